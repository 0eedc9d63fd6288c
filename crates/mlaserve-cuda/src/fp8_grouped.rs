//! FP8 routed experts: [`Fp8Experts`] (every expert's e4m3 weight of one projection in
//! one device buffer, with its 128 × 128 block scales) and [`Fp8Grouped`]
//! (`fp8_grouped_wg*` of `kernels/fp8_gemm.cu`: all experts of a MoE layer in one launch
//! over rows sorted by expert). Semantics as [`crate::fp8`]: `y[r][c] = Σ_kb (Σ_{k in kb}
//! qx·qw) · sx[r][kb] · sw[e][c / 128][kb]` in f32 for a row `r` of expert `e`, each k
//! block's partial promoted into the f32 total; the activation comes quantised by
//! [`Fp8Gemm::act_quant`](crate::fp8::Fp8Gemm::act_quant). Planning and validation are in
//! [`crate::fp8_plan`] (CPU-tested).
//!
//! The kernel is Hopper's (sm_90a wgmma); elsewhere [`Fp8Grouped::new`] fails.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};

use crate::error::{CudaError, Result};
use crate::fp8_plan::{self, FP8_BLOCK, STREAM_COLS, WG_SMEM, WG_TILE};
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::{i32_of, need, with_smem};
use crate::linear::GemmOut;
use crate::tensor_map::u8_matrix_map;

/// One projection of every routed expert: codes `[experts][out][inp]` (e4m3 bytes) and
/// scales `[experts][ceil(out / 128)][inp / 128]`, each expert's as a checkpoint's
/// `weight` / `weight_scale_inv` hold them.
#[derive(Debug)]
pub struct Fp8Experts {
    pub q: CudaSlice<u8>,
    pub scale: CudaSlice<f32>,
    pub experts: usize,
    pub out: usize,
    /// Stored input width, a multiple of 128 (see [`crate::fp8::Fp8Linear`]'s padding).
    pub inp: usize,
    /// Input channels of the activation (`≤ inp`).
    pub x_inp: usize,
}

impl Fp8Experts {
    /// Uploads all experts from one host buffer each for codes and scales (checked).
    pub fn from_raw(
        s: &Arc<CudaStream>,
        q: &[u8],
        scales: &[f32],
        experts: usize,
        out: usize,
        inp: usize,
    ) -> Result<Self> {
        fp8_plan::check_experts(experts, out, inp, q.len(), scales.len())
            .map_err(|e| CudaError::shape("Fp8Experts", e))?;
        Ok(Fp8Experts { q: s.clone_htod(q)?, scale: s.clone_htod(scales)?, experts, out, inp, x_inp: inp })
    }

    /// Uploads the experts from one slice pair per expert (each checked as a weight
    /// `[out][inp]`), packed in order.
    pub fn from_experts(s: &Arc<CudaStream>, experts: &[(&[u8], &[f32])], out: usize, inp: usize) -> Result<Self> {
        const K: &str = "Fp8Experts";
        for (i, (q, sc)) in experts.iter().enumerate() {
            fp8_plan::check_weight(out, inp, q.len(), sc.len())
                .map_err(|e| CudaError::shape(K, format!("expert {i}: {e}")))?;
        }
        fp8_plan::check_experts(experts.len(), out, inp, experts.len() * out * inp, {
            let (so, si) = fp8_plan::scale_shape(out, inp);
            experts.len() * so * si
        })
        .map_err(|e| CudaError::shape(K, e))?;
        let (so, si) = fp8_plan::scale_shape(out, inp);
        // SAFETY: every byte and scale is copied in below before the buffers are returned.
        let mut q = unsafe { s.alloc::<u8>(experts.len() * out * inp) }?;
        let mut scale = unsafe { s.alloc::<f32>(experts.len() * so * si) }?;
        for (i, (eq, es)) in experts.iter().enumerate() {
            s.memcpy_htod(*eq, &mut q.slice_mut(i * out * inp..(i + 1) * out * inp))?;
            s.memcpy_htod(*es, &mut scale.slice_mut(i * so * si..(i + 1) * so * si))?;
        }
        Ok(Fp8Experts { q, scale, experts: experts.len(), out, inp, x_inp: inp })
    }

    /// Device buffers already filled (codes `[experts][out][inp]`, scales per expert as
    /// [`Fp8Experts::from_raw`]), for an activation of `x_inp ≤ inp` channels; checked.
    pub fn from_parts(
        q: CudaSlice<u8>,
        scale: CudaSlice<f32>,
        experts: usize,
        out: usize,
        inp: usize,
        x_inp: usize,
    ) -> Result<Self> {
        fp8_plan::check_experts(experts, out, inp, q.len(), scale.len())
            .map_err(|e| CudaError::shape("Fp8Experts", e))?;
        if fp8_plan::padded_inp(x_inp) != Ok(inp) {
            return Err(CudaError::shape("Fp8Experts", format!("{x_inp} input channels stored as {inp}")));
        }
        Ok(Fp8Experts { q, scale, experts, out, inp, x_inp })
    }

    /// Bytes of one expert's codes and scales on the device.
    pub fn expert_bytes(&self) -> usize {
        let (so, si) = fp8_plan::scale_shape(self.out, self.inp);
        self.out * self.inp + 4 * so * si
    }
}

/// The grouped fp8 expert GEMM on one GPU (Hopper).
#[derive(Debug)]
pub struct Fp8Grouped {
    /// `fp8_grouped_wg{16,32,64}_*` [bf16 out, f32 out].
    wg: [[CudaFunction; 2]; 3],
    /// `fp8_grouped_tile_*` [bf16 out, f32 out].
    tile: [CudaFunction; 2],
}

impl Fp8Grouped {
    /// Loads the grouped kernels; an error on a GPU without wgmma (sm_90) or the shared
    /// memory they need.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        if gpu.compute_capability != (9, 0) || gpu.max_smem_optin < WG_SMEM {
            return Err(CudaError::shape("fp8_grouped", "the grouped fp8 expert kernel needs a Hopper (sm_90) GPU"));
        }
        let m = gpu.load_module(kernels::FP8_GROUPED)?;
        let st = |nt: usize| -> Result<[CudaFunction; 2]> {
            let smem = fp8_plan::stream_wg_smem(nt);
            Ok([
                with_smem(&m, &format!("fp8_grouped_wg{nt}_obf16"), smem)?,
                with_smem(&m, &format!("fp8_grouped_wg{nt}_of32"), smem)?,
            ])
        };
        Ok(Fp8Grouped {
            wg: [st(16)?, st(32)?, st(64)?],
            tile: [with_smem(&m, "fp8_grouped_tile_obf16", WG_SMEM)?, with_smem(&m, "fp8_grouped_tile_of32", WG_SMEM)?],
        })
    }

    /// `y[r] = x[r] · W[e]ᵀ` for every row `r` in `off[e] .. off[e + 1]` of every expert
    /// `e`: `xq [rows][inp]` e4m3 bytes and `xs [rows][inp / 128]` scales (sorted by
    /// expert, as from `moe_sort` and `act_quant`), `off` (`experts + 1`, non-decreasing
    /// from 0 to `rows`, on the device and never read here), `y [rows][out]` bf16 or f32.
    /// With `act` (moe_sort's list of the experts with rows, then -1s) the grid covers
    /// `min(experts, rows)` experts instead of all. The rows per pass over a weight come
    /// from [`fp8_plan::grouped_tile`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        w: &Fp8Experts,
        xq: &impl DevicePtr<u8>,
        xs: &impl DevicePtr<f32>,
        off: &CudaSlice<i32>,
        act: Option<&CudaSlice<i32>>,
        rows: usize,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        self.forward_tile(s, w, xq, xs, off, act, rows, y, fp8_plan::grouped_tile(rows, w.experts))
    }

    /// As [`Fp8Grouped::forward`] with `tile` (16, 32 or 64) rows per pass.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_tile<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        w: &Fp8Experts,
        xq: &impl DevicePtr<u8>,
        xs: &impl DevicePtr<f32>,
        off: &CudaSlice<i32>,
        act: Option<&CudaSlice<i32>>,
        rows: usize,
        y: &mut impl DevicePtrMut<T>,
        tile: usize,
    ) -> Result<()> {
        const K: &str = "fp8_grouped";
        let ti = match tile {
            16 => 0,
            32 => 1,
            64 => 2,
            _ => return Err(CudaError::shape(K, format!("tile {tile} (16, 32 or 64)"))),
        };
        let f = &self.wg[ti][usize::from(!T::BF16)];
        let geometry = Geometry { x_rows: tile, cols: STREAM_COLS, threads: 256, smem: fp8_plan::stream_wg_smem(tile) };
        launch(K, s, f, geometry, w, xq, xs, off, act, rows, y)
    }

    /// As [`Fp8Grouped::forward`] through `fp8_grouped_tile_*` (128 × 128 tiles: for
    /// prefill-sized experts, tens of rows per expert and more). A row's bits do not
    /// depend on the other rows, but differ from [`Fp8Grouped::forward`]'s.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_tiled<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        w: &Fp8Experts,
        xq: &impl DevicePtr<u8>,
        xs: &impl DevicePtr<f32>,
        off: &CudaSlice<i32>,
        act: Option<&CudaSlice<i32>>,
        rows: usize,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        const K: &str = "fp8_grouped_tile";
        let f = &self.tile[usize::from(!T::BF16)];
        let geometry = Geometry { x_rows: WG_TILE, cols: WG_TILE, threads: 384, smem: WG_SMEM };
        launch(K, s, f, geometry, w, xq, xs, off, act, rows, y)
    }
}

/// A grouped kernel's launch shape: activation rows per TMA box, weight rows (output
/// columns) per block, threads, dynamic shared memory.
struct Geometry {
    x_rows: usize,
    cols: usize,
    threads: u32,
    smem: usize,
}

/// Checks a grouped call and launches `f(tx, tw, y, xs, ws, off, act, n, k)` on grid
/// (⌈out / cols⌉, experts), or (⌈out / cols⌉, min(experts, rows)) with `act`; nothing
/// when there are no rows.
#[allow(clippy::too_many_arguments)]
fn launch<T: GemmOut>(
    k: &'static str,
    s: &Arc<CudaStream>,
    f: &CudaFunction,
    g: Geometry,
    w: &Fp8Experts,
    xq: &impl DevicePtr<u8>,
    xs: &impl DevicePtr<f32>,
    off: &CudaSlice<i32>,
    act: Option<&CudaSlice<i32>>,
    rows: usize,
    y: &mut impl DevicePtrMut<T>,
) -> Result<()> {
    if !check_call(k, w, xq, xs, off, rows, y.len())? {
        return Ok(());
    }
    let blocks_y = match act {
        Some(a) => {
            let n = w.experts.min(rows);
            need(k, "act", a.len(), n)?;
            n
        }
        None => w.experts,
    };
    let (ni, ki) = (i32_of(k, w.out)?, i32_of(k, w.inp)?);
    let cols = u32::try_from(w.out.div_ceil(g.cols)).map_err(|_| CudaError::shape(k, "too many columns"))?;
    let (xp, _g1) = xq.device_ptr(s);
    let (sp, _g2) = xs.device_ptr(s);
    let (wp, _g3) = w.q.device_ptr(s);
    let (wsp, _g4) = w.scale.device_ptr(s);
    let (op, _g5) = off.device_ptr(s);
    let (yp, _g6) = y.device_ptr_mut(s);
    let (ap, _g7) = match act {
        Some(a) => {
            let (p, g) = a.device_ptr(s);
            (p, Some(g))
        }
        None => (0, None),
    };
    // x [rows][inp] in boxes of 128 bytes × x_rows rows; W [experts·out][inp] in 128 bytes
    // × cols rows.
    let tx = u8_matrix_map(xp, w.inp, rows, g.x_rows as u32)?;
    let tw = u8_matrix_map(wp, w.inp, w.experts * w.out, g.cols as u32)?;
    let cfg = LaunchConfig {
        grid_dim: (cols, blocks_y as u32, 1),
        block_dim: (g.threads, 1, 1),
        shared_mem_bytes: g.smem as u32,
    };
    // SAFETY: fp8_grouped_wg* and fp8_grouped_tile_* take (tx, tw, y, xs, ws, off, act, n,
    // k); `act` is null or holds the grid's min(experts, rows) entries (checked), each an
    // expert < experts or -1 (moe_sort's contract); otherwise:
    // tx covers exactly xq's rows × inp bytes and tw the experts' experts·out × inp bytes
    // (made just above from live buffers; inp % 128 == 0 keeps rows 16-byte aligned);
    // `off` (experts + 1 entries, checked) is non-decreasing from 0 to rows (the caller's
    // contract, as moe_sort writes it), so block (c, e) reads xs rows < rows (inp/128
    // each, checked) and the scales of expert e (< experts, check_experts), and writes y
    // rows < rows, columns < out (rows·out, checked). The kernel's dynamic shared memory
    // was allowed at load; e·out + 128 fits i32 (check_experts).
    unsafe {
        s.launch_builder(f)
            .arg(&tx)
            .arg(&tw)
            .arg(&yp)
            .arg(&sp)
            .arg(&wsp)
            .arg(&op)
            .arg(&ap)
            .arg(&ni)
            .arg(&ki)
            .launch(cfg)
    }?;
    Ok(())
}

/// The checks every grouped call makes before a launch; `false` when there is nothing to
/// do (no rows).
fn check_call(
    k: &'static str,
    w: &Fp8Experts,
    xq: &impl DevicePtr<u8>,
    xs: &impl DevicePtr<f32>,
    off: &CudaSlice<i32>,
    rows: usize,
    y_len: usize,
) -> Result<bool> {
    fp8_plan::check_experts(w.experts, w.out, w.inp, w.q.len(), w.scale.len()).map_err(|e| CudaError::shape(k, e))?;
    need(k, "off", off.len(), w.experts + 1)?;
    need(k, "xq", xq.len(), rows * w.inp)?;
    need(k, "xs", xs.len(), rows * w.inp / FP8_BLOCK)?;
    need(k, "y", y_len, rows * w.out)?;
    if rows == 0 {
        return Ok(false);
    }
    i32_of(k, rows)?;
    Ok(true)
}
