//! The demo page in real browsers: headless Debian Chromium (over CDP) and
//! Firefox ESR (over WebDriver BiDi), both driven by puppeteer-core
//! (`tests/web/page_test.mjs`) against `omnistream serve`.
//! Needs what `scripts/setup.sh --dev` installs: chromium, firefox-esr, node
//! and `tests/web/node_modules`.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use omnistream_e2e::{http_get, root, spawn_server};
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
    let web = root().join("tests/web");
    let mut child = Command::new("node")
        .arg(web.join("page_test.mjs"))
        .arg(url)
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
                panic!("page_test.mjs ran past {limit:?}");
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
        .unwrap_or_else(|| {
            panic!("no JSON from page_test.mjs\nstdout:\n{stdout}\nstderr:\n{stderr}")
        });
    let v: Value = serde_json::from_str(line).expect("page_test.mjs JSON");
    assert!(
        out.status.success() && v.get("error").is_none(),
        "page test failed: {}\nstderr:\n{stderr}",
        serde_json::to_string_pretty(&v).unwrap_or_default()
    );
    v
}

#[test]
fn page_calls_over_webrtc_in_chromium() {
    page_streams_text_and_audio(CHROMIUM, "webrtc");
}

#[test]
fn page_calls_over_webrtc_in_firefox() {
    page_streams_text_and_audio(FIREFOX, "webrtc");
}

#[test]
fn page_streams_over_the_websocket_in_chromium() {
    page_streams_text_and_audio(CHROMIUM, "websocket");
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
