//! After the attempt: what its outcome means, for the pool (pool control's second
//! call) and for the conversation (the pure [`verdict_for`]), turned into the
//! [`Ending`] `settle` carries out: the reply, or a park until the retry is due.

use std::time::SystemTime;

use async_nats::jetstream::AckKind;
use tracing::{Span, debug};
use webproxy_config::rules::IDEMPOTENCY_KEY;
use webproxy_jetstream::clock;

use super::attempt::Attempted;
use super::before::Go;
use super::ending::Ending;
use super::{Conversation, Revision, Underway};
use crate::conversation::hop::millis;
use crate::conversation::outbox::{error_reply, response_reply, stored_response_reply};
use crate::conversation::verdict::{AttemptContext, Verdict, pool_pause, verdict_for};
use crate::observability::trace;
use crate::pool::outcome::AttemptEnded;

/// The ending an attempt leads to, once pool control has taken its outcome.
pub(crate) async fn after_attempt(
    shared: &Revision,
    go: &Go<'_>,
    attempted: Attempted,
    conversation: &Conversation<'_>,
    underway: &mut Underway<'_>,
) -> Ending {
    let Go {
        request,
        rule,
        probe,
    } = *go;
    let Attempted {
        outcome,
        record,
        timeout,
        stored,
    } = attempted;
    shared
        .pool_control
        .attempt_ended(
            shared.settings.cluster.pools.get(&rule.pool),
            AttemptEnded {
                rule,
                timeout,
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
        large_body: request.large_body,
    };
    let max_payload = shared.outlet.max_payload;
    let reply = match verdict_for(outcome, &context) {
        Verdict::Respond(response) => {
            let context = conversation.context(underway, max_payload);
            match stored {
                Some(object) => stored_response_reply(&context, &response, object),
                None => response_reply(&context, &response),
            }
        }
        Verdict::Fail(error) => error_reply(&conversation.context(underway, max_payload), error),
        // Settle says so, with the reason.
        Verdict::Redeliver { reason } => return Ending::AwaitRedelivery { reason },
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
