//! The operator API: what the binary's operator commands (`dead replay`, `pools remove
//! --dead-letter`) do to conversations, through the service's own code on their own
//! connection. The handlers publish through the crate's [`Outlet`]; this is the one
//! way in from outside.

use async_nats::jetstream::{self, kv};
use webproxy_protocol::{DeadLetter, ErrorBody, Subjects};

use super::ending::Settled;
use super::publish::Outlet;
use super::replay::{Replay, ReplayError};

/// Ends or replays conversations for an operator.
#[derive(Debug, Clone)]
pub struct Operator {
    outlet: Outlet,
}

impl Operator {
    /// An operator on its own connection, with the deployment's `subjects` and progress
    /// bucket. It loads no secrets: what it publishes is what the callers sent.
    pub fn new(client: async_nats::Client, subjects: Subjects, progress: kv::Store) -> Operator {
        Operator {
            outlet: Outlet::operator(client, subjects, progress),
        }
    }

    /// Publishes the letter's request as the first hop of a new generation of its
    /// conversation, into the letter's pool; returns that generation.
    pub async fn replay(&self, letter: &DeadLetter, mode: Replay) -> Result<u64, ReplayError> {
        self.outlet.replay(letter, mode).await
    }

    /// Ends a conversation that was never attempted with `error`, through the same
    /// settle code as the service: the caller is answered when the payload names a
    /// valid id or `reply_to`, and the request is dead-lettered. `AwaitingRedelivery`
    /// means it could not be stored, and the message is still there.
    pub async fn end_unattempted(
        &self,
        pool: &str,
        message: &jetstream::Message,
        error: ErrorBody,
    ) -> Settled {
        self.outlet.end_unattempted(pool, message, error).await
    }
}
