//! Issue 34, point 1: a request that sets `large_body` (published with a random
//! 128-bit `Nats-Msg-Id`) may get a body above the inline limit. It is streamed from the
//! upstream into the pool's body store, and the reply names it (`body_object`), read
//! here as any Object Store client reads it. A body over `max_large_body`, or one a
//! full store refuses, leaves the store's bytes as they were; a request without the
//! opt-in is answered as before.

use async_nats::jetstream;
use axum::Router;
use axum::body::Body;
use axum::extract::Path;
use axum::routing::get;
use futures::{StreamExt as _, stream};
use webproxy_client::{Request, new_msg_id};
use webproxy_protocol::{
    BodyGetCode, BodyGetRequest, ErrorCode, Origin, Outcome, Reply, RequestEnvelope, Subjects,
    body_header, header,
};
use webproxy_tests::authorized::{Admin, Caller, SERVICE_USER, service_as};
use webproxy_tests::bodies::{
    assert_reads_back, digest_of, origin_of, store_subjects, subjects_of,
};
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, envelope, next_message, path_rule};
use webproxy_tests::{
    Gate, NatsServer, Service, ServiceOptions, Upstream, large_body, large_body_byte, large_routes,
    run_webproxy, wait_for,
};

const MIB: usize = 1024 * 1024;

async fn harness(options: ServiceOptions) -> Harness {
    Harness::start_with_options(Upstream::start_with(large_routes()).await, options, |up| {
        path_rule("large", up, "/large/")
    })
    .await
}

fn large(url: &str) -> RequestEnvelope {
    RequestEnvelope {
        large_body: true,
        ..envelope("GET", url)
    }
}

/// Sends `envelope` with `msg_id` as its `Nats-Msg-Id` and waits for the reply.
async fn send(h: &Harness, envelope: RequestEnvelope, msg_id: &str) -> Reply {
    let request = Request::from_envelope(envelope)
        .msg_id(msg_id)
        .wait(REPLY_TIMEOUT);
    h.client
        .request(&request)
        .await
        .unwrap_or_else(|e| panic!("no reply: {e}\n{}", h.service.logs()))
}

/// The default pool's body store stream, as the server holds it now, if it exists.
async fn store_bytes(js: &jetstream::Context) -> Option<u64> {
    let name = Subjects::object_stream(&bodies_bucket());
    let mut stream = js.get_stream(&name).await.ok()?;
    Some(stream.info().await.expect("info").state.bytes)
}

fn bodies_bucket() -> String {
    Subjects::new("webproxy")
        .expect("prefix")
        .pool_body_bucket("default")
}

/// 5 MiB and 40 MiB arrive whole: the reply names the object, its size and digest, and
/// an Object Store client reads exactly the upstream's bytes, with the SHA-256 of the
/// caller's message id in the object's headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_and_forty_mib_responses_arrive_whole_with_their_digest() {
    let h = harness(ServiceOptions::default()).await;
    let store =
        h.js.clone()
            .get_object_store(bodies_bucket())
            .await
            .err()
            .map(|_| ());
    assert_eq!(store, Some(()), "no body store before the first large body");
    for size in [5 * MIB, 40 * MIB] {
        let msg_id = new_msg_id().expect("msg id");
        let reply = send(
            &h,
            large(&h.upstream.url(&format!("/large/{size}"))),
            &msg_id,
        )
        .await;
        assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
        assert_eq!(reply.status, Some(200));
        assert_eq!(reply.body.body, None);
        assert_eq!(reply.body.body_base64, None);
        let object = reply.body_object.expect("body_object");
        let expected = large_body(size);
        assert_eq!(object.bucket, bodies_bucket());
        assert_eq!(object.size, size as u64);
        assert_eq!(object.digest, digest_of(&expected));

        let store =
            h.js.get_object_store(&object.bucket)
                .await
                .expect("the body store is an Object Store");
        assert_reads_back(&store, &object.name, size).await;
        let info = store.info(&object.name).await.expect("the object's info");
        assert_eq!(info.digest.as_deref(), Some(object.digest.as_str()));
        let kept = info
            .headers
            .as_ref()
            .and_then(|h| h.get(header::MSG_ID_SHA256))
            .map(|v| v.to_string());
        assert_eq!(
            kept,
            Some(webproxy_protocol::hex_sha256(msg_id.as_bytes())),
            "the object keeps the capability's hash"
        );
    }
}

/// With the service's `env` set, a 1 MiB body is stored, then a `size` body is refused
/// with `code` and a message naming `names`, and the store's bytes are as before it:
/// no orphan chunk stays. The harness and the store's bytes.
async fn refused_leaving_the_store_as_it_was(
    env: (&str, &str),
    size: usize,
    code: ErrorCode,
    names: &str,
) -> (Harness, u64) {
    let h = harness(ServiceOptions::default().env(env.0, env.1)).await;
    let fits = send(
        &h,
        large(&h.upstream.url(&format!("/large/{MIB}"))),
        &new_msg_id().expect("msg id"),
    )
    .await;
    assert!(fits.body_object.is_some(), "{fits:?}");
    let before = store_bytes(&h.js).await.expect("the store exists");
    let reply = send(
        &h,
        large(&h.upstream.url(&format!("/large/{size}"))),
        &new_msg_id().expect("msg id"),
    )
    .await;
    let error = reply.error.expect("an error reply");
    assert_eq!(error.code, code, "{error:?}");
    assert!(error.message.contains(names), "{}", error.message);
    assert_eq!(error.status, Some(200));
    assert_eq!(
        store_bytes(&h.js).await,
        Some(before),
        "no orphan chunk stays"
    );
    (h, before)
}

/// A body over `max_large_body` ends `response_too_large`, naming the key, and what
/// was streamed of it is removed: the store's bytes are as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_over_max_large_body_is_too_large_and_leaves_the_store_as_it_was() {
    let limit = (2 * MIB).to_string();
    refused_leaving_the_store_as_it_was(
        ("WEBPROXY_OUTBOUND__MAX_LARGE_BODY", &limit),
        3 * MIB,
        ErrorCode::ResponseTooLarge,
        "max_large_body",
    )
    .await;
}

/// A full store ends the attempt `internal` ("body store full") without blocking the
/// pool: what was stored of the body is removed, and the next body that fits is
/// stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_refuses_a_body_clearly_and_the_pool_goes_on() {
    let bound = (4 * MIB).to_string();
    let (h, before) = refused_leaving_the_store_as_it_was(
        ("WEBPROXY_STREAMS__BODY_MAX_BYTES", &bound),
        6 * MIB,
        ErrorCode::Internal,
        "body store full",
    )
    .await;
    // The gauge shows the store's use, read every 5 s; the wait is bounded.
    let series = "webproxy_body_store_used_ratio{pool=\"default\"}";
    let expected = before as f64 / (4 * MIB) as f64;
    wait_for(REPLY_TIMEOUT, "the body store's gauge", || async {
        h.service
            .metric(series)
            .await
            .filter(|ratio| (ratio - expected).abs() < 1e-6)
    })
    .await;

    let again = send(
        &h,
        large(&h.upstream.url(&format!("/large/{}", MIB))),
        &new_msg_id().expect("msg id"),
    )
    .await;
    assert!(again.body_object.is_some(), "{again:?}");
}

/// Without the opt-in a body above the inline limit is `response_too_large` as before,
/// naming `max_response_bytes`, and no store is made; `large_body` with a guessable
/// message id is `invalid_request`, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_opt_in_or_a_capability_nothing_is_stored() {
    let h = harness(ServiceOptions::default()).await;
    let url = h.upstream.url(&format!("/large/{}", MIB));
    let reply = send(&h, envelope("GET", &url), &new_msg_id().expect("msg id")).await;
    let error = reply.error.expect("an error reply");
    assert_eq!(error.code, ErrorCode::ResponseTooLarge, "{error:?}");
    assert!(
        error.message.contains("max_response_bytes"),
        "{}",
        error.message
    );

    let reply = send(&h, large(&url), "order-42").await;
    let error = reply.error.expect("an error reply");
    assert_eq!(error.code, ErrorCode::InvalidRequest, "{error:?}");
    assert!(error.message.contains("`large_body`"), "{}", error.message);
    assert_eq!(reply.attempts, 0);

    // A small body with the opt-in travels inline, as without it.
    let small = send(
        &h,
        large(&h.upstream.url("/large/1000")),
        &new_msg_id().expect("msg id"),
    )
    .await;
    assert_eq!(small.body_object, None);
    assert_eq!(
        small.body.decode().expect("base64"),
        large_body(1000),
        "{small:?}"
    );
    assert_eq!(store_bytes(&h.js).await, None, "no store was made");
}

/// deploy/nats/authorization.conf as shipped: the service, as its own user, makes the
/// pool's body store and writes a body into it; a caller in the callers' account gets
/// the reply naming it, and webproxy's account reads it as any Object Store client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shipped_permissions_let_the_service_store_a_large_body() {
    let (nats, upstream, service) = isolated_scene(&[]).await;
    let caller = Caller::connect(&nats, "caller_a").await;
    let size = 2 * MIB;
    let msg_id = new_msg_id().expect("msg id");
    let (reply, _, _) = isolated_request(&caller, &upstream, &service, size, &msg_id).await;
    let object = reply
        .body_object
        .clone()
        .unwrap_or_else(|| panic!("a stored body: {reply:?}\n{}", service.logs()));

    let admin = Admin::connect(&nats).await;
    let store = admin
        .js
        .get_object_store(&object.bucket)
        .await
        .expect("the body store");
    assert_reads_back(&store, &object.name, size).await;
}

/// A pod killed while it streams a body into the store: the redelivery, on another
/// instance, first removes what the dead one left, so once it settles the store holds
/// one object, the one its reply names, whole. `ack_wait` is 2 s so the redelivery
/// comes soon; the waits are bounded by [`REPLY_TIMEOUT`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_large_response_leaves_one_object_which_the_reply_names() {
    let size = 6 * MIB;
    let gate = Gate::new();
    let held = gate.clone();
    // `/stalling/{n}`: the first half at once, the rest once the gate opens.
    let routes = Router::new().route(
        "/stalling/{n}",
        get(move |Path(n): Path<usize>| {
            let gate = held.clone();
            async move {
                let half = n / 2;
                let pieces = stream::iter([0usize, 1]).then(move |k| {
                    let gate = gate.clone();
                    async move {
                        if k == 1 {
                            gate.wait().await;
                        }
                        let range = if k == 0 { 0..half } else { half..n };
                        Ok::<_, std::io::Error>(range.map(large_body_byte).collect::<Vec<u8>>())
                    }
                });
                Body::from_stream(pieces)
            }
        }),
    );
    let nats = NatsServer::start();
    let upstream = Upstream::start_with(routes).await;
    let config = format!(
        "[service]\nack_wait = \"2s\"\n\n{}",
        path_rule("stalling", &upstream, "/stalling/")
    );
    let mut first = Service::start(&nats, &config).await;
    let client = webproxy_client::Client::new(nats.client().await, "webproxy").expect("client");
    let request = Request::from_envelope(large(&upstream.url(&format!("/stalling/{size}"))))
        .msg_id(new_msg_id().expect("msg id"))
        .wait(REPLY_TIMEOUT * 2);
    let waiting = tokio::spawn(async move { client.request(&request).await });

    let js = jetstream::new(nats.client().await);
    wait_for(REPLY_TIMEOUT, "half the body stored", || async {
        store_bytes(&js)
            .await
            .filter(|bytes| *bytes >= (size / 2) as u64)
    })
    .await;
    first.kill();
    let second = Service::start(&nats, &config).await;
    gate.open();
    let reply = waiting
        .await
        .expect("the waiting task")
        .unwrap_or_else(|e| panic!("no reply: {e}\n{}", second.logs()));
    let object = reply.body_object.expect("a stored body");
    assert_eq!(object.size, size as u64);
    assert_eq!(upstream.hits_for(&format!("/stalling/{size}")), 2);
    let reply_origin = origin_of(&object).expect("an object name starts with its origin");

    let held = store_subjects(&js, &object.bucket)
        .await
        .expect("the store's subjects");
    let store = js.get_object_store(&object.bucket).await.expect("store");
    let expected = subjects_of(&store, &[(&reply_origin, &object)]).await;
    assert_eq!(
        held, expected,
        "one object's chunks and metadata, nothing else"
    );
    assert_reads_back(&store, &object.name, size).await;
}

/// The capability outlives a dead letter: the letter keeps the message id's SHA-256,
/// and `dead replay` carries it into the replayed conversation, whose stored body asks
/// for the same message id as the caller's first publish did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_conversations_body_keeps_the_callers_message_id() {
    let size = 2 * MIB;
    let failed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // `/flaky/{n}`: 400 the first time, `n` bytes from then on.
    let routes = Router::new().route(
        "/flaky/{n}",
        get(move |Path(n): Path<usize>| {
            let first = !failed.swap(true, std::sync::atomic::Ordering::SeqCst);
            async move {
                if first {
                    (axum::http::StatusCode::BAD_REQUEST, Vec::new())
                } else {
                    (axum::http::StatusCode::OK, large_body(n))
                }
            }
        }),
    );
    let h = Harness::start_with_options(
        Upstream::start_with(routes).await,
        ServiceOptions::default(),
        |up| {
            format!(
                "{}\n[[response_rules]]\nstatus = \"400\"\naction = \"error\"\n",
                path_rule("flaky", up, "/flaky/")
            )
        },
    )
    .await;
    let msg_id = new_msg_id().expect("msg id");
    let kept = webproxy_protocol::hex_sha256(msg_id.as_bytes());
    let envelope = large(&h.upstream.url(&format!("/flaky/{size}")));
    let id = envelope.id.clone();
    let reply = send(&h, envelope, &msg_id).await;
    assert_eq!(reply.error.map(|e| e.code), Some(ErrorCode::UpstreamError));
    let letters = h.wait_dead_letters(1).await;
    assert_eq!(letters[0].1.msg_id_sha256.as_deref(), Some(kept.as_str()));

    let mut replies =
        h.js.client()
            .subscribe(h.subjects.reply(&id))
            .await
            .expect("subscribe");
    h.js.client().flush().await.expect("flush");
    let nats = h.nats.url();
    let replayed = run_webproxy(&["dead", "replay", "--nats", &nats, "--yes"]).await;
    assert!(replayed.status.success(), "{replayed:?}");
    let message = next_message(&mut replies, REPLY_TIMEOUT, "the replay's reply").await;
    let reply: Reply = serde_json::from_slice(&message.payload).expect("reply JSON");
    let object = reply
        .body_object
        .clone()
        .unwrap_or_else(|| panic!("a stored body: {reply:?}"));
    let store = h.js.get_object_store(&object.bucket).await.expect("store");
    let info = store.info(&object.name).await.expect("the named object");
    let hash = info
        .headers
        .as_ref()
        .and_then(|h| h.get(header::MSG_ID_SHA256))
        .map(|v| v.to_string());
    assert_eq!(
        hash,
        Some(kept),
        "the replay's body asks for the first message id"
    );
}

/// Reads a stored body through `<prefix>.body.get` as `client`: the first answer as it
/// comes (the code and payload of one without a chunk), then the whole body as the
/// Rust client reads it, chunk by chunk with its size and digest checked.
async fn body_get(
    client: &async_nats::Client,
    id: &str,
    origin: &str,
    msg_id: &str,
) -> Result<Vec<u8>, (BodyGetCode, bytes::Bytes)> {
    let request = BodyGetRequest {
        id: id.into(),
        origin: origin.into(),
        msg_id: msg_id.into(),
        cursor: None,
    };
    let answer = client
        .request(
            "webproxy.body.get",
            serde_json::to_vec(&request).expect("json").into(),
        )
        .await
        .expect("an answer to body.get");
    if let Some(code) = answer
        .headers
        .as_ref()
        .and_then(|h| h.get(body_header::ERROR))
    {
        let code: BodyGetCode = serde_json::from_value(serde_json::Value::String(code.to_string()))
            .expect("a known code");
        return Err((code, answer.payload));
    }
    let reader = webproxy_client::Client::new(client.clone(), "webproxy").expect("client");
    let origin: Origin = origin.parse().expect("an origin");
    match reader.read_body(id, &origin, msg_id).await {
        Ok(body) => Ok(body),
        // It expired while it was read.
        Err(webproxy_client::Error::Body { code, message }) => {
            let code = serde_json::from_value(serde_json::Value::String(code))
                .unwrap_or_else(|_| panic!("an unknown code: {message}"));
            Err((code, bytes::Bytes::new()))
        }
        Err(e) => panic!("the whole body, checked: {e}"),
    }
}

/// The shipped permissions' scene for `body.get`: the service as its own user, the
/// callers' reply spaces allowed, and the upstream's large routes under a rule whose
/// timeout is 3 s (so a stored body lives `reply_max_age` + 3 s).
async fn isolated_scene(env: &[(&str, &str)]) -> (NatsServer, Upstream, Service) {
    let nats = NatsServer::start_authorized();
    let upstream = Upstream::start_with(large_routes()).await;
    let config = format!(
        "[streams]\nreply_to_allow = [\"callers.{{caller}}.replies.>\"]\n\n{}timeout = \"3s\"\n",
        path_rule("large", &upstream, "/large/")
    );
    let options = env
        .iter()
        .fold(service_as(SERVICE_USER), |options, (name, value)| {
            options.env(name, value)
        });
    let service = Service::start_with(&nats.url(), &config, options).await;
    (nats, upstream, service)
}

/// `caller` asks for `size` bytes with `large_body`, published under `msg_id`, answered
/// in its own reply space: the reply and the conversation's origin.
async fn isolated_request(
    caller: &Caller,
    upstream: &Upstream,
    service: &Service,
    size: usize,
    msg_id: &str,
) -> (Reply, Origin, String) {
    let id = webproxy_client::new_id();
    let envelope = serde_json::json!({
        "id": id,
        "method": "GET",
        "url": upstream.url(&format!("/large/{size}")),
        "reply_to": caller.reply_to(&id),
        "large_body": true,
    });
    let mut inbox = caller
        .nats
        .subscribe(caller.reply_to(&id))
        .await
        .expect("subscribe");
    caller.nats.flush().await.expect("flush");
    let ack = caller
        .publish(
            "default",
            msg_id,
            &async_nats::HeaderMap::new(),
            envelope.to_string(),
        )
        .await;
    let what = format!("the reply\n{}", service.logs());
    let message = next_message(&mut inbox, REPLY_TIMEOUT, &what).await;
    let reply: Reply = serde_json::from_slice(&message.payload).expect("reply JSON");
    (reply, Origin::new(ack.stream.as_str(), ack.sequence), id)
}

/// Point 3: an isolated caller, which may not read the body store, reads its large body
/// through `body.get` with its message id, whole and with its digest. Another caller
/// without that message id gets exactly the answer an unknown origin gets, and a
/// cursor changed by hand is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_isolated_caller_reads_its_body_through_body_get_and_no_other_can() {
    let (nats, upstream, service) = isolated_scene(&[]).await;
    let caller_a = Caller::connect(&nats, "caller_a").await;
    let caller_b = Caller::connect(&nats, "caller_b").await;
    let size = 3 * MIB;
    let msg_id = new_msg_id().expect("msg id");
    let (reply, origin, id) = isolated_request(&caller_a, &upstream, &service, size, &msg_id).await;
    let object = reply.body_object.clone().expect("a stored body");

    // The store itself is out of the caller's reach.
    let direct = caller_a.js.get_object_store(&object.bucket).await;
    assert!(
        direct.is_err(),
        "an isolated caller reads no store directly"
    );

    let bytes = body_get(&caller_a.nats, &id, &origin.to_string(), &msg_id)
        .await
        .unwrap_or_else(|(code, payload)| panic!("{code:?}: {payload:?}\n{}", service.logs()));
    assert!(
        bytes == large_body(size),
        "the bytes read through body.get differ"
    );

    let wrong = body_get(
        &caller_b.nats,
        &id,
        &origin.to_string(),
        &new_msg_id().expect("id"),
    )
    .await
    .expect_err("another caller's message id opens nothing");
    let unknown_origin = Origin::new(origin.stream.as_str(), origin.seq + 1000).to_string();
    let unknown = body_get(&caller_b.nats, &id, &unknown_origin, &msg_id)
        .await
        .expect_err("an unknown origin");
    assert_eq!(wrong.0, BodyGetCode::NotFound);
    assert_eq!(
        wrong, unknown,
        "a wrong message id answers as an unknown origin does"
    );

    let tampered = BodyGetRequest {
        id: id.clone(),
        origin: origin.to_string(),
        msg_id: String::new(),
        cursor: Some("eyJiIjoiV0VCUFJPWFlfUE9PTF9ERUZBVUxUX0JPRElFUyJ9.00".into()),
    };
    let answer = caller_b
        .nats
        .request(
            "webproxy.body.get",
            serde_json::to_vec(&tampered).expect("json").into(),
        )
        .await
        .expect("an answer");
    let code = answer
        .headers
        .as_ref()
        .and_then(|h| h.get(body_header::ERROR))
        .map(|v| v.to_string());
    assert_eq!(code.as_deref(), Some("invalid_request"));
}

/// A body that has expired answers `expired`, distinct from `not_found`: its receipt
/// outlives it (`dead_max_age`), so the service knows it was stored. `reply_max_age` is
/// 1 s and the rule's timeout 3 s, so the body lives 4 s; the wait for `expired` is
/// bounded by [`REPLY_TIMEOUT`].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_body_answers_expired() {
    let (nats, upstream, service) =
        isolated_scene(&[("WEBPROXY_STREAMS__REPLY_MAX_AGE", "1s")]).await;
    let caller = Caller::connect(&nats, "caller_a").await;
    let msg_id = new_msg_id().expect("msg id");
    let (reply, origin, id) = isolated_request(&caller, &upstream, &service, MIB, &msg_id).await;
    assert!(reply.body_object.is_some(), "{reply:?}");
    let origin = origin.to_string();
    wait_for(REPLY_TIMEOUT, "the body to expire", || async {
        match body_get(&caller.nats, &id, &origin, &msg_id).await {
            Err((BodyGetCode::Expired, _)) => Some(()),
            _ => None,
        }
    })
    .await;
    let wrong = body_get(&caller.nats, &id, &origin, &new_msg_id().expect("id")).await;
    assert!(
        matches!(wrong, Err((BodyGetCode::NotFound, _))),
        "without the message id even an expired body is not found"
    );
}

/// A 64 MiB body (`max_large_body`'s default) stored and read back through `body.get`
/// within 15 s on loopback, as the issue asks: a generous bound on a debug build,
/// where it takes a few seconds. webproxy's peak RSS stays under point 5's 200 MiB,
/// since neither the attempt nor `body.get` holds more than a chunk window of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_mib_read_through_body_get_within_fifteen_seconds_in_bounded_memory() {
    let h = harness(ServiceOptions::default()).await;
    let size = 64 * MIB;
    let msg_id = new_msg_id().expect("msg id");
    let envelope = large(&h.upstream.url(&format!("/large/{size}")));
    let id = envelope.id.clone();
    let request = Request::from_envelope(envelope)
        .msg_id(&msg_id)
        .wait(REPLY_TIMEOUT);
    let answer = h
        .client
        .request_answer(&request)
        .await
        .unwrap_or_else(|e| panic!("no reply: {e}\n{}", h.service.logs()));
    let object = answer.reply.body_object.expect("a stored body");
    assert_eq!(object.size, size as u64);

    let started = std::time::Instant::now();
    let nats = h.nats.client().await;
    let bytes = body_get(&nats, &id, &answer.origin.to_string(), &msg_id)
        .await
        .unwrap_or_else(|(code, payload)| panic!("{code:?}: {payload:?}"));
    let took = started.elapsed();
    assert!(
        took < std::time::Duration::from_secs(15),
        "64 MiB through body.get took {took:?}"
    );
    assert!(
        bytes.len() == size && bytes == large_body(size),
        "the bytes differ"
    );
    let peak = webproxy_tests::process::peak_rss(h.service.pid()).expect("the service runs");
    assert!(
        peak < 200 * MIB as u64,
        "webproxy's peak RSS: {} MiB",
        peak / MIB as u64
    );
}

/// The Rust client opts in with `Request::large_body` (which draws the message id it
/// will ask for) and reads the stored body back with `Client::read_body`, checked
/// against its size and digest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_opts_in_and_reads_the_stored_body() {
    let h = harness(ServiceOptions::default()).await;
    let size = 2 * MIB + 17;
    let request = Request::new("GET", h.upstream.url(&format!("/large/{size}")))
        .large_body()
        .expect("a message id")
        .wait(REPLY_TIMEOUT);
    let msg_id = request.msg_id_set().expect("drawn").to_string();
    let answer = h.client.request_answer(&request).await.expect("a reply");
    assert!(answer.reply.body_object.is_some(), "{:?}", answer.reply);
    let body = h
        .client
        .read_body(&answer.reply.id, &answer.origin, &msg_id)
        .await
        .expect("the body");
    assert!(body == large_body(size), "the bytes differ");
    let refused = h
        .client
        .read_body(&answer.reply.id, &answer.origin, &new_msg_id().expect("id"))
        .await
        .expect_err("another message id");
    assert!(refused.to_string().contains("not_found"), "{refused}");
}
