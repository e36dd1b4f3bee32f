//! The OpenAI endpoints: each request goes through the stages in order —
//! auth, parse and preprocess, admission, then the upstream relay — and is
//! answered by the OpenAI layer shared with the worker. Response headers say
//! which worker served it and how many prompt blocks were cached there.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use sluice_backend::server::ApiError;
use sluice_backend::server::openai::{
    ChatRequest, CompletionRequest, Kind, Prepared, from_json, read_body,
};

use super::auth;
use crate::admission::{QueueError, Ticket};
use crate::gateway::Gateway;
use crate::policy::{AdmissionPolicy, AdmitDecision};
use crate::preprocess::{Preprocessed, preprocess};
use crate::telemetry::{self, RequestOutcome, TraceContext};
use crate::upstream::{self, Job};
use tracing::Instrument;

/// The worker that served a request.
pub const WORKER_HEADER: &str = "x-sluice-worker";
/// Prompt blocks already cached on that worker.
pub const CACHED_BLOCKS_HEADER: &str = "x-sluice-cached-blocks";
/// The router plugin version that chose the worker, or `builtin`.
pub const ROUTER_HEADER: &str = "x-sluice-router-version";
/// The worker that prefilled the prompt, when it was not the one that
/// generated (a disaggregated request).
pub const PREFILL_WORKER_HEADER: &str = "x-sluice-prefill-worker";

pub async fn chat_completions(
    State(gateway): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    handle(gateway, Kind::Chat, headers, body).await
}

pub async fn completions(
    State(gateway): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    handle(gateway, Kind::Completion, headers, body).await
}

pub async fn models(State(gateway): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    match auth::caller(&gateway, &headers) {
        Ok(_) => Json::<Value>(gateway.frontend.models()).into_response(),
        Err(e) => e.into_response(),
    }
}

/// One request, start to answer; errors before the relay are counted here.
async fn handle(
    gateway: Arc<Gateway>,
    kind: Kind,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let arrived = Instant::now();
    let mut trace =
        TraceContext::from_header(headers.get("traceparent").and_then(|v| v.to_str().ok()));
    let name = match kind {
        Kind::Chat => "POST /v1/chat/completions",
        Kind::Completion => "POST /v1/completions",
    };
    let span = telemetry::request_span(name, &mut trace);
    match answer(&gateway, kind, &headers, body, arrived, trace)
        .instrument(span)
        .await
    {
        Ok(response) => response,
        Err((outcome, error)) => {
            gateway
                .metrics
                .request_done(outcome, arrived.elapsed().as_secs_f64());
            if error.status.is_server_error() {
                tracing::warn!(status = error.status.as_u16(), error = %error.message, "request failed");
            }
            error.into_response()
        }
    }
}

type Failure = (RequestOutcome, ApiError);

/// Bodies up to this size are parsed and tokenized on the server thread;
/// larger ones on the blocking pool.
const INLINE_BODY_BYTES: usize = 64 << 10;

/// Parses and validates a body (template, tokenizer, limits).
fn prepare(
    frontend: &sluice_backend::server::Frontend,
    kind: Kind,
    bytes: &[u8],
) -> Result<Prepared, ApiError> {
    match kind {
        Kind::Chat => frontend.chat(&from_json::<ChatRequest>(bytes)?),
        Kind::Completion => frontend.completion(&from_json::<CompletionRequest>(bytes)?),
    }
}

fn invalid(e: ApiError) -> Failure {
    (RequestOutcome::invalid, e)
}

async fn answer(
    gateway: &Arc<Gateway>,
    kind: Kind,
    headers: &HeaderMap,
    body: axum::body::Body,
    arrived: Instant,
    trace: TraceContext,
) -> Result<Response, Failure> {
    let caller = auth::caller(gateway, headers).map_err(invalid)?;
    let limit = gateway.config.limits.max_body_bytes;
    let bytes = read_body(body, limit).await.map_err(invalid)?;
    let prepared = if bytes.len() <= INLINE_BODY_BYTES {
        prepare(&gateway.frontend, kind, &bytes)
    } else {
        // A large prompt would hold up every connection of this server
        // thread while it is parsed and tokenized.
        let frontend = gateway.frontend.clone();
        tokio::task::spawn_blocking(move || prepare(&frontend, kind, &bytes))
            .await
            .map_err(|e| (RequestOutcome::failed, ApiError::unavailable(e.to_string())))?
    }
    .map_err(invalid)?;
    let pre = preprocess(
        prepared,
        &caller,
        gateway.config.block_size,
        &gateway.policies.cache,
    );
    let deadline = arrived + gateway.config.limits.request_timeout();
    let ticket = admit(gateway, &pre, deadline).await?;
    let Preprocessed {
        prepared,
        view,
        hashes,
    } = pre;
    let reply = prepared.reply;
    let body = serde_json::to_vec(&prepared.generate)
        .map_err(|e| (RequestOutcome::failed, ApiError::unavailable(e.to_string())))?;
    let job = Job {
        body: body.into(),
        view,
        hashes,
        stream: reply.stream,
        trace,
        arrived,
        deadline,
        ticket,
    };
    let (ends, answer) = upstream::channels();
    let relay = upstream::relay(gateway.clone(), job, ends);
    if reply.stream {
        // The relay outlives this handler: it feeds the body.
        tokio::spawn(relay.instrument(tracing::Span::current()));
        return Ok(respond(gateway, kind, reply, answer, trace).await);
    }
    // Not streaming: the relay runs in this task, beside the answer.
    let ((), response) = tokio::join!(relay, respond(gateway, kind, reply, answer, trace));
    Ok(response)
}

/// Waits for the head, then answers with the OpenAI layer; the headers say
/// which worker served the request.
async fn respond(
    gateway: &Arc<Gateway>,
    kind: Kind,
    reply: sluice_backend::server::openai::Reply,
    answer: upstream::Answer,
    trace: TraceContext,
) -> Response {
    let head = match answer.head.await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => return e.into_response(),
        Err(_) => return ApiError::unavailable("the request was dropped").into_response(),
    };
    let id = format!(
        "{}-{}-{}",
        kind.id_prefix(),
        gateway.instance,
        gateway.next_request.fetch_add(1, Ordering::Relaxed)
    );
    let span = tracing::Span::current();
    span.record("worker", head.worker);
    span.record("cached_blocks", head.cached_blocks);
    tracing::debug!(%id, worker = head.worker, cached_blocks = head.cached_blocks, router_version = ?head.router_version, trace = %format_args!("{:032x}", trace.trace_id), "routed");
    let mut response = match gateway
        .frontend
        .respond(reply, id, answer.events, |_| {})
        .await
    {
        Ok(r) => r,
        Err(e) => e.into_response(),
    };
    let h = response.headers_mut();
    h.insert(WORKER_HEADER, HeaderValue::from(head.worker));
    h.insert(CACHED_BLOCKS_HEADER, HeaderValue::from(head.cached_blocks));
    if let Some(prefill) = head.prefill_worker {
        h.insert(PREFILL_WORKER_HEADER, HeaderValue::from(prefill));
    }
    h.insert(
        ROUTER_HEADER,
        match head.router_version {
            Some(v) => HeaderValue::from(v),
            None => HeaderValue::from_static("builtin"),
        },
    );
    response
}

/// Asks the admission policy; waits in the queue if it says so, and asks
/// again each time the queue gives the request a place (as the WIT contract
/// says). A policy that keeps queueing is asked at most every
/// [`REQUEUE_PAUSE`]; the request deadline bounds it all.
async fn admit(
    gateway: &Arc<Gateway>,
    pre: &Preprocessed,
    deadline: Instant,
) -> Result<Ticket, Failure> {
    let queue = &gateway.queue;
    let mut place: Option<Ticket> = None;
    loop {
        queue.set_capacity(gateway.capacity());
        let saturation = gateway.fleet.saturation(queue.waiting());
        let priority = match gateway.policies.admission.admit(&pre.view, &saturation) {
            AdmitDecision::Admit => return Ok(place.unwrap_or_else(|| queue.admit())),
            AdmitDecision::Reject(r) => {
                let done = rejected_completion(pre);
                gateway.policies.admission.on_complete(&done);
                return Err((
                    RequestOutcome::rejected,
                    ApiError::with_code(Some(r.status), StatusCode::TOO_MANY_REQUESTS, r.message),
                ));
            }
            AdmitDecision::Queue(priority) => priority,
        };
        if place.take().is_some() {
            // Queued again after a place freed up: give it back, pause.
            tokio::time::sleep_until(deadline.min(Instant::now() + REQUEUE_PAUSE).into()).await;
        }
        match queue.enqueue(priority, deadline).await {
            Ok(ticket) => place = Some(ticket),
            Err(e) => {
                gateway
                    .policies
                    .admission
                    .on_complete(&rejected_completion(pre));
                let status = match e {
                    QueueError::Full(_) => StatusCode::TOO_MANY_REQUESTS,
                    QueueError::TimedOut => StatusCode::SERVICE_UNAVAILABLE,
                };
                return Err((
                    RequestOutcome::rejected,
                    ApiError {
                        status,
                        message: e.to_string(),
                        param: None,
                    },
                ));
            }
        }
    }
}

/// The least time between two admission asks for a request the policy keeps
/// queueing.
const REQUEUE_PAUSE: std::time::Duration = std::time::Duration::from_millis(10);

/// What the admission policy hears of a request it refused (or that waited
/// in its queue in vain).
fn rejected_completion(pre: &Preprocessed) -> crate::policy::Completion {
    crate::policy::Completion {
        tenant_id: pre.view.tenant_id,
        session_hash: pre.view.session_hash,
        priority: pre.view.priority,
        prompt_tokens: pre.view.prompt_tokens,
        cached_tokens: 0,
        output_tokens: 0,
        outcome: crate::policy::Outcome::Rejected,
        duration_us: 0,
    }
}
