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

use super::{Gauges, Health, Revision};
use crate::conversation::delivery::DeliveryInfo;
use crate::conversation::delivery::fake::FakeDelivery;
use crate::conversation::ending::Settled;
use crate::conversation::handle::handle_delivery;
use crate::conversation::hop::{HopState, subject_token};
use crate::conversation::liveness::Liveness;
use crate::conversation::progress::{Progress, Record};
use crate::conversation::publish::Outlet;
use crate::observability::metrics::Metrics;

mod claims;

pub(crate) const STREAM: &str = "WEBPROXY_POOL_DEFAULT";

/// A closed port on loopback: connecting fails at once.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

pub(crate) struct Fixture {
    _nats: NatsServer,
    pub(crate) shared: Revision,
    pub(crate) js: jetstream::Context,
    url: String,
}

impl Fixture {
    pub(crate) async fn start() -> Fixture {
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
        let provisioned = crate::consuming::start::provision(&js, &settings)
            .await
            .expect("provisioned");
        let worker = Worker::new(&WorkerConfig {
            max_response_bytes: 64 * 1024,
            guard: crate::conversation::egress::guard_policy(&settings.cluster.outbound.guard),
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
            pacing: Arc::new(crate::conversation::pacing::Pacing::new(
                settings.cluster.ack_wait,
            )),
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

    pub(crate) fn envelope(&self, id: &str) -> String {
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

    pub(crate) async fn record(&self, seq: u64, generation: u64) -> Option<Record> {
        self.shared
            .outlet
            .progress
            .load(&Origin::new(STREAM, seq), generation)
            .await
            .expect("record lookup")
            .map(|(record, _)| record)
    }

    pub(crate) async fn stored(
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
    let limit = crate::conversation::liveness::LivenessPolicy::for_ack_wait(
        f.shared.settings.cluster.ack_wait,
    )
    .limit;
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
