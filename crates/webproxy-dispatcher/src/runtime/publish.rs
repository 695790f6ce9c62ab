//! Publishing what a conversation produces into JetStream, holding the message it came
//! from meanwhile: a publish is retried until the server confirms it, with progress
//! acks so the held message is not redelivered elsewhere in the meantime.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use tracing::{debug, warn};
use webproxy_protocol::{AttemptRecord, ErrorBody, header};

use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use webproxy_protocol::Subjects;

use crate::metrics::Metrics;
use crate::outbox::{EncodedReply, dead_letter};
use crate::secrets::Redactor;
use crate::trace;

/// Where a conversation's products go: the NATS connection and the names and limits
/// that shape what is published.
#[derive(Debug, Clone)]
pub struct Outlet {
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub subjects: Subjects,
    /// The server's `max_payload`: replies and dead letters are built to fit it.
    pub max_payload: usize,
    /// Conversations and dead letters are counted where they are published.
    pub metrics: Arc<Metrics>,
    /// Webproxy's own copies of a request (dead letters, parked retries) never hold a
    /// secret it knows.
    pub redactor: Redactor,
}

impl Outlet {
    pub fn new(
        client: async_nats::Client,
        subjects: Subjects,
        max_payload: usize,
        metrics: Arc<Metrics>,
        redactor: Redactor,
    ) -> Outlet {
        Outlet {
            js: jetstream::new(client.clone()),
            client,
            subjects,
            max_payload,
            metrics,
            redactor,
        }
    }
}

/// After this many failed tries a retried publish is logged at warn level, once.
const QUIET_TRIES: u32 = 3;

/// Publishes into a stream and waits for the server to store it, retrying with backoff
/// until it does; meanwhile `hold` gets progress acks, which keep it from being
/// redelivered and do not raise its delivery count. If the process stops first, `hold`
/// stays unacked and the server redelivers it.
pub async fn publish_stored(
    outlet: &Outlet,
    hold: &jetstream::Message,
    subject: &str,
    msg_id: Option<&str>,
    headers: &HeaderMap,
    payload: &Bytes,
) {
    let mut delay = Duration::from_millis(50);
    let mut tries = 0u32;
    loop {
        let mut publish = PublishMessage::build()
            .payload(payload.clone())
            .headers(headers.clone());
        if let Some(msg_id) = msg_id {
            publish = publish.message_id(msg_id);
        }
        let result: Result<(), async_nats::Error> = async {
            outlet
                .js
                .send_publish(subject.to_string(), publish)
                .await?
                .await?;
            Ok(())
        }
        .await;
        let Err(e) = result else { return };
        tries += 1;
        if tries == QUIET_TRIES {
            warn!(subject, error = %e, "publish keeps failing; holding the message and retrying");
        } else {
            debug!(subject, error = %e, tries, "publish failed; retrying");
        }
        if let Err(e) = hold.ack_with(AckKind::Progress).await {
            debug!(error = %e, "progress ack failed");
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(1));
    }
}

/// Unix milliseconds, the form times take in hop headers.
pub fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The inverse of [`unix_ms`].
pub fn from_unix_ms(ms: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
}

/// What a conversation needs to publish its end.
pub struct Ending<'a> {
    pub pool: &'a str,
    /// The rule that decided, `none` when no rule matched: a metrics label.
    pub rule: &'a str,
    /// A valid id: the reply is stored under `<prefix>.reply.<id>`.
    pub id: Option<&'a str>,
    pub reply_to: Option<&'a str>,
    pub generation: u64,
    pub payload: &'a Bytes,
    pub attempts: &'a [AttemptRecord],
}

/// Stores the final reply, copies it to a custom `reply_to`, and stores the dead letter
/// of an error. Returns once all of it is stored.
pub async fn publish_ending(
    outlet: &Outlet,
    hold: &jetstream::Message,
    ending: &Ending<'_>,
    reply: &EncodedReply,
) {
    let outcome = if reply.error.is_some() {
        "error"
    } else {
        "response"
    };
    let mut headers = HeaderMap::new();
    headers.insert(header::OUTCOME, outcome);
    headers.insert(header::GENERATION, ending.generation.to_string().as_str());
    // The caller continues its trace from the reply.
    trace::inject_nats(&tracing::Span::current().context(), &mut headers);
    if let Some(id) = ending.id {
        let subject = outlet.subjects.reply(id);
        let msg_id = format!("{id}:{}:reply", ending.generation);
        publish_stored(
            outlet,
            hold,
            &subject,
            Some(&msg_id),
            &headers,
            &reply.payload,
        )
        .await;
    }
    if let Some(reply_to) = ending.reply_to {
        copy_to_reply_to(outlet, reply_to, headers, reply.payload.clone()).await;
    }
    if let Some(error) = &reply.error {
        publish_dead_letter(outlet, hold, ending, error).await;
    }
    outlet.metrics.request_finished(
        ending.pool,
        ending.rule,
        reply.error.as_ref().map(|e| e.code.as_str()),
    );
}

/// The core-NATS copy of a reply for a caller's own `reply_to`.
pub async fn copy_to_reply_to(outlet: &Outlet, reply_to: &str, headers: HeaderMap, payload: Bytes) {
    if let Err(e) = outlet
        .client
        .publish_with_headers(reply_to.to_string(), headers, payload)
        .await
    {
        warn!(reply_to, error = %e, "could not publish the reply copy");
    }
}

/// Stores a dead letter for a conversation that ended in `error`.
pub async fn publish_dead_letter(
    outlet: &Outlet,
    hold: &jetstream::Message,
    ending: &Ending<'_>,
    error: &ErrorBody,
) {
    // The caller's envelope holds an injected secret only if the caller already knew
    // it, but the dead letter is webproxy's own copy: nothing secret goes in.
    let redactor = &outlet.redactor;
    let mut redacted = error.clone();
    redacted.message = redactor.redact(&error.message).into_owned();
    let mut attempts = ending.attempts.to_vec();
    for attempt in &mut attempts {
        if let Some(failure) = &mut attempt.failure {
            *failure = redactor.redact(failure).into_owned();
        }
    }
    let payload = dead_letter(
        ending.pool,
        ending.id,
        ending.generation,
        redacted,
        &redactor.redact_payload(ending.payload),
        attempts,
        outlet.max_payload,
    );
    let mut headers = HeaderMap::new();
    headers.insert(header::ERROR_CODE, error.code.as_str());
    headers.insert(header::GENERATION, ending.generation.to_string().as_str());
    if let Some(id) = ending.id {
        headers.insert(header::ID, id);
    }
    let subject = outlet.subjects.dead(ending.pool);
    // Dead letters are an audit trail: no message id, so a replayed conversation that
    // fails again is recorded again rather than taken for a duplicate.
    publish_stored(outlet, hold, &subject, None, &headers, &payload).await;
    outlet.metrics.dead_letter(ending.pool, error.code.as_str());
    debug!(
        pool = ending.pool,
        id = ending.id.unwrap_or(""),
        code = error.code.as_str(),
        "dead-lettered"
    );
}
