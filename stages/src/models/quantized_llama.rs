//! The Thinker LM: a llama-architecture model (SmolLM2, Llama, ...) read from a GGUF file, with a
//! ragged multi-sequence forward so one engine step serves many requests at once.
//!
//! Wiring follows candle-transformers' `quantized_llama.rs` (GGUF names, llama.cpp's q/k row
//! permutation, hence the interleaved `rope_i`), but the model holds weights only: every request
//! owns a [`KvCache`], and [`QuantizedLlama::forward_batch`] concatenates the new tokens of all
//! sequences so each projection / MLP matmul runs once per layer for the whole batch, while RoPE
//! positions and causal attention stay per sequence.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{CpuStorage, DType, Device, Layout, Module, Storage, Tensor};

use super::linear::Linear;
use super::tokenizer::ChatTokenizer;
use super::{ModelError, Result};

/// Hyper-parameters, from the GGUF metadata (`llama.*`) and tensor shapes.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub rope_theta: f32,
    pub rms_norm_eps: f64,
    pub vocab_size: usize,
    /// `llama.context_length`: the most positions a sequence may hold.
    pub max_seq_len: usize,
}

/// How the weight matrices are held in memory (and hence which arithmetic the matmuls use).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightPrecision {
    /// Dequantize every matrix to f32 at load: exact f32 arithmetic (matches a float reference
    /// to ~1e-4), ~4 bytes per weight, multiplied by the streaming kernel of [`super::linear`]
    /// (decoding is bound by memory bandwidth). The default: with quantized matmuls, candle
    /// (like llama.cpp) also rounds the *activations* to 8 bits per 32-block, which moves
    /// SmolLM2-135M's logits by up to ~1 (its attention inputs carry large outliers) and changes
    /// greedy answers.
    #[default]
    F32,
    /// Re-quantize every matrix to Q8_0 (fast AVX kernels; ~1.06 bytes per weight); activations
    /// are rounded to 8 bits per block for each matmul.
    Q8_0,
    /// Keep the blocks exactly as stored in the file (Q4_1 has no SIMD kernel on x86: slow).
    AsStored,
}

/// A weight matrix `[n, k]` applied as `x · wᵀ`: f32 through the few-row streaming kernel of
/// [`Linear`] ([`WeightPrecision::F32`]), or a candle `QMatMul` (the quantized settings).
#[derive(Clone)]
enum Proj {
    F32(Linear),
    Quant(QMatMul),
}

impl Proj {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Proj::F32(l) => l.forward(x),
            Proj::Quant(q) => q.forward(x),
        }
    }

    /// Rows `ids` of the matrix (the token embedding).
    fn embedding(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            Proj::F32(l) => l.embedding(ids),
            Proj::Quant(q) => q.embedding(ids),
        }
    }
}

struct Layer {
    attn_norm: Tensor,
    wq: Proj,
    wk: Proj,
    wv: Proj,
    wo: Proj,
    ffn_norm: Tensor,
    w_gate: Proj,
    w_up: Proj,
    w_down: Proj,
}

/// The weights of the model. Holds no per-request state, so one instance serves all requests
/// (`Send + Sync`).
pub struct QuantizedLlama {
    config: Config,
    /// Token embedding (rows are looked up; shares storage with `output` when tied).
    embed: Proj,
    layers: Vec<Layer>,
    norm: Tensor,
    output: Proj,
    /// RoPE tables, `[max_seq_len, head_dim / 2]`.
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

impl std::fmt::Debug for QuantizedLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantizedLlama")
            .field("config", &self.config)
            .field("device", &self.device)
            .finish()
    }
}

/// One layer's keys and values for one sequence: `[n_kv_head, capacity, head_dim]` buffers,
/// valid up to the sequence length.
#[derive(Debug)]
struct LayerCache {
    k: Tensor,
    v: Tensor,
}

/// The attention cache of one sequence (one request). Created by [`QuantizedLlama::new_cache`];
/// grows as tokens are fed. `Send`.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<Option<LayerCache>>,
    len: usize,
    capacity: usize,
    n_kv_head: usize,
    head_dim: usize,
    max_seq_len: usize,
}

/// The new tokens of one sequence for [`QuantizedLlama::forward_batch`], and its cache.
pub struct SeqStep<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

const MIN_CACHE_CAPACITY: usize = 64;

impl KvCache {
    /// Number of positions (tokens) already in the cache.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets everything (keeps the buffers).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Drops positions `len..` (e.g. to roll back speculative tokens). No-op if `len >= self.len()`.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Bytes its buffers hold (allocated capacity, not only the valid positions).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flatten()
            .map(|l| (l.k.elem_count() + l.v.elem_count()) * l.k.dtype().size_in_bytes())
            .sum()
    }

    /// A deep copy of the valid positions only (capacity = length): what a
    /// prefix cache keeps, so its size is what it holds.
    pub fn try_clone_compact(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                Some(l) if self.len > 0 => Ok(Some(LayerCache {
                    k: l.k.narrow(1, 0, self.len)?.contiguous()?.copy()?,
                    v: l.v.narrow(1, 0, self.len)?.contiguous()?.copy()?,
                })),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            len: self.len,
            capacity: self.len,
            n_kv_head: self.n_kv_head,
            head_dim: self.head_dim,
            max_seq_len: self.max_seq_len,
        })
    }

    /// A deep copy (the copy and the original can then be extended independently).
    pub fn try_clone(&self) -> Result<Self> {
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                None => Ok(None),
                Some(l) => Ok(Some(LayerCache {
                    k: l.k.copy()?,
                    v: l.v.copy()?,
                })),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            len: self.len,
            capacity: self.capacity,
            n_kv_head: self.n_kv_head,
            head_dim: self.head_dim,
            max_seq_len: self.max_seq_len,
        })
    }

    /// Makes room for `needed` positions in total (all layers share one capacity).
    fn reserve(&mut self, needed: usize, device: &Device) -> Result<()> {
        if needed <= self.capacity {
            return Ok(());
        }
        let new_cap = needed
            .max(self.capacity * 2)
            .max(MIN_CACHE_CAPACITY)
            .min(self.max_seq_len.max(needed));
        let shape = (self.n_kv_head, new_cap, self.head_dim);
        for slot in self.layers.iter_mut() {
            let k = Tensor::zeros(shape, DType::F32, device)?;
            let v = Tensor::zeros(shape, DType::F32, device)?;
            if let Some(old) = slot.as_ref() {
                if self.len > 0 {
                    k.slice_set(&old.k.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                    v.slice_set(&old.v.narrow(1, 0, self.len)?.contiguous()?, 1, 0)?;
                }
            }
            *slot = Some(LayerCache { k, v });
        }
        self.capacity = new_cap;
        Ok(())
    }

    fn layer(&self, layer: usize) -> Result<&LayerCache> {
        self.layers
            .get(layer)
            .and_then(|l| l.as_ref())
            .ok_or_else(|| ModelError::Invalid("kv cache not allocated".into()))
    }

    /// Writes `k`, `v` (`[n_kv_head, n, head_dim]`, contiguous) at positions `len..len + n` of
    /// `layer` and returns views of positions `0..len + n`. Does not advance `len`.
    fn write(&self, layer: usize, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let n = k.dim(1)?;
        let lc = self.layer(layer)?;
        lc.k.slice_set(k, 1, self.len)?;
        lc.v.slice_set(v, 1, self.len)?;
        Ok((
            lc.k.narrow(1, 0, self.len + n)?,
            lc.v.narrow(1, 0, self.len + n)?,
        ))
    }
}

fn format_err(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Format {
        path: PathBuf::from(path),
        msg: msg.into(),
    }
}

fn md_usize(ct: &gguf_file::Content, path: &Path, key: &str) -> Result<usize> {
    let v = ct
        .metadata
        .get(key)
        .ok_or_else(|| format_err(path, format!("missing {key}")))?;
    let n = match v {
        gguf_file::Value::U8(x) => *x as u64,
        gguf_file::Value::U16(x) => *x as u64,
        gguf_file::Value::U32(x) => *x as u64,
        gguf_file::Value::U64(x) => *x,
        gguf_file::Value::I32(x) if *x >= 0 => *x as u64,
        gguf_file::Value::I64(x) if *x >= 0 => *x as u64,
        _ => {
            return Err(format_err(
                path,
                format!("{key} is not an unsigned integer"),
            ))
        }
    };
    usize::try_from(n).map_err(|_| format_err(path, format!("{key} too large")))
}

fn md_f32(ct: &gguf_file::Content, key: &str) -> Option<f32> {
    ct.metadata.get(key).and_then(|v| match v {
        gguf_file::Value::F32(x) => Some(*x),
        gguf_file::Value::F64(x) => Some(*x as f32),
        _ => None,
    })
}

/// The elements of a contiguous f32 CPU tensor, from its storage guard.
fn cpu_f32<'a>(storage: &'a Storage, layout: &Layout) -> Result<&'a [f32]> {
    match (storage, layout.contiguous_offsets()) {
        (Storage::Cpu(CpuStorage::F32(v)), Some((a, b))) => Ok(&v[a..b]),
        _ => Err(ModelError::Invalid(
            "expected a contiguous f32 cpu tensor".into(),
        )),
    }
}

impl QuantizedLlama {
    /// Reads a llama-architecture GGUF file (one pass over the file) and its tokenizer, with
    /// the weights in f32 ([`WeightPrecision::F32`]).
    pub fn load(path: &Path, device: &Device) -> Result<(Self, ChatTokenizer)> {
        Self::load_with_precision(path, device, WeightPrecision::default())
    }

    /// [`load`](Self::load) with a choice of weight precision.
    pub fn load_with_precision(
        path: &Path,
        device: &Device,
        precision: WeightPrecision,
    ) -> Result<(Self, ChatTokenizer)> {
        let io_err = |source| ModelError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io_err)?;
        let mut reader = BufReader::with_capacity(1 << 20, file);
        let ct = gguf_file::Content::read(&mut reader)
            .map_err(|e| format_err(path, format!("not a readable GGUF file: {e}")))?;
        let tokenizer = ChatTokenizer::from_gguf(&ct, path)?;

        let arch = ct
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| format_err(path, "missing general.architecture"))?;
        if arch != "llama" {
            return Err(format_err(
                path,
                format!("architecture {arch:?} is not llama"),
            ));
        }
        let n_layer = md_usize(&ct, path, "llama.block_count")?;
        let n_head = md_usize(&ct, path, "llama.attention.head_count")?;
        let n_kv_head = md_usize(&ct, path, "llama.attention.head_count_kv")?;
        let hidden_size = md_usize(&ct, path, "llama.embedding_length")?;
        let max_seq_len = md_usize(&ct, path, "llama.context_length")?;
        let rms_norm_eps = md_f32(&ct, "llama.attention.layer_norm_rms_epsilon")
            .ok_or_else(|| format_err(path, "missing llama.attention.layer_norm_rms_epsilon"))?
            as f64;
        let rope_theta = md_f32(&ct, "llama.rope.freq_base").unwrap_or(10_000.0);
        if n_layer == 0 || n_head == 0 || n_kv_head == 0 || max_seq_len == 0 {
            return Err(format_err(path, "zero layers, heads or context length"));
        }
        if hidden_size % n_head != 0 || n_head % n_kv_head != 0 {
            return Err(format_err(
                path,
                "embedding_length / head_count / head_count_kv do not divide",
            ));
        }
        let head_dim = hidden_size / n_head;
        if head_dim % 2 != 0 {
            return Err(format_err(path, "odd head dimension"));
        }
        if let Ok(rope_dim) = md_usize(&ct, path, "llama.rope.dimension_count") {
            if rope_dim != head_dim {
                return Err(format_err(
                    path,
                    format!("partial rope ({rope_dim} of {head_dim}) is not supported"),
                ));
            }
        }
        if ct.metadata.contains_key("llama.expert_count")
            && md_usize(&ct, path, "llama.expert_count").unwrap_or(0) > 0
        {
            return Err(format_err(
                path,
                "mixture-of-experts llama is not supported",
            ));
        }

        let mut get = |name: &str, shape: &[usize]| -> Result<QTensor> {
            let info = ct
                .tensor_infos
                .get(name)
                .ok_or_else(|| format_err(path, format!("missing tensor {name}")))?;
            if info.shape.dims() != shape {
                return Err(format_err(
                    path,
                    format!(
                        "tensor {name} has shape {:?}, expected {shape:?}",
                        info.shape.dims()
                    ),
                ));
            }
            ct.tensor(&mut reader, name, device)
                .map_err(|e| format_err(path, format!("tensor {name}: {e}")))
        };
        let vec_f32 = |q: QTensor| -> Result<Tensor> { Ok(q.dequantize(device)?) };

        let vocab_size = ct
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| format_err(path, "missing tensor token_embd.weight"))?
            .shape
            .dims()
            .first()
            .copied()
            .unwrap_or(0);
        if vocab_size == 0 || vocab_size > u32::MAX as usize {
            return Err(format_err(path, "bad token_embd.weight shape"));
        }
        if tokenizer.vocab_size() > vocab_size {
            return Err(format_err(
                path,
                format!(
                    "tokenizer has {} tokens but the embedding only {vocab_size}",
                    tokenizer.vocab_size()
                ),
            ));
        }
        let kv_dim = n_kv_head * head_dim;
        let mm = |q: QTensor| -> Result<Proj> {
            let quant = |q| -> Result<Proj> { Ok(Proj::Quant(QMatMul::from_qtensor(q)?)) };
            Ok(match precision {
                WeightPrecision::F32 => Proj::F32(Linear::new(q.dequantize(device)?)?),
                WeightPrecision::Q8_0 if q.dtype() != GgmlDType::Q8_0 => {
                    let rows_ok = q
                        .shape()
                        .dims()
                        .last()
                        .is_some_and(|k| k % GgmlDType::Q8_0.block_size() == 0);
                    if rows_ok {
                        let t = q.dequantize(device)?;
                        quant(QTensor::quantize(&t, GgmlDType::Q8_0)?)?
                    } else {
                        quant(q)?
                    }
                }
                _ => quant(q)?,
            })
        };
        let embed = mm(get("token_embd.weight", &[vocab_size, hidden_size])?)?;
        let norm = vec_f32(get("output_norm.weight", &[hidden_size])?)?;
        let output = if ct.tensor_infos.contains_key("output.weight") {
            mm(get("output.weight", &[vocab_size, hidden_size])?)?
        } else {
            embed.clone() // tied embeddings (shared storage)
        };
        let intermediate_size = ct
            .tensor_infos
            .get("blk.0.ffn_gate.weight")
            .and_then(|i| i.shape.dims().first().copied())
            .ok_or_else(|| format_err(path, "missing tensor blk.0.ffn_gate.weight"))?;

        let mut layers = Vec::with_capacity(n_layer);
        for i in 0..n_layer {
            let p = format!("blk.{i}");
            layers.push(Layer {
                attn_norm: vec_f32(get(&format!("{p}.attn_norm.weight"), &[hidden_size])?)?,
                wq: mm(get(
                    &format!("{p}.attn_q.weight"),
                    &[hidden_size, hidden_size],
                )?)?,
                wk: mm(get(&format!("{p}.attn_k.weight"), &[kv_dim, hidden_size])?)?,
                wv: mm(get(&format!("{p}.attn_v.weight"), &[kv_dim, hidden_size])?)?,
                wo: mm(get(
                    &format!("{p}.attn_output.weight"),
                    &[hidden_size, hidden_size],
                )?)?,
                ffn_norm: vec_f32(get(&format!("{p}.ffn_norm.weight"), &[hidden_size])?)?,
                w_gate: mm(get(
                    &format!("{p}.ffn_gate.weight"),
                    &[intermediate_size, hidden_size],
                )?)?,
                w_up: mm(get(
                    &format!("{p}.ffn_up.weight"),
                    &[intermediate_size, hidden_size],
                )?)?,
                w_down: mm(get(
                    &format!("{p}.ffn_down.weight"),
                    &[hidden_size, intermediate_size],
                )?)?,
            });
        }

        // RoPE tables; llama.cpp's "normal" rope rotates adjacent pairs (2i, 2i+1) with
        // theta_i = base^(-2i/d) (optionally divided by `rope_freqs.weight`, llama 3.1 style).
        let half = head_dim / 2;
        let mut inv_freq: Vec<f32> = (0..half)
            .map(|i| 1.0 / rope_theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        if ct.tensor_infos.contains_key("rope_freqs.weight") {
            let f = get("rope_freqs.weight", &[half])?
                .dequantize(&Device::Cpu)?
                .to_vec1::<f32>()?;
            for (x, f) in inv_freq.iter_mut().zip(f) {
                *x /= f;
            }
        }
        let mut cos = Vec::with_capacity(max_seq_len * half);
        let mut sin = Vec::with_capacity(max_seq_len * half);
        for pos in 0..max_seq_len {
            for &f in &inv_freq {
                let a = pos as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        let cos = Tensor::from_vec(cos, (max_seq_len, half), device)?;
        let sin = Tensor::from_vec(sin, (max_seq_len, half), device)?;

        let config = Config {
            n_layer,
            n_head,
            n_kv_head,
            head_dim,
            hidden_size,
            intermediate_size,
            rope_theta,
            rms_norm_eps,
            vocab_size,
            max_seq_len,
        };
        let model = Self {
            config,
            embed,
            layers,
            norm,
            output,
            cos,
            sin,
            device: device.clone(),
        };
        Ok((model, tokenizer))
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// An empty cache for a new sequence (buffers are allocated on first use).
    pub fn new_cache(&self) -> KvCache {
        KvCache {
            layers: (0..self.config.n_layer).map(|_| None).collect(),
            len: 0,
            capacity: 0,
            n_kv_head: self.config.n_kv_head,
            head_dim: self.config.head_dim,
            max_seq_len: self.config.max_seq_len,
        }
    }

    /// Ragged batch: every sequence contributes its new tokens (a prompt prefill = many, a decode
    /// step = one). The token rows of all sequences are concatenated so the projections and the
    /// MLP run as ONE matmul per layer (weights read once for the whole batch); RoPE at each
    /// sequence's own positions and causal attention against each sequence's own cache run per
    /// sequence. Returns f32 logits of each sequence's LAST new token: `[batch.len(), vocab]`.
    ///
    /// Errors (nothing is appended to any cache): an empty batch, a sequence without tokens, a
    /// token id `>= vocab_size`, a sequence that would exceed `max_seq_len`, or a cache made by a
    /// model of another shape.
    pub fn forward_batch(&self, batch: &mut [SeqStep<'_>]) -> Result<Tensor> {
        Ok(self.forward_impl(batch, None)?.0)
    }

    /// Like [`forward_batch`](Self::forward_batch), and also returns the residual-stream hidden
    /// state after block `layer` (`0..n_layer`) at each sequence's last new token:
    /// `(logits [batch, vocab], hidden [batch, hidden_size])`.
    pub fn forward_batch_with_hidden(
        &self,
        batch: &mut [SeqStep<'_>],
        layer: usize,
    ) -> Result<(Tensor, Tensor)> {
        if layer >= self.config.n_layer {
            return Err(ModelError::Invalid(format!(
                "hidden layer {layer} out of range (model has {})",
                self.config.n_layer
            )));
        }
        let (logits, hidden) = self.forward_impl(batch, Some(layer))?;
        let hidden = hidden.ok_or_else(|| ModelError::Invalid("hidden state missing".into()))?;
        Ok((logits, hidden))
    }

    fn validate(&self, batch: &[SeqStep<'_>]) -> Result<()> {
        let cfg = &self.config;
        if batch.is_empty() {
            return Err(ModelError::Invalid("forward_batch: empty batch".into()));
        }
        for (i, s) in batch.iter().enumerate() {
            if s.tokens.is_empty() {
                return Err(ModelError::Invalid(format!(
                    "forward_batch: sequence {i} has no new tokens"
                )));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(ModelError::Invalid(format!(
                    "forward_batch: sequence {i}: token id {t} >= vocab size {}",
                    cfg.vocab_size
                )));
            }
            let c = &s.cache;
            if c.layers.len() != cfg.n_layer
                || c.n_kv_head != cfg.n_kv_head
                || c.head_dim != cfg.head_dim
            {
                return Err(ModelError::Invalid(format!(
                    "forward_batch: sequence {i}: cache was made for another model"
                )));
            }
            if c.len + s.tokens.len() > cfg.max_seq_len {
                return Err(ModelError::Invalid(format!(
                    "forward_batch: sequence {i}: {} + {} tokens exceed the context length {}",
                    c.len,
                    s.tokens.len(),
                    cfg.max_seq_len
                )));
            }
        }
        Ok(())
    }

    /// Causal attention of every sequence's new rows against its own cache, on the CPU, on the
    /// tensors' storage directly (candle's matmul costs ~50 µs per call here, mostly thread-count
    /// detection, and it would run twice per sequence and layer). Writes `k`, `v` into the
    /// caches first. `q`: `[n_head, T, hd]` (roped), `k`, `v`: `[n_kv, T, hd]`; returns
    /// `[T, n_head * hd]`. (Sequence, kv-head) pairs run in parallel when there is enough work.
    #[allow(clippy::too_many_arguments)]
    fn attention_cpu(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        batch: &[SeqStep<'_>],
        spans: &[(usize, usize, usize)],
        li: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let rep = n_head / n_kv;
        let total: usize = spans.iter().map(|&(_, n, _)| n).sum();
        for (s, &(off, n, _)) in batch.iter().zip(spans) {
            let k_new = k.narrow(1, off, n)?.contiguous()?;
            let v_new = v.narrow(1, off, n)?.contiguous()?;
            s.cache.write(li, &k_new, &v_new)?;
        }

        let q = q.contiguous()?;
        let (q_guard, q_layout) = q.storage_and_layout();
        let q_all = cpu_f32(&q_guard, q_layout)?;
        let caches = batch
            .iter()
            .map(|s| s.cache.layer(li))
            .collect::<Result<Vec<_>>>()?;
        let guards: Vec<_> = caches
            .iter()
            .map(|c| (c.k.storage_and_layout(), c.v.storage_and_layout()))
            .collect();
        // Per sequence: its keys and values `[n_kv, capacity, hd]` and its capacity.
        let kv = guards
            .iter()
            .map(|((kg, kl), (vg, vl))| {
                Ok((cpu_f32(kg, kl)?, cpu_f32(vg, vl)?, kl.shape().dims()[1]))
            })
            .collect::<Result<Vec<_>>>()?;

        // One unit: sequence `si`, kv head `g` -> `[rep, n, hd]` for heads g * rep + r.
        let unit = |&(si, g): &(usize, usize)| -> Vec<f32> {
            let (off, n, past) = spans[si];
            let l = past + n;
            let (kc, vc, cap) = kv[si];
            let kg = &kc[g * cap * hd..(g * cap + l) * hd];
            let vg = &vc[g * cap * hd..(g * cap + l) * hd];
            let mut y = vec![0f32; rep * n * hd];
            let mut sc = vec![0f32; n * l];
            for r in 0..rep {
                let h = g * rep + r;
                let qh = &q_all[(h * total + off) * hd..(h * total + off + n) * hd];
                super::linear::matmul_nt(qh, n, kg, l, hd, &mut sc);
                for i in 0..n {
                    // Row i (position past + i) sees positions 0..=past + i.
                    let row = &mut sc[i * l..i * l + past + i + 1];
                    let mut mx = f32::NEG_INFINITY;
                    for a in row.iter_mut() {
                        *a *= scale;
                        mx = mx.max(*a);
                    }
                    let mut sum = 0f32;
                    for a in row.iter_mut() {
                        *a = (*a - mx).exp();
                        sum += *a;
                    }
                    let yi = &mut y[(r * n + i) * hd..(r * n + i + 1) * hd];
                    for (&p, vj) in row.iter().zip(vg.chunks_exact(hd)) {
                        for (o, &b) in yi.iter_mut().zip(vj) {
                            *o += p * b;
                        }
                    }
                    let inv = 1.0 / sum;
                    for o in yi.iter_mut() {
                        *o *= inv;
                    }
                }
            }
            y
        };
        let units: Vec<(usize, usize)> = (0..batch.len())
            .flat_map(|si| (0..n_kv).map(move |g| (si, g)))
            .collect();
        // Multiply-adds (QK and PV) of the whole step: below ~100k, threads cost more.
        let work: usize = spans
            .iter()
            .map(|&(_, n, past)| 2 * n * (past + n) * hd * n_head)
            .sum();
        let ys: Vec<Vec<f32>> = if work >= 100_000 && units.len() > 1 {
            use rayon::prelude::*;
            units.par_iter().map(unit).collect()
        } else {
            units.iter().map(unit).collect()
        };

        let d = n_head * hd;
        let mut out = vec![0f32; total * d];
        for (&(si, g), y) in units.iter().zip(&ys) {
            let (off, n, _) = spans[si];
            for r in 0..rep {
                let h = g * rep + r;
                for i in 0..n {
                    out[(off + i) * d + h * hd..(off + i) * d + (h + 1) * hd]
                        .copy_from_slice(&y[(r * n + i) * hd..(r * n + i + 1) * hd]);
                }
            }
        }
        Ok(Tensor::from_vec(out, (total, d), &self.device)?)
    }

    /// [`attention_cpu`](Self::attention_cpu) with candle ops (any device).
    #[allow(clippy::too_many_arguments)]
    fn attention_candle(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        batch: &[SeqStep<'_>],
        spans: &[(usize, usize, usize)],
        masks: &[Option<Tensor>],
        li: usize,
        scale: f64,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let rep = n_head / n_kv;
        let mut ys = Vec::with_capacity(batch.len());
        for (si, s) in batch.iter().enumerate() {
            let (off, n, past) = spans[si];
            let l = past + n;
            let k_new = k.narrow(1, off, n)?.contiguous()?;
            let v_new = v.narrow(1, off, n)?.contiguous()?;
            let (k_all, v_all) = s.cache.write(li, &k_new, &v_new)?; // [n_kv, L, hd]
                                                                     // Query heads h = kv * rep + r share kv head `kv`: fold the group into rows.
            let q_s = (q.narrow(1, off, n)?.contiguous()? * scale)?.reshape((n_kv, rep * n, hd))?;
            let att = q_s.matmul(&k_all.t()?)?; // [n_kv, rep * n, L]
            let att = match &masks[si] {
                None => att,
                Some(m) => {
                    att.reshape((n_kv, rep, n, l))?
                        .broadcast_add(m)?
                        .reshape((n_kv, rep * n, l))?
                }
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = att.matmul(&v_all)?; // [n_kv, rep * n, hd]
            let y = y
                .reshape((n_head, n, hd))?
                .transpose(0, 1)?
                .contiguous()?
                .reshape((n, n_head * hd))?;
            ys.push(y);
        }
        Ok(if ys.len() == 1 {
            ys.pop()
                .ok_or_else(|| ModelError::Invalid("empty batch".into()))?
        } else {
            Tensor::cat(&ys, 0)?
        })
    }

    fn forward_impl(
        &self,
        batch: &mut [SeqStep<'_>],
        hidden_layer: Option<usize>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.validate(batch)?;
        let cfg = &self.config;
        let dev = &self.device;
        let (n_head, n_kv, hd) = (cfg.n_head, cfg.n_kv_head, cfg.head_dim);
        let eps = cfg.rms_norm_eps as f32;
        let scale = 1.0 / (hd as f64).sqrt();

        // Row layout of the concatenated batch.
        let total: usize = batch.iter().map(|s| s.tokens.len()).sum();
        let mut ids = Vec::with_capacity(total);
        let mut positions = Vec::with_capacity(total);
        let mut spans = Vec::with_capacity(batch.len()); // (row offset, n, past)
        for s in batch.iter() {
            let past = s.cache.len;
            spans.push((ids.len(), s.tokens.len(), past));
            ids.extend_from_slice(s.tokens);
            positions.extend((past..past + s.tokens.len()).map(|p| p as u32));
        }
        let last_rows: Vec<u32> = spans.iter().map(|&(o, n, _)| (o + n - 1) as u32).collect();
        let last_rows = Tensor::from_vec(last_rows, batch.len(), dev)?;

        for (s, &(_, n, past)) in batch.iter_mut().zip(&spans) {
            s.cache.reserve(past + n, dev)?;
        }

        let ids = Tensor::from_vec(ids, total, dev)?;
        let positions = Tensor::from_vec(positions, total, dev)?;
        let cos = self.cos.index_select(&positions, 0)?; // [T, hd/2]
        let sin = self.sin.index_select(&positions, 0)?;

        // Additive causal masks (candle attention path), only for sequences with more than one
        // new token.
        let masks = spans
            .iter()
            .map(|&(_, n, past)| -> Result<Option<Tensor>> {
                if n == 1 || dev.is_cpu() {
                    return Ok(None);
                }
                let l = past + n;
                let m: Vec<f32> = (0..n)
                    .flat_map(|r| {
                        (0..l).map(move |j| {
                            if j <= past + r {
                                0.0
                            } else {
                                f32::NEG_INFINITY
                            }
                        })
                    })
                    .collect();
                Ok(Some(Tensor::from_vec(m, (n, l), dev)?))
            })
            .collect::<Result<Vec<_>>>()?;

        let mut x = self.embed.embedding(&ids)?; // [T, d]
        let mut hidden = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let q = layer.wq.forward(&h)?;
            let k = layer.wk.forward(&h)?;
            let v = layer.wv.forward(&h)?;
            // [1, heads, T, hd] for rope_i with per-row cos/sin.
            let q = q
                .reshape((1, total, n_head, hd))?
                .transpose(1, 2)?
                .contiguous()?;
            let q = candle_nn::rotary_emb::rope_i(&q, &cos, &sin)?.squeeze(0)?;
            let k = k
                .reshape((1, total, n_kv, hd))?
                .transpose(1, 2)?
                .contiguous()?;
            let k = candle_nn::rotary_emb::rope_i(&k, &cos, &sin)?.squeeze(0)?;
            let v = v.reshape((total, n_kv, hd))?.transpose(0, 1)?; // [n_kv, T, hd]

            let y = if dev.is_cpu() {
                self.attention_cpu(&q, &k, &v, batch, &spans, li, scale as f32)?
            } else {
                self.attention_candle(&q, &k, &v, batch, &spans, &masks, li, scale)?
            };
            x = (x + layer.wo.forward(&y)?)?;

            let h = candle_nn::ops::rms_norm(&x, &layer.ffn_norm, eps)?;
            let g = candle_nn::ops::silu(&layer.w_gate.forward(&h)?)?;
            let u = layer.w_up.forward(&h)?;
            x = (x + layer.w_down.forward(&(g * u)?)?)?;

            if hidden_layer == Some(li) {
                hidden = Some(x.index_select(&last_rows, 0)?);
            }
        }

        let x = x.index_select(&last_rows, 0)?; // [B, d]
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        let logits = self.output.forward(&x)?.to_dtype(DType::F32)?;

        // Only now, with every layer written, do the caches advance.
        for (s, &(_, n, _)) in batch.iter_mut().zip(&spans) {
            s.cache.len += n;
        }
        Ok((logits, hidden))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}
    fn assert_send<T: Send>() {}

    #[test]
    fn model_is_send_sync_and_cache_is_send() {
        assert_send_sync::<QuantizedLlama>();
        assert_send::<KvCache>();
        assert_send_sync::<ChatTokenizer>();
    }
}
