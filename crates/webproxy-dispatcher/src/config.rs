//! The service's configuration as typed structs, and its validation into the form the
//! dispatcher runs on (rules compiled, pools checked).
//!
//! Top-level defaults live in `config/default.toml`, which the binary loads as figment's
//! lowest layer; only the fields of repeated items (pools, rules) have defaults in code.

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use webproxy_protocol::{Subjects, validate_pool_name};

use crate::response_rules::{ResponseRule, ResponseRuleConfig};
use crate::rules::{RequestRule, RequestRules, RuleAction};

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub nats: NatsConfig,
    pub streams: StreamsConfig,
    pub http: HttpConfig,
    pub outbound: OutboundConfig,
    pub service: ServiceConfig,
    pub log: LogConfig,
    pub telemetry: TelemetryConfig,
    #[serde(default)]
    pub pools: BTreeMap<String, PoolConfig>,
    #[serde(default)]
    pub request_rules: Vec<RequestRuleConfig>,
    /// Global response rules; first match in file order wins.
    #[serde(default)]
    pub response_rules: Vec<ResponseRuleConfig>,
}

/// The `[nats]` settings. `Debug` and `Serialize` (what `check-config` prints) show the
/// URL without its credentials and the token and password as `[REDACTED]`.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// One server URL, or several separated by commas; a URL may carry credentials
    /// (`nats://user:password@host`, `nats://token@host`).
    #[serde(serialize_with = "serialize_redacted_urls")]
    pub url: String,
    /// Authentication and TLS; see `crate::nats_auth`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub credentials_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nkey_seed_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<crate::nats_auth::Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<crate::nats_auth::Secret>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert_file: Option<std::path::PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key_file: Option<std::path::PathBuf>,
}

fn serialize_redacted_urls<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&crate::nats_auth::redact_url_credentials(url))
}

impl fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &crate::nats_auth::redact_url_credentials(&self.url))
            .field("credentials_file", &self.credentials_file)
            .field("nkey_seed_file", &self.nkey_seed_file)
            .field("token", &self.token)
            .field("user", &self.user)
            .field("password", &self.password)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .finish()
    }
}

impl NatsConfig {
    /// The server URLs, trimmed.
    pub fn urls(&self) -> Vec<String> {
        self.url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_string)
            .collect()
    }
}

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
    /// Patterns a custom `reply_to` must match; empty allows any unreserved subject.
    pub reply_to_allow: Vec<String>,
    /// The pool streams' duplicate window: a caller's publish retried with the same
    /// `Nats-Msg-Id` within it is stored once and gets the same origin.
    #[serde(with = "humantime_serde")]
    pub duplicate_window: Duration,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    pub listen: SocketAddr,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct OutboundConfig {
    pub max_response_bytes: ByteLimit,
    /// The address guard; see `crate::security`.
    pub allow_private_networks: bool,
    pub allow_cidrs: Vec<String>,
    pub deny_cidrs: Vec<String>,
    /// Request limits: larger requests get `invalid_request`.
    pub max_request_bytes: u64,
    /// Header count and size limits, for requests and responses alike.
    pub max_headers: usize,
    pub max_header_bytes: usize,
    /// Headers dropped from every request, whatever the caller sends.
    pub deny_request_headers: Vec<String>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceConfig {
    /// How long the server waits for an ack before it redelivers; attempts send
    /// progress acks every third of it.
    #[serde(with = "humantime_serde")]
    pub ack_wait: Duration,
    /// How long a stopping instance waits for its attempts in flight.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// A pool message delivered more often than this crashed or stalled an instance
    /// that many times: it is answered `internal` and dead-lettered, not attempted.
    pub max_deliver: u32,
}

/// How logs are written.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    pub format: LogFormat,
    /// A tracing filter (`info`, `webproxy=debug,info`); `RUST_LOG` overrides it.
    pub level: String,
}

/// `auto` is text on a terminal and JSON otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Auto,
    Json,
    Text,
}

/// Trace export.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    /// The OTLP/HTTP base URL (`http://collector:4318`); empty turns export off. Spans
    /// and context propagation exist either way.
    pub otlp_endpoint: String,
    pub service_name: String,
}

/// `"auto"` (derived from the server's `max_payload`) or a number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum ByteLimit {
    #[serde(serialize_with = "serialize_auto")]
    Auto,
    Bytes(u64),
}

fn serialize_auto<S: serde::Serializer>(s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str("auto")
}

impl<'de> Deserialize<'de> for ByteLimit {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct LimitVisitor;
        impl Visitor<'_> for LimitVisitor {
            type Value = ByteLimit;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("\"auto\" or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteLimit, E> {
                Ok(ByteLimit::Bytes(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteLimit, E> {
                u64::try_from(v)
                    .map(ByteLimit::Bytes)
                    .map_err(|_| E::custom("must not be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteLimit, E> {
                if v == "auto" {
                    Ok(ByteLimit::Auto)
                } else {
                    Err(E::invalid_value(de::Unexpected::Str(v), &self))
                }
            }
        }
        d.deserialize_any(LimitVisitor)
    }
}

fn default_max_in_flight() -> u64 {
    256
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The pool consumer's `max_ack_pending`: concurrent attempts across all instances.
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: u64,
    /// The most messages that may wait on the pool's request subject (and, separately,
    /// on its retry subject); absent means unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_waiting: Option<u64>,
    /// A request that waited longer than this before its first attempt is answered
    /// `expired` instead of being sent late.
    #[serde(
        default,
        with = "humantime_serde",
        skip_serializing_if = "Option::is_none"
    )]
    pub queue_timeout: Option<Duration>,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_in_flight: default_max_in_flight(),
            max_waiting: None,
            queue_timeout: None,
        }
    }
}

/// `"*"` or one HTTP method.
fn default_method() -> String {
    "*".into()
}
fn default_action() -> RuleAction {
    RuleAction::Accept
}
fn default_pool() -> String {
    "default".into()
}
fn default_timeout() -> Duration {
    Duration::from_secs(30)
}
fn default_max_retries() -> u32 {
    3
}
fn default_retry_delay() -> Duration {
    Duration::from_secs(1)
}
fn default_backoff_factor() -> f64 {
    2.0
}
fn default_max_retry_delay() -> Duration {
    Duration::from_secs(300)
}

/// `true` for `Idempotency-Key`, or a header name.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum IdempotencyHeader {
    Enabled(bool),
    Name(String),
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RequestRuleConfig {
    pub name: String,
    #[serde(default = "default_method")]
    pub method: String,
    pub url_pattern: String,
    #[serde(default = "default_action")]
    pub action: RuleAction,
    #[serde(default = "default_pool")]
    pub pool: String,
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    #[serde(default = "default_retry_delay", with = "humantime_serde")]
    pub retry_delay: Duration,
    #[serde(default = "default_backoff_factor")]
    pub backoff_factor: f64,
    #[serde(default = "default_max_retry_delay", with = "humantime_serde")]
    pub max_retry_delay: Duration,
    #[serde(default)]
    pub jitter: f64,
    #[serde(default)]
    pub retry_non_idempotent: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_header: Option<IdempotencyHeader>,
    /// Replaces the global response rules for requests this rule matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_rules: Option<Vec<ResponseRuleConfig>>,
    /// How many redirects the whole chain may follow; 0 returns the 3xx.
    #[serde(default)]
    pub follow_redirects: u32,
    /// Headers set from secrets, replacing any the caller sends.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub inject_headers: BTreeMap<String, crate::secrets::SecretSource>,
    /// The one origin (`https://host[:port]`) this rule's requests may go to, compared
    /// exactly with every hop sent under it; required with `inject_headers`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
    /// Allows an `http://` origin (a loopback or test upstream): injected credentials
    /// would travel in clear.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_http: bool,
    /// Headers dropped from this rule's requests, on top of the global list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny_request_headers: Vec<String>,
}

/// A configuration that cannot run; the message names the key.
#[derive(Debug, Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

/// The longest a JetStream request (a publish's ack, an API call, a confirmed
/// progress ack) is waited for: async-nats' 5 s, shortened to a third of `ack_wait`, so
/// that a request that times out still leaves time for another before the server
/// would redeliver the message it concerns.
pub fn jetstream_request_timeout(ack_wait: Duration) -> Duration {
    (ack_wait / 3).min(Duration::from_secs(5))
}

pub(crate) fn config_error(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        message: message.into(),
    }
}

/// A validated configuration: what `serve` runs on and `check-config` prints.
#[derive(Debug, Clone)]
pub struct Settings {
    pub config: Config,
    pub subjects: Subjects,
    pub pools: BTreeMap<String, PoolConfig>,
    pub rules: RequestRules,
    /// What may leave this instance, and how.
    pub outbound: crate::security::Outbound,
}

impl Settings {
    /// What `check-config` (and `serve`, at start) warns about: a configuration that
    /// runs, but probably not as meant. Each names the key.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = self.rules.warnings();
        let nats = &self.config.nats;
        let authenticated = nats.credentials_file.is_some()
            || nats.nkey_seed_file.is_some()
            || nats.token.is_some()
            || nats.user.is_some();
        if authenticated && self.config.streams.reply_to_allow.is_empty() {
            warnings.push(
                "streams.reply_to_allow is empty although [nats] names credentials: NATS permissions probably confine the callers, yet a request's reply_to may name any unreserved subject, another caller's or another deployment's replies included; list the callers' reply subjects, e.g. [\"callers.*.replies.>\"]".into(),
            );
        }
        warnings
    }
}

impl Config {
    /// Checks everything that can be checked without a server and compiles the rules.
    pub fn validate(self) -> Result<Settings, ConfigError> {
        let subjects = Subjects::new(&self.streams.prefix)
            .map_err(|e| config_error("streams.prefix", e.to_string()))?
            .with_reply_to_allow(&self.streams.reply_to_allow)
            .map_err(|(i, e)| {
                config_error(format!("streams.reply_to_allow[{i}]"), e.to_string())
            })?;
        if self.nats.urls().is_empty() {
            return Err(config_error("nats.url", "names no server"));
        }
        crate::nats_auth::check(&self.nats)?;
        if !(1..=5).contains(&self.streams.replicas) {
            return Err(config_error("streams.replicas", "must be from 1 to 5"));
        }
        if self.service.ack_wait < Duration::from_millis(300) {
            return Err(config_error("service.ack_wait", "must be at least 300ms"));
        }
        let request_timeout = jetstream_request_timeout(self.service.ack_wait);
        if request_timeout * 3 > self.service.ack_wait {
            return Err(config_error(
                "service.ack_wait",
                format!(
                    "must be at least three JetStream request timeouts ({request_timeout:?}), so a request that times out leaves a delivery time for a confirmed progress ack"
                ),
            ));
        }
        // A hop republished after a lost ack comes back within ack_wait; twice that
        // keeps the republish inside the window, where JetStream drops it as a duplicate.
        if self.streams.duplicate_window < self.service.ack_wait * 2 {
            return Err(config_error(
                "streams.duplicate_window",
                format!(
                    "must be at least twice [service] ack_wait ({:?}), got {:?}",
                    self.service.ack_wait, self.streams.duplicate_window
                ),
            ));
        }
        let endpoint = self.telemetry.otlp_endpoint.trim();
        let is_http = endpoint.starts_with("http://") || endpoint.starts_with("https://");
        if !endpoint.is_empty() && !is_http {
            return Err(config_error(
                "telemetry.otlp_endpoint",
                format!("{endpoint:?} is not an http or https URL"),
            ));
        }
        if self.service.max_deliver == 0 {
            return Err(config_error("service.max_deliver", "must be at least 1"));
        }
        let outbound = crate::security::Outbound::compile(&self.outbound)?;
        let mut pools = self.pools.clone();
        pools.entry("default".into()).or_default();
        for (name, pool) in &pools {
            validate_pool_name(name).map_err(|e| config_error(format!("pools.{name}"), e.0))?;
            if pool.max_in_flight == 0 || pool.max_in_flight > i64::MAX as u64 {
                return Err(config_error(
                    format!("pools.{name}.max_in_flight"),
                    "must be at least 1",
                ));
            }
            if pool.max_waiting == Some(0) {
                return Err(config_error(
                    format!("pools.{name}.max_waiting"),
                    "must be at least 1 (leave it out for unlimited)",
                ));
            }
        }
        let global_response_rules = self
            .response_rules
            .iter()
            .enumerate()
            .map(|(index, rule)| {
                ResponseRule::compile(rule).map_err(|(field, message)| {
                    config_error(format!("response_rules[{index}].{field}"), message)
                })
            })
            .collect::<Result<Arc<[_]>, _>>()?;
        let mut rules = Vec::with_capacity(self.request_rules.len());
        for (index, rule) in self.request_rules.iter().enumerate() {
            let key = |field: &str| format!("request_rules[{index}] ({}).{field}", rule.name);
            if !pools.contains_key(&rule.pool) {
                return Err(config_error(
                    key("pool"),
                    format!("unknown pool {:?}; define [pools.{}]", rule.pool, rule.pool),
                ));
            }
            rules.push(
                RequestRule::compile(rule, &global_response_rules)
                    .map_err(|(field, message)| config_error(key(&field), message))?,
            );
        }
        Ok(Settings {
            subjects,
            pools,
            rules: RequestRules::new(rules),
            outbound,
            config: self,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::Config;

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

    /// The compiled-in defaults with `extra` (TOML) laid over them, as the binary's
    /// configuration layers do.
    pub(crate) fn config_from(extra: &str) -> Config {
        let mut base: toml::Table =
            toml::from_str(include_str!("../../../config/default.toml")).expect("defaults");
        merge(&mut base, toml::from_str(extra).expect("test TOML"));
        toml::Value::Table(base).try_into().expect("a config")
    }

    #[test]
    fn the_jetstream_request_timeout_fits_ack_wait() {
        use std::time::Duration;
        assert_eq!(
            super::jetstream_request_timeout(Duration::from_secs(15)),
            Duration::from_secs(5)
        );
        assert_eq!(
            super::jetstream_request_timeout(Duration::from_secs(60)),
            Duration::from_secs(5)
        );
        assert_eq!(
            super::jetstream_request_timeout(Duration::from_secs(2)),
            Duration::from_secs(2) / 3
        );
        for ack_wait in ["300ms", "2s", "15s", "1m"] {
            let config = config_from(&format!(
                "[service]\nack_wait = \"{ack_wait}\"\n[streams]\nduplicate_window = \"10m\""
            ));
            assert!(config.validate().is_ok(), "{ack_wait}");
        }
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
    }
}
