//! The health listener. Probes read in-memory state only: a load balancer's health
//! checks must never open sessions or take pooled resources (the seed's outage).

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::net::TcpListener;
use webproxy_dispatcher::Health;

/// `GET /healthz`: the process is alive. `GET /readyz`: connected to NATS, consumers
/// provisioned, and not draining.
pub fn router(health: Arc<Health>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(|State(health): State<Arc<Health>>| async move {
                if health.is_ready() {
                    (StatusCode::OK, "ready\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                }
            }),
        )
        .with_state(health)
}

/// Serves the health endpoints on `listener` until the process ends; they must keep
/// answering (503) while the service drains.
pub fn spawn(listener: TcpListener, health: Arc<Health>) {
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router(health)).await {
            tracing::error!(error = %e, "health listener failed");
        }
    });
}
