//! What crosses the wire between processes: typed, versioned messages.
//!
//! Every message starts with a fixed header (the wire version, and for
//! request-scoped messages the request id and its owner), then a postcard body
//! (serde, compact, no schema on the wire). The header is read first, so a
//! message of another version or with a corrupt body still names the request
//! it belongs to, which then fails with a clear error instead of hanging.
//! Tensors travel as dtype + shape + little-endian bytes: moved to the host by
//! the sender, onto the receiving stage's device by the receiver.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::engine::payload::{FrameChunk, Payload, PromptStates, TextChunk, ThinkerStates};
use crate::engine::pipeline::StageStats;
use crate::engine::request::ChatMessage;
use crate::engine::request::{
    Event, Modalities, RequestCtx, RequestId, RequestInput, RequestSpec, SamplingOverrides,
    SpeechStyle, Usage,
};
use crate::engine::tools::{ToolCall, ToolChoice, Tools};

/// Bumped on every change of a message's layout: peers of another version are
/// refused, never misread.
pub const WIRE_VERSION: u16 = 6; // 2: stage stats carry cache_bytes; 3: tools; 4: speech style; 5: its voice reference; 6: announcements carry lost connections

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WireError {
    #[error("wire version {got}, this process speaks {WIRE_VERSION}")]
    Version { got: u16 },
    #[error("message truncated: {0} bytes")]
    Truncated(usize),
    #[error("corrupt message: {0}")]
    Decode(String),
    #[error("tensor: {0}")]
    Tensor(String),
}

impl From<postcard::Error> for WireError {
    fn from(e: postcard::Error) -> Self {
        Self::Decode(e.to_string())
    }
}

impl From<candle_core::Error> for WireError {
    fn from(e: candle_core::Error) -> Self {
        Self::Tensor(e.to_string())
    }
}

// ------------------------------------------------------------------ tensors

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireDtype {
    U8,
    U32,
    I16,
    I32,
    I64,
    Bf16,
    F16,
    F32,
    F64,
}

impl WireDtype {
    fn of(d: DType) -> Result<Self, WireError> {
        Ok(match d {
            DType::U8 => Self::U8,
            DType::U32 => Self::U32,
            DType::I16 => Self::I16,
            DType::I32 => Self::I32,
            DType::I64 => Self::I64,
            DType::BF16 => Self::Bf16,
            DType::F16 => Self::F16,
            DType::F32 => Self::F32,
            DType::F64 => Self::F64,
            other => return Err(WireError::Tensor(format!("dtype {other:?} cannot travel"))),
        })
    }
    fn dtype(self) -> DType {
        match self {
            Self::U8 => DType::U8,
            Self::U32 => DType::U32,
            Self::I16 => DType::I16,
            Self::I32 => DType::I32,
            Self::I64 => DType::I64,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
            Self::F32 => DType::F32,
            Self::F64 => DType::F64,
        }
    }
}

/// A tensor on the wire: exact bytes, so what arrives equals what was sent.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireTensor {
    pub dtype: WireDtype,
    pub shape: Vec<usize>,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

fn le_bytes<T: candle_core::WithDType, const N: usize>(
    t: &Tensor,
    f: impl Fn(T) -> [u8; N],
) -> Result<Vec<u8>, WireError> {
    Ok(t.to_vec1::<T>()?.into_iter().flat_map(f).collect())
}

impl WireTensor {
    /// Copies `t` to the host as bytes.
    pub fn from_tensor(t: &Tensor) -> Result<Self, WireError> {
        let dtype = WireDtype::of(t.dtype())?;
        let flat = t.to_device(&Device::Cpu)?.flatten_all()?;
        let data = match dtype {
            WireDtype::U8 => flat.to_vec1::<u8>()?,
            WireDtype::U32 => le_bytes::<u32, 4>(&flat, u32::to_le_bytes)?,
            WireDtype::I16 => le_bytes::<i16, 2>(&flat, i16::to_le_bytes)?,
            WireDtype::I32 => le_bytes::<i32, 4>(&flat, i32::to_le_bytes)?,
            WireDtype::I64 => le_bytes::<i64, 8>(&flat, i64::to_le_bytes)?,
            WireDtype::Bf16 => le_bytes::<half::bf16, 2>(&flat, half::bf16::to_le_bytes)?,
            WireDtype::F16 => le_bytes::<half::f16, 2>(&flat, half::f16::to_le_bytes)?,
            WireDtype::F32 => le_bytes::<f32, 4>(&flat, f32::to_le_bytes)?,
            WireDtype::F64 => le_bytes::<f64, 8>(&flat, f64::to_le_bytes)?,
        };
        Ok(Self {
            dtype,
            shape: t.dims().to_vec(),
            data,
        })
    }

    /// The tensor on `device`; a size that does not match the shape is an error.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor, WireError> {
        let dtype = self.dtype.dtype();
        let expected = self
            .shape
            .iter()
            .try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d));
        if expected != Some(self.data.len()) {
            return Err(WireError::Tensor(format!(
                "{} bytes for shape {:?} of {dtype:?}",
                self.data.len(),
                self.shape
            )));
        }
        // Decoded on the host, then moved: the one copy onto the device.
        let host = Tensor::from_raw_buffer(&self.data, dtype, &self.shape, &Device::Cpu)?;
        Ok(host.to_device(device)?)
    }
}

/// f32 samples as little-endian bytes (one serde call, not one per sample).
fn f32_bytes(x: &[f32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f32_from(b: &[u8]) -> Result<Vec<f32>, WireError> {
    if !b.len().is_multiple_of(4) {
        return Err(WireError::Decode(format!(
            "{} bytes of f32 samples",
            b.len()
        )));
    }
    Ok(b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

// ---------------------------------------------------------- stage messages

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum WireInput {
    Chat {
        messages: Vec<ChatMessage>,
    },
    Speech {
        text: String,
    },
    Heard {
        messages: Vec<ChatMessage>,
        #[serde(with = "serde_bytes")]
        audio: Vec<u8>,
    },
    Transcribe {
        #[serde(with = "serde_bytes")]
        audio: Vec<u8>,
    },
}

/// A request's context as the stages after the first one need it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WireStart {
    pub input: WireInput,
    pub text: bool,
    pub audio: bool,
    pub sampling: SamplingOverrides,
    pub voice: Option<String>,
    pub style: SpeechStyle,
    /// The tools' JSON (postcard cannot carry a JSON value) and the choice.
    pub tools: Option<(String, ToolChoice)>,
    pub first_stage: u32,
    pub last_stage: u32,
    pub route: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WirePrompt {
    pub ids: Vec<u32>,
    pub embeds: WireTensor,
    pub hidden: WireTensor,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WireText {
    pub text: String,
    pub token_ids: Vec<u32>,
    pub finished: bool,
    /// `None`: no states; `Some((prompt, embeds))`.
    pub states: Option<(Option<WirePrompt>, Option<WireTensor>)>,
}

/// A stage's input: the payloads of [`Payload`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum StageMsg {
    Start(WireStart),
    Text(WireText),
    Frames {
        frames: Option<WireTensor>,
        finished: bool,
    },
}

impl WireStart {
    pub fn from_ctx(ctx: &RequestCtx) -> Self {
        let s = &ctx.spec;
        let input = match &s.input {
            RequestInput::Chat { messages } => WireInput::Chat {
                messages: messages.clone(),
            },
            RequestInput::Speech { text } => WireInput::Speech { text: text.clone() },
            RequestInput::Heard { messages, audio } => WireInput::Heard {
                messages: messages.clone(),
                audio: f32_bytes(audio),
            },
            RequestInput::Transcribe { audio } => WireInput::Transcribe {
                audio: f32_bytes(audio),
            },
        };
        Self {
            input,
            text: s.modalities.text,
            audio: s.modalities.audio,
            sampling: s.sampling.clone(),
            voice: s.voice.clone(),
            style: s.style.clone(),
            tools: s.tools.as_ref().map(|t| {
                (
                    Value::Array(t.functions.clone()).to_string(),
                    t.choice.clone(),
                )
            }),
            first_stage: ctx.first_stage as u32,
            last_stage: ctx.last_stage as u32,
            route: ctx.route.clone(),
        }
    }

    pub fn spec(&self) -> Result<RequestSpec, WireError> {
        let input = match self.input.clone() {
            WireInput::Chat { messages } => RequestInput::Chat { messages },
            WireInput::Speech { text } => RequestInput::Speech { text },
            WireInput::Heard { messages, audio } => RequestInput::Heard {
                messages,
                audio: f32_from(&audio)?.into(),
            },
            WireInput::Transcribe { audio } => RequestInput::Transcribe {
                audio: f32_from(&audio)?.into(),
            },
        };
        Ok(RequestSpec {
            input,
            modalities: Modalities {
                text: self.text,
                audio: self.audio,
            },
            sampling: self.sampling.clone(),
            voice: self.voice.clone(),
            style: self.style.clone(),
            tools: match &self.tools {
                None => None,
                Some((json, choice)) => {
                    let Ok(Value::Array(functions)) = serde_json::from_str(json) else {
                        return Err(WireError::Decode("tools: not a JSON array".into()));
                    };
                    Some(Arc::new(Tools {
                        functions,
                        choice: choice.clone(),
                    }))
                }
            },
        })
    }
}

impl StageMsg {
    /// A payload other than `Start` (which travels as [`WireStart`]).
    pub fn from_payload(p: &Payload) -> Result<Self, WireError> {
        Ok(match p {
            Payload::Start(ctx) => Self::Start(WireStart::from_ctx(ctx)),
            Payload::Text(t) => {
                let states = match &t.states {
                    None => None,
                    Some(s) => {
                        let prompt = match &s.prompt {
                            None => None,
                            Some(p) => Some(WirePrompt {
                                ids: p.ids.clone(),
                                embeds: WireTensor::from_tensor(&p.embeds)?,
                                hidden: WireTensor::from_tensor(&p.hidden)?,
                            }),
                        };
                        let embeds = s.embeds.as_ref().map(WireTensor::from_tensor).transpose()?;
                        Some((prompt, embeds))
                    }
                };
                Self::Text(WireText {
                    text: t.text.clone(),
                    token_ids: t.token_ids.clone(),
                    finished: t.finished,
                    states,
                })
            }
            Payload::Frames(f) => Self::Frames {
                frames: f.frames.as_ref().map(WireTensor::from_tensor).transpose()?,
                finished: f.finished,
            },
        })
    }

    /// The payload, the Thinker's states on `device`, speech units on the host
    /// (where the Talker makes them and Code2Wav checks them, as in-process).
    /// `Start` is built by the caller, which owns the request's outlet.
    pub fn into_payload(self, device: &Device) -> Result<Payload, WireError> {
        Ok(match self {
            Self::Start(_) => {
                return Err(WireError::Decode(
                    "a Start message is not a data payload".into(),
                ))
            }
            Self::Text(t) => {
                let states = match t.states {
                    None => None,
                    Some((prompt, embeds)) => Some(ThinkerStates {
                        prompt: match prompt {
                            None => None,
                            Some(p) => Some(Arc::new(PromptStates {
                                ids: p.ids,
                                embeds: p.embeds.to_tensor(device)?,
                                hidden: p.hidden.to_tensor(device)?,
                            })),
                        },
                        embeds: embeds.map(|e| e.to_tensor(device)).transpose()?,
                    }),
                };
                Payload::Text(TextChunk {
                    text: t.text,
                    token_ids: t.token_ids,
                    finished: t.finished,
                    states,
                })
            }
            Self::Frames { frames, finished } => Payload::Frames(FrameChunk {
                frames: frames.map(|f| f.to_tensor(&Device::Cpu)).transpose()?,
                finished,
            }),
        })
    }
}

// ---------------------------------------------------- back to the owner

/// What a stage process tells the gateway that owns a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum OwnerMsg {
    Text(String),
    ToolCall(ToolCall),
    Audio {
        #[serde(with = "serde_bytes")]
        samples: Vec<u8>,
        sample_rate: u32,
        seq: u64,
    },
    /// The request failed in that stage; the owner fails it for its client.
    Failed(String),
    /// The stage finished the request, with the tokens it counted.
    StageFinished {
        stage: u32,
        usage: Usage,
    },
}

impl OwnerMsg {
    /// `None` for `Done`, which only the owner emits.
    pub fn from_event(e: Event) -> Option<Self> {
        Some(match e {
            Event::TextDelta(t) => Self::Text(t),
            Event::ToolCall(c) => Self::ToolCall(c),
            Event::Audio {
                samples,
                sample_rate,
                seq,
            } => Self::Audio {
                samples: f32_bytes(&samples),
                sample_rate,
                seq,
            },
            Event::Error(m) => Self::Failed(m),
            Event::Done { .. } => return None,
        })
    }

    /// The client event it carries, if any.
    pub fn event(&self) -> Result<Option<Event>, WireError> {
        Ok(match self {
            Self::Text(t) => Some(Event::TextDelta(t.clone())),
            Self::ToolCall(c) => Some(Event::ToolCall(c.clone())),
            Self::Audio {
                samples,
                sample_rate,
                seq,
            } => Some(Event::Audio {
                samples: f32_from(samples)?,
                sample_rate: *sample_rate,
                seq: *seq,
            }),
            Self::Failed(_) | Self::StageFinished { .. } => None,
        })
    }
}

// ------------------------------------------------------------ announcements

/// What a stage's models say about themselves, for the gateway that does not
/// load them (the audio rate it serves, the voices it lists).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StageMeta {
    pub sample_rate: Option<u32>,
    pub voices: Vec<String>,
    /// The languages a request may name (a Talker that takes them), "auto" first.
    pub languages: Vec<String>,
    pub hears: bool,
    pub speaks_text: bool,
}

/// A process announcing itself (every [`super::HEARTBEAT`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Announce {
    pub process: u64,
    /// How many times this process lost its connection to NATS: a change
    /// tells its peers that whatever they had in flight with it is gone,
    /// however short the outage (too short to miss an announcement).
    pub losses: u32,
    pub role: AnnounceRole,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum AnnounceRole {
    Gateway {
        /// Its requests up to this id that were in flight when it last lost
        /// its connection have failed: stage processes drop what they hold
        /// of them, and a late `Start` of one (a message sent before or
        /// during the outage, delivered after) is refused. This holds where
        /// the gateway's cancels were lost with the connection.
        lost_through: RequestId,
    },
    Replica {
        stage: String,
        stage_index: u32,
        replica: u32,
        /// Requests held + payloads queued.
        load: u64,
        stats: Box<StageStats>,
        meta: StageMeta,
    },
}

// ------------------------------------------------------------------ framing

/// The fixed header of a request-scoped message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub version: u16,
    pub request: RequestId,
    pub owner: u64,
    /// When it was sent (µs since the Unix epoch, the sender's clock): the
    /// receiver's per-hop latency where the clocks agree (one host, or NTP).
    pub sent_micros: u64,
}

const HEADER_LEN: usize = 2 + 8 + 8 + 8;

/// Now, in µs since the Unix epoch.
pub fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// `header || postcard(body)`.
pub fn encode<T: Serialize>(
    request: RequestId,
    owner: u64,
    body: &T,
) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(HEADER_LEN + 64);
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    out.extend_from_slice(&request.to_le_bytes());
    out.extend_from_slice(&owner.to_le_bytes());
    out.extend_from_slice(&now_micros().to_le_bytes());
    postcard::to_io(body, &mut out).map_err(WireError::from)?;
    Ok(out)
}

/// The header alone: readable even when the body is not.
pub fn header(bytes: &[u8]) -> Result<Header, WireError> {
    if bytes.len() < HEADER_LEN {
        return Err(WireError::Truncated(bytes.len()));
    }
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&bytes[i..i + 8]);
        u64::from_le_bytes(b)
    };
    Ok(Header {
        version: u16::from_le_bytes([bytes[0], bytes[1]]),
        request: u64_at(2),
        owner: u64_at(10),
        sent_micros: u64_at(18),
    })
}

/// Header and body; another version is refused before the body is read.
pub fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<(Header, T), WireError> {
    let h = header(bytes)?;
    if h.version != WIRE_VERSION {
        return Err(WireError::Version { got: h.version });
    }
    let body = postcard::from_bytes(&bytes[HEADER_LEN..])?;
    Ok((h, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_cross_exactly_in_every_dtype() {
        let base = Tensor::arange(0f32, 24., &Device::Cpu)
            .unwrap()
            .affine(0.37, -1.3)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        for dt in [
            DType::F32,
            DType::BF16,
            DType::F16,
            DType::F64,
            DType::U32,
            DType::I64,
            DType::U8,
        ] {
            let t = if dt == DType::U32 || dt == DType::U8 || dt == DType::I64 {
                base.abs().unwrap().to_dtype(dt).unwrap()
            } else {
                base.to_dtype(dt).unwrap()
            };
            let w = WireTensor::from_tensor(&t).unwrap();
            let bytes = postcard::to_allocvec(&w).unwrap();
            let back: WireTensor = postcard::from_bytes(&bytes).unwrap();
            let u = back.to_tensor(&Device::Cpu).unwrap();
            assert_eq!(u.dims(), t.dims());
            assert_eq!(u.dtype(), dt);
            let f64s = |x: &Tensor| -> Vec<f64> {
                x.to_dtype(DType::F64)
                    .and_then(|x| x.flatten_all())
                    .and_then(|x| x.to_vec1())
                    .unwrap()
            };
            assert_eq!(f64s(&t), f64s(&u), "{dt:?}");
        }
    }

    #[test]
    fn a_tensor_whose_bytes_do_not_match_its_shape_is_refused() {
        let w = WireTensor {
            dtype: WireDtype::F32,
            shape: vec![2, 3],
            data: vec![0; 20],
        };
        assert!(matches!(
            w.to_tensor(&Device::Cpu),
            Err(WireError::Tensor(_))
        ));
        let huge = WireTensor {
            dtype: WireDtype::F32,
            shape: vec![usize::MAX, 4],
            data: vec![],
        };
        assert!(huge.to_tensor(&Device::Cpu).is_err());
    }

    #[test]
    fn frames_and_events_round_trip() {
        let codes = Tensor::new(&[[1u32, 2, 3], [4, 5, 6]], &Device::Cpu).unwrap();
        let msg = StageMsg::from_payload(&Payload::Frames(FrameChunk {
            frames: Some(codes.clone()),
            finished: true,
        }))
        .unwrap();
        let bytes = encode(7, 9, &msg).unwrap();
        let (h, back): (Header, StageMsg) = decode(&bytes).unwrap();
        assert_eq!((h.request, h.owner, h.version), (7, 9, WIRE_VERSION));
        let Payload::Frames(f) = back.into_payload(&Device::Cpu).unwrap() else {
            panic!("not frames");
        };
        assert!(f.finished);
        let v: Vec<Vec<u32>> = f.frames.unwrap().to_vec2().unwrap();
        assert_eq!(v, vec![vec![1, 2, 3], vec![4, 5, 6]]);

        let e = OwnerMsg::from_event(Event::Audio {
            samples: vec![0.5, -0.25, 1e-7],
            sample_rate: 22050,
            seq: 3,
        })
        .unwrap();
        let (_, back): (Header, OwnerMsg) = decode(&encode(1, 2, &e).unwrap()).unwrap();
        match back.event().unwrap() {
            Some(Event::Audio {
                samples,
                sample_rate,
                seq,
            }) => {
                assert_eq!(samples, vec![0.5, -0.25, 1e-7]);
                assert_eq!((sample_rate, seq), (22050, 3));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn other_versions_and_corrupt_bodies_are_refused_with_the_request_named() {
        let mut bytes = encode(42, 5, &OwnerMsg::Text("hi".into())).unwrap();
        bytes[0] = 99;
        assert_eq!(
            decode::<OwnerMsg>(&bytes).unwrap_err(),
            WireError::Version { got: 99 }
        );
        // The header still names the request, so it can be failed.
        assert_eq!(header(&bytes).unwrap().request, 42);
        let mut garbage = encode(43, 5, &OwnerMsg::Text("hi".into())).unwrap();
        garbage.truncate(HEADER_LEN);
        garbage.extend_from_slice(&[0xff; 9]);
        assert!(matches!(
            decode::<StageMsg>(&garbage),
            Err(WireError::Decode(_))
        ));
        assert_eq!(header(&garbage).unwrap().request, 43);
        assert!(matches!(header(&[1, 2, 3]), Err(WireError::Truncated(3))));
    }
}
