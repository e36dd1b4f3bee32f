//! Building blocks for KV-aware routing, shared by the `kv-aware` and
//! `session-affinity` plugins: a routing cost (Dynamo's, or an estimate of
//! time to first token) and a softmax pick.

use crate::{FleetView, RequestView, Worker, WorkerState};

/// How the routing cost weighs its terms, each counted in KV blocks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostWeights {
    /// Per prompt block the worker would have to prefill (not cached there).
    pub uncached: f64,
    /// Per block of prefill already queued there: prompt tokens of requests
    /// routed to it whose first token has not come back yet.
    pub queued_prefill: f64,
    /// Per KV block that requests running there hold.
    pub kv_held: f64,
}

impl CostWeights {
    /// Dynamo's cost: blocks to prefill plus blocks held by running requests.
    pub const DYNAMO: CostWeights = CostWeights {
        uncached: 1.0,
        queued_prefill: 0.0,
        kv_held: 1.0,
    };

    /// An estimate of time to first token in units of one block's prefill:
    /// this request's uncached blocks plus the prefill queued ahead of it. A
    /// block held by a running request costs a decode step far less than a
    /// block of prefill does (it is read, not computed), hence 0.02. Blocks
    /// to prefill weigh 1.5: a request sent away from its cached history
    /// leaves that history behind for its session's later turns too (1.5
    /// beat 1, 2 and 4 on the agentic trace; BENCHMARKS.md).
    pub const PREFILL: CostWeights = CostWeights {
        uncached: 1.5,
        queued_prefill: 1.0,
        kv_held: 0.02,
    };

    /// [`Self::PREFILL`] for a choice made once for a session's whole life
    /// (session affinity's placement): the blocks running requests hold
    /// weigh 0.1, five times more, because they stand for sessions that
    /// stay on the worker and will bring more turns there. On the agentic
    /// trace at 80% load this took session affinity's TTFT p90 from 94 ms
    /// (imbalance 1.62) to 62 ms (1.11) at the same hit rate (BENCHMARKS.md).
    pub const PLACEMENT: CostWeights = CostWeights {
        uncached: 1.5,
        queued_prefill: 1.0,
        kv_held: 0.1,
    };

    /// Reads `cost=prefill|placement|dynamo` (the preset, default `prefill`)
    /// and optional `overlap_weight`, `queued_prefill_weight`,
    /// `kv_held_weight` overrides, each at least 0.
    pub fn from_config(c: &mut crate::Config) -> Result<CostWeights, String> {
        Self::from_config_or(c, "prefill")
    }

    /// [`Self::from_config`] with another default preset.
    pub fn from_config_or(c: &mut crate::Config, default: &str) -> Result<CostWeights, String> {
        let preset: String = c.get("cost", default.to_string())?;
        let base = match preset.as_str() {
            "prefill" => Self::PREFILL,
            "placement" => Self::PLACEMENT,
            "dynamo" => Self::DYNAMO,
            other => {
                return Err(format!(
                    "cost must be prefill, placement or dynamo, got {other}"
                ));
            }
        };
        let w = CostWeights {
            uncached: c.get("overlap_weight", base.uncached)?,
            queued_prefill: c.get("queued_prefill_weight", base.queued_prefill)?,
            kv_held: c.get("kv_held_weight", base.kv_held)?,
        };
        for (name, v) in [
            ("overlap_weight", w.uncached),
            ("queued_prefill_weight", w.queued_prefill),
            ("kv_held_weight", w.kv_held),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(format!("{name} must be >= 0, got {v}"));
            }
        }
        Ok(w)
    }
}

/// The routing cost of sending `request` to `worker` under `w`. Lower is better.
pub fn cost(request: &RequestView, worker: &Worker, w: CostWeights) -> f64 {
    let uncached = request.prompt_blocks.saturating_sub(worker.overlap_blocks);
    let queued = worker.queued_prefill_tokens / request.block_size.max(1);
    w.uncached * f64::from(uncached)
        + w.queued_prefill * f64::from(queued)
        + w.kv_held * f64::from(worker.kv_blocks_used)
}

/// The eligible worker with the lowest [`cost`]; ties go to fewer active
/// requests, then the lower index. `None` when no worker can serve the hop.
pub fn cheapest(request: &RequestView, fleet: &FleetView, w: CostWeights) -> Option<u32> {
    // Walks the columns side by side: this runs for every request.
    let columns = fleet
        .state()
        .iter()
        .zip(fleet.overlap_blocks())
        .zip(fleet.kv_blocks_used())
        .zip(fleet.active_requests())
        .zip(fleet.queued_prefill_tokens());
    let block_size = request.block_size.max(1);
    let mut best: Option<(f64, u32, u32)> = None;
    for (i, ((((&state, &overlap), &used), &active), &queued)) in columns.enumerate() {
        if !WorkerState(state as u8).serves(request.hop) {
            continue;
        }
        let uncached = request.prompt_blocks.saturating_sub(overlap);
        let c = w.uncached * f64::from(uncached)
            + w.queued_prefill * f64::from(queued / block_size)
            + w.kv_held * f64::from(used);
        if best.is_none_or(|(bc, ba, _)| c < bc || (c == bc && active < ba)) {
            best = Some((c, active, i as u32));
        }
    }
    best.map(|(_, _, i)| i)
}

/// Picks one of `costs` (index, cost) at random with probability proportional to
/// `exp(-normalized_cost / temperature)`, costs normalized to 0..=1 as Dynamo
/// does; `unit` is a uniform random number in [0, 1). A temperature of 0 or
/// less (or NaN) picks the cheapest.
pub fn softmax_pick(costs: &[(u32, f64)], temperature: f64, unit: f64) -> Option<u32> {
    if temperature.is_nan() || temperature <= 0.0 {
        return costs
            .iter()
            .min_by(|a, b| a.1.total_cmp(&b.1))
            .map(|&(i, _)| i);
    }
    let (min, max) = costs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &(_, c)| {
            (lo.min(c), hi.max(c))
        });
    let span = if max > min { max - min } else { 1.0 };
    let weights: Vec<f64> = costs
        .iter()
        .map(|&(_, c)| (-(c - min) / span / temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut target = unit * total;
    for (&(i, _), w) in costs.iter().zip(&weights) {
        if target < *w {
            return Some(i);
        }
        target -= w;
    }
    costs.last().map(|&(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::request;

    #[test]
    fn cost_counts_uncached_blocks_and_load() {
        let mut w = Worker::idle(1);
        w.overlap_blocks = 3;
        w.kv_blocks_used = 7;
        w.queued_prefill_tokens = 5 * 16 + 15; // 5 whole blocks
        let dynamo = CostWeights {
            uncached: 2.0,
            ..CostWeights::DYNAMO
        };
        assert_eq!(cost(&request(160), &w, dynamo), 2.0 * 7.0 + 7.0);
        assert_eq!(
            cost(&request(160), &w, CostWeights::PREFILL),
            1.5 * 7.0 + 5.0 + 0.02 * 7.0
        );
        w.overlap_blocks = 99; // more than the prompt: nothing to prefill
        assert_eq!(cost(&request(160), &w, dynamo), 7.0);
    }

    #[test]
    fn prefill_cost_keeps_a_long_prefix_where_dynamo_spreads_it() {
        // Worker 1 holds the conversation (90 of 100 blocks) and 400 blocks
        // of running requests; worker 2 is empty.
        let mut ws: Vec<Worker> = (1..=2).map(Worker::idle).collect();
        ws[0].overlap_blocks = 90;
        ws[0].kv_blocks_used = 400;
        let fleet: FleetView = ws.into_iter().collect();
        let r = request(100 * 16);
        assert_eq!(cheapest(&r, &fleet, CostWeights::PREFILL), Some(0));
        assert_eq!(cheapest(&r, &fleet, CostWeights::DYNAMO), Some(1));
    }

    #[test]
    fn weights_come_from_the_config() {
        let mut c = crate::Config::parse("cost=dynamo, kv_held_weight=0.5").expect("parses");
        let w = CostWeights::from_config(&mut c).expect("valid");
        assert_eq!(w.uncached, 1.0, "the dynamo preset's");
        assert_eq!(w.kv_held, 0.5);
        assert_eq!(w.queued_prefill, 0.0);
        let mut c = crate::Config::parse("").expect("parses");
        assert_eq!(CostWeights::from_config(&mut c), Ok(CostWeights::PREFILL));
        let mut c = crate::Config::parse("").expect("parses");
        assert_eq!(
            CostWeights::from_config_or(&mut c, "placement"),
            Ok(CostWeights::PLACEMENT)
        );
        let mut c = crate::Config::parse("cost=prefill").expect("parses");
        assert_eq!(
            CostWeights::from_config_or(&mut c, "placement"),
            Ok(CostWeights::PREFILL),
            "the key beats the default"
        );
        for bad in ["cost=magic", "overlap_weight=-1", "kv_held_weight=inf"] {
            let mut c = crate::Config::parse(bad).expect("parses");
            assert!(CostWeights::from_config(&mut c).is_err(), "{bad}");
        }
    }

    #[test]
    fn cheapest_breaks_ties_by_active_requests_then_index() {
        let mut ws: Vec<Worker> = (1..=3).map(Worker::idle).collect();
        ws[0].active_requests = 2;
        ws[2].overlap_blocks = 4;
        ws[2].kv_blocks_used = 4; // same cost as the idle ones
        let fleet: FleetView = ws.into_iter().collect();
        assert_eq!(
            cheapest(&request(160), &fleet, CostWeights::DYNAMO),
            Some(1)
        );
        let empty: FleetView = std::iter::empty().collect();
        assert_eq!(cheapest(&request(160), &empty, CostWeights::DYNAMO), None);
    }

    #[test]
    fn softmax_pick_prefers_cheap_and_spreads_with_temperature() {
        let costs = [(0, 0.0), (1, 10.0)];
        assert_eq!(softmax_pick(&costs, 0.01, 0.5), Some(0));
        assert_eq!(softmax_pick(&costs, 0.01, 0.999_999_999), Some(0));
        // At a high temperature both get picked across the unit interval.
        assert_eq!(softmax_pick(&costs, 100.0, 0.1), Some(0));
        assert_eq!(softmax_pick(&costs, 100.0, 0.9), Some(1));
        assert_eq!(softmax_pick(&[], 1.0, 0.5), None);
        assert_eq!(softmax_pick(&[(4, 3.0), (5, 1.0)], 0.0, 0.99), Some(5));
    }
}
