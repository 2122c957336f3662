//! The driver with the Realtime and the stream codecs over in-memory
//! channels and an engine of small deterministic stages: a slow Listener, a
//! Thinker that counts, a Talker and a Code2Wav that make 20 ms of audio per
//! word.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use candle_core::{Device, Tensor};
use futures_util::StreamExt;
use serde_json::{json, Value};

use omnistream_stages::engine::{
    Event, FrameChunk, Payload, Pipeline, RequestCtx, RequestId, RequestInput, StageDef,
    StageModel, StageRole, StepOutput, TextChunk,
};
use omnistream_stages::models::{ModelError, Result};

use super::*;
use crate::serve::sessions::SessionLimits;
use crate::serve::state::ServerConfig;
use crate::serve::transport::realtime::Realtime;
use crate::serve::transport::stream::PcmStream;

/// How long the Listener takes over a transcription.
const HEARING: Duration = Duration::from_millis(700);

/// Listener: "you said something", `HEARING` after the audio came.
#[derive(Default)]
struct SlowListener {
    reqs: HashMap<RequestId, (Arc<RequestCtx>, Instant)>,
}

impl StageModel for SlowListener {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        if !matches!(ctx.spec.input, RequestInput::Transcribe { .. }) {
            return Err(ModelError::Invalid("speech only".into()));
        }
        self.reqs.insert(ctx.id, (ctx, Instant::now()));
        Ok(())
    }
    fn push(&mut self, _: RequestId, _: Payload) -> Result<()> {
        Err(ModelError::Invalid("no input".into()))
    }
    fn step(&mut self, out: &mut StepOutput) {
        std::thread::sleep(Duration::from_millis(5));
        let done: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, (_, t))| t.elapsed() >= HEARING)
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            if let Some((ctx, _)) = self.reqs.remove(&id) {
                ctx.emit(Event::TextDelta("you said something".into()));
                out.finished.push(id);
            }
        }
    }
    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
    }
    fn has_ready_work(&self) -> bool {
        !self.reqs.is_empty()
    }
    fn active(&self) -> usize {
        self.reqs.len()
    }
}

/// Thinker: "one two three ..." up to 60 words, a word each 10 ms.
#[derive(Default)]
struct Counter {
    reqs: HashMap<RequestId, (Arc<RequestCtx>, usize)>,
}

impl StageModel for Counter {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        self.reqs.insert(ctx.id, (ctx, 0));
        Ok(())
    }
    fn push(&mut self, _: RequestId, _: Payload) -> Result<()> {
        Err(ModelError::Invalid("no input".into()))
    }
    fn step(&mut self, out: &mut StepOutput) {
        std::thread::sleep(Duration::from_millis(10));
        let ids: Vec<RequestId> = self.reqs.keys().copied().collect();
        out.batch = ids.len();
        for id in ids {
            let Some((ctx, n)) = self.reqs.get_mut(&id) else {
                continue;
            };
            *n += 1;
            let w = format!("w{n} ");
            ctx.emit(Event::TextDelta(w.clone()));
            ctx.add_completion_tokens(1);
            let finished = *n == 60;
            out.downstream
                .push((id, Payload::Text(TextChunk::text(w, vec![], finished))));
            if finished {
                self.reqs.remove(&id);
                out.finished.push(id);
            }
        }
    }
    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
    }
    fn has_ready_work(&self) -> bool {
        !self.reqs.is_empty()
    }
    fn active(&self) -> usize {
        self.reqs.len()
    }
}

/// Talker: a frame per word, at once.
#[derive(Default)]
struct FramePerWord {
    reqs: HashMap<RequestId, Vec<FrameChunk>>,
}

impl StageModel for FramePerWord {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        self.reqs.insert(ctx.id, Vec::new());
        Ok(())
    }
    fn push(&mut self, id: RequestId, p: Payload) -> Result<()> {
        let Payload::Text(t) = p else {
            return Err(ModelError::Invalid("text only".into()));
        };
        let frames = Tensor::ones((1, 2, 1), candle_core::DType::F32, &Device::Cpu).ok();
        if let Some(r) = self.reqs.get_mut(&id) {
            r.push(FrameChunk {
                frames,
                finished: t.finished,
            });
        }
        Ok(())
    }
    fn step(&mut self, out: &mut StepOutput) {
        for (id, chunks) in self.reqs.iter_mut() {
            for c in chunks.drain(..) {
                let finished = c.finished;
                out.downstream.push((*id, Payload::Frames(c)));
                if finished {
                    out.finished.push(*id);
                }
            }
        }
        self.reqs.retain(|id, _| !out.finished.contains(id));
    }
    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
    }
    fn has_ready_work(&self) -> bool {
        self.reqs.values().any(|c| !c.is_empty())
    }
    fn active(&self) -> usize {
        self.reqs.len()
    }
}

/// Code2Wav: 20 ms of a tone at 24 kHz per frame.
#[derive(Default)]
struct Tone {
    reqs: HashMap<RequestId, (Arc<RequestCtx>, usize, bool, u64)>,
}

impl StageModel for Tone {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        self.reqs.insert(ctx.id, (ctx, 0, false, 0));
        Ok(())
    }
    fn push(&mut self, id: RequestId, p: Payload) -> Result<()> {
        let Payload::Frames(f) = p else {
            return Err(ModelError::Invalid("frames only".into()));
        };
        if let Some(r) = self.reqs.get_mut(&id) {
            r.1 += f.len();
            r.2 |= f.finished;
        }
        Ok(())
    }
    fn step(&mut self, out: &mut StepOutput) {
        let ids: Vec<RequestId> = self.reqs.keys().copied().collect();
        for id in ids {
            let Some(r) = self.reqs.get_mut(&id) else {
                continue;
            };
            if r.1 > 0 {
                out.batch += 1;
                let samples = (0..480 * r.1)
                    .map(|i| (i as f32 * 0.05).sin() * 0.3)
                    .collect();
                r.0.emit(Event::Audio {
                    samples,
                    sample_rate: 24_000,
                    seq: r.3,
                });
                r.3 += 1;
                r.1 = 0;
            }
            if r.2 {
                self.reqs.remove(&id);
                out.finished.push(id);
            }
        }
    }
    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
    }
    fn has_ready_work(&self) -> bool {
        self.reqs.values().any(|r| r.1 > 0 || r.2)
    }
    fn active(&self) -> usize {
        self.reqs.len()
    }
}

fn state() -> Arc<AppState> {
    let pipeline = Pipeline::start(
        vec![
            StageDef::local(
                "listener",
                StageRole::Listener,
                Box::<SlowListener>::default(),
                8,
            ),
            StageDef::local("thinker", StageRole::Thinker, Box::<Counter>::default(), 8),
            StageDef::local(
                "talker",
                StageRole::Talker,
                Box::<FramePerWord>::default(),
                8,
            ),
            StageDef::local("code2wav", StageRole::Code2Wav, Box::<Tone>::default(), 8),
        ],
        Some(24_000),
    )
    .expect("pipeline");
    let config = ServerConfig {
        model_name: "fake".into(),
        api_keys: vec![],
        allowed_origins: vec![],
        allowed_hosts: vec![],
        limits: SessionLimits::default(),
        vad: None,
        devices: vec![],
        voice_aliases: Default::default(),
        voice_store: None,
    };
    AppState::new(pipeline, config).expect("state")
}

/// A Realtime client of `driver::run` over channels.
struct Client {
    tx: mpsc::Sender<Inbound>,
    rx: futures_channel::mpsc::Receiver<Message>,
    task: tokio::task::JoinHandle<()>,
}

impl Client {
    /// A Realtime client.
    fn start(state: &Arc<AppState>) -> Self {
        Self::start_with(state, "realtime", |id| {
            Realtime::new(state.clone(), id, None)
        })
    }

    /// A client of the transport `codec(session id)` makes.
    fn start_with<T: Transport + Send + 'static>(
        state: &Arc<AppState>,
        kind: &'static str,
        codec: impl FnOnce(String) -> T,
    ) -> Self {
        let (tx, in_rx) = mpsc::channel(64);
        let (out_tx, rx) = futures_channel::mpsc::channel(1024);
        let slow = Message::Text("slow".into());
        let out = Outbox::start_on(out_tx, &state.metrics, slow, false);
        let session = state.sessions.open(kind).expect("session");
        let codec = codec(session.id.clone());
        let inbound = tokio_stream::wrappers::ReceiverStream::new(in_rx);
        let task = tokio::spawn(run(state.clone(), codec, out, inbound, session, None));
        Self { tx, rx, task }
    }

    async fn send(&self, v: Value) {
        self.tx
            .send(Inbound::Text(v.to_string()))
            .await
            .expect("send");
    }

    async fn message(&mut self) -> Message {
        tokio::time::timeout(Duration::from_secs(10), self.rx.next())
            .await
            .expect("an event in time")
            .expect("the connection is open")
    }

    async fn next(&mut self) -> Value {
        match self.message().await {
            Message::Text(t) => serde_json::from_str(&t).expect("JSON"),
            other => panic!("not an event: {other:?}"),
        }
    }

    /// Events up to one of type `kind` (its index in `seen` after).
    /// A second of (silent) speech appended and committed: the turn's
    /// `input_audio_buffer.committed`, its transcription under way.
    async fn commit_a_turn(&mut self, seen: &mut Vec<String>) -> Value {
        self.send(json!({"type": "input_audio_buffer.append", "audio": pcm_b64(1.0)}))
            .await;
        self.send(json!({"type": "input_audio_buffer.commit"}))
            .await;
        self.until("input_audio_buffer.committed", seen).await
    }

    async fn until(&mut self, kind: &str, seen: &mut Vec<String>) -> Value {
        loop {
            let v = self.next().await;
            let k = v["type"].as_str().unwrap_or_default().to_string();
            seen.push(k.clone());
            assert_ne!(k, "error", "{v}");
            if k == kind {
                return v;
            }
        }
    }
}

fn pcm_b64(seconds: f64) -> String {
    let n = (24_000.0 * seconds) as usize;
    base64::engine::general_purpose::STANDARD.encode(vec![0u8; n * 2])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_events_are_handled_while_a_turn_is_transcribed() {
    let state = state();
    let mut c = Client::start(&state);
    let mut seen = Vec::new();
    c.until("session.created", &mut seen).await;
    let committed = c.commit_a_turn(&mut seen).await;
    let t0 = Instant::now();
    // The Listener takes 700 ms; the client goes on meanwhile.
    c.send(
        json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "count"}]}}),
    )
    .await;
    c.send(json!({"type": "response.create"})).await;
    let created = c.until("response.created", &mut seen).await;
    assert!(
        t0.elapsed() < HEARING,
        "the answer waited for the transcription"
    );
    let rid = created["response"]["id"].clone();
    c.until("response.output_audio.delta", &mut seen).await;
    c.send(json!({"type": "response.cancel"})).await;
    let done = c.until("response.done", &mut seen).await;
    assert_eq!(done["response"]["id"], rid);
    assert_eq!(done["response"]["status"], "cancelled", "{done}");
    let t = c
        .until(
            "conversation.item.input_audio_transcription.completed",
            &mut seen,
        )
        .await;
    assert_eq!(t["item_id"], committed["item_id"]);
    assert_eq!(t["transcript"], "you said something");
    // The turn joined the conversation: the next answer hears it after the typed one.
    c.send(json!({"type": "response.create", "response": {"output_modalities": ["text"]}}))
        .await;
    let done = c.until("response.done", &mut seen).await;
    assert_eq!(done["response"]["status"], "completed", "{done}");
    let closed = {
        drop(c.tx);
        tokio::time::timeout(Duration::from_secs(5), c.task).await
    };
    assert!(closed.is_ok(), "the driver ends when the client goes");
    assert_eq!(state.sessions.count(), 0);
    assert_eq!(state.sessions.in_flight(), 0, "every request released");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_dropped_and_its_answer_cancelled() {
    let state = state();
    let (tx, in_rx) = mpsc::channel(64);
    // Room for 4 messages, never read: the answer's task waits on the
    // Outbox, not the driver, which still handles the client's events.
    let (out_tx, rx) = futures_channel::mpsc::channel::<Message>(4);
    let out = Outbox::start_on(out_tx, &state.metrics, Message::Text("slow".into()), false);
    let session = state.sessions.open("realtime").expect("session");
    let codec = Realtime::new(state.clone(), session.id.clone(), None);
    let inbound = tokio_stream::wrappers::ReceiverStream::new(in_rx);
    let task = tokio::spawn(run(state.clone(), codec, out, inbound, session, None));
    let item = json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "count"}]}});
    tx.send(Inbound::Text(item.to_string()))
        .await
        .expect("send");
    tx.send(Inbound::Text(
        json!({"type": "response.create"}).to_string(),
    ))
    .await
    .expect("send");
    // The writer gives up on the stuck sink (5 s) and ends the session.
    let ended = tokio::time::timeout(Duration::from_secs(20), task).await;
    assert!(ended.is_ok(), "the session did not end");
    drop(rx);
    let t0 = Instant::now();
    while state.sessions.in_flight() > 0 && t0.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(state.sessions.in_flight(), 0, "the answer was not released");
    assert_eq!(state.metrics.slow_clients.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_mid_transcription_releases_it_at_once() {
    let state = state();
    let mut c = Client::start(&state);
    let mut seen = Vec::new();
    c.until("session.created", &mut seen).await;
    c.commit_a_turn(&mut seen).await;
    // The transcription takes its slot in a task of its own, just after the
    // `committed` event, and holds it for `HEARING`.
    let t0 = Instant::now();
    while state.sessions.in_flight() == 0 && t0.elapsed() < HEARING {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(state.sessions.in_flight(), 1, "the transcription runs");
    let t0 = Instant::now();
    drop(c.tx);
    tokio::time::timeout(Duration::from_secs(5), c.task)
        .await
        .expect("the driver ends")
        .expect("no panic");
    while state.sessions.in_flight() > 0 && t0.elapsed() < HEARING {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        state.sessions.in_flight(),
        0,
        "the transcription outlived its client"
    );
    assert!(
        t0.elapsed() < HEARING / 2,
        "released after {:?}",
        t0.elapsed()
    );
}

/// The stream codec (`/v1/stream`) over the same driver: a typed turn
/// cancelled mid-answer, then a spoken turn heard, answered and completed,
/// its audio in binary frames between `audio_start` and `done`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_codec_answers_typed_and_spoken_turns() {
    let state = state();
    let mut c = Client::start_with(&state, "stream", |id| PcmStream::new(state.clone(), id));
    // Events (text frames) up to one of `kind`, and the audio bytes before it.
    async fn until(c: &mut Client, kind: &str) -> (Value, usize) {
        let mut audio = 0;
        loop {
            match c.message().await {
                Message::Binary(b) => audio += b.len(),
                Message::Text(t) => {
                    let v: Value = serde_json::from_str(&t).expect("JSON");
                    assert_ne!(v["type"], "error", "{v}");
                    if v["type"] == kind {
                        return (v, audio);
                    }
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    c.send(json!({"type": "start", "sample_rate": 24000})).await;
    let (started, _) = until(&mut c, "started").await;
    assert_eq!(started["sample_rate"], 24000);

    c.send(json!({"type": "text", "text": "count"})).await;
    let (a, _) = until(&mut c, "audio_start").await;
    let (_, bytes) = until(&mut c, "transcript").await;
    c.send(json!({"type": "cancel"})).await;
    let (done, _) = until(&mut c, "done").await;
    assert_eq!(done["response_id"], a["response_id"]);
    assert_eq!(done["status"], "cancelled", "{done} after {bytes} bytes");

    // A second of speech, then its end: heard, then answered in full.
    c.tx.send(Inbound::Binary(vec![0u8; 48_000]))
        .await
        .expect("send");
    c.send(json!({"type": "audio_end"})).await;
    let (heard, _) = until(&mut c, "input_transcript").await;
    assert_eq!(heard["text"], "you said something");
    let (b, _) = until(&mut c, "audio_start").await;
    assert_ne!(b["response_id"], a["response_id"]);
    let (done, bytes) = until(&mut c, "done").await;
    assert_eq!(done["status"], "completed", "{done}");
    assert!(bytes > 0 && bytes % 2 == 0, "{bytes} bytes of pcm16");
    // Audio seconds as sent: the bytes at 24 kHz.
    let seconds = done["audio_seconds"].as_f64().expect("audio_seconds");
    assert!((seconds - bytes as f64 / 48_000.0).abs() < 1e-6, "{done}");

    drop(c.tx);
    tokio::time::timeout(Duration::from_secs(5), c.task)
        .await
        .expect("the driver ends")
        .expect("no panic");
    assert_eq!(state.sessions.count(), 0);
    assert_eq!(state.sessions.in_flight(), 0, "every request released");
    // Counted once each, in the one vocabulary: the spoken turn's
    // transcription and answer `ok`, the typed answer `cancelled`.
    let count = |outcome: &str| {
        state
            .metrics
            .requests
            .with_label_values(&["stream", outcome])
            .get()
    };
    assert_eq!((count("ok"), count("cancelled")), (2, 1));
}
