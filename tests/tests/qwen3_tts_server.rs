//! `omnistream serve` with Qwen3-TTS's stages (deploy/qwen3-tts-tiny.yaml: the
//! tiny reference checkpoint), driven by the official OpenAI Python SDK
//! (tests/python/test_qwen3_tts.py): `/v1/audio/speech` in a preset voice, with
//! instructions and a language, whole, streamed and as SSE, equal to the
//! reference's audio; and bad requests, each a 400 naming its parameter. And
//! Qwen3-TTS as the voice of a cascade.

use omnistream_e2e::{run_pytest, spawn_server};

#[test]
fn qwen3_tts_served_through_the_openai_sdk() {
    let mut server = spawn_server(&["--profile", "deploy/qwen3-tts-tiny.yaml"]);
    let report = run_pytest(&server, "test_qwen3_tts.py");
    assert!(report.contains("11 passed"), "{report}");
    let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(server.alive(), "the server died:\n{log}");
}

/// Qwen3-TTS as the voice of a cascade (deploy/smollm2-qwen3-tts-tiny.yaml):
/// SmolLM2's answer spoken as it is written, on chat completions (whole and
/// streamed) and Realtime (tests/python/test_qwen3_tts_cascade.py).
#[test]
fn qwen3_tts_speaks_a_cascade() {
    let mut server = spawn_server(&["--profile", "deploy/smollm2-qwen3-tts-tiny.yaml"]);
    let report = run_pytest(&server, "test_qwen3_tts_cascade.py");
    assert!(report.contains("4 passed"), "{report}");
    let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(server.alive(), "the server died:\n{log}");
}
