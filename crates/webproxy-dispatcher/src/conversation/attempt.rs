//! The attempt: one call of the upstream through the worker, lent the rules and the
//! secrets (`egress`), made only by the server's current delivery; for a request that
//! set `large_body`, with the body store's writer its body may go to (`body_store`).

use std::time::{Duration, Instant};

use async_nats::jetstream::AckKind;
use bytes::Bytes;
use time::format_description::well_known::Rfc3339;
use tracing::{Instrument as _, debug, field, info_span};
use webproxy_config::rules::RequestRule;
use webproxy_jetstream::clock;
use webproxy_jetstream::provision::{body_store_config, pool_body_store_config};
use webproxy_protocol::{AttemptRecord, BodyObject, Request, Subjects};
use webproxy_worker::{AttemptOutcome, ChainRequest, LargeBody};

use super::before::Go;
use super::body_store::{AttemptName, BodyWriter, ReceiptPlan};
use super::delivery::DeliveryInfo;
use super::ending::Ending;
use super::request_body::{self, StoredRequest};
use super::{Conversation, Revision, Underway};
use crate::conversation::egress::RulePolicy;
use crate::conversation::hop::millis;
use crate::conversation::outbox::invalid_request;
use crate::observability::trace;

const STALE_BEFORE_ATTEMPT: &str =
    "no confirmed progress within the ack wait before the attempt: not attempted";
const STALE_DURING_ATTEMPT: &str =
    "no confirmed progress within the ack wait during the attempt: the call was given up";

/// Calls the upstream as `go` says, if this delivery is still the server's current one:
/// what the call came to, or the ending of a delivery that went stale before or during
/// it. A request that set `large_body` brings the `body` its answer may go to.
pub(crate) async fn attempt(
    shared: &Revision,
    go: &Go<'_>,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    body: Option<&mut BodyWriter>,
    request_body: Option<&StoredRequest>,
) -> Result<Attempted, Ending> {
    // Only the server's current delivery calls the upstream: a stale one's message may
    // already run in another handler, in the slot this one held. The margin between
    // stale and the server's redelivery is what lets a call given up here end first.
    let liveness = conversation.liveness;
    if !liveness.is_current() {
        return Err(Ending::AwaitRedelivery {
            reason: STALE_BEFORE_ATTEMPT.into(),
        });
    }
    debug!(id = %conversation.raw_id, pool = conversation.pool, origin = %conversation.state.origin, "attempting");
    let timeout = attempt_timeout(go.request, go.rule);
    let number = underway.attempts.count() + 1;
    tokio::select! {
        (outcome, record, stored) = Box::pin(call(shared, go, timeout, conversation, number, body, request_body)) => Ok(Attempted { outcome, record, timeout, stored }),
        () = liveness.stale() => Err(Ending::AwaitRedelivery {
            reason: STALE_DURING_ATTEMPT.into(),
        }),
    }
}

/// What one call of the upstream came to: its outcome, its record when a connection
/// was made (a destination refused before any was never attempted), and the timeout it
/// was given.
#[derive(Debug)]
pub(crate) struct Attempted {
    pub(crate) outcome: AttemptOutcome,
    pub(crate) record: Option<AttemptRecord>,
    pub(crate) timeout: Duration,
    /// Where the response's body is stored, when it went to the body store.
    pub(crate) stored: Option<BodyObject>,
}

/// How long an attempt of `request` under `rule` may take: the rule's timeout, or the
/// caller's `timeout_ms` when that is shorter.
pub(crate) fn attempt_timeout(request: &Request, rule: &RequestRule) -> Duration {
    request
        .timeout
        .map_or(rule.timeout, |t| t.min(rule.timeout))
}

/// The writer of this attempt's body, for a request that set `large_body`; none for one
/// that did not. A request that set it without a capability is `invalid_request`.
pub(crate) async fn body_writer(
    shared: &Revision,
    go: &Go<'_>,
    info: &DeliveryInfo,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
) -> Result<Option<Box<BodyWriter>>, Ending> {
    if !go.request.large_body {
        return Ok(None);
    }
    let outlet = &shared.outlet;
    let Some(msg_id_sha256) = conversation.state.msg_id_sha256.clone() else {
        let error = invalid_request(
            "large_body",
            "needs the request published with a Nats-Msg-Id of 128 random bits (32 or more hex digits, or a UUID), which is what reading the body later asks for",
        );
        return Err(Ending::error(
            conversation,
            underway,
            error,
            AckKind::Ack,
            outlet.max_payload,
        ));
    };
    let settings = &shared.settings;
    let name = AttemptName {
        conversation,
        attempt: underway.attempts.count() + 1,
        delivered: info.delivered,
    };
    let ttl = settings.streams.reply_max_age + attempt_timeout(go.request, go.rule);
    Ok(Some(Box::new(
        BodyWriter::open(
            &outlet.js,
            outlet.body_stores.clone(),
            pool_body_store_config(settings, conversation.pool),
            name,
            ttl,
            msg_id_sha256,
            ReceiptPlan {
                config: body_store_config(
                    settings,
                    &Subjects::body_bucket_of(&conversation.origin().stream),
                ),
                id: go.request.id.clone(),
                ttl: settings.streams.dead_max_age,
            },
        )
        .await,
    )))
}

/// The stored request body of a request whose envelope names an upload, bound to the
/// conversation now if it is not yet; none for one that does not. A body larger than
/// `max_large_body`, or one whose upload does not match the envelope, ends the
/// conversation `invalid_request` before anything is sent.
pub(crate) async fn bound_request_body(
    shared: &Revision,
    go: &Go<'_>,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
) -> Result<Option<StoredRequest>, Ending> {
    let Some(upload) = &go.request.upload else {
        return Ok(None);
    };
    let outlet = &shared.outlet;
    let fail = |error| {
        Ending::error(
            conversation,
            underway,
            error,
            AckKind::Ack,
            outlet.max_payload,
        )
    };
    let max = shared.settings.cluster.outbound.max_large_body;
    if upload.size > max {
        return Err(fail(invalid_request(
            "body_object",
            &format!(
                "the uploaded body is {} bytes, more than [outbound] max_large_body = {max}",
                upload.size
            ),
        )));
    }
    request_body::bind(
        &outlet.js,
        &outlet.body_stores,
        &shared.settings,
        conversation,
        upload,
    )
    .await
    .map(Some)
    .map_err(fail)
}

/// Runs one attempt (the delivery's progress task keeps the message meanwhile).
async fn call(
    shared: &Revision,
    go: &Go<'_>,
    timeout: Duration,
    conversation: &Conversation<'_>,
    number: u32,
    mut body: Option<&mut BodyWriter>,
    request_body: Option<&StoredRequest>,
) -> (AttemptOutcome, Option<AttemptRecord>, Option<BodyObject>) {
    let Go { request, rule, .. } = *go;
    let span = info_span!(
        "attempt",
        otel.name = %format_args!("{} {}", request.method, request.url.host_str().unwrap_or("")),
        otel.kind = "client",
        id = %request.id,
        pool = conversation.pool,
        rule = %rule.name,
        attempt = i64::from(number),
        http.request.method = request.method.as_str(),
        server.address = request.url.host_str().unwrap_or(""),
        http.response.status_code = field::Empty,
        failure = field::Empty,
        duration_ms = field::Empty,
    );
    let (outcome, record) = async {
        let at = clock::now_utc().format(&Rfc3339).unwrap_or_default();
        let started = Instant::now();
        // Webproxy's own headers replace a caller's of the same name: the rule's
        // idempotency key (one per origin and generation, so a reused id never
        // collides), and the attempt span's context for the upstream to continue.
        let mut own_headers = Vec::new();
        if let Some(name) = &rule.idempotency_header {
            own_headers.push((
                name.clone(),
                conversation
                    .origin()
                    .generation_key(conversation.generation()),
            ));
        }
        trace::inject_http(&trace::attempt_context(&span), &mut own_headers);
        own_headers.extend(crate::hooks::attempt_stamp());
        let redaction = shared
            .secrets
            .redactor()
            .for_envelope(&conversation.payload);
        let policy = RulePolicy {
            rules: &shared.settings.cluster.rules,
            outbound: &shared.settings.cluster.outbound,
            secrets: &shared.secrets,
            redaction: &redaction,
        };
        let chain_request = ChainRequest {
            method: request.method,
            url: &request.url,
            headers: &request.headers,
            body: Bytes::from(request.body.clone()),
            own_headers: &own_headers,
            timeout,
        };
        // Boxed, like the other large awaits here: the HTTP client's future is big,
        // and inline it would make every handler's state (moved on each spawn) big too.
        // The delivery's progress task keeps it meanwhile.
        let large = body.as_deref_mut().map(|sink| LargeBody {
            max: shared.settings.cluster.outbound.max_large_body,
            sink,
        });
        let streamed = request_body.map(|stored| request_body::send(&shared.outlet.js, stored));
        let chain = Box::pin(shared.worker.perform_large(
            &policy,
            policy.leg_for(rule),
            chain_request,
            large,
            streamed,
        ))
        .await;
        // A destination refused before any connection was never attempted.
        let record = chain
            .connected
            .then(|| chain.outcome.record(at, millis(started.elapsed())));
        (chain.outcome, record)
    }
    .instrument(span.clone())
    .await;
    let stored = body.and_then(|body| body.object().cloned());
    let Some(record) = record else {
        if let Some(failure) = outcome.failure() {
            span.record("failure", failure.as_str());
        }
        return (outcome, None, stored);
    };
    match (record.status, &record.failure) {
        (Some(status), _) => span.record("http.response.status_code", i64::from(status)),
        (None, Some(failure)) => span.record("failure", failure.as_str()),
        (None, None) => &span,
    };
    span.record("duration_ms", trace::as_i64(record.duration_ms));
    shared.outlet.metrics.attempt(
        conversation.pool,
        &rule.name,
        outcome.class(),
        Duration::from_millis(record.duration_ms),
    );
    (outcome, Some(record), stored)
}
