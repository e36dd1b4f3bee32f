//! KV-aware routing: each worker's cost is the prompt blocks it would have to
//! prefill plus the prefill already queued there (an estimate of time to
//! first token, `cost=prefill`, the default), or Dynamo's cost, prompt blocks
//! to prefill plus the KV blocks its running requests hold (`cost=dynamo`).
//! With `temperature` 0 the cheapest worker wins; above 0 a worker is drawn
//! with softmax weights over the normalized costs, spreading load across
//! near-ties.
//!
//! Config: `cost=prefill, overlap_weight=1.5, queued_prefill_weight=1.0,
//! kv_held_weight=0.02, temperature=0.0, seed=1` (the weights default to the
//! preset's; see `sluice_plugin_sdk::kv::CostWeights`).

use sluice_plugin_sdk::kv::{CostWeights, cheapest, cost, softmax_pick};
use sluice_plugin_sdk::{Config, FleetView, RequestView, RouteDecision, Router, export_router};

pub struct KvAware {
    weights: CostWeights,
    temperature: f64,
    /// splitmix64 state for softmax draws.
    rng: u64,
}

impl Default for KvAware {
    fn default() -> Self {
        Self {
            weights: CostWeights::PREFILL,
            temperature: 0.0,
            rng: 1,
        }
    }
}

impl KvAware {
    /// A uniform number in [0, 1) (splitmix64).
    fn next_unit(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

impl Router for KvAware {
    fn configure(&mut self, config: &str) -> Result<(), String> {
        let mut c = Config::parse(config)?;
        self.weights = CostWeights::from_config(&mut c)?;
        self.temperature = c.get("temperature", 0.0)?;
        self.rng = c.get("seed", 1)?;
        c.finish()?;
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        Ok(())
    }

    fn route(&mut self, request: &RequestView, fleet: &FleetView) -> RouteDecision {
        let pick = if self.temperature == 0.0 {
            cheapest(request, fleet, self.weights)
        } else {
            let costs: Vec<(u32, f64)> = fleet
                .eligible(request.hop)
                .filter_map(|i| fleet.worker(i as usize))
                .map(|w| (w.index, cost(request, &w, self.weights)))
                .collect();
            let unit = self.next_unit();
            softmax_pick(&costs, self.temperature, unit)
        };
        pick.map_or(RouteDecision::UseDefault, RouteDecision::Worker)
    }
}

export_router!(KvAware);

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_plugin_sdk::Worker;
    use sluice_plugin_sdk::testing::{RouterHarness, request};

    fn fleet(overlaps: &[u32], used: &[u32]) -> FleetView {
        overlaps
            .iter()
            .zip(used)
            .enumerate()
            .map(|(i, (&o, &u))| {
                let mut w = Worker::idle(i as u32 + 1);
                (w.overlap_blocks, w.kv_blocks_used) = (o, u);
                w
            })
            .collect()
    }

    #[test]
    fn follows_the_cached_prefix_until_queued_prefill_outweighs_it() {
        let mut r = RouterHarness::<KvAware>::new("").unwrap();
        // 20 blocks; worker 1 has 15 cached.
        assert_eq!(
            r.route(&request(320), &fleet(&[0, 15, 5], &[0, 0, 0])),
            RouteDecision::Worker(1)
        );
        // Running requests' blocks barely count: 30 held is 0.6 of a block
        // (costs 30, 8.1, 22.5).
        assert_eq!(
            r.route(&request(320), &fleet(&[0, 15, 5], &[0, 30, 0])),
            RouteDecision::Worker(1)
        );
        // 16 blocks of prefill queued on worker 1: costs 30, 7.5 + 16, 22.5.
        let f: FleetView = [(0, 0), (15, 16 * 16), (5, 0)]
            .iter()
            .enumerate()
            .map(|(i, &(overlap, queued))| {
                let mut w = Worker::idle(i as u32 + 1);
                (w.overlap_blocks, w.queued_prefill_tokens) = (overlap, queued);
                w
            })
            .collect();
        assert_eq!(r.route(&request(320), &f), RouteDecision::Worker(2));
    }

    #[test]
    fn dynamo_cost_counts_held_blocks_like_blocks_to_prefill() {
        let mut r = RouterHarness::<KvAware>::new("cost=dynamo").unwrap();
        // Costs 20 + 0, 5 + 30 and 15 + 0.
        assert_eq!(
            r.route(&request(320), &fleet(&[0, 15, 5], &[0, 30, 0])),
            RouteDecision::Worker(2)
        );
        // A heavier overlap weight makes the cache worth more again: 80, 50, 60.
        let mut heavy = RouterHarness::<KvAware>::new("cost=dynamo, overlap_weight=4").unwrap();
        assert_eq!(
            heavy.route(&request(320), &fleet(&[0, 15, 5], &[0, 30, 0])),
            RouteDecision::Worker(1)
        );
    }

    #[test]
    fn temperature_spreads_picks_over_near_ties_and_is_seeded() {
        let f = fleet(&[10, 10, 0], &[0, 1, 0]);
        let picks = |config: &str| {
            let mut r = RouterHarness::<KvAware>::new(config).unwrap();
            (0..400)
                .map(|_| match r.route(&request(320), &f) {
                    RouteDecision::Worker(i) => i,
                    other => panic!("unexpected {other:?}"),
                })
                .collect::<Vec<_>>()
        };
        let hot = picks("temperature=1.0, seed=7");
        assert!(
            hot.contains(&0) && hot.contains(&1),
            "both near-ties get traffic"
        );
        let share_of_worst = hot.iter().filter(|&&i| i == 2).count();
        assert!(
            share_of_worst < 100,
            "the costliest worker gets the least: {share_of_worst}"
        );
        assert_eq!(
            hot,
            picks("temperature=1.0, seed=7"),
            "same seed, same picks"
        );
        assert!(picks("temperature=0").iter().all(|&i| i == 0));
    }

    #[test]
    fn refuses_bad_config() {
        assert!(RouterHarness::<KvAware>::new("temperature=-1").is_err());
        assert!(RouterHarness::<KvAware>::new("overlap_weigth=2").is_err());
        assert!(RouterHarness::<KvAware>::new("overlap_weight=nan").is_err());
    }
}
