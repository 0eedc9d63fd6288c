//! Incremental, UTF-8-safe detokenization.
//!
//! Byte-level BPE tokens can end in the middle of a multi-byte character, and
//! SentencePiece-style decoders render a token differently depending on its left
//! neighbour (the leading space). So a token's text is never decoded alone: we decode a
//! short window of recent ids (a few already-emitted tokens as context, then the new
//! ones) and emit the part of its text not emitted yet.
//!
//! Only the window's last character can still change as bytes arrive: lossy UTF-8
//! decoding turns an incomplete trailing sequence into one U+FFFD, which more bytes may
//! complete into a real character. Every earlier character, U+FFFD or not, is final.
//! So all but a trailing U+FFFD is emitted at once, and the concatenation of the deltas
//! equals decoding the whole output in one go, invalid bytes included.

use tokenizers::Tokenizer;

/// Already-emitted tokens kept as left context when the window slides.
const CONTEXT: usize = 4;
/// The window slides once it holds this many tokens (bounds each decode's cost).
const MAX_WINDOW: usize = 16;
const REPLACEMENT: char = '\u{FFFD}';

/// Turns a stream of token ids into a stream of text deltas whose concatenation is the
/// decoded output.
#[derive(Debug)]
pub struct IncrementalDecoder {
    /// The window: context ids, then ids whose text is (partly) not emitted yet.
    ids: Vec<u32>,
    /// Bytes of `decode(ids)` already emitted (or belonging to the prompt context).
    emitted: usize,
    skip_special: bool,
    started: bool,
    prompt_tail: Vec<u32>,
}

impl IncrementalDecoder {
    /// `prompt`: the request's prompt ids (its tail gives the first tokens context).
    pub fn new(prompt: &[u32], skip_special: bool) -> Self {
        let tail = prompt[prompt.len().saturating_sub(CONTEXT)..].to_vec();
        IncrementalDecoder { ids: Vec::new(), emitted: 0, skip_special, started: false, prompt_tail: tail }
    }

    /// Adds new ids; returns the text they complete (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, new: &[u32]) -> Result<String, String> {
        if !self.started {
            self.started = true;
            self.ids = std::mem::take(&mut self.prompt_tail);
            self.emitted = self.decode(tok)?.len();
        }
        self.ids.extend_from_slice(new);
        self.delta(tok, false)
    }

    /// Emits whatever is still held (an incomplete character comes out as U+FFFD).
    pub fn finish(&mut self, tok: &Tokenizer) -> Result<String, String> {
        if !self.started {
            return Ok(String::new());
        }
        self.delta(tok, true)
    }

    fn decode(&self, tok: &Tokenizer) -> Result<String, String> {
        tok.decode(&self.ids, self.skip_special).map_err(|e| format!("detokenize: {e}"))
    }

    fn delta(&mut self, tok: &Tokenizer, all: bool) -> Result<String, String> {
        let text = self.decode(tok)?;
        let end = if !all && text.ends_with(REPLACEMENT) { text.len() - REPLACEMENT.len_utf8() } else { text.len() };
        let start = floor_char_boundary(&text, self.emitted.min(end));
        let out = text[start..end].to_string();
        self.emitted = self.emitted.max(end);
        if self.ids.len() > MAX_WINDOW {
            // Slide: keep a little context. Whatever the new window decodes to, all but
            // a trailing U+FFFD is already out (see the module docs).
            self.ids.drain(..self.ids.len() - CONTEXT);
            let t = self.decode(tok)?;
            self.emitted = if !all && t.ends_with(REPLACEMENT) { t.len() - REPLACEMENT.len_utf8() } else { t.len() };
        }
        Ok(out)
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// A byte-level tokenizer with the 256 byte tokens only: every non-ASCII character
    /// is split over several tokens, the hard case for incremental decoding.
    pub(crate) fn byte_tokenizer() -> Tokenizer {
        let mut chars: Vec<char> = ByteLevel::alphabet().into_iter().collect();
        chars.sort_unstable();
        let vocab: serde_json::Map<String, serde_json::Value> =
            chars.into_iter().enumerate().map(|(i, c)| (c.to_string(), serde_json::json!(i))).collect();
        let json = serde_json::json!({
            "version": "1.0",
            "model": {"type": "BPE", "vocab": vocab, "merges": []},
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}
        });
        Tokenizer::from_bytes(json.to_string().as_bytes()).expect("tokenizer")
    }

    fn roundtrip(text: &str) {
        let tok = byte_tokenizer();
        let ids = tok.encode(text, false).expect("encode").get_ids().to_vec();
        let mut d = IncrementalDecoder::new(&[], true);
        let mut out = String::new();
        for id in &ids {
            let piece = d.push(&tok, &[*id]).expect("push");
            assert!(!piece.contains('\u{FFFD}'), "partial character leaked: {piece:?}");
            out += &piece;
        }
        out += &d.finish(&tok).expect("finish");
        assert_eq!(out, text);
    }

    #[test]
    fn ascii_and_multibyte_characters() {
        roundtrip("hello world");
        roundtrip("héllo wörld — 日本語 🙂🙂 ok");
    }

    #[test]
    fn many_tokens_at_once() {
        let tok = byte_tokenizer();
        let text = "naïve 🙂 café";
        let ids = tok.encode(text, false).expect("encode").get_ids().to_vec();
        let mut d = IncrementalDecoder::new(&ids[..2], true);
        let mut out = String::new();
        for chunk in ids.chunks(3) {
            out += &d.push(&tok, chunk).expect("push");
        }
        out += &d.finish(&tok).expect("finish");
        assert_eq!(out, text);
    }

    #[test]
    fn truncated_character_is_flushed_at_finish() {
        let tok = byte_tokenizer();
        let ids = tok.encode("a🙂", false).expect("encode").get_ids().to_vec();
        let mut d = IncrementalDecoder::new(&[], true);
        let mut out = d.push(&tok, &ids[..1]).expect("push");
        assert_eq!(out, "a");
        out += &d.push(&tok, &ids[1..ids.len() - 1]).expect("push");
        assert_eq!(out, "a", "an incomplete character is held back");
        out += &d.finish(&tok).expect("finish");
        assert!(out.ends_with('\u{FFFD}'));
    }

    #[test]
    fn invalid_bytes_match_a_whole_decode() {
        // Random byte tokens (what a random-weight model emits), one at a time.
        let tok = byte_tokenizer();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let ids: Vec<u32> = (0..400)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 256) as u32
            })
            .collect();
        let prompt = tok.encode("abc", false).expect("encode").get_ids().to_vec();
        let mut d = IncrementalDecoder::new(&prompt, true);
        let mut out = String::new();
        let mut i = 0;
        while i < ids.len() {
            let n = 1 + (ids[i] as usize % 3);
            let chunk = &ids[i..(i + n).min(ids.len())];
            out += &d.push(&tok, chunk).expect("push");
            i += n;
        }
        out += &d.finish(&tok).expect("finish");
        assert_eq!(out, tok.decode(&ids, true).expect("decode"));
    }

    #[test]
    fn finish_flushes_a_held_partial() {
        let tok = byte_tokenizer();
        let ids = tok.encode("a🙂", false).expect("encode").get_ids().to_vec();
        let mut d = IncrementalDecoder::new(&[], true);
        let mut out = d.push(&tok, &ids[..ids.len() - 1]).expect("push");
        out += &d.finish(&tok).expect("finish");
        assert!(out.ends_with('\u{FFFD}'));
    }
}
