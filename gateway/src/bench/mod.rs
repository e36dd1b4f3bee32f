//! The benchmarks behind `sluice bench`: each prints one JSON object per line
//! and, last, a summary object. Figures go into BENCHMARKS.md with the command,
//! the machine and the date; nothing here asserts a timing.

mod engine;
mod gateway;
mod plugins;
pub mod upstream;

pub use engine::{EngineBenchOptions, run_engine_bench};
pub use gateway::{GatewayBenchOptions, run_gateway_bench};
pub use plugins::{PluginBenchOptions, run_plugin_bench};

use std::time::Instant;

/// Runs `f` `iters` times in each of `rounds` rounds and returns the median
/// nanoseconds per call.
pub fn median_ns_per_call(rounds: usize, iters: u64, mut f: impl FnMut()) -> f64 {
    let mut per_call: Vec<f64> = (0..rounds)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..iters {
                f();
            }
            started.elapsed().as_nanos() as f64 / iters as f64
        })
        .collect();
    per_call.sort_by(f64::total_cmp);
    per_call[per_call.len() / 2]
}
