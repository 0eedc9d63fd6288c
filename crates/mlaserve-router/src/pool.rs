//! The set of worker groups this router can use, kept by one supervisor task per
//! group: connect, serve the session, and on failure mark the group down and reconnect
//! with backoff until discovery removes it.
//!
//! Picking a group: among the ready groups that take work, the one the pool's
//! [`Balancer`] names (`crate::balance`: prefix affinity within a load bound, or the
//! fewest outstanding tokens). A group that reports it is draining is never picked,
//! though it stays in the pool until its session ends (its requests are still
//! streaming).
//!
//! A group must serve this router's model ([`ModelIdentity`]): one whose `GetInfo`
//! differs (config or tokenizer fingerprint, vocabulary, EOS ids) is logged and kept out
//! of the pool; its supervisor looks again every few seconds, in case it is replaced.

use crate::balance::{Balancer, Candidate, LeastLoaded, Reason};
use crate::group::{Group, Link};
use mlaserve_proto::worker::GroupInfo;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{oneshot, watch};

struct Entry {
    addr: String,
    ready: Option<Arc<Group>>,
    stop: Option<oneshot::Sender<()>>,
}

/// What a group must serve to join this router's pool: the router's own model.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ModelIdentity {
    pub vocab_size: u32,
    pub eos_token_ids: Vec<u32>,
    pub config_fingerprint: String,
    pub tokenizer_fingerprint: String,
}

impl ModelIdentity {
    /// `Err` naming every field in which the group's model differs from this one.
    pub fn check(&self, info: &GroupInfo) -> Result<(), String> {
        let mut diff = Vec::new();
        if info.config_fingerprint != self.config_fingerprint {
            diff.push(format!(
                "config.json fingerprint {:?} (the router's: {:?})",
                info.config_fingerprint, self.config_fingerprint
            ));
        }
        if info.tokenizer_fingerprint != self.tokenizer_fingerprint {
            diff.push(format!(
                "tokenizer.json fingerprint {:?} (the router's: {:?})",
                info.tokenizer_fingerprint, self.tokenizer_fingerprint
            ));
        }
        if info.vocab_size != self.vocab_size {
            diff.push(format!("vocab_size {} (the router's: {})", info.vocab_size, self.vocab_size));
        }
        if info.eos_token_ids != self.eos_token_ids {
            diff.push(format!("eos_token_ids {:?} (the router's: {:?})", info.eos_token_ids, self.eos_token_ids));
        }
        if diff.is_empty() {
            Ok(())
        } else {
            Err(format!("serves model `{}`, not this router's: {}", info.model_name, diff.join("; ")))
        }
    }
}

/// How long a supervisor waits before asking a refused group again.
const MISMATCH_RETRY: Duration = Duration::from_secs(5);

/// Worker groups known to the router (see the module docs).
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Mutex<BTreeMap<String, Entry>>>,
    ready_tx: Arc<watch::Sender<usize>>,
    /// The model every group must serve; `None` takes any (tests of the pool alone).
    expect: Option<Arc<ModelIdentity>>,
    link: Arc<Link>,
    balancer: Arc<dyn Balancer>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("ready", &*self.ready_tx.borrow()).finish()
    }
}

impl Default for Pool {
    fn default() -> Self {
        Pool {
            inner: Arc::default(),
            ready_tx: Arc::new(watch::channel(0).0),
            expect: None,
            link: Arc::default(),
            balancer: Arc::new(LeastLoaded),
        }
    }
}

impl Pool {
    /// A pool that admits only groups serving `model`.
    pub fn expecting(model: ModelIdentity) -> Self {
        Pool { expect: Some(Arc::new(model)), ..Pool::default() }
    }

    /// The same pool choosing groups by `balancer` (the least loaded by default).
    pub fn with_balancer(self, balancer: Box<dyn Balancer>) -> Self {
        Pool { balancer: Arc::from(balancer), ..self }
    }

    /// The same pool reaching its groups over `link` (TLS, group secret).
    pub fn with_link(self, link: Link) -> Self {
        Pool { link: Arc::new(link), ..self }
    }

    /// Number of ready groups, as a watch (health follows it).
    pub fn ready_watch(&self) -> watch::Receiver<usize> {
        self.ready_tx.subscribe()
    }

    pub fn ready_count(&self) -> usize {
        *self.ready_tx.borrow()
    }

    /// The ready groups now.
    pub fn ready_groups(&self) -> Vec<Arc<Group>> {
        lock(&self.inner).values().filter_map(|e| e.ready.clone()).filter(|g| g.is_alive()).collect()
    }

    /// The ready group not in `exclude` that takes work (not draining) the balancer
    /// picks for a request with `prompt`, and why; the balancer learns where it went.
    pub fn pick(&self, exclude: &[String], prompt: &[u32]) -> Option<(Arc<Group>, Reason)> {
        let groups: Vec<Arc<Group>> =
            self.ready_groups().into_iter().filter(|g| g.accepts_work() && !exclude.contains(&g.name)).collect();
        if groups.is_empty() {
            return None;
        }
        let loads: Vec<(u64, usize, u32)> =
            groups.iter().map(|g| (g.score(), g.inflight(), g.load().kv_blocks_total)).collect();
        let candidates: Vec<Candidate<'_>> = groups
            .iter()
            .zip(&loads)
            .map(|(g, &(outstanding, inflight, kv_blocks))| Candidate {
                name: &g.name,
                outstanding,
                inflight,
                kv_blocks,
            })
            .collect();
        let (i, why) = self.balancer.pick(prompt, &candidates);
        let i = i.min(groups.len() - 1);
        self.balancer.routed(prompt, &groups[i].name, loads[i].2);
        metrics::counter!("mlaserve_router_routed_total", "group" => groups[i].name.clone(), "reason" => why.label())
            .increment(1);
        Some((groups[i].clone(), why))
    }

    /// Adds (or re-points) group `name` at `addr`; a supervisor keeps it connected.
    pub fn upsert(&self, name: &str, addr: &str) {
        let mut inner = lock(&self.inner);
        if inner.get(name).is_some_and(|e| e.addr == addr) {
            return;
        }
        if let Some(old) = inner.remove(name) {
            shut(old, "the group moved to another address");
        }
        let (stop_tx, stop_rx) = oneshot::channel();
        inner.insert(name.to_string(), Entry { addr: addr.to_string(), ready: None, stop: Some(stop_tx) });
        tokio::spawn(supervise(self.clone(), name.to_string(), addr.to_string(), stop_rx));
        tracing::info!(group = name, addr, "worker group added");
    }

    /// Forgets group `name` (discovery dropped it): its in-flight requests end as lost.
    pub fn remove(&self, name: &str) {
        self.remove_because(name, "the group was removed from discovery");
    }

    /// Forgets group `name`; its in-flight requests end as lost, told `why`.
    pub fn remove_because(&self, name: &str, why: &str) {
        let old = lock(&self.inner).remove(name);
        self.balancer.forget(name);
        if let Some(old) = old {
            tracing::warn!(group = name, reason = why, "worker group removed");
            shut(old, why);
        }
        self.publish();
    }

    /// Names of all known groups (ready or not).
    pub fn names(&self) -> Vec<String> {
        lock(&self.inner).keys().cloned().collect()
    }

    fn set_ready(&self, name: &str, addr: &str, g: Option<Arc<Group>>) -> bool {
        let mut inner = lock(&self.inner);
        let Some(e) = inner.get_mut(name).filter(|e| e.addr == addr) else { return false };
        e.ready = g;
        drop(inner);
        self.publish();
        true
    }

    fn publish(&self) {
        let n = self.ready_groups().len();
        // The gauge first: whoever the watch wakes already reads the same count there.
        crate::metrics::ready_groups(n);
        self.ready_tx.send_if_modified(|v| std::mem::replace(v, n) != n);
    }
}

fn shut(e: Entry, why: &str) {
    // Fail the requests first, so they hear `why` rather than the supervisor's reason.
    if let Some(g) = e.ready {
        g.fail_all(why);
    }
    if let Some(stop) = e.stop {
        let _ = stop.send(());
    }
}

/// Keeps one group connected until told to stop.
async fn supervise(pool: Pool, name: String, addr: String, mut stop: oneshot::Receiver<()>) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let attempt = tokio::select! {
            _ = &mut stop => return,
            r = Group::connect(&name, &addr, &pool.link) => r,
        };
        match attempt {
            Ok((group, session)) if pool.expect.as_ref().is_some_and(|m| m.check(&group.info).is_err()) => {
                let why = pool.expect.as_ref().and_then(|m| m.check(&group.info).err()).unwrap_or_default();
                tracing::error!(group = %name, addr = %addr, "worker group refused: it {why}");
                session.abort();
                group.fail_all("the group serves another model");
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(MISMATCH_RETRY) => {}
                }
                continue;
            }
            Ok((group, mut session)) => {
                backoff = Duration::from_millis(100);
                if !pool.set_ready(&name, &addr, Some(group.clone())) {
                    group.fail_all("the group was removed from discovery");
                    session.abort();
                    return;
                }
                tracing::info!(group = %name, addr = %addr, "worker group ready");
                let why = tokio::select! {
                    _ = &mut stop => {
                        // `shut` has failed its requests with the reason.
                        session.abort();
                        group.fail_all("the group left the router's pool");
                        return;
                    }
                    r = &mut session => r.unwrap_or_else(|e| format!("session task: {e}")),
                };
                group.fail_all(&why);
                tracing::warn!(group = %name, reason = %why, "worker group down");
                if !pool.set_ready(&name, &addr, None) {
                    return;
                }
            }
            Err(e) if refused_us(&e) => {
                // Not a transient fault: the group's TLS or secret does not take ours.
                tracing::error!(group = %name, addr = %addr, error = %e, "worker group refused this router");
                tokio::select! {
                    _ = &mut stop => return,
                    _ = tokio::time::sleep(MISMATCH_RETRY) => {}
                }
                continue;
            }
            Err(e) => tracing::debug!(group = %name, error = %e, "worker group not reachable"),
        }
        tokio::select! {
            _ = &mut stop => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Whether a failed connect means the group does not accept this router (credentials,
/// certificates) rather than that it is down.
fn refused_us(e: &str) -> bool {
    e.starts_with(crate::group::REFUSED)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_different_model_is_named_field_by_field() {
        let me = ModelIdentity {
            vocab_size: 100,
            eos_token_ids: vec![1],
            config_fingerprint: "aa".into(),
            tokenizer_fingerprint: "bb".into(),
        };
        let same = GroupInfo {
            vocab_size: 100,
            eos_token_ids: vec![1],
            config_fingerprint: "aa".into(),
            tokenizer_fingerprint: "bb".into(),
            ..Default::default()
        };
        assert_eq!(me.check(&same), Ok(()));
        let other = GroupInfo { vocab_size: 90, config_fingerprint: "cc".into(), model_name: "m2".into(), ..same };
        let e = me.check(&other).expect_err("refused");
        assert!(e.contains("`m2`") && e.contains("config.json") && e.contains("vocab_size 90"), "{e}");
        assert!(!e.contains("tokenizer.json") && !e.contains("eos"), "{e}");
    }
}
