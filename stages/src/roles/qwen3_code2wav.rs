//! Code2Wav stage for Qwen3-Omni: codec frames in, 24 kHz PCM out.
//!
//! The decoder is causal and keeps every layer's state across chunks
//! (`models::qwen3_omni::code2wav`), so a chunk is decoded as soon as its frames
//! are here, with no lookahead and no re-decoded context, and the streamed audio
//! equals the whole-utterance decode. The chunk sizes only trade how often audio
//! goes out against per-call overhead: the first chunk after
//! `initial_codec_chunk_frames`, then every `codec_chunk_frames`.

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::{ChunkPolicy, Requests};
use crate::engine::{Event, Payload, RequestCtx, RequestId, StageModel, StepOutput};
use crate::models::qwen3_omni::code2wav::Code2WavState;
use crate::models::qwen3_omni::graphs;
use crate::models::qwen3_omni::omni::Qwen3Omni;
use crate::models::{ModelError, Result};

struct Req {
    ctx: Arc<RequestCtx>,
    state: Code2WavState,
    /// Frames `(groups, n)` received and not yet decoded, oldest first.
    pending: VecDeque<Tensor>,
    pending_frames: usize,
    upstream_done: bool,
    chunks: u64,
}

pub struct Qwen3OmniCode2Wav {
    model: Arc<Qwen3Omni>,
    policy: ChunkPolicy,
    max_num_seqs: usize,
    reqs: Requests<Req>,
}

/// The sample rate of Qwen3-Omni's audio.
pub const QWEN3_OMNI_SAMPLE_RATE: u32 = 24_000;

impl Qwen3OmniCode2Wav {
    pub fn new(model: Arc<Qwen3Omni>, policy: ChunkPolicy, max_num_seqs: usize) -> Self {
        Self {
            model,
            policy,
            max_num_seqs,
            reqs: Requests::default(),
        }
    }

    fn chunk(&self, r: &Req) -> usize {
        if r.chunks == 0 {
            self.policy.initial_frames
        } else {
            self.policy.chunk_frames
        }
    }

    fn is_ready(&self, r: &Req) -> bool {
        r.upstream_done || (self.policy.async_chunk && r.pending_frames >= self.chunk(r))
    }

    /// Takes the next chunk's codes `(groups, n)` (everything left once upstream is
    /// done); returns them (none when nothing is pending) and whether the request
    /// is complete after them.
    fn next_chunk(&self, r: &mut Req) -> Result<(Option<Tensor>, bool)> {
        let want = if r.upstream_done {
            r.pending_frames
        } else {
            self.chunk(r).min(r.pending_frames)
        };
        let mut parts = Vec::new();
        let mut got = 0;
        while got < want {
            let Some(t) = r.pending.pop_front() else {
                break;
            };
            let n = t.dim(1)?;
            if got + n <= want {
                got += n;
                parts.push(t);
            } else {
                let need = want - got;
                parts.push(t.narrow(1, 0, need)?);
                r.pending.push_front(t.narrow(1, need, n - need)?);
                got = want;
            }
        }
        r.pending_frames -= got;
        let done = r.upstream_done && r.pending_frames == 0;
        if parts.is_empty() {
            return Ok((None, done));
        }
        Ok((Some(Tensor::cat(&parts, 1)?), done))
    }

    /// Decodes the ready requests' next chunks: requests with chunks of one length
    /// share a forward (`Code2Wav::step_many`), each with its own exact state.
    fn decode_all(&self, batch: &mut [(RequestId, Req)]) -> Vec<Result<bool>> {
        let mut results: Vec<Option<Result<bool>>> = (0..batch.len()).map(|_| None).collect();
        let mut chunks: Vec<(usize, Tensor, bool)> = Vec::new();
        for (i, (_, r)) in batch.iter_mut().enumerate() {
            match self.next_chunk(r) {
                Ok((Some(codes), done)) => chunks.push((i, codes, done)),
                Ok((None, done)) => results[i] = Some(Ok(done)),
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        // One forward per chunk length.
        let mut lens: Vec<usize> = chunks
            .iter()
            .filter_map(|(_, c, _)| c.dim(1).ok())
            .collect();
        lens.sort_unstable();
        lens.dedup();
        for n in lens {
            let group: Vec<&(usize, Tensor, bool)> = chunks
                .iter()
                .filter(|(_, c, _)| c.dim(1).is_ok_and(|m| m == n))
                .collect();
            let mut states: Vec<_> = group
                .iter()
                .map(|(i, _, _)| {
                    std::mem::replace(&mut batch[*i].1.state, self.model.code2wav().new_state())
                })
                .collect();
            let codes: Vec<Tensor> = group.iter().map(|(_, c, _)| c.clone()).collect();
            let decoded = self.model.code2wav().step_many(&mut states, &codes);
            for ((i, _, done), state) in group.iter().zip(states) {
                batch[*i].1.state = state;
                results[*i] = Some(Ok(*done));
            }
            match decoded {
                Ok(wavs) => {
                    for ((i, _, _), wav) in group.iter().zip(wavs) {
                        let r = &mut batch[*i].1;
                        let pcm = wav
                            .flatten_all()
                            .and_then(|w| w.to_dtype(DType::F32))
                            .and_then(|w| w.to_vec1::<f32>());
                        match pcm {
                            Ok(samples) => {
                                r.ctx.emit(Event::Audio {
                                    samples,
                                    sample_rate: QWEN3_OMNI_SAMPLE_RATE,
                                    seq: r.chunks,
                                });
                                r.chunks += 1;
                            }
                            Err(e) => results[*i] = Some(Err(e.into())),
                        }
                    }
                }
                Err(e) => {
                    for (i, _, _) in &group {
                        results[*i] = Some(Err(ModelError::Invalid(format!("code2wav: {e}"))));
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(ModelError::Invalid("code2wav: chunk lost".into()))))
            .collect()
    }
}

impl StageModel for Qwen3OmniCode2Wav {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        self.reqs.insert(
            ctx.id,
            Req {
                ctx,
                state: self.model.code2wav().new_state(),
                pending: VecDeque::new(),
                pending_frames: 0,
                upstream_done: false,
                chunks: 0,
            },
        );
        Ok(())
    }

    fn push(&mut self, id: RequestId, payload: Payload) -> Result<()> {
        let Payload::Frames(chunk) = payload else {
            return Err(ModelError::Invalid("Code2Wav takes codec frames".into()));
        };
        let groups = self.model.config().code2wav.num_quantizers;
        let Some(r) = self.reqs.get_mut(id) else {
            return Ok(());
        };
        if let Some(f) = chunk.frames {
            let dims = f.dims();
            if dims.len() != 2 || dims[0] != groups {
                return Err(ModelError::Invalid(format!(
                    "codec frames must be [{groups}, T], got {dims:?}"
                )));
            }
            r.pending_frames += dims[1];
            r.pending.push_back(f);
        }
        r.upstream_done |= chunk.finished;
        Ok(())
    }

    fn step(&mut self, out: &mut StepOutput) {
        // Ahead of the Thinker's next step on a shared GPU (graphs::yield_to_urgent).
        let _urgent = graphs::UrgentSection::on(self.model.thinker().device());
        let mut reqs = std::mem::take(&mut self.reqs);
        reqs.step(
            self.max_num_seqs,
            out,
            |r| self.is_ready(r),
            |batch, _| self.decode_all(batch),
        );
        self.reqs = reqs;
    }

    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(id);
    }

    fn has_ready_work(&self) -> bool {
        self.reqs.any(|r| self.is_ready(r))
    }

    fn active(&self) -> usize {
        self.reqs.len()
    }
}
