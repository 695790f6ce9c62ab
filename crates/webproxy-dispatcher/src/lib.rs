//! Consumes webproxy's work streams: provisions streams and consumers, matches request
//! rules, decides what happens to each message, performs attempts through the worker,
//! publishes replies and dead letters, and acks. It runs on the settings
//! `webproxy-config` checks and compiles.
//!
//! One folder per concept (ARCHITECTURE.md's code map): `conversation` (the path one
//! message takes), `pool` (pool control), `consuming` (pulling into that path)
//! and `observability`; what it keeps in JetStream is `webproxy-jetstream`'s.

#![warn(unreachable_pub)]

mod body_get;
mod body_put;
mod cancel;
mod consuming;
mod conversation;
mod core_requests;
mod hooks;
mod observability;
mod pool;

// The public surface: what the binary uses, and nothing else. Every other item is `pub(crate)` or private (`unreachable_pub` says so).
pub use consuming::{Dispatcher, StartError, check_server, connect};
pub use conversation::ending::Settled;
pub use conversation::operator::Operator;
pub use conversation::pacing::AckWaitPacing;
pub use conversation::replay::{Replay, ReplayError};
pub use hooks::test_hook;
pub use pool::pauses::PoolPauses;

pub use observability::bucket_use::{BucketUseSink, follow_bucket_use};
pub use observability::trace::request_ids;

use observability::gauges::Gauges;
use observability::health::Health;
use observability::metrics::Metrics;
use std::sync::Arc;

/// The service's observable state, shared by the dispatcher (which updates it) and the
/// health listener (which reads it without any I/O).
#[derive(Debug, Clone)]
pub struct Instruments {
    pub(crate) health: Arc<Health>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) gauges: Arc<Gauges>,
}

impl Default for Instruments {
    fn default() -> Self {
        Instruments::new()
    }
}

impl Instruments {
    /// Health, metrics and gauges with nothing recorded; the dispatcher adds its pools'
    /// gauges when it starts.
    pub fn new() -> Instruments {
        Instruments {
            health: Arc::new(Health::new()),
            metrics: Arc::new(Metrics::new(env!("CARGO_PKG_VERSION"))),
            gauges: Arc::new(Gauges::default()),
        }
    }

    /// `/healthz`: every pool's pull loop runs.
    pub fn is_alive(&self) -> bool {
        self.health.is_alive()
    }

    /// `/readyz`: connected to NATS, consumers provisioned and present, not draining.
    pub fn is_ready(&self) -> bool {
        self.health.is_ready()
    }

    /// Why a pool cannot make progress, one line each (`/readyz` prints them).
    pub fn stuck(&self) -> Vec<String> {
        self.health.stuck()
    }

    /// The instance runs revision `revision` of the configuration bucket's document
    /// (`webproxy_config_revision`).
    pub fn set_config_revision(&self, revision: u64) {
        self.metrics.set_config_revision(revision);
    }

    /// The revision of the configuration bucket's document this instance runs; 0
    /// when its cluster part is the file's.
    pub fn config_revision(&self) -> u64 {
        self.metrics.config_revision()
    }

    /// A revision of the document was refused (`webproxy_config_refused_total`); the
    /// caller has logged why.
    pub fn count_config_refused(&self) {
        self.metrics.config_refused();
    }

    /// The Prometheus exposition.
    pub fn render_metrics(&self) -> String {
        self.metrics.render(&self.gauges, &self.health)
    }
}
