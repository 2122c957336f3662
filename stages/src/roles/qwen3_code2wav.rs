//! Code2Wav stage for Qwen3-Omni and Qwen3-TTS: codec frames in, 24 kHz PCM out.
//!
//! The decoder is causal and keeps every layer's state across chunks
//! (`models::qwen3_omni::code2wav`), so a chunk is decoded as soon as its frames
//! are here, with no lookahead and no re-decoded context, and the streamed audio
//! equals the whole-utterance decode. The chunk sizes only trade how often audio
//! goes out against per-call overhead: the first chunk after
//! `initial_codec_chunk_frames`, then every `codec_chunk_frames` (with
//! `codec_chunk_ramp`, doubling from the first up to it). On a GPU the
//! streams' states live in slots on the device and the steps replay CUDA graphs
//! captured when the stage starts (`Code2Wav::step_slots_graphed`), unless the
//! stage is `enforce_eager`.

use std::collections::VecDeque;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::{ChunkPolicy, Requests};
use crate::engine::{
    Event, Payload, RequestCtx, RequestId, StageModel, StepOutput, VoiceReference,
};
use crate::models::qwen3_omni::code2wav::Code2Wav;
use crate::models::qwen3_omni::code2wav::{Code2WavGraphs, Code2WavSlots};
use crate::models::qwen3_omni::graphs;
use crate::models::qwen3_omni::omni::Qwen3Omni;
use crate::models::qwen3_tts::model::Qwen3Tts;
use crate::models::{ModelError, Result};

/// The checkpoint whose decoder the stage runs.
pub enum CodecSource {
    Omni(Arc<Qwen3Omni>),
    Tts(Arc<Qwen3Tts>),
}

impl CodecSource {
    fn decoder(&self) -> Result<&Code2Wav> {
        match self {
            Self::Omni(m) => m.code2wav(),
            Self::Tts(m) => Ok(m.decoder()),
        }
    }

    fn device(&self) -> &candle_core::Device {
        match self {
            Self::Omni(m) => m.device(),
            Self::Tts(m) => m.device(),
        }
    }

    fn groups(&self) -> usize {
        match self {
            Self::Omni(m) => m.config().code2wav.num_quantizers,
            Self::Tts(m) => m.config().talker_config.num_code_groups,
        }
    }
}

struct Req {
    ctx: Arc<RequestCtx>,
    /// Its streaming state's slot in `Qwen3OmniCode2Wav::slots`.
    slot: usize,
    /// Frames `(groups, n)` received and not yet decoded, oldest first.
    pending: VecDeque<Tensor>,
    pending_frames: usize,
    upstream_done: bool,
    chunks: u64,
    /// A cloned voice's reference codes `(1, groups, frames)`, until the stream
    /// is seeded with them ([`Qwen3OmniCode2Wav::seed_pending`]).
    seed: Option<Tensor>,
}

pub struct Qwen3OmniCode2Wav {
    model: CodecSource,
    policy: ChunkPolicy,
    max_num_seqs: usize,
    reqs: Requests<Req>,
    /// Every stream's decoder state, batched on the device.
    slots: Code2WavSlots,
    /// The request in each slot (a slot is free when its request is gone).
    owners: Vec<Option<RequestId>>,
    /// Captured steps (a CUDA device, unless the stage's `enforce_eager`).
    graphs: Option<Code2WavGraphs>,
}

/// The most reference frames one pass of [`Qwen3OmniCode2Wav::seed_pending`]
/// decodes: 16 clips of 5 s (63 frames), twice a graphed step's 64 x 8.
const SEED_BATCH_FRAMES: usize = 1024;

/// The sample rate of Qwen3-Omni's audio.
pub const QWEN3_OMNI_SAMPLE_RATE: u32 = 24_000;

impl Qwen3OmniCode2Wav {
    pub fn new(
        model: CodecSource,
        policy: ChunkPolicy,
        max_num_seqs: usize,
        cuda_graphs: bool,
    ) -> Result<Self> {
        let slots = model.decoder()?.new_slots(max_num_seqs.max(1));
        let graphs =
            (cuda_graphs && graphs::available(model.device())).then(Code2WavGraphs::default);
        Ok(Self {
            graphs,
            model,
            policy,
            max_num_seqs,
            reqs: Requests::default(),
            owners: vec![None; slots.capacity()],
            slots,
        })
    }

    /// A free slot, reset for a new stream (more slots when all are taken).
    fn take_slot(&mut self, id: RequestId) -> Result<usize> {
        let reqs = &mut self.reqs;
        let free = self
            .owners
            .iter()
            .position(|o| o.is_none_or(|o| reqs.get_mut(o).is_none()));
        let slot = match free {
            Some(slot) => slot,
            None => {
                let slot = self.owners.len();
                self.slots.reserve(slot + 1)?;
                self.owners.resize(self.slots.capacity(), None);
                slot
            }
        };
        self.owners[slot] = Some(id);
        self.slots.reset(slot);
        Ok(slot)
    }

    /// In-context cloning: the speech continues the reference clip's, so the
    /// stream starts from the decoder state after the clip's codes, whose audio
    /// is dropped (qwen-tts decodes the clip's codes and the new ones together
    /// and cuts the clip's share: the same samples, F x 1920 of them, or one
    /// more where its float cut rounds down; see `voice_clone_cut`). Checked
    /// here; decoded by the next step, with the other streams' of its length.
    fn seed_codes(&self, reference: &VoiceReference) -> Result<Tensor> {
        let groups = self.model.groups();
        let frames = reference.codes.len();
        if frames == 0 || reference.codes.iter().any(|f| f.len() != groups) {
            return Err(ModelError::Invalid(format!(
                "a voice reference's codes must be frames of {groups} codes"
            )));
        }
        // (frames, groups) to the decoder's (1, groups, frames).
        let flat: Vec<u32> = reference.codes.iter().flatten().copied().collect();
        Ok(
            Tensor::from_vec(flat, (frames, groups), &candle_core::Device::Cpu)?
                .t()?
                .contiguous()?
                .unsqueeze(0)?,
        )
    }

    /// Decodes the reference codes of every stream admitted since the last step,
    /// those of one length together (up to [`SEED_BATCH_FRAMES`] frames a pass):
    /// one by one, 64 clones arriving at once held every running stream back for
    /// 64 eager decodes of a whole clip each. A pass ([`Code2Wav::seed_slots`])
    /// runs the clip through the transformer and only its last frames through
    /// the convolutions, those in the chunk lengths the stage captured, so on a
    /// GPU it replays captured steps (an eager decode of a whole 5 s clip was
    /// most of a clone's first audio at c=1); the state is the one-shot
    /// decode's. A pass that fails fails its streams.
    fn seed_pending(&mut self, out: &mut StepOutput) {
        let mut waiting: Vec<(RequestId, usize, Tensor)> = self
            .reqs
            .iter_mut()
            .filter_map(|(id, r)| r.seed.take().map(|c| (id, r.slot, c)))
            .collect();
        let frames = |c: &Tensor| c.dim(2).unwrap_or(0);
        waiting.sort_by_key(|(id, _, c)| (frames(c), *id));
        let mut rest = waiting.as_slice();
        while let Some((_, _, first)) = rest.first() {
            let n = frames(first);
            let most = (SEED_BATCH_FRAMES / n.max(1)).max(1);
            let len = rest
                .iter()
                .take(most)
                .take_while(|(_, _, c)| frames(c) == n)
                .count();
            let (group, next) = rest.split_at(len);
            rest = next;
            let slots: Vec<usize> = group.iter().map(|(_, s, _)| *s).collect();
            let codes: Vec<&Tensor> = group.iter().map(|(_, _, c)| c).collect();
            let sizes = self.policy.sizes();
            let seeded = self.model.decoder().and_then(|c2w| {
                let codes = Tensor::cat(&codes, 0)?;
                let graphs = self.graphs.as_mut();
                Ok(c2w.seed_slots(&mut self.slots, graphs, &slots, &codes, &sizes)?)
            });
            if let Err(e) = seeded {
                for (id, _, _) in group {
                    self.reqs.remove(*id);
                    let msg = format!("code2wav: decoding the voice reference: {e}");
                    out.failed.push((*id, ModelError::Invalid(msg)));
                }
            }
        }
    }

    fn chunk(policy: &ChunkPolicy, r: &Req) -> usize {
        policy.frames(r.chunks)
    }

    fn is_ready(policy: &ChunkPolicy, r: &Req) -> bool {
        r.seed.is_none()
            && (r.upstream_done
                || (policy.async_chunk && r.pending_frames >= Self::chunk(policy, r)))
    }

    /// Takes the next chunk's codes `(groups, n)` (everything left once upstream is
    /// done); returns them (none when nothing is pending) and whether the request
    /// is complete after them.
    fn next_chunk(&self, r: &mut Req) -> Result<(Option<Tensor>, bool)> {
        let want = if r.upstream_done {
            r.pending_frames
        } else {
            Self::chunk(&self.policy, r).min(r.pending_frames)
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
    /// share a forward (`Code2Wav::step_slots`), each with its own exact state.
    fn decode_all(&mut self, batch: &mut [(RequestId, Req)]) -> Vec<Result<bool>> {
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
            let slots: Vec<usize> = group.iter().map(|(i, _, _)| batch[*i].1.slot).collect();
            let codes: Vec<Tensor> = group.iter().map(|(_, c, _)| c.clone()).collect();
            // One copy to the host for the whole group.
            let decoded = Tensor::stack(&codes, 0)
                .and_then(|codes| {
                    let c2w = (self.model.decoder())
                        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                    match &mut self.graphs {
                        Some(g) => c2w.step_slots_graphed(&mut self.slots, g, &slots, &codes),
                        None => c2w.step_slots(&mut self.slots, &slots, &codes),
                    }
                })
                .and_then(|wav| wav.flatten_from(1)?.to_dtype(DType::F32)?.to_vec2::<f32>());
            match decoded {
                Ok(wavs) => {
                    for ((i, _, done), samples) in group.iter().zip(wavs) {
                        let r = &mut batch[*i].1;
                        r.ctx.emit(Event::Audio {
                            samples,
                            sample_rate: QWEN3_OMNI_SAMPLE_RATE,
                            seq: r.chunks,
                        });
                        r.chunks += 1;
                        results[*i] = Some(Ok(*done));
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
        let seed = match &ctx.spec.style.reference {
            Some(reference) => Some(self.seed_codes(reference)?),
            None => None,
        };
        let slot = self.take_slot(ctx.id)?;
        self.reqs.insert(
            ctx.id,
            Req {
                ctx,
                slot,
                pending: VecDeque::new(),
                pending_frames: 0,
                upstream_done: false,
                chunks: 0,
                seed,
            },
        );
        Ok(())
    }

    fn push(&mut self, id: RequestId, payload: Payload) -> Result<()> {
        let Payload::Frames(chunk) = payload else {
            return Err(ModelError::Invalid("Code2Wav takes codec frames".into()));
        };
        let groups = self.model.groups();
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
        // With OMNISTREAM_ENCODE_PRIORITY=all the reference clips being encoded
        // go first, as for the Talker: beside this stage's convolutions a batch
        // of clips ran ten times slower, and every cloned request waits for it.
        graphs::yield_to_encodes(graphs::ENCODE_WAIT_CAP, true);
        // Ahead of the Thinker's next step on a shared GPU (graphs::yield_to_urgent).
        let dev = self.model.device();
        let _urgent = graphs::UrgentSection::decoder_step(dev, self.graphs.is_some());
        self.seed_pending(out);
        let mut reqs = std::mem::take(&mut self.reqs);
        let policy = self.policy;
        reqs.step(
            self.max_num_seqs,
            out,
            |r| Self::is_ready(&policy, r),
            |batch, _| self.decode_all(batch),
        );
        self.reqs = reqs;
    }

    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(id);
    }

    fn has_ready_work(&self) -> bool {
        self.reqs
            .any(|r| r.seed.is_some() || Self::is_ready(&self.policy, r))
    }

    fn start(&mut self) {
        let Some(g) = &mut self.graphs else {
            return;
        };
        let t = std::time::Instant::now();
        let sizes = self.policy.sizes();
        // The constructor checked the part is there.
        let Ok(c2w) = self.model.decoder() else {
            return;
        };
        match c2w.warm_up_graphs(&mut self.slots, g, self.max_num_seqs, &sizes) {
            Ok(n) => tracing::info!("Code2Wav: {n} graphs captured in {:?}", t.elapsed()),
            // Buckets not captured are captured at their first step, or run eagerly.
            Err(e) => tracing::warn!("Code2Wav: capturing graphs: {e}"),
        }
    }

    fn active(&self) -> usize {
        self.reqs.len()
    }
}
