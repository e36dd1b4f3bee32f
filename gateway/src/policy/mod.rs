//! The policy contract as the rest of the gateway sees it: plain Rust views,
//! decisions and traits (`RouterPolicy`, `AdmissionPolicy`, `CachePolicy`), with
//! the built-in policies that answer when no plugin is loaded or a plugin fails.
//! The Wasm host in `crate::plugins` implements these traits; nothing here knows
//! about wasmtime. The types mirror `wit/policy.wit` field for field.

mod builtin;
mod view;

pub use builtin::{AdmitAll, KvAwareRouter, LruCache, tenant_salt};
pub use view::{
    AdmitDecision, CacheHints, Completion, EvictionCandidates, FleetSaturation, FleetView, Hop,
    Outcome, Rejection, RequestView, RouteDecision, WorkerLoad, WorkerState,
};

/// Picks the worker for each hop of each request.
pub trait RouterPolicy: Send + Sync {
    /// `fleet` lists the candidate workers; the answer indexes into it.
    fn route(&self, request: &RequestView, fleet: &FleetView) -> RouteDecision;
}

/// Decides whether a request may enter, and hears how each admitted one ended.
pub trait AdmissionPolicy: Send + Sync {
    fn admit(&self, request: &RequestView, saturation: &FleetSaturation) -> AdmitDecision;
    fn on_complete(&self, done: &Completion);
}

/// Tenant isolation, retention hints and eviction order for the KV cache.
pub trait CachePolicy: Send + Sync {
    fn hints(&self, request: &RequestView) -> CacheHints;
    /// One score per candidate; the highest scores are evicted first.
    fn score_eviction(&self, candidates: &EvictionCandidates) -> Vec<f32>;
}
