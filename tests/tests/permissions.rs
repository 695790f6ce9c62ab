//! deploy/nats/authorization.conf as shipped, one role at a time (issue 22, point 2):
//! the service, the operator, the HTTP gateway and an isolated caller each hold one
//! conversation with what the file allows them, and each is refused one named
//! operation, which the server must report as a permissions violation. Widening any of
//! those permissions fails this test. Cancels (issue 35) cross exactly where the file
//! lets them: callers and the gateway on `webproxy.cancel`, the operator alone on
//! `webproxy.admin.cancel`, each answered by the service; a service denied one of
//! them is not ready and says so.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::{self, ErrorCode, context::GetStreamErrorKind, stream};
use serde_json::{Value, json};
use webproxy_client::{Client, Request, new_id};
use webproxy_protocol::{
    AdminCancelRequest, CancelAnswer, CancelErrorCode, CancelRequest, CancelState, Reply, header,
};
use webproxy_tests::authorized::{
    AUTHORIZATION, Admin, Caller, GATEWAY_USER, OPERATOR_USER, Origin, SERVICE_USER, as_operator,
    connect_as, header as header_of, origin_of, service_as, stored_msg_id, violation,
};
use webproxy_tests::caller::{REPLY_TIMEOUT, next_message, path_rule};
use webproxy_tests::{Gateway, NatsServer, Service, Upstream, http_client, wait_for};

/// The pool deploy/kubernetes/gateway/webproxy.toml's route names, the one pool the
/// file's `gateway` user may publish to.
const GATEWAY_POOL: &str = "partner";

/// A pool the operator pauses and removes with its waiting requests.
const DRAINED_POOL: &str = "drained";

/// The JetStream API of the callers' account, as webproxy's account imports it.
const CALLERS_API: &str = "$JS.CALLERS.API";

/// The reply spaces the file's comments say the service must confine copies to.
const REPLY_TO_ALLOW: &str = "[streams]\nreply_to_allow = [\"callers.{caller}.replies.>\"]\n";

/// A server with the file's accounts, an upstream, and the service as the file's
/// `webproxy` user with the pool `partner`, confining reply copies to the callers'
/// reply spaces as the file's comments say it must.
struct Scene {
    nats: NatsServer,
    upstream: Upstream,
    service: Service,
}

impl Scene {
    async fn start() -> Scene {
        Scene::start_on(NatsServer::start_authorized()).await
    }

    /// The scene on `nats`, which the test may have prepared as an admin.
    async fn start_on(nats: NatsServer) -> Scene {
        let upstream = Upstream::start().await;
        let config = format!(
            "{REPLY_TO_ALLOW}\n\
             [pools.{GATEWAY_POOL}]\nmax_in_flight = 4\n\n[pools.{DRAINED_POOL}]\n\n\
             {}pool = \"{GATEWAY_POOL}\"\n",
            path_rule("partner", &upstream, "/")
        );
        let service = Service::start_with(&nats.url(), &config, service_as(SERVICE_USER)).await;
        Scene {
            nats,
            upstream,
            service,
        }
    }

    /// `webproxy ARGS` as the file's operator user; its standard output.
    async fn operator(&self, args: &[&str]) -> String {
        as_operator(&self.nats, args).await
    }

    /// `caller` sends a GET of /echo to `pool`, answered to `callers.<x>.replies.<id>`,
    /// without listening there; the envelope's id, its reply subject and the origin.
    async fn unheard(&self, caller: &Caller, pool: &str) -> (String, String, Origin) {
        let id = new_id();
        let reply_to = caller.reply_to(&id);
        let envelope = json!({
            "id": id,
            "method": "GET",
            "url": self.upstream.url("/echo"),
            "reply_to": reply_to,
        });
        let ack = caller
            .publish(pool, &new_id(), &HeaderMap::new(), envelope.to_string())
            .await;
        (id, reply_to, origin_of(&ack))
    }

    /// Publishes `subject` as `user` and waits for the server's permissions violation.
    async fn refused(&self, user: &str, subject: &str, inbox_prefix: Option<&str>) {
        let (client, mut errors) = connect_as(&self.nats, user, inbox_prefix).await;
        client
            .publish(subject.to_owned(), "{}".into())
            .await
            .expect("publish");
        client.flush().await.expect("flush");
        violation(&mut errors, subject, REPLY_TIMEOUT).await;
    }
}

/// Creates caller `name`'s reply stream as the file's operator, through the callers'
/// JetStream API that webproxy's account imports.
async fn create_reply_stream(nats: &NatsServer, name: &str) {
    let (operator, _) = connect_as(nats, OPERATOR_USER, None).await;
    jetstream::with_prefix(operator, CALLERS_API)
        .create_stream(reply_stream(name))
        .await
        .unwrap_or_else(|e| panic!("the operator creates REPLIES_{name}: {e}"));
}

/// Waits for the last message on `subject` in a caller's reply stream, read as that
/// caller (`$JS.API.STREAM.MSG.GET`).
async fn kept<I>(stream: &stream::Stream<I>, subject: &str, what: &str) -> StreamMessage {
    wait_for(REPLY_TIMEOUT, what, || async {
        stream.get_last_raw_message_by_subject(subject).await.ok()
    })
    .await
}

/// The reply stream of caller `name` (`a` for `caller_a`), as an operator creates it
/// when adding the caller: its reply space, a duplicate window for the copies'
/// `Nats-Msg-Id`, and direct gets.
fn reply_stream(name: &str) -> stream::Config {
    stream::Config {
        name: format!("REPLIES_{}", name.to_ascii_uppercase()),
        subjects: vec![format!("callers.{name}.replies.>")],
        duplicate_window: Duration::from_secs(120),
        max_age: Duration::from_secs(24 * 3600),
        max_bytes: 64 * 1024 * 1024,
        allow_direct: true,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_role_converses_and_is_refused_its_one_named_operation() {
    let scene = Scene::start().await;

    // The service: it served what follows. Refused: deleting a stream, which holds
    // queued requests that are not its to destroy.
    scene
        .refused(
            SERVICE_USER,
            "$JS.API.STREAM.DELETE.WEBPROXY_POOL_PARTNER",
            Some("_WEBPROXY_INBOX.test"),
        )
        .await;

    // The operator: lists the pools, and creates each caller's reply stream in the
    // callers' account through the imported JetStream API. Refused: sending a request,
    // which only callers and the gateway do.
    let listed: Value =
        serde_json::from_str(&scene.operator(&["pools", "--json"]).await).expect("JSON");
    assert!(
        listed
            .as_array()
            .is_some_and(|pools| pools.iter().any(|p| p["pool"] == GATEWAY_POOL)),
        "{listed}"
    );
    for name in ["a", "b"] {
        create_reply_stream(&scene.nats, name).await;
    }
    scene
        .refused(
            OPERATOR_USER,
            &format!("webproxy.request.{GATEWAY_POOL}"),
            None,
        )
        .await;

    // The gateway: one HTTP request through its route to `partner`, and one whose body
    // both ways is over the inline limit (uploaded with body.put, stored by the
    // service, read back with body.get), as the shipped route sets `large_bodies`.
    // Refused: a request, or an upload, to a pool none of its routes names.
    let route = format!(
        "[[gateway.routes]]\npath = \"/partner\"\nupstream = \"{}\"\npool = \"{GATEWAY_POOL}\"\nlarge_bodies = true\n",
        scene.upstream.url("/")
    );
    let gateway = Gateway::start_with(&scene.nats, &route, service_as(GATEWAY_USER)).await;
    let response = http_client()
        .get(gateway.url("/partner/echo"))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(
        response.status(),
        200,
        "{}\n{}",
        gateway.logs(),
        scene.service.logs()
    );
    let large = "a".repeat(1536 * 1024);
    let echoed = http_client()
        .post(gateway.url("/partner/echo"))
        .body(large.clone())
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(
        echoed.status(),
        200,
        "{}\n{}",
        gateway.logs(),
        scene.service.logs()
    );
    assert!(
        echoed.content_length() > Some(large.len() as u64),
        "a stored body, streamed with its length"
    );
    let echoed: Value =
        serde_json::from_slice(&echoed.bytes().await.expect("the echo, whole")).expect("JSON");
    assert_eq!(echoed["body_len"], large.len());
    for subject in ["webproxy.request.default", "webproxy.body.put.default"] {
        scene
            .refused(GATEWAY_USER, subject, Some("_WEBPROXY_INBOX.test"))
            .await;
    }
    // The gateway's "not found" check: it reads its buckets' stream info, and a bucket
    // that is gone answers 10059, never a permissions violation.
    let (as_gateway, _) = connect_as(&scene.nats, GATEWAY_USER, Some("_WEBPROXY_INBOX.test")).await;
    let as_gateway = jetstream::new(as_gateway);
    as_gateway
        .get_stream("KV_WEBPROXY_GATEWAY")
        .await
        .expect("the gateway reads its bucket's stream info");
    Admin::connect(&scene.nats)
        .await
        .js
        .delete_stream("KV_WEBPROXY_GATEWAY_KEY")
        .await
        .expect("the gateway key's bucket deleted by hand");
    let gone = as_gateway
        .get_stream("KV_WEBPROXY_GATEWAY_KEY")
        .await
        .expect_err("the bucket is gone");
    assert!(
        matches!(gone.kind(), GetStreamErrorKind::JetStream(ref e)
            if e.error_code() == ErrorCode::STREAM_NOT_FOUND),
        "{gone}"
    );

    // The isolated caller: a request answered to its reply space while nothing of it
    // listens, the reply read back from its own stream on a new connection.
    let (_, reply_to, origin) = {
        let caller = Caller::connect(&scene.nats, "caller_a").await;
        scene.unheard(&caller, GATEWAY_POOL).await
    };
    // A new connection, as after a reconnect: the reply waits in the stream.
    let caller = Caller::connect(&scene.nats, "caller_a").await;
    let own = caller
        .js
        .get_stream("REPLIES_A")
        .await
        .expect("caller_a reads its own stream's info");
    let what = format!("the reply in REPLIES_A\n{}", scene.service.logs());
    let stored = kept(&own, &reply_to, &what).await;
    let reply: Reply = serde_json::from_slice(&stored.payload).expect("reply JSON");
    assert_eq!(reply.status, Some(200), "{reply:?}");
    let msg_id = stored_msg_id(&origin, 0, "reply");
    assert_eq!(
        header_of(Some(&stored.headers), header::MSG_ID),
        Some(msg_id.as_str())
    );
    assert_eq!(
        header_of(Some(&stored.headers), header::ORIGIN),
        Some(origin.to_string().as_str())
    );
    let direct = own
        .direct_get_last_for_subject(&reply_to)
        .await
        .expect("caller_a direct-gets its reply");
    assert_eq!(direct.payload, stored.payload);

    // A copy sent again (as a redelivery does) is the same message to the stream: only
    // the marker sent after it is stored.
    let admin = Admin::connect(&scene.nats).await;
    let mut again = HeaderMap::new();
    again.insert(header::MSG_ID, msg_id.as_str());
    admin
        .nats
        .publish_with_headers(reply_to.clone(), again, stored.payload.clone())
        .await
        .expect("publish");
    let marker = format!("{reply_to}-marker");
    admin
        .nats
        .publish(marker.clone(), "marker".into())
        .await
        .expect("publish");
    admin.nats.flush().await.expect("flush");
    kept(&own, &marker, "the marker in REPLIES_A").await;
    let mut own = own;
    assert_eq!(own.info().await.expect("info").state.messages, 2);

    // Refused: a caller publishing on a hop subject.
    let hop = format!("webproxy.hop.{GATEWAY_POOL}.{}", new_id());
    scene
        .refused("caller_a", &hop, Some("callers.a._INBOX"))
        .await;
    // Refused: another caller reading caller_a's stored reply, by the stream API or a
    // direct get, and creating a stream of its own (which could capture any subject).
    for subject in [
        "$JS.API.STREAM.MSG.GET.REPLIES_A".to_owned(),
        format!("$JS.API.DIRECT.GET.REPLIES_A.{reply_to}"),
        "$JS.API.STREAM.INFO.REPLIES_A".to_owned(),
        "$JS.API.STREAM.CREATE.REPLIES_B2".to_owned(),
    ] {
        scene
            .refused("caller_b", &subject, Some("callers.b._INBOX"))
            .await;
    }
    // What caller_b may read is its own stream, which holds none of caller_a's.
    let caller_b = Caller::connect(&scene.nats, "caller_b").await;
    let mut theirs = caller_b
        .js
        .get_stream("REPLIES_B")
        .await
        .expect("caller_b reads its own stream's info");
    assert_eq!(theirs.info().await.expect("info").state.messages, 0);
}

/// Issue 29, point 10: the service moves the fences an earlier release made in memory
/// onto file with the file's rights alone (it may delete its fences, and no other
/// stream): it starts, turns ready, and both fences are on file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_moves_memory_fences_onto_file_with_its_own_rights() {
    let nats = NatsServer::start_authorized();
    let admin = Admin::connect(&nats).await;
    let fences = [
        ("WEBPROXY_FENCE_POOL_PARTNER", "webproxy.retry.partner"),
        ("WEBPROXY_FENCE_REPLIES", "webproxy.reply.*.*"),
    ];
    for (name, subject) in fences {
        admin
            .js
            .create_stream(stream::Config {
                name: name.into(),
                subjects: vec![subject.into()],
                storage: stream::StorageType::Memory,
                max_messages: 1,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("the earlier release's {name}: {e}"));
    }
    let scene = Scene::start_on(nats).await;
    for (name, _) in fences {
        let mut fence = admin.js.get_stream(name).await.expect(name);
        let config = fence.info().await.expect("info").config.clone();
        assert_eq!(
            config.storage,
            stream::StorageType::File,
            "{name}\n{}",
            scene.service.logs()
        );
    }
}

/// The operator's `pools remove --dead-letter` ends the requests waiting in a paused
/// pool as the service would: their dead letters and stored replies, and the reply copy
/// to an isolated caller's reply space, which its stream keeps under the stored
/// reply's message id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operators_pools_remove_answers_an_isolated_caller_into_its_stream() {
    let scene = Scene::start().await;
    create_reply_stream(&scene.nats, "a").await;
    scene
        .operator(&["pools", "pause", DRAINED_POOL, "--reason", "test"])
        .await;
    let admin = Admin::connect(&scene.nats).await;
    let consumer = format!("webproxy-{DRAINED_POOL}-l3");
    let stream_name = format!("WEBPROXY_POOL_{}", DRAINED_POOL.to_ascii_uppercase());
    wait_for(REPLY_TIMEOUT, "the pool consumer paused", || async {
        let mut consumer: jetstream::consumer::PullConsumer = admin
            .js
            .get_consumer_from_stream(&consumer, &stream_name)
            .await
            .ok()?;
        consumer.info().await.ok()?.paused.then_some(())
    })
    .await;

    let caller = Caller::connect(&scene.nats, "caller_a").await;
    let (id, reply_to, origin) = scene.unheard(&caller, DRAINED_POOL).await;
    // The operator's command reads the service's reply_to_allow from its config, to
    // copy the ending into the caller's space as the service would.
    let config = tempfile::NamedTempFile::new().expect("a config file");
    std::fs::write(config.path(), REPLY_TO_ALLOW).expect("write the config");
    let config = config.path().to_str().expect("a UTF-8 path");
    let removed = scene
        .operator(&[
            "pools",
            "remove",
            DRAINED_POOL,
            "--dead-letter",
            // The scene's instance still has the pool in its configuration.
            "--force",
            "--config",
            config,
        ])
        .await;
    assert!(removed.contains(DRAINED_POOL), "{removed}");

    let letters = admin.wait_dead_letters(&origin, REPLY_TIMEOUT).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(
        admin
            .wait_stored_replies(&id, &origin, REPLY_TIMEOUT)
            .await
            .len(),
        1
    );
    let own = caller
        .js
        .get_stream_no_info("REPLIES_A")
        .await
        .expect("stream");
    let stored = kept(&own, &reply_to, "the reply copy in REPLIES_A").await;
    let reply: Reply = serde_json::from_slice(&stored.payload).expect("reply JSON");
    assert!(reply.error.is_some(), "{reply:?}");
    assert_eq!(
        header_of(Some(&stored.headers), header::MSG_ID),
        Some(stored_msg_id(&origin, 0, "reply").as_str())
    );
    assert_eq!(scene.upstream.hits_for("/echo"), 0);
}

/// Where callers take a request back (issue 35): `webproxy.cancel`, imported into the
/// callers' account alone, with the message id as the capability.
const CANCEL: &str = "webproxy.cancel";

/// Where operators cancel by origin alone: only the file's operator user may publish it.
const ADMIN_CANCEL: &str = "webproxy.admin.cancel";

/// An origin of the pool `partner` that names no conversation: a pool stream's first
/// sequence is a time in microseconds, so sequence 1 was never stored.
const MADE_UP_ORIGIN: &str = "WEBPROXY_POOL_PARTNER:1";

/// Issue 35: cancels cross exactly where the file lets them. A caller of the callers'
/// account sends its cancels on the imported `webproxy.cancel` and the service answers
/// (`unknown` for an origin that names nothing, `recorded` for its own request in
/// flight, whose reply then says `cancelled`); the caller is refused
/// `webproxy.admin.cancel` and subscribing to the cancels of others. The operator user
/// cancels by origin on `webproxy.admin.cancel` and gets an answer; the gateway user
/// sends a cancel on `webproxy.cancel` and gets one, and is refused the operator's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancels_reach_the_service_exactly_where_the_file_lets_them() {
    cancels_on(NatsServer::start_authorized()).await;
}

/// The cancel test of [`cancels_reach_the_service_exactly_where_the_file_lets_them`] on
/// `nats`: a server with the file's users, as shipped or (by hand) altered.
async fn cancels_on(nats: NatsServer) {
    let scene = Scene::start_on(nats).await;

    // The isolated caller, as a client: a cancel of an origin that names nothing is
    // answered, through the import, on its own inbox.
    let caller = Caller::connect(&scene.nats, "caller_a").await;
    let client = Client::new(caller.nats.clone(), "webproxy")
        .and_then(|c| c.with_caller(&caller.name))
        .expect("a client as caller_a");
    let made_up = MADE_UP_ORIGIN.parse().expect("an origin");
    let unknown = client
        .cancel(&new_id(), &made_up, &new_id())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "caller_a's cancel of nothing: {e}\n{}",
                scene.service.logs()
            )
        });
    assert_eq!(unknown, CancelState::Unknown);

    // Its own request, held at the upstream: recorded, the attempt dropped, and the
    // reply copied to its reply space says so.
    let id = new_id();
    let reply_to = caller.reply_to(&id);
    let mut replies = caller
        .nats
        .subscribe(reply_to.clone())
        .await
        .expect("subscribe to the reply_to");
    caller.nats.flush().await.expect("flush");
    let request = Request::new("GET", scene.upstream.url("/hang"))
        .id(&id)
        .pool(GATEWAY_POOL)
        .reply_to(&reply_to);
    let submitted = client
        .submit(&request)
        .await
        .expect("caller_a's request stored");
    let what = format!("the attempt at the upstream\n{}", scene.service.logs());
    wait_for(REPLY_TIMEOUT, &what, || async {
        (scene.upstream.hits_for("/hang") == 1).then_some(())
    })
    .await;
    let recorded = client
        .cancel(&submitted.id, &submitted.origin, &submitted.msg_id)
        .await
        .unwrap_or_else(|e| panic!("caller_a's cancel: {e}\n{}", scene.service.logs()));
    assert_eq!(recorded, CancelState::Recorded);
    let what = format!("the cancelled reply\n{}", scene.service.logs());
    let reply = next_message(&mut replies, REPLY_TIMEOUT, &what).await;
    let reply: Reply = serde_json::from_slice(&reply.payload).expect("reply JSON");
    assert_eq!(
        reply.error.as_ref().map(|e| e.code),
        Some(webproxy_protocol::ErrorCode::Cancelled),
        "{reply:?}"
    );
    assert_eq!(reply.attempts, 1, "{reply:?}");
    assert_eq!(scene.upstream.hits_for("/hang"), 1, "no second attempt");

    // Refused: the caller cancelling by origin alone, and listening to others' cancels
    // (their message ids are their capabilities).
    scene
        .refused("caller_a", ADMIN_CANCEL, Some("callers.a._INBOX"))
        .await;
    let (as_caller_b, mut errors) =
        connect_as(&scene.nats, "caller_b", Some("callers.b._INBOX")).await;
    let _listening = as_caller_b
        .subscribe(CANCEL.to_owned())
        .await
        .expect("subscribe");
    as_caller_b.flush().await.expect("flush");
    violation(&mut errors, CANCEL, REPLY_TIMEOUT).await;

    // The operator: a cancel by origin alone, answered; the caller's conversation has
    // its final reply.
    let (as_operator, _) = connect_as(&scene.nats, OPERATOR_USER, None).await;
    let admin = AdminCancelRequest {
        origin: submitted.origin.to_string(),
    };
    let admin = serde_json::to_vec(&admin).expect("JSON");
    let answer = ask_cancel(&scene, &as_operator, ADMIN_CANCEL, admin).await;
    assert_eq!(answer, CancelAnswer::state(CancelState::Finished));

    // The gateway (its DELETE): a cancel on webproxy.cancel, answered on its inbox with
    // the very bytes of an unknown origin. Refused: the operator's cancel.
    let (as_gateway, _) = connect_as(&scene.nats, GATEWAY_USER, Some("_WEBPROXY_INBOX.test")).await;
    let cancel = CancelRequest {
        id: new_id(),
        origin: MADE_UP_ORIGIN.to_owned(),
        msg_id: new_id(),
    };
    let cancel = serde_json::to_vec(&cancel).expect("JSON");
    let answer = ask_cancel(&scene, &as_gateway, CANCEL, cancel).await;
    assert_eq!(
        answer.encode(),
        CancelAnswer::state(CancelState::Unknown).encode()
    );
    scene
        .refused(GATEWAY_USER, ADMIN_CANCEL, Some("_WEBPROXY_INBOX.test"))
        .await;
}

/// Sends the cancel `payload` on `subject` over `nats` and returns the service's
/// answer, asked again while it is `busy`. No responders (nothing of the service's
/// reachable on `subject`) fails at once.
async fn ask_cancel(
    scene: &Scene,
    nats: &async_nats::Client,
    subject: &str,
    payload: Vec<u8>,
) -> CancelAnswer {
    let what = format!("an answer on {subject}\n{}", scene.service.logs());
    wait_for(REPLY_TIMEOUT, &what, || async {
        let answer = nats
            .request(subject.to_owned(), payload.clone().into())
            .await
            .unwrap_or_else(|e| panic!("a request on {subject}: {e}\n{}", scene.service.logs()));
        let answer: CancelAnswer = serde_json::from_slice(&answer.payload).expect("an answer");
        let busy = answer
            .error
            .as_ref()
            .is_some_and(|e| e.code == CancelErrorCode::Busy);
        (!busy).then_some(answer)
    })
    .await
}

/// How long a service denied a subscription may take to say so on `/readyz`: it
/// connects, subscribes, and the server's refusal comes back within a round trip;
/// generous for a loaded machine.
const REFUSAL_SHOWN: Duration = Duration::from_secs(30);

/// A service user the file denies `webproxy.cancel` (the line taken out of its
/// subscribe list) starts, yet nothing of it answers cancels: callers would get only
/// "no responders". It is not ready, and `/readyz` names the refused subject.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_denied_a_subject_it_answers_on_is_not_ready_and_names_it() {
    let granted = "\"webproxy.body.put.>\",\n              \"webproxy.cancel\",\n";
    assert_eq!(
        AUTHORIZATION.matches(granted).count(),
        1,
        "the service's subscribe list in deploy/nats/authorization.conf"
    );
    let nats = NatsServer::start_authorized_from(
        &AUTHORIZATION.replace(granted, "\"webproxy.body.put.>\",\n"),
    );
    let service = Service::spawn(&nats.url(), "", service_as(SERVICE_USER));
    let readiness = service
        .not_ready_naming(REFUSAL_SHOWN, "subscribing to webproxy.cancel")
        .await;
    assert!(
        readiness.contains("authorization.conf"),
        "/readyz says where to allow it: {readiness}\n{}",
        service.logs()
    );
}
