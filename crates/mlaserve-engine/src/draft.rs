//! Padded MTP drafting (docs/engine.md, "Padded drafting"): the engine's side. It
//! describes the step's drafting pass from its requests (`mlaserve_core::drafting`
//! runs the stages, on every rank of a group) and hands the drafts back to them.
//!
//! Stage 0 runs MTP layer 0 once over every token of the step — decode windows and
//! prefill chunks alike — pairing the target hidden state of position `p` with the
//! token that follows `p`. For a decode window `[last, d1..dk]` at `L..=L+k` with `a`
//! drafts accepted, that token is `d_{j+1}` for `j < a`, the correction `c` for `j = a`,
//! and padding past it (those cache entries are overwritten by the next window). The
//! first draft is the argmax at window index `a` (at the last prompt position after a
//! prefill).
//!
//! Stage `d` (1..k−1) uses MTP layer `d` while the model has one, run the way it was
//! trained (DeepSeek's MTP): over the same rows as stage 0, at the same positions, with
//! stage `d − 1`'s hidden state of each row and the token `d + 1` ahead of it. Tokens
//! past the verified ones are this step's own drafts (`c`, then `d1`, `d2`, …): the row
//! at the accepted position reads exactly its draft input, and every earlier row's cache
//! entry is right as soon as those drafts are accepted. So each MTP layer's cache holds
//! an entry at every position — prompt included — instead of only at draft positions,
//! which is what keeps layers ≥ 1 as accurate as in training. When the model has fewer
//! MTP layers than `k`, later stages reuse the last layer as a chain (vLLM, TensorRT-LLM
//! "MTP Eagle"): one token per request at the next free position, so the reused layer's
//! own entries are not overwritten. Batch shapes never depend on `a`.

use crate::api::MAX_SPECULATIVE_TOKENS;
use crate::sequence::{Sched, Sequence};
pub(crate) use mlaserve_core::drafting::chunk_at;
use mlaserve_core::drafting::{shifted, ChunkKind, DraftPass, PassPlan, PlannedChunk, StageMemory, StageScratch};
use mlaserve_core::{Backend, Batch, MAX_DRAFT_SLOTS};
use std::time::Instant;

/// A scheduled sequence that goes on after the step.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DraftJob {
    /// Index into the running list.
    pub seq: usize,
    /// First cache position of the step's chunk.
    pub start: usize,
}

/// What the drafter keeps from one step to the next.
#[derive(Debug)]
pub(crate) struct MtpMemory<H> {
    /// Steps that drafted so far.
    pub step: u64,
    /// The stage outputs the next pass redoes stale entries from.
    pub stages: StageMemory<H>,
}

impl<H> MtpMemory<H> {
    /// A step without drafting (k = 0 next): the rows kept so far stop matching any
    /// request's next step.
    pub fn skip(&mut self) {
        self.step += 1;
    }
}

impl<H> Default for MtpMemory<H> {
    fn default() -> Self {
        MtpMemory { step: 0, stages: StageMemory::default() }
    }
}

/// Where a request's kept rows are in the previous pass's stage outputs (`StageMemory::prev`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MtpTail {
    /// The drafting step that kept them.
    pub step: u64,
    /// The request's first position in the next step.
    pub next_start: usize,
    /// Row in `prev[e]` of position `next_start − e − 1`.
    pub rows: [u32; MAX_SPECULATIVE_TOKENS],
}

/// Buffers reused by every step's drafting (no per-chunk allocation in steady state).
#[derive(Debug, Default)]
pub(crate) struct DraftScratch {
    /// The pass planned before this step's target forward.
    pub plan: PassPlan,
    pass: DraftPass,
    /// Per chunk of the pass: its request's index in the running list, and whether the
    /// request goes on after this step (it has a drafting job).
    owners: Vec<(usize, bool)>,
    stages: StageScratch,
}

/// Plans, before the step's target forward over `batch` (chunk `i` belongs to the
/// `i`-th scheduled sequence of `running`), the pass that will follow it with `k`
/// drafts, into `plan`.
pub(crate) fn plan_pass<B: Backend>(
    backend: &B,
    running: &[Sequence],
    batch: &Batch,
    k: usize,
    n_mtp: usize,
    mem: &MtpMemory<B::Hidden>,
    plan: &mut PassPlan,
) {
    plan.k = k;
    plan.n_mtp = n_mtp;
    plan.chunks.clear();
    plan.beyond.clear();
    let n_full = plan.full_stages();
    // The pass will be drafting step `mem.step + 1`.
    let step = mem.step + 1;
    let scheduled = running.iter().filter(|s| s.sched.is_some());
    for (c, s) in batch.seqs.iter().zip(scheduled) {
        let kind = match s.sched {
            Some(Sched::Prefill { last: false, .. }) => ChunkKind::Mid,
            Some(Sched::Prefill { last: true, .. }) => ChunkKind::Last,
            _ => ChunkKind::Window,
        };
        let tail = s.mtp_tail.filter(|t| t.step + 1 == step && t.next_start == c.start_pos);
        let n_tok = s.tokens.len();
        if kind == ChunkKind::Mid {
            let end = c.start_pos + c.tokens.len();
            plan.beyond.extend_from_slice(&s.tokens[end..end + plan.beyond_len(end, n_tok)]);
        }
        plan.chunks.push(PlannedChunk {
            kind,
            cont: tail.is_some(),
            kept: tail.map_or([0; MAX_SPECULATIVE_TOKENS], |t| t.rows),
            // A drafting request that redoes its positions at every stage builds each
            // stage's tokens from the previous stage's; the others read `next_tokens`.
            in_place: kind != ChunkKind::Mid && tail.is_some() && mem.stages.prev.len() + 1 >= n_full,
            n_tok,
            last_tok: s.last_token,
        });
    }
    // Drafts stay on the device between the stages where the backend can keep them (a
    // pass of prompt chunks short of their prompts' ends drafts nothing and reads none).
    let m = plan.drafting();
    plan.keep = backend.keeps_drafts() && m > 0 && m * k <= MAX_DRAFT_SLOTS;
}

/// Runs the pass planned before the step's forward (`sc.plan`) and stores k drafts in
/// each sequence of `jobs` that has a draft row. `batch` is the step's target batch
/// (its chunks hold the scheduled sequences' block tables, lent by
/// `Engine::build_batch`), `argmax` and `sampled` the forward's choices; stage 0 reuses
/// the batch in place, tokens shifted, so the block tables are not copied again. On
/// success the tables are back in their sequences; on an error they are still in
/// `batch`. `jobs` are in running order, one per scheduled sequence that goes on.
/// Sequences that finished in this step draft too (the plan was made before the forward
/// said who finishes) and get no drafts. Returns the microseconds spent inside the
/// backend.
pub(crate) fn draft<B: Backend>(
    backend: &mut B,
    running: &mut [Sequence],
    jobs: &[DraftJob],
    batch: &mut Batch,
    out: &mlaserve_core::ForwardOutput<B::Hidden>,
    sc: &mut DraftScratch,
    mem: &mut MtpMemory<B::Hidden>,
) -> Result<u64, mlaserve_core::Error> {
    mem.step += 1;
    let step = mem.step;
    let DraftScratch { plan, pass, owners, stages } = sc;
    let (k, n_full) = (plan.k, plan.full_stages());
    plan.resolve(batch, &out.argmax, &out.sampled, pass)?;
    owners.clear();
    pass.check.clear();
    // Jobs and chunks are both in running order: walk them together.
    let mut next_job = jobs.iter().peekable();
    let scheduled = running.iter().enumerate().filter(|(_, s)| s.sched.is_some());
    for (c, (idx, s)) in batch.seqs.iter().zip(scheduled) {
        let going_on = next_job.next_if(|j| j.seq == idx).is_some();
        owners.push((idx, going_on));
        if cfg!(debug_assertions) {
            // The stages' tokens are checked against the sequences that go on (a
            // finished one's tokens stop at its stop condition; its drafts are dropped).
            let whole = if going_on { s.tokens.clone() } else { Vec::new() };
            if going_on {
                debug_assert_eq!(c.tokens, shifted(&whole, &[], c.start_pos + 1, c.tokens.len()), "stage 0");
            }
            pass.check.push(whole);
        }
    }
    debug_assert!(next_job.next().is_none(), "every job has a scheduled chunk, in running order");
    let mut backend_us = backend.draft_stages(pass, batch, &out.hidden, &mut mem.stages, stages)?;
    if pass.keep {
        // The one wait of the pass: every draft's id, slot i × k + d.
        let t = Instant::now();
        let ids = backend.read_drafts(plan.drafting() * k)?;
        backend_us += t.elapsed().as_micros() as u64;
        stages.set_drafts(&ids)?;
    }
    // One pass over the requests: their block tables back, their drafts, and (with
    // several full stages) the rows kept for the next step: for a request that goes on,
    // the row of each stage e < n_full − 1 at position `next_start − e − 1`, the input
    // the next step's stage e + 1 needs to redo its stale entries.
    let mut offs = [0usize; MAX_SPECULATIVE_TOKENS];
    for ((ch, &(idx, going_on)), c) in pass.chunks.iter().zip(owners.iter()).zip(&mut batch.seqs) {
        let s = &mut running[idx];
        std::mem::swap(&mut c.block_table, &mut s.block_table);
        if let (Some(ci), true) = (ch.chain, going_on) {
            s.drafts.set(&stages.drafts()[ci * k..(ci + 1) * k]);
        }
        if n_full > 1 {
            let mut tail = MtpTail { step, next_start: s.num_cached, rows: [0; MAX_SPECULATIVE_TOKENS] };
            let mut ok = going_on;
            for (e, off) in offs[..n_full - 1].iter_mut().enumerate() {
                let lo = ch.start - ch.ext[e];
                let p = s.num_cached as isize - e as isize - 1;
                if p < lo as isize || p >= (ch.start + ch.len) as isize {
                    ok = false;
                } else {
                    tail.rows[e] = (*off + p as usize - lo) as u32;
                }
                *off += ch.len + ch.ext[e];
            }
            s.mtp_tail = if ok { Some(tail) } else { None };
        }
    }
    Ok(backend_us)
}
