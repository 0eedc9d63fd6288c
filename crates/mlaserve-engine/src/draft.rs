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
use crate::sequence::Sequence;
pub(crate) use mlaserve_core::drafting::chunk_at;
use mlaserve_core::drafting::{fill_tokens, shifted, DraftChunk, DraftPass, StageMemory, StageScratch};
use mlaserve_core::{Backend, Batch, MAX_DRAFT_SLOTS};
use std::time::Instant;

/// One sequence's share of the step, for drafting.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DraftJob {
    /// Index into the running list.
    pub seq: usize,
    /// First cache position of the step's chunk.
    pub start: usize,
    /// First row of the chunk in the target forward's output.
    pub target_row: usize,
    /// Window index whose MTP logits give the first draft; `None` for a prefill chunk
    /// that does not reach the end of the prompt (it only fills the MTP cache).
    pub draft_off: Option<usize>,
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
    pass: DraftPass,
    /// Per chunk of the pass: its request's index in the running list, and whether the
    /// request goes on after this step (it has a drafting job).
    owners: Vec<(usize, bool)>,
    stages: StageScratch,
}

/// Runs the MTP stages and stores k drafts in each sequence of `jobs` that has a
/// draft row. `batch` is the step's target batch (chunk `i` belongs to the `i`-th
/// scheduled sequence of `running`, and holds its block table, lent by
/// `Engine::build_batch`); stage 0 reuses it in place, tokens shifted, so the block
/// tables are not copied again. On success the tables are back in their sequences; on
/// an error they are still in `batch`. `jobs` are in running order, one per scheduled
/// sequence that goes on. Sequences that finished in this step ride along in stage 0
/// (their rows are padding) and get no drafts. Returns the microseconds spent inside
/// the backend.
pub(crate) fn draft<B: Backend>(
    backend: &mut B,
    running: &mut [Sequence],
    jobs: &[DraftJob],
    batch: &mut Batch,
    target_hidden: &B::Hidden,
    k: usize,
    n_mtp: usize,
    sc: &mut DraftScratch,
    mem: &mut MtpMemory<B::Hidden>,
) -> Result<u64, mlaserve_core::Error> {
    mem.step += 1;
    let step = mem.step;
    // Stages that run over full rows with their own MTP layer.
    let n_full = n_mtp.min(k);
    let DraftScratch { pass, owners, stages } = sc;
    pass.chunks.clear();
    pass.next_tokens.clear();
    pass.check.clear();
    owners.clear();
    // Drafts are argmaxes: the backend returns those ids, never the logits.
    batch.logit_rows.clear();
    batch.argmax_rows.clear();
    batch.sample_rows.clear();
    batch.edits.clear();
    batch.logprob_rows.clear();
    // Jobs and chunks are both in running order: walk them together.
    let mut next_job = jobs.iter().peekable();
    let mut m = 0usize;
    let scheduled = running.iter().enumerate().filter(|(_, s)| s.sched.is_some());
    for (c, (idx, s)) in batch.seqs.iter_mut().zip(scheduled) {
        let job = next_job.next_if(|j| j.seq == idx);
        let draft_off = job.and_then(|j| j.draft_off);
        if let (Some(job), Some(off)) = (job, draft_off) {
            batch.argmax_rows.push((job.target_row + off) as u32);
            m += 1;
        }
        let tail = s.mtp_tail.filter(|t| t.step + 1 == step && t.next_start == c.start_pos);
        let n_tok = s.tokens.len();
        let tok_off = pass.next_tokens.len();
        // A drafting request that redoes its positions at every stage builds each
        // stage's tokens from the previous stage's; the others read these.
        let in_place = draft_off.is_some() && tail.is_some() && mem.stages.prev.len() + 1 >= n_full;
        if n_full > 1 && !in_place {
            // Stage d reads sequence indices start + 1 ..= start + len + d.
            let end = (c.start_pos + c.tokens.len() + n_full).min(n_tok);
            pass.next_tokens.extend_from_slice(&s.tokens[c.start_pos + 1..end]);
        }
        pass.chunks.push(DraftChunk {
            start: c.start_pos,
            len: c.tokens.len(),
            cont: tail.is_some(),
            draft_off,
            kept: tail.map_or([0; MAX_SPECULATIVE_TOKENS], |t| t.rows),
            n_tok,
            last_tok: s.last_token,
            tok_off,
            ..Default::default()
        });
        owners.push((idx, job.is_some()));
        if cfg!(debug_assertions) {
            pass.check.push(s.tokens.clone());
        }
        // Embedding input of position p: the token after it (padded), i.e.
        // `tokens[min(p + 1, len − 1)]`.
        let len = c.tokens.len();
        match draft_off {
            // The chunk's tokens up to the draft row were verified (accepted drafts, or
            // the prompt), the sampled token follows them: shift, then pad with it.
            Some(off) => {
                c.tokens.copy_within(1..=off, 0);
                c.tokens[off..].fill(s.last_token);
            }
            None => {
                let after = &s.tokens[c.start_pos + 1..(c.start_pos + 1 + len).min(n_tok)];
                fill_tokens(&mut c.tokens, len, after, &[], s.last_token);
            }
        }
        debug_assert_eq!(c.tokens, shifted(&s.tokens, &[], c.start_pos + 1, len), "stage 0");
    }
    debug_assert!(next_job.next().is_none(), "every job has a scheduled chunk, in running order");
    pass.k = k;
    pass.n_mtp = n_mtp;
    // Drafts stay on the device between the stages where the backend can keep them (a
    // pass of prompt chunks short of their prompts' ends drafts nothing and reads none).
    pass.keep = backend.keeps_drafts() && m > 0 && m * k <= MAX_DRAFT_SLOTS;
    let mut backend_us = backend.draft_stages(pass, batch, target_hidden, &mut mem.stages, stages)?;
    if pass.keep {
        // The one wait of the pass: every draft's id, slot i × k + d.
        let t = Instant::now();
        let ids = backend.read_drafts(m * k)?;
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
        if let Some(ci) = ch.chain {
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
