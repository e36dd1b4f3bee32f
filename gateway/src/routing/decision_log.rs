//! The decision log: every routing decision's inputs (the request view and
//! the packed fleet view the router saw) and its answer, one JSON object per
//! line, written off the request path by a thread of its own (a full queue
//! drops records and counts them; the file stops growing at its size limit).
//! `sluice plugins replay` reads it back and asks a plugin what it would have
//! done ([`replay`]).

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::shadow::{Comparison, ComparisonStatus};
use crate::policy::{FleetView, Hop, RequestView, RouteDecision, RouterPolicy};

/// One decision as logged.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecisionRecord {
    /// Unix time, milliseconds.
    pub t_ms: u64,
    pub prompt_tokens: u32,
    pub prompt_blocks: u32,
    pub block_size: u32,
    pub max_tokens: u32,
    pub session_hash: u64,
    pub tenant_id: u32,
    pub priority: i32,
    /// `aggregated`, `prefill` or `decode`.
    pub hop: String,
    /// Candidate workers.
    pub workers: u32,
    /// The fleet view's packed columns (as `wit/policy.wit` lays them out).
    pub fleet: Vec<u32>,
    /// The index picked; `None` = rejected.
    pub chosen: Option<u32>,
    /// The router plugin version that decided; `None` = the built-in policy.
    pub version: Option<u64>,
}

fn hop_name(hop: Hop) -> &'static str {
    match hop {
        Hop::Aggregated => "aggregated",
        Hop::Prefill => "prefill",
        Hop::Decode => "decode",
    }
}

impl DecisionRecord {
    pub fn new(
        request: &RequestView,
        fleet: &FleetView,
        decision: &RouteDecision,
        version: Option<u64>,
    ) -> Self {
        Self {
            t_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            prompt_tokens: request.prompt_tokens,
            prompt_blocks: request.prompt_blocks,
            block_size: request.block_size,
            max_tokens: request.max_tokens,
            session_hash: request.session_hash,
            tenant_id: request.tenant_id,
            priority: request.priority,
            hop: hop_name(request.hop).to_string(),
            workers: fleet.len() as u32,
            fleet: fleet.columns().to_vec(),
            chosen: match decision {
                RouteDecision::Worker(i) => Some(*i as u32),
                RouteDecision::Reject(_) => None,
            },
            version,
        }
    }

    /// The request and fleet views back, or why the record is malformed.
    pub fn views(&self) -> Result<(RequestView, FleetView), String> {
        let hop = match self.hop.as_str() {
            "aggregated" => Hop::Aggregated,
            "prefill" => Hop::Prefill,
            "decode" => Hop::Decode,
            other => return Err(format!("unknown hop {other:?}")),
        };
        let fleet = FleetView::from_columns(self.workers as usize, self.fleet.clone()).ok_or_else(
            || {
                format!(
                    "{} fleet values for {} workers",
                    self.fleet.len(),
                    self.workers
                )
            },
        )?;
        let request = RequestView {
            prompt_tokens: self.prompt_tokens,
            prompt_blocks: self.prompt_blocks,
            block_size: self.block_size,
            max_tokens: self.max_tokens,
            session_hash: self.session_hash,
            tenant_id: self.tenant_id,
            priority: self.priority,
            hop,
        };
        Ok((request, fleet))
    }
}

/// Records waiting for the writer thread, at most.
const QUEUE: usize = 65_536;

/// The writer side, held by the gateway.
#[derive(Debug)]
pub struct DecisionLog {
    queue: SyncSender<DecisionRecord>,
    /// Records dropped because the queue was full or the file at its limit.
    pub dropped: std::sync::Arc<AtomicU64>,
    pub path: PathBuf,
}

impl DecisionLog {
    /// Opens (appends to) `path` and starts the writer thread; the file
    /// grows to at most `max_bytes`.
    pub fn open(path: &Path, max_bytes: u64) -> std::io::Result<DecisionLog> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        let mut written = file.metadata()?.len();
        let (queue, records) = sync_channel::<DecisionRecord>(QUEUE);
        let dropped = std::sync::Arc::new(AtomicU64::new(0));
        let thread_dropped = dropped.clone();
        let shown = path.display().to_string();
        std::thread::Builder::new()
            .name("sluice-decision-log".into())
            .spawn(move || {
                let mut out = std::io::BufWriter::new(file);
                let mut full_logged = false;
                loop {
                    let record = match records.recv_timeout(Duration::from_secs(1)) {
                        Ok(r) => r,
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                            let _ = out.flush();
                            continue;
                        }
                        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                    };
                    let mut line = serde_json::to_vec(&record).unwrap_or_default();
                    line.push(b'\n');
                    if written + line.len() as u64 > max_bytes {
                        thread_dropped.fetch_add(1, Ordering::Relaxed);
                        if !full_logged {
                            tracing::warn!(path = %shown, max_bytes, "the decision log is full; later decisions are not recorded");
                            full_logged = true;
                        }
                        continue;
                    }
                    if let Err(e) = out.write_all(&line) {
                        tracing::warn!(path = %shown, error = %e, "cannot write the decision log");
                        thread_dropped.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    written += line.len() as u64;
                }
                let _ = out.flush();
            })?;
        Ok(DecisionLog {
            queue,
            dropped,
            path: path.to_path_buf(),
        })
    }

    /// Queues a record; never blocks.
    pub fn record(&self, record: DecisionRecord) {
        match self.queue.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// What a plugin would have done with a logged stream of decisions.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    pub records: u64,
    /// Lines that could not be read (reported, not fatal).
    pub malformed: u64,
    /// The logged decisions against the plugin's.
    pub comparison: ComparisonStatus,
    /// Requests each worker id got, as logged and as the plugin would send them.
    pub logged_picks: std::collections::BTreeMap<u32, u64>,
    pub plugin_picks: std::collections::BTreeMap<u32, u64>,
}

/// Replays a decision log through `router` (`answered` says whether the
/// router itself answered or fell back); at most `limit` records.
pub fn replay(
    log: impl BufRead,
    router: impl Fn(&RequestView, &FleetView) -> (RouteDecision, bool),
    limit: Option<u64>,
) -> std::io::Result<ReplayReport> {
    let comparison = Comparison::default();
    let mut report = ReplayReport {
        records: 0,
        malformed: 0,
        comparison: ComparisonStatus::default(),
        logged_picks: Default::default(),
        plugin_picks: Default::default(),
    };
    for line in log.lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|l| report.records >= l) {
            break;
        }
        let Ok(record) = serde_json::from_str::<DecisionRecord>(&line) else {
            report.malformed += 1;
            continue;
        };
        let Ok((request, fleet)) = record.views() else {
            report.malformed += 1;
            continue;
        };
        let logged = match record.chosen {
            Some(i) if (i as usize) < fleet.len() => RouteDecision::Worker(i as usize),
            Some(_) => {
                report.malformed += 1;
                continue;
            }
            None => RouteDecision::Reject(crate::policy::Rejection {
                status: 503,
                message: "rejected".into(),
            }),
        };
        let (decision, answered) = router(&request, &fleet);
        comparison.observe(&request, &fleet, &logged, &decision, answered);
        let id_of = |d: &RouteDecision| match d {
            RouteDecision::Worker(i) => fleet.worker_ids().get(*i).copied(),
            RouteDecision::Reject(_) => None,
        };
        if let Some(id) = id_of(&logged) {
            *report.logged_picks.entry(id).or_default() += 1;
        }
        if let Some(id) = id_of(&decision) {
            *report.plugin_picks.entry(id).or_default() += 1;
        }
        report.records += 1;
    }
    report.comparison = comparison.status();
    Ok(report)
}

/// Replays with a plain policy (the built-in, in tests).
pub fn replay_policy(
    log: impl BufRead,
    policy: &impl RouterPolicy,
    limit: Option<u64>,
) -> std::io::Result<ReplayReport> {
    replay(log, |r, f| (policy.route(r, f), true), limit)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{KvAwareRouter, WorkerLoad};

    fn view(overlaps: &[u32]) -> (RequestView, FleetView) {
        let workers: Vec<WorkerLoad> = overlaps
            .iter()
            .enumerate()
            .map(|(i, &o)| WorkerLoad {
                state: crate::policy::WorkerState::new(true, true, true),
                id: 10 + i as u32,
                overlap_blocks: o,
                ..WorkerLoad::default()
            })
            .collect();
        let request = RequestView {
            prompt_tokens: 160,
            prompt_blocks: 10,
            block_size: 16,
            max_tokens: 8,
            session_hash: 7,
            tenant_id: 0,
            priority: 0,
            hop: Hop::Aggregated,
        };
        (request, FleetView::from_workers(&workers))
    }

    #[test]
    fn records_round_trip_to_the_same_views() {
        let (r, f) = view(&[3, 9]);
        let record = DecisionRecord::new(&r, &f, &RouteDecision::Worker(1), Some(4));
        let line = serde_json::to_string(&record).expect("serializes");
        let back: DecisionRecord = serde_json::from_str(&line).expect("parses");
        assert_eq!(back, record);
        assert_eq!(back.views().expect("valid"), (r, f));
        let mut broken = back.clone();
        broken.workers = 3;
        assert!(broken.views().is_err());
    }

    #[test]
    fn replay_compares_the_log_with_a_policy() {
        // Logged: always worker 0 (a round robin that happened to pick it).
        let mut log = String::new();
        for overlaps in [[0, 9], [9, 0], [0, 9], [0, 0]] {
            let (r, f) = view(&overlaps);
            let record = DecisionRecord::new(&r, &f, &RouteDecision::Worker(0), None);
            log.push_str(&serde_json::to_string(&record).expect("serializes"));
            log.push('\n');
        }
        log.push_str("not json\n");
        let report = replay_policy(log.as_bytes(), &KvAwareRouter::default(), None).expect("reads");
        assert_eq!(report.records, 4);
        assert_eq!(report.malformed, 1);
        // KV-aware picks the worker with 9 cached: it disagrees twice.
        assert_eq!(report.comparison.disagreements, 2);
        assert_eq!(report.comparison.active_overlap_blocks, 9);
        assert_eq!(report.comparison.candidate_overlap_blocks, 27);
        assert_eq!(report.logged_picks.get(&10), Some(&4));
        assert_eq!(report.plugin_picks.get(&11), Some(&2));
        let limited =
            replay_policy(log.as_bytes(), &KvAwareRouter::default(), Some(1)).expect("reads");
        assert_eq!(limited.records, 1);
    }

    #[test]
    fn the_writer_appends_lines_and_stops_at_its_limit() {
        let dir = std::env::temp_dir().join(format!("sluice-dlog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("decisions.jsonl");
        let (r, f) = view(&[1, 2]);
        let one = serde_json::to_vec(&DecisionRecord::new(
            &r,
            &f,
            &RouteDecision::Worker(0),
            None,
        ))
        .expect("serializes")
        .len() as u64
            + 1;
        let log = DecisionLog::open(&path, one * 3).expect("opens");
        for _ in 0..5 {
            log.record(DecisionRecord::new(&r, &f, &RouteDecision::Worker(0), None));
        }
        let dropped = log.dropped.clone();
        drop(log); // the writer drains and exits
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while dropped.load(Ordering::Relaxed) < 2 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(50));
        let text = std::fs::read_to_string(&path).expect("reads");
        assert_eq!(
            text.lines().count(),
            3,
            "records past the limit are dropped"
        );
        assert_eq!(dropped.load(Ordering::Relaxed), 2);
        std::fs::remove_dir_all(&dir).ok();
    }
}
