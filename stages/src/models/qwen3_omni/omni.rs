//! The whole Qwen3-Omni model (`Qwen3OmniMoeForConditionalGeneration`): config,
//! loading, the Talker's prompt built from the Thinker's output exactly as the
//! reference builds it, and a non-streaming `generate` (Thinker -> Talker with
//! code predictor -> Code2Wav) that is the end-to-end proof against the
//! reference. The engine's stages stream the same pieces.

use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use candle_nn::{Module, VarBuilder};
use serde::Deserialize;

use super::audio_encoder::{
    feat_extract_output_lengths, AudioEncoder, AudioEncoderConfig, AudioFeatureExtractor,
};
use super::code2wav::{Code2Wav, Code2WavConfig};
use super::sampling::{Sampler, SamplingConfig};
use super::talker::{Talker, TalkerConfig, TtsEmbeds};
use super::thinker::{AudioEmbeds, Thinker, ThinkerCache, ThinkerConfig};
use super::weights::{self, Progress};
use crate::models::{ModelError, Result};

/// `Qwen3OmniMoeConfig` (`config.json` of the checkpoint).
#[derive(Debug, Clone)]
pub struct Qwen3OmniConfig {
    pub thinker: ThinkerConfig,
    /// `thinker_config.audio_config`.
    pub audio: AudioEncoderConfig,
    pub talker: TalkerConfig,
    pub code2wav: Code2WavConfig,
    pub ids: SpecialIds,
    pub enable_audio_output: bool,
}

/// The chat and tts token ids of the top-level config.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct SpecialIds {
    pub im_start_token_id: u32,
    pub im_end_token_id: u32,
    pub tts_pad_token_id: u32,
    pub tts_bos_token_id: u32,
    pub tts_eos_token_id: u32,
    pub system_token_id: u32,
    pub user_token_id: u32,
    pub assistant_token_id: u32,
}

fn default_true() -> bool {
    true
}

#[derive(Deserialize)]
struct RawConfig {
    thinker_config: serde_json::Value,
    talker_config: TalkerConfig,
    code2wav_config: Code2WavConfig,
    #[serde(flatten)]
    ids: SpecialIds,
    #[serde(default = "default_true")]
    enable_audio_output: bool,
}

impl Qwen3OmniConfig {
    pub fn from_value(v: serde_json::Value) -> std::result::Result<Self, serde_json::Error> {
        let raw: RawConfig = serde_json::from_value(v)?;
        let audio = serde_json::from_value(
            raw.thinker_config
                .get("audio_config")
                .cloned()
                .unwrap_or_default(),
        )?;
        Ok(Self {
            thinker: serde_json::from_value(raw.thinker_config)?,
            audio,
            talker: raw.talker_config,
            code2wav: raw.code2wav_config,
            ids: raw.ids,
            enable_audio_output: raw.enable_audio_output,
        })
    }

    /// Reads a checkpoint's `config.json` (transformers 4.57+ or 5.x layout).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let v = serde_json::from_str(&text).map_err(|e| ModelError::Format {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        Self::from_value(v).map_err(|e| ModelError::Format {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })
    }
}

/// One request for [`Qwen3Omni::generate`].
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The chat prompt, ending with `<|im_start|>assistant\n`; audio placeholders
    /// (`audio_token_id`, as many as the encoder makes of `audio`) where the audio goes.
    pub input_ids: Vec<u32>,
    /// 16 kHz mono PCM heard by the Thinker's audio encoder.
    pub audio: Option<Vec<f32>>,
    pub speaker: String,
    pub thinker_max_new_tokens: usize,
    /// As the reference's `talker_max_new_tokens`: code-0 tokens sampled, so at most
    /// one frame less is spoken.
    pub talker_max_new_tokens: usize,
    pub thinker_sampling: SamplingConfig,
    pub talker_sampling: SamplingConfig,
    pub code_predictor_sampling: SamplingConfig,
}

/// What [`Qwen3Omni::generate`] produced.
#[derive(Debug, Clone)]
pub struct GenerateOutput {
    /// The Thinker's new tokens (the end-of-turn token included when it came).
    pub tokens: Vec<u32>,
    /// One `num_code_groups` frame per 80 ms of speech.
    pub frames: Vec<Vec<u32>>,
    /// 24 kHz PCM, `frames.len() * 1920` samples (the first 555 are the causal
    /// decoder's lead-in; see `code2wav`).
    pub audio: Vec<f32>,
}

/// What the Thinker has produced that the Talker's prompt is built from.
pub struct ThinkerTrace<'a> {
    /// The prompt's ids.
    pub prompt: &'a [u32],
    /// Thinker input embeddings (`hidden_states[0]`) of the prompt and of every
    /// generated token fed back so far, `(n, thinker_hidden)`.
    pub embeds: &'a Tensor,
    /// The prompt's hidden states at `accept_hidden_layer`, `(prompt, thinker_hidden)`.
    pub hidden: &'a Tensor,
}

/// Which parts of the model a process builds. Each stage needs only its own:
/// a Thinker process holds no Talker, a Talker + Code2Wav process no Thinker
/// (about 60 GB of the 70 at the released shapes), so the stages can share one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Parts {
    /// The Thinker and its audio encoder.
    pub thinker: bool,
    /// The Talker with its code predictor (and the Thinker's three tts embeddings).
    pub talker: bool,
    pub code2wav: bool,
}

impl Parts {
    pub const ALL: Parts = Parts {
        thinker: true,
        talker: true,
        code2wav: true,
    };
    pub const NONE: Parts = Parts {
        thinker: false,
        talker: false,
        code2wav: false,
    };

    pub fn union(self, o: Parts) -> Parts {
        Parts {
            thinker: self.thinker || o.thinker,
            talker: self.talker || o.talker,
            code2wav: self.code2wav || o.code2wav,
        }
    }
}

pub struct Qwen3Omni {
    cfg: Qwen3OmniConfig,
    device: Device,
    thinker: Option<Thinker>,
    audio: Option<AudioEncoder>,
    features: AudioFeatureExtractor,
    talker: Option<Talker>,
    code2wav: Option<Code2Wav>,
    /// The Thinker's tts_bos / tts_eos / tts_pad through `text_projection`.
    tts: Option<TtsEmbeds>,
}

/// A part asked for that this process did not build.
fn missing(part: &str) -> ModelError {
    ModelError::Invalid(format!(
        "qwen3-omni: the {part} was not loaded in this process (a stage process builds only its own stages' parts)"
    ))
}

impl Qwen3Omni {
    /// `vb` is the checkpoint's root (`thinker.`, `talker.`, `code2wav.` below it).
    pub fn new(cfg: &Qwen3OmniConfig, vb: VarBuilder) -> Result<Self> {
        Self::new_parts(cfg, vb, Parts::ALL)
    }

    /// Only `parts` of the model (the others' weights are never read).
    pub fn new_parts(cfg: &Qwen3OmniConfig, vb: VarBuilder, parts: Parts) -> Result<Self> {
        if !cfg.enable_audio_output {
            return Err(ModelError::Invalid(
                "qwen3-omni: this checkpoint has no Talker (enable_audio_output is false)".into(),
            ));
        }
        let device = vb.device().clone();
        let thinker = match parts.thinker {
            true => Some(Thinker::new(&cfg.thinker, vb.pp("thinker"))?),
            false => None,
        };
        let audio = match parts.thinker {
            true => Some(AudioEncoder::new(
                &cfg.audio,
                vb.pp("thinker").pp("audio_tower"),
            )?),
            false => None,
        };
        let (talker, tts) = match parts.talker {
            true => {
                let talker = Talker::new(&cfg.talker, vb.pp("talker"))?;
                let ids = &cfg.ids;
                let tts_ids = Tensor::new(
                    &[[
                        ids.tts_bos_token_id,
                        ids.tts_eos_token_id,
                        ids.tts_pad_token_id,
                    ]],
                    &device,
                )?;
                let embeds = match &thinker {
                    Some(t) => t.embed_tokens(&tts_ids)?,
                    // Without the Thinker, only its embedding table is read.
                    None => {
                        let tc = &cfg.thinker.text_config;
                        candle_nn::embedding(
                            tc.vocab_size,
                            tc.hidden_size,
                            vb.pp("thinker").pp("model").pp("embed_tokens"),
                        )?
                        .forward(&tts_ids)?
                    }
                };
                let tts = talker.tts_embeds(&embeds.squeeze(0)?)?;
                (Some(talker), Some(tts))
            }
            false => (None, None),
        };
        let code2wav = match parts.code2wav {
            true => Some(Code2Wav::new(&cfg.code2wav, vb.pp("code2wav"))?),
            false => None,
        };
        Ok(Self {
            features: AudioFeatureExtractor::new(cfg.audio.num_mel_bins)?,
            device,
            thinker,
            audio,
            talker,
            code2wav,
            tts,
            cfg: cfg.clone(),
        })
    }

    /// A downloaded checkpoint folder: `config.json` and its safetensors shards.
    pub fn load(
        dir: &Path,
        dtype: DType,
        device: &Device,
        progress: Option<Progress>,
    ) -> Result<Self> {
        Self::load_parts(dir, dtype, device, progress, Parts::ALL)
    }

    /// [`Self::load`] of `parts` only.
    pub fn load_parts(
        dir: &Path,
        dtype: DType,
        device: &Device,
        progress: Option<Progress>,
        parts: Parts,
    ) -> Result<Self> {
        let cfg = Qwen3OmniConfig::from_file(&dir.join("config.json"))?;
        let vb = weights::from_checkpoint(dir, dtype, device, progress)?;
        Self::new_parts(&cfg, vb, parts)
    }

    /// Random weights at `cfg`'s shapes (benchmarks without the checkpoint).
    pub fn random(cfg: &Qwen3OmniConfig, dtype: DType, device: &Device) -> Result<Self> {
        Self::random_parts(cfg, dtype, device, Parts::ALL)
    }

    /// [`Self::random`] of `parts` only.
    pub fn random_parts(
        cfg: &Qwen3OmniConfig,
        dtype: DType,
        device: &Device,
        parts: Parts,
    ) -> Result<Self> {
        Self::new_parts(cfg, weights::random(dtype, device), parts)
    }

    pub fn config(&self) -> &Qwen3OmniConfig {
        &self.cfg
    }
    /// The device every part lives on.
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The parts this process built.
    pub fn parts(&self) -> Parts {
        Parts {
            thinker: self.thinker.is_some(),
            talker: self.talker.is_some(),
            code2wav: self.code2wav.is_some(),
        }
    }
    pub fn thinker(&self) -> Result<&Thinker> {
        self.thinker.as_ref().ok_or_else(|| missing("Thinker"))
    }
    pub fn talker(&self) -> Result<&Talker> {
        self.talker.as_ref().ok_or_else(|| missing("Talker"))
    }
    pub fn code2wav(&self) -> Result<&Code2Wav> {
        self.code2wav.as_ref().ok_or_else(|| missing("Code2Wav"))
    }

    /// The audio encoder's embeddings of 16 kHz PCM, `(tokens, thinker_hidden)`, and
    /// the mel frame count.
    pub fn hear(&self, pcm: &[f32]) -> Result<(Tensor, usize)> {
        let (embeds, frames) = self.hear_all(&[pcm])?;
        Ok((embeds, frames[0]))
    }

    /// [`Self::hear`] for several turns in one pass of the audio encoder:
    /// their embeddings one after another, and each turn's mel frames. Each
    /// turn encodes exactly as it would alone (`forward_independent`).
    pub fn hear_all(&self, pcms: &[&[f32]]) -> Result<(Tensor, Vec<usize>)> {
        let audio = self
            .audio
            .as_ref()
            .ok_or_else(|| missing("audio encoder"))?;
        let mels = pcms
            .iter()
            .map(|pcm| self.features.extract(pcm, &self.device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let frames = mels
            .iter()
            .map(|m| m.dim(1))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let embeds = audio.forward_independent(&Tensor::cat(&mels, 1)?, &frames)?;
        Ok((embeds, frames))
    }

    /// How many audio placeholders `samples` of 16 kHz PCM take in a prompt.
    pub fn audio_tokens(&self, samples: usize) -> usize {
        feat_extract_output_lengths(
            AudioFeatureExtractor::frames(samples),
            self.cfg.audio.n_window,
        )
    }

    /// The Talker prompt, as the reference's `generate` builds it from the Thinker's
    /// output: the user turns (text through `text_projection`, audio/image/video
    /// positions' `accept_hidden_layer` states through `hidden_projection`), then the
    /// assistant turn's opening (3 text positions, 4 tts_pad, tts_bos + first text
    /// token over the codec's think/speaker/pad/bos ids). `trace.embeds` must
    /// hold at least the first generated token; the later ones are the Talker's
    /// trailing text ([`Self::text_vectors`]).
    pub fn talker_prompt(&self, trace: &ThinkerTrace, speaker: u32) -> Result<Tensor> {
        let ids = &self.cfg.ids;
        let prompt = trace.prompt;
        let l = prompt.len();
        let n = trace.embeds.dim(0)?;
        if n < l + 1 || trace.hidden.dim(0)? != l {
            return Err(ModelError::Invalid(format!(
                "talker prompt: {n} embeddings and {} hidden states for a {l}-token prompt",
                trace.hidden.dim(0)?
            )));
        }
        let assistant = (0..l.saturating_sub(1))
            .rev()
            .find(|&i| {
                prompt[i] == ids.im_start_token_id && prompt[i + 1] == ids.assistant_token_id
            })
            .ok_or_else(|| {
                ModelError::Invalid("talker prompt: no <|im_start|>assistant in the prompt".into())
            })?;
        // A position belongs to the turn whose <|im_start|> precedes it; the role is the
        // token after that (position 0's role token when no turn has started).
        let mut user = Vec::new();
        let mut start = 0usize;
        for (i, &t) in prompt.iter().enumerate() {
            if t == ids.im_start_token_id {
                start = i;
            }
            if prompt[(start + 1).min(l - 1)] == ids.user_token_id {
                user.push(i as u32);
            }
        }
        let dev = trace.embeds.device();
        let th = &self.cfg.thinker;
        let mm: Vec<u32> = prompt
            .iter()
            .map(|&t| {
                u32::from(
                    t == th.audio_token_id || t == th.image_token_id || t == th.video_token_id,
                )
            })
            .collect();
        let mut parts = Vec::new();
        if !user.is_empty() {
            let idx = Tensor::from_vec(user.clone(), user.len(), dev)?;
            let embeds = trace.embeds.narrow(0, 0, l)?.index_select(&idx, 0)?;
            let hidden = trace.hidden.index_select(&idx, 0)?;
            let mm = Tensor::from_vec(
                user.iter().map(|&i| mm[i as usize]).collect::<Vec<u32>>(),
                (1, user.len()),
                dev,
            )?;
            parts.push(self.talker()?.user_part(
                &embeds.unsqueeze(0)?,
                &hidden.unsqueeze(0)?,
                &mm,
            )?);
        }
        let (head, _) = self.talker()?.assistant_part(
            &trace.embeds.narrow(0, assistant, 4)?.unsqueeze(0)?,
            &[speaker],
            self.tts()?,
        )?;
        parts.push(head);
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// The tts_bos / tts_eos / tts_pad vectors in the Talker's width.
    pub fn tts(&self) -> Result<&TtsEmbeds> {
        self.tts.as_ref().ok_or_else(|| missing("Talker"))
    }

    /// The Talker's text vectors `(n, talker_hidden)` for generated tokens' Thinker
    /// embeddings `(n, thinker_hidden)`: fed one per frame after the prompt, then
    /// `tts().eos` once the text has ended, then `tts().pad`.
    pub fn text_vectors(&self, embeds: &Tensor) -> Result<Tensor> {
        Ok(self.talker()?.text_projection(embeds)?)
    }

    /// One request end to end, not streamed: the reference's `generate` with the
    /// same sampling settings (greedy everywhere gives its exact tokens, codes and
    /// waveform).
    pub fn generate(&self, req: &GenerateRequest) -> Result<GenerateOutput> {
        let tc = &self.cfg.talker;
        let dev = self.device.clone();
        let (thinker, talker, code2wav, tts) = (
            self.thinker()?,
            self.talker()?,
            self.code2wav()?,
            self.tts()?,
        );
        let speaker = tc
            .speaker(&req.speaker)
            .ok_or_else(|| ModelError::Invalid(format!("unknown voice {:?}", req.speaker)))?;
        let heard = match &req.audio {
            Some(pcm) => Some(self.hear(pcm)?),
            None => None,
        };
        let frames_in;
        let audio = match &heard {
            Some((embeds, frames)) => {
                frames_in = [*frames];
                Some(AudioEmbeds {
                    embeds,
                    feature_lengths: &frames_in,
                })
            }
            None => None,
        };
        // 1. Thinker: prefill, then one token at a time; every token fed back adds its
        //    embedding (hidden_states[0]) to the trace the Talker reads.
        let l = req.input_ids.len();
        let accept = tc.accept_hidden_layer;
        let mut cache: ThinkerCache = thinker.new_cache();
        let ids = Tensor::from_vec(req.input_ids.clone(), (1, l), &dev)?;
        let out = thinker.prefill(&ids, None, audio, &mut cache, &[0, accept])?;
        let mut embeds = vec![out.hidden_states[0].squeeze(0)?];
        let hidden = out.hidden_states[1].squeeze(0)?;
        let mut logits = out.logits.get(0)?.get(l - 1)?;
        let mut sampler = Sampler::new(req.thinker_sampling.clone());
        let eos = self.cfg.ids.im_end_token_id;
        let mut tokens = Vec::new();
        loop {
            let t = sampler.sample_tensor(&logits)?;
            tokens.push(t);
            if t == eos || tokens.len() >= req.thinker_max_new_tokens {
                break;
            }
            let step = thinker.step(&Tensor::from_vec(vec![t], (1, 1), &dev)?, &mut cache, &[0])?;
            embeds.push(step.hidden_states[0].squeeze(0)?);
            logits = step.logits.get(0)?.get(0)?;
        }
        let embeds = Tensor::cat(&embeds, 0)?;
        if embeds.dim(0)? < l + 1 {
            // One token (its end, or a budget of one): nothing to say.
            return Ok(GenerateOutput {
                tokens,
                frames: Vec::new(),
                audio: Vec::new(),
            });
        }
        // 2. Talker prompt.
        let prompt = self.talker_prompt(
            &ThinkerTrace {
                prompt: &req.input_ids,
                embeds: &embeds,
                hidden: &hidden,
            },
            speaker,
        )?;
        // The trailing text: every generated token fed back after the first, then
        // tts_eos. The token the Thinker ended on (end of turn, or the last of its
        // budget) is never fed back, so never spoken, as in the reference.
        let trailing = Tensor::cat(
            &[
                self.text_vectors(&embeds.narrow(0, l + 1, embeds.dim(0)? - l - 1)?)?,
                tts.eos.unsqueeze(0)?,
            ],
            0,
        )?;
        // 3. Talker + code predictor, frame by frame.
        let (mut state, out) = talker.prefill(&prompt, None, None)?;
        let mut code0_sampler = Sampler::new(req.talker_sampling.clone());
        let mut cp = [Sampler::new(req.code_predictor_sampling.clone())];
        let mut logits = out.logits.get(0)?;
        let mut frames = Vec::new();
        let hs = trailing.dim(D::Minus1)?;
        for f in 0..req.talker_max_new_tokens {
            let code0 = code0_sampler.sample_tensor(&logits)?;
            if code0 == tc.codec_eos_token_id || f + 1 == req.talker_max_new_tokens {
                break;
            }
            let text = if f < trailing.dim(0)? {
                trailing.narrow(0, f, 1)?
            } else {
                tts.pad.reshape((1, hs))?
            };
            let step = talker.step(&mut state, &[code0], &text.unsqueeze(0)?, &mut cp)?;
            frames.extend(step.codes);
            logits = step.logits.get(0)?;
        }
        // 4. Code2Wav.
        let audio = if frames.is_empty() {
            Vec::new()
        } else {
            let (n, g) = (frames.len(), frames[0].len());
            let flat: Vec<u32> = frames.iter().flatten().copied().collect();
            let codes = Tensor::from_vec(flat, (1, n, g), &dev)?.transpose(1, 2)?;
            code2wav
                .decode(&codes)?
                .flatten_all()?
                .to_dtype(DType::F32)?
                .to_vec1()?
        };
        Ok(GenerateOutput {
            tokens,
            frames,
            audio,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures::{self, max_abs_diff};

    fn model() -> Qwen3Omni {
        let cfg = Qwen3OmniConfig::from_value(fixtures::config()).unwrap();
        Qwen3Omni::new(&cfg, fixtures::weights()).unwrap()
    }

    fn ids(t: &Tensor) -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::U32)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// A process building only some parts: the others are never read and say so
    /// when asked for, and a Talker without its Thinker still gets the Thinker's
    /// exact tts embeddings (read from its embedding table alone).
    #[test]
    fn parts_build_alone_and_agree_with_the_whole_model() {
        let whole = model();
        let cfg = Qwen3OmniConfig::from_value(fixtures::config()).unwrap();
        let audio_side = Parts {
            thinker: false,
            ..Parts::ALL
        };
        let m = Qwen3Omni::new_parts(&cfg, fixtures::weights(), audio_side).unwrap();
        assert_eq!(m.parts(), audio_side);
        let Err(e) = m.thinker() else {
            panic!("no Thinker was built")
        };
        let e = e.to_string();
        assert!(e.contains("Thinker was not loaded"), "{e}");
        assert!(m.hear(&[0.0; 16_000]).is_err());
        for (a, b) in [
            (&m.tts().unwrap().bos, &whole.tts().unwrap().bos),
            (&m.tts().unwrap().eos, &whole.tts().unwrap().eos),
            (&m.tts().unwrap().pad, &whole.tts().unwrap().pad),
        ] {
            assert_eq!(max_abs_diff(a, b), 0.0);
        }
        let thinker_only = Parts {
            thinker: true,
            ..Parts::NONE
        };
        let t = Qwen3Omni::new_parts(&cfg, fixtures::weights(), thinker_only).unwrap();
        assert!(t.talker().is_err() && t.code2wav().is_err() && t.tts().is_err());
        assert_eq!(t.audio_tokens(16_000), whole.audio_tokens(16_000));
    }

    /// Several spoken turns heard in one pass: each one's embeddings are
    /// exactly what it gets alone (a long turn and two short ones, whose chunks
    /// would pad differently together).
    #[test]
    fn turns_heard_together_are_heard_as_alone() {
        let m = model();
        let tone = |n: usize, f: f32| -> Vec<f32> {
            (0..n)
                .map(|i| 0.3 * (i as f32 * f * std::f32::consts::TAU / 16_000.0).sin())
                .collect()
        };
        let turns = [tone(40_000, 220.0), tone(9_000, 440.0), tone(16_000, 330.0)];
        let pcms: Vec<&[f32]> = turns.iter().map(Vec::as_slice).collect();
        let (together, frames) = m.hear_all(&pcms).unwrap();
        let mut row = 0;
        for (pcm, &f) in pcms.iter().zip(&frames) {
            let (alone, alone_frames) = m.hear(pcm).unwrap();
            assert_eq!(alone_frames, f);
            let n = alone.dim(0).unwrap();
            let part = together.narrow(0, row, n).unwrap();
            assert_eq!(max_abs_diff(&part, &alone), 0.0);
            row += n;
        }
        assert_eq!(row, together.dim(0).unwrap());
    }

    /// The whole model against the reference's `generate` (greedy Thinker, Talker
    /// and code predictor): the same tokens, every code of every frame, and the
    /// same waveform (ours lags by the causal decoder's 555-sample lead-in and has
    /// exactly frames x 1920 samples).
    #[test]
    fn generate_matches_the_reference_end_to_end() {
        let m = model();
        let io = fixtures::io("generate");
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures::dir().join("generate/io.json")).unwrap(),
        )
        .unwrap();
        let cases = meta["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 3);
        let tc = &m.config().talker;
        for (i, case) in cases.iter().enumerate() {
            let p = format!("c{i}_");
            let input_ids = ids(&io[&format!("{p}input_ids")]);
            let audio = io
                .get(&format!("{p}pcm"))
                .map(|t| t.to_vec1::<f32>().unwrap());
            let greedy = SamplingConfig::greedy();
            let req = GenerateRequest {
                input_ids: input_ids.clone(),
                audio,
                speaker: case["speaker"].as_str().unwrap().to_string(),
                thinker_max_new_tokens: 32,
                talker_max_new_tokens: 33,
                thinker_sampling: greedy.clone(),
                talker_sampling: SamplingConfig {
                    repetition_penalty: 1.05,
                    suppress_tokens: tc.suppress_tokens(),
                    ..SamplingConfig::greedy()
                },
                code_predictor_sampling: greedy,
            };
            let out = m.generate(&req).unwrap();
            let seq = ids(&io[&format!("{p}sequences")]);
            assert_eq!(out.tokens, seq[input_ids.len()..], "case {i} tokens");
            let codes = io[&format!("{p}codes")].squeeze(0).unwrap(); // (groups, frames)
            let want: Vec<Vec<u32>> = ids(&codes.t().unwrap().contiguous().unwrap())
                .chunks(codes.dim(0).unwrap())
                .map(|c| c.to_vec())
                .collect();
            assert_eq!(out.frames, want, "case {i} codes");
            let wav = &io[&format!("{p}wav")];
            let n = out.frames.len() * 1920;
            assert_eq!(out.audio.len(), n);
            let lead = m.code2wav().unwrap().delay_samples();
            assert!(out.audio[..lead].iter().all(|&x| x == 0.0));
            let ours = Tensor::new(&out.audio[lead..], &Device::Cpu).unwrap();
            let e = max_abs_diff(&ours, wav);
            let peak = wav
                .abs()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            println!(
                "case {i} ({}): {} tokens, {} frames, waveform max abs {e:.2e} (peak {peak:.3})",
                case["speaker"],
                out.tokens.len(),
                out.frames.len()
            );
            assert!(peak > 0.01, "silent reference");
            assert!(e <= 1e-4, "case {i}: {e}");
        }
    }

    fn request(m: &Qwen3Omni, case: usize, tokens: usize, frames: usize) -> GenerateRequest {
        let io = fixtures::io("generate");
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures::dir().join("generate/io.json")).unwrap(),
        )
        .unwrap();
        let greedy = SamplingConfig::greedy();
        GenerateRequest {
            input_ids: ids(&io[&format!("c{case}_input_ids")]),
            audio: io
                .get(&format!("c{case}_pcm"))
                .map(|t| t.to_vec1::<f32>().unwrap()),
            speaker: meta["cases"][case]["speaker"].as_str().unwrap().into(),
            thinker_max_new_tokens: tokens,
            talker_max_new_tokens: frames,
            thinker_sampling: greedy.clone(),
            talker_sampling: SamplingConfig {
                suppress_tokens: m.config().talker.suppress_tokens(),
                ..greedy.clone()
            },
            code_predictor_sampling: greedy,
        }
    }

    /// The checkpoint in bf16 runs every component (audio in included) and stays
    /// close to f32: the Thinker's first logits within bf16's precision.
    #[test]
    fn bf16_runs_close_to_f32() {
        let cfg = Qwen3OmniConfig::from_value(fixtures::config()).unwrap();
        let dir = fixtures::dir().join("model");
        let bf16 = Qwen3Omni::load(&dir, DType::BF16, &Device::Cpu, None).unwrap();
        let f32m = model();
        let prompt = ids(&fixtures::io("generate")["c0_input_ids"]);
        let x = Tensor::new(prompt.as_slice(), &Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let logits = |m: &Qwen3Omni| {
            let mut cache = m.thinker().unwrap().new_cache();
            m.thinker()
                .unwrap()
                .prefill(&x, None, None, &mut cache, &[])
                .unwrap()
                .logits
        };
        let (a, b) = (logits(&bf16), logits(&f32m));
        let peak = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let peak = peak.to_scalar::<f32>().unwrap();
        let e = max_abs_diff(&a, &b);
        println!("bf16 vs f32 Thinker logits: max abs {e:.3} (peak {peak:.2})");
        assert!(e < 0.05 * peak, "{e} vs peak {peak}");
        for case in [0, 2] {
            let out = bf16.generate(&request(&bf16, case, 6, 8)).unwrap();
            assert_eq!(out.tokens.len(), 6);
            assert_eq!(out.frames.len(), 7);
            assert_eq!(out.audio.len(), 7 * 1920);
            assert!(out.audio.iter().all(|x| x.is_finite()));
            assert!(out.audio.iter().any(|&x| x != 0.0));
        }
        assert_eq!(cfg.code2wav.samples_per_frame(), 1920);
    }

    /// Random weights at any config run the same code: the tiny config here, and
    /// the released widths (one layer each, so it fits a CI machine).
    #[test]
    fn random_weights_run_at_any_config() {
        let cfg = Qwen3OmniConfig::from_value(fixtures::config()).unwrap();
        let m = Qwen3Omni::random(&cfg, DType::F32, &Device::Cpu).unwrap();
        // Random weights (unseeded on the CPU) may draw an end early: barred,
        // so the lengths are the budgets.
        let mut req = request(&m, 2, 3, 3);
        req.thinker_sampling.suppress_tokens = vec![cfg.ids.im_end_token_id];
        req.talker_sampling
            .suppress_tokens
            .push(cfg.talker.codec_eos_token_id);
        let out = m.generate(&req).unwrap();
        assert_eq!(
            (out.tokens.len(), out.frames.len(), out.audio.len()),
            (3, 2, 2 * 1920)
        );

        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/qwen3_omni_moe/config.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        v["thinker_config"]["text_config"]["num_hidden_layers"] = 1.into();
        v["thinker_config"]["audio_config"]["encoder_layers"] = 1.into();
        v["talker_config"]["text_config"]["num_hidden_layers"] = 1.into();
        v["talker_config"]["accept_hidden_layer"] = 1.into();
        v["talker_config"]["code_predictor_config"]["num_hidden_layers"] = 1.into();
        v["code2wav_config"]["num_hidden_layers"] = 1.into();
        let real = Qwen3OmniConfig::from_value(v).unwrap();
        let m = Qwen3Omni::random(&real, DType::BF16, &Device::Cpu).unwrap();
        let ids = &real.ids;
        let input_ids = vec![
            ids.im_start_token_id,
            ids.user_token_id,
            198,
            9707,
            ids.im_end_token_id,
            198,
            ids.im_start_token_id,
            ids.assistant_token_id,
            198,
        ];
        let greedy = SamplingConfig::greedy();
        let out = m
            .generate(&GenerateRequest {
                input_ids,
                audio: None,
                speaker: "chelsie".into(),
                thinker_max_new_tokens: 3,
                talker_max_new_tokens: 3,
                thinker_sampling: SamplingConfig {
                    suppress_tokens: vec![ids.im_end_token_id],
                    ..greedy.clone()
                },
                talker_sampling: SamplingConfig {
                    suppress_tokens: [
                        real.talker.suppress_tokens(),
                        vec![real.talker.codec_eos_token_id],
                    ]
                    .concat(),
                    ..greedy.clone()
                },
                code_predictor_sampling: greedy,
            })
            .unwrap();
        assert_eq!(out.tokens.len(), 3);
        assert_eq!(out.frames.len(), 2);
        assert!(out
            .frames
            .iter()
            .all(|f| f.len() == 16 && f.iter().all(|&c| c < 2048)));
        assert_eq!(out.audio.len(), 2 * 1920);
    }

    /// Not a test: our `generate` on the fixture cases, beside
    /// scripts/qwen3_omni/bench_reference.py (docs/bench/qwen3_omni.md).
    #[test]
    #[ignore]
    fn bench_generate() {
        let m = model();
        for case in 0..3 {
            let req = GenerateRequest {
                talker_sampling: SamplingConfig {
                    repetition_penalty: 1.05,
                    suppress_tokens: m.config().talker.suppress_tokens(),
                    ..SamplingConfig::greedy()
                },
                ..request(&m, case, 20, 24)
            };
            let mut times = Vec::new();
            for _ in 0..6 {
                let t0 = std::time::Instant::now();
                let out = m.generate(&req).unwrap();
                times.push(t0.elapsed().as_secs_f64() * 1e3);
                assert_eq!(out.frames.len(), 23);
            }
            let mut t = times[1..].to_vec();
            t.sort_by(f64::total_cmp);
            println!(
                "omnistream generate, case {case}: median {:.1} ms over 5",
                t[2]
            );
        }
    }

    #[test]
    fn released_config_parses_at_real_shapes() {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/qwen3_omni_moe/config.json");
        let cfg = Qwen3OmniConfig::from_file(&path).unwrap();
        let t = &cfg.thinker.text_config;
        assert_eq!(
            (t.hidden_size, t.num_hidden_layers, t.num_experts),
            (2048, 48, 128)
        );
        assert_eq!(t.mrope_section(), Some(vec![24, 20, 20]));
        assert_eq!(cfg.talker.text_config.num_experts_per_tok, 6);
        assert_eq!(cfg.talker.speaker("Ethan"), Some(2302));
        assert_eq!(cfg.audio.d_model, 1280);
        assert_eq!(cfg.code2wav.samples_per_frame(), 1920);
        assert_eq!(cfg.code2wav.delay_samples(), 555);
    }
}
