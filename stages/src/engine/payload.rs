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

/// A span of generated text. Future Thinkers attach the per-token tensors their
/// Talker needs (embeddings, a hidden layer) next to the ids.
#[derive(Debug, Clone)]
pub struct TextChunk {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// No more text follows for this request.
    pub finished: bool,
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
