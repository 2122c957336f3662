//! The session manager: per-conversation state in a concurrent map, caps on
//! sessions and in-flight requests, and an idle timeout.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;
use omnistream_stages::engine::SamplingOverrides;
use omnistream_stages::models::tokenizer::ChatMessage;

use super::metrics::Metrics;
use super::ApiError;

#[derive(Debug, Clone)]
pub struct SessionLimits {
    /// Open sessions (WebSocket connections, realtime conversations).
    pub max_sessions: usize,
    /// Requests generating at once, over all endpoints.
    pub max_in_flight: usize,
    /// A session with no activity for this long is closed.
    pub idle_timeout: Duration,
}

impl Default for SessionLimits {
    fn default() -> Self {
        Self {
            max_sessions: 256,
            max_in_flight: 64,
            idle_timeout: Duration::from_secs(600),
        }
    }
}

/// One conversation.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: String,
    /// What kind of client holds it (`realtime`, `stream`, `webrtc`).
    pub kind: &'static str,
    pub history: Vec<ChatMessage>,
    pub instructions: Option<String>,
    pub voice: Option<String>,
    pub input_format: String,
    pub output_format: String,
    pub sampling: SamplingOverrides,
    pub created: Instant,
    pub last_active: Instant,
    /// The response being generated, if any (cancelled by `cancel_in_flight`).
    pub in_flight: Option<String>,
    /// The user's last spoken turn (16 kHz), not answered yet, for a Thinker
    /// that hears speech itself (there is no transcript to keep instead).
    pub spoken: Option<std::sync::Arc<[f32]>>,
}

struct Inner {
    sessions: DashMap<String, Session>,
    in_flight: AtomicUsize,
    limits: SessionLimits,
    metrics: Metrics,
}

/// Cheap to clone; all clones share the map.
#[derive(Clone)]
pub struct SessionManager(Arc<Inner>);

/// Removes its session when dropped (the connection ended).
pub struct SessionGuard {
    manager: SessionManager,
    pub id: String,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.manager.close(&self.id);
    }
}

/// Counts one in-flight request until dropped.
pub struct InFlightGuard(SessionManager);

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.0 .0.in_flight.fetch_sub(1, Ordering::AcqRel);
        self.0 .0.metrics.requests_in_flight.dec();
    }
}

impl SessionManager {
    pub fn new(limits: SessionLimits, metrics: Metrics) -> Self {
        Self(Arc::new(Inner {
            sessions: DashMap::new(),
            in_flight: AtomicUsize::new(0),
            limits,
            metrics,
        }))
    }

    /// Opens a session, or refuses when at the cap.
    pub fn open(&self, kind: &'static str) -> Result<SessionGuard, ApiError> {
        if self.0.sessions.len() >= self.0.limits.max_sessions {
            return Err(ApiError::overloaded(format!(
                "too many open sessions (limit {})",
                self.0.limits.max_sessions
            )));
        }
        let id = format!("sess_{}", uuid::Uuid::new_v4().simple());
        let now = Instant::now();
        self.0.sessions.insert(
            id.clone(),
            Session {
                id: id.clone(),
                kind,
                history: Vec::new(),
                instructions: None,
                voice: None,
                input_format: "pcm16".into(),
                output_format: "pcm16".into(),
                sampling: SamplingOverrides::default(),
                created: now,
                last_active: now,
                in_flight: None,
                spoken: None,
            },
        );
        self.0
            .metrics
            .sessions_open
            .set(self.0.sessions.len() as i64);
        Ok(SessionGuard {
            manager: self.clone(),
            id,
        })
    }

    fn close(&self, id: &str) {
        if let Some((_, s)) = self.0.sessions.remove(id) {
            tracing::debug!(id, kind = s.kind, age = ?s.created.elapsed(), "session closed");
        }
        self.0
            .metrics
            .sessions_open
            .set(self.0.sessions.len() as i64);
    }

    /// Runs `f` on the session (and marks it active); `None` if it is gone
    /// (closed or expired).
    pub fn with<R>(&self, id: &str, f: impl FnOnce(&mut Session) -> R) -> Option<R> {
        let mut s = self.0.sessions.get_mut(id)?;
        s.last_active = Instant::now();
        Some(f(&mut s))
    }

    pub fn exists(&self, id: &str) -> bool {
        self.0.sessions.contains_key(id)
    }

    pub fn count(&self) -> usize {
        self.0.sessions.len()
    }

    pub fn in_flight(&self) -> usize {
        self.0.in_flight.load(Ordering::Acquire)
    }

    /// Admits one more generating request, or refuses (503 / a realtime error).
    pub fn begin_request(&self) -> Result<InFlightGuard, ApiError> {
        let max = self.0.limits.max_in_flight;
        let admitted = self
            .0
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            return Err(ApiError::overloaded(format!(
                "too many requests in flight (limit {max}); retry shortly"
            )));
        }
        self.0.metrics.requests_in_flight.inc();
        Ok(InFlightGuard(self.clone()))
    }

    /// Drops sessions idle for longer than the timeout; their connections see
    /// the session gone and close.
    pub fn expire_idle(&self) -> usize {
        let timeout = self.0.limits.idle_timeout;
        let before = self.0.sessions.len();
        self.0
            .sessions
            .retain(|_, s| s.last_active.elapsed() < timeout);
        let n = before.saturating_sub(self.0.sessions.len());
        self.0
            .metrics
            .sessions_open
            .set(self.0.sessions.len() as i64);
        n
    }

    pub fn spawn_reaper(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tick.tick().await;
                me.expire_idle();
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manager(max_sessions: usize, max_in_flight: usize, idle: Duration) -> SessionManager {
        SessionManager::new(
            SessionLimits {
                max_sessions,
                max_in_flight,
                idle_timeout: idle,
            },
            Metrics::new().unwrap(),
        )
    }

    #[test]
    fn caps_refuse_and_guards_release() {
        let m = manager(2, 1, Duration::from_secs(60));
        let a = m.open("stream").unwrap();
        let _b = m.open("stream").unwrap();
        let e = m.open("stream").err().unwrap();
        assert_eq!(e.status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.retry_after, Some(1));
        drop(a);
        assert_eq!(m.count(), 1);
        let _c = m.open("stream").unwrap();

        let r = m.begin_request().unwrap();
        assert!(m.begin_request().is_err());
        drop(r);
        assert_eq!(m.in_flight(), 0);
        assert!(m.begin_request().is_ok());
    }

    #[test]
    fn idle_sessions_expire_and_state_is_per_session() {
        let m = manager(8, 8, Duration::from_millis(20));
        let a = m.open("realtime").unwrap();
        let b = m.open("realtime").unwrap();
        m.with(&a.id, |s| s.voice = Some("joe".into())).unwrap();
        assert_eq!(m.with(&b.id, |s| s.voice.clone()).unwrap(), None);
        std::thread::sleep(Duration::from_millis(30));
        m.with(&b.id, |_| ()).unwrap(); // b is active again
        assert_eq!(m.expire_idle(), 1);
        assert!(!m.exists(&a.id));
        assert!(m.exists(&b.id));
    }
}
