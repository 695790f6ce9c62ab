//! The cluster's part of the configuration: request and response rules, pools, the
//! outbound policy and the consumer timings (`[service] ack_wait`, `max_deliver`). One
//! typed document ([`ClusterConfig`]) that the dispatcher takes whole and compiles
//! whole ([`ClusterConfig::validate`] into a [`Cluster`]); it keeps the file's keys,
//! which error messages name. The process part (`[nats]`, `[streams]`, `[http]`,
//! `[log]`, `[telemetry]`, `[service] shutdown_grace`) is the binary's.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use webproxy_protocol::validate_pool_name;

use crate::breaker::BreakerConfig;
use crate::error::{ConfigError, element_key};
use crate::rate::Rate;
use crate::response_rules::{ResponseRule, ResponseRuleConfig};
use crate::rules::{RequestRule, RequestRuleConfig, RequestRules, RuleAction};
use crate::security::{Outbound, OutboundConfig, suggested_origin};

/// The cluster part, as the file gives it.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub outbound: OutboundConfig,
    pub pools: BTreeMap<String, PoolConfig>,
    pub request_rules: Vec<RequestRuleConfig>,
    /// Global response rules; first match in file order wins.
    pub response_rules: Vec<ResponseRuleConfig>,
    /// `[service] ack_wait`.
    pub ack_wait: Duration,
    /// `[service] max_deliver`.
    pub max_deliver: u32,
}

/// The cluster part, validated and compiled: what the dispatcher runs on.
#[derive(Debug, Clone)]
pub struct Cluster {
    /// Every pool, `default` included.
    pub pools: BTreeMap<String, PoolConfig>,
    pub rules: RequestRules,
    /// What may leave this instance, and how.
    pub outbound: Outbound,
    pub ack_wait: Duration,
    pub max_deliver: u32,
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
    /// Attempts per second (or minute, or hour) across all instances; absent means
    /// unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<Rate>,
    /// Attempts an idle pool may make at once under `rate`.
    #[serde(default = "default_burst")]
    pub burst: u32,
    /// `[pools.NAME.breaker]`: the circuit breaker, off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker: Option<BreakerConfig>,
    /// Whether the limit adapts, between `min_in_flight` and `max_in_flight`, to the
    /// upstream's latency and failures.
    #[serde(default)]
    pub adaptive: bool,
    /// The lowest the adaptive limit goes.
    #[serde(default = "default_min_in_flight")]
    pub min_in_flight: u64,
}

fn default_min_in_flight() -> u64 {
    1
}

fn default_burst() -> u32 {
    1
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            max_in_flight: default_max_in_flight(),
            max_waiting: None,
            queue_timeout: None,
            rate: None,
            burst: default_burst(),
            breaker: None,
            adaptive: false,
            min_in_flight: default_min_in_flight(),
        }
    }
}

/// The longest a JetStream request (a publish's ack, an API call, a confirmed
/// progress ack) is waited for: async-nats' 5 s, shortened to a third of `ack_wait`, so
/// that a request that times out still leaves time for another before the server
/// would redeliver the message it concerns.
pub fn jetstream_request_timeout(ack_wait: Duration) -> Duration {
    (ack_wait / 3).min(Duration::from_secs(5))
}

impl ClusterConfig {
    /// Checks the cluster part and compiles its rules; an error names the file's key.
    pub fn validate(self) -> Result<Cluster, ConfigError> {
        if self.ack_wait < Duration::from_millis(300) {
            return Err(ConfigError::new(
                "service.ack_wait",
                "must be at least 300ms",
            ));
        }
        if self.max_deliver == 0 {
            return Err(ConfigError::new(
                "service.max_deliver",
                "must be at least 1",
            ));
        }
        let outbound = Outbound::compile(&self.outbound)?;
        let mut pools = self.pools.clone();
        pools.entry("default".into()).or_default();
        for (name, pool) in &mut pools {
            validate_pool_name(name).map_err(|e| ConfigError::new(format!("pools.{name}"), e.0))?;
            if pool.max_in_flight == 0 || pool.max_in_flight > i64::MAX as u64 {
                return Err(ConfigError::new(
                    format!("pools.{name}.max_in_flight"),
                    "must be at least 1",
                ));
            }
            if pool.burst == 0 {
                return Err(ConfigError::new(
                    format!("pools.{name}.burst"),
                    "must be at least 1",
                ));
            }
            if pool.max_waiting == Some(0) {
                return Err(ConfigError::new(
                    format!("pools.{name}.max_waiting"),
                    "must be at least 1 (leave it out for unlimited)",
                ));
            }
            if pool.min_in_flight == 0 || pool.min_in_flight > pool.max_in_flight {
                return Err(ConfigError::new(
                    format!("pools.{name}.min_in_flight"),
                    "must be at least 1 and at most max_in_flight",
                ));
            }
            if let Some(breaker) = &mut pool.breaker {
                breaker.compile().map_err(|(field, message)| {
                    ConfigError::new(format!("pools.{name}.breaker.{field}"), message)
                })?;
            }
        }
        let global_response_rules = self
            .response_rules
            .iter()
            .enumerate()
            .map(|(index, rule)| {
                ResponseRule::compile(rule).map_err(|(field, message)| {
                    ConfigError::new(
                        format!("{}.{field}", element_key("response_rules", index, None)),
                        message,
                    )
                })
            })
            .collect::<Result<Arc<[_]>, _>>()?;
        let mut rules = Vec::with_capacity(self.request_rules.len());
        for (index, rule) in self.request_rules.iter().enumerate() {
            let rule_key = element_key("request_rules", index, Some(&rule.name));
            let key = |field: &str| format!("{rule_key}.{field}");
            if !pools.contains_key(&rule.pool) {
                return Err(ConfigError::new(
                    key("pool"),
                    format!("unknown pool {:?}; define [pools.{}]", rule.pool, rule.pool),
                ));
            }
            rules.push(
                RequestRule::compile(rule, &global_response_rules)
                    .map_err(|(field, message)| ConfigError::new(key(&field), message))?,
            );
        }
        Ok(Cluster {
            pools,
            rules: RequestRules::new(rules),
            outbound,
            ack_wait: self.ack_wait,
            max_deliver: self.max_deliver,
        })
    }
}

impl Cluster {
    /// What `check-config` (and `serve`, at start) warns about in the cluster part: the
    /// rules' warnings, and a pool whose breaker or adaptive limit none of its rules can
    /// ever move. Each names the key.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = self.rules.warnings();
        warnings.extend(self.pools.iter().filter_map(|(name, pool)| {
            unjudged_pool(name, pool, self.rules.iter().filter(|r| r.pool == *name))
        }));
        warnings
    }
}

/// The warning for pool `name` when it has a breaker or an adaptive limit but none of
/// its accepting `rules` names an origin: only attempts under such a rule feed them
/// (the dispatcher's `pool::breaker::evidence`), so they would never move.
fn unjudged_pool<'a>(
    name: &str,
    pool: &PoolConfig,
    rules: impl Iterator<Item = &'a RequestRule>,
) -> Option<String> {
    let what = match (pool.breaker.is_some(), pool.adaptive) {
        (true, true) => "its breaker and adaptive limit",
        (true, false) => "its breaker",
        (false, true) => "its adaptive limit",
        (false, false) => return None,
    };
    let mut accepting = rules.filter(|r| r.action == RuleAction::Accept).peekable();
    let first = accepting.peek().map(|r| r.pattern.as_str().to_string());
    if accepting.any(|r| r.security.origin.is_some()) {
        return None;
    }
    let example = first
        .as_deref()
        .and_then(suggested_origin)
        .unwrap_or_else(|| "https://api.partner.com".to_string());
    Some(format!(
        "pools.{name}: {what} will never move: only attempts under a rule that names its origin are counted, and no rule sending to this pool names one (a rule without an origin may reach hosts its callers choose, whose failures are not the upstream's); add origin = \"{example}\" (with allow_http = true for http) to the rules of its upstream"
    ))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::jetstream_request_timeout;

    /// Issue 29, point 7: a pool with a breaker or `adaptive = true` and no rule with
    /// an origin is warned about, naming the pool and what never moves; one rule with an
    /// origin, or neither feature, silences it. Deny rules send nothing and do not count.
    #[test]
    fn a_judged_pool_without_a_rule_naming_an_origin_is_warned_about() {
        let warnings = |pool: &str, rules: &str| {
            crate::testing::settings_from(&format!("[pools.p]\n{pool}\n\n{rules}"))
                .expect("valid")
                .cluster
                .warnings()
        };
        let open = "[[request_rules]]\nname = \"open\"\nurl_pattern = '^https://a\\.test/'\npool = \"p\"\n";
        let bound = "[[request_rules]]\nname = \"bound\"\nurl_pattern = '^https://b\\.test/'\npool = \"p\"\norigin = \"https://b.test\"\n";
        let denied = "[[request_rules]]\nname = \"denied\"\nurl_pattern = '^https://b\\.test/'\npool = \"p\"\norigin = \"https://b.test\"\naction = \"deny\"\n";
        let both = warnings("adaptive = true\n[pools.p.breaker]", open);
        assert_eq!(both.len(), 1, "{both:?}");
        assert!(
            both[0].starts_with("pools.p: its breaker and adaptive limit will never move"),
            "{both:?}"
        );
        assert!(both[0].contains("origin = \"https://a.test\""), "{both:?}");
        let breaker = warnings("[pools.p.breaker]", &format!("{denied}{open}"));
        assert_eq!(breaker.len(), 1, "{breaker:?}");
        assert!(
            breaker[0].starts_with("pools.p: its breaker will never move"),
            "{breaker:?}"
        );
        let adaptive = warnings("adaptive = true", "");
        assert!(
            adaptive[0].starts_with("pools.p: its adaptive limit will never move"),
            "{adaptive:?}"
        );
        assert!(
            warnings(
                "adaptive = true\n[pools.p.breaker]",
                &format!("{open}{bound}")
            )
            .is_empty()
        );
        assert!(warnings("max_in_flight = 4", open).is_empty());
    }

    #[test]
    fn the_jetstream_request_timeout_fits_ack_wait() {
        assert_eq!(
            jetstream_request_timeout(Duration::from_secs(15)),
            Duration::from_secs(5)
        );
        assert_eq!(
            jetstream_request_timeout(Duration::from_secs(60)),
            Duration::from_secs(5)
        );
        assert_eq!(
            jetstream_request_timeout(Duration::from_secs(2)),
            Duration::from_secs(2) / 3
        );
        for ack_wait in ["300ms", "2s", "15s", "1m"] {
            let settings =
                crate::testing::settings_from(&format!("[service]\nack_wait = \"{ack_wait}\""));
            assert!(settings.is_ok(), "{ack_wait}");
        }
    }
}
