//! The one wasmtime `Engine` of the gateway, its epoch ticker, and the base
//! `Linker` that gives every plugin the `sluice:policy/host` imports.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use wasmtime::component::{Linker, WasmStr};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, OptLevel, PoolingAllocationConfig, StoreContextMut,
};

use super::abi::Level;
use super::host_state::HostState;
use super::stats::truncate;

/// Limits and sizes of the plugin host.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// How often the epoch advances: how often a running call is checked.
    pub epoch_tick: Duration,
    /// CPU time one call may use, counted from the first epoch tick that finds
    /// it running (so a call gets at most one tick more). CPU time, not wall
    /// time: a call the OS preempts is not charged for waiting.
    pub call_cpu_budget: Duration,
    /// CPU time `init` and the load-time smoke call may use.
    pub init_cpu_budget: Duration,
    /// Wall time after which any call is stopped, CPU used or not.
    pub max_call_wall: Duration,
    /// Linear memory one plugin instance may grow to, in bytes.
    pub max_memory_bytes: usize,
    /// Idle instances kept per plugin version, ready for calls.
    pub max_idle_instances: usize,
    /// Instances (of all plugins and versions) that may exist at once.
    pub max_instances: u32,
    /// Log lines per second per plugin slot (and the burst allowed).
    pub log_lines_per_sec: f64,
    /// Longest log line kept, in bytes; longer ones are cut.
    pub max_log_line_bytes: usize,
    /// Entries a slot's shared store holds at most (`shared-set`).
    pub max_shared_entries: usize,
    /// Failed calls in a row after which a version is benched.
    pub breaker_threshold: u32,
    /// First bench time; it doubles with each further failure, up to the max.
    pub breaker_first_bench: Duration,
    pub breaker_max_bench: Duration,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            epoch_tick: Duration::from_millis(10),
            call_cpu_budget: Duration::from_millis(1),
            init_cpu_budget: Duration::from_millis(100),
            max_call_wall: Duration::from_secs(1),
            max_memory_bytes: 32 << 20,
            max_idle_instances: 64,
            max_instances: 128,
            log_lines_per_sec: 20.0,
            max_log_line_bytes: 512,
            max_shared_entries: 1 << 18,
            breaker_threshold: 3,
            breaker_first_bench: Duration::from_millis(10),
            breaker_max_bench: Duration::from_secs(1),
        }
    }
}

/// The engine, the linker and the epoch ticker, shared by every plugin slot.
pub struct Runtime {
    pub(super) engine: Engine,
    pub(super) linker: Linker<HostState>,
    pub(super) config: HostConfig,
    /// Origin of the guests' monotonic clock.
    pub(super) started: Instant,
    stop_ticker: Arc<AtomicBool>,
    ticker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Runtime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runtime")
            .field("config", &self.config)
            .finish()
    }
}

/// The interface name (with version) the host implements for every plugin.
pub const HOST_INTERFACE: &str = "sluice:policy/host@0.1.1";

impl Runtime {
    pub fn new(config: HostConfig) -> wasmtime::Result<Runtime> {
        let mut pooling = PoolingAllocationConfig::default();
        pooling
            .total_component_instances(config.max_instances)
            // A Rust component holds its main module plus small shim modules.
            .total_core_instances(config.max_instances * 4)
            .total_memories(config.max_instances)
            .total_tables(config.max_instances * 2)
            .max_memory_size(config.max_memory_bytes);
        let mut wasm = Config::new();
        wasm.epoch_interruption(true)
            .cranelift_opt_level(OptLevel::Speed)
            .max_wasm_stack(512 << 10)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pooling));
        let engine = Engine::new(&wasm)?;
        let mut linker = Linker::new(&engine);
        link_host_imports(&mut linker)?;

        let stop_ticker = Arc::new(AtomicBool::new(false));
        let ticker = {
            let engine = engine.clone();
            let stop = stop_ticker.clone();
            let tick = config.epoch_tick;
            std::thread::Builder::new()
                .name("sluice-plugin-epoch".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(tick);
                        engine.increment_epoch();
                    }
                })?
        };
        Ok(Runtime {
            engine,
            linker,
            config,
            started: Instant::now(),
            stop_ticker,
            ticker: Some(ticker),
        })
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.stop_ticker.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

/// The types-only interface every plugin imports for its records.
pub const TYPES_INTERFACE: &str = "sluice:policy/types@0.1.1";

/// Defines `sluice:policy/host` (log, counter-add, histogram-record, now-ns,
/// and the slot's shared entries) and the types-only `sluice:policy/types`.
fn link_host_imports(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
    linker.instance(TYPES_INTERFACE)?;
    let mut host = linker.instance(HOST_INTERFACE)?;
    host.func_wrap(
        "log",
        |cx: StoreContextMut<'_, HostState>, (level, message): (Level, WasmStr)| {
            let data = cx.data();
            if !data.slot.allow_log_line() {
                data.slot.stats.logs_dropped.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
            let max = data.slot.max_log_line_bytes;
            let id = data.identity.clone();
            let text = message.to_str(&cx)?;
            let line = truncate(&text, max);
            let (name, version) = (&id.name, id.version);
            match level {
                Level::Debug => tracing::debug!(plugin = %name, version, "{line}"),
                Level::Info => tracing::info!(plugin = %name, version, "{line}"),
                Level::Warn => tracing::warn!(plugin = %name, version, "{line}"),
                Level::Error => tracing::error!(plugin = %name, version, "{line}"),
            }
            Ok(())
        },
    )?;
    host.func_wrap(
        "counter-add",
        |cx: StoreContextMut<'_, HostState>, (name, delta): (WasmStr, u64)| {
            let metrics = cx.data().slot.metrics.clone();
            metrics.counter_add(&name.to_str(&cx)?, delta);
            Ok(())
        },
    )?;
    host.func_wrap(
        "histogram-record",
        |cx: StoreContextMut<'_, HostState>, (name, value): (WasmStr, f64)| {
            let metrics = cx.data().slot.metrics.clone();
            metrics.histogram_record(&name.to_str(&cx)?, value);
            Ok(())
        },
    )?;
    host.func_wrap("now-ns", |cx: StoreContextMut<'_, HostState>, (): ()| {
        Ok((cx.data().started.elapsed().as_nanos() as u64,))
    })?;
    host.func_wrap(
        "shared-get",
        |cx: StoreContextMut<'_, HostState>, (key,): (u64,)| Ok((cx.data().shared().get(key),)),
    )?;
    host.func_wrap(
        "shared-set",
        |cx: StoreContextMut<'_, HostState>, (key, value, ttl_ms): (u64, u64, u32)| {
            Ok((cx.data().shared().set(key, value, ttl_ms),))
        },
    )?;
    host.func_wrap(
        "shared-compare-and-swap",
        |cx: StoreContextMut<'_, HostState>,
         (key, expected, new, ttl_ms): (u64, Option<u64>, u64, u32)| {
            Ok((cx
                .data()
                .shared()
                .compare_and_swap(key, expected, new, ttl_ms),))
        },
    )?;
    host.func_wrap(
        "shared-remove",
        |cx: StoreContextMut<'_, HostState>, (key,): (u64,)| {
            cx.data().shared().remove(key);
            Ok(())
        },
    )?;
    Ok(())
}
