//! Audio on a call's RTP stream (a WebRTC peer's track, a SIP call): answers
//! go out paced in 20 ms frames (Opus 48 kHz or G.711 8 kHz) with silence
//! between them; the caller's microphone comes in decoded and resampled to
//! the session's 24 kHz.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use omnistream_codecs::g711;
use omnistream_codecs::opus_frames::{OpusFrameDecoder, OpusFrameEncoder};
use omnistream_codecs::pcm::{f32_to_i16, i16_to_f32};
use omnistream_codecs::resample::StreamResampler;
use omnistream_codecs::CodecError;
use tokio::sync::mpsc;

/// The session's audio rate (pcm16 of the Realtime API).
pub const SESSION_RATE: u32 = 24_000;
/// One RTP packet's worth of audio.
pub const FRAME: Duration = Duration::from_millis(20);
/// Audio a peer may have queued ahead of playback before it is dropped: a
/// long answer is generated much faster than it plays.
const MAX_QUEUED_SECONDS: usize = 600;

/// The codecs a peer can have (the first one its offer lists that we know).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Codec {
    Opus,
    Pcmu,
    Pcma,
}

impl Codec {
    pub fn clock_rate(self) -> u32 {
        match self {
            Codec::Opus => 48_000,
            Codec::Pcmu | Codec::Pcma => 8_000,
        }
    }

    /// Samples in one 20 ms frame at the codec's rate.
    pub fn frame_samples(self) -> usize {
        self.clock_rate() as usize / 50
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::Opus => "opus",
            Codec::Pcmu => "PCMU",
            Codec::Pcma => "PCMA",
        }
    }
}

/// What a response's task tells the pacer.
#[derive(Debug)]
pub enum Cue {
    /// pcm16 LE at 24 kHz, part of `response`.
    Audio { response: String, pcm: Vec<u8> },
    /// `response` has no more audio.
    End { response: String },
    /// Drop everything queued (`output_audio_buffer.clear`).
    Clear,
}

#[derive(Debug)]
pub struct Overflow;

/// The sending side of a peer's speaker.
#[derive(Clone)]
pub struct AudioOut {
    tx: mpsc::UnboundedSender<Cue>,
    /// Samples (at 24 kHz) handed over and not yet played.
    queued: Arc<AtomicUsize>,
}

impl AudioOut {
    pub fn new() -> (Self, mpsc::UnboundedReceiver<Cue>, Arc<AtomicUsize>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        (
            Self {
                tx,
                queued: queued.clone(),
            },
            rx,
            queued,
        )
    }

    /// Queues an answer's audio; `Err` when the peer is gone or the queue
    /// holds more than `MAX_QUEUED_SECONDS`.
    pub fn push(&self, response: &str, pcm16le: &[u8]) -> Result<(), Overflow> {
        let n = pcm16le.len() / 2;
        if self.queued.load(Ordering::Acquire) + n > MAX_QUEUED_SECONDS * SESSION_RATE as usize {
            return Err(Overflow);
        }
        self.queued.fetch_add(n, Ordering::AcqRel);
        self.tx
            .send(Cue::Audio {
                response: response.to_string(),
                pcm: pcm16le.to_vec(),
            })
            .map_err(|_| Overflow)
    }

    pub fn end(&self, response: &str) {
        let _ = self.tx.send(Cue::End {
            response: response.to_string(),
        });
    }

    pub fn clear(&self) {
        let _ = self.tx.send(Cue::Clear);
    }

    /// Samples (at 24 kHz) handed over and not yet played.
    pub fn queued_samples(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }
}

/// The paced speaker, as the conversation's transport plays to it.
impl crate::serve::conn::AudioSink for AudioOut {
    fn push(&self, response: &str, pcm16: &[u8]) -> Result<(), crate::serve::conn::Overflow> {
        AudioOut::push(self, response, pcm16).map_err(|_| crate::serve::conn::Overflow)
    }
    fn end(&self, response: &str) {
        AudioOut::end(self, response)
    }
    fn clear(&self) {
        AudioOut::clear(self)
    }
    fn queued_seconds(&self) -> f64 {
        self.queued_samples() as f64 / f64::from(SESSION_RATE)
    }
}

/// What the pacer sends in one 20 ms slot.
#[derive(Debug, PartialEq)]
pub enum Slot {
    /// A frame of an answer; `first` when it is the answer's first.
    Speech {
        response: String,
        first: bool,
        payload: Vec<u8>,
    },
    /// Silence: between answers (`stopped` names the answer that just ended
    /// and how many of its frames were silence because its audio came too
    /// late), or in the middle of one (an underrun).
    Silence {
        stopped: Option<(String, u32)>,
        payload: Vec<u8>,
    },
}

/// Encodes one codec's 20 ms frames.
enum FrameCodec {
    Opus(Box<OpusFrameEncoder>),
    Pcmu,
    Pcma,
}

impl FrameCodec {
    fn new(codec: Codec) -> Result<Self, CodecError> {
        Ok(match codec {
            Codec::Opus => FrameCodec::Opus(Box::new(OpusFrameEncoder::new(codec.clock_rate())?)),
            Codec::Pcmu => FrameCodec::Pcmu,
            Codec::Pcma => FrameCodec::Pcma,
        })
    }

    fn encode(&mut self, frame: &[i16]) -> Result<Vec<u8>, CodecError> {
        match self {
            FrameCodec::Opus(e) => e.encode(frame),
            FrameCodec::Pcmu => Ok(g711::ulaw_encode(frame)),
            FrameCodec::Pcma => Ok(g711::alaw_encode(frame)),
        }
    }
}

/// The pacer's state, apart from time: answers' audio resampled to the
/// codec's rate, cut into 20 ms frames, silence when there is none.
pub struct Speaker {
    codec: Codec,
    encoder: FrameCodec,
    resampler: StreamResampler,
    /// Samples at the codec's rate, in answer order; each run tagged with its answer.
    pending: VecDeque<(String, Vec<i16>)>,
    /// The answer whose audio is playing, and the silent frames it had to
    /// take because its audio was late.
    playing: Option<(String, u32)>,
    /// Answers whose audio is complete.
    ended: Vec<String>,
    queued: Arc<AtomicUsize>,
    silence: Vec<i16>,
    /// Frames of silence sent in the middle of answers, all answers.
    pub underruns: u64,
    /// Ticks a new answer is held after its first audio arrived.
    lead_ticks: u32,
    waited: u32,
}

impl Speaker {
    /// `lead`: audio an answer must have queued before it starts playing
    /// (unless it is complete), so that a burst-then-pause producer does not
    /// leave holes mid-answer.
    pub fn new(codec: Codec, queued: Arc<AtomicUsize>, lead: Duration) -> Result<Self, CodecError> {
        Ok(Self {
            lead_ticks: (lead.as_millis() / FRAME.as_millis()) as u32,
            waited: 0,
            codec,
            encoder: FrameCodec::new(codec)?,
            resampler: StreamResampler::new(SESSION_RATE, codec.clock_rate())?,
            pending: VecDeque::new(),
            playing: None,
            ended: Vec::new(),
            queued,
            silence: vec![0; codec.frame_samples()],
            underruns: 0,
        })
    }

    pub fn cue(&mut self, cue: Cue) -> Result<(), CodecError> {
        match cue {
            Cue::Audio { response, pcm } => {
                let x: Vec<f32> = pcm
                    .chunks_exact(2)
                    .map(|b| i16_to_f32(i16::from_le_bytes([b[0], b[1]])))
                    .collect();
                let y = self.resampler.process(&x)?;
                self.push_pending(&response, y);
            }
            Cue::End { response } => {
                // The resampler's tail belongs to this answer.
                let tail = self.resampler.flush()?;
                self.push_pending(&response, tail);
                self.resampler = StreamResampler::new(SESSION_RATE, self.codec.clock_rate())?;
                self.ended.push(response);
            }
            Cue::Clear => {
                self.pending.clear();
                self.queued.store(0, Ordering::Release);
                self.resampler = StreamResampler::new(SESSION_RATE, self.codec.clock_rate())?;
                if let Some((id, _)) = self.playing.take() {
                    self.ended.retain(|e| *e != id);
                }
            }
        }
        Ok(())
    }

    fn push_pending(&mut self, response: &str, y: Vec<f32>) {
        let samples: Vec<i16> = y.into_iter().map(f32_to_i16).collect();
        match self.pending.back_mut() {
            Some((r, v)) if r == response => v.extend(samples),
            _ => self.pending.push_back((response.to_string(), samples)),
        }
    }

    /// The next 20 ms slot.
    pub fn next_slot(&mut self) -> Result<Slot, CodecError> {
        let n = self.codec.frame_samples();
        // An answer that has audio, or that ended with a partial frame.
        if let Some((response, samples)) = self.pending.front_mut() {
            let done = self.ended.contains(response);
            let starting = !matches!(&self.playing, Some((id, _)) if id == response);
            // A new answer waits `lead` after its first audio arrived (a
            // jitter buffer: the pipeline delivers in bursts), unless complete.
            let held = starting && !done && {
                self.waited += 1;
                self.waited <= self.lead_ticks
            };
            if !held && (samples.len() >= n || (done && !samples.is_empty())) {
                self.waited = 0;
                let take = samples.len().min(n);
                let mut frame: Vec<i16> = samples.drain(..take).collect();
                frame.resize(n, 0);
                let response = response.clone();
                if samples.is_empty() && done {
                    self.pending.pop_front();
                }
                let played = take * SESSION_RATE as usize / self.codec.clock_rate() as usize;
                let _ = self
                    .queued
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |q| {
                        Some(q.saturating_sub(played))
                    });
                let first = match &mut self.playing {
                    Some((id, _)) if *id == response => false,
                    _ => {
                        self.playing = Some((response.clone(), 0));
                        true
                    }
                };
                return Ok(Slot::Speech {
                    first,
                    payload: self.encoder.encode(&frame)?,
                    response,
                });
            }
            if samples.is_empty() && done {
                self.pending.pop_front();
            }
        }
        // Nothing to play: the playing answer is over once it ended and
        // nothing of it is left.
        let stopped = match &mut self.playing {
            Some((id, late))
                if self.ended.contains(id) && !self.pending.iter().any(|(r, _)| r == id) =>
            {
                let done = (id.clone(), *late);
                self.ended.retain(|e| *e != done.0);
                self.playing = None;
                Some(done)
            }
            // Still playing, nothing to play: generation fell behind.
            Some((_, late)) => {
                *late += 1;
                self.underruns += 1;
                None
            }
            None => None,
        };
        let silence = self.silence.clone();
        Ok(Slot::Silence {
            stopped,
            payload: self.encoder.encode(&silence)?,
        })
    }
}

/// One 20 ms tick of a paced speaker: the payload to send, whether it is an
/// answer's speech, and the `output_audio_buffer` event it starts or ends.
pub struct Tick {
    pub payload: Vec<u8>,
    pub speech: bool,
    pub event: Option<(&'static str, serde_json::Value)>,
}

impl Speaker {
    /// Takes the cues that came, then gives the next slot; `None` (logged)
    /// when the codec failed, and the tick is skipped.
    pub fn tick(&mut self, cues: &mut mpsc::UnboundedReceiver<Cue>) -> Option<Tick> {
        while let Ok(cue) = cues.try_recv() {
            if let Err(e) = self.cue(cue) {
                tracing::warn!("speaker: {e}");
            }
        }
        let slot = match self.next_slot() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("speaker: {e}");
                return None;
            }
        };
        Some(match slot {
            Slot::Speech {
                response,
                first,
                payload,
            } => Tick {
                payload,
                speech: true,
                event: first.then(|| {
                    (
                        "output_audio_buffer.started",
                        serde_json::json!({"response_id": response}),
                    )
                }),
            },
            // `underrun_ms`: silence the answer had to take mid-way because
            // generation fell behind real time (0 when it kept up).
            Slot::Silence { stopped, payload } => Tick {
                payload,
                speech: false,
                event: stopped.map(|(r, late)| {
                    (
                        "output_audio_buffer.stopped",
                        serde_json::json!({"response_id": r, "underrun_ms": late * 20}),
                    )
                }),
            },
        })
    }
}

/// Decodes a peer's RTP payloads into 24 kHz pcm16 LE.
pub struct Mic {
    decoder: MicCodec,
    resampler: StreamResampler,
}

enum MicCodec {
    Opus(Box<OpusFrameDecoder>),
    Pcmu,
    Pcma,
}

impl Mic {
    pub fn new(codec: Codec) -> Result<Self, CodecError> {
        Ok(Self {
            decoder: match codec {
                Codec::Opus => MicCodec::Opus(Box::new(OpusFrameDecoder::new(codec.clock_rate())?)),
                Codec::Pcmu => MicCodec::Pcmu,
                Codec::Pcma => MicCodec::Pcma,
            },
            resampler: StreamResampler::new(codec.clock_rate(), SESSION_RATE)?,
        })
    }

    /// One RTP payload → pcm16 LE at 24 kHz (may be empty while the
    /// resampler fills).
    pub fn decode(&mut self, payload: &[u8]) -> Result<Vec<u8>, CodecError> {
        let pcm = match &mut self.decoder {
            MicCodec::Opus(d) => d.decode(payload)?,
            MicCodec::Pcmu => g711::ulaw_decode(payload),
            MicCodec::Pcma => g711::alaw_decode(payload),
        };
        let x: Vec<f32> = pcm.into_iter().map(i16_to_f32).collect();
        let y = self.resampler.process(&x)?;
        Ok(y.into_iter()
            .flat_map(|v| f32_to_i16(v).to_le_bytes())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tone(ms: usize) -> Vec<u8> {
        (0..SESSION_RATE as usize * ms / 1000)
            .flat_map(|i| {
                let v = (i as f32 * 440.0 * std::f32::consts::TAU / SESSION_RATE as f32).sin();
                f32_to_i16(0.3 * v).to_le_bytes()
            })
            .collect()
    }

    fn speaker(codec: Codec) -> (AudioOut, mpsc::UnboundedReceiver<Cue>, Speaker) {
        let (out, rx, queued) = AudioOut::new();
        (
            out,
            rx,
            Speaker::new(codec, queued, Duration::ZERO).unwrap(),
        )
    }

    fn feed(rx: &mut mpsc::UnboundedReceiver<Cue>, sp: &mut Speaker) {
        while let Ok(c) = rx.try_recv() {
            sp.cue(c).unwrap();
        }
    }

    #[test]
    fn an_answer_plays_in_frames_then_silence() {
        let (out, mut rx, mut sp) = speaker(Codec::Pcmu);
        // Nothing queued: silence (μ-law zero is 0xFF).
        assert_eq!(
            sp.next_slot().unwrap(),
            Slot::Silence {
                stopped: None,
                payload: vec![0xFF; 160]
            }
        );
        out.push("r1", &tone(105)).unwrap();
        out.end("r1");
        feed(&mut rx, &mut sp);
        let mut speech = 0;
        let mut firsts = 0;
        let stopped = loop {
            match sp.next_slot().unwrap() {
                Slot::Speech {
                    response,
                    first,
                    payload,
                } => {
                    assert_eq!(response, "r1");
                    assert_eq!(payload.len(), 160);
                    speech += 1;
                    firsts += first as usize;
                }
                Slot::Silence { stopped, .. } => break stopped,
            }
        };
        // 105 ms (+ the resampler's tail) is six frames, the last padded.
        assert!((6..=7).contains(&speech), "{speech} frames");
        assert_eq!(firsts, 1);
        assert_eq!(stopped, Some(("r1".to_string(), 0)));
        assert_eq!(sp.underruns, 0);
        assert_eq!(out.queued.load(Ordering::Acquire), 0);
        // And then plain silence again.
        assert!(matches!(
            sp.next_slot().unwrap(),
            Slot::Silence { stopped: None, .. }
        ));
    }

    #[test]
    fn late_audio_is_counted_as_underrun() {
        let (out, mut rx, mut sp) = speaker(Codec::Pcmu);
        out.push("r1", &tone(200)).unwrap();
        feed(&mut rx, &mut sp);
        // Silence before an answer starts is not an underrun.
        while !matches!(sp.next_slot().unwrap(), Slot::Speech { .. }) {}
        assert_eq!(sp.underruns, 0);
        let mut speech = 1;
        // The answer has not ended: after its audio, silence is an underrun.
        for _ in 1..30 {
            if matches!(sp.next_slot().unwrap(), Slot::Speech { .. }) {
                speech += 1;
            }
        }
        assert!((5..15).contains(&speech), "{speech}");
        assert_eq!(sp.underruns, 30 - speech);
        out.push("r1", &tone(20)).unwrap();
        out.end("r1");
        feed(&mut rx, &mut sp);
        let stopped = loop {
            if let Slot::Silence { stopped, .. } = sp.next_slot().unwrap() {
                break stopped;
            }
        };
        let (id, late) = stopped.expect("stopped");
        assert_eq!((id.as_str(), u64::from(late)), ("r1", 30 - speech));
    }

    #[test]
    fn an_answer_starts_after_its_lead() {
        let (out, mut rx, queued) = AudioOut::new();
        let mut sp = Speaker::new(Codec::Pcmu, queued, Duration::from_millis(100)).unwrap();
        out.push("r1", &tone(300)).unwrap();
        feed(&mut rx, &mut sp);
        // Held for 100 ms (five ticks) after its audio arrived, then plays.
        for _ in 0..5 {
            assert!(matches!(sp.next_slot().unwrap(), Slot::Silence { .. }));
        }
        assert!(matches!(
            sp.next_slot().unwrap(),
            Slot::Speech { first: true, .. }
        ));
        assert_eq!(sp.underruns, 0);
        // A short answer that is complete plays at once.
        let (out, mut rx, queued) = AudioOut::new();
        let mut sp = Speaker::new(Codec::Pcmu, queued, Duration::from_millis(500)).unwrap();
        out.push("r2", &tone(60)).unwrap();
        out.end("r2");
        feed(&mut rx, &mut sp);
        assert!(matches!(
            sp.next_slot().unwrap(),
            Slot::Speech { first: true, .. }
        ));
    }

    #[test]
    fn clear_drops_what_is_queued() {
        let (out, mut rx, mut sp) = speaker(Codec::Opus);
        out.push("r1", &tone(500)).unwrap();
        feed(&mut rx, &mut sp);
        assert!(matches!(
            sp.next_slot().unwrap(),
            Slot::Speech { first: true, .. }
        ));
        out.clear();
        feed(&mut rx, &mut sp);
        assert!(matches!(sp.next_slot().unwrap(), Slot::Silence { .. }));
        assert_eq!(out.queued.load(Ordering::Acquire), 0);
        // A new answer starts fresh.
        out.push("r2", &tone(100)).unwrap();
        feed(&mut rx, &mut sp);
        match sp.next_slot().unwrap() {
            Slot::Speech {
                response, first, ..
            } => assert_eq!((response.as_str(), first), ("r2", true)),
            s => panic!("{s:?}"),
        }
    }

    #[test]
    fn a_queue_beyond_the_cap_is_refused() {
        let (out, _rx, _sp) = speaker(Codec::Pcma);
        out.queued.store(
            MAX_QUEUED_SECONDS * SESSION_RATE as usize,
            Ordering::Release,
        );
        assert!(out.push("r", &tone(20)).is_err());
    }

    #[test]
    fn mic_decodes_g711_to_24khz() {
        let mut mic = Mic::new(Codec::Pcmu).unwrap();
        let mut total = 0;
        for _ in 0..50 {
            total += mic.decode(&[0xFF; 160]).unwrap().len() / 2;
        }
        // One second at 8 kHz in, about one second at 24 kHz out (less the
        // resampler's delay).
        assert!((20_000..=24_000).contains(&total), "{total}");
        // Garbage Opus is an error, not a panic.
        let mut mic = Mic::new(Codec::Opus).unwrap();
        let _ = mic.decode(&[0xFF, 0xFF, 0xFF]);
    }
}
