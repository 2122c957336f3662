//! One answer through the pipeline, as every endpoint that streams sees it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;

use omnistream_stages::engine::{
    CancelReason, EngineError, Event, RequestHandle, RequestSpec, TextFeed, ToolCall,
};

use super::audio::{AudioEncoder, OutputFormat};
use super::conversation::{End, Usage};
use super::error::{ApiError, ClientError};
use super::metrics::Metrics;
use super::sessions::InFlightGuard;
use super::shutdown;
use super::state::AppState;

/// What to send next.
pub enum Step {
    Text(String),
    /// A function call of the answer (complete; never spoken).
    ToolCall(ToolCall),
    /// pcm16 LE at the requested rate.
    Audio(Vec<u8>),
    End(End),
}

/// One request's metrics, the one definition every endpoint uses (the
/// connections' answers and the HTTP endpoints): TTFT (arrival to the first
/// text sent), TTFP (arrival to the first audio bytes sent), RTF (time of
/// the last audio made / the audio's length, completed requests only), the
/// audio bytes sent, and the outcome, counted once when the request ends (a
/// request dropped without one was abandoned by its client: `cancelled`).
pub struct Meter {
    metrics: Metrics,
    endpoint: &'static str,
    start: Instant,
    /// TTFT and TTFP are observed only where bytes leave as they are made.
    pub streaming: bool,
    text_seen: bool,
    audio_seen: bool,
    audio_seconds: f64,
    last_audio: Option<Instant>,
    outcome: Option<&'static str>,
}

impl Meter {
    pub fn new(metrics: &Metrics, endpoint: &'static str) -> Self {
        Self {
            metrics: metrics.clone(),
            endpoint,
            start: Instant::now(),
            streaming: true,
            text_seen: false,
            audio_seen: false,
            audio_seconds: 0.0,
            last_audio: None,
            outcome: None,
        }
    }

    /// Text went out to the client.
    pub fn text_out(&mut self) {
        if self.streaming && !self.text_seen {
            self.text_seen = true;
            self.metrics
                .ttft
                .with_label_values(&[self.endpoint])
                .observe(self.start.elapsed().as_secs_f64());
        }
    }

    /// The pipeline made `seconds` more of audio (the RTF's clock).
    pub fn audio_made(&mut self, seconds: f64) {
        self.audio_seconds += seconds;
        self.last_audio = Some(Instant::now());
    }

    /// `bytes` of audio went out to the client.
    pub fn audio_out(&mut self, bytes: usize) {
        if bytes == 0 {
            return;
        }
        if self.streaming && !self.audio_seen {
            self.audio_seen = true;
            self.metrics
                .ttfp
                .with_label_values(&[self.endpoint])
                .observe(self.start.elapsed().as_secs_f64());
        }
        self.metrics
            .bytes_out
            .with_label_values(&[self.endpoint])
            .inc_by(bytes as u64);
    }

    /// The request's outcome (replacing any set before).
    pub fn finish(&mut self, outcome: &'static str) {
        self.outcome = Some(outcome);
    }

    /// The request's outcome, unless it has one.
    pub fn finish_if_open(&mut self, outcome: &'static str) {
        self.outcome.get_or_insert(outcome);
    }

    /// Counts a request refused before it reached the pipeline by the
    /// error's outcome; hands the error back.
    pub fn refuse(mut self, error: ClientError) -> ClientError {
        self.finish_if_open(error.outcome());
        error
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        let outcome = self.outcome.unwrap_or("cancelled");
        self.metrics
            .requests
            .with_label_values(&[self.endpoint, outcome])
            .inc();
        if let Some(last) = self.last_audio.filter(|_| outcome == "ok") {
            if self.audio_seconds > 0.0 {
                self.metrics
                    .rtf
                    .with_label_values(&[self.endpoint])
                    .observe((last - self.start).as_secs_f64() / self.audio_seconds);
            }
        }
    }
}

/// What a connection keeps over its answer (a stateless HTTP request has
/// neither: its client cancels by going away).
pub struct Control {
    /// Set to `true` (or dropped) to cancel the answer.
    pub cancel: watch::Receiver<bool>,
    /// Set when the connection dropped its client as too slow.
    pub slow: Arc<AtomicBool>,
}

/// Why `Pipeline::submit` refused a request, in the client's terms.
fn submit_error(e: EngineError) -> ClientError {
    match e {
        EngineError::BadRequest(m) => ClientError::invalid("invalid_value", m),
        EngineError::Closed => ApiError::overloaded("the pipeline is shut down").into(),
        e @ EngineError::Unavailable(_) => ApiError::stage_unavailable(e.to_string()).into(),
        other => ClientError::server("internal_error", other.to_string()),
    }
}

/// Takes an in-flight slot and submits `spec` off the async workers
/// (`Pipeline::submit` may wait on a full connector). Shared by answers and
/// transcriptions.
pub async fn submit(
    state: &Arc<AppState>,
    spec: RequestSpec,
) -> Result<(RequestHandle, InFlightGuard), ClientError> {
    if state.shutdown.draining() {
        return Err(ClientError::shutting_down());
    }
    let in_flight = state.sessions.begin_request().map_err(ClientError::from)?;
    let st = state.clone();
    let handle = tokio::task::spawn_blocking(move || st.pipeline.submit(spec))
        .await
        .map_err(|e| ClientError::server("internal_error", e.to_string()))?
        .map_err(submit_error)?;
    Ok((handle, in_flight))
}

/// [`submit`] for a speech request whose text comes as it is written.
pub async fn submit_text_stream(
    state: &Arc<AppState>,
    spec: RequestSpec,
) -> Result<(RequestHandle, TextFeed, InFlightGuard), ClientError> {
    if state.shutdown.draining() {
        return Err(ClientError::shutting_down());
    }
    let in_flight = state.sessions.begin_request().map_err(ClientError::from)?;
    let st = state.clone();
    let (handle, feed) = tokio::task::spawn_blocking(move || st.pipeline.submit_text_stream(spec))
        .await
        .map_err(|e| ClientError::server("internal_error", e.to_string()))?
        .map_err(submit_error)?;
    Ok((handle, feed, in_flight))
}

/// One request through the pipeline as a client sees it: text deltas,
/// audio converted to the client's format, the end; measured by its
/// [`Meter`]. Every endpoint that answers uses it: the connections through
/// the driver, HTTP through its response bodies.
pub struct Answer {
    handle: Option<RequestHandle>,
    _in_flight: InFlightGuard,
    control: Option<Control>,
    meter: Meter,
    /// The client's audio format, when it wants audio.
    format: Option<OutputFormat>,
    encoder: Option<AudioEncoder>,
    /// Pipeline audio taken in, in seconds (what an Ogg Opus answer lasts).
    pipeline_seconds: f64,
    pending: Option<End>,
    out_bytes: u64,
    phase: shutdown::Watch,
}

impl Answer {
    /// Admits and submits the request. A refusal (over capacity, shutting
    /// down, a bad request) is counted by `meter` and returned.
    pub async fn start(
        state: &Arc<AppState>,
        meter: Meter,
        spec: RequestSpec,
        format: Option<OutputFormat>,
        control: Option<Control>,
    ) -> Result<Self, ClientError> {
        let (handle, in_flight) = match submit(state, spec).await {
            Ok(h) => h,
            Err(e) => return Err(meter.refuse(e)),
        };
        Ok(Self {
            handle: Some(handle),
            _in_flight: in_flight,
            control,
            phase: state.shutdown.watch(),
            meter,
            format,
            encoder: None,
            pipeline_seconds: 0.0,
            pending: None,
            out_bytes: 0,
        })
    }

    /// Seconds of audio handed out: exact for PCM (bytes at the client's
    /// rate), the pipeline's audio for Ogg Opus and MP3.
    pub fn audio_seconds(&self) -> f64 {
        match self.format {
            Some(OutputFormat::Pcm16 { rate } | OutputFormat::Wav { rate }) if rate > 0 => {
                self.out_bytes as f64 / 2.0 / f64::from(rate)
            }
            Some(OutputFormat::OggOpus | OutputFormat::Mp3 { .. }) => self.pipeline_seconds,
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

    /// Stops the request in every stage (cancelled, or the connection went
    /// away mid-answer).
    pub fn abandon(&mut self) {
        self.handle = None;
        self.record("cancelled");
    }

    /// [`Self::start`] for a speech request whose text comes as it is written,
    /// with the feed its text goes through.
    pub async fn start_text_stream(
        state: &Arc<AppState>,
        meter: Meter,
        spec: RequestSpec,
        format: Option<OutputFormat>,
    ) -> Result<(Self, TextFeed), ClientError> {
        let (handle, feed, in_flight) = match submit_text_stream(state, spec).await {
            Ok(h) => h,
            Err(e) => return Err(meter.refuse(e)),
        };
        let answer = Self {
            handle: Some(handle),
            _in_flight: in_flight,
            control: None,
            phase: state.shutdown.watch(),
            meter,
            format,
            encoder: None,
            pipeline_seconds: 0.0,
            pending: None,
            out_bytes: 0,
        };
        Ok((answer, feed))
    }

    /// Call after an audio step of `bytes` was queued for the client.
    pub fn sent_audio(&mut self, bytes: usize) {
        self.meter.audio_out(bytes);
    }

    /// Call after a text step was queued for the client.
    pub fn sent_text(&mut self) {
        self.meter.text_out();
    }

    /// The answer completed but its response could not be made (its whole
    /// file failed to encode): counted as an error.
    pub fn fail(&mut self) {
        self.meter.finish("error");
    }

    fn encode(&mut self, samples: &[f32], input_rate: u32) -> Result<Vec<u8>, String> {
        let Some(format) = self.format else {
            return Ok(Vec::new());
        };
        if self.encoder.is_none() {
            self.encoder = Some(AudioEncoder::new(format, input_rate).map_err(|e| e.to_string())?);
        }
        if input_rate > 0 {
            let seconds = samples.len() as f64 / f64::from(input_rate);
            self.pipeline_seconds += seconds;
            self.meter.audio_made(seconds);
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
        Step::Audio(pcm)
    }

    fn end(&mut self, end: End) -> Step {
        self.record(end.outcome());
        // Dropping the handle releases the request in every stage.
        self.handle = None;
        Step::End(end)
    }

    /// Counts the request once; a cancellation caused by dropping a slow
    /// client counts as `slow_client`.
    fn record(&mut self, outcome: &'static str) {
        let slow = self
            .control
            .as_ref()
            .is_some_and(|c| c.slow.load(Ordering::Acquire));
        let outcome = if outcome == "cancelled" && slow {
            "slow_client"
        } else {
            outcome
        };
        self.meter.finish_if_open(outcome);
    }

    pub async fn next(&mut self) -> Step {
        if let Some(end) = self.pending.take() {
            return self.end(end);
        }
        loop {
            let Some(handle) = self.handle.as_ref() else {
                return Step::End(End::Cancelled);
            };
            let cancelled = async {
                match self.control.as_mut() {
                    // A dropped sender cancels too.
                    Some(c) => drop(c.cancel.wait_for(|c| *c).await),
                    None => std::future::pending().await,
                }
            };
            let event = tokio::select! {
                biased;
                _ = cancelled => None,
                // At the server's close: cancelled, and a shutdown failure.
                e = self.phase.next_event(handle) => Some(e),
            };
            let Some(event) = event else {
                self.abandon();
                return Step::End(End::Cancelled);
            };
            match event {
                Some(Event::TextDelta(t)) => {
                    if t.is_empty() {
                        continue;
                    }
                    return Step::Text(t);
                }
                Some(Event::ToolCall(c)) => return Step::ToolCall(c),
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
