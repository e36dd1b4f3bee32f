//! Session affinity: a request with a session id goes back to the worker that
//! served its session last, for as long as that worker is healthy and the session
//! was seen within `ttl_ms`; otherwise (and for requests without a session) it is
//! routed KV-aware, and the choice is remembered.
//!
//! Config: `ttl_ms=300000, max_sessions=100000`, and the cost keys of
//! `sluice_plugin_sdk::kv::CostWeights` (`cost=prefill`, the weights).

use sluice_plugin_sdk::collections::HashMap;
use sluice_plugin_sdk::kv::{CostWeights, cheapest};
use sluice_plugin_sdk::{
    Config, FleetView, Hop, RequestView, RouteDecision, Router, counter_add, export_router, now_ns,
};

pub struct SessionAffinity {
    ttl_ns: u64,
    max_sessions: usize,
    weights: CostWeights,
    /// (session hash, hop) -> (worker id, expiry in host ns).
    sessions: HashMap<(u64, u8), (u32, u64)>,
}

impl Default for SessionAffinity {
    fn default() -> Self {
        Self {
            ttl_ns: 300_000 * 1_000_000,
            max_sessions: 100_000,
            weights: CostWeights::PREFILL,
            sessions: HashMap::default(),
        }
    }
}

fn hop_key(hop: Hop) -> u8 {
    match hop {
        Hop::Aggregated => 0,
        Hop::Prefill => 1,
        Hop::Decode => 2,
    }
}

impl SessionAffinity {
    /// Makes room for one more session: drops expired ones, then the one that
    /// expires soonest.
    fn make_room(&mut self, now: u64) {
        if self.sessions.len() < self.max_sessions {
            return;
        }
        self.sessions.retain(|_, &mut (_, expiry)| expiry > now);
        if self.sessions.len() >= self.max_sessions
            && let Some(key) = self
                .sessions
                .iter()
                .min_by_key(|(_, (_, e))| *e)
                .map(|(k, _)| *k)
        {
            self.sessions.remove(&key);
        }
    }
}

impl Router for SessionAffinity {
    fn configure(&mut self, config: &str) -> Result<(), String> {
        let mut c = Config::parse(config)?;
        self.ttl_ns = c.get::<u64>("ttl_ms", 300_000)?.saturating_mul(1_000_000);
        self.max_sessions = c.get("max_sessions", 100_000)?;
        self.weights = CostWeights::from_config(&mut c)?;
        c.finish()?;
        if self.max_sessions == 0 {
            return Err("max_sessions must be at least 1".into());
        }
        Ok(())
    }

    fn route(&mut self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        let now = now_ns();
        let key = (request.session_hash, hop_key(request.hop));
        if request.session_hash != 0
            && let Some(&(id, expiry)) = self.sessions.get(&key)
            && expiry > now
            && let Some(i) = fleet.index_of(id)
            && fleet.eligible(request.hop).any(|e| e == i)
        {
            self.sessions.insert(key, (id, now + self.ttl_ns));
            counter_add("sticky", 1);
            return RouteDecision::Worker(i);
        }
        let Some(i) = cheapest(request, fleet, self.weights) else {
            return RouteDecision::UseDefault;
        };
        if request.session_hash != 0 {
            self.make_room(now);
            self.sessions
                .insert(key, (fleet.worker_ids()[i as usize], now + self.ttl_ns));
            counter_add("placed", 1);
        }
        RouteDecision::Worker(i)
    }
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
    fn the_session_table_is_bounded() {
        testing::set_now_ns(0);
        let mut r = RouterHarness::<SessionAffinity>::new("max_sessions=3").unwrap();
        for s in 1..=10 {
            let (req, fleet) = session(s, &[0, 1]);
            r.route(&req, &fleet);
            testing::advance_ms(1);
        }
        assert_eq!(r.policy.sessions.len(), 3);
        assert!(RouterHarness::<SessionAffinity>::new("max_sessions=0").is_err());
    }
}
