//! Publishing into JetStream with a bounded budget. An oversized message is the one permanent failure and
//! is never retried; a missing stream is confirmed before it counts as permanent; any
//! other failure is retried a few times and then given up, so that the message is left
//! for redelivery (where `max_deliver` applies) instead of holding its slot forever.

use crate::conversation::cancels::Cancels;
use crate::pool::admission::Admissions;
use std::sync::Arc;

use crate::conversation::body_store::BodyStores;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream;
use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use bytes::Bytes;
use thiserror::Error;
use tracing::{debug, warn};
use webproxy_config::secrets::Redactor;
use webproxy_protocol::Subjects;

use super::progress::Progress;
use crate::observability::metrics::Metrics;
use webproxy_jetstream::backoff::Backoff;

/// Where a conversation's products go: the NATS connection, the progress records, and
/// the names and limits that shape what is published. Inside the crate only; operators
/// reach it through `Operator`.
#[derive(Debug, Clone)]
pub(crate) struct Outlet {
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
    pub(crate) subjects: Subjects,
    /// The server's `max_payload`: replies, dead letters and hops are built to fit it.
    pub(crate) max_payload: usize,
    /// Conversations and dead letters are counted where they are published.
    pub(crate) metrics: Arc<Metrics>,
    /// What webproxy composes (error messages, attempt failures) holds no secret the
    /// caller did not write itself (`Redactor::for_envelope`).
    pub(crate) redactor: Redactor,
    pub(crate) progress: Progress,
    /// This instance's moves into pools, each counted against `max_waiting`.
    pub(crate) admissions: Arc<Admissions>,
    /// The pools' body stores this instance has made or found.
    pub(crate) body_stores: Arc<BodyStores>,
    /// The cancels this instance follows (none for an operator command's).
    pub(crate) cancels: Arc<Cancels>,
}

impl Outlet {
    /// The outlet of an `Operator`.
    pub(crate) fn operator(
        client: async_nats::Client,
        subjects: Subjects,
        progress: jetstream::kv::Store,
    ) -> Outlet {
        let max_payload = client.server_info().max_payload;
        Outlet::new(
            client,
            subjects,
            max_payload,
            Arc::new(Metrics::new(env!("CARGO_PKG_VERSION"))),
            Redactor::default(),
            Progress::operator(progress),
        )
    }

    pub(crate) fn new(
        client: async_nats::Client,
        subjects: Subjects,
        max_payload: usize,
        metrics: Arc<Metrics>,
        redactor: Redactor,
        progress: Progress,
    ) -> Outlet {
        Outlet {
            js: jetstream::new(client.clone()),
            client,
            subjects,
            max_payload,
            metrics,
            redactor,
            progress,
            admissions: Arc::default(),
            body_stores: Arc::default(),
            cancels: Arc::default(),
        }
    }
}

/// Why a publish did not store its message.
#[derive(Debug, Error)]
pub enum PublishFailure {
    /// Larger than the server's `max_payload`: it can never succeed.
    #[error("the message for {subject} is larger than the server's max_payload")]
    TooLarge { subject: String },
    /// No stream stores the subject, as the server confirmed.
    #[error("no stream stores {subject}")]
    NoStream { subject: String },
    /// The budget ran out; the server may take it later.
    #[error("{subject} did not store the message after {tries} tries: {last}")]
    GaveUp {
        subject: String,
        tries: u32,
        last: String,
    },
}

/// Publishing into a stream: 8 tries, 50 ms between the first two, doubling to at
/// most 1 s (3.55 s of waiting in all), then the message is left for redelivery. Not
/// cut short at shutdown: the drain lets a handler finish storing what it produced.
const PUBLISH_BACKOFF: Backoff =
    Backoff::doubling(Duration::from_millis(50), Duration::from_secs(1)).tries(8);

/// One publish into a stream, under a message id.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stored<'a> {
    pub(crate) subject: &'a str,
    pub(crate) msg_id: &'a str,
    pub(crate) headers: &'a HeaderMap,
    pub(crate) payload: &'a Bytes,
}

/// Publishes into a stream and waits for the server to store it, retrying within the
/// budget. The message being handled meanwhile is kept by its delivery's progress task.
/// A duplicate is success: the same message id is the same message.
pub(crate) async fn publish_stored(
    outlet: &Outlet,
    message: Stored<'_>,
) -> Result<(), PublishFailure> {
    publish_checked(outlet, message, None).await.map(drop)
}

/// What a publish under a subject-sequence check did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Checked {
    /// Stored now, as the subject's next message.
    Stored,
    /// Not stored by this publish: the subject's last message was not the one expected
    /// (10071), or one with the same message id is stored already (a cluster checks the
    /// id first). Either way the subject holds a message this publish did not write
    /// now, which the caller reads back; retrying could not change that.
    Refused,
}

/// Publishes into a stream as [`publish_stored`] does; with `expected_last` (the
/// subject's last sequence, 0 for none) the server stores it only on top of that
/// message (`Nats-Expected-Last-Subject-Sequence`).
pub(crate) async fn publish_checked(
    outlet: &Outlet,
    message: Stored<'_>,
    expected_last: Option<u64>,
) -> Result<Checked, PublishFailure> {
    let subject = message.subject;
    let mut tries = 0u32;
    loop {
        let mut publish = PublishMessage::build()
            .payload(message.payload.clone())
            .headers(message.headers.clone())
            .message_id(message.msg_id);
        if let Some(sequence) = expected_last {
            publish = publish.expected_last_subject_sequence(sequence);
        }
        let result = match outlet.js.send_publish(subject.to_string(), publish).await {
            Ok(ack) => ack.await,
            Err(e) => Err(e),
        };
        let e = match result {
            Ok(ack) if ack.duplicate && expected_last.is_some() => return Ok(Checked::Refused),
            Ok(_) => return Ok(Checked::Stored),
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                return Ok(Checked::Refused);
            }
            Err(e) => e,
        };
        tries += 1;
        match e.kind() {
            PublishErrorKind::MaxPayloadExceeded => {
                return Err(PublishFailure::TooLarge {
                    subject: subject.to_string(),
                });
            }
            PublishErrorKind::StreamNotFound if stream_is_missing(outlet, subject).await => {
                return Err(PublishFailure::NoStream {
                    subject: subject.to_string(),
                });
            }
            _ => {}
        }
        let Some(delay) = PUBLISH_BACKOFF.after(tries) else {
            warn!(subject, error = %e, tries, "publish keeps failing; leaving the message for redelivery");
            return Err(PublishFailure::GaveUp {
                subject: subject.to_string(),
                tries,
                last: e.to_string(),
            });
        };
        debug!(subject, error = %e, tries, "publish failed; retrying");
        tokio::time::sleep(delay).await;
    }
}

/// Whether the server confirms that no stream stores `subject`: "no responders" also
/// happens while a stream's leader is being elected, which is not permanent.
async fn stream_is_missing(outlet: &Outlet, subject: &str) -> bool {
    match outlet.js.stream_by_subject(subject).await {
        Err(e) => e.kind() == GetStreamByNameErrorKind::NotFound,
        Ok(_) => false,
    }
}

/// A core-NATS publish (a live reply, a copy to a caller's `reply_to`): nothing stores
/// it, so a failure is logged and the conversation goes on.
pub(crate) async fn publish_live(
    outlet: &Outlet,
    subject: &str,
    headers: HeaderMap,
    payload: Bytes,
) {
    if let Err(e) = outlet
        .client
        .publish_with_headers(subject.to_string(), headers, payload)
        .await
    {
        warn!(subject, error = %e, "could not publish a live reply");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn publishing_gives_up_after_eight_tries_and_3_55_s_of_waiting() {
        let waits: Vec<Duration> = (1..).map_while(|n| PUBLISH_BACKOFF.after(n)).collect();
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [50, 100, 200, 400, 800, 1000, 1000]);
        assert_eq!(waits.iter().sum::<Duration>(), Duration::from_millis(3550));
    }
}
