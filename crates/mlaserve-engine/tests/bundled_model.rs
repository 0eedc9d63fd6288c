//! The bundled trained model (`models/mla-tiny-code`) on the CPU backend: drafts are
//! accepted most of the time here, so this is where the multi-token accepted path and
//! the MTP chain meet real weights.
//!
//! - Greedy output with k = 3 equals k = 0 token for token, and so does adaptive k (up
//!   to 3, chosen from the CPU's measured step times).
//! - Greedy acceptance per draft position on the 50 held-out prompts the training script
//!   evaluated (64 new tokens each) is within ±3 points of its teacher-forced figure
//!   (`eval.json`, conditional form: P(draft d right | drafts before it right)).

mod common;

use common::{bundled_eval_prompts, bundled_model};
use mlaserve_core::{KvCacheDtype, SingleRank};
use mlaserve_cpu::{CpuBackend, CpuOptions};
use mlaserve_engine::{Engine, EngineConfig, Event, Request, SamplingParams, Speculation, Usage};
use std::collections::HashMap;

/// Runs `prompts` greedily (EOS ignored) and returns tokens per prompt and the usage total.
fn run(prompts: &[Vec<u32>], k: usize, new_tokens: u32) -> (Vec<Vec<u32>>, Usage) {
    run_with(prompts, k, Speculation::Fixed, new_tokens, KvCacheDtype::Auto)
}

fn run_with(
    prompts: &[Vec<u32>],
    k: usize,
    speculation: Speculation,
    new_tokens: u32,
    kv_cache_dtype: KvCacheDtype,
) -> (Vec<Vec<u32>>, Usage) {
    let opts = CpuOptions { num_blocks: 256, kv_cache_dtype, ..Default::default() };
    let backend = CpuBackend::load_with(&bundled_model(), opts, Box::new(SingleRank)).expect("load bundled model");
    let cfg = EngineConfig { num_speculative_tokens: Some(k), speculation, max_num_seqs: 64, ..Default::default() };
    let mut e = Engine::new(backend, cfg).expect("engine");
    let params = SamplingParams { max_new_tokens: new_tokens, ignore_eos: true, ..Default::default() };
    let ids: Vec<_> =
        prompts.iter().map(|p| e.add_request(Request::new(p.clone(), params.clone())).expect("admit")).collect();
    let mut out: HashMap<_, Vec<u32>> = HashMap::new();
    let mut total = Usage::default();
    while e.has_work() {
        for (id, ev) in e.step() {
            match ev {
                Event::Tokens(t) => out.entry(id).or_default().extend(t),
                Event::Finished { usage, .. } => total.accumulate(&usage),
                Event::Logprobs(_) => {}
            }
        }
    }
    (ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect(), total)
}

#[test]
fn bundled_model_acceptance_matches_teacher_forced_and_is_lossless() {
    let prompts = bundled_eval_prompts();
    assert_eq!(prompts.len(), 50);
    let (spec, usage) = run(&prompts, 3, 64);
    let eval: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(bundled_model().join("eval.json")).expect("eval.json"))
            .expect("json");
    let want: Vec<f64> = eval["acceptance"]["conditional_acceptance"]
        .as_array()
        .expect("conditional_acceptance")
        .iter()
        .map(|x| x.as_f64().expect("rate"))
        .collect();
    let mut reached = usage.decode_steps;
    for (d, (&acc, &tf)) in usage.verified_per_position.iter().zip(&want).enumerate() {
        let got = acc as f64 / reached as f64;
        eprintln!("draft position {}: engine {:.1}% vs teacher-forced {:.1}%", d + 1, 100.0 * got, 100.0 * tf);
        assert!((got - tf).abs() <= 0.03, "position {}: {got:.3} vs {tf:.3}", d + 1);
        reached = acc;
    }
    let mal = usage.mean_acceptance_length();
    eprintln!("mean acceptance length (k = 3): {mal:.3}");
    assert!(mal >= 2.0, "mean acceptance length {mal}");
    // Lossless: the same greedy tokens without speculation (first 20 prompts).
    let (plain, _) = run(&prompts[..20], 0, 64);
    assert_eq!(plain, spec[..20].to_vec(), "k = 3 output differs from k = 0");
    let (adaptive, _) = run_with(&prompts[..20], 3, Speculation::Adaptive, 64, KvCacheDtype::Auto);
    assert_eq!(plain, adaptive, "adaptive k output differs from k = 0");
}

/// The fp8 latent cache (`--kv-cache-dtype fp8`) on the same 50 prompts: acceptance per
/// draft position within 2 points of the f32 cache's, and k = 3 still equal to k = 0.
#[test]
fn bundled_model_with_an_fp8_cache_keeps_its_acceptance() {
    let prompts = bundled_eval_prompts();
    let per_position = |u: &Usage| -> Vec<f64> {
        let mut reached = u.decode_steps;
        u.verified_per_position
            .iter()
            .map(|&acc| {
                let r = acc as f64 / reached as f64;
                reached = acc;
                r
            })
            .collect()
    };
    let (_, base) = run(&prompts, 3, 64);
    let (spec, fp8) = run_with(&prompts, 3, Speculation::Fixed, 64, KvCacheDtype::Fp8);
    let (want, got) = (per_position(&base), per_position(&fp8));
    for (d, (w, g)) in want.iter().zip(&got).enumerate() {
        eprintln!("draft position {}: fp8 cache {:.1}% vs f32 cache {:.1}%", d + 1, 100.0 * g, 100.0 * w);
        assert!((g - w).abs() <= 0.02, "position {}: {g:.3} vs {w:.3}", d + 1);
    }
    eprintln!(
        "mean acceptance length (k = 3): fp8 cache {:.3}, f32 cache {:.3}",
        fp8.mean_acceptance_length(),
        base.mean_acceptance_length()
    );
    let (plain, _) = run_with(&prompts[..20], 0, Speculation::Fixed, 64, KvCacheDtype::Fp8);
    assert_eq!(plain, spec[..20].to_vec(), "fp8 cache: k = 3 output differs from k = 0");
}
