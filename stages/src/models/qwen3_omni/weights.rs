//! Where Qwen3-Omni's weights come from: a downloaded checkpoint folder
//! (`config.json`, sharded `*.safetensors` + `model.safetensors.index.json`,
//! memory-mapped) or random values at any config (benchmarks at real shapes
//! without the 70 GB download). Both hand the model code the same
//! `VarBuilder`, so every path runs the same model code.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

use crate::models::{ModelError, Result};

/// Called as tensors are read: (bytes read so far, bytes in the checkpoint).
pub type Progress = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// The safetensors files of a checkpoint folder, in a stable order: those the
/// index names if there is one, else every `*.safetensors` in the folder.
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|source| ModelError::Io {
            path: index.clone(),
            source,
        })?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| ModelError::Format {
                path: index.clone(),
                msg: e.to_string(),
            })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::Format {
                path: index.clone(),
                msg: "no weight_map object".into(),
            })?;
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| ModelError::Format {
                path: index.clone(),
                msg: format!("weight_map[{tensor}] is not a file name"),
            })?;
            // A file name, never a path: the index must not reach outside the folder.
            if file.contains('/') || file.contains('\\') || file == ".." {
                return Err(ModelError::Format {
                    path: index.clone(),
                    msg: format!("weight_map[{tensor}] = {file:?} is not a plain file name"),
                });
            }
            files.insert(file.to_string());
        }
        let files: Vec<PathBuf> = files.into_iter().map(|f| dir.join(f)).collect();
        if let Some(missing) = files.iter().find(|f| !f.exists()) {
            return Err(ModelError::Format {
                path: index,
                msg: format!("names a missing shard {}", missing.display()),
            });
        }
        return Ok(files);
    }
    let entries = std::fs::read_dir(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ModelError::Format {
            path: dir.to_path_buf(),
            msg: "no *.safetensors files and no model.safetensors.index.json".into(),
        });
    }
    Ok(files)
}

/// Memory-maps a checkpoint folder's shards. Tensors are read (and converted to
/// `dtype`, e.g. bf16 on disk to f32) as the model asks for them; `progress`
/// hears about each one.
pub fn from_checkpoint(
    dir: &Path,
    dtype: DType,
    device: &Device,
    progress: Option<Progress>,
) -> Result<VarBuilder<'static>> {
    let files = checkpoint_files(dir)?;
    let total = files
        .iter()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    // SAFETY: the shards are opened read-only; like every mmap-based loader we
    // rely on nobody truncating the files while the server runs.
    let tensors = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| ModelError::Format {
        path: dir.to_path_buf(),
        msg: e.to_string(),
    })?;
    let backend = Counting {
        inner: tensors,
        read: AtomicU64::new(0),
        total,
        progress,
    };
    Ok(VarBuilder::from_backend(
        Box::new(backend),
        dtype,
        device.clone(),
    ))
}

struct Counting {
    inner: MmapedSafetensors,
    read: AtomicU64,
    total: u64,
    progress: Option<Progress>,
}

impl Counting {
    fn counted(&self, name: &str, t: candle_core::Result<Tensor>) -> candle_core::Result<Tensor> {
        if let (Ok(_), Some(progress)) = (&t, &self.progress) {
            // Bytes as stored, whatever dtype they are converted to.
            let bytes = self.inner.get(name).map_or(0, |v| v.data().len()) as u64;
            let read = self.read.fetch_add(bytes, Ordering::Relaxed) + bytes;
            progress(read.min(self.total), self.total);
        }
        t
    }
}

impl SimpleBackend for Counting {
    fn get(
        &self,
        s: Shape,
        name: &str,
        h: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        self.counted(
            name,
            SimpleBackend::get(&self.inner, s, name, h, dtype, dev),
        )
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.counted(
            name,
            SimpleBackend::get_unchecked(&self.inner, name, dtype, dev),
        )
    }

    fn contains_tensor(&self, name: &str) -> bool {
        SimpleBackend::contains_tensor(&self.inner, name)
    }
}

/// Random weights for any config, real shapes included: benchmarks run the
/// real model code without the checkpoint. Values are drawn on `device`
/// (cuRAND on a GPU), so 35B parameters take seconds, not minutes.
///
/// Scale-like parameters get their neutral value so activations stay finite
/// through dozens of layers: norms' weights 1, biases 0, SnakeBeta's log-scale
/// alpha/beta 0, LayerScale 0.01, codebook usage 1; everything else N(0, 0.02).
pub fn random(dtype: DType, device: &Device) -> VarBuilder<'static> {
    VarBuilder::from_backend(Box::new(Random), dtype, device.clone())
}

struct Random;

impl Random {
    fn value(s: &Shape, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let leaf = name.rsplit('.').next().unwrap_or(name);
        let parent = name.rsplit('.').nth(1).unwrap_or("");
        let is_norm = parent.contains("norm") || parent.starts_with("ln");
        let constant = match leaf {
            "bias" => Some(0.0),
            "alpha" | "beta" => Some(0.0),
            "scale" => Some(0.01),
            "gamma" => Some(1e-6),
            // Qwen3-TTS's codebooks are `embedding_sum / cluster_usage`: a
            // usage near 0 would blow the rows up.
            "cluster_usage" => Some(1.0),
            "weight" if is_norm => Some(1.0),
            _ => None,
        };
        match constant {
            Some(v) => Tensor::full(v as f32, s.clone(), dev)?.to_dtype(dtype),
            None => Tensor::randn(0f32, 0.02, s.clone(), dev)?.to_dtype(dtype),
        }
    }
}

impl SimpleBackend for Random {
    fn get(
        &self,
        s: Shape,
        name: &str,
        _: Init,
        dtype: DType,
        dev: &Device,
    ) -> candle_core::Result<Tensor> {
        Self::value(&s, name, dtype, dev)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> candle_core::Result<Tensor> {
        // Without a shape there is nothing to draw.
        candle_core::bail!("random weights: {name} was asked for without a shape")
    }

    fn contains_tensor(&self, _: &str) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn reads_the_fixture_checkpoint_and_reports_progress() {
        let dir = super::super::fixtures::dir().join("model");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let progress: Progress = Arc::new(move |read, total| s.lock().unwrap().push((read, total)));
        let vb = from_checkpoint(&dir, DType::BF16, &Device::Cpu, Some(progress)).unwrap();
        let w = vb
            .pp("thinker.model.layers.0.mlp.experts.3")
            .get((32, 64), "gate_proj.weight")
            .unwrap();
        assert_eq!(w.dtype(), DType::BF16);
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].0, 32 * 64 * 4, "bytes as stored (f32)");
        assert!(seen[0].1 > 1_000_000);
        // A wrong shape is an error naming the tensor, not a panic.
        let err = vb.get((3, 3), "thinker.lm_head.weight").unwrap_err();
        assert!(err.to_string().contains("lm_head"), "{err}");
    }

    #[test]
    fn sharded_checkpoints_follow_their_index() {
        let dir = tempfile::tempdir().unwrap();
        let a = Tensor::arange(0f32, 6., &Device::Cpu)
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let b = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        candle_core::safetensors::save(
            &[("x.weight", a)]
                .into_iter()
                .collect::<std::collections::HashMap<_, _>>(),
            dir.path().join("model-00001-of-00002.safetensors"),
        )
        .unwrap();
        candle_core::safetensors::save(
            &[("y.norm.weight", b)]
                .into_iter()
                .collect::<std::collections::HashMap<_, _>>(),
            dir.path().join("model-00002-of-00002.safetensors"),
        )
        .unwrap();
        // A stray file the index does not name is not read.
        std::fs::write(dir.path().join("junk.safetensors"), b"not safetensors").unwrap();
        let index = r#"{"metadata": {}, "weight_map": {
            "x.weight": "model-00001-of-00002.safetensors",
            "y.norm.weight": "model-00002-of-00002.safetensors"}}"#;
        std::fs::write(dir.path().join("model.safetensors.index.json"), index).unwrap();
        let vb = from_checkpoint(dir.path(), DType::F32, &Device::Cpu, None).unwrap();
        let x = vb.get((2, 3), "x.weight").unwrap();
        assert_eq!(x.to_vec2::<f32>().unwrap()[1], vec![3., 4., 5.]);
        assert_eq!(
            vb.get(4, "y.norm.weight")
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            vec![1.; 4]
        );

        // An index naming a missing shard, or a path outside the folder, is refused.
        let bad = r#"{"weight_map": {"x.weight": "../model.safetensors"}}"#;
        std::fs::write(dir.path().join("model.safetensors.index.json"), bad).unwrap();
        let err = from_checkpoint(dir.path(), DType::F32, &Device::Cpu, None)
            .err()
            .unwrap();
        assert!(err.to_string().contains("plain file name"), "{err}");
        let gone = r#"{"weight_map": {"x.weight": "model-00009-of-00009.safetensors"}}"#;
        std::fs::write(dir.path().join("model.safetensors.index.json"), gone).unwrap();
        let err = from_checkpoint(dir.path(), DType::F32, &Device::Cpu, None)
            .err()
            .unwrap();
        assert!(err.to_string().contains("missing shard"), "{err}");
        let empty = tempfile::tempdir().unwrap();
        assert!(from_checkpoint(empty.path(), DType::F32, &Device::Cpu, None).is_err());
    }

    #[test]
    fn random_weights_have_any_shape_and_neutral_scales() {
        let vb = random(DType::F32, &Device::Cpu);
        let w = vb
            .get((64, 32), "model.layers.0.self_attn.q_proj.weight")
            .unwrap();
        let std = w
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt();
        assert!((std - 0.02).abs() < 0.004, "std {std}");
        let n = vb.get(32, "model.layers.0.input_layernorm.weight").unwrap();
        assert_eq!(n.to_vec1::<f32>().unwrap(), vec![1.0; 32]);
        let b = vb.get(8, "x.bias").unwrap();
        assert_eq!(b.to_vec1::<f32>().unwrap(), vec![0.0; 8]);
        let bf = random(DType::BF16, &Device::Cpu).get((2, 2), "w").unwrap();
        assert_eq!(bf.dtype(), DType::BF16);
    }
}
