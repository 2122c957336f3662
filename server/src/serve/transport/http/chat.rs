//! `POST /v1/chat/completions`: one `chat.completion`, or OpenAI's chunks
//! over SSE.

use std::sync::Arc;

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};

use omnistream_codecs::pcm::pcm16_le_to_f32;
use omnistream_stages::engine::ToolCall;

use super::requests::{internal, read_json, AudioStore, ChatPlan, AUDIO_TTL};
use super::Codec;
use super::{answer_body, b64, refuse, sample_rate, sse, sse_end_error, sse_response, start};
use crate::serve::answer::{Answer, Meter, Step};
use crate::serve::audio::{AudioEncoder, OutputFormat};
use crate::serve::conversation::{End, Usage};
use crate::serve::error::ApiError;
use crate::serve::metrics::TaskGuard;
use crate::serve::state::AppState;
use crate::serve::transport::unix_now;

pub(super) async fn handle(
    state: &Arc<AppState>,
    store: &Arc<AudioStore>,
    req: Request,
    meter: Meter,
) -> Result<Response, ApiError> {
    let plan = async {
        let owner = super::voices::caller(req.headers());
        let body = read_json(req).await?;
        let mut plan = ChatPlan::from_request(body, store, &state.voices)?;
        state
            .speak_cloned(&owner, &mut plan.spec)
            .map_err(|m| ApiError {
                param: Some("audio.voice"),
                ..ApiError::bad_request("voice_not_found", m)
            })?;
        let rate = match plan.audio {
            Some(_) => Some(sample_rate(state)?),
            None => None,
        };
        Ok((plan, rate))
    };
    let ((plan, rate), meter) = refuse(meter, plan.await)?;
    let max_tokens = plan.spec.sampling.max_tokens;
    let meta = ChunkMeta::new(&state.config.model_name, plan.include_usage);
    let audio = plan.audio.zip(rate);
    if !plan.stream {
        // The whole audio at the pipeline's rate, encoded as one file at the end.
        let pcm = audio.map(|(_, rate)| OutputFormat::Pcm16 { rate });
        let (answer, first) = start(state, meter, plan.spec, pcm, false, false).await?;
        return collect(answer, first, audio, &meta, max_tokens, store).await;
    }
    let (answer, first) = start(state, meter, plan.spec, plan.audio, true, false).await?;
    let codec = ChatSse {
        meta,
        audio: plan.audio.map(|_| AudioOut::new()),
        text: String::new(),
        started: false,
        max_tokens,
        store: store.clone(),
        calls: 0,
    };
    let task = TaskGuard::new(&state.metrics);
    Ok(sse_response(answer_body(answer, first, codec, task)))
}

/// Non-streaming chat: the whole answer in one `chat.completion`.
async fn collect(
    mut answer: Answer,
    first: Step,
    audio: Option<(OutputFormat, u32)>,
    meta: &ChunkMeta,
    max_tokens: Option<usize>,
    store: &AudioStore,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut calls = Vec::new();
    let mut pcm = Vec::new();
    let mut next = Some(first);
    let usage = loop {
        let step = match next.take() {
            Some(step) => step,
            None => answer.next().await,
        };
        match step {
            Step::Text(s) => text.push_str(&s),
            Step::ToolCall(c) => calls.push(c),
            Step::Audio(bytes) => pcm.extend(bytes),
            Step::End(End::Completed(usage)) => break usage,
            Step::End(end) => return Err(ApiError::failed(super::cut(&end))),
        }
    };
    let finish = finish_reason(usage.completion_tokens, max_tokens, !calls.is_empty());
    let mut message = match audio {
        Some((format, rate)) => {
            // A whole file (WAV with its real sizes), encoded off the async workers.
            let encoded = tokio::task::spawn_blocking(move || {
                let samples = pcm16_le_to_f32(&pcm).map_err(|e| e.to_string())?;
                AudioEncoder::encode_all(format, &samples, rate).map_err(|e| e.to_string())
            })
            .await
            .map_err(internal)
            .and_then(|r| r.map_err(internal));
            let data = match encoded {
                Ok(data) => data,
                Err(e) => {
                    answer.fail();
                    return Err(e);
                }
            };
            answer.sent_audio(data.len());
            let out = AudioOut::new();
            store.put(&out.id, &text, out.expires_at);
            json!({
                "role": "assistant",
                "content": null,
                "refusal": null,
                "audio": {
                    "id": out.id,
                    "data": b64(&data),
                    "expires_at": out.expires_at,
                    "transcript": text,
                },
            })
        }
        None => json!({"role": "assistant", "content": text, "refusal": null}),
    };
    if !calls.is_empty() {
        message["tool_calls"] = json!(calls);
        if text.is_empty() {
            message["content"] = Value::Null;
        }
    }
    Ok(Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish,
        }],
        "usage": usage_json(&usage),
        "system_fingerprint": null,
    }))
    .into_response())
}

fn finish_reason(
    completion_tokens: usize,
    max_tokens: Option<usize>,
    called: bool,
) -> &'static str {
    match max_tokens {
        Some(m) if completion_tokens >= m => "length",
        _ if called => "tool_calls",
        _ => "stop",
    }
}

/// The usage object of Chat Completions.
fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    })
}

/// The fields every chunk of one completion shares.
#[derive(Debug)]
struct ChunkMeta {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl ChunkMeta {
    fn new(model: &str, include_usage: bool) -> Self {
        Self {
            id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: model.to_string(),
            include_usage,
        }
    }

    fn chunk(&self, choices: Value, usage: Value) -> Vec<u8> {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = usage;
        }
        sse(&v)
    }

    fn delta(&self, delta: Value, finish_reason: Option<&str>) -> Vec<u8> {
        self.chunk(
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}]),
            Value::Null,
        )
    }
}

/// A chat answer's audio id, which a later turn may refer to until it expires.
struct AudioOut {
    id: String,
    expires_at: u64,
}

impl AudioOut {
    fn new() -> Self {
        Self {
            id: format!("audio_{}", uuid::Uuid::new_v4().simple()),
            expires_at: unix_now() + AUDIO_TTL.as_secs(),
        }
    }
}

/// Chat Completions streaming, as OpenAI streams it: text in `delta.content`,
/// or with audio the transcript in `delta.audio.transcript` and the audio in
/// `delta.audio.data`; then `delta.audio.expires_at`, the finish reason, the
/// usage chunk when asked for, and `[DONE]`.
struct ChatSse {
    meta: ChunkMeta,
    audio: Option<AudioOut>,
    text: String,
    started: bool,
    max_tokens: Option<usize>,
    store: Arc<AudioStore>,
    /// Function calls sent so far.
    calls: usize,
}

impl ChatSse {
    /// The assistant's role chunk, before anything else.
    fn open(&mut self) -> Vec<u8> {
        if std::mem::replace(&mut self.started, true) {
            return Vec::new();
        }
        let mut d = json!({"role": "assistant", "content": "", "refusal": null});
        if self.audio.is_some() {
            d["content"] = Value::Null;
        }
        self.meta.delta(d, None)
    }

    fn audio_delta(&self, fields: Value) -> Value {
        let mut a = fields;
        if let Some(out) = &self.audio {
            a["id"] = json!(out.id);
        }
        json!({ "audio": a })
    }
}

impl Codec for ChatSse {
    fn text(&mut self, s: &str) -> Vec<u8> {
        let mut out = self.open();
        self.text.push_str(s);
        let d = if self.audio.is_some() {
            self.audio_delta(json!({ "transcript": s }))
        } else {
            json!({ "content": s })
        };
        out.extend(self.meta.delta(d, None));
        out
    }

    fn audio(&mut self, bytes: &[u8]) -> Vec<u8> {
        let mut out = self.open();
        let d = self.audio_delta(json!({"data": b64(bytes)}));
        out.extend(self.meta.delta(d, None));
        out
    }

    /// A whole call in one delta (OpenAI may split its arguments over
    /// several; clients join them by `index`).
    fn tool_call(&mut self, call: &ToolCall) -> Vec<u8> {
        let mut out = self.open();
        let mut c = json!(call);
        c["index"] = json!(self.calls);
        self.calls += 1;
        out.extend(self.meta.delta(json!({ "tool_calls": [c] }), None));
        out
    }

    fn end(&mut self, end: End) -> Result<Vec<u8>, String> {
        let mut out = self.open();
        let End::Completed(usage) = end else {
            out.extend(sse_end_error(end)?);
            return Ok(out);
        };
        if let Some(a) = &self.audio {
            self.store.put(&a.id, &self.text, a.expires_at);
            out.extend(self.meta.delta(
                json!({"audio": {"id": a.id, "expires_at": a.expires_at}}),
                None,
            ));
        }
        let finish = finish_reason(usage.completion_tokens, self.max_tokens, self.calls > 0);
        out.extend(self.meta.delta(json!({}), Some(finish)));
        if self.meta.include_usage {
            out.extend(self.meta.chunk(json!([]), usage_json(&usage)));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finish_reason_reports_the_token_limit() {
        assert_eq!(finish_reason(10, Some(10), true), "length");
        assert_eq!(finish_reason(3, Some(10), false), "stop");
        assert_eq!(finish_reason(3, None, false), "stop");
        assert_eq!(finish_reason(3, None, true), "tool_calls");
    }
}
