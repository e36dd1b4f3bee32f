//! The canonical-ABI mirrors of `wit/policy.wit`'s types, and their conversions to
//! and from `crate::policy`. Arguments are lowered from borrowed slices, so a call
//! copies the fleet straight from the gateway's columns into guest memory.

use wasmtime::component::{ComponentType, Lift, Lower};

use crate::policy;

#[derive(ComponentType, Lower, Clone, Copy)]
#[component(enum)]
#[repr(u8)]
pub enum Hop {
    #[component(name = "aggregated")]
    Aggregated,
    #[component(name = "prefill")]
    Prefill,
    #[component(name = "decode")]
    Decode,
}

#[derive(ComponentType, Lower, Clone, Copy)]
#[component(record)]
pub struct RequestView {
    #[component(name = "prompt-tokens")]
    prompt_tokens: u32,
    #[component(name = "prompt-blocks")]
    prompt_blocks: u32,
    #[component(name = "block-size")]
    block_size: u32,
    #[component(name = "max-tokens")]
    max_tokens: u32,
    #[component(name = "session-hash")]
    session_hash: u64,
    #[component(name = "tenant-id")]
    tenant_id: u32,
    #[component(name = "priority")]
    priority: i32,
    #[component(name = "hop")]
    hop: Hop,
}

impl From<&policy::RequestView> for RequestView {
    fn from(r: &policy::RequestView) -> Self {
        Self {
            prompt_tokens: r.prompt_tokens,
            prompt_blocks: r.prompt_blocks,
            block_size: r.block_size,
            max_tokens: r.max_tokens,
            session_hash: r.session_hash,
            tenant_id: r.tenant_id,
            priority: r.priority,
            hop: match r.hop {
                policy::Hop::Aggregated => Hop::Aggregated,
                policy::Hop::Prefill => Hop::Prefill,
                policy::Hop::Decode => Hop::Decode,
            },
        }
    }
}

#[derive(ComponentType, Lower)]
#[component(record)]
pub struct FleetView<'a> {
    #[component(name = "workers")]
    workers: u32,
    #[component(name = "columns")]
    columns: &'a [u32],
}

impl<'a> From<&'a policy::FleetView> for FleetView<'a> {
    fn from(f: &'a policy::FleetView) -> Self {
        Self {
            workers: f.len() as u32,
            columns: f.columns(),
        }
    }
}

#[derive(ComponentType, Lift, Debug)]
#[component(record)]
pub struct Rejection {
    #[component(name = "status")]
    status: u16,
    #[component(name = "message")]
    message: String,
}

impl From<Rejection> for policy::Rejection {
    fn from(r: Rejection) -> Self {
        Self {
            status: r.status,
            message: r.message,
        }
    }
}

/// The router's answer before the host resolves `UseDefault`.
#[derive(ComponentType, Lift, Debug)]
#[component(variant)]
pub enum RouteDecision {
    #[component(name = "worker")]
    Worker(u32),
    #[component(name = "use-default")]
    UseDefault,
    #[component(name = "reject")]
    Reject(Rejection),
}

#[derive(ComponentType, Lower, Clone, Copy)]
#[component(record)]
pub struct FleetSaturation {
    #[component(name = "healthy-workers")]
    healthy_workers: u32,
    #[component(name = "active-requests")]
    active_requests: u32,
    #[component(name = "queued-requests")]
    queued_requests: u32,
    #[component(name = "queued-prefill-tokens")]
    queued_prefill_tokens: u64,
    #[component(name = "kv-blocks-used")]
    kv_blocks_used: u64,
    #[component(name = "kv-blocks-total")]
    kv_blocks_total: u64,
}

impl From<&policy::FleetSaturation> for FleetSaturation {
    fn from(s: &policy::FleetSaturation) -> Self {
        Self {
            healthy_workers: s.healthy_workers,
            active_requests: s.active_requests,
            queued_requests: s.queued_requests,
            queued_prefill_tokens: s.queued_prefill_tokens,
            kv_blocks_used: s.kv_blocks_used,
            kv_blocks_total: s.kv_blocks_total,
        }
    }
}

#[derive(ComponentType, Lift, Debug)]
#[component(variant)]
pub enum AdmitDecision {
    #[component(name = "admit")]
    Admit,
    #[component(name = "queue")]
    Queue(i32),
    #[component(name = "reject")]
    Reject(Rejection),
}

impl From<AdmitDecision> for policy::AdmitDecision {
    fn from(d: AdmitDecision) -> Self {
        match d {
            AdmitDecision::Admit => Self::Admit,
            AdmitDecision::Queue(p) => Self::Queue(p),
            AdmitDecision::Reject(r) => Self::Reject(r.into()),
        }
    }
}

#[derive(ComponentType, Lower, Clone, Copy)]
#[component(enum)]
#[repr(u8)]
pub enum Outcome {
    #[component(name = "success")]
    Success,
    #[component(name = "failed")]
    Failed,
    #[component(name = "cancelled")]
    Cancelled,
    #[component(name = "rejected")]
    Rejected,
}

#[derive(ComponentType, Lower, Clone, Copy)]
#[component(record)]
pub struct Completion {
    #[component(name = "tenant-id")]
    tenant_id: u32,
    #[component(name = "session-hash")]
    session_hash: u64,
    #[component(name = "priority")]
    priority: i32,
    #[component(name = "prompt-tokens")]
    prompt_tokens: u32,
    #[component(name = "cached-tokens")]
    cached_tokens: u32,
    #[component(name = "output-tokens")]
    output_tokens: u32,
    #[component(name = "outcome")]
    outcome: Outcome,
    #[component(name = "duration-us")]
    duration_us: u64,
}

impl From<&policy::Completion> for Completion {
    fn from(c: &policy::Completion) -> Self {
        Self {
            tenant_id: c.tenant_id,
            session_hash: c.session_hash,
            priority: c.priority,
            prompt_tokens: c.prompt_tokens,
            cached_tokens: c.cached_tokens,
            output_tokens: c.output_tokens,
            outcome: match c.outcome {
                policy::Outcome::Success => Outcome::Success,
                policy::Outcome::Failed => Outcome::Failed,
                policy::Outcome::Cancelled => Outcome::Cancelled,
                policy::Outcome::Rejected => Outcome::Rejected,
            },
            duration_us: c.duration_us,
        }
    }
}

#[derive(ComponentType, Lift, Clone, Copy, Debug)]
#[component(record)]
pub struct CacheHints {
    #[component(name = "salt")]
    salt: u64,
    #[component(name = "retention-priority")]
    retention_priority: u8,
    #[component(name = "ttl-ms")]
    ttl_ms: u32,
    #[component(name = "write-host-tier")]
    write_host_tier: bool,
}

impl From<CacheHints> for policy::CacheHints {
    fn from(h: CacheHints) -> Self {
        Self {
            salt: h.salt,
            retention_priority: h.retention_priority,
            ttl_ms: h.ttl_ms,
            write_host_tier: h.write_host_tier,
        }
    }
}

#[derive(ComponentType, Lower)]
#[component(record)]
pub struct EvictionCandidates<'a> {
    #[component(name = "age-ms")]
    age_ms: &'a [u32],
    #[component(name = "hits")]
    hits: &'a [u32],
    #[component(name = "priority")]
    priority: &'a [u8],
    #[component(name = "tenant-id")]
    tenant_id: &'a [u32],
}

impl<'a> From<&'a policy::EvictionCandidates> for EvictionCandidates<'a> {
    fn from(c: &'a policy::EvictionCandidates) -> Self {
        Self {
            age_ms: &c.age_ms,
            hits: &c.hits,
            priority: &c.priority,
            tenant_id: &c.tenant_id,
        }
    }
}

/// `host.level`, lifted from the guest's `log` calls.
#[allow(dead_code, reason = "variants are made by lifting guest values")]
#[derive(ComponentType, Lift, Clone, Copy, Debug, PartialEq, Eq)]
#[component(enum)]
#[repr(u8)]
pub enum Level {
    #[component(name = "debug")]
    Debug,
    #[component(name = "info")]
    Info,
    #[component(name = "warn")]
    Warn,
    #[component(name = "error")]
    Error,
}
