//! The `omnistream` CLI end to end: real binary, real models.

use std::path::PathBuf;

use omnistream_codecs::wav::read_wav;
use omnistream_e2e::{omnistream, root, whisper_wer};

const SENTENCES: &[&str] = &[
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back tomorrow morning.",
    "The weather today is sunny and warm.",
    "I would like a cup of coffee with milk.",
    "Our train leaves from platform number seven.",
];

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn say_is_intelligible_to_whisper() {
    let dir = tempfile::tempdir().unwrap();
    let mut pairs = Vec::new();
    for (i, s) in SENTENCES.iter().enumerate() {
        let wav = dir.path().join(format!("s{i}.wav"));
        let o = omnistream(["say", s, "-o", wav.to_str().unwrap()]);
        assert!(o.status.success(), "say failed: {}", stderr(&o));
        let (pcm, rate) = read_wav(&wav).unwrap();
        assert_eq!(rate, 22050);
        assert!(
            pcm.len() > rate as usize,
            "{s:?}: only {} samples",
            pcm.len()
        );
        pairs.push((wav, s.to_string()));
    }
    let (wer, detail) = whisper_wer(&pairs);
    assert!(wer <= 0.10, "WER {wer:.3} > 10%: {detail}");
}

#[test]
fn chat_streams_text_and_reports_latency() {
    let dir = tempfile::tempdir().unwrap();
    let wav = dir.path().join("a.wav");
    let o = omnistream([
        "chat",
        "What is the capital of France?",
        "--max-tokens",
        "40",
        "-o",
        wav.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "chat failed: {}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("Paris"), "answer: {text}");
    let err = stderr(&o);
    for k in ["TTFT", "TTFP", "RTF", "audio"] {
        assert!(err.contains(k), "no {k} in: {err}");
    }
    let (pcm, _) = read_wav(&wav).unwrap();
    assert!(pcm.len() > 22050, "{} samples", pcm.len());
    // The spoken answer says what the text says: the key word is heard.
    let (_, detail) = whisper_wer(&[(wav.clone(), text.trim().to_string())]);
    let heard = detail["items"][0]["hyp"]
        .as_str()
        .unwrap_or("")
        .to_lowercase();
    assert!(heard.contains("paris"), "heard {heard:?} for {text:?}");
}

#[test]
fn bad_input_fails_clearly_without_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.wav");
    let out = out.to_str().unwrap();

    let o = omnistream(["say", "", "-o", out]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("empty"), "{}", stderr(&o));

    let long = "word ".repeat(2000);
    let o = omnistream(["say", &long, "-o", out]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("limit"), "{}", stderr(&o));

    for odd in ["?!...", "🙂🙂🙂"] {
        let o = omnistream(["say", odd, "-o", out]);
        assert!(o.status.success(), "{odd:?}: {}", stderr(&o));
    }

    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let bad = std::ffi::OsStr::from_bytes(b"caf\xe9");
        let o = omnistream([std::ffi::OsStr::new("say"), bad]);
        assert!(!o.status.success());
        assert!(
            stderr(&o).to_lowercase().contains("utf-8"),
            "{}",
            stderr(&o)
        );
    }

    // Broken and unknown-key profiles name the file and the key.
    let good = std::fs::read_to_string(root().join("deploy/tiny-cpu.yaml")).unwrap();
    let cases = [
        (
            good.replace("max_num_seqs: 16", "max_num_seqs: 16\n    turbo: true"),
            "turbo",
        ),
        (
            good.replace("max_num_seqs: 16", "max_num_seqs: 0"),
            "max_num_seqs",
        ),
        ("stages: [".to_string(), "tiny-broken.yaml"),
    ];
    for (text, key) in cases {
        // Next to the real profile, so its relative model paths resolve.
        let p: PathBuf = root().join("deploy/tiny-broken.yaml");
        std::fs::write(&p, &text).unwrap();
        let o = omnistream(["say", "hello", "-o", out, "--profile", p.to_str().unwrap()]);
        std::fs::remove_file(&p).ok();
        assert!(!o.status.success());
        let e = stderr(&o);
        assert!(e.contains("tiny-broken.yaml") && e.contains(key), "{e}");
        assert!(!e.contains("panicked"), "{e}");
    }
    let o = omnistream(["say", "hello", "--profile", "/nonexistent.yaml"]);
    assert!(!o.status.success() && stderr(&o).contains("/nonexistent.yaml"));
}
