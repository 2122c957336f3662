//! WAV (RIFF, PCM16 mono) through hound, plus a streaming header for output
//! whose length is not known when the first bytes leave.

use std::cell::Cell;
use std::io::{Cursor, Read};
use std::path::Path;
use std::rc::Rc;

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

/// A data chunk declaring at least this many bytes (just under 2 GiB) is a
/// stream of unknown length: writers that cannot seek back put the largest
/// size there (as [`streaming_header`] does).
const STREAMING_DATA_LEN: u64 = 0x7FFF_0000;

/// Reads a WAV file as mono f32 (multi-channel input is averaged) and its rate.
pub fn read_wav(path: &Path) -> Result<(Vec<f32>, u32), CodecError> {
    // hound::WavReader::open, with the end of input marked.
    let file = std::fs::File::open(path).map_err(hound::Error::IoError)?;
    let len = file.metadata().map_err(hound::Error::IoError)?.len();
    let (input, eof) = EofMark::new(std::io::BufReader::new(file));
    samples_of(hound::WavReader::new(input)?, len, &eof)
}

/// [`read_wav`] from memory. Any malformed or truncated input is an error
/// (never a panic); a streamed WAV whose header declares the unknown length
/// gives the samples up to the end of `bytes`.
pub fn parse_wav(bytes: &[u8]) -> Result<(Vec<f32>, u32), CodecError> {
    let (input, eof) = EofMark::new(Cursor::new(bytes));
    samples_of(hound::WavReader::new(input)?, bytes.len() as u64, &eof)
}

/// Notes when the input runs out: hound reports a short read as a generic
/// I/O error, and only a read past the end may end an open-ended data chunk.
struct EofMark<R> {
    inner: R,
    hit: Rc<Cell<bool>>,
}

impl<R> EofMark<R> {
    fn new(inner: R) -> (Self, Rc<Cell<bool>>) {
        let hit = Rc::new(Cell::new(false));
        (
            Self {
                inner,
                hit: hit.clone(),
            },
            hit,
        )
    }
}

impl<R: Read> Read for EofMark<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.hit.set(true);
        }
        Ok(n)
    }
}

/// The samples of `r` as mono f32; `input_len` is the whole input's size.
fn samples_of<R: Read>(
    mut r: hound::WavReader<R>,
    input_len: u64,
    eof: &Cell<bool>,
) -> Result<(Vec<f32>, u32), CodecError> {
    let spec = r.spec();
    let ch = spec.channels.max(1) as usize;
    let bits = spec.bits_per_sample;
    if !(1..=32).contains(&bits) {
        return Err(CodecError::Invalid(format!(
            "wav: {bits} bits per sample is not supported"
        )));
    }
    let sample_bytes = (bits as u64).div_ceil(8);
    let declared = r.len() as u64 * sample_bytes;
    let open_ended = declared >= STREAMING_DATA_LEN && declared > input_len;
    // Never reserve more than the input can hold.
    let mut interleaved: Vec<f32> =
        Vec::with_capacity((r.len() as u64).min(input_len / sample_bytes) as usize);
    // An open-ended data chunk ends where the input does.
    let at_end =
        |e: &hound::Error| open_ended && eof.get() && matches!(e, hound::Error::IoError(_));
    match spec.sample_format {
        hound::SampleFormat::Float => {
            for s in r.samples::<f32>() {
                match s {
                    Ok(v) => interleaved.push(v),
                    Err(e) if at_end(&e) => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        hound::SampleFormat::Int => {
            let scale = 1.0 / (1u64 << (bits - 1)) as f32;
            for s in r.samples::<i32>() {
                match s {
                    Ok(v) => interleaved.push(v as f32 * scale),
                    Err(e) if at_end(&e) => break,
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    // chunks_exact: a cut-off last frame (open-ended input only) is dropped.
    let mono = interleaved
        .chunks_exact(ch)
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

    fn hound_bytes(
        spec: hound::WavSpec,
        write: impl Fn(&mut hound::WavWriter<&mut Cursor<Vec<u8>>>),
    ) -> Vec<u8> {
        let mut buf = Cursor::new(Vec::new());
        {
            let mut w = hound::WavWriter::new(&mut buf, spec).unwrap();
            write(&mut w);
            w.finalize().unwrap();
        }
        buf.into_inner()
    }

    #[test]
    fn parse_matches_read_and_formats() {
        let xs: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.03).sin() * 0.7).collect();
        let bytes = wav_bytes(&xs, 16_000).unwrap();
        let (ys, rate) = parse_wav(&bytes).unwrap();
        assert_eq!(rate, 16_000);
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.wav");
        std::fs::write(&p, &bytes).unwrap();
        assert_eq!(read_wav(&p).unwrap(), (ys.clone(), 16_000));
        for (a, b) in xs.iter().zip(&ys) {
            assert!((a - b).abs() < 1e-4);
        }
        // Stereo is averaged.
        let st = hound::WavSpec {
            channels: 2,
            sample_rate: 8000,
            bits_per_sample: 16,
            sample_format: hound::SampleFormat::Int,
        };
        let b = hound_bytes(st, |w| {
            for (l, r) in [(16384i16, 0i16), (-32768, -32768), (8192, 8192)] {
                w.write_sample(l).unwrap();
                w.write_sample(r).unwrap();
            }
        });
        assert_eq!(parse_wav(&b).unwrap(), (vec![0.25, -1.0, 0.25], 8000));
        // 8-bit (unsigned in the file), 24-bit and float.
        let b = hound_bytes(
            hound::WavSpec {
                bits_per_sample: 8,
                channels: 1,
                ..st
            },
            |w| {
                for v in [-128i8, 0, 64] {
                    w.write_sample(v).unwrap();
                }
            },
        );
        assert_eq!(parse_wav(&b).unwrap().0, [-1.0, 0.0, 0.5]);
        let b = hound_bytes(
            hound::WavSpec {
                bits_per_sample: 24,
                channels: 1,
                ..st
            },
            |w| {
                for v in [-(1i32 << 23), 1 << 22] {
                    w.write_sample(v).unwrap();
                }
            },
        );
        assert_eq!(parse_wav(&b).unwrap().0, [-1.0, 0.5]);
        let fl = hound::WavSpec {
            channels: 1,
            sample_rate: 24_000,
            bits_per_sample: 32,
            sample_format: hound::SampleFormat::Float,
        };
        let b = hound_bytes(fl, |w| {
            for v in [0.125f32, -0.5] {
                w.write_sample(v).unwrap();
            }
        });
        assert_eq!(parse_wav(&b).unwrap(), (vec![0.125, -0.5], 24_000));
    }

    #[test]
    fn streamed_wav_reads_to_the_end() {
        let mut bytes = streaming_header(24000).to_vec();
        bytes.extend(crate::pcm::f32_to_pcm16_le(&[0.1, -0.1, 0.2]));
        let (ys, rate) = parse_wav(&bytes).unwrap();
        assert_eq!(rate, 24000);
        assert_eq!(ys.len(), 3);
        assert!((ys[2] - 0.2).abs() < 1e-4);
        // A cut-off last sample is dropped.
        bytes.push(0x12);
        assert_eq!(parse_wav(&bytes).unwrap().0.len(), 3);
        // Just the header: no samples.
        assert!(parse_wav(&streaming_header(8000)).unwrap().0.is_empty());
    }

    #[test]
    fn garbage_and_truncation_are_errors_never_panics() {
        use rand::{Rng, SeedableRng};
        let xs: Vec<f32> = (0..300).map(|i| (i as f32 * 0.1).sin() * 0.5).collect();
        let bytes = wav_bytes(&xs, 22050).unwrap();
        assert!(parse_wav(&[]).is_err());
        assert!(parse_wav(b"RIFF").is_err());
        assert!(parse_wav(b"OggS\0\0\0\0\0\0\0\0\0\0\0\0").is_err());
        // Cut anywhere: the header or the data is short, an error either way.
        for cut in 0..bytes.len() {
            assert!(parse_wav(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for _ in 0..2000 {
            let mut b = bytes[..rng.gen_range(0..200)].to_vec();
            for _ in 0..rng.gen_range(1..6) {
                if !b.is_empty() {
                    let k = rng.gen_range(0..b.len());
                    b[k] = rng.gen();
                }
            }
            if let Ok((ys, _)) = parse_wav(&b) {
                assert!(ys.len() <= b.len());
            }
            let noise: Vec<u8> = (0..rng.gen_range(0..100)).map(|_| rng.gen()).collect();
            assert!(parse_wav(&noise).is_err());
        }
    }
}
