//! The engine, unchanged, on the GPU backend with `tiny-v3`: greedy output with k = 3
//! (MTP speculation) must equal k = 0 token for token, 64 concurrent requests.
//!
//! That needs a token's logits not to depend on what shares its step. With the
//! batch-invariant options (invariant GEMM, varlen attention for every row) it is
//! guaranteed and asserted. (With the default options, cuBLAS and the batch-sized decode
//! plan, requests can diverge: `benches/benches/gpu_engine.rs` reports how many.)
//!
//! The same on tensor-parallel groups of 2 and 4 ranks (threads, one GPU each): the
//! engine drives a `TpLeader`, the other ranks follow its plans over an in-process
//! channel, and the backends all-reduce over their own NCCL communicator. With the
//! batch-invariant options (ordered all-reduce included) k = 3 must equal k = 0.
#![cfg(feature = "cuda")]

mod common;
mod tp_group;

use common::{require_gpu, require_gpus};
use std::path::Path;
use std::time::Instant;

use std::time::Duration;

use mlaserve_core::Backend;
use mlaserve_cuda::{CudaBackend, CudaOptions, TpInit};
use mlaserve_engine::testing::{random_requests, run_to_completion};
use mlaserve_engine::{Engine, EngineConfig, Request, SamplingParams, Speculation};

const BLOCKS: usize = 512;

fn workload() -> Vec<Request> {
    random_requests(987654321, 64, 200, 48, 512)
}

/// Runs every request to completion; each one's tokens in submission order.
fn run<B: Backend>(backend: B, k: usize) -> Vec<Vec<u32>> {
    run_counting(backend, k).0
}

/// The workload's outputs and the preemptions the engine made.
fn run_counting<B: Backend>(backend: B, k: usize) -> (Vec<Vec<u32>>, u64) {
    let (out, pre, _) = run_with(backend, k, Speculation::Fixed);
    (out, pre)
}

/// The workload's outputs, the preemptions, and the decisions per k.
fn run_with<B: Backend>(backend: B, k: usize, speculation: Speculation) -> (Vec<Vec<u32>>, u64, Vec<u64>) {
    let cfg =
        EngineConfig { num_speculative_tokens: Some(k), speculation, max_batch_tokens: 256, ..Default::default() };
    let mut e = Engine::new(backend, cfg).expect("engine");
    let ids: Vec<_> = workload().into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    let out = run_to_completion(&mut e, &ids).expect("run");
    let st = e.stats();
    (out, st.totals.preemptions, st.speculation.steps_per_k)
}

fn gpu_run(dir: &Path, opts: CudaOptions, k: usize) -> Vec<Vec<u32>> {
    gpu_run_counting(dir, opts, k).0
}

fn gpu_run_counting(dir: &Path, opts: CudaOptions, k: usize) -> (Vec<Vec<u32>>, u64) {
    let t0 = Instant::now();
    let (out, pre) = run_counting(CudaBackend::load_with(dir, opts).expect("load"), k);
    let n: usize = out.iter().map(Vec::len).sum();
    println!("  k={k} {opts:?}: {n} tokens, {pre} preemptions, in {:.2}s", t0.elapsed().as_secs_f64());
    (out, pre)
}

fn differing(a: &[Vec<u32>], b: &[Vec<u32>]) -> usize {
    a.iter().zip(b).filter(|(x, y)| x != y).count()
}

fn model() -> tempfile::TempDir {
    let t = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", t.path()).expect("preset");
    t
}

#[test]
fn greedy_k3_equals_k0_cuda_core_batch_invariant() {
    if !require_gpu() {
        return;
    }
    let t = model();
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant_cuda_cores();
    let k0 = gpu_run(t.path(), opts, 0);
    let k3 = gpu_run(t.path(), opts, 3);
    assert!(k0.iter().map(Vec::len).sum::<usize>() > 64 * 4, "the workload generates tokens");
    let cpu = run(mlaserve_cpu::CpuBackend::load(t.path(), BLOCKS).expect("cpu"), 0);
    println!(
        "batch-invariant: k3 vs k0 differ in {}/64 requests; GPU k0 vs CPU k0 differ in {}/64",
        differing(&k3, &k0),
        differing(&k0, &cpu)
    );
    assert_eq!(k3, k0, "greedy k = 3 differs from k = 0 on the GPU (batch-invariant options)");
}

/// The fast batch-invariant options (`CudaOptions::batch_invariant`: tensor-core invariant GEMMs,
/// the decode kernel with fixed-size splits for decode windows, prompt chunks expanded,
/// CUDA graphs): greedy k = 3 == k = 0, on tiny-v3 (latent widths without the tensor-core
/// decode kernel: the varlen kernel) and on tiny-v3 at V3's attention widths (512 + 64, 16
/// heads: the seesaw kernel), the latter also with a cache small enough to preempt (a
/// recomputed sequence's generated tokens go through the decode kernel again).
#[test]
fn greedy_k3_equals_k0_fast_batch_invariant_options() {
    if !require_gpu() {
        return;
    }
    let mut fails = Vec::new();
    for (v3, blocks) in [(false, BLOCKS), (true, BLOCKS), (true, 24)] {
        let t = common::tiny_v3(v3);
        let opts = CudaOptions::new(blocks, 0).batch_invariant();
        let (k0, p0) = gpu_run_counting(t.path(), opts, 0);
        let (k3, p3) = gpu_run_counting(t.path(), opts, 3);
        assert!(k0.iter().map(Vec::len).sum::<usize>() > 64 * 4, "the workload generates tokens");
        if blocks < BLOCKS {
            assert!(p0 > 0 && p3 > 0, "{blocks} blocks must preempt ({p0} and {p3} preemptions)");
        }
        let fast = gpu_run(t.path(), CudaOptions::new(blocks, 0), 0);
        let (d, df) = (differing(&k3, &k0), differing(&k0, &fast));
        println!(
            "batch-invariant options, V3 attention {v3}, {blocks} blocks ({p0}/{p3} preemptions): k3 vs k0 differ in {d}/64 \
             requests; k0 vs the default options' k0 in {df}/64"
        );
        if d != 0 {
            fails.push(format!("V3 attention {v3}, {blocks} blocks: {d}/64 requests differ"));
        }
    }
    assert!(fails.is_empty(), "greedy k = 3 differs from k = 0 on the GPU (batch-invariant options): {fails:?}");
}

/// The fp8 latent cache with the batch-invariant options: greedy k = 3 == k = 0 on
/// tiny-v3 (the varlen kernel reads the cache) and at V3's attention widths (the fp8
/// decode kernel with fixed splits), the latter also with a cache small enough to
/// preempt, and on a TP 2 group where two GPUs are present.
#[test]
fn fp8_cache_greedy_k3_equals_k0_batch_invariant() {
    if !require_gpu() {
        return;
    }
    let mut fails = Vec::new();
    for (v3, blocks) in [(false, BLOCKS), (true, BLOCKS), (true, 24)] {
        let t = common::tiny_v3(v3);
        let opts = CudaOptions {
            kv_cache_dtype: mlaserve_core::KvCacheDtype::Fp8,
            ..CudaOptions::new(blocks, 0).batch_invariant()
        };
        let (k0, p0) = gpu_run_counting(t.path(), opts, 0);
        let (k3, p3) = gpu_run_counting(t.path(), opts, 3);
        assert!(k0.iter().map(Vec::len).sum::<usize>() > 64 * 4, "the workload generates tokens");
        if blocks < BLOCKS {
            assert!(p0 > 0 && p3 > 0, "{blocks} blocks must preempt ({p0} and {p3} preemptions)");
        }
        let bf16_cache = gpu_run(t.path(), CudaOptions::new(blocks, 0).batch_invariant(), 0);
        let (d, db) = (differing(&k3, &k0), differing(&k0, &bf16_cache));
        println!(
            "fp8 cache, V3 attention {v3}, {blocks} blocks ({p0}/{p3} preemptions): k3 vs k0 differ in {d}/64 \
             requests; k0 vs the bf16 cache's k0 in {db}/64 (reported)"
        );
        if d != 0 {
            fails.push(format!("V3 attention {v3}, {blocks} blocks: {d}/64 requests differ"));
        }
        if v3 && blocks == BLOCKS && require_gpus(2) {
            let (t0, t3) = (tp_run(t.path(), opts, 2, 0), tp_run(t.path(), opts, 2, 3));
            let d = differing(&t3, &t0);
            println!("fp8 cache TP=2: k3 vs k0 differ in {d}/64 requests");
            if d != 0 {
                fails.push(format!("TP 2: {d}/64 requests differ"));
            }
        }
    }
    assert!(fails.is_empty(), "greedy k = 3 differs from k = 0 with the fp8 cache: {fails:?}");
}

/// The workload on a group of `world` ranks (GPU r for rank r).
/// Adaptive k on the GPU (fast batch-invariant options, CUDA graphs captured per window
/// as k changes), on the bundled trained model, whose drafts are mostly accepted: the
/// greedy output equals fixed k = 0's.
#[test]
fn greedy_adaptive_k_equals_k0_fast_batch_invariant_options() {
    if !require_gpu() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant();
    let load = || CudaBackend::load_with(&dir, opts).expect("load");
    let (k0, _, _) = run_with(load(), 0, Speculation::Fixed);
    let (adaptive, _, decisions) = run_with(load(), 3, Speculation::Adaptive);
    println!("adaptive k: decisions per k {decisions:?}; differs from k = 0 in {}/64", differing(&adaptive, &k0));
    assert_eq!(adaptive, k0, "greedy output with adaptive k differs from k = 0 (batch-invariant options)");
    // Calibrated at start-up (`Engine::calibrate`: every k at 1 .. 64 rows, through the
    // graphs serving replays): only costs stay, and the output is still k = 0's.
    let cfg = EngineConfig {
        num_speculative_tokens: Some(3),
        speculation: Speculation::Adaptive,
        max_batch_tokens: 256,
        calibration_rows: 64,
        ..Default::default()
    };
    let mut e = Engine::new(load(), cfg.clone()).expect("engine");
    let t0 = Instant::now();
    let cal = e.calibrate(64).expect("calibration");
    let st = e.stats();
    println!(
        "calibration: rows {:?} in {} steps, {:.2} s, {} graphs captured; costs {:?}",
        cal.rows,
        cal.steps,
        t0.elapsed().as_secs_f64(),
        e.backend().graph_captures(),
        st.speculation.costs
    );
    assert_eq!(cal.rows, [1, 2, 4, 8, 16, 32, 64], "{cal:?}");
    assert!(e.backend().graph_captures() > 0, "calibration captured no graph");
    for (rows, c) in &st.speculation.costs {
        assert!(c.iter().all(Option::is_some), "{rows} rows: a k unmeasured: {c:?}");
    }
    assert_eq!((st.totals.generated_tokens, st.prefix.queried_tokens, st.times.steps), (0, 0, 0));
    let ids: Vec<_> = workload().into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    let calibrated = run_to_completion(&mut e, &ids).expect("run");
    println!("calibrated: decisions per k {:?}", e.stats().speculation.steps_per_k);
    assert_eq!(calibrated, k0, "greedy output after a calibration differs from k = 0");
    // Every graph batch size up to 64 at every k first (`Engine::warm_up_graphs`): the
    // target's decode graphs serving needs are all captured by then.
    let mut e = Engine::new(load(), EngineConfig { warm_up_graphs: true, ..cfg }).expect("engine");
    let t0 = Instant::now();
    let w = e.warm_up_graphs(64).expect("warm-up");
    let warmed = e.backend().graph_captures();
    println!("warm-up: sizes {:?} in {} steps, {:.2} s, {warmed} graphs", w.rows, w.steps, t0.elapsed().as_secs_f64());
    assert_eq!(w.rows, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64], "{w:?}");
    let ids: Vec<_> = workload().into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    let out = run_to_completion(&mut e, &ids).expect("run");
    println!("after the warm-up, serving captured {} graphs", e.backend().graph_captures() - warmed);
    assert_eq!(out, k0, "greedy output after a graph warm-up differs from k = 0");
}

/// `work` through an engine of `cfg` on the bundled model with `opts`, k forced to
/// `pattern` where it is not empty: each request's tokens, the drafts made, the accepted
/// drafts per position, and the graph launches.
fn bundled_run(
    opts: CudaOptions,
    cfg: EngineConfig,
    work: Vec<Request>,
    pattern: &[usize],
) -> (Vec<Vec<u32>>, u64, Vec<u64>, u64) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
    let b = CudaBackend::load_with(&dir, opts).expect("load");
    assert_eq!(b.keeps_drafts(), opts.keep_drafts, "one GPU keeps drafts when asked");
    let mut e = Engine::new(b, cfg).expect("engine");
    e.force_k(pattern);
    let ids: Vec<_> = work.into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    let out = run_to_completion(&mut e, &ids).expect("run");
    let t = e.stats().totals;
    (out, t.draft_tokens, t.accepted_per_position, e.backend().graph_stats().launches)
}

/// Drafts kept on the device between a pass's MTP stages (`CudaOptions::keep_drafts`,
/// the default on one GPU) are the drafts read back stage by stage: on the bundled
/// trained model (real acceptance), with CUDA graphs and eagerly, at k = 3 (three
/// MTP layers) and k = 4 (the last one chained), the same tokens, drafts and accepted
/// drafts per position.
#[test]
fn kept_drafts_equal_drafts_read_back_per_stage() {
    if !require_gpu() {
        return;
    }
    let run_on = |opts: CudaOptions, k: usize, work: Vec<Request>| {
        let cfg = EngineConfig { num_speculative_tokens: Some(k), max_batch_tokens: 256, ..Default::default() };
        bundled_run(opts, cfg, work, &[])
    };
    let run = |opts: CudaOptions, k: usize| run_on(opts, k, workload());
    // A fresh engine's first passes over a prompt longer than a step's budget draft
    // nothing (its chunks fall short of its end) and read nothing back.
    let long = || vec![Request::new((0..600).map(|i| 2 + (i * 7) % 500).collect(), SamplingParams::default())];
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant();
    let (kept, back) = (run_on(opts, 3, long()), run_on(CudaOptions { keep_drafts: false, ..opts }, 3, long()));
    assert!(!kept.0[0].is_empty() && kept.1 > 0, "the long prompt decodes, with drafts");
    assert_eq!((&kept.0, kept.1, &kept.2), (&back.0, back.1, &back.2), "a long prompt first");
    for graphs in [true, false] {
        for k in [3, 4] {
            let opts = CudaOptions { graphs, ..CudaOptions::new(BLOCKS, 0).batch_invariant() };
            let kept = run(opts, k);
            let back = run(CudaOptions { keep_drafts: false, ..opts }, k);
            println!(
                "graphs {graphs}, k = {k}: {} drafts, accepted per position {:?} (kept), {:?} (read back); {} graph launches",
                kept.1, kept.2, back.2, kept.3
            );
            // Random prompt ids: about half of the drafts accepted (964 of 1,986 at k = 3
            // on one H100).
            assert!(kept.2.iter().sum::<u64>() > kept.1 / 4, "drafts accepted");
            assert_eq!(graphs, kept.3 > 0, "graphs {graphs}");
            assert_eq!(kept.0, back.0, "graphs {graphs}, k = {k}: tokens");
            assert_eq!((kept.1, &kept.2), (back.1, &back.2), "graphs {graphs}, k = {k}: drafts and acceptance");
        }
    }
}

/// Adaptive k forced through every transition (`Engine::force_k`) on the bundled model
/// with graphs: steps down run fewer MTP stages, steps up start the stages the step
/// before skipped where the stage before them did; drafts kept on the device give the
/// same tokens, drafts and acceptance as drafts read back per stage, and the tokens of
/// k = 0.
#[test]
fn forced_k_transitions_equal_drafts_read_back_per_stage() {
    if !require_gpu() {
        return;
    }
    let pattern = [3, 1, 2, 0, 1, 3, 2];
    let run_on = |opts: CudaOptions| {
        let cfg = EngineConfig {
            num_speculative_tokens: Some(3),
            speculation: Speculation::Adaptive,
            max_batch_tokens: 256,
            ..Default::default()
        };
        bundled_run(opts, cfg, workload(), &pattern)
    };
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
    let k0 = run(CudaBackend::load_with(&dir, opts).expect("load"), 0);
    let kept = run_on(opts);
    let back = run_on(CudaOptions { keep_drafts: false, ..opts });
    println!("k pattern {pattern:?}: {} drafts, accepted per position {:?}", kept.1, kept.2);
    assert!(kept.2.iter().sum::<u64>() > 0, "drafts accepted");
    assert_eq!(kept.0, back.0, "tokens");
    assert_eq!((kept.1, &kept.2), (back.1, &back.2), "drafts and acceptance");
    assert_eq!(kept.0, k0, "tokens as with k = 0");
}

fn tp_run(dir: &Path, opts: CudaOptions, world: usize, k: usize) -> Vec<Vec<u32>> {
    let t0 = Instant::now();
    let out = tp_group::with_tp_group(dir, opts, world, |leader| run(leader, k));
    let n: usize = out.iter().map(Vec::len).sum();
    println!("  TP={world} k={k} {opts:?}: {n} tokens in {:.2}s", t0.elapsed().as_secs_f64());
    out
}

#[test]
fn tp_groups_greedy_k3_equals_k0_cuda_core_batch_invariant() {
    let t = model();
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant_cuda_cores();
    let mut tp1 = None;
    for world in [2, 4, 8] {
        if !require_gpus(world) {
            return;
        }
        let tp1 = tp1.get_or_insert_with(|| gpu_run(t.path(), opts, 0));
        let k0 = tp_run(t.path(), opts, world, 0);
        let k3 = tp_run(t.path(), opts, world, 3);
        println!(
            "TP={world} batch-invariant: k3 vs k0 differ in {}/64 requests; TP={world} vs TP=1 (GPU, k0) differ in {}/64",
            differing(&k3, &k0),
            differing(&k0, tp1)
        );
        assert_eq!(k3, k0, "TP={world}: greedy k = 3 differs from k = 0 (batch-invariant options)");
        let fast = CudaOptions::new(BLOCKS, 0);
        let (f0, f3) = (tp_run(t.path(), fast, world, 0), tp_run(t.path(), fast, world, 3));
        println!("TP={world} default options: k3 vs k0 differ in {}/64 requests (reported)", differing(&f3, &f0));
    }
}

/// tiny-v3 in fp8 with every tensor-parallel split at TP 2 on a 128 block and V3's
/// latent widths (512 + 64: the decode kernel with fixed splits): every projection and
/// expert stays fp8 on both ranks.
fn fp8_model() -> tempfile::TempDir {
    let t = tempfile::tempdir().expect("tempdir");
    let o = serde_json::json!({"num_attention_heads": 16, "num_key_value_heads": 16, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 64, "kv_lora_rank": 512, "v_head_dim": 16, "intermediate_size": 256,
        "moe_intermediate_size": 256});
    let gen = mlaserve_model::presets::GenOptions { fp8: true, overrides: o, ..Default::default() };
    mlaserve_model::presets::generate_opts("tiny-v3", t.path(), &gen).expect("preset");
    t
}

/// fp8 on the fp8 GEMMs with the batch-invariant options (the streaming fp8 kernel, the
/// grouped expert kernel's streaming form): greedy k = 3 == k = 0 for the 64 requests,
/// on one GPU and on a TP 2 group.
#[test]
fn fp8_greedy_k3_equals_k0_batch_invariant_tp1_tp2() {
    if !require_gpu() {
        return;
    }
    let t = fp8_model();
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant();
    let be = CudaBackend::load_with(t.path(), opts).expect("load");
    let (fp8, all) = be.fp8_bytes();
    println!("fp8 model: {fp8} of {all} weight bytes in fp8");
    assert!(fp8 > all / 2, "the projections and experts stay fp8 ({fp8} of {all} bytes)");
    drop(be);
    let k0 = gpu_run(t.path(), opts, 0);
    let k3 = gpu_run(t.path(), opts, 3);
    assert!(k0.iter().map(Vec::len).sum::<usize>() > 64 * 4, "the workload generates tokens");
    println!("fp8 TP=1 batch-invariant: k3 vs k0 differ in {}/64 requests", differing(&k3, &k0));
    assert_eq!(k3, k0, "fp8 TP=1: greedy k = 3 differs from k = 0 (batch-invariant options)");
    if !require_gpus(2) {
        return;
    }
    let (t0, t3) = (tp_run(t.path(), opts, 2, 0), tp_run(t.path(), opts, 2, 3));
    println!(
        "fp8 TP=2 batch-invariant: k3 vs k0 differ in {}/64 requests; TP=2 vs TP=1 (k0) in {}/64 (fp8 noise, reported)",
        differing(&t3, &t0),
        differing(&t0, &k0)
    );
    assert_eq!(t3, t0, "fp8 TP=2: greedy k = 3 differs from k = 0 (batch-invariant options)");
}

/// A rank that stops taking part mid-run (it served a step, then stalls) makes the
/// other's next step fail with a clear error within the collective timeout, instead of
/// hanging, and the communicator stays failed.
///
/// (Before a communicator's first collective, NCCL sets up its connections inside the
/// host call, which then blocks until the peer joins: a rank stuck before its first step
/// is not bounded by this deadline. The worker's rendezvous and the NCCL init, which wait
/// for every rank, come before that.)
#[test]
fn a_stalled_rank_fails_the_step_within_the_timeout() {
    if !require_gpus(2) {
        return;
    }
    let t = model();
    let id = TpInit::new_id().expect("NCCL id");
    let timeout = Duration::from_secs(5);
    let init = |rank| TpInit { rank, world: 2, id: id.clone(), timeout };
    let chunk = |tokens: Vec<u32>, start_pos| mlaserve_core::SeqChunk {
        tokens,
        start_pos,
        block_table: vec![0],
        ..Default::default()
    };
    let prefill = mlaserve_core::Batch {
        argmax_rows: vec![],
        sample_rows: vec![],
        seqs: vec![chunk(vec![5, 6, 7], 0)],
        logit_rows: vec![2],
        ..Default::default()
    };
    let decode = mlaserve_core::Batch {
        argmax_rows: vec![],
        sample_rows: vec![],
        seqs: vec![chunk(vec![8], 3)],
        logit_rows: vec![0],
        ..Default::default()
    };
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        let dir = t.path();
        let prefill2 = prefill.clone();
        let staller = s.spawn(move || {
            let init = init(1);
            let mut be = CudaBackend::load_tp(dir, CudaOptions::new(BLOCKS, 1), Some(&init)).expect("load rank 1");
            be.forward(&prefill2).expect("rank 1's first step");
            // Now never join a collective again until released.
            let _ = rx.recv();
        });
        let mut be = CudaBackend::load_tp(dir, CudaOptions::new(BLOCKS, 0), Some(&init(0))).expect("load rank 0");
        be.forward(&prefill).expect("rank 0's first step");
        let t0 = Instant::now();
        let err = be.forward(&decode).expect_err("a step without the other rank must fail").to_string();
        let waited = t0.elapsed();
        println!("stalled rank: step failed after {waited:?}: {err}");
        assert!(waited < timeout + Duration::from_secs(5), "took {waited:?}");
        assert!(err.contains("peer rank died or stalls"), "{err}");
        let again = be.forward(&decode).expect_err("the group stays failed").to_string();
        assert!(again.contains("aborted"), "{again}");
        // Rank 0 goes first, as its own process would exit: its ncclCommAbort waits for
        // the CUDA graphs that captured the communicator, which its backend's drop
        // destroys, and the stalled rank's abort (NCCL's, in this one process) waits
        // behind it. The other order leaves rank 1's abort running past the test and
        // the process crashing at exit.
        drop(be);
        drop(tx);
        staller.join().expect("staller");
    });
}

/// Drafts kept on the ranks of a TP-2 group (each rank picks the ids from the
/// all-gathered maxima on the device; the one-shot collectives over peer memory) are the
/// drafts read back per stage: on the bundled model with graphs, fixed k = 3 and adaptive
/// k forced through every transition, the same tokens, drafts and accepted drafts per
/// position, and the tokens of k = 0.
#[test]
fn tp2_kept_drafts_equal_drafts_read_back_per_stage() {
    if !require_gpus(2) {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
    let run_on = |opts: CudaOptions, k: usize, pattern: &[usize]| {
        let cfg = EngineConfig {
            num_speculative_tokens: Some(k),
            speculation: if pattern.is_empty() { Speculation::Fixed } else { Speculation::Adaptive },
            max_batch_tokens: 256,
            ..Default::default()
        };
        tp_group::with_tp_group(&dir, opts, 2, |leader| {
            let keeps = leader.keeps_drafts();
            let mut e = Engine::new(leader, cfg).expect("engine");
            e.force_k(pattern);
            let ids: Vec<_> = workload().into_iter().map(|r| e.add_request(r).expect("admit")).collect();
            let out = run_to_completion(&mut e, &ids).expect("run");
            let t = e.stats().totals;
            (out, t.draft_tokens, t.accepted_per_position, keeps)
        })
    };
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant();
    let k0 = run_on(opts, 0, &[]).0;
    for pattern in [&[][..], &[3, 1, 2, 0, 1, 3, 2][..]] {
        let kept = run_on(opts, 3, pattern);
        let back = run_on(CudaOptions { keep_drafts: false, ..opts }, 3, pattern);
        println!("TP 2, k pattern {pattern:?}: {} drafts, accepted per position {:?}", kept.1, kept.2);
        assert!(kept.3 && !back.3, "the group keeps drafts when asked");
        assert!(kept.2.iter().sum::<u64>() > 0, "drafts accepted");
        assert_eq!(kept.0, back.0, "{pattern:?}: tokens");
        assert_eq!((kept.1, &kept.2), (back.1, &back.2), "{pattern:?}: drafts and acceptance");
        assert_eq!(kept.0, k0, "{pattern:?}: tokens as with k = 0");
    }
}
