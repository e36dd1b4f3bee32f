//! What the host offers a plugin (log, metrics, clock, shared entries). In a Wasm component these
//! call the host's imports; on a native target (unit tests) they go to
//! [`crate::testing`], which records them and lets a test set the clock.

pub use crate::bindings::sluice::policy::host::Level;

#[cfg(target_family = "wasm")]
use crate::bindings::sluice::policy::host as imp;
#[cfg(not(target_family = "wasm"))]
use crate::testing::native_host as imp;

/// Writes a line to the gateway's log, tagged with the plugin's name and version.
/// The host rate-limits it per plugin and cuts long lines.
pub fn log(level: Level, message: &str) {
    imp::log(level, message)
}

/// Adds `delta` to the plugin's counter `name` (at most 64 names per plugin).
pub fn counter_add(name: &str, delta: u64) {
    imp::counter_add(name, delta)
}

/// Records `value` into the plugin's histogram `name` (at most 64 names per plugin).
pub fn histogram_record(name: &str, value: f64) {
    imp::histogram_record(name, value)
}

/// Monotonic nanoseconds since an origin fixed for the host's life.
pub fn now_ns() -> u64 {
    imp::now_ns()
}

/// The entries every instance of the plugin's slot shares (`wit/README.md`,
/// "State"): u64 values under u64 keys, each living `ttl_ms` milliseconds
/// (0 = until removed). The host runs several instances of a plugin side by
/// side, so state each call must see alike (a session's worker, a tenant's
/// budget) goes here rather than in the policy's fields. Natively (unit tests)
/// the entries are per thread: two harnesses on one thread share them, as two
/// instances in the gateway do, and they expire by the test clock.
pub mod shared {
    use super::imp;

    /// The value under `key`, if it is there and has not expired.
    pub fn get(key: u64) -> Option<u64> {
        imp::shared_get(key)
    }

    /// Stores `value` under `key` for `ttl_ms`; false (nothing stored) when
    /// the key is new and the slot's store is full.
    pub fn set(key: u64, value: u64, ttl_ms: u32) -> bool {
        imp::shared_set(key, value, ttl_ms)
    }

    /// Stores `new` under `key` only if its value now is `expected` (`None`:
    /// absent or expired); true when it stored. A read-modify-write loop on
    /// it cannot lose an update to an instance running beside this one.
    pub fn compare_and_swap(key: u64, expected: Option<u64>, new: u64, ttl_ms: u32) -> bool {
        imp::shared_compare_and_swap(key, expected, new, ttl_ms)
    }

    /// Removes `key`'s entry, if any.
    pub fn remove(key: u64) {
        imp::shared_remove(key)
    }
}
