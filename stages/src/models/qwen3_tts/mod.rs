//! Qwen3-TTS-12Hz (0.6B / 1.7B; Base, CustomVoice, VoiceDesign), in candle, on
//! the engine's Qwen3-Omni machinery: its Talker is the Qwen3-Omni Talker's frame
//! loop with dense layers ([`talker`]), and its speech tokenizer's decoder is the
//! Qwen3-Omni Code2Wav with a split-RVQ front and a right-only trim
//! ([`codec`]); its encoder, transformers' Mimi, makes the codes of a Base
//! checkpoint's reference clips for in-context cloning ([`codec_encoder`]).
//! Module and weight names mirror qwen-tts 0.1.1
//! (`qwen_tts/core/models/modeling_qwen3_tts.py`,
//! `qwen_tts/core/tokenizer_12hz/modeling_qwen3_tts_tokenizer_v2.py`), so a
//! downloaded checkpoint folder (`config.json`, `model.safetensors` and
//! `speech_tokenizer/`) loads as it is. Proven against the reference by the
//! fixtures under `tests/fixtures/qwen3_tts/` (written by
//! `scripts/qwen3_tts/make_fixtures.py`).

pub mod codec;
pub mod codec_encoder;
pub mod config;
pub mod model;
pub mod speaker_encoder;
pub mod talker;

#[cfg(test)]
pub(crate) mod fixtures {
    //! Test access to the committed reference fixtures.
    use candle_core::{DType, Device, Tensor};
    use candle_nn::VarBuilder;
    use std::collections::HashMap;
    use std::path::PathBuf;

    pub fn dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_tts")
    }

    pub fn model_dir() -> PathBuf {
        dir().join("model")
    }

    /// The tiny checkpoint's weights (unprefixed).
    pub fn weights() -> VarBuilder<'static> {
        let path = model_dir().join("model.safetensors");
        // SAFETY: the fixture file is not modified while the test runs.
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }
            .expect("fixture weights")
    }

    /// A component's inputs and reference outputs.
    pub fn io(name: &str) -> HashMap<String, Tensor> {
        candle_core::safetensors::load(dir().join(name).join("io.safetensors"), &Device::Cpu)
            .expect("fixture io")
    }

    /// A 16-bit clip `pcm16_{n}` of `io` as the reference saw it: / 32768
    /// (exact in f32).
    pub fn pcm16(io: &HashMap<String, Tensor>, n: usize) -> Vec<f32> {
        let pcm = io[&format!("pcm16_{n}")]
            .to_dtype(DType::F32)
            .expect("pcm16")
            .to_vec1::<f32>()
            .expect("pcm16");
        pcm.into_iter().map(|x| x / 32768.0).collect()
    }

    pub fn meta(name: &str) -> serde_json::Value {
        let text = std::fs::read_to_string(dir().join(name).join("io.json")).expect("io.json");
        serde_json::from_str(&text).expect("io.json")
    }
}
