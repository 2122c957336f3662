//! Speech in: the user's audio through the pipeline's Listener stage (speech
//! recognition) as a request of its own, for every endpoint that hears.

use std::sync::Arc;

use omnistream_stages::engine::{
    Event, Modalities, RequestInput, RequestSpec, SamplingOverrides, StageRole,
};

use super::answer::{submit, Meter};
use super::error::ClientError;
use super::state::AppState;

/// Whether the pipeline can transcribe speech.
pub fn can_hear(state: &AppState) -> bool {
    state.pipeline.has_role(StageRole::Listener)
}

/// The words in `audio` (f32 at 16 kHz), trimmed; empty when none were
/// heard. Counts against the in-flight cap like any request, and in
/// `omnistream_requests_total` by the same outcomes; dropping the future
/// cancels it in the Listener.
pub async fn transcribe(
    state: &Arc<AppState>,
    endpoint: &'static str,
    audio: Vec<f32>,
) -> Result<String, ClientError> {
    let mut meter = Meter::new(&state.metrics, endpoint);
    if !can_hear(state) {
        return Err(meter.refuse(ClientError::invalid(
            "transcription_unavailable",
            "this server's pipeline has no speech recognition stage (see deploy/ for profiles with a listener)",
        )));
    }
    let spec = RequestSpec {
        input: RequestInput::Transcribe {
            audio: audio.into(),
        },
        modalities: Modalities::TEXT,
        sampling: SamplingOverrides::default(),
        voice: None,
        tools: None,
        style: Default::default(),
    };
    let (handle, _in_flight) = match submit(state, spec).await {
        Ok(h) => h,
        Err(e) => return Err(meter.refuse(e)),
    };
    let started = std::time::Instant::now();
    let mut text = String::new();
    let outcome = loop {
        match handle.next_event_async().await {
            Some(Event::TextDelta(t)) => text.push_str(&t),
            Some(Event::Done { .. }) => break Ok(()),
            Some(Event::Error(e)) => break Err(ClientError::server("transcription_failed", e)),
            Some(Event::Audio { .. } | Event::ToolCall(_)) => {}
            None => {
                break Err(ClientError::server(
                    "transcription_failed",
                    "the pipeline ended the transcription without a result",
                ))
            }
        }
    };
    meter.finish(if outcome.is_ok() { "ok" } else { "error" });
    state
        .metrics
        .transcribe_seconds
        .with_label_values(&[endpoint])
        .observe(started.elapsed().as_secs_f64());
    outcome.map(|()| text.trim().to_string())
}
