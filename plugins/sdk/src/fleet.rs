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
            if healthy { HEALTHY } else { 0 }
                | if can_prefill { CAN_PREFILL } else { 0 }
                | if can_decode { CAN_DECODE } else { 0 },
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

/// Column numbers in `FleetView::columns` (the WIT contract's order).
const STATE: usize = 0;
const WORKER_ID: usize = 1;
const ACTIVE_REQUESTS: usize = 2;
const QUEUED_PREFILL_TOKENS: usize = 3;
const KV_BLOCKS_USED: usize = 4;
const KV_BLOCKS_TOTAL: usize = 5;
const OVERLAP_BLOCKS: usize = 6;
const COLUMNS: usize = 7;

impl FleetView {
    /// Number of workers.
    pub fn len(&self) -> usize {
        self.workers as usize
    }

    pub fn is_empty(&self) -> bool {
        self.workers == 0
    }

    /// Column `c` (empty if the host sent a short buffer, which it never does).
    fn column(&self, c: usize) -> &[u32] {
        let n = self.len();
        self.columns.get(c * n..(c + 1) * n).unwrap_or(&[])
    }

    /// State bits per worker (see [`WorkerState`]).
    pub fn state(&self) -> &[u32] {
        self.column(STATE)
    }
    /// The gateway's stable id of each worker.
    pub fn worker_ids(&self) -> &[u32] {
        self.column(WORKER_ID)
    }
    pub fn active_requests(&self) -> &[u32] {
        self.column(ACTIVE_REQUESTS)
    }
    pub fn queued_prefill_tokens(&self) -> &[u32] {
        self.column(QUEUED_PREFILL_TOKENS)
    }
    pub fn kv_blocks_used(&self) -> &[u32] {
        self.column(KV_BLOCKS_USED)
    }
    pub fn kv_blocks_total(&self) -> &[u32] {
        self.column(KV_BLOCKS_TOTAL)
    }
    /// Blocks of this request's prompt already cached on each worker.
    pub fn overlap_blocks(&self) -> &[u32] {
        self.column(OVERLAP_BLOCKS)
    }

    /// Worker `i`; `None` past the end.
    pub fn worker(&self, i: usize) -> Option<Worker> {
        let at = |c: usize| self.column(c).get(i).copied();
        Some(Worker {
            index: i as u32,
            id: at(WORKER_ID)?,
            state: WorkerState(at(STATE)? as u8),
            active_requests: at(ACTIVE_REQUESTS)?,
            queued_prefill_tokens: at(QUEUED_PREFILL_TOKENS)?,
            kv_blocks_used: at(KV_BLOCKS_USED)?,
            kv_blocks_total: at(KV_BLOCKS_TOTAL)?,
            overlap_blocks: at(OVERLAP_BLOCKS)?,
        })
    }

    /// Every worker, in index order.
    pub fn workers(&self) -> impl Iterator<Item = Worker> + '_ {
        (0..self.len()).filter_map(|i| self.worker(i))
    }

    /// Indexes of the healthy workers that can serve `hop`.
    pub fn eligible(&self, hop: Hop) -> impl Iterator<Item = u32> + '_ {
        self.state()
            .iter()
            .enumerate()
            .filter(move |(_, s)| WorkerState(**s as u8).serves(hop))
            .map(|(i, _)| i as u32)
    }

    /// The index of the worker with this id, if it is in the fleet.
    pub fn index_of(&self, id: u32) -> Option<u32> {
        self.worker_ids()
            .iter()
            .position(|&w| w == id)
            .map(|i| i as u32)
    }

    /// Sets worker `i`'s state bits (for tests that change a fleet in place).
    pub fn set_state(&mut self, i: usize, state: WorkerState) {
        let n = self.len();
        self.columns[STATE * n + i] = u32::from(state.0);
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
        let workers: Vec<Worker> = workers.into_iter().collect();
        let n = workers.len();
        let mut columns = vec![0; n * COLUMNS];
        for (i, w) in workers.iter().enumerate() {
            let fields = [
                u32::from(w.state.0),
                w.id,
                w.active_requests,
                w.queued_prefill_tokens,
                w.kv_blocks_used,
                w.kv_blocks_total,
                w.overlap_blocks,
            ];
            for (c, value) in fields.into_iter().enumerate() {
                columns[c * n + i] = value;
            }
        }
        FleetView {
            workers: n as u32,
            columns,
        }
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
