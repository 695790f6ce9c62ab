//! One delivery of a pool consumer, from its conversation to its ending: the caller's
//! request, a hop (a move, a retry that came due, a replay), or a redelivery. A message
//! passes once through conversation → record → plan → attempt → verdict, and the
//! resulting [`Ending`] goes to [`settle`], the only code that acks.

use std::time::{Duration, Instant, SystemTime};

use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use time::format_description::well_known::Rfc3339;
use tracing::{Instrument as _, Span, debug, field, info_span, warn};
use webproxy_config::rules::{IDEMPOTENCY_KEY, RequestRule};
use webproxy_protocol::{AttemptRecord, ErrorBody, ErrorCode, ParseError, Request, parse_request};
use webproxy_worker::{AttemptOutcome, ChainRequest};

use super::Revision;
use super::attempt_claim;
use super::conversation::{Arrival, Conversation, Underway};
use super::delivery::{Delivery, DeliveryInfo};
use super::ending::{Ending, Settled};
use super::liveness::Liveness;
use super::progress::{Progress, ProgressError, RETRY, Record, StepClaim, claim};
use super::publish::Outlet;
use super::settle::{internal, settle};
use super::stored_reply::{self, StoredReply};
use crate::clock;
use crate::egress::RulePolicy;
use crate::hop::{HopKind, millis};
use crate::observability::trace;
use crate::outbox::{error_reply, response_reply};
use crate::plan::{Plan, PlanInput, expired, plan};
use crate::pool::admission::Admission;
use crate::pool::breaker::evidence;
use crate::pool::control::Pass;
use crate::pool::oversight;
use crate::pool::state::RETRY_AFTER;
use crate::verdict::{AttemptContext, Verdict, pool_pause, verdict_for};

/// Span fields as i64: OpenTelemetry has no unsigned integers, and u64 fields would be
/// exported as strings.
fn as_i64(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Handles one message inside a span whose parent is the caller's trace context, so
/// that the caller's trace continues through webproxy (a request without one starts a
/// new trace).
pub(super) async fn handle(
    shared: &Revision,
    pool: &str,
    message: &jetstream::Message,
    liveness: &Liveness,
) {
    let span = info_span!(
        "request",
        otel.name = "webproxy request",
        otel.kind = "consumer",
        pool,
        id = field::Empty,
        origin = field::Empty,
        rule = field::Empty,
        generation = field::Empty,
        delivered = field::Empty,
        queue_wait_ms = field::Empty,
        backoff_ms = field::Empty,
    );
    let parent = trace::extract(message.headers.as_ref());
    trace::in_request(
        span,
        parent,
        handle_delivery(shared, pool, message, liveness),
    )
    .await;
}

/// Decides how the delivery ends and settles it.
pub(super) async fn handle_delivery<'a>(
    shared: &'a Revision,
    pool: &'a str,
    delivery: &impl Delivery,
    liveness: &'a Liveness,
) -> Settled {
    let info = match delivery.info() {
        Ok(info) => info,
        Err(e) => {
            // Not a JetStream delivery: nothing can be keyed on it, nothing redelivers
            // it usefully.
            warn!(pool, error = %e, "message without JetStream metadata; terminating it");
            let _ = delivery.ack(AckKind::Term).await;
            return Settled::Done;
        }
    };
    let subjects = &shared.outlet.subjects;
    let (arrival, hop_error) = Arrival::new(pool, delivery, &info, subjects);
    let parsed = parse_request(
        delivery.payload(),
        subjects,
        arrival.state.caller.as_deref(),
    );
    let mut underway = Underway::new(&arrival);
    let conversation = Conversation::new(arrival, delivery.payload().clone(), &parsed, liveness);
    let span = Span::current();
    span.record("origin", conversation.origin().to_string().as_str());
    span.record("generation", as_i64(conversation.generation()));
    span.record("delivered", as_i64(info.delivered));
    if let Some(id) = conversation.id.as_deref() {
        span.record("id", id);
    }
    // Held by a delivery made again while it works, and released once it is settled.
    let mut claim = None;
    let ending = match hop_error {
        Some(e) => {
            // Only the service writes hop state: a malformed one is a bug, answered and
            // dead-lettered rather than read as defaults.
            warn!(pool, error = %e, "malformed hop state on a service subject");
            internal(
                &shared.outlet,
                &conversation,
                &underway,
                format!("webproxy could not read its own hop state: {e}"),
            )
        }
        // Delivered again: one delivery of the message at work at a time.
        None if info.delivered > 1 => {
            match attempt_claim::take(&shared.outlet.progress, &info, liveness).await {
                Some(mut held) => {
                    let ending = super::while_keeping(
                        Box::pin(decide(shared, &info, &conversation, &parsed, &mut underway)),
                        held.keep(liveness),
                    )
                    .await;
                    claim = Some(held);
                    ending
                }
                None => Ending::AwaitRedelivery {
                    reason: STALE_BEFORE_CLAIM.into(),
                },
            }
        }
        None => Box::pin(decide(shared, &info, &conversation, &parsed, &mut underway)).await,
    };
    let settled = settle(
        &shared.outlet,
        delivery,
        &conversation,
        &mut underway,
        ending,
    )
    .await;
    if settled == Settled::Done
        && let Some(claim) = claim
    {
        claim.release().await;
    }
    settled
}

/// Everything between the conversation and its ending.
async fn decide<'a>(
    shared: &'a Revision,
    info: &DeliveryInfo,
    conversation: &Conversation<'_>,
    parsed: &Result<Request, ParseError>,
    underway: &mut Underway<'a>,
) -> Ending {
    let outlet = &shared.outlet;
    // A hop, or the caller's message delivered again, may belong to a conversation that
    // went on or ended without it. A first delivery of a caller's message cannot: it
    // costs no lookup.
    let revisited = conversation.hop || info.delivered > 1;
    if revisited && let Some(ending) = claim_step(outlet, info, conversation, underway).await {
        return ending;
    }
    if revisited {
        match stored_reply(outlet, conversation).await {
            Ok(Some(stored)) => {
                return Ending::Answered {
                    reply: stored.message,
                    generation: stored.generation,
                };
            }
            Ok(None) => {}
            Err(reason) => return Ending::AwaitRedelivery { reason },
        }
    }
    let settings = &shared.settings;
    let input = PlanInput {
        settings,
        pool: conversation.pool,
        delivered: info.delivered,
        parsed,
        payload_len: conversation.payload.len(),
        max_payload: outlet.max_payload,
        now: clock::now(),
        since: conversation.state.first_published(),
        first_attempt: underway.attempts.is_empty(),
    };
    let max_payload = outlet.max_payload;
    match plan(&input) {
        Plan::Poison(error) => {
            warn!(id = %conversation.raw_id, pool = conversation.pool, delivered = info.delivered, "poison message: answering internal and dead-lettering it");
            reply_error(conversation, underway, error, AckKind::Term, max_payload)
        }
        Plan::Undecodable(error) => {
            reply_error(conversation, underway, error, AckKind::Term, max_payload)
        }
        Plan::Reject { error, rule } => {
            if let Some(rule) = rule {
                underway.rule = &rule.name;
            }
            let error = with_last_failure(error, underway.attempts.last());
            reply_error(conversation, underway, error, AckKind::Ack, max_payload)
        }
        Plan::Move(rule) => {
            underway.rule = &rule.name;
            let max_waiting = settings
                .cluster
                .pools
                .get(&rule.pool)
                .and_then(|pool| pool.max_waiting);
            let mut admitted = None;
            if let Some(max_waiting) = max_waiting {
                match outlet
                    .admissions
                    .admit(
                        &outlet.js,
                        &outlet.subjects,
                        &rule.pool,
                        conversation.caller(),
                        max_waiting,
                    )
                    .await
                {
                    Ok(Admission::Room(lock)) => admitted = Some(lock),
                    Ok(Admission::Full { waiting }) => {
                        let error = queue_full(&rule.name, &rule.pool, waiting, max_waiting);
                        return reply_error(
                            conversation,
                            underway,
                            error,
                            AckKind::Ack,
                            max_payload,
                        );
                    }
                    Err(e) => {
                        return Ending::AwaitRedelivery {
                            reason: format!(
                                "cannot count the requests waiting in pool {}: {e}",
                                rule.pool
                            ),
                        };
                    }
                }
            }
            debug!(id = %conversation.raw_id, from = conversation.pool, to = %rule.pool, "moving to the rule's pool");
            Ending::Hop {
                kind: HopKind::Move,
                next: conversation.state.next(underway.attempts.clone(), None),
                pool: rule.pool.clone(),
                admitted,
            }
        }
        Plan::Attempt { rule, queue_wait } => {
            underway.rule = &rule.name;
            Span::current().record("rule", rule.name.as_str());
            if let Some(waited) = queue_wait {
                outlet.metrics.queue_wait(conversation.pool, waited);
                Span::current().record("queue_wait_ms", as_i64(millis(waited)));
            }
            let Ok(request) = parsed else {
                // The plan attempts only parsed requests.
                return internal(
                    outlet,
                    conversation,
                    underway,
                    "attempt planned without a request".into(),
                );
            };
            // The pool's gate (a pause, a rate limit), passed holding the slot; what
            // the wait may have made too late is not attempted.
            let mut pass = Pass::Go;
            if let Some(config) = settings.cluster.pools.get(&rule.pool) {
                pass = shared.pool_control.pass(&rule.pool, config).await;
                if let Some(error) = expired(&input, request, rule, clock::now()) {
                    let error = with_last_failure(error, underway.attempts.last());
                    return reply_error(conversation, underway, error, AckKind::Ack, max_payload);
                }
            }
            if let Pass::Park(until) = pass {
                // Caught by an open breaker: parked as a recorded retry hop, due when
                // its pause ends, with no attempt counted; never NAKed, which would
                // count toward max_deliver and come back ahead of the probe limit.
                debug!(id = %conversation.raw_id, pool = conversation.pool, %until, "breaker open: parking until its pause ends");
                return Ending::park(
                    conversation
                        .state
                        .next(underway.attempts.clone(), Some(until.into())),
                    conversation.pool,
                );
            }
            if pass == Pass::Probe {
                oversight::probe_started(&shared.pool_control, conversation.pool);
            }
            Box::pin(attempt_and_judge(
                shared,
                request,
                rule,
                conversation,
                underway,
                pass == Pass::Probe,
            ))
            .await
        }
    }
}

/// Looks up the conversation's progress record and claims this delivery's step in
/// it. `Some` ends the delivery here: another delivery holds the conversation, its
/// recorded hop is to be published again, or the record cannot be read (never taken
/// as "done").
async fn claim_step(
    outlet: &Outlet,
    info: &DeliveryInfo,
    conversation: &Conversation<'_>,
    underway: &mut Underway<'_>,
) -> Option<Ending> {
    let progress = &outlet.progress;
    let loaded = progress
        .load(conversation.origin(), conversation.generation())
        .await;
    let found = match loaded {
        Ok(Some(found)) => found,
        // No record: the conversation never forked, or it settled (the stored-reply
        // check finds that), or the record aged out. Either way this delivery goes on.
        Ok(None) => return None,
        Err(e) => {
            return Some(Ending::AwaitRedelivery {
                reason: e.to_string(),
            });
        }
    };
    match take_step(progress, found, conversation.state.step, info.seq).await {
        Ok(revision) => {
            underway.record = Some(revision);
            None
        }
        Err(ending) => Some(ending),
    }
}

/// Claims step `step` for the hop message at stream sequence `seq`, given its
/// conversation's record as loaded at a revision: the record's revision once this
/// delivery holds the step, or how the delivery ends. A step taken meanwhile is looked
/// at again, once: taken by another hop message, this delivery is stale and acks; taken
/// by another delivery of this same message (the server handed it out again, and both
/// copies raced), this one carries on as that step, as a redelivery after a crash
/// would. Acking then would end the message while the copy that won may be stale and
/// leave it, and the conversation would stop there.
pub(super) async fn take_step(
    progress: &Progress,
    (record, revision): (Record, u64),
    step: u32,
    seq: u64,
) -> Result<u64, Ending> {
    let (mut record, mut revision) = (record, revision);
    let mut looked_again = false;
    loop {
        match claim(&record, step, seq) {
            StepClaim::Current { take: false } => return Ok(revision),
            StepClaim::Current { take: true } => {
                let mut taken = record.clone();
                taken.taken_by = Some(seq);
                match progress.write(&taken, Some(revision)).await {
                    Ok(revision) => return Ok(revision),
                    Err(ProgressError::Conflict { .. }) if !looked_again => {}
                    Err(ProgressError::Conflict { .. }) => return Err(Ending::Stale),
                    Err(e) => {
                        return Err(Ending::AwaitRedelivery {
                            reason: e.to_string(),
                        });
                    }
                }
            }
            StepClaim::Republish => return Err(Ending::Republish(record)),
            StepClaim::Stale => return Err(Ending::Stale),
        }
        looked_again = true;
        match progress
            .load(&record.hop.origin, record.hop.generation)
            .await
        {
            Ok(Some(found)) => (record, revision) = found,
            // Settled meanwhile: its stored reply answers this delivery.
            Ok(None) => return Err(Ending::Stale),
            Err(e) => {
                return Err(Ending::AwaitRedelivery {
                    reason: e.to_string(),
                });
            }
        }
    }
}

/// The conversation's stored reply, when it answers this generation or a later one. A
/// lookup that fails is tried again while progress acks hold the message: attempting
/// without knowing could answer the conversation a second time, and leaving the message
/// would count a delivery against it for the service's own wait. `Err`: the delivery
/// went stale first, and is left.
async fn stored_reply(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
) -> Result<Option<StoredReply>, String> {
    let Some(id) = conversation.id.as_deref() else {
        return Ok(None);
    };
    let subject = outlet.subjects.stored_reply(id, conversation.origin());
    let mut failures = 0u32;
    loop {
        let error = match stored_reply::answering(
            outlet,
            &subject,
            conversation.origin(),
            conversation.generation(),
        )
        .await
        {
            Ok(found) => return Ok(found),
            Err(e) => e,
        };
        failures = failures.saturating_add(1);
        warn!(error = %error, failures, "cannot look up the stored reply; trying again while the message is held");
        tokio::select! {
            () = tokio::time::sleep(RETRY.after(failures).unwrap_or(Duration::from_secs(2))) => {}
            () = conversation.liveness.stale() => {
                return Err(format!("the stored reply could not be looked up before the delivery went stale: {error}"));
            }
        }
    }
}

/// A move refused because its pool holds `max_waiting` requests already.
fn queue_full(rule: &str, pool: &str, waiting: u64, max_waiting: u64) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::QueueFull,
        message: format!(
            "rule {rule} moves the request to pool {pool}, which holds {waiting} waiting requests (max_waiting {max_waiting}); try again later"
        ),
        status: None,
    }
}

fn reply_error(
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    error: ErrorBody,
    ack: AckKind,
    max_payload: usize,
) -> Ending {
    Ending::Reply {
        reply: error_reply(&conversation.context(underway, max_payload), error),
        ack,
    }
}

/// An `expired` error that says what the last attempt's failure was, if there was one.
fn with_last_failure(mut error: ErrorBody, last: Option<&AttemptRecord>) -> ErrorBody {
    if error.code != ErrorCode::Expired {
        return error;
    }
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

const STALE_BEFORE_CLAIM: &str = "no confirmed progress within the ack wait while another delivery held the attempt claim: not attempted";
const STALE_BEFORE_ATTEMPT: &str =
    "no confirmed progress within the ack wait before the attempt: not attempted";
const STALE_DURING_ATTEMPT: &str =
    "no confirmed progress within the ack wait during the attempt: the call was given up";

/// Makes the attempt and turns its verdict into an ending: the reply, or a park.
async fn attempt_and_judge<'a>(
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
    // Counted only when it reached the upstream, and only when its outcome is the
    // upstream's (`crate::pool::breaker::evidence`). A probe that was not leaves the breaker
    // half-open for the next attempt: one under a rule with an origin then decides.
    if let (Some(record), Some(config)) = (&record, shared.settings.cluster.pools.get(&rule.pool)) {
        let evidence = evidence(
            rule.security.origin.is_some(),
            attempt_timeout(request, rule),
            rule.timeout,
            &outcome,
        );
        if evidence.counts() {
            let failed = shared.pool_control.counts.attempted(
                &rule.pool,
                config,
                &outcome,
                record.duration_ms,
            );
            if probe {
                oversight::probe_ended(&shared.pool_control, &rule.pool, config, failed).await;
            }
        } else if probe {
            debug!(pool = rule.pool, rule = %rule.name, evidence = evidence.as_str(), "the probe's outcome is not the upstream's: the breaker stays half-open");
        }
    }
    if let Some(pause) = pool_pause(rule, &outcome, clock::now()) {
        let reason = format!(
            "rule {}: the upstream asked to retry after {}",
            rule.name,
            humantime::format_duration(pause)
        );
        let until = clock::now_utc() + pause;
        if let Err(e) = shared
            .pool_control
            .pause(&rule.pool, RETRY_AFTER, until, reason)
            .await
        {
            warn!(pool = rule.pool, error = %e, "cannot pause the pool on the upstream's Retry-After");
        }
    }
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
            Span::current().record("backoff_ms", as_i64(millis(after)));
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
    span.record("duration_ms", as_i64(record.duration_ms));
    shared.outlet.metrics.attempt(
        conversation.pool,
        &rule.name,
        outcome.class(),
        Duration::from_millis(record.duration_ms),
    );
    (outcome, Some(record))
}

/// Ends a conversation that was never attempted with `error`, through the same settle
/// code as the service: the caller is answered when the payload names a valid id or
/// `reply_to`, and the request is dead-lettered. Used where a message must leave the
/// stream unattempted (`pools remove --dead-letter`). `Left` means it could not be
/// stored, and the message is still there.
impl Outlet {
    pub async fn end_unattempted(
        &self,
        pool: &str,
        message: &jetstream::Message,
        error: ErrorBody,
    ) -> Settled {
        let Ok(info) = Delivery::info(message) else {
            return Settled::AwaitingRedelivery;
        };
        // A one-off reader acks at once, long before its delivery could go stale.
        let liveness = Liveness::new(Duration::from_secs(3600), tokio::time::Instant::now());
        let (arrival, _) = Arrival::new(pool, message, &info, &self.subjects);
        let parsed = parse_request(
            &message.payload,
            &self.subjects,
            arrival.state.caller.as_deref(),
        );
        let mut underway = Underway::new(&arrival);
        underway.record = self
            .progress
            .load(&arrival.state.origin, arrival.state.generation)
            .await
            .ok()
            .flatten()
            .map(|(_, revision)| revision);
        let conversation = Conversation::new(arrival, message.payload.clone(), &parsed, &liveness);
        let ending = reply_error(
            &conversation,
            &underway,
            error,
            AckKind::Ack,
            self.max_payload,
        );
        settle(self, message, &conversation, &mut underway, ending).await
    }
}
