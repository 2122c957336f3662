//! The staged engine: a pipeline of stage workers joined by connectors.
//!
//! Each stage runs on its own thread with its own batch. A request flows through
//! the stages as typed, request-scoped payloads; its client-visible events (text
//! deltas, audio chunks, done, error) leave through its own bounded queue the
//! moment a stage produces them.

mod connector;
pub mod constrain;
mod payload;
mod pipeline;
pub mod remote;
mod replica;
mod request;
mod stage;
pub mod tools;
mod worker;

pub use connector::{in_process, Closed, ConnectorRx, ConnectorTx, InProcessRx, InProcessTx};
pub use payload::{Envelope, FrameChunk, Payload, PromptStates, TextChunk, ThinkerStates};
pub use pipeline::{
    Pipeline, PipelineStats, StageDef, StagePlacement, StageRole, StageStats, TextFeed, WireStats,
    DEFAULT_EVENT_CAPACITY, MAX_SPEECH_CHARS,
};
pub use replica::{ReplicaId, StageInput};
pub use request::{
    CancelReason, ChatMessage, EncodeTimes, EncodedVoice, Event, Modalities, RemoteOutlet,
    RequestCtx, RequestHandle, RequestId, RequestInput, RequestSpec, Role, SamplingOverrides,
    SpeechStyle, Usage, VoiceClip, VoiceEncoder, VoiceReference, TRANSCRIBE_RATE,
};
pub use stage::{StageModel, StepOutput};
pub use tools::{ToolCall, ToolChoice, Tools};

/// Errors of the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Profile(#[from] crate::profile::ProfileError),
    #[error("stage {stage}: {source}")]
    Model {
        stage: String,
        source: crate::models::ModelError,
    },
    #[error("invalid request: {0}")]
    BadRequest(String),
    #[error("the pipeline is shut down")]
    Closed,
    /// A stage has no live replica (all stopped, or none announced itself yet).
    #[error("stage_unavailable: {0}")]
    Unavailable(String),
}
