//! The model's weights on the device: read as f32 through `mlaserve_model::Weights`
//! (this rank's shard: heads, vocabulary and intermediate columns split as docs/architecture.md says), converted to bf16 on upload. Norm weights and the
//! routing bias stay f32 (tiny, and read by f32 kernels).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaViewMut};
use half::bf16;
use mlaserve_core::config::Arch;
use mlaserve_core::{ModelConfig, MoeConfig, ScoringFunc, TopkMethod};
use mlaserve_model::{names, Shard, Weights};

use super::layer::GROUPED_MAX_EXPERTS;
use super::proj::Proj;
use crate::error::{CudaError, Result};
use crate::fp8_dequant::{Fp8Dequant, Fp8Host};
use crate::fp8_grouped::Fp8Experts;
use crate::linear::Linear;
use crate::ops::{ExpertWeights, RouteParams};
use crate::stage::Stager;
use std::cell::RefCell;

pub(crate) fn mlerr(e: mlaserve_core::Error) -> crate::CudaError {
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
    /// Keep fp8 projections in fp8 (the fp8 kernels are loaded); off, widen them.
    pub fp8: bool,
    /// The grouped fp8 expert kernel exists here: a MoE layer's fp8 experts go into one
    /// buffer per projection ([`Grouped::Fp8`]).
    pub grouped_fp8: bool,
    /// Pinned staging for the bulk of the bytes (fp8 codes, bf16 tensors).
    pub stage: &'a RefCell<Stager>,
}

impl Loader<'_> {
    pub(crate) fn host(&self, name: &str, shape: &[usize], shard: Option<usize>) -> Result<Vec<f32>> {
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
    pub fn bf16_matrix(&self, name: &str, shape: [usize; 2], shard: Option<usize>) -> Result<CudaSlice<bf16>> {
        let (o, i) = match shard {
            Some(0) => (shape[0] / self.world, shape[1]),
            Some(_) => (shape[0], shape[1] / self.world),
            None => (shape[0], shape[1]),
        };
        let mut out = self.s.alloc_zeros::<bf16>(o * i)?;
        if self.bf16_raw_into(name, shape, shard, &mut out)? {
            return Ok(out);
        }
        if !self.fp8_into(name, shape, shard, &mut out.as_view_mut())? {
            let v = self.host(name, &shape, shard)?;
            self.s.memcpy_htod(&v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>(), &mut out)?;
        }
        Ok(out)
    }
    /// A bf16 tensor stored whole or split by rows (contiguous in the file) uploaded as
    /// stored, through the staging ring; `Ok(false)` for anything else.
    fn bf16_raw_into(
        &self,
        name: &str,
        shape: [usize; 2],
        shard: Option<usize>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<bool> {
        let Ok(raw) = self.w.raw(name) else { return Ok(false) };
        if raw.dtype != mlaserve_model::Dtype::BF16 || raw.shape != shape || matches!(shard, Some(1) if self.world > 1)
        {
            return Ok(false);
        }
        let rows = if shard.is_some() { shape[0] / self.world } else { shape[0] };
        let first = if shard.is_some() { self.rank * rows } else { 0 };
        let bytes = &raw.data[first * shape[1] * 2..(first + rows) * shape[1] * 2];
        self.w.count_read(name);
        // SAFETY: the view covers exactly out's bytes (bf16 is 2 bytes, plain data).
        let mut view =
            unsafe { out.transmute_mut::<u8>(out.len() * 2) }.ok_or_else(|| CudaError::shape("load", "bf16 view"))?;
        self.stage.borrow_mut().upload(self.s, bytes, &mut view)?;
        Ok(true)
    }

    /// A norm weight or bias, replicated, f32.
    pub fn vec(&self, name: &str, len: usize) -> Result<CudaSlice<f32>> {
        Ok(self.s.clone_htod(&self.host(name, &[len], None)?)?)
    }
    /// `[out, inp]` split along `shard` (0: output rows, 1: input columns) or replicated,
    /// in bf16 whatever the checkpoint's dtype ([`Loader::proj`] keeps fp8).
    pub fn lin(&self, name: &str, out: usize, inp: usize, shard: Option<usize>) -> Result<Linear> {
        let (o, i) = match shard {
            Some(0) => (out / self.world, inp),
            Some(_) => (out, inp / self.world),
            None => (out, inp),
        };
        Ok(Linear { w: self.bf16_matrix(name, [out, inp], shard)?, out: o, inp: i })
    }
}

/// SwiGLU MLP with gate and up fused into one `[gate | up]` projection (an fp8 one pads
/// each half to whole scale rows: [`crate::fp8_plan::gate_up_half`]).
#[derive(Debug)]
pub(crate) struct Mlp {
    pub gate_up: Proj,
    pub down: Proj,
}

impl Mlp {
    fn load(l: &Loader, prefix: &str, h: usize, inter: usize) -> Result<Self> {
        if l.mlp_fp8(prefix, h, inter) {
            return Ok(Mlp {
                gate_up: l.fp8_gate_up(prefix, h, inter)?,
                down: l.proj(&format!("{prefix}.down_proj.weight"), h, inter, Some(1))?,
            });
        }
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
            gate_up: Proj::Bf16(Linear { w: gate_up, out: 2 * local, inp: h }),
            down: Proj::Bf16(l.lin(&format!("{prefix}.down_proj.weight"), h, inter, Some(1))?),
        })
    }
    /// Local intermediate width (the SiLU's output, down's input).
    pub fn inter(&self) -> usize {
        self.down.inp()
    }
    /// Rows of each half of gate_up (≥ [`Mlp::inter`]: fp8 pads them).
    pub fn half(&self) -> usize {
        self.gate_up.out() / 2
    }
}

/// Every routed expert of a layer in one launch per projection.
#[derive(Debug)]
pub(crate) enum Grouped {
    /// bf16: the experts' addresses (`Ops::moe_grouped_sorted`).
    Bf16(ExpertWeights, ExpertWeights),
    /// fp8: every expert's gate_up and down in one buffer each (`Fp8Grouped`).
    Fp8(Fp8Experts, Fp8Experts),
}

#[derive(Debug)]
pub(crate) struct Moe {
    /// Router weight `[experts][h]`, f32 (the router runs in f32, as transformers').
    pub gate: CudaSlice<f32>,
    pub bias: Option<CudaSlice<f32>>,
    /// One MLP per expert; empty when the experts live in [`Grouped::Fp8`] only.
    pub experts: Vec<Mlp>,
    pub shared: Option<Mlp>,
    pub route: RouteParams,
    /// The experts for the one-launch expert GEMMs (`None` when the experts run one by
    /// one: bf16 dimensions not multiples of 8, fp8 without the grouped kernel).
    pub grouped: Option<Grouped>,
}

impl Moe {
    /// The bf16 address tables of `experts` for [`crate::ops::Ops::moe_grouped_sorted`]
    /// (`None` for fp8 experts or dimensions the kernel does not take).
    pub fn tables(s: &Arc<CudaStream>, experts: &[Mlp]) -> Result<Option<Grouped>> {
        let Some(first) = experts.first() else { return Ok(None) };
        fn bf16(p: &Proj) -> Option<&Linear> {
            match p {
                Proj::Bf16(l) => Some(l),
                Proj::Fp8(_) => None,
            }
        }
        let gu: Option<Vec<&Linear>> = experts.iter().map(|m| bf16(&m.gate_up)).collect();
        let dn: Option<Vec<&Linear>> = experts.iter().map(|m| bf16(&m.down)).collect();
        let (Some(gu), Some(dn)) = (gu, dn) else { return Ok(None) };
        if first.gate_up.inp() % 8 != 0 || first.down.inp() % 8 != 0 {
            return Ok(None);
        }
        Ok(Some(Grouped::Bf16(ExpertWeights::new(s, &gu)?, ExpertWeights::new(s, &dn)?)))
    }

    /// Routed experts per layer and one expert's bytes (gate_up and down).
    pub fn expert_bytes(&self) -> (u64, u64) {
        match &self.grouped {
            Some(Grouped::Fp8(gu, dn)) => (gu.experts as u64, (gu.expert_bytes() + dn.expert_bytes()) as u64),
            _ => (self.experts.len() as u64, self.experts.first().map_or(0, |m| m.gate_up.bytes() + m.down.bytes())),
        }
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
        let prefix = n("mlp.experts");
        let all_fp8 = (0..e).all(|i| l.mlp_fp8(&format!("{prefix}.{i}"), h, inter));
        let (experts, grouped) = if l.grouped_fp8 && all_fp8 && e <= GROUPED_MAX_EXPERTS {
            let (gu, dn) = l.fp8_experts(&prefix, e, h, inter)?;
            (Vec::new(), Some(Grouped::Fp8(gu, dn)))
        } else {
            let experts =
                (0..e).map(|i| Mlp::load(l, &format!("{prefix}.{i}"), h, inter)).collect::<Result<Vec<_>>>()?;
            let grouped = Moe::tables(l.s, &experts)?;
            (experts, grouped)
        };
        let shared = if c.n_shared_experts > 0 {
            Some(Mlp::load(l, &n("mlp.shared_experts"), h, inter * c.n_shared_experts)?)
        } else {
            None
        };
        let route = route_params(c, arch);
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
    Dense(Box<Mlp>),
    Moe(Box<Moe>),
}

/// MLA weights of this rank's heads.
#[derive(Debug)]
pub(crate) struct Attn {
    pub q_a: Option<(Proj, CudaSlice<f32>)>,
    pub q_b: Proj,
    pub kv_a: Proj,
    pub kv_a_norm: CudaSlice<f32>,
    /// `[heads][nope][lora]`, as a `[heads·nope][lora]` projection (the expanded form's
    /// `K_nope = c_kv · W_UKᵀ` over all heads in one GEMM).
    pub w_uk: Linear,
    /// `[heads][vdim][lora]`, as a `[heads·vdim][lora]` projection.
    pub w_uv: Linear,
    pub o_proj: Proj,
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
                let qa = l.proj(&n("self_attn.q_a_proj.weight"), r, h, None)?;
                let qn = l.vec(&n("self_attn.q_a_layernorm.weight"), r)?;
                (Some((qa, qn)), l.proj(&n("self_attn.q_b_proj.weight"), nh * qk, r, Some(0))?)
            }
            None => (None, l.proj(&n("self_attn.q_proj.weight"), nh * qk, h, Some(0))?),
        };
        let kv_a = l.proj(&n("self_attn.kv_a_proj_with_mqa.weight"), c.latent_dim(), h, None)?;
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
            o_proj: l.proj(&n("self_attn.o_proj.weight"), h, nh * vdim, Some(1))?,
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
            _ => Ffn::Dense(Box::new(Mlp::load(l, &names::layer(layer, "mlp"), h, c.intermediate_size)?)),
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
        Ok(Embed { w: l.bf16_matrix(name, [vocab, h], Some(0))?, lo: l.rank * rows, rows })
    }
}

/// An MTP layer: `eh_proj(concat[enorm(embed(t)), hnorm(h)])`, a decoder block, its own head norm.
#[derive(Debug)]
pub(crate) struct Mtp {
    pub enorm: CudaSlice<f32>,
    pub hnorm: CudaSlice<f32>,
    pub eh_proj: Proj,
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
            eh_proj: l.proj(&n("eh_proj.weight"), h, 2 * h, None)?,
            block: Block::load(l, c, layer)?,
            head_norm: l.vec(&n("shared_head.norm.weight"), h)?,
            head: own_head.map(|name| l.lin(&name, v, h, Some(0))).transpose()?,
            embed: own_embed.map(|name| Embed::load(l, &name, v, h)).transpose()?,
        })
    }
}
