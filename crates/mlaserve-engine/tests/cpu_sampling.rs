//! Sampling losslessness: the stochastic verifier's output distribution equals the
//! target's (chi-square, p > 0.001, ≥ 20k draws), on a fixed small distribution with a
//! deliberately poor draft, and on tiny-v3's next-token distribution (CPU backend).

mod common;

use common::stats::chi_square;
use common::TestRng;
use mlaserve_core::{Backend, Batch, SeqChunk};
use mlaserve_cpu::CpuBackend;
use mlaserve_engine::sampling::{choose_token, target_distribution, verify_window};
use mlaserve_engine::SamplingParams;

const P_MIN: f64 = 0.001;

fn probs_of(logits: &[f32], sp: &SamplingParams) -> Vec<f64> {
    let d = target_distribution(logits, sp);
    let mut p = vec![0.0; logits.len()];
    for (&t, &q) in d.tokens.iter().zip(&d.probs) {
        p[t as usize] = q;
    }
    p
}

/// A Markov chain over 6 tokens; the drafts come from a distribution that puts its
/// mass where the target puts little, so most are rejected.
#[test]
fn fixed_distribution_poor_draft() {
    const V: usize = 6;
    let target: [[f64; V]; V] = [
        [0.50, 0.20, 0.15, 0.10, 0.04, 0.01],
        [0.05, 0.05, 0.60, 0.10, 0.10, 0.10],
        [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
        [0.01, 0.09, 0.20, 0.20, 0.20, 0.30],
        [0.25, 0.25, 0.25, 0.05, 0.10, 0.10],
        [0.70, 0.06, 0.06, 0.06, 0.06, 0.06],
    ];
    let poor_q = [0.01, 0.04, 0.10, 0.15, 0.20, 0.50];
    let logits_row = |prev: usize| target[prev].iter().map(|p| p.ln() as f32).collect::<Vec<f32>>();
    for sp in [
        SamplingParams { temperature: 1.0, ..Default::default() },
        SamplingParams { temperature: 0.7, top_k: 4, top_p: 0.9, ..Default::default() },
    ] {
        let mut rng = TestRng(77);
        let n = 40_000;
        let mut joint = vec![0u64; V * V];
        let mut accepted = 0u64;
        for draw in 0..n {
            let draft = |rng: &mut TestRng| {
                let u = rng.f64();
                let mut c = 0.0;
                poor_q
                    .iter()
                    .position(|&q| {
                        c += q;
                        u < c
                    })
                    .unwrap_or(V - 1) as u32
            };
            let (d1, d2) = (draft(&mut rng), draft(&mut rng));
            let last = 0usize;
            let mut logits = logits_row(last);
            logits.extend(logits_row(d1 as usize));
            logits.extend(logits_row(d2 as usize));
            let seed = 0xabc0_0000 + draw as u64;
            let v = verify_window(&logits, V, &[d1, d2], &sp, seed, 100);
            accepted += v.accepted as u64;
            let x0 = v.tokens[0] as usize;
            let x1 = match v.tokens.get(1) {
                Some(&t) => t as usize,
                // Rejected at once: the next step samples position 101 from p(·|x0).
                None => choose_token(&logits_row(x0), &sp, seed, 101) as usize,
            };
            joint[x0 * V + x1] += 1;
        }
        let p0 = probs_of(&logits_row(0), &sp);
        let expected: Vec<f64> = (0..V * V).map(|c| p0[c / V] * probs_of(&logits_row(c / V), &sp)[c % V]).collect();
        let (stat, df, p) = chi_square(&joint, &expected);
        eprintln!(
            "poor draft {sp:?}: chi2 {stat:.1} df {df} p {p:.4}, accepted {:.3}/step",
            accepted as f64 / n as f64
        );
        assert!(p > P_MIN, "joint of the first two tokens: chi2 {stat} df {df} p {p}");
        assert!((accepted as f64 / n as f64) < 0.5, "the draft is poor");
    }
}

#[test]
fn tiny_v3_next_token_distribution() {
    let dir = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", dir.path()).expect("generate");
    let mut b = CpuBackend::load(dir.path(), 8).expect("load");
    let v = b.config().vocab_size;
    let prompt: Vec<u32> = (0..24).map(|i| (i * 53 + 7) % v as u32).collect();
    let table: Vec<u32> = (0..8).collect();
    let pre = Batch {
        argmax_rows: vec![],
        sample_rows: vec![],
        seqs: vec![SeqChunk {
            tokens: prompt[..23].to_vec(),
            start_pos: 0,
            block_table: table.clone(),
            ..Default::default()
        }],
        logit_rows: vec![22],
        ..Default::default()
    };
    b.forward(&pre).expect("prefill");
    // Drafts: the target's own argmax chain (a good draft, so later rows get samples).
    let row = |b: &mut CpuBackend, toks: Vec<u32>| {
        let n = toks.len() as u32;
        let probe = Batch {
            argmax_rows: vec![],
            sample_rows: vec![],
            seqs: vec![SeqChunk { tokens: toks, start_pos: 23, block_table: table.clone(), ..Default::default() }],
            logit_rows: vec![n - 1],
            ..Default::default()
        };
        mlaserve_engine::sampling::argmax(&b.forward(&probe).expect("probe").logits)
    };
    let d1 = row(&mut b, vec![prompt[23]]);
    let d2 = row(&mut b, vec![prompt[23], d1]);
    let window = Batch {
        argmax_rows: vec![],
        sample_rows: vec![],
        seqs: vec![SeqChunk {
            tokens: vec![prompt[23], d1, d2],
            start_pos: 23,
            block_table: table,
            ..Default::default()
        }],
        logit_rows: vec![0, 1, 2],
        ..Default::default()
    };
    let logits = b.forward(&window).expect("window").logits;
    let mut second_tested = false;
    for sp in [
        SamplingParams { temperature: 1.0, ..Default::default() },
        SamplingParams { temperature: 0.6, top_k: 20, top_p: 0.95, ..Default::default() },
    ] {
        let n = 20_000;
        let mut first = vec![0u64; v];
        let mut second = vec![0u64; v];
        for draw in 0..n {
            let r = verify_window(&logits, v, &[d1, d2], &sp, 0x5eed_0000 + draw, 24);
            first[r.tokens[0] as usize] += 1;
            if r.accepted >= 1 {
                second[r.tokens[1] as usize] += 1;
            }
        }
        let (stat, df, p) = chi_square(&first, &probs_of(&logits[..v], &sp));
        eprintln!("tiny-v3 {sp:?}: first token chi2 {stat:.1} df {df} p {p:.4}");
        assert!(p > P_MIN, "first token: chi2 {stat} df {df} p {p}");
        let m: u64 = second.iter().sum();
        if m >= 2_000 {
            let (stat, df, p) = chi_square(&second, &probs_of(&logits[v..2 * v], &sp));
            eprintln!("tiny-v3 {sp:?}: second token after acceptance ({m} draws) chi2 {stat:.1} df {df} p {p:.4}");
            assert!(p > P_MIN, "second token: chi2 {stat} df {df} p {p}");
            second_tested = true;
        }
    }
    assert!(second_tested, "the argmax draft is accepted often enough to test row 1");
    // The same rows through a mismatching draft give the same first-token law.
    let mut rng = TestRng(3);
    let sp = SamplingParams { temperature: 1.0, ..Default::default() };
    let mut first = vec![0u64; v];
    for draw in 0..20_000u64 {
        let poor = rng.range(0, v as u64 - 1) as u32;
        let r = verify_window(&logits[..2 * v], v, &[poor], &sp, 0x7000_0000 + draw, 24);
        first[r.tokens[0] as usize] += 1;
    }
    let (stat, df, p) = chi_square(&first, &probs_of(&logits[..v], &sp));
    assert!(p > P_MIN, "random drafts: chi2 {stat} df {df} p {p}");
}
