//! The paged KV block manager: a pool of physical cache blocks of [`BLOCK_SIZE`]
//! tokens, shared by the target layers and the MTP layers (each layer has its own
//! latent cache indexed by the same block ids, so one table serves all).
//!
//! Every block has a reference count: the block tables that hold it. With prefix
//! caching ([`crate::prefix`]) a full block whose entries are final can be held by
//! several tables, and an unreferenced one stays cached (evictable) until the pool
//! needs it; without, a block belongs to one table or to the free list. The manager
//! never hands out more blocks than it has (`ensure` fails instead), and
//! [`BlockManager::check`] verifies the accounting in tests.

use crate::prefix::{extend_chain, PrefixCache, PrefixStats, ROOT};
use mlaserve_core::{ModelConfig, BLOCK_SIZE};

/// Cache positions per block.
pub const BLOCK_POSITIONS: usize = BLOCK_SIZE;

/// Blocks needed to hold `positions` cache positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK_SIZE)
}

/// Bytes of one cache block over every layer that caches (target and MTP layers), with
/// `dtype_bytes` per latent value (4 for the f32 CPU backend, 2 for bf16).
pub fn kv_block_bytes(cfg: &ModelConfig, dtype_bytes: usize) -> usize {
    BLOCK_SIZE * (cfg.num_hidden_layers + cfg.num_nextn_predict_layers) * cfg.latent_dim() * dtype_bytes
}

/// How many blocks a cache budget of `bytes` holds (capacity from configuration).
pub fn blocks_for_bytes(cfg: &ModelConfig, dtype_bytes: usize, bytes: usize) -> usize {
    bytes / kv_block_bytes(cfg, dtype_bytes).max(1)
}

/// The pool of physical blocks (see the module docs).
#[derive(Debug, Clone)]
pub struct BlockManager {
    /// Unreferenced blocks that hold nothing cached.
    free: Vec<u32>,
    total: usize,
    refs: Vec<u32>,
    prefix: Option<PrefixCache>,
    /// Tests: match only blocks with complete MTP entries.
    pub(crate) complete_only: bool,
    /// Whether admissions may map target-only blocks (the engine's choice per step).
    pub(crate) target_only_hits: bool,
}

impl BlockManager {
    /// A pool of `total` blocks, ids `0..total`, all free, without prefix caching.
    pub fn new(total: usize) -> Self {
        // Pop order hands out low ids first; it only matters for readable traces.
        let free = (0..total as u32).rev().collect();
        BlockManager { free, total, refs: vec![0; total], prefix: None, complete_only: false, target_only_hits: true }
    }

    /// A pool that caches full blocks by prefix, each keyed with the `lookahead`
    /// tokens after it (the MTP layers drafted with; see [`crate::prefix`]).
    pub fn with_prefix_caching(total: usize, lookahead: usize) -> Self {
        BlockManager { prefix: Some(PrefixCache::new(total, lookahead)), ..Self::new(total) }
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix.is_some()
    }

    /// Turns prefix caching off until [`BlockManager::resume_prefix`]: no lookup, no
    /// registration, blocks only from the free list (the engine's start-up calibration,
    /// whose throwaway requests must leave nothing cached).
    pub(crate) fn suspend_prefix(&mut self) -> Option<PrefixCache> {
        self.prefix.take()
    }

    /// Turns back on what [`BlockManager::suspend_prefix`] turned off.
    pub(crate) fn resume_prefix(&mut self, prefix: Option<PrefixCache>) {
        debug_assert!(self.prefix.is_none(), "prefix caching resumed twice");
        self.prefix = prefix;
    }

    /// The tokens after a block that its cache identity includes; `None` without
    /// prefix caching.
    pub fn lookahead(&self) -> Option<usize> {
        self.prefix.as_ref().map(|p| p.lookahead())
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// Blocks a table can get: the free ones and the unreferenced cached ones.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.prefix.as_ref().map_or(0, |p| p.evictable())
    }

    /// Prefix cache counters (zero without prefix caching).
    pub fn prefix_stats(&self) -> PrefixStats {
        self.prefix
            .as_ref()
            .map_or(PrefixStats::default(), |p| PrefixStats { cached_blocks: p.cached_blocks(), ..p.stats })
    }

    fn take(&mut self) -> Option<u32> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => self.prefix.as_mut()?.evict()?,
        };
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Grows `table` so that it covers `positions` positions. Returns false (and
    /// changes nothing) when the pool does not have enough free blocks.
    pub fn ensure(&mut self, table: &mut Vec<u32>, positions: usize) -> bool {
        let need = blocks_for(positions).saturating_sub(table.len());
        if need > self.num_free() {
            return false;
        }
        for _ in 0..need {
            match self.take() {
                Some(b) => table.push(b),
                None => unreachable!("num_free counted the blocks"),
            }
        }
        true
    }

    /// Blocks still missing for `table` to cover `positions`.
    pub fn missing(table: &[u32], positions: usize) -> usize {
        blocks_for(positions).saturating_sub(table.len())
    }

    /// Drops `table`'s reference to each of its blocks and empties it. A block no table
    /// holds any more returns to the free list, or, cached, to the LRU list — the
    /// table's last blocks first, so a prefix's first blocks are evicted last.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        for b in table.drain(..).rev() {
            let r = &mut self.refs[b as usize];
            debug_assert!(*r > 0, "block {b} released more often than taken");
            *r -= 1;
            if *r == 0 {
                match &mut self.prefix {
                    Some(p) if p.is_cached(b) => p.park(b),
                    _ => self.free.push(b),
                }
            }
        }
    }

    /// Maps the longest cached prefix of `tokens` (whole blocks, ending before the last
    /// token and before the last `lookahead` ones) onto the empty `table`: blocks with
    /// complete MTP entries as far as they go, then target-only ones (unless
    /// `target_only_hits` is off). Returns the blocks mapped and, when some are
    /// target-only, the index of the first.
    /// `chain` is the tokens' chained block hash, grown as needed.
    pub fn match_prefix(
        &mut self,
        tokens: &[u32],
        chain: &mut Vec<u64>,
        table: &mut Vec<u32>,
    ) -> (usize, Option<usize>) {
        debug_assert!(table.is_empty());
        let complete_only = self.complete_only || !self.target_only_hits;
        let Some(p) = &mut self.prefix else { return (0, None) };
        let usable = tokens.len().saturating_sub(p.lookahead().max(1)) / BLOCK_SIZE;
        extend_chain(chain, tokens, usable);
        let (mut parent, mut partial) = (ROOT, None);
        for i in 0..usable {
            let found = match partial {
                None => p.find(tokens, chain, i, parent, true).or_else(|| {
                    let b = if complete_only { None } else { p.find(tokens, chain, i, parent, false) };
                    partial = b.map(|_| i);
                    b
                }),
                Some(_) => p.find(tokens, chain, i, parent, false),
            };
            let Some(b) = found else { break };
            let r = &mut self.refs[b as usize];
            if *r == 0 {
                p.unpark(b);
            }
            *r += 1;
            table.push(b);
            parent = b;
        }
        p.stats.queried_tokens += tokens.len() as u64;
        p.stats.hit_tokens += (table.len() * BLOCK_SIZE) as u64;
        (table.len(), partial)
    }

    /// Undoes the counting of a [`BlockManager::match_prefix`] whose request was not
    /// admitted after all (its blocks go back with [`BlockManager::release`]).
    pub fn unmatch(&mut self, tokens: usize, blocks: usize) {
        if let Some(p) = &mut self.prefix {
            p.stats.queried_tokens -= tokens as u64;
            p.stats.hit_tokens -= (blocks * BLOCK_SIZE) as u64;
        }
    }

    /// Indexes `table`'s blocks `from..to` (their target entries are final; their MTP
    /// entries too in the blocks before `complete_to`) and returns how many leading
    /// blocks of `table` are cached now: `to`, or fewer where another block already
    /// holds the same content (the rest of the table stays private).
    pub fn register(
        &mut self,
        table: &[u32],
        tokens: &[u32],
        chain: &mut Vec<u64>,
        (from, to): (usize, usize),
        complete_to: usize,
    ) -> usize {
        let Some(p) = &mut self.prefix else { return from };
        extend_chain(chain, tokens, to);
        for i in from..to {
            let parent = if i == 0 { ROOT } else { table[i - 1] };
            if !p.insert(table[i], tokens, chain, i, parent, i < complete_to) {
                return i;
            }
        }
        to
    }

    /// Checks the accounting: the reference counts are the tables' holdings (no table
    /// holds a block twice), every unreferenced block is free or cached (once), and the
    /// prefix index agrees with both.
    pub fn check<'a>(&self, tables: impl IntoIterator<Item = &'a [u32]>) -> Result<(), String> {
        let mut refs = vec![0u32; self.total];
        for t in tables {
            let mut mine = std::collections::HashSet::new();
            for &b in t {
                let r = refs.get_mut(b as usize).ok_or_else(|| format!("block {b} out of range"))?;
                if !mine.insert(b) {
                    return Err(format!("block {b} twice in one table"));
                }
                *r += 1;
            }
        }
        if refs != self.refs {
            let b = (0..self.total).find(|&b| refs[b] != self.refs[b]).unwrap_or(0);
            return Err(format!("block {b}: {} references counted, tables hold {}", self.refs[b], refs[b]));
        }
        let mut free = vec![false; self.total];
        for &b in &self.free {
            let slot = free.get_mut(b as usize).ok_or_else(|| format!("free block {b} out of range"))?;
            if std::mem::replace(slot, true) {
                return Err(format!("block {b} twice in the free list"));
            }
        }
        for b in 0..self.total {
            let cached = self.prefix.as_ref().is_some_and(|p| p.is_cached(b as u32));
            let held = refs[b] > 0;
            if free[b] && (held || cached) {
                return Err(format!("block {b} free but referenced ({}) or cached ({cached})", refs[b]));
            }
            if !free[b] && !held && !cached {
                return Err(format!("block {b} leaked: neither free, referenced nor cached"));
            }
        }
        match &self.prefix {
            Some(p) => p.check(&self.refs),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ensure_and_release() {
        let mut m = BlockManager::new(4);
        let mut a = Vec::new();
        let mut b = Vec::new();
        assert!(m.ensure(&mut a, 65));
        assert_eq!(a.len(), 2);
        assert!(m.ensure(&mut a, 128));
        assert_eq!(a.len(), 2);
        assert!(!m.ensure(&mut b, 3 * 64));
        assert!(b.is_empty());
        assert!(m.ensure(&mut b, 2 * 64));
        assert_eq!(m.num_free(), 0);
        m.check([a.as_slice(), b.as_slice()]).expect("partition");
        m.release(&mut a);
        assert_eq!(m.num_free(), 2);
        assert!(m.check([b.as_slice()]).is_ok());
        assert!(m.check(std::iter::empty::<&[u32]>()).is_err());
    }

    /// Registered blocks are shared by a later request with the same prefix, survive
    /// their owner, and are evicted last-block-first only when the pool runs out.
    #[test]
    fn cached_blocks_are_shared_kept_and_evicted_in_order() {
        let mut m = BlockManager::with_prefix_caching(4, 1);
        let toks: Vec<u32> = (0..3 * BLOCK_SIZE as u32).collect();
        let (mut ca, mut cb) = (Vec::new(), Vec::new());
        let mut a = Vec::new();
        assert!(m.ensure(&mut a, toks.len()));
        assert_eq!(m.register(&a, &toks, &mut ca, (0, 2), 1), 2);
        let mut b = Vec::new();
        assert_eq!(m.match_prefix(&toks, &mut cb, &mut b), (2, Some(1)), "two blocks, the second target-only");
        assert_eq!(b, a[..2]);
        m.check([a.as_slice(), b.as_slice()]).expect("shared");
        m.release(&mut a);
        m.release(&mut b);
        assert_eq!(m.num_free(), 4);
        m.check(std::iter::empty::<&[u32]>()).expect("cached, unreferenced");
        // A shorter request shares the first block only (the second needs one more
        // token after it).
        let mut c = Vec::new();
        assert_eq!(m.match_prefix(&toks[..2 * BLOCK_SIZE], &mut Vec::new(), &mut c), (1, None));
        // Two free blocks, then the cached second block goes before the held first one.
        let mut d = Vec::new();
        assert!(m.ensure(&mut d, 3 * BLOCK_SIZE));
        assert_eq!(m.prefix_stats().evictions, 1);
        assert!(!m.ensure(&mut d, 4 * BLOCK_SIZE), "the held block is never evicted");
        m.check([c.as_slice(), d.as_slice()]).expect("after eviction");
        let s = m.prefix_stats();
        assert_eq!((s.cached_blocks, s.hit_tokens), (1, 3 * BLOCK_SIZE as u64));
    }
}
