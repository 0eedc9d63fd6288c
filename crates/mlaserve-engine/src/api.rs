//! The engine's public vocabulary: requests, events, finish reasons, usage, load and
//! statistics, and the engine configuration.
//!
//! This module is the contract with the serving layer (the gRPC worker builds on it):
//! change it only additively. Both the synchronous [`crate::Engine`] and the async
//! [`crate::EngineHandle`] speak these types.

pub use mlaserve_core::SamplingParams;

/// Largest number of draft tokens per decode step the engine supports.
pub const MAX_SPECULATIVE_TOKENS: usize = mlaserve_core::drafting::MAX_DRAFTS;

/// Engine-wide request identifier, unique for the life of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "req-{}", self.0)
    }
}

/// A generation request: prompt token ids and how to sample.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Request {
    /// Prompt token ids; must be non-empty and every id `< vocab_size`.
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
}

impl Request {
    pub fn new(prompt: Vec<u32>, sampling: SamplingParams) -> Self {
        Request { prompt, sampling }
    }
}

/// Why a generation stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop condition matched; the matching token(s) are the last ones emitted (the
    /// serving layer trims them from the text if it wants to).
    Stop(StopMatch),
    /// `max_new_tokens` generated, or the context length (`max_model_len`) reached.
    Length,
    /// Aborted by the caller (or the receiver of its events was dropped).
    Abort,
    /// The engine could not run the request (a backend failure of this step); the
    /// message says why. Serving reports it as INTERNAL.
    Error(String),
    /// The group failed for good (it lost a rank, or a collective failed) while the
    /// request was in it; the message says why. Serving reports it as UNAVAILABLE: the
    /// request may succeed on another group.
    Unavailable(String),
}

/// Which stop condition ended a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopMatch {
    /// An end-of-sequence id of the model (`eos_token_id`), unless `ignore_eos`.
    Eos(u32),
    /// One of the request's `stop_token_ids`.
    StopToken(u32),
    /// The request's `stop_sequences[index]` appeared at the end of the output.
    StopSequence(usize),
}

/// Token accounting of one request (also summed over the engine in [`EngineStats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u64,
    /// Tokens emitted to the caller.
    pub generated_tokens: u64,
    /// Draft tokens that entered a verify window (k per decode step).
    pub draft_tokens: u64,
    /// Draft tokens accepted by verification and emitted.
    pub accepted_tokens: u64,
    /// `accepted_per_position[j]`: how often draft `j + 1` was accepted and emitted.
    pub accepted_per_position: Vec<u64>,
    /// `verified_per_position[j]`: how often the verifier accepted draft `j + 1`, also
    /// when a stop condition then cut the run (the drafter's own accuracy).
    pub verified_per_position: Vec<u64>,
    /// Decode steps the request took part in (verify windows).
    pub decode_steps: u64,
    /// Times the request was preempted (its cache dropped and recomputed later).
    pub preemptions: u64,
    /// Prompt tokens found in the prefix cache at admission (not prefilled).
    pub cached_prompt_tokens: u64,
}

impl Usage {
    /// Mean tokens emitted per decode step (`1 + accepted / steps`); 0 with no step.
    pub fn mean_acceptance_length(&self) -> f64 {
        if self.decode_steps == 0 {
            0.0
        } else {
            1.0 + self.accepted_tokens as f64 / self.decode_steps as f64
        }
    }

    /// Adds another usage into this one (for totals).
    pub fn accumulate(&mut self, o: &Usage) {
        self.prompt_tokens += o.prompt_tokens;
        self.generated_tokens += o.generated_tokens;
        self.draft_tokens += o.draft_tokens;
        self.accepted_tokens += o.accepted_tokens;
        self.decode_steps += o.decode_steps;
        self.preemptions += o.preemptions;
        self.cached_prompt_tokens += o.cached_prompt_tokens;
        if self.accepted_per_position.len() < o.accepted_per_position.len() {
            self.accepted_per_position.resize(o.accepted_per_position.len(), 0);
        }
        for (a, b) in self.accepted_per_position.iter_mut().zip(&o.accepted_per_position) {
            *a += b;
        }
        if self.verified_per_position.len() < o.verified_per_position.len() {
            self.verified_per_position.resize(o.verified_per_position.len(), 0);
        }
        for (a, b) in self.verified_per_position.iter_mut().zip(&o.verified_per_position) {
            *a += b;
        }
    }
}

/// What a request's stream carries. A stream is zero or more `Tokens` then exactly one
/// `Finished`; no token is ever sent twice (not even across a preemption). A request with
/// `logprobs` gets a `Logprobs` event right after each `Tokens` event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// New token ids, in order (one to `1 + k` per step).
    Tokens(Vec<u32>),
    /// The log-probabilities of the tokens of the `Tokens` event just before, one per
    /// token (of the target model's raw distribution: `mlaserve_core::logits`).
    Logprobs(Vec<mlaserve_core::RowLogprobs>),
    /// The last event of a request.
    Finished { reason: FinishReason, usage: Usage },
}

/// Cheap load snapshot for load balancing (updated after every step).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Load {
    /// Requests admitted but not yet scheduled (including preempted ones).
    pub queued_requests: usize,
    /// Requests holding cache blocks (prefilling or decoding).
    pub running_requests: usize,
    /// Work left: prompt tokens still to prefill plus tokens still allowed to generate.
    pub outstanding_tokens: u64,
    pub kv_blocks_free: usize,
    pub kv_blocks_total: usize,
}

/// Cumulative wall time of the engine's steps, split by phase (microseconds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StepTimes {
    pub steps: u64,
    /// Choosing the step's work, allocating blocks, building the batch.
    pub schedule_us: u64,
    /// The target model's forward.
    pub forward_us: u64,
    /// Sampling and verification, stop conditions, bookkeeping of emitted tokens.
    pub verify_us: u64,
    /// MTP drafting (all stages, including building their batches).
    pub draft_us: u64,
    /// The part of `draft_us` spent inside the backend's MTP forwards.
    pub draft_forward_us: u64,
    /// CUDA graphs the backend captured so far (`Backend::graph_captures`).
    pub graph_captures: u64,
}

impl StepTimes {
    /// Host-side scheduling and bookkeeping: everything but the backend calls.
    pub fn bookkeeping_us(&self) -> u64 {
        self.schedule_us + self.verify_us + self.draft_us.saturating_sub(self.draft_forward_us)
    }
}

/// What the speculation policy chose and how well it predicted (see
/// [`Speculation::Adaptive`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecStats {
    /// `steps_per_k[k]`: drafting decisions that chose k drafts for the next step.
    pub steps_per_k: Vec<u64>,
    /// Accepted drafts the policy expected for the steps it chose k for.
    pub expected_accepted: f64,
    /// Drafts the verifier accepted, over every decode window.
    pub realised_accepted: u64,
    /// The cost estimates the choices use: per bucket of decode rows (its largest row
    /// count, a power of two), each k's measured cycle time per decode row in µs (the
    /// lower quartile of its recent samples; `None` where not measured there).
    pub costs: Vec<(usize, Vec<Option<f64>>)>,
    /// The overall acceptance rate of each draft position (posterior means).
    pub rates: Vec<f64>,
    /// The decisions per bucket of decode rows (its largest row count, a power of two):
    /// how many chose each k (adaptive speculation only).
    pub decisions: Vec<(usize, Vec<u64>)>,
}

/// Engine statistics: load, totals over finished and running requests, step times.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub load: Load,
    /// Most draft tokens per decode step (k, or k's maximum when adaptive).
    pub num_speculative_tokens: usize,
    /// How the steps' k were chosen.
    pub speculation: SpecStats,
    /// The prefix cache's counters (zero when it is off).
    pub prefix: crate::PrefixStats,
    /// Totals over every request seen (finished ones and the live ones' progress).
    pub totals: Usage,
    pub finished_requests: u64,
    pub times: StepTimes,
    /// Set once the backend failed for good (a collective error: the TP group lost a
    /// rank); every request was failed and new ones are refused.
    pub failed: Option<String>,
}

impl EngineStats {
    /// Fraction of drafted tokens accepted (0 when nothing was drafted).
    pub fn acceptance_rate(&self) -> f64 {
        if self.totals.draft_tokens == 0 {
            0.0
        } else {
            self.totals.accepted_tokens as f64 / self.totals.draft_tokens as f64
        }
    }
}

/// How each decode step's number of drafts is chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Speculation {
    /// Every decode step verifies `num_speculative_tokens` drafts.
    #[default]
    Fixed,
    /// Before each drafting pass the engine picks k in `0..=num_speculative_tokens` for
    /// the next step, maximising expected tokens per second from the acceptance it
    /// measures per draft position (overall and per request) and the step time it
    /// measures per (batch size, k). Output does not depend on the choice.
    Adaptive,
}

/// How the engine schedules. Defaults suit the CPU backend; the GPU worker sets its own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Draft tokens per decode step, `0..=4` (the most, with [`Speculation::Adaptive`]);
    /// `None`: 3 when the model has MTP layers, else 0.
    pub num_speculative_tokens: Option<usize>,
    /// Fixed k, or adaptive up to `num_speculative_tokens`.
    pub speculation: Speculation,
    /// Token budget per step (decode windows count `1 + k` each, plus prefill chunks).
    pub max_batch_tokens: usize,
    /// Most prompt tokens one step prefills while other requests decode in it, so a
    /// long prompt is chunked and their inter-token latency stays bounded; a step with
    /// no decodes prefills up to the whole budget. `None`: no cap below the budget.
    pub max_prefill_tokens: Option<usize>,
    /// Most requests holding cache at once.
    pub max_num_seqs: usize,
    /// Longest sequence (prompt + output). `None`: the model's
    /// `max_position_embeddings - 2 * MAX_SPECULATIVE_TOKENS` (the drafter writes up to
    /// `2k - 1` positions past the last cached token; the headroom does not depend on k
    /// so outputs do not either).
    pub max_model_len: Option<usize>,
    /// Requests waiting for admission beyond which `submit` refuses (backpressure).
    pub max_queued: usize,
    /// Seed of the per-request seeds drawn for requests that give none.
    pub seed: u64,
    /// Keep full cache blocks indexed by their prefix, so requests that share one
    /// prefill it once (`docs/engine.md`, "Prefix caching").
    pub enable_prefix_caching: bool,
    /// Adaptive speculation: before serving, time every k at 1, 2, 4, … up to this many
    /// decode rows on throwaway requests ([`crate::Engine::calibrate`]), so the choice
    /// starts from measured step costs. 0: off (each k is first tried on the traffic).
    pub calibration_rows: usize,
    /// Before serving, run every batch size the backend pads its CUDA graphs to (up to
    /// `max_num_seqs`) at every k the engine takes, on throwaway requests
    /// ([`crate::Engine::warm_up_graphs`]), so serving replays graphs where it would
    /// capture them. Nothing to do without graphs.
    pub warm_up_graphs: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            num_speculative_tokens: None,
            speculation: Speculation::Fixed,
            max_batch_tokens: 2048,
            max_prefill_tokens: None,
            max_num_seqs: 256,
            max_model_len: None,
            max_queued: 4096,
            seed: 0x6d6c_6173_6572_7665,
            enable_prefix_caching: true,
            calibration_rows: 0,
            warm_up_graphs: false,
        }
    }
}
