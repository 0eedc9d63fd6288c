//! CUDA graphs for decode steps, one per batch-size bucket and window length (the
//! "CUDA graph" decode of vLLM and SGLang).
//!
//! A decode step of a real model launches hundreds of kernels (DeepSeek-V3: about 70 per
//! layer); at small batches, and more so with tensor parallelism, the host's launch time
//! rivals the GPU's work. A step whose sequences all bring the same number of tokens, 1
//! to 4 (decode windows), runs instead as one graph launch:
//! - The batch is padded to a bucket of sequences (`layout::seq_bucket`: 1, 2, 4, 8,
//!   then multiples of 8 up to 256) and its block tables to a power-of-two width
//!   (`layout::table_bucket`). Padding sequences have no context and write no latent
//!   (slot -1), so they change nothing real.
//! - Each (stage, bucket, window length, table width, decode split count) is captured
//!   once, on first use, from the very code the eager path runs (`target_body`,
//!   `mtp_body`); its intermediates are graph-owned allocations.
//! - A backend holds at most `CudaOptions::max_graphs` (512). At the cap a new shape
//!   replaces the least recently used graph if that one has gone unused for
//!   `layout::GRAPH_IDLE_STEPS` graph steps (a start-up warm-up's shapes give way to
//!   the longer contexts met later), else it runs eagerly (no capture every step when
//!   more shapes than that are in use at once).
//! - Its inputs live in persistent buffers ([`GraphIo`], sized for the largest bucket)
//!   that each replay refills from the host before the launch; its outputs are copied
//!   out after, so a returned hidden state never aliases a later step's.
//! - The head (logits, argmax, sampling) stays eager: the rows it serves change every
//!   step, and it is a few launches.
//!
//! Eager, always: profiling (its marks wait for the stream), the CUDA-core batch-invariant
//! mode (no decode kernel), models whose MoE sorts on the host (a mid-step wait), steps
//! with prefill chunks or mixed window lengths, shapes past the buckets, and the varlen
//! attention (latent widths without the tensor-core kernel, in the batch-invariant mode
//! or with an fp8 cache) over tables past 48 KiB of its shared memory. A capture that
//! fails is logged and not retried for its key; that step runs eagerly (on a
//! tensor-parallel rank it fails the step instead: its peers would run the step's
//! collectives without it).
//!
//! Tensor-parallel ranks capture their NCCL collectives in the graphs (NCCL's persistent
//! plans). Every rank takes the same keys in the same order (the same batches), a new
//! graph is launched right after its capture so that the captured collectives run before
//! the communicator's next eager one, and the graphs are destroyed before the
//! communicator: NCCL's abort waits for every graph that captured it.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice, CudaStream, DevicePtr};
use mlaserve_core::{Batch, BLOCK_SIZE};

use super::layer::GROUPED_MAX_EXPERTS;
use super::route::{Absorbed, PrefillPath, Route, ABSORBED_MAX_ROWS};
use super::weights::Ffn;
use super::{CaptureMode, CudaBackend, Step};
use crate::dims::DecodeDims;
use crate::error::{CudaError, Result};
use crate::layout::{
    graph_to_evict, seq_bucket, table_bucket, AttnMeta, StepLayout, GRAPH_IDLE_STEPS, MAX_GRAPH_ROWS, MAX_GRAPH_SEQS,
};

/// Which forward a graph holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Stage {
    Target,
    /// MTP layer `d`.
    Mtp(usize),
}

/// What a graph was captured for: every launch argument that depends on the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GraphKey {
    pub stage: Stage,
    /// Padded sequences ([`seq_bucket`]).
    pub seqs: usize,
    /// Tokens per sequence (the window: 1 + drafts).
    pub q_len: usize,
    /// Padded block-table width ([`table_bucket`]).
    pub bt_stride: usize,
    /// The decode kernel's split count (planned from the step's longest context).
    pub splits: usize,
}

/// The persistent buffers every graph reads and writes, sized for the largest bucket:
/// graphs run one at a time on the backend's stream, and each replay refills the inputs
/// and copies the outputs out in stream order.
#[derive(Debug)]
pub(crate) struct GraphIo {
    tokens: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    slot: CudaSlice<i64>,
    row_seq: CudaSlice<i32>,
    /// `[seqs][bt_stride]` for the graph's own `bt_stride`.
    tables: CudaSlice<i32>,
    seq_lens: CudaSlice<i32>,
    /// An MTP stage's previous hidden state, gathered before the launch.
    hid: CudaSlice<f32>,
    /// The residual stream (an MTP stage's output).
    x: CudaSlice<f32>,
    /// The final (head) norm's output.
    normed: CudaSlice<f32>,
}

/// A backend's graphs.
#[derive(Default)]
pub(crate) struct Graphs {
    io: Option<GraphIo>,
    map: HashMap<GraphKey, CudaGraph>,
    /// The graph step each held graph last ran in (or was captured in).
    used: HashMap<GraphKey, u64>,
    /// Keys whose capture failed, with why.
    failed: HashMap<GraphKey, String>,
    /// Steps that took the graph path (a key's first one runs eagerly, then is captured).
    pub steps: u64,
    /// Graph launches so far.
    pub replays: u64,
    /// Captures so far, kept or failed, and graphs dropped to make room for others.
    captured: u64,
    evicted: u64,
}

impl Graphs {
    pub(super) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Captures so far, kept or failed (`Backend::graph_captures`).
    pub(super) fn captures(&self) -> u64 {
        self.captured
    }

    /// The held graph a new shape would replace once `max` are held ([`graph_to_evict`]).
    fn victim(&self, max: usize) -> Option<GraphKey> {
        if self.map.len() < max {
            return None;
        }
        graph_to_evict(self.used.iter().map(|(&k, &t)| (k, t)), self.steps, GRAPH_IDLE_STEPS)
    }

    /// Destroys every graph (later steps capture afresh). A graph holding captured NCCL
    /// collectives keeps its communicator alive: NCCL's abort and destroy wait until
    /// every such graph is gone, so a tensor-parallel rank destroys its graphs before its
    /// communicator (`Drop for CudaBackend`).
    pub(super) fn clear(&mut self) {
        self.map.clear();
        self.used.clear();
    }
}

impl std::fmt::Debug for Graphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graphs")
            .field("graphs", &self.map.len())
            .field("evicted", &self.evicted)
            .field("failed", &self.failed)
            .field("steps", &self.steps)
            .field("replays", &self.replays)
            .finish()
    }
}

/// [`CudaBackend::graph_stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Decode steps that took the graph path.
    pub steps: u64,
    /// Of those, the ones that launched a captured graph (the others were each key's
    /// first step: run eagerly on the graph's buffers, then captured).
    pub launches: u64,
    pub graphs: usize,
    /// Keys whose capture failed (they run eagerly; the reasons are logged).
    pub failed: usize,
    /// Graphs dropped to make room for another shape's (`CudaOptions::max_graphs`).
    pub evicted: u64,
}

/// What a graph step returns: copies of the graph's outputs for the real rows.
pub(crate) struct GraphOut {
    /// The residual stream (MTP stages only: their hidden state).
    pub x: Option<CudaSlice<f32>>,
    pub normed: CudaSlice<f32>,
}

/// The first `len` elements of `base` as a `CudaSlice` of their own: the kernels'
/// wrappers take slices of a step's exact length. Never freed (dropping it leaks the
/// handle, not the memory, which stays `base`'s).
struct Alias<T>(Option<CudaSlice<T>>);

impl<T> Alias<T> {
    fn new(s: &Arc<CudaStream>, base: &CudaSlice<T>, len: usize) -> Self {
        assert!(len <= base.len(), "alias of {len} elements in {}", base.len());
        let (ptr, _sync) = base.device_ptr(s);
        // SAFETY: `ptr .. ptr + len` lies in `base`'s live allocation. The alias is only
        // used on `s` (the backend's one stream) while `base`, owned by the backend, lives:
        // aliases are locals of one call. Drop leaks it, so the memory is never freed twice.
        Alias(Some(unsafe { s.upgrade_device_ptr(ptr, len) }))
    }
    fn take(mut self) -> CudaSlice<T> {
        self.0.take().expect("alias taken once")
    }
}

impl<T> Drop for Alias<T> {
    fn drop(&mut self) {
        if let Some(a) = self.0.take() {
            a.leak();
        }
    }
}

impl<T> std::ops::Deref for Alias<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        self.0.as_ref().expect("alias present")
    }
}

impl<T> std::ops::DerefMut for Alias<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        self.0.as_mut().expect("alias present")
    }
}

/// A [`Step`] over aliases of [`GraphIo`], for a capture: leaked, never freed.
struct AliasStep(Option<Step>);

impl Drop for AliasStep {
    fn drop(&mut self) {
        if let Some(st) = self.0.take() {
            let Step { tokens, pos, slot, row_seq, tables, seq_lens, .. } = st;
            tokens.leak();
            pos.leak();
            slot.leak();
            row_seq.leak();
            tables.leak();
            seq_lens.leak();
        }
    }
}

impl CudaBackend {
    /// Whether this step runs as a graph, and which: `None` for the eager path (see the
    /// module's list).
    pub(super) fn graph_key(&self, batch: &Batch, stage: Stage) -> Option<GraphKey> {
        let o = &self.opts;
        if !o.graphs
            || !o.decode_kernel
            || o.prefill == PrefillPath::Expanded
            || (o.prefill == PrefillPath::Flagged && batch.seqs.iter().any(|c| c.prefill))
            || self.prof.is_some()
        {
            return None;
        }
        let q_len = batch.seqs.first()?.tokens.len();
        if q_len == 0 || q_len > self.graph_max_q(stage) || batch.seqs.iter().any(|c| c.tokens.len() != q_len) {
            return None;
        }
        let seqs = seq_bucket(batch.seqs.len())?;
        let used = batch.seqs.iter().map(|c| c.block_table.len()).max().unwrap_or(1);
        let bt_stride = table_bucket(used);
        if seqs * q_len > MAX_GRAPH_ROWS || bt_stride > self.max_table_bucket() || !self.graph_safe() {
            return None;
        }
        let heads = self.blocks.first().or(self.mtp.first().map(|m| &m.block)).map(|b| b.attn.heads)?;
        let c = &self.cfg;
        let dims = DecodeDims { batch: seqs, heads, q_len, dlat: c.kv_lora_rank, drope: c.qk_rope_head_dim, bt_stride };
        // Fixed-size splits or an fp8 cache on latent widths without the tensor-core
        // kernel: every row runs the varlen kernel (layer.rs), whose result for a row
        // depends on that row alone. In a graph its shared memory is sized for the whole
        // table bucket (eagerly, for the step's longest context): graphs only where that
        // fits the default 48 KiB, so a capture sets no kernel attribute.
        let varlen = self.mla.fixed_split_blocks(bt_stride).is_some()
            || self.opts.kv_cache_dtype == mlaserve_core::KvCacheDtype::Fp8;
        let smem = crate::ops::attn::varlen_smem(dims.dlat + dims.drope, bt_stride * BLOCK_SIZE - 1);
        if varlen && !crate::MlaDecode::is_fast_path(&dims) && smem > crate::ops::attn::DEFAULT_SMEM {
            return None;
        }
        let max_len = batch.seqs.iter().map(|c| c.start_pos + c.tokens.len()).max().unwrap_or(1);
        let key = GraphKey { stage, seqs, q_len, bt_stride, splits: self.mla.num_splits(&dims, max_len) };
        let known = self.graphs.map.contains_key(&key);
        let room =
            || self.graphs.map.len() < self.opts.max_graphs || self.graphs.victim(self.opts.max_graphs).is_some();
        (known || (!self.graphs.failed.contains_key(&key) && room())).then_some(key)
    }

    /// Longest uniform window a graph of `stage` takes: a decode window (the last token
    /// and up to 3 drafts), and for an MTP stage past the first, which also redoes the
    /// positions drafted in the previous step (`k − 1` more rows at most), twice that
    /// where such rows stay absorbed (chunks routed by their flag, or every row
    /// absorbed); under `PrefillPath::Auto` they would take the expanded form, which
    /// runs eagerly.
    fn graph_max_q(&self, stage: Stage) -> usize {
        match (stage, self.opts.prefill) {
            (Stage::Mtp(_), PrefillPath::Flagged | PrefillPath::Absorbed) => 2 * ABSORBED_MAX_ROWS,
            _ => ABSORBED_MAX_ROWS,
        }
    }

    /// Widest block table a graph takes: the model's longest context.
    fn max_table_bucket(&self) -> usize {
        table_bucket(self.cfg.max_position_embeddings.div_ceil(BLOCK_SIZE))
    }

    /// Whether a forward of this model waits for nothing on the host mid-step (every MoE
    /// layer sorts on the device).
    fn graph_safe(&self) -> bool {
        self.blocks.iter().chain(self.mtp.iter().map(|m| &m.block)).all(|b| match &b.ffn {
            Ffn::Dense(_) => true,
            Ffn::Moe(m) => m.grouped.is_some() && m.route.experts <= GROUPED_MAX_EXPERTS,
        })
    }

    /// Runs the body of `key` over the persistent buffers (their first rows hold the
    /// step's inputs), eagerly or, with `capture`, into a graph (nothing executes then).
    fn body_on_io(&mut self, key: GraphKey) -> Result<()> {
        let s = self.gpu.stream.clone();
        let h = self.cfg.hidden_size;
        let rows = key.seqs * key.q_len;
        let io = self.graphs.io.as_ref().expect("allocated before any graph step");
        let st = AliasStep(Some(Step {
            n: rows,
            tokens: Alias::new(&s, &io.tokens, rows).take(),
            pos: Alias::new(&s, &io.pos, rows).take(),
            slot: Alias::new(&s, &io.slot, rows).take(),
            row_seq: Alias::new(&s, &io.row_seq, rows).take(),
            tables: Alias::new(&s, &io.tables, key.seqs * key.bt_stride).take(),
            seq_lens: Alias::new(&s, &io.seq_lens, key.seqs).take(),
            meta: AttnMeta {
                n: rows,
                seqs: key.seqs,
                bt_stride: key.bt_stride,
                max_pos: key.bt_stride * BLOCK_SIZE - 1,
                max_block: self.opts.num_blocks.saturating_sub(1),
            },
            uniform: Some(key.q_len),
            route: Route { abs: Absorbed::All, exp: None },
            splits: Some(key.splits),
            chunks: Vec::new(),
        }));
        let hid = Alias::new(&s, &io.hid, rows * h);
        let mut x = Alias::new(&s, &io.x, rows * h);
        let mut normed = Alias::new(&s, &io.normed, rows * h);
        let step = st.0.as_ref().expect("step present");
        match key.stage {
            Stage::Target => self.target_body(step, &mut x, &mut normed),
            Stage::Mtp(d) => self.mtp_body(d, step, &hid, &mut x, &mut normed),
        }
    }

    /// Captures the graph of `key` (the step just ran eagerly on the same buffers, so
    /// whatever NCCL and cuBLAS set up lazily exists already): `false` when the capture
    /// failed (logged; the key runs eagerly from now on).
    fn capture(&mut self, key: GraphKey) -> Result<bool> {
        let s = self.gpu.stream.clone();
        // Nothing of earlier work may be pending in the capture's view. In a group the
        // wait is bounded (the warm-up step's collectives need every peer).
        self.settle("graph capture")?;
        self.gpu.sync()?;
        let mode = match self.opts.graph_capture {
            CaptureMode::Relaxed => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            CaptureMode::ThreadLocal => CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        };
        s.begin_capture(mode)?;
        let body = self.body_on_io(key);
        // Always ended, so the stream leaves capture mode whatever happened.
        let graph = s.end_capture(CUgraphInstantiate_flags(0));
        let why = match (body, graph) {
            (Ok(()), Ok(Some(g))) => match g.upload() {
                Ok(()) => {
                    tracing::debug!(?key, "CUDA graph captured");
                    self.graphs.map.insert(key, g);
                    self.graphs.used.insert(key, self.graphs.steps);
                    return Ok(true);
                }
                Err(e) => format!("upload: {e:?}"),
            },
            (Err(e), _) => e.to_string(),
            (Ok(()), Err(e)) => format!("end of capture: {e:?}"),
            (Ok(()), Ok(None)) => "empty graph".into(),
        };
        // Work freed inside a failed capture records errors on the context: clear them.
        let _ = self.gpu.ctx.check_err();
        // A tensor-parallel rank cannot fall back alone: its peers, having captured, run
        // the step's collectives once more (the launch after a capture) and would wait
        // for it. The step fails instead, and with it the group.
        if self.comm.is_some() {
            return Err(CudaError::shape(
                "cuda graph",
                format!("capture of {key:?} failed on a tensor-parallel rank: {why}"),
            ));
        }
        tracing::warn!(?key, %why, "CUDA graph capture failed; this shape runs eagerly");
        self.graphs.failed.insert(key, why);
        Ok(false)
    }

    fn ensure_io(&mut self) -> Result<()> {
        if self.graphs.io.is_some() {
            return Ok(());
        }
        let s = &self.gpu.stream;
        let h = self.cfg.hidden_size;
        let tables = MAX_GRAPH_SEQS * self.max_table_bucket();
        self.graphs.io = Some(GraphIo {
            tokens: s.alloc_zeros(MAX_GRAPH_ROWS)?,
            pos: s.alloc_zeros(MAX_GRAPH_ROWS)?,
            slot: s.alloc_zeros(MAX_GRAPH_ROWS)?,
            row_seq: s.alloc_zeros(MAX_GRAPH_ROWS)?,
            tables: s.alloc_zeros(tables)?,
            seq_lens: s.alloc_zeros(MAX_GRAPH_SEQS)?,
            hid: s.alloc_zeros(MAX_GRAPH_ROWS * h)?,
            x: s.alloc_zeros(MAX_GRAPH_ROWS * h)?,
            normed: s.alloc_zeros(MAX_GRAPH_ROWS * h)?,
        });
        Ok(())
    }

    /// Runs `batch` as the graph step of `key`: uploads its padded metadata, gathers an
    /// MTP stage's previous hidden rows (`mtp_in`: the previous output, the rows uploaded,
    /// the same rows on the host), launches the graph, and copies the real rows' outputs
    /// out. A key's first step runs the same body eagerly on the same buffers and is then
    /// captured (vLLM's warm-up before capture): a collective's first use at a message
    /// size may set up NCCL connections, which must not happen inside a capture (measured:
    /// tensor-parallel steps captured cold hung on two H200s).
    pub(super) fn graph_step(
        &mut self,
        key: GraphKey,
        batch: &Batch,
        mtp_in: Option<(&CudaSlice<f32>, &CudaSlice<i32>, &[u32])>,
    ) -> Result<GraphOut> {
        let s = self.gpu.stream.clone();
        let (h, n) = (self.cfg.hidden_size, batch.num_tokens());
        let lay = StepLayout::new(batch, Some((key.seqs, key.bt_stride)));
        if lay.meta.n != key.seqs * key.q_len || lay.tables.len() != key.seqs * key.bt_stride {
            return Err(CudaError::shape("cuda graph", format!("{key:?} does not fit the step's {} rows", lay.meta.n)));
        }
        self.ensure_io()?;
        let io = self.graphs.io.as_mut().expect("allocated above");
        s.memcpy_htod(&lay.tokens, &mut io.tokens)?;
        super::drafts::link_tokens(&self.ops, &s, self.draft_slots.as_ref(), &mut io.tokens, &batch.draft_links)?;
        s.memcpy_htod(&lay.pos, &mut io.pos)?;
        s.memcpy_htod(&lay.slot, &mut io.slot)?;
        s.memcpy_htod(&lay.row_seq, &mut io.row_seq)?;
        s.memcpy_htod(&lay.tables, &mut io.tables)?;
        s.memcpy_htod(&lay.seq_lens, &mut io.seq_lens)?;
        if let Some((prev, rows_d, rows)) = mtp_in {
            let mut hid = Alias::new(&s, &io.hid, n * h);
            self.ops.gather(&s, &mut *hid, prev, rows_d, rows, h)?;
        }
        self.graphs.steps += 1;
        match self.graphs.map.get(&key) {
            Some(g) => {
                g.launch()?;
                self.graphs.replays += 1;
                self.graphs.used.insert(key, self.graphs.steps);
            }
            None => {
                // At the cap, the least recently used idle graph makes room (`graph_key`
                // took this path only if there is one).
                if let Some(old) = self.graphs.victim(self.opts.max_graphs) {
                    self.graphs.map.remove(&old);
                    self.graphs.used.remove(&old);
                    self.graphs.evicted += 1;
                    tracing::debug!(?old, ?key, "CUDA graph dropped for a new shape's");
                }
                self.graphs.captured += 1;
                self.body_on_io(key)?;
                // A tensor-parallel rank launches the new graph at once: its captured
                // collectives then run before the communicator's next eager one (the
                // head's all-gather). Left unlaunched, they are what the fourth
                // session's TP captures hung on (the likely cause; not yet confirmed on
                // two GPUs). The launch recomputes the step from the same inputs and
                // writes the same latents; a single rank needs no second run.
                if self.capture(key)? && self.comm.is_some() {
                    self.graphs.map.get(&key).expect("just captured").launch()?;
                    self.graphs.replays += 1;
                }
            }
        }
        let io = self.graphs.io.as_ref().expect("present");
        let x = match key.stage {
            Stage::Target => None,
            Stage::Mtp(_) => Some(s.clone_dtod(&io.x.slice(..n * h))?),
        };
        Ok(GraphOut { x, normed: s.clone_dtod(&io.normed.slice(..n * h))? })
    }

    /// Graph-path steps, graph launches and graphs held so far (tests and benchmarks).
    pub fn graph_stats(&self) -> GraphStats {
        GraphStats {
            steps: self.graphs.steps,
            launches: self.graphs.replays,
            graphs: self.graphs.map.len(),
            failed: self.graphs.failed.len(),
            evicted: self.graphs.evicted,
        }
    }
}
