//! The errors a client sees, in both their forms: an HTTP response
//! ([`ApiError`]) and an `error` event on a connection ([`ClientError`]).

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::shutdown;

/// The error code a failed request's message maps to: `stage_unavailable`
/// when a stage replica was lost (the engine's messages say so first).
pub fn failure_code(message: &str) -> &'static str {
    if message.starts_with("stage_unavailable") {
        "stage_unavailable"
    } else if message.starts_with(shutdown::CODE) {
        shutdown::CODE
    } else if message.contains(CONTEXT_LENGTH_EXCEEDED) {
        CONTEXT_LENGTH_EXCEEDED
    } else if message.contains(INVALID_TOOL_CALL) {
        INVALID_TOOL_CALL
    } else {
        "generation_failed"
    }
}

/// The error `type` of a failure code: the client's fault, or the server's.
pub fn failure_kind(code: &str) -> &'static str {
    match code {
        CONTEXT_LENGTH_EXCEEDED => "invalid_request_error",
        _ => "server_error",
    }
}

/// The request field a failure code blames (a prompt over the context: the
/// messages), in both error forms.
fn failure_param(code: &str) -> Option<&'static str> {
    (code == CONTEXT_LENGTH_EXCEEDED).then_some("messages")
}

/// The model wrote a tool call that cannot be read (the server's fault: the
/// model's, with the client's tools).
const INVALID_TOOL_CALL: &str = omnistream_stages::engine::tools::INVALID_TOOL_CALL;

/// A prompt over the Thinker's context: the client's fault (400), as OpenAI.
const CONTEXT_LENGTH_EXCEEDED: &str = omnistream_stages::models::CONTEXT_LENGTH_EXCEEDED;

/// An error in the OpenAI shape: `{"error": {"message", "type", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    /// Seconds for `Retry-After` (503 when over capacity).
    pub retry_after: Option<u64>,
    /// The request field at fault (OpenAI's `param`).
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            code,
            message: message.into(),
            retry_after: None,
            param: None,
        }
    }
    pub fn unauthorized() -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            kind: "invalid_request_error",
            code: "invalid_api_key",
            message: "missing or invalid API key".into(),
            retry_after: None,
            param: None,
        }
    }
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: "overloaded",
            message: message.into(),
            retry_after: Some(1),
            param: None,
        }
    }
    /// A stage has no live replica, or lost the one serving this request.
    pub fn stage_unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: "stage_unavailable",
            message: message.into(),
            retry_after: Some(1),
            param: None,
        }
    }
    /// A request body that came too slowly (the connection layer's pacing).
    pub fn request_timeout(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::REQUEST_TIMEOUT,
            code: "request_timeout",
            ..Self::bad_request("", message)
        }
    }
    /// A body of a type this endpoint does not take (among them the types a
    /// page elsewhere may send without a preflight).
    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ..Self::bad_request("unsupported_media_type", message)
        }
    }
    /// A request to a WebSocket endpoint that is no handshake.
    pub fn upgrade_refused(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code: "websocket_upgrade_required",
            ..Self::bad_request("", message)
        }
    }
    /// No route at this path (or not for this method).
    pub fn no_route(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            code: if status == StatusCode::METHOD_NOT_ALLOWED {
                "method_not_allowed"
            } else {
                "not_found"
            },
            ..Self::bad_request("", message)
        }
    }
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            code: "request_too_large",
            ..Self::bad_request("", format!("request body is larger than {limit} bytes"))
        }
    }
    /// New work while the server drains, or an answer its shutdown cut.
    pub fn shutting_down() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_error",
            code: shutdown::CODE,
            message: shutdown::MESSAGE[shutdown::CODE.len() + 2..].into(),
            retry_after: Some(1),
            param: None,
        }
    }
    /// A request that failed while generating.
    pub fn failed(message: String) -> Self {
        match failure_code(&message) {
            "stage_unavailable" => Self::stage_unavailable(message),
            shutdown::CODE => Self::shutting_down(),
            CONTEXT_LENGTH_EXCEEDED => Self {
                param: failure_param(CONTEXT_LENGTH_EXCEEDED),
                ..Self::bad_request(CONTEXT_LENGTH_EXCEEDED, message)
            },
            INVALID_TOOL_CALL => Self {
                code: INVALID_TOOL_CALL,
                ..Self::internal(message)
            },
            _ => Self::internal(message),
        }
    }
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            kind: "invalid_request_error",
            code,
            message: message.into(),
            retry_after: None,
            param: None,
        }
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            code: "not_found",
            message: message.into(),
            retry_after: None,
            param: None,
        }
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "server_error",
            code: "internal_error",
            message: message.into(),
            retry_after: None,
            param: None,
        }
    }
    /// Its `outcome` in `omnistream_requests_total`: `overloaded` for a 503
    /// (over capacity, shutting down, no stage replica), `bad_request` for
    /// the client's faults, else `error`.
    pub fn outcome(&self) -> &'static str {
        match self.status {
            StatusCode::SERVICE_UNAVAILABLE => "overloaded",
            s if s.is_client_error() => "bad_request",
            _ => "error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            if let Ok(v) = header::HeaderValue::from_str(&s.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

/// A client-visible error: an `error` event; the connection stays usable
/// unless the caller closes it.
#[derive(Debug, Clone)]
pub struct ClientError {
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub param: Option<&'static str>,
}

impl ClientError {
    pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind: "invalid_request_error",
            code,
            message: message.into(),
            param: None,
        }
    }
    pub fn param(param: &'static str, message: impl Into<String>) -> Self {
        Self::invalid("invalid_value", message).at(param)
    }
    /// The same error, naming the request field at fault.
    pub fn at(self, param: &'static str) -> Self {
        Self {
            param: Some(param),
            ..self
        }
    }
    pub fn server(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            kind: "server_error",
            ..Self::invalid(code, message)
        }
    }
    /// A request that failed: its code, type and param from the message,
    /// as [`ApiError::failed`] gives them.
    pub fn failed(message: String) -> Self {
        let code = failure_code(&message);
        Self {
            kind: failure_kind(code),
            param: failure_param(code),
            ..Self::invalid(code, message)
        }
    }
    pub fn slow_client() -> Self {
        Self::server(
            "slow_client",
            "the client did not read its output in time; the connection is dropped",
        )
    }
    pub fn shutting_down() -> Self {
        ApiError::shutting_down().into()
    }
    pub fn expired() -> Self {
        Self::invalid(
            "session_expired",
            "the session expired after being idle; reconnect",
        )
    }
}

impl From<ApiError> for ClientError {
    fn from(e: ApiError) -> Self {
        Self {
            kind: e.kind,
            code: e.code,
            message: e.message,
            param: e.param,
        }
    }
}

impl ClientError {
    /// How a request refused or failed with this error counts in
    /// `omnistream_requests_total` (docs/api.md), as its HTTP status says.
    pub fn outcome(&self) -> &'static str {
        self.to_api().outcome()
    }

    /// The same error as an HTTP response: 503 when over capacity or
    /// shutting down, 500 for the server's faults, else 400.
    pub fn to_api(&self) -> ApiError {
        let status = match (self.kind, self.code) {
            (_, "overloaded" | "stage_unavailable") => StatusCode::SERVICE_UNAVAILABLE,
            (_, c) if c == shutdown::CODE => StatusCode::SERVICE_UNAVAILABLE,
            ("server_error", _) => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError {
            status,
            kind: self.kind,
            code: self.code,
            message: self.message.clone(),
            retry_after: (status == StatusCode::SERVICE_UNAVAILABLE).then_some(1),
            param: self.param,
        }
    }
}
