//! Cloned voices, on OpenAI's shapes: `POST /v1/audio/voices` (multipart
//! `name`, `audio_sample`, `consent`, and beyond OpenAI's `ref_text`, the
//! clip's words, for in-context cloning) makes a voice from a reference clip,
//! `GET /v1/audio/voices` lists the caller's, `DELETE /v1/audio/voices/{id}`
//! removes one. The speaker embedding (and with `ref_text` the clip's codes)
//! is computed once, at upload, by the pipeline's voice encoders (a Qwen3-TTS
//! Base checkpoint's, batched by the [`ClipEncoder`]) and kept in the
//! [`VoiceStore`];
//! `/v1/audio/speech` then speaks with `voice: "voice_…"` or
//! `{"id": "voice_…"}`, or with a clip of its own (`ref_audio`).

use std::sync::Arc;

use axum::extract::multipart::MultipartError;
use axum::extract::{DefaultBodyLimit, FromRequest, Multipart, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use axum::{Json, Router};
use base64::Engine as _;
use serde_json::json;

use omnistream_codecs::StreamResampler;
use omnistream_stages::engine::VoiceReference;

use super::transcriptions::{decode_upload, multipart_error};
use crate::serve::auth::bearer;
use crate::serve::clip_encoder::ClipEncoder;
use crate::serve::connections::declared_length;
use crate::serve::error::ApiError;
use crate::serve::state::AppState;
use crate::serve::voice_store::{owner_of, ClonedClip, StoredVoice, VoiceStore, MAX_NAME_CHARS};

/// Largest reference clip upload (OpenAI's limit for voice samples).
pub const MAX_SAMPLE_BYTES: usize = 10 << 20;
/// A reference clip's length bounds: enough speech to hear a voice by, and no
/// more than the encoder needs.
pub const MIN_CLIP_SECONDS: f32 = 2.0;
pub const MAX_CLIP_SECONDS: f32 = 60.0;
/// In-context cloning puts the clip's every frame (12.5 a second) in each
/// prompt: Qwen's advice is 3 to 10 s.
pub const MAX_IN_CONTEXT_SECONDS: f32 = 20.0;
/// The longest transcript of a reference clip.
pub const MAX_REF_TEXT_CHARS: usize = 1000;
/// Below this RMS (-50 dBFS) a clip is silence, and has no voice to clone.
const SILENT_RMS: f32 = 0.003_16;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/audio/voices", get(list).post(create))
        .route("/v1/audio/voices/{voice_id}", delete(remove))
        .layer(DefaultBodyLimit::max(MAX_SAMPLE_BYTES + (64 << 10)))
}

fn bad(param: &'static str, code: &'static str, msg: impl Into<String>) -> ApiError {
    ApiError {
        param: Some(param),
        ..ApiError::bad_request(code, msg)
    }
}

/// The store and encoder, or why this server clones no voices.
fn cloning(state: &AppState) -> Result<(&VoiceStore, &ClipEncoder), ApiError> {
    match (&state.voice_store, &state.clip_encoder) {
        (Some(s), Some(e)) => Ok((s, e)),
        _ => Err(ApiError::bad_request(
            "voice_cloning_unsupported",
            "this server's voice cannot be cloned (it takes a Qwen3-TTS Base checkpoint's Talker in this process)",
        )),
    }
}

/// The owner of the caller's voices (a hash of its API key).
pub fn caller(headers: &HeaderMap) -> String {
    owner_of(bearer(headers))
}

/// A reference clip's transcript, for in-context cloning: `None` when absent
/// or blank, else checked against the encoder and its length.
pub fn ref_text(encoder: &ClipEncoder, text: Option<String>) -> Result<Option<String>, ApiError> {
    let Some(text) = text.map(|t| t.trim().to_string()).filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    if !encoder.encoder().in_context() {
        return Err(bad(
            "ref_text",
            "in_context_unsupported",
            "in-context cloning needs the speech tokenizer's encoder, which this checkpoint lacks: clone from the clip alone (no `ref_text`)",
        ));
    }
    let n = text.chars().count();
    if n > MAX_REF_TEXT_CHARS {
        return Err(bad(
            "ref_text",
            "invalid_value",
            format!("`ref_text` is {n} characters; the limit is {MAX_REF_TEXT_CHARS}"),
        ));
    }
    Ok(Some(text))
}

/// A reference clip (WAV or Ogg Opus bytes) to a cloned voice: its speaker
/// embedding, its length and, with its transcript (`ref_text`), its codes for
/// in-context cloning. Checked for length and silence, resampled to the
/// encoder's rate, encoded in the encoders' next batch (off the async
/// threads). `param` names the field it came in.
pub async fn clone_clip(
    encoder: &ClipEncoder,
    bytes: &[u8],
    param: &'static str,
    ref_text: Option<String>,
) -> Result<ClonedClip, ApiError> {
    let (samples, rate) = decode_upload(bytes).map_err(|e| ApiError {
        param: Some(param),
        ..e
    })?;
    let seconds = samples.len() as f32 / rate.max(1) as f32;
    if seconds < MIN_CLIP_SECONDS {
        return Err(bad(
            param,
            "audio_too_short",
            format!("the reference clip is {seconds:.2} s; at least {MIN_CLIP_SECONDS} s of speech is needed"),
        ));
    }
    if seconds > MAX_CLIP_SECONDS {
        return Err(bad(
            param,
            "audio_too_long",
            format!("the reference clip is {seconds:.0} s; the limit is {MAX_CLIP_SECONDS} s"),
        ));
    }
    if ref_text.is_some() && seconds > MAX_IN_CONTEXT_SECONDS {
        return Err(bad(
            param,
            "audio_too_long",
            format!(
                "the reference clip is {seconds:.0} s; in-context cloning (`ref_text`) takes at most {MAX_IN_CONTEXT_SECONDS} s (every frame of it is in each prompt)"
            ),
        ));
    }
    let rms = (samples.iter().map(|s| s * s).sum::<f32>() / samples.len().max(1) as f32).sqrt();
    if !rms.is_finite() || rms < SILENT_RMS {
        return Err(bad(
            param,
            "audio_silent",
            "the reference clip is silent: there is no voice to clone",
        ));
    }
    let target = encoder.encoder().sample_rate();
    let pcm = if rate == target {
        samples
    } else {
        let mut r = StreamResampler::new(rate, target)
            .map_err(|e| bad(param, "unsupported_sample_rate", e.to_string()))?;
        let mut out = r
            .process(&samples)
            .map_err(|e| bad(param, "unsupported_sample_rate", e.to_string()))?;
        out.extend(
            r.flush()
                .map_err(|e| bad(param, "unsupported_sample_rate", e.to_string()))?,
        );
        out
    };
    let encoded = encoder
        .encode(pcm, ref_text.is_some())
        .await
        .map_err(ApiError::internal)?;
    Ok(ClonedClip {
        seconds,
        embedding: encoded.embedding,
        reference: ref_text
            .zip(encoded.codes)
            .map(|(text, codes)| VoiceReference { text, codes }),
    })
}

/// `ref_audio` of a speech request: base64 of a WAV or Ogg Opus file, or a
/// `data:` URI of one.
pub fn ref_audio_bytes(v: &str) -> Result<Vec<u8>, ApiError> {
    let b64 = match v.strip_prefix("data:") {
        Some(rest) => rest.split_once(',').map_or("", |(_, d)| d),
        None => v,
    };
    base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|e| {
            bad(
                "ref_audio",
                "invalid_audio",
                format!("`ref_audio` is not base64: {e}"),
            )
        })
}

async fn create(State(state): State<Arc<AppState>>, req: Request) -> Response {
    async {
        let (store, encoder) = cloning(&state)?;
        let owner = caller(req.headers());
        // Refused from the header, before a byte of the body is read.
        if declared_length(req.headers()).is_some_and(|n| n > MAX_SAMPLE_BYTES as u64 + (64 << 10)) {
            return Err(too_large());
        }
        let mut form = Multipart::from_request(req, &state)
            .await
            .map_err(|e| ApiError {
                status: e.status(),
                kind: "invalid_request_error",
                code: "invalid_content_type",
                message: format!(
                    "{}: send multipart/form-data with `name`, `audio_sample` and `consent`",
                    e.body_text()
                ),
                retry_after: None,
                param: None,
            })?;
        let (mut name, mut sample, mut consent, mut transcript) = (None, None, None, None);
        while let Some(field) = form
            .next_field()
            .await
            .map_err(|e| form_error(e, "the multipart body is malformed".into()))?
        {
            let field_name = field.name().unwrap_or_default().to_string();
            let data = field
                .bytes()
                .await
                .map_err(|e| form_error(e, format!("reading field {field_name:?}")))?;
            let text = || String::from_utf8_lossy(&data).trim().to_string();
            match field_name.as_str() {
                "name" => name = Some(text()),
                "audio_sample" => sample = Some(data),
                "consent" => consent = Some(text()),
                // Beyond OpenAI's fields: the clip's words, for in-context cloning.
                "ref_text" => transcript = Some(text()),
                "type" if text() == "audio_sample" => {}
                "type" => {
                    return Err(bad(
                        "type",
                        "unsupported_value",
                        "only `audio_sample` voices are made here (a voice described in words is a VoiceDesign checkpoint's `instructions`)",
                    ))
                }
                other => {
                    return Err(ApiError::bad_request(
                        "unknown_parameter",
                        format!(
                            "unknown field {other:?}: use name, audio_sample, consent, ref_text"
                        ),
                    ))
                }
            }
        }
        let name = name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| bad("name", "missing_name", "the `name` field is required"))?;
        if name.chars().count() > MAX_NAME_CHARS {
            return Err(bad(
                "name",
                "invalid_value",
                format!("`name` is over {MAX_NAME_CHARS} characters"),
            ));
        }
        let sample = sample.ok_or_else(|| {
            bad("audio_sample", "missing_file", "the `audio_sample` field is required")
        })?;
        let transcript = ref_text(encoder, transcript)?;
        let clip = clone_clip(
            encoder,
            &sample,
            "audio_sample",
            transcript,
        ).await?;
        let voice = store
            .create(&owner, &name, consent.filter(|c| !c.is_empty()), clip)
            .map_err(store_error)?;
        Ok::<_, ApiError>(Json(voice.to_json()).into_response())
    }
    .await
    .unwrap_or_else(IntoResponse::into_response)
}

/// 413 in the JSON error shape, naming the clip.
fn too_large() -> ApiError {
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        param: Some("audio_sample"),
        ..ApiError::bad_request(
            "request_too_large",
            format!("the upload is larger than {} MiB", MAX_SAMPLE_BYTES >> 20),
        )
    }
}

fn form_error(e: MultipartError, what: String) -> ApiError {
    match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => too_large(),
        _ => multipart_error(e, what),
    }
}

fn store_error(e: crate::serve::voice_store::StoreError) -> ApiError {
    use crate::serve::voice_store::StoreError;
    match e {
        StoreError::Full(m) => ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            ..ApiError::bad_request("voice_limit_reached", m)
        },
        e @ StoreError::Io { .. } => ApiError::internal(e.to_string()),
    }
}

async fn list(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let data: Vec<serde_json::Value> = match &state.voice_store {
        Some(store) => store
            .list(&caller(&headers))
            .iter()
            .map(StoredVoice::to_json)
            .collect(),
        None => Vec::new(),
    };
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn remove(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let gone = match &state.voice_store {
        Some(store) => store.delete(&caller(&headers), &id).map_err(store_error),
        None => Ok(false),
    };
    match gone {
        Ok(true) => Json(json!({"id": id, "object": "audio.voice.deleted", "deleted": true}))
            .into_response(),
        Ok(false) => ApiError {
            status: StatusCode::NOT_FOUND,
            param: Some("voice_id"),
            ..ApiError::bad_request("voice_not_found", format!("no voice {id:?}"))
        }
        .into_response(),
        Err(e) => e.into_response(),
    }
}
