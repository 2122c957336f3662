//! `POST /v1/webrtc`: a WebRTC peer talks to the pipeline like a call.
//!
//! The body is an SDP offer (`application/sdp`, WHIP-style, or JSON
//! `{"sdp", "type": "offer"}`); the answer comes back the same way, with ICE
//! candidates gathered (no trickle). One bidirectional audio track: Opus 48 kHz
//! when the offer has it (browsers), else PCMU or PCMA 8 kHz (telephony
//! bridges). The peer's `oai-events` data channel carries the same JSON events
//! as `/v1/realtime`; the answers' audio goes out on the track, paced in 20 ms
//! frames with silence between answers, and `output_audio_buffer.started` /
//! `.stopped` say when it plays. The microphone is decoded, resampled to
//! 24 kHz and kept in the session's input buffer. Closing the peer (or the
//! data channel, ICE failure, `DELETE /v1/webrtc/{session}`) ends the session
//! and cancels its work in every stage.

pub mod calls;
mod sdp;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::Message;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, post};
use axum::{Extension, Json, Router};
use futures_util::StreamExt;
use serde_json::json;
use tokio::sync::{mpsc, watch};
use webrtc::api::interceptor_registry::register_default_interceptors;
use webrtc::api::media_engine::{MediaEngine, MIME_TYPE_OPUS, MIME_TYPE_PCMA, MIME_TYPE_PCMU};
use webrtc::api::setting_engine::SettingEngine;
use webrtc::api::{APIBuilder, API};
use webrtc::data_channel::data_channel_message::DataChannelMessage;
use webrtc::data_channel::RTCDataChannel;
use webrtc::ice::udp_network::{EphemeralUDP, UDPNetwork};
use webrtc::ice_transport::ice_candidate_type::RTCIceCandidateType;
use webrtc::ice_transport::ice_server::RTCIceServer;
use webrtc::interceptor::registry::Registry;
use webrtc::media::Sample;
use webrtc::peer_connection::configuration::RTCConfiguration;
use webrtc::peer_connection::peer_connection_state::RTCPeerConnectionState;
use webrtc::peer_connection::sdp::session_description::RTCSessionDescription;
use webrtc::peer_connection::RTCPeerConnection;
use webrtc::rtp_transceiver::rtp_codec::{
    RTCRtpCodecCapability, RTCRtpCodecParameters, RTPCodecType,
};
use webrtc::track::track_local::track_local_static_sample::TrackLocalStaticSample;
use webrtc::track::track_local::TrackLocal;
use webrtc::track::track_remote::TrackRemote;

use crate::profile::WebRtcSpec;
use crate::serve::auth::bearer;
use crate::serve::voice_store::owner_of;

use super::media::{self, AudioOut, Codec, Mic, Speaker, FRAME};
use super::realtime::{slow_client_event, Realtime};
use super::sideband::{Link, Links};
use crate::serve::conn::{ConnGauge, Outbox};
use crate::serve::connections::read_body;
use crate::serve::driver::{self, Inbound};
use crate::serve::error::ApiError;
use crate::serve::metrics::TaskGuard;
use crate::serve::state::AppState;

/// Largest SDP offer accepted.
const MAX_OFFER_BYTES: usize = 64 * 1024;
/// How long ICE gathering may take before the answer goes out anyway.
const GATHER_TIMEOUT: Duration = Duration::from_secs(5);
/// A peer that never connects is given up after this long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// The data channel the Realtime events travel on.
const EVENTS_CHANNEL: &str = "oai-events";

/// The WebRTC side of the server: one API object (codecs, interceptors,
/// network settings) shared by every peer, and the live peers by session.
pub struct WebRtc {
    api: API,
    /// Audio an answer must have queued before its first frame goes out.
    playout_lead: Duration,
    ice_servers: Vec<RTCIceServer>,
    peers: dashmap::DashMap<String, Arc<RTCPeerConnection>>,
    /// OpenAI's call flow: its ephemeral keys.
    calls: calls::Calls,
    /// The live calls a sideband can join.
    links: Links,
}

impl WebRtc {
    pub fn new(spec: &WebRtcSpec, links: Links) -> anyhow::Result<Self> {
        let mut media = MediaEngine::default();
        // Opus as browsers offer it; PCMU/PCMA with their static payload types.
        let codecs = [
            (MIME_TYPE_OPUS, 48_000, 2, "minptime=10;useinbandfec=1", 111),
            (MIME_TYPE_PCMU, 8_000, 0, "", 0),
            (MIME_TYPE_PCMA, 8_000, 0, "", 8),
        ];
        for (mime, clock_rate, channels, fmtp, pt) in codecs {
            media.register_codec(
                RTCRtpCodecParameters {
                    capability: RTCRtpCodecCapability {
                        mime_type: mime.to_owned(),
                        clock_rate,
                        channels,
                        sdp_fmtp_line: fmtp.to_owned(),
                        rtcp_feedback: vec![],
                    },
                    payload_type: pt,
                    ..Default::default()
                },
                RTPCodecType::Audio,
            )?;
        }
        let registry = register_default_interceptors(Registry::new(), &mut media)?;
        let mut setting = SettingEngine::default();
        if !spec.public_ips.is_empty() {
            setting.set_nat_1to1_ips(
                spec.public_ips.iter().map(|ip| ip.to_string()).collect(),
                RTCIceCandidateType::Host,
            );
        }
        if let Some([lo, hi]) = spec.udp_ports {
            setting.set_udp_network(UDPNetwork::Ephemeral(EphemeralUDP::new(lo, hi)?));
        }
        let api = APIBuilder::new()
            .with_media_engine(media)
            .with_interceptor_registry(registry)
            .with_setting_engine(setting)
            .build();
        let ice_servers = spec
            .ice_servers
            .iter()
            .map(|s| RTCIceServer {
                urls: s.urls.clone(),
                username: s.username.clone().unwrap_or_default(),
                credential: s.credential.clone().unwrap_or_default(),
            })
            .collect();
        let playout_lead = std::env::var("OMNISTREAM_PLAYOUT_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis)
            .unwrap_or(Duration::from_millis(spec.playout_lead_ms));
        Ok(Self {
            api,
            playout_lead,
            ice_servers,
            peers: dashmap::DashMap::new(),
            calls: calls::Calls::default(),
            links,
        })
    }

    pub fn peers(&self) -> usize {
        self.peers.len()
    }
}

/// `None`: WebRTC could not be set up (offers get a 500 saying so).
pub fn routes(rtc: Option<Arc<WebRtc>>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/webrtc", post(offer))
        .route("/v1/webrtc/{session}", delete(hang_up))
        .route("/v1/realtime/client_secrets", post(calls::client_secrets))
        .route("/v1/realtime/calls/{call_id}/hangup", post(calls::hangup))
        .layer(Extension(rtc))
}

/// `POST /v1/realtime/calls`, which checks its own key: an ephemeral key
/// opens a call and nothing else.
pub fn call_routes(rtc: Option<Arc<WebRtc>>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/realtime/calls", post(calls::calls))
        .layer(Extension(rtc))
}

fn bad_offer(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_offer", msg)
}

/// How the offer came, so the answer goes back the same way.
enum Shape {
    Sdp,
    Json,
}

fn read_offer(headers: &HeaderMap, body: &[u8]) -> Result<(String, Shape), ApiError> {
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    if ctype.starts_with("application/json") {
        let v: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| bad_offer(format!("the body is not JSON: {e}")))?;
        if v["type"] != "offer" {
            return Err(bad_offer("expected {\"type\": \"offer\", \"sdp\": ...}"));
        }
        let sdp = v["sdp"]
            .as_str()
            .ok_or_else(|| bad_offer("`sdp` (a string) is required"))?;
        return Ok((sdp.to_string(), Shape::Json));
    }
    if !(ctype.starts_with("application/sdp") || ctype.is_empty()) {
        return Err(ApiError::unsupported_media_type(format!(
            "send the offer as application/sdp or application/json, not {ctype:?}"
        )));
    }
    let sdp = std::str::from_utf8(body).map_err(|_| bad_offer("the SDP offer is not UTF-8"))?;
    Ok((sdp.to_string(), Shape::Sdp))
}

async fn offer(
    State(state): State<Arc<AppState>>,
    Extension(rtc): Extension<Option<Arc<WebRtc>>>,
    req: Request,
) -> Response {
    let headers = req.headers().clone();
    let body = match read_body(req, MAX_OFFER_BYTES).await {
        Ok(b) => b,
        Err(e) => return e.into_response(),
    };
    match answer(state, rtc, &headers, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn answer(
    state: Arc<AppState>,
    rtc: Option<Arc<WebRtc>>,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let (offer_sdp, shape) = read_offer(headers, body)?;
    let codec = sdp::audio_codec(&offer_sdp).map_err(bad_offer)?;
    let Some(rtc) = rtc else {
        return Err(ApiError::internal("WebRTC is not available on this server"));
    };
    let owner = owner_of(bearer(headers));
    let start = CallStart {
        initial: Vec::new(),
        owner,
    };
    let (id, sdp) = open_call(&state, &rtc, &offer_sdp, codec, start).await?;
    let location = format!("/v1/webrtc/{id}");
    Ok(match shape {
        Shape::Sdp => (
            StatusCode::CREATED,
            [
                (header::CONTENT_TYPE, "application/sdp".to_string()),
                (header::LOCATION, location),
            ],
            sdp,
        )
            .into_response(),
        Shape::Json => (
            StatusCode::CREATED,
            [(header::LOCATION, location)],
            Json(json!({"type": "answer", "sdp": sdp, "session_id": id, "codec": codec.name()})),
        )
            .into_response(),
    })
}

/// What a call starts with.
pub(super) struct CallStart {
    /// Session configurations applied first, as `session.update`s.
    pub initial: Vec<serde_json::Value>,
    /// Whose cloned voices it may speak in (the key that opened it).
    pub owner: String,
}

/// A call from an offer: its session id and the SDP answer.
async fn open_call(
    state: &Arc<AppState>,
    rtc: &Arc<WebRtc>,
    offer_sdp: &str,
    codec: Codec,
    start: CallStart,
) -> Result<(String, String), ApiError> {
    // The session first: at the cap, refuse before any network work.
    let session = state.sessions.open("webrtc")?;
    let pc = Arc::new(
        rtc.api
            .new_peer_connection(RTCConfiguration {
                ice_servers: rtc.ice_servers.clone(),
                ..Default::default()
            })
            .await
            .map_err(|e| ApiError::internal(format!("creating the peer connection: {e}")))?,
    );
    match connect(state, &pc, codec, offer_sdp).await {
        Ok(local) => {
            let id = session.id.clone();
            rtc.peers.insert(id.clone(), pc.clone());
            tokio::spawn(run_peer(
                state.clone(),
                rtc.clone(),
                pc,
                codec,
                session,
                local.tracks,
                start,
            ));
            Ok((id, local.sdp))
        }
        Err(e) => {
            let _ = pc.close().await;
            Err(e)
        }
    }
}

/// What a peer's signalling left for its session task.
struct Tracks {
    speaker: Arc<TrackLocalStaticSample>,
    remote: mpsc::Receiver<Arc<TrackRemote>>,
    /// The events channel, with its messages since it was announced.
    channel: mpsc::Receiver<(Arc<RTCDataChannel>, mpsc::Receiver<Inbound>)>,
    state: watch::Receiver<RTCPeerConnectionState>,
}

/// A data channel message as the session reads it.
fn to_inbound(msg: DataChannelMessage) -> Inbound {
    if msg.is_string {
        match String::from_utf8(msg.data.to_vec()) {
            Ok(t) => Inbound::Text(t),
            Err(_) => Inbound::Binary(msg.data.to_vec()),
        }
    } else {
        Inbound::Binary(msg.data.to_vec())
    }
}

struct Local {
    sdp: String,
    tracks: Tracks,
}

/// Offer in, answer out (ICE gathered); the handlers hand what arrives later
/// to the session task through channels.
async fn connect(
    state: &Arc<AppState>,
    pc: &Arc<RTCPeerConnection>,
    codec: Codec,
    offer: &str,
) -> Result<Local, ApiError> {
    let internal = |what: &str, e: webrtc::Error| ApiError::internal(format!("{what}: {e}"));
    let mime = match codec {
        Codec::Opus => MIME_TYPE_OPUS,
        Codec::Pcmu => MIME_TYPE_PCMU,
        Codec::Pcma => MIME_TYPE_PCMA,
    };
    let speaker = Arc::new(TrackLocalStaticSample::new(
        RTCRtpCodecCapability {
            mime_type: mime.to_owned(),
            clock_rate: codec.clock_rate(),
            channels: if codec == Codec::Opus { 2 } else { 0 },
            ..Default::default()
        },
        "answer".to_owned(),
        "omnistream".to_owned(),
    ));
    let sender = pc
        .add_track(Arc::clone(&speaker) as Arc<dyn TrackLocal + Send + Sync>)
        .await
        .map_err(|e| internal("adding the audio track", e))?;
    // RTCP from the peer must be read for the interceptors to work.
    let rtcp_task = TaskGuard::new(&state.metrics);
    tokio::spawn(async move {
        let _task = rtcp_task;
        let mut buf = vec![0u8; 1500];
        while sender.read(&mut buf).await.is_ok() {}
    });

    let (track_tx, remote) = mpsc::channel(1);
    pc.on_track(Box::new(move |track, _, _| {
        let tx = track_tx.clone();
        Box::pin(async move {
            let _ = tx.send(track).await;
        })
    }));
    let (dc_tx, channel) = mpsc::channel(1);
    pc.on_data_channel(Box::new(move |dc: Arc<RTCDataChannel>| {
        let tx = dc_tx.clone();
        Box::pin(async move {
            if dc.label() == EVENTS_CHANNEL {
                // The handler goes on now, before webrtc-rs starts reading
                // the channel: it drops what arrives with no handler set, and
                // a page sends its first events the moment the channel opens.
                // A full queue holds the channel's reader back (backpressure).
                let (msg_tx, msgs) = mpsc::channel::<Inbound>(64);
                dc.on_message(Box::new(move |msg: DataChannelMessage| {
                    let msg_tx = msg_tx.clone();
                    Box::pin(async move {
                        let _ = msg_tx.send(to_inbound(msg)).await;
                    })
                }));
                let _ = tx.send((dc, msgs)).await;
            }
        })
    }));
    let (state_tx, state_rx) = watch::channel(RTCPeerConnectionState::New);
    pc.on_peer_connection_state_change(Box::new(move |s| {
        let _ = state_tx.send(s);
        Box::pin(async {})
    }));

    let offer = RTCSessionDescription::offer(offer.to_string())
        .map_err(|e| bad_offer(format!("unparseable SDP: {e}")))?;
    pc.set_remote_description(offer)
        .await
        .map_err(|e| bad_offer(format!("the offer cannot be used: {e}")))?;
    let answer = pc
        .create_answer(None)
        .await
        .map_err(|e| bad_offer(format!("no answer to this offer: {e}")))?;
    let mut gathered = pc.gathering_complete_promise().await;
    pc.set_local_description(answer)
        .await
        .map_err(|e| internal("setting the answer", e))?;
    let _ = tokio::time::timeout(GATHER_TIMEOUT, gathered.recv()).await;
    let sdp = pc
        .local_description()
        .await
        .map(|d| d.sdp)
        .ok_or_else(|| ApiError::internal("no local description after the answer"))?;
    Ok(Local {
        sdp,
        tracks: Tracks {
            speaker,
            remote,
            channel,
            state: state_rx,
        },
    })
}

/// One peer's life: the Realtime session over the data channel, the paced
/// speaker, the microphone; all end together.
async fn run_peer(
    state: Arc<AppState>,
    rtc: Arc<WebRtc>,
    pc: Arc<RTCPeerConnection>,
    codec: Codec,
    session: crate::serve::sessions::SessionGuard,
    tracks: Tracks,
    start: CallStart,
) {
    let CallStart { initial, owner } = start;
    let _task = TaskGuard::new(&state.metrics);
    let _conn = ConnGauge::new(&state.metrics, "webrtc");
    let id = session.id.clone();
    let (hangup_tx, hangup) = watch::channel(false);

    // Events: data channel messages in, Outbox messages out through a bridge.
    let (in_tx, in_rx) = mpsc::channel::<Inbound>(64);
    // The call starts with the configuration it was opened with.
    for s in initial {
        let update = json!({"type": "session.update", "session": s});
        let _ = in_tx.try_send(Inbound::Text(update.to_string()));
    }
    // A sideband (`GET /v1/realtime?call_id=`) joins through this link.
    let (link, watchers) = Link::new(in_tx.clone());
    rtc.links.insert(id.clone(), link);
    // A bounded channel whose sending half is the Outbox writer's sink.
    let (out_tx, out_rx) = futures_channel::mpsc::channel::<Message>(64);
    let out = Outbox::start_on(out_tx, &state.metrics, slow_client_event(), false);
    let (speaker_out, cues, queued) = AudioOut::new();
    let (mic_tx, mic_rx) = mpsc::channel::<Vec<u8>>(256);

    // Watches the peer: ICE failure, close, or never connecting end it.
    {
        let hangup_tx = hangup_tx.clone();
        let mut st = tracks.state.clone();
        let task = TaskGuard::new(&state.metrics);
        tokio::spawn(async move {
            let _task = task;
            let connected = tokio::time::timeout(CONNECT_TIMEOUT, async {
                st.wait_for(|s| *s == RTCPeerConnectionState::Connected)
                    .await
                    .is_ok()
            })
            .await
            .unwrap_or(false);
            if connected {
                let _ = st
                    .wait_for(|s| {
                        matches!(
                            s,
                            RTCPeerConnectionState::Failed
                                | RTCPeerConnectionState::Closed
                                | RTCPeerConnectionState::Disconnected
                        )
                    })
                    .await;
            }
            let _ = hangup_tx.send(true);
        });
    }
    // The events channel: when it opens, messages flow both ways.
    let bridge = tokio::spawn(events_bridge(
        state.clone(),
        tracks.channel,
        in_tx.clone(),
        out_rx,
        hangup_tx.clone(),
        watchers,
    ));
    tokio::spawn(pace(
        state.clone(),
        rtc.playout_lead,
        tracks.speaker.clone(),
        codec,
        cues,
        queued,
        out.clone(),
        hangup.clone(),
    ));
    tokio::spawn(listen(
        state.clone(),
        codec,
        tracks.remote,
        mic_tx,
        hangup.clone(),
    ));
    // A hang-up ends the event stream, which ends the session.
    {
        let mut hangup = hangup.clone();
        let task = TaskGuard::new(&state.metrics);
        tokio::spawn(async move {
            let _task = task;
            let _ = hangup.wait_for(|h| *h).await;
            let _ = in_tx.send(Inbound::Closed).await;
        });
    }
    let stream = tokio_stream::wrappers::ReceiverStream::new(in_rx);
    let codec = Realtime::new(state.clone(), id.clone(), Some(Box::new(speaker_out)))
        .with_owner(owner)
        .counted_as("webrtc");
    driver::run(
        state.clone(),
        codec,
        out.clone(),
        stream,
        session,
        Some(mic_rx),
    )
    .await;
    out.close(None, axum::extract::ws::close_code::NORMAL);
    // The session's last events (a shutdown's `error`) cross the channel
    // before the hang-up: the bridge ends at the writer's close.
    let _ = tokio::time::timeout(Duration::from_secs(1), bridge).await;
    if state.shutdown.draining() {
        // ...and SCTP gets a moment to deliver it before the peer closes.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = hangup_tx.send(true);
    let _ = pc.close().await;
    // Listed until closed: a server shutting down waits for its peers to be
    // hung up (the session itself ended with the driver).
    rtc.links.remove(&id);
    rtc.peers.remove(&id);
}

/// Joins the `oai-events` data channel to the session: its messages become
/// the session's input, the Outbox's output is sent on it. Its closing hangs up.
async fn events_bridge(
    state: Arc<AppState>,
    mut channel: mpsc::Receiver<(Arc<RTCDataChannel>, mpsc::Receiver<Inbound>)>,
    input: mpsc::Sender<Inbound>,
    mut output: futures_channel::mpsc::Receiver<Message>,
    hangup: watch::Sender<bool>,
    watchers: tokio::sync::broadcast::Sender<Message>,
) {
    let _task = TaskGuard::new(&state.metrics);
    let mut gone = hangup.subscribe();
    let dc = tokio::select! {
        dc = channel.recv() => dc,
        _ = gone.wait_for(|h| *h) => None,
    };
    let Some((dc, mut msgs)) = dc else {
        return;
    };
    let (open_tx, mut open_rx) = watch::channel(false);
    dc.on_open(Box::new(move || {
        let _ = open_tx.send(true);
        Box::pin(async {})
    }));
    {
        let hangup = hangup.clone();
        dc.on_close(Box::new(move || {
            let _ = hangup.send(true);
            Box::pin(async {})
        }));
    }
    // The channel may already be open when we get it.
    if dc.ready_state() != webrtc::data_channel::data_channel_state::RTCDataChannelState::Open {
        tokio::select! {
            _ = open_rx.wait_for(|o| *o) => {}
            _ = gone.wait_for(|h| *h) => return,
        }
    }
    loop {
        // (No await inside the arms: `gone`'s guard must not cross one.)
        let (msg, incoming) = tokio::select! {
            m = output.next() => (m, None),
            Some(m) = msgs.recv() => (None, Some(m)),
            _ = gone.wait_for(|h| *h) => (None, None),
        };
        if let Some(m) = incoming {
            if input.send(m).await.is_err() {
                break;
            }
            continue;
        }
        match msg {
            Some(Message::Text(t)) => {
                // A sideband sees every event too (none listening is fine).
                let _ = watchers.send(Message::Text(t.clone()));
                if dc.send_text(t.to_string()).await.is_err() {
                    break;
                }
            }
            Some(Message::Close(_)) | None => break,
            Some(_) => {} // pings and binary frames have no place here
        }
    }
    let _ = hangup.send(true);
    let _ = dc.close().await;
}

/// The speaker: one 20 ms frame per tick, answers' audio or silence, with
/// `output_audio_buffer.started/stopped` events as answers start and end.
#[allow(clippy::too_many_arguments)]
async fn pace(
    state: Arc<AppState>,
    lead: Duration,
    track: Arc<TrackLocalStaticSample>,
    codec: Codec,
    mut cues: mpsc::UnboundedReceiver<media::Cue>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
    out: Outbox,
    mut hangup: watch::Receiver<bool>,
) {
    let _task = TaskGuard::new(&state.metrics);
    let mut speaker = match Speaker::new(codec, queued, lead) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("webrtc speaker: {e}");
            return;
        }
    };
    let mut tick = tokio::time::interval(FRAME);
    // Behind schedule (a busy CPU), catch up so the stream keeps real time;
    // the RTP timestamps stay contiguous either way.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = hangup.wait_for(|h| *h) => return,
        }
        let underruns = speaker.underruns;
        let Some(media::Tick { payload, event, .. }) = speaker.tick(&mut cues) else {
            continue;
        };
        let sample = Sample {
            data: payload.into(),
            duration: FRAME,
            ..Default::default()
        };
        if track.write_sample(&sample).await.is_err() {
            return;
        }
        state
            .metrics
            .bytes_out
            .with_label_values(&["webrtc"])
            .inc_by(sample.data.len() as u64);
        if speaker.underruns > underruns {
            state.metrics.webrtc_underrun_frames.inc();
        }
        if let Some((kind, body)) = event {
            let _ = out.send(super::realtime::event(kind, body)).await;
        }
    }
}

/// The microphone: the peer's track decoded to 24 kHz pcm16 for the session.
async fn listen(
    state: Arc<AppState>,
    negotiated: Codec,
    mut remote: mpsc::Receiver<Arc<TrackRemote>>,
    mic: mpsc::Sender<Vec<u8>>,
    mut hangup: watch::Receiver<bool>,
) {
    let _task = TaskGuard::new(&state.metrics);
    let track = tokio::select! {
        t = remote.recv() => t,
        _ = hangup.wait_for(|h| *h) => None,
    };
    let Some(track) = track else {
        return;
    };
    // The track's own codec can still be blank when it arrives (seen with
    // PCMU): the one we negotiated is what the peer sends.
    let mime = track.codec().capability.mime_type;
    let codec = sdp::codec_of_mime(&mime).unwrap_or(negotiated);
    tracing::debug!("webrtc: listening to {} ({mime:?})", codec.name());
    let Ok(mut decoder) = Mic::new(codec) else {
        return;
    };
    loop {
        let packet = tokio::select! {
            p = track.read_rtp() => p,
            _ = hangup.wait_for(|h| *h) => return,
        };
        let Ok((packet, _)) = packet else {
            return;
        };
        // A bad packet is dropped; the stream goes on.
        let decoded = decoder.decode(&packet.payload);
        if let Err(e) = &decoded {
            tracing::debug!("webrtc: dropped a packet: {e}");
        }
        if let Ok(pcm) = decoded {
            if !pcm.is_empty() && mic.try_send(pcm).is_err() && mic.is_closed() {
                return;
            }
        }
    }
}

/// `DELETE /v1/webrtc/{session}`: hang up (WHIP's way to end a session).
async fn hang_up(
    Extension(rtc): Extension<Option<Arc<WebRtc>>>,
    Path(session): Path<String>,
) -> Response {
    close_peer(rtc, &session, "WebRTC session").await
}

/// Closes peer `id` (its session ends with it): 200, or 404 naming `what`.
async fn close_peer(rtc: Option<Arc<WebRtc>>, id: &str, what: &str) -> Response {
    let pc = rtc
        .as_ref()
        .and_then(|r| r.peers.get(id).map(|p| p.clone()));
    match pc {
        Some(pc) => {
            let _ = pc.close().await;
            StatusCode::OK.into_response()
        }
        None => ApiError::not_found(format!("no {what} {id:?}")).into_response(),
    }
}
