//! Prometheus metrics (the `prometheus` crate): sessions, requests by outcome,
//! TTFT/TTFP/RTF histograms, bytes out, and the pipeline's per-stage counters
//! read at scrape time.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Latency buckets (seconds), fine where first-audio latency lives.
const LATENCY_BUCKETS: &[f64] = &[
    0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0,
];
const RTF_BUCKETS: &[f64] = &[0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0];

#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    pub sessions_open: IntGauge,
    pub connections_open: IntGaugeVec,
    pub tasks_open: IntGauge,
    pub requests_in_flight: IntGauge,
    pub requests: IntCounterVec,
    pub ttft: HistogramVec,
    pub ttfp: HistogramVec,
    pub rtf: HistogramVec,
    /// Speech recognition of one user turn, end to end through the Listener.
    pub transcribe_seconds: HistogramVec,
    /// A cloned voice's reference clip encoded, by `part`: `wait` (for its
    /// batch to start), `speaker` (its batch's x-vectors), `codes` (its
    /// batch's in-context codes).
    pub voice_encode_seconds: HistogramVec,
    /// Reference clips encoded together, per batch.
    pub voice_encode_batch_clips: Histogram,
    pub bytes_out: IntCounterVec,
    /// WebRTC frames of silence sent in the middle of an answer (generation
    /// slower than real time).
    pub webrtc_underrun_frames: IntCounter,
    /// Connections dropped because the client stopped reading.
    pub slow_clients: IntCounter,
    /// HTTP connections open (before any upgrade).
    pub http_connections: IntGauge,
    /// HTTP connections the server closed or refused, by reason.
    pub http_connections_closed: IntCounterVec,
    /// Errors on phone media streams, which have no error event, by code.
    pub phone_errors: IntCounterVec,
    stage: GaugeVec,
    replica: GaugeVec,
}

impl Metrics {
    pub fn new() -> prometheus::Result<Self> {
        let registry = Registry::new_custom(Some("omnistream".into()), None)?;
        let sessions_open = IntGauge::new("sessions_open", "Open sessions")?;
        let connections_open = IntGaugeVec::new(
            Opts::new("connections_open", "Open WebSocket/WebRTC connections"),
            &["protocol"],
        )?;
        let tasks_open = IntGauge::new(
            "tasks_open",
            "Server tasks alive (per connection and per request)",
        )?;
        let requests_in_flight = IntGauge::new("requests_in_flight", "Requests generating now")?;
        let requests = IntCounterVec::new(
            Opts::new("requests_total", "Requests by endpoint and outcome"),
            &["endpoint", "outcome"],
        )?;
        let hist = |name: &str, help: &str, buckets: &[f64]| {
            HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                &["endpoint"],
            )
        };
        let ttft = hist(
            "ttft_seconds",
            "Request start to first text delta",
            LATENCY_BUCKETS,
        )?;
        let ttfp = hist(
            "ttfp_seconds",
            "Request start to first audio bytes out",
            LATENCY_BUCKETS,
        )?;
        let rtf = hist(
            "audio_rtf",
            "(last audio chunk - start) / audio seconds",
            RTF_BUCKETS,
        )?;
        let transcribe_seconds = hist(
            "transcribe_seconds",
            "A user turn's audio handed to the Listener to its transcript",
            LATENCY_BUCKETS,
        )?;
        let voice_encode_seconds = HistogramVec::new(
            HistogramOpts::new(
                "voice_encode_seconds",
                "A reference clip to a cloned voice, by part: wait, speaker, codes",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
            &["part"],
        )?;
        let voice_encode_batch_clips = Histogram::with_opts(
            HistogramOpts::new(
                "voice_encode_batch_clips",
                "Reference clips encoded together in one batch",
            )
            .buckets(vec![1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0]),
        )?;
        let bytes_out = IntCounterVec::new(
            Opts::new("audio_bytes_out_total", "Audio bytes sent to clients"),
            &["endpoint"],
        )?;
        let stage = GaugeVec::new(
            Opts::new(
                "stage",
                "Per-stage engine counters (see the `metric` label)",
            ),
            &["stage", "metric"],
        )?;
        registry.register(Box::new(sessions_open.clone()))?;
        registry.register(Box::new(connections_open.clone()))?;
        registry.register(Box::new(tasks_open.clone()))?;
        registry.register(Box::new(requests_in_flight.clone()))?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(ttft.clone()))?;
        registry.register(Box::new(ttfp.clone()))?;
        registry.register(Box::new(rtf.clone()))?;
        registry.register(Box::new(transcribe_seconds.clone()))?;
        registry.register(Box::new(voice_encode_seconds.clone()))?;
        registry.register(Box::new(voice_encode_batch_clips.clone()))?;
        registry.register(Box::new(bytes_out.clone()))?;
        registry.register(Box::new(stage.clone()))?;
        let replica = GaugeVec::new(
            Opts::new(
                "stage_replica",
                "Per-replica engine counters (`replica`: index in-process, index/process id for a remote one)",
            ),
            &["stage", "replica", "metric"],
        )?;
        registry.register(Box::new(replica.clone()))?;
        let webrtc_underrun_frames = IntCounter::new(
            "webrtc_underrun_frames_total",
            "WebRTC 20 ms frames of silence sent mid-answer because its audio was late",
        )?;
        registry.register(Box::new(webrtc_underrun_frames.clone()))?;
        let slow_clients = IntCounter::new(
            "slow_clients_total",
            "Connections dropped because the client stopped reading their output",
        )?;
        registry.register(Box::new(slow_clients.clone()))?;
        let http_connections = IntGauge::new(
            "http_connections_open",
            "HTTP connections open (a WebSocket leaves this count once upgraded)",
        )?;
        registry.register(Box::new(http_connections.clone()))?;
        let http_connections_closed = IntCounterVec::new(
            Opts::new(
                "http_connections_closed_total",
                "HTTP connections the server closed or refused: header_timeout, \
                 body_timeout, evicted (idle, to make room at the cap), refused (at the cap)",
            ),
            &["reason"],
        )?;
        registry.register(Box::new(http_connections_closed.clone()))?;
        let phone_errors = IntCounterVec::new(
            Opts::new(
                "phone_errors_total",
                "Errors on phone media streams (logged; the protocol has no error event), by code",
            ),
            &["code"],
        )?;
        registry.register(Box::new(phone_errors.clone()))?;
        Ok(Self {
            registry,
            sessions_open,
            connections_open,
            tasks_open,
            requests_in_flight,
            requests,
            ttft,
            ttfp,
            rtf,
            transcribe_seconds,
            voice_encode_seconds,
            voice_encode_batch_clips,
            bytes_out,
            webrtc_underrun_frames,
            slow_clients,
            http_connections,
            http_connections_closed,
            phone_errors,
            stage,
            replica,
        })
    }

    /// Prometheus text exposition, with the pipeline's counters refreshed.
    /// The text exposition: these metrics, the pipeline's `stats`, and the
    /// WebRTC peers (`None` where WebRTC is off).
    pub fn render(
        &self,
        stats: &omnistream_stages::engine::PipelineStats,
        webrtc_peers: Option<usize>,
    ) -> String {
        // Replicas come and go (remote ones): only the live ones are shown.
        self.replica.reset();
        let all = stats
            .stages
            .iter()
            .map(|s| (s, None))
            .chain(stats.replicas.iter().map(|s| (s, Some(s.replica.as_str()))));
        for (s, replica) in all {
            let set = |m: &str, v: f64| match replica {
                None => self.stage.with_label_values(&[&s.name, m]).set(v),
                Some(r) => self.replica.with_label_values(&[&s.name, r, m]).set(v),
            };
            set("active_requests", s.active as f64);
            set("queue_depth", s.queue_depth as f64);
            set("cache_bytes", s.cache_bytes as f64);
            set("steps_total", s.steps as f64);
            set("step_seconds_total", s.step_seconds_total);
            set("batch_items_total", s.batch_items_total as f64);
            set("idle_seconds_total", s.idle_seconds_total);
            set("finished_total", s.finished as f64);
            set("cancelled_total", s.cancelled as f64);
            set("failed_total", s.failed as f64);
            set("alive", if s.alive { 1.0 } else { 0.0 });
            if s.wire_messages_in > 0 {
                set("wire_messages_in_total", s.wire_messages_in as f64);
                set("wire_bytes_in_total", s.wire_bytes_in as f64);
                set("wire_seconds_in_total", s.wire_seconds_in_total);
            }
        }
        let mut buf = Vec::new();
        if TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .is_err()
        {
            return String::new();
        }
        let mut text = String::from_utf8_lossy(&buf).into_owned();
        text.push_str(&format!(
            "# HELP omnistream_engine_requests_in_flight Engine requests whose client handle is alive\n\
             # TYPE omnistream_engine_requests_in_flight gauge\n\
             omnistream_engine_requests_in_flight {}\n",
            stats.requests_in_flight
        ));
        if let Some(w) = &stats.wire {
            for (name, help, v) in [
                (
                    "messages_out_total",
                    "Messages this gateway sent over NATS",
                    w.messages_out as f64,
                ),
                (
                    "bytes_out_total",
                    "Bytes this gateway sent over NATS",
                    w.bytes_out as f64,
                ),
                (
                    "events_in_total",
                    "Events from stage processes",
                    w.events_in as f64,
                ),
                (
                    "event_bytes_in_total",
                    "Bytes of events from stage processes",
                    w.event_bytes_in as f64,
                ),
                (
                    "event_seconds_total",
                    "Sum of the events' stage-to-gateway latencies (seconds)",
                    w.event_seconds_total,
                ),
            ] {
                text.push_str(&format!(
                    "# HELP omnistream_wire_{name} {help}\n# TYPE omnistream_wire_{name} counter\nomnistream_wire_{name} {v}\n"
                ));
            }
        }
        if let Some(peers) = webrtc_peers {
            text.push_str(&format!(
                "# HELP omnistream_webrtc_peers Live WebRTC peer connections\n\
                 # TYPE omnistream_webrtc_peers gauge\n\
                 omnistream_webrtc_peers {peers}\n"
            ));
        }
        // Memory as the kernel counts it (Linux), so a bench can report it.
        let (rss, peak) = process_memory();
        for (name, help, v) in [
            ("process_resident_bytes", "Resident memory now", rss),
            (
                "process_peak_resident_bytes",
                "Peak resident memory since start",
                peak,
            ),
        ] {
            if let Some(v) = v {
                text.push_str(&format!(
                    "# HELP omnistream_{name} {help}\n# TYPE omnistream_{name} gauge\nomnistream_{name} {v}\n"
                ));
            }
        }
        text
    }
}

/// (VmRSS, VmHWM) of this process in bytes, from /proc/self/status.
fn process_memory() -> (Option<u64>, Option<u64>) {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else {
        return (None, None);
    };
    let field = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// Counts a spawned task while it lives (for `omnistream_tasks_open`).
pub struct TaskGuard(IntGauge);

impl TaskGuard {
    pub fn new(m: &Metrics) -> Self {
        m.tasks_open.inc();
        Self(m.tasks_open.clone())
    }
}

impl Drop for TaskGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
