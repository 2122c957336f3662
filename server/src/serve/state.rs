//! Shared server state: the pipeline, sessions, metrics, settings.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use omnistream_stages::engine::{Pipeline, RequestSpec};

use super::metrics::Metrics;
use super::sessions::{SessionLimits, SessionManager};
use super::voice_store::{ClonedClip, CLONED_VOICE_PREFIX};
use super::voices::Voices;

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The id `/v1/models` lists (the profile name).
    pub model_name: String,
    /// Accepted API keys; empty = no key needed.
    pub api_keys: Vec<String>,
    /// Browser origins allowed besides the server's own; `*`: any.
    pub allowed_origins: Vec<String>,
    /// Host names allowed besides `localhost` and IP addresses; `*`: any.
    pub allowed_hosts: Vec<String>,
    pub limits: SessionLimits,
    /// Voice activity detection for `server_vad` turns; `None`: clients
    /// commit their turns themselves.
    pub vad: Option<VadHub>,
    /// What each stage replica runs on, for `/health` (`remote` for a stage
    /// in another process).
    pub devices: Vec<StageDevice>,
    /// `server.voice_aliases`: other names for the pipeline's voices.
    pub voice_aliases: std::collections::BTreeMap<String, String>,
    /// Where cloned voices are kept (used where the pipeline can clone).
    pub voice_store: Option<std::path::PathBuf>,
}

/// One stage replica's device, as `/health` lists it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StageDevice {
    pub stage: String,
    pub replica: usize,
    pub device: String,
}

/// The VAD model (shared by every session; each keeps its own state) and
/// the profile's knobs for the audio path.
#[derive(Clone)]
pub struct VadHub {
    pub model: std::sync::Arc<omnistream_stages::models::silero_vad::SileroVad>,
    pub min_speech_ms: u32,
    pub echo_guard_ms: u32,
}

impl std::fmt::Debug for VadHub {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VadHub")
            .field("min_speech_ms", &self.min_speech_ms)
            .field("echo_guard_ms", &self.echo_guard_ms)
            .finish_non_exhaustive()
    }
}

pub struct AppState {
    pub pipeline: Pipeline,
    pub sessions: SessionManager,
    pub metrics: Metrics,
    pub config: ServerConfig,
    pub started_unix: u64,
    /// The voice's speaking rate, for cutting interrupted answers.
    pub speech_rate: super::conversation::playback::SpeechRate,
    /// Serving, draining or closing (SIGTERM/SIGINT).
    pub shutdown: super::shutdown::Shutdown,
    /// The voices a client may name.
    pub voices: Voices,
    /// Cloned voices, where the pipeline can clone (`None`: it cannot).
    pub voice_store: Option<super::voice_store::VoiceStore>,
    /// The pipeline's voice encoders behind their batching queue, where it
    /// can clone (`None`: it cannot).
    pub clip_encoder: Option<super::clip_encoder::ClipEncoder>,
}

impl AppState {
    /// The pipeline's voice that `name` (one of its voices or an alias, any
    /// case) speaks in, or an error listing them.
    pub fn voice(&self, name: &str) -> Result<String, String> {
        self.voices.resolve(name)
    }

    /// The voice `name` names for `owner`: one of the pipeline's (or an
    /// alias), or a cloned voice of `owner`'s, kept by its id (turned into
    /// its clip by [`Self::speak_cloned`] as each answer starts).
    pub fn check_voice(&self, owner: &str, name: &str) -> Result<String, String> {
        if !name.starts_with(CLONED_VOICE_PREFIX) {
            return self.voice(name);
        }
        match &self.voice_store {
            Some(store) if store.has(owner, name) => Ok(name.to_string()),
            _ => Err(format!("no cloned voice {name:?}")),
        }
    }

    /// `owner`'s cloned voice `id`, as a request speaks it.
    pub fn cloned_voice(&self, owner: &str, id: &str) -> Option<ClonedClip> {
        let v = self.voice_store.as_ref()?.get(owner, id)?;
        Some(ClonedClip {
            seconds: v.seconds,
            embedding: v.embedding,
            reference: v.reference,
        })
    }

    /// A request whose `voice` is a cloned voice's id speaks it: its embedding
    /// (and clip) in the style, no preset voice. `Err`: no such voice of
    /// `owner`'s (deleted since it was chosen).
    pub fn speak_cloned(&self, owner: &str, spec: &mut RequestSpec) -> Result<(), String> {
        let Some(id) = spec
            .voice
            .as_deref()
            .filter(|v| v.starts_with(CLONED_VOICE_PREFIX))
        else {
            return Ok(());
        };
        let clip = self
            .cloned_voice(owner, id)
            .ok_or_else(|| format!("no cloned voice {id:?}"))?;
        spec.voice = None;
        spec.style.speaker_embedding = Some(clip.embedding);
        spec.style.reference = clip.reference;
        Ok(())
    }

    /// Resolves once no session is open and no request is in flight.
    pub async fn idle(&self) {
        while self.sessions.count() > 0 || self.sessions.in_flight() > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// The voice used when a request names none.
    pub fn default_voice(&self) -> &str {
        self.voices.default_voice()
    }

    pub fn new(pipeline: Pipeline, config: ServerConfig) -> Result<Arc<Self>> {
        let metrics = Metrics::new()?;
        let voice_store = match (&config.voice_store, pipeline.voice_encoder()) {
            (Some(dir), Some(_)) => {
                Some(super::voice_store::VoiceStore::open(dir).map_err(anyhow::Error::msg)?)
            }
            _ => None,
        };
        let voices = Voices::new(pipeline.voices().to_vec(), &config.voice_aliases)
            .map_err(anyhow::Error::msg)?;
        let clip_encoder = match pipeline.voice_encoder() {
            Some(enc) => Some(
                super::clip_encoder::ClipEncoder::start(
                    enc.clone(),
                    super::clip_encoder::EncodeMetrics {
                        parts: metrics.voice_encode_seconds.clone(),
                        batch: metrics.voice_encode_batch_clips.clone(),
                    },
                )
                .context("starting the voice encoding thread")?,
            ),
            None => None,
        };
        Ok(Arc::new(Self {
            voices,
            voice_store,
            clip_encoder,
            sessions: SessionManager::new(config.limits.clone(), metrics.clone()),
            pipeline,
            metrics,
            config,
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            speech_rate: Default::default(),
            shutdown: Default::default(),
        }))
    }
}
