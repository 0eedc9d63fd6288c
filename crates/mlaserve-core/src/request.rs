//! The rules a request must follow, written once: the router checks a client's request
//! with them before any work is queued, and the engine checks every request it is given
//! with the same functions. A broken rule is an [`InvalidField`] whose `field` is the
//! path the public API (`mlaserve.v1`) gives the field: `sampling.top_p`,
//! `stopping.stop[2]`, `prompt.token_ids[7]`.

use crate::sampling::SamplingParams;

/// Most stop strings per request (the OpenAI API allows 4, TGI more; we take 16).
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes (bounds the hold-back work per token).
pub const MAX_STOP_BYTES: usize = 256;
/// `max_new_tokens` when a request leaves it unset (clipped to the context left).
pub const DEFAULT_MAX_NEW_TOKENS: u32 = 256;

/// A request field that breaks a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {msg}")]
pub struct InvalidField {
    /// The field's path in the public API.
    pub field: String,
    pub msg: String,
}

impl InvalidField {
    pub fn new(field: impl Into<String>, msg: impl Into<String>) -> Self {
        InvalidField { field: field.into(), msg: msg.into() }
    }
}

/// What the checks need to know about the model being served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestLimits {
    pub vocab_size: u32,
    /// Longest sequence (prompt + generated tokens) a request may reach: the serving
    /// group's `max_model_len`.
    pub max_context: u32,
}

/// `sampling.*`: temperature finite and `>= 0` (0 is greedy), top-k `>= 0` (0: no cut),
/// top-p in `(0, 1]`.
pub fn check_sampling(temperature: f32, top_k: i64, top_p: f32) -> Result<(), InvalidField> {
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(InvalidField::new("sampling.temperature", format!("must be finite and >= 0, got {temperature}")));
    }
    if top_k < 0 {
        return Err(InvalidField::new("sampling.top_k", format!("must be >= 0 (0 = no cut), got {top_k}")));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(InvalidField::new("sampling.top_p", format!("must be in (0, 1], got {top_p}")));
    }
    Ok(())
}

/// Most `sampling.logit_bias` entries per request.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// The sampling fields beyond temperature, top-k and top-p, as the public API names them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingExtra<'a> {
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub min_p: f32,
    pub logit_bias: &'a [(u32, f32)],
    pub logprobs: Option<u32>,
}

/// `sampling.*` beyond [`check_sampling`]: presence and frequency penalties in `[-2, 2]`
/// (OpenAI's range), repetition penalty finite and `> 0`, min-p in `[0, 1]`, at most
/// [`MAX_LOGIT_BIAS`] logit biases of distinct tokens inside the vocabulary, each in
/// `[-100, 100]`, and at most [`crate::MAX_TOP_LOGPROBS`] top log-probabilities.
pub fn check_sampling_extra(e: SamplingExtra, vocab_size: u32) -> Result<(), InvalidField> {
    for (name, v) in [("presence_penalty", e.presence_penalty), ("frequency_penalty", e.frequency_penalty)] {
        if !(-2.0..=2.0).contains(&v) {
            return Err(InvalidField::new(format!("sampling.{name}"), format!("must be in [-2, 2], got {v}")));
        }
    }
    if !(e.repetition_penalty > 0.0 && e.repetition_penalty.is_finite()) {
        return Err(InvalidField::new(
            "sampling.repetition_penalty",
            format!("must be finite and > 0 (1 = off), got {}", e.repetition_penalty),
        ));
    }
    if !(0.0..=1.0).contains(&e.min_p) {
        return Err(InvalidField::new("sampling.min_p", format!("must be in [0, 1], got {}", e.min_p)));
    }
    if e.logit_bias.len() > MAX_LOGIT_BIAS {
        return Err(InvalidField::new(
            "sampling.logit_bias",
            format!("at most {MAX_LOGIT_BIAS} entries, got {}", e.logit_bias.len()),
        ));
    }
    for (i, &(t, b)) in e.logit_bias.iter().enumerate() {
        let field = || format!("sampling.logit_bias[{i}]");
        if t >= vocab_size {
            return Err(InvalidField::new(field(), format!("token {t} is not below the vocabulary size {vocab_size}")));
        }
        if !(-100.0..=100.0).contains(&b) {
            return Err(InvalidField::new(field(), format!("bias must be in [-100, 100], got {b}")));
        }
        if e.logit_bias[..i].iter().any(|&(o, _)| o == t) {
            return Err(InvalidField::new(field(), format!("token {t} appears twice")));
        }
    }
    if let Some(n) = e.logprobs.filter(|&n| n > crate::MAX_TOP_LOGPROBS) {
        return Err(InvalidField::new(
            "sampling.logprobs",
            format!("at most {} alternatives, got {n}", crate::MAX_TOP_LOGPROBS),
        ));
    }
    Ok(())
}

/// `stopping.*`: `max_new_tokens >= 1` when given, stop token ids inside the vocabulary,
/// at most [`MAX_STOP_STRINGS`] non-empty stop strings of at most [`MAX_STOP_BYTES`].
pub fn check_stopping(
    max_new_tokens: Option<u32>,
    stop_token_ids: &[u32],
    stop: &[impl AsRef<[u8]>],
    vocab_size: u32,
) -> Result<(), InvalidField> {
    if max_new_tokens == Some(0) {
        return Err(InvalidField::new("stopping.max_new_tokens", "must be >= 1"));
    }
    for (i, &id) in stop_token_ids.iter().enumerate() {
        if id >= vocab_size {
            return Err(InvalidField::new(
                format!("stopping.stop_token_ids[{i}]"),
                format!("id {id} is not below the vocabulary size {vocab_size}"),
            ));
        }
    }
    if stop.len() > MAX_STOP_STRINGS {
        return Err(InvalidField::new(
            "stopping.stop",
            format!("at most {MAX_STOP_STRINGS} stop strings, got {}", stop.len()),
        ));
    }
    for (i, s) in stop.iter().enumerate() {
        let n = s.as_ref().len();
        if n == 0 {
            return Err(InvalidField::new(format!("stopping.stop[{i}]"), "must not be empty"));
        }
        if n > MAX_STOP_BYTES {
            return Err(InvalidField::new(
                format!("stopping.stop[{i}]"),
                format!("at most {MAX_STOP_BYTES} bytes, got {n}"),
            ));
        }
    }
    Ok(())
}

/// The prompt's token ids (`field` is `prompt.token_ids`, or `prompt.text` for a
/// tokenized text): not empty, every id inside the vocabulary, and short enough to leave
/// room for at least one new token.
pub fn check_prompt(ids: &[u32], field: &str, limits: RequestLimits) -> Result<(), InvalidField> {
    if ids.is_empty() {
        return Err(InvalidField::new(field, "must not be empty"));
    }
    if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id >= limits.vocab_size) {
        return Err(InvalidField::new(
            format!("{field}[{i}]"),
            format!("id {id} is not below the vocabulary size {}", limits.vocab_size),
        ));
    }
    if ids.len() >= limits.max_context as usize {
        return Err(InvalidField::new(
            field,
            format!(
                "{} prompt tokens leave no room in the served context of {} tokens (max_model_len)",
                ids.len(),
                limits.max_context
            ),
        ));
    }
    Ok(())
}

/// The `max_new_tokens` a request runs with after a prompt of `prompt_len` tokens: the
/// requested number if it fits the context, else an error naming the limit; unset, the
/// default clipped to the room left.
pub fn resolve_max_new_tokens(
    requested: Option<u32>,
    prompt_len: usize,
    limits: RequestLimits,
) -> Result<u32, InvalidField> {
    let room = (limits.max_context as usize).saturating_sub(prompt_len) as u32;
    match requested {
        None => Ok(DEFAULT_MAX_NEW_TOKENS.min(room)),
        Some(n) if n > room => Err(InvalidField::new(
            "stopping.max_new_tokens",
            format!(
                "{n} new tokens after {prompt_len} prompt tokens exceed the served context of {} tokens \
                 (max_model_len; at most {room})",
                limits.max_context
            ),
        )),
        Some(n) => Ok(n),
    }
}

impl SamplingParams {
    /// The fields [`check_sampling_extra`] checks.
    pub fn extra(&self) -> SamplingExtra<'_> {
        SamplingExtra {
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            min_p: self.min_p,
            logit_bias: &self.logit_bias,
            logprobs: self.logprobs,
        }
    }

    /// Every rule above for a request of `prompt` with these parameters, as the engine
    /// applies them. (Token-id stop sequences have no public field of their own; they are
    /// reported as `stopping.stop`.)
    pub fn check(&self, prompt: &[u32], limits: RequestLimits) -> Result<(), InvalidField> {
        check_prompt(prompt, "prompt.token_ids", limits)?;
        check_sampling(self.temperature, self.top_k as i64, self.top_p)?;
        check_sampling_extra(self.extra(), limits.vocab_size)?;
        let stop: Vec<Vec<u8>> = Vec::new();
        check_stopping(Some(self.max_new_tokens), &self.stop_token_ids, &stop, limits.vocab_size)?;
        if let Some(i) = self.stop_sequences.iter().position(|s| s.is_empty()) {
            return Err(InvalidField::new(format!("stopping.stop[{i}]"), "must not be empty"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: RequestLimits = RequestLimits { vocab_size: 100, max_context: 50 };

    fn field<T: std::fmt::Debug>(r: Result<T, InvalidField>) -> String {
        r.expect_err("refused").field
    }

    #[test]
    fn sampling_rules() {
        for t in [-0.1, f32::NAN, f32::INFINITY] {
            assert_eq!(field(check_sampling(t, 0, 1.0)), "sampling.temperature");
        }
        for p in [0.0, -1.0, 1.01, f32::NAN] {
            assert_eq!(field(check_sampling(0.0, 0, p)), "sampling.top_p");
        }
        assert_eq!(field(check_sampling(0.0, -1, 1.0)), "sampling.top_k");
        assert!(check_sampling(0.7, 5, 1.0).is_ok());
    }

    #[test]
    fn extra_sampling_rules() {
        let ok = SamplingParams::default();
        let field_with = |f: &dyn Fn(&mut SamplingParams)| {
            let mut p = ok.clone();
            f(&mut p);
            field(check_sampling_extra(p.extra(), 100))
        };
        assert!(check_sampling_extra(ok.extra(), 100).is_ok());
        assert_eq!(field_with(&|p| p.presence_penalty = 2.5), "sampling.presence_penalty");
        assert_eq!(field_with(&|p| p.frequency_penalty = f32::NAN), "sampling.frequency_penalty");
        assert_eq!(field_with(&|p| p.repetition_penalty = 0.0), "sampling.repetition_penalty");
        assert_eq!(field_with(&|p| p.min_p = 1.5), "sampling.min_p");
        assert_eq!(field_with(&|p| p.logit_bias = vec![(1, 1.0), (100, 1.0)]), "sampling.logit_bias[1]");
        assert_eq!(field_with(&|p| p.logit_bias = vec![(1, 101.0)]), "sampling.logit_bias[0]");
        assert_eq!(field_with(&|p| p.logit_bias = vec![(1, 1.0), (1, 2.0)]), "sampling.logit_bias[1]");
        assert_eq!(field_with(&|p| p.logprobs = Some(21)), "sampling.logprobs");
        let mut all = ok.clone();
        all.presence_penalty = -2.0;
        all.frequency_penalty = 2.0;
        all.repetition_penalty = 1.3;
        all.min_p = 1.0;
        all.logit_bias = vec![(99, -100.0)];
        all.logprobs = Some(20);
        assert!(check_sampling_extra(all.extra(), 100).is_ok());
    }

    #[test]
    fn stopping_rules() {
        let none: [&str; 0] = [];
        assert_eq!(field(check_stopping(Some(0), &[], &none, 100)), "stopping.max_new_tokens");
        assert_eq!(field(check_stopping(None, &[3, 100], &none, 100)), "stopping.stop_token_ids[1]");
        assert_eq!(field(check_stopping(None, &[], &["a"; 17], 100)), "stopping.stop");
        assert_eq!(field(check_stopping(None, &[], &["a", ""], 100)), "stopping.stop[1]");
        assert_eq!(field(check_stopping(None, &[], &["a".repeat(257)], 100)), "stopping.stop[0]");
        assert!(check_stopping(Some(1), &[99], &["a".repeat(256)], 100).is_ok());
    }

    #[test]
    fn prompt_and_room() {
        assert_eq!(field(check_prompt(&[], "prompt.text", L)), "prompt.text");
        assert_eq!(field(check_prompt(&[1, 100], "prompt.token_ids", L)), "prompt.token_ids[1]");
        let e = check_prompt(&[1; 50], "prompt.token_ids", L).expect_err("too long");
        assert!(e.msg.contains("max_model_len") && e.msg.contains("50 tokens"), "{e}");
        assert!(check_prompt(&[1; 49], "prompt.token_ids", L).is_ok());
        assert_eq!(resolve_max_new_tokens(None, 5, L), Ok(45));
        assert_eq!(resolve_max_new_tokens(Some(45), 5, L), Ok(45));
        let e = resolve_max_new_tokens(Some(46), 5, L).expect_err("past the context");
        assert_eq!(e.field, "stopping.max_new_tokens");
        assert!(e.msg.contains("max_model_len"), "{e}");
    }

    #[test]
    fn the_engine_applies_the_same_rules() {
        let ok = SamplingParams { max_new_tokens: 4, ..Default::default() };
        assert!(ok.check(&[1, 2], L).is_ok());
        assert_eq!(field(ok.check(&[], L)), "prompt.token_ids");
        assert_eq!(field(SamplingParams { top_p: 0.0, ..ok.clone() }.check(&[1], L)), "sampling.top_p");
        assert_eq!(field(SamplingParams { max_new_tokens: 0, ..ok.clone() }.check(&[1], L)), "stopping.max_new_tokens");
        let bad_stop = SamplingParams { stop_sequences: vec![vec![1], vec![]], ..ok };
        assert_eq!(field(bad_stop.check(&[1], L)), "stopping.stop[1]");
    }
}
