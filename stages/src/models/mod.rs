//! The models stages run. One file (or folder) per model, config struct first.

pub mod linear;
pub mod phonemize;
pub mod piper;
pub mod quantized_llama;
pub mod qwen3_omni;
pub mod qwen3_tts;
pub mod silero_vad;
pub mod stft;
pub mod tokenizer;
pub mod whisper;

use std::path::PathBuf;

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid model file: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("phonemizer: {0}")]
    Phonemizer(String),
    #[error("{0}")]
    Invalid(String),
    /// The prompt leaves no room in the context (the client's fault: the server
    /// answers 400 `context_length_exceeded`, as OpenAI does).
    #[error("context_length_exceeded: the prompt is {prompt} tokens; this model's context is {context} tokens, prompt and answer together: shorten the messages")]
    ContextLength { prompt: usize, context: usize },
}

/// The error code of [`ModelError::ContextLength`], found in failed requests' messages.
pub const CONTEXT_LENGTH_EXCEEDED: &str = "context_length_exceeded";

pub type Result<T> = std::result::Result<T, ModelError>;
