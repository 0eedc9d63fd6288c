//! The synchronous engine core: admission, the step (schedule → target forward →
//! verify → MTP drafting), events, statistics. Deterministic; the async
//! [`crate::EngineHandle`] drives it from one thread.

use crate::api::{
    EngineConfig, EngineStats, Event, FinishReason, Load, Request, RequestId, Speculation, StepTimes, Usage,
    MAX_SPECULATIVE_TOKENS,
};
use crate::block::{blocks_for, BlockManager};
use crate::draft::{chunk_at, draft, plan_pass, DraftJob, DraftScratch, MtpMemory};
use crate::error::{EngineError, Result};
use crate::rng::mix64;
use crate::sampling::{sample_row, verify_ids_into};
use crate::scheduler::{schedule, Limits};
use crate::sequence::{Sched, Sequence};
use crate::speculation::{Counts, Policy};
use mlaserve_core::{Backend, Batch, ForwardOutput, LogprobRow, RowEdits, BLOCK_SIZE};
use mlaserve_core::{InvalidField, RequestLimits};
use std::collections::VecDeque;

/// Appends a `Tokens` event for `id` and returns its (empty) token list, which the step
/// fills in place: the event, 128 bytes, is not moved after it is built.
fn tokens_event(events: &mut Vec<(RequestId, Event)>, id: RequestId, capacity: usize) -> &mut Vec<u32> {
    events.push((id, Event::Tokens(Vec::with_capacity(capacity))));
    match events.last_mut() {
        Some((_, Event::Tokens(tokens))) => tokens,
        _ => unreachable!("a Tokens event was just pushed"),
    }
}

/// Continuous-batching engine over one backend.
pub struct Engine<B: Backend> {
    backend: B,
    lim: Limits,
    max_model_len: usize,
    max_queued: usize,
    seed: u64,
    vocab: usize,
    n_mtp: usize,
    eos: Vec<u32>,
    blocks: BlockManager,
    /// Requests holding cache, by arrival.
    running: Vec<Sequence>,
    /// Requests waiting for admission (new or preempted), by arrival.
    waiting: VecDeque<Sequence>,
    next_id: u64,
    pending: Vec<(RequestId, Event)>,
    finished_totals: Usage,
    finished_requests: u64,
    times: StepTimes,
    /// Reused between steps to avoid reallocating every chunk.
    batch: Batch,
    scratch: DraftScratch,
    mtp: MtpMemory<B::Hidden>,
    jobs: Vec<DraftJob>,
    /// Chooses each step's k (fixed, or adaptive up to `lim.k`).
    policy: Policy,
    /// The k of the last drafting pass (`lim.k` before the first).
    last_k: usize,
    /// Why the backend is unusable for good, once a collective failed.
    failed: Option<String>,
}

impl<B: Backend> std::fmt::Debug for Engine<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("k", &self.lim.k)
            .field("running", &self.running.len())
            .field("waiting", &self.waiting.len())
            .field("blocks_free", &self.blocks.num_free())
            .finish_non_exhaustive()
    }
}

/// Whether a backend error means the group itself is gone (a collective failed: a rank
/// died or stalled, or NCCL reported an error), not just this step.
fn is_group_failure(e: &mlaserve_core::Error) -> bool {
    matches!(e, mlaserve_core::Error::Collective(_))
}

/// Indexes `s`'s full blocks that end by position `end` and are not indexed yet (as
/// complete before its MTP holes); stops registering `s` for good once a block's content
/// turns out cached in another block.
fn register_upto(blocks: &mut BlockManager, s: &mut Sequence, end: usize) {
    let to = (end / BLOCK_SIZE).min(s.block_table.len());
    if s.registered < to {
        let span = (s.registered, to);
        let got = blocks.register(&s.block_table, &s.tokens, &mut s.prefix_chain, span, s.holes_from / BLOCK_SIZE);
        s.registered = if got < to { usize::MAX } else { got };
    }
}

/// Blocks one request of `len` tokens needs at most, in every state it can reach.
fn blocks_for_len(lim: &Limits, len: usize) -> usize {
    blocks_for(lim.decode_positions(len - 2).max(lim.prefill_positions(len - 1, true)))
}

/// The longest sequence the KV cache can hold for one request: `len` when it fits; an
/// explicit `--max-model-len` that does not fit is refused, a default one is clipped.
fn fit_max_model_len(lim: &Limits, len: usize, explicit: bool, blocks: usize) -> Result<usize> {
    if blocks_for_len(lim, len) <= blocks {
        return Ok(len);
    }
    if explicit {
        return Err(EngineError::Config(format!(
            "max_model_len {len}: one request of that length needs {} KV cache blocks, the cache has {blocks} \
             (raise --kv-blocks or lower --max-model-len)",
            blocks_for_len(lim, len)
        )));
    }
    // The largest length that fits (blocks_for_len grows with len).
    let (mut lo, mut hi) = (1, len);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if blocks_for_len(lim, mid) <= blocks {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    if lo < 2 {
        return Err(EngineError::Config(format!("the KV cache ({blocks} blocks) cannot hold one request")));
    }
    tracing::info!(max_model_len = lo, blocks, "max_model_len clipped to what the KV cache holds for one request");
    Ok(lo)
}

impl<B: Backend> Engine<B> {
    /// Builds an engine over `backend`, checking `config` against the model and cache.
    pub fn new(backend: B, config: EngineConfig) -> Result<Self> {
        let m = backend.config();
        let n_mtp = m.num_nextn_predict_layers;
        let k = config.num_speculative_tokens.unwrap_or(if n_mtp > 0 { 3 } else { 0 });
        if k > MAX_SPECULATIVE_TOKENS {
            return Err(EngineError::Config(format!("num_speculative_tokens {k} > {MAX_SPECULATIVE_TOKENS}")));
        }
        if k > 0 && n_mtp == 0 {
            return Err(EngineError::Config(format!(
                "num_speculative_tokens {k} needs MTP layers; the model has none"
            )));
        }
        let mpe = m.max_position_embeddings;
        let max_model_len = config.max_model_len.unwrap_or(mpe.saturating_sub(2 * MAX_SPECULATIVE_TOKENS));
        let lim = Limits {
            k,
            max_batch_tokens: config.max_batch_tokens,
            max_prefill_tokens: config.max_prefill_tokens.unwrap_or(config.max_batch_tokens),
            max_num_seqs: config.max_num_seqs,
        };
        if max_model_len < 2 || lim.decode_positions(max_model_len - 2) > mpe {
            return Err(EngineError::Config(format!(
                "max_model_len {max_model_len} with k = {k} does not fit max_position_embeddings {mpe} \
                 (drafting needs 2k - 1 positions of headroom)"
            )));
        }
        if config.max_batch_tokens < 1 + k {
            return Err(EngineError::Config(format!(
                "max_batch_tokens {} must hold one decode window of 1 + k = {} tokens",
                config.max_batch_tokens,
                1 + k
            )));
        }
        if config.max_prefill_tokens == Some(0) {
            return Err(EngineError::Config("max_prefill_tokens must be at least 1".into()));
        }
        if config.max_num_seqs == 0 {
            return Err(EngineError::Config("max_num_seqs must be at least 1".into()));
        }
        if config.calibration_rows > 0
            && (config.speculation != Speculation::Adaptive || config.num_speculative_tokens == Some(0))
        {
            return Err(EngineError::Config(format!(
                "calibration_rows {} (--speculation-calibration-rows) needs adaptive speculation with at least \
                 one draft token (k = {k}, {:?})",
                config.calibration_rows, config.speculation
            )));
        }
        if config.max_queued == 0 {
            return Err(EngineError::Config("max_queued must be at least 1".into()));
        }
        if backend.num_blocks() == 0 {
            return Err(EngineError::Config("kv_blocks: the KV cache has no blocks".into()));
        }
        let max_model_len =
            fit_max_model_len(&lim, max_model_len, config.max_model_len.is_some(), backend.num_blocks())?;
        Ok(Engine {
            vocab: m.vocab_size,
            eos: m.eos_token_ids.clone(),
            n_mtp,
            blocks: if config.enable_prefix_caching {
                BlockManager::with_prefix_caching(backend.num_blocks(), n_mtp.min(k))
            } else {
                BlockManager::new(backend.num_blocks())
            },
            backend,
            lim,
            max_model_len,
            max_queued: config.max_queued,
            seed: config.seed,
            running: Vec::new(),
            waiting: VecDeque::new(),
            next_id: 0,
            pending: Vec::new(),
            finished_totals: Usage { accepted_per_position: vec![0; k], ..Default::default() },
            finished_requests: 0,
            times: StepTimes::default(),
            batch: Batch::default(),
            scratch: DraftScratch::default(),
            mtp: MtpMemory::default(),
            failed: None,
            jobs: Vec::new(),
            policy: Policy::new(k, config.speculation == Speculation::Adaptive),
            last_k: k,
        })
    }

    /// Draft tokens per decode step (k; the most, when adaptive).
    pub fn num_speculative_tokens(&self) -> usize {
        self.lim.k
    }

    /// Longest sequence (prompt + output) the engine lets a request reach.
    /// How the backend split its device's memory, when it planned it.
    pub fn memory_plan(&self) -> Option<mlaserve_core::memory::MemoryPlan> {
        self.backend.memory_plan()
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The backend, mutably (tests use it to inject failures; the engine assumes the
    /// caller leaves the cache alone).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }

    /// Tests of backends: an adaptive engine's decision i takes `pattern[i % len]`
    /// (capped at the maximum) instead of the policy's choice, so the drafting passes of
    /// every k transition run on the backend in a known order (output never depends on
    /// k). An empty pattern gives the choice back to the policy.
    pub fn force_k(&mut self, pattern: &[usize]) {
        self.policy.forced = pattern.to_vec();
    }

    /// For an idle engine, every [`Backend::idle_interval`]: tells the backend the engine
    /// is alive ([`Backend::keep_alive`]: a TP leader's followers would otherwise give up
    /// waiting for its next plan). A collective failure fails the group as a step's does.
    pub fn keep_alive(&mut self) {
        if self.failed.is_some() {
            return;
        }
        if let Err(e) = self.backend.keep_alive() {
            tracing::error!(error = %e, "keep-alive failed");
            self.note_backend_error(&e, &mut Vec::new());
        }
    }

    /// Whether a step would do anything (requests live or events pending).
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty() || !self.pending.is_empty()
    }

    /// Validates and queues a request. Errors name the offending field.
    pub fn add_request(&mut self, req: Request) -> Result<RequestId> {
        if let Some(why) = &self.failed {
            return Err(EngineError::Failed(why.clone()));
        }
        self.validate(&req)?;
        if self.waiting.len() >= self.max_queued {
            return Err(EngineError::QueueFull(self.waiting.len()));
        }
        let id = RequestId(self.next_id);
        self.next_id += 1;
        let seed = req.sampling.seed.unwrap_or_else(|| mix64(self.seed ^ mix64(id.0)));
        let seq = Sequence::new(id, id.0, req.prompt, req.sampling, seed, self.lim.k);
        self.waiting.push_back(seq);
        Ok(id)
    }

    fn validate(&self, req: &Request) -> Result<()> {
        let p = &req.sampling;
        let limits = RequestLimits { vocab_size: self.vocab as u32, max_context: self.max_model_len as u32 };
        p.check(&req.prompt, limits)?;
        // The request must fit the pool alone, in every state it can reach.
        let longest = (req.prompt.len() + p.max_new_tokens as usize).min(self.max_model_len);
        let need = self.lim.decode_positions(longest - 2).max(self.lim.prefill_positions(longest - 1, true));
        if blocks_for(need) > self.blocks.total() {
            return Err(InvalidField::new(
                "stopping.max_new_tokens",
                format!(
                    "prompt + max_new_tokens need {} cache blocks; the cache has {}",
                    blocks_for(need),
                    self.blocks.total()
                ),
            )
            .into());
        }
        Ok(())
    }

    /// Aborts a request: frees its blocks now; its `Finished { Abort }` event comes with
    /// the next [`Engine::step`].
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        let seq = if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i)
        } else if let Some(i) = self.running.iter().position(|s| s.id == id) {
            Some(self.running.remove(i))
        } else {
            None
        };
        let seq = seq.ok_or(EngineError::UnknownRequest(id))?;
        let ev = self.retire(seq, FinishReason::Abort);
        self.pending.push(ev);
        Ok(())
    }

    /// Frees a finished sequence and returns its final event.
    fn retire(&mut self, mut seq: Sequence, reason: FinishReason) -> (RequestId, Event) {
        self.blocks.release(&mut seq.block_table);
        let usage = seq.usage();
        self.finished_totals.accumulate(&usage);
        self.finished_requests += 1;
        (seq.id, Event::Finished { reason, usage })
    }

    /// Runs one step and returns the events it produced (plus those of aborts since
    /// the last step). A backend failure finishes the step's requests with
    /// [`FinishReason::Error`]; the engine goes on with the others.
    pub fn step(&mut self) -> Vec<(RequestId, Event)> {
        let mut events = std::mem::take(&mut self.pending);
        if self.running.is_empty() && self.waiting.is_empty() {
            return events;
        }
        let t0 = self.backend.now();
        let captures = self.backend.graph_captures();
        // While the engine drafts with every MTP layer it uses, a prompt whose cached
        // blocks are target-only (left by steps at a smaller k) is prefilled again, so its
        // blocks are cached complete from then on: inherited MTP holes cost every later
        // request with that prefix a part of its drafts, a new prefill costs once.
        let used = self.n_mtp.min(self.lim.k);
        self.blocks.target_only_hits = used == 0 || self.last_k < used;
        let sched = schedule(&mut self.running, &mut self.waiting, &mut self.blocks, &self.lim);
        if sched.tokens == 0 {
            return events;
        }
        let (windows, step_k) = self.build_batch();
        let decode_only = windows == self.batch.seqs.len();
        // The next drafting pass's k, and its plan, before the forward: a TP leader sends
        // the plan with it, so the step crosses to the followers as one plan.
        let next_k = self.choose_k(decode_only);
        if next_k > 0 {
            let (running, batch, plan) = (&self.running, &self.batch, &mut self.scratch.plan);
            plan_pass(&self.backend, running, batch, next_k, self.n_mtp, &self.mtp, plan);
        }
        let t1 = self.backend.now();
        let fwd = self.backend.forward_planned(&self.batch, (next_k > 0).then_some(&self.scratch.plan));
        let t2 = self.backend.now();
        self.times.steps += 1;
        self.times.schedule_us += (t1 - t0).as_micros() as u64;
        self.times.forward_us += (t2 - t1).as_micros() as u64;
        // One id per asked row, or the backend broke its contract (the ids would be
        // misattributed): fail the step like any backend error.
        let fwd = fwd.and_then(|out| {
            let (b, a, s, l) = (&self.batch, out.argmax.len(), out.sampled.len(), out.logprobs.len());
            if a == b.argmax_rows.len() && s == b.sample_rows.len() && l == b.logprob_rows.len() {
                Ok(out)
            } else {
                Err(mlaserve_core::Error::Backend(format!(
                    "{a} argmax ids for {} rows, {s} sampled ids for {} rows, {l} logprobs for {} rows",
                    b.argmax_rows.len(),
                    b.sample_rows.len(),
                    b.logprob_rows.len()
                )))
            }
        });
        let out = match fwd {
            Ok(out) => out,
            Err(e) => {
                self.return_tables();
                self.fail_scheduled(&e, &mut events);
                return events;
            }
        };
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        events.reserve(self.batch.seqs.len());
        let mut jobs = std::mem::take(&mut self.jobs);
        jobs.clear();
        self.verify(&out, &mut events, &mut finished, &mut jobs);
        let t3 = self.backend.now();
        self.times.verify_us += (t3 - t2).as_micros() as u64;
        // A step that captured a CUDA graph is no cost sample (a capture takes several
        // steps' time, once per shape).
        let captures_after_step = self.backend.graph_captures();
        let captured = captures_after_step != captures;
        let step_us = (t3 - t0).as_micros() as u64;
        tracing::trace!(k = step_k, windows, step_us, decode_only, captured, "step timed");
        self.policy.stepped(step_k, windows, step_us, decode_only && !captured);
        let mut draft_err = None;
        let mut drafted = false;
        // A planned pass runs whoever finished (a TP group's followers run it already).
        if next_k > 0 || !jobs.is_empty() {
            let k = next_k;
            self.last_k = k;
            self.mark_mtp_holes(&jobs, k);
            if k > 0 {
                let (running, batch, sc, mem) = (&mut self.running, &mut self.batch, &mut self.scratch, &mut self.mtp);
                // Drafting gives the block tables back in its last pass, unless it fails.
                match draft(&mut self.backend, running, &jobs, batch, &out, sc, mem) {
                    Ok(fwd_us) => self.times.draft_forward_us += fwd_us,
                    Err(e) => draft_err = Some(e),
                }
                drafted = true;
            } else {
                // No MTP layer runs: the next windows hold the last token alone.
                for j in &jobs {
                    let s = &mut self.running[j.seq];
                    s.drafts.clear();
                    s.whole_mtp = 0;
                }
                self.mtp.skip();
            }
            let captured = self.backend.graph_captures() != captures_after_step;
            let draft_us = (self.backend.now() - t3).as_micros() as u64;
            tracing::trace!(k, draft_us, decode_only, captured, "drafting timed");
            self.policy.drafted(k, draft_us, decode_only && !captured);
        }
        if !drafted || draft_err.is_some() {
            self.return_tables();
        }
        let t4 = self.backend.now();
        self.times.draft_us += (t4 - t3).as_micros() as u64;
        if let Some(e) = &draft_err {
            tracing::error!(error = %e, "MTP drafting failed; failing the step's requests");
            for job in &jobs {
                let reason = if is_group_failure(e) {
                    FinishReason::Unavailable(format!("group failed: {e}"))
                } else {
                    FinishReason::Error(format!("drafting failed: {e}"))
                };
                finished.push((job.seq, reason));
            }
        }
        self.jobs = jobs;
        self.finish(finished, &mut events);
        self.register_prefixes();
        if let Some(e) = draft_err {
            self.note_backend_error(&e, &mut events);
        }
        self.times.verify_us += (self.backend.now() - t4).as_micros() as u64;
        events
    }

    /// The k of the pass that will follow this step's forward (0: none), chosen before
    /// it for the requests that will decode after it: the decode windows and the chunks
    /// that end their prompts (some may finish in the step; the forward has not said).
    fn choose_k(&mut self, decode_only: bool) -> usize {
        if self.lim.k == 0 {
            return 0;
        }
        let n_mtp = self.n_mtp;
        let decoding = self
            .running
            .iter()
            .filter(|s| matches!(s.sched, Some(Sched::Decode) | Some(Sched::Prefill { last: true, .. })))
            .map(|s| {
                let whole = if s.whole_mtp >= n_mtp { MAX_SPECULATIVE_TOKENS } else { s.whole_mtp };
                Counts { offered: &s.offered_at, accepted: &s.verified_at, whole }
            });
        self.policy.choose(decoding, decode_only)
    }

    /// Notes where the step leaves MTP entries that are not final, before it drafts
    /// with `k` drafts: every position from the chunk on when it runs fewer MTP layers
    /// than the engine uses, and the last positions drafted from in the previous step
    /// when the drafter cannot redo them (the request was left out of a step).
    fn mark_mtp_holes(&mut self, jobs: &[DraftJob], k: usize) {
        let used = self.n_mtp.min(self.lim.k);
        let step = self.mtp.step;
        for j in jobs {
            let s = &mut self.running[j.seq];
            let redone = s.mtp_tail.is_some_and(|t| t.step == step && t.next_start == j.start);
            let decode = matches!(s.sched, Some(Sched::Decode));
            if k < used || (decode && !redone) {
                s.holes_from = s.holes_from.min(j.start.saturating_sub(used));
            }
            if k < used {
                s.whole_mtp = s.whole_mtp.min(k);
            }
        }
    }

    /// Indexes the full blocks of the step's requests whose entries are final: below
    /// the cached positions, less what the drafter may still rewrite (the last `2K`
    /// MTP entries); those that reach an MTP hole as target-only. A registered block
    /// is never written again.
    fn register_prefixes(&mut self) {
        if !self.blocks.prefix_caching() {
            return;
        }
        let margin = if self.n_mtp.min(self.lim.k) > 0 { 2 * MAX_SPECULATIVE_TOKENS } else { 0 };
        for s in self.running.iter_mut().filter(|s| s.sched.is_some()) {
            register_upto(&mut self.blocks, s, s.num_cached.saturating_sub(margin));
        }
    }

    /// Indexes a request that finished normally up to its last cached position: nothing
    /// writes its blocks any more, so no margin is kept (its last MTP entries were
    /// marked as holes when it finished).
    fn register_finished(&mut self, s: &mut Sequence) {
        let Some(lookahead) = self.blocks.lookahead() else { return };
        let end = s.num_cached.min(s.tokens.len().saturating_sub(lookahead.max(1)));
        register_upto(&mut self.blocks, s, end);
    }

    /// Fills `self.batch` with the scheduled sequences' chunks, in running order, and
    /// returns its decode windows and the most drafts one holds (all hold as many, but
    /// for a request left out of the previous step, which keeps older drafts).
    ///
    /// Each chunk borrows its sequence's block table (a swap, not a copy) until
    /// [`Engine::return_tables`]; in between, the tables live in the batch and the
    /// sequences hold empty ones, so nothing may allocate or free blocks.
    fn build_batch(&mut self) -> (usize, usize) {
        let b = &mut self.batch;
        let mut n = 0;
        let (mut windows, mut k) = (0, 0);
        let mut row = 0u32;
        // Only the chosen token of a row comes back (computed by the backend, on the
        // device for the GPU): the argmax for greedy requests, a sample for the others,
        // with the uniform of the position the row decides — never the logits.
        b.clear_rows();
        for s in self.running.iter_mut().filter(|s| s.sched.is_some()) {
            let c = chunk_at(&mut b.seqs, n);
            n += 1;
            std::mem::swap(&mut c.block_table, &mut s.block_table);
            c.start_pos = s.num_cached;
            // Prompt tokens (a chunk never mixes them with generated ones: scheduler.rs).
            c.prefill = matches!(s.sched, Some(Sched::Prefill { .. })) && s.num_cached < s.prompt_len;
            // (first row, sequence index of the token it decides, rows)
            let rows = match s.sched {
                Some(Sched::Decode) => {
                    debug_assert_eq!(s.num_cached + 1, s.tokens.len(), "a decode window starts at the last token");
                    c.tokens.push(s.last_token);
                    c.tokens.extend_from_slice(s.drafts.as_slice());
                    k = k.max(s.drafts.as_slice().len());
                    windows += 1;
                    Some((row, s.num_cached + 1, c.tokens.len()))
                }
                Some(Sched::Prefill { len, last }) => {
                    c.tokens.extend_from_slice(&s.tokens[s.num_cached..s.num_cached + len]);
                    last.then(|| (row + len as u32 - 1, s.tokens.len(), 1))
                }
                None => None,
            };
            if let Some((first, pos, count)) = rows {
                if s.params.is_greedy() {
                    b.argmax_rows.extend(first..first + count as u32);
                } else {
                    b.sample_rows
                        .extend((0..count).map(|j| sample_row(first + j as u32, &s.params, s.seed, (pos + j) as u64)));
                }
                if let Some(top) = s.params.logprobs {
                    b.logprob_rows.extend((0..count as u32).map(|j| LogprobRow { row: first + j, top }));
                }
                if let Some(p) = &s.penalty {
                    // Row j of a window follows drafts d1..dj: they are the output when it counts
                    // (a prefill's one row follows none).
                    for j in 0..count {
                        let mut e = RowEdits { row: first + j as u32, edits: Vec::new() };
                        p.row_edits(&s.params, &s.drafts.as_slice()[..j], &mut e.edits);
                        b.edits.push(e);
                    }
                }
            }
            row += c.tokens.len() as u32;
        }
        b.seqs.truncate(n);
        (windows, k)
    }

    /// Gives the block tables lent by [`Engine::build_batch`] back to their sequences
    /// (the scheduled ones, in running order, as the batch's chunks are).
    fn return_tables(&mut self) {
        let scheduled = self.running.iter_mut().filter(|s| s.sched.is_some());
        for (c, s) in self.batch.seqs.iter_mut().zip(scheduled) {
            std::mem::swap(&mut c.block_table, &mut s.block_table);
        }
    }

    /// Verifies decode windows, samples after last prefill chunks, applies stop
    /// conditions, and collects the `Tokens` events and the drafting jobs of the
    /// sequences that go on.
    fn verify(
        &mut self,
        out: &ForwardOutput<B::Hidden>,
        events: &mut Vec<(RequestId, Event)>,
        finished: &mut Vec<(usize, FinishReason)>,
        jobs: &mut Vec<DraftJob>,
    ) {
        let k_max = self.lim.k;
        let used = self.n_mtp.min(k_max);
        // Cursors into the argmax ids (greedy requests) and the sampled ids (the others),
        // both in the order `build_batch` asked for them.
        let (argmax, sampled) = (&out.argmax, &out.sampled);
        // And into the log-probabilities (requests that asked for them), in the same order.
        let (mut arow, mut srow, mut lrow) = (0usize, 0usize, 0usize);
        for (idx, s) in self.running.iter_mut().enumerate() {
            let Some(sched) = s.sched else { continue };
            let start = s.num_cached;
            let mut fin = None;
            match sched {
                Sched::Decode => {
                    let k = s.drafts.as_slice().len();
                    let emitted = tokens_event(events, s.id, 1 + k);
                    let ids = if s.params.is_greedy() {
                        arow += 1 + k;
                        &argmax[arow - 1 - k..arow]
                    } else {
                        srow += 1 + k;
                        &sampled[srow - 1 - k..srow]
                    };
                    let accepted = verify_ids_into(ids, s.drafts.as_slice(), emitted);
                    // A stop condition cuts the run: nothing after the matching token.
                    let mut kept = emitted.len();
                    for (j, &tok) in emitted.iter().enumerate() {
                        fin = s.push_token(tok, &self.eos, self.max_model_len);
                        if fin.is_some() {
                            kept = j + 1;
                            break;
                        }
                    }
                    emitted.truncate(kept);
                    if s.params.logprobs.is_some() {
                        lrow += 1 + k;
                        let lp = out.logprobs[lrow - 1 - k..lrow][..kept].to_vec();
                        events.push((s.id, Event::Logprobs(lp)));
                    }
                    // Drafts accepted, and of those the ones emitted; counted without
                    // loops whose length depends on the outcome (mispredicted branches).
                    let emitted_drafts = accepted.min(kept);
                    s.usage.draft_tokens += k as u64;
                    s.usage.decode_steps += 1;
                    s.usage.accepted_tokens += emitted_drafts as u64;
                    for (j, (v, a)) in s.verified_at.iter_mut().zip(&mut s.accepted_at).enumerate() {
                        *v += (j < accepted) as u64;
                        *a += (j < emitted_drafts) as u64;
                    }
                    // Offered: drafts whose earlier ones were all accepted.
                    for o in &mut s.offered_at[..k.min(accepted + 1)] {
                        *o += 1;
                    }
                    // Positions whose MTP layers are whole measure the drafter's rate.
                    let whole = if s.whole_mtp >= self.n_mtp { k } else { s.whole_mtp };
                    self.policy.observe(k, accepted, whole);
                    s.num_cached = start + 1 + accepted;
                }
                Sched::Prefill { len, last } => {
                    s.num_cached = start + len;
                    if last {
                        let tok = if s.params.is_greedy() {
                            arow += 1;
                            argmax[arow - 1]
                        } else {
                            srow += 1;
                            sampled[srow - 1]
                        };
                        tokens_event(events, s.id, 1).push(tok);
                        if s.params.logprobs.is_some() {
                            lrow += 1;
                            events.push((s.id, Event::Logprobs(vec![out.logprobs[lrow - 1].clone()])));
                        }
                        fin = s.push_token(tok, &self.eos, self.max_model_len);
                        s.decoding = true;
                    }
                }
            }
            match fin {
                Some(reason) => {
                    // It drafts in this step's pass too (its drafts are dropped): its MTP
                    // entries from the last redone ones on are not final.
                    s.holes_from = s.holes_from.min(start.saturating_sub(used));
                    finished.push((idx, reason))
                }
                None if k_max > 0 => jobs.push(DraftJob { seq: idx, start }),
                None => {}
            }
        }
    }

    /// Fails every scheduled request after a target forward error (every request, when
    /// the error is the group's: [`Engine::note_backend_error`]).
    fn fail_scheduled(&mut self, e: &mlaserve_core::Error, events: &mut Vec<(RequestId, Event)>) {
        if is_group_failure(e) {
            self.note_backend_error(e, events);
            return;
        }
        tracing::error!(error = %e, "target forward failed; failing the step's requests");
        let failed: Vec<(usize, FinishReason)> = (0..self.running.len())
            .filter(|&i| self.running[i].sched.is_some())
            .map(|i| (i, FinishReason::Error(format!("forward failed: {e}"))))
            .collect();
        self.finish(failed, events);
    }

    /// A collective failure is permanent (the TP group lost a rank, or NCCL failed): fail
    /// every request, running or waiting, as [`FinishReason::Unavailable`], and refuse
    /// new ones.
    fn note_backend_error(&mut self, e: &mlaserve_core::Error, events: &mut Vec<(RequestId, Event)>) {
        if !is_group_failure(e) {
            return;
        }
        let why = e.to_string();
        tracing::error!(error = %why, "the tensor-parallel group failed; refusing new requests");
        let all: Vec<(usize, FinishReason)> =
            (0..self.running.len()).map(|i| (i, FinishReason::Unavailable(format!("group failed: {why}")))).collect();
        self.finish(all, events);
        while let Some(seq) = self.waiting.pop_front() {
            let ev = self.retire(seq, FinishReason::Unavailable(format!("group failed: {why}")));
            events.push(ev);
        }
        self.failed = Some(why);
    }

    /// Retires the finished sequences (indices into `running`), emitting their events.
    fn finish(&mut self, mut finished: Vec<(usize, FinishReason)>, events: &mut Vec<(RequestId, Event)>) {
        finished.sort_by_key(|f| std::cmp::Reverse(f.0));
        finished.dedup_by_key(|f| f.0);
        // Descending indices keep the remaining ones valid while removing.
        let mut evs = Vec::with_capacity(finished.len());
        for (idx, reason) in finished {
            let mut seq = self.running.remove(idx);
            if matches!(reason, FinishReason::Stop(_) | FinishReason::Length) {
                self.register_finished(&mut seq);
            }
            evs.push(self.retire(seq, reason));
        }
        evs.reverse();
        events.extend(evs);
    }

    /// Current load (cheap: one pass over the live requests).
    pub fn load(&self) -> Load {
        let outstanding = self.running.iter().chain(self.waiting.iter()).map(|s| s.outstanding_tokens()).sum();
        Load {
            queued_requests: self.waiting.len(),
            running_requests: self.running.len(),
            outstanding_tokens: outstanding,
            kv_blocks_free: self.blocks.num_free(),
            kv_blocks_total: self.blocks.total(),
        }
    }

    /// Load, token totals (finished plus live requests) and step times.
    pub fn stats(&self) -> EngineStats {
        let mut totals = self.finished_totals.clone();
        for s in self.running.iter().chain(self.waiting.iter()) {
            s.add_usage_to(&mut totals);
        }
        EngineStats {
            load: self.load(),
            num_speculative_tokens: self.lim.k,
            speculation: self.policy.stats(),
            prefix: self.blocks.prefix_stats(),
            totals,
            finished_requests: self.finished_requests,
            times: StepTimes { graph_captures: self.backend.graph_captures(), ..self.times },
            failed: self.failed.clone(),
        }
    }

    /// Checks the block accounting: the free list and the live tables partition the
    /// pool, and no waiting request holds blocks. For tests.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        if let Some(s) = self.waiting.iter().find(|s| !s.block_table.is_empty()) {
            return Err(format!("waiting request {} holds blocks", s.id));
        }
        self.blocks.check(self.running.iter().map(|s| s.block_table.as_slice()))
    }
}

#[path = "calibrate.rs"]
mod calibrate;
pub use calibrate::Calibration;

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
