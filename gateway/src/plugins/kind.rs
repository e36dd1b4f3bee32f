//! The three plugin kinds (router, admission, cache policy): each names its WIT
//! interface and functions, type-checks an instance's exports once, makes the
//! typed calls, and checks the plugin's answers. `WasmRouter`, `WasmAdmission`
//! and `WasmCachePolicy` put a slot behind the plain traits of `crate::policy`,
//! with the built-in policy answering whenever the plugin cannot.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use wasmtime::Store;
use wasmtime::component::{Func, TypedFunc};

use super::abi;
use super::generation::{CallFailure, Generation, Pooled};
use super::host_state::HostState;
use super::slot::Slot;
use crate::policy::{
    self, AdmissionPolicy, AdmitDecision, CacheHints, CachePolicy, Completion, EvictionCandidates,
    FleetSaturation, FleetView, Hop, RequestView, RouteDecision, RouterPolicy, WorkerLoad,
    WorkerState,
};

mod sealed {
    /// Only the three kinds below are plugin kinds.
    pub trait Sealed {}
    impl Sealed for super::Router {}
    impl Sealed for super::Admission {}
    impl Sealed for super::Cache {}
}

/// A plugin kind: one WIT interface of `sluice:policy`. Sealed: the host knows
/// exactly these three.
pub trait PluginKind: sealed::Sealed + Send + Sync + Sized + 'static {
    /// The WIT interface, which is also the slot's name.
    const INTERFACE: &'static str;
    /// The interface's functions, `init` first.
    const FUNCTIONS: &'static [&'static str];

    /// Checks every function's signature against the Rust types the host calls
    /// it with; `funcs` is in `FUNCTIONS` order.
    fn type_check(store: &Store<HostState>, funcs: &[Func]) -> wasmtime::Result<()>;

    /// A call with made-up inputs whose answer must be valid: part of the checks
    /// a new version passes before it is swapped in.
    fn smoke(pooled: &mut Pooled<Self>) -> Result<(), CallFailure>;

    /// `init(config)`; the outer error is a trap, the inner one the plugin's refusal.
    fn init(pooled: &mut Pooled<Self>, config: &str) -> wasmtime::Result<Result<(), String>> {
        // SAFETY: `type_check_init` checked funcs[0] against exactly these types.
        let init =
            unsafe { TypedFunc::<(&str,), (Result<(), String>,)>::new_unchecked(pooled.funcs[0]) };
        Ok(init.call(&mut pooled.store, (config,))?.0)
    }
}

fn type_check_init(store: &Store<HostState>, funcs: &[Func]) -> wasmtime::Result<()> {
    funcs[0].typed::<(&str,), (Result<(), String>,)>(store)?;
    Ok(())
}

/// Rejections from a plugin must pass `Rejection::problem`.
fn checked(r: abi::Rejection) -> Result<policy::Rejection, CallFailure> {
    let r = policy::Rejection::from(r);
    match r.problem() {
        Some(problem) => Err(CallFailure::Invalid(problem)),
        None => Ok(r),
    }
}

/// A made-up request for load-time checks.
fn smoke_request() -> RequestView {
    RequestView {
        prompt_tokens: 256,
        prompt_blocks: 16,
        block_size: 16,
        max_tokens: 64,
        session_hash: 0x5eed,
        tenant_id: 1,
        priority: 0,
        hop: Hop::Aggregated,
    }
}

// ---------------------------------------------------------------------------
// Router

/// `sluice:policy/router`.
#[derive(Debug)]
pub struct Router;

type RouteFn<'a> = TypedFunc<(abi::RequestView, abi::FleetView<'a>), (abi::RouteDecision,)>;

impl Router {
    /// Calls `route` and checks the answer; `Ok(None)` = use the default.
    fn route(
        pooled: &mut Pooled<Router>,
        request: &RequestView,
        fleet: &FleetView,
    ) -> Result<Option<RouteDecision>, CallFailure> {
        // SAFETY: `type_check` checked funcs[1] against these types when the
        // instance was made; lifetimes do not change the component type.
        let route = unsafe { RouteFn::new_unchecked(pooled.funcs[1]) };
        let (answer,) = route.call(&mut pooled.store, (request.into(), fleet.into()))?;
        match answer {
            abi::RouteDecision::Worker(i) if fleet.serves(i as usize, request.hop) => {
                Ok(Some(RouteDecision::Worker(i as usize)))
            }
            abi::RouteDecision::Worker(i) => {
                Err(CallFailure::Invalid(match fleet.state().get(i as usize) {
                    None => format!(
                        "worker index {i} is out of range (fleet of {})",
                        fleet.len()
                    ),
                    Some(s) => format!(
                        "worker {i} cannot serve the {:?} hop (state {s:#05b})",
                        request.hop
                    ),
                }))
            }
            abi::RouteDecision::UseDefault => Ok(None),
            abi::RouteDecision::Reject(r) => Ok(Some(RouteDecision::Reject(checked(r)?))),
        }
    }
}

impl PluginKind for Router {
    const INTERFACE: &'static str = "router";
    const FUNCTIONS: &'static [&'static str] = &["init", "route"];

    fn type_check(store: &Store<HostState>, funcs: &[Func]) -> wasmtime::Result<()> {
        type_check_init(store, funcs)?;
        funcs[1]
            .typed::<(abi::RequestView, abi::FleetView<'static>), (abi::RouteDecision,)>(store)?;
        Ok(())
    }

    fn smoke(pooled: &mut Pooled<Router>) -> Result<(), CallFailure> {
        let workers: Vec<WorkerLoad> = (0..4u32)
            .map(|i| WorkerLoad {
                state: WorkerState::new(true, true, true),
                id: i + 1,
                active_requests: i % 3,
                queued_prefill_tokens: 0,
                kv_blocks_used: 10 * i,
                kv_blocks_total: 1000,
                overlap_blocks: 4 * i,
            })
            .collect();
        let fleet = FleetView::from_workers(&workers);
        Router::route(pooled, &smoke_request(), &fleet).map(drop)
    }
}

/// A router slot behind [`RouterPolicy`]; KV-aware routing answers when the slot
/// is empty, the plugin defers, or the plugin fails.
#[derive(Debug)]
pub struct WasmRouter {
    slot: Arc<Slot<Router>>,
    fallback: policy::KvAwareRouter,
}

impl WasmRouter {
    pub fn new(slot: Arc<Slot<Router>>) -> Self {
        Self {
            slot,
            fallback: policy::KvAwareRouter::default(),
        }
    }

    pub fn slot(&self) -> &Arc<Slot<Router>> {
        &self.slot
    }

    /// Routes and says who decided: the plugin version, or `None` when the
    /// built-in policy answered (slot empty, plugin deferred, or plugin failed).
    pub fn route_traced(
        &self,
        request: &RequestView,
        fleet: &FleetView,
    ) -> (RouteDecision, Option<u64>) {
        let answer = self.slot.with_current(|generation: &Generation<Router>| {
            let answer = generation.call(|p| Router::route(p, request, fleet));
            (answer, generation.identity.version)
        });
        match answer {
            Some((Ok(Some(decision)), version)) => (decision, Some(version)),
            Some((Ok(None), _)) => {
                self.slot
                    .shared()
                    .stats
                    .deferred
                    .fetch_add(1, Ordering::Relaxed);
                (self.fallback.route(request, fleet), None)
            }
            Some((Err(_), _)) | None => (self.fallback.route(request, fleet), None),
        }
    }
}

impl RouterPolicy for WasmRouter {
    fn route(&self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        self.route_traced(request, fleet).0
    }
}

// ---------------------------------------------------------------------------
// Admission

/// `sluice:policy/admission`.
#[derive(Debug)]
pub struct Admission;

type AdmitFn = TypedFunc<(abi::RequestView, abi::FleetSaturation), (abi::AdmitDecision,)>;
type OnCompleteFn = TypedFunc<(abi::Completion,), ()>;

impl Admission {
    fn admit(
        pooled: &mut Pooled<Admission>,
        request: &RequestView,
        saturation: &FleetSaturation,
    ) -> Result<AdmitDecision, CallFailure> {
        // SAFETY: checked by `type_check` when the instance was made.
        let admit = unsafe { AdmitFn::new_unchecked(pooled.funcs[1]) };
        match admit
            .call(&mut pooled.store, (request.into(), saturation.into()))?
            .0
        {
            abi::AdmitDecision::Reject(r) => Ok(AdmitDecision::Reject(checked(r)?)),
            other => Ok(other.into()),
        }
    }

    fn on_complete(pooled: &mut Pooled<Admission>, done: &Completion) -> Result<(), CallFailure> {
        // SAFETY: checked by `type_check` when the instance was made.
        let on_complete = unsafe { OnCompleteFn::new_unchecked(pooled.funcs[2]) };
        on_complete.call(&mut pooled.store, (done.into(),))?;
        Ok(())
    }
}

impl PluginKind for Admission {
    const INTERFACE: &'static str = "admission";
    const FUNCTIONS: &'static [&'static str] = &["init", "admit", "on-complete"];

    fn type_check(store: &Store<HostState>, funcs: &[Func]) -> wasmtime::Result<()> {
        type_check_init(store, funcs)?;
        funcs[1].typed::<(abi::RequestView, abi::FleetSaturation), (abi::AdmitDecision,)>(store)?;
        funcs[2].typed::<(abi::Completion,), ()>(store)?;
        Ok(())
    }

    fn smoke(pooled: &mut Pooled<Admission>) -> Result<(), CallFailure> {
        let saturation = FleetSaturation {
            healthy_workers: 4,
            active_requests: 8,
            queued_requests: 0,
            queued_prefill_tokens: 1024,
            kv_blocks_used: 100,
            kv_blocks_total: 4000,
        };
        Admission::admit(pooled, &smoke_request(), &saturation)?;
        Admission::on_complete(
            pooled,
            &Completion {
                tenant_id: 1,
                session_hash: 0x5eed,
                priority: 0,
                prompt_tokens: 256,
                cached_tokens: 0,
                output_tokens: 16,
                outcome: policy::Outcome::Success,
                duration_us: 1000,
            },
        )
    }
}

/// An admission slot behind [`AdmissionPolicy`]; admit-all answers when the slot
/// is empty or the plugin fails.
#[derive(Debug)]
pub struct WasmAdmission {
    slot: Arc<Slot<Admission>>,
    fallback: policy::AdmitAll,
}

impl WasmAdmission {
    pub fn new(slot: Arc<Slot<Admission>>) -> Self {
        Self {
            slot,
            fallback: policy::AdmitAll,
        }
    }

    pub fn slot(&self) -> &Arc<Slot<Admission>> {
        &self.slot
    }
}

impl AdmissionPolicy for WasmAdmission {
    fn admit(&self, request: &RequestView, saturation: &FleetSaturation) -> AdmitDecision {
        self.slot
            .with_current(|g| g.call(|p| Admission::admit(p, request, saturation)).ok())
            .flatten()
            .unwrap_or_else(|| self.fallback.admit(request, saturation))
    }

    fn on_complete(&self, done: &Completion) {
        self.slot
            .with_current(|g| g.call(|p| Admission::on_complete(p, done)).ok());
    }
}

// ---------------------------------------------------------------------------
// Cache policy

/// `sluice:policy/cache-policy`.
#[derive(Debug)]
pub struct Cache;

type HintsFn = TypedFunc<(abi::RequestView,), (abi::CacheHints,)>;
type ScoreFn<'a> = TypedFunc<(abi::EvictionCandidates<'a>,), (Vec<f32>,)>;

impl Cache {
    fn hints(pooled: &mut Pooled<Cache>, request: &RequestView) -> Result<CacheHints, CallFailure> {
        // SAFETY: checked by `type_check` when the instance was made.
        let hints = unsafe { HintsFn::new_unchecked(pooled.funcs[1]) };
        Ok(hints.call(&mut pooled.store, (request.into(),))?.0.into())
    }

    fn score_eviction(
        pooled: &mut Pooled<Cache>,
        candidates: &EvictionCandidates,
    ) -> Result<Vec<f32>, CallFailure> {
        // SAFETY: checked by `type_check` when the instance was made; lifetimes
        // do not change the component type.
        let score = unsafe { ScoreFn::new_unchecked(pooled.funcs[2]) };
        let (scores,) = score.call(&mut pooled.store, (candidates.into(),))?;
        if scores.len() != candidates.len() {
            return Err(CallFailure::Invalid(format!(
                "{} scores for {} candidates",
                scores.len(),
                candidates.len()
            )));
        }
        if scores.iter().any(|s| s.is_nan()) {
            return Err(CallFailure::Invalid("a score is NaN".into()));
        }
        Ok(scores)
    }
}

impl PluginKind for Cache {
    const INTERFACE: &'static str = "cache-policy";
    const FUNCTIONS: &'static [&'static str] = &["init", "hints", "score-eviction"];

    fn type_check(store: &Store<HostState>, funcs: &[Func]) -> wasmtime::Result<()> {
        type_check_init(store, funcs)?;
        funcs[1].typed::<(abi::RequestView,), (abi::CacheHints,)>(store)?;
        funcs[2].typed::<(abi::EvictionCandidates<'static>,), (Vec<f32>,)>(store)?;
        Ok(())
    }

    fn smoke(pooled: &mut Pooled<Cache>) -> Result<(), CallFailure> {
        Cache::hints(pooled, &smoke_request())?;
        let candidates = EvictionCandidates {
            age_ms: vec![10, 2000, 50, 0],
            hits: vec![3, 0, 1, 9],
            priority: vec![0, 0, 5, 1],
            tenant_id: vec![1, 2, 1, 3],
        };
        Cache::score_eviction(pooled, &candidates).map(drop)
    }
}

/// A cache-policy slot behind [`CachePolicy`]; LRU answers when the slot is
/// empty or the plugin fails.
#[derive(Debug)]
pub struct WasmCachePolicy {
    slot: Arc<Slot<Cache>>,
    fallback: policy::LruCache,
}

impl WasmCachePolicy {
    pub fn new(slot: Arc<Slot<Cache>>) -> Self {
        Self {
            slot,
            fallback: policy::LruCache,
        }
    }

    pub fn slot(&self) -> &Arc<Slot<Cache>> {
        &self.slot
    }
}

impl CachePolicy for WasmCachePolicy {
    fn hints(&self, request: &RequestView) -> CacheHints {
        self.slot
            .with_current(|g| g.call(|p| Cache::hints(p, request)).ok())
            .flatten()
            .unwrap_or_else(|| self.fallback.hints(request))
    }

    fn score_eviction(&self, candidates: &EvictionCandidates) -> Vec<f32> {
        self.slot
            .with_current(|g| g.call(|p| Cache::score_eviction(p, candidates)).ok())
            .flatten()
            .unwrap_or_else(|| self.fallback.score_eviction(candidates))
    }
}
