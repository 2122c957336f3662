//! `POST /v1/audio/speech`: the file's bytes as they are made, or
//! `speech.audio.delta` events over SSE.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::requests::{read_json, SpeechPlan};
use super::Codec;
use super::{answer_body, b64, cut, refuse, sample_rate, sse, sse_end_error, sse_response, start};
use crate::serve::answer::Meter;
use crate::serve::conversation::End;
use crate::serve::error::ApiError;
use crate::serve::metrics::TaskGuard;
use crate::serve::state::AppState;

pub(super) async fn handle(
    state: &Arc<AppState>,
    req: Request,
    meter: Meter,
) -> Result<Response, ApiError> {
    let plan = async {
        let body = read_json(req).await?;
        let plan = SpeechPlan::from_request(body, &state.voices, state.pipeline.languages())?;
        sample_rate(state)?;
        Ok(plan)
    };
    let (plan, meter) = refuse(meter, plan.await)?;
    // The first audio (or a failure) before the status line is sent.
    let (answer, first) = start(state, meter, plan.spec, Some(plan.format), true, true).await?;
    let task = TaskGuard::new(&state.metrics);
    if plan.sse {
        return Ok(sse_response(answer_body(answer, first, SpeechSse, task)));
    }
    let body = answer_body(answer, first, SpeechRaw, task);
    Ok((
        [
            (header::CONTENT_TYPE, plan.format.content_type()),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response())
}

/// `stream_format: "audio"`: the file's bytes as the encoder makes them.
struct SpeechRaw;

impl Codec for SpeechRaw {
    fn text(&mut self, _: &str) -> Vec<u8> {
        Vec::new()
    }

    fn audio(&mut self, bytes: &[u8]) -> Vec<u8> {
        bytes.to_vec()
    }

    fn end(&mut self, end: End) -> Result<Vec<u8>, String> {
        match end {
            End::Completed(_) => Ok(Vec::new()),
            other => Err(cut(&other)),
        }
    }
}

/// `stream_format: "sse"`: `speech.audio.delta` events, then
/// `speech.audio.done` with the usage.
struct SpeechSse;

impl Codec for SpeechSse {
    fn text(&mut self, _: &str) -> Vec<u8> {
        Vec::new()
    }

    fn audio(&mut self, bytes: &[u8]) -> Vec<u8> {
        sse(&json!({"type": "speech.audio.delta", "audio": b64(bytes)}))
    }

    fn end(&mut self, end: End) -> Result<Vec<u8>, String> {
        let End::Completed(u) = end else {
            return sse_end_error(end);
        };
        Ok(sse(&json!({
            "type": "speech.audio.done",
            "usage": {
                "input_tokens": u.prompt_tokens,
                "output_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            },
        })))
    }
}
