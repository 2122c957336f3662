//! One conversation, decided without sockets, models or clocks.
//!
//! A [`Conversation`] owns everything about one conversation: its history and
//! settings, the input audio buffer, where the user's turn stands, the single
//! running answer and how it plays. It is a state machine in the sans-IO
//! style: the driver (`serve::driver`) feeds it [`Input`]s with the time they
//! happened, then drains [`Conversation::poll_output`] (events for the
//! client, in a transport-neutral form) and [`Conversation::poll_work`]
//! (what the driver must do: transcribe a turn, submit or cancel an answer).
//! The driver reports the results of that work back as inputs.
//!
//! Where things are decided, for a newcomer:
//! - a turn ends: [`Input::Speech`] with [`Speech::Stopped`] (server VAD), a
//!   client's [`Input::Commit`] or [`Input::EndOfAudio`]; then `commit_turn`;
//! - history is remembered and trimmed: `history.rs` (what reaches the
//!   Thinker), `finish_answer` and `barge_in` (an interrupted answer keeps
//!   only what was heard);
//! - a transport may only translate: wire messages to inputs, outputs to
//!   wire messages (`serve::transport`).

pub mod history;
pub mod playback;
pub mod turns;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

use omnistream_stages::engine::{
    ChatMessage, Modalities, RequestInput, RequestSpec, Role, SamplingOverrides, ToolCall,
};

use super::audio::{to_listener_rate, OutputFormat};
use super::error::ClientError;
use super::tools::Offer;
pub use history::Item;
use history::{Generated, History, Origin};
use playback::Playback;
pub use turns::{Speech, TurnSettings};

/// Most input audio the buffer holds (commit or clear it), in seconds.
pub const MAX_INPUT_AUDIO_SECONDS: usize = 60;

/// A fresh id for an item, a response or an event.
pub fn new_id(prefix: &str) -> String {
    let u = uuid::Uuid::new_v4().simple().to_string();
    format!("{prefix}_{}", &u[..20])
}

/// What the pipeline behind the conversation can do, and the server's knobs.
#[derive(Debug, Clone)]
pub struct Caps {
    /// A Listener stage transcribes speech.
    pub listener: bool,
    /// The Thinker hears speech itself (no transcript).
    pub thinker_hears: bool,
    /// Speech that starts this soon after an answer began to play is taken
    /// for the answer's own echo and dropped.
    pub echo_guard: Duration,
    /// How many characters the voice speaks a second (cuts interrupted answers).
    pub chars_per_second: f64,
}

impl Caps {
    /// Whether the pipeline takes speech at all.
    pub fn hears(&self) -> bool {
        self.listener || self.thinker_hears
    }
}

/// What the client chose for the conversation.
#[derive(Debug, Clone)]
pub struct Settings {
    pub instructions: Option<String>,
    pub voice: Option<String>,
    pub sampling: SamplingOverrides,
    /// Answers speak unless a response asks for text only.
    pub audio_out: bool,
    /// The client's audio format for answers.
    pub output: OutputFormat,
    /// Input audio: pcm16 LE mono at this rate.
    pub input_rate: u32,
    /// `server_vad` turn detection; `None`: the client commits its turns.
    pub turns: Option<TurnSettings>,
    /// With turn detection on, whether the input buffer keeps the newest
    /// audio (Realtime, whose clients may still commit it) or stays empty.
    pub buffer_with_vad: bool,
    /// Input comes from a live microphone (a media track): the buffer keeps
    /// the newest audio and is never full.
    pub mic: bool,
    /// The functions the model may call, and how.
    pub tools: Arc<Offer>,
}

impl Settings {
    pub fn new(input_rate: u32, output: OutputFormat) -> Self {
        Self {
            instructions: None,
            voice: None,
            sampling: SamplingOverrides::default(),
            audio_out: true,
            output,
            input_rate,
            turns: None,
            buffer_with_vad: true,
            mic: false,
            tools: Arc::new(Offer::auto()),
        }
    }

    /// Most input audio the buffer holds, in bytes.
    pub fn input_cap(&self) -> usize {
        self.input_rate as usize * 2 * MAX_INPUT_AUDIO_SECONDS
    }
}

/// An answer the client asks for, with what it overrides for this answer.
#[derive(Debug, Clone)]
pub struct Respond {
    pub audio_out: Option<bool>,
    pub instructions: Option<String>,
    pub voice: Option<String>,
    /// `Some(None)`: no limit.
    pub max_tokens: Option<Option<usize>>,
    pub temperature: Option<f64>,
    /// Every token up to `max_tokens` (benchmarks), where set.
    pub ignore_eos: Option<bool>,
    /// Whether the answer joins the conversation.
    pub record: bool,
    /// A typed user turn that this answer answers (joins the history when
    /// the answer is accepted).
    pub user_text: Option<String>,
    /// The error for an answer asked while one is running (its code is the
    /// transport's protocol's).
    pub busy: fn(&str) -> ClientError,
    /// Tools for this answer instead of the session's.
    pub tools: Option<Arc<Offer>>,
    /// This answer's own context instead of the conversation (`input`).
    pub input: Option<Vec<Context>>,
}

/// One item of an answer's own context.
#[derive(Debug, Clone)]
pub enum Context {
    Message(ChatMessage),
    /// One of the conversation's items, by id.
    Reference(String),
}

impl Respond {
    /// The answer to a turn the conversation took itself.
    pub fn auto(busy: fn(&str) -> ClientError) -> Self {
        Self {
            audio_out: None,
            instructions: None,
            voice: None,
            max_tokens: None,
            temperature: None,
            ignore_eos: None,
            record: true,
            user_text: None,
            busy,
            tools: None,
            input: None,
        }
    }
}

/// A key the caller pressed on a phone's keypad (`0-9 * # A-D`): the
/// caller's turn, in words the model can read, answered at once; while an
/// answer runs, it joins the conversation for the next one instead.
pub fn keypress(key: char, conv: &Conversation) -> Input {
    let text = format!("(The caller pressed {key} on the phone keypad.)");
    if conv.answering().is_some() {
        Input::AddMessage {
            item_id: None,
            role: Role::User,
            text,
            content: serde_json::Value::Null,
        }
    } else {
        let mut r = Respond::auto(still_playing);
        r.user_text = Some(text);
        Input::Respond(r)
    }
}

/// Another answer asked for while one plays.
pub fn still_playing(id: &str) -> ClientError {
    ClientError::invalid(
        "response_in_progress",
        format!("response {id} is still playing"),
    )
}

/// How an answer ended, as the engine and the client saw it.
#[derive(Debug, Clone)]
pub enum End {
    Completed(Usage),
    Cancelled,
    SlowClient,
    Failed(String),
}

impl End {
    /// The `outcome` label of `omnistream_requests_total` (docs/api.md).
    pub fn outcome(&self) -> &'static str {
        match self {
            Self::Completed(_) => "ok",
            Self::Cancelled => "cancelled",
            Self::SlowClient => "slow_client",
            // By the error's own rule (a prompt over the context is the
            // client's request, a lost stage replica a 503), as everywhere.
            Self::Failed(m) => ClientError::failed(m.clone()).outcome(),
        }
    }
}

/// Token counts of a completed request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
}

/// What happened, in the order it happened.
#[derive(Debug)]
pub enum Input {
    /// New settings (the transport validated them).
    Configure(Settings),
    /// A message added to the conversation, not answered: `content` is the
    /// item's content as the client sent it (echoed back).
    AddMessage {
        item_id: Option<String>,
        role: Role,
        text: String,
        content: Value,
    },
    /// The result of a function call the model made, from the client.
    AddToolOutput {
        item_id: Option<String>,
        call_id: String,
        output: String,
    },
    /// A function call added by the client (as if the model had made it).
    AddToolCall {
        item_id: Option<String>,
        call: ToolCall,
    },
    /// The client asks for an item as the conversation has it.
    RetrieveItem { item_id: String },
    /// The client forgets an item.
    DeleteItem { item_id: String },
    /// The client played an answer only up to `audio_end_ms`.
    TruncateItem {
        item_id: String,
        content_index: usize,
        audio_end_ms: u64,
    },
    /// Time passed (the driver wakes the conversation at its deadline).
    Tick,
    /// The client asks for an answer.
    Respond(Respond),
    /// The client cancels the running answer (`None`: whichever runs).
    Cancel { response_id: Option<String> },
    /// Input audio: pcm16 LE at the settings' rate.
    Audio(Vec<u8>),
    /// The client dropped its input buffer.
    Clear,
    /// The client ends its turn: the buffer is its audio. `respond`: answer
    /// it once heard (as the stream does; Realtime clients ask themselves).
    Commit { respond: bool },
    /// The client's audio ended (`audio_end`): `ended`, the utterance the
    /// turn detector had under way (16 kHz), else the buffer is the turn.
    EndOfAudio { ended: Option<Vec<f32>> },
    /// The turn detector heard something; `queued_s`: answer audio a media
    /// track still holds (unheard if the user cuts in).
    Speech { speech: Speech, queued_s: f64 },
    /// A transcription the conversation asked for finished.
    Transcribed {
        work: u64,
        result: Result<String, ClientError>,
    },
    /// The engine took the answer, or refused it.
    AnswerAccepted { response_id: String },
    AnswerRejected {
        response_id: String,
        error: ClientError,
    },
    /// The answer's words so far grew by `delta`.
    AnswerText { response_id: String, delta: String },
    /// The answer calls a function.
    AnswerToolCall { response_id: String, call: ToolCall },
    /// Answer audio in the client's format, `until_s` seconds in all.
    AnswerAudio {
        response_id: String,
        bytes: Vec<u8>,
        until_s: f64,
    },
    AnswerEnded {
        response_id: String,
        end: End,
        audio_seconds: f64,
    },
}

/// An answer as the client is told about it.
#[derive(Debug, Clone, PartialEq)]
pub struct AnswerInfo {
    pub response_id: String,
    /// The assistant item it is.
    pub item_id: String,
    pub previous: Option<String>,
    pub audio: bool,
    pub max_out: Option<usize>,
}

/// Events for the client, transport-neutral.
#[derive(Debug)]
pub enum Output {
    Error {
        error: ClientError,
        event_id: Option<String>,
    },
    SpeechStarted {
        item_id: String,
        audio_start_ms: u64,
    },
    SpeechStopped {
        item_id: String,
        audio_end_ms: u64,
        seconds: f64,
    },
    /// The client's audio ended; this much was taken.
    AudioReceived {
        seconds: f64,
    },
    InputCleared,
    /// The user's audio became an item.
    Committed {
        item_id: String,
        previous: Option<String>,
        seconds: f64,
    },
    /// A function call or its output was added by the client.
    ToolItemAdded {
        item_id: String,
        previous: Option<String>,
        item: ToolItem,
    },
    /// A message item was added (echo of the client's item).
    ItemAdded {
        item_id: String,
        previous: Option<String>,
        role: Role,
        content: Value,
    },
    /// The words of a committed turn, or why there are none.
    Transcribed {
        item_id: String,
        result: Result<String, ClientError>,
    },
    AnswerStarted(Arc<AnswerInfo>),
    AnswerText {
        answer: Arc<AnswerInfo>,
        delta: String,
    },
    AnswerAudio {
        answer: Arc<AnswerInfo>,
        bytes: Vec<u8>,
    },
    /// The answer called a function: its own item, `index` among the calls.
    AnswerToolCall {
        answer: Arc<AnswerInfo>,
        item_id: String,
        /// The item before it (the message, or the previous call).
        previous: Option<String>,
        index: usize,
        call: ToolCall,
    },
    AnswerDone {
        answer: Arc<AnswerInfo>,
        end: End,
        /// What the conversation keeps of it (all, or what was heard).
        text: String,
        audio_seconds: f64,
        /// Characters the answer had before any cut (for the speaking rate).
        generated_chars: usize,
        /// The functions it called, each with its item id.
        calls: Vec<(String, ToolCall)>,
    },
    /// An interrupted answer: the conversation keeps `text`, what was heard.
    Truncated {
        response_id: String,
        item_id: String,
        audio_end_ms: u64,
        text: String,
    },
    /// The client should drop the answer audio it has queued.
    PlaybackCleared {
        response_id: String,
    },
    /// An item, as the client asked for it.
    ItemRetrieved(Item),
    /// An item the client deleted.
    ItemDeleted {
        item_id: String,
    },
    /// The user stayed silent past the idle timeout: an answer follows.
    TimeoutTriggered {
        item_id: String,
        audio_start_ms: u64,
        audio_end_ms: u64,
    },
}

/// What the driver must do.
#[derive(Debug)]
pub enum Work {
    /// Transcribe `audio` (16 kHz); report [`Input::Transcribed`].
    Transcribe { id: u64, audio: Vec<f32> },
    /// That transcription is no longer wanted.
    Abandon { id: u64 },
    /// Submit the answer; report [`Input::AnswerAccepted`] or
    /// [`Input::AnswerRejected`], then its text, audio and end.
    Submit {
        response_id: String,
        spec: Box<RequestSpec>,
        format: Option<OutputFormat>,
    },
    /// Stop the answer in every stage (it still reports its end).
    Cancel { response_id: String },
    /// Forget the audio the turn detector holds.
    ClearDetector,
    /// Drop the answer audio a media track has queued.
    ClearPlayer,
}

/// A committed user turn waiting for its words, answered in order.
#[derive(Debug)]
struct PendingTurn {
    item_id: String,
    heard: Heard,
    respond: bool,
}

#[derive(Debug)]
enum Heard {
    /// Being transcribed by work `id`.
    Transcribing(u64),
    Words(Result<String, ClientError>),
    /// For a Thinker that hears: the audio itself.
    Spoken(Arc<[f32]>),
}

/// A transcription started at the user's pause.
#[derive(Debug)]
struct Early {
    id: u64,
    len: usize,
    result: Option<Result<String, ClientError>>,
}

#[derive(Debug)]
struct Answer {
    info: Arc<AnswerInfo>,
    record: bool,
    accepted: bool,
    /// The typed turn it answers, remembered once accepted.
    user: Option<ChatMessage>,
    /// The client event that asked for it (its errors refer to it).
    event_id: Option<String>,
    text: String,
    calls: Vec<(String, ToolCall)>,
}

/// A tool item the client added.
#[derive(Debug, Clone)]
pub enum ToolItem {
    Call(ToolCall),
    Output { call_id: String, output: String },
}

/// The latest answer's playback, kept after it ended while it may play on.
#[derive(Debug)]
struct Played {
    response_id: String,
    item_id: String,
    playback: Playback,
}

/// One conversation. See the module docs.
pub struct Conversation {
    caps: Caps,
    settings: Settings,
    history: History,
    /// The user's last spoken turn, unanswered, for a Thinker that hears.
    spoken: Option<Arc<[f32]>>,
    /// pcm16 at the input rate, until committed or cleared.
    input: Vec<u8>,
    last_item: Option<String>,
    /// The item id announced with `speech_started`, used at its commit.
    speech_item: Option<String>,
    /// The utterance under way began inside the echo guard: dropped.
    ignoring: bool,
    early: Option<Early>,
    pending: VecDeque<PendingTurn>,
    /// A `response.create` that came while a committed turn waited for its
    /// transcript (with its event id): made once the words are in.
    waiting_respond: Option<(Respond, Option<String>)>,
    /// Speech heard while a committed turn waits for its words: its events
    /// follow that turn's transcript (turns reach the client in order), but a
    /// barge-in in it takes effect at once.
    deferred: VecDeque<(Speech, f64, Instant)>,
    answer: Option<Answer>,
    played: Option<Played>,
    next_work: u64,
    /// The client event being handled (its errors carry its id).
    event_id: Option<String>,
    outputs: VecDeque<Output>,
    work: VecDeque<Work>,
    /// When the user's silence after the last answer makes the model speak.
    idle_at: Option<Instant>,
    /// Input audio received in all, in samples at the input rate.
    input_samples: u64,
}

impl Conversation {
    pub fn new(caps: Caps, settings: Settings) -> Self {
        Self {
            caps,
            settings,
            history: History::default(),
            spoken: None,
            input: Vec::new(),
            last_item: None,
            speech_item: None,
            ignoring: false,
            early: None,
            pending: VecDeque::new(),
            waiting_respond: None,
            deferred: VecDeque::new(),
            answer: None,
            played: None,
            next_work: 0,
            event_id: None,
            outputs: VecDeque::new(),
            work: VecDeque::new(),
            idle_at: None,
            input_samples: 0,
        }
    }

    /// When the conversation wants [`Input::Tick`] (the idle timeout).
    pub fn deadline(&self) -> Option<Instant> {
        self.idle_at
    }

    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    pub fn caps(&self) -> &Caps {
        &self.caps
    }

    /// The voice's speaking rate, as the server learnt it.
    pub fn set_chars_per_second(&mut self, r: f64) {
        self.caps.chars_per_second = r;
    }

    #[cfg(test)]
    pub fn history(&self) -> Vec<ChatMessage> {
        self.history.messages()
    }

    /// The running answer's id (asked for and not yet ended).
    pub fn answering(&self) -> Option<&str> {
        self.answer.as_ref().map(|a| a.info.response_id.as_str())
    }

    /// Room left in the input buffer, in bytes.
    pub fn input_room(&self) -> usize {
        self.settings.input_cap().saturating_sub(self.input.len())
    }

    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    pub fn poll_work(&mut self) -> Option<Work> {
        self.work.pop_front()
    }

    /// Handles a client event whose errors refer to `event_id`.
    pub fn handle_from(&mut self, event_id: Option<String>, input: Input, now: Instant) {
        self.event_id = event_id;
        self.handle(input, now);
        self.event_id = None;
    }

    pub fn handle(&mut self, input: Input, now: Instant) {
        match input {
            Input::Configure(s) => self.configure(s),
            Input::AddMessage {
                item_id,
                role,
                text,
                content,
            } => {
                let item_id = item_id.unwrap_or_else(|| new_id("item"));
                self.history.remember(
                    item_id.clone(),
                    ChatMessage::new(role, text),
                    Origin::Client(content.clone()),
                );
                let previous = self.last_item.replace(item_id.clone());
                self.emit(Output::ItemAdded {
                    item_id,
                    previous,
                    role,
                    content,
                });
            }
            Input::AddToolOutput {
                item_id,
                call_id,
                output,
            } => {
                if !self.history.has_call(&call_id) {
                    return self.fail(ClientError::param(
                        "item.call_id",
                        format!("no function call {call_id:?} in this conversation"),
                    ));
                }
                let item_id = item_id.unwrap_or_else(|| new_id("item"));
                self.history.remember(
                    item_id.clone(),
                    ChatMessage::tool(call_id.clone(), output.clone()),
                    Origin::Output,
                );
                self.add_tool_item(item_id, ToolItem::Output { call_id, output });
            }
            Input::AddToolCall { item_id, call } => {
                let item_id = item_id.unwrap_or_else(|| new_id("item"));
                self.history
                    .remember(item_id.clone(), call_message(&call), Origin::Call);
                self.add_tool_item(item_id, ToolItem::Call(call));
            }
            Input::RetrieveItem { item_id } => match self.history.get(&item_id) {
                Some(item) => {
                    let item = item.clone();
                    self.emit(Output::ItemRetrieved(item));
                }
                None => self.fail(not_found(&item_id)),
            },
            Input::DeleteItem { item_id } => self.delete_item(item_id),
            Input::TruncateItem {
                item_id,
                content_index,
                audio_end_ms,
            } => self.truncate_item(item_id, content_index, audio_end_ms),
            Input::Respond(r) => {
                // The newest item is a committed turn still being
                // transcribed: it is what this answer answers, so it waits
                // for the words (with a newer item, or a typed turn of its
                // own, it answers at once).
                let newest_pending = self
                    .pending
                    .back()
                    .is_some_and(|t| self.last_item.as_deref() == Some(t.item_id.as_str()));
                if r.input.is_none()
                    && r.user_text.is_none()
                    && newest_pending
                    && self.answer.is_none()
                {
                    match &self.waiting_respond {
                        Some(_) => self.fail((r.busy)("(waiting for a transcript)")),
                        None => self.waiting_respond = Some((r, self.event_id.clone())),
                    }
                    return;
                }
                if let Err(e) = self.respond(r) {
                    self.fail(e);
                }
            }
            Input::Cancel { response_id } => self.cancel(response_id),
            Input::Audio(pcm) => self.audio(pcm),
            Input::Clear => {
                self.input.clear();
                self.abandon_early();
                self.speech_item = None;
                self.ignoring = false;
                self.work.push_back(Work::ClearDetector);
                self.emit(Output::InputCleared);
            }
            Input::Commit { respond } => self.commit(respond),
            Input::EndOfAudio { ended } => self.end_of_audio(ended),
            Input::Speech { speech, queued_s } => self.speech(speech, queued_s, now),
            Input::Transcribed { work, result } => self.transcribed(work, result),
            Input::AnswerAccepted { response_id } => self.accepted(&response_id),
            Input::AnswerRejected { response_id, error } => {
                if self.is_answer(&response_id) {
                    let a = self.answer.take();
                    self.event_id = a.and_then(|a| a.event_id);
                    self.fail(error);
                }
            }
            Input::AnswerText { response_id, delta } => {
                if let Some(a) = self.answer_mut(&response_id) {
                    a.text.push_str(&delta);
                    let answer = a.info.clone();
                    self.emit(Output::AnswerText { answer, delta });
                }
            }
            Input::AnswerToolCall { response_id, call } => {
                let item_id = new_id("item");
                let last = self.last_item.replace(item_id.clone());
                let Some(a) = self.answer_mut(&response_id) else {
                    self.last_item = last;
                    return;
                };
                a.calls.push((item_id.clone(), call.clone()));
                let (answer, index) = (a.info.clone(), a.calls.len() - 1);
                self.emit(Output::AnswerToolCall {
                    answer,
                    item_id,
                    previous: last,
                    index,
                    call,
                });
            }
            Input::AnswerAudio {
                response_id,
                bytes,
                until_s,
            } => {
                let Some(a) = self.answer_mut(&response_id) else {
                    return;
                };
                let answer = a.info.clone();
                if let Some(p) = self
                    .played
                    .as_mut()
                    .filter(|p| p.response_id == response_id)
                {
                    if p.playback.interrupted() {
                        // Cut off: what its stages made before the cancel
                        // reached them is never played (after the player
                        // was cleared, it would start the answer again).
                        return;
                    }
                    p.playback.sent_until(until_s, now);
                }
                self.emit(Output::AnswerAudio { answer, bytes });
            }
            Input::AnswerEnded {
                response_id,
                end,
                audio_seconds,
            } => self.finish_answer(&response_id, end, audio_seconds, now),
            Input::Tick => self.tick(now),
        }
    }

    fn emit(&mut self, o: Output) {
        self.outputs.push_back(o);
    }

    fn add_tool_item(&mut self, item_id: String, item: ToolItem) {
        let previous = self.last_item.replace(item_id.clone());
        self.emit(Output::ToolItemAdded {
            item_id,
            previous,
            item,
        });
    }

    fn fail(&mut self, error: ClientError) {
        let event_id = self.event_id.clone();
        self.emit(Output::Error { error, event_id });
    }

    fn work_id(&mut self) -> u64 {
        self.next_work += 1;
        self.next_work
    }

    fn configure(&mut self, s: Settings) {
        if s.turns.as_ref().and_then(|t| t.idle_timeout).is_none() {
            self.idle_at = None;
        }
        if s.turns.is_none() && self.settings.turns.is_some() {
            // Turn detection off: an utterance under way is forgotten.
            self.abandon_early();
            self.speech_item = None;
            self.ignoring = false;
        }
        if s.input_rate != self.settings.input_rate {
            // The buffer's audio is at the old rate: dropped (an utterance
            // under way with it); the stream's clock keeps its time.
            self.input_samples = self.input_samples * u64::from(s.input_rate)
                / u64::from(self.settings.input_rate.max(1));
            self.input.clear();
            self.abandon_early();
            self.speech_item = None;
        }
        self.settings = s;
    }

    // ------------------------------------------------------------ audio in

    fn audio(&mut self, pcm: Vec<u8>) {
        if pcm.len() % 2 == 1 {
            return self.fail(ClientError::invalid(
                "invalid_audio",
                "pcm16 audio needs an even number of bytes",
            ));
        }
        self.input_samples += (pcm.len() / 2) as u64;
        let cap = self.settings.input_cap();
        if self.settings.turns.is_some() || self.settings.mic {
            if self.settings.turns.is_some() && !self.settings.buffer_with_vad {
                return;
            }
            // Like a microphone's, the buffer keeps the newest audio.
            self.input.extend_from_slice(&pcm);
            if self.input.len() > cap {
                let excess = self.input.len() - cap;
                self.input.drain(..excess + excess % 2);
            }
            return;
        }
        if self.input.len() + pcm.len() > cap {
            return self.fail(ClientError::invalid(
                "input_audio_buffer_full",
                format!(
                    "the input audio buffer holds at most {MAX_INPUT_AUDIO_SECONDS} s; commit or clear it (this audio was dropped)"
                ),
            ));
        }
        self.input.extend_from_slice(&pcm);
    }

    /// The buffer at the Listener's rate (empty where nothing hears it).
    fn take_input(&mut self) -> Result<(Vec<f32>, f64), ClientError> {
        let pcm = std::mem::take(&mut self.input);
        let seconds = pcm.len() as f64 / 2.0 / f64::from(self.settings.input_rate.max(1));
        let audio = if self.caps.hears() {
            to_listener_rate(&pcm, self.settings.input_rate)?
        } else {
            Vec::new()
        };
        Ok((audio, seconds))
    }

    fn commit(&mut self, respond: bool) {
        if self.input.is_empty() {
            return self.fail(ClientError::invalid(
                "input_audio_buffer_commit_empty",
                "the input audio buffer is empty",
            ));
        }
        self.abandon_early();
        self.ignoring = false;
        self.work.push_back(Work::ClearDetector);
        let (audio, seconds) = match self.take_input() {
            Ok(a) => a,
            Err(e) => return self.fail(e),
        };
        let item_id = self.speech_item.take().unwrap_or_else(|| new_id("item"));
        self.commit_turn(item_id, audio, seconds, None, respond);
    }

    /// The stream's `audio_end`: the utterance under way, or the buffer, is
    /// the user's turn, answered once heard.
    fn end_of_audio(&mut self, ended: Option<Vec<f32>>) {
        let (audio, seconds) = match ended {
            Some(audio) if !self.ignoring => {
                let s = audio.len() as f64 / f64::from(omnistream_stages::engine::TRANSCRIBE_RATE);
                (Some(audio), s)
            }
            _ => {
                let s = self.input.len() as f64 / 2.0 / f64::from(self.settings.input_rate.max(1));
                (None, s)
            }
        };
        self.ignoring = false;
        self.emit(Output::AudioReceived { seconds });
        let early = self.take_early(audio.as_deref());
        let audio = match audio {
            Some(a) => a,
            None if self.input.is_empty() => return,
            None => {
                if !self.caps.hears() {
                    self.input.clear();
                    return self.fail(deaf());
                }
                if let Some(id) = self.answering() {
                    let e = ClientError::invalid(
                        "response_in_progress",
                        format!("response {id} is still playing: wait for done or cancel it"),
                    );
                    self.input.clear();
                    return self.fail(e);
                }
                match self.take_input() {
                    Ok((a, _)) => a,
                    Err(e) => return self.fail(e),
                }
            }
        };
        if !self.caps.hears() {
            return self.fail(deaf());
        }
        let item_id = self.speech_item.take().unwrap_or_else(|| new_id("item"));
        self.commit_turn(item_id, audio, seconds, early, true);
    }

    // ------------------------------------------------------------ turns

    /// Whether speech that started at `now` is the answer's own echo (it
    /// began within the echo guard after the answer started to play).
    fn echo(&self, now: Instant) -> bool {
        let since = self.played.as_ref().and_then(|p| p.playback.started());
        since.is_some_and(|t| t <= now && now - t < self.caps.echo_guard)
    }

    fn speech(&mut self, speech: Speech, queued_s: f64, now: Instant) {
        let Some(turns) = self.settings.turns.clone() else {
            return; // detection was turned off meanwhile
        };
        if !self.pending.is_empty() || !self.deferred.is_empty() {
            if matches!(speech, Speech::Started { .. })
                && turns.interrupt_response
                && !self.echo(now)
            {
                self.barge_in(queued_s, now);
            }
            self.deferred.push_back((speech, queued_s, now));
            return;
        }
        self.speech_now(speech, &turns, queued_s, now);
    }

    fn speech_now(&mut self, speech: Speech, turns: &TurnSettings, queued_s: f64, now: Instant) {
        match speech {
            Speech::Started { audio_start_ms } => {
                self.abandon_early();
                if self.echo(now) {
                    self.ignoring = true;
                    return;
                }
                self.idle_at = None;
                let item_id = new_id("item");
                self.speech_item = Some(item_id.clone());
                self.emit(Output::SpeechStarted {
                    item_id,
                    audio_start_ms,
                });
                if turns.interrupt_response {
                    self.barge_in(queued_s, now);
                }
            }
            Speech::Paused { audio } => {
                self.abandon_early();
                if self.ignoring || !self.caps.listener {
                    return;
                }
                let id = self.work_id();
                self.early = Some(Early {
                    id,
                    len: audio.len(),
                    result: None,
                });
                self.work.push_back(Work::Transcribe { id, audio });
            }
            Speech::Resumed => self.abandon_early(),
            Speech::Stopped {
                audio_end_ms,
                audio,
            } => {
                if std::mem::take(&mut self.ignoring) {
                    self.abandon_early();
                    return;
                }
                let item_id = self.speech_item.take().unwrap_or_else(|| new_id("item"));
                let seconds =
                    audio.len() as f64 / f64::from(omnistream_stages::engine::TRANSCRIBE_RATE);
                self.emit(Output::SpeechStopped {
                    item_id: item_id.clone(),
                    audio_end_ms,
                    seconds,
                });
                // The utterance is the turn; the buffer starts afresh.
                self.input.clear();
                let early = self.take_early(Some(&audio));
                self.commit_turn(item_id, audio, seconds, early, turns.create_response);
            }
        }
    }

    /// The early transcription, if it heard exactly `audio` (the turn ended
    /// where the user paused); else it is abandoned.
    fn take_early(&mut self, audio: Option<&[f32]>) -> Option<Early> {
        match (self.early.take(), audio) {
            (Some(e), Some(a)) if e.len == a.len() => Some(e),
            (Some(e), _) => {
                self.work.push_back(Work::Abandon { id: e.id });
                None
            }
            (None, _) => None,
        }
    }

    fn abandon_early(&mut self) {
        if let Some(e) = self.early.take() {
            self.work.push_back(Work::Abandon { id: e.id });
        }
    }

    /// The user's turn becomes an item; its words come from `early`, a new
    /// transcription, or (a Thinker that hears) the audio itself. Turns are
    /// answered in the order they were taken.
    fn commit_turn(
        &mut self,
        item_id: String,
        audio: Vec<f32>,
        seconds: f64,
        early: Option<Early>,
        respond: bool,
    ) {
        let previous = self.last_item.replace(item_id.clone());
        self.emit(Output::Committed {
            item_id: item_id.clone(),
            previous,
            seconds,
        });
        let heard = match early {
            Some(Early {
                result: Some(r), ..
            }) => Heard::Words(r),
            Some(Early { id, .. }) => Heard::Transcribing(id),
            None if self.caps.thinker_hears && !audio.is_empty() => Heard::Spoken(audio.into()),
            None if self.caps.listener => {
                let id = self.work_id();
                self.work.push_back(Work::Transcribe { id, audio });
                Heard::Transcribing(id)
            }
            None => Heard::Words(Err(ClientError::invalid(
                "transcription_unavailable",
                "this server's pipeline has no speech recognition stage: the audio is kept without a transcript and the model does not hear it",
            ))),
        };
        self.pending.push_back(PendingTurn {
            item_id,
            heard,
            respond,
        });
        self.hear_pending();
    }

    fn transcribed(&mut self, work: u64, result: Result<String, ClientError>) {
        if let Some(e) = self.early.as_mut().filter(|e| e.id == work) {
            e.result = Some(result);
            return;
        }
        if let Some(t) = self
            .pending
            .iter_mut()
            .find(|t| matches!(t.heard, Heard::Transcribing(id) if id == work))
        {
            t.heard = Heard::Words(result);
            self.hear_pending();
        }
    }

    /// Takes the words of the oldest turns that have them into the
    /// conversation, answering the last one when the user waits for it.
    fn hear_pending(&mut self) {
        while self
            .pending
            .front()
            .is_some_and(|t| !matches!(t.heard, Heard::Transcribing(_)))
        {
            let Some(t) = self.pending.pop_front() else {
                break;
            };
            // A later turn waiting too, or the user already speaking again:
            // this one is not answered on its own.
            let speaking = self
                .deferred
                .iter()
                .any(|(s, _, _)| matches!(s, Speech::Started { .. }));
            let respond =
                t.respond && self.pending.is_empty() && !speaking && self.answer.is_none();
            match t.heard {
                Heard::Transcribing(_) => unreachable!("checked above"),
                Heard::Spoken(audio) => {
                    self.spoken = Some(audio);
                    if respond {
                        self.respond_auto();
                    }
                }
                Heard::Words(result) => {
                    let words = result.as_ref().ok().cloned().unwrap_or_default();
                    self.emit(Output::Transcribed {
                        item_id: t.item_id.clone(),
                        result,
                    });
                    // A blank transcript (noise, a cough) adds no turn.
                    if words.is_empty() {
                        continue;
                    }
                    self.history
                        .remember(t.item_id, ChatMessage::user(words), Origin::Spoken);
                    if respond {
                        self.respond_auto();
                    }
                }
            }
        }
        if self.pending.is_empty() {
            if let Some((r, event_id)) = self.waiting_respond.take() {
                let outer = std::mem::replace(&mut self.event_id, event_id);
                if let Err(e) = self.respond(r) {
                    self.fail(e);
                }
                self.event_id = outer;
            }
        }
        // Speech heard meanwhile, in order, until a turn waits again.
        while self.pending.is_empty() {
            let Some((speech, queued_s, at)) = self.deferred.pop_front() else {
                break;
            };
            if let Some(turns) = self.settings.turns.clone() {
                self.speech_now(speech, &turns, queued_s, at);
            }
        }
    }

    fn respond_auto(&mut self) {
        let r = Respond::auto(|id| {
            ClientError::invalid(
                "conversation_already_has_active_response",
                format!("response {id} is still in progress"),
            )
        });
        if let Err(e) = self.respond(r) {
            self.event_id = None;
            self.fail(e);
        }
    }

    // ------------------------------------------------------------ answers

    fn respond(&mut self, r: Respond) -> Result<(), ClientError> {
        if let Some(id) = self.answering() {
            return Err((r.busy)(id));
        }
        // The answer's own settings first: a bad one is named whatever the
        // conversation holds, and takes nothing from it.
        let mut sampling = self.settings.sampling.clone();
        if let Some(m) = r.max_tokens {
            sampling.max_tokens = m;
        }
        if let Some(t) = r.temperature {
            sampling.temperature = Some(t);
        }
        if let Some(i) = r.ignore_eos {
            sampling.ignore_eos = i;
        }
        if sampling.ignore_eos && sampling.max_tokens.is_none() {
            return Err(ClientError::param(
                "response.ignore_eos",
                "`ignore_eos` needs `max_output_tokens`: the answer would never end",
            ));
        }
        self.idle_at = None;
        let user = r.user_text.map(ChatMessage::user);
        let instructions = r.instructions.or(self.settings.instructions.clone());
        let (messages, spoken) = match &r.input {
            Some(input) => (self.own_context(instructions.as_deref(), input)?, None),
            None => (
                self.history.prompt(instructions.as_deref(), user.as_ref()),
                self.spoken.take(),
            ),
        };
        // A context of its own may be instructions alone; the conversation
        // needs a message to answer.
        let nothing = match &r.input {
            Some(_) => messages.is_empty(),
            None => messages.iter().all(|m| m.role == Role::System),
        };
        if spoken.is_none() && nothing {
            return Err(ClientError::invalid(
                "conversation_empty",
                "the conversation has no message to answer: add an item first",
            ));
        }
        let audio = r.audio_out.unwrap_or(self.settings.audio_out);
        let max_out = sampling.max_tokens;
        let spec = RequestSpec {
            input: match spoken {
                Some(audio) => RequestInput::Heard { messages, audio },
                None => RequestInput::Chat { messages },
            },
            modalities: if audio {
                Modalities::TEXT_AUDIO
            } else {
                Modalities::TEXT
            },
            sampling,
            voice: r.voice.or(self.settings.voice.clone()),
            tools: r.tools.as_ref().unwrap_or(&self.settings.tools).tools(),
            style: Default::default(),
        };
        let info = Arc::new(AnswerInfo {
            response_id: new_id("resp"),
            item_id: new_id("item"),
            previous: None,
            audio,
            max_out,
        });
        self.work.push_back(Work::Submit {
            response_id: info.response_id.clone(),
            spec: Box::new(spec),
            format: audio.then_some(self.settings.output),
        });
        self.answer = Some(Answer {
            info,
            record: r.record,
            accepted: false,
            user,
            event_id: self.event_id.clone(),
            text: String::new(),
            calls: Vec::new(),
        });
        Ok(())
    }

    /// An answer's own context: `instructions`, then `input`, its
    /// references resolved against the conversation.
    fn own_context(
        &self,
        instructions: Option<&str>,
        input: &[Context],
    ) -> Result<Vec<ChatMessage>, ClientError> {
        let mut out = Vec::with_capacity(input.len() + 1);
        if let Some(i) = instructions.filter(|i| !i.trim().is_empty()) {
            out.push(ChatMessage::system(i));
        }
        let mut items = Vec::with_capacity(input.len());
        for c in input {
            items.push(match c {
                Context::Message(m) => m.clone(),
                Context::Reference(id) => match self.history.get(id) {
                    Some(item) => item.message.clone(),
                    None => return Err(not_found(id).at("response.input")),
                },
            });
        }
        out.extend(history::merge_calls(&items));
        Ok(out)
    }

    fn is_answer(&self, response_id: &str) -> bool {
        self.answering() == Some(response_id)
    }

    fn answer_mut(&mut self, response_id: &str) -> Option<&mut Answer> {
        self.answer
            .as_mut()
            .filter(|a| a.info.response_id == response_id)
    }

    fn accepted(&mut self, response_id: &str) {
        let last_item = self.last_item.clone();
        let Some(a) = self.answer_mut(response_id) else {
            return;
        };
        a.accepted = true;
        let user = a.user.take();
        let mut info = (*a.info).clone();
        info.previous = last_item;
        a.info = Arc::new(info);
        let info = a.info.clone();
        if let Some(u) = user {
            self.history.remember(new_id("item"), u, Origin::Typed);
        }
        self.last_item = Some(info.item_id.clone());
        self.played = Some(Played {
            response_id: info.response_id.clone(),
            item_id: info.item_id.clone(),
            playback: Playback::default(),
        });
        self.emit(Output::AnswerStarted(info));
    }

    fn cancel(&mut self, response_id: Option<String>) {
        match self.answer.as_ref() {
            Some(a)
                if response_id
                    .as_deref()
                    .is_none_or(|id| id == a.info.response_id) =>
            {
                let response_id = a.info.response_id.clone();
                self.work.push_back(Work::Cancel { response_id });
            }
            _ => self.fail(ClientError::invalid(
                "response_cancel_not_active",
                "there is no active response to cancel",
            )),
        }
    }

    /// The user spoke over the answer: it stops in every stage, the audio
    /// queued for playback is dropped, and the conversation keeps only what
    /// was heard.
    fn barge_in(&mut self, queued_s: f64, now: Instant) {
        let running = self.answer.is_some();
        let Some(p) = self.played.as_mut() else {
            return;
        };
        if p.playback.interrupted() || (!running && queued_s <= 0.0 && !p.playback.playing(now)) {
            return; // nothing is playing
        }
        p.playback.interrupt(queued_s, now);
        let (response_id, item_id, heard_ms) = (
            p.response_id.clone(),
            p.item_id.clone(),
            p.playback.heard_ms(),
        );
        let heard_text = |text: &str| {
            p.playback
                .heard_text(text, self.caps.chars_per_second)
                .to_string()
        };
        self.work.push_back(Work::ClearPlayer);
        if running {
            // The answer reports the cut as it ends.
            self.work.push_back(Work::Cancel {
                response_id: response_id.clone(),
            });
        } else if let Some(item) = self
            .history
            .get_mut(&item_id)
            .filter(|i| matches!(i.origin, Origin::Answer { .. }))
        {
            // Generated whole, still playing: cut the conversation's copy.
            item.message.content = heard_text(&item.message.content);
            if let Origin::Answer { audio_ms, .. } = &mut item.origin {
                *audio_ms = Some(heard_ms);
            }
            let text = item.message.content.clone();
            self.emit(Output::Truncated {
                response_id: response_id.clone(),
                item_id,
                audio_end_ms: heard_ms,
                text,
            });
        }
        self.emit(Output::PlaybackCleared { response_id });
    }

    /// Time passed: past the idle timeout, with the user silent and nothing
    /// running, the model speaks again on the conversation so far.
    fn tick(&mut self, now: Instant) {
        let Some(at) = self.idle_at.filter(|t| *t <= now) else {
            return;
        };
        self.idle_at = None;
        let Some(idle) = self.settings.turns.as_ref().and_then(|t| t.idle_timeout) else {
            return;
        };
        let busy = self.answer.is_some() || !self.pending.is_empty() || self.speech_item.is_some();
        if busy {
            return;
        }
        let rate = u64::from(self.settings.input_rate.max(1));
        let audio_end_ms = self.input_samples * 1000 / rate;
        // The silence since the answer played (it began `idle` before `at`).
        let silent_ms = (idle + now.saturating_duration_since(at)).as_millis() as u64;
        self.emit(Output::TimeoutTriggered {
            item_id: new_id("item"),
            audio_start_ms: audio_end_ms.saturating_sub(silent_ms),
            audio_end_ms,
        });
        self.respond_auto();
    }

    /// The client forgets an item: it no longer reaches the model.
    fn delete_item(&mut self, item_id: String) {
        if self.answer.as_ref().is_some_and(|a| {
            a.info.item_id == item_id || a.calls.iter().any(|(id, _)| *id == item_id)
        }) {
            return self.fail(
                ClientError::invalid(
                    "item_in_progress",
                    format!("item {item_id:?} is being generated: cancel the response first"),
                )
                .at("item_id"),
            );
        }
        if !self.history.delete(&item_id) {
            return self.fail(not_found(&item_id));
        }
        if self.last_item.as_deref() == Some(item_id.as_str()) {
            self.last_item = self.history.last_id().map(str::to_owned);
        }
        self.emit(Output::ItemDeleted { item_id });
    }

    /// The client played an answer only up to `audio_end_ms`: the
    /// conversation keeps the words heard by then. The running answer is
    /// cut when it ends (its `truncated` comes then).
    fn truncate_item(&mut self, item_id: String, content_index: usize, audio_end_ms: u64) {
        if content_index != 0 {
            return self.fail(ClientError::param(
                "content_index",
                "an answer has one content part: content_index 0",
            ));
        }
        if let Some(p) = self.played.as_mut().filter(|p| {
            p.item_id == item_id
                && self
                    .answer
                    .as_ref()
                    .is_some_and(|a| a.info.item_id == item_id)
        }) {
            p.playback.truncate(audio_end_ms);
            return;
        }
        let cps = self.caps.chars_per_second;
        let Some(item) = self.history.get_mut(&item_id) else {
            return self.fail(not_found(&item_id));
        };
        let Origin::Answer {
            audio_ms,
            generated,
        } = &mut item.origin
        else {
            return self.fail(ClientError::param(
                "item_id",
                format!("item {item_id:?} is not an answer: only an answer's audio is truncated"),
            ));
        };
        // Cut from the whole answer: the server may have cut it already at
        // a barge-in, by its estimate of what was played; the client's own
        // cut, a few ms later, is the one that knows.
        let (whole_text, whole_ms) = match (&*generated, *audio_ms) {
            (Some(g), Some(_)) => (g.text.as_str(), g.audio_ms),
            (None, Some(ms)) => (item.message.content.as_str(), ms),
            (_, None) => {
                return self.fail(ClientError::param(
                    "item_id",
                    format!("answer {item_id:?} has no audio to truncate"),
                ))
            }
        };
        if audio_end_ms > whole_ms {
            return self.fail(ClientError::param(
                "audio_end_ms",
                format!("audio_end_ms {audio_end_ms} is past the answer's {whole_ms} ms of audio"),
            ));
        }
        let text =
            playback::spoken_prefix(whole_text, audio_end_ms as f64 / 1000.0, cps).to_string();
        item.message.content = text.clone();
        *audio_ms = Some(audio_end_ms);
        let response_id = self
            .played
            .as_ref()
            .filter(|p| p.item_id == item_id)
            .map(|p| p.response_id.clone())
            .unwrap_or_default();
        self.emit(Output::Truncated {
            response_id,
            item_id,
            audio_end_ms,
            text,
        });
    }

    fn finish_answer(&mut self, response_id: &str, end: End, audio_seconds: f64, now: Instant) {
        if !self.is_answer(response_id) {
            return;
        }
        // The user's silence counts from when the answer has played (a
        // client plays from its first audio, in real time).
        if let Some(idle) = self.settings.turns.as_ref().and_then(|t| t.idle_timeout) {
            let played = self
                .played
                .as_ref()
                .filter(|p| p.response_id == response_id)
                .and_then(|p| p.playback.started())
                .map(|t| t + Duration::from_secs_f64(audio_seconds.max(0.0)));
            self.idle_at = Some(played.map_or(now, |t| t.max(now)) + idle);
        }
        let Some(a) = self.answer.take() else {
            return;
        };
        let generated_chars = a.text.chars().count();
        // The whole answer, for a later cut of its audio.
        let generated_text = a.info.audio.then(|| a.text.clone());
        let mut text = a.text;
        if let Some(p) = self
            .played
            .as_ref()
            .filter(|p| p.response_id == response_id && p.playback.interrupted())
        {
            text = p
                .playback
                .heard_text(&text, self.caps.chars_per_second)
                .to_string();
            self.emit(Output::Truncated {
                response_id: response_id.to_string(),
                item_id: a.info.item_id.clone(),
                audio_end_ms: p.playback.heard_ms(),
                text: text.clone(),
            });
        }
        // The conversation learns the answer (even a cancelled one: it was
        // heard), with the calls it made.
        if a.record && !text.trim().is_empty() {
            let heard_ms = self
                .played
                .as_ref()
                .filter(|p| p.response_id == response_id && p.playback.interrupted())
                .map(|p| p.playback.heard_ms());
            let whole_ms = (audio_seconds * 1000.0).round() as u64;
            let audio_ms = a.info.audio.then(|| heard_ms.unwrap_or(whole_ms));
            let generated = generated_text.map(|text| Generated {
                text,
                audio_ms: whole_ms,
            });
            self.history.remember(
                a.info.item_id.clone(),
                ChatMessage::assistant(text.clone()),
                Origin::Answer {
                    audio_ms,
                    generated,
                },
            );
        }
        if a.record {
            for (item_id, call) in &a.calls {
                self.history
                    .remember(item_id.clone(), call_message(call), Origin::Call);
            }
        }
        self.emit(Output::AnswerDone {
            answer: a.info,
            end,
            text,
            audio_seconds,
            generated_chars,
            calls: a.calls,
        });
    }
}

/// A call as the assistant message that makes it (its own item).
fn call_message(call: &ToolCall) -> ChatMessage {
    let mut m = ChatMessage::assistant("");
    m.tool_calls.push(call.clone());
    m
}

/// No item `id` in the conversation.
fn not_found(id: &str) -> ClientError {
    ClientError::invalid(
        "item_not_found",
        format!("no item {id:?} in this conversation"),
    )
    .at("item_id")
}

/// A pipeline with no way to hear speech.
pub fn deaf() -> ClientError {
    ClientError::invalid(
        "transcription_unavailable",
        "this server's pipeline has no speech recognition stage: the utterance was dropped",
    )
}

#[cfg(test)]
mod tests;
