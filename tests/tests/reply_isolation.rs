//! Reply isolation with the example server config in deploy/nats: two callers each
//! publish requests and receive their replies under their own prefix, and neither can
//! read the other's replies or the stored replies.

use std::time::Duration;

use futures::StreamExt as _;
use webproxy_client::{Client, Error, Request};
use webproxy_protocol::Reply;
use webproxy_tests::authorized::{SERVICE_USER, connect_as, password, service_as, violation};
use webproxy_tests::caller::{REPLY_TIMEOUT, accept_rule, envelope, to};
use webproxy_tests::{NatsServer, Service, Upstream, run_webproxy, wait_for};

/// A client publishing as caller `name`, which the file's permissions require of
/// `caller_<name>`.
fn caller(nats: &async_nats::Client, name: &str) -> Client {
    Client::new(nats.clone(), "webproxy")
        .expect("client")
        .with_caller(name)
        .expect("caller name")
}

/// An upstream, and the service as the file's service user, giving each caller its
/// own reply space: `reply_to_allow = ["callers.{caller}.replies.>"]`.
async fn isolating_service(nats: &NatsServer) -> (Upstream, Service) {
    let upstream = Upstream::start().await;
    let config = format!(
        "[streams]\nreply_to_allow = [\"callers.{{caller}}.replies.>\"]\n\n{}",
        accept_rule("local", &upstream)
    );
    let service = Service::start_with(&nats.url(), &config, service_as(SERVICE_USER)).await;
    (upstream, service)
}

/// Waits until the service logs that conversation `id` finished `invalid_request`.
async fn refused(service: &Service, id: &str) {
    wait_for(
        REPLY_TIMEOUT,
        "the refused conversation to finish",
        || async {
            service
                .logs()
                .lines()
                .any(|line| {
                    line.contains(id)
                        && line.contains("conversation finished")
                        && line.contains("invalid_request")
                })
                .then_some(())
        },
    )
    .await;
}

#[tokio::test]
async fn callers_cannot_read_each_others_replies() {
    let nats = NatsServer::start_authorized();
    let upstream = Upstream::start().await;
    let options = service_as(SERVICE_USER);
    let config = format!(
        "[streams]\nreply_to_allow = [\"callers.{{caller}}.replies.>\"]\n\n{}",
        accept_rule("local", &upstream)
    );
    let service = Service::start_with(&nats.url(), &config, options).await;

    let (a, mut a_errors) = connect_as(&nats, "caller_a", Some("callers.a._INBOX")).await;
    let (b, _) = connect_as(&nats, "caller_b", Some("callers.b._INBOX")).await;

    // A tries to listen to B's replies and to the stored replies: both refused.
    let mut a_snoops_b = a.subscribe("callers.b.replies.>").await.expect("subscribe");
    violation(&mut a_errors, "callers.b.replies.>", REPLY_TIMEOUT).await;
    let mut a_snoops_stored = a.subscribe("webproxy.reply.>").await.expect("subscribe");
    violation(&mut a_errors, "webproxy.reply.>", REPLY_TIMEOUT).await;
    // ...and to read a pool's replies stream, or the shared one of layout 2, through
    // the JetStream API.
    for get in [
        "$JS.API.STREAM.MSG.GET.WEBPROXY_POOL_DEFAULT_REPLIES",
        "$JS.API.STREAM.MSG.GET.WEBPROXY_REPLIES",
    ] {
        a.publish(get, "{}".into()).await.expect("publish");
        violation(&mut a_errors, get, REPLY_TIMEOUT).await;
    }

    // Each caller gets its own reply under its own prefix.
    let mut replies = Vec::new();
    for (client, name, prefix) in [(&a, "a", "callers.a"), (&b, "b", "callers.b")] {
        let mut request = envelope("GET", &upstream.url("/echo"));
        let subject = format!("{prefix}.replies.{}", request.id);
        request.reply_to = Some(subject.clone());
        let mut inbox = client.subscribe(subject).await.expect("subscribe");
        caller(client, name)
            .submit(&to("default", &request))
            .await
            .unwrap_or_else(|e| panic!("{prefix}: submit: {e}\n{}", service.logs()));
        let message = tokio::time::timeout(REPLY_TIMEOUT, inbox.next())
            .await
            .unwrap_or_else(|_| panic!("{prefix}: no reply\n{}", service.logs()))
            .expect("reply");
        let reply: Reply = serde_json::from_slice(&message.payload).expect("reply json");
        assert_eq!(reply.id, request.id);
        assert_eq!(reply.status, Some(200), "{prefix}: {reply:?}");
        replies.push(reply);
    }

    // Everything the server routed to A before this round trip has arrived by now.
    a.flush().await.expect("flush");
    let leaked =
        |sub: &mut async_nats::Subscriber| futures::FutureExt::now_or_never(sub.next()).flatten();
    assert!(leaked(&mut a_snoops_b).is_none(), "A received B's reply");
    assert!(
        leaked(&mut a_snoops_stored).is_none(),
        "A received a stored reply"
    );

    // The service's own permissions are enough to ack what it handled: nothing is
    // left pending for redelivery. They give it its private inbox prefix only.
    let (webproxy, _) = connect_as(&nats, SERVICE_USER, Some("_WEBPROXY_INBOX.test")).await;
    let js = async_nats::jetstream::new(webproxy);
    wait_for(REPLY_TIMEOUT, "every request to be acked", || {
        let js = js.clone();
        async move {
            let stream = js.get_stream_no_info("WEBPROXY_POOL_DEFAULT").await.ok()?;
            let info = stream.consumer_info("webproxy-default-l3").await.ok()?;
            // Two deliveries: pool streams start at a first sequence of Unix
            // microseconds, so the stream sequence says nothing about the count.
            (info.num_ack_pending == 0 && info.delivered.consumer_sequence == 2).then_some(())
        }
    })
    .await;

    // A reply_to in A's space but outside the allowed patterns is refused: the
    // conversation ends with invalid_request and no copy goes there.
    let mut other = a.subscribe("callers.a.other.>").await.expect("subscribe");
    let mut outside = envelope("GET", &upstream.url("/echo"));
    outside.reply_to = Some("callers.a.other.1".into());
    caller(&a, "a")
        .submit(&to("default", &outside))
        .await
        .expect("submitted");
    refused(&service, &outside.id).await;
    a.flush().await.expect("flush");
    assert!(
        leaked(&mut other).is_none(),
        "a reply_to outside reply_to_allow got a copy"
    );
}

/// Under the example permissions the service may subscribe only to its private inbox
/// prefix, not to the `_INBOX.>` callers share; and no caller can aim a `reply_to`
/// at that prefix or at any `$` subject: such a conversation ends `invalid_request`
/// and nothing is published there.
#[tokio::test]
async fn the_service_inbox_and_server_subjects_are_out_of_callers_reach() {
    let nats = NatsServer::start_authorized();
    let upstream = Upstream::start().await;
    let options = service_as(SERVICE_USER);
    let service = Service::start_with(&nats.url(), &accept_rule("local", &upstream), options).await;

    // The service's user may not listen on the inboxes callers share.
    let (as_service, mut reported) =
        connect_as(&nats, SERVICE_USER, Some("_WEBPROXY_INBOX.probe")).await;
    let _shared = as_service.subscribe("_INBOX.>").await.expect("subscribe");
    violation(&mut reported, "_INBOX.>", REPLY_TIMEOUT).await;

    // Caller A aims its reply_to at the service's inbox and at server subjects.
    let (a, _) = connect_as(&nats, "caller_a", Some("callers.a._INBOX")).await;
    let client = caller(&a, "a");
    for subject in [
        "_WEBPROXY_INBOX.guess.1",
        "$O.bucket.x",
        "$MQTT.sess.x",
        "$SRV.PING",
    ] {
        let mut request = envelope("GET", &upstream.url("/echo"));
        request.reply_to = Some(subject.to_string());
        client
            .submit(&to("default", &request))
            .await
            .unwrap_or_else(|e| panic!("{subject}: submit: {e}\n{}", service.logs()));
        refused(&service, &request.id).await;
    }
    assert_eq!(upstream.hits(), 0, "a refused conversation was attempted");
}

/// The Rust client of an isolated caller: with a `reply_to` in its own space it
/// listens there only and never reads the replies stream, which its permissions
/// forbid. A reply arrives; a request that outlives its wait times out naming its
/// `reply_to` rather than failing on a refused lookup; and the server reports no
/// permission violation (a subscription to webproxy.reply.<id> or a stored-reply
/// lookup would be one).
#[tokio::test]
async fn an_isolated_callers_client_listens_on_its_reply_to_only() {
    let nats = NatsServer::start_authorized();
    let (upstream, service) = isolating_service(&nats).await;
    let (a, mut a_errors) = connect_as(&nats, "caller_a", Some("callers.a._INBOX")).await;
    let client = caller(&a, "a");
    let own_reply_to = |request: Request| {
        let subject = format!("callers.a.replies.{}", request.envelope().id);
        request.reply_to(subject)
    };

    let request = own_reply_to(Request::new("GET", upstream.url("/echo")).wait(REPLY_TIMEOUT));
    let answer = client
        .request_answer(&request)
        .await
        .unwrap_or_else(|e| panic!("request: {e}\n{}", service.logs()));
    assert_eq!(answer.reply.id, request.envelope().id);
    assert_eq!(answer.reply.status, Some(200), "{:?}", answer.reply);

    let slow = own_reply_to(
        Request::new("GET", upstream.url("/delay/3000")).wait(Duration::from_millis(300)),
    );
    let result = client.request(&slow).await;
    let Err(Error::Timeout {
        reply_to: Some(reply_to),
        ..
    }) = &result
    else {
        panic!("{result:?}\n{}", service.logs());
    };
    assert_eq!(Some(reply_to), slow.envelope().reply_to.as_ref());

    // The server has answered everything A sent once a flush returns; a violation it
    // reported reaches the event callback shortly after.
    a.flush().await.expect("flush");
    let reported = tokio::time::timeout(Duration::from_millis(500), a_errors.recv()).await;
    assert!(reported.is_err(), "the server reported {reported:?}");
    // The control: what the client must not do is reported on this connection.
    let live = format!("webproxy.reply.{}", request.envelope().id);
    let _refused = a.subscribe(live.clone()).await.expect("subscribe");
    violation(&mut a_errors, &live, REPLY_TIMEOUT).await;
}

/// Issue 30's attack 7: caller a names caller b's reply subject as its `reply_to`. With
/// `reply_to_allow = ["callers.{caller}.replies.>"]` and each caller publishing only
/// under its own name, the service refuses it (`invalid_request`) and nothing reaches
/// b's space; a cannot publish under b's name or under none. a's own reply space still
/// gets its copy, also after a rule moves the request into another pool (the caller's
/// name travels with the hop).
#[tokio::test]
async fn a_caller_cannot_place_a_message_in_another_callers_reply_space() {
    let nats = NatsServer::start_authorized();
    let upstream = Upstream::start().await;
    let config = format!(
        "[streams]\nreply_to_allow = [\"callers.{{caller}}.replies.>\"]\n\n[pools.moved]\n\n{}pool = \"moved\"\n",
        accept_rule("local", &upstream)
    );
    let service = Service::start_with(&nats.url(), &config, service_as(SERVICE_USER)).await;
    let (a, mut a_errors) = connect_as(&nats, "caller_a", Some("callers.a._INBOX")).await;
    let (b, _) = connect_as(&nats, "caller_b", Some("callers.b._INBOX")).await;
    let mut b_space = b.subscribe("callers.b.replies.>").await.expect("subscribe");
    b.flush().await.expect("flush");

    let mut aimed = envelope("GET", &upstream.url("/echo"));
    aimed.reply_to = Some(format!("callers.b.replies.{}", aimed.id));
    caller(&a, "a")
        .submit(&to("default", &aimed))
        .await
        .unwrap_or_else(|e| panic!("submit: {e}\n{}", service.logs()));
    refused(&service, &aimed.id).await;
    assert_eq!(
        upstream.hits_for("/echo"),
        0,
        "the refused request was sent"
    );

    // a under b's name, and under no name: refused by the server.
    let payload = serde_json::to_vec(&aimed).expect("json");
    for subject in ["webproxy.request.default.b", "webproxy.request.default"] {
        a.publish(subject, payload.clone().into())
            .await
            .expect("publish");
        violation(&mut a_errors, subject, REPLY_TIMEOUT).await;
    }

    // a's own space, through a move into another pool: a copy arrives.
    let mut own = envelope("GET", &upstream.url("/echo"));
    let own_subject = format!("callers.a.replies.{}", own.id);
    own.reply_to = Some(own_subject.clone());
    let mut inbox = a.subscribe(own_subject).await.expect("subscribe");
    caller(&a, "a")
        .submit(&to("default", &own))
        .await
        .expect("submitted");
    let message = tokio::time::timeout(REPLY_TIMEOUT, inbox.next())
        .await
        .unwrap_or_else(|_| panic!("no copy in a's own space\n{}", service.logs()))
        .expect("reply");
    let reply: Reply = serde_json::from_slice(&message.payload).expect("reply json");
    assert_eq!(reply.status, Some(200), "{reply:?}");

    b.flush().await.expect("flush");
    assert!(
        futures::FutureExt::now_or_never(b_space.next())
            .flatten()
            .is_none(),
        "a placed a message in b's reply space"
    );
}

/// `webproxy send` works as an isolated caller: as `caller_a`, with its inbox under
/// `callers.a._INBOX`, publishing as caller `a` and listening on its own `reply_to`
/// only, which is all the example permissions allow it.
#[tokio::test]
async fn send_works_as_an_isolated_caller() {
    let nats = NatsServer::start_authorized();
    let (upstream, service) = isolating_service(&nats).await;

    let url = nats.url();
    let password = password("caller_a");
    let target = upstream.url("/echo?marker=sent-as-caller-a");
    let reply_to = format!("callers.a.replies.{}", webproxy_client::new_id());
    let args = [
        "send",
        "--nats",
        &url,
        "--user",
        "caller_a",
        "--password",
        &password,
        "--inbox-prefix",
        "callers.a._INBOX",
        "--caller",
        "a",
        "--reply-to",
        &reply_to,
        "--timeout",
        "20s",
        "GET",
        &target,
    ];
    // Bounded beyond send's own --timeout, so a hung process fails the test.
    let output = tokio::time::timeout(Duration::from_secs(40), run_webproxy(&args))
        .await
        .unwrap_or_else(|_| panic!("webproxy send hung\n{}", service.logs()));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "send as caller_a failed: {}\nstdout: {stdout}\n{}",
        String::from_utf8_lossy(&output.stderr),
        service.logs()
    );
    assert!(stdout.contains("sent-as-caller-a"), "{stdout}");
}
