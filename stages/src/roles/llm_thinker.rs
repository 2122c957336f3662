//! Thinker stage for a llama-architecture GGUF chat model (SmolLM2).
//!
//! Continuous batching: every step takes up to `max_num_seqs` requests
//! (round-robin when more are waiting), each contributing a prompt chunk
//! (prefill) or its last token (decode), and runs them as one ragged batch.
//!
//! Prefix caching: the KV of recent prompts is kept (LRU, at most
//! `prefix_cache_entries` prompts and `prefix_cache_mib` of KV);
//! a new prompt that shares a prefix with one of them (the system prompt, or
//! the history of a conversation) starts from a copy and prefills only the rest.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use candle_transformers::generation::{LogitsProcessor, Sampling};

use super::invalid_call;
use crate::engine::constrain::CallConstraint;
use crate::engine::tools::AnswerWords;
use crate::engine::{
    Payload, RequestCtx, RequestId, RequestInput, StageModel, StepOutput, TextChunk,
};
use crate::models::quantized_llama::{KvCache, QuantizedLlama, SeqStep};
use crate::models::tokenizer::{ChatTokenizer, IncrementalDecoder};
use crate::models::{ModelError, Result};
use crate::profile::SamplingParams;

/// Tokens the repetition penalty looks back over.
const REPEAT_LAST_N: usize = 64;
const DEFAULT_MAX_TOKENS: usize = 256;
/// Shortest shared prefix worth reusing from the prefix cache.
const MIN_PREFIX_TOKENS: usize = 4;

/// A prompt whose KV is kept for later prompts that start the same way.
struct PrefixEntry {
    tokens: Vec<u32>,
    cache: KvCache,
    last_used: u64,
}

struct Seq {
    ctx: Arc<RequestCtx>,
    prompt: Vec<u32>,
    prefilled: usize,
    cache: KvCache,
    sampler: LogitsProcessor,
    repetition_penalty: f32,
    generated: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    detok: IncrementalDecoder,
    /// Words and tool calls of the answer.
    words: AnswerWords,
    /// A forced tool call's grammar: the tokens it allows.
    constraint: Option<CallConstraint>,
}

pub struct LlmThinker {
    model: Arc<QuantizedLlama>,
    tokenizer: Arc<ChatTokenizer>,
    defaults: SamplingParams,
    max_num_seqs: usize,
    max_prefill_tokens: usize,
    seqs: HashMap<RequestId, Seq>,
    order: VecDeque<RequestId>,
    prefixes: Vec<PrefixEntry>,
    prefix_capacity: usize,
    /// Most bytes of KV the prefix cache holds, and what it holds now.
    prefix_max_bytes: usize,
    prefix_bytes: usize,
    clock: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl LlmThinker {
    pub fn new(
        model: Arc<QuantizedLlama>,
        tokenizer: Arc<ChatTokenizer>,
        defaults: SamplingParams,
        max_num_seqs: usize,
        max_prefill_tokens: usize,
        prefix_cache_entries: usize,
        prefix_cache_bytes: usize,
    ) -> Self {
        Self {
            model,
            tokenizer,
            defaults,
            max_num_seqs,
            max_prefill_tokens,
            seqs: HashMap::new(),
            order: VecDeque::new(),
            prefixes: Vec::new(),
            prefix_capacity: prefix_cache_entries,
            prefix_max_bytes: prefix_cache_bytes,
            prefix_bytes: 0,
            clock: 0,
        }
    }

    /// A cache holding the longest cached prefix of `prompt` (at least one
    /// prompt token is left to prefill: its logits start the answer).
    fn cached_prefix(&mut self, prompt: &[u32]) -> Result<(KvCache, usize)> {
        self.clock += 1;
        let best = self
            .prefixes
            .iter_mut()
            .map(|e| {
                let n = common_prefix(&e.tokens, prompt).min(prompt.len() - 1);
                (n, e)
            })
            .filter(|(n, _)| *n >= MIN_PREFIX_TOKENS)
            .max_by_key(|(n, _)| *n);
        match best {
            Some((n, e)) => {
                e.last_used = self.clock;
                let mut cache = e.cache.try_clone()?;
                cache.truncate(n);
                Ok((cache, n))
            }
            None => Ok((self.model.new_cache(), 0)),
        }
    }

    /// Keeps the KV of a fully prefilled prompt for later prompts, within the
    /// cache's entry and byte bounds (least recently used entries go first; a
    /// prompt larger than the whole bound is not kept).
    fn remember_prefix(&mut self, prompt: &[u32], cache: &KvCache) {
        if self.prefix_capacity == 0 || prompt.len() < MIN_PREFIX_TOKENS {
            return;
        }
        self.clock += 1;
        // An entry that is a prefix of this prompt is superseded by it.
        let mut freed = 0;
        self.prefixes.retain(|e| {
            let keep = common_prefix(&e.tokens, prompt) < e.tokens.len();
            if !keep {
                freed += e.cache.bytes();
            }
            keep
        });
        self.prefix_bytes -= freed;
        if self
            .prefixes
            .iter()
            .any(|e| common_prefix(&e.tokens, prompt) == prompt.len())
        {
            return; // already covered by a longer entry
        }
        let Ok(cache) = cache.try_clone_compact() else {
            return;
        };
        let bytes = cache.bytes();
        if bytes > self.prefix_max_bytes {
            return;
        }
        while self.prefixes.len() >= self.prefix_capacity
            || self.prefix_bytes + bytes > self.prefix_max_bytes
        {
            let Some(lru) = self
                .prefixes
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.last_used)
                .map(|(i, _)| i)
            else {
                break;
            };
            self.prefix_bytes -= self.prefixes.swap_remove(lru).cache.bytes();
        }
        self.prefix_bytes += bytes;
        self.prefixes.push(PrefixEntry {
            tokens: prompt.to_vec(),
            cache,
            last_used: self.clock,
        });
    }

    fn sampler_for(&self, ctx: &RequestCtx) -> (LogitsProcessor, f32) {
        let o = &ctx.spec.sampling;
        let d = &self.defaults;
        let temperature = o.temperature.or(d.temperature).unwrap_or(0.0);
        let top_p = o.top_p.or(d.top_p).filter(|p| *p < 1.0);
        let top_k = o.top_k.or(d.top_k).filter(|k| *k > 0);
        let seed = o.seed.or(d.seed).unwrap_or(ctx.id);
        let sampling = if temperature <= 1e-7 {
            Sampling::ArgMax
        } else {
            match (top_k, top_p) {
                (None, None) => Sampling::All { temperature },
                (Some(k), None) => Sampling::TopK { k, temperature },
                (None, Some(p)) => Sampling::TopP { p, temperature },
                (Some(k), Some(p)) => Sampling::TopKThenTopP { k, p, temperature },
            }
        };
        (
            LogitsProcessor::from_sampling(seed, sampling),
            d.repetition_penalty.unwrap_or(1.0),
        )
    }

    /// Samples the next token of `seq` from its logits row; returns whether it ended.
    fn advance(
        &self,
        id: RequestId,
        seq: &mut Seq,
        logits: candle_core::Tensor,
        out: &mut StepOutput,
    ) -> Result<bool> {
        let logits = if seq.repetition_penalty != 1.0 && !seq.generated.is_empty() {
            let start = seq.generated.len().saturating_sub(REPEAT_LAST_N);
            candle_transformers::utils::apply_repeat_penalty(
                &logits,
                seq.repetition_penalty,
                &seq.generated[start..],
            )?
        } else {
            logits
        };
        let logits = match &mut seq.constraint {
            Some(c) => {
                let mut row = logits
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                c.mask(&mut row).map_err(invalid_call)?;
                let n = row.len();
                candle_core::Tensor::from_vec(row, n, logits.device())?
            }
            None => logits,
        };
        let token = seq.sampler.sample(&logits)?;
        if let Some(c) = &mut seq.constraint {
            c.commit(token).map_err(invalid_call)?;
        }
        let eos = self.tokenizer.eos_token_ids().contains(&token);
        if eos && !seq.ignore_eos {
            return Ok(true);
        }
        seq.generated.push(token);
        seq.ctx.add_completion_tokens(1);
        if let Some(text) = seq.detok.push(&self.tokenizer, token)? {
            let (words, _) = seq.words.push(&seq.ctx, text).map_err(invalid_call)?;
            if !words.is_empty() {
                out.downstream.push((
                    id,
                    Payload::Text(TextChunk::text(words, vec![token], false)),
                ));
            }
        }
        let ctx_full = seq.cache.len() + 1 >= self.model.config().max_seq_len;
        let call_done = seq.constraint.as_mut().is_some_and(CallConstraint::done);
        Ok(seq.generated.len() >= seq.max_tokens || ctx_full || seq.words.ended() || call_done)
    }

    fn finish(&self, id: RequestId, seq: &mut Seq, out: &mut StepOutput) -> Result<()> {
        let tail = seq.detok.flush(&self.tokenizer)?.unwrap_or_default();
        let (mut tail, _) = seq.words.push(&seq.ctx, tail).map_err(invalid_call)?;
        tail.push_str(&seq.words.finish(&seq.ctx).map_err(invalid_call)?);
        out.downstream
            .push((id, Payload::Text(TextChunk::text(tail, Vec::new(), true))));
        out.finished.push(id);
        Ok(())
    }
}

impl StageModel for LlmThinker {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        let RequestInput::Chat { messages } = &ctx.spec.input else {
            return Err(ModelError::Invalid(
                "the Thinker takes a conversation".into(),
            ));
        };
        let tools = ctx.spec.tools.as_deref();
        let prompt_text = self.tokenizer.chat_prompt(messages, tools)?;
        let prompt = self.tokenizer.encode(&prompt_text)?;
        let max_ctx = self.model.config().max_seq_len;
        if prompt.is_empty() {
            return Err(ModelError::Invalid("empty prompt".into()));
        }
        if prompt.len() >= max_ctx {
            return Err(ModelError::ContextLength {
                prompt: prompt.len(),
                context: max_ctx,
            });
        }
        ctx.set_prompt_tokens(prompt.len());
        let (cache, cached) = self.cached_prefix(&prompt)?;
        ctx.set_cached_tokens(cached);
        let (sampler, repetition_penalty) = self.sampler_for(&ctx);
        let max_tokens = ctx
            .spec
            .sampling
            .max_tokens
            .or(self.defaults.max_tokens)
            .unwrap_or(DEFAULT_MAX_TOKENS)
            .max(1);
        let seq = Seq {
            prompt,
            prefilled: cached,
            cache,
            sampler,
            repetition_penalty,
            generated: Vec::new(),
            max_tokens,
            ignore_eos: ctx.spec.sampling.ignore_eos,
            detok: IncrementalDecoder::new(),
            words: AnswerWords::new(ctx.spec.tools.as_deref()),
            constraint: self.tokenizer.call_constraint(ctx.spec.tools.as_deref()),
            ctx,
        };
        let id = seq.ctx.id;
        self.seqs.insert(id, seq);
        self.order.push_back(id);
        Ok(())
    }

    fn push(&mut self, _id: RequestId, _payload: Payload) -> Result<()> {
        Err(ModelError::Invalid(
            "the Thinker takes its input with the request".into(),
        ))
    }

    fn step(&mut self, out: &mut StepOutput) {
        let n = self.order.len().min(self.max_num_seqs);
        if n == 0 {
            return;
        }
        // Round-robin: this step's requests go to the back of the line.
        let ids: Vec<RequestId> = self.order.drain(..n).collect();
        self.order.extend(ids.iter().copied());

        // Take the sequences out of the map so each can lend its cache mutably.
        let mut batch_seqs: Vec<(RequestId, Seq)> = ids
            .iter()
            .filter_map(|id| self.seqs.remove(id).map(|s| (*id, s)))
            .collect();
        let inputs: Vec<Vec<u32>> = batch_seqs
            .iter()
            .map(|(_, s)| {
                if s.prefilled < s.prompt.len() {
                    let end = (s.prefilled + self.max_prefill_tokens).min(s.prompt.len());
                    s.prompt[s.prefilled..end].to_vec()
                } else {
                    // Decode: the last sampled token (prefill ended with the prompt's).
                    vec![*s.generated.last().unwrap_or(&s.prompt[s.prompt.len() - 1])]
                }
            })
            .collect();
        let result = {
            let mut steps: Vec<SeqStep<'_>> = batch_seqs
                .iter_mut()
                .zip(&inputs)
                .map(|((_, s), toks)| SeqStep {
                    tokens: toks,
                    cache: &mut s.cache,
                })
                .collect();
            self.model.forward_batch(&mut steps)
        };
        out.batch = batch_seqs.len();
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                // The whole batch failed: fail each request, free everything.
                let msg = e.to_string();
                for (id, _) in batch_seqs {
                    self.order.retain(|x| *x != id);
                    out.failed.push((id, ModelError::Invalid(msg.clone())));
                }
                return;
            }
        };
        for (row, ((id, mut seq), toks)) in batch_seqs.into_iter().zip(&inputs).enumerate() {
            let prefill = seq.prefilled < seq.prompt.len();
            if prefill {
                seq.prefilled += toks.len();
                if seq.prefilled < seq.prompt.len() {
                    self.seqs.insert(id, seq);
                    continue; // more prompt to go: these logits are not needed
                }
                self.remember_prefix(&seq.prompt, &seq.cache);
            }
            let r = logits
                .get(row)
                .map_err(ModelError::from)
                .and_then(|l| self.advance(id, &mut seq, l, out));
            match r {
                Ok(false) => {
                    self.seqs.insert(id, seq);
                }
                Ok(true) => {
                    self.order.retain(|x| *x != id);
                    if let Err(e) = self.finish(id, &mut seq, out) {
                        out.failed.push((id, e));
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
        self.seqs.remove(&id);
        self.order.retain(|x| *x != id);
    }

    fn has_ready_work(&self) -> bool {
        !self.order.is_empty()
    }

    fn active(&self) -> usize {
        self.seqs.len()
    }

    fn cache_bytes(&self) -> usize {
        self.prefix_bytes
    }
}
