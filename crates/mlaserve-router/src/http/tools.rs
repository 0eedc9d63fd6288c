//! Tool calls in DeepSeek-V3's format, parsed out of the generated text when a request
//! gives `tools`: the answer, then
//!
//! ```text
//! <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
//! ```json
//! ARGUMENTS
//! ```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>
//! ```
//!
//! (V3 and R1), or `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`
//! (V3.1). Each call becomes an OpenAI `tool_calls` entry (`type: function`, the
//! arguments as a JSON string).

use serde_json::{json, Value};

pub const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const CALLS_END: &str = "<｜tool▁calls▁end｜>";
const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const SEP: &str = "<｜tool▁sep｜>";

/// One parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

/// Splits `text` into the answer before the tool calls and the calls; `None` when it
/// holds no tool-call block.
pub fn parse(text: &str) -> Option<(String, Vec<Call>)> {
    let at = text.find(CALLS_BEGIN)?;
    let answer = text[..at].to_string();
    let mut rest = &text[at + CALLS_BEGIN.len()..];
    if let Some(end) = rest.find(CALLS_END) {
        rest = &rest[..end];
    }
    let mut calls = Vec::new();
    for part in rest.split(CALL_BEGIN).skip(1) {
        let part = part.split(CALL_END).next().unwrap_or(part);
        let Some((head, tail)) = part.split_once(SEP) else { continue };
        let (name, arguments) = if head.trim() == "function" {
            // V3: NAME, a newline, then the arguments in a ```json fence.
            let (name, body) = tail.split_once('\n').unwrap_or((tail, ""));
            let body = body.trim();
            let body = body.strip_prefix("```json").or_else(|| body.strip_prefix("```")).unwrap_or(body);
            let body = body.strip_suffix("```").unwrap_or(body);
            (name.trim().to_string(), body.trim().to_string())
        } else {
            (head.trim().to_string(), tail.trim().to_string())
        };
        if !name.is_empty() {
            calls.push(Call { name, arguments });
        }
    }
    Some((answer, calls))
}

/// OpenAI's `tool_calls` for `calls`, ids prefixed with `id`.
pub fn to_openai(id: &str, calls: &[Call]) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": format!("call_{id}_{i}"), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect(),
    )
}

/// Streams the answer until a tool-call block begins, then holds the rest for
/// [`Held::finish`] (which parses the calls).
#[derive(Debug, Clone, Default)]
pub struct Held {
    held: String,
    in_calls: bool,
}

impl Held {
    /// Feeds answer text; returns what can be streamed as content now.
    pub fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.in_calls {
            return String::new();
        }
        if let Some(at) = self.held.find(CALLS_BEGIN) {
            self.in_calls = true;
            let out = self.held[..at].to_string();
            self.held.drain(..at);
            return out;
        }
        super::take_settled(&mut self.held, CALLS_BEGIN)
    }

    /// The end: the content still held and the calls, if a block began.
    pub fn finish(&mut self) -> (String, Option<Vec<Call>>) {
        let rest = std::mem::take(&mut self.held);
        match parse(&rest) {
            Some((answer, calls)) => (answer, Some(calls)),
            None => (rest, None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v3_calls_parse() {
        let text = "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (answer, calls) = parse(text).expect("calls");
        assert_eq!(answer, "Let me check.");
        assert_eq!(
            calls,
            [
                Call { name: "get_weather".into(), arguments: "{\"city\": \"Paris\"}".into() },
                Call { name: "get_time".into(), arguments: "{}".into() }
            ]
        );
        let v = to_openai("chatcmpl-3", &calls);
        assert_eq!(v[0]["function"]["name"], "get_weather");
        assert_eq!(v[1]["id"], "call_chatcmpl-3_1");
    }

    #[test]
    fn v31_calls_and_plain_text() {
        let text = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"mla\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (answer, calls) = parse(text).expect("calls");
        assert_eq!((answer.as_str(), calls.len()), ("", 1));
        assert_eq!(calls[0], Call { name: "search".into(), arguments: "{\"q\": \"mla\"}".into() });
        assert!(parse("no calls here").is_none());
    }

    /// Streamed in pieces of any size, the content stops where the block begins and the
    /// calls come out whole at the end.
    #[test]
    fn held_streams_the_answer_and_keeps_the_calls() {
        let text =
            "Sure: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        for step in 1..=7 {
            let mut h = Held::default();
            let mut content = String::new();
            for chunk in chars.chunks(step) {
                let (from, to) = (chunk[0].0, chunk.last().map(|&(i, c)| i + c.len_utf8()).unwrap_or(0));
                content.push_str(&h.push(&text[from..to]));
            }
            let (rest, calls) = h.finish();
            content.push_str(&rest);
            assert_eq!(content, "Sure: ", "pieces of {step}");
            assert_eq!(calls.expect("calls"), [Call { name: "f".into(), arguments: "{}".into() }]);
        }
        let mut h = Held::default();
        assert_eq!(h.push("plain <｜tool"), "plain ");
        assert_eq!(h.finish(), ("<｜tool".into(), None));
    }
}
