//! The CPU backend against the transformers goldens in `tests/golden/` (made by
//! `tools/reference/make_goldens.py`), and its two MLA forms and batch layouts against
//! each other.

use mlaserve_core::{Backend, Batch, SeqChunk, BLOCK_SIZE};
use mlaserve_cpu::attention::AttnMode;
use mlaserve_cpu::{CpuBackend, CpuOptions};
use mlaserve_model::{presets, Weights};
use serde_json::Value;
use std::path::{Path, PathBuf};

struct Golden {
    json: Value,
    tensors: Weights,
}

impl Golden {
    fn load(preset: &str) -> Golden {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden").join(preset);
        let json = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let tensors = Weights::open_files(&[dir.join("golden.safetensors")], None).unwrap();
        Golden { json, tensors }
    }
    fn ids(&self, key: &str) -> Vec<u32> {
        self.json[key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
    }
    fn tensor(&self, name: &str) -> Vec<f32> {
        let shape = self.tensors.shape(name).unwrap();
        self.tensors.f32(name, &shape).unwrap()
    }
}

fn model_dir(preset: &str) -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().join(preset);
    presets::generate(preset, &p).unwrap();
    (t, p)
}

/// max|a − b| / max|b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let d = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    let r = b.iter().fold(0f32, |m, y| m.max(y.abs()));
    d / r
}

/// Checks and reports (run with `--nocapture` to read the measured errors).
fn expect_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    let e = rel_err(got, want);
    eprintln!("{what}: max|Δ|/max|ref| = {e:.2e} (tolerance {tol:.0e})");
    assert!(e <= tol, "{what}: rel err {e} > {tol}");
}

/// Contiguous blocks `first..first + n` covering `len` positions.
fn table(first: u32, len: usize) -> Vec<u32> {
    (first..first + len.div_ceil(BLOCK_SIZE) as u32).collect()
}

fn one(tokens: &[u32], start_pos: usize, table: &[u32]) -> Batch {
    Batch {
        argmax_rows: vec![],
        sample_rows: vec![],
        seqs: vec![SeqChunk { tokens: tokens.to_vec(), start_pos, block_table: table.to_vec(), ..Default::default() }],
        logit_rows: (0..tokens.len() as u32).collect(),
        ..Default::default()
    }
}

const TOL: f32 = 1e-4;

/// A preset generated into a temp dir, or the bundled model from `models/`.
fn checkpoint(name: &str) -> (Option<tempfile::TempDir>, PathBuf) {
    let bundled = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models").join(name);
    if bundled.is_dir() {
        return (None, bundled);
    }
    let (t, p) = model_dir(name);
    (Some(t), p)
}

fn check_target(preset: &str, mode: AttnMode) {
    let g = Golden::load(preset);
    let (_t, dir) = checkpoint(preset);
    let mut b = CpuBackend::load(&dir, 32).unwrap();
    b.set_attn_mode(mode);
    let prompt = g.ids("prompt_ids");
    let decode = g.ids("decode_ids");
    let tb = table(0, prompt.len() + decode.len());
    let out = b.forward(&one(&prompt, 0, &tb)).unwrap();
    expect_close(&format!("{preset} {mode:?} prefill logits"), &out.logits, &g.tensor("prefill_logits"), TOL);
    expect_close(&format!("{preset} {mode:?} prefill hidden"), &out.hidden.data, &g.tensor("prefill_hidden"), TOL);
    // Cached decode: one token per step over the prompt's cache.
    let want = g.tensor("decode_logits");
    let v = b.config().vocab_size;
    for (i, &t) in decode.iter().enumerate() {
        let out = b.forward(&one(&[t], prompt.len() + i, &tb)).unwrap();
        expect_close(&format!("{preset} {mode:?} decode step {i}"), &out.logits, &want[i * v..(i + 1) * v], TOL);
    }
    // Longer than original_max_position_embeddings (YaRN matters), in other blocks.
    let long = g.ids("long_ids");
    let out = b.forward(&one(&long, 0, &table(4, long.len()))).unwrap();
    expect_close(&format!("{preset} {mode:?} long prompt"), &out.logits, &g.tensor("long_logits"), TOL);
}

#[test]
fn tiny_v3_matches_transformers() {
    check_target("tiny-v3", AttnMode::Absorbed);
    check_target("tiny-v3", AttnMode::Expanded);
}

#[test]
fn tiny_v2_matches_transformers() {
    check_target("tiny-v2", AttnMode::Absorbed);
    check_target("tiny-v2", AttnMode::Expanded);
}

#[test]
fn bundled_model_matches_transformers() {
    check_target("mla-tiny-code", AttnMode::Absorbed);
    check_mtp("mla-tiny-code");
}

#[test]
fn tiny_v3_mtp_matches_reference() {
    check_mtp("tiny-v3");
}

fn check_mtp(name: &str) {
    let g = Golden::load(name);
    let (_t, dir) = checkpoint(name);
    let mut b = CpuBackend::load(&dir, 16).unwrap();
    let seq: Vec<u32> = [g.ids("prompt_ids"), g.ids("decode_ids")].concat();
    let tb = table(0, seq.len());
    let target = b.forward(&Batch { logit_rows: vec![], ..one(&seq, 0, &tb) }).unwrap();
    let layers = g.json["mtp"]["layers"].as_u64().unwrap() as usize;
    let mut prev = target.hidden;
    for d in 0..layers {
        // Layer d: positions j = 0..T-2-d, token t_{j+d+1}, hidden row j of the stage before.
        let n = seq.len() - 1 - d;
        let batch = one(&seq[d + 1..d + 1 + n], 0, &tb);
        let rows: Vec<u32> = (0..n as u32).collect();
        let out = b.mtp_forward(d, &batch, &prev, &rows).unwrap();
        expect_close(&format!("mtp{d} logits"), &out.logits, &g.tensor(&format!("mtp{d}_logits")), TOL);
        expect_close(&format!("mtp{d} hidden"), &out.hidden.data, &g.tensor(&format!("mtp{d}_hidden")), TOL);
        prev = out.hidden;
    }
}

fn pseudo_tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i.wrapping_mul(2654435761).wrapping_add(seed * 97) >> 7) % 510 + 2).collect()
}

#[test]
fn absorbed_and_expanded_agree_on_chunked_prefill() {
    let (_t, dir) = model_dir("tiny-v3");
    let toks = pseudo_tokens(150, 3);
    let tb = table(0, toks.len());
    let mut runs = Vec::new();
    for mode in [AttnMode::Absorbed, AttnMode::Expanded] {
        let mut b = CpuBackend::load_with(
            &dir,
            CpuOptions { num_blocks: 8, attn_mode: mode, ..Default::default() },
            Box::new(mlaserve_core::SingleRank),
        )
        .unwrap();
        // Three chunks over a growing cached prefix.
        let mut logits = Vec::new();
        for (lo, hi) in [(0, 70), (70, 130), (130, 150)] {
            logits.extend(b.forward(&one(&toks[lo..hi], lo, &tb)).unwrap().logits);
        }
        runs.push(logits);
    }
    expect_close("expanded vs absorbed, chunked prefill", &runs[1], &runs[0], 1e-5);
}

#[test]
fn mixed_batch_equals_each_sequence_alone() {
    let (_t, dir) = model_dir("tiny-v3");
    let (a, b_pre, b_dec, c_pre, c_dec) =
        (pseudo_tokens(20, 1), pseudo_tokens(30, 2), pseudo_tokens(4, 3), pseudo_tokens(70, 4), pseudo_tokens(4, 5));
    let (ta, tb, tc) = (table(0, 20), table(1, 34), table(2, 74));
    let prefix = |be: &mut CpuBackend| {
        be.forward(&one(&b_pre, 0, &tb)).unwrap();
        be.forward(&one(&c_pre, 0, &tc)).unwrap();
    };
    // Alone.
    let mut alone = CpuBackend::load(&dir, 8).unwrap();
    prefix(&mut alone);
    let want = [
        alone.forward(&one(&a, 0, &ta)).unwrap().logits,
        alone.forward(&one(&b_dec, 30, &tb)).unwrap().logits,
        alone.forward(&one(&c_dec, 70, &tc)).unwrap().logits,
    ]
    .concat();
    // Together: one prefill of 20 and two 4-token decodes over cached prefixes.
    let mut mixed = CpuBackend::load(&dir, 8).unwrap();
    prefix(&mut mixed);
    let batch = Batch {
        argmax_rows: vec![],
        sample_rows: vec![],
        seqs: vec![
            SeqChunk { tokens: a.clone(), start_pos: 0, block_table: ta.clone(), ..Default::default() },
            SeqChunk { tokens: b_dec.clone(), start_pos: 30, block_table: tb.clone(), ..Default::default() },
            SeqChunk { tokens: c_dec.clone(), start_pos: 70, block_table: tc.clone(), ..Default::default() },
        ],
        logit_rows: (0..28).collect(),
        ..Default::default()
    };
    let got = mixed.forward(&batch).unwrap().logits;
    expect_close("mixed batch vs each alone", &got, &want, 1e-6);
}

#[test]
fn bad_batches_are_errors() {
    let (_t, dir) = model_dir("tiny-v2");
    let mut b = CpuBackend::load(&dir, 4).unwrap();
    let e = b.forward(&one(&[600], 0, &[0])).unwrap_err().to_string();
    assert!(e.contains("token id 600"), "{e}");
    let e = b.forward(&one(&[5; 70], 0, &[0])).unwrap_err().to_string();
    assert!(e.contains("block table"), "{e}");
    let e = b.forward(&one(&[5], 0, &[9])).unwrap_err().to_string();
    assert!(e.contains("block id 9"), "{e}");
    let e = b
        .mtp_forward(0, &one(&[5], 0, &[0]), &mlaserve_cpu::CpuHidden { rows: 1, data: vec![0.0; 64] }, &[0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("MTP layer 0"), "{e}");
}
