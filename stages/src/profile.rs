//! Deploy profiles: the YAML in `deploy/` that sets each stage's runtime knobs.
//!
//! Topology (which stage feeds which, and what crosses the boundary) is code; the
//! knobs are YAML. Unknown keys are errors, and so are values that cannot work:
//! every error names the file and the key.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// A profile error, always naming the file and (where there is one) the key.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("{file}: cannot read profile: {source}")]
    Read {
        file: PathBuf,
        source: std::io::Error,
    },
    #[error("{file}: {msg}")]
    Parse { file: PathBuf, msg: String },
    #[error("{file}: {key}: {msg}")]
    Invalid {
        file: PathBuf,
        key: String,
        msg: String,
    },
}

/// `ar` stages decode step by step (one token per request per step); `generation`
/// stages turn a whole input span into output in one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StageKind {
    Ar,
    Generation,
}

/// The models a stage can run. The type fixes which role it can play.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelType {
    /// Whisper in CTranslate2's format (`model.bin` with its `config.json`,
    /// `tokenizer.json` beside it) as Listener: speech to text.
    WhisperCt2,
    /// A llama-architecture GGUF chat model (SmolLM2) as Thinker.
    GgufLlama,
    /// Piper VITS text encoder + duration predictor + flow: phonemes to latent frames.
    PiperTalker,
    /// Piper's HiFi-GAN decoder: latent frames to PCM.
    PiperDecoder,
    /// Qwen3-Omni's Thinker (MoE text decoder + audio encoder): hears speech and
    /// text, writes text and hands its Talker the embeddings it speaks from.
    Qwen3OmniThinker,
    /// Qwen3-Omni's Talker and code predictor: Thinker states to codec frames.
    Qwen3OmniTalker,
    /// Qwen3-Omni's Code2Wav: codec frames to 24 kHz PCM (exact streaming).
    Qwen3OmniCode2wav,
    /// Qwen3-TTS's Talker and code predictor: text (given, or a Thinker's as it
    /// is written) to codec frames, in a preset, described or cloned voice.
    Qwen3TtsTalker,
    /// Qwen3-TTS's speech-tokenizer decoder: codec frames to 24 kHz PCM (exact
    /// streaming).
    Qwen3TtsCode2wav,
}

/// Where a checkpoint's weights come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightsSource {
    /// The safetensors in the model folder.
    #[default]
    Checkpoint,
    /// Random values at the folder's `config.json` shapes (benchmarks).
    Random,
}

/// The dtype a checkpoint is computed in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    Bf16,
}

impl ModelType {
    /// Qwen3-Omni stages load one checkpoint folder (shared by the three stages).
    pub fn is_qwen3_omni(self) -> bool {
        matches!(
            self,
            Self::Qwen3OmniThinker | Self::Qwen3OmniTalker | Self::Qwen3OmniCode2wav
        )
    }

    /// Qwen3-TTS stages load one checkpoint folder (shared by the two stages).
    pub fn is_qwen3_tts(self) -> bool {
        matches!(self, Self::Qwen3TtsTalker | Self::Qwen3TtsCode2wav)
    }

    /// Stages that load a checkpoint folder and may run on a GPU.
    pub fn is_qwen3(self) -> bool {
        self.is_qwen3_omni() || self.is_qwen3_tts()
    }

    /// The Code2Wav stages that keep every stream's state (exact, causal) and
    /// step as CUDA graphs.
    pub fn is_qwen3_code2wav(self) -> bool {
        matches!(self, Self::Qwen3OmniCode2wav | Self::Qwen3TtsCode2wav)
    }

    /// The Talkers whose profile may set a voice and code predictor sampling.
    pub fn is_qwen3_talker(self) -> bool {
        matches!(self, Self::Qwen3OmniTalker | Self::Qwen3TtsTalker)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    #[serde(rename = "type")]
    pub model_type: ModelType,
    /// Model file, relative to the profile's folder.
    pub path: PathBuf,
    /// Second file where a model needs one (Piper's `.onnx.json`); relative to the profile.
    #[serde(default)]
    pub config: Option<PathBuf>,
    /// Qwen3-Omni: the folder with `tokenizer.json` (default: the model folder).
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    /// Qwen3-Omni: `checkpoint` (default) or `random` weights.
    #[serde(default)]
    pub weights: WeightsSource,
    /// Qwen3-Omni: `f32` (default) or `bf16`.
    #[serde(default)]
    pub dtype: Dtype,
}

/// Default sampling parameters of a stage. Which keys apply depends on the model;
/// a key the model does not use is an error, so no knob is silently ignored.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SamplingParams {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
    pub max_tokens: Option<usize>,
    pub seed: Option<u64>,
    pub noise_scale: Option<f32>,
    pub length_scale: Option<f32>,
    pub noise_w: Option<f32>,
}

impl SamplingParams {
    fn set_keys(&self) -> Vec<&'static str> {
        let mut keys = Vec::new();
        macro_rules! check {
            ($($f:ident),*) => { $( if self.$f.is_some() { keys.push(stringify!($f)); } )* };
        }
        check!(
            temperature,
            top_p,
            top_k,
            repetition_penalty,
            max_tokens,
            seed,
            noise_scale,
            length_scale,
            noise_w
        );
        keys
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StageSpec {
    pub stage_id: usize,
    pub name: String,
    pub kind: StageKind,
    pub model: ModelSpec,
    #[serde(default = "default_device")]
    pub device: String,
    /// Independent workers of this stage, each with its own batch and state; a
    /// request stays on the replica it was given for its whole life.
    #[serde(default = "default_replicas")]
    pub replicas: usize,
    /// One device per replica (`[cuda:0, cuda:1]`); overrides `device`.
    #[serde(default)]
    pub devices: Vec<String>,
    /// `local`: the stage's replicas run inside `omnistream serve`; `remote`:
    /// each replica is its own `omnistream stage` process, reached over NATS.
    #[serde(default)]
    pub placement: Placement,
    /// Remote stages naming the same `process` run together, one process per
    /// replica (`omnistream stage --stage talker,code2wav`), sharing their models
    /// (Qwen3-Omni's Talker and Code2Wav: one checkpoint, loaded once). They
    /// need the same `replicas` and devices.
    #[serde(default)]
    pub process: Option<String>,
    /// Requests a stage works on in one step; more are queued, never refused here.
    pub max_num_seqs: usize,
    /// Longest prompt chunk an `ar` stage prefills in one step, so a long prompt
    /// cannot stall the decode steps of everyone else.
    #[serde(default)]
    pub max_prefill_tokens: Option<usize>,
    /// Qwen3-Omni's Thinker: a prompt longer than this is prefilled in chunks
    /// of this many tokens, one a step between the running batch's decode
    /// steps (vLLM's chunked prefill). Unset: every prompt whole.
    #[serde(default)]
    pub prefill_chunk_tokens: Option<usize>,
    /// `ar` stages: prompts whose KV is kept for reuse by prompts with the same
    /// prefix (0 turns prefix caching off).
    #[serde(default)]
    pub prefix_cache_entries: Option<usize>,
    /// `ar` stages: most MiB of KV the prefix cache keeps (default 256).
    #[serde(default)]
    pub prefix_cache_mib: Option<usize>,
    /// Qwen3-Omni `ar` stages: longest prompt + answer of one request, in positions
    /// (sizes its KV slot; default 4096, at most the model's own context).
    #[serde(default)]
    pub max_model_len: Option<usize>,
    /// Qwen3-Omni `ar` stages on a GPU: decode without CUDA graphs (each step's
    /// kernels launched one by one). Graphs are the default there; this is for
    /// debugging and for measuring what they save.
    #[serde(default)]
    pub enforce_eager: bool,
    #[serde(default)]
    pub sampling: SamplingParams,
    /// Qwen3-Omni Talker: how the code predictor draws codes 1..15.
    #[serde(default)]
    pub code_predictor_sampling: Option<SamplingParams>,
    /// Talker stages: the voice used when a request names none.
    #[serde(default)]
    pub voice: Option<String>,
}

fn default_device() -> String {
    "cpu".to_string()
}

fn default_replicas() -> usize {
    1
}

/// Where a stage's replicas run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Placement {
    /// Worker threads inside `omnistream serve` (in-process connectors).
    #[default]
    Local,
    /// `omnistream stage` processes, on this host or others, joined over NATS.
    Remote,
}

/// Most replicas of one stage (a guard against typos such as `replicas: 1000`).
pub const MAX_REPLICAS: usize = 64;

impl StageSpec {
    /// The device of replica `replica`: its `devices` entry, else `device`.
    pub fn device_of(&self, replica: usize) -> &str {
        self.devices
            .get(replica)
            .map(String::as_str)
            .unwrap_or(&self.device)
    }
}

/// Where a stage runs: `cpu`, or `cuda` / `cuda:N` (GPU N) in a build with the
/// `cuda` feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

/// Parses a stage's `device`.
pub fn parse_device(s: &str) -> Result<DeviceSpec, String> {
    let cuda = match s {
        "cpu" => return Ok(DeviceSpec::Cpu),
        "cuda" => 0,
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => return Err(format!("unknown device {s:?} (cpu, cuda or cuda:N)")),
        },
    };
    if cfg!(feature = "cuda") {
        Ok(DeviceSpec::Cuda(cuda))
    } else {
        Err(format!(
            "device {s:?}: this build has no CUDA support (build with `--features cuda`, see scripts/cuda/build.sh)"
        ))
    }
}

/// The knobs of the connector between stage `from` and stage `from + 1`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectorSpec {
    pub from: usize,
    pub to: usize,
    /// Bounded channel capacity, in payloads.
    #[serde(default = "default_capacity")]
    pub capacity: usize,
    /// Text connectors: a span is speakable at a clause boundary once it holds at
    /// least this many characters.
    #[serde(default)]
    pub min_span_chars: Option<usize>,
    /// Text connectors: force a span after this many text deltas (tokens) even
    /// without a clause boundary (cut at the last word boundary).
    #[serde(default)]
    pub max_span_tokens: Option<usize>,
    /// Text connectors: like `max_span_tokens`, for the first span of an answer
    /// only (small = earlier first audio, at some cost to the first phrase's prosody).
    #[serde(default)]
    pub initial_span_tokens: Option<usize>,
    /// Frame connectors: frames of audio in the first decoded chunk.
    #[serde(default)]
    pub initial_codec_chunk_frames: Option<usize>,
    /// Frame connectors: frames of audio in every later chunk.
    #[serde(default)]
    pub codec_chunk_frames: Option<usize>,
    /// Frame connectors: chunks after the first double in size up to
    /// `codec_chunk_frames` (1, 2, 4, 8 ...), so the second chunk's audio is
    /// ready before the first has played out under load.
    #[serde(default)]
    pub codec_chunk_ramp: Option<bool>,
    /// Frame connectors: 0 = stateful exact streaming; N > 0 = re-decode each chunk
    /// with N frames of left context and trim (the reference-style decoder, kept to
    /// show what state buys; not exact).
    #[serde(default)]
    pub codec_left_context_frames: Option<usize>,
}

fn default_capacity() -> usize {
    64
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    /// true: each stage starts on partial input; false: each waits for its whole input.
    pub async_chunk: bool,
    pub stages: Vec<StageSpec>,
    #[serde(default)]
    pub connectors: Vec<ConnectorSpec>,
    /// The server's own section (connections, keys, WebRTC, VAD): read by the
    /// `omnistream` binary, which owns it; the engine does not look inside.
    #[serde(default)]
    pub server: Option<serde_yaml_ng::Value>,
    /// The Silero VAD (a resolved path) the Listener hears through, so silence
    /// and noise never reach the recognizer (faster-whisper's `vad_filter`).
    /// Set by whoever reads the server section (its `vad`), not from YAML.
    #[serde(skip)]
    pub listener_vad: Option<PathBuf>,
    /// Folder of the profile file; model paths are relative to it.
    #[serde(skip)]
    pub base_dir: PathBuf,
    #[serde(skip)]
    pub file: PathBuf,
}

/// What kind of payload crosses a connector, from the model types on each side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectorKind {
    Text,
    Frames,
}

impl Profile {
    pub fn load(path: &Path) -> Result<Self, ProfileError> {
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Read {
            file: path.to_path_buf(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates `text` as if read from `path`.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ProfileError> {
        let mut profile: Profile =
            serde_yaml_ng::from_str(text).map_err(|e| ProfileError::Parse {
                file: path.to_path_buf(),
                msg: e.to_string(),
            })?;
        profile.file = path.to_path_buf();
        profile.base_dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        profile.validate()?;
        Ok(profile)
    }

    /// An error about `key` of this profile (naming its file).
    pub fn invalid(&self, key: impl Into<String>, msg: impl Into<String>) -> ProfileError {
        ProfileError::Invalid {
            file: self.file.clone(),
            key: key.into(),
            msg: msg.into(),
        }
    }

    /// A path from the profile, resolved against the profile's folder.
    pub fn resolve(&self, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            self.base_dir.join(p)
        }
    }

    pub fn stage(&self, name: &str) -> Option<&StageSpec> {
        self.stages.iter().find(|s| s.name == name)
    }

    pub fn connector(&self, from: usize) -> Option<&ConnectorSpec> {
        self.connectors.iter().find(|c| c.from == from)
    }

    pub fn connector_kind(&self, from: usize) -> Option<ConnectorKind> {
        let up = self.stages.get(from)?;
        Some(match up.model.model_type {
            ModelType::WhisperCt2 | ModelType::GgufLlama | ModelType::Qwen3OmniThinker => {
                ConnectorKind::Text
            }
            ModelType::PiperTalker
            | ModelType::PiperDecoder
            | ModelType::Qwen3OmniTalker
            | ModelType::Qwen3OmniCode2wav
            | ModelType::Qwen3TtsTalker
            | ModelType::Qwen3TtsCode2wav => ConnectorKind::Frames,
        })
    }

    fn validate(&self) -> Result<(), ProfileError> {
        if self.stages.is_empty() {
            return Err(self.invalid("stages", "at least one stage is required"));
        }
        for (i, s) in self.stages.iter().enumerate() {
            let key = |k: &str| format!("stages[{i}].{k}");
            if s.stage_id != i {
                return Err(self.invalid(
                    key("stage_id"),
                    format!(
                        "stages must be listed in order: expected {i}, found {}",
                        s.stage_id
                    ),
                ));
            }
            if s.max_num_seqs == 0 {
                return Err(self.invalid(key("max_num_seqs"), "must be at least 1"));
            }
            if s.max_prefill_tokens == Some(0) {
                return Err(self.invalid(key("max_prefill_tokens"), "must be at least 1"));
            }
            if let Some(n) = s.prefill_chunk_tokens {
                if s.model.model_type != ModelType::Qwen3OmniThinker {
                    return Err(self.invalid(
                        key("prefill_chunk_tokens"),
                        "applies to the Qwen3-Omni Thinker only (an `ar` stage's chunk is max_prefill_tokens)",
                    ));
                }
                if n == 0 {
                    return Err(self.invalid(key("prefill_chunk_tokens"), "must be at least 1"));
                }
            }
            if s.kind != StageKind::Ar {
                for (k, set) in [
                    ("max_prefill_tokens", s.max_prefill_tokens.is_some()),
                    ("prefix_cache_entries", s.prefix_cache_entries.is_some()),
                    ("prefix_cache_mib", s.prefix_cache_mib.is_some()),
                    ("max_model_len", s.max_model_len.is_some()),
                ] {
                    if set {
                        return Err(self.invalid(key(k), "applies to `ar` stages only"));
                    }
                }
                // The Qwen3 Code2Wavs step as CUDA graphs too; no other decoder does.
                if s.enforce_eager && !s.model.model_type.is_qwen3_code2wav() {
                    return Err(self.invalid(
                        key("enforce_eager"),
                        "applies to `ar` stages and the Qwen3 Code2Wav stages only",
                    ));
                }
            }
            if s.max_model_len.is_some_and(|n| n < 2) {
                return Err(self.invalid(key("max_model_len"), "must be at least 2"));
            }
            if s.replicas == 0 || s.replicas > MAX_REPLICAS {
                return Err(self.invalid(
                    key("replicas"),
                    format!("must be 1 to {MAX_REPLICAS}, got {}", s.replicas),
                ));
            }
            if !s.devices.is_empty() && s.devices.len() != s.replicas {
                return Err(self.invalid(
                    key("devices"),
                    format!(
                        "{} entries for {} replicas: give one device per replica",
                        s.devices.len(),
                        s.replicas
                    ),
                ));
            }
            let device_keys: Vec<(String, &str)> = if s.devices.is_empty() {
                vec![(key("device"), s.device.as_str())]
            } else {
                s.devices
                    .iter()
                    .enumerate()
                    .map(|(j, d)| (key(&format!("devices[{j}]")), d.as_str()))
                    .collect()
            };
            for (k, d) in device_keys {
                match parse_device(d) {
                    Err(msg) => return Err(self.invalid(k, msg)),
                    Ok(DeviceSpec::Cuda(_)) if !s.model.model_type.is_qwen3() => return Err(self
                        .invalid(
                        k,
                        "only Qwen3-Omni and Qwen3-TTS stages run on a GPU; the others run on cpu",
                    )),
                    Ok(_) => {}
                }
            }
            // Stages sharing one checkpoint share its weights, so one device.
            if let Some(other) = self.stages[..i].iter().find(|o| {
                o.model.model_type.is_qwen3()
                    && s.model.model_type.is_qwen3()
                    && o.model.path == s.model.path
                    && parse_device(o.device_of(0)) != parse_device(s.device_of(0))
            }) {
                return Err(self.invalid(
                    key("device"),
                    format!(
                        "{:?} shares its checkpoint with stage {:?} on {:?}: stages of one checkpoint run on one device",
                        s.device_of(0), other.name, other.device_of(0)
                    ),
                ));
            }
            let expected_kind = match s.model.model_type {
                ModelType::WhisperCt2
                | ModelType::GgufLlama
                | ModelType::Qwen3OmniThinker
                | ModelType::Qwen3OmniTalker
                | ModelType::Qwen3TtsTalker => StageKind::Ar,
                ModelType::PiperTalker
                | ModelType::PiperDecoder
                | ModelType::Qwen3OmniCode2wav
                | ModelType::Qwen3TtsCode2wav => StageKind::Generation,
            };
            if s.kind != expected_kind {
                return Err(self.invalid(
                    key("kind"),
                    format!(
                        "model type {:?} runs as {:?}, not {:?}",
                        s.model.model_type, expected_kind, s.kind
                    ),
                ));
            }
            let model_path = self.resolve(&s.model.path);
            if s.model.model_type.is_qwen3() {
                self.validate_checkpoint(i, s)?;
            } else if !model_path.is_file() {
                return Err(self.invalid(
                    key("model.path"),
                    format!(
                        "{} does not exist (run `omnistream fetch-models`)",
                        model_path.display()
                    ),
                ));
            }
            if let Some(c) = &s.model.config {
                let p = self.resolve(c);
                if !p.is_file() {
                    return Err(self.invalid(
                        key("model.config"),
                        format!("{} does not exist", p.display()),
                    ));
                }
            }
            self.validate_sampling(i, s)?;
        }
        // Topology: the chain of model types must make sense.
        let types: Vec<ModelType> = self.stages.iter().map(|s| s.model.model_type).collect();
        for w in types.windows(2).enumerate() {
            let (i, pair) = w;
            let ok = matches!(
                (pair[0], pair[1]),
                (ModelType::WhisperCt2, ModelType::GgufLlama)
                    | (ModelType::GgufLlama, ModelType::PiperTalker)
                    | (ModelType::PiperTalker, ModelType::PiperDecoder)
                    | (ModelType::Qwen3OmniThinker, ModelType::Qwen3OmniTalker)
                    | (ModelType::Qwen3OmniTalker, ModelType::Qwen3OmniCode2wav)
                    | (ModelType::Qwen3TtsTalker, ModelType::Qwen3TtsCode2wav)
                    | (ModelType::GgufLlama, ModelType::Qwen3TtsTalker)
            );
            if !ok {
                return Err(self.invalid(
                    format!("stages[{}].model.type", i + 1),
                    format!("{:?} cannot follow {:?}", pair[1], pair[0]),
                ));
            }
        }
        for (i, s) in self.stages.iter().enumerate() {
            let Some(group) = &s.process else { continue };
            let key = format!("stages[{i}].process");
            if s.placement != Placement::Remote {
                return Err(self.invalid(
                    key,
                    "only remote stages run in a process of their own (placement: remote)",
                ));
            }
            if group.is_empty() {
                return Err(self.invalid(key, "must name the process"));
            }
            let first = self
                .stages
                .iter()
                .find(|o| o.process.as_ref() == Some(group));
            if let Some(o) = first.filter(|o| o.name != s.name) {
                let devices = |x: &StageSpec| {
                    (0..x.replicas)
                        .map(|r| x.device_of(r).to_string())
                        .collect::<Vec<_>>()
                };
                if o.replicas != s.replicas || devices(o) != devices(s) {
                    return Err(self.invalid(
                        key,
                        format!("stages {:?} and {:?} share process {group:?}, so need the same replicas and devices", o.name, s.name),
                    ));
                }
            }
        }
        for (j, c) in self.connectors.iter().enumerate() {
            let key = |k: &str| format!("connectors[{j}].{k}");
            let feeds_local = |c: &ConnectorSpec| {
                self.stages.get(c.from).map(|s| s.placement) == Some(Placement::Remote)
                    && self.stages.get(c.to).map(|s| s.placement) == Some(Placement::Local)
            };
            if feeds_local(c) {
                return Err(self.invalid(
                    format!("stages[{}].placement", c.to),
                    "a remote stage cannot feed a local one: place the stages after a remote stage remote too",
                ));
            }
            if c.from + 1 != c.to || c.to >= self.stages.len() {
                return Err(self.invalid(
                    key("to"),
                    format!(
                        "a connector joins stage N to stage N+1 of the {} stages; got {} -> {}",
                        self.stages.len(),
                        c.from,
                        c.to
                    ),
                ));
            }
            if self.connectors[..j].iter().any(|o| o.from == c.from) {
                return Err(self.invalid(key("from"), "two connectors leave the same stage"));
            }
            if c.capacity == 0 {
                return Err(self.invalid(key("capacity"), "must be at least 1"));
            }
            let text_keys = [
                ("min_span_chars", c.min_span_chars.is_some()),
                ("max_span_tokens", c.max_span_tokens.is_some()),
                ("initial_span_tokens", c.initial_span_tokens.is_some()),
            ];
            let frame_keys = [
                (
                    "initial_codec_chunk_frames",
                    c.initial_codec_chunk_frames.is_some(),
                ),
                ("codec_chunk_frames", c.codec_chunk_frames.is_some()),
                ("codec_chunk_ramp", c.codec_chunk_ramp.is_some()),
                (
                    "codec_left_context_frames",
                    c.codec_left_context_frames.is_some(),
                ),
            ];
            let kind = self.connector_kind(c.from);
            let foreign = match kind {
                Some(ConnectorKind::Text) => frame_keys.iter().find(|k| k.1),
                Some(ConnectorKind::Frames) => text_keys.iter().find(|k| k.1),
                None => None,
            };
            if let Some((k, _)) = foreign {
                return Err(self.invalid(
                    key(k),
                    format!(
                        "does not apply to a {:?} connector",
                        kind.unwrap_or(ConnectorKind::Text)
                    ),
                ));
            }
            for (k, v) in [
                ("initial_codec_chunk_frames", c.initial_codec_chunk_frames),
                ("codec_chunk_frames", c.codec_chunk_frames),
                ("max_span_tokens", c.max_span_tokens),
                ("initial_span_tokens", c.initial_span_tokens),
            ] {
                if v == Some(0) {
                    return Err(self.invalid(key(k), "must be at least 1"));
                }
            }
            let into_qwen3 = self
                .stages
                .get(c.to)
                .is_some_and(|s| s.model.model_type.is_qwen3_code2wav());
            if into_qwen3 && c.codec_left_context_frames.is_some_and(|n| n > 0) {
                return Err(self.invalid(
                    key("codec_left_context_frames"),
                    "the Qwen3 Code2Wavs always stream exactly (causal, stateful): no re-decoded context",
                ));
            }
        }
        Ok(())
    }

    /// A Qwen3-Omni or Qwen3-TTS stage's folder: `config.json` (and Qwen3-TTS's
    /// `speech_tokenizer/config.json`), and the weights unless random.
    fn validate_checkpoint(&self, i: usize, s: &StageSpec) -> Result<(), ProfileError> {
        let key = |k: &str| format!("stages[{i}].{k}");
        let dir = self.resolve(&s.model.path);
        if !dir.join("config.json").is_file() {
            return Err(self.invalid(
                key("model.path"),
                format!(
                    "{} is not a Qwen3-Omni or Qwen3-TTS checkpoint folder (no config.json)",
                    dir.display()
                ),
            ));
        }
        if s.model.model_type.is_qwen3_tts()
            && !dir.join("speech_tokenizer").join("config.json").is_file()
        {
            return Err(self.invalid(
                key("model.path"),
                format!(
                    "{} is not a Qwen3-TTS checkpoint folder (no speech_tokenizer/config.json)",
                    dir.display()
                ),
            ));
        }
        if s.model.weights == WeightsSource::Checkpoint
            && !dir.join("model.safetensors").is_file()
            && !dir.join("model.safetensors.index.json").is_file()
        {
            return Err(self.invalid(
                key("model.path"),
                format!(
                    "{} has no model.safetensors or model.safetensors.index.json \
                     (or set `weights: random`)",
                    dir.display()
                ),
            ));
        }
        if matches!(
            s.model.model_type,
            ModelType::Qwen3OmniThinker | ModelType::Qwen3TtsTalker
        ) {
            let tok = self.resolve(s.model.tokenizer.as_ref().unwrap_or(&s.model.path));
            if !tok.join("tokenizer.json").is_file() {
                return Err(self.invalid(
                    key("model.tokenizer"),
                    format!("{} has no tokenizer.json", tok.display()),
                ));
            }
        }
        let wrong = |k: &str, set: bool| -> Result<(), ProfileError> {
            if set {
                Err(self.invalid(key(k), "applies to the Qwen3 Talker stages only"))
            } else {
                Ok(())
            }
        };
        if !s.model.model_type.is_qwen3_talker() {
            wrong(
                "code_predictor_sampling",
                s.code_predictor_sampling.is_some(),
            )?;
            wrong("voice", s.voice.is_some())?;
        }
        Ok(())
    }

    fn validate_sampling(&self, i: usize, s: &StageSpec) -> Result<(), ProfileError> {
        let allowed: &[&str] = match s.model.model_type {
            ModelType::GgufLlama => &[
                "temperature",
                "top_p",
                "top_k",
                "repetition_penalty",
                "max_tokens",
                "seed",
            ],
            ModelType::PiperTalker => &["noise_scale", "length_scale", "noise_w", "seed"],
            ModelType::Qwen3OmniThinker
            | ModelType::Qwen3OmniTalker
            | ModelType::Qwen3TtsTalker => &[
                "temperature",
                "top_p",
                "top_k",
                "repetition_penalty",
                "max_tokens",
                "seed",
            ],
            ModelType::PiperDecoder
            | ModelType::WhisperCt2
            | ModelType::Qwen3OmniCode2wav
            | ModelType::Qwen3TtsCode2wav => &[],
        };
        for k in s.sampling.set_keys() {
            if !allowed.contains(&k) {
                return Err(self.invalid(
                    format!("stages[{i}].sampling.{k}"),
                    format!("not used by model type {:?}", s.model.model_type),
                ));
            }
        }
        let p = &s.sampling;
        let key = |k: &str| format!("stages[{i}].sampling.{k}");
        if let Some(t) = p.temperature {
            if !(0.0..=10.0).contains(&t) {
                return Err(self.invalid(key("temperature"), "must be in [0, 10]"));
            }
        }
        if let Some(t) = p.top_p {
            if !(t > 0.0 && t <= 1.0) {
                return Err(self.invalid(key("top_p"), "must be in (0, 1]"));
            }
        }
        if p.max_tokens == Some(0) {
            return Err(self.invalid(key("max_tokens"), "must be at least 1"));
        }
        if let Some(r) = p.repetition_penalty {
            if !(r > 0.0 && r.is_finite()) {
                return Err(self.invalid(key("repetition_penalty"), "must be > 0"));
            }
        }
        for (k, v) in [("noise_scale", p.noise_scale), ("noise_w", p.noise_w)] {
            if let Some(v) = v {
                if !(v >= 0.0 && v.is_finite()) {
                    return Err(self.invalid(key(k), "must be >= 0"));
                }
            }
        }
        if let Some(v) = p.length_scale {
            if !(v > 0.0 && v <= 10.0) {
                return Err(self.invalid(key("length_scale"), "must be in (0, 10]"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A profile whose model files exist (empty files: loading is not tested here).
    fn fixture() -> (tempfile::TempDir, PathBuf, String) {
        let dir = tempfile::tempdir().unwrap();
        for f in ["m.gguf", "v.onnx", "v.onnx.json"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let yaml = r#"
name: t
async_chunk: true
stages:
  - { stage_id: 0, name: thinker, kind: ar, model: { type: gguf-llama, path: m.gguf }, max_num_seqs: 4, sampling: { temperature: 0.0 } }
  - { stage_id: 1, name: talker, kind: generation, model: { type: piper-talker, path: v.onnx, config: v.onnx.json }, max_num_seqs: 2 }
  - { stage_id: 2, name: code2wav, kind: generation, model: { type: piper-decoder, path: v.onnx }, max_num_seqs: 2 }
connectors:
  - { from: 0, to: 1, min_span_chars: 10 }
  - { from: 1, to: 2, initial_codec_chunk_frames: 1, codec_chunk_frames: 25 }
"#
        .to_string();
        let path = dir.path().join("p.yaml");
        (dir, path, yaml)
    }

    fn err(yaml: &str, path: &Path) -> String {
        Profile::parse(yaml, path).unwrap_err().to_string()
    }

    #[test]
    fn valid_profile_loads_and_resolves_paths() {
        let (dir, path, yaml) = fixture();
        let p = Profile::parse(&yaml, &path).unwrap();
        assert_eq!(p.stages.len(), 3);
        assert_eq!(
            p.resolve(&p.stages[0].model.path),
            dir.path().join("m.gguf")
        );
        assert_eq!(p.connector(1).unwrap().initial_codec_chunk_frames, Some(1));
        assert_eq!(p.connector_kind(0), Some(ConnectorKind::Text));
    }

    #[test]
    fn the_shipped_profiles_parse() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        for f in [
            "tiny-cpu.yaml",
            "tiny-cpu-sync.yaml",
            "distributed/tiny-cpu.yaml",
        ] {
            let text = std::fs::read_to_string(root.join(f)).unwrap();
            // Model files may be absent here: only a missing-file error is acceptable.
            match Profile::parse(&text, &root.join(f)) {
                Ok(p) => assert_eq!(
                    p.stages.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
                    ["listener", "thinker", "talker", "code2wav"]
                ),
                Err(e) => assert!(e.to_string().contains("does not exist"), "{f}: {e}"),
            }
        }
    }

    #[test]
    fn the_shipped_qwen3_tts_profiles_parse_and_check_their_folders() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        let tts = Profile::load(&root.join("qwen3-tts-tiny.yaml")).unwrap();
        let types: Vec<ModelType> = tts.stages.iter().map(|s| s.model.model_type).collect();
        assert_eq!(
            types,
            [ModelType::Qwen3TtsTalker, ModelType::Qwen3TtsCode2wav]
        );
        assert_eq!(tts.connector_kind(0), Some(ConnectorKind::Frames));
        let design = Profile::load(&root.join("qwen3-tts-design-tiny.yaml")).unwrap();
        assert_eq!(design.stages[0].voice, None);
        let cascade = Profile::load(&root.join("smollm2-qwen3-tts-tiny.yaml")).unwrap();
        assert_eq!(
            cascade.stages[2].model.model_type,
            ModelType::Qwen3TtsTalker
        );
        assert_eq!(cascade.connector_kind(1), Some(ConnectorKind::Text));
        // A folder without the speech tokenizer is named as the problem.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("model.safetensors"), "").unwrap();
        let text = format!(
            "name: t\nasync_chunk: true\nstages:\n  - {{ stage_id: 0, name: talker, kind: ar, max_num_seqs: 1, model: {{ type: qwen3-tts-talker, path: {0} }} }}\n  - {{ stage_id: 1, name: c2w, kind: generation, max_num_seqs: 1, model: {{ type: qwen3-tts-code2wav, path: {0} }} }}\n",
            dir.path().display()
        );
        let err = Profile::parse(&text, &dir.path().join("p.yaml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("speech_tokenizer/config.json"), "{err}");
        // Qwen3-TTS's Code2Wav after its Talker, never Qwen3-Omni's.
        std::fs::create_dir_all(dir.path().join("speech_tokenizer")).unwrap();
        std::fs::write(dir.path().join("speech_tokenizer/config.json"), "{}").unwrap();
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        Profile::parse(&text, &dir.path().join("p.yaml")).unwrap();
        let bad = text.replace("qwen3-tts-code2wav", "qwen3-omni-code2wav");
        let err = Profile::parse(&bad, &dir.path().join("p.yaml"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot follow"), "{err}");
    }

    #[test]
    fn the_released_qwen3_tts_profiles_parse_and_their_configs_load() {
        use crate::models::qwen3_tts::config::{ModelType as Tts, Qwen3TtsConfig};
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/qwen3_tts_released");
        for (name, kind, presets) in [
            ("1.7b-customvoice", Tts::CustomVoice, true),
            ("1.7b-voicedesign", Tts::VoiceDesign, false),
            ("1.7b-base", Tts::Base, false),
            ("0.6b-customvoice", Tts::CustomVoice, true),
            ("0.6b-base", Tts::Base, false),
        ] {
            // On the CPU (a build without CUDA refuses `device: cuda`).
            let file = root.join(format!("{name}.yaml"));
            let text = std::fs::read_to_string(&file).unwrap();
            assert!(text.contains("device: cuda"), "{name}");
            let p = Profile::parse(&text.replace("device: cuda", "device: cpu"), &file).unwrap();
            let types: Vec<ModelType> = p.stages.iter().map(|s| s.model.model_type).collect();
            assert_eq!(
                types,
                [ModelType::Qwen3TtsTalker, ModelType::Qwen3TtsCode2wav],
                "{name}"
            );
            assert_eq!(p.stages[0].voice.is_some(), presets, "{name}");
            let dir = p.resolve(&p.stages[0].model.path);
            let cfg = Qwen3TtsConfig::load(&dir).unwrap();
            assert_eq!(cfg.tts_model_type, kind, "{name}");
            // The bench folder is the released config but for the text
            // tokens' ids (scripts/qwen3_tts/bench_configs.py).
            assert_eq!(dir, root.join("bench").join(name), "{name}");
            let json = |d: &Path| -> serde_json::Value {
                let mut v: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap())
                        .unwrap();
                for k in [
                    "im_start_token_id",
                    "im_end_token_id",
                    "tts_pad_token_id",
                    "tts_bos_token_id",
                    "tts_eos_token_id",
                    "assistant_token_id",
                ] {
                    v.as_object_mut().unwrap().remove(k);
                }
                v
            };
            assert_eq!(json(&dir), json(&root.join(name)), "{name}");
            assert_eq!(cfg.talker_config.num_code_groups, 16, "{name}");
            if kind == Tts::Base {
                assert!(cfg.speaker_encoder_config.is_some(), "{name}");
            }
        }
    }

    /// vLLM-Omni's 3-GPU layout (deploy/qwen3-omni-3gpu.yaml, and one process
    /// a GPU in deploy/distributed/): checked here with its devices read as
    /// the CPU, which every build accepts.
    #[test]
    fn the_3gpu_layouts_place_their_replicas() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        for (f, remote) in [
            ("qwen3-omni-3gpu.yaml", Placement::Local),
            ("distributed/qwen3-omni-3gpu.yaml", Placement::Remote),
        ] {
            let path = root.join(f);
            let text = std::fs::read_to_string(&path).unwrap();
            let p = Profile::parse(
                &text
                    .replace("cuda:0", "cpu")
                    .replace("[cuda:1, cuda:2]", "[cpu, cpu]"),
                &path,
            )
            .unwrap_or_else(|e| panic!("{f}: {e}"));
            assert_eq!(p.stages[0].replicas, 1, "{f}");
            for s in &p.stages[1..] {
                assert_eq!((s.replicas, s.devices.len()), (2, 2), "{f}: {}", s.name);
                assert_eq!(s.placement, remote, "{f}: {}", s.name);
            }
            // Each replica on its own GPU, the Thinker alone on the first.
            assert!(
                text.contains("devices: [cuda:1, cuda:2]") && text.contains("device: cuda:0"),
                "{f}"
            );
        }
    }

    #[test]
    fn the_8gpu_profile_puts_a_whole_pipeline_on_every_gpu() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/qwen3-omni-8gpu.yaml");
        let text = std::fs::read_to_string(&path).unwrap();
        // (A build without CUDA refuses cuda devices: parsed with cpu ones.)
        let cpu = (0..8).fold(text.clone(), |t, i| t.replace(&format!("cuda:{i}"), "cpu"));
        let p = Profile::parse(&cpu, &path).unwrap_or_else(|e| panic!("{e}"));
        for s in &p.stages {
            assert_eq!((s.replicas, s.devices.len()), (8, 8), "{}", s.name);
            assert_eq!(s.placement, Placement::Local, "{}", s.name);
        }
        let gpus = format!(
            "devices: [{}]",
            (0..8)
                .map(|i| format!("cuda:{i}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        assert_eq!(text.matches(&gpus).count(), 3, "each stage on every GPU");
    }

    #[test]
    fn the_shipped_qwen3_omni_profiles_parse() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        // The tiny one points at the committed fixture checkpoint.
        let tiny = Profile::load(&root.join("qwen3-omni-tiny.yaml")).unwrap();
        assert_eq!(tiny.stages.len(), 3);
        let split = Profile::load(&root.join("distributed/qwen3-omni-tiny.yaml")).unwrap();
        let placed: Vec<Placement> = split.stages.iter().map(|s| s.placement).collect();
        assert_eq!(
            placed,
            [Placement::Local, Placement::Remote, Placement::Remote]
        );
        assert_eq!(tiny.stages[1].voice.as_deref(), Some("ethan"));
        // The GPU ones: every stage on cuda, which only a CUDA build accepts; the
        // voice one decodes eagerly in the Thinker only.
        for (f, eager) in [
            ("qwen3-omni-h200.yaml", [false, false, false]),
            ("qwen3-omni-h200-voice.yaml", [true, false, false]),
        ] {
            let gpu = Profile::load(&root.join(f));
            if cfg!(feature = "cuda") {
                let gpu = gpu.unwrap();
                assert!(gpu.stages.iter().all(|s| s.device == "cuda"));
                let got: Vec<bool> = gpu.stages.iter().map(|s| s.enforce_eager).collect();
                assert_eq!(got, eager, "{f}");
            } else {
                let err = gpu.unwrap_err().to_string();
                assert!(
                    err.contains("stages[0].device") && err.contains("no CUDA support"),
                    "{f}: {err}"
                );
            }
        }
        // The real one, beside a checkpoint folder laid out as the download is.
        let dir = tempfile::tempdir().unwrap();
        let deploy = dir.path().join("deploy");
        let ckpt = dir.path().join("models/Qwen3-Omni-30B-A3B-Instruct");
        std::fs::create_dir_all(&deploy).unwrap();
        std::fs::create_dir_all(&ckpt).unwrap();
        std::fs::copy(
            root.join("qwen3_omni_moe/config.json"),
            ckpt.join("config.json"),
        )
        .unwrap();
        std::fs::write(ckpt.join("tokenizer.json"), "{}").unwrap();
        let text = std::fs::read_to_string(root.join("qwen3_omni_moe.yaml")).unwrap();
        let err = Profile::parse(&text, &deploy.join("qwen3_omni_moe.yaml")).unwrap_err();
        assert!(
            err.to_string().contains("model.safetensors.index.json"),
            "{err}"
        );
        std::fs::write(ckpt.join("model.safetensors.index.json"), "{}").unwrap();
        let p = Profile::parse(&text, &deploy.join("qwen3_omni_moe.yaml")).unwrap();
        assert_eq!(p.stages[0].model.dtype, Dtype::Bf16);
        let talker = &p.stages[1];
        assert_eq!(talker.sampling.top_k, Some(50));
        assert_eq!(
            talker.code_predictor_sampling.as_ref().unwrap().top_p,
            Some(0.8)
        );
        assert_eq!(p.connector(1).unwrap().initial_codec_chunk_frames, Some(1));
        // Code2Wav's CUDA graphs can be turned off, as the `ar` stages' can.
        let eager = text.replace(
            "    max_num_seqs: 8\nconnectors:",
            "    max_num_seqs: 8\n    enforce_eager: true\nconnectors:",
        );
        let p = Profile::parse(&eager, &deploy.join("qwen3_omni_moe.yaml")).unwrap();
        assert!(p.stages[2].enforce_eager);
        // The exact decoder has no re-decoded context to set.
        let text = text.replace(
            "codec_chunk_frames: 4",
            "codec_chunk_frames: 4\n    codec_left_context_frames: 25",
        );
        let err = Profile::parse(&text, &deploy.join("qwen3_omni_moe.yaml")).unwrap_err();
        assert!(
            err.to_string()
                .contains("connectors[1].codec_left_context_frames"),
            "{err}"
        );
    }

    #[test]
    fn replicas_devices_and_placement() {
        let (_d, path, yaml) = fixture();
        let talker = "name: talker, kind: generation,";
        let with = |extra: &str| yaml.replace(talker, &format!("{talker} {extra}"));
        let p = Profile::parse(&with("replicas: 2, devices: [cpu, cpu],"), &path).unwrap();
        assert_eq!(p.stages[1].replicas, 2);
        assert_eq!(p.stages[1].device_of(1), "cpu");
        assert_eq!(p.stages[0].replicas, 1, "one replica unless said");
        assert_eq!(p.stages[0].placement, Placement::Local);
        // The Talker and what follows it remote: a gateway keeps the Thinker.
        let split = with("placement: remote,").replace(
            "name: code2wav, kind: generation,",
            "name: code2wav, kind: generation, placement: remote,",
        );
        let p = Profile::parse(&split, &path).unwrap();
        assert_eq!(p.stages[1].placement, Placement::Remote);
        // Talker and Code2Wav in one process: same replicas and devices, or an error.
        let grouped = split
            .replace("placement: remote,", "placement: remote, process: audio,")
            .replace(
                "name: talker, kind: generation, placement: remote, process: audio,",
                "name: talker, kind: generation, placement: remote, process: audio, replicas: 2,",
            );
        let e = err(&grouped, &path);
        assert!(
            e.contains("stages[2].process") && e.contains("same replicas"),
            "{e}"
        );
        let grouped = grouped.replace("process: audio, replicas: 2,", "process: audio,");
        let p = Profile::parse(&grouped, &path).unwrap();
        assert_eq!(p.stages[2].process.as_deref(), Some("audio"));
        for (extra, key, msg) in [
            ("replicas: 0,", "stages[1].replicas", "must be 1 to 64"),
            ("replicas: 65,", "stages[1].replicas", "must be 1 to 64"),
            (
                "replicas: 2, devices: [cpu],",
                "stages[1].devices",
                "1 entries for 2 replicas",
            ),
            (
                "replicas: 2, devices: [cpu, tpu],",
                "stages[1].devices[1]",
                "unknown device",
            ),
            ("placement: elsewhere,", "", "unknown variant `elsewhere`"),
            ("replica: 2,", "", "unknown field `replica`"),
            ("process: audio,", "stages[1].process", "only remote stages"),
            // Remote Talker, local Code2Wav: the Talker could not reach it.
            (
                "placement: remote,",
                "stages[2].placement",
                "a remote stage cannot feed a local one",
            ),
        ] {
            let e = err(&with(extra), &path);
            assert!(
                e.contains(&path.display().to_string()) && e.contains(key) && e.contains(msg),
                "{extra}: {e}"
            );
        }
    }

    #[test]
    fn errors_name_the_file_and_the_key() {
        let (_d, path, yaml) = fixture();
        let file = path.display().to_string();
        let cases = [
            (
                yaml.replace("max_num_seqs: 4", "max_num_seqs: 4, batch: 3"),
                "batch",
            ),
            (
                yaml.replace("async_chunk: true", "async_chunk: true\nasync_chunks: 1"),
                "async_chunks",
            ),
            (
                yaml.replace("max_num_seqs: 4", "max_num_seqs: 0"),
                "stages[0].max_num_seqs",
            ),
            // No CUDA in this build; with it, a Llama stage still runs on the CPU only.
            (
                yaml.replace("device: cpu", "")
                    .replace("max_num_seqs: 4,", "max_num_seqs: 4, device: cuda,"),
                "stages[0].device",
            ),
            (
                yaml.replace("max_num_seqs: 4", "max_num_seqs: 4, max_model_len: 1"),
                "stages[0].max_model_len",
            ),
            // CUDA graphs are for decode steps and Qwen3-Omni's Code2Wav: another
            // generation stage has none.
            (
                yaml.replace(
                    "max_num_seqs: 2 }\n  - { stage_id: 2",
                    "max_num_seqs: 2, enforce_eager: true }\n  - { stage_id: 2",
                ),
                "stages[1].enforce_eager",
            ),
            (
                yaml.replace("m.gguf", "missing.gguf"),
                "stages[0].model.path",
            ),
            (
                yaml.replace("temperature: 0.0", "temperature: -1"),
                "stages[0].sampling.temperature",
            ),
            (
                yaml.replace("temperature: 0.0", "noise_w: 0.5"),
                "stages[0].sampling.noise_w",
            ),
            (
                yaml.replace("kind: ar", "kind: generation"),
                "stages[0].kind",
            ),
            (yaml.replace("kind: ar", "kind: dream"), "kind"),
            (
                yaml.replace("codec_chunk_frames: 25", "codec_chunk_frames: 0"),
                "connectors[1].codec_chunk_frames",
            ),
            (
                yaml.replace("min_span_chars: 10", "codec_chunk_frames: 4"),
                "connectors[0].codec_chunk_frames",
            ),
            (
                yaml.replace("{ from: 0, to: 1,", "{ from: 0, to: 2,"),
                "connectors[0].to",
            ),
            (
                yaml.replace("stage_id: 1", "stage_id: 5"),
                "stages[1].stage_id",
            ),
            (
                yaml.replace("device: cpu", "")
                    .replace("max_num_seqs: 4,", "max_num_seqs: 4, device: tpu,"),
                "stages[0].device",
            ),
            (
                yaml.replace("type: piper-talker", "type: gguf-llama")
                    .replace(
                        "kind: generation, model: { type: gguf-llama",
                        "kind: ar, model: { type: gguf-llama",
                    ),
                "stages[1].model.type",
            ),
            ("name: [".to_string(), ""),
        ];
        for (text, key) in cases {
            let e = err(&text, &path);
            assert!(e.contains(&file), "error does not name the file: {e}");
            assert!(e.contains(key), "error does not name {key:?}: {e}");
        }
        let e = Profile::load(Path::new("/nonexistent/p.yaml"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("/nonexistent/p.yaml"), "{e}");
    }
}
