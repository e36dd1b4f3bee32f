//! One loaded version of a plugin: its compiled component, pre-instantiated, with
//! a pool of ready instances (one `Store` each). A call takes an instance from the
//! pool, gives it its fuel, runs, and puts it back; an instance whose call
//! trapped, ran out of fuel or answered something invalid is dropped instead. A
//! version that keeps failing is benched for a while (a circuit breaker), so a
//! broken plugin cannot make every request pay for a fresh instance.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use wasmtime::Store;
use wasmtime::component::{ComponentExportIndex, Func, InstancePre};

use super::host_state::{DeniedImport, HostState, PluginIdentity, SlotShared};
use super::kind::PluginKind;
use super::runtime::Runtime;
use super::stats::{ErrorClass, SlotStats};

/// Why one plugin call was not answered by the plugin.
#[derive(Debug)]
pub enum CallFailure {
    /// Wasmtime reported an error: a trap, the deadline, a malformed answer
    /// that could not be lifted, a denied import.
    Wasm(wasmtime::Error),
    /// The plugin answered, but the host refuses the answer.
    Invalid(String),
}

impl From<wasmtime::Error> for CallFailure {
    fn from(e: wasmtime::Error) -> Self {
        CallFailure::Wasm(e)
    }
}

/// A ready instance of a plugin of kind `K`: its store and the type-checked
/// exports of its interface. Only this module and `kind` touch the fields, so a
/// `Func` is only ever called with the types `K::type_check` checked.
pub struct Pooled<K> {
    pub(super) store: Store<HostState>,
    /// The interface's functions, in `K::FUNCTIONS` order.
    pub(super) funcs: Vec<Func>,
    _kind: std::marker::PhantomData<fn() -> K>,
}

impl<K> Pooled<K> {
    /// Prepares the instance for one call: `fuel` to burn and a clear
    /// memory-limit flag.
    pub(super) fn arm(&mut self, fuel: u64) -> wasmtime::Result<()> {
        self.store.data_mut().limiter.hit = false;
        self.store.set_fuel(fuel)
    }
}

impl<K> std::fmt::Debug for Pooled<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pooled")
            .field("plugin", &self.store.data().identity)
            .finish()
    }
}

/// One version of one plugin in one slot.
pub struct Generation<K: PluginKind> {
    pub identity: Arc<PluginIdentity>,
    pub config: String,
    pub(super) runtime: Arc<Runtime>,
    pub(super) slot: Arc<SlotShared>,
    instance_pre: InstancePre<HostState>,
    /// Export indexes of the interface's functions, in `K::FUNCTIONS` order.
    exports: Vec<ComponentExportIndex>,
    idle: Mutex<Vec<Pooled<K>>>,
    /// Set (under the `idle` lock) when the version leaves the slot: instances
    /// are no longer pooled.
    retired: AtomicBool,
    /// This version's own calls, fallbacks and call times (the slot's
    /// stats sum every version).
    pub stats: SlotStats,
    /// Failed calls in a row (reset by a success).
    failures_in_a_row: AtomicU32,
    /// Until when (ns since the runtime started) calls go straight to the
    /// built-in policy.
    benched_until_ns: AtomicU64,
}

impl<K: PluginKind> std::fmt::Debug for Generation<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generation")
            .field("identity", &self.identity)
            .field("config", &self.config)
            .finish()
    }
}

impl<K: PluginKind> Generation<K> {
    pub(super) fn new(
        identity: PluginIdentity,
        config: String,
        runtime: Arc<Runtime>,
        slot: Arc<SlotShared>,
        instance_pre: InstancePre<HostState>,
        exports: Vec<ComponentExportIndex>,
    ) -> Self {
        Self {
            identity: Arc::new(identity),
            config,
            runtime,
            slot,
            instance_pre,
            exports,
            idle: Mutex::new(Vec::new()),
            retired: AtomicBool::new(false),
            stats: SlotStats::default(),
            failures_in_a_row: AtomicU32::new(0),
            benched_until_ns: AtomicU64::new(0),
        }
    }

    /// Makes a new instance and runs the plugin's `init` with this version's config.
    pub(super) fn instantiate(&self) -> Result<Pooled<K>, CallFailure> {
        let rt = &self.runtime;
        let state = HostState::new(
            self.identity.clone(),
            self.slot.clone(),
            rt.config.max_memory_bytes,
            rt.started,
        );
        let mut store = Store::new(&rt.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.set_fuel(rt.config.init_fuel)?;
        let instance = self.instance_pre.instantiate(&mut store)?;
        let mut funcs = Vec::with_capacity(self.exports.len());
        for (name, index) in K::FUNCTIONS.iter().zip(&self.exports) {
            let func = instance
                .get_func(&mut store, index)
                .ok_or_else(|| wasmtime::format_err!("export `{name}` vanished"))?;
            funcs.push(func);
        }
        K::type_check(&store, &funcs)?;
        let mut pooled = Pooled {
            store,
            funcs,
            _kind: std::marker::PhantomData,
        };
        K::init(&mut pooled, &self.config)?.map_err(|e| {
            CallFailure::Invalid(format!("init refused its config {:?}: {e}", self.config))
        })?;
        Ok(pooled)
    }

    /// Gives the version its slot-local number (before any instance for calls exists).
    pub(super) fn set_version(&mut self, version: u64) {
        let mut identity = (*self.identity).clone();
        identity.version = version;
        self.identity = Arc::new(identity);
    }

    /// Puts a fresh instance in the pool, so the first call finds one ready.
    pub(super) fn prewarm(&self) -> Result<(), CallFailure> {
        let pooled = self.instantiate()?;
        self.idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(pooled);
        Ok(())
    }

    /// Stops pooling instances (the slot moved on); in-flight calls finish and
    /// drop theirs.
    pub(super) fn retire(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        self.retired.store(true, Ordering::Relaxed);
        idle.clear();
    }

    /// Pools instances again (the version is active again).
    pub(super) fn reinstate(&self) {
        let _idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        self.retired.store(false, Ordering::Relaxed);
    }

    /// Number of instances waiting in the pool.
    pub fn idle_instances(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Runs `call` on a pooled instance with the call's fuel. On failure the
    /// instance is dropped, the failure is counted and logged, and its class is
    /// returned so that the caller answers with the built-in policy.
    pub(super) fn call<R>(
        &self,
        call: impl FnOnce(&mut Pooled<K>) -> Result<R, CallFailure>,
    ) -> Result<R, ErrorClass> {
        let stats = &self.slot.stats;
        // One clock read serves the breaker check and the call's timing.
        let started = Instant::now();
        let now_ns = started.duration_since(self.runtime.started).as_nanos() as u64;
        if now_ns < self.benched_until_ns.load(Ordering::Relaxed) {
            stats.count_fallback(ErrorClass::Benched);
            self.stats.count_fallback(ErrorClass::Benched);
            return Err(ErrorClass::Benched);
        }
        stats.calls.fetch_add(1, Ordering::Relaxed);
        self.stats.calls.fetch_add(1, Ordering::Relaxed);
        let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut pooled = match pooled {
            Some(p) => p,
            None => match self.instantiate() {
                Ok(p) => p,
                Err(failure) => {
                    return Err(self.fail(failure, Some(ErrorClass::Instantiate), false));
                }
            },
        };
        let result = match pooled.arm(self.runtime.config.call_fuel) {
            Ok(()) => call(&mut pooled),
            Err(e) => Err(CallFailure::Wasm(e)),
        };
        let elapsed_ns = started.elapsed().as_nanos() as f64;
        stats.call_ns.record(elapsed_ns);
        self.stats.call_ns.record(elapsed_ns);
        match result {
            Ok(answer) => {
                self.failures_in_a_row.store(0, Ordering::Relaxed);
                let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                if !self.retired.load(Ordering::Relaxed)
                    && idle.len() < self.runtime.config.max_idle_instances
                {
                    idle.push(pooled);
                }
                Ok(answer)
            }
            Err(failure) => {
                let memory_hit = pooled.store.data().limiter.hit;
                drop(pooled);
                Err(self.fail(failure, None, memory_hit))
            }
        }
    }

    /// Classifies, counts and logs a failed call (its instance already dropped),
    /// and benches the version after repeated failures.
    fn fail(
        &self,
        failure: CallFailure,
        class: Option<ErrorClass>,
        memory_hit: bool,
    ) -> ErrorClass {
        let (found, reason) = match &failure {
            CallFailure::Invalid(why) => (ErrorClass::Invalid, why.clone()),
            CallFailure::Wasm(e) => {
                let class = match e.downcast_ref::<wasmtime::Trap>() {
                    Some(wasmtime::Trap::OutOfFuel) => ErrorClass::Timeout,
                    // A refused memory grow, then whatever failure followed.
                    _ if memory_hit => ErrorClass::Memory,
                    Some(_) => ErrorClass::Trap,
                    // A denied WASI import is the guest's own call, stopped.
                    None if e.downcast_ref::<DeniedImport>().is_some() => ErrorClass::Trap,
                    // Anything else failed while lifting the answer: a bad
                    // string, an out-of-bounds list, an unknown variant case.
                    None => ErrorClass::Invalid,
                };
                (class, format!("{e:#}"))
            }
        };
        let class = class.unwrap_or(found);
        self.slot.stats.count_fallback(class);
        self.stats.count_fallback(class);
        let in_a_row = self.failures_in_a_row.fetch_add(1, Ordering::Relaxed) + 1;
        let config = &self.runtime.config;
        let mut benched = Duration::ZERO;
        if in_a_row >= config.breaker_threshold {
            benched = config
                .breaker_first_bench
                .saturating_mul(1 << (in_a_row - config.breaker_threshold).min(16))
                .min(config.breaker_max_bench);
            let until = self.runtime.started.elapsed() + benched;
            self.benched_until_ns
                .store(until.as_nanos() as u64, Ordering::Relaxed);
        }
        if self.slot.allow_host_log_line() {
            tracing::warn!(
                plugin = %self.identity.name,
                version = self.identity.version,
                class = %class,
                in_a_row,
                benched_ms = benched.as_millis() as u64,
                reason = %super::stats::truncate(&reason, 512),
                "plugin call failed; answered by the built-in policy"
            );
        }
        class
    }
}
