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
//!
//! The graph warm-up (`EngineConfig::warm_up_graphs`) runs throwaway requests the same
//! way at every batch size the backend pads its CUDA graphs to
//! (`Backend::graph_batch_sizes`), two steps at each k the engine can take (every k
//! with adaptive speculation), so that serving meets captured graphs at those sizes
//! instead of capturing them between its steps (with adaptive k, up to three times as
//! many shapes as a fixed k).

use super::{blocks_for_len, Engine};
use crate::api::{Event, FinishReason, Request, SamplingParams};
use crate::error::{EngineError, Result};
use crate::speculation::Policy;
use mlaserve_core::Backend;

/// Prompt tokens of a throwaway request (a chat turn's order of magnitude).
const PROMPT: usize = 64;
/// Prompt tokens of a warm-up request: its contexts stay within the smallest block-table
/// width a graph is captured for.
const WARM_PROMPT: usize = 16;
/// Steps of a warm-up at each k: the first drafts at the new k, the second verifies its
/// window and drafts again as every later step at that k does.
const WARM_STEPS: usize = 2;
/// Most steps one (rows, k) may take: prefill steps, and steps that capture a graph,
/// give no sample.
const MAX_STEPS: usize = 3 * Policy::CALIBRATION_SAMPLES;

/// What [`Engine::calibrate`] measured (or [`Engine::warm_up_graphs`] ran).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Calibration {
    /// The decode rows calibrated (powers of two), or warmed up.
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
        self.throwaway(|e| e.calibrate_rows(max_rows))
    }

    /// Runs every graph batch size of the backend up to `max_rows` at every k the
    /// engine takes (see the module docs). Nothing to do for a backend without graphs.
    /// Needs an idle engine; a backend failure fails it.
    pub fn warm_up_graphs(&mut self, max_rows: usize) -> Result<Calibration> {
        let sizes: Vec<usize> = self.backend.graph_batch_sizes().into_iter().filter(|&m| m <= max_rows).collect();
        if sizes.is_empty() {
            return Ok(Calibration::default());
        }
        self.throwaway(|e| e.warm_up_sizes(&sizes))
    }

    /// Runs `f` over throwaway requests: then drops them and restores what they touched
    /// but the policy's cost samples.
    fn throwaway(&mut self, f: impl FnOnce(&mut Self) -> Result<Calibration>) -> Result<Calibration> {
        if self.has_work() {
            return Err(EngineError::Config("the start-up calibration and graph warm-up need an idle engine".into()));
        }
        let saved = (self.finished_totals.clone(), self.finished_requests, self.times, self.next_id);
        let prefix = self.blocks.suspend_prefix();
        let result = f(self);
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
        let mut cal = Calibration::default();
        let mut n = 1;
        while n <= max_rows {
            let Some(prompt) = self.admit_throwaway(n, PROMPT, new, &mut cal) else { break };
            self.prefill_throwaway(n, prompt, &mut cal)?;
            for k in (0..=k_max).rev() {
                self.policy.forced = vec![k];
                let want =
                    (self.policy.samples(n, k) + Policy::CALIBRATION_SAMPLES).min(2 * Policy::CALIBRATION_SAMPLES);
                for _ in 0..MAX_STEPS {
                    if self.policy.samples(n, k) >= want {
                        break;
                    }
                    self.step_throwaway(n, Some(k), &mut cal)?;
                }
            }
            self.drop_requests();
            cal.rows.push(n);
            n *= 2;
        }
        Ok(cal)
    }

    fn warm_up_sizes(&mut self, sizes: &[usize]) -> Result<Calibration> {
        let ks: Vec<usize> =
            if self.policy.is_adaptive() { (0..=self.lim.k).rev().collect() } else { vec![self.lim.k] };
        let new = WARM_STEPS * ks.iter().map(|k| k + 1).sum::<usize>() + 1;
        let mut cal = Calibration::default();
        for &m in sizes {
            let Some(prompt) = self.admit_throwaway(m, WARM_PROMPT, new, &mut cal) else { break };
            self.prefill_throwaway(m, prompt, &mut cal)?;
            for &k in &ks {
                self.policy.forced = vec![k];
                for _ in 0..WARM_STEPS {
                    self.step_throwaway(m, Some(k), &mut cal)?;
                }
            }
            self.drop_requests();
            cal.rows.push(m);
        }
        Ok(cal)
    }

    /// Admits `n` throwaway requests of a `prompt`-token prompt (less for a short
    /// `max_model_len`) and up to `new` tokens, EOS ignored; returns the prompt's length.
    /// None, with `cal.stopped` saying why, where they do not fit.
    fn admit_throwaway(&mut self, n: usize, prompt: usize, new: usize, cal: &mut Calibration) -> Option<usize> {
        let prompt = prompt.min(self.max_model_len / 2);
        let new = new.min(self.max_model_len - prompt);
        if n > self.lim.max_num_seqs || n * blocks_for_len(&self.lim, prompt + new) > self.blocks.num_free() {
            cal.stopped = Some(format!(
                "{n} requests of {} tokens exceed max_num_seqs {} or the {} free KV cache blocks",
                prompt + new,
                self.lim.max_num_seqs,
                self.blocks.num_free()
            ));
            return None;
        }
        for i in 0..n {
            let tokens = (0..prompt)
                .map(|j| (crate::rng::mix64(((n + i) * prompt + j) as u64) % self.vocab as u64) as u32)
                .collect();
            let sampling = SamplingParams { max_new_tokens: new as u32, ignore_eos: true, ..Default::default() };
            if let Err(e) = self.add_request(Request::new(tokens, sampling)) {
                cal.stopped = Some(format!("{n} requests: {e}"));
                return None;
            }
        }
        Some(prompt)
    }

    /// Steps until the `n` throwaway requests all decode: prefill steps give no sample,
    /// and would eat a stretch's steps (64 prompts at a 256-token budget take 16).
    fn prefill_throwaway(&mut self, n: usize, prompt: usize, cal: &mut Calibration) -> Result<()> {
        for _ in 0..n * prompt / self.lim.max_batch_tokens.max(1) + 4 {
            if self.waiting.is_empty() && self.running.iter().all(|s| s.decoding) {
                break;
            }
            self.step_throwaway(n, None, cal)?;
        }
        Ok(())
    }

    /// One step of throwaway requests; a request it failed fails the calibration.
    fn step_throwaway(&mut self, n: usize, k: Option<usize>, cal: &mut Calibration) -> Result<()> {
        let events = self.step();
        cal.steps += 1;
        match failure(&events) {
            Some(why) => Err(calibration_error(n, k, why)),
            None => Ok(()),
        }
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
    EngineError::Backend(mlaserve_core::Error::Backend(format!(
        "start-up run (calibration or graph warm-up) at {n} rows{at}: {why}"
    )))
}

/// Why a request of a calibration step failed, if one did.
fn failure(events: &[(crate::api::RequestId, Event)]) -> Option<&str> {
    events.iter().find_map(|(_, e)| match e {
        Event::Finished { reason: FinishReason::Error(m) | FinishReason::Unavailable(m), .. } => Some(m.as_str()),
        _ => None,
    })
}
