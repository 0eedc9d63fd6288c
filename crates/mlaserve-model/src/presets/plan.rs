//! The tensors of a generated checkpoint and how each one's values are drawn.
//!
//! Values come from splitmix64 seeded by the preset's seed and the tensor's (seed) name;
//! value `i` of a tensor depends only on `i`, so a tensor can be drawn in bands, in
//! parallel, without holding it whole (a V3-width layer is far larger than we want in
//! memory). Which linears are fp8 follows DeepSeek-V3's published checkpoint: the
//! attention projections and every MLP/expert projection; the embeddings, norms, router
//! gate and its bias, `eh_proj` and the heads stay high precision.

use crate::names;
use mlaserve_core::{ModelConfig, TopkMethod};

const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

pub(crate) fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x100_0000_01b3))
}

/// How a tensor's values follow from uniform draws `u` in [-1, 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Init {
    /// `u · a`.
    Scaled(f32),
    /// `1 + 0.1 u` (norm weights).
    Norm,
    /// `0.05 (u + 1)`: non-negative, so the group mask's fill value never matters.
    Bias,
}

/// One tensor of the checkpoint (an fp8 weight's block scales go with it).
#[derive(Debug, Clone)]
pub(crate) struct Spec {
    pub name: String,
    pub shape: Vec<usize>,
    /// Whose draws it takes: its own name, or the tensor it copies (MTP embedding).
    pub seed_name: String,
    pub init: Init,
    /// Stored as F8_E4M3 with F32 block scales (else BF16).
    pub fp8: bool,
}

impl Spec {
    /// The state before value 0 of this tensor.
    pub fn stream(&self, seed: u64) -> u64 {
        seed ^ fnv1a(self.seed_name.as_bytes())
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Value `i` of the stream that starts at `state` (the `i + 1`-th draw of splitmix64).
#[inline]
pub(crate) fn value(state: u64, i: usize, init: Init) -> f32 {
    let z = mix(state.wrapping_add(GAMMA.wrapping_mul(i as u64 + 1)));
    let u = ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
    match init {
        Init::Scaled(a) => u * a,
        Init::Norm => 1.0 + 0.1 * u,
        Init::Bias => 0.05 * (u + 1.0),
    }
}

struct Plan {
    fp8: bool,
    out: Vec<Spec>,
}

impl Plan {
    fn push(&mut self, name: &str, shape: &[usize], init: Init, fp8: bool) {
        self.out.push(Spec { name: name.into(), shape: shape.to_vec(), seed_name: name.into(), init, fp8 });
    }
    /// A linear that DeepSeek stores in fp8 (when the checkpoint is fp8).
    fn proj(&mut self, name: &str, out: usize, inp: usize) {
        self.push(name, &[out, inp], Init::Scaled((3.0 / inp as f32).sqrt()), self.fp8);
    }
    fn norm(&mut self, name: &str, n: usize) {
        self.push(name, &[n], Init::Norm, false);
    }
    fn mlp(&mut self, prefix: &str, hidden: usize, inter: usize) {
        self.proj(&format!("{prefix}.gate_proj.weight"), inter, hidden);
        self.proj(&format!("{prefix}.up_proj.weight"), inter, hidden);
        self.proj(&format!("{prefix}.down_proj.weight"), hidden, inter);
    }

    fn decoder_layer(&mut self, c: &ModelConfig, l: usize) {
        let h = c.hidden_size;
        let nh = c.num_attention_heads;
        let n = |s: &str| names::layer(l, s);
        self.norm(&n("input_layernorm.weight"), h);
        self.norm(&n("post_attention_layernorm.weight"), h);
        match c.q_lora_rank {
            Some(r) => {
                self.proj(&n("self_attn.q_a_proj.weight"), r, h);
                self.norm(&n("self_attn.q_a_layernorm.weight"), r);
                self.proj(&n("self_attn.q_b_proj.weight"), nh * c.qk_head_dim(), r);
            }
            None => self.proj(&n("self_attn.q_proj.weight"), nh * c.qk_head_dim(), h),
        }
        self.proj(&n("self_attn.kv_a_proj_with_mqa.weight"), c.latent_dim(), h);
        self.norm(&n("self_attn.kv_a_layernorm.weight"), c.kv_lora_rank);
        self.proj(&n("self_attn.kv_b_proj.weight"), nh * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank);
        self.proj(&n("self_attn.o_proj.weight"), h, nh * c.v_head_dim);
        match (&c.moe, c.is_moe_layer(l)) {
            (Some(m), true) => {
                let a = 2.0 * (3.0 / h as f32).sqrt();
                self.push(&n("mlp.gate.weight"), &[m.n_routed_experts, h], Init::Scaled(a), false);
                if m.topk_method == TopkMethod::NoauxTc {
                    self.push(&n("mlp.gate.e_score_correction_bias"), &[m.n_routed_experts], Init::Bias, false);
                }
                for e in 0..m.n_routed_experts {
                    self.mlp(&n(&format!("mlp.experts.{e}")), h, m.moe_intermediate_size);
                }
                if m.n_shared_experts > 0 {
                    self.mlp(&n("mlp.shared_experts"), h, m.moe_intermediate_size * m.n_shared_experts);
                }
            }
            _ => self.mlp(&n("mlp"), h, c.intermediate_size),
        }
    }
}

/// Every tensor of a checkpoint for `c`, in file order: embedding, final norm, head, the
/// decoder layers, then the MTP layers.
pub(crate) fn plan(c: &ModelConfig, fp8: bool) -> Vec<Spec> {
    let mut p = Plan { fp8, out: Vec::new() };
    let (h, v) = (c.hidden_size, c.vocab_size);
    p.push(names::EMBED, &[v, h], Init::Scaled(1.0), false);
    p.norm(names::FINAL_NORM, h);
    let head = Init::Scaled(4.0 * (3.0 / h as f32).sqrt());
    if !c.tie_word_embeddings {
        p.push(names::LM_HEAD, &[v, h], head, false);
    }
    for l in 0..c.num_hidden_layers {
        p.decoder_layer(c, l);
    }
    for d in 0..c.num_nextn_predict_layers {
        let l = c.num_hidden_layers + d;
        p.decoder_layer(c, l);
        let n = |s: &str| names::layer(l, s);
        p.norm(&n("enorm.weight"), h);
        p.norm(&n("hnorm.weight"), h);
        // `eh_proj` is bf16 in DeepSeek-V3's checkpoint (vLLM loads it as a plain linear).
        p.push(&n("eh_proj.weight"), &[h, 2 * h], Init::Scaled((3.0 / (2 * h) as f32).sqrt()), false);
        p.norm(&n("shared_head.norm.weight"), h);
        p.push(&n("shared_head.head.weight"), &[v, h], head, false);
        // MTP layer 0 carries its own copy of the embedding (as DeepSeek-V3's checkpoint
        // does); later layers omit it and fall back to the main one.
        if d == 0 {
            let mut e = p.out[0].clone();
            e.name = n("embed_tokens.weight");
            p.out.push(e);
        }
    }
    p.out
}
