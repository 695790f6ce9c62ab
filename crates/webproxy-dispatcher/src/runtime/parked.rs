//! Parked retries: a request waiting for its next attempt sits on the pool's retry
//! subject, where its own consumer (with a large `max_ack_pending`) NAKs it with the
//! remaining delay until it is due, then republishes it to the pool's request subject.
//! The wait therefore holds no slot of the pool's concurrency limit.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, AckKind};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};
use webproxy_protocol::header;

use super::handle::{Hop, ack};
use super::publish::{from_unix_ms, publish_stored};
use super::{Shared, back_off, next_or_stop};

/// A parked retry that is due within this much is republished at once rather than
/// NAKed for a few milliseconds more.
const DUE_SLACK: Duration = Duration::from_millis(5);

pub(super) async fn park_loop(
    shared: Arc<Shared>,
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
                    if back_off(failures, &shutdown).await { continue } else { return }
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

/// NAKs a parked retry for the rest of its wait, or, once due, republishes it to the
/// pool's request subject under its own message id and acks it.
async fn release_when_due(shared: &Shared, pool: &str, message: jetstream::Message) {
    let headers = message.headers.as_ref();
    let due = headers
        .and_then(|h| h.get(header::DUE))
        .and_then(|v| v.as_str().parse::<u64>().ok())
        .map(from_unix_ms);
    let now = SystemTime::now();
    if let Some(wait) = due.and_then(|due| due.duration_since(now).ok())
        && wait > DUE_SLACK
    {
        if let Err(e) = message.ack_with(AckKind::Nak(Some(wait))).await {
            debug!(error = %e, "nak of a parked retry failed; it comes back after ack_wait");
        }
        return;
    }
    let hop = Hop::read(headers);
    let id = headers
        .and_then(|h| h.get(header::ID))
        .map(|v| v.as_str().to_string())
        .unwrap_or_default();
    let msg_id = format!("{id}:{}:due:{}", hop.generation, hop.attempts.len());
    let mut forward = async_nats::HeaderMap::new();
    if let Some(headers) = headers {
        for (name, values) in headers.iter() {
            let name_str: &str = name.as_ref();
            if name_str == header::DUE || name_str == header::MSG_ID {
                continue;
            }
            for value in values {
                forward.append(name.clone(), value.clone());
            }
        }
    }
    let subject = shared.outlet.subjects.request(pool);
    publish_stored(
        &shared.outlet,
        &message,
        &subject,
        Some(&msg_id),
        &forward,
        &message.payload,
    )
    .await;
    ack(&message, AckKind::Ack).await;
}
