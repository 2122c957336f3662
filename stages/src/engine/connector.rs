//! Connectors: bounded channels between stages, behind a trait so that a stage
//! can live in another process or host without changing stage code (the NATS
//! connector is in `remote/`).

use std::time::Duration;

/// The other side is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("connector closed")]
pub struct Closed;

/// Sending half. `send` blocks while the channel is full: backpressure, so a
/// fast stage cannot run unboundedly ahead of a slow one.
pub trait ConnectorTx<T>: Send + Sync {
    fn send(&self, item: T) -> Result<(), Closed>;
    fn boxed_clone(&self) -> Box<dyn ConnectorTx<T>>;
    /// Items sent and not yet taken by the receiver (its queue, and for a
    /// remote receiver what is still on the wire).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Receiving half.
pub trait ConnectorRx<T>: Send + Sync {
    /// Waits up to `timeout` for an item; `Ok(None)` on timeout.
    fn recv_timeout(&self, timeout: Duration) -> Result<Option<T>, Closed>;
    /// Returns an item if one is waiting.
    fn try_recv(&self) -> Result<Option<T>, Closed>;
    /// Items waiting (queue depth).
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// In-process connector: a bounded MPSC channel.
pub struct InProcessTx<T>(flume::Sender<T>);
pub struct InProcessRx<T>(flume::Receiver<T>);

pub fn in_process<T>(capacity: usize) -> (InProcessTx<T>, InProcessRx<T>) {
    let (tx, rx) = flume::bounded(capacity.max(1));
    (InProcessTx(tx), InProcessRx(rx))
}

impl<T: Send + 'static> ConnectorTx<T> for InProcessTx<T> {
    fn send(&self, item: T) -> Result<(), Closed> {
        self.0.send(item).map_err(|_| Closed)
    }
    fn boxed_clone(&self) -> Box<dyn ConnectorTx<T>> {
        Box::new(InProcessTx(self.0.clone()))
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

impl<T: Send> ConnectorRx<T> for InProcessRx<T> {
    fn recv_timeout(&self, timeout: Duration) -> Result<Option<T>, Closed> {
        match self.0.recv_timeout(timeout) {
            Ok(v) => Ok(Some(v)),
            Err(flume::RecvTimeoutError::Timeout) => Ok(None),
            Err(flume::RecvTimeoutError::Disconnected) => Err(Closed),
        }
    }
    fn try_recv(&self) -> Result<Option<T>, Closed> {
        match self.0.try_recv() {
            Ok(v) => Ok(Some(v)),
            Err(flume::TryRecvError::Empty) => Ok(None),
            Err(flume::TryRecvError::Disconnected) => Err(Closed),
        }
    }
    fn len(&self) -> usize {
        self.0.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_channel_applies_backpressure_and_reports_close() {
        let (tx, rx) = in_process::<u32>(2);
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        assert_eq!(rx.len(), 2);
        // Full: a third send must wait until the receiver takes one.
        let tx2 = tx.boxed_clone();
        let h = std::thread::spawn(move || tx2.send(3));
        std::thread::sleep(Duration::from_millis(50));
        assert!(!h.is_finished(), "send on a full connector returned early");
        assert_eq!(rx.try_recv().unwrap(), Some(1));
        h.join().unwrap().unwrap();
        assert_eq!(rx.try_recv().unwrap(), Some(2));
        assert_eq!(rx.try_recv().unwrap(), Some(3));
        assert_eq!(rx.recv_timeout(Duration::from_millis(10)).unwrap(), None);
        drop(tx);
        assert_eq!(rx.try_recv(), Err(Closed));
    }
}
