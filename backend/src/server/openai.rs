//! The OpenAI API, shared by the worker and the gateway: request types, their
//! validation into a token-level [`GenerateRequest`] ([`Frontend::chat`],
//! [`Frontend::completion`]), and the answer built from a stream of
//! [`GenerateEvent`]s ([`Frontend::respond`]): SSE or JSON, with usage, finish
//! reasons, logprobs and OpenAI-shaped errors.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde::de::IgnoredAny;
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

use super::error::ApiError;
use crate::engine::{
    FinishReason, GenerateEvent, GenerateRequest, SamplingParams, TokenOut, Usage,
};
use crate::model::{ChatMessage, Tokenizer};

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
    /// The end user; the gateway takes it as the session id when the request
    /// has no `X-Session-Id` header.
    pub user: Option<String>,
    /// Not implemented: refused when it biases anything (see `refuse`).
    pub logit_bias: Option<serde_json::Map<String, Value>>,
}

/// `response_format`: only `{"type": "text"}` (the default) is served.
#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
}

/// Features of OpenAI's API that sluice does not implement
/// (`refuse_unsupported` of each request type): a request that asks for one
/// is refused with a 400 naming it, not answered as if it had not asked (a
/// client that sent tools would otherwise read plain text as "the model chose
/// not to call one"). Present but empty or default values (`"tools": []`,
/// `"tool_choice": "none"`, `"response_format": {"type": "text"}`,
/// `"best_of": 1`) ask for nothing and pass.
fn refuse(what: &str, param: &'static str) -> Result<(), ApiError> {
    Err(ApiError::invalid(
        format!("{what} is not supported by this server"),
        Some(param),
    ))
}

impl Common {
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return refuse("logit_bias", "logit_bias");
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<u32>,
    /// Tool calling, function calling and structured output: not
    /// implemented (see `refuse`).
    pub tools: Option<Vec<IgnoredAny>>,
    pub functions: Option<Vec<IgnoredAny>>,
    pub tool_choice: Option<Value>,
    pub response_format: Option<ResponseFormat>,
    #[serde(flatten)]
    pub common: Common,
}

impl ChatRequest {
    /// Refuses what sluice does not implement (see `refuse`).
    pub fn refuse_unsupported(&self) -> Result<(), ApiError> {
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return refuse("tool calling (tools)", "tools");
        }
        if self.functions.as_ref().is_some_and(|f| !f.is_empty()) {
            return refuse("function calling (functions)", "functions");
        }
        // "auto" with no tools can call nothing: the same as "none".
        match &self.tool_choice {
            None => {}
            Some(Value::String(s)) if s == "none" || s == "auto" => {}
            Some(Value::String(s)) => return refuse(&format!("tool_choice `{s}`"), "tool_choice"),
            Some(_) => return refuse("a tool_choice naming a tool", "tool_choice"),
        }
        if let Some(format) = &self.response_format
            && format.kind != "text"
        {
            return refuse(
                &format!("response_format of type `{}`", format.kind),
                "response_format",
            );
        }
        self.common.refuse_unsupported()
    }
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
    /// Insertion (text after the completion) and server-side best-of-n:
    /// not implemented, nor is `echo` (see `refuse`).
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    #[serde(flatten)]
    pub common: Common,
}

impl CompletionRequest {
    /// Refuses what sluice does not implement (see `refuse`).
    pub fn refuse_unsupported(&self) -> Result<(), ApiError> {
        if self.echo {
            return refuse("echo", "echo");
        }
        if self.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return refuse("suffix", "suffix");
        }
        if self.best_of.is_some_and(|n| n != 1) {
            return refuse("best_of other than 1", "best_of");
        }
        self.common.refuse_unsupported()
    }
}

/// Longest stop list accepted.
const MAX_STOPS: usize = 16;

/// The most alternatives per position for logprobs.
const MAX_TOP_LOGPROBS: u32 = 20;

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Reads a JSON body (at most `limit` bytes) into `T`, with OpenAI-shaped
/// errors: 413 for an oversize body, 400 for bad JSON or a body that could
/// not be read.
pub async fn parse<T: serde::de::DeserializeOwned>(
    body: axum::body::Body,
    limit: usize,
) -> Result<T, ApiError> {
    let bytes = read_body(body, limit).await?;
    from_json(&bytes)
}

/// Reads a body of at most `limit` bytes: 413 when it is longer, 400 when it
/// could not be read. Before a 413 the rest of the body is read and dropped
/// (up to `OVERSIZE_DRAIN_BYTES` more, for at most `OVERSIZE_DRAIN_TIME`), so
/// that a client still sending it gets to read the answer: the connection
/// closed under its writes would give it a broken pipe instead (seen in
/// `worker_api`'s 9 MB request on a loaded 2-core machine).
pub async fn read_body(
    mut body: axum::body::Body,
    limit: usize,
) -> Result<axum::body::Bytes, ApiError> {
    use http_body_util::BodyExt;
    let unreadable =
        |e: axum::Error| ApiError::invalid(format!("cannot read the request body: {e}"), None);
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(unreadable)?.into_data() else {
            continue; // trailers
        };
        if bytes.len() + data.len() > limit {
            drain(body).await;
            return Err(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is over {limit} bytes"),
            ));
        }
        bytes.extend_from_slice(&data);
    }
    Ok(bytes.into())
}

/// How much of an oversize body is read and dropped before the 413, at most.
const OVERSIZE_DRAIN_BYTES: usize = 64 << 20;
const OVERSIZE_DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// Reads and drops what is left of `body`, within the limits above.
async fn drain(mut body: axum::body::Body) {
    use http_body_util::BodyExt;
    let mut left = OVERSIZE_DRAIN_BYTES;
    let _ = tokio::time::timeout(OVERSIZE_DRAIN_TIME, async {
        while let Some(Ok(frame)) = body.frame().await {
            let len = frame.data_ref().map_or(0, |d| d.len());
            match left.checked_sub(len) {
                Some(rest) => left = rest,
                None => break,
            }
        }
    })
    .await;
}

/// Parses a JSON body into `T` (400 when it is not one).
pub fn from_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    // UTF-8 checked once for the whole body: `from_slice` checks each string
    // on its own, which costs more on bodies of many short strings.
    let text = std::str::from_utf8(bytes)
        .map_err(|e| ApiError::invalid(format!("invalid request body: not UTF-8 ({e})"), None))?;
    serde_json::from_str(text)
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}"), None))
}

/// Which endpoint an answer is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Chat,
    Completion,
}

impl Kind {
    /// The prefix of response ids.
    pub fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        }
    }
}

/// How a request wants its answer.
#[derive(Clone, Copy, Debug)]
pub struct Reply {
    pub kind: Kind,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
}

/// A validated request: what to generate and how to answer. Only
/// [`Frontend::chat`] and [`Frontend::completion`] make one.
#[derive(Debug)]
pub struct Prepared {
    pub generate: GenerateRequest,
    pub reply: Reply,
    /// The request's `user` field.
    pub user: Option<String>,
}

/// What the OpenAI layer knows of the served model, and the limits it checks.
#[derive(Debug)]
pub struct Frontend {
    /// The name clients use in `model`.
    pub model_name: String,
    pub tokenizer: Arc<Tokenizer>,
    /// The model's context, in tokens.
    pub context: usize,
    pub vocab: u32,
    /// `created` of `/v1/models`.
    pub created: u64,
    /// The most tokens one request may ask for; `None` = up to the context.
    pub max_tokens_limit: Option<u32>,
    /// The simulator's profile, when no model runs behind this layer.
    pub simulated: Option<String>,
}

impl Frontend {
    /// Parses and validates a chat request: template, tokenizer, limits.
    pub fn chat(&self, request: &ChatRequest) -> Result<Prepared, ApiError> {
        request.refuse_unsupported()?;
        let prompt = self.chat_prompt(request)?;
        let top = request.top_logprobs.unwrap_or(0);
        if top > 0 && !request.logprobs {
            return Err(ApiError::invalid(
                "top_logprobs needs logprobs: true",
                Some("top_logprobs"),
            ));
        }
        if top > MAX_TOP_LOGPROBS {
            return Err(ApiError::invalid(
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"),
                Some("top_logprobs"),
            ));
        }
        self.prepare(&request.common, prompt, Kind::Chat, request.logprobs, top)
    }

    /// Parses and validates a completions request.
    pub fn completion(&self, request: &CompletionRequest) -> Result<Prepared, ApiError> {
        request.refuse_unsupported()?;
        let encode = |t: &str| {
            self.tokenizer
                .encode(t)
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
        if let Some(&bad) = prompt.iter().find(|&&t| t >= self.vocab) {
            return Err(ApiError::invalid(
                format!("token id {bad} is outside the vocabulary"),
                Some("prompt"),
            ));
        }
        let top = request.logprobs.unwrap_or(0);
        if top > MAX_TOP_LOGPROBS {
            return Err(ApiError::invalid(
                format!("logprobs must be at most {MAX_TOP_LOGPROBS}"),
                Some("logprobs"),
            ));
        }
        self.prepare(
            &request.common,
            prompt,
            Kind::Completion,
            request.logprobs.is_some(),
            top,
        )
    }

    /// Checks the shared fields and builds the engine request around `prompt`.
    fn prepare(
        &self,
        common: &Common,
        prompt: Vec<u32>,
        kind: Kind,
        logprobs: bool,
        top_logprobs: u32,
    ) -> Result<Prepared, ApiError> {
        if let Some(model) = &common.model
            && !model.is_empty()
            && *model != self.model_name
        {
            return Err(ApiError::not_found(format!(
                "model `{model}` is not served here (this server serves `{}`)",
                self.model_name
            )));
        }
        if common.n.unwrap_or(1) != 1 {
            return Err(ApiError::invalid("only n=1 is supported", Some("n")));
        }
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt is empty", Some("prompt")));
        }
        let context = self.context;
        if prompt.len() >= context {
            return Err(ApiError::invalid(
                format!(
                    "the prompt has {} tokens; the model's context is {context}",
                    prompt.len()
                ),
                Some(match kind {
                    Kind::Chat => "messages",
                    Kind::Completion => "prompt",
                }),
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
            Some(m) if self.max_tokens_limit.is_some_and(|limit| m > limit) => {
                return Err(ApiError::invalid(
                    format!(
                        "max_tokens {m} is over this server's limit of {}",
                        self.max_tokens_limit.unwrap_or_default()
                    ),
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
            None => room.min(self.max_tokens_limit.unwrap_or(u32::MAX)),
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
        if let Some(&bad) = common.stop_token_ids.iter().find(|&&t| t >= self.vocab) {
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
        let generate = GenerateRequest {
            prompt,
            sampling,
            max_tokens,
            stop_ids: common.stop_token_ids.clone(),
            stop_strings,
            ignore_eos: common.ignore_eos,
            cache_salt: 0,
            cache_priority: 0,
            tenant_id: 0,
            remote_prefill: false,
        };
        Ok(Prepared {
            generate,
            reply: Reply {
                kind,
                stream: common.stream,
                include_usage: common
                    .stream_options
                    .as_ref()
                    .is_some_and(|o| o.include_usage),
                logprobs,
            },
            user: common.user.clone(),
        })
    }

    /// The prompt's token ids for a chat request (template, then tokenizer).
    fn chat_prompt(&self, request: &ChatRequest) -> Result<Vec<u32>, ApiError> {
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
        let text = self
            .tokenizer
            .apply_chat_template(&messages, true)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
        self.tokenizer
            .encode(&text)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))
    }

    /// `GET /v1/models`.
    pub fn models(&self) -> Value {
        let mut model = json!({
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "sluice",
            "max_model_len": self.context,
        });
        if let Some(profile) = &self.simulated {
            model["owned_by"] = json!("sluice-sim");
            model["simulated"] = json!(profile);
        }
        json!({"object": "list", "data": [model]})
    }

    /// Answers a request from its generation events: an SSE stream, or (not
    /// streaming) one JSON body once the generation has finished. `on_usage`
    /// hears the usage of a request that finished. When the client goes away
    /// the receiver is dropped, which cancels the generation upstream.
    pub async fn respond(
        self: &Arc<Self>,
        reply: Reply,
        id: String,
        events: UnboundedReceiver<GenerateEvent>,
        on_usage: impl FnOnce(&Usage) + Send + 'static,
    ) -> Result<Response, ApiError> {
        if reply.stream {
            return Ok(self.clone().stream(reply, id, events, on_usage));
        }
        let done = collect(events).await?;
        on_usage(&done.usage);
        let logprobs = reply.logprobs.then(|| match reply.kind {
            Kind::Chat => {
                json!({"content": done.tokens.iter().map(|t| self.chat_logprob(t)).collect::<Vec<_>>()})
            }
            Kind::Completion => self.completion_logprobs(&done.tokens),
        });
        let (object, message, text) = match reply.kind {
            Kind::Chat => (
                "chat.completion",
                Some(MessageOut {
                    role: Some("assistant"),
                    content: &done.text,
                }),
                None,
            ),
            Kind::Completion => ("text_completion", None, Some(done.text.as_str())),
        };
        Ok(Json(Envelope {
            id: &id,
            object,
            created: now_secs(),
            model: &self.model_name,
            choices: [Choice {
                index: 0,
                message,
                delta: None,
                text,
                logprobs,
                finish_reason: Some(finish_str(done.reason)),
            }],
            usage: Some(UsageOut::from(&done.usage)),
        })
        .into_response())
    }

    /// An SSE stream of OpenAI chunks, ending with `[DONE]`. The body reads
    /// the events itself (no task in between): when the client goes away the
    /// body is dropped with `events`, and the generation is cancelled.
    fn stream(
        self: Arc<Self>,
        reply: Reply,
        id: String,
        events: UnboundedReceiver<GenerateEvent>,
        on_usage: impl FnOnce(&Usage) + Send + 'static,
    ) -> Response {
        let writer = ChunkWriter::new(self, reply, &id, now_secs());
        let state = (writer, events, Some(on_usage), false);
        let body = futures_util::stream::unfold(
            state,
            |(writer, mut events, mut on_usage, done)| async move {
                if done {
                    return None;
                }
                // Events already here go out in one chunk (one write, one
                // wake-up of the client), not one each.
                let mut text = Vec::new();
                loop {
                    let event = match events.try_recv() {
                        Ok(e) => e,
                        Err(_) if !text.is_empty() => {
                            return Some((
                                Ok::<_, Infallible>(text),
                                (writer, events, on_usage, false),
                            ));
                        }
                        Err(_) => match events.recv().await {
                            Some(e) => e,
                            None => {
                                // The generation ended without a last event.
                                let error = ApiError::unavailable(
                                    "the generation stopped before it finished",
                                );
                                write_sse_error(&mut text, &error);
                                return Some((Ok(text), (writer, events, on_usage, true)));
                            }
                        },
                    };
                    let finished = matches!(
                        event,
                        GenerateEvent::Finished { .. } | GenerateEvent::Error { .. }
                    );
                    if let GenerateEvent::Finished { usage, .. } = &event
                        && let Some(f) = on_usage.take()
                    {
                        f(usage);
                    }
                    writer.write_sse(event, &mut text);
                    if finished {
                        return Some((Ok(text), (writer, events, on_usage, true)));
                    }
                }
            },
        );
        (
            [
                (header::CONTENT_TYPE, "text/event-stream"),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            axum::body::Body::from_stream(body),
        )
            .into_response()
    }

    /// The chat `logprobs.content` entry of one token.
    fn chat_logprob(&self, t: &TokenOut) -> Value {
        let text = self.tokenizer.decode(&[t.id], false).unwrap_or_default();
        json!({
            "token": text,
            "logprob": t.logprob,
            "bytes": text.as_bytes(),
            "top_logprobs": t.top.iter().map(|(_, s, lp)| json!({"token": s, "logprob": lp, "bytes": s.as_bytes()})).collect::<Vec<_>>(),
        })
    }

    /// The legacy completions logprobs object for `tokens`.
    fn completion_logprobs(&self, tokens: &[TokenOut]) -> Value {
        let texts: Vec<String> = tokens
            .iter()
            .map(|t| self.tokenizer.decode(&[t.id], false).unwrap_or_default())
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
}

/// Writes the SSE chunks of one streaming answer.
struct ChunkWriter {
    frontend: Arc<Frontend>,
    reply: Reply,
    /// What every chunk of the answer starts with, written once: the
    /// envelope's JSON up to its `"choices":` (id, object, created, model).
    /// Serializing those four again for every token was ~1.4k of a chunk's
    /// ~2.8k instructions, most of it escaping strings that do not change.
    head: Vec<u8>,
}

/// `usage` as OpenAI shapes it.
#[derive(serde::Serialize)]
struct UsageOut {
    prompt_tokens: u32,
    completion_tokens: u32,
    total_tokens: u32,
    prompt_tokens_details: CachedTokens,
}

#[derive(serde::Serialize)]
struct CachedTokens {
    cached_tokens: u32,
}

impl From<&Usage> for UsageOut {
    fn from(u: &Usage) -> Self {
        UsageOut {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: CachedTokens {
                cached_tokens: u.cached_tokens,
            },
        }
    }
}

/// A whole answer or one streamed chunk as OpenAI shapes it, serialized
/// straight into the body (no `Value` tree per answer or token).
#[derive(serde::Serialize)]
struct Envelope<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageOut>,
}

/// A choice: a whole answer's chat `message` (with its finish reason), a
/// streamed chunk's chat `delta` (finish reason null until the last), or a
/// completion's text.
#[derive(serde::Serialize)]
struct Choice<'a> {
    index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<MessageOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delta: Option<MessageOut<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    text: Option<&'a str>,
    logprobs: Option<Value>,
    finish_reason: Option<&'static str>,
}

/// A chat message or delta: its role only where one is given.
#[derive(serde::Serialize)]
struct MessageOut<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'a str,
}

impl ChunkWriter {
    /// Appends the SSE text of one generation event to `out` (nothing when
    /// it shows nothing).
    fn write_sse(&self, event: GenerateEvent, out: &mut Vec<u8>) {
        let kind = self.reply.kind;
        let choice = |content, logprobs, finish_reason| {
            let (delta, text) = match kind {
                Kind::Chat => (
                    Some(MessageOut {
                        role: None,
                        content,
                    }),
                    None,
                ),
                Kind::Completion => (None, Some(content)),
            };
            Choice {
                index: 0,
                message: None,
                delta,
                text,
                logprobs,
                finish_reason,
            }
        };
        match event {
            // Disaggregation's own event: the gateway acts on it; clients
            // never see it.
            GenerateEvent::AwaitingKv { .. } => {}
            GenerateEvent::Started { .. } => {
                if kind == Kind::Chat {
                    let opening = Choice {
                        delta: Some(MessageOut {
                            role: Some("assistant"),
                            content: "",
                        }),
                        ..choice("", None, None)
                    };
                    self.write_chunk(out, [opening], None);
                }
            }
            GenerateEvent::Token(t) => {
                let lp = self.reply.logprobs.then(|| match kind {
                    Kind::Chat => json!({"content": [self.frontend.chat_logprob(&t)]}),
                    Kind::Completion => self.frontend.completion_logprobs(std::slice::from_ref(&t)),
                });
                if t.text.is_empty() && lp.is_none() {
                    return;
                }
                self.write_chunk(out, [choice(&t.text, lp, None)], None);
            }
            GenerateEvent::Finished {
                reason,
                text,
                usage,
            } => {
                let last = choice(&text, None, Some(finish_str(reason)));
                self.write_chunk(out, [last], None);
                if self.reply.include_usage {
                    self.write_chunk(out, [(); 0], Some(UsageOut::from(&usage)));
                }
                out.extend_from_slice(b"data: [DONE]\n\n");
            }
            GenerateEvent::Error { message, status } => {
                write_sse_error(
                    out,
                    &ApiError::with_code(status, StatusCode::BAD_REQUEST, message),
                );
            }
        }
    }

    fn new(frontend: Arc<Frontend>, reply: Reply, id: &str, created: u64) -> ChunkWriter {
        let object = match reply.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        let head = chunk_head(id, object, created, &frontend.model_name);
        ChunkWriter {
            frontend,
            reply,
            head,
        }
    }

    /// Appends one `data:` line holding a chunk with `choices`: what
    /// serializing an [`Envelope`] writes, its head copied.
    fn write_chunk(
        &self,
        out: &mut Vec<u8>,
        choices: impl serde::Serialize,
        usage: Option<UsageOut>,
    ) {
        out.extend_from_slice(b"data: ");
        write_envelope(out, &self.head, choices, usage);
        out.extend_from_slice(b"\n\n");
    }
}

/// An [`Envelope`]'s JSON from its head ([`chunk_head`]), `choices` and `usage`.
fn write_envelope(
    out: &mut Vec<u8>,
    head: &[u8],
    choices: impl serde::Serialize,
    usage: Option<UsageOut>,
) {
    out.extend_from_slice(head);
    // Writing into a Vec cannot fail, and the chunk holds no map with
    // non-string keys.
    serde_json::to_writer(&mut *out, &choices).expect("a chunk serializes");
    if let Some(usage) = usage {
        out.extend_from_slice(b",\"usage\":");
        serde_json::to_writer(&mut *out, &usage).expect("usage serializes");
    }
    out.push(b'}');
}

/// An [`Envelope`]'s JSON up to and including `"choices":`.
fn chunk_head(id: &str, object: &'static str, created: u64, model: &str) -> Vec<u8> {
    let mut whole = serde_json::to_vec(&Envelope {
        id,
        object,
        created,
        model,
        choices: (),
        usage: None,
    })
    .expect("an envelope serializes");
    // `...,"choices":null}`: keep what comes before the null.
    let cut = whole.len() - b"null}".len();
    debug_assert!(whole[..cut].ends_with(b"\"choices\":"));
    whole.truncate(cut);
    whole
}

/// Appends the end of a stream that failed: the error's body as the last
/// `data:` line, then `[DONE]`.
fn write_sse_error(out: &mut Vec<u8>, error: &ApiError) {
    out.extend_from_slice(format!("data: {}\n\ndata: [DONE]\n\n", error.body()).as_bytes());
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

fn finish_str(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    }
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
            GenerateEvent::Started { .. } | GenerateEvent::AwaitingKv { .. } => {}
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
            GenerateEvent::Error { message, status } => {
                return Err(ApiError::with_code(
                    status,
                    StatusCode::BAD_REQUEST,
                    message,
                ));
            }
        }
    }
    Err(ApiError::unavailable(
        "the generation stopped before it finished",
    ))
}

#[cfg(test)]
mod chunk_tests {
    use super::*;

    #[test]
    fn a_chunk_from_its_cached_head_is_the_envelope_serialized() {
        let usage = || {
            UsageOut::from(&Usage {
                prompt_tokens: 12,
                completion_tokens: 3,
                cached_tokens: 8,
            })
        };
        for (id, model) in [
            ("chatcmpl-1", "SmolLM2-135M-Instruct"),
            ("cmpl-\"quoted\"\\", "model/with \u{1} control and é漢"),
            ("", ""),
        ] {
            for object in ["chat.completion.chunk", "text_completion"] {
                let head = chunk_head(id, object, 1_764_000_000, model);
                let choice = Choice {
                    index: 0,
                    message: None,
                    delta: Some(MessageOut {
                        role: None,
                        content: " tok\"\n",
                    }),
                    text: None,
                    logprobs: Some(json!({"content": [{"token": "a", "logprob": -0.5}]})),
                    finish_reason: Some("stop"),
                };
                for with_usage in [false, true] {
                    let mut ours = Vec::new();
                    write_envelope(&mut ours, &head, [&choice], with_usage.then(usage));
                    let serde = serde_json::to_vec(&Envelope {
                        id,
                        object,
                        created: 1_764_000_000,
                        model,
                        choices: [&choice],
                        usage: with_usage.then(usage),
                    })
                    .unwrap();
                    assert_eq!(
                        String::from_utf8(ours).unwrap(),
                        String::from_utf8(serde).unwrap()
                    );
                    let mut empty = Vec::new();
                    write_envelope(&mut empty, &head, [(); 0], with_usage.then(usage));
                    let parsed: Value = serde_json::from_slice(&empty).unwrap();
                    assert_eq!(parsed["choices"], json!([]));
                    assert_eq!(parsed["model"], json!(model));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `base` with `extra`'s fields added.
    fn with(mut base: Value, extra: &Value) -> String {
        base.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        base.to_string()
    }

    /// The param a chat request with `extra` is refused for, if any.
    fn chat(extra: Value) -> Option<&'static str> {
        let body = with(
            json!({"messages": [{"role": "user", "content": "hi"}]}),
            &extra,
        );
        let request: ChatRequest = from_json(body.as_bytes()).unwrap();
        request.refuse_unsupported().err().map(|e| e.param.unwrap())
    }

    /// The same for a completions request.
    fn completion(extra: Value) -> Option<&'static str> {
        let body = with(json!({"prompt": "a"}), &extra);
        let request: CompletionRequest = from_json(body.as_bytes()).unwrap();
        request.refuse_unsupported().err().map(|e| e.param.unwrap())
    }

    #[test]
    fn features_sluice_lacks_are_refused_by_name() {
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {}}});
        let refused = [
            (json!({"tools": [tool]}), "tools"),
            (
                json!({"functions": [{"name": "f", "parameters": {}}]}),
                "functions",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
                "tool_choice",
            ),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
                "response_format",
            ),
            (json!({"logit_bias": {"50256": -100}}), "logit_bias"),
        ];
        for (extra, param) in refused {
            assert_eq!(chat(extra.clone()), Some(param), "{extra}");
        }
        assert_eq!(completion(json!({"echo": true})), Some("echo"));
        assert_eq!(completion(json!({"suffix": "b"})), Some("suffix"));
        assert_eq!(completion(json!({"best_of": 3})), Some("best_of"));
        assert_eq!(
            completion(json!({"logit_bias": {"1": 5}})),
            Some("logit_bias")
        );
    }

    #[test]
    fn empty_or_default_forms_of_those_features_pass() {
        for extra in [
            json!({}),
            json!({"tools": []}),
            json!({"tools": null, "functions": []}),
            json!({"tool_choice": "none"}),
            json!({"tool_choice": "auto"}),
            json!({"response_format": {"type": "text"}}),
            json!({"logit_bias": {}}),
            json!({"logit_bias": null, "parallel_tool_calls": false}),
        ] {
            assert_eq!(chat(extra.clone()), None, "{extra}");
        }
        for extra in [
            json!({"suffix": ""}),
            json!({"best_of": 1}),
            json!({"echo": false}),
            json!({"suffix": null, "logit_bias": {}}),
        ] {
            assert_eq!(completion(extra.clone()), None, "{extra}");
        }
    }
}
