//! The OpenAI endpoints of a worker: `/v1/chat/completions`, `/v1/completions`
//! and `/v1/models`, streaming (SSE) and not, with usage, finish reasons,
//! logprobs and OpenAI-shaped errors. A worker is usable on its own.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::WorkerState;
use super::error::ApiError;
use crate::engine::{
    FinishReason, GenerateEvent, GenerateRequest, SamplingParams, TokenOut, Usage,
};
use crate::model::ChatMessage;

/// Stop sequences: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// Chat message content: a string, or a list of parts of which only text is read.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
}

#[derive(Debug, Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The fields chat and completions share.
#[derive(Debug, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Not in OpenAI's API; vLLM and SGLang accept it too.
    pub top_k: Option<u32>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    /// Not in OpenAI's API: token ids that end generation.
    #[serde(default)]
    pub stop_token_ids: Vec<u32>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub n: Option<u32>,
    /// Not in OpenAI's API: generate past end tokens (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
}

/// A completions prompt: text or token ids (one prompt only).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Legacy logprobs: how many alternatives per position (0 = only the chosen).
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub common: Common,
}

/// Longest stop list accepted.
const MAX_STOPS: usize = 16;

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Parses a JSON body into `T`, with OpenAI-shaped errors.
/// Reads a JSON body (at most [`super::MAX_BODY_BYTES`]) into `T`, with
/// OpenAI-shaped errors: 413 for an oversize body, 400 for bad JSON.
pub async fn parse<T: serde::de::DeserializeOwned>(body: axum::body::Body) -> Result<T, ApiError> {
    let bytes = axum::body::to_bytes(body, super::MAX_BODY_BYTES)
        .await
        .map_err(|_| ApiError {
            status: axum::http::StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("the request body is over {} bytes", super::MAX_BODY_BYTES),
            param: None,
        })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}"), None))
}

/// Checks the shared fields and builds the engine request around `prompt`.
fn build_request(
    state: &WorkerState,
    common: &Common,
    prompt: Vec<u32>,
    logprobs: bool,
    top_logprobs: u32,
) -> Result<GenerateRequest, ApiError> {
    if let Some(model) = &common.model
        && !model.is_empty()
        && *model != state.model_name
    {
        return Err(ApiError::not_found(format!(
            "model `{model}` is not served here (this worker serves `{}`)",
            state.model_name
        )));
    }
    if common.n.unwrap_or(1) != 1 {
        return Err(ApiError::invalid("only n=1 is supported", Some("n")));
    }
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
    }
    let context = state.engine.model.config.context;
    if prompt.len() >= context {
        return Err(ApiError::invalid(
            format!(
                "the prompt has {} tokens; the model's context is {context}",
                prompt.len()
            ),
            Some("messages"),
        ));
    }
    let room = (context - prompt.len()) as u32;
    let max_tokens = match common.max_completion_tokens.or(common.max_tokens) {
        Some(0) => {
            return Err(ApiError::invalid(
                "max_tokens must be at least 1",
                Some("max_tokens"),
            ));
        }
        Some(m) if m > room => {
            return Err(ApiError::invalid(
                format!(
                    "max_tokens {m} plus the prompt's {} tokens is over the model's context of {context}",
                    prompt.len()
                ),
                Some("max_tokens"),
            ));
        }
        Some(m) => m,
        None => room,
    };
    let stop_strings = match &common.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop_strings.len() > MAX_STOPS {
        return Err(ApiError::invalid(
            format!("at most {MAX_STOPS} stop sequences"),
            Some("stop"),
        ));
    }
    let vocab = state.engine.model.config.vocab as u32;
    if let Some(&bad) = common.stop_token_ids.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::invalid(
            format!("stop token id {bad} is outside the vocabulary"),
            Some("stop_token_ids"),
        ));
    }
    let defaults = SamplingParams::default();
    let sampling = SamplingParams {
        temperature: common.temperature.unwrap_or(defaults.temperature),
        top_p: common.top_p.unwrap_or(defaults.top_p),
        top_k: common.top_k.unwrap_or(defaults.top_k),
        seed: common.seed,
        presence_penalty: common.presence_penalty.unwrap_or(0.0),
        frequency_penalty: common.frequency_penalty.unwrap_or(0.0),
        logprobs,
        top_logprobs,
    };
    sampling
        .validate()
        .map_err(|m| ApiError::invalid(m, None))?;
    Ok(GenerateRequest {
        prompt,
        sampling,
        max_tokens,
        stop_ids: common.stop_token_ids.clone(),
        stop_strings,
        ignore_eos: common.ignore_eos,
        cache_salt: 0,
        cache_priority: 0,
        tenant_id: 0,
    })
}

/// The text of a chat message's content.
fn content_text(content: &Option<Content>) -> Result<String, ApiError> {
    match content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => parts
            .iter()
            .map(|p| match (p.kind.as_str(), &p.text) {
                ("text", Some(t)) => Ok(t.as_str()),
                (kind, _) => Err(ApiError::invalid(
                    format!("content part of type `{kind}` is not supported (text only)"),
                    Some("messages"),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.concat()),
    }
}

/// The prompt's token ids for a chat request (template, then tokenizer).
pub fn chat_prompt(state: &WorkerState, request: &ChatRequest) -> Result<Vec<u32>, ApiError> {
    if request.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let messages = request
        .messages
        .iter()
        .map(|m| {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "developer" | "tool"
            ) {
                return Err(ApiError::invalid(
                    format!("unknown role `{}`", m.role),
                    Some("messages"),
                ));
            }
            Ok(ChatMessage {
                role: if m.role == "developer" {
                    "system".into()
                } else {
                    m.role.clone()
                },
                content: content_text(&m.content)?,
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let tok = &state.engine.tokenizer;
    let text = tok
        .apply_chat_template(&messages, true)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    tok.encode(&text)
        .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn finish_str(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    }
}

/// The chat `logprobs.content` entry of one token.
fn chat_logprob(state: &WorkerState, t: &TokenOut) -> Value {
    let text = state
        .engine
        .tokenizer
        .decode(&[t.id], false)
        .unwrap_or_default();
    json!({
        "token": text,
        "logprob": t.logprob,
        "bytes": text.as_bytes(),
        "top_logprobs": t.top.iter().map(|(_, s, lp)| json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})).collect::<Vec<_>>(),
    })
}

/// The whole generation, for non-streaming answers.
struct Collected {
    text: String,
    tokens: Vec<TokenOut>,
    reason: FinishReason,
    usage: Usage,
}

async fn collect(mut rx: UnboundedReceiver<GenerateEvent>) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    while let Some(event) = rx.recv().await {
        match event {
            GenerateEvent::Started { .. } => {}
            GenerateEvent::Token(t) => {
                text.push_str(&t.text);
                tokens.push(t);
            }
            GenerateEvent::Finished {
                reason,
                text: rest,
                usage,
            } => {
                text.push_str(&rest);
                return Ok(Collected {
                    text,
                    tokens,
                    reason,
                    usage,
                });
            }
            GenerateEvent::Error { message } => return Err(ApiError::invalid(message, None)),
        }
    }
    Err(ApiError::unavailable(
        "the engine stopped before the request finished",
    ))
}

/// Which endpoint a stream is for.
#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Completion,
}

/// An SSE stream of OpenAI chunks, ending with `[DONE]`.
fn stream(
    state: Arc<WorkerState>,
    rx: UnboundedReceiver<GenerateEvent>,
    kind: Kind,
    id: String,
    include_usage: bool,
    logprobs: bool,
) -> Response {
    let created = now_secs();
    let model = state.model_name.clone();
    let state_for_metrics = state.clone();
    let object = match kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Completion => "text_completion",
    };
    let chunk = move |choices: Value, usage: Option<Value>| {
        let mut c = json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
        if let Some(u) = usage {
            c["usage"] = u;
        }
        Event::default().data(c.to_string())
    };
    let to_events = move |event: GenerateEvent| -> Vec<Event> {
        match event {
            GenerateEvent::Started { .. } => match kind {
                Kind::Chat => vec![chunk(
                    json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                    None,
                )],
                Kind::Completion => vec![],
            },
            GenerateEvent::Token(t) => {
                let lp = logprobs.then(|| match kind {
                    Kind::Chat => json!({"content": [chat_logprob(&state, &t)]}),
                    Kind::Completion => completion_logprobs(&state, std::slice::from_ref(&t)),
                });
                if t.text.is_empty() && lp.is_none() {
                    vec![]
                } else {
                    vec![chunk(
                        match kind {
                            Kind::Chat => {
                                json!([{"index": 0, "delta": {"content": t.text}, "logprobs": lp, "finish_reason": null}])
                            }
                            Kind::Completion => {
                                json!([{"index": 0, "text": t.text, "logprobs": lp, "finish_reason": null}])
                            }
                        },
                        None,
                    )]
                }
            }
            GenerateEvent::Finished {
                reason,
                text,
                usage,
            } => {
                let last = match kind {
                    Kind::Chat => {
                        json!([{"index": 0, "delta": {"content": text}, "logprobs": null, "finish_reason": finish_str(reason)}])
                    }
                    Kind::Completion => {
                        json!([{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_str(reason)}])
                    }
                };
                let mut out = vec![chunk(last, None)];
                if include_usage {
                    out.push(chunk(json!([]), Some(usage_json(&usage))));
                }
                out.push(Event::default().data("[DONE]"));
                out
            }
            GenerateEvent::Error { message } => vec![
                Event::default().data(ApiError::invalid(message, None).body().to_string()),
                Event::default().data("[DONE]"),
            ],
        }
    };
    // A task turns engine events into SSE events; when the client goes away
    // the channel closes, the task drops the engine's receiver, and the engine
    // cancels the request.
    let (tx, sse_rx) = tokio::sync::mpsc::channel::<Result<Event, Infallible>>(64);
    let mut rx = rx;
    let metrics_state = state_for_metrics;
    tokio::spawn(async move {
        while let Some(event) = rx.recv().await {
            let finished = matches!(
                event,
                GenerateEvent::Finished { .. } | GenerateEvent::Error { .. }
            );
            if let GenerateEvent::Finished { usage, .. } = &event {
                metrics_state.metrics.record(usage);
            }
            for e in to_events(event) {
                if tx.send(Ok(e)).await.is_err() {
                    return;
                }
            }
            if finished {
                return;
            }
        }
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(sse_rx)).into_response()
}

/// The legacy completions logprobs object for `tokens`.
fn completion_logprobs(state: &WorkerState, tokens: &[TokenOut]) -> Value {
    let texts: Vec<String> = tokens
        .iter()
        .map(|t| {
            state
                .engine
                .tokenizer
                .decode(&[t.id], false)
                .unwrap_or_default()
        })
        .collect();
    let mut offset = 0;
    let offsets: Vec<usize> = texts
        .iter()
        .map(|t| {
            let at = offset;
            offset += t.len();
            at
        })
        .collect();
    json!({
        "tokens": texts,
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens.iter().map(|t| t.top.iter().map(|(_, s, lp)| (s.clone(), json!(lp))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// A submitted request: its SSE response, or (for a non-streaming request) its
/// id and finished generation.
enum Started {
    Streaming(Response),
    Done(String, Collected),
}

/// Submits `generate` and either streams it or waits for it to finish.
async fn start(
    state: &Arc<WorkerState>,
    generate: GenerateRequest,
    kind: Kind,
    common: &Common,
    logprobs: bool,
) -> Result<Started, ApiError> {
    let (engine_id, rx) = state.engine.submit(generate);
    state
        .metrics
        .requests
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let prefix = match kind {
        Kind::Chat => "chatcmpl",
        Kind::Completion => "cmpl",
    };
    let id = format!("{prefix}-{}-{engine_id}", state.instance);
    if common.stream {
        let usage = common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage);
        return Ok(Started::Streaming(stream(
            state.clone(),
            rx,
            kind,
            id,
            usage,
            logprobs,
        )));
    }
    let done = collect(rx).await?;
    state.metrics.record(&done.usage);
    Ok(Started::Done(id, done))
}

pub async fn chat_completions(
    State(state): State<Arc<WorkerState>>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(body).await?;
    let prompt = chat_prompt(&state, &request)?;
    let top = request.top_logprobs.unwrap_or(0);
    if top > 0 && !request.logprobs {
        return Err(ApiError::invalid(
            "top_logprobs needs logprobs: true",
            Some("top_logprobs"),
        ));
    }
    let generate = build_request(&state, &request.common, prompt, request.logprobs, top)?;
    let (id, done) = match start(
        &state,
        generate,
        Kind::Chat,
        &request.common,
        request.logprobs,
    )
    .await?
    {
        Started::Streaming(response) => return Ok(response),
        Started::Done(id, done) => (id, done),
    };
    let logprobs = request.logprobs.then(|| {
        json!({"content": done.tokens.iter().map(|t| chat_logprob(&state, t)).collect::<Vec<_>>()})
    });
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": now_secs(),
        "model": state.model_name,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": done.text},
            "logprobs": logprobs,
            "finish_reason": finish_str(done.reason),
        }],
        "usage": usage_json(&done.usage),
    }))
    .into_response())
}

pub async fn completions(
    State(state): State<Arc<WorkerState>>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse(body).await?;
    if request.echo {
        return Err(ApiError::invalid("echo is not supported", Some("echo")));
    }
    let tok = &state.engine.tokenizer;
    let encode = |t: &str| {
        tok.encode(t)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))
    };
    let prompt = match &request.prompt {
        Prompt::Text(t) => encode(t)?,
        Prompt::Tokens(ids) => ids.clone(),
        Prompt::Texts(v) if v.len() == 1 => encode(&v[0])?,
        Prompt::TokenLists(v) if v.len() == 1 => v[0].clone(),
        _ => {
            return Err(ApiError::invalid(
                "only one prompt per request is supported",
                Some("prompt"),
            ));
        }
    };
    let vocab = state.engine.model.config.vocab as u32;
    if let Some(&bad) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(ApiError::invalid(
            format!("token id {bad} is outside the vocabulary"),
            Some("prompt"),
        ));
    }
    let top = request.logprobs.unwrap_or(0);
    if top > 20 {
        return Err(ApiError::invalid(
            "logprobs must be at most 20",
            Some("logprobs"),
        ));
    }
    let generate = build_request(
        &state,
        &request.common,
        prompt,
        request.logprobs.is_some(),
        top,
    )?;
    let logprobs = request.logprobs.is_some();
    let (id, done) = match start(
        &state,
        generate,
        Kind::Completion,
        &request.common,
        logprobs,
    )
    .await?
    {
        Started::Streaming(response) => return Ok(response),
        Started::Done(id, done) => (id, done),
    };
    let logprobs = request
        .logprobs
        .is_some()
        .then(|| completion_logprobs(&state, &done.tokens));
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": now_secs(),
        "model": state.model_name,
        "choices": [{"index": 0, "text": done.text, "logprobs": logprobs, "finish_reason": finish_str(done.reason)}],
        "usage": usage_json(&done.usage),
    }))
    .into_response())
}

pub async fn models(State(state): State<Arc<WorkerState>>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": state.model_name,
            "object": "model",
            "created": state.started_unix,
            "owned_by": "sluice",
            "max_model_len": state.engine.model.config.context,
        }],
    }))
}
