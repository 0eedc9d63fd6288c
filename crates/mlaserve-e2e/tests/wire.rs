//! Bytes a client got wrong: a request that does not decode (a wrong wire type, invalid
//! UTF-8 in a string field) is the client's fault — INVALID_ARGUMENT, not INTERNAL — and
//! the server goes on serving.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use std::time::Duration;
use tonic::Code;

/// Field 1 of `GenerateRequest` / `TokenizeRequest` is a string; sent as a varint it is
/// a wrong wire type.
#[derive(Clone, PartialEq, prost::Message)]
struct WrongWireType {
    #[prost(uint64, tag = "1")]
    text: u64,
}

/// The same field as bytes that are not UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct NotUtf8 {
    #[prost(bytes = "vec", tag = "1")]
    text: Vec<u8>,
}

/// Calls `path` with `msg` as its request; returns the status code the call ended with.
async fn code_of<M: prost::Message + Clone + Default + Send + Sync + 'static>(
    addr: std::net::SocketAddr,
    path: &'static str,
    msg: M,
    streaming: bool,
) -> Code {
    let ch = tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.unwrap();
    // The response type is never decoded: every call here fails before any message.
    let codec = tonic_prost::ProstCodec::<M, NotUtf8>::default();
    let path = http::uri::PathAndQuery::from_static(path);
    let r = if streaming {
        match grpc.server_streaming(tonic::Request::new(msg), path, codec).await {
            Ok(resp) => {
                let mut s = resp.into_inner();
                match s.message().await {
                    Err(st) => Err(st),
                    Ok(_) => Ok(()),
                }
            }
            Err(st) => Err(st),
        }
    } else {
        grpc.unary(tonic::Request::new(msg), path, codec).await.map(|_| ())
    };
    r.expect_err("refused").code()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_requests_are_invalid_argument() {
    let s = serve(|_| {});
    let addr = s.get().addr();
    for (path, streaming) in [("/mlaserve.v1.Generation/Generate", true), ("/mlaserve.v1.Generation/Tokenize", false)] {
        assert_eq!(code_of(addr, path, WrongWireType { text: 7 }, streaming).await, Code::InvalidArgument, "{path}");
        let bad = NotUtf8 { text: vec![0x68, 0xff, 0xfe] };
        assert_eq!(code_of(addr, path, bad, streaming).await, Code::InvalidArgument, "{path}");
    }
    // Counted like every other refusal (this test binary's recorder is its own), and the
    // server still serves.
    let text = mlaserve_cluster::metrics::handle().expect("the recorder").render();
    let line = text.lines().find(|l| l.starts_with("mlaserve_requests_total{outcome=\"invalid_argument\"}"));
    assert_eq!(line.and_then(|l| l.rsplit(' ').next()), Some("4"), "{text}");
    let served = tokio::time::timeout(Duration::from_secs(10), async {
        let mut c = client(addr).await;
        collect(&mut c, text_request("def f():", 4)).await
    })
    .await
    .unwrap();
    assert!(served.error.is_none(), "{:?}", served.error);
}
