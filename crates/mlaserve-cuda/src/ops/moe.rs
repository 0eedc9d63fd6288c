//! The MoE kernels: routing from the gate's logits (and the router's batch-invariant
//! logits themselves), sorting the routing slots by expert, every expert's GEMM in one
//! launch, and the weighted combine back into the residual stream.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use half::bf16;

use super::Ops;
use crate::error::{CudaError, Result};
use crate::launch::{i32_of, need, row_blocks_cfg, rows_cfg};
use crate::linear::{GemmMode, GemmOut, Linear};
use crate::tensor_map::bf16_tensor_map;

/// The device addresses of one projection (gate_up or down) of every routed expert, for
/// [`Ops::moe_grouped_sorted`]. The weights must outlive it (the owning `Moe` keeps both).
#[derive(Debug)]
pub struct ExpertWeights {
    pub ptrs: CudaSlice<u64>,
    /// Each weight's TMA tensor map (128 bytes: 16 words per expert; box 64 of k × 128
    /// rows), for `moe_grouped_wgt_*`; `None` where the driver would not encode them.
    maps: Option<CudaSlice<u64>>,
    pub count: usize,
    pub out: usize,
    pub inp: usize,
}

impl ExpertWeights {
    /// The table of `weights` (all `[out][inp]`).
    pub fn new(s: &Arc<CudaStream>, weights: &[&Linear]) -> Result<Self> {
        let (out, inp) = weights.first().map_or((0, 0), |l| (l.out, l.inp));
        if weights.iter().any(|l| l.out != out || l.inp != inp) {
            return Err(CudaError::shape("moe_grouped", "experts of different shapes"));
        }
        let ptrs: Vec<u64> = weights.iter().map(|l| l.w.device_ptr(s).0).collect();
        // Tensor maps need 16-byte rows; a weight whose map cannot be encoded leaves the
        // TMA kernel out (the other kernels take every shape).
        let maps = if !ptrs.is_empty() && inp.is_multiple_of(8) {
            let words: std::result::Result<Vec<u64>, _> = ptrs
                .iter()
                .map(|&p| {
                    bf16_tensor_map(p, &[inp as u64, out as u64], &[(inp * 2) as u64], &[64, 128]).map(|m| m.0.opaque)
                })
                .collect::<std::result::Result<Vec<_>, _>>()
                .map(|v| v.concat());
            match words {
                Ok(w) => Some(s.clone_htod(&w)?),
                Err(_) => None,
            }
        } else {
            None
        };
        let ptrs = s.clone_htod(if ptrs.is_empty() { &[0u64][..] } else { &ptrs })?;
        Ok(ExpertWeights { ptrs, maps, count: weights.len(), out, inp })
    }
}

/// How [`Ops::moe_grouped_sorted`] reads the activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupedVariant {
    /// Each warp reads its rows from global memory (best with few rows per expert).
    Direct,
    /// The block stages its rows in shared memory (best with several rows per expert).
    Staged,
    /// mma.sync tensor cores (`gemm_tc.cu`): fast, and a row's sum never depends on the
    /// expert's other rows, but its sums are not `linear_inv`'s, so not for
    /// [`GemmMode::BatchInvariant`].
    TensorCore,
    /// Hopper's warpgroup MMA fed by TMA (`moe_grouped_wgt_*`): up to 192 rows of an
    /// expert per pass over its weight, 128 columns per block; a row's sum never depends
    /// on the expert's other rows, and equals `TensorCore`'s bit for bit on an H200
    /// (asserted by the tensor-core experts test).
    WgmmaTma,
    /// By the backend's GEMM mode: [`GroupedVariant::TensorCore`] (or `WgmmaTma` on Hopper) in
    /// [`GemmMode::Cublas`] and [`GemmMode::InvariantTc`]; in [`GemmMode::BatchInvariant`]
    /// `Direct` or `Staged` by the average rows per expert (both sum as the invariant GEMM
    /// does).
    Auto(GemmMode),
}

/// Routing parameters of one MoE layer, as the kernel takes them.
#[derive(Debug, Clone, Copy)]
pub struct RouteParams {
    pub experts: usize,
    pub k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    /// 0 greedy, 1 group_limited_greedy, 2 noaux_tc.
    pub method: i32,
    /// 0 sigmoid, 1 softmax.
    pub scoring: i32,
    pub normalise: bool,
    pub scale: f32,
}

/// Experts per token `moe_combine_f32` takes (its shared order of the slots).
const COMBINE_MAX_K: usize = 32;

/// `moe_grouped_wgt_*`'s dynamic shared memory: 5 stages of 128 rows of W and 192 of x,
/// 64 bf16 each, a full and an empty barrier per stage, and 1024 bytes to align them.
pub(super) const GROUPED_WGT_SMEM: usize = 1024 + 5 * (128 + 192) * 64 * 2 + 5 * 16;

impl Ops {
    /// Sorts the `tokens × k` routing slots (`ids`, expert per slot) by expert on the
    /// device: `off` (`experts + 1`) each expert's first row, `perm` (`tokens × k`) each
    /// row's token, `inv` (`tokens × k`) each slot's row; `act` (at least `min(experts,
    /// tokens × k)`) the experts with rows in ascending order, then -1s (the grouped fp8
    /// kernels' compact grid).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_sort(
        &self,
        s: &Arc<CudaStream>,
        ids: &CudaSlice<i32>,
        tokens: usize,
        k: usize,
        experts: usize,
        off: &mut CudaSlice<i32>,
        perm: &mut CudaSlice<i32>,
        inv: &mut CudaSlice<i32>,
        act: &mut CudaSlice<i32>,
    ) -> Result<()> {
        const K: &str = "moe_sort";
        let slots = tokens * k;
        if experts == 0 || experts > 1024 || k == 0 {
            return Err(CudaError::shape(K, format!("{experts} experts (1..=1024), k = {k}")));
        }
        need(K, "ids", ids.len(), slots)?;
        need(K, "off", off.len(), experts + 1)?;
        need(K, "perm", perm.len(), slots)?;
        need(K, "inv", inv.len(), slots)?;
        need(K, "act", act.len(), experts.min(slots))?;
        let (sl, ki, ei) = (i32_of(K, slots)?, i32_of(K, k)?, i32_of(K, experts)?);
        // SAFETY: one block reads ids[..slots], writes off[..=experts], perm/inv rows
        // < slots (the per-expert counts sum to slots; out-of-range ids count as expert 0)
        // and act[..min(experts, slots)] (at most that many experts have rows).
        unsafe {
            s.launch_builder(&self.moe_sort)
                .arg(ids)
                .arg(&sl)
                .arg(&ki)
                .arg(&ei)
                .arg(off)
                .arg(perm)
                .arg(inv)
                .arg(act)
                .launch(rows_cfg(1, 1024, 0))
        }?;
        Ok(())
    }

    /// The MoE experts in one launch: for each expert `g`, rows `off[g]..off[g + 1]` of `x`
    /// (sorted by expert, `k` wide) times its `[n][k]` bf16 weight (`weights` holds the
    /// addresses) into the same rows of `y` (`T`: bf16 or f32). `off`
    /// (`experts + 1`) comes from [`Ops::moe_sort`] and is never read on the host; `rows`
    /// sorted rows in all; experts without rows return at once. `variant` picks the kernel:
    /// the CUDA-core ones (`Direct`, `Staged`: the same bits, equal to the invariant GEMM's)
    /// or tensor cores (fast mode only).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_grouped_sorted<T: GemmOut>(
        &self,
        s: &Arc<CudaStream>,
        y: &mut CudaSlice<T>,
        x: &CudaSlice<bf16>,
        weights: &ExpertWeights,
        off: &CudaSlice<i32>,
        rows: usize,
        variant: GroupedVariant,
    ) -> Result<()> {
        const K: &str = "moe_grouped";
        let (n, k) = (weights.out, weights.inp);
        if k % 8 != 0 {
            return Err(CudaError::shape(K, format!("k = {k} is not a multiple of 8")));
        }
        need(K, "off", off.len(), weights.count + 1)?;
        need(K, "x", x.len(), rows * k)?;
        need(K, "y", y.len(), rows * n)?;
        let out_f32 = !T::BF16;
        if rows == 0 || weights.count == 0 {
            return Ok(());
        }
        let (ni, ki) = (i32_of(K, n)?, i32_of(K, k)?);
        #[derive(PartialEq)]
        enum Kind {
            Direct,
            Staged,
            Tc,
            Wgt,
        }
        // wgmma (fed by TMA, where the weights have tensor maps) from 16 rows per expert on
        // average (prefill; at 8 it was 2% slower than mma.sync, at 64 30% faster). Both
        // round alike (the tensor-core experts test asserts it), so the choice by batch
        // size keeps a row's bits.
        let tma = self.grouped_wgt.is_some() && weights.maps.is_some();
        let wg_auto = self.wgmma && tma && rows >= 16 * weights.count;
        let kind = match variant {
            GroupedVariant::Direct => Kind::Direct,
            GroupedVariant::Staged => Kind::Staged,
            GroupedVariant::TensorCore => Kind::Tc,
            GroupedVariant::WgmmaTma if !tma => {
                return Err(CudaError::shape(K, "the TMA experts need an sm_90 GPU and encodable tensor maps"));
            }
            GroupedVariant::WgmmaTma => Kind::Wgt,
            GroupedVariant::Auto(GemmMode::Cublas) | GroupedVariant::Auto(GemmMode::InvariantTc) if wg_auto => {
                Kind::Wgt
            }
            GroupedVariant::Auto(GemmMode::Cublas) | GroupedVariant::Auto(GemmMode::InvariantTc) => Kind::Tc,
            // Measured on H200 (V3 experts): staging pays from about 4 rows per expert.
            GroupedVariant::Auto(GemmMode::BatchInvariant) if rows >= 4 * weights.count => Kind::Staged,
            GroupedVariant::Auto(GemmMode::BatchInvariant) => Kind::Direct,
        };
        // CUDA cores: 32 columns per 256-thread block; tensor cores: 64 per 128 threads
        // (static shared memory, 48 KiB); wgmma with TMA: 128 per producer and two consumer
        // warpgroups.
        let (cols, threads, smem) = match kind {
            Kind::Tc => (64, 128, 0),
            Kind::Wgt => (128, 384, GROUPED_WGT_SMEM),
            _ => (32, 256, 0),
        };
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(cols) as u32, weights.count as u32, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let no_experts: u64 = 0; // null: group g is expert g
        if kind == Kind::Wgt {
            let (Some(fs), Some(maps)) = (&self.grouped_wgt, &weights.maps) else { unreachable!("checked above") };
            // x [rows][k] in boxes of 64 × 64 (k % 8 == 0 checked: 16-byte rows).
            let tx = bf16_tensor_map(x.device_ptr(s).0, &[k as u64, rows as u64], &[(k * 2) as u64], &[64, 64])?;
            // SAFETY: moe_grouped_wgt_*(const __grid_constant__ CUtensorMap tx, const
            // CUtensorMap* wmaps, T* y, const int* experts, const int* off, int n, int k),
            // T f32 or bf16 (the caller's y, `out_f32` from its type). tx covers rows*k elements of x
            // (checked); `maps` holds `count` live 128-byte maps of the `[n][k]` weights
            // (64-byte aligned: 128 bytes each from a 256-byte aligned allocation), g <
            // count; `off` from moe_sort over `rows` slots is non-decreasing from 0 to rows,
            // so group g writes rows < rows of y (rows*n, checked), columns < n.
            unsafe {
                s.launch_builder(&fs[out_f32 as usize])
                    .arg(&tx)
                    .arg(maps)
                    .arg(y)
                    .arg(&no_experts)
                    .arg(off)
                    .arg(&ni)
                    .arg(&ki)
                    .launch(cfg)
            }?;
            return Ok(());
        }
        let f = match (kind, out_f32) {
            (Kind::Direct, false) => &self.grouped_bf16,
            (Kind::Direct, true) => &self.grouped_f32,
            (Kind::Staged, false) => &self.grouped_staged_bf16,
            (Kind::Staged, true) => &self.grouped_staged_f32,
            (Kind::Tc, false) => &self.grouped_tc_bf16,
            (Kind::Tc, true) => &self.grouped_tc_f32,
            (Kind::Wgt, _) => unreachable!("launched above"),
        };

        // SAFETY: every entry point takes (T* y, const bf16* x, const bf16* const* w,
        // const int* experts, const int* off, int n, int k) with T f32 when out_f32 (from T), else
        // bf16 (the caller's y). `off` comes from moe_sort over `rows` slots: non-decreasing
        // from 0 to rows, so group g reads rows < rows of x (rows*k, checked) and writes the
        // same rows of y (rows*n, checked); columns past n and k are masked or zero-filled;
        // g < count indexes the address table (live `[n][k]` weights, 256-byte aligned as
        // cudarc allocates them; k % 8 == 0 keeps every row 16-byte aligned).
        unsafe {
            s.launch_builder(f).arg(y).arg(x).arg(&weights.ptrs).arg(&no_experts).arg(off).arg(&ni).arg(&ki).launch(cfg)
        }?;
        Ok(())
    }

    /// Router logits in f32: `y[m][n] = x[m][k] · w[n][k]` (x, w f32), a row's logits
    /// the same bits in any batch ([`Router::logits`]).
    #[allow(clippy::too_many_arguments)]
    pub fn router_logits(
        &self,
        s: &Arc<CudaStream>,
        y: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<()> {
        self.router.logits(s, y, x, w, m, n, k)
    }

    /// Router logits for [`Ops::route_split`]: `(buffer, ksplit)`, the logits `[m][n]`
    /// (ksplit 1) or their k-range partials `[ksplit][m][n]` ([`Router::logits_split`]).
    #[allow(clippy::too_many_arguments)]
    pub fn router_logits_split(
        &self,
        s: &Arc<CudaStream>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(CudaSlice<f32>, usize)> {
        self.router.logits_split(s, x, w, m, n, k)
    }

    /// Routes `n` tokens from gate logits `[n][experts]`: `ids`/`weights` `[n][k]`.
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &self,
        s: &Arc<CudaStream>,
        ids: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        bias: Option<&CudaSlice<f32>>,
        n: usize,
        p: &RouteParams,
    ) -> Result<()> {
        self.route_split(s, ids, weights, (logits, 1), bias, n, p)
    }

    /// [`Ops::route`] from `logits.0` holding the router's `logits.1` k-range partials
    /// `[ksplit][n][experts]` (1: the logits themselves), summed in range order inside the
    /// routing kernel: the bits of [`Router::logits`]'s reduce.
    #[allow(clippy::too_many_arguments)]
    pub fn route_split(
        &self,
        s: &Arc<CudaStream>,
        ids: &mut CudaSlice<i32>,
        weights: &mut CudaSlice<f32>,
        logits: (&CudaSlice<f32>, usize),
        bias: Option<&CudaSlice<f32>>,
        n: usize,
        p: &RouteParams,
    ) -> Result<()> {
        const K: &str = "moe_route_f32";
        let (logits, ksplit) = logits;
        if ksplit == 0 {
            return Err(CudaError::shape(K, "0 k ranges"));
        }
        need(K, "logits", logits.len(), ksplit * n * p.experts)?;
        need(K, "ids", ids.len(), n * p.k)?;
        need(K, "weights", weights.len(), n * p.k)?;
        if p.n_group == 0 || !p.experts.is_multiple_of(p.n_group) || p.k == 0 || p.k > p.experts {
            return Err(CudaError::shape(K, format!("bad routing shape {p:?}")));
        }
        if let Some(b) = bias {
            need(K, "bias", b.len(), p.experts)?;
        }
        if n == 0 {
            return Ok(());
        }
        let smem = (2 * p.experts + p.n_group) * 4 + p.experts + p.n_group;
        let (e, k, g, tg) = (i32_of(K, p.experts)?, i32_of(K, p.k)?, i32_of(K, p.n_group)?, i32_of(K, p.topk_group)?);
        let (has_bias, norm) = (bias.is_some() as i32, p.normalise as i32);
        let b = bias.unwrap_or(logits);
        let ks = i32_of(K, ksplit)?;
        // SAFETY: block t reads logits[z*n*E + t*E..][..E] for z < ksplit and bias[..E]
        // (only when has_bias; the stand-in is a live buffer otherwise), writes
        // ids/weights[t*k..][..k]; lengths checked (grid.x = n); shared memory holds
        // 2E + G floats and E + G bytes.
        unsafe {
            s.launch_builder(&self.route)
                .arg(ids)
                .arg(weights)
                .arg(logits)
                .arg(b)
                .arg(&e)
                .arg(&k)
                .arg(&g)
                .arg(&tg)
                .arg(&p.method)
                .arg(&p.scoring)
                .arg(&has_bias)
                .arg(&norm)
                .arg(&p.scale)
                .arg(&ks)
                .launch(rows_cfg(n, 128, smem))
        }?;
        Ok(())
    }

    /// `out[t] += Σ_j (ascending expert id) weights[t][j] · y[inv[t*k + j]]`.
    #[allow(clippy::too_many_arguments)]
    pub fn combine(
        &self,
        s: &Arc<CudaStream>,
        out: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        ids: &CudaSlice<i32>,
        weights: &CudaSlice<f32>,
        inv: &CudaSlice<i32>,
        n: usize,
        k: usize,
        h: usize,
    ) -> Result<()> {
        const K: &str = "moe_combine_f32";
        need(K, "out", out.len(), n * h)?;
        need(K, "y", y.len(), n * k * h)?;
        need(K, "ids", ids.len(), n * k)?;
        need(K, "weights", weights.len(), n * k)?;
        need(K, "inv", inv.len(), n * k)?;
        if k > COMBINE_MAX_K {
            return Err(CudaError::shape(K, format!("k = {k} experts per token > {COMBINE_MAX_K}")));
        }
        if n == 0 {
            return Ok(());
        }
        let (ki, hi) = (i32_of(K, k)?, i32_of(K, h)?);
        // SAFETY: blocks (t, ..) read ids/weights/inv[t*k..][..k] (k <= COMBINE_MAX_K, the
        // size of its shared order) and rows inv[..] < n*k of y (a permutation built by the
        // caller), write disjoint columns of out[t*h..][..h]; lengths checked. float4 accesses only when
        // h % 4 == 0, on cudarc's 256-byte aligned allocations.
        unsafe {
            s.launch_builder(&self.combine)
                .arg(out)
                .arg(y)
                .arg(ids)
                .arg(weights)
                .arg(inv)
                .arg(&ki)
                .arg(&hi)
                .launch(row_blocks_cfg(n, if h.is_multiple_of(4) { h / 4 } else { h }, 256, 1))
        }?;
        Ok(())
    }
}
