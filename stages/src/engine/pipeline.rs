//! The pipeline: stage workers joined by connectors, and request submission.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use super::connector::{in_process, ConnectorTx};
use super::payload::{Envelope, Payload, TextChunk};
use super::request::{Event, RequestCtx, RequestHandle, RequestInput, RequestSpec};
use super::stage::StageModel;
use super::worker::{StageCounters, Worker};
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

/// One stage to start: its model and the capacity of the connector into it.
pub struct StageDef {
    pub name: String,
    pub role: StageRole,
    pub model: Box<dyn StageModel>,
    pub input_capacity: usize,
}

/// A snapshot of one stage's counters.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct StageStats {
    pub name: String,
    /// Requests holding state in the stage now.
    pub active: usize,
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
}

#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct PipelineStats {
    pub stages: Vec<StageStats>,
    /// Requests submitted and not yet dropped by their client.
    pub requests_in_flight: u64,
    pub requests_submitted: u64,
}

pub struct Pipeline {
    names: Vec<String>,
    roles: Vec<StageRole>,
    inputs: Vec<Box<dyn ConnectorTx<Envelope>>>,
    counters: Vec<Arc<StageCounters>>,
    threads: Vec<JoinHandle<()>>,
    shutdown: Arc<AtomicBool>,
    next_id: AtomicU64,
    in_flight: Arc<AtomicU64>,
    event_capacity: usize,
    sample_rate: Option<u32>,
    voices: Vec<String>,
    thinker_hears: bool,
    speaks_text: bool,
}

/// Longest text a speech request may ask for (the OpenAI speech API's limit).
pub const MAX_SPEECH_CHARS: usize = 4096;

/// Events a client may have queued before it is considered too slow.
pub const DEFAULT_EVENT_CAPACITY: usize = 2048;

impl Pipeline {
    /// Starts one worker thread per stage, joined in order by in-process connectors.
    pub fn start(stages: Vec<StageDef>, sample_rate: Option<u32>) -> Result<Self, EngineError> {
        if stages.is_empty() {
            return Err(EngineError::BadRequest("a pipeline needs a stage".into()));
        }
        let shutdown = Arc::new(AtomicBool::new(false));
        let mut names = Vec::new();
        let mut roles = Vec::new();
        let mut inputs: Vec<Box<dyn ConnectorTx<Envelope>>> = Vec::new();
        let mut rxs = Vec::new();
        for s in &stages {
            let (tx, rx) = in_process::<Envelope>(s.input_capacity);
            inputs.push(Box::new(tx));
            rxs.push(rx);
            names.push(s.name.clone());
            roles.push(s.role);
        }
        let mut counters = Vec::new();
        let mut threads = Vec::new();
        for (index, (def, rx)) in stages.into_iter().zip(rxs).enumerate() {
            let c = Arc::new(StageCounters::default());
            counters.push(c.clone());
            let worker = Worker {
                index,
                name: def.name.clone(),
                model: def.model,
                rx: Box::new(rx),
                tx: inputs.get(index + 1).map(|t| t.boxed_clone()),
                counters: c,
                shutdown: shutdown.clone(),
            };
            let handle = std::thread::Builder::new()
                .name(format!("stage-{}", def.name))
                .spawn(move || worker.run())
                .map_err(|e| EngineError::BadRequest(format!("cannot start a worker: {e}")))?;
            threads.push(handle);
        }
        Ok(Self {
            names,
            roles,
            inputs,
            counters,
            threads,
            shutdown,
            next_id: AtomicU64::new(1),
            in_flight: Arc::new(AtomicU64::new(0)),
            event_capacity: DEFAULT_EVENT_CAPACITY,
            sample_rate,
            voices: Vec::new(),
            thinker_hears: false,
            speaks_text: true,
        })
    }

    /// The voices the Talker speaks with, the default first.
    pub fn voices(&self) -> &[String] {
        &self.voices
    }

    pub fn set_voices(&mut self, voices: Vec<String>) {
        self.voices = voices;
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
                if text.trim().is_empty() {
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
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = flume::bounded(self.event_capacity);
        let speech = match &spec.input {
            RequestInput::Speech { text } => Some(text.clone()),
            RequestInput::Chat { .. }
            | RequestInput::Heard { .. }
            | RequestInput::Transcribe { .. } => None,
        };
        let ctx = Arc::new(RequestCtx::new(id, spec, first, last, etx));
        let input = &self.inputs[first];
        input
            .send(Envelope {
                request: id,
                payload: Payload::Start(ctx.clone()),
            })
            .map_err(|_| EngineError::Closed)?;
        if let Some(text) = speech {
            // Speech input is the whole text at once.
            ctx.emit(Event::TextDelta(text.clone()));
            input
                .send(Envelope {
                    request: id,
                    payload: Payload::Text(TextChunk::text(text, Vec::new(), true)),
                })
                .map_err(|_| EngineError::Closed)?;
        }
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Ok(RequestHandle {
            ctx,
            events: erx,
            in_flight: self.in_flight.clone(),
        })
    }

    pub fn stats(&self) -> PipelineStats {
        let stages = self
            .names
            .iter()
            .zip(&self.counters)
            .map(|(name, c)| StageStats {
                name: name.clone(),
                active: c.active.load(Ordering::Relaxed),
                queue_depth: c.queue_depth.load(Ordering::Relaxed),
                steps: c.steps.load(Ordering::Relaxed),
                step_seconds_total: c.step_micros.load(Ordering::Relaxed) as f64 * 1e-6,
                batch_items_total: c.batch_items.load(Ordering::Relaxed),
                idle_seconds_total: c.idle_micros.load(Ordering::Relaxed) as f64 * 1e-6,
                finished: c.finished.load(Ordering::Relaxed),
                cancelled: c.cancelled.load(Ordering::Relaxed),
                failed: c.failed.load(Ordering::Relaxed),
                alive: c.alive.load(Ordering::Relaxed),
            })
            .collect();
        PipelineStats {
            stages,
            requests_in_flight: self.in_flight.load(Ordering::Relaxed),
            requests_submitted: self.next_id.load(Ordering::Relaxed) - 1,
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
