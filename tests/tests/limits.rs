//! Request and response limits and dropped headers, end to end: what the upstream
//! receives, and the replies over-limit requests and responses get.

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use axum::routing::get;
use serde_json::Value;
use webproxy_protocol::{ErrorCode, HeaderValue as Hv, Outcome, Reply};
use webproxy_tests::caller::{Harness, accept_rule, envelope};
use webproxy_tests::{Upstream, default_routes};

fn echo_of(reply: &Reply) -> Value {
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    serde_json::from_str(reply.body.body.as_deref().expect("text body")).expect("echo json")
}

/// `n` headers `x-h0: v` ... on `/headers/{n}`, and `x-big` of `n` bytes on `/big-header/{n}`.
async fn upstream() -> Upstream {
    Upstream::start_with(
        default_routes()
            .route(
                "/headers/{n}",
                get(
                    |axum::extract::Path(n): axum::extract::Path<usize>| async move {
                        let mut headers = HeaderMap::new();
                        for i in 0..n {
                            if let Ok(name) = HeaderName::try_from(format!("x-h{i}")) {
                                headers.insert(name, HeaderValue::from_static("v"));
                            }
                        }
                        (headers, "headers")
                    },
                ),
            )
            .route(
                "/big-header/{n}",
                get(
                    |axum::extract::Path(n): axum::extract::Path<usize>| async move {
                        let mut headers = HeaderMap::new();
                        if let Ok(value) = HeaderValue::try_from("v".repeat(n)) {
                            headers.insert("x-big", value);
                        }
                        (headers, "big")
                    },
                ),
            ),
    )
    .await
}

const LIMITS: &str =
    "[outbound]\nmax_request_bytes = 100\nmax_headers = 10\nmax_header_bytes = 300\n";

#[tokio::test]
async fn over_limit_requests_are_invalid_and_never_sent() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        format!("{LIMITS}\n{}", accept_rule("local", up))
    })
    .await;
    let url = h.upstream.url("/echo");

    let mut within = envelope("POST", &url);
    within.body = Some("b".repeat(100));
    assert_eq!(h.request(&within).await.status, Some(200));

    let mut body = envelope("POST", &url);
    body.body = Some("b".repeat(101));
    let mut count = envelope("GET", &url);
    for i in 0..11 {
        count.headers.insert(format!("X-N{i}"), Hv::One("1".into()));
    }
    let mut bytes = envelope("GET", &url);
    bytes
        .headers
        .insert("X-Long".into(), Hv::One("v".repeat(300)));
    for (request, limit) in [
        (body, "max_request_bytes = 100"),
        (count, "max_headers = 10"),
        (bytes, "max_header_bytes = 300"),
    ] {
        let reply = h.request(&request).await;
        let error = reply.error.expect("error reply");
        assert_eq!(error.code, ErrorCode::InvalidRequest, "{limit}");
        assert!(error.message.contains(limit), "{limit}: {}", error.message);
        assert_eq!(reply.attempts, 0);
    }
    assert_eq!(h.upstream.hits(), 1, "an over-limit request was sent");
}

#[tokio::test]
async fn over_limit_responses_are_response_too_large() {
    let h = Harness::start_with_upstream(upstream().await, |up| {
        format!("{LIMITS}\n{}", accept_rule("local", up))
    })
    .await;
    // axum adds content-length and date to the route's own headers.
    let ok = h
        .request(&envelope("GET", &h.upstream.url("/headers/5")))
        .await;
    assert_eq!(ok.status, Some(200), "{ok:?}");
    for (path, limit) in [
        ("/headers/40", "max_headers"),
        ("/big-header/400", "max_header_bytes"),
    ] {
        let reply = h.request(&envelope("GET", &h.upstream.url(path))).await;
        let error = reply.error.expect("error reply");
        assert_eq!(error.code, ErrorCode::ResponseTooLarge, "{path}: {error:?}");
        assert!(error.message.contains(limit), "{path}: {}", error.message);
        assert_eq!(reply.attempts, 1);
    }
}

#[tokio::test]
async fn denied_request_headers_are_dropped() {
    let h = Harness::start(|up| {
        format!(
            "{}deny_request_headers = [\"X-Rule-Secret\"]\n",
            accept_rule("local", up)
        )
    })
    .await;
    let mut request = envelope("GET", &h.upstream.url("/echo"));
    for (name, value) in [
        ("Proxy-Authorization", "Basic cHJveHk6cHc="),
        ("X-Forwarded-Host", "admin.internal"),
        ("X-HTTP-Method-Override", "DELETE"),
        ("x-rule-secret", "nope"),
        ("X-Kept", "yes"),
    ] {
        request.headers.insert(name.into(), Hv::One(value.into()));
    }
    let echo = echo_of(&h.request(&request).await);
    let seen = echo["headers"].as_object().expect("headers");
    for dropped in [
        "proxy-authorization",
        "x-forwarded-host",
        "x-http-method-override",
        "x-rule-secret",
    ] {
        assert!(!seen.contains_key(dropped), "{dropped} was sent: {seen:?}");
    }
    assert_eq!(echo["headers"]["x-kept"], serde_json::json!(["yes"]));
    assert_eq!(echo["method"], "GET");
}
