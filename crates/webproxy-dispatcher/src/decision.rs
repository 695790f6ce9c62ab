//! What happens to a request, decided by pure code: whether it may be attempted, and
//! what an attempt's outcome means for the conversation. The effects (HTTP, publish,
//! ack) are carried out elsewhere, so every decision here is unit-tested without a server.

use webproxy_protocol::{ErrorBody, ErrorCode, Request};
use webproxy_worker::{AttemptOutcome, HttpResponse};

use crate::rules::{RequestRule, RequestRules, RuleAction};

/// Whether a parsed request may be attempted.
#[derive(Debug)]
pub enum Admission<'r> {
    /// Answer with this error at once; no attempt is made.
    Reject {
        error: ErrorBody,
        /// The deny rule that matched, if one did.
        rule: Option<&'r RequestRule>,
    },
    /// Attempt under this rule.
    Attempt(&'r RequestRule),
}

/// Matches a request against the rules: no match, or a deny rule, is `denied`.
pub fn admit<'r>(request: &Request, rules: &'r RequestRules) -> Admission<'r> {
    let target = format!("{} {}", request.method, request.url);
    match rules.find(request.method, request.url.as_str()) {
        None => Admission::Reject {
            error: ErrorBody {
                code: ErrorCode::Denied,
                message: format!("no request rule accepts {target}"),
                status: None,
            },
            rule: None,
        },
        Some(rule) if rule.action == RuleAction::Deny => Admission::Reject {
            error: ErrorBody {
                code: ErrorCode::Denied,
                message: format!("request rule {:?} denies {target}", rule.name),
                status: None,
            },
            rule: Some(rule),
        },
        Some(rule) => Admission::Attempt(rule),
    }
}

/// What an attempt's outcome means for the conversation.
#[derive(Debug)]
pub enum Verdict {
    /// Deliver this response to the caller.
    Respond(HttpResponse),
    /// End the conversation with this error.
    Fail(ErrorBody),
}

/// Judges one attempt's outcome. Until response rules exist, every HTTP response is
/// delivered, and a transport failure ends the conversation after one attempt.
pub fn judge(outcome: AttemptOutcome) -> Verdict {
    match outcome {
        AttemptOutcome::Response(response) => Verdict::Respond(response),
        AttemptOutcome::Failed(failure) => Verdict::Fail(ErrorBody {
            code: ErrorCode::RetriesExhausted,
            message: format!("{} failure: {}", failure.kind, failure.message),
            status: None,
        }),
        AttemptOutcome::TooLarge { status, limit } => Verdict::Fail(too_large(status, limit)),
        AttemptOutcome::HeadersTooLarge { status, message } => Verdict::Fail(ErrorBody {
            code: ErrorCode::ResponseTooLarge,
            message,
            status,
        }),
        // A refused destination never becomes reachable by trying again.
        AttemptOutcome::Denied { message } => Verdict::Fail(ErrorBody {
            code: ErrorCode::Denied,
            message,
            status: None,
        }),
    }
}

/// The error for a response whose body exceeds `limit` bytes.
pub fn too_large(status: u16, limit: usize) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::ResponseTooLarge,
        message: format!(
            "the upstream answered {status} with a body larger than {limit} bytes ([outbound] max_response_bytes)"
        ),
        status: Some(status),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use webproxy_protocol::{Subjects, parse_request};
    use webproxy_worker::{FailureKind, TransportFailure};

    use super::*;
    use crate::config::RequestRuleConfig;

    fn rules(specs: &[(&str, &str, &str, RuleAction)]) -> RequestRules {
        RequestRules::new(
            specs
                .iter()
                .map(|(name, method, pattern, action)| {
                    RequestRule::compile(&RequestRuleConfig {
                        name: (*name).into(),
                        method: (*method).into(),
                        url_pattern: (*pattern).into(),
                        action: *action,
                        pool: "default".into(),
                        timeout: Duration::from_secs(1),
                        max_retries: 0,
                        retry_delay: Duration::from_secs(1),
                        backoff_factor: 1.0,
                        follow_redirects: 0,
                        inject_headers: Default::default(),
                        deny_request_headers: Vec::new(),
                    })
                    .expect("valid rule")
                })
                .collect(),
        )
    }

    fn request(method: &str, url: &str) -> Request {
        let json = format!(r#"{{"id":"a","method":"{method}","url":"{url}"}}"#);
        parse_request(json.as_bytes(), &Subjects::new("webproxy").expect("prefix")).expect("valid")
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

    #[test]
    fn transport_failure_ends_the_conversation() {
        let verdict = judge(AttemptOutcome::Failed(TransportFailure {
            kind: FailureKind::Connect,
            may_have_reached_upstream: false,
            message: "refused".into(),
        }));
        match verdict {
            Verdict::Fail(e) => {
                assert_eq!(e.code, ErrorCode::RetriesExhausted);
                assert!(e.message.contains("connect"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn too_large_keeps_the_status() {
        match judge(AttemptOutcome::TooLarge {
            status: 200,
            limit: 10,
        }) {
            Verdict::Fail(e) => {
                assert_eq!(e.code, ErrorCode::ResponseTooLarge);
                assert_eq!(e.status, Some(200));
            }
            other => panic!("{other:?}"),
        }
    }
}
