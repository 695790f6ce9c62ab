//! One delivery of a pool consumer, top to bottom: the conversation is read from the
//! message (a caller's request, a hop, or a redelivery), [`before_attempt`] decides
//! what comes before any attempt, [`attempt`] calls the upstream, [`after_attempt`]
//! decides what its outcome means, and [`settle`], the only code that acks, carries out
//! the resulting [`Ending`].

use async_nats::jetstream::{self, AckKind};
use time::format_description::well_known::Rfc3339;
use tracing::{Span, field, info, info_span, warn};
use webproxy_jetstream::clock;
use webproxy_protocol::{AttemptRecord, ParseError, Request, parse_request};

use super::after::after_attempt;
use super::attempt::attempt;
use super::attempt_claim;
use super::before::before_attempt;
use super::delivery::{Delivery, DeliveryInfo};
use super::ending::{Ending, Settled};
use super::hop::millis;
use super::liveness::Liveness;
use super::settle::{internal, settle};
use super::{Arrival, Conversation, Revision, Underway};
use crate::conversation::cancels::cancelled_error;
use crate::observability::trace;

/// Handles one message inside a span whose parent is the caller's trace context, so
/// that the caller's trace continues through webproxy (a request without one starts a
/// new trace).
pub(crate) async fn handle(
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
    // Boxed: inline, the delivery's future (kilobytes) would be copied at each of the
    // wrappers it passes through (the span, the task-local context) and make this
    // future, which the pull loop boxes and moves, twice its size (issue 33).
    trace::in_request(
        span,
        parent,
        Box::pin(handle_delivery(shared, pool, message, liveness)),
    )
    .await;
}

/// Decides how the delivery ends and settles it.
pub(crate) async fn handle_delivery<'a>(
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
    // From memory: a cancel recorded before, or one recorded while this delivery runs
    // (and from the bucket itself while the watch is not in step with it).
    shared
        .outlet
        .cancels
        .catch_up(conversation.origin(), conversation.generation())
        .await;
    underway.cancel = Some(
        shared
            .outlet
            .cancels
            .watch(conversation.origin(), conversation.generation()),
    );
    let span = Span::current();
    span.record("origin", conversation.origin().to_string().as_str());
    span.record("generation", trace::as_i64(conversation.generation()));
    span.record("delivered", trace::as_i64(info.delivered));
    if let Some(id) = conversation.id.as_deref() {
        span.record("id", id);
    }
    // Held by a delivery made again while it works, and released once it is settled.
    let mut claim = None;
    let mut bodies = Bodies::default();
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
        None => {
            let concluded = Box::pin(conclude(
                shared,
                &info,
                &conversation,
                &parsed,
                &mut underway,
                &mut bodies,
            ));
            if info.delivered <= 1 {
                concluded.await
            } else {
                // Delivered again: one delivery of the message at work at a time.
                match attempt_claim::take(&shared.outlet.progress, &info, liveness).await {
                    Some(mut held) => {
                        let ending =
                            super::liveness::while_keeping(concluded, held.keep(liveness)).await;
                        claim = Some(held);
                        ending
                    }
                    None => Ending::AwaitRedelivery {
                        reason: STALE_BEFORE_CLAIM.into(),
                    },
                }
            }
        }
    };
    let response = ending.is_response();
    // A body no response names is gone before the ending is stored, so whoever the
    // ending reaches finds the store as it was.
    if !response && let Some(body) = bodies.response.take() {
        Box::pin(body.keep_if(false)).await;
    }
    let settled = settle(
        &shared.outlet,
        delivery,
        &conversation,
        &mut underway,
        ending,
    )
    .await;
    // A bound request body is kept (for a replay) until a response is settled; one
    // removed before could not be sent again by a redelivery.
    if let Some(stored) = bodies.request
        && response
        && settled == Settled::Done
    {
        // Boxed, as every large-body step here: inline, their futures would size every
        // conversation's future, large bodies or not (issue 33).
        Box::pin(super::request_body::remove(&shared.outlet.js, &stored)).await;
    }
    // A response's body is kept unless settle found another delivery's reply stored
    // first (this delivery was stalled past its ack wait): only settle can tell.
    if let Some(body) = bodies.response {
        Box::pin(body.keep_if(!underway.superseded)).await;
    }
    if settled == Settled::Done
        && let Some(claim) = claim
    {
        claim.release().await;
    }
    settled
}

/// What a delivery stored of its bodies, dealt with once it is settled.
#[derive(Default)]
struct Bodies {
    /// The request body bound for the attempt, removed once a response is settled.
    request: Option<super::request_body::StoredRequest>,
    /// Where the response's body went, kept only if the stored reply names it.
    response: Option<Box<super::body_store::BodyWriter>>,
}

/// Before the attempt, the attempt, after it: the delivery's ending.
async fn conclude<'a>(
    shared: &'a Revision,
    info: &DeliveryInfo,
    conversation: &Conversation<'_>,
    parsed: &'a Result<Request, ParseError>,
    underway: &mut Underway<'a>,
    bodies: &mut Bodies,
) -> Ending {
    let go = match before_attempt(shared, info, conversation, parsed, underway).await {
        Ok(go) => go,
        Err(ending) => return ending,
    };
    bodies.request = match Box::pin(super::attempt::bound_request_body(
        shared,
        &go,
        conversation,
        underway,
    ))
    .await
    {
        Ok(stored) => stored,
        Err(ending) => return ending,
    };
    bodies.response = match Box::pin(super::attempt::body_writer(
        shared,
        &go,
        info,
        conversation,
        underway,
    ))
    .await
    {
        Ok(body) => body,
        Err(ending) => return ending,
    };
    let cancelled = underway
        .cancel
        .as_ref()
        .map(|watch| watch.token())
        .unwrap_or_default();
    // Recorded while the bodies were made ready: no attempt yet, none made.
    if let Some(error) = underway.cancelled(info.delivered > 1) {
        return Ending::error(
            conversation,
            underway,
            error,
            AckKind::Ack,
            shared.outlet.max_payload,
        );
    }
    let started = (clock::now_utc(), std::time::Instant::now());
    // A cancel recorded now drops the call: the HTTP request goes with its future.
    let attempted = tokio::select! {
        attempted = Box::pin(attempt(
            shared,
            &go,
            conversation,
            underway,
            bodies.response.as_deref_mut(),
            bodies.request.as_ref(),
        )) => Some(attempted),
        () = cancelled.cancelled() => None,
    };
    match attempted {
        Some(Ok(attempted)) => after_attempt(shared, &go, attempted, conversation, underway).await,
        Some(Err(ending)) => ending,
        None => dropped_in_flight(shared, conversation, underway, started),
    }
}

/// The ending of an attempt a cancel dropped in flight: answered `cancelled`, with the
/// dropped attempt among the attempts, since the upstream may have acted on it.
fn dropped_in_flight(
    shared: &Revision,
    conversation: &Conversation<'_>,
    underway: &mut Underway<'_>,
    (at, started): (time::OffsetDateTime, std::time::Instant),
) -> Ending {
    let by = underway
        .cancel
        .as_ref()
        .and_then(|watch| watch.by())
        .flatten();
    underway.attempts.push(AttemptRecord {
        at: at.format(&Rfc3339).unwrap_or_default(),
        status: None,
        failure: Some(DROPPED.to_string()),
        duration_ms: millis(started.elapsed()),
    });
    underway.cancelled_in_flight = true;
    info!(id = %conversation.raw_id, pool = conversation.pool, origin = %conversation.origin(), "cancelled in flight: the attempt was dropped");
    let error = cancelled_error(by, underway.attempts.count(), true, false);
    Ending::error(
        conversation,
        underway,
        error,
        AckKind::Ack,
        shared.outlet.max_payload,
    )
}

/// The failure an attempt dropped by a cancel is recorded with.
const DROPPED: &str = "cancelled: the attempt was dropped in flight";

const STALE_BEFORE_CLAIM: &str = "no confirmed progress within the ack wait while another delivery held the attempt claim: not attempted";
