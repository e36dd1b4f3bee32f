//! The benchmarks behind `sluice bench`: each prints one JSON object per line
//! and, last, a summary object. Figures go into BENCHMARKS.md with the command,
//! the machine and the date; nothing here asserts a timing.

mod engine;
mod engine_cuda;
mod fp4;
mod fp4_gpu;
mod gateway;
mod plugins;
mod relay;
pub mod routing;
mod transfer;
pub mod upstream;

pub use engine::{EngineBenchOptions, run_engine_bench};
pub use engine_cuda::{CudaEngineBenchOptions, run_cuda_engine_bench};
pub use fp4::{Fp4BenchOptions, run_fp4_accuracy_bench};
pub use fp4_gpu::run_fp4_gpu_bench;
pub use gateway::{GatewayBenchOptions, process_cpu_ns, run_gateway_bench};
pub use plugins::{PluginBenchOptions, run_plugin_bench};
pub use relay::run as run_relay;
pub use routing::{RoutingBenchOptions, TraceChoice, run_routing_bench};
pub use transfer::{TransferBenchOptions, run_transfer_bench};

use std::process::Child;
use std::time::{Duration, Instant};

/// A child process killed when dropped.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Waits until `url` answers 2xx (at most `limit`).
async fn wait_ready(client: &reqwest::Client, url: &str, limit: Duration) -> Result<(), String> {
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < limit {
        match client.get(url).timeout(Duration::from_secs(1)).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            Ok(r) => last = format!("{url} answered {}", r.status()),
            Err(e) => last = format!("{url}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(last)
}

/// The `q` quantile (0..=1) of sorted values, nearest rank; NaN when empty.
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

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
