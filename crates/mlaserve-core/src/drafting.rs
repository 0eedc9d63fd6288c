//! A drafting pass's MTP stages, as code every rank of a group runs.
//!
//! The engine describes the pass once — a [`DraftPass`] (per chunk: where it starts,
//! which window row gives its first draft, the rows kept from the previous pass, the
//! tokens its later stages read) and the stage-0 batch — and [`run_stages`] builds every
//! later stage's batch from them and runs the stages on a backend, the drafts of one
//! stage feeding the next. A tensor-parallel leader sends that description to its
//! followers as one plan ([`Backend::draft_stages`]); each follower runs the same
//! function on its shard, with drafts it computes itself (every rank computes the same
//! argmax ids from the same all-gathered logits), so a pass crosses once whatever k.
//!
//! Stage 0 runs MTP layer 0 over every token of the step. Stage `d` (1..k−1) uses MTP
//! layer `d` while the model has one, over the same rows at the same positions with the
//! tokens `d + 1` ahead; a request that drafted in the previous pass also redoes its
//! last `d` positions, from the row of stage `d − 1` kept then. When the model has
//! fewer MTP layers than `k`, later stages reuse the last layer as a chain: one token
//! per request at the next free position.

use crate::backend::{Backend, Batch, ForwardOutput, SeqChunk, MAX_DRAFT_SLOTS};
use crate::error::{Error, Result};
use std::time::Instant;

/// The most drafts a pass makes per request.
pub const MAX_DRAFTS: usize = 4;

/// On a backend that keeps a pass's drafts ([`Backend::keeps_drafts`]), the drafts in
/// [`StageScratch::drafts`] are references to their slots, `KEPT | slot` (slot
/// `i × k + d`: chain entry i's draft d), not ids; token ids are below the vocabulary,
/// far below this bit. The stages copy them into their tokens as they copy ids, and
/// turn them into [`Batch::draft_links`] for each call.
pub const KEPT: u32 = 1 << 31;

/// One chunk of the step's batch, as the stages see it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DraftChunk {
    /// First cache position of the chunk.
    pub start: usize,
    pub len: usize,
    /// The request drafted in the previous pass and starts where it said it would.
    pub cont: bool,
    /// Window index whose stage-0 logits give the first draft; `None` for a chunk
    /// that drafts nothing (a prompt chunk short of its prompt's end, a request that
    /// finished in this step).
    pub draft_off: Option<usize>,
    /// The request's rows kept by the previous pass: entry `e`, row of stage `e`'s
    /// output at position `start − e − 1` (valid when `cont`).
    pub kept: [u32; MAX_DRAFTS],
    /// The request's token count and last token after this step's verification.
    pub n_tok: usize,
    pub last_tok: u32,
    /// Where its tokens from sequence index `start + 1` on are in
    /// [`DraftPass::next_tokens`].
    pub tok_off: usize,
    /// Positions redone before `start`, per stage (set by [`run_stages`]).
    pub ext: [usize; MAX_DRAFTS],
    /// Index into the chain (and the drafts) when the chunk drafts (set by
    /// [`run_stages`]).
    pub chain: Option<usize>,
}

/// A drafting pass: everything a rank needs, besides the stage-0 batch and the target
/// hidden state, to run its stages.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DraftPass {
    /// Drafts per request.
    pub k: usize,
    /// The model's MTP layers.
    pub n_mtp: usize,
    /// The drafts stay on the device between the stages (slots `i × k + d`).
    pub keep: bool,
    /// One per chunk of the stage-0 batch, in order.
    pub chunks: Vec<DraftChunk>,
    /// Per chunk, the tokens after its first position that stages 1.. read.
    pub next_tokens: Vec<u32>,
    /// In the engine's debug builds, each chunk's whole token list, which every stage's
    /// tokens are checked against (an empty one is not checked); empty elsewhere (it
    /// never crosses to a follower).
    pub check: Vec<Vec<u32>>,
}

impl DraftPass {
    /// Stages that run over full rows with their own MTP layer.
    pub fn full_stages(&self) -> usize {
        self.n_mtp.min(self.k)
    }
}

/// What a chunk of the target forward is to the pass that follows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ChunkKind {
    /// A decode window `[last, d1..dk]`: verification accepts `a` drafts, and the first
    /// draft comes from window index `a`.
    #[default]
    Window,
    /// A prefill chunk that ends the sequence's tokens: the forward chooses the next
    /// token at its last row, where the first draft comes from too.
    Last,
    /// A prefill chunk short of the end: it only fills the MTP caches.
    Mid,
}

/// A chunk of the target forward, as the pass that follows it will see it: everything
/// but what the forward's choices decide.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlannedChunk {
    pub kind: ChunkKind,
    /// As [`DraftChunk::cont`] and [`DraftChunk::kept`].
    pub cont: bool,
    pub kept: [u32; MAX_DRAFTS],
    /// Its later stages build their tokens from the stage before (the request redoes
    /// its positions at every stage), so it needs no [`DraftPass::next_tokens`].
    pub in_place: bool,
    /// The sequence's token count and last token before the step.
    pub n_tok: usize,
    pub last_tok: u32,
}

/// A drafting pass planned before the target forward it follows: with the forward's
/// batch and choices, [`PassPlan::resolve`] gives the [`DraftPass`] and the stage-0
/// batch. A tensor-parallel leader sends it with the forward, so a follower runs the
/// pass without another plan. Every chunk that ends in a choice drafts, requests that
/// the choice finishes included (their drafts are dropped): which ones finish is
/// decided on the leader alone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassPlan {
    pub k: usize,
    pub n_mtp: usize,
    pub keep: bool,
    /// One per chunk of the forward's batch, in order.
    pub chunks: Vec<PlannedChunk>,
    /// The `Mid` chunks' tokens after their ends (sequence indices `start + len` on, up
    /// to `full_stages` of them, fewer at the end of the tokens), in chunk order.
    pub beyond: Vec<u32>,
}

impl PassPlan {
    /// Stages that run over full rows with their own MTP layer.
    pub fn full_stages(&self) -> usize {
        self.n_mtp.min(self.k)
    }

    /// How many tokens after a `Mid` chunk's end [`PassPlan::beyond`] holds.
    pub fn beyond_len(&self, end: usize, n_tok: usize) -> usize {
        self.full_stages().min(n_tok - end)
    }

    /// Requests that draft in the pass.
    pub fn drafting(&self) -> usize {
        self.chunks.iter().filter(|c| c.kind != ChunkKind::Mid).count()
    }

    /// The pass, once the forward over `batch` chose `argmax` and `sampled` for its
    /// rows (in the order of its `argmax_rows` and `sample_rows`): fills `pass` and turns
    /// `batch` into the stage-0 batch (its tokens shifted, its `argmax_rows` the first
    /// drafts' rows, no other rows asked). Decode windows accept the drafts their rows'
    /// choices confirm, as verification does: the longest prefix of `d1..dk` equal to
    /// the choices of rows `0..k`.
    pub fn resolve(&self, batch: &mut Batch, argmax: &[u32], sampled: &[u32], pass: &mut DraftPass) -> Result<()> {
        if self.chunks.len() != batch.seqs.len()
            || argmax.len() != batch.argmax_rows.len()
            || sampled.len() != batch.sample_rows.len()
        {
            return Err(Error::Batch(format!(
                "a pass planned over {} chunks for {} sequences, {} argmax ids for {} rows, {} sampled for {}",
                self.chunks.len(),
                batch.seqs.len(),
                argmax.len(),
                batch.argmax_rows.len(),
                sampled.len(),
                batch.sample_rows.len()
            )));
        }
        // Each row's choice, by row.
        let mut chosen = vec![u32::MAX; batch.num_tokens()];
        for (&r, &t) in batch.argmax_rows.iter().zip(argmax) {
            chosen[r as usize] = t;
        }
        for (s, &t) in batch.sample_rows.iter().zip(sampled) {
            chosen[s.row as usize] = t;
        }
        let n_full = self.full_stages();
        pass.k = self.k;
        pass.n_mtp = self.n_mtp;
        pass.keep = self.keep;
        pass.chunks.clear();
        pass.next_tokens.clear();
        batch.clear_rows();
        let (mut row, mut beyond) = (0usize, 0usize);
        for (c, p) in batch.seqs.iter_mut().zip(&self.chunks) {
            let (start, len) = (c.start_pos, c.tokens.len());
            let choice = |j: usize| match chosen.get(row + j) {
                Some(&t) if t != u32::MAX => Ok(t),
                _ => Err(Error::Batch(format!("row {} of a drafting chunk has no choice", row + j))),
            };
            let tok_off = pass.next_tokens.len();
            let (draft_off, n_tok, last_tok) = match p.kind {
                ChunkKind::Window | ChunkKind::Last => {
                    let a = match p.kind {
                        ChunkKind::Window => {
                            let mut a = 0;
                            while a + 1 < len && choice(a)? == c.tokens[a + 1] {
                                a += 1;
                            }
                            a
                        }
                        _ => len.checked_sub(1).ok_or_else(|| Error::Batch("an empty prefill chunk".into()))?,
                    };
                    let next = choice(a)?;
                    // The sequence's tokens from start + 1 on: the accepted drafts (or the
                    // chunk's prompt), then the choice.
                    if n_full > 1 && !p.in_place {
                        pass.next_tokens.extend_from_slice(&c.tokens[1..=a]);
                        pass.next_tokens.push(next);
                    }
                    c.tokens.copy_within(1..=a, 0);
                    c.tokens[a..].fill(next);
                    batch.argmax_rows.push((row + a) as u32);
                    let n_tok = match p.kind {
                        ChunkKind::Window => start + a + 2,
                        _ => p.n_tok + 1,
                    };
                    (Some(a), n_tok, next)
                }
                ChunkKind::Mid => {
                    let end = start + len;
                    let n = self.beyond_len(end, p.n_tok);
                    let after = self
                        .beyond
                        .get(beyond..beyond + n)
                        .ok_or_else(|| Error::Batch("a planned pass without the tokens after a chunk".into()))?;
                    beyond += n;
                    if n_full > 1 {
                        pass.next_tokens.extend_from_slice(&c.tokens[1..]);
                        pass.next_tokens.extend_from_slice(after);
                    }
                    let take = after.len().min(1);
                    c.tokens.copy_within(1.., 0);
                    let tail = len - 1;
                    c.tokens.truncate(tail);
                    c.tokens.extend_from_slice(&after[..take]);
                    c.tokens.resize(len, p.last_tok);
                    (None, p.n_tok, p.last_tok)
                }
            };
            pass.chunks.push(DraftChunk {
                start,
                len,
                cont: p.cont,
                draft_off,
                kept: p.kept,
                n_tok,
                last_tok,
                tok_off,
                ..Default::default()
            });
            row += len;
        }
        Ok(())
    }
}

/// The hidden states a rank keeps from one pass to the next.
#[derive(Debug)]
pub struct StageMemory<H> {
    /// The previous pass's outputs of stages `0..full_stages − 1`.
    pub prev: Vec<H>,
    /// An empty list whose buffer the next pass fills with its stage outputs.
    spare: Vec<H>,
}

impl<H> Default for StageMemory<H> {
    fn default() -> Self {
        StageMemory { prev: Vec::new(), spare: Vec::new() }
    }
}

/// A request that drafts in this pass.
#[derive(Debug, Clone, Copy)]
struct ChainEntry {
    /// Index of its chunk in the step's batch.
    chunk: usize,
    /// Position of its stage-0 draft row.
    pos0: usize,
}

/// Buffers reused by every pass (no per-chunk allocation in steady state).
#[derive(Debug, Default)]
pub struct StageScratch {
    /// The single-token batch of the reused-layer stages.
    batch: Batch,
    hidden_rows: Vec<u32>,
    chain: Vec<ChainEntry>,
    /// `chain × k` drafts, row-major: ids, or [`KEPT`] slot references.
    drafts: Vec<u32>,
    /// Kept rows (of the previous pass's stage d − 1) joined into stage d's input.
    kept: Vec<u32>,
    /// `0, 1, 2, …`: row lists that select every row, as slices of one buffer.
    identity: Vec<u32>,
}

impl StageScratch {
    /// The last pass's drafts, `chain × k` row-major (chain entries in chunk order).
    pub fn drafts(&self) -> &[u32] {
        &self.drafts
    }

    /// Replaces the drafts with their ids, read back from the device after a pass
    /// that kept them.
    pub fn set_drafts(&mut self, ids: &[u32]) -> Result<()> {
        if ids.len() != self.drafts.len() {
            return Err(Error::Backend(format!("{} draft ids for {} slots", ids.len(), self.drafts.len())));
        }
        self.drafts.copy_from_slice(ids);
        Ok(())
    }
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
fn fill_shifted(out: &mut Vec<u32>, ch: &DraftChunk, first: usize, n: usize, next: &[u32], drafts: &[u32], last: u32) {
    let from_tokens = ch.n_tok.saturating_sub(first).min(n);
    let from = ch.tok_off + first - ch.start - 1;
    let first_draft = (first + from_tokens).saturating_sub(ch.n_tok).min(drafts.len());
    let from_drafts = (n - from_tokens).min(drafts.len() - first_draft);
    let tokens = if from_tokens > 0 { &next[from..from + from_tokens] } else { &[] };
    fill_tokens(out, n, tokens, &drafts[first_draft..first_draft + from_drafts], last);
}

/// Row i of `n`: sequence index `first + i` of `tokens ++ drafts`, clamped at its end
/// (what the stages' tokens must be; the engine's debug builds check them).
pub fn shifted(tokens: &[u32], drafts: &[u32], first: usize, n: usize) -> Vec<u32> {
    let end = tokens.len() + drafts.len() - 1;
    let at = |j: usize| tokens.get(j).copied().unwrap_or_else(|| drafts[j - tokens.len()]);
    (first..first + n).map(|j| at(j.min(end))).collect()
}

/// The `n`-th chunk of `seqs`, emptied, reusing its buffers.
pub fn chunk_at(seqs: &mut Vec<SeqChunk>, n: usize) -> &mut SeqChunk {
    if seqs.len() <= n {
        seqs.resize_with(n + 1, SeqChunk::default);
    }
    let c = &mut seqs[n];
    c.tokens.clear();
    c.block_table.clear();
    c.prefill = false;
    c
}

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
fn mtp_call<B: Backend + ?Sized>(
    backend: &mut B,
    layer: usize,
    batch: &mut Batch,
    prev: &B::Hidden,
    rows: &[u32],
    keep: Option<(usize, usize)>,
) -> Result<ForwardOutput<B::Hidden>> {
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
fn store_drafts(drafts: &mut [u32], argmax: &[u32], m: usize, k: usize, d: usize, keep: bool) -> Result<()> {
    if !keep && argmax.len() != m {
        return Err(Error::Backend(format!("{} draft ids for {m} drafting requests", argmax.len())));
    }
    for i in 0..m {
        drafts[i * k + d] = if keep { KEPT | (i * k + d) as u32 } else { argmax[i] };
    }
    Ok(())
}

/// Runs the stages of `pass` on `backend`: `batch` is the stage-0 batch (its tokens the
/// embedding inputs of stage 0, its `argmax_rows` the drafting chunks' first-draft rows,
/// no other rows asked) and is changed in place, stage by stage; `target` is the target
/// forward's hidden state. Leaves the drafts in `sc` ([`StageScratch::drafts`]) and,
/// with several full stages, this pass's outputs in `mem` for the next. The block
/// tables are back in `batch` when it returns, error or not. Returns the microseconds
/// spent inside the backend.
pub fn run_stages<B: Backend + ?Sized>(
    backend: &mut B,
    pass: &mut DraftPass,
    batch: &mut Batch,
    target: &B::Hidden,
    mem: &mut StageMemory<B::Hidden>,
    sc: &mut StageScratch,
) -> Result<u64> {
    let (k, n_mtp, keep) = (pass.k, pass.n_mtp, pass.keep);
    let n_full = pass.full_stages();
    if k == 0 || k > MAX_DRAFTS || n_mtp == 0 || pass.chunks.len() != batch.seqs.len() {
        return Err(Error::Batch(format!(
            "a drafting pass of k = {k} with {n_mtp} MTP layers over {} chunks for {} sequences",
            pass.chunks.len(),
            batch.seqs.len()
        )));
    }
    sc.chain.clear();
    for (ci, ch) in pass.chunks.iter_mut().enumerate() {
        ch.ext = [0; MAX_DRAFTS];
        ch.chain = ch.draft_off.map(|off| {
            sc.chain.push(ChainEntry { chunk: ci, pos0: ch.start + off });
            sc.chain.len() - 1
        });
    }
    let m = sc.chain.len();
    if keep && (m == 0 || m * k > MAX_DRAFT_SLOTS) {
        return Err(Error::Batch(format!("{m} drafting requests × {k} drafts cannot stay in the draft slots")));
    }
    let keep_at = |d: usize| keep.then_some((d, k));
    let mut rows = batch.num_tokens();
    let t = Instant::now();
    let out = mtp_call(backend, 0, batch, target, identity(&mut sc.identity, rows), keep_at(0))?;
    let mut backend_us = t.elapsed().as_micros() as u64;
    sc.drafts.clear();
    sc.drafts.resize(m * k, 0);
    store_drafts(&mut sc.drafts, &out.argmax, m, k, 0, keep)?;
    let mut outs = std::mem::take(&mut mem.spare);
    outs.clear();
    outs.push(out.hidden);
    for d in 1..n_full {
        // Full rows at the same positions, tokens d + 1 ahead (this pass's drafts past
        // the verified ones). A request that drafted in the previous pass also redoes
        // its last d positions, whose entries were computed from drafts then: their
        // hidden input is the row kept from the previous pass's stage d − 1, which
        // lands after all of stage d − 1's rows in the joined hidden state.
        let prev_kept = mem.prev.get(d - 1);
        let n_a = rows as u32;
        let StageScratch { hidden_rows, kept, drafts, .. } = &mut *sc;
        let DraftPass { chunks, next_tokens, check, .. } = &mut *pass;
        // Written in place: at most one kept row per chunk, one logit row per draft.
        hidden_rows.clear();
        hidden_rows.resize(rows + chunks.len(), 0);
        kept.clear();
        kept.resize(chunks.len(), 0);
        batch.argmax_rows.clear();
        batch.argmax_rows.resize(m, 0);
        let (mut n_hidden, mut n_kept, mut n_logits) = (0usize, 0usize, 0usize);
        let (mut off_prev, mut row) = (0u32, 0u32);
        for (ci, (c, ch)) in batch.seqs.iter_mut().zip(chunks.iter_mut()).enumerate() {
            // With the previous pass's row of stage d − 1 at `start − d`, redo that
            // position too; without it (that pass drafted fewer stages), stage d starts
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
                Some(i) => &drafts[i * k..i * k + d],
                None => &[],
            };
            // Row i reads sequence index start_pos + i + d + 1 of `tokens ++ drafts`,
            // clamped at its end.
            let n = ch.len + ext;
            let last = drafts.last().copied().unwrap_or(ch.last_tok);
            if ext == d {
                // Row i reads index start + 1 + i at every stage that redid its
                // positions (stage 0 included): stage d − 1's rows, except that
                // `tokens ++ drafts` grew by this pass's draft d, and one row more.
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
            if let Some(all) = check.get(ci).filter(|a| !a.is_empty()) {
                debug_assert_eq!(c.tokens, shifted(all, drafts, c.start_pos + d + 1, n), "stage {d}");
            }
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
            let kept_h = prev_kept.ok_or_else(|| Error::Batch("no kept MTP rows".into()))?;
            let t = Instant::now();
            let all = identity(&mut sc.identity, n_a as usize);
            input = backend.concat_hidden(&[(&outs[d - 1], all), (kept_h, &sc.kept)])?;
            backend_us += t.elapsed().as_micros() as u64;
            &input
        };
        let t = Instant::now();
        let out = mtp_call(backend, d, batch, prev, &sc.hidden_rows, keep_at(d))?;
        backend_us += t.elapsed().as_micros() as u64;
        store_drafts(&mut sc.drafts, &out.argmax, m, k, d, keep)?;
        outs.push(out.hidden);
    }
    let last_out = outs.pop().ok_or_else(|| Error::Batch("no MTP stage ran".into()))?;
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
fn chain_stages<B: Backend + ?Sized>(
    backend: &mut B,
    sc: &mut StageScratch,
    draft_rows: &[u32],
    mut prev_hidden: B::Hidden,
    k: usize,
    n_mtp: usize,
    keep: bool,
) -> Result<u64> {
    let m = sc.chain.len();
    let mut backend_us = 0;
    sc.batch.clear_rows();
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
        store_drafts(&mut sc.drafts, &out.argmax, m, k, d, keep)?;
        prev_hidden = out.hidden;
    }
    Ok(backend_us)
}
