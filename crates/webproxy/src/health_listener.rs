//! The health and metrics listener. Probes and scrapes read in-memory state only: a
//! load balancer's health checks must never open sessions or take pooled resources
//! (the seed's outage).

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::http::header::CONTENT_TYPE;
use axum::routing::get;
use tokio::net::TcpListener;
use webproxy_dispatcher::Instruments;

/// What the listener reads: in-memory state only.
pub(crate) trait Probes: Clone + Send + Sync + 'static {
    fn is_alive(&self) -> bool;
    fn is_ready(&self) -> bool;
    /// What keeps the process from being ready, one line each, for `/readyz`'s body.
    fn stuck(&self) -> Vec<String> {
        Vec::new()
    }
    fn render_metrics(&self) -> String;
}

impl Probes for Instruments {
    fn is_alive(&self) -> bool {
        Instruments::is_alive(self)
    }

    fn is_ready(&self) -> bool {
        Instruments::is_ready(self)
    }

    fn stuck(&self) -> Vec<String> {
        Instruments::stuck(self)
    }

    fn render_metrics(&self) -> String {
        Instruments::render_metrics(self)
    }
}

/// The content type of `/metrics`: what prometheus_client writes is OpenMetrics 1.0
/// (`# EOF`, `_total` counters), and a scraper told `text/plain; version=0.0.4` parses
/// it with the older format's rules.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// `GET /healthz`: the process is alive (for `serve`, every pool's pull loop runs).
/// `GET /readyz`: for `serve`, connected to NATS, consumers provisioned and present,
/// and not draining; for `gateway`, connected with its key and bucket. `GET /metrics`:
/// the OpenMetrics text format, labelled as such.
pub(crate) fn router<P: Probes>(instruments: P) -> Router {
    Router::new()
        .route(
            "/healthz",
            get(|State(instruments): State<P>| async move {
                if instruments.is_alive() {
                    (StatusCode::OK, "ok\n")
                } else {
                    (
                        StatusCode::SERVICE_UNAVAILABLE,
                        "a pool's pull loop has died\n",
                    )
                }
            }),
        )
        .route(
            "/readyz",
            get(|State(instruments): State<P>| async move {
                if instruments.is_ready() {
                    (StatusCode::OK, "ready\n".to_string())
                } else {
                    let mut body = "not ready\n".to_string();
                    for reason in instruments.stuck() {
                        body.push_str(&reason);
                        body.push('\n');
                    }
                    (StatusCode::SERVICE_UNAVAILABLE, body)
                }
            }),
        )
        .route(
            "/metrics",
            get(|State(instruments): State<P>| async move {
                ([(CONTENT_TYPE, OPENMETRICS)], instruments.render_metrics())
            }),
        )
        .with_state(instruments)
}

/// Serves the health endpoints on `listener` until the process ends; they must keep
/// answering (503) while the service drains.
pub(crate) fn spawn<P: Probes>(listener: TcpListener, instruments: P) {
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(instruments)).await {
            tracing::error!(error = %e, "health listener failed");
        }
    });
}
