//! The demo page (`web/`), compiled in with `include_str!` so the binary
//! serves it without files or a build step. Public: no API key (the page asks
//! for one and sends it over the WebSocket).

use std::sync::Arc;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::state::AppState;

const INDEX_HTML: &str = include_str!("../../../web/index.html");
const APP_JS: &str = include_str!("../../../web/app.js");
const STYLE_CSS: &str = include_str!("../../../web/style.css");

/// Scripts and styles only from this origin (no inline code), WebSockets to
/// it; `ws:`/`wss:` are listed because older browsers do not count them as 'self'.
const CSP: &str = "default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data:; \
                   object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'";

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/", get(index))
        .route("/index.html", get(index))
        .route("/app.js", get(app_js))
        .route("/style.css", get(style_css))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            // The page changes with the binary; always revalidate.
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
        .into_response()
}

async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

async fn style_css() -> Response {
    asset("text/css; charset=utf-8", STYLE_CSS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn content_type(r: &Response) -> &str {
        r.headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }

    #[tokio::test]
    async fn assets_have_their_content_types() {
        assert_eq!(content_type(&index().await), "text/html; charset=utf-8");
        assert_eq!(
            content_type(&app_js().await),
            "text/javascript; charset=utf-8"
        );
        assert_eq!(content_type(&style_css().await), "text/css; charset=utf-8");
    }

    #[test]
    fn page_references_its_assets_and_the_realtime_api() {
        assert!(INDEX_HTML.contains(r#"src="/app.js""#));
        assert!(INDEX_HTML.contains(r#"href="/style.css""#));
        // No inline script: the CSP forbids it.
        assert!(!INDEX_HTML.contains("<script>"));
        for needle in [
            "/v1/realtime",
            "openai-insecure-api-key.",
            "response.cancel",
            "response.output_audio.delta",
            "omnistreamStats",
        ] {
            assert!(APP_JS.contains(needle), "app.js lacks {needle}");
        }
    }
}
