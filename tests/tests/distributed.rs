//! Stages beyond one process: the real binary's `omnistream stage` processes
//! and `omnistream serve --nats` gateways, joined through a real `nats-server`
//! (Debian's) on loopback, started and stopped here.

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

/// `/v1/audio/speech` as SSE: Ok(pcm16 bytes), or Err(the body) on an error event.
fn speak(url: &str, text: &str) -> Result<Vec<u8>, String> {
    let body = serde_json::json!({
        "model": "tts-1", "input": text, "voice": "joe",
        "response_format": "pcm", "stream_format": "sse",
    });
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
        let f = replica_counts(&gw, stage, "finished_total");
        assert!(f.len() == 1 && f[0].1 >= 3.0, "{stage}: {f:?}");
    }
    assert_idle(&gw);
}

#[test]
fn split_qwen3_omni_tiny_carries_thinker_states_exactly() {
    let split = "deploy/distributed/qwen3-omni-tiny.yaml";
    let nats = Nats::start();
    let _talker = spawn_stage(split, "talker", &nats.url, &[]);
    let _c2w = spawn_stage(split, "code2wav", &nats.url, &[]);
    let gw = spawn_server(&["--profile", split, "--nats", &nats.url]);
    let local = spawn_server(&["--profile", "deploy/qwen3-omni-tiny.yaml"]);
    for prompt in ["Hello there, who are you?", "Tell me about the sea."] {
        let (t_local, a_local) = chat(&local, prompt, "ethan");
        let (t_split, a_split) = chat(&gw, prompt, "ethan");
        assert!(!a_local.is_empty(), "{prompt}: no audio");
        assert_eq!(t_split, t_local, "{prompt}: text differs");
        assert!(a_split == a_local, "{prompt}: audio differs");
    }
    assert_idle(&gw);
}

/// Eight concurrent answers over two Talker and two Code2Wav processes: both
/// replicas of each stage work, and every answer is its own text, heard.
#[test]
fn two_replicas_share_concurrent_requests_without_cross_talk() {
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
        let f = replica_counts(&gw, stage, "finished_total");
        assert!(
            f.len() == 2 && f.iter().all(|(_, v)| *v >= 1.0),
            "{stage} replicas did not both work: {f:?}"
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

/// `kill -9` of one Code2Wav replica mid-answers: its requests end with
/// `stage_unavailable` within the bound, the others complete, new requests
/// succeed; a restarted replica takes work again; a NATS restart is survived.
#[test]
fn a_dead_replica_fails_only_its_requests_and_the_system_recovers() {
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
    for (r, at) in &failed {
        let e = r.as_ref().unwrap_err();
        assert!(e.contains("stage_unavailable"), "unclear error: {e}");
        let after = at.duration_since(killed);
        assert!(
            after <= Duration::from_secs(3),
            "failed {after:?} after the kill"
        );
    }
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
    let a2_done: f64 = replica_counts(&gw, "code2wav", "finished_total")
        .iter()
        .filter(|(r, _)| r.ends_with(&a2_id))
        .map(|(_, v)| v)
        .sum();
    assert!(a2_done >= 1.0, "the restarted replica took no work");
    // NATS itself restarts: everyone reconnects and announces again.
    nats.restart();
    let back = eventually(30, || {
        replica_counts(&gw, "code2wav", "alive").len() == 2 && speak(&gw.url, "Back again.").is_ok()
    });
    assert!(back, "no recovery after the NATS restart:\n{}", gw.output());
    assert_idle(&gw);
    assert!(metric(&gw, "omnistream_requests_in_flight", &[]) == 0.0);
}

/// Garbage, another wire version and a corrupt body on a stage's subject: each
/// refused with a logged error, a request that names itself fails, the stage
/// keeps serving.
#[test]
fn bad_messages_on_a_stage_subject_are_refused_not_fatal() {
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
    let log = c2w.output();
    assert!(log.matches("refused a payload").count() >= 3, "{log}");
    // Still serving.
    speak(&gw.url, "Still here.").expect("a request after the bad messages");
    assert_idle(&gw);
}
