//! Synthetic weights: every tensor of a configuration, in this rank's shapes, with values
//! from a [`WeightFill`] the caller brings (benchmarks at real dimensions without a
//! checkpoint; the lab crate's random fill). The scales asked for: U(±1/√inp) for
//! projections, U(0.9, 1.1) for norms, U(0, 0.1) for the routing bias.
//!
//! With fp8 kernels (`CudaOptions::synthetic_fp8`) the projections and experts a V3
//! checkpoint stores in fp8 are made fp8: codes quantised on the device from uniform
//! values, block scales around 1 / (448 √inp), so the weights keep the same spread; the
//! rest (embeddings, norms, router, heads, `kv_b`'s W_UK and W_UV) stay as they are.

use cudarc::driver::CudaSlice;
use half::bf16;
use mlaserve_core::{ModelConfig, TopkMethod};

use super::layer::GROUPED_MAX_EXPERTS;
use super::proj::{fp8_experts, fp8_linear, Fp8Kernels, Proj};
use super::weights::{route_params, Attn, Block, Embed, Ffn, Grouped, Mlp, Moe, Mtp};
use crate::error::Result;
use crate::fp8_plan::{StoredFp8, FP8_BLOCK};
use crate::gpu::Gpu;
use crate::linear::Linear;

/// Values quantised per launch when making fp8 codes (32 MB of bf16 scratch).
const FP8_CHUNK: usize = 16 << 20;

/// Values for synthetic weights, written on the device in the order the tensors are made
/// (so a deterministic fill gives the same model every time).
pub trait WeightFill {
    /// Fills `x` with values in `[-a, a)`.
    fn fill_bf16(&self, gpu: &Gpu, x: &mut CudaSlice<bf16>, a: f32) -> Result<()>;
    /// Fills `x` with values in `[lo, hi)`.
    fn fill_f32(&self, gpu: &Gpu, x: &mut CudaSlice<f32>, lo: f32, hi: f32) -> Result<()>;
}

pub(crate) struct Synth<'a> {
    pub gpu: &'a Gpu,
    pub fill: &'a dyn WeightFill,
    /// This rank's place in its group: shapes are its shard's.
    pub rank: usize,
    pub world: usize,
    /// Make the fp8 projections and experts with these kernels (`None`: all bf16).
    pub fp8: Option<&'a Fp8Kernels>,
}

impl Synth<'_> {
    pub fn bf16(&self, n: usize, a: f32) -> Result<CudaSlice<bf16>> {
        let mut x = self.gpu.stream.alloc_zeros::<bf16>(n)?;
        self.fill.fill_bf16(self.gpu, &mut x, a)?;
        Ok(x)
    }
    pub fn lin(&self, out: usize, inp: usize) -> Result<Linear> {
        Ok(Linear { w: self.bf16(out * inp, 1.0 / (inp as f32).sqrt())?, out, inp })
    }
    pub fn vec(&self, n: usize, lo: f32, hi: f32) -> Result<CudaSlice<f32>> {
        let mut x = self.gpu.stream.alloc_zeros::<f32>(n)?;
        self.fill.fill_f32(self.gpu, &mut x, lo, hi)?;
        Ok(x)
    }
    fn norm(&self, n: usize) -> Result<CudaSlice<f32>> {
        self.vec(n, 0.9, 1.1)
    }

    /// `n` random e4m3 codes (uniform values quantised on the device, never NaN).
    fn codes(&self, k: &Fp8Kernels, n: usize) -> Result<CudaSlice<u8>> {
        let s = &self.gpu.stream;
        let mut q = s.alloc_zeros::<u8>(n)?;
        let chunk = FP8_CHUNK.min(n.next_multiple_of(FP8_BLOCK));
        let mut x = s.alloc_zeros::<bf16>(chunk)?;
        let mut sc = s.alloc_zeros::<f32>(chunk / FP8_BLOCK)?;
        let mut at = 0;
        while at < n {
            let len = chunk.min(n - at);
            self.fill.fill_bf16(self.gpu, &mut x, 1.0)?;
            let rows = len / FP8_BLOCK;
            if rows > 0 {
                let mut view = q.slice_mut(at..at + rows * FP8_BLOCK);
                k.gemm.act_quant(s, &x.slice(0..rows * FP8_BLOCK), rows, FP8_BLOCK, &mut view, &mut sc)?;
            }
            at += len;
        }
        Ok(q)
    }

    /// Block scales for `n` blocks of weights of `inp` inputs: U(0.9, 1.1) / (448 √inp).
    fn scales(&self, n: usize, inp: usize) -> Result<CudaSlice<f32>> {
        let a = 1.0 / (448.0 * (inp as f32).sqrt());
        self.vec(n, 0.9 * a, 1.1 * a)
    }

    /// An fp8 weight stored as `st`, `count` of them back to back: random codes, and
    /// scales for `st.x_inp` inputs.
    fn fp8(&self, k: &Fp8Kernels, st: StoredFp8, count: usize) -> Result<(CudaSlice<u8>, CudaSlice<f32>)> {
        Ok((self.codes(k, count * st.codes())?, self.scales(count * st.scales(), st.x_inp)?))
    }

    /// A projection `[out][inp]`: fp8 when making fp8 weights, else bf16.
    fn proj(&self, out: usize, inp: usize) -> Result<Proj> {
        let Some(k) = self.fp8 else { return Ok(Proj::Bf16(self.lin(out, inp)?)) };
        let st = StoredFp8::plain(out, inp).map_err(|e| crate::CudaError::shape("synthetic", e))?;
        let (q, sc) = self.fp8(k, st, 1)?;
        Ok(Proj::Fp8(fp8_linear(q, sc, st)))
    }

    fn mlp(&self, h: usize, inter: usize) -> Result<Mlp> {
        let Some(k) = self.fp8 else {
            return Ok(Mlp { gate_up: Proj::Bf16(self.lin(2 * inter, h)?), down: Proj::Bf16(self.lin(h, inter)?) });
        };
        let st = StoredFp8::gate_up(inter, h).map_err(|e| crate::CudaError::shape("synthetic", e))?;
        let (q, sc) = self.fp8(k, st, 1)?;
        Ok(Mlp { gate_up: Proj::Fp8(fp8_linear(q, sc, st)), down: self.proj(h, inter)? })
    }

    /// A MoE layer's routed experts: grouped fp8 buffers when making fp8 weights on a GPU
    /// with the grouped kernel, else one MLP per expert (and the bf16 tables).
    fn experts(&self, e: usize, h: usize, inter: usize) -> Result<(Vec<Mlp>, Option<Grouped>)> {
        if let Some(k) = self.fp8.filter(|k| k.grouped.is_some() && e <= GROUPED_MAX_EXPERTS) {
            let bad = |er| crate::CudaError::shape("synthetic", er);
            let (gu, dn) = (StoredFp8::gate_up(inter, h).map_err(bad)?, StoredFp8::plain(h, inter).map_err(bad)?);
            let ((gq, gs), (dq, ds)) = (self.fp8(k, gu, e)?, self.fp8(k, dn, e)?);
            return Ok((Vec::new(), Some(Grouped::Fp8(fp8_experts(gq, gs, e, gu)?, fp8_experts(dq, ds, e, dn)?))));
        }
        let experts = (0..e).map(|_| self.mlp(h, inter)).collect::<Result<Vec<_>>>()?;
        let grouped = Moe::tables(&self.gpu.stream, &experts)?;
        Ok((experts, grouped))
    }

    fn block(&self, c: &ModelConfig, layer: usize) -> Result<Block> {
        let h = c.hidden_size;
        let ffn = match (&c.moe, c.is_moe_layer(layer)) {
            (Some(m), true) => {
                let (experts, grouped) = self.experts(m.n_routed_experts, h, m.moe_intermediate_size / self.world)?;
                Ffn::Moe(Box::new(Moe {
                    gate: self.vec(m.n_routed_experts * h, -1.0 / (h as f32).sqrt(), 1.0 / (h as f32).sqrt())?,
                    bias: if m.topk_method == TopkMethod::NoauxTc {
                        Some(self.vec(m.n_routed_experts, 0.0, 0.1)?)
                    } else {
                        None
                    },
                    grouped,
                    experts,
                    shared: if m.n_shared_experts > 0 {
                        Some(self.mlp(h, m.moe_intermediate_size * m.n_shared_experts / self.world)?)
                    } else {
                        None
                    },
                    route: route_params(m, c.arch),
                }))
            }
            _ => Ffn::Dense(Box::new(self.mlp(h, c.intermediate_size / self.world)?)),
        };
        let (nh, qk, lora) = (c.num_attention_heads / self.world, c.qk_head_dim(), c.kv_lora_rank);
        let (q_a, q_b) = match c.q_lora_rank {
            Some(r) => (Some((self.proj(r, h)?, self.norm(r)?)), self.proj(nh * qk, r)?),
            None => (None, self.proj(nh * qk, h)?),
        };
        let a = 1.0 / (lora as f32).sqrt();
        Ok(Block {
            in_norm: self.norm(h)?,
            attn: Attn {
                q_a,
                q_b,
                kv_a: self.proj(c.latent_dim(), h)?,
                kv_a_norm: self.norm(lora)?,
                w_uk: Linear {
                    w: self.bf16(nh * c.qk_nope_head_dim * lora, a)?,
                    out: nh * c.qk_nope_head_dim,
                    inp: lora,
                },
                w_uv: Linear { w: self.bf16(nh * c.v_head_dim * lora, a)?, out: nh * c.v_head_dim, inp: lora },
                o_proj: self.proj(h, nh * c.v_head_dim)?,
                heads: nh,
            },
            post_norm: self.norm(h)?,
            ffn,
        })
    }

    /// Every weight of `c` (one rank), in the order `CudaBackend::assemble` takes them.
    #[allow(clippy::type_complexity)]
    pub fn model(&self, c: &ModelConfig) -> Result<(Embed, Vec<Block>, CudaSlice<f32>, Linear, Vec<Mtp>)> {
        let (h, v) = (c.hidden_size, c.vocab_size);
        let v = v / self.world;
        let embed = Embed { w: self.bf16(v * h, 1.0)?, lo: self.rank * v, rows: v };
        let blocks = (0..c.num_hidden_layers).map(|l| self.block(c, l)).collect::<Result<Vec<_>>>()?;
        let mtp = (0..c.num_nextn_predict_layers)
            .map(|d| {
                Ok(Mtp {
                    enorm: self.norm(h)?,
                    hnorm: self.norm(h)?,
                    // bf16 in V3's checkpoint.
                    eh_proj: Proj::Bf16(self.lin(h, 2 * h)?),
                    block: self.block(c, c.num_hidden_layers + d)?,
                    head_norm: self.norm(h)?,
                    // V3's MTP layer carries copies of the main head and embedding: shared.
                    head: None,
                    embed: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((embed, blocks, self.norm(h)?, self.lin(v, h)?, mtp))
    }
}
