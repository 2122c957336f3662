//! Stage implementations: each binds a model to the engine in a pipeline role
//! (Listener, Thinker, Talker, Code2Wav), and `build_pipeline` assembles them from a
//! deploy profile.

mod listener;
mod llm_thinker;
mod piper_code2wav;
mod piper_talker;
mod qwen3_code2wav;
mod qwen3_talker;
mod qwen3_thinker;
mod qwen3_tts_talker;

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

use candle_core::Device;

pub use listener::{Listener, Transcriber};
pub use llm_thinker::LlmThinker;
pub use piper_code2wav::{ChunkPolicy, PiperCode2Wav};
pub use piper_talker::{PiperTalker, SpanPolicy};
pub use qwen3_code2wav::{CodecSource, Qwen3OmniCode2Wav, QWEN3_OMNI_SAMPLE_RATE};
pub use qwen3_talker::Qwen3OmniTalker;
pub use qwen3_thinker::{Qwen3OmniThinker, ThinkerLimits};
pub use qwen3_tts_talker::Qwen3TtsTalker;

use crate::engine::remote::StageMeta;
use crate::engine::{
    EncodeTimes, EncodedVoice, EngineError, Pipeline, RequestId, StageDef, StageInput, StageModel,
    StagePlacement, StageRole, StepOutput, VoiceClip, VoiceEncoder,
};
use crate::models::piper::{PiperVoice, Scales};
use crate::models::quantized_llama::QuantizedLlama;
use crate::models::qwen3_omni::layers::KvSlots;
use crate::models::qwen3_omni::omni::{Parts, Qwen3Omni};
use crate::models::qwen3_omni::weights::Progress;
use crate::models::qwen3_tts::config::{ModelType as TtsModelType, Qwen3TtsConfig};
use crate::models::qwen3_tts::model::{CloneEncoders, Qwen3Tts, Weights as TtsWeights};
use crate::models::silero_vad::SileroVad;
use crate::models::tokenizer::ChatTokenizer;
use crate::models::whisper::WhisperAsr;
use crate::models::ModelError;
use crate::profile::{
    ConnectorSpec, DeviceSpec, Dtype, ModelType, Placement, Profile, StageSpec, WeightsSource,
};
use crate::vad::{SpeechFilter, SpeechFilterConfig};

/// Name clients use for the Piper voice.
pub const PIPER_VOICE_NAME: &str = "joe";

/// Defaults for connector knobs the profile leaves out.
const DEFAULT_MIN_SPAN_CHARS: usize = 12;
const DEFAULT_MAX_SPAN_TOKENS: usize = 24;
const DEFAULT_INITIAL_FRAMES: usize = 4;
const DEFAULT_CHUNK_FRAMES: usize = 25;
const DEFAULT_MAX_PREFILL: usize = 512;
/// Qwen3-Omni: positions per request's KV slot, and padded prompt tokens prefilled
/// together in one step.
const DEFAULT_MAX_MODEL_LEN: usize = 4096;
const DEFAULT_QWEN3_PREFILL: usize = 8192;
const DEFAULT_PREFIX_CACHE_ENTRIES: usize = 16;
/// The prefix cache's KV bound: about 5,000 positions of SmolLM2-135M (46 kB each).
const DEFAULT_PREFIX_CACHE_MIB: usize = 256;

/// Up to `max` requests of `order` that are ready, in order; they move to the
/// back of the line so that every request gets its turn.
fn take_ready(
    order: &mut VecDeque<RequestId>,
    max: usize,
    is_ready: impl Fn(&RequestId) -> bool,
) -> Vec<RequestId> {
    let ready: Vec<RequestId> = order
        .iter()
        .copied()
        .filter(|id| is_ready(id))
        .take(max)
        .collect();
    order.retain(|id| !ready.contains(id));
    order.extend(ready.iter().copied());
    ready
}

/// The requests of a stage whose requests advance independently of each other:
/// their states and the round-robin order.
pub(crate) struct Requests<R> {
    reqs: HashMap<RequestId, R>,
    order: VecDeque<RequestId>,
}

impl<R> Default for Requests<R> {
    fn default() -> Self {
        Self {
            reqs: HashMap::new(),
            order: VecDeque::new(),
        }
    }
}

impl<R> Requests<R> {
    pub(crate) fn insert(&mut self, id: RequestId, r: R) {
        self.reqs.insert(id, r);
        self.order.push_back(id);
    }
    pub(crate) fn get_mut(&mut self, id: RequestId) -> Option<&mut R> {
        self.reqs.get_mut(&id)
    }
    pub(crate) fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
        self.order.retain(|x| *x != id);
    }
    pub(crate) fn len(&self) -> usize {
        self.reqs.len()
    }
    pub(crate) fn any(&self, f: impl Fn(&R) -> bool) -> bool {
        self.reqs.values().any(f)
    }
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (RequestId, &mut R)> {
        self.reqs.iter_mut().map(|(id, r)| (*id, r))
    }

    /// One step: up to `max` ready requests (round-robin) advance together:
    /// `advance` gets them all at once and returns, in order, whether each
    /// finished (`true` frees its state) or its error (which fails it).
    pub(crate) fn step(
        &mut self,
        max: usize,
        out: &mut StepOutput,
        is_ready: impl Fn(&R) -> bool,
        advance: impl FnOnce(&mut [(RequestId, R)], &mut StepOutput) -> Vec<Result<bool, ModelError>>,
    ) {
        let reqs = &self.reqs;
        let ready = take_ready(&mut self.order, max, |id| {
            reqs.get(id).is_some_and(&is_ready)
        });
        let mut batch: Vec<(RequestId, R)> = ready
            .into_iter()
            .filter_map(|id| self.reqs.remove(&id).map(|r| (id, r)))
            .collect();
        out.batch = batch.len();
        let results = advance(&mut batch, out);
        let mut results = results.into_iter();
        for (id, r) in batch {
            match results.next() {
                Some(Ok(false)) => {
                    self.reqs.insert(id, r);
                }
                Some(Ok(true)) => {
                    self.order.retain(|x| *x != id);
                    out.finished.push(id);
                }
                Some(Err(e)) => {
                    self.order.retain(|x| *x != id);
                    out.failed.push((id, e));
                }
                None => {
                    self.order.retain(|x| *x != id);
                    out.failed
                        .push((id, ModelError::Invalid("the step lost this request".into())));
                }
            }
        }
    }
}

/// Frees `id`'s KV slot in a running batch whose request `i` lives in slot `i`:
/// the last request moves into the freed slot. If that copy fails, the requests
/// from the freed slot on can no longer be trusted to read their own caches: they
/// leave the batch too and are returned, for the caller to fail.
pub(crate) fn leave_slot(
    running: &mut Vec<RequestId>,
    slots: &[KvSlots],
    id: RequestId,
) -> Vec<RequestId> {
    let Some(row) = running.iter().position(|r| *r == id) else {
        return Vec::new();
    };
    let last = running.len() - 1;
    if let Err(e) = slots.iter().try_for_each(|s| s.move_slot(last, row)) {
        tracing::error!("KV slot compaction failed: {e}");
        return running
            .split_off(row)
            .into_iter()
            .filter(|r| *r != id)
            .collect();
    }
    running.swap_remove(row);
    Vec::new()
}

/// Loads every model of `profile` and starts the pipeline.
pub fn build_pipeline(profile: &Profile) -> Result<Pipeline, EngineError> {
    build_pipeline_with_progress(profile, None)
}

/// [`build_pipeline`], reporting the bytes of large checkpoints (Qwen3-Omni's
/// shards) as they are read.
pub fn build_pipeline_with_progress(
    profile: &Profile,
    progress: Option<Progress>,
) -> Result<Pipeline, EngineError> {
    build_pipeline_placed(profile, progress, HashMap::new())
}

/// One stage replica's model, with its role and what it says about itself.
pub struct BuiltStage {
    pub role: StageRole,
    pub model: Box<dyn StageModel>,
    pub meta: StageMeta,
    /// What clones voices for this stage (a Qwen3-TTS Base Talker).
    pub voice_encoder: Option<Arc<dyn VoiceEncoder>>,
}

/// The role a model type plays.
pub fn role_of(t: ModelType) -> StageRole {
    match t {
        ModelType::WhisperCt2 => StageRole::Listener,
        ModelType::GgufLlama | ModelType::Qwen3OmniThinker => StageRole::Thinker,
        ModelType::PiperTalker | ModelType::Qwen3OmniTalker | ModelType::Qwen3TtsTalker => {
            StageRole::Talker
        }
        ModelType::PiperDecoder | ModelType::Qwen3OmniCode2wav | ModelType::Qwen3TtsCode2wav => {
            StageRole::Code2Wav
        }
    }
}

/// Models already loaded, shared by the stages (and replicas) that use them:
/// a Piper voice per file, a Qwen3-Omni checkpoint per folder and device.
#[derive(Default)]
pub struct ModelCache {
    voices: HashMap<PathBuf, Arc<PiperVoice>>,
    omni: HashMap<(PathBuf, String), Arc<Qwen3Omni>>,
    tts: HashMap<(PathBuf, String), Arc<Qwen3Tts>>,
    /// The Qwen3-Omni parts to build per checkpoint and device (all, unplanned).
    plan: HashMap<(PathBuf, String), Parts>,
}

impl ModelCache {
    /// A cache for the stage replicas `(stage index, replica)` this process
    /// builds: each Qwen3-Omni checkpoint is loaded once per device with only
    /// the parts those stages use (a Talker + Code2Wav process reads no Thinker).
    pub fn for_stages(profile: &Profile, stages: impl IntoIterator<Item = (usize, usize)>) -> Self {
        let mut cache = Self::default();
        for (i, r) in stages {
            let Some(s) = profile.stages.get(i) else {
                continue;
            };
            let Some(part) = omni_part(s.model.model_type) else {
                continue;
            };
            let key = (profile.resolve(&s.model.path), s.device_of(r).to_string());
            let e = cache.plan.entry(key).or_insert(Parts::NONE);
            *e = e.union(part);
        }
        cache
    }
}

/// The part of Qwen3-Omni a stage of this type runs.
fn omni_part(t: ModelType) -> Option<Parts> {
    let only = |f: fn(&mut Parts)| {
        let mut p = Parts::NONE;
        f(&mut p);
        Some(p)
    };
    match t {
        ModelType::Qwen3OmniThinker => only(|p| p.thinker = true),
        ModelType::Qwen3OmniTalker => only(|p| p.talker = true),
        ModelType::Qwen3OmniCode2wav => only(|p| p.code2wav = true),
        _ => None,
    }
}

/// Starts the pipeline of `profile`: its local stages' replicas loaded here,
/// its remote stages reached through `remote` (by stage index, with what their
/// replicas announced).
pub fn build_pipeline_placed(
    profile: &Profile,
    progress: Option<Progress>,
    mut remote: HashMap<usize, (Arc<dyn StageInput>, StageMeta)>,
) -> Result<Pipeline, EngineError> {
    let local = profile
        .stages
        .iter()
        .enumerate()
        .filter(|(_, s)| s.placement == Placement::Local)
        .flat_map(|(i, s)| (0..s.replicas).map(move |r| (i, r)));
    let mut cache = ModelCache::for_stages(profile, local);
    let mut defs = Vec::new();
    let mut metas = Vec::new();
    let mut voice_encoder = None;
    for (i, s) in profile.stages.iter().enumerate() {
        let placement = match s.placement {
            Placement::Remote => {
                let (input, meta) = remote.remove(&i).ok_or_else(|| EngineError::Model {
                    stage: s.name.clone(),
                    source: ModelError::Invalid(
                        "placed remote: serve this profile with --nats URL and run its replicas with `omnistream stage`".into(),
                    ),
                })?;
                metas.push(meta);
                if voice_encoder.is_none() {
                    voice_encoder = remote_voice_encoder(profile, s)?;
                }
                StagePlacement::Remote(input)
            }
            Placement::Local => {
                let mut replicas = Vec::new();
                for r in 0..s.replicas {
                    let b = build_stage(profile, i, r, &mut cache, progress.clone())?;
                    if r == 0 {
                        metas.push(b.meta);
                        voice_encoder = voice_encoder.or(b.voice_encoder);
                    }
                    replicas.push(b.model);
                }
                StagePlacement::Local {
                    replicas,
                    input_capacity: input_capacity(profile, i),
                    // `cuda` is `cuda:0`: one name a GPU, for the route's affinity.
                    devices: (0..s.replicas)
                        .map(|r| match s.device_of(r) {
                            "cuda" => "cuda:0".to_string(),
                            d => d.to_string(),
                        })
                        .collect(),
                }
            }
        };
        defs.push(StageDef {
            name: s.name.clone(),
            role: role_of(s.model.model_type),
            placement,
        });
    }
    let sample_rate = metas.iter().find_map(|m| m.sample_rate);
    let mut pipeline = Pipeline::start(defs, sample_rate)?;
    pipeline.set_voices(
        metas
            .iter()
            .find(|m| !m.voices.is_empty())
            .map(|m| m.voices.clone())
            .unwrap_or_default(),
    );
    pipeline.set_languages(
        metas
            .iter()
            .find(|m| !m.languages.is_empty())
            .map(|m| m.languages.clone())
            .unwrap_or_default(),
    );
    pipeline.set_voice_encoder(voice_encoder);
    pipeline.set_thinker_hears(metas.iter().any(|m| m.hears));
    // Piper's and Qwen3-TTS's Talkers speak given text; Qwen3-Omni's speaks its
    // Thinker's states.
    pipeline.set_speaks_text(metas.iter().any(|m| m.speaks_text));
    Ok(pipeline)
}

/// The Listener's speech filter: the VAD the server uses for its turns also keeps
/// silence and noise from the recognizer, on every path that transcribes. None
/// unless the profile's reader set [`Profile::listener_vad`].
fn speech_filter(profile: &Profile, device: &Device) -> Result<Option<SpeechFilter>, ModelError> {
    let Some(model) = &profile.listener_vad else {
        return Ok(None);
    };
    let vad = SileroVad::load(model, device)?;
    SpeechFilter::new(Arc::new(vad), SpeechFilterConfig::default()).map(Some)
}

/// Capacity of the connector into stage `i` (the profile's, or a default).
pub fn input_capacity(profile: &Profile, i: usize) -> usize {
    i.checked_sub(1)
        .and_then(|p| profile.connector(p))
        .map(|c| c.capacity)
        .unwrap_or(1024)
}

/// Loads replica `replica` of stage `i` (on its device).
pub fn build_stage(
    profile: &Profile,
    i: usize,
    replica: usize,
    cache: &mut ModelCache,
    progress: Option<Progress>,
) -> Result<BuiltStage, EngineError> {
    let device = Device::Cpu;
    let s = profile
        .stages
        .get(i)
        .ok_or_else(|| EngineError::BadRequest(format!("the profile has no stage {i}")))?;
    let model_err = |source: ModelError| EngineError::Model {
        stage: s.name.clone(),
        source,
    };
    let path = profile.resolve(&s.model.path);
    // The connector into this stage (none for the first).
    let c = i.checked_sub(1).and_then(|p| profile.connector(p));
    let voices = &mut cache.voices;
    let mut load_voice = || -> Result<Arc<PiperVoice>, EngineError> {
        if let Some(v) = voices.get(&path) {
            return Ok(v.clone());
        }
        let json = match &s.model.config {
            Some(c) => profile.resolve(c),
            None => PathBuf::from(format!("{}.json", path.display())),
        };
        let v = Arc::new(PiperVoice::load(&path, &json, &device).map_err(model_err)?);
        voices.insert(path.clone(), v.clone());
        Ok(v)
    };
    let mut meta = StageMeta::default();
    let mut voice_encoder: Option<Arc<dyn VoiceEncoder>> = None;
    let model: Box<dyn StageModel> = match s.model.model_type {
        ModelType::WhisperCt2 => {
            // The model file names its folder: config and tokenizer sit beside it.
            let dir = path.parent().unwrap_or(std::path::Path::new("."));
            let asr = WhisperAsr::load(dir, &device).map_err(model_err)?;
            let filter = speech_filter(profile, &device).map_err(model_err)?;
            Box::new(Listener::new(Arc::new(asr), filter))
        }
        ModelType::GgufLlama => {
            let (llm, tok) = QuantizedLlama::load(&path, &device).map_err(model_err)?;
            Box::new(LlmThinker::new(
                Arc::new(llm),
                Arc::new(tok),
                s.sampling.clone(),
                s.max_num_seqs,
                s.max_prefill_tokens.unwrap_or(DEFAULT_MAX_PREFILL),
                s.prefix_cache_entries
                    .unwrap_or(DEFAULT_PREFIX_CACHE_ENTRIES),
                s.prefix_cache_mib
                    .unwrap_or(DEFAULT_PREFIX_CACHE_MIB)
                    .saturating_mul(1 << 20),
            ))
        }
        ModelType::PiperTalker => {
            let voice = load_voice()?;
            let d = voice.config().default_scales.clone();
            let scales = Scales {
                noise_scale: s.sampling.noise_scale.unwrap_or(d.noise_scale),
                length_scale: s.sampling.length_scale.unwrap_or(d.length_scale),
                noise_w: s.sampling.noise_w.unwrap_or(d.noise_w),
            };
            let policy = SpanPolicy {
                async_chunk: profile.async_chunk,
                min_span_chars: c
                    .and_then(|c| c.min_span_chars)
                    .unwrap_or(DEFAULT_MIN_SPAN_CHARS),
                max_span_tokens: c
                    .and_then(|c| c.max_span_tokens)
                    .unwrap_or(DEFAULT_MAX_SPAN_TOKENS),
                initial_span_tokens: c
                    .and_then(|c| c.initial_span_tokens.or(c.max_span_tokens))
                    .unwrap_or(DEFAULT_MAX_SPAN_TOKENS),
            };
            let talker = PiperTalker::new(
                voice,
                PIPER_VOICE_NAME.to_string(),
                scales,
                s.sampling.seed,
                policy,
                s.max_num_seqs,
            )
            .map_err(model_err)?;
            meta.voices = vec![PIPER_VOICE_NAME.to_string()];
            meta.speaks_text = true;
            Box::new(talker)
        }
        ModelType::PiperDecoder => {
            let voice = load_voice()?;
            meta.sample_rate = Some(voice.sample_rate());
            Box::new(PiperCode2Wav::new(
                voice,
                chunk_policy(profile, c),
                s.max_num_seqs,
            ))
        }
        ModelType::Qwen3OmniThinker => {
            let model = load_omni(cache, &path, s, replica, progress)?;
            let tok_dir = profile.resolve(s.model.tokenizer.as_ref().unwrap_or(&s.model.path));
            let tok = ChatTokenizer::from_hf_dir(&tok_dir).map_err(model_err)?;
            meta.hears = true;
            Box::new(
                Qwen3OmniThinker::new(
                    model,
                    Arc::new(tok),
                    s.sampling.clone(),
                    ThinkerLimits {
                        max_num_seqs: s.max_num_seqs,
                        max_len: s.max_model_len.unwrap_or(DEFAULT_MAX_MODEL_LEN),
                        max_prefill_tokens: s.max_prefill_tokens.unwrap_or(DEFAULT_QWEN3_PREFILL),
                        prefill_chunk_tokens: s.prefill_chunk_tokens,
                    },
                    !s.enforce_eager,
                )
                .map_err(model_err)?,
            )
        }
        ModelType::Qwen3OmniTalker => {
            let model = load_omni(cache, &path, s, replica, progress)?;
            let names = Qwen3OmniTalker::voice_names(&model);
            let default = s
                .voice
                .clone()
                .or_else(|| names.iter().find(|n| *n == "ethan").cloned())
                .or_else(|| names.first().cloned())
                .ok_or_else(|| model_err(ModelError::Invalid("the Talker has no voices".into())))?;
            meta.voices = std::iter::once(default.clone())
                .chain(names.into_iter().filter(|n| *n != default))
                .collect();
            Box::new(
                Qwen3OmniTalker::new(
                    model,
                    s.sampling.clone(),
                    s.code_predictor_sampling.clone(),
                    default,
                    s.max_num_seqs,
                    s.max_model_len.unwrap_or(DEFAULT_MAX_MODEL_LEN),
                    !s.enforce_eager,
                )
                .map_err(model_err)?,
            )
        }
        ModelType::Qwen3OmniCode2wav => {
            let model = load_omni(cache, &path, s, replica, progress)?;
            meta.sample_rate = Some(QWEN3_OMNI_SAMPLE_RATE);
            Box::new(
                Qwen3OmniCode2Wav::new(
                    CodecSource::Omni(model),
                    chunk_policy(profile, c),
                    s.max_num_seqs,
                    !s.enforce_eager,
                )
                .map_err(model_err)?,
            )
        }
        ModelType::Qwen3TtsTalker => {
            let model = load_tts(cache, &path, s, replica, progress)?;
            let tok_dir = profile.resolve(s.model.tokenizer.as_ref().unwrap_or(&s.model.path));
            let tok = ChatTokenizer::from_hf_dir(&tok_dir).map_err(model_err)?;
            let names = Qwen3TtsTalker::voice_names(&model);
            let default = s.voice.clone().or_else(|| names.first().cloned());
            meta.voices = default
                .iter()
                .cloned()
                .chain(names.into_iter().filter(|n| Some(n) != default.as_ref()))
                .collect();
            meta.speaks_text = true;
            meta.languages = model.config().languages();
            voice_encoder = model
                .clone_encoders()
                .map(|e| Arc::new(XVectors(e.clone())) as Arc<dyn VoiceEncoder>);
            Box::new(
                Qwen3TtsTalker::new(
                    model,
                    Arc::new(tok),
                    s.sampling.clone(),
                    s.code_predictor_sampling.clone(),
                    default,
                    s.max_num_seqs,
                    s.max_model_len.unwrap_or(DEFAULT_MAX_MODEL_LEN),
                    !s.enforce_eager,
                )
                .map_err(model_err)?,
            )
        }
        ModelType::Qwen3TtsCode2wav => {
            let model = load_tts(cache, &path, s, replica, progress)?;
            meta.sample_rate = Some(model.sample_rate());
            Box::new(
                Qwen3OmniCode2Wav::new(
                    CodecSource::Tts(model),
                    chunk_policy(profile, c),
                    s.max_num_seqs,
                    !s.enforce_eager,
                )
                .map_err(model_err)?,
            )
        }
    };
    Ok(BuiltStage {
        role: role_of(s.model.model_type),
        model,
        meta,
        voice_encoder,
    })
}

/// A frame connector's chunk sizes (the profile's, or the defaults).
fn chunk_policy(profile: &Profile, c: Option<&ConnectorSpec>) -> ChunkPolicy {
    ChunkPolicy {
        async_chunk: profile.async_chunk,
        initial_frames: c
            .and_then(|c| c.initial_codec_chunk_frames)
            .unwrap_or(DEFAULT_INITIAL_FRAMES),
        chunk_frames: c
            .and_then(|c| c.codec_chunk_frames)
            .unwrap_or(DEFAULT_CHUNK_FRAMES),
        left_context_frames: c.and_then(|c| c.codec_left_context_frames).unwrap_or(0),
        ramp: c.and_then(|c| c.codec_chunk_ramp).unwrap_or(false),
    }
}

/// The device of a stage's replica (validated with the profile).
pub fn stage_device(s: &StageSpec, replica: usize) -> Result<Device, EngineError> {
    let model_err = |msg: String| EngineError::Model {
        stage: s.name.clone(),
        source: ModelError::Invalid(msg),
    };
    match crate::profile::parse_device(s.device_of(replica)).map_err(model_err)? {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(n) => {
            Device::new_cuda(n).map_err(|e| model_err(format!("cannot open CUDA device {n}: {e}")))
        }
    }
}

/// A stage's device as reports name it: `cpu`, or `cuda:N (GPU model)`.
pub fn describe_device(device: &str) -> String {
    match crate::profile::parse_device(device) {
        Ok(DeviceSpec::Cuda(n)) => match gpu_name(n) {
            Some(name) => format!("cuda:{n} ({name})"),
            None => format!("cuda:{n}"),
        },
        _ => device.to_string(),
    }
}

#[cfg(feature = "cuda")]
fn gpu_name(n: usize) -> Option<String> {
    candle_core::cuda::cudarc::driver::CudaContext::new(n)
        .ok()?
        .name()
        .ok()
}

#[cfg(not(feature = "cuda"))]
fn gpu_name(_: usize) -> Option<String> {
    None
}

/// Qwen3-TTS Base's clone encoders as the pipeline's [`VoiceEncoder`].
struct XVectors(Arc<CloneEncoders>);

impl VoiceEncoder for XVectors {
    fn sample_rate(&self) -> u32 {
        self.0.sample_rate()
    }

    fn min_samples(&self) -> usize {
        self.0.speaker().min_samples()
    }

    fn in_context(&self) -> bool {
        self.0.codec().is_some()
    }

    fn encode(
        &self,
        clips: &[VoiceClip<'_>],
    ) -> Result<(Vec<EncodedVoice>, EncodeTimes), ModelError> {
        use std::time::{Duration, Instant};
        let pcm: Vec<&[f32]> = clips.iter().map(|c| c.pcm).collect();
        let wanted: Vec<&[f32]> = clips
            .iter()
            .filter(|c| c.in_context)
            .map(|c| c.pcm)
            .collect();
        let codec = match wanted.is_empty() {
            true => None,
            false => Some(self.0.codec().ok_or_else(|| {
                ModelError::Invalid("this checkpoint's speech tokenizer has no encoder".into())
            })?),
        };
        let embed = || -> Result<(Vec<Vec<f32>>, Duration), ModelError> {
            let t = Instant::now();
            let e = self
                .0
                .speaker()
                .embed_batch(&pcm)?
                .to_dtype(candle_core::DType::F32)?
                .to_vec2::<f32>()?;
            Ok((e, t.elapsed()))
        };
        // Per in-context clip, its (frames, groups) codes.
        type Codes = Vec<Vec<Vec<u32>>>;
        let encode = || -> Result<(Codes, Duration), ModelError> {
            let Some(enc) = codec else {
                return Ok((Vec::new(), Duration::ZERO));
            };
            let t = Instant::now();
            let codes = enc
                .encode_batch(&wanted)
                .map_err(|e| ModelError::Invalid(e.to_string()))?
                .into_iter()
                .map(|c| c.to_dtype(candle_core::DType::U32)?.to_vec2::<u32>())
                .collect::<candle_core::Result<Vec<_>>>()?;
            Ok((codes, t.elapsed()))
        };
        // The Talker holds its next step back meanwhile (graphs::yield_to_encodes).
        let _section = crate::models::qwen3_omni::graphs::EncodeSection::on(self.0.device());
        // On a GPU the two encoders run at once, each from its own thread and so
        // on its own stream: both are bound by their many small launches, which
        // then overlap. (On a CPU each already takes every core.)
        let (embedded, coded) = match codec.is_some() && self.0.device().is_cuda() {
            true => std::thread::scope(|s| {
                let codes = s.spawn(encode);
                let embedded = embed();
                let coded = codes.join().unwrap_or_else(|_| {
                    Err(ModelError::Invalid("the codec encoder panicked".into()))
                });
                (embedded, coded)
            }),
            false => (embed(), encode()),
        };
        let ((embeddings, speaker), (codes, codes_time)) = (embedded?, coded?);
        let times = EncodeTimes {
            speaker,
            codes: codes_time,
        };
        let mut codes = codes.into_iter();
        let encoded = clips
            .iter()
            .zip(embeddings)
            .map(|(c, embedding)| EncodedVoice {
                embedding,
                codes: c.in_context.then(|| codes.next()).flatten(),
            })
            .collect();
        Ok((encoded, times))
    }
}

/// The clone encoders of a Qwen3-TTS Talker placed in another process: the
/// server encodes reference clips itself (on the CPU, in f32), and the clip's
/// x-vector and codes travel with each request. `None` unless the checkpoint
/// is a Base one.
fn remote_voice_encoder(
    profile: &Profile,
    s: &StageSpec,
) -> Result<Option<Arc<dyn VoiceEncoder>>, EngineError> {
    if s.model.model_type != ModelType::Qwen3TtsTalker {
        return Ok(None);
    }
    let dir = profile.resolve(&s.model.path);
    // Only a Base checkpoint clones: a server without the others' files
    // serves them as before.
    match Qwen3TtsConfig::load(&dir) {
        Ok(cfg) if cfg.tts_model_type == TtsModelType::Base => {}
        Ok(_) => return Ok(None),
        Err(e) => {
            tracing::warn!(
                "stage {}: no cloned voices here (the Talker's checkpoint is not readable: {e})",
                s.name
            );
            return Ok(None);
        }
    }
    let encoders = CloneEncoders::load(&dir, candle_core::DType::F32, &Device::Cpu, tts_weights(s))
        .map_err(|source| EngineError::Model {
            stage: s.name.clone(),
            source,
        })?;
    Ok(encoders.map(|e| Arc::new(XVectors(Arc::new(e))) as Arc<dyn VoiceEncoder>))
}

fn tts_weights(s: &StageSpec) -> TtsWeights {
    match s.model.weights {
        WeightsSource::Checkpoint => TtsWeights::Checkpoint,
        WeightsSource::Random => TtsWeights::Random,
    }
}

/// A Qwen3-TTS checkpoint, loaded once per folder and device for its stages.
fn load_tts(
    cache: &mut ModelCache,
    path: &std::path::Path,
    s: &StageSpec,
    replica: usize,
    progress: Option<Progress>,
) -> Result<Arc<Qwen3Tts>, EngineError> {
    let key = (path.to_path_buf(), s.device_of(replica).to_string());
    if let Some(m) = cache.tts.get(&key) {
        return Ok(m.clone());
    }
    let dtype = match s.model.dtype {
        Dtype::F32 => candle_core::DType::F32,
        Dtype::Bf16 => candle_core::DType::BF16,
    };
    let device = stage_device(s, replica)?;
    let model =
        Qwen3Tts::load(path, dtype, &device, tts_weights(s), progress).map_err(|source| {
            EngineError::Model {
                stage: s.name.clone(),
                source,
            }
        })?;
    let model = Arc::new(model);
    cache.tts.insert(key, model.clone());
    Ok(model)
}

/// The Qwen3-Omni checkpoint at `path`, loaded once per device for all its
/// stages and replicas there, with the parts the cache's plan names.
fn load_omni(
    cache: &mut ModelCache,
    path: &std::path::Path,
    s: &StageSpec,
    replica: usize,
    progress: Option<Progress>,
) -> Result<Arc<Qwen3Omni>, EngineError> {
    let key = (path.to_path_buf(), s.device_of(replica).to_string());
    let need = omni_part(s.model.model_type).unwrap_or(Parts::ALL);
    if let Some(m) = cache.omni.get(&key) {
        if m.parts().union(need) == m.parts() {
            return Ok(m.clone());
        }
    }
    let parts = cache
        .plan
        .get(&key)
        .copied()
        .unwrap_or(Parts::ALL)
        .union(need);
    let model_err = |source: ModelError| EngineError::Model {
        stage: s.name.clone(),
        source,
    };
    let dtype = match s.model.dtype {
        Dtype::F32 => candle_core::DType::F32,
        Dtype::Bf16 => candle_core::DType::BF16,
    };
    let device = stage_device(s, replica)?;
    let model = match s.model.weights {
        WeightsSource::Checkpoint => Qwen3Omni::load_parts(path, dtype, &device, progress, parts),
        WeightsSource::Random => {
            crate::models::qwen3_omni::omni::Qwen3OmniConfig::from_file(&path.join("config.json"))
                .and_then(|cfg| Qwen3Omni::random_parts(&cfg, dtype, &device, parts))
        }
    }
    .map_err(model_err)?;
    let model = Arc::new(model);
    cache.omni.insert(key, model.clone());
    Ok(model)
}

#[cfg(test)]
mod slot_tests {
    use super::*;
    use crate::models::qwen3_omni::layers::{KvCache, SlotBatch};
    use candle_core::{DType, Tensor};

    /// A request leaving the running batch: the last one moves into its slot,
    /// caches and order together.
    #[test]
    fn leaving_moves_the_last_request_into_the_freed_slot() {
        let slots = KvSlots::new(4, 1, 2, 1, DType::F32, &Device::Cpu).unwrap();
        for s in 0..3 {
            let mut c = KvCache::new();
            let k = Tensor::full(s as f32 + 1.0, (1, 1, 2, 1), &Device::Cpu).unwrap();
            c.append(&k, &k).unwrap();
            slots.load(s, &c, 0, 0).unwrap();
        }
        let mut running = vec![10, 11, 12];
        let lost = leave_slot(&mut running, std::slice::from_ref(&slots), 11);
        assert!(lost.is_empty());
        assert_eq!(running, vec![10, 12]);
        let batch = SlotBatch::new(&slots, &[0, 1], &[1, 1]).unwrap();
        let k = Tensor::zeros((2, 1, 1, 1), DType::F32, &Device::Cpu).unwrap();
        // Appending writes position 1; position 0 still holds what each request loaded.
        let (all, _) = slots.append(&batch, &k, &k).unwrap();
        let v: Vec<f32> = all.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(v, vec![1.0, 0.0, 3.0, 0.0]);
        assert!(leave_slot(&mut running, &[], 99).is_empty());
    }
}

#[cfg(test)]
mod cache_tests {
    use super::*;

    /// A stage process running the Talker and Code2Wav of a split profile loads
    /// the checkpoint once, without its Thinker; the in-process pipeline loads
    /// it whole.
    #[test]
    fn stage_processes_load_only_their_parts_once() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let split = Profile::load(&root.join("deploy/distributed/qwen3-omni-tiny.yaml")).unwrap();
        let mut cache = ModelCache::for_stages(&split, [(1, 0), (2, 0)]);
        for i in [1, 2] {
            build_stage(&split, i, 0, &mut cache, None).unwrap();
        }
        assert_eq!(
            cache.omni.len(),
            1,
            "one checkpoint, one device: loaded once"
        );
        let m = cache.omni.values().next().unwrap();
        assert_eq!(
            m.parts(),
            Parts {
                thinker: false,
                ..Parts::ALL
            }
        );
        let whole = Profile::load(&root.join("deploy/qwen3-omni-tiny.yaml")).unwrap();
        let cache = ModelCache::for_stages(&whole, [(0, 0), (1, 0), (2, 0)]);
        assert_eq!(
            cache.plan.values().copied().collect::<Vec<_>>(),
            [Parts::ALL]
        );
    }
}

#[cfg(test)]
mod listener_tests {
    use super::*;

    /// The Listener filters with the VAD its profile's reader names, and
    /// without one there is no filter.
    #[test]
    fn the_listener_filters_with_the_vad_it_is_given() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let model = root.join("models/silero-vad/silero_vad_16k.safetensors");
        if !model.is_file() {
            // No `omnistream fetch-models`: nothing to load.
            eprintln!("SKIP: {} is missing", model.display());
            return;
        }
        let mut p = Profile::load(&root.join("deploy/tiny-cpu.yaml")).unwrap();
        p.listener_vad = Some(model);
        let f = speech_filter(&p, &Device::Cpu).unwrap().expect("a filter");
        assert_eq!(f.config(), &SpeechFilterConfig::default());
        p.listener_vad = None;
        assert!(speech_filter(&p, &Device::Cpu).unwrap().is_none());
    }
}

/// A tool call the model wrote that cannot be read fails its request, with
/// the message the server maps to `invalid_tool_call`.
pub(crate) fn invalid_call(e: crate::engine::tools::InvalidToolCall) -> ModelError {
    ModelError::Invalid(e.to_string())
}
