//! The effects: pulls each pool's messages, runs the pure plan and verdict, performs
//! attempts with the worker, parks retries, publishes replies and dead letters, and acks.
//!
//! A message is always answered, dead-lettered, parked, or left unacked for
//! redelivery; it is never acked before what it produced is stored.

mod attempt_claim;
mod conversation;
mod dead_letter;
mod delivery;
mod ending;
mod handle;
mod liveness;
mod migrate;
mod pacing;
mod parked;
mod progress;
mod publish;
mod pull;
mod replay;
mod revisions;
mod settle;
mod start;
mod stored_reply;
#[cfg(test)]
mod tests;

pub use crate::hooks::test_hook;
pub use ending::Settled;
pub use pacing::AckWaitPacing;
pub use publish::Outlet;
pub use replay::{Replay, ReplayError};
pub(crate) use start::retry_until_done;
pub use start::{StartError, check_server};

use progress::Progress;

use std::sync::Arc;
use std::time::Duration;

use async_nats::connection;
use async_nats::jetstream::consumer::PullConsumer;
use futures::StreamExt as _;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};
use webproxy_config::human;
use webproxy_config::secrets::Secrets;
use webproxy_config::settings::{Settings, jetstream_request_timeout};
use webproxy_worker::Worker;

use crate::Instruments;
use crate::backoff::{Backoff, PULL_BACKOFF};
use crate::clock;
use crate::observability::bucket_use;
use crate::observability::gauges::GAUGE_REFRESH;
use crate::observability::gauges::Gauges;
use crate::observability::health::Health;
use crate::provision::{LayoutRefusal, PoolConsumers};
use crate::state::Bucket;
use liveness::Liveness;
use pull::{PULL_EXPIRES, Pull, PullEnd};
use revisions::{Pools, Revisions};
use start::Provisioned;

/// The most messages one pull asks for.
const MAX_PULL: usize = 256;

/// Connects to NATS, keeping `health` in step with the connection state. Returns at
/// once: an unreachable server is retried in the background (`client.flush()` waits
/// for it); an error is one that retrying cannot mend (an address that does not parse,
/// an unreadable credentials file).
///
/// `options` carry the process's authentication and TLS (the binary builds them from
/// `[nats]`); `urls` are the servers; `ack_wait` sets the ping interval.
pub async fn connect(
    options: async_nats::ConnectOptions,
    urls: Vec<String>,
    ack_wait: Duration,
    instruments: &Instruments,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    let health = &instruments.health;
    let events = health.clone();
    let client = options
        .name("webproxy")
        // The one retry of connecting: the first connection too is made in the
        // background, with `reconnect_delay`; errors returned here are permanent.
        .retry_on_initial_connect()
        // A half-open connection is noticed within a few pings, well inside ack_wait.
        .ping_interval(ping_interval(ack_wait))
        // Back within about a second of the server, not the client's default of 4 s.
        .reconnect_delay_callback(reconnect_delay)
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
        .connect(urls)
        .await?;
    health.set_nats_connected(client.connection_state() == connection::State::Connected);
    Ok(client)
}

/// How often the connection is pinged: a fifth of `ack_wait`, at most 10 s.
fn ping_interval(ack_wait: Duration) -> Duration {
    (ack_wait / 5).clamp(Duration::from_millis(100), Duration::from_secs(10))
}

/// Connecting, the first time and after a loss (`retry_on_initial_connect`: the
/// client's own loop is the only one): 100 ms more per attempt, at most 1 s, forever.
const RECONNECT_BACKOFF: Backoff =
    Backoff::linear(Duration::from_millis(100), Duration::from_secs(1));

/// The wait before reconnect attempt `attempts`: growing to about a second, no more.
fn reconnect_delay(attempts: usize) -> Duration {
    let attempts = u32::try_from(attempts).unwrap_or(u32::MAX);
    RECONNECT_BACKOFF
        .after(attempts)
        .unwrap_or(Duration::from_secs(1))
}

/// Everything a message handler needs, shared by all of them: one revision of the
/// cluster part, swapped whole by [`revisions::Revisions`].
#[derive(Clone)]
struct Revision {
    settings: Arc<Settings>,
    health: Arc<Health>,
    gauges: Arc<Gauges>,
    outlet: Outlet,
    worker: Worker,
    /// Injected credentials, per rule.
    secrets: Arc<Secrets>,
    /// Pauses and rate limits: the same for every revision.
    pool_control: Arc<crate::pool::control::PoolControl>,
    /// The `ack_wait` progress acks are paced from: the same for every revision.
    pacing: Arc<pacing::Pacing>,
}

/// Consumes every pool of this instance until told to stop.
pub struct Dispatcher {
    live: Arc<Revisions>,
    /// The provisioned pools, which [`Dispatcher::run`] consumes.
    pools: Vec<PoolConsumers>,
    /// The state buckets whose use [`Dispatcher::run`] exports and watches.
    buckets: Vec<Bucket>,
}

impl Dispatcher {
    /// A dispatcher for what `provisioned` made, publishing within `max_payload`.
    fn new(
        settings: Arc<Settings>,
        client: async_nats::Client,
        worker: Worker,
        max_payload: usize,
        instruments: Instruments,
        secrets: Arc<Secrets>,
        provisioned: Provisioned,
    ) -> Dispatcher {
        let mut outlet = Outlet::new(
            client,
            settings.subjects.clone(),
            max_payload,
            instruments.metrics,
            secrets.redactor().clone(),
            Progress::new(provisioned.progress, instruments.health.clone()),
        );
        outlet
            .js
            .set_timeout(jetstream_request_timeout(settings.cluster.ack_wait));
        let pool_control = Arc::new(crate::pool::control::PoolControl::new(
            outlet.js.clone(),
            outlet.metrics.clone(),
            instruments.health.clone(),
            &settings,
        ));
        Dispatcher {
            live: Arc::new(Revisions::new(Revision {
                pool_control,
                pacing: Arc::new(pacing::Pacing::new(settings.cluster.ack_wait)),
                gauges: instruments.gauges,
                outlet,
                settings,
                worker,
                health: instruments.health,
                secrets,
            })),
            pools: provisioned.pools,
            buckets: bucket_use::SERVED.to_vec(),
        }
    }

    /// Also exports the use of `bucket`, and keeps the instance not ready while it is
    /// nearly full: for the buckets only the binary knows it uses (the configuration
    /// bucket, in kv mode).
    pub fn gauge_bucket(&mut self, bucket: Bucket) {
        if !self.buckets.contains(&bucket) {
            self.buckets.push(bucket);
        }
    }

    /// How the binary hands this dispatcher a new revision of the cluster document
    /// (its number, the settings `Settings::new` compiled, the secrets its rules
    /// inject): the next message is handled under it, and the pools follow it while
    /// [`Dispatcher::run`] runs (new pools provisioned and served, changed limits
    /// written to the consumers and the local permits, dropped pools still served
    /// until `pools remove`). An error refuses the revision, which this instance
    /// cannot run; the running one stays.
    pub fn reconfigure(
        &self,
    ) -> impl Fn(u64, Arc<Settings>, Arc<Secrets>) -> Result<(), StartError> + Send + Sync + 'static
    {
        let live = self.live.clone();
        move |revision, settings, secrets| {
            live.apply(revision, Arc::unwrap_or_clone(settings), secrets)
        }
    }

    /// The longest `ack_wait` this instance's progress acks are paced from now, and
    /// its changes: what its heartbeat reports, so that the pool consumers' owner
    /// lowers `ack_wait` only once every live instance paces from the lower value.
    pub fn ack_wait_pacing(&self) -> AckWaitPacing {
        AckWaitPacing::new(self.live.load().pacing.known())
    }

    /// Runs the pool loops until `shutdown` is cancelled, then waits up to `grace` for
    /// the attempts in flight. Attempts still running at the deadline are left unacked,
    /// so the server redelivers them elsewhere.
    pub async fn run(self, shutdown: CancellationToken, grace: Duration) {
        let attempts = TaskTracker::new();
        let health = self.live.load().health.clone();
        let owner =
            crate::pool::owner::own_pool_consumers(self.live.pool_tasks(), shutdown.clone());
        let running = self.live.load();
        let states = running
            .pool_control
            .follow_states(&running.settings, shutdown.clone());
        // One reading of the server's clock before the first message is judged, so a
        // pod whose clock is off judges none by it; the gauges' refresh reads it after.
        if let Some(first) = self.pools.first() {
            match timed_info(&running.outlet.js, &first.work).await {
                Ok(info) => running.pacing.server_has(&first.pool, info.config.ack_wait),
                Err(e) => {
                    debug!(pool = first.pool, error = %e, "cannot read the server's clock at start")
                }
            }
        }
        let served = bucket_use::Served {
            metrics: running.outlet.metrics.clone(),
            health: health.clone(),
        };
        let bucket_use = bucket_use::follow_bucket_use(
            running.outlet.js.clone(),
            &running.settings.subjects,
            &running.settings.streams,
            &self.buckets,
            &served,
            shutdown.clone(),
        );
        let mut pools = Pools::new(self.live, attempts.clone(), shutdown.clone());
        for consumers in self.pools {
            pools.serve(consumers);
        }
        health.set_provisioned();
        // Until the signal the pools follow the revisions; then the pool loops end.
        tokio::join!(pools.follow(), owner, states, bucket_use, async {
            shutdown.cancelled().await;
            health.set_draining();
        });
        attempts.close();
        let in_flight = attempts.len();
        info!(in_flight, grace = %human(grace), "draining");
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

/// Reads a pool's waiting and parked counts and its limit from its consumers on a fixed
/// interval.
async fn refresh_gauges(
    shared: Arc<Revision>,
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
        match (
            timed_info(&shared.outlet.js, &work).await,
            parked.get_info().await.map_err(|e| e.to_string()),
        ) {
            (Ok(work), Ok(parked)) => {
                shared.pacing.server_has(&pool, work.config.ack_wait);
                gauge.set_queued(
                    work.num_pending,
                    parked.num_pending + parked.num_ack_pending as u64,
                );
                shared
                    .outlet
                    .metrics
                    .set_pool_paused(&pool, shared.pool_control.is_paused(&pool));
                if let Some(config) = shared.settings.cluster.pools.get(&pool) {
                    shared.outlet.metrics.set_pool_effective_limit(
                        &pool,
                        shared.pool_control.effective_limit(&pool, config),
                    );
                }
                // Negative means unlimited, which webproxy never provisions.
                if let Ok(limit) = u64::try_from(work.config.max_ack_pending) {
                    gauge.set_max_in_flight(limit);
                }
            }
            (Err(e), _) | (_, Err(e)) => debug!(pool, error = %e, "cannot refresh pool gauges"),
        }
    }
}

/// A consumer's info, as `get_info` reads it, and the server's time in it (`ts`) as a
/// reading of this pod's clock skew (`clock::observe`): the gauges' own round trip,
/// with none added.
async fn timed_info(
    js: &async_nats::jetstream::Context,
    consumer: &PullConsumer,
) -> Result<async_nats::jetstream::consumer::Info, String> {
    use async_nats::jetstream::response::Response;
    let cached = consumer.cached_info();
    let subject = format!("CONSUMER.INFO.{}.{}", cached.stream_name, cached.name);
    let sent = clock::local();
    let response: Response<serde_json::Value> = js
        .request(subject, &serde_json::json!({}))
        .await
        .map_err(|e| e.to_string())?;
    let received = clock::local();
    let info = match response {
        Response::Err { error } => return Err(error.to_string()),
        Response::Ok(info) => info,
    };
    let server = info
        .get("ts")
        .and_then(serde_json::Value::as_str)
        .and_then(|ts| {
            time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339).ok()
        });
    if let Some(server) = server {
        clock::observe(clock::Sample {
            sent_us: clock::unix_us(sent),
            received_us: clock::unix_us(received),
            server_us: clock::unix_us(server.into()),
        });
    }
    serde_json::from_value(info).map_err(|e| e.to_string())
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
/// A pull lost in an outage is noticed by its missing heartbeats, and every pull is
/// made again the moment the connection is back; a missing consumer is recreated (the
/// pool is not ready meanwhile); failures and quick empty pulls back off.
async fn pull_loop(
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

/// Runs `work` to its end while `keeper` runs beside it (until the keeper ends).
async fn while_keeping<T>(work: impl Future<Output = T>, keeper: impl Future<Output = ()>) -> T {
    tokio::pin!(work);
    tokio::pin!(keeper);
    let mut keeping = true;
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = &mut keeper, if keeping => keeping = false,
        }
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn reconnecting_waits_100_ms_more_per_attempt_up_to_a_second() {
        assert_eq!(reconnect_delay(0), ms(0));
        assert_eq!(reconnect_delay(1), ms(100));
        assert_eq!(reconnect_delay(5), ms(500));
        assert_eq!(reconnect_delay(10), ms(1000));
        assert_eq!(reconnect_delay(11), ms(1000));
        assert_eq!(reconnect_delay(usize::MAX), ms(1000));
    }
}
