//! [`MlaDecode`]: the padded absorbed-MLA decode attention of `kernels/mla_decode.cu`
//! (docs/cuda.md, "MLA decode"). It owns the kernel's launch geometry (64-row tiles × split-KV ×
//! batch, 256 threads, ~196 KB of shared memory), the split plan, and every `unsafe`.
//!
//! One call covers the whole decode batch: one launch of the split kernel, plus one of
//! the combine kernel when a request is split. Dims other than DeepSeek's 512 + 64 (the
//! tiny test models) go to a simple generic kernel with the same contract.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUfunction_attribute};
use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use half::bf16;

use crate::dims::DecodeDims;
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::with_smem;
pub use crate::plan::SplitMerge;
use crate::plan::{self, MAX_SPLITS, PAGE, TILE_ROWS};
use crate::tensor_map::{bf16_tensor_map, TensorMapArg};

const NAME: &str = "mla_decode";
/// Fast-path dims: every V2/V3/R1/K2 checkpoint has kv_lora_rank 512, rope 64.
const FAST_DLAT: usize = 512;
const FAST_DROPE: usize = 64;
const FAST_THREADS: u32 = 256;
/// Shared memory of the fast kernel: Q tile + 3 KV chunks of 32 tokens + the S exchange
/// (must match `Cfg::SMEM_BYTES` in mla_decode.cu).
const FAST_SMEM: usize = TILE_ROWS * 1152 + 3 * 32 * 1152 + 8 * 32 * 16 * 4;
/// Dynamic shared memory of the seesaw kernel (`SMEM_BYTES` in mla_decode_sm90_ss.cu):
/// 1 KB alignment slack + Q (64 rows) + two 64-token slots + P fragments + two row maxima
/// + four mbarriers.
const SEESAW_SMEM: usize = 1024 + 64 * 1152 + 2 * 64 * 1152 + 8192 + 2 * 64 * 4 + 4 * 8;

/// Dynamic shared memory of the transposed kernel per stored query rows (16, 32):
/// `SMEM_BYTES` in mla_decode_sm90_t.cu (pinned there by a static_assert).
const TRANSPOSED_QROWS: [usize; 2] = [16, 32];
const TRANSPOSED_SMEM: [usize; 2] = [172_176, 195_856];
/// Query rows per tile of the fp8 cache's kernel (mla_decode_sm90_fp8.cu), the bf16
/// elements of a cache entry (656 bytes) and its dynamic shared memory (`SMEM_BYTES`
/// there, pinned by a static_assert).
const FP8_QROWS: usize = 32;
const FP8_ENTRY_ELEMS: usize = 328;
const FP8_SMEM: usize = 231_976;

/// Loads `{name}_obf16` and `{name}_of32` from `m` and opts both into `smem` bytes of
/// dynamic shared memory.
fn load_pair(m: &Arc<CudaModule>, name: &str, smem: usize) -> Result<(CudaFunction, CudaFunction)> {
    Ok((with_smem(m, &format!("{name}_obf16"), smem)?, with_smem(m, &format!("{name}_of32"), smem)?))
}

/// Tensor map of the latent cache, 3-D: dim 0 = 64 dims (128 bytes, the swizzle span),
/// dim 1 = tokens (stride 1152 bytes), dim 2 = the 9 blocks of 64 dims (stride 128
/// bytes). A box of 64 x `box_tokens` x `box_blocks` lands as `[block][token][128 B]`
/// with the 128-byte swizzle the wgmma layout expects: 64 x 64 x 1 is one 64-dim piece of
/// a page (the 64-token kernels issue nine per page, so each piece can complete on its own
/// barrier).
fn kv_tensor_map(
    cache_ptr: sys::CUdeviceptr,
    num_blocks: usize,
    dqk: usize,
    box_tokens: u32,
    box_blocks: u32,
) -> Result<TensorMapArg> {
    let dims: [u64; 3] = [64, (num_blocks * PAGE) as u64, (dqk / 64) as u64];
    // The global address is a device allocation of num_blocks*64*dqk bf16 (256-byte
    // aligned), both strides multiples of 16 and every element addressed inside it.
    bf16_tensor_map(cache_ptr, &dims, &[(dqk * 2) as u64, 128], &[64, box_tokens, box_blocks])
}

const GENERIC_THREADS: u32 = 128;
const GENERIC_MAX_DV: usize = 128 * 8;

/// Output element type of the decode kernels: bf16 (what the next GEMM reads) or f32.
pub trait MlaOut: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    /// Kernel-name suffix.
    const SUFFIX: &'static str;
    fn to_f32(self) -> f32;
    /// A quiet NaN, to poison outputs before a checked launch.
    fn nan() -> Self;
}
impl MlaOut for bf16 {
    const SUFFIX: &'static str = "obf16";
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    fn nan() -> Self {
        bf16::NAN
    }
}
impl MlaOut for f32 {
    const SUFFIX: &'static str = "of32";
    fn to_f32(self) -> f32 {
        self
    }
    fn nan() -> Self {
        f32::NAN
    }
}

/// Which tensor-core kernel runs the 512 + 64 fast path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MlaKernel {
    /// mma.sync m16n8k16 (any sm_80+ GPU; the sm_100a and PTX images use it).
    MmaSync,
    /// The "seesaw" schedule (mla_decode_sm90_ss.cu): 64-token blocks, each warpgroup
    /// computes S = Q Kᵀ (m64n64) of every other block over all 576 dims and owns half
    /// of O; P and the running max pass between the two through shared memory.
    Seesaw,
    /// Sᵀ = K Qᵀ for single tiles of at most 32 rows (mla_decode_sm90_t.cu): the tokens
    /// are wgmma's M, so 16 or 32 query rows do not pay for 64. Other shapes run
    /// [`MlaKernel::Seesaw`].
    Transposed,
    /// The fp8 cache's kernel (mla_decode_sm90_fp8.cu): chosen by the cache's layout
    /// ([`MlaDecode::set_kv_cache_dtype`]), not selectable.
    Fp8Cache,
    /// The default: per launch, the kernel that measured fastest for its shape on an
    /// H200 (docs/PERFORMANCE.md): on sm_90 the transposed kernel for one tile of at
    /// most 32 rows and the seesaw kernel for everything else (each faster than the
    /// mma.sync kernel at every shape of the sweep); elsewhere mma.sync.
    Auto,
}

impl MlaKernel {
    /// Every selectable kernel, `Auto` last.
    pub const ALL: [MlaKernel; 4] = [MlaKernel::MmaSync, MlaKernel::Seesaw, MlaKernel::Transposed, MlaKernel::Auto];

    /// The kernel called `name` (as [`MlaKernel::name`] spells it).
    pub fn from_name(name: &str) -> Option<MlaKernel> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            MlaKernel::MmaSync => "mma.sync",
            MlaKernel::Seesaw => "wgmma-ss",
            MlaKernel::Transposed => "wgmma-t",
            MlaKernel::Fp8Cache => "wgmma-fp8",
            MlaKernel::Auto => "auto",
        }
    }
}

/// Everything a launch needs besides the buffers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaDecodeShape {
    pub dims: DecodeDims,
    /// Physical pages in the cache buffer (`cache.len() / (64 * dqk)`).
    pub num_blocks: usize,
    /// Splits per request (from [`MlaDecode::num_splits`]; 1 on the generic path).
    pub num_splits: usize,
    /// Softmax scale (`1/sqrt(qk_nope + rope)` times YaRN mscale² where configured).
    pub scale: f32,
}

/// Split-KV partials: `o_acc [batch][splits][rows][dlat]` f32 and `lse_acc`.
#[derive(Debug)]
pub struct MlaWorkspace {
    o_acc: CudaSlice<f32>,
    lse_acc: CudaSlice<f32>,
    /// One arrival counter per (request, tile) for the kernels that merge their own
    /// splits (seesaw, transposed): zero between launches (the merging CTA resets it).
    counters: CudaSlice<u32>,
}

impl MlaWorkspace {
    /// The split partials `(o_acc, lse_acc)` (checks poison them with NaN).
    pub fn partials_mut(&mut self) -> (&mut CudaSlice<f32>, &mut CudaSlice<f32>) {
        (&mut self.o_acc, &mut self.lse_acc)
    }
}

/// The loaded decode kernels of one device.
#[derive(Debug)]
pub struct MlaDecode {
    splitkv_bf16: CudaFunction,
    splitkv_f32: CudaFunction,
    combine_bf16: CudaFunction,
    combine_f32: CudaFunction,
    generic_bf16: CudaFunction,
    generic_f32: CudaFunction,
    /// (bf16 out, f32 out) seesaw kernels (sm_90 only), and their two-split cluster
    /// entries (`_c2`, [`SplitMerge::Cluster`]).
    seesaw: Option<(CudaFunction, CudaFunction)>,
    seesaw_c2: Option<(CudaFunction, CudaFunction)>,
    /// (bf16 out, f32 out) transposed kernels per [`TRANSPOSED_QROWS`] (sm_90 only), and
    /// their cluster entries.
    transposed: Option<Vec<(CudaFunction, CudaFunction)>>,
    transposed_c2: Option<Vec<(CudaFunction, CudaFunction)>>,
    /// (bf16 out, f32 out) of the fp8 cache's kernel and its cluster entries (sm_90 only).
    fp8: Option<[(CudaFunction, CudaFunction); 2]>,
    /// The cache holds fp8 entries (`kernels/kv_fp8.cuh`): every launch runs `fp8`.
    kv_fp8: bool,
    kernel: MlaKernel,
    /// How the 64-token kernels merge their splits.
    merge: SplitMerge,
    /// Pages per split when splits have a fixed size (the batch-invariant plan,
    /// [`MlaDecode::set_fixed_splits`]); 0: the planner shares a request's pages evenly
    /// among as many splits as fill the GPU.
    split_blocks: usize,
    num_sms: usize,
}

impl MlaDecode {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        if gpu.max_smem_optin < FAST_SMEM {
            return Err(CudaError::shape(
                NAME,
                format!("needs {FAST_SMEM} B of shared memory, device allows {}", gpu.max_smem_optin),
            ));
        }
        let m = gpu.load_module(kernels::MLA_DECODE)?;
        let splitkv_bf16 = m.load_function("mla_decode_splitkv_d512r64_obf16")?;
        let splitkv_f32 = m.load_function("mla_decode_splitkv_d512r64_of32")?;
        for f in [&splitkv_bf16, &splitkv_f32] {
            f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, FAST_SMEM as i32)?;
        }
        // wgmma exists only in the sm_90a images; elsewhere its entry points trap.
        let (seesaw, seesaw_c2) = if gpu.compute_capability == (9, 0) && gpu.max_smem_optin >= SEESAW_SMEM {
            let m = gpu.load_module(kernels::MLA_DECODE_SM90_SS)?;
            (
                Some(load_pair(&m, "mla_decode_wgmma_ss_d512r64", SEESAW_SMEM)?),
                Some(load_pair(&m, "mla_decode_wgmma_ss_c2_d512r64", SEESAW_SMEM)?),
            )
        } else {
            (None, None)
        };
        let (transposed, transposed_c2) =
            if gpu.compute_capability == (9, 0) && gpu.max_smem_optin >= TRANSPOSED_SMEM[1] {
                let m = gpu.load_module(kernels::MLA_DECODE_SM90_T)?;
                let load = |prefix: &str| -> Result<Vec<(CudaFunction, CudaFunction)>> {
                    TRANSPOSED_QROWS
                        .iter()
                        .zip(TRANSPOSED_SMEM)
                        .map(|(qr, smem)| load_pair(&m, &format!("{prefix}_q{qr}"), smem))
                        .collect()
                };
                (Some(load("mla_decode_wgmma_t_d512r64")?), Some(load("mla_decode_wgmma_t_c2_d512r64")?))
            } else {
                (None, None)
            };
        let fp8 = if gpu.compute_capability == (9, 0) && gpu.max_smem_optin >= FP8_SMEM {
            let m = gpu.load_module(kernels::MLA_DECODE_SM90_FP8)?;
            Some([
                load_pair(&m, "mla_decode_wgmma_fp8_d512r64", FP8_SMEM)?,
                load_pair(&m, "mla_decode_wgmma_fp8_c2_d512r64", FP8_SMEM)?,
            ])
        } else {
            None
        };
        let kernel = MlaKernel::Auto;
        Ok(MlaDecode {
            seesaw,
            seesaw_c2,
            transposed,
            transposed_c2,
            fp8,
            kv_fp8: false,
            kernel,
            merge: SplitMerge::Cluster,
            split_blocks: 0,
            splitkv_bf16,
            splitkv_f32,
            combine_bf16: m.load_function("mla_decode_combine_obf16")?,
            combine_f32: m.load_function("mla_decode_combine_of32")?,
            generic_bf16: m.load_function("mla_decode_generic_obf16")?,
            generic_f32: m.load_function("mla_decode_generic_of32")?,
            num_sms: gpu.num_sms,
        })
    }

    /// Selects the cache layout the launches read: bf16 (the default) or fp8 entries
    /// (`kernels/kv_fp8.cuh`), which only the sm_90 kernel reads (512 + 64 dims).
    pub fn set_kv_cache_dtype(&mut self, dtype: mlaserve_core::KvCacheDtype) -> Result<()> {
        let fp8 = dtype == mlaserve_core::KvCacheDtype::Fp8;
        if fp8 && self.fp8.is_none() {
            return Err(CudaError::shape(NAME, "the fp8 latent cache's decode kernel needs an sm_90 GPU"));
        }
        self.kv_fp8 = fp8;
        Ok(())
    }

    /// Whether launches read fp8 cache entries.
    pub fn kv_fp8(&self) -> bool {
        self.kv_fp8
    }

    /// Query-row tiles of a launch with `dims` (64 rows a tile, 32 with the fp8 cache).
    pub fn tiles(&self, dims: &DecodeDims) -> usize {
        if self.kv_fp8 {
            dims.rows().div_ceil(FP8_QROWS)
        } else {
            plan::tiles(dims.heads, dims.q_len)
        }
    }

    /// The tensor-core kernel selection in use ([`MlaKernel::Auto`] unless set).
    pub fn kernel(&self) -> MlaKernel {
        self.kernel
    }

    /// Concrete tensor-core kernels this GPU can run (what `Auto` chooses among).
    pub fn available_kernels(&self) -> Vec<MlaKernel> {
        let mut v = vec![MlaKernel::MmaSync];
        if self.seesaw.is_some() {
            v.push(MlaKernel::Seesaw);
        }
        if self.transposed.is_some() {
            v.push(MlaKernel::Transposed);
        }
        v
    }

    /// How the seesaw and transposed kernels merge their splits ([`SplitMerge::Cluster`]
    /// unless set).
    pub fn set_split_merge(&mut self, merge: SplitMerge) {
        self.merge = merge;
    }

    /// The merge a launch with `dims` and `splits` splits uses (`None`: one split, nothing
    /// to merge).
    pub fn effective_merge(&self, dims: &DecodeDims, splits: usize) -> Option<SplitMerge> {
        self.merge_with(self.merge, dims, splits)
    }

    /// The merge a launch with `dims` and `splits` splits would use with `merge` set
    /// (fixed-size splits always merge through `merge_splits_row`, [`SplitMerge::LastCta`]).
    pub fn merge_with(&self, merge: SplitMerge, dims: &DecodeDims, splits: usize) -> Option<SplitMerge> {
        let merge = if self.split_blocks > 0 { SplitMerge::LastCta } else { merge };
        let own = Self::is_fast_path(dims)
            && matches!(self.effective_kernel(dims), MlaKernel::Seesaw | MlaKernel::Transposed | MlaKernel::Fp8Cache);
        merge.resolve(own, splits)
    }

    /// Selects the fast-path kernel (for comparisons and tests).
    pub fn set_kernel(&mut self, k: MlaKernel) -> Result<()> {
        if k == MlaKernel::Fp8Cache {
            return Err(CudaError::shape(NAME, "the fp8 cache's kernel follows the cache layout (set_kv_cache_dtype)"));
        }
        if (k == MlaKernel::Seesaw && self.seesaw.is_none())
            || (k == MlaKernel::Transposed && (self.transposed.is_none() || self.seesaw.is_none()))
        {
            return Err(CudaError::shape(NAME, "wgmma needs an sm_90 GPU"));
        }
        self.kernel = k;
        Ok(())
    }

    /// Batch-invariant decode: splits of `blocks` pages each from the start of every
    /// request, whatever the batch (None: back to the planner's even splits). A row's key
    /// ranges, the order it visits them and the merge of their partials then depend on
    /// its own position only, and the seesaw kernel runs for every window length (the
    /// kernel a launch uses is otherwise chosen by its rows), so a token's attention is
    /// bit-identical alone, in any batch, and as any row of a draft window. Up to
    /// `blocks × MAX_SPLITS` pages of context (a longer table widens the splits). Needs
    /// the seesaw kernel (sm_90).
    pub fn set_fixed_splits(&mut self, blocks: Option<usize>) -> Result<()> {
        match blocks {
            Some(0) => return Err(CudaError::shape(NAME, "fixed splits of 0 pages")),
            Some(_) if self.seesaw.is_none() => {
                return Err(CudaError::shape(NAME, "fixed-size splits need the seesaw kernel (sm_90)"))
            }
            _ => {}
        }
        self.split_blocks = blocks.unwrap_or(0);
        Ok(())
    }

    /// Pages per split under [`MlaDecode::set_fixed_splits`] for a block table of
    /// `bt_stride` pages (None: even splits).
    pub fn fixed_split_blocks(&self, bt_stride: usize) -> Option<usize> {
        (self.split_blocks > 0).then(|| self.split_blocks.max(bt_stride.div_ceil(MAX_SPLITS)))
    }

    /// The concrete kernel a launch with `dims` runs (the fast path's; `Auto` resolved).
    pub fn effective_kernel(&self, dims: &DecodeDims) -> MlaKernel {
        let tiles = plan::tiles(dims.heads, dims.q_len);
        let rows = dims.rows();
        if self.kv_fp8 {
            // The fp8 cache has one kernel, for every shape and split plan.
            return MlaKernel::Fp8Cache;
        }
        if self.split_blocks > 0 {
            return MlaKernel::Seesaw;
        }
        match self.kernel {
            MlaKernel::Transposed if !(tiles == 1 && rows <= 32) => MlaKernel::Seesaw,
            MlaKernel::Auto if self.transposed.is_some() && self.seesaw.is_some() && tiles == 1 && rows <= 32 => {
                MlaKernel::Transposed
            }
            MlaKernel::Auto if self.seesaw.is_some() => MlaKernel::Seesaw,
            MlaKernel::Auto => MlaKernel::MmaSync,
            k => k,
        }
    }

    /// Whether `dims` run on the tensor-core kernel (else the generic one).
    pub fn is_fast_path(dims: &DecodeDims) -> bool {
        dims.dlat == FAST_DLAT && dims.drope == FAST_DROPE
    }

    /// Splits per request for this batch (`max_seq_len` = the longest `seq_lens` entry).
    pub fn num_splits(&self, dims: &DecodeDims, max_seq_len: usize) -> usize {
        if !Self::is_fast_path(dims) {
            return 1;
        }
        if let Some(per) = self.fixed_split_blocks(dims.bt_stride) {
            return max_seq_len.div_ceil(plan::PAGE).div_ceil(per).clamp(1, MAX_SPLITS);
        }
        let chunk = match self.effective_kernel(dims) {
            MlaKernel::Seesaw | MlaKernel::Transposed | MlaKernel::Fp8Cache => plan::BLOCK_TOKENS,
            _ => plan::CHUNK_TOKENS,
        };
        plan::num_splits(dims.batch, self.tiles(dims), max_seq_len, self.num_sms, chunk)
    }

    /// Allocates the split-KV workspace for `dims` and up to `num_splits` splits (empty
    /// when no split is needed). Allocate once per batch-size bucket, reuse every step.
    pub fn workspace(&self, stream: &Arc<CudaStream>, dims: &DecodeDims, num_splits: usize) -> Result<MlaWorkspace> {
        let n = if num_splits > 1 { dims.batch * num_splits * dims.rows() } else { 0 };
        let c = if num_splits > 1 { dims.batch * self.tiles(dims) } else { 0 };
        Ok(MlaWorkspace {
            o_acc: stream.alloc_zeros::<f32>((n * dims.dlat).max(1))?,
            lse_acc: stream.alloc_zeros::<f32>(n.max(1))?,
            counters: stream.alloc_zeros::<u32>(c.max(1))?,
        })
    }

    /// Runs decode attention for the whole batch on `stream`.
    ///
    /// Buffers (see [`crate::reference::mla_decode`] for the exact semantics):
    /// `q [batch][q_len*heads][dqk]`, `cache [num_blocks][64][dqk]`,
    /// `block_table [batch][bt_stride]`, `seq_lens [batch]` (each counting the drafts),
    /// `out [batch][rows][dlat]`, `lse [batch][rows]`. All sizes are checked here. The
    /// device-side metadata (page ids, seq_lens) is clamped inside the kernels, so bad
    /// metadata gives wrong numbers, never an out-of-bounds access; the engine validates
    /// it on the host (`Batch::validate`).
    #[allow(clippy::too_many_arguments)]
    pub fn launch<T: MlaOut>(
        &self,
        stream: &Arc<CudaStream>,
        shape: &MlaDecodeShape,
        q: &impl DevicePtr<bf16>,
        cache: &CudaSlice<bf16>,
        block_table: &impl DevicePtr<i32>,
        seq_lens: &impl DevicePtr<i32>,
        out: &mut impl DevicePtrMut<T>,
        lse: &mut impl DevicePtrMut<f32>,
        ws: &mut MlaWorkspace,
    ) -> Result<()> {
        let d = &shape.dims;
        let (rows, dqk) = (d.rows(), d.dqk());
        let check = |ok: bool, msg: String| if ok { Ok(()) } else { Err(CudaError::shape(NAME, msg)) };
        check(d.batch > 0 && d.heads > 0 && d.q_len > 0 && d.dlat > 0, format!("empty dims {d:?}"))?;
        check(d.batch <= 65_535, format!("batch {} > 65535", d.batch))?;
        check(q.len() == d.batch * rows * dqk, format!("q has {} elements, want {}", q.len(), d.batch * rows * dqk))?;
        let entry = if self.kv_fp8 { FP8_ENTRY_ELEMS } else { dqk };
        check(!self.kv_fp8 || Self::is_fast_path(d), format!("the fp8 cache needs dims 512 + 64, not {d:?}"))?;
        check(
            shape.num_blocks > 0 && cache.len() == shape.num_blocks * PAGE * entry,
            format!("cache has {} elements, want {} blocks x {PAGE} x {entry}", cache.len(), shape.num_blocks),
        )?;
        check(
            d.bt_stride > 0 && block_table.len() == d.batch * d.bt_stride,
            format!("block table has {} entries", block_table.len()),
        )?;
        check(seq_lens.len() == d.batch, format!("seq_lens has {} entries", seq_lens.len()))?;
        check(out.len() == d.batch * rows * d.dlat, format!("out has {} elements", out.len()))?;
        check(lse.len() == d.batch * rows, format!("lse has {} elements", lse.len()))?;
        // Raw device pointers (the buffers may be views of larger ones); the guards keep
        // the stream ordering until the launches below are enqueued.
        let (q, _gq) = q.device_ptr(stream);
        let (block_table, _gb) = block_table.device_ptr(stream);
        let (seq_lens, _gs) = seq_lens.device_ptr(stream);
        let (out, _go) = out.device_ptr_mut(stream);
        let (lse, _gl) = lse.device_ptr_mut(stream);
        let (out, lse) = (&out, &lse);
        check(
            d.bt_stride * PAGE <= i32::MAX as usize && shape.num_blocks <= i32::MAX as usize,
            "sizes overflow i32".into(),
        )?;
        let (heads, q_len, bt_stride, num_blocks) =
            (d.heads as i32, d.q_len as i32, d.bt_stride as i32, shape.num_blocks as i32);
        let scale_log2 = shape.scale * std::f32::consts::LOG2_E;

        if !Self::is_fast_path(d) {
            check(shape.num_splits == 1, "the generic kernel does not split".into())?;
            check(d.dlat <= GENERIC_MAX_DV, format!("generic kernel supports dlat <= {GENERIC_MAX_DV}"))?;
            let f = if T::SUFFIX == "obf16" { &self.generic_bf16 } else { &self.generic_f32 };
            let (dlat, drope) = (d.dlat as i32, d.drope as i32);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, d.batch as u32, 1),
                block_dim: (GENERIC_THREADS, 1, 1),
                shared_mem_bytes: ((dqk + GENERIC_THREADS as usize / 32) * 4) as u32,
            };
            check(cfg.shared_mem_bytes <= 48 * 1024, "generic kernel: dqk too large".into())?;
            // SAFETY: argument list matches mla_decode_generic_o*(q, kv, block_table,
            // seq_lens, out, lse, heads, q_len, bt_stride, num_blocks, dlat, drope,
            // scale_log2); every buffer has the length checked above; the kernel clamps
            // seq_lens to bt_stride*64 and page ids to num_blocks-1, and reads/writes only
            // rows < q_len*heads of requests < batch (grid = rows x batch).
            unsafe {
                stream
                    .launch_builder(f)
                    .arg(&q)
                    .arg(cache)
                    .arg(&block_table)
                    .arg(&seq_lens)
                    .arg(out)
                    .arg(lse)
                    .arg(&heads)
                    .arg(&q_len)
                    .arg(&bt_stride)
                    .arg(&num_blocks)
                    .arg(&dlat)
                    .arg(&drope)
                    .arg(&scale_log2)
                    .launch(cfg)
            }?;
            return Ok(());
        }

        let splits = shape.num_splits;
        check((1..=MAX_SPLITS).contains(&splits), format!("num_splits {splits} not in 1..={MAX_SPLITS}"))?;
        if splits > 1 {
            let need = d.batch * splits * rows;
            check(
                ws.lse_acc.len() >= need && ws.o_acc.len() >= need * d.dlat,
                format!("workspace holds {} rows of partials, need {need}", ws.lse_acc.len()),
            )?;
            let tiles = self.tiles(d);
            check(
                ws.counters.len() >= d.batch * tiles,
                format!("workspace holds {} split counters, need {}", ws.counters.len(), d.batch * tiles),
            )?;
        }
        let bf = T::SUFFIX == "obf16";
        let tiles = self.tiles(d);
        let kernel = self.effective_kernel(d);
        let merge = self.effective_merge(d, splits);
        // (function, shared memory, TMA box: tokens x 64-dim blocks, or none for mma.sync)
        let (f, smem, tma_box) = match (kernel, &self.seesaw) {
            (MlaKernel::Fp8Cache, _) => {
                let [plain, c2] = self.fp8.as_ref().expect("set_kv_cache_dtype checked");
                let (fb, ff) = if merge == Some(SplitMerge::Cluster) { c2 } else { plain };
                (if bf { fb } else { ff }, FP8_SMEM, None)
            }
            (MlaKernel::Seesaw, Some((fb, ff))) => {
                let (fb, ff) = match (merge, &self.seesaw_c2) {
                    (Some(SplitMerge::Cluster), Some((cb, cf))) => (cb, cf),
                    _ => (fb, ff),
                };
                (if bf { fb } else { ff }, SEESAW_SMEM, Some((64, 1)))
            }
            (MlaKernel::Transposed, _) if self.transposed.is_some() => {
                let t = usize::from(rows > TRANSPOSED_QROWS[0]);
                let set = match (merge, &self.transposed_c2) {
                    (Some(SplitMerge::Cluster), Some(c2)) => c2,
                    _ => self.transposed.as_ref().expect("checked"),
                };
                let (fb, ff) = &set[t];
                (if bf { fb } else { ff }, TRANSPOSED_SMEM[t], Some((64, 1)))
            }
            _ => (if bf { &self.splitkv_bf16 } else { &self.splitkv_f32 }, FAST_SMEM, None),
        };
        // The 64-token kernels can merge their own splits: in a cluster of the two (their
        // _c2 entries, chosen above), or by the last CTA of a tile through the workspace's
        // counters; otherwise, like the others, they leave it to the combine kernel.
        let own_splits = matches!(kernel, MlaKernel::Seesaw | MlaKernel::Transposed | MlaKernel::Fp8Cache);
        let last_cta = merge == Some(SplitMerge::LastCta);
        let tmap = match tma_box {
            Some((box_tokens, box_blocks)) => {
                let (ptr, _sync) = cache.device_ptr(stream);
                Some(kv_tensor_map(ptr, shape.num_blocks, dqk, box_tokens, box_blocks)?)
            }
            None => None,
        };
        let splits_i = splits as i32;
        let split_blocks = self.fixed_split_blocks(d.bt_stride).unwrap_or(0) as i32;
        let cfg = LaunchConfig {
            // x = tile fastest: the tiles of one (request, split) run side by side and
            // share each KV chunk through L2.
            grid_dim: (tiles as u32, splits as u32, d.batch as u32),
            block_dim: (FAST_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: argument list matches mla_decode_splitkv_d512r64_o* (and, after the
        // tensor map and with the extra arguments below, the 64-token kernels): (q, kv, block_table,
        // seq_lens, out, lse, o_acc, lse_acc, heads, q_len, bt_stride, num_blocks,
        // num_splits, scale_log2). q/cache/out/lse lengths are checked above for dims
        // 512+64; with splits > 1 the kernel writes partials at
        // [(b*splits + split)*rows + row] < batch*splits*rows, which the workspace holds
        // (checked), and with splits == 1 it writes only out/lse. Page ids and seq_lens
        // are clamped in the kernel. Each kernel's shared memory was opted into in `new`,
        // and the wgmma kernels are only chosen where their sm_90a image exists. The TMA
        // kernels take the cache's tensor map first; it describes exactly the `cache`
        // allocation (num_blocks pages, checked above), so every box is in bounds. The
        // seesaw and transposed kernels take `counters` after lse_acc: null (no merge), or
        // batch * tiles of them (checked above when splits > 1, zero between launches:
        // the merging CTA resets its own, and only it writes out/lse); they read the
        // cache only through the map (64, resp. 16 or 32 >= rows, stored query rows,
        // zero-filled past `rows`; the transposed kernel is chosen only for one tile of
        // <= 32 rows). A null `counters` asks the 64-token kernels to leave the merge to
        // the combine kernel below. Their _c2 entries (compile-time cluster 1 x 2 x 1) are
        // chosen only with exactly two splits, so grid.y = 2 is one cluster; they write
        // out/lse only, never the workspace. The seesaw kernel takes `split_blocks` after
        // num_splits (0: even splits; else pages per split, the last split taking the
        // rest, so every page below seq_len is covered whatever the split count), and so
        // does the fp8 cache's kernel (mla_decode_wgmma_fp8[_c2]_d512r64_o*, chosen for
        // every launch over an fp8 cache, no tensor map): tiles of 32 query rows (grid.x
        // = rows / 32 rounded up, rows past `rows` zero-filled and never written), the
        // cache of num_blocks pages of 64 entries of 656 bytes (checked above as bf16
        // elements), each page read by one bulk copy inside it (page ids clamped).
        let no_counters: u64 = 0;
        unsafe {
            let mut b = stream.launch_builder(f);
            if let Some(t) = &tmap {
                b.arg(t);
            }
            b.arg(&q)
                .arg(cache)
                .arg(&block_table)
                .arg(&seq_lens)
                .arg(out)
                .arg(lse)
                .arg(&mut ws.o_acc)
                .arg(&mut ws.lse_acc);
            if last_cta {
                b.arg(&mut ws.counters);
            } else if own_splits {
                b.arg(&no_counters);
            }
            b.arg(&heads).arg(&q_len).arg(&bt_stride).arg(&num_blocks).arg(&splits_i);
            if matches!(kernel, MlaKernel::Seesaw | MlaKernel::Fp8Cache) {
                b.arg(&split_blocks);
            }
            b.arg(&scale_log2).launch(cfg)
        }?;
        self.combine_if(stream, merge, ws, (out, lse), d.batch, rows, splits, bf)
    }

    /// The combine kernel over the split partials when `merge` leaves it the merge:
    /// `out` and `lse` are the launch's output pointers, `rows` per request.
    #[allow(clippy::too_many_arguments)]
    fn combine_if(
        &self,
        stream: &Arc<CudaStream>,
        merge: Option<SplitMerge>,
        ws: &MlaWorkspace,
        (out, lse): (&sys::CUdeviceptr, &sys::CUdeviceptr),
        batch: usize,
        rows: usize,
        splits: usize,
        bf: bool,
    ) -> Result<()> {
        if merge != Some(SplitMerge::Kernel) {
            return Ok(());
        }
        let comb = if bf { &self.combine_bf16 } else { &self.combine_f32 };
        let (rows_i, splits_i, dv) = (rows as i32, splits as i32, FAST_DLAT as i32);
        let cfg = LaunchConfig {
            grid_dim: (rows.div_ceil(4) as u32, batch as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: mla_decode_combine_o*(o_acc, lse_acc, out, lse, rows, num_splits, dv):
        // one warp per (row < rows, request < batch) reads splits partials inside the
        // workspace (checked by `launch`) and writes out[b][row][0..dv) and lse[b][row];
        // dv = 512 is a multiple of 4 (float4 reads, 16-byte aligned rows).
        unsafe {
            stream
                .launch_builder(comb)
                .arg(&ws.o_acc)
                .arg(&ws.lse_acc)
                .arg(out)
                .arg(lse)
                .arg(&rows_i)
                .arg(&splits_i)
                .arg(&dv)
                .launch(cfg)
        }?;
        Ok(())
    }
}
