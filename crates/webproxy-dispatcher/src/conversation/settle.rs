//! The one settle point: every way a handler can end is an [`Ending`], and
//! [`settle`] stores what it produced, then acks. It is the only code that acks a pool
//! message, and it applies the stale-delivery rule (`liveness`) to every ack.
//!
//! Order matters: the dead letter is stored before the reply (a crash between them
//! loses neither, since the redelivery finds no reply and ends the conversation
//! again under the same message ids), a hop's progress record before the hop, and
//! everything before the ack.

use async_nats::HeaderMap;
use async_nats::jetstream::AckKind;
use tracing::{debug, error, info, warn};
use webproxy_protocol::{ErrorBody, ErrorCode, Origin, header};

use super::dead_letter::{store_dead_letter, supersede_dead_letter, tolerate_missing_stream};
use super::delivery::Delivery;
use super::ending::{Ending, Settled};
use super::progress::{ProgressError, Record};
use super::publish::{Outlet, PublishFailure, Stored, publish_live, publish_stored};
use super::stored_reply::{Kept, store_once};
use super::{Conversation, Underway};
use crate::conversation::hop::{HopKind, HopState, hop_msg_id, new_token};
use crate::conversation::outbox::{EncodedReply, error_reply, minimal_reply};
use crate::hooks;
use crate::observability::trace;

/// Stores what `ending` produced, then acks `delivery`.
pub(crate) async fn settle(
    outlet: &Outlet,
    delivery: &impl Delivery,
    conversation: &Conversation<'_>,
    underway: &mut Underway<'_>,
    ending: Ending,
) -> Settled {
    let stored = match ending {
        Ending::Reply { reply, ack } => {
            reply_or_minimal(outlet, conversation, underway, &reply, ack)
                .await
                .map(|(ack, kept)| {
                    underway.superseded = kept == Some(false);
                    ack
                })
        }
        Ending::Hop {
            kind,
            next,
            pool,
            admitted,
        } => {
            // Held to the end of the hop: the move is published (or not) by then.
            let _admitted = admitted;
            hop(outlet, delivery, conversation, underway, kind, next, &pool).await
        }
        Ending::Answered { reply, generation } => {
            recopy(outlet, conversation, &reply, generation).await;
            forget_record(outlet, conversation, underway).await;
            info!(
                id = %conversation.raw_id,
                pool = conversation.pool,
                origin = %conversation.origin(),
                generation = conversation.generation(),
                "final reply already stored; acking without another attempt"
            );
            Ok(Some(AckKind::Ack))
        }
        Ending::Republish(record) => republish(outlet, delivery, conversation, &record).await,
        Ending::Stale => Ok(Some(stale(conversation))),
        Ending::AwaitRedelivery { reason } => Err(reason),
    };
    match stored {
        Ok(Some(ack)) => {
            ack_current(delivery, conversation, ack).await;
            Settled::Done
        }
        Ok(None) => Settled::Done,
        Err(reason) => await_redelivery(conversation, &reason),
    }
}

/// What an ending stored leaves to do: `Ok(Some(ack))` acks the delivery so,
/// `Ok(None)` leaves it unacked though its ending is stored (a test hook's lost ack),
/// and `Err` leaves it for redelivery, saying why.
type Outcome = Result<Option<AckKind>, String>;

/// A reply ending: the reply stored and sent, or, when it or its dead letter does not
/// fit `max_payload`, a minimal reply in its place, which always fits; and whether the
/// reply stored is this one (`None` for the minimal one).
async fn reply_or_minimal(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    reply: &EncodedReply,
    ack: AckKind,
) -> Result<(Option<AckKind>, Option<bool>), String> {
    match store_reply(outlet, conversation, underway, reply).await {
        Ok(ours) => Ok((Some(ack), Some(ours))),
        Err(PublishFailure::TooLarge { subject }) => {
            error!(
                subject,
                "a reply or dead letter did not fit max_payload; answering with a minimal reply"
            );
            let context = conversation.context(underway, outlet.max_payload);
            let code = reply.error.as_ref().map_or(ErrorCode::Internal, |e| e.code);
            let minimal = minimal_reply(&context, code);
            store_reply(outlet, conversation, underway, &minimal)
                .await
                .map_err(|e| e.to_string())?;
            Ok((Some(ack), None))
        }
        Err(e) => Err(e.to_string()),
    }
}

/// Stores a reply (its dead letter first) and sends its live copies: this delivery's
/// (`true`), or the one another delivery stored for this generation first.
async fn store_reply(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    reply: &EncodedReply,
) -> Result<bool, PublishFailure> {
    match store_ending(outlet, conversation, underway, reply).await? {
        Kept::Ours => {
            finished(outlet, conversation, underway, reply).await;
            Ok(true)
        }
        Kept::Theirs(theirs) => {
            forget_record(outlet, conversation, underway).await;
            info!(
                id = %conversation.raw_id,
                pool = conversation.pool,
                origin = %conversation.origin(),
                generation = theirs.generation,
                "another delivery stored this conversation's reply first; sent that one, not this delivery's"
            );
            Ok(false)
        }
    }
}

/// A hop ending: the next hop recorded in the progress record, then published. Another
/// delivery that recorded it first goes on instead (its hop republished, or this
/// delivery stale); a hop that cannot be handed on at all is answered `internal`.
async fn hop(
    outlet: &Outlet,
    delivery: &impl Delivery,
    conversation: &Conversation<'_>,
    underway: &mut Underway<'_>,
    kind: HopKind,
    next: HopState,
    pool: &str,
) -> Outcome {
    let token = new_token();
    let subject = match kind {
        HopKind::Park => outlet.subjects.retry(conversation.pool, &token),
        HopKind::Move => outlet.subjects.moved(pool, next.caller.as_deref(), &token),
        HopKind::Replay => outlet.subjects.hop(pool, &token),
    };
    let record = Record {
        kind,
        subject,
        msg_id: hop_msg_id(kind, &token),
        hop: next,
        taken_by: None,
    };
    match outlet.progress.write(&record, underway.record).await {
        Ok(revision) => underway.record = Some(revision),
        Err(ProgressError::Conflict { key }) => {
            debug!(key, "the next hop is recorded already");
            return match outlet
                .progress
                .load(conversation.origin(), conversation.generation())
                .await
            {
                Ok(Some((recorded, _))) if recorded.taken_by.is_none() => {
                    republish(outlet, delivery, conversation, &recorded).await
                }
                Ok(_) => Ok(Some(stale(conversation))),
                Err(e) => Err(e.to_string()),
            };
        }
        Err(e) => return Err(e.to_string()),
    }
    match publish_hop(outlet, delivery, conversation, &record).await {
        Ok(()) => {}
        Err(e @ (PublishFailure::TooLarge { .. } | PublishFailure::NoStream { .. })) => {
            error!(error = %e, "cannot hand the request on; answering internal");
            let reply = internal_reply(
                outlet,
                conversation,
                underway,
                format!("the request could not be handed on: {e}"),
            );
            // No minimal reply after this one: a second failure leaves the message.
            store_reply(outlet, conversation, underway, &reply)
                .await
                .map_err(|e| e.to_string())?;
            return Ok(Some(AckKind::Term));
        }
        Err(e) => return Err(e.to_string()),
    }
    if kind == HopKind::Park && hooks::lose_park_ack() {
        return Ok(None);
    }
    Ok(Some(AckKind::Ack))
}

/// A recorded hop published again: the delivery that recorded it may have stopped
/// before publishing it.
async fn republish(
    outlet: &Outlet,
    delivery: &impl Delivery,
    conversation: &Conversation<'_>,
    record: &Record,
) -> Outcome {
    publish_hop(outlet, delivery, conversation, record)
        .await
        .map_err(|e| e.to_string())?;
    debug!(origin = %conversation.origin(), step = record.step(), "republished the recorded hop");
    Ok(Some(AckKind::Ack))
}

/// Not the conversation's current step: acked without attempting.
fn stale(conversation: &Conversation<'_>) -> AckKind {
    debug!(origin = %conversation.origin(), step = conversation.state.step, "not the conversation's current step; acking without attempting");
    AckKind::Ack
}

fn await_redelivery(conversation: &Conversation<'_>, reason: &str) -> Settled {
    warn!(
        id = %conversation.raw_id,
        pool = conversation.pool,
        origin = %conversation.origin(),
        reason,
        "leaving the message for redelivery"
    );
    Settled::AwaitingRedelivery
}

/// An `internal` error ending.
pub(crate) fn internal(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    message: String,
) -> Ending {
    Ending::Reply {
        reply: internal_reply(outlet, conversation, underway, message),
        ack: AckKind::Term,
    }
}

/// An `internal` error reply saying `message`.
fn internal_reply(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    message: String,
) -> EncodedReply {
    let error = ErrorBody {
        code: ErrorCode::Internal,
        message,
        status: None,
    };
    error_reply(&conversation.context(underway, outlet.max_payload), error)
}

/// Publishes a stored reply's live copies again, when this delivery is the step that
/// stored it: it may have stopped between storing the reply and copying it. A late
/// redelivery of an earlier step (a lost park ack) finds a reply whose copies the later
/// step published, and sends none, so the caller gets one.
async fn recopy(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
    stored: &async_nats::Message,
    generation: u64,
) {
    let Some(stored_headers) = stored.headers.as_ref() else {
        return;
    };
    let step = stored_headers
        .get(header::STEP)
        .and_then(|s| s.as_str().parse::<u32>().ok());
    if step.is_some_and(|step| step != conversation.state.step) {
        return;
    }
    let mut headers = HeaderMap::new();
    for name in [header::OUTCOME, header::GENERATION, header::ORIGIN] {
        if let Some(value) = stored_headers.get(name) {
            headers.insert(name, value.clone());
        }
    }
    trace::forward(Some(stored_headers), &mut headers);
    if let Some(id) = conversation.id.as_deref() {
        let live = outlet.subjects.reply(id);
        publish_live(outlet, &live, headers.clone(), stored.payload.clone()).await;
    }
    // Only to the subject stored with the reply: never to the incoming message's
    // `reply_to`, which may be anyone's.
    if let Some(reply_to) = stored_headers.get(header::REPLY_TO) {
        let headers = reply_to_headers(headers, conversation.origin(), generation);
        publish_live(outlet, reply_to.as_str(), headers, stored.payload.clone()).await;
    }
}

/// The headers of the copy to a custom `reply_to`: those of every copy, plus the stored
/// reply's own message id (`<STREAM>:<seq>:<generation>:reply`). A caller that
/// captures its reply space in a stream of its own (an isolated caller, which cannot
/// read the replies stream) then stores each generation's final reply once, however
/// often a redelivery copies it again within its stream's duplicate window.
fn reply_to_headers(mut headers: HeaderMap, origin: &Origin, generation: u64) -> HeaderMap {
    headers.insert(header::MSG_ID, origin.reply_msg_id(generation).as_str());
    headers
}

/// The headers of every copy of a reply.
fn reply_headers(conversation: &Conversation<'_>, reply: &EncodedReply) -> HeaderMap {
    let mut headers = HeaderMap::new();
    let outcome = if reply.error.is_some() {
        "error"
    } else {
        "response"
    };
    headers.insert(header::OUTCOME, outcome);
    headers.insert(
        header::GENERATION,
        conversation.generation().to_string().as_str(),
    );
    headers.insert(header::ORIGIN, conversation.origin().to_string().as_str());
    // The caller continues its trace from the reply.
    trace::inject_nats(&trace::request_context(), &mut headers);
    headers
}

/// Stores the dead letter of an error, then the reply, then publishes the live copies:
/// this delivery's reply, or, when another delivery stored this generation's reply
/// first, that one (a stalled delivery that woke never sends a second body).
async fn store_ending(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    reply: &EncodedReply,
) -> Result<Kept, PublishFailure> {
    let headers = reply_headers(conversation, reply);
    if let Some(error) = &reply.error {
        store_dead_letter(outlet, conversation, underway, error).await?;
        hooks::exit_after_dead_letter();
    }
    if let Some(id) = conversation.id.as_deref() {
        let mut stored_headers = headers.clone();
        stored_headers.insert(header::STEP, conversation.state.step.to_string().as_str());
        // What a caller's cancel shows is checked against, once it is finished.
        if let Some(hash) = &conversation.state.msg_id_sha256 {
            stored_headers.insert(header::MSG_ID_SHA256, hash.as_str());
        }
        if let Some(reply_to) = conversation.reply_to.as_deref() {
            stored_headers.insert(header::REPLY_TO, reply_to);
        }
        let subject = outlet.subjects.stored_reply(id, conversation.origin());
        let msg_id = conversation
            .origin()
            .reply_msg_id(conversation.generation());
        let stored = Stored {
            subject: &subject,
            msg_id: &msg_id,
            headers: &stored_headers,
            payload: &reply.payload,
        };
        let kept = store_once(
            outlet,
            stored,
            conversation.origin(),
            conversation.generation(),
        );
        match tolerate_missing_stream(kept.await)? {
            Kept::Theirs(theirs) => {
                if reply.error.is_some() && outcome(&theirs.message) != Some("error") {
                    supersede_dead_letter(outlet, conversation).await?;
                }
                recopy(outlet, conversation, &theirs.message, theirs.generation).await;
                return Ok(Kept::Theirs(theirs));
            }
            Kept::Ours => {}
        }
        publish_live(
            outlet,
            &outlet.subjects.reply(id),
            headers.clone(),
            reply.payload.clone(),
        )
        .await;
    }
    if let Some(reply_to) = conversation.reply_to.as_deref() {
        let headers = reply_to_headers(headers, conversation.origin(), conversation.generation());
        publish_live(outlet, reply_to, headers, reply.payload.clone()).await;
    }
    Ok(Kept::Ours)
}

/// A stored reply's `Webproxy-Outcome`: `response` or `error`.
fn outcome(stored: &async_nats::Message) -> Option<&str> {
    stored
        .headers
        .as_ref()
        .and_then(|h| h.get(header::OUTCOME))
        .map(|v| v.as_str())
}

/// Publishes a recorded hop, with the conversation's request as its payload.
async fn publish_hop(
    outlet: &Outlet,
    delivery: &impl Delivery,
    conversation: &Conversation<'_>,
    record: &Record,
) -> Result<(), PublishFailure> {
    let mut headers = HeaderMap::new();
    headers.insert(header::HOP, record.hop.format().as_str());
    trace::forward(delivery.headers(), &mut headers);
    // The caller's envelope byte for byte: it holds no injected value the caller did
    // not write itself, and rewriting what it wrote would answer a guess.
    let payload = conversation.payload.clone();
    let stored = Stored {
        subject: &record.subject,
        msg_id: &record.msg_id,
        headers: &headers,
        payload: &payload,
    };
    publish_stored(outlet, stored).await
}

/// The bookkeeping of a conversation that ended: its record goes, its metrics and the
/// one log line per finished conversation are written.
async fn finished(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    reply: &EncodedReply,
) {
    forget_record(outlet, conversation, underway).await;
    let code = reply.error.as_ref().map(|e| e.code.as_str());
    outlet
        .metrics
        .request_finished(conversation.pool, underway.rule, code);
    if reply.error.as_ref().map(|e| e.code) == Some(ErrorCode::Cancelled) {
        let state = match (
            underway.cancelled_in_flight,
            conversation.state.attempts.is_empty(),
        ) {
            (true, _) => "in_flight",
            (false, true) => "waiting",
            (false, false) => "parked",
        };
        outlet
            .metrics
            .conversation_cancelled(conversation.pool, state);
    }
    info!(
        id = %conversation.raw_id,
        pool = conversation.pool,
        rule = underway.rule,
        outcome = if reply.error.is_some() { "error" } else { "response" },
        code = code.unwrap_or("none"),
        attempts = underway.attempts.count(),
        duration_ms = conversation.elapsed_ms(),
        "conversation finished"
    );
}

/// Deletes the progress record of a conversation that settled, if it has one, and the
/// cancel of its generation, if this delivery saw one.
async fn forget_record(outlet: &Outlet, conversation: &Conversation<'_>, underway: &Underway<'_>) {
    if let Some(watch) = &underway.cancel {
        outlet.cancels.forget(watch).await;
    }
    if underway.record.is_some()
        && let Err(e) = outlet
            .progress
            .delete(conversation.origin(), conversation.generation())
            .await
    {
        // The bucket's age limit removes it later; a missing record is never read as done.
        warn!(error = %e, "cannot delete the progress record of a settled conversation");
    }
}

/// Acks, unless the delivery went stale meanwhile: acks count by stream sequence
/// alone, so a stale delivery's ack would free the slot that the redelivered copy
/// holds. That copy finds what this one stored (the reply, or the recorded hop) and
/// acks for both.
async fn ack_current(delivery: &impl Delivery, conversation: &Conversation<'_>, kind: AckKind) {
    if !conversation.liveness.is_current() {
        info!(id = %conversation.raw_id, pool = conversation.pool, "the delivery may have been redelivered elsewhere (no confirmed progress within the ack wait); leaving it unacked");
        return;
    }
    if let Err(e) = delivery.ack(kind).await {
        warn!(error = %e, "ack failed; the server will redeliver the message");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reply_to_copy_carries_the_stored_replys_message_id() {
        let origin = Origin::new("WEBPROXY_POOL_DEFAULT", 42);
        let mut live = HeaderMap::new();
        live.insert(header::ORIGIN, origin.to_string().as_str());
        let copy = reply_to_headers(live.clone(), &origin, 0);
        assert_eq!(
            copy.get(header::MSG_ID).map(|v| v.as_str()),
            Some("WEBPROXY_POOL_DEFAULT:42:0:reply")
        );
        assert_eq!(
            copy.get(header::MSG_ID).map(|v| v.as_str().to_string()),
            Some(origin.reply_msg_id(0)),
            "the same id as the stored reply's, so every copy of it is one message"
        );
        // The rest of the copy is untouched.
        assert_eq!(copy.get(header::ORIGIN), live.get(header::ORIGIN));
        // A replay's reply is a new message; another conversation's never collides.
        let replayed = reply_to_headers(live.clone(), &origin, 1);
        let other = reply_to_headers(live, &Origin::new("WEBPROXY_POOL_DEFAULT", 43), 0);
        assert_ne!(replayed.get(header::MSG_ID), copy.get(header::MSG_ID));
        assert_ne!(other.get(header::MSG_ID), copy.get(header::MSG_ID));
    }
}
