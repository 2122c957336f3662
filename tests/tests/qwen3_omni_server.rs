//! `omnistream serve` with Qwen3-Omni's stages (deploy/qwen3-omni-tiny.yaml: the
//! tiny reference checkpoint), driven by the official OpenAI Python SDK
//! (tests/python/test_qwen3_omni.py): typed and spoken questions answered with
//! the reference's exact words and audio, streamed and whole, and bad requests.

use std::process::Command;

use omnistream_e2e::{root, spawn_server};

#[test]
fn qwen3_omni_served_through_the_openai_sdk() {
    let mut server = spawn_server(&["--profile", "deploy/qwen3-omni-tiny.yaml"]);
    let out = Command::new("python3")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(root().join("tests/python/test_qwen3_omni.py"))
        .env("OMNISTREAM_URL", &server.url)
        .current_dir(root())
        .output()
        .expect("running pytest");
    let report = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
    assert!(
        out.status.success(),
        "pytest failed:\n{report}\nserver log:\n{log}"
    );
    assert!(report.contains("6 passed"), "{report}");
    assert!(server.alive(), "the server died:\n{log}");
}
