//! Qwen3-Omni (Qwen3-Omni-30B-A3B): Thinker (text decoder + audio encoder),
//! Talker, code predictor and Code2Wav, in candle. One file per component;
//! modules and weight names mirror Hugging Face transformers 5.24's
//! `modeling_qwen3_omni_moe.py`, so checkpoint tensors map one to one.
//! Proven against the reference by the fixtures under
//! `tests/fixtures/qwen3_omni/` (written by `scripts/qwen3_omni/make_fixtures.py`).

pub mod audio_encoder;
pub mod code2wav;
pub mod code_predictor;
pub mod graphs;
pub mod kernels;
pub mod layers;
pub mod omni;
pub mod sampling;
pub mod talker;
pub mod thinker;
pub mod weights;

#[cfg(all(test, feature = "cuda"))]
mod cuda_tests;

#[cfg(test)]
pub(crate) mod fixtures {
    //! Test access to the committed reference fixtures.
    use candle_core::{DType, Device, Tensor};
    use candle_nn::VarBuilder;
    use std::collections::HashMap;
    use std::path::PathBuf;

    pub fn dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3_omni")
    }

    /// The tiny model's weights (the whole checkpoint, unprefixed: use `vb.pp("code2wav")` etc.).
    pub fn weights() -> VarBuilder<'static> {
        let path = dir().join("model/model.safetensors");
        // SAFETY: the fixture file is not modified while the test runs.
        unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, &Device::Cpu) }
            .expect("fixture weights")
    }

    /// The tiny model's config.json.
    pub fn config() -> serde_json::Value {
        let text =
            std::fs::read_to_string(dir().join("model/config.json")).expect("fixture config");
        serde_json::from_str(&text).expect("fixture config json")
    }

    /// A component's inputs and reference outputs.
    pub fn io(name: &str) -> HashMap<String, Tensor> {
        candle_core::safetensors::load(dir().join(name).join("io.safetensors"), &Device::Cpu)
            .expect("fixture io")
    }

    /// Largest absolute difference between two tensors of one shape.
    pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims(), "shapes differ");
        (a.to_dtype(DType::F32).unwrap() - b.to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }
}
