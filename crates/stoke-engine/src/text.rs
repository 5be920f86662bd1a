//! A request's output text as tokens arrive: incremental detokenization (each new token decoded
//! with a few tokens before it, not the whole output again), stop strings, and the text that is
//! safe to hand out (no incomplete UTF-8 character, nothing that could still become a stop
//! string).

/// Turns token ids into text (a tokenizer).
pub trait Detokenize: Send + Sync {
    /// The text of `ids`, special tokens included as the tokenizer spells them.
    fn decode(&self, ids: &[u32]) -> String;
}

/// The text of one request's generated tokens.
#[derive(Clone, Debug, Default)]
pub struct Text {
    /// All decoded text so far (up to a stop string once one is found).
    text: String,
    /// Bytes of `text` handed out.
    emitted: usize,
    /// Tokens before `read`, decoded from `prefix` on, give the text up to `text`'s end.
    prefix: usize,
    read: usize,
    /// The stop string found, if any.
    pub stopped: Option<String>,
}

impl Text {
    /// Adds the tokens of `ids` past those already read (all of `ids` is the output so far) and
    /// returns the text that can be handed out now. After a stop string, nothing more.
    pub fn push(&mut self, detok: &dyn Detokenize, ids: &[u32], stop: &[String]) -> String {
        if self.stopped.is_some() {
            return String::new();
        }
        let before = detok.decode(&ids[self.prefix..self.read]);
        let now = detok.decode(&ids[self.prefix..]);
        // A token that ends inside a UTF-8 character decodes to U+FFFD: wait for the rest.
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            let start = self.text.len();
            self.text.push_str(&now[before.len()..]);
            self.prefix = self.read;
            self.read = ids.len();
            // A stop string can only end in the new text.
            let from = start.saturating_sub(stop.iter().map(String::len).max().unwrap_or(0));
            let from = (0..=from)
                .rev()
                .find(|&i| self.text.is_char_boundary(i))
                .unwrap_or(0);
            if let Some((at, s)) = stop
                .iter()
                .filter_map(|s| self.text[from..].find(s.as_str()).map(|i| (from + i, s)))
                .min_by_key(|&(at, _)| at)
            {
                self.text.truncate(at);
                self.stopped = Some(s.clone());
                return self.take(self.text.len());
            }
        }
        self.take(self.safe(stop))
    }

    /// The rest of the text, once generation has ended.
    pub fn finish(&mut self) -> String {
        self.take(self.text.len())
    }

    /// All text so far (up to a stop string).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Where the text that can be handed out ends: before any tail that is the start of a stop
    /// string.
    fn safe(&self, stop: &[String]) -> usize {
        let mut safe = self.text.len();
        for s in stop {
            for k in (1..s.len()).rev() {
                if s.is_char_boundary(k) && self.text.ends_with(&s[..k]) {
                    safe = safe.min(self.text.len() - k);
                    break;
                }
            }
        }
        safe
    }

    fn take(&mut self, end: usize) -> String {
        if end <= self.emitted || !self.text.is_char_boundary(end) {
            return String::new();
        }
        let out = self.text[self.emitted..end].to_string();
        self.emitted = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token i is the i-th string; 9 and 10 are the two halves of "é".
    struct Toy;
    impl Detokenize for Toy {
        fn decode(&self, ids: &[u32]) -> String {
            let mut bytes = Vec::new();
            for &t in ids {
                match t {
                    9 => bytes.push(0xC3),
                    10 => bytes.push(0xA9),
                    _ => bytes.extend(
                        ["a", "b", " ", "END", "x", "E", "N", "D", "!"][t as usize].bytes(),
                    ),
                }
            }
            String::from_utf8_lossy(&bytes).into_owned()
        }
    }

    fn run(ids: &[u32], stop: &[&str]) -> (Vec<String>, Text) {
        let stop: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
        let mut t = Text::default();
        let mut out = Vec::new();
        for n in 1..=ids.len() {
            out.push(t.push(&Toy, &ids[..n], &stop));
        }
        out.push(t.finish());
        (out, t)
    }

    #[test]
    fn text_is_handed_out_whole_and_stops_before_a_stop_string() {
        let (out, t) = run(&[0, 1, 2], &[]);
        assert_eq!(out.concat(), "ab ");
        assert_eq!(out[0], "a");
        // A character split over two tokens comes out whole, with the second.
        let (out, _) = run(&[0, 9, 10, 1], &[]);
        assert_eq!(out, ["a", "", "é", "b", ""]);
        // A stop string spread over tokens: held back while it could still match, cut when it
        // does; nothing after it.
        let (out, t2) = run(&[0, 5, 6, 7, 1], &["END"]);
        assert_eq!(out, ["a", "", "", "", "", ""]);
        assert_eq!(t2.stopped.as_deref(), Some("END"));
        assert_eq!(t2.text(), "a");
        // A held-back tail that does not become the stop string is handed out.
        let (out, t3) = run(&[5, 4, 3], &["END"]);
        assert_eq!(out.concat(), "Ex");
        assert_eq!(t3.stopped.as_deref(), Some("END"));
        assert_eq!(t.text(), "ab ");
        // The earliest of several stop strings wins.
        let (_, t4) = run(&[0, 1, 3, 8], &["!", "b"]);
        assert_eq!(t4.text(), "a");
    }
}
