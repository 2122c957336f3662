//! `omnistream bench` end to end: the real binary drives a real server (or
//! starts one per profile for `--compare`) and writes its reports. The metric
//! arithmetic itself is unit-tested in `server/src/bench/metrics.rs`.

use std::path::Path;

use omnistream_e2e::{omnistream, spawn_server};
use serde_json::Value;

fn report(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join("bench.json")).expect("bench.json");
    serde_json::from_str(&text).expect("bench.json parses")
}

fn text(o: &std::process::Output) -> String {
    format!(
        "stdout:\n{}\nstderr:\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

#[test]
fn sweep_against_a_running_server() {
    let server = spawn_server(&[]);
    let ok_before = server
        .metric("omnistream_requests_total{endpoint=\"chat_completions\",outcome=\"ok\"}")
        .unwrap_or(0.0);
    let dir = tempfile::tempdir().unwrap();
    let o = omnistream([
        "bench",
        "--url",
        &server.url,
        "--concurrency",
        "1,2",
        "--num-prompts",
        "3",
        "--warmup",
        "1",
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(dir.path());
    assert_eq!(r["schema"], "omnistream.bench.v1");
    assert_eq!(r["request"]["ignore_eos"], true);
    let levels = r["runs"][0]["levels"].as_array().expect("levels");
    assert_eq!(levels.len(), 2);
    for (l, c) in levels.iter().zip([1, 2]) {
        assert_eq!(
            l["load"],
            serde_json::json!({"mode": "closed", "concurrency": c})
        );
        assert_eq!(
            (l["completed"].as_u64(), l["failed"].as_u64()),
            (Some(3), Some(0)),
            "{l}"
        );
        // ignore_eos + max_tokens: every answer is exactly 8 tokens long.
        assert_eq!(f(&l["output_tokens"]["mean"]), 8.0, "{l}");
        assert_eq!(f(&l["output_tokens"]["p99"]), 8.0, "{l}");
        let (ttft, ttfp, e2el) = (
            f(&l["ttft_ms"]["median"]),
            f(&l["ttfp_ms"]["median"]),
            f(&l["e2el_ms"]["median"]),
        );
        assert!(ttft > 0.0 && ttfp > 0.0 && e2el >= ttfp, "{l}");
        assert!(f(&l["tpot_ms"]["median"]) > 0.0, "{l}");
        assert!(f(&l["audio_rtf"]["median"]) > 0.0, "{l}");
        assert!(f(&l["audio_seconds"]["mean"]) > 0.5, "{l}");
        // The server's memory, as /metrics reports it.
        let peak = f(&l["server_peak_rss_mib"]);
        assert!(peak > 100.0 && peak >= f(&l["server_rss_mib"]), "{l}");
        // Throughputs follow from the level's own totals.
        let wall = f(&l["wall_s"]);
        assert!((f(&l["req_s"]) - 3.0 / wall).abs() < 1e-9, "{l}");
        assert!((f(&l["output_tok_s"]) - 24.0 / wall).abs() < 1e-9, "{l}");
        let stages: Vec<&str> = l["stages"]
            .as_array()
            .expect("stages")
            .iter()
            .filter_map(|s| s["stage"].as_str())
            .collect();
        for name in ["thinker", "talker", "code2wav"] {
            assert!(stages.contains(&name), "{name} missing in {stages:?}");
        }
        for s in l["stages"].as_array().unwrap() {
            let busy = f(&s["busy_fraction"]);
            assert!((0.0..=1.05).contains(&busy), "{s}");
            // The stages a spoken chat answer goes through worked; the
            // Listener (speech in) has nothing to do in a chat sweep.
            if s["stage"] != "listener" {
                assert!(busy > 0.0, "{s}");
                assert!(s["steps"].as_u64().is_some_and(|n| n > 0), "{s}");
            }
        }
    }
    // The server saw exactly the warm-up and the measured requests.
    let ok_after = server
        .metric("omnistream_requests_total{endpoint=\"chat_completions\",outcome=\"ok\"}")
        .unwrap_or(0.0);
    assert_eq!(ok_after - ok_before, 7.0);
    let md = std::fs::read_to_string(dir.path().join("bench.md")).unwrap();
    assert!(md.contains("| c=2 | 3 | 0 |"), "{md}");
    assert!(md.contains("| c=1 | thinker |"), "{md}");
    for png in ["ttfp.png", "rtf.png", "throughput.png"] {
        let bytes = std::fs::read(dir.path().join(png)).expect(png);
        assert!(bytes.starts_with(b"\x89PNG") && bytes.len() > 5000, "{png}");
    }

    // Plots redrawn from the report alone.
    let replot = tempfile::tempdir().unwrap();
    let o = omnistream([
        "bench",
        "--overlay",
        dir.path().join("bench.json").to_str().unwrap(),
        "--plot-only",
        "--out",
        replot.path().to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(replot.path().join("ttfp.png").exists());

    // Open loop over the speech endpoint, the earlier report overlaid.
    let dir2 = tempfile::tempdir().unwrap();
    let o = omnistream([
        "bench",
        "--url",
        &server.url,
        "--endpoint",
        "speech",
        "--request-rate",
        "4,inf",
        "--num-prompts",
        "2",
        "--warmup",
        "0",
        "--input-len",
        "6",
        "--out",
        dir2.path().to_str().unwrap(),
        "--overlay",
        dir.path().join("bench.json").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(dir2.path());
    let levels = r["runs"][0]["levels"].as_array().expect("levels");
    assert_eq!(levels[0]["load"]["rate"], 4.0);
    assert_eq!(levels[1]["load"]["rate"], Value::Null);
    for l in levels {
        assert_eq!(l["completed"], 2, "{l}");
        assert_eq!(l["ttft_ms"]["n"], 0, "speech has no text: {l}");
        assert!(f(&l["ttfp_ms"]["median"]) > 0.0, "{l}");
    }
}

/// One run over two servers (whole pipelines replicated, no load balancer):
/// requests are shared between them, each gets the warm-up, and the report
/// keeps each server's stages apart and sums their memory.
#[test]
fn one_run_over_several_servers() {
    let a = spawn_server(&[]);
    let b = spawn_server(&[]);
    let ok = |s: &omnistream_e2e::Server| {
        s.metric("omnistream_requests_total{endpoint=\"chat_completions\",outcome=\"ok\"}")
            .unwrap_or(0.0)
    };
    let before = (ok(&a), ok(&b));
    let dir = tempfile::tempdir().unwrap();
    let urls = format!("{},{}", a.url, b.url);
    let o = omnistream([
        "bench",
        "--url",
        &urls,
        "--concurrency",
        "2",
        "--num-prompts",
        "4",
        "--warmup",
        "1",
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--no-plots",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(dir.path());
    assert_eq!(r["runs"][0]["url"], urls.as_str());
    let l = &r["runs"][0]["levels"][0];
    assert_eq!(
        (l["completed"].as_u64(), l["failed"].as_u64()),
        (Some(4), Some(0)),
        "{l}"
    );
    // Each server: its warm-up and at least one measured request; together
    // exactly the two warm-ups and the four measured.
    let (da, db) = (ok(&a) - before.0, ok(&b) - before.1);
    assert!(da >= 2.0 && db >= 2.0, "shared {da} / {db}");
    assert_eq!(da + db, 6.0);
    let stages: Vec<&str> = l["stages"]
        .as_array()
        .expect("stages")
        .iter()
        .filter_map(|s| s["stage"].as_str())
        .collect();
    for name in ["0:thinker", "1:thinker", "0:code2wav", "1:code2wav"] {
        assert!(stages.contains(&name), "{name} missing in {stages:?}");
    }
    // Two servers' memory: more than one holds.
    let one = a
        .metric("omnistream_process_peak_resident_bytes")
        .expect("peak")
        / 1048576.0;
    assert!(f(&l["server_peak_rss_mib"]) > one, "{l}");
}

#[test]
fn failures_are_counted_and_reported() {
    let server = spawn_server(&[]);
    let dir = tempfile::tempdir().unwrap();
    let o = omnistream([
        "bench",
        "--url",
        &server.url,
        "--concurrency",
        "2",
        "--num-prompts",
        "3",
        "--warmup",
        "0",
        "--voice",
        "nobody",
        "--no-plots",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("3 request(s) failed"), "{}", text(&o));
    let l = &report(dir.path())["runs"][0]["levels"][0];
    assert_eq!(
        (l["completed"].as_u64(), l["failed"].as_u64()),
        (Some(0), Some(3))
    );
    let errors = l["errors"].to_string();
    assert!(
        errors.contains("HTTP 400") && errors.contains("nobody"),
        "{errors}"
    );

    // Nothing listening: a clear error before any load.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let o = omnistream([
        "bench",
        "--url",
        &format!("http://127.0.0.1:{port}"),
        "--out",
        dir.path().join("x").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(text(&o).contains("cannot reach the server"), "{}", text(&o));
    // Bad arguments are refused up front.
    for bad in [
        &["--concurrency", "0"][..],
        &["--request-rate", "-1"],
        &["--url", "https://example.com"],
    ] {
        let mut args = vec!["bench", "--out", "/nonexistent/never"];
        args.extend_from_slice(bad);
        let o = omnistream(args);
        assert!(!o.status.success(), "{bad:?} accepted: {}", text(&o));
    }
}

#[test]
fn compare_starts_each_profile_and_reports_ratios() {
    let dir = tempfile::tempdir().unwrap();
    let o = omnistream([
        "bench",
        "--compare",
        "deploy/tiny-cpu.yaml",
        "deploy/tiny-cpu-sync.yaml",
        "--concurrency",
        "1",
        "--num-prompts",
        "2",
        "--warmup",
        "1",
        "--output-len",
        "24",
        "--input-len",
        "8",
        "--no-plots",
        "--out",
        dir.path().to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r = report(dir.path());
    let runs = r["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["label"], "tiny-cpu");
    assert_eq!(runs[1]["profile"], "deploy/tiny-cpu-sync.yaml");
    for run in runs {
        assert_eq!(run["levels"][0]["completed"], 2, "{run}");
    }
    let ratio = &r["ratios"][0];
    assert_eq!(ratio["label"], "tiny-cpu-sync");
    assert_eq!(ratio["baseline"], "tiny-cpu");
    assert_eq!(ratio["load"], "c=1");
    // Without async chunking audio waits for the whole 24-token answer; with
    // it, for the first span of 3 tokens.
    assert!(f(&ratio["values"]["ttfp_ms.median"]) > 1.0, "{ratio}");
    for k in [
        "ttft_ms.median",
        "e2el_ms.median",
        "audio_throughput",
        "req_s",
    ] {
        let v = f(&ratio["values"][k]);
        assert!(v.is_finite() && v > 0.0, "{k}: {ratio}");
    }
    // Both servers were stopped: their logs exist and nothing listens now.
    assert!(dir.path().join("server-tiny-cpu.log").exists());
    let md = std::fs::read_to_string(dir.path().join("bench.md")).unwrap();
    assert!(md.contains("## Ratios to `tiny-cpu`"), "{md}");
}
