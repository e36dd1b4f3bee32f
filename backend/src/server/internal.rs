//! The worker's own endpoints: the token-level generate endpoint the gateway
//! calls (token ids in, one JSON event per line out), the prefill endpoint
//! of disaggregation (prefill here, KV to a decode worker), the KV event and load
//! stream (SSE), a KV snapshot for resyncs, `/health` and `/metrics`.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::header;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::error::ApiError;
use super::openai::parse;
use super::{MAX_BODY_BYTES, WorkerState};
use crate::engine::{FinishReason, GenerateEvent, GenerateRequest, Usage};
use crate::transfer::{KvTarget, Pushed};

/// `POST /internal/generate`: a [`GenerateRequest`] as JSON (token ids, sampling,
/// stops, cache salt); answers `application/x-ndjson`, one [`GenerateEvent`] per
/// line, ending with `finished` or `error`.
pub async fn generate(
    State(state): State<Arc<WorkerState>>,
    headers: axum::http::HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let request: GenerateRequest = parse(body, MAX_BODY_BYTES).await?;
    // The gateway passes its request span on (W3C trace context).
    if let Some(parent) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        tracing::debug!(
            traceparent = parent,
            prompt_tokens = request.prompt.len(),
            "generate"
        );
    }
    if request.remote_prefill && state.kv_addr.is_none() {
        return Err(ApiError::unavailable(format!(
            "this worker (role {}) takes no KV from prefill workers",
            state.role
        )));
    }
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let (_, rx) = state.engine.submit(request);
    let metrics_state = state.clone();
    let lines = UnboundedReceiverStream::new(rx).map(move |mut event| {
        match &mut event {
            GenerateEvent::Finished { usage, .. } => metrics_state.metrics.record(usage),
            GenerateEvent::AwaitingKv { addr, .. } => {
                addr.clone_from(metrics_state.kv_addr.as_ref().expect("checked above"));
            }
            _ => {}
        }
        let mut line = serde_json::to_vec(&event).unwrap_or_default();
        line.push(b'\n');
        Ok::<_, Infallible>(line)
    });
    Ok((
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

/// The body of `POST /internal/prefill`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct PrefillRequest {
    /// The whole request, as the decode worker got it (its prompt included
    /// the last token, which the decode worker runs).
    pub request: GenerateRequest,
    /// Where the KV goes (from the decode worker's `awaiting_kv` event).
    pub target: KvTarget,
}

/// The answer of `POST /internal/prefill`.
#[derive(Clone, Copy, Debug, serde::Serialize, serde::Deserialize)]
pub struct PrefillDone {
    /// Tokens prefilled here (the prompt without its last token).
    pub prompt_tokens: u32,
    /// Of those, served from this worker's prefix cache.
    pub cached_tokens: u32,
    pub pushed: Pushed,
    /// From the request's arrival to the decode worker's acknowledgement.
    pub seconds: f64,
}

/// `POST /internal/prefill`: a [`PrefillRequest`]. Prefills the prompt but
/// its last token and pushes each step's finished blocks to the decode
/// worker as they come; answers [`PrefillDone`] once the decode worker has
/// acknowledged them all, or an error (the decode side then fails its
/// request and releases the blocks). A client that goes away cancels both.
pub async fn prefill(
    State(state): State<Arc<WorkerState>>,
    body: axum::body::Body,
) -> Result<Json<PrefillDone>, ApiError> {
    if !state.role.can_prefill() {
        return Err(ApiError::unavailable(format!(
            "this worker (role {}) does not prefill for others",
            state.role
        )));
    }
    let PrefillRequest { request, target } = parse(body, MAX_BODY_BYTES).await?;
    let started = std::time::Instant::now();
    // Same node and both caches shared: the engine copies the blocks into
    // the decode worker's pages itself. An ask that fails (the decode side
    // gone, say) fails here as the transfer would.
    let direct = match state.engine.kv_share.as_ref().filter(|_| state.kv_direct) {
        Some(local) => state.transport.direct(&target, local).await.map_err(|e| {
            ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                format!("the KV transfer failed: {e}"),
            )
        })?,
        None => None,
    };
    let (_, mut events, kv) = state
        .engine
        .submit_prefill(request, target.from_block, direct);
    let push = state.transport.push(target, state.engine.kv_layout, kv);
    let engine_side = async {
        let mut usage = None;
        while let Some(event) = events.recv().await {
            match event {
                GenerateEvent::Finished {
                    reason: FinishReason::Stop,
                    usage: u,
                    ..
                } => usage = Some(u),
                GenerateEvent::Finished { reason, .. } => {
                    return Err(ApiError::unavailable(format!(
                        "the prefill ended early ({reason:?})"
                    )));
                }
                GenerateEvent::Error { message, status } => {
                    return Err(ApiError::with_code(
                        status,
                        axum::http::StatusCode::BAD_REQUEST,
                        message,
                    ));
                }
                _ => {}
            }
        }
        usage.ok_or_else(|| ApiError::unavailable("the engine stopped"))
    };
    let transfer = async {
        push.await.map_err(|e| {
            ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                format!("the KV transfer failed: {e}"),
            )
        })
    };
    // Whichever fails first drops the other: the push's connection closes
    // (the decode side fails its request), or the export is cancelled.
    let (usage, pushed): (Usage, Pushed) = tokio::try_join!(engine_side, transfer)?;
    let m = &state.metrics;
    m.kv_blocks_in_place
        .fetch_add(pushed.in_place.into(), Ordering::Relaxed);
    m.kv_blocks_as_bytes
        .fetch_add((pushed.blocks - pushed.in_place).into(), Ordering::Relaxed);
    Ok(Json(PrefillDone {
        prompt_tokens: usage.prompt_tokens,
        cached_tokens: usage.cached_tokens,
        pushed,
        seconds: started.elapsed().as_secs_f64(),
    }))
}

/// `GET /events`: SSE (`super::events`): `kv` events carry the worker's KV
/// events with their sequence numbers (batched under load), a `load` event
/// comes every 250 ms, a `lagged` event says events were dropped for this
/// listener (resync from `/internal/kv`).
pub async fn events(
    State(state): State<Arc<WorkerState>>,
) -> Sse<impl tokio_stream::Stream<Item = Result<Event, Infallible>>> {
    let engine = state.engine.clone();
    super::events::event_stream(state.engine.subscribe_kv_events(), move || engine.load())
}

/// `GET /internal/kv`: `{"seq": last event number, "hashes": [...]}`.
pub async fn kv_snapshot(State(state): State<Arc<WorkerState>>) -> Json<serde_json::Value> {
    let (seq, hashes) = state.engine.snapshot().await;
    Json(json!({"seq": seq, "hashes": hashes, "block_size": state.engine.config.block_size}))
}

pub async fn health(State(state): State<Arc<WorkerState>>) -> Json<serde_json::Value> {
    Json(json!({
        "status": "ok",
        "model": state.model_name,
        "load": state.engine.load(),
        "role": state.role,
        "kv_addr": state.kv_addr,
        "simulated": state.frontend.simulated,
    }))
}

/// `GET /metrics`: Prometheus text format.
pub async fn metrics(State(state): State<Arc<WorkerState>>) -> Response {
    let m = &state.metrics;
    let load = state.engine.load();
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n"
        ));
    };
    metric(
        "sluice_worker_requests_total",
        "counter",
        "Generation requests received.",
        m.requests.load(Ordering::Relaxed),
    );
    metric(
        "sluice_worker_prompt_tokens_total",
        "counter",
        "Prompt tokens of finished requests.",
        m.prompt_tokens.load(Ordering::Relaxed),
    );
    metric(
        "sluice_worker_cached_prompt_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
        m.cached_prompt_tokens.load(Ordering::Relaxed),
    );
    metric(
        "sluice_worker_completion_tokens_total",
        "counter",
        "Generated tokens of finished requests.",
        m.completion_tokens.load(Ordering::Relaxed),
    );
    metric(
        "sluice_worker_kv_blocks_pushed_in_place_total",
        "counter",
        "KV blocks this worker prefilled and copied straight into a decode worker's cache (same node).",
        m.kv_blocks_in_place.load(Ordering::Relaxed),
    );
    metric(
        "sluice_worker_kv_blocks_pushed_as_bytes_total",
        "counter",
        "KV blocks this worker prefilled and sent to a decode worker as bytes (TCP).",
        m.kv_blocks_as_bytes.load(Ordering::Relaxed),
    );
    metric(
        "sluice_worker_active_requests",
        "gauge",
        "Requests running now.",
        load.active_requests.into(),
    );
    metric(
        "sluice_worker_waiting_requests",
        "gauge",
        "Requests waiting for KV blocks.",
        load.waiting_requests.into(),
    );
    metric(
        "sluice_worker_queued_prefill_tokens",
        "gauge",
        "Prompt tokens waiting for prefill.",
        load.queued_prefill_tokens.into(),
    );
    metric(
        "sluice_worker_kv_blocks_used",
        "gauge",
        "KV blocks held by running requests.",
        load.kv_blocks_used.into(),
    );
    metric(
        "sluice_worker_kv_blocks_total",
        "gauge",
        "KV blocks in the pool.",
        load.kv_blocks_total.into(),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
