//! One task per worker keeps the fleet's view of it true: it checks
//! `/health`, follows the worker's event stream (`/events`: KV events into the
//! KV index, load reports into the load view), resyncs from `/internal/kv`
//! when a sequence number is skipped, and takes the worker out of service when
//! the stream breaks or falls silent. OpenAI workers (vLLM, SGLang) have no
//! such stream: their health is polled, and their KV events, when they
//! publish them, are followed by `engine_events`.

use std::sync::Arc;
use std::time::Duration;

use sluice_backend::engine::{Load, NumberedKvEvent};
use sluice_backend::kv::KvEvent;
use tokio_stream::StreamExt;

use super::fleet::{Fleet, Origin, Worker};
use crate::config::WorkerKind;

/// Why following a worker stopped.
#[derive(Debug, thiserror::Error)]
enum FollowError {
    #[error("cannot reach it: {0}")]
    Http(#[from] reqwest::Error),
    #[error("it answered {0}")]
    Status(reqwest::StatusCode),
    #[error("its event stream ended")]
    Ended,
    #[error("no event for {0:?}")]
    Silent(Duration),
    #[error("it uses KV blocks of {worker} tokens; the gateway uses {gateway}")]
    BlockSize { worker: u32, gateway: u32 },
    #[error("bad event: {0}")]
    BadEvent(String),
}

/// `GET /internal/kv`.
#[derive(serde::Deserialize)]
struct Snapshot {
    seq: u64,
    hashes: Vec<u64>,
    block_size: u32,
}

/// Starts the monitor of a newly added worker.
pub fn spawn(fleet: Arc<Fleet>, client: reqwest::Client, worker: Arc<Worker>) {
    if worker.kind() == WorkerKind::Openai {
        tokio::spawn(watch_openai(fleet, client, worker));
        return;
    }
    tokio::spawn(async move {
        let mut last_error = String::new();
        while !worker.is_removed() {
            let result = follow(&fleet, &client, &worker).await;
            fleet.set_healthy(&worker, false);
            if worker.is_removed() {
                return;
            }
            if let Err(e) = result {
                let message = e.to_string();
                if message != last_error {
                    tracing::warn!(worker = worker.id, url = %worker.url, error = %message, "worker unreachable");
                    last_error = message;
                }
            }
            let ttl = Duration::from_millis(fleet.config.registration_ttl_ms);
            if worker.origin == Origin::Registered && worker.registered_at().elapsed() > ttl {
                tracing::warn!(worker = worker.id, url = %worker.url, "registration expired");
                fleet.remove(worker.id);
                return;
            }
            tokio::time::sleep(Duration::from_millis(fleet.config.reconnect_ms)).await;
        }
    });
}

/// An OpenAI worker has no event stream: its health is polled (`/health`,
/// which vLLM and SGLang answer, else `/v1/models`), and its load is what
/// the gateway has running there. Its predictions (approximate mode)
/// expire here too.
async fn watch_openai(fleet: Arc<Fleet>, client: reqwest::Client, worker: Arc<Worker>) {
    let timeout = Duration::from_millis(fleet.config.heartbeat_timeout_ms);
    let every = (timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut last_error = String::new();
    while !worker.is_removed() {
        match openai_health(&client, &worker, timeout).await {
            Ok(()) => {
                last_error.clear();
                fleet.set_healthy(&worker, true);
            }
            Err(e) => {
                if e != last_error {
                    tracing::warn!(worker = worker.id, url = %worker.label(), error = %e, "worker unreachable");
                    last_error = e;
                }
                fleet.set_healthy(&worker, false);
            }
        }
        fleet.expire_predictions(worker.id);
        tokio::time::sleep(every).await;
    }
}

async fn openai_health(
    client: &reqwest::Client,
    worker: &Worker,
    timeout: Duration,
) -> Result<(), String> {
    let get = |path: &str| {
        let mut request = client.get(format!("{}{path}", worker.url)).timeout(timeout);
        if let Some(key) = &worker.upstream.api_key {
            request = request.bearer_auth(key);
        }
        request.send()
    };
    let health = get("/health").await.map_err(|e| e.to_string())?;
    if health.status().is_success() {
        return Ok(());
    }
    if health.status() != reqwest::StatusCode::NOT_FOUND {
        return Err(format!("/health answered {}", health.status()));
    }
    let models = get("/v1/models").await.map_err(|e| e.to_string())?;
    if models.status().is_success() {
        Ok(())
    } else {
        Err(format!("/v1/models answered {}", models.status()))
    }
}

/// Connects to a worker and follows its events until something breaks.
async fn follow(
    fleet: &Fleet,
    client: &reqwest::Client,
    worker: &Worker,
) -> Result<(), FollowError> {
    let timeout = Duration::from_millis(fleet.config.heartbeat_timeout_ms);
    let health = client
        .get(format!("{}/health", worker.url))
        .timeout(timeout)
        .send()
        .await?;
    if !health.status().is_success() {
        return Err(FollowError::Status(health.status()));
    }
    // Its role in a disaggregated fleet (workers before roles said none:
    // they do both).
    // (A body that is not JSON names no role either.)
    let health: serde_json::Value = tokio::time::timeout(timeout, health.bytes())
        .await
        .map_err(|_| FollowError::Silent(timeout))?
        .map(|body| serde_json::from_slice(&body).unwrap_or_default())?;
    let role = match health.get("role") {
        None => sluice_backend::transfer::Role::Both,
        Some(r) => serde_json::from_value(r.clone())
            .map_err(|e| FollowError::BadEvent(format!("bad role in /health: {e}")))?,
    };
    worker.set_role(role);
    // Subscribe first, then read the snapshot: events numbered after the
    // snapshot are applied, earlier ones skipped, so nothing falls between.
    let events = tokio::time::timeout(timeout, client.get(format!("{}/events", worker.url)).send())
        .await
        .map_err(|_| FollowError::Silent(timeout))??;
    if !events.status().is_success() {
        return Err(FollowError::Status(events.status()));
    }
    let mut last_seq = resync(fleet, client, worker, timeout).await?;
    fleet.set_healthy(worker, true);
    let mut stream = events.bytes_stream();
    let mut sse = SseBuffer::default();
    loop {
        let chunk = match tokio::time::timeout(timeout, stream.next()).await {
            Err(_) => return Err(FollowError::Silent(timeout)),
            Ok(None) => return Err(FollowError::Ended),
            Ok(Some(chunk)) => chunk?,
        };
        if worker.is_removed() {
            return Ok(());
        }
        sse.push(&chunk);
        while let Some((event, data)) = sse.next_event() {
            match event.as_str() {
                "load" => {
                    let load: Load = serde_json::from_str(&data)
                        .map_err(|e| FollowError::BadEvent(e.to_string()))?;
                    worker.set_load(load);
                }
                "kv" => {
                    let e: NumberedKvEvent = serde_json::from_str(&data)
                        .map_err(|e| FollowError::BadEvent(e.to_string()))?;
                    match next_step(last_seq, e.seq) {
                        Step::Skip => continue,
                        Step::Resync => {
                            tracing::info!(
                                worker = worker.id,
                                expected = last_seq + 1,
                                got = e.seq,
                                "KV events skipped; resync"
                            );
                            last_seq = resync(fleet, client, worker, timeout).await?;
                            continue;
                        }
                        Step::Apply => {}
                    }
                    apply(fleet, worker, e.event);
                    last_seq = e.seq;
                }
                "lagged" => {
                    tracing::info!(
                        worker = worker.id,
                        "KV events dropped by the worker; resync"
                    );
                    last_seq = resync(fleet, client, worker, timeout).await?;
                }
                _ => {}
            }
        }
    }
}

/// Replaces the worker's blocks with its snapshot; returns the snapshot's
/// sequence number.
async fn resync(
    fleet: &Fleet,
    client: &reqwest::Client,
    worker: &Worker,
    timeout: Duration,
) -> Result<u64, FollowError> {
    let response = client
        .get(format!("{}/internal/kv", worker.url))
        .timeout(timeout)
        .send()
        .await?;
    if !response.status().is_success() {
        return Err(FollowError::Status(response.status()));
    }
    let snapshot: Snapshot = response.json().await?;
    if snapshot.block_size != fleet.block_size {
        return Err(FollowError::BlockSize {
            worker: snapshot.block_size,
            gateway: fleet.block_size,
        });
    }
    fleet
        .index_mut()
        .replace_worker(worker.id, &snapshot.hashes);
    Ok(snapshot.seq)
}

/// What to do with KV event `seq` after event `last` was applied.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Already in the snapshot (or seen).
    Skip,
    Apply,
    /// Events were lost in between: read a snapshot.
    Resync,
}

fn next_step(last: u64, seq: u64) -> Step {
    match seq {
        s if s <= last => Step::Skip,
        s if s == last + 1 => Step::Apply,
        _ => Step::Resync,
    }
}

fn apply(fleet: &Fleet, worker: &Worker, event: KvEvent) {
    let mut index = fleet.index_mut();
    // Removal clears the worker's blocks under this lock: nothing after it.
    if worker.is_removed() {
        return;
    }
    let worker = worker.id;
    match event {
        KvEvent::Stored { hashes, .. } => index.store(worker, &hashes),
        KvEvent::Removed { hashes } => index.remove(worker, &hashes),
        KvEvent::AllCleared => index.clear_worker(worker),
    }
}

/// Cuts a byte stream of server-sent events into (event, data) pairs.
#[derive(Debug, Default)]
pub struct SseBuffer {
    pending: Vec<u8>,
}

impl SseBuffer {
    pub fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
    }

    /// The next complete event; comments and keep-alives are skipped.
    pub fn next_event(&mut self) -> Option<(String, String)> {
        loop {
            let end = self.pending.windows(2).position(|w| w == b"\n\n")?;
            let block: Vec<u8> = self.pending.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&block);
            let mut event = String::from("message");
            let mut data = String::new();
            for line in text.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = v.trim_start().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            if !data.is_empty() {
                return Some((event, data));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{SseBuffer, Step, next_step};

    #[test]
    fn events_in_order_apply_old_ones_skip_a_gap_resyncs() {
        // After a snapshot at 10: 9 and 10 are in it, 11 follows, 13 means 12 was lost.
        assert_eq!(next_step(10, 9), Step::Skip);
        assert_eq!(next_step(10, 10), Step::Skip);
        assert_eq!(next_step(10, 11), Step::Apply);
        assert_eq!(next_step(10, 13), Step::Resync);
        assert_eq!(next_step(0, 1), Step::Apply);
    }

    #[test]
    fn sse_events_split_across_chunks() {
        let mut sse = SseBuffer::default();
        sse.push(b"event: kv\ndata: {\"seq\"");
        assert_eq!(sse.next_event(), None);
        sse.push(b":1}\n\n:keep-alive\n\nevent: load\ndata: a\ndata: b\n\ndata: x\n\n");
        assert_eq!(sse.next_event(), Some(("kv".into(), "{\"seq\":1}".into())));
        assert_eq!(sse.next_event(), Some(("load".into(), "a\nb".into())));
        assert_eq!(sse.next_event(), Some(("message".into(), "x".into())));
        assert_eq!(sse.next_event(), None);
    }
}
