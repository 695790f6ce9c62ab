//! Redirects end to end: none followed by default, a rule's budget for the whole
//! chain, method and body per status, every hop matched against the rules and the
//! address guard again, and injected credentials only where the hop's own rule puts
//! them. Upstreams listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 only.

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};

use axum::extract::{Path, Query};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use serde_json::Value;
use webproxy_protocol::{ErrorCode, HeaderValue as Hv, Outcome, Reply};
use webproxy_tests::caller::{Harness, envelope};
use webproxy_tests::{ServiceOptions, Upstream, default_routes};

/// `/to/{code}?url=...` answers `code` with `Location: url`.
fn redirecting() -> axum::Router {
    default_routes().route(
        "/to/{code}",
        any(
            |Path(code): Path<u16>, Query(q): Query<std::collections::HashMap<String, String>>| async move {
                let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
                let mut response: Response = (status, "redirecting").into_response();
                if let Some(Ok(location)) = q.get("url").map(|u| u.parse()) {
                    response.headers_mut().insert("location", location);
                }
                response
            },
        ),
    )
}

fn to(upstream: &Upstream, code: u16, target: &str) -> String {
    let encoded: String = url::form_urlencoded::byte_serialize(target.as_bytes()).collect();
    upstream.url(&format!("/to/{code}?url={encoded}"))
}

fn echo_of(reply: &Reply) -> Value {
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    serde_json::from_str(reply.body.body.as_deref().expect("text body")).expect("echo json")
}

/// Binds an injecting rule to a loopback upstream's origin (plain http).
fn origin_of(upstream: &Upstream) -> String {
    format!("origin = \"http://{}\"\nallow_http = true", upstream.addr())
}

fn rule(name: &str, upstream: &Upstream, extra: &str) -> String {
    format!(
        "[[request_rules]]\nname = \"{name}\"\nurl_pattern = '^{}'\n{extra}\n",
        upstream.url("/").replace('.', "\\.")
    )
}

#[tokio::test]
async fn redirects_are_not_followed_by_default() {
    let h = Harness::start_with_upstream(Upstream::start_with(redirecting()).await, |up| {
        rule("local", up, "")
    })
    .await;
    let target = h.upstream.url("/echo");
    let reply = h
        .request(&envelope("GET", &to(&h.upstream, 302, &target)))
        .await;
    assert_eq!(reply.status, Some(302));
    assert_eq!(h.upstream.hits_for("/echo"), 0);
}

#[tokio::test]
async fn methods_bodies_and_the_budget() {
    let h = Harness::start_with_upstream(Upstream::start_with(redirecting()).await, |up| {
        rule("local", up, "follow_redirects = 2")
    })
    .await;
    let echo = h.upstream.url("/echo");

    for (code, method, body) in [
        (301, "GET", ""),
        (302, "GET", ""),
        (303, "GET", ""),
        (307, "POST", "payload"),
        (308, "POST", "payload"),
    ] {
        let mut request = envelope("POST", &to(&h.upstream, code, &echo));
        request.body = Some("payload".into());
        request
            .headers
            .insert("Content-Type".into(), Hv::One("text/plain".into()));
        let reply = h.request(&request).await;
        let seen = echo_of(&reply);
        assert_eq!(seen["method"], method, "{code}");
        assert_eq!(seen["body"], body, "{code}");
        assert_eq!(
            seen["headers"].get("content-type").is_some(),
            !body.is_empty(),
            "{code}: {seen}"
        );
        assert_eq!(reply.attempts, 1, "a chain is one attempt");
    }

    // Two redirects are followed; the third 3xx comes back as the response.
    let three = to(
        &h.upstream,
        302,
        &to(&h.upstream, 302, &to(&h.upstream, 302, &echo)),
    );
    let before = h.upstream.hits_for("/echo");
    let reply = h.request(&envelope("GET", &three)).await;
    assert_eq!(reply.status, Some(302), "{reply:?}");
    assert_eq!(h.upstream.hits_for("/echo"), before);
    let two = to(&h.upstream, 302, &to(&h.upstream, 302, &echo));
    assert_eq!(h.request(&envelope("GET", &two)).await.status, Some(200));
}

/// A loopback upstream on `ip`, on `port`.
async fn upstream_at(ip: &str, port: u16) -> Upstream {
    let ip: IpAddr = ip.parse().expect("ip");
    Upstream::start_on(SocketAddr::new(ip, port), redirecting()).await
}

#[tokio::test]
async fn every_hop_is_matched_and_guarded_again() {
    // 127.0.0.2 is opened with allow_cidrs; the rest of 127/8 stays denied.
    let allowed = Upstream::start_on("127.0.0.2:0".parse().expect("addr"), redirecting()).await;
    let port = allowed.addr().port();
    let denied = upstream_at("127.0.0.1", port).await;
    let unruled = upstream_at("127.0.0.3", port).await;
    let h = Harness::start_with_options(allowed, ServiceOptions::guarded(), |up| {
        format!(
            "[outbound]\nallow_cidrs = [\"127.0.0.2/32\", \"127.0.0.3/32\"]\n\n{}\
             [[request_rules]]\nname = \"to-denied\"\nurl_pattern = '^http://127\\.0\\.0\\.1:'\n",
            rule("allowed", up, "follow_redirects = 5")
        )
    })
    .await;

    // Redirected to a loopback address the guard denies: the rule accepts it, the
    // guard does not.
    let reply = h
        .request(&envelope(
            "GET",
            &to(&h.upstream, 302, &denied.url("/echo")),
        ))
        .await;
    let error = reply.error.as_ref().expect("denied");
    assert_eq!(error.code, ErrorCode::Denied, "{error:?}");
    assert_eq!(error.message, "destination not allowed (loopback)");
    assert_eq!(reply.attempts, 1, "the first hop was an attempt");

    // The same through the decimal spelling of 127.0.0.1.
    let decimal = format!("http://2130706433:{port}/echo");
    let reply = h
        .request(&envelope("GET", &to(&h.upstream, 307, &decimal)))
        .await;
    assert_eq!(reply.error.map(|e| e.code), Some(ErrorCode::Denied));

    // Redirected to an address the guard allows but no rule accepts.
    let reply = h
        .request(&envelope(
            "GET",
            &to(&h.upstream, 302, &unruled.url("/echo")),
        ))
        .await;
    let error = reply.error.expect("denied");
    assert_eq!(error.code, ErrorCode::Denied);
    assert!(
        error
            .message
            .contains("no request rule accepts GET http://127.0.0.3"),
        "{}",
        error.message
    );

    // Redirected off http(s).
    let reply = h
        .request(&envelope(
            "GET",
            &to(&h.upstream, 302, "file:///etc/passwd"),
        ))
        .await;
    assert_eq!(reply.error.map(|e| e.code), Some(ErrorCode::Denied));

    assert_eq!(denied.hits(), 0, "a redirect reached a denied address");
    assert_eq!(
        unruled.hits(),
        0,
        "a redirect reached an address no rule accepts"
    );
}

/// What `/who` saw: the authorization, x-api-key and cookie headers, per upstream.
type Seen = Arc<Mutex<Vec<(String, Vec<String>)>>>;

fn recording(seen: Seen, name: &'static str) -> axum::Router {
    redirecting().route(
        "/who",
        any(move |headers: HeaderMap| {
            let seen = seen.clone();
            async move {
                let mut values = Vec::new();
                for header in ["authorization", "x-api-key", "cookie"] {
                    for value in headers.get_all(header) {
                        values.push(format!(
                            "{header}: {}",
                            String::from_utf8_lossy(value.as_bytes())
                        ));
                    }
                }
                seen.lock().expect("lock").push((name.to_string(), values));
                "seen"
            }
        }),
    )
}

/// Two recording upstreams on the same port of two loopback addresses: one origin
/// each, which only the host tells apart.
async fn two_origins_on_one_port() -> (Seen, Upstream, Upstream) {
    let seen: Seen = Arc::default();
    let first = Upstream::start_on(
        "127.0.0.2:0".parse().expect("addr"),
        recording(seen.clone(), "first"),
    )
    .await;
    let port = first.addr().port();
    let other = Upstream::start_on(
        SocketAddr::new("127.0.0.3".parse().expect("ip"), port),
        recording(seen.clone(), "other"),
    )
    .await;
    (seen, first, other)
}

#[tokio::test]
async fn injected_credentials_stay_with_their_rule_and_origin() {
    let (seen, first, other) = two_origins_on_one_port().await;
    let other_url = other.url("/who");
    let options = ServiceOptions::guarded().env("PARTNER_KEY", "k-123");
    let h = Harness::start_with_options(first, options, |up| {
        format!(
            "[outbound]\nallow_cidrs = [\"127.0.0.2/32\", \"127.0.0.3/32\"]\n\n{}\
             [request_rules.inject_headers]\nX-Api-Key = {{ env = \"PARTNER_KEY\" }}\n\n{}",
            rule(
                "partner",
                up,
                &format!("follow_redirects = 3\n{}", origin_of(up))
            ),
            rule("other", &other, ""),
        )
    })
    .await;
    let with_caller_credentials = |url: String| {
        let mut request = envelope("GET", &url);
        request
            .headers
            .insert("Authorization".into(), Hv::One("Bearer caller".into()));
        request
            .headers
            .insert("Cookie".into(), Hv::One("session=caller".into()));
        request
    };

    // Same origin, same rule: the key and the caller's credentials go along.
    let same = to(&h.upstream, 302, &h.upstream.url("/who"));
    assert_eq!(
        h.request(&with_caller_credentials(same)).await.status,
        Some(200)
    );
    // Another origin under a rule that injects nothing: neither goes along.
    let cross = to(&h.upstream, 307, &other_url);
    assert_eq!(
        h.request(&with_caller_credentials(cross)).await.status,
        Some(200)
    );

    let seen = seen.lock().expect("lock").clone();
    assert_eq!(
        seen,
        vec![
            (
                "first".to_string(),
                vec![
                    "authorization: Bearer caller".to_string(),
                    "x-api-key: k-123".to_string(),
                    "cookie: session=caller".to_string(),
                ]
            ),
            ("other".to_string(), Vec::new()),
        ]
    );
}

/// A redirect hop that the injecting rule's pattern matches but whose origin is not
/// the rule's is denied: it is neither sent with the credential nor without it.
#[tokio::test]
async fn a_hop_outside_the_injecting_rules_origin_is_denied() {
    let (_seen, first, other) = two_origins_on_one_port().await;
    let port = first.addr().port();
    let options = ServiceOptions::default().env("PARTNER_KEY", "k-123");
    let h = Harness::start_with_options(first, options, |up| {
        // Loose on purpose: the pattern matches both loopback upstreams.
        format!(
            "[[request_rules]]\nname = \"partner\"\nurl_pattern = '^http://127\\.0\\.0\\.'\nfollow_redirects = 2\n{}\n\
             [request_rules.inject_headers]\nX-Api-Key = {{ env = \"PARTNER_KEY\" }}\n",
            origin_of(up)
        )
    })
    .await;
    let reply = h
        .request(&envelope("GET", &to(&h.upstream, 307, &other.url("/who"))))
        .await;
    let error = reply.error.expect("denied");
    assert_eq!(error.code, ErrorCode::Denied, "{error:?}");
    assert!(
        error
            .message
            .contains(&format!("bound to origin http://127.0.0.2:{port}")),
        "{}",
        error.message
    );
    assert_eq!(reply.attempts, 1, "the first hop was an attempt");
    assert_eq!(other.hits(), 0, "a hop left the injecting rule's origin");
}

/// A redirect to a URL webproxy would refuse from a caller is refused the same way:
/// user information, an empty path segment or an encoded `/` end the chain with
/// `invalid_request`.
#[tokio::test]
async fn a_redirect_to_an_invalid_url_is_invalid_request() {
    let h = Harness::start_with_upstream(Upstream::start_with(redirecting()).await, |up| {
        rule("local", up, "follow_redirects = 2")
    })
    .await;
    let port = h.upstream.addr().port();
    for (target, why) in [
        (
            format!("http://u:secret@127.0.0.1:{port}/echo"),
            "user information",
        ),
        (
            format!("http://u@127.0.0.1:{port}/echo"),
            "user information",
        ),
        (h.upstream.url("//echo"), "empty path segment"),
        (h.upstream.url("/x%2Fecho"), "%2F"),
    ] {
        let reply = h
            .request(&envelope("GET", &to(&h.upstream, 302, &target)))
            .await;
        let error = reply
            .error
            .unwrap_or_else(|| panic!("{target} was followed"));
        assert_eq!(error.code, ErrorCode::InvalidRequest, "{target}: {error:?}");
        assert!(error.message.contains(why), "{target}: {}", error.message);
        assert!(!error.message.contains("secret"), "{}", error.message);
        assert_eq!(reply.attempts, 1, "the first hop was an attempt");
    }
    assert_eq!(h.upstream.hits_for("/echo"), 0);
}
