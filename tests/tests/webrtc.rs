//! `POST /v1/webrtc` with real peers: aiortc (`tests/python/webrtc_peer.py`)
//! over Opus and over PCMU, hang-ups mid-answer, connect/disconnect cycles and
//! bad offers. The page's WebRTC call in Chromium and Firefox is in `page.rs`.

use std::process::Command;
use std::time::{Duration, Instant};

use omnistream_codecs::wav::write_wav;
use omnistream_e2e::{
    assert_wer_like_reference, espeak, exclusive, omnistream, resample, root, spawn_server,
    utterances, whisper_wer, Server,
};
use serde_json::Value;

fn peer(server: &Server, args: &[&str]) -> Value {
    let out = Command::new("python3")
        .arg(root().join("tests/python/webrtc_peer.py"))
        .args(["--url", &server.url])
        .args(args)
        .output()
        .expect("running python3 (scripts/setup.sh --dev installs aiortc)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().rev().find(|l| l.starts_with('{'));
    let v: Value = line
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| {
            panic!(
                "no JSON from webrtc_peer.py\nstdout:\n{stdout}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    assert!(
        out.status.success() && v.get("error").is_none(),
        "peer failed: {v}\nstderr:\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        server.log.lock().map(|l| l.clone()).unwrap_or_default()
    );
    v
}

/// Waits until `/metrics` shows nothing left of any peer or request.
fn settled(server: &Server, limit: Duration) -> String {
    let t0 = Instant::now();
    loop {
        let m = server.metrics();
        let zero = |name: &str| {
            m.lines()
                .filter(|l| l.starts_with(name) && !l.starts_with('#'))
                .all(|l| l.ends_with(" 0"))
        };
        if zero("omnistream_webrtc_peers")
            && zero("omnistream_sessions_open")
            && zero("omnistream_engine_requests_in_flight")
            && zero("omnistream_connections_open")
            && zero("omnistream_stage{metric=\"active_requests\"")
        {
            return m;
        }
        assert!(
            t0.elapsed() < limit,
            "still busy after {limit:?}:\n{}",
            m.lines()
                .filter(|l| !l.starts_with('#'))
                .collect::<Vec<_>>()
                .join("\n")
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn answer_checks(v: &Value, rate: u64) {
    assert_eq!(v["status"], 201, "{v}");
    assert!(
        v["location"]
            .as_str()
            .is_some_and(|l| l.starts_with("/v1/webrtc/sess_")),
        "{v}"
    );
    assert_eq!(v["errors"], serde_json::json!([]), "{v}");
    // The microphone's second went up the track and into the input buffer.
    let mic = v["mic_seconds"].as_f64().expect("mic_seconds");
    assert!((0.6..3.0).contains(&mic), "mic audio {mic} s: {v}");
    assert_eq!(v["sample_rate"], rate, "{v}");
    assert!(v["answer_seconds"].as_f64().is_some_and(|s| s > 1.0), "{v}");
    assert!(v["rms"].as_f64().is_some_and(|r| r > 300.0), "silent: {v}");
    assert_eq!(v["pts_monotonic"], true, "{v}");
    // Paced 20 ms frames: no hole in the stream while the answer plays, by
    // the frames' RTP timestamps. The arrival gaps at a Python receiver on a
    // busy 2-core machine also carry its scheduling (40.4 and 64.7 ms seen in
    // CI with no frame missing): bounded where a jitter buffer still absorbs
    // them, so a server that sends in bursts fails.
    assert_eq!(v["frames_lost"], 0, "frames missing from the stream: {v}");
    let gap = v["max_gap_ms"].as_f64().expect("max_gap_ms");
    assert!(gap < 150.0, "a {gap} ms gap between frames: {v}");
    let events: Vec<&str> = v["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    for e in [
        "response.created",
        "output_audio_buffer.started",
        "response.done",
    ] {
        assert!(events.contains(&e), "no {e}: {events:?}");
    }
    // Audio never rides the data channel over WebRTC.
    assert!(
        !events.contains(&"response.output_audio.delta"),
        "{events:?}"
    );
}

#[test]
fn opus_and_pcmu_peers_hear_intelligible_answers() {
    let _alone = exclusive();
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().unwrap();
    let mut pairs = Vec::new();
    for (codec, rate, prompt) in [
        // Greedy answers of ~37 words each: one misheard word moves the
        // pooled WER by ~1.4%, not by 17% as in a six-word answer.
        ("opus", 48_000, "What do bees make?"),
        ("PCMU", 8_000, "What is rain?"),
    ] {
        let out = dir.path().join(codec);
        std::fs::create_dir_all(&out).unwrap();
        let v = peer(
            &server,
            &[
                "--codec",
                codec,
                "--prompt",
                prompt,
                "--max-tokens",
                "40",
                "--out",
                out.to_str().unwrap(),
            ],
        );
        eprintln!("{codec}: {v}");
        answer_checks(&v, rate);
        let transcript = v["transcript"].as_str().unwrap_or("").to_string();
        assert!(!transcript.trim().is_empty(), "{v}");
        pairs.push((out.join("answer.wav"), transcript));
    }
    let (wer, detail) = whisper_wer(&pairs);
    assert!(wer <= 0.15, "WER {wer:.3} > 15%: {detail}");
    settled(&server, Duration::from_secs(15));
    // The calls' answers count under their own transport.
    let ok = |endpoint| {
        omnistream_e2e::metric(
            &server,
            "omnistream_requests_total",
            &[("endpoint", endpoint), ("outcome", "ok")],
        )
    };
    assert!(ok("webrtc") >= 2.0, "{}", server.metrics());
    assert_eq!(ok("realtime"), 0.0, "{}", server.metrics());
}

/// Hands-free: a question said into the microphone (omnistream's own voice;
/// espeak-ng's is in `voice.rs`) is found by `server_vad`, heard, and
/// answered in intelligible audio.
#[test]
fn a_spoken_question_is_heard_and_answered() {
    let _alone = exclusive();
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().unwrap();
    let question = dir.path().join("question.wav");
    let said = omnistream([
        "say",
        "What do bees make?",
        "-o",
        question.to_str().unwrap(),
    ]);
    assert!(said.status.success(), "omnistream say: {said:?}");
    let v = peer(
        &server,
        &[
            "--mic-wav",
            question.to_str().unwrap(),
            "--max-tokens",
            "40",
            "--out",
            dir.path().to_str().unwrap(),
        ],
    );
    eprintln!("hands-free: {v}");
    let heard = v["mic_transcript"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    assert!(heard.contains("bees"), "heard {heard:?}: {v}");
    answer_checks(&v, 48_000);
    let transcript = v["transcript"].as_str().unwrap_or("").to_string();
    let (wer, detail) = whisper_wer(&[(dir.path().join("answer.wav"), transcript)]);
    assert!(wer <= 0.15, "WER {wer:.3} > 15%: {detail}");
    settled(&server, Duration::from_secs(15));
}

/// Speech over the microphone track, Opus (48 kHz) and PCMU (8 kHz
/// telephony): ten espeak-ng sentences and three in omnistream's own voice,
/// one turn each by `server_vad`. The server hears them about as well as the
/// reference implementation of its recognizer (faster-whisper over the same
/// files) hears the same audio at the codec's rate, and answers in audio.
#[test]
fn speech_over_the_track_is_heard_like_the_reference() {
    let _alone = exclusive();
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().unwrap();
    let all = utterances(dir.path());
    let mut report = Vec::new();
    for (codec, rate) in [("opus", 48_000), ("PCMU", 8_000)] {
        let mut wavs = Vec::new();
        let mut refs = Vec::new();
        for (i, (text, x, r)) in all.iter().enumerate() {
            let wav = dir.path().join(format!("{codec}{i}.wav"));
            write_wav(&wav, &resample(x, *r, rate), rate).expect("write wav");
            wavs.push(wav.to_str().expect("utf-8 path").to_string());
            refs.push((wav, text.clone()));
        }
        let out = dir.path().to_str().expect("utf-8 path");
        let mut args = vec![
            "--codec",
            codec,
            "--max-tokens",
            "24",
            "--out",
            out,
            "--mic-wav",
        ];
        args.extend(wavs.iter().map(String::as_str));
        let v = peer(&server, &args);
        let heard: Vec<String> = v["mic_transcripts"]
            .as_array()
            .unwrap_or_else(|| panic!("{v}"))
            .iter()
            .map(|t| t.as_str().unwrap_or_default().to_string())
            .collect();
        assert_eq!(heard.len(), all.len(), "{v}");
        let pairs: Vec<(String, String)> = all
            .iter()
            .zip(heard)
            .map(|((text, _, _), h)| (text.clone(), h))
            .collect();
        let (ours, reference) = assert_wer_like_reference(codec, &pairs, &refs);
        // The last turn is answered on the track (`incomplete`: the token cap).
        let status = v["response_status"].as_str().unwrap_or_default();
        assert!(matches!(status, "completed" | "incomplete"), "{v}");
        assert!(v["answer_seconds"].as_f64().is_some_and(|s| s > 1.0), "{v}");
        assert!(v["rms"].as_f64().is_some_and(|r| r > 300.0), "silent: {v}");
        report.push((codec, ours, reference));
    }
    eprintln!("WER over WebRTC (ours, faster-whisper): {report:?}");
    settled(&server, Duration::from_secs(15));
}

/// Talking over an answer on a call: the track goes quiet within 100 ms (+
/// one 20 ms frame) of the server detecting the speech (its queue is
/// emptied), and the conversation keeps only what was played.
#[test]
fn talking_over_an_answer_on_a_call_stops_it() {
    let _alone = exclusive();
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().unwrap();
    let stop = dir.path().join("stop.wav");
    espeak("Stop, please stop talking.", &stop);
    let v = peer(
        &server,
        &[
            "--prompt",
            "Tell me a long story about the sea and the ships on it.",
            "--max-tokens",
            "300",
            "--barge-in-wav",
            stop.to_str().unwrap(),
        ],
    );
    eprintln!("barge-in: {v}");
    assert_eq!(v["response_status"], "cancelled", "{v}");
    assert_eq!(v["cleared"], true, "{v}");
    assert!(v["loud_frames"].as_u64().is_some_and(|n| n > 20), "{v}");
    let late = v["late_ms"].as_f64().unwrap_or(f64::INFINITY);
    assert!(
        late <= 120.0,
        "answer audio {late} ms after the speech was detected: {v}"
    );
    let (full, kept) = (
        v["transcript"].as_str().unwrap_or_default(),
        v["kept"].as_str().unwrap_or_default(),
    );
    assert!(
        full.starts_with(kept) && kept.len() < full.len(),
        "kept {kept:?} of {full:?}"
    );
    let heard = v["mic_transcript"]
        .as_str()
        .unwrap_or_default()
        .to_lowercase();
    assert!(heard.contains("stop"), "{v}");
    settled(&server, Duration::from_secs(15));
}

#[test]
fn hanging_up_mid_answer_cancels_it_everywhere() {
    let _alone = exclusive();
    let server = spawn_server(&[]);
    let cancelled_before = server
        .metric("omnistream_stage{metric=\"cancelled_total\",stage=\"thinker\"}")
        .unwrap_or(0.0);
    let v = peer(
        &server,
        &[
            "--prompt",
            "Tell me a long story about the sea and the ships on it.",
            "--max-tokens",
            "400",
            "--hangup-after-audio-ms",
            "300",
        ],
    );
    assert_eq!(v["hung_up"], true, "{v}");
    let m = settled(&server, Duration::from_secs(15));
    let cancelled = m
        .lines()
        .find(|l| l.starts_with("omnistream_stage{metric=\"cancelled_total\",stage=\"thinker\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(
        cancelled > cancelled_before,
        "the Thinker did not cancel the answer:\n{m}"
    );
}

#[test]
fn fifty_connect_disconnect_cycles_leave_nothing_behind() {
    let _alone = exclusive();
    let server = spawn_server(&[]);
    peer(&server, &["--cycles", "5"]);
    settled(&server, Duration::from_secs(15));
    let rss = || {
        server
            .metric("omnistream_process_resident_bytes")
            .expect("resident bytes")
            / 1048576.0
    };
    let tasks = || server.metric("omnistream_tasks_open").unwrap_or(-1.0);
    let (rss0, tasks0) = (rss(), tasks());
    let v = peer(&server, &["--cycles", "50"]);
    assert_eq!(v["cycles"], 50);
    settled(&server, Duration::from_secs(20));
    // Tasks wind down right after the peers: allow them a moment.
    let t0 = Instant::now();
    while tasks() > tasks0 && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(tasks(), tasks0, "tasks left behind");
    let grown = rss() - rss0;
    assert!(grown < 40.0, "RSS grew {grown:.1} MiB over 50 calls");
}

#[test]
fn bad_offers_get_clear_errors_and_the_server_stays_healthy() {
    let _alone = exclusive();
    let server = spawn_server(&[]);
    let post = |ctype: &str, body: &str| -> (u16, String) {
        let out = Command::new("curl")
            .args(["-s", "-o", "-", "-w", "\n%{http_code}", "-X", "POST"])
            .args(["-H", &format!("Content-Type: {ctype}")])
            .args(["--data-binary", body])
            .arg(format!("{}/v1/webrtc", server.url))
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        (code.trim().parse().unwrap_or(0), body.to_string())
    };
    let head = "v=0\r\no=- 1 2 IN IP4 127.0.0.1\r\ns=-\r\nt=0 0\r\n";
    let cases = [
        (
            "application/sdp",
            "hello, I am not SDP".to_string(),
            "not an SDP offer",
        ),
        (
            "application/sdp",
            format!("{head}m=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\n"),
            "no audio section",
        ),
        (
            "application/sdp",
            format!("{head}m=audio 9 UDP/TLS/RTP/SAVPF 9\r\na=rtpmap:9 G722/8000\r\n"),
            "no supported audio codec",
        ),
        (
            "application/sdp",
            format!("{head}m=audio 9 UDP/TLS/RTP/SAVPF 111\r\na=rtpmap:111 opus/48000/2\r\n"),
            "the offer cannot be used",
        ),
        ("application/json", "{\"type\": \"answer\"}".into(), "type"),
        ("application/json", "{not json".into(), "not JSON"),
    ];
    // A type a page elsewhere could send without a preflight: 415; an offer
    // over 64 KiB: 413; both in the JSON error shape.
    let cases = cases.into_iter().map(|(c, b, e)| (c, b, e, 400)).chain([
        ("text/plain", "v=0".into(), "application/sdp", 415),
        (
            "application/sdp",
            format!("v=0\r\n{}", "a=x\r\n".repeat(20_000)),
            "larger than 65536 bytes",
            413,
        ),
    ]);
    for (ctype, body, expect, status) in cases {
        let (code, text) = post(ctype, &body);
        assert_eq!(code, status, "{ctype} {body:.60}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_default();
        let msg = v["error"]["message"].as_str().unwrap_or("");
        assert!(msg.contains(expect), "{expect:?} not in {msg:?}");
    }
    settled(&server, Duration::from_secs(10));
    assert!(omnistream_e2e::http_get(server.port, "/health").contains("\"ok\""));
    // Hanging up a session that does not exist is a 404.
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            "-X",
            "DELETE",
        ])
        .arg(format!("{}/v1/webrtc/sess_nope", server.url))
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "404");
}
