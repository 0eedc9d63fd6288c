//! Padded MTP drafting (DESIGN §5).
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

use crate::sampling::argmax;
use crate::sequence::Sequence;
use mlaserve_core::{Backend, Batch, SeqChunk};
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
    /// The previous step's outputs of stages `0..n_full − 1`.
    pub prev: Vec<H>,
}

impl<H> Default for MtpMemory<H> {
    fn default() -> Self {
        MtpMemory { step: 0, prev: Vec::new() }
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
    pub rows: [u32; 4],
}

/// One scheduled chunk of the step, as the drafter sees it.
#[derive(Debug, Clone, Copy)]
struct ChunkInfo {
    /// Index into the running list.
    idx: usize,
    start: usize,
    len: usize,
    /// The request drafted in the previous step and starts where it said it would.
    cont: bool,
    draft_off: Option<usize>,
    /// Positions redone before `start`, per stage.
    ext: [usize; 4],
}

/// Buffers reused by every step's drafting (no per-chunk allocation in steady state).
#[derive(Debug, Default)]
pub(crate) struct DraftScratch {
    /// The single-token batch of stages 1..k-1.
    batch: Batch,
    hidden_rows: Vec<u32>,
    /// (sequence, position of the stage-0 draft row)
    chain: Vec<(usize, usize)>,
    /// `chain.len() × k` drafts, row-major.
    drafts: Vec<u32>,
    chunks: Vec<ChunkInfo>,
    /// Kept rows (of the previous step's stage d − 1) joined into stage d's input.
    kept: Vec<u32>,
    /// Running index → index into `chunks`.
    chunk_of: Vec<Option<usize>>,
    /// Running index → the request goes on after this step.
    going_on: Vec<bool>,
    /// Running index → index into `chain` (requests that draft this step).
    chain_of: Vec<Option<usize>>,
    /// The stage-0 rows that give each chain request's drafts.
    draft_rows: Vec<u32>,
    all_rows: Vec<u32>,
}

/// The `n`-th chunk of `seqs`, emptied, reusing its buffers.
pub(crate) fn chunk_at(seqs: &mut Vec<SeqChunk>, n: usize) -> &mut SeqChunk {
    if seqs.len() <= n {
        seqs.resize_with(n + 1, SeqChunk::default);
    }
    let c = &mut seqs[n];
    c.tokens.clear();
    c.block_table.clear();
    c
}

/// Runs the MTP stages and stores k drafts in each sequence of `jobs` that has a
/// draft row. `batch` is the step's target batch (chunk `i` belongs to the `i`-th
/// scheduled sequence of `running`); stage 0 reuses it in place, tokens shifted, so
/// the block tables are not copied again. Sequences that finished in this step ride
/// along in stage 0 (their rows are padding) and get no drafts. Returns the
/// microseconds spent inside the backend.
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
    let vocab = backend.config().vocab_size;
    mem.step += 1;
    let step = mem.step;
    // Stages that run over full rows with their own MTP layer.
    let n_full = n_mtp.min(k);
    sc.chunks.clear();
    sc.chain_of.clear();
    sc.chain_of.resize(running.len(), None);
    sc.chunk_of.clear();
    sc.chunk_of.resize(running.len(), None);
    sc.going_on.clear();
    sc.going_on.resize(running.len(), false);
    for job in jobs {
        sc.going_on[job.seq] = true;
    }
    let scheduled = running.iter().enumerate().filter(|(_, s)| s.sched.is_some());
    for (c, (idx, s)) in batch.seqs.iter_mut().zip(scheduled) {
        let cont = matches!(s.mtp_tail, Some(t) if t.step + 1 == step && t.next_start == c.start_pos);
        sc.chunk_of[idx] = Some(sc.chunks.len());
        sc.chunks.push(ChunkInfo { idx, start: c.start_pos, len: c.tokens.len(), cont, draft_off: None, ext: [0; 4] });
        // Embedding input of position p: the token after it (DESIGN §5, padded).
        let last = s.tokens.len() - 1;
        for (i, t) in c.tokens.iter_mut().enumerate() {
            *t = s.tokens[(c.start_pos + i + 1).min(last)];
        }
    }
    batch.logit_rows.clear();
    sc.chain.clear();
    for job in jobs {
        if let Some(off) = job.draft_off {
            sc.chain_of[job.seq] = Some(sc.chain.len());
            batch.logit_rows.push((job.target_row + off) as u32);
            sc.chain.push((job.seq, job.start + off));
            if let Some(ch) = sc.chunk_of[job.seq].and_then(|ci| sc.chunks.get_mut(ci)) {
                ch.draft_off = Some(off);
            }
        }
    }
    sc.draft_rows.clone_from(&batch.logit_rows);
    sc.hidden_rows.clear();
    sc.hidden_rows.extend(0..batch.num_tokens() as u32);
    let t = Instant::now();
    let out = backend.mtp_forward(0, batch, target_hidden, &sc.hidden_rows)?;
    let mut backend_us = t.elapsed().as_micros() as u64;
    let m = sc.chain.len();
    sc.drafts.clear();
    sc.drafts.resize(m * k, 0);
    for i in 0..m {
        sc.drafts[i * k] = argmax(&out.logits[i * vocab..(i + 1) * vocab]);
    }
    let mut outs: Vec<B::Hidden> = vec![out.hidden];
    for d in 1..n_full {
        // Full rows at the same positions, tokens d + 1 ahead (this step's drafts past
        // the verified ones). A request that drafted in the previous step also redoes
        // its last d positions, whose entries were computed from drafts then: their
        // hidden input is the row kept from the previous step's stage d − 1.
        let prev_kept = mem.prev.get(d - 1);
        // First pass: which chunks redo positions, and where the kept rows will land
        // (after all of stage d − 1's rows in the joined hidden state).
        let mut n_a = 0u32;
        sc.kept.clear();
        for ch in sc.chunks.iter_mut() {
            let cont = ch.cont && prev_kept.is_some() && ch.ext[d - 1] == d - 1;
            ch.ext[d] = if cont { d } else { 0 };
            n_a += (ch.len + ch.ext[d - 1]) as u32;
            if cont {
                sc.kept.push(running[ch.idx].mtp_tail.map(|t| t.rows[d - 1]).unwrap_or(0));
            }
        }
        sc.hidden_rows.clear();
        batch.logit_rows.clear();
        let (mut off_prev, mut row, mut kept_i) = (0u32, 0u32, 0u32);
        for (c, ch) in batch.seqs.iter_mut().zip(&sc.chunks) {
            let s = &running[ch.idx];
            let ext = ch.ext[d];
            let prev_len = (ch.len + ch.ext[d - 1]) as u32;
            if ext > 0 {
                sc.hidden_rows.push(n_a + kept_i);
                kept_i += 1;
            }
            sc.hidden_rows.extend(off_prev..off_prev + prev_len);
            off_prev += prev_len;
            c.start_pos = ch.start - ext;
            c.tokens.resize(ch.len + ext, 0);
            let drafts: &[u32] = match sc.chain_of[ch.idx] {
                Some(ci) => &sc.drafts[ci * k..ci * k + d],
                None => &[],
            };
            // Row i reads sequence index start_pos + i + d + 1 of `tokens ++ drafts`,
            // clamped at its end: a bulk copy, then the drafts, then the last one repeated.
            let first = c.start_pos + d + 1;
            let n = s.tokens.len() + drafts.len();
            let from_tokens = s.tokens.len().saturating_sub(first).min(c.tokens.len());
            if from_tokens > 0 {
                c.tokens[..from_tokens].copy_from_slice(&s.tokens[first..first + from_tokens]);
            }
            let last = if n == s.tokens.len() { s.tokens[n - 1] } else { drafts[drafts.len() - 1] };
            for (i, t) in c.tokens.iter_mut().enumerate().skip(from_tokens) {
                let j = first + i;
                *t = if j < n { drafts[j - s.tokens.len()] } else { last };
            }
            if let Some(off) = ch.draft_off {
                batch.logit_rows.push(row + (ext + off) as u32);
            }
            row += c.tokens.len() as u32;
        }
        let input;
        let prev: &B::Hidden = if sc.kept.is_empty() {
            &outs[d - 1]
        } else {
            sc.all_rows.clear();
            sc.all_rows.extend(0..n_a);
            let kept_h = prev_kept.ok_or_else(|| mlaserve_core::Error::Batch("no kept MTP rows".into()))?;
            let t = Instant::now();
            input = backend.concat_hidden(&[(&outs[d - 1], &sc.all_rows), (kept_h, &sc.kept)])?;
            backend_us += t.elapsed().as_micros() as u64;
            &input
        };
        let t = Instant::now();
        let out = backend.mtp_forward(d, batch, prev, &sc.hidden_rows)?;
        backend_us += t.elapsed().as_micros() as u64;
        for i in 0..m {
            sc.drafts[i * k + d] = argmax(&out.logits[i * vocab..(i + 1) * vocab]);
        }
        outs.push(out.hidden);
        sc.draft_rows.clone_from(&batch.logit_rows);
    }
    // Keep, for every request that goes on, the row of each stage e < n_full − 1 at
    // position `next_start − e − 1`: the input the next step's stage e + 1 needs to redo
    // its stale entries.
    let last_out = outs.pop().ok_or_else(|| mlaserve_core::Error::Batch("no MTP stage ran".into()))?;
    if n_full > 1 {
        let mut offs = vec![0usize; n_full - 1];
        for ch in &sc.chunks {
            let s = &mut running[ch.idx];
            let mut tail = MtpTail { step, next_start: s.num_cached, rows: [0; 4] };
            let mut ok = sc.going_on[ch.idx];
            for (e, off) in offs.iter_mut().enumerate() {
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
        mem.prev = outs;
    }
    let mut prev_hidden = last_out;
    let mut prev_full = true;
    sc.all_rows.clear();
    sc.all_rows.extend(0..m as u32);
    sc.batch.logit_rows.clone_from(&sc.all_rows);
    for d in n_full..k {
        if m == 0 {
            break;
        }
        if d == n_full {
            for (i, &(seq, _)) in sc.chain.iter().enumerate() {
                let c = chunk_at(&mut sc.batch.seqs, i);
                c.tokens.push(0);
                c.block_table.extend_from_slice(&running[seq].block_table);
            }
            sc.batch.seqs.truncate(m);
        }
        // The reused last layer: one token per request at the next free position.
        let shift = d + 1 - n_mtp;
        for (i, (c, &(_, pos0))) in sc.batch.seqs.iter_mut().zip(&sc.chain).enumerate() {
            c.tokens[0] = sc.drafts[i * k + d - 1];
            c.start_pos = pos0 + shift;
        }
        let rows = if prev_full { &sc.draft_rows } else { &sc.all_rows };
        let t = Instant::now();
        let out = backend.mtp_forward(n_mtp - 1, &sc.batch, &prev_hidden, rows)?;
        backend_us += t.elapsed().as_micros() as u64;
        for i in 0..m {
            sc.drafts[i * k + d] = argmax(&out.logits[i * vocab..(i + 1) * vocab]);
        }
        prev_hidden = out.hidden;
        prev_full = false;
    }
    for (i, &(seq, _)) in sc.chain.iter().enumerate() {
        let s = &mut running[seq];
        s.drafts.clear();
        s.drafts.extend_from_slice(&sc.drafts[i * k..(i + 1) * k]);
    }
    Ok(backend_us)
}
