//! The attempt: one call of the upstream through the worker, made only by the server's
//! current delivery, and its verdict turned into an ending (the reply, or a park).

use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream::AckKind;
use bytes::Bytes;
use time::format_description::well_known::Rfc3339;
use tracing::{Instrument as _, Span, debug, field, info_span};
use webproxy_config::rules::{IDEMPOTENCY_KEY, RequestRule};
use webproxy_protocol::{AttemptRecord, Request};
use webproxy_worker::{AttemptOutcome, ChainRequest};

use super::Revision;
use super::ending::Ending;
use super::{Conversation, Underway};
use crate::conversation::egress::RulePolicy;
use crate::conversation::hop::millis;
use crate::conversation::outbox::{error_reply, response_reply};
use crate::conversation::verdict::{AttemptContext, Verdict, pool_pause, verdict_for};
use crate::observability::trace;
use crate::pool::outcome::AttemptEnded;
use webproxy_jetstream::clock;

const STALE_BEFORE_ATTEMPT: &str =
    "no confirmed progress within the ack wait before the attempt: not attempted";
const STALE_DURING_ATTEMPT: &str =
    "no confirmed progress within the ack wait during the attempt: the call was given up";

/// Makes the attempt and turns its verdict into an ending: the reply, or a park.
pub(crate) async fn attempt_and_judge<'a>(
    shared: &'a Revision,
    request: &Request,
    rule: &'a RequestRule,
    conversation: &Conversation<'_>,
    underway: &mut Underway<'a>,
    probe: bool,
) -> Ending {
    // Only the server's current delivery calls the upstream: a stale one's message may
    // already run in another handler, in the slot this one held. The margin between
    // stale and the server's redelivery is what lets a call given up here end first.
    let liveness = conversation.liveness;
    if !liveness.is_current() {
        return Ending::AwaitRedelivery {
            reason: STALE_BEFORE_ATTEMPT.into(),
        };
    }
    debug!(id = %conversation.raw_id, pool = conversation.pool, origin = %conversation.state.origin, "attempting");
    let attempted = tokio::select! {
        attempted = Box::pin(attempt(shared, request, rule, conversation, underway.attempts.count() + 1)) => Some(attempted),
        () = liveness.stale() => None,
    };
    let Some((outcome, record)) = attempted else {
        return Ending::AwaitRedelivery {
            reason: STALE_DURING_ATTEMPT.into(),
        };
    };
    shared
        .pool_control
        .attempt_ended(
            shared.settings.cluster.pools.get(&rule.pool),
            AttemptEnded {
                rule,
                timeout: attempt_timeout(request, rule),
                outcome: &outcome,
                duration_ms: record.as_ref().map(|record| record.duration_ms),
                probe,
                pause: pool_pause(rule, &outcome, clock::now()),
            },
        )
        .await;
    if let Some(record) = record {
        underway.attempts.push(record);
    }
    let deadline = request.deadline.map(SystemTime::from);
    let context = AttemptContext {
        rule,
        method: request.method,
        has_idempotency_key: rule.idempotency_header.is_some()
            || request
                .headers
                .iter()
                .any(|(name, _)| name.eq_ignore_ascii_case(IDEMPOTENCY_KEY)),
        attempt: underway.attempts.count(),
        now: clock::now(),
        deadline,
        jitter_unit: fastrand::f64() * 2.0 - 1.0,
    };
    let max_payload = shared.outlet.max_payload;
    let reply = match verdict_for(outcome, &context) {
        Verdict::Respond(response) => {
            response_reply(&conversation.context(underway, max_payload), &response)
        }
        Verdict::Fail(error) => error_reply(&conversation.context(underway, max_payload), error),
        Verdict::Retry { after, last } => {
            debug!(id = %conversation.raw_id, pool = conversation.pool, after_ms = millis(after), last = %last.description, "parking for a retry");
            Span::current().record("backoff_ms", trace::as_i64(millis(after)));
            return Ending::park(
                conversation
                    .state
                    .next(underway.attempts.clone(), Some(clock::now() + after)),
                conversation.pool,
            );
        }
    };
    Ending::Reply {
        reply,
        ack: AckKind::Ack,
    }
}

/// How long an attempt of `request` under `rule` may take: the rule's timeout, or the
/// caller's `timeout_ms` when that is shorter.
fn attempt_timeout(request: &Request, rule: &RequestRule) -> Duration {
    request
        .timeout
        .map_or(rule.timeout, |t| t.min(rule.timeout))
}

/// Runs one attempt (the delivery's progress task keeps the message meanwhile).
async fn attempt(
    shared: &Revision,
    request: &Request,
    rule: &RequestRule,
    conversation: &Conversation<'_>,
    number: u32,
) -> (AttemptOutcome, Option<AttemptRecord>) {
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
        let timeout = attempt_timeout(request, rule);
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
        let chain = Box::pin(
            shared
                .worker
                .perform(&policy, policy.leg_for(rule), chain_request),
        )
        .await;
        // A destination refused before any connection was never attempted.
        let record = chain
            .connected
            .then(|| chain.outcome.record(at, millis(started.elapsed())));
        (chain.outcome, record)
    }
    .instrument(span.clone())
    .await;
    let Some(record) = record else {
        if let Some(failure) = outcome.failure() {
            span.record("failure", failure.as_str());
        }
        return (outcome, None);
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
    (outcome, Some(record))
}
