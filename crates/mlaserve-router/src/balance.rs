//! Which ready group a request goes to: a [`Balancer`] policy, chosen by
//! `--routing-policy`.
//!
//! - [`LeastLoaded`]: the group with the fewest outstanding tokens (prompt tokens not
//!   yet prefilled plus new tokens still allowed), ties broken by fewer in-flight
//!   requests. Tokens, not requests, because one 8k-token prompt costs more than fifty
//!   short chats.
//! - [`PrefixAffinity`] (the default): the group most likely to hold the request's
//!   prompt prefix in its prefix cache — the one this router last sent the longest
//!   matching prefix to — unless that group is overloaded: its outstanding tokens
//!   exceed twice the least loaded group's plus `--affinity-slack-tokens`. Otherwise,
//!   and when no group has seen any of the prefix, the least loaded group. The router
//!   keeps, per group, the chained hashes of the 64-token blocks of the prompts it sent
//!   there (least recently used forgotten first, at most as many as the group has KV
//!   blocks): an approximation of the group's cache, as SGLang's router keeps a radix
//!   tree per worker. It never changes a request's output, only where it runs.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// Tokens per block, as the engine's cache blocks.
const BLOCK: usize = 64;

/// A group a request may go to, as a policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate<'a> {
    pub name: &'a str,
    /// Outstanding tokens (the larger of the router's count and the group's report).
    pub outstanding: u64,
    pub inflight: usize,
    /// The group's KV cache blocks (0 before its first report).
    pub kv_blocks: u32,
}

/// Why a group was chosen (the `reason` label of `mlaserve_router_routed_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The least loaded group.
    LeastLoaded,
    /// The group holding the longest prefix of the prompt.
    Affinity,
    /// The group holding the prefix was overloaded: the least loaded one instead.
    Overloaded,
}

impl Reason {
    pub fn label(self) -> &'static str {
        match self {
            Reason::LeastLoaded => "least_loaded",
            Reason::Affinity => "affinity",
            Reason::Overloaded => "overloaded",
        }
    }
}

/// A routing policy (see the module docs).
pub trait Balancer: Send + Sync + std::fmt::Debug {
    /// The index in `candidates` (never empty) of the group for a request whose prompt
    /// is `prompt`, and why.
    fn pick(&self, prompt: &[u32], candidates: &[Candidate<'_>]) -> (usize, Reason);
    /// The request went to group `group` (a policy may learn from it).
    fn routed(&self, _prompt: &[u32], _group: &str, _kv_blocks: u32) {}
    /// Group `group` left the pool.
    fn forget(&self, _group: &str) {}
}

/// `--routing-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum RoutingPolicy {
    LeastLoaded,
    #[default]
    PrefixAffinity,
}

/// The balancer `policy` names.
pub fn balancer(policy: RoutingPolicy, slack_tokens: u64) -> Box<dyn Balancer> {
    match policy {
        RoutingPolicy::LeastLoaded => Box::new(LeastLoaded),
        RoutingPolicy::PrefixAffinity => Box::new(PrefixAffinity::new(slack_tokens)),
    }
}

fn least_loaded(candidates: &[Candidate<'_>]) -> usize {
    (0..candidates.len()).min_by_key(|&i| (candidates[i].outstanding, candidates[i].inflight)).unwrap_or(0)
}

/// The least loaded group (see the module docs).
#[derive(Debug, Default)]
pub struct LeastLoaded;

impl Balancer for LeastLoaded {
    fn pick(&self, _prompt: &[u32], candidates: &[Candidate<'_>]) -> (usize, Reason) {
        (least_loaded(candidates), Reason::LeastLoaded)
    }
}

/// Chained hashes of the prompt's full blocks.
fn block_hashes(prompt: &[u32]) -> Vec<u64> {
    use std::hash::{Hash, Hasher};
    let mut h = 0u64;
    prompt
        .chunks_exact(BLOCK)
        .map(|b| {
            let mut s = std::collections::hash_map::DefaultHasher::new();
            (h, b).hash(&mut s);
            h = s.finish();
            h
        })
        .collect()
}

/// What the router sent one group: block hashes by last use.
#[derive(Debug, Default)]
struct Seen {
    tick_of: HashMap<u64, u64>,
    by_tick: BTreeMap<u64, u64>,
    tick: u64,
}

impl Seen {
    fn matched(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.tick_of.contains_key(h)).count()
    }

    fn touch(&mut self, hashes: &[u64], capacity: usize) {
        // Last blocks first, so a prefix's first blocks are the most recent.
        for &h in hashes.iter().rev() {
            self.tick += 1;
            if let Some(old) = self.tick_of.insert(h, self.tick) {
                self.by_tick.remove(&old);
            }
            self.by_tick.insert(self.tick, h);
        }
        while self.tick_of.len() > capacity.max(1) {
            let Some((_, h)) = self.by_tick.pop_first() else { break };
            self.tick_of.remove(&h);
        }
    }
}

/// Blocks remembered per group before its first load report.
const DEFAULT_CAPACITY: usize = 1 << 16;

/// The prefix-affinity policy (see the module docs).
#[derive(Debug)]
pub struct PrefixAffinity {
    slack: u64,
    groups: Mutex<HashMap<String, Seen>>,
}

impl PrefixAffinity {
    pub fn new(slack_tokens: u64) -> Self {
        PrefixAffinity { slack: slack_tokens, groups: Mutex::new(HashMap::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Seen>> {
        self.groups.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Balancer for PrefixAffinity {
    fn pick(&self, prompt: &[u32], candidates: &[Candidate<'_>]) -> (usize, Reason) {
        let least = least_loaded(candidates);
        let hashes = block_hashes(prompt);
        let groups = self.lock();
        let matched = |c: &Candidate<'_>| groups.get(c.name).map_or(0, |s| s.matched(&hashes));
        let best = (0..candidates.len()).max_by_key(|&i| {
            let c = &candidates[i];
            // The longest match; among equal ones the least loaded.
            (matched(c), std::cmp::Reverse((c.outstanding, c.inflight)))
        });
        match best {
            Some(i) if matched(&candidates[i]) > 0 => {
                let bound = candidates[least].outstanding.saturating_mul(2).saturating_add(self.slack);
                if candidates[i].outstanding > bound {
                    (least, Reason::Overloaded)
                } else {
                    (i, Reason::Affinity)
                }
            }
            _ => (least, Reason::LeastLoaded),
        }
    }

    fn routed(&self, prompt: &[u32], group: &str, kv_blocks: u32) {
        let capacity = if kv_blocks == 0 { DEFAULT_CAPACITY } else { kv_blocks as usize };
        self.lock().entry(group.to_string()).or_default().touch(&block_hashes(prompt), capacity);
    }

    fn forget(&self, group: &str) {
        self.lock().remove(group);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(name: &str, outstanding: u64) -> Candidate<'_> {
        Candidate { name, outstanding, inflight: 0, kv_blocks: 100 }
    }

    fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
        (0..(blocks * BLOCK) as u32).map(|i| seed * 1_000_003 + i).collect()
    }

    #[test]
    fn least_loaded_takes_the_fewest_outstanding_tokens() {
        let c = [cand("a", 30), cand("b", 10), cand("c", 20)];
        assert_eq!(LeastLoaded.pick(&[1, 2, 3], &c), (1, Reason::LeastLoaded));
    }

    #[test]
    fn affinity_follows_the_longest_prefix_within_the_bound() {
        let b = PrefixAffinity::new(1000);
        let c = [cand("a", 500), cand("b", 0)];
        let sys = prompt(1, 4);
        // Nothing seen: the least loaded.
        assert_eq!(b.pick(&sys, &c), (1, Reason::LeastLoaded));
        b.routed(&sys, "a", 100);
        let mut turn = sys.clone();
        turn.extend(prompt(2, 1));
        assert_eq!(b.pick(&turn, &c), (0, Reason::Affinity), "a holds the prefix, within 2 × 0 + 1000");
        // The longer match wins over a shorter one.
        b.routed(&turn, "b", 100);
        let mut next = turn.clone();
        next.extend(prompt(3, 1));
        assert_eq!(b.pick(&next, &c), (1, Reason::Affinity));
        // Overloaded beyond the bound: the least loaded instead.
        let c = [cand("a", 2000), cand("b", 500)];
        b.forget("b");
        assert_eq!(b.pick(&turn, &c), (0, Reason::Affinity), "2000 <= 2 × 500 + 1000");
        let c = [cand("a", 2001), cand("b", 500)];
        assert_eq!(b.pick(&turn, &c), (1, Reason::Overloaded));
        // A prompt shorter than a block matches nothing.
        assert_eq!(b.pick(&sys[..10], &c), (1, Reason::LeastLoaded));
    }

    #[test]
    fn a_group_forgets_its_least_recently_sent_blocks_first() {
        let b = PrefixAffinity::new(0);
        let c = [cand("a", 0), cand("b", 0)];
        b.routed(&prompt(1, 2), "a", 3);
        b.routed(&prompt(2, 2), "a", 3);
        // Capacity 3: prompt 1's last block was forgotten, its first kept.
        let groups = b.lock();
        let seen = &groups["a"];
        assert_eq!(seen.matched(&block_hashes(&prompt(2, 2))), 2);
        assert_eq!(seen.matched(&block_hashes(&prompt(1, 2))), 1);
        drop(groups);
        assert_eq!(b.pick(&prompt(1, 2), &c), (0, Reason::Affinity));
    }
}
