//! A stage worker: one thread that owns a stage's model and per-request state,
//! takes payloads from its input connector, steps, and sends results on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::connector::ConnectorRx;
use super::payload::{Envelope, Payload};
use super::pipeline::StageStats;
use super::replica::StageInput;
use super::request::{RequestCtx, RequestId};
use super::stage::{StageModel, StepOutput};

/// How long an idle worker waits before re-checking cancellations and shutdown.
const IDLE_POLL: Duration = Duration::from_millis(5);

/// Live counters of one stage (read by `/metrics` and the tests).
#[derive(Default)]
pub(crate) struct StageCounters {
    pub active: AtomicUsize,
    pub queue_depth: AtomicUsize,
    pub steps: AtomicU64,
    pub step_micros: AtomicU64,
    pub batch_items: AtomicU64,
    pub idle_micros: AtomicU64,
    pub finished: AtomicU64,
    pub cancelled: AtomicU64,
    pub failed: AtomicU64,
    pub alive: AtomicBool,
    pub cache_bytes: AtomicUsize,
}

impl StageCounters {
    pub fn snapshot(&self, name: &str, replica: &str) -> StageStats {
        StageStats {
            name: name.to_string(),
            replica: replica.to_string(),
            active: self.active.load(Ordering::Relaxed),
            cache_bytes: self.cache_bytes.load(Ordering::Relaxed),
            queue_depth: self.queue_depth.load(Ordering::Relaxed),
            steps: self.steps.load(Ordering::Relaxed),
            step_seconds_total: self.step_micros.load(Ordering::Relaxed) as f64 * 1e-6,
            batch_items_total: self.batch_items.load(Ordering::Relaxed),
            idle_seconds_total: self.idle_micros.load(Ordering::Relaxed) as f64 * 1e-6,
            finished: self.finished.load(Ordering::Relaxed),
            cancelled: self.cancelled.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            alive: self.alive.load(Ordering::Relaxed),
            ..Default::default()
        }
    }
}

/// Starts `worker` on a thread of its own, named after its stage.
pub(crate) fn spawn(
    worker: Worker,
    replica: usize,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("stage-{}-{replica}", worker.name))
        .spawn(move || worker.run())
}

pub(crate) struct Worker {
    pub index: usize,
    pub name: String,
    pub model: Box<dyn StageModel>,
    pub rx: Box<dyn ConnectorRx<Envelope>>,
    /// The next stage (whatever its replicas and wherever they run).
    pub tx: Option<Arc<dyn StageInput>>,
    pub counters: Arc<StageCounters>,
    pub shutdown: Arc<AtomicBool>,
}

impl Worker {
    pub fn run(mut self) {
        self.model.start();
        self.counters.alive.store(true, Ordering::Release);
        let mut requests: HashMap<RequestId, Arc<RequestCtx>> = HashMap::new();
        let mut input_closed = false;
        loop {
            if self.shutdown.load(Ordering::Acquire) {
                break;
            }
            // Take everything waiting, without blocking.
            while !input_closed {
                match self.rx.try_recv() {
                    Ok(Some(env)) => self.accept(env, &mut requests),
                    Ok(None) => break,
                    Err(_) => input_closed = true,
                }
            }
            self.reap(&mut requests);
            self.counters
                .queue_depth
                .store(self.rx.len(), Ordering::Relaxed);
            self.counters
                .active
                .store(requests.len(), Ordering::Relaxed);
            self.counters
                .cache_bytes
                .store(self.model.cache_bytes(), Ordering::Relaxed);

            if self.model.has_ready_work() {
                self.step(&mut requests);
                continue;
            }
            if input_closed {
                if requests.is_empty() {
                    break;
                }
                std::thread::sleep(IDLE_POLL);
                continue;
            }
            let t0 = Instant::now();
            match self.rx.recv_timeout(IDLE_POLL) {
                Ok(Some(env)) => self.accept(env, &mut requests),
                Ok(None) => {}
                Err(_) => input_closed = true,
            }
            self.counters
                .idle_micros
                .fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        }
        for (id, _) in requests.drain() {
            self.model.remove(id);
        }
        self.counters.active.store(0, Ordering::Relaxed);
        self.counters.alive.store(false, Ordering::Release);
    }

    fn accept(&mut self, env: Envelope, requests: &mut HashMap<RequestId, Arc<RequestCtx>>) {
        let id = env.request;
        match env.payload {
            Payload::Start(ctx) => {
                if ctx.is_cancelled() {
                    return;
                }
                if let Err(e) = self.model.admit(ctx.clone()) {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                    ctx.fail(format!("{}: {e}", self.name));
                    self.model.remove(id);
                    return;
                }
                // Downstream stages learn of the request before its first data.
                if ctx.last_stage > self.index {
                    if let Some(tx) = &self.tx {
                        let next = ctx.route.get(self.index + 1).copied().unwrap_or(0);
                        let start = Envelope {
                            request: id,
                            payload: Payload::Start(ctx.clone()),
                        };
                        if tx.send(next, start).is_err() {
                            ctx.fail(format!(
                                "stage_unavailable: {}: the next stage's replica is gone",
                                self.name
                            ));
                        }
                    }
                }
                requests.insert(id, ctx);
            }
            payload => {
                let Some(ctx) = requests.get(&id) else {
                    return; // cancelled or failed earlier: drop its data
                };
                if let Err(e) = self.model.push(id, payload) {
                    self.counters.failed.fetch_add(1, Ordering::Relaxed);
                    ctx.fail(format!("{}: {e}", self.name));
                    self.model.remove(id);
                    requests.remove(&id);
                }
            }
        }
    }

    fn reap(&mut self, requests: &mut HashMap<RequestId, Arc<RequestCtx>>) {
        let gone: Vec<RequestId> = requests
            .iter()
            .filter(|(_, c)| c.is_cancelled())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.model.remove(id);
            requests.remove(&id);
            self.counters.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn step(&mut self, requests: &mut HashMap<RequestId, Arc<RequestCtx>>) {
        let mut out = StepOutput::default();
        let t0 = Instant::now();
        self.model.step(&mut out);
        let dt = t0.elapsed();
        self.counters.steps.fetch_add(1, Ordering::Relaxed);
        self.counters
            .step_micros
            .fetch_add(dt.as_micros() as u64, Ordering::Relaxed);
        self.counters
            .batch_items
            .fetch_add(out.batch as u64, Ordering::Relaxed);

        for (id, payload) in out.downstream {
            let Some(ctx) = requests.get(&id) else {
                continue;
            };
            if ctx.is_cancelled() || ctx.last_stage <= self.index {
                continue;
            }
            if let Some(tx) = &self.tx {
                let next = ctx.route.get(self.index + 1).copied().unwrap_or(0);
                if tx
                    .send(
                        next,
                        Envelope {
                            request: id,
                            payload,
                        },
                    )
                    .is_err()
                {
                    ctx.fail(format!(
                        "stage_unavailable: {}: the next stage's replica is gone",
                        self.name
                    ));
                }
            }
        }
        for (id, err) in out.failed {
            self.model.remove(id);
            if let Some(ctx) = requests.remove(&id) {
                self.counters.failed.fetch_add(1, Ordering::Relaxed);
                ctx.fail(format!("{}: {err}", self.name));
            }
        }
        for id in out.finished {
            if let Some(ctx) = requests.remove(&id) {
                self.counters.finished.fetch_add(1, Ordering::Relaxed);
                // Done once every stage of the route has finished, not when the
                // last one has: a Talker can end its speech (its end code, its
                // frame budget) while the Thinker is still writing.
                if ctx.stage_finished() {
                    ctx.done();
                }
            }
        }
        self.counters
            .active
            .store(requests.len(), Ordering::Relaxed);
    }
}
