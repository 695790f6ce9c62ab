//! The plan for one delivery, decided by pure code before anything is attempted:
//! poison, a payload that is no request, admission by the rules, the request limits,
//! expiry, and a move to the rule's pool, in that order. The handler carries it out.

use std::time::{Duration, SystemTime};

use webproxy_config::human;
use webproxy_config::rules::RequestRule;
use webproxy_config::security::Outbound;
use webproxy_config::settings::Settings;
use webproxy_protocol::{ErrorBody, ErrorCode, ParseError, Request};

use crate::conversation::hop::MAX_HOP_HEADER_BYTES;
use crate::conversation::outbox::{HEADER_ALLOWANCE, invalid_request};
use crate::conversation::target::{Admission, admit};

/// Everything the plan depends on: the settings (whose rules the plan names, for
/// `'r`) and the delivery (for `'d`).
#[derive(Debug)]
pub(crate) struct PlanInput<'r, 'd> {
    pub(crate) settings: &'r Settings,
    /// The pool whose consumer delivered the message.
    pub(crate) pool: &'d str,
    /// The server's delivery count of this message.
    pub(crate) delivered: u64,
    pub(crate) parsed: &'d Result<Request, ParseError>,
    /// The size of the stored message's payload.
    pub(crate) payload_len: usize,
    /// The server's `max_payload`.
    pub(crate) max_payload: usize,
    pub(crate) now: SystemTime,
    /// The caller's publish: queue waits count from it.
    pub(crate) since: SystemTime,
    /// No attempt has been made yet in this generation.
    pub(crate) first_attempt: bool,
}

/// What happens to the delivery.
#[derive(Debug)]
pub(crate) enum Plan<'r> {
    /// Delivered more often than `max_deliver`: it crashed or stalled an instance each
    /// time. Answered `internal`, dead-lettered and terminated.
    Poison(ErrorBody),
    /// Not a request envelope at all: dead-lettered and terminated.
    Undecodable(ErrorBody),
    /// Ended with this error without an attempt: invalid, denied, over a limit, or
    /// expired.
    Reject {
        error: ErrorBody,
        /// The rule that matched, if one did.
        rule: Option<&'r RequestRule>,
    },
    /// The rule's pool is not the pool it arrived in: hand it over, so that publishing
    /// everything to one pool cannot bypass another pool's limit.
    Move(&'r RequestRule),
    /// Attempt under this rule; `queue_wait` is the wait before a first attempt.
    Attempt {
        rule: &'r RequestRule,
        queue_wait: Option<Duration>,
    },
}

/// The largest request envelope the service takes: one that, with the largest hop
/// state beside it, still fits the server's `max_payload`, so every hop of it can be
/// published.
pub(crate) fn max_envelope_bytes(max_payload: usize) -> usize {
    max_payload.saturating_sub(HEADER_ALLOWANCE + MAX_HOP_HEADER_BYTES)
}

/// Decides what happens to a delivery.
pub(crate) fn plan<'r>(input: &PlanInput<'r, '_>) -> Plan<'r> {
    let max_deliver = input.settings.cluster.max_deliver;
    if input.delivered > u64::from(max_deliver) {
        return Plan::Poison(ErrorBody {
            code: ErrorCode::Internal,
            message: format!(
                "delivered {} times without finishing (more than [service] max_deliver = {max_deliver}): it crashed or stalled an instance each time, so it is not attempted again",
                input.delivered
            ),
            status: None,
        });
    }
    let request = match input.parsed {
        Ok(request) => request,
        Err(ParseError::Undecodable { reason }) => {
            return Plan::Undecodable(ErrorBody {
                code: ErrorCode::InvalidRequest,
                message: format!("payload is not a request envelope: {reason}"),
                status: None,
            });
        }
        Err(ParseError::Invalid(invalid)) => {
            return Plan::Reject {
                error: invalid_request(invalid.field, &invalid.message),
                rule: None,
            };
        }
    };
    let largest = max_envelope_bytes(input.max_payload);
    if input.payload_len > largest {
        return Plan::Reject {
            error: invalid_request(
                "payload",
                &format!(
                    "the envelope is {} bytes; with the server's max_payload of {} bytes the largest that every retry and move can carry is {largest}",
                    input.payload_len, input.max_payload
                ),
            ),
            rule: None,
        };
    }
    let settings = input.settings;
    let rule = match admit(request, &settings.cluster.rules) {
        Admission::Reject { error, rule } => return Plan::Reject { error, rule },
        Admission::Attempt(rule) => rule,
    };
    if let Err(error) = check_request(request, &settings.cluster.outbound) {
        return Plan::Reject {
            error,
            rule: Some(rule),
        };
    }
    if let Some(error) = expired(input, request, rule, input.now) {
        return Plan::Reject {
            error,
            rule: Some(rule),
        };
    }
    if rule.pool != input.pool {
        return Plan::Move(rule);
    }
    Plan::Attempt {
        rule,
        queue_wait: input
            .first_attempt
            .then(|| input.now.duration_since(input.since).unwrap_or_default()),
    }
}

/// Whether `request`, under `rule`, is past its deadline or its pool's
/// `queue_timeout` at `now`: when planned, and again after a wait at the pool's gate.
pub(crate) fn expired(
    input: &PlanInput<'_, '_>,
    request: &Request,
    rule: &RequestRule,
    now: SystemTime,
) -> Option<ErrorBody> {
    let waited = now.duration_since(input.since).unwrap_or_default();
    // The queue that counts is the rule's pool's, where the request runs; a moved
    // request's wait counts from the caller's publish all the same.
    let queued = input
        .settings
        .cluster
        .pools
        .get(&rule.pool)
        .and_then(|p| p.queue_timeout)
        .filter(|_| input.first_attempt)
        .map(|limit| (waited, limit));
    let deadline = request.deadline.map(SystemTime::from);
    expiry(now, deadline, queued)
}

/// Whether a request is within the request limits; the error is `invalid_request`
/// naming the limit. Counted on the caller's headers as received.
pub(crate) fn check_request(request: &Request, outbound: &Outbound) -> Result<(), ErrorBody> {
    if request.body.len() as u64 > outbound.max_request_bytes {
        return Err(invalid_request(
            "body",
            &format!(
                "is {} bytes, more than [outbound] max_request_bytes = {}",
                request.body.len(),
                outbound.max_request_bytes
            ),
        ));
    }
    if request.headers.len() > outbound.max_headers {
        return Err(invalid_request(
            "headers",
            &format!(
                "has {} headers, more than [outbound] max_headers = {}",
                request.headers.len(),
                outbound.max_headers
            ),
        ));
    }
    let bytes: usize = request
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    if bytes > outbound.max_header_bytes {
        return Err(invalid_request(
            "headers",
            &format!(
                "has {bytes} bytes of names and values, more than [outbound] max_header_bytes = {}",
                outbound.max_header_bytes
            ),
        ));
    }
    Ok(())
}

/// Why a request may not start its next attempt, if it may not: the deadline has
/// passed, or it waited in the queue longer than the pool's `queue_timeout` before its
/// first attempt (`queued` is how long it waited and the limit).
pub(crate) fn expiry(
    now: SystemTime,
    deadline: Option<SystemTime>,
    queued: Option<(Duration, Duration)>,
) -> Option<ErrorBody> {
    if let Some(deadline) = deadline
        && now > deadline
    {
        let late = now.duration_since(deadline).unwrap_or_default();
        return Some(ErrorBody {
            code: ErrorCode::Expired,
            message: format!(
                "the deadline passed {} before the attempt could start",
                human(late)
            ),
            status: None,
        });
    }
    match queued {
        Some((waited, limit)) if waited > limit => Some(ErrorBody {
            code: ErrorCode::Expired,
            message: format!(
                "waited {} in the pool's queue, longer than its queue_timeout of {}",
                human(waited),
                human(limit)
            ),
            status: None,
        }),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use webproxy_config::testing::settings_from;
    use webproxy_protocol::{Subjects, parse_request};

    use super::*;

    fn settings() -> Settings {
        let toml = r#"
            [pools.slow]
            max_in_flight = 1
            queue_timeout = "10s"

            [[request_rules]]
            name = "denied"
            method = "*"
            url_pattern = '^https://a\.test/admin/'
            action = "deny"

            [[request_rules]]
            name = "slow"
            method = "*"
            url_pattern = '^https://slow\.test/'
            action = "accept"
            pool = "slow"

            [[request_rules]]
            name = "a"
            method = "*"
            url_pattern = '^https://a\.test/'
            action = "accept"
        "#;
        webproxy_config::testing::settings_from(toml).expect("valid config")
    }

    fn parsed(json: &str) -> Result<Request, ParseError> {
        parse_request(
            json.as_bytes(),
            &Subjects::new("webproxy").expect("prefix"),
            None,
        )
    }

    fn input<'a>(
        settings: &'a Settings,
        parsed: &'a Result<Request, ParseError>,
        pool: &'a str,
    ) -> PlanInput<'a, 'a> {
        let now = SystemTime::now();
        PlanInput {
            settings,
            pool,
            delivered: 1,
            parsed,
            payload_len: 100,
            max_payload: 1024 * 1024,
            now,
            since: now - Duration::from_secs(1),
            first_attempt: true,
        }
    }

    fn rejected(plan: Plan<'_>) -> ErrorBody {
        match plan {
            Plan::Reject { error, .. } => error,
            other => panic!("expected a rejection, got {other:?}"),
        }
    }

    const GET_A: &str = r#"{"id":"x","method":"GET","url":"https://a.test/x"}"#;

    #[test]
    fn an_accepted_request_in_its_pool_is_attempted() {
        let settings = settings();
        let parsed = parsed(GET_A);
        match plan(&input(&settings, &parsed, "default")) {
            Plan::Attempt { rule, queue_wait } => {
                assert_eq!(rule.name, "a");
                assert!(queue_wait.is_some_and(|w| w >= Duration::from_secs(1)));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn poison_comes_before_everything_else() {
        let settings = settings();
        let parsed = parsed("not json");
        let mut input = input(&settings, &parsed, "default");
        input.delivered = 6;
        match plan(&input) {
            Plan::Poison(error) => {
                assert_eq!(error.code, ErrorCode::Internal);
                assert!(
                    error.message.contains("max_deliver = 5"),
                    "{}",
                    error.message
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn undecodable_and_invalid_payloads() {
        let settings = settings();
        let garbage = parsed("[1]");
        assert!(matches!(
            plan(&input(&settings, &garbage, "default")),
            Plan::Undecodable(_)
        ));
        let invalid = parsed(r#"{"id":"x","method":"BREW","url":"https://a.test/"}"#);
        let error = rejected(plan(&input(&settings, &invalid, "default")));
        assert_eq!(error.code, ErrorCode::InvalidRequest);
        assert!(error.message.contains("`method`"), "{}", error.message);
    }

    #[test]
    fn an_envelope_too_large_for_its_hops_is_invalid() {
        let settings = settings();
        let parsed = parsed(GET_A);
        let mut input = input(&settings, &parsed, "default");
        input.payload_len = max_envelope_bytes(input.max_payload) + 1;
        let error = rejected(plan(&input));
        assert_eq!(error.code, ErrorCode::InvalidRequest);
        assert!(error.message.contains("max_payload"), "{}", error.message);
    }

    #[test]
    fn denial_names_the_rule() {
        let settings = settings();
        let parsed = parsed(r#"{"id":"x","method":"GET","url":"https://a.test/admin/"}"#);
        match plan(&input(&settings, &parsed, "default")) {
            Plan::Reject { error, rule } => {
                assert_eq!(error.code, ErrorCode::Denied);
                assert_eq!(rule.map(|r| r.name.as_str()), Some("denied"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_request_in_the_wrong_pool_moves() {
        let settings = settings();
        let parsed = parsed(r#"{"id":"x","method":"GET","url":"https://slow.test/"}"#);
        match plan(&input(&settings, &parsed, "default")) {
            Plan::Move(rule) => assert_eq!(rule.pool, "slow"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            plan(&input(&settings, &parsed, "slow")),
            Plan::Attempt { .. }
        ));
    }

    #[test]
    fn the_queue_timeout_of_the_rules_pool_applies_to_first_attempts_only() {
        let settings = settings();
        let parsed = parsed(r#"{"id":"x","method":"GET","url":"https://slow.test/"}"#);
        let mut late = input(&settings, &parsed, "default");
        late.since = late.now - Duration::from_secs(11);
        assert_eq!(rejected(plan(&late)).code, ErrorCode::Expired);
        late.first_attempt = false;
        assert!(matches!(plan(&late), Plan::Move(_)));
    }

    #[test]
    fn a_passed_deadline_expires() {
        let settings = settings();
        let parsed = parsed(
            r#"{"id":"x","method":"GET","url":"https://a.test/","deadline":"2000-01-01T00:00:00Z"}"#,
        );
        assert_eq!(
            rejected(plan(&input(&settings, &parsed, "default"))).code,
            ErrorCode::Expired
        );
    }

    fn request(headers: &[(&str, &str)], body: &str) -> Request {
        let headers: serde_json::Map<String, serde_json::Value> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), serde_json::Value::String(v.to_string())))
            .collect();
        let json = serde_json::json!({
            "id": "a", "method": "POST", "url": "http://h/", "headers": headers, "body": body
        });
        webproxy_protocol::parse_request(
            json.to_string().as_bytes(),
            &webproxy_protocol::Subjects::new("webproxy").expect("prefix"),
            None,
        )
        .expect("valid")
    }

    fn compiled() -> Outbound {
        let limits = "[outbound]\nmax_request_bytes = 10\nmax_headers = 2\nmax_header_bytes = 20";
        settings_from(limits)
            .expect("valid config")
            .cluster
            .outbound
    }

    #[test]
    fn request_limits_name_the_limit() {
        assert!(check_request(&request(&[("A", "1")], "0123456789"), &compiled()).is_ok());
        let e = check_request(&request(&[], "0123456789x"), &compiled()).expect_err("body");
        assert_eq!(e.code, webproxy_protocol::ErrorCode::InvalidRequest);
        assert!(
            e.message.contains("max_request_bytes = 10"),
            "{}",
            e.message
        );
        let e = check_request(
            &request(&[("A", "1"), ("B", "2"), ("C", "3")], ""),
            &compiled(),
        )
        .expect_err("count");
        assert!(e.message.contains("max_headers = 2"), "{}", e.message);
        // 9 + 12 = 21 bytes of names and values.
        let e = check_request(&request(&[("X-Long-Na", "123456789012")], ""), &compiled())
            .expect_err("bytes");
        assert!(e.message.contains("max_header_bytes = 20"), "{}", e.message);
        assert!(check_request(&request(&[("X-Long-Na", "12345678901")], ""), &compiled()).is_ok());
    }

    const T0: Duration = Duration::from_secs(1_800_000_000);

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + T0 + Duration::from_millis(ms)
    }

    #[test]
    fn expiry_by_deadline_and_queue_timeout() {
        assert!(expiry(at(0), None, None).is_none());
        assert!(expiry(at(0), Some(at(1)), None).is_none());
        let late = expiry(at(2), Some(at(1)), None).expect("expired");
        assert_eq!(late.code, ErrorCode::Expired);
        assert!(
            late.message.contains("passed 1ms before"),
            "{}",
            late.message
        );
        // Decades late reads in years, not in milliseconds.
        let ancient = expiry(at(0), Some(SystemTime::UNIX_EPOCH), None).expect("expired");
        assert!(
            ancient.message.contains("passed 57years"),
            "{}",
            ancient.message
        );
        let secs = Duration::from_secs;
        assert!(expiry(at(0), None, Some((secs(29), secs(30)))).is_none());
        let waited = expiry(at(0), None, Some((secs(31), secs(30)))).expect("expired");
        assert!(
            waited
                .message
                .contains("waited 31s in the pool's queue, longer than its queue_timeout of 30s"),
            "{}",
            waited.message
        );
    }
}
