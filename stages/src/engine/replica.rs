//! A stage's replicas behind one input: a new request goes to the least-loaded
//! replica, and every later payload of that request to the same one (its KV
//! cache and streaming state live there).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::connector::{Closed, ConnectorTx};
use super::payload::Envelope;
use super::pipeline::StageStats;
use super::request::RequestCtx;
use super::worker::StageCounters;
use super::EngineError;

/// Which replica of a stage holds a request: a local replica's index, or a
/// remote replica's instance id (from its announcements).
pub type ReplicaId = u64;

/// The way into one stage, whatever its replicas are and wherever they run.
pub trait StageInput: Send + Sync {
    /// The replica a new request goes to: the least loaded live one.
    fn pick(&self) -> Result<ReplicaId, EngineError>;
    /// [`Self::pick`] among the replicas on `device` (the request's previous
    /// stage's), where this stage has some in this process.
    fn pick_near(&self, device: Option<&str>) -> Result<ReplicaId, EngineError> {
        let _ = device;
        self.pick()
    }
    /// The device replica `replica` runs on, where this process knows it.
    fn device_of(&self, replica: ReplicaId) -> Option<String> {
        let _ = replica;
        None
    }
    /// Sends to one replica; blocks while its connector is full (backpressure).
    /// `Closed` when that replica is gone.
    fn send(&self, replica: ReplicaId, env: Envelope) -> Result<(), Closed>;
    /// Called once per request whose route passes this stage, at submission,
    /// after its route is set.
    fn admit(&self, _ctx: &Arc<RequestCtx>) {}
    /// One snapshot per replica.
    fn stats(&self) -> Vec<StageStats>;
    /// This process's traffic to and from remote stages, if it has any.
    fn wire(&self) -> Option<super::pipeline::WireStats> {
        None
    }
}

/// Index of the smallest load; ties go round robin from `start`, so that
/// requests submitted together spread over idle replicas.
pub(crate) fn least_loaded(loads: &[usize], start: usize) -> Option<usize> {
    let n = loads.len();
    (0..n).map(|k| (start + k) % n).min_by_key(|&i| loads[i])
}

/// [`least_loaded`] among the replicas on `device` (`devices[i]` is replica
/// i's) when any is there, else among all.
pub(crate) fn least_loaded_near(
    loads: &[usize],
    devices: &[String],
    device: Option<&str>,
    start: usize,
) -> Option<usize> {
    let near: Vec<usize> = match device {
        Some(d) => (0..loads.len())
            .filter(|&i| devices.get(i).is_some_and(|x| x == d))
            .collect(),
        None => Vec::new(),
    };
    if near.is_empty() {
        return least_loaded(loads, start);
    }
    let sub: Vec<usize> = near.iter().map(|&i| loads[i]).collect();
    least_loaded(&sub, start).map(|k| near[k])
}

/// One local replica: its input connector and the counters its worker keeps.
pub(crate) struct LocalReplica {
    pub tx: Box<dyn ConnectorTx<Envelope>>,
    pub counters: Arc<StageCounters>,
}

/// Replicas that are worker threads of this process.
pub(crate) struct LocalReplicas {
    pub name: String,
    pub replicas: Vec<LocalReplica>,
    /// Each replica's device (empty: not known).
    devices: Vec<String>,
    next: AtomicUsize,
}

impl LocalReplicas {
    pub fn new(name: String, replicas: Vec<LocalReplica>, devices: Vec<String>) -> Self {
        Self {
            name,
            replicas,
            devices,
            next: AtomicUsize::new(0),
        }
    }
}

impl StageInput for LocalReplicas {
    fn pick(&self) -> Result<ReplicaId, EngineError> {
        self.pick_near(None)
    }

    fn pick_near(&self, device: Option<&str>) -> Result<ReplicaId, EngineError> {
        // Load = requests the worker holds + payloads waiting for it. The queue
        // is read live, so requests submitted back to back see each other.
        let loads: Vec<usize> = self
            .replicas
            .iter()
            .map(|r| r.counters.active.load(Ordering::Relaxed) + r.tx.len())
            .collect();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        least_loaded_near(&loads, &self.devices, device, start)
            .map(|i| i as ReplicaId)
            .ok_or_else(|| EngineError::Unavailable(format!("stage {} has no replica", self.name)))
    }

    fn device_of(&self, replica: ReplicaId) -> Option<String> {
        self.devices.get(replica as usize).cloned()
    }

    fn send(&self, replica: ReplicaId, env: Envelope) -> Result<(), Closed> {
        let r = self.replicas.get(replica as usize).ok_or(Closed)?;
        r.tx.send(env)
    }

    fn stats(&self) -> Vec<StageStats> {
        self.replicas
            .iter()
            .enumerate()
            .map(|(i, r)| r.counters.snapshot(&self.name, &i.to_string()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_loaded_breaks_ties_round_robin() {
        assert_eq!(least_loaded(&[], 0), None);
        assert_eq!(least_loaded(&[3, 1, 2], 0), Some(1));
        assert_eq!(least_loaded(&[0, 0, 0], 0), Some(0));
        assert_eq!(least_loaded(&[0, 0, 0], 1), Some(1));
        assert_eq!(least_loaded(&[0, 0, 0], 5), Some(2));
        assert_eq!(least_loaded(&[1, 0, 0], 0), Some(1));
    }

    #[test]
    fn a_replica_on_the_previous_stages_device_goes_first() {
        let devs: Vec<String> = ["cuda:0", "cuda:1", "cuda:1", "cuda:2"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        // On cuda:1: the less loaded of its two, though cuda:0's is idle.
        assert_eq!(
            least_loaded_near(&[0, 5, 3, 0], &devs, Some("cuda:1"), 0),
            Some(2)
        );
        // Ties on the device go round.
        assert_eq!(
            least_loaded_near(&[0, 1, 1, 0], &devs, Some("cuda:1"), 1),
            Some(2)
        );
        assert_eq!(
            least_loaded_near(&[0, 1, 1, 0], &devs, Some("cuda:1"), 2),
            Some(1)
        );
        // None there (vLLM-Omni's layout: the Thinker alone on cuda:3), or
        // no device known: the least loaded of all.
        assert_eq!(
            least_loaded_near(&[4, 5, 3, 1], &devs, Some("cuda:3"), 0),
            Some(3)
        );
        assert_eq!(least_loaded_near(&[4, 5, 3, 1], &devs, None, 0), Some(3));
        assert_eq!(
            least_loaded_near(&[4, 5, 3, 1], &[], Some("cuda:1"), 0),
            Some(3)
        );
    }
}
