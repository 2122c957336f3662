//! Graceful shutdown. On SIGTERM or SIGINT the server drains: `/health`
//! says `draining` (503) so a load balancer stops sending, new work is
//! refused with 503 `server_shutting_down`, and answers in flight may finish
//! until the drain deadline (`server.drain_s`). Then it closes: whatever still
//! runs is cancelled and its client told so — Realtime an `error` and close
//! 1001, `/v1/stream` `done` and close 1001, SSE an error chunk and `[DONE]`,
//! WebRTC the data-channel `error` and a hang-up — and the process exits 0.

use tokio::sync::watch;

use omnistream_stages::engine::{Event, RequestHandle};

/// Where the server is in its life. Ordered: each phase follows the one before.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Serving,
    /// No new work; answers in flight finish.
    Draining,
    /// Everything still running is cancelled and its client told.
    Closing,
}

/// The message (and, by its prefix, the error code) of an answer cut by the shutdown.
pub const MESSAGE: &str =
    "server_shutting_down: the server is shutting down; retry (on another instance)";
pub const CODE: &str = "server_shutting_down";

/// The server's phase, watched by every live session and stream.
pub struct Shutdown {
    tx: watch::Sender<Phase>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self {
            tx: watch::channel(Phase::Serving).0,
        }
    }
}

impl Shutdown {
    pub fn phase(&self) -> Phase {
        *self.tx.borrow()
    }

    /// Whether new work is refused.
    pub fn draining(&self) -> bool {
        self.phase() >= Phase::Draining
    }

    pub fn watch(&self) -> Watch {
        Watch(self.tx.subscribe())
    }

    /// Moves on to `p` (never back).
    pub fn enter(&self, p: Phase) {
        self.tx.send_if_modified(|cur| {
            let later = p > *cur;
            if later {
                *cur = p;
            }
            later
        });
    }
}

/// One task's view of the phase.
#[derive(Clone)]
pub struct Watch(watch::Receiver<Phase>);

impl Watch {
    /// Resolves once the server reaches `p` (at once if it has).
    pub async fn reached(&mut self, p: Phase) {
        // The sender lives in the state every task holds; gone means gone.
        let _ = self.0.wait_for(|cur| *cur >= p).await;
    }

    pub fn now(&self) -> Phase {
        *self.0.borrow()
    }

    /// The request's next event, or — once the server closes — the request
    /// cancelled and a shutdown error in place of the rest.
    pub async fn next_event(&mut self, handle: &RequestHandle) -> Option<Event> {
        tokio::select! {
            biased;
            ev = handle.next_event_async() => ev,
            _ = self.reached(Phase::Closing) => {
                handle.cancel();
                Some(Event::Error(MESSAGE.into()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn phases_only_move_forward_and_wake_their_watchers() {
        let s = Shutdown::default();
        let mut w = s.watch();
        assert_eq!(w.now(), Phase::Serving);
        assert!(!s.draining());
        let waiter = tokio::spawn(async move {
            w.reached(Phase::Closing).await;
            w.now()
        });
        s.enter(Phase::Draining);
        assert!(s.draining());
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        s.enter(Phase::Closing);
        s.enter(Phase::Draining); // no way back
        assert_eq!(waiter.await.unwrap(), Phase::Closing);
        assert_eq!(s.phase(), Phase::Closing);
    }
}
