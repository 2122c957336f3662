//! `GET /v1/realtime?call_id=…`: the sideband WebSocket of an app server on a
//! call that someone else holds (a browser on WebRTC, a phone on SIP). The
//! call's events come to it too, and its events go into the call's session
//! as if the caller's side had sent them. Closing it leaves the call as it is.

use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use dashmap::DashMap;
use futures_util::{SinkExt, StreamExt};
use tokio::sync::{broadcast, mpsc};

use super::realtime;
use crate::serve::conn::{self, ConnGauge};
use crate::serve::driver::Inbound;
use crate::serve::error::ApiError;
use crate::serve::state::AppState;

/// Events a sideband may fall behind by before it is dropped.
const SIDEBAND_BACKLOG: usize = 1024;

/// A live call as its sideband sees it: a way in, and its events.
pub struct Link {
    input: mpsc::Sender<Inbound>,
    events: broadcast::Sender<Message>,
}

impl Link {
    /// A link into a call's session; the sender is where the call publishes
    /// its events (none listening is fine).
    pub fn new(input: mpsc::Sender<Inbound>) -> (Self, broadcast::Sender<Message>) {
        let (events, _) = broadcast::channel(SIDEBAND_BACKLOG);
        (
            Self {
                input,
                events: events.clone(),
            },
            events,
        )
    }
}

/// The live calls a sideband can join, by call id (WebRTC and SIP alike).
pub type Links = Arc<DashMap<String, Link>>;

/// `GET /v1/realtime?call_id=…`.
pub fn upgrade(
    state: Arc<AppState>,
    links: &Links,
    headers: &HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
    call_id: String,
) -> Response {
    let ws = match conn::upgrade(&state, headers, ws, &["realtime"]) {
        Ok(ws) => ws,
        Err(e) => return e.into_response(),
    };
    let link = links
        .get(&call_id)
        .map(|l| (l.input.clone(), l.events.subscribe()));
    let Some((input, events)) = link else {
        return ApiError::not_found(format!("no call {call_id:?}")).into_response();
    };
    ws.on_upgrade(move |socket| run(state, socket, input, events))
}

/// Relays both ways until the sideband or the call goes.
async fn run(
    state: Arc<AppState>,
    socket: WebSocket,
    input: mpsc::Sender<Inbound>,
    mut events: broadcast::Receiver<Message>,
) {
    let _conn = ConnGauge::new(&state.metrics, "sideband");
    let (mut sink, mut stream) = socket.split();
    loop {
        tokio::select! {
            ev = events.recv() => match ev {
                Ok(m) => {
                    if sink.send(m).await.is_err() {
                        break;
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {
                    let _ = sink.send(realtime::slow_client_event()).await;
                    break;
                }
                // The call ended.
                Err(broadcast::error::RecvError::Closed) => break,
            },
            m = stream.next() => match m {
                Some(Ok(Message::Text(t))) => {
                    if input.send(Inbound::Text(t.to_string())).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Binary(b))) => {
                    if input.send(Inbound::Binary(b.to_vec())).await.is_err() {
                        break;
                    }
                }
                Some(Ok(_)) => {}
                None | Some(Err(_)) => break,
            },
        }
    }
    let _ = sink.close().await;
}
