//! MP3 out, streamed: OpenAI's default speech format. LAME through
//! `mp3lame-encoder` (built from LAME 3.100's bundled source), mono, constant
//! 64 kbit/s: frames leave as soon as LAME has them, and the concatenation
//! of every chunk is one valid MP3 stream.

use mp3lame_encoder::{max_required_buffer_size, Bitrate, Builder, FlushNoGap, MonoPcm, Quality};

use crate::CodecError;

/// The MPEG sample rates LAME takes as they are.
pub const MP3_RATES: [u32; 9] = [
    8_000, 11_025, 12_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000,
];

/// A streaming MP3 encoder of mono f32 samples.
pub struct Mp3Encoder {
    enc: Lame,
}

/// LAME's encoder state is one heap object that this wrapper owns alone and
/// only ever touches through `&mut self`; LAME keeps no thread-local state,
/// so moving it to another thread is sound (the crate's type does not say
/// so because it holds a raw pointer).
struct Lame(mp3lame_encoder::Encoder);
// SAFETY: see above; `Lame` is never shared (no `Sync`), only moved.
unsafe impl Send for Lame {}

fn lame_err(what: &str, e: impl std::fmt::Display) -> CodecError {
    CodecError::Invalid(format!("mp3 {what}: {e}"))
}

impl Mp3Encoder {
    pub fn new(rate: u32) -> Result<Self, CodecError> {
        if !MP3_RATES.contains(&rate) {
            return Err(CodecError::Invalid(format!(
                "mp3: {rate} Hz is not an MPEG sample rate ({MP3_RATES:?})"
            )));
        }
        let mut b = Builder::new().ok_or_else(|| lame_err("setup", "LAME could not start"))?;
        b.set_num_channels(1).map_err(|e| lame_err("channels", e))?;
        b.set_sample_rate(rate).map_err(|e| lame_err("rate", e))?;
        b.set_brate(Bitrate::Kbps64)
            .map_err(|e| lame_err("bitrate", e))?;
        b.set_quality(Quality::Good)
            .map_err(|e| lame_err("quality", e))?;
        let enc = b.build().map_err(|e| lame_err("setup", e))?;
        Ok(Self { enc: Lame(enc) })
    }

    /// The MP3 frames ready after `samples` (maybe none: LAME holds a frame
    /// and its look-ahead).
    pub fn push(&mut self, samples: &[f32]) -> Result<Vec<u8>, CodecError> {
        let mut out = Vec::with_capacity(max_required_buffer_size(samples.len()));
        // LAME takes floats in [-1, 1] and clips nothing itself.
        let clipped: Vec<f32> = samples.iter().map(|x| x.clamp(-1.0, 1.0)).collect();
        self.enc
            .0
            .encode_to_vec(MonoPcm(clipped.as_slice()), &mut out)
            .map_err(|e| lame_err("encode", e))?;
        Ok(out)
    }

    /// The last frames (the held samples, padded to a whole frame).
    pub fn finish(&mut self) -> Result<Vec<u8>, CodecError> {
        let mut out = Vec::with_capacity(max_required_buffer_size(4_608));
        self.enc
            .0
            .flush_to_vec::<FlushNoGap>(&mut out)
            .map_err(|e| lame_err("flush", e))?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MPEG-2 Layer III frame headers from the start of `bytes`: (count,
    /// samples per frame × count). Each header gives its frame's length.
    fn frames(bytes: &[u8], rate: u32) -> usize {
        let (mut i, mut n) = (0, 0);
        while i + 4 <= bytes.len() {
            let h = &bytes[i..i + 4];
            assert!(
                h[0] == 0xFF && h[1] & 0xE0 == 0xE0,
                "no frame sync at byte {i}"
            );
            let mpeg1 = h[1] & 0x18 == 0x18;
            let kbps: [u32; 16] = if mpeg1 {
                [
                    0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 0,
                ]
            } else {
                [
                    0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160, 0,
                ]
            };
            let bitrate = kbps[usize::from(h[2] >> 4)] * 1000;
            let padding = u32::from((h[2] >> 1) & 1);
            let coef = if mpeg1 { 144 } else { 72 };
            let len = (coef * bitrate / rate + padding) as usize;
            assert!(len > 4, "bad frame length at byte {i}");
            i += len;
            n += 1;
        }
        assert_eq!(i, bytes.len(), "a partial frame at the end");
        n
    }

    #[test]
    fn streamed_chunks_make_one_valid_stream() {
        let rate = 24_000;
        let tone: Vec<f32> = (0..rate as usize)
            .map(|i| (i as f32 * 440.0 * std::f32::consts::TAU / rate as f32).sin() * 0.5)
            .collect();
        let mut enc = Mp3Encoder::new(rate).unwrap();
        let mut out = Vec::new();
        let mut chunks_with_bytes = 0;
        for chunk in tone.chunks(960) {
            let b = enc.push(chunk).unwrap();
            chunks_with_bytes += usize::from(!b.is_empty());
            out.extend(b);
        }
        out.extend(enc.finish().unwrap());
        // Frames left while the audio came, not only at the end.
        assert!(chunks_with_bytes > 10, "{chunks_with_bytes}");
        // One second at 24 kHz: 576 samples a frame (MPEG-2), about 42 frames
        // (more with the encoder's delay and padding).
        let n = frames(&out, rate);
        assert!((42..=48).contains(&n), "{n} frames");
        // 64 kbit/s for about a second.
        assert!((7_000..=10_000).contains(&out.len()), "{} bytes", out.len());
        assert!(Mp3Encoder::new(23_000).is_err());
        // Out-of-range input is clipped, not an error.
        assert!(Mp3Encoder::new(rate)
            .unwrap()
            .push(&[2.0, -3.0, f32::NAN])
            .is_ok());
    }
}
