//! Helpers for the end-to-end tests in `tests/tests/`: the real `omnistream`
//! binary, the real models, real clients.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Once;

/// The repository root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// The `omnistream` binary of this checkout, built (dev profile) on first use.
pub fn binary() -> PathBuf {
    static BUILD: Once = Once::new();
    BUILD.call_once(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args(["build", "--quiet", "-p", "omnistream"])
            .current_dir(root())
            .status()
            .expect("running cargo build");
        assert!(status.success(), "cargo build -p omnistream failed");
    });
    let target = std::env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| root().join("target"));
    target.join("debug/omnistream")
}

/// Runs `omnistream ARGS` in the repository root.
pub fn omnistream<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    Command::new(binary())
        .args(args)
        .current_dir(root())
        .output()
        .expect("running omnistream")
}

/// Word error rate of Whisper tiny.en (faster-whisper over the shipped
/// CTranslate2 model) on `(wav, reference text)` pairs; returns the aggregate
/// and the per-item JSON.
pub fn whisper_wer(pairs: &[(PathBuf, String)]) -> (f64, serde_json::Value) {
    let dir = tempfile::tempdir().expect("tempdir");
    let list: Vec<serde_json::Value> = pairs
        .iter()
        .map(|(w, r)| serde_json::json!({"wav": w, "ref": r}))
        .collect();
    let pairs_file = dir.path().join("pairs.json");
    std::fs::write(&pairs_file, serde_json::to_vec(&list).expect("json")).expect("write pairs");
    let out = Command::new("python3")
        .arg(root().join("tests/python/wer.py"))
        .arg("--model")
        .arg(root().join("models/whisper-tiny-en"))
        .arg("--pairs")
        .arg(&pairs_file)
        .output()
        .expect("running tests/python/wer.py");
    assert!(
        out.status.success(),
        "wer.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("wer.py JSON");
    (v["wer"].as_f64().expect("wer field"), v)
}
