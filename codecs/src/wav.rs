//! WAV (RIFF, PCM16 mono) through hound, plus a streaming header for output
//! whose length is not known when the first bytes leave.

use std::io::Cursor;
use std::path::Path;

use crate::pcm::f32_to_i16;
use crate::CodecError;

fn spec(sample_rate: u32) -> hound::WavSpec {
    hound::WavSpec {
        channels: 1,
        sample_rate,
        bits_per_sample: 16,
        sample_format: hound::SampleFormat::Int,
    }
}

/// Writes mono f32 samples as a 16-bit WAV file.
pub fn write_wav(path: &Path, samples: &[f32], sample_rate: u32) -> Result<(), CodecError> {
    let mut w = hound::WavWriter::create(path, spec(sample_rate))?;
    for &s in samples {
        w.write_sample(f32_to_i16(s))?;
    }
    w.finalize()?;
    Ok(())
}

/// A complete WAV file in memory.
pub fn wav_bytes(samples: &[f32], sample_rate: u32) -> Result<Vec<u8>, CodecError> {
    let mut buf = Cursor::new(Vec::new());
    {
        let mut w = hound::WavWriter::new(&mut buf, spec(sample_rate))?;
        for &s in samples {
            w.write_sample(f32_to_i16(s))?;
        }
        w.finalize()?;
    }
    Ok(buf.into_inner())
}

/// Reads a WAV file as mono f32 (multi-channel input is averaged) and its rate.
pub fn read_wav(path: &Path) -> Result<(Vec<f32>, u32), CodecError> {
    let mut r = hound::WavReader::open(path)?;
    let spec = r.spec();
    let ch = spec.channels.max(1) as usize;
    let interleaved: Vec<f32> = match spec.sample_format {
        hound::SampleFormat::Float => r.samples::<f32>().collect::<Result<_, _>>()?,
        hound::SampleFormat::Int => {
            let scale = 1.0 / (1u64 << (spec.bits_per_sample.saturating_sub(1))) as f32;
            r.samples::<i32>()
                .map(|s| s.map(|v| v as f32 * scale))
                .collect::<Result<_, _>>()?
        }
    };
    let mono = interleaved
        .chunks(ch)
        .map(|f| f.iter().sum::<f32>() / ch as f32)
        .collect();
    Ok((mono, spec.sample_rate))
}

/// The 44-byte header of a PCM16 mono WAV stream of unknown length: the RIFF and
/// data sizes are set to the largest even value, which players read as "until
/// the end" (even, because readers check it is a whole number of samples).
pub fn streaming_header(sample_rate: u32) -> [u8; 44] {
    let mut h = [0u8; 44];
    let byte_rate = sample_rate * 2;
    h[0..4].copy_from_slice(b"RIFF");
    h[4..8].copy_from_slice(&(u32::MAX - 1).to_le_bytes());
    h[8..12].copy_from_slice(b"WAVE");
    h[12..16].copy_from_slice(b"fmt ");
    h[16..20].copy_from_slice(&16u32.to_le_bytes());
    h[20..22].copy_from_slice(&1u16.to_le_bytes()); // PCM
    h[22..24].copy_from_slice(&1u16.to_le_bytes()); // mono
    h[24..28].copy_from_slice(&sample_rate.to_le_bytes());
    h[28..32].copy_from_slice(&byte_rate.to_le_bytes());
    h[32..34].copy_from_slice(&2u16.to_le_bytes()); // block align
    h[34..36].copy_from_slice(&16u16.to_le_bytes()); // bits
    h[36..40].copy_from_slice(b"data");
    h[40..44].copy_from_slice(&(u32::MAX - 1).to_le_bytes());
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.wav");
        let xs: Vec<f32> = (0..2205).map(|i| (i as f32 * 0.05).sin() * 0.5).collect();
        write_wav(&p, &xs, 22050).unwrap();
        let (ys, rate) = read_wav(&p).unwrap();
        assert_eq!(rate, 22050);
        assert_eq!(ys.len(), xs.len());
        for (a, b) in xs.iter().zip(&ys) {
            assert!((a - b).abs() < 1e-4);
        }
        let bytes = wav_bytes(&xs, 22050).unwrap();
        assert_eq!(bytes.len(), 44 + xs.len() * 2);
    }

    #[test]
    fn streaming_header_is_read_by_hound() {
        let mut bytes = streaming_header(24000).to_vec();
        bytes.extend(crate::pcm::f32_to_pcm16_le(&[0.1, -0.1, 0.2]));
        let mut r = hound::WavReader::new(Cursor::new(bytes)).unwrap();
        assert_eq!(r.spec().sample_rate, 24000);
        assert_eq!(r.spec().channels, 1);
        assert_eq!(r.spec().bits_per_sample, 16);
        let got: Vec<i16> = r.samples::<i16>().take(3).map(|s| s.unwrap()).collect();
        assert_eq!(got, vec![3277, -3277, 6553]);
    }
}
