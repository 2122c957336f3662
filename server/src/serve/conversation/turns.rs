//! `server_vad` turn detection as a session configures it, and what the
//! detector reports (the detector itself runs in the driver: it is a model).

use std::time::Duration;

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
    /// Silence after an answer played that makes the model speak again.
    pub idle_timeout_ms: Option<Value>,
}

/// The bounds OpenAI puts on `idle_timeout_ms`.
pub const IDLE_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 5_000..=30_000;

/// Validated `server_vad` settings of a session.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnSettings {
    pub vad: VadConfig,
    pub create_response: bool,
    pub interrupt_response: bool,
    /// After an answer has played, this long without the user speaking
    /// makes the model answer again (`idle_timeout_ms`).
    pub idle_timeout: Option<Duration>,
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
        let idle_timeout = match &td.idle_timeout_ms {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_u64().filter(|ms| IDLE_TIMEOUT_MS.contains(ms)) {
                Some(ms) => Some(Duration::from_millis(ms)),
                None => {
                    return Err(bad(
                        "invalid_value",
                        format!(
                            "idle_timeout_ms is null or {}–{} ms, not {v}",
                            IDLE_TIMEOUT_MS.start(),
                            IDLE_TIMEOUT_MS.end()
                        ),
                    ))
                }
            },
        };
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
            idle_timeout,
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
            "idle_timeout_ms": self.idle_timeout.map(|d| d.as_millis() as u64),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_timeout_is_null_or_within_openais_bounds() {
        let parse = |v: Value| TurnSettings::parse(&v, Some(250), "turn_detection");
        let t = parse(json!({"type": "server_vad"})).unwrap().unwrap();
        assert_eq!(t.idle_timeout, None);
        let t = parse(json!({"type": "server_vad", "idle_timeout_ms": null}))
            .unwrap()
            .unwrap();
        assert_eq!(t.idle_timeout, None);
        let t = parse(json!({"type": "server_vad", "idle_timeout_ms": 8000}))
            .unwrap()
            .unwrap();
        assert_eq!(t.idle_timeout, Some(Duration::from_secs(8)));
        assert_eq!(t.to_json()["idle_timeout_ms"], 8000);
        for bad in [json!(1000), json!(60_000), json!("soon"), json!(-5)] {
            let e = parse(json!({"type": "server_vad", "idle_timeout_ms": bad})).unwrap_err();
            assert_eq!((e.code, e.param), ("invalid_value", Some("turn_detection")));
        }
    }
}
