//! The model's weights on the device: read as f32 through `mlaserve_model::Weights`
//! (this rank's shard: heads, vocabulary and intermediate columns split as docs/architecture.md says), converted to bf16 on upload. Norm weights and the
//! routing bias stay f32 (tiny, and read by f32 kernels).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut};
use half::bf16;
use mlaserve_core::config::Arch;
use mlaserve_core::{ModelConfig, MoeConfig, ScoringFunc, TopkMethod};
use mlaserve_model::{names, Shard, Weights};

use crate::error::{CudaError, Result};
use crate::fp8_dequant::{Fp8Dequant, Fp8Host};
use crate::linear::Linear;
use crate::ops::{ExpertWeights, RouteParams};

fn mlerr(e: mlaserve_core::Error) -> crate::CudaError {
    crate::CudaError::Shape { kernel: "load", msg: e.to_string() }
}

/// Reads this rank's shards and uploads them. An fp8 weight is uploaded as its codes and
/// block scales and widened to bf16 on the device ([`Fp8Dequant`]): no f32 host copy.
pub(crate) struct Loader<'a> {
    pub w: &'a Weights,
    pub s: &'a Arc<CudaStream>,
    pub rank: usize,
    pub world: usize,
    pub dq: &'a Fp8Dequant,
}

impl Loader<'_> {
    fn host(&self, name: &str, shape: &[usize], shard: Option<usize>) -> Result<Vec<f32>> {
        self.w.f32_shard(name, shape, shard.map(|d| Shard::new(d, self.rank, self.world))).map_err(mlerr)
    }

    /// This rank's shard of `name` (`[out, inp]`) dequantised into `out` on the device,
    /// when the tensor is fp8 and the shard falls on its scale blocks; `Ok(false)`
    /// otherwise (the caller takes the host path, which gives the same bits).
    fn fp8_into(
        &self,
        name: &str,
        shape: [usize; 2],
        shard: Option<usize>,
        out: &mut CudaViewMut<'_, bf16>,
    ) -> Result<bool> {
        if !self.w.is_fp8(name) {
            return Ok(false);
        }
        let block = self.w.fp8_block();
        if let Some(d) = shard {
            if !(shape[d] / self.world).is_multiple_of(block[d]) {
                return Ok(false);
            }
        }
        let t = self.w.fp8_shard(name, shape, shard.map(|d| Shard::new(d, self.rank, self.world))).map_err(mlerr)?;
        let host = Fp8Host { q: &t.q, scales: &t.scales, rows: t.out, cols: t.inp, block: t.block };
        self.dq.into(self.s, host, out)?;
        Ok(true)
    }

    /// This rank's shard of `name` as bf16 on the device, `[rows][cols]` after sharding.
    fn bf16_matrix(&self, name: &str, shape: [usize; 2], shard: Option<usize>) -> Result<CudaSlice<bf16>> {
        let (o, i) = match shard {
            Some(0) => (shape[0] / self.world, shape[1]),
            Some(_) => (shape[0], shape[1] / self.world),
            None => (shape[0], shape[1]),
        };
        let mut out = self.s.alloc_zeros::<bf16>(o * i)?;
        if !self.fp8_into(name, shape, shard, &mut out.as_view_mut())? {
            let v = self.host(name, &shape, shard)?;
            self.s.memcpy_htod(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), &mut out)?;
        }
        Ok(out)
    }
    /// A norm weight or bias, replicated, f32.
    pub fn vec(&self, name: &str, len: usize) -> Result<CudaSlice<f32>> {
        Ok(self.s.clone_htod(&self.host(name, &[len], None)?)?)
    }
    /// `[out, inp]` split along `shard` (0: output rows, 1: input columns) or replicated.
    pub fn lin(&self, name: &str, out: usize, inp: usize, shard: Option<usize>) -> Result<Linear> {
        let (o, i) = match shard {
            Some(0) => (out / self.world, inp),
            Some(_) => (out, inp / self.world),
            None => (out, inp),
        };
        Ok(Linear { w: self.bf16_matrix(name, [out, inp], shard)?, out: o, inp: i })
    }
    fn bf16(&self, v: &[f32]) -> Result<CudaSlice<bf16>> {
        Ok(self.s.clone_htod(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>())?)
    }
}

/// SwiGLU MLP with gate and up fused into one `[2I, h]` projection.
#[derive(Debug)]
pub(crate) struct Mlp {
    pub gate_up: Linear,
    pub down: Linear,
}

impl Mlp {
    fn load(l: &Loader, prefix: &str, h: usize, inter: usize) -> Result<Self> {
        let local = inter / l.world;
        let mut gate_up = l.s.alloc_zeros::<bf16>(2 * local * h)?;
        for (i, part) in ["gate_proj", "up_proj"].iter().enumerate() {
            let name = format!("{prefix}.{part}.weight");
            let mut half = gate_up.slice_mut(i * local * h..(i + 1) * local * h);
            if !l.fp8_into(&name, [inter, h], Some(0), &mut half)? {
                let v = l.host(&name, &[inter, h], Some(0))?;
                l.s.memcpy_htod(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), &mut half)?;
            }
        }
        Ok(Mlp {
            gate_up: Linear { w: gate_up, out: 2 * local, inp: h },
            down: l.lin(&format!("{prefix}.down_proj.weight"), h, inter, Some(1))?,
        })
    }
    /// Local intermediate width.
    pub fn inter(&self) -> usize {
        self.gate_up.out / 2
    }
}

#[derive(Debug)]
pub(crate) struct Moe {
    /// Router weight `[experts][h]`, f32 (the router runs in f32, as transformers').
    pub gate: CudaSlice<f32>,
    pub bias: Option<CudaSlice<f32>>,
    pub experts: Vec<Mlp>,
    pub shared: Option<Mlp>,
    pub route: RouteParams,
    /// Every expert's gate_up and down addresses for the one-launch expert GEMMs
    /// (`None` when a dimension is not a multiple of 8: the experts then run one by one).
    pub grouped: Option<(ExpertWeights, ExpertWeights)>,
}

impl Moe {
    /// The address tables of `experts` for [`crate::ops::Ops::moe_grouped_sorted`].
    pub fn tables(s: &Arc<CudaStream>, experts: &[Mlp]) -> Result<Option<(ExpertWeights, ExpertWeights)>> {
        let Some(first) = experts.first() else { return Ok(None) };
        if first.gate_up.inp % 8 != 0 || first.down.inp % 8 != 0 {
            return Ok(None);
        }
        let gu: Vec<&Linear> = experts.iter().map(|m| &m.gate_up).collect();
        let dn: Vec<&Linear> = experts.iter().map(|m| &m.down).collect();
        Ok(Some((ExpertWeights::new(s, &gu)?, ExpertWeights::new(s, &dn)?)))
    }
}

impl Moe {
    fn load(l: &Loader, c: &MoeConfig, arch: Arch, layer: usize, h: usize) -> Result<Self> {
        let e = c.n_routed_experts;
        let n = |s: &str| names::layer(layer, s);
        let gate = l.s.clone_htod(&l.host(&n("mlp.gate.weight"), &[e, h], None)?)?;
        let bias = match c.topk_method {
            TopkMethod::NoauxTc => Some(l.vec(&n("mlp.gate.e_score_correction_bias"), e)?),
            _ => None,
        };
        let inter = c.moe_intermediate_size;
        let experts =
            (0..e).map(|i| Mlp::load(l, &n(&format!("mlp.experts.{i}")), h, inter)).collect::<Result<Vec<_>>>()?;
        let shared = if c.n_shared_experts > 0 {
            Some(Mlp::load(l, &n("mlp.shared_experts"), h, inter * c.n_shared_experts)?)
        } else {
            None
        };
        let route = route_params(c, arch);
        let grouped = Moe::tables(l.s, &experts)?;
        Ok(Moe { gate, bias, experts, shared, route, grouped })
    }
}

/// The routing kernel's parameters for a MoE config.
pub(crate) fn route_params(c: &MoeConfig, arch: Arch) -> RouteParams {
    RouteParams {
        experts: c.n_routed_experts,
        k: c.num_experts_per_tok,
        n_group: c.n_group,
        topk_group: c.topk_group,
        method: match c.topk_method {
            TopkMethod::Greedy => 0,
            TopkMethod::GroupLimitedGreedy => 1,
            TopkMethod::NoauxTc => 2,
        },
        scoring: match c.scoring_func {
            ScoringFunc::Sigmoid => 0,
            ScoringFunc::Softmax => 1,
        },
        // As DeepSeek-V2's code: normalise only for top-k > 1 there (mlaserve-cpu's rule).
        normalise: c.norm_topk_prob && (arch == Arch::DeepseekV3 || c.num_experts_per_tok > 1),
        scale: c.routed_scaling_factor as f32,
    }
}

#[derive(Debug)]
pub(crate) enum Ffn {
    Dense(Mlp),
    Moe(Box<Moe>),
}

/// MLA weights of this rank's heads.
#[derive(Debug)]
pub(crate) struct Attn {
    pub q_a: Option<(Linear, CudaSlice<f32>)>,
    pub q_b: Linear,
    pub kv_a: Linear,
    pub kv_a_norm: CudaSlice<f32>,
    /// `[heads][nope][lora]`, as a `[heads·nope][lora]` projection (the expanded form's
    /// `K_nope = c_kv · W_UKᵀ` over all heads in one GEMM).
    pub w_uk: Linear,
    /// `[heads][vdim][lora]`, as a `[heads·vdim][lora]` projection.
    pub w_uv: Linear,
    pub o_proj: Linear,
    pub heads: usize,
}

impl Attn {
    fn load(l: &Loader, c: &ModelConfig, layer: usize) -> Result<Self> {
        let (h, nh) = (c.hidden_size, c.num_attention_heads);
        let lh = nh / l.world;
        let qk = c.qk_head_dim();
        let n = |s: &str| names::layer(layer, s);
        let (q_a, q_b) = match c.q_lora_rank {
            Some(r) => {
                let qa = l.lin(&n("self_attn.q_a_proj.weight"), r, h, None)?;
                let qn = l.vec(&n("self_attn.q_a_layernorm.weight"), r)?;
                (Some((qa, qn)), l.lin(&n("self_attn.q_b_proj.weight"), nh * qk, r, Some(0))?)
            }
            None => (None, l.lin(&n("self_attn.q_proj.weight"), nh * qk, h, Some(0))?),
        };
        let kv_a = l.lin(&n("self_attn.kv_a_proj_with_mqa.weight"), c.latent_dim(), h, None)?;
        let kv_a_norm = l.vec(&n("self_attn.kv_a_layernorm.weight"), c.kv_lora_rank)?;
        let (nope, vdim, lora) = (c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
        // kv_b_proj stays bf16 (the absorbed form multiplies by its halves): widened on
        // the device, then split per head into W_UK and W_UV.
        let kv_b = l.bf16_matrix(&n("self_attn.kv_b_proj.weight"), [nh * (nope + vdim), lora], Some(0))?;
        let (mut uk, mut uv) = (l.s.alloc_zeros::<bf16>(lh * nope * lora)?, l.s.alloc_zeros::<bf16>(lh * vdim * lora)?);
        for hd in 0..lh {
            let base = hd * (nope + vdim) * lora;
            l.s.memcpy_dtod(
                &kv_b.slice(base..base + nope * lora),
                &mut uk.slice_mut(hd * nope * lora..(hd + 1) * nope * lora),
            )?;
            l.s.memcpy_dtod(
                &kv_b.slice(base + nope * lora..base + (nope + vdim) * lora),
                &mut uv.slice_mut(hd * vdim * lora..(hd + 1) * vdim * lora),
            )?;
        }
        Ok(Attn {
            q_a,
            q_b,
            kv_a,
            kv_a_norm,
            w_uk: Linear { w: uk, out: lh * nope, inp: lora },
            w_uv: Linear { w: uv, out: lh * vdim, inp: lora },
            o_proj: l.lin(&n("self_attn.o_proj.weight"), h, nh * vdim, Some(1))?,
            heads: lh,
        })
    }
}

#[derive(Debug)]
pub(crate) struct Block {
    pub in_norm: CudaSlice<f32>,
    pub attn: Attn,
    pub post_norm: CudaSlice<f32>,
    pub ffn: Ffn,
}

impl Block {
    pub fn load(l: &Loader, c: &ModelConfig, layer: usize) -> Result<Self> {
        let h = c.hidden_size;
        let ffn = match (&c.moe, c.is_moe_layer(layer)) {
            (Some(m), true) => Ffn::Moe(Box::new(Moe::load(l, m, c.arch, layer, h)?)),
            _ => Ffn::Dense(Mlp::load(l, &names::layer(layer, "mlp"), h, c.intermediate_size)?),
        };
        Ok(Block {
            in_norm: l.vec(&names::layer(layer, "input_layernorm.weight"), h)?,
            attn: Attn::load(l, c, layer)?,
            post_norm: l.vec(&names::layer(layer, "post_attention_layernorm.weight"), h)?,
            ffn,
        })
    }
}

/// A vocabulary-parallel table: rows `[lo, lo + rows)` of `[vocab, h]`.
#[derive(Debug)]
pub(crate) struct Embed {
    pub w: CudaSlice<bf16>,
    pub lo: usize,
    pub rows: usize,
}

impl Embed {
    pub fn load(l: &Loader, name: &str, vocab: usize, h: usize) -> Result<Self> {
        let rows = vocab / l.world;
        let v = l.host(name, &[vocab, h], Some(0))?;
        Ok(Embed { w: l.bf16(&v)?, lo: l.rank * rows, rows })
    }
}

/// An MTP layer: `eh_proj(concat[enorm(embed(t)), hnorm(h)])`, a decoder block, its own head norm.
#[derive(Debug)]
pub(crate) struct Mtp {
    pub enorm: CudaSlice<f32>,
    pub hnorm: CudaSlice<f32>,
    pub eh_proj: Linear,
    pub block: Block,
    pub head_norm: CudaSlice<f32>,
    /// The layer's own head; `None`: the main model's (absent, or the same tensor: V3
    /// ships a copy, which is checked byte for byte and not uploaded twice).
    pub head: Option<Linear>,
    /// The layer's own embedding; `None`: the main model's (likewise).
    pub embed: Option<Embed>,
}

impl Mtp {
    pub fn load(l: &Loader, c: &ModelConfig, d: usize, main_head: &str) -> Result<Self> {
        let (h, v) = (c.hidden_size, c.vocab_size);
        let layer = c.num_hidden_layers + d;
        let n = |s: &str| names::layer(layer, s);
        let bad = |e: mlaserve_core::Error| CudaError::Shape { kernel: "load", msg: e.to_string() };
        // Its own tensor, unless absent or identical to the main model's.
        let own = |name: String, main: &str| -> Result<Option<String>> {
            Ok(if l.w.contains(&name) && !l.w.same_tensor(&name, main).map_err(bad)? { Some(name) } else { None })
        };
        let own_head = own(n("shared_head.head.weight"), main_head)?;
        let own_embed = own(n("embed_tokens.weight"), names::EMBED)?;
        Ok(Mtp {
            enorm: l.vec(&n("enorm.weight"), h)?,
            hnorm: l.vec(&n("hnorm.weight"), h)?,
            eh_proj: l.lin(&n("eh_proj.weight"), h, 2 * h, None)?,
            block: Block::load(l, c, layer)?,
            head_norm: l.vec(&n("shared_head.norm.weight"), h)?,
            head: own_head.map(|name| l.lin(&name, v, h, Some(0))).transpose()?,
            embed: own_embed.map(|name| Embed::load(l, &name, v, h)).transpose()?,
        })
    }
}
