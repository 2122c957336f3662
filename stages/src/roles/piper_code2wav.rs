//! Code2Wav stage for Piper's HiFi-GAN decoder: latent frames -> PCM.
//!
//! Chunk policy (in frames of *output* audio): the first chunk after
//! `initial_codec_chunk_frames`, then every `codec_chunk_frames`. The default
//! decoder is stateful and exact (every conv keeps its state across chunks); it
//! is non-causal, so each chunk also waits for a fixed lookahead of frames when
//! more are still coming. `codec_left_context_frames > 0` selects the
//! reference-style decoder instead: each chunk re-decoded with that much left
//! context and trimmed (not exact; kept to measure what state buys).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use candle_core::Tensor;

use super::take_ready;
use crate::engine::{Event, Payload, RequestCtx, RequestId, StageModel, StepOutput};
use crate::models::piper::{DecoderStream, PiperVoice};
use crate::models::{ModelError, Result};

#[derive(Debug, Clone, Copy)]
pub struct ChunkPolicy {
    pub async_chunk: bool,
    pub initial_frames: usize,
    pub chunk_frames: usize,
    pub left_context_frames: usize,
    /// Chunks after the first double from `initial_frames` up to `chunk_frames`.
    pub ramp: bool,
}

impl ChunkPolicy {
    /// Frames in a request's chunk `k` (0: its first).
    pub fn frames(&self, k: u64) -> usize {
        match (k, self.ramp) {
            (0, _) => self.initial_frames,
            (_, false) => self.chunk_frames,
            (k, true) => self
                .initial_frames
                .max(1)
                .saturating_mul(1usize << k.min(16))
                .min(self.chunk_frames),
        }
    }

    /// Every chunk length a request goes through, the first flagged (what
    /// CUDA graphs are captured for).
    pub fn sizes(&self) -> Vec<(usize, bool)> {
        let mut out = vec![(self.initial_frames, true)];
        for k in 1.. {
            let n = self.frames(k);
            if !out[1..].iter().any(|&(m, _)| m == n) {
                out.push((n, false));
            }
            if n >= self.chunk_frames || !self.ramp {
                break;
            }
        }
        out
    }
}

struct DecReq {
    ctx: Arc<RequestCtx>,
    stream: DecoderStream,
    /// Frames received and not yet fed to the decoder, oldest first.
    pending: VecDeque<Tensor>,
    pending_frames: usize,
    /// Frames fed to the decoder so far.
    fed: usize,
    /// Frames whose audio has been emitted (or requested from the stream).
    emitted: usize,
    /// Windowed mode: the last `left_context_frames` frames already decoded.
    history: Option<Tensor>,
    upstream_done: bool,
    /// Decode steps taken (the first uses the initial chunk size).
    seq: u64,
    /// Audio chunks sent to the client.
    chunks: u64,
}

pub struct PiperCode2Wav {
    voice: Arc<PiperVoice>,
    policy: ChunkPolicy,
    max_num_seqs: usize,
    reqs: HashMap<RequestId, DecReq>,
    order: VecDeque<RequestId>,
}

impl PiperCode2Wav {
    pub fn new(voice: Arc<PiperVoice>, policy: ChunkPolicy, max_num_seqs: usize) -> Self {
        Self {
            voice,
            policy,
            max_num_seqs,
            reqs: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn target(&self, r: &DecReq) -> usize {
        if r.seq == 0 {
            self.policy.initial_frames
        } else {
            r.emitted + self.policy.frames(r.seq)
        }
    }

    fn lookahead(&self, r: &DecReq) -> usize {
        if self.policy.left_context_frames > 0 {
            0
        } else {
            r.stream.lookahead_frames()
        }
    }

    fn is_ready(&self, r: &DecReq) -> bool {
        if r.upstream_done {
            return true;
        }
        self.policy.async_chunk && r.fed + r.pending_frames >= self.target(r) + self.lookahead(r)
    }

    /// Takes `n` frames (or all when `n` is None) off the pending queue.
    fn take(r: &mut DecReq, n: Option<usize>) -> Result<Option<Tensor>> {
        let want = n.unwrap_or(r.pending_frames).min(r.pending_frames);
        if want == 0 {
            return Ok(None);
        }
        let mut parts = Vec::new();
        let mut got = 0;
        while got < want {
            let Some(t) = r.pending.pop_front() else {
                break;
            };
            let len = t.dim(2)?;
            let need = want - got;
            if len <= need {
                got += len;
                parts.push(t);
            } else {
                parts.push(t.narrow(2, 0, need)?);
                r.pending.push_front(t.narrow(2, need, len - need)?);
                got += need;
            }
        }
        r.pending_frames -= got;
        Ok(Some(Tensor::cat(&parts, 2)?))
    }

    fn decode_step(&self, r: &mut DecReq) -> Result<(Vec<f32>, bool)> {
        if !self.policy.async_chunk {
            // Baseline: one decode of everything once it has all arrived.
            let z = Self::take(r, None)?;
            let pcm = match z {
                Some(z) => self.voice.decode(&z)?,
                None => Vec::new(),
            };
            return Ok((pcm, true));
        }
        if self.policy.left_context_frames > 0 {
            return self.windowed_step(r);
        }
        if r.upstream_done {
            let mut pcm = Vec::new();
            if let Some(z) = Self::take(r, None)? {
                r.fed += z.dim(2)?;
                pcm = r.stream.step(&self.voice, &z)?;
            }
            pcm.extend(r.stream.finish(&self.voice)?);
            r.emitted = r.fed;
            return Ok((pcm, true));
        }
        let target = self.target(r);
        let n = (target + self.lookahead(r)).saturating_sub(r.fed);
        let z = Self::take(r, Some(n))?;
        let mut pcm = Vec::new();
        if let Some(z) = z {
            r.fed += z.dim(2)?;
            pcm = r.stream.step(&self.voice, &z)?;
        }
        r.emitted = target;
        Ok((pcm, false))
    }

    /// Reference-style: decode [left context + chunk] and keep the chunk's samples.
    fn windowed_step(&self, r: &mut DecReq) -> Result<(Vec<f32>, bool)> {
        let n = if r.upstream_done {
            None
        } else {
            Some(self.target(r).saturating_sub(r.emitted))
        };
        let Some(z) = Self::take(r, n)? else {
            return Ok((Vec::new(), r.upstream_done));
        };
        let t = z.dim(2)?;
        let (window, ctx_frames) = match &r.history {
            Some(h) => (Tensor::cat(&[h, &z], 2)?, h.dim(2)?),
            None => (z.clone(), 0),
        };
        let pcm = self.voice.decode(&window)?;
        let hop = self.voice.hop_length();
        let pcm = pcm[(ctx_frames * hop).min(pcm.len())..].to_vec();
        let keep = self.policy.left_context_frames.min(window.dim(2)?);
        let total = window.dim(2)?;
        r.history = Some(window.narrow(2, total - keep, keep)?);
        r.fed += t;
        r.emitted += t;
        let done = r.upstream_done && r.pending_frames == 0;
        Ok((pcm, done))
    }
}

impl StageModel for PiperCode2Wav {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        let id = ctx.id;
        self.reqs.insert(
            id,
            DecReq {
                ctx,
                stream: self.voice.decoder_stream(),
                pending: VecDeque::new(),
                pending_frames: 0,
                fed: 0,
                emitted: 0,
                history: None,
                upstream_done: false,
                seq: 0,
                chunks: 0,
            },
        );
        self.order.push_back(id);
        Ok(())
    }

    fn push(&mut self, id: RequestId, payload: Payload) -> Result<()> {
        let Payload::Frames(chunk) = payload else {
            return Err(ModelError::Invalid("Code2Wav takes frames".into()));
        };
        let channels = self.voice.latent_channels();
        if let Some(r) = self.reqs.get_mut(&id) {
            if let Some(f) = chunk.frames {
                let dims = f.dims();
                if dims.len() != 3 || dims[0] != 1 || dims[1] != channels {
                    return Err(ModelError::Invalid(format!(
                        "frames must be [1, {channels}, T], got {dims:?}"
                    )));
                }
                r.pending_frames += dims[2];
                r.pending.push_back(f);
            }
            r.upstream_done |= chunk.finished;
        }
        Ok(())
    }

    fn step(&mut self, out: &mut StepOutput) {
        let mut order = std::mem::take(&mut self.order);
        let ready = take_ready(&mut order, self.max_num_seqs, |id| {
            self.reqs.get(id).is_some_and(|r| self.is_ready(r))
        });
        self.order = order;
        out.batch = ready.len();
        let sample_rate = self.voice.sample_rate();
        for id in ready {
            let Some(mut r) = self.reqs.remove(&id) else {
                continue;
            };
            match self.decode_step(&mut r) {
                Ok((pcm, done)) => {
                    if !pcm.is_empty() {
                        r.ctx.emit(Event::Audio {
                            samples: pcm,
                            sample_rate,
                            seq: r.chunks,
                        });
                        r.chunks += 1;
                    }
                    // `seq` counts decode steps, so the first-chunk policy
                    // applies once even if that chunk was all lookahead.
                    r.seq += 1;
                    if done {
                        self.order.retain(|x| *x != id);
                        out.finished.push(id);
                    } else {
                        self.reqs.insert(id, r);
                    }
                }
                Err(e) => {
                    self.order.retain(|x| *x != id);
                    out.failed.push((id, e));
                }
            }
        }
    }

    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
        self.order.retain(|x| *x != id);
    }

    fn has_ready_work(&self) -> bool {
        self.reqs.values().any(|r| self.is_ready(r))
    }

    fn active(&self) -> usize {
        self.reqs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::ChunkPolicy;

    #[test]
    fn a_ramp_doubles_up_to_the_chunk() {
        let p = |initial, chunk, ramp| ChunkPolicy {
            async_chunk: true,
            initial_frames: initial,
            chunk_frames: chunk,
            left_context_frames: 0,
            ramp,
        };
        let first: Vec<usize> = (0..6).map(|k| p(1, 8, true).frames(k)).collect();
        assert_eq!(first, vec![1, 2, 4, 8, 8, 8]);
        assert_eq!(
            p(1, 8, true).sizes(),
            vec![(1, true), (2, false), (4, false), (8, false)]
        );
        assert_eq!(
            p(3, 25, true).sizes(),
            vec![(3, true), (6, false), (12, false), (24, false), (25, false)]
        );
        // Without it: the first, then the chunk; a first larger than the chunk too.
        assert_eq!(p(1, 8, false).sizes(), vec![(1, true), (8, false)]);
        assert_eq!(
            (0..3).map(|k| p(10, 4, true).frames(k)).collect::<Vec<_>>(),
            vec![10, 4, 4]
        );
        assert_eq!(p(10, 4, true).sizes(), vec![(10, true), (4, false)]);
        assert_eq!(p(1, 1, false).sizes(), vec![(1, true), (1, false)]);
    }
}
