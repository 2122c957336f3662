//! Qwen3-TTS's Talker (`Qwen3TTSTalkerForConditionalGeneration`, weights under
//! `talker`) and the prompt layouts of qwen-tts's `Qwen3TTSForConditionalGeneration.generate`.
//!
//! The frame loop is the engine's Qwen3-Omni Talker ([`Talker`], built as
//! [`TalkerVariant::Tts`]: dense layers, the code predictor behind
//! `small_to_mtp_projection`); what is Qwen3-TTS's own is here: the text
//! embedding (`talker.model.text_embedding`, through `text_projection`) and the
//! prompt, one per way of choosing the voice:
//!
//! ```text
//! [instruct]  text(<|im_start|>user\n{instruct}<|im_end|>\n)               (optional)
//! role        text(<|im_start|>assistant\n)
//! control     tts_pad x (L-2), tts_bos  +  codec(think/nothink, think_bos, [lang], think_eos, [speaker], pad)
//! first       text(first token) + codec(bos)                                  (streaming text)
//!   or        text(all tokens), tts_eos + codec(pad) each; tts_pad + codec(bos) (non_streaming)
//! ```
//!
//! The speaker is a preset's codec embedding (CustomVoice), a speaker encoder's
//! x-vector (Base), or nothing (VoiceDesign, whose `instructions` describe the
//! voice). With streaming text, the rest of the text (then `tts_eos`) is fed one
//! vector a frame as the trailing text; non-streaming, every frame gets `tts_pad`.
//!
//! In-context cloning (Base, the reference's `icl_mode`: [`Voice::InContext`])
//! keeps the x-vector in the control part and replaces `first` with the
//! reference clip's transcript and codes, which the Talker then continues
//! (`generate_icl_prompt`):
//!
//! ```text
//! text side   text(ref transcript + text), tts_eos                            T positions
//! codec side  codec(bos), then each ref frame's codes embedded and summed     C positions
//! streaming   text[..C] + codec side, the rest of the text side trailing      (T > C)
//!   or        text side, tts_pad up to C, + codec side; nothing trails        (T <= C)
//! whole text  text side + codec(pad) each, then codec side + tts_pad each
//! ```

use candle_core::{Module, Tensor};
use candle_nn::{Embedding, VarBuilder};

use super::config::Qwen3TtsConfig;
use crate::models::qwen3_omni::talker::{Talker, TtsEmbeds};

/// Why a request's prompt could not be built: the client's input, or the model.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("unknown voice {0:?}")]
    UnknownSpeaker(String),
    #[error("unknown language {0:?}")]
    UnknownLanguage(String),
    #[error("the text is empty")]
    EmptyText,
    #[error("this checkpoint has no preset voices and no voice was given")]
    NoVoice,
    #[error("the reference clip's transcript is empty")]
    EmptyRefText,
    #[error("the reference clip's codes: {0}")]
    BadRefCodes(String),
    #[error(transparent)]
    Model(#[from] candle_core::Error),
}

/// Whose voice speaks.
#[derive(Debug, Clone)]
pub enum Voice {
    /// A preset speaker (CustomVoice), by name (any case).
    Preset(String),
    /// A speaker encoder's x-vector `(hidden,)` (Base, voice cloning).
    Embedding(Tensor),
    /// A reference clip's x-vector, codes and transcript (Base, in-context
    /// cloning): the speech continues the clip's.
    InContext(RefClip),
    /// None: the instruction describes the voice (VoiceDesign).
    Described,
}

/// A reference clip for in-context cloning, as qwen-tts's
/// `create_voice_clone_prompt` makes it (without `x_vector_only_mode`).
#[derive(Debug, Clone)]
pub struct RefClip {
    /// The speaker encoder's x-vector of the clip, `(hidden,)`.
    pub xvector: Tensor,
    /// The speech tokenizer's codes of the clip, `(frames, groups)` (u32 or
    /// i64), from [`super::codec_encoder::CodecEncoder::encode`].
    pub codes: Tensor,
    /// The tokens of [`ref_text`]`(transcript)`.
    pub ref_ids: Vec<u32>,
}

impl RefClip {
    /// Tokens of the transcript itself (inside its chat wrapping).
    pub fn transcript_len(&self) -> usize {
        self.ref_ids.len().saturating_sub(ROLE + REF_CLOSE)
    }

    /// Positions of the prompt's codec side: `codec_bos` and the clip's frames.
    pub fn codec_positions(&self) -> candle_core::Result<usize> {
        Ok(self.codes.dim(0)? + 1)
    }
}

/// One utterance to speak.
#[derive(Debug, Clone)]
pub struct SpeechRequest<'a> {
    /// The tokens of [`assistant_text`]`(text)`.
    pub input_ids: &'a [u32],
    /// The tokens of [`instruct_text`]`(instructions)`: the style for CustomVoice,
    /// the voice for VoiceDesign.
    pub instruct_ids: Option<&'a [u32]>,
    pub voice: Voice,
    /// "auto" or a language the checkpoint lists (any case).
    pub language: &'a str,
    /// The whole text in the prompt (qwen-tts's default) instead of one token a frame.
    pub non_streaming: bool,
}

/// A prompt for [`Talker::prefill`] and the text vectors its frames take.
#[derive(Debug, Clone)]
pub struct Prompt {
    /// `(1, s, hidden)`.
    pub embeds: Tensor,
    /// `(1, t, hidden)`: frame `f < t` adds `trailing[f]`, later frames `tts_pad`.
    pub trailing: Tensor,
}

/// The text qwen-tts tokenizes for an utterance (the prompt takes the role, the
/// text and the closing tokens from it by position, as the reference does).
pub fn assistant_text(text: &str) -> String {
    format!("<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")
}

/// The text qwen-tts tokenizes for a reference clip's transcript (the prompt
/// takes the transcript's tokens from it by position, as the reference does).
pub fn ref_text(text: &str) -> String {
    format!("<|im_start|>assistant\n{text}<|im_end|>\n")
}

/// The text qwen-tts tokenizes for an instruction.
pub fn instruct_text(instruct: &str) -> String {
    format!("<|im_start|>user\n{instruct}<|im_end|>\n")
}

/// Tokens of [`assistant_text`] before and after the text itself.
pub(crate) const ROLE: usize = 3;
pub(crate) const CLOSE: usize = 5;
/// Tokens of [`ref_text`] after the transcript.
pub(crate) const REF_CLOSE: usize = 2;

/// The Talker with Qwen3-TTS's text embedding and prompts.
#[derive(Debug, Clone)]
pub struct Qwen3TtsTalker {
    talker: Talker,
    text_embedding: Embedding,
    tts: TtsEmbeds,
    cfg: Qwen3TtsConfig,
}

impl Qwen3TtsTalker {
    /// `vb` at the checkpoint's root (the weights are under `talker.`).
    pub fn new(cfg: &Qwen3TtsConfig, vb: VarBuilder) -> candle_core::Result<Self> {
        let t = &cfg.talker_config;
        let vb = vb.pp("talker");
        let talker = Talker::new(&cfg.talker(), vb.clone())?;
        let text_embedding = candle_nn::embedding(
            t.text_vocab_size,
            t.text_hidden_size,
            vb.pp("model").pp("text_embedding"),
        )?;
        let ids = Tensor::new(
            &[
                cfg.tts_bos_token_id,
                cfg.tts_eos_token_id,
                cfg.tts_pad_token_id,
            ],
            vb.device(),
        )?;
        let tts = talker.tts_embeds(&text_embedding.forward(&ids)?)?;
        Ok(Self {
            talker,
            text_embedding,
            tts,
            cfg: cfg.clone(),
        })
    }

    pub fn talker(&self) -> &Talker {
        &self.talker
    }

    pub fn config(&self) -> &Qwen3TtsConfig {
        &self.cfg
    }

    /// `text_projection(tts_pad)`, `(hidden,)`: what frames past the text add.
    pub fn tts_pad(&self) -> &Tensor {
        &self.tts.pad
    }

    /// `text_projection(tts_eos)`, `(hidden,)`: what the frame after the text adds.
    pub fn tts_eos(&self) -> &Tensor {
        &self.tts.eos
    }

    /// `text_projection(text_embedding(ids))`, `(1, n, hidden)`.
    pub fn text(&self, ids: &[u32]) -> candle_core::Result<Tensor> {
        let ids = Tensor::new(ids, self.text_embedding.embeddings().device())?.unsqueeze(0)?;
        self.talker
            .text_projection(&self.text_embedding.forward(&ids)?)
    }

    fn codec(&self, ids: &[u32]) -> candle_core::Result<Tensor> {
        let ids = Tensor::new(ids, self.text_embedding.embeddings().device())?.unsqueeze(0)?;
        self.talker.embed_codec(&ids)
    }

    /// `(1, k, hidden)` copies of a `(hidden,)` vector.
    fn rows(v: &Tensor, k: usize) -> candle_core::Result<Tensor> {
        let h = v.dim(0)?;
        v.reshape((1, 1, h))?.broadcast_as((1, k, h))?.contiguous()
    }

    /// The language's codec id (`None` for "auto"), or the preset speaker's
    /// dialect where the language is Chinese or "auto", as the reference picks.
    fn language_id(&self, language: &str, voice: &Voice) -> Result<Option<u32>, PromptError> {
        let t = &self.cfg.talker_config;
        let lang = language.to_lowercase();
        let mut id = match lang.as_str() {
            "auto" => None,
            l => match t.codec_language_id.get(l) {
                Some(&i) if !l.contains("dialect") => Some(i),
                _ => return Err(PromptError::UnknownLanguage(language.to_string())),
            },
        };
        if let (Voice::Preset(name), "chinese" | "auto") = (voice, lang.as_str()) {
            if let Some(serde_json::Value::String(d)) = t.spk_is_dialect.get(&name.to_lowercase()) {
                id = t.codec_language_id.get(d).copied().or(id);
            }
        }
        Ok(id)
    }

    /// The prompt `generate` builds for one request.
    pub fn prompt(&self, req: &SpeechRequest) -> Result<Prompt, PromptError> {
        let ids = req.input_ids;
        if ids.len() <= ROLE + CLOSE {
            return Err(PromptError::EmptyText);
        }
        self.prompt_parts(
            &ids[..ROLE],
            &ids[ROLE..ids.len() - CLOSE],
            req.instruct_ids,
            &req.voice,
            req.language,
            req.non_streaming,
        )
    }

    /// [`Self::prompt`] from the role tokens (`<|im_start|>assistant\n`) and the
    /// text tokens. With `non_streaming` every token goes into the prompt; else
    /// only the first, the rest (then `tts_eos`) being the trailing text, so a
    /// stream whose text is still coming can start from what it has. With a
    /// [`Voice::InContext`] the text must be whole: streaming, the prompt takes
    /// as many transcript and text tokens as the clip has frames, plus one.
    pub fn prompt_parts(
        &self,
        role: &[u32],
        text_ids: &[u32],
        instruct_ids: Option<&[u32]>,
        voice: &Voice,
        language: &str,
        non_streaming: bool,
    ) -> Result<Prompt, PromptError> {
        let c = &self.cfg.talker_config;
        if text_ids.is_empty() {
            return Err(PromptError::EmptyText);
        }
        let speaker = match voice {
            Voice::Preset(name) => {
                let id = c
                    .spk_id
                    .get(&name.to_lowercase())
                    .and_then(|i| i.id())
                    .ok_or_else(|| PromptError::UnknownSpeaker(name.clone()))?;
                Some(self.codec(&[id])?)
            }
            Voice::Embedding(e) | Voice::InContext(RefClip { xvector: e, .. }) => {
                let h = e.elem_count();
                Some(e.reshape((1, 1, h))?.to_dtype(self.tts.pad.dtype())?)
            }
            Voice::Described => None,
        };
        let control: Vec<u32> = match self.language_id(language, voice)? {
            None => vec![
                c.codec_nothink_id,
                c.codec_think_bos_id,
                c.codec_think_eos_id,
            ],
            Some(l) => vec![
                c.codec_think_id,
                c.codec_think_bos_id,
                l,
                c.codec_think_eos_id,
            ],
        };
        // codec(control), [speaker], codec(pad): every position but the last (bos).
        let mut codec = vec![self.codec(&control)?];
        codec.extend(speaker);
        codec.push(self.codec(&[c.codec_pad_id])?);
        let codec = Tensor::cat(&codec, 1)?;
        let l = codec.dim(1)?;
        let tts_side = Tensor::cat(
            &[
                Self::rows(&self.tts.pad, l - 1)?,
                Self::rows(&self.tts.bos, 1)?,
            ],
            1,
        )?;
        let mut parts = Vec::new();
        if let Some(ins) = instruct_ids.filter(|i| !i.is_empty()) {
            parts.push(self.text(ins)?);
        }
        parts.push(self.text(role)?);
        parts.push((tts_side + codec)?);
        if let Voice::InContext(clip) = voice {
            let (icl, trailing) = self.in_context(text_ids, clip, non_streaming)?;
            parts.push(icl);
            return Ok(Prompt {
                embeds: Tensor::cat(&parts, 1)?,
                trailing,
            });
        }
        let bos = self.codec(&[c.codec_bos_id])?;
        let trailing = if non_streaming {
            let n = text_ids.len();
            let text = Tensor::cat(&[self.text(text_ids)?, Self::rows(&self.tts.eos, 1)?], 1)?;
            parts.push((text + self.codec(&vec![c.codec_pad_id; n + 1])?)?);
            parts.push((Self::rows(&self.tts.pad, 1)? + bos)?);
            Self::rows(&self.tts.pad, 1)?
        } else {
            parts.push((self.text(&text_ids[..1])? + bos)?);
            let rest = &text_ids[1..];
            let eos = Self::rows(&self.tts.eos, 1)?;
            match rest.is_empty() {
                true => eos,
                false => Tensor::cat(&[self.text(rest)?, eos], 1)?,
            }
        };
        Ok(Prompt {
            embeds: Tensor::cat(&parts, 1)?,
            trailing,
        })
    }

    /// `generate_icl_prompt`: the clip's transcript and codes after the control
    /// part, and the trailing text (see the module doc).
    fn in_context(
        &self,
        text_ids: &[u32],
        clip: &RefClip,
        non_streaming: bool,
    ) -> Result<(Tensor, Tensor), PromptError> {
        let c = &self.cfg.talker_config;
        let ids = &clip.ref_ids;
        if ids.len() <= ROLE + REF_CLOSE {
            return Err(PromptError::EmptyRefText);
        }
        let all: Vec<u32> = ids[ROLE..ids.len() - REF_CLOSE]
            .iter()
            .chain(text_ids)
            .copied()
            .collect();
        let text = Tensor::cat(&[self.text(&all)?, Self::rows(&self.tts.eos, 1)?], 1)?;
        let codec = Tensor::cat(
            &[
                self.codec(&[c.codec_bos_id])?,
                self.ref_frames(&clip.codes)?,
            ],
            1,
        )?;
        let (t, n) = (text.dim(1)?, codec.dim(1)?);
        let pad = Self::rows(&self.tts.pad, 1)?;
        Ok(if non_streaming {
            let text = (text + self.codec(&vec![c.codec_pad_id; t])?)?;
            let codec = (codec + Self::rows(&self.tts.pad, n)?)?;
            (Tensor::cat(&[text, codec], 1)?, pad)
        } else if t > n {
            let trailing = text.narrow(1, n, t - n)?;
            ((text.narrow(1, 0, n)? + codec)?, trailing)
        } else {
            let text = match n - t {
                0 => text,
                k => Tensor::cat(&[text, Self::rows(&self.tts.pad, k)?], 1)?,
            };
            ((text + codec)?, pad)
        })
    }

    /// Each frame of `codes` `(frames, groups)` embedded as the Talker takes a
    /// frame (code 0 by its codec embedding, code g by the code predictor's
    /// `codec_embedding[g - 1]`) and summed: `(1, frames, hidden)`.
    fn ref_frames(&self, codes: &Tensor) -> Result<Tensor, PromptError> {
        let c = &self.cfg.talker_config;
        let (groups, size) = (
            c.num_code_groups,
            c.code_predictor_config.decoder.vocab_size,
        );
        let shape = codes.dims();
        if shape.len() != 2 || shape[0] == 0 || shape[1] != groups {
            return Err(PromptError::BadRefCodes(format!(
                "shape {shape:?}, not (frames, {groups})"
            )));
        }
        // Negative i64 codes wrap to large u32s, refused with the rest.
        let codes = codes
            .to_dtype(candle_core::DType::U32)?
            .to_device(self.text_embedding.embeddings().device())?;
        let max = codes.max_all()?.to_scalar::<u32>()?;
        if max as usize >= size {
            return Err(PromptError::BadRefCodes(format!(
                "code {max} outside the codebook of {size}"
            )));
        }
        let group = |g: usize| codes.narrow(1, g, 1)?.t()?.contiguous();
        let mut sum = self.talker.embed_codec(&group(0)?)?;
        for g in 1..groups {
            sum = (sum + self.talker.code_predictor().embed(g, &group(g)?)?)?;
        }
        Ok(sum.to_dtype(self.tts.pad.dtype())?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures::max_abs_diff;
    use crate::models::qwen3_omni::sampling::{Sampler, SamplingConfig};
    use crate::models::qwen3_tts::fixtures;
    use crate::models::qwen3_tts::model::{voice_clone_cut, Qwen3Tts, Weights};
    use candle_core::DType;
    use std::collections::HashMap;

    fn load() -> Qwen3TtsTalker {
        let cfg = Qwen3TtsConfig::load(&fixtures::model_dir()).unwrap();
        Qwen3TtsTalker::new(&cfg, fixtures::weights()).unwrap()
    }

    fn u32s(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::U32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// Greedy frames as the reference's `generate(do_sample=False,
    /// subtalker_dosample=False)`: repetition penalty 1.05, the control ids
    /// suppressed, EOS barred for the first two frames (`min_new_tokens=2`).
    /// Stops at EOS or after `limit` frames; returns the frames and the prefill's
    /// code-0 logits.
    fn greedy(
        tts: &Qwen3TtsTalker,
        prompt: &Prompt,
        limit: usize,
    ) -> (Vec<Vec<u32>>, Tensor, bool) {
        let talker = tts.talker();
        let cfg = talker.config();
        let eos = cfg.codec_eos_token_id;
        let mut code0 = Sampler::new(SamplingConfig {
            repetition_penalty: 1.05,
            suppress_tokens: cfg.suppress_tokens(),
            ..SamplingConfig::greedy()
        });
        let mut cp = vec![Sampler::new(SamplingConfig::greedy())];
        let (mut state, out) = talker.prefill(&prompt.embeds, None, None).unwrap();
        let logits0 = out.logits.clone();
        let mut logits = out.logits;
        let t_len = prompt.trailing.dim(1).unwrap();
        let mut frames = Vec::new();
        loop {
            let mut row = logits.get(0).unwrap().to_vec1::<f32>().unwrap();
            if frames.len() < 2 {
                row[eos as usize] = f32::NEG_INFINITY;
            }
            let c0 = code0.sample(&row).unwrap();
            if c0 == eos {
                return (frames, logits0, true);
            }
            if frames.len() == limit {
                return (frames, logits0, false);
            }
            let f = frames.len();
            let text = match f < t_len {
                true => prompt.trailing.narrow(1, f, 1).unwrap(),
                false => tts.tts_pad().reshape((1, 1, ())).unwrap(),
            };
            let step = talker.step(&mut state, &[c0], &text, &mut cp).unwrap();
            frames.push(step.codes[0].clone());
            logits = step.logits;
        }
    }

    /// One reference `generate` case `c` of `io`: the prompt and trailing text
    /// (within `tol`), the prefill's logits, the greedy codes and where EOS
    /// comes (the reference stops at `max` frames). Returns the codes
    /// `(1, groups, frames)`.
    fn check_generate(
        tts: &Qwen3TtsTalker,
        io: &HashMap<String, Tensor>,
        c: &str,
        req: &SpeechRequest,
        max: usize,
        tol: f32,
    ) -> Tensor {
        let prompt = tts.prompt(req).unwrap();
        let e = max_abs_diff(&prompt.embeds, &io[&format!("{c}.prompt")]);
        assert!(e < tol, "{c}: prompt {e}");
        let e = max_abs_diff(&prompt.trailing, &io[&format!("{c}.trailing")]);
        assert!(e < tol, "{c}: trailing text {e}");

        let want: Vec<Vec<u32>> = io[&format!("{c}.codes")]
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec2()
            .unwrap();
        // The reference's last code 0 gets its other codes only from a further
        // step, which max_new_tokens cuts: it returns max - 1 frames then.
        let (ours, logits0, ended) = greedy(tts, &prompt, want.len());
        let e = max_abs_diff(&logits0.squeeze(0).unwrap(), &io[&format!("{c}.logits0")]);
        assert!(e < 1e-4, "{c}: prefill logits {e}");
        assert_eq!(ours, want, "{c}: codes");
        assert_eq!(ended, want.len() < max - 1, "{c}: where EOS comes");
        let n = ours.len();
        let flat: Vec<u32> = ours.concat();
        Tensor::from_vec(flat, (1, n, ours[0].len()), &candle_core::Device::Cpu)
            .unwrap()
            .transpose(1, 2)
            .unwrap()
    }

    #[test]
    fn every_voice_path_matches_reference() {
        let tts = load();
        let io = fixtures::io("generate");
        let meta = fixtures::meta("generate");
        let max = meta["max_frames"].as_u64().unwrap() as usize;
        let xvector = fixtures::io("speaker")["embedding"].clone();
        let (codec, _) = crate::models::qwen3_tts::codec::load_decoder(
            &fixtures::model_dir(),
            DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap();
        for case in meta["cases"].as_array().unwrap() {
            let c = case["name"].as_str().unwrap();
            let input_ids = u32s(&io[&format!("{c}.input_ids")]);
            let instruct = io.get(&format!("{c}.instruct_ids")).map(u32s);
            let voice = match (case["speaker"].as_str(), case.get("xvector")) {
                (Some(s), _) => Voice::Preset(s.to_string()),
                (None, Some(_)) => Voice::Embedding(xvector.clone()),
                (None, None) => Voice::Described,
            };
            let req = SpeechRequest {
                input_ids: &input_ids,
                instruct_ids: instruct.as_deref(),
                voice,
                language: case["language"].as_str().unwrap(),
                non_streaming: case["non_streaming"].as_bool().unwrap(),
            };
            let codes = check_generate(&tts, &io, c, &req, max, 1e-5);
            // And the waveform the speech tokenizer makes of them.
            let wav = codec.decode(&codes).unwrap().flatten_all().unwrap();
            let e = max_abs_diff(&wav, &io[&format!("{c}.wav")]);
            assert!(e < 1e-4, "{c}: waveform {e}");
        }
    }

    /// In-context cloning from the reference clip up: our codec encoder's codes
    /// and speaker encoder's x-vector of the clip make the prompt; the codes
    /// generated after it, and `generate_voice_clone`'s waveform (the decode of
    /// the ref's codes and the new ones, the ref's share cut off) from a
    /// streamed decoder seeded with the ref's codes.
    #[test]
    fn in_context_cloning_matches_reference() {
        let dir = fixtures::model_dir();
        let dev = candle_core::Device::Cpu;
        let m = Qwen3Tts::load(&dir, DType::F32, &dev, Weights::Checkpoint, None).unwrap();
        let encoder = m
            .codec_encoder()
            .expect("a Base checkpoint's codec encoder");
        let io = fixtures::io("icl");
        let clips = fixtures::io("encoder");
        let meta = fixtures::meta("icl");
        let max = meta["max_frames"].as_u64().unwrap() as usize;
        let cases = meta["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 3);
        for case in cases {
            let c = case["name"].as_str().unwrap();
            let n = case["ref_clip"].as_u64().unwrap() as usize;
            let pcm = fixtures::pcm16(&clips, n);
            let ref_codes = encoder.encode(&pcm).unwrap();
            let r = ref_codes.dim(0).unwrap();
            assert_eq!(r, case["ref_frames"].as_u64().unwrap() as usize, "{c}");
            let xvector = m.speaker_encoder().unwrap().embed_pcm(&pcm).unwrap();
            let ex = max_abs_diff(&xvector, &io[&format!("{c}.xvector")]);
            assert!(ex < 1e-4, "{c}: x-vector {ex}");
            let input_ids = u32s(&io[&format!("{c}.input_ids")]);
            let req = SpeechRequest {
                input_ids: &input_ids,
                instruct_ids: None,
                voice: Voice::InContext(RefClip {
                    xvector,
                    codes: ref_codes.clone(),
                    ref_ids: u32s(&io[&format!("{c}.ref_ids")]),
                }),
                language: case["language"].as_str().unwrap(),
                non_streaming: case["non_streaming"].as_bool().unwrap(),
            };
            let codes = check_generate(m.talker(), &io, c, &req, max, 1e-5);
            let frames = codes.dim(2).unwrap();

            // The streamed decoder, seeded with the ref's codes: what it says for
            // them is dropped but for the samples the reference's cut keeps.
            let dec = m.decoder();
            let mut state = dec.new_state();
            let seed = dec
                .step(&mut state, &ref_codes.t().unwrap().unsqueeze(0).unwrap())
                .unwrap();
            let wav = dec.step(&mut state, &codes).unwrap();
            let cut = voice_clone_cut(r, r + frames, 1920);
            assert_eq!(cut as u64, case["cut"].as_u64().unwrap(), "{c}: the cut");
            let keep = r * 1920 - cut;
            let wav = Tensor::cat(&[seed.narrow(2, r * 1920 - keep, keep).unwrap(), wav], 2)
                .unwrap()
                .flatten_all()
                .unwrap();
            let e = max_abs_diff(&wav, &io[&format!("{c}.wav")]);
            assert!(e < 1e-4, "{c}: waveform {e}");
        }
    }

    #[test]
    fn bad_reference_clips_are_named() {
        let tts = load();
        let io = fixtures::io("icl");
        let ids = u32s(&io["icl_whole.input_ids"]);
        let clip = RefClip {
            xvector: io["icl_whole.xvector"].clone(),
            codes: Tensor::zeros((3, 4), DType::U32, &candle_core::Device::Cpu).unwrap(),
            ref_ids: u32s(&io["icl_whole.ref_ids"]),
        };
        let req = |clip: RefClip| SpeechRequest {
            input_ids: &ids,
            instruct_ids: None,
            voice: Voice::InContext(clip),
            language: "auto",
            non_streaming: false,
        };
        assert!(tts.prompt(&req(clip.clone())).is_ok());
        let err = tts
            .prompt(&req(RefClip {
                ref_ids: clip.ref_ids[..5].to_vec(),
                ..clip.clone()
            }))
            .unwrap_err();
        assert!(matches!(err, PromptError::EmptyRefText), "{err}");
        for codes in [
            Tensor::zeros((3, 2), DType::U32, &candle_core::Device::Cpu).unwrap(),
            Tensor::zeros((0, 4), DType::U32, &candle_core::Device::Cpu).unwrap(),
            Tensor::full(64u32, (3, 4), &candle_core::Device::Cpu).unwrap(),
            Tensor::full(-1i64, (3, 4), &candle_core::Device::Cpu).unwrap(),
        ] {
            let err = tts
                .prompt(&req(RefClip {
                    codes,
                    ..clip.clone()
                }))
                .unwrap_err();
            assert!(matches!(err, PromptError::BadRefCodes(_)), "{err}");
        }
    }

    #[test]
    fn bad_requests_are_named() {
        let tts = load();
        let ids = u32s(&fixtures::io("generate")["custom.input_ids"]);
        let req = |voice: Voice, language: &'static str| SpeechRequest {
            input_ids: &ids,
            instruct_ids: None,
            voice,
            language,
            non_streaming: true,
        };
        let err = tts
            .prompt(&req(Voice::Preset("nobody".into()), "auto"))
            .unwrap_err();
        assert!(
            matches!(err, PromptError::UnknownSpeaker(ref s) if s == "nobody"),
            "{err}"
        );
        let err = tts
            .prompt(&req(Voice::Preset("Vivian".into()), "klingon"))
            .unwrap_err();
        assert!(matches!(err, PromptError::UnknownLanguage(_)), "{err}");
        // A dialect is chosen through its speaker, never named directly.
        let err = tts
            .prompt(&req(Voice::Preset("vivian".into()), "sichuan_dialect"))
            .unwrap_err();
        assert!(matches!(err, PromptError::UnknownLanguage(_)), "{err}");
        let empty = &ids[..8];
        let err = tts
            .prompt(&SpeechRequest {
                input_ids: empty,
                ..req(Voice::Described, "auto")
            })
            .unwrap_err();
        assert!(matches!(err, PromptError::EmptyText), "{err}");
        // Names are matched in any case, as the reference does.
        assert!(tts
            .prompt(&req(Voice::Preset("VIVIAN".into()), "English"))
            .is_ok());
    }
}
