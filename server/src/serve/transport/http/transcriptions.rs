//! `POST /v1/audio/transcriptions`: an uploaded file through the pipeline's
//! Listener stage (`serve::listen`).

use std::sync::Arc;

use axum::extract::multipart::MultipartError;
use axum::extract::{DefaultBodyLimit, FromRequest, Multipart, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::json;

use omnistream_codecs::decode_ogg_opus;
use omnistream_codecs::wav::parse_wav;

use crate::serve::audio::resample;
use crate::serve::connections::{declared_length, too_slow};
use crate::serve::error::ApiError;
use crate::serve::listen::transcribe;
use crate::serve::state::AppState;

/// Largest upload (OpenAI's limit for this endpoint).
const MAX_UPLOAD_BYTES: usize = 25 << 20;
/// Longest audio taken in one request.
const MAX_UPLOAD_SECONDS: f64 = 600.0;
const EP_TRANSCRIBE: &str = "audio_transcriptions";

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/audio/transcriptions", post(transcriptions))
        .layer(DefaultBodyLimit::max(MAX_UPLOAD_BYTES))
}

/// The OpenAI transcription API: multipart `file` (WAV or Ogg Opus, any
/// rate), `model`, optional `response_format` (`json` or `text`) and
/// `language` (`en`: the recognizer is English-only).
async fn transcriptions(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let reply = async {
        // Refused from the header, before a byte of the body is read.
        if declared_length(req.headers()).is_some_and(|n| n > MAX_UPLOAD_BYTES as u64) {
            return Err(upload_too_large());
        }
        let mut form = Multipart::from_request(req, &state)
            .await
            .map_err(|e| ApiError {
                status: e.status(),
                kind: "invalid_request_error",
                code: "invalid_content_type",
                message: format!(
                    "{}: send multipart/form-data with a `file` field",
                    e.body_text()
                ),
                retry_after: None,
                param: None,
            })?;
        transcription(&state, &mut form).await
    };
    match reply.await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// 413 in the JSON error shape.
fn upload_too_large() -> ApiError {
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        kind: "invalid_request_error",
        code: "request_too_large",
        message: format!("the upload is larger than {} MB", MAX_UPLOAD_BYTES >> 20),
        retry_after: None,
        param: Some("file"),
    }
}

/// A multipart error: 413 past the size limit (a body sent without its
/// length), else 400.
pub(super) fn multipart_error(e: MultipartError, what: String) -> ApiError {
    if let Some(m) = too_slow(&e) {
        return ApiError::request_timeout(m);
    }
    if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return upload_too_large();
    }
    ApiError::bad_request("invalid_request", format!("{what}: {}", e.body_text()))
}

async fn transcription(state: &Arc<AppState>, form: &mut Multipart) -> Result<Response, ApiError> {
    let bad = |code: &'static str, m: String| ApiError::bad_request(code, m);
    let mut file = None;
    let mut format = "json".to_string();
    let mut model = None;
    while let Some(field) = form
        .next_field()
        .await
        .map_err(|e| multipart_error(e, "the multipart body is malformed".into()))?
    {
        let name = field.name().unwrap_or_default().to_string();
        let data = field
            .bytes()
            .await
            .map_err(|e| multipart_error(e, format!("reading field {name:?}")))?;
        let text = || String::from_utf8_lossy(&data).trim().to_string();
        match name.as_str() {
            "file" => file = Some(data),
            "model" => model = Some(text()),
            "response_format" => format = text(),
            "language" if matches!(text().as_str(), "en" | "english") => {}
            "language" => {
                return Err(bad(
                    "unsupported_language",
                    format!(
                        "language {:?}: this recognizer (Whisper tiny.en) hears English only",
                        text()
                    ),
                ))
            }
            // Decoding is greedy and unprompted; these only tune sampling.
            "prompt" | "temperature" => {}
            other => {
                return Err(bad(
                    "unknown_parameter",
                    format!("unknown field {other:?}: use file, model, response_format, language"),
                ))
            }
        }
    }
    if model.as_deref().is_none_or(str::is_empty) {
        return Err(bad("missing_model", "the `model` field is required".into()));
    }
    if !matches!(format.as_str(), "json" | "text") {
        return Err(bad(
            "unsupported_response_format",
            format!("response_format {format:?}: use json or text"),
        ));
    }
    let file = file.ok_or_else(|| bad("missing_file", "the `file` field is required".into()))?;
    let (samples, rate) = decode_upload(&file)?;
    let seconds = samples.len() as f64 / f64::from(rate.max(1));
    if seconds > MAX_UPLOAD_SECONDS {
        return Err(bad(
            "audio_too_long",
            format!("the audio is {seconds:.0} s; the limit is {MAX_UPLOAD_SECONDS:.0} s"),
        ));
    }
    let audio = resample(&samples, rate).map_err(|e| e.to_api())?;
    let text = transcribe(state, EP_TRANSCRIBE, audio)
        .await
        .map_err(|e| e.to_api())?;
    Ok(if format == "text" {
        ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], text).into_response()
    } else {
        Json(json!({"text": text})).into_response()
    })
}

/// WAV (any PCM layout hound reads) or Ogg Opus, told apart by their magic.
pub(super) fn decode_upload(bytes: &[u8]) -> Result<(Vec<f32>, u32), ApiError> {
    let bad = |what: &str, e: omnistream_codecs::CodecError| {
        ApiError::bad_request(
            "invalid_audio",
            format!("the {what} file is not valid: {e}"),
        )
    };
    match bytes.get(..4) {
        Some(b"RIFF") => parse_wav(bytes).map_err(|e| bad("WAV", e)),
        Some(b"OggS") => decode_ogg_opus(bytes).map_err(|e| bad("Ogg Opus", e)),
        _ => Err(ApiError::bad_request(
            "unsupported_audio_format",
            "the file is neither WAV nor Ogg Opus (the formats this server reads)",
        )),
    }
}
