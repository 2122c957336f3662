//! Shared server state: the pipeline, sessions, metrics, settings.

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Result;
use omnistream_stages::engine::Pipeline;

use super::metrics::Metrics;
use super::sessions::{SessionLimits, SessionManager};

#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The id `/v1/models` lists (the profile name).
    pub model_name: String,
    /// Accepted API keys; empty = no key needed.
    pub api_keys: Vec<String>,
    /// Origins allowed to open browser WebSockets; empty = same origin only.
    pub allowed_origins: Vec<String>,
    pub limits: SessionLimits,
}

pub struct AppState {
    pub pipeline: Pipeline,
    pub sessions: SessionManager,
    pub metrics: Metrics,
    pub config: ServerConfig,
    pub started_unix: u64,
    /// WebRTC peers (`POST /v1/webrtc`); `None` where it could not be set up.
    pub webrtc: Option<super::webrtc::WebRtc>,
}

impl AppState {
    pub fn new(
        pipeline: Pipeline,
        config: ServerConfig,
        webrtc: Option<super::webrtc::WebRtc>,
    ) -> Result<Arc<Self>> {
        let metrics = Metrics::new()?;
        Ok(Arc::new(Self {
            sessions: SessionManager::new(config.limits.clone(), metrics.clone()),
            pipeline,
            metrics,
            config,
            started_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            webrtc,
        }))
    }
}
