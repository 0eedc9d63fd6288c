//! Streams planned tensors into safetensors files, one band of rows at a time.
//!
//! A safetensors header lists every tensor's dtype, shape and byte range up front; the
//! plan knows them before any value is drawn, so each file's header is written first and
//! the data follows band by band (128 rows: one row of fp8 blocks). Memory stays at one
//! band, however large the checkpoint. fp8 weights get DeepSeek's block scales:
//! `s = amax(block) / 448` (1 for an all-zero block), `q = e4m3(w / s)`, and the scale
//! tensor is written right after its weight.

use super::plan::{value, Spec};
use crate::fp8::{f32_to_fp8_e4m3, E4M3_MAX};
use crate::names;
use crate::progress::LoadProgress;
use half::bf16;
use mlaserve_core::{Error, Result};
use rayon::prelude::*;
use safetensors::tensor::Dtype;
use serde_json::{json, Value};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Rows drawn at once: one row of 128 × 128 fp8 blocks.
const BAND: usize = 128;

/// A stored tensor of the plan: a weight, or an fp8 weight's scales.
#[derive(Debug, Clone)]
struct Entry {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
}

impl Entry {
    fn bytes(&self) -> u64 {
        let n: usize = self.shape.iter().product();
        (n * self.dtype.bitsize() / 8) as u64
    }
}

/// The stored tensors of one planned tensor.
fn entries(s: &Spec, block: [usize; 2]) -> Vec<Entry> {
    if s.fp8 {
        let sshape = vec![s.shape[0].div_ceil(block[0]), s.shape[1].div_ceil(block[1])];
        vec![
            Entry { name: s.name.clone(), dtype: Dtype::F8_E4M3, shape: s.shape.clone() },
            Entry { name: names::scale_of(&s.name), dtype: Dtype::F32, shape: sshape },
        ]
    } else {
        vec![Entry { name: s.name.clone(), dtype: Dtype::BF16, shape: s.shape.clone() }]
    }
}

/// How the tensors are spread over files.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Layout {
    /// One `model.safetensors`, no index.
    Single,
    /// Two files split after the first decoder layer (embedding and layer 0 | the rest),
    /// with an index: the tiny-v3 preset's historical layout.
    SplitAfterLayer0,
    /// `model-0000i-of-0000n.safetensors` of at most this many bytes each (a tensor
    /// larger than that gets a file of its own), with an index.
    MaxBytes(u64),
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    pub files: Vec<String>,
    /// Bytes of tensor data (the index's `metadata.total_size`).
    pub total_size: u64,
}

/// Groups `specs` into files, per `layout`.
fn assign(specs: &[Spec], layout: Layout, block: [usize; 2]) -> Vec<(String, Vec<&Spec>)> {
    match layout {
        Layout::Single => vec![("model.safetensors".into(), specs.iter().collect())],
        Layout::SplitAfterLayer0 => {
            let (a, b): (Vec<&Spec>, Vec<&Spec>) =
                specs.iter().partition(|s| s.name.starts_with("model.embed") || s.name.starts_with("model.layers.0."));
            let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
            names.iter().map(|n| n.to_string()).zip([a, b]).collect()
        }
        Layout::MaxBytes(max) => {
            let mut groups: Vec<Vec<&Spec>> = vec![Vec::new()];
            let mut size = 0u64;
            for s in specs {
                let b: u64 = entries(s, block).iter().map(Entry::bytes).sum();
                if size > 0 && size + b > max {
                    groups.push(Vec::new());
                    size = 0;
                }
                size += b;
                if let Some(g) = groups.last_mut() {
                    g.push(s);
                }
            }
            let n = groups.len();
            groups
                .into_iter()
                .enumerate()
                .map(|(i, g)| (format!("model-{:05}-of-{n:05}.safetensors", i + 1), g))
                .collect()
        }
    }
}

/// Writes `specs` into `out` per `layout`, drawing values from `seed`, ticking `progress`
/// with the bytes written; writes `model.safetensors.index.json` unless `Single`.
pub(crate) fn write_checkpoint(
    out: &Path,
    specs: &[Spec],
    seed: u64,
    block: [usize; 2],
    layout: Layout,
    progress: Option<&LoadProgress>,
) -> Result<Written> {
    let mut weight_map = serde_json::Map::new();
    let mut files = Vec::new();
    let mut total_size = 0u64;
    for (file, group) in assign(specs, layout, block) {
        let path = out.join(&file);
        let all: Vec<Entry> = group.iter().flat_map(|s| entries(s, block)).collect();
        let mut w = FileWriter::create(&path, &all)?;
        for s in &group {
            write_tensor(&mut w, s, seed, block, progress)?;
        }
        w.finish()?;
        for e in &all {
            weight_map.insert(e.name.clone(), json!(file));
            total_size += e.bytes();
        }
        files.push(file);
    }
    if !matches!(layout, Layout::Single) {
        let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
        super::write_json(&out.join("model.safetensors.index.json"), &index)?;
    }
    Ok(Written { files, total_size })
}

/// Draws tensor `s` band by band and appends it (and its scales) to `w`.
fn write_tensor(w: &mut FileWriter, s: &Spec, seed: u64, block: [usize; 2], p: Option<&LoadProgress>) -> Result<()> {
    let state = s.stream(seed);
    let cols = if s.shape.len() == 2 { s.shape[1] } else { s.numel() };
    let rows = s.numel() / cols.max(1);
    let mut scales = Vec::new();
    for r0 in (0..rows).step_by(BAND) {
        let r1 = (r0 + BAND).min(rows);
        let vals: Vec<f32> = (r0 * cols..r1 * cols).into_par_iter().map(|i| value(state, i, s.init)).collect();
        let bytes: Vec<u8> = if s.fp8 {
            let (q, sc) = quantize_band(&vals, cols, block[1]);
            scales.extend(sc);
            q
        } else {
            vals.par_iter().flat_map_iter(|v| bf16::from_f32(*v).to_le_bytes()).collect()
        };
        w.write(&bytes)?;
        if let Some(p) = p {
            p.add(bytes.len() as u64);
        }
    }
    if s.fp8 {
        debug_assert_eq!(block[0], BAND, "one band is one row of blocks");
        let bytes: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
        w.write(&bytes)?;
    }
    Ok(())
}

/// fp8 codes of one band (≤ 128 rows × `cols`) and its row of block scales.
fn quantize_band(vals: &[f32], cols: usize, bc: usize) -> (Vec<u8>, Vec<f32>) {
    let scales: Vec<f32> = (0..cols.div_ceil(bc))
        .map(|b| {
            let amax = vals
                .chunks(cols)
                .flat_map(|row| row[b * bc..((b + 1) * bc).min(cols)].iter())
                .fold(0f32, |m, v| m.max(v.abs()));
            if amax > 0.0 {
                amax / E4M3_MAX
            } else {
                1.0
            }
        })
        .collect();
    let q = vals.par_iter().enumerate().map(|(i, v)| f32_to_fp8_e4m3(v / scales[(i % cols) / bc])).collect();
    (q, scales)
}

/// One safetensors file being written: the header first, then the data in header order.
struct FileWriter {
    path: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    expect: u64,
    written: u64,
}

impl FileWriter {
    fn create(path: &Path, entries: &[Entry]) -> Result<Self> {
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut off = 0u64;
        for e in entries {
            let dtype = match e.dtype {
                Dtype::BF16 => "BF16",
                Dtype::F32 => "F32",
                Dtype::F8_E4M3 => "F8_E4M3",
                other => return Err(Error::tensor(&e.name, format!("cannot write dtype {other:?}"))),
            };
            header.insert(
                e.name.clone(),
                json!({"dtype": dtype, "shape": e.shape, "data_offsets": [off, off + e.bytes()]}),
            );
            off += e.bytes();
        }
        let mut text = Value::Object(header).to_string().into_bytes();
        // Pad with spaces to a multiple of 8, as safetensors does, so the data is aligned.
        text.resize(text.len().next_multiple_of(8), b' ');
        let err = |e: std::io::Error| Error::file(path, e.to_string());
        let file = std::fs::File::create(path).map_err(err)?;
        let mut out = std::io::BufWriter::with_capacity(8 << 20, file);
        out.write_all(&(text.len() as u64).to_le_bytes()).map_err(err)?;
        out.write_all(&text).map_err(err)?;
        Ok(FileWriter { path: path.to_path_buf(), out, expect: off, written: 0 })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        self.written += bytes.len() as u64;
        self.out.write_all(bytes).map_err(|e| Error::file(&self.path, e.to_string()))
    }

    fn finish(mut self) -> Result<()> {
        if self.written != self.expect {
            return Err(Error::file(
                &self.path,
                format!("wrote {} data bytes, the header promised {}", self.written, self.expect),
            ));
        }
        self.out.flush().map_err(|e| Error::file(&self.path, e.to_string()))
    }
}

/// Bytes of tensor data the plan will write (fp8 scales included).
pub(crate) fn planned_bytes(specs: &[Spec], block: [usize; 2]) -> u64 {
    specs.iter().flat_map(|s| entries(s, block)).map(|e| e.bytes()).sum()
}
