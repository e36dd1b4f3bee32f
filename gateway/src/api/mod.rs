//! The HTTP front door (axum on hyper): the OpenAI endpoints under `/v1`
//! (`v1`), the admin API under `/admin` (`crate::admin`), `/metrics` and
//! `/health`, with API-key and admin-token checks (`auth`).

mod auth;
mod server;
mod timer_floor;
mod v1;

pub use server::{ServerThreads, start as start_server_threads, thread_client};

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use sluice_backend::server::ApiError;

use crate::gateway::Gateway;

/// Every route of the gateway.
pub fn router(gateway: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(v1::chat_completions))
        .route("/v1/completions", post(v1::completions))
        .route("/v1/models", get(v1::models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(crate::admin::router())
        .fallback(|| async { ApiError::not_found_path() })
        // Bodies are read by the handlers, to answer an oversize one with an
        // OpenAI-shaped 413.
        .layer(DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(
            gateway.clone(),
            auth::admin_guard,
        ))
        .with_state(gateway)
}

/// Serves on `listener` until `shutdown` resolves (then lets open
/// connections finish); every accepted socket gets TCP_NODELAY.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    gateway: Arc<Gateway>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(error = %e, "cannot set TCP_NODELAY");
        }
    });
    axum::serve(listener, router(gateway))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn health(State(gateway): State<Arc<Gateway>>) -> Response {
    let healthy = gateway.fleet.healthy_count();
    let body = serde_json::json!({
        "status": if healthy > 0 { "ok" } else { "no_workers" },
        "healthy_workers": healthy,
    });
    let status = if healthy > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}

async fn metrics(State(gateway): State<Arc<Gateway>>) -> Response {
    let text = gateway.metrics.render(
        &gateway.policies.status(),
        &gateway.policies.shadow.status(),
    );
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response()
}
