//! One conversation as a delivery presents it, built at the trust boundary: a
//! message on the caller's request subject is step 0 of generation 0 of the
//! conversation whose origin is its own stream sequence, whatever `Webproxy-*` headers
//! it carries; only the service's own hop and retry subjects carry hop state.

use bytes::Bytes;
use serde_json::value::RawValue;
use webproxy_protocol::{Origin, ParseError, Request, Subjects, header};

use super::delivery::{Delivery, DeliveryInfo};
use super::liveness::Liveness;
use crate::hop::{HopError, HopState};
use crate::outbox::ReplyContext;

/// One conversation's state while its message is handled.
#[derive(Debug)]
pub(super) struct Conversation<'a> {
    pub(crate) pool: &'a str,
    /// Origin, generation, step, attempts and the caller's publish time.
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
    /// The rule that decided, `none` until one did: a metrics label.
    pub(crate) rule: &'a str,
    /// The revision of the conversation's progress record, once one is known to exist.
    pub(crate) record: Option<u64>,
    /// Whether the delivery is still the server's current one: see `liveness`.
    pub(crate) liveness: &'a Liveness,
}

impl<'a> Conversation<'a> {
    /// The conversation of a delivery, and the error of a hop header that is not what
    /// the service writes (the conversation then falls back to the delivery's own
    /// origin, so it can still be answered and dead-lettered).
    pub(super) fn new(
        pool: &'a str,
        delivery: &impl Delivery,
        info: &DeliveryInfo,
        subjects: &Subjects,
        liveness: &'a Liveness,
    ) -> (Conversation<'a>, Option<HopError>) {
        // The caller's name comes from the subject it published on, which NATS
        // permissions confine; never from anything it wrote.
        let request_caller = subjects.request_caller(pool, delivery.subject());
        let own = HopState::first(
            Origin::new(info.stream.as_str(), info.seq),
            info.published,
            request_caller.flatten(),
        );
        let hop = request_caller.is_none();
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
        let conversation = Conversation {
            pool,
            state,
            hop,
            id: None,
            raw_id: String::new(),
            reply_to: None,
            metadata: None,
            payload: delivery.payload().clone(),
            rule: "none",
            record: None,
            liveness,
        };
        (conversation, error)
    }

    /// Takes the id, `reply_to` and metadata from the parsed payload: as far as they
    /// are valid even when the envelope is not, so the caller can be answered.
    pub(super) fn absorb(&mut self, parsed: &Result<Request, ParseError>) {
        match parsed {
            Ok(request) => {
                self.id = Some(request.id.clone());
                self.raw_id = request.id.clone();
                self.reply_to = request.reply_to.clone();
                self.metadata = request.metadata.clone();
            }
            Err(ParseError::Invalid(invalid)) => {
                self.id = invalid.id.clone();
                self.raw_id = invalid.raw_id.clone().unwrap_or_default();
                self.reply_to = invalid.reply_to.clone();
                self.metadata = invalid.metadata.clone();
            }
            Err(ParseError::Undecodable { .. }) => {}
        }
    }

    /// The caller name of the request subject, carried along every hop.
    pub(super) fn caller(&self) -> Option<&str> {
        self.state.caller.as_deref()
    }

    pub(super) fn origin(&self) -> &Origin {
        &self.state.origin
    }

    pub(super) fn generation(&self) -> u64 {
        self.state.generation
    }

    /// What the reply says besides its outcome.
    pub(super) fn context(&self, max_payload: usize) -> ReplyContext<'_> {
        ReplyContext {
            id: &self.raw_id,
            attempts: self.state.attempts.count(),
            duration_ms: self.elapsed_ms(),
            metadata: self.metadata.as_deref(),
            max_payload,
        }
    }

    /// Since the caller's publish: queue wait and backoff included.
    pub(super) fn elapsed_ms(&self) -> u64 {
        let elapsed = crate::clock::now()
            .duration_since(self.state.first_published())
            .unwrap_or_default();
        crate::hop::millis(elapsed)
    }
}
