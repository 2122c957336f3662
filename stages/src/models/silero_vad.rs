//! Silero VAD v6, 16 kHz, in candle: one speech probability per 512-sample (32 ms)
//! window, with the recurrent state carried across windows so a stream costs one
//! small step per window (31.25 steps per second of audio).
//!
//! One step, as in silero-vad 6.2.3 (`tinygrad_model.py`, and the 16 kHz branch of
//! `silero_vad.onnx`):
//! 1. input = the previous step's last 64 samples (zeros at the start) + the 512 new
//!    ones (576), reflection-padded by 64 on the right (640);
//! 2. `stft_conv`: conv1d with the 258 x 1 x 256 basis, stride 128 (4 frames); the
//!    first 129 channels are the real parts, the rest the imaginary parts ->
//!    magnitude sqrt(re^2 + im^2) (129 x 4);
//! 3. `conv1`..`conv4`: conv1d kernel 3, padding 1, strides 1, 2, 2, 1, each + ReLU
//!    (129 -> 128 -> 64 -> 64 -> 128 channels, 4 -> 4 -> 2 -> 1 -> 1 frames);
//! 4. `lstm_cell`: one PyTorch LSTMCell step (gates i, f, g, o) on the 128 features
//!    with the carried (h, c);
//! 5. ReLU(h) -> `final_conv` (1x1, 128 -> 1) -> sigmoid = speech probability.
//!
//! Weights: [`SileroVad::load`] reads either file silero-vad ships.
//! * `silero_vad_16k.safetensors` (tinygrad names, the field names here);
//! * `silero_vad.onnx` (the 16 kHz branch's constants: `stft.forward_basis_buffer`,
//!   `encoder.{0..3}.reparam_conv.*`, `decoder.rnn.*`, `decoder.decoder.2.*`, mapped
//!   one to one by [`ONNX_NAMES`]).
//!
//! The two files of silero-vad 6.2.3 hold DIFFERENT weights (only the STFT basis is
//! equal): the `.onnx` is the model the package runs by default (its weights are those
//! of `silero_vad.jit`), the `.safetensors` another checkpoint of the same network.
//! Probabilities differ by up to ~0.8 on single windows of speech (see
//! `scripts/fixtures/silero_vad_reference.py`); the tests check each file against
//! onnxruntime running the same graph with that file's weights.
//!
//! Execution: candle reads the weights; a step runs on the calling thread, the three
//! products that matter (STFT 4x256x258, `conv1` 4x387x128, LSTM 1x256x512) through
//! [`matmul_nt`] with the glue on host buffers (see `dense` for why not candle's
//! matmul). ~75 us of CPU per step on the 2-core dev VM (AVX2): ~2.4 ms per second
//! of audio (`cargo run -p omnistream-stages --example vad_cost`).

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use candle_onnx::onnx;

use crate::models::linear::matmul_nt;
use crate::models::{ModelError, Result};

/// File names in `models/silero-vad` (as `omnistream fetch-models` unpacks them).
pub const ONNX_FILE: &str = "silero_vad.onnx";
pub const SAFETENSORS_FILE: &str = "silero_vad_16k.safetensors";

/// safetensors (tinygrad) name -> name in the ONNX graph (after the branch prefix).
pub const ONNX_NAMES: [(&str, &str); 15] = [
    ("stft_conv.weight", "stft.forward_basis_buffer"),
    ("conv1.weight", "encoder.0.reparam_conv.weight"),
    ("conv1.bias", "encoder.0.reparam_conv.bias"),
    ("conv2.weight", "encoder.1.reparam_conv.weight"),
    ("conv2.bias", "encoder.1.reparam_conv.bias"),
    ("conv3.weight", "encoder.2.reparam_conv.weight"),
    ("conv3.bias", "encoder.2.reparam_conv.bias"),
    ("conv4.weight", "encoder.3.reparam_conv.weight"),
    ("conv4.bias", "encoder.3.reparam_conv.bias"),
    ("lstm_cell.weight_ih", "decoder.rnn.weight_ih"),
    ("lstm_cell.weight_hh", "decoder.rnn.weight_hh"),
    ("lstm_cell.bias_ih", "decoder.rnn.bias_ih"),
    ("lstm_cell.bias_hh", "decoder.rnn.bias_hh"),
    ("final_conv.weight", "decoder.decoder.2.weight"),
    ("final_conv.bias", "decoder.decoder.2.bias"),
];

/// The fixed geometry of the 16 kHz model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SileroVadConfig {
    pub sample_rate: u32,
    /// New samples per step.
    pub window: usize,
    /// Samples of the previous step prepended to each window.
    pub context: usize,
    /// STFT size (kernel of `stft_conv`); `n_fft / 2 + 1` frequency bins.
    pub n_fft: usize,
    /// STFT hop (stride of `stft_conv`).
    pub hop: usize,
    /// Right reflection padding before the STFT.
    pub pad: usize,
    /// Strides of `conv1`..`conv4` (kernel 3, padding 1 each).
    pub encoder_strides: [usize; 4],
    /// LSTM width.
    pub hidden: usize,
}

impl Default for SileroVadConfig {
    fn default() -> Self {
        Self {
            sample_rate: 16_000,
            window: 512,
            context: 64,
            n_fft: 256,
            hop: 128,
            pad: 64,
            encoder_strides: [1, 2, 2, 1],
            hidden: 128,
        }
    }
}

impl SileroVadConfig {
    /// Frequency bins of the magnitude spectrogram.
    pub fn bins(&self) -> usize {
        self.n_fft / 2 + 1
    }

    /// STFT frames per step.
    fn frames(&self) -> usize {
        (self.context + self.window + self.pad).saturating_sub(self.n_fft) / self.hop + 1
    }

    /// Frames left after the encoder (the LSTM cell needs exactly one).
    fn encoder_frames(&self) -> usize {
        self.encoder_strides
            .iter()
            .fold(self.frames(), |t, &s| (t + 2 - 3) / s.max(1) + 1)
    }

    fn validate(&self) -> Result<()> {
        let input = self.context + self.window;
        // Reflection padding reads `pad + 1` samples back from the end.
        if self.pad >= input || input + self.pad < self.n_fft || self.hop == 0 {
            return Err(ModelError::Invalid(format!(
                "silero vad: bad geometry {self:?}"
            )));
        }
        if self.encoder_frames() != 1 {
            return Err(ModelError::Invalid(format!(
                "silero vad: the encoder leaves {} frames, the LSTM cell needs 1",
                self.encoder_frames()
            )));
        }
        Ok(())
    }
}

/// Per-stream state: the context samples and the LSTM state. Reset it between
/// unrelated streams.
#[derive(Debug, Clone, PartialEq)]
pub struct VadState {
    context: Vec<f32>,
    h: Vec<f32>,
    c: Vec<f32>,
}

impl VadState {
    pub fn new(config: &SileroVadConfig) -> Self {
        Self {
            context: vec![0.0; config.context],
            h: vec![0.0; config.hidden],
            c: vec![0.0; config.hidden],
        }
    }

    /// Back to the start-of-stream state (zeros everywhere).
    pub fn reset(&mut self) {
        self.context.fill(0.0);
        self.h.fill(0.0);
        self.c.fill(0.0);
    }
}

/// One encoder layer: conv1d (kernel 3, padding 1) + bias + ReLU, as im2col + one
/// product on time-major rows.
#[derive(Debug, Clone)]
struct EncoderConv {
    /// The (out, in, 3) kernel as (out, 3 * in): column `k * in + c`.
    weight: Vec<f32>,
    bias: Vec<f32>,
    c_in: usize,
    c_out: usize,
    stride: usize,
}

impl EncoderConv {
    /// `x`: (t_in, c_in) time-major -> ((t_out, c_out), t_out).
    fn forward(&self, x: &[f32], t_in: usize) -> (Vec<f32>, usize) {
        let (c_in, c_out) = (self.c_in, self.c_out);
        let t_out = (t_in + 2 - 3) / self.stride + 1;
        let mut cols = vec![0f32; t_out * 3 * c_in];
        for t in 0..t_out {
            for k in 0..3 {
                // Input frame t * stride + k - 1; outside [0, t_in) is the zero padding.
                let Some(src) = (t * self.stride + k).checked_sub(1) else {
                    continue;
                };
                if src < t_in {
                    let dst = (t * 3 + k) * c_in;
                    cols[dst..dst + c_in].copy_from_slice(&x[src * c_in..(src + 1) * c_in]);
                }
            }
        }
        let mut y = dense(&cols, t_out, &self.weight, c_out, 3 * c_in);
        for row in y.chunks_exact_mut(c_out) {
            for (v, b) in row.iter_mut().zip(&self.bias) {
                *v = (*v + b).max(0.0);
            }
        }
        (y, t_out)
    }
}

/// Output rows of `w` per [`matmul_nt`] call. With k <= 512 a call holds at most
/// 128 KiB of weights, that kernel's least task size, so it runs as one block on the
/// calling thread instead of splitting over rayon.
const DENSE_ROWS: usize = 64;

/// `x` (m, k) times `w` (n, k) transposed -> (m, n), on the calling thread.
///
/// Why not candle's matmul: at these shapes (m <= 4, k <= 387) its gemm costs 2-4x
/// more per call, and both it and the parallel path of `matmul_nt` hand work to
/// rayon's global pool, where a 32 ms VAD step would queue behind LLM matmuls.
fn dense(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    let mut block = vec![0f32; m * DENSE_ROWS.min(n)];
    for n0 in (0..n).step_by(DENSE_ROWS) {
        let nb = DENSE_ROWS.min(n - n0);
        matmul_nt(x, m, &w[n0 * k..(n0 + nb) * k], nb, k, &mut block[..m * nb]);
        for (i, row) in block[..m * nb].chunks_exact(nb).enumerate() {
            out[i * n + n0..i * n + n0 + nb].copy_from_slice(row);
        }
    }
    out
}

/// PyTorch `LSTMCell`, the two products fused into one over `[x, h]`.
#[derive(Debug, Clone)]
struct LstmCell {
    /// `[weight_ih | weight_hh]`: (4 * hidden, input + hidden), gate order i, f, g, o.
    weight: Vec<f32>,
    /// `bias_ih + bias_hh`.
    bias: Vec<f32>,
}

/// `final_conv` (1x1, hidden -> 1), kept on the host: one 128-long dot product.
#[derive(Debug, Clone)]
struct FinalConv {
    weight: Vec<f32>,
    bias: f32,
}

/// The Silero VAD v6 16 kHz network. Immutable and `Sync`: one instance serves any
/// number of streams, each with its own [`VadState`].
#[derive(Debug, Clone)]
pub struct SileroVad {
    config: SileroVadConfig,
    /// `stft_conv.weight`: (2 * bins, n_fft).
    stft_conv: Vec<f32>,
    conv: [EncoderConv; 4],
    lstm_cell: LstmCell,
    final_conv: FinalConv,
}

fn format_err(path: &Path, msg: impl Into<String>) -> ModelError {
    ModelError::Format {
        path: path.to_path_buf(),
        msg: msg.into(),
    }
}

/// The safetensors-named tensors of an ONNX export: the 16 kHz branch is the one whose
/// STFT basis has `2 * (n_fft / 2 + 1)` rows (the 8 kHz branch has 130).
fn onnx_tensors(
    path: &Path,
    config: &SileroVadConfig,
    device: &Device,
) -> Result<HashMap<String, Tensor>> {
    let model = candle_onnx::read_file(path).map_err(|e| format_err(path, e.to_string()))?;
    let graph = model
        .graph
        .as_ref()
        .ok_or_else(|| format_err(path, "the model has no graph"))?;
    // Weights are initializers in some exports and Constant nodes inside the `If`
    // branches in others (silero_vad.onnx): collect both, subgraphs included.
    let mut found: HashMap<&str, &onnx::TensorProto> = HashMap::new();
    let mut stack = vec![graph];
    while let Some(g) = stack.pop() {
        for t in &g.initializer {
            found.insert(t.name.as_str(), t);
        }
        for n in &g.node {
            for a in &n.attribute {
                if let Some(sub) = &a.g {
                    stack.push(sub);
                }
                stack.extend(a.graphs.iter());
                if n.op_type == "Constant" && a.name == "value" {
                    if let (Some(t), Some(out)) = (&a.t, n.output.first()) {
                        found.insert(out.as_str(), t);
                    }
                }
            }
        }
    }
    let basis_dims = [2 * config.bins() as i64, 1, config.n_fft as i64];
    let basis_name = ONNX_NAMES[0].1;
    let prefix = found
        .iter()
        .find(|(name, t)| name.ends_with(basis_name) && t.dims == basis_dims)
        .map(|(name, _)| &name[..name.len() - basis_name.len()])
        .ok_or_else(|| {
            format_err(
                path,
                format!("no {basis_name} of shape {basis_dims:?} (not a 16 kHz silero vad?)"),
            )
        })?;
    let mut out = HashMap::new();
    for (st_name, onnx_name) in ONNX_NAMES {
        let full = format!("{prefix}{onnx_name}");
        let t = found
            .get(full.as_str())
            .ok_or_else(|| format_err(path, format!("missing {full}")))?;
        out.insert(st_name.to_string(), tensor_from_proto(path, t, device)?);
    }
    Ok(out)
}

/// A float TensorProto (raw little-endian bytes or `float_data`) -> Tensor.
fn tensor_from_proto(path: &Path, t: &onnx::TensorProto, device: &Device) -> Result<Tensor> {
    const FLOAT: i32 = 1;
    let name = &t.name;
    if t.data_type != FLOAT {
        return Err(format_err(
            path,
            format!("{name}: data type {}, not float", t.data_type),
        ));
    }
    if t.data_location != 0 || !t.external_data.is_empty() {
        return Err(format_err(
            path,
            format!("{name}: external data is not supported"),
        ));
    }
    let dims = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|_| format_err(path, format!("{name}: negative dim in {:?}", t.dims)))?;
    let numel: usize = dims.iter().product();
    let data: Vec<f32> = if !t.float_data.is_empty() {
        t.float_data.clone()
    } else {
        t.raw_data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    if data.len() != numel || (t.float_data.is_empty() && t.raw_data.len() != numel * 4) {
        return Err(format_err(
            path,
            format!("{name}: {} values for shape {dims:?}", data.len()),
        ));
    }
    Ok(Tensor::from_vec(data, dims, device)?)
}

/// Takes `name` out of `w`, checking its shape.
fn take(
    path: &Path,
    w: &mut HashMap<String, Tensor>,
    name: &str,
    shape: &[usize],
) -> Result<Tensor> {
    let t = w
        .remove(name)
        .ok_or_else(|| format_err(path, format!("missing tensor {name}")))?;
    if t.dims() != shape {
        return Err(format_err(
            path,
            format!("{name}: shape {:?}, expected {shape:?}", t.dims()),
        ));
    }
    Ok(t.to_dtype(candle_core::DType::F32)?)
}

impl SileroVad {
    /// Loads `silero_vad_16k.safetensors` or `silero_vad.onnx` (by extension). The
    /// tensors are read on `device`, then kept on the host, where steps run.
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        Self::load_with_config(path, SileroVadConfig::default(), device)
    }

    pub fn load_with_config(path: &Path, config: SileroVadConfig, device: &Device) -> Result<Self> {
        config.validate()?;
        if !path.is_file() {
            return Err(ModelError::Io {
                path: path.to_path_buf(),
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let weights = match path.extension().and_then(|e| e.to_str()) {
            Some("safetensors") => {
                let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                candle_core::safetensors::load_buffer(&bytes, device)
                    .map_err(|e| format_err(path, e.to_string()))?
            }
            Some("onnx") => onnx_tensors(path, &config, device)?,
            _ => {
                return Err(format_err(
                    path,
                    "expected a .safetensors or .onnx silero vad file",
                ))
            }
        };
        Self::from_tensors(path, weights, config)
    }

    /// Builds the model from safetensors-named tensors; `path` only labels errors.
    pub fn from_tensors(
        path: &Path,
        mut w: HashMap<String, Tensor>,
        config: SileroVadConfig,
    ) -> Result<Self> {
        config.validate()?;
        let bins = config.bins();
        let hid = config.hidden;
        // Weights become host (out, in) matrices for `dense`.
        let stft_conv = take(
            path,
            &mut w,
            "stft_conv.weight",
            &[2 * bins, 1, config.n_fft],
        )?
        .flatten_all()?
        .to_vec1::<f32>()?;

        // Channel counts come from the weights; each layer must feed the next.
        let mut conv = Vec::with_capacity(4);
        let mut c_in = bins;
        for (i, &stride) in config.encoder_strides.iter().enumerate() {
            let name = format!("conv{}", i + 1);
            let c_out = w
                .get(&format!("{name}.weight"))
                .map(|t| t.dims().first().copied().unwrap_or(0))
                .ok_or_else(|| format_err(path, format!("missing tensor {name}.weight")))?;
            let weight = take(path, &mut w, &format!("{name}.weight"), &[c_out, c_in, 3])?
                .permute((0, 2, 1))?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let bias = take(path, &mut w, &format!("{name}.bias"), &[c_out])?.to_vec1::<f32>()?;
            conv.push(EncoderConv {
                weight,
                bias,
                c_in,
                c_out,
                stride,
            });
            c_in = c_out;
        }
        let conv: [EncoderConv; 4] = conv
            .try_into()
            .map_err(|_| format_err(path, "expected 4 encoder convs"))?;

        let w_ih = take(path, &mut w, "lstm_cell.weight_ih", &[4 * hid, c_in])?;
        let w_hh = take(path, &mut w, "lstm_cell.weight_hh", &[4 * hid, hid])?;
        let b_ih = take(path, &mut w, "lstm_cell.bias_ih", &[4 * hid])?;
        let b_hh = take(path, &mut w, "lstm_cell.bias_hh", &[4 * hid])?;
        let lstm_cell = LstmCell {
            weight: Tensor::cat(&[&w_ih, &w_hh], 1)?
                .flatten_all()?
                .to_vec1::<f32>()?,
            bias: (b_ih + b_hh)?.to_vec1::<f32>()?,
        };
        let fw = take(path, &mut w, "final_conv.weight", &[1, hid, 1])?;
        let fb = take(path, &mut w, "final_conv.bias", &[1])?;
        let final_conv = FinalConv {
            weight: fw.flatten_all()?.to_vec1::<f32>()?,
            bias: fb.to_vec1::<f32>()?[0],
        };
        Ok(Self {
            config,
            stft_conv,
            conv,
            lstm_cell,
            final_conv,
        })
    }

    pub fn config(&self) -> &SileroVadConfig {
        &self.config
    }

    /// A fresh (start-of-stream) state for this model.
    pub fn new_state(&self) -> VadState {
        VadState::new(&self.config)
    }

    /// Runs one window of exactly `config.window` new samples (16 kHz, in [-1, 1])
    /// and returns its speech probability. `state` is only updated on success.
    pub fn step(&self, state: &mut VadState, window: &[f32]) -> Result<f32> {
        let cfg = &self.config;
        if window.len() != cfg.window {
            return Err(ModelError::Invalid(format!(
                "silero vad: a window has {} samples, got {}",
                cfg.window,
                window.len()
            )));
        }
        if state.context.len() != cfg.context
            || state.h.len() != cfg.hidden
            || state.c.len() != cfg.hidden
        {
            return Err(ModelError::Invalid(
                "silero vad: the state was made for another config".into(),
            ));
        }
        // A NaN would poison the LSTM state for the rest of the stream.
        if let Some(bad) = window.iter().find(|s| !s.is_finite()) {
            return Err(ModelError::Invalid(format!(
                "silero vad: non-finite sample {bad}"
            )));
        }

        let n = cfg.context + cfg.window;
        let mut x = Vec::with_capacity(n + cfg.pad);
        x.extend_from_slice(&state.context);
        x.extend_from_slice(window);
        // Reflection (not repeating the edge): x[n + j] = x[n - 2 - j].
        for j in 0..cfg.pad {
            x.push(x[n - 2 - j]);
        }
        let next_context = x[n - cfg.context..n].to_vec();

        // STFT: frame f is x[f * hop..f * hop + n_fft]; one gemm for all frames.
        // Channels 0..bins of the result are real parts, bins..2 bins imaginary.
        let frames = cfg.frames();
        let mut cols = Vec::with_capacity(frames * cfg.n_fft);
        for f in 0..frames {
            cols.extend_from_slice(&x[f * cfg.hop..f * cfg.hop + cfg.n_fft]);
        }
        let bins = cfg.bins();
        let spec = dense(&cols, frames, &self.stft_conv, 2 * bins, cfg.n_fft);
        // Time-major (frames, bins) magnitudes.
        let mut y: Vec<f32> = spec
            .chunks_exact(2 * bins)
            .flat_map(|row| {
                let (re, im) = row.split_at(bins);
                re.iter().zip(im).map(|(r, i)| (r * r + i * i).sqrt())
            })
            .collect();
        let mut t = frames;
        for conv in &self.conv {
            (y, t) = conv.forward(&y, t);
        }
        // The config check at load guarantees one frame is left.
        debug_assert_eq!(t, 1);

        // LSTM cell: gates = [x, h] W + b, then the elementwise rest on the host.
        let hid = cfg.hidden;
        let mut xh = y;
        xh.extend_from_slice(&state.h);
        let gates = dense(&xh, 1, &self.lstm_cell.weight, 4 * hid, xh.len());
        let gate = |k: usize, j: usize| gates[k * hid + j] + self.lstm_cell.bias[k * hid + j];
        let mut h = vec![0f32; hid];
        let mut c = vec![0f32; hid];
        for j in 0..hid {
            let i = sigmoid(gate(0, j));
            let f = sigmoid(gate(1, j));
            let g = gate(2, j).tanh();
            let o = sigmoid(gate(3, j));
            c[j] = f * state.c[j] + i * g;
            h[j] = o * c[j].tanh();
        }

        let logit = h
            .iter()
            .zip(&self.final_conv.weight)
            .map(|(&h, &w)| h.max(0.0) * w)
            .sum::<f32>()
            + self.final_conv.bias;

        state.context = next_context;
        state.h = h;
        state.c = c;
        Ok(sigmoid(logit))
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

#[cfg(test)]
pub(crate) mod testdata {
    //! Fixture access shared with the segmenter tests.

    use std::path::{Path, PathBuf};

    use super::*;

    pub fn model_path(file: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../models/silero-vad")
            .join(file)
    }

    /// The model, or None (after a message) when `omnistream fetch-models` has not
    /// put the file in models/.
    pub fn load(file: &str) -> Option<SileroVad> {
        let p = model_path(file);
        if !p.exists() {
            eprintln!("SKIP: {} not found", p.display());
            return None;
        }
        Some(SileroVad::load(&p, &Device::Cpu).expect("loading silero vad"))
    }

    pub fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("testdata/silero_vad")
            .join(name)
    }

    /// A 16 kHz mono 16-bit PCM WAV fixture as samples / 32768.
    pub fn read_wav(name: &str) -> Vec<f32> {
        let bytes = std::fs::read(fixture(name)).expect("fixture wav");
        assert_eq!(&bytes[0..4], b"RIFF");
        assert_eq!(&bytes[8..12], b"WAVE");
        let mut at = 12;
        let mut fmt_ok = false;
        while at + 8 <= bytes.len() {
            let id = &bytes[at..at + 4];
            let len =
                u32::from_le_bytes([bytes[at + 4], bytes[at + 5], bytes[at + 6], bytes[at + 7]])
                    as usize;
            let body = &bytes[at + 8..(at + 8 + len).min(bytes.len())];
            if id == b"fmt " {
                let channels = u16::from_le_bytes([body[2], body[3]]);
                let rate = u32::from_le_bytes([body[4], body[5], body[6], body[7]]);
                let bits = u16::from_le_bytes([body[14], body[15]]);
                assert_eq!((channels, rate, bits), (1, 16_000, 16), "{name}");
                fmt_ok = true;
            } else if id == b"data" {
                assert!(fmt_ok, "{name}: data before fmt");
                return body
                    .chunks_exact(2)
                    .map(|b| i16::from_le_bytes([b[0], b[1]]) as f32 / 32768.0)
                    .collect();
            }
            at += 8 + len + (len & 1);
        }
        panic!("{name}: no data chunk");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::testdata::*;
    use super::*;

    /// Tolerance on each window's probability against onnxruntime.
    const MAX_ABS_PROB: f32 = 1e-3;
    const FIXTURES: [&str; 4] = ["silence", "noise", "speech", "mix"];

    fn reference(name: &str, series: &str) -> (Vec<f32>, Vec<f32>) {
        let text = std::fs::read_to_string(fixture(&format!("{name}.json"))).expect("fixture");
        let doc: serde_json::Value = serde_json::from_str(&text).expect("fixture json");
        let probs: Vec<f32> = doc[series]
            .as_array()
            .expect("series")
            .iter()
            .map(|v| v.as_f64().expect("probability") as f32)
            .collect();
        let audio = read_wav(doc["wav"].as_str().expect("wav name"));
        assert_eq!(probs.len(), audio.len() / 512, "{name}");
        (audio, probs)
    }

    /// Every window of every fixture, for one weights file against its series.
    fn check_file(file: &str, series: &str) {
        let Some(vad) = load(file) else { return };
        let mut worst = 0f32;
        let mut windows = 0;
        let t = Instant::now();
        for name in FIXTURES {
            let (audio, want) = reference(name, series);
            let mut state = vad.new_state();
            let mut max_err = 0f32;
            for (i, (w, &p_ref)) in audio.chunks_exact(512).zip(&want).enumerate() {
                let p = vad.step(&mut state, w).expect("step");
                let err = (p - p_ref).abs();
                assert!(
                    err < MAX_ABS_PROB,
                    "{file} {name} window {i}: candle {p} vs onnxruntime {p_ref}"
                );
                max_err = max_err.max(err);
            }
            windows += want.len();
            eprintln!(
                "{file} {name}: {} windows, max |dp| {max_err:.2e}",
                want.len()
            );
            worst = worst.max(max_err);
        }
        eprintln!(
            "{file}: max |p_candle - p_onnxruntime| = {worst:.2e} over {windows} windows ({:.1?})",
            t.elapsed()
        );
    }

    #[test]
    fn onnx_weights_match_onnxruntime() {
        check_file(ONNX_FILE, "onnx");
    }

    #[test]
    fn safetensors_weights_match_onnxruntime() {
        check_file(SAFETENSORS_FILE, "safetensors");
    }

    #[test]
    fn rejects_bad_windows_and_keeps_state() {
        let Some(vad) = load(ONNX_FILE) else { return };
        let mut state = vad.new_state();
        let fresh = state.clone();
        for len in [0, 511, 513, 576] {
            let err = vad.step(&mut state, &vec![0.0; len]).unwrap_err();
            assert!(matches!(err, ModelError::Invalid(_)), "{err}");
        }
        let mut w = vec![0.1f32; 512];
        w[7] = f32::NAN;
        assert!(matches!(
            vad.step(&mut state, &w),
            Err(ModelError::Invalid(_))
        ));
        w[7] = f32::INFINITY;
        assert!(matches!(
            vad.step(&mut state, &w),
            Err(ModelError::Invalid(_))
        ));
        assert_eq!(state, fresh);
    }

    #[test]
    fn reset_replays_the_stream() {
        let Some(vad) = load(ONNX_FILE) else { return };
        let audio = read_wav("speech.wav");
        let mut state = vad.new_state();
        let run = |state: &mut VadState| -> Vec<f32> {
            audio
                .chunks_exact(512)
                .take(40)
                .map(|w| vad.step(state, w).expect("step"))
                .collect()
        };
        let first = run(&mut state);
        assert_ne!(state, vad.new_state());
        state.reset();
        assert_eq!(state, vad.new_state());
        assert_eq!(run(&mut state), first);
    }

    #[test]
    fn load_errors_are_typed() {
        let missing = Path::new("/nonexistent/silero_vad.onnx");
        assert!(matches!(
            SileroVad::load(missing, &Device::Cpu),
            Err(ModelError::Io { .. })
        ));
        let dir = tempfile::tempdir().expect("tempdir");
        let txt = dir.path().join("vad.bin");
        std::fs::write(&txt, b"not a model").expect("write");
        assert!(matches!(
            SileroVad::load(&txt, &Device::Cpu),
            Err(ModelError::Format { .. })
        ));
        for name in ["vad.onnx", "vad.safetensors"] {
            let p = dir.path().join(name);
            std::fs::write(&p, b"\x08\x01garbage").expect("write");
            assert!(matches!(
                SileroVad::load(&p, &Device::Cpu),
                Err(ModelError::Format { .. })
            ));
        }
    }

    #[test]
    fn model_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<SileroVad>();
        assert_send_sync::<VadState>();
    }
}
