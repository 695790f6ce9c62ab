//! A pool's circuit breaker as configured: `[pools.NAME.breaker]`, its defaults and
//! its checks. What it counts and when it opens are the dispatcher's.

use std::ops::RangeInclusive;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::response_rules::parse_status_range;

/// `[pools.NAME.breaker]`: present means on.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BreakerConfig {
    /// Failures ÷ attempts, across the cluster within `window`, that open the breaker.
    #[serde(default = "default_failure_ratio")]
    pub failure_ratio: f64,
    /// Attempts, across the cluster within `window`, below which it never opens.
    #[serde(default = "default_min_attempts")]
    pub min_attempts: u64,
    #[serde(default = "default_window", with = "humantime_serde")]
    pub window: Duration,
    /// The first pause; each failed probe doubles it, up to `max_open_for`.
    #[serde(default = "default_open_for", with = "humantime_serde")]
    pub open_for: Duration,
    #[serde(default = "default_max_open_for", with = "humantime_serde")]
    pub max_open_for: Duration,
    /// Statuses (`"503"`) or inclusive ranges (`"502-504"`) that count as failures.
    #[serde(default = "default_failure_statuses")]
    pub failure_statuses: Vec<String>,
    /// `failure_statuses`, compiled by [`BreakerConfig::compile`].
    #[serde(skip)]
    pub statuses: Vec<RangeInclusive<u16>>,
}

fn default_failure_ratio() -> f64 {
    0.5
}
fn default_min_attempts() -> u64 {
    20
}
fn default_window() -> Duration {
    Duration::from_secs(30)
}
fn default_open_for() -> Duration {
    Duration::from_secs(30)
}
fn default_max_open_for() -> Duration {
    Duration::from_secs(600)
}
fn default_failure_statuses() -> Vec<String> {
    vec!["429".into(), "502-504".into()]
}

/// The failure statuses when no breaker is configured (what the adaptive limit counts).
pub fn default_statuses() -> Vec<RangeInclusive<u16>> {
    default_failure_statuses()
        .iter()
        .filter_map(|s| parse_status_range(s))
        .collect()
}

impl BreakerConfig {
    /// Checks the section and compiles its statuses; an error names the field.
    pub fn compile(&mut self) -> Result<(), (&'static str, String)> {
        if !(self.failure_ratio > 0.0 && self.failure_ratio <= 1.0) {
            return Err(("failure_ratio", "must be above 0 and at most 1".into()));
        }
        if self.min_attempts == 0 {
            return Err(("min_attempts", "must be at least 1".into()));
        }
        if self.window < Duration::from_secs(1) {
            return Err(("window", "must be at least 1s".into()));
        }
        if self.open_for < Duration::from_secs(1) {
            return Err(("open_for", "must be at least 1s".into()));
        }
        if self.max_open_for < self.open_for {
            return Err(("max_open_for", "must be at least open_for".into()));
        }
        self.statuses = self
            .failure_statuses
            .iter()
            .map(|s| {
                parse_status_range(s).ok_or_else(|| {
                    format!(
                        "{s:?} is not a status code (\"429\") or an inclusive range (\"502-504\") within 100-599"
                    )
                })
            })
            .collect::<Result<_, _>>()
            .map_err(|e| ("failure_statuses", e))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::breaker_config;

    use super::*;

    #[test]
    fn defaults_are_the_issues() {
        let config = breaker_config("");
        assert_eq!(config.failure_ratio, 0.5);
        assert_eq!(config.min_attempts, 20);
        assert_eq!(config.window, Duration::from_secs(30));
        assert_eq!(config.open_for, Duration::from_secs(30));
        assert_eq!(config.max_open_for, Duration::from_secs(600));
        assert_eq!(config.statuses, vec![429..=429, 502..=504]);
    }

    #[test]
    fn bad_values_name_their_field() {
        for (text, field) in [
            ("failure_ratio = 0.0", "failure_ratio"),
            ("failure_ratio = 1.5", "failure_ratio"),
            ("min_attempts = 0", "min_attempts"),
            ("window = \"100ms\"", "window"),
            ("open_for = \"10s\"\nmax_open_for = \"5s\"", "max_open_for"),
            ("failure_statuses = [\"5xx\"]", "failure_statuses"),
        ] {
            let mut config: BreakerConfig = toml::from_str(text).expect("toml");
            assert_eq!(config.compile().expect_err(text).0, field, "{text}");
        }
    }
}
