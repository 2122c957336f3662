//! Speech recognition with an English-only Whisper (tiny.en) read from a CTranslate2 folder
//! (`model.bin`, `config.json`, `vocabulary.txt`, `tokenizer.json`, as faster-whisper uses it)
//! and run on the CPU by [`model`] (this crate's kernels, HF module names).
//!
//! * Weights: CTranslate2's variables are renamed to candle's (HF) names, fp16 -> f32, the
//!   fused self-attention QKV and cross-attention KV projections split. The key projection
//!   bias CTranslate2 stores (zeros: Whisper's keys have none) is dropped — a key bias only
//!   adds a per-query constant to the attention logits, which softmax cancels. The decoder's
//!   output projection must be the token embedding (CTranslate2 stores it as an alias), since
//!   the decoder here ties them.
//! * Front end: faster-whisper's `FeatureExtractor` (which is what the reference transcripts
//!   come from), not candle's `pcm_to_mel`: 160 zero samples appended, centered (reflect
//!   padded) STFT, periodic Hann window, n_fft 400, hop 160, power spectrum, slaney mel
//!   filterbank, log10 (clamped at 1e-10 and at max - 8), (x + 4) / 4; each 30 s window is
//!   the audio's frames zero-padded to 3000. candle's whisper.cpp-style `pcm_to_mel` frames
//!   without centering (a 200-sample shift), doubles the power of all but the DC / Nyquist
//!   bins, and pads the audio rather than the features, so it would not match.
//! * Decoding: greedy, as CTranslate2's `Whisper.generate` with faster-whisper's
//!   `transcribe(beam_size=1, temperature=0, without_timestamps=True,
//!   condition_on_previous_text=False)`: prompt `<|startoftranscript|><|notimestamps|>` (an
//!   English-only model has no language / task tokens), `suppress_ids` masked at every step
//!   and `suppress_ids_begin` at the first, at most 224 new tokens, stop at `<|endoftext|>`.
//!   A window whose no-speech probability is above 0.6 while its mean log-probability is
//!   below -1 is dropped (faster-whisper's defaults).
//! * Silence and noise: that rule alone lets tiny.en's hallucinations through, since they are
//!   confident (measured: digital silence gives "you" at no-speech 0.95 but mean log-prob
//!   -0.38; white noise at -60 dBFS gives " ." 224 times at -0.05). So a window whose
//!   loudest 100 ms is below -60 dBFS RMS is not decoded at all, and a decode that ends in a
//!   loop (a unit of <= 16 tokens repeated >= 4 times over >= 32 tokens) stops there, is cut to
//!   one copy of the unit and does not count as confident. The Listener stage also removes
//!   non-speech with Silero VAD first when the profile has one (`crate::vad::SpeechFilter`).
//!
//! Cost: candle-transformers' Whisper (used here before) spent 1.7 s per 30 s window in the
//! encoder (candle's CPU gemm) and reran the whole prefix at every decoder step; the network in
//! [`model`] runs every product on [`crate::models::linear::matmul_nt`] and keeps a KV
//! cache (`docs/bench/voice.md` has the figures).

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};
use candle_transformers::models::whisper as cw;
use rayon::prelude::*;
use tokenizers::Tokenizer;

use ct2::Ct2Model;
use model::{WeightSource, WhisperNet, WhisperNetConfig};
pub mod ct2;
pub mod model;

use crate::models::{ModelError, Result};

/// Decoding settings (faster-whisper's defaults for greedy decoding).
#[derive(Debug, Clone, PartialEq)]
pub struct WhisperConfig {
    /// Most tokens generated per 30 s window (CTranslate2 caps it at half the text context).
    pub max_new_tokens: usize,
    /// Drop a window whose `<|nocaptions|>` probability at the start of the transcript is above
    /// this ... (None: never drop).
    pub no_speech_threshold: Option<f32>,
    /// ... unless its mean token log-probability is above this (and the decoder did not loop).
    pub logprob_threshold: Option<f32>,
    /// Skip, without running the model, a window whose loudest 100 ms is quieter than this
    /// (RMS, dBFS; None: decode every window). Whisper normalises its input's level, so it
    /// makes words up on near-digital silence ("you") at high confidence.
    pub silence_dbfs: Option<f32>,
}

impl Default for WhisperConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 224,
            no_speech_threshold: Some(0.6),
            logprob_threshold: Some(-1.0),
            silence_dbfs: Some(-60.0),
        }
    }
}

/// The loop guard: decoding stops once the last tokens repeat a unit of at most
/// `LOOP_MAX_PERIOD` tokens at least `LOOP_MIN_REPEATS` times over at least `LOOP_MIN_TOKENS`
/// tokens. On noise tiny.en writes " ." until the token cap (224 of them, ~4x the time of a
/// window of speech) with a mean log-probability near 0, which passes the no-speech rule.
/// Speech hardly repeats itself back to back over 32 tokens (a word 32 times, an 8-token
/// phrase 4 times).
const LOOP_MAX_PERIOD: usize = 16;
const LOOP_MIN_REPEATS: usize = 4;
const LOOP_MIN_TOKENS: usize = 32;

/// Samples over which the silence check measures the level (100 ms).
const LEVEL_FRAME: usize = SAMPLE_RATE / 10;

pub const SAMPLE_RATE: usize = cw::SAMPLE_RATE;
pub const N_FFT: usize = cw::N_FFT;
pub const HOP_LENGTH: usize = cw::HOP_LENGTH;
/// Mel frames per 30 s window (the encoder's fixed input length).
pub const N_FRAMES: usize = cw::N_FRAMES;

/// A transcript with where the time went.
#[derive(Debug, Clone, Default)]
pub struct Transcript {
    pub text: String,
    /// Generated token ids of every kept window (without the prompt and `<|endoftext|>`).
    pub tokens: Vec<u32>,
    pub windows: usize,
    pub mel_s: f64,
    pub encoder_s: f64,
    pub decoder_s: f64,
    /// Every 30 s window, in order: how loud it was, what the decoder made of it.
    pub window_stats: Vec<WindowStats>,
}

/// One 30 s window of a transcription.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowStats {
    /// RMS of its loudest 100 ms, in dBFS (-inf for digital silence).
    pub loudest_dbfs: f32,
    /// None: skipped as near-silent ([`WhisperConfig::silence_dbfs`]), never decoded.
    pub decode: Option<DecodeStats>,
    /// Whether its text went into the transcript.
    pub kept: bool,
}

/// What the no-speech rule saw in one decoded window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecodeStats {
    /// Probability of `<|nospeech|>` right after `<|startoftranscript|>`.
    pub no_speech_prob: f32,
    /// Mean log-probability of the generated tokens (the end token included).
    pub avg_logprob: f64,
    /// Tokens generated (without `<|endoftext|>`).
    pub tokens: usize,
    /// Whether the loop guard stopped it (the loop is cut to one copy of its unit).
    pub looped: bool,
}

/// Token ids the decoder needs (from `vocabulary.txt`, checked against `tokenizer.json`).
#[derive(Debug, Clone, Copy)]
struct Special {
    eot: u32,
    sot: u32,
    no_timestamps: u32,
    no_speech: Option<u32>,
}

/// Whisper recognizer. `transcribe` takes `&self`: each call decodes with its own
/// [`model::DecoderState`]; the weights are shared.
pub struct WhisperAsr {
    net: WhisperNet,
    cfg: cw::Config,
    tokenizer: Tokenizer,
    mel: MelFrontEnd,
    special: Special,
    suppress: Vec<u32>,
    suppress_begin: Vec<u32>,
    config: WhisperConfig,
    device: Device,
}

impl WhisperAsr {
    /// Loads the CTranslate2 folder `dir` with the default [`WhisperConfig`].
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        Self::load_with(dir, device, WhisperConfig::default())
    }

    pub fn load_with(dir: &Path, device: &Device, config: WhisperConfig) -> Result<Self> {
        let ct2 = Ct2Model::read(&dir.join("model.bin"))?;
        // Revision 3 is CTranslate2 4.x's WhisperSpec (the layout mapped here).
        if ct2.spec != "WhisperSpec" || ct2.spec_revision > 3 {
            return Err(ct2.format_err(format!(
                "spec {:?} revision {}, expected WhisperSpec revision <= 3",
                ct2.spec, ct2.spec_revision
            )));
        }
        let cfg = model_config(&ct2)?;
        if cfg.vocab_size == 51865 {
            // CTranslate2's own test for a multilingual model: those need language and task
            // tokens in the prompt, which this recognizer does not write.
            return Err(ct2.format_err("multilingual Whisper models are not supported".into()));
        }
        let weights = candle_weights(&ct2, &cfg, &Device::Cpu)?;
        let net = WhisperNet::load(
            &weights,
            &WhisperNetConfig {
                n_mels: cfg.num_mel_bins,
                d_model: cfg.d_model,
                encoder_heads: cfg.encoder_attention_heads,
                decoder_heads: cfg.decoder_attention_heads,
                encoder_layers: cfg.encoder_layers,
                decoder_layers: cfg.decoder_layers,
                audio_ctx: cfg.max_source_positions,
                text_ctx: cfg.max_target_positions,
                vocab: cfg.vocab_size,
            },
        )?;
        drop(weights);

        let vocab_path = dir.join("vocabulary.txt");
        let vocab = std::fs::read_to_string(&vocab_path).map_err(|source| ModelError::Io {
            path: vocab_path.clone(),
            source,
        })?;
        let vocab: Vec<&str> = vocab.lines().collect();
        if vocab.len() != cfg.vocab_size {
            return Err(ModelError::Format {
                path: vocab_path,
                msg: format!(
                    "{} tokens, the embedding has {} rows",
                    vocab.len(),
                    cfg.vocab_size
                ),
            });
        }
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = Tokenizer::from_file(&tok_path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
        let find = |tok: &str| -> Option<u32> {
            let id = vocab.iter().position(|&t| t == tok)? as u32;
            Some(id)
        };
        let need = |tok: &str| -> Result<u32> {
            let id = find(tok).ok_or_else(|| ModelError::Format {
                path: dir.join("vocabulary.txt"),
                msg: format!("no token {tok}"),
            })?;
            if tokenizer.token_to_id(tok) != Some(id) {
                return Err(ModelError::Tokenizer(format!(
                    "{tok} is {id} in vocabulary.txt but {:?} in tokenizer.json",
                    tokenizer.token_to_id(tok)
                )));
            }
            Ok(id)
        };
        let special = Special {
            eot: need("<|endoftext|>")?,
            sot: need("<|startoftranscript|>")?,
            no_timestamps: need("<|notimestamps|>")?,
            // CTranslate2 falls back to the older name.
            no_speech: find("<|nospeech|>").or_else(|| find("<|nocaptions|>")),
        };

        let (suppress, suppress_begin) = read_suppress_ids(&dir.join("config.json"), &cfg)?;
        Ok(Self {
            net,
            mel: MelFrontEnd::new(cfg.num_mel_bins),
            cfg,
            tokenizer,
            special,
            suppress,
            suppress_begin,
            config,
            device: device.clone(),
        })
    }

    /// candle's model hyper-parameters, as read from the file.
    pub fn model_config(&self) -> &cw::Config {
        &self.cfg
    }

    /// Text of 16 kHz mono audio in [-1, 1]; audio longer than 30 s is decoded in consecutive
    /// 30 s windows.
    pub fn transcribe(&self, pcm_16k: &[f32]) -> Result<String> {
        Ok(self.transcribe_detailed(pcm_16k)?.text)
    }

    /// [`Self::transcribe`] with the tokens and the time spent in each part.
    pub fn transcribe_detailed(&self, pcm_16k: &[f32]) -> Result<Transcript> {
        if pcm_16k.iter().any(|x| !x.is_finite()) {
            return Err(ModelError::Invalid(
                "whisper: audio holds NaN or infinite samples".into(),
            ));
        }
        let mut out = Transcript::default();
        let t = Instant::now();
        let mel = self.mel.log_mel(pcm_16k);
        out.mel_s = t.elapsed().as_secs_f64();
        // faster-whisper decodes the frames but the last (the one centred past the end).
        let content = mel.n_frames.saturating_sub(1);
        let mut seek = 0;
        let mut text = String::new();
        while seek < content {
            let n = (content - seek).min(N_FRAMES);
            // The window's own samples (frame f is centred on sample f * hop).
            let samples = pcm_16k
                .get(seek * HOP_LENGTH..((seek + n) * HOP_LENGTH).min(pcm_16k.len()))
                .unwrap_or_default();
            let loudest_dbfs = loudest_dbfs(samples);
            out.windows += 1;
            if self.config.silence_dbfs.is_some_and(|th| loudest_dbfs < th) {
                out.window_stats.push(WindowStats {
                    loudest_dbfs,
                    decode: None,
                    kept: false,
                });
                seek += n;
                continue;
            }
            let t = Instant::now();
            // Always the full 30 s: tiny.en given a shorter encoder context
            // (whisper.cpp's `audio_ctx`) loops and garbles (measured: 564%
            // WER on the fixtures with the audio + 2 s).
            let window = mel.window(seek, n, N_FRAMES);
            let enc = self.net.encoder.forward(&window, N_FRAMES)?;
            out.encoder_s += t.elapsed().as_secs_f64();
            let t = Instant::now();
            let w = self.decode_window(&enc)?;
            out.decoder_s += t.elapsed().as_secs_f64();
            let keep = !self.no_speech(&w.stats);
            out.window_stats.push(WindowStats {
                loudest_dbfs,
                decode: Some(w.stats),
                kept: keep,
            });
            if keep {
                let tokens = w.tokens;
                // As faster-whisper: text tokens only (timestamps and specials are >= eot).
                let ids: Vec<u32> = tokens
                    .iter()
                    .copied()
                    .filter(|&id| id < self.special.eot)
                    .collect();
                let piece = self
                    .tokenizer
                    .decode(&ids, true)
                    .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
                text.push_str(&piece);
                out.tokens.extend(tokens);
            }
            seek += n;
        }
        out.text = text.trim().to_string();
        Ok(out)
    }

    /// The log-mel features of `pcm_16k`: `[n_mels, n_frames]` row-major with
    /// `n_frames = len / 160 + 1` (faster-whisper's `FeatureExtractor()(audio)`).
    pub fn log_mel(&self, pcm_16k: &[f32]) -> (Vec<f32>, usize) {
        let m = self.mel.log_mel(pcm_16k);
        (m.data, m.n_frames)
    }

    /// Encoder output `[1500, d_model]` of the first 30 s window of `pcm_16k`.
    pub fn encode(&self, pcm_16k: &[f32]) -> Result<Tensor> {
        let mel = self.mel.log_mel(pcm_16k);
        let n = mel.n_frames.saturating_sub(1).min(N_FRAMES);
        let enc = self
            .net
            .encoder
            .forward(&mel.window(0, n, N_FRAMES), N_FRAMES)?;
        let rows = enc.len() / self.cfg.d_model;
        Ok(Tensor::from_vec(
            enc,
            (rows, self.cfg.d_model),
            &self.device,
        )?)
    }

    /// Greedy decoding of one window, with what the no-speech rule reads.
    fn decode_window(&self, enc: &[f32]) -> Result<WindowDecode> {
        let sp = self.special;
        let prompt = [sp.sot, sp.no_timestamps];
        let mut tokens = prompt.to_vec();
        // CTranslate2: min(max_length / 2, max_length - prompt steps), max_length = text ctx.
        let ctx = self.cfg.max_target_positions;
        let max_new = self
            .config
            .max_new_tokens
            .min(ctx / 2)
            .min(ctx.saturating_sub(prompt.len()));
        let mut sum_logprob = 0f64;
        let mut no_speech_prob = 0f32;
        let mut loop_cut = None;
        let dec = &self.net.decoder;
        let d = self.cfg.d_model;
        let mut state = dec.start(enc);
        let mut h = dec.step(&mut state, &prompt)?;
        for step in 0..max_new {
            if step == 0 {
                if let Some(ns) = sp.no_speech {
                    // Probability of "no speech" as the successor of <|startoftranscript|>,
                    // on the raw logits (as CTranslate2).
                    no_speech_prob = softmax_at(&dec.logits(&h[..d], 1), ns as usize);
                }
            }
            let last = &h[h.len() - d..];
            let mut logits = dec.logits(last, 1);
            for &id in &self.suppress {
                logits[id as usize] = f32::NEG_INFINITY;
            }
            if step == 0 {
                for &id in &self.suppress_begin {
                    logits[id as usize] = f32::NEG_INFINITY;
                }
            }
            let (best, best_logit) = argmax(&logits);
            sum_logprob += (best_logit - log_sum_exp(&logits)) as f64;
            if best == sp.eot as usize {
                break;
            }
            tokens.push(best as u32);
            loop_cut = repetition_cut(&tokens[prompt.len()..]);
            if loop_cut.is_some() {
                break;
            }
            if step + 1 < max_new {
                h = dec.step(&mut state, &[best as u32])?;
            }
        }
        let mut generated = tokens.split_off(prompt.len());
        // faster-whisper: cumulative log-prob (the end token's included) / (length + 1).
        let avg_logprob = sum_logprob / (generated.len() + 1) as f64;
        let stats = DecodeStats {
            no_speech_prob,
            avg_logprob,
            tokens: generated.len(),
            looped: loop_cut.is_some(),
        };
        if let Some(keep) = loop_cut {
            generated.truncate(keep);
        }
        Ok(WindowDecode {
            tokens: generated,
            stats,
        })
    }

    /// faster-whisper's rule: a window is dropped when its no-speech probability is above
    /// the threshold, unless the decoder was confident in what it wrote.
    fn no_speech(&self, w: &DecodeStats) -> bool {
        let Some(th) = self.config.no_speech_threshold else {
            return false;
        };
        // A loop's tokens are each likely given the last: its mean says nothing of confidence.
        let confident = !w.looped
            && self
                .config
                .logprob_threshold
                .is_some_and(|lp| w.avg_logprob > lp as f64);
        w.no_speech_prob > th && !confident
    }
}

/// One window's greedy decode.
struct WindowDecode {
    /// Without `<|endoftext|>`; a loop cut to one copy of its unit.
    tokens: Vec<u32>,
    stats: DecodeStats,
}

/// When `tokens` ends in a loop (see [`LOOP_MAX_PERIOD`]): how many to keep, everything before
/// the loop and one copy of its unit.
fn repetition_cut(tokens: &[u32]) -> Option<usize> {
    let len = tokens.len();
    for period in 1..=LOOP_MAX_PERIOD {
        let span = (period * LOOP_MIN_REPEATS).max(LOOP_MIN_TOKENS);
        if len < span || !(len - span + period..len).all(|i| tokens[i] == tokens[i - period]) {
            continue;
        }
        let mut start = len - span;
        while start > 0 && tokens[start - 1] == tokens[start - 1 + period] {
            start -= 1;
        }
        return Some(start + period);
    }
    None
}

/// RMS of the loudest 100 ms of `samples`, in dBFS (-inf when all zero or empty).
fn loudest_dbfs(samples: &[f32]) -> f32 {
    let loudest = samples
        .chunks(LEVEL_FRAME)
        .map(|f| f.iter().map(|&x| f64::from(x) * f64::from(x)).sum::<f64>() / f.len() as f64)
        .fold(0f64, f64::max);
    (10.0 * loudest.log10()) as f32
}

fn argmax(v: &[f32]) -> (usize, f32) {
    let mut best = (0, f32::NEG_INFINITY);
    for (i, &x) in v.iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best
}

fn log_sum_exp(v: &[f32]) -> f32 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    let s: f64 = v.iter().map(|&x| ((x - m) as f64).exp()).sum();
    m + s.ln() as f32
}

fn softmax_at(v: &[f32], i: usize) -> f32 {
    match v.get(i) {
        Some(&x) => (x - log_sum_exp(v)).exp(),
        None => 0.0,
    }
}

/// candle's `Config` from the stored shapes and attributes; also checks the architecture
/// flags the network in `model` hard-codes.
fn model_config(ct2: &Ct2Model) -> Result<cw::Config> {
    let shape = |name: &str| -> Result<Vec<usize>> { Ok(ct2.require(name)?.shape.clone()) };
    let conv1 = shape("encoder/conv1/weight")?;
    let emb = shape("decoder/embeddings/weight")?;
    let enc_pos = shape("encoder/position_encodings/encodings")?;
    let dec_pos = shape("decoder/position_encodings/encodings")?;
    let (&[d_model, n_mels, 3], &[vocab, d2], &[n_audio, d3], &[n_text, d4]) = (
        conv1.as_slice(),
        emb.as_slice(),
        enc_pos.as_slice(),
        dec_pos.as_slice(),
    ) else {
        return Err(ct2.format_err(format!(
            "unexpected shapes: conv1 {conv1:?}, embeddings {emb:?}, positions {enc_pos:?} / \
             {dec_pos:?}"
        )));
    };
    if [d2, d3, d4] != [d_model; 3] || n_audio * 2 != N_FRAMES {
        return Err(ct2.format_err(format!(
            "inconsistent sizes: d_model {d_model} / {d2} / {d3} / {d4}, audio context {n_audio}"
        )));
    }
    let count_layers = |prefix: &str| {
        (0..)
            .take_while(|i| {
                ct2.get(&format!("{prefix}/layer_{i}/ffn/linear_0/weight"))
                    .is_some()
            })
            .count()
    };
    let heads = |name: &str| -> Result<usize> {
        match ct2.scalar_int(name)? {
            Some(h) if h > 0 && d_model % h as usize == 0 => Ok(h as usize),
            other => Err(ct2.format_err(format!("{name}: {other:?} heads for d_model {d_model}"))),
        }
    };
    // Flags of CTranslate2's TransformerDecoderSpec that the decoder here assumes.
    let flag = |name: &str, want: i64, default: i64| -> Result<()> {
        let v = ct2.scalar_int(name)?.unwrap_or(default);
        if v != want {
            return Err(ct2.format_err(format!("{name} = {v}, the decoder here needs {want}")));
        }
        Ok(())
    };
    flag("decoder/pre_norm", 1, 1)?;
    flag("decoder/scale_embeddings", 0, 0)?;
    flag("decoder/activation", 3, 3)?; // GELU
    Ok(cw::Config {
        num_mel_bins: n_mels,
        max_source_positions: n_audio,
        d_model,
        encoder_attention_heads: heads("encoder/num_heads")?,
        encoder_layers: count_layers("encoder"),
        vocab_size: vocab,
        max_target_positions: n_text,
        decoder_attention_heads: heads("decoder/num_heads")?,
        decoder_layers: count_layers("decoder"),
        suppress_tokens: Vec::new(),
    })
}

type Weights = std::collections::HashMap<String, Tensor>;

impl WeightSource for Weights {
    fn get(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let t = std::collections::HashMap::get(self, name)
            .ok_or_else(|| ModelError::Invalid(format!("whisper: no weight {name}")))?;
        Ok((t.flatten_all()?.to_vec1::<f32>()?, t.dims().to_vec()))
    }

    fn has(&self, name: &str) -> bool {
        self.contains_key(name)
    }
}

/// A (possibly fused) linear layer: rows `[i d, (i + 1) d)` of `src` become `dst[i]`.
fn split_linear(
    ct2: &Ct2Model,
    w: &mut Weights,
    d: usize,
    src: &str,
    dst: &[&str],
    dev: &Device,
) -> Result<()> {
    let weight = ct2.tensor(&format!("{src}/weight"), dev)?;
    if weight.dims() != [dst.len() * d, d] {
        return Err(ct2.format_err(format!(
            "{src}/weight: shape {:?}, expected [{}, {d}]",
            weight.dims(),
            dst.len() * d
        )));
    }
    let bias_name = format!("{src}/bias");
    let bias = match ct2.get(&bias_name) {
        Some(_) => Some(ct2.tensor(&bias_name, dev)?),
        None => None,
    };
    for (i, name) in dst.iter().enumerate() {
        w.insert(format!("{name}.weight"), weight.narrow(0, i * d, d)?);
        if let Some(b) = &bias {
            w.insert(format!("{name}.bias"), b.narrow(0, i * d, d)?);
        }
    }
    Ok(())
}

/// CTranslate2 variables -> candle (HF `WhisperForConditionalGeneration`) names.
fn candle_weights(ct2: &Ct2Model, cfg: &cw::Config, dev: &Device) -> Result<Weights> {
    let d = cfg.d_model;
    let mut w = Weights::new();
    let put = |w: &mut Weights, dst: String, src: String| -> Result<()> {
        w.insert(dst, ct2.tensor(&src, dev)?);
        Ok(())
    };
    for (side, n_layers) in [
        ("encoder", cfg.encoder_layers),
        ("decoder", cfg.decoder_layers),
    ] {
        for l in 0..n_layers {
            let s = format!("{side}/layer_{l}");
            let t = format!("model.{side}.layers.{l}");
            let mut attns = vec![("self_attention", "self_attn")];
            if side == "decoder" {
                attns.push(("attention", "encoder_attn"));
            }
            for (src, dst) in attns {
                let [q, k, v, o] =
                    ["q_proj", "k_proj", "v_proj", "out_proj"].map(|p| format!("{t}.{dst}.{p}"));
                if src == "self_attention" {
                    // linear_0: fused [q; k; v], linear_1: output.
                    split_linear(
                        ct2,
                        &mut w,
                        d,
                        &format!("{s}/{src}/linear_0"),
                        &[&q, &k, &v],
                        dev,
                    )?;
                    split_linear(ct2, &mut w, d, &format!("{s}/{src}/linear_1"), &[&o], dev)?;
                } else {
                    // linear_0: query, linear_1: fused [k; v] (of the encoder output), linear_2:
                    // output.
                    split_linear(ct2, &mut w, d, &format!("{s}/{src}/linear_0"), &[&q], dev)?;
                    split_linear(
                        ct2,
                        &mut w,
                        d,
                        &format!("{s}/{src}/linear_1"),
                        &[&k, &v],
                        dev,
                    )?;
                    split_linear(ct2, &mut w, d, &format!("{s}/{src}/linear_2"), &[&o], dev)?;
                }
                // Whisper's keys have no bias (CTranslate2 stores zeros; see the module docs).
                w.remove(&format!("{k}.bias"));
                let norm = if src == "self_attention" {
                    "self_attn_layer_norm"
                } else {
                    "encoder_attn_layer_norm"
                };
                put(
                    &mut w,
                    format!("{t}.{norm}.weight"),
                    format!("{s}/{src}/layer_norm/gamma"),
                )?;
                put(
                    &mut w,
                    format!("{t}.{norm}.bias"),
                    format!("{s}/{src}/layer_norm/beta"),
                )?;
            }
            put(
                &mut w,
                format!("{t}.final_layer_norm.weight"),
                format!("{s}/ffn/layer_norm/gamma"),
            )?;
            put(
                &mut w,
                format!("{t}.final_layer_norm.bias"),
                format!("{s}/ffn/layer_norm/beta"),
            )?;
            for (src, dst) in [("linear_0", "fc1"), ("linear_1", "fc2")] {
                put(
                    &mut w,
                    format!("{t}.{dst}.weight"),
                    format!("{s}/ffn/{src}/weight"),
                )?;
                put(
                    &mut w,
                    format!("{t}.{dst}.bias"),
                    format!("{s}/ffn/{src}/bias"),
                )?;
            }
        }
        put(
            &mut w,
            format!("model.{side}.layer_norm.weight"),
            format!("{side}/layer_norm/gamma"),
        )?;
        put(
            &mut w,
            format!("model.{side}.layer_norm.bias"),
            format!("{side}/layer_norm/beta"),
        )?;
    }
    for conv in ["conv1", "conv2"] {
        for p in ["weight", "bias"] {
            put(
                &mut w,
                format!("model.encoder.{conv}.{p}"),
                format!("encoder/{conv}/{p}"),
            )?;
        }
    }
    put(
        &mut w,
        "model.decoder.embed_tokens.weight".into(),
        "decoder/embeddings/weight".into(),
    )?;
    put(
        &mut w,
        "model.decoder.embed_positions.weight".into(),
        "decoder/position_encodings/encodings".into(),
    )?;

    check_tied_projection(ct2)?;
    check_encoder_positions(ct2, cfg)?;
    Ok(w)
}

/// The decoder computes logits with the token embedding; the file's output projection must be it.
fn check_tied_projection(ct2: &Ct2Model) -> Result<()> {
    let emb = ct2.require("decoder/embeddings/weight")?;
    if let Some(proj) = ct2.get("decoder/projection/weight") {
        if proj.name != emb.name && ct2.bytes(proj) != ct2.bytes(emb) {
            return Err(ct2.format_err(
                "decoder/projection/weight differs from the token embedding (the decoder here \
                 ties them)"
                    .into(),
            ));
        }
    }
    if let Some(bias) = ct2.get("decoder/projection/bias") {
        if ct2.to_f32(bias)?.iter().any(|&b| b != 0.0) {
            return Err(ct2.format_err("decoder/projection/bias is not zero".into()));
        }
    }
    Ok(())
}

/// The encoder computes its sinusoidal positions itself; make sure the stored ones are
/// those (to fp16 rounding).
fn check_encoder_positions(ct2: &Ct2Model, cfg: &cw::Config) -> Result<()> {
    let var = ct2.require("encoder/position_encodings/encodings")?;
    let stored = ct2.to_f32(var)?;
    let (n, d) = (cfg.max_source_positions, cfg.d_model);
    let half = d / 2;
    let inc = (10000f64).ln() / (half as f64 - 1.0);
    let mut worst = 0f64;
    for t in 0..n {
        for i in 0..half {
            let a = t as f64 * (-(i as f64) * inc).exp();
            let (s, c) = (stored[t * d + i] as f64, stored[t * d + half + i] as f64);
            worst = worst.max((s - a.sin()).abs()).max((c - a.cos()).abs());
        }
    }
    if worst > 1e-2 {
        return Err(ct2.format_err(format!(
            "encoder position encodings are not Whisper's sinusoids (max diff {worst})"
        )));
    }
    Ok(())
}

/// `suppress_ids` and `suppress_ids_begin` of the CTranslate2 `config.json`.
fn read_suppress_ids(path: &Path, cfg: &cw::Config) -> Result<(Vec<u32>, Vec<u32>)> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| ModelError::Format {
        path: path.to_path_buf(),
        msg: e.to_string(),
    })?;
    let ids = |key: &str| -> Result<Vec<u32>> {
        let Some(v) = json.get(key) else {
            return Ok(Vec::new());
        };
        let bad = |msg: String| ModelError::Format {
            path: path.to_path_buf(),
            msg,
        };
        let arr = v
            .as_array()
            .ok_or_else(|| bad(format!("{key} is not a list")))?;
        arr.iter()
            .map(|x| match x.as_u64() {
                Some(id) if (id as usize) < cfg.vocab_size => Ok(id as u32),
                _ => Err(bad(format!("{key}: {x} is not a token id"))),
            })
            .collect()
    };
    Ok((ids("suppress_ids")?, ids("suppress_ids_begin")?))
}

/// Log-mel features `[n_mels, n_frames]` row-major.
struct LogMel {
    data: Vec<f32>,
    n_mels: usize,
    n_frames: usize,
}

impl LogMel {
    /// Frames `[start, start + n)` zero-padded to `width` frames (faster-whisper's
    /// `pad_or_trim` of the feature slice).
    fn window(&self, start: usize, n: usize, width: usize) -> Vec<f32> {
        let mut out = vec![0f32; self.n_mels * width];
        let n = n.min(width).min(self.n_frames.saturating_sub(start));
        for m in 0..self.n_mels {
            let row = &self.data[m * self.n_frames..(m + 1) * self.n_frames];
            out[m * width..m * width + n].copy_from_slice(&row[start..start + n]);
        }
        out
    }
}

/// faster-whisper's `FeatureExtractor` (see the module docs).
pub struct MelFrontEnd {
    n_mels: usize,
    filters: Vec<f32>,
    window: Vec<f32>,
    fft: Fft,
}

impl MelFrontEnd {
    pub fn new(n_mels: usize) -> Self {
        // np.hanning(n_fft + 1)[:-1]: the periodic Hann window, computed in f64, stored f32.
        let window = (0..N_FFT)
            .map(|i| {
                (0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / N_FFT as f64).cos()) as f32
            })
            .collect();
        Self {
            n_mels,
            filters: mel_filters(SAMPLE_RATE, N_FFT, n_mels),
            window,
            fft: Fft::new(N_FFT),
        }
    }

    fn log_mel(&self, pcm: &[f32]) -> LogMel {
        let n_bins = N_FFT / 2 + 1;
        // 160 zeros appended, then reflect padding of n_fft / 2 on both sides.
        let mut x = pcm.to_vec();
        x.extend(std::iter::repeat_n(0f32, HOP_LENGTH));
        let pad = N_FFT / 2;
        // STFT frames of the padded signal, less the last one.
        let n_frames = x.len() / HOP_LENGTH;
        let mut mel = vec![0f32; n_frames * self.n_mels]; // frame-major while computing
        mel.par_chunks_mut(self.n_mels).enumerate().for_each_init(
            || (vec![(0f64, 0f64); N_FFT], vec![(0f64, 0f64); N_FFT]),
            |(buf, out), (f, dst)| {
                for (j, b) in buf.iter_mut().enumerate() {
                    let src = reflect(f * HOP_LENGTH + j, pad, x.len());
                    *b = ((x[src] * self.window[j]) as f64, 0.0);
                }
                self.fft.run(buf, out);
                let power: Vec<f64> = out[..n_bins]
                    .iter()
                    .map(|&(re, im)| (re * re + im * im) as f32 as f64)
                    .collect();
                for (m, d) in dst.iter_mut().enumerate() {
                    let row = &self.filters[m * n_bins..(m + 1) * n_bins];
                    let s: f64 = row.iter().zip(&power).map(|(&w, &p)| w as f64 * p).sum();
                    *d = (s.max(1e-10)).log10() as f32;
                }
            },
        );
        let max = mel.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut data = vec![0f32; n_frames * self.n_mels];
        for f in 0..n_frames {
            for m in 0..self.n_mels {
                data[m * n_frames + f] = (mel[f * self.n_mels + m].max(max - 8.0) + 4.0) / 4.0;
            }
        }
        LogMel {
            data,
            n_mels: self.n_mels,
            n_frames,
        }
    }
}

/// Index into a signal of length `len` for position `i` of its copy reflect-padded by `pad`
/// on the left (numpy's `np.pad(mode="reflect")`: mirrored without repeating the edge,
/// periodically when the pad exceeds the signal).
fn reflect(i: usize, pad: usize, len: usize) -> usize {
    if len <= 1 {
        return 0;
    }
    let period = 2 * (len - 1);
    // Shift by a multiple of the period so the position is non-negative.
    let shifted = (i + period * pad.div_ceil(period) - pad) % period;
    if shifted < len {
        shifted
    } else {
        period - shifted
    }
}

/// The slaney-style mel filterbank `[n_mels, n_fft / 2 + 1]` of librosa / Whisper's
/// `mel_filters.npz` (faster-whisper's `get_mel_filters`): triangles between mel points
/// spaced evenly from 0 to sr / 2 on the slaney scale (linear below 1 kHz, logarithmic
/// above), each scaled to unit area (2 / bandwidth).
pub fn mel_filters(sample_rate: usize, n_fft: usize, n_mels: usize) -> Vec<f32> {
    let n_bins = n_fft / 2 + 1;
    let f_sp = 200.0 / 3.0;
    let min_log_hz = 1000.0;
    let min_log_mel = min_log_hz / f_sp;
    let logstep = (6.4f64).ln() / 27.0;
    let hz_to_mel = |f: f64| {
        if f >= min_log_hz {
            min_log_mel + (f / min_log_hz).ln() / logstep
        } else {
            f / f_sp
        }
    };
    let mel_to_hz = |m: f64| {
        if m >= min_log_mel {
            min_log_hz * (logstep * (m - min_log_mel)).exp()
        } else {
            f_sp * m
        }
    };
    let max_mel = hz_to_mel(sample_rate as f64 / 2.0);
    // np.linspace(0, max_mel, n_mels + 2)
    let step = max_mel / (n_mels + 1) as f64;
    let freqs: Vec<f64> = (0..n_mels + 2)
        .map(|i| {
            if i == n_mels + 1 {
                mel_to_hz(max_mel)
            } else {
                mel_to_hz(i as f64 * step)
            }
        })
        .collect();
    let fft_freqs: Vec<f64> = (0..n_bins)
        .map(|k| k as f64 * sample_rate as f64 / n_fft as f64)
        .collect();
    let mut out = vec![0f32; n_mels * n_bins];
    for m in 0..n_mels {
        let (lo, mid, hi) = (freqs[m], freqs[m + 1], freqs[m + 2]);
        let enorm = 2.0 / (hi - lo);
        for (k, &f) in fft_freqs.iter().enumerate() {
            let lower = (f - lo) / (mid - lo);
            let upper = (hi - f) / (hi - mid);
            out[m * n_bins + k] = (lower.min(upper).max(0.0) * enorm) as f32;
        }
    }
    out
}

/// A complex FFT of one fixed size: recursive mixed-radix Cooley-Tukey over the size's prime
/// factors (whisper's 400 = 2^4 * 5^2), twiddles precomputed.
struct Fft {
    n: usize,
    factors: Vec<usize>,
    twiddles: Vec<(f64, f64)>,
}

type C64 = (f64, f64);

impl Fft {
    fn new(n: usize) -> Self {
        let mut factors = Vec::new();
        let mut r = n.max(1);
        let mut p = 2;
        while r > 1 {
            while r.is_multiple_of(p) {
                factors.push(p);
                r /= p;
            }
            p += 1;
        }
        let twiddles = (0..n)
            .map(|k| {
                let a = -2.0 * std::f64::consts::PI * k as f64 / n as f64;
                (a.cos(), a.sin())
            })
            .collect();
        Self {
            n,
            factors,
            twiddles,
        }
    }

    /// `out = DFT(input)`; both hold `n` values.
    fn run(&self, input: &[C64], out: &mut [C64]) {
        self.rec(input, 1, 0, &mut out[..self.n]);
    }

    /// DFT of `x[0], x[stride], ...` (`out.len()` values) into `out`.
    fn rec(&self, x: &[C64], stride: usize, depth: usize, out: &mut [C64]) {
        let n = out.len();
        if n == 1 {
            out[0] = x[0];
            return;
        }
        let p = self.factors[depth];
        let m = n / p;
        // Sub-transforms of the p decimated sequences, side by side in `out`.
        for r in 0..p {
            self.rec(
                &x[r * stride..],
                stride * p,
                depth + 1,
                &mut out[r * m..(r + 1) * m],
            );
        }
        // Butterflies: X[k + q m] = sum_r W_n^(r (k + q m)) Y_r[k].
        let tw = self.n / n;
        let mut y = [(0f64, 0f64); 16];
        let mut big = Vec::new();
        let y: &mut [C64] = if p <= 16 {
            &mut y[..p]
        } else {
            big.resize(p, (0.0, 0.0));
            &mut big
        };
        for k in 0..m {
            for (r, v) in y.iter_mut().enumerate() {
                *v = out[r * m + k];
            }
            for q in 0..p {
                let idx = k + q * m;
                let (mut re, mut im) = (0.0, 0.0);
                for (r, &(a, b)) in y.iter().enumerate() {
                    let (c, s) = self.twiddles[(r * idx % n) * tw];
                    re += a * c - b * s;
                    im += a * s + b * c;
                }
                out[idx] = (re, im);
            }
        }
    }
}

/// Samples of a 16-bit PCM mono 16 kHz WAV file, scaled to [-1, 1) (x / 32768, as PyAV /
/// faster-whisper's `decode_audio`).
pub fn read_wav_16k(path: &Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_wav_16k(&bytes, path)
}

fn parse_wav_16k(b: &[u8], path: &Path) -> Result<Vec<f32>> {
    let bad = |msg: &str| ModelError::Format {
        path: PathBuf::from(path),
        msg: format!("WAV: {msg}"),
    };
    let u16_at = |i: usize| b.get(i..i + 2).map(|s| u16::from_le_bytes([s[0], s[1]]));
    let u32_at = |i: usize| {
        b.get(i..i + 4)
            .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    };
    if b.get(0..4) != Some(b"RIFF") || b.get(8..12) != Some(b"WAVE") {
        return Err(bad("not a RIFF/WAVE file"));
    }
    let mut pos = 12;
    let mut format = None;
    while let (Some(id), Some(len)) = (b.get(pos..pos + 4), u32_at(pos + 4)) {
        let body = pos + 8;
        let len = len as usize;
        match id {
            b"fmt " => {
                let (Some(tag), Some(ch), Some(rate), Some(bits)) = (
                    u16_at(body),
                    u16_at(body + 2),
                    u32_at(body + 4),
                    u16_at(body + 14),
                ) else {
                    return Err(bad("short fmt chunk"));
                };
                format = Some((tag, ch, rate, bits));
            }
            b"data" => {
                let Some((tag, ch, rate, bits)) = format else {
                    return Err(bad("data before fmt"));
                };
                // 1: PCM, 0xFFFE: WAVE_FORMAT_EXTENSIBLE (assumed PCM at 16 bits).
                if !(tag == 1 || tag == 0xfffe) || ch != 1 || rate != 16000 || bits != 16 {
                    return Err(bad(&format!(
                        "need 16-bit PCM mono 16 kHz, got format {tag}, {ch} channels, {rate} Hz, \
                         {bits} bits"
                    )));
                }
                // A streamed WAV may carry a bogus length: take what is there.
                let end = body.saturating_add(len).min(b.len());
                let data = b.get(body..end).ok_or_else(|| bad("data past the end"))?;
                return Ok(data
                    .chunks_exact(2)
                    .map(|s| i16::from_le_bytes([s[0], s[1]]) as f32 / 32768.0)
                    .collect());
            }
            _ => {}
        }
        // Chunks are padded to an even length.
        pos = body.saturating_add(len).saturating_add(len & 1);
    }
    Err(bad("no data chunk"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::OnceLock;

    fn manifest() -> &'static Path {
        Path::new(env!("CARGO_MANIFEST_DIR"))
    }

    fn testdata(name: &str) -> PathBuf {
        manifest().join("testdata/whisper").join(name)
    }

    fn reference() -> serde_json::Value {
        let text = std::fs::read_to_string(testdata("reference.json")).expect("reference.json");
        serde_json::from_str(&text).expect("reference.json parses")
    }

    fn read_f32(name: &str) -> Vec<f32> {
        let b = std::fs::read(testdata(name)).expect("fixture");
        b.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// The model, loaded once; None (after a message) when models/ lacks it.
    fn asr() -> Option<&'static WhisperAsr> {
        static M: OnceLock<Option<WhisperAsr>> = OnceLock::new();
        M.get_or_init(|| {
            let dir = manifest().join("../models/whisper-tiny-en");
            if !dir.join("model.bin").exists() {
                eprintln!("SKIP: {} not found", dir.display());
                return None;
            }
            let t = Instant::now();
            let m = WhisperAsr::load(&dir, &Device::Cpu).expect("loading whisper-tiny-en");
            eprintln!("loaded {} in {:.2?}", dir.display(), t.elapsed());
            Some(m)
        })
        .as_ref()
    }

    /// Lower case, apostrophes dropped, anything else not alphanumeric a word break (as
    /// scripts/fixtures/whisper_reference.py).
    fn normalize(text: &str) -> Vec<String> {
        let t: String = text
            .to_lowercase()
            .chars()
            .filter(|c| !matches!(c, '\'' | '\u{2019}' | '`'))
            .map(|c| if c.is_ascii_alphanumeric() { c } else { ' ' })
            .collect();
        t.split_whitespace().map(str::to_string).collect()
    }

    fn edit_distance(a: &[String], b: &[String]) -> usize {
        let mut prev: Vec<usize> = (0..=b.len()).collect();
        for (i, x) in a.iter().enumerate() {
            let mut cur = vec![i + 1; b.len() + 1];
            for (j, y) in b.iter().enumerate() {
                cur[j + 1] = (prev[j + 1] + 1)
                    .min(cur[j] + 1)
                    .min(prev[j] + usize::from(x != y));
            }
            prev = cur;
        }
        prev[b.len()]
    }

    #[test]
    fn fft_matches_a_plain_dft() {
        for n in [1, 2, 5, 12, 17, 400] {
            let fft = Fft::new(n);
            let x: Vec<C64> = (0..n)
                .map(|i| (((i * 7919) % 13) as f64 - 6.0, ((i * 31) % 5) as f64))
                .collect();
            let mut out = vec![(0.0, 0.0); n];
            fft.run(&x, &mut out);
            for (k, &(re, im)) in out.iter().enumerate() {
                let (mut er, mut ei) = (0.0, 0.0);
                for (j, &(a, b)) in x.iter().enumerate() {
                    let ang = -2.0 * std::f64::consts::PI * (j * k % n) as f64 / n as f64;
                    er += a * ang.cos() - b * ang.sin();
                    ei += a * ang.sin() + b * ang.cos();
                }
                assert!(
                    (re - er).abs() < 1e-9 && (im - ei).abs() < 1e-9,
                    "n {n} bin {k}"
                );
            }
        }
    }

    #[test]
    fn reflect_padding_matches_numpy() {
        // np.pad([0, 1, 2, 3], 2, mode="reflect") -> [2, 1, 0, 1, 2, 3, 2, 1]
        let got: Vec<usize> = (0..8).map(|i| reflect(i, 2, 4)).collect();
        assert_eq!(got, vec![2, 1, 0, 1, 2, 3, 2, 1]);
        // np.pad([0, 1, 2], 5, mode="reflect") -> [1, 0, 1, 2, 1, 0, 1, 2, 1, 0, 1, 2, 1]
        let got: Vec<usize> = (0..13).map(|i| reflect(i, 5, 3)).collect();
        assert_eq!(got, vec![1, 0, 1, 2, 1, 0, 1, 2, 1, 0, 1, 2, 1]);
        // np.pad([0, 1, 2, 3], 7, mode="reflect")
        let got: Vec<usize> = (0..18).map(|i| reflect(i, 7, 4)).collect();
        assert_eq!(
            got,
            vec![1, 0, 1, 2, 3, 2, 1, 0, 1, 2, 3, 2, 1, 0, 1, 2, 3, 2]
        );
        assert_eq!(reflect(3, 2, 1), 0);
    }

    #[test]
    fn mel_filterbank_shape_and_area() {
        let f = mel_filters(16000, 400, 80);
        assert_eq!(f.len(), 80 * 201);
        // Slaney normalisation: each triangle's integral over Hz is ~1 (bins are 40 Hz apart;
        // the narrow low triangles are sampled too coarsely to integrate well).
        for m in 20..80 {
            let area: f32 = f[m * 201..(m + 1) * 201].iter().sum::<f32>() * 40.0;
            assert!((area - 1.0).abs() < 0.1, "filter {m}: area {area}");
        }
        // Values of faster-whisper's get_mel_filters(16000, 400, 80) (= librosa's).
        for (m, k, want) in [
            (1, 1, 0.001_990_822),
            (1, 2, 0.022_871_772),
            (10, 11, 0.004_954_375_3),
            (79, 192, 0.003_164_711_6),
            (79, 200, 0.0),
        ] {
            let got = f[m * 201 + k];
            assert!(
                (got - want).abs() <= 1e-6 * want,
                "filter {m} bin {k}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn log_mel_matches_faster_whisper() {
        let r = reference();
        let mel_ref = &r["mel"];
        let pcm = read_wav_16k(&testdata(mel_ref["wav"].as_str().expect("wav"))).expect("wav");
        let want = read_f32(mel_ref["file"].as_str().expect("file"));
        let n_frames = mel_ref["n_frames"].as_u64().expect("n_frames") as usize;
        let front = MelFrontEnd::new(80);
        let got = front.log_mel(&pcm);
        assert_eq!(got.n_frames, n_frames);
        assert_eq!(got.data.len(), want.len());
        let diff = got
            .data
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        eprintln!("log-mel vs faster-whisper: max abs diff {diff:e} over {n_frames} frames");
        assert!(diff < 1e-4, "max abs diff {diff}");
    }

    #[test]
    fn wav_parsing_rejects_bad_input() {
        let p = Path::new("x.wav");
        assert!(parse_wav_16k(b"", p).is_err());
        assert!(parse_wav_16k(b"RIFF\0\0\0\0WAVE", p).is_err());
        let good = std::fs::read(testdata("s00.wav")).expect("s00.wav");
        for cut in [12, 20, 30, 43] {
            // Cut inside the headers: an error; the samples themselves may be cut anywhere.
            assert!(parse_wav_16k(&good[..cut], p).is_err(), "cut at {cut}");
        }
        assert!(!parse_wav_16k(&good, p).expect("s00.wav").is_empty());
    }

    #[test]
    fn model_config_is_tiny_en() {
        let Some(asr) = asr() else { return };
        let c = asr.model_config();
        assert_eq!(
            (
                c.num_mel_bins,
                c.encoder_layers,
                c.decoder_layers,
                c.d_model
            ),
            (80, 4, 4, 384)
        );
        assert_eq!(
            (c.encoder_attention_heads, c.decoder_attention_heads),
            (6, 6)
        );
        assert_eq!(
            (c.vocab_size, c.max_source_positions, c.max_target_positions),
            (51864, 1500, 448)
        );
        assert_eq!(asr.special.sot, 50257);
        assert_eq!(asr.special.eot, 50256);
        assert_eq!(asr.special.no_timestamps, 50362);
        assert_eq!(asr.special.no_speech, Some(50361));
        assert_eq!(asr.suppress.len(), 90);
        assert_eq!(asr.suppress_begin, vec![220, 50256]);
    }

    #[test]
    fn encoder_matches_ctranslate2() {
        let Some(asr) = asr() else { return };
        let r = reference();
        let e = &r["encoder"];
        let pcm = read_wav_16k(&testdata(e["wav"].as_str().expect("wav"))).expect("wav");
        let want = read_f32(e["file"].as_str().expect("file"));
        let d = e["d_model"].as_u64().expect("d_model") as usize;
        let rows: Vec<usize> = e["rows"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|v| v.as_u64().expect("row") as usize)
            .collect();
        let got = asr.encode(&pcm).expect("encode");
        let got: Vec<Vec<f32>> = got.to_vec2().expect("vec2");
        let (mut worst, mut scale) = (0f32, 0f32);
        for (i, &row) in rows.iter().enumerate() {
            for j in 0..d {
                worst = worst.max((got[row][j] - want[i * d + j]).abs());
                scale = scale.max(want[i * d + j].abs());
            }
        }
        eprintln!("encoder vs CTranslate2: max abs diff {worst:e} (values up to {scale})");
        // f32 sums in another order over 4 layers (measured 4.5e-3, relative 5e-4).
        assert!(worst < 1e-2, "max abs diff {worst}");
    }

    #[test]
    fn transcripts_match_faster_whisper() {
        let Some(asr) = asr() else { return };
        let r = reference();
        let items = r["items"].as_array().expect("items");
        assert!(!items.is_empty());
        let (mut err_rs, mut err_fw, mut words, mut same) = (0, 0, 0, 0);
        let (mut audio_s, mut compute_s) = (0.0, 0.0);
        for it in items {
            let wav = it["wav"].as_str().expect("wav");
            let refw = normalize(it["ref"].as_str().expect("ref"));
            let fw = it["fw_text"].as_str().expect("fw_text");
            let pcm = read_wav_16k(&testdata(wav)).expect("wav");
            let t = Instant::now();
            let got = asr.transcribe_detailed(&pcm).expect("transcribe");
            compute_s += t.elapsed().as_secs_f64();
            audio_s += pcm.len() as f64 / SAMPLE_RATE as f64;
            err_rs += edit_distance(&refw, &normalize(&got.text));
            err_fw += edit_distance(&refw, &normalize(fw));
            words += refw.len();
            let fw_tokens: Vec<u32> = it["fw_tokens"]
                .as_array()
                .expect("fw_tokens")
                .iter()
                .map(|v| v.as_u64().expect("token") as u32)
                .collect();
            let agree = got.text == fw;
            same += usize::from(agree);
            eprintln!(
                "{wav}: {} rust={:?} fw={fw:?}{}",
                if agree { "same" } else { "DIFF" },
                got.text,
                if got.tokens == fw_tokens {
                    ""
                } else {
                    " (tokens differ)"
                }
            );
        }
        let (wer_rs, wer_fw) = (
            100.0 * err_rs as f64 / words as f64,
            100.0 * err_fw as f64 / words as f64,
        );
        eprintln!(
            "WER rust {wer_rs:.2}% vs faster-whisper {wer_fw:.2}% over {words} words; \
             {same}/{} transcripts identical; RTF {:.3}",
            items.len(),
            compute_s / audio_s
        );
        assert!(
            wer_rs <= wer_fw + 2.0,
            "rust WER {wer_rs:.2}% is more than 2 points above faster-whisper's {wer_fw:.2}%"
        );
    }

    #[test]
    fn long_audio_is_decoded_in_windows_and_silence_gives_nothing() {
        let Some(asr) = asr() else { return };
        assert_eq!(asr.transcribe(&[]).expect("empty"), "");
        assert!(asr.transcribe(&[f32::NAN; 100]).is_err());
        // s04, then silence to 30.4 s, then s06: two windows, a sentence in each.
        let a = read_wav_16k(&testdata("s04.wav")).expect("s04");
        let b = read_wav_16k(&testdata("s06.wav")).expect("s06");
        let mut pcm = a.clone();
        pcm.resize(SAMPLE_RATE * 304 / 10, 0.0);
        pcm.extend_from_slice(&b);
        let t = asr.transcribe_detailed(&pcm).expect("transcribe");
        eprintln!("two windows: {:?}", t.text);
        assert_eq!(t.windows, 2);
        let words = normalize(&t.text).join(" ");
        assert!(words.contains("traffic light"), "{words}");
        assert!(words.contains("finish the project"), "{words}");
    }

    /// `seconds` of reproducible white noise at `dbfs` RMS, 16 kHz.
    fn white_noise(seconds: usize, dbfs: f32, seed: u64) -> Vec<f32> {
        crate::vad::white_noise(seconds * SAMPLE_RATE, dbfs, seed)
    }

    #[test]
    fn silence_and_low_noise_transcribe_to_nothing() {
        let Some(asr) = asr() else { return };
        // Digital silence: every window (30 + 30 + 1 s) skipped before the encoder (tiny.en
        // says "you" in each at no-speech 0.95, mean log-prob -0.38).
        let t = asr
            .transcribe_detailed(&vec![0.0; 61 * SAMPLE_RATE])
            .expect("silence");
        eprintln!("silence: {:?}", t.window_stats);
        assert_eq!(t.text, "");
        assert_eq!(t.windows, 3);
        assert!(t.window_stats.iter().all(|w| w.decode.is_none()), "{t:?}");
        // Low white noise, at and above the silence level: decoded, and dropped as no speech;
        // at -60 dBFS tiny.en writes " ." until stopped, here by the loop guard at 32 tokens
        // (without it, 224 tokens of " . . ." at mean log-prob -0.05: "confident").
        for (dbfs, seconds) in [(-60.0, 60), (-50.0, 30)] {
            let t = asr
                .transcribe_detailed(&white_noise(seconds, dbfs, 7))
                .expect("noise");
            eprintln!("{dbfs} dBFS noise: {:?}", t.window_stats);
            assert_eq!(t.text, "", "{dbfs} dBFS: {t:?}");
            assert_eq!(t.windows, seconds / 30);
            for w in &t.window_stats {
                let d = w.decode.expect("decoded: louder than the silence level");
                assert!(!w.kept && d.tokens <= LOOP_MIN_TOKENS, "{dbfs} dBFS: {w:?}");
            }
            if dbfs == -60.0 {
                assert!(t
                    .window_stats
                    .iter()
                    .all(|w| w.decode.is_some_and(|d| d.looped)));
            }
        }
        // Speech is heard as before; the silent window after it adds nothing.
        let mut pcm = read_wav_16k(&testdata("s04.wav")).expect("s04");
        let alone = asr.transcribe(&pcm).expect("s04");
        assert_eq!(alone, "Turn left at the next traffic light.");
        pcm.resize(pcm.len() + 40 * SAMPLE_RATE, 0.0);
        let t = asr.transcribe_detailed(&pcm).expect("s04 + silence");
        assert_eq!(t.text, alone, "{:?}", t.window_stats);
        assert_eq!(t.windows, 2);
        assert!(t.window_stats[0].kept && t.window_stats[1].decode.is_none());
    }

    #[test]
    fn the_loop_guard_cuts_repeats_only() {
        let words: Vec<u32> = (100..110).collect();
        // " ." 40 times after a sentence: cut to the sentence and one " .".
        let mut t = words.clone();
        t.extend([764; 40]);
        assert_eq!(repetition_cut(&t[..41]), None);
        assert_eq!(repetition_cut(&t[..42]), Some(11));
        // A 3-token unit, 11 copies (33 tokens): a loop.
        let mut t = words.clone();
        for _ in 0..11 {
            t.extend([7, 8, 9]);
        }
        assert_eq!(repetition_cut(&t), Some(13));
        // A 16-token phrase said 3 times, a word said 31 times, a sentence: no loop.
        let phrase: Vec<u32> = (200..216).collect();
        assert_eq!(repetition_cut(&phrase.repeat(3)), None);
        assert_eq!(repetition_cut(&phrase.repeat(4)), Some(16));
        assert_eq!(repetition_cut(&[5; 31]), None);
        assert_eq!(repetition_cut(&words), None);
        assert_eq!(repetition_cut(&[]), None);
    }

    #[test]
    fn loudness_is_the_loudest_100_ms() {
        assert_eq!(loudest_dbfs(&[]), f32::NEG_INFINITY);
        assert_eq!(loudest_dbfs(&[0.0; 48_000]), f32::NEG_INFINITY);
        // Full-scale square wave: 0 dBFS; 1e-3 for 100 ms among zeros: -60 dBFS.
        let square: Vec<f32> = (0..3200)
            .map(|i| if i % 2 == 0 { 1.0 } else { -1.0 })
            .collect();
        assert!(loudest_dbfs(&square).abs() < 1e-4);
        let mut quiet = vec![0.0; 16_000];
        quiet[8000..9600].fill(1e-3);
        assert!(
            (loudest_dbfs(&quiet) + 60.0).abs() < 1e-3,
            "{}",
            loudest_dbfs(&quiet)
        );
    }

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn recognizer_is_send_sync() {
        assert_send_sync::<WhisperAsr>();
    }
}
