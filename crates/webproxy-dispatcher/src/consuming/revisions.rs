//! The cluster part changed while the instance runs: a new revision of the document
//! is swapped in whole (a handler keeps the revision it started with), then the pools
//! are brought in line with it: new pools provisioned and served, changed limits
//! written to the pool's consumers and to the local permits.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{error, info, warn};
use webproxy_config::settings::Settings;

use super::gauges::refresh_gauges;
use super::pull_loop::pull_loop;
use super::{Revisions, parked};
use crate::pool::consumers::provision_pool;
use webproxy_jetstream::provision::{PoolConsumers, PoolSpec, update_pool_stream};

/// `next` with the pools that `running` serves and `next` leaves out, which keep being
/// served until `pools remove` deletes them, and their names (pure).
pub(crate) fn keep_dropped_pools(
    running: &Settings,
    mut next: Settings,
) -> (Settings, BTreeSet<String>) {
    let mut dropped = BTreeSet::new();
    for (pool, config) in &running.cluster.pools {
        if !next.cluster.pools.contains_key(pool) {
            next.cluster.pools.insert(pool.clone(), config.clone());
            dropped.insert(pool.clone());
        }
    }
    (next, dropped)
}

/// Local permits for a limit of `limit` messages in flight.
pub(crate) fn permit_count(limit: u64) -> usize {
    usize::try_from(limit)
        .unwrap_or(usize::MAX)
        .min(Semaphore::MAX_PERMITS)
}

/// Resizes `permits` from `from` to `to` messages in flight. Permits held by handlers
/// are taken away as those handlers finish, never from a handler in flight, and
/// nothing waits on a permit only a waiting handler could free.
fn resize(permits: &Arc<Semaphore>, from: u64, to: u64) {
    let (from, to) = (permit_count(from), permit_count(to));
    if to > from {
        permits.add_permits(to - from);
        return;
    }
    let excess = from - to;
    let left = excess - permits.forget_permits(excess);
    let Ok(left) = u32::try_from(left) else {
        return;
    };
    if left > 0 {
        let permits = permits.clone();
        tokio::spawn(async move {
            if let Ok(taken) = permits.acquire_many_owned(left).await {
                taken.forget();
            }
        });
    }
}

/// A pool this instance serves: what was provisioned for it, and its local permits.
struct Served {
    spec: PoolSpec,
    permits: Arc<Semaphore>,
}

/// The pools this instance serves, and the tasks that serve them.
pub(crate) struct Pools {
    live: Arc<Revisions>,
    served: BTreeMap<String, Served>,
    attempts: TaskTracker,
    loops: TaskTracker,
    shutdown: CancellationToken,
}

impl Pools {
    pub(crate) fn new(
        live: Arc<Revisions>,
        attempts: TaskTracker,
        shutdown: CancellationToken,
    ) -> Pools {
        Pools {
            live,
            served: BTreeMap::new(),
            attempts,
            loops: TaskTracker::new(),
            shutdown,
        }
    }

    /// Starts serving a provisioned pool: its gauges, its parked retries and its pull
    /// loop, with as many local permits as its `max_in_flight`.
    pub(crate) fn serve(&mut self, consumers: PoolConsumers) {
        let PoolConsumers { pool, work, parked } = consumers;
        let shared = self.live.load();
        let Some(config) = shared.settings.cluster.pools.get(&pool) else {
            return;
        };
        let spec = PoolSpec::of(&shared.settings, config);
        shared.gauges.add([&pool]);
        // Shown from the start; the refresh then reports the server's value, which the
        // last instance to provision the consumer set.
        if let Some(gauge) = shared.gauges.pool(&pool) {
            gauge.set_max_in_flight(spec.max_in_flight);
        }
        self.loops.spawn(refresh_gauges(
            shared.clone(),
            pool.clone(),
            work.clone(),
            parked.clone(),
            self.shutdown.clone(),
        ));
        self.loops.spawn(parked::park_loop(
            shared.clone(),
            Arc::from(pool.as_str()),
            parked,
            self.attempts.clone(),
            self.shutdown.clone(),
        ));
        let permits = Arc::new(Semaphore::new(permit_count(spec.max_in_flight)));
        let live = self.live.clone();
        let attempts = self.attempts.clone();
        let shutdown = self.shutdown.clone();
        let loop_permits = permits.clone();
        let name = pool.clone();
        self.loops.spawn(async move {
            let ended = tokio::spawn(pull_loop(
                live,
                Arc::from(name.as_str()),
                work,
                loop_permits,
                attempts,
                shutdown.clone(),
            ))
            .await;
            // A pull loop ends only on shutdown, or when a pool the document dropped is
            // removed; any other end (a panic) leaves the pool unserved, which only a
            // restart repairs.
            if let Err(e) = ended
                && !shutdown.is_cancelled()
            {
                error!(pool = name, error = %e, "the pool's pull loop ended; not alive");
                shared.health.set_pull_loop_dead(&name);
            }
        });
        self.served.insert(pool, Served { spec, permits });
    }

    /// Brings the pools in line with the running revision: provisions and serves the
    /// new ones, resizes the local permits of those whose [`PoolSpec`] changed (their
    /// consumers are their owner's to update: `owner`). `false` when some could not
    /// be, to be tried again.
    async fn reconcile(&mut self) -> bool {
        let shared = self.live.load();
        let settings = &shared.settings;
        let js = &shared.outlet.js;
        let mut done = true;
        for (pool, config) in &settings.cluster.pools {
            let wanted = PoolSpec::of(settings, config);
            if let Some(served) = self.served.get_mut(pool) {
                if served.spec != wanted {
                    let changes = wanted.changes_from(&served.spec);
                    if served.spec.max_waiting != wanted.max_waiting
                        && let Err(e) = update_pool_stream(js, settings, pool, config).await
                    {
                        // Nothing of the revision's limits is applied, so the next
                        // try sees the same change.
                        warn!(pool, error = %e, "cannot apply the pool's new limits ({changes}) to its stream; retrying");
                        done = false;
                        continue;
                    }
                    info!(pool, "pool limits applied: {changes}");
                    resize(
                        &served.permits,
                        served.spec.max_in_flight,
                        wanted.max_in_flight,
                    );
                    served.spec = wanted;
                }
                continue;
            }
            match provision_pool(js, settings, pool, config).await {
                Ok(provisioned) => {
                    info!(pool, "new pool provisioned; serving it");
                    self.serve(provisioned);
                }
                Err(e) => {
                    warn!(pool, error = %e, "cannot provision the new pool; retrying");
                    done = false;
                }
            }
        }
        done
    }

    /// Follows the running revision until `shutdown`, then waits for the pool loops
    /// to end.
    pub(crate) async fn follow(mut self) {
        let mut changes = self.live.changes();
        changes.mark_unchanged();
        let mut failures = 0u32;
        loop {
            tokio::select! {
                changed = changes.changed() => if changed.is_err() { break },
                _ = self.shutdown.cancelled() => break,
                _ = webproxy_jetstream::backoff::PULL_BACKOFF.wait(failures, &self.shutdown), if failures > 0 => {}
            }
            changes.mark_unchanged();
            let shutdown = self.shutdown.clone();
            tokio::select! {
                done = self.reconcile() => failures = if done { 0 } else { failures.saturating_add(1) },
                _ = shutdown.cancelled() => break,
            }
        }
        self.shutdown.cancelled().await;
        self.loops.close();
        self.loops.wait().await;
    }
}

#[cfg(test)]
mod tests {
    use webproxy_config::testing::settings_from;

    use super::*;

    #[test]
    fn a_pool_the_document_drops_is_kept_with_its_last_limits() {
        let running =
            settings_from("[pools.slow]\nmax_in_flight = 3\n[pools.fast]\nmax_in_flight = 9\n")
                .expect("running");
        let next = settings_from("[pools.fast]\nmax_in_flight = 20\n").expect("next");
        let (kept, dropped) = keep_dropped_pools(&running, next);
        assert_eq!(dropped, BTreeSet::from(["slow".to_string()]));
        assert_eq!(kept.cluster.pools["slow"].max_in_flight, 3);
        assert_eq!(kept.cluster.pools["fast"].max_in_flight, 20);
        let (_, none) = keep_dropped_pools(&kept, kept.clone());
        assert!(none.is_empty());
    }

    #[tokio::test]
    async fn permits_grow_at_once_and_shrink_as_handlers_finish() {
        let permits = Arc::new(Semaphore::new(4));
        resize(&permits, 4, 6);
        assert_eq!(permits.available_permits(), 6);
        let held = permits.clone().acquire_many_owned(5).await.expect("held");
        // One free permit is taken at once; four more as the holders finish.
        resize(&permits, 6, 1);
        assert_eq!(permits.available_permits(), 0);
        drop(held);
        available_within_5s(&permits, 1, "shrunk to one permit").await;
        // A raise while a shrink waits gives the shrink its permits first.
        let held = permits.clone().acquire_owned().await.expect("one");
        resize(&permits, 1, 0);
        resize(&permits, 0, 2);
        drop(held);
        available_within_5s(&permits, 2, "two permits").await;
    }

    /// Waits, at most 5 s, until `permits` has `n` available; the resizes give their
    /// permits back as the holders finish, not at once.
    async fn available_within_5s(permits: &Semaphore, n: usize, what: &str) {
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while permits.available_permits() != n {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect(what);
    }
}
