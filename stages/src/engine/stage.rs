//! The interface between the engine and a model: a stage with explicit
//! per-request state and a `step`.

use std::sync::Arc;

use super::payload::Payload;
use super::request::{RequestCtx, RequestId};
use crate::models::ModelError;

/// What one step produced.
#[derive(Default)]
pub struct StepOutput {
    /// Payloads for the next stage, in order.
    pub downstream: Vec<(RequestId, Payload)>,
    /// Requests this stage is done with (their state is already freed).
    pub finished: Vec<RequestId>,
    /// Requests that failed in this step, with the error.
    pub failed: Vec<(RequestId, ModelError)>,
    /// Requests that took part in the step (the batch size).
    pub batch: usize,
}

/// A stage's model with its per-request state. The worker owns it on one thread.
///
/// Contract: `admit` is called once per request before any `push` for it;
/// `remove` frees everything the stage holds for the request (cancel or failure)
/// and must be cheap; `step` advances up to `max_num_seqs` ready requests by one
/// step and reports finished requests (whose state it has freed itself).
pub trait StageModel: Send {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<(), ModelError>;
    fn push(&mut self, id: RequestId, payload: Payload) -> Result<(), ModelError>;
    fn step(&mut self, out: &mut StepOutput);
    fn remove(&mut self, id: RequestId);
    /// Whether `step` would do anything now.
    fn has_ready_work(&self) -> bool;
    /// Requests holding state in this stage.
    fn active(&self) -> usize;
    /// Bytes held for later requests (a prefix cache's KV), not for any request now.
    fn cache_bytes(&self) -> usize {
        0
    }
    /// Called once on the worker's thread before any request: set-up that must
    /// happen on the thread that steps (capturing CUDA graphs, whose replays and
    /// cached inputs belong to that thread).
    fn start(&mut self) {}
}
