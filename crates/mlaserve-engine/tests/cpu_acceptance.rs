//! Issue 3's acceptance tests on the real CPU reference backend with the `tiny-v3`
//! checkpoint: greedy losslessness across k, preemption, seeded determinism, sampled
//! tokens from the backend equal to the host rule's, no leak.
//!
//! tiny-v3 declares `max_position_embeddings: 512`, room for the prompts of up to
//! 300 tokens plus 64 new ones.

mod common;

use common::{random_arrivals, run_all, Arrival, Outcome, TestRng};
use mlaserve_core::{Backend, Batch, SeqChunk};
use mlaserve_cpu::CpuBackend;
use mlaserve_engine::sampling::choose_token;
use mlaserve_engine::{Engine, EngineConfig, Event, FinishReason, Request, SamplingParams};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const VOCAB: u32 = 512;

fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().expect("tempdir").keep();
        mlaserve_model::presets::generate("tiny-v3", &dir).expect("generate tiny-v3");
        dir
    })
}

fn engine(k: usize, blocks: usize, budget: usize) -> Engine<CpuBackend> {
    let backend = CpuBackend::load(model_dir(), blocks).expect("load tiny-v3");
    let cfg = EngineConfig {
        num_speculative_tokens: Some(k),
        max_batch_tokens: budget,
        max_num_seqs: 64,
        ..Default::default()
    };
    Engine::new(backend, cfg).expect("engine")
}

/// The workload: 64 requests, prompts 1–300, 1–64 new tokens, arrivals over
/// the first 30 steps.
fn workload() -> &'static [Arrival] {
    static W: OnceLock<Vec<Arrival>> = OnceLock::new();
    W.get_or_init(|| random_arrivals(&mut TestRng(33), 64, VOCAB, (1, 300), (1, 64), 30, &SamplingParams::default()))
}

/// k = 0 output of the workload with a large pool: the reference.
fn baseline() -> &'static [Outcome] {
    static B: OnceLock<Vec<Outcome>> = OnceLock::new();
    B.get_or_init(|| run_all(&mut engine(0, 512, 160), workload()))
}

fn assert_same(reference: &[Outcome], out: &[Outcome], what: &str) {
    for (i, (x, y)) in reference.iter().zip(out).enumerate() {
        assert_eq!(x.tokens, y.tokens, "{what}: request {i} differs");
        assert_eq!(x.reason, y.reason, "{what}: request {i} finish reason");
    }
}

#[test]
fn greedy_lossless_k1_to_k4() {
    let base = baseline();
    let generated: usize = base.iter().map(|o| o.tokens.len()).sum();
    assert!(generated > 64 * 8, "the workload generates enough tokens ({generated})");
    for k in 1..=4 {
        let mut e = engine(k, 512, 160);
        let out = run_all(&mut e, workload());
        assert_same(base, &out, &format!("k={k}"));
        let st = e.stats();
        eprintln!(
            "tiny-v3 k={k}: drafted {} accepted {} per position {:?} mean acceptance length {:.2}",
            st.totals.draft_tokens,
            st.totals.accepted_tokens,
            st.totals.accepted_per_position,
            st.totals.mean_acceptance_length()
        );
        assert_eq!(st.totals.draft_tokens, st.totals.decode_steps * k as u64);
    }
}

#[test]
fn preemption_small_pool_same_greedy_output() {
    // 16 blocks hold about 1000 positions; the workload's live requests need far more.
    for k in [3, 0] {
        let mut e = engine(k, 16, 160);
        let out = run_all(&mut e, workload());
        let pre: u64 = out.iter().map(|o| o.usage.preemptions).sum();
        assert!(pre > 0, "k={k}: the small pool must preempt");
        assert_same(baseline(), &out, &format!("small pool, k={k}"));
    }
}

#[test]
fn seeded_request_alone_equals_in_batch() {
    let seeded = Request::new(
        (0..20).map(|i| (i * 37 + 11) % VOCAB).collect(),
        SamplingParams {
            temperature: 0.9,
            top_k: 0,
            top_p: 0.95,
            seed: Some(1234),
            max_new_tokens: 48,
            ..Default::default()
        },
    );
    let alone = |k| run_all(&mut engine(k, 128, 160), &[Arrival { at: 0, req: seeded.clone() }]).remove(0);
    let a3 = alone(3);
    assert_eq!(alone(0).tokens, a3.tokens, "k does not change a seeded output");
    let mut rng = TestRng(9);
    let mut others = random_arrivals(&mut rng, 32, VOCAB, (1, 120), (1, 40), 6, &SamplingParams::default());
    for (i, o) in others.iter_mut().enumerate() {
        if i % 2 == 0 {
            o.req.sampling.temperature = 1.0;
            o.req.sampling.top_k = 50;
        }
    }
    let greedy: Vec<Arrival> = others.iter().skip(1).step_by(2).cloned().collect();
    others.push(Arrival { at: 3, req: seeded.clone() });
    let out = run_all(&mut engine(3, 256, 160), &others);
    assert_eq!(out[32].tokens, a3.tokens, "same tokens inside a batch of 32");
    // The greedy requests (their rows return only an argmax) read the same tokens with
    // sampled requests (whose rows return logits) between them as among themselves.
    let alone = run_all(&mut engine(3, 256, 160), &greedy);
    for (i, g) in alone.iter().enumerate() {
        assert_eq!(out[2 * i + 1].tokens, g.tokens, "greedy request {} beside sampled ones", 2 * i + 1);
    }
}

/// Sampled requests go to the backend as `Batch::sample_rows` (the CPU backend applies
/// `mlaserve_core::sample_token` to its own logits row). Their tokens must not depend on
/// k, and every token must be the one the old host path picks: the row's logits copied
/// to the host (`logit_rows`) and the engine's host rule with the request's uniform for
/// that position (`choose_token`), replayed here one position at a time.
#[test]
fn sampled_tokens_backend_path_equals_host_path() {
    let params = [
        SamplingParams { temperature: 0.8, ..Default::default() },
        SamplingParams { temperature: 1.3, top_k: 20, top_p: 0.9, ..Default::default() },
        SamplingParams { temperature: 0.5, top_p: 0.6, ..Default::default() },
        SamplingParams { temperature: 2.0, top_k: 3, ..Default::default() },
    ];
    let arrivals: Vec<Arrival> = params
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let prompt = (0..12 + 5 * i as u32).map(|j| (j * 29 + 3 * i as u32 + 5) % VOCAB).collect();
            let sampling =
                SamplingParams { seed: Some(500 + i as u64), max_new_tokens: 40, ignore_eos: true, ..p.clone() };
            Arrival { at: i, req: Request::new(prompt, sampling) }
        })
        .collect();
    let k0 = run_all(&mut engine(0, 128, 160), &arrivals);
    let k3 = run_all(&mut engine(3, 128, 160), &arrivals);
    let mut backend = CpuBackend::load(model_dir(), 8).expect("load tiny-v3");
    let table: Vec<u32> = (0..8).collect();
    for (i, (a, (x0, x3))) in arrivals.iter().zip(k0.iter().zip(&k3)).enumerate() {
        assert_eq!(x0.tokens.len(), 40, "request {i} runs to max_new_tokens");
        assert_eq!(x0.tokens, x3.tokens, "request {i}: k = 3 changes a sampled output");
        // The old host path, position by position: the prompt, then one emitted token at a
        // time, each step's last row copied out and sampled on the host.
        let sp = &a.req.sampling;
        let seed = sp.seed.expect("seeded");
        let mut start = 0;
        let mut feed = a.req.prompt.clone();
        for (j, &want) in x3.tokens.iter().enumerate() {
            let batch = Batch {
                argmax_rows: vec![],
                sample_rows: vec![],
                seqs: vec![SeqChunk {
                    tokens: feed.clone(),
                    start_pos: start,
                    block_table: table.clone(),
                    ..Default::default()
                }],
                logit_rows: vec![feed.len() as u32 - 1],
                ..Default::default()
            };
            let logits = backend.forward(&batch).expect("replay step").logits;
            start += feed.len();
            let got = choose_token(&logits, sp, seed, start as u64);
            assert_eq!(got, want, "request {i} token {j}: host path {got}, backend path {want}");
            feed = vec![want];
        }
    }
}

#[test]
fn no_leak_random_operations() {
    let mut rng = TestRng(5);
    let mut e = engine(3, 12, 64);
    let mut live = Vec::new();
    let (mut finished, mut aborted) = (0u64, 0u64);
    for _ in 0..5_000 {
        let r = rng.f64();
        if r < 0.25 {
            let len = rng.range(1, 64) as usize;
            let prompt = (0..len).map(|_| rng.range(2, VOCAB as u64 - 1) as u32).collect();
            let sp = SamplingParams {
                max_new_tokens: rng.range(1, 24) as u32,
                temperature: if rng.f64() < 0.5 { 0.0 } else { 1.0 },
                ignore_eos: true,
                ..Default::default()
            };
            live.push(e.add_request(Request::new(prompt, sp)).expect("fits the pool"));
        } else if r < 0.33 && !live.is_empty() {
            let id = live.swap_remove(rng.range(0, live.len() as u64 - 1) as usize);
            e.abort(id).expect("live request");
        } else {
            for (id, ev) in e.step() {
                if let Event::Finished { reason, .. } = ev {
                    assert!(!matches!(reason, FinishReason::Error(_)), "{reason:?}");
                    if reason == FinishReason::Abort {
                        aborted += 1;
                    } else {
                        finished += 1;
                        live.retain(|&x| x != id);
                    }
                }
            }
        }
        e.check_invariants().expect("block accounting");
    }
    for id in live.drain(..) {
        e.abort(id).expect("live");
    }
    e.step();
    let st = e.stats();
    assert_eq!(st.load.kv_blocks_free, st.load.kv_blocks_total, "every block free at the end");
    assert!(finished > 50 && aborted > 50, "finished {finished}, aborted {aborted}");
    assert!(st.totals.preemptions > 0, "the pool is small enough to preempt");
}
