//! Round-robin routing: each hop goes to the next healthy worker that can serve it,
//! in worker-id order, so a worker joining or leaving does not reshuffle the rest.

use sluice_plugin_sdk::{FleetView, RequestView, RouteDecision, Router, export_router};

#[derive(Default)]
pub struct RoundRobin {
    /// The id of the worker picked last; the next pick is the eligible worker
    /// with the smallest id above it (wrapping).
    last_id: Option<u32>,
}

impl Router for RoundRobin {
    fn route(&mut self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        let id_of = |i: u32| fleet.worker_ids()[i as usize];
        let after_last = |i: &u32| self.last_id.is_none_or(|last| id_of(*i) > last);
        let next = fleet
            .eligible(request.hop)
            .filter(after_last)
            .min_by_key(|&i| id_of(i))
            .or_else(|| fleet.eligible(request.hop).min_by_key(|&i| id_of(i)));
        match next {
            Some(i) => {
                self.last_id = Some(id_of(i));
                RouteDecision::Worker(i)
            }
            None => RouteDecision::UseDefault,
        }
    }
}

export_router!(RoundRobin);

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_plugin_sdk::testing::{RouterHarness, request};
    use sluice_plugin_sdk::{Worker, WorkerState};

    #[test]
    fn cycles_through_healthy_workers_by_id() {
        let mut sick = Worker::idle(20);
        sick.state = WorkerState::new(false, true, true);
        // Listed out of id order on purpose.
        let fleet: FleetView = [Worker::idle(30), sick, Worker::idle(10)]
            .into_iter()
            .collect();
        let mut rr = RouterHarness::<RoundRobin>::new("").unwrap();
        let picks: Vec<_> = (0..4).map(|_| rr.route(&request(32), &fleet)).collect();
        use RouteDecision::Worker as W;
        assert_eq!(picks, vec![W(2), W(0), W(2), W(0)]);
    }

    #[test]
    fn a_new_worker_joins_the_cycle_without_reshuffling() {
        let mut rr = RouterHarness::<RoundRobin>::new("").unwrap();
        let two: FleetView = [Worker::idle(1), Worker::idle(3)].into_iter().collect();
        assert_eq!(rr.route(&request(8), &two), RouteDecision::Worker(0)); // id 1
        let three: FleetView = [Worker::idle(1), Worker::idle(2), Worker::idle(3)]
            .into_iter()
            .collect();
        assert_eq!(rr.route(&request(8), &three), RouteDecision::Worker(1)); // id 2
        assert_eq!(rr.route(&request(8), &three), RouteDecision::Worker(2)); // id 3
    }

    #[test]
    fn no_eligible_worker_defers_to_the_host() {
        let mut rr = RouterHarness::<RoundRobin>::new("").unwrap();
        let empty: FleetView = std::iter::empty().collect();
        assert_eq!(rr.route(&request(8), &empty), RouteDecision::UseDefault);
        assert!(RouterHarness::<RoundRobin>::new("x=1").is_err());
    }
}
