//! Settings and rules from TOML text as the binary's configuration layers give them,
//! for tests here and in the crates that run on them (`testing` feature).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;

use crate::breaker::BreakerConfig;
use crate::cluster::{ClusterConfig, PoolConfig};
use crate::error::ConfigError;
use crate::response_rules::ResponseRuleConfig;
use crate::rules::{RequestRuleConfig, RuleAction};
use crate::security::OutboundConfig;
use crate::settings::{Settings, StreamsConfig};

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
pub fn settings_from(extra: &str) -> Result<Settings, ConfigError> {
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

/// A request rule named `name` with the defaults but its method, pattern and action.
pub fn rule_config(
    name: &str,
    method: &str,
    pattern: &str,
    action: RuleAction,
) -> RequestRuleConfig {
    let mut config: RequestRuleConfig = toml::from_str(&format!(
        "name = {name:?}\nmethod = {method:?}\nurl_pattern = {pattern:?}"
    ))
    .expect("rule toml");
    config.action = action;
    config
}

/// A pool's `[pools.NAME.breaker]` section from TOML text, checked and compiled.
pub fn breaker_config(text: &str) -> BreakerConfig {
    let mut config: BreakerConfig = toml::from_str(text).expect("breaker toml");
    config.compile().expect("a valid breaker section");
    config
}
