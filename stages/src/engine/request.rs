//! Requests: what a client asks for, its per-request context shared by every
//! stage, and the events it gets back.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::tools::{ToolCall, Tools};

/// Who speaks a chat turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool's result (OpenAI's `tool` role).
    Tool,
}

impl Role {
    /// As chat templates and the OpenAI APIs spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }

    /// `system`, `user`, `assistant` or `tool`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "system" => Some(Self::System),
            "user" => Some(Self::User),
            "assistant" => Some(Self::Assistant),
            "tool" => Some(Self::Tool),
            _ => None,
        }
    }
}

/// One chat turn, as chat templates expect it (`message['role']`,
/// `message['content']`, `message['tool_calls']`, `message['tool_call_id']`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    /// The calls an assistant turn made (empty: none).
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
    /// For a [`Role::Tool`] turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
    /// A tool's result for call `call_id`.
    pub fn tool(call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            tool_call_id: Some(call_id.into()),
            ..Self::new(Role::Tool, content)
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
}

pub type RequestId = u64;

/// Which outputs a request wants; it decides how far down the pipeline it goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Modalities {
    pub text: bool,
    pub audio: bool,
}

impl Modalities {
    pub const TEXT: Self = Self {
        text: true,
        audio: false,
    };
    pub const TEXT_AUDIO: Self = Self {
        text: true,
        audio: true,
    };

    /// From OpenAI-style names (`["text"]`, `["text", "audio"]`, `["audio"]`).
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Self, String> {
        let mut m = Self {
            text: false,
            audio: false,
        };
        for n in names {
            match n.as_ref() {
                "text" => m.text = true,
                "audio" => m.audio = true,
                other => return Err(format!("unknown modality {other:?}")),
            }
        }
        if !m.text && !m.audio {
            return Err("modalities must not be empty".into());
        }
        // Audio is spoken text: the text is always produced (it is the transcript).
        m.text = true;
        Ok(m)
    }
}

/// What goes into the first stage of the request's route.
#[derive(Debug, Clone)]
pub enum RequestInput {
    /// A conversation for the Thinker.
    Chat { messages: Vec<ChatMessage> },
    /// Text to speak as it is (skips the Thinker).
    Speech { text: String },
    /// A conversation whose last user turn is speech (mono f32 at
    /// [`TRANSCRIBE_RATE`]), for a Thinker that hears (Qwen3-Omni's audio encoder).
    Heard {
        messages: Vec<ChatMessage>,
        audio: Arc<[f32]>,
    },
    /// Speech to transcribe: mono f32 at [`TRANSCRIBE_RATE`]. Goes to the
    /// Listener stage only; the transcript comes back as text deltas.
    Transcribe { audio: Arc<[f32]> },
}

/// The sample rate of [`RequestInput::Transcribe`] audio.
pub const TRANSCRIBE_RATE: u32 = 16_000;

/// Per-request sampling overrides; `None` keeps the stage default.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SamplingOverrides {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub max_tokens: Option<usize>,
    pub seed: Option<u64>,
    /// Generate exactly `max_tokens` (benchmarks: equal work across configs).
    pub ignore_eos: bool,
    /// With `ignore_eos`, a frame-by-frame Talker speaks exactly this many
    /// frames: the text's vectors, then `tts_eos` and `tts_pad` as the reference
    /// goes on past the text until its end code (benchmarks: speech at a set
    /// pace, where random weights never draw that code). `None`: one frame per
    /// text vector.
    #[serde(default)]
    pub audio_frames: Option<usize>,
    /// Speech speed (1.0 = the voice's natural pace).
    pub speed: Option<f32>,
}

#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub input: RequestInput,
    pub modalities: Modalities,
    pub sampling: SamplingOverrides,
    pub voice: Option<String>,
    /// Functions the Thinker may call (`None`: none, and its answer is not
    /// searched for calls).
    pub tools: Option<Arc<Tools>>,
    /// How to speak, beyond the voice (a Talker that takes instructions).
    pub style: SpeechStyle,
}

/// How a request is to be spoken, beyond the voice (Qwen3-TTS's Talker; others
/// ignore it).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SpeechStyle {
    /// How to speak (CustomVoice), or the voice itself (VoiceDesign).
    pub instructions: Option<String>,
    /// The language to speak; unset is "auto".
    pub language: Option<String>,
    /// A cloned voice: the speaker embedding of a reference clip (Qwen3-TTS
    /// Base's x-vector), spoken in place of a preset `voice`.
    pub speaker_embedding: Option<Vec<f32>>,
    /// In-context cloning (with `speaker_embedding`): the clip's codes and
    /// transcript, which the speech continues.
    #[serde(default)]
    pub reference: Option<VoiceReference>,
}

/// A reference clip as in-context cloning takes it (Qwen3-TTS Base's
/// `ref_code` and `ref_text`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VoiceReference {
    /// What the clip says.
    pub text: String,
    /// The speech tokenizer's codes of the clip: one row of code groups a frame.
    pub codes: Vec<Vec<u32>>,
}

/// A reference clip for [`VoiceEncoder::encode`]: mono PCM in [-1, 1] at
/// [`VoiceEncoder::sample_rate`].
#[derive(Debug, Clone, Copy)]
pub struct VoiceClip<'a> {
    pub pcm: &'a [f32],
    /// Also its codes, for in-context cloning ([`VoiceEncoder::in_context`]).
    pub in_context: bool,
}

/// A clip as [`VoiceEncoder::encode`] makes it.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedVoice {
    /// The speaker embedding (x-vector) a Talker clones the voice from.
    pub embedding: Vec<f32>,
    /// The speech tokenizer's codes, one row a frame
    /// ([`VoiceReference::codes`]), for a clip asked `in_context`.
    pub codes: Option<Vec<Vec<u32>>>,
}

/// Where a batch of [`VoiceEncoder::encode`] spent its time.
#[derive(Debug, Clone, Copy, Default)]
pub struct EncodeTimes {
    /// The speaker embeddings.
    pub speaker: std::time::Duration,
    /// The codes (zero when no clip asked for them).
    pub codes: std::time::Duration,
}

/// Turns reference clips into what a Talker clones a voice from (Qwen3-TTS
/// Base's speaker encoder, and its speech tokenizer's encoder), for the
/// server's voice registry and `ref_audio`.
pub trait VoiceEncoder: Send + Sync {
    /// The rate of the PCM [`Self::encode`] takes.
    fn sample_rate(&self) -> u32;
    /// The shortest clip it takes, in samples.
    fn min_samples(&self) -> usize;
    /// Whether it also makes a clip's codes: in-context cloning (the
    /// checkpoint's speech tokenizer has its encoder).
    fn in_context(&self) -> bool;
    /// Several clips at once, each encoded as it would be alone; the results
    /// in the clips' order. One bad clip fails the call.
    fn encode(
        &self,
        clips: &[VoiceClip<'_>],
    ) -> Result<(Vec<EncodedVoice>, EncodeTimes), crate::models::ModelError>;
}

/// Why a request stopped early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum CancelReason {
    None = 0,
    /// The client cancelled or went away.
    Client = 1,
    /// The client could not keep up with its own output queue.
    SlowClient = 2,
    /// A stage failed on this request.
    Failed = 3,
}

/// What a client receives, in order.
#[derive(Debug, Clone)]
pub enum Event {
    /// Generated text (also the transcript of the audio that follows).
    TextDelta(String),
    /// A complete function call of the answer (never spoken).
    ToolCall(ToolCall),
    /// Mono f32 PCM in [-1, 1], as Code2Wav emitted it. `seq` counts chunks.
    Audio {
        samples: Vec<f32>,
        sample_rate: u32,
        seq: u64,
    },
    /// The request completed normally.
    Done {
        prompt_tokens: usize,
        /// Prompt tokens whose KV came from the prefix cache.
        cached_tokens: usize,
        completion_tokens: usize,
    },
    /// The request failed or was cancelled by the engine; nothing follows.
    Error(String),
}

/// Slots of a client's event queue kept free for the terminal event.
const RESERVED_SLOTS: usize = 4;

/// Where a request's events go: straight to its client's queue, or, in a stage
/// process, back over the wire to the gateway that owns the request.
pub(crate) enum Outlet {
    Local(flume::Sender<Event>),
    Remote(Arc<dyn RemoteOutlet>),
}

/// Token counts a stage gathered for a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub completion_tokens: u64,
}

/// The owner's side of a request, seen from a stage process.
pub trait RemoteOutlet: Send + Sync {
    fn event(&self, ctx: &RequestCtx, event: Event);
    fn fail(&self, ctx: &RequestCtx, msg: String);
    /// The stage finished the request; `usage` is what it counted.
    fn stage_finished(&self, ctx: &RequestCtx, usage: Usage);
}

/// A request's context, shared by every stage that works on it.
pub struct RequestCtx {
    pub id: RequestId,
    pub spec: RequestSpec,
    pub created: Instant,
    /// Index of the first and last stage on this request's route.
    pub first_stage: usize,
    pub last_stage: usize,
    /// For each stage of the pipeline, the replica that holds this request
    /// (meaningful from `first_stage` to `last_stage`).
    pub route: Vec<super::ReplicaId>,
    /// Stages of the route that have not finished the request yet.
    stages_left: AtomicUsize,
    cancelled: AtomicBool,
    reason: AtomicU8,
    outlet: Outlet,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    completion_tokens: AtomicU64,
}

impl RequestCtx {
    /// A request held by one stage of a test, its events on the receiver.
    #[cfg(test)]
    pub(crate) fn for_test(id: RequestId, spec: RequestSpec) -> (Self, flume::Receiver<Event>) {
        let (tx, rx) = flume::unbounded();
        (Self::new(id, spec, 0, 0, vec![0], Outlet::Local(tx)), rx)
    }

    pub(crate) fn new(
        id: RequestId,
        spec: RequestSpec,
        first_stage: usize,
        last_stage: usize,
        route: Vec<super::ReplicaId>,
        outlet: Outlet,
    ) -> Self {
        Self {
            id,
            spec,
            created: Instant::now(),
            first_stage,
            last_stage,
            route,
            stages_left: AtomicUsize::new(last_stage.saturating_sub(first_stage) + 1),
            cancelled: AtomicBool::new(false),
            reason: AtomicU8::new(CancelReason::None as u8),
            outlet,
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    pub fn cancel(&self, reason: CancelReason) {
        let _ = self.reason.compare_exchange(
            CancelReason::None as u8,
            reason as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.cancelled.store(true, Ordering::Release);
    }

    pub fn cancel_reason(&self) -> CancelReason {
        match self.reason.load(Ordering::Acquire) {
            1 => CancelReason::Client,
            2 => CancelReason::SlowClient,
            3 => CancelReason::Failed,
            _ => CancelReason::None,
        }
    }

    /// Queues an event for the client without ever blocking the stage: a client
    /// whose queue is full is too slow for real time, so its request is cancelled.
    pub fn emit(&self, event: Event) {
        if self.is_cancelled() {
            return;
        }
        let events = match &self.outlet {
            Outlet::Local(events) => events,
            // The owner applies its client's limits when the event arrives.
            Outlet::Remote(r) => return r.event(self, event),
        };
        // The last few slots are kept for the terminal error, so a slow client
        // still learns why its request ended once it catches up.
        let cap = events.capacity().unwrap_or(usize::MAX);
        let terminal = matches!(event, Event::Done { .. } | Event::Error(_));
        if !terminal && events.len() + RESERVED_SLOTS >= cap {
            self.cancel(CancelReason::SlowClient);
            let _ = events.try_send(Event::Error(
                "client too slow: output queue full, request dropped".into(),
            ));
            return;
        }
        match events.try_send(event) {
            Ok(()) => {}
            Err(flume::TrySendError::Full(_)) => self.cancel(CancelReason::SlowClient),
            Err(flume::TrySendError::Disconnected(_)) => self.cancel(CancelReason::Client),
        }
    }

    /// Fails the request: the client gets the error; every stage drops it.
    pub fn fail(&self, msg: String) {
        if !self.is_cancelled() {
            match &self.outlet {
                Outlet::Local(events) => {
                    let _ = events.try_send(Event::Error(msg));
                }
                Outlet::Remote(r) => r.fail(self, msg),
            }
        }
        self.cancel(CancelReason::Failed);
    }

    pub fn set_prompt_tokens(&self, n: usize) {
        self.prompt_tokens.store(n as u64, Ordering::Relaxed);
    }
    pub fn set_cached_tokens(&self, n: usize) {
        self.cached_tokens.store(n as u64, Ordering::Relaxed);
    }
    pub fn add_completion_tokens(&self, n: usize) {
        self.completion_tokens
            .fetch_add(n as u64, Ordering::Relaxed);
    }
    /// Adds what a stage in another process counted (the owner's side).
    pub fn add_usage(&self, u: Usage) {
        if u.prompt_tokens > 0 {
            self.prompt_tokens.store(u.prompt_tokens, Ordering::Relaxed);
        }
        if u.cached_tokens > 0 {
            self.cached_tokens.store(u.cached_tokens, Ordering::Relaxed);
        }
        self.completion_tokens
            .fetch_add(u.completion_tokens, Ordering::Relaxed);
    }

    fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens.load(Ordering::Relaxed),
            cached_tokens: self.cached_tokens.load(Ordering::Relaxed),
            completion_tokens: self.completion_tokens.load(Ordering::Relaxed),
        }
    }

    /// Records that one stage of the route has finished the request; true for
    /// the last one to (whichever stage that is), which ends it with [`Self::done`].
    /// In a stage process the owner keeps that count: this tells it, and is false.
    pub fn stage_finished(&self) -> bool {
        if let Outlet::Remote(r) = &self.outlet {
            r.stage_finished(self, self.usage());
            return false;
        }
        self.stages_left.fetch_sub(1, Ordering::AcqRel) == 1
    }

    /// Emits `Done` with the token counts gathered on the way.
    pub fn done(&self) {
        let u = self.usage();
        self.emit(Event::Done {
            prompt_tokens: u.prompt_tokens as usize,
            cached_tokens: u.cached_tokens as usize,
            completion_tokens: u.completion_tokens as usize,
        });
    }
}

/// The client's end of a request. Dropping it cancels the request in every stage.
pub struct RequestHandle {
    pub(crate) ctx: Arc<RequestCtx>,
    pub(crate) events: flume::Receiver<Event>,
    pub(crate) in_flight: Arc<AtomicU64>,
}

impl RequestHandle {
    pub fn id(&self) -> RequestId {
        self.ctx.id
    }
    pub fn created(&self) -> Instant {
        self.ctx.created
    }
    /// The event queue (works from sync and async code).
    pub fn events(&self) -> &flume::Receiver<Event> {
        &self.events
    }
    /// Blocks for the next event; `None` once the request has ended and its
    /// events are drained.
    pub fn next_event(&self) -> Option<Event> {
        self.events.recv().ok()
    }
    pub async fn next_event_async(&self) -> Option<Event> {
        self.events.recv_async().await.ok()
    }
    pub fn cancel(&self) {
        // Workers poll the flag between steps (and every few ms when idle).
        self.ctx.cancel(CancelReason::Client);
    }
    pub fn cancel_reason(&self) -> CancelReason {
        self.ctx.cancel_reason()
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        self.cancel();
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}
