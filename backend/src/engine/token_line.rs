//! The worker's token line read without serde: a gateway reads one for every
//! generated token, and serde_json spends most of its time on the line's
//! keys (~1.7k instructions a line under callgrind, of a request's ~188k).
//! Only the exact form a worker writes is read here, the fields in serde's
//! order with `top` left out and text that needs no unescaping:
//! `{"event":"token","id":7,"text":" tok","logprob":-0.25}`; anything else
//! (alternatives, escapes, another order, a number JSON does not allow) is
//! left to serde, so what is accepted or refused does not change.

use super::types::TokenOut;

/// A token line in the worker's own form, or None (then serde decides).
pub(super) fn plain_token_line(line: &str) -> Option<TokenOut> {
    let rest = line.strip_prefix(r#"{"event":"token","id":"#)?;
    // (Byte searches: `str::find` with a char costs ~130 instructions a
    // call on these few bytes; both bytes are ASCII, so char boundaries.)
    let comma = byte_at(rest, b',')?;
    let id = json_u32(&rest[..comma])?;
    let rest = rest[comma + 1..].strip_prefix(r#""text":""#)?;
    // The first quote ends the text unless a backslash came before it: a
    // text with any backslash, or a control character JSON refuses raw,
    // goes to serde.
    let end = byte_at(rest, b'"')?;
    let text = &rest[..end];
    if text.bytes().any(|b| b == b'\\' || b < 0x20) {
        return None;
    }
    let number = rest[end + 1..]
        .strip_prefix(r#","logprob":"#)?
        .strip_suffix('}')?;
    Some(TokenOut {
        id,
        text: text.to_owned(),
        logprob: json_f32(number)?,
        top: Vec::new(),
    })
}

/// Where `byte` first is in `s`.
fn byte_at(s: &str, byte: u8) -> Option<usize> {
    s.bytes().position(|b| b == byte)
}

/// A JSON integer that fits u32: digits, no leading zero but "0" itself.
fn json_u32(s: &str) -> Option<u32> {
    let b = s.as_bytes();
    if b.is_empty() || !b.iter().all(u8::is_ascii_digit) || (b.len() > 1 && b[0] == b'0') {
        return None;
    }
    s.parse().ok()
}

/// A JSON number as f32, for what a worker writes (ryu's shortest form,
/// at most 15 bytes for an f32): longer ones go to serde, which reads
/// through f64 and could differ in the last bit from this correctly
/// rounded parse. Rust's parser takes more than JSON allows ("1.", ".5",
/// "inf"), so the grammar is checked first.
fn json_f32(s: &str) -> Option<f32> {
    if let Some(v) = short_decimal_f32(s.as_bytes()) {
        return Some(v);
    }
    if s.len() > 16 || !json_number(s.as_bytes()) {
        return None;
    }
    s.parse().ok()
}

/// Powers of ten exact in f32.
const POW10_F32: [f32; 11] = [1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10];

/// A JSON number without exponent whose digits make an integer m ≤ 2^24
/// with at most 10 after the point, read in one pass: m and 10^k are exact
/// in f32, so one division rounds correctly (Clinger's fast path) and gives
/// the bits `str::parse` gives, at a fraction of its cost. Anything else
/// (an exponent, more digits) is `None`.
fn short_decimal_f32(b: &[u8]) -> Option<f32> {
    let (negative, digits) = match b.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, b),
    };
    let (mut m, mut int_digits, mut frac_digits, mut point) = (0u32, 0u32, 0u32, false);
    for &c in digits {
        match c {
            b'0'..=b'9' => {
                m = m.checked_mul(10)?.checked_add(u32::from(c - b'0'))?;
                if point {
                    frac_digits += 1;
                } else {
                    int_digits += 1;
                }
            }
            b'.' if !point => point = true,
            _ => return None,
        }
    }
    let leading_zero = digits.first() == Some(&b'0');
    if int_digits == 0 || (int_digits > 1 && leading_zero) || (point && frac_digits == 0) {
        return None;
    }
    if m > 1 << 24 || frac_digits as usize >= POW10_F32.len() {
        return None;
    }
    let v = m as f32 / POW10_F32[frac_digits as usize];
    Some(if negative { -v } else { v })
}

/// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?`
fn json_number(b: &[u8]) -> bool {
    let digits = |i: usize| b[i..].iter().take_while(|c| c.is_ascii_digit()).count();
    let mut i = usize::from(b.first() == Some(&b'-'));
    match digits(i) {
        0 => return false,
        n if n > 1 && b[i] == b'0' => return false,
        n => i += n,
    }
    if b.get(i) == Some(&b'.') {
        match digits(i + 1) {
            0 => return false,
            n => i += 1 + n,
        }
    }
    if matches!(b.get(i), Some(b'e' | b'E')) {
        i += 1;
        if matches!(b.get(i), Some(b'+' | b'-')) {
            i += 1;
        }
        match digits(i) {
            0 => return false,
            n => i += n,
        }
    }
    i == b.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::GenerateEvent;
    use rand::{Rng, SeedableRng};

    #[test]
    fn short_decimals_read_as_str_parse_reads_them() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let mut fast = 0;
        for i in 0..200_000 {
            let x: f32 = match i % 3 {
                0 => -rng.random::<f32>() * 20.0,
                1 => f32::from_bits(rng.random::<u32>() & 0xbfff_ffff),
                _ => rng.random_range(-1e4f32..1e4),
            };
            if !x.is_finite() {
                continue;
            }
            for text in [
                serde_json::to_string(&x).unwrap(),
                format!("{x:.3}"),
                format!("{x:.9}"),
                format!("{}", x.round()),
            ] {
                let want: Option<f32> = json_number(text.as_bytes()).then(|| text.parse().unwrap());
                match short_decimal_f32(text.as_bytes()) {
                    Some(got) => {
                        fast += 1;
                        assert_eq!(Some(got.to_bits()), want.map(f32::to_bits), "{text}");
                    }
                    // (7 digits or fewer: an integer under 2^24, at most 7 after the point.)
                    None => assert!(
                        want.is_none()
                            || text.contains(['e', 'E'])
                            || text.bytes().filter(u8::is_ascii_digit).count() > 7,
                        "{text} is short and plain, yet not read"
                    ),
                }
            }
        }
        assert!(fast > 200_000, "only {fast} on the fast path");
        for text in [
            "",
            "-",
            "01",
            "-01",
            "1.",
            ".5",
            "1.2.3",
            "+1",
            "1e5",
            "0x1",
            "16777217",
            "1.23456789012",
        ] {
            assert_eq!(short_decimal_f32(text.as_bytes()), None, "{text}");
        }
        assert_eq!(
            short_decimal_f32(b"-0").map(f32::to_bits),
            Some((-0.0f32).to_bits())
        );
        assert_eq!(short_decimal_f32(b"16777216"), Some(16_777_216.0));
        assert_eq!(short_decimal_f32(b"-0.0000000001"), Some(-1e-10));
    }

    /// What serde reads from `line`, as a token (None: refused or another event).
    fn by_serde(line: &str) -> Option<TokenOut> {
        match serde_json::from_str::<GenerateEvent>(line) {
            Ok(GenerateEvent::Token(t)) => Some(t),
            _ => None,
        }
    }

    /// Token lines as a worker writes them, over random ids, texts (escapes,
    /// controls, quotes, non-ASCII) and logprobs (every f32 bit pattern,
    /// subnormals and non-finite ones included): wherever the plain reader
    /// answers, it answers what serde does, to the bit; it answers for
    /// most lines of plain text; and `from_line` always agrees with serde.
    #[test]
    fn plain_lines_read_as_serde_reads_them() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let pieces = [
            " tok", "a", "", "\"", "\\", "\n", "\u{1}", "é", "日本", "🙂", "/", "\t", "}", ",",
        ];
        let (mut plain, mut lines) = (0, 0);
        for i in 0..20_000 {
            let text: String = (0..rng.random_range(0..4))
                .map(|_| pieces[rng.random_range(0..pieces.len())])
                .collect();
            let logprob = match i % 4 {
                0 => f32::from_bits(rng.random()),
                1 => -rng.random::<f32>() * 30.0,
                2 => -(rng.random_range(0..64) as f32) / 8.0,
                _ => f32::from_bits(rng.random_range(0..0x0080_0000)), // subnormal
            };
            let token = TokenOut {
                id: if i % 7 == 0 {
                    u32::MAX - i
                } else {
                    rng.random_range(0..200_000)
                },
                text,
                logprob,
                top: Vec::new(),
            };
            let line = serde_json::to_string(&GenerateEvent::Token(token)).unwrap();
            lines += 1;
            let serde = by_serde(&line);
            if let Some(t) = plain_token_line(&line) {
                plain += 1;
                let s = serde
                    .clone()
                    .expect("serde reads what the plain reader reads");
                assert_eq!(
                    (t.id, &t.text, t.logprob.to_bits()),
                    (s.id, &s.text, s.logprob.to_bits()),
                    "{line}"
                );
            }
            let from_line = GenerateEvent::from_line(&line).ok();
            assert_eq!(from_line, serde.map(GenerateEvent::Token), "{line}");
        }
        // 9 of the 14 pieces need no escape, so a little over half the texts
        // are plain (and nearly every random f32 is finite).
        assert!(plain > lines / 3, "{plain} of {lines} lines read plainly");
    }

    /// Lines a worker does not write, or JSON refuses: the plain reader
    /// passes them on, and what is accepted or refused is serde's call.
    #[test]
    fn other_lines_are_left_to_serde() {
        for line in [
            r#"{"event":"token","id":01,"text":"a","logprob":0.0}"#,
            r#"{"event":"token","id":-1,"text":"a","logprob":0.0}"#,
            r#"{"event":"token","id":4294967296,"text":"a","logprob":0.0}"#,
            r#"{"event":"token","id":,"text":"a","logprob":0.0}"#,
            r#"{"event":"token","id":1,"text":"a\"b","logprob":0.0}"#,
            "{\"event\":\"token\",\"id\":1,\"text\":\"a\tb\",\"logprob\":0.0}", // a raw tab
            r#"{"event":"token","id":1,"text":"a","logprob":1.}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":.5}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":+1}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":inf}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":NaN}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":00}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":1e}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":null}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":-0.000000000012345}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":0.5} "#,
            r#"{"event":"token","id":1,"text":"a","logprob":0.5}}"#,
            r#"{"event":"token","id":1,"text":"a","logprob":0.5,"top":[]}"#,
            r#"{"event":"token","id":1,"logprob":0.5,"text":"a"}"#,
        ] {
            assert_eq!(plain_token_line(line), None, "{line}");
            assert_eq!(
                GenerateEvent::from_line(line).ok(),
                by_serde(line).map(GenerateEvent::Token),
                "{line}"
            );
        }
        // Numbers as JSON has them, each read plainly.
        for (number, value) in [
            ("0", 0.0),
            ("-0.5", -0.5),
            ("1e-7", 1e-7),
            ("-2.5E+3", -2500.0),
            ("10", 10.0),
        ] {
            let line = format!(r#"{{"event":"token","id":0,"text":"","logprob":{number}}}"#);
            assert_eq!(
                plain_token_line(&line).map(|t| t.logprob),
                Some(value),
                "{line}"
            );
        }
    }
}
