//! FP8 projections: [`Fp8Linear`] (an e4m3 weight with DeepSeek's 128 × 128 block scales
//! on the device) and [`Fp8Gemm`] (activation quantisation and the two GEMMs of
//! `kernels/fp8_gemm.cu`). The planning (which kernel, split-K, validation) is
//! [`crate::fp8_plan`], built without CUDA.
//!
//! Semantics: the weight is `w = q · s` per 128 × 128 block; an activation row is
//! quantised per 128 channels (`s = amax / 448`, 1 for an all-zero group; `q = e4m3(x /
//! s)`, round to nearest even, saturating); `y[r][c] = Σ_kb (Σ_{k in kb} qx·qw) · sx[r][kb]
//! · sw[c / 128][kb]` in f32, each k block's partial sum promoted into the f32 total.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::error::{CudaError, Result};
use crate::fp8_plan::{
    self, Fp8Kernel, Fp8Path, FP8_BLOCK, STREAM_COLS, STREAM_MAX_SPLIT, STREAM_ROWS, WG_SMEM, WG_TILE, WIDE_TILE,
};
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::{i32_of, launch_cluster, max_active_clusters, need, with_smem};
use crate::linear::GemmOut;
use crate::tensor_map::{u8_kblock_map, u8_matrix_map};

/// An fp8 e4m3 weight `[out][inp]` (row-major bytes) with f32 scales `[ceil(out / 128)]
/// [ceil(inp / 128)]`, as a checkpoint's `weight` and `weight_scale_inv` hold them.
///
/// `inp` is a multiple of 128 (whole scale blocks); a checkpoint weight of fewer input
/// channels (`x_inp`, the activation's width: tiny test models) is stored with zero
/// columns up to the next multiple, which changes no product and no activation scale
/// ([`Fp8Gemm::act_quant_padded`]).
#[derive(Debug)]
pub struct Fp8Linear {
    pub q: CudaSlice<u8>,
    pub scale: CudaSlice<f32>,
    pub out: usize,
    pub inp: usize,
    /// Input channels of the activation (`≤ inp`, a multiple of 4).
    pub x_inp: usize,
}

impl Fp8Linear {
    /// Uploads a checkpoint's bytes and scales (checked: lengths, `inp % 128 == 0`).
    pub fn from_raw(s: &Arc<CudaStream>, q: &[u8], scales: &[f32], out: usize, inp: usize) -> Result<Self> {
        fp8_plan::check_weight(out, inp, q.len(), scales.len()).map_err(|e| CudaError::shape("Fp8Linear", e))?;
        Ok(Fp8Linear { q: s.clone_htod(q)?, scale: s.clone_htod(scales)?, out, inp, x_inp: inp })
    }

    /// Uploads a weight of any input width: codes `[out][x_inp]` with scales `[ceil(out /
    /// 128)][ceil(x_inp / 128)]`, the rows padded with zero codes to whole 128-channel
    /// blocks (a host copy only when `x_inp % 128 != 0`).
    pub fn from_unpadded(s: &Arc<CudaStream>, q: &[u8], scales: &[f32], out: usize, x_inp: usize) -> Result<Self> {
        let inp = fp8_plan::padded_inp(x_inp).map_err(|e| CudaError::shape("Fp8Linear", e))?;
        if q.len() != out * x_inp {
            return Err(CudaError::shape("Fp8Linear", format!("{} codes for [{out}, {x_inp}]", q.len())));
        }
        let mut lin = if inp == x_inp {
            Self::from_raw(s, q, scales, out, inp)?
        } else {
            Self::from_raw(s, &fp8_plan::pad_rows(q, out, x_inp, inp), scales, out, inp)?
        };
        lin.x_inp = x_inp;
        Ok(lin)
    }

    /// Bytes of the weight and its scales on the device.
    pub fn bytes(&self) -> usize {
        self.q.len() + 4 * self.scale.len()
    }
}

/// An activation element `act_quant` reads: bf16 or f32.
pub trait QuantIn: cudarc::driver::DeviceRepr {
    const F32: bool;
}
impl QuantIn for bf16 {
    const F32: bool = false;
}
impl QuantIn for f32 {
    const F32: bool = true;
}

/// The fp8 kernels on one GPU.
#[derive(Debug)]
pub struct Fp8Gemm {
    quant_bf16: CudaFunction,
    quant_f32: CudaFunction,
    silu_quant: CudaFunction,
    norm_quant: CudaFunction,
    /// `fp8_stream{1,2,4}_*`: [bf16 out, f32 out] per m-tile count 1, 2, 4.
    stream: [[CudaFunction; 2]; 3],
    /// The streaming kernel's split-K arrival counters ([`fp8_plan::STREAM_COUNTERS`]),
    /// zero between launches (the last block of a tile resets its counter), so calls
    /// on one stream only: like [`crate::linear::Gemm`], a `Fp8Gemm` belongs to a stream.
    counters: CudaSlice<u32>,
    /// `fp8_gemm_wg_*` [bf16, f32] (Hopper with enough shared memory only).
    wg: Option<[CudaFunction; 2]>,
    /// `fp8_gemm_wide_*` [bf16, f32] (with `wg`).
    wide: Option<[CudaFunction; 2]>,
    /// `fp8_stream_wg{16,32,64}_*` [bf16, f32] (with `wg`).
    stream_wg: Option<[[CudaFunction; 2]; 3]>,
    num_sms: usize,
    /// Which kernel runs a call (fixed per process for a batch-invariant engine).
    pub path: Fp8Path,
    /// On Hopper, run the streaming kernel's k chunks of a column tile as one cluster that
    /// sums its partials in shared memory where the GPU holds all of a launch's clusters
    /// at once (the default); off, through global partials and the tile's last block,
    /// as elsewhere. Both give the same bits (`gpu_fp8`), so the choice may depend on the
    /// rows of a call.
    pub cluster_split: bool,
    /// Clusters of `fp8_stream_wg{16,32,64}` of 2 ..= 8 blocks the GPU runs at once
    /// ([16, 32, 64 rows][blocks], 0 where none can run).
    max_clusters: [[usize; STREAM_MAX_SPLIT + 1]; 3],
}

impl Fp8Gemm {
    /// Loads `fp8_gemm.cu`; `path` must be runnable here ([`Fp8Path::Wgmma`] needs sm_90).
    pub fn new(gpu: &Gpu, path: Fp8Path) -> Result<Self> {
        let m = gpu.load_module(kernels::FP8_GEMM)?;
        let wgmma = gpu.compute_capability == (9, 0) && gpu.max_smem_optin >= WG_SMEM;
        path.kernel(1, 1, FP8_BLOCK, gpu.num_sms, wgmma).map_err(|e| CudaError::shape("Fp8Gemm", e))?;
        let f = |name: &str| m.load_function(name);
        let st = |mt: usize| -> Result<[CudaFunction; 2]> {
            let smem = fp8_plan::stream_smem(mt);
            Ok([
                with_smem(&m, &format!("fp8_stream{mt}_obf16"), smem)?,
                with_smem(&m, &format!("fp8_stream{mt}_of32"), smem)?,
            ])
        };
        let mut max_clusters = [[0; STREAM_MAX_SPLIT + 1]; 3];
        if wgmma {
            for (i, nt) in [16usize, 32, 64].into_iter().enumerate() {
                let smem = fp8_plan::stream_wg_smem(nt);
                let f = with_smem(&m, &format!("fp8_stream_wg{nt}_of32"), smem)?;
                for (cl, slot) in max_clusters[i].iter_mut().enumerate().skip(2) {
                    let cfg = LaunchConfig {
                        grid_dim: (1, cl as u32, 1),
                        block_dim: (256, 1, 1),
                        shared_mem_bytes: smem as u32,
                    };
                    *slot = max_active_clusters(&f, cfg, (1, cl as u32, 1))?;
                }
            }
        }
        Ok(Fp8Gemm {
            quant_bf16: f("act_quant_bf16")?,
            quant_f32: f("act_quant_f32")?,
            silu_quant: f("silu_mul_quant")?,
            norm_quant: f("rmsnorm_quant_f32")?,
            stream: [st(1)?, st(2)?, st(4)?],
            counters: gpu.stream.alloc_zeros::<u32>(fp8_plan::STREAM_COUNTERS)?,
            wg: if wgmma {
                Some([with_smem(&m, "fp8_gemm_wg_obf16", WG_SMEM)?, with_smem(&m, "fp8_gemm_wg_of32", WG_SMEM)?])
            } else {
                None
            },
            wide: if wgmma {
                Some([with_smem(&m, "fp8_gemm_wide_obf16", WG_SMEM)?, with_smem(&m, "fp8_gemm_wide_of32", WG_SMEM)?])
            } else {
                None
            },
            stream_wg: if wgmma {
                let st = |nt: usize| -> Result<[CudaFunction; 2]> {
                    let smem = fp8_plan::stream_wg_smem(nt);
                    Ok([
                        with_smem(&m, &format!("fp8_stream_wg{nt}_obf16"), smem)?,
                        with_smem(&m, &format!("fp8_stream_wg{nt}_of32"), smem)?,
                    ])
                };
                Some([st(16)?, st(32)?, st(64)?])
            } else {
                None
            },
            num_sms: gpu.num_sms,
            path,
            cluster_split: true,
            max_clusters,
        })
    }

    /// Clusters of the streaming kernel of 16, 32 and 64 rows, by blocks per cluster, the
    /// GPU holds at once (all 0 without the wgmma kernels).
    pub fn cluster_capacity(&self) -> [[usize; STREAM_MAX_SPLIT + 1]; 3] {
        self.max_clusters
    }

    /// Whether the Hopper wgmma kernel is available on this GPU.
    pub fn has_wgmma(&self) -> bool {
        self.wg.is_some()
    }

    /// Quantises `x [m][k]` per row and 128 channels into `q [m][k]` (e4m3 bytes) and
    /// `scale [m][k / 128]`. `k` must be a multiple of 128.
    pub fn act_quant<I: QuantIn>(
        &self,
        s: &Arc<CudaStream>,
        x: &impl DevicePtr<I>,
        m: usize,
        k: usize,
        q: &mut impl DevicePtrMut<u8>,
        scale: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        self.act_quant_padded(s, x, m, k, k, q, scale)
    }

    /// As [`Fp8Gemm::act_quant`] from `x [m][kx]` (`kx ≤ k`, a multiple of 4): channels
    /// `kx..k` quantise as zeros, so each group's scale is that of its real channels (the
    /// input of an [`Fp8Linear`] padded to whole blocks).
    #[allow(clippy::too_many_arguments)]
    pub fn act_quant_padded<I: QuantIn>(
        &self,
        s: &Arc<CudaStream>,
        x: &impl DevicePtr<I>,
        m: usize,
        kx: usize,
        k: usize,
        q: &mut impl DevicePtrMut<u8>,
        scale: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const K: &str = "act_quant";
        fp8_plan::check_act(m, k).map_err(|e| CudaError::shape(K, e))?;
        if kx > k || !kx.is_multiple_of(4) || k - kx >= FP8_BLOCK {
            return Err(CudaError::shape(K, format!("{kx} input channels padded to {k}")));
        }
        need(K, "x", x.len(), m * kx)?;
        need(K, "q", q.len(), m * k)?;
        need(K, "scale", scale.len(), m * k / FP8_BLOCK)?;
        if m == 0 {
            return Ok(());
        }
        let cfg = quant_cfg(K, m, k)?;
        let (mi, ki, kxi) = (i32_of(K, m)?, i32_of(K, k)?, i32_of(K, kx)?);
        let f = if I::F32 { &self.quant_f32 } else { &self.quant_bf16 };
        let (xp, _g1) = x.device_ptr(s);
        let (qp, _g2) = q.device_ptr_mut(s);
        let (sp, _g3) = scale.device_ptr_mut(s);
        // SAFETY: act_quant_*(x, q, s, m, k, kx): warp w < m·k/128 reads x[row·kx + c ..
        // c + 4] only for channels c < kx, and writes q[row·k + 128g ..][..128] and
        // s[row·k/128 + g]: all within the lengths checked above; 8/16-byte loads and
        // 4-byte stores stay aligned (kx % 4 == 0, k % 128 == 0, cudarc buffers 256-byte
        // aligned, callers' views start at whole rows).
        unsafe { s.launch_builder(f).arg(&xp).arg(&qp).arg(&sp).arg(&mi).arg(&ki).arg(&kxi).launch(cfg) }?;
        Ok(())
    }

    /// SiLU-and-multiply of `gu` (`[m][2dp]` bf16: the gate at columns `0..d`, the up
    /// projection at `dp..dp + d`) fused with the activation quantisation for a weight of
    /// `k` input channels (`d ≤ k < d + 128`, `k % 128 == 0`): the codes and scales that
    /// `SiluMul::launch_padded` followed by [`Fp8Gemm::act_quant_padded`] give, bit for bit.
    #[allow(clippy::too_many_arguments)]
    pub fn silu_quant(
        &self,
        s: &Arc<CudaStream>,
        gu: &impl DevicePtr<bf16>,
        m: usize,
        d: usize,
        dp: usize,
        k: usize,
        q: &mut impl DevicePtrMut<u8>,
        scale: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        const K: &str = "silu_mul_quant";
        fp8_plan::check_act(m, k).map_err(|e| CudaError::shape(K, e))?;
        if d > k || k - d >= FP8_BLOCK || !d.is_multiple_of(4) || !dp.is_multiple_of(4) || dp < d {
            return Err(CudaError::shape(K, format!("{d} channels (halves {dp} apart) padded to {k}")));
        }
        need(K, "gu", gu.len(), m * 2 * dp)?;
        need(K, "q", q.len(), m * k)?;
        need(K, "scale", scale.len(), m * k / FP8_BLOCK)?;
        if m == 0 {
            return Ok(());
        }
        let cfg = quant_cfg(K, m, k)?;
        let (mi, ki, di, dpi) = (i32_of(K, m)?, i32_of(K, k)?, i32_of(K, d)?, i32_of(K, dp)?);
        let (gp, _g1) = gu.device_ptr(s);
        let (qp, _g2) = q.device_ptr_mut(s);
        let (sp, _g3) = scale.device_ptr_mut(s);
        // SAFETY: silu_mul_quant(in, q, s, m, k, d, dp): warp w < m·k/128 reads
        // in[row·2dp + c ..][..4] and in[row·2dp + dp + c ..][..4] only for channels c < d
        // ≤ dp, and writes q[row·k + 128g ..][..128] and s[row·k/128 + g]: within the
        // lengths checked above; 8-byte loads aligned (d, dp multiples of 4, cudarc buffers
        // 256-byte aligned), 4-byte stores (k % 128 == 0).
        unsafe {
            s.launch_builder(&self.silu_quant)
                .arg(&gp)
                .arg(&qp)
                .arg(&sp)
                .arg(&mi)
                .arg(&ki)
                .arg(&di)
                .arg(&dpi)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// RMSNorm of `m` rows of `x` (f32, row stride `x_stride`, `w.len()` wide) fused with
    /// the activation quantisation for a weight of `k` input channels (`dim ≤ k < dim +
    /// 128`): the codes and scales of `Ops::rmsnorm` into bf16 followed by
    /// [`Fp8Gemm::act_quant_padded`], bit for bit. `None` (nothing launched) where the
    /// widths do not allow it (the width or the row stride not a multiple of 4).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_quant(
        &self,
        s: &Arc<CudaStream>,
        x: &impl DevicePtr<f32>,
        x_stride: usize,
        w: &CudaSlice<f32>,
        m: usize,
        k: usize,
        eps: f32,
        q: &mut impl DevicePtrMut<u8>,
        scale: &mut impl DevicePtrMut<f32>,
    ) -> Result<Option<()>> {
        const K: &str = "rmsnorm_quant_f32";
        let dim = w.len();
        if !dim.is_multiple_of(4) || !x_stride.is_multiple_of(4) {
            return Ok(None);
        }
        fp8_plan::check_act(m, k).map_err(|e| CudaError::shape(K, e))?;
        if dim > k || k - dim >= FP8_BLOCK || x_stride < dim {
            return Err(CudaError::shape(K, format!("{dim} channels (row stride {x_stride}) padded to {k}")));
        }
        if m == 0 {
            return Ok(Some(()));
        }
        need(K, "x", x.len(), (m - 1) * x_stride + dim)?;
        need(K, "q", q.len(), m * k)?;
        need(K, "scale", scale.len(), m * k / FP8_BLOCK)?;
        let (xs, di, ki) = (i32_of(K, x_stride)?, i32_of(K, dim)?, i32_of(K, k)?);
        u32::try_from(m).map_err(|_| CudaError::shape(K, "too many rows"))?;
        let (xp, _g1) = x.device_ptr(s);
        let (qp, _g2) = q.device_ptr_mut(s);
        let (sp, _g3) = scale.device_ptr_mut(s);
        let cfg = LaunchConfig { grid_dim: (m as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: rmsnorm_quant_f32(x, x_stride, w, q, s, dim, k, eps): block r < m reads
        // x[r·x_stride ..][..dim] and w[..dim] 16 bytes at a time (dim and x_stride
        // multiples of 4, cudarc buffers 256-byte aligned), writes q[r·k ..][..k] and
        // s[r·k/128 ..][..k/128]: within the lengths checked above.
        unsafe {
            s.launch_builder(&self.norm_quant)
                .arg(&xp)
                .arg(&xs)
                .arg(w)
                .arg(&qp)
                .arg(&sp)
                .arg(&di)
                .arg(&ki)
                .arg(&eps)
                .launch(cfg)
        }?;
        Ok(Some(()))
    }

    /// `y[m][out] = x[m][x_inp] · Wᵀ`: quantises the bf16 activation (into stream-ordered
    /// scratch) and runs [`Fp8Gemm::forward_quantized`].
    pub fn forward<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        lin: &Fp8Linear,
        x: &impl DevicePtr<bf16>,
        m: usize,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        need("fp8 gemm", "x", x.len(), m * lin.x_inp)?;
        if m == 0 {
            return Ok(());
        }
        // SAFETY: act_quant writes every byte and scale of the m rows before the GEMM reads them.
        let mut q = unsafe { s.alloc::<u8>(m * lin.inp) }?;
        let mut sc = unsafe { s.alloc::<f32>(m * lin.inp / FP8_BLOCK) }?;
        self.act_quant_padded(s, x, m, lin.x_inp, lin.inp, &mut q, &mut sc)?;
        self.forward_quantized(s, lin, &q, &sc, m, y)
    }

    /// `y = x · Wᵀ` from a quantised activation (`xq [m][inp]` bytes, `xs [m][inp / 128]`).
    pub fn forward_quantized<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        lin: &Fp8Linear,
        xq: &impl DevicePtr<u8>,
        xs: &impl DevicePtr<f32>,
        m: usize,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const K: &str = "fp8 gemm";
        fp8_plan::check_weight(lin.out, lin.inp, lin.q.len(), lin.scale.len()).map_err(|e| CudaError::shape(K, e))?;
        need(K, "xq", xq.len(), m * lin.inp)?;
        need(K, "xs", xs.len(), m * lin.inp / FP8_BLOCK)?;
        need(K, "y", y.len(), m * lin.out)?;
        if m == 0 {
            return Ok(());
        }
        i32_of(K, m)?;
        let kernel = self
            .path
            .kernel(m, lin.out, lin.inp, self.num_sms, self.wg.is_some())
            .map_err(|e| CudaError::shape(K, e))?;
        match kernel {
            Fp8Kernel::StreamMma | Fp8Kernel::StreamWg => self.stream(s, lin, xq, xs, m, y, kernel),
            Fp8Kernel::Wgmma => self.wgmma(s, lin, xq, xs, m, y, false),
            Fp8Kernel::WgmmaWide => self.wgmma(s, lin, xq, xs, m, y, true),
        }
    }

    /// The streaming kernels: `fp8_stream*` (mma.sync) or `fp8_stream_wg*` (`kernel`).
    #[allow(clippy::too_many_arguments)]
    fn stream<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        lin: &Fp8Linear,
        xq: &impl DevicePtr<u8>,
        xs: &impl DevicePtr<f32>,
        m: usize,
        y: &mut impl DevicePtrMut<T>,
        kernel: Fp8Kernel,
    ) -> Result<()> {
        const K: &str = "fp8_stream";
        let (ksplit, kchunk) = fp8_plan::stream_split(lin.out, lin.inp, self.num_sms);
        let slab = fp8_plan::stream_slab(m, lin.out, ksplit);
        let mt = fp8_plan::stream_mtiles(slab);
        let wg = match kernel {
            Fp8Kernel::StreamWg => {
                Some(self.stream_wg.as_ref().ok_or_else(|| CudaError::shape(K, "no wgmma kernel on this GPU"))?)
            }
            _ => None,
        };
        let f = match wg {
            Some(w) => &w[mt.trailing_zeros() as usize][usize::from(!T::BF16)],
            None => &self.stream[mt.trailing_zeros() as usize][usize::from(!T::BF16)],
        };
        let smem = if wg.is_some() { fp8_plan::stream_wg_smem(16 * mt) } else { fp8_plan::stream_smem(mt) };
        let cols = u32::try_from(lin.out.div_ceil(STREAM_COLS)).map_err(|_| CudaError::shape(K, "too many columns"))?;
        if ksplit > 65_535 {
            return Err(CudaError::shape(K, "too many k splits"));
        }
        // On Hopper a column tile's k chunks run as one cluster and sum their partials in
        // shared memory (`f8g_cluster_reduce`, the same order and bits as the last block's
        // sum): no partials in global memory.
        let cluster = self.cluster_split
            && wg.is_some()
            && ksplit > 1
            && cols as usize * slab.div_ceil(STREAM_ROWS) <= self.max_clusters[mt.trailing_zeros() as usize][ksplit];
        let mut part = if ksplit > 1 && !cluster {
            // SAFETY: every block of a launch writes its (ks, row, col) partials before it
            // counts itself, and the last block of a tile reads them only after every
            // block of the tile has counted (a block stores all its rows < rows, cols < out).
            Some(unsafe { s.alloc::<f32>(ksplit * slab * lin.out) }?)
        } else {
            None
        };
        let (pp, _gp) = match part.as_mut() {
            Some(p) => {
                let (ptr, g) = p.device_ptr_mut(s);
                (ptr, Some(g))
            }
            None => (0, None),
        };
        let (xp, _g1) = xq.device_ptr(s);
        let (sp, _g2) = xs.device_ptr(s);
        let (wp, _g3) = lin.q.device_ptr(s);
        let (wsp, _g4) = lin.scale.device_ptr(s);
        let (yp, _g5) = y.device_ptr_mut(s);
        let (cp, _g6) = self.counters.device_ptr(s);
        let (ni, ki, kc) = (i32_of(K, lin.out)?, i32_of(K, lin.inp)?, i32_of(K, kchunk)?);
        let sb = fp8_plan::STREAM_STAGE_BLOCKS as u32;
        // mma.sync form: 3-D boxes of two k blocks a row; wgmma form: 2-D [rows][128 bytes].
        let tw = if wg.is_some() {
            u8_matrix_map(wp, lin.inp, lin.out, STREAM_COLS as u32)?
        } else {
            u8_kblock_map(wp, lin.inp, lin.out, sb, STREAM_COLS as u32)?
        };
        let kbs = (lin.inp / FP8_BLOCK) as u64;
        let out_bytes = std::mem::size_of::<T>() as u64;
        let mut r0 = 0;
        while r0 < m {
            let rows = slab.min(m - r0);
            let ri = rows as i32;
            let tiles = rows.div_ceil(STREAM_ROWS);
            if tiles > 65_535 || (ksplit > 1 && tiles * cols as usize > fp8_plan::STREAM_COUNTERS) {
                return Err(CudaError::shape(K, "too many rows per launch"));
            }
            let xr = xp + (r0 * lin.inp) as u64;
            let sr = sp + r0 as u64 * kbs * 4;
            let yr = yp + (r0 * lin.out) as u64 * out_bytes;
            // The activation rows of this slab, in boxes of the kernel's staged rows.
            let tx = if wg.is_some() {
                u8_matrix_map(xr, lin.inp, rows, (16 * mt) as u32)?
            } else {
                u8_kblock_map(xr, lin.inp, rows, sb, (16 * mt) as u32)?
            };
            let cfg = LaunchConfig {
                grid_dim: (cols, ksplit as u32, tiles as u32),
                block_dim: (256, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // SAFETY: fp8_stream*/fp8_stream_wg*(tx, tw, y, part, counters, xs, ws, m, n, k,
            // kchunk) (one tile = 64 rows, or all rows ≤ 16·mt when fewer): the
            // tensor maps cover exactly this slab's rows × inp bytes of xq and W's
            // out × inp bytes (made from live buffers; 16-byte rows: inp % 128 == 0); the
            // kernel reads xs rows r0 .. r0 + rows (k/128 scales a row; lengths checked in
            // forward_quantized), ws's scale grid (check_weight), and writes y rows r0..
            // (within m × out) and, with ksplit > 1, part[ks][row][col] for ks < ksplit,
            // row < rows, col < out (within the ksplit × slab × out allocation) and
            // counters[tile · cols + col tile] (< STREAM_COUNTERS, checked above), which
            // the tile's last block sets back to zero. Dynamic shared memory allowed at load.
            // As clusters of the ksplit chunks of a tile, the kernel writes no partials and
            // touches no counter (grid.y = ksplit ≤ STREAM_MAX_SPLIT, a cluster's size).
            if cluster {
                let (mut tx, mut tw, mut yr, mut pp, mut cp, mut sr, mut wsp) = (tx, tw, yr, pp, cp, sr, wsp);
                let (mut ri, mut ni, mut ki, mut kc) = (ri, ni, ki, kc);
                let mut params = [
                    (&mut tx) as *mut _ as *mut std::ffi::c_void,
                    (&mut tw) as *mut _ as *mut _,
                    (&mut yr) as *mut _ as *mut _,
                    (&mut pp) as *mut _ as *mut _,
                    (&mut cp) as *mut _ as *mut _,
                    (&mut sr) as *mut _ as *mut _,
                    (&mut wsp) as *mut _ as *mut _,
                    (&mut ri) as *mut _ as *mut _,
                    (&mut ni) as *mut _ as *mut _,
                    (&mut ki) as *mut _ as *mut _,
                    (&mut kc) as *mut _ as *mut _,
                ];
                // SAFETY: as above; `params` points at this scope's copies of the same
                // arguments, of the kernel's parameter types, alive through the launch.
                unsafe { launch_cluster(s, f, cfg, (1, ksplit as u32, 1), &mut params) }?;
            } else {
                // SAFETY: as above.
                unsafe {
                    s.launch_builder(f)
                        .arg(&tx)
                        .arg(&tw)
                        .arg(&yr)
                        .arg(&pp)
                        .arg(&cp)
                        .arg(&sr)
                        .arg(&wsp)
                        .arg(&ri)
                        .arg(&ni)
                        .arg(&ki)
                        .arg(&kc)
                        .launch(cfg)
                }?;
            }
            r0 += rows;
        }
        Ok(())
    }

    /// The tile kernels: `fp8_gemm_wg*` (one block per 128 × 128 tile) or, `wide`,
    /// `fp8_gemm_wide*` (one block per SM over 128 × 256 tiles).
    #[allow(clippy::too_many_arguments)]
    fn wgmma<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        lin: &Fp8Linear,
        xq: &impl DevicePtr<u8>,
        xs: &impl DevicePtr<f32>,
        m: usize,
        y: &mut impl DevicePtrMut<T>,
        wide: bool,
    ) -> Result<()> {
        const K: &str = "fp8_gemm_wg";
        let wg = self.wg.as_ref().ok_or_else(|| CudaError::shape(K, "no wgmma kernel on this GPU"))?;
        let cols = lin.out.div_ceil(WG_TILE);
        if cols > 65_535 {
            return Err(CudaError::shape(K, "too many columns"));
        }
        let row_tiles = u32::try_from(m.div_ceil(WG_TILE)).map_err(|_| CudaError::shape(K, "too many rows"))?;
        let (f, grid_dim, bn) = if wide {
            let f = self.wide.as_ref().ok_or_else(|| CudaError::shape(K, "no wgmma kernel on this GPU"))?;
            let tiles = i32_of(K, row_tiles as usize * lin.out.div_ceil(WIDE_TILE))? as usize;
            (&f[usize::from(!T::BF16)], (tiles.min(self.num_sms) as u32, 1, 1), WIDE_TILE)
        } else {
            (&wg[usize::from(!T::BF16)], (row_tiles, cols as u32, 1), WG_TILE)
        };
        let (xp, _g1) = xq.device_ptr(s);
        let (sp, _g2) = xs.device_ptr(s);
        let (wp, _g3) = lin.q.device_ptr(s);
        let (wsp, _g4) = lin.scale.device_ptr(s);
        let (yp, _g5) = y.device_ptr_mut(s);
        let tx = u8_matrix_map(xp, lin.inp, m, WG_TILE as u32)?;
        let tw = u8_matrix_map(wp, lin.inp, lin.out, bn as u32)?;
        let (mi, ni, ki) = (i32_of(K, m)?, i32_of(K, lin.out)?, i32_of(K, lin.inp)?);
        let cfg = LaunchConfig { grid_dim, block_dim: (384, 1, 1), shared_mem_bytes: WG_SMEM as u32 };
        // SAFETY: fp8_gemm_wg_*(tx, tw, y, xs, ws, m, n, k): the tensor maps cover exactly
        // xq's m × inp and W's out × inp bytes (made just above from live buffers, 16-byte
        // rows); the kernel reads xs[row][kb] for row < m, ws's scale grid, and writes
        // y[row][col] for row < m, col < out only (lengths checked in forward_quantized);
        // its dynamic shared memory was allowed at load.
        unsafe {
            s.launch_builder(f).arg(&tx).arg(&tw).arg(&yp).arg(&sp).arg(&wsp).arg(&mi).arg(&ni).arg(&ki).launch(cfg)
        }?;
        Ok(())
    }
}

/// The grid of the quantisers (`act_quant_*`, `silu_mul_quant`): one warp per (row,
/// 128-channel group) of `m` rows of `k` channels, 8 warps a block.
fn quant_cfg(kernel: &'static str, m: usize, k: usize) -> Result<LaunchConfig> {
    let warps = m * (k / FP8_BLOCK);
    let blocks = u32::try_from(warps.div_ceil(8)).map_err(|_| CudaError::shape(kernel, "too many rows"))?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
}
