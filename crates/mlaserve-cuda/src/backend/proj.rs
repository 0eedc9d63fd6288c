//! A projection as the backend holds it ([`Proj`]): bf16, or fp8 e4m3 with its 128 × 128
//! block scales when the checkpoint stores it so (and [`CudaOptions::fp8_kernels`] is
//! on); the loader's fp8 paths (projections, fused gate_up, every routed expert of a
//! layer in one buffer for the grouped kernel); and the dispatch of a projection call.
//!
//! An fp8 projection runs the block-scaled fp8 GEMM (`crate::fp8`): its input is
//! quantised per token per 128 channels on the way in, the semantics of
//! `mlaserve-cpu`'s fp8 linears (docs/fp8.md). A weight of fewer than a multiple of 128
//! input channels (tiny test models) is stored padded with zero columns, which changes
//! nothing; a tensor-parallel shard that does not start on a scale block, or a block
//! size other than 128 × 128, is widened to bf16 instead (the dequantised model).
//!
//! [`CudaOptions::fp8_kernels`]: super::CudaOptions::fp8_kernels

use cudarc::driver::{CudaSlice, CudaViewMut, DevicePtr, DevicePtrMut};
use half::bf16;
use mlaserve_model::{Fp8Tensor, Shard};

use super::weights::{mlerr, Loader};
use super::{weights, CudaBackend, CudaOptions, WeightBytes};
use crate::error::Result;
use crate::fp8::{Fp8Gemm, Fp8Linear};
use crate::fp8_grouped::{Fp8Experts, Fp8Grouped};
use crate::fp8_plan::{self, Fp8Path, StoredFp8, FP8_BLOCK};
use crate::gpu::Gpu;
use crate::linear::{GemmOut, Linear};

/// A normed activation as the projections that read it take it: bf16, or already
/// quantised for fp8 weights of its width (codes `[n][inp]`, scales `[n][inp / 128]`).
pub(crate) enum Normed {
    Bf16(CudaSlice<bf16>),
    Fp8 { q: CudaSlice<u8>, scale: CudaSlice<f32>, x_inp: usize, inp: usize },
}

/// A weight `[out][inp]` on the device, in the precision it runs in.
#[derive(Debug)]
pub(crate) enum Proj {
    Bf16(Linear),
    Fp8(Fp8Linear),
}

impl Proj {
    /// Output features.
    pub fn out(&self) -> usize {
        match self {
            Proj::Bf16(l) => l.out,
            Proj::Fp8(l) => l.out,
        }
    }
    /// Input features (the activation's width).
    pub fn inp(&self) -> usize {
        match self {
            Proj::Bf16(l) => l.inp,
            Proj::Fp8(l) => l.x_inp,
        }
    }
    /// Bytes on the device (codes and scales for fp8).
    pub fn bytes(&self) -> u64 {
        match self {
            Proj::Bf16(l) => (l.w.len() * 2) as u64,
            Proj::Fp8(l) => l.bytes() as u64,
        }
    }
}

/// The fp8 kernels a backend runs its fp8 projections with.
#[derive(Debug)]
pub(crate) struct Fp8Kernels {
    pub gemm: Fp8Gemm,
    /// The grouped expert GEMM (Hopper); elsewhere fp8 experts run one by one.
    pub grouped: Option<Fp8Grouped>,
}

impl Fp8Kernels {
    /// The fp8 kernels for `opts` on `gpu` (the batch-invariant streaming kernel when the
    /// options are batch-invariant), or `None` when `opts.fp8_kernels` is off or they do
    /// not load here (logged: the fp8 weights are then widened to bf16).
    pub fn new(gpu: &Gpu, opts: &CudaOptions) -> Option<Self> {
        if !opts.fp8_kernels {
            return None;
        }
        let path = if opts.gemm.batch_invariant() { Fp8Path::Stream } else { Fp8Path::Auto };
        match Fp8Gemm::new(gpu, path) {
            Ok(gemm) => Some(Fp8Kernels { gemm, grouped: Fp8Grouped::new(gpu).ok() }),
            Err(e) => {
                tracing::warn!("fp8 kernels unavailable ({e}); fp8 weights are widened to bf16");
                None
            }
        }
    }
}

impl Loader<'_> {
    /// Whether linear `name` (full `shape`, split along `shard`) stays fp8 on the device.
    pub fn keeps_fp8(&self, name: &str, shape: [usize; 2], shard: Option<usize>) -> bool {
        if !self.fp8 || !self.w.is_fp8(name) || self.w.fp8_block() != [FP8_BLOCK, FP8_BLOCK] {
            return false;
        }
        let local_inp = match shard {
            Some(1) => shape[1] / self.world,
            _ => shape[1],
        };
        let on_grid = match shard {
            Some(d) if self.world > 1 => (shape[d] / self.world).is_multiple_of(FP8_BLOCK),
            _ => true,
        };
        on_grid && fp8_plan::padded_inp(local_inp).is_ok()
    }

    /// This rank's shard of fp8 linear `name`.
    pub fn fp8_tensor(&self, name: &str, shape: [usize; 2], shard: Option<usize>) -> Result<Fp8Tensor<'_>> {
        self.w.fp8_shard(name, shape, shard.map(|d| Shard::new(d, self.rank, self.world))).map_err(mlerr)
    }

    /// `name` as a projection: fp8 when [`Loader::keeps_fp8`], else bf16.
    pub fn proj(&self, name: &str, out: usize, inp: usize, shard: Option<usize>) -> Result<Proj> {
        if self.keeps_fp8(name, [out, inp], shard) {
            let t = self.fp8_tensor(name, [out, inp], shard)?;
            let st = StoredFp8::plain(t.out, t.inp).map_err(|e| mlerr_s(name, e))?;
            let (mut q, mut sc) = (self.s.alloc_zeros::<u8>(st.codes())?, self.s.alloc_zeros::<f32>(st.scales())?);
            self.put_fp8(&t, st.inp, &mut q.as_view_mut(), &mut sc.as_view_mut())?;
            return Ok(Proj::Fp8(fp8_linear(q, sc, st)));
        }
        Ok(Proj::Bf16(self.lin(name, out, inp, shard)?))
    }

    /// Copies `t` into `q` (rows of `inp` bytes, `inp` ≥ `t.inp`: zero columns beyond)
    /// and its scales into `sc`, at the views' starts.
    fn put_fp8(
        &self,
        t: &Fp8Tensor,
        inp: usize,
        q: &mut CudaViewMut<'_, u8>,
        sc: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let n = t.out * inp;
        let mut stage = self.stage.borrow_mut();
        if inp == t.inp {
            stage.upload(self.s, &t.q, &mut q.slice_mut(0..n))?;
        } else {
            stage.upload(self.s, &fp8_plan::pad_rows(&t.q, t.out, t.inp, inp), &mut q.slice_mut(0..n))?;
        }
        stage.upload_f32(self.s, &t.scales, &mut sc.slice_mut(0..t.scales.len()))?;
        Ok(())
    }

    /// A SwiGLU's gate and up (`[inter, h]` each, split along rows) as one fp8
    /// projection `[gate | up]` stored as `st` ([`StoredFp8::gate_up`]: halves on scale
    /// rows), written into `q`/`sc` (zeroed, `st`'s sizes) at their starts.
    fn put_gate_up(
        &self,
        prefix: &str,
        h: usize,
        inter: usize,
        st: StoredFp8,
        q: &mut CudaViewMut<'_, u8>,
        sc: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (half_codes, half_scales) = (st.codes() / 2, st.scales() / 2);
        for (i, part) in ["gate_proj", "up_proj"].iter().enumerate() {
            let t = self.fp8_tensor(&format!("{prefix}.{part}.weight"), [inter, h], Some(0))?;
            let mut qv = q.slice_mut(i * half_codes..(i + 1) * half_codes);
            let mut sv = sc.slice_mut(i * half_scales..(i + 1) * half_scales);
            self.put_fp8(&t, st.inp, &mut qv, &mut sv)?;
        }
        Ok(())
    }

    /// Whether a SwiGLU at `prefix` runs in fp8: gate, up and down all stay fp8.
    pub fn mlp_fp8(&self, prefix: &str, h: usize, inter: usize) -> bool {
        ["gate_proj", "up_proj"].iter().all(|p| self.keeps_fp8(&format!("{prefix}.{p}.weight"), [inter, h], Some(0)))
            && self.keeps_fp8(&format!("{prefix}.down_proj.weight"), [h, inter], Some(1))
    }

    /// A SwiGLU's fused fp8 gate_up (see [`Loader::put_gate_up`]).
    pub fn fp8_gate_up(&self, prefix: &str, h: usize, inter: usize) -> Result<Proj> {
        let st = StoredFp8::gate_up(inter / self.world, h).map_err(|e| mlerr_s(prefix, e))?;
        let (mut q, mut sc) = (self.s.alloc_zeros::<u8>(st.codes())?, self.s.alloc_zeros::<f32>(st.scales())?);
        self.put_gate_up(prefix, h, inter, st, &mut q.as_view_mut(), &mut sc.as_view_mut())?;
        Ok(Proj::Fp8(fp8_linear(q, sc, st)))
    }

    /// Every routed expert of a MoE layer (`prefix.{i}`) as two grouped fp8 weights:
    /// the fused gate_up of each (halves on scale rows) and down.
    pub fn fp8_experts(
        &self,
        prefix: &str,
        experts: usize,
        h: usize,
        inter: usize,
    ) -> Result<(Fp8Experts, Fp8Experts)> {
        let local = inter / self.world;
        let gu = StoredFp8::gate_up(local, h).map_err(|e| mlerr_s(prefix, e))?;
        let dn = StoredFp8::plain(h, local).map_err(|e| mlerr_s(prefix, e))?;
        let (mut gq, mut gs) =
            (self.s.alloc_zeros::<u8>(experts * gu.codes())?, self.s.alloc_zeros::<f32>(experts * gu.scales())?);
        let (mut dq, mut ds) =
            (self.s.alloc_zeros::<u8>(experts * dn.codes())?, self.s.alloc_zeros::<f32>(experts * dn.scales())?);
        let range = |e: usize, n: usize| e * n..(e + 1) * n;
        for e in 0..experts {
            let p = format!("{prefix}.{e}");
            let (mut q, mut s) = (gq.slice_mut(range(e, gu.codes())), gs.slice_mut(range(e, gu.scales())));
            self.put_gate_up(&p, h, inter, gu, &mut q, &mut s)?;
            let t = self.fp8_tensor(&format!("{p}.down_proj.weight"), [h, inter], Some(1))?;
            let (mut q, mut s) = (dq.slice_mut(range(e, dn.codes())), ds.slice_mut(range(e, dn.scales())));
            self.put_fp8(&t, dn.inp, &mut q, &mut s)?;
        }
        Ok((fp8_experts(gq, gs, experts, gu)?, fp8_experts(dq, ds, experts, dn)?))
    }
}

/// An [`Fp8Linear`] over filled buffers of `st`'s sizes.
pub(crate) fn fp8_linear(q: CudaSlice<u8>, scale: CudaSlice<f32>, st: StoredFp8) -> Fp8Linear {
    Fp8Linear { q, scale, out: st.out, inp: st.inp, x_inp: st.x_inp }
}

/// [`Fp8Experts`] over filled buffers of `experts` × `st`'s sizes.
pub(crate) fn fp8_experts(
    q: CudaSlice<u8>,
    scale: CudaSlice<f32>,
    experts: usize,
    st: StoredFp8,
) -> Result<Fp8Experts> {
    Fp8Experts::from_parts(q, scale, experts, st.out, st.inp, st.x_inp)
}

fn mlerr_s(what: &str, e: String) -> crate::CudaError {
    crate::CudaError::Shape { kernel: "load", msg: format!("{what}: {e}") }
}

impl CudaBackend {
    /// `y[n][p.out] = x[n][p.inp] · pᵀ` on the stream: the bf16 GEMM of the backend's
    /// mode, or the fp8 GEMM (quantising `x` on the way).
    pub(super) fn proj<T: GemmOut>(
        &self,
        p: &Proj,
        x: &impl DevicePtr<bf16>,
        n: usize,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        let s = &self.gpu.stream;
        match p {
            Proj::Bf16(l) => self.gemm.forward(s, l, x, n, y),
            Proj::Fp8(l) => self.fp8_kernels()?.gemm.forward(s, l, x, n, y),
        }
    }

    /// RMSNorm of `n` rows of `x` (f32, row stride `x_stride`, `w.len()` wide; `eps`) as the
    /// input of the projections `ps`: quantised inside the norm's launch where every one of
    /// them is fp8 of that width ([`crate::fp8::Fp8Gemm::rmsnorm_quant`], the bytes the
    /// bf16 norm and the GEMM's own quantisation give), else bf16.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn norm_for(
        &self,
        ps: &[&Proj],
        x: &impl DevicePtr<f32>,
        x_stride: usize,
        w: &CudaSlice<f32>,
        n: usize,
        eps: f32,
    ) -> Result<Normed> {
        let s = &self.gpu.stream;
        let dim = w.len();
        let fp8: Vec<&Fp8Linear> =
            ps.iter().filter_map(|p| if let Proj::Fp8(l) = p { Some(l) } else { None }).collect();
        if n > 0
            && !fp8.is_empty()
            && fp8.len() == ps.len()
            && fp8.iter().all(|l| l.x_inp == dim && l.inp == fp8[0].inp)
        {
            let inp = fp8[0].inp;
            // SAFETY: rmsnorm_quant writes every byte and scale of the n rows before a GEMM
            // reads them (when it launches at all).
            let mut q = unsafe { s.alloc::<u8>(n * inp) }?;
            let mut scale = unsafe { s.alloc::<f32>(n * inp / crate::fp8_plan::FP8_BLOCK) }?;
            let g = &self.fp8_kernels()?.gemm;
            if g.rmsnorm_quant(s, x, x_stride, w, n, inp, eps, &mut q, &mut scale)?.is_some() {
                return Ok(Normed::Fp8 { q, scale, x_inp: dim, inp });
            }
        }
        let mut xn = s.alloc_zeros::<bf16>(n * dim)?;
        self.ops.rmsnorm(s, &mut xn, dim, x, x_stride, w, n, eps)?;
        Ok(Normed::Bf16(xn))
    }

    /// `y[n][p.out] = x · pᵀ` from a [`Normed`] input ([`CudaBackend::norm_for`] made it for
    /// `p`).
    pub(super) fn proj_normed<T: GemmOut>(
        &self,
        p: &Proj,
        x: &Normed,
        n: usize,
        y: &mut impl DevicePtrMut<T>,
    ) -> Result<()> {
        match (p, x) {
            (_, Normed::Bf16(xb)) => self.proj(p, xb, n, y),
            (Proj::Fp8(l), Normed::Fp8 { q, scale, x_inp, inp }) if l.x_inp == *x_inp && l.inp == *inp => {
                self.fp8_kernels()?.gemm.forward_quantized(&self.gpu.stream, l, q, scale, n, y)
            }
            _ => Err(crate::CudaError::shape("fp8 gemm", "a quantised input made for another weight")),
        }
    }

    /// Two projections of the same input (`y1 = x · p1ᵀ`, `y2 = x · p2ᵀ`): where both are
    /// fp8 of the same input width, `x` is quantised once for both (the same bytes each
    /// would quantise on its own).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn proj_pair<T: GemmOut, U: GemmOut>(
        &self,
        p1: &Proj,
        y1: &mut impl DevicePtrMut<T>,
        p2: &Proj,
        y2: &mut impl DevicePtrMut<U>,
        x: &impl DevicePtr<bf16>,
        n: usize,
    ) -> Result<()> {
        match (p1, p2) {
            (Proj::Fp8(a), Proj::Fp8(b)) if a.inp == b.inp && a.x_inp == b.x_inp && n > 0 => {
                let s = &self.gpu.stream;
                let g = &self.fp8_kernels()?.gemm;
                // SAFETY: act_quant writes every byte and scale of the n rows before either
                // GEMM reads them.
                let mut q = unsafe { s.alloc::<u8>(n * a.inp) }?;
                let mut sc = unsafe { s.alloc::<f32>(n * a.inp / crate::fp8_plan::FP8_BLOCK) }?;
                g.act_quant_padded(s, x, n, a.x_inp, a.inp, &mut q, &mut sc)?;
                g.forward_quantized(s, a, &q, &sc, n, y1)?;
                g.forward_quantized(s, b, &q, &sc, n, y2)
            }
            _ => {
                self.proj(p1, x, n, y1)?;
                self.proj(p2, x, n, y2)
            }
        }
    }

    /// Weight bytes held in fp8 (codes and scales) and in all, this rank.
    pub fn fp8_bytes(&self) -> (u64, u64) {
        let wb = self.weight_bytes();
        let layers = self.blocks.iter().chain(self.mtp.iter().map(|m| &m.block));
        let mut fp8 = 0u64;
        let of = |p: &Proj| if let Proj::Fp8(l) = p { l.bytes() as u64 } else { 0 };
        for b in layers {
            let a = &b.attn;
            fp8 += [&a.q_b, &a.kv_a, &a.o_proj].into_iter().chain(a.q_a.as_ref().map(|q| &q.0)).map(of).sum::<u64>();
            let (dense, moe) = match &b.ffn {
                weights::Ffn::Dense(m) => (Some(&**m), None),
                weights::Ffn::Moe(m) => (m.shared.as_ref(), Some(m)),
            };
            for m in dense.into_iter().chain(moe.map_or(&[][..], |m| &m.experts[..])) {
                fp8 += of(&m.gate_up) + of(&m.down);
            }
            if let Some(weights::Grouped::Fp8(gu, dn)) = moe.and_then(|m| m.grouped.as_ref()) {
                fp8 += (gu.q.len() + 4 * gu.scale.len() + dn.q.len() + 4 * dn.scale.len()) as u64;
            }
        }
        let all = wb.target_dense
            + wb.mtp_dense
            + wb.head
            + wb.expert * wb.experts_per_layer * (wb.moe_layers + u64::from(wb.mtp_moe))
            + self.embed.w.len() as u64 * 2;
        (fp8, all)
    }

    pub(super) fn fp8_kernels(&self) -> Result<&Fp8Kernels> {
        self.fp8.as_ref().ok_or_else(|| crate::CudaError::shape("fp8", "an fp8 weight without the fp8 kernels"))
    }

    /// Bytes of every weight on the device, split as (dense: attention, norms, dense
    /// MLPs, shared experts, router, embedding and heads; one routed expert's MLP; routed
    /// experts per MoE layer; MoE layers), for rooflines.
    pub fn weight_bytes(&self) -> WeightBytes {
        let lin = |l: &Linear| (l.w.len() * 2) as u64;
        let mlp = |m: &weights::Mlp| m.gate_up.bytes() + m.down.bytes();
        let mut wb = WeightBytes { head: lin(&self.lm_head), ..Default::default() };
        let blocks = self.blocks.iter().map(|b| (b, false)).chain(self.mtp.iter().map(|m| (&m.block, true)));
        for (b, is_mtp) in blocks {
            let a = &b.attn;
            let mut d =
                a.q_b.bytes() + a.kv_a.bytes() + a.o_proj.bytes() + (a.w_uk.w.len() + a.w_uv.w.len()) as u64 * 2;
            if let Some((qa, _)) = &a.q_a {
                d += qa.bytes();
            }
            match &b.ffn {
                weights::Ffn::Dense(m) => d += mlp(m),
                weights::Ffn::Moe(m) => {
                    d += (m.gate.len() * 4) as u64 + m.shared.as_ref().map_or(0, mlp);
                    (wb.experts_per_layer, wb.expert) = m.expert_bytes();
                    wb.top_k = m.route.k as u64;
                    if is_mtp {
                        wb.mtp_moe = true;
                    } else {
                        wb.moe_layers += 1;
                    }
                }
            }
            if is_mtp {
                wb.mtp_dense += d;
            } else {
                wb.target_dense += d;
            }
        }
        wb.mtp_dense += self.mtp.iter().map(|m| m.eh_proj.bytes()).sum::<u64>();
        wb
    }
}
