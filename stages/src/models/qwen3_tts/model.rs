//! A whole Qwen3-TTS checkpoint: the Talker with its prompts, the speaker
//! encoder (Base), the speech tokenizer's decoder and the text tokenizer, loaded
//! once and shared by the engine's Talker and Code2Wav stages.

use std::path::Path;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use super::codec::{load_decoder, CodecError};
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

/// A loaded Qwen3-TTS checkpoint.
pub struct Qwen3Tts {
    cfg: Qwen3TtsConfig,
    talker: Qwen3TtsTalker,
    speaker_encoder: Option<SpeakerEncoder>,
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
        Self::from_parts(cfg, vb, decoder, codec_cfg, device)
    }

    fn from_parts(
        cfg: Qwen3TtsConfig,
        vb: VarBuilder,
        decoder: Code2Wav,
        codec_cfg: SpeechTokenizerConfig,
        device: &Device,
    ) -> Result<Self, ModelError> {
        let groups = cfg.talker_config.num_code_groups;
        if codec_cfg.decoder_config.num_quantizers != groups {
            return Err(ModelError::Invalid(format!(
                "the Talker makes {groups} codes a frame, the speech tokenizer decodes {}",
                codec_cfg.decoder_config.num_quantizers
            )));
        }
        let talker = Qwen3TtsTalker::new(&cfg, vb.clone())?;
        let speaker_encoder = match (&cfg.speaker_encoder_config, cfg.tts_model_type) {
            (Some(se), ModelType::Base) => Some(SpeakerEncoder::new(se, vb.pp("speaker_encoder"))?),
            _ => None,
        };
        Ok(Self {
            cfg,
            talker,
            speaker_encoder,
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

    /// Base checkpoints only.
    pub fn speaker_encoder(&self) -> Option<&SpeakerEncoder> {
        self.speaker_encoder.as_ref()
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
        let mut code0 = Sampler::new(SamplingConfig {
            suppress_tokens: talker.config().suppress_tokens(),
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
    }
}
