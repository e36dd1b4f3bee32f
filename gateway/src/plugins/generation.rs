//! One loaded version of a plugin: its compiled component, pre-instantiated, with
//! a pool of ready instances (one `Store` each). A call takes an instance from the
//! pool, sets its epoch deadline, runs, and puts it back; an instance whose call
//! trapped, timed out or answered something invalid is dropped instead.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use wasmtime::component::{ComponentExportIndex, Func, InstancePre};
use wasmtime::{Store, UpdateDeadline};

use super::host_state::{HostState, PluginIdentity, SlotShared};
use super::kind::PluginKind;
use super::runtime::Runtime;
use super::stats::ErrorClass;

/// Why one plugin call was not answered by the plugin.
#[derive(Debug)]
pub enum CallFailure {
    /// Wasmtime reported an error: a trap, the epoch deadline, a failed import.
    Wasm(wasmtime::Error),
    /// The plugin answered, but the host refuses the answer.
    Invalid(String),
}

impl From<wasmtime::Error> for CallFailure {
    fn from(e: wasmtime::Error) -> Self {
        CallFailure::Wasm(e)
    }
}

/// A ready instance: its store and the type-checked exports of its interface.
pub struct Pooled {
    pub store: Store<HostState>,
    /// The interface's functions, in `PluginKind::FUNCTIONS` order.
    pub funcs: Vec<Func>,
}

impl Pooled {
    /// Prepares the instance for one call: a fresh CPU deadline, from the next
    /// epoch tick on, and a clear memory-limit flag.
    pub fn arm(&mut self, cpu_budget: std::time::Duration) {
        let data = self.store.data_mut();
        data.limiter.hit = false;
        data.deadline.reset(cpu_budget);
        self.store.set_epoch_deadline(1);
    }
}

impl std::fmt::Debug for Pooled {
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
    idle: Mutex<Vec<Pooled>>,
    /// Set when the version leaves the slot: instances are no longer pooled.
    retired: AtomicBool,
    _kind: std::marker::PhantomData<fn() -> K>,
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
            _kind: std::marker::PhantomData,
        }
    }

    /// Makes a new instance and runs the plugin's `init` with this version's config.
    pub(super) fn instantiate(&self) -> Result<Pooled, CallFailure> {
        let rt = &self.runtime;
        let state = HostState::new(
            self.identity.clone(),
            self.slot.clone(),
            rt.config.max_memory_bytes,
            (rt.config.max_call_wall.as_nanos() / rt.config.epoch_tick.as_nanos().max(1)) as u64,
            rt.started,
        );
        let mut store = Store::new(&rt.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_callback(|mut cx| {
            Ok(if cx.data_mut().deadline.tick() {
                UpdateDeadline::Continue(1)
            } else {
                UpdateDeadline::Interrupt
            })
        });
        store.data_mut().deadline.reset(rt.config.init_cpu_budget);
        store.set_epoch_deadline(1);
        let instance = self.instance_pre.instantiate(&mut store)?;
        let mut funcs = Vec::with_capacity(self.exports.len());
        for (name, index) in K::FUNCTIONS.iter().zip(&self.exports) {
            let func = instance
                .get_func(&mut store, index)
                .ok_or_else(|| wasmtime::format_err!("export `{name}` vanished"))?;
            funcs.push(func);
        }
        K::type_check(&store, &funcs)?;
        let mut pooled = Pooled { store, funcs };
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

    /// Stops pooling instances (the slot moved on); in-flight calls finish.
    pub(super) fn retire(&self) {
        self.retired.store(true, Ordering::Relaxed);
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Pools instances again (the version came back by rollback).
    pub(super) fn reinstate(&self) {
        self.retired.store(false, Ordering::Relaxed);
    }

    /// Number of instances waiting in the pool.
    pub fn idle_instances(&self) -> usize {
        self.idle.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Runs `call` on a pooled instance under the call deadline. On failure the
    /// instance is dropped, the failure is counted and logged, and its class is
    /// returned so that the caller answers with the built-in policy.
    pub fn call<R>(
        &self,
        call: impl FnOnce(&mut Pooled) -> Result<R, CallFailure>,
    ) -> Result<R, ErrorClass> {
        let stats = &self.slot.stats;
        stats.calls.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let pooled = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        let mut pooled = match pooled {
            Some(p) => p,
            None => match self.instantiate() {
                Ok(p) => p,
                Err(failure) => return Err(self.fail(None, failure, ErrorClass::Instantiate)),
            },
        };
        pooled.arm(self.runtime.config.call_cpu_budget);
        let result = call(&mut pooled);
        stats.call_ns.record(started.elapsed().as_nanos() as f64);
        match result {
            Ok(answer) => {
                if !self.retired.load(Ordering::Relaxed) {
                    let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
                    if idle.len() < self.runtime.config.max_idle_instances {
                        idle.push(pooled);
                    }
                }
                Ok(answer)
            }
            Err(failure) => Err(self.fail(Some(pooled), failure, ErrorClass::Trap)),
        }
    }

    /// Classifies, counts and logs a failed call; the instance is dropped.
    fn fail(
        &self,
        pooled: Option<Pooled>,
        failure: CallFailure,
        default: ErrorClass,
    ) -> ErrorClass {
        let memory_hit = pooled.as_ref().is_some_and(|p| p.store.data().limiter.hit);
        let (class, reason) = match &failure {
            CallFailure::Invalid(why) => (ErrorClass::Invalid, why.clone()),
            CallFailure::Wasm(e) => {
                let class = match e.downcast_ref::<wasmtime::Trap>() {
                    Some(wasmtime::Trap::Interrupt) => ErrorClass::Timeout,
                    _ if memory_hit => ErrorClass::Memory,
                    _ => default,
                };
                (class, format!("{e:#}"))
            }
        };
        self.slot.stats.count_fallback(class);
        if self.slot.allow_log_line() {
            tracing::warn!(
                plugin = %self.identity.name,
                version = self.identity.version,
                class = %class,
                reason = %super::stats::truncate(&reason, 512),
                "plugin call failed; answered by the built-in policy"
            );
        }
        class
    }
}
