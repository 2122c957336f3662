//! The WebSocket endpoints end to end: a real `omnistream serve` on loopback,
//! real models, a Rust WebSocket client (tokio-tungstenite).
//!
//! `/v1/realtime` (OpenAI Realtime, GA event names) and `/v1/stream` (plain
//! PCM, or Ogg Opus both ways): answers, audio, cancellation, concurrency without cross-talk, bad
//! input, connection churn and a client that stops reading.

use std::path::Path;
use std::time::{Duration, Instant};

use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use omnistream_codecs::decode_ogg_opus;
use omnistream_codecs::pcm::pcm16_le_to_f32;
use omnistream_codecs::wav::write_wav;
use omnistream_e2e::{http_get, spawn_server, whisper_wer, Server};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One server at a time: the models share two cores, and the leak checks
/// (sessions, tasks, stage activity) need the server to themselves.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const EVENT_TIMEOUT: Duration = Duration::from_secs(180);

async fn connect(server: &Server, path: &str) -> Ws {
    let (ws, _) = tokio_tungstenite::connect_async(server.ws_url(path))
        .await
        .unwrap_or_else(|e| panic!("connecting to {path}: {e}"));
    ws
}

async fn send(ws: &mut Ws, v: Value) {
    ws.send(Message::text(v.to_string())).await.expect("send");
}

/// The next text or binary message (pings are answered by the client library).
async fn next_msg(ws: &mut Ws) -> Option<Message> {
    loop {
        let m = tokio::time::timeout(EVENT_TIMEOUT, ws.next())
            .await
            .expect("no message from the server in time");
        match m {
            None | Some(Err(_)) => return None,
            Some(Ok(Message::Ping(_) | Message::Pong(_) | Message::Frame(_))) => continue,
            Some(Ok(Message::Close(_))) => return None,
            Some(Ok(m)) => return Some(m),
        }
    }
}

/// The next server event (JSON text), checked for `type` and `event_id`.
async fn next_event(ws: &mut Ws) -> Value {
    match next_msg(ws).await {
        Some(Message::Text(t)) => {
            let v: Value = serde_json::from_str(&t).expect("server events are JSON");
            assert!(v["type"].is_string(), "event without type: {v}");
            v
        }
        other => panic!("expected a JSON event, got {other:?}"),
    }
}

/// Reads events until one of type `kind`; fails on an unexpected `error`.
async fn expect(ws: &mut Ws, kind: &str) -> Value {
    loop {
        let v = next_event(ws).await;
        if v["type"] == kind {
            return v;
        }
        assert_ne!(v["type"], "error", "while waiting for {kind}: {v}");
    }
}

/// Reads events until an `error`, returning its code (other events are skipped).
async fn expect_error(ws: &mut Ws) -> Value {
    loop {
        let v = next_event(ws).await;
        if v["type"] == "error" {
            return v;
        }
    }
}

/// Standard base64 (the test crate has no base64 dependency).
fn b64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => u32::from(c - b'A'),
            b'a'..=b'z' => u32::from(c - b'a') + 26,
            b'0'..=b'9' => u32::from(c - b'0') + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c:?}"),
        }
    };
    let bytes: Vec<u8> = s.bytes().filter(|c| *c != b'=').collect();
    let mut out = Vec::with_capacity(bytes.len() * 3 / 4);
    for chunk in bytes.chunks(4) {
        let mut acc = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            acc |= val(*c) << (18 - 6 * i);
        }
        let n = chunk.len() * 6 / 8;
        for i in 0..n {
            out.push((acc >> (16 - 8 * i)) as u8);
        }
    }
    out
}

/// Everything one realtime response sent.
#[derive(Default, Debug)]
struct Answer {
    text: String,
    transcript: String,
    pcm: Vec<u8>,
    kinds: Vec<String>,
    done: Value,
}

impl Answer {
    fn audio_seconds(&self) -> f64 {
        self.pcm.len() as f64 / 2.0 / 24_000.0
    }
}

/// Reads one response from `response.created` to `response.done`, checking
/// ids on the way.
async fn read_response(ws: &mut Ws) -> Answer {
    let created = expect(ws, "response.created").await;
    let rid = created["response"]["id"]
        .as_str()
        .expect("response id")
        .to_string();
    let mut a = Answer::default();
    loop {
        let v = next_event(ws).await;
        let kind = v["type"].as_str().unwrap_or_default().to_string();
        assert!(
            v["event_id"].as_str().is_some_and(|e| !e.is_empty()),
            "no event_id: {v}"
        );
        assert_ne!(kind, "error", "error during the response: {v}");
        if kind.ends_with(".delta") {
            assert_eq!(v["response_id"], rid.as_str(), "{v}");
            assert!(v["item_id"].is_string(), "{v}");
            assert_eq!(v["output_index"], 0, "{v}");
            assert_eq!(v["content_index"], 0, "{v}");
        }
        match kind.as_str() {
            "response.output_text.delta" => a.text += v["delta"].as_str().unwrap_or_default(),
            "response.output_audio_transcript.delta" => {
                a.transcript += v["delta"].as_str().unwrap_or_default()
            }
            "response.output_audio.delta" => a
                .pcm
                .extend(b64_decode(v["delta"].as_str().expect("audio delta"))),
            "response.done" => {
                assert_eq!(v["response"]["id"], rid.as_str());
                a.kinds.push(kind);
                a.done = v;
                return a;
            }
            _ => {}
        }
        a.kinds.push(kind);
    }
}

/// Adds a user message and asks for a response.
async fn ask(ws: &mut Ws, text: &str, response: Value) {
    send(
        ws,
        json!({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}],
        }}),
    )
    .await;
    let item = expect(ws, "conversation.item.created").await;
    assert_eq!(item["item"]["role"], "user");
    send(ws, json!({"type": "response.create", "response": response})).await;
}

fn status(a: &Answer) -> &str {
    a.done["response"]["status"].as_str().unwrap_or_default()
}

/// `omnistream_stage{metric="active_requests",...}` of every stage.
fn active_requests(server: &Server) -> Vec<f64> {
    server
        .metrics()
        .lines()
        .filter(|l| l.starts_with("omnistream_stage{") && l.contains("metric=\"active_requests\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect()
}

/// Polls until `cond` holds (or fails with `what`).
async fn eventually(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < timeout, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The server is back to idle: no sessions, tasks, requests; healthy.
async fn assert_idle(server: &Server) {
    eventually(
        "omnistream_sessions_open 0",
        Duration::from_secs(20),
        || server.metric("omnistream_sessions_open") == Some(0.0),
    )
    .await;
    eventually("omnistream_tasks_open 0", Duration::from_secs(20), || {
        server.metric("omnistream_tasks_open") == Some(0.0)
    })
    .await;
    eventually("no stage holds a request", Duration::from_secs(20), || {
        let a = active_requests(server);
        !a.is_empty() && a.iter().all(|v| *v == 0.0)
    })
    .await;
    let health = http_get(server.port, "/health");
    assert!(health.contains("\"ok\""), "health: {health}");
}

/// Lower-case word stems (the first five letters: "penguins" ~ "penguin").
fn words(s: &str) -> Vec<String> {
    s.split(|c: char| !c.is_alphanumeric() && c != '\'')
        .filter(|w| !w.is_empty())
        .map(|w| w.to_lowercase().chars().take(5).collect())
        .collect()
}

/// Share of `reference`'s words found in `text`.
fn overlap(reference: &str, text: &str) -> f64 {
    let have = words(text);
    let want = words(reference);
    let hit = want.iter().filter(|w| have.contains(w)).count();
    hit as f64 / want.len().max(1) as f64
}

fn write_pcm16_wav(path: &Path, pcm: &[u8], rate: u32) {
    let samples = pcm16_le_to_f32(pcm).expect("pcm16");
    write_wav(path, &samples, rate).expect("write wav");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn realtime_answers_in_text_and_audio_over_turns() {
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let mut ws = connect(&server, "/v1/realtime").await;
    let created = expect(&mut ws, "session.created").await;
    assert!(created["session"]["id"].is_string(), "{created}");
    assert_eq!(
        created["session"]["audio"]["output"]["format"]["rate"],
        24000
    );
    send(
        &mut ws,
        json!({"type": "session.update", "session": {
            "type": "realtime",
            "audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "joe"},
                      "input": {"turn_detection": null}},
            "max_output_tokens": 48, "temperature": 0,
        }}),
    )
    .await;
    let updated = expect(&mut ws, "session.updated").await;
    assert_eq!(updated["session"]["max_output_tokens"], 48);

    // Turn 1: text only.
    ask(
        &mut ws,
        "What is the capital of France?",
        json!({"output_modalities": ["text"]}),
    )
    .await;
    let first = read_response(&mut ws).await;
    assert_eq!(status(&first), "completed", "{:?}", first.done);
    assert!(first.text.contains("Paris"), "answer: {:?}", first.text);
    assert!(first.pcm.is_empty(), "a text response carries no audio");
    for k in [
        "response.output_item.added",
        "response.output_text.done",
        "response.output_item.done",
    ] {
        assert!(
            first.kinds.iter().any(|x| x == k),
            "no {k}: {:?}",
            first.kinds
        );
    }
    let usage1 = first.done["response"]["usage"].clone();
    assert!(
        usage1["output_tokens"].as_u64().unwrap_or(0) > 0,
        "{usage1}"
    );

    // Turn 2: audio (the session default), with the first answer in the history.
    let sentence = "The weather today is sunny and warm.";
    ask(&mut ws, &format!("Repeat after me: {sentence}"), json!({})).await;
    let second = read_response(&mut ws).await;
    assert_eq!(status(&second), "completed", "{:?}", second.done);
    assert!(
        second.text.is_empty(),
        "audio responses send transcript deltas"
    );
    assert!(
        overlap(sentence, &second.transcript) >= 0.6,
        "transcript: {:?}",
        second.transcript
    );
    assert!(
        second.audio_seconds() > 0.5,
        "{} s of audio",
        second.audio_seconds()
    );
    for k in [
        "response.output_audio.done",
        "response.output_audio_transcript.done",
    ] {
        assert!(
            second.kinds.iter().any(|x| x == k),
            "no {k}: {:?}",
            second.kinds
        );
    }
    // Multi-turn: the second prompt holds the first exchange.
    let usage2 = &second.done["response"]["usage"];
    let (in1, out1, in2) = (
        usage1["input_tokens"].as_u64().unwrap_or(0),
        usage1["output_tokens"].as_u64().unwrap_or(0),
        usage2["input_tokens"].as_u64().unwrap_or(0),
    );
    assert!(
        in2 > in1 + out1,
        "history not in the prompt: {usage1} then {usage2}"
    );

    // The audio says the transcript (a sanity check on one short clip: one
    // word in five; the 10% bar is in the /v1/stream test, over four clips).
    let dir = tempfile::tempdir().expect("tempdir");
    let wav = dir.path().join("realtime.wav");
    write_pcm16_wav(&wav, &second.pcm, 24_000);
    let (wer, detail) = whisper_wer(&[(wav, second.transcript.clone())]);
    assert!(wer <= 0.35, "WER {wer:.3}: {detail}"); // one short clip: see test_openai.py

    drop(ws);
    assert_idle(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn realtime_cancel_mid_answer_frees_every_stage() {
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let mut ws = connect(&server, "/v1/realtime").await;
    expect(&mut ws, "session.created").await;
    ask(
        &mut ws,
        "Tell me a long story about a brave knight and a dragon.",
        json!({"max_output_tokens": 200}),
    )
    .await;
    let created = expect(&mut ws, "response.created").await;
    let rid = created["response"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    expect(&mut ws, "response.output_audio.delta").await;
    // One response at a time.
    send(
        &mut ws,
        json!({"type": "response.create", "event_id": "evt_2"}),
    )
    .await;
    let err = expect_error(&mut ws).await;
    assert_eq!(
        err["error"]["code"], "conversation_already_has_active_response",
        "{err}"
    );
    assert_eq!(err["error"]["event_id"], "evt_2", "{err}");
    send(&mut ws, json!({"type": "response.cancel"})).await;
    let done = expect(&mut ws, "response.done").await;
    assert_eq!(done["response"]["id"], rid.as_str());
    assert_eq!(done["response"]["status"], "cancelled", "{done}");
    eventually("the stages go idle", Duration::from_secs(10), || {
        let a = active_requests(&server);
        !a.is_empty() && a.iter().all(|v| *v == 0.0)
    })
    .await;
    // Nothing more of the cancelled answer; the session goes on.
    ask(
        &mut ws,
        "What is two plus two?",
        json!({"output_modalities": ["text"], "max_output_tokens": 16}),
    )
    .await;
    let next = read_response(&mut ws).await;
    assert!(
        matches!(status(&next), "completed" | "incomplete"),
        "{:?}",
        next.done
    );
    assert!(!next.text.is_empty() && next.pcm.is_empty());
    // ignore_eos (the extension benchmarks use, as on chat): exactly the limit.
    ask(
        &mut ws,
        "Say yes.",
        json!({"output_modalities": ["text"], "max_output_tokens": 24, "ignore_eos": true}),
    )
    .await;
    let exact = read_response(&mut ws).await;
    assert_eq!(
        exact.done["response"]["usage"]["output_tokens"], 24,
        "{:?}",
        exact.done
    );
    drop(ws);
    assert_idle(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_speaks_at_every_rate_intelligibly() {
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut pairs = Vec::new();
    let sentence = "Please call me back tomorrow morning.";
    for rate in [8_000u32, 16_000, 24_000, 48_000] {
        let mut ws = connect(&server, "/v1/stream").await;
        send(
            &mut ws,
            json!({"type": "start", "sample_rate": rate, "voice": "joe"}),
        )
        .await;
        let started = next_event(&mut ws).await;
        assert_eq!(started["type"], "started", "{started}");
        assert!(started["session_id"].is_string());
        send(
            &mut ws,
            json!({"type": "text", "text": format!("Repeat after me: {sentence}")}),
        )
        .await;
        let (pcm, transcript, done) = read_stream_answer(&mut ws, None).await;
        assert_eq!(done["status"], "completed", "{done}");
        let secs = done["audio_seconds"].as_f64().expect("audio_seconds");
        assert!(pcm.len() % 2 == 0);
        let samples = (pcm.len() / 2) as f64;
        assert!(
            (samples - secs * f64::from(rate)).abs() <= 2.0,
            "{rate} Hz: {samples} samples for {secs} s"
        );
        assert!(secs > 1.0, "{rate} Hz: only {secs} s");
        assert!(
            overlap(sentence, &transcript) >= 0.6,
            "transcript: {transcript:?}"
        );
        let wav = dir.path().join(format!("stream_{rate}.wav"));
        write_pcm16_wav(&wav, &pcm, rate);
        pairs.push((wav, transcript));
        ws.close(None).await.ok();
    }
    let (wer, detail) = whisper_wer(&pairs);
    assert!(wer <= 0.10, "WER {wer:.3} > 10%: {detail}");
    assert_idle(&server).await;
}

/// One `/v1/stream` answer: its audio bytes, transcript and `done` event;
/// sends `cancel` once `cancel_after` bytes of audio came.
async fn read_stream_answer(ws: &mut Ws, cancel_after: Option<usize>) -> (Vec<u8>, String, Value) {
    let mut audio = Vec::new();
    let mut transcript = String::new();
    let mut response_id = None;
    let mut cancelled = false;
    let done = loop {
        match next_msg(ws).await.expect("the stream ended early") {
            Message::Binary(b) => {
                assert!(response_id.is_some(), "audio before audio_start");
                audio.extend_from_slice(&b);
                if cancel_after.is_some_and(|n| audio.len() >= n) && !cancelled {
                    cancelled = true;
                    send(ws, json!({"type": "cancel"})).await;
                }
            }
            Message::Text(t) => {
                let v: Value = serde_json::from_str(&t).expect("JSON");
                match v["type"].as_str().unwrap_or_default() {
                    "audio_start" => response_id = Some(v["response_id"].clone()),
                    "transcript" => transcript += v["text"].as_str().unwrap_or_default(),
                    "done" => break v,
                    other => panic!("unexpected {other}: {v}"),
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(Some(done["response_id"].clone()), response_id);
    (audio, transcript, done)
}

/// Reads `/v1/stream` messages until the event `kind`; fails on an error.
async fn expect_stream(ws: &mut Ws, kind: &str) -> Value {
    loop {
        let v = next_event(ws).await;
        assert_ne!(v["type"], "error", "while waiting for {kind}: {v}");
        if v["type"] == kind {
            return v;
        }
    }
}

/// Sends `bytes` in binary frames of uneven sizes (Ogg pages split anywhere).
async fn send_split(ws: &mut Ws, bytes: &[u8]) {
    let mut rest = bytes;
    for size in [1usize, 700, 33, 4096].iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (now, later) = rest.split_at((*size).min(rest.len()));
        ws.send(Message::binary(now.to_vec())).await.expect("send");
        rest = later;
    }
}

/// Sends `audio_end`; returns the seconds the server reports buffered.
async fn audio_end(ws: &mut Ws) -> f64 {
    send(ws, json!({"type": "audio_end"})).await;
    let v = next_event(ws).await;
    assert_eq!(v["type"], "audio_received", "{v}");
    v["seconds"].as_f64().expect("seconds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_speaks_and_hears_ogg_opus() {
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let mut ws = connect(&server, "/v1/stream").await;
    // Opus is 48 kHz both ways: another rate is refused, not ignored.
    send(
        &mut ws,
        json!({"type": "start", "format": "opus", "sample_rate": 16000}),
    )
    .await;
    assert_eq!(next_event(&mut ws).await["code"], "unsupported_sample_rate");
    send(&mut ws, json!({"type": "start", "format": "mp3"})).await;
    let e = next_event(&mut ws).await;
    assert_eq!(e["code"], "invalid_event", "{e}");
    assert!(
        e["message"].as_str().is_some_and(|m| m.contains("opus")),
        "{e}"
    );
    send(&mut ws, json!({"type": "start", "format": "opus"})).await;
    let started = next_event(&mut ws).await;
    assert_eq!(started["type"], "started", "{started}");
    assert_eq!(started["format"], "opus");
    assert_eq!(started["sample_rate"], 48_000);

    // Output: each answer is one whole Ogg Opus stream, and it is heard.
    let sentence = "Please call me back tomorrow morning.";
    send(
        &mut ws,
        json!({"type": "text", "text": format!("Repeat after me: {sentence}")}),
    )
    .await;
    let (answer, transcript, done) = read_stream_answer(&mut ws, None).await;
    assert_eq!(done["status"], "completed", "{done}");
    let (pcm, rate) = decode_ogg_opus(&answer).expect("the answer is one valid Ogg Opus stream");
    assert_eq!(rate, 48_000);
    let secs = done["audio_seconds"].as_f64().expect("audio_seconds");
    let decoded = pcm.len() as f64 / 48_000.0;
    assert!(
        secs > 1.0 && (decoded - secs).abs() < 0.03,
        "{decoded} s decoded, {secs} s said"
    );
    let dir = tempfile::tempdir().expect("tempdir");
    let wav = dir.path().join("answer_opus.wav");
    write_wav(&wav, &pcm, 48_000).expect("write wav");
    let (wer, detail) = whisper_wer(&[(wav, transcript.clone())]);
    assert!(wer <= 0.10, "WER {wer:.3} > 10%: {detail}");

    // Input: that answer sent back as speech, its Ogg pages split anywhere,
    // is decoded whole, transcribed and answered.
    send_split(&mut ws, &answer).await;
    let heard = audio_end(&mut ws).await;
    assert!(
        (heard - decoded).abs() < 0.03,
        "{heard} s taken of {decoded} s"
    );
    let said = expect_stream(&mut ws, "input_transcript").await;
    let said = said["text"].as_str().unwrap_or_default().to_string();
    assert!(
        overlap(&transcript, &said) >= 0.8,
        "heard {said:?} for {transcript:?}"
    );
    let (reply, _, done) = read_stream_answer(&mut ws, None).await;
    assert_eq!(done["status"], "completed", "{done}");
    decode_ogg_opus(&reply).expect("the reply is a valid Ogg Opus stream");

    // A truncated stream: a clear error; what was decoded before the cut is
    // still taken (and, heard, answered).
    send_split(&mut ws, &answer[..answer.len() / 2]).await;
    send(&mut ws, json!({"type": "audio_end"})).await;
    let e = next_event(&mut ws).await;
    assert_eq!(e["code"], "truncated_audio", "{e}");
    let v = next_event(&mut ws).await;
    assert_eq!(v["type"], "audio_received", "{v}");
    let cut = v["seconds"].as_f64().expect("seconds");
    assert!(cut > 0.2 && cut < decoded, "{cut} s of {decoded} s");
    let said = expect_stream(&mut ws, "input_transcript").await;
    if said["text"].as_str().is_some_and(|t| !t.is_empty()) {
        let (_, _, done) = read_stream_answer(&mut ws, None).await;
        assert_eq!(done["status"], "completed", "{done}");
    }

    // Garbage: refused once, then its stream's later bytes too; nothing was
    // taken, so audio_end has nothing to hear.
    ws.send(Message::binary(b"RIFF....WAVEfmt not ogg at all".repeat(8)))
        .await
        .expect("send");
    assert_eq!(next_event(&mut ws).await["code"], "invalid_audio");
    ws.send(Message::binary(answer[..100].to_vec()))
        .await
        .expect("send");
    assert_eq!(next_event(&mut ws).await["code"], "invalid_audio");
    assert_eq!(audio_end(&mut ws).await, 0.0);

    // A cancelled answer still ends its Ogg stream: the bytes are a valid file.
    send(
        &mut ws,
        json!({"type": "text", "text": "Tell me a long story about the sea."}),
    )
    .await;
    let (ogg, _, done) = read_stream_answer(&mut ws, Some(1)).await;
    assert_eq!(done["status"], "cancelled", "{done}");
    decode_ogg_opus(&ogg).expect("a cancelled answer is still a valid Ogg Opus stream");
    ws.close(None).await.ok();
    assert_idle(&server).await;
}

const SENTENCES: [&str; 16] = [
    "The purple elephant visits Paris every spring.",
    "My grandmother bakes apple pies on Sundays.",
    "Seven sailors crossed the stormy ocean at night.",
    "The library closes early on public holidays.",
    "A tiny robot painted the fence bright yellow.",
    "Fresh bread smells wonderful in the morning.",
    "The football match was cancelled because of snow.",
    "Our neighbor plays the violin beautifully.",
    "The train to Boston departs at noon.",
    "Penguins swim very fast in cold water.",
    "She planted tomatoes and carrots in the garden.",
    "The old clock tower rings every hour.",
    "Two cats slept on the warm windowsill.",
    "The doctor told him to drink more water.",
    "Thunder rolled across the quiet valley.",
    "We watched the stars from the mountain top.",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_realtime_sessions_without_cross_talk() {
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let url = server.ws_url("/v1/realtime");
    let mut tasks = Vec::new();
    for (i, sentence) in SENTENCES.iter().enumerate() {
        let url = url.clone();
        tasks.push(tokio::spawn(async move {
            let (mut ws, _) = tokio_tungstenite::connect_async(url)
                .await
                .expect("connect");
            expect(&mut ws, "session.created").await;
            ask(
                &mut ws,
                &format!("Repeat after me: {sentence}"),
                json!({"max_output_tokens": 40}),
            )
            .await;
            let a = read_response(&mut ws).await;
            ws.close(None).await.ok();
            (i, a)
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.push(t.await.expect("session task"));
    }
    let table: String = answers
        .iter()
        .map(|(i, a)| format!("\n  {i}: {:?} -> {:?}", SENTENCES[*i], a.transcript))
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut pairs = Vec::new();
    for (i, a) in answers {
        assert_eq!(status(&a), "completed", "session {i}: {:?}", a.done);
        assert!(
            a.audio_seconds() > 0.5,
            "session {i}: {} s",
            a.audio_seconds()
        );
        // Its own sentence, and nobody else's.
        let own = overlap(SENTENCES[i], &a.transcript);
        assert!(
            own >= 0.5,
            "session {i} did not repeat its sentence:{table}"
        );
        for (j, other) in SENTENCES.iter().enumerate() {
            if j != i {
                assert!(
                    overlap(other, &a.transcript) < own,
                    "session {i} sounds like {j}:{table}"
                );
            }
        }
        let wav = dir.path().join(format!("session_{i}.wav"));
        write_pcm16_wav(&wav, &a.pcm, 24_000);
        pairs.push((wav, a.transcript));
    }
    // The audio of each session says its own transcript.
    let (wer, detail) = whisper_wer(&pairs);
    eprintln!("WER {wer:.3}: {detail}");
    assert!(wer <= 0.10, "WER {wer:.3}: {detail}");
    assert_idle(&server).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_gets_clear_errors() {
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let mut ws = connect(&server, "/v1/realtime").await;
    expect(&mut ws, "session.created").await;
    let cases: Vec<(Message, &str)> = vec![
        (Message::text("{not json"), "invalid_json"),
        (
            Message::text(r#"{"type":"session.dance"}"#),
            "unknown_event_type",
        ),
        (
            Message::text(r#"{"type":"input_audio_buffer.append","audio":"@@not base64@@"}"#),
            "invalid_base64",
        ),
        (
            Message::text(
                r#"{"type":"session.update","session":{"audio":{"output":{"format":{"type":"audio/opus"}}}}}"#,
            ),
            "unsupported_audio_format",
        ),
        (
            Message::text(r#"{"type":"session.update","session":{"output_audio_format":"g722"}}"#),
            "unsupported_audio_format",
        ),
        (
            Message::text(
                r#"{"type":"session.update","session":{"audio":{"output":{"format":{"type":"audio/pcm","rate":16000}}}}}"#,
            ),
            "unsupported_audio_format",
        ),
        (
            Message::text(
                r#"{"type":"session.update","session":{"turn_detection":{"type":"semantic_vad"}}}"#,
            ),
            "unsupported_turn_detection",
        ),
        (
            Message::text(
                r#"{"type":"session.update","session":{"audio":{"output":{"voice":"bob"}}}}"#,
            ),
            "invalid_value",
        ),
        (
            Message::text(r#"{"type":"response.cancel"}"#),
            "response_cancel_not_active",
        ),
        (
            Message::text(r#"{"type":"input_audio_buffer.commit"}"#),
            "input_audio_buffer_commit_empty",
        ),
    ];
    for (m, code) in cases {
        ws.send(m).await.expect("send");
        let e = expect_error(&mut ws).await;
        assert_eq!(e["error"]["code"], code, "{e}");
        assert!(
            e["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{e}"
        );
        assert!(e["error"]["type"].is_string(), "{e}");
    }
    // ignore_eos with no limit would never end: refused, naming it.
    for (kind, field) in [
        ("session.update", "session"),
        ("response.create", "response"),
    ] {
        send(
            &mut ws,
            json!({"type": kind, field: {"max_output_tokens": "inf", "ignore_eos": true}}),
        )
        .await;
        let e = expect_error(&mut ws).await;
        assert_eq!(e["error"]["code"], "invalid_value", "{e}");
        assert_eq!(e["error"]["param"], format!("{field}.ignore_eos"), "{e}");
    }
    // Still usable: valid audio is buffered, committed and heard: silence
    // holds no words (no made-up transcript).
    let silence = "AAAAAAAAAAAAAAAA"; // 12 bytes of zeros
    send(
        &mut ws,
        json!({"type": "input_audio_buffer.append", "audio": silence}),
    )
    .await;
    send(&mut ws, json!({"type": "input_audio_buffer.commit"})).await;
    expect(&mut ws, "input_audio_buffer.committed").await;
    let item = expect(&mut ws, "conversation.item.created").await;
    assert!(item["item"]["content"][0]["transcript"].is_null(), "{item}");
    let heard = expect(
        &mut ws,
        "conversation.item.input_audio_transcription.completed",
    )
    .await;
    assert_eq!(heard["transcript"], "", "{heard}");
    send(
        &mut ws,
        json!({"type": "session.update", "session": {"instructions": "Be brief."}}),
    )
    .await;
    let updated = expect(&mut ws, "session.updated").await;
    assert_eq!(updated["session"]["instructions"], "Be brief.");

    // A prompt over the Thinker's context fails its answer as the client's
    // fault, with the code and param HTTP's 400 has; the session goes on.
    send(
        &mut ws,
        json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "hello ".repeat(12000)}]}}),
    )
    .await;
    expect(&mut ws, "conversation.item.created").await;
    send(
        &mut ws,
        json!({"type": "response.create", "response": {"max_output_tokens": 4}}),
    )
    .await;
    let done = expect(&mut ws, "response.done").await;
    assert_eq!(done["response"]["status"], "failed", "{done}");
    let e = &done["response"]["status_details"]["error"];
    assert_eq!(e["code"], "context_length_exceeded", "{done}");
    assert_eq!(e["param"], "messages", "{done}");
    assert_eq!(e["type"], "invalid_request_error", "{done}");

    // An oversized frame: an error, then the server closes.
    let big = format!(
        r#"{{"type":"conversation.item.create","pad":"{}"}}"#,
        "x".repeat(1_100_000)
    );
    ws.send(Message::text(big)).await.ok();
    let e = expect_error(&mut ws).await;
    assert_eq!(e["error"]["code"], "message_too_large", "{e}");
    assert!(next_msg(&mut ws).await.is_none(), "the server should close");

    // /v1/stream: nothing before start, a wrong rate, then it works.
    let mut ws = connect(&server, "/v1/stream").await;
    send(&mut ws, json!({"type": "text", "text": "hello"})).await;
    assert_eq!(next_event(&mut ws).await["code"], "not_started");
    send(&mut ws, json!({"type": "start", "sample_rate": 44100})).await;
    let e = next_event(&mut ws).await;
    assert_eq!(e["type"], "error");
    assert_eq!(e["code"], "unsupported_sample_rate", "{e}");
    ws.send(Message::text("[1,2")).await.expect("send");
    assert_eq!(next_event(&mut ws).await["code"], "invalid_json");
    send(&mut ws, json!({"type": "jump"})).await;
    assert_eq!(next_event(&mut ws).await["code"], "unknown_event_type");
    send(&mut ws, json!({"type": "start", "sample_rate": 16000})).await;
    assert_eq!(next_event(&mut ws).await["type"], "started");
    ws.send(Message::binary(vec![0u8; 3])).await.expect("send");
    assert_eq!(next_event(&mut ws).await["code"], "invalid_audio");
    ws.send(Message::binary(vec![0u8; 3200]))
        .await
        .expect("send");
    send(&mut ws, json!({"type": "cancel"})).await;
    assert_eq!(next_event(&mut ws).await["code"], "no_active_response");
    ws.close(None).await.ok();
    // A prompt over the context (instructions are not capped as a turn is):
    // an error with HTTP's code and param, then the answer's end.
    let mut ws = connect(&server, "/v1/stream").await;
    send(
        &mut ws,
        json!({"type": "start", "sample_rate": 16000, "instructions": "hello ".repeat(12000)}),
    )
    .await;
    assert_eq!(next_event(&mut ws).await["type"], "started");
    send(&mut ws, json!({"type": "text", "text": "Hi."})).await;
    let e = expect_error(&mut ws).await;
    assert_eq!(e["code"], "context_length_exceeded", "{e}");
    assert_eq!(e["param"], "messages", "{e}");
    let done = expect_stream(&mut ws, "done").await;
    assert_eq!(done["status"], "failed", "{done}");
    ws.close(None).await.ok();
    assert_idle(&server).await;
}

/// A WebSocket handshake with extra headers.
async fn connect_with(
    server: &Server,
    path: &str,
    headers: &[(&'static str, &str)],
) -> Result<
    (
        Ws,
        tokio_tungstenite::tungstenite::handshake::client::Response,
    ),
    String,
> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut req = server
        .ws_url(path)
        .into_client_request()
        .map_err(|e| e.to_string())?;
    for (k, v) in headers {
        req.headers_mut()
            .insert(*k, v.parse().map_err(|_| format!("bad header {v}"))?);
    }
    tokio_tungstenite::connect_async(req)
        .await
        .map_err(|e| e.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_key_origin_and_subprotocol() {
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&["--api-key", "sekrit"]);
    for path in ["/v1/realtime", "/v1/stream"] {
        let e = connect_with(&server, path, &[]).await.err();
        assert!(
            e.as_deref().is_some_and(|e| e.contains("401")),
            "{path}: {e:?}"
        );
    }
    // Browser style: the key as a subprotocol; `realtime` is echoed.
    let (mut ws, resp) = connect_with(
        &server,
        "/v1/realtime",
        &[(
            "Sec-WebSocket-Protocol",
            "realtime, openai-insecure-api-key.sekrit",
        )],
    )
    .await
    .expect("subprotocol key");
    assert_eq!(
        resp.headers()
            .get("sec-websocket-protocol")
            .and_then(|v| v.to_str().ok()),
        Some("realtime")
    );
    expect(&mut ws, "session.created").await;
    ws.close(None).await.ok();
    // A foreign Origin is refused, the server's own is fine.
    let bearer = ("Authorization", "Bearer sekrit");
    let e = connect_with(
        &server,
        "/v1/stream",
        &[bearer, ("Origin", "https://evil.example")],
    )
    .await
    .err();
    assert!(e.as_deref().is_some_and(|e| e.contains("403")), "{e:?}");
    let own = format!("http://127.0.0.1:{}", server.port);
    let (mut ws, _) = connect_with(&server, "/v1/stream", &[bearer, ("Origin", &own)])
        .await
        .expect("same origin");
    send(&mut ws, json!({"type": "start", "sample_rate": 24000})).await;
    assert_eq!(next_event(&mut ws).await["type"], "started");
    ws.close(None).await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn churn_and_a_stalled_reader_leave_the_server_healthy() {
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&[]);

    // 1,000 rapid connects and disconnects, 8 at a time, some abrupt.
    let url_rt = server.ws_url("/v1/realtime");
    let url_st = server.ws_url("/v1/stream");
    let mut workers = Vec::new();
    for w in 0..8usize {
        let (rt, st) = (url_rt.clone(), url_st.clone());
        workers.push(tokio::spawn(async move {
            for i in 0..125usize {
                let url = if (w + i) % 4 == 0 { &st } else { &rt };
                let (mut ws, _) = tokio_tungstenite::connect_async(url.as_str())
                    .await
                    .expect("connect");
                match i % 3 {
                    0 => drop(ws),
                    1 => {
                        ws.close(None).await.ok();
                    }
                    _ => {
                        if url == &rt {
                            let _ = tokio::time::timeout(Duration::from_secs(5), ws.next()).await;
                        }
                        drop(ws);
                    }
                }
            }
        }));
    }
    for w in workers {
        w.await.expect("churn worker");
    }
    eventually(
        "sessions closed after churn",
        Duration::from_secs(20),
        || server.metric("omnistream_sessions_open") == Some(0.0),
    )
    .await;

    // A client that stops reading mid-answer, next to one that reads. Greedy,
    // so its answer is the same long one every run: the server drops a client
    // only once enough output went unread.
    let mut slow = connect(&server, "/v1/realtime").await;
    expect(&mut slow, "session.created").await;
    send(
        &mut slow,
        json!({"type": "session.update", "session": {"type": "realtime", "temperature": 0}}),
    )
    .await;
    expect(&mut slow, "session.updated").await;
    ask(
        &mut slow,
        "Tell me a long story about a dragon who learns to sing.",
        json!({"max_output_tokens": 200}),
    )
    .await;
    expect(&mut slow, "response.output_audio.delta").await;
    // ...and from here on it reads nothing.

    let mut good = connect(&server, "/v1/realtime").await;
    expect(&mut good, "session.created").await;
    ask(
        &mut good,
        "Repeat after me: Our train leaves from platform number seven.",
        json!({"max_output_tokens": 30}),
    )
    .await;
    let a = read_response(&mut good).await;
    assert_eq!(status(&a), "completed", "{:?}", a.done);
    assert!(a.audio_seconds() > 0.5);

    // Dropped whether or not its answer was still running by then.
    eventually(
        "the stalled client is dropped",
        Duration::from_secs(120),
        || server.metric("omnistream_slow_clients_total") == Some(1.0),
    )
    .await;
    // When it reads again it finds out why, then the close.
    let (mut told, mut close) = (false, None);
    while let Ok(Some(m)) = tokio::time::timeout(EVENT_TIMEOUT, slow.next()).await {
        match m {
            Ok(Message::Text(t)) => {
                let v: Value = serde_json::from_str(&t).expect("JSON");
                if v["type"] == "error" {
                    assert_eq!(v["error"]["code"], "slow_client", "{v}");
                    told = true;
                }
            }
            Ok(Message::Close(f)) => close = f.map(|f| u16::from(f.code)),
            Ok(_) => {}
            Err(_) => break,
        }
    }
    assert!(told, "the dropped client was not told why");
    // 1008: policy violation (RFC 6455), the code for "you did not read".
    assert_eq!(close, Some(1008), "the close after slow_client");

    // The other session still works after all that.
    ask(
        &mut good,
        "What is the capital of France?",
        json!({"output_modalities": ["text"], "max_output_tokens": 16}),
    )
    .await;
    let b = read_response(&mut good).await;
    assert_eq!(status(&b), "completed");
    good.close(None).await.ok();
    drop(good);
    assert_idle(&server).await;
}

/// Protocol violations close with the codes RFC 6455 gives them, after an
/// `error` that says why: text that is not UTF-8 (1007), a reserved opcode
/// (1002), on both WebSocket endpoints; the server stays healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn protocol_violations_close_with_their_rfc_6455_codes() {
    use tokio_tungstenite::tungstenite::protocol::frame::coding::{CloseCode, Data, OpCode};
    use tokio_tungstenite::tungstenite::protocol::frame::Frame;
    let _serial = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let cases = [
        (
            OpCode::Data(Data::Text),
            &b"{\"type\": \"\xff\xfe\"}"[..],
            "invalid_utf8",
            CloseCode::Invalid,
        ),
        (
            OpCode::Data(Data::Reserved(3)),
            &b"{}"[..],
            "protocol_error",
            CloseCode::Protocol,
        ),
    ];
    for path in ["/v1/realtime", "/v1/stream"] {
        for (opcode, payload, code, close) in &cases {
            let mut ws = connect(&server, path).await;
            if path == "/v1/realtime" {
                expect(&mut ws, "session.created").await;
            }
            ws.send(Message::Frame(Frame::message(
                payload.to_vec(),
                *opcode,
                true,
            )))
            .await
            .expect("send");
            let mut error = None;
            let mut closed = None;
            while let Ok(Some(m)) = tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
                match m {
                    Ok(Message::Text(t)) => {
                        error = Some(serde_json::from_str::<Value>(&t).unwrap())
                    }
                    Ok(Message::Close(f)) => {
                        closed = f.map(|f| f.code);
                        break;
                    }
                    Ok(_) => {}
                    Err(_) => break,
                }
            }
            let e = error.unwrap_or_else(|| panic!("{path} {code}: no error event"));
            let got = if e["error"].is_object() {
                &e["error"]["code"]
            } else {
                &e["code"]
            };
            assert_eq!(got, code, "{path}: {e}");
            assert_eq!(closed.as_ref(), Some(close), "{path} {code}");
        }
    }
    assert_idle(&server).await;
}
