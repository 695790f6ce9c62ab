//! Issue 30, point 4: per-pool budgets in what used to be shared streams. Each pool
//! stream's stored replies live in `<POOL STREAM>_REPLIES` and each pool's dead letters
//! in `<POOL STREAM>_DEAD`, each with its own `reply_max_bytes` / `dead_max_bytes`, so
//! a flood through one pool cannot evict another pool's letters and replies before
//! their max age. And layout 2's shared streams migrate: retired (their subjects taken
//! away) but still read, so a reply stored before the upgrade stays readable, and a
//! layout-2 instance's rewrite of them is refused.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer, stream};
use serde_json::{Value, json};
use webproxy_protocol::{ErrorCode, Origin, header};
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, envelope, path_rule, to};
use webproxy_tests::run_webproxy as webproxy;
use webproxy_tests::{NatsServer, Service, ServiceOptions, Upstream};

/// Each pool's replies and dead-letter budget in these tests: a flood of
/// [`FLOOD`] messages of [`BODY`] bytes passes it several times.
const BUDGET: u64 = 256 * 1024;
const BODY: usize = 16 * 1024;
const FLOOD: usize = 64;

fn budgets() -> ServiceOptions {
    let budget = BUDGET.to_string();
    ServiceOptions::default()
        .env("WEBPROXY_STREAMS__REPLY_MAX_BYTES", &budget)
        .env("WEBPROXY_STREAMS__DEAD_MAX_BYTES", &budget)
}

/// Pools `a` and `b`; only `/bytes/` of the upstream is allowed, so `/echo` is denied.
async fn two_pools() -> Harness {
    Harness::start_with_options(Upstream::start().await, budgets(), |up| {
        format!(
            "[pools.a]\nmax_in_flight = 2\n\n[pools.b]\nmax_in_flight = 4\n\n{}",
            path_rule("bytes", up, "/bytes/")
        )
    })
    .await
}

/// The stored messages of `name` now: its first sequence, message count and bytes.
async fn state(js: &jetstream::Context, name: &str) -> stream::State {
    js.get_stream(name)
        .await
        .unwrap_or_else(|e| panic!("stream {name}: {e}"))
        .info()
        .await
        .expect("stream info")
        .state
        .clone()
}

/// The sequence of the last message on `subject` in `stream`, if it has one.
async fn last_on(js: &jetstream::Context, stream: &str, subject: &str) -> Option<u64> {
    let stream = js.get_stream_no_info(stream).await.expect("stream");
    stream
        .get_last_raw_message_by_subject(subject)
        .await
        .ok()
        .map(|message| message.sequence)
}

/// A pool's pre-flood dead letter and stored reply survive another pool's flood, which
/// passes its own budgets several times over and evicts its own oldest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pools_letter_and_reply_survive_another_pools_flood() {
    let h = two_pools().await;
    let js = &h.js;

    // Pool a: one denied request, which leaves a dead letter and a stored reply.
    let victim = envelope("GET", &h.upstream.url("/echo"));
    let victim = h
        .client
        .request_answer(&to("a", &victim).wait(REPLY_TIMEOUT))
        .await
        .expect("pool a's reply");
    assert_eq!(
        victim.reply.error.as_ref().map(|e| e.code),
        Some(ErrorCode::Denied)
    );
    assert_eq!(victim.origin.stream, "WEBPROXY_POOL_A");
    assert_eq!(state(js, "WEBPROXY_POOL_A_DEAD").await.messages, 1);

    // Pool b: denied requests with large bodies (each letter keeps its envelope)
    // and allowed ones with large responses (each stored reply keeps its body).
    let mut first_b = None;
    for n in 0..FLOOD {
        let mut denied = envelope("POST", &h.upstream.url("/echo"));
        denied.body = Some("d".repeat(BODY));
        let large = envelope("GET", &h.upstream.url(&format!("/bytes/{BODY}")));
        for request in [denied, large] {
            let answer = h
                .client
                .request_answer(&to("b", &request).wait(REPLY_TIMEOUT))
                .await
                .unwrap_or_else(|e| panic!("flood {n}: {e}\n{}", h.service.logs()));
            first_b.get_or_insert((request.id.clone(), answer.origin.clone()));
        }
    }

    // The flood passed b's budgets several times and evicted b's oldest...
    let flooded = (FLOOD * BODY) as u64;
    assert!(flooded >= 3 * BUDGET, "the flood is {flooded} bytes");
    for name in ["WEBPROXY_POOL_B_DEAD", "WEBPROXY_POOL_B_REPLIES"] {
        let b = state(js, name).await;
        assert!(b.bytes <= BUDGET, "{name} holds {} bytes", b.bytes);
        assert!(b.first_sequence > 1, "{name} kept its oldest: {b:?}");
    }
    let (first_id, first_origin) = first_b.expect("a flood");
    assert!(
        h.client
            .reply(&first_id, &first_origin)
            .await
            .expect("lookup")
            .is_none(),
        "pool b's first stored reply outlived the flood"
    );

    // ...and left pool a's letter and stored reply where they were.
    let stored = h
        .client
        .reply(&victim.reply.id, &victim.origin)
        .await
        .expect("lookup")
        .expect("pool a's stored reply survived pool b's flood");
    assert_eq!(stored.error.map(|e| e.code), Some(ErrorCode::Denied));
    let letter = last_on(js, "WEBPROXY_POOL_A_DEAD", "webproxy.dead.a").await;
    assert_eq!(
        letter,
        Some(1),
        "pool a's dead letter survived pool b's flood"
    );
    let listed = webproxy(&[
        "dead",
        "list",
        "--nats",
        &h.nats.url(),
        "--pool",
        "a",
        "--json",
    ])
    .await;
    assert!(listed.status.success(), "{listed:?}");
    let lines: Vec<Value> = serde_json::from_slice(&listed.stdout).expect("one JSON array");
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert_eq!(lines[0]["id"], victim.reply.id.as_str());
    assert_eq!(lines[0]["stream"], "WEBPROXY_POOL_A_DEAD");

    // A deployment that began at layout 3 has no shared streams.
    for shared in ["WEBPROXY_REPLIES", "WEBPROXY_DEAD"] {
        assert!(js.get_stream(shared).await.is_err(), "{shared} exists");
    }
}

/// Layout 2's streams as its provisioning left them, made by hand (no layout-2 binary
/// is built for the tests): the pool stream `default` with its `-l2` consumers and its
/// fence, and the shared replies and dead-letter streams.
async fn layout2(js: &jetstream::Context) {
    let layout = |n: &str| HashMap::from([("webproxy.layout".to_string(), n.to_string())]);
    let limits = |name: &str, subject: &str, metadata: HashMap<String, String>| stream::Config {
        name: name.into(),
        subjects: vec![subject.into()],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        max_age: Duration::from_secs(900),
        max_bytes: i64::try_from(BUDGET).expect("budget"),
        discard: stream::DiscardPolicy::Old,
        metadata,
        ..Default::default()
    };
    for config in [
        limits("WEBPROXY_REPLIES", "webproxy.reply.*.*.*", layout("2")),
        // Layout 2 made its dead-letter stream without looking at layouts.
        limits("WEBPROXY_DEAD", "webproxy.dead.>", HashMap::new()),
        limits("WEBPROXY_FENCE_REPLIES", "webproxy.reply.*.*", layout("2")),
        limits(
            "WEBPROXY_FENCE_POOL_DEFAULT",
            "webproxy.retry.default",
            layout("2"),
        ),
        stream::Config {
            name: "WEBPROXY_POOL_DEFAULT".into(),
            subjects: vec![
                "webproxy.request.default".into(),
                "webproxy.hop.default.>".into(),
                "webproxy.retry.default.>".into(),
            ],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            first_sequence: Some(1_700_000_000_000_000),
            metadata: layout("2"),
            ..Default::default()
        },
    ] {
        let name = config.name.clone();
        js.create_stream(config)
            .await
            .unwrap_or_else(|e| panic!("layout 2's {name}: {e}"));
    }
    let pool = js.get_stream("WEBPROXY_POOL_DEFAULT").await.expect("pool");
    for (name, filters) in [
        (
            "webproxy-default-l2",
            vec![
                "webproxy.request.default".to_string(),
                "webproxy.hop.default.>".to_string(),
            ],
        ),
        (
            "webproxy-default-retry-l2",
            vec!["webproxy.retry.default.>".to_string()],
        ),
    ] {
        pool.create_consumer(layout2_consumer(name, filters))
            .await
            .unwrap_or_else(|e| panic!("layout 2's consumer {name}: {e}"));
    }
}

fn layout2_consumer(name: &str, filter_subjects: Vec<String>) -> consumer::pull::Config {
    consumer::pull::Config {
        durable_name: Some(name.into()),
        filter_subjects,
        metadata: HashMap::from([("webproxy.layout".to_string(), "2".to_string())]),
        ..Default::default()
    }
}

/// Stores `payload` on `subject` as layout 2's service did, with the conversation's
/// headers.
async fn store(js: &jetstream::Context, subject: String, origin: &Origin, payload: Value) {
    let mut headers = HeaderMap::new();
    headers.insert(header::ORIGIN, origin.to_string().as_str());
    headers.insert(header::GENERATION, "0");
    headers.insert(header::OUTCOME, "response");
    js.publish_with_headers(subject, headers, payload.to_string().into())
        .await
        .expect("publish")
        .await
        .expect("stored by layout 2's stream");
}

/// The stream's subjects and recorded layout.
async fn subjects_and_layout(js: &jetstream::Context, name: &str) -> (Vec<String>, Option<String>) {
    let mut stream = js.get_stream(name).await.expect(name);
    let config = stream.info().await.expect("info").config.clone();
    (
        config.subjects,
        config.metadata.get("webproxy.layout").cloned(),
    )
}

/// Whether `result` failed because the subjects overlap another stream's (10065).
fn overlaps(result: Result<stream::Info, jetstream::context::UpdateStreamError>) -> bool {
    matches!(result, Err(ref e) if matches!(e.kind(),
        jetstream::context::UpdateStreamErrorKind::JetStream(ref js)
            if js.error_code() == jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP))
}

/// Layout 2's shared streams migrate: a layout-3 instance retires them (their
/// subjects taken away, what they hold kept), creates the pool's own streams, and
/// deletes layout 2's consumers. A reply and a letter stored before the upgrade stay
/// readable, by the client and by `dead list`; what layout 2 would write to take its
/// streams back is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout2s_shared_streams_are_retired_and_still_read() {
    let nats = NatsServer::start();
    let js = jetstream::new(nats.client().await);
    layout2(&js).await;
    let before = Origin::new("WEBPROXY_POOL_DEFAULT", 1_700_000_000_000_005);
    store(
        &js,
        format!("webproxy.reply.before.{}.{}", before.stream, before.seq),
        &before,
        json!({"v": 1, "id": "before", "outcome": "response", "status": 200,
               "body": "stored by layout 2", "attempts": 1, "duration_ms": 5}),
    )
    .await;
    store(
        &js,
        "webproxy.dead.default".into(),
        &before,
        json!({"pool": "default", "id": "before-letter", "generation": 0,
               "origin": before.to_string(),
               "error": {"code": "upstream_error", "message": "stored by layout 2"},
               "envelope": {"id": "before-letter", "method": "GET", "url": "http://127.0.0.1:1/"}}),
    )
    .await;

    let upstream = Upstream::start().await;
    let config = path_rule("bytes", &upstream, "/bytes/");
    let service = Service::start_with(&nats.url(), &config, budgets()).await;

    // Retired: the subjects gone, the layout this one's, the messages kept.
    for (shared, retired) in [
        ("WEBPROXY_REPLIES", "webproxy.retired.replies"),
        ("WEBPROXY_DEAD", "webproxy.retired.dead"),
    ] {
        let (subjects, layout) = subjects_and_layout(&js, shared).await;
        assert_eq!(subjects, [retired], "{shared}\n{}", service.logs());
        assert_eq!(layout.as_deref(), Some("3"), "{shared}");
        assert_eq!(state(&js, shared).await.messages, 1, "{shared}");
    }
    for (own, captures) in [
        (
            "WEBPROXY_POOL_DEFAULT_REPLIES",
            &["webproxy.reply.*.WEBPROXY_POOL_DEFAULT.*"][..],
        ),
        (
            "WEBPROXY_POOL_DEFAULT_DEAD",
            &["webproxy.dead.default", "webproxy.dead.default.superseded"][..],
        ),
    ] {
        let (subjects, layout) = subjects_and_layout(&js, own).await;
        assert_eq!(subjects, captures, "{own}");
        assert_eq!(layout.as_deref(), Some("3"), "{own}");
    }
    let pool = js.get_stream("WEBPROXY_POOL_DEFAULT").await.expect("pool");
    for gone in ["webproxy-default-l2", "webproxy-default-retry-l2"] {
        assert!(pool.consumer_info(gone).await.is_err(), "{gone} is left");
    }
    for made in ["webproxy-default-l3", "webproxy-default-retry-l3"] {
        pool.consumer_info(made).await.expect(made);
    }

    // The reply stored before the upgrade is still read, from the retired stream.
    let client = webproxy_client::Client::new(nats.client().await, "webproxy").expect("client");
    let old = client
        .reply("before", &before)
        .await
        .expect("lookup")
        .expect("the reply stored before the upgrade");
    assert_eq!(old.body.body.as_deref(), Some("stored by layout 2"));
    // New conversations are stored in the pool's own streams.
    let fresh = envelope("GET", &upstream.url("/bytes/3"));
    let answer = client
        .request_answer(&to("default", &fresh).wait(REPLY_TIMEOUT))
        .await
        .unwrap_or_else(|e| panic!("a reply after the migration: {e}\n{}", service.logs()));
    assert_eq!(answer.reply.status, Some(200));
    assert_eq!(
        state(&js, "WEBPROXY_POOL_DEFAULT_REPLIES").await.messages,
        1
    );
    let denied = envelope("GET", &upstream.url("/echo"));
    client
        .request_answer(&to("default", &denied).wait(REPLY_TIMEOUT))
        .await
        .expect("a denied reply");
    // `dead list` reads the retired stream first, then the pool's own.
    let listed = webproxy(&["dead", "list", "--nats", &nats.url(), "--json"]).await;
    assert!(listed.status.success(), "{listed:?}");
    let lines: Vec<Value> = serde_json::from_slice(&listed.stdout).expect("one JSON array");
    let found: Vec<(&str, &str)> = lines
        .iter()
        .map(|l| {
            (
                l["id"].as_str().unwrap_or("-"),
                l["stream"].as_str().unwrap_or("-"),
            )
        })
        .collect();
    assert_eq!(
        found,
        [
            ("before-letter", "WEBPROXY_DEAD"),
            (denied.id.as_str(), "WEBPROXY_POOL_DEFAULT_DEAD")
        ]
    );

    // The fence: what a layout-2 instance writes at its start is refused. Its
    // dead-letter stream and its replies stream (were it not refused first as a newer
    // layout) overlap the pool's own, and its work consumer overlaps layout 3's on
    // the work queue.
    for (shared, subject) in [
        ("WEBPROXY_DEAD", "webproxy.dead.>"),
        ("WEBPROXY_REPLIES", "webproxy.reply.*.*.*"),
    ] {
        let mut stream = js.get_stream(shared).await.expect(shared);
        let mut config = stream.info().await.expect("info").config.clone();
        config.subjects = vec![subject.into()];
        assert!(overlaps(js.update_stream(config).await), "{shared}");
    }
    let refused = pool
        .create_consumer(layout2_consumer(
            "webproxy-default-l2",
            vec![
                "webproxy.request.default".to_string(),
                "webproxy.hop.default.>".to_string(),
            ],
        ))
        .await
        .expect_err("layout 2's work consumer");
    assert!(
        matches!(refused.kind(), stream::ConsumerErrorKind::JetStream(ref e)
            if e.error_code() == jetstream::ErrorCode::CONSUMER_WQ_CONSUMER_NOT_UNIQUE),
        "{refused}"
    );
    assert!(service.is_ready().await, "{}", service.logs());
}
