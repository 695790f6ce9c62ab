//! What an attempt's outcome means for the conversation, decided by pure code: the
//! retry decision as a type ([`Verdict`]), apart from the code that acts on it, and the
//! pool pause a Retry-After asks for. Unit-tested without a server.

use std::time::{Duration, SystemTime};

use webproxy_config::response_rules::{ResponseAction, classify};
use webproxy_config::retry::parse_retry_after;
use webproxy_config::rules::RequestRule;
use webproxy_protocol::{ErrorBody, ErrorCode, Method, excerpt};
use webproxy_worker::{AttemptOutcome, FailureKind, HttpResponse, TransportFailure};

use crate::conversation::outbox::{BODY_EXCERPT_BYTES, too_large, upstream_error};

/// What an attempt's outcome means for the conversation; the retry decision as a type,
/// apart from the code that acts on it.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Deliver this response to the caller.
    Respond(HttpResponse),
    /// End the conversation with this error.
    Fail(ErrorBody),
    /// Attempt again after `after`; `last` describes the failure for the final error if
    /// the retries run out later.
    Retry { after: Duration, last: LastFailure },
    /// Leave the delivery for the server to redeliver: webproxy lost the answer to a
    /// passing failure of its own (a body store not answering), and the redelivery,
    /// counted against `max_deliver`, asks again.
    Redeliver { reason: String },
}

/// The failure that made an attempt retryable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LastFailure {
    pub(crate) status: Option<u16>,
    pub(crate) description: String,
}

/// What `judge` needs to know besides the outcome.
#[derive(Debug, Clone)]
pub(crate) struct AttemptContext<'a> {
    pub(crate) rule: &'a RequestRule,
    pub(crate) method: Method,
    /// The request carries an idempotency key (the caller's `Idempotency-Key`, or the
    /// header the rule adds), so the upstream can absorb a repeat.
    pub(crate) has_idempotency_key: bool,
    /// The number of the attempt just made, from 1.
    pub(crate) attempt: u32,
    pub(crate) now: SystemTime,
    pub(crate) deadline: Option<SystemTime>,
    /// Uniform in [-1, 1], for the rule's jitter.
    pub(crate) jitter_unit: f64,
    /// The request set `large_body`: a body too large was over `max_large_body`.
    pub(crate) large_body: bool,
}

/// The wait a 429 or 503 asks for with `Retry-After`.
fn retry_after(response: &HttpResponse, now: SystemTime) -> Option<Duration> {
    matches!(response.status, 429 | 503)
        .then(|| response.header("retry-after"))
        .flatten()
        .and_then(|v| parse_retry_after(v, now))
}

/// How long an attempt's outcome pauses the rule's whole pool: the `Retry-After` of a
/// 429 or 503 under a rule with `pause_on_retry_after`, at most its `max_pause`.
pub(crate) fn pool_pause(
    rule: &RequestRule,
    outcome: &AttemptOutcome,
    now: SystemTime,
) -> Option<Duration> {
    let max_pause = rule.max_pause?;
    let AttemptOutcome::Response(response) = outcome else {
        return None;
    };
    retry_after(response, now)
        .map(|wait| wait.min(max_pause))
        .filter(|wait| !wait.is_zero())
}

/// Judges one attempt's outcome under the rule's response rules and retry policy.
pub(crate) fn verdict_for(outcome: AttemptOutcome, context: &AttemptContext<'_>) -> Verdict {
    match outcome {
        AttemptOutcome::Response(response) => {
            match classify(
                &context.rule.response_rules,
                response.status,
                &response.body,
            ) {
                ResponseAction::Respond => Verdict::Respond(response),
                ResponseAction::Error => Verdict::Fail(upstream_error(&response)),
                ResponseAction::Retry => {
                    let retry_after = retry_after(&response, context.now);
                    let last = LastFailure {
                        status: Some(response.status),
                        description: format!(
                            "the upstream answered {}: {}",
                            response.status,
                            excerpt(&response.body, BODY_EXCERPT_BYTES)
                        ),
                    };
                    retry_or_give_up(context, last, retry_after)
                }
            }
        }
        AttemptOutcome::TooLarge { status, limit } => {
            Verdict::Fail(too_large(status, limit, context.large_body))
        }
        // The upstream's answer is lost to a body store that did not answer for a
        // moment (a new store without a leader yet, a restart): a redelivery asks again,
        // as after a crash, when the request may be repeated. A full store is not
        // passing, and a call that may not be repeated is not made twice: both are
        // webproxy's failure, which the pool must not wait for.
        AttemptOutcome::StoreFailed {
            status,
            message,
            full,
        } => {
            if !full && may_repeat(context) {
                return Verdict::Redeliver {
                    reason: format!(
                        "{message}: the upstream's answer was lost; left for redelivery"
                    ),
                };
            }
            Verdict::Fail(ErrorBody {
                code: ErrorCode::Internal,
                message,
                status: Some(status),
            })
        }
        AttemptOutcome::Failed(failure) => {
            let description = format!("{} failure: {}", failure.kind, failure.message);
            if transport_failure_is_retryable(&failure, context) {
                let last = LastFailure {
                    status: None,
                    description,
                };
                return retry_or_give_up(context, last, None);
            }
            let message = if failure.may_have_reached_upstream
                && matches!(failure.kind, FailureKind::Timeout | FailureKind::Reset)
            {
                format!(
                    "{description}; the request may have reached the upstream, and {} is retried after that only when the rule sets retry_non_idempotent or the request carries an Idempotency-Key",
                    context.method
                )
            } else {
                format!("{description}; retrying cannot fix this")
            };
            Verdict::Fail(ErrorBody {
                code: ErrorCode::TransportError,
                message,
                status: None,
            })
        }
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
        AttemptOutcome::Invalid { message } => Verdict::Fail(ErrorBody {
            code: ErrorCode::InvalidRequest,
            message,
            status: None,
        }),
    }
}

/// Connect and DNS failures never reached the upstream, so every method may repeat
/// them. A timeout or reset after the request was sent may have been acted on, so only
/// requests that are safe to repeat are. TLS and other failures are not transient.
fn transport_failure_is_retryable(
    failure: &TransportFailure,
    context: &AttemptContext<'_>,
) -> bool {
    match failure.kind {
        FailureKind::Connect | FailureKind::Dns => true,
        FailureKind::Timeout | FailureKind::Reset => {
            !failure.may_have_reached_upstream || may_repeat(context)
        }
        FailureKind::Tls | FailureKind::Other => false,
    }
}

/// Whether a request that reached the upstream may be sent again: its method is
/// idempotent, the upstream can absorb a repeat (an idempotency key), or the rule says
/// so.
fn may_repeat(context: &AttemptContext<'_>) -> bool {
    context.method.is_idempotent()
        || context.rule.retry_non_idempotent
        || context.has_idempotency_key
}

fn retry_or_give_up(
    context: &AttemptContext<'_>,
    last: LastFailure,
    retry_after: Option<Duration>,
) -> Verdict {
    let policy = &context.rule.retry;
    if context.attempt >= policy.max_attempts() {
        return Verdict::Fail(ErrorBody {
            code: ErrorCode::RetriesExhausted,
            message: format!(
                "gave up after {} attempts; the last: {}",
                context.attempt, last.description
            ),
            status: last.status,
        });
    }
    let scheduled = policy.delay_after(context.attempt, context.jitter_unit);
    let after = policy.with_retry_after(scheduled, retry_after);
    if let Some(deadline) = context.deadline
        && context.now + after > deadline
    {
        return Verdict::Fail(ErrorBody {
            code: ErrorCode::Expired,
            message: format!(
                "the next attempt would start after the deadline; the last failure: {}",
                last.description
            ),
            status: last.status,
        });
    }
    Verdict::Retry { after, last }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use webproxy_config::response_rules::{ResponseRule, ResponseRuleConfig};
    use webproxy_config::rules::RuleAction;
    use webproxy_config::testing::rule_config;

    use super::*;

    const T0: Duration = Duration::from_secs(1_800_000_000);

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + T0 + Duration::from_millis(ms)
    }

    fn rule_with(max_retries: u32, response_rules: &[(&str, &str, Option<&str>)]) -> RequestRule {
        let mut config = rule_config("r", "*", ".", RuleAction::Accept);
        config.max_retries = max_retries;
        config.retry_delay = Duration::from_millis(300);
        config.backoff_factor = 2.0;
        let global: Arc<[ResponseRule]> = response_rules
            .iter()
            .map(|(status, action, body)| {
                let config: ResponseRuleConfig = toml::from_str(&format!(
                    "status = {status:?}\naction = {action:?}\n{}",
                    body.map(|b| format!("body_pattern = {b:?}"))
                        .unwrap_or_default()
                ))
                .expect("toml");
                ResponseRule::compile(&config).expect("rule")
            })
            .collect();
        RequestRule::compile(&config, &global).expect("rule")
    }

    fn context<'a>(rule: &'a RequestRule, method: Method, attempt: u32) -> AttemptContext<'a> {
        AttemptContext {
            large_body: false,
            rule,
            method,
            has_idempotency_key: false,
            attempt,
            now: at(0),
            deadline: None,
            jitter_unit: 0.0,
        }
    }

    fn response(status: u16, headers: &[(&str, &str)], body: &str) -> AttemptOutcome {
        AttemptOutcome::Response(HttpResponse {
            status,
            headers: headers
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            body: body.as_bytes().to_vec().into(),
        })
    }

    fn failure(kind: FailureKind, reached: bool) -> AttemptOutcome {
        AttemptOutcome::Failed(TransportFailure {
            kind,
            may_have_reached_upstream: reached,
            message: "boom".into(),
        })
    }

    #[test]
    fn default_rules_retry_5xx_on_schedule_then_give_up() {
        let rule = rule_with(3, &[]);
        match verdict_for(response(503, &[], "busy"), &context(&rule, Method::Get, 1)) {
            Verdict::Retry { after, last } => {
                assert_eq!(after, Duration::from_millis(300));
                assert_eq!(last.status, Some(503));
            }
            other => panic!("{other:?}"),
        }
        match verdict_for(response(503, &[], "busy"), &context(&rule, Method::Get, 2)) {
            Verdict::Retry { after, .. } => assert_eq!(after, Duration::from_millis(600)),
            other => panic!("{other:?}"),
        }
        match verdict_for(response(503, &[], "busy"), &context(&rule, Method::Get, 4)) {
            Verdict::Fail(e) => {
                assert_eq!(e.code, ErrorCode::RetriesExhausted);
                assert_eq!(e.status, Some(503));
                assert!(e.message.contains("4 attempts"), "{}", e.message);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            verdict_for(response(404, &[], ""), &context(&rule, Method::Get, 1)),
            Verdict::Respond(_)
        ));
    }

    #[test]
    fn retry_after_stretches_the_wait_for_429_and_503_only() {
        let rule = rule_with(3, &[]);
        for status in [429, 503] {
            match verdict_for(
                response(status, &[("retry-after", "1")], ""),
                &context(&rule, Method::Get, 1),
            ) {
                Verdict::Retry { after, .. } => assert_eq!(after, Duration::from_secs(1)),
                other => panic!("{other:?}"),
            }
        }
        match verdict_for(
            response(500, &[("retry-after", "1")], ""),
            &context(&rule, Method::Get, 1),
        ) {
            Verdict::Retry { after, .. } => assert_eq!(after, Duration::from_millis(300)),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn retry_after_pauses_the_pool_only_under_a_rule_that_asks_and_at_most_max_pause() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let off = rule_with(3, &[]);
        let asked = response(429, &[("retry-after", "2")], "");
        assert_eq!(pool_pause(&off, &asked, now), None);
        let mut config = rule_config("r", "*", ".", RuleAction::Accept);
        config.pause_on_retry_after = true;
        config.max_pause = Duration::from_secs(60);
        let on = RequestRule::compile(&config, &Arc::from([])).expect("rule");
        assert_eq!(pool_pause(&on, &asked, now), Some(Duration::from_secs(2)));
        let unavailable = response(503, &[("retry-after", "3600")], "");
        assert_eq!(
            pool_pause(&on, &unavailable, now),
            Some(Duration::from_secs(60))
        );
        for other in [
            response(500, &[("retry-after", "2")], ""),
            response(429, &[], ""),
            response(429, &[("retry-after", "0")], ""),
            failure(FailureKind::Timeout, true),
        ] {
            assert_eq!(pool_pause(&on, &other, now), None);
        }
    }

    #[test]
    fn error_action_and_body_patterns() {
        let rule = rule_with(
            3,
            &[
                ("500", "retry", Some("ConcurrentRequestLimit")),
                ("500-599", "error", None),
            ],
        );
        assert!(matches!(
            verdict_for(
                response(500, &[], "ExceededConcurrentRequestLimitFault"),
                &context(&rule, Method::Post, 1)
            ),
            Verdict::Retry { .. }
        ));
        match verdict_for(
            response(500, &[], "InvalidLogin"),
            &context(&rule, Method::Post, 1),
        ) {
            Verdict::Fail(e) => {
                assert_eq!(e.code, ErrorCode::UpstreamError);
                assert_eq!(e.status, Some(500));
                assert!(e.message.contains("InvalidLogin"), "{}", e.message);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn transport_failures_by_kind_and_method() {
        let rule = rule_with(3, &[]);
        let retries = |outcome, method, key| {
            let mut c = context(&rule, method, 1);
            c.has_idempotency_key = key;
            matches!(verdict_for(outcome, &c), Verdict::Retry { .. })
        };
        // nothing reached the upstream: every method
        assert!(retries(
            failure(FailureKind::Connect, false),
            Method::Post,
            false
        ));
        assert!(retries(
            failure(FailureKind::Dns, false),
            Method::Patch,
            false
        ));
        assert!(retries(
            failure(FailureKind::Timeout, false),
            Method::Post,
            false
        ));
        // may have reached it: only what is safe to repeat
        for method in [
            Method::Get,
            Method::Head,
            Method::Options,
            Method::Put,
            Method::Delete,
        ] {
            assert!(
                retries(failure(FailureKind::Timeout, true), method, false),
                "{method}"
            );
            assert!(
                retries(failure(FailureKind::Reset, true), method, false),
                "{method}"
            );
        }
        for method in [Method::Post, Method::Patch] {
            assert!(
                !retries(failure(FailureKind::Timeout, true), method, false),
                "{method}"
            );
            assert!(
                !retries(failure(FailureKind::Reset, true), method, false),
                "{method}"
            );
            assert!(
                retries(failure(FailureKind::Timeout, true), method, true),
                "{method}"
            );
        }
        assert!(!retries(
            failure(FailureKind::Tls, true),
            Method::Get,
            false
        ));
        assert!(!retries(
            failure(FailureKind::Other, true),
            Method::Get,
            false
        ));
        match verdict_for(
            failure(FailureKind::Timeout, true),
            &context(&rule, Method::Post, 1),
        ) {
            Verdict::Fail(e) => {
                assert_eq!(e.code, ErrorCode::TransportError);
                assert!(
                    e.message.contains("may have reached the upstream"),
                    "{}",
                    e.message
                );
            }
            other => panic!("{other:?}"),
        }
        let mut lenient = rule_with(3, &[]);
        lenient.retry_non_idempotent = true;
        assert!(matches!(
            verdict_for(
                failure(FailureKind::Timeout, true),
                &context(&lenient, Method::Post, 1)
            ),
            Verdict::Retry { .. }
        ));
    }

    #[test]
    fn a_retry_due_after_the_deadline_expires_now() {
        let rule = rule_with(3, &[]);
        let mut c = context(&rule, Method::Get, 1);
        c.deadline = Some(at(200));
        match verdict_for(response(503, &[], "busy"), &c) {
            Verdict::Fail(e) => {
                assert_eq!(e.code, ErrorCode::Expired);
                assert_eq!(e.status, Some(503));
            }
            other => panic!("{other:?}"),
        }
        c.deadline = Some(at(1000));
        assert!(matches!(
            verdict_for(response(503, &[], "busy"), &c),
            Verdict::Retry { .. }
        ));
    }

    #[test]
    fn too_large_keeps_the_status() {
        let rule = rule_with(3, &[]);
        match verdict_for(
            AttemptOutcome::TooLarge {
                status: 200,
                limit: 10,
            },
            &context(&rule, Method::Get, 1),
        ) {
            Verdict::Fail(e) => {
                assert_eq!(e.code, ErrorCode::ResponseTooLarge);
                assert_eq!(e.status, Some(200));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_body_store_not_answering_is_redelivered_when_the_call_may_be_repeated() {
        let rule = rule_with(3, &[]);
        let judged = |full, method, key| {
            let mut c = context(&rule, method, 1);
            c.has_idempotency_key = key;
            let outcome = AttemptOutcome::StoreFailed {
                status: 200,
                message: "body store: not stored: no responders".into(),
                full,
            };
            verdict_for(outcome, &c)
        };
        for (method, key) in [(Method::Get, false), (Method::Post, true)] {
            match judged(false, method, key) {
                Verdict::Redeliver { reason } => {
                    assert!(reason.contains("no responders"), "{reason}");
                }
                other => panic!("{method}: {other:?}"),
            }
        }
        // A full store, or a call that may not be made twice: internal, at once.
        for (full, method) in [(true, Method::Get), (false, Method::Post)] {
            match judged(full, method, false) {
                Verdict::Fail(e) => {
                    assert_eq!((e.code, e.status), (ErrorCode::Internal, Some(200)));
                }
                other => panic!("{method}: {other:?}"),
            }
        }
    }
}
