//! `omnistream serve`: one port, axum on tokio. OpenAI-compatible HTTP, the
//! Realtime WebSocket, a plain PCM WebSocket, the demo page, metrics.

mod audio;
mod auth;
mod connections;
mod listen;
mod metrics;
mod openai;
mod realtime;
mod sessions;
mod shutdown;
mod state;
mod stream;
mod turns;
mod web;
mod webrtc;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};

pub use sessions::SessionLimits;
pub use state::{AppState, ServerConfig};

use crate::run::{chat_spec, load_profile_placed, run_request};
use omnistream_stages::engine::{
    Modalities, RequestInput, RequestSpec, SamplingOverrides, StageRole, TRANSCRIBE_RATE,
};
use omnistream_stages::models::silero_vad::SileroVad;
use omnistream_stages::profile::Profile;

/// Options of `omnistream serve`.
pub struct ServeOptions {
    pub profile: PathBuf,
    pub host: String,
    pub port: u16,
    /// Extra API keys (added to the profile's `server.api_keys`).
    pub api_keys: Vec<String>,
    pub limits: SessionLimits,
    /// NATS server joining this gateway to the profile's remote stages.
    pub nats: Option<String>,
    /// How long to wait at start for each remote stage's first replica.
    pub wait_stages: Duration,
}

/// Loads the pipeline, warms it up, and serves until ctrl-c.
pub async fn run(opts: ServeOptions) -> Result<()> {
    let profile = Profile::load(&opts.profile)?;
    let (mesh, remote) =
        crate::distributed::remote_stages(&profile, opts.nats.as_deref(), opts.wait_stages).await?;
    let pipeline = {
        let profile = profile.clone();
        let gateway_id = mesh.as_ref().map(|m| m.process());
        tokio::task::spawn_blocking(move || -> Result<_> {
            let mut p = load_profile_placed(&profile, remote)?;
            if let Some(g) = gateway_id {
                // Ids unique across the gateways that share the stage processes.
                p.set_first_request_id((g >> 32) << 32 | 1);
            }
            // Warm-up: every stage runs once before the first client waits on it.
            let mut warm = chat_spec("Hi", Modalities::TEXT_AUDIO, SamplingOverrides::default());
            warm.sampling.max_tokens = Some(4);
            run_request(&p, warm, |_| {}).context("warm-up request")?;
            // A chat does not touch the Listener: half a second of silence does.
            if p.has_role(StageRole::Listener) {
                let hear = RequestSpec {
                    input: RequestInput::Transcribe {
                        audio: vec![0.0; TRANSCRIBE_RATE as usize / 2].into(),
                    },
                    modalities: Modalities::TEXT,
                    sampling: SamplingOverrides::default(),
                    voice: None,
                };
                run_request(&p, hear, |_| {}).context("warm-up transcription")?;
            }
            Ok(p)
        })
        .await
        .context("loading the pipeline")??
    };
    let server = profile.server.clone().unwrap_or_default();
    let mut api_keys = server.api_keys.clone();
    api_keys.extend(opts.api_keys.iter().cloned());
    let vad = match &server.vad {
        Some(v) => {
            let path = profile.resolve(&v.model);
            let model = SileroVad::load(&path, &candle_core::Device::Cpu)
                .with_context(|| format!("loading the VAD model {}", path.display()))?;
            Some(state::VadHub {
                model: Arc::new(model),
                min_speech_ms: v.min_speech_ms,
                echo_guard_ms: v.echo_guard_ms,
            })
        }
        None => None,
    };
    let config = ServerConfig {
        model_name: profile.name.clone(),
        api_keys,
        allowed_origins: server.allowed_origins.clone(),
        allowed_hosts: server.allowed_hosts.clone(),
        limits: opts.limits,
        vad,
    };
    let limits =
        connections::Limits::new(&server.connections, connections::raise_open_file_limit());
    let rtc = webrtc::WebRtc::new(&server.webrtc).context("setting up WebRTC")?;
    let state = AppState::new(pipeline, config, Some(rtc))?;
    let app = router(state.clone());
    let addr: SocketAddr = format!("{}:{}", opts.host, opts.port)
        .parse()
        .with_context(|| format!("bad address {}:{}", opts.host, opts.port))?;
    let listener = connections::listen(addr).with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    // Tests and scripts wait for this line.
    println!(
        "omnistream listening on http://{local}/ (profile {})",
        opts.profile.display()
    );
    let reaper = state.sessions.spawn_reaper(Duration::from_secs(5));
    let drain = Duration::from_secs_f64(server.drain_s);
    connections::serve(
        listener,
        app,
        limits,
        state.metrics.clone(),
        shut_down_on_signal(state.clone(), drain),
        CLOSE_LINGER,
    )
    .await;
    reaper.abort();
    drop(mesh);
    println!("omnistream shut down");
    Ok(())
}

/// Time the connections get to finish after the drain, and the clients to
/// read their last events.
const CLOSE_LINGER: Duration = Duration::from_secs(5);

/// Resolves once the server may stop accepting: after SIGTERM or SIGINT, it
/// drains (new work refused, answers in flight finish) until nothing runs or
/// `drain` passes (or a second signal comes), then closes what still runs and
/// waits for the sessions to say goodbye.
async fn shut_down_on_signal(state: Arc<AppState>, drain: Duration) {
    crate::distributed::wait_for_signal().await;
    // Lifecycle lines go to stdout beside the listening line (the log's
    // default level is warn).
    println!(
        "omnistream shutting down: draining {} sessions and {} requests for up to {:.1} s",
        state.sessions.count(),
        state.sessions.in_flight(),
        drain.as_secs_f64()
    );
    state.shutdown.enter(shutdown::Phase::Draining);
    tokio::select! {
        _ = state.idle() => {}
        _ = tokio::time::sleep(drain) => {
            println!("omnistream drain deadline: cancelling what still runs");
        }
        _ = crate::distributed::wait_for_signal() => {
            println!("omnistream second signal: cancelling what still runs");
        }
    }
    state.shutdown.enter(shutdown::Phase::Closing);
    let _ = tokio::time::timeout(CLOSE_LINGER, state.idle()).await;
}

/// While draining, new work gets 503 `server_shutting_down` (and the
/// connection is closed); `/health` and `/metrics` still answer.
async fn refuse_when_draining(
    State(state): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if state.shutdown.draining() && !matches!(req.uri().path(), "/health" | "/metrics") {
        let mut r = ApiError::shutting_down().into_response();
        r.headers_mut().insert(
            header::CONNECTION,
            header::HeaderValue::from_static("close"),
        );
        return r;
    }
    next.run(req).await
}

/// All routes. Public ones: `/`, `/health`; everything under `/v1` and
/// `/metrics` goes through the API-key check.
pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics::handler))
        .merge(openai::routes())
        .merge(listen::routes())
        .merge(realtime::routes())
        .merge(stream::routes())
        .merge(webrtc::routes())
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ));
    Router::new()
        .route("/health", get(health))
        .merge(web::routes())
        .merge(api)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            refuse_when_draining,
        ))
        // Before everything else, the key check included: a page elsewhere,
        // or one that rebinds its name to this server, is refused outright.
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::same_site,
        ))
        .with_state(state)
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    let stats = state.pipeline.stats();
    let alive = stats.stages.iter().all(|s| s.alive);
    let draining = state.shutdown.draining();
    let status = match (draining, alive) {
        (true, _) => "draining",
        (false, true) => "ok",
        (false, false) => "degraded",
    };
    let body = serde_json::json!({
        "status": status,
        "sessions_open": state.sessions.count(),
        "requests_in_flight": state.sessions.in_flight(),
        "stages": stats.stages.iter().map(|s| serde_json::json!({"name": s.name, "alive": s.alive})).collect::<Vec<_>>(),
    });
    let code = if alive && !draining {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(body)).into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> Response {
    let created = state.started_unix;
    Json(serde_json::json!({
        "object": "list",
        "data": [{
            "id": state.config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "omnistream",
        }],
    }))
    .into_response()
}

/// The error code a failed request's message maps to: `stage_unavailable`
/// when a stage replica was lost (the engine's messages say so first).
pub fn failure_code(message: &str) -> &'static str {
    if message.starts_with("stage_unavailable") {
        "stage_unavailable"
    } else if message.starts_with(shutdown::CODE) {
        shutdown::CODE
    } else if message.contains(CONTEXT_LENGTH_EXCEEDED) {
        CONTEXT_LENGTH_EXCEEDED
    } else {
        "generation_failed"
    }
}

/// The body length a request declares (`Content-Length`), to refuse an
/// oversized body before reading any of it.
pub fn declared_length(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// The error `type` of a failure code: the client's fault, or the server's.
pub fn failure_kind(code: &str) -> &'static str {
    match code {
        CONTEXT_LENGTH_EXCEEDED => "invalid_request_error",
        _ => "server_error",
    }
}

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
                param: Some("messages"),
                ..Self::bad_request(CONTEXT_LENGTH_EXCEEDED, message)
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
