//! Session affinity: a request with a session id goes back to the worker that
//! served its session last, for as long as that worker is healthy and the session
//! was seen within `ttl_ms`; otherwise (and for requests without a session) it is
//! routed KV-aware, and the choice is remembered.
//!
//! The session table lives in the slot's shared entries
//! (`sluice_plugin_sdk::shared`), not in the instance: the gateway runs several
//! instances side by side (one per concurrent caller), and a table per
//! instance sent a session's turns wherever the instance that took them had
//! placed it (7% of the later turns of a 16-worker agentic replay moved).
//! The host bounds the table (`wit/README.md`); a session it has no room
//! for is routed KV-aware each time.
//!
//! New sessions are placed by `CostWeights::PLACEMENT` (the KV-aware cost
//! with running requests' blocks weighing 0.1: they stand for sessions that
//! will bring more turns).
//!
//! With `move_over_blocks=N` a session leaves its worker when that worker's
//! cost is more than N blocks above the cheapest one's (a bound on how long
//! a hot worker's queue may hold its sessions); by default it never does
//! (on ShareGPT at 80% load, N = 32 gave TTFT p90 25 ms against 18 ms
//! without, at a lower hit rate: BENCHMARKS.md).
//!
//! Config: `ttl_ms=300000, move_over_blocks=inf`, and the cost keys of
//! `sluice_plugin_sdk::kv::CostWeights` (`cost=placement` by default, the
//! weights).

use sluice_plugin_sdk::kv::{CostWeights, cheapest, cost};
use sluice_plugin_sdk::{
    Config, FleetView, Hop, RequestView, RouteDecision, Router, counter_add, export_router, shared,
};

pub struct SessionAffinity {
    ttl_ms: u32,
    weights: CostWeights,
    /// A session moves when its worker's cost exceeds the cheapest worker's
    /// by more than this many blocks (infinite: never).
    move_over: f64,
}

impl Default for SessionAffinity {
    fn default() -> Self {
        Self {
            ttl_ms: 300_000,
            weights: CostWeights::PLACEMENT,
            move_over: f64::INFINITY,
        }
    }
}

/// The shared-entry key of a session's worker for one hop (a disaggregated
/// session has a prefill worker and a decode worker).
fn session_key(session_hash: u64, hop: Hop) -> u64 {
    let hop = match hop {
        Hop::Aggregated => 0u64,
        Hop::Prefill => 1,
        Hop::Decode => 2,
    };
    session_hash ^ hop.wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl Router for SessionAffinity {
    fn configure(&mut self, config: &str) -> Result<(), String> {
        let mut c = Config::parse(config)?;
        let ttl_ms: u64 = c.get("ttl_ms", 300_000)?;
        self.weights = CostWeights::from_config_or(&mut c, "placement")?;
        self.move_over = c.get("move_over_blocks", f64::INFINITY)?;
        c.finish()?;
        if self.move_over.is_nan() || self.move_over < 0.0 {
            return Err(format!(
                "move_over_blocks must be >= 0 (inf: never move), got {}",
                self.move_over
            ));
        }
        self.ttl_ms = match u32::try_from(ttl_ms) {
            Ok(ms) if ms > 0 => ms,
            _ => {
                return Err(format!(
                    "ttl_ms must be 1..={} (about 49 days), got {ttl_ms}",
                    u32::MAX
                ));
            }
        };
        Ok(())
    }

    fn route(&mut self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        let key = session_key(request.session_hash, request.hop);
        let current = match request.session_hash {
            0 => None,
            _ => shared::get(key),
        };
        if let Some(id) = current
            && let Some(i) = eligible_index(request, fleet, id)
        {
            if let Some(to) = self.worth_moving(request, fleet, i) {
                let to_id = fleet.worker_ids()[to as usize];
                shared::set(key, u64::from(to_id), self.ttl_ms);
                counter_add("moved", 1);
                return RouteDecision::Worker(to);
            }
            // Seen again: the affinity lasts another ttl.
            shared::set(key, id, self.ttl_ms);
            counter_add("sticky", 1);
            return RouteDecision::Worker(i);
        }
        let Some(i) = cheapest(request, fleet, self.weights) else {
            return RouteDecision::UseDefault;
        };
        if request.session_hash != 0 {
            let id = u64::from(fleet.worker_ids()[i as usize]);
            if shared::compare_and_swap(key, current, id, self.ttl_ms) {
                counter_add("placed", 1);
            } else if let Some(winner) = shared::get(key)
                && let Some(w) = eligible_index(request, fleet, winner)
            {
                // Another instance placed the session first: go where it did.
                counter_add("sticky", 1);
                return RouteDecision::Worker(w);
            } else {
                counter_add("unplaced", 1);
            }
        }
        RouteDecision::Worker(i)
    }
}

impl SessionAffinity {
    /// The cheapest worker, when the session's worker `home` costs more than
    /// `move_over` blocks above it.
    fn worth_moving(&self, request: &RequestView, fleet: &FleetView, home: u32) -> Option<u32> {
        if self.move_over.is_infinite() {
            return None;
        }
        let best = cheapest(request, fleet, self.weights)?;
        let of = |i: u32| Some(cost(request, &fleet.worker(i as usize)?, self.weights));
        (of(home)? - of(best)? > self.move_over).then_some(best)
    }
}

/// The index of worker `id` in `fleet`, if it can take the request's hop.
fn eligible_index(request: &RequestView, fleet: &FleetView, id: u64) -> Option<u32> {
    let i = fleet.index_of(u32::try_from(id).ok()?)?;
    fleet.eligible(request.hop).any(|e| e == i).then_some(i)
}

export_router!(SessionAffinity);

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_plugin_sdk::testing::{self, RouterHarness, request};
    use sluice_plugin_sdk::{Worker, WorkerState};

    fn session(hash: u64, overlap_on: &[u32]) -> (RequestView, FleetView) {
        let mut r = request(160);
        r.session_hash = hash;
        let fleet = overlap_on
            .iter()
            .enumerate()
            .map(|(i, &o)| {
                let mut w = Worker::idle(10 + i as u32);
                w.overlap_blocks = o;
                w
            })
            .collect();
        (r, fleet)
    }

    #[test]
    fn sticks_to_the_first_worker_even_when_another_looks_cheaper() {
        testing::set_now_ns(0);
        let mut r = RouterHarness::<SessionAffinity>::new("ttl_ms=1000").unwrap();
        let (req, fleet) = session(42, &[0, 5]);
        assert_eq!(r.route(&req, &fleet), RouteDecision::Worker(1));
        // The cache moved (say, evicted): KV-aware alone would now pick 0.
        let (req, fleet) = session(42, &[5, 0]);
        assert_eq!(r.route(&req, &fleet), RouteDecision::Worker(1));
        assert_eq!(testing::counter("sticky"), 1);
        // A request without a session is routed KV-aware.
        let (anon, fleet) = session(0, &[5, 0]);
        assert_eq!(r.route(&anon, &fleet), RouteDecision::Worker(0));
    }

    #[test]
    fn affinity_expires_after_the_ttl_and_follows_the_worker_id() {
        testing::set_now_ns(0);
        let mut r = RouterHarness::<SessionAffinity>::new("ttl_ms=1000").unwrap();
        let (req, fleet) = session(7, &[0, 5]);
        assert_eq!(r.route(&req, &fleet), RouteDecision::Worker(1));
        // The same worker (id 11) now listed first: affinity follows the id.
        let mut other = Worker::idle(10);
        other.overlap_blocks = 9;
        let moved: FleetView = [Worker::idle(11), other].into_iter().collect();
        assert_eq!(r.route(&req, &moved), RouteDecision::Worker(0));
        testing::advance_ms(1001);
        assert_eq!(
            r.route(&req, &moved),
            RouteDecision::Worker(1),
            "expired: KV-aware again"
        );
    }

    #[test]
    fn an_unhealthy_sticky_worker_is_abandoned() {
        testing::set_now_ns(0);
        let mut r = RouterHarness::<SessionAffinity>::new("").unwrap();
        let (req, mut fleet) = session(9, &[0, 5]);
        assert_eq!(r.route(&req, &fleet), RouteDecision::Worker(1));
        fleet.set_state(1, WorkerState::new(false, true, true));
        assert_eq!(r.route(&req, &fleet), RouteDecision::Worker(0));
    }

    #[test]
    fn instances_side_by_side_keep_a_session_on_one_worker() {
        testing::set_now_ns(0);
        testing::clear_shared();
        // Two instances, as the gateway runs them: one places the session...
        let mut first = RouterHarness::<SessionAffinity>::new("").unwrap();
        let mut second = RouterHarness::<SessionAffinity>::new("").unwrap();
        let (req, fleet) = session(77, &[0, 5]);
        assert_eq!(first.route(&req, &fleet), RouteDecision::Worker(1));
        // ...and the other, asked next, sends it to the same worker though
        // KV-aware alone would now pick worker 0.
        let (req, fleet) = session(77, &[9, 0]);
        assert_eq!(second.route(&req, &fleet), RouteDecision::Worker(1));
    }

    #[test]
    fn a_session_moves_only_when_its_worker_costs_more_than_move_over() {
        testing::set_now_ns(0);
        testing::clear_shared();
        let mut r = RouterHarness::<SessionAffinity>::new("move_over_blocks=32").unwrap();
        let (req, fleet) = session(5, &[0, 5]);
        assert_eq!(r.route(&req, &fleet), RouteDecision::Worker(1));
        // 10 blocks; worker 1 now has 20 blocks of prefill queued (cost 20 +
        // 15, against 15 on worker 0): 20 over, under 32, stays.
        let queued = |blocks: u32| -> FleetView {
            let mut busy = Worker::idle(11);
            busy.queued_prefill_tokens = blocks * 16;
            [Worker::idle(10), busy].into_iter().collect()
        };
        assert_eq!(r.route(&req, &queued(20)), RouteDecision::Worker(1));
        // 40 blocks queued: 40 over, moves, and stays moved.
        assert_eq!(r.route(&req, &queued(40)), RouteDecision::Worker(0));
        assert_eq!(testing::counter("moved"), 1);
        assert_eq!(r.route(&req, &queued(0)), RouteDecision::Worker(0));
        assert!(RouterHarness::<SessionAffinity>::new("move_over_blocks=-1").is_err());
    }

    #[test]
    fn sessions_are_kept_apart_per_hop_and_config_is_checked() {
        testing::set_now_ns(0);
        testing::clear_shared();
        assert_ne!(session_key(5, Hop::Prefill), session_key(5, Hop::Decode));
        assert_ne!(session_key(5, Hop::Aggregated), session_key(5, Hop::Decode));
        assert!(RouterHarness::<SessionAffinity>::new("ttl_ms=0").is_err());
        assert!(RouterHarness::<SessionAffinity>::new("ttl_ms=99999999999").is_err());
        assert!(RouterHarness::<SessionAffinity>::new("max_sessions=3").is_err());
    }
}
