//! Helpers for the end-to-end tests in `tests/tests/`: the real `omnistream`
//! binary, the real models, real clients.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use omnistream_codecs::wav::parse_wav;
use omnistream_codecs::StreamResampler;
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, Once};

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

/// Held by a test that judges real-time playback (gaps, underruns, what a
/// listener hears) so no other test of the same binary loads the 2-core CI
/// machine meanwhile; `cargo test` runs binaries one at a time, so this is
/// enough. A panicking holder does not poison it for the others.
pub fn exclusive() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
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
        // float32, as the server computes (its CTranslate2 files are float16):
        // int8 quantizes at load, and its kernels differ by processor (the same
        // audio gave 16.1% WER on one machine, 12.9% on an AVX2-only one).
        .args(["--compute-type", "float32"])
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

/// Asserts the server heard `(reference text, transcript)` pairs within 2
/// points of word error rate of the reference implementation of its
/// recognizer (faster-whisper over the same CTranslate2 files) on the audio
/// in `refs` (`(wav, reference text)`); returns both rates. `what` names the
/// path in messages.
pub fn assert_wer_like_reference(
    what: &str,
    heard: &[(String, String)],
    refs: &[(PathBuf, String)],
) -> (f64, f64) {
    let errors: usize = heard.iter().map(|(r, h)| word_error_rate(r, h).0).sum();
    let words: usize = heard.iter().map(|(r, _)| word_error_rate(r, "").1).sum();
    let ours = errors as f64 / words.max(1) as f64;
    let (reference, detail) = whisper_wer(refs);
    eprintln!("{what}: omnistream WER {ours:.3}, faster-whisper WER {reference:.3}\n{heard:#?}");
    assert!(
        ours <= reference + 0.02,
        "{what}: omnistream WER {ours:.3} vs faster-whisper {reference:.3}: {heard:#?}\n{detail}"
    );
    (ours, reference)
}

/// Word errors (substitutions, insertions, deletions) of `hyp` against
/// `reference`, and the reference's word count; both normalised as
/// `tests/python/wer.py` does for text without numbers (lower case, no
/// punctuation, contractions written out, American spelling, compounds
/// written apart on one side joined).
pub fn word_error_rate(reference: &str, hyp: &str) -> (usize, usize) {
    static SPELLING: std::sync::LazyLock<HashMap<String, String>> =
        std::sync::LazyLock::new(|| {
            serde_json::from_str(include_str!("python/spelling.json")).expect("spelling.json")
        });
    // Contractions written out as wer.py does (they're -> they are): Whisper
    // writes either for the same sound; 's and 'd are ambiguous and kept.
    let expand = |w: &str| -> Vec<String> {
        let w = w.trim_matches('\'');
        let whole = match w {
            "won't" => Some("will not"),
            "can't" | "cannot" => Some("can not"),
            "shan't" => Some("shall not"),
            _ => None,
        };
        if let Some(whole) = whole {
            return whole.split(' ').map(str::to_owned).collect();
        }
        for (suffix, word) in [
            ("n't", "not"),
            ("'re", "are"),
            ("'ve", "have"),
            ("'ll", "will"),
            ("'m", "am"),
        ] {
            if let Some(stem) = w
                .strip_suffix(suffix)
                .filter(|s| s.ends_with(char::is_alphabetic))
            {
                return vec![stem.replace('\'', ""), word.to_owned()];
            }
        }
        vec![w.replace('\'', "")]
    };
    let words = |s: &str| -> Vec<String> {
        s.to_lowercase()
            .chars()
            .map(|c| match c {
                '\'' | '\u{2019}' | '`' => '\'',
                c if c.is_alphanumeric() => c,
                _ => ' ',
            })
            .collect::<String>()
            .split_whitespace()
            .flat_map(expand)
            .filter(|w| !w.is_empty())
            .map(|w| SPELLING.get(&w).cloned().unwrap_or(w))
            .collect()
    };
    // As wer.py's join_compounds.
    let join = |words: &[String], other: &[String]| -> Vec<String> {
        let (mut out, mut i) = (Vec::new(), 0);
        while i < words.len() {
            let pair = words.get(i + 1).map(|n| format!("{}{n}", words[i]));
            match pair {
                Some(p) if other.contains(&p) && !other.contains(&words[i]) => {
                    out.push(p);
                    i += 2;
                }
                _ => {
                    out.push(words[i].clone());
                    i += 1;
                }
            }
        }
        out
    };
    let (r, h) = (words(reference), words(hyp));
    let (r, h) = (join(&r, &h), join(&h, &r));
    let mut prev: Vec<usize> = (0..=h.len()).collect();
    for (i, rw) in r.iter().enumerate() {
        let mut cur = vec![i + 1; h.len() + 1];
        for (j, hw) in h.iter().enumerate() {
            let sub = prev[j] + usize::from(rw != hw);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    (prev[h.len()], r.len())
}

/// A running `omnistream serve` on a free loopback port; killed on drop.
pub struct Server {
    child: std::process::Child,
    pub port: u16,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// Server output so far is drained in a thread; kept for failure messages.
    pub log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Server {
    pub fn ws_url(&self, path: &str) -> String {
        format!("ws://127.0.0.1:{}{path}", self.port)
    }
    /// Ends the process at once (SIGKILL: no goodbye to anyone).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
    /// Sends `signal` (`TERM`, `INT`, ...) to the process.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .args(["-s", signal, &self.child.id().to_string()])
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -s {signal} failed");
    }
    /// Waits up to `limit` for the process to exit; its status, or `None`.
    pub fn wait_exit(&mut self, limit: std::time::Duration) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + limit;
        while std::time::Instant::now() < until {
            if let Ok(Some(s)) = self.child.try_wait() {
                return Some(s);
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        None
    }
    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
    /// The process's resident memory (VmRSS), in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }
    /// The process's output so far.
    pub fn output(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }
    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
    /// The `/metrics` text.
    pub fn metrics(&self) -> String {
        http_get(self.port, "/metrics")
    }
    /// One sample from `/metrics` (first line starting with `name`).
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metrics()
            .lines()
            .find(|l| l.starts_with(name) && !l.starts_with('#'))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A profile written beside the default one (its relative paths hold),
/// edited by `edit`; removed on drop. `path` is relative to the repository.
pub struct TempProfile {
    pub path: String,
}

impl TempProfile {
    pub fn new(name: &str, edit: impl FnOnce(String) -> String) -> Self {
        let yaml = std::fs::read_to_string(root().join("deploy/tiny-cpu.yaml"))
            .expect("deploy/tiny-cpu.yaml");
        let path = format!("deploy/.test-{name}-{}.yaml", std::process::id());
        std::fs::write(root().join(&path), edit(yaml)).expect("writing a test profile");
        Self { path }
    }

    /// The default profile with `lines` (indented by 2) added to its `server:` section.
    pub fn with_server(name: &str, lines: &str) -> Self {
        Self::new(name, |yaml| add_server_lines(&yaml, lines))
    }
}

/// `yaml` with `lines` (indented by 2) added to its `server:` section.
pub fn add_server_lines(yaml: &str, lines: &str) -> String {
    assert!(
        yaml.contains("\nserver:\n"),
        "the profile has a server section"
    );
    let indented: String = lines.lines().map(|l| format!("  {l}\n")).collect();
    yaml.replacen("\nserver:\n", &format!("\nserver:\n{indented}"), 1)
}

impl Drop for TempProfile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(root().join(&self.path));
    }
}

/// A free loopback TCP port.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// A free port whose next one is free too, for TCP and UDP (baresip 1.0 opens
/// its SIP/TLS transport on the port after its SIP one, whatever
/// `sip_transports` says: a busy neighbour failed its start).
pub fn free_port_pair() -> u16 {
    use std::net::{TcpListener, UdpSocket};
    for _ in 0..100 {
        let port = free_port();
        let Some(next) = port.checked_add(1) else {
            continue;
        };
        let free = |p: u16| {
            TcpListener::bind(("127.0.0.1", p)).is_ok() && UdpSocket::bind(("127.0.0.1", p)).is_ok()
        };
        if free(port) && free(next) {
            return port;
        }
    }
    panic!("no two free ports side by side");
}

/// Starts `omnistream serve` (default profile) with `extra` arguments and waits
/// until it listens (models loaded and warmed up).
pub fn spawn_server(extra: &[&str]) -> Server {
    spawn_server_in(&[], extra)
}

/// [`spawn_server`] under a command prefix (`ip netns exec NS`).
pub fn spawn_server_in(prefix: &[&str], extra: &[&str]) -> Server {
    let port = free_port();
    let mut args = vec!["serve", "--port"];
    let p = port.to_string();
    args.push(&p);
    args.extend_from_slice(extra);
    spawn_ready(prefix, &args, "listening on", port)
}

/// Starts `omnistream stage` (one replica of `stage` of `profile`, over the
/// NATS server at `nats`) and waits until it is ready. Its `port` is 0.
pub fn spawn_stage(profile: &str, stage: &str, nats: &str, extra: &[&str]) -> Server {
    spawn_stage_in(&[], profile, stage, nats, extra)
}

/// [`spawn_stage`] under a command prefix (`ip netns exec NS`).
pub fn spawn_stage_in(
    prefix: &[&str],
    profile: &str,
    stage: &str,
    nats: &str,
    extra: &[&str],
) -> Server {
    let mut args = vec![
        "stage",
        "--profile",
        profile,
        "--stage",
        stage,
        "--nats",
        nats,
    ];
    args.extend_from_slice(extra);
    spawn_ready(prefix, &args, " ready (", 0)
}

/// Runs `[PREFIX] omnistream ARGS` and waits for `ready` on its standard output.
fn spawn_ready(prefix: &[&str], args: &[&str], ready: &str, port: u16) -> Server {
    use std::io::BufRead;
    let bin = binary();
    let mut cmd = match prefix.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(&bin);
            c
        }
        None => Command::new(&bin),
    };
    let mut child = cmd
        .args(args)
        .current_dir(root())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("starting omnistream");
    let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    for (stream, is_stdout) in [
        (Box::new(stdout) as Box<dyn std::io::Read + Send>, true),
        (Box::new(stderr), false),
    ] {
        let log = log.clone();
        let tx = tx.clone();
        let ready = ready.to_string();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stream)
                .lines()
                .map_while(Result::ok)
            {
                // Logged first: a caller woken by the ready line finds it there.
                if let Ok(mut l) = log.lock() {
                    l.push_str(&line);
                    l.push('\n');
                }
                if is_stdout && line.contains(&ready) {
                    let _ = tx.send(());
                }
            }
        });
    }
    let mut server = Server {
        child,
        port,
        url: format!("http://127.0.0.1:{port}"),
        log,
    };
    if rx
        .recv_timeout(std::time::Duration::from_secs(300))
        .is_err()
        || !server.alive()
    {
        let log = server.log.lock().map(|l| l.clone()).unwrap_or_default();
        panic!("omnistream {} did not start:\n{log}", args.join(" "));
    }
    server
}

/// A real `nats-server` (Debian's) on a loopback port, with the deploy
/// config's payload limit; killed on drop.
pub struct Nats {
    child: Option<std::process::Child>,
    pub port: u16,
    /// `nats://127.0.0.1:PORT`
    pub url: String,
    _dir: tempfile::TempDir,
    conf: PathBuf,
}

impl Nats {
    pub fn start() -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().expect("tempdir");
        let conf = dir.path().join("nats.conf");
        std::fs::write(
            &conf,
            format!("listen: 127.0.0.1:{port}\nmax_payload: 64MB\n"),
        )
        .expect("write nats.conf");
        let mut n = Self {
            child: None,
            port,
            url: format!("nats://127.0.0.1:{port}"),
            _dir: dir,
            conf,
        };
        n.up();
        n
    }

    fn up(&mut self) {
        let child = Command::new("nats-server")
            .arg("-c")
            .arg(&self.conf)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("starting nats-server (apt-get install nats-server)");
        self.child = Some(child);
        let end = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < end, "nats-server did not listen");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (SIGKILL).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port.
    pub fn restart(&mut self) {
        self.stop();
        self.up();
    }
}

impl Drop for Nats {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs a pytest file from `tests/python/` against `server` (`OMNISTREAM_URL`);
/// panics with pytest's report and the server's log unless it passed. Returns
/// the report.
pub fn run_pytest(server: &Server, file: &str) -> String {
    run_pytest_at(&server.url, server, file)
}

/// [`run_pytest`] against `url` (a load balancer in front of `server`).
pub fn run_pytest_at(url: &str, server: &Server, file: &str) -> String {
    let out = Command::new("python3")
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(root().join("tests/python").join(file))
        .env("OMNISTREAM_URL", url)
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
    report
}

/// A plain HTTP/1.1 GET on loopback (no client library needed); returns the body.
pub fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    );
    let mut buf = String::new();
    let _ = s.read_to_string(&mut buf);
    buf.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

// ------------------------------------------------------------ HTTP clients

/// An HTTP response, as curl saw it.
pub struct Resp {
    pub status: u16,
    /// Header block(s), lower-cased.
    pub headers: String,
    pub body: String,
}

impl Resp {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", self.body))
    }
    /// Asserts an OpenAI-shaped error with this status.
    pub fn assert_error(&self, status: u16, what: &str) -> serde_json::Value {
        assert_eq!(self.status, status, "{what}: {} {}", self.status, self.body);
        let v = self.json();
        let err = &v["error"];
        assert!(
            err["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{what}: {v}"
        );
        assert!(
            err["type"].is_string() && err["code"].is_string(),
            "{what}: {v}"
        );
        err.clone()
    }
}

/// `curl -X POST url` with a JSON body (or a body file), extra headers.
pub fn post(url: &str, body: &str, headers: &[&str]) -> Resp {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("body");
    std::fs::write(&file, body).unwrap();
    curl(url, Some(&file), headers)
}

pub fn curl(url: &str, body: Option<&std::path::Path>, headers: &[&str]) -> Resp {
    let dir = tempfile::tempdir().unwrap();
    let (hfile, bfile) = (dir.path().join("h"), dir.path().join("b"));
    let mut c = Command::new("curl");
    c.args(["-sS", "--max-time", "300", "-D"])
        .arg(&hfile)
        .arg("-o")
        .arg(&bfile)
        .args(["-w", "%{http_code}"]);
    if let Some(b) = body {
        c.args(["-X", "POST", "-H", "Content-Type: application/json"])
            .arg("--data-binary")
            .arg(format!("@{}", b.display()));
    }
    for h in headers {
        c.args(["-H", h]);
    }
    let out = c.arg(url).output().expect("running curl");
    let code = String::from_utf8_lossy(&out.stdout);
    Resp {
        status: code.trim().parse().unwrap_or_else(|_| {
            panic!(
                "curl {url}: {code:?} {}",
                String::from_utf8_lossy(&out.stderr)
            )
        }),
        headers: std::fs::read_to_string(&hfile)
            .unwrap_or_default()
            .to_lowercase(),
        body: std::fs::read_to_string(&bfile).unwrap_or_default(),
    }
}

/// Every sample of `/metrics`: (name, labels) -> value.
pub fn samples(server: &Server) -> Vec<(String, BTreeMap<String, String>, f64)> {
    parse_samples(&server.metrics())
}

/// Every sample of a Prometheus text exposition.
pub fn parse_samples(text: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (key, value) = l.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match key.split_once('{') {
                Some((n, rest)) => {
                    let labels = rest
                        .trim_end_matches('}')
                        .split("\",")
                        .filter_map(|kv| {
                            let (k, v) = kv.split_once('=')?;
                            Some((k.to_string(), v.trim_matches('"').to_string()))
                        })
                        .collect();
                    (n.to_string(), labels)
                }
                None => (key.to_string(), BTreeMap::new()),
            };
            Some((name, labels, value))
        })
        .collect()
}

/// The sum of `name` samples carrying all of `labels`.
pub fn metric(server: &Server, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_in(&server.metrics(), name, labels)
}

/// [`metric`] of a server that wants `key` for `/metrics`.
pub fn metric_keyed(server: &Server, key: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let auth = format!("Authorization: Bearer {key}");
    let r = curl(&format!("{}/metrics", server.url), None, &[&auth]);
    assert_eq!(r.status, 200, "/metrics: {}", r.body);
    metric_in(&r.body, name, labels)
}

/// The sum of `name` samples carrying all of `labels`, in `text`.
pub fn metric_in(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    parse_samples(text)
        .into_iter()
        .filter(|(n, l, _)| {
            n == name
                && labels
                    .iter()
                    .all(|(k, v)| l.get(*k).map(String::as_str) == Some(v))
        })
        .map(|(_, _, v)| v)
        .sum()
}

/// Waits (up to `secs`) for `cond`; false if it never held.
pub fn eventually(secs: u64, mut cond: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    cond()
}

// ------------------------------------------------------ speech for the tests

/// espeak-ng's voice (a different speaker and synthesis than the server's).
pub const ESPEAK: [&str; 10] = [
    "The weather is lovely today.",
    "Please open the window before you leave.",
    "My brother plays the guitar every evening.",
    "We bought fresh apples at the market.",
    "The museum is closed on Mondays.",
    "Could you send me the report tomorrow?",
    "The children are playing in the garden.",
    "Turn left at the next traffic light.",
    "She reads a book before going to sleep.",
    "The coffee in this shop is very good.",
];

/// omnistream's own voice (`omnistream say`).
pub const OWN: [&str; 3] = [
    "What is the capital of France?",
    "Tell me something about the ocean.",
    "How do bees make honey?",
];

/// `text` said by espeak-ng into `path`.
pub fn espeak(text: &str, path: &Path) -> (Vec<f32>, u32) {
    let out = Command::new("espeak-ng")
        .arg("-w")
        .arg(path)
        .arg(text)
        .output()
        .expect("running espeak-ng (scripts/setup.sh installs it)");
    assert!(out.status.success(), "espeak-ng: {out:?}");
    read_wav(path)
}

/// `text` said by `omnistream say` (the server's own voice) into `path`.
pub fn own_voice(text: &str, path: &Path) -> (Vec<f32>, u32) {
    let out = omnistream(["say", text, "-o", path.to_str().expect("utf-8 path")]);
    assert!(out.status.success(), "omnistream say: {out:?}");
    read_wav(path)
}

pub fn read_wav(path: &Path) -> (Vec<f32>, u32) {
    parse_wav(&std::fs::read(path).expect("read wav")).expect("parse wav")
}

pub fn resample(x: &[f32], from: u32, to: u32) -> Vec<f32> {
    if from == to {
        return x.to_vec();
    }
    let mut r = StreamResampler::new(from, to).expect("resampler");
    let mut y = r.process(x).expect("resample");
    y.extend(r.flush().expect("flush"));
    y
}

pub fn silence(seconds: f64, rate: u32) -> Vec<f32> {
    vec![0.0; (seconds * f64::from(rate)) as usize]
}

/// Every test utterance ([`ESPEAK`], then [`OWN`]), as (reference text, mono
/// f32, its rate); the WAVs are left in `dir`.
pub fn utterances(dir: &Path) -> Vec<(String, Vec<f32>, u32)> {
    let mut all = Vec::new();
    for (i, t) in ESPEAK.iter().enumerate() {
        let (x, r) = espeak(t, &dir.join(format!("espeak{i}.wav")));
        all.push((t.to_string(), x, r));
    }
    for (i, t) in OWN.iter().enumerate() {
        let (x, r) = own_voice(t, &dir.join(format!("own{i}.wav")));
        all.push((t.to_string(), x, r));
    }
    all
}

#[cfg(test)]
mod tests {
    use super::word_error_rate;

    #[test]
    fn word_errors_leave_spelling_and_compounds_alone() {
        assert_eq!(
            word_error_rate("Two cats, one dog.", "two cats one dog"),
            (0, 4)
        );
        assert_eq!(
            word_error_rate("The match was cancelled.", "the match was canceled"),
            (0, 4)
        );
        assert_eq!(
            word_error_rate("on the warm windowsill", "on the warm window sill"),
            (0, 4)
        );
        // The reference's words are counted joined, as wer.py counts them.
        assert_eq!(
            word_error_rate("on the warm window sill", "on the warm windowsill"),
            (0, 4)
        );
        // Real errors still count: a word missed, a word swapped.
        assert_eq!(
            word_error_rate("the old clock rings", "the old clock"),
            (1, 4)
        );
        assert_eq!(
            word_error_rate("tomatoes and carrots", "tomatoes in carrots"),
            (1, 3)
        );
    }

    #[test]
    fn contractions_count_as_their_words() {
        assert_eq!(
            word_error_rate(
                "They\u{2019}re sure we'll go; I'm not",
                "they are sure we will go i am not"
            ),
            (0, 9)
        );
        assert_eq!(word_error_rate("won't, can't", "will not cannot"), (0, 4));
        // A quote is no contraction, and 's stays one word.
        assert_eq!(word_error_rate("'rest' it's", "rest its"), (0, 2));
        // We're is not were.
        assert_eq!(word_error_rate("we're here", "were here"), (2, 3));
    }
}
