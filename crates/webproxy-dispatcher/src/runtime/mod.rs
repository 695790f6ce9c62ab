//! The effects: pulls each pool's messages, runs the decisions of `decision`, performs
//! attempts with the worker, parks retries, publishes replies and dead letters, and acks.
//!
//! A message is always answered, dead-lettered, parked, or left unacked for
//! redelivery; it is never acked before what it produced is stored.

mod conversation;
mod delivery;
mod handle;
mod hooks;
mod migrate;
mod parked;
mod progress;
mod publish;
mod replay;
mod settle;
#[cfg(test)]
mod tests;

pub use delivery::{Delivery, DeliveryInfo};
pub use handle::end_unattempted;
pub use migrate::MigrationError;
pub use progress::{Progress, ProgressError, Record};
pub use publish::{Outlet, PublishFailure};
pub use replay::{ReplayError, replay};
pub use settle::Settled;

use std::sync::Arc;
use std::time::Duration;

use async_nats::connection;
use async_nats::jetstream::consumer::PullConsumer;
use futures::StreamExt as _;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};
use webproxy_worker::Worker;

use crate::Instruments;
use crate::config::Settings;
use crate::gauges::Gauges;
use crate::health::Health;
use crate::provision::PoolConsumers;
use crate::secrets::Secrets;

/// The most messages one pull asks for.
const MAX_PULL: usize = 256;
/// How long one pull request waits for messages on the server.
const PULL_EXPIRES: Duration = Duration::from_secs(5);

/// Connects to NATS, keeping `health` in step with the connection state.
pub async fn connect(
    settings: &Settings,
    health: Arc<Health>,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    let events = health.clone();
    let client = crate::nats_auth::connect_options(&settings.config.nats)
        .await?
        .name("webproxy")
        .retry_on_initial_connect()
        .event_callback(move |event| {
            let events = events.clone();
            async move {
                match event {
                    async_nats::Event::Connected => events.set_nats_connected(true),
                    async_nats::Event::Disconnected => events.set_nats_connected(false),
                    other => debug!(event = %other, "nats event"),
                }
            }
        })
        .connect(settings.config.nats.urls())
        .await?;
    health.set_nats_connected(client.connection_state() == connection::State::Connected);
    Ok(client)
}

/// Everything a message handler needs, shared by all of them.
struct Shared {
    settings: Arc<Settings>,
    health: Arc<Health>,
    gauges: Arc<Gauges>,
    outlet: Outlet,
    worker: Worker,
    /// Injected credentials, per rule.
    secrets: Arc<Secrets>,
}

/// Consumes every pool of this instance until told to stop.
pub struct Dispatcher {
    shared: Arc<Shared>,
}

impl Dispatcher {
    pub fn new(
        settings: Arc<Settings>,
        client: async_nats::Client,
        worker: Worker,
        max_payload: usize,
        instruments: Instruments,
        secrets: Arc<Secrets>,
        progress: Progress,
    ) -> Dispatcher {
        Dispatcher {
            shared: Arc::new(Shared {
                gauges: instruments.gauges,
                outlet: Outlet::new(
                    client,
                    settings.subjects.clone(),
                    max_payload,
                    instruments.metrics,
                    secrets.redactor().clone(),
                    progress,
                ),
                settings,
                worker,
                health: instruments.health,
                secrets,
            }),
        }
    }

    /// Runs the pool loops until `shutdown` is cancelled, then waits up to `grace` for
    /// the attempts in flight. Attempts still running at the deadline are left unacked,
    /// so the server redelivers them elsewhere.
    pub async fn run(
        &self,
        consumers: Vec<PoolConsumers>,
        shutdown: CancellationToken,
        grace: Duration,
    ) {
        let attempts = TaskTracker::new();
        let mut pulls = Vec::new();
        for PoolConsumers { pool, work, parked } in consumers {
            let shared = self.shared.clone();
            let limit = self
                .shared
                .settings
                .pools
                .get(&pool)
                .map_or(1, |p| p.max_in_flight);
            pulls.push(tokio::spawn(refresh_gauges(
                shared.clone(),
                pool.clone(),
                work.clone(),
                parked.clone(),
                shutdown.clone(),
            )));
            pulls.push(tokio::spawn(parked::park_loop(
                shared.clone(),
                Arc::from(pool.as_str()),
                parked,
                attempts.clone(),
                shutdown.clone(),
            )));
            let permits = Arc::new(Semaphore::new(
                usize::try_from(limit)
                    .unwrap_or(usize::MAX)
                    .min(Semaphore::MAX_PERMITS),
            ));
            pulls.push(tokio::spawn(pull_loop(
                shared,
                Arc::from(pool.as_str()),
                work,
                permits,
                attempts.clone(),
                shutdown.clone(),
            )));
        }
        self.shared.health.set_provisioned();
        shutdown.cancelled().await;
        self.shared.health.set_draining();
        for pull in pulls {
            let _ = pull.await;
        }
        attempts.close();
        let in_flight = attempts.len();
        info!(in_flight, grace = ?grace, "draining");
        // Handlers hold their messages with progress acks while they retry a publish;
        // at the deadline they are dropped unacked and the server redelivers them.
        if tokio::time::timeout(grace, attempts.wait()).await.is_err() {
            warn!(
                left = attempts.len(),
                "shutdown grace ran out; leaving the remaining attempts unacked for redelivery"
            );
        }
    }
}

/// How often the cluster-wide gauges of a pool are read from its consumers.
const GAUGE_REFRESH: Duration = Duration::from_secs(5);

/// Reads a pool's waiting and parked counts from its consumers on a fixed interval.
async fn refresh_gauges(
    shared: Arc<Shared>,
    pool: String,
    work: PullConsumer,
    parked: PullConsumer,
    shutdown: CancellationToken,
) {
    let Some(gauge) = shared.gauges.pool(&pool) else {
        return;
    };
    let mut interval = tokio::time::interval(GAUGE_REFRESH);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        match (work.get_info().await, parked.get_info().await) {
            (Ok(work), Ok(parked)) => gauge.set_queued(
                work.num_pending,
                parked.num_pending + parked.num_ack_pending as u64,
            ),
            (Err(e), _) | (_, Err(e)) => debug!(pool, error = %e, "cannot refresh pool gauges"),
        }
    }
}

/// Waits a backoff that grows with `failures`; false when `shutdown` comes first.
async fn back_off(failures: u32, shutdown: &CancellationToken) -> bool {
    let backoff = Duration::from_millis(100 * u64::from(failures.min(20)));
    tokio::select! {
        _ = tokio::time::sleep(backoff) => true,
        _ = shutdown.cancelled() => false,
    }
}

/// The stream's next item, or `None` once `shutdown` is cancelled; an ended stream is
/// `Some(None)`.
async fn next_or_stop<S: futures::Stream + Unpin>(
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
async fn pull_loop(
    shared: Arc<Shared>,
    pool: Arc<str>,
    consumer: PullConsumer,
    permits: Arc<Semaphore>,
    attempts: TaskTracker,
    shutdown: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        // As many as can start now, and never fewer than one: a pull already waiting
        // at the server lets the next message go out the moment a slot frees, instead
        // of a round trip later. It cannot overfill this instance: the server holds
        // deliveries to max_ack_pending, which is the number of local permits, so a
        // message delivered while all are taken waits only for the permit that its
        // predecessor's ack is releasing.
        let wanted = permits.available_permits().clamp(1, MAX_PULL);
        let request = consumer
            .batch()
            .max_messages(wanted)
            .expires(PULL_EXPIRES)
            .messages();
        let mut batch = tokio::select! {
            batch = request => match batch {
                Ok(b) => { failures = 0; b }
                Err(e) => {
                    failures += 1;
                    warn!(pool = %pool, error = %e, "pull request failed; retrying");
                    if back_off(failures, &shutdown).await { continue } else { return }
                }
            },
            _ = shutdown.cancelled() => return,
        };
        loop {
            let Some(next) = next_or_stop(&mut batch, &shutdown).await else {
                return;
            };
            let message = match next {
                Some(Ok(message)) => message,
                Some(Err(e)) => {
                    debug!(pool = %pool, error = %e, "pull ended");
                    break;
                }
                None => break,
            };
            let permit = tokio::select! {
                permit = permits.clone().acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => return,
                },
                // Unacked, the message goes back to the server after ack_wait.
                _ = shutdown.cancelled() => return,
            };
            let shared = shared.clone();
            let pool = pool.clone();
            attempts.spawn(async move {
                let _in_flight = shared.gauges.pool(&pool).map(|g| g.start());
                Box::pin(handle::handle(&shared, &pool, message)).await;
                drop(permit);
            });
        }
    }
}
