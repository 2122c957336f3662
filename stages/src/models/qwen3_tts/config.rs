//! Qwen3-TTS's config.json (`Qwen3TTSConfig` of qwen-tts) and its speech
//! tokenizer's (`speech_tokenizer/config.json`, `Qwen3TTSTokenizerV2Config`).

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use super::codec_encoder::CodecEncoderConfig;
use crate::models::qwen3_omni::code2wav::{Code2WavConfig, Code2WavVariant};
use crate::models::qwen3_omni::code_predictor::CodePredictorConfig;
use crate::models::qwen3_omni::layers::DecoderConfig;
use crate::models::qwen3_omni::talker::{TalkerConfig, TalkerVariant};

/// A checkpoint file that could not be read or understood.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {source}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("{path}: {msg}")]
    Invalid { path: String, msg: String },
}

pub(crate) fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let p = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: p.clone(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ConfigError::Parse { path: p, source })
}

/// A codec id written either as a number or as a one-element list (both are
/// embedded the same way by the reference).
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum CodecId {
    One(u32),
    List(Vec<u32>),
}

impl CodecId {
    pub fn id(&self) -> Option<u32> {
        match self {
            Self::One(i) => Some(*i),
            Self::List(l) => l.first().copied(),
        }
    }
}

/// `Qwen3TTSTalkerConfig`: a dense Qwen3 decoder's fields, the code predictor,
/// and the codec's control ids, speakers and languages.
#[derive(Debug, Clone, Deserialize)]
pub struct TtsTalkerConfig {
    #[serde(flatten)]
    pub decoder: DecoderConfig,
    pub code_predictor_config: CodePredictorConfig,
    pub num_code_groups: usize,
    pub text_hidden_size: usize,
    pub text_vocab_size: usize,
    pub codec_eos_token_id: u32,
    pub codec_think_id: u32,
    pub codec_nothink_id: u32,
    pub codec_think_bos_id: u32,
    pub codec_think_eos_id: u32,
    pub codec_pad_id: u32,
    pub codec_bos_id: u32,
    /// Preset speaker (lower case) -> codec id (CustomVoice checkpoints).
    #[serde(default)]
    pub spk_id: HashMap<String, CodecId>,
    /// Preset speaker -> `false`, or the dialect (a `codec_language_id` key) it speaks.
    #[serde(default)]
    pub spk_is_dialect: HashMap<String, serde_json::Value>,
    /// Language (lower case) -> codec id.
    #[serde(default)]
    pub codec_language_id: HashMap<String, u32>,
}

/// `Qwen3TTSSpeakerEncoderConfig` (ECAPA-TDNN; Base checkpoints). The released
/// Base configs write only `enc_dim` and `sample_rate`: the rest are the
/// reference class's defaults.
#[derive(Debug, Clone, Deserialize)]
pub struct SpeakerEncoderConfig {
    #[serde(default = "d_mel")]
    pub mel_dim: usize,
    pub enc_dim: usize,
    #[serde(default = "d_channels")]
    pub enc_channels: Vec<usize>,
    #[serde(default = "d_kernel_sizes")]
    pub enc_kernel_sizes: Vec<usize>,
    #[serde(default = "d_dilations")]
    pub enc_dilations: Vec<usize>,
    #[serde(default = "d_128")]
    pub enc_attention_channels: usize,
    #[serde(default = "d_res2net_scale")]
    pub enc_res2net_scale: usize,
    #[serde(default = "d_128")]
    pub enc_se_channels: usize,
    #[serde(default = "d_rate")]
    pub sample_rate: u32,
}

fn d_mel() -> usize {
    128
}
fn d_rate() -> u32 {
    24000
}
fn d_channels() -> Vec<usize> {
    vec![512, 512, 512, 512, 1536]
}
fn d_kernel_sizes() -> Vec<usize> {
    vec![5, 3, 3, 3, 1]
}
fn d_dilations() -> Vec<usize> {
    vec![1, 2, 3, 4, 1]
}
fn d_128() -> usize {
    128
}
fn d_res2net_scale() -> usize {
    8
}

/// What a checkpoint was trained for (`tts_model_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ModelType {
    /// Voice cloning from a reference clip (has the speaker encoder).
    Base,
    /// Preset speakers, with style instructions (1.7B).
    CustomVoice,
    /// A voice described in words.
    VoiceDesign,
}

/// `Qwen3TTSConfig`.
#[derive(Debug, Clone, Deserialize)]
pub struct Qwen3TtsConfig {
    pub talker_config: TtsTalkerConfig,
    #[serde(default)]
    pub speaker_encoder_config: Option<SpeakerEncoderConfig>,
    pub tts_model_type: ModelType,
    #[serde(default)]
    pub tts_model_size: Option<String>,
    #[serde(default)]
    pub tokenizer_type: Option<String>,
    pub im_start_token_id: u32,
    pub im_end_token_id: u32,
    pub tts_pad_token_id: u32,
    pub tts_bos_token_id: u32,
    pub tts_eos_token_id: u32,
}

impl Qwen3TtsConfig {
    /// `config.json` of a checkpoint folder.
    pub fn load(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("config.json");
        let cfg: Self = read_json(&path)?;
        let invalid = |msg: String| ConfigError::Invalid {
            path: path.display().to_string(),
            msg,
        };
        if let Some(t) = cfg.tokenizer_type.as_deref() {
            if t != "qwen3_tts_tokenizer_12hz" {
                return Err(invalid(format!(
                    "tokenizer_type {t}: only the 12 Hz tokenizer is supported"
                )));
            }
        }
        let t = &cfg.talker_config;
        if t.code_predictor_config.num_code_groups != t.num_code_groups {
            return Err(invalid(
                "num_code_groups differs from the code predictor's".into(),
            ));
        }
        if cfg.tts_model_type == ModelType::Base && cfg.speaker_encoder_config.is_none() {
            return Err(invalid(
                "a Base checkpoint needs speaker_encoder_config".into(),
            ));
        }
        Ok(cfg)
    }

    /// The engine's Talker config for these shapes (the Qwen3-Omni Talker's
    /// frame loop with Qwen3-TTS's layers).
    pub fn talker(&self) -> TalkerConfig {
        let t = &self.talker_config;
        TalkerConfig {
            text_config: t.decoder.clone(),
            code_predictor_config: t.code_predictor_config.clone(),
            num_code_groups: t.num_code_groups,
            thinker_hidden_size: t.text_hidden_size,
            accept_hidden_layer: 0,
            codec_eos_token_id: t.codec_eos_token_id,
            codec_nothink_id: t.codec_nothink_id,
            codec_think_bos_id: t.codec_think_bos_id,
            codec_think_eos_id: t.codec_think_eos_id,
            codec_pad_id: t.codec_pad_id,
            codec_bos_id: t.codec_bos_id,
            speaker_id: t
                .spk_id
                .iter()
                .filter_map(|(k, v)| Some((k.to_lowercase(), v.id()?)))
                .collect(),
            audio_token_id: None,
            image_token_id: None,
            video_token_id: None,
            vision_start_token_id: None,
            audio_start_token_id: None,
            position_id_per_seconds: 25,
            spatial_merge_size: 2,
            variant: TalkerVariant::Tts,
        }
    }

    /// The preset speakers, sorted.
    pub fn speakers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.talker_config.spk_id.keys().cloned().collect();
        v.sort();
        v
    }

    /// The languages a request may name: "auto", then every non-dialect one, sorted.
    pub fn languages(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .talker_config
            .codec_language_id
            .keys()
            .filter(|k| !k.contains("dialect"))
            .cloned()
            .collect();
        v.sort();
        v.insert(0, "auto".to_string());
        v
    }
}

/// `speech_tokenizer/config.json` (`Qwen3TTSTokenizerV2Config`).
#[derive(Debug, Clone, Deserialize)]
pub struct SpeechTokenizerConfig {
    #[serde(default)]
    pub model_type: Option<String>,
    pub decoder_config: Code2WavConfig,
    #[serde(default = "d_rate")]
    pub output_sample_rate: u32,
    #[serde(default = "d_upsample")]
    pub decode_upsample_rate: usize,
    /// The encoder (reference clips to codes, for in-context cloning); checked
    /// only where it is built ([`super::codec_encoder::CodecEncoder::new`]).
    #[serde(default)]
    pub encoder_config: Option<CodecEncoderConfig>,
    /// The encoder's leading quantizers that make a frame's codes.
    #[serde(default = "d_valid")]
    pub encoder_valid_num_quantizers: usize,
    #[serde(default = "d_upsample")]
    pub encode_downsample_rate: usize,
}

fn d_upsample() -> usize {
    1920
}
fn d_valid() -> usize {
    16
}

impl SpeechTokenizerConfig {
    /// `speech_tokenizer/config.json` under a checkpoint folder; the decoder's
    /// config comes back marked as Qwen3-TTS's.
    pub fn load(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join("speech_tokenizer").join("config.json");
        let mut cfg: Self = read_json(&path)?;
        let invalid = |msg: String| ConfigError::Invalid {
            path: path.display().to_string(),
            msg,
        };
        if let Some(t) = cfg.model_type.as_deref() {
            if t != "qwen3_tts_tokenizer_12hz" {
                return Err(invalid(format!(
                    "model_type {t}: only the 12 Hz tokenizer is supported"
                )));
            }
        }
        cfg.decoder_config.variant = Code2WavVariant::Tts12Hz;
        if cfg.decoder_config.samples_per_frame() != cfg.decode_upsample_rate {
            return Err(invalid(format!(
                "the decoder makes {} samples a frame, decode_upsample_rate says {}",
                cfg.decoder_config.samples_per_frame(),
                cfg.decode_upsample_rate
            )));
        }
        Ok(cfg)
    }
}
