//! Tests of raw fp8 reads, tensor identity and load progress over real safetensors files.

use crate::fp8::{f32_to_fp8_e4m3, fp8_e4m3_to_f32};
use crate::progress::LoadProgress;
use crate::weights::{write_safetensors, RawTensor, Shard, Weights};
use mlaserve_core::config::Fp8Config;
use safetensors::tensor::Dtype;
use std::collections::BTreeMap;
use std::sync::Arc;

const BLOCK: Option<Fp8Config> = Some(Fp8Config { block: [128, 128] });

/// A 384 × 300 fp8 weight (scales 3 × 3) and a bf16 tensor, written to one file.
fn fp8_dir() -> (tempfile::TempDir, Vec<u8>, Vec<f32>) {
    let (rows, cols) = (384, 300);
    let q: Vec<u8> = (0..rows * cols).map(|i| f32_to_fp8_e4m3(((i * 7 % 23) as f32 - 11.0) * 0.37)).collect();
    let scales: Vec<f32> = (0..9).map(|i| 0.5 + i as f32 * 0.125).collect();
    let mut t = BTreeMap::new();
    t.insert("l.weight".to_string(), RawTensor { shape: vec![rows, cols], dtype: Dtype::F8_E4M3, data: q.clone() });
    t.insert("l.weight_scale_inv".to_string(), RawTensor::f32(&[3, 3], &scales));
    t.insert("n.weight".to_string(), RawTensor::bf16(&[4], &[1.0, 2.0, 3.0, 4.0]));
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &t).unwrap();
    (dir, q, scales)
}

#[test]
fn fp8_shard_reads_codes_and_scales_without_dequantising() {
    let (dir, q, scales) = fp8_dir();
    let w = Weights::open(dir.path(), BLOCK).unwrap();
    let t = w.fp8_shard("l.weight", [384, 300], None).unwrap();
    assert!(t.is_borrowed());
    assert_eq!((t.out, t.inp, t.block, t.scale_rows(), t.scale_cols()), (384, 300, [128, 128], 3, 3));
    assert_eq!(&t.q[..], &q[..]);
    assert_eq!(t.scales, scales);
    // The borrowed codes are the memory map's bytes, not a copy.
    assert_eq!(t.q.as_ptr(), w.raw("l.weight").unwrap().data.as_ptr());
    // Dequantising agrees with the f32 reader exactly.
    assert_eq!(t.dequantize(), w.f32("l.weight", &[384, 300]).unwrap());

    // Row shard 1 of 3: rows 128..256, scale row 1, borrowed.
    let r = w.fp8_shard("l.weight", [384, 300], Some(Shard::new(0, 1, 3))).unwrap();
    assert!(r.is_borrowed());
    assert_eq!((r.out, r.inp), (128, 300));
    assert_eq!(&r.q[..], &q[128 * 300..256 * 300]);
    assert_eq!(r.scales, scales[3..6].to_vec());
    let full = w.f32("l.weight", &[384, 300]).unwrap();
    assert_eq!(r.dequantize(), full[128 * 300..256 * 300].to_vec());

    // A 300-wide input does not split into 128-multiples: refused, naming the tensor.
    let e = w.fp8_shard("l.weight", [384, 300], Some(Shard::new(1, 0, 2))).unwrap_err().to_string();
    assert!(e.contains("`l.weight`") && e.contains("block"), "{e}");
    // Nor do 384 rows into two 192-row halves.
    let e = w.fp8_shard("l.weight", [384, 300], Some(Shard::new(0, 0, 2))).unwrap_err().to_string();
    assert!(e.contains("`l.weight`") && e.contains("192") && e.contains("block"), "{e}");
    // Wrong dtype and shape are named.
    let e = w.fp8_shard("n.weight", [2, 2], None).unwrap_err().to_string();
    assert!(e.contains("`n.weight`") && e.contains("BF16"), "{e}");
    let e = w.fp8_shard("l.weight", [300, 384], None).unwrap_err().to_string();
    assert!(e.contains("`l.weight`") && e.contains("expected [300, 384]"), "{e}");
}

#[test]
fn fp8_column_shards_take_their_scale_columns() {
    let (rows, cols) = (200, 512);
    let q: Vec<u8> = (0..rows * cols).map(|i| (i * 31 % 0x7e) as u8).collect();
    let scales: Vec<f32> = (0..8).map(|i| 2f32.powi(i - 4)).collect();
    let mut t = BTreeMap::new();
    t.insert("c.weight".to_string(), RawTensor { shape: vec![rows, cols], dtype: Dtype::F8_E4M3, data: q.clone() });
    t.insert("c.weight_scale_inv".to_string(), RawTensor::f32(&[2, 4], &scales));
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &t).unwrap();
    let w = Weights::open(dir.path(), BLOCK).unwrap();
    let full = w.f32("c.weight", &[rows, cols]).unwrap();
    for rank in 0..2 {
        let s = w.fp8_shard("c.weight", [rows, cols], Some(Shard::new(1, rank, 2))).unwrap();
        assert!(!s.is_borrowed());
        assert_eq!((s.out, s.inp, s.scale_rows(), s.scale_cols()), (200, 256, 2, 2));
        assert_eq!(s.scales, vec![scales[2 * rank], scales[2 * rank + 1], scales[4 + 2 * rank], scales[5 + 2 * rank]]);
        for r in 0..rows {
            assert_eq!(&s.q[r * 256..(r + 1) * 256], &q[r * cols + rank * 256..r * cols + (rank + 1) * 256]);
        }
        // The same values the f32 column shard gives.
        let f = w.f32_shard("c.weight", &[rows, cols], Some(Shard::new(1, rank, 2))).unwrap();
        assert_eq!(s.dequantize(), f);
        assert_eq!(f[0], full[rank * 256]);
        assert_eq!(s.scale_at(150, 130), scales[4 + 2 * rank + 1]);
        assert_eq!(fp8_e4m3_to_f32(s.q[150 * 256 + 130]) * s.scale_at(150, 130), f[150 * 256 + 130]);
    }
}

#[test]
fn same_tensor_compares_dtype_shape_and_bytes() {
    let v: Vec<f32> = (0..64).map(|i| i as f32 * 0.5).collect();
    let mut w2 = v.clone();
    w2[63] = -1.0;
    let mut t = BTreeMap::new();
    t.insert("a".to_string(), RawTensor::bf16(&[8, 8], &v));
    t.insert("b".to_string(), RawTensor::bf16(&[8, 8], &v));
    t.insert("c".to_string(), RawTensor::bf16(&[8, 8], &w2));
    t.insert("d".to_string(), RawTensor::bf16(&[4, 16], &v));
    t.insert("e".to_string(), RawTensor::f32(&[8, 8], &v));
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("a.safetensors"), &t).unwrap();
    // The same bytes in another file of a sharded checkpoint.
    let other: BTreeMap<String, RawTensor> = [("f".to_string(), RawTensor::bf16(&[8, 8], &v))].into();
    write_safetensors(&dir.path().join("b.safetensors"), &other).unwrap();
    let w = Weights::open(dir.path(), None).unwrap();
    assert!(w.same_tensor("a", "a").unwrap());
    assert!(w.same_tensor("a", "b").unwrap());
    assert!(w.same_tensor("a", "f").unwrap());
    assert!(!w.same_tensor("a", "c").unwrap(), "one value differs");
    assert!(!w.same_tensor("a", "d").unwrap(), "same bytes, other shape");
    assert!(!w.same_tensor("a", "e").unwrap(), "same values, other dtype");
    let e = w.same_tensor("a", "zz").unwrap_err().to_string();
    assert!(e.contains("`zz`"), "{e}");
}

#[test]
fn same_tensor_of_fp8_weights_compares_their_scales() {
    let q = vec![0x38u8; 128 * 128];
    let mut t = BTreeMap::new();
    for (n, s) in [("x", 1.0f32), ("y", 1.0), ("z", 2.0)] {
        t.insert(format!("{n}.weight"), RawTensor { shape: vec![128, 128], dtype: Dtype::F8_E4M3, data: q.clone() });
        t.insert(format!("{n}.weight_scale_inv"), RawTensor::f32(&[1, 1], &[s]));
    }
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join("model.safetensors"), &t).unwrap();
    let w = Weights::open(dir.path(), BLOCK).unwrap();
    assert!(w.same_tensor("x.weight", "y.weight").unwrap());
    assert!(!w.same_tensor("x.weight", "z.weight").unwrap(), "equal codes, other scales");
}

#[test]
fn progress_counts_each_tensor_once() {
    let (dir, _, _) = fp8_dir();
    let mut w = Weights::open(dir.path(), BLOCK).unwrap();
    let total = w.data_bytes();
    assert_eq!(total, 384 * 300 + 9 * 4 + 4 * 2);
    let p = Arc::new(LoadProgress::new("test", total));
    w.set_progress(p.clone());
    // A row shard counts the whole weight and its scales; reading them again adds nothing.
    w.fp8_shard("l.weight", [384, 300], Some(Shard::new(0, 2, 3))).unwrap();
    assert_eq!(p.snapshot().bytes_done, 384 * 300 + 36);
    w.f32("l.weight", &[384, 300]).unwrap();
    assert_eq!(p.snapshot().bytes_done, 384 * 300 + 36);
    w.f32("n.weight", &[4]).unwrap();
    let s = p.finish();
    assert_eq!((s.bytes_done, s.fraction()), (total, 1.0));
}

#[test]
fn a_corrupt_or_missing_shard_names_its_file() {
    let dir = tempfile::tempdir().unwrap();
    let a: BTreeMap<String, RawTensor> = [("x".to_string(), RawTensor::f32(&[2], &[1.0, 2.0]))].into();
    let b: BTreeMap<String, RawTensor> = [("y".to_string(), RawTensor::f32(&[64], &[3.0; 64]))].into();
    write_safetensors(&dir.path().join("model-00001-of-00002.safetensors"), &a).unwrap();
    let second = dir.path().join("model-00002-of-00002.safetensors");
    write_safetensors(&second, &b).unwrap();
    let idx = serde_json::json!({"metadata": {"total_size": 264}, "weight_map": {
        "x": "model-00001-of-00002.safetensors", "y": "model-00002-of-00002.safetensors"}});
    std::fs::write(dir.path().join("model.safetensors.index.json"), idx.to_string()).unwrap();
    Weights::open(dir.path(), None).unwrap();
    // Truncated second shard.
    let full = std::fs::read(&second).unwrap();
    std::fs::write(&second, &full[..full.len() - 4]).unwrap();
    let e = Weights::open(dir.path(), None).unwrap_err().to_string();
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("truncated"), "{e}");
    // Garbage header.
    std::fs::write(&second, b"\x10\0\0\0\0\0\0\0{not json at all}").unwrap();
    let e = Weights::open(dir.path(), None).unwrap_err().to_string();
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("corrupt"), "{e}");
    // Missing.
    std::fs::remove_file(&second).unwrap();
    let e = Weights::open(dir.path(), None).unwrap_err().to_string();
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}
