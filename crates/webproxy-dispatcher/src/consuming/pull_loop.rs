//! One pool's pull loop: pulls as many messages as there are free local slots and
//! starts each one's conversation at once.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use futures::StreamExt as _;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::Revisions;
use super::pull::{PULL_EXPIRES, Pull, PullEnd};
use crate::conversation::handle;
use crate::conversation::liveness::{self, Liveness, while_keeping};
use webproxy_jetstream::backoff::PULL_BACKOFF;
use webproxy_jetstream::provision::LayoutRefusal;

/// The most messages one pull asks for.
const MAX_PULL: usize = 256;

/// The stream's next item, or `None` once `shutdown` is cancelled; an ended stream is
/// `Some(None)`.
pub(crate) async fn next_or_stop<S: futures::Stream + Unpin>(
    stream: &mut S,
    shutdown: &CancellationToken,
) -> Option<Option<S::Item>> {
    tokio::select! {
        next = stream.next() => Some(next),
        _ = shutdown.cancelled() => None,
    }
}

/// Pulls as many messages as there are free local slots and starts each at once: a
/// message buffered here would hold a cluster-wide slot that an idle instance could use.
/// A pull lost in an outage is noticed by its missing heartbeats, and every pull is
/// made again the moment the connection is back; a missing consumer is recreated (the
/// pool is not ready meanwhile); failures and quick empty pulls back off.
pub(crate) async fn pull_loop(
    live: Arc<Revisions>,
    pool: Arc<str>,
    mut consumer: PullConsumer,
    permits: Arc<Semaphore>,
    attempts: TaskTracker,
    shutdown: CancellationToken,
) {
    let mut connections = live.load().health.connections();
    let mut states = live.load().pool_control.states();
    let mut failures = 0u32;
    // Counted up each time the consumer's leader stops serving the pull: every delivery
    // held from before is stale from then on (`liveness::Leadership`).
    let leadership = tokio::sync::watch::Sender::new(0u64);
    let held_deliveries = Arc::new(liveness::HeldDeliveries::default());
    // The inbox is kept from one pull request to the next while they end cleanly: a
    // subscription per request cost the server a SUB and an UNSUB per batch, which at
    // low concurrency is one per message, and a message that arrived after its
    // request's end went to a dead inbox.
    let mut pulling: Option<Pull> = None;
    loop {
        // The revision running when the pull starts: ack_wait may have changed.
        let shared = live.load();
        let arrived_under = shared.settings.cluster.ack_wait;
        // As many as can start now, and never fewer than one: a pull already waiting
        // at the server lets the next message go out the moment a slot frees, instead
        // of a round trip later. It cannot overfill this instance: the server holds
        // deliveries to max_ack_pending, the number of local permits, and a message
        // delivered while all are taken is kept by its progress acks meanwhile.
        let wanted = permits.available_permits().clamp(1, MAX_PULL);
        let started = tokio::time::Instant::now();
        let mut delivered = 0usize;
        let end = tokio::select! {
            end = async {
                let pull = match &mut pulling {
                    Some(pull) => match pull.request(&consumer, wanted).await {
                        Ok(()) => pull,
                        Err(end) => return end,
                    },
                    None => match Pull::start(&consumer, &shared.outlet.js, wanted).await {
                        Ok(pull) => pulling.insert(pull),
                        Err(end) => return end,
                    },
                };
                loop {
                    let message = tokio::select! {
                        next = pull.next() => match next {
                            Ok(message) => message,
                            Err(end) => return end,
                        },
                        // The request may have been lost with the old connection.
                        _ = connections.changed() => return PullEnd::Lost,
                        // A pause lifted by hand: the server would serve this pull only
                        // at its next heartbeat.
                        _ = crate::pool::control::pool_state_changed(&mut states, &pool) => {
                            if let Err(end) = pull.nudge(&consumer).await {
                                return end;
                            }
                            continue;
                        }
                    };
                    delivered += 1;
                    let held = Held {
                        permits: &permits,
                        attempts: &attempts,
                        leadership: leadership.subscribe(),
                        deliveries: &held_deliveries,
                    };
                    start(&live, &pool, message, held, &shutdown, arrived_under).await;
                }
            } => end,
            _ = shutdown.cancelled() => return,
        };
        if end != PullEnd::Done {
            pulling = None;
        }
        match end {
            PullEnd::Done if delivered > 0 || started.elapsed() >= PULL_EXPIRES / 2 => failures = 0,
            PullEnd::Lost | PullEnd::LeaderLost(_) => {
                if let PullEnd::LeaderLost(why) = &end {
                    info!(pool = %pool, reason = %why, "the pool consumer's leader changed; the deliveries held are stale");
                    leadership.send_modify(|epoch| *epoch += 1);
                } else {
                    debug!(pool = %pool, "pull lost; pulling again");
                }
                failures = 0;
                if !shared.health.nats_connected() {
                    // Pulls made now would queue up unsent; one is enough once back.
                    tokio::select! {
                        _ = connections.changed() => {}
                        _ = shutdown.cancelled() => return,
                    }
                }
            }
            PullEnd::ConsumerGone(why) => {
                warn!(pool = %pool, reason = %why, "the pool's consumer did not answer; recreating it if it is gone");
                // No leader answered: whatever comes back restores what was committed.
                leadership.send_modify(|epoch| *epoch += 1);
                shared.health.set_pool_down(&pool, true);
                match crate::pool::consumers::recreate_pool_consumer(
                    &shared.outlet.js,
                    &shared.settings,
                    &pool,
                )
                .await
                {
                    Ok(crate::pool::consumers::Recreated::Made(made)) => {
                        consumer = made;
                        shared.outlet.metrics.consumer_recreated(&pool);
                        shared.health.set_pool_down(&pool, false);
                        info!(pool = %pool, "recreated the pool's consumer");
                        failures = 0;
                    }
                    Ok(crate::pool::consumers::Recreated::Found(found)) => {
                        consumer = found;
                        shared.health.set_pool_down(&pool, false);
                        info!(pool = %pool, "the pool's consumer answers again; nothing recreated");
                        failures = 0;
                    }
                    Err(e)
                        if live.is_retained(&pool)
                            && e.refusal().is_some_and(LayoutRefusal::is_removal) =>
                    {
                        info!(pool = %pool, reason = %e, "the pool is removed and no longer in the document; no longer serving it");
                        shared.health.set_pool_down(&pool, false);
                        live.forget(&pool);
                        return;
                    }
                    Err(e) => {
                        warn!(pool = %pool, error = %e, "cannot recreate the pool's consumer");
                        failures += 1;
                    }
                }
            }
            PullEnd::Done => failures += 1,
            PullEnd::Failed(why) => {
                debug!(pool = %pool, reason = %why, "pull failed");
                failures += 1;
            }
        }
        if failures > 0 && !PULL_BACKOFF.wait(failures, &shutdown).await {
            return;
        }
    }
}

/// What a pull loop holds its deliveries with: the local permits, the task tracker
/// their handlers run in, and the pool's leadership epoch.
struct Held<'a> {
    permits: &'a Arc<Semaphore>,
    attempts: &'a TaskTracker,
    leadership: liveness::Leadership,
    deliveries: &'a Arc<liveness::HeldDeliveries>,
}

/// Starts one delivered message: its progress task at once, its handler once a local
/// permit is free. Returns when the handler holds its permit (or at shutdown), so the
/// pull loop never has more messages waiting than the one in hand.
async fn start(
    live: &Arc<Revisions>,
    pool: &Arc<str>,
    message: async_nats::jetstream::Message,
    held: Held<'_>,
    shutdown: &CancellationToken,
    arrived_under: Duration,
) {
    let Held {
        permits,
        attempts,
        leadership,
        deliveries,
    } = held;
    let deliveries = deliveries.clone();
    let (started, has_started) = tokio::sync::oneshot::channel();
    let live = live.clone();
    let pool = pool.clone();
    let permits = permits.clone();
    let stop = shutdown.clone();
    attempts.spawn(async move {
        let known = live.load().pacing.known();
        let pacing = known.borrow().pacing(arrived_under);
        let liveness = Arc::new(
            Liveness::paced(arrived_under, pacing, tokio::time::Instant::now()).under(leadership),
        );
        if let Ok(info) = message.info()
            && deliveries.hold(info.stream_sequence, &liveness)
        {
            info!(pool = %pool, sequence = info.stream_sequence, "delivered again while this instance holds it; the earlier delivery is stale");
        }
        let work = async {
            let permit = tokio::select! {
                permit = permits.acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
                // Unacked, the message goes back to the server after ack_wait.
                _ = stop.cancelled() => return,
            };
            let _ = started.send(());
            // Handled to its end under the revision running now.
            let shared = live.load();
            let _in_flight = shared.gauges.pool(&pool).map(|g| g.start());
            Box::pin(handle::handle(&shared, &pool, &message, &liveness)).await;
            drop(permit);
        };
        while_keeping(work, liveness.keep(&message, Some(known))).await;
    });
    tokio::select! {
        _ = has_started => {}
        _ = shutdown.cancelled() => {}
    }
}
