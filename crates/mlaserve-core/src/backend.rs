//! The [`Backend`] trait: what the engine asks of a device to run one step.
//!
//! A step is a [`Batch`] of sequence chunks. Each chunk carries its new tokens, the
//! number of tokens already in the paged latent cache before them, and the block table
//! that maps its positions to physical cache blocks of [`BLOCK_SIZE`] tokens. Chunks of
//! different kinds (a prefill chunk, a decode window of `1 + k` tokens) mix freely, so
//! the scheduler can build mixed steps. The backend writes the latent cache entries of
//! the new tokens and returns the hidden state of every new token (kept on the device:
//! the MTP drafter consumes it), logits for the rows the caller asked for, and only the
//! chosen token for the rows where that is all the caller needs — the greedy choice
//! ([`argmax`]) or a sample under the one sampling rule ([`crate::sampling::sample_token`],
//! with the temperature, top-k, top-p and uniform the row carries): a backend computes
//! those on its device and sends back one id per row instead of a vocabulary of logits
//! (132 MB per call at DeepSeek-V3's vocabulary, batch 64, 4 rows each).

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::logits::{LogprobRow, RowEdits, RowLogprobs, MAX_TOP_LOGPROBS};
use crate::sampling::SampleRow;

/// Tokens per page of the latent KV cache (FlashMLA's page size).
pub const BLOCK_SIZE: usize = 64;

/// One sequence's slice of a step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqChunk {
    /// Token ids processed in this step, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: Vec<u32>,
    /// Tokens of this sequence already in the cache (for this layer stack) before `tokens`.
    pub start_pos: usize,
    /// Physical block ids; must cover positions `0..start_pos + tokens.len()`.
    pub block_table: Vec<u32>,
    /// The tokens are prompt tokens being prefilled, not a decode window or generated
    /// tokens being recomputed after preemption (the engine never puts both kinds in one
    /// chunk). Results must not depend on it; a backend may route by it (the CUDA
    /// backend's batch-invariant options give every prompt chunk, whatever its length, the
    /// expanded form of MLA, and every other chunk the absorbed one, so a token's form
    /// never depends on how its prompt was chunked or whether it was recomputed).
    pub prefill: bool,
}

/// A step's input: chunks, and which flattened token rows need logits.
///
/// Rows are numbered over the concatenation of all chunks' tokens in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Batch {
    pub seqs: Vec<SeqChunk>,
    /// Flattened row indices whose logits are returned, in this order.
    pub logit_rows: Vec<u32>,
    /// Flattened row indices whose argmax token is returned (`ForwardOutput::argmax`), in
    /// this order: the lowest id among the largest logits, NaN never chosen ([`argmax`]).
    pub argmax_rows: Vec<u32>,
    /// Rows whose token is sampled by the backend (`ForwardOutput::sampled`), in this
    /// order: [`crate::sampling::sample_token`] of the row's logits with the row's
    /// parameters and uniform.
    pub sample_rows: Vec<SampleRow>,
    /// Logit edits (bias, penalties) of argmax or sample rows, applied to the row before
    /// its choice (`crate::logits`); at most one entry per row.
    pub edits: Vec<RowEdits>,
    /// Argmax or sample rows whose log-probabilities are returned
    /// (`ForwardOutput::logprobs`, in this order), of the unedited row.
    pub logprob_rows: Vec<LogprobRow>,
    /// MTP calls on a backend that [`Backend::keeps_drafts`]: `(row, slot)`, row `row`'s
    /// token is the id in draft slot `slot` (stored by an earlier call of the same
    /// drafting pass); the id in `seqs` at that row is a placeholder.
    pub draft_links: Vec<(u32, u32)>,
    /// MTP calls on a backend that [`Backend::keeps_drafts`]: when not empty, one slot
    /// per `argmax_rows` entry, the backend keeps each argmax id in its slot instead of
    /// returning it (`ForwardOutput::argmax` comes back empty; [`Backend::read_drafts`]
    /// returns the slots).
    pub argmax_slots: Vec<u32>,
}

/// Draft slots a drafting pass may use ([`Batch::draft_links`], [`Batch::argmax_slots`]).
pub const MAX_DRAFT_SLOTS: usize = 1 << 16;

impl Batch {
    /// Asks nothing of any row: no logits, choices, edits, log-probabilities, draft
    /// links or slots (the chunks stay).
    pub fn clear_rows(&mut self) {
        self.logit_rows.clear();
        self.argmax_rows.clear();
        self.sample_rows.clear();
        self.edits.clear();
        self.logprob_rows.clear();
        self.draft_links.clear();
        self.argmax_slots.clear();
    }

    /// The token a row chose: its argmax or sampled id, given the answers to
    /// `argmax_rows` and `sample_rows`.
    pub fn chosen(&self, row: u32, argmax: &[u32], sampled: &[u32]) -> Option<u32> {
        if let Some(i) = self.argmax_rows.iter().position(|&r| r == row) {
            return argmax.get(i).copied();
        }
        let i = self.sample_rows.iter().position(|s| s.row == row)?;
        sampled.get(i).copied()
    }

    fn chooses(&self, row: u32) -> bool {
        self.argmax_rows.contains(&row) || self.sample_rows.iter().any(|s| s.row == row)
    }

    /// Total number of new tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    /// Refuses [`Batch::draft_links`] and [`Batch::argmax_slots`] where the call cannot
    /// honour them (`keeps`: an MTP call on a backend that [`Backend::keeps_drafts`]).
    pub fn validate_kept(&self, keeps: bool) -> Result<()> {
        let carries = !self.draft_links.is_empty() || !self.argmax_slots.is_empty();
        if carries && !keeps {
            return Err(Error::Batch("draft links or argmax slots for a call that keeps no drafts".into()));
        }
        Ok(())
    }

    /// Checks shapes against the model and the cache size; every backend calls this.
    pub fn validate(&self, vocab_size: usize, num_blocks: usize, max_positions: usize) -> Result<()> {
        let n = self.num_tokens();
        for (i, s) in self.seqs.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(Error::Batch(format!("sequence {i} has no new tokens")));
            }
            let end = s.start_pos + s.tokens.len();
            if end > max_positions {
                return Err(Error::Batch(format!("sequence {i} reaches position {end} > {max_positions}")));
            }
            if s.block_table.len() * BLOCK_SIZE < end {
                return Err(Error::Batch(format!(
                    "sequence {i}: block table of {} blocks cannot hold {end} positions",
                    s.block_table.len()
                )));
            }
            if let Some(&b) = s.block_table.iter().find(|&&b| b as usize >= num_blocks) {
                return Err(Error::Batch(format!("sequence {i}: block id {b} >= {num_blocks}")));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab_size) {
                return Err(Error::Batch(format!("sequence {i}: token id {t} >= vocab size {vocab_size}")));
            }
        }
        if let Some(&r) = self.logit_rows.iter().find(|&&r| r as usize >= n) {
            return Err(Error::Batch(format!("logit row {r} >= {n} tokens")));
        }
        if let Some(&r) = self.argmax_rows.iter().find(|&&r| r as usize >= n) {
            return Err(Error::Batch(format!("argmax row {r} >= {n} tokens")));
        }
        for s in &self.sample_rows {
            if s.row as usize >= n {
                return Err(Error::Batch(format!("sample row {} >= {n} tokens", s.row)));
            }
            if !(s.temperature > 0.0 && s.temperature.is_finite()) {
                return Err(Error::Batch(format!(
                    "sample row {}: temperature {} is not finite > 0",
                    s.row, s.temperature
                )));
            }
            if !(s.top_p > 0.0 && s.top_p <= 1.0) {
                return Err(Error::Batch(format!("sample row {}: top_p {} is not in (0, 1]", s.row, s.top_p)));
            }
            if !(0.0..1.0).contains(&s.u) {
                return Err(Error::Batch(format!("sample row {}: uniform {} is not in [0, 1)", s.row, s.u)));
            }
            if !(0.0..=1.0).contains(&s.min_p) {
                return Err(Error::Batch(format!("sample row {}: min_p {} is not in [0, 1]", s.row, s.min_p)));
            }
        }
        for (i, e) in self.edits.iter().enumerate() {
            if !self.chooses(e.row) || self.edits[..i].iter().any(|o| o.row == e.row) {
                return Err(Error::Batch(format!("edits of row {}: not a choice row, or edited twice", e.row)));
            }
            if let Some(t) = e.edits.iter().find(|t| t.token as usize >= vocab_size) {
                return Err(Error::Batch(format!("edits of row {}: token {} >= {vocab_size}", e.row, t.token)));
            }
            if e.edits.iter().any(|t| !(t.repetition > 0.0 && t.repetition.is_finite())) {
                return Err(Error::Batch(format!("edits of row {}: a repetition penalty is not finite > 0", e.row)));
            }
        }
        let decides_more = !self.sample_rows.is_empty() || !self.edits.is_empty() || !self.logprob_rows.is_empty();
        if !self.argmax_slots.is_empty() && decides_more {
            return Err(Error::Batch("argmax slots with samples, edits or logprobs (drafts have none)".into()));
        }
        if !self.argmax_slots.is_empty() && self.argmax_slots.len() != self.argmax_rows.len() {
            return Err(Error::Batch(format!(
                "{} argmax slots for {} argmax rows",
                self.argmax_slots.len(),
                self.argmax_rows.len()
            )));
        }
        if let Some(&s) = self
            .argmax_slots
            .iter()
            .chain(self.draft_links.iter().map(|(_, s)| s))
            .find(|&&s| s as usize >= MAX_DRAFT_SLOTS)
        {
            return Err(Error::Batch(format!("draft slot {s} >= {MAX_DRAFT_SLOTS}")));
        }
        if let Some(&(r, _)) = self.draft_links.iter().find(|&&(r, _)| r as usize >= n) {
            return Err(Error::Batch(format!("draft link row {r} >= {n} tokens")));
        }
        for l in &self.logprob_rows {
            if !self.chooses(l.row) || l.top > MAX_TOP_LOGPROBS {
                return Err(Error::Batch(format!(
                    "logprob row {}: not a choice row, or top {} > {MAX_TOP_LOGPROBS}",
                    l.row, l.top
                )));
            }
        }
        Ok(())
    }
}

/// What a forward returns.
#[derive(Debug)]
pub struct ForwardOutput<H> {
    /// Hidden state of every new token, in row order. For the target model this is the
    /// state after the final norm; for an MTP layer it is the block output (residual
    /// added) before `shared_head.norm` — exactly what the next drafting stage consumes.
    pub hidden: H,
    /// `logit_rows.len() × vocab_size` logits, row-major, on the host.
    pub logits: Vec<f32>,
    /// The argmax token of each of `argmax_rows`.
    pub argmax: Vec<u32>,
    /// The sampled token of each of `sample_rows`, in order.
    pub sampled: Vec<u32>,
    /// The log-probabilities of each of `logprob_rows`, in order.
    pub logprobs: Vec<RowLogprobs>,
}

/// Index of the largest logit; ties go to the lowest id, NaN never wins (a row of NaN
/// and −∞ only: its first non-NaN entry, else 0). Every backend's `argmax_rows` and the
/// engine's greedy choice use this rule (and the sampling rule falls back to it).
pub fn argmax(logits: &[f32]) -> u32 {
    if logits.len() <= 64 {
        // Short rows: one branch-free pass (selects, no mispredicted jumps).
        let (mut best, mut best_v) = (0usize, f32::NEG_INFINITY);
        for (i, &v) in logits.iter().enumerate() {
            let gt = v > best_v;
            best = if gt { i } else { best };
            best_v = if gt { v } else { best_v };
        }
        if best_v == f32::NEG_INFINITY {
            return logits.iter().position(|v| !v.is_nan()).unwrap_or(0) as u32;
        }
        return best as u32;
    }
    // Pass 1: the maximum, lane-wise so that it vectorises (`v > m` is false for NaN).
    const LANES: usize = 16;
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for i in 0..LANES {
            lanes[i] = if c[i] > lanes[i] { c[i] } else { lanes[i] };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(rest) {
        if v > max {
            max = v;
        }
    }
    // Pass 2: the first index holding it (all -inf or NaN: the first non-NaN entry).
    let pos = if max == f32::NEG_INFINITY {
        logits.iter().position(|v| !v.is_nan())
    } else {
        logits.iter().position(|&v| v == max)
    };
    pos.unwrap_or(0) as u32
}

/// A device that runs the model: the CPU reference backend, the CUDA backend.
///
/// One backend instance is one tensor-parallel rank. Calls are made from one thread.
pub trait Backend {
    /// Hidden states of a step's tokens, resident wherever the backend computes.
    type Hidden;

    /// The model's configuration.
    fn config(&self) -> &ModelConfig;

    /// Number of physical cache blocks (shared by the target layers and the MTP layers).
    fn num_blocks(&self) -> usize;

    /// How the device's memory was split at load, for a backend that planned it (the
    /// CUDA backend under `--gpu-memory-utilization`).
    fn memory_plan(&self) -> Option<crate::memory::MemoryPlan> {
        None
    }

    /// Target model forward over `batch`: writes the latent cache of the main layers.
    fn forward(&mut self, batch: &Batch) -> Result<ForwardOutput<Self::Hidden>>;

    /// MTP layer `layer` (0-based, < `num_nextn_predict_layers`) over `batch`, where the
    /// token at row `r` is the embedding input and row `hidden_rows[r]` of `prev` is the
    /// hidden input (`h_i`: the target's final-normed hidden state for the first MTP layer, the previous layer's block output after it). Writes that MTP layer's latent cache. Logits
    /// come from the layer's `shared_head`.
    fn mtp_forward(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &Self::Hidden,
        hidden_rows: &[u32],
    ) -> Result<ForwardOutput<Self::Hidden>>;

    /// Copies hidden rows to the host (`rows × hidden_size`), for tests and debugging.
    fn hidden_to_host(&self, h: &Self::Hidden) -> Result<Vec<f32>>;

    /// A new hidden state made of the given rows of each part, in order (the drafter
    /// joins rows kept from the previous step with the current stage's output).
    fn concat_hidden(&mut self, parts: &[(&Self::Hidden, &[u32])]) -> Result<Self::Hidden>;

    /// The target forward, told the drafting pass that will follow it (`None`: none
    /// will; [`crate::drafting::PassPlan`]). A tensor-parallel leader sends the plan
    /// with the forward, so its followers run the pass without another plan; other
    /// backends only run the forward.
    fn forward_planned(
        &mut self,
        batch: &Batch,
        plan: Option<&crate::drafting::PassPlan>,
    ) -> Result<ForwardOutput<Self::Hidden>> {
        let _ = plan;
        self.forward(batch)
    }

    /// Runs a drafting pass's MTP stages over the stage-0 `batch`
    /// ([`crate::drafting::run_stages`], which says what each argument holds). A
    /// tensor-parallel leader sends the pass to its followers as one plan first.
    fn draft_stages(
        &mut self,
        pass: &mut crate::drafting::DraftPass,
        batch: &mut Batch,
        target: &Self::Hidden,
        mem: &mut crate::drafting::StageMemory<Self::Hidden>,
        sc: &mut crate::drafting::StageScratch,
    ) -> Result<u64> {
        crate::drafting::run_stages(self, pass, batch, target, mem, sc)
    }

    /// The clock the engine times its steps with (adaptive speculation follows these
    /// times): wall time, unless a test backend keeps a clock of its own.
    fn now(&self) -> std::time::Instant {
        std::time::Instant::now()
    }

    /// Whether MTP calls honour [`Batch::draft_links`] and [`Batch::argmax_slots`]: the
    /// drafts of a pass stay on the device, so its stages run back to back without a
    /// round trip to the host between them. `false` (the default): the caller writes
    /// the drafts into the batches itself, and the batches carry neither field.
    fn keeps_drafts(&self) -> bool {
        false
    }

    /// The ids in draft slots `0..n` (after the pass that stored them).
    fn read_drafts(&mut self, n: usize) -> Result<Vec<u32>> {
        let _ = n;
        Err(Error::Batch("this backend keeps no drafts".into()))
    }

    /// How often [`Backend::keep_alive`] is due: a tensor-parallel leader's followers
    /// wait for its next plan no longer than their collective timeout. None (the
    /// default): never.
    fn idle_interval(&self) -> Option<std::time::Duration> {
        None
    }

    /// Called by the engine's thread every [`Backend::idle_interval`], whether or not it
    /// has stepped since: a tensor-parallel leader that has sent no plan for that long
    /// tells its followers the group is alive. An error is the group's failure.
    fn keep_alive(&mut self) -> Result<()> {
        Ok(())
    }

    /// CUDA graphs captured so far. A call that captured one took several times a
    /// replay's time, so the engine keeps such steps out of the costs adaptive
    /// speculation measures. 0 for backends without graphs.
    fn graph_captures(&self) -> u64 {
        0
    }

    /// The batch sizes (sequences, ascending) a decode step is padded to for its CUDA
    /// graph: a step of another size runs as the next one up. The engine can capture
    /// them all before it serves (`EngineConfig::warm_up_graphs`). Empty (the default)
    /// for backends without graphs.
    fn graph_batch_sizes(&self) -> Vec<usize> {
        Vec::new()
    }
}

/// A mutable borrow of a backend is a backend (so a caller can keep ownership).
impl<B: Backend + ?Sized> Backend for &mut B {
    type Hidden = B::Hidden;

    fn config(&self) -> &ModelConfig {
        (**self).config()
    }
    fn num_blocks(&self) -> usize {
        (**self).num_blocks()
    }
    fn memory_plan(&self) -> Option<crate::memory::MemoryPlan> {
        (**self).memory_plan()
    }
    fn forward(&mut self, batch: &Batch) -> Result<ForwardOutput<Self::Hidden>> {
        (**self).forward(batch)
    }
    fn mtp_forward(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &Self::Hidden,
        hidden_rows: &[u32],
    ) -> Result<ForwardOutput<Self::Hidden>> {
        (**self).mtp_forward(layer, batch, prev, hidden_rows)
    }
    fn hidden_to_host(&self, h: &Self::Hidden) -> Result<Vec<f32>> {
        (**self).hidden_to_host(h)
    }
    fn idle_interval(&self) -> Option<std::time::Duration> {
        (**self).idle_interval()
    }
    fn keep_alive(&mut self) -> Result<()> {
        (**self).keep_alive()
    }
    fn keeps_drafts(&self) -> bool {
        (**self).keeps_drafts()
    }
    fn read_drafts(&mut self, n: usize) -> Result<Vec<u32>> {
        (**self).read_drafts(n)
    }
    fn concat_hidden(&mut self, parts: &[(&Self::Hidden, &[u32])]) -> Result<Self::Hidden> {
        (**self).concat_hidden(parts)
    }
    fn draft_stages(
        &mut self,
        pass: &mut crate::drafting::DraftPass,
        batch: &mut Batch,
        target: &Self::Hidden,
        mem: &mut crate::drafting::StageMemory<Self::Hidden>,
        sc: &mut crate::drafting::StageScratch,
    ) -> Result<u64> {
        (**self).draft_stages(pass, batch, target, mem, sc)
    }
    fn forward_planned(
        &mut self,
        batch: &Batch,
        plan: Option<&crate::drafting::PassPlan>,
    ) -> Result<ForwardOutput<Self::Hidden>> {
        (**self).forward_planned(batch, plan)
    }
    fn now(&self) -> std::time::Instant {
        (**self).now()
    }
    fn graph_captures(&self) -> u64 {
        (**self).graph_captures()
    }
    fn graph_batch_sizes(&self) -> Vec<usize> {
        (**self).graph_batch_sizes()
    }
}
