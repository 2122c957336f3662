//! Ogg Opus (RFC 7845), mono, streaming.
//!
//! Opus comes from the system libopus through the `opus` crate, 0.3 line
//! (safe Encoder/Decoder over `audiopus_sys`, which links the libopus that
//! pkg-config finds: Debian's `libopus-dev`). Not `opus` 0.4: its
//! `opusic-sys` always builds a bundled libopus with CMake. Not `audiopus`:
//! its only maintained line is a pre-release. The Ogg framing is the pure-Rust
//! `ogg` crate for writing; reading goes through the push-based
//! `ogg_demux`, which streams and never panics on any input.

use std::borrow::Cow;

use ogg::{PacketWriteEndInfo, PacketWriter};

use crate::ogg_demux::{OggDemuxer, Packet, Page};
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
/// cut short (no end-of-stream page) is an error; no input panics.
pub fn decode_ogg_opus(bytes: &[u8]) -> Result<(Vec<f32>, u32), CodecError> {
    let mut dec = OggOpusDecoder::new();
    let pcm = dec.push(bytes)?;
    dec.finish()?;
    Ok((pcm, OPUS_RATE))
}

/// Most bytes kept of one Ogg packet. An Opus packet is at most 120 ms of
/// 1275-byte frames (~61 kB); a longer OpusTags (cover art) is only counted.
const MAX_OGG_PACKET: usize = 1 << 17;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    Head,
    Tags,
    Audio,
    Ended,
    Failed,
}

/// Streaming Ogg Opus decoder: bytes in as they arrive (split anywhere),
/// mono f32 at 48 kHz out as each page completes. Same rules and output as
/// [`decode_ogg_opus`], which is this decoder fed everything at once.
///
/// A page's samples leave when the page is complete, with the pre-skip cut
/// from the start and, on the end-of-stream page, the end trim applied; so
/// output lags input by at most one page. The first error ends the stream:
/// later calls fail too. Bytes after the end-of-stream page are ignored.
///
/// Memory stays at about one page besides the output, but the output can be
/// thousands of times the input (a 3-byte packet may stand for 120 ms of
/// concealment): callers taking untrusted streams should cap the duration
/// they accept, as `push` lets them do as it goes.
pub struct OggOpusDecoder {
    demux: OggDemuxer,
    stage: Stage,
    dec: Option<opus::Decoder>,
    channels: usize,
    pre_skip: u64,
    input_rate: Option<u32>,
    /// Decoder output for one packet (interleaved).
    frame: Vec<f32>,
    /// Mono samples of the page being decoded.
    page_pcm: Vec<f32>,
    /// Samples decoded so far (pre-skip included), up to the last page.
    decoded: u64,
    /// The stream's granule clock minus our sample count, fixed at the first
    /// page with a granule position (0 unless the stream was cut from a
    /// longer one).
    offset: Option<i128>,
    last_granule: Option<u64>,
}

impl Default for OggOpusDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl OggOpusDecoder {
    pub fn new() -> Self {
        Self {
            demux: OggDemuxer::new(MAX_OGG_PACKET),
            stage: Stage::Head,
            dec: None,
            channels: 1,
            pre_skip: 0,
            input_rate: None,
            frame: Vec::new(),
            page_pcm: Vec::new(),
            decoded: 0,
            offset: None,
            last_granule: None,
        }
    }

    /// The rate of the output: always 48 kHz (Opus decodes at 48 kHz).
    pub fn sample_rate(&self) -> u32 {
        OPUS_RATE
    }

    /// The encoder's input rate from OpusHead (informational), once read.
    pub fn input_sample_rate(&self) -> Option<u32> {
        self.input_rate
    }

    /// Whether the end-of-stream page was read.
    pub fn is_finished(&self) -> bool {
        self.stage == Stage::Ended
    }

    /// Takes the next bytes of the stream; returns the samples of the pages
    /// they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<f32>, CodecError> {
        match self.stage {
            Stage::Ended => return Ok(Vec::new()),
            Stage::Failed => {
                return Err(CodecError::Invalid(
                    "ogg opus decoder stopped at an earlier error".into(),
                ))
            }
            _ => {}
        }
        let r = self.push_pages(bytes);
        if r.is_err() {
            self.stage = Stage::Failed;
            self.demux.clear();
        }
        r
    }

    /// Ends the input: an error unless the end-of-stream page came (all
    /// samples have already been returned by `push`).
    pub fn finish(&mut self) -> Result<(), CodecError> {
        let what = match self.stage {
            Stage::Ended => return Ok(()),
            Stage::Failed => {
                return Err(CodecError::Invalid(
                    "ogg opus decoder stopped at an earlier error".into(),
                ))
            }
            Stage::Head if !self.demux.started() => {
                if self.demux.pending() == 0 {
                    "no pages"
                } else {
                    "the first page is incomplete"
                }
            }
            Stage::Head => "no OpusHead",
            Stage::Tags => "no OpusTags",
            Stage::Audio => "no end-of-stream page",
        };
        self.stage = Stage::Failed;
        Err(CodecError::Truncated(what.into()))
    }

    fn push_pages(&mut self, bytes: &[u8]) -> Result<Vec<f32>, CodecError> {
        self.demux.push(bytes);
        let mut out = Vec::new();
        while self.stage != Stage::Ended {
            let Some(page) = self.demux.next_page()? else {
                break;
            };
            self.page(page, &mut out)?;
        }
        if self.stage == Stage::Ended {
            self.demux.clear();
        }
        Ok(out)
    }

    fn page(&mut self, page: Page, out: &mut Vec<f32>) -> Result<(), CodecError> {
        self.page_pcm.clear();
        let mut audio_ended = false;
        for p in &page.packets {
            match self.stage {
                Stage::Head => {
                    self.head(p)?;
                    self.stage = Stage::Tags;
                }
                Stage::Tags => {
                    if p.data.len() < 8 || &p.data[..8] != b"OpusTags" {
                        return Err(CodecError::Malformed(
                            "second packet is not OpusTags".into(),
                        ));
                    }
                    self.stage = Stage::Audio;
                }
                _ => {
                    self.audio(p)?;
                    audio_ended = true;
                }
            }
        }
        if page.eos {
            match self.stage {
                Stage::Head => {
                    return Err(CodecError::Truncated("stream ends before OpusHead".into()))
                }
                Stage::Tags => {
                    return Err(CodecError::Truncated("stream ends after OpusHead".into()))
                }
                _ if page.ends_inside_packet => {
                    return Err(CodecError::Malformed(
                        "end-of-stream page ends inside a packet".into(),
                    ))
                }
                _ => {}
            }
        }
        let base = self.decoded;
        self.decoded += self.page_pcm.len() as u64;
        // -1 marks a page on which no packet ends.
        if audio_ended && page.granule != u64::MAX {
            let g = page.granule;
            if self.offset.is_none() && !page.eos {
                let off = g as i128 - self.decoded as i128;
                if off < 0 {
                    return Err(CodecError::Malformed(
                        "granule position before the decoded audio".into(),
                    ));
                }
                self.offset = Some(off);
            }
            self.last_granule = Some(g);
        }
        let start = base.max(self.pre_skip);
        if !page.eos {
            if self.decoded > start {
                out.extend_from_slice(&self.page_pcm[(start - base) as usize..]);
            }
            return Ok(());
        }
        // End trim (RFC 7845 4.5): the last granule position says where the
        // audio really ends, inside the final page.
        let Some(end_granule) = self.last_granule else {
            return Err(CodecError::Malformed("no granule position".into()));
        };
        let end = end_granule as i128 - self.offset.unwrap_or(0);
        if end > self.decoded as i128 {
            return Err(CodecError::Malformed(format!(
                "final granule position {end_granule} is past the {} decoded samples",
                self.decoded
            )));
        }
        let end = end.max(0) as u64;
        // Samples of earlier pages were already returned.
        if end.max(self.pre_skip) < base {
            return Err(CodecError::Malformed(format!(
                "final granule position {end_granule} cuts into earlier pages"
            )));
        }
        if end > start {
            out.extend_from_slice(&self.page_pcm[(start - base) as usize..(end - base) as usize]);
        }
        self.stage = Stage::Ended;
        Ok(())
    }

    /// RFC 7845 5.1: OpusHead.
    fn head(&mut self, p: &Packet) -> Result<(), CodecError> {
        let d = &p.data;
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
        if d[18] != 0 || !(1..=2).contains(&channels) {
            return Err(CodecError::Malformed(format!(
                "unsupported channel mapping (family {}, {channels} channels)",
                d[18]
            )));
        }
        self.pre_skip = u16::from_le_bytes([d[10], d[11]]) as u64;
        self.input_rate = Some(u32::from_le_bytes([d[12], d[13], d[14], d[15]]));
        let gain = i16::from_le_bytes([d[16], d[17]]);
        let ch = if channels == 2 {
            opus::Channels::Stereo
        } else {
            opus::Channels::Mono
        };
        let mut dec = opus::Decoder::new(OPUS_RATE, ch)?;
        // The output gain (Q7.8 dB) is the decoder's own gain setting.
        if gain != 0 {
            dec.set_gain(gain as i32)?;
        }
        self.dec = Some(dec);
        self.channels = channels;
        self.frame = vec![0.0; MAX_PACKET_SAMPLES * channels];
        Ok(())
    }

    fn audio(&mut self, p: &Packet) -> Result<(), CodecError> {
        if p.len > p.data.len() {
            return Err(CodecError::Malformed(format!(
                "{}-byte packet is larger than any opus packet",
                p.len
            )));
        }
        // An empty slice would make libopus conceal a loss; a packet has at
        // least its TOC byte (RFC 6716 3.4).
        if p.data.is_empty() {
            return Err(CodecError::Malformed("empty opus packet".into()));
        }
        let Some(dec) = self.dec.as_mut() else {
            return Err(CodecError::Invalid("opus decoder missing".into()));
        };
        let n = dec.decode_float(&p.data, &mut self.frame, false)?;
        let n = n.min(self.frame.len() / self.channels);
        if self.channels == 2 {
            self.page_pcm.extend(
                self.frame[..2 * n]
                    .chunks_exact(2)
                    .map(|f| 0.5 * (f[0] + f[1])),
            );
        } else {
            self.page_pcm.extend_from_slice(&self.frame[..n]);
        }
        Ok(())
    }
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

    /// Feeds `bytes` in random pieces (empty ones included).
    fn decode_in_pieces(bytes: &[u8], rng: &mut rand::rngs::StdRng) -> Vec<f32> {
        let mut d = OggOpusDecoder::new();
        let mut out = Vec::new();
        let mut i = 0;
        while i < bytes.len() {
            let n = rng.gen_range(0..300).min(bytes.len() - i);
            out.extend(d.push(&bytes[i..i + n]).unwrap());
            i += n;
        }
        d.finish().unwrap();
        assert!(d.is_finished());
        out
    }

    #[test]
    fn streaming_decoder_matches_whole_decode() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (rate, n) in [
            (22050, 44_100),
            (48_000, 4_800),
            (24_000, 0),
            (8_000, 7_777),
        ] {
            let bytes = encode(&sine(330.0, rate, n), rate, 1234);
            let (whole, _) = decode_ogg_opus(&bytes).unwrap();
            for _ in 0..5 {
                assert_eq!(decode_in_pieces(&bytes, &mut rng), whole, "{rate} Hz");
            }
            // Byte by byte too.
            let mut d = OggOpusDecoder::new();
            let mut out = Vec::new();
            for b in &bytes {
                out.extend(d.push(std::slice::from_ref(b)).unwrap());
            }
            d.finish().unwrap();
            assert_eq!(out, whole);
            assert_eq!(d.sample_rate(), 48_000);
            assert_eq!(d.input_sample_rate(), Some(rate));
        }
        // Audio comes out as pages complete, not at the end.
        let bytes = encode(&sine(330.0, 22050, 44_100), 22050, 1234);
        let mut d = OggOpusDecoder::new();
        let first = d.push(&bytes[..bytes.len() / 2]).unwrap();
        assert!(
            first.len() > 30_000,
            "{} samples from half the stream",
            first.len()
        );
        assert!(!d.is_finished());
        assert!(matches!(d.finish(), Err(CodecError::Truncated(_))));
    }

    #[test]
    fn a_stream_cut_anywhere_gives_a_prefix_then_a_clear_error() {
        let bytes = encode(&sine(500.0, 16_000, 4_000), 16_000, 800);
        let (whole, _) = decode_ogg_opus(&bytes).unwrap();
        for cut in 0..bytes.len() {
            let err = decode_ogg_opus(&bytes[..cut]).unwrap_err();
            assert!(
                matches!(err, CodecError::Truncated(_)),
                "cut at {cut}: {err}"
            );
            // The streaming decoder returns what the whole pages hold: a
            // prefix of the full output.
            let mut d = OggOpusDecoder::new();
            let got = d.push(&bytes[..cut]).unwrap();
            assert_eq!(got[..], whole[..got.len()], "cut at {cut}");
            assert!(d.finish().is_err());
        }
        assert!(decode_ogg_opus(&[])
            .unwrap_err()
            .to_string()
            .contains("no pages"));
        assert!(decode_ogg_opus(&bytes[..10])
            .unwrap_err()
            .to_string()
            .contains("first page is incomplete"));
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for _ in 0..500 {
            let n = rng.gen_range(0..2000);
            let mut b: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            if rng.gen_bool(0.5) && b.len() >= 4 {
                b[..4].copy_from_slice(b"OggS");
            }
            assert!(decode_ogg_opus(&b).is_err());
        }
        // Errors are sticky; bytes after the end of a stream are ignored.
        let mut d = OggOpusDecoder::new();
        assert!(d.push(b"RIFF....").is_err());
        assert!(d.push(b"OggS").is_err());
        assert!(d.finish().is_err());
        let bytes = encode(&sine(500.0, 48_000, 4_800), 48_000, 960);
        let mut d = OggOpusDecoder::new();
        let y = d
            .push(&[bytes.as_slice(), b"trailing junk"].concat())
            .unwrap();
        assert_eq!(y.len(), 4_800);
        assert!(d.push(b"more junk").unwrap().is_empty());
        d.finish().unwrap();
    }

    /// A stereo stream written here by hand: OpusHead with `gain` (Q7.8 dB),
    /// an OpusTags of `tags_len` bytes (over several pages when large), and
    /// 0.5 s of a 440 Hz tone in both channels.
    fn stereo_stream(gain: i16, tags_len: usize) -> Vec<u8> {
        let mut enc =
            opus::Encoder::new(48_000, opus::Channels::Stereo, opus::Application::Audio).unwrap();
        let pre_skip = enc.get_lookahead().unwrap() as u16;
        let mut w = PacketWriter::new(Vec::new());
        let mut head = b"OpusHead".to_vec();
        head.extend([1, 2]);
        head.extend(pre_skip.to_le_bytes());
        head.extend(48_000u32.to_le_bytes());
        head.extend(gain.to_le_bytes());
        head.push(0);
        w.write_packet(head, 5, PacketWriteEndInfo::EndPage, 0)
            .unwrap();
        let mut tags = b"OpusTags".to_vec();
        tags.resize(tags_len.max(16), b'x');
        w.write_packet(tags, 5, PacketWriteEndInfo::EndPage, 0)
            .unwrap();
        let frames = 25u64;
        let end = pre_skip as u64 + frames * 960 - 500;
        for k in 0..frames {
            let pcm: Vec<f32> = (0..960)
                .flat_map(|i| {
                    let t = (k * 960 + i) as f32 / 48_000.0;
                    let v = 0.25 * (2.0 * std::f32::consts::PI * 440.0 * t).sin();
                    [v, v]
                })
                .collect();
            let p = enc.encode_vec_float(&pcm, 4000).unwrap();
            let (info, g) = if k + 1 == frames {
                (PacketWriteEndInfo::EndStream, end)
            } else {
                (PacketWriteEndInfo::NormalPacket, (k + 1) * 960)
            };
            w.write_packet(p, 5, info, g).unwrap();
        }
        w.into_inner()
    }

    #[test]
    fn stereo_gain_and_large_tags() {
        let rms = |x: &[f32]| (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        let (plain, _) = decode_ogg_opus(&stereo_stream(0, 100)).unwrap();
        // 25 frames less the 500-sample end trim (and the pre-skip).
        assert_eq!(plain.len(), 25 * 960 - 500);
        let r = rms(&plain[4800..]);
        assert!((r - 0.25 / 2f32.sqrt()).abs() < 0.02, "downmixed rms {r}");
        // +6.02 dB (1541 / 256) doubles the amplitude.
        let (loud, _) = decode_ogg_opus(&stereo_stream(1541, 100)).unwrap();
        let ratio = rms(&loud[4800..]) / r;
        assert!((ratio - 2.0).abs() < 0.02, "gain ratio {ratio}");
        // A 200 kB OpusTags spans pages and is skipped, not stored.
        let big = stereo_stream(0, 200_000);
        assert!(big.len() > 200_000);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        assert_eq!(decode_in_pieces(&big, &mut rng), plain);
    }
}
