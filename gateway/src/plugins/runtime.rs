//! The one wasmtime `Engine` of the gateway (fuel bounds each call's work),
//! and the base `Linker` that gives every plugin the `sluice:policy/host`
//! imports, each of which charges the call's fuel for the host's work.

use std::sync::atomic::Ordering;
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
    /// Fuel one call may burn: wasmtime's count, about one unit a Wasm
    /// instruction, plus HOST_CALL_FUEL and a unit a byte of every string
    /// for each host import it calls. A tight loop runs out in under a
    /// millisecond; a real policy's call takes thousands. Work, not time: a
    /// call the OS preempts is not charged for waiting, and no thread wakes
    /// up to watch it. (An epoch deadline on thread CPU time needed a ticker
    /// thread waking 100 times a second, ~30 us of CPU each on this VM,
    /// ~13 us a request at 200 a second; BENCHMARKS.md.)
    pub call_fuel: u64,
    /// Fuel `init` and the load-time smoke call may burn.
    pub init_fuel: u64,
    /// Linear memory one plugin instance may grow to, in bytes.
    pub max_memory_bytes: usize,
    /// Address space reserved for each instance's linear memory (at least
    /// `max_memory_bytes`); None: wasmtime's default, 4 GiB and guards, so
    /// that compiled code needs no bounds checks (`Config::plugin_memory_reservation`).
    pub memory_reservation: Option<u64>,
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
            call_fuel: 10_000_000,
            init_fuel: 1_000_000_000,
            max_memory_bytes: 32 << 20,
            memory_reservation: None,
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

/// The engine and the linker, shared by every plugin slot.
pub struct Runtime {
    pub(super) engine: Engine,
    pub(super) linker: Linker<HostState>,
    pub(super) config: HostConfig,
    /// Origin of the guests' monotonic clock.
    pub(super) started: Instant,
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
        wasm.consume_fuel(true)
            .cranelift_opt_level(OptLevel::Speed)
            .max_wasm_stack(512 << 10)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pooling));
        if let Some(bytes) = config.memory_reservation {
            // Bounds checked, then: no guard region needed past it (the
            // default's guard lets offsets skip their checks).
            wasm.memory_reservation(bytes.max(config.max_memory_bytes as u64))
                .memory_guard_size(0)
                .memory_reservation_for_growth(0);
        }
        let engine = Engine::new(&wasm)?;
        let mut linker = Linker::new(&engine);
        link_host_imports(&mut linker)?;
        Ok(Runtime {
            engine,
            linker,
            config,
            started: Instant::now(),
        })
    }
}

/// Fuel a host import costs the call besides a unit a byte of its strings:
/// about what the host spends on one (a few hundred ns) in Wasm
/// instructions, so that a loop over imports runs out as a loop over
/// instructions does.
pub const HOST_CALL_FUEL: u64 = 2_000;

/// Takes `HOST_CALL_FUEL + bytes` from the call's fuel, or stops the call
/// (out of fuel, as the Wasm itself would be).
fn charge(cx: &mut StoreContextMut<'_, HostState>, bytes: usize) -> wasmtime::Result<()> {
    let cost = HOST_CALL_FUEL.saturating_add(bytes as u64);
    let left = cx.get_fuel()?;
    if left < cost {
        cx.set_fuel(0)?;
        return Err(wasmtime::Trap::OutOfFuel.into());
    }
    cx.set_fuel(left - cost)
}

/// `charge` for a host import with string `s` (checked as UTF-8 first).
fn charge_str(cx: &mut StoreContextMut<'_, HostState>, s: &WasmStr) -> wasmtime::Result<()> {
    let len = s.to_str(&*cx)?.len();
    charge(cx, len)
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
        |mut cx: StoreContextMut<'_, HostState>, (level, message): (Level, WasmStr)| {
            charge_str(&mut cx, &message)?;
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
        |mut cx: StoreContextMut<'_, HostState>, (name, delta): (WasmStr, u64)| {
            charge_str(&mut cx, &name)?;
            let metrics = &cx.data().slot.metrics;
            metrics.counter_add(&name.to_str(&cx)?, delta);
            Ok(())
        },
    )?;
    host.func_wrap(
        "histogram-record",
        |mut cx: StoreContextMut<'_, HostState>, (name, value): (WasmStr, f64)| {
            charge_str(&mut cx, &name)?;
            let metrics = &cx.data().slot.metrics;
            metrics.histogram_record(&name.to_str(&cx)?, value);
            Ok(())
        },
    )?;
    host.func_wrap(
        "now-ns",
        |mut cx: StoreContextMut<'_, HostState>, (): ()| {
            charge(&mut cx, 0)?;
            Ok((cx.data().started.elapsed().as_nanos() as u64,))
        },
    )?;
    host.func_wrap(
        "shared-get",
        |mut cx: StoreContextMut<'_, HostState>, (key,): (u64,)| {
            charge(&mut cx, 0)?;
            Ok((cx.data().shared().get(key),))
        },
    )?;
    host.func_wrap(
        "shared-set",
        |mut cx: StoreContextMut<'_, HostState>, (key, value, ttl_ms): (u64, u64, u32)| {
            charge(&mut cx, 0)?;
            Ok((cx.data().shared().set(key, value, ttl_ms),))
        },
    )?;
    host.func_wrap(
        "shared-compare-and-swap",
        |mut cx: StoreContextMut<'_, HostState>,
         (key, expected, new, ttl_ms): (u64, Option<u64>, u64, u32)| {
            charge(&mut cx, 0)?;
            Ok((cx
                .data()
                .shared()
                .compare_and_swap(key, expected, new, ttl_ms),))
        },
    )?;
    host.func_wrap(
        "shared-remove",
        |mut cx: StoreContextMut<'_, HostState>, (key,): (u64,)| {
            charge(&mut cx, 0)?;
            cx.data().shared().remove(key);
            Ok(())
        },
    )?;
    Ok(())
}
