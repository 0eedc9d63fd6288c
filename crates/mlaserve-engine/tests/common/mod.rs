//! Shared drivers for the engine's integration tests: run a schedule of arrivals
//! through an [`Engine`] step by step, checking the block accounting every step and
//! collecting each request's tokens and final event.
#![allow(dead_code)]

pub mod stats;

use mlaserve_core::Backend;
use mlaserve_engine::{Engine, Event, FinishReason, Request, RequestId, SamplingParams, Usage};
use std::collections::HashMap;

/// splitmix64 stream for reproducible test inputs.
#[derive(Debug, Clone)]
pub struct TestRng(pub u64);

impl TestRng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mlaserve_engine::rng::mix64(self.0)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What a request produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub tokens: Vec<u32>,
    pub reason: FinishReason,
    pub usage: Usage,
    /// One per token when the request asked for log-probabilities, else empty.
    pub logprobs: Vec<mlaserve_engine::RowLogprobs>,
}

/// A request arriving before step `at`.
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at: usize,
    pub req: Request,
}

/// Random arrivals: prompts of `prompt_len` tokens (random ids in `2..vocab`), outputs of
/// `new_tokens`, arrival steps in `0..=max_step`.
pub fn random_arrivals(
    rng: &mut TestRng,
    n: usize,
    vocab: u32,
    prompt_len: (u64, u64),
    new_tokens: (u64, u64),
    max_step: u64,
    sampling: &SamplingParams,
) -> Vec<Arrival> {
    (0..n)
        .map(|_| {
            let len = rng.range(prompt_len.0, prompt_len.1) as usize;
            let prompt = (0..len).map(|_| rng.range(2, vocab as u64 - 1) as u32).collect();
            let sampling =
                SamplingParams { max_new_tokens: rng.range(new_tokens.0, new_tokens.1) as u32, ..sampling.clone() };
            Arrival { at: rng.range(0, max_step) as usize, req: Request::new(prompt, sampling) }
        })
        .collect()
}

/// Steps `engine` until every arrival finished; returns outcomes in arrival order.
pub fn run_all<B: Backend>(engine: &mut Engine<B>, arrivals: &[Arrival]) -> Vec<Outcome> {
    let mut ids: Vec<Option<RequestId>> = vec![None; arrivals.len()];
    let mut index: HashMap<RequestId, usize> = HashMap::new();
    let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); arrivals.len()];
    let mut done: Vec<Option<(FinishReason, Usage)>> = vec![None; arrivals.len()];
    let mut logprobs: Vec<Vec<mlaserve_engine::RowLogprobs>> = vec![Vec::new(); arrivals.len()];
    let mut step = 0usize;
    let mut left = arrivals.len();
    while left > 0 {
        for (i, a) in arrivals.iter().enumerate() {
            if a.at == step {
                let id = engine.add_request(a.req.clone()).expect("valid request");
                ids[i] = Some(id);
                index.insert(id, i);
            }
        }
        for (id, ev) in engine.step() {
            let i = index[&id];
            match ev {
                Event::Tokens(t) => {
                    assert!(done[i].is_none(), "tokens after finish");
                    tokens[i].extend(t)
                }
                Event::Finished { reason, usage } => {
                    assert!(done[i].replace((reason, usage)).is_none(), "finished twice");
                    left -= 1;
                }
                Event::Logprobs(l) => {
                    logprobs[i].extend(l);
                    assert_eq!(logprobs[i].len(), tokens[i].len(), "one logprobs entry per token, right after them");
                }
            }
        }
        engine.check_invariants().expect("block accounting");
        step += 1;
        assert!(step < 1_000_000, "engine made no progress");
    }
    let load = engine.load();
    assert_eq!(load.kv_blocks_free, load.kv_blocks_total, "blocks leaked");
    tokens
        .into_iter()
        .zip(done)
        .zip(logprobs)
        .map(|((tokens, d), logprobs)| {
            let (reason, usage) = d.expect("finished");
            assert!(logprobs.is_empty() || logprobs.len() == tokens.len(), "a logprob per token");
            Outcome { tokens, reason, usage, logprobs }
        })
        .collect()
}

/// The bundled trained model (`models/mla-tiny-code`).
pub fn bundled_model() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code")
}

/// The 50 held-out prompts the bundled model's training script evaluated.
pub fn bundled_eval_prompts() -> Vec<Vec<u32>> {
    let text = std::fs::read_to_string(bundled_model().join("eval_prompts.jsonl")).expect("eval_prompts.jsonl");
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json line");
            v["prompt_ids"].as_array().expect("prompt_ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
        })
        .collect()
}
