//! The expanded-form (non-absorbed) MLA attention of prefill and chunked-prefill chunks
//! (docs/cuda.md, "MLA prefill"): the host planning of a call (always built, unit-tested on the CPU) and,
//! with `cuda`, [`MlaPrefill`], the typed wrappers of `kernels/mla_prefill.cu`.
//!
//! For the sequences that take this path, the cached latents of positions `0..k_len` (the
//! cached prefix and the chunk just written) are gathered from the paged cache into
//! contiguous rows and up-projected once per step by two GEMMs over all heads
//! (`K_nope = c_kv · W_UKᵀ`, `V = c_kv · W_UVᵀ`); a flash-attention kernel (wgmma on
//! Hopper, else mma.sync; online softmax, causal with the queries at the end of the keys)
//! then writes each query row's `[heads][v_head_dim]` output straight into `o_proj`'s
//! input. Per (query, key, head) it costs `2·(qk + v)` FLOPs (640 at DeepSeek-V3's
//! 192 + 128) instead of the absorbed form's `2·(576 + 512)`, plus the up-projection once
//! per key: cheaper as soon as a sequence brings more than a few query rows, which is why
//! decode windows keep the absorbed form (vLLM and SGLang split the same way).
//!
//! A row's result depends only on its own sequence (no split over keys), so the kernel is
//! batch-invariant; the K/V up-projection is too when the GEMM is
//! ([`crate::linear::GemmMode::BatchInvariant`]).

/// Query rows per CTA of the attention kernel (one head each).
pub const TILE_ROWS: usize = 64;
/// Query rows per CTA of the warpgroup-MMA kernel (two warpgroups of 64).
pub const WG_TILE_ROWS: usize = 128;
/// Keys per pipeline tile of the attention kernel.
pub const KEY_TILE: usize = 64;
/// Ints per sequence descriptor on the device (`kernels/mla_prefill.cu`'s `SEQ_FIELDS`):
/// first output row, query rows, first key row, keys, block-table row.
pub const SEQ_FIELDS: usize = 5;

/// Dynamic shared memory of the instance with padded widths `(qk, v)`: the Q tile and two
/// stages of K and V tiles, bf16.
pub fn smem_bytes(qk: usize, v: usize) -> usize {
    TILE_ROWS * qk * 2 + 2 * KEY_TILE * (qk + v) * 2
}

/// The warpgroup-MMA instance's dynamic shared memory: the Q tile of 128 rows, three
/// stages of K and V tiles, 1024 bytes of alignment slack and 64 for the TMA variant's
/// barriers.
pub fn smem_bytes_wg(qk: usize, v: usize) -> usize {
    1024 + WG_TILE_ROWS * qk * 2 + 3 * KEY_TILE * (qk + v) * 2 + 64
}

pub use crate::dims::{PrefillDims, PrefillSeq};

/// Which attention kernel an expanded-form call runs. They agree to rounding, not in
/// bits: keep one kernel for the runs whose outputs are compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillKernel {
    /// mma.sync (every GPU; what the others resolve to without wgmma).
    MmaSync,
    /// Hopper's warpgroup MMA (`mla_prefill_wg_*`), K/V tiles by cp.async.
    Wgmma,
    /// The same with the K/V tiles by TMA (`mla_prefill_wgt_qk192_v128`) where the head
    /// widths are DeepSeek's exactly (nope 128, rope 64, v 128); `Wgmma` elsewhere. The
    /// default.
    #[default]
    WgmmaTma,
}

impl PrefillKernel {
    /// Every choice, as [`PrefillKernel::name`] spells it.
    pub const ALL: [PrefillKernel; 3] = [PrefillKernel::MmaSync, PrefillKernel::Wgmma, PrefillKernel::WgmmaTma];

    pub fn name(self) -> &'static str {
        match self {
            PrefillKernel::MmaSync => "mma.sync",
            PrefillKernel::Wgmma => "wgmma",
            PrefillKernel::WgmmaTma => "tma",
        }
    }

    /// The choice called `name` (as [`PrefillKernel::name`] spells it).
    pub fn from_name(name: &str) -> Option<PrefillKernel> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// Visible (query, key) pairs of a call: `Σ_j Σ_i (k_len − q_len + i + 1)`, the honest
/// causal count (no tile padding).
pub fn causal_pairs(seqs: &[PrefillSeq]) -> u64 {
    seqs.iter()
        .map(|s| {
            let (q, base) = (s.q_len as u64, (s.k_len - s.q_len) as u64);
            q * base + q * (q + 1) / 2
        })
        .sum()
}

/// FLOPs of the attention kernel over `seqs`: `2·(qk + v)` per visible (query, key, head).
pub fn flops(seqs: &[PrefillSeq], d: &PrefillDims) -> f64 {
    causal_pairs(seqs) as f64 * d.heads as f64 * 2.0 * (d.qk() + d.vdim) as f64
}

/// The attention kernel's CTA list (times the heads): `[sequence, first query]` per
/// tile of `rows` queries, the tiles with the most keys first so that the longest CTAs do
/// not start last (causal work grows with the query's position).
pub fn tile_list(seqs: &[PrefillSeq], rows: usize) -> Vec<[usize; 2]> {
    let mut t: Vec<(usize, usize, usize)> = Vec::new();
    for (j, s) in seqs.iter().enumerate() {
        for i0 in (0..s.q_len).step_by(rows) {
            let last = (i0 + rows).min(s.q_len) - 1;
            t.push((s.k_len - s.q_len + last + 1, j, i0));
        }
    }
    t.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    t.into_iter().map(|(_, j, i0)| [j, i0]).collect()
}

/// Checks a call's sequences: at least one query each, no more queries than keys.
pub fn check_seqs(seqs: &[PrefillSeq]) -> Result<(), String> {
    for (j, s) in seqs.iter().enumerate() {
        if s.q_len == 0 || s.k_len < s.q_len {
            return Err(format!("sequence {j}: {} queries over {} keys", s.q_len, s.k_len));
        }
    }
    Ok(())
}

#[cfg(feature = "cuda")]
pub use device::{LatentCache, MlaPrefill, PrefillBuffers, PrefillPlan};

#[cfg(feature = "cuda")]
mod device {
    use std::sync::Arc;

    use cudarc::driver::sys::CUfunction_attribute;
    use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
    use half::bf16;

    use super::{
        check_seqs, smem_bytes, smem_bytes_wg, tile_list, PrefillDims, PrefillKernel, PrefillSeq, SEQ_FIELDS,
        TILE_ROWS, WG_TILE_ROWS,
    };
    use crate::error::{CudaError, Result};
    use crate::gpu::Gpu;
    use crate::kernels;
    use crate::launch::need;
    use crate::linear::{Gemm, Linear};
    use crate::plan::PAGE;
    use crate::rope::RopeTables;
    use crate::tensor_map::bf16_tensor_map;

    const K: &str = "mla_prefill";

    fn i32_of(v: usize) -> Result<i32> {
        crate::launch::i32_of(K, v)
    }

    /// A call's sequences, on the host and as the kernels' descriptors on the device
    /// (uploaded once, when the step's metadata is: see `Step::logit_rows` on why no
    /// upload may follow a collective).
    #[derive(Debug)]
    pub struct PrefillPlan {
        seqs: Vec<PrefillSeq>,
        k_offs: Vec<usize>,
        keys: usize,
        rows_end: usize,
        max_k_len: usize,
        max_table_row: usize,
        num_tiles: usize,
        num_tiles_wg: usize,
        d_seqs: CudaSlice<i32>,
        /// 64-row tiles (the mma.sync kernel), then 128-row tiles (the wgmma one).
        d_tiles: CudaSlice<i32>,
    }

    impl PrefillPlan {
        /// Plans a call over `seqs` (at least one) and uploads the descriptors.
        pub fn new(s: &Arc<CudaStream>, seqs: &[PrefillSeq]) -> Result<Self> {
            if seqs.is_empty() {
                return Err(CudaError::shape(K, "a call needs at least one sequence"));
            }
            check_seqs(seqs).map_err(|m| CudaError::shape(K, m))?;
            let mut k_offs = Vec::with_capacity(seqs.len());
            let mut desc = Vec::with_capacity(seqs.len() * SEQ_FIELDS);
            let mut keys = 0usize;
            for sq in seqs {
                k_offs.push(keys);
                for v in [sq.q_row0, sq.q_len, keys, sq.k_len, sq.table_row] {
                    desc.push(i32_of(v)?);
                }
                keys += sq.k_len;
            }
            i32_of(keys)?;
            let rows_end = seqs.iter().map(|q| q.q_row0 + q.q_len).max().unwrap_or(0);
            i32_of(rows_end)?;
            let (tiles, tiles_wg) = (tile_list(seqs, TILE_ROWS), tile_list(seqs, WG_TILE_ROWS));
            let flat: Vec<i32> = tiles.iter().chain(&tiles_wg).flat_map(|t| [t[0] as i32, t[1] as i32]).collect();
            Ok(PrefillPlan {
                seqs: seqs.to_vec(),
                k_offs,
                keys,
                rows_end,
                max_k_len: seqs.iter().map(|q| q.k_len).max().unwrap_or(0),
                max_table_row: seqs.iter().map(|q| q.table_row).max().unwrap_or(0),
                num_tiles: tiles.len(),
                num_tiles_wg: tiles_wg.len(),
                d_seqs: s.clone_htod(&desc)?,
                d_tiles: s.clone_htod(&flat)?,
            })
        }

        pub fn seqs(&self) -> &[PrefillSeq] {
            &self.seqs
        }

        /// Keys of every sequence together (rows of the gathered latents and of K, V).
        pub fn keys(&self) -> usize {
            self.keys
        }

        /// Row of sequence `j`'s first key in the gathered buffers.
        pub fn key_offset(&self, j: usize) -> usize {
            self.k_offs[j]
        }

        /// One past the last query row (what the query and output buffers must hold).
        pub fn rows_end(&self) -> usize {
            self.rows_end
        }
    }

    /// The paged latent cache of one layer, as the gather reads it.
    #[derive(Debug, Clone, Copy)]
    pub struct LatentCache<'a> {
        /// `[num_blocks][64][lora + rope]` bf16, or with `fp8` entries of the fp8 layout
        /// (`kernels/kv_fp8.cuh`) in as many bytes.
        pub data: &'a CudaSlice<bf16>,
        pub fp8: bool,
        /// `[table rows][bt_stride]` page ids.
        pub tables: &'a CudaSlice<i32>,
        pub bt_stride: usize,
        pub num_blocks: usize,
        pub lora: usize,
        pub rope: usize,
    }

    /// The gathered latents and the up-projected K, V of one call.
    #[derive(Debug)]
    pub struct PrefillBuffers {
        /// `[keys][lora]`.
        pub ckv: CudaSlice<bf16>,
        /// `[keys][rope]`.
        pub kpe: CudaSlice<bf16>,
        /// `[keys][heads][nope]`.
        pub kn: CudaSlice<bf16>,
        /// `[keys][heads][vdim]`.
        pub v: CudaSlice<bf16>,
    }

    /// The warpgroup-MMA instances of the attention kernel (sm_90 only).
    #[derive(Debug)]
    struct WgKernels {
        small: CudaFunction,
        large: CudaFunction,
        large_tma: CudaFunction,
    }

    /// The loaded functions of `mla_prefill.cu`.
    #[derive(Debug)]
    pub struct MlaPrefill {
        fwd_small: CudaFunction,
        fwd_large: CudaFunction,
        fwd_wg: Option<WgKernels>,
        gather: CudaFunction,
        gather_fp8: CudaFunction,
        scatter: CudaFunction,
        max_smem: usize,
        /// The attention kernel: the one asked for where the GPU has wgmma, else mma.sync.
        pub kernel: PrefillKernel,
    }

    impl MlaPrefill {
        /// Loads the kernels; `kernel` is the attention kernel to run (mma.sync where the
        /// GPU has no wgmma).
        pub fn new(gpu: &Gpu, kernel: PrefillKernel) -> Result<Self> {
            let m = gpu.load_module(kernels::MLA_PREFILL)?;
            let fwd_large = m.load_function("mla_prefill_fwd_qk192_v128")?;
            let large = smem_bytes(192, 128);
            if large <= gpu.max_smem_optin {
                fwd_large.set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    large as i32,
                )?;
            }
            let fwd_wg = if gpu.compute_capability == (9, 0) {
                let f = |name: &str, qk: usize, v: usize| -> Result<CudaFunction> {
                    let f = m.load_function(name)?;
                    f.set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem_bytes_wg(qk, v) as i32,
                    )?;
                    Ok(f)
                };
                Some(WgKernels {
                    small: f("mla_prefill_wg_qk64_v64", 64, 64)?,
                    large: f("mla_prefill_wg_qk192_v128", 192, 128)?,
                    large_tma: f("mla_prefill_wgt_qk192_v128", 192, 128)?,
                })
            } else {
                None
            };
            let kernel = if fwd_wg.is_some() { kernel } else { PrefillKernel::MmaSync };
            Ok(MlaPrefill {
                fwd_small: m.load_function("mla_prefill_fwd_qk64_v64")?,
                fwd_large,
                fwd_wg,
                gather: m.load_function("mla_prefill_gather_bf16")?,
                gather_fp8: m.load_function("mla_prefill_gather_fp8")?,
                scatter: m.load_function("scatter_rows_bf16")?,
                max_smem: gpu.max_smem_optin,
                kernel,
            })
        }

        /// Buffers for `plan`'s gathered latents and K, V.
        pub fn buffers(
            &self,
            s: &Arc<CudaStream>,
            plan: &PrefillPlan,
            d: &PrefillDims,
            lora: usize,
        ) -> Result<PrefillBuffers> {
            let t = plan.keys;
            Ok(PrefillBuffers {
                ckv: s.alloc_zeros(t * lora)?,
                kpe: s.alloc_zeros(t * d.rope)?,
                kn: s.alloc_zeros(t * d.heads * d.nope)?,
                v: s.alloc_zeros(t * d.heads * d.vdim)?,
            })
        }

        /// The whole expanded form for `plan`'s sequences: gather their latents, up-project
        /// K and V, attend; `o` (`[rows][heads][vdim]` bf16) gets their query rows only.
        #[allow(clippy::too_many_arguments)]
        pub fn forward(
            &self,
            s: &Arc<CudaStream>,
            gemm: &Gemm,
            (w_uk, w_uv): (&Linear, &Linear),
            plan: &PrefillPlan,
            d: &PrefillDims,
            scale: f32,
            q: &impl DevicePtr<f32>,
            cache: &LatentCache,
            rope: &RopeTables,
            o: &mut impl DevicePtrMut<bf16>,
        ) -> Result<()> {
            let mut b = self.buffers(s, plan, d, cache.lora)?;
            self.expand(s, gemm, (w_uk, w_uv), plan, d, cache, &mut b)?;
            self.attention(s, plan, d, scale, q, &b.kn, &b.kpe, &b.v, rope, o)
        }

        /// Gathers `plan`'s latents into `b.ckv`, `b.kpe` and up-projects `b.kn`, `b.v`
        /// (`W_UK` as a `[heads·nope][lora]` projection, `W_UV` as `[heads·vdim][lora]`).
        #[allow(clippy::too_many_arguments)]
        pub fn expand(
            &self,
            s: &Arc<CudaStream>,
            gemm: &Gemm,
            (w_uk, w_uv): (&Linear, &Linear),
            plan: &PrefillPlan,
            d: &PrefillDims,
            cache: &LatentCache,
            b: &mut PrefillBuffers,
        ) -> Result<()> {
            let lora = cache.lora;
            if (w_uk.out, w_uk.inp) != (d.heads * d.nope, lora) || (w_uv.out, w_uv.inp) != (d.heads * d.vdim, lora) {
                return Err(CudaError::shape(
                    K,
                    format!(
                        "W_UK [{}, {}] / W_UV [{}, {}] do not fit {d:?} with lora {lora}",
                        w_uk.out, w_uk.inp, w_uv.out, w_uv.inp
                    ),
                ));
            }
            if cache.rope != d.rope {
                return Err(CudaError::shape(K, format!("cache rope {} != {}", cache.rope, d.rope)));
            }
            self.gather(s, plan, cache, &mut b.ckv, &mut b.kpe)?;
            gemm.forward(s, w_uk, &b.ckv, plan.keys, &mut b.kn)?;
            gemm.forward(s, w_uv, &b.ckv, plan.keys, &mut b.v)
        }

        /// Copies `plan`'s cached latents (positions `0..k_len` of each sequence, through its
        /// block-table row) into `ckv` (`[keys][lora]`) and `kpe` (`[keys][rope]`).
        pub fn gather(
            &self,
            s: &Arc<CudaStream>,
            plan: &PrefillPlan,
            c: &LatentCache,
            ckv: &mut CudaSlice<bf16>,
            kpe: &mut CudaSlice<bf16>,
        ) -> Result<()> {
            const G: &str = "mla_prefill_gather";
            let lat = crate::layout::kv_entry_elems(c.fp8, c.lora, c.rope).map_err(|e| CudaError::shape(G, e))?;
            if !c.lora.is_multiple_of(8) || !c.rope.is_multiple_of(8) || c.num_blocks == 0 || c.bt_stride == 0 {
                return Err(CudaError::shape(
                    G,
                    format!("lora {} / rope {} / {} blocks", c.lora, c.rope, c.num_blocks),
                ));
            }
            need(G, "cache", c.data.len(), c.num_blocks * PAGE * lat)?;
            need(G, "tables", c.tables.len(), (plan.max_table_row + 1) * c.bt_stride)?;
            need(G, "ckv", ckv.len(), plan.keys * c.lora)?;
            need(G, "kpe", kpe.len(), plan.keys * c.rope)?;
            if plan.max_k_len > c.bt_stride * PAGE {
                return Err(CudaError::shape(G, "a sequence's keys lie past its block table"));
            }
            let (nseq, keys) = (i32_of(plan.seqs.len())?, i32_of(plan.keys)?);
            let (bt, nb, lo, ro) = (i32_of(c.bt_stride)?, i32_of(c.num_blocks)?, i32_of(c.lora)?, i32_of(c.rope)?);
            let cfg = LaunchConfig {
                grid_dim: (plan.keys.div_ceil(4) as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: warp t < keys finds its sequence among the nseq descriptors (sorted
            // key offsets, first 0), reads its table row (< max_table_row + 1 rows of
            // bt_stride, the entry index clamped below bt_stride) and the cache row of that
            // page (clamped below num_blocks; the cache holds num_blocks*64*lat), and writes
            // ckv[t*lora..][..lora], kpe[t*rope..][..rope]; lengths checked above, 16-byte
            // accesses aligned since lora and rope are multiples of 8 (the fp8 gather reads
            // an entry's bytes one channel at a time, entries of `lat` elements' bytes).
            unsafe {
                s.launch_builder(if c.fp8 { &self.gather_fp8 } else { &self.gather })
                    .arg(&mut *ckv)
                    .arg(&mut *kpe)
                    .arg(c.data)
                    .arg(c.tables)
                    .arg(&plan.d_seqs)
                    .arg(&nseq)
                    .arg(&keys)
                    .arg(&bt)
                    .arg(&nb)
                    .arg(&lo)
                    .arg(&ro)
                    .launch(cfg)
            }?;
            Ok(())
        }

        /// The attention kernel: for `plan`'s sequences, `o[q_row0 + i][h] = softmax(scale ·
        /// [q_nope | RoPE(q_pe)] · [k_nope | k_pe]ᵀ) · V` over keys `0..=position`, with `q`
        /// the q_b projection's output (`[rows][heads][nope + rope]` f32, q_pe not yet
        /// rotated; RoPE from `rope` at the query's position), `kn` `[keys][heads][nope]`,
        /// `kpe` `[keys][rope]`, `v` `[keys][heads][vdim]`, all bf16. Rows of `o` outside
        /// the sequences' queries are not touched.
        #[allow(clippy::too_many_arguments)]
        pub fn attention(
            &self,
            s: &Arc<CudaStream>,
            plan: &PrefillPlan,
            d: &PrefillDims,
            scale: f32,
            q: &impl DevicePtr<f32>,
            kn: &impl DevicePtr<bf16>,
            kpe: &impl DevicePtr<bf16>,
            v: &impl DevicePtr<bf16>,
            rope: &RopeTables,
            o: &mut impl DevicePtrMut<bf16>,
        ) -> Result<()> {
            let Some((qk_pad, v_pad)) = d.instance() else {
                return Err(CudaError::shape(K, format!("no kernel instance takes {d:?}")));
            };
            let (h, t, rows) = (d.heads, plan.keys, plan.rows_end);
            if rope.dim != d.rope {
                return Err(CudaError::shape(K, format!("RoPE tables of width {} for rope {}", rope.dim, d.rope)));
            }
            need(K, "q", q.len(), rows * h * d.qk())?;
            need(K, "o", o.len(), rows * h * d.vdim)?;
            need(K, "kn", kn.len(), t * h * d.nope)?;
            need(K, "kpe", kpe.len(), t * d.rope)?;
            need(K, "v", v.len(), t * h * d.vdim)?;
            // Query positions are < max_k_len.
            need(K, "RoPE cos", rope.cos.len(), plan.max_k_len * d.rope / 2)?;
            need(K, "RoPE sin", rope.sin.len(), plan.max_k_len * d.rope / 2)?;
            if h > 65_535 {
                return Err(CudaError::shape(K, format!("{h} heads > 65535")));
            }
            // The TMA variant loads whole 64-dim boxes: DeepSeek's widths exactly.
            let tma_dims = (d.nope, d.rope, d.vdim) == (128, 64, 128);
            let (wg, tma) = match (self.kernel, &self.fwd_wg) {
                (PrefillKernel::WgmmaTma, Some(k)) if tma_dims => (Some(&k.large_tma), true),
                (PrefillKernel::Wgmma | PrefillKernel::WgmmaTma, Some(k)) => {
                    (Some(if qk_pad == 64 { &k.small } else { &k.large }), false)
                }
                (PrefillKernel::Wgmma | PrefillKernel::WgmmaTma, None) => {
                    return Err(CudaError::shape(K, "the wgmma prefill kernels need an sm_90 GPU"));
                }
                (PrefillKernel::MmaSync, _) => (None, false),
            };
            let smem = if wg.is_some() { smem_bytes_wg(qk_pad, v_pad) } else { smem_bytes(qk_pad, v_pad) };
            if smem > self.max_smem {
                return Err(CudaError::shape(
                    K,
                    format!("needs {smem} B of shared memory, the GPU allows {}", self.max_smem),
                ));
            }
            let f = match wg {
                Some(f) => f,
                None if qk_pad == 64 => &self.fwd_small,
                None => &self.fwd_large,
            };
            let (hi, ni, ri, vi) = (i32_of(h)?, i32_of(d.nope)?, i32_of(d.rope)?, i32_of(d.vdim)?);
            let scale_log2 = scale * std::f32::consts::LOG2_E;
            let (tiles, threads) = if wg.is_some() { (plan.num_tiles_wg, 256) } else { (plan.num_tiles, 128) };
            let cfg = LaunchConfig {
                grid_dim: (tiles as u32, h as u32, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // The wgmma kernel's tiles follow the mma.sync kernel's in d_tiles.
            let tile_skip = if wg.is_some() { 2 * plan.num_tiles } else { 0 };
            let d_tiles = plan.d_tiles.slice(tile_skip..);
            let (op, _g1) = o.device_ptr_mut(s);
            let (qp, _g2) = q.device_ptr(s);
            let (knp, _g3) = kn.device_ptr(s);
            let (kpp, _g4) = kpe.device_ptr(s);
            let (vp, _g5) = v.device_ptr(s);
            // TMA maps over kn [keys][heads·128], kpe [keys][64], v [keys][heads·128] (lengths
            // checked above; 16-byte rows), boxes of 64 dims × 64 keys.
            let maps = if tma {
                let map = |p: u64, inner: usize| {
                    bf16_tensor_map(p, &[inner as u64, t as u64], &[(inner * 2) as u64], &[64, 64])
                };
                Some([map(knp, h * d.nope)?, map(kpp, d.rope)?, map(vp, h * d.vdim)?])
            } else {
                None
            };
            // SAFETY: argument list matches mla_prefill_{fwd,wg}_*(o, q, kn, kpe, v, cos, sin, seqs,
            // tiles, heads, nope, rope, vdim, scale_log2). CTA (tile, h < heads) reads its
            // tile descriptor (< num_tiles, or num_tiles_wg after the 64-row list: d_tiles
            // holds both) and sequence descriptor, q rows q_row0 + i
            // (i < q_len, so < rows_end) of width heads*qk, keys k_off + t < keys of kn, kpe,
            // v, RoPE rows of positions < k_len <= max_k_len, and writes o rows < rows_end
            // at columns < vdim; every length is checked above; nope, rope, vdim are
            // multiples of 8 (instance()), so the 16-byte and float4 accesses are aligned;
            // the dynamic shared memory is the instance's size (opted in at new()). The TMA
            // variant's maps cover exactly the kn, kpe and v elements checked above (its
            // boxes past a sequence's keys read other sequences' rows or zero fill).
            unsafe {
                let mut b = s.launch_builder(f);
                b.arg(&op)
                    .arg(&qp)
                    .arg(&knp)
                    .arg(&kpp)
                    .arg(&vp)
                    .arg(&rope.cos)
                    .arg(&rope.sin)
                    .arg(&plan.d_seqs)
                    .arg(&d_tiles)
                    .arg(&hi)
                    .arg(&ni)
                    .arg(&ri)
                    .arg(&vi)
                    .arg(&scale_log2);
                // mla_prefill_wgt_* takes the three tensor maps after scale_log2.
                if let Some(m) = &maps {
                    b.arg(&m[0]).arg(&m[1]).arg(&m[2]);
                }
                b.launch(cfg)
            }?;
            Ok(())
        }

        /// `out[rows[b]] = inp[b]` for rows of `width` bf16 (`host_rows` is the host copy of
        /// `rows`, checked against `out`).
        pub fn scatter_rows(
            &self,
            s: &Arc<CudaStream>,
            out: &mut CudaSlice<bf16>,
            inp: &CudaSlice<bf16>,
            rows: &CudaSlice<i32>,
            host_rows: &[u32],
            width: usize,
        ) -> Result<()> {
            const S: &str = "scatter_rows_bf16";
            let n = host_rows.len();
            need(S, "rows", rows.len(), n)?;
            need(S, "inp", inp.len(), n * width)?;
            if let Some(&r) = host_rows.iter().find(|&&r| (r as usize + 1) * width > out.len()) {
                return Err(CudaError::shape(S, format!("row {r} outside the output")));
            }
            if n == 0 {
                return Ok(());
            }
            let w = i32_of(width)?;
            let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: block b reads rows[b] (n entries) and inp[b*width..][..width], writes
            // out[rows[b]*width..][..width]; every row was checked on the host copy.
            unsafe { s.launch_builder(&self.scatter).arg(out).arg(inp).arg(rows).arg(&w).launch(cfg) }?;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(q_row0: usize, q_len: usize, k_len: usize) -> PrefillSeq {
        PrefillSeq { q_row0, q_len, k_len, table_row: 0 }
    }

    #[test]
    fn causal_pairs_count_what_each_query_sees() {
        // 3 queries over no prefix: 1 + 2 + 3.
        assert_eq!(causal_pairs(&[seq(0, 3, 3)]), 6);
        // 2 queries after 10 cached keys: 11 + 12.
        assert_eq!(causal_pairs(&[seq(0, 2, 12)]), 23);
        let brute = |q: usize, k: usize| (0..q).map(|i| (k - q + i + 1) as u64).sum::<u64>();
        for (q, k) in [(1, 1), (64, 64), (65, 300), (300, 300), (2000, 2000)] {
            assert_eq!(causal_pairs(&[seq(0, q, k)]), brute(q, k));
        }
        let d = PrefillDims { heads: 2, nope: 128, rope: 64, vdim: 128 };
        assert_eq!(flops(&[seq(0, 3, 3)], &d), 6.0 * 2.0 * 2.0 * 320.0);
    }

    #[test]
    fn tiles_cover_every_query_once_longest_first() {
        let seqs = [seq(0, 130, 130), seq(130, 1, 500), seq(131, 64, 64)];
        // 3 + 1 + 1 tiles of 64 rows, 2 + 1 + 1 of 128.
        for (rows, n) in [(TILE_ROWS, 5), (WG_TILE_ROWS, 4)] {
            let t = tile_list(&seqs, rows);
            assert_eq!(t.len(), n);
            let work = |x: &[usize; 2]| {
                let s = seqs[x[0]];
                s.k_len - s.q_len + (x[1] + rows).min(s.q_len)
            };
            assert!(t.windows(2).all(|w| work(&w[0]) >= work(&w[1])), "{t:?}");
            assert_eq!(t[0], [1, 0]); // 500 keys
            let mut covered: Vec<(usize, usize)> =
                t.iter().flat_map(|&[j, i0]| (i0..(i0 + rows).min(seqs[j].q_len)).map(move |i| (j, i))).collect();
            covered.sort();
            let want: Vec<(usize, usize)> =
                seqs.iter().enumerate().flat_map(|(j, s)| (0..s.q_len).map(move |i| (j, i))).collect();
            assert_eq!(covered, want);
        }
    }

    #[test]
    fn instances_and_shared_memory() {
        let v3 = PrefillDims { heads: 128, nope: 128, rope: 64, vdim: 128 };
        assert_eq!(v3.instance(), Some((192, 128)));
        assert_eq!(smem_bytes(192, 128), 106_496); // two CTAs per SM on Hopper (228 KiB)
        assert!(smem_bytes_wg(192, 128) + 1024 <= 228 * 1024); // the wgmma one: one CTA per SM
        let tiny = PrefillDims { heads: 8, nope: 16, rope: 8, vdim: 24 };
        assert_eq!(tiny.instance(), Some((64, 64)));
        assert_eq!(PrefillDims { vdim: 20, ..tiny }.instance(), None);
        assert_eq!(PrefillDims { nope: 256, ..v3 }.instance(), None);
        assert!(check_seqs(&[seq(0, 0, 3)]).is_err());
        assert!(check_seqs(&[seq(0, 4, 3)]).is_err());
        assert!(check_seqs(&[seq(0, 3, 3)]).is_ok());
    }
}
