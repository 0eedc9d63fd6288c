//! What happens to a logits row between the model and the token choice, written once for
//! every backend: per-token edits (logit bias and the repetition, frequency and presence
//! penalties, [`LogitEdit`]) and log-probabilities ([`row_logprobs`]).
//!
//! The order, as vLLM runs it:
//!
//! 1. Log-probabilities of the *raw* row (the model's distribution, before any edit,
//!    temperature or cut: what OpenAI's `logprobs` report and vLLM's default mode).
//! 2. Logit bias, then the penalties ([`LogitEdit::apply`]).
//! 3. The choice: the argmax of the edited row (greedy), or the sampling rule
//!    ([`crate::sampling::target_distribution`]: temperature, top-k, min-p, top-p) over it.
//!
//! A backend applies a row's edits (`Batch::edits`) in place before its argmax or sample
//! and computes the log-probabilities of `Batch::logprob_rows` from the unedited row.
//! [`host_choices`] is all of it on the host, for host backends and tests.

use crate::backend::{argmax, Batch};
use crate::sampling::SampleRow;

/// Most `top_logprobs` a request may ask for (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

/// One token's edit in one row: `bias` is added, then the repetition penalty divides a
/// positive logit or multiplies a negative one (`repetition == 1`: untouched), then
/// `sub` (the frequency and presence penalties of the token's count) is subtracted.
/// Every step is one f32 operation, so every backend gets the same bits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitEdit {
    pub token: u32,
    pub bias: f32,
    /// `> 0`; 1 for a token that neither the prompt nor the output holds.
    pub repetition: f32,
    /// `frequency · count + presence` (as [`penalty_sub`] rounds it); 0 for a token the
    /// output does not hold.
    pub sub: f32,
}

impl LogitEdit {
    /// The edited logit.
    pub fn apply(&self, l: f32) -> f32 {
        let l = l + self.bias;
        let l = if self.repetition == 1.0 {
            l
        } else if l > 0.0 {
            l / self.repetition
        } else {
            l * self.repetition
        };
        l - self.sub
    }
}

/// The subtracted amount of a token the output holds `count` times (`count > 0`): the
/// frequency penalty per occurrence plus the presence penalty, in f32 as the edit
/// carries it.
pub fn penalty_sub(frequency: f32, presence: f32, count: u32) -> f32 {
    if count == 0 {
        0.0
    } else {
        frequency * count as f32 + presence
    }
}

/// The edits of one row (`Batch::edits`): applied to the row's logits before its argmax
/// or sample. A token appears at most once.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowEdits {
    pub row: u32,
    pub edits: Vec<LogitEdit>,
}

impl RowEdits {
    /// Applies the edits to `logits` (the row's full vocabulary).
    pub fn apply(&self, logits: &mut [f32]) {
        for e in &self.edits {
            if let Some(l) = logits.get_mut(e.token as usize) {
                *l = e.apply(*l);
            }
        }
    }
}

/// A row whose log-probabilities are returned (`Batch::logprob_rows`): of the token the
/// row chooses and of its `top` most likely tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogprobRow {
    pub row: u32,
    /// At most [`MAX_TOP_LOGPROBS`].
    pub top: u32,
}

/// Log-probabilities of one row (`ForwardOutput::logprobs`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RowLogprobs {
    /// Of the token the row chose.
    pub logprob: f32,
    /// The `top` most likely tokens, most likely first (equal logits: lower id first).
    pub top: Vec<(u32, f32)>,
}

/// The log-softmax of a raw logits row at `chosen` and at its `top` largest entries.
///
/// With `m` the largest non-NaN logit, `logprob_i = (l_i − m) as f64 − ln Σ_j exp((l_j − m)
/// as f64)` over the non-NaN `j` (f32 differences, f64 sums, the result rounded to f32).
/// A NaN logit has logprob NaN and is never among the top; when `m` is ±∞ or no entry is
/// a number, the largest entries get 0 and every other −∞ (the argmax rule's one-hot).
/// The top are ordered by logit descending in IEEE total order, then id ascending — the
/// order top-k uses.
pub fn row_logprobs(logits: &[f32], chosen: u32, top: usize) -> RowLogprobs {
    let m = logits.iter().copied().filter(|v| !v.is_nan()).fold(f32::NEG_INFINITY, f32::max);
    let lp: Box<dyn Fn(f32) -> f32> = if m.is_finite() {
        let z: f64 = logits.iter().filter(|v| !v.is_nan()).map(|&v| ((v - m) as f64).exp()).sum();
        let lz = z.ln();
        Box::new(move |v: f32| ((v - m) as f64 - lz) as f32)
    } else {
        Box::new(move |v: f32| {
            if v.is_nan() {
                f32::NAN
            } else if v == m {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
    };
    let mut order: Vec<u32> = (0..logits.len() as u32).filter(|&i| !logits[i as usize].is_nan()).collect();
    let by_logit_desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    let top = top.min(order.len());
    if top > 0 && top < order.len() {
        order.select_nth_unstable_by(top - 1, by_logit_desc);
    }
    order.truncate(top);
    order.sort_unstable_by(by_logit_desc);
    let logprob = logits.get(chosen as usize).map_or(f32::NAN, |&v| lp(v));
    RowLogprobs { logprob, top: order.iter().map(|&i| (i, lp(logits[i as usize]))).collect() }
}

/// The choices a batch asks for, made on the host: the argmax ids, the sampled ids and
/// the log-probabilities, in the orders of `argmax_rows`, `sample_rows` and
/// `logprob_rows`. `row_logits(row, buf)` writes the raw logits of a flattened row into
/// `buf` (cleared first). What every backend's answer must equal.
pub fn host_choices(batch: &Batch, mut row_logits: impl FnMut(u32, &mut Vec<f32>)) -> Choices {
    let mut buf = Vec::new();
    let mut edited = |row: u32, buf: &mut Vec<f32>| {
        buf.clear();
        row_logits(row, buf);
        if let Some(e) = batch.edits.iter().find(|e| e.row == row) {
            e.apply(buf);
        }
    };
    let argmax_ids: Vec<u32> = batch
        .argmax_rows
        .iter()
        .map(|&r| {
            edited(r, &mut buf);
            argmax(&buf)
        })
        .collect();
    let sampled: Vec<u32> = batch
        .sample_rows
        .iter()
        .map(|s: &SampleRow| {
            edited(s.row, &mut buf);
            s.sample(&buf)
        })
        .collect();
    let logprobs = batch
        .logprob_rows
        .iter()
        .map(|l| {
            let chosen = batch.chosen(l.row, &argmax_ids, &sampled).unwrap_or(0);
            buf.clear();
            row_logits(l.row, &mut buf);
            row_logprobs(&buf, chosen, l.top as usize)
        })
        .collect();
    Choices { argmax: argmax_ids, sampled, logprobs }
}

/// What [`host_choices`] returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Choices {
    pub argmax: Vec<u32>,
    pub sampled: Vec<u32>,
    pub logprobs: Vec<RowLogprobs>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_follow_their_definitions() {
        let e = |bias, repetition, sub| LogitEdit { token: 0, bias, repetition, sub };
        assert_eq!(e(1.0, 1.0, 0.0).apply(2.0), 3.0);
        assert_eq!(e(0.0, 2.0, 0.0).apply(3.0), 1.5, "a positive logit is divided");
        assert_eq!(e(0.0, 2.0, 0.0).apply(-3.0), -6.0, "a negative one multiplied");
        assert_eq!(e(-4.0, 2.0, 0.5).apply(3.0), -2.5, "bias, then repetition, then sub");
        assert_eq!(penalty_sub(0.5, 1.0, 3), 2.5);
        assert_eq!(penalty_sub(0.5, 1.0, 0), 0.0);
        let mut row = vec![1.0f32, 2.0, 3.0];
        RowEdits { row: 0, edits: vec![LogitEdit { token: 2, bias: -10.0, repetition: 1.0, sub: 0.0 }] }
            .apply(&mut row);
        assert_eq!(row, vec![1.0, 2.0, -7.0]);
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax() {
        let row = [1.0f32, 3.0, 2.0, 3.0, f32::NAN];
        let z: f64 = [1.0f64, 3.0, 2.0, 3.0].iter().map(|v| v.exp()).sum();
        let r = row_logprobs(&row, 2, 3);
        assert!((r.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(r.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 3, 2], "ties: lower id first");
        assert!((r.top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-6);
        assert!(row_logprobs(&row, 4, 0).logprob.is_nan());
        assert_eq!(row_logprobs(&row, 0, 99).top.len(), 4, "NaN is never among the top");
        let inf = row_logprobs(&[0.0, f32::INFINITY], 1, 2);
        assert_eq!((inf.logprob, inf.top), (0.0, vec![(1, 0.0), (0, f32::NEG_INFINITY)]));
    }
}
