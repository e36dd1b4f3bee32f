//! W3C trace context (`traceparent`): continued from the client's header or
//! started here, and passed on to the worker with the gateway's own span id,
//! so a worker's logs join the client's trace.

use std::sync::atomic::{AtomicU64, Ordering};

/// One request's place in a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: u128,
    /// The gateway's span for this request.
    pub span_id: u64,
    /// The caller's span, when the client sent one.
    pub parent_id: Option<u64>,
    pub sampled: bool,
}

/// Cheap unique ids: a per-process random start, then a counter mixed by
/// splitmix64.
fn next_id() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let start = *START.get_or_init(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        t ^ (u64::from(std::process::id()) << 32)
    });
    let mut z = start.wrapping_add(
        COUNTER
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15),
    );
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)).max(1)
}

impl TraceContext {
    /// Continues the client's `traceparent`, or starts a trace when it is
    /// absent or malformed (as the W3C spec says to).
    pub fn from_header(traceparent: Option<&str>) -> Self {
        if let Some(parent) = traceparent.and_then(Self::parse) {
            return Self {
                span_id: next_id(),
                parent_id: parent.parent_id,
                ..parent
            };
        }
        Self {
            trace_id: (u128::from(next_id()) << 64) | u128::from(next_id()),
            span_id: next_id(),
            parent_id: None,
            sampled: true,
        }
    }

    /// Parses `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`.
    fn parse(header: &str) -> Option<Self> {
        let mut parts = header.trim().split('-');
        let version = parts.next()?;
        let trace = parts.next()?;
        let span = parts.next()?;
        let flags = parts.next()?;
        if version.len() != 2
            || version == "ff"
            || trace.len() != 32
            || span.len() != 16
            || flags.len() != 2
        {
            return None;
        }
        if version == "00" && parts.next().is_some() {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|&t| t != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|&s| s != 0)?;
        let flags = u8::from_str_radix(flags, 16).ok()?;
        Some(Self {
            trace_id,
            span_id,
            parent_id: Some(span_id),
            sampled: flags & 1 == 1,
        })
    }

    /// The header sent to the worker: same trace, the gateway's span as parent.
    pub fn header(&self) -> String {
        format!(
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id,
            self.span_id,
            u8::from(self.sampled)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_a_valid_parent_and_starts_one_otherwise() {
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = TraceContext::from_header(Some(parent));
        assert_eq!(t.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(t.parent_id, Some(0x00f067aa0ba902b7));
        assert_ne!(
            t.span_id, 0x00f067aa0ba902b7,
            "the gateway has its own span"
        );
        assert!(
            t.header()
                .starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-")
        );
        assert!(t.header().ends_with("-01"));
        assert_eq!(
            TraceContext::parse(&t.header()).unwrap().trace_id,
            t.trace_id
        );
        for bad in [
            "",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
        ] {
            let t = TraceContext::from_header(Some(bad));
            assert_eq!(t.parent_id, None, "{bad:?} starts a new trace");
            assert_ne!(t.trace_id, 0);
        }
        let a = TraceContext::from_header(None);
        let b = TraceContext::from_header(None);
        assert_ne!(a.trace_id, b.trace_id);
    }
}
