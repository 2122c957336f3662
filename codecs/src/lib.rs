//! Audio formats and transforms: PCM sample conversions, WAV, streaming
//! sample-rate conversion, Ogg Opus, raw Opus packets and G.711 for RTP.

pub mod flac;
pub mod g711;
pub mod mp3;
mod ogg_demux;
pub mod ogg_opus;
pub mod opus_frames;
pub mod pcm;
pub mod resample;
pub mod wav;

pub use ogg_opus::{decode_ogg_opus, OggOpusDecoder, OggOpusEncoder};
pub use resample::StreamResampler;

/// Errors of the codecs.
#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("wav: {0}")]
    Wav(#[from] hound::Error),
    #[error("{0}")]
    Invalid(String),
    #[error("unsupported sample rate {0} Hz (supported: 8000, 16000, 22050, 24000, 48000)")]
    UnsupportedRate(u32),
    #[error("resampler setup: {0}")]
    ResamplerSetup(#[from] rubato::ResamplerConstructionError),
    #[error("resampling: {0}")]
    Resample(#[from] rubato::ResampleError),
    #[error("opus: {0}")]
    Opus(#[from] opus::Error),
    #[error("ogg: {0}")]
    Ogg(#[from] ogg::OggReadError),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    /// Input that is not (or no longer) a well-formed Ogg Opus stream.
    #[error("malformed ogg opus: {0}")]
    Malformed(String),
    /// The stream stops before its end-of-stream page.
    #[error("truncated ogg opus: {0}")]
    Truncated(String),
}
