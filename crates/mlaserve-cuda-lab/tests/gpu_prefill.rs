//! The expanded-form prefill attention (`kernels/mla_prefill.cu`, `prefill.rs`) on the GPU.
//!
//! Kernel level, against `reference::mla_prefill` (f64) on fresh random inputs: DeepSeek
//! head dims (128 + 64, v 128) at 1, 8 and 128 heads and the small instance (tiny-v3's
//! 16 + 8, v 24; 32 + 32, v 64), lengths crossing the 64-row and 64-key tiles and the
//! 64-token pages (1, 63, 64, 65, 300, 700, 2000), chunks over a cached prefix, several
//! sequences per call with other paths' rows between them (NaN-poisoned: they must stay
//! untouched). Tolerance: relative L2 ≤ 1e-2 over the written outputs (bf16 inputs, P and
//! the output rounded to bf16), every written value finite. A sequence's rows are
//! bit-identical alone and in company (batch invariance). The whole path (gather from a
//! shuffled paged cache, K/V up-projection on both GEMMs, kernel) against the reference
//! fed the f64 up-projection of the same latents.
//!
//! Backend level (`CudaBackend` on tiny-v3 with every layer dense — see `tiny_dir` — and
//! `max_position_embeddings` raised to 1024): a mixed prefill step (700-, 130- and 65-token prompts in the expanded form, a
//! 3-token one in the absorbed form), a step with the second 130-token chunk of a prompt
//! beside decode windows of 4, and a 1-token decode step; every row's logits within 2e-2
//! of max|ref| of the CPU backend, with the expanded form by default, forced on every row,
//! with the invariant GEMM, and forced off (the old absorbed path), and the default within
//! 2e-2 of the forced-off run. Rows whose f32 routing lies within 5e-3 of a tie are
//! reported, not asserted (see gpu_backend.rs).
#![cfg(feature = "cuda")]

// The GPU test helpers of mlaserve-cuda's own tests, shared rather than copied.
#[path = "../../mlaserve-cuda/tests/common/mod.rs"]
mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use half::bf16;
use mlaserve_core::{Backend, Batch, SeqChunk};
use mlaserve_cpu::CpuBackend;
use mlaserve_cuda::linear::{Gemm, GemmMode, Linear, TcKernels};
use mlaserve_cuda::prefill::{LatentCache, MlaPrefill, PrefillDims, PrefillKernel, PrefillPlan, PrefillSeq};
use mlaserve_cuda::rope::RopeTables;
use mlaserve_cuda::{CudaBackend, CudaOptions, Gpu, PrefillPath};
use mlaserve_cuda_lab::reference::{self, err_stats};
use mlaserve_cuda_lab::rng::Rng;
use mlaserve_cuda_lab::util::Util;

use common::{require_gpu, require_gpus};

/// Two bf16 NaNs: a row the kernel must not write keeps these bits.
const POISON: u32 = 0x7fc1_7fc1;
const POISON_BF16: u16 = 0x7fc1;
/// Relative L2 of a kernel's output against the f64 reference.
const KERNEL_TOL: f64 = 1e-2;

fn v3(heads: usize) -> PrefillDims {
    PrefillDims { heads, nope: 128, rope: 64, vdim: 128 }
}

/// The attention kernels this GPU runs: mma.sync, and wgmma (cp.async and TMA) on Hopper.
fn kernels(g: &Gpu) -> Vec<MlaPrefill> {
    let mut v = Vec::new();
    for k in [PrefillKernel::MmaSync, PrefillKernel::Wgmma, PrefillKernel::WgmmaTma] {
        if k != PrefillKernel::MmaSync && g.compute_capability != (9, 0) {
            continue;
        }
        v.push(MlaPrefill::new(g, k).expect("prefill"));
    }
    v
}

fn rand(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
}
fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}
fn to_bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// Sequences of `(new tokens, cached prefix)` one after another, `gap` rows of another
/// path before each and after the last; returns them and the rows in all.
fn layout(parts: &[(usize, usize)], gap: usize) -> (Vec<PrefillSeq>, usize) {
    let mut row = 0;
    let mut seqs = Vec::new();
    for (j, &(len, prefix)) in parts.iter().enumerate() {
        row += gap;
        seqs.push(PrefillSeq { q_row0: row, q_len: len, k_len: prefix + len, table_row: j });
        row += len;
    }
    (seqs, row + gap)
}

/// RoPE tables (YaRN-style attention factor 1.25) on the device and the host.
fn rope_tables(g: &Gpu, rope: usize, max_pos: usize) -> (RopeTables, Vec<f32>, Vec<f32>) {
    let inv: Vec<f64> = (0..rope / 2).map(|i| 1.0 / 10000f64.powf((2 * i) as f64 / rope as f64)).collect();
    let (cos, sin) = mlaserve_cuda::rope::rope_tables(&inv, 1.25, max_pos);
    (RopeTables::new(&g.stream, &inv, 1.25, max_pos).expect("rope tables"), cos, sin)
}

/// Each row's position (queries at the end of their keys; other rows 0).
fn positions(seqs: &[PrefillSeq], rows: usize) -> Vec<usize> {
    let mut pos = vec![0; rows];
    for s in seqs {
        for i in 0..s.q_len {
            pos[s.q_row0 + i] = s.k_len - s.q_len + i;
        }
    }
    pos
}

/// Host inputs of a kernel call: q `[rows][heads][qk]` f32 and bf16-valued keys.
struct Inputs {
    q: Vec<f32>,
    kn: Vec<f32>,
    kpe: Vec<f32>,
    v: Vec<f32>,
}

impl Inputs {
    fn random(rng: &mut Rng, d: &PrefillDims, rows: usize, keys: usize) -> Self {
        let h = d.heads;
        Inputs {
            q: rand(rng, rows * h * d.qk()),
            kn: rounded(&rand(rng, keys * h * d.nope)),
            kpe: rounded(&rand(rng, keys * d.rope)),
            v: rounded(&rand(rng, keys * h * d.vdim)),
        }
    }
}

/// Runs the attention kernel on `x` into a NaN-poisoned output; returns its bits.
fn run_kernel(
    g: &Gpu,
    pre: &MlaPrefill,
    d: &PrefillDims,
    seqs: &[PrefillSeq],
    rows: usize,
    x: &Inputs,
    rope: &RopeTables,
    scale: f32,
) -> Vec<u16> {
    let s = &g.stream;
    let plan = PrefillPlan::new(s, seqs).expect("plan");
    let q = s.clone_htod(&x.q).expect("q");
    let (kn, kpe, v) = (
        s.clone_htod(&to_bf(&x.kn)).expect("kn"),
        s.clone_htod(&to_bf(&x.kpe)).expect("kpe"),
        s.clone_htod(&to_bf(&x.v)).expect("v"),
    );
    let mut o = s.alloc_zeros::<bf16>(rows * d.heads * d.vdim).expect("o");
    Util::new(g).expect("util").poison_bf16(s, &mut o, POISON).expect("poison");
    pre.attention(s, &plan, d, scale, &q, &kn, &kpe, &v, rope, &mut o).expect("attention");
    let out = s.clone_dtoh(&o).expect("dtoh");
    g.sync().expect("sync");
    out.iter().map(|b| b.to_bits()).collect()
}

/// Compares a kernel output (bits) with the reference over the query rows of the heads
/// in `only` (all when `None`); every query row must be finite, every other row
/// untouched. Returns the relative L2 error.
fn compare(
    name: &str,
    d: &PrefillDims,
    seqs: &[PrefillSeq],
    rows: usize,
    got: &[u16],
    want: &[f32],
    only: Option<&[usize]>,
    fails: &mut Vec<String>,
) -> f64 {
    let w = d.heads * d.vdim;
    let mut is_q = vec![false; rows];
    for s in seqs {
        is_q[s.q_row0..s.q_row0 + s.q_len].iter_mut().for_each(|x| *x = true);
    }
    let heads: Vec<usize> = only.map_or_else(|| (0..d.heads).collect(), <[usize]>::to_vec);
    let (mut g, mut r) = (Vec::new(), Vec::new());
    let (mut untouched, mut finite) = (true, true);
    for (row, &q) in is_q.iter().enumerate() {
        let bits = &got[row * w..(row + 1) * w];
        if !q {
            untouched &= bits.iter().all(|&b| b == POISON_BF16);
            continue;
        }
        finite &= bits.iter().all(|&b| bf16::from_bits(b).is_finite());
        for &h in &heads {
            let at = row * w + h * d.vdim;
            g.extend(got[at..at + d.vdim].iter().map(|&b| bf16::from_bits(b).to_f32()));
            r.extend_from_slice(&want[at..at + d.vdim]);
        }
    }
    let e = err_stats(&g, &r);
    let ok = e.all_finite && finite && untouched && e.rel_l2 <= KERNEL_TOL;
    println!(
        "{name:<62} rel L2 {:.2e} max|d| {:.2e} finite {} untouched {} {}",
        e.rel_l2,
        e.max_abs,
        e.all_finite && finite,
        untouched,
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        fails.push(format!("{name}: rel {:.3e}, finite {finite}, untouched {untouched}", e.rel_l2));
    }
    e.rel_l2
}

/// One kernel case on fresh random inputs against the reference.
fn kernel_case(
    g: &Gpu,
    pre: &MlaPrefill,
    d: PrefillDims,
    parts: &[(usize, usize)],
    gap: usize,
    only: Option<&[usize]>,
    seed: u64,
    fails: &mut Vec<String>,
) {
    let (seqs, rows) = layout(parts, gap);
    let keys: usize = seqs.iter().map(|s| s.k_len).sum();
    let mut rng = Rng::new(seed);
    let x = Inputs::random(&mut rng, &d, rows, keys);
    let max_pos = seqs.iter().map(|s| s.k_len).max().unwrap_or(1);
    let (rope, cos, sin) = rope_tables(g, d.rope, max_pos);
    let scale = 0.9 / (d.qk() as f32).sqrt();
    let got = run_kernel(g, pre, &d, &seqs, rows, &x, &rope, scale);
    let qr = reference::rope_query(&x.q, &positions(&seqs, rows), d.heads, d.nope, &cos, &sin, d.rope);
    let want = reference::mla_prefill(&d, &seqs, &qr, &x.kn, &x.kpe, &x.v, scale, only);
    let name = format!(
        "{:?}: heads {} qk {}+{} v {} {:?}{}",
        pre.kernel,
        d.heads,
        d.nope,
        d.rope,
        d.vdim,
        parts,
        only.map_or(String::new(), |h| format!(" heads {h:?}"))
    );
    compare(&name, &d, &seqs, rows, &got, &want, only, fails);
}

const LENS: [(usize, usize); 6] = [(1, 0), (63, 0), (64, 0), (65, 0), (300, 0), (2000, 0)];

#[test]
fn kernel_matches_reference_deepseek_dims() {
    if !require_gpu() {
        return;
    }
    let g = Gpu::new(0).expect("gpu");
    let mut fails = Vec::new();
    for pre in kernels(&g) {
        // One head: every length in one call, a row of another path between sequences.
        kernel_case(&g, &pre, v3(1), &LENS, 1, None, 1, &mut fails);
        // 8 heads: the lengths again plus chunks over cached prefixes (a page-crossing
        // prefix, a single new token at position 1999, a chunk starting on a page boundary,
        // one starting at position 1, a 130-row chunk over 170 cached tokens).
        let mut parts = LENS.to_vec();
        parts.extend([(65, 100), (1, 1999), (64, 64), (5, 1), (130, 170)]);
        kernel_case(&g, &pre, v3(8), &parts, 2, None, 2, &mut fails);
        // DeepSeek-V3's 128 heads: every head up to 300 + a chunk; 2000 tokens on 3 heads.
        let parts = [(1, 0), (63, 0), (64, 0), (65, 0), (300, 0), (130, 300)];
        kernel_case(&g, &pre, v3(128), &parts, 0, None, 3, &mut fails);
        kernel_case(&g, &pre, v3(128), &[(2000, 0), (64, 1000)], 1, Some(&[0, 57, 127]), 4, &mut fails);
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

#[test]
fn kernel_matches_reference_small_dims() {
    if !require_gpu() {
        return;
    }
    let g = Gpu::new(0).expect("gpu");
    let mut fails = Vec::new();
    let parts = [(1, 0), (63, 0), (64, 0), (65, 0), (300, 0), (700, 0), (400, 300)];
    for pre in kernels(&g) {
        // tiny-v3's heads (padded to the 64 + 64 instance) and an exactly 64-wide one.
        let tiny = PrefillDims { heads: 8, nope: 16, rope: 8, vdim: 24 };
        kernel_case(&g, &pre, tiny, &parts, 1, None, 5, &mut fails);
        kernel_case(&g, &pre, PrefillDims { heads: 2, nope: 32, rope: 32, vdim: 64 }, &parts, 0, None, 6, &mut fails);
        // The large instance with dims below its padding (V2-Lite-like widths pass through).
        let lite = PrefillDims { heads: 4, nope: 64, rope: 32, vdim: 96 };
        kernel_case(&g, &pre, lite, &parts[..5], 1, None, 7, &mut fails);
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

/// A sequence's rows are the same bits alone and among others (other rows before it,
/// other keys before its keys, its tiles in another place of the CTA order).
#[test]
fn kernel_is_batch_invariant() {
    if !require_gpu() {
        return;
    }
    let g = Gpu::new(0).expect("gpu");
    let d = v3(8);
    let (seqs, rows) = layout(&[(65, 0), (300, 50), (130, 20)], 3);
    let keys: usize = seqs.iter().map(|s| s.k_len).sum();
    let mut rng = Rng::new(8);
    let all = Inputs::random(&mut rng, &d, rows, keys);
    let (rope, _, _) = rope_tables(&g, d.rope, 350);
    let scale = 1.0 / (d.qk() as f32).sqrt();
    // The middle sequence alone: its query rows and its keys cut out.
    let x = seqs[1];
    let k0 = seqs[0].k_len;
    let (h, qk) = (d.heads, d.qk());
    let alone_in = Inputs {
        q: all.q[x.q_row0 * h * qk..(x.q_row0 + x.q_len) * h * qk].to_vec(),
        kn: all.kn[k0 * h * d.nope..(k0 + x.k_len) * h * d.nope].to_vec(),
        kpe: all.kpe[k0 * d.rope..(k0 + x.k_len) * d.rope].to_vec(),
        v: all.v[k0 * h * d.vdim..(k0 + x.k_len) * h * d.vdim].to_vec(),
    };
    let one = [PrefillSeq { q_row0: 0, table_row: 0, ..x }];
    let w = h * d.vdim;
    for pre in kernels(&g) {
        let together = run_kernel(&g, &pre, &d, &seqs, rows, &all, &rope, scale);
        let alone = run_kernel(&g, &pre, &d, &one, x.q_len, &alone_in, &rope, scale);
        let same = alone[..] == together[x.q_row0 * w..(x.q_row0 + x.q_len) * w];
        println!("{:?}: 300 rows over 350 keys alone == among two other sequences: {same}", pre.kernel);
        assert!(same, "{:?}: the kernel's result for a sequence depends on what shares the call", pre.kernel);
    }
}

/// The whole expanded path: latents gathered from a paged cache (pages shuffled, slots
/// past each sequence NaN), K and V up-projected by the GEMM (cuBLAS and the invariant
/// kernel), the kernel; against the reference fed the f64 up-projection of the same bf16
/// latents. With the invariant GEMM a sequence's rows are also the same bits alone.
#[test]
fn expanded_path_from_paged_cache_matches_reference() {
    if !require_gpu() {
        return;
    }
    let g = Gpu::new(0).expect("gpu");
    let s = &g.stream;
    let pre = MlaPrefill::new(&g, PrefillKernel::default()).expect("prefill");
    let mut fails = Vec::new();
    let lora = 512;
    for (d, parts, lora) in [
        (v3(16), vec![(300, 0), (65, 200), (1, 63), (64, 0)], lora),
        (PrefillDims { heads: 8, nope: 16, rope: 8, vdim: 24 }, vec![(700, 0), (130, 130), (5, 0)], 32),
    ] {
        let (seqs, rows) = layout(&parts, 1);
        let lat = lora + d.rope;
        let pages: Vec<usize> = seqs.iter().map(|q| q.k_len.div_ceil(64)).collect();
        let bt_stride = *pages.iter().max().expect("pages");
        let num_blocks = pages.iter().sum::<usize>() + 3;
        let mut rng = Rng::new(40 + d.heads as u64);
        // Cache: NaN everywhere, then each sequence's positions 0..k_len on shuffled pages.
        let mut order: Vec<usize> = (0..num_blocks).collect();
        rng.shuffle(&mut order);
        let mut cache = vec![f32::NAN; num_blocks * 64 * lat];
        let mut tables = vec![0i32; seqs.len() * bt_stride];
        let mut lat_rows: Vec<Vec<f32>> = Vec::new(); // per sequence, [k_len][lat]
        let mut next = 0;
        for (j, q) in seqs.iter().enumerate() {
            for p in 0..pages[j] {
                tables[j * bt_stride + p] = order[next] as i32;
                next += 1;
            }
            let rowsv = rounded(&rand(&mut rng, q.k_len * lat));
            for p in 0..q.k_len {
                let slot = tables[j * bt_stride + p / 64] as usize * 64 + p % 64;
                cache[slot * lat..(slot + 1) * lat].copy_from_slice(&rowsv[p * lat..(p + 1) * lat]);
            }
            lat_rows.push(rowsv);
        }
        let a = 1.0 / (lora as f32).sqrt();
        let wuk = rounded(&rand(&mut rng, d.heads * d.nope * lora).iter().map(|x| x * a).collect::<Vec<_>>());
        let wuv = rounded(&rand(&mut rng, d.heads * d.vdim * lora).iter().map(|x| x * a).collect::<Vec<_>>());
        let q = rand(&mut rng, rows * d.heads * d.qk());
        // Reference K, V: f64 up-projection of the bf16 latents.
        let up = |w: &[f32], width: usize| -> Vec<f32> {
            let all: Vec<&[f32]> = lat_rows.iter().flat_map(|r| r.chunks(lat)).collect();
            let mut out = vec![0f32; all.len() * d.heads * width];
            std::thread::scope(|sc| {
                let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
                let per = (all.len().div_ceil(threads) * d.heads * width).max(1);
                for (i, chunk) in out.chunks_mut(per).enumerate() {
                    let all = &all;
                    sc.spawn(move || {
                        for (k, o) in chunk.iter_mut().enumerate() {
                            let idx = i * per + k;
                            let (t, hw) = (idx / (d.heads * width), idx % (d.heads * width));
                            *o = (0..lora).map(|x| all[t][x] as f64 * w[hw * lora + x] as f64).sum::<f64>() as f32;
                        }
                    });
                }
            });
            out
        };
        let (kn, v) = (up(&wuk, d.nope), up(&wuv, d.vdim));
        let kpe: Vec<f32> = lat_rows.iter().flat_map(|r| r.chunks(lat).flat_map(|x| x[lora..].to_vec())).collect();
        let max_pos = seqs.iter().map(|q| q.k_len).max().unwrap_or(1);
        let (rope, cos, sin) = rope_tables(&g, d.rope, max_pos);
        let scale = 1.0 / (d.qk() as f32).sqrt();
        let qr = reference::rope_query(&q, &positions(&seqs, rows), d.heads, d.nope, &cos, &sin, d.rope);
        let want = reference::mla_prefill(&d, &seqs, &qr, &kn, &kpe, &v, scale, None);

        let cache_d = s.clone_htod(&to_bf(&cache)).expect("cache");
        let tables_d = s.clone_htod(&tables).expect("tables");
        let lc =
            LatentCache { data: &cache_d, fp8: false, tables: &tables_d, bt_stride, num_blocks, lora, rope: d.rope };
        let w_uk = Linear::from_f32(s, &wuk, d.heads * d.nope, lora).expect("w_uk");
        let w_uv = Linear::from_f32(s, &wuv, d.heads * d.vdim, lora).expect("w_uv");
        let q_d = s.clone_htod(&q).expect("q");
        let util = Util::new(&g).expect("util");
        let run = |gemm: &Gemm, seqs: &[PrefillSeq], q_d: &cudarc::driver::CudaSlice<f32>, rows: usize| {
            let plan = PrefillPlan::new(s, seqs).expect("plan");
            let mut o = s.alloc_zeros::<bf16>(rows * d.heads * d.vdim).expect("o");
            util.poison_bf16(s, &mut o, POISON).expect("poison");
            pre.forward(s, gemm, (&w_uk, &w_uv), &plan, &d, scale, q_d, &lc, &rope, &mut o).expect("forward");
            let out = s.clone_dtoh(&o).expect("dtoh");
            g.sync().expect("sync");
            out.iter().map(|b| b.to_bits()).collect::<Vec<u16>>()
        };
        for mode in [GemmMode::Cublas, GemmMode::BatchInvariant] {
            let gemm = Gemm::new(&g, mode, TcKernels::Auto).expect("gemm");
            let got = run(&gemm, &seqs, &q_d, rows);
            let name = format!("path {mode:?} heads {} qk {}+{} lora {lora} {parts:?}", d.heads, d.nope, d.rope);
            compare(&name, &d, &seqs, rows, &got, &want, None, &mut fails);
            if mode == GemmMode::BatchInvariant {
                // The second sequence alone (its own block-table row, the same pages).
                let x = seqs[1];
                let w = d.heads * d.qk();
                let q1 = s.clone_htod(&q[x.q_row0 * w..(x.q_row0 + x.q_len) * w]).expect("q1");
                let alone = run(&gemm, &[PrefillSeq { q_row0: 0, ..x }], &q1, x.q_len);
                let wo = d.heads * d.vdim;
                let same = alone[..] == got[x.q_row0 * wo..(x.q_row0 + x.q_len) * wo];
                println!("{name}: sequence 1 alone == in company: {same}");
                if !same {
                    fails.push(format!("{name}: not batch-invariant"));
                }
            }
        }
    }
    assert!(fails.is_empty(), "failed: {fails:?}");
}

// ---------------------------------------------------------------------------------------
// Backend level: tiny-v3.

const BLOCKS: usize = 32;
const TOL: f64 = 2e-2;

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 2 + (seed.wrapping_mul(7919) + i * 131) % 509).collect()
}

/// The scenario's sequences: full token lists and block tables (distinct blocks < 20,
/// not in order).
fn sequences() -> Vec<(Vec<u32>, Vec<u32>)> {
    let ids: Vec<u32> = (0..20).map(|i| (i * 7) % 20).collect();
    let lens = [705usize, 261, 4, 70];
    let mut at = 0;
    lens.iter()
        .enumerate()
        .map(|(j, &len)| {
            let nb = len.div_ceil(64);
            let t = ids[at..at + nb].to_vec();
            at += nb;
            (toks(11 + j as u32, len), t)
        })
        .collect()
}

/// The steps: `(sequence, first position, new tokens)` per chunk.
fn steps() -> Vec<Vec<(usize, usize, usize)>> {
    vec![
        // Mixed prefill: A 700, B's first 130, C 3 (absorbed: a window), D 65.
        vec![(0, 0, 700), (1, 0, 130), (2, 0, 3), (3, 0, 65)],
        // A decode window of 4, B's second chunk of 130 over its 130 cached, D a window.
        vec![(0, 700, 4), (1, 130, 130), (3, 65, 4)],
        // One token each.
        vec![(0, 704, 1), (1, 260, 1), (2, 3, 1), (3, 69, 1)],
    ]
}

fn batch_of(seqs: &[(Vec<u32>, Vec<u32>)], step: &[(usize, usize, usize)]) -> Batch {
    let chunks: Vec<SeqChunk> = step
        .iter()
        .map(|&(j, p, n)| SeqChunk {
            tokens: seqs[j].0[p..p + n].to_vec(),
            start_pos: p,
            block_table: seqs[j].1.clone(),
            prefill: true,
        })
        .collect();
    let n: usize = step.iter().map(|c| c.2).sum();
    Batch {
        seqs: chunks,
        logit_rows: (0..n as u32).collect(),
        argmax_rows: vec![],
        sample_rows: vec![],
        ..Default::default()
    }
}

/// Every step's logits (all rows) on one backend.
fn run_steps<B: Backend>(be: &mut B) -> Vec<Vec<f32>> {
    let seqs = sequences();
    steps().iter().map(|st| be.forward(&batch_of(&seqs, st)).expect("forward").logits).collect()
}

/// tiny-v3 with room for 705 positions, every layer dense. With MoE layers a long prompt
/// cannot be held to 2e-2 of the CPU: an expert choice that bf16 flips for one token
/// (102 of the 898 prefill rows sit within 5e-3 of a routing tie) changes that token's
/// K/V and so every later row through attention, and the old absorbed path missed by up
/// to 0.47 too. Dense layers leave the attention path as the only difference; the MoE
/// preset's short prompts go through the expanded path in gpu_backend's tests.
fn tiny_dir() -> tempfile::TempDir {
    let t = tempfile::tempdir().expect("tempdir");
    let layers = mlaserve_model::presets::preset_config("tiny-v3").expect("preset")["num_hidden_layers"].clone();
    let overrides = serde_json::json!({"max_position_embeddings": 1024, "first_k_dense_replace": layers});
    mlaserve_model::presets::generate_with("tiny-v3", t.path(), &overrides).expect("preset");
    t
}

/// Per step, the rows whose token's routing lies within 5e-3 of a tie in the CPU replay.
fn tie_rows(dir: &std::path::Path) -> Vec<BTreeSet<usize>> {
    let seqs = sequences();
    let mut first = Vec::new();
    let mut at = 0;
    for s in &seqs {
        first.push(at);
        at += s.0.len();
    }
    let near: BTreeSet<(usize, usize)> = common::near_ties(dir, &seqs, 5e-3)
        .into_iter()
        .flat_map(|(_, v)| v)
        .map(|(r, _)| {
            let j = first.iter().rposition(|&f| f <= r).expect("row");
            (j, r - first[j])
        })
        .collect();
    steps()
        .iter()
        .map(|st| {
            let mut rows = BTreeSet::new();
            let mut row = 0;
            for &(j, p, n) in st {
                for i in 0..n {
                    if near.contains(&(j, p + i)) {
                        rows.insert(row + i);
                    }
                }
                row += n;
            }
            rows
        })
        .collect()
}

/// max|Δ| / max|ref| over the rows not in `skip` (rows `width` wide); NaN if any value is
/// not finite. Also the rows over `TOL` (skipped ones included), worst first.
fn rel_rows(got: &[f32], want: &[f32], width: usize, skip: &BTreeSet<usize>) -> (f64, Vec<(usize, f64)>) {
    assert_eq!(got.len(), want.len(), "shape");
    if got.iter().any(|v| !v.is_finite()) {
        return (f64::NAN, vec![]);
    }
    let m = want.iter().map(|v| v.abs() as f64).fold(1e-30, f64::max);
    let per: Vec<f64> = got
        .chunks(width)
        .zip(want.chunks(width))
        .map(|(g, w)| g.iter().zip(w).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max) / m)
        .collect();
    let rel = per.iter().enumerate().filter(|(r, _)| !skip.contains(r)).map(|(_, &e)| e).fold(0.0, f64::max);
    let mut over: Vec<(usize, f64)> = per.into_iter().enumerate().filter(|(_, e)| *e > TOL).collect();
    over.sort_by(|a, b| b.1.total_cmp(&a.1));
    (rel, over)
}

fn check_runs(label: &str, got: &[Vec<f32>], want: &[Vec<f32>], vocab: usize, ties: &[BTreeSet<usize>]) -> Vec<String> {
    let mut bad = Vec::new();
    for (i, ((g, w), skip)) in got.iter().zip(want).zip(ties).enumerate() {
        let (rel, over) = rel_rows(g, w, vocab, skip);
        let worst: Vec<String> = over
            .iter()
            .take(4)
            .map(|(r, e)| format!("row {r}{}: {e:.2e}", if skip.contains(r) { " (near tie)" } else { "" }))
            .collect();
        let ok = rel <= TOL;
        println!(
            "{label:<44} step {} rel {rel:.2e} {} ({} of {} rows over {TOL:.0e}; {} near-tie rows skipped) {}",
            i + 1,
            if ok { "ok" } else { "FAIL" },
            over.len(),
            g.len() / vocab,
            skip.len(),
            worst.join(", ")
        );
        if !ok {
            bad.push(format!("{label} step {}: {rel:.3e}", i + 1));
        }
    }
    bad
}

fn gpu_runs(dir: &std::path::Path, opts: CudaOptions, world: usize) -> Vec<Vec<f32>> {
    if world == 1 {
        let mut gpu = CudaBackend::load_with(dir, opts).expect("load gpu");
        return run_steps(&mut gpu);
    }
    let id = mlaserve_cuda::TpInit::new_id().expect("NCCL id");
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|rank| {
                let init = mlaserve_cuda::TpInit { rank, world, id: id.clone(), timeout: Duration::from_secs(60) };
                let opts = CudaOptions { ordinal: rank, ..opts };
                s.spawn(move || run_steps(&mut CudaBackend::load_tp(dir, opts, Some(&init)).expect("load rank")))
            })
            .collect();
        let mut outs: Vec<Vec<Vec<f32>>> = ranks.into_iter().map(|r| r.join().expect("rank thread")).collect();
        for (r, o) in outs.iter().enumerate().skip(1) {
            assert!(o == &outs[0], "rank {r}'s logits differ from rank 0's");
        }
        outs.swap_remove(0)
    })
}

#[test]
fn tiny_v3_expanded_prefill_matches_cpu_and_absorbed_path() {
    if !require_gpu() {
        return;
    }
    let t = tiny_dir();
    let vocab = mlaserve_model::load_config(t.path()).expect("config").vocab_size;
    let ties = tie_rows(t.path());
    let cpu = run_steps(&mut CpuBackend::load(t.path(), BLOCKS).expect("load cpu"));
    let base = CudaOptions::new(BLOCKS, 0);
    let auto = gpu_runs(t.path(), base, 1);
    let absorbed = gpu_runs(t.path(), CudaOptions { prefill: PrefillPath::Absorbed, ..base }, 1);
    let expanded = gpu_runs(t.path(), CudaOptions { prefill: PrefillPath::Expanded, ..base }, 1);
    let inv = gpu_runs(t.path(), CudaOptions { prefill: PrefillPath::Auto, ..base.batch_invariant_cuda_cores() }, 1);
    let mut bad = Vec::new();
    bad.extend(check_runs("expanded for prefill (default) vs CPU", &auto, &cpu, vocab, &ties));
    bad.extend(check_runs("absorbed everywhere (old path) vs CPU", &absorbed, &cpu, vocab, &ties));
    bad.extend(check_runs("expanded everywhere vs CPU", &expanded, &cpu, vocab, &ties));
    bad.extend(check_runs("invariant GEMM + expanded prefill vs CPU", &inv, &cpu, vocab, &ties));
    bad.extend(check_runs("default vs old absorbed path", &auto, &absorbed, vocab, &ties));
    // The routes really differ: the prefill step's logits are not the old path's bits.
    if auto[0] == absorbed[0] {
        bad.push("the default prefill step equals the absorbed path bit for bit: no row took the expanded form".into());
    }
    if expanded[2] == auto[2] {
        bad.push("the forced expanded decode step equals the default one bit for bit".into());
    }
    assert!(bad.is_empty(), "{bad:?}");
}

#[test]
fn tiny_v3_expanded_prefill_tp2_matches_cpu() {
    if !require_gpus(2) {
        return;
    }
    let t = tiny_dir();
    let vocab = mlaserve_model::load_config(t.path()).expect("config").vocab_size;
    let ties = tie_rows(t.path());
    let cpu = run_steps(&mut CpuBackend::load(t.path(), BLOCKS).expect("load cpu"));
    let tp = gpu_runs(t.path(), CudaOptions::new(BLOCKS, 0), 2);
    let bad = check_runs("TP2 expanded for prefill vs CPU", &tp, &cpu, vocab, &ties);
    assert!(bad.is_empty(), "{bad:?}");
}
