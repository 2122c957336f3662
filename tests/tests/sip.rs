//! SIP calls (`omnistream serve --sip`), end to end: Debian's `baresip` calls
//! the server on loopback with a spoken question (digest authentication with
//! an API key, over TCP), an app server joins the call's sideband from the
//! `realtime.call.incoming` webhook, the answer is recorded and transcribed,
//! a keypad digit arrives as `input_audio_buffer.dtmf_event_received`, and
//! the caller's hang-up frees everything. Bad SIP and RTP from a raw UDP
//! peer get the right status codes, and the server stays healthy.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::Value;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use omnistream_e2e::{
    eventually, free_port, free_port_pair, metric_keyed, own_voice, resample, spawn_server,
    whisper_wer, Server, TempProfile,
};

const KEY: &str = "sip-test-key";
const RATE: u32 = 8_000;
/// The raw peer's address: on the server's allow-list, so no challenge.
const TRUSTED: &str = "127.0.0.2";

/// A `baresip` that dials once: its question from a WAV (then silence until
/// the file ends, when it hangs up), the answer recorded by its `sndfile`
/// module, commands over `ctrl_tcp`.
struct Baresip {
    child: Child,
    dir: tempfile::TempDir,
    ctrl: u16,
    log: Arc<Mutex<String>>,
}

impl Baresip {
    fn dial(uri: &str, password: &str, wav: &Path) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (sip, ctrl) = (free_port_pair(), free_port());
        std::fs::create_dir_all(dir.path().join("rec")).expect("rec dir");
        let config = format!(
            "poll_method epoll\n\
             sip_listen 127.0.0.1:{sip}\n\
             sip_transports udp,tcp\n\
             audio_player aubridge,speaker\n\
             audio_alert aubridge,speaker\n\
             audio_source aufile,{wav}\n\
             ausrc_srate 8000\nauplay_srate 8000\n\
             ausrc_channels 1\nauplay_channels 1\n\
             module_path /usr/lib/baresip/modules\n\
             module g711.so\nmodule aufile.so\nmodule aubridge.so\nmodule sndfile.so\n\
             module_app account.so\nmodule_app menu.so\nmodule_app ctrl_tcp.so\n\
             ctrl_tcp_listen 127.0.0.1:{ctrl}\n\
             snd_path {rec}\n",
            wav = wav.display(),
            rec = dir.path().join("rec").display(),
        );
        std::fs::write(dir.path().join("config"), config).expect("config");
        std::fs::write(
            dir.path().join("accounts"),
            format!("<sip:caller@127.0.0.1>;auth_user=caller;auth_pass={password};regint=0;audio_codecs=PCMU\n"),
        )
        .expect("accounts");
        let mut child = Command::new("baresip")
            .arg("-f")
            .arg(dir.path())
            .args(["-e", &format!("/dial {uri}"), "-t", "90"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("starting baresip (scripts/setup.sh installs baresip-core)");
        let log = Arc::new(Mutex::new(String::new()));
        for s in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(s).split(b'\n').map_while(Result::ok) {
                    let mut l = log.lock().expect("log");
                    l.push_str(&String::from_utf8_lossy(&line));
                    l.push('\n');
                }
            });
        }
        Self {
            child,
            dir,
            ctrl,
            log,
        }
    }

    fn log(&self) -> String {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// A `ctrl_tcp` command (a netstring of JSON); whether it succeeded.
    fn command(&self, command: &str, params: &str) -> bool {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.ctrl)) else {
            return false;
        };
        let msg =
            serde_json::json!({"command": command, "params": params, "token": "t"}).to_string();
        let _ = s.write_all(format!("{}:{msg},", msg.len()).as_bytes());
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).unwrap_or(0);
        String::from_utf8_lossy(&buf[..n]).contains("\"ok\":true")
    }

    /// What the caller heard (the decoded answer), once it hung up.
    fn heard(&self) -> PathBuf {
        std::fs::read_dir(self.dir.path().join("rec"))
            .expect("rec dir")
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.to_string_lossy().ends_with("-dec.wav"))
            .unwrap_or_else(|| panic!("no recording; baresip said:\n{}", self.log()))
    }

    fn wait(&mut self, limit: Duration) -> bool {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

impl Drop for Baresip {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP request's body, answered 200 (the app server's webhook); `None`
/// when none comes within `limit` (a blocking accept would hang the test run).
fn accept_hook(listener: &TcpListener, limit: Duration) -> Option<Value> {
    listener.set_nonblocking(true).expect("nonblocking");
    let until = Instant::now() + limit;
    let mut s = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(_) => return None,
        }
    };
    s.set_nonblocking(false).expect("blocking");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut reader = BufReader::new(s.try_clone().expect("clone"));
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("webhook headers");
        if line == "\r\n" || line.is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().expect("content-length");
        }
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).expect("webhook body");
    let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
    Some(serde_json::from_slice(&body).expect("webhook JSON"))
}

/// A raw SIP peer on UDP: requests in, responses out, nothing else.
struct Peer {
    sock: UdpSocket,
    server: SocketAddr,
}

impl Peer {
    fn new(ip: &str, server: SocketAddr) -> Self {
        let sock = UdpSocket::bind((ip, 0)).expect("bind the peer");
        sock.set_read_timeout(Some(Duration::from_millis(500)))
            .expect("timeout");
        Self { sock, server }
    }

    fn request(&self, method: &str, call: &str, cseq: u32, to_tag: &str, body: &str) -> String {
        let me = self.sock.local_addr().expect("addr");
        let ctype = if body.is_empty() {
            String::new()
        } else {
            "Content-Type: application/sdp\r\n".into()
        };
        format!(
            "{method} sip:agent@{server} SIP/2.0\r\n\
             Via: SIP/2.0/UDP {me};branch=z9hG4bK{call}{cseq}{method}\r\n\
             Max-Forwards: 70\r\n\
             From: <sip:peer@{me}>;tag=peer{call}\r\n\
             To: <sip:agent@{server}>{to_tag}\r\n\
             Call-ID: {call}\r\n\
             CSeq: {cseq} {method}\r\n\
             Contact: <sip:peer@{me}>\r\n\
             {ctype}Content-Length: {}\r\n\r\n{body}",
            body.len(),
            server = self.server,
        )
    }

    /// Sends `msg`; the final response (the provisional ones skipped).
    fn ask(&self, msg: &str) -> String {
        self.sock
            .send_to(msg.as_bytes(), self.server)
            .expect("send");
        let until = Instant::now() + Duration::from_secs(10);
        let mut buf = vec![0u8; 8192];
        while Instant::now() < until {
            let Ok((n, _)) = self.sock.recv_from(&mut buf) else {
                continue;
            };
            let r = String::from_utf8_lossy(&buf[..n]).to_string();
            if status(&r) >= 200 {
                return r;
            }
        }
        panic!("no final response to:\n{msg}");
    }
}

fn status(response: &str) -> u16 {
    response
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn header<'a>(msg: &'a str, name: &str) -> Option<&'a str> {
    msg.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

fn offer(rtp: SocketAddr, fmts: &str, maps: &str) -> String {
    format!(
        "v=0\r\no=- 1 1 IN IP4 {ip}\r\ns=-\r\nc=IN IP4 {ip}\r\nt=0 0\r\n\
         m=audio {port} RTP/AVP {fmts}\r\n{maps}a=sendrecv\r\n",
        ip = rtp.ip(),
        port = rtp.port()
    )
}

fn rtp_packet(pt: u8, seq: u16, payload: &[u8]) -> Vec<u8> {
    let mut p = vec![0x80, pt, (seq >> 8) as u8, seq as u8];
    p.extend_from_slice(&(u32::from(seq) * 160).to_be_bytes());
    p.extend_from_slice(&7u32.to_be_bytes());
    p.extend_from_slice(payload);
    p
}

/// A sample of `/metrics` (the server wants its key there).
fn metric(server: &Server, name: &str, labels: &[(&str, &str)]) -> f64 {
    metric_keyed(server, KEY, name, labels)
}

fn phone_errors(server: &Server, code: &str) -> f64 {
    metric(server, "omnistream_phone_errors_total", &[("code", code)])
}

fn sip_calls(server: &Server) -> f64 {
    metric(
        server,
        "omnistream_connections_open",
        &[("protocol", "sip")],
    )
}

/// Nothing of any call is left: connections, sessions, tasks.
fn idle(server: &Server) -> bool {
    eventually(15, || {
        sip_calls(server) == 0.0
            && metric(server, "omnistream_sessions_open", &[]) == 0.0
            && metric(server, "omnistream_tasks_open", &[]) == 0.0
    })
}

/// Bad SIP and RTP from a raw peer: each gets its status code (or is
/// dropped and counted), and a call still goes up and down cleanly.
fn raw_peer(server: &Server, sip: SocketAddr) {
    // Garbage is dropped; the server still answers.
    let peer = Peer::new(TRUSTED, sip);
    peer.sock
        .send_to(b"\x00\x01garbage\r\n\r\n", sip)
        .expect("send");
    peer.sock
        .send_to(b"INVITE nonsense\r\n\r\n", sip)
        .expect("send");
    let ok = peer.ask(&peer.request("OPTIONS", "opt1", 1, "", ""));
    assert_eq!(status(&ok), 200, "{ok}");
    assert!(
        header(&ok, "Allow").is_some_and(|a| a.contains("INVITE")),
        "{ok}"
    );

    // OPTIONS over TCP too.
    let mut tcp = TcpStream::connect(sip).expect("SIP over TCP");
    tcp.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let me = tcp.local_addr().expect("addr");
    let msg = format!(
        "OPTIONS sip:agent@{sip} SIP/2.0\r\nVia: SIP/2.0/TCP {me};branch=z9hG4bKtcp1\r\n\
         From: <sip:peer@{me}>;tag=t1\r\nTo: <sip:agent@{sip}>\r\nCall-ID: tcp1\r\n\
         CSeq: 1 OPTIONS\r\nContent-Length: 0\r\n\r\n"
    );
    tcp.write_all(msg.as_bytes()).expect("write");
    let mut buf = [0u8; 4096];
    let n = tcp.read(&mut buf).expect("a TCP response");
    let r = String::from_utf8_lossy(&buf[..n]);
    assert_eq!(status(&r), 200, "{r}");

    // A caller off the allow-list is challenged.
    let outsider = Peer::new("127.0.0.1", sip);
    let rtp_sock = UdpSocket::bind((TRUSTED, 0)).expect("rtp");
    let good = offer(
        rtp_sock.local_addr().expect("addr"),
        "0 101",
        "a=rtpmap:101 telephone-event/8000\r\n",
    );
    let r = outsider.ask(&outsider.request("INVITE", "c401", 1, "", &good));
    assert_eq!(status(&r), 401, "{r}");
    assert!(
        header(&r, "WWW-Authenticate")
            .is_some_and(|h| h.starts_with("Digest") && h.contains("nonce=")),
        "{r}"
    );

    // Offers that cannot be served; requests for no call; unknown methods.
    for (call, body, code) in [
        (
            "c400",
            "v=0\r\nc=IN IP4 not-an-ip\r\nm=audio 1 RTP/AVP 0\r\n",
            400,
        ),
        (
            "c488a",
            &*offer(
                rtp_sock.local_addr().expect("addr"),
                "96",
                "a=rtpmap:96 opus/48000/2\r\n",
            ),
            488,
        ),
        ("c488b", "", 488),
    ] {
        let r = peer.ask(&peer.request("INVITE", call, 1, "", body));
        assert_eq!(status(&r), code, "{call}: {r}");
        if code == 488 && !body.is_empty() {
            let w = header(&r, "Warning").unwrap_or_default();
            assert!(
                w.contains("opus/48000/2"),
                "the refusal names the offer: {r}"
            );
        }
    }
    let r = peer.ask(&peer.request("BYE", "nocall", 2, ";tag=x", ""));
    assert_eq!(status(&r), 481, "{r}");
    let r = peer.ask(&peer.request("SUBSCRIBE", "sub", 1, "", ""));
    assert_eq!(status(&r), 405, "{r}");
    assert!(phone_errors(server, "sip_no_common_codec") >= 1.0);
    assert!(phone_errors(server, "sip_bad_sdp") >= 1.0);

    // A call: 200 with our answer, RTP both ways.
    let r = peer.ask(&peer.request("INVITE", "call1", 1, "", &good));
    assert_eq!(status(&r), 200, "{r}");
    let to = header(&r, "To").expect("To").to_string();
    let tag = to.split(";tag=").nth(1).expect("a To tag").to_string();
    let sdp = r.split("\r\n\r\n").nth(1).expect("an SDP answer");
    assert!(sdp.contains("a=rtpmap:0 PCMU/8000"), "{sdp}");
    assert!(sdp.contains("telephone-event/8000"), "{sdp}");
    let port: u16 = sdp
        .lines()
        .find_map(|l| l.strip_prefix("m=audio "))
        .and_then(|m| m.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .expect("the answer's port");
    let ack = peer.request("ACK", "call1", 1, &format!(";tag={tag}"), "");
    peer.sock.send_to(ack.as_bytes(), sip).expect("ACK");
    let media = SocketAddr::new(sip.ip(), port);
    // The server sends 20 ms packets from the start (silence until it speaks).
    rtp_sock
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut got = 0;
    let t0 = Instant::now();
    let mut buf = [0u8; 2048];
    while got < 25 {
        let (n, from) = rtp_sock.recv_from(&mut buf).expect("RTP from the server");
        assert_eq!(from, media);
        assert_eq!((buf[0] >> 6, buf[1] & 0x7f, n), (2, 0, 12 + 160));
        got += 1;
    }
    let paced = t0.elapsed();
    assert!(
        paced >= Duration::from_millis(400),
        "25 packets in {paced:?}: not paced"
    );
    // RTP of another payload type, and from an address that is not the caller's.
    let wrong_pt = phone_errors(server, "rtp_wrong_payload_type");
    let wrong_src = phone_errors(server, "rtp_wrong_source");
    rtp_sock
        .send_to(&rtp_packet(0, 1, &[0xff; 160]), media)
        .expect("rtp");
    rtp_sock
        .send_to(&rtp_packet(8, 2, &[0xd5; 160]), media)
        .expect("rtp");
    let stranger = UdpSocket::bind(("127.0.0.3", 0)).expect("bind");
    stranger
        .send_to(&rtp_packet(0, 3, &[0xff; 160]), media)
        .expect("rtp");
    assert!(eventually(5, || phone_errors(
        server,
        "rtp_wrong_payload_type"
    ) > wrong_pt));
    assert!(eventually(5, || phone_errors(server, "rtp_wrong_source") > wrong_src));
    assert_eq!(sip_calls(server), 1.0);
    // The caller hangs up: everything is freed.
    let r = peer.ask(&peer.request("BYE", "call1", 2, &format!(";tag={tag}"), ""));
    assert_eq!(status(&r), 200, "{r}");
    assert!(idle(server), "a hung-up call left state");
}

#[test]
fn a_phone_calls_over_sip() {
    if Command::new("baresip").arg("-h").output().is_err() {
        panic!("baresip is not installed (scripts/setup.sh installs baresip-core)");
    }
    let hook = TcpListener::bind("127.0.0.1:0").expect("webhook port");
    let hook_url = format!("http://{}/hook", hook.local_addr().expect("addr"));
    let profile = TempProfile::with_server(
        "sip",
        &format!(
            "sip:\n  allow: [\"{TRUSTED}/32\"]\n  webhook: {hook_url}\n  \
             session: {{instructions: \"You answer phone calls. Answer in one short sentence.\"}}\n"
        ),
    );
    let sip_port = free_port();
    let sip_at = format!("127.0.0.1:{sip_port}");
    let server = spawn_server(&[
        "--profile",
        &profile.path,
        "--api-key",
        KEY,
        "--sip",
        &sip_at,
    ]);
    let sip: SocketAddr = sip_at.parse().expect("addr");
    assert!(
        server
            .output()
            .contains(&format!("omnistream sip ready on udp+tcp {sip_at}")),
        "{}",
        server.output()
    );
    raw_peer(&server, sip);

    // The question, as a phone line carries it, then silence for the answer.
    let dir = tempfile::tempdir().expect("tempdir");
    let (q, rate) = own_voice("What is the capital of France?", &dir.path().join("q.wav"));
    let mut audio = vec![0.0f32; RATE as usize / 2];
    audio.extend(resample(&q, rate, RATE));
    audio.extend(vec![0.0; RATE as usize * 24]);
    let wav = dir.path().join("q8k.wav");
    let mut w = hound::WavWriter::create(
        &wav,
        hound::WavSpec {
            channels: 1,
            sample_rate: RATE,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        },
    )
    .expect("wav");
    for s in &audio {
        w.write_sample((s.clamp(-1.0, 1.0) * 32767.0) as i16)
            .expect("sample");
    }
    w.finalize().expect("wav");

    // A wrong password: refused (403 after the challenge), nothing kept.
    let forbidden = phone_errors(&server, "sip_forbidden");
    let wrong = Baresip::dial(&format!("sip:agent@{sip_at}"), "guess", &wav);
    assert!(
        eventually(20, || phone_errors(&server, "sip_forbidden") > forbidden),
        "no refusal; baresip said:\n{}",
        wrong.log()
    );
    drop(wrong);
    assert_eq!(metric(&server, "omnistream_sessions_open", &[]), 0.0);

    // The real call, over TCP, with the API key as its password.
    let mut phone = Baresip::dial(&format!("sip:agent@{sip_at};transport=tcp"), KEY, &wav);
    // (The raw peer's call was announced first.)
    let event = loop {
        let Some(e) = accept_hook(&hook, Duration::from_secs(30)) else {
            panic!(
                "no realtime.call.incoming for baresip's call; baresip said:\n{}\nthe server said:\n{}",
                phone.log(),
                server.output()
            );
        };
        assert_eq!(e["type"], "realtime.call.incoming", "{e}");
        if e["data"]["sip_headers"].to_string().contains("caller@") {
            break e;
        }
    };
    let call_id = event["data"]["call_id"]
        .as_str()
        .expect("call_id")
        .to_string();
    let headers = event["data"]["sip_headers"].to_string();
    assert!(headers.contains("Call-ID"), "{headers}");

    // The app server joins the call's sideband.
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let events: Arc<Mutex<Vec<Value>>> = Arc::default();
    {
        let mut req = server
            .ws_url(&format!("/v1/realtime?call_id={call_id}"))
            .into_client_request()
            .expect("request");
        req.headers_mut().insert(
            "Authorization",
            format!("Bearer {KEY}").parse().expect("header"),
        );
        let (ws, _) = rt
            .block_on(async {
                tokio::time::timeout(
                    Duration::from_secs(30),
                    tokio_tungstenite::connect_async(req),
                )
                .await
            })
            .expect("the sideband within 30 s")
            .expect("the sideband");
        let events = events.clone();
        rt.spawn(async move {
            let (_sink, mut stream) = ws.split();
            while let Some(Ok(m)) = stream.next().await {
                if let Ok(v) = serde_json::from_str::<Value>(m.to_text().unwrap_or("")) {
                    events.lock().expect("events").push(v);
                }
            }
        });
    }
    let done = |n: usize| {
        let events = events.clone();
        move || {
            events
                .lock()
                .expect("events")
                .iter()
                .filter(|e| e["type"] == "response.done")
                .count()
                >= n
        }
    };
    assert!(
        eventually(90, done(1)),
        "no answer on the sideband: {:?}\nbaresip:\n{}",
        events.lock().expect("events"),
        phone.log()
    );
    // A key: the event, and an answer to it.
    assert!(
        phone.command("sndcode", "7"),
        "baresip did not send the key"
    );
    assert!(
        eventually(60, || events
            .lock()
            .expect("events")
            .iter()
            .any(
                |e| e["type"] == "input_audio_buffer.dtmf_event_received" && e["event"] == "7"
            )),
        "no dtmf event: {:?}",
        events.lock().expect("events")
    );
    assert!(eventually(90, done(2)), "the key was not answered");

    // The caller hangs up when its file ends (then quits, writing its
    // recording): everything is freed.
    assert!(
        eventually(60, || phone.log().contains("terminated")),
        "baresip did not hang up:\n{}",
        phone.log()
    );
    phone.command("quit", "");
    assert!(phone.wait(Duration::from_secs(10)), "baresip did not quit");
    assert!(idle(&server), "the call left state");
    // Its answers counted under SIP.
    let answered = metric(
        &server,
        "omnistream_requests_total",
        &[("endpoint", "sip"), ("outcome", "ok")],
    );
    assert!(answered >= 2.0, "{answered} answers counted under sip");

    // What the caller heard is what the model said.
    let said: Vec<String> = events
        .lock()
        .expect("events")
        .iter()
        .filter(|e| e["type"] == "response.output_audio_transcript.done")
        .filter_map(|e| e["transcript"].as_str().map(str::to_string))
        .collect();
    assert!(!said.is_empty(), "no transcripts on the sideband");
    let (wer, detail) = whisper_wer(&[(phone.heard(), said.join(" "))]);
    assert!(
        wer <= 0.35,
        "the answer heard on the phone: WER {wer}: {detail}"
    );
    println!("sip: WER {wer:.3} of the answer heard on the phone: {detail}");
    let _ = rt;
    drop(server);
}
