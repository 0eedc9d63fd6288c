//! OpenAI's `logprobs` objects from `mlaserve.v1`'s per-token log-probabilities: the chat
//! form (`{"content": [{token, logprob, bytes, top_logprobs}]}`) and the completions form
//! (`{tokens, token_logprobs, top_logprobs, text_offset}`). A token's string is its id
//! decoded alone (special tokens kept); `bytes` are that string's UTF-8 bytes.

use mlaserve_model::Tokenizer;
use mlaserve_proto::v1 as pb;
use serde_json::{json, Map, Value};

/// OpenAI's stand-in for a log-probability of −∞ (JSON has no infinity).
const NEG_INF_LOGPROB: f64 = -9999.0;

fn num(lp: f32) -> Value {
    if lp.is_finite() {
        json!(lp)
    } else {
        json!(NEG_INF_LOGPROB)
    }
}

fn token_str(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// The chat form's `content` entries of `ids` (one per id, `lps` aligned with them).
pub fn chat_content(tok: &Tokenizer, ids: &[u32], lps: &[pb::TokenLogprobs]) -> Vec<Value> {
    let entry = |id: u32, lp: f32| {
        let s = token_str(tok, id);
        json!({"token": s, "logprob": num(lp), "bytes": s.as_bytes()})
    };
    ids.iter()
        .zip(lps)
        .map(|(&id, l)| {
            let mut e = entry(id, l.logprob);
            let top: Vec<Value> = l.top_token_ids.iter().zip(&l.top_logprobs).map(|(&t, &lp)| entry(t, lp)).collect();
            e["top_logprobs"] = Value::Array(top);
            e
        })
        .collect()
}

/// The completions form over `ids`, whose text starts at byte `offset` of the choice's
/// text; advances `offset` past it.
pub fn completion(tok: &Tokenizer, ids: &[u32], lps: &[pb::TokenLogprobs], offset: &mut usize) -> Value {
    let (mut tokens, mut token_logprobs, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for (&id, l) in ids.iter().zip(lps) {
        let s = token_str(tok, id);
        offsets.push(*offset);
        *offset += s.len();
        tokens.push(s);
        token_logprobs.push(num(l.logprob));
        let top: Map<String, Value> =
            l.top_token_ids.iter().zip(&l.top_logprobs).map(|(&t, &lp)| (token_str(tok, t), num(lp))).collect();
        tops.push(Value::Object(top));
    }
    json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets})
}

/// One choice's tokens and log-probabilities, gathered over its messages.
#[derive(Debug, Clone, Default)]
pub struct Gathered {
    pub ids: Vec<u32>,
    pub lps: Vec<pb::TokenLogprobs>,
}

impl Gathered {
    pub fn push(&mut self, msg: &pb::GenerateResponse) {
        self.ids.extend_from_slice(&msg.token_ids);
        self.lps.extend(msg.logprobs.iter().cloned());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infinities_become_openais_stand_in() {
        assert_eq!(num(f32::NEG_INFINITY), json!(NEG_INF_LOGPROB));
        assert_eq!(num(-0.5), json!(-0.5));
    }
}
