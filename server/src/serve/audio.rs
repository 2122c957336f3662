//! Pipeline audio (mono f32 at the pipeline's rate) -> a client's format,
//! streaming: PCM16, WAV (streaming header), MP3 or Ogg Opus.

// Some callers land after this file; the API is complete either way.
#![allow(dead_code)]

use omnistream_codecs::pcm::{f32_to_pcm16_le, pcm16_le_to_f32};
use omnistream_stages::engine::TRANSCRIBE_RATE;

use super::error::ClientError;
use omnistream_codecs::flac::FlacEncoder;
use omnistream_codecs::mp3::Mp3Encoder;
use omnistream_codecs::wav::{streaming_header, wav_bytes};
use omnistream_codecs::{CodecError, OggOpusEncoder, StreamResampler};

/// The rate of OpenAI's `pcm16` and `wav` output.
pub const OPENAI_PCM_RATE: u32 = 24_000;

/// A client's audio output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputFormat {
    /// Raw little-endian signed 16-bit mono.
    Pcm16 { rate: u32 },
    /// PCM16 mono in RIFF/WAV.
    Wav { rate: u32 },
    /// Opus in Ogg, 48 kHz mono.
    OggOpus,
    /// MP3 (LAME), 64 kbit/s mono.
    Mp3 { rate: u32 },
    /// FLAC, 16-bit mono, lossless.
    Flac { rate: u32 },
}

/// The names `from_name` takes, for error messages.
pub const SUPPORTED_NAMES: &str = "pcm16 (or pcm), wav, mp3, opus, flac";

impl OutputFormat {
    /// From OpenAI names: "pcm16"/"pcm" (24 kHz), "wav" (24 kHz), "mp3"
    /// (24 kHz), "opus" (Ogg Opus 48 kHz). Anything else (flac, aac, …) is
    /// an error naming the supported ones.
    pub fn from_name(name: &str) -> Result<Self, String> {
        match name {
            "pcm16" | "pcm" => Ok(Self::Pcm16 {
                rate: OPENAI_PCM_RATE,
            }),
            "wav" => Ok(Self::Wav {
                rate: OPENAI_PCM_RATE,
            }),
            "opus" => Ok(Self::OggOpus),
            "mp3" => Ok(Self::Mp3 {
                rate: OPENAI_PCM_RATE,
            }),
            "flac" => Ok(Self::Flac {
                rate: OPENAI_PCM_RATE,
            }),
            other => Err(format!(
                "unsupported audio format {other:?}; supported: {SUPPORTED_NAMES}"
            )),
        }
    }

    pub fn content_type(&self) -> &'static str {
        match self {
            Self::Pcm16 { .. } => "audio/pcm",
            Self::Wav { .. } => "audio/wav",
            Self::OggOpus => "audio/ogg",
            Self::Mp3 { .. } => "audio/mpeg",
            Self::Flac { .. } => "audio/flac",
        }
    }

    /// The sample rate of the bytes this format produces.
    pub fn rate(&self) -> u32 {
        match *self {
            Self::Pcm16 { rate }
            | Self::Wav { rate }
            | Self::Mp3 { rate }
            | Self::Flac { rate } => rate,
            Self::OggOpus => omnistream_codecs::ogg_opus::OPUS_RATE,
        }
    }
}

/// Streaming converter from the pipeline's f32 audio to the client's bytes.
pub struct AudioEncoder {
    inner: Inner,
}

enum Inner {
    // Boxed: the resampler's FFT state is large, the enum stays small.
    Pcm {
        resampler: Box<StreamResampler>,
        /// WAV: the streaming header, until the first bytes leave.
        header: Option<[u8; 44]>,
    },
    Opus(Box<OggOpusEncoder>),
    Mp3 {
        resampler: Box<StreamResampler>,
        enc: Box<Mp3Encoder>,
    },
    Flac {
        resampler: Box<StreamResampler>,
        enc: Box<FlacEncoder>,
    },
}

impl AudioEncoder {
    pub fn new(format: OutputFormat, input_rate: u32) -> Result<Self, CodecError> {
        let inner = match format {
            OutputFormat::Pcm16 { rate } => Inner::Pcm {
                resampler: Box::new(StreamResampler::new(input_rate, rate)?),
                header: None,
            },
            OutputFormat::Wav { rate } => Inner::Pcm {
                resampler: Box::new(StreamResampler::new(input_rate, rate)?),
                header: Some(streaming_header(rate)),
            },
            OutputFormat::OggOpus => Inner::Opus(Box::new(OggOpusEncoder::new(input_rate, None)?)),
            OutputFormat::Mp3 { rate } => Inner::Mp3 {
                resampler: Box::new(StreamResampler::new(input_rate, rate)?),
                enc: Box::new(Mp3Encoder::new(rate)?),
            },
            OutputFormat::Flac { rate } => Inner::Flac {
                resampler: Box::new(StreamResampler::new(input_rate, rate)?),
                enc: Box::new(FlacEncoder::new(rate)?),
            },
        };
        Ok(Self { inner })
    }

    /// Bytes ready to send now (for WAV the streaming header comes first).
    pub fn push(&mut self, samples: &[f32]) -> Result<Vec<u8>, CodecError> {
        match &mut self.inner {
            Inner::Pcm { resampler, header } => {
                let pcm = resampler.process(samples)?;
                Ok(with_header(header, f32_to_pcm16_le(&pcm)))
            }
            Inner::Opus(enc) => enc.push(samples),
            Inner::Mp3 { resampler, enc } => enc.push(&resampler.process(samples)?),
            Inner::Flac { resampler, enc } => enc.push(&resampler.process(samples)?),
        }
    }

    /// The rest: the resampler's tail, Opus's last pages (end of stream).
    pub fn finish(&mut self) -> Result<Vec<u8>, CodecError> {
        match &mut self.inner {
            Inner::Pcm { resampler, header } => {
                let pcm = resampler.flush()?;
                Ok(with_header(header, f32_to_pcm16_le(&pcm)))
            }
            Inner::Opus(enc) => enc.finish(),
            Inner::Mp3 { resampler, enc } => {
                let mut out = enc.push(&resampler.flush()?)?;
                out.extend(enc.finish()?);
                Ok(out)
            }
            Inner::Flac { resampler, enc } => {
                let mut out = enc.push(&resampler.flush()?)?;
                out.extend(enc.finish()?);
                Ok(out)
            }
        }
    }

    /// Whole-file encoding for non-streaming responses (WAV with real sizes).
    pub fn encode_all(
        format: OutputFormat,
        samples: &[f32],
        input_rate: u32,
    ) -> Result<Vec<u8>, CodecError> {
        match format {
            OutputFormat::Wav { rate } => {
                let mut r = StreamResampler::new(input_rate, rate)?;
                let mut pcm = r.process(samples)?;
                pcm.extend(r.flush()?);
                wav_bytes(&pcm, rate)
            }
            OutputFormat::Pcm16 { .. }
            | OutputFormat::OggOpus
            | OutputFormat::Mp3 { .. }
            | OutputFormat::Flac { .. } => {
                let mut enc = Self::new(format, input_rate)?;
                let mut out = enc.push(samples)?;
                out.extend(enc.finish()?);
                Ok(out)
            }
        }
    }
}

/// Prepends the pending header (once) to `body`.
fn with_header(header: &mut Option<[u8; 44]>, body: Vec<u8>) -> Vec<u8> {
    match header.take() {
        Some(h) => {
            let mut out = Vec::with_capacity(44 + body.len());
            out.extend_from_slice(&h);
            out.extend(body);
            out
        }
        None => body,
    }
}

/// PCM16 LE mono at `rate` -> f32 at the Listener's rate.
pub fn to_listener_rate(pcm16: &[u8], rate: u32) -> Result<Vec<f32>, ClientError> {
    let samples =
        pcm16_le_to_f32(pcm16).map_err(|e| ClientError::invalid("invalid_audio", e.to_string()))?;
    resample(&samples, rate)
}

/// Mono f32 at `rate` -> the Listener's rate.
pub fn resample(samples: &[f32], rate: u32) -> Result<Vec<f32>, ClientError> {
    if rate == TRANSCRIBE_RATE {
        return Ok(samples.to_vec());
    }
    let bad = |e: omnistream_codecs::CodecError| {
        ClientError::invalid("unsupported_sample_rate", e.to_string())
    };
    let mut r = StreamResampler::new(rate, TRANSCRIBE_RATE).map_err(bad)?;
    let mut out = r.process(samples).map_err(bad)?;
    out.extend(r.flush().map_err(bad)?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnistream_codecs::pcm::pcm16_le_to_f32;

    const PIPELINE_RATE: u32 = 22_050;

    fn sine(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| 0.4 * (2.0 * std::f32::consts::PI * 440.0 * i as f32 / 22_050.0).sin())
            .collect()
    }

    /// `x` (a second) encoded in tenths of a second, as an answer comes:
    /// all its bytes, and how many tenths gave some at once.
    fn stream_in_tenths(f: OutputFormat, x: &[f32]) -> (Vec<u8>, usize) {
        let mut e = AudioEncoder::new(f, PIPELINE_RATE).unwrap();
        let (mut out, mut early) = (Vec::new(), 0);
        for c in x.chunks(2_205) {
            let b = e.push(c).unwrap();
            early += usize::from(!b.is_empty());
            out.extend(b);
        }
        out.extend(e.finish().unwrap());
        (out, early)
    }

    #[test]
    fn mp3_streams_frames_as_the_audio_comes() {
        let f = OutputFormat::from_name("mp3").unwrap();
        assert_eq!(f, OutputFormat::Mp3 { rate: 24_000 });
        assert_eq!(f.content_type(), "audio/mpeg");
        let x = sine(22_050);
        let (streamed, early) = stream_in_tenths(f, &x);
        assert!(early >= 5, "{early} of 10 chunks gave frames");
        assert_eq!(streamed[0], 0xFF, "frame sync");
        let whole = AudioEncoder::encode_all(f, &x, PIPELINE_RATE).unwrap();
        // One second at 64 kbit/s, however it was fed.
        for n in [streamed.len(), whole.len()] {
            assert!((7_000..=10_000).contains(&n), "{n} bytes");
        }
    }

    #[test]
    fn flac_streams_blocks_as_the_audio_comes() {
        let f = OutputFormat::from_name("flac").unwrap();
        assert_eq!(f, OutputFormat::Flac { rate: 24_000 });
        assert_eq!(f.content_type(), "audio/flac");
        let x = sine(22_050);
        let (streamed, early) = stream_in_tenths(f, &x);
        // The header at once, then a 4,096-sample block about every other chunk.
        assert!(early >= 5, "{early} of 10 chunks gave bytes");
        assert_eq!(&streamed[..4], b"fLaC");
        let whole = AudioEncoder::encode_all(f, &x, PIPELINE_RATE).unwrap();
        assert_eq!(streamed, whole, "however it was fed");
    }

    #[test]
    fn names_and_content_types() {
        assert_eq!(
            OutputFormat::from_name("pcm16"),
            Ok(OutputFormat::Pcm16 { rate: 24_000 })
        );
        assert_eq!(
            OutputFormat::from_name("pcm"),
            Ok(OutputFormat::Pcm16 { rate: 24_000 })
        );
        assert_eq!(
            OutputFormat::from_name("wav"),
            Ok(OutputFormat::Wav { rate: 24_000 })
        );
        assert_eq!(OutputFormat::from_name("opus"), Ok(OutputFormat::OggOpus));
        for bad in ["aac", "", "PCM16"] {
            let e = OutputFormat::from_name(bad).unwrap_err();
            assert!(
                e.contains("pcm16") && e.contains("wav") && e.contains("opus"),
                "{e}"
            );
        }
        assert_eq!(
            OutputFormat::Pcm16 { rate: 24_000 }.content_type(),
            "audio/pcm"
        );
        assert_eq!(
            OutputFormat::Wav { rate: 24_000 }.content_type(),
            "audio/wav"
        );
        assert_eq!(OutputFormat::OggOpus.content_type(), "audio/ogg");
        assert_eq!(OutputFormat::OggOpus.rate(), 48_000);
    }

    #[test]
    fn pcm16_streams_resampled_and_matches_whole() {
        let x = sine(22_050);
        let f = OutputFormat::Pcm16 { rate: 24_000 };
        let mut enc = AudioEncoder::new(f, PIPELINE_RATE).unwrap();
        let mut streamed = Vec::new();
        for c in x.chunks(1234) {
            streamed.extend(enc.push(c).unwrap());
        }
        streamed.extend(enc.finish().unwrap());
        assert_eq!(streamed.len(), 24_000 * 2, "1 s of 24 kHz PCM16");
        assert_eq!(
            streamed,
            AudioEncoder::encode_all(f, &x, PIPELINE_RATE).unwrap()
        );
        let y = pcm16_le_to_f32(&streamed).unwrap();
        let peak = y.iter().fold(0f32, |m, s| m.max(s.abs()));
        assert!((peak - 0.4).abs() < 0.01, "peak {peak}");
    }

    #[test]
    fn wav_streams_header_first_and_whole_has_sizes() {
        let x = sine(2205);
        let f = OutputFormat::Wav { rate: 24_000 };
        let mut enc = AudioEncoder::new(f, PIPELINE_RATE).unwrap();
        let first = enc.push(&x[..100]).unwrap();
        assert_eq!(&first[..44], &streaming_header(24_000)[..]);
        let mut rest = enc.push(&x[100..]).unwrap();
        rest.extend(enc.finish().unwrap());
        assert_ne!(rest.get(..4), Some(&b"RIFF"[..]), "header only once");
        assert_eq!(first.len() - 44 + rest.len(), 2400 * 2);
        // A stream with no audio is still a valid (empty) WAV stream.
        let mut empty = AudioEncoder::new(f, PIPELINE_RATE).unwrap();
        assert_eq!(empty.finish().unwrap().len(), 44);

        let whole = AudioEncoder::encode_all(f, &x, PIPELINE_RATE).unwrap();
        // Real sizes (hound writes the canonical 44-byte layout).
        let u32_at =
            |i: usize| u32::from_le_bytes([whole[i], whole[i + 1], whole[i + 2], whole[i + 3]]);
        assert_eq!(u32_at(24), 24_000);
        assert_eq!(u32_at(40), 2400 * 2, "data size");
        assert_eq!(u32_at(4) as usize, whole.len() - 8, "RIFF size");
    }

    #[test]
    fn opus_streams_and_decodes() {
        let x = sine(22_050);
        let mut enc = AudioEncoder::new(OutputFormat::OggOpus, PIPELINE_RATE).unwrap();
        let mut bytes = Vec::new();
        for c in x.chunks(4410) {
            bytes.extend(enc.push(c).unwrap());
        }
        bytes.extend(enc.finish().unwrap());
        assert_eq!(&bytes[..4], b"OggS");
        let (y, rate) = omnistream_codecs::decode_ogg_opus(&bytes).unwrap();
        assert_eq!(rate, 48_000);
        assert!(y.len().abs_diff(48_000) <= 960);
        let whole = AudioEncoder::encode_all(OutputFormat::OggOpus, &x, PIPELINE_RATE).unwrap();
        assert_eq!(
            omnistream_codecs::decode_ogg_opus(&whole).unwrap().0.len(),
            y.len()
        );
    }

    #[test]
    fn bad_rates_are_errors() {
        assert!(AudioEncoder::new(OutputFormat::Pcm16 { rate: 44_100 }, PIPELINE_RATE).is_err());
        assert!(AudioEncoder::new(OutputFormat::OggOpus, 11_025).is_err());
    }
}
