//! Memory-mapped safetensors weights: one file or a sharded set with
//! `model.safetensors.index.json`.
//!
//! Reads are typed and checked: a missing tensor, a wrong shape, an unsupported dtype, a
//! corrupt header or a truncated file is an error naming the tensor and the file. A
//! [`Shard`] hint makes a tensor-parallel rank read (and convert) only its slice. fp8 e4m3
//! weights are read raw (codes and block scales, borrowed from the map where contiguous:
//! [`Weights::fp8_shard`]) for backends that compute in fp8, or dequantised with their
//! block `weight_scale_inv` by [`Weights::f32_shard`]. [`Weights::same_tensor`] tells a
//! backend when two names hold the same values, so it keeps one copy.

pub use crate::fp8::{f32_to_fp8_e4m3, fp8_e4m3_to_f32, Fp8Tensor};
use crate::names;
use crate::progress::LoadProgress;
use half::{bf16, f16};
use memmap2::Mmap;
use mlaserve_core::config::Fp8Config;
use mlaserve_core::{Error, Result};
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

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

impl SafeFile {
    /// A tensor's stored bytes (offsets were checked against the file size at open).
    fn data(&self, info: &TensorInfo) -> &[u8] {
        &self.mmap[8 + self.header_len + info.data_offsets.0..8 + self.header_len + info.data_offsets.1]
    }
}

/// A tensor as stored: dtype, shape and little-endian bytes borrowed from the memory map.
#[derive(Debug, Clone, Copy)]
pub struct RawView<'a> {
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// `a == b`, compared on several threads when large (a V3 embedding copy is 1.85 GB; one
/// thread compares at memory speed of one core).
fn equal_bytes(a: &[u8], b: &[u8]) -> bool {
    const PER_THREAD: usize = 64 << 20;
    if a.len() != b.len() {
        return false;
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(a.len().div_ceil(PER_THREAD)).max(1);
    if threads == 1 {
        return a == b;
    }
    let per = a.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = a.chunks(per).zip(b.chunks(per)).map(|(x, y)| s.spawn(move || x == y)).collect();
        parts.into_iter().all(|h| h.join().unwrap_or(false))
    })
}

/// The weights of a checkpoint directory.
pub struct Weights {
    files: Vec<SafeFile>,
    /// Tensor name → index into `files`.
    index: HashMap<String, usize>,
    fp8: Option<Fp8Config>,
    /// Ticked once per tensor the first time it is read (see [`Weights::set_progress`]).
    progress: Option<Arc<LoadProgress>>,
    counted: Mutex<HashSet<String>>,
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
        Ok(Weights { files, index, fp8, progress: None, counted: Mutex::new(HashSet::new()) })
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

    /// Whether tensor `name` is stored as fp8 e4m3 (false when it is missing).
    pub fn is_fp8(&self, name: &str) -> bool {
        self.dtype(name).is_ok_and(|d| d == Dtype::F8_E4M3)
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
        let bytes = file.data(info);
        self.tick(name, bytes.len());
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

    /// The fp8 block shape: the config's, else DeepSeek's 128 × 128.
    pub fn fp8_block(&self) -> [usize; 2] {
        self.fp8.map(|q| q.block).unwrap_or([128, 128])
    }

    /// The full block-scale matrix of fp8 weight `name` (shape `[out, inp]`).
    fn block_scales(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let block = self.fp8_block();
        let scale_name = names::scale_of(name);
        let sshape = [shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
        self.f32(&scale_name, &sshape).map_err(|e| match e {
            Error::Tensor { name: n, msg } => Error::tensor(n, format!("{msg} (block scales of fp8 weight `{name}`)")),
            other => other,
        })
    }

    /// Tensor `name` as stored, borrowed from the memory map (no conversion, no copy).
    pub fn raw(&self, name: &str) -> Result<RawView<'_>> {
        let (file, info) = self.info(name)?;
        Ok(RawView { dtype: info.dtype, shape: &info.shape, data: file.data(info) })
    }

    /// The safetensors files this checkpoint reads (the index's, or the directory's).
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// Sum of the stored sizes of all tensors, in bytes.
    pub fn data_bytes(&self) -> u64 {
        self.files
            .iter()
            .flat_map(|f| f.meta.tensors().into_values())
            .map(|i| (i.data_offsets.1 - i.data_offsets.0) as u64)
            .sum()
    }

    /// Asks the OS to read every tensor whose name starts with `prefix` into the page
    /// cache, without waiting (`madvise(MADV_WILLNEED)` on their ranges of the maps): a
    /// loader that prefetches the next layer while it uploads this one keeps disk reads
    /// of several files in flight. Returns the bytes asked for; advice the OS refuses is
    /// ignored (the reads then happen on first touch, as without it).
    pub fn prefetch(&self, prefix: &str) -> u64 {
        let mut asked = 0u64;
        for f in &self.files {
            for (name, info) in f.meta.tensors() {
                if !name.starts_with(prefix) {
                    continue;
                }
                let (lo, hi) = (8 + f.header_len + info.data_offsets.0, 8 + f.header_len + info.data_offsets.1);
                // memmap2 widens the range to whole pages itself.
                if f.mmap.advise_range(memmap2::Advice::WillNeed, lo, hi - lo).is_ok() {
                    asked += (hi - lo) as u64;
                }
            }
        }
        asked
    }

    /// Ticks `progress` with each tensor's stored size the first time any part of it is
    /// read ([`Weights::f32_shard`], [`Weights::fp8_shard`]): the progress then measures how
    /// far the loader is through the checkpoint, and reaches [`Weights::data_bytes`] once
    /// every tensor has been read, whatever the tensor-parallel slices.
    pub fn set_progress(&mut self, progress: Arc<LoadProgress>) {
        self.progress = Some(progress);
    }

    /// Counts tensor `name` as read for the progress (a caller that read it through
    /// [`Weights::raw`]); unknown names are ignored.
    pub fn count_read(&self, name: &str) {
        if let Ok((file, info)) = self.info(name) {
            self.tick(name, file.data(info).len());
        }
    }

    fn tick(&self, name: &str, bytes: usize) {
        let Some(p) = &self.progress else { return };
        let first = self.counted.lock().map(|mut c| c.insert(name.to_string())).unwrap_or(false);
        if first {
            p.add(bytes as u64);
        }
    }

    /// Reads fp8 weight `name` (full shape `[out, inp]`) and its block scales without
    /// dequantising, only the slice `shard` selects when given: rows (`dim` 0) or columns
    /// (`dim` 1) with the scale rows or columns that cover them. A shard boundary must
    /// fall on a block boundary (else the rank's scales would be shared with its
    /// neighbour's rows): the error names the tensor. The whole tensor and row shards
    /// borrow the memory map; a column shard copies its rows' slices.
    pub fn fp8_shard(&self, name: &str, shape: [usize; 2], shard: Option<Shard>) -> Result<Fp8Tensor<'_>> {
        let (file, info) = self.info(name)?;
        if info.dtype != Dtype::F8_E4M3 {
            return Err(Error::tensor(
                name,
                format!("dtype {:?} in {}, expected F8_E4M3 (an fp8 weight)", info.dtype, file.path.display()),
            ));
        }
        if info.shape != shape {
            return Err(Error::tensor(
                name,
                format!("shape {:?} in {}, expected {:?}", info.shape, file.path.display(), shape),
            ));
        }
        let block = self.fp8_block();
        let scales = self.block_scales(name, &shape)?;
        let bytes = file.data(info);
        self.tick(name, bytes.len());
        let [out, inp] = shape;
        let whole = Fp8Tensor { q: Cow::Borrowed(bytes), scales, out, inp, block };
        let Some(s) = shard.filter(|s| s.world > 1) else { return Ok(whole) };
        if s.dim > 1 {
            return Err(Error::tensor(name, format!("shard dimension {} out of range for shape {shape:?}", s.dim)));
        }
        let len = shape[s.dim];
        if s.rank >= s.world || !len.is_multiple_of(s.world) {
            return Err(Error::tensor(
                name,
                format!("dimension {} of shape {shape:?} does not split into {} equal shards", s.dim, s.world),
            ));
        }
        let part = len / s.world;
        if !part.is_multiple_of(block[s.dim]) {
            return Err(Error::tensor(
                name,
                format!(
                    "a {}-way shard of dimension {} (shape {shape:?}) is {part} wide, not a multiple of the fp8 \
                     block {}: shard boundaries must fall on block boundaries",
                    s.world, s.dim, block[s.dim]
                ),
            ));
        }
        let (lo, hi) = (s.rank * part, (s.rank + 1) * part);
        let (sr, sc) = (whole.scale_rows(), whole.scale_cols());
        let (blo, bhi) = (lo / block[s.dim], hi.div_ceil(block[s.dim]));
        Ok(if s.dim == 0 {
            let scales = whole.scales[blo * sc..bhi * sc].to_vec();
            Fp8Tensor { q: Cow::Borrowed(&bytes[lo * inp..hi * inp]), scales, out: part, inp, block }
        } else {
            let q: Vec<u8> = (0..out).flat_map(|r| bytes[r * inp + lo..r * inp + hi].iter().copied()).collect();
            let scales = (0..sr).flat_map(|r| whole.scales[r * sc + blo..r * sc + bhi].iter().copied()).collect();
            Fp8Tensor { q: Cow::Owned(q), scales, out, inp: part, block }
        })
    }

    /// Whether tensors `a` and `b` hold the same values: same dtype, same shape and equal
    /// stored bytes (an fp8 weight's block scales too). Both must exist. Two names for one
    /// stored range answer at once; otherwise the bytes are compared in the memory maps
    /// (no copy), after the cheap dtype and shape checks. A backend keeps one copy of
    /// tensors that are the same (the MTP layer's embedding and head, for instance).
    pub fn same_tensor(&self, a: &str, b: &str) -> Result<bool> {
        let (fa, ia) = self.info(a)?;
        let (fb, ib) = self.info(b)?;
        if std::ptr::eq(fa, fb) && ia.data_offsets == ib.data_offsets && ia.dtype == ib.dtype && ia.shape == ib.shape {
            return Ok(true);
        }
        if ia.dtype != ib.dtype || ia.shape != ib.shape {
            return Ok(false);
        }
        // Comparing reads both: a backend that keeps one copy has still gone through both.
        self.tick(a, fa.data(ia).len());
        self.tick(b, fb.data(ib).len());
        if !equal_bytes(fa.data(ia), fb.data(ib)) {
            return Ok(false);
        }
        if ia.dtype == Dtype::F8_E4M3 {
            let (sa, sb) = (names::scale_of(a), names::scale_of(b));
            return match (self.contains(&sa), self.contains(&sb)) {
                (true, true) => self.same_tensor(&sa, &sb),
                (false, false) => Ok(true),
                _ => Ok(false),
            };
        }
        Ok(true)
    }

    fn dequant_fp8(&self, name: &str, shape: &[usize], bytes: &[u8], sel: &Selection) -> Result<Vec<f32>> {
        let block = self.fp8_block();
        if shape.len() != 2 {
            return Err(Error::tensor(name, format!("fp8 weight must be 2-D, got shape {shape:?}")));
        }
        let scales = self.block_scales(name, shape)?;
        let sshape = [shape[0].div_ceil(block[0]), shape[1].div_ceil(block[1])];
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
        // (The codec itself is tested exhaustively in `fp8`.)
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
