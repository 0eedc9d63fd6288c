//! GPU-vs-CPU checks of the kernels, shared by the crate's GPU tests and the
//! `mlaserve-cuda-check` binary (so the device run and `cargo test` check the same
//! things).
//!
//! Every case draws fresh random inputs (never zeros), poisons the outputs with NaN
//! before the launch (an element the kernel fails to write cannot pass), fills cache
//! slots past each request's `seq_len` and all unused pages with NaN (a kernel that
//! reads past the mask produces NaN), scatters each request's pages over the cache in a
//! shuffled order, and compares with [`crate::reference`].

use std::fmt;

use half::bf16;

use crate::reference::{self, ErrStats};
use crate::rng::Rng;
use crate::util::Util;
use mlaserve_cuda::dims::DecodeDims;
use mlaserve_cuda::plan::PAGE;
use mlaserve_cuda::Gpu;
use mlaserve_cuda::Result;
use mlaserve_cuda::{MlaDecode, MlaDecodeShape, MlaOut};

/// bf16 NaN (0x7fc0) twice: poisons a 32-bit word of bf16 pairs or an f32.
const NAN_BITS: u32 = 0x7fc0_7fc0;

/// A paged latent cache on the host, in the launch's layout (bf16 entries, or fp8 ones:
/// `kernels/kv_fp8.cuh`), with the values the reference reads: NaN everywhere (NaN codes
/// and scales in the fp8 layout) until [`HostCache::randomize`] writes an entry.
struct HostCache {
    /// The device's bf16 elements (an fp8 entry's bytes in pairs, low byte first).
    words: Vec<u16>,
    /// `[slots][lora + rope]`, as the decode kernel reads the entries (an fp8 code widened
    /// to bf16(code * scale); the CPU backend keeps the f32 product, which the backend
    /// tests compare with).
    values: Vec<f32>,
    lora: usize,
    rope: usize,
    entry: usize,
    fp8: bool,
}

impl HostCache {
    fn new(num_blocks: usize, lora: usize, rope: usize, fp8: bool) -> Self {
        let entry = mlaserve_cuda::layout::kv_entry_elems(fp8, lora, rope).expect("fp8 widths");
        let slots = num_blocks * PAGE;
        HostCache {
            words: vec![if fp8 { 0xffff } else { 0x7fc0 }; slots * entry],
            values: vec![f32::NAN; slots * (lora + rope)],
            lora,
            rope,
            entry,
            fp8,
        }
    }

    /// Fresh random values in [-1, 1) at `slot` (the fp8 latent quantised per 128).
    fn randomize(&mut self, rng: &mut Rng, slot: usize) {
        let dqk = self.lora + self.rope;
        let x: Vec<f32> = (0..dqk).map(|_| rng.uniform(-1.0, 1.0)).collect();
        let val = &mut self.values[slot * dqk..(slot + 1) * dqk];
        let w = &mut self.words[slot * self.entry..(slot + 1) * self.entry];
        if !self.fp8 {
            for ((v, w), x) in val.iter_mut().zip(w.iter_mut()).zip(&x) {
                *w = bf16::from_f32(*x).to_bits();
                *v = bf16::from_bits(*w).to_f32();
            }
            return;
        }
        let lora = self.lora;
        let groups = lora.div_ceil(128);
        let mut bytes = vec![0u8; self.entry * 2];
        for g in 0..groups {
            let (c0, c1) = (g * 128, ((g + 1) * 128).min(lora));
            let mut xg = [0f32; 128]; // a partial group padded with zeros: same amax
            xg[..c1 - c0].copy_from_slice(&x[c0..c1]);
            let (q, sc) = crate::fp8_ref::act_quant(&xg, 1, 128);
            for (c, &code) in (c0..c1).zip(&q) {
                bytes[c] = code;
                // What the kernel widens a code to: bf16(code * scale).
                val[c] = bf16::from_f32(crate::fp8_ref::e4m3_to_f32(code) * sc[0]).to_f32();
            }
            bytes[lora + 4 * g..lora + 4 * g + 4].copy_from_slice(&sc[0].to_le_bytes());
        }
        for c in 0..self.rope {
            let b = bf16::from_f32(x[lora + c]);
            val[lora + c] = b.to_f32();
            let at = lora + 4 * groups + 2 * c;
            bytes[at..at + 2].copy_from_slice(&b.to_bits().to_le_bytes());
        }
        for (i, w) in w.iter_mut().enumerate() {
            *w = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
        }
    }

    fn device_elems(&self) -> Vec<bf16> {
        self.words.iter().map(|&w| bf16::from_bits(w)).collect()
    }
}

/// One decode-attention check.
#[derive(Debug, Clone)]
pub struct DecodeCase {
    pub name: String,
    pub heads: usize,
    pub q_len: usize,
    pub dlat: usize,
    pub drope: usize,
    /// One entry per request; each `>= q_len` (seq_len counts the drafts).
    pub seq_lens: Vec<usize>,
    /// Multiplies the model scale `1/sqrt(128 + drope)`: > 1 makes the softmax peaky.
    pub scale_mult: f32,
    /// Output in f32 (else bf16).
    pub out_f32: bool,
    /// Force a split count (else the planner's).
    pub splits: Option<usize>,
}

impl DecodeCase {
    pub fn dims(&self) -> DecodeDims {
        let max = self.seq_lens.iter().copied().max().unwrap_or(1);
        DecodeDims {
            batch: self.seq_lens.len(),
            heads: self.heads,
            q_len: self.q_len,
            dlat: self.dlat,
            drope: self.drope,
            bt_stride: max.div_ceil(PAGE) + 1, // one spare entry: the kernel must not read it
        }
    }
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub struct CaseReport {
    pub name: String,
    /// "generic" or the tensor-core kernel's name (`MlaKernel::name`).
    pub kernel: &'static str,
    pub fast_path: bool,
    pub num_splits: usize,
    /// How the splits were merged ("-" for one split).
    pub merge: &'static str,
    pub out: ErrStats,
    pub lse_max_abs: f64,
    pub tol_rel_l2: f64,
    pub tol_lse: f64,
}

impl CaseReport {
    pub fn passed(&self) -> bool {
        self.out.all_finite && self.out.rel_l2 <= self.tol_rel_l2 && self.lse_max_abs <= self.tol_lse
    }
}

impl fmt::Display for CaseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<52} {:>9} splits={:<2} {:>8} rel_l2={:.2e} (tol {:.0e}) max_abs={:.2e} lse_err={:.2e} (tol {:.0e}) {}",
            self.name,
            self.kernel,
            self.num_splits,
            self.merge,
            self.out.rel_l2,
            self.tol_rel_l2,
            self.out.max_abs,
            self.lse_max_abs,
            self.tol_lse,
            if self.passed() { "PASS" } else { "FAIL" }
        )
    }
}

/// Tolerances (bf16 inputs, f32 accumulation): the fast kernel rounds the softmax
/// weights P to bf16 before P·V, as FlashMLA does (~2^-9 relative per weight), and a
/// bf16 output adds its own rounding; the generic kernel is f32 throughout.
fn tolerances(fast: bool, out_f32: bool) -> (f64, f64) {
    let rel = match (fast, out_f32) {
        (false, true) => 1e-4,
        _ => 1e-2,
    };
    (rel, 2e-3)
}

/// Runs one case on `gpu` against the CPU reference.
/// The cache holds fp8 entries when `mla` reads them ([`MlaDecode::kv_fp8`]).
pub fn run_decode_case(gpu: &Gpu, mla: &MlaDecode, util: &Util, case: &DecodeCase, seed: u64) -> Result<CaseReport> {
    if case.out_f32 {
        run_typed::<f32>(gpu, mla, util, case, seed)
    } else {
        run_typed::<bf16>(gpu, mla, util, case, seed)
    }
}

fn run_typed<T: MlaOut>(gpu: &Gpu, mla: &MlaDecode, util: &Util, case: &DecodeCase, seed: u64) -> Result<CaseReport> {
    let d = case.dims();
    let mut rng = Rng::new(seed);
    let (rows, dqk) = (d.rows(), d.dqk());

    // Pages: each request's logical pages map to distinct physical pages, shuffled, with
    // a few pages nobody owns.
    let pages_per_req: Vec<usize> = case.seq_lens.iter().map(|l| l.div_ceil(PAGE)).collect();
    let num_blocks = pages_per_req.iter().sum::<usize>() + 3;
    let mut phys: Vec<usize> = (0..num_blocks).collect();
    rng.shuffle(&mut phys);
    let mut block_table = vec![0i32; d.batch * d.bt_stride];
    let mut next = 0;
    let mut cache = HostCache::new(num_blocks, d.dlat, d.drope, mla.kv_fp8());
    for (b, &np) in pages_per_req.iter().enumerate() {
        for lp in 0..d.bt_stride {
            block_table[b * d.bt_stride + lp] = if lp < np {
                next += 1;
                phys[next - 1] as i32
            } else {
                rng.below(num_blocks) as i32 // a valid id the kernel must not use
            };
        }
        // Real data at positions < seq_len; NaN stays past it.
        for p in 0..case.seq_lens[b] {
            let page = block_table[b * d.bt_stride + p / PAGE] as usize;
            cache.randomize(&mut rng, page * PAGE + p % PAGE);
        }
    }
    let q = rng.bf16_vec(d.batch * rows * dqk, -1.0, 1.0);
    let seq_i32: Vec<i32> = case.seq_lens.iter().map(|&l| l as i32).collect();
    let scale = case.scale_mult / ((128 + d.drope) as f32).sqrt();

    let to_f32 = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let (want_out, want_lse) = reference::mla_decode(&d, &to_f32(&q), &cache.values, &block_table, &seq_i32, scale);

    let s = &gpu.stream;
    let q_d = s.clone_htod(&q)?;
    let cache_d = s.clone_htod(&cache.device_elems())?;
    let bt_d = s.clone_htod(&block_table)?;
    let sl_d = s.clone_htod(&seq_i32)?;
    let mut out_d = s.clone_htod(&vec![T::nan(); d.batch * rows * d.dlat])?;
    let mut lse_d = s.alloc_zeros::<f32>(d.batch * rows)?;
    util.poison_f32(s, &mut lse_d, NAN_BITS)?;

    let max_seq = case.seq_lens.iter().copied().max().unwrap_or(1);
    let splits = case.splits.unwrap_or_else(|| mla.num_splits(&d, max_seq));
    let mut ws = mla.workspace(s, &d, splits)?;
    // Poisoned partials: a split the kernel forgets to write shows up as NaN.
    let (o_acc, lse_acc) = ws.partials_mut();
    util.poison_f32(s, o_acc, NAN_BITS)?;
    util.poison_f32(s, lse_acc, NAN_BITS)?;
    let shape = MlaDecodeShape { dims: d, num_blocks, num_splits: splits, scale };
    mla.launch::<T>(s, &shape, &q_d, &cache_d, &bt_d, &sl_d, &mut out_d, &mut lse_d, &mut ws)?;
    gpu.sync()?;

    let got_out: Vec<f32> = s.clone_dtoh(&out_d)?.into_iter().map(MlaOut::to_f32).collect();
    let got_lse = s.clone_dtoh(&lse_d)?;
    let (tol_rel_l2, tol_lse) = tolerances(MlaDecode::is_fast_path(&d), case.out_f32);
    Ok(CaseReport {
        name: case.name.clone(),
        kernel: if MlaDecode::is_fast_path(&d) { mla.effective_kernel(&d).name() } else { "generic" },
        fast_path: MlaDecode::is_fast_path(&d),
        num_splits: splits,
        merge: mla.effective_merge(&d, splits).map_or("-", |m| m.name()),
        out: reference::err_stats(&got_out, &want_out),
        lse_max_abs: reference::lse_max_abs(&got_lse, &want_lse),
        tol_rel_l2,
        tol_lse,
    })
}

/// The outcome of [`run_window_invariance`].
#[derive(Debug, Clone)]
pub struct InvarianceReport {
    pub name: String,
    /// Query rows compared (`requests × 4 × heads`), in each of the two comparisons.
    pub rows: usize,
    /// Rows of the 4-token windows that differ in any bit from the same token run as a
    /// 1-token step of all the tokens together / of that token alone.
    pub differ_batched: usize,
    pub differ_alone: usize,
    /// Splits of the window launch.
    pub num_splits: usize,
    /// The window launch against the f64 reference.
    pub out: ErrStats,
    pub tol_rel_l2: f64,
}

impl InvarianceReport {
    pub fn passed(&self) -> bool {
        self.differ_batched == 0 && self.differ_alone == 0 && self.out.all_finite && self.out.rel_l2 <= self.tol_rel_l2
    }
}

impl fmt::Display for InvarianceReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<52} splits={:<2} rows={:<5} differ: batched {} alone {} rel_l2={:.2e} (tol {:.0e}) {}",
            self.name,
            self.num_splits,
            self.rows,
            self.differ_batched,
            self.differ_alone,
            self.out.rel_l2,
            self.tol_rel_l2,
            if self.passed() { "PASS" } else { "FAIL" }
        )
    }
}

/// Whether a token's decode attention is the same whatever else runs with it (the
/// speculative "k = 3 equals k = 0" needs it), under `mla`'s plan: requests with
/// `ctx[b]` cached tokens each run a `window`-token window (positions ctx[b]..ctx[b] +
/// window − 1: 4 for a k = 3 verification; longer ones are prefill chunks, which need
/// fixed splits; f32 out, DeepSeek dims at `heads` heads); then every one of those tokens runs as a
/// 1-token step, all of them in one batch and each alone, over the same cache and pages
/// (the window's later tokens sit in the cache past the 1-token step's seq_len, as
/// drafts do). Counts the rows that differ in any bit, and checks the windows against the
/// reference. Pages past the windows hold NaN.
pub fn run_window_invariance(
    gpu: &Gpu,
    mla: &MlaDecode,
    heads: usize,
    ctx: &[usize],
    window: usize,
    seed: u64,
) -> Result<InvarianceReport> {
    let w_len = window.max(1);
    let mut rng = Rng::new(seed);
    let batch = ctx.len();
    let seq_lens: Vec<usize> = ctx.iter().map(|&c| c + w_len).collect();
    let max = seq_lens.iter().copied().max().unwrap_or(w_len);
    let d = DecodeDims { batch, heads, q_len: w_len, dlat: 512, drope: 64, bt_stride: max.div_ceil(PAGE) + 1 };
    let (rows, dqk, dv) = (d.rows(), d.dqk(), d.dlat);
    let pages: Vec<usize> = seq_lens.iter().map(|l| l.div_ceil(PAGE)).collect();
    let num_blocks = pages.iter().sum::<usize>() + 2;
    let mut phys: Vec<usize> = (0..num_blocks).collect();
    rng.shuffle(&mut phys);
    let mut table = vec![0i32; batch * d.bt_stride];
    let mut cache = HostCache::new(num_blocks, d.dlat, d.drope, mla.kv_fp8());
    let mut next = 0;
    for b in 0..batch {
        for lp in 0..d.bt_stride {
            table[b * d.bt_stride + lp] = if lp < pages[b] {
                next += 1;
                phys[next - 1] as i32
            } else {
                rng.below(num_blocks) as i32
            };
        }
        for p in 0..seq_lens[b] {
            cache.randomize(&mut rng, table[b * d.bt_stride + p / PAGE] as usize * PAGE + p % PAGE);
        }
    }
    let q = rng.bf16_vec(batch * rows * dqk, -1.0, 1.0);
    let scale = 1.0 / ((128 + d.drope) as f32).sqrt();
    let s = &gpu.stream;
    let cache_d = s.clone_htod(&cache.device_elems())?;
    // One launch: `dims` over requests whose tables are `tab` rows of `table`.
    let run = |dims: DecodeDims, q: &[bf16], tab: &[usize], lens: &[usize]| -> Result<(Vec<f32>, usize)> {
        let t: Vec<i32> = tab.iter().flat_map(|&b| table[b * d.bt_stride..(b + 1) * d.bt_stride].to_vec()).collect();
        let l: Vec<i32> = lens.iter().map(|&x| x as i32).collect();
        let (q_d, t_d, l_d) = (s.clone_htod(q)?, s.clone_htod(&t)?, s.clone_htod(&l)?);
        let mut out = s.clone_htod(&vec![f32::NAN; dims.batch * dims.rows() * dv])?;
        let mut lse = s.alloc_zeros::<f32>(dims.batch * dims.rows())?;
        let splits = mla.num_splits(&dims, lens.iter().copied().max().unwrap_or(1));
        let mut ws = mla.workspace(s, &dims, splits)?;
        let shape = MlaDecodeShape { dims, num_blocks, num_splits: splits, scale };
        mla.launch::<f32>(s, &shape, &q_d, &cache_d, &t_d, &l_d, &mut out, &mut lse, &mut ws)?;
        gpu.sync()?;
        Ok((s.clone_dtoh(&out)?, splits))
    };
    let all: Vec<usize> = (0..batch).collect();
    let (win, num_splits) = run(d, &q, &all, &seq_lens)?;
    // Token (b, j) as a 1-token step: query rows j·heads.. of request b's window.
    let tok_q = |b: usize, j: usize| q[(b * rows + j * heads) * dqk..(b * rows + (j + 1) * heads) * dqk].to_vec();
    let win_rows = |b: usize, j: usize| &win[(b * rows + j * heads) * dv..(b * rows + (j + 1) * heads) * dv];
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    let one = DecodeDims { q_len: 1, ..d };
    let toks: Vec<(usize, usize)> = (0..batch).flat_map(|b| (0..w_len).map(move |j| (b, j))).collect();
    let q1: Vec<bf16> = toks.iter().flat_map(|&(b, j)| tok_q(b, j)).collect();
    let tab1: Vec<usize> = toks.iter().map(|&(b, _)| b).collect();
    let len1: Vec<usize> = toks.iter().map(|&(b, j)| ctx[b] + j + 1).collect();
    let (batched, _) = run(DecodeDims { batch: toks.len(), ..one }, &q1, &tab1, &len1)?;
    let mut differ_batched = 0;
    let mut differ_alone = 0;
    for (i, &(b, j)) in toks.iter().enumerate() {
        let w = win_rows(b, j);
        for h in 0..heads {
            let r = h * dv..(h + 1) * dv;
            differ_batched +=
                usize::from(!same(&w[r.clone()], &batched[(i * heads + h) * dv..(i * heads + h + 1) * dv]));
        }
        let (alone, _) = run(DecodeDims { batch: 1, ..one }, &tok_q(b, j), &[b], &[ctx[b] + j + 1])?;
        for h in 0..heads {
            let r = h * dv..(h + 1) * dv;
            differ_alone += usize::from(!same(&w[r.clone()], &alone[r]));
        }
    }
    let to_f32 = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
    let lens_i: Vec<i32> = seq_lens.iter().map(|&l| l as i32).collect();
    let (want, _) = reference::mla_decode(&d, &to_f32(&q), &cache.values, &table, &lens_i, scale);
    Ok(InvarianceReport {
        name: format!("h{heads} windows of {w_len} at {ctx:?}"),
        rows: batch * w_len * heads,
        differ_batched,
        differ_alone,
        num_splits,
        out: reference::err_stats(&win, &want),
        tol_rel_l2: tolerances(true, true).0,
    })
}

/// The standard case list: tiny-model dims on the generic kernel; DeepSeek dims (512 +
/// 64) at 16/32/64/128 heads, q_len 1..4, page-boundary and shortest lengths, forced
/// uneven and empty splits, both output types and a peaky softmax.
pub fn standard_cases() -> Vec<DecodeCase> {
    let c = |name: &str, heads, q_len, dlat, drope, seq_lens: &[usize], scale_mult, out_f32, splits| DecodeCase {
        name: name.to_string(),
        heads,
        q_len,
        dlat,
        drope,
        seq_lens: seq_lens.to_vec(),
        scale_mult,
        out_f32,
        splits,
    };
    vec![
        c("tiny h4 s1 dlat32+8 f32", 4, 1, 32, 8, &[1, 17, 64, 65, 200], 1.0, true, None),
        c("tiny h4 s4 dlat32+8 bf16", 4, 4, 32, 8, &[4, 63, 130], 1.0, false, None),
        c("small h16 s2 dlat64+16 f32", 16, 2, 64, 16, &[2, 100, 129], 4.0, true, None),
        c("v3 h16 s1 (TP8) f32", 16, 1, 512, 64, &[1, 63, 64, 65, 1000], 1.0, true, None),
        c("v3 h16 s4 (TP8, 64 rows) bf16", 16, 4, 512, 64, &[4, 130, 777, 2049], 1.0, false, None),
        c("v3 h32 s3 (96 rows, partial tile) f32", 32, 3, 512, 64, &[3, 300, 901], 1.0, true, None),
        c("v3 h64 s2 forced 7 splits f32", 64, 2, 512, 64, &[2, 40, 700], 1.0, true, Some(7)),
        c("v3 h128 s4 (TP1) bf16", 128, 4, 512, 64, &[300, 1029], 1.0, false, None),
        c("v3 h128 s4 (TP1) f32 peaky", 128, 4, 512, 64, &[257, 640], 8.0, true, Some(3)),
        c("v3 h128 s1 batch1 long, auto split f32", 128, 1, 512, 64, &[4096], 1.0, true, None),
        c(
            "v3 h16 s2 many requests bf16",
            16,
            2,
            512,
            64,
            &[2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377],
            1.0,
            false,
            None,
        ),
        // Exactly two splits: the 64-token kernels merge them in a cluster of two CTAs
        // (SplitMerge::Cluster, the default), the others with the combine kernel. Lengths
        // of one page or less leave the second split empty.
        c("v3 h16 s1 2 splits (one split empty) f32", 16, 1, 512, 64, &[1, 63, 64, 65, 129, 1000], 1.0, true, Some(2)),
        c("v3 h16 s2 2 splits bf16", 16, 2, 512, 64, &[2, 64, 130, 777], 1.0, false, Some(2)),
        c("v3 h16 s4 (64 rows) 2 splits bf16", 16, 4, 512, 64, &[4, 65, 128, 2049], 1.0, false, Some(2)),
        c("v3 h32 s3 (96 rows, partial tile) 2 splits f32 peaky", 32, 3, 512, 64, &[3, 300, 901], 8.0, true, Some(2)),
    ]
}

/// The outcome of one small-kernel check (RMSNorm, SiLU-mul, argmax).
#[derive(Debug, Clone)]
pub struct OpReport {
    pub name: String,
    /// Relative L2 error, or the number of mismatching rows for argmax.
    pub metric: f64,
    pub tol: f64,
    pub all_finite: bool,
}

impl OpReport {
    pub fn passed(&self) -> bool {
        self.all_finite && self.metric <= self.tol
    }
}

impl fmt::Display for OpReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:<44} err={:.2e} (tol {:.0e}) {}",
            self.name,
            self.metric,
            self.tol,
            if self.passed() { "PASS" } else { "FAIL" }
        )
    }
}

fn op_report(name: String, got: &[f32], want: &[f32], tol: f64) -> OpReport {
    let e = reference::err_stats(got, want);
    OpReport { name, metric: e.rel_l2, tol, all_finite: e.all_finite }
}

/// RMSNorm (plain and fused add), SiLU-mul and argmax against the CPU reference at
/// DeepSeek-V3's widths (hidden 7168, dense intermediate 18432, MoE intermediate 2048,
/// vocab 129280) and small/odd widths (the scalar paths). Tolerance: relative L2 1e-2
/// for bf16 outputs; argmax exact, with planted ties and NaNs.
pub fn run_op_checks(gpu: &Gpu, seed: u64) -> Result<Vec<OpReport>> {
    use mlaserve_cuda::elementwise::{Argmax, RmsNorm, SiluMul};
    let s = &gpu.stream;
    let mut rng = Rng::new(seed);
    let mut out = Vec::new();
    let f32s = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();

    let norm = RmsNorm::new(gpu)?;
    for (rows, h) in [(1, 7168), (7, 7168), (64, 2048), (5, 36), (3, 64)] {
        let eps = 1e-6;
        let x = rng.bf16_vec(rows * h, -2.0, 2.0);
        let res = rng.bf16_vec(rows * h, -2.0, 2.0);
        let w = rng.bf16_vec(h, 0.5, 1.5);
        let (xd, wd) = (s.clone_htod(&x)?, s.clone_htod(&w)?);
        let mut od = s.clone_htod(&vec![bf16::NAN; rows * h])?;
        norm.rmsnorm(s, &mut od, &xd, &wd, eps)?;
        gpu.sync()?;
        let want = reference::rmsnorm(&f32s(&x), &f32s(&w), h, eps);
        out.push(op_report(format!("rmsnorm rows={rows} h={h}"), &f32s(&s.clone_dtoh(&od)?), &want, 1e-2));

        let mut xd = s.clone_htod(&x)?;
        let mut rd = s.clone_htod(&res)?;
        norm.fused_add_rmsnorm(s, &mut xd, &mut rd, &wd, eps)?;
        gpu.sync()?;
        let (want_x, want_r) = reference::fused_add_rmsnorm(&f32s(&x), &f32s(&res), &f32s(&w), h, eps);
        out.push(op_report(
            format!("fused add+rmsnorm rows={rows} h={h} (out)"),
            &f32s(&s.clone_dtoh(&xd)?),
            &want_x,
            1e-2,
        ));
        out.push(op_report(
            format!("fused add+rmsnorm rows={rows} h={h} (residual)"),
            &f32s(&s.clone_dtoh(&rd)?),
            &want_r,
            1e-2,
        ));
    }

    let silu = SiluMul::new(gpu)?;
    for (rows, d) in [(1, 18432), (8, 2048), (64, 256), (3, 20)] {
        let x = rng.bf16_vec(rows * 2 * d, -4.0, 4.0);
        let xd = s.clone_htod(&x)?;
        let mut od = s.clone_htod(&vec![bf16::NAN; rows * d])?;
        silu.launch(s, &mut od, &xd, d)?;
        gpu.sync()?;
        let want = reference::silu_mul(&f32s(&x), d);
        out.push(op_report(format!("silu_mul rows={rows} d={d}"), &f32s(&s.clone_dtoh(&od)?), &want, 1e-2));
    }

    let amax = Argmax::new(gpu)?;
    // The vocabulary-parallel head: each rank's (value, id) pair over its slice, then the
    // group's ids from the pairs in rank order, against the argmax of the whole rows.
    for (rows, vocab, world) in [(8, 129280, 2), (64, 1000, 8), (3, 40, 4)] {
        let part = vocab / world;
        let mut logits: Vec<f32> = (0..rows * vocab).map(|_| rng.uniform(-10.0, 10.0)).collect();
        for r in 0..rows {
            let row = &mut logits[r * vocab..][..vocab];
            // A tie at the maximum across two slices, a NaN; the last row all NaN.
            let (a, b) = (rng.below(part), part + rng.below(vocab - part));
            row[a] = 20.0;
            row[b] = 20.0;
            row[rng.below(vocab)] = f32::NAN;
            if r == rows - 1 {
                row.fill(f32::NAN);
            }
        }
        let mut pairs = Vec::with_capacity(2 * rows * world);
        for rk in 0..world {
            let slice: Vec<f32> = (0..rows).flat_map(|r| logits[r * vocab + rk * part..][..part].to_vec()).collect();
            let mut pd = s.alloc_zeros::<f32>(2 * rows)?;
            amax.argmax_pair_f32(s, &s.clone_htod(&slice)?, &mut pd, part, rk * part)?;
            pairs.extend(s.clone_dtoh(&pd)?);
        }
        let mut od = s.clone_htod(&vec![-1i32; rows])?;
        amax.best_of_pairs(s, &s.clone_htod(&pairs)?, &mut od, world)?;
        gpu.sync()?;
        let got = s.clone_dtoh(&od)?;
        let host = mlaserve_cuda::vocab::best_of_ranks(&pairs, rows, world);
        let want = reference::argmax(&logits, vocab);
        let mismatches = (0..rows).filter(|&r| got[r] as i64 != want[r] as i64 || host[r] != want[r]).count();
        out.push(OpReport {
            name: format!("argmax_pairs_best rows={rows} vocab={vocab} world={world} (ties, NaN)"),
            metric: mismatches as f64,
            tol: 0.0,
            all_finite: true,
        });
    }
    for (rows, vocab, as_bf16) in
        [(1, 129280, false), (8, 129280, false), (64, 1000, false), (3, 37, false), (8, 129280, true)]
    {
        let mut logits: Vec<f32> = (0..rows * vocab).map(|_| rng.uniform(-10.0, 10.0)).collect();
        for r in 0..rows {
            let row = &mut logits[r * vocab..][..vocab];
            // A tie at the maximum (the lower index must win) and a NaN that must lose.
            let (a, b) = (rng.below(vocab), rng.below(vocab));
            row[a] = 20.0;
            row[b] = 20.0;
            row[rng.below(vocab)] = f32::NAN;
        }
        let logits: Vec<f32> =
            if as_bf16 { logits.iter().map(|&v| bf16::from_f32(v).to_f32()).collect() } else { logits };
        let mut od = s.clone_htod(&vec![-1i32; rows])?;
        if as_bf16 {
            let lb: Vec<bf16> = logits.iter().map(|&v| bf16::from_f32(v)).collect();
            amax.argmax(s, &s.clone_htod(&lb)?, &mut od, vocab)?;
        } else {
            amax.argmax(s, &s.clone_htod(&logits)?, &mut od, vocab)?;
        }
        gpu.sync()?;
        let got = s.clone_dtoh(&od)?;
        let want = reference::argmax(&logits, vocab);
        let mismatches = got.iter().zip(&want).filter(|(g, w)| **g as i64 != **w as i64).count();
        out.push(OpReport {
            name: format!("argmax_{} rows={rows} vocab={vocab} (ties, NaN)", if as_bf16 { "bf16" } else { "f32" }),
            metric: mismatches as f64,
            tol: 0.0,
            all_finite: true,
        });
    }
    Ok(out)
}
