//! One message of a pool's request subject, from parse to ack: the caller's request,
//! a retry that came due, or a redelivery.

use std::time::{Duration, Instant, SystemTime};

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use serde_json::value::RawValue;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tracing::{Instrument as _, Span, debug, field, info, info_span, warn};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use webproxy_client::stored_reply_message;
use webproxy_protocol::{
    AttemptRecord, ErrorBody, ErrorCode, ParseError, Request, header, parse_request,
};
use webproxy_worker::AttemptOutcome;

use super::Shared;
use super::publish::{
    Ending, Outlet, copy_to_reply_to, from_unix_ms, publish_ending, publish_stored, unix_ms,
};
use crate::decision::{Admission, AttemptContext, Verdict, admit, expiry, judge};
use crate::egress::Egress;
use crate::metrics::status_class;
use crate::outbox::{EncodedReply, ReplyContext, error_reply, invalid_request, response_reply};
use crate::rules::{IDEMPOTENCY_KEY, RequestRule};
use crate::trace;

fn header_str<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    headers.and_then(|h| h.get(name)).map(|v| v.as_str())
}

/// Span fields as i64: OpenTelemetry has no unsigned integers, and u64 fields would be
/// exported as strings.
fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// What the hop headers say about a message's conversation so far.
pub(super) struct Hop {
    pub generation: u64,
    /// The attempts already made (empty for the caller's own request).
    pub attempts: Vec<AttemptRecord>,
    /// The caller's original publish, when a hop carried it.
    pub first_published: Option<SystemTime>,
}

impl Hop {
    pub fn read(headers: Option<&HeaderMap>) -> Hop {
        Hop {
            generation: header_str(headers, header::GENERATION)
                .and_then(|g| g.parse().ok())
                .unwrap_or(0),
            attempts: header_str(headers, header::ATTEMPTS)
                .and_then(|a| serde_json::from_str(a).ok())
                .unwrap_or_default(),
            first_published: header_str(headers, header::FIRST_PUBLISHED)
                .and_then(|t| t.parse().ok())
                .map(from_unix_ms),
        }
    }
}

/// One conversation's state while its message is handled.
struct Conversation<'a> {
    pool: &'a str,
    /// A valid id: its reply is stored under `<prefix>.reply.<id>`.
    id: Option<String>,
    /// The id as given, for the reply body even when it is invalid.
    raw_id: String,
    reply_to: Option<String>,
    generation: u64,
    payload: Bytes,
    /// The caller's original publish: `duration_ms` counts from it.
    since: SystemTime,
    attempts: Vec<AttemptRecord>,
    rule: &'a str,
    /// The connection's redelivery epoch when handling began; see `ack_current`.
    epoch: u64,
}

impl Conversation<'_> {
    fn context<'m>(&'m self, metadata: Option<&'m RawValue>) -> ReplyContext<'m> {
        ReplyContext {
            id: &self.raw_id,
            attempts: u32::try_from(self.attempts.len()).unwrap_or(u32::MAX),
            duration_ms: millis(
                SystemTime::now()
                    .duration_since(self.since)
                    .unwrap_or_default(),
            ),
            metadata,
        }
    }

    fn ending(&self) -> Ending<'_> {
        Ending {
            pool: self.pool,
            rule: self.rule,
            id: self.id.as_deref(),
            reply_to: self.reply_to.as_deref(),
            generation: self.generation,
            payload: &self.payload,
            attempts: &self.attempts,
        }
    }
}

/// Handles one message inside a span whose parent is the caller's trace context, so
/// that the caller's trace continues through webproxy (a request without one starts a
/// new trace).
pub(super) async fn handle(shared: &Shared, pool: &str, message: jetstream::Message) {
    let span = info_span!(
        "request",
        otel.name = "webproxy request",
        otel.kind = "consumer",
        pool,
        id = field::Empty,
        rule = field::Empty,
        generation = field::Empty,
        delivered = field::Empty,
        queue_wait_ms = field::Empty,
        backoff_ms = field::Empty,
    );
    let _ = span.set_parent(trace::extract(message.headers.as_ref()));
    handle_message(shared, pool, message).instrument(span).await;
}

async fn handle_message(shared: &Shared, pool: &str, message: jetstream::Message) {
    let epoch = shared.health.redelivery_epoch();
    let hop = Hop::read(message.headers.as_ref());
    let (delivered, published) = match message.info() {
        Ok(info) => (info.delivered, SystemTime::from(info.published)),
        Err(e) => {
            warn!(pool, error = %e, "message without JetStream metadata; terminating it");
            ack(&message, AckKind::Term).await;
            return;
        }
    };
    let request = match parse_request(&message.payload, &shared.outlet.subjects) {
        Ok(request) => request,
        Err(e) => {
            // Undecodable payloads are terminated: nothing can answer them, and a
            // redelivery would only fail again.
            let (error, kind, id) = match e {
                ParseError::Undecodable { reason } => (
                    ErrorBody {
                        code: ErrorCode::InvalidRequest,
                        message: format!("payload is not a request envelope: {reason}"),
                        status: None,
                    },
                    AckKind::Term,
                    None,
                ),
                ParseError::Invalid(invalid) => (
                    invalid_request(invalid.field, &invalid.message),
                    AckKind::Ack,
                    invalid.raw_id,
                ),
            };
            end_unattempted(&shared.outlet, pool, &message, error).await;
            info!(
                id = id.as_deref().unwrap_or(""),
                pool,
                rule = "none",
                outcome = "error",
                code = "invalid_request",
                attempts = 0,
                "conversation finished"
            );
            ack(&message, kind).await;
            return;
        }
    };
    let mut conversation = Conversation {
        pool,
        id: Some(request.id.clone()),
        raw_id: request.id.clone(),
        reply_to: request.reply_to.clone(),
        generation: hop.generation,
        payload: message.payload.clone(),
        since: hop.first_published.unwrap_or(published),
        attempts: hop.attempts,
        rule: "none",
        epoch,
    };
    let span = Span::current();
    span.record("id", conversation.raw_id.as_str());
    span.record("generation", as_i64(conversation.generation));
    span.record("delivered", delivered);

    // A retry or a redelivery may belong to a conversation that already ended (a crash
    // between storing the reply and acking): its stored reply is the answer.
    if (!conversation.attempts.is_empty() || delivered > 1)
        && answered_already(shared, &message, &conversation).await
    {
        return;
    }
    // The service never NAKs on a pool consumer, so only crashes and stalls raise the
    // delivery count; past the limit the message is what keeps killing instances.
    let max_deliver = shared.settings.config.service.max_deliver;
    if delivered > i64::from(max_deliver) {
        let error = ErrorBody {
            code: ErrorCode::Internal,
            message: format!(
                "delivered {delivered} times without finishing (more than [service] max_deliver = {max_deliver}): it crashed or stalled an instance each time, so it is not attempted again"
            ),
            status: None,
        };
        warn!(id = %conversation.raw_id, pool, delivered, "poison message: answering internal and dead-lettering it");
        let metadata = request.metadata.as_deref();
        fail(
            shared,
            &message,
            &conversation,
            metadata,
            error,
            AckKind::Term,
        )
        .await;
        return;
    }

    let metadata = request.metadata.as_deref();
    let rule = match admit(&request, &shared.settings.rules) {
        Admission::Reject { error, rule } => {
            if let Some(rule) = rule {
                conversation.rule = &rule.name;
            }
            fail(
                shared,
                &message,
                &conversation,
                metadata,
                error,
                AckKind::Ack,
            )
            .await;
            return;
        }
        Admission::Attempt(rule) => rule,
    };
    conversation.rule = &rule.name;
    Span::current().record("rule", rule.name.as_str());
    if let Err(error) = crate::security::check_request(&request, &shared.settings.outbound) {
        fail(
            shared,
            &message,
            &conversation,
            metadata,
            error,
            AckKind::Ack,
        )
        .await;
        return;
    }

    let now = SystemTime::now();
    let deadline = request.deadline.map(SystemTime::from);
    let first_attempt = conversation.attempts.is_empty();
    let waited = now.duration_since(conversation.since).unwrap_or_default();
    // The queue that counts is the rule's pool's, where the request runs; a moved
    // request's wait counts from the caller's publish all the same.
    let queued = shared
        .settings
        .pools
        .get(&rule.pool)
        .and_then(|p| p.queue_timeout)
        .filter(|_| first_attempt)
        .map(|limit| (waited, limit));
    if let Some(error) = expiry(now, deadline, queued) {
        let error = with_last_failure(error, conversation.attempts.last());
        fail(
            shared,
            &message,
            &conversation,
            metadata,
            error,
            AckKind::Ack,
        )
        .await;
        return;
    }
    if rule.pool != pool {
        move_to_pool(shared, &message, &conversation, &rule.pool).await;
        return;
    }

    if first_attempt {
        shared.outlet.metrics.queue_wait(pool, waited);
        Span::current().record("queue_wait_ms", as_i64(millis(waited)));
    }
    let (outcome, record) =
        Box::pin(attempt(shared, &message, &request, rule, &conversation)).await;
    conversation.attempts.extend(record);
    let context = AttemptContext {
        rule,
        method: request.method,
        has_idempotency_key: rule.idempotency_header.is_some()
            || request
                .headers
                .iter()
                .any(|(name, _)| name.eq_ignore_ascii_case(IDEMPOTENCY_KEY)),
        attempt: u32::try_from(conversation.attempts.len()).unwrap_or(u32::MAX),
        now: SystemTime::now(),
        deadline,
        jitter_unit: fastrand::f64() * 2.0 - 1.0,
    };
    let reply = match judge(outcome, &context) {
        Verdict::Respond(response) => response_reply(
            &conversation.context(metadata),
            &response,
            shared.outlet.max_payload,
        ),
        Verdict::Fail(error) => error_reply(&conversation.context(metadata), error),
        Verdict::Retry { after, last } => {
            debug!(id = %conversation.raw_id, pool, after_ms = millis(after), last = %last.description, "parking for a retry");
            park(shared, &message, &conversation, after).await;
            return;
        }
    };
    finish(shared, &message, &conversation, reply, AckKind::Ack).await;
}

/// Ends the conversation with `error` as its reply.
async fn fail(
    shared: &Shared,
    message: &jetstream::Message,
    conversation: &Conversation<'_>,
    metadata: Option<&RawValue>,
    error: ErrorBody,
    ack_kind: AckKind,
) {
    let reply = error_reply(&conversation.context(metadata), error);
    finish(shared, message, conversation, reply, ack_kind).await;
}

/// Ends a conversation that was never attempted with `error`: the caller is answered
/// when the payload names a valid id or `reply_to`, and the payload is dead-lettered.
/// Used where a message must leave the stream unattempted (a pool being removed, a
/// poison message).
pub async fn end_unattempted(
    outlet: &Outlet,
    pool: &str,
    message: &jetstream::Message,
    error: ErrorBody,
) {
    let hop = Hop::read(message.headers.as_ref());
    let since = hop
        .first_published
        .or_else(|| message.info().ok().map(|i| SystemTime::from(i.published)))
        .unwrap_or_else(SystemTime::now);
    let mut conversation = Conversation {
        pool,
        id: None,
        raw_id: String::new(),
        reply_to: None,
        generation: hop.generation,
        payload: message.payload.clone(),
        since,
        attempts: hop.attempts,
        rule: "none",
        epoch: 0,
    };
    let metadata = match parse_request(&message.payload, &outlet.subjects) {
        Ok(request) => {
            conversation.id = Some(request.id.clone());
            conversation.raw_id = request.id;
            conversation.reply_to = request.reply_to;
            request.metadata
        }
        Err(ParseError::Invalid(invalid)) => {
            conversation.id = invalid.id;
            conversation.raw_id = invalid.raw_id.unwrap_or_default();
            conversation.reply_to = invalid.reply_to;
            invalid.metadata
        }
        Err(ParseError::Undecodable { .. }) => None,
    };
    let reply = error_reply(&conversation.context(metadata.as_deref()), error);
    publish_ending(outlet, message, &conversation.ending(), &reply).await;
}

/// An `expired` error that says what the last attempt's failure was, if there was one.
fn with_last_failure(mut error: ErrorBody, last: Option<&AttemptRecord>) -> ErrorBody {
    if let Some(last) = last {
        match (&last.failure, last.status) {
            (Some(failure), _) => {
                error.message = format!("{}; the last failure: {failure}", error.message)
            }
            (None, Some(status)) => {
                error.message = format!("{}; the last attempt got status {status}", error.message);
                error.status = Some(status);
            }
            (None, None) => {}
        }
    }
    error
}

/// Whether the conversation's final reply of this generation or a later one is stored
/// already; if so the message is acked without another attempt (the reply is copied to
/// a custom `reply_to` again, in case the first copy was lost with the instance).
async fn answered_already(
    shared: &Shared,
    message: &jetstream::Message,
    conversation: &Conversation<'_>,
) -> bool {
    let Some(id) = conversation.id.as_deref() else {
        return false;
    };
    let stored = match stored_reply_message(&shared.outlet.js, &shared.outlet.subjects, id).await {
        Ok(Some(stored)) => stored,
        Ok(None) => return false,
        Err(e) => {
            // Unknown: attempting again is the at-least-once side of the trade-off.
            warn!(id, error = %e, "cannot look up the stored reply; attempting anyway");
            return false;
        }
    };
    let stored_generation = header_str(Some(&stored.headers), header::GENERATION)
        .and_then(|g| g.parse::<u64>().ok())
        .unwrap_or(0);
    if stored_generation < conversation.generation {
        return false;
    }
    if let Some(reply_to) = conversation.reply_to.as_deref() {
        copy_to_reply_to(
            &shared.outlet,
            reply_to,
            stored.headers.clone(),
            stored.payload.clone(),
        )
        .await;
    }
    info!(
        id,
        pool = conversation.pool,
        generation = conversation.generation,
        "final reply already stored; acking without another attempt"
    );
    ack(message, AckKind::Ack).await;
    true
}

/// Runs one attempt, telling the server every third of `ack_wait` that the message is
/// still in progress, so it is never redelivered while its attempt runs.
async fn attempt(
    shared: &Shared,
    message: &jetstream::Message,
    request: &Request,
    rule: &RequestRule,
    conversation: &Conversation<'_>,
) -> (AttemptOutcome, Option<AttemptRecord>) {
    let number = conversation.attempts.len() + 1;
    let span = info_span!(
        "attempt",
        otel.name = %format_args!("{} {}", request.method, request.url.host_str().unwrap_or("")),
        otel.kind = "client",
        id = %request.id,
        pool = conversation.pool,
        rule = %rule.name,
        attempt = as_i64(number as u64),
        http.request.method = request.method.as_str(),
        server.address = request.url.host_str().unwrap_or(""),
        http.response.status_code = field::Empty,
        failure = field::Empty,
        duration_ms = field::Empty,
    );
    let (outcome, record) = async {
        let at = OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_default();
        let started = Instant::now();
        // Webproxy's own headers replace a caller's of the same name: the rule's
        // idempotency key, and the attempt span's context for the upstream to continue.
        let mut own_headers = Vec::new();
        if let Some(name) = &rule.idempotency_header {
            own_headers.push((
                name.clone(),
                format!("{}:{}", request.id, conversation.generation),
            ));
        }
        trace::inject_http(&span.context(), &mut own_headers);
        let egress = Egress {
            worker: &shared.worker,
            rules: &shared.settings.rules,
            outbound: &shared.settings.outbound,
            secrets: &shared.secrets,
        };
        let timeout = request
            .timeout
            .map_or(rule.timeout, |t| t.min(rule.timeout));
        // Boxed, like the other large awaits here: the HTTP client's future is big,
        // and inline it would make every handler's state (moved on each spawn) big too.
        let mut attempt = Box::pin(egress.perform(rule, request, &own_headers, timeout));
        let period = shared.settings.config.service.ack_wait / 3;
        let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        let chain = loop {
            tokio::select! {
                chain = &mut attempt => break chain,
                _ = progress.tick() => {
                    if let Err(e) = message.ack_with(AckKind::Progress).await {
                        debug!(error = %e, "progress ack failed");
                    }
                }
            }
        };
        let (status, failure) = match &chain.outcome {
            AttemptOutcome::Response(r) => (Some(r.status), None),
            AttemptOutcome::TooLarge { status, .. } => (Some(*status), None),
            AttemptOutcome::HeadersTooLarge { status, .. } => (*status, None),
            AttemptOutcome::Failed(f) => (None, Some(format!("{}: {}", f.kind, f.message))),
            AttemptOutcome::Denied { message } => (None, Some(format!("denied: {message}"))),
            AttemptOutcome::Invalid { message } => (None, Some(format!("invalid: {message}"))),
        };
        // A destination refused before any connection was never attempted.
        let record = chain.connected.then(|| AttemptRecord {
            at,
            status,
            failure,
            duration_ms: millis(started.elapsed()),
        });
        (chain.outcome, record)
    }
    .instrument(span.clone())
    .await;
    let Some(record) = record else {
        if let AttemptOutcome::Denied { message } = &outcome {
            span.record("failure", format!("denied: {message}").as_str());
        }
        return (outcome, None);
    };
    match (record.status, &record.failure) {
        (Some(status), _) => span.record("http.response.status_code", i64::from(status)),
        (None, Some(failure)) => span.record("failure", failure.as_str()),
        (None, None) => &span,
    };
    span.record("duration_ms", as_i64(record.duration_ms));
    let result = match &outcome {
        AttemptOutcome::Response(r) => status_class(r.status),
        AttemptOutcome::TooLarge { status, .. } => status_class(*status),
        AttemptOutcome::HeadersTooLarge { status, .. } => status.map_or("other", status_class),
        AttemptOutcome::Failed(f) => f.kind.as_str(),
        AttemptOutcome::Denied { .. } | AttemptOutcome::Invalid { .. } => "other",
    };
    shared.outlet.metrics.attempt(
        conversation.pool,
        &rule.name,
        result,
        Duration::from_millis(record.duration_ms),
    );
    (outcome, Some(record))
}

/// Moves a request that arrived on another pool's subject to its rule's pool, so that
/// publishing everything to one pool cannot bypass another pool's limit.
async fn move_to_pool(
    shared: &Shared,
    message: &jetstream::Message,
    conversation: &Conversation<'_>,
    target: &str,
) {
    let subject = shared.outlet.subjects.request(target);
    hand_off(
        shared,
        message,
        conversation,
        &subject,
        &format!("to:{target}"),
        None,
    )
    .await;
    debug!(id = %conversation.raw_id, from = conversation.pool, to = target, "moved to the rule's pool");
}

/// Republishes the conversation's request as its next hop, under the message id
/// `<id>:<generation>:<hop>`, and acks this message once the hop is stored.
async fn hand_off(
    shared: &Shared,
    message: &jetstream::Message,
    conversation: &Conversation<'_>,
    subject: &str,
    hop: &str,
    due: Option<SystemTime>,
) {
    let Some(id) = conversation.id.as_deref() else {
        return;
    };
    let mut headers = hop_headers(id, conversation);
    trace::forward(message.headers.as_ref(), &mut headers);
    if let Some(due) = due {
        headers.insert(header::DUE, unix_ms(due).to_string().as_str());
    }
    let msg_id = format!("{id}:{}:{hop}", conversation.generation);
    // A parked or moved copy is webproxy's own: no secret it knows goes in.
    let payload = Bytes::from(
        shared
            .outlet
            .redactor
            .redact_payload(&conversation.payload)
            .into_owned(),
    );
    publish_stored(
        &shared.outlet,
        message,
        subject,
        Some(&msg_id),
        &headers,
        &payload,
    )
    .await;
    ack(message, AckKind::Ack).await;
}

/// The headers every hop of a conversation carries: what `Hop::read` reads back.
fn hop_headers(id: &str, conversation: &Conversation<'_>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(header::ID, id);
    headers.insert(
        header::GENERATION,
        conversation.generation.to_string().as_str(),
    );
    headers.insert(
        header::FIRST_PUBLISHED,
        unix_ms(conversation.since).to_string().as_str(),
    );
    if !conversation.attempts.is_empty() {
        headers.insert(
            header::ATTEMPTS,
            serde_json::to_string(&conversation.attempts)
                .unwrap_or_default()
                .as_str(),
        );
    }
    headers
}

/// Parks the request on the pool's retry subject until it is due, then acks it here:
/// a waiting request must not hold a concurrency slot.
async fn park(
    shared: &Shared,
    message: &jetstream::Message,
    conversation: &Conversation<'_>,
    after: Duration,
) {
    let subject = shared.outlet.subjects.retry(conversation.pool);
    let hop = format!("park:{}", conversation.attempts.len());
    Span::current().record("backoff_ms", as_i64(millis(after)));
    hand_off(
        shared,
        message,
        conversation,
        &subject,
        &hop,
        Some(SystemTime::now() + after),
    )
    .await;
}

/// Stores the reply and dead letter, then acks.
async fn finish(
    shared: &Shared,
    message: &jetstream::Message,
    conversation: &Conversation<'_>,
    reply: EncodedReply,
    ack_kind: AckKind,
) {
    Box::pin(publish_ending(
        &shared.outlet,
        message,
        &conversation.ending(),
        &reply,
    ))
    .await;
    info!(
        id = %conversation.raw_id,
        pool = conversation.pool,
        rule = conversation.rule,
        outcome = if reply.error.is_some() { "error" } else { "response" },
        code = reply.error.as_ref().map_or("none", |e| e.code.as_str()),
        attempts = conversation.attempts.len(),
        duration_ms = millis(SystemTime::now().duration_since(conversation.since).unwrap_or_default()),
        "conversation finished"
    );
    ack_current(shared, message, conversation, ack_kind).await;
}

/// Acks, unless the connection was lost long enough meanwhile for the server to have
/// redelivered the message: acks count by stream sequence alone, so a stale delivery's
/// ack would free the slot that the redelivered copy still holds. That copy finds the
/// stored reply (or the stored hop, by its message id) and acks for both.
async fn ack_current(
    shared: &Shared,
    message: &jetstream::Message,
    conversation: &Conversation<'_>,
    kind: AckKind,
) {
    if shared.health.redelivery_epoch() != conversation.epoch {
        info!(id = %conversation.raw_id, pool = conversation.pool, "the NATS connection was lost for longer than the ack wait allows; leaving this possibly stale delivery unacked");
        return;
    }
    ack(message, kind).await;
}

pub(super) async fn ack(message: &jetstream::Message, kind: AckKind) {
    if let Err(e) = message.ack_with(kind).await {
        warn!(error = %e, "ack failed; the server will redeliver the message");
    }
}
