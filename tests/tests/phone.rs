//! A phone call over Twilio Media Streams (`/v1/phone/twilio`), end to end:
//! a real server with its real models, and a carrier that behaves as
//! Twilio's does — it sends the caller's voice as 20 ms μ-law frames at real
//! time, plays the answer's audio at real time, echoes each mark when the
//! audio before it has played, and on `clear` drops what it buffered and
//! echoes the marks that were pending.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

use omnistream_codecs::g711::{ulaw_decode_f32, ulaw_encode_f32};
use omnistream_e2e::{eventually, metric, metric_keyed, own_voice, resample, spawn_server, Server};

type Ws = WebSocketStream<MaybeTlsStream<TcpStream>>;

const KEY: &str = "phone-test-key";
const RATE: u32 = 8_000;
/// One Twilio frame: 20 ms at 8 kHz.
const FRAME: usize = 160;
const PATH: &str = "/v1/phone/twilio";

async fn connect(server: &Server) -> Ws {
    tokio_tungstenite::connect_async(server.ws_url(PATH))
        .await
        .expect("connecting")
        .0
}

fn start_event(sid: &str, encoding: &str, rate: u32, params: Value) -> Value {
    json!({
        "event": "start", "sequenceNumber": "1", "streamSid": sid,
        "start": {
            "accountSid": "AC00000000000000000000000000000000",
            "streamSid": sid, "callSid": "CA00000000000000000000000000000001",
            "tracks": ["inbound"], "customParameters": params,
            "mediaFormat": {"encoding": encoding, "sampleRate": rate, "channels": 1},
        },
    })
}

async fn send(ws: &mut Ws, v: Value) {
    ws.send(Message::text(v.to_string())).await.expect("send");
}

/// Reads until the server closes: its close code and reason.
async fn closed_with(ws: &mut Ws, within: Duration) -> (CloseCode, String) {
    let until = tokio::time::Instant::now() + within;
    loop {
        match tokio::time::timeout_at(until, ws.next()).await {
            Err(_) => panic!("the server did not close in time"),
            Ok(Some(Ok(Message::Close(Some(f))))) => return (f.code, f.reason.to_string()),
            Ok(Some(Ok(Message::Close(None)))) | Ok(None) | Ok(Some(Err(_))) => {
                panic!("closed without a close frame")
            }
            Ok(Some(Ok(_))) => {}
        }
    }
}

/// A carrier's side of one call, as Twilio plays it.
struct Carrier {
    ws: Ws,
    sid: String,
    /// The caller's voice still to send (8 kHz); silence when empty.
    mic: VecDeque<f32>,
    seq: u64,
    /// Answer samples received, and played, in all.
    received: u64,
    played: u64,
    /// Marks received, with the received-audio position they follow.
    pending: VecDeque<(String, u64)>,
    /// Every mark the server sent, in order, and whether it came after a clear.
    marks: Vec<(String, usize)>,
    clears: usize,
    answer: Vec<f32>,
    /// When the last answer audio arrived.
    last_media: Instant,
}

impl Carrier {
    async fn call(server: &Server, params: Value) -> Self {
        let mut ws = connect(server).await;
        let sid = "MZ00000000000000000000000000000042".to_string();
        send(
            &mut ws,
            json!({"event": "connected", "protocol": "Call", "version": "1.0.0"}),
        )
        .await;
        send(&mut ws, start_event(&sid, "audio/x-mulaw", RATE, params)).await;
        Self {
            ws,
            sid,
            mic: VecDeque::new(),
            seq: 1,
            received: 0,
            played: 0,
            pending: VecDeque::new(),
            marks: Vec::new(),
            clears: 0,
            answer: Vec::new(),
            last_media: Instant::now(),
        }
    }

    fn say(&mut self, samples: &[f32]) {
        self.mic.extend(samples);
    }

    fn next_seq(&mut self) -> String {
        self.seq += 1;
        self.seq.to_string()
    }

    async fn event(&mut self, kind: &str, body: Value) {
        let mut v =
            json!({"event": kind, "sequenceNumber": self.next_seq(), "streamSid": self.sid});
        v[kind] = body;
        send(&mut self.ws, v).await;
    }

    /// Every 20 ms: one frame of the caller, 20 ms of the answer played, the
    /// marks it passed echoed.
    async fn tick(&mut self) {
        let frame: Vec<f32> = (0..FRAME)
            .map(|_| self.mic.pop_front().unwrap_or(0.0))
            .collect();
        let payload = base64::engine::general_purpose::STANDARD.encode(ulaw_encode_f32(&frame));
        let chunk = self.seq;
        self.event(
            "media",
            json!({"track": "inbound", "chunk": chunk.to_string(), "timestamp": (chunk * 20).to_string(), "payload": payload}),
        )
        .await;
        self.played = (self.played + FRAME as u64).min(self.received);
        while self
            .pending
            .front()
            .is_some_and(|(_, at)| *at <= self.played)
        {
            let (name, _) = self.pending.pop_front().expect("a mark");
            self.event("mark", json!({"name": name})).await;
        }
    }

    async fn on_frame(&mut self, m: Message) {
        let t = match m {
            Message::Text(t) => t,
            // Answered by the socket.
            Message::Ping(_) | Message::Pong(_) => return,
            m => panic!("Media Streams frames are text: {m:?}"),
        };
        let v: Value = serde_json::from_str(&t).expect("JSON");
        assert_eq!(v["streamSid"], self.sid.as_str(), "{v}");
        match v["event"].as_str() {
            Some("media") => {
                let b64 = v["media"]["payload"].as_str().expect("payload");
                let codes = base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .expect("base64");
                self.received += codes.len() as u64;
                self.answer.extend(ulaw_decode_f32(&codes));
                self.last_media = Instant::now();
            }
            Some("mark") => {
                let name = v["mark"]["name"].as_str().expect("name").to_string();
                self.pending.push_back((name.clone(), self.received));
                self.marks.push((name, self.clears));
            }
            Some("clear") => {
                // Twilio drops its buffer and sends back the pending marks.
                self.clears += 1;
                self.played = self.received;
                while let Some((name, _)) = self.pending.pop_front() {
                    self.event("mark", json!({"name": name})).await;
                }
            }
            other => panic!("unexpected event {other:?}: {v}"),
        }
    }

    /// Runs the call until `done` holds; false if `limit` passed first.
    async fn run_until(&mut self, limit: Duration, mut done: impl FnMut(&Self) -> bool) -> bool {
        let until = tokio::time::Instant::now() + limit;
        let mut tick = tokio::time::interval(Duration::from_millis(20));
        while !done(self) {
            if tokio::time::Instant::now() > until {
                return false;
            }
            tokio::select! {
                _ = tick.tick() => self.tick().await,
                m = self.ws.next() => match m {
                    Some(Ok(Message::Close(f))) => panic!("the server closed the call: {f:?}"),
                    Some(Ok(m)) => self.on_frame(m).await,
                    other => panic!("the call broke: {other:?}"),
                },
            }
        }
        true
    }

    /// The response id of the newest mark.
    fn last_response(&self) -> Option<String> {
        self.marks
            .last()
            .and_then(|(n, _)| n.rsplit_once(':'))
            .map(|(r, _)| r.to_string())
    }
}

fn rms(x: &[f32]) -> f32 {
    (x.iter().map(|v| v * v).sum::<f32>() / x.len().max(1) as f32).sqrt()
}

/// The stream refuses a missing key, a wrong format and a silent
/// connection, each with a close reason; a call is heard, answered in
/// μ-law, interrupted by the caller's voice (`clear`, and nothing more of
/// the cut answer), answered again, and answered when a key is pressed;
/// malformed frames are dropped and counted, and the call goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_phone_call_is_heard_answered_and_interrupted() {
    let server = spawn_server(&["--api-key", KEY]);
    let dir = tempfile::tempdir().expect("tempdir");
    let voice = |text: &str, file: &str| {
        let (x, r) = own_voice(text, &dir.path().join(file));
        resample(&x, r, RATE)
    };
    let story = voice(
        "Tell me a long story about the sea and the ships on it.",
        "story.wav",
    );
    let stop = voice("Stop, please stop talking.", "stop.wav");

    // A connection that never starts is closed.
    let url = server.ws_url(PATH);
    let idle = tokio::spawn(async move {
        let (mut ws, _) = tokio_tungstenite::connect_async(url)
            .await
            .expect("connect");
        closed_with(&mut ws, Duration::from_secs(20)).await
    });

    // No key, then a wrong one: refused at start.
    for params in [json!({}), json!({"api_key": "wrong"})] {
        let mut ws = connect(&server).await;
        send(&mut ws, start_event("MZ1", "audio/x-mulaw", RATE, params)).await;
        let (code, reason) = closed_with(&mut ws, Duration::from_secs(10)).await;
        assert_eq!(code, CloseCode::Policy);
        assert!(reason.starts_with("invalid_api_key"), "{reason}");
    }
    // Linear PCM at 16 kHz is not what a phone stream carries.
    let mut ws = connect(&server).await;
    send(
        &mut ws,
        start_event("MZ2", "audio/l16", 16_000, json!({"api_key": KEY})),
    )
    .await;
    let (code, reason) = closed_with(&mut ws, Duration::from_secs(10)).await;
    assert_eq!(code, CloseCode::Policy);
    assert!(reason.starts_with("unsupported_media_format"), "{reason}");
    // An unknown voice is named.
    let mut ws = connect(&server).await;
    send(
        &mut ws,
        start_event(
            "MZ3",
            "audio/x-mulaw",
            RATE,
            json!({"api_key": KEY, "voice": "nobody"}),
        ),
    )
    .await;
    let (_, reason) = closed_with(&mut ws, Duration::from_secs(10)).await;
    assert!(reason.contains("nobody"), "{reason}");

    let mut call = Carrier::call(
        &server,
        json!({"api_key": KEY, "voice": "alloy", "silence_duration_ms": "500"}),
    )
    .await;
    // Garbage mid-call: dropped and counted, the call goes on.
    call.ws
        .send(Message::text("{not json"))
        .await
        .expect("send");
    call.ws
        .send(Message::binary(vec![1u8, 2, 3]))
        .await
        .expect("send");
    call.event("nonsense", json!({})).await;
    call.event("media", json!({"track": "inbound", "payload": "@@@"}))
        .await;
    call.event("dtmf", json!({"track": "inbound_track", "digit": "x"}))
        .await;

    // The caller asks; the answer comes as μ-law and plays.
    call.say(&vec![0.0; RATE as usize / 4]);
    call.say(&story);
    let talking = call
        .run_until(Duration::from_secs(90), |c| {
            c.received >= u64::from(RATE) * 3 / 2 && c.played >= u64::from(RATE) * 3 / 5
        })
        .await;
    assert!(
        talking,
        "no answer played: {} samples received",
        call.received
    );
    assert!(rms(&call.answer) > 0.01, "the answer is silent");
    let cut = call.last_response().expect("marks name their response");
    assert!(cut.starts_with("resp_"), "{cut}");

    // The caller talks over it: the carrier is told to clear, the cut
    // answer sends nothing more, and the interruption is answered.
    call.say(&stop);
    call.say(&vec![0.0; RATE as usize]);
    let cleared = call
        .run_until(Duration::from_secs(30), |c| c.clears > 0)
        .await;
    assert!(cleared, "no clear after the caller spoke over the answer");
    let answered = call
        .run_until(Duration::from_secs(90), |c| {
            c.last_response().is_some_and(|r| r != cut)
        })
        .await;
    assert!(answered, "the interruption was not answered");
    let late: Vec<_> = call
        .marks
        .iter()
        .filter(|(n, after_clear)| *after_clear > 0 && n.starts_with(&format!("{cut}:")))
        .collect();
    assert!(
        late.is_empty(),
        "audio of the cut answer after the clear: {late:?}"
    );

    // A key pressed while nothing runs is a turn of its own, answered.
    // ("Stop, please stop talking." may be two turns: quiet for a while.)
    let mut settled = false;
    for _ in 0..30 {
        call.run_until(Duration::from_secs(90), |c| {
            c.last_media.elapsed() > Duration::from_secs(2)
        })
        .await;
        if metric_keyed(&server, KEY, "omnistream_requests_in_flight", &[]) == 0.0 {
            settled = true;
            break;
        }
    }
    assert!(settled, "the answers did not finish");
    let before = call.last_response();
    call.event("dtmf", json!({"track": "inbound_track", "digit": "5"}))
        .await;
    let keyed = call
        .run_until(Duration::from_secs(90), |c| c.last_response() != before)
        .await;
    assert!(
        keyed,
        "the key press was not answered:\n{}",
        server.output()
    );

    // The call ends as Twilio ends it: `stop`, then the socket closes.
    call.event(
        "stop",
        json!({"accountSid": "AC00000000000000000000000000000000", "callSid": "CA00000000000000000000000000000001"}),
    )
    .await;
    call.ws.close(None).await.expect("close");

    let (code, reason) = idle.await.expect("idle task");
    assert_eq!(code, CloseCode::Policy);
    assert!(reason.starts_with("start_timeout"), "{reason}");

    let m = |name: &str, labels: &[(&str, &str)]| metric_keyed(&server, KEY, name, labels);
    let errors = |code: &str| m("omnistream_phone_errors_total", &[("code", code)]);
    for code in [
        "invalid_json",
        "invalid_event",
        "unknown_event_type",
        "invalid_base64",
        "invalid_digit",
        "unsupported_media_format",
        "start_timeout",
    ] {
        assert!(errors(code) >= 1.0, "{code} not counted");
    }
    assert_eq!(errors("invalid_api_key"), 2.0);
    let answers = |outcome: &str| {
        m(
            "omnistream_requests_total",
            &[("endpoint", "twilio"), ("outcome", outcome)],
        )
    };
    assert!(answers("ok") >= 1.0, "no answer counted ok");
    assert!(
        answers("cancelled") >= 1.0,
        "the cut answer not counted cancelled"
    );
    assert!(
        eventually(10, || m("omnistream_sessions_open", &[]) == 0.0),
        "the call's session stayed open"
    );
    let health = omnistream_e2e::http_get(server.port, "/health");
    assert!(health.contains("\"status\":\"ok\""), "{health}");
}

/// A server without API keys takes a call with none; a key pressed first
/// thing is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn without_an_api_key_configured_a_call_needs_none() {
    let server = spawn_server(&[]);
    let mut call = Carrier::call(&server, json!({})).await;
    call.event("dtmf", json!({"track": "inbound_track", "digit": "1"}))
        .await;
    let answered = call
        .run_until(Duration::from_secs(90), |c| c.received > 0)
        .await;
    assert!(answered, "no answer to the key press");
    call.ws.close(None).await.expect("close");
    assert!(eventually(10, || metric(
        &server,
        "omnistream_sessions_open",
        &[]
    ) == 0.0));
}
