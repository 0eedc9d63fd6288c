//! mlaserve-cpu: the f32 reference backend.
//!
//! It is the oracle every other backend is compared with, the backend CI runs, and the
//! default when a machine has no GPU. Clarity and exactness come first: f32 weights and
//! activations, f32 latent cache, reductions in a fixed order so a token's result never
//! depends on the rest of its batch. One instance is one tensor-parallel rank; with a
//! [`Collective`] of world size > 1 it loads only its shards (heads, intermediate columns and vocabulary split as vLLM and SGLang do) and all-reduces
//! twice per layer.

pub mod attention;
pub mod fp8;
pub mod moe;
pub mod ops;

use attention::{AttnMode, LayerCache, Mla, StepLayout};
use fp8::{load_linear, Fp8Act};
use mlaserve_core::{
    Backend, Batch, Choices, Collective, Error, ForwardOutput, KvCacheDtype, ModelConfig, Result, SingleRank,
};
use mlaserve_model::{names, LoadProgress, Shard, Weights};
use moe::{Mlp, Moe};
use ops::{rms_norm, Linear, Rope};
use std::path::Path;
use std::sync::Arc;

/// Construction options of the CPU backend.
#[derive(Debug, Clone, Copy)]
pub struct CpuOptions {
    /// Physical blocks of [`mlaserve_core::BLOCK_SIZE`] tokens in the latent cache.
    pub num_blocks: usize,
    pub attn_mode: AttnMode,
    /// For an fp8 checkpoint: quantise activations per token per 128 channels before each
    /// linear whose weight is fp8, as the GPU's fp8 GEMMs do ([`fp8`]); on by default.
    /// Off, the fp8 weights are dequantised and multiplied in f32: the dequantised model,
    /// to measure what activation quantisation costs. No effect on bf16/f32 weights.
    pub fp8_activations: bool,
    /// With `fp8_activations`: round each fp8 linear's input to bf16 before quantising
    /// it, as the CUDA backend does (its activations between kernels are bf16), so a GPU
    /// run can be held to this one tightly; off by default (the input quantised from f32).
    /// An fp8 latent cache likewise rounds each entry to bf16 before its fp8 rounding (a
    /// perturbation the GPU tests measure the codes' sensitivity with).
    pub fp8_bf16_inputs: bool,
    /// How the latent cache is stored ([`KvCacheDtype::Fp8`]: DeepSeek's fp8 layout, its
    /// rounding computed at every cache write; `Auto`: f32).
    pub kv_cache_dtype: KvCacheDtype,
}

impl CpuOptions {
    /// What fp8 weights do with their inputs under these options.
    pub fn fp8_act(&self) -> Fp8Act {
        match (self.fp8_activations, self.fp8_bf16_inputs) {
            (false, _) => Fp8Act::Off,
            (true, false) => Fp8Act::F32,
            (true, true) => Fp8Act::Bf16,
        }
    }
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions {
            num_blocks: 256,
            attn_mode: AttnMode::Absorbed,
            fp8_activations: true,
            fp8_bf16_inputs: false,
            kv_cache_dtype: KvCacheDtype::Auto,
        }
    }
}

/// Hidden states of a step, `rows × hidden_size`, on the host.
#[derive(Debug, Clone)]
pub struct CpuHidden {
    pub rows: usize,
    pub data: Vec<f32>,
}

#[derive(Debug)]
enum Ffn {
    Dense(Mlp),
    Moe(Moe),
}

/// A decoder block: MLA + (dense or MoE) FFN, pre-norm residual.
#[derive(Debug)]
struct Block {
    in_norm: Vec<f32>,
    attn: Mla,
    post_norm: Vec<f32>,
    ffn: Ffn,
}

impl Block {
    fn load(w: &Weights, c: &ModelConfig, layer: usize, rank: usize, world: usize, fp8_act: Fp8Act) -> Result<Self> {
        let h = c.hidden_size;
        let ffn = match (&c.moe, c.is_moe_layer(layer)) {
            (Some(m), true) => Ffn::Moe(Moe::load_with(w, m, c.arch, layer, h, rank, world, fp8_act)?),
            _ => Ffn::Dense(Mlp::load_with(
                w,
                &names::layer(layer, "mlp"),
                h,
                c.intermediate_size,
                rank,
                world,
                fp8_act,
            )?),
        };
        Ok(Block {
            in_norm: w.f32(&names::layer(layer, "input_layernorm.weight"), &[h])?,
            attn: Mla::load_with(w, c, layer, rank, world, fp8_act)?,
            post_norm: w.f32(&names::layer(layer, "post_attention_layernorm.weight"), &[h])?,
            ffn,
        })
    }
}

/// A vocabulary-parallel embedding table: this rank's rows `[lo, lo + rows)`.
#[derive(Debug)]
struct VocabShard {
    w: Vec<f32>,
    lo: usize,
    rows: usize,
}

impl VocabShard {
    fn load(w: &Weights, name: &str, vocab: usize, h: usize, rank: usize, world: usize) -> Result<Self> {
        let rows = vocab / world;
        Ok(VocabShard { w: w.f32_shard(name, &[vocab, h], Some(Shard::new(0, rank, world)))?, lo: rank * rows, rows })
    }
}

/// An MTP layer: `eh_proj(concat[enorm(embed(t)), hnorm(h)])`, a decoder block, its own head norm.
#[derive(Debug)]
struct MtpLayer {
    enorm: Vec<f32>,
    hnorm: Vec<f32>,
    eh_proj: Linear,
    block: Block,
    head_norm: Vec<f32>,
    /// The layer's own head when the checkpoint has one that differs from the model's.
    head: Option<Linear>,
    /// The layer's own embedding when the checkpoint has one that differs from the model's.
    embed: Option<VocabShard>,
}

/// The reference backend (one tensor-parallel rank).
pub struct CpuBackend {
    cfg: ModelConfig,
    comm: Box<dyn Collective>,
    embed: VocabShard,
    blocks: Vec<Block>,
    final_norm: Vec<f32>,
    lm_head: Linear,
    mtp: Vec<MtpLayer>,
    /// Target layers first, then one cache per MTP layer.
    caches: Vec<LayerCache>,
    rope: Rope,
    opts: CpuOptions,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("layers", &self.blocks.len())
            .field("mtp_layers", &self.mtp.len())
            .field("rank", &self.comm.rank())
            .field("world_size", &self.comm.world_size())
            .finish()
    }
}

impl CpuBackend {
    /// Loads the checkpoint in `dir` for a single rank.
    pub fn load(dir: &Path, num_blocks: usize) -> Result<Self> {
        Self::load_with(dir, CpuOptions { num_blocks, ..Default::default() }, Box::new(SingleRank))
    }

    /// Loads this rank's shards of the checkpoint in `dir`.
    pub fn load_with(dir: &Path, opts: CpuOptions, comm: Box<dyn Collective>) -> Result<Self> {
        let progress = Arc::new(LoadProgress::new(format!("loading {}", dir.display()), 0));
        Self::load_observed(dir, opts, comm, progress)
    }

    /// [`CpuBackend::load_with`], ticking `progress` (its total is set to the checkpoint's
    /// size once the files are open): a caller can read it from another thread while the
    /// load runs, e.g. for a health or metrics endpoint.
    pub fn load_observed(
        dir: &Path,
        opts: CpuOptions,
        comm: Box<dyn Collective>,
        progress: Arc<LoadProgress>,
    ) -> Result<Self> {
        let cfg = mlaserve_model::load_config(dir)?;
        let mut w = Weights::open(dir, cfg.fp8)?;
        progress.set_total(w.data_bytes());
        w.set_progress(progress.clone());
        let (rank, world) = (comm.rank(), comm.world_size());
        let fp8_act = opts.fp8_act();
        cfg.check_tp(world)?;
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let vocab = Some(Shard::new(0, rank, world));
        let embed = VocabShard::load(&w, names::EMBED, v, h, rank, world)?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|l| Block::load(&w, &cfg, l, rank, world, fp8_act))
            .collect::<Result<Vec<_>>>()?;
        let final_norm = w.f32(names::FINAL_NORM, &[h])?;
        let head_name = if cfg.tie_word_embeddings { names::EMBED } else { names::LM_HEAD };
        let lm_head = load_linear(&w, head_name, [v, h], vocab, fp8_act)?;
        let mut mtp = Vec::with_capacity(cfg.num_nextn_predict_layers);
        for d in 0..cfg.num_nextn_predict_layers {
            let l = cfg.num_hidden_layers + d;
            let n = |s: &str| names::layer(l, s);
            // The layer's own embedding and head, unless absent or the same as the main
            // model's (DeepSeek-V3 ships copies): then it shares the main one.
            let own = |name: String, main: &str| -> Result<Option<String>> {
                Ok(if w.contains(&name) && !w.same_tensor(&name, main)? { Some(name) } else { None })
            };
            let head = match own(n("shared_head.head.weight"), head_name)? {
                Some(name) => Some(load_linear(&w, &name, [v, h], vocab, fp8_act)?),
                None => None,
            };
            let embed = match own(n("embed_tokens.weight"), names::EMBED)? {
                Some(name) => Some(VocabShard::load(&w, &name, v, h, rank, world)?),
                None => None,
            };
            mtp.push(MtpLayer {
                enorm: w.f32(&n("enorm.weight"), &[h])?,
                hnorm: w.f32(&n("hnorm.weight"), &[h])?,
                eh_proj: load_linear(&w, &n("eh_proj.weight"), [h, 2 * h], None, fp8_act)?,
                block: Block::load(&w, &cfg, l, rank, world, fp8_act)?,
                head_norm: w.f32(&n("shared_head.norm.weight"), &[h])?,
                head,
                embed,
            });
        }
        progress.finish();
        let caches = (0..cfg.num_hidden_layers + mtp.len())
            .map(|_| {
                let (lat, lora, kv) = (cfg.latent_dim(), cfg.kv_lora_rank, opts.kv_cache_dtype);
                LayerCache::with_dtype(opts.num_blocks, lat, lora, kv, opts.fp8_bf16_inputs)
            })
            .collect();
        let rope = Rope::new(&cfg.rope_inv_freq(), cfg.rope_attention_factor(), cfg.max_position_embeddings);
        Ok(CpuBackend { cfg, comm, embed, blocks, final_norm, lm_head, mtp, caches, rope, opts })
    }

    /// Per MTP layer: whether it keeps its own embedding and its own head (false: it
    /// shares the main model's, being absent or byte-identical in the checkpoint).
    pub fn mtp_own_tensors(&self) -> Vec<(bool, bool)> {
        self.mtp.iter().map(|m| (m.embed.is_some(), m.head.is_some())).collect()
    }

    /// Switches the MLA form (tests compare the two).
    pub fn set_attn_mode(&mut self, mode: AttnMode) {
        self.opts.attn_mode = mode;
    }

    fn embed_rows(&self, table: &VocabShard, tokens: &[u32]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size;
        let mut x = vec![0f32; tokens.len() * h];
        for (r, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            if t >= table.lo && t < table.lo + table.rows {
                let i = t - table.lo;
                x[r * h..(r + 1) * h].copy_from_slice(&table.w[i * h..(i + 1) * h]);
            }
        }
        self.comm.all_reduce_sum(&mut x)?;
        Ok(x)
    }

    /// Runs `block` over `x` (`[n, hidden]`) in place, with layer cache `cache_idx`.
    fn run_block(&mut self, block_idx: BlockRef, x: &mut [f32], layout: &StepLayout) -> Result<()> {
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps as f32;
        let (block, cache_idx) = match block_idx {
            BlockRef::Target(l) => (&self.blocks[l], l),
            BlockRef::Mtp(d) => (&self.mtp[d].block, self.cfg.num_hidden_layers + d),
        };
        let mut normed = x.to_vec();
        rms_norm(&mut normed, &block.in_norm, eps);
        let mut a = block.attn.forward(&normed, layout, &mut self.caches[cache_idx], &self.rope, self.opts.attn_mode);
        self.comm.all_reduce_sum(&mut a)?;
        for (xi, ai) in x.iter_mut().zip(&a) {
            *xi += ai;
        }
        let mut normed = x.to_vec();
        rms_norm(&mut normed, &block.post_norm, eps);
        let mut f = match &block.ffn {
            Ffn::Dense(m) => m.forward(&normed),
            Ffn::Moe(m) => m.forward(&normed, h),
        };
        self.comm.all_reduce_sum(&mut f)?;
        for (xi, fi) in x.iter_mut().zip(&f) {
            *xi += fi;
        }
        Ok(())
    }

    /// The choices the batch asks for: each argmax and sample row's full logits, edited
    /// (`Batch::edits`), then `mlaserve_core::argmax` or the sampling rule with the row's
    /// parameters, and the log-probabilities of `logprob_rows` of the unedited rows — the
    /// reference the devices' choices are held to (`mlaserve_core::host_choices`).
    fn head_choices(&self, head: &Linear, normed: &[f32], batch: &Batch) -> Result<Choices> {
        let mut rows: Vec<u32> =
            batch.argmax_rows.iter().copied().chain(batch.sample_rows.iter().map(|s| s.row)).collect();
        rows.sort_unstable();
        rows.dedup();
        if rows.is_empty() {
            return Ok(Choices::default());
        }
        let v = self.cfg.vocab_size;
        let logits = self.head_logits(head, normed, &rows)?;
        Ok(mlaserve_core::host_choices(batch, |r, buf| {
            let i = rows.binary_search(&r).expect("a choice row");
            buf.extend_from_slice(&logits[i * v..(i + 1) * v]);
        }))
    }

    /// Vocab-parallel head over the selected rows: local logits, then all-gather.
    fn head_logits(&self, head: &Linear, normed: &[f32], rows: &[u32]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size;
        let sel: Vec<f32> =
            rows.iter().flat_map(|&r| normed[r as usize * h..(r as usize + 1) * h].iter().copied()).collect();
        let local = head.forward(&sel);
        let world = self.comm.world_size();
        if world == 1 {
            return Ok(local);
        }
        let gathered = self.comm.all_gather(&local)?;
        // `gathered` is rank-major `[world, rows, vocab/world]`; reorder to `[rows, vocab]`.
        let (n, part) = (rows.len(), head.out);
        let mut out = vec![0f32; n * part * world];
        for rk in 0..world {
            for r in 0..n {
                let src = &gathered[(rk * n + r) * part..][..part];
                out[r * part * world + rk * part..][..part].copy_from_slice(src);
            }
        }
        Ok(out)
    }
}

#[derive(Debug, Clone, Copy)]
enum BlockRef {
    Target(usize),
    Mtp(usize),
}

fn layout(batch: &Batch) -> StepLayout<'_> {
    let mut rows = Vec::with_capacity(batch.num_tokens());
    for (s, c) in batch.seqs.iter().enumerate() {
        rows.extend((0..c.tokens.len()).map(|i| (s, c.start_pos + i)));
    }
    StepLayout { rows, tables: batch.seqs.iter().map(|c| c.block_table.as_slice()).collect() }
}

impl Backend for CpuBackend {
    type Hidden = CpuHidden;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn num_blocks(&self) -> usize {
        self.opts.num_blocks
    }

    fn forward(&mut self, batch: &Batch) -> Result<ForwardOutput<CpuHidden>> {
        batch.validate(self.cfg.vocab_size, self.opts.num_blocks, self.cfg.max_position_embeddings)?;
        batch.validate_kept(false)?;
        let tokens: Vec<u32> = batch.seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let mut x = self.embed_rows(&self.embed, &tokens)?;
        let lay = layout(batch);
        for l in 0..self.blocks.len() {
            self.run_block(BlockRef::Target(l), &mut x, &lay)?;
        }
        rms_norm(&mut x, &self.final_norm, self.cfg.rms_norm_eps as f32);
        let logits = self.head_logits(&self.lm_head, &x, &batch.logit_rows)?;
        let c = self.head_choices(&self.lm_head, &x, batch)?;
        let hidden = CpuHidden { rows: tokens.len(), data: x };
        Ok(ForwardOutput { hidden, logits, argmax: c.argmax, sampled: c.sampled, logprobs: c.logprobs })
    }

    fn mtp_forward(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &CpuHidden,
        hidden_rows: &[u32],
    ) -> Result<ForwardOutput<CpuHidden>> {
        batch.validate(self.cfg.vocab_size, self.opts.num_blocks, self.cfg.max_position_embeddings)?;
        batch.validate_kept(false)?;
        if layer >= self.mtp.len() {
            return Err(Error::Batch(format!("MTP layer {layer} requested; the model has {}", self.mtp.len())));
        }
        let n = batch.num_tokens();
        if hidden_rows.len() != n {
            return Err(Error::Batch(format!("{} hidden rows for {n} tokens", hidden_rows.len())));
        }
        if let Some(&r) = hidden_rows.iter().find(|&&r| r as usize >= prev.rows) {
            return Err(Error::Batch(format!("hidden row {r} >= {} rows", prev.rows)));
        }
        let h = self.cfg.hidden_size;
        let eps = self.cfg.rms_norm_eps as f32;
        let tokens: Vec<u32> = batch.seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let lay = layout(batch);
        let m = &self.mtp[layer];
        let mut e = self.embed_rows(m.embed.as_ref().unwrap_or(&self.embed), &tokens)?;
        // vLLM's convention: the embedding input is zero at position 0.
        for (r, &(_, pos)) in lay.rows.iter().enumerate() {
            if pos == 0 {
                e[r * h..(r + 1) * h].fill(0.0);
            }
        }
        rms_norm(&mut e, &m.enorm, eps);
        let mut hid: Vec<f32> =
            hidden_rows.iter().flat_map(|&r| prev.data[r as usize * h..(r as usize + 1) * h].iter().copied()).collect();
        rms_norm(&mut hid, &m.hnorm, eps);
        let mut cat = Vec::with_capacity(n * 2 * h);
        for r in 0..n {
            cat.extend_from_slice(&e[r * h..(r + 1) * h]);
            cat.extend_from_slice(&hid[r * h..(r + 1) * h]);
        }
        let mut x = m.eh_proj.forward(&cat);
        self.run_block(BlockRef::Mtp(layer), &mut x, &lay)?;
        let m = &self.mtp[layer];
        let mut normed = x.clone();
        rms_norm(&mut normed, &m.head_norm, eps);
        let head = m.head.as_ref().unwrap_or(&self.lm_head);
        let logits = self.head_logits(head, &normed, &batch.logit_rows)?;
        let c = self.head_choices(head, &normed, batch)?;
        let hidden = CpuHidden { rows: n, data: x };
        Ok(ForwardOutput { hidden, logits, argmax: c.argmax, sampled: c.sampled, logprobs: c.logprobs })
    }

    fn hidden_to_host(&self, h: &CpuHidden) -> Result<Vec<f32>> {
        Ok(h.data.clone())
    }

    fn concat_hidden(&mut self, parts: &[(&CpuHidden, &[u32])]) -> Result<CpuHidden> {
        let h = self.cfg.hidden_size;
        let rows: usize = parts.iter().map(|(_, r)| r.len()).sum();
        let mut data = Vec::with_capacity(rows * h);
        for (src, sel) in parts {
            for &r in *sel {
                let r = r as usize;
                if r >= src.rows {
                    return Err(Error::Batch(format!("hidden row {r} >= {} rows", src.rows)));
                }
                data.extend_from_slice(&src.data[r * h..(r + 1) * h]);
            }
        }
        Ok(CpuHidden { rows, data })
    }
}
