//! The built-in policies: what answers when no plugin is loaded in a slot, when a
//! plugin says "use the default", and when a plugin fails (trap, timeout, invalid
//! answer) for one request.

use super::{
    AdmissionPolicy, AdmitDecision, CacheHints, CachePolicy, Completion, EvictionCandidates,
    FleetSaturation, FleetView, Rejection, RequestView, RouteDecision, RouterPolicy, WorkerState,
};

/// KV-aware routing by estimated time to first token, in blocks of prefill:
/// for each worker that can serve the hop, `uncached * (prompt blocks not
/// cached there) + queued_prefill * (blocks of prefill queued there) +
/// kv_held * (KV blocks its running requests hold)`; the cheapest wins, ties
/// to fewer active requests, then the lower index. The `kv-aware` plugin
/// computes the same cost by default (`cost=prefill`); Dynamo's cost is
/// `uncached = 1, queued_prefill = 0, kv_held = 1`.
#[derive(Clone, Copy, Debug)]
pub struct KvAwareRouter {
    pub uncached: f64,
    pub queued_prefill: f64,
    pub kv_held: f64,
}

impl Default for KvAwareRouter {
    fn default() -> Self {
        Self {
            uncached: 1.5,
            queued_prefill: 1.0,
            kv_held: 0.02,
        }
    }
}

impl KvAwareRouter {
    /// The cost of a worker with `overlap` of the prompt's `prompt_blocks`
    /// cached, `queued` blocks of prefill waiting and `held` blocks held by
    /// running requests.
    pub fn cost(&self, prompt_blocks: u32, overlap: u32, queued: u32, held: u32) -> f64 {
        let uncached = prompt_blocks.saturating_sub(overlap);
        self.uncached * f64::from(uncached)
            + self.queued_prefill * f64::from(queued)
            + self.kv_held * f64::from(held)
    }
}

impl RouterPolicy for KvAwareRouter {
    fn route(&self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        // Walks the columns side by side: this runs for every request.
        let columns = fleet
            .state()
            .iter()
            .zip(fleet.overlap_blocks())
            .zip(fleet.kv_blocks_used())
            .zip(fleet.active_requests())
            .zip(fleet.queued_prefill_tokens());
        let block_size = request.block_size.max(1);
        let mut best: Option<(f64, u32, usize)> = None;
        for (i, ((((&state, &overlap), &used), &active), &queued)) in columns.enumerate() {
            if !WorkerState(state as u8).serves(request.hop) {
                continue;
            }
            let cost = self.cost(request.prompt_blocks, overlap, queued / block_size, used);
            if best.is_none_or(|(bc, ba, _)| cost < bc || (cost == bc && active < ba)) {
                best = Some((cost, active, i));
            }
        }
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

/// Tenants isolated (a salt per tenant; anonymous requests share), no TTL,
/// plain LRU eviction (the score is the age). Isolation is the default so that
/// a failing cache plugin never opens one tenant's prefixes to another.
#[derive(Clone, Copy, Debug, Default)]
pub struct LruCache;

/// A per-tenant cache salt, never 0 (0 means shared).
pub fn tenant_salt(tenant_id: u32) -> u64 {
    let mut z = u64::from(tenant_id).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)).max(1)
}

impl CachePolicy for LruCache {
    fn hints(&self, request: &RequestView) -> CacheHints {
        CacheHints {
            salt: if request.tenant_id == 0 {
                0
            } else {
                tenant_salt(request.tenant_id)
            },
            ..CacheHints::default()
        }
    }

    fn score_eviction(&self, candidates: &EvictionCandidates) -> Vec<f32> {
        candidates.age_ms.iter().map(|&age| age as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{Hop, WorkerLoad, WorkerState};

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

    /// A fleet of idle, healthy workers, one per overlap given, with the
    /// given KV use and active requests (missing entries are 0).
    fn fleet(overlap: &[u32], used: &[u32], active: &[u32], state: &[WorkerState]) -> FleetView {
        let workers: Vec<WorkerLoad> = (0..overlap.len())
            .map(|i| WorkerLoad {
                state: state
                    .get(i)
                    .copied()
                    .unwrap_or(WorkerState::new(true, true, true)),
                id: i as u32,
                active_requests: active.get(i).copied().unwrap_or(0),
                kv_blocks_used: used.get(i).copied().unwrap_or(0),
                kv_blocks_total: 1000,
                overlap_blocks: overlap[i],
                ..WorkerLoad::default()
            })
            .collect();
        FleetView::from_workers(&workers)
    }

    #[test]
    fn prefers_the_worker_with_the_longest_cached_prefix() {
        let f = fleet(&[2, 9, 5], &[], &[], &[]);
        assert_eq!(
            KvAwareRouter::default().route(&request(10), &f),
            RouteDecision::Worker(1)
        );
    }

    #[test]
    fn queued_prefill_outweighs_a_small_overlap() {
        let mut f = fleet(&[4, 0], &[50, 0], &[], &[]);
        // Held blocks barely count: 1.5 * 6 + 0.02 * 50 = 10 against 15.
        assert_eq!(
            KvAwareRouter::default().route(&request(10), &f),
            RouteDecision::Worker(0)
        );
        // 8 blocks of prefill queued on worker 0: 18 against 15.
        let mut workers: Vec<WorkerLoad> = (0..2).filter_map(|i| f.worker(i)).collect();
        workers[0].queued_prefill_tokens = 8 * 16;
        f = FleetView::from_workers(&workers);
        assert_eq!(
            KvAwareRouter::default().route(&request(10), &f),
            RouteDecision::Worker(1)
        );
    }

    #[test]
    fn dynamo_weights_count_held_blocks_like_blocks_to_prefill() {
        let f = fleet(&[4, 0], &[50, 0], &[], &[]);
        let dynamo = KvAwareRouter {
            uncached: 1.0,
            queued_prefill: 0.0,
            kv_held: 1.0,
        };
        // Worker 0: 6 uncached + 50 used = 56; worker 1: 10 + 0 = 10.
        assert_eq!(dynamo.route(&request(10), &f), RouteDecision::Worker(1));
    }

    #[test]
    fn skips_workers_that_cannot_serve_the_hop_and_rejects_when_none_can() {
        let (sick, prefill_only) = (
            WorkerState::new(false, true, true),
            WorkerState::new(true, true, false),
        );
        let f = fleet(&[9, 9, 0], &[], &[], &[sick, prefill_only]);
        let router = KvAwareRouter::default();
        assert_eq!(router.route(&request(10), &f), RouteDecision::Worker(2));
        let mut prefill = request(10);
        prefill.hop = Hop::Prefill;
        assert_eq!(router.route(&prefill, &f), RouteDecision::Worker(1));
        let none = fleet(&[9, 9, 0], &[], &[], &[sick, prefill_only, sick]);
        assert!(
            matches!(router.route(&request(10), &none), RouteDecision::Reject(r) if r.status == 503)
        );
    }

    #[test]
    fn ties_go_to_fewer_active_requests() {
        let f = fleet(&[0, 0], &[], &[3, 1], &[]);
        assert_eq!(
            KvAwareRouter::default().route(&request(4), &f),
            RouteDecision::Worker(1)
        );
    }

    #[test]
    fn the_default_cache_policy_isolates_tenants() {
        let mut r = request(4);
        assert_eq!(LruCache.hints(&r).salt, 0, "anonymous requests share");
        r.tenant_id = 1;
        let one = LruCache.hints(&r).salt;
        r.tenant_id = 2;
        assert!(one != 0 && one != LruCache.hints(&r).salt);
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
