//! Audio formats and transforms: PCM sample conversions and WAV.

pub mod pcm;
pub mod wav;

/// Errors of the codecs.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("wav: {0}")]
    Wav(#[from] hound::Error),
    #[error("{0}")]
    Invalid(String),
}
