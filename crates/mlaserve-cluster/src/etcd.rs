//! A minimal etcd v3 client over tonic: prefix listing, put with a lease, prefix watch,
//! lease grant / keep-alive / revoke — what discovery and group registration need, on
//! the generated `mlaserve_proto::etcd` stubs (no system protoc, no extra crate).

use mlaserve_proto::etcd::{self as pb, kv_client::KvClient, lease_client::LeaseClient, watch_client::WatchClient};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

/// HTTP/2 keep-alive towards etcd. etcd answers pings more frequent than its
/// `--grpc-keepalive-min-time` (5 s by default), or any ping on a connection without an
/// open stream, with GOAWAY "too_many_pings" and closes the connection, which breaks
/// every watch and lease stream on it. So: a ping every 10 s, only while a stream (a
/// watch, a lease keep-alive) is open; a dead or hung etcd is noticed within 15 s.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors talking to etcd.
#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("etcd endpoint {0}: {1}")]
    Connect(String, String),
    #[error("etcd: {0}")]
    Rpc(#[from] tonic::Status),
    #[error("etcd: {0}")]
    Protocol(String),
}

/// A connected etcd client (cheap to clone).
#[derive(Debug, Clone)]
pub struct Etcd {
    channel: Channel,
}

/// One change under a watched prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    Put { key: Vec<u8>, value: Vec<u8> },
    Delete { key: Vec<u8> },
}

/// The end of the key range that holds every key starting with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0] // every key
}

impl Etcd {
    /// Connects to the first reachable endpoint (`host:port` or `http://host:port`).
    pub async fn connect(endpoints: &[String]) -> Result<Etcd, EtcdError> {
        let mut last = EtcdError::Protocol("no etcd endpoint given".into());
        for ep in endpoints {
            let url = if ep.contains("://") { ep.clone() } else { format!("http://{ep}") };
            let endpoint = match Endpoint::from_shared(url.clone()) {
                Ok(e) => e
                    .connect_timeout(Duration::from_secs(2))
                    .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
                    .keep_alive_timeout(KEEPALIVE_TIMEOUT)
                    .keep_alive_while_idle(false),
                Err(e) => {
                    last = EtcdError::Connect(url, e.to_string());
                    continue;
                }
            };
            match endpoint.connect().await {
                Ok(channel) => return Ok(Etcd { channel }),
                Err(e) => last = EtcdError::Connect(url, e.to_string()),
            }
        }
        Err(last)
    }

    /// Every key/value under `prefix`, and the store revision they were read at.
    pub async fn list(&self, prefix: &[u8]) -> Result<(Vec<(Vec<u8>, Vec<u8>)>, i64), EtcdError> {
        let resp = KvClient::new(self.channel.clone())
            .range(pb::RangeRequest { key: prefix.to_vec(), range_end: prefix_end(prefix), ..Default::default() })
            .await?
            .into_inner();
        let rev = resp.header.map(|h| h.revision).unwrap_or(0);
        Ok((resp.kvs.into_iter().map(|kv| (kv.key, kv.value)).collect(), rev))
    }

    /// Puts `key` = `value`, attached to `lease` (0: none).
    pub async fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<(), EtcdError> {
        KvClient::new(self.channel.clone())
            .put(pb::PutRequest { key: key.to_vec(), value: value.to_vec(), lease, prev_kv: false })
            .await?;
        Ok(())
    }

    /// Deletes `key`.
    pub async fn delete(&self, key: &[u8]) -> Result<(), EtcdError> {
        KvClient::new(self.channel.clone())
            .delete_range(pb::DeleteRangeRequest { key: key.to_vec(), ..Default::default() })
            .await?;
        Ok(())
    }

    /// Grants a lease of `ttl` seconds; returns its id.
    pub async fn grant(&self, ttl: i64) -> Result<i64, EtcdError> {
        let r = LeaseClient::new(self.channel.clone())
            .lease_grant(pb::LeaseGrantRequest { ttl, id: 0 })
            .await?
            .into_inner();
        if !r.error.is_empty() {
            return Err(EtcdError::Protocol(format!("lease grant: {}", r.error)));
        }
        Ok(r.id)
    }

    /// Revokes a lease: its keys are deleted at once.
    pub async fn revoke(&self, lease: i64) -> Result<(), EtcdError> {
        LeaseClient::new(self.channel.clone()).lease_revoke(pb::LeaseRevokeRequest { id: lease }).await?;
        Ok(())
    }

    /// Opens a keep-alive stream for `lease` and refreshes it once; returns the stream
    /// and the lease's remaining TTL (0: the lease is gone).
    pub async fn keep_alive(&self, lease: i64) -> Result<(KeepAlive, i64), EtcdError> {
        let (tx, rx) = mpsc::channel(4);
        // etcd answers the call only once the first request arrives: queue it first.
        tx.send(pb::LeaseKeepAliveRequest { id: lease })
            .await
            .map_err(|_| EtcdError::Protocol("keep-alive channel closed".into()))?;
        let stream =
            LeaseClient::new(self.channel.clone()).lease_keep_alive(ReceiverStream::new(rx)).await?.into_inner();
        let mut k = KeepAlive { lease, tx, stream };
        let ttl = k.next_ttl().await?;
        Ok((k, ttl))
    }

    /// Watches `prefix` from `start_revision`; changes arrive on the returned channel,
    /// which closes when the watch breaks (then list and watch again).
    pub async fn watch(&self, prefix: &[u8], start_revision: i64) -> Result<mpsc::Receiver<Vec<Change>>, EtcdError> {
        let (req_tx, req_rx) = mpsc::channel(1);
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(pb::WatchCreateRequest {
                key: prefix.to_vec(),
                range_end: prefix_end(prefix),
                start_revision,
                ..Default::default()
            })),
        };
        req_tx.send(create).await.map_err(|_| EtcdError::Protocol("watch request channel closed".into()))?;
        let mut stream = WatchClient::new(self.channel.clone()).watch(ReceiverStream::new(req_rx)).await?.into_inner();
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            // Keep the request side open for as long as we watch.
            let _req_tx = req_tx;
            while let Some(Ok(resp)) = stream.next().await {
                if resp.canceled {
                    tracing::warn!(reason = %resp.cancel_reason, "etcd cancelled the watch");
                    return;
                }
                let changes: Vec<Change> = resp
                    .events
                    .into_iter()
                    .filter_map(|ev| {
                        let kv = ev.kv?;
                        Some(if ev.r#type == pb::event::EventType::Delete as i32 {
                            Change::Delete { key: kv.key }
                        } else {
                            Change::Put { key: kv.key, value: kv.value }
                        })
                    })
                    .collect();
                if !changes.is_empty() && tx.send(changes).await.is_err() {
                    return;
                }
            }
        });
        Ok(rx)
    }
}

/// A lease keep-alive stream.
#[derive(Debug)]
pub struct KeepAlive {
    lease: i64,
    tx: mpsc::Sender<pb::LeaseKeepAliveRequest>,
    stream: tonic::Streaming<pb::LeaseKeepAliveResponse>,
}

impl KeepAlive {
    /// Refreshes the lease; returns its remaining TTL (0: the lease is gone).
    pub async fn refresh(&mut self) -> Result<i64, EtcdError> {
        self.tx
            .send(pb::LeaseKeepAliveRequest { id: self.lease })
            .await
            .map_err(|_| EtcdError::Protocol("keep-alive stream closed".into()))?;
        self.next_ttl().await
    }

    async fn next_ttl(&mut self) -> Result<i64, EtcdError> {
        match self.stream.next().await {
            Some(Ok(r)) => Ok(r.ttl),
            Some(Err(s)) => Err(s.into()),
            None => Err(EtcdError::Protocol("keep-alive stream ended".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_ranges() {
        assert_eq!(prefix_end(b"/a/"), b"/a0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b""), vec![0]);
    }
}
