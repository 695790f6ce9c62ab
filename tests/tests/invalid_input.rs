//! Bad input end to end: every invalid envelope gets an `invalid_request` reply naming
//! the field (when it can be answered) and a dead letter; nothing is redelivered, and
//! the service keeps serving.

use futures::StreamExt as _;
use serde_json::json;
use webproxy_client::new_id;
use webproxy_protocol::{ErrorCode, Outcome, Reply, header};
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, accept_rule, envelope, next_message};
use webproxy_tests::wait_until;

/// `(what breaks, the field the reply must name, the envelope with `ID` and `URL`)`.
const FIELD_CASES: &[(&str, &str, &str)] = &[
    ("missing method", "method", r#"{"id":"ID","url":"URL"}"#),
    (
        "unknown method",
        "method",
        r#"{"id":"ID","method":"BREW","url":"URL"}"#,
    ),
    ("missing url", "url", r#"{"id":"ID","method":"GET"}"#),
    (
        "relative url",
        "url",
        r#"{"id":"ID","method":"GET","url":"/echo"}"#,
    ),
    (
        "ftp url",
        "url",
        r#"{"id":"ID","method":"GET","url":"ftp://127.0.0.1/x"}"#,
    ),
    (
        "version as string",
        "v",
        r#"{"v":"1","id":"ID","method":"GET","url":"URL"}"#,
    ),
    (
        "version 2",
        "v",
        r#"{"v":2,"id":"ID","method":"GET","url":"URL"}"#,
    ),
    (
        "header of a number",
        "headers",
        r#"{"id":"ID","method":"GET","url":"URL","headers":{"X":1}}"#,
    ),
    (
        "both bodies",
        "body",
        r#"{"id":"ID","method":"POST","url":"URL","body":"a","body_base64":"YQ=="}"#,
    ),
    (
        "bad base64",
        "body_base64",
        r#"{"id":"ID","method":"POST","url":"URL","body_base64":"%%%"}"#,
    ),
    (
        "wildcard reply_to",
        "reply_to",
        r#"{"id":"ID","method":"GET","url":"URL","reply_to":"app.*"}"#,
    ),
    (
        "reserved reply_to",
        "reply_to",
        r#"{"id":"ID","method":"GET","url":"URL","reply_to":"webproxy.request.default"}"#,
    ),
    (
        "system reply_to",
        "reply_to",
        r#"{"id":"ID","method":"GET","url":"URL","reply_to":"$JS.API.STREAM.DELETE.WEBPROXY_REPLIES"}"#,
    ),
    (
        "negative timeout",
        "timeout_ms",
        r#"{"id":"ID","method":"GET","url":"URL","timeout_ms":-1}"#,
    ),
    (
        "bad deadline",
        "deadline",
        r#"{"id":"ID","method":"GET","url":"URL","deadline":"tomorrow"}"#,
    ),
    (
        "huge metadata",
        "metadata",
        r#"{"id":"ID","method":"GET","url":"URL","metadata":"BIG"}"#,
    ),
];

#[tokio::test]
async fn invalid_envelopes_are_answered_dead_lettered_and_not_redelivered() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let nats = h.js.client();
    let url = h.upstream.url("/echo");
    let big = "m".repeat(64 * 1024 + 1);
    let mut expected_letters = 0;

    // Answerable: a valid id, one bad field.
    for (what, field, template) in FIELD_CASES {
        let id = new_id();
        let payload = template
            .replace("ID", &id)
            .replace("URL", &url)
            .replace("\"BIG\"", &format!("\"{big}\""));
        let mut replies = nats
            .subscribe(format!("webproxy.reply.{id}"))
            .await
            .expect("subscribe");
        h.publish_raw("default", &id, payload).await;
        let message = tokio::time::timeout(REPLY_TIMEOUT, replies.next())
            .await
            .unwrap_or_else(|_| panic!("{what}: no reply\n{}", h.service.logs()))
            .expect("reply");
        let reply: Reply = serde_json::from_slice(&message.payload).expect("reply json");
        assert_eq!(reply.outcome, Outcome::Error, "{what}");
        let error = reply.error.expect("error");
        assert_eq!(error.code, ErrorCode::InvalidRequest, "{what}");
        assert!(
            error.message.contains(&format!("`{field}`")),
            "{what}: message {:?} does not name {field}",
            error.message
        );
        assert_eq!(reply.attempts, 0, "{what}");
        assert_eq!(
            message
                .headers
                .as_ref()
                .and_then(|hd| hd.get(header::OUTCOME))
                .map(|v| v.as_str()),
            Some("error")
        );
        expected_letters += 1;
    }

    // An id that cannot name a reply subject: answered on a valid reply_to only.
    let mut custom = nats
        .subscribe("_INBOX.app.bad-id")
        .await
        .expect("subscribe");
    h.publish_raw(
        "default",
        &new_id(),
        json!({"id": "not a token", "method": "GET", "url": url, "reply_to": "_INBOX.app.bad-id"})
            .to_string(),
    )
    .await;
    let message = next_message(&mut custom, REPLY_TIMEOUT, "reply on reply_to").await;
    let reply: Reply = serde_json::from_slice(&message.payload).expect("reply json");
    assert_eq!(reply.id, "not a token");
    let error = reply.error.expect("error");
    assert_eq!(error.code, ErrorCode::InvalidRequest);
    assert!(error.message.contains("`id`"), "{}", error.message);
    expected_letters += 1;
    h.publish_raw("default", &new_id(), r#"{"id": 42, "method": "GET"}"#)
        .await;
    expected_letters += 1;

    // Undecodable: no reply possible, dead-lettered with the raw payload.
    let undecodable: [&[u8]; 4] = [
        b"not json",
        b"[1, 2, 3]",
        b"\"just a string\"",
        &[0xff, 0xfe, 0x00],
    ];
    for payload in undecodable {
        h.publish_raw("default", &new_id(), payload.to_vec()).await;
        expected_letters += 1;
    }

    let letters = h.wait_dead_letters(expected_letters).await;
    assert_eq!(letters.len(), expected_letters);
    for (headers, letter) in &letters {
        assert_eq!(letter.error.code, ErrorCode::InvalidRequest);
        assert_eq!(letter.pool, "default");
        assert_eq!(
            headers.get(header::ERROR_CODE).map(|v| v.as_str()),
            Some("invalid_request")
        );
        assert!(letter.envelope.is_some() || letter.payload_base64.is_some());
    }
    let raw: Vec<_> = letters
        .iter()
        .filter_map(|(_, l)| l.payload_base64.clone())
        .collect();
    assert!(raw.contains(&"//4A".to_string()), "{raw:?}");
    assert_eq!(raw.len(), undecodable.len());

    // Nothing is left pending or waiting for redelivery.
    wait_until(REPLY_TIMEOUT, "the pool consumer to be empty", || async {
        let info = h.pool_consumer("default").await;
        info.num_ack_pending == 0 && info.num_pending == 0
    })
    .await;
    let info = h.pool_consumer("default").await;
    assert_eq!(info.num_redelivered, 0, "{info:?}");

    // The service still serves.
    let reply = h.request(&envelope("GET", &url)).await;
    assert_eq!(reply.status, Some(200));
}
