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
        cancelled: None,
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

/// `admit` and `target`: which rule a request goes under.
mod rules {
    use std::sync::Arc;

    use webproxy_config::testing::rule_config;
    use webproxy_protocol::{Subjects, parse_request};

    use crate::conversation::plan::*;

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

#[test]
fn a_recorded_cancel_ends_the_delivery_before_anything_else_is_asked() {
    let settings = settings();
    let parsed = parsed(GET_A);
    let cancel = crate::conversation::cancels::cancelled_error(
        Some(crate::conversation::cancels::By::Caller),
        0,
        false,
        false,
    );
    let mut cancelled = input(&settings, &parsed, "default");
    cancelled.cancelled = Some(cancel.clone());
    // Past max_deliver too: the cancel, not poison, answers it.
    cancelled.delivered = 1000;
    assert_eq!(rejected(plan(&cancelled)), cancel);
}
