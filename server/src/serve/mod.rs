//! `omnistream serve`: one port, axum on tokio. OpenAI-compatible HTTP, the
//! Realtime WebSocket, a plain PCM WebSocket, the demo page, metrics.

mod answer;
mod audio;
mod auth;
mod clip_encoder;
mod conn;
mod connections;
mod conversation;
mod driver;
mod error;
mod listen;
mod metrics;
mod sessions;
mod shutdown;
mod state;
mod tools;
mod transport;
mod voice_store;
mod voices;
mod web;

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

pub use error::ApiError;
pub use sessions::SessionLimits;
pub use state::{AppState, ServerConfig};

use crate::run::{chat_spec, load_profile_placed, run_request};
use omnistream_stages::engine::{
    Modalities, RequestInput, RequestSpec, SamplingOverrides, StageRole, VoiceClip, TRANSCRIBE_RATE,
};
use omnistream_stages::models::silero_vad::SileroVad;

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
    /// `--sip`: answer SIP calls here (over the profile's `server.sip.listen`).
    pub sip: Option<String>,
    /// `--voice-store`: where cloned voices are kept.
    pub voice_store: Option<PathBuf>,
}

/// Loads the pipeline, warms it up, and serves until ctrl-c.
pub async fn run(opts: ServeOptions) -> Result<()> {
    let (profile, server) = crate::profile::load(&opts.profile)?;
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
            // A chat where there is a Thinker; a Talker alone speaks given text.
            let mut warm = match p.has_role(StageRole::Thinker) {
                true => chat_spec("Hi", Modalities::TEXT_AUDIO, SamplingOverrides::default()),
                false => crate::run::speech_spec("Hi.", None, None),
            };
            warm.sampling.max_tokens = Some(4);
            // A Talker with no preset voice (Qwen3-TTS Base) speaks only cloned
            // ones: a voice cloned from a synthetic clip, which warms the
            // clip encoders too.
            if p.voices().is_empty() {
                if let Some(enc) = p.voice_encoder() {
                    let clip = warm_up_clip(enc.sample_rate(), enc.min_samples());
                    let (mut done, _) = enc
                        .encode(&[VoiceClip {
                            pcm: &clip,
                            in_context: enc.in_context(),
                        }])
                        .context("warm-up: the speaker encoder")?;
                    warm.style.speaker_embedding = done.pop().map(|d| d.embedding);
                }
            }
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
                    tools: None,
                    style: Default::default(),
                };
                run_request(&p, hear, |_| {}).context("warm-up transcription")?;
            }
            Ok(p)
        })
        .await
        .context("loading the pipeline")??
    };
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
        devices: stage_devices(&profile),
        voice_aliases: server.voice_aliases.clone(),
        voice_store: Some(
            opts.voice_store
                .clone()
                .or_else(|| server.voice_store.as_ref().map(|p| profile.resolve(p)))
                .unwrap_or_else(|| PathBuf::from("data/voices")),
        ),
    };
    let limits =
        connections::Limits::new(&server.connections, connections::raise_open_file_limit());
    let links = transport::sideband::Links::default();
    let rtc = transport::webrtc::WebRtc::new(&server.webrtc, links.clone())
        .context("setting up WebRTC")?;
    let state = AppState::new(pipeline, config)?;
    let rtc = Arc::new(rtc);
    let app = router(state.clone(), Some(rtc.clone()), links.clone());
    let sip = match opts.sip.as_ref().or(server.sip.listen.as_ref()) {
        Some(listen) => {
            let at: SocketAddr = listen
                .parse()
                .with_context(|| format!("bad SIP address {listen:?} (expected ip:port)"))?;
            let sip = transport::sip::SipServer::start(
                state.clone(),
                server.sip.clone(),
                at,
                links.clone(),
            )
            .await
            .context("starting SIP")?;
            // Tests and scripts wait for this line too.
            println!("omnistream sip ready on udp+tcp {}", sip.local);
            Some(sip)
        }
        None => None,
    };
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
        shut_down_on_signal(state.clone(), rtc, sip.clone(), drain),
        CLOSE_LINGER,
    )
    .await;
    reaper.abort();
    if let Some(sip) = sip {
        sip.stop();
    }
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
async fn shut_down_on_signal(
    state: Arc<AppState>,
    rtc: Arc<transport::webrtc::WebRtc>,
    sip: Option<Arc<transport::sip::SipServer>>,
    drain: Duration,
) {
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
    // Sessions said goodbye, and WebRTC peers and SIP calls are hung up (a
    // session ends before its call; exiting first would leave the caller to
    // find out by ICE or RTP timeout).
    let _ = tokio::time::timeout(CLOSE_LINGER, async {
        state.idle().await;
        while rtc.peers() > 0 || sip.as_ref().is_some_and(|s| s.calls() > 0) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
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
pub fn router(
    state: Arc<AppState>,
    rtc: Option<Arc<transport::webrtc::WebRtc>>,
    links: transport::sideband::Links,
) -> Router {
    let peers = rtc.clone();
    let api = Router::new()
        .route("/v1/models", get(models))
        .route(
            "/metrics",
            get(move |State(state): State<Arc<AppState>>| async move {
                let peers = peers.as_ref().map(|r| r.peers());
                (
                    [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
                    state.metrics.render(&state.pipeline.stats(), peers),
                )
            }),
        )
        .merge(transport::http::routes())
        .merge(transport::realtime_routes(links))
        .merge(transport::stream::routes())
        .merge(transport::speech_stream::routes())
        .merge(transport::webrtc::routes(rtc.clone()))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            auth::require_key,
        ));
    Router::new()
        .route("/health", get(health))
        .merge(web::routes())
        // Twilio cannot send a key header: the stream checks its `start`.
        .merge(transport::twilio::routes())
        // An ephemeral key opens a call and nothing else: checked there.
        .merge(transport::webrtc::call_routes(rtc.clone()))
        .merge(api)
        // Every answer in the JSON error shape, a wrong path or method too.
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::no_route(
                StatusCode::NOT_FOUND,
                format!("no endpoint at {}", uri.path()),
            )
        })
        .method_not_allowed_fallback(
            |method: axum::http::Method, uri: axum::http::Uri| async move {
                ApiError::no_route(
                    StatusCode::METHOD_NOT_ALLOWED,
                    format!("{} does not take {method}", uri.path()),
                )
            },
        )
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

/// Every stage replica's device, named (`cuda:0 (NVIDIA H200)`), so that a
/// report taken through the server says what it ran on.
fn stage_devices(profile: &omnistream_stages::profile::Profile) -> Vec<state::StageDevice> {
    use omnistream_stages::profile::Placement;
    let mut names = std::collections::HashMap::new();
    let mut out = Vec::new();
    for s in &profile.stages {
        for replica in 0..s.replicas.max(1) {
            let device = if s.placement == Placement::Remote {
                "remote".to_string()
            } else {
                let spec = s.device_of(replica).to_string();
                names
                    .entry(spec.clone())
                    .or_insert_with(|| omnistream_stages::roles::describe_device(&spec))
                    .clone()
            };
            out.push(state::StageDevice {
                stage: s.name.clone(),
                replica,
                device,
            });
        }
    }
    out
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
        "devices": state.config.devices,
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

/// A second (at least `min` samples) of a voiced tone at `rate`: a clip to
/// clone a warm-up voice from.
fn warm_up_clip(rate: u32, min: usize) -> Vec<f32> {
    let n = (rate as usize).max(min);
    (0..n)
        .map(|i| {
            let t = i as f32 / rate.max(1) as f32;
            (0..8)
                .map(|k| {
                    (2.0 * std::f32::consts::PI * 150.0 * (k + 1) as f32 * t).sin() / (k + 1) as f32
                })
                .sum::<f32>()
                * 0.3
        })
        .collect()
}
