//! Stateless HTTP, OpenAI's shape: `POST /v1/chat/completions` (text, or
//! text and audio; one JSON body or SSE), `POST /v1/audio/speech` (a body
//! streamed as it is produced, or SSE) and `POST /v1/audio/transcriptions`.
//!
//! A request is validated, admitted and submitted as an [`Answer`] (the one
//! every endpoint uses), and its first step awaited, so every failure up to
//! that point is an ordinary HTTP error. From then on the response body pulls
//! the answer's steps through a codec of the wire format ([`Codec`]): audio
//! leaves the moment the pipeline emits it, a slow client never blocks a
//! stage (the engine drops it once its queue fills), and a client that goes
//! away drops the body, and with it the answer: the request is cancelled in
//! every stage.

mod chat;
mod requests;
mod speech;
mod transcriptions;
mod voices;

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Router};
use base64::Engine as _;
use serde_json::Value;

use omnistream_stages::engine::ToolCall;

use crate::serve::answer::{Answer, Meter, Step};
use crate::serve::audio::OutputFormat;
use crate::serve::conversation::End;
use crate::serve::error::ApiError;
use crate::serve::metrics::TaskGuard;
use crate::serve::state::AppState;
use omnistream_stages::engine::RequestSpec;

pub(crate) use requests::{cloned_voice_id, speech_session};
use requests::{AudioStore, MAX_BODY_BYTES};

/// Metric labels.
const EP_CHAT: &str = "chat_completions";
const EP_SPEECH: &str = "audio_speech";

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/audio/speech", post(speech))
        .layer(Extension(Arc::new(AudioStore::default())))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .merge(transcriptions::routes())
        .merge(voices::routes())
}

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(store): Extension<Arc<AudioStore>>,
    req: Request,
) -> Response {
    let meter = Meter::new(&state.metrics, EP_CHAT);
    chat::handle(&state, &store, req, meter)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn speech(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let meter = Meter::new(&state.metrics, EP_SPEECH);
    speech::handle(&state, req, meter)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// A request refused before the pipeline: counted by its outcome.
fn refuse<T>(mut meter: Meter, r: Result<T, ApiError>) -> Result<(T, Meter), ApiError> {
    match r {
        Ok(v) => Ok((v, meter)),
        Err(e) => {
            meter.finish_if_open(e.outcome());
            Err(e)
        }
    }
}

/// Starts the answer and waits for its first step (for speech, the first
/// past its own text): a refusal or a failure up to here is an HTTP error.
async fn start(
    state: &Arc<AppState>,
    mut meter: Meter,
    spec: RequestSpec,
    format: Option<OutputFormat>,
    streaming: bool,
    skip_text: bool,
) -> Result<(Answer, Step), ApiError> {
    // TTFT and TTFP are observed only where bytes leave as they are made.
    meter.streaming = streaming;
    let mut answer = Answer::start(state, meter, spec, format, None)
        .await
        .map_err(|e| e.to_api())?;
    loop {
        match answer.next().await {
            Step::Text(_) if skip_text => continue,
            Step::End(end @ (End::Failed(_) | End::Cancelled | End::SlowClient)) => {
                return Err(ApiError::failed(cut(&end)))
            }
            step => return Ok((answer, step)),
        }
    }
}

/// One wire format of a streamed answer: its steps in, the body's bytes out.
trait Codec: Send + 'static {
    /// A text delta (nothing when the format carries no text).
    fn text(&mut self, text: &str) -> Vec<u8>;
    /// Audio bytes in the client's format.
    fn audio(&mut self, bytes: &[u8]) -> Vec<u8>;
    /// A function call of the answer (nothing where the format has none).
    fn tool_call(&mut self, _call: &ToolCall) -> Vec<u8> {
        Vec::new()
    }
    /// The last bytes; `Err` breaks the body off (the status line is gone,
    /// so the client sees it cut).
    fn end(&mut self, end: End) -> Result<Vec<u8>, String>;
}

/// A body that pulls the answer's steps as the client reads: each step's
/// bytes go out as one chunk, flushed while the body waits for the next.
fn answer_body<C: Codec>(answer: Answer, first: Step, codec: C, task: TaskGuard) -> Body {
    struct St<C> {
        answer: Answer,
        first: Option<Step>,
        codec: C,
        ended: bool,
        _task: TaskGuard,
    }
    let st = St {
        answer,
        first: Some(first),
        codec,
        ended: false,
        _task: task,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        while !st.ended {
            let step = match st.first.take() {
                Some(step) => step,
                None => st.answer.next().await,
            };
            let bytes = match step {
                Step::Text(t) => {
                    let b = st.codec.text(&t);
                    if !b.is_empty() {
                        st.answer.sent_text();
                    }
                    b
                }
                Step::ToolCall(c) => st.codec.tool_call(&c),
                Step::Audio(a) => {
                    let b = st.codec.audio(&a);
                    if !b.is_empty() {
                        st.answer.sent_audio(a.len());
                    }
                    b
                }
                Step::End(end) => {
                    st.ended = true;
                    match st.codec.end(end) {
                        Ok(b) => b,
                        Err(m) => return Some((Err(std::io::Error::other(m)), st)),
                    }
                }
            };
            if !bytes.is_empty() {
                return Some((Ok(Bytes::from(bytes)), st));
            }
        }
        None
    });
    Body::from_stream(stream)
}

/// Why a streamed answer ended without completing, for a body that can only
/// be cut.
fn cut(end: &End) -> String {
    match end {
        End::Failed(m) => m.clone(),
        End::SlowClient => "the client did not read its output in time".into(),
        End::Cancelled | End::Completed(_) => "the request was cancelled".into(),
    }
}

fn sse_response(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        body,
    )
        .into_response()
}

fn sse(v: &Value) -> Vec<u8> {
    format!("data: {v}\n\n").into_bytes()
}

/// An SSE answer that did not complete: a failure gets the error, by its
/// code (as before the status line), and `[DONE]`, so that a client's stream
/// ends as usual; a client dropped as too slow is cut.
fn sse_end_error(end: End) -> Result<Vec<u8>, String> {
    match end {
        End::Failed(m) => {
            let mut out = sse(&ApiError::failed(m).body());
            out.extend_from_slice(b"data: [DONE]\n\n");
            Ok(out)
        }
        other => Err(cut(&other)),
    }
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// The pipeline's output rate, or 400 when it makes no audio.
fn sample_rate(state: &AppState) -> Result<u32, ApiError> {
    state
        .pipeline
        .sample_rate()
        .ok_or_else(|| ApiError::bad_request("invalid_value", "this pipeline cannot speak"))
}
