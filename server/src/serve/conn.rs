//! Connection plumbing every transport shares: the WebSocket upgrade, the
//! bounded writer (`Outbox`) with slow-client detection, reading errors,
//! the drain at shutdown; and where a media track plays answers' audio.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
use base64::Engine as _;
use futures_util::stream::SplitSink;
use futures_util::{Sink, SinkExt};
use prometheus::IntGauge;
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use crate::serve::auth;
use crate::serve::error::{ApiError, ClientError};
use crate::serve::metrics::{Metrics, TaskGuard};
use crate::serve::sessions::SessionGuard;
use crate::serve::shutdown::{self, Phase};
use crate::serve::state::AppState;

/// Largest WebSocket frame or message a client may send.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Unsent output one connection may queue (in KiB) before its producers wait.
const QUEUE_KIB: u32 = 1024;
/// A client is too slow when a write has been stuck this long, or a ping
/// has gone unanswered this long while output kept flowing.
const SLOW_AFTER: Duration = Duration::from_secs(5);
/// ...at least this much output written after the unanswered ping.
const SLOW_BYTES: u64 = 256 * 1024;
/// A ping goes out after this much output (the pong says the client read it).
const PING_EVERY_BYTES: u64 = 64 * 1024;
/// How long the final error frame and the close may take to go out.
const FINAL_WRITE: Duration = Duration::from_secs(5);
/// ...to a client dropped for not reading.
const SLOW_GOODBYE: Duration = Duration::from_secs(30);
/// Time left to a client to read a server-initiated close before the socket goes.
const LINGER: Duration = Duration::from_millis(500);
fn forbidden_origin() -> ApiError {
    ApiError::forbidden(
        "origin_not_allowed",
        "this Origin may not open WebSockets here (server.allowed_origins)",
    )
}

/// The shared WebSocket upgrade: Origin check, a session (or 503 over the
/// cap), frame and message limits, the subprotocol to echo (the first of
/// `protocols` the client offered), then `serve` on the socket. A request
/// that is no WebSocket handshake gets the JSON error shape (axum's
/// rejection says what was wrong, with its status).
pub fn accept<F, Fut>(
    state: Arc<AppState>,
    headers: &HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
    kind: &'static str,
    protocols: &[&'static str],
    serve: F,
) -> Response
where
    F: FnOnce(Arc<AppState>, WebSocket, SessionGuard) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let ws = match upgrade(&state, headers, ws, protocols) {
        Ok(ws) => ws,
        Err(e) => return e.into_response(),
    };
    let session = match state.sessions.open(kind) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    ws.on_upgrade(move |socket| serve(state, socket, session))
}

/// What every WebSocket upgrade passes: the Origin check and a real
/// handshake (else the JSON error), then the frame and message limits and
/// the subprotocol to echo.
pub fn upgrade(
    state: &AppState,
    headers: &HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
    protocols: &[&'static str],
) -> Result<WebSocketUpgrade, ApiError> {
    if !auth::origin_allowed(state, headers) {
        return Err(forbidden_origin());
    }
    let ws = ws.map_err(|e| ApiError::upgrade_refused(e.status(), e.body_text()))?;
    Ok(ws
        .max_message_size(MAX_MESSAGE_BYTES)
        .max_frame_size(MAX_MESSAGE_BYTES)
        .protocols(protocols.iter().copied()))
}

/// A read error worth telling the client about, with the close code
/// RFC 6455 gives it (1009 too big, 1007 not UTF-8, 1002 a protocol
/// violation), or `None` when the connection is simply gone.
pub fn read_error(e: &axum::Error) -> Option<(ClientError, u16)> {
    use axum::extract::ws::close_code;
    let s = e.to_string();
    if s.contains("Space limit exceeded") {
        let m = format!("frames and messages are limited to {MAX_MESSAGE_BYTES} bytes; closing");
        Some((
            ClientError::invalid("message_too_large", m),
            close_code::SIZE,
        ))
    } else if s.contains("UTF-8 encoding error") {
        let m = "a text frame is not valid UTF-8; closing";
        Some((ClientError::invalid("invalid_utf8", m), close_code::INVALID))
    } else if s.contains("WebSocket protocol error") {
        let m = format!("{s}; closing");
        Some((
            ClientError::invalid("protocol_error", m),
            close_code::PROTOCOL,
        ))
    } else {
        None
    }
}

/// A client's base64 audio as bytes, or `invalid_base64`.
pub fn decode_audio_base64(b64: &str) -> Result<Vec<u8>, ClientError> {
    base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| {
            ClientError::invalid("invalid_base64", format!("audio is not valid base64: {e}"))
        })
}

/// Base64 pcm16 (little-endian) -> bytes, checked.
pub fn decode_pcm16_base64(b64: &str) -> Result<Vec<u8>, ClientError> {
    let pcm = decode_audio_base64(b64)?;
    if pcm.len() % 2 == 1 {
        return Err(ClientError::invalid(
            "invalid_audio",
            "pcm16 audio needs an even number of bytes",
        ));
    }
    Ok(pcm)
}

/// Marks the session active while a response runs; `false` once it expired.
pub fn keep_alive(state: &AppState, id: &str, busy: bool) -> bool {
    if busy {
        state.sessions.touch(id)
    } else {
        state.sessions.exists(id)
    }
}

/// `omnistream_connections_open{protocol}` while alive.
pub struct ConnGauge(IntGauge);

impl ConnGauge {
    pub fn new(m: &Metrics, protocol: &str) -> Self {
        let g = m.connections_open.with_label_values(&[protocol]);
        g.inc();
        Self(g)
    }
}

impl Drop for ConnGauge {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// A session's view of the server's shutdown: wakes it when the server
/// starts draining, then every 50 ms to see whether it may end.
pub struct Drain {
    phase: shutdown::Watch,
    draining: bool,
    tick: tokio::time::Interval,
}

impl Drain {
    pub fn new(state: &AppState) -> Self {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        // Not polled until the drain: no burst of missed ticks then.
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Self {
            phase: state.shutdown.watch(),
            draining: false,
            tick,
        }
    }

    pub async fn next(&mut self) {
        if self.draining {
            self.tick.tick().await;
        } else {
            self.phase.reached(Phase::Draining).await;
            self.draining = true;
        }
    }

    pub fn closing(&self) -> bool {
        self.phase.now() >= Phase::Closing
    }
}

/// How long a session's last events may take to reach its client.
pub const GOODBYE: Duration = Duration::from_secs(2);

/// The connection is closing (or closed).
#[derive(Debug)]
pub struct Gone;

/// How the connection ends: an optional last message and a close code.
#[derive(Clone)]
struct Ending {
    last: Option<Message>,
    code: u16,
}

struct Shared {
    tx: mpsc::UnboundedSender<(Message, OwnedSemaphorePermit)>,
    budget: Arc<Semaphore>,
    closing: watch::Sender<Option<Ending>>,
    /// Highest ping sequence the client answered.
    acked: AtomicU64,
    /// The client was dropped for not reading.
    slow: Arc<AtomicBool>,
    /// `omnistream_slow_clients_total`.
    slow_clients: prometheus::IntCounter,
}

impl Shared {
    /// Marks the client as dropped for not reading (counted once).
    fn mark_slow(&self) {
        if !self.slow.swap(true, Ordering::AcqRel) {
            self.slow_clients.inc();
        }
    }
}

/// The sending side of a connection: a queue bounded in bytes in front of
/// a writer task. Cheap to clone.
#[derive(Clone)]
pub struct Outbox(Arc<Shared>);

impl Outbox {
    /// Spawns the writer; `slow` is the message a too-slow client gets last.
    pub fn start(sink: SplitSink<WebSocket, Message>, metrics: &Metrics, slow: Message) -> Self {
        Self::start_on(sink, metrics, slow, true)
    }

    /// The same over any sink of messages (a WebRTC data channel's
    /// bridge); `pings` off where the transport acknowledges by itself.
    pub fn start_on<K>(sink: K, metrics: &Metrics, slow: Message, pings: bool) -> Self
    where
        K: Sink<Message> + Unpin + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared {
            tx,
            budget: Arc::new(Semaphore::new(QUEUE_KIB as usize)),
            closing: watch::channel(None).0,
            acked: AtomicU64::new(0),
            slow: Arc::new(AtomicBool::new(false)),
            slow_clients: metrics.slow_clients.clone(),
        });
        let task = TaskGuard::new(metrics);
        let reading = Reading {
            pings,
            ..Reading::default()
        };
        tokio::spawn(write_loop(sink, rx, shared.clone(), slow, task, reading));
        Self(shared)
    }

    /// Queues `msg`; waits while the queue is full. `Err` once closing.
    pub async fn send(&self, msg: Message) -> Result<(), Gone> {
        let kib = (wire_len(&msg) / 1024 + 1).min(QUEUE_KIB as u64) as u32;
        let permit = self
            .0
            .budget
            .clone()
            .acquire_many_owned(kib)
            .await
            .map_err(|_| Gone)?;
        self.0.tx.send((msg, permit)).map_err(|_| Gone)
    }

    /// Ends the connection: `last` (if any) goes out after what is being
    /// written now, then a close frame with `code`. Queued output is dropped.
    pub fn close(&self, last: Option<Message>, code: u16) {
        self.0.closing.send_if_modified(|c| {
            if c.is_some() {
                return false;
            }
            *c = Some(Ending { last, code });
            true
        });
        self.0.budget.close();
    }

    /// Ends the connection after everything queued, `last` included, is
    /// written (or `within` passes): the graceful [`Self::close`].
    pub async fn finish(&self, last: Message, code: u16, within: Duration) {
        // A close frame (a protocol with no error event) goes last, as the close.
        let (queued, close) = match last {
            m @ Message::Close(_) => (None, Some(m)),
            m => (Some(m), None),
        };
        let _ = tokio::time::timeout(within, async {
            if let Some(m) = queued {
                if self.send(m).await.is_err() {
                    return;
                }
            }
            // Every permit back: the writer has written it all.
            let _ = self.0.budget.acquire_many(QUEUE_KIB).await;
        })
        .await;
        self.close(close, code);
    }

    /// Waits until the queue has room for more output (a producer that
    /// checks first, then [`Self::push`]es, never blocks its caller on a
    /// full queue). `Err` once closing.
    pub async fn ready(&self) -> Result<(), Gone> {
        let p = self
            .0
            .budget
            .acquire_many(QUEUE_KIB / 8)
            .await
            .map_err(|_| Gone)?;
        drop(p);
        Ok(())
    }

    /// Queues `msg` without waiting: it takes what room is left (a producer
    /// that waited for [`Self::ready`] overshoots the queue by one message
    /// at most). `Err` once closing.
    pub fn push(&self, msg: Message) -> Result<(), Gone> {
        let kib = (wire_len(&msg) / 1024 + 1).min(QUEUE_KIB as u64) as u32;
        let budget = &self.0.budget;
        if budget.is_closed() {
            return Err(Gone);
        }
        let take = kib.min(budget.available_permits() as u32).max(1);
        let permit = match budget.clone().try_acquire_many_owned(take) {
            Ok(p) => p,
            // Full: the message rides on an empty permit (bounded by the caller's `ready`).
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                budget.clone().try_acquire_many_owned(0).map_err(|_| Gone)?
            }
            Err(tokio::sync::TryAcquireError::Closed) => return Err(Gone),
        };
        self.0.tx.send((msg, permit)).map_err(|_| Gone)
    }

    /// Set once the client is dropped for not reading (for the answer's
    /// metrics, which count its cancellation as `slow_client`).
    pub fn slow_flag(&self) -> Arc<AtomicBool> {
        self.0.slow.clone()
    }

    /// Drops a client that cannot keep up: `last` tells it why.
    pub fn close_slow(&self, last: Message) {
        self.0.mark_slow();
        self.close(Some(last), axum::extract::ws::close_code::POLICY);
    }

    pub async fn closed(&self) {
        let mut rx = self.0.closing.subscribe();
        let _ = rx.wait_for(Option::is_some).await;
    }

    /// A pong from the client (the payload is our ping's sequence number).
    pub fn pong(&self, payload: &[u8]) {
        if let Ok(b) = <[u8; 8]>::try_from(payload) {
            self.0
                .acked
                .fetch_max(u64::from_be_bytes(b), Ordering::AcqRel);
        }
    }
}

fn wire_len(m: &Message) -> u64 {
    match m {
        Message::Text(t) => t.len() as u64,
        Message::Binary(b) => b.len() as u64,
        _ => 0,
    }
}

/// The writer's view of whether the client reads what it is sent.
#[derive(Default)]
struct Reading {
    /// Whether to probe the client with pings at all.
    pings: bool,
    written: u64,
    last_ping_at: u64,
    next_seq: u64,
    /// Unanswered ping: (seq, sent at, bytes written then).
    outstanding: Option<(u64, Instant, u64)>,
}

impl Reading {
    fn slow(&mut self, acked: u64) -> bool {
        if self.outstanding.is_some_and(|(seq, _, _)| acked >= seq) {
            self.outstanding = None;
        }
        self.slow_at()
            .is_some_and(|t| tokio::time::Instant::now() > t)
    }

    /// When the unanswered ping makes the client slow even if no more
    /// output comes: enough was written after it, so only time is missing.
    fn slow_at(&self) -> Option<tokio::time::Instant> {
        let (_, at, bytes) = self.outstanding?;
        (self.written - bytes >= SLOW_BYTES).then(|| (at + SLOW_AFTER).into())
    }

    /// A ping to send now, if it is time.
    fn ping(&mut self) -> Option<Message> {
        if !self.pings
            || self.outstanding.is_some()
            || self.written - self.last_ping_at < PING_EVERY_BYTES
        {
            return None;
        }
        self.next_seq += 1;
        self.last_ping_at = self.written;
        self.outstanding = Some((self.next_seq, Instant::now(), self.written));
        Some(Message::Ping(Bytes::copy_from_slice(
            &self.next_seq.to_be_bytes(),
        )))
    }
}

enum Stop {
    Closing,
    Slow,
    Broken,
}

/// Sends one message, giving up when the connection closes or the client
/// turns out too slow.
async fn send_watched<K: Sink<Message> + Unpin>(
    sink: &mut K,
    msg: Message,
    closing: &mut watch::Receiver<Option<Ending>>,
    reading: &mut Reading,
    shared: &Shared,
) -> Result<(), Stop> {
    let started = Instant::now();
    let send = sink.send(msg);
    tokio::pin!(send);
    let mut tick = tokio::time::interval(Duration::from_millis(250));
    loop {
        tokio::select! {
            biased;
            r = &mut send => return r.map_err(|_| Stop::Broken),
            _ = closing.wait_for(Option::is_some) => return Err(Stop::Closing),
            _ = tick.tick() => {
                if started.elapsed() > SLOW_AFTER
                    || reading.slow(shared.acked.load(Ordering::Acquire))
                {
                    return Err(Stop::Slow);
                }
            }
        }
    }
}

async fn write_loop<K: Sink<Message> + Unpin>(
    mut sink: K,
    mut rx: mpsc::UnboundedReceiver<(Message, OwnedSemaphorePermit)>,
    shared: Arc<Shared>,
    slow: Message,
    _task: TaskGuard,
    mut reading: Reading,
) {
    let mut closing = shared.closing.subscribe();
    let stop = loop {
        let slow_at = reading.slow_at();
        let next = tokio::select! {
            biased;
            _ = closing.wait_for(Option::is_some) => break Stop::Closing,
            m = rx.recv() => m,
            // A client that stopped reading just before the output ended
            // is found out too, not only while output keeps coming.
            _ = async {
                match slow_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            } => {
                if reading.slow(shared.acked.load(Ordering::Acquire)) {
                    break Stop::Slow;
                }
                continue;
            }
        };
        let Some((msg, permit)) = next else {
            break Stop::Closing;
        };
        let n = wire_len(&msg);
        if let Err(s) = send_watched(&mut sink, msg, &mut closing, &mut reading, &shared).await {
            break s;
        }
        drop(permit);
        reading.written += n;
        if reading.slow(shared.acked.load(Ordering::Acquire)) {
            break Stop::Slow;
        }
        if let Some(ping) = reading.ping() {
            if let Err(s) = send_watched(&mut sink, ping, &mut closing, &mut reading, &shared).await
            {
                break s;
            }
        }
    };
    if matches!(stop, Stop::Slow) {
        shared.mark_slow();
    }
    let ending = match stop {
        Stop::Slow => Some(Ending {
            last: Some(slow),
            code: axum::extract::ws::close_code::POLICY,
        }),
        Stop::Closing => closing.borrow().clone(),
        Stop::Broken => None,
    };
    // A slow client has a full socket before its `slow_client` error: it
    // gets longer to come back and read it (this task is all it holds).
    let within = if shared.slow.load(Ordering::Acquire) {
        SLOW_GOODBYE
    } else {
        FINAL_WRITE
    };
    // Whatever ended the writer ends the connection for everyone else too.
    let outbox = Outbox(shared);
    outbox.close(None, axum::extract::ws::close_code::NORMAL);
    drop(rx);
    let Some(Ending { last, code }) = ending else {
        return;
    };
    // A last message that is itself a close frame gives the close its reason.
    let (last, reason) = match last {
        Some(Message::Close(f)) => (None, f.map(|f| f.reason).unwrap_or_default()),
        m => (m, "".into()),
    };
    let told = last.is_some() || !reason.is_empty();
    let _ = tokio::time::timeout(within, async {
        if let Some(m) = last {
            sink.send(m).await?;
        }
        sink.send(Message::Close(Some(CloseFrame { code, reason })))
            .await
    })
    .await;
    if told {
        tokio::time::sleep(LINGER).await;
    }
}

/// A media track's player (or queue) is full: the client does not keep up.
#[derive(Debug)]
pub struct Overflow;

/// Where a transport plays answers' audio when it is not sent as events: a
/// paced media track (WebRTC).
pub trait AudioSink: Send + Sync {
    /// Queues pcm16 LE at 24 kHz of `response`; `Err` when the track's queue
    /// is full (the peer does not keep up).
    fn push(&self, response: &str, pcm16: &[u8]) -> Result<(), Overflow>;
    /// `response` has no more audio (the track reports when it played out).
    fn end(&self, response: &str);
    /// Drops everything queued (a barge-in).
    fn clear(&self);
    /// Audio queued and not yet played, in seconds.
    fn queued_seconds(&self) -> f64;
}
