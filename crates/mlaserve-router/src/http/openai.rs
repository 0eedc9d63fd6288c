//! The OpenAI API's request and response bodies, and their translation to and from
//! `mlaserve.v1` (`GenerateRequest` / `GenerateResponse`): the HTTP front drives the
//! same generation service as gRPC.

use axum::http::StatusCode;
use mlaserve_proto::v1::{self as pb, generate_request::Prompt};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// The most choices (`n`) one request may ask for.
pub const MAX_CHOICES: u32 = 16;

/// An OpenAI error: its HTTP status and `{"error": {...}}` body.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400 naming the request parameter.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("{param}: {}", message.into()),
            kind: "invalid_request_error",
            param: Some(param.to_string()),
            code: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }

    /// A gRPC status of the generation service, in OpenAI's terms: INVALID_ARGUMENT →
    /// 400 naming the parameter (the status message starts with the gRPC field),
    /// RESOURCE_EXHAUSTED → 429, UNAVAILABLE → 503, DEADLINE_EXCEEDED → 504.
    pub fn from_status(s: &tonic::Status, messages: bool) -> ApiError {
        use tonic::Code;
        let (status, kind, code) = match s.code() {
            Code::InvalidArgument => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            Code::ResourceExhausted => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some("overloaded")),
            Code::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "server_error", Some("unavailable")),
            Code::DeadlineExceeded => (StatusCode::GATEWAY_TIMEOUT, "timeout_error", Some("timeout")),
            Code::Unauthenticated => (StatusCode::UNAUTHORIZED, "authentication_error", Some("invalid_api_key")),
            Code::Cancelled => (StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST), "cancelled", None),
            _ => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        let param = (s.code() == Code::InvalidArgument)
            .then(|| s.message().split(':').next().map(|f| openai_param(f, messages)))
            .flatten();
        ApiError { status, message: s.message().to_string(), kind, param, code }
    }
}

/// The OpenAI parameter a `mlaserve.v1` field comes from.
fn openai_param(field: &str, messages: bool) -> String {
    let base = field.split('[').next().unwrap_or(field);
    match base {
        "prompt.text" | "prompt.token_ids" | "prompt" => (if messages { "messages" } else { "prompt" }).into(),
        "stopping.max_new_tokens" => "max_tokens".into(),
        "stopping.stop" => "stop".into(),
        "stopping.stop_token_ids" => "stop_token_ids".into(),
        "sampling.logprobs" if messages => "top_logprobs".into(),
        other => other.trim_start_matches("sampling.").to_string(),
    }
}

/// `stop`: one string or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The parameters both endpoints share (sampling, stopping, streaming).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM's extension: keep the k most likely tokens (0: no cut).
    pub top_k: Option<i32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    /// vLLM's extension: token ids that end the generation.
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    /// vLLM's extension: keep generating past EOS.
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<u32>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub min_p: Option<f32>,
    pub logit_bias: Option<Value>,
    pub best_of: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<Value>,
}

impl Common {
    /// Refuses what is not served yet (never silently ignored), malformed `logprobs`,
    /// `top_logprobs` and `logit_bias` (`chat`: the chat endpoint's forms), and a model
    /// that is not the served one. The ranges of the sampling values are the generation
    /// service's (a 400 naming the parameter, from its INVALID_ARGUMENT).
    pub fn check(&self, served: &str, chat: bool) -> Result<(), ApiError> {
        self.logprobs(chat)?;
        self.logit_bias()?;
        if let Some(m) = &self.model {
            if m != served {
                return Err(ApiError {
                    status: StatusCode::NOT_FOUND,
                    message: format!("model `{m}` does not exist; this server serves `{served}`"),
                    kind: "invalid_request_error",
                    param: Some("model".into()),
                    code: Some("model_not_found"),
                });
            }
        }
        if let Some(n) = self.n {
            if !(1..=MAX_CHOICES).contains(&n) {
                return Err(ApiError::invalid("n", format!("must be in 1..={MAX_CHOICES}, got {n}")));
            }
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid("best_of", "only best_of = 1 is served"));
        }
        match &self.tool_choice {
            None => {}
            Some(v) if *v == json!("auto") || *v == json!("none") => {}
            Some(_) => return Err(ApiError::invalid("tool_choice", "only \"auto\" and \"none\" are served")),
        }
        if let Some(t) = &self.tools {
            if !t.is_array() {
                return Err(ApiError::invalid("tools", "must be a list"));
            }
        }
        let unsupported: [(&str, bool); 3] = [
            ("echo", self.echo == Some(true)),
            ("suffix", self.suffix.as_ref().is_some_and(|s| !s.is_empty())),
            ("response_format", self.response_format.as_ref().is_some_and(|v| v["type"] != "text")),
        ];
        match unsupported.iter().find(|(_, set)| *set) {
            Some((name, _)) => Err(ApiError::invalid(name, "not supported by this server yet")),
            None => Ok(()),
        }
    }

    /// How many alternatives' log-probabilities to return with each token (`None`: no
    /// log-probabilities). Chat: `logprobs` true or false, `top_logprobs` 0..=20 only with
    /// it. Completions: `logprobs` the number of alternatives (0..=20; OpenAI allows 5,
    /// vLLM 20).
    pub fn logprobs(&self, chat: bool) -> Result<Option<u32>, ApiError> {
        let max = mlaserve_core::MAX_TOP_LOGPROBS as u64;
        let count = |name: &str, v: &Value| match v.as_u64() {
            Some(n) if n <= max => Ok(n as u32),
            _ => Err(ApiError::invalid(name, format!("must be an integer in 0..={max}, got {v}"))),
        };
        let logprobs = self.logprobs.as_ref().filter(|v| !v.is_null());
        let top = self.top_logprobs.as_ref().filter(|v| !v.is_null());
        if !chat {
            if top.is_some() {
                return Err(ApiError::invalid("top_logprobs", "is a chat parameter; completions take logprobs: <n>"));
            }
            return logprobs.map(|v| count("logprobs", v)).transpose();
        }
        let on = match logprobs {
            None => false,
            Some(v) => {
                v.as_bool().ok_or_else(|| ApiError::invalid("logprobs", format!("must be a boolean, got {v}")))?
            }
        };
        match (on, top) {
            (false, Some(_)) => Err(ApiError::invalid("top_logprobs", "needs logprobs: true")),
            (false, None) => Ok(None),
            (true, None) => Ok(Some(0)),
            (true, Some(v)) => count("top_logprobs", v).map(Some),
        }
    }

    /// `logit_bias`: an object of token ids (as strings) to biases.
    pub fn logit_bias(&self) -> Result<Vec<pb::LogitBias>, ApiError> {
        let Some(v) = self.logit_bias.as_ref().filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
        let obj =
            v.as_object().ok_or_else(|| ApiError::invalid("logit_bias", "must be an object of token ids to biases"))?;
        obj.iter()
            .map(|(k, b)| {
                let token_id = k
                    .parse::<u32>()
                    .map_err(|_| ApiError::invalid("logit_bias", format!("key `{k}` is not a token id")))?;
                let bias = b
                    .as_f64()
                    .ok_or_else(|| ApiError::invalid("logit_bias", format!("the bias of token {k} is not a number")))?;
                Ok(pb::LogitBias { token_id, bias: bias as f32 })
            })
            .collect()
    }

    /// The `mlaserve.v1` request for `prompt` (`chat`: the chat endpoint's `logprobs`);
    /// after [`Common::check`] passed.
    pub fn request(&self, prompt: Prompt, chat: bool) -> pb::GenerateRequest {
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        pb::GenerateRequest {
            prompt: Some(prompt),
            sampling: Some(pb::SamplingParams {
                // OpenAI's default temperature is 1; 0 is greedy.
                temperature: Some(self.temperature.unwrap_or(1.0)),
                top_k: self.top_k,
                top_p: self.top_p,
                seed: self.seed,
                presence_penalty: self.presence_penalty,
                frequency_penalty: self.frequency_penalty,
                repetition_penalty: self.repetition_penalty,
                min_p: self.min_p,
                logit_bias: self.logit_bias().unwrap_or_default(),
                logprobs: self.logprobs(chat).ok().flatten(),
            }),
            stopping: Some(pb::StoppingCriteria {
                max_new_tokens: self.max_completion_tokens.or(self.max_tokens),
                stop,
                stop_token_ids: self.stop_token_ids.clone(),
                ignore_eos: self.ignore_eos,
            }),
            ..Default::default()
        }
    }

    /// Whether tool calls are parsed out of the output: `tools` given and not
    /// `tool_choice: "none"`.
    pub fn parse_tools(&self) -> bool {
        self.tools.as_ref().is_some_and(|t| t.as_array().is_some_and(|a| !a.is_empty()))
            && self.tool_choice.as_ref() != Some(&json!("none"))
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

/// `prompt` of `/v1/completions`: a string, token ids, or a list of one of those.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptIn {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdLists(Vec<Vec<u32>>),
}

impl PromptIn {
    pub fn into_prompt(self) -> Result<Prompt, ApiError> {
        let one = |n: usize| if n == 1 { Ok(()) } else { Err(ApiError::invalid("prompt", "one prompt per request")) };
        Ok(match self {
            PromptIn::Text(t) => Prompt::Text(t),
            PromptIn::Ids(ids) => Prompt::TokenIds(pb::TokenIds { ids }),
            PromptIn::Texts(mut v) => {
                one(v.len())?;
                Prompt::Text(v.remove(0))
            }
            PromptIn::IdLists(mut v) => {
                one(v.len())?;
                Prompt::TokenIds(pb::TokenIds { ids: v.remove(0) })
            }
        })
    }
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptIn,
    #[serde(flatten)]
    pub common: Common,
}

/// A chat message's `content`: a string, or parts of which the text ones are joined.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<Content>,
    pub tool_calls: Option<Value>,
    pub tool_call_id: Option<String>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessageIn>,
    #[serde(flatten)]
    pub common: Common,
}

impl ChatRequest {
    /// The messages as the template sees them; a part that is not text is refused.
    pub fn messages(&self) -> Result<Vec<super::chat::Message>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages", "must not be empty"));
        }
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p["type"].as_str(), p["text"].as_str()) {
                            (Some("text"), Some(t)) => text.push_str(t),
                            _ => {
                                return Err(ApiError::invalid(
                                    &format!("messages[{i}].content[{j}]"),
                                    "only text parts are served",
                                ))
                            }
                        }
                    }
                    text
                }
            };
            out.push(super::chat::Message {
                role: m.role.clone(),
                content,
                tool_calls: m.tool_calls.clone(),
                tool_call_id: m.tool_call_id.clone(),
            });
        }
        Ok(out)
    }
}

/// OpenAI's `finish_reason` of a `mlaserve.v1` finish.
pub fn finish_reason(f: &pb::Finish) -> &'static str {
    match pb::FinishReason::try_from(f.reason) {
        Ok(pb::FinishReason::Length) => "length",
        _ => "stop",
    }
}

/// OpenAI's `usage` of a `mlaserve.v1` usage.
pub fn usage(u: &pb::Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    })
}

/// `GET /v1/models`'s entry for the served model.
#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_to_openai_errors_naming_the_parameter() {
        let e = ApiError::from_status(&tonic::Status::invalid_argument("sampling.top_p: must be in (0, 1]"), false);
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("top_p")));
        let e = ApiError::from_status(&tonic::Status::invalid_argument("stopping.max_new_tokens: too many"), true);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        let e = ApiError::from_status(&tonic::Status::invalid_argument("prompt.token_ids[3]: id 9 too big"), true);
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = ApiError::from_status(&tonic::Status::resource_exhausted("full"), false);
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(ApiError::from_status(&tonic::Status::unavailable("x"), false).status.as_u16(), 503);
        assert_eq!(ApiError::from_status(&tonic::Status::deadline_exceeded("x"), false).status.as_u16(), 504);
    }

    #[test]
    fn unsupported_parameters_are_refused_by_name() {
        let common = |v: Value| -> Common { serde_json::from_value(v).expect("parses") };
        let param = |c: &Common, chat| c.check("m", chat).unwrap_err().param;
        assert_eq!(param(&common(json!({"echo": true})), false).as_deref(), Some("echo"));
        let c = common(json!({"presence_penalty": 0.5, "n": 1, "logprobs": null, "logit_bias": {"7": -3}}));
        assert!(c.check("m", true).is_ok());
        assert_eq!(c.logit_bias().unwrap(), vec![pb::LogitBias { token_id: 7, bias: -3.0 }]);
        assert!(common(json!({"n": 3})).check("m", false).is_ok());
        assert_eq!(param(&common(json!({"n": 0})), false).as_deref(), Some("n"));
        assert_eq!(common(json!({"model": "other"})).check("m", false).unwrap_err().status, StatusCode::NOT_FOUND);
        assert_eq!(param(&common(json!({"logit_bias": {"x": 1}})), false).as_deref(), Some("logit_bias"));
        assert_eq!(param(&common(json!({"logit_bias": [1]})), false).as_deref(), Some("logit_bias"));
    }

    #[test]
    fn logprobs_forms_of_each_endpoint() {
        let common = |v: Value| -> Common { serde_json::from_value(v).expect("parses") };
        let chat = |v: Value| common(v).logprobs(true).map_err(|e| e.param.unwrap_or_default());
        let cmpl = |v: Value| common(v).logprobs(false).map_err(|e| e.param.unwrap_or_default());
        assert_eq!(chat(json!({})), Ok(None));
        assert_eq!(chat(json!({"logprobs": true})), Ok(Some(0)));
        assert_eq!(chat(json!({"logprobs": true, "top_logprobs": 5})), Ok(Some(5)));
        assert_eq!(chat(json!({"logprobs": false})), Ok(None));
        assert_eq!(chat(json!({"top_logprobs": 5})), Err("top_logprobs".into()));
        assert_eq!(chat(json!({"logprobs": true, "top_logprobs": 21})), Err("top_logprobs".into()));
        assert_eq!(chat(json!({"logprobs": 3})), Err("logprobs".into()));
        assert_eq!(cmpl(json!({"logprobs": 3})), Ok(Some(3)));
        assert_eq!(cmpl(json!({"logprobs": 0})), Ok(Some(0)));
        assert_eq!(cmpl(json!({"logprobs": 30})), Err("logprobs".into()));
        assert_eq!(cmpl(json!({"logprobs": true})), Err("logprobs".into()));
    }
}
