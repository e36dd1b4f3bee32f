//! What each plugin `Store` carries: the memory limiter, the plugin's identity,
//! and the slot-wide shared parts (stats, metrics, log rate limit, shared
//! entries).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use wasmtime::ResourceLimiter;

use super::shared::SharedStore;
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

/// A token bucket: `rate` tokens a second, burst of one second's worth.
#[derive(Debug)]
struct RateLimit {
    rate: f64,
    /// (tokens, last refill).
    bucket: Mutex<(f64, Instant)>,
}

impl RateLimit {
    fn new(rate: f64) -> Self {
        Self {
            rate,
            bucket: Mutex::new((rate, Instant::now())),
        }
    }

    fn allow(&self) -> bool {
        let mut bucket = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let refill = now.duration_since(bucket.1).as_secs_f64() * self.rate;
        *bucket = ((bucket.0 + refill).min(self.rate), now);
        if bucket.0 >= 1.0 {
            bucket.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Parts of a slot that every store of every version shares.
#[derive(Debug)]
pub struct SlotShared {
    pub stats: SlotStats,
    pub metrics: Arc<PluginMetrics>,
    pub max_log_line_bytes: usize,
    /// The entries the slot's instances share (kept across its versions).
    pub store: SharedStore,
    /// The plugin's own `log` lines.
    plugin_log: RateLimit,
    /// The host's warnings about the plugin (kept apart, so that a plugin cannot
    /// drown out the reports of its own failures).
    host_log: RateLimit,
}

impl SlotShared {
    pub fn new(
        log_lines_per_sec: f64,
        max_log_line_bytes: usize,
        max_shared_entries: usize,
    ) -> Self {
        Self {
            stats: SlotStats::default(),
            metrics: Arc::new(PluginMetrics::default()),
            max_log_line_bytes,
            store: SharedStore::new(max_shared_entries),
            plugin_log: RateLimit::new(log_lines_per_sec),
            host_log: RateLimit::new(log_lines_per_sec),
        }
    }

    /// May the plugin log one more line now?
    pub fn allow_log_line(&self) -> bool {
        self.plugin_log.allow()
    }

    /// May the host log one more warning about this slot now?
    pub fn allow_host_log_line(&self) -> bool {
        self.host_log.allow()
    }
}

/// The error a guest gets from any `wasi:*` import: nothing but
/// `sluice:policy/host` is granted.
#[derive(Debug, thiserror::Error)]
#[error("import `{0}` is denied: plugins get no WASI (only sluice:policy/host)")]
pub struct DeniedImport(pub String);

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

/// The data of one plugin `Store`.
#[derive(Debug)]
pub struct HostState {
    pub limiter: MemoryLimiter,
    pub identity: Arc<PluginIdentity>,
    pub slot: Arc<SlotShared>,
    pub started: Instant,
    /// Shared entries for this store alone, instead of the slot's: the
    /// load-time smoke call's made-up request must leave no entry behind.
    pub scratch: Option<Box<SharedStore>>,
}

impl HostState {
    /// The shared entries this store's calls read and write.
    pub fn shared(&self) -> &SharedStore {
        self.scratch.as_deref().unwrap_or(&self.slot.store)
    }

    pub fn new(
        identity: Arc<PluginIdentity>,
        slot: Arc<SlotShared>,
        max_memory_bytes: usize,
        started: Instant,
    ) -> Self {
        Self {
            limiter: MemoryLimiter {
                max_bytes: max_memory_bytes,
                hit: false,
            },
            identity,
            slot,
            started,
            scratch: None,
        }
    }
}
