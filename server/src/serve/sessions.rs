//! The session store: a handle per open conversation (its id, kind and last
//! activity; the conversation itself lives with its driver), caps on
//! sessions and in-flight requests, and an idle timeout.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dashmap::DashMap;

use super::error::ApiError;
use super::metrics::Metrics;

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

/// One open conversation, as the store sees it.
#[derive(Debug, Clone)]
pub struct Session {
    /// What kind of client holds it (`realtime`, `stream`, `webrtc`).
    pub kind: &'static str,
    pub created: Instant,
    pub last_active: Instant,
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
                kind,
                created: now,
                last_active: now,
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

    /// Marks the session active; `false` if it is gone (closed or expired).
    pub fn touch(&self, id: &str) -> bool {
        match self.0.sessions.get_mut(id) {
            Some(mut s) => {
                s.last_active = Instant::now();
                true
            }
            None => false,
        }
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
    fn idle_sessions_expire() {
        let m = manager(8, 8, Duration::from_millis(20));
        let a = m.open("realtime").unwrap();
        let b = m.open("realtime").unwrap();
        std::thread::sleep(Duration::from_millis(30));
        assert!(m.touch(&b.id)); // b is active again
        assert_eq!(m.expire_idle(), 1);
        assert!(!m.exists(&a.id));
        assert!(m.exists(&b.id));
    }
}
