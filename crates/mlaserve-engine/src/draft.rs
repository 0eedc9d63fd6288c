//! Padded MTP drafting (DESIGN §5).
//!
//! Stage 0 runs MTP layer 0 once over every token of the step — decode windows and
//! prefill chunks alike — pairing the target hidden state of position `p` with the
//! token that follows `p`. For a decode window `[last, d1..dk]` at `L..=L+k` with `a`
//! drafts accepted, that token is `d_{j+1}` for `j < a`, the correction `c` for `j = a`,
//! and `c` again past it (those rows are padding: their cache entries are overwritten by
//! the next window). In sequence terms it is `tokens[min(p + 1, len − 1)]` once the
//! step's tokens are appended. The first draft is the argmax at window index `a` (at the
//! last prompt position after a prefill). Stages `d = 1..k−1` run MTP layer
//! `min(d, n_mtp − 1)` on one token per request at position `pos0 + d`, with the previous
//! stage's hidden state and the previous draft. Batch shapes never depend on `a`.

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
) -> Result<u64, mlaserve_core::Error> {
    let vocab = backend.config().vocab_size;
    let scheduled = running.iter().filter(|s| s.sched.is_some());
    for (c, s) in batch.seqs.iter_mut().zip(scheduled) {
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
            batch.logit_rows.push((job.target_row + off) as u32);
            sc.chain.push((job.seq, job.start + off));
        }
    }
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
    let mut prev_hidden = out.hidden;
    // Stage 1 reads the stage-0 draft rows; later stages read row i for request i.
    std::mem::swap(&mut sc.hidden_rows, &mut batch.logit_rows);
    sc.all_rows.clear();
    sc.all_rows.extend(0..m as u32);
    sc.batch.logit_rows.clone_from(&sc.all_rows);
    for d in 1..k {
        if m == 0 {
            break;
        }
        if d == 1 {
            for (i, &(seq, _)) in sc.chain.iter().enumerate() {
                let c = chunk_at(&mut sc.batch.seqs, i);
                c.tokens.push(0);
                c.block_table.extend_from_slice(&running[seq].block_table);
            }
            sc.batch.seqs.truncate(m);
        }
        for (i, (c, &(_, pos0))) in sc.batch.seqs.iter_mut().zip(&sc.chain).enumerate() {
            c.tokens[0] = sc.drafts[i * k + d - 1];
            c.start_pos = pos0 + d;
        }
        let t = Instant::now();
        let out = backend.mtp_forward(d.min(n_mtp - 1), &sc.batch, &prev_hidden, &sc.hidden_rows)?;
        backend_us += t.elapsed().as_micros() as u64;
        for i in 0..m {
            sc.drafts[i * k + d] = argmax(&out.logits[i * vocab..(i + 1) * vocab]);
        }
        prev_hidden = out.hidden;
        sc.hidden_rows.clone_from(&sc.all_rows);
    }
    for (i, &(seq, _)) in sc.chain.iter().enumerate() {
        let s = &mut running[seq];
        s.drafts.clear();
        s.drafts.extend_from_slice(&sc.drafts[i * k..(i + 1) * k]);
    }
    Ok(backend_us)
}
