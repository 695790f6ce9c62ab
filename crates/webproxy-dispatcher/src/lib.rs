//! Consumes webproxy's work streams: provisions streams and consumers, matches request
//! rules, decides what happens to each message, performs attempts through the worker,
//! publishes replies and dead letters, and acks.
//!
//! Decisions (`rules`, `decision`, `outbox`) are pure; effects live in `runtime` and
//! `provision`.

pub mod backoff;
pub mod cluster;
pub mod config;
pub mod config_error;
pub mod decision;
pub mod egress;
pub mod gauges;
pub mod health;
pub mod hop;
pub mod metrics;
pub mod outbox;
pub mod plan;
pub mod provision;
pub mod response_rules;
pub mod retry;
pub mod rules;
pub mod runtime;
pub mod secret_source;
pub mod secrets;
pub mod security;
pub mod trace;

pub use config::{ConfigError, Settings};
pub use gauges::Gauges;
pub use health::Health;
pub use ipnet;
pub use metrics::Metrics;

use std::sync::Arc;

/// The service's observable state, shared by the dispatcher (which updates it) and the
/// health listener (which reads it without any I/O).
#[derive(Debug, Clone)]
pub struct Instruments {
    pub health: Arc<Health>,
    pub metrics: Arc<Metrics>,
    pub gauges: Arc<Gauges>,
}

impl Instruments {
    pub fn new(settings: &Settings) -> Instruments {
        Instruments {
            health: Arc::new(Health::new()),
            metrics: Arc::new(Metrics::new(env!("CARGO_PKG_VERSION"))),
            gauges: Arc::new(Gauges::new(settings.cluster.pools.keys())),
        }
    }

    /// The Prometheus exposition.
    pub fn render_metrics(&self) -> String {
        self.metrics.render(&self.gauges, &self.health)
    }
}
pub use runtime::{Dispatcher, connect};
