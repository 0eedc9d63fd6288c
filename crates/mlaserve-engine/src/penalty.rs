//! The logit edits of a request's rows: its logit bias and its repetition, frequency and
//! presence penalties, as `mlaserve_core::logits` defines them (vLLM's semantics: the
//! frequency and presence penalties count the generated tokens, the repetition penalty
//! applies to every token of the prompt or the output).
//!
//! Row `j` of a decode window decides the token after drafts `d1..dj`, and is only used
//! when those were all accepted, i.e. when they are the output; so its edits count them
//! as generated ([`Penalties::row_edits`] with `extra = d1..dj`). Every emitted token was
//! therefore chosen with the edits of exactly the output before it, whatever k was.

use std::collections::{BTreeMap, HashMap};

use mlaserve_core::{penalty_sub, LogitEdit, SamplingParams};

/// A request's penalty state: the output's token counts and the prompt's tokens.
#[derive(Debug, Clone, Default)]
pub(crate) struct Penalties {
    /// Occurrences of each generated token.
    counts: HashMap<u32, u32>,
    /// The prompt's distinct tokens, ascending (only with a repetition penalty).
    prompt: Vec<u32>,
}

/// Whether a request's rows carry edits at all.
pub(crate) fn has_edits(p: &SamplingParams) -> bool {
    !p.logit_bias.is_empty() || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 || p.repetition_penalty != 1.0
}

impl Penalties {
    /// The state of a request with `params` and `prompt`, or `None` without edits.
    pub fn new(params: &SamplingParams, prompt: &[u32]) -> Option<Box<Self>> {
        if !has_edits(params) {
            return None;
        }
        let mut p = Penalties::default();
        if params.repetition_penalty != 1.0 {
            p.prompt = prompt.to_vec();
            p.prompt.sort_unstable();
            p.prompt.dedup();
        }
        Some(Box::new(p))
    }

    /// Counts a generated token.
    pub fn push(&mut self, tok: u32) {
        *self.counts.entry(tok).or_insert(0) += 1;
    }

    /// The edits of a row that decides the token after the output plus `extra` (drafts
    /// taken as generated), ascending by token, into `out` (cleared first).
    pub fn row_edits(&self, params: &SamplingParams, extra: &[u32], out: &mut Vec<LogitEdit>) {
        out.clear();
        let rep = params.repetition_penalty;
        let mut m: BTreeMap<u32, (f32, bool, u32)> = BTreeMap::new();
        for &(t, b) in &params.logit_bias {
            m.entry(t).or_default().0 += b;
        }
        if rep != 1.0 {
            for &t in &self.prompt {
                m.entry(t).or_default().1 = true;
            }
        }
        let extra_counts = extra.iter().fold(HashMap::<u32, u32>::new(), |mut c, &t| {
            *c.entry(t).or_insert(0) += 1;
            c
        });
        for (&t, &n) in self.counts.iter().chain(extra_counts.iter()) {
            let e = m.entry(t).or_default();
            e.1 = true;
            e.2 += n;
        }
        let (freq, pres) = (params.frequency_penalty, params.presence_penalty);
        out.extend(m.into_iter().map(|(token, (bias, seen, count))| LogitEdit {
            token,
            bias,
            repetition: if seen { rep } else { 1.0 },
            sub: penalty_sub(freq, pres, count),
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_count_the_output_and_the_drafts() {
        let params = SamplingParams {
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            repetition_penalty: 2.0,
            logit_bias: vec![(9, 3.0)],
            ..Default::default()
        };
        let mut p = Penalties::new(&params, &[4, 4, 2]).expect("edits");
        p.push(7);
        p.push(4);
        let mut out = Vec::new();
        p.row_edits(&params, &[7], &mut out);
        let e = |token, bias, repetition, sub| LogitEdit { token, bias, repetition, sub };
        assert_eq!(out, vec![e(2, 0.0, 2.0, 0.0), e(4, 0.0, 2.0, 0.75), e(7, 0.0, 2.0, 1.0), e(9, 3.0, 1.0, 0.0)]);
        assert!(Penalties::new(&SamplingParams::default(), &[1]).is_none());
    }
}
