//! (being written)

use std::sync::Arc;

use axum::Router;

use super::state::AppState;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
}
