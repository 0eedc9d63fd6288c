//! [`CudaBackend`]: `mlaserve_core::Backend` on one GPU (one tensor-parallel rank).
//!
//! The math mirrors mlaserve-cpu exactly (RoPE on interleaved pairs with the YaRN
//! attention factor, q_a/kv_a norms with eps 1e-6, every routing variant, MTP with the
//! embedding zeroed at position 0, vocabulary-parallel heads); the numbers differ by bf16
//! rounding: weights and the latent cache are bf16, GEMM inputs are rounded to bf16,
//! the residual stream and every reduction stay f32.
//!
//! A step: the host lays out per-row metadata (positions, cache slots, block tables) and
//! uploads it once; embedding, then per layer RMSNorm → MLA (projections on cuBLAS,
//! latent write, attention split by kind in `route.rs` — decode windows of ≤ 4 tokens
//! absorbed: the FlashMLA-style decode kernel when those windows all have one length, the
//! varlen kernel otherwise; longer chunks expanded: K and V up-projected from the gathered
//! latents, flash attention on tensor cores, `crate::prefill`) → residual →
//! RMSNorm → dense MLP or MoE (routing on the device, experts as per-expert GEMMs over
//! gathered rows) → residual; final norm; the head over the requested rows only: logits
//! to the host for `logit_rows`, and for `argmax_rows` and `sample_rows` only the chosen
//! ids (the argmax and the sampling rule run on the device over the full rows).
//!
//! Tensor parallelism (docs/architecture.md): with a [`TpInit`] the backend joins its group's NCCL
//! communicator on its own stream and loads only its shards through
//! `Weights::f32_shard` (heads, the MLPs' intermediate widths, the vocabulary). A layer
//! all-reduces twice (after `o_proj`, after the FFN) and the vocabulary-parallel
//! embedding once, on the device; the head's logits are all-gathered. The router runs
//! replicated on the identical reduced residual, so every rank routes alike. In
//! batch-invariant mode the all-reduce is the deterministic one (all-gather + sum in rank
//! order) so a token's sum never depends on its batch. Every wait for the stream is
//! bounded ([`DeviceComm::wait`]): a dead peer fails the step instead of hanging it.

mod drafts;
mod graphs;
mod head;
mod layer;
mod load;
mod memory;
mod options;
mod proj;
mod route;
mod synthetic;
mod weights;

use std::path::Path;
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use mlaserve_core::{Backend, Batch, Error, ForwardOutput, KvCacheDtype, ModelConfig, BLOCK_SIZE};
use mlaserve_model::progress::LoadProgress;

use crate::comm::{DeviceComm, TpInit};
use crate::elementwise::{Argmax, SiluMul};
use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::layout::AttnMeta;
use crate::layout::StepLayout;
use crate::linear::{Gemm, Linear};
use crate::logit_ops::{DeviceEdits, LogitOps};
use crate::ops::Ops;
use crate::prefill::MlaPrefill;
use crate::rope::RopeTables;
use crate::sample::Sampler;
use crate::{MlaDecode, MlaKernel};
use weights::{Block, Embed, Mtp};

pub use graphs::GraphStats;
pub use options::{CaptureMode, CudaOptions, INVARIANT_SPLIT_BLOCKS, PEER_ALL_REDUCE_BYTES, PEER_LINES_BYTES};
pub use route::{PrefillPath, ABSORBED_MAX_ROWS};
pub use synthetic::WeightFill;

/// Hidden states of a step, `rows × hidden_size` f32, on the device.
#[derive(Debug)]
pub struct CudaHidden {
    pub rows: usize,
    pub data: CudaSlice<f32>,
}

/// Weight bytes by what a decode step reads (see [`CudaBackend::weight_bytes`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct WeightBytes {
    /// Target layers' weights read whole every forward (attention, dense MLPs, shared
    /// experts, router).
    pub target_dense: u64,
    /// The same for the MTP layers.
    pub mtp_dense: u64,
    /// `lm_head` (each MTP layer's head is as large).
    pub head: u64,
    /// One routed expert's MLP.
    pub expert: u64,
    pub experts_per_layer: u64,
    pub top_k: u64,
    /// Target MoE layers.
    pub moe_layers: u64,
    pub mtp_moe: bool,
}

/// Which stack a block belongs to (its cache index differs).
#[derive(Debug, Clone, Copy)]
enum BlockRef {
    Target(usize),
    Mtp(usize),
}

/// The GPU backend (one rank).
#[derive(Debug)]
pub struct CudaBackend {
    cfg: ModelConfig,
    gpu: Gpu,
    ops: Ops,
    gemm: Gemm,
    silu: SiluMul,
    argmax: Argmax,
    sampler: Sampler,
    logit_ops: LogitOps,
    mla: MlaDecode,
    prefill: MlaPrefill,
    embed: Embed,
    blocks: Vec<Block>,
    final_norm: CudaSlice<f32>,
    lm_head: Linear,
    mtp: Vec<Mtp>,
    /// Target layers first, then one per MTP layer: `[num_blocks][64][latent]` bf16,
    /// zeroed (stale entries are finite).
    caches: Vec<CudaSlice<half::bf16>>,
    rope: RopeTables,
    opts: CudaOptions,
    /// The group's communicator (none for a single rank).
    comm: Option<DeviceComm>,
    /// Phase timings when profiling ([`CudaBackend::set_profile`]).
    prof: Option<std::cell::RefCell<Profile>>,
    /// The decode steps' CUDA graphs and their persistent buffers.
    graphs: graphs::Graphs,
    /// How the device's memory was split, when the cache was sized from it.
    memory: Option<mlaserve_core::memory::MemoryPlan>,
    /// The fp8 GEMMs, when any projection is kept in fp8.
    fp8: Option<proj::Fp8Kernels>,
    /// The draft slots of [`CudaOptions::keep_drafts`] (`drafts.rs`), from the first
    /// pass that kept drafts.
    draft_slots: Option<CudaSlice<i32>>,
}

impl Drop for CudaBackend {
    /// The graphs go before the communicator (the fields' order would drop it first):
    /// NCCL's `ncclCommAbort` waits until every graph that captured its collectives is
    /// destroyed, so the other order never returns (measured: a TP-2 group with graphs
    /// hung at its end).
    fn drop(&mut self) {
        if self.comm.is_some() && !self.graphs.is_empty() {
            // No graph in flight when destroyed, and the context idle after, so that
            // CUDA has released the graphs' hold on NCCL's plans before the abort. The
            // wait is bounded: with a peer gone it fails and aborts the communicator.
            let settled = self.settle("shutdown").is_ok();
            self.graphs.clear();
            if settled {
                let _ = self.gpu.ctx.synchronize();
            }
        }
        self.comm = None;
    }
}

/// Joins the group's communicator (TP only), with the one-shot all-reduce over peer
/// memory where [`CudaOptions::peer_all_reduce`] asks for it and the GPUs allow it.
fn join_comm(gpu: &Gpu, tp: Option<&TpInit>, opts: &CudaOptions) -> Result<Option<DeviceComm>> {
    let Some(t) = tp else { return Ok(None) };
    let mut comm = DeviceComm::new(&gpu.stream, t)?;
    if let Some(max_bytes) = opts.peer_all_reduce {
        if !comm.enable_peer_reduce(gpu, max_bytes, opts.peer_lines_bytes)? {
            tracing::warn!(rank = t.rank, "peer all-reduce asked for, but not every GPU reaches the others: NCCL only");
        }
    }
    Ok(Some(comm))
}

/// What a constructor starts before the weights, for [`CudaBackend::assemble`]: the
/// device's free memory then, and the RoPE tables computing on the host meanwhile.
struct Early {
    free_at_start: usize,
    rope: crate::rope::PendingRope,
}

/// Wall time per phase of the forward passes since profiling was switched on; each mark
/// waits for the stream, so a profiled step is slower than an unprofiled one.
#[derive(Debug)]
struct Profile {
    last: std::time::Instant,
    phases: Vec<(&'static str, f64)>,
}

/// A step's row metadata, on the device (and what the host knows of it).
#[derive(Debug)]
pub(crate) struct Step {
    pub n: usize,
    pub tokens: CudaSlice<i32>,
    pub pos: CudaSlice<i32>,
    pub slot: CudaSlice<i64>,
    pub row_seq: CudaSlice<i32>,
    pub tables: CudaSlice<i32>,
    pub seq_lens: CudaSlice<i32>,
    pub meta: AttnMeta,
    /// `Some(q_len)` when every chunk has that many tokens (decode windows).
    pub uniform: Option<usize>,
    /// Which rows take the absorbed and the expanded form of MLA, uploaded with the rest
    /// (see [`HeadRows`] for why everything is uploaded first).
    pub route: route::Route,
    /// The decode kernel's split count when it is fixed (a step captured into a CUDA
    /// graph); `None`: planned from the step's longest context.
    pub splits: Option<usize>,
    /// Each sequence's (new tokens, seq_len) on the host (empty in graph steps).
    pub chunks: Vec<(usize, usize)>,
}

/// The rows the head serves, on the device. Uploaded before the step's first collective,
/// like all of a step's metadata: an upload from pageable host memory synchronizes the
/// stream, so none may follow a collective inside a step (a stalled peer would block it
/// beyond any deadline).
#[derive(Debug)]
pub(crate) struct HeadRows {
    /// `Batch::logit_rows`.
    pub logit_rows: CudaSlice<i32>,
    /// `Batch::argmax_rows`.
    pub argmax_rows: CudaSlice<i32>,
    /// `Batch::sample_rows`: their rows and their parameters ([`Sampler::params`]).
    pub sample_rows: CudaSlice<i32>,
    pub sample_params: CudaSlice<f64>,
    /// The logit edits of the argmax rows and of the sample rows.
    pub argmax_edits: DeviceEdits,
    pub sample_edits: DeviceEdits,
    /// (temperature, min_p) of each sample row, when one has a min-p cut.
    pub min_p: Option<CudaSlice<f64>>,
}

impl CudaBackend {
    /// Loads the checkpoint in `dir` onto GPU `ordinal` with `num_blocks` cache blocks.
    pub fn load(dir: &Path, num_blocks: usize, ordinal: usize) -> Result<Self> {
        Self::load_with(dir, CudaOptions::new(num_blocks, ordinal))
    }

    pub fn load_with(dir: &Path, opts: CudaOptions) -> Result<Self> {
        Self::load_tp(dir, opts, None)
    }

    /// Loads rank `tp.rank`'s shards of the checkpoint in `dir` and joins the group's
    /// communicator (a single rank without `tp`).
    pub fn load_tp(dir: &Path, opts: CudaOptions, tp: Option<&TpInit>) -> Result<Self> {
        Self::load_tp_observed(dir, opts, tp, Arc::new(LoadProgress::new(format!("loading {}", dir.display()), 0)))
    }

    /// [`CudaBackend::load_with`], ticking `progress` (its total set to the checkpoint's
    /// size once the files are open), which another thread may read while it loads.
    pub fn load_observed(dir: &Path, opts: CudaOptions, progress: Arc<LoadProgress>) -> Result<Self> {
        Self::load_tp_observed(dir, opts, None, progress)
    }

    /// A model of configuration `cfg` with synthetic weights whose values `fill` writes on
    /// the device (benchmarks at real dimensions; no checkpoint needed), as one rank of a
    /// tensor-parallel group with `tp`: this rank's shapes (its heads, intermediate and
    /// vocabulary slices).
    pub fn synthetic(cfg: ModelConfig, opts: CudaOptions, fill: &dyn WeightFill, tp: Option<&TpInit>) -> Result<Self> {
        let (rank, world) = tp.map_or((0, 1), |t| (t.rank, t.world));
        Self::synthetic_in(cfg, opts, fill, tp, rank, world)
    }

    /// As [`CudaBackend::synthetic`], rank `rank`'s shard of a `world`-way group run
    /// alone on one GPU (no communicator: its all-reduces are skipped), for measuring one
    /// rank's weights, memory and kernels where the group's GPUs are not all at hand.
    pub fn synthetic_shard(
        cfg: ModelConfig,
        opts: CudaOptions,
        fill: &dyn WeightFill,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        Self::synthetic_in(cfg, opts, fill, None, rank, world)
    }

    fn synthetic_in(
        cfg: ModelConfig,
        opts: CudaOptions,
        fill: &dyn WeightFill,
        tp: Option<&TpInit>,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        cfg.check_tp(world).map_err(|e| CudaError::Shape { kernel: "synthetic", msg: e.to_string() })?;
        let rope = crate::rope::PendingRope::start(&cfg);
        let gpu = Gpu::new(opts.ordinal)?;
        let (free_at_start, _) = gpu.free_memory()?;
        let comm = join_comm(&gpu, tp, &opts)?;
        let fp8 = if opts.synthetic_fp8 { proj::Fp8Kernels::new(&gpu, &opts) } else { None };
        if opts.synthetic_fp8 && fp8.is_none() {
            return Err(CudaError::shape("synthetic", "fp8 weights asked for, but the fp8 kernels do not load here"));
        }
        let parts = synthetic::Synth { gpu: &gpu, fill, rank, world, fp8: fp8.as_ref() }.model(&cfg)?;
        Self::assemble(cfg, gpu, parts, fp8, opts, comm, Early { free_at_start, rope })
    }

    #[allow(clippy::type_complexity)]
    fn assemble(
        cfg: ModelConfig,
        gpu: Gpu,
        parts: (Embed, Vec<Block>, CudaSlice<f32>, Linear, Vec<Mtp>),
        fp8: Option<proj::Fp8Kernels>,
        opts: CudaOptions,
        comm: Option<DeviceComm>,
        early: Early,
    ) -> Result<Self> {
        let Early { free_at_start, rope } = early;
        let (embed, blocks, final_norm, lm_head, mtp) = parts;
        let (free_after_weights, total) = gpu.free_memory()?;
        let mem = memory::LoadMemory { total, free_at_start, free_after_weights };
        // Planning: a temporary cache just large enough for the profiling step.
        let longest = cfg.max_position_embeddings.max(1);
        let profile = opts.gpu_memory_utilization.map(|_| crate::profile::profile_batch(opts.profile_tokens, longest));
        let mut opts = opts;
        if let Some((_, blocks)) = &profile {
            opts.num_blocks = *blocks;
        }
        let kv_fp8 = opts.kv_cache_dtype == KvCacheDtype::Fp8;
        let entry = crate::layout::kv_entry_elems(kv_fp8, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
            .map_err(|e| CudaError::shape("kv cache", e))?;
        let caches = (0..blocks.len() + mtp.len())
            .map(|_| gpu.stream.alloc_zeros::<half::bf16>(opts.num_blocks * BLOCK_SIZE * entry))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        let rope = rope.upload(&gpu.stream)?;
        let mut ops = Ops::new(&gpu, opts.linear_tc)?;
        ops.set_kv_cache_dtype(opts.kv_cache_dtype);
        let gemm = Gemm::new(&gpu, opts.gemm, opts.linear_tc)?;
        let silu = SiluMul::new(&gpu)?;
        let argmax = Argmax::new(&gpu)?;
        let sampler = Sampler::new(&gpu)?;
        let logit_ops = LogitOps::new(&gpu)?;
        let mut mla = MlaDecode::new(&gpu)?;
        mla.set_kernel(MlaKernel::Auto)?;
        let fast = MlaDecode::is_fast_path(&crate::dims::DecodeDims {
            batch: 1,
            heads: 1,
            q_len: 1,
            dlat: cfg.kv_lora_rank,
            drope: cfg.qk_rope_head_dim,
            bt_stride: 1,
        });
        if kv_fp8 && fast {
            // Other widths read the fp8 cache on the varlen kernel only (layer.rs).
            mla.set_kv_cache_dtype(opts.kv_cache_dtype)?;
        }
        if opts.decode_kernel {
            if let Err(e) = mla.set_fixed_splits(opts.decode_split_blocks) {
                // Fixed splits need the seesaw kernel: without it, the varlen kernel keeps
                // decode batch-invariant.
                tracing::warn!("decode kernel off: {e}");
                opts.decode_kernel = false;
            }
        }
        let prefill = MlaPrefill::new(&gpu, opts.prefill_kernel)?;
        gpu.sync()?;
        let utilization = opts.gpu_memory_utilization;
        let mut backend = CudaBackend {
            cfg,
            gpu,
            ops,
            gemm,
            silu,
            argmax,
            sampler,
            logit_ops,
            mla,
            prefill,
            embed,
            blocks,
            final_norm,
            lm_head,
            mtp,
            caches,
            rope,
            opts,
            comm,
            prof: None,
            graphs: graphs::Graphs::default(),
            fp8,
            memory: None,
            draft_slots: None,
        };
        if let (Some(u), Some((batch, _))) = (utilization, profile) {
            backend.plan_memory(u, mem, batch)?;
        }
        Ok(backend)
    }

    /// Fills every layer's latent cache with `fill`'s values in [-1, 1) (benchmarks: a
    /// context without a prefill).
    pub fn fill_caches(&mut self, fill: &dyn WeightFill) -> Result<()> {
        let (lora, rope) = (self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim);
        for (i, c) in self.caches.iter_mut().enumerate() {
            if self.opts.kv_cache_dtype == KvCacheDtype::Fp8 {
                self.ops.fill_kv_fp8(&self.gpu.stream, c, lora, rope, 0x5eed + i as u32)?;
            } else {
                fill.fill_bf16(&self.gpu, c, 1.0)?;
            }
        }
        self.gpu.sync()
    }

    /// Uploads host hidden rows (`rows × hidden_size`), e.g. another backend's, so a
    /// stage can be checked on exactly the reference's inputs.
    pub fn hidden_from_host(&self, data: &[f32]) -> Result<CudaHidden> {
        let h = self.cfg.hidden_size;
        if data.is_empty() || !data.len().is_multiple_of(h) {
            return Err(CudaError::shape("hidden_from_host", format!("{} values are not rows of {h}", data.len())));
        }
        Ok(CudaHidden { rows: data.len() / h, data: self.gpu.stream.clone_htod(data)? })
    }

    /// The GPU this backend runs on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Switches phase profiling on (off: `false`) and returns what was recorded so far:
    /// seconds per phase (embedding, attention, all-reduces, dense MLP, MoE routing, MoE
    /// experts, head...), summed over the forward passes since it was switched on.
    pub fn set_profile(&mut self, on: bool) -> Vec<(&'static str, f64)> {
        let was = self.prof.take().map(|p| p.into_inner().phases).unwrap_or_default();
        if on {
            self.prof = Some(std::cell::RefCell::new(Profile { last: std::time::Instant::now(), phases: Vec::new() }));
        }
        was
    }

    /// Ends phase `what` when profiling: waits for the stream, adds the time since the last
    /// mark to the phase.
    pub(crate) fn mark(&self, what: &'static str) -> Result<()> {
        let Some(p) = &self.prof else { return Ok(()) };
        self.settle(what)?;
        self.gpu.sync()?;
        let mut p = p.borrow_mut();
        let dt = p.last.elapsed().as_secs_f64();
        p.last = std::time::Instant::now();
        match p.phases.iter_mut().find(|(n, _)| *n == what) {
            Some((_, t)) => *t += dt,
            None => p.phases.push((what, dt)),
        }
        Ok(())
    }

    /// The group's communicator (`None` for a single rank).
    pub fn comm(&self) -> Option<&DeviceComm> {
        self.comm.as_ref()
    }

    /// Sums `buf` (`[rows][h]` partial results of this rank's shard) across the group, on
    /// the stream; nothing for a single rank.
    pub fn all_reduce(&self, buf: &mut CudaSlice<f32>) -> Result<()> {
        match &self.comm {
            None => Ok(()),
            Some(c) if self.opts.ordered_all_reduce => c.all_reduce_ordered(&self.ops, buf),
            Some(c) => c.all_reduce(buf),
        }
    }

    /// Whether every collective of a call over `rows` rows takes the one-shot kernels
    /// over peer memory (true without a group): its messages, `rows` padded to a graph
    /// bucket (less than twice `rows`) times the hidden width, fit their slots.
    fn bounded_collectives(&self, rows: usize) -> bool {
        self.comm.as_ref().is_none_or(|c| c.peer_reduce_cap().is_some_and(|cap| 2 * rows * self.cfg.hidden_size <= cap))
    }

    /// Waits for the stream: bounded by the collective timeout in a group (a dead peer
    /// fails the wait), a plain synchronize for a single rank. Call before every copy
    /// to the host.
    pub(crate) fn settle(&self, what: &str) -> Result<()> {
        match &self.comm {
            Some(c) => c.wait(what),
            None => Ok(()),
        }
    }

    /// Builds and uploads the step's row metadata.
    fn step(&self, batch: &Batch) -> Result<Step> {
        let s = &self.gpu.stream;
        let l = StepLayout::new(batch, None);
        let up = |v: &[i32]| s.clone_htod(if v.is_empty() { &[0][..] } else { v });
        Ok(Step {
            n: l.meta.n,
            tokens: up(&l.tokens)?,
            pos: up(&l.pos)?,
            slot: s.clone_htod(if l.slot.is_empty() { &[0i64][..] } else { &l.slot })?,
            row_seq: up(&l.row_seq)?,
            tables: up(&l.tables)?,
            seq_lens: up(&l.seq_lens)?,
            meta: l.meta,
            uniform: l.uniform,
            route: self.route(batch, l.meta.bt_stride, l.meta.max_block)?,
            splits: None,
            chunks: batch.seqs.iter().map(|c| (c.tokens.len(), c.start_pos + c.tokens.len())).collect(),
        })
    }

    fn validate(&self, batch: &Batch) -> mlaserve_core::Result<()> {
        batch.validate(self.cfg.vocab_size, self.opts.num_blocks, self.cfg.max_position_embeddings)
    }

    fn forward_impl(&mut self, batch: &Batch) -> Result<ForwardOutput<CudaHidden>> {
        self.mark("idle (between calls)")?;
        let s = self.gpu.stream.clone();
        let (h, n) = (self.cfg.hidden_size, batch.num_tokens());
        let rows = self.head_rows_upload(batch)?;
        let normed = match self.graph_key(batch, graphs::Stage::Target) {
            Some(key) => self.graph_step(key, batch, None)?.normed,
            None => {
                let st = self.step(batch)?;
                self.mark("step metadata upload")?;
                let mut x = s.alloc_zeros::<f32>(n * h)?;
                let mut normed = s.alloc_zeros::<f32>(n * h)?;
                self.target_body(&st, &mut x, &mut normed)?;
                normed
            }
        };
        let o = self.head_outputs(&self.lm_head, &normed, &rows, batch, "forward", false)?;
        let hidden = CudaHidden { rows: n, data: normed };
        Ok(ForwardOutput { hidden, logits: o.logits, argmax: o.argmax, sampled: o.sampled, logprobs: o.logprobs })
    }

    /// The target model over a step's rows (the part of a forward a CUDA graph holds):
    /// embedding, every block, the final norm into `normed`; `x` (`[n][h]`) is the
    /// residual stream. Launches only (no host wait, no upload, no allocation that
    /// outlives it), so it can be captured.
    pub(crate) fn target_body(&mut self, st: &Step, x: &mut CudaSlice<f32>, normed: &mut CudaSlice<f32>) -> Result<()> {
        let s = self.gpu.stream.clone();
        let (h, n) = (self.cfg.hidden_size, st.n);
        s.memset_zeros(x)?;
        let e = &self.embed;
        self.ops.embed(&s, x, &e.w, &st.tokens, &st.pos, h, e.lo, e.rows, false)?;
        self.all_reduce(x)?;
        self.mark("embedding")?;
        for l in 0..self.blocks.len() {
            self.run_block(BlockRef::Target(l), x, st)?;
        }
        let eps = self.cfg.rms_norm_eps as f32;
        self.ops.rmsnorm(&s, normed, h, x, h, &self.final_norm, n, eps)?;
        self.mark("final norm")
    }

    fn concat_impl(&self, parts: &[(&CudaHidden, &[u32])]) -> Result<CudaHidden> {
        let s = &self.gpu.stream;
        let h = self.cfg.hidden_size;
        let rows: usize = parts.iter().map(|(_, r)| r.len()).sum();
        let mut data = s.alloc_zeros::<f32>(rows.max(1) * h)?;
        let mut at = 0;
        for (src, sel) in parts {
            if let Some(&r) = sel.iter().find(|&&r| r as usize >= src.rows) {
                return Err(CudaError::shape("concat_hidden", format!("hidden row {r} >= {} rows", src.rows)));
            }
            if sel.is_empty() {
                continue;
            }
            let idx = s.clone_htod(&sel.iter().map(|&r| r as i32).collect::<Vec<_>>())?;
            self.ops.gather(s, &mut data.slice_mut(at * h..(at + sel.len()) * h), &src.data, &idx, sel, h)?;
            at += sel.len();
        }
        Ok(CudaHidden { rows, data })
    }

    fn mtp_impl(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &CudaHidden,
        hidden_rows: &[u32],
    ) -> Result<ForwardOutput<CudaHidden>> {
        self.mark("idle (between calls)")?;
        let s = self.gpu.stream.clone();
        let (h, n) = (self.cfg.hidden_size, batch.num_tokens());
        let rows = self.head_rows_upload(batch)?;
        // Uploaded before the first collective (see `HeadRows`).
        let rows_d = s.clone_htod(&hidden_rows.iter().map(|&r| r as i32).collect::<Vec<_>>())?;
        let (x, normed) = match self.graph_key(batch, graphs::Stage::Mtp(layer)) {
            Some(key) => {
                let out = self.graph_step(key, batch, Some((&prev.data, &rows_d, hidden_rows)))?;
                (out.x.expect("an MTP graph returns its hidden state"), out.normed)
            }
            None => {
                let mut st = self.step(batch)?;
                drafts::link_tokens(&self.ops, &s, self.draft_slots.as_ref(), &mut st.tokens, &batch.draft_links)?;
                self.mark("step metadata upload")?;
                let mut hid = s.alloc_zeros::<f32>(n * h)?;
                self.ops.gather(&s, &mut hid, &prev.data, &rows_d, hidden_rows, h)?;
                let mut x = s.alloc_zeros::<f32>(n * h)?;
                let mut normed = s.alloc_zeros::<f32>(n * h)?;
                self.mtp_body(layer, &st, &hid, &mut x, &mut normed)?;
                (x, normed)
            }
        };
        let head = self.mtp[layer].head.as_ref().unwrap_or(&self.lm_head);
        let o = self.head_outputs(head, &normed, &rows, batch, "MTP forward", self.bounded_collectives(n))?;
        if let Some(ids) = &o.kept_ids {
            self.store_drafts(ids, batch)?;
        }
        let hidden = CudaHidden { rows: n, data: x };
        Ok(ForwardOutput { hidden, logits: o.logits, argmax: o.argmax, sampled: o.sampled, logprobs: o.logprobs })
    }

    /// MTP layer `layer` over a step's rows, `hid` (`[n][h]`) holding each row's previous
    /// hidden state: the embedding (zero at position 0), the two norms, `eh_proj`, the
    /// block, the head norm into `normed`; `x` gets the layer's output (the next stage's
    /// hidden state). Capturable, as [`Self::target_body`].
    pub(crate) fn mtp_body(
        &mut self,
        layer: usize,
        st: &Step,
        hid: &CudaSlice<f32>,
        x: &mut CudaSlice<f32>,
        normed: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let s = self.gpu.stream.clone();
        let (h, n) = (self.cfg.hidden_size, st.n);
        let eps = self.cfg.rms_norm_eps as f32;
        let m = &self.mtp[layer];
        let table = m.embed.as_ref().unwrap_or(&self.embed);
        let mut e = s.alloc_zeros::<f32>(n * h)?;
        // vLLM's convention: the embedding input is zero at position 0.
        self.ops.embed(&s, &mut e, &table.w, &st.tokens, &st.pos, h, table.lo, table.rows, true)?;
        self.all_reduce(&mut e)?;
        // cat[r] = [enorm(e_r), hnorm(h_r)]: embedding first (as vLLM and SGLang feed DeepSeek's MTP layer).
        let mut cat = s.alloc_zeros::<half::bf16>(n * 2 * h)?;
        self.ops.rmsnorm(&s, &mut cat, 2 * h, &e, h, &m.enorm, n, eps)?;
        self.ops.rmsnorm(&s, &mut cat.slice_mut(h..), 2 * h, hid, h, &m.hnorm, n, eps)?;
        self.proj(&m.eh_proj, &cat, n, x)?;
        self.mark("MTP input (embedding, norms, eh_proj)")?;
        self.run_block(BlockRef::Mtp(layer), x, st)?;
        let m = &self.mtp[layer];
        self.ops.rmsnorm(&s, normed, h, x, h, &m.head_norm, n, eps)
    }
}

impl Backend for CudaBackend {
    type Hidden = CudaHidden;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn graph_captures(&self) -> u64 {
        self.graphs.captures()
    }

    fn graph_batch_sizes(&self) -> Vec<usize> {
        if !self.opts.graphs {
            return Vec::new();
        }
        let mut sizes: Vec<usize> = (1..=crate::layout::MAX_GRAPH_SEQS).filter_map(crate::layout::seq_bucket).collect();
        sizes.dedup();
        sizes
    }

    fn num_blocks(&self) -> usize {
        self.opts.num_blocks
    }

    fn memory_plan(&self) -> Option<mlaserve_core::memory::MemoryPlan> {
        self.memory
    }

    fn forward(&mut self, batch: &Batch) -> mlaserve_core::Result<ForwardOutput<CudaHidden>> {
        self.validate(batch)?;
        batch.validate_kept(false)?;
        Ok(self.forward_impl(batch)?)
    }

    fn mtp_forward(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &CudaHidden,
        hidden_rows: &[u32],
    ) -> mlaserve_core::Result<ForwardOutput<CudaHidden>> {
        self.validate(batch)?;
        batch.validate_kept(self.keeps_drafts_here())?;
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
        Ok(self.mtp_impl(layer, batch, prev, hidden_rows)?)
    }

    fn concat_hidden(&mut self, parts: &[(&CudaHidden, &[u32])]) -> mlaserve_core::Result<CudaHidden> {
        Ok(self.concat_impl(parts)?)
    }

    fn keeps_drafts(&self) -> bool {
        self.keeps_drafts_here()
    }

    fn read_drafts(&mut self, n: usize) -> mlaserve_core::Result<Vec<u32>> {
        Ok(self.read_drafts_impl(n)?)
    }

    fn hidden_to_host(&self, h: &CudaHidden) -> mlaserve_core::Result<Vec<f32>> {
        self.settle("hidden_to_host")?;
        let v = self.gpu.stream.clone_dtoh(&h.data).map_err(CudaError::from)?;
        self.gpu.sync()?;
        Ok(v)
    }
}
