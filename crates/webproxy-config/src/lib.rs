//! webproxy's configuration as data: the `[streams]` settings and the cluster document
//! (request and response rules, retry, the outbound policy, secret sources, pools with
//! their rate and breaker sections), checked and compiled into the form the dispatcher
//! runs on, with errors that name the key. Pure: no async runtime, no NATS; the one I/O
//! is reading an injected secret's file or variable when asked to.
//!
//! The binary loads the file and `check-config` checks it with this crate alone; the
//! dispatcher takes a [`Settings`] and runs it.

pub mod breaker;
pub mod cluster;
pub mod error;
pub mod rate;
pub mod response_rules;
pub mod retry;
pub mod rules;
pub mod secret_source;
pub mod secrets;
pub mod security;
pub mod settings;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

use std::time::Duration;

pub use cluster::{Cluster, ClusterConfig, PoolConfig};
pub use error::{ConfigError, element_key, key_path};
pub use response_rules::{AppliedResponseRules, ResponseRuleConfig, ResponseRulesSource};
pub use retry::RetryPolicy;
pub use rules::{RequestRuleConfig, RuleAction};
pub use secret_source::SecretSource;
pub use secrets::{Redactor, SecretError, Secrets};
pub use security::{OutboundConfig, parse_cidrs};
pub use settings::{Settings, StreamsConfig};

/// A duration as people read it, to the millisecond: `1s 500ms`, `6years 11months`
/// (a deadline set decades ago), never a bare count of milliseconds.
pub fn human(duration: Duration) -> String {
    let millis = Duration::from_millis(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX));
    humantime::format_duration(millis).to_string()
}
