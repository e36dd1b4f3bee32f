//! Byte-level BPE encoding of one segment without `tokenizers`' per-call
//! bookkeeping (offset tracking, normalized-string splits), which costs more
//! than the merges on short prompts. The split is GPT-2's pattern — run with
//! the `regex` crate, with its one look-ahead (`\s+(?!\S)`) applied by hand —
//! after SmolLM2-style digit isolation; the merges are `tokenizers`' own BPE
//! model. Words seen before take their ids from a bounded cache of our own
//! (piece bytes -> ids): `tokenizers`' path for a cached word still builds a
//! `Token` (id, offsets and the token's string, looked up in a 49k-entry
//! map) per id, which on a gateway's cold caches cost several µs a word.
//! Tests check it against `tokenizers` id for id.

use std::sync::Mutex;

use regex::Regex;
use tokenizers::Model;

use super::generations::Generations;

/// Pieces longer than this are not cached (long runs of letters or spaces
/// are rare and unlikely to repeat).
const MAX_CACHED_PIECE: usize = 48;
/// Words per cache generation; at most twice this many are kept.
const GENERATION_WORDS: usize = 32 * 1024;

/// GPT-2's split pattern without the look-ahead alternative.
const PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// Splits and maps text the way `Digits(individual) + ByteLevel(regex)` do.
#[derive(Debug)]
pub struct ByteLevelEncoder {
    split: Regex,
    /// Isolate every numeric character first (SmolLM2's `Digits(true)`).
    isolate_digits: bool,
    /// GPT-2's byte -> printable char table.
    byte_chars: [char; 256],
    /// Ids of pieces (as split, before the byte mapping) seen before.
    words: Mutex<Generations<Box<str>, Box<[u32]>>>,
}

/// GPT-2's `bytes_to_unicode`: printable bytes stand for themselves, the rest
/// are moved to 256 and up.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

impl ByteLevelEncoder {
    pub fn new(isolate_digits: bool) -> Self {
        Self {
            split: Regex::new(PATTERN).expect("the GPT-2 pattern compiles"),
            isolate_digits,
            byte_chars: byte_chars(),
            words: Mutex::new(Generations::new(
                GENERATION_WORDS,
                GENERATION_WORDS * (MAX_CACHED_PIECE + 32),
                // A word's bytes and ids, and the two boxes' pointers and lengths.
                |piece, ids| piece.len() + ids.len() * 4 + 32,
            )),
        }
    }

    /// Appends the ids of `text` (which holds no added tokens) to `out`.
    /// `model` must be the same on every call: the word cache keeps its ids.
    pub fn encode(
        &self,
        text: &str,
        model: &impl Model,
        out: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let mut mapped = String::new();
        let mut emit = |piece: &str| -> tokenizers::Result<()> {
            let cacheable = piece.len() <= MAX_CACHED_PIECE;
            if cacheable {
                let mut words = self.words.lock().unwrap_or_else(|e| e.into_inner());
                if words
                    .get_with(piece, |ids| out.extend_from_slice(ids))
                    .is_some()
                {
                    return Ok(());
                }
            }
            mapped.clear();
            for &b in piece.as_bytes() {
                mapped.push(self.byte_chars[b as usize]);
            }
            let from = out.len();
            out.extend(model.tokenize(&mapped)?.iter().map(|t| t.id));
            if cacheable {
                self.words
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(piece.into(), out[from..].into());
            }
            Ok(())
        };
        if !self.isolate_digits {
            return self.split_gpt2(text, &mut emit);
        }
        let mut at = 0;
        for (i, c) in text.char_indices() {
            if c.is_numeric() {
                self.split_gpt2(&text[at..i], &mut emit)?;
                emit(&text[i..i + c.len_utf8()])?;
                at = i + c.len_utf8();
            }
        }
        self.split_gpt2(&text[at..], &mut emit)
    }

    /// GPT-2's split of `piece`. `\s+(?!\S)` (tried before plain `\s+`) takes a
    /// whitespace run that ends the text, or all but the last character of a
    /// run followed by something else, leaving that character to start the
    /// next piece (` word`).
    fn split_gpt2(
        &self,
        piece: &str,
        emit: &mut impl FnMut(&str) -> tokenizers::Result<()>,
    ) -> tokenizers::Result<()> {
        self.split_gpt2_by(piece, piece.is_ascii(), emit)
    }

    /// `split_gpt2`, the pattern's matches found by `ascii_match_end` (ASCII
    /// text only) or by the regex.
    fn split_gpt2_by(
        &self,
        piece: &str,
        ascii: bool,
        emit: &mut impl FnMut(&str) -> tokenizers::Result<()>,
    ) -> tokenizers::Result<()> {
        let mut at = 0;
        while at < piece.len() {
            let (start, mut end) = if ascii {
                (at, ascii_match_end(piece.as_bytes(), at))
            } else {
                match self.split.find_at(piece, at) {
                    Some(m) => (m.start(), m.end()),
                    // Every character matches some alternative; keep going anyway.
                    None => return emit(&piece[at..]),
                }
            };
            let matched = &piece[start..end];
            if end < piece.len() && matched.chars().all(char::is_whitespace) {
                let last = matched.chars().next_back().map_or(0, char::len_utf8);
                if matched.len() > last {
                    end -= last;
                }
            }
            if start > at {
                emit(&piece[at..start])?;
            }
            emit(&piece[start..end])?;
            at = end;
        }
        Ok(())
    }
}

/// What PATTERN's alternatives see of an ASCII byte: `\p{L}`, `\p{N}`,
/// `\s` (Unicode White_Space: tab to carriage return, and space) or else.
#[derive(Clone, Copy, PartialEq, Eq)]
enum AsciiClass {
    Letter,
    Digit,
    Space,
    Other,
}

fn ascii_class(b: u8) -> AsciiClass {
    match b {
        b'a'..=b'z' | b'A'..=b'Z' => AsciiClass::Letter,
        b'0'..=b'9' => AsciiClass::Digit,
        b'\t'..=b'\r' | b' ' => AsciiClass::Space,
        _ => AsciiClass::Other,
    }
}

/// The end of PATTERN's match at `at` in ASCII text `s`, as the regex finds
/// it (leftmost-first: the first alternative that matches): every ASCII
/// byte matches some alternative, so the match starts at `at`. The regex
/// costs ~1k instructions a piece on short prompts (its search set-up per
/// call); this is a few a byte. Checked against the regex on random ASCII
/// text (the tests below).
fn ascii_match_end(s: &[u8], at: usize) -> usize {
    let rest = &s[at..];
    // 's 't 're 've 'm 'll 'd
    if rest.first() == Some(&b'\'') {
        for contraction in [&b"s"[..], b"t", b"re", b"ve", b"m", b"ll", b"d"] {
            if rest[1..].starts_with(contraction) {
                return at + 1 + contraction.len();
            }
        }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: a run of one class, after
    // one space where one leads; else `\s+`.
    let (run_from, class) = match rest {
        [b' ', next, ..] if ascii_class(*next) != AsciiClass::Space => (at + 1, ascii_class(*next)),
        [first, ..] => (at, ascii_class(*first)),
        [] => return at,
    };
    run_from
        + s[run_from..]
            .iter()
            .take_while(|&&b| ascii_class(b) == class)
            .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces of `text`, split through the regex or by hand.
    fn pieces(encoder: &ByteLevelEncoder, text: &str, ascii: bool) -> Vec<String> {
        let mut out = Vec::new();
        encoder
            .split_gpt2_by(text, ascii, &mut |p| {
                out.push(p.to_string());
                Ok(())
            })
            .unwrap();
        out
    }

    /// The hand-written ASCII split gives the regex's pieces: on text made
    /// of the pattern's hard cases (contractions, a space before each
    /// class, runs of whitespace kinds, control characters, apostrophes
    /// that start no contraction), 20,000 random strings, and all of
    /// printable ASCII.
    #[test]
    fn the_ascii_split_is_the_regexs() {
        let encoder = ByteLevelEncoder::new(false);
        let parts = [
            "'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'x", "'", "''", " ", "  ", "\t",
            "\n", "\r\n", "\x0b", "\x0c", "\x00", "\x1f", "\x7f", "a", "Zz", "word", "7", "42",
            "!", "?!", ".", "-", "_", "@#",
        ];
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..20_000 {
            let len = next() % 12;
            let text: String = (0..len)
                .map(|_| parts[(next() % parts.len() as u64) as usize])
                .collect();
            assert_eq!(
                pieces(&encoder, &text, true),
                pieces(&encoder, &text, false),
                "{text:?}"
            );
        }
        let printable: String = (0u8..128).map(char::from).collect();
        assert_eq!(
            pieces(&encoder, &printable, true),
            pieces(&encoder, &printable, false)
        );
        let prose = "Customer 17 asks: how much does it cost to replace a chain?  I'd say\n\n  it's 'fine'...";
        assert_eq!(
            pieces(&encoder, prose, true),
            pieces(&encoder, prose, false)
        );
    }

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
    }
}
