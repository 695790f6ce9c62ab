//! Layout 1's parked retries, moved into layout 2 once: each message still on a pool's
//! old retry subject (`<prefix>.retry.<pool>`) becomes a park of layout 2, through the
//! one settle point like any park (progress record first, then the hop on
//! `retry.<pool>.<token>`), and is then deleted. One whose layout-1 headers cannot be
//! read is answered `internal` and dead-lettered there instead.
//!
//! Provisioning fences layout 1's instances out before this runs, so nothing new
//! arrives on the old subject; the messages are read by stream sequence (no consumer,
//! whose filter would have to name a subject the stream no longer lists). Running it
//! again is harmless: a message moved but not yet deleted finds its progress record,
//! and its recorded hop is published again under the same message id.

use std::future::Future;
use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::AckKind;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{self, LastRawMessageErrorKind};
use bytes::Bytes;
use thiserror::Error;
use tracing::{info, warn};
use webproxy_protocol::parse_request;

use super::Dispatcher;
use crate::conversation::delivery::{Delivery, DeliveryInfo, ProgressAckError};
use crate::conversation::ending::{Ending, Settled};
use crate::conversation::hop::HopState;
use crate::conversation::liveness::Liveness;
use crate::conversation::publish::Outlet;
use crate::conversation::settle::{internal, settle};
use crate::conversation::{Arrival, Conversation, Underway};

/// Some parked retries of layout 1 were not moved; they are still there, and the next
/// run moves them.
#[derive(Debug, Error)]
#[error("cannot migrate the parked retries of pool {pool}: {reason}")]
pub(crate) struct MigrationError {
    pub(crate) pool: String,
    pub(crate) reason: String,
}

impl Dispatcher {
    /// Moves every retry that layout 1 parked in this instance's pools into layout 2,
    /// and returns how many there were. A pool whose stream never had layout 1 costs
    /// one message lookup.
    pub(crate) async fn migrate_layout1_parked(&self) -> Result<u64, MigrationError> {
        let mut moved = 0;
        let shared = self.live.load();
        for pool in shared.settings.cluster.pools.keys() {
            moved += migrate_pool(&shared.outlet, pool).await?;
        }
        Ok(moved)
    }
}

async fn migrate_pool(outlet: &Outlet, pool: &str) -> Result<u64, MigrationError> {
    let failed = |reason: String| MigrationError {
        pool: pool.to_string(),
        reason,
    };
    let name = outlet.subjects.pool_stream(pool);
    let stream = outlet
        .js
        .get_stream_no_info(&name)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let subject = outlet.subjects.layout1_retry(pool);
    let (mut next, mut moved, mut left) = (0, 0, 0);
    loop {
        let message = match stream
            .get_first_raw_message_by_subject(&subject, next)
            .await
        {
            Ok(message) => message,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => break,
            Err(e) => return Err(failed(e.to_string())),
        };
        next = message.sequence + 1;
        let parked = StoredMessage {
            stream: &stream,
            name: &name,
            message,
        };
        match migrate_one(outlet, pool, &parked).await {
            Settled::Done => moved += 1,
            Settled::AwaitingRedelivery => left += 1,
        }
    }
    if moved > 0 {
        info!(
            pool,
            moved, "moved the retries that layout 1 parked into this layout"
        );
    }
    if left > 0 {
        return Err(failed(format!(
            "{left} could not be moved now; they stay on {subject}"
        )));
    }
    Ok(moved)
}

/// Settles one parked retry of layout 1 as a park of this layout, or, when its
/// headers cannot be read, as an `internal` error.
async fn migrate_one(outlet: &Outlet, pool: &str, parked: &StoredMessage<'_>) -> Settled {
    let Ok(info) = parked.info() else {
        return Settled::AwaitingRedelivery;
    };
    // Read by sequence, not delivered: nothing redelivers it meanwhile, so it never
    // goes stale (as in `end_unattempted`).
    let liveness = Liveness::new(Duration::from_secs(3600), tokio::time::Instant::now());
    // Not a hop of this layout: the conversation's own state comes from the layout 1
    // headers below, so the constructor's complaint about a missing hop header is moot.
    let (mut arrival, _) = Arrival::new(pool, parked, &info, &outlet.subjects);
    let parsed = parse_request(parked.payload(), &outlet.subjects, None);
    let headers = &parked.message.headers;
    let read = HopState::from_layout1(arrival.state.origin.clone(), |name| {
        headers.get(name).map(|value| value.as_str())
    });
    let next = read.map(|(state, due)| {
        let next = state.next(state.attempts.clone(), Some(due));
        arrival.state = state;
        next
    });
    let mut underway = Underway::new(&arrival);
    let conversation = Conversation::new(arrival, parked.payload().clone(), &parsed, &liveness);
    let ending = match next {
        Ok(next) => Ending::park(next, pool),
        Err(e) => {
            warn!(pool, seq = info.seq, error = %e, "a retry parked by layout 1 has unreadable headers; answering internal and dead-lettering it");
            internal(
                outlet,
                &conversation,
                &underway,
                format!("webproxy could not read a retry parked by its previous version: {e}"),
            )
        }
    };
    settle(outlet, parked, &conversation, &mut underway, ending).await
}

/// A message read from a stream by sequence, as a delivery: acking or terminating it
/// deletes it, and progress acks have nothing to hold.
struct StoredMessage<'a> {
    stream: &'a stream::Stream<()>,
    name: &'a str,
    message: StreamMessage,
}

impl Delivery for StoredMessage<'_> {
    fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    fn headers(&self) -> Option<&HeaderMap> {
        Some(&self.message.headers)
    }

    fn payload(&self) -> &Bytes {
        &self.message.payload
    }

    fn info(&self) -> Result<DeliveryInfo, String> {
        Ok(DeliveryInfo {
            stream: self.name.to_string(),
            seq: self.message.sequence,
            delivered: 1,
            published: SystemTime::from(self.message.time),
        })
    }

    fn ack(&self, kind: AckKind) -> impl Future<Output = Result<(), async_nats::Error>> + Send {
        let delete = matches!(kind, AckKind::Ack | AckKind::Term);
        async move {
            if delete {
                self.stream.delete_message(self.message.sequence).await?;
            }
            Ok(())
        }
    }

    fn progress_confirmed(&self) -> impl Future<Output = Result<(), ProgressAckError>> + Send {
        std::future::ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    //! Against a real nats-server: a pool stream turned back into layout 1, as the
    //! version before the conversation core left it, with retries it parked.

    use std::collections::HashMap;

    use crate::conversation::hop::HopKind;
    use async_nats::jetstream::{self, consumer, stream};
    use webproxy_protocol::{Origin, header};

    use super::*;
    use crate::consuming::start::provision;
    use crate::conversation::hop::{from_unix_ms, unix_ms};
    use crate::conversation::tests::{Fixture, STREAM};
    use crate::pool::consumers::{Recreated, recreate_pool_consumer};
    use webproxy_jetstream::provision::{self, Examined, LayoutRefusal, examine};

    const OLD_RETRY: &str = "webproxy.retry.default";

    /// Layout 1's pool stream config, as c7a4dcd wrote it on every start.
    fn layout1_stream() -> stream::Config {
        stream::Config {
            name: STREAM.into(),
            subjects: vec!["webproxy.request.default".into(), OLD_RETRY.into()],
            retention: stream::RetentionPolicy::WorkQueue,
            ..Default::default()
        }
    }

    fn layout1_consumer(name: &str, filter: &str) -> consumer::pull::Config {
        consumer::pull::Config {
            durable_name: Some(name.into()),
            filter_subject: filter.into(),
            ..Default::default()
        }
    }

    fn code(error: &impl std::fmt::Display) -> String {
        error.to_string()
    }

    /// Makes the fixture's provisioned pool look as layout 1 left it.
    async fn back_to_layout1(f: &Fixture) -> stream::Stream {
        let js = &f.js;
        let pool = js.get_stream(STREAM).await.expect("pool");
        for name in ["webproxy-default-l3", "webproxy-default-retry-l3"] {
            pool.delete_consumer(name).await.expect("delete");
        }
        js.delete_stream("WEBPROXY_FENCE_POOL_DEFAULT")
            .await
            .expect("delete fence");
        let mut config = layout1_stream();
        config.metadata = HashMap::new();
        js.update_stream(&config).await.expect("layout 1 stream");
        let mut pool = js.get_stream(STREAM).await.expect("pool");
        let metadata = pool.info().await.expect("info").config.metadata.clone();
        assert_eq!(examine(&metadata), Examined::Migrate { from: 1 });
        pool.create_consumer(layout1_consumer(
            "webproxy-default",
            "webproxy.request.default",
        ))
        .await
        .expect("layout 1 consumer");
        pool.create_consumer(layout1_consumer("webproxy-default-retry", OLD_RETRY))
            .await
            .expect("layout 1 retry consumer");
        pool
    }

    /// Parks a retry the way layout 1 did; returns its stream sequence.
    async fn park_layout1(
        js: &jetstream::Context,
        payload: String,
        headers: &[(&str, &str)],
    ) -> u64 {
        let mut map = async_nats::HeaderMap::new();
        for (name, value) in headers {
            map.insert(*name, *value);
        }
        js.publish_with_headers(OLD_RETRY, map, payload.into())
            .await
            .expect("publish")
            .await
            .expect("stored")
            .sequence
    }

    #[tokio::test]
    async fn layout1_is_fenced_out_and_its_parked_retries_moved_once() {
        let f = Fixture::start().await;
        let js = &f.js;
        let settings = &f.shared.settings;
        let pool = back_to_layout1(&f).await;
        let due = unix_ms(SystemTime::now()) + 3_600_000;
        let attempts = r#"[{"at":"2026-11-30T00:00:00Z","status":503,"duration_ms":4}]"#;
        let good = |generation: &'static str| {
            let due = due.to_string();
            [
                ("Webproxy-Id", "a".to_string()),
                ("Webproxy-Generation", generation.to_string()),
                ("Webproxy-First-Published", "1700000000000".to_string()),
                ("Webproxy-Due", due),
                ("Webproxy-Attempts", attempts.to_string()),
            ]
        };
        let mut parked = Vec::new();
        for generation in ["0", "2"] {
            let headers = good(generation);
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            parked.push(park_layout1(js, f.envelope("a"), &headers).await);
        }
        let broken = park_layout1(
            js,
            f.envelope("b"),
            &[("Webproxy-Id", "b"), ("Webproxy-Generation", "0")],
        )
        .await;

        provision(js, settings).await.expect("migrated");
        let mut pool_info = js.get_stream(STREAM).await.expect("pool");
        let metadata = pool_info
            .info()
            .await
            .expect("info")
            .config
            .metadata
            .clone();
        assert_eq!(examine(&metadata), Examined::Current);
        for gone in ["webproxy-default", "webproxy-default-retry"] {
            assert!(pool.consumer_info(gone).await.is_err(), "{gone}");
        }
        // An old pod's start: its stream update overlaps the fence, and its consumer
        // would overlap the new one on the work queue.
        let update = js
            .update_stream(&layout1_stream())
            .await
            .expect_err("fenced");
        assert!(
            matches!(update.kind(), jetstream::context::UpdateStreamErrorKind::JetStream(ref e)
                if e.error_code() == jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP),
            "{}",
            code(&update)
        );
        let consumer = pool
            .create_consumer(layout1_consumer(
                "webproxy-default",
                "webproxy.request.default",
            ))
            .await
            .expect_err("overlapping");
        assert!(
            matches!(consumer.kind(), stream::ConsumerErrorKind::JetStream(ref e)
                if e.error_code() == jetstream::ErrorCode::CONSUMER_WQ_CONSUMER_NOT_UNIQUE),
            "{}",
            code(&consumer)
        );

        let outlet = &f.shared.outlet;
        assert_eq!(migrate_pool(outlet, "default").await.expect("moved"), 3);
        let stream = js.get_stream_no_info(STREAM).await.expect("pool");
        assert!(
            stream
                .get_first_raw_message_by_subject(OLD_RETRY, 0)
                .await
                .is_err(),
            "a layout 1 park is left"
        );
        for (seq, generation) in parked.iter().zip([0, 2]) {
            let record = f.record(*seq, generation).await.expect("a progress record");
            assert_eq!(record.kind, HopKind::Park);
            assert_eq!(record.hop.origin, Origin::new(STREAM, *seq));
            assert_eq!(record.hop.step, 1);
            assert_eq!(record.hop.due(), Some(from_unix_ms(due)));
            assert_eq!(record.hop.attempts.count(), 1);
            assert_eq!(record.taken_by, None);
            let hop = f.stored(&record.subject).await.expect("the park is stored");
            assert!(record.subject.starts_with("webproxy.retry.default."));
            assert_eq!(
                hop.headers.get(header::MSG_ID).map(|v| v.as_str()),
                Some(record.msg_id.as_str())
            );
        }
        // The unreadable one is answered internal and dead-lettered, not dropped.
        let letter = f
            .stored("webproxy.dead.default")
            .await
            .expect("a dead letter");
        assert_eq!(
            letter.headers.get(header::ORIGIN).map(|v| v.as_str()),
            Some(format!("{STREAM}:{broken}").as_str())
        );
        // Once is all: nothing is left to move.
        assert_eq!(migrate_pool(outlet, "default").await.expect("again"), 0);
    }

    #[tokio::test]
    async fn a_newer_layout_or_a_removal_is_left_alone() {
        let f = Fixture::start().await;
        let js = &f.js;
        let settings = &f.shared.settings;
        let mut pool = js.get_stream(STREAM).await.expect("pool");
        let mut config = pool.info().await.expect("info").config.clone();
        config
            .metadata
            .insert(provision::LAYOUT_KEY.into(), "4".into());
        config.max_messages = 12345;
        js.update_stream(&config).await.expect("layout 4");
        let Err(error) = provision(js, settings).await else {
            panic!("a newer layout is refused");
        };
        assert!(
            matches!(error.refusal(), Some(LayoutRefusal::NewerLayout { found, own: 3 }) if found == "4"),
            "{error}"
        );
        let after = pool.info().await.expect("info").config.clone();
        assert_eq!(after.max_messages, 12345, "the stream was rewritten");
        let Err(error) = recreate_pool_consumer(js, settings, "default").await else {
            panic!("refused");
        };
        assert!(matches!(
            error.refusal(),
            Some(LayoutRefusal::NewerLayout { .. })
        ));

        // Back to this layout: the work consumer is recreated, and only while the
        // stream is not marked for removal.
        config
            .metadata
            .insert(provision::LAYOUT_KEY.into(), "3".into());
        js.update_stream(&config).await.expect("layout 3");
        pool.delete_consumer("webproxy-default-l3")
            .await
            .expect("delete");
        let Recreated::Made(consumer) = recreate_pool_consumer(js, settings, "default")
            .await
            .expect("recreated")
        else {
            panic!("the deleted consumer was found");
        };
        assert_eq!(
            consumer.cached_info().config.durable_name.as_deref(),
            Some("webproxy-default-l3")
        );
        // One that exists is found, and what the owner wrote there stays: a pull's
        // "no responders" may mean only that JetStream was down.
        let mut owned = consumer.cached_info().config.clone();
        owned.max_ack_pending = 777;
        pool.update_consumer(owned)
            .await
            .expect("the owner's write");
        let Ok(Recreated::Found(found)) = recreate_pool_consumer(js, settings, "default").await
        else {
            panic!("the consumer that exists was not found");
        };
        assert_eq!(found.cached_info().config.max_ack_pending, 777);
        config
            .metadata
            .insert(provision::REMOVING_KEY.into(), "true".into());
        js.update_stream(&config).await.expect("marked");
        pool.delete_consumer("webproxy-default-l3")
            .await
            .expect("delete");
        let Err(error) = recreate_pool_consumer(js, settings, "default").await else {
            panic!("refused");
        };
        assert_eq!(error.refusal(), Some(&LayoutRefusal::Removing));
        assert!(pool.consumer_info("webproxy-default-l3").await.is_err());
        js.delete_stream(STREAM).await.expect("removed");
        let Err(error) = recreate_pool_consumer(js, settings, "default").await else {
            panic!("refused");
        };
        assert_eq!(error.refusal(), Some(&LayoutRefusal::Missing));
    }
}
