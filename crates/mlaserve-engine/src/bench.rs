//! `bench_engine`: the engine's host-side cost per step (scheduling, batch building,
//! verification, stop checks, events, draft batch building) with many running
//! requests, measured as step wall time minus the time spent inside the backend.
//! It runs on [`SyntheticBackend`], whose vocabulary size sets the cost of the
//! logits math (argmax or sampling over each row), reported with the result. That math
//! is the backend's (`Batch::argmax_rows`, `Batch::sample_rows`: on the GPU it runs on the
//! device), so it falls in the excluded backend time; the engine's share of a sampled
//! row is drawing its uniform and comparing the returned id with the draft.

use crate::api::{EngineConfig, Request, SamplingParams};
use crate::engine::Engine;
use crate::error::Result;
use crate::testing::SyntheticBackend;
use mlaserve_core::{Backend, Batch, ForwardOutput, ModelConfig};
use std::time::Instant;

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Running (decoding) requests.
    pub running: usize,
    /// Draft tokens per step.
    pub k: usize,
    /// Vocabulary of the synthetic model (the per-row logits work).
    pub vocab: usize,
    pub prompt_len: usize,
    /// Measured steps (after every request reached decoding).
    pub steps: usize,
    /// Sample with temperature 1 instead of greedy (the backend samples each row).
    pub sampled: bool,
    /// MTP layers of the synthetic model; `None`: `k` (every draft stage its own layer,
    /// the most host work). DeepSeek-V3/R1 checkpoints have one (a reused chain).
    pub mtp_layers: Option<usize>,
}

impl Default for BenchConfig {
    fn default() -> Self {
        BenchConfig { running: 256, k: 3, vocab: 16, prompt_len: 32, steps: 500, sampled: false, mtp_layers: None }
    }
}

/// Per-step host time, in microseconds.
#[derive(Debug, Clone)]
pub struct BenchReport {
    pub config: BenchConfig,
    pub median_us: f64,
    pub p90_us: f64,
    pub mean_us: f64,
    /// Median of the backend's own time per step (not counted above).
    pub median_backend_us: f64,
    /// Mean per step of the engine's own phase timers: schedule (with batch
    /// building), verify (with stop checks and events), drafting minus MTP forwards.
    pub mean_phase_us: [f64; 3],
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = &self.config;
        write!(
            f,
            "engine host time per step: {} running, k={}, {} MTP layer(s), vocab {}, {}: median {:.1} us, p90 {:.1} us, \
             mean {:.1} us over {} steps (phases, mean: schedule {:.1}, verify {:.1}, draft {:.1}; \
             synthetic backend time, excluded: median {:.1} us)",
            c.running,
            c.k,
            c.mtp_layers.unwrap_or(c.k).max(1),
            c.vocab,
            if c.sampled { "sampled (T = 1, by the backend)" } else { "greedy" },
            self.median_us,
            self.p90_us,
            self.mean_us,
            c.steps,
            self.mean_phase_us[0],
            self.mean_phase_us[1],
            self.mean_phase_us[2],
            self.median_backend_us
        )
    }
}

/// Wraps a backend and adds up the nanoseconds spent inside it.
struct Timed<B> {
    inner: B,
    ns: u64,
}

impl<B: Backend> Backend for Timed<B> {
    type Hidden = B::Hidden;
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn memory_plan(&self) -> Option<mlaserve_core::memory::MemoryPlan> {
        self.inner.memory_plan()
    }
    fn forward(&mut self, batch: &Batch) -> mlaserve_core::Result<ForwardOutput<B::Hidden>> {
        let t = Instant::now();
        let r = self.inner.forward(batch);
        self.ns += t.elapsed().as_nanos() as u64;
        r
    }
    fn mtp_forward(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &B::Hidden,
        hidden_rows: &[u32],
    ) -> mlaserve_core::Result<ForwardOutput<B::Hidden>> {
        let t = Instant::now();
        let r = self.inner.mtp_forward(layer, batch, prev, hidden_rows);
        self.ns += t.elapsed().as_nanos() as u64;
        r
    }
    fn hidden_to_host(&self, h: &B::Hidden) -> mlaserve_core::Result<Vec<f32>> {
        self.inner.hidden_to_host(h)
    }
    fn concat_hidden(&mut self, parts: &[(&B::Hidden, &[u32])]) -> mlaserve_core::Result<B::Hidden> {
        let t = Instant::now();
        let r = self.inner.concat_hidden(parts);
        self.ns += t.elapsed().as_nanos() as u64;
        r
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Runs the benchmark described by `cfg`.
pub fn bench_engine(cfg: &BenchConfig) -> Result<BenchReport> {
    let max_len = cfg.prompt_len + (cfg.steps + 64) * (cfg.k + 1) + 16;
    let blocks_per = crate::block::blocks_for(max_len + 2 * cfg.k) + 1;
    let backend = SyntheticBackend::new(
        cfg.vocab,
        cfg.mtp_layers.unwrap_or(cfg.k).max(1),
        cfg.running * blocks_per,
        max_len + 64,
    );
    let config = EngineConfig {
        num_speculative_tokens: Some(cfg.k),
        max_batch_tokens: cfg.running * (cfg.k + 1) + cfg.running * cfg.prompt_len,
        max_num_seqs: cfg.running,
        max_model_len: Some(max_len),
        ..Default::default()
    };
    let mut engine = Engine::new(Timed { inner: backend, ns: 0 }, config)?;
    for i in 0..cfg.running {
        let prompt = (0..cfg.prompt_len).map(|j| ((i * 7 + j * 3) % cfg.vocab) as u32).collect();
        let sampling = SamplingParams {
            temperature: if cfg.sampled { 1.0 } else { 0.0 },
            max_new_tokens: (max_len - cfg.prompt_len) as u32,
            ignore_eos: true,
            seed: Some(i as u64),
            ..Default::default()
        };
        engine.add_request(Request::new(prompt, sampling))?;
    }
    // Prefill everything, then a few warm-up decode steps.
    for _ in 0..8 {
        engine.step();
    }
    let t0 = engine.stats().times;
    let mut host = Vec::with_capacity(cfg.steps);
    let mut backend = Vec::with_capacity(cfg.steps);
    for _ in 0..cfg.steps {
        let ns0 = engine.backend().ns;
        let t = Instant::now();
        let events = engine.step();
        let wall = t.elapsed().as_nanos() as u64;
        drop(events);
        let b = engine.backend().ns - ns0;
        host.push(wall.saturating_sub(b) as f64 / 1000.0);
        backend.push(b as f64 / 1000.0);
    }
    let mean = host.iter().sum::<f64>() / host.len().max(1) as f64;
    let t1 = engine.stats().times;
    let per = |a: u64, b: u64| (b - a) as f64 / cfg.steps.max(1) as f64;
    let mean_phase_us = [
        per(t0.schedule_us, t1.schedule_us),
        per(t0.verify_us, t1.verify_us),
        per(t0.draft_us - t0.draft_forward_us, t1.draft_us - t1.draft_forward_us),
    ];
    host.sort_by(f64::total_cmp);
    backend.sort_by(f64::total_cmp);
    Ok(BenchReport {
        config: cfg.clone(),
        median_us: percentile(&host, 0.5),
        p90_us: percentile(&host, 0.9),
        mean_us: mean,
        median_backend_us: percentile(&backend, 0.5),
        mean_phase_us,
    })
}
