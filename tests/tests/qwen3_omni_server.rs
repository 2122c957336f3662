//! `omnistream serve` with Qwen3-Omni's stages (deploy/qwen3-omni-tiny.yaml: the
//! tiny reference checkpoint), driven by the official OpenAI Python SDK
//! (tests/python/test_qwen3_omni.py): typed and spoken questions answered with
//! the reference's exact words and audio, streamed and whole, and bad requests.

use omnistream_e2e::{run_pytest, spawn_server};

#[test]
fn qwen3_omni_served_through_the_openai_sdk() {
    let mut server = spawn_server(&["--profile", "deploy/qwen3-omni-tiny.yaml"]);
    let report = run_pytest(&server, "test_qwen3_omni.py");
    assert!(report.contains("6 passed"), "{report}");
    let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(server.alive(), "the server died:\n{log}");
}
