//! Voice in, end to end: speech from espeak-ng and from omnistream's own
//! voice, sent as audio to a real server, heard by the Listener stage
//! (Whisper tiny.en in candle) and answered; `server_vad` turns over
//! `/v1/realtime`; barge-in; and audio that is not speech.
//!
//! The recognizer's word error rate is judged against the reference
//! implementation of the same model on the same audio: faster-whisper over
//! the same CTranslate2 files (`tests/python/wer.py`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use omnistream_codecs::pcm::f32_to_pcm16_le;
use omnistream_codecs::wav::write_wav;
use omnistream_e2e::{
    assert_wer_like_reference, espeak, own_voice, resample, silence, spawn_server, utterances,
    Server, ESPEAK,
};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// One test at a time: each judges timing and recognition on two cores.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const TIMEOUT: Duration = Duration::from_secs(120);

/// No answer audio arrived more than 100 ms (+ one 20 ms frame) after the
/// interrupting speech was detected.
fn quiet_after(detected: Option<Instant>, last_audio: Option<Instant>) {
    let detected = detected.expect("the speech was not detected");
    if let Some(t) = last_audio {
        let late = t.saturating_duration_since(detected);
        assert!(
            late <= Duration::from_millis(120),
            "answer audio {late:?} after the speech was detected"
        );
    }
}

/// `/v1/stream`: the utterance is heard (its transcript holds `word`) and
/// answered in full.
async fn heard_and_answered(ws: &mut Ws, word: &str) {
    let t = expect(ws, "input_transcript").await;
    let heard = t["text"].as_str().unwrap_or_default().to_lowercase();
    assert!(heard.contains(word), "{t}");
    expect(ws, "audio_start").await;
    let done = expect(ws, "done").await;
    assert_eq!(done["status"], "completed", "{done}");
}

async fn connect(server: &Server, path: &str) -> Ws {
    tokio_tungstenite::connect_async(server.ws_url(path))
        .await
        .unwrap_or_else(|e| panic!("connecting to {path}: {e}"))
        .0
}

async fn send(ws: &mut Ws, v: Value) {
    ws.send(Message::text(v.to_string())).await.expect("send");
}

/// The next text or binary message.
async fn next_msg(ws: &mut Ws) -> Message {
    loop {
        match tokio::time::timeout(TIMEOUT, ws.next()).await {
            Err(_) => panic!("no message from the server in time"),
            Ok(None | Some(Err(_))) => panic!("the connection closed"),
            Ok(Some(Ok(Message::Text(t)))) => return Message::Text(t),
            Ok(Some(Ok(Message::Binary(b)))) => return Message::Binary(b),
            Ok(Some(Ok(_))) => continue,
        }
    }
}

async fn next_event(ws: &mut Ws) -> Value {
    loop {
        if let Message::Text(t) = next_msg(ws).await {
            return serde_json::from_str(&t).expect("JSON event");
        }
    }
}

/// Events until one of type `kind`; fails on an `error`.
async fn expect(ws: &mut Ws, kind: &str) -> Value {
    loop {
        let v = next_event(ws).await;
        assert_ne!(v["type"], "error", "while waiting for {kind}: {v}");
        if v["type"] == kind {
            return v;
        }
    }
}

/// Appends PCM16 to the realtime input buffer, 100 ms per event.
async fn append(ws: &mut Ws, samples_24k: &[f32]) {
    for chunk in samples_24k.chunks(2400) {
        let b64 = base64::engine::general_purpose::STANDARD.encode(f32_to_pcm16_le(chunk));
        send(
            ws,
            json!({"type": "input_audio_buffer.append", "audio": b64}),
        )
        .await;
    }
}

async fn server_vad(ws: &mut Ws, create_response: bool) {
    expect(ws, "session.created").await;
    send(
        ws,
        json!({"type": "session.update", "session": {"audio": {"input": {"turn_detection": {
            "type": "server_vad", "silence_duration_ms": 500, "create_response": create_response,
        }}}}}),
    )
    .await;
    let s = expect(ws, "session.updated").await;
    assert_eq!(
        s["session"]["audio"]["input"]["turn_detection"]["type"], "server_vad",
        "{s}"
    );
}

/// Speech at every rate over `/v1/stream` (utterance ended with
/// `audio_end`) and over `/v1/realtime` (turns found by `server_vad`): the
/// server hears it about as well as the reference implementation of its
/// recognizer, and answers in audio.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn speech_is_heard_like_the_reference_at_every_rate() {
    let _alone = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let all = utterances(dir.path());
    let mut refs: Vec<(PathBuf, String)> = Vec::new();
    let mut heard: Vec<(String, String)> = Vec::new();

    // /v1/stream at 8, 16, 24 and 48 kHz; every utterance is answered.
    for (i, (text, x, rate)) in all.iter().enumerate() {
        let to = [8_000u32, 16_000, 24_000, 48_000][i % 4];
        let y = resample(x, *rate, to);
        let wav = dir.path().join(format!("stream{i}_{to}.wav"));
        write_wav(&wav, &y, to).expect("write wav");
        refs.push((wav, text.clone()));
        let mut ws = connect(&server, "/v1/stream").await;
        send(&mut ws, json!({"type": "start", "sample_rate": to})).await;
        assert_eq!(next_event(&mut ws).await["type"], "started");
        for chunk in f32_to_pcm16_le(&y).chunks(6400) {
            ws.send(Message::binary(chunk.to_vec()))
                .await
                .expect("send");
        }
        send(&mut ws, json!({"type": "audio_end"})).await;
        let got = expect(&mut ws, "audio_received").await;
        let secs = got["seconds"].as_f64().unwrap_or(0.0);
        let want = y.len() as f64 / f64::from(to);
        assert!((secs - want).abs() < 0.01, "{secs} s taken of {want} s");
        let t = expect(&mut ws, "input_transcript").await;
        let said = t["text"].as_str().unwrap_or_default().to_string();
        heard.push((text.clone(), said.clone()));
        assert!(!said.is_empty(), "nothing heard in {text:?} at {to} Hz");
        // The answer comes back as audio; one frame of it is enough here.
        expect(&mut ws, "audio_start").await;
        loop {
            match next_msg(&mut ws).await {
                Message::Binary(b) if !b.is_empty() => break,
                Message::Text(t) => {
                    let v: Value = serde_json::from_str(&t).expect("JSON");
                    assert!(
                        matches!(v["type"].as_str(), Some("transcript")),
                        "before any audio: {v}"
                    );
                }
                _ => {}
            }
        }
        ws.close(None).await.ok();
    }

    // /v1/realtime with server_vad: all the ESPEAK sentences in one stream,
    // a second of silence between them; each is one turn.
    let mut ws = connect(&server, "/v1/realtime").await;
    server_vad(&mut ws, false).await;
    let mut stream = silence(0.5, 24_000);
    for (i, (text, x, rate)) in all.iter().take(ESPEAK.len()).enumerate() {
        let y = resample(x, *rate, 24_000);
        let wav = dir.path().join(format!("realtime{i}.wav"));
        write_wav(&wav, &y, 24_000).expect("write wav");
        refs.push((wav, text.clone()));
        stream.extend(&y);
        stream.extend(silence(1.0, 24_000));
    }
    append(&mut ws, &stream).await;
    let mut last_end = 0;
    for (text, _, _) in all.iter().take(ESPEAK.len()) {
        let started = expect(&mut ws, "input_audio_buffer.speech_started").await;
        let start = started["audio_start_ms"].as_u64().expect("audio_start_ms");
        let stopped = expect(&mut ws, "input_audio_buffer.speech_stopped").await;
        let end = stopped["audio_end_ms"].as_u64().expect("audio_end_ms");
        assert!(last_end <= start && start < end, "{last_end} {start} {end}");
        last_end = end;
        assert_eq!(stopped["item_id"], started["item_id"]);
        let committed = expect(&mut ws, "input_audio_buffer.committed").await;
        assert_eq!(committed["item_id"], started["item_id"]);
        let t = expect(
            &mut ws,
            "conversation.item.input_audio_transcription.completed",
        )
        .await;
        heard.push((
            text.clone(),
            t["transcript"].as_str().unwrap_or_default().to_string(),
        ));
    }
    // With create_response off nothing was answered; ask for the last turn.
    send(&mut ws, json!({"type": "response.create"})).await;
    let mut audio = 0;
    let done = loop {
        let v = next_event(&mut ws).await;
        assert_ne!(v["type"], "error", "{v}");
        match v["type"].as_str() {
            Some("response.output_audio.delta") => audio += 1,
            Some("response.done") => break v,
            _ => {}
        }
    };
    assert_eq!(done["response"]["status"], "completed", "{done}");
    assert!(audio > 0, "no audio in the answer");

    assert_wer_like_reference("/v1/stream and /v1/realtime", &heard, &refs);
}

/// Speaking over an answer stops it at once: no answer audio more than
/// 100 ms (+ one frame) after the speech was detected, the queued audio is
/// dropped, and the conversation keeps only what was heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn speaking_over_an_answer_interrupts_it() {
    let _alone = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let (x, rate) = espeak("Stop, please stop talking.", &dir.path().join("stop.wav"));
    let speech = resample(&x, rate, 24_000);

    let mut ws = connect(&server, "/v1/realtime").await;
    server_vad(&mut ws, true).await;
    send(
        &mut ws,
        json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Tell me a long story about the sea and the ships on it."}]}}),
    )
    .await;
    send(
        &mut ws,
        json!({"type": "response.create", "response": {"max_output_tokens": 300}}),
    )
    .await;
    let created = expect(&mut ws, "response.created").await;
    let rid = created["response"]["id"].clone();
    let mut transcript = String::new();
    let mut audio_bytes = 0usize;
    loop {
        let v = next_event(&mut ws).await;
        match v["type"].as_str() {
            Some("response.output_audio_transcript.delta") => {
                transcript += v["delta"].as_str().unwrap_or_default();
            }
            Some("response.output_audio.delta") => {
                audio_bytes += v["delta"].as_str().unwrap_or_default().len() * 3 / 4;
                if audio_bytes > 24_000 * 2 {
                    break; // a second of the answer has arrived
                }
            }
            Some("response.done") => panic!("the answer ended before the interruption: {v}"),
            _ => {}
        }
    }
    // The user speaks (paced like a microphone, 100 ms at a time).
    let mut spoken = silence(0.2, 24_000);
    spoken.extend(&speech);
    spoken.extend(silence(1.0, 24_000));
    let mut chunks = spoken.chunks(2400);
    let mut detected = None;
    let mut last_audio = None;
    let mut events = Vec::new();
    let done = loop {
        // A microphone keeps sending: the rest of the speech ends the turn.
        if let Some(c) = chunks.next() {
            append(&mut ws, c).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let v = match tokio::time::timeout(Duration::from_millis(5), next_event(&mut ws)).await {
            Ok(v) => v,
            Err(_) => continue,
        };
        let kind = v["type"].as_str().unwrap_or_default().to_string();
        events.push(kind.clone());
        match kind.as_str() {
            "input_audio_buffer.speech_started" => detected = Some(Instant::now()),
            "response.output_audio.delta" => {
                last_audio = Some(Instant::now());
                assert_eq!(v["response_id"], rid, "audio of another response: {v}");
            }
            "response.output_audio_transcript.delta" => {
                transcript += v["delta"].as_str().unwrap_or_default();
            }
            "response.done" if v["response"]["id"] == rid => break v,
            "error" => panic!("{v}"),
            _ => {}
        }
    };
    quiet_after(detected, last_audio);
    assert_eq!(done["response"]["status"], "cancelled", "{done}");
    for e in ["output_audio_buffer.cleared", "conversation.item.truncated"] {
        assert!(events.iter().any(|k| k == e), "no {e}: {events:?}");
    }
    // What the conversation keeps is a prefix of what was said, and shorter.
    let kept = done["response"]["output"][0]["content"][0]["transcript"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        transcript.starts_with(&kept) && kept.len() < transcript.len(),
        "kept {kept:?} of {transcript:?}"
    );
    // The interruption is the user's next turn: heard and answered.
    let t = expect(
        &mut ws,
        "conversation.item.input_audio_transcription.completed",
    )
    .await;
    assert!(
        t["transcript"]
            .as_str()
            .is_some_and(|s| s.to_lowercase().contains("stop")),
        "{t}"
    );
    let next = expect(&mut ws, "response.done").await;
    assert_eq!(next["response"]["status"], "completed", "{next}");
}

/// `/v1/stream` with `server_vad`: the server finds the user's turns in a
/// plain PCM stream, answers them, and a user who talks over an answer
/// interrupts it (no answer audio 100 ms + a frame after the speech was
/// detected; `output_cleared`; the conversation keeps what was heard).
/// `audio_end` ends a turn still under way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_takes_turns_and_is_interrupted() {
    let _alone = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let rate = 16_000;
    let (x, r) = espeak("Stop, please stop talking.", &dir.path().join("stop.wav"));
    let stop = resample(&x, r, rate);
    let (x, r) = own_voice("How do bees make honey?", &dir.path().join("bees.wav"));
    let mut bees = resample(&x, r, rate);
    // Its trailing silence cut: the turn must still be under way at audio_end.
    let end = bees.iter().rposition(|v| v.abs() > 0.02).unwrap_or(0);
    bees.truncate(end + 1);

    let mut ws = connect(&server, "/v1/stream").await;
    // Unsupported turn detection: refused, and the stream is not started.
    send(
        &mut ws,
        json!({"type": "start", "sample_rate": rate, "turn_detection": {"type": "semantic_vad"}}),
    )
    .await;
    let e = expect_error(&mut ws).await;
    assert_eq!(e["code"], "unsupported_turn_detection", "{e}");
    send(
        &mut ws,
        json!({"type": "start", "sample_rate": rate, "turn_detection": {
            "type": "server_vad", "silence_duration_ms": 500}}),
    )
    .await;
    let started = expect(&mut ws, "started").await;
    assert_eq!(started["turn_detection"]["type"], "server_vad", "{started}");

    // A long answer to a typed turn; a second of it arrives.
    send(
        &mut ws,
        json!({"type": "text", "text": "Tell me a long story about the sea and the ships on it."}),
    )
    .await;
    let rid = expect(&mut ws, "audio_start").await["response_id"].clone();
    let mut transcript = String::new();
    let mut audio_bytes = 0usize;
    while audio_bytes < rate as usize * 2 {
        match next_msg(&mut ws).await {
            Message::Binary(b) => audio_bytes += b.len(),
            Message::Text(t) => {
                let v: Value = serde_json::from_str(&t).expect("JSON");
                match v["type"].as_str() {
                    Some("transcript") => transcript += v["text"].as_str().unwrap_or_default(),
                    Some("done") => panic!("the answer ended before the interruption: {v}"),
                    _ => panic!("unexpected: {v}"),
                }
            }
            _ => {}
        }
    }
    // The user talks over it, paced like a microphone (100 ms frames).
    let mut spoken = silence(0.2, rate);
    spoken.extend(&stop);
    spoken.extend(silence(1.0, rate));
    let mut chunks = spoken.chunks(rate as usize / 10);
    let (mut detected, mut last_audio) = (None, None);
    let mut events: Vec<Value> = Vec::new();
    let done = loop {
        if let Some(c) = chunks.next() {
            ws.send(Message::binary(f32_to_pcm16_le(c)))
                .await
                .expect("send");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let m = match tokio::time::timeout(Duration::from_millis(5), next_msg(&mut ws)).await {
            Ok(m) => m,
            Err(_) => continue,
        };
        let v: Value = match m {
            Message::Binary(_) => {
                last_audio = Some(Instant::now());
                continue;
            }
            Message::Text(t) => serde_json::from_str(&t).expect("JSON"),
            _ => continue,
        };
        match v["type"].as_str() {
            Some("speech_started") => detected = Some(Instant::now()),
            Some("transcript") => transcript += v["text"].as_str().unwrap_or_default(),
            Some("done") if v["response_id"] == rid => break v,
            Some("error") => panic!("{v}"),
            _ => {}
        }
        events.push(v);
    };
    quiet_after(detected, last_audio);
    assert_eq!(done["status"], "cancelled", "{done}");
    let cleared = events.iter().find(|v| v["type"] == "output_cleared");
    assert_eq!(cleared.map(|v| &v["response_id"]), Some(&rid), "{events:?}");
    let cut = events
        .iter()
        .find(|v| v["type"] == "truncated")
        .unwrap_or_else(|| panic!("no truncated: {events:?}"));
    let kept = cut["text"].as_str().unwrap_or_default();
    assert!(
        transcript.starts_with(kept) && kept.len() < transcript.len(),
        "kept {kept:?} of {transcript:?}"
    );
    // The interruption is the user's next turn: heard and answered.
    let stopped = expect(&mut ws, "speech_stopped").await;
    assert!(
        stopped["seconds"].as_f64().unwrap_or(0.0) > 1.0,
        "{stopped}"
    );
    heard_and_answered(&mut ws, "stop").await;

    // A turn still under way when the client says audio_end ends there.
    let mut frames = 0;
    for c in bees.chunks(rate as usize / 10) {
        ws.send(Message::binary(f32_to_pcm16_le(c)))
            .await
            .expect("send");
        frames += 1;
    }
    assert!(frames > 5);
    send(&mut ws, json!({"type": "audio_end"})).await;
    let got = expect(&mut ws, "audio_received").await;
    assert!(got["seconds"].as_f64().unwrap_or(0.0) > 1.0, "{got}");
    heard_and_answered(&mut ws, "honey").await;
    let health = omnistream_e2e::http_get(server.port, "/health");
    assert!(health.contains("\"status\":\"ok\""), "{health}");
}

/// Silence, noise, clipping, a DC offset and ten minutes of quiet make no
/// turn; garbage is refused; memory stays flat; the server stays healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn audio_without_speech_makes_no_turns() {
    let _alone = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let mut ws = connect(&server, "/v1/realtime").await;
    server_vad(&mut ws, true).await;
    let rate = 24_000;
    let mut seed = 7u64;
    let mut noise = |n: usize, amp: f32| -> Vec<f32> {
        (0..n)
            .map(|_| {
                // xorshift: reproducible white noise without a dependency.
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                amp * ((seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
            })
            .collect()
    };
    let mut signal = silence(5.0, rate);
    signal.extend(noise(5 * rate as usize, 0.3));
    // Clipped: a loud hum driven into the rails.
    signal.extend((0..5 * rate as usize).map(|i| {
        (3.0 * (2.0 * std::f32::consts::PI * 50.0 * i as f32 / rate as f32).sin()).clamp(-1.0, 1.0)
    }));
    signal.extend(vec![0.5; 5 * rate as usize]); // DC offset
    append(&mut ws, &signal).await;
    // Garbage: a clear error, the session goes on.
    send(
        &mut ws,
        json!({"type": "input_audio_buffer.append", "audio": "%%% not audio %%%"}),
    )
    .await;
    let e = expect_error(&mut ws).await;
    assert_eq!(e["error"]["code"], "invalid_base64", "{e}");

    send(&mut ws, json!({"type": "input_audio_buffer.clear"})).await;
    // Ten minutes of quiet noise, as fast as it can go: memory stays flat.
    let rss = || {
        server
            .metric("omnistream_process_resident_bytes")
            .expect("rss")
    };
    let before = rss();
    let quiet = noise(60 * rate as usize, 0.003);
    for _ in 0..10 {
        append(&mut ws, &quiet).await;
        // Keep the input buffer under its cap, as a client would.
        send(&mut ws, json!({"type": "input_audio_buffer.clear"})).await;
    }
    send(&mut ws, json!({"type": "input_audio_buffer.clear"})).await;
    // Drain: everything the server says until it confirms the last clear.
    let mut cleared = 0;
    let mut kinds = Vec::new();
    while cleared < 12 {
        let v = next_event(&mut ws).await;
        let k = v["type"].as_str().unwrap_or_default().to_string();
        if k == "input_audio_buffer.cleared" {
            cleared += 1;
        }
        // A turn the detector took for speech is fine if nothing was heard
        // in it: a phantom turn is words made up, or an answer.
        let words = v["transcript"].as_str().is_some_and(|t| !t.is_empty());
        assert!(
            !k.starts_with("response.") && !words,
            "a phantom turn: {v}\n{kinds:?}"
        );
        kinds.push(k);
    }
    eprintln!("events: {kinds:?}");
    let grown = rss() - before;
    assert!(grown < 64.0 * 1024.0 * 1024.0, "RSS grew by {grown} bytes");
    let health = omnistream_e2e::http_get(server.port, "/health");
    assert!(health.contains("\"status\":\"ok\""), "{health}");
}

async fn expect_error(ws: &mut Ws) -> Value {
    loop {
        let v = next_event(ws).await;
        if v["type"] == "error" {
            return v;
        }
    }
}

/// `POST /v1/audio/transcriptions` of a WAV file with curl: (status, body).
fn transcribe_file(server: &Server, wav: &std::path::Path) -> (u16, String) {
    let out = std::process::Command::new("curl")
        .args(["-sS", "--max-time", "120", "-w", "\n%{http_code}"])
        .arg("-F")
        .arg(format!("file=@{}", wav.display()))
        .args(["-F", "model=whisper-1"])
        .arg(format!("{}/v1/audio/transcriptions", server.url))
        .output()
        .expect("running curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_string())
}

/// The default profile with the Listener's VAD filter off, beside it (its relative
/// paths hold); removed on drop.
struct UnfilteredProfile(PathBuf);

impl UnfilteredProfile {
    fn new() -> Self {
        let root = omnistream_e2e::root();
        let yaml = std::fs::read_to_string(root.join("deploy/tiny-cpu.yaml")).expect("profile");
        let vad = "\n  vad:\n";
        assert!(yaml.contains(vad), "the default profile has server.vad");
        let yaml = yaml.replacen(vad, "\n  vad:\n    filter_transcriptions: false\n", 1);
        let path = root.join(format!(
            "deploy/.test-unfiltered-{}.yaml",
            std::process::id()
        ));
        std::fs::write(&path, yaml).expect("writing the test profile");
        Self(path)
    }
}

impl Drop for UnfilteredProfile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A minute of digital silence and of white noise at -60 dBFS is no words (Whisper
/// alone said "you you" and ". . . .": docs/api.md has the rule), with the profile's
/// VAD in front of Whisper and without it; speech is still heard; the server stays well.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silence_and_noise_transcribe_to_nothing() {
    let _alone = SERIAL.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let rate = 16_000;
    let mut seed = 11u64;
    // xorshift, uniform: RMS = peak / sqrt(3) = -60 dBFS.
    let peak = 1e-3 * 3f32.sqrt();
    let noise: Vec<f32> = (0..60 * rate)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            peak * ((seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
        })
        .collect();
    let files = [("silence", silence(60.0, rate)), ("noise", noise)].map(|(name, samples)| {
        let path = dir.path().join(format!("{name}.wav"));
        write_wav(&path, &samples, rate).expect("write wav");
        (name, path)
    });
    let speech = omnistream_e2e::root().join("stages/testdata/whisper/s04.wav");

    let unfiltered = UnfilteredProfile::new();
    let profile = unfiltered.0.to_string_lossy().to_string();
    for extra in [&[][..], &["--profile", profile.as_str()][..]] {
        let server = spawn_server(extra);
        for (name, path) in &files {
            let t = Instant::now();
            let (status, body) = transcribe_file(&server, path);
            eprintln!("{extra:?} {name}: {status} {body} in {:.2?}", t.elapsed());
            assert_eq!(status, 200, "{extra:?} {name}: {body}");
            let v: Value = serde_json::from_str(&body).expect("JSON");
            assert_eq!(v, json!({"text": ""}), "{extra:?} {name}");
        }
        let (status, body) = transcribe_file(&server, &speech);
        assert_eq!(status, 200, "{body}");
        let heard = body.to_lowercase();
        assert!(
            heard.contains("turn left at the next traffic light"),
            "{body}"
        );
        let health = omnistream_e2e::http_get(server.port, "/health");
        assert!(health.contains("\"status\":\"ok\""), "{health}");
    }
}

/// A long spoken turn (about 8 s, no pause of half a second in it).
const LONG_TURN: &str = "The weather is lovely today, and my brother plays the guitar every \
    evening, while the children are playing in the garden and the coffee in this shop is very good.";

/// The client is heard while a turn is being transcribed: an answer it asks
/// for starts before that turn's words are in, and speech over that answer
/// interrupts it; the turns' transcripts arrive in the order they were
/// spoken (`/v1/realtime`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn realtime_barge_in_while_the_previous_turn_is_transcribed() {
    let _alone = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let (x, rate) = espeak(LONG_TURN, &dir.path().join("long.wav"));
    let long = resample(&x, rate, 24_000);
    let (x, rate) = espeak("Stop, please stop talking.", &dir.path().join("stop.wav"));
    let stop = resample(&x, rate, 24_000);

    let mut ws = connect(&server, "/v1/realtime").await;
    server_vad(&mut ws, false).await;
    let mut turn = silence(0.3, 24_000);
    turn.extend(&long);
    turn.extend(silence(0.8, 24_000));
    append(&mut ws, &turn).await;
    let committed = expect(&mut ws, "input_audio_buffer.committed").await;
    let first_item = committed["item_id"].clone();
    // Its transcription runs; the client asks for an answer meanwhile.
    send(
        &mut ws,
        json!({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Tell me a long story about the sea and the ships on it."}]}}),
    )
    .await;
    send(
        &mut ws,
        json!({"type": "response.create", "response": {"max_output_tokens": 300}}),
    )
    .await;
    let mut order = Vec::new();
    let mut audio_bytes = 0usize;
    let rid = loop {
        let v = next_event(&mut ws).await;
        assert_ne!(v["type"], "error", "{v}");
        let kind = v["type"].as_str().unwrap_or_default().to_string();
        if kind == "conversation.item.input_audio_transcription.completed" {
            assert_eq!(v["item_id"], first_item, "{v}");
        }
        if kind == "response.output_audio.delta" {
            audio_bytes += v["delta"].as_str().unwrap_or_default().len() * 3 / 4;
            if audio_bytes > 24_000 * 2 {
                break v["response_id"].clone(); // a second of the answer
            }
        }
        order.push(kind);
    };
    let pos = |k: &str| order.iter().position(|e| e == k);
    assert!(
        pos("response.created") < pos("conversation.item.input_audio_transcription.completed")
            || pos("conversation.item.input_audio_transcription.completed").is_none(),
        "the answer waited for the transcription: {order:?}"
    );
    // The user talks over the answer.
    let mut spoken = silence(0.2, 24_000);
    spoken.extend(&stop);
    spoken.extend(silence(1.0, 24_000));
    let mut transcripts = Vec::new();
    if pos("conversation.item.input_audio_transcription.completed").is_some() {
        transcripts.push(first_item.clone());
    }
    let mut chunks = spoken.chunks(2400);
    let mut cleared = false;
    let done = loop {
        if let Some(c) = chunks.next() {
            append(&mut ws, c).await;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let v = match tokio::time::timeout(Duration::from_millis(5), next_event(&mut ws)).await {
            Ok(v) => v,
            Err(_) => continue,
        };
        match v["type"].as_str() {
            Some("output_audio_buffer.cleared") => cleared = true,
            Some("conversation.item.input_audio_transcription.completed") => {
                transcripts.push(v["item_id"].clone());
            }
            Some("response.done") if v["response"]["id"] == rid => break v,
            Some("error") => panic!("{v}"),
            _ => {}
        }
    };
    assert_eq!(done["response"]["status"], "cancelled", "{done}");
    assert!(cleared, "no output_audio_buffer.cleared");
    // The rest of the speech and its silence: the turn ends.
    for c in chunks {
        append(&mut ws, c).await;
    }
    while transcripts.len() < 2 {
        let t = expect(
            &mut ws,
            "conversation.item.input_audio_transcription.completed",
        )
        .await;
        transcripts.push(t["item_id"].clone());
    }
    assert_eq!(transcripts[0], first_item, "turns heard out of order");
    assert_ne!(transcripts[1], first_item);
}

/// The same over `/v1/stream`: a typed turn is answered while a spoken one
/// is being transcribed, and speech over that answer interrupts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_barge_in_while_the_previous_turn_is_transcribed() {
    let _alone = SERIAL.lock().await;
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let rate = 16_000;
    let (x, r) = espeak(LONG_TURN, &dir.path().join("long.wav"));
    let long = resample(&x, r, rate);
    let (x, r) = espeak("Stop, please stop talking.", &dir.path().join("stop.wav"));
    let stop = resample(&x, r, rate);

    let mut ws = connect(&server, "/v1/stream").await;
    send(
        &mut ws,
        json!({"type": "start", "sample_rate": rate, "turn_detection": {
            "type": "server_vad", "silence_duration_ms": 500, "create_response": false}}),
    )
    .await;
    expect(&mut ws, "started").await;
    let mut turn = silence(0.3, rate);
    turn.extend(&long);
    turn.extend(silence(0.8, rate));
    ws.send(Message::binary(f32_to_pcm16_le(&turn)))
        .await
        .expect("send");
    expect(&mut ws, "speech_stopped").await;
    send(
        &mut ws,
        json!({"type": "text", "text": "Tell me a long story about the sea and the ships on it."}),
    )
    .await;
    let mut order = Vec::new();
    let mut audio_bytes = 0usize;
    let mut rid = Value::Null;
    while audio_bytes < rate as usize * 2 {
        match next_msg(&mut ws).await {
            Message::Binary(b) => audio_bytes += b.len(),
            Message::Text(t) => {
                let v: Value = serde_json::from_str(&t).expect("JSON");
                assert_ne!(v["type"], "error", "{v}");
                if v["type"] == "audio_start" {
                    rid = v["response_id"].clone();
                }
                order.push(v["type"].as_str().unwrap_or_default().to_string());
            }
            _ => {}
        }
    }
    let pos = |k: &str| order.iter().position(|e| e == k);
    assert!(
        pos("audio_start") < pos("input_transcript") || pos("input_transcript").is_none(),
        "the answer waited for the transcription: {order:?}"
    );
    let mut heard = usize::from(pos("input_transcript").is_some());
    let mut spoken = silence(0.2, rate);
    spoken.extend(&stop);
    spoken.extend(silence(1.0, rate));
    let mut chunks = spoken.chunks(rate as usize / 10);
    let mut cleared = false;
    let done = loop {
        if let Some(c) = chunks.next() {
            ws.send(Message::binary(f32_to_pcm16_le(c)))
                .await
                .expect("send");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let m = match tokio::time::timeout(Duration::from_millis(5), next_msg(&mut ws)).await {
            Ok(m) => m,
            Err(_) => continue,
        };
        let Message::Text(t) = m else { continue };
        let v: Value = serde_json::from_str(&t).expect("JSON");
        match v["type"].as_str() {
            Some("output_cleared") => cleared = true,
            Some("input_transcript") => heard += 1,
            Some("done") if v["response_id"] == rid => break v,
            Some("error") => panic!("{v}"),
            _ => {}
        }
    };
    assert_eq!(done["status"], "cancelled", "{done}");
    assert!(cleared, "no output_cleared");
    // The rest of the speech and its silence: the turn ends.
    for c in chunks {
        ws.send(Message::binary(f32_to_pcm16_le(c)))
            .await
            .expect("send");
    }
    while heard < 2 {
        let t = expect(&mut ws, "input_transcript").await;
        assert!(t["text"].as_str().is_some_and(|s| !s.is_empty()), "{t}");
        heard += 1;
    }
}
