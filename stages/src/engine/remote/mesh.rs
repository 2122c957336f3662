//! The NATS side: one connection per process, the registry of live replicas and
//! gateways, credit-windowed links to replicas, the requests this process owns
//! (a gateway) or holds (a stage process), and the hosted stage's input.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use candle_core::Device;
use dashmap::DashMap;
use futures_util::StreamExt;

use super::wire::{self, Announce, AnnounceRole, OwnerMsg, StageMeta, StageMsg, WireError};
use crate::engine::connector::{Closed, ConnectorRx};
use crate::engine::payload::{Envelope, Payload};
use crate::engine::pipeline::{StageStats, WireStats};
use crate::engine::replica::{least_loaded, ReplicaId, StageInput};
use crate::engine::request::{CancelReason, Outlet, RemoteOutlet, RequestCtx, RequestId, Usage};
use crate::engine::stage::StageModel;
use crate::engine::worker::{self, StageCounters, Worker};
use crate::engine::EngineError;

/// How often every process announces itself.
pub const HEARTBEAT: Duration = Duration::from_millis(500);
/// A replica not heard from for this long is dead: its requests fail with
/// `stage_unavailable` and new requests go elsewhere. With the monitor's period
/// a death is acted on within 1.75 s.
pub const DEAD_AFTER: Duration = Duration::from_millis(1500);
/// A gateway not heard from for this long has lost its requests: the stage
/// processes drop them.
const OWNER_DEAD_AFTER: Duration = Duration::from_secs(3);
const MONITOR: Duration = Duration::from_millis(250);
/// How often cancelled requests are looked for (a worker's idle poll).
const SWEEP: Duration = Duration::from_millis(5);
/// Outgoing messages queued for the connection before senders wait.
const OUTBOX: usize = 4096;
/// Cancelled ids remembered, so that a `Start` overtaken by its cancel is dropped.
const RECENT_CANCELS: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    #[error("cannot connect to NATS at {url}: {msg}")]
    Connect { url: String, msg: String },
    #[error("NATS subscribe to {subject}: {msg}")]
    Subscribe { subject: String, msg: String },
    #[error("no replica of stage {stage} announced itself within {secs} s (is `omnistream stage --stage {stage}` running against the same NATS server and profile?)")]
    NoReplica { stage: String, secs: u64 },
}

struct Outgoing {
    subject: String,
    reply: Option<String>,
    payload: Vec<u8>,
}

struct ReplicaEntry {
    stage: String,
    stage_index: usize,
    replica: u32,
    load: u64,
    /// Requests this process sent it since its last announcement.
    pending: u64,
    last_seen: Instant,
    /// Its connections lost, as announced ([`Announce::losses`]).
    losses: u32,
    stats: StageStats,
    meta: StageMeta,
}

/// A gateway as its announcements tell it.
#[derive(Clone, Copy)]
struct GatewaySeen {
    last_seen: Instant,
    /// See [`AnnounceRole::Gateway`].
    lost_through: RequestId,
}

/// A request this process owns (its gateway) or holds (a stage of it).
struct Tracked {
    ctx: Arc<RequestCtx>,
    owner: u64,
}

/// Credits towards one replica: payloads sent and not yet taken.
struct Link {
    subject: String,
    sent: Mutex<usize>,
    cv: Condvar,
    alive: AtomicBool,
}

/// What this process hosts, for its announcements.
struct HostedInfo {
    stage: String,
    stage_index: usize,
    replica: u32,
    counters: Arc<StageCounters>,
    queue: flume::Receiver<(Envelope, Option<String>)>,
    meta: StageMeta,
}

/// Messages, bytes and summed latency of one direction of traffic.
#[derive(Default)]
struct Hop {
    messages: AtomicU64,
    bytes: AtomicU64,
    micros: AtomicU64,
}

impl Hop {
    fn record(&self, bytes: usize, sent_micros: u64) {
        self.messages.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
        let lat = wire::now_micros().saturating_sub(sent_micros);
        self.micros.fetch_add(lat, Ordering::Relaxed);
    }
    fn seconds(&self) -> f64 {
        self.micros.load(Ordering::Relaxed) as f64 * 1e-6
    }
}

/// Ids recently cancelled (bounded).
#[derive(Default)]
struct RecentSet {
    set: HashSet<RequestId>,
    order: VecDeque<RequestId>,
}

impl RecentSet {
    fn insert(&mut self, id: RequestId) {
        if self.set.insert(id) {
            self.order.push_back(id);
            while self.order.len() > RECENT_CANCELS {
                if let Some(old) = self.order.pop_front() {
                    self.set.remove(&old);
                }
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One process's place on the NATS server.
pub struct Mesh {
    client: async_nats::Client,
    ns: String,
    process: u64,
    gateway: bool,
    out: flume::Sender<Outgoing>,
    replicas: Mutex<HashMap<u64, ReplicaEntry>>,
    gateways: Mutex<HashMap<u64, GatewaySeen>>,
    links: Mutex<HashMap<u64, Arc<Link>>>,
    requests: DashMap<RequestId, Tracked>,
    cancelled: Mutex<RecentSet>,
    /// Times this process lost its connection (announced).
    losses: AtomicU32,
    /// A gateway's: the highest id of its requests failed by a lost
    /// connection. Held while they fail, so that a request owned meanwhile
    /// is either failed with them or above it.
    lost_through: Mutex<RequestId>,
    hosted: Mutex<Option<HostedInfo>>,
    max_payload: AtomicUsize,
    /// Counts of messages refused (wrong version, corrupt), for the logs and tests.
    pub refused: AtomicUsize,
    /// The hosted replica's input payloads; a gateway's incoming events.
    inputs: Hop,
    events: Hop,
    out_messages: AtomicU64,
    out_bytes: AtomicU64,
}

impl Mesh {
    /// Connects to NATS at `url` (retrying for up to `wait`) as a gateway
    /// (`gateway`: owns requests) or a stage process, under the namespace of
    /// profile `profile_name`, and starts this process's tasks on the current
    /// tokio runtime.
    pub async fn connect(
        url: &str,
        profile_name: &str,
        gateway: bool,
        wait: Duration,
    ) -> Result<Arc<Self>, MeshError> {
        let (ev_tx, ev_rx) = flume::unbounded::<async_nats::Event>();
        let opts = || {
            let ev_tx = ev_tx.clone();
            async_nats::ConnectOptions::new()
                .name(if gateway {
                    "omnistream-gateway"
                } else {
                    "omnistream-stage"
                })
                .max_reconnects(None)
                // Back quickly after a NATS restart (the default backs off to seconds).
                .reconnect_delay_callback(|n| Duration::from_millis((n as u64 * 100).min(1000)))
                .event_callback(move |e| {
                    let ev_tx = ev_tx.clone();
                    async move {
                        let _ = ev_tx.send(e);
                    }
                })
        };
        let deadline = Instant::now() + wait;
        let client = loop {
            match opts().connect(url).await {
                Ok(c) => break c,
                Err(e) if Instant::now() >= deadline => {
                    return Err(MeshError::Connect {
                        url: url.to_string(),
                        msg: e.to_string(),
                    })
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        let ns: String = format!(
            "omnistream.{}",
            profile_name
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                    c
                } else {
                    '_'
                })
                .collect::<String>()
        );
        let (out, out_rx) = flume::bounded(OUTBOX);
        let max_payload = client.server_info().max_payload;
        let mesh = Arc::new(Self {
            client,
            ns,
            process: loop {
                let p = rand::random::<u64>();
                if p != 0 {
                    break p;
                }
            },
            gateway,
            out,
            replicas: Mutex::new(HashMap::new()),
            gateways: Mutex::new(HashMap::new()),
            links: Mutex::new(HashMap::new()),
            requests: DashMap::new(),
            cancelled: Mutex::new(RecentSet::default()),
            losses: AtomicU32::new(0),
            lost_through: Mutex::new(0),
            hosted: Mutex::new(None),
            max_payload: AtomicUsize::new(max_payload.max(1024)),
            refused: AtomicUsize::new(0),
            inputs: Hop::default(),
            events: Hop::default(),
            out_messages: AtomicU64::new(0),
            out_bytes: AtomicU64::new(0),
        });
        mesh.start_tasks(out_rx, ev_rx).await?;
        Ok(mesh)
    }

    /// This process's id (a hosted replica's [`ReplicaId`]).
    pub fn process(&self) -> u64 {
        self.process
    }

    fn subject(&self, what: &str, process: u64) -> String {
        format!("{}.{what}.{process:016x}", self.ns)
    }

    async fn subscribe(&self, subject: String) -> Result<async_nats::Subscriber, MeshError> {
        self.client
            .subscribe(subject.clone())
            .await
            .map_err(|e| MeshError::Subscribe {
                subject,
                msg: e.to_string(),
            })
    }

    async fn start_tasks(
        self: &Arc<Self>,
        out_rx: flume::Receiver<Outgoing>,
        ev_rx: flume::Receiver<async_nats::Event>,
    ) -> Result<(), MeshError> {
        // One ordered outbox: payloads and events of a request leave in the
        // order they were produced.
        let client = self.client.clone();
        tokio::spawn(async move {
            while let Ok(m) = out_rx.recv_async().await {
                let r = match m.reply {
                    Some(reply) => {
                        client
                            .publish_with_reply(m.subject, reply, Bytes::from(m.payload))
                            .await
                    }
                    None => client.publish(m.subject, Bytes::from(m.payload)).await,
                };
                if let Err(e) = r {
                    tracing::warn!("NATS publish: {e}");
                }
            }
        });
        let weak = Arc::downgrade(self);
        let subs = [
            (
                format!("{}.hb", self.ns),
                Self::on_announce as fn(&Self, async_nats::Message),
            ),
            (format!("{}.cancel", self.ns), Self::on_cancel),
            (self.subject("ev", self.process), Self::on_owner_msg),
            (self.subject("ack", self.process), Self::on_ack),
        ];
        for (subject, handler) in subs {
            let mut sub = self.subscribe(subject).await?;
            let weak = weak.clone();
            tokio::spawn(async move {
                while let Some(m) = sub.next().await {
                    let Some(mesh) = weak.upgrade() else { break };
                    handler(&mesh, m);
                }
            });
        }
        let w = weak.clone();
        tokio::spawn(async move {
            while let Ok(e) = ev_rx.recv_async().await {
                let Some(mesh) = w.upgrade() else { break };
                match e {
                    async_nats::Event::Disconnected => mesh.lost("lost the connection to NATS"),
                    // The client dropped messages a subscription could not
                    // take in time: an event, an ack or a payload of any
                    // request in flight may be gone, so none may wait on it.
                    async_nats::Event::SlowConsumer(_) => {
                        mesh.lost("this process fell behind NATS and lost messages (slow consumer)")
                    }
                    async_nats::Event::Connected => {
                        tracing::info!("NATS: connected");
                        mesh.max_payload.store(
                            mesh.client.server_info().max_payload.max(1024),
                            Ordering::Relaxed,
                        );
                    }
                    other => tracing::warn!("NATS: {other}"),
                }
            }
        });
        every(HEARTBEAT, weak.clone(), Self::announce);
        every(MONITOR, weak.clone(), Self::monitor);
        every(SWEEP, weak, Self::sweep);
        self.announce();
        Ok(())
    }

    /// Queues a message, waiting for room in the outbox: for the workers'
    /// threads, whose wait is the backpressure.
    fn push(&self, subject: String, reply: Option<String>, payload: Vec<u8>) {
        self.out_messages.fetch_add(1, Ordering::Relaxed);
        self.out_bytes
            .fetch_add(payload.len() as u64, Ordering::Relaxed);
        let _ = self.out.send(Outgoing {
            subject,
            reply,
            payload,
        });
    }

    /// Queues a message from an async task, which must not block a runtime
    /// thread: with the outbox full (NATS stalled or gone) the message is
    /// dropped and said so. What goes this way repeats (announcements) or
    /// costs only work (a lost cancel: the stage generates on for a request
    /// nobody reads, until it ends); a full outbox means NATS is stalled, and
    /// a disconnect or slow consumer fails what crossed it.
    fn push_from_task(&self, subject: String, reply: Option<String>, payload: Vec<u8>) {
        let len = payload.len() as u64;
        match self.out.try_send(Outgoing {
            subject,
            reply,
            payload,
        }) {
            Ok(()) => {
                self.out_messages.fetch_add(1, Ordering::Relaxed);
                self.out_bytes.fetch_add(len, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(
                "NATS outbox full ({OUTBOX} messages): dropped a message to {}",
                e.into_inner().subject
            ),
        }
    }

    fn announce(&self) {
        let role = match lock(&self.hosted).as_ref() {
            Some(h) => {
                let mut stats = h.counters.snapshot(&h.stage, &h.replica.to_string());
                stats.wire_messages_in = self.inputs.messages.load(Ordering::Relaxed);
                stats.wire_bytes_in = self.inputs.bytes.load(Ordering::Relaxed);
                stats.wire_seconds_in_total = self.inputs.seconds();
                AnnounceRole::Replica {
                    stage: h.stage.clone(),
                    stage_index: h.stage_index as u32,
                    replica: h.replica,
                    load: (stats.active + h.queue.len()) as u64,
                    stats: Box::new(stats),
                    meta: h.meta.clone(),
                }
            }
            None if self.gateway => AnnounceRole::Gateway {
                lost_through: *lock(&self.lost_through),
            },
            None => return,
        };
        let a = Announce {
            process: self.process,
            losses: self.losses.load(Ordering::Relaxed),
            role,
        };
        if let Ok(bytes) = wire::encode(0, self.process, &a) {
            self.push_from_task(format!("{}.hb", self.ns), None, bytes);
        }
    }

    fn on_announce(&self, m: async_nats::Message) {
        let a: Announce = match wire::decode(&m.payload) {
            Ok((_, a)) => a,
            Err(e) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                tracing::error!("NATS {}: refused an announcement: {e}", m.subject);
                return;
            }
        };
        match a.role {
            AnnounceRole::Gateway { lost_through } => {
                let before = lock(&self.gateways)
                    .insert(
                        a.process,
                        GatewaySeen {
                            last_seen: Instant::now(),
                            lost_through,
                        },
                    )
                    .map_or(0, |g| g.lost_through);
                if lost_through > before {
                    self.owner_lost(a.process, lost_through);
                }
            }
            AnnounceRole::Replica {
                stage,
                stage_index,
                replica,
                load,
                stats,
                meta,
            } => {
                let mut reps = lock(&self.replicas);
                // It lost its connection since we last heard it (too briefly
                // to be missed): what it held of ours is gone, as if it died.
                if reps.get(&a.process).is_some_and(|e| e.losses != a.losses) {
                    if let Some(old) = reps.remove(&a.process) {
                        drop(reps);
                        self.replica_gone(a.process, &old, "lost its connection to NATS");
                        reps = lock(&self.replicas);
                    }
                }
                let e = reps.entry(a.process).or_insert_with(|| {
                    tracing::info!(
                        "stage {stage} replica {replica} ({:016x}) joined",
                        a.process
                    );
                    ReplicaEntry {
                        stage: stage.clone(),
                        stage_index: stage_index as usize,
                        replica,
                        load,
                        pending: 0,
                        last_seen: Instant::now(),
                        losses: a.losses,
                        stats: (*stats).clone(),
                        meta: meta.clone(),
                    }
                });
                e.load = load;
                e.pending = 0;
                e.last_seen = Instant::now();
                e.stats = *stats;
                e.meta = meta;
            }
        }
    }

    /// Dead replicas and dead gateways: act on them.
    fn monitor(&self) {
        let now = Instant::now();
        let dead: Vec<(u64, ReplicaEntry)> = {
            let mut reps = lock(&self.replicas);
            let ids: Vec<u64> = reps
                .iter()
                .filter(|(_, e)| now.duration_since(e.last_seen) > DEAD_AFTER)
                .map(|(id, _)| *id)
                .collect();
            ids.into_iter()
                .filter_map(|id| reps.remove(&id).map(|e| (id, e)))
                .collect()
        };
        for (id, e) in dead {
            let why = format!(
                "stopped answering (no announcement for {} ms)",
                DEAD_AFTER.as_millis()
            );
            self.replica_gone(id, &e, &why);
        }
        if lock(&self.hosted).is_some() {
            let gws = lock(&self.gateways).clone();
            for t in self.requests.iter() {
                let alive = match gws.get(&t.owner) {
                    Some(g) => now.duration_since(g.last_seen) <= OWNER_DEAD_AFTER,
                    None => now.duration_since(t.ctx.created) <= OWNER_DEAD_AFTER,
                };
                if !alive && !t.ctx.is_cancelled() {
                    tracing::warn!("request {}: its gateway is gone; dropped", t.ctx.id);
                    t.ctx.cancel(CancelReason::Client);
                }
            }
            lock(&self.gateways)
                .retain(|_, g| now.duration_since(g.last_seen) <= OWNER_DEAD_AFTER * 4);
        }
    }

    /// Replica `id` (`e`) died or lost its connection (`why`): its link
    /// closes and the requests routed through it fail.
    fn replica_gone(&self, id: u64, e: &ReplicaEntry, why: &str) {
        tracing::error!(
            "stage {} replica {} ({id:016x}) {why}: its requests fail",
            e.stage,
            e.replica
        );
        let msg = format!(
            "stage_unavailable: stage {} replica {} {why}",
            e.stage, e.replica
        );
        if let Some(link) = lock(&self.links).remove(&id) {
            link.alive.store(false, Ordering::Release);
            link.cv.notify_all();
        }
        for t in self.requests.iter() {
            let c = &t.ctx;
            let on_it = (c.first_stage..=c.last_stage).contains(&e.stage_index)
                && c.route.get(e.stage_index) == Some(&id);
            if on_it && !c.is_cancelled() {
                c.fail(msg.clone());
            }
        }
    }

    /// Gateway `owner` failed its requests up to `lost_through` when it lost
    /// its connection: drop what this process holds of them.
    fn owner_lost(&self, owner: u64, lost_through: RequestId) {
        for t in self.requests.iter() {
            if t.owner == owner && t.ctx.id <= lost_through && !t.ctx.is_cancelled() {
                tracing::warn!(
                    "request {}: its gateway lost its connection to NATS; dropped",
                    t.ctx.id
                );
                t.ctx.cancel(CancelReason::Failed);
            }
        }
    }

    /// Cancelled requests leave the table; a gateway tells every stage process.
    fn sweep(&self) {
        let gone: Vec<(RequestId, u64)> = self
            .requests
            .iter()
            .filter(|t| t.ctx.is_cancelled())
            .map(|t| (*t.key(), t.owner))
            .collect();
        for (id, owner) in gone {
            self.requests.remove(&id);
            if owner == self.process {
                if let Ok(b) = wire::encode(id, self.process, &()) {
                    self.push_from_task(format!("{}.cancel", self.ns), None, b);
                }
            }
        }
    }

    fn on_cancel(&self, m: async_nats::Message) {
        let Ok(h) = wire::header(&m.payload) else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if h.owner == self.process {
            return; // our own
        }
        lock(&self.cancelled).insert(h.request);
        if let Some(t) = self.requests.get(&h.request) {
            t.ctx.cancel(CancelReason::Client);
        }
    }

    /// Messages were lost (`why`): every request crossing NATS fails (none
    /// waits on what will not come), and the links' credit windows start
    /// over from the replicas' next announcements.
    fn lost(&self, why: &str) {
        tracing::error!("NATS: {why}; requests that cross it fail");
        self.losses.fetch_add(1, Ordering::Relaxed);
        let mut lost_through = lock(&self.lost_through);
        for t in self.requests.iter() {
            if t.owner == self.process {
                t.ctx.fail(format!("stage_unavailable: {why}"));
                *lost_through = (*lost_through).max(t.ctx.id);
            } else {
                t.ctx.cancel(CancelReason::Failed);
            }
        }
        drop(lost_through);
        for (_, link) in lock(&self.links).drain() {
            link.alive.store(false, Ordering::Release);
            link.cv.notify_all();
        }
        lock(&self.replicas).clear();
    }

    /// Events from stage processes for a request this gateway owns.
    fn on_owner_msg(&self, m: async_nats::Message) {
        let h = match wire::header(&m.payload) {
            Ok(h) => h,
            Err(e) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                tracing::error!("NATS {}: refused a message: {e}", m.subject);
                return;
            }
        };
        self.events.record(m.payload.len(), h.sent_micros);
        let Some(ctx) = self.requests.get(&h.request).map(|t| t.ctx.clone()) else {
            return; // ended here already
        };
        let msg: OwnerMsg = match wire::decode(&m.payload) {
            Ok((_, msg)) => msg,
            Err(e) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                tracing::error!("request {}: refused an event: {e}", h.request);
                ctx.fail(format!(
                    "stage_unavailable: a stage sent a message this gateway cannot read: {e}"
                ));
                return;
            }
        };
        match msg {
            OwnerMsg::Failed(m) => ctx.fail(m),
            OwnerMsg::StageFinished { usage, .. } => {
                ctx.add_usage(usage);
                if ctx.stage_finished() {
                    ctx.done();
                    self.requests.remove(&h.request);
                }
            }
            other => match other.event() {
                Ok(Some(e)) => ctx.emit(e),
                Ok(None) => {}
                Err(e) => ctx.fail(format!("stage_unavailable: corrupt event: {e}")),
            },
        }
    }

    fn on_ack(&self, m: async_nats::Message) {
        let Ok((h, n)) = wire::decode::<u32>(&m.payload) else {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if let Some(link) = lock(&self.links).get(&h.owner) {
            let mut sent = lock(&link.sent);
            *sent = sent.saturating_sub(n as usize);
            link.cv.notify_all();
        }
    }

    /// One credit back to a payload's sender; `from_task`: not from a
    /// worker's thread (see [`Self::push_from_task`]).
    fn ack(&self, reply: Option<String>, from_task: bool) {
        if let Some(reply) = reply {
            if let Ok(b) = wire::encode(0, self.process, &1u32) {
                if from_task {
                    self.push_from_task(reply, None, b);
                } else {
                    self.push(reply, None, b);
                }
            }
        }
    }

    /// Sends `env` to replica `replica`, waiting for a credit (at most `window`
    /// unacknowledged). `Closed` once the replica is dead.
    fn send_to(&self, replica: u64, window: usize, env: Envelope) -> Result<(), Closed> {
        let link = {
            let mut links = lock(&self.links);
            match links.get(&replica) {
                Some(l) => l.clone(),
                None => {
                    if !lock(&self.replicas).contains_key(&replica) {
                        return Err(Closed);
                    }
                    let l = Arc::new(Link {
                        subject: self.subject("in", replica),
                        sent: Mutex::new(0),
                        cv: Condvar::new(),
                        alive: AtomicBool::new(true),
                    });
                    links.insert(replica, l.clone());
                    l
                }
            }
        };
        {
            let mut sent = lock(&link.sent);
            loop {
                if !link.alive.load(Ordering::Acquire) {
                    return Err(Closed);
                }
                if *sent < window.max(1) {
                    *sent += 1;
                    break;
                }
                sent = link
                    .cv
                    .wait_timeout(sent, Duration::from_millis(50))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        let id = env.request;
        let owner = self
            .requests
            .get(&id)
            .map(|t| t.owner)
            .unwrap_or(self.process);
        let fail = |msg: String| {
            let mut sent = lock(&link.sent);
            *sent = sent.saturating_sub(1);
            link.cv.notify_all();
            let ctx = match &env.payload {
                Payload::Start(ctx) => Some(ctx.clone()),
                _ => self.requests.get(&id).map(|t| t.ctx.clone()),
            };
            if let Some(ctx) = ctx {
                ctx.fail(msg);
            }
        };
        let bytes =
            match StageMsg::from_payload(&env.payload).and_then(|m| wire::encode(id, owner, &m)) {
                Ok(b) => b,
                Err(e) => {
                    fail(format!("cannot send to the next stage: {e}"));
                    return Ok(());
                }
            };
        let max = self.max_payload.load(Ordering::Relaxed);
        if bytes.len() > max {
            fail(format!(
                "a payload of {} bytes is over the NATS server's max_payload of {max} bytes: raise max_payload in the NATS configuration (deploy/distributed/nats.conf)",
                bytes.len()
            ));
            return Ok(());
        }
        self.push(
            link.subject.clone(),
            Some(self.subject("ack", self.process)),
            bytes,
        );
        Ok(())
    }

    /// Starts tracking a request this gateway owns (its route crosses the wire).
    fn own(&self, ctx: &Arc<RequestCtx>) {
        let lost_through = lock(&self.lost_through);
        self.requests.entry(ctx.id).or_insert_with(|| Tracked {
            ctx: ctx.clone(),
            owner: self.process,
        });
        if ctx.id <= *lost_through {
            // Submitted before a loss, owned after it: the stage processes
            // refuse it (see `AnnounceRole::Gateway`).
            ctx.fail("stage_unavailable: lost the connection to NATS".to_string());
        }
    }

    /// Waits until stage `index` has a live replica; its announced meta.
    pub async fn wait_for_stage(
        &self,
        index: usize,
        name: &str,
        wait: Duration,
    ) -> Result<StageMeta, MeshError> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(m) = lock(&self.replicas)
                .values()
                .find(|e| e.stage_index == index)
                .map(|e| e.meta.clone())
            {
                return Ok(m);
            }
            if Instant::now() >= deadline {
                return Err(MeshError::NoReplica {
                    stage: name.to_string(),
                    secs: wait.as_secs(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A stage process stopping (SIGTERM): its requests fail now with `msg`,
    /// rather than when its announcements are missed; waits briefly for the
    /// outbox to drain.
    pub async fn stop_hosted(&self, msg: &str) {
        for t in self.requests.iter() {
            if t.owner != self.process && !t.ctx.is_cancelled() {
                t.ctx.fail(msg.to_string());
            }
        }
        *lock(&self.hosted) = None;
        let deadline = Instant::now() + Duration::from_secs(2);
        while !self.out.is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let _ = self.client.flush().await;
    }

    /// This process's traffic so far.
    pub fn wire_stats(&self) -> WireStats {
        WireStats {
            messages_out: self.out_messages.load(Ordering::Relaxed),
            bytes_out: self.out_bytes.load(Ordering::Relaxed),
            events_in: self.events.messages.load(Ordering::Relaxed),
            event_bytes_in: self.events.bytes.load(Ordering::Relaxed),
            event_seconds_total: self.events.seconds(),
        }
    }

    /// Hosts one replica of a stage: subscribes to its input and starts its
    /// worker. Returns the worker's thread; it ends once `shutdown` is set.
    pub async fn host(
        self: &Arc<Self>,
        stage: HostedStage,
    ) -> Result<std::thread::JoinHandle<()>, MeshError> {
        let (qtx, qrx) = flume::bounded::<(Envelope, Option<String>)>(stage.queue_capacity.max(1));
        let counters = Arc::new(StageCounters::default());
        *lock(&self.hosted) = Some(HostedInfo {
            stage: stage.name.clone(),
            stage_index: stage.index,
            replica: stage.replica,
            counters: counters.clone(),
            queue: qrx.clone(),
            meta: stage.meta.clone(),
        });
        let mut sub = self.subscribe(self.subject("in", self.process)).await?;
        let weak = Arc::downgrade(self);
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                let Some(mesh) = weak.upgrade() else { break };
                mesh.on_input(m, &qtx);
            }
        });
        let worker = Worker {
            index: stage.index,
            name: stage.name.clone(),
            model: stage.model,
            rx: Box::new(NatsRx {
                rx: qrx,
                mesh: Arc::downgrade(self),
                device: stage.device.clone(),
            }),
            tx: stage.next,
            counters,
            shutdown: stage.shutdown,
        };
        let handle =
            worker::spawn(worker, stage.replica as usize).map_err(|e| MeshError::Subscribe {
                subject: "worker".into(),
                msg: e.to_string(),
            })?;
        self.announce();
        Ok(handle)
    }

    /// A payload for the hosted replica.
    fn on_input(
        self: &Arc<Self>,
        m: async_nats::Message,
        queue: &flume::Sender<(Envelope, Option<String>)>,
    ) {
        let reply = m.reply.as_ref().map(|r| r.to_string());
        let refuse = |h: Option<wire::Header>, e: WireError| {
            self.refused.fetch_add(1, Ordering::Relaxed);
            tracing::error!("NATS {}: refused a payload: {e}", m.subject);
            self.ack(reply.clone(), true);
            // Tell the owner, so the request fails rather than waits.
            if let Some(h) = h.filter(|h| h.owner != 0) {
                if let Some(t) = self.requests.get(&h.request) {
                    t.ctx.cancel(CancelReason::Failed);
                }
                let msg = OwnerMsg::Failed(format!("stage refused a payload: {e}"));
                if let Ok(b) = wire::encode(h.request, h.owner, &msg) {
                    self.push_from_task(self.subject("ev", h.owner), None, b);
                }
            }
        };
        let h = match wire::header(&m.payload) {
            Ok(h) => h,
            Err(e) => return refuse(None, e),
        };
        self.inputs.record(m.payload.len(), h.sent_micros);
        let msg: StageMsg = match wire::decode(&m.payload) {
            Ok((_, msg)) => msg,
            Err(e) => return refuse(Some(h), e),
        };
        if lock(&self.hosted).is_none() {
            return;
        }
        let payload = match msg {
            StageMsg::Start(start) => {
                let owner_lost = lock(&self.gateways)
                    .get(&h.owner)
                    .is_some_and(|g| h.request <= g.lost_through);
                if owner_lost || lock(&self.cancelled).set.contains(&h.request) {
                    self.ack(reply, true);
                    return;
                }
                let spec = match start.spec() {
                    Ok(s) => s,
                    Err(e) => return refuse(Some(h), e),
                };
                let stage = lock(&self.hosted)
                    .as_ref()
                    .map(|x| x.stage_index)
                    .unwrap_or(0);
                let outlet = Arc::new(OwnerOutlet {
                    mesh: Arc::downgrade(self),
                    owner: h.owner,
                    stage,
                });
                let ctx = Arc::new(RequestCtx::new(
                    h.request,
                    spec,
                    start.first_stage as usize,
                    start.last_stage as usize,
                    start.route,
                    Outlet::Remote(outlet),
                ));
                self.requests.insert(
                    h.request,
                    Tracked {
                        ctx: ctx.clone(),
                        owner: h.owner,
                    },
                );
                Payload::Start(ctx)
            }
            // Onto the device on the worker's thread (`NatsRx`), not this task's.
            other => match other.into_payload(&Device::Cpu) {
                Ok(p) => p,
                Err(e) => return refuse(Some(h), e),
            },
        };
        let env = Envelope {
            request: h.request,
            payload,
        };
        if queue.try_send((env, reply.clone())).is_err() {
            // Senders hold at most their window unacknowledged, so this means
            // more upstream processes than the queue was sized for.
            refuse(
                Some(h),
                WireError::Decode("the stage's input queue is full".into()),
            );
        }
    }
}

/// Runs `f` on the mesh every `period` while it lives (a late tick is delayed,
/// not bunched up).
fn every(period: Duration, mesh: Weak<Mesh>, f: fn(&Mesh)) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Some(mesh) = mesh.upgrade() else { break };
            f(&mesh);
        }
    });
}

/// One replica for [`Mesh::host`].
pub struct HostedStage {
    pub name: String,
    pub index: usize,
    pub replica: u32,
    pub model: Box<dyn StageModel>,
    pub meta: StageMeta,
    /// Where the Thinker's states go as the worker takes them.
    pub device: Device,
    /// Payloads held before the worker takes them (≥ the upstream's window
    /// times the upstream processes).
    pub queue_capacity: usize,
    /// The next stage of the pipeline (over NATS), if any.
    pub next: Option<Arc<dyn StageInput>>,
    pub shutdown: Arc<AtomicBool>,
}

/// The hosted replica's input connector: the queue filled from NATS; each
/// payload taken returns a credit to its sender.
struct NatsRx {
    rx: flume::Receiver<(Envelope, Option<String>)>,
    mesh: Weak<Mesh>,
    /// The replica's device: the Thinker's states go there as they are taken.
    device: Device,
}

impl NatsRx {
    fn taken(&self, (env, reply): (Envelope, Option<String>)) -> Envelope {
        let mesh = self.mesh.upgrade();
        if let Some(m) = &mesh {
            m.ack(reply, false);
        }
        let request = env.request;
        match env.payload.states_to(&self.device) {
            Ok(payload) => Envelope { request, payload },
            Err(e) => {
                // The request cannot go on here; the worker drops what follows.
                if let Some(t) = mesh
                    .as_ref()
                    .and_then(|m| m.requests.get(&request).map(|t| t.ctx.clone()))
                {
                    t.fail(format!(
                        "stage_unavailable: moving the Thinker's states to the device: {e}"
                    ));
                }
                Envelope {
                    request,
                    payload: Payload::Text(crate::engine::payload::TextChunk {
                        text: String::new(),
                        token_ids: Vec::new(),
                        finished: true,
                        states: None,
                    }),
                }
            }
        }
    }
}

impl ConnectorRx<Envelope> for NatsRx {
    fn recv_timeout(&self, timeout: Duration) -> Result<Option<Envelope>, Closed> {
        match self.rx.recv_timeout(timeout) {
            Ok(v) => Ok(Some(self.taken(v))),
            Err(flume::RecvTimeoutError::Timeout) => Ok(None),
            Err(flume::RecvTimeoutError::Disconnected) => Err(Closed),
        }
    }
    fn try_recv(&self) -> Result<Option<Envelope>, Closed> {
        match self.rx.try_recv() {
            Ok(v) => Ok(Some(self.taken(v))),
            Err(flume::TryRecvError::Empty) => Ok(None),
            Err(flume::TryRecvError::Disconnected) => Err(Closed),
        }
    }
    fn len(&self) -> usize {
        self.rx.len()
    }
}

/// A held request's way back to its gateway.
struct OwnerOutlet {
    mesh: Weak<Mesh>,
    owner: u64,
    stage: usize,
}

impl OwnerOutlet {
    fn send(&self, ctx: &RequestCtx, msg: OwnerMsg) {
        let Some(mesh) = self.mesh.upgrade() else {
            return;
        };
        match wire::encode(ctx.id, self.owner, &msg) {
            Ok(b) => mesh.push(mesh.subject("ev", self.owner), None, b),
            Err(e) => tracing::error!("request {}: cannot encode an event: {e}", ctx.id),
        }
    }
}

impl RemoteOutlet for OwnerOutlet {
    fn event(&self, ctx: &RequestCtx, event: crate::engine::Event) {
        if let Some(m) = OwnerMsg::from_event(event) {
            self.send(ctx, m);
        }
    }
    fn fail(&self, ctx: &RequestCtx, msg: String) {
        self.send(ctx, OwnerMsg::Failed(msg));
    }
    fn stage_finished(&self, ctx: &RequestCtx, usage: Usage) {
        self.send(
            ctx,
            OwnerMsg::StageFinished {
                stage: self.stage as u32,
                usage,
            },
        );
        if let Some(mesh) = self.mesh.upgrade() {
            mesh.requests.remove(&ctx.id);
        }
    }
}

/// A stage whose replicas are other processes, as the engine sees it.
pub struct RemoteStage {
    mesh: Arc<Mesh>,
    index: usize,
    name: String,
    /// Unacknowledged payloads per replica (the connector's `capacity`).
    window: usize,
    next: AtomicUsize,
}

impl RemoteStage {
    pub fn new(mesh: Arc<Mesh>, index: usize, name: impl Into<String>, window: usize) -> Self {
        Self {
            mesh,
            index,
            name: name.into(),
            window,
            next: AtomicUsize::new(0),
        }
    }
}

impl StageInput for RemoteStage {
    fn pick(&self) -> Result<ReplicaId, EngineError> {
        let mut reps = lock(&self.mesh.replicas);
        let mut ids: Vec<u64> = reps
            .iter()
            .filter(|(_, e)| e.stage_index == self.index)
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        let loads: Vec<usize> = ids
            .iter()
            .map(|id| {
                reps.get(id)
                    .map(|e| (e.load + e.pending) as usize)
                    .unwrap_or(usize::MAX)
            })
            .collect();
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        let i = least_loaded(&loads, start).ok_or_else(|| {
            EngineError::Unavailable(format!("stage {} has no live replica", self.name))
        })?;
        let id = ids[i];
        if let Some(e) = reps.get_mut(&id) {
            e.pending += 1;
        }
        Ok(id)
    }

    fn send(&self, replica: ReplicaId, env: Envelope) -> Result<(), Closed> {
        self.mesh.send_to(replica, self.window, env)
    }

    fn admit(&self, ctx: &Arc<RequestCtx>) {
        self.mesh.own(ctx);
    }

    fn wire(&self) -> Option<WireStats> {
        Some(self.mesh.wire_stats())
    }

    fn stats(&self) -> Vec<StageStats> {
        let reps = lock(&self.mesh.replicas);
        let mut v: Vec<StageStats> = reps
            .iter()
            .filter(|(_, e)| e.stage_index == self.index)
            .map(|(id, e)| StageStats {
                name: self.name.clone(),
                replica: format!("{}/{id:016x}", e.replica),
                alive: true,
                ..e.stats.clone()
            })
            .collect();
        v.sort_by(|a, b| a.replica.cmp(&b.replica));
        if v.is_empty() {
            // Shown as a dead stage rather than no stage at all.
            v.push(StageStats {
                name: self.name.clone(),
                replica: "none".into(),
                ..Default::default()
            });
        }
        v
    }
}
