//! The fleet: the workers the gateway knows (static, self-registered or
//! embedded), each one's health and load, and the KV index their events feed.
//! Requests read the worker list without a lock (arc-swap) and the index
//! under a read lock ([`Fleet::candidates`]); one monitor task per worker
//! ([`super::monitor`]) writes them.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use arc_swap::ArcSwap;
use sluice_backend::engine::Load;
use sluice_backend::transfer::Role;

use super::approx::Predicted;
use super::kv_index::KvIndex;
use crate::config::{FleetConfig, WorkerKind};
use crate::policy::{FleetSaturation, FleetView, Hop, WorkerLoad, WorkerState};

/// How the gateway came to know a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// Listed in the config: kept (and retried) while it is down.
    Static,
    /// Registered itself: forgotten when it has been unreachable too long.
    Registered,
    /// Runs inside the gateway's process.
    Embedded,
}

/// What kind of server a worker is, and how to address it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Upstream {
    pub kind: WorkerKind,
    /// The engine's data-parallel rank this entry stands for (one entry per
    /// rank: each caches on its own).
    pub dp_rank: Option<u32>,
    /// Sent as a bearer token.
    pub api_key: Option<String>,
    /// Its engine's KV events feed the index (`engine_events`).
    pub kv_events: bool,
}

/// One worker as the gateway sees it.
#[derive(Debug)]
pub struct Worker {
    /// Never reused.
    pub id: u32,
    /// Base URL, without a trailing slash.
    pub url: String,
    pub origin: Origin,
    pub upstream: Upstream,
    /// Whether its cached blocks in the index are what it reported (its
    /// events are heard, from a known start); otherwise the gateway predicts
    /// them from its routing (approximate mode).
    exact: AtomicBool,
    healthy: AtomicBool,
    /// Set when the worker is removed; its monitor stops.
    removed: AtomicBool,
    /// Requests this gateway has running there now.
    pub in_flight: AtomicU32,
    /// KV blocks those requests' prompts take there (exact and immediate,
    /// where the worker's own report is up to 250 ms old).
    pub in_flight_blocks: AtomicU32,
    /// Prompt tokens of those requests that were not cached there and whose
    /// first token has not come back: the prefill queued ahead of a new one.
    pub pending_prefill_tokens: AtomicU32,
    /// Requests routed there, ever.
    pub routed: AtomicU64,
    /// The worker's last reported load.
    load: Mutex<Load>,
    /// Its role in a disaggregated fleet, from its `/health`.
    role: Mutex<Role>,
    /// When the worker last registered (or was added).
    registered_at: Mutex<Instant>,
    /// Where its token API is, from its URL once (or why it does not split).
    endpoint: Result<Endpoint, String>,
}

impl Worker {
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    pub fn is_removed(&self) -> bool {
        self.removed.load(Ordering::Acquire)
    }

    pub fn load(&self) -> Load {
        *self.load.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_load(&self, load: Load) {
        *self.load.lock().unwrap_or_else(|e| e.into_inner()) = load;
    }

    pub fn role(&self) -> Role {
        *self.role.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn set_role(&self, role: Role) {
        *self.role.lock().unwrap_or_else(|e| e.into_inner()) = role;
    }

    /// Its state bits for a fleet view (it is healthy: only healthy workers
    /// are candidates).
    fn state(&self) -> WorkerState {
        let role = self.role();
        WorkerState::new(true, role.can_prefill(), role.can_decode())
    }

    pub fn registered_at(&self) -> Instant {
        *self.registered_at.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn kind(&self) -> WorkerKind {
        self.upstream.kind
    }

    /// Whether the index holds what it reported (not predictions).
    pub fn is_exact(&self) -> bool {
        self.exact.load(Ordering::Acquire)
    }

    /// How its name reads in logs and `/admin/workers`: the URL, and the
    /// rank for one rank of a data-parallel engine.
    pub fn label(&self) -> String {
        match self.upstream.dp_rank {
            Some(r) => format!("{}#dp{r}", self.url),
            None => self.url.clone(),
        }
    }

    /// Where a sluice worker takes token ids, from its URL when the worker
    /// was added (a request then parses and formats nothing).
    pub fn endpoint(&self) -> Result<&Endpoint, &str> {
        self.endpoint.as_ref().map_err(String::as_str)
    }
}

/// A sluice worker's token API: the address to connect to and the paths of
/// its generate and prefill calls (behind its URL's path prefix, if any).
#[derive(Debug)]
pub struct Endpoint {
    pub authority: String,
    pub generate_path: String,
    pub prefill_path: String,
}

impl Endpoint {
    fn of(url: &str) -> Result<Self, String> {
        let (authority, prefix) =
            crate::upstream::conn::split_url(url).map_err(|e| e.to_string())?;
        Ok(Endpoint {
            authority: authority.to_string(),
            generate_path: format!("{prefix}/internal/generate"),
            prefill_path: format!("{prefix}/internal/prefill"),
        })
    }
}

/// A prompt's block hashes as each kind of worker is indexed by; `None`:
/// the request cannot go to workers of that kind. Sluice workers hash with
/// the request's cache salt (they apply it); OpenAI workers' blocks are
/// hashed by the gateway from their events' token ids, unsalted.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptKeys {
    pub sluice: Option<Vec<u64>>,
    pub openai: Option<Vec<u64>>,
}

impl PromptKeys {
    /// Keys for sluice workers only.
    pub fn sluice(hashes: Vec<u64>) -> Self {
        Self {
            sluice: Some(hashes),
            openai: None,
        }
    }

    pub fn of(&self, kind: WorkerKind) -> Option<&[u64]> {
        match kind {
            WorkerKind::Sluice => self.sluice.as_deref(),
            WorkerKind::Openai => self.openai.as_deref(),
        }
    }
}

/// What `GET /admin/workers` shows of a worker.
#[derive(Debug, serde::Serialize)]
pub struct WorkerStatus {
    pub id: u32,
    pub url: String,
    pub origin: Origin,
    pub kind: WorkerKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_rank: Option<u32>,
    /// `events` (the index holds what it reported) or `approximate`.
    pub kv_mode: &'static str,
    pub healthy: bool,
    pub role: Role,
    pub in_flight: u32,
    pub routed: u64,
    pub cached_blocks: usize,
    pub load: Load,
}

/// The workers and the KV index.
#[derive(Debug)]
pub struct Fleet {
    workers: ArcSwap<Vec<Arc<Worker>>>,
    /// Serializes changes to `workers`.
    changing: Mutex<()>,
    index: RwLock<KvIndex>,
    /// Approximate-mode predictions, per worker (lock before `index`).
    predicted: Mutex<std::collections::HashMap<u32, Predicted>>,
    /// How long and how many predictions live.
    pub approximate: Approximate,
    next_id: AtomicU32,
    pub config: FleetConfig,
    pub block_size: u32,
}

/// The workers a request may go to, and the view the router sees of them
/// (same order).
#[derive(Debug)]
pub struct Candidates {
    pub workers: Vec<Arc<Worker>>,
    pub view: FleetView,
}

/// Approximate mode's limits.
#[derive(Clone, Copy, Debug)]
pub struct Approximate {
    pub ttl: std::time::Duration,
    pub max_blocks: usize,
}

impl Default for Approximate {
    fn default() -> Self {
        Self {
            ttl: std::time::Duration::from_secs(120),
            max_blocks: 1 << 20,
        }
    }
}

impl Fleet {
    pub fn new(config: FleetConfig, block_size: u32) -> Self {
        Self {
            workers: ArcSwap::from_pointee(Vec::new()),
            changing: Mutex::new(()),
            index: RwLock::new(KvIndex::new()),
            predicted: Mutex::new(std::collections::HashMap::new()),
            approximate: Approximate::default(),
            next_id: AtomicU32::new(1),
            config,
            block_size,
        }
    }

    /// Adds a sluice worker, or (same URL) refreshes its registration.
    /// Returns it and whether it is new (a new worker needs a monitor).
    pub fn add(&self, url: &str, origin: Origin) -> (Arc<Worker>, bool) {
        self.add_upstream(url, origin, Upstream::default())
    }

    /// Adds a worker of any kind (one rank of a data-parallel engine is a
    /// worker of its own), or refreshes the one with the same URL and rank.
    pub fn add_upstream(
        &self,
        url: &str,
        origin: Origin,
        upstream: Upstream,
    ) -> (Arc<Worker>, bool) {
        let url = url.trim_end_matches('/');
        let _guard = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.workers.load_full();
        if let Some(w) = current
            .iter()
            .find(|w| w.url == url && w.upstream.dp_rank == upstream.dp_rank)
        {
            *w.registered_at.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
            return (w.clone(), false);
        }
        let worker = Arc::new(Worker {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            url: url.to_string(),
            origin,
            // Sluice workers resync from a snapshot: always exact. Others
            // are approximate until their events are heard from a known start.
            exact: AtomicBool::new(upstream.kind == WorkerKind::Sluice),
            upstream,
            healthy: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            in_flight: AtomicU32::new(0),
            in_flight_blocks: AtomicU32::new(0),
            pending_prefill_tokens: AtomicU32::new(0),
            routed: AtomicU64::new(0),
            load: Mutex::new(Load::default()),
            role: Mutex::new(Role::Both),
            registered_at: Mutex::new(Instant::now()),
            endpoint: Endpoint::of(url),
        });
        let mut next = (*current).clone();
        next.push(worker.clone());
        self.workers.store(Arc::new(next));
        tracing::info!(worker = worker.id, url = %worker.label(), kind = ?worker.kind(), ?origin, "worker added");
        (worker, true)
    }

    /// Forgets a worker; its monitor stops. False if it was not known.
    pub fn remove(&self, id: u32) -> bool {
        let _guard = self.changing.lock().unwrap_or_else(|e| e.into_inner());
        let current = self.workers.load_full();
        let Some(worker) = current.iter().find(|w| w.id == id) else {
            return false;
        };
        worker.removed.store(true, Ordering::Release);
        worker.healthy.store(false, Ordering::Release);
        let next: Vec<_> = current.iter().filter(|w| w.id != id).cloned().collect();
        self.workers.store(Arc::new(next));
        self.forget_blocks(id);
        tracing::info!(worker = id, url = %worker.label(), "worker removed");
        true
    }

    pub fn get(&self, id: u32) -> Option<Arc<Worker>> {
        self.workers.load().iter().find(|w| w.id == id).cloned()
    }

    pub fn workers(&self) -> Arc<Vec<Arc<Worker>>> {
        self.workers.load_full()
    }

    /// Marks a worker in or out of service; taking it out forgets its
    /// blocks, except those its engine's KV events keep (a failed health
    /// check does not empty a cache; a restarted engine's publisher says so).
    pub fn set_healthy(&self, worker: &Worker, healthy: bool) {
        let was = worker.healthy.swap(healthy, Ordering::AcqRel);
        if was != healthy {
            if healthy {
                tracing::info!(worker = worker.id, url = %worker.label(), "worker in service");
            } else {
                if !worker.upstream.kv_events {
                    self.forget_blocks(worker.id);
                }
                tracing::warn!(worker = worker.id, url = %worker.label(), "worker out of service");
            }
        }
    }

    /// Forgets a worker's blocks, reported and predicted.
    fn forget_blocks(&self, worker: u32) {
        let mut predicted = self.predicted();
        predicted.remove(&worker);
        self.index_mut().clear_worker(worker);
    }

    fn predicted(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u32, Predicted>> {
        self.predicted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Approximate mode: a request with these blocks was routed to `worker`;
    /// they count as cached there (until the TTL after their last use).
    /// Nothing for a worker whose events are heard.
    pub fn predict(&self, worker: &Worker, hashes: &[u64]) {
        if worker.is_exact() || hashes.is_empty() {
            return;
        }
        let now = Instant::now();
        let mut predicted = self.predicted();
        let p = predicted.entry(worker.id).or_default();
        let new = p.touch(hashes, now);
        let gone = p.expire(now, self.approximate.ttl, self.approximate.max_blocks);
        let mut index = self.index_mut();
        // A worker removed meanwhile has had its blocks cleared: add none.
        if worker.is_removed() {
            return;
        }
        index.store(worker.id, &new);
        index.remove(worker.id, &gone);
    }

    /// Drops a worker's expired predictions (its monitor calls this).
    pub fn expire_predictions(&self, worker: u32) {
        let mut predicted = self.predicted();
        let Some(p) = predicted.get_mut(&worker) else {
            return;
        };
        let gone = p.expire(
            Instant::now(),
            self.approximate.ttl,
            self.approximate.max_blocks,
        );
        if !gone.is_empty() {
            self.index_mut().remove(worker, &gone);
        }
    }

    /// Switches a worker between exact (its events are heard from a known
    /// start) and approximate mode. Into approximate mode, what the index
    /// holds of it becomes predictions (they expire unless routed to again);
    /// into exact mode, predictions are dropped and the index holds
    /// `exact_blocks`.
    pub fn set_exact(&self, worker: &Worker, exact: Option<&[u64]>) {
        let mut predicted = self.predicted();
        let mut index = self.index_mut();
        match exact {
            Some(blocks) => {
                predicted.remove(&worker.id);
                if !worker.is_removed() {
                    index.replace_worker(worker.id, blocks);
                }
                if !worker.exact.swap(true, Ordering::AcqRel) {
                    tracing::info!(worker = worker.id, url = %worker.label(), blocks = blocks.len(), "KV events heard: exact mode");
                }
            }
            None => {
                if worker.exact.swap(false, Ordering::AcqRel) {
                    let held = index.hashes_of(worker.id);
                    let p = predicted.entry(worker.id).or_default();
                    p.clear();
                    p.touch(&held, Instant::now());
                    tracing::warn!(worker = worker.id, url = %worker.label(), blocks = held.len(), "KV events lost: approximate mode");
                }
            }
        }
    }

    pub fn index_mut(&self) -> std::sync::RwLockWriteGuard<'_, KvIndex> {
        self.index.write().unwrap_or_else(|e| e.into_inner())
    }

    fn index(&self) -> std::sync::RwLockReadGuard<'_, KvIndex> {
        self.index.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Healthy workers not in `excluded` that can serve `hop` and take the
    /// request (its keys name their kind), with each one's overlap with the
    /// prompt's blocks.
    pub fn candidates(&self, keys: &PromptKeys, excluded: &[u32], hop: Hop) -> Candidates {
        let all = self.workers.load();
        let workers: Vec<Arc<Worker>> = all
            .iter()
            .filter(|w| {
                w.is_healthy()
                    && !excluded.contains(&w.id)
                    && w.state().serves(hop)
                    && keys.of(w.kind()).is_some()
            })
            .cloned()
            .collect();
        let loads: Vec<WorkerLoad> = workers
            .iter()
            .map(|w| {
                let load = w.load();
                WorkerLoad {
                    state: w.state(),
                    id: w.id,
                    // The gateway's own counts are exact and immediate; the
                    // worker's report lags by up to 250 ms, long enough to
                    // make a worker that just finished look busy.
                    active_requests: w.in_flight.load(Ordering::Relaxed),
                    queued_prefill_tokens: w.pending_prefill_tokens.load(Ordering::Relaxed),
                    kv_blocks_used: w.in_flight_blocks.load(Ordering::Relaxed),
                    kv_blocks_total: load.kv_blocks_total,
                    overlap_blocks: 0,
                }
            })
            .collect();
        let mut view = FleetView::from_workers(&loads);
        if !workers.is_empty() {
            let overlap = view.overlap_blocks_mut();
            let index = self.index();
            for kind in [WorkerKind::Sluice, WorkerKind::Openai] {
                let Some(hashes) = keys.of(kind).filter(|h| !h.is_empty()) else {
                    continue;
                };
                index.overlaps(hashes, |id, blocks| {
                    if let Some(i) = workers.iter().position(|w| w.id == id && w.kind() == kind) {
                        overlap[i] = blocks;
                    }
                });
            }
        }
        Candidates { workers, view }
    }

    /// How loaded the fleet is, for admission.
    pub fn saturation(&self, queued_requests: u32) -> FleetSaturation {
        let mut s = FleetSaturation {
            queued_requests,
            ..FleetSaturation::default()
        };
        for w in self.workers.load().iter().filter(|w| w.is_healthy()) {
            let load = w.load();
            s.healthy_workers += 1;
            s.active_requests += w.in_flight.load(Ordering::Relaxed);
            s.queued_prefill_tokens += u64::from(load.queued_prefill_tokens);
            s.kv_blocks_used += u64::from(load.kv_blocks_used);
            s.kv_blocks_total += u64::from(load.kv_blocks_total);
        }
        s
    }

    /// Whether requests are routed by hops: some healthy worker has a role
    /// other than both. Then whole requests go to decode-capable workers,
    /// and long prompts are prefilled on prefill workers first (when one is
    /// left; a decode-only worker can still serve whole requests).
    pub fn disaggregated(&self) -> bool {
        self.workers
            .load()
            .iter()
            .any(|w| w.is_healthy() && w.role() != Role::Both)
    }

    pub fn healthy_count(&self) -> u32 {
        self.workers
            .load()
            .iter()
            .filter(|w| w.is_healthy())
            .count() as u32
    }

    pub fn status(&self) -> Vec<WorkerStatus> {
        let index = self.index();
        self.workers
            .load()
            .iter()
            .map(|w| WorkerStatus {
                id: w.id,
                url: w.url.clone(),
                origin: w.origin,
                kind: w.kind(),
                dp_rank: w.upstream.dp_rank,
                kv_mode: if w.is_exact() {
                    "events"
                } else {
                    "approximate"
                },
                healthy: w.is_healthy(),
                role: w.role(),
                in_flight: w.in_flight.load(Ordering::Relaxed),
                routed: w.routed.load(Ordering::Relaxed),
                cached_blocks: index.blocks_of(w.id),
                load: w.load(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(hashes: &[u64]) -> PromptKeys {
        PromptKeys::sluice(hashes.to_vec())
    }

    #[test]
    fn candidates_are_healthy_unexcluded_workers_with_their_overlap() {
        let fleet = Fleet::new(FleetConfig::default(), 16);
        let (a, new_a) = fleet.add("http://a:1/", Origin::Static);
        let (b, _) = fleet.add("http://b:1", Origin::Registered);
        let (c, _) = fleet.add("http://c:1", Origin::Registered);
        assert!(new_a);
        let (again, new) = fleet.add("http://a:1", Origin::Static);
        assert!(!new && again.id == a.id, "same URL, same worker");
        for w in [&a, &b, &c] {
            fleet.set_healthy(w, true);
        }
        fleet.set_healthy(&c, false);
        fleet.index_mut().store(b.id, &[1, 2, 3]);
        fleet.index_mut().store(a.id, &[1]);
        let got = fleet.candidates(&keys(&[1, 2, 9]), &[], Hop::Aggregated);
        assert_eq!(got.view.worker_ids(), [a.id, b.id]);
        assert_eq!(got.view.overlap_blocks(), [1, 2]);
        let got = fleet.candidates(&keys(&[1, 2]), &[b.id], Hop::Aggregated);
        assert_eq!(got.view.worker_ids(), [a.id]);
        // Out of service forgets the blocks; removal forgets the worker.
        fleet.set_healthy(&b, false);
        fleet.set_healthy(&b, true);
        assert_eq!(
            fleet
                .candidates(&keys(&[1, 2]), &[], Hop::Aggregated)
                .view
                .overlap_blocks(),
            [1, 0]
        );
        assert!(fleet.remove(a.id));
        assert!(!fleet.remove(a.id));
        assert!(a.is_removed());
        assert_eq!(
            fleet
                .candidates(&keys(&[1]), &[], Hop::Aggregated)
                .view
                .worker_ids(),
            [b.id]
        );
        assert_eq!(fleet.saturation(3).healthy_workers, 1);
    }

    #[test]
    fn roles_decide_which_hops_a_worker_is_a_candidate_for() {
        let fleet = Fleet::new(FleetConfig::default(), 16);
        let (p, _) = fleet.add("http://p:1", Origin::Static);
        let (d, _) = fleet.add("http://d:1", Origin::Static);
        let (both, _) = fleet.add("http://b:1", Origin::Static);
        for w in [&p, &d, &both] {
            fleet.set_healthy(w, true);
        }
        assert!(!fleet.disaggregated(), "every worker does both");
        p.set_role(Role::Prefill);
        d.set_role(Role::Decode);
        assert!(fleet.disaggregated());
        let ids = |hop| {
            fleet
                .candidates(&keys(&[]), &[], hop)
                .view
                .worker_ids()
                .to_vec()
        };
        assert_eq!(ids(Hop::Prefill), [p.id, both.id]);
        assert_eq!(ids(Hop::Decode), [d.id, both.id]);
        assert_eq!(ids(Hop::Aggregated), [both.id]);
        let view = fleet.candidates(&keys(&[]), &[], Hop::Prefill).view;
        assert!(view.serves(0, Hop::Prefill) && !view.serves(0, Hop::Decode));
        // Without its prefill worker the fleet still routes by hops: the
        // decode-only worker takes whole requests (no aggregated candidate).
        fleet.set_healthy(&p, false);
        assert!(fleet.disaggregated());
        fleet.set_healthy(&d, false);
        assert!(!fleet.disaggregated(), "every worker in service does both");
    }

    #[test]
    fn openai_workers_take_their_own_keys_and_predictions_expire() {
        let mut fleet = Fleet::new(FleetConfig::default(), 16);
        fleet.approximate = Approximate {
            ttl: std::time::Duration::from_millis(50),
            max_blocks: 100,
        };
        let (ours, _) = fleet.add("http://a:1", Origin::Static);
        let openai = |rank| Upstream {
            kind: WorkerKind::Openai,
            dp_rank: Some(rank),
            api_key: None,
            kv_events: rank == 0,
        };
        let (r0, new0) = fleet.add_upstream("http://v:1", Origin::Static, openai(0));
        let (r1, new1) = fleet.add_upstream("http://v:1", Origin::Static, openai(1));
        assert!(new0 && new1 && r0.id != r1.id, "each rank is a worker");
        for w in [&ours, &r0, &r1] {
            fleet.set_healthy(w, true);
        }
        assert!(ours.is_exact() && !r0.is_exact());
        fleet.predict(&ours, &[1, 2]); // exact: no prediction
        fleet.predict(&r1, &[5, 6]);
        let both = PromptKeys {
            sluice: Some(vec![1, 2]),
            openai: Some(vec![5, 6, 7]),
        };
        let got = fleet.candidates(&both, &[], Hop::Aggregated);
        assert_eq!(got.view.worker_ids(), [ours.id, r0.id, r1.id]);
        assert_eq!(got.view.overlap_blocks(), [0, 0, 2]);
        let only_openai = PromptKeys {
            sluice: None,
            ..both.clone()
        };
        let got = fleet.candidates(&only_openai, &[], Hop::Aggregated);
        assert_eq!(got.view.worker_ids(), [r0.id, r1.id]);
        std::thread::sleep(std::time::Duration::from_millis(60));
        for w in [&r0, &r1] {
            fleet.expire_predictions(w.id);
        }
        let got = fleet.candidates(&both, &[], Hop::Aggregated);
        assert_eq!(got.view.overlap_blocks(), [0, 0, 0], "predictions expired");
        // Events heard: exact, the index holds what they said; lost again:
        // what was held becomes predictions.
        fleet.set_exact(&r0, Some(&[5]));
        assert!(r0.is_exact());
        assert_eq!(
            fleet
                .candidates(&both, &[], Hop::Aggregated)
                .view
                .overlap_blocks(),
            [0, 1, 0]
        );
        fleet.set_exact(&r0, None);
        assert!(!r0.is_exact());
        assert_eq!(
            fleet
                .candidates(&both, &[], Hop::Aggregated)
                .view
                .overlap_blocks(),
            [0, 1, 0]
        );
        std::thread::sleep(std::time::Duration::from_millis(60));
        for w in [&r0, &r1] {
            fleet.expire_predictions(w.id);
        }
        assert_eq!(
            fleet
                .candidates(&both, &[], Hop::Aggregated)
                .view
                .overlap_blocks(),
            [0, 0, 0]
        );
        // Out of service and back: what the events said stays (rank 0 has
        // events); predictions do not (rank 1 has none).
        fleet.set_exact(&r0, Some(&[5, 6]));
        fleet.predict(&r1, &[5]);
        for w in [&r0, &r1] {
            fleet.set_healthy(w, false);
            fleet.set_healthy(w, true);
        }
        assert_eq!(
            fleet
                .candidates(&both, &[], Hop::Aggregated)
                .view
                .overlap_blocks(),
            [0, 2, 0]
        );
    }
}
