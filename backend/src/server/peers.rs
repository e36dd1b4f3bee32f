//! Endpoints other routers ask of a worker, so that SGLang's model gateway
//! (`/health_generate`, `/get_model_info`, `/get_server_info`) and vLLM's
//! router (`/tokenize`, `/v1/chat/completions/render`, `/get_server_info`'s
//! block size) can front sluice workers, real or simulated, as they front
//! their own engines.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde_json::{Value, json};

use super::error::ApiError;
use super::openai::{ChatRequest, from_json, read_body};
use super::{MAX_BODY_BYTES, WorkerState};

/// `GET /health_generate`: the engine is up and taking requests.
pub async fn health_generate(State(state): State<Arc<WorkerState>>) -> Json<Value> {
    Json(json!({"status": "ok", "load": state.engine.load()}))
}

/// `GET /get_model_info`, as SGLang answers it.
pub async fn model_info(State(state): State<Arc<WorkerState>>) -> Json<Value> {
    Json(json!({
        "model_path": state.model_name,
        "tokenizer_path": state.model_name,
        "is_generation": true,
        "simulated": state.frontend.simulated,
    }))
}

/// `GET /get_server_info`: limits and sizes, under SGLang's names, with the
/// KV block size vLLM's router reads.
pub async fn server_info(State(state): State<Arc<WorkerState>>) -> Json<Value> {
    let c = &state.engine.config;
    Json(json!({
        "model_path": state.model_name,
        "tokenizer_path": state.model_name,
        "served_model_name": state.model_name,
        "context_length": state.engine.context,
        "max_total_num_tokens": c.kv_blocks as usize * c.block_size,
        "max_running_requests": c.max_running,
        "chunked_prefill_size": c.step_tokens,
        "page_size": c.block_size,
        "block_size": c.block_size,
        "simulated": state.frontend.simulated,
    }))
}

/// `POST /tokenize` (vLLM's shape): `{"prompt": text}` or `{"messages": [...]}`
/// (rendered with the chat template and its generation prompt) →
/// `{"tokens": [...], "count": n, "max_model_len": context}`.
pub async fn tokenize(
    State(state): State<Arc<WorkerState>>,
    body: axum::body::Body,
) -> Result<Json<Value>, ApiError> {
    let bytes = read_body(body, MAX_BODY_BYTES).await?;
    let tokens = prompt_tokens(&state, &bytes)?;
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.engine.context,
        "tokens": tokens,
    })))
}

/// `POST /v1/chat/completions/render`: a chat request's prompt token ids,
/// without generating (`token_ids`, and `tokens` as `/tokenize` names them).
pub async fn render_chat(
    State(state): State<Arc<WorkerState>>,
    body: axum::body::Body,
) -> Result<Json<Value>, ApiError> {
    let bytes = read_body(body, MAX_BODY_BYTES).await?;
    let request: ChatRequest = from_json(&bytes)?;
    let prepared = state.frontend.chat(&request)?;
    let tokens = prepared.generate.prompt;
    Ok(Json(json!({
        "token_ids": tokens,
        "tokens": tokens,
        "count": tokens.len(),
    })))
}

fn prompt_tokens(state: &WorkerState, bytes: &[u8]) -> Result<Vec<u32>, ApiError> {
    let body: Value = from_json(bytes)?;
    if body.get("messages").is_some() {
        let request: ChatRequest = from_json(bytes)?;
        return Ok(state.frontend.chat(&request)?.generate.prompt);
    }
    let Some(prompt) = body.get("prompt").and_then(Value::as_str) else {
        return Err(ApiError::invalid(
            "send `prompt` (a string) or `messages`".to_string(),
            Some("prompt"),
        ));
    };
    state
        .engine
        .tokenizer
        .encode(prompt)
        .map_err(|e| ApiError::invalid(format!("cannot tokenize the prompt: {e}"), Some("prompt")))
}
