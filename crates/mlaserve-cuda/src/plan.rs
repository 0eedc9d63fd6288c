//! Launch planning for the MLA decode kernel (tile and split-KV geometry) and the k
//! splits of the batch-invariant GEMMs. Pure host arithmetic, so it is unit-tested
//! without a GPU.

/// Tokens per page of the latent cache (FlashMLA's page size; the engine's block size).
pub const PAGE: usize = mlaserve_core::BLOCK_SIZE;
/// Query rows per tile: `rows = q_len * heads`, packed `row = s_idx * heads + head`.
pub const TILE_ROWS: usize = 64;
/// Cache tokens per pipeline step of the mma.sync kernel (half a page); its splits are
/// made of these.
pub const CHUNK_TOKENS: usize = 32;
/// The 64-token kernels (seesaw, transposed) split at page boundaries.
pub const BLOCK_TOKENS: usize = PAGE;
/// Upper bound on splits per request (bounds the workspace and the combine's loop).
pub const MAX_SPLITS: usize = 64;
/// A CTA's fixed cost (Q tile load, pipeline fill, epilogue) in chunk-equivalents,
/// for the split cost model.
const CTA_OVERHEAD_CHUNKS: usize = 2;

/// Number of 64-row tiles for `q_len * heads` rows.
pub fn tiles(heads: usize, q_len: usize) -> usize {
    (heads * q_len).div_ceil(TILE_ROWS)
}

/// Splits per request so that `batch * tiles * splits` CTAs (one per SM at a time) fill
/// `num_sms` with the least tail: minimises `waves * (chunks per split + overhead)`, ties
/// to fewer splits (each split adds a partial write and the combine's read). A split is
/// made of whole chunks of `chunk_tokens` ([`CHUNK_TOKENS`] or [`BLOCK_TOKENS`]).
pub fn num_splits(batch: usize, tiles: usize, max_seq_len: usize, num_sms: usize, chunk_tokens: usize) -> usize {
    let chunks = max_seq_len.div_ceil(chunk_tokens.max(1)).max(1);
    let ctas_per_split = (batch * tiles).max(1);
    let sms = num_sms.max(1);
    let mut best = (usize::MAX, 1);
    for s in 1..=chunks.min(MAX_SPLITS) {
        let waves = (ctas_per_split * s).div_ceil(sms);
        let cost = waves * (chunks.div_ceil(s) + CTA_OVERHEAD_CHUNKS);
        if cost < best.0 {
            best = (cost, s);
        }
    }
    best.1
}

/// FLOPs of one decode attention call as reported by the benchmark:
/// `2 * rows * seq_len * (dqk + dv)` per request (QK over dqk, PV over dv).
pub fn flops(rows: usize, seq_lens: &[usize], dqk: usize, dv: usize) -> f64 {
    seq_lens.iter().map(|&l| 2.0 * rows as f64 * l as f64 * (dqk + dv) as f64).sum()
}

/// Fewest bytes a decode call must move: every cached token once (`dqk` bf16), q once,
/// the output and its LSE once.
pub fn min_bytes(rows: usize, seq_lens: &[usize], dqk: usize, dv: usize, out_elem_bytes: usize) -> f64 {
    let cache: usize = seq_lens.iter().map(|&l| l * dqk * 2).sum();
    let per_req = rows * (dqk * 2 + dv * out_elem_bytes + 4);
    (cache + seq_lens.len() * per_req) as f64
}

/// How the 64-token kernels (seesaw, transposed) merge a request's split-KV partials.
/// The other kernels always leave it to the combine kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitMerge {
    /// A second launch, `mla_decode_combine` (any split count).
    Kernel,
    /// The last CTA of a (request, tile) to finish merges every split's partial, found
    /// through an atomic counter in the workspace (any split count).
    LastCta,
    /// The default: exactly two splits run as the two CTAs of a thread-block cluster,
    /// which swap half of their normalised partials through distributed shared memory and
    /// each write half of the output; no partial goes to global memory and no second
    /// kernel runs. Other split counts use the combine kernel.
    Cluster,
}

impl SplitMerge {
    pub const ALL: [SplitMerge; 3] = [SplitMerge::Kernel, SplitMerge::LastCta, SplitMerge::Cluster];

    /// The merge called `name` (as [`SplitMerge::name`] spells it).
    pub fn from_name(name: &str) -> Option<SplitMerge> {
        Self::ALL.into_iter().find(|m| m.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            SplitMerge::Kernel => "kernel",
            SplitMerge::LastCta => "last-cta",
            SplitMerge::Cluster => "cluster",
        }
    }

    /// The merge that runs when this one is asked for: `None` with one split (nothing
    /// to merge); the combine kernel where the kernel (`own_merge`: seesaw or
    /// transposed) cannot merge its own splits, or where a cluster pair would need
    /// other than two.
    pub fn resolve(self, own_merge: bool, splits: usize) -> Option<SplitMerge> {
        match self {
            _ if splits <= 1 => None,
            SplitMerge::Cluster if own_merge && splits == 2 => Some(SplitMerge::Cluster),
            SplitMerge::LastCta if own_merge => Some(SplitMerge::LastCta),
            _ => Some(SplitMerge::Kernel),
        }
    }
}

/// Columns per `linear_tc` block (kernels/gemm_tc.cu) and the k granularity of its splits.
pub const TC_BN: usize = 64;
pub const TC_BK: usize = 64;

/// `linear_tc`'s split of k for an `[n][k]` weight on `num_sms` SMs: `(ksplit, kchunk)`,
/// k in `ksplit` ranges of `kchunk` (a multiple of 64, the last range maybe shorter).
/// Enough column blocks × splits for two blocks per SM at decode sizes, no range under
/// 512 of k. A function of the weight's shape only: the rows of a call never change how a
/// row is summed.
pub fn tc_split(n: usize, k: usize, num_sms: usize) -> (usize, usize) {
    let col_blocks = n.div_ceil(TC_BN).max(1);
    let want = (2 * num_sms.max(1)).div_ceil(col_blocks).clamp(1, (k / 512).max(1));
    let kchunk = k.div_ceil(want).div_ceil(TC_BK) * TC_BK;
    (k.div_ceil(kchunk.max(1)).max(1), kchunk.max(TC_BK))
}

/// Columns per block of the router's decode tile (`router_f32_tile16`, kernels/router.cu),
/// which sets how many blocks a k range gives a decode call.
pub const ROUTER_DECODE_BN: usize = 16;
/// The router's k ranges are multiples of this (the larger k tile of its two entry points).
pub const ROUTER_K_ALIGN: usize = 64;

/// The MoE router GEMM's split of k for an `[n][k]` f32 weight on `num_sms` SMs:
/// `(ksplit, kchunk)`, k in `ksplit` ranges of `kchunk` (a multiple of
/// [`ROUTER_K_ALIGN`], the last range maybe shorter, none empty). A decode call is bound by
/// reading the weight, so ranges are cut until its 16-column blocks number two per SM, but
/// none under 256 of k (each range adds an m × n partial that prefill writes and reads
/// back). A function of the weight's shape and the SM count only: the ranges fix every
/// logit's order of summation, so the rows of a call never change a row's bits.
pub fn router_split(n: usize, k: usize, num_sms: usize) -> (usize, usize) {
    let col_blocks = n.div_ceil(ROUTER_DECODE_BN).max(1);
    let want = (2 * num_sms.max(1)).div_ceil(col_blocks).clamp(1, (k / 256).max(1));
    let kchunk = (k.div_ceil(want).div_ceil(ROUTER_K_ALIGN) * ROUTER_K_ALIGN).max(ROUTER_K_ALIGN);
    (k.div_ceil(kchunk).max(1), kchunk)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn router_split_covers_k_in_aligned_ranges() {
        // DeepSeek-V3 (256 experts × 7168) and V2 (160 × 5120) on an H200's 132 SMs.
        assert_eq!(router_split(256, 7168, 132), (16, 448), "16 column blocks × 16 ranges");
        assert_eq!(router_split(160, 5120, 132), (20, 256), "ranges of no less than 256");
        for (n, k) in [(256, 7168), (160, 5120), (64, 1000), (16, 36), (40, 1001), (4096, 256), (1, 1), (8, 0)] {
            for sms in [1, 78, 132, 148] {
                let (ks, kc) = router_split(n, k, sms);
                assert!(kc % ROUTER_K_ALIGN == 0 && ks >= 1, "{n}x{k} on {sms}");
                assert!(ks * kc >= k && (ks - 1) * kc < k.max(1), "{n}x{k} on {sms}: k covered, no empty range");
                assert!(kc >= 256 || ks == 1, "{n}x{k} on {sms}: ranges of 256 or more");
            }
        }
        assert_eq!(router_split(4096, 256, 132), (1, 256), "enough columns: no split");
        assert_eq!(router_split(8, 0, 132), (1, 64), "k = 0: one empty range, the logits are 0");
    }

    #[test]
    fn tc_split_depends_on_the_weight_only() {
        // DeepSeek-V3's projections on 132 SMs.
        for (n, k) in [(576, 7168), (1536, 7168), (24576, 1536), (7168, 16384), (129280, 7168), (7168, 18432)] {
            let (ks, kc) = tc_split(n, k, 132);
            assert_eq!(kc % 64, 0, "{n}x{k}");
            assert!(ks * kc >= k && (ks - 1) * kc < k, "{n}x{k}: every range non-empty, k covered");
            assert!(kc >= 512 || ks == 1, "{n}x{k}: ranges of 512 or more");
            let blocks = n.div_ceil(64) * ks;
            assert!(blocks >= 132 || kc <= 512, "{n}x{k}: {blocks} blocks fill the chip");
        }
        assert_eq!(tc_split(129280, 7168, 132), (1, 7168), "wide weights need no split");
        assert_eq!(tc_split(576, 7168, 132).0, 14, "kv_a: 9 column blocks × 14 splits");
        // Small and odd shapes still cover k.
        assert_eq!(tc_split(8, 16, 132), (1, 64));
        let (ks, kc) = tc_split(40, 1000, 132);
        assert!(ks * kc >= 1000 && kc % 64 == 0);
    }

    #[test]
    fn split_merge_resolves_to_what_runs() {
        use SplitMerge::*;
        for m in SplitMerge::ALL {
            assert_eq!(SplitMerge::from_name(m.name()), Some(m));
            assert_eq!(m.resolve(true, 1), None, "one split: nothing to merge");
        }
        assert_eq!(Cluster.resolve(true, 2), Some(Cluster));
        assert_eq!(Cluster.resolve(true, 3), Some(Kernel), "a cluster pair holds two splits only");
        assert_eq!(Cluster.resolve(false, 2), Some(Kernel), "the mma.sync kernel has no cluster entry");
        assert_eq!(LastCta.resolve(true, 7), Some(LastCta));
        assert_eq!(LastCta.resolve(false, 7), Some(Kernel));
        assert_eq!(Kernel.resolve(true, 2), Some(Kernel));
        assert_eq!(SplitMerge::from_name("fused"), None);
    }

    #[test]
    fn tiles_pad_to_64_rows() {
        assert_eq!(tiles(16, 1), 1);
        assert_eq!(tiles(16, 4), 1);
        assert_eq!(tiles(128, 4), 8);
        assert_eq!(tiles(32, 3), 2);
    }

    #[test]
    fn splits_fill_the_chip_for_small_batches() {
        // 64 requests x 1 tile on 132 SMs: 2 splits make 128 CTAs, one wave.
        assert_eq!(num_splits(64, 1, 4096, 132, CHUNK_TOKENS), 2);
        assert_eq!(num_splits(64, 1, 4096, 132, BLOCK_TOKENS), 2);
        // Already many waves: no split.
        assert_eq!(num_splits(128, 8, 4096, 132, CHUNK_TOKENS), 1);
        // One request: split wide, but never past the chunk count or MAX_SPLITS.
        let s = num_splits(1, 1, 8192, 132, CHUNK_TOKENS);
        assert!(s > 16 && s <= MAX_SPLITS, "{s}");
        assert_eq!(num_splits(1, 1, 40, 132, CHUNK_TOKENS), 2);
        assert_eq!(num_splits(4, 1, 0, 132, CHUNK_TOKENS), 1);
        // Page-sized splits never outnumber the pages.
        assert_eq!(num_splits(1, 1, 40, 132, BLOCK_TOKENS), 1);
        assert!(num_splits(1, 1, 8192, 132, BLOCK_TOKENS) <= 128);
    }

    #[test]
    fn flop_and_byte_counts() {
        assert_eq!(flops(64, &[4096], 576, 512), 2.0 * 64.0 * 4096.0 * 1088.0);
        assert_eq!(min_bytes(16, &[100], 576, 512, 2), (100 * 1152 + 16 * (1152 + 1024 + 4)) as f64);
    }
}
