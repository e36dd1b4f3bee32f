//! A minimal, fast upstream for `sluice bench gateway`, and only for it: it
//! speaks a worker's API (the internal token endpoint, the event stream with
//! real KV events for the prompts it sees, the KV snapshot, health) and
//! OpenAI's chat endpoint (for direct calls and for peer gateways), and
//! answers every request at once with a fixed number of canned tokens. It does
//! no inference, so what a benchmark measures in front of it is the gateway.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use sluice_backend::engine::{GenerateRequest, NumberedKvEvent};
use sluice_backend::kv::KvEvent;
use sluice_backend::kv::hash::block_hashes;
use tokio::sync::broadcast;

/// The canned answers of one upstream.
#[derive(Debug)]
struct Canned {
    /// `/internal/generate` after the `started` line.
    ndjson_tail: Bytes,
    chat_json: Bytes,
    chat_sse: Bytes,
    tokens: u32,
}

#[derive(Debug)]
struct Upstream {
    canned: Canned,
    model: String,
    block_size: usize,
    /// Blocks "cached" here, for KV events.
    blocks: Mutex<HashSet<u64>>,
    seq: AtomicU64,
    events: broadcast::Sender<NumberedKvEvent>,
}

fn canned(tokens: u32, model: &str) -> Canned {
    let mut ndjson = String::new();
    for i in 0..tokens {
        ndjson.push_str(&format!(
            "{{\"event\":\"token\",\"id\":{},\"text\":\" tok\",\"logprob\":0.0}}\n",
            100 + i
        ));
    }
    ndjson.push_str(&format!(
        "{{\"event\":\"finished\",\"reason\":\"length\",\"text\":\"\",\"usage\":{{\"prompt_tokens\":0,\"completion_tokens\":{tokens},\"cached_tokens\":0}}}}\n"
    ));
    let text = " tok".repeat(tokens as usize);
    let chat_json = json!({
        "id": "chatcmpl-upstream", "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 0, "completion_tokens": tokens, "total_tokens": tokens},
    })
    .to_string();
    let mut sse = String::new();
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| {
        format!(
            "data: {}\n\n",
            json!({"id": "chatcmpl-upstream", "object": "chat.completion.chunk", "created": 0, "model": model,
                   "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
        )
    };
    sse.push_str(&chunk(
        json!({"role": "assistant", "content": ""}),
        json!(null),
    ));
    for _ in 0..tokens {
        sse.push_str(&chunk(json!({"content": " tok"}), json!(null)));
    }
    sse.push_str(&chunk(json!({}), json!("length")));
    sse.push_str("data: [DONE]\n\n");
    Canned {
        ndjson_tail: Bytes::from(ndjson),
        chat_json: Bytes::from(chat_json),
        chat_sse: Bytes::from(sse),
        tokens,
    }
}

/// `POST /internal/generate`: records the prompt's blocks (a KV event when new)
/// and answers the canned tokens.
async fn generate(State(up): State<Arc<Upstream>>, body: Bytes) -> Response {
    let Ok(request) = serde_json::from_slice::<GenerateRequest>(&body) else {
        return (axum::http::StatusCode::BAD_REQUEST, "bad request").into_response();
    };
    let hashes = block_hashes(&request.prompt, up.block_size, request.cache_salt);
    let cached = {
        let mut blocks = up.blocks.lock().unwrap_or_else(|e| e.into_inner());
        let cached = hashes.iter().take_while(|h| blocks.contains(h)).count();
        let new: Vec<u64> = hashes[cached..].to_vec();
        if !new.is_empty() {
            blocks.extend(&new);
            let seq = up.seq.fetch_add(1, Ordering::Relaxed) + 1;
            let _ = up.events.send(NumberedKvEvent {
                seq,
                event: KvEvent::Stored {
                    hashes: new,
                    parent: None,
                },
            });
        }
        cached
    };
    let started = format!(
        "{{\"event\":\"started\",\"prompt_tokens\":{},\"cached_tokens\":{}}}\n",
        request.prompt.len(),
        cached * up.block_size
    );
    let mut out = Vec::with_capacity(started.len() + up.canned.ndjson_tail.len());
    out.extend_from_slice(started.as_bytes());
    out.extend_from_slice(&up.canned.ndjson_tail);
    ([(header::CONTENT_TYPE, "application/x-ndjson")], out).into_response()
}

/// `POST /v1/chat/completions` (and `/generate`-less peers): canned JSON or SSE.
async fn chat(State(up): State<Arc<Upstream>>, body: Bytes) -> Response {
    // Looking for `"stream":true` is all the parsing this upstream needs.
    let stream = memchr_find(&body, b"\"stream\":true") || memchr_find(&body, b"\"stream\": true");
    if stream {
        (
            [(header::CONTENT_TYPE, "text/event-stream")],
            up.canned.chat_sse.clone(),
        )
            .into_response()
    } else {
        (
            [(header::CONTENT_TYPE, "application/json")],
            up.canned.chat_json.clone(),
        )
            .into_response()
    }
}

fn memchr_find(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// A sluice worker's event stream, batched as a worker batches it.
async fn events(State(up): State<Arc<Upstream>>) -> impl IntoResponse {
    sluice_backend::server::events::event_stream(up.events.subscribe(), || {
        sluice_backend::engine::Load {
            kv_blocks_total: 1 << 20,
            ..Default::default()
        }
    })
}

async fn snapshot(State(up): State<Arc<Upstream>>) -> Response {
    let blocks = up.blocks.lock().unwrap_or_else(|e| e.into_inner());
    axum::Json(json!({
        "seq": up.seq.load(Ordering::Relaxed),
        "hashes": blocks.iter().collect::<Vec<_>>(),
        "block_size": up.block_size,
    }))
    .into_response()
}

/// Starts an upstream on `listener`, answering `tokens` tokens per request.
pub async fn serve(
    listener: tokio::net::TcpListener,
    tokens: u32,
    model: String,
) -> std::io::Result<()> {
    let up = Arc::new(Upstream {
        canned: canned(tokens, &model),
        model,
        block_size: 16,
        blocks: Mutex::new(HashSet::new()),
        seq: AtomicU64::new(0),
        events: broadcast::channel(4096).0,
    });
    let info = {
        let up = up.clone();
        move || {
            let up = up.clone();
            async move {
                axum::Json(
                    json!({"model_path": up.model, "tokenizer_path": up.model, "is_generation": true,
                                  "status": "ok", "completion_tokens": up.canned.tokens}),
                )
            }
        }
    };
    let models = {
        let up = up.clone();
        move || {
            let up = up.clone();
            async move {
                axum::Json(json!({"object": "list", "data": [{"id": up.model, "object": "model"}]}))
            }
        }
    };
    let app = Router::new()
        .route("/internal/generate", post(generate))
        .route("/v1/chat/completions", post(chat))
        .route("/events", get(events))
        .route("/internal/kv", get(snapshot))
        .route(
            "/health",
            get(|| async { axum::Json(json!({"status": "ok"})) }),
        )
        .route("/health_generate", get(|| async { "ok" }))
        .route("/get_server_info", get(info.clone()))
        .route("/get_model_info", get(info))
        .route("/v1/models", get(models))
        .with_state(up);
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app).await
}
