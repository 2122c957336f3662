//! API keys: `Authorization: Bearer KEY` for HTTP; for WebSockets also the
//! `openai-insecure-api-key.KEY` subprotocol (browsers cannot set headers).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::state::AppState;

/// The subprotocol prefix that carries an API key from a browser WebSocket.
pub const KEY_SUBPROTOCOL_PREFIX: &str = "openai-insecure-api-key.";

/// Whether the request carries an accepted key (always true when none are set).
pub fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    let keys = &state.config.api_keys;
    keys.is_empty() || presented(headers).any(|k| key_matches(keys, k))
}

/// The key whose cloned voices a WebSocket session speaks: the first one it
/// presents that is accepted (with no keys set, the first it presents).
pub fn presented_key<'a>(state: &AppState, headers: &'a HeaderMap) -> Option<&'a str> {
    let keys = &state.config.api_keys;
    presented(headers).find(|k| keys.is_empty() || key_matches(keys, k))
}

/// The keys a request presents: its Bearer credentials, then the key
/// subprotocols a browser WebSocket sends.
fn presented(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    bearer(headers).into_iter().chain(
        headers
            .get_all(header::SEC_WEBSOCKET_PROTOCOL)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|p| p.trim().strip_prefix(KEY_SUBPROTOCOL_PREFIX)),
    )
}

/// Whether `key`, given in a protocol's own message (a phone stream's
/// `start`), is accepted (always true when none are set).
pub fn key_accepted(state: &AppState, key: &str) -> bool {
    let keys = &state.config.api_keys;
    keys.is_empty() || key_matches(keys, key)
}

/// The credentials of `Authorization: Bearer …` (the scheme is case-insensitive,
/// RFC 9110 §11.1).
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Whether `given` is one of `keys`, in time that depends on neither which key
/// matched nor how much of it: every key is compared in full (`subtle`).
fn key_matches(keys: &[String], given: &str) -> bool {
    use subtle::ConstantTimeEq;
    keys.iter()
        .fold(subtle::Choice::from(0), |any, k| {
            any | k.as_bytes().ct_eq(given.as_bytes())
        })
        .into()
}

pub async fn require_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if authorized(&state, req.headers()) {
        next.run(req).await
    } else {
        ApiError::unauthorized().into_response()
    }
}

/// Browsers: the `Host` must be a name this server answers to, and an
/// `Origin`, when there is one, this server's own (scheme, host and port) or
/// listed. Non-browser clients send no `Origin`; the `Host` check stops DNS
/// rebinding, where a page's own name points at this server.
pub async fn same_site(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if !host_allowed(&state, req.headers()) {
        return ApiError::forbidden(
            "host_not_allowed",
            "this Host is not one this server answers to (server.allowed_hosts)",
        )
        .into_response();
    }
    if !origin_allowed(&state, req.headers()) {
        return ApiError::forbidden(
            "origin_not_allowed",
            "requests from this Origin are not allowed here (server.allowed_origins)",
        )
        .into_response();
    }
    next.run(req).await
}

/// `localhost`, any IP address, or a listed name (any port); no `Host` at all
/// (HTTP/1.0, health checkers) passes: browsers always send one.
pub fn host_allowed(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST) else {
        return true;
    };
    let Ok(host) = host.to_str() else {
        return false;
    };
    let name = host_name(host);
    name.eq_ignore_ascii_case("localhost")
        || name.parse::<std::net::IpAddr>().is_ok()
        || state
            .config
            .allowed_hosts
            .iter()
            .any(|h| h == "*" || h.eq_ignore_ascii_case(name) || h.eq_ignore_ascii_case(host))
}

/// The name of `host[:port]` (an IPv6 literal without its brackets).
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    host.rsplit_once(':')
        .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
        .map_or(host, |(name, _)| name)
}

/// No `Origin` (not a browser), a listed one, or this server's own: the same
/// scheme (`X-Forwarded-Proto` behind a TLS proxy, else http), host and port.
pub fn origin_allowed(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN) else {
        return true;
    };
    let Ok(origin) = origin.to_str() else {
        return false;
    };
    let origin = origin.trim_end_matches('/');
    if state
        .config
        .allowed_origins
        .iter()
        .any(|o| o == "*" || o.trim_end_matches('/').eq_ignore_ascii_case(origin))
    {
        return true;
    }
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let scheme = headers
        .get("x-forwarded-proto")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(',').next())
        .map_or("http", str::trim);
    let ours = format!("{scheme}://{host}");
    origin.eq_ignore_ascii_case(&ours) || origin.eq_ignore_ascii_case(&default_port_less(&ours))
}

/// `http://h:80` as browsers write it (`http://h`), likewise `https://h:443`.
fn default_port_less(origin: &str) -> String {
    for (scheme, port) in [("http://", ":80"), ("https://", ":443")] {
        if origin.starts_with(scheme) {
            if let Some(o) = origin.strip_suffix(port) {
                return o.to_string();
            }
        }
    }
    origin.to_string()
}
