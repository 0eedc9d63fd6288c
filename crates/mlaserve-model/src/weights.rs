//! Memory-mapped safetensors weights: one file or a sharded set with
//! `model.safetensors.index.json`.
//!
//! Reads are typed and checked: a missing tensor, a wrong shape, an unsupported dtype, a
//! corrupt header or a truncated file is an error naming the tensor and the file. A
//! [`Shard`] hint makes a tensor-parallel rank read (and convert) only its slice. fp8 e4m3
//! weights are dequantised with their block `weight_scale_inv` at load.

use crate::names;
use half::{bf16, f16};
use memmap2::Mmap;
use mlaserve_core::config::Fp8Config;
use mlaserve_core::{Error, Result};
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// A tensor-parallel slice: split dimension `dim` into `world` equal parts, take part `rank`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub dim: usize,
    pub rank: usize,
    pub world: usize,
}

impl Shard {
    pub fn new(dim: usize, rank: usize, world: usize) -> Self {
        Shard { dim, rank, world }
    }
}

struct SafeFile {
    path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    meta: Metadata,
}

/// The weights of a checkpoint directory.
pub struct Weights {
    files: Vec<SafeFile>,
    /// Tensor name → index into `files`.
    index: HashMap<String, usize>,
    fp8: Option<Fp8Config>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weights").field("files", &self.files.len()).field("tensors", &self.index.len()).finish()
    }
}

impl Weights {
    /// Opens `dir/model.safetensors.index.json` if present, else every `*.safetensors`
    /// file in `dir`. `fp8` comes from the config's `quantization_config`. When `dir` has a
    /// `config.json`, the checkpoint must hold exactly the tensors it describes
    /// ([`crate::expected::check_tensors`]): an unused tensor is an error naming it.
    pub fn open(dir: &Path, fp8: Option<Fp8Config>) -> Result<Self> {
        let w = Self::open_unchecked(dir, fp8)?;
        if dir.join("config.json").is_file() {
            let cfg = crate::load_config(dir)?;
            crate::expected::check_tensors(&cfg, &w)?;
        }
        Ok(w)
    }

    /// [`Weights::open`] without comparing the tensors with `dir/config.json`.
    pub fn open_unchecked(dir: &Path, fp8: Option<Fp8Config>) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let paths: Vec<PathBuf> = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| Error::file(&index_path, e.to_string()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::file(&index_path, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::file(&index_path, "missing object `weight_map`"))?;
            if map.values().any(|f| !f.is_string()) {
                return Err(Error::file(&index_path, "`weight_map` values must be file names"));
            }
            let files: std::collections::BTreeSet<&str> = map.values().filter_map(|f| f.as_str()).collect();
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
                .map_err(|e| Error::file(dir, e.to_string()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect();
            found.sort();
            if found.is_empty() {
                return Err(Error::file(dir, "no *.safetensors files and no model.safetensors.index.json"));
            }
            found
        };
        Self::open_files(&paths, fp8)
    }

    /// Opens the given safetensors files.
    pub fn open_files(paths: &[PathBuf], fp8: Option<Fp8Config>) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for path in paths {
            let file = File::open(path).map_err(|e| Error::file(path, e.to_string()))?;
            // SAFETY: the file is opened read-only and we never hand out references that
            // outlive `Weights`; a concurrent truncation by another process is outside our
            // contract (as for every mmap-based loader).
            let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::file(path, format!("mmap failed: {e}")))?;
            let (header_len, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| {
                let what = match e {
                    safetensors::SafeTensorError::MetadataIncompleteBuffer => {
                        "truncated or padded: the header's offsets do not match the file size".to_string()
                    }
                    other => format!("corrupt safetensors header: {other}"),
                };
                Error::file(path, what)
            })?;
            let fi = files.len();
            for name in meta.tensors().keys() {
                if let Some(prev) = index.insert(name.clone(), fi) {
                    let prev: &SafeFile = &files[prev];
                    return Err(Error::tensor(
                        name,
                        format!("present in both {} and {}", prev.path.display(), path.display()),
                    ));
                }
            }
            files.push(SafeFile { path: path.clone(), mmap, header_len, meta });
        }
        Ok(Weights { files, index, fp8 })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// All tensor names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.index.keys().map(|s| s.as_str()).collect();
        v.sort();
        v
    }

    fn info(&self, name: &str) -> Result<(&SafeFile, &TensorInfo)> {
        let fi = *self.index.get(name).ok_or_else(|| Error::tensor(name, "missing from the checkpoint"))?;
        let f = &self.files[fi];
        let info = f.meta.info(name).ok_or_else(|| Error::tensor(name, "missing from the checkpoint"))?;
        Ok((f, info))
    }

    /// The tensor's dtype as stored.
    pub fn dtype(&self, name: &str) -> Result<Dtype> {
        Ok(self.info(name)?.1.dtype)
    }

    /// The file that holds tensor `name`.
    pub fn path_of(&self, name: &str) -> Option<&Path> {
        self.index.get(name).map(|&fi| self.files[fi].path.as_path())
    }

    /// The tensor's shape as stored.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.info(name)?.1.shape.clone())
    }

    /// Reads a whole tensor as f32, checking its shape.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        self.f32_shard(name, shape, None)
    }

    /// Reads `name` (whose full shape must be `shape`) as f32, only the slice `shard`
    /// selects when given.
    pub fn f32_shard(&self, name: &str, shape: &[usize], shard: Option<Shard>) -> Result<Vec<f32>> {
        let (file, info) = self.info(name)?;
        if info.shape != shape {
            return Err(Error::tensor(
                name,
                format!("shape {:?} in {}, expected {:?}", info.shape, file.path.display(), shape),
            ));
        }
        let sel = Selection::new(name, shape, shard)?;
        let start = 8 + file.header_len + info.data_offsets.0;
        let bytes = &file.mmap[start..8 + file.header_len + info.data_offsets.1];
        match info.dtype {
            Dtype::F32 => Ok(sel.map(|i| f32::from_le_bytes(le4(bytes, i)))),
            Dtype::BF16 => Ok(sel.map(|i| bf16::from_le_bytes(le2(bytes, i)).to_f32())),
            Dtype::F16 => Ok(sel.map(|i| f16::from_le_bytes(le2(bytes, i)).to_f32())),
            Dtype::F8_E4M3 => self.dequant_fp8(name, shape, bytes, &sel),
            other => Err(Error::tensor(
                name,
                format!(
                    "dtype {other:?} in {} is not supported (expected F32, BF16, F16 or F8_E4M3)",
                    file.path.display()
                ),
            )),
        }
    }

    fn dequant_fp8(&self, name: &str, shape: &[usize], bytes: &[u8], sel: &Selection) -> Result<Vec<f32>> {
        let block = self.fp8.map(|q| q.block).unwrap_or([128, 128]);
        if shape.len() != 2 {
            return Err(Error::tensor(name, format!("fp8 weight must be 2-D, got shape {shape:?}")));
        }
        let scale_name = names::scale_of(name);
        let sshape = [shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
        let scales = self.f32(&scale_name, &sshape).map_err(|e| match e {
            Error::Tensor { name: n, msg } => Error::tensor(n, format!("{msg} (block scales of fp8 weight `{name}`)")),
            other => other,
        })?;
        let cols = shape[1];
        Ok(sel.map(|i| {
            let (r, c) = (i / cols, i % cols);
            fp8_e4m3_to_f32(bytes[i]) * scales[(r / block[0]) * sshape[1] + c / block[1]]
        }))
    }
}

/// The flat element indices a shard selects, in row-major order of the slice.
struct Selection {
    outer: usize,
    inner: usize,
    dim_len: usize,
    lo: usize,
    hi: usize,
}

impl Selection {
    fn new(name: &str, shape: &[usize], shard: Option<Shard>) -> Result<Self> {
        let total: usize = shape.iter().product();
        let Some(s) = shard.filter(|s| s.world > 1) else {
            return Ok(Selection { outer: 1, inner: total, dim_len: 1, lo: 0, hi: 1 });
        };
        if s.dim >= shape.len() {
            return Err(Error::tensor(name, format!("shard dimension {} out of range for shape {shape:?}", s.dim)));
        }
        if s.rank >= s.world || !shape[s.dim].is_multiple_of(s.world) {
            return Err(Error::tensor(
                name,
                format!("dimension {} of shape {shape:?} does not split into {} equal shards", s.dim, s.world),
            ));
        }
        let part = shape[s.dim] / s.world;
        Ok(Selection {
            outer: shape[..s.dim].iter().product(),
            inner: shape[s.dim + 1..].iter().product(),
            dim_len: shape[s.dim],
            lo: s.rank * part,
            hi: (s.rank + 1) * part,
        })
    }

    fn map(&self, f: impl Fn(usize) -> f32) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.outer * (self.hi - self.lo) * self.inner);
        for o in 0..self.outer {
            let base = (o * self.dim_len + self.lo) * self.inner;
            let end = (o * self.dim_len + self.hi) * self.inner;
            out.extend((base..end).map(&f));
        }
        out
    }
}

fn le2(b: &[u8], i: usize) -> [u8; 2] {
    [b[2 * i], b[2 * i + 1]]
}

fn le4(b: &[u8], i: usize) -> [u8; 4] {
    [b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]
}

/// OCP fp8 e4m3 ("fn": no infinities, 0x7f/0xff are NaN) to f32.
pub fn fp8_e4m3_to_f32(x: u8) -> f32 {
    let sign = if x & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((x >> 3) & 0xf) as i32;
    let man = (x & 0x7) as f32;
    if exp == 0xf && (x & 0x7) == 0x7 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// Nearest fp8 e4m3 encoding of `v` (saturating at ±448); used by tests and presets.
pub fn f32_to_fp8_e4m3(v: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = f32::INFINITY;
    for b in 0..=255u8 {
        let f = fp8_e4m3_to_f32(b);
        if f.is_nan() {
            continue;
        }
        let e = (f - v).abs();
        if e < best_err {
            best_err = e;
            best = b;
        }
    }
    best
}

/// A tensor to write: name, shape, dtype and little-endian bytes.
#[derive(Debug, Clone)]
pub struct RawTensor {
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    pub data: Vec<u8>,
}

impl RawTensor {
    pub fn bf16(shape: &[usize], values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect();
        RawTensor { shape: shape.to_vec(), dtype: Dtype::BF16, data }
    }
    pub fn f32(shape: &[usize], values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        RawTensor { shape: shape.to_vec(), dtype: Dtype::F32, data }
    }
}

impl safetensors::View for &RawTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` to one safetensors file.
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, RawTensor>) -> Result<()> {
    let bytes = safetensors::serialize(tensors.iter().map(|(k, v)| (k.as_str(), v)), None)
        .map_err(|e| Error::file(path, format!("serialize: {e}")))?;
    std::fs::write(path, bytes).map_err(|e| Error::file(path, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp_with(tensors: &[(&str, RawTensor)]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let map: BTreeMap<String, RawTensor> = tensors.iter().map(|(n, t)| (n.to_string(), t.clone())).collect();
        write_safetensors(&path, &map).unwrap();
        (dir, path)
    }

    fn seq(n: usize) -> Vec<f32> {
        (0..n).map(|i| i as f32 * 0.25 - 3.0).collect()
    }

    #[test]
    fn reads_dtypes_and_shards() {
        let v = seq(24);
        let (dir, _) = tmp_with(&[("a", RawTensor::f32(&[4, 6], &v)), ("b", RawTensor::bf16(&[4, 6], &v))]);
        let w = Weights::open(dir.path(), None).unwrap();
        assert_eq!(w.f32("a", &[4, 6]).unwrap(), v);
        assert_eq!(w.f32("b", &[4, 6]).unwrap(), v); // quarter steps are exact in bf16
        let rows = w.f32_shard("a", &[4, 6], Some(Shard::new(0, 1, 2))).unwrap();
        assert_eq!(rows, v[12..].to_vec());
        let cols = w.f32_shard("a", &[4, 6], Some(Shard::new(1, 2, 3))).unwrap();
        let want: Vec<f32> = (0..4).flat_map(|r| v[r * 6 + 4..r * 6 + 6].to_vec()).collect();
        assert_eq!(cols, want);
        let e = w.f32_shard("a", &[4, 6], Some(Shard::new(1, 0, 4))).unwrap_err().to_string();
        assert!(e.contains("`a`") && e.contains("4 equal shards"), "{e}");
    }

    #[test]
    fn missing_wrong_shape_and_dtype_name_the_tensor() {
        let (dir, _) = tmp_with(&[
            ("a", RawTensor::f32(&[2, 3], &seq(6))),
            ("i", RawTensor { shape: vec![2], dtype: Dtype::I64, data: vec![0; 16] }),
        ]);
        let w = Weights::open(dir.path(), None).unwrap();
        let e = w.f32("nope", &[1]).unwrap_err().to_string();
        assert!(e.contains("`nope`") && e.contains("missing"), "{e}");
        let e = w.f32("a", &[3, 2]).unwrap_err().to_string();
        assert!(e.contains("`a`") && e.contains("[2, 3]") && e.contains("expected [3, 2]"), "{e}");
        let e = w.f32("i", &[2]).unwrap_err().to_string();
        assert!(e.contains("`i`") && e.contains("I64"), "{e}");
    }

    #[test]
    fn corrupt_and_truncated_files_name_the_file() {
        let (dir, path) = tmp_with(&[("a", RawTensor::f32(&[16], &seq(16)))]);
        let full = std::fs::read(&path).unwrap();
        std::fs::write(&path, &full[..full.len() - 5]).unwrap();
        let e = Weights::open(dir.path(), None).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
        let mut bad = full.clone();
        bad[8] = b'!';
        std::fs::write(&path, &bad).unwrap();
        let e = Weights::open(dir.path(), None).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("corrupt"), "{e}");
        std::fs::write(&path, [1u8, 2, 3]).unwrap();
        let e = Weights::open(dir.path(), None).unwrap_err().to_string();
        assert!(e.contains("model.safetensors") && e.contains("corrupt"), "{e}");
    }

    #[test]
    fn sharded_index() {
        let dir = tempfile::tempdir().unwrap();
        let a: BTreeMap<String, RawTensor> = [("x".to_string(), RawTensor::f32(&[2], &[1.0, 2.0]))].into();
        let b: BTreeMap<String, RawTensor> = [("y".to_string(), RawTensor::f32(&[1], &[3.0]))].into();
        write_safetensors(&dir.path().join("m-1.safetensors"), &a).unwrap();
        write_safetensors(&dir.path().join("m-2.safetensors"), &b).unwrap();
        let idx = serde_json::json!({"metadata": {}, "weight_map": {"x": "m-1.safetensors", "y": "m-2.safetensors"}});
        std::fs::write(dir.path().join("model.safetensors.index.json"), idx.to_string()).unwrap();
        let w = Weights::open(dir.path(), None).unwrap();
        assert_eq!(w.f32("y", &[1]).unwrap(), vec![3.0]);
        assert_eq!(w.names(), vec!["x", "y"]);
        let idx = serde_json::json!({"weight_map": {"x": "m-1.safetensors", "y": "gone.safetensors"}});
        std::fs::write(dir.path().join("model.safetensors.index.json"), idx.to_string()).unwrap();
        let e = Weights::open(dir.path(), None).unwrap_err().to_string();
        assert!(e.contains("gone.safetensors"), "{e}");
    }

    #[test]
    fn fp8_block_dequant() {
        for b in 0..=255u8 {
            let f = fp8_e4m3_to_f32(b);
            if !f.is_nan() {
                assert_eq!(f32_to_fp8_e4m3(f), if f == 0.0 { 0 } else { b }, "byte {b:#x} -> {f}");
            }
        }
        assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
        // A 200 x 300 weight in 128 x 128 blocks: scales are 2 x 3.
        let (rows, cols) = (200, 300);
        let scales = [0.5f32, 2.0, 0.25, 4.0, 1.0, 8.0];
        let q: Vec<u8> = (0..rows * cols).map(|i| f32_to_fp8_e4m3(((i % 17) as f32 - 8.0) * 0.5)).collect();
        let w8 = RawTensor { shape: vec![rows, cols], dtype: Dtype::F8_E4M3, data: q.clone() };
        let (dir, _) = tmp_with(&[("l.weight", w8), ("l.weight_scale_inv", RawTensor::f32(&[2, 3], &scales))]);
        let w = Weights::open(dir.path(), Some(Fp8Config { block: [128, 128] })).unwrap();
        let full = w.f32("l.weight", &[rows, cols]).unwrap();
        for (i, &v) in full.iter().enumerate() {
            let (r, c) = (i / cols, i % cols);
            assert_eq!(v, fp8_e4m3_to_f32(q[i]) * scales[(r / 128) * 3 + c / 128]);
        }
        // A column shard keeps the global block indices.
        let half = w.f32_shard("l.weight", &[rows, cols], Some(Shard::new(1, 1, 2))).unwrap();
        assert_eq!(half[0], full[150]);
        assert_eq!(half[150 * 2 + 149], full[2 * cols + 299]);
        // Missing scales are named.
        let w8 = RawTensor { shape: vec![4, 4], dtype: Dtype::F8_E4M3, data: vec![0x38; 16] };
        let (dir, _) = tmp_with(&[("m.weight", w8)]);
        let w = Weights::open(dir.path(), None).unwrap();
        let e = w.f32("m.weight", &[4, 4]).unwrap_err().to_string();
        assert!(e.contains("m.weight_scale_inv") && e.contains("missing"), "{e}");
    }
}
