//! Ending a conversation that was never attempted, through the same settle code as the
//! service: the operator's `pools remove --dead-letter`.

use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use webproxy_protocol::{ErrorBody, parse_request};

use super::delivery::Delivery;
use super::ending::{Ending, Settled};
use super::liveness::Liveness;
use super::publish::Outlet;
use super::settle::settle;
use super::{Arrival, Conversation, Underway};

impl Outlet {
    /// `Operator::end_unattempted`: used where a message must leave the stream
    /// unattempted (`pools remove --dead-letter`).
    pub(crate) async fn end_unattempted(
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
        let ending = Ending::error(
            &conversation,
            &underway,
            error,
            AckKind::Ack,
            self.max_payload,
        );
        settle(self, message, &conversation, &mut underway, ending).await
    }
}
