//! The server's part of a deploy profile: its `server:` section (keys, hosts,
//! the connection layer, WebRTC, the VAD for turns, the drain). The engine's
//! [`Profile`] keeps the section unread; the binary parses and checks it here,
//! with errors that name the file and the key, and hands the Listener its
//! speech filter ([`Profile::listener_vad`]).

use std::path::{Path, PathBuf};

use serde::Deserialize;

use omnistream_stages::profile::{Profile, ProfileError};

/// Loads a profile and its server section; the Listener is given the
/// server's VAD to hear through unless `server.vad.filter_transcriptions` is
/// false.
pub fn load(path: &Path) -> Result<(Profile, ServerSpec), ProfileError> {
    let mut profile = Profile::load(path)?;
    let server = ServerSpec::of(&profile)?;
    profile.listener_vad = server
        .vad
        .as_ref()
        .filter(|v| v.filter_transcriptions)
        .map(|v| profile.resolve(&v.model));
    Ok((profile, server))
}

impl ServerSpec {
    /// Parses and checks `profile`'s server section (defaults without one).
    pub fn of(profile: &Profile) -> Result<Self, ProfileError> {
        // No section is an empty one: serde's defaults (a drain of 25 s), not
        // the type's zeroes.
        let empty = serde_yaml_ng::Value::Mapping(Default::default());
        let section = profile.server.as_ref().unwrap_or(&empty).clone();
        let sv: ServerSpec =
            serde_yaml_ng::from_value(section).map_err(|e| ProfileError::Parse {
                file: profile.file.clone(),
                msg: format!("server: {e}"),
            })?;
        sv.validate(profile)?;
        Ok(sv)
    }

    fn validate(&self, profile: &Profile) -> Result<(), ProfileError> {
        for (alias, voice) in &self.voice_aliases {
            if alias.trim().is_empty() || voice.trim().is_empty() {
                return Err(profile.invalid(
                    "server.voice_aliases",
                    format!("an alias and its voice must both be named, got {alias:?}: {voice:?}"),
                ));
            }
        }
        let w = &self.webrtc;
        if let Some([lo, hi]) = w.udp_ports {
            if lo == 0 || hi < lo {
                return Err(profile.invalid(
                    "server.webrtc.udp_ports",
                    format!("expected [first, last] with 0 < first <= last, got [{lo}, {hi}]"),
                ));
            }
        }
        for (i, ice) in w.ice_servers.iter().enumerate() {
            let bad = ice.urls.is_empty()
                || ice.urls.iter().any(|u| {
                    !["stun:", "stuns:", "turn:", "turns:"]
                        .iter()
                        .any(|p| u.starts_with(p))
                });
            if bad {
                return Err(profile.invalid(
                    format!("server.webrtc.ice_servers[{i}].urls"),
                    "expected one or more stun:, stuns:, turn: or turns: URLs",
                ));
            }
        }
        self.sip.validate(profile)?;
        let c = &self.connections;
        for (k, v, max) in [
            ("connections.header_timeout_s", c.header_timeout_s, 3600.0),
            ("connections.body_timeout_s", c.body_timeout_s, 3600.0),
            ("drain_s", self.drain_s, 3600.0),
        ] {
            let zero_ok = k == "drain_s";
            let ok = v.is_finite() && v <= max && (v > 0.0 || zero_ok && v == 0.0);
            if !ok {
                let low = if zero_ok { "[0" } else { "(0" };
                return Err(profile.invalid(
                    format!("server.{k}"),
                    format!("expected seconds in {low}, {max}], got {v}"),
                ));
            }
        }
        if c.min_body_rate == 0 {
            return Err(profile.invalid(
                "server.connections.min_body_rate",
                "expected bytes per second > 0",
            ));
        }
        if let Some(v) = &self.vad {
            let p = profile.resolve(&v.model);
            if !p.is_file() {
                return Err(profile.invalid(
                    "server.vad.model",
                    format!(
                        "{} does not exist (run `omnistream fetch-models`)",
                        p.display()
                    ),
                ));
            }
            for (k, ms) in [
                ("min_speech_ms", v.min_speech_ms),
                ("echo_guard_ms", v.echo_guard_ms),
            ] {
                if ms > 10_000 {
                    return Err(profile.invalid(
                        format!("server.vad.{k}"),
                        format!("{ms} ms is over the 10000 ms limit"),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The profile's `server:` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerSpec {
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// Browser origins (`scheme://host:port`) allowed besides the server's own;
    /// `*` allows any.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// Host names clients may reach the server by, besides `localhost` and IP
    /// addresses (DNS rebinding always comes with a name); `*` allows any.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    #[serde(default)]
    pub webrtc: WebRtcSpec,
    /// SIP calls answered by the server itself (off unless `listen` is set,
    /// here or with `omnistream serve --sip`).
    #[serde(default)]
    pub sip: SipSpec,
    /// Voice activity detection for `server_vad` turn detection; without it
    /// clients commit their turns themselves.
    #[serde(default)]
    pub vad: Option<VadSpec>,
    /// Timeouts and caps of the connection layer (before any request is read).
    #[serde(default)]
    pub connections: ConnectionSpec,
    /// After SIGTERM or SIGINT, how long answers in flight may take to finish
    /// (seconds) before they are cancelled and the process exits.
    #[serde(default = "default_drain_s")]
    pub drain_s: f64,
    /// Other names for the pipeline's voices (`alloy: chelsie`): apps written
    /// for OpenAI hard-code its voice names. Every OpenAI voice not named
    /// here speaks in the pipeline's default voice.
    #[serde(default)]
    pub voice_aliases: std::collections::BTreeMap<String, String>,
    /// Where cloned voices (`POST /v1/audio/voices`) are kept, relative to
    /// the profile's folder; default `data/voices` in the working directory.
    #[serde(default)]
    pub voice_store: Option<std::path::PathBuf>,
}

fn default_drain_s() -> f64 {
    // Under Kubernetes' default 30 s grace period, with room to close.
    25.0
}

/// The connection layer: what a client may hold open, and for how long,
/// before it has sent a request (checked before the key: it is not read yet).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionSpec {
    /// Seconds a connection may take to send a request's headers, counted from
    /// the moment it waits for one: a new connection, or a kept-alive one
    /// between requests (so this is the idle keep-alive timeout too).
    #[serde(default = "default_header_timeout_s")]
    pub header_timeout_s: f64,
    /// Request bodies: this many seconds of grace, after which a body must
    /// keep arriving at `min_body_rate` bytes/s on average (or is cut, 408).
    #[serde(default = "default_body_timeout_s")]
    pub body_timeout_s: f64,
    #[serde(default = "default_min_body_rate")]
    pub min_body_rate: u64,
    /// Open HTTP connections in total; 0 = half the open-file limit, at most
    /// 4096. WebSockets count against the session caps instead, once upgraded.
    #[serde(default)]
    pub max: usize,
    /// Open HTTP connections per client address; 0 = no cap (behind a load
    /// balancer every client has its address).
    #[serde(default = "default_max_per_client")]
    pub max_per_client: usize,
}

impl Default for ConnectionSpec {
    fn default() -> Self {
        Self {
            header_timeout_s: default_header_timeout_s(),
            body_timeout_s: default_body_timeout_s(),
            min_body_rate: default_min_body_rate(),
            max: 0,
            max_per_client: default_max_per_client(),
        }
    }
}

fn default_header_timeout_s() -> f64 {
    10.0
}
fn default_body_timeout_s() -> f64 {
    10.0
}
fn default_min_body_rate() -> u64 {
    // 64 kbit/s: a phone on a poor link still uploads 25 MB in under an hour.
    8 * 1024
}
fn default_max_per_client() -> usize {
    256
}

/// Silero VAD for turn detection and for the Listener's speech filter, and
/// the knobs that suit the audio path (clients set threshold, padding and
/// silence per session).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VadSpec {
    /// The 16 kHz Silero VAD safetensors, relative to the profile's folder.
    pub model: PathBuf,
    /// Speech needed without a gap before a turn starts (ms): longer ignores
    /// clicks and short echoes.
    #[serde(default = "default_min_speech_ms")]
    pub min_speech_ms: u32,
    /// After an answer starts playing, speech is not taken as an interruption
    /// for this long (ms): for speakerphones and telephony, where the answer
    /// comes back in the microphone. 0 for headsets and browsers with echo
    /// cancellation.
    #[serde(default)]
    pub echo_guard_ms: u32,
    /// The Listener hears only the speech this model finds in its audio
    /// (faster-whisper's `vad_filter`): silence and noise are not transcribed.
    #[serde(default = "default_filter_transcriptions")]
    pub filter_transcriptions: bool,
}

fn default_min_speech_ms() -> u32 {
    250
}

fn default_filter_transcriptions() -> bool {
    true
}

/// WebRTC peers (`POST /v1/webrtc`): ICE servers for clients behind NAT and
/// the address a server behind NAT should advertise.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebRtcSpec {
    /// STUN/TURN servers, as in the browser's `RTCIceServer`.
    #[serde(default)]
    pub ice_servers: Vec<IceServerSpec>,
    /// Public IPs to advertise instead of the host's own (1:1 NAT).
    #[serde(default)]
    pub public_ips: Vec<std::net::IpAddr>,
    /// UDP ports for ICE, `[first, last]`; empty = any ephemeral port.
    #[serde(default)]
    pub udp_ports: Option<[u16; 2]>,
    /// How long a new answer is held after its first audio arrives before it
    /// plays on the track (ms, a jitter buffer): more delays the first audio,
    /// less risks holes mid-answer when generation comes in bursts.
    #[serde(default = "default_playout_lead_ms")]
    pub playout_lead_ms: u64,
}

fn default_playout_lead_ms() -> u64 {
    // Measured on the tiny CPU pipeline (docs/bench/webrtc.md): 1 s is the
    // shortest hold with no holes mid-answer at 1 and 2 concurrent calls.
    1000
}

impl Default for WebRtcSpec {
    fn default() -> Self {
        Self {
            ice_servers: vec![],
            public_ips: vec![],
            udp_ports: None,
            playout_lead_ms: default_playout_lead_ms(),
        }
    }
}

/// `server.sip`: the server answers SIP calls (UDP and TCP on one port).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SipSpec {
    /// `host:port` to listen on, UDP and TCP (`0.0.0.0:5060`); port 0 picks
    /// one. Unset: no SIP.
    #[serde(default)]
    pub listen: Option<String>,
    /// The address SDP and Contact advertise (1:1 NAT); default: the local
    /// address the caller's packets reach.
    #[serde(default)]
    pub public_ip: Option<std::net::IpAddr>,
    /// UDP ports for calls' RTP, `[first, last]`; default: any free port.
    #[serde(default)]
    pub rtp_ports: Option<[u16; 2]>,
    /// Callers let in by address, as CIDRs (`203.0.113.0/24`, `::1/128`): a
    /// SIP trunk's signalling IPs. Anyone else must answer the digest
    /// challenge with an API key as the password (when the server has keys).
    #[serde(default)]
    pub allow: Vec<String>,
    /// The digest challenge's realm.
    #[serde(default = "default_sip_realm")]
    pub realm: String,
    /// The Realtime session configuration each call starts with (what a
    /// `session.update` takes: instructions, voice, turn_detection, ...).
    #[serde(default)]
    pub session: Option<serde_json::Value>,
    /// Where each answered call is announced (`realtime.call.incoming`,
    /// POSTed as OpenAI's SIP calls do): the call id an app server joins the
    /// call's sideband with.
    #[serde(default)]
    pub webhook: Option<String>,
    /// How long a new answer is held after its first audio arrives before it
    /// plays (ms), as `server.webrtc.playout_lead_ms`.
    #[serde(default = "default_playout_lead_ms")]
    pub playout_lead_ms: u64,
    /// Most calls at once (each is a session too, under `--max-sessions`).
    #[serde(default = "default_sip_max_calls")]
    pub max_calls: usize,
}

fn default_sip_realm() -> String {
    "omnistream".into()
}

fn default_sip_max_calls() -> usize {
    64
}

impl Default for SipSpec {
    fn default() -> Self {
        Self {
            listen: None,
            public_ip: None,
            rtp_ports: None,
            allow: vec![],
            realm: default_sip_realm(),
            session: None,
            webhook: None,
            playout_lead_ms: default_playout_lead_ms(),
            max_calls: default_sip_max_calls(),
        }
    }
}

impl SipSpec {
    fn validate(&self, profile: &Profile) -> Result<(), ProfileError> {
        if let Some(l) = &self.listen {
            if l.parse::<std::net::SocketAddr>().is_err() {
                return Err(profile.invalid(
                    "server.sip.listen",
                    format!("expected ip:port (0.0.0.0:5060), got {l:?}"),
                ));
            }
        }
        if let Some([lo, hi]) = self.rtp_ports {
            if lo == 0 || hi < lo {
                return Err(profile.invalid(
                    "server.sip.rtp_ports",
                    format!("expected [first, last] with 0 < first <= last, got [{lo}, {hi}]"),
                ));
            }
        }
        for (i, cidr) in self.allow.iter().enumerate() {
            if let Err(e) = Cidr::parse(cidr) {
                return Err(profile.invalid(format!("server.sip.allow[{i}]"), e));
            }
        }
        if self.realm.is_empty() || self.realm.contains('"') {
            return Err(profile.invalid(
                "server.sip.realm",
                "expected a non-empty realm without quotes",
            ));
        }
        if self.max_calls == 0 {
            return Err(profile.invalid("server.sip.max_calls", "expected at least 1"));
        }
        if let Some(w) = &self.webhook {
            if !(w.starts_with("http://") || w.starts_with("https://")) {
                return Err(profile.invalid(
                    "server.sip.webhook",
                    format!("expected an http:// or https:// URL, got {w:?}"),
                ));
            }
        }
        Ok(())
    }
}

/// An address block (`10.0.0.0/8`); a bare address is a block of one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    net: std::net::IpAddr,
    bits: u8,
}

impl Cidr {
    pub fn parse(s: &str) -> Result<Self, String> {
        let (addr, bits) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let net: std::net::IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("{s:?} is not an address or CIDR block"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            None => max,
            Some(b) => b
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|b| *b <= max)
                .ok_or_else(|| format!("{s:?}: the prefix length is 0-{max}"))?,
        };
        Ok(Self { net, bits })
    }

    pub fn contains(&self, ip: std::net::IpAddr) -> bool {
        use std::net::IpAddr;
        // An IPv4 caller on a dual-stack socket arrives as ::ffff:a.b.c.d.
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.bits)).unwrap_or(0);
                u32::from(n) & mask == u32::from(a) & mask
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.bits))
                    .unwrap_or(0);
                u128::from(n) & mask == u128::from(a) & mask
            }
            _ => false,
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IceServerSpec {
    /// `stun:host:port`, `turn:host:port?transport=udp`, ...
    pub urls: Vec<String>,
    #[serde(default)]
    pub username: Option<String>,
    #[serde(default)]
    pub credential: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A profile whose model files exist (empty files: loading is not tested here).
    fn fixture() -> (tempfile::TempDir, PathBuf, String) {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.gguf", "v.onnx", "v.onnx.json", "vad.safetensors"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let yaml = r#"
name: t
async_chunk: true
stages:
  - { stage_id: 0, name: thinker, kind: ar, model: { type: gguf-llama, path: m.gguf }, max_num_seqs: 4, sampling: { temperature: 0.0 } }
  - { stage_id: 1, name: talker, kind: generation, model: { type: piper-talker, path: v.onnx, config: v.onnx.json }, max_num_seqs: 2 }
  - { stage_id: 2, name: code2wav, kind: generation, model: { type: piper-decoder, path: v.onnx }, max_num_seqs: 2 }
"#
        .to_string();
        let path = dir.path().join("p.yaml");
        (dir, path, yaml)
    }

    fn parse(yaml: &str, path: &Path) -> Result<ServerSpec, ProfileError> {
        ServerSpec::of(&Profile::parse(yaml, path)?)
    }

    fn err(yaml: &str, path: &Path) -> String {
        parse(yaml, path).unwrap_err().to_string()
    }

    #[test]
    fn connection_limits_and_the_drain_are_checked() {
        let (_dir, path, yaml) = fixture();
        let d = parse(&yaml, &path).unwrap();
        assert_eq!(d.connections.header_timeout_s, 10.0);
        assert_eq!(d.connections.max_per_client, 256);
        let with = |server: &str| format!("{yaml}\nserver:\n{server}\n");
        let s = parse(
            &with(
                "  drain_s: 0\n  connections: {header_timeout_s: 2, max: 100, max_per_client: 0}",
            ),
            &path,
        )
        .unwrap();
        assert_eq!((s.drain_s, s.connections.max), (0.0, 100));
        for (bad, key) in [
            ("  drain_s: -1", "server.drain_s"),
            (
                "  connections: {header_timeout_s: 0}",
                "server.connections.header_timeout_s",
            ),
            (
                "  connections: {body_timeout_s: .nan}",
                "server.connections.body_timeout_s",
            ),
            (
                "  connections: {min_body_rate: 0}",
                "server.connections.min_body_rate",
            ),
            ("  connections: {max_conns: 3}", "max_conns"),
        ] {
            let e = err(&with(bad), &path);
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn the_vad_is_checked_and_given_to_the_listener() {
        let (dir, path, yaml) = fixture();
        let with = |server: &str| format!("{yaml}\nserver:\n{server}\n");
        std::fs::write(&path, with("  vad: {model: vad.safetensors}")).unwrap();
        let (p, s) = load(&path).unwrap();
        assert_eq!(s.vad.unwrap().min_speech_ms, 250);
        assert_eq!(p.listener_vad, Some(dir.path().join("vad.safetensors")));
        let off = "  vad: {model: vad.safetensors, filter_transcriptions: false}";
        std::fs::write(&path, with(off)).unwrap();
        assert_eq!(load(&path).unwrap().0.listener_vad, None);
        std::fs::write(&path, &yaml).unwrap();
        assert_eq!(load(&path).unwrap().0.listener_vad, None);
        for (bad, key) in [
            ("  vad: {model: nowhere.safetensors}", "server.vad.model"),
            (
                "  vad: {model: vad.safetensors, echo_guard_ms: 20000}",
                "server.vad.echo_guard_ms",
            ),
            ("  webrtc: {udp_ports: [10, 5]}", "server.webrtc.udp_ports"),
            ("  apikeys: [a]", "apikeys"),
        ] {
            let e = err(&with(bad), &path);
            assert!(e.contains(key) && e.contains("p.yaml"), "{bad}: {e}");
        }
    }
}
