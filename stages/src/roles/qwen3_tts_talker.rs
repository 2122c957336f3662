//! Talker stage for Qwen3-TTS: text in, one codec frame (16 codes, 80 ms) per
//! step out, to the Code2Wav stage.
//!
//! Text arrives as text chunks: all at once (`/v1/audio/speech`), or as a
//! Thinker writes it (a cascade). A request whose text is complete before it
//! starts gets qwen-tts's default prompt, the whole text in it
//! (`non_streaming_mode`); one whose text is still coming starts as soon as its
//! first token is settled, with the rest fed one token a frame (the reference's
//! streaming-text layout), a frame whose token has not arrived waiting for it.
//! The text is tokenized as the reference tokenizes the whole string; a token
//! counts as settled once its word has ended (a space, or sentence punctuation
//! after letters), as the rest of a word can change its tokens. Only the text
//! after the last such cut is re-tokenized as it grows (`TextTokens`).
//!
//! Requests run batched on KV slots, as Qwen3-Omni's Talker does (the same
//! frame loop, code predictor and CUDA graphs).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::qwen3_talker::{end_of_speech, left_padded};
use super::qwen3_thinker::sampling_config;
use crate::engine::{
    FrameChunk, Payload, RequestCtx, RequestId, RequestInput, StageModel, StepOutput,
    VoiceReference,
};
use crate::models::qwen3_omni::graphs;
use crate::models::qwen3_omni::layers::KvSlots;
use crate::models::qwen3_omni::sampling::{samples_on_device, Sampler, SamplingConfig};
use crate::models::qwen3_omni::talker::{SlotRows, TalkerGraphs};
use crate::models::qwen3_tts::config::ModelType;
use crate::models::qwen3_tts::model::Qwen3Tts;
use crate::models::qwen3_tts::talker::{
    assistant_text, instruct_text, ref_text, PromptError, RefClip, Voice, CLOSE, ROLE,
};
use crate::models::tokenizer::ChatTokenizer;
use crate::models::{ModelError, Result};
use crate::profile::SamplingParams;

/// Frames a request may speak when the profile sets no `max_tokens` (qwen-tts's
/// generation_config: 8192 code-0 tokens, 11 minutes).
const DEFAULT_MAX_FRAMES: usize = 8192;
/// The reference's `min_new_tokens`: no end code in the first frames.
const MIN_FRAMES: usize = 2;

/// A VoiceDesign checkpoint's voice: the one the instructions describe.
pub const DESCRIBED: &str = "described";

/// The text tokens of `text` as the reference tokenizes it (inside its chat
/// wrapping), and the role tokens before them.
fn tokens(tokenizer: &ChatTokenizer, text: &str) -> Result<(Vec<u32>, Vec<u32>)> {
    let ids = tokenizer.encode(&assistant_text(text))?;
    if ids.len() < ROLE + CLOSE {
        return Err(ModelError::Invalid(
            "the tokenizer dropped the chat tokens".into(),
        ));
    }
    let text = ids[ROLE..ids.len() - CLOSE].to_vec();
    Ok((ids[..ROLE].to_vec(), text))
}

/// The tokens of a text that arrives in pieces, equal to [`tokens`] of the
/// text so far at every push, with each byte tokenized about once:
/// re-tokenizing the whole text at each piece is quadratic in its length.
///
/// The tokens of `text[..base]` are final: `base` is a pre-token boundary that
/// no later text moves, so the tokens of the text are those of `text[..base]`
/// followed by those of `text[base..]` alone (BPE merges stay within pre-tokens).
#[derive(Default)]
struct TextTokens {
    /// Bytes of the text whose tokens are final; 0 or a cut (see [`last_cut`]).
    base: usize,
    /// The text's length at the last push: no cut lies before it.
    seen: usize,
    /// The role tokens before the text.
    role: Vec<u32>,
    /// The tokens of `text[..base]` (`ids[..fixed]`), then those of the rest.
    ids: Vec<u32>,
    fixed: usize,
}

impl TextTokens {
    /// Tokenizes `text` (the text so far: the last push's text and more) and
    /// returns how many of [`Self::ids`] are settled: all of them once `done`,
    /// else those before the last cut (`ids[..fixed]`). Not "all but the
    /// last": a piece that ends inside a word can end in two tokens that the
    /// rest of the word changes (" n" is " ", "n"; " naïve" starts " na").
    fn push(&mut self, tokenizer: &ChatTokenizer, text: &str, done: bool) -> Result<usize> {
        // A whole text (or the end of one) needs no cut: its rest is
        // tokenized once.
        if !done {
            if let Some(cut) = last_cut(text, self.seen.max(self.base + 1)) {
                let ids = self.encode(tokenizer, &text[self.base..cut])?;
                self.ids.truncate(self.fixed);
                self.ids.extend(ids);
                self.fixed = self.ids.len();
                self.base = cut;
            }
        }
        self.seen = text.len();
        let rest = self.encode(tokenizer, &text[self.base..])?;
        self.ids.truncate(self.fixed);
        self.ids.extend(rest);
        Ok(match done {
            true => self.ids.len(),
            false => self.fixed,
        })
    }

    /// The tokens of `part`, text from `self.base` on: at the text's start in
    /// its chat wrapping, as the reference tokenizes it (it follows
    /// "assistant\n" there); from a cut (a space) on alone.
    fn encode(&mut self, tokenizer: &ChatTokenizer, part: &str) -> Result<Vec<u32>> {
        if self.base == 0 {
            let (role, ids) = tokens(tokenizer, part)?;
            self.role = role;
            return Ok(ids);
        }
        let enc = tokenizer
            .inner()
            .encode(part, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }
}

/// Draws `r`'s next code 0 if it has none; returns whether its speech ended.
fn draw_code0(eos: usize, r: &mut Req) -> Result<bool> {
    if r.code0.is_some() {
        return Ok(false);
    }
    let mut logits = r
        .logits
        .take()
        .ok_or_else(|| ModelError::Invalid("talker: no logits".into()))?;
    if let Some(n) = r.fixed_frames {
        if r.frames >= n {
            return Ok(true);
        }
    }
    if r.frames < MIN_FRAMES || r.fixed_frames.is_some() {
        if let Some(l) = logits.get_mut(eos) {
            *l = f32::NEG_INFINITY;
        }
    }
    let c = r.sampler.sample(&logits)?;
    // As max_new_tokens: the budget's last code 0 is not spoken.
    if c as usize == eos || r.frames + 1 >= r.max_frames {
        return Ok(true);
    }
    r.code0 = Some(c);
    Ok(false)
}

/// The last position `p >= from` in `text` where a space follows a character
/// that is not whitespace, or sentence punctuation ([`CUT_PUNCT`]) follows a
/// letter (text without spaces, as Chinese and Japanese are, has cuts there):
/// a boundary between Qwen2's pre-tokens whatever text follows. No alternative of its split regex
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
/// matches a non-space followed by a space (a space comes only first or in an
/// all-whitespace run), so the match before `p` ends at `p` having looked at
/// nothing past it, and the next starts there (no lookbehind). NFC keeps the
/// boundary (a space is a starter that composes with nothing), and Qwen's
/// added tokens hold no space. Control characters are left out too, in case the
/// regex's `\s` counts one that Rust does not. Likewise a run of letters ends
/// where punctuation starts, and the punctuation starts the next match (the
/// letters' optional prefix, or a run of its own); these marks are never part
/// of an added token (`<|im_end|>`: the cut must not split one).
fn last_cut(text: &str, from: usize) -> Option<usize> {
    let mut next = None;
    for (i, c) in text.char_indices().rev() {
        let p = i + c.len_utf8();
        if p < from {
            return None;
        }
        let after_word = next == Some(' ') && !c.is_whitespace() && !c.is_control();
        let ends_letters = c.is_alphabetic() && next.is_some_and(|n| CUT_PUNCT.contains(&n));
        if after_word || ends_letters {
            return Some(p);
        }
        next = Some(c);
    }
    None
}

/// Punctuation that ends a run of letters at a cut ([`last_cut`]).
const CUT_PUNCT: &[char] = &[
    ',', '.', '!', '?', ';', ':', '，', '。', '！', '？', '；', '：', '、',
];

impl From<PromptError> for ModelError {
    fn from(e: PromptError) -> Self {
        match e {
            PromptError::Model(e) => ModelError::Candle(e),
            e => ModelError::Invalid(e.to_string()),
        }
    }
}

struct Req {
    voice: Voice,
    instruct_ids: Option<Vec<u32>>,
    language: String,
    text: String,
    /// The tokens of `text`, kept up to date as it grows.
    tokens: TextTokens,
    upstream_done: bool,
    /// The prompt `(1, s, hidden)` once its first text token is settled.
    prompt: Option<Tensor>,
    /// Streaming text: the projected vectors of text tokens 1.. settled so far,
    /// one a frame. `None`: the whole text is in the prompt.
    fed: Option<Vec<Tensor>>,
    /// Text tokens taken so far (prompt and `fed`).
    taken: usize,
    /// Once prefilled: cached positions, next rotary position, last hidden state.
    decode: Option<(usize, u32, Tensor)>,
    /// The next frame's code-0 logits.
    logits: Option<Vec<f32>>,
    /// Drawn but not yet spoken (its text vector has not arrived).
    code0: Option<u32>,
    frames: usize,
    sampler: Sampler,
    cp_sampler: Sampler,
    max_frames: usize,
    /// Benchmarks: this many frames, ignoring the end code.
    fixed_frames: Option<usize>,
}

/// The text vector a frame adds.
enum Text {
    Fed(Tensor),
    Eos,
    Pad,
    Wait,
}

pub struct Qwen3TtsTalker {
    model: Arc<Qwen3Tts>,
    tokenizer: Arc<ChatTokenizer>,
    defaults: SamplingParams,
    cp_defaults: SamplingConfig,
    default_voice: Option<String>,
    max_num_seqs: usize,
    /// Positions per request's KV slot (prompt included).
    max_len: usize,
    reqs: HashMap<RequestId, Req>,
    /// Prefilled requests: request `i` lives in KV slot `i`.
    running: Vec<RequestId>,
    slots: Vec<KvSlots>,
    /// Requests dropped from the batch by a failed slot copy, to fail next step.
    lost: Vec<RequestId>,
    graphs: Option<TalkerGraphs>,
}

impl Qwen3TtsTalker {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        model: Arc<Qwen3Tts>,
        tokenizer: Arc<ChatTokenizer>,
        defaults: SamplingParams,
        code_predictor: Option<SamplingParams>,
        default_voice: Option<String>,
        max_num_seqs: usize,
        max_len: usize,
        cuda_graphs: bool,
    ) -> Result<Self> {
        let cfg = model.config();
        let described = |v: &str| {
            cfg.tts_model_type == ModelType::VoiceDesign && v.eq_ignore_ascii_case(DESCRIBED)
        };
        if let Some(v) = default_voice.as_deref().filter(|v| !described(v)) {
            if !cfg.talker_config.spk_id.contains_key(&v.to_lowercase()) {
                return Err(ModelError::Invalid(format!(
                    "unknown voice {v:?}; the model has {:?}",
                    cfg.speakers()
                )));
            }
        }
        for (token, want) in [
            ("<|tts_pad|>", cfg.tts_pad_token_id),
            ("<|im_start|>", cfg.im_start_token_id),
        ] {
            if tokenizer.token_to_id(token) != Some(want) {
                return Err(ModelError::Invalid(format!(
                    "the tokenizer's {token} is not the model's id {want}: wrong tokenizer for this checkpoint"
                )));
            }
        }
        // qwen-tts's generation_config: the code predictor samples like the Talker.
        let cp_defaults = match &code_predictor {
            Some(p) => sampling_config(p, None, 0),
            None => {
                let sample = defaults.temperature.unwrap_or(0.9) > 1e-7;
                SamplingConfig {
                    do_sample: sample,
                    temperature: 0.9,
                    top_k: 50,
                    ..SamplingConfig::greedy()
                }
            }
        };
        let talker = model.talker().talker();
        let max_len = max_len
            .min(talker.config().text_config.max_position_embeddings)
            .max(2);
        let graphs = (cuda_graphs && graphs::available(model.device()))
            .then(|| TalkerGraphs::new(max_num_seqs));
        let scratch = match graphs {
            Some(_) => TalkerGraphs::scratch_slots(max_num_seqs),
            None => 0,
        };
        let slots = talker.new_slots(max_num_seqs + scratch, max_len)?;
        Ok(Self {
            model,
            tokenizer,
            defaults,
            cp_defaults,
            default_voice,
            max_num_seqs,
            max_len,
            reqs: HashMap::new(),
            running: Vec::new(),
            slots,
            lost: Vec::new(),
            graphs,
        })
    }

    /// The voices a request may name: the checkpoint's preset speakers, or a
    /// VoiceDesign checkpoint's one voice, [`DESCRIBED`] (the one its
    /// `instructions` describe).
    pub fn voice_names(model: &Qwen3Tts) -> Vec<String> {
        let cfg = model.config();
        match (cfg.tts_model_type, cfg.speakers()) {
            (ModelType::VoiceDesign, s) if s.is_empty() => vec![DESCRIBED.to_string()],
            (_, s) => s,
        }
    }

    /// An in-context voice: the x-vector, the clip's codes and its transcript.
    fn ref_clip(&self, xvector: Tensor, r: &VoiceReference) -> Result<RefClip> {
        let groups = self.model.config().talker_config.num_code_groups;
        if r.codes.is_empty() || r.codes.iter().any(|f| f.len() != groups) {
            return Err(ModelError::Invalid(format!(
                "a voice reference's codes must be frames of {groups} codes"
            )));
        }
        let flat: Vec<u32> = r.codes.iter().flatten().copied().collect();
        let codes = Tensor::from_vec(flat, (r.codes.len(), groups), self.model.device())?;
        Ok(RefClip {
            xvector,
            codes,
            ref_ids: self.tokenizer.encode(&ref_text(&r.text))?,
        })
    }

    /// Text tokens a streamed prompt takes before its first frame: one, or
    /// with an in-context voice as many as fill the clip's codec side (its
    /// frames and `codec_bos`) after the transcript, as `generate_icl_prompt`
    /// lays out a streamed prompt.
    fn streamed_prompt_tokens(voice: &Voice) -> Result<usize> {
        let Voice::InContext(clip) = voice else {
            return Ok(1);
        };
        // At least one: a transcript longer than the clip's codec side leaves
        // its own tail trailing, before the text.
        Ok(clip
            .codec_positions()?
            .saturating_sub(clip.transcript_len())
            .max(1))
    }

    /// Builds the prompt once enough tokens are settled, and feeds settled tokens.
    fn advance(&self, r: &mut Req) -> Result<()> {
        if r.prompt.is_some() && r.fed.is_none() {
            return Ok(());
        }
        let settled = r.tokens.push(&self.tokenizer, &r.text, r.upstream_done)?;
        let (role, text) = (&r.tokens.role, &r.tokens.ids);
        let tts = self.model.talker();
        if r.prompt.is_none() {
            let need = Self::streamed_prompt_tokens(&r.voice)?;
            let whole = r.upstream_done;
            if settled == 0 || (!whole && settled < need) {
                return Ok(());
            }
            let take = if whole { &text[..] } else { &text[..need] };
            // A whole text is all in the prompt, as qwen-tts's default for
            // preset and described voices; in context, its default is the
            // streamed layout (`generate_voice_clone`), for a whole text too.
            let in_context = match &r.voice {
                Voice::InContext(clip) => Some(clip),
                _ => None,
            };
            let non_streaming = whole && in_context.is_none();
            let p = tts.prompt_parts(
                role,
                take,
                r.instruct_ids.as_deref(),
                &r.voice,
                &r.language,
                non_streaming,
            )?;
            // In context, a text that ends within the clip's codec side has
            // its `tts_eos` in the prompt: pads follow.
            let eos_in_prompt = match in_context {
                Some(clip) if whole => {
                    clip.transcript_len() + take.len() < clip.codec_positions()?
                }
                _ => false,
            };
            r.prompt = Some(p.embeds);
            r.taken = take.len();
            r.fed = match non_streaming || eos_in_prompt {
                true => None,
                // The trailing text before its `tts_eos` (an in-context voice's
                // text past the codec side), then the text as it settles.
                false => {
                    let n = p.trailing.dim(1)?.saturating_sub(1);
                    Some(
                        (0..n)
                            .map(|i| p.trailing.narrow(1, i, 1))
                            .collect::<candle_core::Result<_>>()?,
                    )
                }
            };
        }
        if let Some(fed) = &mut r.fed {
            if settled > r.taken {
                let v = tts.text(&text[r.taken..settled])?;
                for i in 0..v.dim(1)? {
                    fed.push(v.narrow(1, i, 1)?);
                }
                r.taken = settled;
            }
        }
        Ok(())
    }

    fn is_ready(&self, r: &Req) -> bool {
        if r.decode.is_none() {
            return r.prompt.is_some() || r.upstream_done;
        }
        r.code0.is_none() || !matches!(self.text_for(r, r.frames), Text::Wait)
    }

    /// What frame `f` adds: the next settled text token, `tts_eos` right after the
    /// last, `tts_pad` after that (and always, with the whole text in the prompt).
    fn text_for(&self, r: &Req, f: usize) -> Text {
        let Some(fed) = &r.fed else {
            return Text::Pad;
        };
        if f < fed.len() {
            Text::Fed(fed[f].clone())
        } else if !r.upstream_done {
            Text::Wait
        } else if f == fed.len() {
            Text::Eos
        } else {
            Text::Pad
        }
    }

    fn text_vectors(&self, texts: Vec<Text>) -> Result<Tensor> {
        let tts = self.model.talker();
        let rows: Vec<Tensor> = texts
            .into_iter()
            .map(|t| -> Result<Tensor> {
                Ok(match t {
                    Text::Fed(v) => v.flatten_all()?,
                    Text::Eos => tts.tts_eos().clone(),
                    Text::Pad | Text::Wait => tts.tts_pad().clone(),
                })
            })
            .collect::<Result<_>>()?;
        Ok(Tensor::stack(&rows, 0)?.unsqueeze(1)?)
    }

    /// Prefills `batch` in one left-padded forward, each into the next free slot.
    fn prefill(&mut self, batch: &mut [(RequestId, Req)]) -> Result<()> {
        let talker = self.model.talker().talker();
        let mut inputs = Vec::with_capacity(batch.len());
        for (_, r) in batch.iter() {
            let Some(p) = &r.prompt else {
                return Err(ModelError::Invalid(
                    "talker: prefill before the prompt".into(),
                ));
            };
            inputs.push(p.clone());
        }
        let (x, mask) = left_padded(&inputs)?;
        let (state, o) = talker.prefill(&x, Some(&mask), None)?;
        let logits = o.logits.to_vec2::<f32>()?;
        for (row, ((id, r), logits)) in batch.iter_mut().zip(logits).enumerate() {
            let slot = self.running.len();
            let (len, pos, hidden) = talker.load_slot(&self.slots, slot, &state, row)?;
            r.decode = Some((len, pos, hidden));
            r.logits = Some(logits);
            r.max_frames = r.max_frames.min(self.max_len.saturating_sub(len));
            self.running.push(*id);
        }
        Ok(())
    }

    /// Draws the next code 0 of every running request that has none, in slot
    /// order; returns the requests whose speech ended. Past a few rows the draws
    /// run in parallel: each is a top-k and a softmax over the codec vocabulary on
    /// the host (~2 ms a step for 64 rows on one core), with the GPU idle.
    fn draw_codes0(
        &self,
        reqs: &mut HashMap<RequestId, Req>,
        out: &mut StepOutput,
    ) -> Result<Vec<RequestId>> {
        use rayon::prelude::*;
        const PARALLEL_FROM: usize = 8;
        let eos = self.model.talker().talker().config().codec_eos_token_id as usize;
        let running: HashSet<RequestId> = self.running.iter().copied().collect();
        let draw = |(id, r): (&RequestId, &mut Req)| (*id, draw_code0(eos, r));
        let mut drawn: HashMap<RequestId, Result<bool>> = if running.len() >= PARALLEL_FROM {
            reqs.par_iter_mut()
                .filter(|(id, _)| running.contains(id))
                .map(draw)
                .collect()
        } else {
            reqs.iter_mut()
                .filter(|(id, _)| running.contains(id))
                .map(draw)
                .collect()
        };
        let mut done = Vec::new();
        for id in &self.running {
            if drawn.remove(id).transpose()?.unwrap_or(false) {
                end_of_speech(out, *id);
                done.push(*id);
            }
        }
        Ok(done)
    }

    /// One frame for every running request whose text vector is there, batched.
    fn step_running(
        &self,
        reqs: &mut HashMap<RequestId, Req>,
        graphs: Option<&mut TalkerGraphs>,
        out: &mut StepOutput,
    ) -> Result<Vec<RequestId>> {
        let finished = self.draw_codes0(reqs, out)?;
        let mut ids = Vec::new();
        let (mut slots_of, mut lens, mut pos, mut code0, mut texts, mut hidden) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        for (slot, &id) in self.running.iter().enumerate() {
            let Some(r) = reqs.get_mut(&id) else {
                continue;
            };
            if finished.contains(&id) {
                continue;
            }
            let text = self.text_for(r, r.frames);
            if matches!(text, Text::Wait) {
                continue;
            }
            let (Some(c), Some((len, p, h))) = (r.code0, &r.decode) else {
                continue;
            };
            ids.push(id);
            slots_of.push(slot);
            lens.push(*len);
            pos.push(*p);
            code0.push(c);
            texts.push(text);
            hidden.push(h.clone());
        }
        out.batch = ids.len();
        if ids.is_empty() {
            return Ok(finished);
        }
        let last_hidden = Tensor::cat(&hidden, 0)?;
        let text = self.text_vectors(texts)?;
        let mut samplers = Vec::with_capacity(ids.len());
        for id in &ids {
            if let Some(r) = reqs.get_mut(id) {
                let stand_in = Sampler::new(SamplingConfig::greedy());
                samplers.push(std::mem::replace(&mut r.cp_sampler, stand_in));
            }
        }
        let rows = SlotRows {
            slots: &slots_of,
            lens: &lens,
            pos: &pos,
            last_hidden: &last_hidden,
        };
        let result = self.model.talker().talker().step_slots(
            &self.slots,
            &rows,
            &code0,
            &text,
            &mut samplers,
            graphs,
        );
        for (id, sampler) in ids.iter().zip(samplers) {
            if let Some(r) = reqs.get_mut(id) {
                r.cp_sampler = sampler;
            }
        }
        let (step, new_hidden) = result?;
        let logits = step.logits.to_vec2::<f32>()?;
        for (row, ((id, codes), logits)) in ids.iter().zip(step.codes).zip(logits).enumerate() {
            let Some(r) = reqs.get_mut(id) else {
                continue;
            };
            r.code0 = None;
            r.frames += 1;
            r.logits = Some(logits);
            if let Some((len, p, h)) = &mut r.decode {
                *len += 1;
                *p += 1;
                *h = new_hidden.narrow(0, row, 1)?;
            }
            let g = codes.len();
            let frame =
                Tensor::from_vec(codes, (g, 1), &candle_core::Device::Cpu)?.to_dtype(DType::U32)?;
            out.downstream.push((
                *id,
                Payload::Frames(FrameChunk {
                    frames: Some(frame),
                    finished: false,
                }),
            ));
        }
        Ok(finished)
    }

    fn leave(&mut self, id: RequestId) {
        for lost in super::leave_slot(&mut self.running, &self.slots, id) {
            self.reqs.remove(&lost);
            self.lost.push(lost);
        }
    }
}

impl StageModel for Qwen3TtsTalker {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        let cfg = self.model.config();
        let name = ctx
            .spec
            .voice
            .clone()
            .or_else(|| self.default_voice.clone());
        let voice = match (&ctx.spec.style.speaker_embedding, name) {
            // A cloned voice (the server's registry, or a clip with the request).
            (Some(e), _) => {
                let hidden = self
                    .model
                    .talker()
                    .talker()
                    .config()
                    .text_config
                    .hidden_size;
                if e.len() != hidden {
                    return Err(ModelError::Invalid(format!(
                        "a cloned voice of {} values; this Talker takes {hidden}",
                        e.len()
                    )));
                }
                let xvector = Tensor::from_slice(e, hidden, self.model.device())?;
                match &ctx.spec.style.reference {
                    Some(r) => Voice::InContext(self.ref_clip(xvector, r)?),
                    None => Voice::Embedding(xvector),
                }
            }
            (None, Some(n))
                if cfg.tts_model_type == ModelType::VoiceDesign
                    && n.eq_ignore_ascii_case(DESCRIBED) =>
            {
                Voice::Described
            }
            (None, Some(n)) => {
                if !cfg.talker_config.spk_id.contains_key(&n.to_lowercase()) {
                    return Err(ModelError::Invalid(format!(
                        "unknown voice {n:?}; available voices: {}",
                        cfg.speakers().join(", ")
                    )));
                }
                Voice::Preset(n)
            }
            (None, None) if cfg.tts_model_type == ModelType::VoiceDesign => Voice::Described,
            (None, None) => {
                return Err(ModelError::Invalid(
                    "this checkpoint has no preset voices: name one the server knows".into(),
                ))
            }
        };
        let style = &ctx.spec.style;
        let language = style.language.clone().unwrap_or_else(|| "auto".into());
        if language.to_lowercase() != "auto" && !cfg.languages().contains(&language.to_lowercase())
        {
            return Err(ModelError::Invalid(format!(
                "unknown language {language:?}; available: {}",
                cfg.languages().join(", ")
            )));
        }
        let instruct_ids = match style
            .instructions
            .as_deref()
            .filter(|s| !s.trim().is_empty())
        {
            Some(i) => Some(self.tokenizer.encode(&instruct_text(i))?),
            None => None,
        };
        let t = self.model.talker().talker().config();
        let mut code0 = sampling_config(&self.defaults, None, ctx.id);
        code0.suppress_tokens = t.suppress_tokens();
        let cp = self.cp_defaults.clone().with_seed(ctx.id.wrapping_add(1));
        let sampling = &ctx.spec.sampling;
        // A request's `max_tokens` counts this Talker's frames only where it
        // speaks the request's own text (/v1/audio/speech); in a cascade it is
        // the Thinker's text budget.
        let frame_cap = match ctx.spec.input {
            RequestInput::Speech { .. } => sampling.max_tokens,
            _ => None,
        };
        self.reqs.insert(
            ctx.id,
            Req {
                voice,
                instruct_ids,
                language,
                text: String::new(),
                tokens: TextTokens::default(),
                upstream_done: false,
                prompt: None,
                fed: None,
                taken: 0,
                decode: None,
                logits: None,
                code0: None,
                frames: 0,
                sampler: Sampler::new(code0),
                cp_sampler: Sampler::new(cp),
                // The profile's cap (generate's max_new_tokens: its last code 0
                // is not spoken), and the request's where it sets a lower one
                // (`max_tokens` on /v1/audio/speech: frames spoken).
                max_frames: self
                    .defaults
                    .max_tokens
                    .unwrap_or(DEFAULT_MAX_FRAMES)
                    .min(frame_cap.map_or(usize::MAX, |n| n.saturating_add(1)))
                    .max(1),
                fixed_frames: sampling
                    .ignore_eos
                    .then_some(sampling.audio_frames.or(frame_cap))
                    .flatten(),
            },
        );
        Ok(())
    }

    fn push(&mut self, id: RequestId, payload: Payload) -> Result<()> {
        let Payload::Text(chunk) = payload else {
            return Err(ModelError::Invalid(
                "the Qwen3-TTS Talker speaks text".into(),
            ));
        };
        let Some(mut r) = self.reqs.remove(&id) else {
            return Ok(());
        };
        r.text.push_str(&chunk.text);
        r.upstream_done |= chunk.finished;
        let result = self.advance(&mut r);
        self.reqs.insert(id, r);
        result
    }

    fn step(&mut self, out: &mut StepOutput) {
        let dev = self.model.device().clone();
        // The reference clips being encoded go first: each cloned request waits
        // for its clip, and beside these steps an encode ran 30x slower (only a
        // GPU's encodes are counted, so on the CPU this returns at once).
        graphs::yield_to_encodes(graphs::ENCODE_WAIT_CAP, false);
        for id in self.lost.drain(..) {
            out.failed
                .push((id, ModelError::Invalid("its KV slot was lost".into())));
        }
        let mut waiting: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.decode.is_none() && self.is_ready(r))
            .map(|(id, _)| *id)
            .collect();
        waiting.sort_unstable();
        let free = self.max_num_seqs.saturating_sub(self.running.len());
        let mut batch = Vec::new();
        for id in waiting.into_iter().take(free) {
            let Some(r) = self.reqs.remove(&id) else {
                continue;
            };
            if r.prompt.is_none() {
                // The text ended with nothing to say.
                end_of_speech(out, id);
                out.finished.push(id);
            } else {
                batch.push((id, r));
            }
        }
        if !batch.is_empty() {
            let running = self.running.len();
            let result = self.prefill(&mut batch);
            if let Err(e) = result {
                self.running.truncate(running);
                for (id, _) in batch.drain(..) {
                    out.failed.push((id, ModelError::Invalid(e.to_string())));
                }
            }
            for (id, r) in batch {
                self.reqs.insert(id, r);
            }
        }
        let mut reqs = std::mem::take(&mut self.reqs);
        let mut graphs = self.graphs.take();
        let _urgent = graphs::UrgentSection::step(&dev, graphs.is_some());
        let result = self.step_running(&mut reqs, graphs.as_mut(), out);
        self.reqs = reqs;
        self.graphs = graphs;
        match result {
            Ok(done) => {
                for id in done {
                    self.reqs.remove(&id);
                    self.leave(id);
                    out.finished.push(id);
                }
            }
            Err(e) => {
                for id in self.running.clone() {
                    self.reqs.remove(&id);
                    self.leave(id);
                    out.failed.push((id, ModelError::Invalid(e.to_string())));
                }
            }
        }
    }

    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
        self.leave(id);
    }

    fn has_ready_work(&self) -> bool {
        self.reqs.values().any(|r| self.is_ready(r)) || !self.lost.is_empty()
    }

    fn start(&mut self) {
        let Some(g) = &mut self.graphs else {
            return;
        };
        let talker = self.model.talker().talker();
        let t = std::time::Instant::now();
        match talker.warm_up_graphs(g, &self.slots, self.max_num_seqs) {
            Ok(n) => tracing::info!("Talker: {n} decode graphs captured in {:?}", t.elapsed()),
            Err(e) => tracing::warn!("Talker: capturing decode graphs: {e}"),
        }
        if !samples_on_device(&self.cp_defaults) {
            return;
        }
        let cp = talker.code_predictor();
        if let Err(e) = cp.warm_up_graphs(&mut g.predictor, self.max_num_seqs, &self.cp_defaults) {
            tracing::warn!("Talker: capturing code predictor graphs: {e}");
        }
    }

    fn active(&self) -> usize {
        self.reqs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Modalities, RequestSpec, SpeechStyle, TextChunk};
    use crate::models::qwen3_tts::fixtures;
    use crate::models::qwen3_tts::model::Weights;

    fn stage() -> Qwen3TtsTalker {
        stage_of(4)
    }

    fn stage_of(max_num_seqs: usize) -> Qwen3TtsTalker {
        let dev = candle_core::Device::Cpu;
        let model = Qwen3Tts::load(
            &fixtures::model_dir(),
            DType::F32,
            &dev,
            Weights::Checkpoint,
            None,
        )
        .unwrap();
        let tok =
            ChatTokenizer::from_hf_dir(&fixtures::dir().join("../qwen3_omni/tokenizer")).unwrap();
        let greedy = SamplingParams {
            temperature: Some(0.0),
            repetition_penalty: Some(1.05),
            max_tokens: Some(24),
            ..Default::default()
        };
        let cp = SamplingParams {
            temperature: Some(0.0),
            ..Default::default()
        };
        Qwen3TtsTalker::new(
            Arc::new(model),
            Arc::new(tok),
            greedy,
            Some(cp),
            None,
            max_num_seqs,
            512,
            false,
        )
        .unwrap()
    }

    fn ctx(id: RequestId, voice: &str, style: SpeechStyle) -> Arc<RequestCtx> {
        let spec = RequestSpec {
            input: RequestInput::Chat {
                messages: Vec::new(),
            },
            modalities: Modalities::TEXT_AUDIO,
            sampling: Default::default(),
            voice: Some(voice.into()),
            tools: None,
            style,
        };
        Arc::new(RequestCtx::for_test(id, spec).0)
    }

    /// Steps until `id` is finished; its frames, in order.
    fn run(stage: &mut Qwen3TtsTalker, id: RequestId) -> Vec<Vec<u32>> {
        let mut frames = Vec::new();
        for _ in 0..200 {
            let mut out = StepOutput::default();
            stage.step(&mut out);
            assert!(out.failed.is_empty(), "{:?}", out.failed);
            for (rid, p) in out.downstream {
                if let (
                    true,
                    Payload::Frames(FrameChunk {
                        frames: Some(f), ..
                    }),
                ) = (rid == id, p)
                {
                    frames.push(f.flatten_all().unwrap().to_vec1::<u32>().unwrap());
                }
            }
            if out.finished.contains(&id) {
                return frames;
            }
        }
        panic!("request {id} never finished");
    }

    fn want(case: &str) -> Vec<Vec<u32>> {
        fixtures::io("generate")[&format!("{case}.codes")]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec2()
            .unwrap()
    }

    /// `text` pushed word by word, a step after each; then steps to the end.
    fn speak_in_deltas(stage: &mut Qwen3TtsTalker, id: RequestId, text: &str) -> Vec<Vec<u32>> {
        let words: Vec<&str> = text.split_inclusive(' ').collect();
        let mut got = Vec::new();
        for (i, w) in words.iter().enumerate() {
            let chunk = TextChunk::text(w.to_string(), Vec::new(), i + 1 == words.len());
            stage.push(id, Payload::Text(chunk)).unwrap();
            // A step between deltas: frames whose text has not come wait for it.
            let mut out = StepOutput::default();
            stage.step(&mut out);
            assert!(out.failed.is_empty());
            for (_, p) in out.downstream {
                if let Payload::Frames(FrameChunk {
                    frames: Some(f), ..
                }) = p
                {
                    got.push(f.flatten_all().unwrap().to_vec1::<u32>().unwrap());
                }
            }
        }
        got.extend(run(stage, id));
        got
    }

    fn case(name: &str) -> serde_json::Value {
        let meta = fixtures::meta("generate");
        meta["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == name)
            .unwrap()
            .clone()
    }

    /// A Thinker's text, arriving word by word, is spoken as the reference's
    /// streaming-text `generate` speaks the whole text.
    #[test]
    fn text_in_deltas_is_the_reference_streaming_layout() {
        let mut stage = stage();
        let c = case("custom_stream");
        let style = SpeechStyle {
            instructions: c["instruct"].as_str().map(str::to_string),
            language: Some("english".into()),
            ..Default::default()
        };
        stage
            .admit(ctx(2, c["speaker"].as_str().unwrap(), style))
            .unwrap();
        let got = speak_in_deltas(&mut stage, 2, c["text"].as_str().unwrap());
        assert_eq!(got, want("custom_stream"));
    }

    /// A cloned voice (the speaker encoder's x-vector) in place of a preset.
    #[test]
    fn a_cloned_voice_is_the_reference_xvector_path() {
        let mut stage = stage();
        let c = case("xvector");
        let xvector: Vec<f32> = fixtures::io("speaker")["embedding"].to_vec1().unwrap();
        let style = SpeechStyle {
            language: Some("english".into()),
            speaker_embedding: Some(xvector.clone()),
            ..Default::default()
        };
        stage.admit(ctx(3, "vivian", style)).unwrap();
        let got = speak_in_deltas(&mut stage, 3, c["text"].as_str().unwrap());
        assert_eq!(got, want("xvector"));
        // The wrong width is refused at admission.
        let style = SpeechStyle {
            speaker_embedding: Some(xvector[1..].to_vec()),
            ..Default::default()
        };
        let err = stage.admit(ctx(4, "vivian", style)).unwrap_err();
        assert!(err.to_string().contains("cloned voice"), "{err}");
    }

    /// The whole text at once is qwen-tts's default (non-streaming) prompt.
    #[test]
    fn whole_text_is_the_reference_default_layout() {
        let mut stage = stage();
        let meta = fixtures::meta("generate");
        let case = meta["cases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "custom")
            .unwrap();
        stage
            .admit(ctx(7, "Vivian", SpeechStyle::default()))
            .unwrap();
        let chunk = TextChunk::text(case["text"].as_str().unwrap().into(), Vec::new(), true);
        stage.push(7, Payload::Text(chunk)).unwrap();
        assert_eq!(run(&mut stage, 7), want("custom"));
    }

    /// Nine requests at once (their code 0s drawn in parallel, past eight rows)
    /// each speak as the reference does alone.
    #[test]
    fn nine_requests_at_once_each_speak_as_alone() {
        let mut stage = stage_of(9);
        let text = case("custom")["text"].as_str().unwrap().to_string();
        let ids: Vec<RequestId> = (20..29).collect();
        for &id in &ids {
            stage
                .admit(ctx(id, "Vivian", SpeechStyle::default()))
                .unwrap();
            let chunk = TextChunk::text(text.clone(), Vec::new(), true);
            stage.push(id, Payload::Text(chunk)).unwrap();
        }
        let mut frames: HashMap<RequestId, Vec<Vec<u32>>> = HashMap::new();
        let mut finished = HashSet::new();
        let mut widest = 0;
        for _ in 0..200 {
            let mut out = StepOutput::default();
            stage.step(&mut out);
            assert!(out.failed.is_empty(), "{:?}", out.failed);
            widest = widest.max(out.batch);
            for (id, p) in out.downstream {
                if let Payload::Frames(FrameChunk {
                    frames: Some(f), ..
                }) = p
                {
                    let f = f.flatten_all().unwrap().to_vec1::<u32>().unwrap();
                    frames.entry(id).or_default().push(f);
                }
            }
            finished.extend(out.finished);
            if finished.len() == ids.len() {
                break;
            }
        }
        assert_eq!(widest, 9, "the nine never stepped together");
        for id in ids {
            assert!(finished.contains(&id), "request {id} never finished");
            assert_eq!(frames[&id], want("custom"), "request {id}");
        }
    }

    /// A text streamed in pieces of any size is tokenized as the whole text
    /// is, and as today's whole-text tokenization at every push.
    #[test]
    fn streamed_text_tokens_are_the_whole_texts() {
        use rand::{Rng, SeedableRng};
        let tok =
            ChatTokenizer::from_hf_dir(&fixtures::dir().join("../qwen3_omni/tokenizer")).unwrap();
        let sentences = [
            "Hello, world! It's 2024 and we're   testing: tokens, digits 1234567890.",
            "\nNew line here;\n\n  indented  text (with parens) and \"quotes\" -- dashes...",
            "Ünïcödé: café naïve façade, Straße größer,日本語のテキスト 中文 , Ελληνικά κείμενο.",
            " tabs\tand\tspaces ,  punctuation !? ... 'quoted' I'll you've he'd.\r\n",
            "e\u{301}t\u{301}e\u{301} combining , Kelvin \u{212a} 3.14 %@# end",
        ];
        let whole: String = sentences.concat().repeat(4);
        let (_, want) = tokens(&tok, &whole).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let stream = |ends: &[usize]| {
            let mut t = TextTokens::default();
            let (mut cuts, mut last) = (0, 0);
            for &end in ends {
                let done = end == whole.len();
                let settled = t.push(&tok, &whole[..end], done).unwrap();
                let (role, now) = tokens(&tok, &whole[..end]).unwrap();
                assert_eq!((&t.role, &t.ids), (&role, &now), "at byte {end}");
                assert_eq!(&t.ids[..t.fixed], &want[..t.fixed], "at byte {end}");
                // Every settled token is final, and settled ones stay settled.
                assert_eq!(&t.ids[..settled], &want[..settled], "at byte {end}");
                assert!(settled >= last, "at byte {end}");
                last = settled;
                cuts += usize::from(t.base > 0);
            }
            assert_eq!(t.ids, want);
            assert!(cuts > 0);
        };
        for _ in 0..20 {
            let mut ends = Vec::new();
            let mut end = 0;
            while end < whole.len() {
                end = (end + rng.gen_range(1..=12)).min(whole.len());
                while !whole.is_char_boundary(end) {
                    end += 1;
                }
                ends.push(end);
            }
            stream(&ends);
        }
        // Word by word, a space after each (the WS speech stream) or before
        // (an LLM's tokens).
        let ends: Vec<usize> = whole
            .split_inclusive(' ')
            .scan(0, |end, w| {
                *end += w.len();
                Some(*end)
            })
            .collect();
        stream(&ends);
        let mut ends: Vec<usize> = whole.match_indices(' ').map(|(i, _)| i).collect();
        ends.retain(|&i| i > 0);
        ends.push(whole.len());
        stream(&ends);
        // Text without spaces settles at its punctuation, before its end.
        let cjk = "你好，世界。今天天气很好！我们去公园吧？好的：走吧";
        let (_, want) = tokens(&tok, cjk).unwrap();
        let mut t = TextTokens::default();
        let mut early = 0;
        for (i, c) in cjk.char_indices() {
            let end = i + c.len_utf8();
            let settled = t.push(&tok, &cjk[..end], false).unwrap();
            assert_eq!(&t.ids[..settled], &want[..settled], "at byte {end}");
            early = settled;
        }
        assert!(early > 0 && early < want.len(), "{early} of {}", want.len());
        assert_eq!(t.push(&tok, cjk, true).unwrap(), want.len());
        assert_eq!(t.ids, want);
    }

    #[test]
    fn bad_voices_and_languages_are_refused_at_admission() {
        let mut stage = stage();
        let err = stage
            .admit(ctx(1, "nobody", SpeechStyle::default()))
            .unwrap_err();
        assert!(err.to_string().contains("unknown voice"), "{err}");
        let style = SpeechStyle {
            language: Some("klingon".into()),
            ..Default::default()
        };
        let err = stage.admit(ctx(2, "ryan", style)).unwrap_err();
        assert!(err.to_string().contains("unknown language"), "{err}");
        // Nothing to say: the request ends with no frames.
        stage.admit(ctx(3, "ryan", SpeechStyle::default())).unwrap();
        stage
            .push(
                3,
                Payload::Text(TextChunk::text(String::new(), Vec::new(), true)),
            )
            .unwrap();
        assert!(run(&mut stage, 3).is_empty());
    }
}
