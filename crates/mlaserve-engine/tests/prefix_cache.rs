//! Prefix caching (`EngineConfig::enable_prefix_caching`): requests that share a prefix
//! map its cached blocks instead of prefilling them, and nothing else changes.
//!
//! - Synthetic backend, small pool: shared system prompts, repeated and multi-turn
//!   prompts, preemption and eviction — every output equals the cache-off output, greedy
//!   and seeded sampling, and the block accounting (reference counts, the LRU list, the
//!   index) holds after every step.
//! - 5,000+ random operations (submit, abort, step) with aborts: no block leaked or
//!   freed twice, every reference back to zero at the end, completed outputs equal to
//!   the cache-off ones, aborted ones a prefix of them.
//! - The bundled model on the CPU backend: outputs *and* the drafter's verified drafts
//!   per position are the same with hits as without, so the MTP layers' cached entries
//!   and the drafter's state at the end of a reused prefix are exact.

mod common;

use common::{bundled_eval_prompts, bundled_model, run_all, Arrival, Outcome, TestRng};
use mlaserve_cpu::CpuBackend;
use mlaserve_engine::testing::SyntheticBackend;
use mlaserve_engine::{Engine, EngineConfig, Event, FinishReason, Request, RequestId, SamplingParams, Usage};
use std::collections::HashMap;

const VOCAB: usize = 64;

fn synthetic(prefix: bool, blocks: usize) -> Engine<SyntheticBackend> {
    synthetic_k(prefix, blocks, 3)
}

fn synthetic_k(prefix: bool, blocks: usize, k: usize) -> Engine<SyntheticBackend> {
    let b = SyntheticBackend::new(VOCAB, 2, blocks, 4096);
    let cfg = EngineConfig {
        num_speculative_tokens: Some(k),
        max_batch_tokens: 256,
        max_num_seqs: 16,
        enable_prefix_caching: prefix,
        ..Default::default()
    };
    Engine::new(b, cfg).expect("engine")
}

fn random_tokens(rng: &mut TestRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.range(2, VOCAB as u64 - 1) as u32).collect()
}

/// A prompt: one of `systems` (or none), then a user part; sometimes an earlier prompt
/// again, or an earlier prompt continued (the next turn of a conversation).
fn prompt(rng: &mut TestRng, systems: &[Vec<u32>], earlier: &[Vec<u32>]) -> Vec<u32> {
    let r = rng.f64();
    if r < 0.15 && !earlier.is_empty() {
        return earlier[rng.range(0, earlier.len() as u64 - 1) as usize].clone();
    }
    let mut p = if r < 0.35 && !earlier.is_empty() {
        earlier[rng.range(0, earlier.len() as u64 - 1) as usize].clone()
    } else if r < 0.9 {
        systems[rng.range(0, systems.len() as u64 - 1) as usize].clone()
    } else {
        Vec::new()
    };
    let user = rng.range(1, 90) as usize;
    p.extend(random_tokens(rng, user));
    p.truncate(600);
    p
}

fn workload(seed: u64, n: usize, sampling: &SamplingParams) -> Vec<Arrival> {
    let mut rng = TestRng(seed);
    let systems: Vec<Vec<u32>> = (0..4).map(|i| random_tokens(&mut rng, 64 * (i + 1) + 10 * i)).collect();
    let mut earlier = Vec::new();
    (0..n)
        .map(|i| {
            let p = prompt(&mut rng, &systems, &earlier);
            earlier.push(p.clone());
            let sp = SamplingParams {
                max_new_tokens: rng.range(1, 48) as u32,
                ignore_eos: true,
                seed: Some(900 + i as u64),
                ..sampling.clone()
            };
            Arrival { at: rng.range(0, n as u64 / 2) as usize, req: Request::new(p, sp) }
        })
        .collect()
}

fn same_outputs(base: &[Outcome], got: &[Outcome], what: &str) {
    for (i, (x, y)) in base.iter().zip(got).enumerate() {
        assert_eq!(x.tokens, y.tokens, "{what}: request {i} differs with prefix caching");
        assert_eq!(x.reason, y.reason, "{what}: request {i}");
    }
}

/// The drafts verified per position, request by request: equal when every MTP cache
/// entry a hit reuses is the one the request would have computed. Compared for the
/// requests never preempted in either run (a recompute samples one token without a
/// verify window, so the windows that follow differ).
fn same_drafts(base: &[Outcome], got: &[Outcome], what: &str) {
    let mut compared = 0;
    for (i, (x, y)) in base.iter().zip(got).enumerate() {
        if x.usage.preemptions + y.usage.preemptions == 0 {
            assert_eq!(x.usage.verified_per_position, y.usage.verified_per_position, "{what}: request {i}'s drafts");
            compared += 1;
        }
    }
    assert!(compared * 4 >= base.len(), "{what}: only {compared} requests ran without preemption");
}

#[test]
fn shared_prefixes_keep_every_output_under_preemption_and_eviction() {
    for (what, sp) in [
        ("greedy", SamplingParams::default()),
        ("seeded sampling", SamplingParams { temperature: 1.0, top_k: 20, ..Default::default() }),
    ] {
        let a = workload(21, 160, &sp);
        let base = run_all(&mut synthetic(false, 16), &a);
        let mut e = synthetic(true, 16);
        let got = run_all(&mut e, &a);
        same_outputs(&base, &got, what);
        same_drafts(&base, &got, what);
        let st = e.stats();
        let cached: u64 = got.iter().map(|o| o.usage.cached_prompt_tokens).sum();
        eprintln!("{what}: {:?}, preemptions {}, cached prompt tokens {cached}", st.prefix, st.totals.preemptions);
        assert!(st.prefix.hit_tokens * 4 > st.prefix.queried_tokens, "a quarter of the tokens hit: {:?}", st.prefix);
        assert!(st.prefix.evictions > 0, "the pool is small enough to evict: {:?}", st.prefix);
        assert!(st.totals.preemptions > 0, "and to preempt");
        assert!(cached > 0 && cached <= st.prefix.hit_tokens);
        assert_eq!(st.totals.cached_prompt_tokens, cached);
        for o in &got {
            assert!(o.usage.cached_prompt_tokens <= o.usage.prompt_tokens);
            assert_eq!(o.usage.cached_prompt_tokens % 64, 0, "whole blocks");
        }
    }
}

#[test]
fn random_operations_with_aborts_leak_nothing() {
    let mut rng = TestRng(5);
    let systems: Vec<Vec<u32>> = (0..3).map(|i| random_tokens(&mut rng, 70 + 64 * i)).collect();
    let mut e = synthetic(true, 14);
    let mut earlier = Vec::new();
    let mut reqs: Vec<Request> = Vec::new();
    let mut ids: HashMap<RequestId, usize> = HashMap::new();
    let mut live: Vec<RequestId> = Vec::new();
    let mut tokens: Vec<Vec<u32>> = Vec::new();
    let mut aborted = vec![false; 0];
    let mut ops = 0;
    while ops < 6_000 {
        let r = rng.f64();
        if r < 0.25 {
            let p = prompt(&mut rng, &systems, &earlier);
            earlier.push(p.clone());
            let sp = SamplingParams { max_new_tokens: rng.range(1, 40) as u32, ignore_eos: true, ..Default::default() };
            let req = Request::new(p, sp);
            let id = e.add_request(req.clone()).expect("valid");
            ids.insert(id, reqs.len());
            reqs.push(req);
            tokens.push(Vec::new());
            aborted.push(false);
            live.push(id);
        } else if r < 0.32 && !live.is_empty() {
            let id = live.swap_remove(rng.range(0, live.len() as u64 - 1) as usize);
            e.abort(id).expect("live request");
            aborted[ids[&id]] = true;
        } else {
            for (id, ev) in e.step() {
                match ev {
                    Event::Tokens(t) => tokens[ids[&id]].extend(t),
                    Event::Finished { reason, .. } => {
                        assert_eq!(reason == FinishReason::Abort, aborted[ids[&id]]);
                        live.retain(|&x| x != id);
                    }
                    Event::Logprobs(_) => {}
                }
            }
        }
        e.check_invariants().expect("block accounting");
        ops += 1;
    }
    for id in live.drain(..) {
        e.abort(id).expect("live");
        aborted[ids[&id]] = true;
    }
    e.step();
    e.check_invariants().expect("every reference dropped");
    let st = e.stats();
    assert_eq!(st.load.kv_blocks_free, st.load.kv_blocks_total, "blocks leaked");
    assert!(st.prefix.hit_tokens > 0 && st.prefix.evictions > 0, "{:?}", st.prefix);
    assert!(st.totals.preemptions > 0, "the pool is small enough to preempt");
    // The same requests without the cache, all at once.
    let all: Vec<Arrival> = reqs.iter().map(|r| Arrival { at: 0, req: r.clone() }).collect();
    let base = run_all(&mut synthetic(false, 1024), &all);
    let n_aborted = aborted.iter().filter(|&&a| a).count();
    eprintln!("{} requests, {n_aborted} aborted, {:?}", reqs.len(), st.prefix);
    assert!(n_aborted > 20 && reqs.len() - n_aborted > 100);
    for (i, (b, t)) in base.iter().zip(&tokens).enumerate() {
        if aborted[i] {
            assert!(b.tokens.starts_with(t), "aborted request {i}: not a prefix of its output");
        } else {
            assert_eq!(&b.tokens, t, "request {i}");
        }
    }
}

/// Runs `waves` of requests one wave after the other (a wave is submitted once the
/// previous one finished) and returns each request's tokens and usage.
fn run_waves(prefix: bool, waves: &[Vec<Request>]) -> (Vec<(Vec<u32>, Usage)>, mlaserve_engine::PrefixStats) {
    let backend = CpuBackend::load(&bundled_model(), 64).expect("load bundled model");
    let cfg = EngineConfig { num_speculative_tokens: Some(3), enable_prefix_caching: prefix, ..Default::default() };
    let mut e = Engine::new(backend, cfg).expect("engine");
    let mut out = Vec::new();
    for wave in waves {
        let ids: Vec<RequestId> = wave.iter().map(|r| e.add_request(r.clone()).expect("admit")).collect();
        let mut toks: HashMap<RequestId, Vec<u32>> = HashMap::new();
        let mut usage: HashMap<RequestId, Usage> = HashMap::new();
        while e.has_work() {
            for (id, ev) in e.step() {
                match ev {
                    Event::Tokens(t) => toks.entry(id).or_default().extend(t),
                    Event::Finished { usage: u, .. } => {
                        usage.insert(id, u);
                    }
                    Event::Logprobs(_) => {}
                }
            }
            e.check_invariants().expect("block accounting");
        }
        out.extend(ids.iter().map(|id| (toks.remove(id).unwrap_or_default(), usage.remove(id).expect("finished"))));
    }
    (out, e.stats().prefix)
}

#[test]
fn bundled_model_output_and_drafts_are_the_same_with_hits() {
    let p = bundled_eval_prompts();
    // A 194-token "system prompt" (three full blocks), then a different user part.
    let system: Vec<u32> = p[0].iter().chain(&p[1]).copied().collect();
    for (what, sp) in [
        ("greedy", SamplingParams::default()),
        ("seeded sampling", SamplingParams { temperature: 0.8, top_p: 0.95, ..Default::default() }),
    ] {
        let req = |i: usize, user: &[u32]| {
            let prompt = system.iter().chain(user).copied().collect();
            let sp = SamplingParams { max_new_tokens: 24, ignore_eos: true, seed: Some(70 + i as u64), ..sp.clone() };
            Request::new(prompt, sp)
        };
        let first = vec![req(0, &p[2][..30])];
        // The second wave: other user parts, and the first prompt continued (a turn).
        let mut second: Vec<Request> = (3..9).map(|i| req(i, &p[i][..20 + 5 * i])).collect();
        second.push(req(9, &p[2][..60]));
        let waves = [first, second];
        let (off, off_stats) = run_waves(false, &waves);
        let (on, on_stats) = run_waves(true, &waves);
        assert_eq!(off_stats.hit_tokens, 0);
        for (i, ((a, ua), (b, ub))) in off.iter().zip(&on).enumerate() {
            assert_eq!(a, b, "{what}: request {i}'s tokens differ with a cache hit");
            assert_eq!(
                ua.verified_per_position, ub.verified_per_position,
                "{what}: request {i}'s drafts differ with a cache hit (MTP cache or drafter state)"
            );
        }
        let hits: Vec<u64> = on.iter().map(|(_, u)| u.cached_prompt_tokens).collect();
        eprintln!("{what}: cached prompt tokens per request {hits:?}, {on_stats:?}");
        assert_eq!(hits[0], 0, "the first request finds nothing");
        assert!(hits[1..].iter().all(|&h| h >= 3 * 64), "the second wave reuses the system prompt: {hits:?}");
    }
}
