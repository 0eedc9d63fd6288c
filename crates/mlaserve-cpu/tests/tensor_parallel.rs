//! Tensor parallelism on the CPU backend: ranks as threads over a `LocalGroup`, each
//! loading only its shards. TP = 2, 4, 8 must reproduce TP = 1's logits within 1e-5
//! (relative to the largest logit), for the target model and the MTP layers.

use mlaserve_core::{Backend, Batch, Collective, SeqChunk};
use mlaserve_cpu::{CpuBackend, CpuOptions};
use mlaserve_tp::LocalGroup;
use std::path::Path;
use std::time::Duration;

fn load(dir: &Path, comm: Box<dyn Collective>) -> CpuBackend {
    CpuBackend::load_with(dir, CpuOptions { num_blocks: 8, ..Default::default() }, comm).unwrap()
}

/// Runs a fixed script (a mixed prefill + decode step, then both MTP layers) and returns
/// every logit it produced.
fn script(dir: &Path, comm: Box<dyn Collective>) -> Vec<f32> {
    run_script(&mut load(dir, comm))
}

fn run_script<B: Backend>(b: &mut B) -> Vec<f32> {
    let toks = |n: u32, s: u32| (0..n).map(|i| (i * 31 + s * 7) % 509 + 2).collect::<Vec<u32>>();
    let mut logits = Vec::new();
    let pre = Batch {
        argmax_rows: vec![],
        sample_rows: vec![],
        seqs: vec![
            SeqChunk { tokens: toks(70, 1), start_pos: 0, block_table: vec![0, 1], ..Default::default() },
            SeqChunk { tokens: toks(9, 2), start_pos: 0, block_table: vec![2], ..Default::default() },
        ],
        logit_rows: vec![69, 78],
        ..Default::default()
    };
    let out = b.forward(&pre).unwrap();
    logits.extend(&out.logits);
    let step = Batch {
        argmax_rows: vec![7, 0, 3],
        sample_rows: vec![],
        seqs: vec![
            SeqChunk { tokens: toks(4, 3), start_pos: 70, block_table: vec![0, 1], ..Default::default() },
            SeqChunk { tokens: toks(4, 4), start_pos: 9, block_table: vec![2], ..Default::default() },
        ],
        logit_rows: (0..8).collect(),
        ..Default::default()
    };
    let out = b.forward(&step).unwrap();
    // `argmax_rows`: the argmax of those rows' logits, in the order asked.
    let v = b.config().vocab_size;
    let want: Vec<u32> = [7usize, 0, 3].iter().map(|&r| mlaserve_core::argmax(&out.logits[r * v..][..v])).collect();
    assert_eq!(out.argmax, want);
    logits.extend(&out.logits);
    let mtp0 = b.mtp_forward(0, &step, &out.hidden, &(0..8).collect::<Vec<_>>()).unwrap();
    logits.extend(&mtp0.logits);
    let one = Batch {
        argmax_rows: vec![],
        sample_rows: vec![],
        seqs: vec![SeqChunk { tokens: vec![17], start_pos: 74, block_table: vec![0, 1], ..Default::default() }],
        logit_rows: vec![0],
        ..Default::default()
    };
    let mtp1 = b.mtp_forward(1, &one, &mtp0.hidden, &[3]).unwrap();
    logits.extend(&mtp1.logits);
    logits
}

#[test]
fn tp_2_4_8_match_tp_1() {
    let t = tempfile::tempdir().unwrap();
    mlaserve_model::presets::generate("tiny-v3", t.path()).unwrap();
    let want = script(t.path(), Box::new(mlaserve_core::SingleRank));
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    for world in [2, 4, 8] {
        let outs: Vec<Vec<f32>> = std::thread::scope(|s| {
            let js: Vec<_> = LocalGroup::new(world, Duration::from_secs(60))
                .into_iter()
                .map(|g| s.spawn(|| script(t.path(), Box::new(g))))
                .collect();
            js.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for (rank, got) in outs.iter().enumerate() {
            let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
            assert!(err <= 1e-5, "TP={world} rank {rank}: rel err {err}");
            assert_eq!(got, &outs[0], "TP={world}: ranks disagree");
        }
    }
}

#[test]
fn indivisible_tp_size_is_a_clear_error() {
    let t = tempfile::tempdir().unwrap();
    mlaserve_model::presets::generate("tiny-v3", t.path()).unwrap();
    let errs: Vec<String> = std::thread::scope(|s| {
        let js: Vec<_> = LocalGroup::new(3, Duration::from_secs(5))
            .into_iter()
            .map(|g| {
                s.spawn(|| CpuBackend::load_with(t.path(), CpuOptions::default(), Box::new(g)).unwrap_err().to_string())
            })
            .collect();
        js.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert!(errs[0].contains("num_attention_heads") && errs[0].contains("tensor-parallel size 3"), "{}", errs[0]);
}

/// The same script driven through `TpLeader` on rank 0 while ranks 1..n only follow the
/// broadcast plans: the leader's logits equal TP = 1's.
#[test]
fn leader_follower_plans_reproduce_tp_1() {
    let t = tempfile::tempdir().unwrap();
    mlaserve_model::presets::generate("tiny-v3", t.path()).unwrap();
    let want = script(t.path(), Box::new(mlaserve_core::SingleRank));
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let world = 4;
    let dir = t.path();
    let got = std::thread::scope(|s| {
        let mut inner = LocalGroup::new(world, Duration::from_secs(60));
        let mut plans = LocalGroup::new(world, Duration::from_secs(60));
        let followers: Vec<_> = inner
            .drain(1..)
            .zip(plans.drain(1..))
            .map(|(g, p)| {
                s.spawn(move || {
                    let mut b = load(dir, Box::new(g));
                    mlaserve_tp::run_follower(&mut b, &p)
                })
            })
            .collect();
        let b0 = load(dir, Box::new(inner.pop().unwrap()));
        let mut leader = mlaserve_tp::TpLeader::new(b0, plans.pop().unwrap()).unwrap();
        let got = run_script(&mut leader);
        leader.shutdown().unwrap();
        for f in followers {
            f.join().unwrap().unwrap();
        }
        got
    });
    let err = got.iter().zip(&want).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / scale;
    assert!(err <= 1e-5, "rel err {err}");
}
