//! The handler's paths in-process: a fake delivery (whose acks are recorded) against a
//! real nats-server, so each way a delivery can end is checked without a service
//! process. Upstream attempts go to a closed loopback port, which fails at once and is
//! retried: the park path needs no HTTP server.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream;
use webproxy_config::secrets::Secrets;
use webproxy_config::testing::settings_from;
use webproxy_protocol::{DeadLetter, Origin, header};
use webproxy_testkit::NatsServer;
use webproxy_worker::{Worker, WorkerConfig};

use super::delivery::DeliveryInfo;
use super::delivery::fake::FakeDelivery;
use super::ending::Settled;
use super::handle::handle_delivery;
use super::liveness::Liveness;
use super::progress::{Progress, Record};
use super::publish::Outlet;
use super::{Gauges, Health, Revision};
use crate::hop::{HopState, subject_token};
use crate::observability::metrics::Metrics;

pub(super) const STREAM: &str = "WEBPROXY_POOL_DEFAULT";

/// A closed port on loopback: connecting fails at once.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

pub(super) struct Fixture {
    _nats: NatsServer,
    pub(super) shared: Revision,
    pub(super) js: jetstream::Context,
    url: String,
}

impl Fixture {
    pub(super) async fn start() -> Fixture {
        let nats = NatsServer::start();
        let url = format!("http://127.0.0.1:{}/x", closed_port());
        let settings = settings_from(&format!(
            r#"
            [nats]
            url = "{}"
            [outbound]
            allow_private_networks = true
            [[request_rules]]
            name = "local"
            method = "*"
            url_pattern = '^http://127\.0\.0\.1:'
            action = "accept"
            max_retries = 5
            retry_delay = "1h"
            "#,
            nats.url()
        ))
        .expect("valid config");
        let client = nats.client().await;
        let js = jetstream::new(client.clone());
        let provisioned = crate::runtime::start::provision(&js, &settings)
            .await
            .expect("provisioned");
        let worker = Worker::new(&WorkerConfig {
            max_response_bytes: 64 * 1024,
            guard: crate::egress::guard_policy(&settings.cluster.outbound.guard),
            max_response_headers: settings.cluster.outbound.max_headers,
            max_response_header_bytes: settings.cluster.outbound.max_header_bytes,
            dns: webproxy_worker::DnsConfig::default(),
        })
        .expect("worker");
        let secrets = Secrets::empty();
        let outlet = Outlet::new(
            client,
            settings.subjects.clone(),
            1024 * 1024,
            Arc::new(Metrics::new("test")),
            secrets.redactor().clone(),
            Progress::new(provisioned.progress, Arc::new(Health::new())),
        );
        let health = Arc::new(Health::new());
        let shared = Revision {
            pool_control: Arc::new(crate::pool::control::PoolControl::new(
                outlet.js.clone(),
                outlet.metrics.clone(),
                health.clone(),
                &settings,
            )),
            health,
            pacing: Arc::new(super::pacing::Pacing::new(settings.cluster.ack_wait)),
            gauges: {
                let gauges = Gauges::default();
                gauges.add(settings.cluster.pools.keys());
                Arc::new(gauges)
            },
            settings: Arc::new(settings),
            outlet,
            worker,
            secrets: Arc::new(secrets),
        };
        Fixture {
            _nats: nats,
            shared,
            js,
            url,
        }
    }

    pub(super) fn envelope(&self, id: &str) -> String {
        format!(r#"{{"id":"{id}","method":"GET","url":"{}"}}"#, self.url)
    }

    async fn handle(&self, delivery: &FakeDelivery) -> Settled {
        self.handle_delivered_at(delivery, tokio::time::Instant::now())
            .await
    }

    /// Handles a delivery that arrived at `delivered`, with no progress confirmed since.
    async fn handle_delivered_at(
        &self,
        delivery: &FakeDelivery,
        delivered: tokio::time::Instant,
    ) -> Settled {
        let liveness = Liveness::new(self.shared.settings.cluster.ack_wait, delivered);
        handle_delivery(&self.shared, "default", delivery, &liveness).await
    }

    pub(super) async fn record(&self, seq: u64, generation: u64) -> Option<Record> {
        self.shared
            .outlet
            .progress
            .load(&Origin::new(STREAM, seq), generation)
            .await
            .expect("record lookup")
            .map(|(record, _)| record)
    }

    pub(super) async fn stored(
        &self,
        subject: &str,
    ) -> Option<async_nats::jetstream::message::StreamMessage> {
        let name = if subject.contains(".reply.") {
            format!("{STREAM}_REPLIES")
        } else if subject.contains(".dead.") {
            format!("{STREAM}_DEAD")
        } else {
            STREAM.to_string()
        };
        let stream = self.js.get_stream(name).await.expect("stream");
        stream.get_last_raw_message_by_subject(subject).await.ok()
    }

    async fn messages_in_pool_stream(&self) -> u64 {
        let mut stream = self.js.get_stream(STREAM).await.expect("stream");
        stream.info().await.expect("info").state.messages
    }
}

fn info(seq: u64, delivered: u64) -> DeliveryInfo {
    DeliveryInfo {
        stream: STREAM.into(),
        seq,
        delivered,
        published: SystemTime::now(),
    }
}

/// A caller's message on the request subject.
fn caller(payload: &str, seq: u64, delivered: u64) -> FakeDelivery {
    FakeDelivery::new("webproxy.request.default", payload, info(seq, delivered))
}

/// The hop message that `record` describes, as the pool consumer delivers it.
fn hop(record: &Record, payload: &str, seq: u64) -> FakeDelivery {
    let token = subject_token(&record.subject).expect("token");
    let mut delivery = FakeDelivery::new(
        &format!("webproxy.hop.default.{token}"),
        payload,
        info(seq, 1),
    );
    let mut headers = HeaderMap::new();
    headers.insert(header::HOP, record.hop.format().as_str());
    delivery.headers = Some(headers);
    delivery
}

#[tokio::test]
async fn a_callers_forged_hop_state_is_ignored() {
    let f = Fixture::start().await;
    // Claims to be generation 9 of another conversation, with attempts made.
    let mut forged = HopState::first(Origin::new(STREAM, 1), SystemTime::UNIX_EPOCH, None);
    forged.generation = 9;
    forged.step = 3;
    let mut delivery = caller(
        r#"{"id":"victim","method":"BREW","url":"http://127.0.0.1:1/"}"#,
        42,
        1,
    );
    let mut headers = HeaderMap::new();
    headers.insert(header::HOP, forged.format().as_str());
    headers.insert(header::GENERATION, "9");
    delivery.headers = Some(headers);

    assert_eq!(f.handle(&delivery).await, Settled::Done);
    assert_eq!(delivery.final_acks(), ["Ack"]);
    // Answered as generation 0 of its own origin: nothing of conversation 1 changed.
    let own = f
        .stored(&format!("webproxy.reply.victim.{STREAM}.42"))
        .await
        .expect("its own stored reply");
    assert_eq!(
        own.headers.get(header::GENERATION).map(|v| v.as_str()),
        Some("0")
    );
    assert_eq!(
        own.headers.get(header::ORIGIN).map(|v| v.as_str()),
        Some(format!("{STREAM}:42").as_str())
    );
    assert!(
        f.stored(&format!("webproxy.reply.victim.{STREAM}.1"))
            .await
            .is_none()
    );
}

#[tokio::test]
async fn a_lost_park_ack_starts_no_second_attempt_line() {
    let f = Fixture::start().await;
    let payload = f.envelope("a");
    let first = caller(&payload, 7, 1);
    assert_eq!(f.handle(&first).await, Settled::Done);
    assert_eq!(first.final_acks(), ["Ack"]);
    let parked = f.record(7, 0).await.expect("the park is recorded");
    assert_eq!(parked.step(), 1);
    assert_eq!(parked.hop.attempts.count(), 1);
    assert_eq!(f.messages_in_pool_stream().await, 1, "one parked retry");

    // The park's ack was lost: the caller's message comes back. It republishes the
    // recorded park under the same id (deduplicated) and makes no attempt.
    let again = caller(&payload, 7, 2);
    assert_eq!(f.handle(&again).await, Settled::Done);
    assert_eq!(again.final_acks(), ["Ack"]);
    assert_eq!(f.record(7, 0).await.as_ref(), Some(&parked));
    assert_eq!(f.messages_in_pool_stream().await, 1, "deduplicated");

    // The parked retry comes due as a hop: it takes step 1, attempts, parks step 2.
    let due = hop(&parked, &payload, 8);
    assert_eq!(f.handle(&due).await, Settled::Done);
    assert_eq!(due.final_acks(), ["Ack"]);
    let second = f.record(7, 0).await.expect("step 2 recorded");
    assert_eq!(second.step(), 2);
    assert_eq!(second.hop.attempts.count(), 2);

    // A second copy of the step-1 hop, and the caller's message once more, change
    // nothing: neither is the current untaken step.
    let copy = hop(&parked, &payload, 9);
    assert_eq!(f.handle(&copy).await, Settled::Done);
    assert_eq!(copy.final_acks(), ["Ack"]);
    let late = caller(&payload, 7, 3);
    assert_eq!(f.handle(&late).await, Settled::Done);
    let after = f.record(7, 0).await.expect("record");
    assert_eq!(after.step(), 2);
    assert_eq!(after.hop.attempts.count(), 2, "no attempt was made");
}

#[tokio::test]
async fn a_malformed_hop_state_is_answered_internal_and_dead_lettered() {
    let f = Fixture::start().await;
    let mut delivery = FakeDelivery::new(
        "webproxy.hop.default.0123456789abcdef0123456789abcdef",
        &f.envelope("b"),
        info(11, 1),
    );
    let mut headers = HeaderMap::new();
    headers.insert(header::HOP, "{not hop state");
    delivery.headers = Some(headers);

    assert_eq!(f.handle(&delivery).await, Settled::Done);
    assert_eq!(delivery.final_acks(), ["Term"]);
    let letter = f
        .stored("webproxy.dead.default")
        .await
        .expect("dead letter");
    let letter: DeadLetter = serde_json::from_slice(&letter.payload).expect("json");
    assert_eq!(letter.error.code.as_str(), "internal");
    assert!(
        letter.error.message.contains("hop state"),
        "{}",
        letter.error.message
    );
    assert!(
        f.stored(&format!("webproxy.reply.b.{STREAM}.11"))
            .await
            .is_some(),
        "the caller is answered"
    );
}

/// The next message on `copies`, within 10 s.
async fn next_copy(copies: &mut async_nats::Subscriber) -> async_nats::Message {
    tokio::time::timeout(Duration::from_secs(10), futures::StreamExt::next(copies))
        .await
        .expect("a copy in time")
        .expect("a copy")
}

#[tokio::test]
async fn a_redelivered_message_whose_reply_is_stored_is_not_attempted_again() {
    let f = Fixture::start().await;
    let payload =
        r#"{"id":"c","method":"GET","url":"http://127.0.0.2/","reply_to":"_INBOX.app.c"}"#;
    let client = &f.shared.outlet.client;
    let mut copies = client.subscribe("_INBOX.app.c").await.expect("subscribe");
    client.flush().await.expect("flush");
    let copy_header = |copy: &async_nats::Message, name: &str| {
        copy.headers
            .as_ref()
            .and_then(|h| h.get(name))
            .map(|v| v.as_str().to_owned())
    };
    // Denied (no rule accepts 127.0.0.2): answered and dead-lettered, no HTTP at all.
    let first = caller(payload, 21, 1);
    assert_eq!(f.handle(&first).await, Settled::Done);
    let first_copy = next_copy(&mut copies).await;
    // A crash before the ack: the redelivery finds the stored reply and copies it to
    // the reply_to stored with it.
    let again = caller(payload, 21, 2);
    assert_eq!(f.handle(&again).await, Settled::Done);
    assert_eq!(again.final_acks(), ["Ack"]);
    let copy = next_copy(&mut copies).await;
    assert_eq!(
        copy_header(&copy, header::ORIGIN),
        Some(format!("{STREAM}:21"))
    );
    // Both copies carry the stored reply's message id, so a stream that captures the
    // reply_to keeps one of them.
    let msg_id = format!("{STREAM}:21:0:reply");
    assert_eq!(
        copy_header(&first_copy, header::MSG_ID),
        Some(msg_id.clone())
    );
    assert_eq!(copy_header(&copy, header::MSG_ID), Some(msg_id));
}

#[tokio::test]
async fn a_stale_delivery_stores_its_ending_but_does_not_ack() {
    let f = Fixture::start().await;
    let delivery = caller(
        r#"{"id":"d","method":"GET","url":"http://127.0.0.2/"}"#,
        31,
        1,
    );
    // No confirmed progress for longer than ack_wait allows: the server may have
    // redelivered it, and an ack would free the slot the other copy holds.
    let long_ago = tokio::time::Instant::now() - Duration::from_secs(60);
    assert_eq!(
        f.handle_delivered_at(&delivery, long_ago).await,
        Settled::Done
    );
    assert!(
        delivery.final_acks().is_empty(),
        "{:?}",
        delivery.final_acks()
    );
    assert!(
        f.stored(&format!("webproxy.reply.d.{STREAM}.31"))
            .await
            .is_some(),
        "the reply is stored for the redelivered copy to find"
    );
}

#[tokio::test]
async fn a_delivery_stale_before_its_attempt_makes_none() {
    let f = Fixture::start().await;
    let delivery = caller(&f.envelope("s"), 51, 1);
    let long_ago = tokio::time::Instant::now() - Duration::from_secs(60);
    assert_eq!(
        f.handle_delivered_at(&delivery, long_ago).await,
        Settled::AwaitingRedelivery
    );
    assert!(delivery.final_acks().is_empty());
    // An attempt (to the closed port) would have failed and parked a retry.
    assert_eq!(f.record(51, 0).await, None);
    assert_eq!(f.messages_in_pool_stream().await, 0, "no retry parked");
}

#[tokio::test]
async fn an_attempt_is_given_up_when_its_delivery_goes_stale() {
    let f = Fixture::start().await;
    // Accepts connections (the backlog) and never answers: the call runs until given up.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("addr").port();
    let payload = format!(r#"{{"id":"g","method":"GET","url":"http://127.0.0.1:{port}/x"}}"#);
    let delivery = caller(&payload, 52, 1);
    let limit =
        super::liveness::LivenessPolicy::for_ack_wait(f.shared.settings.cluster.ack_wait).limit;
    // Stale half a second from now, long before the rule's timeout ends the call.
    let delivered = tokio::time::Instant::now() - (limit - Duration::from_millis(500));
    let settled = tokio::time::timeout(
        Duration::from_secs(10),
        f.handle_delivered_at(&delivery, delivered),
    )
    .await
    .expect("the call was given up when the delivery went stale");
    assert_eq!(settled, Settled::AwaitingRedelivery);
    assert!(delivery.final_acks().is_empty());
    assert_eq!(f.messages_in_pool_stream().await, 0, "no retry parked");
}

#[tokio::test]
async fn only_the_step_that_stored_a_reply_copies_it_again() {
    let f = Fixture::start().await;
    let payload = f.envelope("e");
    let first = caller(&payload, 41, 1);
    f.handle(&first).await;
    let parked = f.record(41, 0).await.expect("parked");
    // The hop of step 1 ends the conversation (denied once the rules changed, say):
    // here its payload no longer parses, which ends it just the same.
    let mut hop_delivery = hop(
        &parked,
        r#"{"id":"e","method":"BREW","url":"http://x/"}"#,
        42,
    );
    f.handle(&hop_delivery).await;
    let stored = f
        .stored(&format!("webproxy.reply.e.{STREAM}.41"))
        .await
        .expect("stored");
    assert_eq!(
        stored.headers.get(header::STEP).map(|v| v.as_str()),
        Some("1")
    );

    let client = &f.shared.outlet.client;
    let mut live = client
        .subscribe("webproxy.reply.e")
        .await
        .expect("subscribe");
    client.flush().await.expect("flush");
    // The caller's message, its park ack lost, comes back after the conversation
    // ended: it acks and sends no copy, since step 1 sent them.
    let late = caller(&payload, 41, 2);
    f.handle(&late).await;
    assert_eq!(late.final_acks(), ["Ack"]);
    // The step-1 hop itself redelivered (it may have stopped before copying): copies.
    hop_delivery.info.delivered = 2;
    f.handle(&hop_delivery).await;
    client.flush().await.expect("flush");
    let copy = tokio::time::timeout(Duration::from_secs(10), futures::StreamExt::next(&mut live))
        .await
        .expect("a copy in time")
        .expect("a copy");
    assert_eq!(copy.payload, stored.payload);
    assert!(
        copy.headers
            .as_ref()
            .and_then(|h| h.get(header::REPLY_TO))
            .is_none()
    );
    // One copy only: the late caller message sent none. The service published both
    // before the flush above, so a second copy would be here by now.
    client.flush().await.expect("flush");
    let second = tokio::time::timeout(
        Duration::from_millis(300),
        futures::StreamExt::next(&mut live),
    )
    .await;
    assert!(second.is_err(), "a second copy: {second:?}");
}

/// An upstream on loopback that answers each call `200 ok` after `delay`, counting the
/// calls it has and the most it had open at once.
struct SlowUpstream {
    port: u16,
    calls: Arc<std::sync::atomic::AtomicUsize>,
    open: Arc<std::sync::atomic::AtomicUsize>,
    most_open: Arc<std::sync::atomic::AtomicUsize>,
}

impl SlowUpstream {
    async fn start(delay: Duration) -> SlowUpstream {
        use std::sync::atomic::Ordering::SeqCst;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let upstream = SlowUpstream {
            port,
            calls: Arc::default(),
            open: Arc::default(),
            most_open: Arc::default(),
        };
        let (calls, open, most_open) = (
            upstream.calls.clone(),
            upstream.open.clone(),
            upstream.most_open.clone(),
        );
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                calls.fetch_add(1, SeqCst);
                let now_open = open.fetch_add(1, SeqCst) + 1;
                most_open.fetch_max(now_open, SeqCst);
                let open = open.clone();
                tokio::spawn(async move {
                    let mut request = [0u8; 4096];
                    let _ = socket.read(&mut request).await;
                    tokio::time::sleep(delay).await;
                    let _ = socket
                        .write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                        )
                        .await;
                    open.fetch_sub(1, SeqCst);
                });
            }
        });
        upstream
    }

    /// A GET of `/x` with `id`.
    fn envelope(&self, id: &str) -> String {
        format!(
            r#"{{"id":"{id}","method":"GET","url":"http://127.0.0.1:{}/x"}}"#,
            self.port
        )
    }

    fn open(&self) -> usize {
        self.open.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// After a consumer's leadership changes, the server may hand a message out again while
/// another instance's delivery of it still calls the upstream; the later delivery waits
/// for the attempt claim, then finds the stored reply. Two calls at once would break a
/// pool limit of 1.
#[tokio::test]
async fn a_message_delivered_again_while_another_delivery_calls_waits_for_it() {
    use std::sync::atomic::Ordering::SeqCst;
    let f = Fixture::start().await;
    let upstream = SlowUpstream::start(Duration::from_millis(1500)).await;
    let payload = upstream.envelope("w");
    let (holder, later) = (caller(&payload, 61, 2), caller(&payload, 61, 3));
    let later_run = async {
        // Bounded: the holder's call is open within 10 s.
        let opened = tokio::time::timeout(Duration::from_secs(10), async {
            while upstream.open() == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            opened.is_ok(),
            "the holder's call never reached the upstream"
        );
        f.handle(&later).await
    };
    let (held, waited) = tokio::time::timeout(
        Duration::from_secs(30),
        futures::future::join(f.handle(&holder), later_run),
    )
    .await
    .expect("both deliveries end");
    assert_eq!((held, waited), (Settled::Done, Settled::Done));
    assert_eq!(upstream.most_open.load(SeqCst), 1, "two calls at once");
    assert_eq!(
        upstream.calls.load(SeqCst),
        1,
        "the later delivery called too"
    );
    assert_eq!(holder.final_acks(), ["Ack"]);
    assert_eq!(
        later.final_acks(),
        ["Ack"],
        "answered from the stored reply"
    );
}

/// A claim whose holder died (never renewed, never released) lapses after its TTL, and
/// the delivery waiting for it then makes the attempt.
#[tokio::test]
async fn a_claim_whose_holder_died_lapses_and_the_waiting_delivery_attempts() {
    use std::sync::atomic::Ordering::SeqCst;
    let f = Fixture::start().await;
    let upstream = SlowUpstream::start(Duration::from_millis(10)).await;
    let payload = upstream.envelope("l");
    let key = super::progress::attempt_key(STREAM, 62);
    let taken = f
        .shared
        .outlet
        .progress
        .take_attempt(&key, 2, Duration::from_secs(1))
        .await
        .expect("taken");
    assert!(
        matches!(taken, super::progress::Taken::Held { .. }),
        "{taken:?}"
    );
    let later = caller(&payload, 62, 3);
    // Bounded: a 1 s TTL, and the server's expiry sweep, lapse within 10 s.
    let settled = tokio::time::timeout(Duration::from_secs(10), f.handle(&later))
        .await
        .expect("the claim lapsed and the delivery went on");
    assert_eq!(settled, Settled::Done);
    assert_eq!(later.final_acks(), ["Ack"]);
    assert_eq!(
        upstream.calls.load(SeqCst),
        1,
        "the waiting delivery attempted"
    );
}

/// Two deliveries of one hop message (the server handed it out again, and both copies
/// raced to take its step): the one whose write lost carries on as that step rather
/// than ack, since the copy that won may be stale and leave the message. A hop of
/// another sequence that lost is stale and acks.
#[tokio::test]
async fn a_copy_of_the_hop_that_took_the_step_carries_on_and_another_hop_is_stale() {
    let f = Fixture::start().await;
    let progress = &f.shared.outlet.progress;
    let caller = HopState::first(Origin::new(STREAM, 71), SystemTime::UNIX_EPOCH, None);
    let untaken = Record {
        kind: crate::hop::HopKind::Park,
        subject: "webproxy.retry.partner.t".into(),
        msg_id: "park:t".into(),
        hop: caller.next(crate::hop::AttemptHistory::default(), None),
        taken_by: None,
    };
    let step = untaken.step();
    let before = progress.write(&untaken, None).await.expect("recorded");
    // The winning copy of hop message 80 took the step after both had read the record.
    let mut taken = untaken.clone();
    taken.taken_by = Some(80);
    let now = progress.write(&taken, Some(before)).await.expect("taken");

    let carried = super::handle::take_step(progress, (untaken.clone(), before), step, 80).await;
    assert!(
        matches!(carried, Ok(revision) if revision == now),
        "{carried:?}"
    );
    let other = super::handle::take_step(progress, (untaken, before), step, 81).await;
    assert!(
        matches!(other, Err(super::ending::Ending::Stale)),
        "{other:?}"
    );
}
