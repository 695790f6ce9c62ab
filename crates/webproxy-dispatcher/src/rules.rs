//! Request rules (the seed's RequestFilter table): which requests are accepted, into
//! which pool, with which timeout and retry policy. Matching is pure.

use std::time::Duration;

use regex::Regex;
use serde::{Deserialize, Serialize};
use webproxy_protocol::Method;

use crate::config::RequestRuleConfig;

/// What a matching rule does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleAction {
    Accept,
    Deny,
}

/// How often and how fast a rule's requests are retried.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetryPolicy {
    pub max_retries: u32,
    #[serde(with = "humantime_serde")]
    pub retry_delay: Duration,
    pub backoff_factor: f64,
}

/// A compiled request rule.
#[derive(Debug, Clone)]
pub struct RequestRule {
    pub name: String,
    /// `None` matches every method.
    pub method: Option<Method>,
    pub pattern: Regex,
    pub action: RuleAction,
    pub pool: String,
    /// Per attempt.
    pub timeout: Duration,
    pub retry: RetryPolicy,
    /// Redirects, injected credentials and dropped headers.
    pub security: crate::security::RuleSecurity,
}

impl RequestRule {
    /// Compiles a rule; an error names the field.
    pub fn compile(config: &RequestRuleConfig) -> Result<RequestRule, (&'static str, String)> {
        if config.name.trim().is_empty() {
            return Err(("name", "must not be empty".into()));
        }
        let method = if config.method == "*" {
            None
        } else {
            Some(Method::parse(&config.method).ok_or((
                "method",
                format!(
                    "{:?} is not \"*\" or one of GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS",
                    config.method
                ),
            ))?)
        };
        let pattern = Regex::new(&config.url_pattern)
            .map_err(|e| ("url_pattern", format!("invalid regex: {e}")))?;
        if config.timeout.is_zero() {
            return Err(("timeout", "must be more than 0".into()));
        }
        if !(config.backoff_factor.is_finite() && config.backoff_factor >= 1.0) {
            return Err(("backoff_factor", "must be a number of at least 1.0".into()));
        }
        Ok(RequestRule {
            name: config.name.clone(),
            method,
            pattern,
            action: config.action,
            pool: config.pool.clone(),
            timeout: config.timeout,
            retry: RetryPolicy {
                max_retries: config.max_retries,
                retry_delay: config.retry_delay,
                backoff_factor: config.backoff_factor,
            },
            security: crate::security::RuleSecurity::compile(config)?,
        })
    }
}

/// The rule table, in file order.
#[derive(Debug, Clone, Default)]
pub struct RequestRules {
    rules: Vec<RequestRule>,
}

impl RequestRules {
    pub fn new(mut rules: Vec<RequestRule>) -> Self {
        for (index, rule) in rules.iter_mut().enumerate() {
            rule.security.index = index;
        }
        RequestRules { rules }
    }

    pub fn iter(&self) -> impl Iterator<Item = &RequestRule> {
        self.rules.iter()
    }

    /// The rule that governs `method url`: a rule naming the method beats a `*` rule,
    /// whatever their order; among equals the first in file order wins. `url` is the
    /// normalised URL, which is also what is sent.
    pub fn find(&self, method: Method, url: &str) -> Option<&RequestRule> {
        let mut first_wildcard = None;
        for rule in &self.rules {
            match rule.method {
                Some(m) if m == method => {
                    if rule.pattern.is_match(url) {
                        return Some(rule);
                    }
                }
                Some(_) => {}
                None => {
                    if first_wildcard.is_none() && rule.pattern.is_match(url) {
                        first_wildcard = Some(rule);
                    }
                }
            }
        }
        first_wildcard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(name: &str, method: &str, pattern: &str, action: RuleAction) -> RequestRule {
        RequestRule::compile(&RequestRuleConfig {
            name: name.into(),
            method: method.into(),
            url_pattern: pattern.into(),
            action,
            pool: "default".into(),
            timeout: Duration::from_secs(30),
            max_retries: 3,
            retry_delay: Duration::from_secs(1),
            backoff_factor: 2.0,
            follow_redirects: 0,
            inject_headers: Default::default(),
            deny_request_headers: Vec::new(),
        })
        .expect("valid rule")
    }

    #[test]
    fn no_rules_matches_nothing() {
        let rules = RequestRules::default();
        assert!(rules.find(Method::Get, "https://a/").is_none());
    }

    #[test]
    fn exact_method_beats_wildcard_in_either_order() {
        let any = rule("any", "*", "^https://a/", RuleAction::Deny);
        let post = rule("post", "post", "^https://a/", RuleAction::Accept);
        for rules in [
            RequestRules::new(vec![any.clone(), post.clone()]),
            RequestRules::new(vec![post.clone(), any.clone()]),
        ] {
            assert_eq!(
                rules
                    .find(Method::Post, "https://a/x")
                    .map(|r| r.name.as_str()),
                Some("post")
            );
            assert_eq!(
                rules
                    .find(Method::Get, "https://a/x")
                    .map(|r| r.name.as_str()),
                Some("any")
            );
        }
    }

    #[test]
    fn first_among_equals_wins() {
        let rules = RequestRules::new(vec![
            rule("first", "*", "^https://a/", RuleAction::Accept),
            rule("second", "*", "^https://a/x", RuleAction::Deny),
        ]);
        assert_eq!(
            rules
                .find(Method::Get, "https://a/x")
                .map(|r| r.name.as_str()),
            Some("first")
        );
    }

    #[test]
    fn pattern_is_searched_not_anchored() {
        let rules = RequestRules::new(vec![rule("r", "*", "example", RuleAction::Accept)]);
        assert!(
            rules
                .find(Method::Get, "https://api.example.com/")
                .is_some()
        );
        let anchored =
            RequestRules::new(vec![rule("r", "*", "^https://example", RuleAction::Accept)]);
        assert!(
            anchored
                .find(Method::Get, "https://api.example.com/")
                .is_none()
        );
    }

    #[test]
    fn other_method_does_not_match() {
        let rules = RequestRules::new(vec![rule("r", "GET", ".", RuleAction::Accept)]);
        assert!(rules.find(Method::Delete, "https://a/").is_none());
    }

    #[test]
    fn bad_fields_are_named() {
        let mut config = RequestRuleConfig {
            name: "r".into(),
            method: "*".into(),
            url_pattern: "(".into(),
            action: RuleAction::Accept,
            pool: "default".into(),
            timeout: Duration::from_secs(1),
            max_retries: 0,
            retry_delay: Duration::from_secs(1),
            backoff_factor: 1.0,
            follow_redirects: 0,
            inject_headers: Default::default(),
            deny_request_headers: Vec::new(),
        };
        assert_eq!(
            RequestRule::compile(&config).map(|_| ()).unwrap_err().0,
            "url_pattern"
        );
        config.url_pattern = ".".into();
        config.method = "BREW".into();
        assert_eq!(
            RequestRule::compile(&config).map(|_| ()).unwrap_err().0,
            "method"
        );
        config.method = "get".into();
        config.backoff_factor = 0.5;
        assert_eq!(
            RequestRule::compile(&config).map(|_| ()).unwrap_err().0,
            "backoff_factor"
        );
    }
}
