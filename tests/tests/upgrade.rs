//! Mixed versions on one nats-server: webproxy of stream layout 1 (commit c7a4dcd, the
//! version before the conversation core) and today's, started in either order. No
//! conversation is lost, retries parked by the old version included; the callers are
//! old-style throughout (they are upgraded after the service): each publishes with its
//! envelope id as `Nats-Msg-Id` and takes the live reply on `webproxy.reply.<id>`,
//! which both versions publish.
//!
//! Needs the old binary: `just test-upgrade` builds it and names it in
//! `WEBPROXY_OLD_BINARY`. Ignored in the normal run. The same goes for layout 2's last
//! build (`WEBPROXY_LAYOUT2_BINARY`), which the move to per-pool replies and
//! dead-letter streams (layout 3) is tested against.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use async_nats::jetstream::stream::StorageType;
use async_nats::jetstream::{self, consumer, message::PublishMessage};
use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::any;
use webproxy_client::Client;
use webproxy_protocol::{Reply, RequestEnvelope, Subjects};
use webproxy_tests::caller::{REPLY_TIMEOUT, accept_rule, envelope, next_message, to};
use webproxy_tests::{NatsServer, Service, ServiceOptions, Upstream, default_routes, wait_until};

const OLD_BINARY: &str = "WEBPROXY_OLD_BINARY";

/// A conversation that parks twice waits 2 x 2 s, plus a migration in between.
const PARKED_REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// The service run from the binary that the environment variable `var` names.
fn built(var: &str) -> ServiceOptions {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("{var} is not set: run `just test-upgrade`"));
    assert!(path.is_file(), "{var}={} is no file", path.display());
    ServiceOptions::default().binary(path)
}

/// Layout 1's last build.
fn old() -> ServiceOptions {
    built(OLD_BINARY)
}

/// The default routes and `/flaky/{key}/{n}`: 503 for the first `n` calls with that
/// key, then 200, so every conversation parks its own retries.
async fn upstream() -> Upstream {
    let calls: Arc<Mutex<std::collections::HashMap<String, usize>>> = Arc::default();
    let flaky = any(move |Path((key, n)): Path<(String, usize)>| {
        let calls = calls.clone();
        async move {
            let mut calls = calls.lock().unwrap_or_else(PoisonError::into_inner);
            let seen = calls.entry(key).or_default();
            *seen += 1;
            if *seen > n {
                (StatusCode::OK, "ok")
            } else {
                (StatusCode::SERVICE_UNAVAILABLE, "busy")
            }
        }
    });
    Upstream::start_with(default_routes().merge(Router::new().route("/flaky/{key}/{n}", flaky)))
        .await
}

/// A config both versions read alike: retries 2 s apart, so parked retries are still
/// waiting when the other version takes over.
fn config(upstream: &Upstream) -> String {
    format!(
        "[service]\nshutdown_grace = \"2s\"\n\n[pools.default]\nmax_in_flight = 4\n\n{}max_retries = 4\nretry_delay = \"2s\"\nbackoff_factor = 1.0\n",
        accept_rule("local", upstream)
    )
}

/// A caller of before the conversation core.
struct OldCaller {
    nats: async_nats::Client,
    js: jetstream::Context,
}

/// One conversation an [`OldCaller`] started: its live reply subscription.
struct Call {
    id: String,
    replies: async_nats::Subscriber,
}

impl OldCaller {
    async fn new(nats: &NatsServer) -> OldCaller {
        let client = nats.client().await;
        OldCaller {
            js: jetstream::new(client.clone()),
            nats: client,
        }
    }

    /// Subscribes to the live reply, then publishes under the envelope's id.
    async fn call(&self, envelope: &RequestEnvelope) -> Call {
        let replies = self
            .nats
            .subscribe(format!("webproxy.reply.{}", envelope.id))
            .await
            .expect("subscribe");
        let payload = serde_json::to_vec(envelope).expect("envelope json");
        self.js
            .send_publish(
                "webproxy.request.default",
                PublishMessage::build()
                    .payload(payload.into())
                    .message_id(&envelope.id),
            )
            .await
            .expect("publish")
            .await
            .expect("stored");
        Call {
            id: envelope.id.clone(),
            replies,
        }
    }
}

impl Call {
    /// The first live reply, as an old caller takes it.
    async fn reply(mut self, within: Duration) -> Reply {
        let what = format!("the reply of {}", self.id);
        let message = next_message(&mut self.replies, within, &what).await;
        serde_json::from_slice(&message.payload).expect("reply json")
    }
}

/// How many messages `stream` holds on exactly `subject`.
async fn messages_on(stream: &jetstream::stream::Stream, subject: &str) -> usize {
    let (mut next, mut count) = (0, 0);
    loop {
        match stream.get_first_raw_message_by_subject(subject, next).await {
            Ok(message) => {
                count += 1;
                next = message.sequence + 1;
            }
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return count,
            Err(e) => panic!("reading {subject}: {e}"),
        }
    }
}

/// Waits for `calls` and checks every reply is the upstream's 200 after `attempts`.
async fn all_answered(calls: Vec<(Call, u32)>, within: Duration, logs: &dyn Fn() -> String) {
    for (call, attempts) in calls {
        let id = call.id.clone();
        let reply = call.reply(within).await;
        assert_eq!(reply.id, id);
        assert_eq!(reply.status, Some(200), "{reply:?}\n{}", logs());
        assert_eq!(reply.attempts, attempts, "{id}: {reply:?}");
    }
}

/// The pool stream is layout 3 with its fence and its own replies and dead-letter
/// streams, layout 1's consumers are gone, and the shared streams are retired when
/// the old version made them (`shared`), or absent.
async fn assert_layout3(js: &jetstream::Context, shared: bool) {
    let subjects = Subjects::new("webproxy").expect("prefix");
    let mut pool = js.get_stream("WEBPROXY_POOL_DEFAULT").await.expect("pool");
    let config = pool.info().await.expect("info").config.clone();
    assert_eq!(
        config.metadata.get("webproxy.layout").map(String::as_str),
        Some("3")
    );
    assert!(
        config.subjects.contains(&subjects.hop_filter("default")),
        "{config:?}"
    );
    for gone in ["webproxy-default", "webproxy-default-retry"] {
        assert!(
            pool.consumer_info(gone).await.is_err(),
            "{gone} is still there"
        );
    }
    for kept in ["webproxy-default-l3", "webproxy-default-retry-l3"] {
        pool.consumer_info(kept).await.expect(kept);
    }
    let mut streams = vec![
        (
            "WEBPROXY_POOL_DEFAULT_REPLIES",
            &["webproxy.reply.*.WEBPROXY_POOL_DEFAULT.*"][..],
        ),
        (
            "WEBPROXY_POOL_DEFAULT_DEAD",
            &["webproxy.dead.default", "webproxy.dead.default.superseded"][..],
        ),
    ];
    // Layout 1's shared streams, retired: what they hold ages out.
    let retired = [
        ("WEBPROXY_REPLIES", &["webproxy.retired.replies"][..]),
        ("WEBPROXY_DEAD", &["webproxy.retired.dead"][..]),
    ];
    if shared {
        streams.extend(retired);
    } else {
        for (stream, _) in retired {
            assert!(js.get_stream(stream).await.is_err(), "{stream} was made");
        }
    }
    for (stream, captures) in streams {
        let mut found = js.get_stream(stream).await.expect(stream);
        let subjects = found.info().await.expect("info").config.subjects.clone();
        assert_eq!(subjects, captures, "{stream}");
    }
    for (fence, _) in FENCES {
        let mut stream = js.get_stream(fence).await.expect(fence);
        let storage = stream.info().await.expect("info").config.storage;
        // On file: a memory fence is gone after a restart of its server.
        assert_eq!(storage, StorageType::File, "{fence}");
    }
}

/// Waits until the old version's provisioning is refused by a fence (its stream
/// rewrite overlaps it), and checks that it is not ready.
async fn refused_by_a_fence(old: &Service) {
    wait_until(
        REPLY_TIMEOUT,
        "the old version's provisioning to be refused by a fence",
        || async {
            old.logs()
                .contains("subjects overlap with an existing stream")
        },
    )
    .await;
    assert!(!old.is_ready().await, "{}", old.logs());
}

/// The old version answered no conversation.
fn answered_nothing(old: &Service) {
    assert!(
        !old.logs().contains("conversation finished"),
        "the old version answered something:\n{}",
        old.logs()
    );
}

/// The fences of the pool `default` and of the replies, with what each captures.
const FENCES: [(&str, &str); 2] = [
    ("WEBPROXY_FENCE_POOL_DEFAULT", "webproxy.retry.default"),
    ("WEBPROXY_FENCE_REPLIES", "webproxy.reply.*.*"),
];

/// Old first, then new, as in a rolling update: the new instance migrates the pool
/// while the old one runs, moves the retries it parked, and answers them with their
/// attempt history; the old instance is stopped once the new one is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the old binary: run `just test-upgrade`"]
async fn old_first_then_new() {
    let old_binary = old();
    let nats = NatsServer::start();
    let upstream = upstream().await;
    let config = config(&upstream);
    let old = Service::start_with(&nats.url(), &config, old_binary).await;
    let caller = OldCaller::new(&nats).await;
    let js = jetstream::new(nats.client().await);

    let mut before = Vec::new();
    let mut parked = Vec::new();
    for _ in 0..3 {
        before.push(caller.call(&envelope("GET", &upstream.url("/echo"))).await);
    }
    for _ in 0..4 {
        let mut request = envelope("GET", "");
        request.url = upstream.url(&format!("/flaky/{}/2", request.id));
        parked.push((caller.call(&request).await, 3));
    }
    let logs = || format!("--- old ---\n{}\n--- nats ---\n{}", old.logs(), nats.logs());
    all_answered(
        before.into_iter().map(|c| (c, 1)).collect(),
        REPLY_TIMEOUT,
        &logs,
    )
    .await;
    let pool = js.get_stream("WEBPROXY_POOL_DEFAULT").await.expect("pool");
    wait_until(
        REPLY_TIMEOUT,
        "the old version to park four retries",
        || async { messages_on(&pool, "webproxy.retry.default").await == 4 },
    )
    .await;

    let new = Service::start(&nats, &config).await;
    old.terminate();
    // Ready means migrated: nothing is left on layout 1's retry subject.
    assert_eq!(messages_on(&pool, "webproxy.retry.default").await, 0);
    assert_layout3(&js, true).await;
    assert!(
        new.logs()
            .contains("moved the retries that layout 1 parked"),
        "{}",
        new.logs()
    );

    let mut after = Vec::new();
    for _ in 0..3 {
        after.push((
            caller.call(&envelope("GET", &upstream.url("/echo"))).await,
            1,
        ));
    }
    let mut request = envelope("GET", "");
    request.url = upstream.url(&format!("/flaky/{}/1", request.id));
    after.push((caller.call(&request).await, 2));
    let logs = || format!("--- new ---\n{}\n--- old ---\n{}", new.logs(), old.logs());
    // The parked ones went on with their history: 1 attempt by the old version, 2 by
    // the new one.
    all_answered(parked, PARKED_REPLY_TIMEOUT, &logs).await;
    all_answered(after, PARKED_REPLY_TIMEOUT, &logs).await;

    // The clients are upgraded last.
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    let reply = client
        .request(&to("default", &envelope("GET", &upstream.url("/echo"))).wait(REPLY_TIMEOUT))
        .await
        .expect("an upgraded client's reply");
    assert_eq!(reply.status, Some(200));
}

/// New first, then old (a rollback, or an old pod restarting mid-rollout): the old
/// instance cannot rewrite the streams, stays not ready and takes nothing, and the new
/// one answers everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the old binary: run `just test-upgrade`"]
async fn new_first_then_old() {
    let old_binary = old();
    let nats = NatsServer::start();
    let upstream = upstream().await;
    let config = config(&upstream);
    let new = Service::start(&nats, &config).await;
    let old = Service::spawn(&nats.url(), &config, old_binary);
    let js = jetstream::new(nats.client().await);
    refused_by_a_fence(&old).await;

    let caller = OldCaller::new(&nats).await;
    let mut calls = Vec::new();
    for _ in 0..3 {
        calls.push((
            caller.call(&envelope("GET", &upstream.url("/echo"))).await,
            1,
        ));
    }
    for _ in 0..2 {
        let mut request = envelope("GET", "");
        request.url = upstream.url(&format!("/flaky/{}/1", request.id));
        calls.push((caller.call(&request).await, 2));
    }
    let logs = || format!("--- new ---\n{}\n--- old ---\n{}", new.logs(), old.logs());
    all_answered(calls, PARKED_REPLY_TIMEOUT, &logs).await;

    assert!(!old.is_ready().await, "{}", old.logs());
    answered_nothing(&old);
    assert_layout3(&js, false).await;
    // Had the old version got past the fences, its consumer would not be created
    // either: its filter overlaps the new consumer's on the work queue.
    let pool = js.get_stream("WEBPROXY_POOL_DEFAULT").await.expect("pool");
    let refused = pool
        .create_consumer(consumer::pull::Config {
            durable_name: Some("webproxy-default".into()),
            filter_subject: "webproxy.request.default".into(),
            ..Default::default()
        })
        .await
        .expect_err("an overlapping consumer");
    assert!(
        matches!(
            refused.kind(),
            jetstream::stream::ConsumerErrorKind::JetStream(ref e)
                if e.error_code() == jetstream::ErrorCode::CONSUMER_WQ_CONSUMER_NOT_UNIQUE
        ),
        "{refused}"
    );
}

/// Issue 29, points 8 and 10: the fences in memory, as the release before fences moved
/// to file left them (the pool's holding an old pod's stray publish). Today's version
/// starts, deletes them and makes them again on file; an old pod that starts then is
/// still refused by the fences, and the new version answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the old binary: run `just test-upgrade`"]
async fn memory_fences_are_moved_to_file_and_still_keep_old_pods_out() {
    let old_binary = old();
    let nats = NatsServer::start();
    let upstream = upstream().await;
    let config = config(&upstream);
    let js = jetstream::new(nats.client().await);

    // The earlier release's layout: today's streams, the fences in memory.
    let mut earlier = Service::start(&nats, &config).await;
    earlier.terminate();
    assert!(earlier.wait_exit(Duration::from_secs(30)).await.is_some());
    for (name, subject) in FENCES {
        js.delete_stream(name).await.expect(name);
        js.create_stream(jetstream::stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            storage: StorageType::Memory,
            max_messages: 1,
            ..Default::default()
        })
        .await
        .expect(name);
    }
    js.publish("webproxy.retry.default", "stray".into())
        .await
        .expect("publish")
        .await
        .expect("stored in the memory fence");

    let new = Service::start(&nats, &config).await;
    assert_layout3(&js, false).await;
    assert!(
        new.logs()
            .contains("moving fence stream WEBPROXY_FENCE_POOL_DEFAULT"),
        "{}",
        new.logs()
    );

    let old = Service::spawn(&nats.url(), &config, old_binary);
    refused_by_a_fence(&old).await;
    let caller = OldCaller::new(&nats).await;
    let call = caller.call(&envelope("GET", &upstream.url("/echo"))).await;
    let logs = || format!("--- new ---\n{}\n--- old ---\n{}", new.logs(), old.logs());
    all_answered(vec![(call, 1)], REPLY_TIMEOUT, &logs).await;
    answered_nothing(&old);
}

const LAYOUT2_BINARY: &str = "WEBPROXY_LAYOUT2_BINARY";

/// The last build of stream layout 2 (`just test-upgrade` builds it and names it in
/// `WEBPROXY_LAYOUT2_BINARY`).
fn layout2() -> ServiceOptions {
    built(LAYOUT2_BINARY)
}

/// Issue 30, point 4: layout 2 (one replies and one dead-letter stream for every pool)
/// first, then today's in a rolling update. The new instance retires the shared
/// streams and makes the pool's own; a reply and a dead letter stored by layout 2 stay
/// readable, retries it parked are answered by the new one, and a layout 2 instance
/// started afterwards stays not ready and answers nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the layout 2 binary: run `just test-upgrade`"]
async fn layout2_first_then_layout3() {
    let layout2 = layout2();
    let nats = NatsServer::start();
    let upstream = upstream().await;
    let config = config(&upstream);
    let old = Service::start_with(&nats.url(), &config, layout2.clone()).await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    let js = jetstream::new(nats.client().await);

    let stored = client
        .request_answer(
            &to("default", &envelope("GET", &upstream.url("/echo"))).wait(REPLY_TIMEOUT),
        )
        .await
        .unwrap_or_else(|e| panic!("layout 2's reply: {e}\n{}", old.logs()));
    let denied = envelope("GET", "http://127.0.0.1:1/denied");
    let letter = client
        .request_answer(&to("default", &denied).wait(REPLY_TIMEOUT))
        .await
        .expect("layout 2's denial");
    assert!(letter.reply.error.is_some(), "{:?}", letter.reply);
    let caller = OldCaller::new(&nats).await;
    let mut parked = Vec::new();
    for _ in 0..2 {
        let mut request = envelope("GET", "");
        request.url = upstream.url(&format!("/flaky/{}/1", request.id));
        parked.push((caller.call(&request).await, 2));
    }
    // The other two are answered and acked: what the work queue holds is the parks.
    wait_until(REPLY_TIMEOUT, "layout 2 to park two retries", || async {
        let mut pool = js.get_stream("WEBPROXY_POOL_DEFAULT").await.expect("pool");
        pool.info().await.is_ok_and(|info| info.state.messages == 2)
    })
    .await;

    let new = Service::start(&nats, &config).await;
    old.terminate();
    let logs = || format!("--- new ---\n{}\n--- old ---\n{}", new.logs(), old.logs());
    assert_layout3(&js, true).await;
    all_answered(parked, PARKED_REPLY_TIMEOUT, &logs).await;
    // What layout 2 stored is read from its retired streams.
    let reply = client
        .reply(&stored.reply.id, &stored.origin)
        .await
        .expect("lookup")
        .unwrap_or_else(|| panic!("layout 2's stored reply is gone\n{}", logs()));
    assert_eq!(reply.status, Some(200));
    let listed = webproxy_tests::run_webproxy(&[
        "dead",
        "list",
        "--nats",
        &nats.url(),
        "--id",
        &denied.id,
        "--json",
    ])
    .await;
    assert!(listed.status.success(), "{listed:?}");
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(text.contains("\"stream\":\"WEBPROXY_DEAD\""), "{text}");

    // A layout 2 instance that starts now is fenced out.
    let again = Service::spawn(&nats.url(), &config, layout2);
    wait_until(
        REPLY_TIMEOUT,
        "layout 2 to refuse the retired replies stream as newer",
        || async {
            again
                .logs()
                .contains("is newer than this instance's layout 2")
        },
    )
    .await;
    let call = caller.call(&envelope("GET", &upstream.url("/echo"))).await;
    let logs = || {
        format!(
            "--- new ---\n{}\n--- layout 2 ---\n{}",
            new.logs(),
            again.logs()
        )
    };
    all_answered(vec![(call, 1)], REPLY_TIMEOUT, &logs).await;
    assert!(!again.is_ready().await, "{}", again.logs());
    answered_nothing(&again);
}
