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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerState(pub u8);

impl WorkerState {
    pub const HEALTHY: u8 = 1;
    pub const CAN_PREFILL: u8 = 2;
    pub const CAN_DECODE: u8 = 4;

    pub const fn new(healthy: bool, can_prefill: bool, can_decode: bool) -> Self {
        Self(
            (healthy as u8) * Self::HEALTHY
                | (can_prefill as u8) * Self::CAN_PREFILL
                | (can_decode as u8) * Self::CAN_DECODE,
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

/// The candidate workers as struct-of-arrays: entry `i` of each column is worker `i`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetView {
    /// [`WorkerState`] bits.
    pub state: Vec<u8>,
    /// Stable gateway ids, never reused.
    pub worker_ids: Vec<u32>,
    pub active_requests: Vec<u32>,
    pub queued_prefill_tokens: Vec<u32>,
    /// Blocks held by running requests.
    pub kv_blocks_used: Vec<u32>,
    pub kv_blocks_total: Vec<u32>,
    /// Blocks of this request's prompt already cached on each worker.
    pub overlap_blocks: Vec<u32>,
}

impl FleetView {
    pub fn len(&self) -> usize {
        self.state.len()
    }

    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }

    /// True when every column has one entry per worker.
    pub fn is_consistent(&self) -> bool {
        let n = self.len();
        [
            self.worker_ids.len(),
            self.active_requests.len(),
            self.queued_prefill_tokens.len(),
            self.kv_blocks_used.len(),
            self.kv_blocks_total.len(),
            self.overlap_blocks.len(),
        ]
        .iter()
        .all(|&len| len == n)
    }

    /// Worker `i` can serve the request's hop.
    pub fn serves(&self, i: usize, hop: Hop) -> bool {
        self.state
            .get(i)
            .is_some_and(|&s| WorkerState(s).serves(hop))
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
