//! What the host offers a plugin (log, metrics, clock). In a Wasm component these
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
