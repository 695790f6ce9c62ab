//! This instance's attempts per pool, per second: what the breaker and the adaptive
//! limit count, reported to the cluster by [`super::oversight::report`].

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};
use std::time::UNIX_EPOCH;

use webproxy_config::breaker::default_statuses;
use webproxy_config::settings::PoolConfig;
use webproxy_worker::AttemptOutcome;

use super::breaker::{Report, is_failure};
use webproxy_jetstream::clock;

/// Unix seconds now.
pub(crate) fn now_s() -> u64 {
    clock::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Whether `pool`'s attempts are counted at all.
pub(crate) fn counted(config: &PoolConfig) -> bool {
    config.breaker.is_some() || config.adaptive
}

/// This instance's attempts per pool, per second, for its reports.
#[derive(Default)]
pub(crate) struct AttemptCounts {
    pools: Mutex<BTreeMap<String, Report>>,
}

impl AttemptCounts {
    /// Counts an attempt of `pool` that connected to the upstream, when the pool has a
    /// breaker or an adaptive limit; whether it was a failure.
    pub(crate) fn attempted(
        &self,
        pool: &str,
        config: &PoolConfig,
        outcome: &AttemptOutcome,
        latency_ms: u64,
    ) -> bool {
        if !counted(config) {
            return false;
        }
        let failed = match &config.breaker {
            Some(breaker) => is_failure(outcome, &breaker.statuses),
            None => is_failure(outcome, &default_statuses()),
        };
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        pools
            .entry(pool.to_string())
            .or_default()
            .record(now_s(), failed, latency_ms);
        failed
    }

    /// `pool`'s report, its seconds before `oldest` dropped; none when it is empty.
    pub(crate) fn report(&self, pool: &str, oldest: u64) -> Option<Report> {
        let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        let report = pools.get_mut(pool)?;
        if report.keep_from(oldest) {
            Some(report.clone())
        } else {
            pools.remove(pool);
            None
        }
    }
}
