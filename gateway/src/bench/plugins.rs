//! `sluice bench plugins`: the cost of a KV-aware routing decision through the
//! Wasm host (pool checkout, deadline, lowering the fleet, the guest's cost loop,
//! lifting and checking the answer) against the same policy in native Rust, and
//! the cost of loading, validating and swapping a plugin version.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use serde_json::{Value, json};

use super::median_ns_per_call;
use crate::plugins::{HostConfig, Router, Runtime, Slot, WasmRouter};
use crate::policy::{
    FleetView, Hop, KvAwareRouter, RequestView, RouterPolicy, WorkerLoad, WorkerState,
};

/// What `sluice bench plugins` measures.
#[derive(Clone, Debug)]
pub struct PluginBenchOptions {
    /// Folder holding `kv_aware.wasm` (built by `make plugins`).
    pub plugins_dir: PathBuf,
    /// Fleet sizes to route over.
    pub workers: Vec<usize>,
    /// Calls per timed round at 64 workers (scaled for other sizes).
    pub calls: u64,
    /// Timed rounds per figure (the median is reported).
    pub rounds: usize,
    /// Load-validate-swap cycles for the swap figures.
    pub swaps: usize,
}

impl Default for PluginBenchOptions {
    fn default() -> Self {
        Self {
            plugins_dir: PathBuf::from("plugins/target/wasm32-wasip2/release"),
            workers: vec![8, 64, 512],
            calls: 200_000,
            rounds: 5,
            swaps: 10,
        }
    }
}

/// Errors that stop the benchmark before it measures anything.
#[derive(Debug, thiserror::Error)]
pub enum PluginBenchError {
    #[error("cannot read {path} (build the plugins with `make plugins`)")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Load(#[from] crate::plugins::LoadError),
    #[error("cannot start the plugin runtime: {0}")]
    Runtime(String),
}

/// A fleet of `n` healthy workers with varied load and cached prefixes.
fn bench_fleet(n: usize) -> FleetView {
    let workers: Vec<WorkerLoad> = (0..n as u32)
        .map(|i| {
            let mix = i.wrapping_mul(2_654_435_761);
            WorkerLoad {
                state: WorkerState::new(true, true, true),
                id: i + 1,
                active_requests: mix % 17,
                queued_prefill_tokens: mix % 4096,
                kv_blocks_used: mix % 3000,
                kv_blocks_total: 4096,
                overlap_blocks: (mix >> 7) % 64,
            }
        })
        .collect();
    FleetView::from_workers(&workers)
}

fn bench_request() -> RequestView {
    RequestView {
        prompt_tokens: 2048,
        prompt_blocks: 128,
        block_size: 16,
        max_tokens: 256,
        session_hash: 0xfeed,
        tenant_id: 1,
        priority: 0,
        hop: Hop::Aggregated,
    }
}

/// Runs the benchmark, printing JSON lines through `emit`; returns the summary.
pub fn run_plugin_bench(
    options: &PluginBenchOptions,
    mut emit: impl FnMut(&Value),
) -> Result<Value, PluginBenchError> {
    let path = options.plugins_dir.join("kv_aware.wasm");
    let bytes = std::fs::read(&path).map_err(|source| PluginBenchError::Read {
        path: path.display().to_string(),
        source,
    })?;
    let runtime = Arc::new(
        Runtime::new(HostConfig::default())
            .map_err(|e| PluginBenchError::Runtime(format!("{e:#}")))?,
    );
    let slot = Arc::new(Slot::<Router>::new(runtime));
    let mut summary = serde_json::Map::new();

    // Load, validate and swap, `swaps` times; the first call after each swap.
    let mut validate_ms = Vec::new();
    let mut swap_ms = Vec::new();
    let mut first_call_us = Vec::new();
    let router = WasmRouter::new(slot.clone());
    let (request, small) = (bench_request(), bench_fleet(64));
    for _ in 0..options.swaps.max(1) {
        let (identity, timings) = slot.load("kv-aware", &bytes, "")?;
        let started = Instant::now();
        let (_, answered_by) = router.route_traced(&request, &small);
        let first = started.elapsed();
        assert_eq!(
            answered_by,
            Some(identity.version),
            "the new version answered"
        );
        validate_ms.push(timings.validate.as_secs_f64() * 1e3);
        swap_ms.push(timings.swap.as_secs_f64() * 1e3);
        first_call_us.push(first.as_secs_f64() * 1e6);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let swap_line = json!({
        "bench": "plugin_swap",
        "plugin": "kv-aware",
        "component_bytes": bytes.len(),
        "swaps": validate_ms.len(),
        "validate_ms_median": median(&mut validate_ms),
        "swap_ms_median": median(&mut swap_ms),
        "first_call_us_median": median(&mut first_call_us),
    });
    emit(&swap_line);
    summary.insert(
        "swap_validate_ms".into(),
        swap_line["validate_ms_median"].clone(),
    );
    summary.insert("swap_ms".into(), swap_line["swap_ms_median"].clone());
    summary.insert(
        "first_call_us".into(),
        swap_line["first_call_us_median"].clone(),
    );

    // Routing decisions: Wasm against native, per fleet size.
    let native = KvAwareRouter::default();
    for &n in &options.workers {
        let fleet = bench_fleet(n);
        assert_eq!(
            router.route(&request, &fleet),
            native.route(&request, &fleet),
            "Wasm and native agree at {n} workers"
        );
        let calls = (options.calls * 64 / n.max(1) as u64).clamp(1_000, options.calls * 8);
        for _ in 0..calls / 10 {
            std::hint::black_box(router.route(&request, &fleet));
        }
        let wasm_ns = median_ns_per_call(options.rounds, calls, || {
            std::hint::black_box(router.route(std::hint::black_box(&request), &fleet));
        });
        let native_ns = median_ns_per_call(options.rounds, calls, || {
            std::hint::black_box(native.route(std::hint::black_box(&request), &fleet));
        });
        emit(&json!({
            "bench": "kv_aware_route",
            "workers": n,
            "calls_per_round": calls,
            "rounds": options.rounds,
            "wasm_ns": wasm_ns,
            "native_ns": native_ns,
        }));
        summary.insert(format!("wasm_ns_{n}"), json!(wasm_ns));
        summary.insert(format!("native_ns_{n}"), json!(native_ns));
    }
    let stats = slot.status();
    summary.insert(
        "fallbacks".into(),
        json!(stats.errors.iter().map(|e| e.1).sum::<u64>()),
    );
    summary.insert("summary".into(), json!(true));
    Ok(Value::Object(summary))
}
