//! Least-load routing: the eligible worker with the fewest active requests, then
//! the fewest queued prefill tokens, then the emptiest KV cache.

use sluice_plugin_sdk::{FleetView, RequestView, RouteDecision, Router, export_router};

#[derive(Default)]
pub struct LeastLoad;

impl Router for LeastLoad {
    fn route(&mut self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        fleet
            .eligible(request.hop)
            .filter_map(|i| fleet.worker(i as usize))
            .min_by(|a, b| {
                let kv_use = |w: &sluice_plugin_sdk::Worker| {
                    f64::from(w.kv_blocks_used) / f64::from(w.kv_blocks_total.max(1))
                };
                a.active_requests
                    .cmp(&b.active_requests)
                    .then(a.queued_prefill_tokens.cmp(&b.queued_prefill_tokens))
                    .then(kv_use(a).total_cmp(&kv_use(b)))
            })
            .map_or(RouteDecision::UseDefault, |w| {
                RouteDecision::Worker(w.index)
            })
    }
}

export_router!(LeastLoad);

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_plugin_sdk::testing::{RouterHarness, request};
    use sluice_plugin_sdk::{Worker, WorkerState};

    fn worker(id: u32, active: u32, queued: u32, used: u32) -> Worker {
        let mut w = Worker::idle(id);
        (w.active_requests, w.queued_prefill_tokens, w.kv_blocks_used) = (active, queued, used);
        w
    }

    #[test]
    fn picks_fewest_active_then_queued_then_kv_use() {
        let mut r = RouterHarness::<LeastLoad>::new("").unwrap();
        let fleet: FleetView = [
            worker(1, 3, 0, 0),
            worker(2, 1, 500, 0),
            worker(3, 1, 100, 900),
        ]
        .into_iter()
        .collect();
        assert_eq!(r.route(&request(64), &fleet), RouteDecision::Worker(2));
        let fleet: FleetView = [worker(1, 1, 100, 800), worker(2, 1, 100, 10)]
            .into_iter()
            .collect();
        assert_eq!(r.route(&request(64), &fleet), RouteDecision::Worker(1));
    }

    #[test]
    fn ignores_workers_that_cannot_serve_the_hop() {
        let mut r = RouterHarness::<LeastLoad>::new("").unwrap();
        let mut idle_but_sick = worker(1, 0, 0, 0);
        idle_but_sick.state = WorkerState::new(false, true, true);
        let fleet: FleetView = [idle_but_sick, worker(2, 9, 0, 0)].into_iter().collect();
        assert_eq!(r.route(&request(64), &fleet), RouteDecision::Worker(1));
    }
}
