//! Before the attempt: everything decided about a delivery before the upstream is
//! called, in order. A hop or a redelivery first claims its step in the conversation's
//! progress record and looks for a stored reply; then the pure [`plan`] decides (poison,
//! no request, the rules, the limits, expiry, a move), a move is checked against its
//! pool's `max_waiting`, and pool control's gate is passed. What comes out is a [`Go`]
//! for `attempt`, or the [`Ending`] of a delivery that ends unattempted.

use std::time::Duration;

use async_nats::jetstream::AckKind;
use tracing::{Span, debug, warn};
use webproxy_config::rules::RequestRule;
use webproxy_jetstream::clock;
use webproxy_protocol::{AttemptRecord, ErrorBody, ErrorCode, ParseError, Request};

use super::delivery::DeliveryInfo;
use super::ending::Ending;
use super::progress::{Progress, ProgressError, RETRY, Record, StepClaim, claim};
use super::publish::Outlet;
use super::settle::internal;
use super::stored_reply::{self, StoredReply};
use super::{Conversation, Revision, Underway};
use crate::conversation::hop::{HopKind, millis};
use crate::conversation::plan::{Plan, PlanInput, expired, plan};
use crate::observability::trace;
use crate::pool::admission::Admission;
use crate::pool::control::Pass;

/// An attempt the delivery may make: of `request`, under `rule`, through the pool's
/// gate (`probe`: as the one probe of a half-open breaker).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Go<'a> {
    pub(crate) request: &'a Request,
    pub(crate) rule: &'a RequestRule,
    pub(crate) probe: bool,
}

/// Everything decided before an attempt: whether this delivery is the conversation's
/// current step, whether a stored reply answers it already, the plan, a move's room in
/// its pool, and pool control's gate. `Ok`: the attempt to make; `Err`: the delivery
/// ends here, unattempted.
pub(crate) async fn before_attempt<'a>(
    shared: &'a Revision,
    info: &DeliveryInfo,
    conversation: &Conversation<'_>,
    parsed: &'a Result<Request, ParseError>,
    underway: &mut Underway<'a>,
) -> Result<Go<'a>, Ending> {
    let outlet = &shared.outlet;
    // A hop, or the caller's message delivered again, may belong to a conversation that
    // went on or ended without it. A first delivery of a caller's message cannot: it
    // costs no lookup.
    let revisited = conversation.hop || info.delivered > 1;
    if revisited && let Some(ending) = claim_step(outlet, info, conversation, underway).await {
        return Err(ending);
    }
    if revisited {
        match stored_reply(outlet, conversation).await {
            Ok(Some(stored)) => {
                return Err(Ending::Answered {
                    reply: stored.message,
                    generation: stored.generation,
                });
            }
            Ok(None) => {}
            Err(reason) => return Err(Ending::AwaitRedelivery { reason }),
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
        cancelled: underway.cancelled(info.delivered > 1),
    };
    let max_payload = outlet.max_payload;
    let planned = plan(&input);
    if let Plan::Poison(_) = planned {
        warn!(id = %conversation.raw_id, pool = conversation.pool, delivered = info.delivered, "poison message: answering internal and dead-lettering it");
    }
    let (rule, request) = match planned {
        Plan::Poison(error) | Plan::Undecodable(error) => {
            return Err(Ending::error(
                conversation,
                underway,
                error,
                AckKind::Term,
                max_payload,
            ));
        }
        Plan::Reject { error, rule } => {
            if let Some(rule) = rule {
                underway.rule = &rule.name;
            }
            return Err(refused(conversation, underway, error, max_payload));
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
                        return Err(refused(conversation, underway, error, max_payload));
                    }
                    Err(e) => {
                        return Err(Ending::AwaitRedelivery {
                            reason: format!(
                                "cannot count the requests waiting in pool {}: {e}",
                                rule.pool
                            ),
                        });
                    }
                }
            }
            debug!(id = %conversation.raw_id, from = conversation.pool, to = %rule.pool, "moving to the rule's pool");
            return Err(Ending::Hop {
                kind: HopKind::Move,
                next: conversation.state.next(underway.attempts.clone(), None),
                pool: rule.pool.clone(),
                admitted,
            });
        }
        Plan::Attempt { rule, queue_wait } => {
            underway.rule = &rule.name;
            Span::current().record("rule", rule.name.as_str());
            if let Some(waited) = queue_wait {
                outlet.metrics.queue_wait(conversation.pool, waited);
                Span::current().record("queue_wait_ms", trace::as_i64(millis(waited)));
            }
            let Ok(request) = parsed else {
                // The plan attempts only parsed requests.
                return Err(internal(
                    outlet,
                    conversation,
                    underway,
                    "attempt planned without a request".into(),
                ));
            };
            (rule, request)
        }
    };
    gate(shared, &input, conversation, underway, rule, request).await
}

/// Pool control's gate before the attempt (a pause, a rate limit, an open breaker),
/// passed holding the slot; what the wait may have made too late is not attempted.
async fn gate<'a>(
    shared: &'a Revision,
    input: &PlanInput<'_, '_>,
    conversation: &Conversation<'_>,
    underway: &Underway<'a>,
    rule: &'a RequestRule,
    request: &'a Request,
) -> Result<Go<'a>, Ending> {
    let max_payload = shared.outlet.max_payload;
    let mut pass = Pass::Go;
    if let Some(config) = shared.settings.cluster.pools.get(&rule.pool) {
        pass = shared.pool_control.pass(&rule.pool, config).await;
        if let Some(error) = expired(input, request, rule, clock::now()) {
            return Err(refused(conversation, underway, error, max_payload));
        }
    }
    // A cancel recorded while the message waited at the gate ends it there.
    if let Some(error) = underway.cancelled(input.delivered > 1) {
        return Err(refused(conversation, underway, error, max_payload));
    }
    if let Pass::Park(until) = pass {
        // Caught by an open breaker: parked as a recorded retry hop, due when its pause
        // ends, with no attempt counted; never NAKed, which would count toward
        // max_deliver and come back ahead of the probe limit.
        debug!(id = %conversation.raw_id, pool = conversation.pool, %until, "breaker open: parking until its pause ends");
        return Err(Ending::park(
            conversation
                .state
                .next(underway.attempts.clone(), Some(until.into())),
            conversation.pool,
        ));
    }
    let probe = pass == Pass::Probe;
    if probe {
        shared.pool_control.probe_started(conversation.pool);
    }
    Ok(Go {
        request,
        rule,
        probe,
    })
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
pub(crate) async fn take_step(
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

/// A request refused before its attempt (denied, invalid, expired, its queue full):
/// answered with `error`, and acked.
fn refused(
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    error: ErrorBody,
    max_payload: usize,
) -> Ending {
    let error = with_last_failure(error, underway.attempts.last());
    Ending::error(conversation, underway, error, AckKind::Ack, max_payload)
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
