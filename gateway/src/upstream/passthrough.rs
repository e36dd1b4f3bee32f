//! OpenAI passthrough: requests for `kind = "openai"` workers (vLLM, SGLang,
//! any OpenAI-compatible server). The client's body is forwarded as it came
//! and the worker's answer relayed byte for byte (status, content type, every
//! SSE chunk: tool-call deltas, usage, fields the gateway does not know).
//! The gateway only reads the body to route it: the prompt is rendered and
//! tokenized as the engine would (`tokenizer`, with the messages and tools as
//! sent), or, without a tokenizer, cut into blocks of characters.

use std::time::Instant;

use bytes::Bytes;
use serde_json::Value;
use sluice_backend::engine::Usage;
use sluice_backend::kv::hash::block_hashes;
use sluice_backend::model::Tokenizer;
use sluice_backend::server::ApiError;
use sluice_backend::server::openai::Kind;
use tokio_stream::StreamExt;

use super::{Attempt, ERROR_BODY_WAIT, Head, InFlight, Job, Output, Relayed, timed_out};
use crate::gateway::Gateway;
use crate::routing::Worker;

/// A request as forwarded: path and the client's bytes.
#[derive(Debug)]
pub struct Passthrough {
    pub path: &'static str,
    pub body: Bytes,
}

/// What routing needs of a forwarded request.
#[derive(Debug)]
pub struct Routed {
    pub stream: bool,
    /// Prompt tokens (with no tokenizer: characters / 4).
    pub prompt_tokens: u32,
    /// Block hashes of the prompt (of tokens, or of text blocks).
    pub hashes: Vec<u64>,
    /// Tokens per block (with no tokenizer: text block characters / 4).
    pub block_size: u32,
    pub max_tokens: u32,
    pub user: Option<String>,
}

/// Reads what routing needs from a body bound for OpenAI workers; refuses
/// only what no server would take (not JSON, no messages or prompt, more
/// tokens than the gateway's limit).
pub fn route_info(
    bytes: &[u8],
    kind: Kind,
    tokenizer: Option<&Tokenizer>,
    block_size: u32,
    text_block_chars: u32,
    max_tokens_limit: Option<u32>,
) -> Result<Routed, ApiError> {
    let body: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}"), None))?;
    if !body.is_object() {
        return Err(ApiError::invalid(
            "the request body is not a JSON object",
            None,
        ));
    }
    let stream = body["stream"].as_bool().unwrap_or(false);
    let max_tokens = body["max_completion_tokens"]
        .as_u64()
        .or_else(|| body["max_tokens"].as_u64())
        .map(|n| n.min(u64::from(u32::MAX)) as u32);
    if let (Some(asked), Some(limit)) = (max_tokens, max_tokens_limit)
        && asked > limit
    {
        return Err(ApiError::invalid(
            format!("max_tokens is {asked}; this gateway allows at most {limit}"),
            Some("max_tokens"),
        ));
    }
    let user = body["user"].as_str().map(str::to_string);
    let text = match kind {
        Kind::Chat => {
            let messages = body["messages"]
                .as_array()
                .filter(|m| !m.is_empty())
                .ok_or_else(|| {
                    ApiError::invalid("messages must be a non-empty list", Some("messages"))
                })?;
            Prompt::Chat(messages, body.get("tools").filter(|t| !t.is_null()))
        }
        Kind::Completion => match &body["prompt"] {
            Value::String(s) => Prompt::Text(s.clone()),
            Value::Array(items) if items.iter().all(Value::is_u64) && !items.is_empty() => {
                Prompt::Tokens(
                    items
                        .iter()
                        .filter_map(Value::as_u64)
                        .map(|t| t as u32)
                        .collect(),
                )
            }
            Value::Array(items) if items.len() == 1 && items[0].is_string() => {
                Prompt::Text(items[0].as_str().unwrap_or_default().to_string())
            }
            // Several prompts: routed by the first.
            Value::Array(items) if !items.is_empty() => Prompt::Text(items[0].to_string()),
            _ => {
                return Err(ApiError::invalid(
                    "prompt must be text or token ids",
                    Some("prompt"),
                ));
            }
        },
    };
    let (tokens, block_size) = match tokenizer {
        Some(tok) => (prompt_tokens(tok, &text)?, block_size),
        None => (text_units(&text), text_block_chars),
    };
    let hashes = block_hashes(&tokens, block_size as usize, 0);
    let (prompt_tokens, block_size) = match tokenizer {
        Some(_) => (tokens.len() as u32, block_size),
        None => (
            (tokens.len() as u32).div_ceil(4),
            (text_block_chars / 4).max(1),
        ),
    };
    Ok(Routed {
        stream,
        prompt_tokens,
        hashes,
        block_size,
        max_tokens: max_tokens.unwrap_or(0),
        user,
    })
}

enum Prompt<'a> {
    Chat(&'a Vec<Value>, Option<&'a Value>),
    Text(String),
    Tokens(Vec<u32>),
}

/// Token ids as the engine would see them: the chat template rendered with
/// the messages as sent (text parts joined, as engines do for text models).
fn prompt_tokens(tokenizer: &Tokenizer, prompt: &Prompt<'_>) -> Result<Vec<u32>, ApiError> {
    let bad = |e: sluice_backend::model::TokenizerError| ApiError::invalid(e.to_string(), None);
    match prompt {
        Prompt::Chat(messages, tools) => {
            let messages: Vec<Value> = messages.iter().map(text_content).collect();
            let text = tokenizer
                .apply_chat_template_json(&Value::Array(messages), *tools, true)
                .map_err(bad)?;
            // The template writes the special tokens itself.
            tokenizer.encode_without_bos(&text).map_err(bad)
        }
        Prompt::Text(text) => tokenizer.encode(text).map_err(bad),
        Prompt::Tokens(ids) => Ok(ids.clone()),
    }
}

/// A message whose content is a list of parts gets its text parts joined.
fn text_content(message: &Value) -> Value {
    let mut message = message.clone();
    if let Some(parts) = message["content"].as_array() {
        let text: Vec<&str> = parts.iter().filter_map(|p| p["text"].as_str()).collect();
        message["content"] = Value::String(text.join("\n"));
    }
    message
}

/// Without a tokenizer: the prompt's characters (as code points), so that
/// equal text prefixes give equal block hashes, as a character prefix tree
/// would match them.
fn text_units(prompt: &Prompt<'_>) -> Vec<u32> {
    match prompt {
        Prompt::Chat(messages, tools) => {
            let mut text = String::new();
            if let Some(tools) = tools {
                text.push_str(&tools.to_string());
            }
            for m in *messages {
                text.push_str(m["role"].as_str().unwrap_or(""));
                text.push('\n');
                match &m["content"] {
                    Value::String(s) => text.push_str(s),
                    Value::Null => {}
                    other => text.push_str(&other.to_string()),
                }
                if let Some(calls) = m.get("tool_calls") {
                    text.push_str(&calls.to_string());
                }
                text.push('\n');
            }
            text.chars().map(u32::from).collect()
        }
        Prompt::Text(t) => t.chars().map(u32::from).collect(),
        Prompt::Tokens(ids) => ids.clone(),
    }
}

/// Statuses after which another worker is tried: the worker is down,
/// overloaded or failing; anything else (a 2xx, the client's 4xx) is the
/// answer and is relayed.
fn retry_elsewhere(status: u16) -> bool {
    status == 429 || status >= 500
}

/// One try on one OpenAI worker: forward, wait for the first bytes (until
/// then a failure tries another worker), then relay every byte.
pub(super) async fn attempt(
    gateway: &Gateway,
    job: &Job,
    worker: &Worker,
    cached_blocks: u32,
    router_version: Option<u64>,
    out: &mut Output,
    in_flight: &InFlight<'_>,
) -> Attempt {
    let Some(pass) = &job.passthrough else {
        return Attempt::Retry("not a forwardable request".into(), worker.id);
    };
    let mut request = gateway
        .client()
        .post(format!("{}{}", worker.url, pass.path))
        .header("content-type", "application/json")
        .header("traceparent", job.trace.header())
        .body(pass.body.clone());
    if let Some(key) = &worker.upstream.api_key {
        request = request.bearer_auth(key);
    }
    if let Some(rank) = worker.upstream.dp_rank {
        // vLLM's and SGLang's way to pin a request to a data-parallel rank.
        request = request.header("x-data-parallel-rank", rank);
    }
    let response = tokio::select! {
        r = tokio::time::timeout_at(job.deadline.into(), request.send()) => r,
        () = out.client_gone() => return Attempt::ClientGone,
    };
    let response = match response {
        Err(_) => return Attempt::Broken(timed_out(out)),
        Ok(Err(e)) => return Attempt::Retry(format!("cannot send: {e}"), worker.id),
        Ok(Ok(r)) => r,
    };
    let status = response.status();
    if retry_elsewhere(status.as_u16()) {
        let body = tokio::time::timeout(ERROR_BODY_WAIT, response.bytes()).await;
        let detail = body
            .ok()
            .and_then(Result::ok)
            .map(|b| String::from_utf8_lossy(&b[..b.len().min(200)]).into_owned())
            .unwrap_or_default();
        return Attempt::Retry(format!("it answered {status}: {detail}"), worker.id);
    }
    let head = Head {
        worker: worker.id,
        cached_blocks,
        router_version,
        prefill_worker: None,
        relayed: Some(Relayed {
            status: status.as_u16(),
            content_type: response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
        }),
    };
    let sse = head
        .relayed
        .as_ref()
        .and_then(|r| r.content_type.as_deref())
        .is_some_and(|c| c.starts_with("text/event-stream"));
    let idle = gateway.config.limits.idle_stream_timeout();
    let mut body = response.bytes_stream();
    let mut usage = UsageScan::new(sse);
    let mut last_chunk: Option<Instant> = None;
    loop {
        let wait_until = match last_chunk {
            None => job.deadline,
            Some(t) => (t + idle).min(job.deadline),
        };
        let chunk = tokio::select! {
            c = tokio::time::timeout_at(wait_until.into(), body.next()) => c,
            () = out.client_gone() => return Attempt::ClientGone,
        };
        let chunk = match chunk {
            Err(_) if out.started() || Instant::now() >= job.deadline => {
                return Attempt::Broken(broken(out, sse, "timed out"));
            }
            Err(_) => return Attempt::Retry(format!("no answer for {idle:?}"), worker.id),
            Ok(None) if out.started() => break,
            Ok(None) if status.is_success() => {
                return Attempt::Retry("it closed the answer before a byte".into(), worker.id);
            }
            // An empty error answer is an answer.
            Ok(None) => {
                if !out.open_relayed(head) {
                    return Attempt::ClientGone;
                }
                break;
            }
            Ok(Some(Err(e))) if !out.started() => {
                return Attempt::Retry(format!("its answer broke: {e}"), worker.id);
            }
            Ok(Some(Err(e))) => {
                tracing::warn!(worker = worker.id, error = %e, "OpenAI worker failed mid-answer");
                return Attempt::Broken(broken(out, sse, &e.to_string()));
            }
            Ok(Some(Ok(c))) => c,
        };
        let now = Instant::now();
        match last_chunk {
            None => {
                in_flight.prefilled();
                // The worker does not say what it had cached: the index's
                // count (exact with events, else predicted) stands for it.
                gateway.metrics.kv_blocks(
                    job.view.prompt_blocks,
                    cached_blocks.min(job.view.prompt_blocks),
                );
                gateway
                    .metrics
                    .first_token(now.duration_since(job.arrived).as_secs_f64());
                if !out.open_relayed(head.clone()) {
                    return Attempt::ClientGone;
                }
            }
            Some(t) if sse => gateway
                .metrics
                .next_token(now.duration_since(t).as_secs_f64()),
            Some(_) => {}
        }
        last_chunk = Some(now);
        usage.push(&chunk);
        if !out.send_bytes(chunk) {
            return Attempt::ClientGone;
        }
    }
    if !status.is_success() {
        return Attempt::Relayed(status.as_u16());
    }
    Attempt::Finished(usage.finish())
}

/// Ends a relayed answer that broke: an SSE stream gets an error event (as
/// OpenAI streams do); any other body is cut short (the client sees an
/// incomplete answer, not a well-formed wrong one).
fn broken(out: &mut Output, sse: bool, why: &str) -> crate::telemetry::RequestOutcome {
    if sse {
        let event = serde_json::json!({"error": {"message": format!("the worker failed mid-stream: {why}"), "type": "server_error", "code": 502}});
        out.send_bytes(Bytes::from(format!("data: {event}\n\n")));
    } else {
        out.abort_bytes(why);
    }
    crate::telemetry::RequestOutcome::failed
}

/// Finds the usage in a relayed answer (the last SSE chunk with a `usage`
/// object, or the JSON body's), for the gateway's own accounting.
#[derive(Debug)]
struct UsageScan {
    sse: bool,
    /// The current SSE line, or the JSON body (up to `MAX_SCAN`).
    pending: Vec<u8>,
    usage: Option<Value>,
    chunks: u32,
}

/// Bytes of one line (or JSON body) kept to look for usage.
const MAX_SCAN: usize = 1 << 20;

impl UsageScan {
    fn new(sse: bool) -> Self {
        Self {
            sse,
            pending: Vec::new(),
            usage: None,
            chunks: 0,
        }
    }

    fn push(&mut self, bytes: &[u8]) {
        if !self.sse {
            if self.pending.len() + bytes.len() <= MAX_SCAN {
                self.pending.extend_from_slice(bytes);
            }
            return;
        }
        let mut rest = bytes;
        while let Some(end) = rest.iter().position(|&b| b == b'\n') {
            self.keep(&rest[..end]);
            self.line();
            self.pending.clear();
            rest = &rest[end + 1..];
        }
        self.keep(rest);
    }

    /// Adds to the current line, up to `MAX_SCAN` bytes.
    fn keep(&mut self, bytes: &[u8]) {
        let room = MAX_SCAN.saturating_sub(self.pending.len());
        self.pending
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    fn line(&mut self) {
        let Some(data) = self.pending.strip_prefix(b"data:") else {
            return;
        };
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            return;
        }
        self.chunks += 1;
        if memchr_usage(data)
            && let Ok(v) = serde_json::from_slice::<Value>(data)
            && v["usage"].is_object()
        {
            self.usage = Some(v["usage"].clone());
        }
    }

    fn finish(mut self) -> Usage {
        if !self.sse {
            self.usage = serde_json::from_slice::<Value>(&self.pending)
                .ok()
                .map(|v| v["usage"].clone())
                .filter(Value::is_object);
        }
        let Some(u) = self.usage else {
            // No usage reported: count SSE chunks as tokens.
            return Usage {
                completion_tokens: self.chunks,
                ..Usage::default()
            };
        };
        let n = |v: &Value| v.as_u64().map_or(0, |n| n as u32);
        Usage {
            prompt_tokens: n(&u["prompt_tokens"]),
            completion_tokens: n(&u["completion_tokens"]),
            cached_tokens: n(&u["prompt_tokens_details"]["cached_tokens"]),
        }
    }
}

fn memchr_usage(data: &[u8]) -> bool {
    data.windows(7).any(|w| w == b"\"usage\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_info_reads_chat_and_completions_without_a_tokenizer() {
        let chat = br#"{"model":"m","stream":true,"max_tokens":9,"user":"u1","tools":[{"type":"function"}],
            "messages":[{"role":"system","content":"You are terse."},{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;
        let r = route_info(chat, Kind::Chat, None, 16, 8, None).unwrap();
        assert!(r.stream);
        assert_eq!(
            (r.max_tokens, r.user.as_deref(), r.block_size),
            (9, Some("u1"), 2)
        );
        assert!(!r.hashes.is_empty());
        // The same conversation one turn on shares the leading blocks.
        let longer = br#"{"model":"m","tools":[{"type":"function"}],
            "messages":[{"role":"system","content":"You are terse."},{"role":"user","content":[{"type":"text","text":"hi"}]},
            {"role":"assistant","content":"hello"},{"role":"user","content":"more"}]}"#;
        let l = route_info(longer, Kind::Chat, None, 16, 8, None).unwrap();
        assert!(l.hashes.len() > r.hashes.len());
        let shared = r.hashes.len() - 1;
        assert_eq!(l.hashes[..shared], r.hashes[..shared]);
        let tokens = br#"{"prompt":[1,2,3,4,5,6,7,8,9]}"#;
        let t = route_info(tokens, Kind::Completion, None, 16, 4, None).unwrap();
        assert_eq!(t.hashes, block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 4, 0));
    }

    #[test]
    fn route_info_refuses_what_no_server_would_take() {
        let status = |body: &[u8], kind| {
            route_info(body, kind, None, 16, 64, Some(100))
                .unwrap_err()
                .status
                .as_u16()
        };
        assert_eq!(status(b"nope", Kind::Chat), 400);
        assert_eq!(status(b"[1]", Kind::Chat), 400);
        assert_eq!(status(br#"{"messages":[]}"#, Kind::Chat), 400);
        assert_eq!(status(br#"{"prompt":7}"#, Kind::Completion), 400);
        assert_eq!(
            status(br#"{"prompt":"x","max_tokens":101}"#, Kind::Completion),
            400
        );
    }

    #[test]
    fn usage_comes_from_the_last_usage_chunk_or_the_body() {
        let mut scan = UsageScan::new(true);
        scan.push(
            b"data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}]}\n\ndata: {\"choices\":[],\"usa",
        );
        scan.push(b"ge\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n");
        let u = scan.finish();
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens),
            (5, 2, 4)
        );
        let mut scan = UsageScan::new(true);
        scan.push(b"data: {\"choices\":[]}\n\ndata: {\"choices\":[]}\n\ndata: [DONE]\n\n");
        assert_eq!(scan.finish().completion_tokens, 2, "no usage: chunks count");
        let mut scan = UsageScan::new(false);
        scan.push(b"{\"usage\":{\"prompt_tokens\":3,");
        scan.push(b"\"completion_tokens\":1}}");
        assert_eq!(scan.finish().prompt_tokens, 3);
    }
}
