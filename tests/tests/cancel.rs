//! Issue 35: taking a request back. A caller's cancel (`<prefix>.cancel`, the message
//! id it published with as the capability) or an operator's (`<prefix>.admin.cancel`,
//! by origin alone) is recorded, and the conversation's next delivery ends it: a
//! waiting or parked one without an attempt, an in-flight one by dropping its HTTP
//! request. Its reply says `cancelled`, or is the response of an attempt that finished
//! first; exactly one either way. Real `webproxy serve` processes against a real
//! nats-server and in-process HTTP upstreams.
//!
//! Time bounds are generous (a loaded 2-core CI machine runs several of these at once)
//! and documented where they are set.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_nats::jetstream;
use axum::Router;
use axum::extract::{Path, State};
use axum::routing::any;
use bytes::Bytes;
use futures::StreamExt as _;
use tokio::sync::mpsc;
use webproxy_client::{Client, Submitted, new_msg_id};
use webproxy_protocol::{
    AdminCancelRequest, CancelAnswer, CancelRequest, CancelState, DeadLetter, ErrorCode, Origin,
    Outcome, Reply, Subjects,
};
use webproxy_tests::caller::{
    Harness, REPLY_TIMEOUT, accept_rule, envelope, next_message, stored_reply, to,
};
use webproxy_tests::{
    Gate, NatsServer, Relay, Service, Upstream, default_routes, wait_for, wait_until,
};

/// The answer to a cancel of an unknown origin, which a wrong message id must get
/// byte for byte.
const UNKNOWN: &[u8] = br#"{"cancel":"unknown"}"#;

/// The default routes and `/gated/{ms}`, held until the test passes them.
async fn gated_upstream(gate: &Gate) -> Upstream {
    Upstream::start_with(default_routes().merge(gate.routes())).await
}

/// One pool of `slots` and one rule accepting the upstream, with the rule's `extra`
/// keys; a 60 s attempt timeout, so no attempt the test holds ends on its own.
fn config(up: &Upstream, slots: u32, extra: &str) -> String {
    format!(
        "[pools.default]\nmax_in_flight = {slots}\n\n{}timeout = \"60s\"\n{extra}\n",
        accept_rule("local", up)
    )
}

/// Publishes a GET of `path` to the default pool, without waiting for its reply.
async fn submit(h: &Harness, path: &str) -> Submitted {
    h.client
        .submit(&to("default", &envelope("GET", &h.upstream.url(path))))
        .await
        .expect("submit")
}

/// The caller's cancel of `submitted`, with its own message id.
async fn cancel(h: &Harness, submitted: &Submitted) -> CancelState {
    h.client
        .cancel(&submitted.id, &submitted.origin, &submitted.msg_id)
        .await
        .unwrap_or_else(|e| panic!("cancel {}: {e}\n{}", submitted.id, h.service.logs()))
}

/// The stored reply of `submitted`, once there is one.
async fn reply_of(h: &Harness, submitted: &Submitted, within: Duration) -> Reply {
    wait_for(
        within,
        &format!("the reply to {}", submitted.id),
        || async {
            h.client
                .reply(&submitted.id, &submitted.origin)
                .await
                .ok()
                .flatten()
        },
    )
    .await
}

/// The dead letter of conversation `id`, once it is stored.
async fn letter_of(h: &Harness, id: &str) -> DeadLetter {
    wait_for(
        REPLY_TIMEOUT,
        &format!("the dead letter of {id}"),
        || async {
            h.dead_letters()
                .await
                .into_iter()
                .map(|(_, letter)| letter)
                .find(|letter| letter.id.as_deref() == Some(id))
        },
    )
    .await
}

/// Asserts `reply` is the `cancelled` error reply with `attempts` attempts.
fn assert_cancelled(reply: &Reply, attempts: u32) {
    assert_eq!(reply.outcome, Outcome::Error, "{reply:?}");
    assert_eq!(
        reply.error.as_ref().map(|e| e.code),
        Some(ErrorCode::Cancelled),
        "{reply:?}"
    );
    assert_eq!(reply.attempts, attempts, "{reply:?}");
}

/// A core NATS request of `payload` to `subject`, answered within 10 s: the raw
/// answer, headers and all.
async fn ask(nats: &async_nats::Client, subject: String, payload: Vec<u8>) -> async_nats::Message {
    tokio::time::timeout(
        Duration::from_secs(10),
        nats.request(subject.clone(), payload.into()),
    )
    .await
    .unwrap_or_else(|_| panic!("no answer on {subject} within 10 s"))
    .unwrap_or_else(|e| panic!("request on {subject}: {e}"))
}

/// A caller's cancel sent as raw bytes on `<prefix>.cancel`, answered raw: what a
/// caller without the client library sees.
async fn raw_cancel(h: &Harness, id: &str, origin: &str, msg_id: &str) -> async_nats::Message {
    let request = CancelRequest {
        id: id.to_string(),
        origin: origin.to_string(),
        msg_id: msg_id.to_string(),
    };
    ask(
        h.client.nats(),
        h.subjects.cancel(),
        serde_json::to_vec(&request).expect("encode"),
    )
    .await
}

/// How many replies the replies stream stores on `submitted`'s own subject.
async fn stored_count(js: &jetstream::Context, subjects: &Subjects, submitted: &Submitted) -> u64 {
    let subject = subjects.stored_reply(&submitted.id, &submitted.origin);
    let stream = js
        .get_stream(subjects.replies_stream_of(&submitted.origin))
        .await
        .expect("the replies stream");
    let mut info = stream
        .info_with_subjects(subject.clone())
        .await
        .expect("stream info");
    let mut count = 0;
    while let Some(entry) = info.next().await {
        let (listed, n) = entry.expect("a subject count");
        if listed == subject {
            count += n as u64;
        }
    }
    count
}

/// Waits until the metric counts `count` cancels of the default pool's conversations in
/// `state`.
async fn assert_cancelled_total(service: &Service, state: &str, count: f64) {
    let series =
        format!("webproxy_conversations_cancelled_total{{pool=\"default\",state=\"{state}\"}}");
    wait_until(
        Duration::from_secs(10),
        &format!("{series} = {count}"),
        || async { service.metric(&series).await == Some(count) },
    )
    .await;
}

/// A request to `/status/503` whose first attempt was made and whose retry is parked
/// (the pool holds no delivery of it, the retry consumer one).
async fn one_parked(h: &Harness) -> Submitted {
    let parked = submit(h, "/status/503").await;
    let pool =
        h.js.get_stream(h.subjects.pool_stream("default"))
            .await
            .expect("the pool stream");
    wait_until(
        REPLY_TIMEOUT,
        "the first attempt's retry to be parked",
        || async {
            let work = pool
                .consumer_info(h.subjects.pool_consumer("default"))
                .await;
            let retry = pool
                .consumer_info(h.subjects.retry_consumer("default"))
                .await;
            matches!((work, retry), (Ok(w), Ok(r))
            if h.upstream.hits_for("/status/503") == 1
                && w.num_ack_pending == 0
                && r.num_pending + r.num_ack_pending as u64 == 1)
        },
    )
    .await;
    parked
}

/// A gated pool of one slot whose slot the first request holds at the upstream, and a
/// second request waiting behind it: that one, to be cancelled.
async fn one_waiting(h: &Harness) -> (Submitted, Submitted) {
    let first = submit(h, "/gated/0").await;
    wait_until(
        REPLY_TIMEOUT,
        "the first request to hold the slot",
        || async { h.upstream.hits_for("/gated/0") == 1 },
    )
    .await;
    let waiting = submit(h, "/echo").await;
    wait_until(REPLY_TIMEOUT, "the second request to wait", || async {
        h.pool_consumer("default").await.num_pending == 1
    })
    .await;
    (first, waiting)
}

/// The request to cancel waits behind a busy pool of one slot; it is answered
/// `cancelled` without an attempt once the slot frees, and the upstream never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_conversation_is_cancelled_without_an_attempt() {
    let gate = Gate::new();
    let h = Harness::start_with_upstream(gated_upstream(&gate).await, |up| config(up, 1, "")).await;
    let (first, waiting) = one_waiting(&h).await;

    assert_eq!(cancel(&h, &waiting).await, CancelState::Recorded);
    gate.pass(1);
    assert_eq!(reply_of(&h, &first, REPLY_TIMEOUT).await.status, Some(200));
    let reply = reply_of(&h, &waiting, REPLY_TIMEOUT).await;
    assert_cancelled(&reply, 0);
    let letter = letter_of(&h, &waiting.id).await;
    assert_eq!(letter.error.code, ErrorCode::Cancelled, "{letter:?}");
    assert!(letter.attempts.is_empty(), "{letter:?}");
    assert_eq!(h.upstream.hits_for("/echo"), 0, "the upstream saw it");
    assert_cancelled_total(&h.service, "waiting", 1.0).await;
}

/// The cancel records in the bucket, as keys: what a caller's cancels have spent.
async fn cancel_records(h: &Harness) -> Vec<String> {
    let Ok(bucket) = h.js.get_key_value(h.subjects.cancel_bucket()).await else {
        return Vec::new();
    };
    match bucket.keys().await {
        Ok(keys) => keys.filter_map(|key| async { key.ok() }).collect().await,
        Err(_) => Vec::new(),
    }
}

/// What one caller can spend on cancel records: one per conversation under way whose
/// message id it shows, however often it asks, none for a wrong message id or an
/// unknown origin, and none left once the conversation settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_records_are_one_per_conversation_under_way_and_go_when_it_settles() {
    let gate = Gate::new();
    let h = Harness::start_with_upstream(gated_upstream(&gate).await, |up| config(up, 1, "")).await;
    let (first, waiting) = one_waiting(&h).await;

    for _ in 0..5 {
        assert_eq!(cancel(&h, &waiting).await, CancelState::Recorded);
    }
    let stranger = Submitted {
        msg_id: "0123456789abcdef0123456789abcdef".into(),
        ..first.clone()
    };
    assert_eq!(cancel(&h, &stranger).await, CancelState::Unknown);
    let nowhere = Submitted {
        origin: Origin::new(first.origin.stream.clone(), 1),
        ..first.clone()
    };
    assert_eq!(cancel(&h, &nowhere).await, CancelState::Unknown);
    assert_eq!(
        cancel_records(&h).await,
        [waiting.origin.record_key(0)],
        "one record, the waiting conversation's"
    );

    gate.pass(1);
    assert_eq!(reply_of(&h, &first, REPLY_TIMEOUT).await.status, Some(200));
    assert_cancelled(&reply_of(&h, &waiting, REPLY_TIMEOUT).await, 0);
    wait_until(REPLY_TIMEOUT, "no cancel record once settled", || async {
        cancel_records(&h).await.is_empty()
    })
    .await;
}

/// A conversation parked for its retry is answered `cancelled` when the retry comes
/// due, listing the one attempt made, and no second attempt is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_conversation_is_cancelled_when_its_retry_comes_due() {
    let h = Harness::start_with_upstream(Upstream::start().await, |up| {
        config(
            up,
            4,
            "max_retries = 3\nretry_delay = \"3s\"\nbackoff_factor = 1.0",
        )
    })
    .await;
    let parked = one_parked(&h).await;
    assert!(
        h.client
            .reply(&parked.id, &parked.origin)
            .await
            .expect("lookup")
            .is_none(),
        "a parked conversation has no reply yet"
    );

    assert_eq!(cancel(&h, &parked).await, CancelState::Recorded);
    // Due 3 s after its attempt; the rest of the bound is for a loaded machine.
    let reply = reply_of(&h, &parked, REPLY_TIMEOUT).await;
    assert_cancelled(&reply, 1);
    assert_eq!(h.upstream.hits_for("/status/503"), 1, "attempted again");
    let letter = letter_of(&h, &parked.id).await;
    assert_eq!(letter.error.code, ErrorCode::Cancelled, "{letter:?}");
    assert_eq!(letter.attempts.len(), 1, "{letter:?}");
    assert_eq!(letter.attempts[0].status, Some(503), "{letter:?}");
    assert_cancelled_total(&h.service, "parked", 1.0).await;
}

/// `/held`: counts the request (as every route is counted) and never answers; when the
/// server drops the handler, because the client closed its connection, it says so.
#[derive(Clone, Default)]
struct Held {
    dropped: Arc<AtomicBool>,
}

/// Sets its flag when dropped: the handler's future is dropped with the connection.
struct OnDrop(Arc<AtomicBool>);

impl Drop for OnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

async fn held(State(held): State<Held>) -> &'static str {
    let _dropped = OnDrop(held.dropped.clone());
    std::future::pending::<&'static str>().await
}

/// An attempt the upstream holds is dropped at once on a cancel: the reply says
/// `cancelled` well before the rule's 60 s timeout, the dead letter lists the attempt as
/// cancelled, the upstream sees the connection closed, and the rule's retries are not
/// used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_flight_attempt_is_dropped_on_a_cancel() {
    let held_route = Held::default();
    let dropped = held_route.dropped.clone();
    let upstream = Upstream::start_with(
        Router::new()
            .route("/held", any(held))
            .with_state(held_route),
    )
    .await;
    let h = Harness::start_with_upstream(upstream, |up| {
        config(up, 4, "max_retries = 2\nretry_delay = \"100ms\"")
    })
    .await;
    let in_flight = submit(&h, "/held").await;
    wait_until(REPLY_TIMEOUT, "the attempt at the upstream", || async {
        h.upstream.hits_for("/held") == 1
    })
    .await;

    let cancelled_at = Instant::now();
    assert_eq!(cancel(&h, &in_flight).await, CancelState::Recorded);
    // "At once": 15 s is a quarter of the rule's timeout, and far more than dropping a
    // connection and settling take even on a loaded machine.
    let reply = reply_of(&h, &in_flight, Duration::from_secs(15)).await;
    assert!(cancelled_at.elapsed() < Duration::from_secs(15));
    assert_cancelled(&reply, 1);
    let letter = letter_of(&h, &in_flight.id).await;
    assert_eq!(letter.error.code, ErrorCode::Cancelled, "{letter:?}");
    assert_eq!(letter.attempts.len(), 1, "{letter:?}");
    let failure = letter.attempts[0].failure.as_deref().unwrap_or_default();
    assert!(failure.starts_with("cancelled"), "{letter:?}");
    wait_until(
        Duration::from_secs(10),
        "the upstream to see the request dropped",
        || async { dropped.load(Ordering::SeqCst) },
    )
    .await;
    assert_eq!(h.upstream.hits_for("/held"), 1, "attempted again");
    assert_cancelled_total(&h.service, "in_flight", 1.0).await;
}

/// A conversation that has its reply answers `finished`, and its stored reply stays
/// the very message it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_conversation_answers_finished_and_is_unchanged() {
    let h = Harness::start_with_upstream(Upstream::start().await, |up| config(up, 4, "")).await;
    let finished = submit(&h, "/echo").await;
    assert_eq!(
        reply_of(&h, &finished, REPLY_TIMEOUT).await.status,
        Some(200)
    );
    let before = h
        .client
        .reply_message(&finished.id, &finished.origin)
        .await
        .expect("lookup")
        .expect("stored");

    assert_eq!(cancel(&h, &finished).await, CancelState::Finished);
    let after = h
        .client
        .reply_message(&finished.id, &finished.origin)
        .await
        .expect("lookup")
        .expect("stored");
    assert_eq!(after.sequence, before.sequence, "the stored reply changed");
    assert_eq!(after.payload, before.payload, "the stored reply changed");
    assert_eq!(stored_count(&h.js, &h.subjects, &finished).await, 1);
    assert!(
        h.dead_letters().await.is_empty(),
        "a dead letter was stored"
    );
    assert_eq!(h.upstream.hits_for("/echo"), 1);
}

/// A wrong message id gets the unknown origin's answer, byte for byte, whatever state
/// the conversation is in, and changes nothing: each conversation then ends as it
/// would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_msg_id_answers_as_an_unknown_origin_in_every_state() {
    let gate = Gate::new();
    // One slot; /status/ is retried once 5 s later: long enough to ask while it is
    // parked, short enough for the test.
    let h = Harness::start_with_upstream(gated_upstream(&gate).await, |up| {
        let retried = webproxy_tests::caller::path_rule("retried", up, "/status/");
        format!(
            "{retried}max_retries = 1\nretry_delay = \"5s\"\n\n{}",
            config(up, 1, "")
        )
    })
    .await;
    let made_up = format!("{}:{}", h.subjects.pool_stream("default"), 1u64 << 62);
    let unknown = raw_cancel(&h, "made-up", &made_up, &new_msg_id().expect("msg id")).await;
    assert_eq!(unknown.payload, UNKNOWN, "a made-up origin");
    let wrong = |submitted: &Submitted| {
        let (id, origin) = (submitted.id.clone(), submitted.origin.to_string());
        let h = &h;
        async move {
            let answer = raw_cancel(h, &id, &origin, &new_msg_id().expect("msg id")).await;
            (answer.payload, answer.headers)
        }
    };
    let as_unknown = (unknown.payload.clone(), unknown.headers.clone());

    let finished = submit(&h, "/echo").await;
    assert_eq!(
        reply_of(&h, &finished, REPLY_TIMEOUT).await.status,
        Some(200)
    );
    let finished_reply = h
        .client
        .reply_message(&finished.id, &finished.origin)
        .await
        .expect("lookup")
        .expect("stored");
    assert_eq!(wrong(&finished).await, as_unknown, "finished");

    let parked = one_parked(&h).await;
    assert_eq!(wrong(&parked).await, as_unknown, "parked");

    let in_flight = submit(&h, "/gated/0").await;
    wait_until(REPLY_TIMEOUT, "the attempt at the upstream", || async {
        h.upstream.hits_for("/gated/0") == 1
    })
    .await;
    assert_eq!(wrong(&in_flight).await, as_unknown, "in flight");

    let waiting = submit(&h, "/echo").await;
    wait_until(REPLY_TIMEOUT, "the request to wait", || async {
        h.pool_consumer("default").await.num_pending >= 1
    })
    .await;
    assert_eq!(wrong(&waiting).await, as_unknown, "waiting");

    // Nothing was cancelled: each ends as it would have.
    gate.pass(1);
    assert_eq!(
        reply_of(&h, &in_flight, REPLY_TIMEOUT).await.status,
        Some(200)
    );
    let waited = reply_of(&h, &waiting, REPLY_TIMEOUT).await;
    assert_eq!(waited.status, Some(200), "{waited:?}");
    assert_eq!(waited.attempts, 1);
    // Its retry is due 5 s after its first attempt.
    let retried = reply_of(&h, &parked, REPLY_TIMEOUT).await;
    assert_eq!(
        retried.error.as_ref().map(|e| e.code),
        Some(ErrorCode::RetriesExhausted),
        "{retried:?}"
    );
    assert_eq!(retried.attempts, 2);
    let unchanged = h
        .client
        .reply_message(&finished.id, &finished.origin)
        .await
        .expect("lookup")
        .expect("stored");
    assert_eq!(unchanged.sequence, finished_reply.sequence);
    assert_eq!(unchanged.payload, finished_reply.payload);
    let cancelled: Vec<_> = h
        .dead_letters()
        .await
        .into_iter()
        .filter(|(_, letter)| letter.error.code == ErrorCode::Cancelled)
        .collect();
    assert!(cancelled.is_empty(), "cancelled: {cancelled:?}");

    // An origin in no stream at all is as unknown as a sequence its stream never had.
    let no_stream = raw_cancel(&h, "made-up", "WEBPROXY_POOL_NOPE:1", "x").await;
    assert_eq!(
        (no_stream.payload.clone(), no_stream.headers),
        as_unknown,
        "a made-up stream: {}",
        String::from_utf8_lossy(&no_stream.payload)
    );
}

/// A small deterministic generator, seeded per run and printed: the tests need varied
/// timings, not secure ones.
struct XorShift(u64);

impl XorShift {
    fn seeded() -> XorShift {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        println!("seed {seed}");
        XorShift(seed)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// `/race/{n}/{ms}`: says `n` arrived, then answers 200 `ok` after `ms` milliseconds.
async fn race(
    State(arrived): State<mpsc::UnboundedSender<u64>>,
    Path((n, ms)): Path<(u64, u64)>,
) -> &'static str {
    let _ = arrived.send(n);
    tokio::time::sleep(Duration::from_millis(ms)).await;
    "ok"
}

/// A cancel racing with an attempt that finishes 0–30 ms after it arrives ends with
/// exactly one reply, stored and live: the response (the attempt won) or `cancelled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_racing_a_finishing_attempt_ends_with_one_reply() {
    const ROUNDS: u64 = 20;
    let (arrived, mut arrivals) = mpsc::unbounded_channel();
    let upstream = Upstream::start_with(
        Router::new()
            .route("/race/{n}/{ms}", any(race))
            .with_state(arrived),
    )
    .await;
    let h = Harness::start_with_upstream(upstream, |up| config(up, 4, "")).await;
    let mut random = XorShift::seeded();
    let mut rounds = Vec::new();
    for n in 0..ROUNDS {
        let path = format!("/race/{n}/{}", random.below(31));
        let request = envelope("GET", &h.upstream.url(&path));
        let live = h
            .client
            .nats()
            .subscribe(h.subjects.reply(&request.id))
            .await
            .expect("subscribe to the live reply");
        h.client.nats().flush().await.expect("flush");
        let submitted = h
            .client
            .submit(&to("default", &request))
            .await
            .expect("submit");
        // Every fourth round cancels at once (the attempt may not have started);
        // the others once the attempt is at the upstream, 0–30 ms later: before, about
        // when or after the upstream answers.
        if n % 4 != 0 {
            let seen = tokio::time::timeout(REPLY_TIMEOUT, async {
                while let Some(m) = arrivals.recv().await {
                    if m == n {
                        return;
                    }
                }
            })
            .await;
            assert!(seen.is_ok(), "round {n}'s attempt never arrived");
            // The jitter is the point: it moves the cancel across the attempt's end.
            tokio::time::sleep(Duration::from_millis(random.below(31))).await;
        }
        let state = cancel(&h, &submitted).await;
        assert_ne!(state, CancelState::Unknown, "round {n}");
        let reply = reply_of(&h, &submitted, REPLY_TIMEOUT).await;
        match (&reply.outcome, reply.error.as_ref().map(|e| e.code)) {
            (Outcome::Response, _) => {
                assert_eq!(reply.status, Some(200), "round {n}: {reply:?}");
                assert_eq!(reply.body.body.as_deref(), Some("ok"), "round {n}");
            }
            (Outcome::Error, Some(ErrorCode::Cancelled)) => {
                assert_eq!(state, CancelState::Recorded, "round {n}: {reply:?}");
                assert!(reply.attempts <= 1, "round {n}: {reply:?}");
            }
            _ => panic!("round {n} ended neither answered nor cancelled: {reply:?}"),
        }
        rounds.push((n, path, submitted, live, reply));
    }

    let mut outcomes = BTreeMap::new();
    let mut afterwards = Vec::new();
    let letters = h.dead_letters().await;
    for (n, path, submitted, mut live, reply) in rounds {
        assert_eq!(
            stored_count(&h.js, &h.subjects, &submitted).await,
            1,
            "round {n}'s stored replies"
        );
        let first = next_message(&mut live, REPLY_TIMEOUT, "a live reply").await;
        let seen: Reply = serde_json::from_slice(&first.payload).expect("a live reply");
        assert_eq!(
            (seen.outcome, seen.status, seen.error.map(|e| e.code)),
            (
                reply.outcome,
                reply.status,
                reply.error.as_ref().map(|e| e.code)
            ),
            "round {n}: the live reply is not the stored one"
        );
        afterwards.push(live.map(move |_| n));
        let cancelled = reply.outcome == Outcome::Error;
        let lettered = letters
            .iter()
            .any(|(_, letter)| letter.id.as_deref() == Some(submitted.id.as_str()));
        assert_eq!(lettered, cancelled, "round {n}: dead letter iff cancelled");
        *outcomes
            .entry(if cancelled { "cancelled" } else { "answered" })
            .or_insert(0) += 1;
        assert!(h.upstream.hits_for(&path) <= 1, "round {n}");
    }
    // A second live copy would follow its first within moments, and the earlier
    // rounds had the later ones' time besides: 500 ms more is plenty.
    let mut afterwards = futures::stream::select_all(afterwards);
    let again = tokio::time::timeout(Duration::from_millis(500), afterwards.next()).await;
    if let Ok(Some(n)) = again {
        panic!("round {n} got a second live reply");
    }
    println!("race: {outcomes:?}");
}

/// Every live reply on `webproxy.reply.<id>`, by id, as a subscriber saw them.
#[derive(Clone, Default)]
struct Live(Arc<Mutex<BTreeMap<String, Vec<Bytes>>>>);

impl Live {
    async fn subscribe(nats: &async_nats::Client) -> Live {
        let live = Live::default();
        let mut replies = nats.subscribe("webproxy.reply.*").await.expect("subscribe");
        nats.flush().await.expect("flush");
        let sink = live.clone();
        tokio::spawn(async move {
            while let Some(message) = replies.next().await {
                let id = message.subject.trim_start_matches("webproxy.reply.");
                sink.lock()
                    .entry(id.to_string())
                    .or_default()
                    .push(message.payload);
            }
        });
        live
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<Bytes>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn count(&self, id: &str) -> usize {
        self.lock().get(id).map_or(0, Vec::len)
    }
}

/// Cancels landing at random moments (on waiting and in-flight conversations alike)
/// never let a pool of two slots run more than two attempts at once, and every
/// conversation ends with exactly one reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pools_limit_holds_while_cancels_land() {
    const REQUESTS: usize = 20;
    let h = Harness::start_with_upstream(Upstream::start().await, |up| config(up, 2, "")).await;
    let live = Live::subscribe(h.client.nats()).await;
    let mut random = XorShift::seeded();
    let mut submitted = Vec::with_capacity(REQUESTS);
    let mut cancels = Vec::new();
    for i in 0..REQUESTS {
        // 200–600 ms each, two at a time: some 4 s in all, across which the cancels
        // land on conversations waiting, in flight and finished.
        let path = format!("/delay/{}", 200 + random.below(401));
        let s = submit(&h, &path).await;
        if i % 2 == 0 {
            let after = Duration::from_millis(random.below(3000));
            let client = h.client.clone();
            let s = s.clone();
            cancels.push(tokio::spawn(async move {
                // The random moment is the point of the test.
                tokio::time::sleep(after).await;
                client.cancel(&s.id, &s.origin, &s.msg_id).await
            }));
        }
        submitted.push(s);
    }
    for (k, cancel) in cancels.into_iter().enumerate() {
        let state = cancel.await.expect("the cancel task").expect("cancel");
        assert_ne!(state, CancelState::Unknown, "request {}", 2 * k);
    }
    let mut cancelled = 0;
    for (i, s) in submitted.iter().enumerate() {
        // Twenty 600 ms attempts two at a time take 6 s; the rest is for a loaded machine.
        let reply = reply_of(&h, s, Duration::from_secs(40)).await;
        match reply.error.as_ref().map(|e| e.code) {
            None => assert_eq!(reply.status, Some(200), "request {i}: {reply:?}"),
            Some(ErrorCode::Cancelled) if i % 2 == 0 => cancelled += 1,
            Some(_) => panic!("request {i}: {reply:?}"),
        }
        assert_eq!(stored_count(&h.js, &h.subjects, s).await, 1, "request {i}");
    }
    wait_until(REPLY_TIMEOUT, "a live reply to every request", || async {
        submitted.iter().all(|s| live.count(&s.id) >= 1)
    })
    .await;
    // A second live copy would follow its first within moments: 1 s is plenty.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for (i, s) in submitted.iter().enumerate() {
        assert_eq!(live.count(&s.id), 1, "request {i}'s live replies");
    }
    assert!(
        h.upstream.max_concurrent() <= 2,
        "{} attempts at once: {:?}",
        h.upstream.max_concurrent(),
        h.upstream.busiest_calls()
    );
    println!(
        "limit: {cancelled} of {} cancels ended cancelled",
        REQUESTS / 2
    );
}

/// A cancel recorded just before the instance holding the attempt dies: the
/// redelivery on the other instance ends `cancelled`, and the upstream gets no second
/// call.
///
/// Instance A alone runs when the request is published, so A holds its attempt; B
/// starts once the attempt is at the upstream. A's connection to NATS is then cut, so
/// that A cannot learn of the cancel and end the conversation itself (and the cancel
/// is answered by B, the only instance the server still knows), and A is killed as
/// soon as the cancel is recorded. The message comes back to B once `ack_wait` (5 s)
/// has passed since A's last progress ack; 30 s allows for that on a loaded machine.
/// `ack_wait` is 5 s, not less, so that the cancel is recorded before the redelivery
/// reaches B even when the first ask went to A's dying subscription and timed out
/// (2 s): a redelivery that came first would rightly attempt, and be dropped by the
/// cancel in flight, which is another test's case.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_killed_right_after_a_cancel_leaves_the_redelivery_to_end_it() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let config = format!(
        "[service]\nack_wait = \"5s\"\n\n{}",
        config(&upstream, 1, "max_retries = 2\nretry_delay = \"100ms\"")
    );
    let relay = Relay::start(SocketAddr::from((Ipv4Addr::LOCALHOST, nats.port()))).await;
    let mut a = Service::start_with_url(&relay.nats_url(), &config).await;
    let observer = nats.client().await;
    let client = Client::new(observer.clone(), "webproxy").expect("client");
    let subjects = Subjects::new("webproxy").expect("prefix");
    let request = envelope("GET", &upstream.url("/hang"));
    let mut live = observer
        .subscribe(subjects.reply(&request.id))
        .await
        .expect("subscribe");
    observer.flush().await.expect("flush");
    let submitted = client
        .submit(&to("default", &request))
        .await
        .expect("submit");
    wait_until(REPLY_TIMEOUT, "A's attempt at the upstream", || async {
        upstream.hits_for("/hang") == 1
    })
    .await;
    let b = Service::start(&nats, &config).await;

    relay.cut();
    let answer = cancel_until_answered(&observer, &subjects, &submitted).await;
    a.kill();
    assert_eq!(
        answer.cancel,
        Some(CancelState::Recorded),
        "{answer:?}\n{}",
        b.logs()
    );

    let message = next_message(&mut live, Duration::from_secs(30), "the reply").await;
    let reply: Reply = serde_json::from_slice(&message.payload).expect("a reply");
    assert_eq!(
        reply.error.as_ref().map(|e| e.code),
        Some(ErrorCode::Cancelled),
        "{reply:?}\n{}",
        b.logs()
    );
    let js = jetstream::new(observer.clone());
    let stored = stored_reply(&client, &submitted.id, &submitted.origin, REPLY_TIMEOUT).await;
    assert_eq!(stored.error.map(|e| e.code), Some(ErrorCode::Cancelled));
    assert_eq!(stored_count(&js, &subjects, &submitted).await, 1);
    assert_eq!(upstream.hits_for("/hang"), 1, "B called the upstream again");
    let letters = webproxy_tests::dead_letter_count(&js).await;
    assert_eq!(letters, Some(1), "one dead letter");
}

/// The caller's cancel of `submitted`, asked again while no instance answers: one that
/// just lost its connection may still hold the server's attention for a moment.
async fn cancel_until_answered(
    nats: &async_nats::Client,
    subjects: &Subjects,
    submitted: &Submitted,
) -> CancelAnswer {
    let request = CancelRequest {
        id: submitted.id.clone(),
        origin: submitted.origin.to_string(),
        msg_id: submitted.msg_id.clone(),
    };
    let payload = Bytes::from(serde_json::to_vec(&request).expect("encode"));
    wait_for(REPLY_TIMEOUT, "an answer to the cancel", || async {
        let asked = nats.request(subjects.cancel(), payload.clone());
        let answer = tokio::time::timeout(Duration::from_secs(2), asked)
            .await
            .ok()?
            .ok()?;
        serde_json::from_slice(&answer.payload).ok()
    })
    .await
}

/// An operator's cancel by origin alone ends a waiting conversation, and its dead
/// letter says an operator cancelled it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_cancels_by_origin_alone() {
    let gate = Gate::new();
    let h = Harness::start_with_upstream(gated_upstream(&gate).await, |up| config(up, 1, "")).await;
    let (first, waiting) = one_waiting(&h).await;

    let request = AdminCancelRequest {
        origin: waiting.origin.to_string(),
    };
    let answer = ask(
        h.client.nats(),
        h.subjects.admin_cancel(),
        serde_json::to_vec(&request).expect("encode"),
    )
    .await;
    assert_eq!(
        answer.payload,
        br#"{"cancel":"recorded"}"#.as_slice(),
        "{}",
        String::from_utf8_lossy(&answer.payload)
    );
    gate.pass(1);
    assert_eq!(reply_of(&h, &first, REPLY_TIMEOUT).await.status, Some(200));
    assert_cancelled(&reply_of(&h, &waiting, REPLY_TIMEOUT).await, 0);
    let letter = letter_of(&h, &waiting.id).await;
    assert_eq!(letter.error.code, ErrorCode::Cancelled, "{letter:?}");
    assert!(
        letter.error.message.to_lowercase().contains("operator"),
        "{letter:?}"
    );
    assert_eq!(h.upstream.hits_for("/echo"), 0, "the upstream saw it");

    // The same origin again: the conversation has its reply now.
    let again = ask(
        h.client.nats(),
        h.subjects.admin_cancel(),
        serde_json::to_vec(&request).expect("encode"),
    )
    .await;
    assert_eq!(again.payload, br#"{"cancel":"finished"}"#.as_slice());
}
