//! The wire protocols: each a thin codec between its connection's messages
//! and the conversation core (`serve::conversation`), driven by
//! `serve::driver`. The connection plumbing they share is `serve::conn`.
//! Stateless HTTP has no conversation: each request is one
//! `serve::answer::Answer`, its steps coded into the response body.

pub mod http;
pub mod media;
pub mod realtime;
pub mod sideband;
pub mod sip;
pub mod speech_stream;
pub mod stream;
pub mod twilio;
pub mod webrtc;

use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::WebSocketUpgrade;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::{Extension, Router};
use serde::Deserialize;

use crate::serve::state::AppState;
use sideband::Links;
use std::time::{SystemTime, UNIX_EPOCH};

/// `GET /v1/realtime`: a Realtime session, or with `?call_id=` the sideband
/// of a call (WebRTC or SIP; here, above them, so none depends on another).
pub fn realtime_routes(links: Links) -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/realtime", get(realtime_upgrade))
        .layer(Extension(links))
}

/// Seconds since the Unix epoch (the `created_at`s and `expires_at`s of the wire).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[derive(Deserialize)]
struct Connect {
    /// A call's id: this socket is its sideband.
    call_id: Option<String>,
}

async fn realtime_upgrade(
    State(state): State<Arc<AppState>>,
    Extension(links): Extension<Links>,
    Query(q): Query<Connect>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    match q.call_id {
        Some(call_id) => sideband::upgrade(state, &links, &headers, ws, call_id),
        None => realtime::accept(state, &headers, ws),
    }
}
