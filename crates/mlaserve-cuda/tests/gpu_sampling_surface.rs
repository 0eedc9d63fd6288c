//! The sampling surface on the GPU backend (tiny-v3): logit edits (bias, penalties),
//! min-p and log-probabilities, computed on the device.
//!
//! - One call asks for raw logits, argmax rows with edits, sample rows with edits and
//!   min-p, and log-probabilities of both: every id equals the host rule
//!   (`mlaserve_core::host_choices`) over the same call's raw logits, and every
//!   log-probability is within 1e-3 of the host's, the top ids equal — on one GPU and on
//!   a TP 2 group (its argmax rows are edited on each rank's slice of the vocabulary).
//! - The engine with penalties, bias, min-p and logprobs: k = 3 equals k = 0, tokens and
//!   log-probabilities, with the batch-invariant options, on one GPU and on TP 2.
#![cfg(feature = "cuda")]

mod common;
mod tp_group;

use common::{require_gpu, require_gpus};
use mlaserve_core::{Backend, Batch, LogitEdit, LogprobRow, RowEdits, SampleRow, SeqChunk};
use mlaserve_cuda::{CudaBackend, CudaOptions};
use mlaserve_engine::{Engine, EngineConfig, Event, FinishReason, Request, SamplingParams};
use std::collections::HashMap;

const BLOCKS: usize = 64;

fn tiny() -> tempfile::TempDir {
    let t = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", t.path()).expect("preset");
    t
}

/// A step of two sequences: a prompt of 40 (its last row chooses) and a decode window of
/// 4 over a cached prefix of 24; greedy rows and sampled rows, edited, with logprobs.
fn probe_calls(b: &mut impl Backend, seed: u64) -> (Batch, Vec<f32>, mlaserve_core::ForwardOutput<()>) {
    let v = b.config().vocab_size as u32;
    let toks = |s: u32, n: u32| (0..n).map(|i| 2 + (s * 7919 + i * 131) % (v - 2)).collect::<Vec<u32>>();
    let pre = Batch {
        seqs: vec![SeqChunk { tokens: toks(2, 24), start_pos: 0, block_table: vec![8, 9], prefill: true }],
        ..Default::default()
    };
    b.forward(&pre).expect("prefix");
    let mut rng = seed;
    let mut next = || {
        rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        rng >> 11
    };
    let mut edits = |row: u32| RowEdits {
        row,
        edits: (0..12)
            .map(|i| LogitEdit {
                token: (next() % (v / 12) as u64) as u32 * 12 + i,
                bias: [0.0, 2.5, -100.0, 0.75][(next() % 4) as usize],
                repetition: [1.0, 1.3, 0.8][(next() % 3) as usize],
                sub: [0.0, 0.4, -1.2][(next() % 3) as usize],
            })
            .collect(),
    };
    // Rows 0..40: the prompt (row 39 chooses); rows 40..44: the window.
    let argmax_rows = vec![39, 40, 42];
    let sample_rows: Vec<SampleRow> = [41u32, 43, 43, 43]
        .iter()
        .enumerate()
        .map(|(i, &row)| SampleRow {
            row,
            temperature: [0.7, 1.0, 1.5, 1.0][i],
            top_k: [0, 50, 0, 0][i],
            top_p: [1.0, 0.9, 1.0, 1.0][i],
            min_p: [0.05, 0.0, 0.2, 0.0][i],
            u: (i as f64 * 0.618 + seed as f64 * 0.1).fract(),
        })
        .collect();
    let batch = Batch {
        seqs: vec![
            SeqChunk { tokens: toks(1, 40), start_pos: 0, block_table: vec![0], prefill: true },
            SeqChunk { tokens: toks(3, 4), start_pos: 24, block_table: vec![8, 9], prefill: false },
        ],
        logit_rows: vec![39, 40, 41, 42, 43],
        argmax_rows,
        sample_rows,
        edits: vec![edits(39), edits(41), edits(42), edits(43)],
        logprob_rows: vec![
            LogprobRow { row: 39, top: 5 },
            LogprobRow { row: 41, top: 20 },
            LogprobRow { row: 43, top: 0 },
        ],
        ..Default::default()
    };
    let out = b.forward(&batch).expect("forward");
    let logits = out.logits.clone();
    let o = mlaserve_core::ForwardOutput {
        hidden: (),
        logits: Vec::new(),
        argmax: out.argmax,
        sampled: out.sampled,
        logprobs: out.logprobs,
    };
    (batch, logits, o)
}

fn check_against_host(name: &str, batch: &Batch, logits: &[f32], o: &mlaserve_core::ForwardOutput<()>) {
    let v = logits.len() / batch.logit_rows.len();
    let want = mlaserve_core::host_choices(batch, |r, buf| {
        let i = batch.logit_rows.iter().position(|&x| x == r).expect("a logit row");
        buf.extend_from_slice(&logits[i * v..(i + 1) * v]);
    });
    assert_eq!(o.argmax, want.argmax, "{name}: edited argmax");
    assert_eq!(o.sampled, want.sampled, "{name}: edited, min-p cut samples");
    assert_eq!(o.logprobs.len(), want.logprobs.len());
    for (g, w) in o.logprobs.iter().zip(&want.logprobs) {
        assert!((g.logprob - w.logprob).abs() < 1e-3, "{name}: logprob {} vs {}", g.logprob, w.logprob);
        assert_eq!(g.top.iter().map(|t| t.0).collect::<Vec<_>>(), w.top.iter().map(|t| t.0).collect::<Vec<_>>());
        for (a, b) in g.top.iter().zip(&w.top) {
            assert!((a.1 - b.1).abs() < 1e-3, "{name}: top logprob {} vs {}", a.1, b.1);
        }
    }
}

#[test]
fn edits_min_p_and_logprobs_match_the_host_rule_one_gpu() {
    if !require_gpu() {
        return;
    }
    let t = tiny();
    for seed in 0..4 {
        let mut b = CudaBackend::load_with(t.path(), CudaOptions::new(BLOCKS, 0).batch_invariant()).expect("load");
        let (batch, logits, o) = probe_calls(&mut b, seed);
        check_against_host(&format!("TP=1 seed {seed}"), &batch, &logits, &o);
    }
}

#[test]
fn edits_min_p_and_logprobs_match_the_host_rule_tp2() {
    if !require_gpus(2) {
        return;
    }
    let t = tiny();
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant_cuda_cores();
    for seed in 0..2 {
        let (batch, logits, o) = tp_group::with_tp_group(t.path(), opts, 2, |l| probe_calls(l, seed));
        check_against_host(&format!("TP=2 seed {seed}"), &batch, &logits, &o);
    }
}

fn requests(vocab: u32) -> Vec<Request> {
    let prompt = |s: u32| (0..30).map(|i| (i * 37 + s * 11) % (vocab - 2) + 2).collect::<Vec<u32>>();
    let base = SamplingParams { max_new_tokens: 32, ignore_eos: true, logprobs: Some(4), ..Default::default() };
    (0..16)
        .map(|i| {
            let sp = match i % 4 {
                0 => SamplingParams { presence_penalty: -2.0, frequency_penalty: -0.5, ..base.clone() },
                1 => SamplingParams { repetition_penalty: 1.5, logit_bias: vec![(7, 3.0)], ..base.clone() },
                2 => SamplingParams {
                    temperature: 0.9,
                    min_p: 0.1,
                    presence_penalty: 0.7,
                    seed: Some(i),
                    ..base.clone()
                },
                _ => SamplingParams { temperature: 1.1, logit_bias: vec![(5, -100.0)], seed: Some(i), ..base.clone() },
            };
            Request::new(prompt(i as u32), sp)
        })
        .collect()
}

type Run = (Vec<Vec<u32>>, Vec<Vec<mlaserve_core::RowLogprobs>>);

fn run<B: Backend>(backend: B, k: usize) -> Run {
    let vocab = backend.config().vocab_size as u32;
    let cfg = EngineConfig { num_speculative_tokens: Some(k), ..Default::default() };
    let mut e = Engine::new(backend, cfg).expect("engine");
    let ids: Vec<_> = requests(vocab).into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    let (mut toks, mut lps): (HashMap<_, Vec<u32>>, HashMap<_, Vec<_>>) = (HashMap::new(), HashMap::new());
    let mut done = 0;
    while done < ids.len() {
        for (id, ev) in e.step() {
            match ev {
                Event::Tokens(t) => toks.entry(id).or_default().extend(t),
                Event::Logprobs(l) => lps.entry(id).or_default().extend(l),
                Event::Finished { reason: FinishReason::Error(m), .. } => panic!("request failed: {m}"),
                Event::Finished { .. } => done += 1,
            }
        }
    }
    let t: Vec<Vec<u32>> = ids.iter().map(|id| toks.remove(id).unwrap_or_default()).collect();
    let l: Vec<Vec<_>> = ids.iter().map(|id| lps.remove(id).unwrap_or_default()).collect();
    for (t, l) in t.iter().zip(&l) {
        assert_eq!((t.len(), l.len()), (32, 32), "a logprob per token");
    }
    (t, l)
}

#[test]
fn engine_k3_equals_k0_with_the_whole_surface_one_gpu_and_tp2() {
    if !require_gpu() {
        return;
    }
    let t = tiny();
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant_cuda_cores();
    let k0 = run(CudaBackend::load_with(t.path(), opts).expect("load"), 0);
    let k3 = run(CudaBackend::load_with(t.path(), opts).expect("load"), 3);
    assert_eq!(k3.0, k0.0, "TP=1: tokens differ between k = 3 and k = 0");
    assert_eq!(k3.1, k0.1, "TP=1: logprobs differ between k = 3 and k = 0");
    if !require_gpus(2) {
        return;
    }
    let tp0 = tp_group::with_tp_group(t.path(), opts, 2, |l| run(l, 0));
    let tp3 = tp_group::with_tp_group(t.path(), opts, 2, |l| run(l, 3));
    assert_eq!(tp3.0, tp0.0, "TP=2: tokens differ between k = 3 and k = 0");
    assert_eq!(tp3.1, tp0.1, "TP=2: logprobs differ between k = 3 and k = 0");
    let differ = tp0.0.iter().zip(&k0.0).filter(|(a, b)| a != b).count();
    println!("TP=2 vs TP=1: {differ}/16 outputs differ (TP's all-reduce rounds differently)");
}
