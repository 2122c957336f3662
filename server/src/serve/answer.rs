//! One answer through the pipeline, as every endpoint that streams sees it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;

use omnistream_stages::engine::{CancelReason, Event, RequestHandle, RequestSpec};

use super::audio::{AudioEncoder, OutputFormat};
use super::conversation::{End, Usage};
use super::error::ClientError;
use super::metrics::Metrics;
use super::sessions::InFlightGuard;
use super::shutdown;
use super::state::AppState;

/// What to send next.
pub enum Step {
    Text(String),
    /// pcm16 LE at the requested rate.
    Audio(Vec<u8>),
    End(End),
}

/// One request through the pipeline as a client sees it: text deltas,
/// audio converted to the client's format, the end; and the one definition
/// of its metrics: TTFT (first text), TTFP (first audio handed to the
/// client), RTF (time of the last audio / its length) and its outcome.
pub struct Answer {
    handle: Option<RequestHandle>,
    _in_flight: InFlightGuard,
    /// Set when the connection it answers dropped its client as too slow.
    slow: Arc<AtomicBool>,
    cancel: watch::Receiver<bool>,
    metrics: Metrics,
    endpoint: &'static str,
    /// The client's audio format, when it wants audio.
    format: Option<OutputFormat>,
    encoder: Option<AudioEncoder>,
    /// Pipeline audio taken in, in seconds (what an Ogg Opus answer lasts).
    pipeline_seconds: f64,
    pending: Option<End>,
    started: Instant,
    first_text: bool,
    first_audio: bool,
    last_audio: Option<Instant>,
    out_bytes: u64,
    finished: bool,
    phase: shutdown::Watch,
}

impl Answer {
    /// Admits and submits the request (errors: over capacity, bad request).
    pub fn start(
        state: &AppState,
        slow: Arc<AtomicBool>,
        endpoint: &'static str,
        spec: RequestSpec,
        format: Option<OutputFormat>,
        cancel: watch::Receiver<bool>,
    ) -> Result<Self, ClientError> {
        if state.shutdown.draining() {
            return Err(ClientError::shutting_down());
        }
        let in_flight = state.sessions.begin_request().map_err(ClientError::from)?;
        let handle = state.pipeline.submit(spec).map_err(|e| match e {
            omnistream_stages::engine::EngineError::BadRequest(m) => {
                ClientError::invalid("invalid_request", m)
            }
            e @ omnistream_stages::engine::EngineError::Unavailable(_) => {
                ClientError::server("stage_unavailable", e.to_string())
            }
            other => ClientError::server("engine_unavailable", other.to_string()),
        })?;
        Ok(Self {
            handle: Some(handle),
            _in_flight: in_flight,
            slow,
            cancel,
            phase: state.shutdown.watch(),
            metrics: state.metrics.clone(),
            endpoint,
            format,
            encoder: None,
            pipeline_seconds: 0.0,
            pending: None,
            started: Instant::now(),
            first_text: true,
            first_audio: true,
            last_audio: None,
            out_bytes: 0,
            finished: false,
        })
    }

    /// Seconds of audio handed out: exact for PCM (bytes at the client's
    /// rate), the pipeline's audio for Ogg Opus.
    pub fn audio_seconds(&self) -> f64 {
        match self.format {
            Some(OutputFormat::Pcm16 { rate } | OutputFormat::Wav { rate }) if rate > 0 => {
                self.out_bytes as f64 / 2.0 / f64::from(rate)
            }
            Some(OutputFormat::OggOpus) => self.pipeline_seconds,
            _ => 0.0,
        }
    }

    /// After a cancelled answer: the end of an Ogg Opus stream (its last
    /// pages, end-of-stream flag set), so what the client saved is still a
    /// valid file. Nothing for PCM, whose bytes need no closing.
    pub fn seal(&mut self) -> Vec<u8> {
        if self.format != Some(OutputFormat::OggOpus) {
            return Vec::new();
        }
        self.flush().unwrap_or_default()
    }

    /// Stops the request in every stage.
    pub fn cancel(&mut self) {
        self.handle = None;
        self.record("cancelled");
    }

    /// The connection went away mid-answer: stops the request.
    pub fn abandon(&mut self) {
        self.handle = None;
        self.record("cancelled");
    }

    /// Call after an audio step was queued for the client (TTFP).
    pub fn sent_audio(&mut self) {
        if self.first_audio && self.out_bytes > 0 {
            self.first_audio = false;
            self.metrics
                .ttfp
                .with_label_values(&[self.endpoint])
                .observe(self.started.elapsed().as_secs_f64());
        }
    }

    fn encode(&mut self, samples: &[f32], input_rate: u32) -> Result<Vec<u8>, String> {
        let Some(format) = self.format else {
            return Ok(Vec::new());
        };
        if self.encoder.is_none() {
            self.encoder = Some(AudioEncoder::new(format, input_rate).map_err(|e| e.to_string())?);
        }
        if input_rate > 0 {
            self.pipeline_seconds += samples.len() as f64 / f64::from(input_rate);
        }
        match self.encoder.as_mut() {
            Some(e) => e.push(samples).map_err(|e| e.to_string()),
            None => Ok(Vec::new()),
        }
    }

    fn flush(&mut self) -> Result<Vec<u8>, String> {
        match self.encoder.take() {
            Some(mut e) => e.finish().map_err(|e| e.to_string()),
            None => Ok(Vec::new()),
        }
    }

    fn audio(&mut self, pcm: Vec<u8>) -> Step {
        self.out_bytes += pcm.len() as u64;
        self.last_audio = Some(Instant::now());
        self.metrics
            .bytes_out
            .with_label_values(&[self.endpoint])
            .inc_by(pcm.len() as u64);
        Step::Audio(pcm)
    }

    fn end(&mut self, end: End) -> Step {
        let outcome = end.outcome();
        if matches!(end, End::Completed(_)) {
            let secs = self.audio_seconds();
            if let Some(last) = self.last_audio.filter(|_| secs > 0.0) {
                self.metrics
                    .rtf
                    .with_label_values(&[self.endpoint])
                    .observe((last - self.started).as_secs_f64() / secs);
            }
        }
        self.record(outcome);
        // Dropping the handle releases the request in every stage.
        self.handle = None;
        Step::End(end)
    }

    /// Counts the request once; a cancellation caused by dropping a slow
    /// client counts as `slow_client`.
    fn record(&mut self, outcome: &str) {
        let outcome = if outcome == "cancelled" && self.slow.load(Ordering::Acquire) {
            "slow_client"
        } else {
            outcome
        };
        if !self.finished {
            self.finished = true;
            self.metrics
                .requests
                .with_label_values(&[self.endpoint, outcome])
                .inc();
        }
    }

    pub async fn next(&mut self) -> Step {
        if let Some(end) = self.pending.take() {
            return self.end(end);
        }
        loop {
            let Some(handle) = self.handle.as_ref() else {
                return Step::End(End::Cancelled);
            };
            let event = tokio::select! {
                biased;
                _ = self.cancel.wait_for(|c| *c) => None,
                // At the server's close: cancelled, and a shutdown failure.
                e = self.phase.next_event(handle) => Some(e),
            };
            let Some(event) = event else {
                self.cancel();
                return Step::End(End::Cancelled);
            };
            match event {
                Some(Event::TextDelta(t)) => {
                    if t.is_empty() {
                        continue;
                    }
                    if self.first_text {
                        self.first_text = false;
                        self.metrics
                            .ttft
                            .with_label_values(&[self.endpoint])
                            .observe(self.started.elapsed().as_secs_f64());
                    }
                    return Step::Text(t);
                }
                Some(Event::Audio {
                    samples,
                    sample_rate,
                    ..
                }) => match self.encode(&samples, sample_rate) {
                    Ok(pcm) if pcm.is_empty() => continue,
                    Ok(pcm) => return self.audio(pcm),
                    Err(e) => return self.end(End::Failed(format!("audio conversion: {e}"))),
                },
                Some(Event::Done {
                    prompt_tokens,
                    cached_tokens,
                    completion_tokens,
                }) => {
                    let end = End::Completed(Usage {
                        prompt_tokens,
                        cached_tokens,
                        completion_tokens,
                    });
                    return match self.flush() {
                        Ok(tail) if !tail.is_empty() => {
                            self.pending = Some(end);
                            self.audio(tail)
                        }
                        Ok(_) => self.end(end),
                        Err(e) => self.end(End::Failed(format!("audio conversion: {e}"))),
                    };
                }
                Some(Event::Error(e)) => {
                    let slow = handle.cancel_reason() == CancelReason::SlowClient;
                    return self.end(if slow {
                        End::SlowClient
                    } else {
                        End::Failed(e)
                    });
                }
                None => {
                    return self.end(End::Failed(
                        "the pipeline ended the request without a result".into(),
                    ))
                }
            }
        }
    }
}
