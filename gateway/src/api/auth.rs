//! Who may call what: `/v1` takes an API key (when any are configured) that
//! names the caller's tenant; everything under `/admin` takes the admin token
//! and answers nothing but 401 without it.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sluice_backend::server::ApiError;

use crate::gateway::Gateway;
use crate::preprocess::Caller;

/// The bearer token of an `Authorization` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers
        .get(axum::http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .trim_start();
    // The scheme is case-insensitive (RFC 9110).
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Compares without returning early at the first differing byte.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// Middleware: requests under `/admin` need the admin token.
pub async fn admin_guard(
    State(gateway): State<Arc<Gateway>>,
    request: Request,
    next: Next,
) -> Response {
    let path = request.uri().path();
    if (path == "/admin" || path.starts_with("/admin/"))
        && !bearer(request.headers()).is_some_and(|t| same_secret(t, &gateway.admin_token))
    {
        return ApiError::unauthorized("the admin API needs `Authorization: Bearer <admin token>`")
            .into_response();
    }
    next.run(request).await
}

/// The caller of a `/v1` request: tenant from the API key, session from
/// `X-Session-Id`, priority from `X-Priority`.
pub fn caller(gateway: &Gateway, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let keys = &gateway.config.api_keys;
    let tenant_id = if keys.is_empty() {
        0
    } else {
        let key = bearer(headers).ok_or_else(|| {
            ApiError::unauthorized("missing API key: send `Authorization: Bearer <key>`")
        })?;
        keys.iter()
            .find(|k| same_secret(&k.key, key))
            .map(|k| k.tenant)
            .ok_or_else(|| ApiError::unauthorized("invalid API key"))?
    };
    let session = match headers.get("x-session-id") {
        None => None,
        Some(v) => Some(
            v.to_str()
                .ok()
                .filter(|s| s.len() <= 256)
                .ok_or_else(|| {
                    ApiError::invalid(
                        "X-Session-Id must be visible ASCII, at most 256 bytes",
                        None,
                    )
                })?
                .to_string(),
        ),
    };
    let priority = match headers.get("x-priority") {
        None => 0,
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .ok_or_else(|| ApiError::invalid("X-Priority must be an integer", None))?,
    };
    Ok(Caller {
        tenant_id,
        session,
        priority,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_tokens_and_secrets() {
        let mut h = HeaderMap::new();
        assert_eq!(bearer(&h), None);
        h.insert("authorization", "Bearer sk-1 ".parse().unwrap());
        assert_eq!(bearer(&h), Some("sk-1"));
        h.insert("authorization", "bearer sk-2".parse().unwrap());
        assert_eq!(bearer(&h), Some("sk-2"));
        h.insert("authorization", "Basic xyz".parse().unwrap());
        assert_eq!(bearer(&h), None);
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abc", "abd"));
        assert!(!same_secret("abc", "abcd"));
    }
}
