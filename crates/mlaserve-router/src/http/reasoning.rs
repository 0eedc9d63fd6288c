//! DeepSeek-R1-style reasoning: when the chat template opens a thinking block (its
//! generation prompt ends with `<think>`), the output up to `</think>` is the
//! reasoning, returned as `reasoning_content` (its own deltas when streaming), and the
//! rest is the answer (`content`).

const CLOSE: &str = "</think>";

/// Whether a rendered chat prompt leaves the model inside a thinking block.
pub fn opens_thinking(prompt: &str) -> bool {
    prompt.trim_end().ends_with("<think>")
}

/// Splits a stream of text deltas into reasoning and answer (see the module docs).
#[derive(Debug, Clone)]
pub struct Splitter {
    thinking: bool,
    /// Text held back: it may be the start of `</think>`.
    held: String,
}

impl Splitter {
    /// A splitter for an output that starts inside a thinking block or not.
    pub fn new(thinking: bool) -> Self {
        Splitter { thinking, held: String::new() }
    }

    /// Feeds a delta; returns the (reasoning, answer) text it completes.
    pub fn push(&mut self, text: &str) -> (String, String) {
        if !self.thinking {
            return (String::new(), text.to_string());
        }
        self.held.push_str(text);
        if let Some(at) = self.held.find(CLOSE) {
            let reasoning = self.held[..at].to_string();
            let answer = self.held[at + CLOSE.len()..].to_string();
            self.held.clear();
            self.thinking = false;
            return (reasoning, answer);
        }
        let out = super::take_settled(&mut self.held, CLOSE);
        (out, String::new())
    }

    /// The end of the output: whatever was held back (an unfinished thinking block is
    /// all reasoning).
    pub fn finish(&mut self) -> (String, String) {
        let rest = std::mem::take(&mut self.held);
        if self.thinking {
            (rest, String::new())
        } else {
            (String::new(), rest)
        }
    }
}

/// The whole output, split.
pub fn split(thinking: bool, text: &str) -> (String, String) {
    let mut s = Splitter::new(thinking);
    let (mut r, mut a) = s.push(text);
    let (r2, a2) = s.finish();
    r.push_str(&r2);
    a.push_str(&a2);
    (r, a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thinking_prompt_is_recognised() {
        assert!(opens_thinking("<｜User｜>hi<｜Assistant｜><think>\n"));
        assert!(!opens_thinking("<｜User｜>hi<｜Assistant｜>"));
    }

    #[test]
    fn reasoning_and_answer_split_at_the_close_tag() {
        assert_eq!(split(true, "I add them.</think>\n\n3"), ("I add them.".into(), "\n\n3".into()));
        assert_eq!(split(false, "no <think> here</think>"), (String::new(), "no <think> here</think>".into()));
        assert_eq!(split(true, "still thinking"), ("still thinking".into(), String::new()));
    }

    /// However the stream is cut into deltas, even inside `</think>`, the pieces add up
    /// to the whole split.
    #[test]
    fn streamed_deltas_add_up_whatever_the_cuts() {
        let text = "Let me see: 1 < 2 and </th is not it.</think>The answer is 3 → done.";
        let want = split(true, text);
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        for step in 1..=9 {
            let mut s = Splitter::new(true);
            let (mut r, mut a) = (String::new(), String::new());
            for chunk in chars.chunks(step) {
                let from = chunk[0].0;
                let to = chunk.last().map(|&(i, c)| i + c.len_utf8()).unwrap_or(from);
                let (x, y) = s.push(&text[from..to]);
                r.push_str(&x);
                a.push_str(&y);
            }
            let (x, y) = s.finish();
            r.push_str(&x);
            a.push_str(&y);
            assert_eq!((r, a), want, "deltas of {step} chars");
        }
    }
}
