//! The paged KV block manager: a free list of physical cache blocks of
//! [`BLOCK_SIZE`] tokens, shared by the target layers and the MTP layers (each layer
//! has its own latent cache indexed by the same block ids, so one table serves all).
//!
//! A block belongs to exactly one sequence's table or to the free list; the manager
//! never hands out more blocks than it has (`allocate` fails instead), and
//! [`BlockManager::check`] verifies the accounting in tests.

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

/// Free list of physical blocks.
#[derive(Debug, Clone)]
pub struct BlockManager {
    free: Vec<u32>,
    total: usize,
}

impl BlockManager {
    /// A pool of `total` blocks, ids `0..total`, all free.
    pub fn new(total: usize) -> Self {
        // Pop order hands out low ids first; it only matters for readable traces.
        let free = (0..total as u32).rev().collect();
        BlockManager { free, total }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Grows `table` so that it covers `positions` positions. Returns false (and
    /// changes nothing) when the pool does not have enough free blocks.
    pub fn ensure(&mut self, table: &mut Vec<u32>, positions: usize) -> bool {
        let need = blocks_for(positions).saturating_sub(table.len());
        if need == 0 {
            return true;
        }
        if need > self.free.len() {
            return false;
        }
        let at = self.free.len() - need;
        table.extend(self.free.drain(at..));
        true
    }

    /// Blocks still missing for `table` to cover `positions`.
    pub fn missing(table: &[u32], positions: usize) -> usize {
        blocks_for(positions).saturating_sub(table.len())
    }

    /// Returns every block of `table` to the pool and empties it.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.append(table);
    }

    /// Checks that the free list and the given tables partition `0..total` exactly.
    pub fn check<'a>(&self, tables: impl IntoIterator<Item = &'a [u32]>) -> Result<(), String> {
        let mut seen = vec![false; self.total];
        let mut mark = |b: u32, owner: &str| -> Result<(), String> {
            let slot = seen.get_mut(b as usize).ok_or_else(|| format!("block {b} out of range ({owner})"))?;
            if *slot {
                return Err(format!("block {b} owned twice ({owner})"));
            }
            *slot = true;
            Ok(())
        };
        for &b in &self.free {
            mark(b, "free list")?;
        }
        for t in tables {
            for &b in t {
                mark(b, "sequence")?;
            }
        }
        match seen.iter().position(|s| !s) {
            Some(b) => Err(format!("block {b} leaked: neither free nor owned")),
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
}
