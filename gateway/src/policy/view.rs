//! Views of a request and the fleet, and the decisions policies return.

/// Which hop of a request is being routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Hop {
    /// One worker does prefill and decode.
    Aggregated,
    /// The prefill hop of a disaggregated request.
    Prefill,
    /// The decode hop of a disaggregated request.
    Decode,
}

/// What the gateway knows about one request before it reaches a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestView {
    pub prompt_tokens: u32,
    /// Whole KV blocks in the prompt.
    pub prompt_blocks: u32,
    pub block_size: u32,
    pub max_tokens: u32,
    /// Hash of the session id; 0 = none.
    pub session_hash: u64,
    /// 0 = anonymous.
    pub tenant_id: u32,
    /// Higher is more important; 0 = normal.
    pub priority: i32,
    pub hop: Hop,
}

/// A worker's state bits, as `wit/policy.wit` defines them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerState(pub u8);

impl WorkerState {
    pub const HEALTHY: u8 = 1;
    pub const CAN_PREFILL: u8 = 2;
    pub const CAN_DECODE: u8 = 4;

    pub const fn new(healthy: bool, can_prefill: bool, can_decode: bool) -> Self {
        Self(
            if healthy { Self::HEALTHY } else { 0 }
                | if can_prefill { Self::CAN_PREFILL } else { 0 }
                | if can_decode { Self::CAN_DECODE } else { 0 },
        )
    }

    /// Healthy and able to serve `hop` (an aggregated hop needs both roles).
    pub fn serves(self, hop: Hop) -> bool {
        let needs = match hop {
            Hop::Aggregated => Self::CAN_PREFILL | Self::CAN_DECODE,
            Hop::Prefill => Self::CAN_PREFILL,
            Hop::Decode => Self::CAN_DECODE,
        };
        self.0 & Self::HEALTHY != 0 && self.0 & needs == needs
    }
}

/// One worker's entry in a [`FleetView`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    pub state: WorkerState,
    /// Stable gateway id, never reused.
    pub id: u32,
    pub active_requests: u32,
    pub queued_prefill_tokens: u32,
    /// Blocks held by running requests.
    pub kv_blocks_used: u32,
    pub kv_blocks_total: u32,
    /// Blocks of this request's prompt already cached on the worker.
    pub overlap_blocks: u32,
}

/// The candidate workers as struct-of-arrays packed into one buffer, exactly as
/// `wit/policy.wit` lays out `fleet-view`: seven columns of `len()` entries.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetView {
    workers: usize,
    columns: Vec<u32>,
}

/// Column numbers in [`FleetView`]'s buffer (the WIT contract's order).
mod column {
    pub const STATE: usize = 0;
    pub const WORKER_ID: usize = 1;
    pub const ACTIVE_REQUESTS: usize = 2;
    pub const QUEUED_PREFILL_TOKENS: usize = 3;
    pub const KV_BLOCKS_USED: usize = 4;
    pub const KV_BLOCKS_TOTAL: usize = 5;
    pub const OVERLAP_BLOCKS: usize = 6;
    pub const COUNT: usize = 7;
}

impl FleetView {
    /// The fleet of `workers`, in order.
    pub fn from_workers(workers: &[WorkerLoad]) -> Self {
        let n = workers.len();
        let mut columns = vec![0; n * column::COUNT];
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
        Self {
            workers: n,
            columns,
        }
    }

    /// A fleet from its packed buffer (as [`FleetView::columns`] gives it);
    /// `None` when the buffer is not `workers` times the columns long.
    pub fn from_columns(workers: usize, columns: Vec<u32>) -> Option<Self> {
        (columns.len() == workers.checked_mul(column::COUNT)?).then_some(Self { workers, columns })
    }

    pub fn len(&self) -> usize {
        self.workers
    }

    pub fn is_empty(&self) -> bool {
        self.workers == 0
    }

    /// The packed buffer, as the WIT contract lays it out.
    pub fn columns(&self) -> &[u32] {
        &self.columns
    }

    fn column(&self, c: usize) -> &[u32] {
        &self.columns[c * self.workers..(c + 1) * self.workers]
    }

    /// [`WorkerState`] bits, one per worker.
    pub fn state(&self) -> &[u32] {
        self.column(column::STATE)
    }
    pub fn worker_ids(&self) -> &[u32] {
        self.column(column::WORKER_ID)
    }
    pub fn active_requests(&self) -> &[u32] {
        self.column(column::ACTIVE_REQUESTS)
    }
    pub fn queued_prefill_tokens(&self) -> &[u32] {
        self.column(column::QUEUED_PREFILL_TOKENS)
    }
    pub fn kv_blocks_used(&self) -> &[u32] {
        self.column(column::KV_BLOCKS_USED)
    }
    pub fn kv_blocks_total(&self) -> &[u32] {
        self.column(column::KV_BLOCKS_TOTAL)
    }
    pub fn overlap_blocks(&self) -> &[u32] {
        self.column(column::OVERLAP_BLOCKS)
    }

    /// The overlap column, to fill in per request from the KV index.
    pub fn overlap_blocks_mut(&mut self) -> &mut [u32] {
        let n = self.workers;
        &mut self.columns[column::OVERLAP_BLOCKS * n..(column::OVERLAP_BLOCKS + 1) * n]
    }

    /// Worker `i`; `None` past the end.
    pub fn worker(&self, i: usize) -> Option<WorkerLoad> {
        (i < self.workers).then(|| {
            let at = |c: usize| self.columns[c * self.workers + i];
            WorkerLoad {
                state: WorkerState(at(column::STATE) as u8),
                id: at(column::WORKER_ID),
                active_requests: at(column::ACTIVE_REQUESTS),
                queued_prefill_tokens: at(column::QUEUED_PREFILL_TOKENS),
                kv_blocks_used: at(column::KV_BLOCKS_USED),
                kv_blocks_total: at(column::KV_BLOCKS_TOTAL),
                overlap_blocks: at(column::OVERLAP_BLOCKS),
            }
        })
    }

    /// Worker `i` can serve the request's hop.
    pub fn serves(&self, i: usize, hop: Hop) -> bool {
        i < self.workers && WorkerState(self.state()[i] as u8).serves(hop)
    }
}

/// A refusal, answered to the client as an OpenAI-style error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    /// 400..=599.
    pub status: u16,
    pub message: String,
}

impl Rejection {
    /// The longest message a plugin may return, in bytes.
    pub const MAX_MESSAGE_BYTES: usize = 1024;

    /// Why this rejection would be refused from a plugin, if it would.
    pub fn problem(&self) -> Option<String> {
        if !(400..=599).contains(&self.status) {
            return Some(format!("rejection status {} is not 400..=599", self.status));
        }
        if self.message.len() > Self::MAX_MESSAGE_BYTES {
            return Some(format!(
                "rejection message of {} bytes is over {}",
                self.message.len(),
                Self::MAX_MESSAGE_BYTES
            ));
        }
        None
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RouteDecision {
    /// Send the request to this index of the fleet view.
    Worker(usize),
    Reject(Rejection),
}

/// How loaded the whole fleet is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FleetSaturation {
    pub healthy_workers: u32,
    pub active_requests: u32,
    pub queued_requests: u32,
    pub queued_prefill_tokens: u64,
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AdmitDecision {
    Admit,
    /// Hold in the gateway's queue with this priority (higher leaves first).
    Queue(i32),
    Reject(Rejection),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Success,
    Failed,
    Cancelled,
    Rejected,
}

/// One finished request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    pub tenant_id: u32,
    pub session_hash: u64,
    pub priority: i32,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub output_tokens: u32,
    pub outcome: Outcome,
    pub duration_us: u64,
}

/// Cache hints for a request's prompt prefix.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheHints {
    /// Mixed into the first block hash; 0 = shared.
    pub salt: u64,
    pub retention_priority: u8,
    /// 0 = no floor.
    pub ttl_ms: u32,
    pub write_host_tier: bool,
}

/// Eviction candidates as struct-of-arrays.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvictionCandidates {
    pub age_ms: Vec<u32>,
    pub hits: Vec<u32>,
    pub priority: Vec<u8>,
    pub tenant_id: Vec<u32>,
}

impl EvictionCandidates {
    pub fn len(&self) -> usize {
        self.age_ms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.age_ms.is_empty()
    }
}
