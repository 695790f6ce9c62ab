//! Request rules (the seed's RequestFilter table): which requests are accepted, into
//! which pool, with which timeout and retry policy. Matching is pure.

use std::sync::Arc;
use std::time::Duration;

use regex::Regex;
use serde::{Deserialize, Serialize};
use webproxy_protocol::Method;

use crate::config::{IdempotencyHeader, RequestRuleConfig};
use crate::response_rules::ResponseRule;
use crate::retry::RetryPolicy;

/// The header name upstreams that support idempotency keys commonly honour.
pub const IDEMPOTENCY_KEY: &str = "Idempotency-Key";

/// What a matching rule does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum RuleAction {
    Accept,
    Deny,
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
    /// Whether POST and PATCH may be repeated after a failure that may have reached
    /// the upstream.
    pub retry_non_idempotent: bool,
    /// A header sent on every attempt with `<id>:<generation>`.
    pub idempotency_header: Option<String>,
    /// The rule's own response rules, or the global ones.
    pub response_rules: Arc<[ResponseRule]>,
    /// Redirects, injected credentials and dropped headers.
    pub security: crate::security::RuleSecurity,
}

impl RequestRule {
    /// Compiles a rule; an error names the field. `global_response_rules` apply unless
    /// the rule has a list of its own.
    pub fn compile(
        config: &RequestRuleConfig,
        global_response_rules: &Arc<[ResponseRule]>,
    ) -> Result<RequestRule, (String, String)> {
        Self::compile_fields(config, global_response_rules).map_err(|(f, m)| (f.to_string(), m))
    }

    fn compile_fields(
        config: &RequestRuleConfig,
        global_response_rules: &Arc<[ResponseRule]>,
    ) -> Result<RequestRule, (String, String)> {
        if config.name.trim().is_empty() {
            return Err(("name".into(), "must not be empty".into()));
        }
        let method = if config.method == "*" {
            None
        } else {
            Some(Method::parse(&config.method).ok_or((
                "method".to_string(),
                format!(
                    "{:?} is not \"*\" or one of GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS",
                    config.method
                ),
            ))?)
        };
        let pattern = Regex::new(&config.url_pattern)
            .map_err(|e| ("url_pattern".to_string(), format!("invalid regex: {e}")))?;
        if config.timeout.is_zero() {
            return Err(("timeout".into(), "must be more than 0".into()));
        }
        if !(config.backoff_factor.is_finite() && config.backoff_factor >= 1.0) {
            return Err((
                "backoff_factor".into(),
                "must be a number of at least 1.0".into(),
            ));
        }
        if !(config.jitter.is_finite() && (0.0..=1.0).contains(&config.jitter)) {
            return Err(("jitter".into(), "must be a fraction from 0.0 to 1.0".into()));
        }
        let response_rules = match &config.response_rules {
            None => global_response_rules.clone(),
            Some(list) => list
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    ResponseRule::compile(r)
                        .map_err(|(field, m)| (format!("response_rules[{i}].{field}"), m))
                })
                .collect::<Result<Arc<[_]>, _>>()?,
        };
        let idempotency_header = match &config.idempotency_header {
            None | Some(IdempotencyHeader::Enabled(false)) => None,
            Some(IdempotencyHeader::Enabled(true)) => Some(IDEMPOTENCY_KEY.to_string()),
            Some(IdempotencyHeader::Name(name)) => {
                if name.is_empty()
                    || !name
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
                {
                    return Err((
                        "idempotency_header".into(),
                        format!("{name:?} is not a valid header name"),
                    ));
                }
                Some(name.clone())
            }
        };
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
                max_retry_delay: config.max_retry_delay,
                jitter: config.jitter,
            },
            retry_non_idempotent: config.retry_non_idempotent,
            idempotency_header,
            response_rules,
            security: crate::security::RuleSecurity::compile(config)
                .map_err(|(field, message)| (field.to_string(), message))?,
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
pub(crate) mod tests {
    use super::*;

    pub(crate) fn rule_config(
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

    fn rule(name: &str, method: &str, pattern: &str, action: RuleAction) -> RequestRule {
        RequestRule::compile(&rule_config(name, method, pattern, action), &Arc::from([]))
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

    fn field_error(config: &RequestRuleConfig) -> String {
        RequestRule::compile(config, &Arc::from([]))
            .map(|_| ())
            .unwrap_err()
            .0
    }

    #[test]
    fn bad_fields_are_named() {
        let mut config = rule_config("r", "*", "(", RuleAction::Accept);
        assert_eq!(field_error(&config), "url_pattern");
        config.url_pattern = ".".into();
        config.method = "BREW".into();
        assert_eq!(field_error(&config), "method");
        config.method = "get".into();
        config.backoff_factor = 0.5;
        assert_eq!(field_error(&config), "backoff_factor");
        config.backoff_factor = 1.0;
        config.jitter = 1.5;
        assert_eq!(field_error(&config), "jitter");
        config.jitter = 0.0;
        config.idempotency_header = Some(IdempotencyHeader::Name("bad header".into()));
        assert_eq!(field_error(&config), "idempotency_header");
        config.idempotency_header = None;
        config.response_rules = Some(vec![
            toml::from_str("status = \"5xx\"\naction = \"retry\"").expect("toml"),
        ]);
        assert_eq!(field_error(&config), "response_rules[0].status");
    }

    #[test]
    fn idempotency_header_forms() {
        let mut config = rule_config("r", "*", ".", RuleAction::Accept);
        let compile = |c: &RequestRuleConfig| {
            RequestRule::compile(c, &Arc::from([]))
                .expect("valid")
                .idempotency_header
        };
        assert_eq!(compile(&config), None);
        config.idempotency_header = Some(IdempotencyHeader::Enabled(true));
        assert_eq!(compile(&config).as_deref(), Some("Idempotency-Key"));
        config.idempotency_header = Some(IdempotencyHeader::Enabled(false));
        assert_eq!(compile(&config), None);
        config.idempotency_header = Some(IdempotencyHeader::Name("X-Request-Key".into()));
        assert_eq!(compile(&config).as_deref(), Some("X-Request-Key"));
    }

    #[test]
    fn own_response_rules_replace_the_global_ones() {
        let global: Arc<[ResponseRule]> = Arc::from([ResponseRule::compile(
            &toml::from_str("status = \"500\"\naction = \"error\"").expect("toml"),
        )
        .expect("rule")]);
        let mut config = rule_config("r", "*", ".", RuleAction::Accept);
        let inherited = RequestRule::compile(&config, &global).expect("valid");
        assert_eq!(inherited.response_rules.len(), 1);
        config.response_rules = Some(Vec::new());
        let own = RequestRule::compile(&config, &global).expect("valid");
        assert!(own.response_rules.is_empty());
    }
}
