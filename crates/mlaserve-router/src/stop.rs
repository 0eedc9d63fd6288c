//! Stop strings over streamed text.
//!
//! Text is released only once no stop string can still start in it: we hold back the
//! longest suffix of the output that is a prefix of some stop string. A match can then
//! never begin in text already sent (it would have been a held-back suffix), so the
//! client sees exactly the text before the first match, and no prefix of the stop
//! string. Work per delta is O(stops × stop length).

/// Result of feeding one text delta.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StopOutput {
    /// Text safe to send now.
    pub text: String,
    /// Index of the stop string that matched; the generation ends here.
    pub matched: Option<usize>,
}

/// Holds back text that might be the start of a stop string.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops, pending: String::new() }
    }

    /// Feeds a delta; returns what may be sent and whether a stop string matched.
    pub fn push(&mut self, delta: &str) -> StopOutput {
        if self.stops.is_empty() {
            return StopOutput { text: delta.to_string(), matched: None };
        }
        self.pending.push_str(delta);
        // Earliest match wins; among matches at one position, the first listed.
        let first =
            self.stops.iter().enumerate().filter_map(|(i, s)| self.pending.find(s.as_str()).map(|at| (at, i))).min();
        if let Some((at, i)) = first {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutput { text, matched: Some(i) };
        }
        let hold = self.held_suffix_len();
        let cut = self.pending.len() - hold;
        let text = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutput { text, matched: None }
    }

    /// The generation ended for another reason: everything held back is output.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }

    /// Length of the longest suffix of `pending` that is a proper prefix of a stop.
    fn held_suffix_len(&self) -> usize {
        let p = &self.pending;
        let mut best = 0;
        for s in &self.stops {
            let max = s.len().saturating_sub(1).min(p.len());
            for k in (best + 1..=max).rev() {
                let start = p.len() - k;
                if p.is_char_boundary(start) && s.is_char_boundary(k) && s.as_bytes()[..k] == p.as_bytes()[start..] {
                    best = k;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<usize>) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            let o = m.push(d);
            out += &o.text;
            if o.matched.is_some() {
                return (out, o.matched);
            }
        }
        out += &m.finish();
        (out, None)
    }

    #[test]
    fn no_stops_passes_through() {
        assert_eq!(run(&[], &["ab", "c"]), ("abc".into(), None));
    }

    #[test]
    fn match_across_deltas_is_cut_before_the_stop() {
        assert_eq!(run(&["STOP"], &["hello S", "TO", "P tail"]), ("hello ".into(), Some(0)));
    }

    #[test]
    fn prefix_is_held_then_released() {
        let mut m = StopMatcher::new(vec!["abc".into()]);
        assert_eq!(m.push("xa").text, "x");
        assert_eq!(m.push("b").text, "");
        assert_eq!(m.push("d").text, "abd");
    }

    #[test]
    fn earliest_match_wins() {
        assert_eq!(run(&["world", "lo"], &["hello world"]), ("hel".into(), Some(1)));
    }

    #[test]
    fn multibyte_stop() {
        assert_eq!(run(&["🙂"], &["a", "é", "🙂", "b"]), ("aé".into(), Some(0)));
    }

    #[test]
    fn unmatched_prefix_flushed_at_finish() {
        assert_eq!(run(&["</s>"], &["end</"]), ("end</".into(), None));
    }
}
