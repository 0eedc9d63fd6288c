//! Synthetic weights: every tensor of a configuration, in this rank's shapes, with values
//! from a [`WeightFill`] the caller brings (benchmarks at real dimensions without a
//! checkpoint; the lab crate's random fill). The scales asked for: U(±1/√inp) for
//! projections, U(0.9, 1.1) for norms, U(0, 0.1) for the routing bias.

use cudarc::driver::CudaSlice;
use half::bf16;
use mlaserve_core::{ModelConfig, TopkMethod};

use super::weights::{route_params, Attn, Block, Embed, Ffn, Mlp, Moe, Mtp};
use crate::error::Result;
use crate::gpu::Gpu;
use crate::linear::Linear;

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

    fn mlp(&self, h: usize, inter: usize) -> Result<Mlp> {
        Ok(Mlp { gate_up: self.lin(2 * inter, h)?, down: self.lin(h, inter)? })
    }

    fn block(&self, c: &ModelConfig, layer: usize) -> Result<Block> {
        let h = c.hidden_size;
        let ffn = match (&c.moe, c.is_moe_layer(layer)) {
            (Some(m), true) => {
                let experts = (0..m.n_routed_experts)
                    .map(|_| self.mlp(h, m.moe_intermediate_size / self.world))
                    .collect::<Result<Vec<_>>>()?;
                Ffn::Moe(Box::new(Moe {
                    gate: self.vec(m.n_routed_experts * h, -1.0 / (h as f32).sqrt(), 1.0 / (h as f32).sqrt())?,
                    bias: if m.topk_method == TopkMethod::NoauxTc {
                        Some(self.vec(m.n_routed_experts, 0.0, 0.1)?)
                    } else {
                        None
                    },
                    grouped: Moe::tables(&self.gpu.stream, &experts)?,
                    experts,
                    shared: if m.n_shared_experts > 0 {
                        Some(self.mlp(h, m.moe_intermediate_size * m.n_shared_experts / self.world)?)
                    } else {
                        None
                    },
                    route: route_params(m, c.arch),
                }))
            }
            _ => Ffn::Dense(self.mlp(h, c.intermediate_size / self.world)?),
        };
        let (nh, qk, lora) = (c.num_attention_heads / self.world, c.qk_head_dim(), c.kv_lora_rank);
        let (q_a, q_b) = match c.q_lora_rank {
            Some(r) => (Some((self.lin(r, h)?, self.norm(r)?)), self.lin(nh * qk, r)?),
            None => (None, self.lin(nh * qk, h)?),
        };
        let a = 1.0 / (lora as f32).sqrt();
        Ok(Block {
            in_norm: self.norm(h)?,
            attn: Attn {
                q_a,
                q_b,
                kv_a: self.lin(c.latent_dim(), h)?,
                kv_a_norm: self.norm(lora)?,
                w_uk: Linear {
                    w: self.bf16(nh * c.qk_nope_head_dim * lora, a)?,
                    out: nh * c.qk_nope_head_dim,
                    inp: lora,
                },
                w_uv: Linear { w: self.bf16(nh * c.v_head_dim * lora, a)?, out: nh * c.v_head_dim, inp: lora },
                o_proj: self.lin(h, nh * c.v_head_dim)?,
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
                    eh_proj: self.lin(h, 2 * h)?,
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
