//! The settings the dispatcher runs on: the `[streams]` settings (deployment-wide,
//! read at start), the subjects they give, and the compiled cluster part
//! ([`crate::cluster`]). The file's schema and the process part are the binary's.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use webproxy_protocol::Subjects;

use crate::error::element_key;
use crate::human;

pub use crate::cluster::{Cluster, ClusterConfig, PoolConfig, jetstream_request_timeout};
pub use crate::error::ConfigError;

/// The `[streams]` settings.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StreamsConfig {
    pub prefix: String,
    pub replicas: usize,
    #[serde(with = "humantime_serde")]
    pub reply_max_age: Duration,
    pub reply_max_bytes: i64,
    #[serde(with = "humantime_serde")]
    pub dead_max_age: Duration,
    pub dead_max_bytes: i64,
    /// Each pool's body store budget (its Object Store stream's `max_bytes`); absent
    /// from documents older than large bodies.
    #[serde(default = "default_body_max_bytes")]
    pub body_max_bytes: i64,
    /// Each pool's upload quota (its upload store's `max_bytes`).
    #[serde(default = "default_body_max_bytes")]
    pub upload_max_bytes: i64,
    /// How long an upload no envelope has bound is kept.
    #[serde(default = "default_upload_max_age", with = "humantime_serde")]
    pub upload_max_age: Duration,
    /// Patterns a custom `reply_to` must match; empty allows any unreserved subject.
    pub reply_to_allow: Vec<String>,
    /// The pool streams' duplicate window: a caller's publish retried with the same
    /// `Nats-Msg-Id` within it is stored once and gets the same origin.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
}

/// 1 GiB, as `config/default.toml` ships it.
fn default_body_max_bytes() -> i64 {
    1 << 30
}

/// 1 h, as `config/default.toml` ships it.
fn default_upload_max_age() -> Duration {
    Duration::from_secs(3600)
}

impl StreamsConfig {
    /// Every stream's and bucket's replicas (the gateway's buckets too).
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// How long replies are kept, and so the gateway's records of its ids.
    pub fn reply_max_age(&self) -> Duration {
        self.reply_max_age
    }
}

/// What the dispatcher runs on: the streams, their subjects and the cluster part.
#[derive(Debug, Clone)]
pub struct Settings {
    pub streams: StreamsConfig,
    pub subjects: Subjects,
    /// The cluster part, compiled.
    pub cluster: Cluster,
}

impl Settings {
    /// Checks `[streams]`, compiles the cluster part and checks the two together; an
    /// error names the key. Every cluster document goes through here, the file's at
    /// start and a pushed one (`webproxy config push`) alike.
    pub fn new(streams: StreamsConfig, cluster: ClusterConfig) -> Result<Settings, ConfigError> {
        let subjects = Subjects::new(&streams.prefix)
            .map_err(|e| ConfigError::new("streams.prefix", e.to_string()))?
            .with_reply_to_allow(&streams.reply_to_allow)
            .map_err(|(i, e)| {
                ConfigError::new(
                    element_key("streams.reply_to_allow", i, None),
                    e.to_string(),
                )
            })?;
        if !(1..=5).contains(&streams.replicas) {
            return Err(ConfigError::new("streams.replicas", "must be from 1 to 5"));
        }
        let cluster = cluster.validate()?;
        // A hop republished after a lost ack comes back within ack_wait; twice that
        // keeps the republish inside the window, where JetStream drops it as a duplicate.
        if streams.duplicate_window < cluster.ack_wait * 2 {
            return Err(ConfigError::new(
                "streams.duplicate_window",
                format!(
                    "must be at least twice [service] ack_wait ({}), got {}",
                    human(cluster.ack_wait),
                    human(streams.duplicate_window)
                ),
            ));
        }
        Ok(Settings {
            subjects,
            cluster,
            streams,
        })
    }
}
