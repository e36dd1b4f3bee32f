//! Newline-delimited records (a sluice worker's NDJSON events) as they
//! arrive in chunks of any size: whole lines are handed out where they lie
//! in the buffer, and the bytes they took are dropped once per chunk, not
//! line by line (a worker's whole answer can come in one chunk).

/// The bytes received and not yet handed out as whole lines.
#[derive(Debug, Default)]
pub struct Lines {
    buf: Vec<u8>,
    /// Bytes of `buf` already handed out.
    read: usize,
}

impl Lines {
    /// Adds a chunk as it came.
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.drain(..self.read);
        self.read = 0;
        self.buf.extend_from_slice(chunk);
    }

    /// The next whole line, without its newline; None until one is complete.
    pub fn next_line(&mut self) -> Option<&[u8]> {
        let len = self.buf[self.read..].iter().position(|&b| b == b'\n')?;
        let line = &self.buf[self.read..self.read + len];
        self.read += len + 1;
        Some(line)
    }
}

#[cfg(test)]
mod tests {
    use super::Lines;

    /// Every way of cutting a stream into two or three chunks gives the same
    /// lines, empty ones included, and an unfinished last line waits.
    #[test]
    fn lines_come_whole_wherever_the_chunks_are_cut() {
        let stream = b"{\"a\":1}\n\n{\"b\":\"x y\"}\n{\"c\":3}\nunfinished";
        let want: Vec<&[u8]> = vec![b"{\"a\":1}", b"", b"{\"b\":\"x y\"}", b"{\"c\":3}"];
        for i in 0..=stream.len() {
            for j in i..=stream.len() {
                let mut lines = Lines::default();
                let mut got = Vec::new();
                for chunk in [&stream[..i], &stream[i..j], &stream[j..]] {
                    lines.push(chunk);
                    while let Some(line) = lines.next_line() {
                        got.push(line.to_vec());
                    }
                }
                assert_eq!(got, want, "cut at {i} and {j}");
                lines.push(b"\n");
                assert_eq!(
                    lines.next_line(),
                    Some(&b"unfinished"[..]),
                    "cut at {i} and {j}"
                );
                assert_eq!(lines.next_line(), None);
            }
        }
    }
}
