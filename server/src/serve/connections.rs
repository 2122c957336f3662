//! The connection layer, below HTTP and before the API key (a request's key
//! is only read with its headers): how long a client may take to send them,
//! how slowly it may send a body, and how many connections it may hold.
//!
//! hyper serves each connection (HTTP/1.1; WebSockets upgrade from it) with
//! its header-read timer, which runs whenever a connection waits for a
//! request: a new one, and a kept-alive one between requests. At the caps
//! (in total, per client address) the connection idle longest — no request in
//! flight — is closed to make room, so a flood of half-open connections
//! cannot lock out a client with a real request; only when every connection
//! is busy is the new one refused with 503 and `Retry-After`. Accept errors
//! (out of file descriptors) back off instead of spinning.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};
use axum::http::Request;
use axum::Router;
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tower::ServiceExt;

use crate::profile::ConnectionSpec;

use super::error::ApiError;
use super::metrics::Metrics;

/// The profile's `server.connections`, resolved.
#[derive(Debug, Clone)]
pub struct Limits {
    pub header_timeout: Duration,
    pub body_grace: Duration,
    pub min_body_rate: u64,
    pub max: usize,
    /// 0: no cap.
    pub max_per_client: usize,
}

impl Limits {
    /// `open_files`: the process's file-descriptor limit (sizes `max: 0`).
    pub fn new(spec: &ConnectionSpec, open_files: u64) -> Self {
        let auto = (open_files / 2).clamp(16, 4096) as usize;
        Self {
            header_timeout: Duration::from_secs_f64(spec.header_timeout_s),
            body_grace: Duration::from_secs_f64(spec.body_timeout_s),
            min_body_rate: spec.min_body_rate,
            max: if spec.max == 0 { auto } else { spec.max },
            max_per_client: spec.max_per_client,
        }
    }
}

/// Raises the soft open-file limit to the hard one (as Go's runtime and
/// nginx's `worker_rlimit_nofile` do: 1024 is a common default) and returns it.
pub fn raise_open_file_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!("could not raise the open-file limit: {e}");
            rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
        }
    }
}

/// Serves `app` on `listener` until `stop` resolves; then stops accepting,
/// asks every connection to finish (idle ones close at once, requests in
/// flight complete) and waits for them up to `linger`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    metrics: Metrics,
    stop: impl Future<Output = ()>,
    linger: Duration,
) {
    let registry = Arc::new(Registry::new(limits.clone(), metrics.clone()));
    // Dropped to tell every connection to finish; each holds a receiver.
    let (finish_tx, finish_rx) = watch::channel(());
    let refusing = Arc::new(AtomicUsize::new(0));
    let mut backoff = Duration::ZERO;
    let mut last_warned: Option<Instant> = None;
    tokio::pin!(stop);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = &mut stop => break,
            a = listener.accept() => a,
        };
        let (stream, peer) = match accepted {
            Ok(a) => {
                backoff = Duration::ZERO;
                a
            }
            Err(e) => {
                if is_connection_error(&e) {
                    continue;
                }
                // EMFILE/ENFILE: the backlog waits while connections close.
                backoff = (backoff * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                if last_warned.is_none_or(|t| t.elapsed() > Duration::from_secs(5)) {
                    tracing::warn!("accept failed ({e}); backing off {backoff:?}");
                    last_warned = Some(Instant::now());
                }
                tokio::time::sleep(backoff).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true); // small audio frames go out at once
        match registry.admit(peer.ip()) {
            Ok(slot) => {
                let app = app.clone();
                let limits = limits.clone();
                let finish = finish_rx.clone();
                tokio::spawn(serve_connection(stream, peer, app, limits, slot, finish));
            }
            Err(()) => {
                metrics
                    .http_connections_closed
                    .with_label_values(&["refused"])
                    .inc();
                refuse(stream, &refusing);
            }
        }
    }
    drop(listener);
    drop(finish_rx);
    drop(finish_tx);
    let deadline = tokio::time::Instant::now() + linger;
    while registry.open() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Pending connections the kernel queues before `accept` (clamped by
/// `net.core.somaxconn`). Tokio's default, 128 here, overflows when a few
/// hundred clients connect at once: their handshakes are dropped and retried a
/// second later, a second of latency for nothing.
const LISTEN_BACKLOG: u32 = 4096;

/// A listening socket on `addr` with a backlog for bursts of clients.
pub fn listen(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if addr.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    // As `TcpListener::bind` does: a restarted server rebinds at once.
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

fn is_connection_error(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionRefused | ConnectionAborted | ConnectionReset
    )
}

/// One connection, start to end (an upgraded one ends here; its socket lives
/// on in the WebSocket's task).
async fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    limits: Limits,
    slot: Slot,
    mut finish: watch::Receiver<()>,
) {
    let conn_state = slot.state.clone();
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let busy = Busy::new(conn_state.clone());
        let req = req.map(|b| Body::new(Paced::new(b, limits.body_grace, limits.min_body_rate)));
        let app = app.clone();
        async move {
            let resp = app.oneshot(req).await.unwrap_or_else(|e| match e {});
            Ok::<_, Infallible>(resp.map(|b| {
                Body::new(Tracked {
                    inner: b,
                    _busy: busy,
                })
            }))
        }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    let conn = http
        .serve_connection(TokioIo::new(stream), service)
        .with_upgrades();
    tokio::pin!(conn);
    let mut finishing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    if e.is_timeout() {
                        slot.closed("header_timeout");
                    }
                    tracing::debug!(%peer, "connection ended: {e}");
                }
                break;
            }
            _ = slot.state.evict.notified() => {
                slot.closed("evicted");
                break;
            }
            _ = finish.changed(), if !finishing => {
                finishing = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// A connection over the cap: 503 with `Retry-After`, written without
/// reading the request. Bounded: past 64 at once, the socket is just closed.
fn refuse(mut stream: TcpStream, refusing: &Arc<AtomicUsize>) {
    if refusing.fetch_add(1, Ordering::AcqRel) >= 64 {
        refusing.fetch_sub(1, Ordering::AcqRel);
        return;
    }
    let refusing = refusing.clone();
    tokio::spawn(async move {
        let body = ApiError::overloaded(
            "too many connections (server.connections.max / max_per_client); retry",
        )
        .body()
        .to_string();
        let head = format!(
            "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\
             retry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            stream.write_all(head.as_bytes()).await?;
            stream.write_all(body.as_bytes()).await?;
            stream.shutdown().await?;
            // Read what the client sent, so the close is not a reset that
            // discards the answer before it reads it.
            let mut sink = [0u8; 4096];
            while stream.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        })
        .await;
        refusing.fetch_sub(1, Ordering::AcqRel);
    });
}

// ------------------------------------------------------------ the registry

/// Per connection: requests in flight and since when it has been idle.
struct ConnState {
    busy: AtomicUsize,
    /// Milliseconds since the registry's epoch at which it last went idle.
    idle_since_ms: AtomicU64,
    evict: Notify,
    epoch: Instant,
}

impl ConnState {
    fn touch(&self) {
        self.idle_since_ms
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Release);
    }
}

struct Entry {
    ip: IpAddr,
    state: Arc<ConnState>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    conns: HashMap<u64, Entry>,
    per_ip: HashMap<IpAddr, usize>,
}

impl Table {
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let e = self.conns.remove(&id)?;
        if let Some(n) = self.per_ip.get_mut(&e.ip) {
            *n -= 1;
            if *n == 0 {
                self.per_ip.remove(&e.ip);
            }
        }
        Some(e)
    }

    /// The connection idle longest (of `ip`, if given).
    fn idlest(&self, ip: Option<IpAddr>) -> Option<u64> {
        self.conns
            .iter()
            .filter(|(_, e)| ip.is_none_or(|ip| e.ip == ip))
            .filter(|(_, e)| e.state.busy.load(Ordering::Acquire) == 0)
            .min_by_key(|(_, e)| e.state.idle_since_ms.load(Ordering::Acquire))
            .map(|(id, _)| *id)
    }
}

/// Every open HTTP connection, for the caps.
struct Registry {
    table: Mutex<Table>,
    limits: Limits,
    metrics: Metrics,
    epoch: Instant,
}

impl Registry {
    fn new(limits: Limits, metrics: Metrics) -> Self {
        Self {
            table: Mutex::default(),
            limits,
            metrics,
            epoch: Instant::now(),
        }
    }

    fn open(&self) -> usize {
        self.table.lock().map_or(0, |t| t.conns.len())
    }

    /// A slot for a new connection from `ip`, making room by closing the
    /// idlest connection where a cap is reached; `Err` when none is idle.
    fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Slot, ()> {
        let mut t = self.table.lock().map_err(|_| ())?;
        let per_client = self.limits.max_per_client;
        if per_client > 0 && t.per_ip.get(&ip).copied().unwrap_or(0) >= per_client {
            self.evict(&mut t, Some(ip))?;
        }
        if t.conns.len() >= self.limits.max {
            self.evict(&mut t, None)?;
        }
        let state = Arc::new(ConnState {
            busy: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
            evict: Notify::new(),
            epoch: self.epoch,
        });
        state.touch();
        t.next_id += 1;
        let id = t.next_id;
        t.conns.insert(
            id,
            Entry {
                ip,
                state: state.clone(),
            },
        );
        *t.per_ip.entry(ip).or_default() += 1;
        self.metrics.http_connections.inc();
        Ok(Slot {
            id,
            state,
            registry: self.clone(),
        })
    }

    fn evict(&self, t: &mut Table, ip: Option<IpAddr>) -> Result<(), ()> {
        let id = t.idlest(ip).ok_or(())?;
        if let Some(e) = t.remove(id) {
            // Stored if the task is not waiting yet: it sees it at its next poll.
            e.state.evict.notify_one();
            self.metrics.http_connections.dec();
        }
        Ok(())
    }
}

/// A connection's place in the registry, freed when its task ends.
struct Slot {
    id: u64,
    state: Arc<ConnState>,
    registry: Arc<Registry>,
}

impl Slot {
    fn closed(&self, reason: &str) {
        self.registry
            .metrics
            .http_connections_closed
            .with_label_values(&[reason])
            .inc();
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut t) = self.registry.table.lock() {
            // Already gone if it was evicted.
            if t.remove(self.id).is_some() {
                self.registry.metrics.http_connections.dec();
            }
        }
    }
}

/// A request in flight on its connection, until its response body is done.
struct Busy(Arc<ConnState>);

impl Busy {
    fn new(s: Arc<ConnState>) -> Self {
        s.busy.fetch_add(1, Ordering::AcqRel);
        Self(s)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its connection marked busy while it streams.
struct Tracked {
    inner: Body,
    _busy: Busy,
}

impl HttpBody for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

// ------------------------------------------------------------ request bodies

const TOO_SLOW: &str = "the request body came too slowly";

/// A request body that came too slowly (see [`Paced`]).
#[derive(Debug, thiserror::Error)]
#[error("the request body came too slowly: {received} bytes in {elapsed_s:.1} s (the server needs {rate} bytes/s after {grace_s:.0} s)")]
pub struct BodyTooSlow {
    received: u64,
    elapsed_s: f64,
    rate: u64,
    grace_s: f64,
}

/// Whether a body read failed because the body was too slow: the request
/// then gets 408 (`request_timeout`).
pub fn too_slow(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<BodyTooSlow>() {
            return Some(t.to_string());
        }
        // A wrapper that keeps only the message (no `source`) still says so.
        let m = err.to_string();
        if let Some(i) = m.find(TOO_SLOW) {
            return Some(m[i..].to_string());
        }
        cur = err.source();
    }
    None
}

/// A request body that must keep coming: after `grace`, at least `rate`
/// bytes/s on average since it started. Each frame pushes the deadline on by
/// its length / `rate`, so a steady client never meets it and a stalled or
/// dribbling one does, `grace` after its last useful byte at the latest.
struct Paced {
    inner: Incoming,
    started: tokio::time::Instant,
    grace: Duration,
    rate: u64,
    received: u64,
    sleep: Pin<Box<tokio::time::Sleep>>,
    failed: bool,
}

impl Paced {
    fn new(inner: Incoming, grace: Duration, rate: u64) -> Self {
        let started = tokio::time::Instant::now();
        Self {
            inner,
            started,
            grace,
            rate: rate.max(1),
            received: 0,
            sleep: Box::pin(tokio::time::sleep_until(started + grace)),
            failed: false,
        }
    }

    fn deadline(&self) -> tokio::time::Instant {
        self.started + self.grace + Duration::from_secs_f64(self.received as f64 / self.rate as f64)
    }
}

impl HttpBody for Paced {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(d) = frame.data_ref() {
                    self.received += d.len() as u64;
                    let at = self.deadline();
                    self.sleep.as_mut().reset(at);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => {
                if self.sleep.as_mut().poll(cx).is_ready() {
                    self.failed = true;
                    let err = BodyTooSlow {
                        received: self.received,
                        elapsed_s: self.started.elapsed().as_secs_f64(),
                        rate: self.rate,
                        grace_s: self.grace.as_secs_f64(),
                    };
                    return Poll::Ready(Some(Err(err.into())));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The body length a request declares (`Content-Length`), to refuse an
/// oversized body before reading any of it.
pub fn declared_length(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// An over-long body up to this size is read (and dropped) before the 413.
const DRAIN_MAX_BYTES: u64 = 4 << 20;

/// A request's whole body, at most `limit` bytes, every refusal in the JSON
/// shape: 413 `request_too_large` from its `Content-Length` (a client waiting
/// on `Expect: 100-continue` never sends it; a body up to 4 MiB is read and
/// dropped first, so that its client reads the answer) or once it grows past
/// `limit`, 408 `request_timeout` when it comes too slowly.
pub async fn read_body(
    req: axum::extract::Request,
    limit: usize,
) -> Result<axum::body::Bytes, ApiError> {
    use axum::extract::FromRequest;
    use futures_util::StreamExt;
    if let Some(n) = declared_length(req.headers()).filter(|n| *n > limit as u64) {
        // A client still sending when the connection closes gets a reset
        // and never reads the 413: a body of modest size is read and
        // dropped first (the connection's body timeouts still apply). One
        // waiting on `Expect: 100-continue` has sent nothing yet.
        let expects = req.headers().contains_key(axum::http::header::EXPECT);
        if !expects && n <= DRAIN_MAX_BYTES {
            let mut body = req.into_body().into_data_stream();
            while let Some(Ok(_)) = body.next().await {}
        }
        return Err(ApiError::too_large(limit));
    }
    let bytes = axum::body::Bytes::from_request(req, &())
        .await
        .map_err(|e| {
            if let Some(m) = too_slow(&e) {
                ApiError::request_timeout(m)
            } else if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::too_large(limit)
            } else {
                ApiError::bad_request("invalid_body", e.body_text())
            }
        })?;
    if bytes.len() > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max: usize, per_client: usize) -> Limits {
        Limits {
            header_timeout: Duration::from_secs(1),
            body_grace: Duration::from_secs(1),
            min_body_rate: 1,
            max,
            max_per_client: per_client,
        }
    }

    fn registry(max: usize, per_client: usize) -> Arc<Registry> {
        Arc::new(Registry::new(
            limits(max, per_client),
            Metrics::new().unwrap(),
        ))
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    #[test]
    fn at_the_cap_the_idlest_connection_makes_room() {
        let r = registry(2, 0);
        let first = r.admit(A).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let second = r.admit(B).unwrap();
        let third = r.admit(B).unwrap();
        assert_eq!(r.open(), 2);
        // The oldest idle one was told to go, and its slot is free already.
        assert!(futures_util::FutureExt::now_or_never(first.state.evict.notified()).is_some());
        assert!(futures_util::FutureExt::now_or_never(second.state.evict.notified()).is_none());
        drop(first);
        assert_eq!(r.open(), 2);
        // Busy connections are never evicted: with both busy, a fourth is refused.
        let _b2 = Busy::new(second.state.clone());
        let _b3 = Busy::new(third.state.clone());
        assert!(r.admit(A).is_err());
        drop(_b2);
        assert!(r.admit(A).is_ok());
    }

    #[test]
    fn the_per_client_cap_evicts_only_that_clients_connections() {
        let r = registry(100, 2);
        let b = r.admit(B).unwrap();
        let a1 = r.admit(A).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let _a2 = r.admit(A).unwrap();
        let _a3 = r.admit(A).unwrap();
        assert!(futures_util::FutureExt::now_or_never(a1.state.evict.notified()).is_some());
        assert!(futures_util::FutureExt::now_or_never(b.state.evict.notified()).is_none());
        assert_eq!(r.open(), 3);
        drop(a1);
        drop(b);
        assert_eq!(r.open(), 2);
    }

    #[test]
    fn limits_follow_the_file_limit_unless_set() {
        let spec = ConnectionSpec::default();
        assert_eq!(Limits::new(&spec, 1024).max, 512);
        assert_eq!(Limits::new(&spec, 1 << 20).max, 4096);
        let spec = ConnectionSpec { max: 7, ..spec };
        assert_eq!(Limits::new(&spec, 1024).max, 7);
    }
}
