//! Per-request state: tokens (prompt + emitted), how much of it the cache holds, the
//! pending drafts, the block table, usage, and the stop conditions.

use crate::api::{FinishReason, RequestId, SamplingParams, StopMatch, Usage};

/// What a sequence does in the step being built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Sched {
    /// Verify window `[last, d1..dk]` at positions `num_cached..=num_cached + k`.
    Decode,
    /// Prefill `len` tokens from `num_cached`; `last` when the chunk reaches the end of
    /// `tokens` (the step then samples the next token and drafts).
    Prefill { len: usize, last: bool },
}

/// One request inside the engine.
#[derive(Debug)]
pub(crate) struct Sequence {
    pub id: RequestId,
    /// Submission order; lower is older (FCFS admission, newest-first preemption).
    pub arrival: u64,
    pub params: SamplingParams,
    pub seed: u64,
    pub prompt_len: usize,
    /// Prompt followed by every emitted token.
    pub tokens: Vec<u32>,
    /// Positions `0..num_cached` of `tokens` are in the target cache. While decoding,
    /// `num_cached == tokens.len() - 1` (the last emitted token is not cached yet).
    pub num_cached: usize,
    /// True once the prefill of `tokens` finished and `drafts` holds k drafts.
    pub decoding: bool,
    pub drafts: Vec<u32>,
    pub block_table: Vec<u32>,
    pub usage: Usage,
    pub sched: Option<Sched>,
    /// Rows the drafter kept for this request from its last step.
    pub mtp_tail: Option<crate::draft::MtpTail>,
}

impl Sequence {
    pub fn new(id: RequestId, arrival: u64, prompt: Vec<u32>, params: SamplingParams, seed: u64, k: usize) -> Self {
        let usage = Usage {
            prompt_tokens: prompt.len() as u64,
            accepted_per_position: vec![0; k],
            verified_per_position: vec![0; k],
            ..Default::default()
        };
        Sequence {
            id,
            arrival,
            params,
            seed,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_cached: 0,
            decoding: false,
            drafts: Vec::new(),
            block_table: Vec::new(),
            usage,
            sched: None,
            mtp_tail: None,
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
        self.sched = None;
        self.usage.preemptions += 1;
    }

    /// Appends an emitted token and checks the stop conditions in order.
    pub fn push_token(&mut self, tok: u32, eos: &[u32], max_model_len: usize) -> Option<FinishReason> {
        self.tokens.push(tok);
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
