//! `omnistream serve` with Qwen3-TTS's stages (deploy/qwen3-tts-tiny.yaml: the
//! tiny reference checkpoint), driven by the official OpenAI Python SDK
//! (tests/python/test_qwen3_tts.py): `/v1/audio/speech` in a preset voice, with
//! instructions and a language, whole, streamed and as SSE, equal to the
//! reference's audio; voices cloned from a clip, kept per API key and across a
//! restart; bad requests, each a 400 naming its parameter; and text streamed in
//! over `WS /v1/audio/speech/stream` (tests/python/test_speech_stream.py). And
//! Qwen3-TTS as the voice of a cascade.

use omnistream_e2e::{curl, run_pytest, spawn_server};

#[test]
fn qwen3_tts_served_through_the_openai_sdk() {
    let store = tempfile::tempdir().unwrap();
    let dir = store.path().to_str().unwrap();
    let args = [
        "--profile",
        "deploy/qwen3-tts-tiny.yaml",
        "--api-key",
        "key-alice",
        "--api-key",
        "key-bob",
        "--voice-store",
        dir,
    ];
    let mut server = spawn_server(&args);
    let report = run_pytest(&server, "test_qwen3_tts.py");
    assert!(report.contains("22 passed"), "{report}");
    let report = run_pytest(&server, "test_speech_stream.py");
    assert!(report.contains("4 passed"), "{report}");
    let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(server.alive(), "the server died:\n{log}");
    server.kill();
    // The voice the test left behind is there after a restart, for its key only.
    let server = spawn_server(&args);
    let list = |key: &str| {
        let auth = format!("Authorization: Bearer {key}");
        curl(&format!("{}/v1/audio/voices", server.url), None, &[&auth]).json()
    };
    let alice = list("key-alice");
    let names: Vec<&str> = alice["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, ["kept"], "{alice}");
    assert_eq!(list("key-bob")["data"], serde_json::json!([]));
}

/// A VoiceDesign checkpoint (deploy/qwen3-tts-design-tiny.yaml): the voice
/// `instructions` describe, equal to the reference's
/// (tests/python/test_qwen3_tts_design.py).
#[test]
fn qwen3_tts_voice_design_through_the_openai_sdk() {
    let mut server = spawn_server(&["--profile", "deploy/qwen3-tts-design-tiny.yaml"]);
    let report = run_pytest(&server, "test_qwen3_tts_design.py");
    assert!(report.contains("3 passed"), "{report}");
    let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(server.alive(), "the server died:\n{log}");
}

/// A Base checkpoint as released, with no preset speaker
/// (deploy/qwen3-tts-base-tiny.yaml): it starts, speaks cloned voices only,
/// encodes clips uploaded at once in shared batches, each as alone, and
/// refuses a request with none (tests/python/test_qwen3_tts_base.py).
#[test]
fn qwen3_tts_base_speaks_only_cloned_voices() {
    let store = tempfile::tempdir().unwrap();
    let dir = store.path().to_str().unwrap();
    let args = [
        "--profile",
        "deploy/qwen3-tts-base-tiny.yaml",
        "--voice-store",
        dir,
    ];
    let mut server = spawn_server(&args);
    let report = run_pytest(&server, "test_qwen3_tts_base.py");
    assert!(report.contains("3 passed"), "{report}");
    let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(server.alive(), "the server died:\n{log}");
    // A failed batch is encoded again clip by clip, which would hide it.
    assert!(
        !log.contains("encoding each alone"),
        "a batch failed:\n{log}"
    );
}

/// Qwen3-TTS as the voice of a cascade (deploy/smollm2-qwen3-tts-tiny.yaml):
/// SmolLM2's answer spoken as it is written, on chat completions (whole and
/// streamed) and Realtime, in preset and cloned voices
/// (tests/python/test_qwen3_tts_cascade.py).
#[test]
fn qwen3_tts_speaks_a_cascade() {
    let store = tempfile::tempdir().unwrap();
    let dir = store.path().to_str().unwrap();
    let args = [
        "--profile",
        "deploy/smollm2-qwen3-tts-tiny.yaml",
        "--voice-store",
        dir,
    ];
    let mut server = spawn_server(&args);
    let report = run_pytest(&server, "test_qwen3_tts_cascade.py");
    assert!(report.contains("7 passed"), "{report}");
    let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(server.alive(), "the server died:\n{log}");
}
