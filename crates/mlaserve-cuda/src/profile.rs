//! The memory planner's profiling step (`CudaOptions::gpu_memory_utilization`): host
//! arithmetic, unit-tested without a GPU.

use mlaserve_core::{Batch, SeqChunk, BLOCK_SIZE};

/// The profiling step: `tokens` prompt tokens in chunks of at most `longest`, each its own
/// sequence from position 0; the blocks they need.
pub fn profile_batch(tokens: usize, longest: usize) -> (Batch, usize) {
    let longest = longest.max(1);
    let mut seqs = Vec::new();
    let (mut left, mut next_block) = (tokens.max(1), 0u32);
    while left > 0 {
        let len = left.min(longest);
        let blocks = len.div_ceil(BLOCK_SIZE) as u32;
        seqs.push(SeqChunk {
            tokens: (0..len as u32).map(|i| 1 + i % 97).collect(),
            start_pos: 0,
            block_table: (next_block..next_block + blocks).collect(),
            prefill: true,
        });
        next_block += blocks;
        left -= len;
    }
    let mut row = 0u32;
    let mut last_rows = Vec::new();
    for s in &seqs {
        row += s.tokens.len() as u32;
        last_rows.push(row - 1);
    }
    let batch = Batch {
        seqs,
        logit_rows: last_rows.clone(),
        argmax_rows: last_rows,
        sample_rows: Vec::new(),
        ..Default::default()
    };
    (batch, next_block as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_profile_step_covers_the_tokens_in_valid_chunks() {
        let (b, blocks) = profile_batch(2048, 700);
        assert_eq!(b.num_tokens(), 2048);
        assert_eq!(b.seqs.iter().map(|s| s.tokens.len()).collect::<Vec<_>>(), [700, 700, 648]);
        assert_eq!(blocks, 11 + 11 + 11);
        b.validate(1000, blocks, 700).expect("a valid batch");
        assert_eq!(b.logit_rows, [699, 1399, 2047]);
    }
}
