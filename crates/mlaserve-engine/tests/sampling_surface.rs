//! The sampling surface beyond temperature, top-k and top-p, on the CPU backend with
//! tiny-v3: logit bias, the repetition, frequency and presence penalties, min-p and
//! log-probabilities.
//!
//! - Each generated token is replayed step by step against the definitions written out
//!   here (not the library's): the raw logits of the sequence so far from a fresh
//!   forward, the bias and penalties of the output so far applied by hand, then the
//!   argmax (greedy) or the inverse-CDF draw with the request's uniform for that position
//!   over softmax(l / T) cut by min-p (sampled) — exactly, with speculation (k = 3) and
//!   without (k = 0).
//! - Log-probabilities are the raw row's log-softmax, equal with k = 3 and k = 0.
//! - Statistically: 20,000 draws from one edited row follow the definitions (chi-square).

mod common;

use common::stats::chi_square;
use common::{run_all, Arrival};
use mlaserve_core::{Backend, Batch, LogitEdit, RowEdits, SampleRow, SeqChunk};
use mlaserve_cpu::CpuBackend;
use mlaserve_engine::rng::{uniform, Purpose};
use mlaserve_engine::{Engine, EngineConfig, Request, SamplingParams};
use std::path::Path;

fn tiny(dir: &Path) -> CpuBackend {
    mlaserve_model::presets::generate("tiny-v3", dir).expect("generate tiny-v3");
    CpuBackend::load(dir, 64).expect("load tiny-v3")
}

/// The raw logits of the token after `seq`, from a fresh forward over all of it.
fn next_logits(b: &mut CpuBackend, seq: &[u32]) -> Vec<f32> {
    let batch = Batch {
        seqs: vec![SeqChunk { tokens: seq.to_vec(), start_pos: 0, block_table: (0..64).collect(), prefill: true }],
        logit_rows: vec![seq.len() as u32 - 1],
        ..Default::default()
    };
    b.forward(&batch).expect("forward").logits
}

/// The definitions: bias, then repetition over prompt and output, then frequency and
/// presence over the output.
fn edit_by_hand(logits: &mut [f32], p: &SamplingParams, prompt: &[u32], out: &[u32]) {
    for &(t, b) in &p.logit_bias {
        logits[t as usize] += b;
    }
    for (t, l) in logits.iter_mut().enumerate() {
        let t = t as u32;
        let count = out.iter().filter(|&&o| o == t).count() as u32;
        if p.repetition_penalty != 1.0 && (count > 0 || prompt.contains(&t)) {
            *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
        }
        if count > 0 {
            *l -= p.frequency_penalty * count as f32 + p.presence_penalty;
        }
    }
}

/// The token after `logits` (edited): argmax, or the draw with `u` over softmax(l / T)
/// restricted to probabilities at least min_p times the largest, in id order.
fn choose_by_hand(logits: &[f32], p: &SamplingParams, u: f64) -> u32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if p.temperature == 0.0 {
        return logits.iter().position(|&l| l == max).unwrap() as u32;
    }
    let w: Vec<f64> = logits
        .iter()
        .map(|&l| ((l - max) as f64 / p.temperature as f64).exp())
        .map(|w| if w >= p.min_p as f64 { w } else { 0.0 })
        .collect();
    let limit = u * w.iter().sum::<f64>();
    let mut c = 0.0;
    for (t, &x) in w.iter().enumerate() {
        c += x;
        if limit < c {
            return t as u32;
        }
    }
    unreachable!("u < 1")
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let z: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    logits.iter().map(|&l| (l - max) as f64 - z.ln()).collect()
}

fn requests(vocab: u32) -> Vec<Request> {
    let prompt = |s: u32| (0..20).map(|i| (i * 37 + s * 11) % (vocab - 2) + 2).collect::<Vec<u32>>();
    let base = SamplingParams { max_new_tokens: 24, ignore_eos: true, logprobs: Some(3), ..Default::default() };
    vec![
        // Negative penalties reward repetition: tiny-v3 alone rarely repeats in 24 tokens.
        Request::new(prompt(1), SamplingParams { presence_penalty: -2.0, frequency_penalty: -0.7, ..base.clone() }),
        Request::new(prompt(2), SamplingParams { repetition_penalty: 1.8, ..base.clone() }),
        Request::new(prompt(3), SamplingParams { logit_bias: vec![(5, 100.0), (9, -100.0)], ..base.clone() }),
        Request::new(
            prompt(4),
            SamplingParams {
                temperature: 0.9,
                min_p: 0.2,
                presence_penalty: 0.8,
                repetition_penalty: 1.3,
                logit_bias: vec![(7, 2.5)],
                seed: Some(11),
                ..base.clone()
            },
        ),
        Request::new(prompt(5), SamplingParams { temperature: 1.2, min_p: 0.05, seed: Some(12), ..base.clone() }),
        Request::new(prompt(6), base.clone()),
    ]
}

#[test]
fn every_token_follows_the_definitions_with_and_without_speculation() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut reference = tiny(dir.path());
    let vocab = reference.config().vocab_size as u32;
    let reqs = requests(vocab);
    let mut runs = Vec::new();
    for k in [0, 3] {
        let cfg = EngineConfig { num_speculative_tokens: Some(k), max_batch_tokens: 64, ..Default::default() };
        let mut e = Engine::new(tiny(dir.path()), cfg).expect("engine");
        let arrivals: Vec<Arrival> = reqs.iter().enumerate().map(|(i, r)| Arrival { at: i, req: r.clone() }).collect();
        runs.push(run_all(&mut e, &arrivals));
    }
    let (k0, k3) = (&runs[0], &runs[1]);
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(k0[i].tokens, k3[i].tokens, "request {i}: k = 3 and k = 0 differ");
        assert_eq!(k0[i].logprobs, k3[i].logprobs, "request {i}: logprobs differ between k = 3 and k = 0");
        assert_eq!(k0[i].tokens.len(), 24);
        let p = &r.sampling;
        let mut seq = r.prompt.clone();
        for (j, &tok) in k3[i].tokens.iter().enumerate() {
            let raw = next_logits(&mut reference, &seq);
            let mut edited = raw.clone();
            edit_by_hand(&mut edited, p, &r.prompt, &seq[r.prompt.len()..]);
            let u = p.seed.map_or(0.0, |s| uniform(s, seq.len() as u64, Purpose::Sample));
            assert_eq!(tok, choose_by_hand(&edited, p, u), "request {i}, token {j}: not the definitions' choice");
            let lp = log_softmax(&raw);
            let got = &k3[i].logprobs[j];
            assert!((got.logprob as f64 - lp[tok as usize]).abs() < 1e-5, "request {i}, token {j}: logprob");
            let mut order: Vec<usize> = (0..raw.len()).collect();
            order.sort_by(|&a, &b| raw[b].total_cmp(&raw[a]).then(a.cmp(&b)));
            let want: Vec<u32> = order[..3].iter().map(|&t| t as u32).collect();
            assert_eq!(got.top.iter().map(|t| t.0).collect::<Vec<_>>(), want, "request {i}, token {j}: top 3");
            for &(t, l) in &got.top {
                assert!((l as f64 - lp[t as usize]).abs() < 1e-5);
            }
            seq.push(tok);
        }
        if !p.logit_bias.is_empty() && p.temperature == 0.0 {
            assert!(!k3[i].tokens.contains(&9), "request {i}: a token biased by -100 was chosen");
        }
    }
    // The penalties changed something: without them the greedy requests' outputs differ.
    let plain = SamplingParams { max_new_tokens: 24, ignore_eos: true, ..Default::default() };
    let mut e = Engine::new(tiny(dir.path()), EngineConfig { num_speculative_tokens: Some(3), ..Default::default() })
        .expect("engine");
    let arrivals: Vec<Arrival> =
        reqs[..3].iter().map(|r| Arrival { at: 0, req: Request::new(r.prompt.clone(), plain.clone()) }).collect();
    let unpenalised = run_all(&mut e, &arrivals);
    for i in 0..3 {
        assert_ne!(unpenalised[i].tokens, k3[i].tokens, "request {i}: its edits changed nothing");
    }
}

/// 20,000 draws from one row of tiny-v3, edited (bias and penalties) and cut by min-p,
/// follow the definitions' distribution (chi-square, p > 0.001).
#[test]
fn draws_from_an_edited_row_follow_the_definitions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut b = tiny(dir.path());
    let vocab = b.config().vocab_size;
    let prompt: Vec<u32> = (0..16).map(|i| (i * 29 + 3) % vocab as u32).collect();
    let out = [prompt[3], prompt[3], 17];
    let p = SamplingParams {
        temperature: 1.3,
        min_p: 0.02,
        presence_penalty: 0.6,
        frequency_penalty: 0.4,
        repetition_penalty: 1.5,
        logit_bias: vec![(17, 1.0), (40, 3.0)],
        ..Default::default()
    };
    let seq: Vec<u32> = prompt.iter().chain(&out).copied().collect();
    let mut edited = next_logits(&mut b, &seq);
    edit_by_hand(&mut edited, &p, &prompt, &out);
    let max = edited.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w: Vec<f64> = edited
        .iter()
        .map(|&l| ((l - max) as f64 / p.temperature as f64).exp())
        .map(|w| if w >= p.min_p as f64 { w } else { 0.0 })
        .collect();
    let z: f64 = w.iter().sum();
    let expected: Vec<f64> = w.iter().map(|x| x / z).collect();
    assert!(expected.iter().filter(|&&e| e > 0.0).count() > 5, "a row worth sampling");
    // The library's edits for this output, as the engine would build them.
    let edits: Vec<LogitEdit> = {
        let mut m = std::collections::BTreeMap::<u32, LogitEdit>::new();
        let e = |token| LogitEdit { token, bias: 0.0, repetition: 1.0, sub: 0.0 };
        for &(t, bias) in &p.logit_bias {
            m.entry(t).or_insert_with(|| e(t)).bias = bias;
        }
        for &t in prompt.iter().chain(&out) {
            m.entry(t).or_insert_with(|| e(t)).repetition = p.repetition_penalty;
        }
        for &t in &out {
            let n = out.iter().filter(|&&o| o == t).count() as u32;
            m.entry(t).or_insert_with(|| e(t)).sub =
                mlaserve_core::penalty_sub(p.frequency_penalty, p.presence_penalty, n);
        }
        m.into_values().collect()
    };
    let n = 20_000;
    let last = seq.len() as u32 - 1;
    let batch = Batch {
        seqs: vec![SeqChunk { tokens: seq.clone(), start_pos: 0, block_table: (0..64).collect(), prefill: true }],
        sample_rows: (0..n)
            .map(|i| SampleRow {
                row: last,
                temperature: p.temperature,
                top_k: 0,
                top_p: 1.0,
                min_p: p.min_p,
                u: uniform(5, i, Purpose::Sample),
            })
            .collect(),
        edits: vec![RowEdits { row: last, edits }],
        ..Default::default()
    };
    let sampled = b.forward(&batch).expect("forward").sampled;
    let mut observed = vec![0u64; vocab];
    for t in sampled {
        assert!(expected[t as usize] > 0.0, "token {t} is below the min-p cut");
        observed[t as usize] += 1;
    }
    let (stat, dof, pval) = chi_square(&observed, &expected);
    assert!(pval > 0.001, "chi-square {stat:.1} over {dof} degrees of freedom: p = {pval}");
}
