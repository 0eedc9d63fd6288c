//! The engine with k forced to change from step to step in every pattern (the adaptive
//! policy's choices, without waiting for timing noise to produce them).

use super::Engine;
use crate::api::{EngineConfig, Event, Request, SamplingParams, Speculation};
use crate::rng::mix64;
use crate::testing::SyntheticBackend;
use std::collections::HashMap;

const VOCAB: u64 = 64;

/// Runs 48 requests (prompts of 1..300 tokens, 1..64 new tokens, arriving over 40
/// steps) and returns each one's tokens; checks the block accounting at every step.
fn run(mut e: Engine<SyntheticBackend>) -> (Vec<Vec<u32>>, u64) {
    let mut x = 11u64;
    let mut next = |lo: u64, hi: u64| {
        x = mix64(x.wrapping_add(0x9e37_79b9_7f4a_7c15));
        lo + x % (hi - lo + 1)
    };
    let reqs: Vec<(usize, Request)> = (0..48)
        .map(|_| {
            let len = next(1, 300) as usize;
            let prompt = (0..len).map(|_| next(2, VOCAB - 1) as u32).collect();
            let sp = SamplingParams { max_new_tokens: next(1, 64) as u32, ..Default::default() };
            (next(0, 40) as usize, Request::new(prompt, sp))
        })
        .collect();
    let mut ids = HashMap::new();
    let mut out = vec![Vec::new(); reqs.len()];
    let (mut step, mut left) = (0, reqs.len());
    while left > 0 {
        for (i, (at, r)) in reqs.iter().enumerate() {
            if *at == step {
                ids.insert(e.add_request(r.clone()).expect("valid"), i);
            }
        }
        for (id, ev) in e.step() {
            match ev {
                Event::Tokens(t) => out[ids[&id]].extend(t),
                Event::Finished { .. } => left -= 1,
                Event::Logprobs(_) => {}
            }
        }
        e.check_invariants().expect("block accounting");
        step += 1;
        assert!(step < 100_000, "no progress");
    }
    (out, e.stats().totals.preemptions)
}

fn engine(n_mtp: usize, k: usize, speculation: Speculation) -> Engine<SyntheticBackend> {
    let b = SyntheticBackend::new(VOCAB as usize, n_mtp, 14, 4096);
    let cfg = EngineConfig {
        num_speculative_tokens: Some(k),
        speculation,
        max_batch_tokens: 128,
        max_num_seqs: 32,
        ..Default::default()
    };
    Engine::new(b, cfg).expect("engine")
}

/// Every transition between k values (0 included: no drafting, the MTP caches miss
/// those positions), with 1 to 3 MTP layers, under preemption and a budget that leaves
/// decodes out of some steps: the output is the k = 0 output.
#[test]
fn k_changing_every_step_keeps_the_output() {
    let (base, _) = run(engine(1, 0, Speculation::Fixed));
    let patterns: [&[usize]; 4] =
        [&[0, 1, 2, 3, 4], &[4, 3, 2, 1, 0], &[3, 0, 4, 1, 4, 2, 0, 0, 3], &[2, 4, 2, 0, 1, 3, 1]];
    for n_mtp in 1..=3 {
        for p in patterns {
            let mut e = engine(n_mtp, 4, Speculation::Adaptive);
            e.policy.forced = p.to_vec();
            let (out, preemptions) = run(e);
            assert!(preemptions > 0, "the pool is small enough to preempt");
            for (i, (x, y)) in base.iter().zip(&out).enumerate() {
                assert_eq!(x, y, "{n_mtp} MTP layers, k pattern {p:?}: request {i}");
            }
        }
    }
}

/// An adaptive engine (k ≤ 3, the k decisions forced to `pattern`) on a synthetic
/// backend with 2 MTP layers and `blocks` cache blocks.
fn prefix_engine(prefix: bool, blocks: usize, budget: usize, pattern: &[usize]) -> Engine<SyntheticBackend> {
    let b = SyntheticBackend::new(VOCAB as usize, 2, blocks, 4096);
    let cfg = EngineConfig {
        num_speculative_tokens: Some(3),
        speculation: Speculation::Adaptive,
        max_batch_tokens: budget,
        enable_prefix_caching: prefix,
        ..Default::default()
    };
    let mut e = Engine::new(b, cfg).expect("engine");
    e.policy.forced = pattern.to_vec();
    e
}

/// `n` token ids drawn from `seed`.
fn tokens(seed: u64, n: u64) -> impl Iterator<Item = u32> {
    (0..n).map(move |i| 2 + (mix64(i ^ seed.wrapping_mul(0x9e37_79b9)) % (VOCAB - 2)) as u32)
}

/// Runs request A under the k `pattern`, then request B — A's whole history and 20
/// more tokens — at k = 3, and returns B's drafts verified per position and its
/// cached prompt tokens.
fn extend_after_holes(pattern: &[usize], prefix: bool) -> (Vec<u64>, u64) {
    let mut e = prefix_engine(prefix, 256, EngineConfig::default().max_batch_tokens, pattern);
    e.blocks.complete_only = true;
    let sp = SamplingParams { max_new_tokens: 200, ignore_eos: true, ..Default::default() };
    let mut history: Vec<u32> = tokens(0, 150).collect();
    let mut usage = None;
    for round in 0..2 {
        e.add_request(Request::new(history.clone(), sp.clone())).expect("valid");
        while e.has_work() {
            for (_, ev) in e.step() {
                match ev {
                    Event::Tokens(t) => history.extend(t),
                    Event::Finished { usage: u, .. } => usage = Some(u),
                    Event::Logprobs(_) => {}
                }
            }
            e.check_invariants().expect("block accounting");
        }
        if round == 0 {
            e.policy.forced = vec![3];
            history.extend(tokens(1, 20));
        }
    }
    let u = usage.expect("finished");
    (u.verified_per_position, u.cached_prompt_tokens)
}

/// Steps that draft nothing, or with fewer MTP layers than the engine uses, leave MTP
/// entries missing; no block reaching one is cached as complete, so a request that
/// extends the whole history and reuses only complete blocks drafts exactly as without
/// the cache (and still reuses the blocks before the first hole).
#[test]
fn blocks_with_mtp_holes_are_not_shared() {
    for pattern in [&[3, 3, 3, 3, 3, 3, 0][..], &[3, 3, 3, 1]] {
        let (off, _) = extend_after_holes(pattern, false);
        let (on, cached) = extend_after_holes(pattern, true);
        assert_eq!(off, on, "k pattern {pattern:?}: drafts after a hit");
        assert!(cached >= 128, "k pattern {pattern:?}: the blocks before the first hole are reused ({cached})");
    }
}

/// While the engine drafts with every MTP layer it uses, a prompt cached target-only is
/// prefilled again instead of mapped, and its blocks are cached complete from then on:
/// the request after that maps them and drafts exactly as on a cold cache.
#[test]
fn target_only_blocks_are_prefilled_again_once_every_mtp_layer_drafts() {
    let run = |prefix: bool| {
        let mut e = prefix_engine(prefix, 256, EngineConfig::default().max_batch_tokens, &[0]);
        let prompt: Vec<u32> = tokens(0, 200).collect();
        let sp = SamplingParams { max_new_tokens: 40, ignore_eos: true, ..Default::default() };
        let mut out = Vec::new();
        for i in 0..4 {
            if i == 1 {
                e.policy.forced = vec![3];
            }
            e.add_request(Request::new(prompt.clone(), sp.clone())).expect("valid");
            while e.has_work() {
                for (_, ev) in e.step() {
                    if let Event::Finished { usage, .. } = ev {
                        out.push((usage.verified_per_position, usage.cached_prompt_tokens));
                    }
                }
                e.check_invariants().expect("block accounting");
            }
        }
        out
    };
    let (off, on) = (run(false), run(true));
    // Request 0 drafts nothing: the prompt's 3 usable blocks are cached target-only.
    // Request 1 comes after steps at k = 0, so it maps them (and has their holes).
    assert_eq!(on[1].1, 192, "request 1 maps the target-only blocks");
    // Request 2 comes after steps at k = 3: it prefills the prompt itself.
    assert_eq!(on[2].1, 0, "request 2 does not map target-only blocks");
    assert_eq!(on[2].0, off[2].0, "request 2 drafts as on a cold cache");
    // Request 3 maps request 2's complete blocks and drafts as on a cold cache.
    assert_eq!(on[3].1, 192, "request 3 maps complete blocks");
    assert_eq!(on[3].0, off[3].0, "request 3 drafts as on a cold cache");
}

/// Runs 6 requests together under a token budget that leaves decodes out of some
/// steps (their last drafted MTP entries cannot be redone), then, one at a time, each
/// one's whole history and 20 more tokens at k = 3; returns the second round's drafts
/// and the prompt tokens they found cached.
fn extend_after_skips(prefix: bool) -> (Vec<Vec<u64>>, u64) {
    // Windows of 4 and 3 tokens: two of 4 do not fit the budget, so the second request
    // waits a step with its drafts of k = 3.
    let mut e = prefix_engine(prefix, 512, 7, &[3, 2]);
    e.blocks.complete_only = true;
    let sp = SamplingParams { max_new_tokens: 120, ignore_eos: true, ..Default::default() };
    let mut ids = HashMap::new();
    let mut hist: Vec<Vec<u32>> = (0..6u64).map(|r| tokens(10 + r, 100 + 20 * r).collect()).collect();
    for (r, h) in hist.iter().enumerate() {
        ids.insert(e.add_request(Request::new(h.clone(), sp.clone())).expect("valid"), r);
    }
    while e.has_work() {
        for (id, ev) in e.step() {
            if let Event::Tokens(t) = ev {
                hist[ids[&id]].extend(t);
            }
        }
        e.check_invariants().expect("block accounting");
    }
    e.lim.max_batch_tokens = 2048;
    e.policy.forced = vec![3];
    let (mut drafts, mut cached) = (Vec::new(), 0);
    for (r, h) in hist.iter().enumerate() {
        let mut p = h.clone();
        p.extend(tokens(100 + r as u64, 20));
        e.add_request(Request::new(p, sp.clone())).expect("valid");
        while e.has_work() {
            for (_, ev) in e.step() {
                if let Event::Finished { usage, .. } = ev {
                    cached += usage.cached_prompt_tokens;
                    drafts.push(usage.verified_per_position);
                }
            }
        }
    }
    (drafts, cached)
}

/// Decodes left out of a step keep MTP entries drafted from guesses that the next
/// step cannot redo: no block reaching them is cached as complete.
#[test]
fn blocks_with_entries_left_unredone_are_not_shared() {
    let ((off, _), (on, cached)) = (extend_after_skips(false), extend_after_skips(true));
    assert_eq!(off, on);
    assert!(cached >= 6 * 64, "blocks before the holes are reused ({cached})");
}

/// While the engine drafts with fewer MTP layers than it uses, blocks past an MTP hole
/// are still reused for the target layers (the request then has the holes as its own):
/// outputs equal, the reuse reaches past the first hole.
#[test]
fn target_only_blocks_are_reused_with_the_same_output() {
    for pattern in [&[0][..], &[1, 1, 1, 0]] {
        let run = |prefix: bool| {
            let mut e = prefix_engine(prefix, 256, EngineConfig::default().max_batch_tokens, pattern);
            let mut history: Vec<u32> = tokens(0, 150).collect();
            let sp = SamplingParams { max_new_tokens: 100, ignore_eos: true, ..Default::default() };
            let mut cached = Vec::new();
            for turn in 0..3u64 {
                history.extend(tokens(200 + turn, 10));
                e.add_request(Request::new(history.clone(), sp.clone())).expect("valid");
                while e.has_work() {
                    for (_, ev) in e.step() {
                        match ev {
                            Event::Tokens(t) => history.extend(t),
                            Event::Finished { usage, .. } => cached.push(usage.cached_prompt_tokens),
                            Event::Logprobs(_) => {}
                        }
                    }
                    e.check_invariants().expect("block accounting");
                }
            }
            (history, cached)
        };
        let ((off, _), (on, cached)) = (run(false), run(true));
        assert_eq!(off, on, "k pattern {pattern:?}");
        // Turn 2 reuses turn 1's prompt and most of its reply, holes or not.
        assert!(cached[1] >= 192 && cached[2] >= 320, "k pattern {pattern:?}: {cached:?}");
    }
}
