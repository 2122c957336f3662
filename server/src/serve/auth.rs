//! API keys: `Authorization: Bearer KEY` for HTTP; for WebSockets also the
//! `openai-insecure-api-key.KEY` subprotocol (browsers cannot set headers).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::state::AppState;
use super::ApiError;

/// The subprotocol prefix that carries an API key from a browser WebSocket.
pub const KEY_SUBPROTOCOL_PREFIX: &str = "openai-insecure-api-key.";

/// Whether the request carries an accepted key (always true when none are set).
pub fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    let keys = &state.config.api_keys;
    if keys.is_empty() {
        return true;
    }
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if bearer.is_some_and(|b| keys.iter().any(|k| k == b)) {
        return true;
    }
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|p| p.trim().strip_prefix(KEY_SUBPROTOCOL_PREFIX))
        .any(|k| keys.iter().any(|key| key == k))
}

pub async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if authorized(&state, req.headers()) {
        next.run(req).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

/// Browser WebSockets: the `Origin` must be the server's own host or listed.
pub fn origin_allowed(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true; // not a browser
    };
    if state
        .config
        .allowed_origins
        .iter()
        .any(|o| o == "*" || o == origin)
    {
        return true;
    }
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    host.is_some_and(|h| {
        origin
            .split_once("://")
            .is_some_and(|(_, rest)| rest.trim_end_matches('/') == h)
    })
}
