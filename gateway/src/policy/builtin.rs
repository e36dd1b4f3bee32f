//! The built-in policies: what answers when no plugin is loaded in a slot, when a
//! plugin says "use the default", and when a plugin fails (trap, timeout, invalid
//! answer) for one request.

use super::{
    AdmissionPolicy, AdmitDecision, CacheHints, CachePolicy, Completion, EvictionCandidates,
    FleetSaturation, FleetView, Rejection, RequestView, RouteDecision, RouterPolicy,
};

/// KV-aware routing with Dynamo's cost: for each worker that can serve the hop,
/// `overlap_weight * (prompt blocks not cached there) + (KV blocks its running
/// requests hold)`; the cheapest wins, ties to fewer active requests, then the
/// lower index. The `kv-aware` plugin computes the same cost (plus an optional
/// softmax temperature).
#[derive(Clone, Copy, Debug)]
pub struct KvAwareRouter {
    pub overlap_weight: f64,
}

impl Default for KvAwareRouter {
    fn default() -> Self {
        Self {
            overlap_weight: 1.0,
        }
    }
}

impl KvAwareRouter {
    /// The cost of sending the request to worker `i`.
    pub fn cost(&self, request: &RequestView, fleet: &FleetView, i: usize) -> f64 {
        let uncached = request
            .prompt_blocks
            .saturating_sub(fleet.overlap_blocks[i]);
        self.overlap_weight * f64::from(uncached) + f64::from(fleet.kv_blocks_used[i])
    }
}

impl RouterPolicy for KvAwareRouter {
    fn route(&self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        let best = (0..fleet.len())
            .filter(|&i| fleet.serves(i, request.hop))
            .map(|i| (self.cost(request, fleet, i), fleet.active_requests[i], i))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        match best {
            Some((_, _, i)) => RouteDecision::Worker(i),
            None => RouteDecision::Reject(Rejection {
                status: 503,
                message: format!("no healthy worker can serve the {:?} hop", request.hop),
            }),
        }
    }
}

/// Admits everything; keeps no accounting.
#[derive(Clone, Copy, Debug, Default)]
pub struct AdmitAll;

impl AdmissionPolicy for AdmitAll {
    fn admit(&self, _request: &RequestView, _saturation: &FleetSaturation) -> AdmitDecision {
        AdmitDecision::Admit
    }

    fn on_complete(&self, _done: &Completion) {}
}

/// Shared cache, no TTL, plain LRU eviction (the score is the age).
#[derive(Clone, Copy, Debug, Default)]
pub struct LruCache;

impl CachePolicy for LruCache {
    fn hints(&self, _request: &RequestView) -> CacheHints {
        CacheHints::default()
    }

    fn score_eviction(&self, candidates: &EvictionCandidates) -> Vec<f32> {
        candidates.age_ms.iter().map(|&age| age as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Hop, WorkerState};

    fn request(prompt_blocks: u32) -> RequestView {
        RequestView {
            prompt_tokens: prompt_blocks * 16,
            prompt_blocks,
            block_size: 16,
            max_tokens: 64,
            session_hash: 0,
            tenant_id: 0,
            priority: 0,
            hop: Hop::Aggregated,
        }
    }

    /// A fleet of `n` idle, healthy workers.
    fn fleet(n: usize) -> FleetView {
        FleetView {
            state: vec![WorkerState::new(true, true, true).0; n],
            worker_ids: (0..n as u32).collect(),
            active_requests: vec![0; n],
            queued_prefill_tokens: vec![0; n],
            kv_blocks_used: vec![0; n],
            kv_blocks_total: vec![1000; n],
            overlap_blocks: vec![0; n],
        }
    }

    #[test]
    fn prefers_the_worker_with_the_longest_cached_prefix() {
        let mut f = fleet(3);
        f.overlap_blocks = vec![2, 9, 5];
        assert_eq!(
            KvAwareRouter::default().route(&request(10), &f),
            RouteDecision::Worker(1)
        );
    }

    #[test]
    fn load_outweighs_a_small_overlap() {
        let mut f = fleet(2);
        f.overlap_blocks = vec![4, 0];
        f.kv_blocks_used = vec![50, 0];
        // Worker 0: 6 uncached + 50 used = 56; worker 1: 10 + 0 = 10.
        assert_eq!(
            KvAwareRouter::default().route(&request(10), &f),
            RouteDecision::Worker(1)
        );
    }

    #[test]
    fn skips_workers_that_cannot_serve_the_hop_and_rejects_when_none_can() {
        let mut f = fleet(3);
        f.overlap_blocks = vec![9, 9, 0];
        f.state[0] = WorkerState::new(false, true, true).0;
        f.state[1] = WorkerState::new(true, true, false).0;
        let router = KvAwareRouter::default();
        assert_eq!(router.route(&request(10), &f), RouteDecision::Worker(2));
        let mut prefill = request(10);
        prefill.hop = Hop::Prefill;
        assert_eq!(router.route(&prefill, &f), RouteDecision::Worker(1));
        f.state[2] = 0;
        assert!(
            matches!(router.route(&request(10), &f), RouteDecision::Reject(r) if r.status == 503)
        );
    }

    #[test]
    fn ties_go_to_fewer_active_requests() {
        let mut f = fleet(2);
        f.active_requests = vec![3, 1];
        assert_eq!(
            KvAwareRouter::default().route(&request(4), &f),
            RouteDecision::Worker(1)
        );
    }

    #[test]
    fn lru_scores_by_age() {
        let c = EvictionCandidates {
            age_ms: vec![5, 50],
            hits: vec![0, 0],
            priority: vec![0, 0],
            tenant_id: vec![0, 0],
        };
        assert_eq!(LruCache.score_eviction(&c), vec![5.0, 50.0]);
    }
}
