//! The upstream stage: routes a request to a worker, sends it its token ids
//! (`POST /internal/generate`), and relays the worker's events to the answer.
//! Nothing reaches the client before the first token (streaming) or the whole
//! generation (not streaming), so until then a failed worker is excluded and
//! the request is routed again; after that, a failure ends the stream with an
//! error event. Every wait is bounded: the request deadline, and the idle
//! stream timeout between tokens.
//!
//! In a fleet with prefill-only workers a request takes two hops
//! (disaggregation, `disagg`): the router picks a decode worker (the decode
//! hop), and, unless the prompt's part not cached there is short, a prefill
//! worker (the prefill hop). The decode worker gets the request with
//! `remote_prefill`, reserves its blocks and names a transfer handle; the
//! prefill worker is then asked to prefill into them; the decode worker's
//! tokens are relayed as usual. A failed prefill hop excludes that prefill
//! worker and routes again (with none left, the decode worker prefills).
//!
//! A request routed to an OpenAI-compatible worker (`kind = "openai"`) is
//! forwarded and its answer relayed byte for byte (`passthrough`); the same
//! retry rule holds: until the first byte reaches the client.

pub mod conn;
mod lines;
pub mod passthrough;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Instant;

use futures_util::future::OptionFuture;

use sluice_backend::engine::{GenerateEvent, Usage};
use sluice_backend::server::{ApiError, PrefillDone};
use sluice_backend::transfer::KvTarget;
use tokio::sync::{mpsc, oneshot};

use crate::admission::Ticket;
use crate::config::WorkerKind;
use crate::gateway::Gateway;
use crate::policy::{AdmissionPolicy, Completion, Hop, Outcome, RequestView, RouteDecision};
use crate::routing::decision_log::DecisionRecord;
use crate::routing::{PromptKeys, Worker};
use crate::telemetry::{RequestOutcome, TraceContext};

/// What the answer's headers say, known once the first token is in.
#[derive(Clone, Debug)]
pub struct Head {
    pub worker: u32,
    /// Prompt blocks that were already cached on that worker.
    pub cached_blocks: u32,
    /// The router plugin version that chose it; `None` = the built-in policy.
    pub router_version: Option<u64>,
    /// The worker that prefilled the prompt, when it was not `worker`
    /// (disaggregation); `cached_blocks` are then that worker's.
    pub prefill_worker: Option<u32>,
    /// An OpenAI worker's answer, relayed as it is: its status and content
    /// type; the body comes through [`Answer::bytes`].
    pub relayed: Option<Relayed>,
}

/// The head of an answer relayed from an OpenAI worker.
#[derive(Clone, Debug)]
pub struct Relayed {
    pub status: u16,
    pub content_type: Option<String>,
}

/// Body bytes of a relayed answer; an error cuts it short.
pub type BodyChunk = Result<bytes::Bytes, std::io::Error>;

/// One admitted request on its way to a worker.
#[derive(Debug)]
pub struct Job {
    /// The `/internal/generate` body (empty when the request cannot go to
    /// sluice workers: `keys.sluice` is `None`).
    pub body: bytes::Bytes,
    /// The client's request as OpenAI workers get it, when it may go to one.
    pub passthrough: Option<passthrough::Passthrough>,
    pub view: RequestView,
    /// The prompt's block hashes, per kind of worker it may go to.
    pub keys: PromptKeys,
    pub stream: bool,
    pub trace: TraceContext,
    pub arrived: Instant,
    pub deadline: Instant,
    pub ticket: Ticket,
}

/// How one attempt on one worker ended.
enum Attempt {
    Finished(Usage),
    /// Nothing was sent to the client: another worker may take the request
    /// (this one, by id, is excluded).
    Retry(String, u32),
    /// The worker refused the request itself (bad input): no retry.
    Refused(ApiError),
    /// Failed after the client got the head; the stream ended with an error.
    Broken(RequestOutcome),
    /// An OpenAI worker's refusal (this status) was relayed to the client.
    Relayed(u16),
    ClientGone,
}

/// What the answer reads: the head (or why the request failed before any
/// answer), after which `events` carries the rest.
#[derive(Debug)]
pub struct Answer {
    pub head: oneshot::Receiver<Result<Head, ApiError>>,
    pub events: mpsc::UnboundedReceiver<GenerateEvent>,
    /// A relayed answer's body.
    pub bytes: mpsc::UnboundedReceiver<BodyChunk>,
}

/// The relay's ends of the answer's channels.
#[derive(Debug)]
pub struct RelayEnds {
    head: oneshot::Sender<Result<Head, ApiError>>,
    events: mpsc::UnboundedSender<GenerateEvent>,
    bytes: mpsc::UnboundedSender<BodyChunk>,
}

/// A connected pair of ends.
pub fn channels() -> (RelayEnds, Answer) {
    let (head_tx, head) = oneshot::channel();
    let (events_tx, events) = mpsc::unbounded_channel();
    let (bytes_tx, bytes) = mpsc::unbounded_channel();
    (
        RelayEnds {
            head: head_tx,
            events: events_tx,
            bytes: bytes_tx,
        },
        Answer {
            head,
            events,
            bytes,
        },
    )
}

/// Counts a request's end exactly once: at the end of the relay, or (when
/// the relay is dropped because its client went away) as cancelled.
struct Accounting<'a> {
    gateway: &'a Gateway,
    view: RequestView,
    arrived: Instant,
    done: bool,
}

impl Accounting<'_> {
    fn finish(&mut self, outcome: RequestOutcome, usage: Usage) {
        self.done = true;
        let elapsed = self.arrived.elapsed();
        let gateway = self.gateway;
        gateway.metrics.request_done(outcome, elapsed.as_secs_f64());
        gateway.policies.admission.on_complete(&Completion {
            tenant_id: self.view.tenant_id,
            session_hash: self.view.session_hash,
            priority: self.view.priority,
            prompt_tokens: self.view.prompt_tokens,
            cached_tokens: usage.cached_tokens,
            output_tokens: usage.completion_tokens,
            outcome: match outcome {
                RequestOutcome::success => Outcome::Success,
                RequestOutcome::cancelled => Outcome::Cancelled,
                RequestOutcome::rejected => Outcome::Rejected,
                _ => Outcome::Failed,
            },
            duration_us: elapsed.as_micros() as u64,
        });
    }
}

impl Drop for Accounting<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.finish(RequestOutcome::cancelled, Usage::default());
        }
    }
}

/// Route, send, retry before the head, then relay. Spawned for a streaming
/// answer; run inside the handler's own task for a non-streaming one.
pub async fn relay(gateway: Arc<Gateway>, job: Job, ends: RelayEnds) {
    let RelayEnds {
        head: head_tx,
        events,
        bytes,
    } = ends;
    let mut accounting = Accounting {
        gateway: &gateway,
        view: job.view,
        arrived: job.arrived,
        done: false,
    };
    let out = Output {
        head: Some(head_tx),
        events,
        bytes,
        relaying: false,
        buffered: Vec::new(),
        stream: job.stream,
        last: None,
    };
    relay_inner(&gateway, &job, out, &mut accounting).await;
}

async fn relay_inner(
    gateway: &Gateway,
    job: &Job,
    mut out: Output,
    accounting: &mut Accounting<'_>,
) {
    let mut excluded: Vec<u32> = Vec::new();
    let mut usage = Usage::default();
    let outcome = loop {
        if excluded.len() as u32 >= gateway.config.fleet.max_attempts {
            out.fail(ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                format!("{} workers failed this request", excluded.len()),
            ));
            break RequestOutcome::failed;
        }
        let route = match route(gateway, job, &excluded) {
            Ok(r) => r,
            Err(NoRoute::NoWorker) => {
                out.fail(ApiError::unavailable(if excluded.is_empty() {
                    "no healthy worker serves this model".to_string()
                } else {
                    format!("no healthy worker is left after {} failed", excluded.len())
                }));
                break RequestOutcome::failed;
            }
            Err(NoRoute::Refused(error, outcome)) => {
                out.fail(error);
                break outcome;
            }
        };
        for hop in std::iter::once(&route.decode).chain(&route.prefill) {
            hop.worker.routed.fetch_add(1, Ordering::Relaxed);
            gateway.metrics.routed(hop.worker.id);
            // Approximate mode: the gateway's routing is its knowledge.
            if let Some(hashes) = job.keys.of(hop.worker.kind()) {
                gateway.fleet.predict(&hop.worker, hashes);
            }
        }
        let attempt = {
            let block_size = job.view.block_size.max(1);
            // With a prefill hop, the decode worker prefills one token.
            let prefill_tokens = match route.prefill {
                Some(_) => 0,
                None => job
                    .view
                    .prompt_tokens
                    .saturating_sub(route.decode.cached_blocks.saturating_mul(block_size)),
            };
            let in_flight = InFlight::enter(
                &route.decode.worker,
                job.view.prompt_tokens.div_ceil(block_size),
                prefill_tokens,
            );
            match route.decode.worker.kind() {
                WorkerKind::Sluice => attempt(gateway, job, &route, &mut out, &in_flight).await,
                WorkerKind::Openai => {
                    out.buffered.clear();
                    passthrough::attempt(
                        gateway,
                        job,
                        &route.decode.worker,
                        route.decode.cached_blocks,
                        route.decode.router_version,
                        &mut out,
                        &in_flight,
                    )
                    .await
                }
            }
        };
        match attempt {
            Attempt::Finished(u) => {
                usage = u;
                break RequestOutcome::success;
            }
            Attempt::Retry(why, failed) => {
                tracing::warn!(worker = failed, error = %why, "worker failed before the first token; routing again");
                gateway.metrics.retried();
                excluded.push(failed);
            }
            Attempt::Refused(e) => {
                out.fail(e);
                break RequestOutcome::invalid;
            }
            Attempt::Broken(outcome) => break outcome,
            Attempt::Relayed(status) => {
                tracing::debug!(
                    status,
                    "the worker refused the request; its answer was relayed"
                );
                break RequestOutcome::invalid;
            }
            Attempt::ClientGone => break RequestOutcome::cancelled,
        }
        if Instant::now() >= job.deadline {
            out.fail(timeout_error());
            break RequestOutcome::timeout;
        }
    };
    accounting.finish(outcome, usage);
    out.close();
}

/// The worker one hop goes to, and what the router saw of it.
#[derive(Debug)]
struct Chosen {
    worker: Arc<Worker>,
    /// Prompt blocks cached there, by the gateway's KV index.
    cached_blocks: u32,
    router_version: Option<u64>,
}

/// Where a request goes: one worker, or a prefill worker and a decode worker.
#[derive(Debug)]
struct Route {
    /// The worker that generates (and, without `prefill`, prefills).
    decode: Chosen,
    prefill: Option<Chosen>,
}

enum NoRoute {
    /// No healthy worker (not excluded) serves the hop.
    NoWorker,
    /// The router refused the request, or answered nonsense.
    Refused(ApiError, RequestOutcome),
}

/// Picks the request's route: one aggregated hop in a fleet where every
/// worker does both; otherwise the decode hop, then (when the prompt's part
/// not cached on that decode worker is long enough) the prefill hop.
fn route(gateway: &Gateway, job: &Job, excluded: &[u32]) -> Result<Route, NoRoute> {
    if !gateway.fleet.disaggregated() {
        let decode = choose(gateway, job, Hop::Aggregated, excluded)?;
        return Ok(Route {
            decode,
            prefill: None,
        });
    }
    let decode = choose(gateway, job, Hop::Decode, excluded)?;
    let uncached = job
        .view
        .prompt_tokens
        .saturating_sub(decode.cached_blocks.saturating_mul(job.view.block_size));
    if uncached < gateway.config.disaggregation.min_prefill_tokens.max(1)
        || job.view.prompt_tokens < 2
    {
        return Ok(Route {
            decode,
            prefill: None,
        });
    }
    let mut not_prefill = excluded.to_vec();
    not_prefill.push(decode.worker.id);
    let prefill = match choose(gateway, job, Hop::Prefill, &not_prefill) {
        Ok(p) => Some(p),
        // Decode workers prefill for themselves.
        Err(NoRoute::NoWorker) => None,
        Err(refused) => return Err(refused),
    };
    Ok(Route { decode, prefill })
}

/// Asks the router for one hop's worker among the candidates for it.
fn choose(gateway: &Gateway, job: &Job, hop: Hop, excluded: &[u32]) -> Result<Chosen, NoRoute> {
    let view = RequestView { hop, ..job.view };
    let candidates = gateway.fleet.candidates(&job.keys, excluded, hop);
    if candidates.workers.is_empty() {
        return Err(NoRoute::NoWorker);
    }
    let (decision, router_version) = gateway
        .policies
        .router
        .route_traced(&view, &candidates.view);
    gateway
        .policies
        .shadow
        .observe(&view, &candidates.view, &decision);
    if let Some(log) = &gateway.decision_log {
        log.record(DecisionRecord::new(
            &view,
            &candidates.view,
            &decision,
            router_version,
        ));
    }
    let index = match decision {
        RouteDecision::Worker(i) => i,
        RouteDecision::Reject(r) => {
            return Err(NoRoute::Refused(
                ApiError::with_code(
                    Some(r.status),
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    r.message,
                ),
                RequestOutcome::rejected,
            ));
        }
    };
    // The host checks a plugin's answer; the built-in router answers in
    // range. Guarded all the same: a bad index must not panic a thread.
    let Some(worker) = candidates.workers.get(index).cloned() else {
        return Err(NoRoute::Refused(
            ApiError::new(
                axum::http::StatusCode::BAD_GATEWAY,
                format!(
                    "the router chose worker index {index} of {}",
                    candidates.workers.len()
                ),
            ),
            RequestOutcome::failed,
        ));
    };
    let cached_blocks = candidates
        .view
        .overlap_blocks()
        .get(index)
        .copied()
        .unwrap_or(0);
    Ok(Chosen {
        worker,
        cached_blocks,
        router_version,
    })
}

fn timeout_error() -> ApiError {
    ApiError::new(
        axum::http::StatusCode::GATEWAY_TIMEOUT,
        "the request timed out",
    )
}

/// Counts a request (and its prompt's KV blocks) running on a worker for as
/// long as it lives, and its uncached prompt tokens as prefill queued there
/// until its first token comes back.
struct InFlight<'a> {
    worker: &'a Worker,
    blocks: u32,
    /// Prefill tokens still counted on the worker (0 once prefilled).
    prefill: AtomicU32,
}

impl<'a> InFlight<'a> {
    fn enter(worker: &'a Worker, blocks: u32, prefill_tokens: u32) -> Self {
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        worker.in_flight_blocks.fetch_add(blocks, Ordering::Relaxed);
        worker
            .pending_prefill_tokens
            .fetch_add(prefill_tokens, Ordering::Relaxed);
        Self {
            worker,
            blocks,
            prefill: AtomicU32::new(prefill_tokens),
        }
    }

    /// The prompt is prefilled (its first token is here).
    fn prefilled(&self) {
        let tokens = self.prefill.swap(0, Ordering::Relaxed);
        self.worker
            .pending_prefill_tokens
            .fetch_sub(tokens, Ordering::Relaxed);
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.prefilled();
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.worker
            .in_flight_blocks
            .fetch_sub(self.blocks, Ordering::Relaxed);
    }
}

/// Where the relay's output goes: events are held back until the head is
/// sent, so an attempt can be abandoned without the client seeing it; the
/// last word (the finish, or the failure) is held until the request has been
/// counted, so a client that reads the metrics next sees its request there.
struct Output {
    head: Option<oneshot::Sender<Result<Head, ApiError>>>,
    events: mpsc::UnboundedSender<GenerateEvent>,
    /// A relayed answer's body (sent as it comes: nothing is held back
    /// after the head).
    bytes: mpsc::UnboundedSender<BodyChunk>,
    /// The answer is a relayed one (its client reads `bytes`).
    relaying: bool,
    buffered: Vec<GenerateEvent>,
    stream: bool,
    last: Option<Last>,
}

/// How the answer ends.
enum Last {
    Finished(Head, GenerateEvent),
    Failure(ApiError),
}

impl Output {
    fn started(&self) -> bool {
        self.head.is_none()
    }

    /// Sends the head and what was held back; false if the client is gone.
    fn open(&mut self, head: Head) -> bool {
        let Some(tx) = self.head.take() else {
            return true;
        };
        if tx.send(Ok(head)).is_err() {
            return false;
        }
        self.buffered.drain(..).all(|e| self.events.send(e).is_ok())
    }

    /// Opens a relayed answer: its body comes as bytes.
    fn open_relayed(&mut self, head: Head) -> bool {
        self.relaying = true;
        self.open(head)
    }

    /// Relays body bytes (after the head); false if the client is gone.
    fn send_bytes(&mut self, bytes: bytes::Bytes) -> bool {
        self.bytes.send(Ok(bytes)).is_ok()
    }

    /// Cuts a relayed body short.
    fn abort_bytes(&mut self, why: &str) {
        let _ = self.bytes.send(Err(std::io::Error::other(why.to_string())));
    }

    fn send(&mut self, event: GenerateEvent) -> bool {
        if self.started() {
            self.events.send(event).is_ok()
        } else {
            self.buffered.push(event);
            true
        }
    }

    /// Fails the request (when [`Output::close`] runs): before the head, with
    /// an error answer; after it, with an error event.
    fn fail(&mut self, error: ApiError) {
        if self.last.is_none() {
            self.last = Some(Last::Failure(error));
        }
    }

    /// Sends the last word.
    fn close(mut self) {
        match self.last.take() {
            Some(Last::Finished(head, event)) => {
                let _ = self.open(head) && self.events.send(event).is_ok();
            }
            Some(Last::Failure(error)) => match self.head.take() {
                Some(tx) => {
                    let _ = tx.send(Err(error));
                }
                None => {
                    let _ = self.events.send(GenerateEvent::Error {
                        message: error.message,
                        status: Some(error.status.as_u16()),
                    });
                }
            },
            None => {}
        }
    }

    /// Resolves when the client has gone away.
    async fn client_gone(&mut self) {
        match &mut self.head {
            Some(tx) => tx.closed().await,
            None if self.relaying => self.bytes.closed().await,
            None => self.events.closed().await,
        }
    }
}

/// One try on one route: the decode worker's stream, and (disaggregated)
/// the prefill worker's call once the decode worker has reserved blocks.
async fn attempt(
    gateway: &Gateway,
    job: &Job,
    route: &Route,
    out: &mut Output,
    in_flight: &InFlight<'_>,
) -> Attempt {
    out.buffered.clear();
    let worker = &*route.decode.worker;
    let body = match route.prefill {
        Some(_) => with_remote_prefill(&job.body),
        None => job.body.clone(),
    };
    let endpoint = match worker.endpoint() {
        Ok(endpoint) => endpoint,
        Err(e) => return Attempt::Retry(format!("bad URL: {e}"), worker.id),
    };
    let traceparent = job.trace.header();
    let request = conn::post_json(
        &endpoint.authority,
        &endpoint.generate_path,
        &traceparent,
        body,
        gateway.config.fleet.connect_timeout(),
    );
    let response = tokio::select! {
        r = tokio::time::timeout_at(job.deadline.into(), request) => r,
        () = out.client_gone() => return Attempt::ClientGone,
    };
    let mut response = match response {
        Err(_) => return Attempt::Broken(timed_out(out)),
        Ok(Err(e)) => return Attempt::Retry(format!("cannot send: {e}"), worker.id),
        Ok(Ok(r)) => r,
    };
    if response.new_connection() {
        gateway.metrics.worker_connection_opened();
    }
    let status = response.status();
    if !status.is_success() && !refused_by_worker(status.as_u16()) {
        // Unavailable, overloaded, or not a worker at that URL: another may do.
        return Attempt::Retry(format!("it answered {status}"), worker.id);
    }
    if !status.is_success() {
        return Attempt::Refused(error_answer(job, response).await);
    }
    let idle = gateway.config.limits.idle_stream_timeout();
    let block_size = job.view.block_size.max(1);
    let mut head = Head {
        worker: worker.id,
        cached_blocks: 0,
        router_version: route.decode.router_version,
        prefill_worker: None,
        relayed: None,
    };
    let mut lines = lines::Lines::default();
    let mut last_token: Option<Instant> = None;
    // The prefill hop's call, from the decode worker's `awaiting_kv` until
    // the prefill worker answers; the head waits for it (its cached blocks).
    let mut prefill_call: Option<PrefillCall<'_>> = None;
    let mut prefill_cached: Option<u32> = None;
    loop {
        // Before the first token the request deadline bounds the wait (the
        // worker may be queueing it); after it, the idle timeout does too.
        let wait_until = match last_token {
            None => job.deadline,
            Some(t) => (t + idle).min(job.deadline),
        };
        let chunk = tokio::select! {
            c = tokio::time::timeout_at(wait_until.into(), response.chunk()) => c,
            () = out.client_gone() => return Attempt::ClientGone,
            r = OptionFuture::from(prefill_call.as_mut()), if prefill_call.is_some() => {
                prefill_call = None;
                let (prefill, result) = r.expect("the branch runs only with a call");
                match result {
                    Ok(cached) => {
                        prefill_cached = Some(cached);
                        head.prefill_worker = Some(prefill);
                        head.cached_blocks = cached / block_size;
                        gateway.metrics.kv_blocks(
                            job.view.prompt_blocks,
                            head.cached_blocks.min(job.view.prompt_blocks),
                        );
                        // Tokens that came first were held for the head.
                        if out.stream && last_token.is_some() && !out.open(head.clone()) {
                            return Attempt::ClientGone;
                        }
                    }
                    // The decode worker has every block already: a late
                    // failure of the prefill worker's answer changes nothing.
                    Err(why) if last_token.is_some() => {
                        tracing::warn!(worker = prefill, error = %why, "prefill worker failed after its transfer");
                    }
                    Err(why) => return Attempt::Retry(format!("prefill: {why}"), prefill),
                }
                continue;
            }
        };
        let chunk = match chunk {
            Err(_) if Instant::now() >= job.deadline || out.started() => {
                return Attempt::Broken(timed_out(out));
            }
            Err(_) => return Attempt::Retry(format!("no token for {idle:?}"), worker.id),
            Ok(None) => return lost(out, worker, "its stream ended early".into()),
            Ok(Some(Err(e))) => return lost(out, worker, format!("its stream broke: {e}")),
            Ok(Some(Ok(c))) => c,
        };
        lines.push(&chunk);
        while let Some(line) = lines.next_line() {
            // (UTF-8 checked once a line, not once a string as `from_slice` does.)
            let event: GenerateEvent = match std::str::from_utf8(line) {
                Ok(line) => match GenerateEvent::from_line(line) {
                    Ok(e) => e,
                    Err(e) => return lost(out, worker, format!("bad event: {e}")),
                },
                Err(e) => return lost(out, worker, format!("bad event: not UTF-8 ({e})")),
            };
            match &event {
                GenerateEvent::Started { cached_tokens, .. } => {
                    head.cached_blocks = cached_tokens / block_size;
                    // Disaggregated, the prefill worker's cache counts.
                    if route.prefill.is_none() {
                        gateway.metrics.kv_blocks(
                            job.view.prompt_blocks,
                            head.cached_blocks.min(job.view.prompt_blocks),
                        );
                    }
                }
                GenerateEvent::Token(_) => {
                    let now = Instant::now();
                    match last_token {
                        None => {
                            in_flight.prefilled();
                            gateway
                                .metrics
                                .first_token(now.duration_since(job.arrived).as_secs_f64());
                        }
                        Some(t) => gateway
                            .metrics
                            .next_token(now.duration_since(t).as_secs_f64()),
                    }
                    last_token = Some(now);
                }
                GenerateEvent::AwaitingKv { .. }
                | GenerateEvent::Finished { .. }
                | GenerateEvent::Error { .. } => {}
            }
            match event {
                GenerateEvent::AwaitingKv {
                    handle,
                    from_block,
                    blocks,
                    addr,
                } => match &route.prefill {
                    Some(prefill) if blocks > 0 => {
                        let target = KvTarget {
                            addr,
                            handle,
                            from_block,
                        };
                        prefill_call = Some(Box::pin(call_prefill(gateway, job, prefill, target)));
                    }
                    // Everything is cached on the decode worker.
                    Some(_) => gateway.metrics.kv_blocks(
                        job.view.prompt_blocks,
                        head.cached_blocks.min(job.view.prompt_blocks),
                    ),
                    None => return lost(out, worker, "it awaits KV nobody sends".into()),
                },
                GenerateEvent::Token(t) => {
                    let ok = out.send(GenerateEvent::Token(t))
                        && (!out.stream || prefill_call.is_some() || out.open(head.clone()));
                    if !ok {
                        return Attempt::ClientGone;
                    }
                }
                GenerateEvent::Finished {
                    reason,
                    text,
                    mut usage,
                } => {
                    if let Some(call) = prefill_call.take() {
                        // Finished before the prefill worker's answer came:
                        // wait (briefly) for its cached blocks.
                        let wait = job.deadline.min(Instant::now() + ERROR_BODY_WAIT);
                        if let Ok((prefill, Ok(cached))) =
                            tokio::time::timeout_at(wait.into(), call).await
                        {
                            prefill_cached = Some(cached);
                            head.prefill_worker = Some(prefill);
                            head.cached_blocks = cached / block_size;
                        }
                    }
                    if let Some(cached) = prefill_cached {
                        usage.cached_tokens = cached;
                    }
                    response.release();
                    // Sent after the request is counted (see `Output::close`).
                    out.last = Some(Last::Finished(
                        head,
                        GenerateEvent::Finished {
                            reason,
                            text,
                            usage,
                        },
                    ));
                    return Attempt::Finished(usage);
                }
                // The worker's stream ends with its error: the connection
                // can serve another request.
                GenerateEvent::Error { message, status }
                    if !out.started() && !status.is_none_or(refused_by_worker) =>
                {
                    response.release();
                    // During a transfer, the decode worker's failure is the
                    // transfer's: the prefill worker is the one excluded.
                    let failed = match (&route.prefill, &prefill_call) {
                        (Some(prefill), Some(_)) => prefill.worker.id,
                        _ => worker.id,
                    };
                    return Attempt::Retry(format!("it failed the request: {message}"), failed);
                }
                GenerateEvent::Error { message, status } if !out.started() => {
                    response.release();
                    return Attempt::Refused(ApiError::with_code(
                        status,
                        axum::http::StatusCode::BAD_REQUEST,
                        message,
                    ));
                }
                GenerateEvent::Error { message, status } => {
                    response.release();
                    out.fail(ApiError::with_code(
                        status,
                        axum::http::StatusCode::BAD_GATEWAY,
                        message,
                    ));
                    return Attempt::Broken(RequestOutcome::failed);
                }
                started @ GenerateEvent::Started { .. } => {
                    out.send(started);
                }
            }
        }
    }
}

/// The prefill hop in flight: resolves to (prefill worker id, its cached
/// prompt tokens or why it failed).
type PrefillCall<'a> = Pin<Box<dyn Future<Output = (u32, Result<u32, String>)> + Send + 'a>>;

/// Asks the prefill worker to prefill the request into the decode worker's
/// reserved blocks; counts the prefill queued there while it runs.
async fn call_prefill(
    gateway: &Gateway,
    job: &Job,
    prefill: &Chosen,
    target: KvTarget,
) -> (u32, Result<u32, String>) {
    let worker = &*prefill.worker;
    let block_size = job.view.block_size.max(1);
    let _in_flight = InFlight::enter(
        worker,
        job.view.prompt_tokens.div_ceil(block_size),
        job.view
            .prompt_tokens
            .saturating_sub(prefill.cached_blocks.saturating_mul(block_size)),
    );
    let result = async {
        let target = serde_json::to_vec(&target).map_err(|e| e.to_string())?;
        // `{"request": <the generate body>, "target": ...}` without parsing
        // the body again.
        let mut body = Vec::with_capacity(job.body.len() + target.len() + 32);
        body.extend_from_slice(br#"{"request":"#);
        body.extend_from_slice(&job.body);
        body.extend_from_slice(br#","target":"#);
        body.extend_from_slice(&target);
        body.push(b'}');
        let endpoint = worker.endpoint().map_err(|e| format!("bad URL: {e}"))?;
        let traceparent = job.trace.header();
        let request = conn::post_json(
            &endpoint.authority,
            &endpoint.prefill_path,
            &traceparent,
            body.into(),
            gateway.config.fleet.connect_timeout(),
        );
        let response = tokio::time::timeout_at(job.deadline.into(), request)
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|e| format!("cannot send: {e}"))?;
        if response.new_connection() {
            gateway.metrics.worker_connection_opened();
        }
        if !response.status().is_success() {
            return Err(error_answer(job, response).await.message);
        }
        let answer = tokio::time::timeout_at(job.deadline.into(), response.bytes(ANSWER_LIMIT))
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|e| format!("bad answer: {e}"))?;
        let done: PrefillDone =
            serde_json::from_slice(&answer).map_err(|e| format!("bad answer: {e}"))?;
        tracing::debug!(
            worker = worker.id,
            cached_tokens = done.cached_tokens,
            blocks = done.pushed.blocks,
            bytes = done.pushed.bytes,
            transfer_ms = done.pushed.seconds * 1e3,
            prefill_ms = done.seconds * 1e3,
            "prefilled"
        );
        Ok(done.cached_tokens)
    }
    .await;
    (worker.id, result)
}

/// The generate body with `"remote_prefill": true` (the body is a JSON
/// object, as the preprocess stage wrote it).
fn with_remote_prefill(body: &bytes::Bytes) -> bytes::Bytes {
    debug_assert_eq!(body.first(), Some(&b'{'));
    let mut out = Vec::with_capacity(body.len() + 24);
    out.extend_from_slice(br#"{"remote_prefill":true,"#);
    out.extend_from_slice(&body[1..]);
    out.into()
}

/// The error a refusing worker gave, as ours.
async fn error_answer(job: &Job, response: conn::Answer) -> ApiError {
    let status = response.status();
    let body = tokio::time::timeout_at(
        job.deadline.min(Instant::now() + ERROR_BODY_WAIT).into(),
        response.bytes(ANSWER_LIMIT),
    )
    .await;
    let message = body
        .ok()
        .and_then(Result::ok)
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| v["error"]["message"].as_str().map(String::from))
        .unwrap_or_else(|| format!("the worker answered {status}"));
    ApiError::with_code(
        Some(status.as_u16()),
        axum::http::StatusCode::BAD_GATEWAY,
        message,
    )
}

/// The most a worker's whole answer (an error, a prefill's report) may be.
const ANSWER_LIMIT: usize = 1 << 20;

/// How long the error body of a refusing worker is waited for.
const ERROR_BODY_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Statuses that mean the request itself is at fault (every worker would
/// refuse it): passed on to the client. Anything else is the worker's problem
/// and another worker is tried.
fn refused_by_worker(status: u16) -> bool {
    matches!(status, 400 | 413 | 422)
}

/// A worker failed mid-request: retry if the client has seen nothing.
fn lost(out: &mut Output, worker: &Worker, why: String) -> Attempt {
    if !out.started() {
        return Attempt::Retry(why, worker.id);
    }
    tracing::warn!(worker = worker.id, error = %why, "worker failed mid-stream");
    out.fail(ApiError::new(
        axum::http::StatusCode::BAD_GATEWAY,
        format!("worker {} failed mid-stream: {why}", worker.id),
    ));
    Attempt::Broken(RequestOutcome::failed)
}

fn timed_out(out: &mut Output) -> RequestOutcome {
    out.fail(timeout_error());
    RequestOutcome::timeout
}
