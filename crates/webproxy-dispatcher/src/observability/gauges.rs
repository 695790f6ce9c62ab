//! Per-pool gauges kept in memory, for the metrics endpoint to export: attempts in
//! flight on this instance (live), and the pool's waiting and parked messages and its
//! concurrency limit across the cluster (refreshed from consumer info on a fixed
//! interval, whatever the number of readers).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

/// How often the cluster-wide gauges of a pool are read from its consumers.
pub(crate) const GAUGE_REFRESH: Duration = Duration::from_secs(5);

/// One pool's gauges.
#[derive(Debug, Default)]
pub(crate) struct PoolGauge {
    in_flight: AtomicU64,
    waiting: AtomicU64,
    parked: AtomicU64,
    max_in_flight: AtomicU64,
}

impl PoolGauge {
    /// Attempts and other handling running on this instance now.
    pub(crate) fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Messages waiting in the pool's queue, cluster-wide, as last refreshed.
    pub(crate) fn waiting(&self) -> u64 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Retries parked on the pool's retry subject, cluster-wide, as last refreshed.
    pub(crate) fn parked(&self) -> u64 {
        self.parked.load(Ordering::Relaxed)
    }

    /// The pool's limit on messages in flight across every instance, as last read.
    pub(crate) fn max_in_flight(&self) -> u64 {
        self.max_in_flight.load(Ordering::Relaxed)
    }

    /// Counts one message as in flight until the guard is dropped.
    pub(crate) fn start(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    pub(crate) fn set_queued(&self, waiting: u64, parked: u64) {
        self.waiting.store(waiting, Ordering::Relaxed);
        self.parked.store(parked, Ordering::Relaxed);
    }

    pub(crate) fn set_max_in_flight(&self, limit: u64) {
        self.max_in_flight.store(limit, Ordering::Relaxed);
    }
}

/// Keeps a message counted in flight while it lives.
#[derive(Debug)]
pub(crate) struct InFlight(Arc<PoolGauge>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The gauges of every pool of this instance. The pools are known once the cluster
/// part is (from the file, or from the bucket after connecting), so the dispatcher
/// adds them; the metrics endpoint may already be serving by then.
#[derive(Debug, Default)]
pub(crate) struct Gauges {
    pools: RwLock<BTreeMap<String, Arc<PoolGauge>>>,
}

impl Gauges {
    /// Adds a gauge for every one of `pools` that has none.
    pub(crate) fn add<'a>(&self, pools: impl IntoIterator<Item = &'a String>) {
        let mut gauges = self.pools.write().unwrap_or_else(PoisonError::into_inner);
        for pool in pools {
            gauges.entry(pool.clone()).or_default();
        }
    }

    pub(crate) fn pool(&self, name: &str) -> Option<Arc<PoolGauge>> {
        let gauges = self.pools.read().unwrap_or_else(PoisonError::into_inner);
        gauges.get(name).cloned()
    }

    /// Every pool's gauge, as now.
    pub(crate) fn all(&self) -> Vec<(String, Arc<PoolGauge>)> {
        let gauges = self.pools.read().unwrap_or_else(PoisonError::into_inner);
        gauges.iter().map(|(n, g)| (n.clone(), g.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_flight_counts_while_the_guard_lives() {
        let gauges = Gauges::default();
        gauges.add(&["default".to_string()]);
        let pool = gauges.pool("default").expect("pool");
        let first = pool.start();
        let second = pool.start();
        assert_eq!(pool.in_flight(), 2);
        drop(first);
        assert_eq!(pool.in_flight(), 1);
        drop(second);
        assert_eq!(pool.in_flight(), 0);
        pool.set_queued(5, 2);
        assert_eq!((pool.waiting(), pool.parked()), (5, 2));
        pool.set_max_in_flight(16);
        assert_eq!(pool.max_in_flight(), 16);
        assert!(gauges.pool("other").is_none());
    }
}
