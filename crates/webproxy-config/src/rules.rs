//! Request rules (the seed's RequestFilter table): which requests are accepted, into
//! which pool, with which timeout and retry policy. Matching is pure.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use regex::Regex;
use serde::{Deserialize, Serialize};
use webproxy_protocol::Method;

use crate::error::element_key;
use crate::response_rules::{AppliedResponseRules, ResponseRule, ResponseRuleConfig};
use crate::retry::RetryPolicy;
use crate::secret_source::SecretSource;
use crate::security::{self, RuleSecurity};

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

fn default_max_pause() -> Duration {
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
    /// A 429 or 503 with `Retry-After` under this rule pauses its whole pool until then
    /// (capped by `max_pause`), on every instance.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pause_on_retry_after: bool,
    #[serde(default = "default_max_pause", with = "humantime_serde")]
    pub max_pause: Duration,
    /// Headers set from secrets, replacing any the caller sends.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub inject_headers: BTreeMap<String, SecretSource>,
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
    /// Sends a `;` in the path (raw or `%3B`, a path parameter such as
    /// `;jsessionid=x`), which is otherwise `invalid_request`: upstreams such as
    /// Tomcat drop what follows it, so they read another path than the one matched.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_path_parameters: bool,
}

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
    /// Whether `response_rules` are the rule's own.
    own_response_rules: bool,
    /// The longest pause of the pool a `Retry-After` under this rule makes; `None`
    /// when `pause_on_retry_after` is off.
    pub max_pause: Option<Duration>,
    /// Redirects, injected credentials and dropped headers.
    pub security: RuleSecurity,
}

impl RequestRule {
    /// The response rules that classify this rule's responses, and where they come
    /// from.
    pub fn applied_response_rules(&self) -> AppliedResponseRules {
        AppliedResponseRules::of(&self.response_rules, self.own_response_rules)
    }

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
        if config.pause_on_retry_after && config.max_pause.is_zero() {
            return Err(("max_pause".into(), "must be more than 0".into()));
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
                    ResponseRule::compile(r).map_err(|(field, m)| {
                        (
                            format!("{}.{field}", element_key("response_rules", i, None)),
                            m,
                        )
                    })
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
            own_response_rules: config.response_rules.is_some(),
            max_pause: config.pause_on_retry_after.then_some(config.max_pause),
            security: RuleSecurity::compile(config)
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

    /// The rule that governs `method url`: the first in file order whose method (or
    /// `*`) and pattern both match, deny or accept. Exceptions are written by order: an
    /// accept for `/admin/health` before a deny for `/admin/`. `url` is the canonical
    /// URL, which is also what is sent.
    pub fn find(&self, method: Method, url: &str) -> Option<&RequestRule> {
        self.rules
            .iter()
            .find(|rule| rule.method.is_none_or(|m| m == method) && rule.pattern.is_match(url))
    }

    /// What `check-config` warns about in the rules: a rule an earlier one shadows
    /// completely (where that can be decided), an unanchored pattern, and an unescaped
    /// dot in a pattern's host part. Each names the rule.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for (index, rule) in self.rules.iter().enumerate() {
            let key = element_key("request_rules", index, Some(&rule.name));
            let pattern = rule.pattern.as_str();
            if let Some((earlier, shadow)) = self.rules[..index]
                .iter()
                .enumerate()
                .find(|(_, earlier)| shadows(earlier, rule))
            {
                warnings.push(format!(
                    "{key}: never matches: {} comes first, covers its methods, and its url_pattern is a prefix of this one's; to make this rule an exception, move it above",
                    element_key("request_rules", earlier, Some(&shadow.name))
                ));
            }
            if !is_anchored(pattern) {
                warnings.push(format!(
                    "{key}.url_pattern {pattern:?} is not anchored: it is searched anywhere in the URL, so it also matches a URL that only mentions what it names (https://evil.example/?u=...); start it with ^"
                ));
            }
            if let Some(host) = unescaped_dot_in_host(pattern) {
                warnings.push(format!(
                    "{key}.url_pattern: the host part {host:?} has an unescaped '.', which matches any character (apixpartner.com for api.partner.com); write \\."
                ));
            }
        }
        warnings
    }
}

/// Whether `earlier` matches every request `later` matches, where that can be decided
/// from the text: `earlier` covers `later`'s methods, and `later`'s pattern is
/// `earlier`'s followed by more, with no alternation at the top level of either and
/// nothing that would bind to the end of `earlier`'s (a quantifier).
fn shadows(earlier: &RequestRule, later: &RequestRule) -> bool {
    if earlier.method.is_some() && earlier.method != later.method {
        return false;
    }
    let (first, second) = (earlier.pattern.as_str(), later.pattern.as_str());
    let Some(rest) = second.strip_prefix(first) else {
        return false;
    };
    !rest.starts_with(['*', '+', '?', '{'])
        && !has_top_level_alternation(first)
        && !has_top_level_alternation(second)
}

/// Walks a pattern outside escapes and character classes, giving each character and
/// its group depth.
fn outside_classes(pattern: &str, mut visit: impl FnMut(usize, char, usize) -> bool) {
    let mut depth = 0usize;
    let mut class = 0usize;
    let mut chars = pattern.char_indices().peekable();
    while let Some((at, c)) = chars.next() {
        match c {
            '\\' => {
                chars.next();
            }
            '[' => {
                class += 1;
                // A `]` (or `^]`) first in a class is a literal.
                if chars.peek().is_some_and(|(_, c)| *c == '^') {
                    chars.next();
                }
                if class == 1 && chars.peek().is_some_and(|(_, c)| *c == ']') {
                    chars.next();
                }
            }
            ']' if class > 0 => class -= 1,
            _ if class > 0 => {}
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ => {
                if !visit(at, c, depth) {
                    return;
                }
            }
        }
    }
}

fn has_top_level_alternation(pattern: &str) -> bool {
    let mut found = false;
    outside_classes(pattern, |_, c, depth| {
        found = c == '|' && depth == 0;
        !found
    });
    found
}

/// Whether a pattern can only match at the start of the URL: `^` or `\A` first, after
/// any inline flags such as `(?i)`.
fn is_anchored(pattern: &str) -> bool {
    let mut rest = pattern;
    while let Some(after) = rest.strip_prefix("(?") {
        match after.find(')') {
            Some(end)
                if after[..end]
                    .chars()
                    .all(|c| c.is_ascii_alphabetic() || c == '-') =>
            {
                rest = &after[end + 1..];
            }
            _ => break,
        }
    }
    rest.starts_with('^') || rest.starts_with("\\A")
}

/// The host part of a pattern (from after `://` to the first `/` outside groups and
/// classes) when it has a `.` that is neither escaped nor in a class.
fn unescaped_dot_in_host(pattern: &str) -> Option<&str> {
    let start = pattern.find("://")? + 3;
    let host = &pattern[start..];
    let mut end = host.len();
    let mut dot = false;
    outside_classes(host, |at, c, depth| {
        if c == '/' && depth == 0 {
            end = at;
            return false;
        }
        dot |= c == '.';
        true
    });
    dot.then(|| &host[..end])
}

/// A rule's security keys are compiled here, with the rest of the rule, so that
/// `security` needs nothing of the rules' schema.
impl RuleSecurity {
    /// Compiles a rule's security keys; an error names the field.
    pub fn compile(config: &RequestRuleConfig) -> Result<RuleSecurity, (&'static str, String)> {
        let deny_request_headers = security::header_names(&config.deny_request_headers)
            .map_err(|(i, m)| ("deny_request_headers", format!("item {i}: {m}")))?;
        let mut inject = Vec::with_capacity(config.inject_headers.len());
        let mut seen = BTreeMap::new();
        for (name, source) in &config.inject_headers {
            if !security::is_token(name) {
                return Err(("inject_headers", format!("{name:?} is not a header name")));
            }
            if seen.insert(name.to_ascii_lowercase(), ()).is_some() {
                return Err(("inject_headers", format!("{name:?} is set twice")));
            }
            source
                .validate()
                .map_err(|m| ("inject_headers", format!("{name}: {m}")))?;
            if source
                .prefix
                .bytes()
                .any(|b| b == b'\r' || b == b'\n' || b == 0)
            {
                return Err((
                    "inject_headers",
                    format!("{name}: the prefix contains CR, LF or NUL"),
                ));
            }
            inject.push((name.clone(), source.clone()));
        }
        let origin = match &config.origin {
            Some(text) => Some(security::parse_origin(text, config.allow_http)?),
            None if !inject.is_empty() => {
                let example = security::suggested_origin(&config.url_pattern)
                    .unwrap_or_else(|| "https://api.partner.com".to_string());
                return Err((
                    "origin",
                    format!(
                        "is required because the rule injects headers: add origin = \"{example}\", the scheme, host and port the credentials may be sent to"
                    ),
                ));
            }
            None if config.allow_http => {
                return Err((
                    "allow_http",
                    "applies only to a rule's origin: set origin = \"http://host:port\" too, or remove allow_http".into(),
                ));
            }
            None => None,
        };
        if config.allow_path_parameters && config.action == RuleAction::Deny {
            return Err((
                "allow_path_parameters",
                "applies only to an accept rule: a deny rule sends nothing".into(),
            ));
        }
        Ok(RuleSecurity {
            index: 0,
            follow_redirects: config.follow_redirects,
            inject,
            deny_request_headers,
            origin,
            allow_path_parameters: config.allow_path_parameters,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::rule_config;

    fn rule(name: &str, method: &str, pattern: &str, action: RuleAction) -> RequestRule {
        RequestRule::compile(&rule_config(name, method, pattern, action), &Arc::from([]))
            .expect("valid rule")
    }

    #[test]
    fn allow_path_parameters_is_an_accept_rules_key() {
        let mut config = rule_config("r", "*", "^https://a/", RuleAction::Accept);
        config.allow_path_parameters = true;
        let compiled = RequestRule::compile(&config, &Arc::from([])).expect("valid");
        assert!(compiled.security.allow_path_parameters);
        assert!(
            !rule("r", "*", "^https://a/", RuleAction::Accept)
                .security
                .allow_path_parameters,
            "off by default"
        );
        config.action = RuleAction::Deny;
        let (field, message) = RequestRule::compile(&config, &Arc::from([])).expect_err("deny");
        assert_eq!(field, "allow_path_parameters");
        assert!(message.contains("accept rule"), "{message}");
    }

    #[test]
    fn no_rules_matches_nothing() {
        let rules = RequestRules::default();
        assert!(rules.find(Method::Get, "https://a/").is_none());
    }

    fn found(rules: &RequestRules, method: Method, url: &str) -> Option<String> {
        rules.find(method, url).map(|r| r.name.clone())
    }

    /// The first rule whose method and pattern match decides, deny or accept: a
    /// method-specific accept no longer beats an earlier `*` deny.
    #[test]
    fn first_match_in_file_order_decides_whatever_the_method() {
        let any = rule("any", "*", "^https://a/", RuleAction::Deny);
        let post = rule("post", "post", "^https://a/", RuleAction::Accept);
        let deny_first = RequestRules::new(vec![any.clone(), post.clone()]);
        assert_eq!(
            found(&deny_first, Method::Post, "https://a/x").as_deref(),
            Some("any")
        );
        assert_eq!(
            found(&deny_first, Method::Get, "https://a/x").as_deref(),
            Some("any")
        );
        let accept_first = RequestRules::new(vec![post, any]);
        assert_eq!(
            found(&accept_first, Method::Post, "https://a/x").as_deref(),
            Some("post")
        );
        assert_eq!(
            found(&accept_first, Method::Get, "https://a/x").as_deref(),
            Some("any")
        );
    }

    /// The issue's bypass: a deny on /admin/ before a POST accept for the whole API
    /// holds for POST too; an exception for /admin/health is written above the deny.
    #[test]
    fn a_deny_before_an_accept_holds_and_exceptions_go_first() {
        let rules = RequestRules::new(vec![
            rule(
                "health",
                "GET",
                "^https://api\\.partner\\.com/admin/health$",
                RuleAction::Accept,
            ),
            rule(
                "no-admin",
                "*",
                "^https://api\\.partner\\.com/admin/",
                RuleAction::Deny,
            ),
            rule(
                "api",
                "POST",
                "^https://api\\.partner\\.com/",
                RuleAction::Accept,
            ),
        ]);
        let delete = "https://api.partner.com/admin/users/42/delete";
        assert_eq!(
            found(&rules, Method::Post, delete).as_deref(),
            Some("no-admin")
        );
        let health = "https://api.partner.com/admin/health";
        assert_eq!(
            found(&rules, Method::Get, health).as_deref(),
            Some("health")
        );
        assert_eq!(
            found(&rules, Method::Post, health).as_deref(),
            Some("no-admin")
        );
        let orders = "https://api.partner.com/orders";
        assert_eq!(found(&rules, Method::Post, orders).as_deref(), Some("api"));
        assert_eq!(found(&rules, Method::Get, orders), None);
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

    fn warnings(rules: Vec<RequestRule>) -> Vec<String> {
        RequestRules::new(rules).warnings()
    }

    #[test]
    fn a_rule_shadowed_by_an_earlier_prefix_is_warned_about() {
        let w = warnings(vec![
            rule(
                "no-admin",
                "*",
                "^https://a\\.test/admin/",
                RuleAction::Deny,
            ),
            rule(
                "health",
                "GET",
                "^https://a\\.test/admin/health",
                RuleAction::Accept,
            ),
        ]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(
            w[0].starts_with("request_rules[1] (health): never matches"),
            "{w:?}"
        );
        assert!(w[0].contains("request_rules[0] (no-admin)"), "{w:?}");
        // The same pattern under the same method.
        let w = warnings(vec![
            rule("a", "GET", "^https://a\\.test/", RuleAction::Accept),
            rule("b", "get", "^https://a\\.test/", RuleAction::Deny),
        ]);
        assert_eq!(w.len(), 1, "{w:?}");
        // In the right order, or under another method, nothing is shadowed.
        for rules in [
            vec![
                rule(
                    "health",
                    "GET",
                    "^https://a\\.test/admin/health",
                    RuleAction::Accept,
                ),
                rule(
                    "no-admin",
                    "*",
                    "^https://a\\.test/admin/",
                    RuleAction::Deny,
                ),
            ],
            vec![
                rule("get", "GET", "^https://a\\.test/", RuleAction::Accept),
                rule("post", "POST", "^https://a\\.test/x", RuleAction::Accept),
                rule("any", "*", "^https://a\\.test/x", RuleAction::Deny),
            ],
        ] {
            assert!(warnings(rules).is_empty());
        }
    }

    #[test]
    fn shadowing_is_warned_about_only_where_it_can_be_decided() {
        for (first, second) in [
            // A quantifier binds to the end of the earlier pattern.
            ("^https://a", "^https://a*b"),
            ("^https://a\\.test/x", "^https://a\\.test/x?y"),
            ("^https://a\\.test/x", "^https://a\\.test/x{0}y"),
            // Alternation at the top level.
            ("^https://a|^https://b", "^https://a|^https://b|^https://c"),
            ("^https://a", "^https://ab|^https://c"),
            // Not a prefix.
            ("^https://a\\.test/x", "^https://a\\.test/y"),
        ] {
            let w = warnings(vec![
                rule("first", "*", first, RuleAction::Accept),
                rule("second", "*", second, RuleAction::Accept),
            ]);
            assert!(
                w.iter().all(|w| !w.contains("never matches")),
                "{first} {second}: {w:?}"
            );
        }
        // Alternation inside a group is fine.
        let w = warnings(vec![
            rule(
                "first",
                "*",
                "^https://(www\\.)?a\\.(com|org)/",
                RuleAction::Accept,
            ),
            rule(
                "second",
                "*",
                "^https://(www\\.)?a\\.(com|org)/x",
                RuleAction::Accept,
            ),
        ]);
        assert!(w[0].contains("never matches"), "{w:?}");
    }

    #[test]
    fn unanchored_patterns_and_unescaped_host_dots_are_warned_about() {
        let w = warnings(vec![rule(
            "r",
            "*",
            "api\\.partner\\.com/",
            RuleAction::Accept,
        )]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("request_rules[0] (r).url_pattern"), "{w:?}");
        assert!(w[0].contains("not anchored"), "{w:?}");
        let w = warnings(vec![rule(
            "r",
            "*",
            "^https://api.partner.com/",
            RuleAction::Accept,
        )]);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("unescaped '.'"), "{w:?}");
        assert!(w[0].contains("\"api.partner.com\""), "{w:?}");
        for clean in [
            "^https://api\\.partner\\.com/",
            "(?i)^https://api\\.partner\\.com/",
            "\\Ahttps://api\\.partner\\.com:8443/",
            "^https://(www\\.)?example\\.(com|org)/",
            "^https://api[.]partner[.]com/v1/.*",
            "^http://",
            // Dots in the path are not the host's.
            "^https://a\\.test/x.y",
        ] {
            let w = warnings(vec![rule("r", "*", clean, RuleAction::Accept)]);
            assert!(w.is_empty(), "{clean}: {w:?}");
        }
        // `.*` in the host part matches any host, slashes included.
        let w = warnings(vec![rule(
            "r",
            "*",
            "^https://.*\\.partner\\.com/",
            RuleAction::Accept,
        )]);
        assert!(w.iter().any(|w| w.contains("unescaped '.'")), "{w:?}");
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
