//! Padded MTP drafting (docs/engine.md, "Padded drafting").
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
use mlaserve_core::{Backend, Batch, SeqChunk, MAX_DRAFT_SLOTS};
use std::time::Instant;

/// On a backend that keeps a pass's drafts ([`Backend::keeps_drafts`]), the drafts in
/// [`DraftScratch::drafts`] are references to their slots, `KEPT | slot` (slot
/// `i × k + d`: chain entry i's draft d), not ids; token ids are below the vocabulary,
/// far below this bit. The stages copy them into their tokens as they copy ids;
/// [`link_drafts`] turns them into [`Batch::draft_links`] for the call.
const KEPT: u32 = 1 << 31;

/// Moves the slot references out of `batch`'s tokens into its links for the backend
/// call (the tokens there get a placeholder, 0); [`unlink_drafts`] puts them back
/// (stage d + 1 builds its tokens from stage d's).
fn link_drafts(batch: &mut Batch) {
    batch.draft_links.clear();
    let mut row = 0u32;
    for c in &mut batch.seqs {
        for t in &mut c.tokens {
            if *t & KEPT != 0 {
                batch.draft_links.push((row, *t & !KEPT));
                *t = 0;
            }
            row += 1;
        }
    }
}

/// Undoes [`link_drafts`].
fn unlink_drafts(batch: &mut Batch) {
    let mut links = batch.draft_links.iter().peekable();
    let mut row = 0u32;
    for c in &mut batch.seqs {
        for t in &mut c.tokens {
            if let Some(&(_, slot)) = links.next_if(|&&(r, _)| r == row) {
                *t = KEPT | slot;
            }
            row += 1;
        }
    }
    batch.draft_links.clear();
}

/// One MTP call of a pass: with kept drafts, the batch's draft tokens go as links and
/// its argmax ids into slots `i × k + d` (chain entry i, draft d), and the call returns
/// no ids; else the ids come back.
fn mtp_call<B: Backend>(
    backend: &mut B,
    layer: usize,
    batch: &mut Batch,
    prev: &B::Hidden,
    rows: &[u32],
    keep: Option<(usize, usize)>,
) -> Result<mlaserve_core::ForwardOutput<B::Hidden>, mlaserve_core::Error> {
    batch.argmax_slots.clear();
    let Some((d, k)) = keep else {
        return backend.mtp_forward(layer, batch, prev, rows);
    };
    batch.argmax_slots.extend((0..batch.argmax_rows.len()).map(|i| (i * k + d) as u32));
    link_drafts(batch);
    let out = backend.mtp_forward(layer, batch, prev, rows);
    unlink_drafts(batch);
    batch.argmax_slots.clear();
    out
}

/// Stores stage `d`'s drafts of the `m` chain entries: their ids (`argmax`, in chain
/// order) or, kept on the device, their slots.
fn store_drafts(drafts: &mut [u32], argmax: &[u32], m: usize, k: usize, d: usize, keep: bool) {
    for i in 0..m {
        drafts[i * k + d] = if keep { KEPT | (i * k + d) as u32 } else { argmax[i] };
    }
}

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
    /// The previous step's outputs of stages `0..n_full − 1`.
    pub prev: Vec<H>,
    /// An empty list whose buffer the next step fills with its stage outputs.
    spare: Vec<H>,
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
        MtpMemory { step: 0, prev: Vec::new(), spare: Vec::new() }
    }
}

/// Where a request's kept rows are in [`MtpMemory::prev`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct MtpTail {
    /// The drafting step that kept them.
    pub step: u64,
    /// The request's first position in the next step.
    pub next_start: usize,
    /// Row in `prev[e]` of position `next_start − e − 1`.
    pub rows: [u32; MAX_SPECULATIVE_TOKENS],
}

/// One scheduled chunk of the step, as the drafter sees it. Everything the stage loops
/// need about the request except its tokens, so they touch the sequence once.
#[derive(Debug, Clone, Copy)]
struct ChunkInfo {
    /// Index into the running list.
    idx: usize,
    start: usize,
    len: usize,
    /// The request drafted in the previous step and starts where it said it would.
    cont: bool,
    /// The request goes on after this step (it has a drafting job).
    going_on: bool,
    draft_off: Option<usize>,
    /// Index into the chain (and the drafts) when the request drafts in this step.
    chain: Option<usize>,
    /// The request's kept rows (its [`MtpTail::rows`]), valid when `cont`.
    kept: [u32; MAX_SPECULATIVE_TOKENS],
    /// Positions redone before `start`, per stage.
    ext: [usize; MAX_SPECULATIVE_TOKENS],
    /// The request's token count and last token after this step's verification.
    n_tok: usize,
    last_tok: u32,
    /// Where its tokens from sequence index `start + 1` on are in
    /// [`DraftScratch::next_tokens`].
    tok_off: usize,
}

/// A request that drafts in this step.
#[derive(Debug, Clone, Copy)]
struct ChainEntry {
    /// Index of its chunk in the step's batch.
    chunk: usize,
    /// Position of its stage-0 draft row.
    pos0: usize,
}

/// Buffers reused by every step's drafting (no per-chunk allocation in steady state).
#[derive(Debug, Default)]
pub(crate) struct DraftScratch {
    /// The single-token batch of the reused-layer stages.
    batch: Batch,
    hidden_rows: Vec<u32>,
    chain: Vec<ChainEntry>,
    /// `chain.len() × k` drafts, row-major.
    drafts: Vec<u32>,
    chunks: Vec<ChunkInfo>,
    /// Kept rows (of the previous step's stage d − 1) joined into stage d's input.
    kept: Vec<u32>,
    /// Per chunk, the tokens after its first position that stages 1.. read (copied
    /// once, while stage 0 has them in cache; the stages then read one flat buffer).
    next_tokens: Vec<u32>,
    /// `0, 1, 2, …`: row lists that select every row, as slices of one buffer.
    identity: Vec<u32>,
}

/// The rows `0..n`, from `buf` (grown as needed).
fn identity(buf: &mut Vec<u32>, n: usize) -> &[u32] {
    if buf.len() < n {
        let from = buf.len() as u32;
        buf.extend(from..n as u32);
    }
    &buf[..n]
}

/// Sets `out` to `n` tokens: `tokens`, then `drafts`, then `pad` repeated (written in
/// place: no per-token `push`).
fn fill_tokens(out: &mut Vec<u32>, n: usize, tokens: &[u32], drafts: &[u32], pad: u32) {
    out.resize(n, pad);
    let (head, rest) = out.split_at_mut(tokens.len());
    head.copy_from_slice(tokens);
    let (mid, tail) = rest.split_at_mut(drafts.len());
    mid.copy_from_slice(drafts);
    tail.fill(pad);
}

/// Sets `out` to the `n` tokens of `ch`'s chunk whose row i reads sequence index
/// `first + i` of `tokens ++ drafts`, clamped at its end: some tokens (from the
/// chunk's `next_tokens`, which start at sequence index start + 1), then drafts, then
/// the last one again.
fn fill_shifted(out: &mut Vec<u32>, ch: &ChunkInfo, first: usize, n: usize, next: &[u32], drafts: &[u32], last: u32) {
    let from_tokens = ch.n_tok.saturating_sub(first).min(n);
    let from = ch.tok_off + first - ch.start - 1;
    let first_draft = (first + from_tokens).saturating_sub(ch.n_tok).min(drafts.len());
    let from_drafts = (n - from_tokens).min(drafts.len() - first_draft);
    let tokens = if from_tokens > 0 { &next[from..from + from_tokens] } else { &[] };
    fill_tokens(out, n, tokens, &drafts[first_draft..first_draft + from_drafts], last);
}

/// Row i of `n`: sequence index `first + i` of `tokens ++ drafts`, clamped at its end
/// (what [`fill_shifted`] and the in-place updates produce, checked in debug builds).
fn shifted(tokens: &[u32], drafts: &[u32], first: usize, n: usize) -> Vec<u32> {
    let end = tokens.len() + drafts.len() - 1;
    let at = |j: usize| tokens.get(j).copied().unwrap_or_else(|| drafts[j - tokens.len()]);
    (first..first + n).map(|j| at(j.min(end))).collect()
}

/// The `n`-th chunk of `seqs`, emptied, reusing its buffers.
pub(crate) fn chunk_at(seqs: &mut Vec<SeqChunk>, n: usize) -> &mut SeqChunk {
    if seqs.len() <= n {
        seqs.resize_with(n + 1, SeqChunk::default);
    }
    let c = &mut seqs[n];
    c.tokens.clear();
    c.block_table.clear();
    c.prefill = false;
    c
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
    sc.chunks.clear();
    sc.chain.clear();
    sc.next_tokens.clear();
    // Drafts are argmaxes: the backend returns those ids, never the logits.
    batch.logit_rows.clear();
    batch.argmax_rows.clear();
    batch.sample_rows.clear();
    batch.edits.clear();
    batch.logprob_rows.clear();
    // Jobs and chunks are both in running order: walk them together.
    let mut next_job = jobs.iter().peekable();
    let mut rows = 0usize;
    let scheduled = running.iter().enumerate().filter(|(_, s)| s.sched.is_some());
    for (ci, (c, (idx, s))) in batch.seqs.iter_mut().zip(scheduled).enumerate() {
        let job = next_job.next_if(|j| j.seq == idx);
        let draft_off = job.and_then(|j| j.draft_off);
        let chain = match (job, draft_off) {
            (Some(job), Some(off)) => {
                batch.argmax_rows.push((job.target_row + off) as u32);
                sc.chain.push(ChainEntry { chunk: ci, pos0: job.start + off });
                Some(sc.chain.len() - 1)
            }
            _ => None,
        };
        let tail = s.mtp_tail.filter(|t| t.step + 1 == step && t.next_start == c.start_pos);
        let n_tok = s.tokens.len();
        let tok_off = sc.next_tokens.len();
        // A drafting request that redoes its positions at every stage builds each
        // stage's tokens from the previous stage's (below); the others read these.
        let in_place = chain.is_some() && tail.is_some() && mem.prev.len() + 1 >= n_full;
        if n_full > 1 && !in_place {
            // Stage d reads sequence indices start + 1 ..= start + len + d.
            let end = (c.start_pos + c.tokens.len() + n_full).min(n_tok);
            sc.next_tokens.extend_from_slice(&s.tokens[c.start_pos + 1..end]);
        }
        sc.chunks.push(ChunkInfo {
            idx,
            start: c.start_pos,
            len: c.tokens.len(),
            cont: tail.is_some(),
            going_on: job.is_some(),
            draft_off,
            chain,
            kept: tail.map_or([0; MAX_SPECULATIVE_TOKENS], |t| t.rows),
            ext: [0; MAX_SPECULATIVE_TOKENS],
            n_tok,
            last_tok: s.last_token,
            tok_off,
        });
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
        rows += len;
    }
    debug_assert!(next_job.next().is_none(), "every job has a scheduled chunk, in running order");
    let m = sc.chain.len();
    // Drafts stay on the device between the stages where the backend can keep them (a
    // pass of prompt chunks short of their prompts' ends drafts nothing and reads none).
    let keep = backend.keeps_drafts() && m > 0 && m * k <= MAX_DRAFT_SLOTS;
    let keep_at = |d: usize| keep.then_some((d, k));
    let t = Instant::now();
    let out = mtp_call(backend, 0, batch, target_hidden, identity(&mut sc.identity, rows), keep_at(0))?;
    let mut backend_us = t.elapsed().as_micros() as u64;
    sc.drafts.clear();
    sc.drafts.resize(m * k, 0);
    store_drafts(&mut sc.drafts, &out.argmax, m, k, 0, keep);
    let mut outs = std::mem::take(&mut mem.spare);
    outs.clear();
    outs.push(out.hidden);
    for d in 1..n_full {
        // Full rows at the same positions, tokens d + 1 ahead (this step's drafts past
        // the verified ones). A request that drafted in the previous step also redoes
        // its last d positions, whose entries were computed from drafts then: their
        // hidden input is the row kept from the previous step's stage d − 1, which
        // lands after all of stage d − 1's rows in the joined hidden state.
        let prev_kept = mem.prev.get(d - 1);
        let n_a = rows as u32;
        let DraftScratch { hidden_rows, kept, next_tokens, chunks, drafts, .. } = &mut *sc;
        // Written in place: at most one kept row per chunk, one logit row per draft.
        hidden_rows.clear();
        hidden_rows.resize(rows + chunks.len(), 0);
        kept.clear();
        kept.resize(chunks.len(), 0);
        batch.argmax_rows.clear();
        batch.argmax_rows.resize(m, 0);
        let (mut n_hidden, mut n_kept, mut n_logits) = (0usize, 0usize, 0usize);
        let (mut off_prev, mut row) = (0u32, 0u32);
        for (c, ch) in batch.seqs.iter_mut().zip(chunks.iter_mut()) {
            // With the previous step's row of stage d − 1 at `start − d`, redo that
            // position too; without it (that step drafted fewer stages), stage d starts
            // where stage d − 1 did.
            let with_kept = ch.cont && prev_kept.is_some() && ch.ext[d - 1] == d - 1;
            let ext = if with_kept { d } else { ch.ext[d - 1] };
            ch.ext[d] = ext;
            if with_kept {
                hidden_rows[n_hidden] = n_a + n_kept as u32;
                kept[n_kept] = ch.kept[d - 1];
                n_hidden += 1;
                n_kept += 1;
            }
            let prev_len = ch.len + ch.ext[d - 1];
            for (h, r) in hidden_rows[n_hidden..n_hidden + prev_len].iter_mut().zip(off_prev..) {
                *h = r;
            }
            n_hidden += prev_len;
            off_prev += prev_len as u32;
            c.start_pos = ch.start - ext;
            let drafts: &[u32] = match ch.chain {
                Some(ci) => &drafts[ci * k..ci * k + d],
                None => &[],
            };
            // Row i reads sequence index start_pos + i + d + 1 of `tokens ++ drafts`,
            // clamped at its end.
            let n = ch.len + ext;
            let last = drafts.last().copied().unwrap_or(ch.last_tok);
            if ext == d {
                // Row i reads index start + 1 + i at every stage that redid its
                // positions (stage 0 included): stage d − 1's rows, except that
                // `tokens ++ drafts` grew by this step's draft d, and one row more.
                let n_next = ch.n_tok - ch.start - 1;
                if drafts.is_empty() {
                    let i = n - 1;
                    c.tokens.push(if i < n_next { next_tokens[ch.tok_off + i] } else { last });
                } else {
                    debug_assert!(n_next <= ch.len, "a drafting chunk ends at the last token");
                    c.tokens.truncate(n_next + d - 1);
                    c.tokens.resize(n, last);
                }
            } else {
                fill_shifted(&mut c.tokens, ch, c.start_pos + d + 1, n, next_tokens, drafts, last);
            }
            debug_assert_eq!(c.tokens, shifted(&running[ch.idx].tokens, drafts, c.start_pos + d + 1, n), "stage {d}");
            if let Some(off) = ch.draft_off {
                batch.argmax_rows[n_logits] = row + (ext + off) as u32;
                n_logits += 1;
            }
            row += n as u32;
        }
        debug_assert_eq!((n_hidden, n_logits), (row as usize, m), "one hidden row per token, one logit row per draft");
        hidden_rows.truncate(n_hidden);
        kept.truncate(n_kept);
        batch.argmax_rows.truncate(n_logits);
        rows = row as usize;
        let input;
        let prev: &B::Hidden = if sc.kept.is_empty() {
            &outs[d - 1]
        } else {
            let kept_h = prev_kept.ok_or_else(|| mlaserve_core::Error::Batch("no kept MTP rows".into()))?;
            let t = Instant::now();
            let all = identity(&mut sc.identity, n_a as usize);
            input = backend.concat_hidden(&[(&outs[d - 1], all), (kept_h, &sc.kept)])?;
            backend_us += t.elapsed().as_micros() as u64;
            &input
        };
        let t = Instant::now();
        let out = mtp_call(backend, d, batch, prev, &sc.hidden_rows, keep_at(d))?;
        backend_us += t.elapsed().as_micros() as u64;
        store_drafts(&mut sc.drafts, &out.argmax, m, k, d, keep);
        outs.push(out.hidden);
    }
    let last_out = outs.pop().ok_or_else(|| mlaserve_core::Error::Batch("no MTP stage ran".into()))?;
    if n_full < k && m > 0 {
        // The reused last layer runs on its own batch of the drafting requests, which
        // borrows their block tables from `batch` and gives them back, error or not.
        for (i, e) in sc.chain.iter().enumerate() {
            let c = chunk_at(&mut sc.batch.seqs, i);
            c.tokens.push(0);
            std::mem::swap(&mut c.block_table, &mut batch.seqs[e.chunk].block_table);
        }
        sc.batch.seqs.truncate(m);
        let r = chain_stages(backend, sc, &batch.argmax_rows, last_out, k, n_mtp, keep);
        for (c, e) in sc.batch.seqs.iter_mut().zip(&sc.chain) {
            std::mem::swap(&mut c.block_table, &mut batch.seqs[e.chunk].block_table);
        }
        backend_us += r?;
    }
    if keep {
        // The one wait of the pass: every draft's id, slot i × k + d.
        let t = Instant::now();
        let ids = backend.read_drafts(m * k)?;
        backend_us += t.elapsed().as_micros() as u64;
        if ids.len() != m * k {
            return Err(mlaserve_core::Error::Backend(format!("{} draft ids for {} slots", ids.len(), m * k)));
        }
        sc.drafts.copy_from_slice(&ids);
    }
    // One pass over the requests: their block tables back, their drafts, and (with
    // several full stages) the rows kept for the next step: for a request that goes on,
    // the row of each stage e < n_full − 1 at position `next_start − e − 1`, the input
    // the next step's stage e + 1 needs to redo its stale entries.
    let mut offs = [0usize; MAX_SPECULATIVE_TOKENS];
    for (ch, c) in sc.chunks.iter().zip(&mut batch.seqs) {
        let s = &mut running[ch.idx];
        std::mem::swap(&mut c.block_table, &mut s.block_table);
        if let Some(ci) = ch.chain {
            s.drafts.set(&sc.drafts[ci * k..(ci + 1) * k]);
        }
        if n_full > 1 {
            let mut tail = MtpTail { step, next_start: s.num_cached, rows: [0; MAX_SPECULATIVE_TOKENS] };
            let mut ok = ch.going_on;
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
    if n_full > 1 {
        std::mem::swap(&mut mem.prev, &mut outs);
    }
    outs.clear();
    mem.spare = outs;
    Ok(backend_us)
}

/// Stages `n_full..k` with the last MTP layer reused (vLLM, TensorRT-LLM "MTP Eagle"):
/// one token per drafting request — the previous draft — at the next free position,
/// so the reused layer's own entries at the window positions are not overwritten.
/// `sc.batch` holds one chunk per chain entry; `draft_rows` are the last full stage's
/// rows of the chain (its logit rows), `prev_hidden` that stage's output. Returns the
/// microseconds spent inside the backend.
fn chain_stages<B: Backend>(
    backend: &mut B,
    sc: &mut DraftScratch,
    draft_rows: &[u32],
    mut prev_hidden: B::Hidden,
    k: usize,
    n_mtp: usize,
    keep: bool,
) -> Result<u64, mlaserve_core::Error> {
    let m = sc.chain.len();
    let mut backend_us = 0;
    sc.batch.logit_rows.clear();
    sc.batch.sample_rows.clear();
    sc.batch.edits.clear();
    sc.batch.logprob_rows.clear();
    sc.batch.argmax_rows.clear();
    sc.batch.argmax_rows.extend_from_slice(identity(&mut sc.identity, m));
    for d in n_mtp.min(k)..k {
        let shift = d + 1 - n_mtp;
        for (i, (c, e)) in sc.batch.seqs.iter_mut().zip(&sc.chain).enumerate() {
            c.tokens[0] = sc.drafts[i * k + d - 1];
            c.start_pos = e.pos0 + shift;
        }
        let rows = if d == n_mtp.min(k) { draft_rows } else { &sc.identity[..m] };
        let t = Instant::now();
        let out = mtp_call(backend, n_mtp - 1, &mut sc.batch, &prev_hidden, rows, keep.then_some((d, k)))?;
        backend_us += t.elapsed().as_micros() as u64;
        store_drafts(&mut sc.drafts, &out.argmax, m, k, d, keep);
        prev_hidden = out.hidden;
    }
    Ok(backend_us)
}
