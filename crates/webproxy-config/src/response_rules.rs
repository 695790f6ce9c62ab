//! Response rules (the seed's ResponseFilter table): what an HTTP status, and
//! optionally the body, mean for the conversation. Classification is pure.

use std::ops::RangeInclusive;

use regex::bytes::Regex;
use serde::{Deserialize, Serialize};

/// What a matching response rule does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponseAction {
    /// Deliver the response.
    Respond,
    /// Attempt again on the retry schedule.
    Retry,
    /// End with `upstream_error`.
    Error,
}

/// A response rule as written in the configuration.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseRuleConfig {
    /// One code (`"429"`) or an inclusive range (`"500-599"`).
    pub status: String,
    pub action: ResponseAction,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_pattern: Option<String>,
}

/// A compiled response rule.
#[derive(Debug, Clone)]
pub struct ResponseRule {
    pub status: RangeInclusive<u16>,
    pub action: ResponseAction,
    /// Searched in the raw body; the rule matches only when it matches too.
    pub body_pattern: Option<Regex>,
}

impl ResponseRule {
    /// Compiles a rule; an error names the field.
    pub fn compile(config: &ResponseRuleConfig) -> Result<ResponseRule, (&'static str, String)> {
        let status = parse_status_range(&config.status).ok_or((
            "status",
            format!(
                "{:?} is not a status code (\"429\") or an inclusive range (\"500-599\") within 100-599",
                config.status
            ),
        ))?;
        let body_pattern = config
            .body_pattern
            .as_deref()
            .map(Regex::new)
            .transpose()
            .map_err(|e| ("body_pattern", format!("invalid regex: {e}")))?;
        Ok(ResponseRule {
            status,
            action: config.action,
            body_pattern,
        })
    }

    /// The rule as it would be written: a single status as one code.
    fn written(&self) -> ResponseRuleConfig {
        let (low, high) = (*self.status.start(), *self.status.end());
        ResponseRuleConfig {
            status: if low == high {
                low.to_string()
            } else {
                format!("{low}-{high}")
            },
            action: self.action,
            body_pattern: self.body_pattern.as_ref().map(|p| p.as_str().to_string()),
        }
    }

    fn matches(&self, status: u16, body: &[u8]) -> bool {
        self.status.contains(&status)
            && self
                .body_pattern
                .as_ref()
                .is_none_or(|pattern| pattern.is_match(body))
    }
}

pub fn parse_status_range(text: &str) -> Option<RangeInclusive<u16>> {
    let (low, high) = match text.split_once('-') {
        Some((low, high)) => (low.trim().parse().ok()?, high.trim().parse().ok()?),
        None => {
            let code = text.trim().parse().ok()?;
            (code, code)
        }
    };
    ((100..=599).contains(&low) && (100..=599).contains(&high) && low <= high).then_some(low..=high)
}

/// Where the response rules of a request rule come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ResponseRulesSource {
    /// The request rule's own `[[request_rules.response_rules]]`.
    Own,
    /// The global `[[response_rules]]`.
    Global,
    /// None configured (or an empty list): [`default_action`]'s.
    Default,
}

/// The response rules that classify a request rule's responses, in order, as
/// `check-config` shows them: a misplaced block shows as the wrong source.
#[derive(Debug, Clone, Serialize)]
pub struct AppliedResponseRules {
    pub source: ResponseRulesSource,
    /// Empty for [`ResponseRulesSource::Default`].
    pub rules: Vec<ResponseRuleConfig>,
}

impl AppliedResponseRules {
    pub fn of(rules: &[ResponseRule], own: bool) -> AppliedResponseRules {
        let source = match (rules.is_empty(), own) {
            (true, _) => ResponseRulesSource::Default,
            (false, true) => ResponseRulesSource::Own,
            (false, false) => ResponseRulesSource::Global,
        };
        AppliedResponseRules {
            source,
            rules: rules.iter().map(ResponseRule::written).collect(),
        }
    }

    /// One line: each rule as `STATUS action [body ~ /PATTERN/]`, then what any other
    /// response does.
    pub fn summary(&self) -> String {
        if self.source == ResponseRulesSource::Default {
            return "408, 429 and 500-599 retry; any other responds".to_string();
        }
        let mut parts: Vec<String> = self
            .rules
            .iter()
            .map(|rule| {
                let action = match rule.action {
                    ResponseAction::Respond => "respond",
                    ResponseAction::Retry => "retry",
                    ResponseAction::Error => "error",
                };
                match &rule.body_pattern {
                    Some(pattern) => {
                        format!("{} {action} if the body matches /{pattern}/", rule.status)
                    }
                    None => format!("{} {action}", rule.status),
                }
            })
            .collect();
        parts.push("any other responds".to_string());
        parts.join("; ")
    }
}

/// What a response means when no response rule is configured: 408, 429 and 5xx are
/// transient, everything else is the upstream's answer.
pub fn default_action(status: u16) -> ResponseAction {
    match status {
        408 | 429 | 500..=599 => ResponseAction::Retry,
        _ => ResponseAction::Respond,
    }
}

/// Classifies a response: the first rule in order that matches decides; no match is
/// `Respond`. An empty list means the defaults of [`default_action`].
pub fn classify(rules: &[ResponseRule], status: u16, body: &[u8]) -> ResponseAction {
    if rules.is_empty() {
        return default_action(status);
    }
    rules
        .iter()
        .find(|rule| rule.matches(status, body))
        .map_or(ResponseAction::Respond, |rule| rule.action)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(status: &str, action: ResponseAction, body: Option<&str>) -> ResponseRule {
        ResponseRule::compile(&ResponseRuleConfig {
            status: status.into(),
            action,
            body_pattern: body.map(str::to_string),
        })
        .expect("valid rule")
    }

    #[test]
    fn applied_rules_name_their_source_and_read_as_written() {
        let rules = [
            rule("429", ResponseAction::Retry, None),
            rule("200-299", ResponseAction::Error, Some("\"ok\":false")),
        ];
        let own = AppliedResponseRules::of(&rules, true);
        assert_eq!(own.source, ResponseRulesSource::Own);
        assert_eq!(own.rules[0].status, "429");
        assert_eq!(
            own.summary(),
            "429 retry; 200-299 error if the body matches /\"ok\":false/; any other responds"
        );
        assert_eq!(
            AppliedResponseRules::of(&rules, false).source,
            ResponseRulesSource::Global
        );
        let defaults = AppliedResponseRules::of(&[], true);
        assert_eq!(defaults.source, ResponseRulesSource::Default);
        assert!(defaults.summary().starts_with("408, 429 and 500-599 retry"));
    }

    #[test]
    fn defaults_retry_transient_statuses() {
        for status in [408, 429, 500, 503, 599] {
            assert_eq!(
                classify(&[], status, b""),
                ResponseAction::Retry,
                "{status}"
            );
        }
        for status in [200, 204, 301, 400, 404, 409] {
            assert_eq!(
                classify(&[], status, b""),
                ResponseAction::Respond,
                "{status}"
            );
        }
    }

    #[test]
    fn first_match_wins_and_no_match_responds() {
        let rules = [
            rule("503", ResponseAction::Error, None),
            rule("500-599", ResponseAction::Retry, None),
        ];
        assert_eq!(classify(&rules, 503, b""), ResponseAction::Error);
        assert_eq!(classify(&rules, 502, b""), ResponseAction::Retry);
        // a configured list replaces the defaults entirely
        assert_eq!(classify(&rules, 429, b""), ResponseAction::Respond);
    }

    #[test]
    fn body_pattern_must_match_too() {
        let rules = [
            rule(
                "500",
                ResponseAction::Retry,
                Some("ExceededConcurrentRequestLimitFault"),
            ),
            rule("500-599", ResponseAction::Error, None),
        ];
        assert_eq!(
            classify(
                &rules,
                500,
                b"<soap:Fault>ExceededConcurrentRequestLimitFault</soap:Fault>"
            ),
            ResponseAction::Retry
        );
        assert_eq!(
            classify(&rules, 500, b"<soap:Fault>InvalidLogin</soap:Fault>"),
            ResponseAction::Error
        );
        // binary bodies are searched as bytes
        let binary = [rule("200", ResponseAction::Error, Some("(?-u:\\xff)"))];
        assert_eq!(classify(&binary, 200, &[0, 0xff]), ResponseAction::Error);
    }

    #[test]
    fn status_forms() {
        assert_eq!(parse_status_range("429"), Some(429..=429));
        assert_eq!(parse_status_range("500-599"), Some(500..=599));
        assert_eq!(parse_status_range(" 400 - 404 "), Some(400..=404));
        for bad in ["", "5xx", "599-500", "99", "600", "200-700", "a-b"] {
            assert_eq!(parse_status_range(bad), None, "{bad}");
        }
    }

    #[test]
    fn bad_rules_name_the_field() {
        let bad_status = ResponseRuleConfig {
            status: "5xx".into(),
            action: ResponseAction::Retry,
            body_pattern: None,
        };
        assert_eq!(
            ResponseRule::compile(&bad_status)
                .map(|_| ())
                .unwrap_err()
                .0,
            "status"
        );
        let bad_pattern = ResponseRuleConfig {
            status: "500".into(),
            action: ResponseAction::Retry,
            body_pattern: Some("(".into()),
        };
        assert_eq!(
            ResponseRule::compile(&bad_pattern)
                .map(|_| ())
                .unwrap_err()
                .0,
            "body_pattern"
        );
    }
}
