//! The settings the dispatcher runs on: the `[streams]` settings (deployment-wide,
//! read at start), the subjects they give, and the compiled cluster part
//! ([`crate::cluster`]). The file's schema and the process part are the binary's.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use webproxy_protocol::Subjects;

use crate::config_error::element_key;
use crate::decision::human;

pub(crate) use crate::cluster::{Cluster, ClusterConfig, PoolConfig, jetstream_request_timeout};
pub(crate) use crate::config_error::ConfigError;

/// The `[streams]` settings.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct StreamsConfig {
    pub(crate) prefix: String,
    pub(crate) replicas: usize,
    #[serde(with = "humantime_serde")]
    pub(crate) reply_max_age: Duration,
    pub(crate) reply_max_bytes: i64,
    #[serde(with = "humantime_serde")]
    pub(crate) dead_max_age: Duration,
    pub(crate) dead_max_bytes: i64,
    /// Patterns a custom `reply_to` must match; empty allows any unreserved subject.
    pub reply_to_allow: Vec<String>,
    /// The pool streams' duplicate window: a caller's publish retried with the same
    /// `Nats-Msg-Id` within it is stored once and gets the same origin.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
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
    pub(crate) streams: StreamsConfig,
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

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use serde::Deserialize;

    use super::*;
    use crate::{OutboundConfig, RequestRuleConfig, ResponseRuleConfig};

    fn merge(base: &mut toml::Table, over: toml::Table) {
        for (key, value) in over {
            match (base.get_mut(&key), value) {
                (Some(toml::Value::Table(base)), toml::Value::Table(over)) => merge(base, over),
                (_, value) => {
                    base.insert(key, value);
                }
            }
        }
    }

    /// The keys of the file the dispatcher reads; the process keys are left out.
    #[derive(Deserialize)]
    struct File {
        streams: StreamsConfig,
        outbound: OutboundConfig,
        service: Service,
        #[serde(default)]
        pools: BTreeMap<String, PoolConfig>,
        #[serde(default)]
        request_rules: Vec<RequestRuleConfig>,
        #[serde(default)]
        response_rules: Vec<ResponseRuleConfig>,
    }

    #[derive(Deserialize)]
    struct Service {
        #[serde(with = "humantime_serde")]
        ack_wait: Duration,
        max_deliver: u32,
    }

    /// The compiled-in defaults with `extra` (TOML) laid over them, as the binary's
    /// configuration layers do, as the dispatcher's settings.
    pub(crate) fn settings_from(extra: &str) -> Result<Settings, ConfigError> {
        let mut base: toml::Table =
            toml::from_str(include_str!("../../../config/default.toml")).expect("defaults");
        merge(&mut base, toml::from_str(extra).expect("test TOML"));
        let file: File = toml::Value::Table(base).try_into().expect("a config");
        Settings::new(
            file.streams,
            ClusterConfig {
                outbound: file.outbound,
                pools: file.pools,
                request_rules: file.request_rules,
                response_rules: file.response_rules,
                ack_wait: file.service.ack_wait,
                max_deliver: file.service.max_deliver,
            },
        )
    }
}
