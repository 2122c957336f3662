//! What crosses a stage boundary: typed, request-scoped payloads.

use std::sync::Arc;

use candle_core::Tensor;

use super::request::{RequestCtx, RequestId};

/// One message on a connector.
pub struct Envelope {
    pub request: RequestId,
    pub payload: Payload,
}

pub enum Payload {
    /// The first message of a request on every connector: its context.
    Start(Arc<RequestCtx>),
    /// Thinker -> Talker.
    Text(TextChunk),
    /// Talker -> Code2Wav.
    Frames(FrameChunk),
}

/// A span of generated text, with the Thinker's tensors for a Talker that
/// speaks from them (Qwen3-Omni) rather than from the text.
#[derive(Debug, Clone)]
pub struct TextChunk {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// No more text follows for this request.
    pub finished: bool,
    pub states: Option<ThinkerStates>,
}

impl TextChunk {
    pub fn text(text: String, token_ids: Vec<u32>, finished: bool) -> Self {
        Self {
            text,
            token_ids,
            finished,
            states: None,
        }
    }
}

/// What a Qwen3-Omni Thinker hands its Talker.
#[derive(Debug, Clone, Default)]
pub struct ThinkerStates {
    /// With the first chunk: the prompt's ids, input embeddings and hidden states
    /// at the Talker's `accept_hidden_layer`.
    pub prompt: Option<Arc<PromptStates>>,
    /// Input embeddings `(n, hidden)` of the generated tokens the Thinker fed back
    /// since the last chunk (the token it ends on is never fed back).
    pub embeds: Option<Tensor>,
}

#[derive(Debug)]
pub struct PromptStates {
    pub ids: Vec<u32>,
    /// `(prompt, hidden)`.
    pub embeds: Tensor,
    /// `(prompt, hidden)`.
    pub hidden: Tensor,
}

/// Speech units with time on the last axis: latent frames `[1, C, T]` (Piper) or
/// codec codes `[groups, T]` (RVQ Talkers). `frames` is `None` for an empty final
/// chunk.
#[derive(Debug, Clone)]
pub struct FrameChunk {
    pub frames: Option<Tensor>,
    /// No more frames follow for this request.
    pub finished: bool,
}

impl FrameChunk {
    pub fn len(&self) -> usize {
        self.frames
            .as_ref()
            .and_then(|t| t.dims().last().copied())
            .unwrap_or(0)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Payload {
    /// The Thinker's states moved to `device` (other payloads as they are):
    /// a stage process decodes on its NATS task and moves them on the worker's
    /// thread, the one that then uses them, as in-process.
    pub fn states_to(self, device: &candle_core::Device) -> candle_core::Result<Payload> {
        let Payload::Text(mut t) = self else {
            return Ok(self);
        };
        if let Some(s) = t.states.as_mut() {
            if let Some(p) = s.prompt.as_mut() {
                if !p.embeds.device().same_device(device) {
                    *p = Arc::new(PromptStates {
                        ids: p.ids.clone(),
                        embeds: p.embeds.to_device(device)?,
                        hidden: p.hidden.to_device(device)?,
                    });
                }
            }
            if let Some(e) = s.embeds.as_mut() {
                *e = e.to_device(device)?;
            }
        }
        Ok(Payload::Text(t))
    }
}
