//! Host-side planning of the fp8 (e4m3, 128 × 128 block-scaled) projections of
//! `kernels/fp8_gemm.cu`: shape validation, which kernel runs a call, the weight-streaming
//! kernel's split-K and row tiles. Built without CUDA, so CI unit-tests it; the launch
//! wrappers are `crate::fp8` (with the `cuda` feature).
//!
//! Batch invariance: the streaming kernel's k split ([`stream_split`]) depends on the
//! weight's shape and the GPU's SM count only, never on the rows of a call, and a row's
//! sum is the same mma/promotion sequence whatever tile it sits in; so
//! [`Fp8Path::Stream`] gives a row the same bits at any row count.

/// Scale block edge (rows and columns of the weight, channels of an activation group).
pub const FP8_BLOCK: usize = 128;
/// Weight rows (output columns) per streaming block: one scale row.
pub const STREAM_COLS: usize = 128;
/// Activation rows per streaming block (more rows run as more blocks along grid.z).
pub const STREAM_ROWS: usize = 64;
/// [`Fp8Path::Auto`] runs the streaming kernel up to this many rows on Hopper whatever
/// the shape (H200, V3's projections, 1 and 4 rows: the streaming kernel 4.2-41 µs, the
/// tile kernel 4.4-82).
pub const STREAM_MAX_ROWS: usize = 16;
/// Up to this many rows [`Fp8Path::Auto`] still streams a weight whose tile-kernel grid
/// would leave half the SMs idle, unless its k loop is short (see [`TILE_SHORT_K`]).
pub const STREAM_MID_ROWS: usize = 256;
/// A weight with at most this many input channels runs the tile kernel from
/// [`STREAM_MAX_ROWS`] rows on even when its tiles leave SMs idle: each tile's k loop is
/// short. (H200, 64 rows: o_proj/TP8 2048→7168 tiles 12.6 µs, streaming 15.9; q_a
/// 7168→1536 tiles 32.0, streaming 12.4.)
pub const TILE_SHORT_K: usize = 2304;
/// Rows and columns per block of the wgmma kernel.
pub const WG_TILE: usize = 128;
/// The wgmma kernel's dynamic shared memory: 1024 bytes of alignment slack, 6 stages of
/// two 128 × 128-byte tiles, 12 barriers of 8 bytes.
pub const WG_SMEM: usize = 1024 + 6 * 2 * WG_TILE * FP8_BLOCK + 16 * 6;
/// Columns per tile of the wide wgmma kernel (`fp8_gemm_wide*`; 128 rows a tile, the
/// same dynamic shared memory [`WG_SMEM`] as four stages).
pub const WIDE_TILE: usize = 256;
/// Bytes of f32 split-K partials one streaming launch may write; more rows run in slabs.
pub const STREAM_PARTIAL_BYTES: usize = 64 << 20;

/// Which kernel runs an fp8 projection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Path {
    /// On Hopper the streaming kernel up to [`STREAM_MAX_ROWS`] rows, and up to
    /// [`STREAM_MID_ROWS`] for weights whose tile grid would leave SMs idle (see
    /// [`Fp8Path::kernel`]); the wgmma tile kernel otherwise. The streaming kernel
    /// elsewhere. Not batch-invariant across those thresholds.
    #[default]
    Auto,
    /// The weight-streaming kernel at every row count: on Hopper its wgmma form
    /// (`fp8_stream_wg*`), elsewhere the mma.sync form. Batch-invariant.
    Stream,
    /// The mma.sync streaming kernel (`fp8_stream*`) on every GPU, Hopper included (the
    /// portable kernel; batch-invariant).
    Portable,
    /// The wgmma tile kernel (128 × 128 tiles) at every row count (Hopper only).
    Wgmma,
    /// The wide wgmma tile kernel (128 × 256 tiles, persistent) at every row count
    /// (Hopper only).
    Wide,
}

impl Fp8Path {
    pub const ALL: [Fp8Path; 5] = [Fp8Path::Auto, Fp8Path::Stream, Fp8Path::Portable, Fp8Path::Wgmma, Fp8Path::Wide];

    pub fn name(self) -> &'static str {
        match self {
            Fp8Path::Auto => "auto",
            Fp8Path::Stream => "stream",
            Fp8Path::Portable => "portable",
            Fp8Path::Wgmma => "wgmma",
            Fp8Path::Wide => "wide",
        }
    }

    pub fn from_name(name: &str) -> Option<Fp8Path> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Whether a row's result is independent of the other rows of the call.
    pub fn batch_invariant(self) -> bool {
        matches!(self, Fp8Path::Stream | Fp8Path::Portable)
    }

    /// The kernel that runs `rows` rows of a weight `[out][inp]` on a GPU of `num_sms` SMs
    /// with (`wgmma`: Hopper) or without the wgmma kernels; an error for
    /// [`Fp8Path::Wgmma`] without them.
    pub fn kernel(self, rows: usize, out: usize, inp: usize, num_sms: usize, wgmma: bool) -> Result<Fp8Kernel, String> {
        let stream = if wgmma { Fp8Kernel::StreamWg } else { Fp8Kernel::StreamMma };
        match self {
            Fp8Path::Stream => Ok(stream),
            Fp8Path::Portable => Ok(Fp8Kernel::StreamMma),
            Fp8Path::Wgmma if wgmma => Ok(Fp8Kernel::Wgmma),
            Fp8Path::Wide if wgmma => Ok(Fp8Kernel::WgmmaWide),
            Fp8Path::Wgmma | Fp8Path::Wide => Err("the wgmma fp8 kernels need a Hopper (sm_90) GPU".into()),
            Fp8Path::Auto if !wgmma || rows <= STREAM_MAX_ROWS => Ok(stream),
            Fp8Path::Auto => {
                let tiles = rows.div_ceil(WG_TILE) * out.div_ceil(WG_TILE);
                let idle = 2 * tiles < num_sms;
                Ok(if rows <= STREAM_MID_ROWS && idle && inp > TILE_SHORT_K {
                    stream
                } else {
                    tile_kernel(rows, out, num_sms)
                })
            }
        }
    }
}

/// The tile kernel for `rows` rows of a weight with `out` output columns: the wide one
/// where its waves of tiles cost less. A wide tile does twice a narrow one's work in
/// about 1.6 times its time (H200, V3's projections at 4,096 rows: 1.1-1.3x the narrow
/// kernel's speed), and a wave is as slow as its fullest SM, so the cost of a kernel is
/// its waves (tiles over SMs, rounded up) times its tile's time.
pub fn tile_kernel(rows: usize, out: usize, num_sms: usize) -> Fp8Kernel {
    let waves = |cols: usize| (rows.div_ceil(WG_TILE) * out.div_ceil(cols)).div_ceil(num_sms.max(1));
    if 8 * waves(WIDE_TILE) < 5 * waves(WG_TILE) {
        Fp8Kernel::WgmmaWide
    } else {
        Fp8Kernel::Wgmma
    }
}

/// A kernel of `fp8_gemm.cu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Kernel {
    /// `fp8_stream*`: weight streaming on mma.sync (every GPU).
    StreamMma,
    /// `fp8_stream_wg*`: weight streaming on wgmma, operands swapped (Hopper).
    StreamWg,
    /// `fp8_gemm_wg*`: 128 × 128 tiles on wgmma (Hopper).
    Wgmma,
    /// `fp8_gemm_wide*`: 128 × 256 tiles on wgmma, persistent (Hopper).
    WgmmaWide,
}

impl Fp8Kernel {
    pub fn name(self) -> &'static str {
        match self {
            Fp8Kernel::StreamMma => "stream-mma",
            Fp8Kernel::StreamWg => "stream-wg",
            Fp8Kernel::Wgmma => "wgmma",
            Fp8Kernel::WgmmaWide => "wide",
        }
    }
}

/// Scale grid of a weight `[out][inp]`: `[ceil(out / 128)][ceil(inp / 128)]`.
pub fn scale_shape(out: usize, inp: usize) -> (usize, usize) {
    (out.div_ceil(FP8_BLOCK), inp.div_ceil(FP8_BLOCK))
}

/// Checks a weight's byte and scale counts; the kernels also need `inp % 128 == 0`
/// (whole activation groups) and `out > 0`.
pub fn check_weight(out: usize, inp: usize, q_len: usize, scale_len: usize) -> Result<(), String> {
    if out == 0 || inp == 0 {
        return Err(format!("empty weight [{out}, {inp}]"));
    }
    if !inp.is_multiple_of(FP8_BLOCK) {
        return Err(format!(
            "in = {inp} is not a multiple of {FP8_BLOCK} (activations are quantised per 128 channels)"
        ));
    }
    if out > i32::MAX as usize || inp > i32::MAX as usize {
        return Err(format!("[{out}, {inp}] overflows i32"));
    }
    let want = out.checked_mul(inp).ok_or_else(|| format!("[{out}, {inp}] overflows usize"))?;
    if q_len != want {
        return Err(format!("{q_len} weight bytes for [{out}, {inp}] (want {want})"));
    }
    let (so, si) = scale_shape(out, inp);
    if scale_len != so * si {
        return Err(format!("{scale_len} scales for [{out}, {inp}] (want [{so}, {si}] = {})", so * si));
    }
    Ok(())
}

/// The stored input width of an fp8 weight of `x_inp` input channels: the next multiple
/// of 128 (zero columns fill the last block); `x_inp` must be a positive multiple of 4
/// (the activation quantiser's loads).
pub fn padded_inp(x_inp: usize) -> Result<usize, String> {
    if x_inp == 0 || !x_inp.is_multiple_of(4) {
        return Err(format!("{x_inp} input channels: an fp8 weight needs a positive multiple of 4"));
    }
    Ok(x_inp.next_multiple_of(FP8_BLOCK))
}

/// `rows` rows of `from` bytes each, widened to `to ≥ from` bytes with zeros.
pub fn pad_rows(q: &[u8], rows: usize, from: usize, to: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * to];
    for (dst, src) in out.chunks_exact_mut(to).zip(q.chunks_exact(from.max(1))) {
        dst[..from].copy_from_slice(src);
    }
    out
}

/// Rows of one half of a fused fp8 gate_up `[gate | up]` of `inter` rows each: `inter`
/// rounded up to whole 128-row scale blocks, so that up's first row starts a scale row
/// (the SiLU reads the halves at this stride).
pub fn gate_up_half(inter: usize) -> usize {
    inter.next_multiple_of(FP8_BLOCK)
}

/// How an fp8 weight is stored on the device: `out` rows of `inp` code bytes (`inp` the
/// input width `x_inp` padded to whole blocks) and the scale grid over them. The one
/// place the loader and the synthetic weights get their buffer sizes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoredFp8 {
    pub out: usize,
    pub inp: usize,
    pub x_inp: usize,
}

impl StoredFp8 {
    /// A projection `[out][x_inp]`.
    pub fn plain(out: usize, x_inp: usize) -> Result<Self, String> {
        Ok(StoredFp8 { out, inp: padded_inp(x_inp)?, x_inp })
    }
    /// A SwiGLU's fused `[gate | up]` of `inter` rows each over `x_inp` inputs, each half
    /// padded to whole scale rows ([`gate_up_half`]).
    pub fn gate_up(inter: usize, x_inp: usize) -> Result<Self, String> {
        Self::plain(2 * gate_up_half(inter), x_inp)
    }
    /// Code bytes.
    pub fn codes(&self) -> usize {
        self.out * self.inp
    }
    /// Scales (`scale_shape(out, inp)`).
    pub fn scales(&self) -> usize {
        let (so, si) = scale_shape(self.out, self.inp);
        so * si
    }
}

/// Which grouped expert kernel runs `rows` sorted rows over `experts` experts: the
/// streaming kernel (`fp8_grouped_wg*`, tile from [`grouped_tile`]) for decode-sized
/// calls and whenever a row's bits must not depend on the others (`invariant`); the
/// 128 × 128 tile kernel when experts average more than [`GROUPED_TILED_ROWS`] rows.
pub fn grouped_tiled(rows: usize, experts: usize, invariant: bool) -> bool {
    !invariant && rows.div_ceil(experts.max(1)) > GROUPED_TILED_ROWS
}

/// Rows per expert on average above which [`grouped_tiled`] picks the tile kernel.
pub const GROUPED_TILED_ROWS: usize = 64;

/// Checks an activation `[m][k]` for `Fp8Gemm::act_quant`: `k` a positive multiple of 128.
pub fn check_act(m: usize, k: usize) -> Result<(), String> {
    if k == 0 || !k.is_multiple_of(FP8_BLOCK) {
        return Err(format!("k = {k} is not a positive multiple of {FP8_BLOCK}"));
    }
    if m > i32::MAX as usize || k > i32::MAX as usize {
        return Err(format!("[{m}, {k}] overflows i32"));
    }
    Ok(())
}

/// Checks the experts of a grouped projection: `experts` weights `[out][inp]` in one
/// buffer `[experts][out][inp]` of `q_len` bytes and `scale_len` scales `[experts]
/// [ceil(out / 128)][inp / 128]`; every weight row index `experts · out` must fit an i32
/// (the kernel's TMA coordinate).
pub fn check_experts(experts: usize, out: usize, inp: usize, q_len: usize, scale_len: usize) -> Result<(), String> {
    if experts == 0 {
        return Err("no experts".into());
    }
    if experts > 65_535 {
        return Err(format!("{experts} experts (at most 65535: one grid row each)"));
    }
    check_weight(out, inp, out * inp, scale_shape(out, inp).0 * scale_shape(out, inp).1)?;
    let rows = experts.checked_mul(out).filter(|&r| r <= i32::MAX as usize);
    let rows = rows.ok_or_else(|| format!("{experts} experts of {out} rows overflow i32"))?;
    let want = rows.checked_mul(inp).ok_or_else(|| format!("[{experts}, {out}, {inp}] overflows usize"))?;
    if q_len != want {
        return Err(format!("{q_len} weight bytes for [{experts}, {out}, {inp}] (want {want})"));
    }
    let (so, si) = scale_shape(out, inp);
    if scale_len != experts * so * si {
        return Err(format!(
            "{scale_len} scales for [{experts}, {out}, {inp}] (want [{experts}, {so}, {si}] = {})",
            experts * so * si
        ));
    }
    Ok(())
}

/// Activation rows per pass over an expert's weight in the grouped kernel
/// (`fp8_grouped_wg{16,32,64}`), from the call's sorted rows and expert count (never
/// from the routing, which stays on the device): 16 up to 8 rows per expert on average,
/// 32 up to 16, else 64. An expert with more rows than the tile takes several passes
/// over its weight (the later ones mostly from L2); a row's bits do not depend on the
/// tile (the GPU tests assert it).
pub fn grouped_tile(rows: usize, experts: usize) -> usize {
    let avg = rows.div_ceil(experts.max(1));
    match avg {
        0..=8 => 16,
        9..=16 => 32,
        _ => 64,
    }
}

/// The streaming kernel's k split of a weight `[out][inp]` on `num_sms` SMs: `(ksplit,
/// kchunk)` with kchunk a multiple of 128 and `ksplit = ceil(inp / kchunk)`. The fewest
/// splits whose `ceil(out / 128) · ksplit` blocks fill at least one wave of `num_sms` and
/// waste at most 15% of the last wave; else the split with the least waste. Depends on
/// the weight's shape and the GPU only (never on the rows of a call).
pub fn stream_split(out: usize, inp: usize, num_sms: usize) -> (usize, usize) {
    let cols = out.div_ceil(STREAM_COLS).max(1);
    let kbs = inp.div_ceil(FP8_BLOCK).max(1);
    let sms = num_sms.max(1);
    // (efficiency, fills a wave, ksplit, k blocks per split) of the best split so far.
    let mut best: Option<(f64, bool, usize, usize)> = None;
    for want in 1..=kbs.min(STREAM_MAX_SPLIT) {
        let per = kbs.div_ceil(want);
        if kbs.div_ceil(per) != want {
            continue; // not reachable with even chunks
        }
        let units = cols * want;
        let eff = units as f64 / (units.div_ceil(sms) * sms) as f64;
        let fills = units >= sms;
        if fills && eff >= 0.85 {
            return (want, per * FP8_BLOCK);
        }
        let better = match best {
            None => true,
            Some((e, f, _, _)) => (fills && !f) || (fills == f && eff > e + 1e-9),
        };
        if better {
            best = Some((eff, fills, want, per));
        }
    }
    let (_, _, ks, per) = best.unwrap_or((1.0, true, 1, kbs));
    (ks, per * FP8_BLOCK)
}

/// Most k splits of the streaming kernel: the last block of a column tile sums its
/// partials, so more splits cost more than they win in waves (H200, 1 row: a cap of 16
/// made expert down 2048→7168 14.2 µs against 8.2, kv_a 5.6 against 6.2).
pub const STREAM_MAX_SPLIT: usize = 8;

/// Counters of the streaming kernel's split-K (one per column tile and row tile of a
/// launch); launches of more tiles run in slabs.
pub const STREAM_COUNTERS: usize = 1 << 16;

/// k blocks per stage of the streaming kernel's ring (`f8s::KS`).
pub const STREAM_STAGE_BLOCKS: usize = 2;

/// Ring stages of the streaming kernel with `mt` m-tiles (`Cfg<MT>` in fp8_gemm.cu).
pub fn stream_stages(mt: usize) -> usize {
    match mt {
        1 => 3,
        2 => 5,
        _ => 4,
    }
}

/// Dynamic shared memory of the streaming kernel with `mt` m-tiles: 1024 bytes of
/// alignment slack, the ring (per stage two k blocks of 128 weight rows and of 16·mt
/// activation rows) and its barriers.
pub fn stream_smem(mt: usize) -> usize {
    let st = stream_stages(mt);
    1024 + st * (STREAM_COLS + 16 * mt) * STREAM_STAGE_BLOCKS * FP8_BLOCK + 8 * st
}

/// Ring stages of the wgmma streaming kernel with `nt` rows a tile (`f8g::Cfg<NT>`).
pub fn stream_wg_stages(nt: usize) -> usize {
    match nt {
        16 => 3,
        32 => 5,
        _ => 4,
    }
}

/// Dynamic shared memory of the wgmma streaming kernel with `nt` rows a tile: 1024 bytes
/// of slack, the ring (two k blocks of 128 weight rows and `nt` activation rows a stage)
/// and its barriers.
pub fn stream_wg_smem(nt: usize) -> usize {
    let st = stream_wg_stages(nt);
    1024 + st * STREAM_STAGE_BLOCKS * (STREAM_COLS + nt) * FP8_BLOCK + 8 * st
}

/// m-tiles of 16 rows the streaming kernel stages for a launch of `rows` rows: 1, 2 or 4.
pub fn stream_mtiles(rows: usize) -> usize {
    match rows {
        0..=16 => 1,
        17..=32 => 2,
        _ => 4,
    }
}

/// Rows per streaming launch: all `m` without split-K, else as many 64-row tiles as
/// keep the partials within [`STREAM_PARTIAL_BYTES`] and the tiles within
/// [`STREAM_COUNTERS`].
pub fn stream_slab(m: usize, out: usize, ksplit: usize) -> usize {
    if ksplit <= 1 {
        return m.max(1);
    }
    let by_bytes = (STREAM_PARTIAL_BYTES / (ksplit * out * 4)).max(STREAM_ROWS);
    let by_counters = (STREAM_COUNTERS / out.div_ceil(STREAM_COLS)).max(1) * STREAM_ROWS;
    let rows = by_bytes.min(by_counters) / STREAM_ROWS * STREAM_ROWS;
    rows.min(m.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_keeps_rows_and_fills_whole_blocks() {
        assert_eq!(padded_inp(64), Ok(128));
        assert_eq!(padded_inp(7168), Ok(7168));
        assert_eq!(padded_inp(300), Ok(384));
        assert!(padded_inp(0).is_err() && padded_inp(6).is_err());
        assert_eq!(pad_rows(&[1, 2, 3, 4, 5, 6], 2, 3, 5), vec![1, 2, 3, 0, 0, 4, 5, 6, 0, 0]);
        assert_eq!(gate_up_half(32), 128);
        assert_eq!(gate_up_half(256), 256);
        // tiny-v3's expert (32 rows over 64 inputs): halves of 128 rows, one 128 block.
        let g = StoredFp8::gate_up(32, 64).unwrap();
        assert_eq!((g.out, g.inp, g.x_inp, g.codes(), g.scales()), (256, 128, 64, 256 * 128, 2));
        // V3 at TP 8: gate_up 2 × 256 over 7168, down 7168 over 256.
        let g = StoredFp8::gate_up(256, 7168).unwrap();
        assert_eq!((g.out, g.inp, g.codes(), g.scales()), (512, 7168, 512 * 7168, 4 * 56));
        let d = StoredFp8::plain(7168, 256).unwrap();
        assert_eq!((d.codes(), d.scales()), (7168 * 256, 56 * 2));
        assert!(StoredFp8::plain(10, 6).is_err());
        // Decode-sized (64 × 4 rows × top-8 over 256 experts) streams; prefill tiles
        // unless invariant.
        assert!(!grouped_tiled(64 * 4 * 8, 256, false));
        assert!(grouped_tiled(4096 * 8, 256, false));
        assert!(!grouped_tiled(4096 * 8, 256, true));
    }

    /// DeepSeek-V3's projections (TP 1 and 8 widths).
    const SHAPES: &[(usize, usize)] = &[
        (1536, 7168),
        (24576, 1536),
        (3072, 1536),
        (576, 7168),
        (7168, 16384),
        (7168, 2048),
        (18432, 7168),
        (7168, 18432),
        (2048, 7168),
        (256, 7168),
    ];

    #[test]
    fn split_covers_k_in_whole_blocks_and_fills_the_gpu() {
        for &(out, inp) in SHAPES {
            for sms in [1, 78, 132, 148] {
                let (ks, kc) = stream_split(out, inp, sms);
                assert!(kc.is_multiple_of(FP8_BLOCK), "{out}x{inp}: kchunk {kc}");
                assert!(ks >= 1 && (ks - 1) * kc < inp && ks * kc >= inp, "{out}x{inp}: {ks} x {kc}");
                let blocks = out.div_ceil(STREAM_COLS) * ks;
                // At least one wave, unless the splits are as many as even chunks allow
                // under the cap.
                let kbs = inp / FP8_BLOCK;
                let most = kbs.div_ceil(kbs.div_ceil(kbs.min(STREAM_MAX_SPLIT)));
                assert!(blocks >= sms || ks == most, "{out}x{inp} on {sms}: {blocks}");
                assert!(ks <= STREAM_MAX_SPLIT);
            }
        }
        // kv_a: 5 column tiles, 56 k blocks; no split fills a wave: the cap, 8 of 7 blocks.
        assert_eq!(stream_split(576, 7168, 132), (8, 896));
        // dense MLP up: 144 column tiles; 4 splits of 14 k blocks = 576 blocks, 87% of 5 waves.
        assert_eq!(stream_split(18432, 7168, 132), (4, 1792));
        // q_b unsharded: 192 column tiles; 2 splits = 384 blocks, 97% of 3 waves.
        assert_eq!(stream_split(24576, 1536, 132), (2, 768));
        assert_eq!(stream_split(24576, 1536, 96), (1, 1536));
    }

    #[test]
    fn split_ignores_rows() {
        // The plan takes no row count at all; the slab only cuts rows, never k.
        let (ks, _) = stream_split(7168, 2048, 132);
        for m in [1, 7, 64, 65, 4096, 100_000] {
            let slab = stream_slab(m, 7168, ks);
            assert!(slab >= 1 && slab <= m.max(1));
            assert!(slab == m || slab.is_multiple_of(STREAM_ROWS), "m {m}: slab {slab}");
            assert!(ks <= 1 || slab * ks * 7168 * 4 <= STREAM_PARTIAL_BYTES || slab == STREAM_ROWS);
            assert!(ks <= 1 || slab.div_ceil(STREAM_ROWS) * 7168usize.div_ceil(STREAM_COLS) <= STREAM_COUNTERS);
        }
    }

    #[test]
    fn mtiles_cover_rows() {
        for rows in 1..=200 {
            let mt = stream_mtiles(rows);
            assert!(mt * 16 >= rows.min(STREAM_ROWS), "{rows}");
            assert!([1, 2, 4].contains(&mt));
        }
    }

    #[test]
    fn weight_and_activation_validation() {
        assert!(check_weight(576, 7168, 576 * 7168, 5 * 56).is_ok());
        assert!(check_weight(576, 7168, 576 * 7168, 4 * 56).unwrap_err().contains("scales"));
        assert!(check_weight(576, 7168, 576 * 7167, 5 * 56).unwrap_err().contains("weight bytes"));
        assert!(check_weight(576, 7000, 576 * 7000, 5 * 55).unwrap_err().contains("multiple of 128"));
        assert!(check_weight(0, 128, 0, 0).is_err());
        assert!(check_act(4, 7168).is_ok());
        assert!(check_act(4, 100).unwrap_err().contains("multiple of 128"));
        assert!(check_act(4, 0).is_err());
    }

    #[test]
    fn path_choice() {
        let auto = |m, out, inp| Fp8Path::Auto.kernel(m, out, inp, 132, true);
        assert_eq!(auto(STREAM_MAX_ROWS, 18432, 7168), Ok(Fp8Kernel::StreamWg));
        // 144 narrow tiles (two waves) or 72 wide ones (one).
        assert_eq!(auto(STREAM_MAX_ROWS + 1, 18432, 7168), Ok(Fp8Kernel::WgmmaWide));
        assert_eq!(auto(64, 1536, 7168), Ok(Fp8Kernel::StreamWg)); // q_a: 12 tiles
        assert_eq!(auto(64, 7168, 2048), Ok(Fp8Kernel::Wgmma)); // a short k loop
        assert_eq!(auto(256, 7168, 16384), Ok(Fp8Kernel::Wgmma)); // 112 tiles
        assert_eq!(auto(256, 576, 7168), Ok(Fp8Kernel::StreamWg)); // kv_a: 10 tiles
        assert_eq!(auto(257, 576, 7168), Ok(Fp8Kernel::Wgmma));
        assert_eq!(Fp8Path::Auto.kernel(4096, 7168, 2048, 132, false), Ok(Fp8Kernel::StreamMma));
        assert_eq!(Fp8Path::Stream.kernel(4096, 7168, 2048, 132, true), Ok(Fp8Kernel::StreamWg));
        assert_eq!(Fp8Path::Stream.kernel(4096, 7168, 2048, 132, false), Ok(Fp8Kernel::StreamMma));
        assert_eq!(Fp8Path::Portable.kernel(1, 7168, 2048, 132, true), Ok(Fp8Kernel::StreamMma));
        assert!(Fp8Path::Wgmma.kernel(1, 7168, 2048, 132, false).is_err());
        assert!(Fp8Path::Wide.kernel(1, 7168, 2048, 132, false).is_err());
        assert_eq!(Fp8Path::Wide.kernel(1, 7168, 2048, 132, true), Ok(Fp8Kernel::WgmmaWide));
        // The tile kernels by their waves (H200 at 4,096 rows: o_proj 7168 columns wide
        // 1,024 µs, narrow 1,144; q_a 1536 narrow 101, wide 122; kv_a 576 wide 52,
        // narrow 65; 256 columns narrow 33, wide 49; 256 rows of o_proj narrow 75,
        // wide 112).
        assert_eq!(tile_kernel(4096, 7168, 132), Fp8Kernel::WgmmaWide);
        assert_eq!(tile_kernel(4096, 1536, 132), Fp8Kernel::Wgmma);
        assert_eq!(tile_kernel(4096, 576, 132), Fp8Kernel::WgmmaWide);
        assert_eq!(tile_kernel(4096, 256, 132), Fp8Kernel::Wgmma);
        assert_eq!(tile_kernel(256, 7168, 132), Fp8Kernel::Wgmma);
        assert_eq!(tile_kernel(0, 7168, 132), Fp8Kernel::Wgmma);
        assert!(Fp8Path::Stream.batch_invariant() && Fp8Path::Portable.batch_invariant());
        assert!(!Fp8Path::Auto.batch_invariant() && !Fp8Path::Wgmma.batch_invariant());
        for p in Fp8Path::ALL {
            assert_eq!(Fp8Path::from_name(p.name()), Some(p));
        }
        const { assert!(WG_SMEM <= 227 * 1024) };
        // One block per SM (plus up to 4 KB of static shared memory: the scale ring)
        // within the 227 KB a block may opt into on an H100; two of the 1-tile kernel
        // (each with 1 KB reserved by the system) within its 228 KB.
        for mt in [1, 2, 4] {
            assert!(stream_smem(mt) + 4096 <= 227 * 1024, "{mt}: {}", stream_smem(mt));
        }
        assert!(2 * (stream_smem(1) + 2048 + 1024) <= 228 * 1024);
        for nt in [32, 64] {
            assert!(stream_wg_smem(nt) + 4096 <= 227 * 1024, "{nt}: {}", stream_wg_smem(nt));
        }
        assert!(2 * (stream_wg_smem(16) + 3072 + 1024) <= 228 * 1024);
    }
    #[test]
    fn experts_validation_and_tile() {
        // V3 expert up (gate_up fused), 256 experts.
        let (e, n, k) = (256, 4096, 7168);
        assert!(check_experts(e, n, k, e * n * k, e * 32 * 56).is_ok());
        assert!(check_experts(e, n, k, e * n * k - 1, e * 32 * 56).unwrap_err().contains("weight bytes"));
        assert!(check_experts(e, n, k, e * n * k, e * 32 * 56 - 1).unwrap_err().contains("scales"));
        assert!(check_experts(0, n, k, 0, 0).unwrap_err().contains("no experts"));
        assert!(check_experts(2, 200, 100, 40_000, 2).unwrap_err().contains("multiple of 128"));
        // out not a multiple of 128: two scale rows per expert.
        assert!(check_experts(3, 200, 256, 3 * 200 * 256, 3 * 2 * 2).is_ok());
        assert!(check_experts(1 << 16, 128, 128, 0, 0).unwrap_err().contains("65535"));
        assert!(check_experts(60_000, 1 << 16, 128, 0, 0).unwrap_err().contains("overflow"));
        assert_eq!(grouped_tile(2048, 256), 16); // decode: 64 sequences x 4 tokens x top-8
        assert_eq!(grouped_tile(4096, 256), 32);
        assert_eq!(grouped_tile(4096 * 8, 256), 64); // prefill
        assert_eq!(grouped_tile(1, 256), 16);
        assert_eq!(grouped_tile(0, 0), 16);
        for t in [16, 32, 64] {
            assert!(stream_wg_smem(t) + 4096 <= 227 * 1024);
        }
    }
}
