//! Building blocks for KV-aware routing, shared by the `kv-aware` and
//! `session-affinity` plugins: Dynamo's cost and a softmax pick.

use crate::{FleetView, RequestView, Worker, WorkerState};

/// Dynamo's routing cost of sending `request` to `worker`: the prompt blocks it
/// would have to prefill (`overlap_weight` each) plus the KV blocks its running
/// requests hold. Lower is better.
pub fn cost(request: &RequestView, worker: &Worker, overlap_weight: f64) -> f64 {
    let uncached = request.prompt_blocks.saturating_sub(worker.overlap_blocks);
    overlap_weight * f64::from(uncached) + f64::from(worker.kv_blocks_used)
}

/// The eligible worker with the lowest [`cost`]; ties go to fewer active
/// requests, then the lower index. `None` when no worker can serve the hop.
pub fn cheapest(request: &RequestView, fleet: &FleetView, overlap_weight: f64) -> Option<u32> {
    // Walks the columns side by side: this runs for every request.
    let columns = fleet
        .state()
        .iter()
        .zip(fleet.overlap_blocks())
        .zip(fleet.kv_blocks_used())
        .zip(fleet.active_requests());
    let mut best: Option<(f64, u32, u32)> = None;
    for (i, (((&state, &overlap), &used), &active)) in columns.enumerate() {
        if !WorkerState(state as u8).serves(request.hop) {
            continue;
        }
        let uncached = request.prompt_blocks.saturating_sub(overlap);
        let c = overlap_weight * f64::from(uncached) + f64::from(used);
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
        assert_eq!(cost(&request(160), &w, 2.0), 2.0 * 7.0 + 7.0);
        w.overlap_blocks = 99; // more than the prompt: nothing to prefill
        assert_eq!(cost(&request(160), &w, 2.0), 7.0);
    }

    #[test]
    fn cheapest_breaks_ties_by_active_requests_then_index() {
        let mut ws: Vec<Worker> = (1..=3).map(Worker::idle).collect();
        ws[0].active_requests = 2;
        ws[2].overlap_blocks = 4;
        ws[2].kv_blocks_used = 4; // same cost as the idle ones
        let fleet: FleetView = ws.into_iter().collect();
        assert_eq!(cheapest(&request(160), &fleet, 1.0), Some(1));
        let empty: FleetView = std::iter::empty().collect();
        assert_eq!(cheapest(&request(160), &empty, 1.0), None);
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
