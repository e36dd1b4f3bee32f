//! Typed views over the struct-of-arrays `FleetView`: one [`Worker`] per index.

use crate::{FleetView, Hop};

/// Bits of `FleetView::state`, as the WIT contract defines them.
const HEALTHY: u8 = 1;
const CAN_PREFILL: u8 = 2;
const CAN_DECODE: u8 = 4;

/// A worker's state byte, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerState(pub u8);

impl WorkerState {
    pub const fn new(healthy: bool, can_prefill: bool, can_decode: bool) -> Self {
        Self(
            (healthy as u8) * HEALTHY
                | (can_prefill as u8) * CAN_PREFILL
                | (can_decode as u8) * CAN_DECODE,
        )
    }
    pub fn healthy(self) -> bool {
        self.0 & HEALTHY != 0
    }
    pub fn can_prefill(self) -> bool {
        self.0 & CAN_PREFILL != 0
    }
    pub fn can_decode(self) -> bool {
        self.0 & CAN_DECODE != 0
    }
    /// Healthy and able to serve `hop` (an aggregated hop needs both roles).
    pub fn serves(self, hop: Hop) -> bool {
        let needs = match hop {
            Hop::Aggregated => CAN_PREFILL | CAN_DECODE,
            Hop::Prefill => CAN_PREFILL,
            Hop::Decode => CAN_DECODE,
        };
        self.healthy() && self.0 & needs == needs
    }
}

/// One worker of a [`FleetView`], by value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Worker {
    pub index: u32,
    pub id: u32,
    pub state: WorkerState,
    pub active_requests: u32,
    pub queued_prefill_tokens: u32,
    pub kv_blocks_used: u32,
    pub kv_blocks_total: u32,
    /// Blocks of this request's prompt already cached on the worker.
    pub overlap_blocks: u32,
}

impl FleetView {
    /// Number of workers (the length of every list).
    pub fn len(&self) -> usize {
        self.state.len()
    }

    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    /// Worker `i`; `None` past the end.
    pub fn worker(&self, i: usize) -> Option<Worker> {
        Some(Worker {
            index: i as u32,
            id: *self.worker_ids.get(i)?,
            state: WorkerState(*self.state.get(i)?),
            active_requests: *self.active_requests.get(i)?,
            queued_prefill_tokens: *self.queued_prefill_tokens.get(i)?,
            kv_blocks_used: *self.kv_blocks_used.get(i)?,
            kv_blocks_total: *self.kv_blocks_total.get(i)?,
            overlap_blocks: *self.overlap_blocks.get(i)?,
        })
    }

    /// Every worker, in index order.
    pub fn workers(&self) -> impl Iterator<Item = Worker> + '_ {
        (0..self.len()).filter_map(|i| self.worker(i))
    }

    /// Indexes of the healthy workers that can serve `hop`.
    pub fn eligible(&self, hop: Hop) -> impl Iterator<Item = u32> + '_ {
        self.state
            .iter()
            .enumerate()
            .filter(move |(_, s)| WorkerState(**s).serves(hop))
            .map(|(i, _)| i as u32)
    }

    /// The index of the worker with this id, if it is in the fleet.
    pub fn index_of(&self, id: u32) -> Option<u32> {
        self.worker_ids
            .iter()
            .position(|&w| w == id)
            .map(|i| i as u32)
    }
}

impl Worker {
    /// An idle, healthy worker that does prefill and decode, with 1,000 KV blocks;
    /// the starting point of test fleets (see [`crate::testing`]).
    pub fn idle(id: u32) -> Worker {
        Worker {
            index: 0,
            id,
            state: WorkerState::new(true, true, true),
            active_requests: 0,
            queued_prefill_tokens: 0,
            kv_blocks_used: 0,
            kv_blocks_total: 1000,
            overlap_blocks: 0,
        }
    }
}

impl FromIterator<Worker> for FleetView {
    /// Builds a fleet from workers; their `index` fields are ignored (position wins).
    fn from_iter<I: IntoIterator<Item = Worker>>(workers: I) -> FleetView {
        let mut fleet = FleetView {
            state: Vec::new(),
            worker_ids: Vec::new(),
            active_requests: Vec::new(),
            queued_prefill_tokens: Vec::new(),
            kv_blocks_used: Vec::new(),
            kv_blocks_total: Vec::new(),
            overlap_blocks: Vec::new(),
        };
        for w in workers {
            fleet.state.push(w.state.0);
            fleet.worker_ids.push(w.id);
            fleet.active_requests.push(w.active_requests);
            fleet.queued_prefill_tokens.push(w.queued_prefill_tokens);
            fleet.kv_blocks_used.push(w.kv_blocks_used);
            fleet.kv_blocks_total.push(w.kv_blocks_total);
            fleet.overlap_blocks.push(w.overlap_blocks);
        }
        fleet
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_bits_round_trip_and_gate_hops() {
        let both = WorkerState::new(true, true, true);
        assert!(both.serves(Hop::Aggregated) && both.serves(Hop::Prefill));
        let prefill = WorkerState::new(true, true, false);
        assert!(prefill.serves(Hop::Prefill) && !prefill.serves(Hop::Aggregated));
        assert!(!prefill.serves(Hop::Decode));
        let sick = WorkerState::new(false, true, true);
        assert!(!sick.serves(Hop::Aggregated));
        assert_eq!(WorkerState::new(true, false, true).0, 0b101);
    }

    #[test]
    fn fleet_round_trips_workers() {
        let mut b = Worker::idle(7);
        b.overlap_blocks = 3;
        b.state = WorkerState::new(false, true, true);
        let fleet: FleetView = [Worker::idle(5), b].into_iter().collect();
        assert_eq!(fleet.len(), 2);
        let got = fleet.worker(1).unwrap();
        assert_eq!((got.index, got.id, got.overlap_blocks), (1, 7, 3));
        assert_eq!(fleet.eligible(Hop::Aggregated).collect::<Vec<_>>(), vec![0]);
        assert_eq!(fleet.index_of(7), Some(1));
        assert!(fleet.worker(2).is_none());
    }
}
