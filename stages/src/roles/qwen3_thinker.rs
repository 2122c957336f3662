//! Thinker stage for Qwen3-Omni: chat text or speech in (the audio encoder hears
//! a spoken turn itself), text out, and for requests that want audio the
//! Thinker's states for the Talker: the prompt's embeddings and
//! `accept_hidden_layer` states once, then each generated token's embedding as
//! it is fed back.
//!
//! Continuous batching: new requests are prefilled together (prompts left-padded
//! into one forward, their spoken turns heard in one pass of the audio encoder),
//! then join the running batch in a KV slot; every step decodes the whole running
//! batch in one forward, and a finished request leaves between steps (the last
//! slot moves into its place). With `prefill_chunk_tokens`, a longer prompt is
//! prefilled a chunk a step, after the running batch's decode (vLLM's chunked
//! prefill), so that it does not hold everyone else's next token for its whole
//! prefill.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use candle_core::{IndexOp, Tensor};

use super::invalid_call;
use crate::engine::constrain::CallConstraint;
use crate::engine::tools::{AnswerWords, Tools};
use crate::engine::ChatMessage;
use crate::engine::{
    Payload, PromptStates, RequestCtx, RequestId, RequestInput, StageModel, StepOutput, TextChunk,
    ThinkerStates,
};
use crate::models::qwen3_omni::graphs;
use crate::models::qwen3_omni::layers::KvSlots;
use crate::models::qwen3_omni::omni::Qwen3Omni;
use crate::models::qwen3_omni::sampling::{self, Sampler, SamplingConfig};
use crate::models::qwen3_omni::thinker::{AudioEmbeds, ThinkerCache, ThinkerGraphs};
use crate::models::tokenizer::{ChatTokenizer, IncrementalDecoder};
use crate::models::{ModelError, Result};
use crate::profile::SamplingParams;

const DEFAULT_MAX_TOKENS: usize = 256;
/// How a spoken turn appears in the chat template (the processor's placeholder,
/// expanded to one `<|audio_pad|>` per audio-encoder output).
/// The longest a decode step waits for the Talker's or Code2Wav's eager work.
const MAX_YIELD: std::time::Duration = std::time::Duration::from_millis(100);

const AUDIO_PLACEHOLDER: &str = "<|audio_start|><|audio_pad|><|audio_end|>";

/// One request's result of a forward: its next-token logits and what the Talker
/// gets of it.
type Row = (RequestId, Pick, ThinkerStates);

/// A row's next token as the step leaves it: chosen on the device (greedy), or
/// its logits for the request's sampler on the host.
enum Pick {
    Token(u32),
    Logits(Vec<f32>),
}

struct Seq {
    ctx: Arc<RequestCtx>,
    prompt: Vec<u32>,
    /// A spoken turn's 16 kHz PCM, heard at prefill.
    audio: Option<Arc<[f32]>>,
    /// Once prefilled: cached positions and the next token's rope position.
    decode: Option<(usize, i64)>,
    sampler: Sampler,
    /// The request named its seed: its draws come from the host's seeded sampler,
    /// reproducibly, never from the device's generator.
    seeded: bool,
    generated: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    detok: IncrementalDecoder,
    /// Words and tool calls of the answer.
    words: AnswerWords,
    /// A forced tool call's grammar: its rows' logits go to the host, masked.
    constraint: Option<CallConstraint>,
    /// The last token was all words: the Talker gets its embedding (a tool
    /// call's tokens are never spoken).
    last_was_words: bool,
    /// The request goes on to the Talker: produce its states.
    speak: bool,
}

/// A long prompt being prefilled a chunk a step.
struct Chunking {
    id: RequestId,
    cache: ThinkerCache,
    /// Prompt tokens prefilled so far.
    done: usize,
    /// Its spoken turn's embeddings (heard with the first chunk), and how
    /// many of them the chunks so far took.
    audio: Option<Tensor>,
    audio_used: usize,
    /// The Talker's prompt states, chunk by chunk: embeddings, and the
    /// `accept_hidden_layer` states.
    embeds: Vec<Tensor>,
    hidden: Vec<Tensor>,
}

pub struct Qwen3OmniThinker {
    model: Arc<Qwen3Omni>,
    tokenizer: Arc<ChatTokenizer>,
    defaults: SamplingParams,
    max_num_seqs: usize,
    /// Longest prompt + answer (the KV slots' length).
    max_len: usize,
    /// Padded tokens prefilled together in one step (a longer prompt goes alone).
    max_prefill_tokens: usize,
    /// A prompt longer than this is prefilled in chunks of it, one a step.
    prefill_chunk: Option<usize>,
    chunking: Option<Chunking>,
    seqs: HashMap<RequestId, Seq>,
    /// Admitted, not prefilled yet, oldest first.
    waiting: VecDeque<RequestId>,
    /// The running batch: request `i` lives in KV slot `i`.
    running: Vec<RequestId>,
    /// One per layer, allocated with the stage (like any server's KV pool).
    slots: Vec<KvSlots>,
    /// Requests dropped from the batch by a failed slot copy, to fail next step.
    lost: Vec<RequestId>,
    /// Captured decode steps (a GPU without `enforce_eager`).
    graphs: Option<ThinkerGraphs>,
}

/// A Qwen3-Omni sampling config from a stage's defaults and a request's overrides.
pub(super) fn sampling_config(
    d: &SamplingParams,
    o: Option<&crate::engine::SamplingOverrides>,
    seed: u64,
) -> SamplingConfig {
    let temperature = o
        .and_then(|o| o.temperature)
        .or(d.temperature)
        .unwrap_or(0.0) as f32;
    SamplingConfig {
        do_sample: temperature > 1e-7,
        temperature: if temperature > 1e-7 { temperature } else { 1.0 },
        top_k: o.and_then(|o| o.top_k).or(d.top_k).unwrap_or(0),
        top_p: o.and_then(|o| o.top_p).or(d.top_p).unwrap_or(1.0) as f32,
        repetition_penalty: d.repetition_penalty.unwrap_or(1.0),
        suppress_tokens: Vec::new(),
        seed: o.and_then(|o| o.seed).or(d.seed).unwrap_or(seed),
    }
}

/// How much the Thinker takes on: the profile's stage settings.
pub struct ThinkerLimits {
    pub max_num_seqs: usize,
    /// Longest prompt + answer (`max_model_len`).
    pub max_len: usize,
    pub max_prefill_tokens: usize,
    pub prefill_chunk_tokens: Option<usize>,
}

impl Qwen3OmniThinker {
    pub fn new(
        model: Arc<Qwen3Omni>,
        tokenizer: Arc<ChatTokenizer>,
        defaults: SamplingParams,
        limits: ThinkerLimits,
        cuda_graphs: bool,
    ) -> Result<Self> {
        let ThinkerLimits {
            max_num_seqs,
            max_len,
            max_prefill_tokens,
            prefill_chunk_tokens,
        } = limits;
        // The tokenizer and the checkpoint must agree on the audio placeholder.
        let want = model.config().thinker.audio_token_id;
        match tokenizer.token_to_id("<|audio_pad|>") {
            Some(id) if id == want => {}
            got => {
                return Err(ModelError::Invalid(format!(
                    "tokenizer's <|audio_pad|> is {got:?}, the model's audio_token_id is {want}"
                )))
            }
        }
        let max_ctx = model.config().thinker.text_config.max_position_embeddings;
        let max_len = max_len.min(max_ctx).max(2);
        let slots = model.thinker()?.new_slots(max_num_seqs, max_len)?;
        let graphs =
            (cuda_graphs && graphs::available(model.device())).then(ThinkerGraphs::default);
        Ok(Self {
            model,
            tokenizer,
            defaults,
            max_num_seqs,
            max_len,
            max_prefill_tokens: max_prefill_tokens.max(1),
            prefill_chunk: prefill_chunk_tokens.map(|c| c.max(1)),
            chunking: None,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            graphs,
            slots,
            lost: Vec::new(),
        })
    }

    fn prompt(
        &self,
        messages: &[ChatMessage],
        audio: Option<&[f32]>,
        tools: Option<&Tools>,
    ) -> Result<Vec<u32>> {
        let Some(pcm) = audio else {
            let text = self.tokenizer.chat_prompt(messages, tools)?;
            return self.tokenizer.encode(&text);
        };
        let mut all = messages.to_vec();
        all.push(ChatMessage::user(AUDIO_PLACEHOLDER));
        let text = self.tokenizer.chat_prompt(&all, tools)?;
        let pad = self.model.config().thinker.audio_token_id;
        let n = self.model.audio_tokens(pcm.len());
        if n == 0 {
            return Err(ModelError::Invalid(
                "the spoken turn is too short to hear".into(),
            ));
        }
        let mut ids = Vec::new();
        for t in self.tokenizer.encode(&text)? {
            if t == pad {
                ids.extend(std::iter::repeat_n(pad, n));
            } else {
                ids.push(t);
            }
        }
        Ok(ids)
    }

    /// Prefills `ids` together (left-padded; their spoken turns heard here) and
    /// moves each into a free KV slot. Returns each request's first
    /// logits and what the Talker gets of its prompt.
    fn prefill(&mut self, ids: &[RequestId]) -> Result<Vec<Row>> {
        let thinker = self.model.thinker()?;
        let dev = thinker.device().clone();
        let accept = self.model.config().talker.accept_hidden_layer;
        let ids: Vec<RequestId> = ids
            .iter()
            .copied()
            .filter(|id| self.seqs.contains_key(id))
            .collect();
        let seqs: Vec<&Seq> = ids.iter().filter_map(|id| self.seqs.get(id)).collect();
        let (b, s) = (
            seqs.len(),
            seqs.iter().map(|q| q.prompt.len()).max().unwrap_or(0),
        );
        // The group's spoken turns, heard in one pass of the audio encoder;
        // their embeddings come in row order, the order of their `<|audio_pad|>` tokens.
        let pcms: Vec<&[f32]> = seqs.iter().filter_map(|q| q.audio.as_deref()).collect();
        let heard = match pcms.is_empty() {
            true => None,
            false => Some(self.model.hear_all(&pcms)?),
        };
        let audio = heard.as_ref().map(|(embeds, frames)| AudioEmbeds {
            embeds,
            feature_lengths: frames,
        });
        let mut flat = Vec::with_capacity(b * s);
        let mut mask = Vec::with_capacity(b * s);
        for q in &seqs {
            let pad = s - q.prompt.len();
            flat.extend(std::iter::repeat_n(0u32, pad).chain(q.prompt.iter().copied()));
            mask.extend(
                std::iter::repeat_n(0u8, pad).chain(std::iter::repeat_n(1, q.prompt.len())),
            );
        }
        let input = Tensor::from_vec(flat, (b, s), &dev)?;
        let mask = Tensor::from_vec(mask, (b, s), &dev)?;
        let speak = seqs.iter().any(|q| q.speak);
        let hidden: &[usize] = if speak { &[0, accept] } else { &[] };
        let mut cache = thinker.new_cache();
        let out = thinker.prefill_last(&input, Some(&mask), audio, &mut cache, hidden)?;
        let slots = &self.slots;
        let last = self.picks(&ids, &out.logits.squeeze(1)?)?;
        let mut results = Vec::with_capacity(b);
        for (row, (id, logits)) in ids.iter().zip(last).enumerate() {
            let slot = self.running.len();
            let (len, pos) = thinker.load_slot(slots, slot, &cache, row)?;
            let Some(seq) = self.seqs.get_mut(id) else {
                continue;
            };
            seq.decode = Some((len, pos));
            self.running.push(*id);
            let states = if seq.speak {
                let part = |t: &Tensor| t.i(row)?.narrow(0, s - len, len);
                ThinkerStates {
                    prompt: Some(Arc::new(PromptStates {
                        ids: seq.prompt.clone(),
                        embeds: part(&out.hidden_states[0])?,
                        hidden: part(&out.hidden_states[1])?,
                    })),
                    embeds: None,
                }
            } else {
                ThinkerStates::default()
            };
            results.push((*id, logits, states));
        }
        Ok(results)
    }

    /// The next chunk of the long prompt being prefilled (its spoken turn
    /// heard with the first). After the last chunk the request moves into a
    /// free KV slot and its first logits and prompt states come back.
    fn prefill_chunk(&mut self) -> Result<Option<Row>> {
        let Some(mut c) = self.chunking.take() else {
            return Ok(None);
        };
        let thinker = self.model.thinker()?;
        let Some(seq) = self.seqs.get(&c.id) else {
            return Ok(None);
        };
        if c.done == 0 {
            if let Some(pcm) = &seq.audio {
                c.audio = Some(self.model.hear(pcm)?.0);
            }
        }
        let end = (c.done + self.prefill_chunk.unwrap_or(usize::MAX)).min(seq.prompt.len());
        let part = &seq.prompt[c.done..end];
        let pad = self.model.config().thinker.audio_token_id;
        let n_audio = part.iter().filter(|&&t| t == pad).count();
        let audio_part = match &c.audio {
            Some(a) if n_audio > 0 => Some(a.narrow(0, c.audio_used, n_audio)?),
            _ => None,
        };
        let audio = audio_part.as_ref().map(|embeds| AudioEmbeds {
            embeds,
            feature_lengths: &[],
        });
        let input = Tensor::from_vec(part.to_vec(), (1, part.len()), thinker.device())?;
        let accept = self.model.config().talker.accept_hidden_layer;
        let hidden: &[usize] = if seq.speak { &[0, accept] } else { &[] };
        let out = match c.done {
            0 => thinker.prefill_last(&input, None, audio, &mut c.cache, hidden)?,
            _ => thinker.extend_last(&input, audio, &mut c.cache, hidden)?,
        };
        c.done = end;
        c.audio_used += n_audio;
        if seq.speak {
            c.embeds.push(out.hidden_states[0].i(0)?);
            c.hidden.push(out.hidden_states[1].i(0)?);
        }
        if end < seq.prompt.len() {
            self.chunking = Some(c);
            return Ok(None);
        }
        let states = match seq.speak {
            true => ThinkerStates {
                prompt: Some(Arc::new(PromptStates {
                    ids: seq.prompt.clone(),
                    embeds: Tensor::cat(&c.embeds, 0)?,
                    hidden: Tensor::cat(&c.hidden, 0)?,
                })),
                embeds: None,
            },
            false => ThinkerStates::default(),
        };
        let pick = self
            .picks(&[c.id], &out.logits.squeeze(1)?)?
            .pop()
            .ok_or_else(|| ModelError::Invalid("the prompt's pick went missing".into()))?;
        let slot = self.running.len();
        let (len, pos) = thinker.load_slot(&self.slots, slot, &c.cache, 0)?;
        if let Some(seq) = self.seqs.get_mut(&c.id) {
            seq.decode = Some((len, pos));
        }
        self.running.push(c.id);
        Ok(Some((c.id, pick, states)))
    }

    /// One decode step of the whole running batch: each request's last token fed back.
    fn decode(&mut self) -> Result<Vec<Row>> {
        let thinker = self.model.thinker()?;
        let slots = &self.slots;
        let mut ids = Vec::with_capacity(self.running.len());
        let mut pos = Vec::with_capacity(self.running.len());
        let mut lens = Vec::with_capacity(self.running.len());
        let mut speak = false;
        for id in &self.running {
            let seq = self
                .seqs
                .get(id)
                .ok_or_else(|| ModelError::Invalid("lost a running request".into()))?;
            let (Some(&last), Some((len, p))) = (seq.generated.last(), seq.decode) else {
                return Err(ModelError::Invalid("decode before any token".into()));
            };
            ids.push(last);
            pos.push(p);
            lens.push(len);
            speak |= seq.speak;
        }
        let hidden: &[usize] = if speak { &[0] } else { &[] };
        if speak && thinker.device().is_cuda() {
            // The audio path first on a shared GPU (graphs::yield_to_urgent).
            graphs::yield_to_urgent(MAX_YIELD);
        }
        let out = match &mut self.graphs {
            Some(g) => thinker.step_slots_graphed(g, &ids, &pos, &lens, slots, hidden)?,
            None => thinker.step_slots(&ids, &pos, &lens, slots, hidden)?,
        };
        let logits = self.picks(&self.running, &out.logits.squeeze(1)?)?;
        let mut results = Vec::with_capacity(logits.len());
        for (row, (id, logits)) in self.running.iter().zip(logits).enumerate() {
            let seq = self
                .seqs
                .get_mut(id)
                .ok_or_else(|| ModelError::Invalid("lost a running request".into()))?;
            if let Some((len, p)) = &mut seq.decode {
                *len += 1;
                *p += 1;
            }
            let embeds = match seq.speak {
                true => Some(out.hidden_states[0].i((row, 0))?.unsqueeze(0)?),
                false => None,
            };
            results.push((
                *id,
                logits,
                ThinkerStates {
                    prompt: None,
                    embeds,
                },
            ));
        }
        Ok(results)
    }

    /// Each row's [`Pick`] from a step's logits `(rows, vocab)` for requests `ids`:
    /// on a GPU the greedy rows' ids come from one argmax launch, the rows sampled
    /// at a temperature alone (unseeded) from one Gumbel-max draw there, and only
    /// the other rows' logits are copied (a row is 608 KB, and the host sampler
    /// takes milliseconds a row over the vocabulary).
    fn picks(&self, ids: &[RequestId], logits: &Tensor) -> Result<Vec<Pick>> {
        // The checkpoint's embedding rows past the tokenizer's vocabulary are
        // padding (152,064 rows for ~151,700 tokens): never drawn.
        let vocab = self.tokenizer.vocab_size().min(logits.dim(1)?);
        // index_select wants whole (contiguous) rows; the padding goes after.
        let full = logits.contiguous()?;
        let logits = full.narrow(1, 0, vocab)?;
        #[derive(Clone, Copy, PartialEq)]
        enum Where {
            Argmax,
            Tempered(f32),
            Host,
        }
        let how: Vec<Where> = ids
            .iter()
            .map(|id| match self.seqs.get(id) {
                Some(q) if q.constraint.is_some() => Where::Host,
                Some(q) if sampling::greedy_on_device(q.sampler.config()) => Where::Argmax,
                Some(q) if !q.seeded && sampling::tempered_on_device(q.sampler.config()) => {
                    Where::Tempered(q.sampler.config().temperature)
                }
                _ => Where::Host,
            })
            .collect();
        if !logits.device().is_cuda() || how.iter().all(|&h| h == Where::Host) {
            return Ok(logits
                .to_vec2::<f32>()?
                .into_iter()
                .map(Pick::Logits)
                .collect());
        }
        let rows_where = |f: &dyn Fn(Where) -> bool| -> Vec<u32> {
            (0..ids.len() as u32)
                .filter(|&r| f(how[r as usize]))
                .collect()
        };
        let select = |rows: &[u32]| -> Result<Tensor> {
            let idx = Tensor::from_vec(rows.to_vec(), rows.len(), logits.device())?;
            Ok(full.index_select(&idx, 0)?.narrow(1, 0, vocab)?)
        };
        let argmax = match rows_where(&|h| h == Where::Argmax).len() {
            0 => Vec::new(),
            _ => sampling::argmax_rows(&logits)?.to_vec1::<u32>()?,
        };
        let tempered = rows_where(&|h| matches!(h, Where::Tempered(_)));
        let mut drawn = match tempered.len() {
            0 => Vec::new(),
            _ => {
                let temps: Vec<f32> = tempered
                    .iter()
                    .map(|&r| match how[r as usize] {
                        Where::Tempered(t) => t,
                        _ => 1.0,
                    })
                    .collect();
                sampling::gumbel_max_rows(&select(&tempered)?, &temps)?.to_vec1::<u32>()?
            }
        }
        .into_iter();
        let host = rows_where(&|h| h == Where::Host);
        let mut rows = match host.len() {
            0 => Vec::new(),
            _ => select(&host)?.to_vec2::<f32>()?,
        }
        .into_iter();
        let lost = || ModelError::Invalid("a row's pick went missing".into());
        how.iter()
            .enumerate()
            .map(|(r, h)| match h {
                Where::Argmax => argmax.get(r).copied().map(Pick::Token).ok_or_else(lost),
                Where::Tempered(_) => drawn.next().map(Pick::Token).ok_or_else(lost),
                Where::Host => rows.next().map(Pick::Logits).ok_or_else(lost),
            })
            .collect()
    }

    /// Samples `seq`'s next token (or takes the device's) and sends it on; returns
    /// whether the request is finished.
    fn advance(
        &self,
        id: RequestId,
        seq: &mut Seq,
        pick: Pick,
        states: ThinkerStates,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let token = match pick {
            Pick::Token(t) => {
                seq.sampler.push(t);
                t
            }
            Pick::Logits(mut l) => {
                if let Some(c) = &mut seq.constraint {
                    c.mask(&mut l).map_err(invalid_call)?;
                }
                seq.sampler.sample(&l)?
            }
        };
        if let Some(c) = &mut seq.constraint {
            c.commit(token).map_err(invalid_call)?;
        }
        let mut states = seq.speak.then_some(states);
        if !seq.last_was_words {
            // The embedding of the token before this one, a call's.
            if let Some(s) = &mut states {
                s.embeds = None;
            }
        }
        let eos = self.tokenizer.is_eos(token) && !seq.ignore_eos;
        let at_limit = seq.generated.len() + 1 >= seq.max_tokens;
        let ctx_full = seq.prompt.len() + seq.generated.len() + 1 >= self.max_len;
        let mut text = String::new();
        if !eos {
            seq.generated.push(token);
            seq.ctx.add_completion_tokens(1);
            if let Some(t) = seq.detok.push(&self.tokenizer, token)? {
                text = t;
            }
        }
        let call_done = seq.constraint.as_mut().is_some_and(CallConstraint::done);
        let finished = eos || at_limit || ctx_full || call_done;
        if finished {
            if let Some(t) = seq.detok.flush(&self.tokenizer)? {
                text.push_str(&t);
            }
        }
        let (mut text, all_words) = seq.words.push(&seq.ctx, text).map_err(invalid_call)?;
        let finished = finished || seq.words.ended();
        if finished {
            text.push_str(&seq.words.finish(&seq.ctx).map_err(invalid_call)?);
        }
        seq.last_was_words = all_words;
        // (The worker drops it for text-only requests, whose route ends here.)
        out.downstream.push((
            id,
            Payload::Text(TextChunk {
                text,
                token_ids: if eos || !all_words {
                    Vec::new()
                } else {
                    vec![token]
                },
                finished,
                states,
            }),
        ));
        Ok(finished)
    }
}

impl Qwen3OmniThinker {
    /// The next requests to prefill together: oldest first, as many as the free slots
    /// and `max_prefill_tokens` (padded) allow, spoken prompts with typed ones (the
    /// spoken turns are heard together in the prefill).
    fn next_prefill_group(&mut self) -> Vec<RequestId> {
        let free = self.max_num_seqs.saturating_sub(self.running.len());
        let mut group: Vec<RequestId> = Vec::new();
        let mut longest = 0;
        while group.len() < free {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(seq) = self.seqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            if self.is_long(seq) {
                break; // prefilled alone, a chunk a step
            }
            let l = longest.max(seq.prompt.len());
            if !group.is_empty() && l * (group.len() + 1) > self.max_prefill_tokens {
                break;
            }
            group.push(id);
            longest = l;
            self.waiting.pop_front();
        }
        group
    }

    /// A prompt prefilled in chunks.
    fn is_long(&self, seq: &Seq) -> bool {
        self.prefill_chunk.is_some_and(|c| seq.prompt.len() > c)
    }

    /// The long prompt to prefill next, a chunk a step: the one under way,
    /// else the oldest waiting when it is long and a KV slot is free.
    fn chunk_next(&mut self) -> bool {
        if self.chunking.is_some() {
            return true;
        }
        let Some(&id) = self.waiting.front() else {
            return false;
        };
        let long = self.seqs.get(&id).is_some_and(|q| self.is_long(q));
        if !long || self.running.len() >= self.max_num_seqs {
            return false;
        }
        let Ok(thinker) = self.model.thinker() else {
            return false;
        };
        self.waiting.pop_front();
        self.chunking = Some(Chunking {
            id,
            cache: thinker.new_cache(),
            done: 0,
            audio: None,
            audio_used: 0,
            embeds: Vec::new(),
            hidden: Vec::new(),
        });
        true
    }

    /// Samples and sends each row's token; finished and failed requests leave.
    fn finish_rows(&mut self, rows: Vec<Row>, out: &mut StepOutput) {
        for (id, pick, states) in rows {
            let Some(mut seq) = self.seqs.remove(&id) else {
                continue;
            };
            match self.advance(id, &mut seq, pick, states, out) {
                Ok(false) => {
                    self.seqs.insert(id, seq);
                }
                Ok(true) => {
                    self.leave(id);
                    out.finished.push(id);
                }
                Err(e) => {
                    self.leave(id);
                    out.failed.push((id, e));
                }
            }
        }
    }

    /// Frees `id`'s slot (see [`super::leave_slot`]); requests that lost theirs
    /// are failed at the next step.
    fn leave(&mut self, id: RequestId) {
        for lost in super::leave_slot(&mut self.running, &self.slots, id) {
            self.seqs.remove(&lost);
            self.lost.push(lost);
        }
    }
}

impl StageModel for Qwen3OmniThinker {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        let (messages, audio) = match &ctx.spec.input {
            RequestInput::Chat { messages } => (messages, None),
            RequestInput::Heard { messages, audio } => (messages, Some(audio.clone())),
            _ => {
                return Err(ModelError::Invalid(
                    "the Thinker takes a conversation".into(),
                ))
            }
        };
        let prompt = self.prompt(messages, audio.as_deref(), ctx.spec.tools.as_deref())?;
        if prompt.is_empty() {
            return Err(ModelError::Invalid("empty prompt".into()));
        }
        if prompt.len() >= self.max_len {
            return Err(ModelError::ContextLength {
                prompt: prompt.len(),
                context: self.max_len,
            });
        }
        ctx.set_prompt_tokens(prompt.len());
        let o = &ctx.spec.sampling;
        let max_tokens = o
            .max_tokens
            .or(self.defaults.max_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS)
            .max(1);
        let seq = Seq {
            sampler: Sampler::new(sampling_config(&self.defaults, Some(o), ctx.id)),
            seeded: o.seed.or(self.defaults.seed).is_some(),
            speak: ctx.spec.modalities.audio,
            prompt,
            audio,
            decode: None,
            generated: Vec::new(),
            max_tokens,
            ignore_eos: o.ignore_eos,
            detok: IncrementalDecoder::new(),
            words: AnswerWords::new(ctx.spec.tools.as_deref()),
            constraint: self.tokenizer.call_constraint(ctx.spec.tools.as_deref()),
            last_was_words: true,
            ctx,
        };
        self.waiting.push_back(seq.ctx.id);
        self.seqs.insert(seq.ctx.id, seq);
        Ok(())
    }

    fn push(&mut self, _id: RequestId, _payload: Payload) -> Result<()> {
        Err(ModelError::Invalid(
            "the Thinker takes its input with the request".into(),
        ))
    }

    fn step(&mut self, out: &mut StepOutput) {
        for id in self.lost.drain(..) {
            out.failed
                .push((id, ModelError::Invalid("its KV slot was lost".into())));
        }
        // Decode the running batch first, so new prompts never delay its next token.
        if !self.running.is_empty() {
            out.batch = self.running.len();
            match self.decode() {
                Ok(rows) => self.finish_rows(rows, out),
                Err(e) => {
                    for id in std::mem::take(&mut self.running) {
                        self.seqs.remove(&id);
                        out.failed.push((id, ModelError::Invalid(e.to_string())));
                    }
                }
            }
        }
        // Then a long prompt's next chunk, or what fits of the waiting
        // prompts in the free slots and the prefill budget.
        if self.chunk_next() {
            let id = self.chunking.as_ref().map(|c| c.id);
            out.batch += 1;
            match self.prefill_chunk() {
                Ok(Some(row)) => self.finish_rows(vec![row], out),
                Ok(None) => {}
                Err(e) => {
                    // (It joins `running` only once nothing can fail.)
                    self.chunking = None;
                    if let Some(id) = id {
                        self.seqs.remove(&id);
                        out.failed.push((id, ModelError::Invalid(e.to_string())));
                    }
                }
            }
            return;
        }
        let group = self.next_prefill_group();
        if group.is_empty() {
            return;
        }
        out.batch += group.len();
        match self.prefill(&group) {
            Ok(rows) => self.finish_rows(rows, out),
            Err(e) => {
                for id in group {
                    self.running.retain(|r| *r != id);
                    self.seqs.remove(&id);
                    out.failed.push((id, ModelError::Invalid(e.to_string())));
                }
            }
        }
    }

    fn remove(&mut self, id: RequestId) {
        if self.chunking.as_ref().is_some_and(|c| c.id == id) {
            self.chunking = None;
        }
        self.seqs.remove(&id);
        self.waiting.retain(|w| *w != id);
        self.leave(id);
    }

    fn has_ready_work(&self) -> bool {
        !self.seqs.is_empty() || !self.lost.is_empty()
    }

    fn start(&mut self) {
        // The constructor checked the part is there.
        if let (Some(g), Ok(thinker)) = (&mut self.graphs, self.model.thinker()) {
            let t = std::time::Instant::now();
            let n = thinker.warm_up_graphs(g, &self.slots);
            tracing::info!("Thinker: {n} decode graphs captured in {:?}", t.elapsed());
        }
    }

    fn active(&self) -> usize {
        self.seqs.len()
    }
}
