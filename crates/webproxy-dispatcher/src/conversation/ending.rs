//! How a delivery ends: the [`Ending`] a handler decides, which `settle` carries out,
//! and what became of the delivery once it has ([`Settled`]).

use async_nats::jetstream::AckKind;

use webproxy_protocol::ErrorBody;

use super::progress::Record;
use super::{Conversation, Underway};
use crate::conversation::hop::{HopKind, HopState};
use crate::conversation::outbox::{EncodedReply, error_reply};
use crate::pool::admission::Admitted;

/// How a handler ends.
#[derive(Debug)]
pub(crate) enum Ending {
    /// The final reply, then `ack`; an error reply is dead-lettered first.
    Reply { reply: EncodedReply, ack: AckKind },
    /// Hand the request on as `next`: record the hop, publish it, ack. A park goes to
    /// the conversation's own pool's retry subject, a move to `pool`'s moved subject
    /// (held `admitted` until published: `admission.rs`), a replay to its hop subject.
    Hop {
        kind: HopKind,
        next: HopState,
        pool: String,
        admitted: Option<Admitted>,
    },
    /// The final reply of this generation or a later one (`generation`, the stored
    /// reply's own) is stored already: copy it to the live subject and to the
    /// `reply_to` stored with it, then ack.
    Answered {
        reply: async_nats::Message,
        generation: u64,
    },
    /// The conversation went on without this delivery and its recorded hop may be
    /// unpublished: publish it again under its own message id, then ack.
    Republish(Record),
    /// Another delivery holds the conversation: ack, nothing else.
    Stale,
    /// Leave the message unacked, for the server to redeliver after `ack_wait`.
    AwaitRedelivery { reason: String },
}

impl Ending {
    /// Whether this ending is a `response` reply (not an error): what a stored body
    /// must end in to be kept.
    pub(crate) fn is_response(&self) -> bool {
        matches!(self, Ending::Reply { reply, .. } if reply.error.is_none())
    }

    /// Park the request in `pool` as `next`, until it is due.
    pub(crate) fn park(next: HopState, pool: &str) -> Ending {
        Ending::Hop {
            kind: HopKind::Park,
            next,
            pool: pool.to_string(),
            admitted: None,
        }
    }
}

/// What became of the delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Everything it produced is stored and it was acked (or, being possibly stale,
    /// deliberately not).
    Done,
    /// Left for redelivery: something could not be stored.
    AwaitingRedelivery,
}

impl Ending {
    /// The ending that answers `conversation` with `error` and then acks as `ack` says.
    pub(crate) fn error(
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
}
