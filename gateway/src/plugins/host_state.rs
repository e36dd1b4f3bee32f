//! What each plugin `Store` carries: the memory limiter, the plugin's identity,
//! and the slot-wide shared parts (stats, metrics, log rate limit).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use wasmtime::ResourceLimiter;

use super::stats::{PluginMetrics, SlotStats};

/// A plugin version's name, as operators see it in logs and the admin API.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PluginIdentity {
    /// The plugin's name (its file stem, or the name it was uploaded under).
    pub name: String,
    /// The slot-local version number: 1 for the first load, +1 for each swap.
    pub version: u64,
    /// The first 16 hex digits of the component's SHA-256.
    pub digest: String,
}

/// Parts of a slot that every store of every version shares.
#[derive(Debug)]
pub struct SlotShared {
    pub stats: SlotStats,
    pub metrics: Arc<PluginMetrics>,
    pub max_log_line_bytes: usize,
    log_rate: f64,
    /// (tokens, last refill) of the log rate limit.
    log_bucket: Mutex<(f64, Instant)>,
}

impl SlotShared {
    pub fn new(log_lines_per_sec: f64, max_log_line_bytes: usize) -> Self {
        Self {
            stats: SlotStats::default(),
            metrics: Arc::new(PluginMetrics::default()),
            max_log_line_bytes,
            log_rate: log_lines_per_sec,
            log_bucket: Mutex::new((log_lines_per_sec, Instant::now())),
        }
    }

    /// Takes one token from the log bucket (burst = one second's worth).
    pub fn allow_log_line(&self) -> bool {
        let mut bucket = self.log_bucket.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(bucket.1).as_secs_f64() * self.log_rate;
        *bucket = ((bucket.0 + refill).min(self.log_rate), now);
        if bucket.0 >= 1.0 {
            bucket.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Caps linear memory and remembers whether the cap was hit, so that the trap
/// that follows is counted as a memory error.
#[derive(Debug)]
pub struct MemoryLimiter {
    max_bytes: usize,
    pub hit: bool,
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.max_bytes {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

/// The deadline of the call in progress, checked at every epoch tick.
#[derive(Debug)]
pub struct CallDeadline {
    /// CPU time the call may use after the first tick that finds it running.
    pub cpu_budget_ns: u64,
    /// Ticks after which the call stops regardless.
    pub max_ticks: u64,
    /// Thread CPU time at the first tick of this call.
    first_tick_cpu_ns: Option<u64>,
    ticks: u64,
}

impl CallDeadline {
    /// Starts a new call with `budget` of CPU time.
    pub fn reset(&mut self, budget: std::time::Duration) {
        self.cpu_budget_ns = budget.as_nanos() as u64;
        self.first_tick_cpu_ns = None;
        self.ticks = 0;
    }

    /// Called at each epoch tick during a call: keep running?
    pub fn tick(&mut self) -> bool {
        self.ticks += 1;
        let now = thread_cpu_ns();
        let first = *self.first_tick_cpu_ns.get_or_insert(now);
        now.saturating_sub(first) < self.cpu_budget_ns && self.ticks < self.max_ticks
    }
}

/// CPU time used by the calling thread, in nanoseconds.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID is
    // supported on every Linux and macOS the gateway runs on.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return u64::MAX; // no CPU clock: stop at the first tick past the budget
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The data of one plugin `Store`.
#[derive(Debug)]
pub struct HostState {
    pub limiter: MemoryLimiter,
    pub deadline: CallDeadline,
    pub identity: Arc<PluginIdentity>,
    pub slot: Arc<SlotShared>,
    pub started: Instant,
}

impl HostState {
    pub fn new(
        identity: Arc<PluginIdentity>,
        slot: Arc<SlotShared>,
        max_memory_bytes: usize,
        max_ticks: u64,
        started: Instant,
    ) -> Self {
        Self {
            limiter: MemoryLimiter {
                max_bytes: max_memory_bytes,
                hit: false,
            },
            deadline: CallDeadline {
                cpu_budget_ns: 0,
                max_ticks,
                first_tick_cpu_ns: None,
                ticks: 0,
            },
            identity,
            slot,
            started,
        }
    }
}
