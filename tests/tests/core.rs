//! The core request path end to end: a real nats-server, the real `webproxy serve`
//! binary and a real HTTP upstream. Every reply is read the way a caller reads it.

use std::time::Duration;

use serde_json::{Value, json};
use webproxy_client::{Error as ClientError, Request};
use webproxy_protocol::{ErrorCode, HeaderValue, Outcome, Reply, header};
use webproxy_tests::caller::{
    Harness, REPLY_TIMEOUT, accept_rule, envelope, next_message, stored_reply,
};
use webproxy_tests::{NatsServer, Service, http_client, wait_until};

fn echo_of(reply: &Reply) -> Value {
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    serde_json::from_str(reply.body.body.as_deref().expect("text body")).expect("echo json")
}

#[tokio::test]
async fn get_post_put_round_trips_with_headers() {
    let h = Harness::start(|up| accept_rule("local", up)).await;

    let mut get = envelope("get", &h.upstream.url("/echo?q=1"));
    get.headers
        .insert("X-Single".into(), HeaderValue::One("one".into()));
    get.headers.insert(
        "X-Multi".into(),
        HeaderValue::Many(vec!["a".into(), "b".into()]),
    );
    let reply = h.request(&get).await;
    assert_eq!(reply.id, get.id);
    assert_eq!(reply.status, Some(200));
    assert_eq!(reply.attempts, 1);
    let echo = echo_of(&reply);
    assert_eq!(echo["method"], "GET");
    assert_eq!(echo["query"], "q=1");
    assert_eq!(echo["headers"]["x-single"], json!(["one"]));
    assert_eq!(echo["headers"]["x-multi"], json!(["a", "b"]));

    for method in ["POST", "PUT"] {
        let mut request = envelope(method, &h.upstream.url("/echo"));
        request.body = Some(format!("{{\"method\": \"{method}\"}}"));
        request.headers.insert(
            "Content-Type".into(),
            HeaderValue::One("application/json".into()),
        );
        let echo = echo_of(&h.request(&request).await);
        assert_eq!(echo["method"], method);
        assert_eq!(echo["body"], format!("{{\"method\": \"{method}\"}}"));
        assert_eq!(echo["headers"]["content-type"], json!(["application/json"]));
    }

    let multi = h.request(&envelope("GET", &h.upstream.url("/multi"))).await;
    let headers = multi.headers.expect("response headers");
    assert_eq!(
        headers["x-multi"],
        HeaderValue::Many(vec!["a".into(), "b".into()])
    );
    assert_eq!(headers["x-single"], HeaderValue::One("one".into()));
    assert_eq!(multi.body.body.as_deref(), Some("multi"));
}

#[tokio::test]
async fn utf8_and_binary_bodies_both_ways() {
    let h = Harness::start(|up| accept_rule("local", up)).await;

    let mut text = envelope("POST", &h.upstream.url("/echo"));
    text.body = Some("grüße, 世界".into());
    let echo = echo_of(&h.request(&text).await);
    assert_eq!(echo["body"], "grüße, 世界");

    let mut binary = envelope("POST", &h.upstream.url("/echo"));
    binary.body_base64 = Some("AAH//g==".into()); // 00 01 ff fe
    let echo = echo_of(&h.request(&binary).await);
    assert_eq!(echo["body_len"], 4);

    let reply = h
        .request(&envelope("GET", &h.upstream.url("/binary")))
        .await;
    assert_eq!(reply.body.body, None);
    assert_eq!(reply.body.body_base64.as_deref(), Some("AAEC//4="));
    assert_eq!(
        reply.body.decode().expect("base64"),
        vec![0, 1, 2, 255, 254]
    );

    let head = h
        .request(&envelope("HEAD", &h.upstream.url("/multi")))
        .await;
    assert_eq!(head.body.body.as_deref(), Some(""));
}

#[tokio::test]
async fn metadata_is_echoed_verbatim() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let id = webproxy_client::new_id();
    // Raw JSON with an order and spacing a re-serialisation would change.
    let payload = format!(
        r#"{{"id":"{id}","method":"GET","url":"{}","metadata":{{"z": 1, "a": [true, null], "n": 1.50}}}}"#,
        h.upstream.url("/echo")
    );
    let mut replies =
        h.js.client()
            .subscribe(format!("webproxy.reply.{id}"))
            .await
            .expect("subscribe");
    h.publish_raw("default", &id, payload).await;
    let message = next_message(&mut replies, REPLY_TIMEOUT, "reply in time").await;
    let text = std::str::from_utf8(&message.payload).expect("utf8");
    assert!(
        text.contains(r#""metadata":{"z": 1, "a": [true, null], "n": 1.50}"#),
        "{text}"
    );
}

#[tokio::test]
async fn reply_is_stored_with_outcome_header_and_copied_to_reply_to() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let mut request = envelope("GET", &h.upstream.url("/echo"));
    request.reply_to = Some(format!("_INBOX.app.replies.{}", request.id));
    let mut copies =
        h.js.client()
            .subscribe(format!("_INBOX.app.replies.{}", request.id))
            .await
            .expect("subscribe");
    let answer = h.request_answer(&request).await;
    assert_eq!(answer.reply.status, Some(200));

    let copy = next_message(&mut copies, REPLY_TIMEOUT, "copy in time").await;
    let copied: Reply = serde_json::from_slice(&copy.payload).expect("reply json");
    assert_eq!(copied.id, request.id);
    let headers = copy.headers.expect("headers");
    assert_eq!(
        headers.get(header::OUTCOME).map(|v| v.as_str()),
        Some("response")
    );
    assert_eq!(
        headers.get(header::GENERATION).map(|v| v.as_str()),
        Some("0")
    );

    // A live subscriber can see the reply a moment before the stream has stored it.
    let stored = stored_reply(
        &h.client,
        &request.id,
        &answer.origin,
        Duration::from_secs(10),
    )
    .await;
    assert_eq!(stored.id, request.id);
    assert_eq!(stored.status, Some(200));
    let stream =
        h.js.get_stream("WEBPROXY_POOL_DEFAULT_REPLIES")
            .await
            .expect("replies stream");
    // Stored on the conversation's own subject, under an id made of its origin; the
    // live subject stores nothing.
    let origin = &answer.origin;
    let raw = stream
        .get_last_raw_message_by_subject(&format!(
            "webproxy.reply.{}.{}.{}",
            request.id, origin.stream, origin.seq
        ))
        .await
        .expect("stored message");
    assert_eq!(
        raw.headers.get(header::OUTCOME).map(|v| v.as_str()),
        Some("response")
    );
    assert_eq!(
        raw.headers.get(header::ORIGIN).map(|v| v.as_str()),
        Some(origin.to_string().as_str())
    );
    assert_eq!(
        raw.headers.get(header::MSG_ID).map(|v| v.as_str()),
        Some(format!("{origin}:0:reply").as_str())
    );
    assert_eq!(
        raw.headers.get(header::REPLY_TO).map(|v| v.as_str()),
        request.reply_to.as_deref()
    );
    assert!(
        stream
            .get_last_raw_message_by_subject(&format!("webproxy.reply.{}", request.id))
            .await
            .is_err(),
        "the live copy is not stored"
    );
}

#[tokio::test]
async fn everything_is_denied_without_rules() {
    let h = Harness::start(|_| String::new()).await;
    let reply = h.request(&envelope("GET", &h.upstream.url("/echo"))).await;
    assert_eq!(reply.outcome, Outcome::Error);
    let error = reply.error.expect("error");
    assert_eq!(error.code, ErrorCode::Denied);
    assert!(
        error.message.contains("no request rule accepts GET"),
        "{}",
        error.message
    );
    assert_eq!(reply.attempts, 0);
    assert_eq!(h.upstream.hits(), 0);
    let letters = h.wait_dead_letters(1).await;
    assert_eq!(letters[0].1.error.code, ErrorCode::Denied);
    assert_eq!(
        letters[0].0.get(header::ERROR_CODE).map(|v| v.as_str()),
        Some("denied")
    );
}

#[tokio::test]
async fn explicit_deny_rule_wins_for_what_it_matches() {
    let h = Harness::start(|up| {
        format!(
            "[[request_rules]]\nname = \"no-admin\"\nurl_pattern = '/admin'\naction = \"deny\"\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    let denied = h
        .request(&envelope("GET", &h.upstream.url("/admin/echo")))
        .await;
    let error = denied.error.expect("denied");
    assert_eq!(error.code, ErrorCode::Denied);
    assert!(error.message.contains("no-admin"), "{}", error.message);
    let allowed = h.request(&envelope("GET", &h.upstream.url("/echo"))).await;
    assert_eq!(allowed.status, Some(200));
    assert_eq!(h.upstream.hits_for("/admin/echo"), 0);
}

/// The first rule whose method and pattern match decides, deny or accept: a deny on
/// `/admin/` above a POST accept for everything holds for POST too (before, the
/// method-specific accept won and `POST /admin/users/42/delete` was sent), and an
/// exception to the deny is written above it.
#[tokio::test]
async fn rules_match_in_file_order_deny_before_accept() {
    let h = Harness::start(|up| {
        let base = regex_escape_url(&up.url("/"));
        format!(
            "[[request_rules]]\nname = \"echo-exception\"\nmethod = \"GET\"\nurl_pattern = '^{base}admin/echo$'\n\
             [[request_rules]]\nname = \"no-admin\"\nurl_pattern = '^{base}admin/'\naction = \"deny\"\n\
             [[request_rules]]\nname = \"post-ok\"\nmethod = \"POST\"\nurl_pattern = '^{base}'\n"
        )
    })
    .await;
    let delete = h
        .request(&envelope("POST", &h.upstream.url("/admin/users/42/delete")))
        .await;
    let error = delete.error.expect("denied");
    assert_eq!(error.code, ErrorCode::Denied);
    assert!(error.message.contains("\"no-admin\""), "{}", error.message);
    let post = h.request(&envelope("POST", &h.upstream.url("/echo"))).await;
    assert_eq!(post.status, Some(200), "{post:?}");
    // The exception above the deny: GET only, exactly that path.
    let exception = h
        .request(&envelope("GET", &h.upstream.url("/admin/echo")))
        .await;
    // The upstream has no such route: its 404 shows the request reached it.
    assert_eq!(exception.outcome, Outcome::Response, "{exception:?}");
    let not_excepted = h
        .request(&envelope("POST", &h.upstream.url("/admin/echo")))
        .await;
    assert_eq!(not_excepted.error.map(|e| e.code), Some(ErrorCode::Denied));
    assert_eq!(h.upstream.hits_for("/admin/users/42/delete"), 0);
    assert_eq!(h.upstream.hits_for("/admin/echo"), 1);
}

/// The URL matched is the URL sent: unreserved escapes are decoded before matching
/// (so `/%61dmin/` meets the deny on `/admin/`) and sent decoded; forms an upstream
/// may read differently from the matcher, and user information, are refused.
#[tokio::test]
async fn urls_are_canonical_before_matching_and_sending() {
    let h = Harness::start(|up| {
        let base = regex_escape_url(&up.url("/"));
        format!(
            "[[request_rules]]\nname = \"no-admin\"\nurl_pattern = '^{base}admin/'\naction = \"deny\"\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    let escaped = h
        .request(&envelope("GET", &h.upstream.url("/%61dmin/echo")))
        .await;
    let error = escaped.error.expect("denied");
    assert_eq!(error.code, ErrorCode::Denied, "{error:?}");
    assert!(error.message.contains("/admin/echo"), "{}", error.message);

    let decoded = h
        .request(&envelope("GET", &h.upstream.url("/%65cho")))
        .await;
    assert_eq!(echo_of(&decoded)["path"], "/echo");

    let port = h.upstream.addr().port();
    for (url, why) in [
        (h.upstream.url("//admin/echo"), "empty path segment"),
        (h.upstream.url("/x/..//admin/echo"), "empty path segment"),
        (h.upstream.url("/x%2F..%2Fadmin/echo"), "%2F"),
        (
            format!("http://u:p@127.0.0.1:{port}/echo"),
            "user information",
        ),
        (
            format!("http://token@127.0.0.1:{port}/echo"),
            "user information",
        ),
        (format!("http://localhost.:{port}/echo"), "ends with a dot"),
    ] {
        let reply = h.request(&envelope("GET", &url)).await;
        let error = reply.error.unwrap_or_else(|| panic!("{url} was sent"));
        assert_eq!(error.code, ErrorCode::InvalidRequest, "{url}: {error:?}");
        assert!(error.message.contains(why), "{url}: {}", error.message);
        assert_eq!(reply.attempts, 0);
    }
    assert_eq!(h.upstream.hits(), 1, "only the decoded /echo was sent");
}

fn regex_escape_url(url: &str) -> String {
    url.replace('.', "\\.")
}

#[tokio::test]
async fn publish_to_unknown_pool_fails() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let request = Request::from(envelope("GET", &h.upstream.url("/echo"))).pool("nope");
    let result = h.client.submit(&request).await;
    assert!(
        matches!(result, Err(ClientError::NoSuchPool { ref pool, .. }) if pool == "nope"),
        "{result:?}"
    );
}

#[tokio::test]
async fn health_endpoints_read_state_only() {
    let mut nats = NatsServer::start();
    let service = Service::start(&nats, "").await;
    let http = http_client();
    let status = |path: &'static str| {
        let http = http.clone();
        let url = format!("{}{path}", service.health_url());
        async move { http.get(url).send().await.map(|r| r.status().as_u16()).ok() }
    };
    assert_eq!(status("/healthz").await, Some(200));
    assert_eq!(status("/readyz").await, Some(200));

    nats.kill();
    wait_until(
        Duration::from_secs(20),
        "readyz 503 without NATS",
        || async { status("/readyz").await == Some(503) },
    )
    .await;
    assert_eq!(status("/healthz").await, Some(200));

    nats.restart();
    wait_until(
        Duration::from_secs(30),
        "readyz 200 after reconnect",
        || async { status("/readyz").await == Some(200) },
    )
    .await;
}
