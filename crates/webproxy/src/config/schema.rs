//! The configuration file's schema, parsed once (unknown keys rejected) and split in
//! two: the process part (`[nats]`, `[streams]`, `[http]`, `[log]`, `[telemetry]`,
//! `[service] shutdown_grace` and `secret_poll_interval`, and `[gateway]` for `webproxy gateway`), which is this process's, and the cluster part
//! ([`webproxy_config::ClusterConfig`]), which the dispatcher takes whole.
//! The checks across the two parts are here.
//!
//! Top-level defaults live in `config/default.toml`, which `cfg` loads as figment's
//! lowest layer; only the fields of repeated items (pools, rules) have defaults in code.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use webproxy_config::{
    ClusterConfig, ConfigError, OutboundConfig, PoolConfig, RequestRuleConfig, ResponseRuleConfig,
    StreamsConfig,
};

use crate::config::nats_auth::NatsConfig;

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Config {
    pub(crate) nats: NatsConfig,
    pub(crate) streams: StreamsConfig,
    pub(crate) http: HttpConfig,
    pub(crate) gateway: crate::config::gateway::GatewayConfig,
    pub(crate) outbound: OutboundConfig,
    pub(crate) service: ServiceConfig,
    pub(crate) log: LogConfig,
    pub(crate) telemetry: TelemetryConfig,
    pub(crate) config: SourceConfig,
    #[serde(default)]
    pub(crate) pools: BTreeMap<String, PoolConfig>,
    #[serde(default)]
    pub(crate) request_rules: Vec<RequestRuleConfig>,
    /// Global response rules; first match in file order wins.
    #[serde(default)]
    pub(crate) response_rules: Vec<ResponseRuleConfig>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct HttpConfig {
    pub(crate) listen: SocketAddr,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServiceConfig {
    /// How long the server waits for an ack before it redelivers; attempts send
    /// progress acks every third of it.
    #[serde(with = "humantime_serde")]
    pub(crate) ack_wait: Duration,
    /// How long a stopping instance waits for its attempts in flight.
    #[serde(with = "humantime_serde")]
    pub(crate) shutdown_grace: Duration,
    /// How often the secret files this process reads (injected headers, gateway
    /// tokens) are read again and compared with the values in force; zero: on SIGHUP
    /// only. This process's, like `shutdown_grace`.
    #[serde(with = "humantime_serde")]
    pub(crate) secret_poll_interval: Duration,
    /// A pool message delivered more often than this crashed or stalled an instance
    /// that many times: it is answered `internal` and dead-lettered, not attempted.
    pub(crate) max_deliver: u32,
}

/// `[config]`: where the cluster part comes from.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SourceConfig {
    pub(crate) source: ClusterSource,
}

/// `file`: the cluster sections of this configuration. `kv`: the bucket
/// `<PREFIX>_CONFIG`, seeded from this configuration when it is empty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum ClusterSource {
    File,
    Kv,
}

/// How logs are written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LogConfig {
    pub(crate) format: LogFormat,
    /// A tracing filter (`info`, `webproxy=debug,info`); `RUST_LOG` overrides it.
    pub(crate) level: String,
}

/// `auto` is text on a terminal and JSON otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum LogFormat {
    Auto,
    Json,
    Text,
}

/// Trace export.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TelemetryConfig {
    /// The OTLP base URL (`http://collector:4318`, or `:4317` with gRPC); empty leaves
    /// export to the `OTEL_EXPORTER_OTLP_*` environment, which wins over it. Spans and
    /// context propagation exist either way.
    pub(crate) otlp_endpoint: String,
    pub(crate) service_name: String,
}

/// A validated configuration: what `serve` runs on and `check-config` prints.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) config: Config,
    /// The streams and the compiled cluster part, which the dispatcher runs on.
    pub(crate) dispatcher: std::sync::Arc<webproxy_config::Settings>,
    /// `[gateway]`, checked: what `webproxy gateway` serves.
    pub(crate) gateway: crate::config::gateway::Gateway,
    /// `WEBPROXY_` variables that are not configuration and were ignored, each named.
    pub(crate) environment_warnings: Vec<String>,
    /// The cluster sections and variables the `--config` file and the environment
    /// set, which `source = "kv"` ignores once the bucket holds a document.
    pub(crate) cluster_keys_set: Vec<String>,
}

impl Settings {
    /// These settings with a cluster document (parsed and validated by `document`) in
    /// place of the file's cluster part.
    pub(crate) fn with_document(
        mut self,
        document: ClusterDocument,
        dispatcher: webproxy_config::Settings,
    ) -> Settings {
        let config = &mut self.config;
        config.outbound = document.outbound;
        config.service.ack_wait = document.service.ack_wait;
        config.service.max_deliver = document.service.max_deliver;
        config.pools = document.pools;
        config.request_rules = document.request_rules;
        config.response_rules = document.response_rules;
        self.dispatcher = std::sync::Arc::new(dispatcher);
        self
    }

    /// What `check-config` (and `serve`, at start) warns about: a configuration that
    /// runs, but probably not as meant. Each names the key.
    pub(crate) fn warnings(&self) -> Vec<String> {
        let mut warnings = self.environment_warnings.clone();
        warnings.extend(self.dispatcher.cluster.warnings());
        let nats = &self.config.nats;
        let authenticated = nats.credentials_file.is_some()
            || nats.nkey_seed_file.is_some()
            || nats.token.is_some()
            || nats.user.is_some();
        // Empty allows only `_INBOX.` subjects, whose random names no caller guesses
        // and no stream captures; any other wildcard pattern that names no caller is
        // every caller's space at once.
        if authenticated {
            for (i, pattern) in self.config.streams.reply_to_allow.iter().enumerate() {
                let shared = !pattern.contains(webproxy_protocol::CALLER_PLACEHOLDER)
                    && !pattern.starts_with("_INBOX.")
                    && pattern.split('.').any(|token| token == "*" || token == ">");
                if shared {
                    warnings.push(format!(
                        "streams.reply_to_allow[{i}] = {pattern:?} names no {{caller}} although [nats] names credentials: NATS permissions probably confine the callers, yet any caller may name any subject it matches as its reply_to, another caller's included; write the caller's own token as {{caller}}, e.g. \"callers.{{caller}}.replies.>\", and let each caller publish only on <prefix>.request.*.<its name>"
                    ));
                }
            }
        }
        // Both are for a caller's connection (`send`, the operator commands): `serve`
        // keeps to its own account's JetStream, and a custom inbox gives up the
        // private one no caller's reply_to may name.
        if nats.inbox_prefix.is_some() {
            warnings.push("nats.inbox_prefix is set: `serve` and `gateway` then take their inboxes under it instead of their private _WEBPROXY_INBOX.<random>, which no caller's reply_to may name; set it for `send` and the operator commands only".to_string());
        }
        if nats.js_api_prefix.is_some() {
            warnings.push("nats.js_api_prefix is set: `send` and the operator commands use it, `serve` and `gateway` do not (they use their own account's $JS.API)".to_string());
        }
        warnings
    }
}

impl Config {
    /// The cluster part of the file, as the document a bucket would hold.
    pub(crate) fn document(&self) -> ClusterDocument {
        ClusterDocument {
            outbound: self.outbound.clone(),
            service: ClusterService {
                ack_wait: self.service.ack_wait,
                max_deliver: self.service.max_deliver,
            },
            pools: self.pools.clone(),
            request_rules: self.request_rules.clone(),
            response_rules: self.response_rules.clone(),
        }
    }

    /// The cluster part of the file: the document the dispatcher takes whole.
    pub(crate) fn cluster(&self) -> ClusterConfig {
        self.document().into()
    }

    /// Checks everything that can be checked without a server and compiles the rules.
    pub(crate) fn validate(self) -> Result<Settings, ConfigError> {
        if self.nats.urls().is_empty() {
            return Err(ConfigError::new("nats.url", "names no server"));
        }
        crate::config::nats_auth::check(&self.nats)?;
        let gateway = self.gateway.check()?;
        let dispatcher = webproxy_config::Settings::new(self.streams.clone(), self.cluster())?;
        let endpoint = self.telemetry.otlp_endpoint.trim();
        let is_http = endpoint.starts_with("http://") || endpoint.starts_with("https://");
        if !endpoint.is_empty() && !is_http {
            return Err(ConfigError::new(
                "telemetry.otlp_endpoint",
                format!("{endpoint:?} is not an http or https URL"),
            ));
        }
        Ok(Settings {
            config: self,
            dispatcher: std::sync::Arc::new(dispatcher),
            gateway,
            environment_warnings: Vec::new(),
            cluster_keys_set: Vec::new(),
        })
    }
}

/// The cluster part, with the file's shape.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClusterDocument {
    pub(crate) outbound: OutboundConfig,
    pub(crate) service: ClusterService,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) pools: BTreeMap<String, PoolConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) request_rules: Vec<RequestRuleConfig>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) response_rules: Vec<ResponseRuleConfig>,
}

/// The document's `[service]`: the consumer timings. `shutdown_grace` and
/// `secret_poll_interval` are the process's and have no place here.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClusterService {
    #[serde(with = "humantime_serde")]
    pub(crate) ack_wait: Duration,
    pub(crate) max_deliver: u32,
}

impl From<ClusterDocument> for ClusterConfig {
    fn from(document: ClusterDocument) -> ClusterConfig {
        ClusterConfig {
            outbound: document.outbound,
            pools: document.pools,
            request_rules: document.request_rules,
            response_rules: document.response_rules,
            ack_wait: document.service.ack_wait,
            max_deliver: document.service.max_deliver,
        }
    }
}

/// The sections and keys a document holds: how the start-up warning names each, and
/// its key path in the configuration (`kv` mode ignores the file's and the
/// environment's values under these paths).
pub(crate) const SECTIONS: [(&str, &str); 6] = [
    ("[outbound]", "outbound"),
    ("[service] ack_wait", "service.ack_wait"),
    ("[service] max_deliver", "service.max_deliver"),
    ("[pools.*]", "pools"),
    ("[[request_rules]]", "request_rules"),
    ("[[response_rules]]", "response_rules"),
];

#[cfg(test)]
mod tests {
    use figment::Figment;
    use figment::providers::{Format as _, Toml};

    use super::Config;

    /// The compiled-in defaults with `extra` (TOML) laid over them, as the
    /// configuration layers do.
    fn config_from(extra: &str) -> Config {
        Figment::from(Toml::string(crate::config::load::DEFAULT_CONFIG))
            .merge(Toml::string(extra))
            .extract()
            .expect("a config")
    }

    #[test]
    fn a_duplicate_window_under_twice_ack_wait_is_refused() {
        let error = config_from("[streams]\nduplicate_window = \"20s\"")
            .validate()
            .expect_err("20s < 2 x 15s");
        assert!(
            error.to_string().contains("streams.duplicate_window"),
            "{error}"
        );
        assert!(
            config_from("[streams]\nduplicate_window = \"30s\"")
                .validate()
                .is_ok()
        );
        for ack_wait in ["300ms", "2s", "15s", "1m"] {
            let config = config_from(&format!(
                "[service]\nack_wait = \"{ack_wait}\"\n[streams]\nduplicate_window = \"10m\""
            ));
            assert!(config.validate().is_ok(), "{ack_wait}");
        }
    }
}
