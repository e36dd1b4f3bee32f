//! Shadow routing: a candidate router plugin is asked beside the active one
//! on live requests, with the same request and fleet view; where the two
//! disagree, and how much of the prompt each choice had cached, is counted,
//! and the candidate's choice is never acted on. [`Comparison`] is the
//! counting, shared with `sluice plugins replay` (which asks a plugin about a
//! recorded decision log instead of live requests).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::plugins::{PluginIdentity, Runtime, Slot, WasmRouter};
use crate::policy::{FleetView, RequestView, RouteDecision};

/// Counts of two routers' choices on the same inputs.
#[derive(Debug, Default)]
pub struct Comparison {
    /// Decisions both made.
    pub decisions: AtomicU64,
    /// Of those, the ones where they picked different workers.
    pub disagreements: AtomicU64,
    /// The candidate deferred or failed (the built-in policy answered for it).
    pub candidate_fallbacks: AtomicU64,
    /// Prompt blocks of the compared requests.
    pub prompt_blocks: AtomicU64,
    /// Prompt blocks already cached on the worker each one picked.
    pub active_overlap_blocks: AtomicU64,
    pub candidate_overlap_blocks: AtomicU64,
    /// The candidate rejected a request the active one routed, or the reverse.
    pub reject_mismatches: AtomicU64,
}

/// A snapshot of a [`Comparison`], with rates.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct ComparisonStatus {
    pub decisions: u64,
    pub disagreements: u64,
    pub disagreement_rate: f64,
    pub candidate_fallbacks: u64,
    pub reject_mismatches: u64,
    pub prompt_blocks: u64,
    pub active_overlap_blocks: u64,
    pub candidate_overlap_blocks: u64,
    /// Cached prompt blocks / prompt blocks, had each router's choice been taken.
    pub active_hit_rate: f64,
    pub candidate_hit_rate: f64,
}

impl Comparison {
    /// Counts one request routed by both: `active` the decision taken,
    /// `candidate` the other's (and whether the candidate itself answered).
    pub fn observe(
        &self,
        request: &RequestView,
        fleet: &FleetView,
        active: &RouteDecision,
        candidate: &RouteDecision,
        candidate_answered: bool,
    ) {
        if !candidate_answered {
            self.candidate_fallbacks.fetch_add(1, Ordering::Relaxed);
        }
        let overlap = |i: usize| u64::from(fleet.overlap_blocks().get(i).copied().unwrap_or(0));
        match (active, candidate) {
            (RouteDecision::Worker(a), RouteDecision::Worker(c)) => {
                self.decisions.fetch_add(1, Ordering::Relaxed);
                if a != c {
                    self.disagreements.fetch_add(1, Ordering::Relaxed);
                }
                let blocks = u64::from(request.prompt_blocks);
                self.prompt_blocks.fetch_add(blocks, Ordering::Relaxed);
                self.active_overlap_blocks
                    .fetch_add(overlap(*a).min(blocks), Ordering::Relaxed);
                self.candidate_overlap_blocks
                    .fetch_add(overlap(*c).min(blocks), Ordering::Relaxed);
            }
            (RouteDecision::Reject(_), RouteDecision::Reject(_)) => {}
            _ => {
                self.reject_mismatches.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn status(&self) -> ComparisonStatus {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (decisions, disagreements, blocks) = (
            get(&self.decisions),
            get(&self.disagreements),
            get(&self.prompt_blocks),
        );
        let rate = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        ComparisonStatus {
            decisions,
            disagreements,
            disagreement_rate: rate(disagreements, decisions),
            candidate_fallbacks: get(&self.candidate_fallbacks),
            reject_mismatches: get(&self.reject_mismatches),
            prompt_blocks: blocks,
            active_overlap_blocks: get(&self.active_overlap_blocks),
            candidate_overlap_blocks: get(&self.candidate_overlap_blocks),
            active_hit_rate: rate(get(&self.active_overlap_blocks), blocks),
            candidate_hit_rate: rate(get(&self.candidate_overlap_blocks), blocks),
        }
    }
}

/// The shadow router slot and its comparison with the active router. A new
/// candidate starts a new comparison.
#[derive(Debug)]
pub struct Shadow {
    router: WasmRouter,
    comparison: arc_swap::ArcSwap<Comparison>,
}

/// What `GET /admin/plugins` and `/metrics` show of the shadow.
#[derive(Clone, Debug, serde::Serialize)]
pub struct ShadowStatus {
    /// The candidate; `None` when no shadow runs.
    pub candidate: Option<PluginIdentity>,
    pub comparison: ComparisonStatus,
    /// The candidate's own call statistics.
    pub calls: u64,
    pub call_p50_ns: f64,
    pub call_p99_ns: f64,
}

impl Shadow {
    pub fn new(runtime: Arc<Runtime>) -> Self {
        Self {
            router: WasmRouter::new(Arc::new(Slot::new(runtime))),
            comparison: arc_swap::ArcSwap::from_pointee(Comparison::default()),
        }
    }

    pub fn slot(&self) -> &Arc<Slot<crate::plugins::Router>> {
        self.router.slot()
    }

    /// Loads a candidate (validated as any plugin) and starts counting afresh.
    pub fn load(
        &self,
        name: &str,
        bytes: &[u8],
        config: &str,
    ) -> Result<PluginIdentity, crate::plugins::LoadError> {
        let (identity, _) = self.slot().load(name, bytes, config)?;
        self.comparison.store(Arc::new(Comparison::default()));
        Ok(identity)
    }

    /// Stops shadowing; returns the candidate that ran, if one did.
    pub fn clear(&self) -> Option<PluginIdentity> {
        self.slot().clear()
    }

    /// Asks the candidate about a request the active router decided (a
    /// no-op without a candidate).
    pub fn observe(&self, request: &RequestView, fleet: &FleetView, active: &RouteDecision) {
        if self.slot().with_current(|_| ()).is_none() {
            return;
        }
        let (candidate, version) = self.router.route_traced(request, fleet);
        self.comparison
            .load()
            .observe(request, fleet, active, &candidate, version.is_some());
    }

    pub fn status(&self) -> ShadowStatus {
        let slot = self.slot().status();
        ShadowStatus {
            candidate: slot.active,
            comparison: self.comparison.load().status(),
            calls: slot.calls,
            call_p50_ns: slot.call_p50_ns,
            call_p99_ns: slot.call_p99_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Hop, Rejection, WorkerLoad};

    fn request(blocks: u32) -> RequestView {
        RequestView {
            prompt_tokens: blocks * 16,
            prompt_blocks: blocks,
            block_size: 16,
            max_tokens: 16,
            session_hash: 0,
            tenant_id: 0,
            priority: 0,
            hop: Hop::Aggregated,
        }
    }

    fn fleet(overlaps: &[u32]) -> FleetView {
        let workers: Vec<WorkerLoad> = overlaps
            .iter()
            .enumerate()
            .map(|(i, &o)| WorkerLoad {
                id: i as u32 + 1,
                overlap_blocks: o,
                ..WorkerLoad::default()
            })
            .collect();
        FleetView::from_workers(&workers)
    }

    #[test]
    fn counts_disagreements_and_the_overlap_each_choice_had() {
        let c = Comparison::default();
        let f = fleet(&[8, 2, 0]);
        let r = request(10);
        c.observe(
            &r,
            &f,
            &RouteDecision::Worker(0),
            &RouteDecision::Worker(0),
            true,
        );
        c.observe(
            &r,
            &f,
            &RouteDecision::Worker(0),
            &RouteDecision::Worker(1),
            true,
        );
        c.observe(
            &r,
            &f,
            &RouteDecision::Worker(2),
            &RouteDecision::Worker(1),
            false,
        );
        let reject = RouteDecision::Reject(Rejection {
            status: 503,
            message: "no".into(),
        });
        c.observe(&r, &f, &RouteDecision::Worker(0), &reject, true);
        let s = c.status();
        assert_eq!(s.decisions, 3);
        assert_eq!(s.disagreements, 2);
        assert_eq!(s.candidate_fallbacks, 1);
        assert_eq!(s.reject_mismatches, 1);
        assert_eq!(s.prompt_blocks, 30);
        assert_eq!(s.active_overlap_blocks, 8 + 8);
        assert_eq!(s.candidate_overlap_blocks, 8 + 2 + 2);
        assert!((s.disagreement_rate - 2.0 / 3.0).abs() < 1e-12);
        assert!((s.active_hit_rate - 16.0 / 30.0).abs() < 1e-12);
    }

    #[test]
    fn overlap_beyond_the_prompt_counts_only_the_prompt() {
        let c = Comparison::default();
        c.observe(
            &request(4),
            &fleet(&[9]),
            &RouteDecision::Worker(0),
            &RouteDecision::Worker(0),
            true,
        );
        assert_eq!(c.status().active_overlap_blocks, 4);
    }
}
