//! The traits a plugin implements, one per plugin kind, and the glue that holds the
//! plugin's instance between calls.

use std::cell::RefCell;

use crate::{
    AdmitDecision, CacheHints, Completion, EvictionCandidates, FleetSaturation, FleetView,
    RequestView, RouteDecision,
};

/// Accepts only an empty config: the default of every `configure`.
fn no_config(config: &str) -> Result<(), String> {
    if config.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("this plugin takes no config, got {config:?}"))
    }
}

/// A routing policy (`sluice:policy/router`). Export it with [`crate::export_router!`].
///
/// The host keeps each instance for many calls, so `&mut self` state (counters,
/// session tables) lives as long as the instance. The host may run several
/// instances of one plugin side by side: state is per instance, not global.
pub trait Router: Default + 'static {
    /// Runs once per instance before any other call, with the operator's config
    /// string. An error refuses the plugin at load time. Default: accept only "".
    fn configure(&mut self, config: &str) -> Result<(), String> {
        no_config(config)
    }

    /// Runs for every hop of every request that needs a worker. Answer
    /// `Worker(i)` with `i < fleet.len()` (a healthy worker that can serve the
    /// hop), `UseDefault` to let the host's KV-aware policy pick, or `Reject`.
    /// An index out of range, a trap or running out of fuel (10 million units,
    /// about a Wasm instruction each) makes the host use its default policy
    /// for this request and count the error.
    fn route(&mut self, request: &RequestView, fleet: &FleetView) -> RouteDecision;
}

/// An admission policy (`sluice:policy/admission`). Export it with
/// [`crate::export_admission!`].
pub trait Admission: Default + 'static {
    /// As [`Router::configure`].
    fn configure(&mut self, config: &str) -> Result<(), String> {
        no_config(config)
    }

    /// Runs once for every request that arrives, before routing.
    fn admit(&mut self, request: &RequestView, saturation: &FleetSaturation) -> AdmitDecision;

    /// Runs once for every admitted request when it ends, whatever the outcome.
    /// Default: nothing.
    fn on_complete(&mut self, _done: &Completion) {}
}

/// A KV cache policy (`sluice:policy/cache-policy`). Export it with
/// [`crate::export_cache_policy!`].
pub trait CachePolicy: Default + 'static {
    /// As [`Router::configure`].
    fn configure(&mut self, config: &str) -> Result<(), String> {
        no_config(config)
    }

    /// Runs once per admitted request, before it is sent to a worker.
    /// Default: no salt, priority 0, no TTL, no host tier.
    fn hints(&mut self, _request: &RequestView) -> CacheHints {
        CacheHints {
            salt: 0,
            retention_priority: 0,
            ttl_ms: 0,
            write_host_tier: false,
        }
    }

    /// Runs when a worker must evict: one score per candidate; the highest scores
    /// are evicted first. Default: plain LRU (the score is the age).
    fn score_eviction(&mut self, candidates: &EvictionCandidates) -> Vec<f32> {
        candidates.age_ms.iter().map(|&age| age as f32).collect()
    }
}

/// Creates the instance's policy and configures it with `configure` (the
/// plugin kind's trait method); the export macros call this for WIT `init`.
pub fn init<T: Default>(
    state: &RefCell<Option<T>>,
    config: &str,
    configure: fn(&mut T, &str) -> Result<(), String>,
) -> Result<(), String> {
    // A plugin has no stderr: send panic messages to the host's log instead,
    // so operators see why a call trapped.
    #[cfg(target_family = "wasm")]
    std::panic::set_hook(Box::new(|info| {
        crate::host::log(crate::Level::Error, &format!("plugin panicked: {info}"));
    }));
    let mut policy = T::default();
    configure(&mut policy, config)?;
    *state.borrow_mut() = Some(policy);
    Ok(())
}

/// Runs `f` on the instance's policy (created with an empty config if the host
/// skipped `init`, which the sluice host never does).
pub fn with_policy<T: Default, R>(state: &RefCell<Option<T>>, f: impl FnOnce(&mut T) -> R) -> R {
    let mut state = state.borrow_mut();
    f(state.get_or_insert_with(T::default))
}
