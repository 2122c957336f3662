//! `server_vad` turn detection as a session configures it, and what the
//! detector reports (the detector itself runs in the driver: it is a model).

use serde::Deserialize;
use serde_json::{json, Value};

use omnistream_stages::vad::VadConfig;

use super::super::error::ClientError;

/// `turn_detection: {"type": "server_vad", ...}` as clients send it (the
/// OpenAI Realtime knobs).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerVad {
    #[serde(rename = "type")]
    pub kind: String,
    pub threshold: Option<f32>,
    pub prefix_padding_ms: Option<u32>,
    pub silence_duration_ms: Option<u32>,
    pub create_response: Option<bool>,
    pub interrupt_response: Option<bool>,
    /// Accepted when null: no idle prompts.
    pub idle_timeout_ms: Option<Value>,
}

/// Validated `server_vad` settings of a session.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnSettings {
    pub vad: VadConfig,
    pub create_response: bool,
    pub interrupt_response: bool,
}

impl TurnSettings {
    /// From a client's `turn_detection` value: `Ok(None)` for null (the
    /// client commits), an error naming the field for anything unsupported.
    /// `min_speech_ms`: the server's VAD setting, `None` without a VAD.
    pub fn parse(
        v: &Value,
        min_speech_ms: Option<u32>,
        param: &'static str,
    ) -> Result<Option<Self>, ClientError> {
        if v.is_null() {
            return Ok(None);
        }
        let bad = |code: &'static str, m: String| ClientError {
            param: Some(param),
            ..ClientError::invalid(code, m)
        };
        let td: ServerVad = serde_json::from_value(v.clone())
            .map_err(|e| bad("invalid_value", format!("turn_detection: {e}")))?;
        if td.kind != "server_vad" {
            return Err(bad(
                "unsupported_turn_detection",
                format!(
                    "turn_detection type {:?} is not supported: use \"server_vad\" or null",
                    td.kind
                ),
            ));
        }
        let Some(min_speech_ms) = min_speech_ms else {
            return Err(bad(
                "unsupported_turn_detection",
                "this server has no VAD model (profile `server.vad`): set turn_detection to null and commit the input audio buffer yourself".into(),
            ));
        };
        if td.idle_timeout_ms.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(bad(
                "unsupported_turn_detection",
                "idle_timeout_ms is not supported: leave it out or null".into(),
            ));
        }
        let d = VadConfig::default();
        let vad = VadConfig {
            threshold: td.threshold.unwrap_or(d.threshold),
            prefix_padding_ms: td.prefix_padding_ms.unwrap_or(d.prefix_padding_ms),
            silence_duration_ms: td.silence_duration_ms.unwrap_or(d.silence_duration_ms),
            min_speech_ms,
            ..d
        };
        vad.validate()
            .map_err(|e| bad("invalid_value", e.to_string()))?;
        Ok(Some(Self {
            vad,
            create_response: td.create_response.unwrap_or(true),
            interrupt_response: td.interrupt_response.unwrap_or(true),
        }))
    }

    /// As the session reports it.
    pub fn to_json(&self) -> Value {
        json!({
            "type": "server_vad",
            "threshold": self.vad.threshold,
            "prefix_padding_ms": self.vad.prefix_padding_ms,
            "silence_duration_ms": self.vad.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "idle_timeout_ms": null,
        })
    }
}

/// What the turn detector heard, in the order it heard it. Offsets count
/// from the start of the session's audio.
#[derive(Debug, Clone, PartialEq)]
pub enum Speech {
    /// The user started speaking (`audio_start_ms` includes the prefix padding).
    Started { audio_start_ms: u64 },
    /// The user paused: `audio`, the utterance so far (16 kHz), is the whole
    /// turn unless they speak again.
    Paused { audio: Vec<f32> },
    /// They spoke again after a pause.
    Resumed,
    /// The user stopped: their utterance (16 kHz, prefix padding included,
    /// trailing silence past its pause trimmed).
    Stopped { audio_end_ms: u64, audio: Vec<f32> },
}
