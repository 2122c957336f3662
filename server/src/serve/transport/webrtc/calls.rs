//! OpenAI's WebRTC call flow, so that code written for OpenAI's WebRTC guide
//! works unchanged (see `docs/webrtc.md`):
//!
//! - `POST /v1/realtime/client_secrets` (API key): an ephemeral key (`ek_…`)
//!   with a time to live and, optionally, the session configuration its call
//!   starts with. It opens one call and nothing else.
//! - `POST /v1/realtime/calls` (ephemeral key or API key): the SDP offer as
//!   `application/sdp`, or the multipart form of `sdp` and `session`; `201`
//!   with the SDP answer and `Location: /v1/realtime/calls/{call_id}`.
//! - `POST /v1/realtime/calls/{call_id}/hangup` (API key): ends the call.
//! - `GET /v1/realtime?call_id=…` (API key): the sideband WebSocket of an app
//!   server on a call a browser holds (`transport::sideband`).
//!
//! The call itself is the one `/v1/webrtc` makes: the same peer, track and
//! Realtime session.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, Multipart, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use dashmap::DashMap;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{open_call, CallStart, WebRtc, MAX_OFFER_BYTES};
use crate::serve::auth;
use crate::serve::connections::read_body;
use crate::serve::error::ApiError;
use crate::serve::state::AppState;
use crate::serve::transport::{realtime, unix_now};
use crate::serve::voice_store::owner_of;

/// An ephemeral key lives this long unless asked otherwise.
const DEFAULT_TTL_S: u64 = 600;
/// The bounds OpenAI puts on `expires_after.seconds`.
const TTL_RANGE_S: std::ops::RangeInclusive<u64> = 10..=7200;
/// Ephemeral keys outstanding at once (expired ones are swept first).
const MAX_SECRETS: usize = 10_000;

/// An ephemeral key not yet used.
struct Secret {
    expires: Instant,
    /// The session configuration the call starts with (already checked).
    session: Option<Value>,
    /// The voice-store owner of the key that made it: the call speaks that
    /// key's cloned voices.
    owner: String,
}

/// The call flow's ephemeral keys not yet used.
#[derive(Default)]
pub struct Calls {
    secrets: DashMap<String, Secret>,
}

impl Calls {
    /// Whether the key `value` is live, without taking it. `Err`: why not.
    fn check(&self, value: &str, now: Instant) -> Result<(), &'static str> {
        match self.secrets.get(value) {
            None => Err("unknown or already used ephemeral key"),
            Some(s) if s.expires <= now => Err("the ephemeral key expired"),
            Some(_) => Ok(()),
        }
    }

    /// Takes the key `value` if it is live. `Err`: why it is refused.
    fn redeem(&self, value: &str, now: Instant) -> Result<Secret, &'static str> {
        let Some((_, s)) = self.secrets.remove(value) else {
            return Err("unknown or already used ephemeral key");
        };
        if s.expires <= now {
            return Err("the ephemeral key expired");
        }
        Ok(s)
    }

    /// Gives a taken key back: the call it was for could not be opened (the
    /// server at its session cap, say), so the browser may try again.
    fn restore(&self, value: String, secret: Secret) {
        self.secrets.insert(value, secret);
    }

    fn insert(&self, value: String, secret: Secret, now: Instant) -> Result<(), ApiError> {
        if self.secrets.len() >= MAX_SECRETS {
            self.secrets.retain(|_, s| s.expires > now);
        }
        if self.secrets.len() >= MAX_SECRETS {
            return Err(ApiError::overloaded(format!(
                "too many unused ephemeral keys (limit {MAX_SECRETS}); retry shortly"
            )));
        }
        self.secrets.insert(value, secret);
        Ok(())
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct SecretRequest {
    expires_after: Option<ExpiresAfter>,
    session: Option<Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ExpiresAfter {
    anchor: Option<String>,
    seconds: Option<u64>,
}

fn no_webrtc() -> ApiError {
    ApiError::internal("WebRTC is not available on this server")
}

/// `POST /v1/realtime/client_secrets`.
pub async fn client_secrets(
    State(state): State<Arc<AppState>>,
    Extension(rtc): Extension<Option<Arc<WebRtc>>>,
    headers: HeaderMap,
    body: Result<Json<Value>, JsonRejection>,
) -> Response {
    let owner = owner_of(auth::bearer(&headers));
    match make_secret(&state, rtc, owner, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn make_secret(
    state: &Arc<AppState>,
    rtc: Option<Arc<WebRtc>>,
    owner: String,
    body: Result<Json<Value>, JsonRejection>,
) -> Result<Response, ApiError> {
    let rtc = rtc.ok_or_else(no_webrtc)?;
    let body = match body {
        Ok(Json(v)) => v,
        // An empty body asks for the defaults.
        Err(JsonRejection::MissingJsonContentType(_)) => json!({}),
        Err(e) => return Err(ApiError::bad_request("invalid_json", e.body_text())),
    };
    let req: SecretRequest = serde_json::from_value(body)
        .map_err(|e| ApiError::bad_request("invalid_request", e.to_string()))?;
    let ttl = match req.expires_after {
        None => DEFAULT_TTL_S,
        Some(e) => {
            if e.anchor.as_deref().is_some_and(|a| a != "created_at") {
                return Err(ApiError {
                    param: Some("expires_after.anchor"),
                    ..ApiError::bad_request("invalid_value", "the anchor is \"created_at\"")
                });
            }
            let s = e.seconds.unwrap_or(DEFAULT_TTL_S);
            if !TTL_RANGE_S.contains(&s) {
                return Err(ApiError {
                    param: Some("expires_after.seconds"),
                    ..ApiError::bad_request(
                        "invalid_value",
                        format!(
                            "expires_after.seconds is {}–{}",
                            TTL_RANGE_S.start(),
                            TTL_RANGE_S.end()
                        ),
                    )
                });
            }
            s
        }
    };
    // Checked now, as a session.update would be: a bad one is this call's 400.
    let effective = match &req.session {
        Some(s) => realtime::check_session(state, &owner, s).map_err(|e| e.to_api())?,
        None => realtime::check_session(state, &owner, &json!({})).map_err(|e| e.to_api())?,
    };
    let value = format!("ek_{}", uuid::Uuid::new_v4().simple());
    let now = Instant::now();
    rtc.calls.insert(
        value.clone(),
        Secret {
            expires: now + Duration::from_secs(ttl),
            session: req.session,
            owner,
        },
        now,
    )?;
    Ok(Json(json!({
        "value": value,
        "expires_at": unix_now() + ttl,
        "session": effective,
    }))
    .into_response())
}

/// The caller's credential for a call.
enum Caller {
    /// An API key (or none is needed).
    Keyed,
    /// A live ephemeral key, taken when the call opens.
    Ephemeral(String),
}

/// Who may open a call: an API key (or none needed), or a live ephemeral
/// key. Nothing is taken yet: a request refused for its offer keeps its key.
fn authorize(state: &AppState, rtc: &WebRtc, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let refused = |m: &str| ApiError {
        message: m.into(),
        ..ApiError::unauthorized()
    };
    if let Some(key) = auth::bearer(headers).filter(|k| k.starts_with("ek_")) {
        rtc.calls.check(key, Instant::now()).map_err(refused)?;
        return Ok(Caller::Ephemeral(key.to_string()));
    }
    if auth::authorized(state, headers) {
        Ok(Caller::Keyed)
    } else {
        Err(ApiError::unauthorized())
    }
}

/// `POST /v1/realtime/calls`.
pub async fn calls(
    State(state): State<Arc<AppState>>,
    Extension(rtc): Extension<Option<Arc<WebRtc>>>,
    req: Request,
) -> Response {
    match call(state, rtc, req).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn call(
    state: Arc<AppState>,
    rtc: Option<Arc<WebRtc>>,
    req: Request,
) -> Result<Response, ApiError> {
    let rtc = rtc.ok_or_else(no_webrtc)?;
    let caller = authorize(&state, &rtc, req.headers())?;
    let keyed_owner = owner_of(auth::bearer(req.headers()));
    let ctype = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let (sdp, form_session) = if ctype.starts_with("multipart/form-data") {
        read_form(&state, &keyed_owner, req).await?
    } else if ctype.starts_with("application/sdp") {
        let body = read_body(req, MAX_OFFER_BYTES).await?;
        let sdp = String::from_utf8(body.to_vec())
            .map_err(|_| super::bad_offer("the SDP offer is not UTF-8"))?;
        (sdp, None)
    } else {
        return Err(ApiError::unsupported_media_type(format!(
            "send the offer as application/sdp, or multipart/form-data with `sdp` and `session`, not {ctype:?}"
        )));
    };
    // The app server chose the session when it made the key: a browser
    // holding the key does not get to change it.
    if form_session.is_some() && matches!(caller, Caller::Ephemeral(_)) {
        return Err(ApiError {
            param: Some("session"),
            ..ApiError::bad_request(
                "invalid_request",
                "a call opened with an ephemeral key takes its session from the key: leave `session` out",
            )
        });
    }
    let codec = super::sdp::audio_codec(&sdp).map_err(super::bad_offer)?;
    // The offer is sound: the key is taken now (once, even if raced).
    let taken = match caller {
        Caller::Keyed => None,
        Caller::Ephemeral(key) => {
            let secret = rtc
                .calls
                .redeem(&key, Instant::now())
                .map_err(|m| ApiError {
                    message: m.into(),
                    ..ApiError::unauthorized()
                })?;
            Some((key, secret))
        }
    };
    let key_session = taken.as_ref().and_then(|(_, s)| s.session.clone());
    let owner = match &taken {
        Some((_, s)) => s.owner.clone(),
        None => keyed_owner,
    };
    let initial: Vec<Value> = key_session.into_iter().chain(form_session).collect();
    let start = CallStart { initial, owner };
    let (id, answer) = match open_call(&state, &rtc, &sdp, codec, start).await {
        Ok(opened) => opened,
        Err(e) => {
            if let Some((key, secret)) = taken {
                rtc.calls.restore(key, secret);
            }
            return Err(e);
        }
    };
    Ok((
        StatusCode::CREATED,
        [
            (header::CONTENT_TYPE, "application/sdp".to_string()),
            (header::LOCATION, format!("/v1/realtime/calls/{id}")),
        ],
        answer,
    )
        .into_response())
}

/// The multipart form: `sdp` (the offer) and an optional `session` (JSON).
async fn read_form(
    state: &Arc<AppState>,
    owner: &str,
    req: Request,
) -> Result<(String, Option<Value>), ApiError> {
    let bad = |m: String| ApiError::bad_request("invalid_request", m);
    let (parts, body) = req.into_parts();
    let bytes = read_body(Request::from_parts(parts.clone(), body), MAX_OFFER_BYTES).await?;
    let req = Request::from_parts(parts, axum::body::Body::from(bytes));
    let mut form = Multipart::from_request(req, state)
        .await
        .map_err(|e| bad(e.body_text()))?;
    let (mut sdp, mut session) = (None, None);
    while let Some(field) = form
        .next_field()
        .await
        .map_err(|e| bad(format!("the form cannot be read: {}", e.body_text())))?
    {
        let name = field.name().unwrap_or_default().to_string();
        let text = field
            .text()
            .await
            .map_err(|e| bad(format!("form field {name:?}: {}", e.body_text())))?;
        match name.as_str() {
            "sdp" => sdp = Some(text),
            "session" => {
                let v: Value = serde_json::from_str(&text).map_err(|e| ApiError {
                    param: Some("session"),
                    ..bad(format!("session is not JSON: {e}"))
                })?;
                realtime::check_session(state, owner, &v).map_err(|e| e.to_api())?;
                session = Some(v);
            }
            other => {
                return Err(bad(format!(
                    "unknown form field {other:?}: use sdp and session"
                )))
            }
        }
    }
    let sdp = sdp.ok_or_else(|| ApiError {
        param: Some("sdp"),
        ..bad("the form has no sdp field".into())
    })?;
    Ok((sdp, session))
}

/// `POST /v1/realtime/calls/{call_id}/hangup`.
pub async fn hangup(
    Extension(rtc): Extension<Option<Arc<WebRtc>>>,
    Path(call_id): Path<String>,
) -> Response {
    super::close_peer(rtc, &call_id, "call").await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_opens_one_call_before_it_expires() {
        let calls = Calls::default();
        let t0 = Instant::now();
        let secret = |ttl: u64| Secret {
            expires: t0 + Duration::from_secs(ttl),
            session: Some(json!({"instructions": "hi"})),
            owner: String::new(),
        };
        calls.insert("ek_a".into(), secret(60), t0).unwrap();
        calls.insert("ek_b".into(), secret(10), t0).unwrap();
        let taken = calls.redeem("ek_a", t0).expect("a live key");
        assert_eq!(taken.session, Some(json!({"instructions": "hi"})));
        // Once only...
        assert!(calls.redeem("ek_a", t0).is_err());
        // ...unless its call could not be opened: then it is given back.
        calls.restore("ek_a".into(), taken);
        assert!(calls.redeem("ek_a", t0).is_ok());
        assert_eq!(
            calls.redeem("ek_b", t0 + Duration::from_secs(11)).err(),
            Some("the ephemeral key expired")
        );
        assert!(calls.redeem("ek_forged", t0).is_err());
    }
}
