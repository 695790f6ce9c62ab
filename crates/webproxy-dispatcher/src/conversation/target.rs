//! Which rule a request goes under, decided by pure code: `admit` for the request as
//! the caller sent it, `target` for it and every redirect leg (an accepting rule's
//! origin and path parameters included). Unit-tested without a server.

use webproxy_config::rules::{RequestRule, RequestRules, RuleAction};
use webproxy_protocol::{ErrorBody, ErrorCode, Method, Request};

/// Whether a parsed request may be attempted.
#[derive(Debug)]
pub(crate) enum Admission<'r> {
    /// Answer with this error at once; no attempt is made.
    Reject {
        error: ErrorBody,
        /// The rule that matched, if one did.
        rule: Option<&'r RequestRule>,
    },
    /// Attempt under this rule.
    Attempt(&'r RequestRule),
}

/// Matches a request against the rules: no match, a deny rule, or an accept rule
/// bound to another origin is `denied`; a path parameter the accepting rule does not
/// allow is `invalid_request`.
pub(crate) fn admit<'r>(request: &Request, rules: &'r RequestRules) -> Admission<'r> {
    match target(rules, request.method, &request.url) {
        Ok(rule) => Admission::Attempt(rule),
        Err(refusal) => Admission::Reject {
            error: ErrorBody {
                code: refusal.code,
                message: refusal.message,
                status: None,
            },
            rule: refusal.rule,
        },
    }
}

/// Why nothing may be sent to a URL.
#[derive(Debug)]
pub(crate) struct TargetRefusal<'r> {
    /// `denied` (the rules refuse the destination) or `invalid_request` (the URL is
    /// one webproxy does not send under the rule that accepts it).
    pub(crate) code: ErrorCode,
    pub(crate) message: String,
    /// The rule that matched (a deny rule, an accept rule bound to another origin,
    /// or one that does not allow the URL's path parameter), if one did.
    pub(crate) rule: Option<&'r RequestRule>,
}

/// The rule under which `method url` may be sent, for the first hop and every
/// redirect hop alike: the first matching rule must accept, an accept rule with
/// an origin must name exactly the URL's scheme, host and port, and a `;` in the path
/// needs the rule's `allow_path_parameters` (else `invalid_request`, as for a URL
/// the envelope's parser refuses: the rule is known only here).
pub(crate) fn target<'r>(
    rules: &'r RequestRules,
    method: Method,
    url: &url::Url,
) -> Result<&'r RequestRule, TargetRefusal<'r>> {
    let refused = |message: String, rule| {
        Err(TargetRefusal {
            code: ErrorCode::Denied,
            message,
            rule,
        })
    };
    match rules.find(method, url.as_str()) {
        None => refused(format!("no request rule accepts {method} {url}"), None),
        Some(rule) if rule.action == RuleAction::Deny => refused(
            format!("request rule {:?} denies {method} {url}", rule.name),
            Some(rule),
        ),
        Some(rule) => match rule.security.check_origin(url) {
            Err(why) => refused(
                format!(
                    "request rule {:?} matches {method} {url} but {why}",
                    rule.name
                ),
                Some(rule),
            ),
            // The URL is not repeated: a path parameter may carry a session id.
            Ok(()) => match rule.security.check_path(url) {
                Ok(()) => Ok(rule),
                Err(why) => Err(TargetRefusal {
                    code: ErrorCode::InvalidRequest,
                    message: format!("request rule {:?} {why}", rule.name),
                    rule: Some(rule),
                }),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use webproxy_config::testing::rule_config;
    use webproxy_protocol::{Subjects, parse_request};

    use super::*;

    fn rules(specs: &[(&str, &str, &str, RuleAction)]) -> RequestRules {
        RequestRules::new(
            specs
                .iter()
                .map(|(name, method, pattern, action)| {
                    RequestRule::compile(
                        &rule_config(name, method, pattern, *action),
                        &Arc::from([]),
                    )
                    .expect("valid rule")
                })
                .collect(),
        )
    }

    fn request(method: &str, url: &str) -> Request {
        let json = format!(r#"{{"id":"a","method":"{method}","url":"{url}"}}"#);
        parse_request(
            json.as_bytes(),
            &Subjects::new("webproxy").expect("prefix"),
            None,
        )
        .expect("valid")
    }

    #[test]
    fn no_rules_denies_everything() {
        match admit(&request("GET", "https://a/"), &RequestRules::default()) {
            Admission::Reject { error, rule } => {
                assert_eq!(error.code, ErrorCode::Denied);
                assert!(
                    error.message.contains("GET https://a/"),
                    "{}",
                    error.message
                );
                assert!(rule.is_none());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn deny_rule_is_named() {
        let rules = rules(&[("block", "*", "^https://a/", RuleAction::Deny)]);
        match admit(&request("GET", "https://a/x"), &rules) {
            Admission::Reject { error, rule } => {
                assert!(error.message.contains("\"block\""), "{}", error.message);
                assert_eq!(rule.map(|r| r.name.as_str()), Some("block"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn accept_rule_admits() {
        let rules = rules(&[("ok", "get", "^https://a/", RuleAction::Accept)]);
        assert!(matches!(
            admit(&request("get", "https://a/x"), &rules),
            Admission::Attempt(r) if r.name == "ok"
        ));
    }

    /// The issue's rules: a deny on `/raw/target/admin/` above an accept on
    /// `/raw/target/`. A `;` the accepting rule does not allow is `invalid_request`
    /// naming the rule and the key, without repeating the URL; the same rule with
    /// `allow_path_parameters` admits it; the deny rule still decides what it matches.
    #[test]
    fn a_path_parameter_needs_the_accepting_rules_allow_path_parameters() {
        let specs = [
            (
                "admin",
                "*",
                "^https://a/raw/target/admin/",
                RuleAction::Deny,
            ),
            ("target", "*", "^https://a/raw/target/", RuleAction::Accept),
        ];
        let strict = rules(&specs);
        for url in [
            "https://a/raw/target/admin;jsessionid=x/users",
            "https://a/raw/target/admin%3B/users",
            "https://a/raw/target/admin%3b/users",
        ] {
            match admit(&request("GET", url), &strict) {
                Admission::Reject { error, rule } => {
                    assert_eq!(error.code, ErrorCode::InvalidRequest, "{url}");
                    assert!(error.message.contains("\"target\""), "{}", error.message);
                    assert!(error.message.contains("';'"), "{}", error.message);
                    assert!(error.message.contains("segment 3"), "{}", error.message);
                    assert!(
                        error.message.contains("allow_path_parameters"),
                        "{}",
                        error.message
                    );
                    assert!(!error.message.contains("jsessionid"), "{}", error.message);
                    assert_eq!(rule.map(|r| r.name.as_str()), Some("target"));
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        assert!(matches!(
            admit(&request("GET", "https://a/raw/target/admin/x;y"), &strict),
            Admission::Reject { error, .. } if error.code == ErrorCode::Denied
        ));
        assert!(matches!(
            admit(&request("GET", "https://a/raw/target/x?a=1;b=2"), &strict),
            Admission::Attempt(r) if r.name == "target"
        ));

        let mut allowing = rule_config("target", "*", specs[1].2, RuleAction::Accept);
        allowing.allow_path_parameters = true;
        let allowing = RequestRules::new(vec![
            RequestRule::compile(&allowing, &Arc::from([])).expect("valid rule"),
        ]);
        assert!(matches!(
            admit(&request("GET", "https://a/raw/target/cars;color=red"), &allowing),
            Admission::Attempt(r) if r.name == "target"
        ));
    }
}
