//! The conversation path: what one delivered message passes, envelope → plan →
//! attempt → verdict → settle. [`handle`] is the entry, per delivery, and runs
//! `before`, `attempt` and `after` in turn; the pure modules (`plan` before the attempt,
//! `verdict` after it, `outbox`, `hop`) decide; `settle` alone acks.
//!
//! A message is always answered, dead-lettered, parked, or left unacked for
//! redelivery; it is never acked before what it produced is stored.
//!
//! This module holds one conversation as a delivery presents it, built at the trust boundary: a
//! message on the caller's request subject is step 0 of generation 0 of the
//! conversation whose origin is its own stream sequence, whatever `Webproxy-*` headers
//! it carries; only the service's own hop and retry subjects carry hop state.

pub(crate) mod after;
pub(crate) mod attempt;
pub(crate) mod attempt_claim;
pub(crate) mod before;
pub(crate) mod body_store;
pub(crate) mod cancels;
pub(crate) mod dead_letter;
pub(crate) mod delivery;
pub(crate) mod egress;
pub(crate) mod ending;
pub(crate) mod handle;
pub(crate) mod hop;
pub(crate) mod liveness;
pub(crate) mod operator;
pub(crate) mod outbox;
pub(crate) mod pacing;
pub(crate) mod plan;
pub(crate) mod progress;
pub(crate) mod publish;
pub(crate) mod replay;
pub(crate) mod request_body;
pub(crate) mod settle;
pub(crate) mod stored_reply;
#[cfg(test)]
pub(crate) mod tests;
pub(crate) mod unattempted;
pub(crate) mod verdict;

use std::sync::Arc;

use webproxy_config::secrets::Secrets;
use webproxy_config::settings::Settings;
use webproxy_worker::Worker;

use crate::observability::gauges::Gauges;
use crate::observability::health::Health;
use publish::Outlet;

use bytes::Bytes;
use serde_json::value::RawValue;
use webproxy_protocol::{Origin, ParseError, Request, Subjects, header};

use crate::conversation::hop::{AttemptHistory, HopError, HopState};
use crate::conversation::outbox::ReplyContext;
use delivery::{Delivery, DeliveryInfo};
use liveness::Liveness;

/// Where a delivery stands in its conversation, read from the delivery alone, before
/// its payload is parsed: its pool, its hop state and whether it came on a service
/// subject. What the progress record and the parse need first.
#[derive(Debug)]
pub(crate) struct Arrival<'a> {
    pub(crate) pool: &'a str,
    /// Origin, generation, step, attempts and the caller's publish time.
    pub(crate) state: HopState,
    /// It arrived on a service-only subject (a hop), not the caller's request subject.
    pub(crate) hop: bool,
}

impl<'a> Arrival<'a> {
    /// The arrival of a delivery, and the error of a hop header that is not what the
    /// service writes (the arrival then falls back to the delivery's own origin, so the
    /// conversation can still be answered and dead-lettered).
    pub(crate) fn new(
        pool: &'a str,
        delivery: &impl Delivery,
        info: &DeliveryInfo,
        subjects: &Subjects,
    ) -> (Arrival<'a>, Option<HopError>) {
        // The caller's name comes from the subject it published on, which NATS
        // permissions confine; never from anything it wrote.
        let request_caller = subjects.request_caller(pool, delivery.subject());
        let mut own = HopState::first(
            Origin::new(info.stream.as_str(), info.seq),
            info.published,
            request_caller.flatten(),
        );
        let hop = request_caller.is_none();
        if !hop {
            own.msg_id_sha256 = delivery
                .headers()
                .and_then(|h| h.get(header::MSG_ID))
                .and_then(|id| webproxy_protocol::capability_sha256(id.as_str()));
        }
        let (state, error) = if hop {
            let header = delivery
                .headers()
                .and_then(|h| h.get(header::HOP))
                .map(|v| v.as_str());
            match HopState::parse(header) {
                Ok(state) => (state, None),
                Err(e) => (own, Some(e)),
            }
        } else {
            (own, None)
        };
        (Arrival { pool, state, hop }, error)
    }
}

/// One conversation as its delivery presents it: built once, after the payload is
/// parsed, and never changed. What the delivery does to it meanwhile is [`Underway`].
#[derive(Debug)]
pub(crate) struct Conversation<'a> {
    pub(crate) pool: &'a str,
    /// Origin, generation, step, the attempts before this delivery and the caller's
    /// publish time, as the delivery arrived with them.
    pub(crate) state: HopState,
    /// It arrived on a service-only subject (a hop), not the caller's request subject.
    pub(crate) hop: bool,
    /// A valid id: the reply goes to `<prefix>.reply.<id>`.
    pub(crate) id: Option<String>,
    /// The id as given, for the reply body even when it is invalid.
    pub(crate) raw_id: String,
    pub(crate) reply_to: Option<String>,
    pub(crate) metadata: Option<Box<RawValue>>,
    pub(crate) payload: Bytes,
    /// Whether the delivery is still the server's current one: see `liveness`.
    pub(crate) liveness: &'a Liveness,
}

/// What one delivery has done to its conversation so far, passed from step to step:
/// the rule that decided it, the progress record's revision it holds, and the attempts
/// (those it arrived with, and its own).
#[derive(Debug)]
pub(crate) struct Underway<'a> {
    /// The rule that decided, `none` until one did: a metrics label.
    pub(crate) rule: &'a str,
    /// The revision of the conversation's progress record, once one is known to exist.
    pub(crate) record: Option<u64>,
    pub(crate) attempts: AttemptHistory,
    /// Settle found this generation's reply stored by another delivery first: this
    /// delivery's ending, and any body it stored, went nowhere.
    pub(crate) superseded: bool,
    /// The conversation's cancel as this instance knows it, watched while the
    /// delivery runs (none for an operator's one-off ending).
    pub(crate) cancel: Option<crate::conversation::cancels::CancelWatch>,
    /// A cancel dropped this delivery's attempt in flight.
    pub(crate) cancelled_in_flight: bool,
}

impl<'r> Underway<'r> {
    /// The error of a cancel recorded for this conversation, if one is, for an ending
    /// without an attempt by this delivery (`redelivered`: the server delivered it
    /// before, and an attempt then may not be recorded).
    pub(crate) fn cancelled(&self, redelivered: bool) -> Option<webproxy_protocol::ErrorBody> {
        let by = self.cancel.as_ref()?.by()?;
        Some(crate::conversation::cancels::cancelled_error(
            by,
            self.attempts.count(),
            false,
            redelivered,
        ))
    }

    /// Nothing done yet: no rule, no record, the attempts `arrival` came with.
    pub(crate) fn new(arrival: &Arrival<'_>) -> Underway<'r> {
        Underway {
            rule: "none",
            record: None,
            attempts: arrival.state.attempts.clone(),
            superseded: false,
            cancel: None,
            cancelled_in_flight: false,
        }
    }
}

impl<'a> Conversation<'a> {
    /// The conversation `arrival` belongs to, with what its parsed payload says of it
    /// (an undecodable payload says nothing).
    pub(crate) fn new(
        arrival: Arrival<'a>,
        payload: Bytes,
        parsed: &Result<Request, ParseError>,
        liveness: &'a Liveness,
    ) -> Conversation<'a> {
        let (id, raw_id, reply_to, metadata) = match parsed {
            Ok(request) => (
                Some(request.id.clone()),
                request.id.clone(),
                request.reply_to.clone(),
                request.metadata.clone(),
            ),
            Err(ParseError::Invalid(invalid)) => (
                invalid.id.clone(),
                invalid.raw_id.clone().unwrap_or_default(),
                invalid.reply_to.clone(),
                invalid.metadata.clone(),
            ),
            Err(ParseError::Undecodable { .. }) => (None, String::new(), None, None),
        };
        Conversation {
            pool: arrival.pool,
            state: arrival.state,
            hop: arrival.hop,
            id,
            raw_id,
            reply_to,
            metadata,
            payload,
            liveness,
        }
    }

    /// The caller name of the request subject, carried along every hop.
    pub(crate) fn caller(&self) -> Option<&str> {
        self.state.caller.as_deref()
    }

    pub(crate) fn origin(&self) -> &Origin {
        &self.state.origin
    }

    pub(crate) fn generation(&self) -> u64 {
        self.state.generation
    }

    /// What the reply says besides its outcome, after `underway`'s attempts.
    pub(crate) fn context(&self, underway: &Underway<'_>, max_payload: usize) -> ReplyContext<'_> {
        ReplyContext {
            id: &self.raw_id,
            attempts: underway.attempts.count(),
            duration_ms: self.elapsed_ms(),
            metadata: self.metadata.as_deref(),
            max_payload,
        }
    }

    /// Since the caller's publish: queue wait and backoff included.
    pub(crate) fn elapsed_ms(&self) -> u64 {
        let elapsed = webproxy_jetstream::clock::now()
            .duration_since(self.state.first_published())
            .unwrap_or_default();
        crate::conversation::hop::millis(elapsed)
    }
}

/// Everything a message handler needs, shared by all of them: one revision of the
/// cluster part, swapped whole by `crate::consuming::revisions::Revisions`.
#[derive(Clone)]
pub(crate) struct Revision {
    pub(crate) settings: Arc<Settings>,
    pub(crate) health: Arc<Health>,
    pub(crate) gauges: Arc<Gauges>,
    pub(crate) outlet: Outlet,
    pub(crate) worker: Worker,
    /// Injected credentials, per rule.
    pub(crate) secrets: Arc<Secrets>,
    /// Pauses and rate limits: the same for every revision.
    pub(crate) pool_control: Arc<crate::pool::control::PoolControl>,
    /// The `ack_wait` progress acks are paced from: the same for every revision.
    pub(crate) pacing: Arc<pacing::Pacing>,
}
