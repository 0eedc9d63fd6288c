//! Prefix caching on the GPU backend: 64 concurrent requests over 4 shared system
//! prompts, after a first wave that leaves those prompts cached. With the
//! batch-invariant options, every request's output with cache hits equals its output
//! with prefix caching off, greedy and seeded sampling — on one GPU (the bundled trained
//! model, whose drafts are mostly accepted, so the reused MTP entries matter) and on a
//! tensor-parallel group of 2 ranks (tiny-v3; every rank maps the same block ids).
#![cfg(feature = "cuda")]

mod common;
mod tp_group;

use common::{require_gpu, require_gpus};
use mlaserve_core::Backend;
use mlaserve_cuda::linear::{GemmMode, TcKernels};
use mlaserve_cuda::prefill::PrefillKernel;
use mlaserve_cuda::{CudaBackend, CudaOptions, PrefillPath};
use mlaserve_engine::{Engine, EngineConfig, Event, FinishReason, Request, SamplingParams};
use std::collections::HashMap;
use std::path::Path;

const BLOCKS: usize = 512;

fn ids(seed: u64, n: usize, vocab: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            2 + (s % (vocab - 2)) as u32
        })
        .collect()
}

/// The two waves: one request per system prompt, then 64 over the same prompts.
fn waves(sampling: &SamplingParams, vocab: u64) -> [Vec<Request>; 2] {
    let systems: Vec<Vec<u32>> = (0..4).map(|i| ids(100 + i, 130 + 40 * i as usize, vocab)).collect();
    let req = |i: usize, user: usize| {
        let mut p = systems[i % 4].clone();
        p.extend(ids(1000 + i as u64, user, vocab));
        let sp = SamplingParams { max_new_tokens: 24, ignore_eos: true, seed: Some(7 + i as u64), ..sampling.clone() };
        Request::new(p, sp)
    };
    [(0..4).map(|i| req(i, 5)).collect(), (0..64).map(|i| req(i, 1 + i % 37)).collect()]
}

/// Runs the waves one after the other; the second wave's tokens and cached tokens.
fn run<B: Backend>(backend: B, prefix: bool, waves: &[Vec<Request>; 2]) -> (Vec<Vec<u32>>, u64) {
    run_with(backend, prefix, 512, waves)
}

/// [`run`] with steps of at most `max_batch_tokens` (prompts are prefilled in chunks
/// that fit).
fn run_with<B: Backend>(
    backend: B,
    prefix: bool,
    max_batch_tokens: usize,
    waves: &[Vec<Request>; 2],
) -> (Vec<Vec<u32>>, u64) {
    let cfg = EngineConfig {
        num_speculative_tokens: Some(3),
        max_batch_tokens,
        enable_prefix_caching: prefix,
        ..Default::default()
    };
    let mut e = Engine::new(backend, cfg).expect("engine");
    let mut last = (Vec::new(), 0);
    for wave in waves {
        let ids: Vec<_> = wave.iter().map(|r| e.add_request(r.clone()).expect("admit")).collect();
        let mut out: HashMap<_, Vec<u32>> = HashMap::new();
        let (mut done, mut cached) = (0, 0);
        while done < ids.len() {
            for (id, ev) in e.step() {
                match ev {
                    Event::Tokens(t) => out.entry(id).or_default().extend(t),
                    Event::Finished { reason: FinishReason::Error(m), .. } => panic!("request failed: {m}"),
                    Event::Finished { usage, .. } => {
                        cached += usage.cached_prompt_tokens;
                        done += 1;
                    }
                    Event::Logprobs(_) => {}
                }
            }
            e.check_invariants().expect("block accounting");
        }
        last = (ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect(), cached);
    }
    last
}

fn samplings() -> [(&'static str, SamplingParams); 2] {
    [
        ("greedy", SamplingParams::default()),
        ("seeded sampling", SamplingParams { temperature: 0.8, top_p: 0.95, ..Default::default() }),
    ]
}

/// One GPU, the bundled model: with either set of batch-invariant options every output
/// is equal with and without hits, greedy and seeded.
#[test]
fn cache_hits_keep_every_output_one_gpu() {
    if !require_gpu() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
    for (mode, opts) in [
        ("CUDA cores", CudaOptions::new(BLOCKS, 0).batch_invariant_cuda_cores()),
        ("tensor cores", CudaOptions::new(BLOCKS, 0).batch_invariant()),
    ] {
        for (what, sp) in samplings() {
            let w = waves(&sp, 4096);
            let (off, _) = run(CudaBackend::load_with(&dir, opts).expect("load"), false, &w);
            let (on, cached) = run(CudaBackend::load_with(&dir, opts).expect("load"), true, &w);
            let differ = off.iter().zip(&on).filter(|(a, b)| a != b).count();
            println!(
                "TP=1 {mode}, {what}: {cached} prompt tokens cached in the second wave; {differ}/64 outputs differ"
            );
            assert!(cached >= 64 * 128, "every request of the second wave reuses its system prompt ({cached})");
            assert_eq!(on, off, "TP=1 {mode}, {what}: outputs differ with cache hits");
        }
    }
}

#[test]
fn cache_hits_keep_every_output_tp2() {
    if !require_gpus(2) {
        return;
    }
    let t = tempfile::tempdir().expect("tempdir");
    mlaserve_model::presets::generate("tiny-v3", t.path()).expect("preset");
    let opts = CudaOptions::new(BLOCKS, 0).batch_invariant_cuda_cores();
    for (what, sp) in samplings() {
        let w = waves(&sp, 512);
        let (off, _) = tp_group::with_tp_group(t.path(), opts, 2, |l| run(l, false, &w));
        let (on, cached) = tp_group::with_tp_group(t.path(), opts, 2, |l| run(l, true, &w));
        let differ = off.iter().zip(&on).filter(|(a, b)| a != b).count();
        println!("TP=2 {what}: {cached} prompt tokens cached in the second wave; {differ}/64 outputs differ");
        assert!(cached >= 64 * 128, "every request of the second wave reuses its system prompt ({cached})");
        assert_eq!(on, off, "TP=2 {what}: outputs differ with cache hits");
    }
}

/// The same waves without prefix caching, prompts prefilled whole (steps of up to 8192
/// tokens) and in chunks (steps of 512): with the batch-invariant options a token's result
/// does not depend on how its prompt was chunked, so the outputs are equal. Run over the
/// tensor-core options with each choice of kernels, and the CUDA-core options; prints
/// each variant's count of differing outputs before asserting.
#[test]
fn chunked_prefill_keeps_every_output_one_gpu() {
    if !require_gpu() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
    let tc = CudaOptions::new(BLOCKS, 0).batch_invariant();
    let variants = [
        ("tensor cores", tc),
        ("tensor cores, GEMMs mma.sync", CudaOptions { linear_tc: TcKernels::MmaSync, ..tc }),
        ("tensor cores, GEMMs wgmma", CudaOptions { linear_tc: TcKernels::WgmmaTma, ..tc }),
        ("tensor cores, prefill mma.sync", CudaOptions { prefill_kernel: PrefillKernel::MmaSync, ..tc }),
        ("tensor cores, CUDA-core GEMMs", CudaOptions { gemm: GemmMode::BatchInvariant, ..tc }),
        ("tensor cores, absorbed prefill", CudaOptions { prefill: PrefillPath::Absorbed, ..tc }),
        ("tensor cores, no decode kernel", CudaOptions { decode_kernel: false, decode_split_blocks: None, ..tc }),
        ("CUDA cores", CudaOptions::new(BLOCKS, 0).batch_invariant_cuda_cores()),
    ];
    let mut failed = Vec::new();
    for (mode, opts) in variants {
        for (what, sp) in samplings() {
            let w = waves(&sp, 4096);
            let (whole, _) = run_with(CudaBackend::load_with(&dir, opts).expect("load"), false, 8192, &w);
            let (chunked, _) = run_with(CudaBackend::load_with(&dir, opts).expect("load"), false, 512, &w);
            let differ = whole.iter().zip(&chunked).filter(|(a, b)| a != b).count();
            println!("TP=1 {mode}, {what}: {differ}/64 outputs differ between whole and chunked prompts");
            if differ > 0 {
                failed.push(format!("{mode}, {what}"));
            }
        }
    }
    assert!(failed.is_empty(), "chunking changed outputs: {failed:?}");
}

/// One prompt of 300 tokens of the bundled model prefilled whole and in two chunks split
/// at each of several points (a fresh cache each time): the logits of every row, bit for
/// bit, under each batch-invariant option set and choice of kernels. Prints the rows that
/// differ per split and asserts none does. It guards the expanded kernel's online
/// softmax: a rescale by a factor a rounding residual off 1 on key tiles wholly past a
/// row would change the row's last bits with how far its CTA reaches.
#[test]
fn one_prompt_whole_vs_two_chunks_one_gpu() {
    use mlaserve_core::{Batch, SeqChunk};
    if !require_gpu() {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
    let prompt = ids(77, 300, 4096);
    let table: Vec<u32> = (0..8).collect();
    let last_logits = |b: &mut CudaBackend, splits: &[usize]| {
        let mut start = 0;
        let mut out = Vec::new();
        for (i, &end) in splits.iter().chain([prompt.len()].iter()).enumerate() {
            let last = i == splits.len();
            let batch = Batch {
                seqs: vec![SeqChunk {
                    tokens: prompt[start..end].to_vec(),
                    start_pos: start,
                    block_table: table.clone(),
                    prefill: true,
                }],
                logit_rows: (0..(end - start) as u32).collect(),
                ..Default::default()
            };
            out.extend(b.forward(&batch).expect("forward").logits);
            start = end;
            let _ = last;
        }
        out
    };
    let v = 4096;
    let tc = CudaOptions::new(BLOCKS, 0).batch_invariant();
    let mut failed = Vec::new();
    for (mode, opts) in [
        ("tensor cores (expanded prompts)", tc),
        ("tensor cores, GEMMs mma.sync", CudaOptions { linear_tc: TcKernels::MmaSync, ..tc }),
        ("tensor cores, GEMMs wgmma", CudaOptions { linear_tc: TcKernels::WgmmaTma, ..tc }),
        ("tensor cores, prefill mma.sync", CudaOptions { prefill_kernel: PrefillKernel::MmaSync, ..tc }),
        ("tensor cores, CUDA-core GEMMs", CudaOptions { gemm: GemmMode::BatchInvariant, ..tc }),
        ("tensor cores, absorbed prefill", CudaOptions { prefill: PrefillPath::Absorbed, ..tc }),
        ("CUDA cores", CudaOptions::new(BLOCKS, 0).batch_invariant_cuda_cores()),
    ] {
        let mut b = CudaBackend::load_with(&dir, opts).expect("load");
        let whole = last_logits(&mut b, &[]);
        for split in [1, 2, 8, 16, 17, 32, 33, 63, 64, 80, 100, 299] {
            let chunked = last_logits(&mut b, &[split]);
            let row_diff = |r: usize| {
                let (a, b) = (&whole[r * v..(r + 1) * v], &chunked[r * v..(r + 1) * v]);
                a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max)
            };
            let diff = row_diff(prompt.len() - 1);
            let rows: Vec<usize> = (0..prompt.len()).filter(|&r| row_diff(r) != 0.0).collect();
            println!(
                "{mode}: split at {split}: last row's largest logit difference {diff:e}; rows that differ: {} (first {:?}, last {:?})",
                rows.len(),
                rows.first(),
                rows.last()
            );
            if !rows.is_empty() {
                failed.push(format!("{mode} at {split}"));
            }
        }
    }
    assert!(failed.is_empty(), "chunking changed the logits: {failed:?}");
}
