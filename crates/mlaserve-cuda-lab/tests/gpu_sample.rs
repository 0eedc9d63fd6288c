//! Sampling on the device (`kernels/sample.cu`, `Sampler`, `Batch::sample_rows`) against
//! the one rule, `mlaserve_core::sample_token`.
//!
//! - `sample_kernel_matches_core_rule`: fresh random logits rows (vocabularies 1 to
//!   129280; Gaussian-like rows, rows of few distinct values — massive ties —, ties at the
//!   top, NaN and −∞ sprinkled, +∞, all NaN, NaN and −∞ only, constant rows, signed zeros,
//!   magnitudes up to 3e38 whose differences overflow, subnormals), temperatures from
//!   1e-30 to 1e30, top-k 0/1/50/5000, top-p 1/0.9/0.5, random uniforms plus 0, 0.5 and
//!   1 − 2⁻⁵³: the device's token must equal the rule's on every row. The rule's sums are
//!   f64 in a fixed order on the host and in another on the device, so a row whose
//!   nucleus walk or inverse-CDF sum lies within rounding (`(n + 64)·2⁻⁵²` of the mass for
//!   n terms: the host's sequential sum of 2^17 terms may be off by ~1.5e-11) of
//!   `top_p · Z` or of `u · mass` could legitimately differ: such rows are counted and
//!   printed, never hidden; a mismatch on any other row fails. Rows whose sums are exact in any order (equal weights, ties with
//!   the rest underflowed) have no such margin: the device must match them exactly. A
//!   second launch must give the same ids bit for bit.
//! - `tiny_v3_backend_samples_match_core_rule`: `CudaBackend` on tiny-v3 (one GPU, and a
//!   TP group of 2 when there are two GPUs): every call asks for all rows' logits and for
//!   sampled tokens of every row under several parameter sets; each sampled token must be
//!   the rule applied to the same call's logits row (near-boundary rows reported as above).
//! - `engine_sampled_k3_equals_k0_batch_invariant`: the engine on the GPU with sampled
//!   requests: k = 3 gives the k = 0 tokens (a token is a pure function of its logits,
//!   seed and position; the batch-invariant options make the logits independent of the
//!   batch).
//! - `sample_kernel_timing`: the kernel's time at vocabulary 129280 for 1, 64 and 256 rows,
//!   beside the time to read those logits once at the copy bandwidth of the same run.
#![cfg(feature = "cuda")]

// The GPU test helpers of mlaserve-cuda's own tests, shared rather than copied.
#[path = "../../mlaserve-cuda/tests/common/mod.rs"]
mod common;

use common::{require_gpu, require_gpus};
use std::time::Duration;

use mlaserve_core::{sample_from, target_distribution, Backend, Batch, SampleRow, SeqChunk, TargetDist};
use mlaserve_cuda::sample::Sampler;
use mlaserve_cuda::{CudaBackend, CudaOptions, Gpu, TpInit};

/// How far, as a fraction of the mass, two f64 sums of `n` non-negative terms in two
/// orders can be apart: the host's sequential sum is off by at most `(n − 1)·2⁻⁵³` of the
/// total, the device's tree and the products `top_p · Z`, `u · mass` by far less; twice
/// that, with room. Decisions closer than this to a boundary may differ (module doc).
fn rounding_bound(n: usize) -> f64 {
    (n as f64 + 64.0) * f64::EPSILON
}

/// splitmix64, for reproducible inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1) with 53 bits.
    fn f64(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// Roughly N(0, 1) (Irwin–Hall of 4).
    fn normal(&mut self) -> f32 {
        ((0..4).map(|_| self.f64()).sum::<f64>() - 2.0) as f32 * 1.732
    }
}

/// Whether every sum of the non-negative `w`, in any order, is exact: they all lie on the
/// grid of the finest one's lowest set bit and their total stays below 2^53 steps of it.
/// Then the device's sums equal the reference's bit for bit (equal weights, ties at the
/// top with the rest underflowed, huge temperatures), and so do its decisions.
fn exact_sums(w: &[f64]) -> bool {
    let lowest_bit = |x: f64| {
        let b = x.to_bits();
        let (exp, man) = (((b >> 52) & 0x7ff) as i32, b & ((1u64 << 52) - 1));
        let (m, e) = if exp == 0 { (man, -1074) } else { (man | (1u64 << 52), exp - 1075) };
        e + m.trailing_zeros() as i32
    };
    match w.iter().filter(|&&x| x > 0.0).map(|&x| lowest_bit(x)).min() {
        None => true,
        Some(e) => w.iter().sum::<f64>() < 2f64.powi(e + 53),
    }
}

/// The rule's distribution for a row's parameters, and how close its nucleus cut lies to
/// a rounding boundary (in units of [`rounding_bound`]; infinite where the sums are exact).
struct Reference {
    dist: TargetDist,
    nucleus_margin: f64,
}

impl Reference {
    fn new(logits: &[f32], temperature: f32, top_k: u32, top_p: f32) -> Self {
        let dist = target_distribution(logits, temperature, top_k, 0.0, top_p);
        let mut nucleus_margin = f64::INFINITY;
        // The nucleus walk as the rule does it: the top-k set's weights (the same f64
        // values and Z), summed in (logit desc, id asc) order against top_p * Z.
        let all = target_distribution(logits, temperature, top_k, 0.0, 1.0);
        if top_p < 1.0 && all.tokens.len() > 1 {
            let mut order: Vec<usize> = (0..all.tokens.len()).collect();
            let l = |i: usize| logits[all.tokens[i] as usize];
            order.sort_by(|&a, &b| l(b).total_cmp(&l(a)).then(a.cmp(&b)));
            let target = top_p as f64 * all.mass;
            let mut cum = 0.0;
            let mut reached = false;
            for (n, &o) in order.iter().enumerate() {
                let prev = cum;
                cum += all.weights[o];
                if cum >= target {
                    nucleus_margin = cum - target;
                    if n > 0 {
                        nucleus_margin = nucleus_margin.min(target - prev);
                    }
                    reached = true;
                    break;
                }
            }
            if !reached {
                nucleus_margin = target - cum;
            }
            nucleus_margin /= all.mass * rounding_bound(all.tokens.len());
            if exact_sums(&all.weights) {
                nucleus_margin = f64::INFINITY;
            }
        }
        Reference { dist, nucleus_margin }
    }

    /// The rule's token for `u`, and the distance of the decision to a rounding boundary
    /// in units of [`rounding_bound`] (below 1: near): the nucleus cut's, or that of
    /// `u · mass` to the cumulative sums around the chosen token (0 when the draw fell
    /// back to the last one).
    /// A single candidate, exact sums, or `u = 0` (the first token with weight) leave the
    /// draw nothing to round.
    fn token(&self, u: f64) -> (u32, f64) {
        let tok = sample_from(&self.dist, u);
        let d = &self.dist;
        if d.tokens.len() == 1 || u == 0.0 || exact_sums(&d.weights) {
            return (tok, self.nucleus_margin);
        }
        let last_with_weight = d.weights.iter().rposition(|&w| w > 0.0).unwrap_or(0);
        let limit = u * d.mass;
        let unit = d.mass * rounding_bound(d.tokens.len());
        let mut cum = 0.0;
        for (j, &w) in d.weights.iter().enumerate() {
            let prev = cum;
            cum += w;
            if limit < cum {
                let mut m = self.nucleus_margin;
                if prev > 0.0 {
                    m = m.min((limit - prev) / unit);
                }
                if j != last_with_weight {
                    m = m.min((cum - limit) / unit);
                }
                return (tok, m);
            }
        }
        (tok, 0.0)
    }
}

/// One logits row of a kind, for vocabulary `v`.
fn make_row(kind: usize, v: usize, rng: &mut Rng) -> Vec<f32> {
    let mut row: Vec<f32> = match kind {
        0 => (0..v).map(|_| rng.normal()).collect(),
        1 => (0..v).map(|_| rng.normal() * 4.0).collect(),
        2 => (0..v).map(|_| rng.normal() * 12.0 + 3.0).collect(),
        3 => (0..v).map(|_| rng.below(6) as f32).collect(), // few values: massive ties
        4 => {
            // ties at the top and just below it
            let mut r: Vec<f32> = (0..v).map(|_| rng.normal() * 2.0).collect();
            for i in 0..v.min(9) {
                let at = rng.below(v);
                r[at] = if i < 5 { 9.0 } else { 8.5 };
            }
            r
        }
        5 => (0..v)
            .map(|_| match rng.below(100) {
                0 => f32::NAN,
                1 => f32::NEG_INFINITY,
                _ => rng.normal() * 3.0,
            })
            .collect(),
        6 => {
            let mut r: Vec<f32> = (0..v).map(|_| rng.normal()).collect();
            r[rng.below(v)] = f32::INFINITY;
            r[rng.below(v)] = f32::INFINITY;
            r[rng.below(v)] = f32::NAN;
            r
        }
        7 => vec![f32::NAN; v],
        8 => (0..v).map(|_| if rng.below(2) == 0 { f32::NAN } else { f32::NEG_INFINITY }).collect(),
        9 => vec![3.5; v],
        10 => (0..v).map(|_| [-0.0f32, 0.0, -1.0, 1.0][rng.below(4)]).collect(),
        11 => (0..v).map(|_| (rng.f64() * 2.0 - 1.0) as f32 * 3e38).collect(),
        _ => (0..v).map(|_| rng.normal() * 1e-40).collect(), // subnormal
    };
    if kind == 5 && v > 1 {
        row[0] = f32::NAN; // a NaN at id 0 whatever the draw
    }
    row
}
const KINDS: usize = 13;

const TEMPERATURES: [f32; 6] = [1.0, 0.7, 1e-3, 5.0, 1e30, 1e-30];
const TOP_KS: [u32; 4] = [0, 1, 50, 5000];
const TOP_PS: [f32; 3] = [1.0, 0.9, 0.5];

/// Parameter set `i` of the 72 combinations.
fn params(i: usize) -> (f32, u32, f32) {
    (TEMPERATURES[i % 6], TOP_KS[(i / 6) % 4], TOP_PS[(i / 24) % 3])
}

/// Launches the kernel on `rows` (each `vocab` long) with `spec`; the ids.
fn device_ids(gpu: &Gpu, sampler: &Sampler, rows: &[f32], vocab: usize, spec: &[SampleRow]) -> Vec<u32> {
    let s = &gpu.stream;
    let logits = s.clone_htod(rows).expect("upload logits");
    let params = s.clone_htod(&Sampler::params(spec)).expect("upload params");
    let mut out = s.alloc_zeros::<i32>(spec.len()).expect("alloc");
    sampler.sample(s, &logits, vocab, &params, &mut out, spec.len()).expect("launch");
    let ids = s.clone_dtoh(&out).expect("download");
    gpu.sync().expect("sync");
    ids.into_iter().map(|i| i as u32).collect()
}

/// Counts of a comparison: rows, mismatches away from a boundary, rows near one.
#[derive(Default)]
struct Tally {
    rows: usize,
    bad: Vec<String>,
    near: Vec<String>,
}

impl Tally {
    fn check(&mut self, what: impl Fn() -> String, got: u32, want: u32, margin: f64) {
        self.rows += 1;
        if margin < 1.0 {
            self.near.push(format!("{} (device {got}, rule {want}, margin {margin:.2} bounds)", what()));
        } else if got != want {
            self.bad.push(format!("{}: device {got}, rule {want} (margin {margin:.2e} bounds)", what()));
        }
    }
    fn finish(&self, label: &str) {
        println!(
            "{label}: {} rows, {} near a rounding boundary (reported), {} mismatches",
            self.rows,
            self.near.len(),
            self.bad.len()
        );
        for n in &self.near {
            println!("  near a boundary: {n}");
        }
        for b in self.bad.iter().take(20) {
            println!("  MISMATCH: {b}");
        }
        assert!(self.bad.is_empty(), "{label}: {} rows differ from the rule away from any boundary", self.bad.len());
    }
}

#[test]
fn sample_kernel_matches_core_rule() {
    if !require_gpu() {
        return;
    }
    let gpu = Gpu::new(0).expect("gpu");
    let sampler = Sampler::new(&gpu).expect("sampler");
    let mut rng = Rng(0x5a3e_11ed);
    let mut tally = Tally::default();
    let edge_u = [0.0, 0.5, 1.0 - f64::EPSILON / 2.0];
    let mut combo = 0usize;
    for vocab in [1usize, 2, 7, 100, 1000, 4096, 4097, 32000, 129280] {
        // Every (row kind, 8 parameter sets) case, 4 uniforms each, in one launch.
        let (mut rows, mut spec, mut refs) = (Vec::new(), Vec::new(), Vec::new());
        for kind in 0..KINDS {
            let row = make_row(kind, vocab, &mut rng);
            for _ in 0..8 {
                let (temperature, top_k, top_p) = params(combo % 72);
                combo += 1;
                let r = Reference::new(&row, temperature, top_k, top_p);
                for n in 0..4 {
                    let u = if n == 0 { edge_u[combo % 3] } else { rng.f64() };
                    rows.extend_from_slice(&row);
                    let sr = SampleRow { row: spec.len() as u32, temperature, top_k, top_p, min_p: 0.0, u };
                    let (want, margin) = r.token(u);
                    spec.push(sr);
                    refs.push((kind, want, margin));
                }
            }
        }
        let got = device_ids(&gpu, &sampler, &rows, vocab, &spec);
        for ((sr, &(kind, want, margin)), &g) in spec.iter().zip(&refs).zip(&got) {
            let what = || {
                format!(
                    "vocab {vocab} kind {kind} T {:e} top_k {} top_p {} u {}",
                    sr.temperature, sr.top_k, sr.top_p, sr.u
                )
            };
            tally.check(what, g, want, margin);
        }
        if vocab == 129280 {
            let again = device_ids(&gpu, &sampler, &rows, vocab, &spec);
            assert_eq!(got, again, "a second launch on the same rows gives other ids");
        }
    }
    tally.finish("sample_f32 vs mlaserve_core::sample_token");

    // Shapes the wrapper must refuse before launching.
    let s = &gpu.stream;
    let logits = s.alloc_zeros::<f32>(10).expect("alloc");
    let params = s.clone_htod(&[1.0f64, 0.0, 1.0, 0.5]).expect("upload");
    let mut out = s.alloc_zeros::<i32>(2).expect("alloc");
    assert!(sampler.sample(s, &logits, 5, &params, &mut out, 2).is_err(), "params for one row, two rows asked");
    assert!(sampler.sample(s, &logits, 11, &params, &mut out, 1).is_err(), "logits shorter than a row");
    assert!(sampler.sample(s, &logits, 0, &params, &mut out, 1).is_err(), "vocabulary 0");
}

fn chunk(tokens: Vec<u32>, start_pos: usize, table: &[u32]) -> SeqChunk {
    SeqChunk { tokens, start_pos, block_table: table.to_vec(), ..Default::default() }
}

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 2 + (seed.wrapping_mul(7919) + i * 131) % 509).collect()
}

/// Every row's logits, and three sample rows per row with parameters cycling through
/// the 72 combinations and random uniforms.
fn with_samples(mut b: Batch, rng: &mut Rng) -> Batch {
    let n = b.num_tokens() as u32;
    b.logit_rows = (0..n).collect();
    b.sample_rows = (0..3 * n)
        .map(|i| {
            let (temperature, top_k, top_p) = params((i as usize * 7 + 3) % 72);
            SampleRow { row: i % n, temperature, top_k, top_p, min_p: 0.0, u: rng.f64() }
        })
        .collect();
    b
}

/// The scenario's calls (prefill of two sequences, MTP layer 0 over it, a decode step of
/// 4-token windows); per call, (name, batch, logits, sampled ids).
fn calls<B: Backend>(be: &mut B) -> Vec<(&'static str, Batch, Vec<f32>, Vec<u32>)> {
    let mut rng = Rng(77);
    let (ta, tb) = ([3u32, 7], [1u32, 9]);
    let mut out = Vec::new();
    let b1 = with_samples(
        Batch { seqs: vec![chunk(toks(1, 70), 0, &ta), chunk(toks(2, 20), 0, &tb)], ..Default::default() },
        &mut rng,
    );
    let o1 = be.forward(&b1).expect("prefill");
    let mut m0 = b1.clone();
    for c in &mut m0.seqs {
        c.tokens.rotate_left(1);
    }
    let m0 = with_samples(m0, &mut rng);
    let ident: Vec<u32> = (0..90).collect();
    let om0 = be.mtp_forward(0, &m0, &o1.hidden, &ident).expect("mtp0");
    out.push(("prefill", b1, o1.logits, o1.sampled));
    out.push(("MTP layer 0", m0, om0.logits, om0.sampled));
    let b2 = with_samples(
        Batch { seqs: vec![chunk(toks(3, 4), 70, &ta), chunk(toks(4, 4), 20, &tb)], ..Default::default() },
        &mut rng,
    );
    let o2 = be.forward(&b2).expect("decode");
    out.push(("decode s=4", b2, o2.logits, o2.sampled));
    out
}

fn check_calls(label: &str, res: &[(&'static str, Batch, Vec<f32>, Vec<u32>)], vocab: usize) {
    let mut tally = Tally::default();
    for (name, b, logits, sampled) in res {
        assert_eq!(sampled.len(), b.sample_rows.len(), "{label} {name}: one id per sample row");
        for (sr, &got) in b.sample_rows.iter().zip(sampled) {
            let at = b.logit_rows.iter().position(|&r| r == sr.row).expect("row's logits");
            let row = &logits[at * vocab..(at + 1) * vocab];
            let (want, margin) = Reference::new(row, sr.temperature, sr.top_k, sr.top_p).token(sr.u);
            let what = || format!("{name} row {} T {:e} top_k {} top_p {}", sr.row, sr.temperature, sr.top_k, sr.top_p);
            tally.check(what, got, want, margin);
        }
    }
    tally.finish(label);
}

#[test]
fn tiny_v3_backend_samples_match_core_rule() {
    if !require_gpu() {
        return;
    }
    let t = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", t.path()).expect("preset");
    let vocab = mlaserve_model::load_config(t.path()).expect("config").vocab_size;
    for opts in [CudaOptions::new(32, 0), CudaOptions::new(32, 0).batch_invariant_cuda_cores()] {
        let mut gpu = CudaBackend::load_with(t.path(), opts).expect("load");
        check_calls(&format!("tiny-v3 TP1 {:?}", opts.gemm), &calls(&mut gpu), vocab);
    }
    if !require_gpus(2) {
        return;
    }
    let id = TpInit::new_id().expect("NCCL id");
    let dir = t.path();
    let mut outs = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..2)
            .map(|rank| {
                let init = TpInit { rank, world: 2, id: id.clone(), timeout: Duration::from_secs(60) };
                s.spawn(move || {
                    let opts = CudaOptions::new(32, rank);
                    calls(&mut CudaBackend::load_tp(dir, opts, Some(&init)).expect("load rank"))
                })
            })
            .collect();
        ranks.into_iter().map(|r| r.join().expect("rank thread")).collect::<Vec<_>>()
    });
    for ((name, _, l1, s1), (_, _, l0, s0)) in outs[1].iter().zip(&outs[0]) {
        assert!(l1 == l0 && s1 == s0, "TP2 {name}: rank 1's logits or sampled ids differ from rank 0's");
    }
    check_calls("tiny-v3 TP2", &outs.swap_remove(0), vocab);
}

#[test]
fn engine_sampled_k3_equals_k0_batch_invariant() {
    use mlaserve_engine::{Engine, EngineConfig, Request, SamplingParams};
    if !require_gpu() {
        return;
    }
    let t = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", t.path()).expect("preset");
    let run = |k: usize| {
        let be = CudaBackend::load_with(t.path(), CudaOptions::new(512, 0).batch_invariant_cuda_cores()).expect("load");
        let cfg = EngineConfig { num_speculative_tokens: Some(k), max_batch_tokens: 256, ..Default::default() };
        let mut e = Engine::new(be, cfg).expect("engine");
        let mut rng = Rng(4242);
        let ids: Vec<_> = (0..32)
            .map(|i| {
                let prompt = (0..1 + rng.below(120)).map(|_| 2 + rng.below(500) as u32).collect();
                let (temperature, top_k, top_p) = [(1.0, 0, 1.0), (0.7, 50, 0.9), (1.3, 0, 0.5), (0.0, 0, 1.0)][i % 4];
                let sp = SamplingParams {
                    temperature,
                    top_k,
                    top_p,
                    seed: Some(900 + i as u64),
                    max_new_tokens: 1 + rng.below(32) as u32,
                    ignore_eos: true,
                    ..Default::default()
                };
                e.add_request(Request::new(prompt, sp)).expect("admit")
            })
            .collect();
        mlaserve_engine::testing::run_to_completion(&mut e, &ids).expect("run")
    };
    let (k0, k3) = (run(0), run(3));
    let n: usize = k0.iter().map(Vec::len).sum();
    let differ = k0.iter().zip(&k3).filter(|(a, b)| a != b).count();
    println!("engine on the GPU, 32 requests (3 of 4 sampled), {n} tokens: k3 vs k0 differ in {differ}/32");
    assert!(n > 32 * 4, "the workload generates tokens");
    assert_eq!(k3, k0, "sampled k = 3 differs from k = 0 on the GPU (batch-invariant options)");
}
