//! Prefix caching: full cache blocks whose every latent entry (target and MTP layers)
//! is final are indexed by the tokens that produced them, so a later request with the
//! same prefix maps them into its block table instead of prefilling them again.
//!
//! What a block's entries depend on: the target layers' entries at positions `p` of the
//! block depend on the tokens `0..=p`; MTP layer `d`'s entry at `p` pairs the hidden
//! state of `p` with the token `d + 1` ahead, so the block's last MTP entries also
//! depend on the first `lookahead` tokens after it (`lookahead` = the MTP layers the
//! engine drafts with). A block's identity is therefore its prefix (all tokens before
//! its end) plus those `lookahead` tokens.
//!
//! The index is a hash map from a chained hash of that identity to the block, but a
//! hash only finds candidates: a match also compares the block's stored tokens (its
//! own and the lookahead) with the request's, and its stored parent (block id and the
//! parent's generation, bumped at every eviction) with the block matched just before.
//! Matching from the first block on, that proves the whole prefix equal, token for
//! token: nothing is shared between requests that differ anywhere in the prefix, even
//! on a hash collision.
//!
//! A block is indexed as *complete* when its MTP layers' entries are final too, and
//! as target-only when some may not be (a step drafted with fewer MTP layers than the
//! engine uses — adaptive k = 0 on a CPU, say): a request reuses the complete chain as
//! far as it goes, then target-only blocks, whose MTP holes it then has as its own
//! (its drafts are worse; its output is the same) — the latter only while the engine
//! drafts with fewer MTP layers than it uses (`BlockManager::target_only_hits`, set per
//! step): once it drafts with all of them, the prompt is prefilled again and cached
//! complete.
//!
//! Unreferenced cached blocks wait in an LRU list and are evicted (oldest first) only
//! when the pool has no never-cached free block left. A referenced block is never
//! evicted; the engine never writes one it shares (see `Engine::register_prefixes`).

use crate::rng::mix64;
use mlaserve_core::BLOCK_SIZE;
use std::collections::{BTreeMap, HashMap};

const NO_BLOCK: u32 = u32::MAX;

/// Chained hash of full blocks: element `i` covers the tokens of blocks `0..=i`.
/// Grows `chain` to `blocks` elements (it only ever grows: tokens are only appended).
pub(crate) fn extend_chain(chain: &mut Vec<u64>, tokens: &[u32], blocks: usize) {
    while chain.len() < blocks {
        let i = chain.len();
        let mut h = chain.last().copied().unwrap_or(0x6d6c_6173_6572_7665);
        for &t in &tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE] {
            h = mix64(h ^ t as u64);
        }
        chain.push(h);
    }
}

/// The index key of a block: its chained hash, the tokens after it, and whether its
/// MTP entries are complete.
fn key_of(chain: u64, lookahead: &[u32], complete: bool) -> u64 {
    let seed = mix64(chain ^ 0x4c41 ^ ((!complete) as u64) << 40);
    lookahead.iter().fold(seed, |h, &t| mix64(h ^ t as u64))
}

/// Counters of the prefix cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Tokens looked up at admission (each admitted request's tokens).
    pub queried_tokens: u64,
    /// Of those, tokens found in cached blocks (not prefilled).
    pub hit_tokens: u64,
    /// Blocks in the index now (referenced or not).
    pub cached_blocks: usize,
    /// Cached blocks taken back for new content.
    pub evictions: u64,
}

/// The index of cached blocks and their LRU list (see the module docs).
#[derive(Debug, Clone)]
pub(crate) struct PrefixCache {
    lookahead: usize,
    map: HashMap<u64, u32>,
    /// Per block: its key while cached.
    key: Vec<Option<u64>>,
    /// Per block: bumped when it is evicted (its children stop matching).
    gen: Vec<u32>,
    /// Per block: (parent block, parent's generation), `NO_BLOCK` for a first block.
    parent: Vec<(u32, u32)>,
    /// Per block: every MTP layer's entries are final (else only the target's are).
    complete: Vec<bool>,
    /// Per block: its tokens and the `lookahead` tokens after it.
    content: Vec<u32>,
    /// Unreferenced cached blocks by release tick (oldest first).
    lru: BTreeMap<u64, u32>,
    tick_of: Vec<u64>,
    tick: u64,
    pub stats: PrefixStats,
}

impl PrefixCache {
    pub fn new(total: usize, lookahead: usize) -> Self {
        PrefixCache {
            lookahead,
            map: HashMap::new(),
            key: vec![None; total],
            gen: vec![0; total],
            parent: vec![(NO_BLOCK, 0); total],
            complete: vec![false; total],
            content: vec![0; total * (BLOCK_SIZE + lookahead)],
            lru: BTreeMap::new(),
            tick_of: vec![0; total],
            tick: 0,
            stats: PrefixStats::default(),
        }
    }

    /// Tokens after a block that its identity includes.
    pub fn lookahead(&self) -> usize {
        self.lookahead
    }

    /// Unreferenced cached blocks (evictable).
    pub fn evictable(&self) -> usize {
        self.lru.len()
    }

    pub fn is_cached(&self, b: u32) -> bool {
        self.key[b as usize].is_some()
    }

    pub fn cached_blocks(&self) -> usize {
        self.map.len()
    }

    fn content(&self, b: u32) -> &[u32] {
        let n = BLOCK_SIZE + self.lookahead;
        &self.content[b as usize * n..(b as usize + 1) * n]
    }

    /// The cached block holding block `i` of `tokens` after `parent`, with complete
    /// MTP entries or not, if any.
    pub fn find(&self, tokens: &[u32], chain: &[u64], i: usize, parent: u32, complete: bool) -> Option<u32> {
        let (from, to) = (i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE + self.lookahead);
        let k = key_of(chain[i], &tokens[(i + 1) * BLOCK_SIZE..to], complete);
        let &b = self.map.get(&k)?;
        let want_parent = if parent == NO_BLOCK { (NO_BLOCK, 0) } else { (parent, self.gen[parent as usize]) };
        let same = self.parent[b as usize] == want_parent && self.complete[b as usize] == complete;
        (same && self.content(b) == &tokens[from..to]).then_some(b)
    }

    /// A block leaves the LRU list (it is referenced again).
    pub fn unpark(&mut self, b: u32) {
        let t = self.tick_of[b as usize];
        let removed = self.lru.remove(&t);
        debug_assert_eq!(removed, Some(b), "block {b} was parked");
    }

    /// An unreferenced cached block joins the LRU list as its newest entry.
    pub fn park(&mut self, b: u32) {
        self.tick += 1;
        self.tick_of[b as usize] = self.tick;
        self.lru.insert(self.tick, b);
    }

    /// Evicts the least recently used unreferenced block and returns it.
    pub fn evict(&mut self) -> Option<u32> {
        let (_, b) = self.lru.pop_first()?;
        self.forget(b);
        self.stats.evictions += 1;
        Some(b)
    }

    fn forget(&mut self, b: u32) {
        if let Some(k) = self.key[b as usize].take() {
            if self.map.get(&k) == Some(&b) {
                self.map.remove(&k);
            }
        }
        self.gen[b as usize] = self.gen[b as usize].wrapping_add(1);
    }

    /// Indexes block `b`, holding block `i` of `tokens` after `parent`, with complete
    /// MTP entries or not. False when another block already holds that content (`b`
    /// then stays private).
    pub fn insert(&mut self, b: u32, tokens: &[u32], chain: &[u64], i: usize, parent: u32, complete: bool) -> bool {
        let (from, to) = (i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE + self.lookahead);
        let k = key_of(chain[i], &tokens[(i + 1) * BLOCK_SIZE..to], complete);
        if self.map.contains_key(&k) || self.key[b as usize].is_some() {
            return false;
        }
        self.map.insert(k, b);
        self.key[b as usize] = Some(k);
        self.parent[b as usize] = if parent == NO_BLOCK { (NO_BLOCK, 0) } else { (parent, self.gen[parent as usize]) };
        self.complete[b as usize] = complete;
        let n = BLOCK_SIZE + self.lookahead;
        self.content[b as usize * n..(b as usize + 1) * n].copy_from_slice(&tokens[from..to]);
        true
    }

    /// Checks the index against the reference counts: the map and the per-block keys
    /// agree, and the LRU list holds exactly the unreferenced cached blocks, once.
    pub fn check(&self, refs: &[u32]) -> Result<(), String> {
        for (&k, &b) in &self.map {
            if self.key[b as usize] != Some(k) {
                return Err(format!("index entry {k:#x} -> block {b}, whose key is {:?}", self.key[b as usize]));
            }
        }
        let keyed = self.key.iter().filter(|k| k.is_some()).count();
        if keyed != self.map.len() {
            return Err(format!("{keyed} blocks keyed, {} in the index", self.map.len()));
        }
        let mut parked = vec![false; refs.len()];
        for (&t, &b) in &self.lru {
            if std::mem::replace(&mut parked[b as usize], true) || self.tick_of[b as usize] != t {
                return Err(format!("block {b} parked twice or under a stale tick"));
            }
        }
        for (b, (&r, &p)) in refs.iter().zip(&parked).enumerate() {
            let want = r == 0 && self.key[b].is_some();
            if p != want {
                return Err(format!("block {b}: {r} references, cached {}, parked {p}", self.key[b].is_some()));
            }
        }
        Ok(())
    }
}

/// The first-block sentinel for [`PrefixCache::find`] and [`PrefixCache::insert`].
pub(crate) const ROOT: u32 = NO_BLOCK;

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(seed: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| seed.wrapping_mul(7919).wrapping_add(i * 31) % 1000).collect()
    }

    #[test]
    fn a_match_needs_the_same_tokens_lookahead_and_parent() {
        let mut c = PrefixCache::new(8, 2);
        let a = toks(1, 3 * BLOCK_SIZE);
        let mut ch = Vec::new();
        extend_chain(&mut ch, &a, 2);
        assert!(c.insert(5, &a, &ch, 0, ROOT, true));
        assert!(c.insert(6, &a, &ch, 1, 5, false));
        assert!(!c.insert(7, &a, &ch, 1, 5, false), "the same content is indexed once");
        assert_eq!(c.find(&a, &ch, 0, ROOT, true), Some(5));
        assert_eq!(c.find(&a, &ch, 0, ROOT, false), None, "complete and incomplete blocks are told apart");
        assert_eq!(c.find(&a, &ch, 1, 5, false), Some(6));
        assert_eq!(c.find(&a, &ch, 1, 4, false), None, "another parent");
        // The same first block with another token right after it (the lookahead).
        let mut b = a.clone();
        b[BLOCK_SIZE + 1] += 1;
        let mut chb = Vec::new();
        extend_chain(&mut chb, &b, 2);
        assert_eq!(c.find(&b, &chb, 0, ROOT, true), None);
        // Evicting the parent orphans the child, even if the id comes back with it.
        c.park(6);
        c.park(5);
        assert_eq!(c.evict(), Some(6));
        assert_eq!(c.evict(), Some(5));
        assert!(c.insert(5, &a, &ch, 0, ROOT, true));
        assert_eq!(c.find(&a, &ch, 0, ROOT, true), Some(5));
        assert_eq!(c.find(&a, &ch, 1, 5, false), None);
        assert_eq!(c.stats.evictions, 2);
    }

    /// A hash collision cannot share a block: the stored tokens are compared.
    #[test]
    fn a_forged_index_entry_does_not_match() {
        let mut c = PrefixCache::new(4, 0);
        let a = toks(2, BLOCK_SIZE);
        let b = toks(3, BLOCK_SIZE);
        let (mut cha, mut chb) = (Vec::new(), Vec::new());
        extend_chain(&mut cha, &a, 1);
        extend_chain(&mut chb, &b, 1);
        assert!(c.insert(0, &a, &cha, 0, ROOT, true));
        // Make b's key point at a's block, as a collision would.
        let kb = key_of(chb[0], &[], true);
        c.map.insert(kb, 0);
        assert_eq!(c.find(&b, &chb, 0, ROOT, true), None);
    }
}
