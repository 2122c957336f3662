//! `POST /v1/audio/speech`: the file's bytes as they are made, or
//! `speech.audio.delta` events over SSE.

use std::sync::Arc;

use axum::extract::Request;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::requests::{read_json, SpeechPlan, SpeechRequest};
use super::voices;
use super::Codec;
use super::{answer_body, b64, cut, refuse, sample_rate, sse, sse_end_error, sse_response, start};
use crate::serve::answer::Meter;
use crate::serve::conversation::End;
use crate::serve::error::ApiError;
use crate::serve::metrics::TaskGuard;
use crate::serve::state::AppState;
use crate::serve::voice_store::ClonedClip;

/// The request's cloned voice: a stored voice of the caller's (`voice:
/// "voice_…"`), or its own `ref_audio` clip (with `ref_text`, in context)
/// encoded now.
async fn cloned_voice(
    state: &AppState,
    owner: &str,
    body: &SpeechRequest,
) -> Result<Option<ClonedClip>, ApiError> {
    let param = |p: &'static str, e: ApiError| ApiError {
        param: Some(p),
        ..e
    };
    if let Some((clip, transcript)) = body.ref_audio()? {
        let Some(encoder) = &state.clip_encoder else {
            return Err(param(
                "ref_audio",
                ApiError::bad_request(
                    "voice_cloning_unsupported",
                    "this server's voice cannot be cloned: `ref_audio` needs a Qwen3-TTS Base checkpoint",
                ),
            ));
        };
        let transcript = voices::ref_text(encoder, transcript.map(str::to_string))?;
        let bytes = voices::ref_audio_bytes(clip)?;
        return Ok(Some(
            voices::clone_clip(encoder, &bytes, "ref_audio", transcript).await?,
        ));
    }
    let Some(id) = body.cloned_voice_id() else {
        return Ok(None);
    };
    match state.cloned_voice(owner, id) {
        Some(clip) => Ok(Some(clip)),
        None => Err(param(
            "voice",
            ApiError::bad_request("voice_not_found", format!("no cloned voice {id:?}")),
        )),
    }
}

pub(super) async fn handle(
    state: &Arc<AppState>,
    req: Request,
    meter: Meter,
) -> Result<Response, ApiError> {
    let plan = async {
        let owner = voices::caller(req.headers());
        let body: SpeechRequest = read_json(req).await?;
        let cloned = cloned_voice(state, &owner, &body).await?;
        let plan =
            SpeechPlan::from_request(body, &state.voices, state.pipeline.languages(), cloned)?;
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
