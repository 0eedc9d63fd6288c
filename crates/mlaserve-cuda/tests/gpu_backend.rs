//! `CudaBackend` against the CPU reference backend on `tiny-v3`: the same calls on both
//! (a prefill of two sequences, a uniform decode step of 4-token windows, a 1-token
//! decode step, a mixed step with a prefill chunk over a cached prefix and a new
//! sequence, both MTP layers), logits within 2e-2 of max|ref| (bf16 weights and cache).
//! Runs with the default options (cuBLAS, decode kernel) and the batch-invariant ones.
//!
//! Expert choice is discrete: a prefill token whose f32 routing lies within 5e-3 of a tie
//! (found by a CPU replay, `common::near_ties`) may pick another expert on the GPU and
//! differ by far more than the rounding (an H200 run showed exactly such rows). Those rows
//! are reported, not asserted. MTP layer 0 gets the CPU's hidden state as input, so a
//! target-side flip does not propagate into its check.
#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeSet;

use mlaserve_core::{Backend, Batch, SeqChunk};
use mlaserve_cpu::CpuBackend;
use mlaserve_cuda::{CudaBackend, CudaOptions};

const BLOCKS: usize = 32;
const TOL: f64 = 2e-2;

fn require_gpu() -> bool {
    match mlaserve_cuda::Gpu::new(0) {
        Ok(_) => true,
        Err(e) if std::env::var_os("MLASERVE_REQUIRE_GPU").is_none() => {
            eprintln!("skipping GPU test: {e}");
            false
        }
        Err(e) => panic!("MLASERVE_REQUIRE_GPU is set but no GPU: {e}"),
    }
}

fn rel(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "shape");
    if got.iter().any(|v| !v.is_finite()) {
        return f64::NAN;
    }
    let d = got.iter().zip(want).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max);
    d / want.iter().map(|v| v.abs() as f64).fold(1e-30, f64::max)
}

fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 2 + (seed.wrapping_mul(7919) + i * 131) % 509).collect()
}

fn all_rows(b: &mut Batch) {
    b.logit_rows = (0..b.num_tokens() as u32).collect();
}

fn chunk(tokens: Vec<u32>, start_pos: usize, table: &[u32]) -> SeqChunk {
    SeqChunk { tokens, start_pos, block_table: table.to_vec() }
}

/// Rows whose own max|Δ| exceeds `TOL · max|ref|` (all rows `width` wide), worst first.
fn rows_over(got: &[f32], want: &[f32], width: usize) -> Vec<(usize, f64)> {
    let m = want.iter().map(|v| v.abs() as f64).fold(1e-30, f64::max);
    let mut v: Vec<(usize, f64)> = got
        .chunks(width)
        .zip(want.chunks(width))
        .map(|(g, w)| g.iter().zip(w).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max) / m)
        .enumerate()
        .filter(|(_, r)| r.is_nan() || *r > TOL)
        .collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1));
    v
}

/// One compared output: name, rel over all rows, rows over the tolerance (worst first).
type Cmp = (String, f64, usize, Vec<(usize, f64)>);

/// Rows excluded from the strict check in a named output.
type Excluded = BTreeSet<usize>;

/// Runs the scenario on both backends.
fn scenario(gpu: &mut CudaBackend, cpu: &mut CpuBackend, ties: &Excluded) -> Vec<(Cmp, Excluded)> {
    let (ta, tb, tc) = ([3u32, 7], [1u32, 9], [5u32]);
    let mut res = Vec::new();
    let (v, hd) = (cpu.config().vocab_size, cpu.config().hidden_size);
    let mut cmp = |name: &str, g: &[f32], c: &[f32]| {
        let width = if name.contains("hidden") { hd } else { v };
        let ex = if name.starts_with("prefill") { ties.clone() } else { Excluded::new() };
        let over = rows_over(g, c, width);
        // rel over the rows that are not near a routing tie
        let keep: Vec<usize> = (0..g.len() / width).filter(|r| !ex.contains(r)).collect();
        let pick = |v: &[f32]| keep.iter().flat_map(|&r| v[r * width..(r + 1) * width].to_vec()).collect::<Vec<_>>();
        res.push(((name.to_string(), rel(&pick(g), &pick(c)), g.len() / width, over), ex))
    };
    // 1. Prefill: A 70 tokens (two blocks), B 20.
    let mut b1 = Batch { seqs: vec![chunk(toks(1, 70), 0, &ta), chunk(toks(2, 20), 0, &tb)], logit_rows: vec![] };
    all_rows(&mut b1);
    let (g1, c1) = (gpu.forward(&b1).expect("gpu prefill"), cpu.forward(&b1).expect("cpu prefill"));
    cmp("prefill logits (90 rows)", &g1.logits, &c1.logits);
    cmp("prefill hidden", &gpu.hidden_to_host(&g1.hidden).expect("h"), &cpu.hidden_to_host(&c1.hidden).expect("h"));
    // MTP layer 0 over the prefill (tokens shifted by one), then layer 1 on the last rows.
    let mut m0 = b1.clone();
    for c in &mut m0.seqs {
        c.tokens.rotate_left(1);
    }
    let ident: Vec<u32> = (0..90).collect();
    let cpu_hidden = gpu.hidden_from_host(&cpu.hidden_to_host(&c1.hidden).expect("h")).expect("upload");
    let (gm0, cm0) = (
        gpu.mtp_forward(0, &m0, &cpu_hidden, &ident).expect("gpu mtp0"),
        cpu.mtp_forward(0, &m0, &c1.hidden, &ident).expect("cpu mtp0"),
    );
    cmp("MTP layer 0 logits (90 rows, CPU hidden in)", &gm0.logits, &cm0.logits);
    let m1 = Batch { seqs: vec![chunk(vec![11], 70, &ta), chunk(vec![12], 20, &tb)], logit_rows: vec![0, 1] };
    let (gm1, cm1) = (
        gpu.mtp_forward(1, &m1, &gm0.hidden, &[69, 89]).expect("gpu mtp1"),
        cpu.mtp_forward(1, &m1, &cm0.hidden, &[69, 89]).expect("cpu mtp1"),
    );
    cmp("MTP layer 1 logits", &gm1.logits, &cm1.logits);
    // 2. Uniform decode windows of 4 (the decode kernel's path with default options).
    let mut b2 = Batch { seqs: vec![chunk(toks(3, 4), 70, &ta), chunk(toks(4, 4), 20, &tb)], logit_rows: vec![] };
    all_rows(&mut b2);
    let (g2, c2) = (gpu.forward(&b2).expect("gpu decode"), cpu.forward(&b2).expect("cpu decode"));
    cmp("decode s=4 logits", &g2.logits, &c2.logits);
    // 3. One-token decode.
    let mut b3 = Batch { seqs: vec![chunk(vec![40], 74, &ta), chunk(vec![41], 24, &tb)], logit_rows: vec![] };
    all_rows(&mut b3);
    let (g3, c3) = (gpu.forward(&b3).expect("gpu decode1"), cpu.forward(&b3).expect("cpu decode1"));
    cmp("decode s=1 logits", &g3.logits, &c3.logits);
    // 4. Mixed: a 2-token window, a 30-token chunk over B's cached 25, a new sequence C.
    let b4 = Batch {
        seqs: vec![chunk(toks(5, 2), 75, &ta), chunk(toks(6, 30), 25, &tb), chunk(toks(7, 5), 0, &tc)],
        logit_rows: vec![0, 1, 31, 36],
    };
    let (g4, c4) = (gpu.forward(&b4).expect("gpu mixed"), cpu.forward(&b4).expect("cpu mixed"));
    cmp("mixed logits", &g4.logits, &c4.logits);
    res
}

fn run_with(opts: CudaOptions, label: &str) {
    let t = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", t.path()).expect("preset");
    let mut gpu = CudaBackend::load_with(t.path(), opts).expect("load gpu");
    let mut cpu = CpuBackend::load(t.path(), BLOCKS).expect("load cpu");
    let seqs = vec![(toks(1, 70), vec![3, 7]), (toks(2, 20), vec![1, 9])];
    let ties: Excluded =
        common::near_ties(t.path(), &seqs, 5e-3).into_iter().flat_map(|(_, v)| v).map(|x| x.0).collect();
    println!("{label}: prefill rows within 5e-3 of a routing tie (reported, not asserted): {ties:?}");
    let res = scenario(&mut gpu, &mut cpu, &ties);
    let mut bad = Vec::new();
    for ((name, r, rows, over), ex) in &res {
        let ok = *r <= TOL;
        if !ex.is_empty() {
            let near: Vec<String> =
                over.iter().filter(|(i, _)| ex.contains(i)).map(|(i, e)| format!("row {i}: {e:.2e}")).collect();
            println!("{label:<16} {name:<32} near-tie rows over {TOL:.0e}: [{}]", near.join(", "));
        }
        let worst: Vec<String> = over.iter().take(4).map(|(i, e)| format!("row {i}: {e:.2e}")).collect();
        println!(
            "{label:<16} {name:<32} rel {r:.2e} {} ({}/{rows} rows over {TOL:.0e}{}{})",
            if ok { "ok" } else { "FAIL" },
            over.len(),
            if worst.is_empty() { "" } else { "; " },
            worst.join(", ")
        );
        if !ok {
            bad.push(format!("{name}: {r:.3e}"));
        }
    }
    assert!(bad.is_empty(), "{label}: {bad:?}");
}

#[test]
fn tiny_v3_matches_cpu_default_options() {
    if !require_gpu() {
        return;
    }
    run_with(CudaOptions::new(BLOCKS, 0), "cublas+decode");
}

#[test]
fn tiny_v3_matches_cpu_batch_invariant() {
    if !require_gpu() {
        return;
    }
    run_with(CudaOptions::new(BLOCKS, 0).batch_invariant(), "batch-invariant");
}
