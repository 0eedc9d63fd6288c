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
