//! The pipeline: stage workers joined by connectors, and request submission.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::connector::in_process;
use super::payload::{Envelope, Payload, TextChunk};
use super::replica::{LocalReplica, LocalReplicas, StageInput};
use super::request::{
    Event, Outlet, RequestCtx, RequestHandle, RequestInput, RequestSpec, VoiceEncoder,
};
use super::stage::StageModel;
use super::worker::{self, StageCounters, Worker};
use super::EngineError;

/// What a stage consumes, which decides where each kind of request enters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageRole {
    /// Takes speech, produces its transcript (for Thinkers that cannot hear).
    Listener,
    /// Takes a conversation, produces text (and the Talker's conditioning).
    Thinker,
    /// Takes text, produces speech units.
    Talker,
    /// Takes speech units, produces audio.
    Code2Wav,
}

/// One stage to start: its replicas and where they run.
pub struct StageDef {
    pub name: String,
    pub role: StageRole,
    pub placement: StagePlacement,
}

/// Where a stage's replicas run.
pub enum StagePlacement {
    /// Worker threads of this process, one per model, each behind an
    /// in-process connector of `input_capacity` payloads.
    Local {
        replicas: Vec<Box<dyn StageModel>>,
        input_capacity: usize,
        /// Each replica's device (`cuda:1`), for the route's affinity; empty
        /// where it does not matter (one device, tests).
        devices: Vec<String>,
    },
    /// Elsewhere (the NATS connector's stage processes).
    Remote(Arc<dyn StageInput>),
}

impl StageDef {
    /// One local replica of `model`.
    pub fn local(
        name: impl Into<String>,
        role: StageRole,
        model: Box<dyn StageModel>,
        input_capacity: usize,
    ) -> Self {
        Self {
            name: name.into(),
            role,
            placement: StagePlacement::Local {
                replicas: vec![model],
                input_capacity,
                devices: Vec::new(),
            },
        }
    }
}

/// A snapshot of one stage's counters (of one replica, or summed over them).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct StageStats {
    pub name: String,
    /// The replica (`0`, `1`, ... in-process; the process's id for a remote
    /// one); empty for a sum over replicas.
    #[serde(default)]
    pub replica: String,
    /// Requests holding state in the stage now.
    pub active: usize,
    /// Bytes kept for later requests (the Thinker's prefix cache).
    #[serde(default)]
    pub cache_bytes: usize,
    /// Payloads waiting on the stage's input connector.
    pub queue_depth: usize,
    pub steps: u64,
    pub step_seconds_total: f64,
    /// Sum of batch sizes over all steps (mean batch = this / steps).
    pub batch_items_total: u64,
    /// Time the worker waited for input.
    pub idle_seconds_total: f64,
    pub finished: u64,
    pub cancelled: u64,
    pub failed: u64,
    pub alive: bool,
    /// A remote replica: payloads it took off the wire, their bytes, and the
    /// sum of their sender-to-receiver latencies.
    #[serde(default)]
    pub wire_messages_in: u64,
    #[serde(default)]
    pub wire_bytes_in: u64,
    #[serde(default)]
    pub wire_seconds_in_total: f64,
}

/// This process's traffic over NATS (a gateway with remote stages).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct WireStats {
    pub messages_out: u64,
    pub bytes_out: u64,
    /// Events from stage processes (text, audio, failures, stage finished).
    pub events_in: u64,
    pub event_bytes_in: u64,
    /// Sum of the events' sender-to-gateway latencies.
    pub event_seconds_total: f64,
}

impl StageStats {
    /// The sum over `replicas` of one stage; alive while any replica is.
    fn sum(name: &str, replicas: &[StageStats]) -> Self {
        let mut t = StageStats {
            name: name.to_string(),
            ..Default::default()
        };
        for r in replicas {
            t.active += r.active;
            t.cache_bytes += r.cache_bytes;
            t.queue_depth += r.queue_depth;
            t.steps += r.steps;
            t.step_seconds_total += r.step_seconds_total;
            t.batch_items_total += r.batch_items_total;
            t.idle_seconds_total += r.idle_seconds_total;
            t.finished += r.finished;
            t.cancelled += r.cancelled;
            t.failed += r.failed;
            t.alive |= r.alive;
            t.wire_messages_in += r.wire_messages_in;
            t.wire_bytes_in += r.wire_bytes_in;
            t.wire_seconds_in_total += r.wire_seconds_in_total;
        }
        t
    }
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PipelineStats {
    /// One entry per stage, summed over its replicas.
    pub stages: Vec<StageStats>,
    /// One entry per replica of every stage.
    pub replicas: Vec<StageStats>,
    /// Traffic over NATS, when some stage is remote.
    pub wire: Option<WireStats>,
    /// Requests submitted and not yet dropped by their client.
    pub requests_in_flight: u64,
    pub requests_submitted: u64,
}

pub struct Pipeline {
    names: Vec<String>,
    roles: Vec<StageRole>,
    inputs: Vec<Arc<dyn StageInput>>,
    threads: Vec<JoinHandle<()>>,
    shutdown: Arc<AtomicBool>,
    next_id: AtomicU64,
    first_id: u64,
    in_flight: Arc<AtomicU64>,
    event_capacity: usize,
    sample_rate: Option<u32>,
    voices: Vec<String>,
    languages: Vec<String>,
    voice_encoder: Option<Arc<dyn VoiceEncoder>>,
    thinker_hears: bool,
    speaks_text: bool,
}

/// Longest text a speech request may ask for (the OpenAI speech API's limit).
pub const MAX_SPEECH_CHARS: usize = 4096;

/// Events a client may have queued before it is considered too slow.
pub const DEFAULT_EVENT_CAPACITY: usize = 2048;

impl Pipeline {
    /// Starts one worker thread per local replica; each stage is reached
    /// through its [`StageInput`] (in-process connectors for local replicas).
    pub fn start(stages: Vec<StageDef>, sample_rate: Option<u32>) -> Result<Self, EngineError> {
        if stages.is_empty() {
            return Err(EngineError::BadRequest("a pipeline needs a stage".into()));
        }
        let shutdown = Arc::new(AtomicBool::new(false));
        let mut names = Vec::new();
        let mut roles = Vec::new();
        let mut inputs: Vec<Arc<dyn StageInput>> = Vec::new();
        // Per stage: its local workers still to start (model, receiver, counters).
        let mut pending = Vec::new();
        for s in stages {
            names.push(s.name.clone());
            roles.push(s.role);
            match s.placement {
                StagePlacement::Local {
                    replicas,
                    input_capacity,
                    devices,
                } => {
                    let mut ports = Vec::new();
                    let mut workers = Vec::new();
                    for model in replicas {
                        let (tx, rx) = in_process::<Envelope>(input_capacity);
                        let counters = Arc::new(StageCounters::default());
                        ports.push(LocalReplica {
                            tx: Box::new(tx),
                            counters: counters.clone(),
                        });
                        workers.push((model, rx, counters));
                    }
                    inputs.push(Arc::new(LocalReplicas::new(s.name, ports, devices)));
                    pending.push(workers);
                }
                StagePlacement::Remote(input) => {
                    inputs.push(input);
                    pending.push(Vec::new());
                }
            }
        }
        let mut threads = Vec::new();
        for (index, workers) in pending.into_iter().enumerate() {
            for (replica, (model, rx, counters)) in workers.into_iter().enumerate() {
                let worker = Worker {
                    index,
                    name: names[index].clone(),
                    model,
                    rx: Box::new(rx),
                    tx: inputs.get(index + 1).cloned(),
                    counters,
                    shutdown: shutdown.clone(),
                };
                let handle = worker::spawn(worker, replica)
                    .map_err(|e| EngineError::BadRequest(format!("cannot start a worker: {e}")))?;
                threads.push(handle);
            }
        }
        Ok(Self {
            names,
            roles,
            inputs,
            threads,
            shutdown,
            next_id: AtomicU64::new(1),
            first_id: 1,
            in_flight: Arc::new(AtomicU64::new(0)),
            event_capacity: DEFAULT_EVENT_CAPACITY,
            sample_rate,
            voices: Vec::new(),
            languages: Vec::new(),
            voice_encoder: None,
            thinker_hears: false,
            speaks_text: true,
        })
    }

    /// Request ids start at `first`: gateways that share stage processes give
    /// theirs distinct ranges, so an id names one request everywhere.
    pub fn set_first_request_id(&mut self, first: u64) {
        self.next_id = AtomicU64::new(first.max(1));
        self.first_id = first.max(1);
    }

    /// The voices the Talker speaks with, the default first.
    pub fn voices(&self) -> &[String] {
        &self.voices
    }

    pub fn set_voices(&mut self, voices: Vec<String>) {
        self.voices = voices;
    }

    /// The languages a request may ask the Talker for (empty: it takes none).
    pub fn languages(&self) -> &[String] {
        &self.languages
    }

    pub fn set_languages(&mut self, languages: Vec<String>) {
        self.languages = languages;
    }

    /// What clones voices from reference clips, where the Talker can (a
    /// Qwen3-TTS Base checkpoint loaded in this process).
    pub fn voice_encoder(&self) -> Option<&Arc<dyn VoiceEncoder>> {
        self.voice_encoder.as_ref()
    }

    pub fn set_voice_encoder(&mut self, encoder: Option<Arc<dyn VoiceEncoder>>) {
        self.voice_encoder = encoder;
    }

    /// Whether the Thinker takes speech itself ([`RequestInput::Heard`]).
    pub fn thinker_hears(&self) -> bool {
        self.thinker_hears
    }

    pub fn set_thinker_hears(&mut self, hears: bool) {
        self.thinker_hears = hears;
    }

    /// Whether the Talker speaks given text ([`RequestInput::Speech`]); a
    /// Qwen3-Omni Talker speaks only from its Thinker's states.
    pub fn speaks_text(&self) -> bool {
        self.speaks_text
    }

    pub fn set_speaks_text(&mut self, speaks: bool) {
        self.speaks_text = speaks;
    }

    /// Sample rate of the audio the last stage emits, if the pipeline speaks.
    pub fn sample_rate(&self) -> Option<u32> {
        self.sample_rate
    }

    pub fn stage_names(&self) -> &[String] {
        &self.names
    }

    pub fn has_role(&self, role: StageRole) -> bool {
        self.roles.contains(&role)
    }

    fn index_of(&self, role: StageRole) -> Option<usize> {
        self.roles.iter().position(|r| *r == role)
    }

    /// Sets how many events a client may leave unread before it is dropped as too slow.
    pub fn set_event_capacity(&mut self, n: usize) {
        self.event_capacity = n.max(8);
    }

    /// Starts a request. Its events arrive on the handle; dropping the handle
    /// cancels it in every stage.
    pub fn submit(&self, spec: RequestSpec) -> Result<RequestHandle, EngineError> {
        self.start_request(spec, false).map(|(h, _)| h)
    }

    /// Starts a speech request ([`RequestInput::Speech`]) whose text comes as
    /// it is written: its `text` (possibly empty) is the start, the rest goes
    /// through the returned [`TextFeed`], to a Talker that speaks text as it
    /// comes (Piper's, Qwen3-TTS's).
    pub fn submit_text_stream(
        &self,
        spec: RequestSpec,
    ) -> Result<(RequestHandle, TextFeed), EngineError> {
        match self.start_request(spec, true)? {
            (h, Some(feed)) => Ok((h, feed)),
            // start_request refused every other input already.
            (_, None) => Err(EngineError::BadRequest(
                "a text stream is a speech request".into(),
            )),
        }
    }

    fn start_request(
        &self,
        spec: RequestSpec,
        stream: bool,
    ) -> Result<(RequestHandle, Option<TextFeed>), EngineError> {
        if stream && !matches!(spec.input, RequestInput::Speech { .. }) {
            return Err(EngineError::BadRequest(
                "a text stream is a speech request".into(),
            ));
        }
        let first = match &spec.input {
            RequestInput::Chat { messages } => {
                if messages.is_empty() {
                    return Err(EngineError::BadRequest("no messages".into()));
                }
                self.index_of(StageRole::Thinker)
                    .ok_or_else(|| EngineError::BadRequest("this pipeline has no Thinker".into()))?
            }
            RequestInput::Heard { audio, .. } => {
                if audio.is_empty() {
                    return Err(EngineError::BadRequest(
                        "no audio in the spoken turn".into(),
                    ));
                }
                if !self.thinker_hears {
                    return Err(EngineError::BadRequest(
                        "this pipeline's Thinker does not hear audio; transcribe it first".into(),
                    ));
                }
                self.index_of(StageRole::Thinker)
                    .ok_or_else(|| EngineError::BadRequest("this pipeline has no Thinker".into()))?
            }
            RequestInput::Speech { text } => {
                if !self.speaks_text {
                    return Err(EngineError::BadRequest(
                        "this pipeline's Talker speaks the Thinker's answers, not given text: ask for audio from a chat instead".into(),
                    ));
                }
                if text.trim().is_empty() && !stream {
                    return Err(EngineError::BadRequest(
                        "nothing to say: the text is empty".into(),
                    ));
                }
                let n = text.chars().count();
                if n > MAX_SPEECH_CHARS {
                    return Err(EngineError::BadRequest(format!(
                        "the text is {n} characters; the limit is {MAX_SPEECH_CHARS}"
                    )));
                }
                self.index_of(StageRole::Talker)
            }
            .ok_or_else(|| EngineError::BadRequest("this pipeline cannot speak".into()))?,
            RequestInput::Transcribe { audio } => {
                if audio.is_empty() {
                    return Err(EngineError::BadRequest("no audio to transcribe".into()));
                }
                if spec.modalities.audio {
                    return Err(EngineError::BadRequest(
                        "a transcription produces text only".into(),
                    ));
                }
                self.index_of(StageRole::Listener).ok_or_else(|| {
                    EngineError::BadRequest("this pipeline has no speech recognition stage".into())
                })?
            }
        };
        let last = if spec.modalities.audio {
            self.index_of(StageRole::Code2Wav)
                .ok_or_else(|| EngineError::BadRequest("this pipeline cannot speak".into()))?
        } else {
            match spec.input {
                RequestInput::Chat { .. }
                | RequestInput::Heard { .. }
                | RequestInput::Transcribe { .. } => first,
                RequestInput::Speech { .. } => {
                    return Err(EngineError::BadRequest(
                        "speech requests produce audio".into(),
                    ))
                }
            }
        };
        // Each stage of the route picks its replica now, the least loaded
        // (of those on the previous stage's device, where it has some: whole
        // pipelines replicated a GPU each keep a request on one GPU); the
        // request stays on it for its whole life.
        let mut route = vec![0; self.inputs.len()];
        for i in first..=last {
            let near = match i > first {
                true => self.inputs[i - 1].device_of(route[i - 1]),
                false => None,
            };
            route[i] = self.inputs[i].pick_near(near.as_deref())?;
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = flume::bounded(self.event_capacity);
        let speech = match &spec.input {
            RequestInput::Speech { text } => Some(text.clone()),
            RequestInput::Chat { .. }
            | RequestInput::Heard { .. }
            | RequestInput::Transcribe { .. } => None,
        };
        let ctx = Arc::new(RequestCtx::new(
            id,
            spec,
            first,
            last,
            route,
            Outlet::Local(etx),
        ));
        for input in &self.inputs[first..=last] {
            input.admit(&ctx);
        }
        let input = &self.inputs[first];
        let replica = ctx.route[first];
        let gone = |_| {
            EngineError::Unavailable(format!("stage {}: its replica is gone", self.names[first]))
        };
        input
            .send(
                replica,
                Envelope {
                    request: id,
                    payload: Payload::Start(ctx.clone()),
                },
            )
            .map_err(gone)?;
        let feed = match (speech, stream) {
            // Speech input is the whole text at once.
            (Some(text), false) => {
                ctx.emit(Event::TextDelta(text.clone()));
                input
                    .send(
                        replica,
                        Envelope {
                            request: id,
                            payload: Payload::Text(TextChunk::text(text, Vec::new(), true)),
                        },
                    )
                    .map_err(gone)?;
                None
            }
            (text, true) => {
                let feed = TextFeed(Arc::new(FeedInner {
                    input: input.clone(),
                    replica,
                    ctx: ctx.clone(),
                    stage: self.names[first].clone(),
                    finished: AtomicBool::new(false),
                }));
                if let Some(t) = text.filter(|t| !t.is_empty()) {
                    feed.push(&t)?;
                }
                Some(feed)
            }
            (None, false) => None,
        };
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok((
            RequestHandle {
                ctx,
                events: erx,
                in_flight: self.in_flight.clone(),
            },
            feed,
        ))
    }

    pub fn stats(&self) -> PipelineStats {
        let mut stages = Vec::new();
        let mut replicas = Vec::new();
        for (name, input) in self.names.iter().zip(&self.inputs) {
            let r = input.stats();
            stages.push(StageStats::sum(name, &r));
            replicas.extend(r);
        }
        PipelineStats {
            stages,
            replicas,
            wire: self.inputs.iter().find_map(|i| i.wire()),
            requests_in_flight: self.in_flight.load(Ordering::Relaxed),
            requests_submitted: self.next_id.load(Ordering::Relaxed) - self.first_id,
        }
    }
}

/// The text of a speech request that comes as it is written
/// ([`Pipeline::submit_text_stream`]): each push goes to the Talker (and to the
/// client's events, as the transcript), `finish` ends the text, and dropping
/// the last clone ends it too, so a Talker never waits on a feed that is gone.
#[derive(Clone)]
pub struct TextFeed(Arc<FeedInner>);

struct FeedInner {
    input: Arc<dyn StageInput>,
    replica: super::ReplicaId,
    ctx: Arc<RequestCtx>,
    stage: String,
    finished: AtomicBool,
}

impl FeedInner {
    fn send(&self, text: String, finished: bool) -> Result<(), EngineError> {
        let env = Envelope {
            request: self.ctx.id,
            payload: Payload::Text(TextChunk::text(text, Vec::new(), finished)),
        };
        self.input.send(self.replica, env).map_err(|_| {
            EngineError::Unavailable(format!("stage {}: its replica is gone", self.stage))
        })
    }
}

impl TextFeed {
    /// More of the text. Blocks while the Talker's connector is full.
    pub fn push(&self, text: &str) -> Result<(), EngineError> {
        let f = &self.0;
        if f.finished.load(Ordering::Acquire) {
            return Err(EngineError::BadRequest(
                "the text is already finished".into(),
            ));
        }
        if f.ctx.is_cancelled() {
            return Err(EngineError::BadRequest("the request has ended".into()));
        }
        f.ctx.emit(Event::TextDelta(text.to_string()));
        f.send(text.to_string(), false)
    }

    /// The text is complete (again: nothing).
    pub fn finish(&self) -> Result<(), EngineError> {
        let f = &self.0;
        if f.finished.swap(true, Ordering::AcqRel) || f.ctx.is_cancelled() {
            return Ok(());
        }
        f.send(String::new(), true)
    }
}

impl Drop for FeedInner {
    fn drop(&mut self) {
        if !self.finished.swap(true, Ordering::AcqRel) && !self.ctx.is_cancelled() {
            let _ = self.send(String::new(), true);
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::Release);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
