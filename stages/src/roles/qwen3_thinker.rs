//! Thinker stage for Qwen3-Omni: chat text or speech in (the audio encoder hears
//! a spoken turn itself), text out, and for requests that want audio the
//! Thinker's states for the Talker: the prompt's embeddings and
//! `accept_hidden_layer` states once, then each generated token's embedding as
//! it is fed back.
//!
//! Requests are stepped one after another within a step (each with its own KV
//! cache); batching them into one forward is the GPU engine's job.

use std::sync::Arc;

use candle_core::Tensor;

use super::Requests;
use crate::engine::{
    Event, Payload, PromptStates, RequestCtx, RequestId, RequestInput, StageModel, StepOutput,
    TextChunk, ThinkerStates,
};
use crate::models::qwen3_omni::omni::Qwen3Omni;
use crate::models::qwen3_omni::sampling::{Sampler, SamplingConfig};
use crate::models::qwen3_omni::thinker::{AudioEmbeds, ThinkerCache};
use crate::models::tokenizer::{ChatMessage, ChatTokenizer, IncrementalDecoder};
use crate::models::{ModelError, Result};
use crate::profile::SamplingParams;

const DEFAULT_MAX_TOKENS: usize = 256;
/// How a spoken turn appears in the chat template (the processor's placeholder,
/// expanded to one `<|audio_pad|>` per audio-encoder output).
const AUDIO_PLACEHOLDER: &str = "<|audio_start|><|audio_pad|><|audio_end|>";

struct Seq {
    ctx: Arc<RequestCtx>,
    prompt: Vec<u32>,
    /// A spoken turn's 16 kHz PCM, heard at prefill.
    audio: Option<Arc<[f32]>>,
    cache: Option<ThinkerCache>,
    sampler: Sampler,
    generated: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    detok: IncrementalDecoder,
    /// The request goes on to the Talker: produce its states.
    speak: bool,
}

pub struct Qwen3OmniThinker {
    model: Arc<Qwen3Omni>,
    tokenizer: Arc<ChatTokenizer>,
    defaults: SamplingParams,
    max_num_seqs: usize,
    seqs: Requests<Seq>,
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

impl Qwen3OmniThinker {
    pub fn new(
        model: Arc<Qwen3Omni>,
        tokenizer: Arc<ChatTokenizer>,
        defaults: SamplingParams,
        max_num_seqs: usize,
    ) -> Result<Self> {
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
        Ok(Self {
            model,
            tokenizer,
            defaults,
            max_num_seqs,
            seqs: Requests::default(),
        })
    }

    fn prompt(&self, messages: &[ChatMessage], audio: Option<&[f32]>) -> Result<Vec<u32>> {
        let Some(pcm) = audio else {
            let text = self.tokenizer.apply_chat_template(messages, true)?;
            return self.tokenizer.encode(&text);
        };
        let mut all = messages.to_vec();
        all.push(ChatMessage::new("user", AUDIO_PLACEHOLDER));
        let text = self.tokenizer.apply_chat_template(&all, true)?;
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

    /// Runs one step of `seq`: its prefill, or its last token fed back. Returns the
    /// logits of the next token and what the Talker gets of this step.
    fn forward(&self, seq: &mut Seq) -> Result<(Tensor, ThinkerStates)> {
        let thinker = self.model.thinker();
        let dev = thinker.device().clone();
        let accept = self.model.config().talker.accept_hidden_layer;
        match &mut seq.cache {
            None => {
                let heard = match &seq.audio {
                    Some(pcm) => Some(self.model.hear(pcm)?),
                    None => None,
                };
                let lens;
                let audio = match &heard {
                    Some((embeds, frames)) => {
                        lens = [*frames];
                        Some(AudioEmbeds {
                            embeds,
                            feature_lengths: &lens,
                        })
                    }
                    None => None,
                };
                let l = seq.prompt.len();
                let ids = Tensor::from_vec(seq.prompt.clone(), (1, l), &dev)?;
                let mut cache = thinker.new_cache();
                let hidden: &[usize] = if seq.speak { &[0, accept] } else { &[] };
                let out = thinker.prefill(&ids, None, audio, &mut cache, hidden)?;
                seq.cache = Some(cache);
                let states = if seq.speak {
                    ThinkerStates {
                        prompt: Some(Arc::new(PromptStates {
                            ids: seq.prompt.clone(),
                            embeds: out.hidden_states[0].squeeze(0)?,
                            hidden: out.hidden_states[1].squeeze(0)?,
                        })),
                        embeds: None,
                    }
                } else {
                    ThinkerStates::default()
                };
                Ok((out.logits.get(0)?.get(l - 1)?, states))
            }
            Some(cache) => {
                let last = *seq
                    .generated
                    .last()
                    .ok_or_else(|| ModelError::Invalid("decode before any token".into()))?;
                let ids = Tensor::from_vec(vec![last], (1, 1), &dev)?;
                let hidden: &[usize] = if seq.speak { &[0] } else { &[] };
                let out = thinker.step(&ids, cache, hidden)?;
                let states = ThinkerStates {
                    prompt: None,
                    embeds: if seq.speak {
                        Some(out.hidden_states[0].squeeze(0)?)
                    } else {
                        None
                    },
                };
                Ok((out.logits.get(0)?.get(0)?, states))
            }
        }
    }

    /// One step of `seq`; returns whether it finished.
    fn advance(&self, id: RequestId, seq: &mut Seq, out: &mut StepOutput) -> Result<bool> {
        let (logits, states) = self.forward(seq)?;
        let token = seq.sampler.sample_tensor(&logits)?;
        let states = seq.speak.then_some(states);
        let eos = self.tokenizer.is_eos(token) && !seq.ignore_eos;
        let at_limit = seq.generated.len() + 1 >= seq.max_tokens;
        let max_ctx = self
            .model
            .config()
            .thinker
            .text_config
            .max_position_embeddings;
        let ctx_full = seq.prompt.len() + seq.generated.len() + 1 >= max_ctx;
        let mut text = String::new();
        if !eos {
            seq.generated.push(token);
            seq.ctx.add_completion_tokens(1);
            if let Some(t) = seq.detok.push(&self.tokenizer, token)? {
                text = t;
            }
        }
        let finished = eos || at_limit || ctx_full;
        if finished {
            if let Some(t) = seq.detok.flush(&self.tokenizer)? {
                text.push_str(&t);
            }
        }
        if !text.is_empty() {
            seq.ctx.emit(Event::TextDelta(text.clone()));
        }
        // (The worker drops it for text-only requests, whose route ends here.)
        out.downstream.push((
            id,
            Payload::Text(TextChunk {
                text,
                token_ids: if eos { Vec::new() } else { vec![token] },
                finished,
                states,
            }),
        ));
        Ok(finished)
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
        let prompt = self.prompt(messages, audio.as_deref())?;
        let max_ctx = self
            .model
            .config()
            .thinker
            .text_config
            .max_position_embeddings;
        if prompt.is_empty() || prompt.len() >= max_ctx {
            return Err(ModelError::Invalid(format!(
                "prompt is {} tokens; the model's context is {max_ctx}",
                prompt.len()
            )));
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
            speak: ctx.spec.modalities.audio,
            prompt,
            audio,
            cache: None,
            generated: Vec::new(),
            max_tokens,
            ignore_eos: o.ignore_eos,
            detok: IncrementalDecoder::new(),
            ctx,
        };
        self.seqs.insert(seq.ctx.id, seq);
        Ok(())
    }

    fn push(&mut self, _id: RequestId, _payload: Payload) -> Result<()> {
        Err(ModelError::Invalid(
            "the Thinker takes its input with the request".into(),
        ))
    }

    fn step(&mut self, out: &mut StepOutput) {
        let mut seqs = std::mem::take(&mut self.seqs);
        seqs.step(
            self.max_num_seqs,
            out,
            |_| true,
            |id, seq, out| self.advance(id, seq, out),
        );
        self.seqs = seqs;
    }

    fn remove(&mut self, id: RequestId) {
        self.seqs.remove(id);
    }

    fn has_ready_work(&self) -> bool {
        self.seqs.len() > 0
    }

    fn active(&self) -> usize {
        self.seqs.len()
    }
}
