//! `webproxy-client` against a live service: the calls every caller makes (request,
//! submit, reply), the outcomes it must tell apart, the stored-reply fallback when
//! the live reply cannot arrive, and conversations that share an envelope id: each
//! gets its own reply, live and stored, also after a reconnect.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::Duration;

use async_nats::HeaderMap;
use serde_json::{Value, json};
use webproxy_client::{Client, Error, ErrorCode, Origin, Outcome, Request, new_id, new_msg_id};
use webproxy_protocol::header;
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, accept_rule, stored_reply};
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
    let submitted = h.client.submit(&request).await.expect("submit");
    assert_eq!(submitted.id, request.envelope().id);
    assert_eq!(submitted.origin.stream, "WEBPROXY_POOL_DEFAULT");
    let stored = stored_reply(&h.client, &submitted.id, &submitted.origin, REPLY_TIMEOUT).await;
    assert_eq!(stored.id, submitted.id);
    assert_eq!(stored.outcome, Outcome::Response);
    assert_eq!(stored.body.body.as_deref(), Some("multi"));
    let message = h
        .client
        .reply_message(&submitted.id, &submitted.origin)
        .await
        .expect("lookup")
        .expect("stored");
    assert_eq!(
        message.subject.as_str(),
        h.client
            .subjects()
            .stored_reply(&submitted.id, &submitted.origin)
    );
    assert_eq!(
        origin_of(Some(&message.headers)),
        Some(submitted.origin.clone())
    );

    // Neither another id nor another origin finds it.
    let none = h
        .client
        .reply(&new_id(), &submitted.origin)
        .await
        .expect("lookup");
    assert!(none.is_none(), "{none:?}");
    let next = Origin::new(submitted.origin.stream.clone(), submitted.origin.seq + 1);
    let none = h.client.reply(&submitted.id, &next).await.expect("lookup");
    assert!(none.is_none(), "{none:?}");
}

/// A caller that submitted, lost its process and publishes the very same message
/// again (the same `Nats-Msg-Id`, within the duplicate window): the publish is a
/// duplicate of the same conversation, no live reply will ever come, and the answer
/// is that conversation's stored one, at once rather than when the wait runs out.
#[tokio::test]
async fn publishing_the_same_message_again_returns_its_stored_reply() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let first = Request::new("GET", h.upstream.url("/echo")).msg_id(new_msg_id().expect("id"));
    let submitted = h.client.submit(&first).await.expect("submit");
    stored_reply(&h.client, &submitted.id, &submitted.origin, REPLY_TIMEOUT).await;

    let again = first.wait(LONG_WAIT);
    let answer = tokio::time::timeout(REPLY_TIMEOUT, h.client.request_answer(&again))
        .await
        .expect("the stored reply at once, not after the wait")
        .expect("reply");
    assert_eq!(answer.origin, submitted.origin);
    assert_eq!(answer.reply.id, submitted.id);
    assert_eq!(answer.reply.status, Some(200));
    assert_eq!(
        h.upstream.hits_for("/echo"),
        1,
        "the duplicate was sent again"
    );
}

/// The query string the upstream's `/echo` saw, which tells conversations apart.
fn echoed_query(reply: &webproxy_client::Reply) -> String {
    let echo: Value =
        serde_json::from_str(reply.body.body.as_deref().expect("text body")).expect("echo json");
    echo["query"].as_str().expect("query").to_string()
}

fn origin_of(headers: Option<&HeaderMap>) -> Option<Origin> {
    headers?.get(header::ORIGIN)?.as_str().parse().ok()
}

/// Anyone may reuse an envelope id: two conversations with the same id, one after the
/// other, are two publishes with their own random `Nats-Msg-Id`s, two origins and two
/// replies, and each caller gets its own, live and stored.
#[tokio::test]
async fn two_conversations_with_one_id_each_get_their_own_reply() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let id = new_id();
    let mut answers = Vec::new();
    for n in 1..=2 {
        let request = Request::new("GET", h.upstream.url(&format!("/echo?n={n}")))
            .id(id.clone())
            .wait(REPLY_TIMEOUT);
        let answer = h
            .client
            .request_answer(&request)
            .await
            .unwrap_or_else(|e| panic!("conversation {n}: {e}\n{}", h.service.logs()));
        assert_eq!(answer.reply.id, id);
        assert_eq!(echoed_query(&answer.reply), format!("n={n}"), "{n}");
        answers.push(answer);
    }
    assert_ne!(answers[0].origin, answers[1].origin);
    assert_eq!(h.upstream.hits_for("/echo"), 2);
    for (n, answer) in answers.iter().enumerate() {
        let stored = h
            .client
            .reply(&id, &answer.origin)
            .await
            .expect("lookup")
            .expect("stored");
        assert_eq!(echoed_query(&stored), format!("n={}", n + 1));
    }
}

/// A live reply on the id's subject that names another origin (a conversation that
/// reused the id, or a forgery) or no origin is not this conversation's.
#[tokio::test]
async fn a_live_reply_with_another_origin_is_ignored() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let client = h.client.clone();
    let request = Request::new("GET", h.upstream.url("/delay/1500")).wait(LONG_WAIT);
    let id = request.envelope().id.clone();
    let in_flight = tokio::spawn(async move { client.request_answer(&request).await });
    wait_until(REPLY_TIMEOUT, "the upstream call", || async {
        h.upstream.hits_for("/delay/1500") == 1
    })
    .await;
    let fake = serde_json::to_vec(&json!({
        "v": 1, "id": id, "outcome": "response", "status": 418, "headers": {},
        "body": "forged", "attempts": 1, "duration_ms": 1
    }))
    .expect("json");
    let nats = h.client.nats();
    for origin in [Some("WEBPROXY_POOL_DEFAULT:1"), None] {
        let mut headers = HeaderMap::new();
        headers.insert(header::OUTCOME, "response");
        if let Some(origin) = origin {
            headers.insert(header::ORIGIN, origin);
        }
        nats.publish_with_headers(format!("webproxy.reply.{id}"), headers, fake.clone().into())
            .await
            .expect("publish the forged reply");
    }
    nats.flush().await.expect("flush");

    let answer = tokio::time::timeout(REPLY_TIMEOUT, in_flight)
        .await
        .expect("the real reply in time")
        .expect("request task")
        .expect("reply");
    assert_eq!(answer.reply.status, Some(200), "{:?}", answer.reply);
    assert_eq!(answer.reply.body.body.as_deref(), Some("ok"));
    assert_ne!(answer.origin.seq, 1);
}

/// The default pool's replies stream's message count: one per stored reply.
async fn stored_replies(h: &Harness) -> u64 {
    let replies = h
        .subjects
        .pool_replies_stream(&h.subjects.pool_stream("default"));
    let mut stream = h.js.get_stream(replies).await.expect("replies stream");
    stream.info().await.expect("info").state.messages
}

/// The caller's connection drops while its request is in flight, and the reply is
/// published while it is away: the live subscription never sees it. Meanwhile another
/// conversation reuses the id and is answered, so the newest stored reply for the id is
/// not this caller's. Once reconnected, the client reads exactly its own stored
/// subject, and gets its own reply.
#[tokio::test]
async fn reply_missed_while_disconnected_is_read_from_its_own_stored_subject() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let relay = Relay::start(SocketAddr::from((Ipv4Addr::LOCALHOST, h.nats.port()))).await;
    let nats = async_nats::connect(relay.nats_url())
        .await
        .expect("connect through the relay");
    let client = Client::new(nats, "webproxy").expect("client");

    let request = Request::new("GET", h.upstream.url("/delay/1500")).wait(LONG_WAIT);
    let id = request.envelope().id.clone();
    let in_flight = tokio::spawn(async move { client.request_answer(&request).await });
    wait_until(REPLY_TIMEOUT, "the upstream call", || async {
        h.upstream.hits_for("/delay/1500") == 1
    })
    .await;
    relay.cut();
    wait_until(REPLY_TIMEOUT, "the reply stored while cut off", || async {
        stored_replies(&h).await == 1
    })
    .await;
    let other = Request::new("GET", h.upstream.url("/echo?other"))
        .id(id.clone())
        .wait(REPLY_TIMEOUT);
    let other = h.client.request_answer(&other).await.expect("other reply");
    assert_eq!(stored_replies(&h).await, 2);
    assert!(!in_flight.is_finished(), "a reply arrived while cut off");
    relay.heal();

    let answer = tokio::time::timeout(REPLY_TIMEOUT, in_flight)
        .await
        .expect("the stored reply soon after reconnecting, not after the wait")
        .expect("request task")
        .expect("reply");
    assert_eq!(answer.reply.id, id);
    assert_eq!(answer.reply.body.body.as_deref(), Some("ok"));
    assert_ne!(answer.origin, other.origin);
    assert_eq!(echoed_query(&other.reply), "other");
}

#[tokio::test]
async fn no_reply_within_the_wait_is_a_timeout() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let request =
        Request::new("GET", h.upstream.url("/delay/5000")).wait(Duration::from_millis(300));
    let result = h.client.request(&request).await;
    let Err(Error::Timeout { id, origin, .. }) = &result else {
        panic!("{result:?}");
    };
    assert_eq!(*id, request.envelope().id);
    // The request was stored: its reply can be read later under its origin.
    let stored = wait_for(REPLY_TIMEOUT, "the stored reply", || async {
        h.client.reply(id, origin).await.expect("lookup")
    })
    .await;
    assert_eq!(stored.body.body.as_deref(), Some("ok"));
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
    let bad_reply_to = Request::new("GET", h.upstream.url("/echo")).reply_to("app.>");
    let result = h.client.request(&bad_reply_to).await;
    assert!(
        matches!(result, Err(Error::InvalidReplyTo { .. })),
        "{result:?}"
    );
    let bad_msg_id = Request::new("GET", h.upstream.url("/echo")).msg_id("a b");
    let result = h.client.submit(&bad_msg_id).await;
    assert!(matches!(result, Err(Error::InvalidMsgId(_))), "{result:?}");
    assert_eq!(h.upstream.hits(), 0);
}
