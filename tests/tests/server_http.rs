//! `omnistream serve` over HTTP: the OpenAI SDK end to end (Python), and the
//! edges with plain clients (curl, raw TCP): bad requests, body limit, API
//! keys, capacity, a client that goes away mid-stream.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use omnistream_e2e::{curl, eventually, metric, post, run_pytest, samples, spawn_server, Server};

fn assert_healthy(server: &mut Server) {
    assert!(server.alive(), "server died:\n{}", log(server));
    let r = curl(&format!("{}/health", server.url), None, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["status"], "ok", "{}", r.body);
}

fn log(server: &Server) -> String {
    server.log.lock().map(|l| l.clone()).unwrap_or_default()
}

/// A streaming chat request with audio over a raw socket, read until its first
/// audio chunk has arrived; the socket is returned, still open.
fn open_audio_stream(server: &Server, prompt: &str) -> TcpStream {
    let body = serde_json::json!({
        "model": "omnistream",
        "messages": [{"role": "user", "content": prompt}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "joe", "format": "pcm16"},
        "stream": true,
        "max_tokens": 200,
    })
    .to_string();
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 16384];
    while !String::from_utf8_lossy(&seen).contains("\"data\":\"") {
        let n = s.read(&mut buf).expect("reading the stream");
        assert!(
            n > 0,
            "stream ended before audio: {}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&buf[..n]);
    }
    let head = String::from_utf8_lossy(&seen).to_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    s
}

#[test]
fn openai_python_sdk_end_to_end() {
    let mut server = spawn_server(&["--max-in-flight", "4"]);
    let report = run_pytest(&server, "test_openai.py");
    assert!(report.contains("passed"), "{report}");
    assert!(!report.contains("skipped"), "{report}");

    // What the suite did shows in the metrics.
    let ok = |ep| {
        metric(
            &server,
            "omnistream_requests_total",
            &[("endpoint", ep), ("outcome", "ok")],
        )
    };
    assert!(ok("chat_completions") >= 8.0, "{}", server.metrics());
    assert!(ok("audio_speech") >= 6.0, "{}", server.metrics());
    for h in [
        "omnistream_ttft_seconds_count",
        "omnistream_ttfp_seconds_count",
    ] {
        assert!(
            metric(&server, h, &[("endpoint", "chat_completions")]) >= 1.0,
            "{h}"
        );
    }
    assert!(
        metric(
            &server,
            "omnistream_audio_rtf_count",
            &[("endpoint", "audio_speech")]
        ) >= 6.0
    );
    assert!(metric(&server, "omnistream_audio_bytes_out_total", &[]) > 100_000.0);
    assert!(
        metric(
            &server,
            "omnistream_requests_total",
            &[("outcome", "bad_request")]
        ) >= 10.0
    );
    assert_eq!(metric(&server, "omnistream_requests_in_flight", &[]), 0.0);
    assert_healthy(&mut server);
}

#[test]
fn bad_requests_keys_and_body_limit_are_openai_errors() {
    let mut server = spawn_server(&["--api-key", "secret"]);
    let chat = &format!("{}/v1/chat/completions", server.url);
    let speech = &format!("{}/v1/audio/speech", server.url);
    let key = "Authorization: Bearer secret";
    let hello = r#"{"model":"m","messages":[{"role":"user","content":"Say hi."}],"max_tokens":4}"#;

    let e = post(chat, hello, &[]).assert_error(401, "no key");
    assert_eq!(e["code"], "invalid_api_key");
    post(chat, hello, &["Authorization: Bearer wrong"]).assert_error(401, "wrong key");
    post(chat, hello, &["Authorization: Bearer secre"]).assert_error(401, "a prefix of the key");
    post(chat, hello, &["Authorization: Basic secret"]).assert_error(401, "another scheme");
    // The scheme is case-insensitive (RFC 9110).
    let r = post(chat, hello, &["Authorization: bearer secret"]);
    assert_eq!(r.status, 200, "lower-case scheme: {}", r.body);
    post(speech, r#"{"input":"Hi"}"#, &[]).assert_error(401, "speech without key");
    let r = curl(&format!("{}/metrics", server.url), None, &[]);
    assert_eq!(r.status, 401, "metrics need the key too");

    let bad: &[(&str, &str, &str)] = &[
        (chat, "{not json", "malformed JSON"),
        (chat, r#"{"messages": "hi"}"#, "messages not a list"),
        (chat, r#"{"model": "m"}"#, "no messages"),
        (chat, r#"{"messages": []}"#, "empty messages"),
        (
            chat,
            r#"{"messages":[{"role":"captain","content":"x"}]}"#,
            "bad role",
        ),
        (
            chat,
            r#"{"messages":[{"role":"user","content":"x"}],"temperature":2.5}"#,
            "temperature",
        ),
        (
            chat,
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
            "max_tokens",
        ),
        (
            chat,
            r#"{"messages":[{"role":"user","content":"x"}],"modalities":["text","audio"],"audio":{"voice":"joe","format":"aac"}}"#,
            "chat format",
        ),
        (
            chat,
            r#"{"messages":[{"role":"user","content":"x"}],"modalities":["text","audio"],"audio":{"voice":"bob","format":"wav"}}"#,
            "chat voice",
        ),
        (
            speech,
            r#"{"input":"Hi","voice":"joe","response_format":"aac"}"#,
            "speech format",
        ),
        (speech, r#"{"input":"Hi","voice":"joe","speed":9}"#, "speed"),
        (speech, r#"{"input":"","voice":"joe"}"#, "empty input"),
        (
            speech,
            r#"{"input":"... -- !?","voice":"joe"}"#,
            "punctuation only",
        ),
        (speech, "[1,2", "speech malformed JSON"),
    ];
    for (url, body, what) in bad {
        let e = post(url, body, &[key]).assert_error(400, what);
        assert_eq!(e["type"], "invalid_request_error", "{what}");
    }
    // Nothing to say: the rule's own code, naming the field.
    let e = post(speech, r#"{"input":"... -- !?","voice":"joe"}"#, &[key])
        .assert_error(400, "punctuation only");
    assert_eq!(
        (&e["code"], &e["param"]),
        (&"nothing_to_say".into(), &"input".into()),
        "{e}"
    );
    // A wrong path or method: the JSON error shape too.
    let r = post(&format!("{}/v1/nowhere", server.url), "{}", &[key]);
    let e = r.assert_error(404, "no such path");
    assert_eq!(e["code"], "not_found", "{e}");
    let r = omnistream_e2e::curl(&format!("{}/v1/chat/completions", server.url), None, &[key]);
    let e = r.assert_error(405, "GET on a POST endpoint");
    assert_eq!(e["code"], "method_not_allowed", "{e}");
    // A plain GET on a WebSocket endpoint (no handshake).
    let r = omnistream_e2e::curl(&format!("{}/v1/realtime", server.url), None, &[key]);
    assert!(r.status >= 400 && r.status < 500, "{}", r.body);
    assert_eq!(
        r.json()["error"]["code"],
        "websocket_upgrade_required",
        "{}",
        r.body
    );
    let long = serde_json::json!({"input": "a".repeat(4097), "voice": "joe"}).to_string();
    post(speech, &long, &[key]).assert_error(400, "input over 4096");
    let e = post(speech, r#"{"input":"Hi","voice":"bob"}"#, &[key]).assert_error(400, "voice");
    let m = e["message"].as_str().unwrap_or("");
    assert!(m.contains("joe") && m.contains("alloy"), "{e}");

    // 2 MiB: 413, as JSON; both with a Content-Length and chunked.
    let big = serde_json::json!({
        "messages": [{"role": "user", "content": "x".repeat(2 << 20)}],
    })
    .to_string();
    post(chat, &big, &[key]).assert_error(413, "oversized body");
    // Chunked: just over the limit and without `Expect: 100-continue`, so the
    // whole upload fits in the loopback socket buffers and curl always reads
    // the 413 (with 2 MiB, curl may still be sending when the server answers).
    let over = serde_json::json!({
        "messages": [{"role": "user", "content": "x".repeat((1 << 20) + (64 << 10))}],
    })
    .to_string();
    post(chat, &over, &[key, "Transfer-Encoding: chunked", "Expect:"])
        .assert_error(413, "oversized chunked body");

    // Nothing above reached the pipeline; a good request still works.
    let r = post(chat, hello, &[key]);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["object"], "chat.completion");
    assert!(r.json()["choices"][0]["message"]["content"].is_string());
    // /metrics needs the key on this server.
    let metrics = curl(&format!("{}/metrics", server.url), None, &[key]);
    assert_eq!(metrics.status, 200);
    let count: f64 = metrics
        .body
        .lines()
        .filter(|l| {
            l.starts_with("omnistream_requests_total{") && l.contains("outcome=\"bad_request\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert!(count >= (bad.len() + 4) as f64, "bad_request count {count}");
    assert_healthy(&mut server);
}

#[test]
fn over_capacity_is_503_and_a_client_that_leaves_is_cancelled() {
    let mut server = spawn_server(&["--max-in-flight", "1"]);
    let chat = &format!("{}/v1/chat/completions", server.url);
    let tasks_before = metric(&server, "omnistream_tasks_open", &[]);

    let stream = open_audio_stream(&server, "Tell me a long story about a dragon and a knight.");
    assert_eq!(metric(&server, "omnistream_requests_in_flight", &[]), 1.0);

    // A second request while the first generates: 503 + Retry-After, both endpoints.
    let second = r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4}"#;
    let r = post(chat, second, &[]);
    let e = r.assert_error(503, "over capacity");
    assert_eq!(e["code"], "overloaded");
    assert!(r.headers.contains("retry-after: 1"), "{}", r.headers);
    let r = post(
        &format!("{}/v1/audio/speech", server.url),
        r#"{"input":"Hi"}"#,
        &[],
    );
    r.assert_error(503, "speech over capacity");
    assert!(r.headers.contains("retry-after:"), "{}", r.headers);
    assert_eq!(
        metric(
            &server,
            "omnistream_requests_total",
            &[("outcome", "overloaded")]
        ),
        2.0
    );

    // The client goes away mid-stream: the request is cancelled in every stage.
    drop(stream);
    let settled = eventually(30, || {
        let s = samples(&server);
        let get = |name: &str| {
            s.iter()
                .filter(|(n, _, _)| n == name)
                .map(|(_, _, v)| *v)
                .sum::<f64>()
        };
        let active: f64 = s
            .iter()
            .filter(|(n, l, _)| {
                n == "omnistream_stage"
                    && l.get("metric").map(String::as_str) == Some("active_requests")
            })
            .map(|(_, _, v)| *v)
            .sum();
        active == 0.0
            && get("omnistream_requests_in_flight") == 0.0
            && get("omnistream_engine_requests_in_flight") == 0.0
    });
    assert!(settled, "request not cancelled:\n{}", server.metrics());
    let cancelled_in_stages = metric(
        &server,
        "omnistream_stage",
        &[("metric", "cancelled_total")],
    );
    assert!(cancelled_in_stages >= 1.0, "{}", server.metrics());
    assert_eq!(
        metric(
            &server,
            "omnistream_requests_total",
            &[("endpoint", "chat_completions"), ("outcome", "cancelled")]
        ),
        1.0
    );
    assert!(eventually(5, || metric(
        &server,
        "omnistream_tasks_open",
        &[]
    ) == tasks_before));

    // The slot is free again, and the server is fine.
    let r = post(chat, second, &[]);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = post(
        &format!("{}/v1/audio/speech", server.url),
        r#"{"input":"Hello there.","response_format":"wav"}"#,
        &[],
    );
    assert_eq!(r.status, 200);
    assert!(
        r.headers.contains("content-type: audio/wav"),
        "{}",
        r.headers
    );
    assert_healthy(&mut server);
}

/// One raw HTTP/1.1 exchange (`Connection: close`): status and body.
fn raw(server: &Server, head: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", server.port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "{head}Connection: close\r\n\r\n{body}").unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {out:?}"));
    let body = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// The OpenAI error body's `error` object, with its code checked.
fn error_code(body: &str, code: &str) -> serde_json::Value {
    // A chunked body: the JSON sits between the chunk sizes.
    let start = body.find('{').unwrap_or(0);
    let end = body.rfind('}').map_or(body.len(), |e| e + 1);
    let v: serde_json::Value = serde_json::from_str(&body[start..end])
        .unwrap_or_else(|e| panic!("not JSON ({e}): {body:?}"));
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    v["error"].clone()
}

/// What a hostile page or a careless client sends is refused before the
/// pipeline, with the right status and a JSON error; the server serves on.
#[test]
fn hostile_and_careless_requests_get_the_right_errors() {
    let mut server = spawn_server(&[]);
    let port = server.port;
    let hello = r#"{"model":"m","messages":[{"role":"user","content":"Say hi."}],"max_tokens":4}"#;
    let post_chat = |extra: &str, ctype: &str, body: &str| {
        raw(
            &server,
            &format!(
                "POST /v1/chat/completions HTTP/1.1\r\n{extra}Content-Type: {ctype}\r\nContent-Length: {}\r\n",
                body.len()
            ),
            body,
        )
    };
    let own = format!("Host: 127.0.0.1:{port}\r\n");

    // DNS rebinding: a page's own name resolved to this server. Host and
    // Origin agree with each other, but the name is not this server's.
    let evil = format!("Host: evil.example:{port}\r\nOrigin: http://evil.example:{port}\r\n");
    let (s, b) = post_chat(&evil, "application/json", hello);
    assert_eq!(s, 403, "{b}");
    error_code(&b, "host_not_allowed");
    let upgrade = "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n";
    let (s, b) = raw(
        &server,
        &format!("GET /v1/realtime HTTP/1.1\r\n{evil}{upgrade}"),
        "",
    );
    assert_eq!(s, 403, "rebinding WebSocket upgrade: {b}");
    // Another site's page; this site's page over another scheme.
    for origin in [
        "http://evil.example",
        &format!("https://127.0.0.1:{port}"),
        "null",
    ] {
        let (s, b) = post_chat(
            &format!("{own}Origin: {origin}\r\n"),
            "application/json",
            hello,
        );
        assert_eq!(s, 403, "{origin}: {b}");
        error_code(&b, "origin_not_allowed");
    }
    // A simple cross-origin request's content type, even without an Origin.
    let (s, b) = post_chat(&own, "text/plain;charset=UTF-8", hello);
    assert_eq!(s, 415, "{b}");
    error_code(&b, "unsupported_media_type");
    // This server's own page, by IP and by localhost, is served.
    let (s, b) = post_chat(
        &format!("{own}Origin: http://127.0.0.1:{port}\r\n"),
        "application/json",
        hello,
    );
    assert_eq!(s, 200, "{b}");
    let local = format!("Host: localhost:{port}\r\nOrigin: http://localhost:{port}\r\n");
    let (s, b) = post_chat(&local, "application/json", hello);
    assert_eq!(s, 200, "{b}");

    // A prompt over the Thinker's context: the client's fault, as OpenAI says it.
    let long = serde_json::json!({
        "messages": [{"role": "user", "content": "hello ".repeat(12000)}],
        "max_tokens": 4,
    })
    .to_string();
    let (s, b) = post_chat(&own, "application/json", &long);
    assert_eq!(s, 400, "{b}");
    let e = error_code(&b, "context_length_exceeded");
    assert_eq!(e["param"], "messages", "{e}");
    assert_eq!(e["type"], "invalid_request_error", "{e}");

    // Transcription: an upload declared over 25 MB is refused from its header
    // (nothing of it sent); a body that is not multipart gets the JSON shape.
    let (s, b) = raw(
        &server,
        &format!(
            "POST /v1/audio/transcriptions HTTP/1.1\r\n{own}Content-Type: multipart/form-data; boundary=x\r\nContent-Length: {}\r\n",
            26 << 20
        ),
        "",
    );
    assert_eq!(s, 413, "{b}");
    error_code(&b, "request_too_large");
    let (s, b) = raw(
        &server,
        &format!(
            "POST /v1/audio/transcriptions HTTP/1.1\r\n{own}Content-Type: application/json\r\nContent-Length: {}\r\n",
            hello.len()
        ),
        hello,
    );
    assert_eq!(s, 400, "{b}");
    error_code(&b, "invalid_content_type");

    // None of it reached the pipeline; the server is well.
    assert_eq!(metric(&server, "omnistream_requests_in_flight", &[]), 0.0);
    assert_healthy(&mut server);
}

/// The Thinker's prefix cache is bounded by bytes (`prefix_cache_mib`), not
/// only by entries: distinct long prompts evict the oldest, `/metrics` shows
/// what it holds, and the process's memory grows by less than the bound.
#[test]
fn the_prefix_cache_stays_within_its_byte_bound() {
    const BOUND: f64 = 32.0 * 1048576.0;
    // The default profile with a small bound, beside it (its paths are relative).
    let profile = omnistream_e2e::TempProfile::new("prefix", |yaml| {
        assert!(yaml.contains("prefix_cache_entries: 16"));
        yaml.replace(
            "prefix_cache_entries: 16",
            "prefix_cache_entries: 16\n    prefix_cache_mib: 32",
        )
    });
    let profile = &profile.path;
    let mut server = spawn_server(&["--profile", profile]);
    let chat = &format!("{}/v1/chat/completions", server.url);
    let ask = |i: usize| {
        // ~450 tokens, each prompt its own from the first word: ~21 MB of KV.
        let content = format!("{i} {}", "the cat sat ".repeat(150));
        let body = serde_json::json!({
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 1,
        });
        let r = post(chat, &body.to_string(), &[]);
        assert_eq!(r.status, 200, "{}", r.body);
    };
    let held = |server: &Server| {
        metric(
            server,
            "omnistream_stage",
            &[("stage", "thinker"), ("metric", "cache_bytes")],
        )
    };
    ask(0);
    assert!(
        eventually(10, || held(&server) > BOUND / 2.0),
        "the first prompt's KV is not kept: {}",
        held(&server)
    );
    let before = server.rss_bytes();
    for i in 1..20 {
        ask(i);
        let h = held(&server);
        assert!(h <= BOUND, "prompt {i}: the cache holds {h} bytes");
    }
    assert!(
        eventually(10, || {
            let h = held(&server);
            h > BOUND / 2.0 && h <= BOUND
        }),
        "the cache holds {} bytes; bound {BOUND}",
        held(&server)
    );
    // Nineteen prompts' KV is ~400 MB (16 entries, the entry cap, ~340 MB);
    // kept, as before the bound, it would show here.
    let grown = server.rss_bytes().saturating_sub(before) as f64;
    assert!(
        grown < 2.0 * BOUND,
        "RSS grew by {grown} bytes over 19 long prompts"
    );
    assert_healthy(&mut server);
}
