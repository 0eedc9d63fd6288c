//! The engine on the GPU backend (`cargo bench --features cuda --bench gpu_engine`):
//! how many of 64 greedy requests on `tiny-v3` diverge between k = 3 and k = 0 with the
//! default (not batch-invariant) options, and decode tokens/s of the bundled model at
//! batch 1, k = 3 against k = 0. Arguments select by name (`divergence`, `bundled`);
//! none runs both. Run from the repository root (the bundled model is read from
//! `models/mla-tiny-code`, or `$MLASERVE_BUNDLED_MODEL`). Needs a GPU (device 0).

use std::path::Path;
use std::time::Instant;

use mlaserve_cuda::{CudaBackend, CudaOptions};
use mlaserve_engine::testing::{random_requests, run_to_completion};
use mlaserve_engine::{Engine, EngineConfig, Event, FinishReason, Request, SamplingParams};

fn main() {
    let only: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let on = |name: &str| only.is_empty() || only.iter().any(|o| o == name);
    if on("divergence") {
        greedy_k3_vs_k0_default_options();
    }
    if on("bundled") {
        bundled_model_batch1_decode_speed();
    }
}

/// 64 requests of random prompts (1..=200 tokens) and lengths (1..=48 new tokens).
fn workload() -> Vec<Request> {
    random_requests(987654321, 64, 200, 48, 512)
}

/// Every request's tokens, in submission order.
fn run(backend: CudaBackend, k: usize) -> Vec<Vec<u32>> {
    let cfg = EngineConfig { num_speculative_tokens: Some(k), max_batch_tokens: 256, ..Default::default() };
    let mut e = Engine::new(backend, cfg).expect("engine");
    let ids: Vec<_> = workload().into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    run_to_completion(&mut e, &ids).expect("run")
}

fn greedy_k3_vs_k0_default_options() {
    let t = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", t.path()).expect("preset");
    let opts = CudaOptions::new(512, 0);
    let k0 = run(CudaBackend::load_with(t.path(), opts).expect("load"), 0);
    let k3 = run(CudaBackend::load_with(t.path(), opts).expect("load"), 3);
    let differ = k3.iter().zip(&k0).filter(|(a, b)| a != b).count();
    println!("default options (cuBLAS + decode kernel): k3 vs k0 differ in {differ}/64 requests");
}

/// Issue 7: decode tokens/s of the bundled model at batch 1, k = 3 against k = 0, on the
/// GPU with the default (fast) options. Run from the repository root (the model is read
/// from `models/mla-tiny-code`, or `$MLASERVE_BUNDLED_MODEL`).
fn bundled_model_batch1_decode_speed() {
    let dir = std::env::var("MLASERVE_BUNDLED_MODEL").unwrap_or_else(|_| "models/mla-tiny-code".into());
    let dir = Path::new(&dir);
    if !dir.join("config.json").exists() {
        panic!("bundled model not found at {} (run from the repository root)", dir.display());
    }
    let prompts: Vec<Vec<u32>> = std::fs::read_to_string(dir.join("eval_prompts.jsonl"))
        .expect("eval_prompts.jsonl")
        .lines()
        .take(8)
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("json");
            v["prompt_ids"].as_array().expect("ids").iter().map(|x| x.as_u64().expect("id") as u32).collect()
        })
        .collect();
    let new_tokens = 256u32;
    let mut rates = Vec::new();
    let mut outputs = Vec::new();
    for k in [0usize, 3] {
        let backend = CudaBackend::load_with(dir, CudaOptions::new(64, 0)).expect("load");
        let cfg = EngineConfig { num_speculative_tokens: Some(k), ..Default::default() };
        let mut e = Engine::new(backend, cfg).expect("engine");
        let (mut decode_s, mut decoded, mut steps, mut outs) = (0f64, 0usize, 0u64, Vec::new());
        for (i, p) in prompts.iter().enumerate() {
            let params = SamplingParams { max_new_tokens: new_tokens, ignore_eos: true, ..Default::default() };
            e.add_request(Request::new(p.clone(), params)).expect("admit");
            let mut toks = Vec::new();
            let mut first_at = None;
            while e.has_work() {
                for (_, ev) in e.step() {
                    match ev {
                        Event::Tokens(t) => {
                            if first_at.is_none() {
                                first_at = Some(Instant::now());
                                toks.extend(t);
                            } else {
                                toks.extend(t);
                            }
                        }
                        Event::Finished { reason: FinishReason::Error(m), .. } => panic!("request failed: {m}"),
                        Event::Finished { usage, .. } => steps += usage.decode_steps,
                        Event::Logprobs(_) => {}
                    }
                }
            }
            // The first prompt warms up (cuBLAS handles, kernels): not timed.
            if i > 0 {
                decode_s += first_at.expect("tokens").elapsed().as_secs_f64();
                decoded += toks.len() - 1;
            }
            outs.push(toks);
        }
        let rate = decoded as f64 / decode_s;
        println!(
            "bundled model, batch 1, k = {k}: {decoded} decode tokens in {decode_s:.3} s = {rate:.1} tokens/s \
             ({steps} decode steps over all prompts)"
        );
        rates.push(rate);
        outputs.push(outs);
    }
    let same = outputs[0].iter().zip(&outputs[1]).filter(|(a, b)| a == b).count();
    println!(
        "speed-up k = 3 over k = 0 at batch 1: {:.2}x; identical outputs: {same}/{} prompts",
        rates[1] / rates[0],
        prompts.len()
    );
}
