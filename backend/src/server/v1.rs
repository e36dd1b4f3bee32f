//! The worker's `/v1` handlers: the shared OpenAI layer ([`super::openai`])
//! in front of this worker's engine.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use axum::Json;
use axum::extract::State;
use axum::response::Response;
use serde_json::Value;

use super::error::ApiError;
use super::openai::{ChatRequest, CompletionRequest, Prepared, parse};
use super::{MAX_BODY_BYTES, WorkerState};

/// Submits a validated request to the engine and answers it.
async fn run(state: Arc<WorkerState>, prepared: Prepared) -> Result<Response, ApiError> {
    let (engine_id, events) = state.engine.submit(prepared.generate);
    state.metrics.requests.fetch_add(1, Ordering::Relaxed);
    let id = format!(
        "{}-{}-{engine_id}",
        prepared.reply.kind.id_prefix(),
        state.instance
    );
    let metrics_state = state.clone();
    state
        .frontend
        .respond(prepared.reply, id, events, move |usage| {
            metrics_state.metrics.record(usage)
        })
        .await
}

pub async fn chat_completions(
    State(state): State<Arc<WorkerState>>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let request: ChatRequest = parse(body, MAX_BODY_BYTES).await?;
    let prepared = state.frontend.chat(&request)?;
    run(state, prepared).await
}

pub async fn completions(
    State(state): State<Arc<WorkerState>>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let request: CompletionRequest = parse(body, MAX_BODY_BYTES).await?;
    let prepared = state.frontend.completion(&request)?;
    run(state, prepared).await
}

pub async fn models(State(state): State<Arc<WorkerState>>) -> Json<Value> {
    Json(state.frontend.models())
}
