//! One decoder block on the device: MLA (projections, latent write, attention in the
//! absorbed form — then W_UV — or the expanded one, as the step's route says; o_proj) and
//! the FFN (dense SwiGLU or DeepSeekMoE), pre-norm residual.

use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use mlaserve_core::KvCacheDtype;

use super::proj::{Normed, Proj};
use super::route::Absorbed;
use super::weights::{Attn, Ffn, Grouped, Mlp, Moe};
use super::{BlockRef, CudaBackend, Step};
use crate::dims::DecodeDims;
use crate::error::Result;
use crate::fp8_grouped::Fp8Experts;
use crate::fp8_plan;
use crate::layout::AttnMeta;
use crate::ops::GroupedVariant;
use crate::prefill::{LatentCache, PrefillDims};
use crate::{MlaDecode, MlaDecodeShape};

/// Most routed experts of a layer whose tokens the device sorts (`Ops::moe_sort`); a
/// layer with more sorts on the host, which waits for the stream mid-step (such a model
/// runs no CUDA graphs, see `graphs.rs`).
pub(crate) const GROUPED_MAX_EXPERTS: usize = 1024;

/// A MoE step's routing slots sorted by expert on the device (`CudaBackend::moe_sort`).
struct Sorted {
    /// Each expert's first sorted row (`experts + 1`).
    off: CudaSlice<i32>,
    /// Each sorted row's token.
    perm: CudaSlice<i32>,
    /// Each slot's sorted row.
    inv: CudaSlice<i32>,
    /// The experts with rows, ascending, then -1s (the grouped fp8 kernels' compact grid).
    act: CudaSlice<i32>,
}

/// Rows that take the absorbed form, with the metadata the absorbed kernels read (the
/// step's own, or a mixed step's compact copy for those rows).
struct AbsView<'a> {
    n: usize,
    pos: &'a CudaSlice<i32>,
    row_seq: &'a CudaSlice<i32>,
    tables: &'a CudaSlice<i32>,
    seq_lens: &'a CudaSlice<i32>,
    meta: AttnMeta,
    uniform: Option<usize>,
    /// The decode kernel's split count when fixed ([`Step::splits`]).
    splits: Option<usize>,
    /// Each sequence's (new tokens, seq_len), in row order (empty where `uniform` is set
    /// and nothing else needs them: graph steps).
    chunks: &'a [(usize, usize)],
}

impl CudaBackend {
    /// Runs a block over `x` (`[n][h]` f32, the residual stream) in place.
    pub(super) fn run_block(&mut self, which: BlockRef, x: &mut CudaSlice<f32>, st: &Step) -> Result<()> {
        let s = self.gpu.stream.clone();
        let (h, n) = (self.cfg.hidden_size, st.n);
        let eps = self.cfg.rms_norm_eps as f32;
        let (block, cache_idx) = match which {
            BlockRef::Target(l) => (&self.blocks[l], l),
            BlockRef::Mtp(d) => (&self.mtp[d].block, self.cfg.num_hidden_layers + d),
        };
        // The input norm, quantised in its launch where the projections that read it are fp8.
        let first = match &block.attn.q_a {
            Some((qa, _)) => qa,
            None => &block.attn.q_b,
        };
        let xin = self.norm_for(&[first, &block.attn.kv_a], &*x, h, &block.in_norm, n, eps)?;
        // The cache is written inside; take it out of `self` for the call.
        let mut cache = std::mem::replace(&mut self.caches[cache_idx], s.alloc_zeros::<bf16>(1)?);
        let block = match which {
            BlockRef::Target(l) => &self.blocks[l],
            BlockRef::Mtp(d) => &self.mtp[d].block,
        };
        let a = self.attention(&block.attn, &xin, &mut cache, st);
        self.caches[cache_idx] = cache;
        let mut a = a?;
        self.mark("attention")?;
        self.all_reduce(&mut a)?;
        self.mark("all-reduce")?;
        // The residual add and the post-attention norm in one launch.
        let mut xn = match xin {
            Normed::Bf16(b) => b,
            Normed::Fp8 { .. } => s.alloc_zeros::<bf16>(n * h)?,
        };
        let mut f = match &block.ffn {
            Ffn::Dense(m) => {
                self.ops.add_rmsnorm(&s, x, &a, None, Some(&mut xn), &block.post_norm, n, eps)?;
                let f = self.mlp(m, &xn, n)?;
                self.mark("dense MLP")?;
                f
            }
            Ffn::Moe(m) => {
                // The router reads the normed state in f32 too (its choice is discrete).
                let mut xf = s.alloc_zeros::<f32>(n * h)?;
                self.ops.add_rmsnorm(&s, x, &a, Some(&mut xf), Some(&mut xn), &block.post_norm, n, eps)?;
                self.moe(m, &xn, &xf, n)?
            }
        };
        self.all_reduce(&mut f)?;
        self.mark("all-reduce")?;
        self.ops.add(&s, x, &f)?;
        Ok(())
    }

    /// MLA over normed `xn` (`[n][h]`, bf16 or quantised for q_a and kv_a): writes the
    /// latent cache, returns `o_proj`'s output `[n][h]` f32. Attention per the step's route
    /// (`route.rs`): each row's `o` (o_proj's input) comes from exactly one of the two forms.
    fn attention(&self, a: &Attn, xn: &Normed, cache: &mut CudaSlice<bf16>, st: &Step) -> Result<CudaSlice<f32>> {
        let s = &self.gpu.stream;
        let c = &self.cfg;
        let n = st.n;
        let (heads, nope, rope, lora, vdim) =
            (a.heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank, c.v_head_dim);
        let qk = nope + rope;
        // DeepSeek's and transformers' q_a/kv_a norms use eps 1e-6 whatever rms_norm_eps says.
        let eps_lat = 1e-6;
        let mut q = s.alloc_zeros::<f32>(n * heads * qk)?;
        let lat = lora + rope;
        let mut kv = s.alloc_zeros::<f32>(n * lat)?;
        match (&a.q_a, xn) {
            (Some((qa, qn)), xn) => {
                let r = qa.out();
                let mut cq = s.alloc_zeros::<f32>(n * r)?;
                match xn {
                    // q_a and kv_a read the same normed input (quantised once where both are fp8).
                    Normed::Bf16(xb) => self.proj_pair(qa, &mut cq, &a.kv_a, &mut kv, xb, n)?,
                    Normed::Fp8 { .. } => {
                        self.proj_normed(qa, xn, n, &mut cq)?;
                        self.proj_normed(&a.kv_a, xn, n, &mut kv)?;
                    }
                }
                let cqn = self.norm_for(&[&a.q_b], &cq, r, qn, n, eps_lat)?;
                self.proj_normed(&a.q_b, &cqn, n, &mut q)?;
            }
            (None, xn) => {
                self.proj_normed(&a.q_b, xn, n, &mut q)?;
                self.proj_normed(&a.kv_a, xn, n, &mut kv)?;
            }
        }
        self.ops.kv_write(s, cache, &kv, &a.kv_a_norm, &self.rope, &st.pos, &st.slot, n, eps_lat)?;
        self.mark("attention: q/kv projections, cache write")?;
        let scale = c.softmax_scale() as f32;
        // Every row absorbed into an fp8 o_proj whose input groups are the heads: W_UV's
        // reduce quantises o_proj's input itself (the bytes W_UV then the GEMM's own
        // quantisation give).
        let o_proj_fp8 = match &a.o_proj {
            Proj::Fp8(l) if l.x_inp == heads * vdim && l.inp == heads * vdim => Some(l),
            _ => None,
        };
        let fused = o_proj_fp8.filter(|_| {
            matches!(st.route.abs, Absorbed::All)
                && st.route.exp.is_none()
                && n > 0
                && crate::ops::Ops::wuv_quant_takes(lora, vdim)
        });
        let all_rows = || AbsView {
            n,
            pos: &st.pos,
            row_seq: &st.row_seq,
            tables: &st.tables,
            seq_lens: &st.seq_lens,
            meta: st.meta,
            uniform: st.uniform,
            splits: st.splits,
            chunks: &st.chunks,
        };
        if let Some(l) = fused {
            let o_lat = self.absorbed(a, &q, cache, &all_rows())?;
            // SAFETY: wuv_quant writes every code and scale of the n rows.
            let mut oq = unsafe { s.alloc::<u8>(n * heads * vdim) }?;
            let mut osc = unsafe { s.alloc::<f32>(n * heads) }?;
            self.ops.wuv_quant(s, &mut oq, &mut osc, &o_lat, &a.w_uv.w, n, heads, lora, vdim)?;
            self.mark("attention: absorbed q (W_UK), W_UV")?;
            let mut out = s.alloc_zeros::<f32>(n * c.hidden_size)?;
            self.fp8_kernels()?.gemm.forward_quantized(s, l, &oq, &osc, n, &mut out)?;
            self.mark("attention: o_proj")?;
            return Ok(out);
        }
        let mut o = s.alloc_zeros::<bf16>(n * heads * vdim)?;
        match &st.route.abs {
            Absorbed::All => {
                let o_lat = self.absorbed(a, &q, cache, &all_rows())?;
                self.ops.wuv(s, &mut o, &o_lat, &a.w_uv.w, n, heads, lora, vdim)?;
                self.mark("attention: absorbed q (W_UK), W_UV")?;
            }
            Absorbed::Nothing => {}
            Absorbed::Rows(r) => {
                let m = r.rows.len();
                let mut qs = s.alloc_zeros::<f32>(m * heads * qk)?;
                self.ops.gather(s, &mut qs, &q, &r.rows_d, &r.rows, heads * qk)?;
                let rows = AbsView {
                    n: m,
                    pos: &r.pos,
                    row_seq: &r.row_seq,
                    tables: &r.tables,
                    seq_lens: &r.seq_lens,
                    meta: r.meta,
                    uniform: r.uniform,
                    splits: None,
                    chunks: &r.chunks,
                };
                let mut os = s.alloc_zeros::<bf16>(m * heads * vdim)?;
                let o_lat = self.absorbed(a, &qs, cache, &rows)?;
                self.ops.wuv(s, &mut os, &o_lat, &a.w_uv.w, m, heads, lora, vdim)?;
                self.mark("attention: absorbed q (W_UK), W_UV")?;
                self.prefill.scatter_rows(s, &mut o, &os, &r.rows_d, &r.rows, heads * vdim)?;
            }
        }
        if let Some(plan) = &st.route.exp {
            let d = PrefillDims { heads, nope, rope, vdim };
            let lc = LatentCache {
                data: cache,
                fp8: self.opts.kv_cache_dtype == KvCacheDtype::Fp8,
                tables: &st.tables,
                bt_stride: st.meta.bt_stride,
                num_blocks: self.opts.num_blocks,
                lora,
                rope,
            };
            self.prefill.forward(s, &self.gemm, (&a.w_uk, &a.w_uv), plan, &d, scale, &q, &lc, &self.rope, &mut o)?;
            self.mark("attention: expanded form")?;
        }
        let mut out = s.alloc_zeros::<f32>(n * c.hidden_size)?;
        self.proj(&a.o_proj, &o, n, &mut out)?;
        self.mark("attention: o_proj")?;
        Ok(out)
    }

    /// The absorbed form over `rows.n` rows (`q` their q_b output, compact): query
    /// absorption, attention over the latent cache (the decode kernel for uniform windows
    /// of ≤ 4 tokens when enabled, else the varlen kernel): `o_lat` (`[rows.n][heads][lora]`
    /// f32), which the caller multiplies by `W_UV`.
    fn absorbed(
        &self,
        a: &Attn,
        q: &CudaSlice<f32>,
        cache: &CudaSlice<bf16>,
        rows: &AbsView,
    ) -> Result<CudaSlice<f32>> {
        let s = &self.gpu.stream;
        let c = &self.cfg;
        let n = rows.n;
        let (heads, nope, rope, lora) = (a.heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank);
        let lat = lora + rope;
        let mut qa = s.alloc_zeros::<f32>(n * heads * lat)?;
        let mut qa_bf16 = s.alloc_zeros::<bf16>(n * heads * lat)?;
        self.ops.q_absorb(s, &mut qa, &mut qa_bf16, q, &a.w_uk.w, &self.rope, rows.pos, n, heads, nope, lora)?;
        self.mark("attention: absorbed q (W_UK), W_UV")?;
        let mut o_lat = s.alloc_zeros::<f32>(n * heads * lora)?;
        let scale = c.softmax_scale() as f32;
        // Fixed-size splits (batch-invariant decode): every absorbed row goes through the
        // decode kernel, whatever its chunk's length, so no row's sums depend on what else
        // the step holds; chunks of other lengths run as their own launches.
        let probe = DecodeDims { batch: 1, heads, q_len: 1, dlat: lora, drope: rope, bt_stride: rows.meta.bt_stride };
        // Latent widths without the tensor-core kernel run the varlen kernel for every row
        // then (the generic decode kernel sums differently).
        let exact = self.mla.fixed_split_blocks(rows.meta.bt_stride).is_some();
        let fast = MlaDecode::is_fast_path(&probe);
        let fixed = self.opts.decode_kernel && fast && exact;
        // The generic kernel reads no fp8 cache: those widths take the varlen kernel.
        let generic_ok = self.opts.kv_cache_dtype != KvCacheDtype::Fp8;
        let kernel = self.opts.decode_kernel && (fast || (!exact && generic_ok));
        if fixed && rows.uniform.is_none() {
            self.absorbed_runs(&qa_bf16, cache, rows, &mut o_lat, heads, lora, rope, scale)?;
        } else {
            match rows.uniform.filter(|&ql| kernel && (ql <= 4 || fixed)) {
                Some(q_len) => {
                    let dims = DecodeDims {
                        batch: rows.meta.seqs,
                        heads,
                        q_len,
                        dlat: lora,
                        drope: rope,
                        bt_stride: rows.meta.bt_stride,
                    };
                    let num_splits = rows.splits.unwrap_or_else(|| self.mla.num_splits(&dims, rows.meta.max_pos + 1));
                    let mut ws = self.mla.workspace(s, &dims, num_splits)?;
                    let mut lse = s.alloc_zeros::<f32>(n * heads)?;
                    let shape = MlaDecodeShape { dims, num_blocks: self.opts.num_blocks, num_splits, scale };
                    self.mla.launch(
                        s,
                        &shape,
                        &qa_bf16,
                        cache,
                        rows.tables,
                        rows.seq_lens,
                        &mut o_lat,
                        &mut lse,
                        &mut ws,
                    )?;
                }
                None => {
                    self.ops.attn_varlen(
                        s,
                        &mut o_lat,
                        &qa,
                        cache,
                        rows.tables,
                        rows.row_seq,
                        rows.pos,
                        &rows.meta,
                        heads,
                        lora,
                        rope,
                        scale,
                    )?;
                }
            }
        }
        self.mark("attention: absorbed kernel")?;
        Ok(o_lat)
    }

    /// The decode kernel over a step whose absorbed chunks differ in length (fixed-size
    /// splits only): one launch per run of consecutive sequences with the same number of
    /// new tokens, over views of the step's rows, tables and lengths.
    #[allow(clippy::too_many_arguments)]
    fn absorbed_runs(
        &self,
        qa: &CudaSlice<bf16>,
        cache: &CudaSlice<bf16>,
        rows: &AbsView,
        o_lat: &mut CudaSlice<f32>,
        heads: usize,
        lora: usize,
        rope: usize,
        scale: f32,
    ) -> Result<()> {
        let s = &self.gpu.stream;
        let bt = rows.meta.bt_stride;
        let lat = lora + rope;
        if rows.chunks.len() != rows.meta.seqs {
            return Err(crate::CudaError::shape(
                "mla_decode",
                format!("{} chunk lengths for {} sequences", rows.chunks.len(), rows.meta.seqs),
            ));
        }
        let (mut seq, mut row) = (0, 0);
        while seq < rows.chunks.len() {
            let q_len = rows.chunks[seq].0;
            let ns = rows.chunks[seq..].iter().take_while(|c| c.0 == q_len).count();
            let max_len = rows.chunks[seq..seq + ns].iter().map(|c| c.1).max().unwrap_or(1);
            let nrows = ns * q_len;
            if q_len > 0 {
                let dims = DecodeDims { batch: ns, heads, q_len, dlat: lora, drope: rope, bt_stride: bt };
                let num_splits = self.mla.num_splits(&dims, max_len);
                let mut ws = self.mla.workspace(s, &dims, num_splits)?;
                let mut lse = s.alloc_zeros::<f32>(nrows * heads)?;
                let shape = MlaDecodeShape { dims, num_blocks: self.opts.num_blocks, num_splits, scale };
                let mut out = o_lat.slice_mut(row * heads * lora..(row + nrows) * heads * lora);
                self.mla.launch(
                    s,
                    &shape,
                    &qa.slice(row * heads * lat..(row + nrows) * heads * lat),
                    cache,
                    &rows.tables.slice(seq * bt..(seq + ns) * bt),
                    &rows.seq_lens.slice(seq..seq + ns),
                    &mut out,
                    &mut lse,
                    &mut ws,
                )?;
            }
            seq += ns;
            row += nrows;
        }
        Ok(())
    }

    /// SwiGLU MLP over `rows` rows of `x` (bf16, anything with a device pointer): `[rows][h]` f32.
    fn mlp_into(
        &self,
        m: &Mlp,
        x: &impl DevicePtr<bf16>,
        rows: usize,
        out: &mut impl cudarc::driver::DevicePtrMut<f32>,
    ) -> Result<()> {
        let mut gu = self.gpu.stream.alloc_zeros::<bf16>(rows * 2 * m.half())?;
        self.proj(&m.gate_up, x, rows, &mut gu)?;
        self.mlp_down(m, &gu, rows, out)
    }

    /// [`CudaBackend::mlp_into`] over an input already normed or quantised for `m`'s
    /// gate_up ([`Normed`]).
    fn mlp_into_normed(
        &self,
        m: &Mlp,
        x: &Normed,
        rows: usize,
        out: &mut impl cudarc::driver::DevicePtrMut<f32>,
    ) -> Result<()> {
        let mut gu = self.gpu.stream.alloc_zeros::<bf16>(rows * 2 * m.half())?;
        self.proj_normed(&m.gate_up, x, rows, &mut gu)?;
        self.mlp_down(m, &gu, rows, out)
    }

    /// SiLU-mul of gate_up's output `gu` and the down projection.
    fn mlp_down(
        &self,
        m: &Mlp,
        gu: &CudaSlice<bf16>,
        rows: usize,
        out: &mut impl cudarc::driver::DevicePtrMut<f32>,
    ) -> Result<()> {
        let s = &self.gpu.stream;
        let (i, half) = (m.inter(), m.half());
        if let Proj::Fp8(down) = &m.down {
            if down.x_inp == i && rows > 0 {
                // SiLU fused with the down projection's activation quantisation.
                let g = &self.fp8_kernels()?.gemm;
                // SAFETY: silu_quant writes every byte and scale of the rows before the GEMM
                // reads them.
                let mut q = unsafe { s.alloc::<u8>(rows * down.inp) }?;
                let mut sc = unsafe { s.alloc::<f32>(rows * down.inp / fp8_plan::FP8_BLOCK) }?;
                g.silu_quant(s, gu, rows, i, half, down.inp, &mut q, &mut sc)?;
                return g.forward_quantized(s, down, &q, &sc, rows, out);
            }
        }
        let mut act = s.alloc_zeros::<bf16>(rows * i)?;
        self.silu.launch_padded(s, &mut act, gu, i, half)?;
        self.proj(&m.down, &act, rows, out)
    }

    fn mlp(&self, m: &Mlp, xn: &CudaSlice<bf16>, n: usize) -> Result<CudaSlice<f32>> {
        let mut out = self.gpu.stream.alloc_zeros::<f32>(n * self.cfg.hidden_size)?;
        self.mlp_into(m, xn, n, &mut out)?;
        Ok(out)
    }

    /// DeepSeekMoE: routing on the device (f32 logits from `xf`); the chosen (token, expert)
    /// pairs sorted by expert (on the device; on the host when the grouped kernel does not
    /// take the dimensions), each expert's rows gathered and run through its MLP, then
    /// summed per token in ascending expert order, plus the shared experts.
    fn moe(&self, m: &Moe, xn: &CudaSlice<bf16>, xf: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>> {
        let s = &self.gpu.stream;
        let h = self.cfg.hidden_size;
        let (e, k) = (m.route.experts, m.route.k);
        // The router's k-range partials, summed inside the routing kernel.
        let (logits, ksplit) = self.ops.router_logits_split(s, xf, &m.gate, n, e, h)?;
        let mut ids = s.alloc_zeros::<i32>(n * k)?;
        let mut w = s.alloc_zeros::<f32>(n * k)?;
        self.ops.route_split(s, &mut ids, &mut w, (&logits, ksplit), m.bias.as_ref(), n, &m.route)?;
        self.mark("MoE routing")?;
        // Where the routed experts are fp8, each token's input is quantised once, for them
        // and for a shared expert of the same input width (the bytes each GEMM's own
        // quantisation of the row would give).
        let fp8_in = match &m.grouped {
            Some(Grouped::Fp8(gate_up, _)) if e <= GROUPED_MAX_EXPERTS => {
                let (x_inp, inp) = (gate_up.x_inp, gate_up.inp);
                // SAFETY: the quantiser writes every byte and scale of the n rows.
                let mut q = unsafe { s.alloc::<u8>(n * inp) }?;
                let mut scale = unsafe { s.alloc::<f32>(n * inp / fp8_plan::FP8_BLOCK) }?;
                self.fp8_kernels()?.gemm.act_quant_padded(s, xn, n, x_inp, inp, &mut q, &mut scale)?;
                Some(Normed::Fp8 { q, scale, x_inp, inp })
            }
            _ => None,
        };
        let mut out = match (&m.shared, &fp8_in) {
            (Some(sh), Some(x)) => match &sh.gate_up {
                Proj::Fp8(l) if matches!(x, Normed::Fp8 { x_inp, inp, .. } if l.x_inp == *x_inp && l.inp == *inp) => {
                    let mut out = s.alloc_zeros::<f32>(n * h)?;
                    self.mlp_into_normed(sh, x, n, &mut out)?;
                    out
                }
                _ => self.mlp(sh, xn, n)?,
            },
            (Some(sh), None) => self.mlp(sh, xn, n)?,
            (None, _) => s.alloc_zeros::<f32>(n * h)?,
        };
        self.mark("MoE shared experts")?;
        let rows = n * k;
        // The expert buffers below are not zeroed (in prefill they are hundreds of MB per
        // layer): each is written whole before it is read. moe_sort counts every slot
        // (out-of-range ids as expert 0), so the experts' row ranges cover rows 0..rows,
        // and the gather, the grouped GEMMs and SiLU write every column of their rows; the
        // host path below runs every slot's expert over its rows too.
        // SAFETY: uninitialised device memory of a plain type, written before any read.
        let mut ys = unsafe { s.alloc::<f32>(rows * h) }?;
        let inv_d = match &m.grouped {
            // Sorted and run on the device: no host round trip, three expert launches.
            Some(Grouped::Fp8(gate_up, down)) if e <= GROUPED_MAX_EXPERTS => {
                let Sorted { off, perm, inv, act } = self.moe_sort(&ids, n, k, e)?;
                let Some(Normed::Fp8 { q, scale, inp, .. }) = &fp8_in else {
                    return Err(crate::CudaError::shape("moe", "the routed experts' input was not quantised"));
                };
                // SAFETY: the gather writes every byte and scale of the `rows` rows.
                let mut xq = unsafe { s.alloc::<u8>(rows * inp) }?;
                let mut xsc = unsafe { s.alloc::<f32>(rows * inp / fp8_plan::FP8_BLOCK) }?;
                self.ops.gather_q8_sorted(s, &mut xq, &mut xsc, q, scale, &perm, rows, *inp)?;
                self.mark("MoE routed experts: sort, gather")?;
                self.moe_fp8(gate_up, down, &xq, &xsc, &off, &act, rows, e, &mut ys)?;
                inv
            }
            Some(Grouped::Bf16(gate_up, down)) if e <= GROUPED_MAX_EXPERTS => {
                let Sorted { off, perm, inv, .. } = self.moe_sort(&ids, n, k, e)?;
                // SAFETY: uninitialised device memory of a plain type; the gather writes all
                // `rows` rows.
                let mut xs = unsafe { s.alloc::<bf16>(rows * h) }?;
                self.ops.gather_sorted(s, &mut xs, xn, &perm, rows, h)?;
                self.mark("MoE routed experts: sort, gather")?;
                // Tensor cores in fast mode; the invariant mode keeps `linear_inv`'s sums.
                let variant = GroupedVariant::Auto(self.gemm.mode);
                let i = gate_up.out / 2;
                // SAFETY: as `ys`: the experts' ranges cover every row.
                let mut gu = unsafe { s.alloc::<bf16>(rows * 2 * i) }?;
                self.ops.moe_grouped_sorted(s, &mut gu, &xs, gate_up, &off, rows, variant)?;
                self.mark("MoE routed experts: gate_up")?;
                // SAFETY: as `ys`: SiLU-mul writes every element.
                let mut act = unsafe { s.alloc::<bf16>(rows * i) }?;
                self.silu.launch(s, &mut act, &gu, i)?;
                self.mark("MoE routed experts: SiLU")?;
                self.ops.moe_grouped_sorted(s, &mut ys, &act, down, &off, rows, variant)?;
                self.mark("MoE routed experts: down")?;
                inv
            }
            // Dimensions the grouped kernel does not take: sorted on the host, each touched
            // expert through the GEMM on its contiguous rows.
            _ => {
                self.settle("MoE routing")?;
                let ids_h = s.clone_dtoh(&ids)?;
                s.synchronize()?;
                // Slots (t, j) sorted by (expert, token): `perm` gives each sorted row's
                // token, `inv` each slot's sorted row.
                let mut slots: Vec<usize> = (0..rows).collect();
                slots.sort_by_key(|&sl| (ids_h[sl], sl));
                let perm: Vec<u32> = slots.iter().map(|&sl| (sl / k) as u32).collect();
                let mut inv = vec![0i32; rows];
                for (row, &sl) in slots.iter().enumerate() {
                    inv[sl] = row as i32;
                }
                let perm_d = s.clone_htod(&perm.iter().map(|&t| t as i32).collect::<Vec<_>>())?;
                let inv_d = s.clone_htod(&inv)?;
                let mut xs = s.alloc_zeros::<bf16>(rows * h)?;
                self.ops.gather(s, &mut xs, xn, &perm_d, &perm, h)?;
                let mut start = 0;
                while start < slots.len() {
                    let ex = ids_h[slots[start]];
                    let end = start + slots[start..].iter().take_while(|&&sl| ids_h[sl] == ex).count();
                    let expert = m.experts.get(ex as usize).ok_or_else(|| {
                        crate::CudaError::shape("moe_route_f32", format!("expert id {ex} out of range"))
                    })?;
                    self.mlp_into(
                        expert,
                        &xs.slice(start * h..end * h),
                        end - start,
                        &mut ys.slice_mut(start * h..end * h),
                    )?;
                    start = end;
                }
                inv_d
            }
        };
        self.mark("MoE routed experts")?;
        self.ops.combine(s, &mut out, &ys, &ids, &w, &inv_d, n, k, h)?;
        self.mark("MoE combine")?;
        Ok(out)
    }
}

impl CudaBackend {
    /// The `(token, expert)` pairs of `ids` (`[n][k]`) sorted by expert on the device.
    fn moe_sort(&self, ids: &CudaSlice<i32>, n: usize, k: usize, e: usize) -> Result<Sorted> {
        let s = &self.gpu.stream;
        let rows = n * k;
        let mut off = s.alloc_zeros::<i32>(e + 1)?;
        let mut perm = s.alloc_zeros::<i32>(rows)?;
        let mut inv = s.alloc_zeros::<i32>(rows)?;
        let mut act = s.alloc_zeros::<i32>(e.min(rows).max(1))?;
        self.ops.moe_sort(s, ids, n, k, e, &mut off, &mut perm, &mut inv, &mut act)?;
        Ok(Sorted { off, perm, inv, act })
    }

    /// The routed experts of an fp8 layer over `rows` gathered, quantised rows (`xq`,
    /// `xsc`; sorted by expert, `off` each expert's range, `act` the experts with rows):
    /// the grouped fp8 GEMMs (gate_up, SiLU-mul, down) into `ys` (`[rows][h]` f32).
    #[allow(clippy::too_many_arguments)]
    fn moe_fp8(
        &self,
        gate_up: &Fp8Experts,
        down: &Fp8Experts,
        xq: &CudaSlice<u8>,
        xsc: &CudaSlice<f32>,
        off: &CudaSlice<i32>,
        act: &CudaSlice<i32>,
        rows: usize,
        e: usize,
        ys: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let s = &self.gpu.stream;
        let fp8 = self.fp8_kernels()?;
        let grouped =
            fp8.grouped.as_ref().ok_or_else(|| crate::CudaError::shape("fp8_grouped", "no grouped kernel"))?;
        // SAFETY (the buffers below): uninitialised device memory of plain types, each
        // written whole before it is read (the quantiser, the grouped GEMMs and SiLU
        // write every element of their rows; the experts' ranges cover every row).
        let invariant = self.gemm.mode.batch_invariant();
        let tiled = fp8_plan::grouped_tiled(rows, e, invariant);
        let half = gate_up.out / 2;
        let mut gu = unsafe { s.alloc::<bf16>(rows * gate_up.out) }?;
        if tiled {
            grouped.forward_tiled(s, gate_up, xq, xsc, off, Some(act), rows, &mut gu)?;
        } else {
            grouped.forward(s, gate_up, xq, xsc, off, Some(act), rows, &mut gu)?;
        }
        self.mark("MoE routed experts: gate_up")?;
        let i = down.x_inp;
        let mut aq = unsafe { s.alloc::<u8>(rows * down.inp) }?;
        let mut asc = unsafe { s.alloc::<f32>(rows * down.inp / fp8_plan::FP8_BLOCK) }?;
        fp8.gemm.silu_quant(s, &gu, rows, i, half, down.inp, &mut aq, &mut asc)?;
        self.mark("MoE routed experts: SiLU")?;
        if tiled {
            grouped.forward_tiled(s, down, &aq, &asc, off, Some(act), rows, ys)?;
        } else {
            grouped.forward(s, down, &aq, &asc, off, Some(act), rows, ys)?;
        }
        self.mark("MoE routed experts: down")
    }
}
