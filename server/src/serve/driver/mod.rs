//! The one async driver of a conversation: it performs what the
//! [`Conversation`] decides. It is the only place with `select!`, timers and
//! spawning for a session: client messages come in through a [`Transport`]
//! (which translates them), the turn detector runs on a blocking worker,
//! transcriptions and answers run in tasks of their own (a barge-in is seen
//! while the previous turn is still being transcribed), `Pipeline::submit`
//! runs off the async workers, and the conversation's outputs go back out
//! through the transport to the connection's [`Outbox`].

pub mod vad;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ws::{close_code, Message};
use futures_util::{Stream, StreamExt};
use tokio::sync::{mpsc, watch};

use omnistream_stages::engine::ToolCall;

use super::answer::{Answer, Control, Meter, Step};
use super::conn::{self, Drain, Outbox, Overflow};
use super::conversation::{Caps, Conversation, End, Input, Output, Settings, Work};
use super::error::ClientError;
use super::listen;
use super::metrics::TaskGuard;
use super::sessions::SessionGuard;
use super::state::AppState;
use vad::{Detector, Heard};

/// A client message as it arrived, whatever carried it.
pub enum Incoming<'a> {
    Text(&'a str),
    Binary(&'a [u8]),
}

/// What a connection delivers: client messages, or its end.
pub enum Inbound {
    Text(String),
    Binary(Vec<u8>),
    /// The client answered a ping of ours (its payload).
    Pong(Vec<u8>),
    /// The caller pressed a key on a phone's keypad (a SIP call's RFC 4733
    /// event or SIP INFO).
    Key(char),
    /// The client closed, or the connection is gone.
    Closed,
    /// A read error worth telling the client, with the close code it gets.
    Broken(ClientError, u16),
}

/// A WebSocket's messages as [`Inbound`].
pub fn websocket_inbound(
    socket: impl Stream<Item = Result<Message, axum::Error>> + Unpin,
) -> impl Stream<Item = Inbound> + Unpin {
    socket.filter_map(|m| {
        std::future::ready(match m {
            Ok(Message::Text(t)) => Some(Inbound::Text(t.to_string())),
            Ok(Message::Binary(b)) => Some(Inbound::Binary(b.to_vec())),
            Ok(Message::Pong(p)) => Some(Inbound::Pong(p.to_vec())),
            Ok(Message::Ping(_)) => None, // answered by the socket
            Ok(Message::Close(_)) => Some(Inbound::Closed),
            Err(e) => Some(match conn::read_error(&e) {
                Some((err, code)) => Inbound::Broken(err, code),
                None => Inbound::Closed,
            }),
        })
    })
}

/// What a transport asks of the driver for one client message.
pub enum Action {
    /// An input for the conversation; its errors refer to `event_id`.
    Input {
        event_id: Option<String>,
        input: Input,
    },
    /// A reply straight to the client (a settings echo, a protocol error).
    Send(Message),
    /// The client's audio ended: the turn detector's utterance (if any) ends
    /// here, then [`Input::EndOfAudio`].
    EndOfAudio,
    /// The connection ends: the error goes out last, then a close with `code`.
    Close(ClientError, u16),
}

/// A wire protocol over a connection: a codec between its messages and the
/// conversation's inputs and outputs. It decides nothing about the
/// conversation.
pub trait Transport: Send {
    /// The endpoint its requests count under (`realtime`, `stream`, `twilio`,
    /// `webrtc`, `sip`).
    fn endpoint(&self) -> &'static str;
    /// The conversation's settings before the client chose any.
    fn settings(&self) -> Settings;
    /// Whose cloned voices its answers may speak in (a hash of the API key
    /// it came with; none: the voices made with no key).
    fn voice_owner(&self) -> &str {
        ""
    }
    /// What the client is told when the connection opens.
    fn opening(&mut self, conv: &Conversation) -> Vec<Message>;
    /// A client message, translated.
    fn message(&mut self, m: Incoming<'_>, conv: &Conversation) -> Vec<Action>;
    /// An output, translated; `Err` when a media track cannot take more.
    fn output(&mut self, o: Output, conv: &Conversation) -> Result<Vec<Message>, Overflow>;
    /// An error event in this protocol (the last message of a connection
    /// it ends, too).
    fn error(&self, e: &ClientError) -> Message;
    /// An error that does not end the connection, as the client is told it
    /// (`None` where the protocol has no way to).
    fn notice(&self, e: &ClientError) -> Option<Message> {
        Some(self.error(e))
    }
    /// Whether the connection has outstayed what it may do without doing
    /// it (checked every second): the error it is closed with.
    fn overdue(&self, _now: Instant) -> Option<ClientError> {
        None
    }
    /// When the transport wants [`Self::wake`] called (audio it holds back).
    fn wake_at(&self) -> Option<Instant> {
        None
    }
    /// Its time came: what it sends now.
    fn wake(&mut self, _now: Instant) -> Vec<Message> {
        Vec::new()
    }
    /// Answer audio a media track still has queued, in seconds.
    fn queued_seconds(&self) -> f64 {
        0.0
    }
    /// Drops the answer audio a media track has queued.
    fn clear_player(&mut self) {}
    /// Whether answers play on a media track (they end when it played them).
    fn has_player(&self) -> bool {
        false
    }
    /// The caller pressed a key: its turn (a protocol may tell its client too).
    fn key(&mut self, key: char, conv: &Conversation) -> Vec<Action> {
        vec![Action::Input {
            event_id: None,
            input: super::conversation::keypress(key, conv),
        }]
    }
}

/// What the server's pipeline and knobs give a conversation.
pub fn caps(state: &AppState) -> Caps {
    Caps {
        listener: listen::can_hear(state),
        thinker_hears: state.pipeline.thinker_hears(),
        echo_guard: Duration::from_millis(
            state
                .config
                .vad
                .as_ref()
                .map_or(0, |h| u64::from(h.echo_guard_ms)),
        ),
        chars_per_second: state.speech_rate.chars_per_second(),
    }
}

/// What an answer's task reports.
enum AnswerEvent {
    Text(String),
    ToolCall(ToolCall),
    Audio { bytes: Vec<u8>, until_s: f64 },
    Ended { end: End, audio_seconds: f64 },
}

/// Runs one conversation until the client goes, the session expires or the
/// server closes. `mic`: pcm16 from a media track (WebRTC), at the
/// conversation's input rate.
pub async fn run<T, St>(
    state: Arc<AppState>,
    transport: T,
    out: Outbox,
    mut stream: St,
    session: SessionGuard,
    mut mic: Option<mpsc::Receiver<Vec<u8>>>,
) where
    T: Transport,
    St: Stream<Item = Inbound> + Unpin,
{
    let _task = TaskGuard::new(&state.metrics);
    let conv = Conversation::new(caps(&state), transport.settings());
    let (heard_tx, heard_rx) = mpsc::unbounded_channel();
    let (words_tx, words_rx) = mpsc::unbounded_channel();
    let (answers_tx, answers_rx) = mpsc::unbounded_channel();
    let (submitted_tx, submitted_rx) = mpsc::unbounded_channel();
    let mut d = Driver {
        endpoint: transport.endpoint(),
        state,
        transport,
        out,
        conv,
        session,
        detector: None,
        heard_tx,
        words_tx,
        transcribing: HashMap::new(),
        answers_tx,
        submitted_tx,
        cancels: HashMap::new(),
    };
    for m in d.transport.opening(&d.conv) {
        d.send(m);
    }
    let mut channels = Channels {
        heard: heard_rx,
        words: words_rx,
        answers: answers_rx,
        submitted: submitted_rx,
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut drain = Drain::new(&d.state);
    let out = d.out.clone();
    loop {
        // The earliest of what the transport and the conversation wait for.
        let wake = match (d.transport.wake_at(), d.conv.deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        tokio::select! {
            biased;
            _ = out.closed() => break,
            _ = async {
                match wake {
                    Some(t) => tokio::time::sleep_until(t.into()).await,
                    None => std::future::pending().await,
                }
            } => {
                let now = Instant::now();
                for m in d.transport.wake(now) {
                    d.send(m);
                }
                if d.conv.deadline().is_some_and(|t| t <= now) {
                    d.handle(None, Input::Tick).await;
                }
            }
            _ = drain.next() => {
                let closing = drain.closing();
                // On a media track the answer is done when the track played it.
                let playing = d.transport.queued_seconds() > 0.0;
                if d.conv.answering().is_none() && (!playing || closing) {
                    if d.transport.has_player() && !closing {
                        // `output_audio_buffer.stopped` is one frame behind.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    let bye = d.transport.error(&ClientError::shutting_down());
                    out.finish(bye, close_code::AWAY, conn::GOODBYE).await;
                    break;
                }
            }
            _ = tick.tick() => {
                let busy = d.conv.answering().is_some();
                if !conn::keep_alive(&d.state, &d.session.id, busy) {
                    out.close(Some(d.transport.error(&ClientError::expired())), close_code::POLICY);
                    break;
                }
                if let Some(e) = d.transport.overdue(Instant::now()) {
                    out.close(Some(d.transport.error(&e)), close_code::POLICY);
                    break;
                }
                d.conv.set_chars_per_second(d.state.speech_rate.chars_per_second());
            }
            Some(h) = channels.heard.recv() => d.heard(h).await,
            Some((id, result)) = channels.words.recv() => {
                d.transcribing.remove(&id);
                d.handle(None, Input::Transcribed { work: id, result }).await;
            }
            Some((id, result)) = channels.submitted.recv() => d.submitted(id, result).await,
            Some((id, ev)) = channels.answers.recv() => d.answer_event(id, ev).await,
            Some(pcm) = async { match mic.as_mut() { Some(m) => m.recv().await, None => None } } => {
                d.handle(None, Input::Audio(pcm)).await;
            }
            msg = stream.next() => match msg {
                None | Some(Inbound::Closed) => break,
                Some(Inbound::Broken(err, code)) => {
                    out.close(Some(d.transport.error(&err)), code);
                    break;
                }
                Some(Inbound::Text(t)) => d.client(Incoming::Text(&t)).await,
                Some(Inbound::Binary(b)) => d.client(Incoming::Binary(&b)).await,
                Some(Inbound::Pong(p)) => out.pong(&p),
                Some(Inbound::Key(k)) => {
                    let actions = d.transport.key(k, &d.conv);
                    d.act(actions).await;
                }
            }
        }
    }
    for (_, c) in d.cancels.drain() {
        let _ = c.send(true);
    }
    // Transcriptions nobody will read: stopped, their requests released.
    for (_, t) in d.transcribing.drain() {
        t.abort();
    }
    out.close(None, close_code::NORMAL);
}

struct Channels {
    heard: mpsc::UnboundedReceiver<Heard>,
    words: mpsc::UnboundedReceiver<(u64, Result<String, ClientError>)>,
    answers: mpsc::UnboundedReceiver<(String, AnswerEvent)>,
    submitted: mpsc::UnboundedReceiver<(String, Result<Answer, ClientError>)>,
}

struct Driver<T> {
    endpoint: &'static str,
    state: Arc<AppState>,
    transport: T,
    out: Outbox,
    conv: Conversation,
    session: SessionGuard,
    detector: Option<Detector>,
    heard_tx: mpsc::UnboundedSender<Heard>,
    words_tx: mpsc::UnboundedSender<(u64, Result<String, ClientError>)>,
    /// Transcriptions running, by work id (dropping the handle aborts one).
    transcribing: HashMap<u64, tokio::task::AbortHandle>,
    answers_tx: mpsc::UnboundedSender<(String, AnswerEvent)>,
    submitted_tx: mpsc::UnboundedSender<(String, Result<Answer, ClientError>)>,
    /// The running answers' cancel switches, by response id.
    cancels: HashMap<String, watch::Sender<bool>>,
}

impl<T: Transport> Driver<T> {
    fn send(&self, m: Message) {
        // A failed push means the connection is closing; the loop sees it.
        let _ = self.out.push(m);
    }

    /// A client message: activity for the session, then the transport's
    /// translation of it.
    async fn client(&mut self, m: Incoming<'_>) {
        // Any client message counts as activity; an expired session ends here.
        if !self.state.sessions.touch(&self.session.id) {
            let bye = self.transport.error(&ClientError::expired());
            self.out.close(Some(bye), close_code::POLICY);
            return;
        }
        let actions = self.transport.message(m, &self.conv);
        self.act(actions).await;
    }

    /// Does what the transport asked.
    async fn act(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Input { event_id, input } => self.handle(event_id, input).await,
                Action::Send(m) => self.send(m),
                Action::EndOfAudio => match &self.detector {
                    Some(d) => d.finish().await,
                    None => self.handle(None, Input::EndOfAudio { ended: None }).await,
                },
                Action::Close(e, code) => {
                    self.out.close(Some(self.transport.error(&e)), code);
                    return;
                }
            }
        }
    }

    async fn heard(&mut self, h: Heard) {
        match h {
            Heard::Speech(speech) => {
                let queued_s = self.transport.queued_seconds();
                self.handle(None, Input::Speech { speech, queued_s }).await;
            }
            Heard::Finished(ended) => self.handle(None, Input::EndOfAudio { ended }).await,
            Heard::Error(e) => self.notice(&e),
        }
    }

    /// Feeds the conversation, then does what it decided.
    async fn handle(&mut self, event_id: Option<String>, input: Input) {
        let audio = match &input {
            Input::Audio(pcm) if self.detector.is_some() => Some(pcm.clone()),
            _ => None,
        };
        // Turn detection or the input's rate changed: a fresh detector (or
        // none). An update that leaves both keeps the utterance under way.
        let changed = matches!(&input, Input::Configure(s)
            if s.turns != self.conv.settings().turns || s.input_rate != self.conv.settings().input_rate);
        self.conv.handle_from(event_id, input, Instant::now());
        if changed {
            self.restart_detector();
        }
        if let (Some(pcm), Some(d)) = (audio, &self.detector) {
            d.push(pcm).await;
        }
        self.flush().await;
    }

    /// A detector for the settings' turn detection, if on.
    fn restart_detector(&mut self) {
        self.detector = None;
        let (Some(turns), Some(hub)) = (&self.conv.settings().turns, &self.state.config.vad) else {
            return;
        };
        match Detector::start(
            turns,
            hub,
            self.conv.settings().input_rate,
            self.heard_tx.clone(),
        ) {
            Ok(d) => self.detector = Some(d),
            Err(e) => self.notice(&e),
        }
    }

    /// An error the connection outlives.
    fn notice(&self, e: &ClientError) {
        if let Some(m) = self.transport.notice(e) {
            self.send(m);
        }
    }

    /// Does the conversation's work, then sends its outputs.
    async fn flush(&mut self) {
        while let Some(w) = self.conv.poll_work() {
            self.work(w).await;
        }
        while let Some(o) = self.conv.poll_output() {
            if let Output::AnswerDone {
                answer,
                end: End::Completed(_),
                audio_seconds,
                generated_chars,
                ..
            } = &o
            {
                if answer.audio {
                    self.state
                        .speech_rate
                        .observe(*generated_chars, *audio_seconds);
                }
            }
            let slow = matches!(
                &o,
                Output::AnswerDone {
                    end: End::SlowClient,
                    ..
                }
            );
            if slow {
                self.out
                    .close_slow(self.transport.error(&ClientError::slow_client()));
                return;
            }
            match self.transport.output(o, &self.conv) {
                Ok(frames) => {
                    for m in frames {
                        self.send(m);
                    }
                }
                Err(Overflow) => {
                    self.out
                        .close_slow(self.transport.error(&ClientError::slow_client()));
                    return;
                }
            }
        }
    }

    async fn work(&mut self, w: Work) {
        match w {
            Work::Transcribe { id, audio } => {
                let state = self.state.clone();
                let endpoint = self.endpoint;
                let tx = self.words_tx.clone();
                let task = tokio::spawn(async move {
                    let r = listen::transcribe(&state, endpoint, audio).await;
                    let _ = tx.send((id, r));
                });
                self.transcribing.insert(id, task.abort_handle());
            }
            Work::Abandon { id } => {
                if let Some(t) = self.transcribing.remove(&id) {
                    t.abort();
                }
            }
            Work::Submit {
                response_id,
                mut spec,
                format,
            } => {
                // A cloned voice, by id: its embedding (and clip) from the store.
                if let Err(m) = self
                    .state
                    .speak_cloned(self.transport.voice_owner(), &mut spec)
                {
                    let _ = self
                        .submitted_tx
                        .send((response_id, Err(ClientError::param("voice", m))));
                    return;
                }
                let (cancel, cancel_rx) = watch::channel(false);
                self.cancels.insert(response_id.clone(), cancel);
                let state = self.state.clone();
                let control = Control {
                    cancel: cancel_rx,
                    slow: self.out.slow_flag(),
                };
                let meter = Meter::new(&state.metrics, self.endpoint);
                let tx = self.submitted_tx.clone();
                tokio::spawn(async move {
                    let r = Answer::start(&state, meter, *spec, format, Some(control)).await;
                    let _ = tx.send((response_id, r));
                });
            }
            Work::Cancel { response_id } => {
                if let Some(c) = self.cancels.get(&response_id) {
                    let _ = c.send(true);
                }
            }
            Work::ClearDetector => {
                if let Some(d) = &self.detector {
                    d.clear().await;
                }
            }
            Work::ClearPlayer => self.transport.clear_player(),
        }
    }

    async fn submitted(&mut self, response_id: String, r: Result<Answer, ClientError>) {
        match r {
            Ok(answer) => {
                let tx = self.answers_tx.clone();
                let out = self.out.clone();
                let task = TaskGuard::new(&self.state.metrics);
                tokio::spawn(pump(answer, response_id.clone(), out, tx, task));
                self.handle(None, Input::AnswerAccepted { response_id })
                    .await;
            }
            Err(error) => {
                self.cancels.remove(&response_id);
                self.handle(None, Input::AnswerRejected { response_id, error })
                    .await;
            }
        }
    }

    async fn answer_event(&mut self, response_id: String, ev: AnswerEvent) {
        let input = match ev {
            AnswerEvent::Text(delta) => Input::AnswerText { response_id, delta },
            AnswerEvent::ToolCall(call) => Input::AnswerToolCall { response_id, call },
            AnswerEvent::Audio { bytes, until_s } => Input::AnswerAudio {
                response_id,
                bytes,
                until_s,
            },
            AnswerEvent::Ended { end, audio_seconds } => {
                self.cancels.remove(&response_id);
                Input::AnswerEnded {
                    response_id,
                    end,
                    audio_seconds,
                }
            }
        };
        self.handle(None, input).await;
    }
}

/// One answer's task: pulls the pipeline's events while the connection has
/// room for them (the engine, not the session, waits on a slow client).
async fn pump(
    mut answer: Answer,
    id: String,
    out: Outbox,
    tx: mpsc::UnboundedSender<(String, AnswerEvent)>,
    _task: TaskGuard,
) {
    loop {
        if out.ready().await.is_err() {
            answer.abandon();
            let ended = AnswerEvent::Ended {
                end: End::Cancelled,
                audio_seconds: answer.audio_seconds(),
            };
            let _ = tx.send((id, ended));
            return;
        }
        let ev = match answer.next().await {
            Step::Text(t) => {
                answer.sent_text();
                AnswerEvent::Text(t)
            }
            Step::ToolCall(c) => AnswerEvent::ToolCall(c),
            Step::Audio(bytes) => {
                answer.sent_audio(bytes.len());
                AnswerEvent::Audio {
                    bytes,
                    until_s: answer.audio_seconds(),
                }
            }
            Step::End(end) => {
                // A cut-short Ogg Opus answer still ends its stream: a valid file.
                if matches!(end, End::Cancelled | End::Failed(_)) {
                    let tail = answer.seal();
                    if !tail.is_empty() {
                        let until_s = answer.audio_seconds();
                        let _ = tx.send((
                            id.clone(),
                            AnswerEvent::Audio {
                                bytes: tail,
                                until_s,
                            },
                        ));
                    }
                }
                let ended = AnswerEvent::Ended {
                    end,
                    audio_seconds: answer.audio_seconds(),
                };
                let _ = tx.send((id, ended));
                return;
            }
        };
        if tx.send((id.clone(), ev)).is_err() {
            answer.abandon();
            return;
        }
    }
}

#[cfg(test)]
mod tests;
