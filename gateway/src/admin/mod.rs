//! The admin API (behind the admin token, see `crate::api`): the fleet
//! (`GET /admin/workers`, `POST` to register, `DELETE /admin/workers/{id}`)
//! and the plugin slots (`GET /admin/plugins`, `PUT /admin/plugins/{slot}`
//! with a component as the body, `POST /admin/plugins/{slot}/rollback`), a
//! candidate router in shadow (`PUT`/`DELETE /admin/plugins/router/shadow`);
//! and the plugins folder, loaded at start and watched for changes.

mod plugins_dir;

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::json;
use sluice_backend::server::ApiError;
use sluice_backend::server::openai::read_body;

pub use plugins_dir::{load_plugins_dir, watch_plugins_dir};

use crate::gateway::{Gateway, Policies};
use crate::plugins::{LoadError, PluginIdentity};
use crate::routing::Origin;

/// The largest component `PUT /admin/plugins/{slot}` accepts.
pub const MAX_COMPONENT_BYTES: usize = 64 << 20;

pub fn router() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/admin/workers", get(workers).post(register))
        .route("/admin/workers/{id}", axum::routing::delete(remove))
        .route("/admin/plugins", get(plugins))
        .route("/admin/plugins/{slot}", axum::routing::put(put_plugin))
        .route("/admin/plugins/{slot}/rollback", post(rollback))
        .route(
            "/admin/plugins/router/shadow",
            axum::routing::put(put_shadow).delete(delete_shadow),
        )
}

async fn workers(State(gateway): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    Json(json!({"workers": gateway.fleet.status()}))
}

#[derive(serde::Deserialize)]
struct Registration {
    url: String,
}

/// `POST /admin/workers {"url": ...}`: a worker registers (again, as a
/// heartbeat, every few seconds).
async fn register(State(gateway): State<Arc<Gateway>>, body: axum::body::Body) -> Response {
    let r: Registration = match sluice_backend::server::openai::parse(body, 64 << 10).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let url = r.url.trim();
    if !(url.starts_with("http://") || url.starts_with("https://")) || url.len() > 512 {
        return ApiError::invalid("url must be an http:// URL", Some("url")).into_response();
    }
    let id = gateway.add_worker(url, Origin::Registered);
    Json(json!({"id": id})).into_response()
}

async fn remove(State(gateway): State<Arc<Gateway>>, Path(id): Path<u32>) -> Response {
    if gateway.fleet.remove(id) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        ApiError::new(StatusCode::NOT_FOUND, format!("no worker {id}")).into_response()
    }
}

async fn plugins(State(gateway): State<Arc<Gateway>>) -> Json<serde_json::Value> {
    Json(json!({
        "slots": gateway.policies.status(),
        "shadow": gateway.policies.shadow.status(),
    }))
}

#[derive(serde::Deserialize)]
struct PutQuery {
    #[serde(default)]
    config: String,
    /// The name the version is shown under; default: the slot's name.
    name: Option<String>,
}

/// Which slot a path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotName {
    Router,
    Admission,
    CachePolicy,
}

impl SlotName {
    pub const ALL: [SlotName; 3] = [SlotName::Router, SlotName::Admission, SlotName::CachePolicy];

    pub fn as_str(self) -> &'static str {
        match self {
            SlotName::Router => "router",
            SlotName::Admission => "admission",
            SlotName::CachePolicy => "cache-policy",
        }
    }

    fn parse(s: &str) -> Result<Self, ApiError> {
        Self::ALL
            .into_iter()
            .find(|n| n.as_str() == s)
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    format!("no slot `{s}`: the slots are router, admission, cache-policy"),
                )
            })
    }
}

/// Validates and activates a component in a slot (compiles it: blocking work).
pub fn load_into(
    policies: &Policies,
    slot: SlotName,
    name: &str,
    bytes: &[u8],
    config: &str,
) -> Result<(PluginIdentity, crate::plugins::LoadTimings), LoadError> {
    match slot {
        SlotName::Router => policies.router.slot().load(name, bytes, config),
        SlotName::Admission => policies.admission.slot().load(name, bytes, config),
        SlotName::CachePolicy => policies.cache.slot().load(name, bytes, config),
    }
}

async fn put_plugin(
    State(gateway): State<Arc<Gateway>>,
    Path(slot): Path<String>,
    Query(query): Query<PutQuery>,
    body: axum::body::Body,
) -> Response {
    let slot = match SlotName::parse(&slot) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let bytes = match component_bytes(body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let name = query.name.unwrap_or_else(|| slot.as_str().to_string());
    let g = gateway.clone();
    let loaded = tokio::task::spawn_blocking(move || {
        load_into(&g.policies, slot, &name, &bytes, &query.config)
    })
    .await;
    match loaded {
        Ok(Ok((identity, timings))) => Json(json!({
            "slot": slot.as_str(),
            "active": identity,
            "validate_ms": timings.validate.as_secs_f64() * 1e3,
            "swap_us": timings.swap.as_secs_f64() * 1e6,
        }))
        .into_response(),
        Ok(Err(e)) => {
            tracing::warn!(slot = slot.as_str(), error = %e, "plugin refused");
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()).into_response()
        }
        Err(e) => ApiError::unavailable(format!("the load task failed: {e}")).into_response(),
    }
}

/// A request body holding a component: not empty, at most
/// [`MAX_COMPONENT_BYTES`] (read as the API's bodies are: an oversize one's
/// rest is drained before the 413, so the client reads it).
async fn component_bytes(body: axum::body::Body) -> Result<axum::body::Bytes, ApiError> {
    let bytes = read_body(body, MAX_COMPONENT_BYTES)
        .await
        .map_err(|e| match e.status {
            StatusCode::PAYLOAD_TOO_LARGE => ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("a component may be at most {MAX_COMPONENT_BYTES} bytes"),
            ),
            _ => e,
        })?;
    if bytes.is_empty() {
        return Err(ApiError::invalid(
            "the body must be the component's bytes",
            None,
        ));
    }
    Ok(bytes)
}

/// `PUT /admin/plugins/router/shadow` (component as the body, optional
/// `?config=` and `?name=`): validates the candidate and starts asking it
/// beside the active router, with fresh counts.
async fn put_shadow(
    State(gateway): State<Arc<Gateway>>,
    Query(query): Query<PutQuery>,
    body: axum::body::Body,
) -> Response {
    let bytes = match component_bytes(body).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    let name = query.name.unwrap_or_else(|| "shadow".to_string());
    let g = gateway.clone();
    let loaded =
        tokio::task::spawn_blocking(move || g.policies.shadow.load(&name, &bytes, &query.config))
            .await;
    match loaded {
        Ok(Ok(identity)) => {
            tracing::info!(plugin = %identity.name, version = identity.version, "shadow router started");
            Json(json!({"slot": "router", "shadow": identity})).into_response()
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "shadow plugin refused");
            ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, e.to_string()).into_response()
        }
        Err(e) => ApiError::unavailable(format!("the load task failed: {e}")).into_response(),
    }
}

/// `DELETE /admin/plugins/router/shadow`: stops shadowing; answers the
/// candidate's last counts.
async fn delete_shadow(State(gateway): State<Arc<Gateway>>) -> Response {
    let status = gateway.policies.shadow.status();
    match gateway.policies.shadow.clear() {
        Some(identity) => {
            Json(json!({"stopped": identity, "comparison": status.comparison})).into_response()
        }
        None => ApiError::new(StatusCode::NOT_FOUND, "no shadow router is running").into_response(),
    }
}

async fn rollback(State(gateway): State<Arc<Gateway>>, Path(slot): Path<String>) -> Response {
    let slot = match SlotName::parse(&slot) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let p = &gateway.policies;
    let result = match slot {
        SlotName::Router => p.router.slot().rollback(),
        SlotName::Admission => p.admission.slot().rollback(),
        SlotName::CachePolicy => p.cache.slot().rollback(),
    };
    match result {
        Ok(identity) => Json(json!({"slot": slot.as_str(), "active": identity})).into_response(),
        Err(e) => ApiError::new(StatusCode::CONFLICT, e.to_string()).into_response(),
    }
}
