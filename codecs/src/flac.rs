//! FLAC out, streamed: lossless, for `response_format: "flac"`. `flacenc`
//! (pure Rust) encodes each 4,096-sample block as one frame the moment it is
//! full; the stream header goes out with the first frame and says what a
//! live stream cannot know yet (total samples, MD5) as unknown, which the
//! format allows. The concatenation of every chunk is one valid FLAC file.

use flacenc::bitsink::ByteSink;
use flacenc::component::{BitRepr, Stream};
use flacenc::config;
use flacenc::error::{Verified, Verify};
use flacenc::source::{Fill, FrameBuf};

use crate::pcm::f32_to_i16;
use crate::CodecError;

/// Samples per frame (one channel): the reference encoder's default.
pub const FLAC_BLOCK: usize = 4_096;

/// A streaming FLAC encoder of mono f32 samples, 16-bit.
pub struct FlacEncoder {
    config: Verified<config::Encoder>,
    /// Its STREAMINFO (and no frames): written once, first.
    header: Option<Stream>,
    info: flacenc::component::StreamInfo,
    buf: FrameBuf,
    pending: Vec<i32>,
    frame: usize,
}

fn flac_err(what: &str, e: impl std::fmt::Debug) -> CodecError {
    CodecError::Invalid(format!("flac {what}: {e:?}"))
}

impl FlacEncoder {
    pub fn new(rate: u32) -> Result<Self, CodecError> {
        // STREAMINFO holds 20 bits of rate; frame headers up to 655,350 Hz.
        if !(1..=655_350).contains(&rate) {
            return Err(CodecError::Invalid(format!(
                "flac: {rate} Hz is not a FLAC sample rate"
            )));
        }
        let mut header =
            Stream::new(rate as usize, 1, 16).map_err(|e| flac_err("stream header", e))?;
        let info = header.stream_info_mut();
        info.set_block_sizes(FLAC_BLOCK, FLAC_BLOCK)
            .map_err(|e| flac_err("block size", e))?;
        // Frame sizes are not known ahead: 0 says so.
        info.set_frame_sizes(0, 0)
            .map_err(|e| flac_err("frame size", e))?;
        let info = header.stream_info().clone();
        let config = config::Encoder::default()
            .into_verified()
            .map_err(|(_, e)| flac_err("config", e))?;
        Ok(Self {
            config,
            header: Some(header),
            info,
            buf: FrameBuf::with_size(1, FLAC_BLOCK).map_err(|e| flac_err("buffer", e))?,
            pending: Vec::with_capacity(FLAC_BLOCK),
            frame: 0,
        })
    }

    /// What is ready after `samples`: the stream header the first time, and
    /// each block filled.
    pub fn push(&mut self, samples: &[f32]) -> Result<Vec<u8>, CodecError> {
        let mut out = ByteSink::new();
        self.write_header(&mut out)?;
        for &x in samples {
            self.pending.push(i32::from(f32_to_i16(x)));
            if self.pending.len() == FLAC_BLOCK {
                self.write_block(&mut out)?;
            }
        }
        Ok(out.into_inner())
    }

    /// The last frame (the samples held, a shorter block).
    pub fn finish(&mut self) -> Result<Vec<u8>, CodecError> {
        let mut out = ByteSink::new();
        if !self.pending.is_empty() || self.header.is_some() {
            self.write_block(&mut out)?;
        }
        Ok(out.into_inner())
    }

    fn write_header(&mut self, out: &mut ByteSink) -> Result<(), CodecError> {
        if let Some(h) = self.header.take() {
            h.write(out).map_err(|e| flac_err("header", e))?;
        }
        Ok(())
    }

    /// The header if not yet written, then the pending samples as a frame.
    fn write_block(&mut self, out: &mut ByteSink) -> Result<(), CodecError> {
        self.write_header(out)?;
        if self.pending.is_empty() {
            return Ok(());
        }
        self.buf
            .fill_interleaved(&self.pending)
            .map_err(|e| flac_err("samples", e))?;
        let frame =
            flacenc::encode_fixed_size_frame(&self.config, &self.buf, self.frame, &self.info)
                .map_err(|e| flac_err("frame", e))?;
        frame.write(out).map_err(|e| flac_err("frame", e))?;
        self.frame += 1;
        self.pending.clear();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flacenc::component::{parser, Decode};

    #[test]
    fn streamed_chunks_make_one_lossless_stream() {
        let rate = 24_000;
        // A second and a bit: full blocks and a short last one.
        let tone: Vec<f32> = (0..30_000)
            .map(|i| (i as f32 * 440.0 * std::f32::consts::TAU / rate as f32).sin() * 0.5)
            .collect();
        let mut enc = FlacEncoder::new(rate).unwrap();
        let mut out = Vec::new();
        let mut chunks_with_bytes = 0;
        for chunk in tone.chunks(960) {
            let b = enc.push(chunk).unwrap();
            chunks_with_bytes += usize::from(!b.is_empty());
            out.extend(b);
        }
        out.extend(enc.finish().unwrap());
        // The header at once, then frames as the audio came: 30,000 / 4,096
        // = 7 full blocks.
        assert_eq!(chunks_with_bytes, 8);
        assert_eq!(&out[..4], b"fLaC");
        let (rest, stream) = parser::stream::<()>(&out).expect("a FLAC stream");
        assert!(rest.is_empty(), "{} bytes after the stream", rest.len());
        assert_eq!(stream.stream_info().sample_rate(), rate as usize);
        assert_eq!(stream.frame_count(), 8);
        let decoded: Vec<i32> = (0..stream.frame_count())
            .flat_map(|n| stream.frame(n).unwrap().decode())
            .collect();
        let want: Vec<i32> = tone.iter().map(|&x| i32::from(f32_to_i16(x))).collect();
        assert_eq!(decoded, want, "lossless");
        // Compressed: a tone takes far less than 16 bits a sample.
        assert!(out.len() < want.len(), "{} bytes", out.len());
    }

    #[test]
    fn an_empty_answer_is_a_valid_empty_stream() {
        let mut enc = FlacEncoder::new(16_000).unwrap();
        let out = enc.finish().unwrap();
        // "fLaC", then STREAMINFO alone (the last metadata block, type 0):
        // a 4-byte block header and its 34 bytes.
        assert_eq!(&out[..4], b"fLaC");
        assert_eq!(out[4], 0x80);
        assert_eq!(out.len(), 4 + 4 + 34);
        let (_, info) = parser::stream_info::<()>(&out[8..]).expect("STREAMINFO");
        assert_eq!(info.sample_rate(), 16_000);
        assert!(enc.finish().unwrap().is_empty(), "once only");
        assert!(FlacEncoder::new(0).is_err());
    }
}
