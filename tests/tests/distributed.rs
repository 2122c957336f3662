//! Stages beyond one process: the real binary's `omnistream stage` processes
//! and `omnistream serve --nats` gateways, joined through a real `nats-server`
//! (Debian's) on loopback, started and stopped here. They run one at a time
//! (`exclusive`): each starts several processes, and two tests' worth on two
//! cores change the timings they judge (first audio, the death bound) and the
//! Qwen3-Omni Talker's pacing against its Thinker.

use std::io::{BufRead, BufReader};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use base64::Engine as _;
use omnistream_e2e::{
    eventually, metric, post, samples, spawn_server, spawn_stage, whisper_wer, Nats, Server,
};

const SPLIT: &str = "deploy/distributed/tiny-cpu.yaml";

fn b64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .expect("base64")
}

/// A greedy chat answer with audio: (transcript, pcm16 bytes).
fn chat(server: &Server, prompt: &str, voice: &str) -> (String, Vec<u8>) {
    let body = serde_json::json!({
        "model": "x",
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "audio": {"voice": voice, "format": "pcm16"},
    });
    let r = post(
        &format!("{}/v1/chat/completions", server.url),
        &body.to_string(),
        &[],
    );
    assert_eq!(r.status, 200, "{}\n{}", r.body, server.output());
    let v = r.json();
    let audio = &v["choices"][0]["message"]["audio"];
    let text = audio["transcript"]
        .as_str()
        .expect("transcript")
        .to_string();
    (text, b64(audio["data"].as_str().expect("audio data")))
}

/// The largest difference between two pcm16 buffers of one length, in steps.
fn max_pcm16_step(a: &[u8], b: &[u8]) -> i32 {
    let samples = |x: &[u8]| -> Vec<i32> {
        x.chunks_exact(2)
            .map(|c| i32::from(i16::from_le_bytes([c[0], c[1]])))
            .collect()
    };
    let (a, b) = (samples(a), samples(b));
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .max()
        .unwrap_or(0)
}

/// `/v1/audio/speech` as SSE: Ok(pcm16 bytes), or Err(the body) on an error event.
fn speak(url: &str, text: &str) -> Result<Vec<u8>, String> {
    speak_with(
        url,
        serde_json::json!({"model": "tts-1", "input": text, "voice": "joe"}),
    )
}

/// [`speak`] with the request's own fields.
fn speak_with(url: &str, mut body: serde_json::Value) -> Result<Vec<u8>, String> {
    body["response_format"] = "pcm".into();
    body["stream_format"] = "sse".into();
    let r = post(&format!("{url}/v1/audio/speech"), &body.to_string(), &[]);
    if r.status != 200 {
        return Err(format!("{} {}", r.status, r.body));
    }
    let mut pcm = Vec::new();
    let mut done = false;
    for line in r.body.lines() {
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            continue;
        };
        match v["type"].as_str() {
            Some("speech.audio.delta") => pcm.extend(b64(v["audio"].as_str().unwrap_or(""))),
            Some("speech.audio.done") => done = true,
            _ => return Err(r.body.clone()),
        }
    }
    if done {
        Ok(pcm)
    } else {
        Err(r.body)
    }
}

/// Writes pcm16 (24 kHz mono) as a WAV for the WER harness.
fn write_wav(path: &std::path::Path, pcm: &[u8]) {
    let samples: Vec<f32> = pcm
        .chunks_exact(2)
        .map(|c| i16::from_le_bytes([c[0], c[1]]) as f32 / 32768.0)
        .collect();
    omnistream_codecs::wav::write_wav(path, &samples, 24_000).expect("write wav");
}

/// The gateway's replica counters for `stage`: replica label -> value of `m`.
fn replica_counts(gw: &Server, stage: &str, m: &str) -> Vec<(String, f64)> {
    samples(gw)
        .into_iter()
        .filter(|(n, l, _)| {
            n == "omnistream_stage_replica"
                && l.get("stage").map(String::as_str) == Some(stage)
                && l.get("metric").map(String::as_str) == Some(m)
        })
        .map(|(_, l, v)| (l.get("replica").cloned().unwrap_or_default(), v))
        .collect()
}

/// The process id a stage prints when ready (`... ready (HEX) ...`).
fn process_id(stage: &Server) -> String {
    let out = stage.output();
    let i = out.find(" ready (").expect("ready line") + 8;
    out[i..i + 16].to_string()
}

/// Nothing left over: no request in flight on the gateway, none held by a stage.
fn assert_idle(gw: &Server) {
    let idle = eventually(10, || {
        gw.metric("omnistream_engine_requests_in_flight") == Some(0.0)
            && gw.metric("omnistream_requests_in_flight") == Some(0.0)
            && ["talker", "code2wav"].iter().all(|s| {
                replica_counts(gw, s, "active_requests")
                    .iter()
                    .all(|(_, v)| *v == 0.0)
            })
    });
    assert!(idle, "not idle:\n{}", gw.metrics());
}

#[test]
fn split_tiny_pipeline_answers_exactly_as_in_process() {
    let _serial = omnistream_e2e::exclusive();
    let nats = Nats::start();
    let _talker = spawn_stage(SPLIT, "talker", &nats.url, &[]);
    let _c2w = spawn_stage(SPLIT, "code2wav", &nats.url, &[]);
    let gw = spawn_server(&["--profile", SPLIT, "--nats", &nats.url]);
    let local = spawn_server(&["--profile", "deploy/tiny-cpu.yaml"]);
    for prompt in [
        "What do bees make?",
        "Name three colors of the rainbow.",
        "Say hello to my friend Anna.",
    ] {
        let (t_local, a_local) = chat(&local, prompt, "joe");
        let (t_split, a_split) = chat(&gw, prompt, "joe");
        assert!(!a_local.is_empty() && !t_local.is_empty(), "{prompt}");
        assert_eq!(t_split, t_local, "{prompt}: text differs");
        assert_eq!(
            a_split.len(),
            a_local.len(),
            "{prompt}: audio length differs"
        );
        assert!(a_split == a_local, "{prompt}: audio differs");
    }
    // The remote stages did the work and hold nothing now.
    for stage in ["talker", "code2wav"] {
        let done = eventually(5, || {
            let f = replica_counts(&gw, stage, "finished_total");
            f.len() == 1 && f[0].1 >= 3.0
        });
        assert!(done, "{stage}:\n{}", gw.metrics());
    }
    assert_idle(&gw);
}

#[test]
fn split_qwen3_omni_tiny_carries_thinker_states_exactly() {
    let _serial = omnistream_e2e::exclusive();
    let split = "deploy/distributed/qwen3-omni-tiny.yaml";
    let nats = Nats::start();
    // Talker and Code2Wav share one process (and one load of the checkpoint,
    // without its Thinker), as on a GPU.
    let audio = spawn_stage(split, "talker,code2wav", &nats.url, &[]);
    let gw = spawn_server(&["--profile", split, "--nats", &nats.url]);
    let local = spawn_server(&["--profile", "deploy/qwen3-omni-tiny.yaml"]);
    for prompt in ["Hello there, who are you?", "Tell me about the sea."] {
        let (t_local, a_local) = chat(&local, prompt, "ethan");
        let (t_split, a_split) = chat(&gw, prompt, "ethan");
        assert!(!a_local.is_empty(), "{prompt}: no audio");
        assert_eq!(t_split, t_local, "{prompt}: text differs");
        // The same codes decoded in the same order; only where Code2Wav's chunks
        // fall depends on timing (the last chunk takes whatever is pending when
        // the Talker ends), and a chunk's float sums may round differently by
        // its length: the samples agree to a pcm16 step or two, not always bit for bit.
        assert_eq!(
            a_split.len(),
            a_local.len(),
            "{prompt}: audio length differs"
        );
        let worst = max_pcm16_step(&a_split, &a_local);
        assert!(worst <= 2, "{prompt}: audio differs by {worst} pcm16 steps");
    }
    assert_idle(&gw);
    let out = audio.output();
    for stage in ["talker", "code2wav"] {
        assert!(
            out.contains(&format!("omnistream stage {stage} replica 0 ready")),
            "{out}"
        );
    }
}

/// A Qwen3-TTS Base checkpoint whose Talker and Code2Wav run in a stage
/// process: the server clones voices itself (it loads the speaker and codec
/// encoders alone), and a clip speaks as in process — given with the request
/// (x-vector, and in context with its words) or saved once as a voice.
#[test]
fn split_qwen3_tts_base_clones_voices_in_the_server() {
    let _serial = omnistream_e2e::exclusive();
    let split = "deploy/distributed/qwen3-tts-base-tiny.yaml";
    let nats = Nats::start();
    let audio = spawn_stage(split, "talker,code2wav", &nats.url, &[]);
    let (store_split, store_local) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let gw = spawn_server(&[
        "--profile",
        split,
        "--nats",
        &nats.url,
        "--voice-store",
        store_split.path().to_str().unwrap(),
    ]);
    let local = spawn_server(&[
        "--profile",
        "deploy/qwen3-tts-base-tiny.yaml",
        "--voice-store",
        store_local.path().to_str().unwrap(),
    ]);
    let dir = tempfile::tempdir().unwrap();
    let clip = dir.path().join("clip.wav");
    let words = "This is how I sound when I speak, slowly and clearly, to my friends.";
    omnistream_e2e::own_voice(words, &clip);
    let clip_b64 = base64::engine::general_purpose::STANDARD.encode(std::fs::read(&clip).unwrap());
    let same = |what: &str, a: &[u8], b: &[u8]| {
        assert!(!a.is_empty(), "{what}: no audio");
        assert_eq!(a.len(), b.len(), "{what}: audio length differs");
        // The same codes; only where Code2Wav's chunks fall depends on timing.
        let worst = max_pcm16_step(a, b);
        assert!(worst <= 2, "{what}: audio differs by {worst} pcm16 steps");
    };
    let text = "Hello there, how are you today?";
    for ref_text in [None, Some(words)] {
        let mut body = serde_json::json!({"model": "qwen3-tts", "input": text, "ref_audio": clip_b64, "max_tokens": 50});
        if let Some(t) = ref_text {
            body["ref_text"] = t.into();
        }
        let a_split = speak_with(&gw.url, body.clone()).expect("split");
        let a_local = speak_with(&local.url, body).expect("local");
        same(&format!("ref_text {ref_text:?}"), &a_split, &a_local);
    }
    // A voice saved once (in context), spoken by its id.
    let make_voice = |server: &Server| -> String {
        let out = std::process::Command::new("curl")
            .args([
                "-sS",
                "--max-time",
                "300",
                "-F",
                "name=mine",
                "-F",
                "consent=cons_test",
            ])
            .arg("-F")
            .arg(format!("ref_text={words}"))
            .arg("-F")
            .arg(format!("audio_sample=@{};type=audio/wav", clip.display()))
            .arg(format!("{}/v1/audio/voices", server.url))
            .output()
            .expect("curl");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stdout)));
        v["id"]
            .as_str()
            .unwrap_or_else(|| panic!("{v}"))
            .to_string()
    };
    let (v_split, v_local) = (make_voice(&gw), make_voice(&local));
    let a_split = speak_with(
        &gw.url,
        serde_json::json!({"model": "qwen3-tts", "input": text, "voice": v_split, "max_tokens": 50}),
    )
    .expect("split");
    let a_local = speak_with(
        &local.url,
        serde_json::json!({"model": "qwen3-tts", "input": text, "voice": v_local, "max_tokens": 50}),
    )
    .expect("local");
    same("a saved voice", &a_split, &a_local);
    assert_idle(&gw);
    // The server loaded the encoders, not the Talker: the stage did the work.
    let done = eventually(5, || {
        let f = replica_counts(&gw, "talker", "finished_total");
        f.len() == 1 && f[0].1 >= 3.0
    });
    assert!(done, "{}\n{}", gw.metrics(), audio.output());
}

/// Eight concurrent answers over two Talker and two Code2Wav processes: both
/// replicas of each stage work, and every answer is its own text, heard.
#[test]
fn two_replicas_share_concurrent_requests_without_cross_talk() {
    let _serial = omnistream_e2e::exclusive();
    let nats = Nats::start();
    let _stages: Vec<Server> = ["talker", "talker", "code2wav", "code2wav"]
        .iter()
        .map(|s| spawn_stage(SPLIT, s, &nats.url, &[]))
        .collect();
    let gw = Arc::new(spawn_server(&["--profile", SPLIT, "--nats", &nats.url]));
    // Both replicas of each stage must be known before the burst.
    assert!(eventually(10, || replica_counts(&gw, "code2wav", "alive")
        .len()
        == 2
        && replica_counts(&gw, "talker", "alive").len() == 2));
    let texts = omnistream_e2e::ESPEAK[..8].to_vec();
    let answers: Vec<(String, Result<Vec<u8>, String>)> = texts
        .iter()
        .map(|t| {
            let url = gw.url.clone();
            let t = t.to_string();
            thread::spawn(move || {
                let r = speak(&url, &t);
                (t, r)
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().expect("client thread"))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let mut pairs = Vec::new();
    for (i, (text, r)) in answers.iter().enumerate() {
        let pcm = r.as_ref().unwrap_or_else(|e| panic!("{text}: {e}"));
        let wav = dir.path().join(format!("{i}.wav"));
        write_wav(&wav, pcm);
        pairs.push((wav, text.clone()));
    }
    for stage in ["talker", "code2wav"] {
        let both = eventually(5, || {
            let f = replica_counts(&gw, stage, "finished_total");
            f.len() == 2 && f.iter().all(|(_, v)| *v >= 1.0)
        });
        assert!(
            both,
            "{stage} replicas did not both work:\n{}",
            gw.metrics()
        );
    }
    // Each answer is heard as its own sentence: cross-talk (another request's
    // frames in this answer) would add or swap words.
    let (wer, detail) = whisper_wer(&pairs);
    assert!(wer < 0.15, "WER {wer:.3}: {detail}");
    for item in detail["items"].as_array().into_iter().flatten() {
        let w = item["wer"].as_f64().unwrap_or(0.0);
        assert!(w < 0.5, "an answer is not its own text: {item}");
    }
    assert_idle(&gw);
}

/// `tests/python/delay_proxy.py` (run under `prefix`, e.g. `ip netns exec`)
/// with its `args`, once it says it is ready; its output for what it says next.
fn delay_proxy(prefix: &[&str], args: &[&str]) -> (Proc, BufReader<std::process::ChildStdout>) {
    let (cmd, pre) = prefix
        .split_first()
        .map_or(("python3", &[][..]), |(c, rest)| (*c, rest));
    let mut c = std::process::Command::new(cmd);
    c.args(pre);
    if !prefix.is_empty() {
        c.arg("python3");
    }
    let mut p = c
        .arg(omnistream_e2e::root().join("tests/python/delay_proxy.py"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("delay proxy");
    let mut out = BufReader::new(p.stdout.take().expect("piped"));
    let mut line = String::new();
    out.read_line(&mut line).expect("the proxy's first line");
    assert!(line.contains("ready"), "{line}");
    (Proc(p), out)
}

/// Each of `failed` (a client's result and when it ended) is a clear
/// `stage_unavailable`, within 3 s of `since` (`what` happened then).
fn assert_failed_soon(failed: &[&(Result<Vec<u8>, String>, Instant)], since: Instant, what: &str) {
    for (r, at) in failed {
        let e = r.as_ref().unwrap_err();
        assert!(e.contains("stage_unavailable"), "unclear error: {e}");
        let after = at.duration_since(since);
        assert!(
            after <= Duration::from_secs(3),
            "failed {after:?} after the {what}"
        );
    }
}

/// `kill -9` of one Code2Wav replica mid-answers: its requests end with
/// `stage_unavailable` within the bound, the others complete, new requests
/// succeed; a restarted replica takes work again; a NATS restart is survived.
#[test]
fn a_dead_replica_fails_only_its_requests_and_the_system_recovers() {
    let _serial = omnistream_e2e::exclusive();
    let mut nats = Nats::start();
    let _talker = spawn_stage(SPLIT, "talker", &nats.url, &[]);
    let mut a = spawn_stage(SPLIT, "code2wav", &nats.url, &[]);
    let _b = spawn_stage(SPLIT, "code2wav", &nats.url, &[]);
    let a_id = process_id(&a);
    let gw = Arc::new(spawn_server(&["--profile", SPLIT, "--nats", &nats.url]));
    assert!(eventually(10, || replica_counts(&gw, "code2wav", "alive")
        .len()
        == 2));
    let long = "The river runs past the old mill, under the stone bridge, and out \
        across the fields where the farmers plant their wheat in spring and bring \
        it in at the end of summer, when the evenings are long and warm.";
    let clients: Vec<_> = (0..6)
        .map(|_| {
            let url = gw.url.clone();
            thread::spawn(move || {
                let r = speak(&url, long);
                (r, Instant::now())
            })
        })
        .collect();
    // Kill A once it holds requests.
    let on_a = |gw: &Server| {
        replica_counts(gw, "code2wav", "active_requests")
            .iter()
            .any(|(r, v)| r.ends_with(&a_id) && *v > 0.0)
    };
    assert!(eventually(60, || on_a(&gw)), "no request reached replica A");
    a.kill();
    let killed = Instant::now();
    let results: Vec<_> = clients.into_iter().map(|h| h.join().unwrap()).collect();
    let failed: Vec<_> = results.iter().filter(|(r, _)| r.is_err()).collect();
    let ok = results.len() - failed.len();
    assert!(!failed.is_empty(), "no request was on the killed replica");
    assert!(
        ok >= 1,
        "the other replica's requests failed too: {results:?}"
    );
    assert_failed_soon(&failed, killed, "kill");
    // New requests go to the replica that is left.
    speak(&gw.url, "The next request works.").expect("after the kill");
    assert_eq!(replica_counts(&gw, "code2wav", "alive").len(), 1);
    // A restarted replica rejoins and takes work.
    let a2 = spawn_stage(SPLIT, "code2wav", &nats.url, &[]);
    let a2_id = process_id(&a2);
    assert!(eventually(10, || replica_counts(&gw, "code2wav", "alive")
        .len()
        == 2));
    let burst: Vec<_> = (0..4)
        .map(|i| {
            let url = gw.url.clone();
            thread::spawn(move || speak(&url, &format!("Sentence number {i} is short.")))
        })
        .collect();
    for h in burst {
        h.join().unwrap().expect("with the restarted replica");
    }
    // (Counters reach the gateway with the replica's next announcement.)
    let a2_worked = eventually(5, || {
        replica_counts(&gw, "code2wav", "finished_total")
            .iter()
            .any(|(r, v)| r.ends_with(&a2_id) && *v >= 1.0)
    });
    assert!(
        a2_worked,
        "the restarted replica took no work:\n{}",
        gw.metrics()
    );
    // A client that leaves mid-answer: the cancel crosses NATS and the
    // stage processes drop its request (counted there as cancelled), rather
    // than finish an answer nobody reads.
    let cancelled = |gw: &Server| -> f64 {
        ["talker", "code2wav"]
            .iter()
            .flat_map(|s| replica_counts(gw, s, "cancelled_total"))
            .map(|(_, v)| v)
            .sum()
    };
    let before = cancelled(&gw);
    let first = sse_first_bytes(gw.port, &format!("{long} {long} {long}"));
    assert!(first.contains("speech.audio.delta"), "{first}");
    assert!(
        eventually(10, || cancelled(&gw) > before),
        "the cancel did not reach the stage processes:\n{}",
        gw.metrics()
    );
    assert_idle(&gw);
    // NATS itself restarts, with answers in flight: they end (completed, or
    // failed with stage_unavailable), none hangs; everyone reconnects and
    // announces again.
    let clients: Vec<_> = (0..2)
        .map(|_| {
            let url = gw.url.clone();
            thread::spawn(move || speak(&url, long))
        })
        .collect();
    assert!(
        eventually(60, || ["talker", "code2wav"].iter().any(|s| {
            replica_counts(&gw, s, "active_requests")
                .iter()
                .any(|(_, v)| *v > 0.0)
        })),
        "no answer in flight"
    );
    let restarted = Instant::now();
    nats.restart();
    for h in clients {
        if let Err(e) = h.join().unwrap() {
            assert!(e.contains("stage_unavailable"), "unclear error: {e}");
        }
    }
    assert!(
        restarted.elapsed() < Duration::from_secs(30),
        "answers in flight took {:?} to end after the NATS restart",
        restarted.elapsed()
    );
    let back = eventually(30, || {
        replica_counts(&gw, "code2wav", "alive").len() == 2 && speak(&gw.url, "Back again.").is_ok()
    });
    assert!(back, "no recovery after the NATS restart:\n{}", gw.output());
    assert_idle(&gw);
    assert!(metric(&gw, "omnistream_requests_in_flight", &[]) == 0.0);
}

/// A stage process's short network outage (its NATS connection reset, back
/// within a heartbeat, so no announcement is missed): what it held is gone
/// with its connection, so the answers through it fail at once with
/// `stage_unavailable` rather than wait for events that will not come; the
/// stage process drops them too, and the next requests are answered.
#[test]
fn a_stage_process_that_loses_its_connection_briefly_fails_what_it_held() {
    let _serial = omnistream_e2e::exclusive();
    let nats = Nats::start();
    // The Talker reaches NATS through a proxy that can cut its connection.
    let port = omnistream_e2e::free_port();
    let (proxy, mut proxy_out) = delay_proxy(
        &[],
        &[
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--to",
            &format!("127.0.0.1:{}", nats.port),
            "--delay-ms",
            "0",
        ],
    );
    let talker = spawn_stage(SPLIT, "talker", &format!("nats://127.0.0.1:{port}"), &[]);
    let _c2w = spawn_stage(SPLIT, "code2wav", &nats.url, &[]);
    let gw = spawn_server(&["--profile", SPLIT, "--nats", &nats.url]);
    let long = "The river runs past the old mill, under the stone bridge, and out \
        across the fields where the farmers plant their wheat in spring.";
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let url = gw.url.clone();
            thread::spawn(move || (speak(&url, long), Instant::now()))
        })
        .collect();
    assert!(
        eventually(60, || replica_counts(&gw, "talker", "active_requests")
            .iter()
            .any(|(_, v)| *v > 0.0)),
        "no request reached the Talker"
    );
    let cut = Instant::now();
    let sent = std::process::Command::new("kill")
        .args(["-USR1", &proxy.0.id().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let mut line = String::new();
    proxy_out.read_line(&mut line).unwrap();
    assert!(
        line.starts_with("cut ") && !line.starts_with("cut 0"),
        "{line}"
    );
    let results: Vec<_> = clients.into_iter().map(|h| h.join().unwrap()).collect();
    let failed: Vec<_> = results.iter().filter(|(r, _)| r.is_err()).collect();
    assert!(
        !failed.is_empty(),
        "no answer was held by the Talker: {results:?}"
    );
    assert_failed_soon(&failed, cut, "cut");
    // It was an outage, not a death: the Talker reconnected and works on.
    assert!(
        eventually(20, || speak(&gw.url, "The next request works.").is_ok()),
        "no recovery after the cut:\n{}",
        talker.output()
    );
    assert!(
        talker.output().contains("lost the connection to NATS"),
        "{}",
        talker.output()
    );
    assert_idle(&gw);
}

/// Starts a streamed `/v1/audio/speech` of `text` and returns once its first
/// bytes arrived, dropping the connection (a client that leaves).
fn sse_first_bytes(port: u16, text: &str) -> String {
    use std::io::{Read, Write};
    let body = serde_json::json!({
        "model": "tts-1", "input": text, "voice": "joe",
        "response_format": "pcm", "stream_format": "sse",
    })
    .to_string();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    write!(
        s,
        "POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    while !String::from_utf8_lossy(&got).contains("speech.audio.delta") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// Garbage, another wire version and a corrupt body on a stage's subject: each
/// refused with a logged error, a request that names itself fails, the stage
/// keeps serving.
#[test]
fn bad_messages_on_a_stage_subject_are_refused_not_fatal() {
    let _serial = omnistream_e2e::exclusive();
    use futures_util::StreamExt;
    use omnistream_stages::engine::remote::wire;
    let nats = Nats::start();
    let mut c2w = spawn_stage(SPLIT, "code2wav", &nats.url, &[]);
    let _talker = spawn_stage(SPLIT, "talker", &nats.url, &[]);
    let gw = spawn_server(&["--profile", SPLIT, "--nats", &nats.url]);
    let subject = format!("omnistream.tiny-cpu-split.in.{}", process_id(&c2w));
    let owner: u64 = 0x5eed_0000_0000_0001;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let failures = rt.block_on(async {
        let client = async_nats::connect(nats.url.as_str()).await.unwrap();
        let mut events = client
            .subscribe(format!("omnistream.tiny-cpu-split.ev.{owner:016x}"))
            .await
            .unwrap();
        client.flush().await.unwrap();
        // Too short for a header: nobody to tell.
        client
            .publish(subject.clone(), vec![1u8, 2, 3].into())
            .await
            .unwrap();
        // Another version, naming request 77.
        let mut other = wire::encode(77, owner, &wire::OwnerMsg::Text("x".into())).unwrap();
        other[0..2].copy_from_slice(&(wire::WIRE_VERSION + 1).to_le_bytes());
        client.publish(subject.clone(), other.into()).await.unwrap();
        // This version, a body that is no stage message, naming request 78.
        let mut corrupt = wire::encode(78, owner, &0u8).unwrap();
        corrupt.extend_from_slice(&[0xff; 32]);
        client
            .publish(subject.clone(), corrupt.into())
            .await
            .unwrap();
        client.flush().await.unwrap();
        let mut got = Vec::new();
        while got.len() < 2 {
            let m = tokio::time::timeout(Duration::from_secs(10), events.next())
                .await
                .expect("a failure for each named request")
                .expect("subscription");
            let (h, msg): (wire::Header, wire::OwnerMsg) = wire::decode(&m.payload).unwrap();
            got.push((h.request, msg));
        }
        got
    });
    let mut ids: Vec<u64> = failures.iter().map(|(id, _)| *id).collect();
    ids.sort();
    assert_eq!(ids, vec![77, 78]);
    for (_, m) in &failures {
        assert!(
            matches!(m, wire::OwnerMsg::Failed(e) if e.contains("refused")),
            "{m:?}"
        );
    }
    assert!(c2w.alive(), "the stage died");
    // (Its log is read by another thread: give it a moment.)
    let logged = eventually(5, || c2w.output().matches("refused a payload").count() >= 3);
    assert!(logged, "{}", c2w.output());
    // Still serving.
    speak(&gw.url, "Still here.").expect("a request after the bad messages");
    assert_idle(&gw);
}

/// One text turn on `/v1/realtime` at `ws_url`: the answer's text.
async fn realtime_turn(ws_url: &str) -> String {
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    let (mut ws, _) = tokio_tungstenite::connect_async(ws_url)
        .await
        .unwrap_or_else(|e| panic!("connecting to {ws_url}: {e}"));
    let send = |v: serde_json::Value| Message::text(v.to_string());
    ws.send(send(
        serde_json::json!({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Say hello to Anna."}],
        }}),
    ))
    .await
    .expect("send");
    ws.send(send(
        serde_json::json!({"type": "response.create", "response": {}}),
    ))
    .await
    .expect("send");
    let mut text = String::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(120), ws.next())
            .await
            .expect("a realtime event in time")
            .expect("the socket stays open")
            .expect("a message");
        let Message::Text(t) = m else { continue };
        let v: serde_json::Value = serde_json::from_str(&t).expect("JSON event");
        match v["type"].as_str().unwrap_or_default() {
            "error" => panic!("realtime error: {v}"),
            "response.output_text.delta" | "response.output_audio_transcript.delta" => {
                text += v["delta"].as_str().unwrap_or_default()
            }
            "response.done" => {
                assert_eq!(v["response"]["status"], "completed", "{v}");
                return text;
            }
            _ => {}
        }
    }
}

/// Two gateways behind a real HAProxy share one pool of stage processes: the
/// `openai` SDK and a Realtime client through HAProxy both work, and with one
/// gateway killed the other serves every new session.
#[test]
fn gateways_behind_haproxy_share_the_stages() {
    let _serial = omnistream_e2e::exclusive();
    let nats = Nats::start();
    let _talker = spawn_stage(SPLIT, "talker", &nats.url, &[]);
    let _c2w = spawn_stage(SPLIT, "code2wav", &nats.url, &[]);
    let mut gw1 = spawn_server(&["--profile", SPLIT, "--nats", &nats.url]);
    let gw2 = spawn_server(&["--profile", SPLIT, "--nats", &nats.url]);
    let port = omnistream_e2e::free_port();
    let dir = tempfile::tempdir().unwrap();
    // The shipped config, pointed at this test's loopback ports.
    let shipped =
        std::fs::read_to_string(omnistream_e2e::root().join("deploy/distributed/haproxy.cfg"))
            .unwrap();
    let cfg = shipped
        .replace("bind :8080", &format!("bind 127.0.0.1:{port}"))
        .replace("gateway-1:8091", &format!("127.0.0.1:{}", gw1.port))
        .replace("gateway-2:8091", &format!("127.0.0.1:{}", gw2.port))
        .replace("log stdout format raw local0", "");
    let cfg_path = dir.path().join("haproxy.cfg");
    std::fs::write(&cfg_path, cfg).unwrap();
    // (`shipped_deploy_files_are_valid` checks the file with `haproxy -c`.)
    let hp = std::process::Command::new("haproxy")
        .arg("-db")
        .arg("-f")
        .arg(&cfg_path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("starting haproxy");
    let _hp = Proc(hp);
    let lb = format!("http://127.0.0.1:{port}");
    assert!(eventually(20, || {
        omnistream_e2e::http_get(port, "/health").contains("\"ok\"")
    }));
    omnistream_e2e::run_pytest_at(&lb, &gw1, "test_openai_lb.py");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ws = format!("ws://127.0.0.1:{port}/v1/realtime");
    for _ in 0..2 {
        let text = rt.block_on(realtime_turn(&ws));
        assert!(!text.trim().is_empty());
    }
    // WebRTC through the balancer: each call's offer and its hang-up (round
    // robin would send the DELETE to the other gateway, a 404) reach the
    // gateway that owns the call; the media goes straight to it.
    let out = std::process::Command::new("python3")
        .arg(omnistream_e2e::root().join("tests/python/webrtc_peer.py"))
        .args(["--url", &lb, "--cycles", "4", "--delete"])
        .output()
        .expect("python3 webrtc_peer.py");
    let report = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = report
        .lines()
        .rfind(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| {
            panic!(
                "no report: {report}\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    assert_eq!(v["hangups"], serde_json::json!([200, 200, 200, 200]), "{v}");
    // Round robin reached both gateways.
    for gw in [&gw1, &gw2] {
        let served = metric(gw, "omnistream_requests_total", &[]);
        assert!(
            served >= 2.0,
            "a gateway served {served} requests:\n{}",
            gw.metrics()
        );
    }
    gw1.kill();
    for i in 0..3 {
        let text = rt.block_on(realtime_turn(&ws));
        assert!(!text.trim().is_empty(), "session {i} after the kill");
        speak(&lb, "One gateway is enough.").expect("speech after the kill");
    }
    assert_idle(&gw2);
}

/// Test hosts: two network namespaces joined by a veth pair, with addresses of
/// the test's own; removed on drop.
struct Hosts {
    gateway: String,
    stages: String,
    stages_ip: String,
}

impl Hosts {
    fn new() -> Self {
        let id = std::process::id() % 10_000;
        let (a, b) = (format!("osgw{id}"), format!("osst{id}"));
        let (va, vb) = (format!("osva{id}"), format!("osvb{id}"));
        let net = format!("10.231.{}", id % 250);
        let ip = |args: &[&str]| {
            let out = std::process::Command::new("ip")
                .args(args)
                .output()
                .expect("ip (iproute2)");
            assert!(
                out.status.success(),
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let hosts = Self {
            gateway: a.clone(),
            stages: b.clone(),
            stages_ip: format!("{net}.2"),
        };
        ip(&["netns", "add", &a]);
        ip(&["netns", "add", &b]);
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb]);
        ip(&["link", "set", &va, "netns", &a]);
        ip(&["link", "set", &vb, "netns", &b]);
        ip(&["-n", &a, "addr", "add", &format!("{net}.1/24"), "dev", &va]);
        ip(&["-n", &b, "addr", "add", &format!("{net}.2/24"), "dev", &vb]);
        for (ns, dev) in [(&a, &va), (&b, &vb)] {
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        hosts
    }
    fn on(ns: &str) -> Vec<String> {
        vec!["ip".into(), "netns".into(), "exec".into(), ns.into()]
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for ns in [&self.gateway, &self.stages] {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", ns])
                .status();
        }
    }
}

/// A child process killed on drop.
struct Proc(std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `prefix curl` of a streamed speech request: (seconds to the first body
/// byte: the status line waits for the first audio, so this is the TTFP a
/// client sees), the pcm16.
fn timed_speech(prefix: &[String], url: &str, text: &str) -> (f64, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("pcm");
    let body = serde_json::json!({"model": "tts-1", "input": text, "voice": "joe", "response_format": "pcm"});
    let r = std::process::Command::new(&prefix[0])
        .args(&prefix[1..])
        .args(["curl", "-sS", "--max-time", "120", "-o"])
        .arg(&out)
        .args([
            "-w",
            "%{http_code} %{time_starttransfer}",
            "-H",
            "Content-Type: application/json",
            "-d",
        ])
        .arg(body.to_string())
        .arg(format!("{url}/v1/audio/speech"))
        .output()
        .expect("curl");
    let w = String::from_utf8_lossy(&r.stdout).to_string();
    let mut it = w.split_whitespace();
    assert_eq!(
        it.next(),
        Some("200"),
        "{w} {}",
        String::from_utf8_lossy(&r.stderr)
    );
    let t: f64 = it.next().and_then(|t| t.parse().ok()).expect("time");
    (t, std::fs::read(&out).unwrap())
}

/// The gateway on one host, NATS and the stages on another, the link between
/// them delayed 20 ms each way: answers are the same as over a direct link,
/// and the first-audio cost of the delay is reported.
#[test]
fn stages_on_another_host_over_a_delayed_link() {
    let _serial = omnistream_e2e::exclusive();
    let hosts = Hosts::new();
    let on_gw = Hosts::on(&hosts.gateway);
    let on_st = Hosts::on(&hosts.stages);
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("nats.conf");
    std::fs::write(
        &conf,
        format!("listen: {}:4222\nmax_payload: 64MB\n", hosts.stages_ip),
    )
    .unwrap();
    let _nats = Proc(
        std::process::Command::new(&on_st[0])
            .args(&on_st[1..])
            .arg("nats-server")
            .arg("-c")
            .arg(&conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("nats-server"),
    );
    let nats_url = format!("nats://{}:4222", hosts.stages_ip);
    let st: Vec<&str> = on_st.iter().map(String::as_str).collect();
    let _talker = spawn_stage_in_retry(&st, "talker", &nats_url);
    let _c2w = spawn_stage_in_retry(&st, "code2wav", &nats_url);
    // On the gateway's host: a proxy per link (20 ms each way, and none).
    let mut proxies = Vec::new();
    let carried = |port: u16| dir.path().join(format!("carried-{port}"));
    for (port, delay) in [(14222, "20"), (14223, "0")] {
        let prefix: Vec<&str> = on_gw.iter().map(String::as_str).collect();
        let stats = carried(port);
        let (p, _) = delay_proxy(
            &prefix,
            &[
                "--listen",
                &format!("127.0.0.1:{port}"),
                "--to",
                &format!("{}:4222", hosts.stages_ip),
                "--delay-ms",
                delay,
                "--stats",
                &stats.to_string_lossy(),
            ],
        );
        proxies.push(p);
    }
    let gw: Vec<&str> = on_gw.iter().map(String::as_str).collect();
    let far = omnistream_e2e::spawn_server_in(
        &gw,
        &["--profile", SPLIT, "--nats", "nats://127.0.0.1:14222"],
    );
    let near = omnistream_e2e::spawn_server_in(
        &gw,
        &["--profile", SPLIT, "--nats", "nats://127.0.0.1:14223"],
    );
    let (mut t_far, mut t_near) = (Vec::new(), Vec::new());
    for i in 0..8 {
        let text = format!("Request number {i} crosses the link between the hosts.");
        let (a, pcm_near) = timed_speech(&on_gw, &near.url, &text);
        let (b, pcm_far) = timed_speech(&on_gw, &far.url, &text);
        assert!(pcm_near.len() > 24_000, "no audio");
        assert!(
            pcm_near == pcm_far,
            "{text}: the answer differs over the delayed link"
        );
        if i > 0 {
            // The first of each is a warm-up.
            t_near.push(a);
            t_far.push(b);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (n, f) = (median(&mut t_near), median(&mut t_far));
    eprintln!(
        "first audio through the gateway: direct link {:.0} ms, 20 ms link {:.0} ms: the delay costs {:.0} ms",
        n * 1e3,
        f * 1e3,
        (f - n) * 1e3
    );
    // Gateway -> Talker -> Code2Wav -> gateway crosses the link once each way
    // through NATS: 40 ms more in theory. The cost is reported, not judged
    // (medians of 7 on two busy cores wander by tens of ms; one CI run saw
    // 648 against 649 ms): what is asserted is that each gateway's traffic,
    // the answers' audio among it, went through its own link, and that the
    // delay cost no more than a bound.
    let read = |port: u16| -> u64 {
        std::fs::read_to_string(carried(port))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    };
    std::thread::sleep(Duration::from_millis(300));
    let audio_bytes = 7 * 24_000;
    for port in [14222, 14223] {
        let b = read(port);
        assert!(b > audio_bytes, "the link on {port} carried {b} bytes");
    }
    assert!(f - n < 1.0, "the delay cost too much: {n} vs {f}");
}

/// A stage process on another host (NATS may still be starting there).
fn spawn_stage_in_retry(prefix: &[&str], stage: &str, nats: &str) -> Server {
    omnistream_e2e::spawn_stage_in(prefix, SPLIT, stage, nats, &[])
}

/// The shipped deployment files are what the tools accept, and name only
/// stages the profile has.
#[test]
fn shipped_deploy_files_are_valid() {
    let _serial = omnistream_e2e::exclusive();
    let dir = omnistream_e2e::root().join("deploy/distributed");
    let run = |cmd: &str, args: &[&str]| {
        let out = std::process::Command::new(cmd)
            .args(args)
            .current_dir(&dir)
            .output()
            .unwrap_or_else(|e| panic!("{cmd}: {e}"));
        assert!(
            out.status.success(),
            "{cmd} {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    };
    run("nats-server", &["-t", "-c", "nats.conf"]);
    // haproxy -c resolves server names: point them at loopback to check.
    let cfg = std::fs::read_to_string(dir.join("haproxy.cfg"))
        .unwrap()
        .replace("gateway-1:", "127.0.0.1:")
        .replace("gateway-2:", "127.0.0.1:");
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("haproxy.cfg");
    std::fs::write(&path, cfg).unwrap();
    run("haproxy", &["-c", "-f", path.to_str().unwrap()]);
    // compose and Kubernetes: YAML, and every `stage --stage NAME` names a
    // remote stage of the profile they run.
    let script = r#"
import sys, yaml
profile = yaml.safe_load(open("tiny-cpu.yaml"))
remote = {s["name"] for s in profile["stages"] if s.get("placement") == "remote"}
docs = [yaml.safe_load(open("compose.yaml"))] + list(yaml.safe_load_all(open("k8s/omnistream.yaml")))
found = set()
def walk(x):
    if isinstance(x, dict):
        for v in x.values(): walk(v)
    elif isinstance(x, list):
        if x and x[0] == "stage":
            name = x[x.index("--stage") + 1]
            assert name in remote, f"{name} is not a remote stage of tiny-cpu.yaml"
            found.add(name)
        for v in x: walk(v)
for d in docs: walk(d)
assert found == remote, (found, remote)
kinds = [d["kind"] for d in docs[1:]]
assert kinds.count("Deployment") == 4 and "Ingress" in kinds and "Service" in kinds, kinds
"#;
    run("python3", &["-c", script]);
}
