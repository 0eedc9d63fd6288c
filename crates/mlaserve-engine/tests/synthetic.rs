//! Scheduling-logic tests on the deterministic [`SyntheticBackend`] (fast; the
//! acceptance tests on the real CPU backend live in `cpu_*.rs`).

mod common;

use common::{random_arrivals, run_all, Arrival, TestRng};
use mlaserve_engine::testing::SyntheticBackend;
use mlaserve_engine::{Engine, EngineConfig, EngineError, Event, FinishReason, Request, SamplingParams, StopMatch};

const VOCAB: usize = 64;

fn engine(k: usize, blocks: usize, budget: usize) -> Engine<SyntheticBackend> {
    engine_with(k, blocks, budget, true)
}

fn engine_with(k: usize, blocks: usize, budget: usize, prefix: bool) -> Engine<SyntheticBackend> {
    let b = SyntheticBackend::new(VOCAB, 2, blocks, 4096);
    let cfg = EngineConfig {
        num_speculative_tokens: Some(k),
        max_batch_tokens: budget,
        max_num_seqs: 64,
        enable_prefix_caching: prefix,
        ..Default::default()
    };
    Engine::new(b, cfg).expect("engine")
}

fn arrivals(seed: u64, n: usize, sampling: &SamplingParams) -> Vec<Arrival> {
    random_arrivals(&mut TestRng(seed), n, VOCAB as u32, (1, 300), (1, 64), 40, sampling)
}

#[test]
fn greedy_lossless_across_k() {
    let a = arrivals(1, 64, &SamplingParams::default());
    let base = run_all(&mut engine(0, 1024, 256), &a);
    for k in 1..=4 {
        let mut e = engine(k, 1024, 256);
        let out = run_all(&mut e, &a);
        for (i, (x, y)) in base.iter().zip(&out).enumerate() {
            assert_eq!(x.tokens, y.tokens, "k={k} request {i}");
            assert_eq!(x.reason, y.reason, "k={k} request {i}");
        }
        let st = e.stats();
        assert!(st.totals.accepted_tokens > 0, "k={k}: some drafts accepted");
        assert!(st.totals.accepted_tokens < st.totals.draft_tokens);
        assert_eq!(st.totals.accepted_per_position.len(), k);
        assert_eq!(st.totals.accepted_per_position.iter().sum::<u64>(), st.totals.accepted_tokens);
    }
}

/// Drafts kept on the backend between a pass's stages (`Backend::keeps_drafts`, as the
/// CUDA backend keeps them on its device) are the drafts the engine would have written
/// itself: the same tokens, drafts and acceptance per request, at every k (2 MTP layers:
/// k = 3, 4 chain the last one), greedy and sampled, with preemption.
#[test]
fn kept_drafts_equal_drafts_through_the_host() {
    let sp = SamplingParams { temperature: 0.8, top_k: 20, ..Default::default() };
    let mut a = arrivals(6, 48, &SamplingParams::default());
    for (i, x) in arrivals(7, 16, &sp).into_iter().enumerate() {
        a.push(Arrival {
            req: Request { sampling: SamplingParams { seed: Some(i as u64), ..x.req.sampling }, ..x.req },
            ..x
        });
    }
    for (k, blocks) in [(1, 1024), (2, 1024), (3, 1024), (4, 1024), (3, 24)] {
        let host = run_all(&mut engine_with(k, blocks, 256, false), &a);
        let mut e = engine_with(k, blocks, 256, false);
        e.backend_mut().keep_drafts = true;
        let kept = run_all(&mut e, &a);
        assert!(e.backend().passes_kept > 0, "k={k}: the passes kept their drafts");
        assert!(e.stats().totals.accepted_tokens > 0, "k={k}: drafts accepted");
        for (i, (x, y)) in host.iter().zip(&kept).enumerate() {
            assert_eq!(x, y, "k={k}, {blocks} blocks, request {i}: tokens, drafts and acceptance");
        }
        if blocks < 100 {
            assert!(kept.iter().map(|o| o.usage.preemptions).sum::<u64>() > 0, "the small pool must preempt");
        }
    }
    // A pass without drafts (a prompt chunk short of its prompt's end, the first work of
    // a fresh engine) reads none back.
    let long =
        [Arrival { at: 0, req: Request::new((0..200).map(|i| 2 + i % 60).collect(), SamplingParams::default()) }];
    let host = run_all(&mut engine_with(3, 1024, 64, false), &long);
    let mut e = engine_with(3, 1024, 64, false);
    e.backend_mut().keep_drafts = true;
    assert_eq!(run_all(&mut e, &long), host, "a long prompt first, in chunks");
}

#[test]
fn sampled_outputs_independent_of_k_and_batch() {
    let sp = SamplingParams { temperature: 1.0, top_k: 20, top_p: 0.9, ..Default::default() };
    let a: Vec<Arrival> = arrivals(2, 40, &sp)
        .into_iter()
        .enumerate()
        .map(|(i, mut a)| {
            a.req.sampling.seed = Some(1000 + i as u64);
            a
        })
        .collect();
    let base = run_all(&mut engine(0, 1024, 128), &a);
    let out = run_all(&mut engine(3, 1024, 512), &a);
    assert_eq!(base, base.clone());
    for (x, y) in base.iter().zip(&out) {
        assert_eq!(x.tokens, y.tokens);
    }
    // Alone:
    let alone = run_all(&mut engine(3, 1024, 128), &[Arrival { at: 0, ..a[5].clone() }]);
    assert_eq!(alone[0].tokens, base[5].tokens);
}

/// The engine marks prompt chunks (`SeqChunk::prefill`, which the CUDA backend's
/// batch-invariant options route by): every prompt token goes through a marked chunk once,
/// decode windows (at most k + 1 tokens) are unmarked; a preempted sequence prefills its
/// prompt again in marked chunks and its generated tokens in unmarked ones (prefix
/// caching off, so a recomputed prompt is prefilled from its start).
#[test]
fn prefill_chunks_are_marked() {
    let a = arrivals(4, 32, &SamplingParams::default());
    let prompts: u64 = a.iter().map(|x| x.req.prompt.len() as u64).sum();
    let mut e = engine(3, 2048, 96);
    let out = run_all(&mut e, &a);
    assert_eq!(out.iter().map(|o| o.usage.preemptions).sum::<u64>(), 0);
    let b = e.backend();
    assert_eq!(b.prefill_tokens, prompts, "each prompt token prefilled once, in marked chunks");
    assert!(b.window_tokens > 0 && b.longest_window <= 4, "windows of 1 + k tokens at most, unmarked");
    let mut small = engine_with(3, 16, 96, false);
    let out = run_all(&mut small, &a);
    assert!(out.iter().map(|o| o.usage.preemptions).sum::<u64>() > 0, "the small pool must preempt");
    assert!(small.backend().prefill_tokens > prompts, "a recomputed prompt is prefilled again");
}

#[test]
fn preemption_small_pool_same_output() {
    let a = arrivals(3, 48, &SamplingParams::default());
    let big = run_all(&mut engine(3, 2048, 512), &a);
    let mut small = engine(3, 24, 512);
    let out = run_all(&mut small, &a);
    let preemptions: u64 = out.iter().map(|o| o.usage.preemptions).sum();
    assert!(preemptions > 0, "the small pool must preempt");
    for (i, (x, y)) in big.iter().zip(&out).enumerate() {
        assert_eq!(x.tokens, y.tokens, "request {i}");
    }
}

#[test]
fn no_leak_random_ops() {
    let mut rng = TestRng(4);
    let mut e = engine(3, 24, 200);
    let mut live = Vec::new();
    let mut ops = 0;
    let (mut finished, mut aborted) = (0, 0);
    while ops < 20_000 {
        let r = rng.f64();
        if r < 0.3 {
            let len = rng.range(1, 200) as usize;
            let prompt = (0..len).map(|_| rng.range(2, VOCAB as u64 - 1) as u32).collect();
            let sp = SamplingParams {
                max_new_tokens: rng.range(1, 80) as u32,
                ignore_eos: rng.f64() < 0.7,
                ..Default::default()
            };
            match e.add_request(Request::new(prompt, sp)) {
                Ok(id) => live.push(id),
                Err(EngineError::InvalidRequest { field, .. }) => {
                    assert_eq!(field, "stopping.max_new_tokens")
                }
                Err(err) => panic!("{err}"),
            }
        } else if r < 0.4 && !live.is_empty() {
            let i = rng.range(0, live.len() as u64 - 1) as usize;
            let id = live.swap_remove(i);
            e.abort(id).expect("live request");
            assert!(e.abort(id).is_err(), "double abort is an error");
        } else {
            for (id, ev) in e.step() {
                if let Event::Finished { reason, .. } = ev {
                    if reason == FinishReason::Abort {
                        aborted += 1;
                    } else {
                        finished += 1;
                        live.retain(|&x| x != id);
                    }
                }
            }
        }
        e.check_invariants().expect("accounting");
        let l = e.load();
        assert!(l.kv_blocks_free <= l.kv_blocks_total);
        ops += 1;
    }
    for id in live.drain(..) {
        e.abort(id).expect("live");
    }
    e.step();
    let st = e.stats();
    assert_eq!(st.load.kv_blocks_free, st.load.kv_blocks_total);
    assert_eq!(st.load.running_requests + st.load.queued_requests, 0);
    assert!(finished > 100 && aborted > 100, "finished {finished}, aborted {aborted}");
    assert!(st.totals.preemptions > 0, "the pool is small enough to preempt: {st:?}");
}

#[test]
fn stop_conditions_cut_the_run() {
    let mut base = engine(0, 256, 256);
    let prompt = vec![5, 6, 7];
    let long = SamplingParams { max_new_tokens: 40, ignore_eos: true, ..Default::default() };
    let full = run_all(&mut base, &[Arrival { at: 0, req: Request::new(prompt.clone(), long.clone()) }]);
    let toks = &full[0].tokens;
    assert_eq!(toks.len(), 40);
    for k in [0, 3] {
        let mut e = engine(k, 256, 256);
        let stop_tok = toks[10];
        let first = toks.iter().position(|&t| t == stop_tok).expect("present");
        let sp = SamplingParams { stop_token_ids: vec![stop_tok], ..long.clone() };
        let o = run_all(&mut e, &[Arrival { at: 0, req: Request::new(prompt.clone(), sp) }]);
        assert_eq!(o[0].tokens, toks[..=first].to_vec());
        assert_eq!(o[0].reason, FinishReason::Stop(StopMatch::StopToken(stop_tok)));
        let seq = toks[20..23].to_vec();
        let sp = SamplingParams { stop_sequences: vec![vec![999], seq.clone()], ..long.clone() };
        let o = run_all(&mut e, &[Arrival { at: 0, req: Request::new(prompt.clone(), sp) }]);
        let end = (3..=toks.len()).find(|&n| toks[..n].ends_with(&seq)).expect("present");
        assert_eq!(o[0].tokens, toks[..end].to_vec());
        assert_eq!(o[0].reason, FinishReason::Stop(StopMatch::StopSequence(1)));
        let sp = SamplingParams { max_new_tokens: 7, ..long.clone() };
        let o = run_all(&mut e, &[Arrival { at: 0, req: Request::new(prompt.clone(), sp) }]);
        assert_eq!(o[0].tokens, toks[..7].to_vec());
        assert_eq!(o[0].reason, FinishReason::Length);
    }
}

#[test]
fn context_length_and_validation() {
    let b = SyntheticBackend::new(VOCAB, 1, 64, 64);
    // 64 positions × (1 target + 1 MTP layer) × (kv_lora_rank 4 + rope 2) × 4 bytes.
    assert_eq!(mlaserve_engine::block::kv_block_bytes(mlaserve_core::Backend::config(&b), 4), 3072);
    assert_eq!(mlaserve_engine::block::blocks_for_bytes(mlaserve_core::Backend::config(&b), 4, 10_000), 3);
    let cfg = EngineConfig { num_speculative_tokens: Some(3), max_batch_tokens: 64, ..Default::default() };
    let mut e = Engine::new(b, cfg).expect("engine");
    assert_eq!(e.max_model_len(), 56);
    let sp = SamplingParams { max_new_tokens: 1000, ignore_eos: true, ..Default::default() };
    let o = run_all(&mut e, &[Arrival { at: 0, req: Request::new(vec![3; 50], sp.clone()) }]);
    assert_eq!(o[0].tokens.len(), 6);
    assert_eq!(o[0].reason, FinishReason::Length);
    let mut bad = |r: Request| match e.add_request(r) {
        Err(EngineError::InvalidRequest { field, .. }) => field,
        other => panic!("expected invalid request, got {other:?}"),
    };
    assert_eq!(bad(Request::new(vec![], sp.clone())), "prompt.token_ids");
    assert_eq!(bad(Request::new(vec![3, VOCAB as u32], sp.clone())), "prompt.token_ids[1]");
    assert_eq!(bad(Request::new(vec![3; 56], sp.clone())), "prompt.token_ids");
    let bad_max = SamplingParams { max_new_tokens: 0, ..sp.clone() };
    assert_eq!(bad(Request::new(vec![3], bad_max)), "stopping.max_new_tokens");
    assert_eq!(bad(Request::new(vec![3], SamplingParams { top_p: 0.0, ..sp.clone() })), "sampling.top_p");
    let bad_t = SamplingParams { temperature: -1.0, ..sp.clone() };
    assert_eq!(bad(Request::new(vec![3], bad_t)), "sampling.temperature");
    let b = SyntheticBackend::new(VOCAB, 0, 64, 64);
    assert!(Engine::new(b, EngineConfig { num_speculative_tokens: Some(1), ..Default::default() }).is_err());
    let b = SyntheticBackend::new(VOCAB, 0, 64, 64);
    assert_eq!(Engine::new(b, EngineConfig::default()).expect("k=0").num_speculative_tokens(), 0);
}

#[test]
fn backend_failure_fails_the_step_only() {
    let mut e = engine(2, 256, 256);
    let sp = SamplingParams { max_new_tokens: 5, ignore_eos: true, ..Default::default() };
    let a = e.add_request(Request::new(vec![3, 4], sp.clone())).expect("ok");
    e.step();
    e.backend_mut().fail_next_forward = true;
    let evs = e.step();
    assert!(matches!(&evs[..], [(id, Event::Finished { reason: FinishReason::Error(_), .. })] if *id == a), "{evs:?}");
    e.check_invariants().expect("accounting");
    // The engine goes on serving.
    let o = run_all(&mut e, &[Arrival { at: 0, req: Request::new(vec![9], sp) }]);
    assert_eq!(o[0].tokens.len(), 5);
}

/// An explicit max_model_len must fit one request in the KV cache, or the engine refuses
/// to start naming it; the default is clipped to what the cache holds.
#[test]
fn max_model_len_is_checked_against_the_cache() {
    let cfg = |len| EngineConfig { num_speculative_tokens: Some(2), max_model_len: len, ..Default::default() };
    // 4 blocks of 64 positions: 256 positions, of which a request needs its length + 2k.
    let b = SyntheticBackend::new(VOCAB, 2, 4, 4096);
    let e = Engine::new(b, cfg(Some(1000))).expect_err("1000 tokens cannot fit 4 blocks").to_string();
    assert!(e.contains("max_model_len 1000") && e.contains("--kv-blocks"), "{e}");
    let b = SyntheticBackend::new(VOCAB, 2, 4, 4096);
    let fits = Engine::new(b, cfg(Some(200))).expect("200 tokens fit");
    assert_eq!(fits.max_model_len(), 200);
    let b = SyntheticBackend::new(VOCAB, 2, 4, 4096);
    let clipped = Engine::new(b, cfg(None)).expect("the default is clipped").max_model_len();
    assert!(clipped > 200 && clipped < 256, "{clipped}");
}

/// A zero or too-small limit is refused at start, naming the one that is wrong.
#[test]
fn bad_limits_name_themselves() {
    let start = |cfg: EngineConfig, blocks| Engine::new(SyntheticBackend::new(VOCAB, 2, blocks, 4096), cfg);
    let k3 = EngineConfig { num_speculative_tokens: Some(3), ..Default::default() };
    for (cfg, blocks, name) in [
        (EngineConfig { max_batch_tokens: 3, ..k3.clone() }, 64, "max_batch_tokens"),
        (EngineConfig { max_num_seqs: 0, ..k3.clone() }, 64, "max_num_seqs"),
        (EngineConfig { max_queued: 0, ..k3.clone() }, 64, "max_queued"),
        (k3.clone(), 0, "kv_blocks"),
        (EngineConfig { calibration_rows: 8, ..k3.clone() }, 64, "calibration"),
    ] {
        let e = start(cfg, blocks).expect_err("refused").to_string();
        assert!(e.contains(name), "{name}: {e}");
        for other in ["max_batch_tokens", "max_num_seqs", "max_queued", "kv_blocks", "calibration"]
            .iter()
            .filter(|o| **o != name)
        {
            assert!(!e.contains(other), "{name}: names {other} too: {e}");
        }
    }
}
