//! Start-up calibration of adaptive speculation (`EngineConfig::calibration_rows`):
//! before the engine serves, it times a cycle of every k at 1, 2, 4, … decode rows on
//! throwaway requests, so the policy starts from measured costs at every batch size
//! instead of trying each k on the first requests of each size (docs/engine.md, "k").
//!
//! The requests run through the very steps serving runs (on the CUDA backend the first
//! step of a shape captures its graphs, and captures give no sample, as in serving), with
//! k forced per stretch, the most drafts first. Only their cost samples stay: no prefix
//! is looked up or cached, their acceptance and the decisions are forgotten, and the
//! totals, step times and request ids are as before the calibration.

use super::{blocks_for_len, Engine};
use crate::api::{Event, FinishReason, Request, SamplingParams};
use crate::error::{EngineError, Result};
use crate::speculation::Policy;
use mlaserve_core::Backend;

/// Prompt tokens of a throwaway request (a chat turn's order of magnitude).
const PROMPT: usize = 64;
/// Most steps one (rows, k) may take: prefill steps, and steps that capture a graph,
/// give no sample.
const MAX_STEPS: usize = 3 * Policy::CALIBRATION_SAMPLES;

/// What [`Engine::calibrate`] measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calibration {
    /// The decode rows calibrated (powers of two).
    pub rows: Vec<usize>,
    /// Why it stopped below the rows asked for, if it did.
    pub stopped: Option<String>,
    /// Engine steps it took.
    pub steps: u64,
}

impl<B: Backend> Engine<B> {
    /// Times every k at 1, 2, 4, … up to `max_rows` decode rows (see the module docs).
    /// Nothing to do for a fixed k. Needs an idle engine; a backend failure fails it.
    pub fn calibrate(&mut self, max_rows: usize) -> Result<Calibration> {
        if !self.policy.is_adaptive() || max_rows == 0 {
            return Ok(Calibration::default());
        }
        if self.has_work() {
            return Err(EngineError::Config("speculation calibration needs an idle engine".into()));
        }
        let saved = (self.finished_totals.clone(), self.finished_requests, self.times, self.next_id);
        let prefix = self.blocks.suspend_prefix();
        let result = self.calibrate_rows(max_rows);
        // Whatever happened, the throwaway requests go, with their events.
        self.drop_requests();
        self.blocks.resume_prefix(prefix);
        (self.finished_totals, self.finished_requests, self.times, self.next_id) = saved;
        self.last_k = self.lim.k;
        self.policy.end_calibration();
        result
    }

    fn calibrate_rows(&mut self, max_rows: usize) -> Result<Calibration> {
        let k_max = self.lim.k;
        // The stretch of each k at most MAX_STEPS steps of at most 1 + k tokens.
        let new = MAX_STEPS * (k_max + 1) * (k_max + 2) / 2;
        let prompt = PROMPT.min(self.max_model_len / 2);
        let new = new.min(self.max_model_len - prompt);
        let per_request = blocks_for_len(&self.lim, prompt + new);
        let mut cal = Calibration::default();
        let mut n = 1;
        while n <= max_rows {
            if n > self.lim.max_num_seqs || n * per_request > self.blocks.num_free() {
                cal.stopped = Some(format!(
                    "{n} requests of {} tokens exceed max_num_seqs {} or the {} free KV cache blocks",
                    prompt + new,
                    self.lim.max_num_seqs,
                    self.blocks.num_free()
                ));
                break;
            }
            for i in 0..n {
                let tokens = (0..prompt)
                    .map(|j| (crate::rng::mix64(((n + i) * prompt + j) as u64) % self.vocab as u64) as u32)
                    .collect();
                let sampling = SamplingParams { max_new_tokens: new as u32, ignore_eos: true, ..Default::default() };
                self.add_request(Request::new(tokens, sampling))?;
            }
            // The prompts first: prefill steps give no sample, and would eat a stretch's
            // steps (64 prompts at a 256-token budget take 16).
            let prefill_steps = n * prompt / self.lim.max_batch_tokens.max(1) + 4;
            for _ in 0..prefill_steps {
                if self.waiting.is_empty() && self.running.iter().all(|s| s.decoding) {
                    break;
                }
                let events = self.step();
                cal.steps += 1;
                if let Some(why) = failure(&events) {
                    return Err(calibration_error(n, None, why));
                }
            }
            for k in (0..=k_max).rev() {
                self.policy.forced = vec![k];
                let want =
                    (self.policy.samples(n, k) + Policy::CALIBRATION_SAMPLES).min(2 * Policy::CALIBRATION_SAMPLES);
                for _ in 0..MAX_STEPS {
                    if self.policy.samples(n, k) >= want {
                        break;
                    }
                    let events = self.step();
                    cal.steps += 1;
                    if let Some(why) = failure(&events) {
                        return Err(calibration_error(n, Some(k), why));
                    }
                }
            }
            self.drop_requests();
            cal.rows.push(n);
            n *= 2;
        }
        Ok(cal)
    }

    /// Aborts every request, running or waiting, and drops their events.
    fn drop_requests(&mut self) {
        let ids: Vec<_> = self.running.iter().chain(self.waiting.iter()).map(|s| s.id).collect();
        for id in ids {
            let _ = self.abort(id);
        }
        self.pending.clear();
    }
}

fn calibration_error(n: usize, k: Option<usize>, why: &str) -> EngineError {
    let at = k.map_or(String::new(), |k| format!(", k = {k}"));
    EngineError::Backend(mlaserve_core::Error::Backend(format!("speculation calibration at {n} rows{at}: {why}")))
}

/// Why a request of a calibration step failed, if one did.
fn failure(events: &[(crate::api::RequestId, Event)]) -> Option<&str> {
    events.iter().find_map(|(_, e)| match e {
        Event::Finished { reason: FinishReason::Error(m) | FinishReason::Unavailable(m), .. } => Some(m.as_str()),
        _ => None,
    })
}
