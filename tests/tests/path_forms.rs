//! Issue 30's point 3 end to end: path forms that the rules and an upstream read
//! differently never reach the upstream. Tomcat, Jetty and Spring drop a `;` path
//! parameter and read `..;` as `..`, so under a deny rule on `/raw/target/admin/` and
//! an accept rule on `/raw/target/`, `/raw/target/admin;jsessionid=x/users` and
//! `/raw/target/public/..;/admin/users` would be `/raw/target/admin/users` upstream
//! (the class of CVE-2020-1957). Each is `invalid_request`: in an envelope, on a
//! redirect hop, and through the gateway (400). A rule may let `;` through with
//! `allow_path_parameters = true`, never a `.;` or `..;` segment.

use std::collections::HashMap;

use axum::extract::{Path, Query};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::any;
use webproxy_protocol::{ErrorCode, Outcome, Reply};
use webproxy_tests::caller::{Harness, envelope, path_rule};
use webproxy_tests::{Gateway, Upstream};

/// Every path answers 200 `reached` (so anything that got through shows), and
/// `/to/{code}?url=...` answers `code` with `Location: url`.
fn upstream_routes() -> axum::Router {
    axum::Router::new()
        .route(
            "/to/{code}",
            any(
                |Path(code): Path<u16>, Query(q): Query<HashMap<String, String>>| async move {
                    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
                    let mut response: Response = (status, "redirecting").into_response();
                    if let Some(Ok(location)) = q.get("url").map(|u| u.parse()) {
                        response.headers_mut().insert("location", location);
                    }
                    response
                },
            ),
        )
        .fallback(|| async { "reached" })
}

/// The rules: a deny rule on `/raw/target/admin/` above an accept rule on
/// `/raw/target/`, and a rule for the redirecting route that follows one redirect.
fn rules(upstream: &Upstream) -> String {
    format!(
        "{}action = \"deny\"\n\n{}\n{}follow_redirects = 1\n",
        path_rule("admin", upstream, "/raw/target/admin/"),
        path_rule("target", upstream, "/raw/target/"),
        path_rule("redirector", upstream, "/to/"),
    )
}

/// The forms the issue names, with their percent-encoded and mixed-case spellings:
/// each would read as `/raw/target/admin/users` on Tomcat or Spring.
const FORMS: &[&str] = &[
    "/raw/target/admin;jsessionid=x/users",
    "/raw/target/admin%3B/users",
    "/raw/target/admin%3bjsessionid=x/users",
    "/raw/target/public/..;/admin/users",
    "/raw/target/public/%2e%2e;/admin/users",
    "/raw/target/public/..%3b/admin/users",
    "/raw/target/public/%2E%2E%3B/admin/users",
    "/raw/target/.;/admin/users",
    "/raw/target/public/..;jsessionid=x/admin/users",
];

/// How many requests reached the upstream on any path but the redirecting one.
fn raw_hits(upstream: &Upstream) -> usize {
    upstream.hits() - upstream.hits_for("/to/302")
}

/// Why `reply` is not `invalid_request` with a message naming the `;` (and, for a
/// redirect hop, the redirect), if it is not.
fn not_refused(reply: &Reply, redirect: bool) -> Option<String> {
    let Some(error) = reply.error.as_ref() else {
        return Some(format!("answered {:?} {:?}", reply.outcome, reply.status));
    };
    let named = error.message.contains("';'") && (!redirect || error.message.contains("redirect"));
    (reply.outcome != Outcome::Error || error.code != ErrorCode::InvalidRequest || !named)
        .then(|| format!("{}: {}", error.code, error.message))
}

/// Every form, sent in an envelope and as a redirect's `Location`, is answered
/// `invalid_request` with a message naming what was wrong, and the upstream sees none
/// of them; a plain path under the accept rule still reaches it, and the deny rule
/// still denies `/raw/target/admin/users`. Every form is tried before the verdict, so
/// a failure lists all that got through.
#[tokio::test]
async fn path_parameters_and_dot_semicolon_segments_never_reach_the_upstream() {
    let h =
        Harness::start_with_upstream(Upstream::start_with(upstream_routes()).await, rules).await;
    let mut wrong = Vec::new();
    for form in FORMS {
        let reply = h.request(&envelope("GET", &h.upstream.url(form))).await;
        if let Some(why) = not_refused(&reply, false) {
            wrong.push(format!("{form}: {why}"));
        }
    }
    for form in FORMS {
        let location = h.upstream.url(form);
        let encoded: String = url::form_urlencoded::byte_serialize(location.as_bytes()).collect();
        let first = h.upstream.url(&format!("/to/302?url={encoded}"));
        let reply = h.request(&envelope("GET", &first)).await;
        if let Some(why) = not_refused(&reply, true) {
            wrong.push(format!("redirect to {form}: {why}"));
        }
    }
    assert!(wrong.is_empty(), "not refused:\n{}", wrong.join("\n"));
    assert_eq!(raw_hits(&h.upstream), 0, "a form reached the upstream");

    let plain = h
        .request(&envelope(
            "GET",
            &h.upstream.url("/raw/target/public/users"),
        ))
        .await;
    assert_eq!(plain.status, Some(200), "{plain:?}");
    let denied = h
        .request(&envelope("GET", &h.upstream.url("/raw/target/admin/users")))
        .await;
    assert_eq!(
        denied.error.map(|e| e.code),
        Some(ErrorCode::Denied),
        "the deny rule still holds"
    );
    assert_eq!(h.upstream.hits_for("/raw/target/admin/users"), 0);
}

/// `allow_path_parameters = true` on an accept rule sends a `;` (raw or `%3B`) as it
/// is, while its `.;` and `..;` segments are still refused; another rule without it
/// still refuses `;`.
#[tokio::test]
async fn allow_path_parameters_lets_a_semicolon_through_but_no_dot_segment() {
    let h = Harness::start_with_upstream(Upstream::start_with(upstream_routes()).await, |up| {
        format!(
            "{}allow_path_parameters = true\n\n{}",
            path_rule("matrix", up, "/raw/matrix/"),
            path_rule("target", up, "/raw/target/"),
        )
    })
    .await;
    for path in ["/raw/matrix/cars;color=red/list", "/raw/matrix/a%3Bb/list"] {
        let reply = h.request(&envelope("GET", &h.upstream.url(path))).await;
        assert_eq!(reply.status, Some(200), "{path}: {reply:?}");
        assert_eq!(h.upstream.hits_for(path), 1, "{path} sent as it is");
    }
    for path in [
        "/raw/matrix/x/..;/admin",
        "/raw/matrix/x/.;/admin",
        "/raw/matrix/x/%2e%2e%3b/admin",
        "/raw/target/cars;color=red/list",
    ] {
        let reply = h.request(&envelope("GET", &h.upstream.url(path))).await;
        assert_eq!(not_refused(&reply, false), None, "{path}");
        assert_eq!(h.upstream.hits_for(path), 0, "{path}");
    }
}

/// The same forms through the gateway: routes `/pub` (to `/raw/target/public`) and
/// `/t` (to `/raw/target`) answer each with 400 and send nothing upstream, written by
/// hand on a TCP connection so that no client library rewrites them.
#[tokio::test]
async fn the_gateway_answers_400_and_sends_no_form_upstream() {
    let h =
        Harness::start_with_upstream(Upstream::start_with(upstream_routes()).await, rules).await;
    let gateway = Gateway::start(
        &h.nats,
        &format!(
            "[[gateway.routes]]\npath = \"/pub\"\nupstream = \"{}\"\n\n\
             [[gateway.routes]]\npath = \"/t\"\nupstream = \"{}\"\n",
            h.upstream.url("/raw/target/public"),
            h.upstream.url("/raw/target"),
        ),
    )
    .await;
    let forms = [
        "/pub/..;/admin/users",
        "/pub/%2e%2e;/admin/users",
        "/pub/..%3B/admin/users",
        "/t/.;/admin/users",
        "/t/admin;jsessionid=x/users",
        "/t/admin%3B/users",
        "/t/admin%3bx/users",
    ];
    let mut wrong = Vec::new();
    for path in forms {
        let answer = gateway.raw_get(path).await;
        if !answer.starts_with("HTTP/1.1 400") {
            wrong.push(format!(
                "{path}: {}",
                answer.lines().next().unwrap_or_default()
            ));
        }
    }
    assert!(wrong.is_empty(), "not 400:\n{}", wrong.join("\n"));
    assert_eq!(
        h.upstream.hits(),
        0,
        "nothing reached the upstream: {}",
        gateway.logs()
    );
    let plain = gateway.raw_get("/pub/users").await;
    assert!(plain.starts_with("HTTP/1.1 200"), "{plain}");
    assert!(plain.ends_with("reached"), "{plain}");
}
