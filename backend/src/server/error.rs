//! Errors in OpenAI's shape, turned into HTTP responses in one place:
//! `{"error": {"message", "type", "param", "code"}}` with the matching status.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<&'static str>,
}

impl ApiError {
    /// An error with no request field at fault.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// An error with status `code` (from a plugin or a worker), or
    /// `otherwise` when there is none or it is not a valid status.
    pub fn with_code(code: Option<u16>, otherwise: StatusCode, message: impl Into<String>) -> Self {
        let status = code
            .and_then(|c| StatusCode::from_u16(c).ok())
            .unwrap_or(otherwise);
        Self::new(status, message)
    }

    pub fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param,
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            param: Some("model"),
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            param: None,
        }
    }

    /// A path nothing answers.
    pub fn not_found_path() -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: "no such endpoint".into(),
            param: None,
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            param: None,
        }
    }

    /// OpenAI's `type` for the status.
    pub fn kind(&self) -> &'static str {
        match self.status.as_u16() {
            400 | 413 | 422 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            502..=504 => "service_unavailable",
            _ => "server_error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": null,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
