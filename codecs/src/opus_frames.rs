//! Raw Opus packets for RTP (RFC 7587): one packet per 20 ms frame, mono, no
//! Ogg framing. The encoder is tuned for speech over a network (libopus's
//! VoIP application); the decoder takes whatever a peer sends (any packet
//! duration, mono or stereo, downmixed) and conceals lost packets.

use crate::CodecError;

/// Rates libopus runs at natively.
pub const OPUS_RATES: [u32; 5] = [8000, 12000, 16000, 24000, 48000];
/// Largest packet for one 20 ms frame (RFC 6716 3.4: 1275 bytes per frame)
/// plus the TOC byte and headroom.
const MAX_FRAME_PACKET: usize = 1500;

fn check_rate(sample_rate: u32) -> Result<(), CodecError> {
    if OPUS_RATES.contains(&sample_rate) {
        Ok(())
    } else {
        Err(CodecError::Invalid(format!(
            "opus runs at 8000, 12000, 16000, 24000 or 48000 Hz, not {sample_rate}"
        )))
    }
}

/// Encodes 20 ms frames of mono i16 PCM into one Opus packet each.
pub struct OpusFrameEncoder {
    enc: opus::Encoder,
    sample_rate: u32,
    frame: usize,
    lookahead: usize,
}

impl OpusFrameEncoder {
    /// `sample_rate`: one of [`OPUS_RATES`] (48,000 for WebRTC's opus/48000).
    /// Bitrate starts at libopus's automatic choice; see [`Self::set_bitrate`].
    pub fn new(sample_rate: u32) -> Result<Self, CodecError> {
        check_rate(sample_rate)?;
        let mut enc =
            opus::Encoder::new(sample_rate, opus::Channels::Mono, opus::Application::Voip)?;
        enc.set_signal(opus::Signal::Voice)?;
        let lookahead = enc.get_lookahead()?;
        let lookahead = usize::try_from(lookahead)
            .map_err(|_| CodecError::Invalid(format!("opus lookahead {lookahead} out of range")))?;
        Ok(Self {
            enc,
            sample_rate,
            frame: sample_rate as usize / 50,
            lookahead,
        })
    }

    /// Bits per second (6,000..=510,000), or `None` for libopus's choice.
    pub fn set_bitrate(&mut self, bitrate: Option<i32>) -> Result<(), CodecError> {
        let b = match bitrate {
            None => opus::Bitrate::Auto,
            Some(b) if (6_000..=510_000).contains(&b) => opus::Bitrate::Bits(b),
            Some(b) => {
                return Err(CodecError::Invalid(format!(
                    "opus bitrate {b} b/s is out of range (6000..=510000)"
                )))
            }
        };
        self.enc.set_bitrate(b)?;
        Ok(())
    }

    /// libopus's complexity, 0..=10 (default 9): lower is cheaper for
    /// slightly worse quality; 5 takes about half the CPU of the default
    /// (`examples/codec_cost.rs`).
    pub fn set_complexity(&mut self, complexity: i32) -> Result<(), CodecError> {
        if !(0..=10).contains(&complexity) {
            return Err(CodecError::Invalid(format!(
                "opus complexity {complexity} is out of range (0..=10)"
            )));
        }
        self.enc.set_complexity(complexity)?;
        Ok(())
    }

    /// The complexity in use (libopus's default unless set).
    pub fn complexity(&mut self) -> Result<i32, CodecError> {
        Ok(self.enc.get_complexity()?)
    }

    pub fn sample_rate(&self) -> u32 {
        self.sample_rate
    }

    /// Samples in one 20 ms frame: what [`Self::encode`] takes.
    pub fn frame_samples(&self) -> usize {
        self.frame
    }

    /// The encoder's delay in samples: decoded audio lags the input by this.
    pub fn lookahead(&self) -> usize {
        self.lookahead
    }

    /// Encodes exactly one 20 ms frame ([`Self::frame_samples`] samples).
    pub fn encode(&mut self, pcm: &[i16]) -> Result<Vec<u8>, CodecError> {
        if pcm.len() != self.frame {
            return Err(CodecError::Invalid(format!(
                "opus frame must be {} samples (20 ms at {} Hz), got {}",
                self.frame,
                self.sample_rate,
                pcm.len()
            )));
        }
        let mut packet = vec![0u8; MAX_FRAME_PACKET];
        let n = self.enc.encode(pcm, &mut packet)?;
        packet.truncate(n);
        Ok(packet)
    }
}

/// Decodes Opus packets (from RTP) to mono i16 PCM.
pub struct OpusFrameDecoder {
    dec: opus::Decoder,
    sample_rate: u32,
    frame: usize,
    /// Room for the longest packet, 120 ms (RFC 6716 3.2.5).
    buf: Vec<i16>,
}

impl OpusFrameDecoder {
    /// `sample_rate`: one of [`OPUS_RATES`]; packets of any rate decode to it.
    pub fn new(sample_rate: u32) -> Result<Self, CodecError> {
        check_rate(sample_rate)?;
        let dec = opus::Decoder::new(sample_rate, opus::Channels::Mono)?;
        Ok(Self {
            dec,
            sample_rate,
            frame: sample_rate as usize / 50,
            buf: vec![0; sample_rate as usize * 120 / 1000],
        })
    }

    pub fn sample_rate(&self) -> u32 {
        self.sample_rate
    }

    /// Samples in one 20 ms frame: what [`Self::decode_lost`] returns.
    pub fn frame_samples(&self) -> usize {
        self.frame
    }

    /// Decodes one packet (2.5 to 120 ms of audio). Malformed packets are a
    /// `CodecError`: libopus checks the packet structure before decoding.
    pub fn decode(&mut self, packet: &[u8]) -> Result<Vec<i16>, CodecError> {
        // An empty slice would ask libopus for concealment instead; a packet
        // has at least its TOC byte (RFC 6716 3.4, R1).
        if packet.is_empty() {
            return Err(CodecError::Invalid("empty opus packet".into()));
        }
        let n = self.dec.decode(packet, &mut self.buf, false)?;
        Ok(self.buf[..n.min(self.buf.len())].to_vec())
    }

    /// Packet loss concealment for one lost 20 ms frame: audio extrapolated
    /// from what came before (silence before the first packet).
    pub fn decode_lost(&mut self) -> Vec<i16> {
        let frame = self.frame;
        match self.dec.decode(&[], &mut self.buf[..frame], false) {
            Ok(n) => self.buf[..n.min(frame)].to_vec(),
            // Not expected for a valid frame size; silence keeps the timing.
            Err(_) => vec![0; frame],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Voice-like test signal: harmonics of a pitch that glides (300..=500
    /// Hz) under a 4 Hz syllable envelope, so that no lag but the true one
    /// lines it up with itself. A high voice: the VoIP mode's high-pass
    /// filter shifts the phase of a low fundamental, which lowers the
    /// waveform correlation without being a fault.
    fn voice(rate: u32, n: usize) -> Vec<i16> {
        let mut phase = 0f32;
        (0..n)
            .map(|i| {
                let t = i as f32 / rate as f32;
                let f0 = 400.0 + 100.0 * (2.0 * std::f32::consts::PI * 1.3 * t).sin();
                phase += 2.0 * std::f32::consts::PI * f0 / rate as f32;
                let s: f32 = [(1.0, 0.4), (2.0, 0.25), (3.0, 0.15), (5.0, 0.1)]
                    .iter()
                    .map(|(h, a)| a * (h * phase).sin())
                    .sum();
                let env = 0.6 + 0.4 * (2.0 * std::f32::consts::PI * 4.0 * t).sin();
                (s * env * 0.6 * i16::MAX as f32) as i16
            })
            .collect()
    }

    fn round_trip(rate: u32, x: &[i16]) -> (Vec<i16>, usize) {
        let mut e = OpusFrameEncoder::new(rate).unwrap();
        let mut d = OpusFrameDecoder::new(rate).unwrap();
        let mut y = Vec::new();
        for f in x.chunks_exact(e.frame_samples()) {
            let p = e.encode(f).unwrap();
            assert!(!p.is_empty() && p.len() <= MAX_FRAME_PACKET);
            let out = d.decode(&p).unwrap();
            assert_eq!(out.len(), e.frame_samples());
            y.extend(out);
        }
        (y, e.lookahead())
    }

    /// Normalized correlation of `y[lag..]` with `x`, over the middle.
    fn corr(x: &[i16], y: &[i16], lag: usize) -> f64 {
        let n = x.len().min(y.len() - lag);
        let (a, b) = (n / 5, n * 9 / 10);
        let (mut xy, mut xx, mut yy) = (0f64, 0f64, 0f64);
        for i in a..b {
            let (p, q) = (x[i] as f64, y[i + lag] as f64);
            xy += p * q;
            xx += p * p;
            yy += q * q;
        }
        xy / (xx * yy).sqrt()
    }

    #[test]
    fn tone_round_trips_after_the_codec_delay() {
        for rate in [48_000, 16_000, 8_000] {
            let x = voice(rate, rate as usize);
            let (y, lookahead) = round_trip(rate, &x);
            assert_eq!(y.len(), x.len());
            // The best alignment is the encoder's lookahead (6.5 ms) within
            // 1 ms (SILK's internal resampling moves it a little), and the
            // waveform is kept there.
            let search = rate as usize / 50;
            let best = (0..search)
                .max_by(|&a, &b| corr(&x, &y, a).total_cmp(&corr(&x, &y, b)))
                .unwrap();
            assert!(
                best.abs_diff(lookahead) <= rate as usize / 1000,
                "{rate} Hz: lag {best} vs lookahead {lookahead}"
            );
            let c = corr(&x, &y, best);
            assert!(c > 0.95, "{rate} Hz: correlation {c}");
            // SNR of the aligned middle.
            let n = x.len() - best;
            let (mut sig, mut err) = (0f64, 0f64);
            for i in n / 5..n * 9 / 10 {
                sig += (x[i] as f64).powi(2);
                err += (x[i] as f64 - y[i + best] as f64).powi(2);
            }
            let snr = 10.0 * (sig / err).log10();
            assert!(snr > 10.0, "{rate} Hz: SNR {snr:.1} dB");
        }
    }

    #[test]
    fn wrong_frame_sizes_and_rates_are_rejected() {
        let mut e = OpusFrameEncoder::new(48_000).unwrap();
        assert_eq!(e.frame_samples(), 960);
        for n in [0, 1, 959, 961, 480, 1920] {
            let err = e.encode(&vec![0; n]).unwrap_err();
            assert!(err.to_string().contains("960 samples"), "{err}");
        }
        assert!(e.encode(&[0; 960]).is_ok());
        assert_eq!(OpusFrameEncoder::new(8_000).unwrap().frame_samples(), 160);
        for rate in [0, 22_050, 44_100, 96_000] {
            assert!(OpusFrameEncoder::new(rate).is_err(), "{rate}");
            assert!(OpusFrameDecoder::new(rate).is_err(), "{rate}");
        }
        assert!(e.set_bitrate(Some(32_000)).is_ok());
        assert!(e.set_bitrate(None).is_ok());
        assert!(e.set_bitrate(Some(1_000)).is_err());
        assert!(e.set_complexity(11).is_err() && e.set_complexity(-1).is_err());
        e.set_complexity(3).unwrap();
        assert_eq!(e.complexity().unwrap(), 3);
        assert!(e.encode(&[0; 960]).is_ok());
    }

    #[test]
    fn bitrate_changes_packet_size() {
        let x = voice(48_000, 48_000);
        let size = |b: i32| {
            let mut e = OpusFrameEncoder::new(48_000).unwrap();
            e.set_bitrate(Some(b)).unwrap();
            x.chunks_exact(960)
                .map(|f| e.encode(f).unwrap().len())
                .sum::<usize>()
        };
        let (lo, hi) = (size(12_000), size(64_000));
        // 1 s at 12 kb/s is ~1.5 kB, at 64 kb/s ~8 kB.
        assert!(lo < 2_500 && hi > 6_000, "{lo} vs {hi}");
    }

    #[test]
    fn garbage_packets_are_errors_not_panics() {
        let mut d = OpusFrameDecoder::new(48_000).unwrap();
        assert!(d.decode(&[]).is_err());
        // Code 3 (TOC & 3), with the frame-count byte asking for 63 frames of
        // 20 ms: far over the 120 ms limit.
        assert!(d.decode(&[0xFF, 0xFF, 0xFF]).is_err());
        // Code 3 with zero frames.
        assert!(d.decode(&[0x03, 0x00]).is_err());
        // Code 1 (two equal frames) needs an even payload length.
        assert!(d.decode(&[0x01, 0x00, 0x00, 0x00]).is_err());
        // Code 2: the first frame's length runs past the end.
        assert!(d.decode(&[0x02, 200, 1, 2]).is_err());
        // Random bytes: an error, or a packet's worth of audio (any TOC byte
        // with enough bytes behind it can be valid), never a panic.
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (mut ok, mut bad) = (0, 0);
        for _ in 0..2000 {
            let n = rng.gen_range(1..200);
            let p: Vec<u8> = (0..n).map(|_| rng.gen()).collect();
            match d.decode(&p) {
                // Multiples of 2.5 ms, at most 120 ms.
                Ok(y) => {
                    assert!(y.len() % 120 == 0 && y.len() <= 5760, "{}", y.len());
                    ok += 1;
                }
                Err(_) => bad += 1,
            }
        }
        assert!(ok > 0 && bad > 0, "{ok} ok, {bad} errors");
        // The decoder still works after garbage.
        let mut e = OpusFrameEncoder::new(48_000).unwrap();
        let p = e.encode(&voice(48_000, 960)).unwrap();
        assert_eq!(d.decode(&p).unwrap().len(), 960);
    }

    #[test]
    fn lost_frames_are_concealed() {
        let rate = 16_000;
        let x = voice(rate, rate as usize);
        let mut e = OpusFrameEncoder::new(rate).unwrap();
        let mut d = OpusFrameDecoder::new(rate).unwrap();
        // Before any packet: one frame of silence.
        let first = d.decode_lost();
        assert_eq!(first.len(), 320);
        assert!(first.iter().all(|&s| s == 0));
        let mut y = Vec::new();
        for (k, f) in x.chunks_exact(320).enumerate() {
            let p = e.encode(f).unwrap();
            // Lose every 10th frame once the decoder has history.
            let out = if k > 10 && k % 10 == 0 {
                d.decode_lost()
            } else {
                d.decode(&p).unwrap()
            };
            assert_eq!(out.len(), 320);
            y.extend(out);
        }
        // Concealment continues the voice: the lost frames are not silent
        // and the whole still follows the input closely.
        let lost = &y[20 * 320..21 * 320];
        let rms = (lost.iter().map(|&s| (s as f64).powi(2)).sum::<f64>() / 320.0).sqrt();
        assert!(rms > 1000.0, "concealed frame rms {rms}");
        let c = corr(&x, &y, e.lookahead());
        assert!(c > 0.8, "correlation with losses {c}");
    }
}
