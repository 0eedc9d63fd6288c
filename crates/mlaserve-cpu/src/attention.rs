//! Multi-head latent attention (MLA) over a paged latent cache, in both forms.
//!
//! The cache holds `[c_kv (kv_lora_rank), k_pe (rope)]` per token per layer, in blocks of
//! [`BLOCK_SIZE`] tokens. The *absorbed* form folds `W_UK` into the query
//! (`q_lat = W_UKᵀ q_nope`) and `W_UV` into the output, attending over the latent
//! directly — what the decode kernel does. The *expanded* form up-projects every cached
//! latent to per-head keys and values — what prefill kernels do. Both compute the same
//! function; a test holds them within 1e-5.
//!
//! Under tensor parallelism a rank owns `heads / world` heads: `q_b_proj` (or `q_proj`)
//! and `kv_b_proj` are split by heads, `o_proj` by input (the caller all-reduces), and
//! the latent projections are replicated.

use crate::fp8::{kv_fp8_round, load_linear, Fp8Act};
use crate::ops::{dot, rms_norm, Linear, Rope};
use mlaserve_core::{KvCacheDtype, ModelConfig, Result, BLOCK_SIZE};
use mlaserve_model::{names, Shard, Weights};
use rayon::prelude::*;

/// Which MLA form computes attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnMode {
    /// Absorbed for every token (the default: a token's result then depends only on its
    /// own inputs and the cache, never on how the step was chunked).
    #[default]
    Absorbed,
    /// Expanded for every token.
    Expanded,
}

/// One layer's latent cache: `[num_blocks, BLOCK_SIZE, latent]` f32. With the fp8 format
/// each entry is stored as the fp8 layout reads it back ([`kv_fp8_round`]); the arrays
/// stay f32, since the reference computes what the format means, not its bytes.
#[derive(Debug, Clone)]
pub struct LayerCache {
    pub data: Vec<f32>,
    latent: usize,
    /// `Some(kv_lora_rank)` for [`KvCacheDtype::Fp8`].
    fp8_lora: Option<usize>,
    /// Round an entry to bf16 before its fp8 rounding (a perturbation of the writes, to
    /// measure how sensitive outputs are to the fp8 codes; `CpuOptions::fp8_bf16_inputs`).
    bf16_first: bool,
}

impl LayerCache {
    /// An f32 cache (`KvCacheDtype::Auto`).
    pub fn new(num_blocks: usize, latent: usize) -> Self {
        LayerCache { data: vec![0f32; num_blocks * BLOCK_SIZE * latent], latent, fp8_lora: None, bf16_first: false }
    }
    /// A cache in `dtype`, for latents of `lora` latent channels then RoPE channels;
    /// `bf16_first`: an fp8 cache rounds each entry to bf16 before its fp8 rounding.
    pub fn with_dtype(num_blocks: usize, latent: usize, lora: usize, dtype: KvCacheDtype, bf16_first: bool) -> Self {
        let fp8_lora = (dtype == KvCacheDtype::Fp8).then_some(lora);
        LayerCache { fp8_lora, bf16_first, ..Self::new(num_blocks, latent) }
    }
    /// Stores `row` (`[c_kv, k_pe]`) as the entry of position `pos`.
    fn write(&mut self, table: &[u32], pos: usize, row: &[f32]) {
        let s = self.slot(table, pos);
        let e = &mut self.data[s..s + self.latent];
        e.copy_from_slice(row);
        if let Some(lora) = self.fp8_lora {
            if self.bf16_first {
                e.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
            }
            kv_fp8_round(e, lora);
        }
    }
    fn slot(&self, table: &[u32], pos: usize) -> usize {
        (table[pos / BLOCK_SIZE] as usize * BLOCK_SIZE + pos % BLOCK_SIZE) * self.latent
    }
    fn entry(&self, table: &[u32], pos: usize) -> &[f32] {
        let s = self.slot(table, pos);
        &self.data[s..s + self.latent]
    }
}

/// Where each row of a step lives: its sequence and position.
#[derive(Debug, Clone)]
pub struct StepLayout<'a> {
    /// Per row: (sequence index, position).
    pub rows: Vec<(usize, usize)>,
    /// Per sequence: block table.
    pub tables: Vec<&'a [u32]>,
}

/// An MLA layer's weights (this rank's heads).
#[derive(Debug)]
pub struct Mla {
    q_a: Option<(Linear, Vec<f32>)>,
    q_b: Linear,
    kv_a: Linear,
    kv_a_norm: Vec<f32>,
    /// `[local_heads, qk_nope, kv_lora]`.
    w_uk: Vec<f32>,
    /// `[local_heads, v_head_dim, kv_lora]`.
    w_uv: Vec<f32>,
    o_proj: Linear,
    heads: usize,
    nope: usize,
    rope: usize,
    vdim: usize,
    lora: usize,
    eps: f32,
    scale: f32,
}

impl Mla {
    pub fn load(w: &Weights, c: &ModelConfig, layer: usize, rank: usize, world: usize) -> Result<Self> {
        Self::load_with(w, c, layer, rank, world, Fp8Act::F32)
    }

    /// [`Mla::load`]; `fp8_act` says whether fp8 weights quantise their activations.
    /// `kv_b_proj` is always dequantised: its halves `W_UK`/`W_UV` multiply per-head
    /// vectors inside attention (absorbed into the query and the output), where the GPU
    /// path, like vLLM's and SGLang's, uses them dequantised in bf16, not as an fp8 GEMM.
    pub fn load_with(
        w: &Weights,
        c: &ModelConfig,
        layer: usize,
        rank: usize,
        world: usize,
        fp8_act: Fp8Act,
    ) -> Result<Self> {
        let (h, nh) = (c.hidden_size, c.num_attention_heads);
        let lh = nh / world;
        let qk = c.qk_head_dim();
        let heads_shard = Some(Shard::new(0, rank, world));
        let n = |s: &str| names::layer(layer, s);
        let (q_a, q_b) = match c.q_lora_rank {
            Some(r) => {
                let qa = load_linear(w, &n("self_attn.q_a_proj.weight"), [r, h], None, fp8_act)?;
                let qn = w.f32(&n("self_attn.q_a_layernorm.weight"), &[r])?;
                let qb = load_linear(w, &n("self_attn.q_b_proj.weight"), [nh * qk, r], heads_shard, fp8_act)?;
                (Some((qa, qn)), qb)
            }
            None => (None, load_linear(w, &n("self_attn.q_proj.weight"), [nh * qk, h], heads_shard, fp8_act)?),
        };
        let lat = c.latent_dim();
        let kv_a = load_linear(w, &n("self_attn.kv_a_proj_with_mqa.weight"), [lat, h], None, fp8_act)?;
        let kv_a_norm = w.f32(&n("self_attn.kv_a_layernorm.weight"), &[c.kv_lora_rank])?;
        let (nope, vdim, lora) = (c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank);
        let kv_b = w.f32_shard(&n("self_attn.kv_b_proj.weight"), &[nh * (nope + vdim), lora], heads_shard)?;
        // kv_b rows per head: `nope` rows of W_UK, then `vdim` rows of W_UV.
        let mut w_uk = Vec::with_capacity(lh * nope * lora);
        let mut w_uv = Vec::with_capacity(lh * vdim * lora);
        for hd in 0..lh {
            let base = hd * (nope + vdim) * lora;
            w_uk.extend_from_slice(&kv_b[base..base + nope * lora]);
            w_uv.extend_from_slice(&kv_b[base + nope * lora..base + (nope + vdim) * lora]);
        }
        let o_proj =
            load_linear(w, &n("self_attn.o_proj.weight"), [h, nh * vdim], Some(Shard::new(1, rank, world)), fp8_act)?;
        Ok(Mla {
            q_a,
            q_b,
            kv_a,
            kv_a_norm,
            w_uk,
            w_uv,
            o_proj,
            heads: lh,
            nope,
            rope: c.qk_rope_head_dim,
            vdim,
            lora,
            // DeepSeek's and transformers' q_a/kv_a norms use eps 1e-6 whatever
            // `rms_norm_eps` says.
            eps: 1e-6,
            scale: c.softmax_scale() as f32,
        })
    }

    /// Attention over `x` (`[n, hidden]`, already normed): writes the new tokens' latent
    /// into `cache`, then attends causally. Returns this rank's partial `o_proj` output.
    pub fn forward(
        &self,
        x: &[f32],
        layout: &StepLayout,
        cache: &mut LayerCache,
        rope: &Rope,
        mode: AttnMode,
    ) -> Vec<f32> {
        let qk = self.nope + self.rope;
        let q = match &self.q_a {
            Some((qa, qn)) => {
                let mut cq = qa.forward(x);
                rms_norm(&mut cq, qn, self.eps);
                self.q_b.forward(&cq)
            }
            None => self.q_b.forward(x),
        };
        let lat = self.lora + self.rope;
        let mut kv = self.kv_a.forward(x);
        for (r, &(seq, pos)) in layout.rows.iter().enumerate() {
            let row = &mut kv[r * lat..(r + 1) * lat];
            let (ckv, kpe) = row.split_at_mut(self.lora);
            rms_norm(ckv, &self.kv_a_norm, self.eps);
            rope.apply(kpe, pos);
            cache.write(layout.tables[seq], pos, row);
        }
        let cache = &*cache;
        // Expanded form: up-project each sequence's cached latents once per step.
        let expanded: Vec<Option<(Vec<f32>, Vec<f32>)>> = match mode {
            AttnMode::Absorbed => vec![None; layout.tables.len()],
            AttnMode::Expanded => (0..layout.tables.len())
                .map(|s| {
                    let end = layout.rows.iter().filter(|r| r.0 == s).map(|r| r.1 + 1).max().unwrap_or(0);
                    Some(self.expand(cache, layout.tables[s], end))
                })
                .collect(),
        };
        let o: Vec<f32> = (0..layout.rows.len())
            .into_par_iter()
            .flat_map_iter(|r| {
                let (seq, pos) = layout.rows[r];
                let mut qr = q[r * self.heads * qk..(r + 1) * self.heads * qk].to_vec();
                for hd in 0..self.heads {
                    rope.apply(&mut qr[hd * qk + self.nope..(hd + 1) * qk], pos);
                }
                match &expanded[seq] {
                    None => self.attend_absorbed(&qr, cache, layout.tables[seq], pos),
                    Some((k, v)) => self.attend_expanded(&qr, cache, layout.tables[seq], pos, k, v),
                }
            })
            .collect();
        self.o_proj.forward(&o)
    }

    /// One token, absorbed: `q_lat = W_UKᵀ q_nope`; keys `[c_kv, k_pe]`, values `c_kv`.
    fn attend_absorbed(&self, q: &[f32], cache: &LayerCache, table: &[u32], pos: usize) -> Vec<f32> {
        let qk = self.nope + self.rope;
        let mut out = Vec::with_capacity(self.heads * self.vdim);
        let mut scores = vec![0f32; pos + 1];
        for hd in 0..self.heads {
            let (q_nope, q_pe) = q[hd * qk..(hd + 1) * qk].split_at(self.nope);
            let wuk = &self.w_uk[hd * self.nope * self.lora..(hd + 1) * self.nope * self.lora];
            let mut q_lat = vec![0f32; self.lora];
            for (n, &qn) in q_nope.iter().enumerate() {
                for (c, ql) in q_lat.iter_mut().enumerate() {
                    *ql += qn * wuk[n * self.lora + c];
                }
            }
            for (j, s) in scores.iter_mut().enumerate() {
                let e = cache.entry(table, j);
                *s = (dot(&q_lat, &e[..self.lora]) + dot(q_pe, &e[self.lora..])) * self.scale;
            }
            let probs = softmax(&scores);
            let mut o_lat = vec![0f32; self.lora];
            for (j, p) in probs.iter().enumerate() {
                let e = cache.entry(table, j);
                for (o, c) in o_lat.iter_mut().zip(&e[..self.lora]) {
                    *o += p * c;
                }
            }
            let wuv = &self.w_uv[hd * self.vdim * self.lora..(hd + 1) * self.vdim * self.lora];
            for v in 0..self.vdim {
                out.push(dot(&wuv[v * self.lora..(v + 1) * self.lora], &o_lat));
            }
        }
        out
    }

    /// Per-head keys (nope part) and values of positions `0..end`:
    /// `[end, heads, nope]` and `[end, heads, vdim]`.
    fn expand(&self, cache: &LayerCache, table: &[u32], end: usize) -> (Vec<f32>, Vec<f32>) {
        let mut k = Vec::with_capacity(end * self.heads * self.nope);
        let mut v = Vec::with_capacity(end * self.heads * self.vdim);
        for j in 0..end {
            let ckv = &cache.entry(table, j)[..self.lora];
            for hd in 0..self.heads {
                let wuk = &self.w_uk[hd * self.nope * self.lora..];
                k.extend((0..self.nope).map(|n| dot(&wuk[n * self.lora..(n + 1) * self.lora], ckv)));
                let wuv = &self.w_uv[hd * self.vdim * self.lora..];
                v.extend((0..self.vdim).map(|d| dot(&wuv[d * self.lora..(d + 1) * self.lora], ckv)));
            }
        }
        (k, v)
    }

    fn attend_expanded(
        &self,
        q: &[f32],
        cache: &LayerCache,
        table: &[u32],
        pos: usize,
        k: &[f32],
        v: &[f32],
    ) -> Vec<f32> {
        let qk = self.nope + self.rope;
        let mut out = Vec::with_capacity(self.heads * self.vdim);
        let mut scores = vec![0f32; pos + 1];
        for hd in 0..self.heads {
            let (q_nope, q_pe) = q[hd * qk..(hd + 1) * qk].split_at(self.nope);
            for (j, s) in scores.iter_mut().enumerate() {
                let kn = &k[(j * self.heads + hd) * self.nope..][..self.nope];
                let kpe = &cache.entry(table, j)[self.lora..];
                *s = (dot(q_nope, kn) + dot(q_pe, kpe)) * self.scale;
            }
            let probs = softmax(&scores);
            let mut o = vec![0f32; self.vdim];
            for (j, p) in probs.iter().enumerate() {
                let vj = &v[(j * self.heads + hd) * self.vdim..][..self.vdim];
                for (a, b) in o.iter_mut().zip(vj) {
                    *a += p * b;
                }
            }
            out.extend(o);
        }
        out
    }
}

/// Two-pass softmax in index order.
fn softmax(s: &[f32]) -> Vec<f32> {
    let m = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.iter().map(|x| x / sum).collect()
}
