//! Per-request sampling parameters, shared by the router (validation) and the engine.

/// How a request's tokens are chosen and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: u32,
    /// 1 means no nucleus cut.
    pub top_p: f32,
    /// Seed of the request's counter-based RNG; `None` draws one at admission.
    pub seed: Option<u64>,
    pub max_new_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    /// Token-id sequences that end the generation when they appear in the output.
    pub stop_sequences: Vec<Vec<u32>>,
    pub ignore_eos: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_new_tokens: 64,
            stop_token_ids: Vec::new(),
            stop_sequences: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}
