//! Continuous batching: decides each step's work under a token budget and the block
//! pool, and preempts by recompute when blocks run out.
//!
//! Order of a step (all lists ordered by arrival, oldest first):
//! 1. running decode requests, `1 + k` tokens each (k: the drafts the request holds for
//!    this step), with blocks for `L + max(1 + K, 2K)` positions (`L` = cached tokens,
//!    `K` the most drafts a step may take): the target window writes `L..=L+k` and the
//!    MTP chain writes up to `L + a + k − 1 ≤ L + 2k − 1`;
//! 2. running requests part-way through their prefill, a chunk each from what budget
//!    is left — while requests decode in the step, at most `max_prefill_tokens` in all,
//!    so a long prompt cannot stall their streams;
//! 3. admission of waiting requests, FCFS, while the budget, `max_num_seqs` and the
//!    free blocks allow; the head of the queue is never skipped (no starvation). A
//!    request first maps the longest prefix the prefix cache holds for its tokens
//!    (`crate::prefix`) and prefills from there.
//!
//! When a running request lacks blocks it preempts the newest running request not yet
//! scheduled in this step (or, being the newest, itself): its blocks are freed and it
//! returns to the waiting queue, to prefill its prompt and emitted tokens again later.

use crate::block::{BlockManager, BLOCK_POSITIONS};
use crate::sequence::{Sched, Sequence};
use std::collections::VecDeque;

/// Scheduling limits of one engine.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// The most drafts a decode window holds (blocks are reserved for it).
    pub k: usize,
    pub max_batch_tokens: usize,
    /// Prefill tokens per step while requests decode in it (see `EngineConfig`).
    pub max_prefill_tokens: usize,
    pub max_num_seqs: usize,
}

impl Limits {
    /// Cache positions a decode step of a sequence with `cached` tokens writes.
    pub fn decode_positions(&self, cached: usize) -> usize {
        cached + (1 + self.k).max(2 * self.k)
    }

    /// Cache positions a prefill chunk needs; a last chunk also drafts `k − 1` past it.
    pub fn prefill_positions(&self, end: usize, last: bool) -> usize {
        if last {
            end + self.k
        } else {
            end
        }
    }

    /// The largest chunk of `s`'s prefill of at most `want` tokens whose positions fit in
    /// `avail` positions, as (length, is-last).
    fn fit_chunk(&self, s: &Sequence, want: usize, avail: usize) -> Option<(usize, bool)> {
        let total = s.tokens.len();
        let start = s.num_cached;
        let n = want.min(prefill_end(s) - start);
        if start + n == total && self.prefill_positions(total, true) <= avail {
            return Some((n, true));
        }
        let n = n.min(total - start - 1).min(avail.saturating_sub(start));
        (n > 0).then_some((n, false))
    }
}

/// Counts of one scheduling pass.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Scheduled {
    pub tokens: usize,
    pub preempted: usize,
}

fn preempt(running: &mut Vec<Sequence>, waiting: &mut VecDeque<Sequence>, blocks: &mut BlockManager, j: usize) {
    let mut s = running.remove(j);
    blocks.release(&mut s.block_table);
    s.reset_for_recompute();
    let at = waiting.partition_point(|w| w.arrival < s.arrival);
    waiting.insert(at, s);
}

/// Where `s`'s next prefill chunk must end at the latest: a chunk never holds prompt
/// tokens and generated ones together (a sequence recomputed after preemption prefills
/// its prompt first, then its generated tokens), so `SeqChunk::prefill` can mark prompt
/// chunks and a backend may route by it.
fn prefill_end(s: &Sequence) -> usize {
    if s.num_cached < s.prompt_len {
        s.prompt_len
    } else {
        s.tokens.len()
    }
}

fn newest_unscheduled_after(running: &[Sequence], i: usize) -> Option<usize> {
    (i + 1..running.len()).rev().find(|&j| running[j].sched.is_none())
}

/// Plans one step: sets `sched` on the sequences that run, allocating their blocks.
pub(crate) fn schedule(
    running: &mut Vec<Sequence>,
    waiting: &mut VecDeque<Sequence>,
    blocks: &mut BlockManager,
    lim: &Limits,
) -> Scheduled {
    let mut out = Scheduled::default();
    for s in running.iter_mut() {
        s.sched = None;
    }
    let mut budget = lim.max_batch_tokens;

    // 1. Decodes, oldest first.
    let mut i = 0;
    let mut prefilling = false;
    while i < running.len() {
        let window = 1 + running[i].drafts.as_slice().len();
        if !running[i].decoding || budget < window {
            prefilling |= !running[i].decoding;
            i += 1;
            continue;
        }
        let need = lim.decode_positions(running[i].num_cached);
        loop {
            if blocks.ensure(&mut running[i].block_table, need) {
                running[i].sched = Some(Sched::Decode);
                budget -= window;
                out.tokens += window;
                i += 1;
                break;
            }
            out.preempted += 1;
            match newest_unscheduled_after(running, i) {
                Some(j) => preempt(running, waiting, blocks, j),
                None => {
                    preempt(running, waiting, blocks, i);
                    break;
                }
            }
        }
    }

    // While requests decode in this step, prefill at most the cap: their next token
    // waits for the whole step.
    if out.tokens > 0 {
        budget = budget.min(lim.max_prefill_tokens);
    }

    // 2. Running prefills, oldest first (preempting in 1 only removes requests).
    let mut i = 0;
    while prefilling && i < running.len() && budget > 0 {
        if running[i].decoding || running[i].sched.is_some() {
            i += 1;
            continue;
        }
        loop {
            let s = &running[i];
            let avail = (s.block_table.len() + blocks.num_free()) * BLOCK_POSITIONS;
            let total = s.tokens.len();
            let n = budget.min(prefill_end(s) - s.num_cached);
            let last = s.num_cached + n == total;
            let whole = lim.prefill_positions(s.num_cached + n, last) <= avail;
            let chunk = if whole {
                Some((n, last))
            } else if let Some(j) = newest_unscheduled_after(running, i) {
                out.preempted += 1;
                preempt(running, waiting, blocks, j);
                continue;
            } else {
                lim.fit_chunk(s, budget, avail)
            };
            match chunk {
                Some((n, last)) => {
                    let s = &mut running[i];
                    let end = lim.prefill_positions(s.num_cached + n, last);
                    let ok = blocks.ensure(&mut s.block_table, end);
                    debug_assert!(ok, "chunk was fitted to the free blocks");
                    s.sched = Some(Sched::Prefill { len: n, last });
                    budget -= n;
                    out.tokens += n;
                    i += 1;
                }
                None => {
                    // Nothing newer to take and no room for even one token: step aside
                    // for the older requests, which hold the blocks and will progress.
                    out.preempted += 1;
                    preempt(running, waiting, blocks, i);
                }
            }
            break;
        }
    }

    // 3. Admission, FCFS, each request's prefill starting after its cached prefix.
    while budget > 0 && running.len() < lim.max_num_seqs {
        let Some(front) = waiting.front_mut() else { break };
        let (hit, partial) = blocks.match_prefix(&front.tokens, &mut front.prefix_chain, &mut front.block_table);
        front.num_cached = hit * BLOCK_POSITIONS;
        let avail = (hit + blocks.num_free()) * BLOCK_POSITIONS;
        let Some((n, last)) = lim.fit_chunk(front, budget, avail) else {
            blocks.release(&mut front.block_table);
            blocks.unmatch(front.tokens.len(), hit);
            front.num_cached = 0;
            break;
        };
        let Some(mut s) = waiting.pop_front() else {
            break;
        };
        s.registered = hit;
        if let Some(i) = partial {
            // Target-only blocks: their MTP holes are the request's own now.
            s.holes_from = i * BLOCK_POSITIONS;
            s.whole_mtp = 0;
        }
        if s.usage.preemptions == 0 {
            s.usage.cached_prompt_tokens = s.num_cached.min(s.prompt_len) as u64;
        }
        let ok = blocks.ensure(&mut s.block_table, lim.prefill_positions(s.num_cached + n, last));
        debug_assert!(ok, "chunk was fitted to the free blocks");
        s.sched = Some(Sched::Prefill { len: n, last });
        budget -= n;
        out.tokens += n;
        let at = running.partition_point(|r| r.arrival < s.arrival);
        running.insert(at, s);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{RequestId, SamplingParams};

    /// A recomputed sequence's chunks never straddle its prompt's end, so prompt chunks
    /// can be marked (`SeqChunk::prefill`); a fresh one is chunked as before.
    #[test]
    fn recompute_prefills_the_prompt_then_the_generated_tokens() {
        let lim = Limits { k: 3, max_batch_tokens: 512, max_prefill_tokens: 512, max_num_seqs: 8 };
        let mut s = Sequence::new(RequestId(0), 0, (2..12).collect(), SamplingParams::default(), 0, 3);
        assert_eq!(lim.fit_chunk(&s, 100, 1 << 20), Some((10, true)), "a fresh prompt: one last chunk");
        s.tokens.extend([20, 21, 22, 23, 24]); // 5 generated tokens, then preempted
        s.reset_for_recompute();
        assert_eq!(lim.fit_chunk(&s, 100, 1 << 20), Some((10, false)), "the prompt alone first");
        assert_eq!(lim.fit_chunk(&s, 4, 1 << 20), Some((4, false)));
        s.num_cached = 10;
        assert_eq!(lim.fit_chunk(&s, 100, 1 << 20), Some((5, true)), "then the generated tokens");
        s.num_cached = 8;
        assert_eq!(lim.fit_chunk(&s, 100, 1 << 20), Some((2, false)), "the prompt's tail alone");
    }

    /// While a request decodes, a long prompt is prefilled at most `max_prefill_tokens`
    /// per step; alone, it takes the whole budget.
    #[test]
    fn prefill_is_capped_only_while_requests_decode() {
        let lim = Limits { k: 3, max_batch_tokens: 2048, max_prefill_tokens: 128, max_num_seqs: 8 };
        let mut blocks = BlockManager::new(64);
        let long = |id| Sequence::new(RequestId(id), id, (2..1002).collect(), SamplingParams::default(), 0, 3);

        // Alone: one chunk of the whole prompt.
        let (mut running, mut waiting) = (Vec::new(), VecDeque::from([long(1)]));
        let out = schedule(&mut running, &mut waiting, &mut blocks, &lim);
        assert_eq!(out.tokens, 1000);
        for s in running.iter_mut() {
            blocks.release(&mut s.block_table);
        }

        // Beside a decoding request: 4 decode tokens, then 128 prompt tokens per step.
        let mut d = Sequence::new(RequestId(0), 0, vec![2, 3, 4], SamplingParams::default(), 0, 3);
        assert!(blocks.ensure(&mut d.block_table, 3));
        d.num_cached = 3;
        d.decoding = true;
        d.drafts.set(&[5, 6, 7]);
        let (mut running, mut waiting) = (vec![d], VecDeque::from([long(1)]));
        let mut prefilled = 0;
        for _ in 0..3 {
            let out = schedule(&mut running, &mut waiting, &mut blocks, &lim);
            assert_eq!(out.tokens, 4 + 128);
            assert_eq!(running[1].sched, Some(Sched::Prefill { len: 128, last: false }));
            prefilled += 128;
            running[1].num_cached = prefilled;
        }
    }
}
