//! A native test harness: run a policy as the host would, without Wasm, and check
//! each answer against the host's rules. On a native target the host imports
//! (log, metrics, clock, shared entries) land here: a test can read what was
//! logged and counted, and set the clock.
//!
//! ```ignore
//! let mut router = RouterHarness::<MyPolicy>::new("temperature=0").unwrap();
//! let fleet: FleetView = [Worker::idle(1), Worker::idle(2)].into_iter().collect();
//! assert_eq!(router.route(&request(64), &fleet), RouteDecision::Worker(0));
//! ```

use crate::{
    Admission, AdmitDecision, CacheHints, CachePolicy, Completion, EvictionCandidates,
    FleetSaturation, FleetView, Hop, Rejection, RequestView, RouteDecision, Router, WorkerState,
};

/// The longest rejection message the host accepts, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// A request of `prompt_tokens` tokens in blocks of 16, for 256 new tokens,
/// aggregated hop, no session, tenant 0, priority 0.
pub fn request(prompt_tokens: u32) -> RequestView {
    RequestView {
        prompt_tokens,
        prompt_blocks: prompt_tokens / 16,
        block_size: 16,
        max_tokens: 256,
        session_hash: 0,
        tenant_id: 0,
        priority: 0,
        hop: Hop::Aggregated,
    }
}

/// A fleet that is neither idle nor saturated: 4 healthy workers, half full.
pub fn saturation() -> FleetSaturation {
    FleetSaturation {
        healthy_workers: 4,
        active_requests: 16,
        queued_requests: 0,
        queued_prefill_tokens: 0,
        kv_blocks_used: 2000,
        kv_blocks_total: 4000,
    }
}

/// Checks a rejection as the host does.
pub fn check_rejection(r: &Rejection) -> Result<(), String> {
    if !(400..=599).contains(&r.status) {
        return Err(format!("rejection status {} is not 400..=599", r.status));
    }
    if r.message.len() > MAX_MESSAGE_BYTES {
        return Err(format!(
            "rejection message is {} bytes, over {MAX_MESSAGE_BYTES}",
            r.message.len()
        ));
    }
    Ok(())
}

/// Checks a routing answer as the host does: the index must name a healthy worker
/// that can serve the hop.
pub fn check_route(
    decision: &RouteDecision,
    request: &RequestView,
    fleet: &FleetView,
) -> Result<(), String> {
    match decision {
        RouteDecision::Worker(i) => match fleet.state().get(*i as usize) {
            None => Err(format!(
                "worker index {i} is out of range (fleet of {})",
                fleet.len()
            )),
            Some(&s) if !WorkerState(s as u8).serves(request.hop) => Err(format!(
                "worker {i} cannot serve the {:?} hop (state {s:#05b})",
                request.hop
            )),
            Some(_) => Ok(()),
        },
        RouteDecision::UseDefault => Ok(()),
        RouteDecision::Reject(r) => check_rejection(r),
    }
}

/// Runs a [`Router`] as the host would; panics on an answer the host would refuse.
#[derive(Debug)]
pub struct RouterHarness<T> {
    pub policy: T,
}

impl<T: Router> RouterHarness<T> {
    /// Creates and configures the policy, as the host's `init` call does.
    pub fn new(config: &str) -> Result<Self, String> {
        let mut policy = T::default();
        policy.configure(config)?;
        Ok(Self { policy })
    }

    pub fn route(&mut self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        let decision = self.policy.route(request, fleet);
        if let Err(why) = check_route(&decision, request, fleet) {
            panic!("the host would refuse this answer ({decision:?}): {why}");
        }
        decision
    }
}

/// Runs an [`Admission`] policy as the host would.
#[derive(Debug)]
pub struct AdmissionHarness<T> {
    pub policy: T,
}

impl<T: Admission> AdmissionHarness<T> {
    pub fn new(config: &str) -> Result<Self, String> {
        let mut policy = T::default();
        policy.configure(config)?;
        Ok(Self { policy })
    }

    pub fn admit(&mut self, request: &RequestView, saturation: &FleetSaturation) -> AdmitDecision {
        let decision = self.policy.admit(request, saturation);
        if let AdmitDecision::Reject(r) = &decision
            && let Err(why) = check_rejection(r)
        {
            panic!("the host would refuse this answer: {why}");
        }
        decision
    }

    pub fn on_complete(&mut self, done: &Completion) {
        self.policy.on_complete(done)
    }
}

/// Runs a [`CachePolicy`] as the host would.
#[derive(Debug)]
pub struct CachePolicyHarness<T> {
    pub policy: T,
}

impl<T: CachePolicy> CachePolicyHarness<T> {
    pub fn new(config: &str) -> Result<Self, String> {
        let mut policy = T::default();
        policy.configure(config)?;
        Ok(Self { policy })
    }

    pub fn hints(&mut self, request: &RequestView) -> CacheHints {
        self.policy.hints(request)
    }

    pub fn score_eviction(&mut self, candidates: &EvictionCandidates) -> Vec<f32> {
        let scores = self.policy.score_eviction(candidates);
        assert_eq!(
            scores.len(),
            candidates.age_ms.len(),
            "the host would refuse this answer: one score per candidate"
        );
        assert!(
            !scores.iter().any(|s| s.is_nan()),
            "the host would refuse this answer: a score is NaN ({scores:?})"
        );
        scores
    }
}

/// The clock and recorders behind the host imports on a native target.
pub mod native_host {
    use std::cell::RefCell;
    use std::collections::BTreeMap;

    use crate::Level;

    #[derive(Default)]
    struct Recorder {
        now_ns: u64,
        logs: Vec<(Level, String)>,
        counters: BTreeMap<String, u64>,
        histograms: BTreeMap<String, Vec<f64>>,
        /// Shared entries: key -> (value, expiry in test-clock ns; MAX = never).
        shared: BTreeMap<u64, (u64, u64)>,
    }

    impl Recorder {
        fn live(&self, key: u64) -> Option<u64> {
            self.shared
                .get(&key)
                .filter(|&&(_, expires)| expires > self.now_ns)
                .map(|&(value, _)| value)
        }

        fn store(&mut self, key: u64, value: u64, ttl_ms: u32) {
            let expires = match ttl_ms {
                0 => u64::MAX,
                ms => self.now_ns.saturating_add(u64::from(ms) * 1_000_000),
            };
            self.shared.insert(key, (value, expires));
        }
    }

    std::thread_local! {
        static RECORDER: RefCell<Recorder> = RefCell::new(Recorder::default());
    }

    pub fn log(level: Level, message: &str) {
        RECORDER.with(|r| r.borrow_mut().logs.push((level, message.to_string())))
    }

    /// Saturates, as the host does.
    pub fn counter_add(name: &str, delta: u64) {
        RECORDER.with(|r| {
            let mut r = r.borrow_mut();
            let c = r.counters.entry(name.to_string()).or_default();
            *c = c.saturating_add(delta);
        })
    }

    pub fn histogram_record(name: &str, value: f64) {
        RECORDER.with(|r| {
            r.borrow_mut()
                .histograms
                .entry(name.to_string())
                .or_default()
                .push(value)
        })
    }

    pub fn shared_get(key: u64) -> Option<u64> {
        RECORDER.with(|r| r.borrow().live(key))
    }

    /// Never full: the native store has no bound.
    pub fn shared_set(key: u64, value: u64, ttl_ms: u32) -> bool {
        RECORDER.with(|r| r.borrow_mut().store(key, value, ttl_ms));
        true
    }

    pub fn shared_compare_and_swap(key: u64, expected: Option<u64>, new: u64, ttl_ms: u32) -> bool {
        RECORDER.with(|r| {
            let mut r = r.borrow_mut();
            let swap = r.live(key) == expected;
            if swap {
                r.store(key, new, ttl_ms);
            }
            swap
        })
    }

    pub fn shared_remove(key: u64) {
        RECORDER.with(|r| {
            r.borrow_mut().shared.remove(&key);
        })
    }

    /// Forgets this thread's shared entries (a fresh slot).
    pub fn clear_shared() {
        RECORDER.with(|r| r.borrow_mut().shared.clear())
    }

    /// The test clock: starts at 0 and moves only by [`set_now_ns`] / [`advance_ms`].
    pub fn now_ns() -> u64 {
        RECORDER.with(|r| r.borrow().now_ns)
    }

    pub fn set_now_ns(ns: u64) {
        RECORDER.with(|r| r.borrow_mut().now_ns = ns)
    }

    pub fn advance_ms(ms: u64) {
        RECORDER.with(|r| r.borrow_mut().now_ns += ms * 1_000_000)
    }

    /// The value of counter `name` on this thread (0 if never added to).
    pub fn counter(name: &str) -> u64 {
        RECORDER.with(|r| r.borrow().counters.get(name).copied().unwrap_or(0))
    }

    /// Values recorded into histogram `name` on this thread.
    pub fn histogram(name: &str) -> Vec<f64> {
        RECORDER.with(|r| r.borrow().histograms.get(name).cloned().unwrap_or_default())
    }

    /// Lines logged on this thread.
    pub fn logs() -> Vec<(Level, String)> {
        RECORDER.with(|r| r.borrow().logs.clone())
    }
}

pub use native_host::{advance_ms, clear_shared, counter, histogram, logs, set_now_ns};
