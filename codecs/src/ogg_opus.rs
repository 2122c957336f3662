//! Ogg Opus (RFC 7845), mono, streaming.
//!
//! Opus comes from the system libopus through the `opus` crate, 0.3 line
//! (safe Encoder/Decoder over `audiopus_sys`, which links the libopus that
//! pkg-config finds: Debian's `libopus-dev`). Not `opus` 0.4: its
//! `opusic-sys` always builds a bundled libopus with CMake. Not `audiopus`:
//! its only maintained line is a pre-release. The Ogg framing is the pure-Rust
//! `ogg` crate.

use std::borrow::Cow;
use std::io::Cursor;

use ogg::{PacketReader, PacketWriteEndInfo, PacketWriter};

use crate::resample::StreamResampler;
use crate::CodecError;

/// Opus always runs at 48 kHz here; granule positions count 48 kHz samples.
pub const OPUS_RATE: u32 = 48_000;
/// 20 ms frames.
const FRAME: usize = 960;
/// Frames per Ogg page: a page leaves every 60 ms, so a listener waits at most
/// that long for audio that was already encoded.
const FRAMES_PER_PAGE: usize = 3;
/// Largest Opus packet (RFC 6716: 1275 bytes per frame) with headroom.
const MAX_PACKET: usize = 4000;
/// Longest Opus packet duration (120 ms at 48 kHz), per channel.
const MAX_PACKET_SAMPLES: usize = 5760;

/// Streaming encoder from mono f32 PCM to Ogg Opus bytes.
pub struct OggOpusEncoder {
    resampler: Option<StreamResampler>,
    enc: opus::Encoder,
    writer: PacketWriter<'static, Vec<u8>>,
    serial: u32,
    input_rate: u32,
    pre_skip: u16,
    /// 48 kHz samples waiting for a whole frame.
    buf: Vec<f32>,
    /// 48 kHz samples of real audio (not padding) taken in.
    samples_48k: u64,
    /// Opus packets written.
    packets: u64,
    frames_in_page: usize,
    headers_written: bool,
    finished: bool,
}

impl OggOpusEncoder {
    /// `input_rate`: one of [`crate::resample::SUPPORTED_RATES`] (resampled to
    /// 48 kHz inside). `bitrate`: bits per second (6,000..=510,000), or `None`
    /// for libopus's automatic choice.
    pub fn new(input_rate: u32, bitrate: Option<i32>) -> Result<Self, CodecError> {
        let resampler = if input_rate == OPUS_RATE {
            None
        } else {
            Some(StreamResampler::new(input_rate, OPUS_RATE)?)
        };
        let mut enc =
            opus::Encoder::new(OPUS_RATE, opus::Channels::Mono, opus::Application::Audio)?;
        if let Some(b) = bitrate {
            if !(6_000..=510_000).contains(&b) {
                return Err(CodecError::Invalid(format!(
                    "opus bitrate {b} b/s is out of range (6000..=510000)"
                )));
            }
            enc.set_bitrate(opus::Bitrate::Bits(b))?;
        }
        // The pipeline speaks; the hint tunes mode decisions for speech.
        enc.set_signal(opus::Signal::Voice)?;
        let lookahead = enc.get_lookahead()?;
        let pre_skip = u16::try_from(lookahead)
            .map_err(|_| CodecError::Invalid(format!("opus lookahead {lookahead} out of range")))?;
        Ok(Self {
            resampler,
            enc,
            writer: PacketWriter::new(Vec::new()),
            serial: random_serial(),
            input_rate,
            pre_skip,
            buf: Vec::with_capacity(FRAME * 4),
            samples_48k: 0,
            packets: 0,
            frames_in_page: 0,
            headers_written: false,
            finished: false,
        })
    }

    /// Samples (at 48 kHz) a decoder drops at the start (the encoder's lookahead).
    pub fn pre_skip(&self) -> u16 {
        self.pre_skip
    }

    /// Takes `pcm` (at the input rate); returns the bytes of the Ogg pages
    /// completed so far (the two header pages come with the first call).
    pub fn push(&mut self, pcm: &[f32]) -> Result<Vec<u8>, CodecError> {
        if self.finished {
            return Err(CodecError::Invalid(
                "ogg opus encoder already finished".into(),
            ));
        }
        self.write_headers()?;
        let pcm48 = match self.resampler.as_mut() {
            Some(r) => r.process(pcm)?,
            None => pcm.to_vec(),
        };
        self.samples_48k += pcm48.len() as u64;
        self.buf.extend_from_slice(&pcm48);
        self.encode_full_frames()?;
        Ok(self.take_bytes())
    }

    /// Ends the stream: encodes the rest (padded with silence so the encoder's
    /// lookahead comes out), sets the final granule position to the real end
    /// and writes the end-of-stream page.
    pub fn finish(&mut self) -> Result<Vec<u8>, CodecError> {
        if self.finished {
            return Err(CodecError::Invalid(
                "ogg opus encoder already finished".into(),
            ));
        }
        self.write_headers()?;
        if let Some(r) = self.resampler.as_mut() {
            let tail = r.flush()?;
            self.samples_48k += tail.len() as u64;
            self.buf.extend_from_slice(&tail);
        }
        self.encode_full_frames()?;
        let end_granule = self.pre_skip as u64 + self.samples_48k;
        // Enough frames to cover the lookahead, and at least one to carry the
        // end-of-stream flag.
        let needed = end_granule.div_ceil(FRAME as u64).max(self.packets + 1);
        while self.packets < needed {
            self.buf.resize(FRAME, 0.0);
            let last = self.packets + 1 == needed;
            let granule = if last {
                end_granule
            } else {
                (self.packets + 1) * FRAME as u64
            };
            self.encode_frame(
                if last {
                    PacketWriteEndInfo::EndStream
                } else {
                    PacketWriteEndInfo::NormalPacket
                },
                granule,
            )?;
        }
        self.finished = true;
        Ok(self.take_bytes())
    }

    fn write_headers(&mut self) -> Result<(), CodecError> {
        if self.headers_written {
            return Ok(());
        }
        // RFC 7845 5.1: OpusHead, version 1, mono, mapping family 0.
        let mut head = Vec::with_capacity(19);
        head.extend_from_slice(b"OpusHead");
        head.push(1);
        head.push(1);
        head.extend_from_slice(&self.pre_skip.to_le_bytes());
        head.extend_from_slice(&self.input_rate.to_le_bytes());
        head.extend_from_slice(&0i16.to_le_bytes());
        head.push(0);
        // RFC 7845 5.2: OpusTags, vendor string and no comments.
        let vendor = format!("omnistream ({})", opus::version());
        let mut tags = Vec::with_capacity(16 + vendor.len());
        tags.extend_from_slice(b"OpusTags");
        tags.extend_from_slice(&(vendor.len() as u32).to_le_bytes());
        tags.extend_from_slice(vendor.as_bytes());
        tags.extend_from_slice(&0u32.to_le_bytes());
        // Each header packet ends its own page, with granule position 0.
        self.writer
            .write_packet(head, self.serial, PacketWriteEndInfo::EndPage, 0)?;
        self.writer
            .write_packet(tags, self.serial, PacketWriteEndInfo::EndPage, 0)?;
        self.headers_written = true;
        Ok(())
    }

    fn encode_full_frames(&mut self) -> Result<(), CodecError> {
        while self.buf.len() >= FRAME {
            let end = if self.frames_in_page + 1 >= FRAMES_PER_PAGE {
                PacketWriteEndInfo::EndPage
            } else {
                PacketWriteEndInfo::NormalPacket
            };
            self.encode_frame(end, (self.packets + 1) * FRAME as u64)?;
        }
        Ok(())
    }

    /// Encodes the first frame of `buf` as one packet with `granule`.
    fn encode_frame(&mut self, end: PacketWriteEndInfo, granule: u64) -> Result<(), CodecError> {
        let mut packet = vec![0u8; MAX_PACKET];
        let n = self.enc.encode_float(&self.buf[..FRAME], &mut packet)?;
        packet.truncate(n);
        self.buf.drain(..FRAME);
        self.writer
            .write_packet(Cow::Owned(packet), self.serial, end, granule)?;
        self.packets += 1;
        self.frames_in_page = if end == PacketWriteEndInfo::NormalPacket {
            self.frames_in_page + 1
        } else {
            0
        };
        Ok(())
    }

    fn take_bytes(&mut self) -> Vec<u8> {
        std::mem::take(self.writer.inner_mut())
    }
}

/// A stream serial number that differs between streams (RFC 3533 asks for
/// unique serials so streams can be chained); no crypto quality needed.
fn random_serial() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish() as u32
}

/// Demuxes and decodes a whole Ogg Opus stream (one logical stream, 1 or 2
/// channels, mapping family 0) to mono f32 at 48 kHz, with the pre-skip and
/// the end trim of the last granule position applied. Anything malformed or
/// cut short (no end-of-stream page) is an error.
pub fn decode_ogg_opus(bytes: &[u8]) -> Result<(Vec<f32>, u32), CodecError> {
    let mut rdr = PacketReader::new(Cursor::new(bytes));
    let head = rdr
        .read_packet()?
        .ok_or_else(|| CodecError::Truncated("no pages".into()))?;
    let d = &head.data;
    if d.len() < 19 || &d[..8] != b"OpusHead" {
        return Err(CodecError::Malformed("first packet is not OpusHead".into()));
    }
    if d[8] & 0xF0 != 0 {
        return Err(CodecError::Malformed(format!(
            "unsupported OpusHead version {}",
            d[8]
        )));
    }
    let channels = d[9] as usize;
    let pre_skip = u16::from_le_bytes([d[10], d[11]]) as usize;
    if d[18] != 0 || !(1..=2).contains(&channels) {
        return Err(CodecError::Malformed(format!(
            "unsupported channel mapping (family {}, {channels} channels)",
            d[18]
        )));
    }
    let serial = head.stream_serial();
    let next = |rdr: &mut PacketReader<Cursor<&[u8]>>| -> Result<Option<ogg::Packet>, CodecError> {
        match rdr.read_packet()? {
            Some(p) if p.stream_serial() != serial => {
                Err(CodecError::Malformed("more than one logical stream".into()))
            }
            other => Ok(other),
        }
    };
    if head.last_in_stream() {
        return Err(CodecError::Truncated("stream ends after OpusHead".into()));
    }
    let tags = next(&mut rdr)?.ok_or_else(|| CodecError::Truncated("no OpusTags".into()))?;
    if tags.data.len() < 8 || &tags.data[..8] != b"OpusTags" {
        return Err(CodecError::Malformed(
            "second packet is not OpusTags".into(),
        ));
    }
    let ch = if channels == 2 {
        opus::Channels::Stereo
    } else {
        opus::Channels::Mono
    };
    let mut dec = opus::Decoder::new(OPUS_RATE, ch)?;
    let mut frame = vec![0f32; MAX_PACKET_SAMPLES * channels];
    let mut pcm: Vec<f32> = Vec::new();
    let mut eos = tags.last_in_stream();
    // Granule position of the last completed page, and the offset of the
    // stream's granule clock from our decoded sample count (0 unless the
    // stream was cut from a longer one).
    let mut last_granule: Option<u64> = None;
    let mut offset: Option<i128> = None;
    while !eos {
        let Some(p) = next(&mut rdr)? else {
            return Err(CodecError::Truncated("no end-of-stream page".into()));
        };
        let n = dec.decode_float(&p.data, &mut frame, false)?;
        if channels == 2 {
            pcm.extend(frame[..2 * n].chunks_exact(2).map(|f| 0.5 * (f[0] + f[1])));
        } else {
            pcm.extend_from_slice(&frame[..n]);
        }
        eos = p.last_in_stream();
        // -1 marks a page on which no packet ends.
        if p.last_in_page() && p.absgp_page() != u64::MAX {
            let g = p.absgp_page();
            if offset.is_none() && !eos {
                let off = g as i128 - pcm.len() as i128;
                if off < 0 {
                    return Err(CodecError::Malformed(
                        "granule position before the decoded audio".into(),
                    ));
                }
                offset = Some(off);
            }
            last_granule = Some(g);
        }
    }
    let Some(end_granule) = last_granule else {
        return Err(CodecError::Malformed("no granule position".into()));
    };
    let end = end_granule as i128 - offset.unwrap_or(0);
    if end > pcm.len() as i128 {
        return Err(CodecError::Malformed(format!(
            "final granule position {end_granule} is past the {} decoded samples",
            pcm.len()
        )));
    }
    let end = end.max(0) as usize;
    let start = pre_skip.min(end);
    pcm.truncate(end);
    pcm.drain(..start);
    Ok((pcm, OPUS_RATE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn sine(freq: f32, rate: u32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| 0.5 * (2.0 * std::f32::consts::PI * freq * i as f32 / rate as f32).sin())
            .collect()
    }

    fn encode(x: &[f32], rate: u32, chunk: usize) -> Vec<u8> {
        let mut e = OggOpusEncoder::new(rate, Some(64_000)).unwrap();
        let mut out = Vec::new();
        for c in x.chunks(chunk) {
            out.extend(e.push(c).unwrap());
        }
        out.extend(e.finish().unwrap());
        out
    }

    /// One raw Ogg page.
    struct Page {
        flags: u8,
        granule: u64,
        serial: u32,
        seq: u32,
        body: Vec<u8>,
        /// Byte offset just past the page.
        end: usize,
    }

    /// The Ogg CRC-32 (polynomial 0x04c11db7, no reflection, zero init),
    /// written out here so the check does not trust the muxer's own code.
    fn ogg_crc(data: &[u8]) -> u32 {
        let mut crc = 0u32;
        for &b in data {
            crc ^= (b as u32) << 24;
            for _ in 0..8 {
                crc = if crc & 0x8000_0000 != 0 {
                    (crc << 1) ^ 0x04c1_1db7
                } else {
                    crc << 1
                };
            }
        }
        crc
    }

    /// Walks the raw pages, checking capture patterns, lengths and CRCs by hand.
    fn pages(bytes: &[u8]) -> Vec<Page> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            assert_eq!(&bytes[i..i + 4], b"OggS", "capture pattern at {i}");
            assert_eq!(bytes[i + 4], 0, "stream structure version");
            let nseg = bytes[i + 26] as usize;
            let lacing = &bytes[i + 27..i + 27 + nseg];
            let body_len: usize = lacing.iter().map(|&l| l as usize).sum();
            let end = i + 27 + nseg + body_len;
            let mut copy = bytes[i..end].to_vec();
            copy[22..26].fill(0);
            let crc = u32::from_le_bytes(bytes[i + 22..i + 26].try_into().unwrap());
            assert_eq!(ogg_crc(&copy), crc, "page CRC at {i}");
            out.push(Page {
                flags: bytes[i + 5],
                granule: u64::from_le_bytes(bytes[i + 6..i + 14].try_into().unwrap()),
                serial: u32::from_le_bytes(bytes[i + 14..i + 18].try_into().unwrap()),
                seq: u32::from_le_bytes(bytes[i + 18..i + 22].try_into().unwrap()),
                body: bytes[i + 27 + nseg..end].to_vec(),
                end,
            });
            i = end;
        }
        out
    }

    #[test]
    fn stream_structure_is_valid() {
        let x = sine(440.0, 22050, 22050);
        let bytes = encode(&x, 22050, 1000);
        let ps = pages(&bytes);
        assert!(ps.len() > 4);
        // Header pages: BOS flag, OpusHead alone, then OpusTags alone, granule 0.
        assert_eq!(ps[0].flags, 0x02);
        assert_eq!(&ps[0].body[..8], b"OpusHead");
        assert_eq!(ps[0].body.len(), 19);
        assert_eq!(ps[0].body[9], 1, "mono");
        let pre_skip = u16::from_le_bytes([ps[0].body[10], ps[0].body[11]]) as u64;
        assert!(pre_skip > 0);
        assert_eq!(
            u32::from_le_bytes(ps[0].body[12..16].try_into().unwrap()),
            22050
        );
        assert_eq!(ps[0].granule, 0);
        assert_eq!(&ps[1].body[..8], b"OpusTags");
        assert_eq!(ps[1].granule, 0);
        assert_eq!(ps[1].flags, 0);
        // Every page: one serial, consecutive sequence numbers, growing
        // granules, EOS on the last page only.
        for (k, p) in ps.iter().enumerate() {
            assert_eq!(p.serial, ps[0].serial);
            assert_eq!(p.seq, k as u32);
            assert_eq!(
                p.flags & 0x04 != 0,
                k + 1 == ps.len(),
                "EOS flag on page {k}"
            );
            if k >= 3 {
                assert!(p.granule > ps[k - 1].granule);
            }
        }
        // Audio pages hold FRAMES_PER_PAGE 20 ms frames: granule = frames * 960.
        assert_eq!(ps[2].granule, (FRAMES_PER_PAGE * FRAME) as u64);
        // The last granule marks the real end: pre-skip + 1 s at 48 kHz.
        assert_eq!(ps.last().unwrap().granule, pre_skip + 48_000);
    }

    #[test]
    fn sine_round_trips() {
        let x = sine(440.0, 22050, 22050);
        for chunk in [1000, 4410, 22050] {
            let bytes = encode(&x, 22050, chunk);
            let (y, rate) = decode_ogg_opus(&bytes).unwrap();
            assert_eq!(rate, 48_000);
            // 1 s at 48 kHz (the resampler's length rule), within one frame.
            assert!(y.len().abs_diff(48_000) <= FRAME, "len {}", y.len());
            let mut r = StreamResampler::new(22050, 48_000).unwrap();
            let want = [r.process(&x).unwrap(), r.flush().unwrap()].concat();
            let (a, b) = (2400, want.len().min(y.len()) - 2400);
            let dot: f64 = (a..b).map(|i| y[i] as f64 * want[i] as f64).sum();
            let ny: f64 = (a..b).map(|i| (y[i] as f64).powi(2)).sum();
            let nw: f64 = (a..b).map(|i| (want[i] as f64).powi(2)).sum();
            let corr = dot / (ny * nw).sqrt();
            assert!(corr > 0.95, "correlation {corr} (chunk {chunk})");
        }
    }

    #[test]
    fn pages_stream_out_early() {
        let mut e = OggOpusEncoder::new(22050, None).unwrap();
        let first = e.push(&[]).unwrap();
        assert_eq!(pages(&first).len(), 2, "headers come first, at once");
        // 100 ms of audio completes at least one audio page.
        let more = e.push(&sine(300.0, 22050, 2205)).unwrap();
        assert!(!pages(&more).is_empty());
        e.finish().unwrap();
        assert!(e.push(&[0.0]).is_err());
        assert!(e.finish().is_err());
    }

    #[test]
    fn empty_and_48k_streams_decode() {
        let bytes = encode(&[], 48_000, 10);
        let (y, _) = decode_ogg_opus(&bytes).unwrap();
        assert!(y.is_empty());
        let x = sine(1000.0, 48_000, 4800);
        let (y, _) = decode_ogg_opus(&encode(&x, 48_000, 777)).unwrap();
        assert_eq!(y.len(), 4800);
        assert!(OggOpusEncoder::new(44_100, None).is_err());
        assert!(OggOpusEncoder::new(22_050, Some(100)).is_err());
    }

    #[test]
    fn truncated_or_corrupt_input_is_an_error() {
        let bytes = encode(&sine(440.0, 22050, 22050), 22050, 2000);
        assert!(decode_ogg_opus(&[]).is_err());
        assert!(decode_ogg_opus(b"not an ogg stream at all").is_err());
        // Cut anywhere, including exactly at a page boundary.
        let page_ends: Vec<usize> = pages(&bytes).iter().map(|p| p.end).collect();
        for cut in [1, 10, 30, 60, 200, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode_ogg_opus(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        for &end in &page_ends[..page_ends.len() - 1] {
            if end < bytes.len() {
                assert!(
                    decode_ogg_opus(&bytes[..end]).is_err(),
                    "cut at page end {end}"
                );
            }
        }
        // Random corruption: an error or some audio, never a panic.
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for _ in 0..300 {
            let mut b = bytes.clone();
            for _ in 0..rng.gen_range(1..8) {
                let k = rng.gen_range(0..b.len());
                b[k] = rng.gen();
            }
            let cut = rng.gen_range(0..=b.len());
            let _ = decode_ogg_opus(&b[..cut]);
        }
    }
}
