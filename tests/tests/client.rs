//! `webproxy-client` against a live service: the calls every caller makes (request,
//! submit, reply), the outcomes it must tell apart, and the stored-reply fallback when
//! the live reply cannot arrive.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use serde_json::{Value, json};
use webproxy_client::{Client, Error, ErrorCode, Outcome, Request};
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, accept_rule};
use webproxy_tests::{Relay, free_port, wait_for, wait_until};

/// Longer than any test may take, so that a request that returns at all returned
/// because of the reply, not because its wait ran out.
const LONG_WAIT: Duration = Duration::from_secs(600);

#[tokio::test]
async fn response_carries_status_headers_body_and_metadata() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let request = Request::new("post", h.upstream.url("/echo?q=1"))
        .header("X-Multi", "a")
        .header("X-Multi", "b")
        .body("hello")
        .metadata(json!({"order": 42}))
        .wait(REPLY_TIMEOUT);
    let reply = h.client.request(&request).await.expect("reply");
    assert_eq!(reply.id, request.envelope().id);
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    assert_eq!(reply.status, Some(200));
    assert_eq!(reply.attempts, 1);
    assert!(reply.error.is_none());
    let echo: Value =
        serde_json::from_str(reply.body.body.as_deref().expect("text body")).expect("echo json");
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["query"], "q=1");
    assert_eq!(echo["body"], "hello");
    assert_eq!(echo["headers"]["x-multi"], json!(["a", "b"]));
    assert_eq!(
        reply.metadata.map(|m| m.get().to_string()),
        Some(r#"{"order":42}"#.to_string())
    );
}

#[tokio::test]
async fn denied_request_is_an_error_outcome_not_a_client_error() {
    let h = Harness::start(|_| String::new()).await;
    let request = Request::new("GET", h.upstream.url("/echo")).wait(REPLY_TIMEOUT);
    let reply = h.client.request(&request).await.expect("reply");
    assert_eq!(reply.outcome, Outcome::Error);
    assert_eq!(reply.status, None);
    let error = reply.error.expect("error body");
    assert_eq!(error.code, ErrorCode::Denied);
    assert_eq!(reply.attempts, 0);
    assert_eq!(h.upstream.hits(), 0);
}

#[tokio::test]
async fn refused_connection_is_an_error_outcome_after_one_attempt() {
    let closed = format!("http://127.0.0.1:{}/", free_port());
    let h = Harness::start(|up| {
        format!(
            "[[request_rules]]\nname = \"closed\"\nurl_pattern = '^{}'\nmax_retries = 0\n{}",
            closed.replace('.', "\\."),
            accept_rule("local", up)
        )
    })
    .await;
    let request = Request::new("GET", format!("{closed}nothing")).wait(REPLY_TIMEOUT);
    let reply = h.client.request(&request).await.expect("reply");
    assert_eq!(reply.outcome, Outcome::Error, "{reply:?}");
    let error = reply.error.expect("error body");
    assert_eq!(error.code, ErrorCode::RetriesExhausted, "{error:?}");
    assert!(error.message.contains("connect"), "{}", error.message);
    assert_eq!(reply.attempts, 1);
}

#[tokio::test]
async fn submitted_reply_is_fetched_once_stored() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let request = Request::new("GET", h.upstream.url("/multi"));
    let id = h.client.submit(&request).await.expect("submit");
    assert_eq!(id, request.envelope().id);
    let stored = wait_for(REPLY_TIMEOUT, "the stored reply", || async {
        h.client.reply(&id).await.expect("lookup")
    })
    .await;
    assert_eq!(stored.id, id);
    assert_eq!(stored.outcome, Outcome::Response);
    assert_eq!(stored.body.body.as_deref(), Some("multi"));

    let unknown = Request::new("GET", h.upstream.url("/multi"));
    let none = h
        .client
        .reply(&unknown.envelope().id)
        .await
        .expect("lookup");
    assert!(none.is_none(), "{none:?}");
}

/// A caller that submitted, lost its process and asks again with the same id: the
/// publish is a duplicate, no live reply will ever come, and the answer is the stored
/// one, at once rather than when the wait runs out.
#[tokio::test]
async fn asking_again_for_an_answered_id_returns_the_stored_reply() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let first = Request::new("GET", h.upstream.url("/echo"));
    let id = h.client.submit(&first).await.expect("submit");
    wait_for(REPLY_TIMEOUT, "the stored reply", || async {
        h.client.reply(&id).await.expect("lookup")
    })
    .await;

    let again = Request::new("GET", h.upstream.url("/echo"))
        .id(id.clone())
        .wait(LONG_WAIT);
    let reply = tokio::time::timeout(REPLY_TIMEOUT, h.client.request(&again))
        .await
        .expect("the stored reply at once, not after the wait")
        .expect("reply");
    assert_eq!(reply.id, id);
    assert_eq!(reply.status, Some(200));
    assert_eq!(
        h.upstream.hits_for("/echo"),
        1,
        "the duplicate was sent again"
    );
}

/// The caller's connection drops while its request is in flight and the reply is
/// published while it is away: the live subscription never sees it, and the client
/// reads it from the replies stream once it has reconnected.
#[tokio::test]
async fn reply_missed_while_disconnected_is_read_from_the_stream() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let relay = Relay::start(SocketAddr::from((Ipv4Addr::LOCALHOST, h.nats.port()))).await;
    let nats = async_nats::connect(relay.nats_url())
        .await
        .expect("connect through the relay");
    let client = Client::new(nats, "webproxy").expect("client");

    let request = Request::new("GET", h.upstream.url("/delay/1500")).wait(LONG_WAIT);
    let id = request.envelope().id.clone();
    let in_flight = tokio::spawn(async move { client.request(&request).await });
    wait_until(REPLY_TIMEOUT, "the upstream call", || async {
        h.upstream.hits_for("/delay/1500") == 1
    })
    .await;
    relay.cut();
    wait_for(REPLY_TIMEOUT, "the reply stored while cut off", || async {
        h.client.reply(&id).await.expect("lookup")
    })
    .await;
    assert!(!in_flight.is_finished(), "a reply arrived while cut off");
    relay.heal();

    let reply = tokio::time::timeout(REPLY_TIMEOUT, in_flight)
        .await
        .expect("the stored reply soon after reconnecting, not after the wait")
        .expect("request task")
        .expect("reply");
    assert_eq!(reply.id, id);
    assert_eq!(reply.body.body.as_deref(), Some("ok"));
}

#[tokio::test]
async fn no_reply_within_the_wait_is_a_timeout() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let request =
        Request::new("GET", h.upstream.url("/delay/5000")).wait(Duration::from_millis(300));
    let result = h.client.request(&request).await;
    assert!(
        matches!(&result, Err(Error::Timeout { id, .. }) if *id == request.envelope().id),
        "{result:?}"
    );
}

#[tokio::test]
async fn an_id_that_is_not_one_subject_token_is_refused_before_sending() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    for id in ["a.>", ">", "a b", ""] {
        let request = Request::new("GET", h.upstream.url("/echo")).id(id);
        let result = h.client.request(&request).await;
        assert!(
            matches!(result, Err(Error::InvalidId { .. })),
            "{id:?}: {result:?}"
        );
        let result = h.client.submit(&request).await;
        assert!(
            matches!(result, Err(Error::InvalidId { .. })),
            "{id:?}: {result:?}"
        );
    }
    let bad_pool = Request::new("GET", h.upstream.url("/echo")).pool("a.*");
    let result = h.client.submit(&bad_pool).await;
    assert!(matches!(result, Err(Error::InvalidPool(_))), "{result:?}");
    assert_eq!(h.upstream.hits(), 0);
}
