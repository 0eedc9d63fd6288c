//! Per-request state: tokens (prompt + emitted), how much of it the cache holds, the
//! pending drafts, the block table, usage, and the stop conditions.

use crate::api::{FinishReason, RequestId, SamplingParams, StopMatch, Usage, MAX_SPECULATIVE_TOKENS};

/// What a sequence does in the step being built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sched {
    /// Verify window `[last, d1..dk]` at positions `num_cached..=num_cached + k`.
    Decode,
    /// Prefill `len` tokens from `num_cached`; `last` when the chunk reaches the end of
    /// `tokens` (the step then samples the next token and drafts).
    Prefill { len: usize, last: bool },
}

/// The drafts of a request's next verify window, kept inline: every step reads and
/// writes them for every running request, and a heap buffer would cost a cache miss
/// each time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Drafts {
    buf: [u32; MAX_SPECULATIVE_TOKENS],
    len: usize,
}

impl Drafts {
    pub fn as_slice(&self) -> &[u32] {
        &self.buf[..self.len]
    }

    /// Replaces the drafts (at most [`MAX_SPECULATIVE_TOKENS`]).
    pub fn set(&mut self, drafts: &[u32]) {
        self.buf[..drafts.len()].copy_from_slice(drafts);
        self.len = drafts.len();
    }

    pub fn clear(&mut self) {
        self.len = 0;
    }
}

/// One request inside the engine.
///
/// `repr(C)` keeps the declared order: the fields that every step reads or writes for
/// every running request come first, so each pass over the requests (several per step,
/// each after a backend call has left the caches cold) touches few cache lines.
#[derive(Debug)]
#[repr(C)]
pub(crate) struct Sequence {
    pub sched: Option<Sched>,
    /// Positions `0..num_cached` of `tokens` are in the target cache. While decoding,
    /// `num_cached == tokens.len() - 1` (the last emitted token is not cached yet).
    pub num_cached: usize,
    pub drafts: Drafts,
    /// The last of `tokens`, inline: a decode window starts with it, and reading it
    /// through `tokens` costs a cache miss per request per step.
    pub last_token: u32,
    /// True once the prefill of `tokens` finished and `drafts` holds the next step's
    /// drafts (k of them; none when the step runs without).
    pub decoding: bool,
    pub seed: u64,
    /// Prompt followed by every emitted token (appended only by `push_token`).
    pub tokens: Vec<u32>,
    pub block_table: Vec<u32>,
    pub id: RequestId,
    pub prompt_len: usize,
    /// `Usage::accepted_per_position`, inline.
    pub accepted_at: [u64; MAX_SPECULATIVE_TOKENS],
    /// `Usage::verified_per_position`, inline.
    pub verified_at: [u64; MAX_SPECULATIVE_TOKENS],
    /// Per draft position, the windows that offered it with every earlier draft
    /// accepted (`verified_at[j] / offered_at[j]` is the request's conditional rate).
    pub offered_at: [u64; MAX_SPECULATIVE_TOKENS],
    /// Leading MTP layers whose caches have no holes (`usize::MAX`: all of them). A
    /// step that drafts k < the layers in use runs layers `0..k` only (none at adaptive
    /// k = 0), leaving holes in the others at its positions until a recompute; a draft
    /// at position j comes from layers `0..=j`, so with holes there it says little
    /// about the drafter's own rate.
    pub whole_mtp: usize,
    /// Rows the drafter kept for this request from its last step.
    pub mtp_tail: Option<crate::draft::MtpTail>,
    /// Positions from here on may hold MTP entries that are not final (a step drafted
    /// with fewer MTP layers than the engine uses, or could not redo the entries the
    /// last one drafted from): no block reaching past it is cached. `usize::MAX`: none.
    pub holes_from: usize,
    /// Leading blocks of `block_table` that are in the prefix cache (found there at
    /// admission, or registered since); `usize::MAX` once one could not be registered
    /// (its content was cached in another block: the rest of the table stays private).
    pub registered: usize,
    /// The chained hash of `tokens`' full blocks (`crate::prefix::extend_chain`).
    pub prefix_chain: Vec<u64>,
    /// Counters of the request's [`Usage`] but the per-position ones, which live in
    /// `accepted_at` and `verified_at` (inline, for the verify loop's sake) until
    /// [`Sequence::usage`] puts them together.
    pub usage: Usage,
    pub params: SamplingParams,
    /// Submission order; lower is older (FCFS admission, newest-first preemption).
    pub arrival: u64,
    /// The logit bias and penalty state (`None`: the request edits no logit).
    pub penalty: Option<Box<crate::penalty::Penalties>>,
    /// The most drafts a window holds: the length of the per-position counts.
    positions: usize,
}

impl Sequence {
    pub fn new(id: RequestId, arrival: u64, prompt: Vec<u32>, params: SamplingParams, seed: u64, k: usize) -> Self {
        let usage = Usage { prompt_tokens: prompt.len() as u64, ..Default::default() };
        let penalty = crate::penalty::Penalties::new(&params, &prompt);
        Sequence {
            id,
            arrival,
            params,
            seed,
            prompt_len: prompt.len(),
            last_token: prompt.last().copied().unwrap_or(0),
            tokens: prompt,
            num_cached: 0,
            decoding: false,
            drafts: Drafts::default(),
            block_table: Vec::new(),
            usage,
            accepted_at: [0; MAX_SPECULATIVE_TOKENS],
            verified_at: [0; MAX_SPECULATIVE_TOKENS],
            offered_at: [0; MAX_SPECULATIVE_TOKENS],
            whole_mtp: usize::MAX,
            positions: k,
            sched: None,
            mtp_tail: None,
            holes_from: usize::MAX,
            registered: 0,
            prefix_chain: Vec::new(),
            penalty,
        }
    }

    /// The request's usage so far.
    pub fn usage(&self) -> Usage {
        Usage {
            accepted_per_position: self.accepted_at[..self.positions].to_vec(),
            verified_per_position: self.verified_at[..self.positions].to_vec(),
            ..self.usage.clone()
        }
    }

    /// Adds the request's usage so far to `totals` (without building a [`Usage`]).
    pub fn add_usage_to(&self, totals: &mut Usage) {
        totals.accumulate(&self.usage);
        for (per_position, mine) in [
            (&mut totals.accepted_per_position, &self.accepted_at),
            (&mut totals.verified_per_position, &self.verified_at),
        ] {
            if per_position.len() < self.positions {
                per_position.resize(self.positions, 0);
            }
            for (t, n) in per_position.iter_mut().zip(&mine[..self.positions]) {
                *t += n;
            }
        }
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to prefill plus tokens still allowed to generate.
    pub fn outstanding_tokens(&self) -> u64 {
        let prefill = if self.decoding { 0 } else { self.tokens.len() - self.num_cached };
        let gen_left = (self.params.max_new_tokens as usize).saturating_sub(self.generated());
        (prefill + gen_left) as u64
    }

    /// Drops the cache (preemption by recompute): the tokens stay, the next admission
    /// prefills all of them and samples the token after them.
    pub fn reset_for_recompute(&mut self) {
        self.num_cached = 0;
        self.decoding = false;
        self.drafts.clear();
        self.whole_mtp = usize::MAX;
        self.mtp_tail = None;
        self.holes_from = usize::MAX;
        self.registered = 0;
        self.sched = None;
        self.usage.preemptions += 1;
    }

    /// Appends an emitted token and checks the stop conditions in order.
    pub fn push_token(&mut self, tok: u32, eos: &[u32], max_model_len: usize) -> Option<FinishReason> {
        self.tokens.push(tok);
        self.last_token = tok;
        if let Some(p) = &mut self.penalty {
            p.push(tok);
        }
        self.usage.generated_tokens += 1;
        if !self.params.ignore_eos && eos.contains(&tok) {
            return Some(FinishReason::Stop(StopMatch::Eos(tok)));
        }
        if self.params.stop_token_ids.contains(&tok) {
            return Some(FinishReason::Stop(StopMatch::StopToken(tok)));
        }
        let out = &self.tokens[self.prompt_len..];
        if let Some(i) = self.params.stop_sequences.iter().position(|s| !s.is_empty() && out.ends_with(s)) {
            return Some(FinishReason::Stop(StopMatch::StopSequence(i)));
        }
        if self.generated() >= self.params.max_new_tokens as usize || self.tokens.len() >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_conditions() {
        let p = SamplingParams {
            max_new_tokens: 5,
            stop_token_ids: vec![7],
            stop_sequences: vec![vec![3, 4]],
            ..Default::default()
        };
        let mut s = Sequence::new(RequestId(0), 0, vec![3], p.clone(), 0, 0);
        assert_eq!(s.push_token(4, &[1], 100), None, "stop sequences match the output only");
        assert_eq!(s.push_token(3, &[1], 100), None);
        assert_eq!(s.push_token(4, &[1], 100), Some(FinishReason::Stop(StopMatch::StopSequence(0))));
        let mut s = Sequence::new(RequestId(0), 0, vec![3], p.clone(), 0, 0);
        assert_eq!(s.push_token(1, &[1], 100), Some(FinishReason::Stop(StopMatch::Eos(1))));
        let mut s = Sequence::new(RequestId(0), 0, vec![3], p.clone(), 0, 0);
        assert_eq!(s.push_token(7, &[1], 100), Some(FinishReason::Stop(StopMatch::StopToken(7))));
        let mut s = Sequence::new(RequestId(0), 0, vec![3], SamplingParams { ignore_eos: true, ..p }, 0, 0);
        assert_eq!(s.push_token(1, &[1], 100), None);
        assert_eq!(s.push_token(2, &[1], 3), Some(FinishReason::Length));
    }
}
