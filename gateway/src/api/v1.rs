//! The OpenAI endpoints: each request goes through the stages in order —
//! auth, parse and preprocess, admission, then the upstream relay — and is
//! answered by the OpenAI layer shared with the worker, or, from an OpenAI
//! worker (vLLM, SGLang: `kind = "openai"`), with that worker's own bytes.
//! Response headers say which worker served it and how many prompt blocks
//! were cached there.

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
use crate::policy::{AdmissionPolicy, AdmitDecision, RequestView};
use crate::preprocess::preprocess;
use crate::routing::PromptKeys;
use crate::telemetry::{self, RequestOutcome, TraceContext};
use crate::upstream::passthrough::{self, Passthrough, Routed};
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
    if let Err(e) = auth::caller(&gateway, &headers) {
        return e.into_response();
    }
    match &gateway.frontend {
        Some(frontend) => Json::<Value>(frontend.models()).into_response(),
        // No model of its own: the models of an OpenAI worker.
        None => upstream_models(&gateway).await,
    }
}

/// `GET /v1/models` of the first healthy OpenAI worker that answers.
async fn upstream_models(gateway: &Gateway) -> Response {
    for worker in gateway.fleet.workers().iter() {
        if !worker.is_healthy() || worker.kind() != crate::config::WorkerKind::Openai {
            continue;
        }
        let mut request = gateway
            .client()
            .get(format!("{}/v1/models", worker.url))
            .timeout(std::time::Duration::from_secs(5));
        if let Some(key) = &worker.upstream.api_key {
            request = request.bearer_auth(key);
        }
        if let Ok(r) = request.send().await
            && r.status().is_success()
            && let Ok(body) = r.bytes().await
        {
            return (
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response();
        }
    }
    ApiError::unavailable("no healthy worker answers /v1/models").into_response()
}

/// One request, start to answer; errors before the relay are counted here.
async fn handle(
    gateway: Arc<Gateway>,
    kind: Kind,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Response {
    let arrived = Instant::now();
    super::timer_floor::request_arrived();
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
    let request = if bytes.len() <= INLINE_BODY_BYTES {
        read_request(gateway, kind, &bytes)
    } else {
        // A large prompt would hold up every connection of this server
        // thread while it is parsed and tokenized.
        let gateway = gateway.clone();
        let bytes = bytes.clone();
        tokio::task::spawn_blocking(move || read_request(&gateway, kind, &bytes))
            .await
            .map_err(|e| (RequestOutcome::failed, ApiError::unavailable(e.to_string())))?
    }
    .map_err(invalid)?;
    let ReadRequest {
        ours,
        forwarded: routed,
        stream,
    } = request;
    let (view, mut keys, reply, generate) = match ours {
        Some(pre) => {
            let pre = preprocess(
                pre,
                &caller,
                gateway.config.block_size,
                &gateway.policies.cache,
            );
            // Room for the prompt's ids (up to 6 digits and a comma each) at
            // once, rather than a buffer doubled from 128 bytes as it fills.
            let mut generate = Vec::with_capacity(256 + 7 * pre.prepared.generate.prompt.len());
            serde_json::to_writer(&mut generate, &pre.prepared.generate)
                .map_err(|e| (RequestOutcome::failed, ApiError::unavailable(e.to_string())))?;
            (
                pre.view,
                PromptKeys::sluice(pre.hashes),
                Some(pre.prepared.reply),
                generate,
            )
        }
        None => {
            let routed = routed
                .as_ref()
                .expect("read_request returns one of the two");
            (
                forwarded_view(routed, &caller),
                PromptKeys::default(),
                None,
                Vec::new(),
            )
        }
    };
    let passthrough = routed.map(|routed| {
        keys.openai = Some(routed.hashes);
        Passthrough {
            path: match kind {
                Kind::Chat => "/v1/chat/completions",
                Kind::Completion => "/v1/completions",
            },
            body: bytes,
        }
    });
    let deadline = arrived + gateway.config.limits.request_timeout();
    let ticket = admit(gateway, &view, deadline).await?;
    let job = Job {
        body: generate.into(),
        passthrough,
        view,
        keys,
        stream,
        trace,
        arrived,
        deadline,
        ticket,
    };
    let (ends, answer) = upstream::channels();
    let relay = upstream::relay(gateway.clone(), job, ends);
    if stream {
        // The relay outlives this handler: it feeds the body.
        tokio::spawn(relay.instrument(tracing::Span::current()));
        return Ok(respond(gateway, kind, reply, answer, trace).await);
    }
    // Not streaming: the relay runs in this task, beside the answer.
    let ((), response) = tokio::join!(relay, respond(gateway, kind, reply, answer, trace));
    Ok(response)
}

/// A request read for the workers it may go to: sluice workers (`ours`:
/// parsed and tokenized by the served model's OpenAI layer) and OpenAI
/// workers (`forwarded`: what routing needs; the body goes as it came).
struct ReadRequest {
    ours: Option<Prepared>,
    forwarded: Option<Routed>,
    stream: bool,
}

/// Reads a body for every kind of worker the fleet has; fails only when no
/// kind can take it (with our OpenAI layer's error when there is one).
fn read_request(gateway: &Gateway, kind: Kind, bytes: &[u8]) -> Result<ReadRequest, ApiError> {
    let ours = gateway.frontend.as_ref().map(|f| prepare(f, kind, bytes));
    let forwarded = gateway.forwards().then(|| {
        let routing = &gateway.config.routing;
        passthrough::route_info(
            bytes,
            kind,
            gateway.routing_tokenizer.as_deref(),
            gateway.config.block_size,
            routing.text_block_chars,
            gateway.config.limits.max_tokens,
        )
    });
    match (ours, forwarded) {
        (Some(Err(e)), None | Some(Err(_))) | (None, Some(Err(e))) => Err(e),
        (ours, forwarded) => {
            let forwarded = forwarded.and_then(Result::ok);
            let ours = ours.and_then(Result::ok);
            let stream = ours
                .as_ref()
                .map(|p| p.reply.stream)
                .or(forwarded.as_ref().map(|r| r.stream))
                .unwrap_or(false);
            Ok(ReadRequest {
                ours,
                forwarded,
                stream,
            })
        }
    }
}

/// The view admission and routing see of a request only OpenAI workers take.
fn forwarded_view(routed: &Routed, caller: &crate::preprocess::Caller) -> RequestView {
    let block_size = routed.block_size.max(1);
    RequestView {
        prompt_tokens: routed.prompt_tokens,
        prompt_blocks: routed.hashes.len() as u32,
        block_size,
        max_tokens: routed.max_tokens,
        session_hash: crate::preprocess::session_hash(
            caller.session.as_deref().or(routed.user.as_deref()),
        ),
        tenant_id: caller.tenant_id,
        priority: caller.priority,
        hop: crate::policy::Hop::Aggregated,
    }
}

/// Waits for the head, then answers with the OpenAI layer (or, for a
/// relayed answer, with the worker's own bytes); the headers say which
/// worker served the request.
async fn respond(
    gateway: &Arc<Gateway>,
    kind: Kind,
    reply: Option<sluice_backend::server::openai::Reply>,
    answer: upstream::Answer,
    trace: TraceContext,
) -> Response {
    let head = match answer.head.await {
        Ok(Ok(head)) => head,
        Ok(Err(e)) => return e.into_response(),
        Err(_) => return ApiError::unavailable("the request was dropped").into_response(),
    };
    let span = tracing::Span::current();
    span.record("worker", head.worker);
    span.record("cached_blocks", head.cached_blocks);
    let mut response = match (&head.relayed, reply, &gateway.frontend) {
        (Some(relayed), _, _) => {
            tracing::debug!(worker = head.worker, cached_blocks = head.cached_blocks, router_version = ?head.router_version, status = relayed.status, trace = %format_args!("{:032x}", trace.trace_id), "relayed");
            relayed_response(relayed, answer.bytes)
        }
        (None, Some(reply), Some(frontend)) => {
            let id = format!(
                "{}-{}-{}",
                kind.id_prefix(),
                gateway.instance,
                gateway.next_request.fetch_add(1, Ordering::Relaxed)
            );
            tracing::debug!(%id, worker = head.worker, cached_blocks = head.cached_blocks, router_version = ?head.router_version, trace = %format_args!("{:032x}", trace.trace_id), "routed");
            match frontend.respond(reply, id, answer.events, |_| {}).await {
                Ok(r) => r,
                Err(e) => e.into_response(),
            }
        }
        // A sluice worker only gets requests our OpenAI layer read.
        (None, _, _) => {
            return ApiError::unavailable("a worker answered a request it was not sent")
                .into_response();
        }
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

/// An OpenAI worker's answer as it came: status, content type, body bytes.
fn relayed_response(
    relayed: &upstream::Relayed,
    bytes: tokio::sync::mpsc::UnboundedReceiver<upstream::BodyChunk>,
) -> Response {
    let body =
        axum::body::Body::from_stream(tokio_stream::wrappers::UnboundedReceiverStream::new(bytes));
    let mut response = Response::new(body);
    *response.status_mut() =
        StatusCode::from_u16(relayed.status).unwrap_or(StatusCode::BAD_GATEWAY);
    if let Some(ct) = relayed
        .content_type
        .as_deref()
        .and_then(|c| HeaderValue::from_str(c).ok())
    {
        response
            .headers_mut()
            .insert(axum::http::header::CONTENT_TYPE, ct);
    }
    if relayed
        .content_type
        .as_deref()
        .is_some_and(|c| c.starts_with("text/event-stream"))
    {
        response.headers_mut().insert(
            axum::http::header::CACHE_CONTROL,
            HeaderValue::from_static("no-cache"),
        );
    }
    response
}

/// Asks the admission policy; waits in the queue if it says so, and asks
/// again each time the queue gives the request a place (as the WIT contract
/// says). A policy that keeps queueing is asked at most every
/// [`REQUEUE_PAUSE`]; the request deadline bounds it all.
async fn admit(
    gateway: &Arc<Gateway>,
    view: &RequestView,
    deadline: Instant,
) -> Result<Ticket, Failure> {
    let queue = &gateway.queue;
    let mut place: Option<Ticket> = None;
    loop {
        queue.set_capacity(gateway.capacity());
        let saturation = gateway.fleet.saturation(queue.waiting());
        let priority = match gateway.policies.admission.admit(view, &saturation) {
            AdmitDecision::Admit => return Ok(place.unwrap_or_else(|| queue.admit())),
            AdmitDecision::Reject(r) => {
                let done = rejected_completion(view);
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
                    .on_complete(&rejected_completion(view));
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
fn rejected_completion(view: &RequestView) -> crate::policy::Completion {
    crate::policy::Completion {
        tenant_id: view.tenant_id,
        session_hash: view.session_hash,
        priority: view.priority,
        prompt_tokens: view.prompt_tokens,
        cached_tokens: 0,
        output_tokens: 0,
        outcome: crate::policy::Outcome::Rejected,
        duration_us: 0,
    }
}
