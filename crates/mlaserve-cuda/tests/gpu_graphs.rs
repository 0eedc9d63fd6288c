//! CUDA graphs for decode steps (`backend/graphs.rs`) against the eager path, on two
//! models: `tiny-v3` (the generic decode kernel) and `tiny-v3` at DeepSeek-V3's attention
//! widths (512 + 64 latent, 16 heads: the decode kernel's fast path, mma.sync for 16-row
//! windows and wgmma + TMA for 64-row ones).
//!
//! Two backends of the same model take the same calls, one with graphs and one without:
//! a prefill (eager on both), then decode rounds (1- and 4-token windows, each followed by
//! MTP layer 0 on the target's hidden state), every sequence advancing. When the step's
//! sequence count is a bucket (8), the graph runs exactly the eager kernels on exactly the
//! same rows: logits and hidden states must be equal bit for bit, round after round (the
//! persistent inputs refilled, the outputs copied out). With 5 or 3 sequences the graph
//! pads to 8 or 4; padding rows must not disturb the real ones (no latent written, cuBLAS
//! may pick another algorithm for the padded row count): within 1e-2 of max |eager|. With
//! the batch-invariant options (run on both models too; at tiny-v3's own widths the
//! decode attention is then the varlen kernel) every round must be bit-identical. Every
//! decode call of the graph backend must have taken the graph path (each graph's first
//! step runs eagerly on its buffers, then is captured; every later one is a launch), none
//! of the eager one's.
//!
//! Then the engine on each: greedy output with graphs equals eager output, 8 requests
//! decoding together (k = 0, every step a full bucket); k = 3 is reported.
//!
//! With two GPUs, the decode rounds also run on tensor-parallel groups of two ranks,
//! graphs on (the default) against eager.
#![cfg(feature = "cuda")]

mod common;

use common::{rel, require_gpu};
use mlaserve_core::{Backend, Batch, SeqChunk};
use mlaserve_cuda::{CudaBackend, CudaOptions, GraphStats};
use mlaserve_engine::{Engine, EngineConfig, Request, SamplingParams};

const BLOCKS: usize = 64;
const SEQS: usize = 8;
/// Blocks per sequence (256 positions).
const PER_SEQ: usize = 4;

fn toks(seed: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| 2 + ((seed * 7919 + i * 131) % 509) as u32).collect()
}

/// A step over sequences `which` (each at its current length), `q_len` new tokens each,
/// logits for every row.
fn step(lens: &[usize], which: &[usize], q_len: usize, round: usize) -> Batch {
    let seqs: Vec<SeqChunk> = which
        .iter()
        .map(|&i| SeqChunk {
            tokens: toks(round * 31 + i, q_len),
            start_pos: lens[i],
            block_table: (0..PER_SEQ as u32).map(|b| i as u32 * PER_SEQ as u32 + b).collect(),
            prefill: false,
        })
        .collect();
    let n = seqs.iter().map(|c| c.tokens.len() as u32).sum();
    Batch { seqs, logit_rows: (0..n).collect(), ..Default::default() }
}

/// The prompts of every sequence, `lens[i]` tokens each, in one prefill batch.
fn prefill(lens: &[usize]) -> Batch {
    let seqs = (0..SEQS)
        .map(|i| SeqChunk {
            tokens: toks(i, lens[i]),
            start_pos: 0,
            block_table: (0..PER_SEQ as u32).map(|b| i as u32 * PER_SEQ as u32 + b).collect(),
            prefill: true,
        })
        .collect();
    Batch { seqs, logit_rows: vec![0], ..Default::default() }
}

/// The prefill, then the decode rounds, on a graph backend `g` and an eager one `e` of
/// the same model: each difference beyond what the round allows, and the graph side's
/// decode calls. `long_mtp`: MTP calls over windows of 5–8 rows run as graphs too (the
/// later stages of a drafting pass, where rows stay absorbed: `CudaOptions::
/// batch_invariant`); the target's such windows run eagerly.
fn run_rounds(
    g: &mut CudaBackend,
    e: &mut CudaBackend,
    name: &str,
    quiet: bool,
    all_exact: bool,
    long_mtp: bool,
) -> (Vec<String>, u64) {
    let mut fails = Vec::new();
    let mut lens = [37usize, 90, 5, 150, 64, 120, 11, 200];
    let all: Vec<usize> = (0..SEQS).collect();
    let prefill = prefill(&lens);
    g.forward(&prefill).expect("prefill");
    e.forward(&prefill).expect("prefill");
    let mut decode_calls = 0u64;
    // (sequences, window, exact?): full buckets, padded ones, then full buckets again.
    let five = [0usize, 2, 3, 5, 7];
    let plan: Vec<(&[usize], usize, bool)> = vec![
        (&all, 1, true),
        (&all, 1, true),
        (&all, 4, true),
        (&all, 4, true),
        (&five, 1, false),
        (&five, 4, false),
        (&five[..3], 4, false),
        (&all, 1, false),
        (&all, 4, false),
        (&all, 6, false),
        (&five, 5, false),
        (&all, 6, false),
    ];
    for (round, &(which, q_len, exact)) in plan.iter().enumerate() {
        let b = step(&lens, which, q_len, round);
        let og = g.forward(&b).expect("graph forward");
        let oe = e.forward(&b).expect("eager forward");
        let rows: Vec<u32> = (0..b.num_tokens() as u32).collect();
        let mg = g.mtp_forward(0, &b, &og.hidden, &rows).expect("graph mtp");
        let me = e.mtp_forward(0, &b, &oe.hidden, &rows).expect("eager mtp");
        decode_calls += u64::from(q_len <= 4) + u64::from(q_len <= 4 || long_mtp);
        let hg = g.hidden_to_host(&mg.hidden).expect("hidden");
        let he = e.hidden_to_host(&me.hidden).expect("hidden");
        let pairs = [
            ("target logits", &og.logits, &oe.logits),
            ("MTP logits", &mg.logits, &me.logits),
            ("MTP hidden", &hg, &he),
        ];
        for (what, got, want) in pairs {
            let r = rel(got, want);
            let tag = format!("{name}, round {round} ({} seqs, q_len {q_len}): {what}", which.len());
            let exact = exact || all_exact;
            let ok = if exact { got == want } else { r <= 1e-2 };
            if !quiet {
                println!("{tag:<64} rel {r:.2e} {}", if ok { "ok" } else { "FAIL" });
            }
            if !ok {
                fails.push(format!("{tag}: rel {r:.3e}{}", if exact { " (must be bit-identical)" } else { "" }));
            }
        }
        for &i in which {
            lens[i] += q_len;
        }
    }
    if e.graph_stats() != GraphStats::default() {
        fails.push(format!("{name}: the eager backend ran graphs: {:?}", e.graph_stats()));
    }
    (fails, decode_calls)
}

#[test]
fn decode_steps_through_graphs_equal_eager() {
    if !require_gpu() {
        return;
    }
    let mut fails = Vec::new();
    for (v3, invariant) in [(false, false), (true, false), (false, true), (true, true)] {
        let t = common::tiny_v3(v3);
        let name = match (v3, invariant) {
            (false, false) => "tiny-v3",
            (true, false) => "tiny-v3 @ 512+64, 16 heads",
            // The varlen attention (these widths have no tensor-core kernel): graphs too.
            (false, true) => "tiny-v3, batch-invariant",
            (true, true) => "tiny-v3 @ 512+64, batch-invariant",
        };
        let o = CudaOptions::new(BLOCKS, 0);
        let o = if invariant { o.batch_invariant() } else { o };
        let mut g = CudaBackend::load_with(t.path(), o).expect("load");
        let mut e = CudaBackend::load_with(t.path(), CudaOptions { graphs: false, ..o }).expect("load");
        // Batch-invariant: a padded bucket changes no real row's bits either.
        let (f, decode_calls) = run_rounds(&mut g, &mut e, name, false, invariant, invariant);
        fails.extend(f);
        let st = g.graph_stats();
        println!("{name}: {decode_calls} decode calls: {st:?}");
        // Every decode call on the graph path; each graph's first step runs eagerly (the
        // warm-up before its capture), every later one launches it.
        if st.steps != decode_calls
            || st.launches != decode_calls - st.graphs as u64
            || st.graphs == 0
            || st.failed != 0
        {
            fails.push(format!("{name}: {decode_calls} decode calls, {st:?}"));
        }
    }
    assert!(fails.is_empty(), "{fails:#?}");
}

/// The same rounds on tensor-parallel groups of two ranks (threads, GPUs 0 and 1, NCCL):
/// a group with graphs on its ranks (the default) against an eager group. Each rank holds
/// one backend of each group and makes the same calls, so both communicators see the
/// same collectives in the same order. Full buckets must be bit-identical, as on one
/// rank, and both ranks' outputs agree. On a TP rank each capture is launched at once, so
/// every decode call launches a graph.
#[test]
fn tp2_decode_steps_through_graphs_equal_eager() {
    if !common::require_gpus(2) {
        return;
    }
    let t = common::tiny_v3(true);
    let dir = t.path();
    let mut fails = Vec::new();
    // Default options, then batch-invariant ones (ordered all-reduce; MTP windows of
    // 5–8 rows as graphs too, their rows bit-identical to eager ones).
    for invariant in [false, true] {
        let (gid, eid) =
            (mlaserve_cuda::TpInit::new_id().expect("NCCL id"), mlaserve_cuda::TpInit::new_id().expect("NCCL id"));
        let results: Vec<(Vec<String>, u64, GraphStats)> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    let (gid, eid) = (gid.clone(), eid.clone());
                    s.spawn(move || {
                        let timeout = std::time::Duration::from_secs(60);
                        let gi = mlaserve_cuda::TpInit { rank, world: 2, id: gid, timeout };
                        let ei = mlaserve_cuda::TpInit { rank, world: 2, id: eid, timeout };
                        let base = CudaOptions::new(BLOCKS, rank);
                        let base = if invariant { base.batch_invariant() } else { base };
                        let mut g = CudaBackend::load_tp(dir, base, Some(&gi)).expect("load graph rank");
                        let mut e = CudaBackend::load_tp(dir, CudaOptions { graphs: false, ..base }, Some(&ei))
                            .expect("load eager rank");
                        let name = format!("TP2 rank {rank}, batch-invariant {invariant}");
                        let (f, calls) = run_rounds(&mut g, &mut e, &name, rank != 0, invariant, invariant);
                        (f, calls, g.graph_stats())
                    })
                })
                .collect();
            ranks.into_iter().map(|r| r.join().expect("rank thread")).collect()
        });
        for (rank, (f, calls, st)) in results.into_iter().enumerate() {
            println!("TP2 rank {rank}, batch-invariant {invariant}: {calls} decode calls: {st:?}");
            fails.extend(f);
            if st.steps != calls || st.launches != calls || st.graphs == 0 || st.failed != 0 {
                fails.push(format!("TP2 rank {rank}, batch-invariant {invariant}: {calls} decode calls, {st:?}"));
            }
        }
    }
    assert!(fails.is_empty(), "{fails:#?}");
}

/// Runs 8 greedy requests of equal length through the engine; each one's tokens.
fn engine_run(dir: &std::path::Path, graphs: bool, k: usize) -> (Vec<Vec<u32>>, GraphStats) {
    let be = CudaBackend::load_with(dir, CudaOptions { graphs, ..CudaOptions::new(BLOCKS, 0) }).expect("load");
    // Every prompt prefilled in the first step, so the 8 decode together until the end.
    let cfg = EngineConfig { num_speculative_tokens: Some(k), max_batch_tokens: 1024, ..Default::default() };
    let mut e = Engine::new(be, cfg).expect("engine");
    let ids: Vec<_> = (0..SEQS)
        .map(|i| {
            let params = SamplingParams { max_new_tokens: 48, ignore_eos: true, ..Default::default() };
            e.add_request(Request::new(toks(100 + i, 20 + 9 * i), params)).expect("admit")
        })
        .collect();
    let out = mlaserve_engine::testing::run_to_completion(&mut e, &ids).expect("run");
    (out, e.backend().graph_stats())
}

#[test]
fn engine_greedy_with_graphs_equals_eager() {
    if !require_gpu() {
        return;
    }
    for v3 in [false, true] {
        let t = common::tiny_v3(v3);
        for k in [0usize, 3] {
            let (eager, none) = engine_run(t.path(), false, k);
            let (graphs, st) = engine_run(t.path(), true, k);
            let differ = eager.iter().zip(&graphs).filter(|(a, b)| a != b).count();
            println!("v3 attention {v3}, k = {k}: {differ}/{SEQS} requests differ; {st:?}");
            assert_eq!(none, GraphStats::default(), "the eager engine ran graphs");
            assert!(st.launches > 0, "no decode step ran as a graph");
            if k == 0 {
                assert_eq!(differ, 0, "greedy output with graphs differs from eager (k = 0, full buckets)");
            }
        }
    }
}

/// A backend holding its most graphs (`CudaOptions::max_graphs`, 2 here): a new shape
/// runs eagerly while both held graphs are in use, and takes the place of the one that
/// has gone unused for `GRAPH_IDLE_STEPS` graph steps once there is one; every output
/// equals the eager backend's bit for bit (batch-invariant options).
#[test]
fn a_full_graph_cache_replaces_its_longest_idle_graph() {
    if !require_gpu() {
        return;
    }
    let t = common::tiny_v3(false);
    let o = CudaOptions::new(BLOCKS, 0).batch_invariant();
    let mut g = CudaBackend::load_with(t.path(), CudaOptions { max_graphs: 2, ..o }).expect("load");
    let mut e = CudaBackend::load_with(t.path(), CudaOptions { graphs: false, ..o }).expect("load");
    let lens = [37usize, 90, 5, 150, 64, 120, 11, 200];
    let all: Vec<usize> = (0..SEQS).collect();
    let prefill = prefill(&lens);
    g.forward(&prefill).expect("prefill");
    e.forward(&prefill).expect("prefill");
    // Three shapes (the same batch each time, so repeating one rewrites the same latents).
    let a = step(&lens, &all, 1, 0);
    let b = step(&lens, &all, 4, 1);
    let c = step(&lens, &all[..3], 4, 2);
    let mut check = |g: &mut CudaBackend, batch: &Batch, what: &str| {
        let got = g.forward(batch).expect("graph backend").logits;
        let want = e.forward(batch).expect("eager backend").logits;
        assert!(got == want, "{what}: rel {:.2e}, must be bit-identical", rel(&got, &want));
        g.graph_stats()
    };
    check(&mut g, &a, "a, captured");
    let st = check(&mut g, &b, "b, captured");
    assert_eq!((st.graphs, st.steps, st.evicted), (2, 2, 0), "{st:?}");
    let st = check(&mut g, &c, "c while a and b are in use");
    assert_eq!((st.graphs, st.steps, st.evicted), (2, 2, 0), "c runs eagerly: {st:?}");
    for _ in 0..mlaserve_cuda::layout::GRAPH_IDLE_STEPS {
        g.forward(&a).expect("a");
    }
    let st = check(&mut g, &a, "a, replayed");
    let steps = 3 + mlaserve_cuda::layout::GRAPH_IDLE_STEPS;
    assert_eq!((st.graphs, st.steps, st.evicted), (2, steps, 0), "{st:?}");
    let st = check(&mut g, &c, "c in b's place");
    assert_eq!((st.graphs, st.steps, st.evicted), (2, steps + 1, 1), "{st:?}");
    let st = check(&mut g, &b, "b while a and c are in use");
    assert_eq!((st.graphs, st.steps, st.evicted), (2, steps + 1, 1), "b runs eagerly: {st:?}");
    assert_eq!(g.graph_captures(), 3);
    println!("a full graph cache: {st:?}");
}
