//! Counters and histograms for plugin slots: calls, fallbacks by error class,
//! call time, and the metrics plugins record through the host imports. Lock-free
//! on the call path (relaxed atomics).

use std::fmt;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Why a plugin call was answered by the built-in policy instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorClass {
    /// The guest trapped (a panic, `unreachable`, a trapping WASI import, ...).
    Trap,
    /// The call ran out of fuel (`HostConfig::call_fuel`).
    Timeout,
    /// The guest asked for more memory than the limit allows, then trapped.
    Memory,
    /// The guest answered something the host refuses (index out of range,
    /// a bad rejection status, an over-long message, wrong list length).
    Invalid,
    /// No instance could be made for the call (instance pool exhausted, `init`
    /// failed or ran out of time or memory).
    Instantiate,
    /// Not called: the version failed several calls in a row and is benched for
    /// a short while (10 ms, doubling, at most 1 s).
    Benched,
}

impl ErrorClass {
    pub const ALL: [ErrorClass; 6] = [
        ErrorClass::Trap,
        ErrorClass::Timeout,
        ErrorClass::Memory,
        ErrorClass::Invalid,
        ErrorClass::Instantiate,
        ErrorClass::Benched,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorClass::Trap => "trap",
            ErrorClass::Timeout => "timeout",
            ErrorClass::Memory => "memory",
            ErrorClass::Invalid => "invalid",
            ErrorClass::Instantiate => "instantiate",
            ErrorClass::Benched => "benched",
        }
    }
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A histogram of non-negative values in log-spaced buckets: four per power of
/// two, from 1 to 2^63; quantiles are accurate to within ~19%.
pub struct LogHistogram {
    buckets: [AtomicU64; Self::BUCKETS],
    count: AtomicU64,
    /// Sum of recorded values, as f64 bits updated by compare-and-swap.
    sum_bits: AtomicU64,
}

impl LogHistogram {
    const SUB: usize = 4;
    const BUCKETS: usize = 64 * Self::SUB;

    pub fn new() -> Self {
        Self {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            count: AtomicU64::new(0),
            sum_bits: AtomicU64::new(0f64.to_bits()),
        }
    }

    fn bucket(value: f64) -> usize {
        if value.is_nan() || value <= 1.0 {
            return 0;
        }
        ((value.log2() * Self::SUB as f64) as usize).min(Self::BUCKETS - 1)
    }

    /// The upper bound of bucket `i`.
    fn upper(i: usize) -> f64 {
        ((i + 1) as f64 / Self::SUB as f64).exp2()
    }

    pub fn record(&self, value: f64) {
        self.buckets[Self::bucket(value)].fetch_add(1, Relaxed);
        self.count.fetch_add(1, Relaxed);
        let _ = self.sum_bits.fetch_update(Relaxed, Relaxed, |bits| {
            Some((f64::from_bits(bits) + value.max(0.0)).to_bits())
        });
    }

    pub fn count(&self) -> u64 {
        self.count.load(Relaxed)
    }

    pub fn sum(&self) -> f64 {
        f64::from_bits(self.sum_bits.load(Relaxed))
    }

    /// The value below which a fraction `q` of the recorded values fall
    /// (a bucket's upper bound); 0 when empty.
    pub fn quantile(&self, q: f64) -> f64 {
        let total = self.count();
        if total == 0 {
            return 0.0;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, b) in self.buckets.iter().enumerate() {
            seen += b.load(Relaxed);
            if seen >= rank {
                return Self::upper(i);
            }
        }
        Self::upper(Self::BUCKETS - 1)
    }
}

impl Default for LogHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for LogHistogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LogHistogram")
            .field("count", &self.count())
            .field("p50", &self.quantile(0.5))
            .finish()
    }
}

/// What one plugin slot has done since the gateway started (across versions).
#[derive(Debug, Default)]
pub struct SlotStats {
    /// Calls into the plugin (each plugin call, whatever its outcome).
    pub calls: AtomicU64,
    /// Answers the plugin deferred to the built-in policy (`use-default`).
    pub deferred: AtomicU64,
    fallbacks: [AtomicU64; ErrorClass::ALL.len()],
    /// Wall time of each plugin call, in nanoseconds.
    pub call_ns: LogHistogram,
    /// Log lines dropped by the rate limit.
    pub logs_dropped: AtomicU64,
}

impl SlotStats {
    pub fn count_fallback(&self, class: ErrorClass) {
        self.fallbacks[class as usize].fetch_add(1, Relaxed);
    }

    pub fn fallbacks(&self, class: ErrorClass) -> u64 {
        self.fallbacks[class as usize].load(Relaxed)
    }

    /// Fallbacks of every class, by name, in [`ErrorClass::ALL`] order.
    pub fn fallbacks_by_class(&self) -> Vec<(&'static str, u64)> {
        ErrorClass::ALL
            .iter()
            .map(|&c| (c.as_str(), self.fallbacks(c)))
            .collect()
    }

    pub fn total_fallbacks(&self) -> u64 {
        ErrorClass::ALL.iter().map(|&c| self.fallbacks(c)).sum()
    }
}

/// The most metric names one plugin may create (counters and histograms each).
pub const MAX_METRIC_NAMES: usize = 64;

/// The counters and histograms a plugin records through the host imports.
#[derive(Debug, Default)]
pub struct PluginMetrics {
    counters: Mutex<Vec<(String, u64)>>,
    histograms: Mutex<Vec<(String, std::sync::Arc<LogHistogram>)>>,
    /// Records refused because the plugin already had `MAX_METRIC_NAMES` names.
    pub refused: AtomicU64,
}

/// The longest metric name kept, in bytes.
const MAX_METRIC_NAME_BYTES: usize = 128;

impl PluginMetrics {
    pub fn counter_add(&self, name: &str, delta: u64) {
        let name = truncate(name, MAX_METRIC_NAME_BYTES);
        let mut counters = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, v)) = counters.iter_mut().find(|(n, _)| n == name) {
            *v = v.saturating_add(delta);
        } else if counters.len() < MAX_METRIC_NAMES {
            counters.push((name.to_string(), delta));
        } else {
            self.refused.fetch_add(1, Relaxed);
        }
    }

    pub fn histogram_record(&self, name: &str, value: f64) {
        let name = truncate(name, MAX_METRIC_NAME_BYTES);
        let hist = {
            let mut hists = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((_, h)) = hists.iter().find(|(n, _)| n == name) {
                h.clone()
            } else if hists.len() < MAX_METRIC_NAMES {
                let h = std::sync::Arc::new(LogHistogram::new());
                hists.push((name.to_string(), h.clone()));
                h
            } else {
                self.refused.fetch_add(1, Relaxed);
                return;
            }
        };
        hist.record(value);
    }

    /// Counter values by name.
    pub fn counters(&self) -> Vec<(String, u64)> {
        self.counters
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// (name, count, sum, p50, p99) of each histogram.
    pub fn histograms(&self) -> Vec<(String, u64, f64, f64, f64)> {
        let hists = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
        hists
            .iter()
            .map(|(n, h)| {
                (
                    n.clone(),
                    h.count(),
                    h.sum(),
                    h.quantile(0.5),
                    h.quantile(0.99),
                )
            })
            .collect()
    }
}

/// `s` cut to at most `max` bytes, on a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_land_in_the_right_bucket() {
        let h = LogHistogram::new();
        for v in 1..=1000 {
            h.record(v as f64);
        }
        let p50 = h.quantile(0.5);
        let p99 = h.quantile(0.99);
        assert!((500.0..=500.0 * 1.19).contains(&p50), "p50 {p50}");
        assert!((990.0..=990.0 * 1.19).contains(&p99), "p99 {p99}");
        assert_eq!(h.count(), 1000);
        assert_eq!(h.sum(), 500_500.0);
        assert_eq!(LogHistogram::new().quantile(0.5), 0.0);
    }

    #[test]
    fn plugin_metrics_cap_their_names() {
        let m = PluginMetrics::default();
        for i in 0..MAX_METRIC_NAMES + 3 {
            m.counter_add(&format!("c{i}"), 1);
        }
        m.counter_add("c0", 5);
        assert_eq!(m.counters().len(), MAX_METRIC_NAMES);
        assert_eq!(m.counters()[0], ("c0".to_string(), 6));
        assert_eq!(m.refused.load(Relaxed), 3);
    }

    #[test]
    fn truncate_respects_char_boundaries() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("abc", 10), "abc");
    }
}
