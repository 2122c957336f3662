//! omnistream's engine: deploy profiles, the staged pipeline (workers joined by
//! connectors), and the models the stages run.

pub mod engine;
pub mod models;
pub mod profile;
pub mod roles;
pub mod vad;
