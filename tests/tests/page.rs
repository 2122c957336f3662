//! The demo page in real browsers: headless Debian Chromium (over CDP) and
//! Firefox ESR (over WebDriver BiDi), both driven by puppeteer-core
//! (`tests/web/page_test.mjs`) against `omnistream serve`.
//! Over WebRTC the answer the browser received is transcribed by Whisper
//! (`tests/python/wer.py`) and its jitter-buffer counters checked for gaps.
//! Needs what `scripts/setup.sh --dev` installs: chromium, firefox-esr, node,
//! `tests/web/node_modules` and `tests/python/requirements.txt`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use omnistream_e2e::{http_get, root, spawn_server, whisper_wer};
use serde_json::Value;

/// (BROWSER for page_test.mjs, its executable, its Debian package)
const CHROMIUM: (&str, &str, &str) = ("chromium", "/usr/bin/chromium", "chromium");
const FIREFOX: (&str, &str, &str) = ("firefox", "/usr/bin/firefox-esr", "firefox-esr");

fn require_tools((_, exe, package): (&str, &str, &str)) {
    let web = root().join("tests/web");
    assert!(
        Path::new(exe).exists(),
        "{exe} is missing: run scripts/setup.sh --dev (apt package {package})"
    );
    assert!(
        web.join("node_modules/puppeteer-core").exists(),
        "tests/web/node_modules is missing: run scripts/setup.sh --dev (npm ci in tests/web)"
    );
}

/// Runs `node page_test.mjs URL`, killing it past `limit`; returns its JSON.
fn run_page_test(browser: &str, url: &str, limit: Duration) -> Value {
    run_page_test_with(browser, url, limit, &[])
}

/// [`run_page_test`] with extra environment (`MIC_WAV`: hands-free).
fn run_page_test_with(browser: &str, url: &str, limit: Duration, env: &[(&str, &str)]) -> Value {
    run_script("page_test.mjs", &[url], browser, limit, env)
}

/// Runs `node tests/web/SCRIPT ARGS…`, killing it past `limit`; its JSON.
fn run_script(
    script: &str,
    args: &[&str],
    browser: &str,
    limit: Duration,
    env: &[(&str, &str)],
) -> Value {
    let web = root().join("tests/web");
    let mut child = Command::new("node")
        .arg(web.join(script))
        .args(args)
        .envs(env.iter().copied())
        .env("BROWSER", browser)
        .current_dir(&web)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running node (install nodejs: scripts/setup.sh --dev)");
    let start = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{script} ran past {limit:?}");
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => panic!("waiting for node: {e}"),
        }
    }
    let out = child.wait_with_output().expect("node output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON from {script}\nstdout:\n{stdout}\nstderr:\n{stderr}"));
    let v: Value = serde_json::from_str(line).expect("the script's JSON");
    assert!(
        out.status.success() && v.get("error").is_none(),
        "{script} failed: {}\nstderr:\n{stderr}",
        serde_json::to_string_pretty(&v).unwrap_or_default()
    );
    v
}

/// The strict audio check (no packet lost, little concealed) measures the
/// server's pacing, so that test runs with no other browser beside it: two
/// browsers and the models on CI's two cores starve the receiving one (a
/// packet lost on loopback, seconds concealed). The others may share.
static ALONE: std::sync::RwLock<()> = std::sync::RwLock::new(());

fn alone() -> std::sync::RwLockWriteGuard<'static, ()> {
    ALONE.write().unwrap_or_else(|e| e.into_inner())
}

fn shared() -> std::sync::RwLockReadGuard<'static, ()> {
    ALONE.read().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn page_calls_over_webrtc_in_chromium() {
    let _alone = alone();
    page_streams_text_and_audio(CHROMIUM, "webrtc");
}

#[test]
fn page_calls_over_webrtc_in_firefox() {
    let _shared = shared();
    page_streams_text_and_audio(FIREFOX, "webrtc");
}

#[test]
fn page_streams_over_the_websocket_in_chromium() {
    let _shared = shared();
    page_streams_text_and_audio(CHROMIUM, "websocket");
}

/// Hands-free in Chromium over the WebRTC call: the (fake) microphone asks
/// a question in omnistream's own voice; the page shows what the server
/// heard and plays the answer, with the time from the end of speech to its
/// first audio.
#[test]
fn page_hands_free_in_chromium() {
    let _shared = shared();
    page_hands_free(CHROMIUM, "webrtc");
}

/// The same over the WebSocket: the page sends the microphone itself
/// (`input_audio_buffer.append`) and plays the answer's audio deltas.
#[test]
fn page_hands_free_over_the_websocket_in_chromium() {
    let _shared = shared();
    page_hands_free(CHROMIUM, "websocket");
}

fn page_hands_free(browser: (&str, &str, &str), transport: &str) {
    require_tools(browser);
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().expect("tempdir");
    let wav = dir.path().join("question.wav");
    let out = omnistream_e2e::omnistream([
        "say",
        "What is the capital of France?",
        "-o",
        wav.to_str().expect("utf-8 path"),
    ]);
    assert!(out.status.success(), "omnistream say: {out:?}");
    // Chromium's fake microphone starts with the call, before the session
    // turns turn detection on: the question comes after 3 s of silence.
    let bytes = std::fs::read(&wav).expect("read wav");
    let (speech, rate) = omnistream_codecs::wav::parse_wav(&bytes).expect("parse wav");
    let mut mic = vec![0.0; 3 * rate as usize];
    mic.extend(speech);
    omnistream_codecs::wav::write_wav(&wav, &mic, rate).expect("write wav");
    let url = format!("{}/?transport={transport}", server.url);
    let v = run_page_test_with(
        browser.0,
        &url,
        Duration::from_secs(300),
        &[("MIC_WAV", wav.to_str().expect("utf-8 path"))],
    );
    eprintln!(
        "hands-free: {}",
        serde_json::to_string_pretty(&v).unwrap_or_default()
    );
    assert_eq!(v["handsfree_pressed"], "true", "{v}");
    let turns = v["stats"]["turns"].as_array().cloned().unwrap_or_default();
    let t = turns
        .iter()
        .find(|t| t["heard"].as_str().is_some_and(|h| !h.is_empty()))
        .unwrap_or_else(|| panic!("nothing heard: {v}"));
    let heard = t["heard"].as_str().unwrap_or_default().to_lowercase();
    assert!(heard.contains("capital") && heard.contains("france"), "{t}");
    assert_eq!(t["status"], "completed", "{t}");
    assert_eq!(t["audio_started"], true, "{t}");
    assert!(t["ttfp_ms"].as_f64().is_some_and(|x| x > 0.0), "{t}");
    let shown = v["user_shown"].to_string().to_lowercase();
    assert!(
        shown.contains("france"),
        "the transcript is not shown: {shown}"
    );
    let status = v["status_text"].as_str().unwrap_or_default();
    let want = if transport == "webrtc" {
        "WebRTC"
    } else {
        "WebSocket"
    };
    assert!(status.contains(want), "{transport}: status {status:?}");
    let errors = v["console_errors"].as_array().cloned().unwrap_or_default();
    assert!(errors.is_empty(), "console errors: {errors:?}");
}

fn page_streams_text_and_audio(browser: (&str, &str, &str), transport: &str) {
    require_tools(browser);
    let server = spawn_server(&[]);

    // The static assets, before the browser.
    let html = http_get(server.port, "/");
    assert!(html.contains("<title>omnistream</title>"), "{html}");
    assert!(http_get(server.port, "/app.js").contains("omnistreamStats"));
    assert!(http_get(server.port, "/style.css").contains(".composer"));

    let url = format!("{}/?transport={transport}", server.url);
    let v = run_page_test(browser.0, &url, Duration::from_secs(420));
    eprintln!(
        "page test: {}",
        serde_json::to_string_pretty(&v).unwrap_or_default()
    );
    assert_eq!(v["status"], 200);
    assert_eq!(v["title"], "omnistream");
    assert_eq!(v["browser"], browser.0);
    // The page connected the asked way (no silent fallback).
    assert_eq!(
        v["after_first"]["transport"], transport,
        "{}",
        v["status_text"]
    );
    // The controls carry the names a screen-reader user hears.
    assert_eq!(
        v["labels"],
        serde_json::json!({"message": "Message", "send": "Send", "stop": "Stop"})
    );

    // Turn 1: text and audio streamed, both timings measured and shown.
    let t0 = &v["after_first"]["turns"][0];
    assert_eq!(t0["status"], "completed", "{t0}");
    assert_eq!(t0["audio_started"], true, "{t0}");
    let ttft = t0["ttft_ms"].as_f64().expect("ttft_ms");
    let ttfp = t0["ttfp_ms"].as_f64().expect("ttfp_ms");
    assert!(ttft > 0.0 && ttfp > 0.0, "{t0}");
    assert!(
        t0["text"].as_str().is_some_and(|t| !t.trim().is_empty()),
        "{t0}"
    );
    assert!(
        t0["audio_seconds"].as_f64().is_some_and(|s| s > 0.2),
        "{t0}"
    );
    for shown in ["ttfp_shown", "ttft_shown"] {
        let s = v[shown].as_str().unwrap_or("");
        assert!(
            s.ends_with(" ms") && s.trim_end_matches(" ms").parse::<u64>().is_ok(),
            "{shown}: {s:?}"
        );
    }
    // The audio clock ran: playback really happened.
    assert!(
        v["after_first"]["audio_clock_s"]
            .as_f64()
            .is_some_and(|c| c > 0.0),
        "audio clock did not run: {}",
        v["after_first"]
    );

    if transport == "webrtc" {
        check_received_audio(&v, browser.0 == CHROMIUM.0);
    }

    // Turn 2: Stop sent response.cancel and the server cancelled.
    let t1 = &v["stats"]["turns"][1];
    assert_eq!(t1["status"], "cancelled", "{t1}");

    let errors = v["console_errors"].as_array().cloned().unwrap_or_default();
    assert!(errors.is_empty(), "console errors: {errors:?}");
    let shot = v["screenshot"].as_str().expect("screenshot path");
    let size = std::fs::metadata(shot).map(|m| m.len()).unwrap_or(0);
    assert!(size > 1000, "screenshot {shot} is {size} bytes");
    eprintln!("screenshot: {shot}");
}

/// Most non-silent audio the browser's jitter buffer may conceal (make up)
/// during the answer, as a share of the samples it received meanwhile, and
/// most concealment events per second of it. The track carries 20 ms frames
/// without a break (silence between answers) and loopback loses nothing, so a
/// correct run conceals only when a busy CPU holds the server's pacer back
/// and it then catches up in a burst: measured 0.2-2.3% in 1-8 events over a
/// 60 s answer in Chromium on a 2-core machine at load 2-6 (stalls of up to
/// 1.5 s while the answer is still being generated). A pacer that drifts,
/// skips frames or breaks the RTP timestamps conceals more, or in many short
/// gaps.
const MAX_CONCEALED: f64 = 0.05;
const MAX_CONCEALMENTS_PER_S: f64 = 0.25;
/// Most audio that arrived but was never played (a jitter buffer that
/// overflows flushes itself; concealment does not count that): what is still
/// buffered as the recording stops, measured up to 0.54 s in Chromium.
const MAX_UNPLAYED_S: f64 = 1.0;

/// WebRTC: the answer as the browser decoded it (turn 1, recorded by
/// page_test.mjs) says the transcript the page showed (Whisper tiny.en WER),
/// and arrived whole (inbound-rtp counters).
///
/// Asserted in Chromium only. Headless Firefox on a busy 2-core machine
/// stalls its own audio thread (a second with 40 ms played, seen while the
/// packets kept arriving), so its jitter buffer piles up, speeds the answer up
/// by seconds and, 3 runs in 8, overflowed and dropped ~4 s of it (WER
/// 0.12-0.13 against 0.02-0.06 otherwise): a browser problem, not the
/// call's. Firefox's figures are printed all the same.
fn check_received_audio(v: &Value, strict: bool) {
    let r = &v["received"];
    let wav = v["received_wav"].as_str().expect("received_wav");
    let transcript = v["transcript"].as_str().unwrap_or("").trim().to_string();
    assert!(!transcript.is_empty(), "no transcript: {r}");
    assert_eq!(r["truncated"], false, "the recording hit its limit: {r}");
    // Said here rather than as a WER of 1: the recorder got nothing.
    assert!(
        r["peak"].as_f64().is_some_and(|p| p > 0.05),
        "the recording is silent: {r}"
    );

    let (start, end) = (&v["inbound_audio_at_start"], &v["inbound_audio"]);
    let delta = |k: &str| {
        let n = |s: &Value| {
            s[k].as_f64()
                .unwrap_or_else(|| panic!("inbound-rtp has no {k}: {start} {end}"))
        };
        n(end) - n(start)
    };
    let received = delta("totalSamplesReceived");
    let seconds = delta("totalSamplesDuration");
    let concealed = delta("concealedSamples") - delta("silentConcealedSamples");
    let events = delta("concealmentEvents");
    // Samples the packets brought (20 ms of Opus at 48 kHz each) less those
    // played: decoded ones (received less concealed) before the time
    // stretching took some out or put some in.
    let played = received - delta("concealedSamples") + delta("removedSamplesForAcceleration")
        - delta("insertedSamplesForDeceleration");
    let unplayed_s = (delta("packetsReceived") * 960.0 - played) / 48000.0;
    let lost = end["packetsLost"].as_f64().unwrap_or(-1.0);
    let share = if received > 0.0 {
        concealed / received
    } else {
        1.0
    };
    let (wer, detail) = whisper_wer(&[(PathBuf::from(wav), transcript)]);
    eprintln!(
        "received audio ({}): WER {wer}, Whisper heard {}; {lost} packets lost, \
         {concealed} of {received} samples concealed ({:.2}%) in {events} events \
         over {seconds:.1} s of answer, {unplayed_s:.2} s unplayed",
        v["browser"],
        detail["items"][0]["hyp"],
        share * 100.0
    );
    if !strict {
        return;
    }
    let context = format!("recording: {r}\ninbound-rtp: {start} -> {end}");
    assert!(
        wer <= 0.15,
        "the received audio is not intelligible: WER {wer}\n{detail}\n{context}"
    );
    assert_eq!(lost, 0.0, "packets lost\n{context}");
    assert!(
        received > 0.0,
        "no audio received during the answer\n{context}"
    );
    assert!(
        share <= MAX_CONCEALED,
        "{:.2}% of the answer concealed (gaps)\n{context}",
        share * 100.0
    );
    assert!(
        events <= MAX_CONCEALMENTS_PER_S * seconds,
        "{events} gaps concealed in {seconds:.1} s of answer\n{context}"
    );
    assert!(
        unplayed_s <= MAX_UNPLAYED_S,
        "{unplayed_s:.2} s of the audio received was never played\n{context}"
    );
}

/// OpenAI's WebRTC call flow, as OpenAI's guide writes it, in Chromium
/// (`tests/web/openai_call.mjs`): an ephemeral key with a session, the offer
/// POSTed to `/v1/realtime/calls` with it, a turn answered in audio on the
/// track, the app server's sideband on the call, the multipart form with
/// the API key, hang-up; a reused, forged or misapplied key is refused.
#[test]
fn openai_call_flow_in_chromium() {
    require_tools(CHROMIUM);
    let _shared = shared();
    const KEY: &str = "call-flow-key";
    let server = spawn_server(&["--api-key", KEY]);
    let v = run_script(
        "openai_call.mjs",
        &[&server.url, KEY],
        "chromium",
        Duration::from_secs(300),
        &[],
    );
    let call = &v["call"];
    assert_eq!(call["status"], 201, "{v}");
    assert_eq!(call["contentType"], "application/sdp", "{v}");
    assert!(
        call["location"]
            .as_str()
            .is_some_and(|l| l.starts_with("/v1/realtime/calls/")),
        "{v}"
    );
    assert_eq!(
        call["instructions"], v["secret"]["session"],
        "the key's session applies: {v}"
    );
    assert_eq!(call["status_done"], "completed", "{v}");
    assert!(
        call["transcript"]
            .as_str()
            .is_some_and(|t| !t.trim().is_empty()),
        "{v}"
    );
    // 20 ms packets: at least two seconds of the answer reached the browser.
    assert!(call["packetsReceived"].as_u64().unwrap_or(0) >= 100, "{v}");
    assert_eq!(call["sidebandTranscript"], call["transcript"], "{v}");
    assert_eq!(call["pageSawSideband"], true, "{v}");
    assert_eq!(call["formStatus"], 201, "{v}");
    assert_eq!(call["formInstructions"], "Form session.", "{v}");
    assert_eq!(call["formWithEphemeralStatus"], 400, "{v}");
    assert_eq!(call["formWithEphemeralParam"], "session", "{v}");
    // Refusals: a used key, a forged one, one shown to another endpoint,
    // no API key, a bad session or lifetime (naming the field).
    assert_eq!(call["reusedStatus"], 401, "{v}");
    assert_eq!(v["forged"]["status"], 401, "{v}");
    assert_eq!(v["ekOnModels"], 401, "{v}");
    assert_eq!(v["noKeyStatus"], 401, "{v}");
    assert_eq!(v["badVoice"]["status"], 400, "{v}");
    assert_eq!(v["badVoice"]["param"], "voice", "{v}");
    assert_eq!(v["badTtl"]["param"], "expires_after.seconds", "{v}");
    assert_eq!(v["secret"]["prefix"], "ek_", "{v}");
    // Hang-up over HTTP ends the call, the sideband with it; then 404.
    assert_eq!(v["hangupStatus"], 200, "{v}");
    assert_ne!(v["afterHangup"]["pc"], "connected", "{v}");
    assert_eq!(v["afterHangup"]["sideband"], 3, "the sideband closed: {v}");
    assert_eq!(v["hangupAgainStatus"], 404, "{v}");
    let idle = omnistream_e2e::eventually(15, || {
        omnistream_e2e::metric_keyed(&server, KEY, "omnistream_sessions_open", &[]) == 0.0
    });
    assert!(idle, "the calls' sessions stayed open");
}
