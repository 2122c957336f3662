//! SIP calls answered by the server itself (`server.sip`, or `omnistream
//! serve --sip ADDR`): a phone system or SIP trunk sends an INVITE, and the
//! call is a Realtime conversation (server VAD, barge-in) over G.711 RTP.
//!
//! - Signalling: rsipstack (RFC 3261 transactions and dialogs, UDP and TCP
//!   on one port): INVITE with an SDP offer, 100 Trying, 200 OK with our
//!   answer, ACK, BYE and CANCEL either way, OPTIONS, INFO (keypad digits as
//!   `application/dtmf-relay`), re-INVITE and UPDATE answered with the same
//!   media.
//! - Who may call: `server.sip.allow` (CIDRs, e.g. a trunk's IPs), or a
//!   digest answer with one of the server's API keys as the password.
//!   A server without API keys and without an allow-list takes any caller,
//!   as its HTTP endpoints do.
//! - Media (`rtp`): PCMU or PCMA (the first the offer lists), 20 ms packets
//!   out at real time with silence between answers, a jitter buffer in,
//!   RFC 4733 keypad events. Packets from another address than the offer's,
//!   or of another payload type, are dropped and counted.
//! - The session: each call is a Realtime session (`server.sip.session` is
//!   its first `session.update`); an app server joins it on the sideband
//!   `GET /v1/realtime?call_id=…`, the id coming in the
//!   `realtime.call.incoming` webhook (`server.sip.webhook`). A key pressed
//!   is `input_audio_buffer.dtmf_event_received` there, and the caller's turn.
//! - Hang-up either way frees everything: a BYE from the caller ends the
//!   session; the session ending (idle, expired, shutdown) sends our BYE.

mod digest;
mod rtp;
mod sdp;

use std::net::{IpAddr, SocketAddr, UdpSocket as StdUdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use axum::extract::ws::Message;
use dashmap::DashMap;
use futures_util::StreamExt;
use rsipstack::dialog::dialog::{Dialog, DialogState, DialogStateReceiver, TerminatedReason};
use rsipstack::dialog::dialog_layer::DialogLayer;
use rsipstack::dialog::invite_dialog::InviteDialog;
use rsipstack::sip::{Header, HeadersExt, Method, StatusCode};
use rsipstack::transaction::transaction::Transaction;
use rsipstack::transport::udp::UdpConnection;
use rsipstack::transport::{TcpListenerConnection, TransportLayer};
use rsipstack::EndpointBuilder;
use serde_json::{json, Value};
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::media::{AudioOut, Cue, Mic, Speaker, Tick, FRAME};
use super::realtime::{self, slow_client_event, Realtime};
use super::sideband::{Link, Links};
use super::unix_now;
use crate::profile::{Cidr, SipSpec};
use crate::serve::conn::{ConnGauge, Outbox};
use crate::serve::driver::{self, Inbound};
use crate::serve::metrics::TaskGuard;
use crate::serve::sessions::SessionGuard;
use crate::serve::state::AppState;
use crate::serve::voice_store::owner_of;
use digest::{DigestAuth, Verdict};

/// The `User-Agent` and `Server` we send.
const AGENT: &str = concat!("omnistream/", env!("CARGO_PKG_VERSION"));
/// The largest INVITE body read as SDP.
const MAX_SDP_BYTES: usize = 16 * 1024;
/// How long our BYE may take when we hang up.
const BYE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the webhook may take (it is not waited for by the call).
const WEBHOOK_TIMEOUT: Duration = Duration::from_secs(5);
/// Ports tried in `rtp_ports` before a call is refused for want of one.
const RTP_PORT_TRIES: usize = 64;

/// What a call hears from signalling.
enum Control {
    /// The dialog ended (the caller's BYE or CANCEL, or no ACK).
    Ended(TerminatedReason),
    /// A key from SIP INFO.
    Key(char),
}

/// A live call as signalling sees it.
struct Call {
    control: mpsc::UnboundedSender<Control>,
    /// Our SDP answer, repeated to a re-INVITE or UPDATE.
    answer: String,
}

/// A call just answered, for its task.
struct Answered {
    dialog: InviteDialog,
    dialog_id: String,
    /// The INVITE's From, To and Call-ID, for the webhook.
    sip_headers: Vec<Value>,
    /// Where its signalling came from.
    caller: Option<SocketAddr>,
    socket: UdpSocket,
    offer: sdp::Offer,
    session: SessionGuard,
    control: mpsc::UnboundedReceiver<Control>,
    /// Whose cloned voices the call may speak in: the key that answered the
    /// digest challenge (an allow-listed caller's: the keyless voices).
    owner: String,
}

/// The SIP side of the server.
pub struct SipServer {
    state: Arc<AppState>,
    spec: SipSpec,
    allow: Vec<Cidr>,
    digest: DigestAuth,
    links: Links,
    dialogs: Arc<DialogLayer>,
    /// Live calls by dialog id.
    calls: DashMap<String, Call>,
    /// Where signalling listens (UDP and TCP).
    pub local: SocketAddr,
    token: CancellationToken,
    http: reqwest::Client,
}

impl SipServer {
    /// Binds UDP and TCP on `listen` and starts answering.
    pub async fn start(
        state: Arc<AppState>,
        spec: SipSpec,
        listen: SocketAddr,
        links: Links,
    ) -> anyhow::Result<Arc<Self>> {
        let allow = spec
            .allow
            .iter()
            .map(|c| Cidr::parse(c).map_err(anyhow::Error::msg))
            .collect::<anyhow::Result<Vec<_>>>()?;
        // The session every call starts with is checked now: a bad one is
        // the profile's error, not every caller's.
        if let Some(s) = &spec.session {
            realtime::check_session(&state, "", s)
                .map_err(|e| anyhow::anyhow!("server.sip.session: {}", e.message))?;
        }
        let token = CancellationToken::new();
        let transport = TransportLayer::new(token.clone());
        let udp = UdpConnection::create_connection(listen, None, Some(token.child_token()))
            .await
            .with_context(|| format!("binding SIP UDP {listen}"))?;
        let port = udp
            .get_addr()
            .get_socketaddr()
            .context("the SIP UDP socket's address")?
            .port();
        let local = SocketAddr::new(listen.ip(), port);
        // rsipstack binds TCP when it starts serving (and only logs a
        // failure): bind once here so a taken port is this call's error.
        drop(
            std::net::TcpListener::bind(local)
                .with_context(|| format!("binding SIP TCP {local}"))?,
        );
        transport.add_transport(udp.into());
        let tcp = TcpListenerConnection::new(local, None)
            .await
            .with_context(|| format!("SIP TCP {local}"))?;
        transport.add_transport(tcp.into());
        let endpoint = EndpointBuilder::new()
            .with_cancel_token(token.clone())
            .with_transport_layer(transport)
            .with_user_agent(AGENT)
            .build();
        let incoming = endpoint
            .incoming_transactions()
            .context("SIP transactions")?;
        let dialogs = Arc::new(DialogLayer::new(endpoint.inner.clone()));
        let (state_tx, state_rx) = dialogs.new_dialog_state_channel();
        let server = Arc::new(Self {
            digest: DigestAuth::new(&spec.realm),
            state,
            spec,
            allow,
            links,
            dialogs,
            calls: DashMap::new(),
            local,
            token,
            http: reqwest::Client::builder()
                .timeout(WEBHOOK_TIMEOUT)
                .build()
                .context("the webhook client")?,
        });
        tokio::spawn(async move { endpoint.serve().await });
        tokio::spawn(server.clone().dialog_states(state_rx));
        tokio::spawn(server.clone().requests(incoming, state_tx));
        Ok(server)
    }

    /// Calls up now.
    pub fn calls(&self) -> usize {
        self.calls.len()
    }

    /// Stops listening (calls already up end with their sessions).
    pub fn stop(&self) {
        self.token.cancel();
    }

    /// Every request outside a dialog's own transactions.
    async fn requests(
        self: Arc<Self>,
        mut incoming: rsipstack::transaction::TransactionReceiver,
        state_tx: rsipstack::dialog::dialog::DialogStateSender,
    ) {
        while let Some(tx) = incoming.recv().await {
            let me = self.clone();
            let state_tx = state_tx.clone();
            tokio::spawn(async move { me.request(tx, state_tx).await });
        }
    }

    async fn request(
        self: Arc<Self>,
        mut tx: Transaction,
        state_tx: rsipstack::dialog::dialog::DialogStateSender,
    ) {
        // In a dialog: its own handling (BYE, ACK, INFO, re-INVITE, ...).
        if let Some(Dialog::Invite(mut d)) = self.dialogs.match_dialog(&tx) {
            if let Err(e) = d.handle(&mut tx).await {
                tracing::debug!("sip: in-dialog {}: {e}", tx.original.method);
            }
            return;
        }
        let method = tx.original.method;
        let to_tagged = tx
            .original
            .to_header()
            .ok()
            .and_then(|t| t.tag().ok().flatten())
            .is_some();
        let r = match method {
            Method::Invite if !to_tagged => self.invite(&mut tx, state_tx).await,
            Method::Options => {
                let allow = Header::Other("Allow".into(), ALLOW.into());
                let accept = Header::Other("Accept".into(), "application/sdp".into());
                tx.reply_with(StatusCode::OK, vec![allow, accept], None)
                    .await
            }
            // An ACK to a response we no longer know of needs no answer.
            Method::Ack => Ok(()),
            Method::Bye | Method::Cancel | Method::Info | Method::Update | Method::Invite => {
                self.refused("sip_no_such_call");
                tx.reply(StatusCode::CallTransactionDoesNotExist).await
            }
            _ => {
                self.refused("sip_method_not_allowed");
                let allow = Header::Other("Allow".into(), ALLOW.into());
                tx.reply_with(StatusCode::MethodNotAllowed, vec![allow], None)
                    .await
            }
        };
        if let Err(e) = r {
            tracing::debug!("sip: answering a {method}: {e}");
        }
    }

    fn refused(&self, code: &str) {
        self.state
            .metrics
            .phone_errors
            .with_label_values(&[code])
            .inc();
    }

    /// Answers `tx` with `status`, a `Warning` saying why (RFC 3261 §20.43).
    async fn refuse(
        &self,
        tx: &mut Transaction,
        status: StatusCode,
        code: &str,
        why: &str,
    ) -> rsipstack::Result<()> {
        self.refused(code);
        tracing::info!(
            from = %source(tx).map_or("?".into(), |a| a.to_string()),
            "sip: refused an INVITE: {} {why}",
            status.code()
        );
        let text = why.replace('"', "'");
        let warning = Header::Other("Warning".into(), format!("399 omnistream \"{text}\""));
        tx.reply_with(status, vec![warning], None).await
    }

    /// Whether the caller may call, and the owner of the voices its call may
    /// speak in (see [`Answered::owner`]): `Err` is the refusal already sent.
    async fn admit(&self, tx: &mut Transaction) -> Result<String, ()> {
        let ip = source(tx).map(|a| a.ip());
        if ip.is_some_and(|ip| self.allow.iter().any(|c| c.contains(ip))) {
            return Ok(String::new());
        }
        let keys = &self.state.config.api_keys;
        if keys.is_empty() {
            if self.allow.is_empty() {
                return Ok(String::new());
            }
            let _ = self
                .refuse(
                    tx,
                    StatusCode::Forbidden,
                    "sip_forbidden",
                    "not on the allow-list",
                )
                .await;
            return Err(());
        }
        let now = unix_now();
        let verdict = tx
            .original
            .header_value("Authorization")
            .map(|h| self.digest.verify(&h, "INVITE", keys, now));
        let challenge = |stale: bool| {
            Header::Other("WWW-Authenticate".into(), self.digest.challenge(now, stale))
        };
        let r = match verdict {
            Some(Verdict::Ok(k)) => return Ok(owner_of(keys.get(k).map(String::as_str))),
            None => {
                self.refused("sip_unauthorized");
                tx.reply_with(StatusCode::Unauthorized, vec![challenge(false)], None)
                    .await
            }
            Some(Verdict::Stale) => {
                tx.reply_with(StatusCode::Unauthorized, vec![challenge(true)], None)
                    .await
            }
            Some(Verdict::Refused(why)) => {
                self.refuse(tx, StatusCode::Forbidden, "sip_forbidden", why)
                    .await
            }
        };
        if let Err(e) = r {
            tracing::debug!("sip: answering an INVITE: {e}");
        }
        Err(())
    }

    /// A new call.
    async fn invite(
        self: &Arc<Self>,
        tx: &mut Transaction,
        state_tx: rsipstack::dialog::dialog::DialogStateSender,
    ) -> rsipstack::Result<()> {
        if self.state.shutdown.draining() {
            return self
                .refuse(
                    tx,
                    StatusCode::ServiceUnavailable,
                    "sip_shutting_down",
                    "shutting down",
                )
                .await;
        }
        let Ok(owner) = self.admit(tx).await else {
            return Ok(());
        };
        let ctype = tx
            .original
            .header_value("Content-Type")
            .unwrap_or_default()
            .to_ascii_lowercase();
        let body = tx.original.body.clone();
        if body.is_empty() {
            return self
                .refuse(
                    tx,
                    StatusCode::NotAcceptableHere,
                    "sip_no_offer",
                    "an INVITE without an SDP offer is not served: send the offer in the INVITE",
                )
                .await;
        }
        if !ctype.starts_with("application/sdp") || body.len() > MAX_SDP_BYTES {
            let accept = Header::Other("Accept".into(), "application/sdp".into());
            self.refused("sip_not_sdp");
            return tx
                .reply_with(StatusCode::UnsupportedMediaType, vec![accept], None)
                .await;
        }
        let offer = match std::str::from_utf8(&body)
            .map_err(|_| sdp::OfferError::Malformed("the SDP is not UTF-8".into()))
            .and_then(sdp::parse_offer)
        {
            Ok(o) => o,
            Err(sdp::OfferError::Malformed(m)) => {
                return self
                    .refuse(tx, StatusCode::BadRequest, "sip_bad_sdp", &m)
                    .await
            }
            Err(sdp::OfferError::NotAcceptable(m)) => {
                return self
                    .refuse(tx, StatusCode::NotAcceptableHere, "sip_no_common_codec", &m)
                    .await
            }
        };
        if self.calls.len() >= self.spec.max_calls {
            return self
                .refuse(
                    tx,
                    StatusCode::BusyHere,
                    "sip_busy",
                    "at the most calls this server takes",
                )
                .await;
        }
        let session = match self.state.sessions.open("sip") {
            Ok(s) => s,
            Err(e) => {
                return self
                    .refuse(tx, StatusCode::ServiceUnavailable, "sip_busy", &e.message)
                    .await
            }
        };
        let caller = source(tx);
        let local_ip = self.media_ip(offer.rtp.ip());
        let socket = match self.rtp_socket(local_ip).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("sip: no RTP port: {e}");
                return self
                    .refuse(
                        tx,
                        StatusCode::ServiceUnavailable,
                        "sip_no_rtp_port",
                        "no RTP port free",
                    )
                    .await;
            }
        };
        let rtp_local = SocketAddr::new(
            self.spec.public_ip.unwrap_or(local_ip),
            socket.local_addr().map(|a| a.port()).unwrap_or(0),
        );
        let answer = sdp::answer(&offer, rtp_local, rand::random::<u32>().into());
        let contact_host =
            SocketAddr::new(self.spec.public_ip.unwrap_or(local_ip), self.local.port());
        let mut contact = format!("sip:omnistream@{contact_host}");
        if tx
            .connection
            .as_ref()
            .is_some_and(|c| !matches!(c.transport(), rsipstack::sip::Transport::Udp))
        {
            contact.push_str(";transport=tcp");
        }
        let contact = rsipstack::sip::Uri::try_from(contact.as_str()).ok();
        let dialog = match self
            .dialogs
            .get_or_create_server_invite(tx, state_tx, None, contact)
        {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("sip: the dialog: {e}");
                return tx.reply(StatusCode::ServerInternalError).await;
            }
        };
        let dialog_id = dialog.id().to_string();
        let (control_tx, control_rx) = mpsc::unbounded_channel();
        self.calls.insert(
            dialog_id.clone(),
            Call {
                control: control_tx,
                answer: answer.clone(),
            },
        );
        let headers = vec![Header::ContentType("application/sdp".into())];
        if let Err(e) = dialog.accept(Some(headers), Some(answer.into_bytes())) {
            self.calls.remove(&dialog_id);
            tracing::warn!("sip: accepting the call: {e}");
            return tx.reply(StatusCode::ServerInternalError).await;
        }
        let call_id = session.id.clone();
        tracing::info!(
            call_id,
            from = ?caller,
            codec = offer.codec.name(),
            rtp = %offer.rtp,
            "sip: call answered"
        );
        let sip_headers: Vec<Value> = ["From", "To", "Call-ID"]
            .iter()
            .filter_map(|h| {
                tx.original
                    .header_value(h)
                    .map(|v| json!({"name": h, "value": v}))
            })
            .collect();
        tokio::spawn(self.clone().run_call(Answered {
            dialog: dialog.clone(),
            dialog_id,
            sip_headers,
            caller,
            socket,
            offer,
            session,
            control: control_rx,
            owner,
        }));
        // The INVITE transaction runs until the ACK (or a CANCEL).
        let mut d = dialog;
        d.handle(tx).await
    }

    /// Our IP on the way to `peer`: the listening address, or where the
    /// routing table sends packets for the peer when listening on all.
    fn media_ip(&self, peer: IpAddr) -> IpAddr {
        if !self.local.ip().is_unspecified() {
            return self.local.ip();
        }
        let probe = || -> std::io::Result<IpAddr> {
            let any: SocketAddr = if peer.is_ipv4() {
                "0.0.0.0:0".parse().expect("literal")
            } else {
                "[::]:0".parse().expect("literal")
            };
            let s = StdUdpSocket::bind(any)?;
            s.connect(SocketAddr::new(peer, 9))?;
            Ok(s.local_addr()?.ip())
        };
        probe().unwrap_or(self.local.ip())
    }

    /// A UDP socket for one call's RTP, in `rtp_ports` if set.
    async fn rtp_socket(&self, ip: IpAddr) -> std::io::Result<UdpSocket> {
        let bind_ip = if self.local.ip().is_unspecified() {
            self.local.ip()
        } else {
            ip
        };
        let Some([lo, hi]) = self.spec.rtp_ports else {
            return UdpSocket::bind(SocketAddr::new(bind_ip, 0)).await;
        };
        // Even ports, by RTP's convention; a random start spreads the calls.
        let span = u32::from(hi - lo) / 2 + 1;
        let start = rand::random::<u32>() % span;
        let mut last = None;
        for i in 0..span.min(RTP_PORT_TRIES as u32) {
            let port = lo + (((start + i) % span) * 2) as u16;
            match UdpSocket::bind(SocketAddr::new(bind_ip, port)).await {
                Ok(s) => return Ok(s),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("rtp_ports is empty")))
    }

    /// `realtime.call.incoming` to `server.sip.webhook`, as OpenAI's SIP
    /// calls announce themselves: the call id a sideband joins with.
    fn webhook(&self, call_id: &str, headers: Vec<Value>) {
        let Some(url) = self.spec.webhook.clone() else {
            return;
        };
        let body = json!({
            "object": "event",
            "id": format!("evt_{}", uuid::Uuid::new_v4().simple()),
            "type": "realtime.call.incoming",
            "created_at": unix_now(),
            "data": {"call_id": call_id, "sip_headers": headers},
        });
        let http = self.http.clone();
        let task = TaskGuard::new(&self.state.metrics);
        tokio::spawn(async move {
            let _task = task;
            match http.post(&url).json(&body).send().await {
                Ok(r) if r.status().is_success() => {}
                Ok(r) => tracing::warn!("sip: the webhook {url} answered {}", r.status()),
                Err(e) => tracing::warn!("sip: the webhook {url}: {e}"),
            }
        });
    }

    /// Dialog events to the calls they belong to.
    async fn dialog_states(self: Arc<Self>, mut states: DialogStateReceiver) {
        while let Some(st) = states.recv().await {
            match st {
                DialogState::Terminated(id, reason) => {
                    let key = id.to_string();
                    if let Some(c) = self.calls.get(&key) {
                        let _ = c.control.send(Control::Ended(reason));
                    }
                    self.dialogs.remove_dialog(&id);
                }
                DialogState::Info(id, req, handle) => {
                    let key = key_of_info(&req);
                    let status = match (key, self.calls.get(&id.to_string())) {
                        (Ok(Some(k)), Some(c)) => {
                            let _ = c.control.send(Control::Key(k));
                            StatusCode::OK
                        }
                        (Ok(_), _) => StatusCode::OK,
                        (Err(()), _) => StatusCode::UnsupportedMediaType,
                    };
                    let _ = handle.reply(status).await;
                }
                DialogState::Options(_, _, handle) => {
                    let _ = handle.reply(StatusCode::OK).await;
                }
                // A re-INVITE or UPDATE (a session timer, hold): the media
                // stay as they are, and our answer says so again.
                DialogState::Updated(id, req, handle) => {
                    let answer = self.calls.get(&id.to_string()).map(|c| c.answer.clone());
                    let _ = match answer {
                        Some(a) if !req.body.is_empty() => {
                            let h = vec![Header::ContentType("application/sdp".into())];
                            handle
                                .respond(StatusCode::OK, Some(h), Some(a.into_bytes()))
                                .await
                        }
                        Some(_) => handle.reply(StatusCode::OK).await,
                        None => handle.reply(StatusCode::CallTransactionDoesNotExist).await,
                    };
                }
                DialogState::Refer(_, _, handle)
                | DialogState::Message(_, _, handle)
                | DialogState::Notify(_, _, handle)
                | DialogState::Publish(_, _, handle) => {
                    let _ = handle.reply(StatusCode::MethodNotAllowed).await;
                }
                _ => {}
            }
        }
    }

    /// One call's life: the session, the paced speaker, the microphone.
    async fn run_call(self: Arc<Self>, call: Answered) {
        let Answered {
            dialog,
            dialog_id,
            sip_headers,
            caller,
            socket,
            offer,
            session,
            mut control,
            owner,
        } = call;
        let state = self.state.clone();
        let _task = TaskGuard::new(&state.metrics);
        let _conn = ConnGauge::new(&state.metrics, "sip");
        let id = session.id.clone();
        let socket = Arc::new(socket);
        let (hangup_tx, hangup) = watch::channel(false);
        let (in_tx, in_rx) = mpsc::channel::<Inbound>(64);
        // A phone has no client to turn server VAD on: it starts on (where
        // the server has VAD), then `server.sip.session` as configured.
        let vad = state
            .config
            .vad
            .is_some()
            .then(|| json!({"turn_detection": {"type": "server_vad"}}));
        for s in vad.iter().chain(self.spec.session.as_ref()) {
            let update = json!({"type": "session.update", "session": s});
            let _ = in_tx.try_send(Inbound::Text(update.to_string()));
        }
        let (link, watchers) = Link::new(in_tx.clone());
        self.links.insert(id.clone(), link);
        // Announced once a sideband can join.
        self.webhook(&id, sip_headers);
        // The session's events go to the sideband (if one joins).
        let (out_tx, mut out_rx) = futures_channel::mpsc::channel::<Message>(64);
        let out = Outbox::start_on(out_tx, &state.metrics, slow_client_event(), false);
        {
            let task = TaskGuard::new(&state.metrics);
            tokio::spawn(async move {
                let _task = task;
                while let Some(m) = out_rx.next().await {
                    match m {
                        Message::Close(_) => break,
                        m @ Message::Text(_) => {
                            let _ = watchers.send(m);
                        }
                        _ => {}
                    }
                }
            });
        }
        let (speaker_out, cues, queued) = AudioOut::new();
        let (mic_tx, mic_rx) = mpsc::channel::<Vec<u8>>(256);
        // Where the caller's RTP comes from: the offer's address; its port
        // is learnt from the first packet (symmetric RTP behind NAT).
        let (peer_tx, peer_rx) = watch::channel(offer.rtp);
        tokio::spawn(speak(
            state.clone(),
            self.spec.playout_lead_ms,
            socket.clone(),
            offer.clone(),
            cues,
            queued,
            out.clone(),
            peer_rx,
            hangup.clone(),
        ));
        let sources = std::iter::once(offer.rtp.ip())
            .chain(caller.map(|c| c.ip()))
            .collect();
        tokio::spawn(listen(
            state.clone(),
            socket.clone(),
            offer.clone(),
            sources,
            mic_tx,
            in_tx.clone(),
            peer_tx,
            hangup.clone(),
        ));
        // Signalling: the caller hung up, or pressed a key (SIP INFO).
        let (ended_tx, mut ended) = watch::channel(None::<String>);
        {
            let in_tx = in_tx.clone();
            let mut hangup = hangup.clone();
            let task = TaskGuard::new(&state.metrics);
            tokio::spawn(async move {
                let _task = task;
                loop {
                    let c = tokio::select! {
                        c = control.recv() => c,
                        _ = hangup.wait_for(|h| *h) => None,
                    };
                    match c {
                        Some(Control::Key(k)) => {
                            let _ = in_tx.send(Inbound::Key(k)).await;
                        }
                        Some(Control::Ended(reason)) => {
                            let _ = ended_tx.send(Some(format!("{reason:?}")));
                            let _ = in_tx.send(Inbound::Closed).await;
                            return;
                        }
                        None => return,
                    }
                }
            });
        }
        let stream = tokio_stream::wrappers::ReceiverStream::new(in_rx);
        let codec = Realtime::new(state.clone(), id.clone(), Some(Box::new(speaker_out)))
            .with_owner(owner)
            .counted_as("sip");
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
        let _ = hangup_tx.send(true);
        let by_caller = ended.borrow_and_update().clone();
        match by_caller {
            Some(reason) => tracing::info!(call_id = id, "sip: the caller hung up ({reason})"),
            None => {
                // The session ended here (idle, expired, shutdown): our BYE.
                tracing::info!(call_id = id, "sip: hanging up");
                match tokio::time::timeout(BYE_TIMEOUT, dialog.hangup()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!("sip: BYE: {e}"),
                    Err(_) => tracing::debug!("sip: BYE timed out"),
                }
                self.dialogs.remove_dialog(&dialog.id());
            }
        }
        self.links.remove(&id);
        self.calls.remove(&dialog_id);
    }
}

/// What `Allow` lists.
const ALLOW: &str = "INVITE, ACK, BYE, CANCEL, OPTIONS, INFO, UPDATE";

/// Where a request came from.
fn source(tx: &Transaction) -> Option<SocketAddr> {
    tx.connection
        .as_ref()
        .and_then(|c| c.get_remote_addr())
        .and_then(|a| a.get_socketaddr().ok())
}

/// The key a SIP INFO carries (`application/dtmf-relay`: `Signal=5`, or
/// `application/dtmf`: `5`); `Ok(None)` for an INFO about something else
/// (answered 200, as RFC 6086 lets us), `Err` for a keypad body we cannot read.
fn key_of_info(req: &rsipstack::sip::Request) -> Result<Option<char>, ()> {
    let ctype = req
        .header_value("Content-Type")
        .unwrap_or_default()
        .to_ascii_lowercase();
    let body = String::from_utf8_lossy(&req.body);
    let signal = if ctype.starts_with("application/dtmf-relay") {
        body.lines()
            .find_map(|l| {
                let (k, v) = l.split_once('=')?;
                k.trim()
                    .eq_ignore_ascii_case("signal")
                    .then(|| v.trim().to_string())
            })
            .ok_or(())?
    } else if ctype.starts_with("application/dtmf") {
        body.trim().to_string()
    } else {
        return Ok(None);
    };
    let mut chars = signal.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) if c.is_ascii_digit() || "*#ABCDabcd".contains(c) => {
            Ok(Some(c.to_ascii_uppercase()))
        }
        _ => Err(()),
    }
}

/// The paced speaker: one 20 ms packet per tick, answers' audio or silence,
/// with `output_audio_buffer.started/stopped` for the sideband.
#[allow(clippy::too_many_arguments)]
async fn speak(
    state: Arc<AppState>,
    lead_ms: u64,
    socket: Arc<UdpSocket>,
    offer: sdp::Offer,
    mut cues: mpsc::UnboundedReceiver<Cue>,
    queued: Arc<std::sync::atomic::AtomicUsize>,
    out: Outbox,
    peer: watch::Receiver<SocketAddr>,
    mut hangup: watch::Receiver<bool>,
) {
    let _task = TaskGuard::new(&state.metrics);
    let mut speaker = match Speaker::new(offer.codec, queued, Duration::from_millis(lead_ms)) {
        Ok(s) => s,
        Err(e) => {
            tracing::error!("sip speaker: {e}");
            return;
        }
    };
    let mut rtp = rtp::Outgoing::new(offer.pt);
    let mut tick = tokio::time::interval(FRAME);
    // Behind schedule (a busy CPU), catch up so the stream keeps real time.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = hangup.wait_for(|h| *h) => return,
        }
        let Some(Tick {
            payload,
            speech,
            event,
        }) = speaker.tick(&mut cues)
        else {
            continue;
        };
        let packet = rtp.packet(payload, speech);
        let to = *peer.borrow();
        if let Err(e) = socket.send_to(&packet, to).await {
            tracing::debug!("sip: sending RTP to {to}: {e}");
        }
        state
            .metrics
            .bytes_out
            .with_label_values(&["sip"])
            .inc_by(packet.len() as u64);
        if let Some((kind, body)) = event {
            let _ = out.send(realtime::event(kind, body)).await;
        }
    }
}

/// The microphone: the caller's RTP, put in order, decoded to 24 kHz pcm16
/// for the session; keys to the session as they are pressed.
#[allow(clippy::too_many_arguments)]
async fn listen(
    state: Arc<AppState>,
    socket: Arc<UdpSocket>,
    offer: sdp::Offer,
    sources: Vec<IpAddr>,
    mic: mpsc::Sender<Vec<u8>>,
    keys: mpsc::Sender<Inbound>,
    peer: watch::Sender<SocketAddr>,
    mut hangup: watch::Receiver<bool>,
) {
    let _task = TaskGuard::new(&state.metrics);
    let Ok(mut decoder) = Mic::new(offer.codec) else {
        return;
    };
    let mut jitter = rtp::Jitter::default();
    let mut keypad = rtp::Keypad::default();
    let mut latched = false;
    let mut tick = tokio::time::interval(FRAME);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut buf = vec![0u8; 2048];
    let drop_packet = |why: &str| {
        state.metrics.phone_errors.with_label_values(&[why]).inc();
    };
    loop {
        // (Nothing awaited inside the arms: the packet is handled below.)
        let packet = tokio::select! {
            _ = hangup.wait_for(|h| *h) => return,
            _ = tick.tick() => None,
            r = socket.recv_from(&mut buf) => match r {
                Ok(p) => Some(p),
                Err(_) => continue,
            },
        };
        let now = Instant::now();
        let played = match packet {
            None => jitter.tick(now),
            Some((n, from)) => {
                // Only from the caller: the offer's address, or the one its
                // signalling came from (behind NAT the offer names a private
                // one); the port is learnt from the first packet.
                if !sources.iter().any(|&ip| same_host(from.ip(), ip)) {
                    drop_packet("rtp_wrong_source");
                    continue;
                }
                let current = *peer.borrow();
                if !latched {
                    latched = true;
                    let _ = peer.send(from);
                } else if from != current {
                    drop_packet("rtp_wrong_source");
                    continue;
                }
                match rtp::read(&buf[..n], offer.pt, offer.dtmf_pt) {
                    rtp::Incoming::Audio { seq, ts, payload } => jitter.push(seq, ts, payload, now),
                    rtp::Incoming::Dtmf { ts, payload } => {
                        match keypad.event(ts, &payload) {
                            Ok(Some(k)) => {
                                tracing::debug!("sip: key {k}");
                                let _ = keys.send(Inbound::Key(k)).await;
                            }
                            Ok(None) => {}
                            Err(why) => drop_packet(why),
                        }
                        continue;
                    }
                    rtp::Incoming::Dropped(why) => {
                        drop_packet(why);
                        continue;
                    }
                }
            }
        };
        for p in played {
            let decoded = match p {
                rtp::Played::Payload(b) => decoder.decode(&b),
                rtp::Played::Silence(n) => {
                    let silence = match offer.codec {
                        super::media::Codec::Pcma => vec![0xd5u8; n as usize],
                        _ => vec![0xffu8; n as usize],
                    };
                    decoder.decode(&silence)
                }
            };
            match decoded {
                Ok(pcm) if !pcm.is_empty() => {
                    if mic.try_send(pcm).is_err() && mic.is_closed() {
                        return;
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::debug!("sip: dropped a packet: {e}"),
            }
        }
    }
}

/// Whether `a` and `b` are one address (an IPv4 one on a dual-stack
/// socket arrives as ::ffff:a.b.c.d).
fn same_host(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(ctype: &str, body: &str) -> rsipstack::sip::Request {
        let raw = format!(
            "INFO sip:omnistream@127.0.0.1 SIP/2.0\r\n\
             Via: SIP/2.0/UDP 127.0.0.1:5062;branch=z9hG4bK1\r\n\
             From: <sip:a@127.0.0.1>;tag=1\r\nTo: <sip:b@127.0.0.1>;tag=2\r\n\
             Call-ID: x\r\nCSeq: 3 INFO\r\nContent-Type: {ctype}\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        rsipstack::sip::Request::try_from(raw.as_bytes()).unwrap()
    }

    #[test]
    fn keys_from_sip_info() {
        let r = info("application/dtmf-relay", "Signal=5\r\nDuration=160\r\n");
        assert_eq!(key_of_info(&r), Ok(Some('5')));
        assert_eq!(
            key_of_info(&info("application/dtmf-relay", "Signal= #\r\n")),
            Ok(Some('#'))
        );
        assert_eq!(key_of_info(&info("application/dtmf", "a")), Ok(Some('A')));
        assert_eq!(
            key_of_info(&info("application/dtmf-relay", "Signal=55\r\n")),
            Err(())
        );
        assert_eq!(
            key_of_info(&info("application/dtmf-relay", "Duration=1\r\n")),
            Err(())
        );
        assert_eq!(key_of_info(&info("text/plain", "hello")), Ok(None));
    }
}
