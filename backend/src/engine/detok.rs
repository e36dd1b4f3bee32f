//! Incremental detokenization with stop strings: turns the generated token ids
//! into text deltas, never emits a partial UTF-8 character, and holds back text
//! that could still turn out to be the start of a stop string.

use crate::model::Tokenizer;

/// The text side of one generating sequence.
#[derive(Debug, Default)]
pub struct Detokenizer {
    /// Generated token ids so far.
    ids: Vec<u32>,
    /// Text decoded from `ids`, cut at a stop string once one is seen.
    text: String,
    /// Bytes of `text` already emitted.
    emitted: usize,
    stop_strings: Vec<String>,
    /// Set when a stop string was found: the text ends before it.
    stopped: bool,
}

impl Detokenizer {
    pub fn new(stop_strings: Vec<String>) -> Self {
        Self {
            stop_strings: stop_strings.into_iter().filter(|s| !s.is_empty()).collect(),
            ..Self::default()
        }
    }

    /// Adds a token; returns the text that can be emitted now, and whether a
    /// stop string ended the text.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> (String, bool) {
        self.ids.push(id);
        let decoded = tokenizer.decode(&self.ids, true).unwrap_or_default();
        // A trailing replacement character is a UTF-8 sequence still incomplete.
        if decoded.ends_with('\u{FFFD}') {
            return (String::new(), false);
        }
        let search_from = self
            .text
            .len()
            .saturating_sub(self.stop_strings.iter().map(String::len).max().unwrap_or(0));
        self.text = decoded;
        let hit = self
            .stop_strings
            .iter()
            .filter_map(|s| {
                let from = floor_char_boundary(&self.text, search_from);
                self.text[from..].find(s.as_str()).map(|at| from + at)
            })
            .min();
        if let Some(at) = hit {
            self.text.truncate(at);
            self.stopped = true;
        }
        // Hold back a tail that could be the start of a stop string.
        let hold = if self.stopped { 0 } else { self.held_back() };
        let end = floor_char_boundary(&self.text, self.text.len() - hold).max(self.emitted);
        let delta = self.text[self.emitted..end].to_string();
        self.emitted = end;
        (delta, self.stopped)
    }

    /// Text not emitted yet (the held-back tail), for the end of generation.
    pub fn flush(&mut self) -> String {
        let rest = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        rest
    }

    /// The longest suffix of the text that is a proper prefix of a stop string.
    fn held_back(&self) -> usize {
        self.stop_strings
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n))
                    .map(move |n| &s[..n])
            })
            .filter(|prefix| self.text.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0)
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}
