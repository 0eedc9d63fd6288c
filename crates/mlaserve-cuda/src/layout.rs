//! A step's row metadata on the host, as the CUDA backend's kernels read it, and the
//! buckets its CUDA graphs pad decode steps to (`backend/graphs.rs`). Host code only, so
//! CI tests it without a GPU.

use mlaserve_core::{Batch, KvCacheDtype, BLOCK_SIZE};

/// Most sequences of a step that runs as a CUDA graph.
pub const MAX_GRAPH_SEQS: usize = 256;
/// Most rows (sequences × window length) of a step that runs as a CUDA graph.
pub const MAX_GRAPH_ROWS: usize = 1024;

/// The padded sequence count of a step of `n` sequences: 1, 2, 4, 8, then the next
/// multiple of 8; `None` past [`MAX_GRAPH_SEQS`] (or for an empty step).
pub fn seq_bucket(n: usize) -> Option<usize> {
    match n {
        0 => None,
        1..=8 => Some(n.next_power_of_two()),
        _ if n <= MAX_GRAPH_SEQS => Some(n.div_ceil(8) * 8),
        _ => None,
    }
}

/// The padded block-table width for `entries` entries: a power of two, at least 8.
pub fn table_bucket(entries: usize) -> usize {
    entries.max(8).next_power_of_two()
}

/// bf16 elements per latent-cache entry of `lora` + `rope` channels: `lora + rope` for
/// the bf16 cache, the fp8 entry's bytes / 2 (`kernels/kv_fp8.cuh`: codes, f32 group
/// scales, bf16 k_pe), which needs `lora` a multiple of 4 and `rope` even (aligned
/// scales, whole elements; the error says what is refused).
pub fn kv_entry_elems(fp8: bool, lora: usize, rope: usize) -> Result<usize, String> {
    if !fp8 {
        return Ok(lora + rope);
    }
    if !lora.is_multiple_of(4) || !rope.is_multiple_of(2) {
        return Err(format!(
            "the fp8 latent cache needs kv_lora_rank {lora} a multiple of 4 and qk_rope_head_dim {rope} even"
        ));
    }
    Ok(KvCacheDtype::Fp8.entry_bytes(lora, rope, 2) / 2)
}

/// Host facts about a step's attention metadata that bound what the kernels read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttnMeta {
    pub n: usize,
    pub seqs: usize,
    pub bt_stride: usize,
    pub max_pos: usize,
    pub max_block: usize,
}

/// A step's row metadata on the host, as the kernels read it. With padding (CUDA graph
/// buckets, `graphs.rs`) it describes `seqs` sequences and a table width of `bt_stride`,
/// the padding sequences having no context, positions `0..q_len` and slot -1 (the latent
/// write skips them).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StepLayout {
    pub tokens: Vec<i32>,
    pub pos: Vec<i32>,
    pub slot: Vec<i64>,
    pub row_seq: Vec<i32>,
    pub tables: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub meta: AttnMeta,
    pub uniform: Option<usize>,
}

impl StepLayout {
    /// Lays `batch` out; `pad = Some((seqs, bt_stride))` pads a uniform batch to `seqs`
    /// sequences and its block tables to `bt_stride` entries (both at least the batch's).
    pub fn new(batch: &Batch, pad: Option<(usize, usize)>) -> Self {
        let bt_used = batch.seqs.iter().map(|c| c.block_table.len()).max().unwrap_or(1).max(1);
        let (seqs, bt_stride) =
            pad.map_or((batch.seqs.len(), bt_used), |(s, b)| (s.max(batch.seqs.len()), b.max(bt_used)));
        let mut l = StepLayout { tables: vec![0i32; seqs.max(1) * bt_stride], ..Default::default() };
        let (mut max_pos, mut max_block) = (0usize, 0usize);
        for (i, c) in batch.seqs.iter().enumerate() {
            for (j, &b) in c.block_table.iter().enumerate() {
                l.tables[i * bt_stride + j] = b as i32;
                max_block = max_block.max(b as usize);
            }
            for (j, &t) in c.tokens.iter().enumerate() {
                let p = c.start_pos + j;
                let sl = c.block_table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE;
                l.tokens.push(t as i32);
                l.pos.push(p as i32);
                l.slot.push(sl as i64);
                l.row_seq.push(i as i32);
                max_pos = max_pos.max(p);
            }
            l.seq_lens.push((c.start_pos + c.tokens.len()) as i32);
        }
        let first = batch.seqs.first().map(|c| c.tokens.len()).unwrap_or(0);
        l.uniform = (first > 0 && batch.seqs.iter().all(|c| c.tokens.len() == first)).then_some(first);
        for i in batch.seqs.len()..seqs {
            for j in 0..first {
                l.tokens.push(0);
                l.pos.push(j as i32);
                l.slot.push(-1);
                l.row_seq.push(i as i32);
                max_pos = max_pos.max(j);
            }
            l.seq_lens.push(0);
        }
        l.meta = AttnMeta { n: l.tokens.len(), seqs, bt_stride, max_pos, max_block };
        l
    }
}

/// Most CUDA graphs a backend holds by default (`CudaOptions::max_graphs`).
pub const MAX_GRAPHS: usize = 512;
/// Graph steps a held graph must have gone unused before a new shape may take its place.
pub const GRAPH_IDLE_STEPS: u64 = 4096;

/// Which held graph makes room for a new shape's once a backend holds its most: the
/// least recently used (`last_used`: each graph's last graph step), if it has gone
/// unused for at least `idle` steps by `now`; `None`, and the new shape runs eagerly,
/// otherwise, so that serving more shapes at once than the cap never turns into a
/// capture every step. Every graph step uses one graph, so no two graphs share a last
/// use and the choice does not depend on the iteration order: the ranks of a group,
/// which see the same steps, choose alike.
pub fn graph_to_evict<K>(last_used: impl IntoIterator<Item = (K, u64)>, now: u64, idle: u64) -> Option<K> {
    last_used.into_iter().filter(|&(_, t)| now.saturating_sub(t) >= idle).min_by_key(|&(_, t)| t).map(|(k, _)| k)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlaserve_core::SeqChunk;

    #[test]
    fn fp8_entries_in_bf16_elements() {
        assert_eq!(kv_entry_elems(false, 512, 64).unwrap(), 576);
        assert_eq!(kv_entry_elems(true, 512, 64).unwrap(), 328); // 656 bytes
        assert_eq!(kv_entry_elems(true, 32, 16).unwrap(), (32 + 4 + 32) / 2);
        assert_eq!(kv_entry_elems(true, 128, 16).unwrap(), (128 + 4 + 32) / 2);
        assert!(kv_entry_elems(true, 30, 16).is_err());
        assert!(kv_entry_elems(true, 32, 15).is_err());
    }

    #[test]
    fn the_least_recently_used_idle_graph_makes_room() {
        let used = [("a", 50), ("b", 10), ("c", 30)];
        assert_eq!(graph_to_evict(used, 100, 20), Some("b"));
        // Only graphs idle long enough qualify; the oldest of them goes.
        assert_eq!(graph_to_evict(used, 100, 60), Some("b"));
        assert_eq!(graph_to_evict(used, 100, 91), None);
        assert_eq!(graph_to_evict([("c", 30), ("a", 50)], 100, 60), Some("c"));
        assert_eq!(graph_to_evict([("a", 50), ("c", 30)], 100, 71), None);
        assert_eq!(graph_to_evict(std::iter::empty::<(&str, u64)>(), 100, 0), None);
    }

    #[test]
    fn buckets() {
        let got: Vec<_> = [1, 2, 3, 5, 8, 9, 16, 17, 255, 256].iter().map(|&n| seq_bucket(n).unwrap()).collect();
        assert_eq!(got, [1, 2, 4, 8, 8, 16, 16, 24, 256, 256]);
        assert_eq!(seq_bucket(0), None);
        assert_eq!(seq_bucket(MAX_GRAPH_SEQS + 1), None);
        assert_eq!([1, 8, 9, 64, 65, 2560].map(table_bucket), [8, 8, 16, 64, 128, 4096]);
    }

    fn decode_batch() -> Batch {
        // Three windows of 2 tokens: contexts of 70, 5 and 130 tokens before the window.
        let seq = |start: usize, blocks: Vec<u32>, t: u32| SeqChunk {
            tokens: vec![t, t + 1],
            start_pos: start,
            block_table: blocks,
            prefill: false,
        };
        Batch {
            seqs: vec![seq(70, vec![4, 9], 10), seq(5, vec![2], 20), seq(130, vec![7, 1, 3], 30)],
            ..Default::default()
        }
    }

    #[test]
    fn layout_without_padding() {
        let l = StepLayout::new(&decode_batch(), None);
        assert_eq!(l.tokens, [10, 11, 20, 21, 30, 31]);
        assert_eq!(l.pos, [70, 71, 5, 6, 130, 131]);
        // slot = block_table[p / 64] * 64 + p % 64
        assert_eq!(l.slot, [9 * 64 + 6, 9 * 64 + 7, 2 * 64 + 5, 2 * 64 + 6, 3 * 64 + 2, 3 * 64 + 3]);
        assert_eq!(l.row_seq, [0, 0, 1, 1, 2, 2]);
        assert_eq!(l.tables, [4, 9, 0, 2, 0, 0, 7, 1, 3]);
        assert_eq!(l.seq_lens, [72, 7, 132]);
        assert_eq!(l.meta, AttnMeta { n: 6, seqs: 3, bt_stride: 3, max_pos: 131, max_block: 9 });
        assert_eq!(l.uniform, Some(2));
    }

    #[test]
    fn padding_adds_inert_sequences_and_keeps_the_real_rows() {
        let b = decode_batch();
        let l = StepLayout::new(&b, Some((4, 8)));
        let plain = StepLayout::new(&b, None);
        assert_eq!(&l.tokens[..6], &plain.tokens[..]);
        assert_eq!(&l.pos[..6], &plain.pos[..]);
        assert_eq!(&l.slot[..6], &plain.slot[..]);
        assert_eq!(&l.seq_lens[..3], &plain.seq_lens[..]);
        // The padding sequence: window positions 0.., no context, no latent written.
        assert_eq!(&l.tokens[6..], [0, 0]);
        assert_eq!(&l.pos[6..], [0, 1]);
        assert_eq!(&l.slot[6..], [-1, -1]);
        assert_eq!(&l.row_seq[6..], [3, 3]);
        assert_eq!(l.seq_lens[3], 0);
        // Tables re-strided to 8 entries, real entries kept, the rest zero.
        assert_eq!(l.tables.len(), 4 * 8);
        for (i, c) in b.seqs.iter().enumerate() {
            assert_eq!(
                &l.tables[i * 8..i * 8 + c.block_table.len()],
                c.block_table.iter().map(|&x| x as i32).collect::<Vec<_>>()
            );
            assert!(l.tables[i * 8 + c.block_table.len()..(i + 1) * 8].iter().all(|&x| x == 0));
        }
        assert!(l.tables[24..].iter().all(|&x| x == 0));
        assert_eq!(l.meta, AttnMeta { n: 8, seqs: 4, bt_stride: 8, max_pos: 131, max_block: 9 });
        assert_eq!(l.uniform, Some(2));
        // A bucket never shrinks a step.
        assert_eq!(StepLayout::new(&b, Some((1, 1))), plain);
    }
}
