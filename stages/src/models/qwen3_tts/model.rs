//! A whole Qwen3-TTS checkpoint: the Talker with its prompts, the speaker
//! encoder and the speech tokenizer's encoder (Base), the speech tokenizer's
//! decoder and the text tokenizer, loaded once and shared by the engine's Talker
//! and Code2Wav stages.

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use super::codec::{load_decoder, CodecError};
use super::codec_encoder::{load_encoder, CodecEncoder, EncodeError};
use super::config::{ConfigError, ModelType, Qwen3TtsConfig, SpeechTokenizerConfig};
use super::speaker_encoder::SpeakerEncoder;
use super::talker::Qwen3TtsTalker;
use crate::models::qwen3_omni::code2wav::Code2Wav;
use crate::models::qwen3_omni::weights::{self, Progress};
use crate::models::ModelError;

/// Where the weights come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Weights {
    /// The checkpoint folder's safetensors (one file or shards with an index).
    Checkpoint,
    /// Random at the folder's configs (benchmarks at released shapes).
    Random,
}

/// Where qwen-tts's `generate_voice_clone` cuts the decode of a reference
/// clip's `ref_frames` codes followed by the generated ones (`total_frames` in
/// all, `samples_per_frame` samples each) to drop the clip's own audio:
/// `int(ref / total * samples)` in float64. That is `ref_frames *
/// samples_per_frame`, or one sample less where the product rounds below it
/// (15 ref frames of 26, for one; about 4% of pairs): the reference then keeps
/// the last sample of the clip's audio. So a streamed decoder seeded with the
/// ref's codes drops what it says for them but its last
/// `ref_frames * samples_per_frame - cut` samples (0 or 1).
pub fn voice_clone_cut(ref_frames: usize, total_frames: usize, samples_per_frame: usize) -> usize {
    let samples = (total_frames * samples_per_frame) as f64;
    (ref_frames as f64 / total_frames.max(1) as f64 * samples) as usize
}

/// A loaded Qwen3-TTS checkpoint.
pub struct Qwen3Tts {
    cfg: Qwen3TtsConfig,
    talker: Qwen3TtsTalker,
    cloning: Option<Arc<CloneEncoders>>,
    decoder: Code2Wav,
    codec_cfg: SpeechTokenizerConfig,
    device: Device,
}

impl From<ConfigError> for ModelError {
    fn from(e: ConfigError) -> Self {
        ModelError::Invalid(e.to_string())
    }
}

impl From<CodecError> for ModelError {
    fn from(e: CodecError) -> Self {
        ModelError::Invalid(e.to_string())
    }
}

impl From<EncodeError> for ModelError {
    fn from(e: EncodeError) -> Self {
        match e {
            EncodeError::Model(e) => ModelError::Candle(e),
            e => ModelError::Invalid(e.to_string()),
        }
    }
}

impl Qwen3Tts {
    /// Loads `dir` (`config.json`, the weights, `speech_tokenizer/`).
    pub fn load(
        dir: &Path,
        dtype: DType,
        device: &Device,
        source: Weights,
        progress: Option<Progress>,
    ) -> Result<Self, ModelError> {
        let cfg = Qwen3TtsConfig::load(dir)?;
        let (vb, decoder, codec_cfg) = match source {
            Weights::Checkpoint => {
                let vb = weights::from_checkpoint(dir, dtype, device, progress)?;
                let (decoder, codec_cfg) = load_decoder(dir, dtype, device)?;
                (vb, decoder, codec_cfg)
            }
            Weights::Random => {
                let codec_cfg = SpeechTokenizerConfig::load(dir)?;
                let vb = weights::random(dtype, device);
                let decoder = Code2Wav::new(&codec_cfg.decoder_config, vb.pp("decoder"))?;
                (vb, decoder, codec_cfg)
            }
        };
        let groups = cfg.talker_config.num_code_groups;
        if codec_cfg.decoder_config.num_quantizers != groups {
            return Err(ModelError::Invalid(format!(
                "the Talker makes {groups} codes a frame, the speech tokenizer decodes {}",
                codec_cfg.decoder_config.num_quantizers
            )));
        }
        let cloning = CloneEncoders::from_parts(dir, &cfg, &codec_cfg, &vb, source, device)?;
        Ok(Self {
            talker: Qwen3TtsTalker::new(&cfg, vb)?,
            cfg,
            cloning: cloning.map(Arc::new),
            decoder,
            codec_cfg,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &Qwen3TtsConfig {
        &self.cfg
    }

    pub fn talker(&self) -> &Qwen3TtsTalker {
        &self.talker
    }

    /// What clones voices: Base checkpoints only.
    pub fn clone_encoders(&self) -> Option<&Arc<CloneEncoders>> {
        self.cloning.as_ref()
    }

    /// Base checkpoints only.
    pub fn speaker_encoder(&self) -> Option<&SpeakerEncoder> {
        self.cloning.as_deref().map(CloneEncoders::speaker)
    }

    /// The speech tokenizer's encoder: a reference clip's codes for in-context
    /// cloning. Base checkpoints whose speech tokenizer ships it only.
    pub fn codec_encoder(&self) -> Option<&CodecEncoder> {
        self.cloning.as_deref().and_then(CloneEncoders::codec)
    }

    pub fn decoder(&self) -> &Code2Wav {
        &self.decoder
    }

    pub fn sample_rate(&self) -> u32 {
        self.codec_cfg.output_sample_rate
    }

    pub fn device(&self) -> &Device {
        &self.device
    }
}

/// What clones a voice from a reference clip, in a Base checkpoint: the
/// speaker encoder (the clip's x-vector) and the speech tokenizer's encoder
/// (its codes, for in-context cloning). Loaded with the model, or alone
/// ([`Self::load`]) where the Talker runs in another process and the server
/// encodes clips itself.
pub struct CloneEncoders {
    speaker: SpeakerEncoder,
    codec: Option<CodecEncoder>,
    /// The rate the speaker encoder hears (the codec encoder's too).
    sample_rate: u32,
    device: Device,
}

impl CloneEncoders {
    /// `dir`'s encoders, and none of the rest of the checkpoint (its weights
    /// are mapped, and only the encoders' are read); `None` where it is not
    /// a Base checkpoint.
    pub fn load(
        dir: &Path,
        dtype: DType,
        device: &Device,
        source: Weights,
    ) -> Result<Option<Self>, ModelError> {
        let cfg = Qwen3TtsConfig::load(dir)?;
        let codec_cfg = SpeechTokenizerConfig::load(dir)?;
        let vb = match source {
            Weights::Checkpoint => weights::from_checkpoint(dir, dtype, device, None)?,
            Weights::Random => weights::random(dtype, device),
        };
        Self::from_parts(dir, &cfg, &codec_cfg, &vb, source, device)
    }

    fn from_parts(
        dir: &Path,
        cfg: &Qwen3TtsConfig,
        codec_cfg: &SpeechTokenizerConfig,
        vb: &VarBuilder,
        source: Weights,
        device: &Device,
    ) -> Result<Option<Self>, ModelError> {
        // Only a Base checkpoint takes reference clips (qwen-tts refuses
        // `create_voice_clone_prompt` for the others).
        let (Some(se), ModelType::Base) = (&cfg.speaker_encoder_config, cfg.tts_model_type) else {
            return Ok(None);
        };
        let speaker = SpeakerEncoder::new(se, vb.pp("speaker_encoder"))?;
        // The codec encoder is kept in f32 whatever the model's dtype is (its
        // codes are argmins: see codec_encoder).
        let codec = match source {
            Weights::Checkpoint => load_encoder(dir, codec_cfg, device)?,
            Weights::Random if codec_cfg.encoder_config.is_some() => {
                let vb = weights::random(DType::F32, device).pp("encoder");
                Some(CodecEncoder::new(codec_cfg, vb)?)
            }
            Weights::Random => None,
        };
        let groups = cfg.talker_config.num_code_groups;
        if let Some(e) = &codec {
            if e.num_quantizers() != groups {
                return Err(ModelError::Invalid(format!(
                    "the Talker makes {groups} codes a frame, the speech tokenizer encodes {}",
                    e.num_quantizers()
                )));
            }
        }
        Ok(Some(Self {
            speaker,
            codec,
            sample_rate: se.sample_rate,
            device: device.clone(),
        }))
    }

    pub fn speaker(&self) -> &SpeakerEncoder {
        &self.speaker
    }

    /// Where the speech tokenizer ships its encoder.
    pub fn codec(&self) -> Option<&CodecEncoder> {
        self.codec.as_ref()
    }

    /// Where the encoders run.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The rate the encoders hear a clip at.
    pub fn sample_rate(&self) -> u32 {
        self.sample_rate
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::sampling::{Sampler, SamplingConfig};
    use crate::models::qwen3_tts::fixtures;
    use crate::models::qwen3_tts::talker::{Prompt, Voice};

    /// Random weights at a checkpoint's shapes (benchmarks at released shapes
    /// run this way): the whole path runs and the audio is finite.
    #[test]
    fn random_weights_speak_finite_audio() {
        let m = Qwen3Tts::load(
            &fixtures::model_dir(),
            DType::F32,
            &Device::Cpu,
            Weights::Random,
            None,
        )
        .unwrap();
        assert!(m.speaker_encoder().is_some(), "a Base checkpoint");
        let tts = m.talker();
        let Prompt { embeds, trailing } = tts
            .prompt_parts(
                &[1, 2, 3],
                &[10, 11, 12],
                None,
                &Voice::Preset("ryan".into()),
                "auto",
                false,
            )
            .unwrap();
        let talker = tts.talker();
        let (mut state, out) = talker.prefill(&embeds, None, None).unwrap();
        // Random weights may rank the end code first (it is no code of the
        // codebook): barred, as a request's first frames bar it.
        let mut suppress = talker.config().suppress_tokens();
        suppress.push(talker.config().codec_eos_token_id);
        let mut code0 = Sampler::new(SamplingConfig {
            suppress_tokens: suppress,
            ..SamplingConfig::greedy()
        });
        let mut cp = vec![Sampler::new(SamplingConfig::greedy())];
        let mut logits = out.logits;
        let mut frames = Vec::new();
        for f in 0..4 {
            let c0 = code0
                .sample(&logits.get(0).unwrap().to_vec1::<f32>().unwrap())
                .unwrap();
            let text = match f < trailing.dim(1).unwrap() {
                true => trailing.narrow(1, f, 1).unwrap(),
                false => tts.tts_pad().reshape((1, 1, ())).unwrap(),
            };
            let step = talker.step(&mut state, &[c0], &text, &mut cp).unwrap();
            frames.extend(step.codes[0].clone());
            logits = step.logits;
        }
        let groups = talker.config().num_code_groups;
        let codes = candle_core::Tensor::from_vec(frames, (1, 4, groups), &Device::Cpu)
            .unwrap()
            .transpose(1, 2)
            .unwrap();
        let wav = m.decoder().decode(&codes).unwrap().flatten_all().unwrap();
        let v = wav.to_vec1::<f32>().unwrap();
        assert_eq!(v.len(), 4 * 1920);
        assert!(v.iter().all(|x| x.is_finite()));
        let x = m
            .speaker_encoder()
            .unwrap()
            .embed_pcm(&vec![0.1; 24_000])
            .unwrap();
        assert!(x.to_vec1::<f32>().unwrap().iter().all(|v| v.is_finite()));
        let codes = m.codec_encoder().unwrap().encode(&vec![0.1; 5000]).unwrap();
        assert_eq!(codes.dims(), [3, groups]);
    }

    /// A Base checkpoint whose speech tokenizer ships no encoder weights loads,
    /// without the codec encoder; other checkpoints never load it.
    #[test]
    fn the_codec_encoder_is_loaded_where_it_is_shipped() {
        let dev = Device::Cpu;
        let load = |dir: &Path| Qwen3Tts::load(dir, DType::F32, &dev, Weights::Checkpoint, None);
        let m = load(&fixtures::model_dir()).unwrap();
        assert_eq!(m.codec_encoder().unwrap().num_quantizers(), 4);
        let design = load(&fixtures::dir().join("model_design")).unwrap();
        assert!(design.codec_encoder().is_none());

        let src = fixtures::model_dir();
        let tmp = tempfile::tempdir().unwrap();
        let st = tmp.path().join("speech_tokenizer");
        std::fs::create_dir(&st).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
        }
        std::fs::copy(
            src.join("speech_tokenizer/config.json"),
            st.join("config.json"),
        )
        .unwrap();
        let weights =
            candle_core::safetensors::load(src.join("speech_tokenizer/model.safetensors"), &dev)
                .unwrap();
        let decoder_only: std::collections::HashMap<_, _> = weights
            .into_iter()
            .filter(|(k, _)| !k.starts_with("encoder."))
            .collect();
        candle_core::safetensors::save(&decoder_only, st.join("model.safetensors")).unwrap();
        let m = load(tmp.path()).unwrap();
        assert!(m.speaker_encoder().is_some());
        assert!(m.codec_encoder().is_none());
    }

    /// The reference's cut is the ref's samples, or one less: the fixture's
    /// in-context cases have both.
    #[test]
    fn the_voice_clone_cut_is_the_references() {
        assert_eq!(voice_clone_cut(7, 18, 1920), 7 * 1920);
        assert_eq!(voice_clone_cut(38, 49, 1920), 38 * 1920);
        assert_eq!(voice_clone_cut(15, 26, 1920), 15 * 1920 - 1);
        assert_eq!(voice_clone_cut(0, 0, 1920), 0);
        let off = (1..=375)
            .flat_map(|r| (r..r + 2048).map(move |t| (r, t)))
            .filter(|&(r, t)| voice_clone_cut(r, t, 1920) != r * 1920)
            .inspect(|&(r, t)| assert_eq!(voice_clone_cut(r, t, 1920), r * 1920 - 1))
            .count();
        assert!(off > 0 && off < 375 * 2048 / 20, "{off}");
    }
}
