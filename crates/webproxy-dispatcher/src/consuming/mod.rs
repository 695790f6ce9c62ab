//! Consuming: connects, provisions, and pulls each pool's messages into the
//! conversation path (`crate::conversation`), under the revision running now; follows
//! new revisions and serves the parked retries' consumer.

mod connect;
mod gauges;
mod migrate;
mod parked;
mod pull;
mod pull_loop;
mod revisions;
pub(crate) mod start;

pub use connect::connect;
pub use start::{StartError, check_server};

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};
use webproxy_config::human;
use webproxy_config::secrets::Secrets;
use webproxy_config::settings::{Settings, jetstream_request_timeout};
use webproxy_worker::Worker;

use crate::Instruments;
use crate::conversation::cancels::Cancels;
use crate::conversation::pacing::AckWaitPacing;
use crate::conversation::progress::Progress;
use crate::conversation::publish::Outlet;
use crate::conversation::{Revision, pacing};
use crate::observability::bucket_use;
use crate::pool::{PoolRevision, PoolTasks};
use gauges::timed_info;
use revisions::{Pools, keep_dropped_pools};
use start::{Provisioned, worker_for};
use webproxy_jetstream::provision::PoolConsumers;
use webproxy_jetstream::state::Bucket;

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
        outlet.cancels = Arc::new(Cancels::new(provisioned.cancels));
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
        let body_get = crate::body_get::serve(
            running.outlet.client.clone(),
            running.settings.subjects.clone(),
            shutdown.clone(),
        );
        let body_put = crate::body_put::serve(self.live.changes(), shutdown.clone());
        let cancels = running.outlet.cancels.clone();
        let follow_cancels = cancels.follow(shutdown.clone());
        let answer_cancels = crate::cancel::serve(
            crate::cancel::Answerer {
                outlet: running.outlet.clone(),
                cancels: cancels.clone(),
            },
            shutdown.clone(),
        );
        let mut pools = Pools::new(self.live, attempts.clone(), shutdown.clone());
        for consumers in self.pools {
            pools.serve(consumers);
        }
        health.set_provisioned();
        // Until the signal the pools follow the revisions; then the pool loops end.
        tokio::join!(
            pools.follow(),
            owner,
            states,
            bucket_use,
            body_get,
            body_put,
            follow_cancels,
            answer_cancels,
            async {
                shutdown.cancelled().await;
                health.set_draining();
            }
        );
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

/// The revision every new message is handled under, and the pools the running document
/// no longer names but this instance still serves (until `pools remove`).
pub(crate) struct Revisions {
    current: watch::Sender<Arc<Revision>>,
    /// The same revisions as pool control's tasks read them.
    for_pools: watch::Sender<PoolRevision>,
    retained: Mutex<BTreeSet<String>>,
}

fn pool_revision(shared: &Revision) -> PoolRevision {
    PoolRevision {
        settings: shared.settings.clone(),
        js: shared.outlet.js.clone(),
    }
}

impl Revisions {
    pub(crate) fn new(shared: Revision) -> Revisions {
        Revisions {
            for_pools: watch::Sender::new(pool_revision(&shared)),
            current: watch::Sender::new(Arc::new(shared)),
            retained: Mutex::new(BTreeSet::new()),
        }
    }

    /// What pool control's cluster tasks are given: they follow every revision
    /// swapped in here.
    pub(crate) fn pool_tasks(&self) -> PoolTasks {
        let shared = self.load();
        PoolTasks {
            control: shared.pool_control.clone(),
            revisions: self.for_pools.subscribe(),
        }
    }

    /// Swaps in `next` for every message handled from now on, and for pool control.
    fn swap_in(&self, next: Revision) {
        self.current.send_replace(Arc::new(next));
        self.pools_follow();
    }

    /// Gives pool control the revision running now. Read under `for_pools`' lock after
    /// each change of `current`, so that of two changes at once the last write is of
    /// the latest revision.
    fn pools_follow(&self) {
        self.for_pools
            .send_modify(|pools| *pools = pool_revision(&self.current.borrow()));
    }

    /// The revision a message starting now is handled under.
    pub(crate) fn load(&self) -> Arc<Revision> {
        self.current.borrow().clone()
    }

    pub(crate) fn changes(&self) -> watch::Receiver<Arc<Revision>> {
        self.current.subscribe()
    }

    /// Whether `pool` is served only because it was served before the running
    /// document dropped it.
    pub(crate) fn is_retained(&self, pool: &str) -> bool {
        self.retained
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(pool)
    }

    /// A retained pool was removed (`pools remove`): it is no longer served, nor kept
    /// in the settings of later revisions.
    pub(crate) fn forget(&self, pool: &str) {
        self.retained
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(pool);
        self.current.send_modify(|shared| {
            let mut settings = (*shared.settings).clone();
            settings.cluster.pools.remove(pool);
            *shared = Arc::new(Revision {
                settings: Arc::new(settings),
                ..Revision::clone(shared)
            });
        });
        self.pools_follow();
    }

    /// Swaps in `settings` (a validated revision) with its `secrets`: the next message
    /// is handled under it; the pools follow ([`Pools::reconcile`]). Refused, keeping
    /// the running revision, when this instance cannot run it (a response limit above
    /// what the server's `max_payload` allows, no HTTP client).
    pub(crate) fn apply(
        &self,
        revision: u64,
        settings: Settings,
        secrets: Arc<Secrets>,
    ) -> Result<(), StartError> {
        let running = self.load();
        let (settings, retained) = keep_dropped_pools(&running.settings, settings);
        let worker = worker_for(
            &settings.cluster.outbound,
            running.outlet.max_payload,
            &running.outlet.metrics,
        )?;
        let mut outlet = running.outlet.clone();
        outlet
            .js
            .set_timeout(jetstream_request_timeout(settings.cluster.ack_wait));
        if !retained.is_empty() {
            warn!(
                revision,
                pools = %retained.iter().map(String::as_str).collect::<Vec<_>>().join(", "),
                "pools no longer in the document are still served until `webproxy pools remove` deletes them"
            );
        }
        *self.retained.lock().unwrap_or_else(PoisonError::into_inner) = retained;
        outlet.metrics.set_config_revision(revision);
        // Deliveries in flight pace from a shorter ack_wait at once.
        running.pacing.learned(settings.cluster.ack_wait);
        self.swap_in(Revision {
            settings: Arc::new(settings),
            health: running.health.clone(),
            gauges: running.gauges.clone(),
            outlet,
            worker,
            secrets,
            pool_control: running.pool_control.clone(),
            pacing: running.pacing.clone(),
        });
        info!(revision, "running the configuration bucket's revision");
        Ok(())
    }
}
