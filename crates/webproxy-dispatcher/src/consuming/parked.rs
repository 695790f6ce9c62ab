//! Parked retries: a request waiting for its next attempt sits on its own retry subject
//! (`retry.<pool>.<token>`), where the pool's retry consumer (with a large
//! `max_ack_pending`) NAKs it with the remaining delay until it is due, then hands it
//! back to the pool on `hop.<pool>.<token>`. The wait therefore holds no slot of the
//! pool's concurrency limit.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};
use webproxy_protocol::header;

use super::pull_loop::next_or_stop;
use crate::conversation::Revision;
use crate::conversation::hop::{HopState, due_msg_id, subject_token};
use crate::conversation::publish::{Stored, publish_stored};
use webproxy_jetstream::backoff::PULL_BACKOFF;

/// A parked retry that is due within this much is released at once rather than NAKed
/// for a few milliseconds more.
const DUE_SLACK: Duration = Duration::from_millis(5);

pub(crate) async fn park_loop(
    shared: Arc<Revision>,
    pool: Arc<str>,
    consumer: PullConsumer,
    tasks: TaskTracker,
    shutdown: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        let mut messages = tokio::select! {
            messages = consumer.messages() => match messages {
                Ok(m) => m,
                Err(e) => {
                    failures += 1;
                    warn!(pool = %pool, error = %e, "cannot consume parked retries; retrying");
                    if PULL_BACKOFF.wait(failures, &shutdown).await { continue } else { return }
                }
            },
            _ = shutdown.cancelled() => return,
        };
        failures = 0;
        loop {
            let Some(next) = next_or_stop(&mut messages, &shutdown).await else {
                return;
            };
            match next {
                Some(Ok(message)) => {
                    let shared = shared.clone();
                    let pool = pool.clone();
                    tasks.spawn(async move { release_when_due(&shared, &pool, message).await });
                }
                Some(Err(e)) => {
                    debug!(pool = %pool, error = %e, "parked retry stream ended");
                    break;
                }
                None => break,
            }
        }
    }
}

/// NAKs a parked retry for the rest of its wait, or, once due, publishes it on the
/// pool's hop subject of the same token, under `due:<token>`, and acks it. The hop
/// state goes along unread beyond its due time: the pool's handler reads it, and
/// answers a malformed one.
async fn release_when_due(shared: &Revision, pool: &str, message: jetstream::Message) {
    let headers = message.headers.as_ref();
    let due = HopState::parse(headers.and_then(|h| h.get(header::HOP)).map(|v| v.as_str()))
        .ok()
        .and_then(|state| state.due());
    if let Some(wait) =
        due.and_then(|due| due.duration_since(webproxy_jetstream::clock::now()).ok())
        && wait > DUE_SLACK
    {
        if let Err(e) = message.ack_with(AckKind::Nak(Some(wait))).await {
            debug!(error = %e, "nak of a parked retry failed; it comes back after ack_wait");
        }
        return;
    }
    let Some(token) = subject_token(message.subject.as_str()) else {
        warn!(subject = %message.subject, "parked retry on a subject without a token; terminating it");
        let _ = message.ack_with(AckKind::Term).await;
        return;
    };
    let mut forward = async_nats::HeaderMap::new();
    for (name, values) in headers.into_iter().flat_map(|h| h.iter()) {
        let name_str: &str = name.as_ref();
        if name_str == header::MSG_ID {
            continue;
        }
        for value in values {
            forward.append(name.clone(), value.clone());
        }
    }
    let subject = shared.outlet.subjects.hop(pool, token);
    let msg_id = due_msg_id(token);
    let stored = Stored {
        subject: &subject,
        msg_id: &msg_id,
        headers: &forward,
        payload: &message.payload,
    };
    match publish_stored(&shared.outlet, stored).await {
        // Only the retry consumer acks here: parked retries are not pool slots.
        Ok(()) => {
            if let Err(e) = message.ack_with(AckKind::Ack).await {
                debug!(error = %e, "ack of a released retry failed; it is released again, deduplicated");
            }
        }
        Err(e) => warn!(error = %e, "cannot release a parked retry; it comes back after ack_wait"),
    }
}
