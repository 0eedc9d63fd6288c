//! Request validation: every bad input is refused with INVALID_ARGUMENT naming the
//! field, before any work is queued. The rules are `mlaserve_core::request`'s, the same
//! the engine applies; this module maps the public request onto them, tokenizes a text
//! prompt, and resolves the defaults. Cheap checks run before tokenization.

use crate::error::RouterError;
use mlaserve_core::request::{self, InvalidField};
use mlaserve_proto::v1::{generate_request::Prompt, GenerateRequest};
use mlaserve_proto::worker::{LogitBias as WireBias, SamplingParams as WireSampling, StoppingCriteria as WireStopping};

pub use mlaserve_core::request::{DEFAULT_MAX_NEW_TOKENS, MAX_STOP_BYTES, MAX_STOP_STRINGS};
/// What validation needs to know about the served model.
pub use mlaserve_core::RequestLimits as ModelLimits;

/// A request that passed validation, with its prompt tokenized.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub prompt: Vec<u32>,
    pub sampling: WireSampling,
    pub stopping: WireStopping,
    pub stop: Vec<String>,
    pub keep_special_tokens: bool,
    pub echo_prompt_ids: bool,
    /// Choices to generate (`GenerateRequest.n`).
    pub n: u32,
}

/// Most choices (`GenerateRequest.n`) one request may ask for.
pub const MAX_CHOICES: u32 = 16;

impl From<InvalidField> for RouterError {
    fn from(e: InvalidField) -> Self {
        RouterError::Invalid { field: e.field, msg: e.msg }
    }
}

/// Bytes of text allowed per token of the served context, checked before tokenizing.
pub const TEXT_BYTES_PER_TOKEN: usize = 64;

/// The cheap bound a text passes before it is tokenized: at most
/// [`TEXT_BYTES_PER_TOKEN`] bytes per token of the served context. Only texts that could
/// never fit are refused (a token is rarely longer than a few bytes), and the memory the
/// tokenizer takes for one text (about 200 times its size) stays bounded.
pub fn check_text_bytes(field: &str, text: &str, limits: ModelLimits) -> Result<(), RouterError> {
    let max = TEXT_BYTES_PER_TOKEN * limits.max_context as usize;
    if text.len() > max {
        return Err(RouterError::invalid(
            field,
            format!(
                "{} bytes is over the limit of {max} ({TEXT_BYTES_PER_TOKEN} per token of the served context of {} \
                 tokens, max_model_len)",
                text.len(),
                limits.max_context
            ),
        ));
    }
    Ok(())
}

/// Validates `req`; `tokenize` turns a text prompt into ids (BOS included).
pub fn validate(
    req: &GenerateRequest,
    limits: ModelLimits,
    tokenize: impl FnOnce(&str) -> Result<Vec<u32>, RouterError>,
) -> Result<ValidRequest, RouterError> {
    let s = req.sampling.clone().unwrap_or_default();
    let (temperature, top_k, top_p) = (s.temperature.unwrap_or(0.0), s.top_k.unwrap_or(0), s.top_p.unwrap_or(1.0));
    request::check_sampling(temperature, top_k as i64, top_p)?;
    let logit_bias: Vec<(u32, f32)> = s.logit_bias.iter().map(|b| (b.token_id, b.bias)).collect();
    let extra = request::SamplingExtra {
        presence_penalty: s.presence_penalty.unwrap_or(0.0),
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        min_p: s.min_p.unwrap_or(0.0),
        logit_bias: &logit_bias,
        logprobs: s.logprobs,
    };
    request::check_sampling_extra(extra, limits.vocab_size)?;
    let n = req.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(RouterError::invalid("n", format!("must be in 1..={MAX_CHOICES}, got {n}")));
    }
    let st = req.stopping.clone().unwrap_or_default();
    request::check_stopping(st.max_new_tokens, &st.stop_token_ids, &st.stop, limits.vocab_size)?;

    let (field, prompt) = match &req.prompt {
        None => return Err(RouterError::invalid("prompt", "must be set (text or token_ids)")),
        Some(Prompt::TokenIds(t)) => ("prompt.token_ids", t.ids.clone()),
        Some(Prompt::Text(t)) if t.is_empty() => return Err(RouterError::invalid("prompt.text", "must not be empty")),
        Some(Prompt::Text(t)) => {
            check_text_bytes("prompt.text", t, limits)?;
            ("prompt.text", tokenize(t)?)
        }
    };
    request::check_prompt(&prompt, field, limits)?;
    let max_new_tokens = request::resolve_max_new_tokens(st.max_new_tokens, prompt.len(), limits)?;
    Ok(ValidRequest {
        prompt,
        sampling: WireSampling {
            temperature,
            top_k: top_k as u32,
            top_p,
            seed: s.seed,
            presence_penalty: extra.presence_penalty,
            frequency_penalty: extra.frequency_penalty,
            repetition_penalty: Some(extra.repetition_penalty),
            min_p: extra.min_p,
            logit_bias: s.logit_bias.iter().map(|b| WireBias { token_id: b.token_id, bias: b.bias }).collect(),
            logprobs: s.logprobs,
        },
        stopping: WireStopping { max_new_tokens, stop_token_ids: st.stop_token_ids, ignore_eos: st.ignore_eos },
        stop: st.stop,
        keep_special_tokens: req.keep_special_tokens,
        echo_prompt_ids: req.echo_prompt_ids,
        n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlaserve_proto::v1::{SamplingParams, StoppingCriteria, TokenIds};

    const LIMITS: ModelLimits = ModelLimits { vocab_size: 100, max_context: 50 };

    fn req(prompt: Option<Prompt>) -> GenerateRequest {
        GenerateRequest { prompt, ..Default::default() }
    }

    fn text(t: &str) -> GenerateRequest {
        req(Some(Prompt::Text(t.into())))
    }

    fn chars(t: &str) -> Result<Vec<u32>, RouterError> {
        Ok(t.bytes().map(|b| b as u32 % 100).collect())
    }

    fn field_of(r: &GenerateRequest) -> String {
        match validate(r, LIMITS, chars) {
            Err(RouterError::Invalid { field, .. }) => field,
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        }
    }

    fn with_sampling(s: SamplingParams) -> GenerateRequest {
        GenerateRequest { sampling: Some(s), ..text("hi") }
    }

    fn with_stopping(s: StoppingCriteria) -> GenerateRequest {
        GenerateRequest { stopping: Some(s), ..text("hi") }
    }

    #[test]
    fn defaults() {
        let v = validate(&text("hello"), LIMITS, chars).expect("valid");
        assert_eq!(v.prompt.len(), 5);
        assert_eq!(v.stopping.max_new_tokens, 45, "default clipped to the room left");
        assert_eq!(v.sampling.temperature, 0.0);
        assert_eq!(v.sampling.top_p, 1.0);
    }

    #[test]
    fn prompt_fields() {
        assert_eq!(field_of(&req(None)), "prompt");
        assert_eq!(field_of(&text("")), "prompt.text");
        assert_eq!(field_of(&req(Some(Prompt::TokenIds(TokenIds { ids: vec![] })))), "prompt.token_ids");
        assert_eq!(field_of(&req(Some(Prompt::TokenIds(TokenIds { ids: vec![1, 100] })))), "prompt.token_ids[1]");
        assert_eq!(field_of(&text(&"x".repeat(50))), "prompt.text");
        assert_eq!(field_of(&text(&"x".repeat(100_000))), "prompt.text");
    }

    #[test]
    fn sampling_fields() {
        for t in [-0.1, f32::NAN, f32::INFINITY] {
            let r = with_sampling(SamplingParams { temperature: Some(t), ..Default::default() });
            assert_eq!(field_of(&r), "sampling.temperature");
        }
        for p in [0.0, -1.0, 1.01, f32::NAN] {
            let r = with_sampling(SamplingParams { top_p: Some(p), ..Default::default() });
            assert_eq!(field_of(&r), "sampling.top_p");
        }
        let r = with_sampling(SamplingParams { top_k: Some(-1), ..Default::default() });
        assert_eq!(field_of(&r), "sampling.top_k");
        let ok = with_sampling(SamplingParams {
            temperature: Some(0.7),
            top_k: Some(5),
            top_p: Some(1.0),
            seed: Some(3),
            ..Default::default()
        });
        assert!(validate(&ok, LIMITS, chars).is_ok());
    }

    #[test]
    fn penalties_bias_and_logprobs() {
        use mlaserve_proto::v1::LogitBias;
        let bias = |token_id, bias| LogitBias { token_id, bias };
        let cases = [
            (SamplingParams { presence_penalty: Some(-2.5), ..Default::default() }, "sampling.presence_penalty"),
            (SamplingParams { frequency_penalty: Some(3.0), ..Default::default() }, "sampling.frequency_penalty"),
            (SamplingParams { repetition_penalty: Some(0.0), ..Default::default() }, "sampling.repetition_penalty"),
            (SamplingParams { min_p: Some(-0.1), ..Default::default() }, "sampling.min_p"),
            (
                SamplingParams { logit_bias: vec![bias(1, 0.0), bias(100, 1.0)], ..Default::default() },
                "sampling.logit_bias[1]",
            ),
            (SamplingParams { logprobs: Some(21), ..Default::default() }, "sampling.logprobs"),
        ];
        for (s, field) in cases {
            assert_eq!(field_of(&with_sampling(s)), field);
        }
        let v = validate(
            &with_sampling(SamplingParams {
                presence_penalty: Some(0.5),
                frequency_penalty: Some(-0.5),
                min_p: Some(0.1),
                logit_bias: vec![bias(7, -100.0)],
                logprobs: Some(3),
                ..Default::default()
            }),
            LIMITS,
            chars,
        )
        .expect("valid");
        let s = v.sampling;
        assert_eq!(
            (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p),
            (0.5, -0.5, Some(1.0), 0.1)
        );
        assert_eq!((s.logit_bias.len(), s.logit_bias[0].token_id, s.logprobs), (1, 7, Some(3)));
    }

    #[test]
    fn stopping_fields() {
        let r = with_stopping(StoppingCriteria { max_new_tokens: Some(0), ..Default::default() });
        assert_eq!(field_of(&r), "stopping.max_new_tokens");
        let r = with_stopping(StoppingCriteria { max_new_tokens: Some(49), ..Default::default() });
        assert_eq!(field_of(&r), "stopping.max_new_tokens");
        let r = with_stopping(StoppingCriteria { max_new_tokens: Some(48), ..Default::default() });
        assert!(validate(&r, LIMITS, chars).is_ok());
        let r = with_stopping(StoppingCriteria { stop: vec!["a".into(); 17], ..Default::default() });
        assert_eq!(field_of(&r), "stopping.stop");
        let r = with_stopping(StoppingCriteria { stop: vec!["a".into(), String::new()], ..Default::default() });
        assert_eq!(field_of(&r), "stopping.stop[1]");
        let r = with_stopping(StoppingCriteria { stop: vec!["a".repeat(257)], ..Default::default() });
        assert_eq!(field_of(&r), "stopping.stop[0]");
        let r = with_stopping(StoppingCriteria { stop_token_ids: vec![3, 100], ..Default::default() });
        assert_eq!(field_of(&r), "stopping.stop_token_ids[1]");
    }
}
