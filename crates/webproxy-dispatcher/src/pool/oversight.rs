//! The circuit breaker and the adaptive limit, cluster-wide, as effects. Every
//! instance counts its attempts per pool (`super::counts`) and reports them each second
//! under `stats.<pool>.<instance>` in `<PREFIX>_INSTANCES` ([`report`]); the holder of
//! the lease of the pool consumers' settings sums the reports ([`oversee`]), opens a
//! pool's breaker (a pause of cause `breaker` and a probe limit of 1 in the pool's
//! state) and moves its adaptive limit, and `owner` writes what the state then
//! says to the consumer. The instance that makes the probe closes or reopens the
//! breaker (`outcome.rs`, when pool control takes the probe's outcome).
//!
//! The decisions are pure, in `crate::pool::breaker` and `crate::pool::adaptive`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt as _;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use webproxy_config::human;
use webproxy_config::settings::PoolConfig;

use super::PoolTasks;
use super::control::PoolControl;
use super::counts::{counted, now_s};
use crate::pool::adaptive::{ADAPT_EVERY, Adaptive, Bounds, next_limit, start};
use crate::pool::breaker::{
    self, ClusterReports, Phase, Report, STATS, counted_from, open_reason, should_open, stats_key,
};
use crate::pool::state::PoolState;
use webproxy_jetstream::clock;
use webproxy_jetstream::instances;
use webproxy_jetstream::state::{Bucket, StateBucket};

/// How often an instance reports its counts, and the owner looks at them.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// A report unchanged this long is written again, so the bucket's 20 s TTL removes
/// only the reports of instances that stopped.
const REWRITE_AFTER: Duration = Duration::from_secs(10);

/// How many seconds of counts a pool's reports keep: its breaker's window, and two
/// steps of the adaptive limit.
fn kept_seconds(config: &PoolConfig) -> u64 {
    let window = config.breaker.as_ref().map_or(0, |b| b.window.as_secs());
    window.max(2 * ADAPT_EVERY.as_secs()) + 1
}

/// Writes this instance's counts of every counted pool every [`REPORT_EVERY`], while
/// they hold a second recent enough to matter, until `shutdown`.
pub(crate) async fn report(tasks: PoolTasks, shutdown: CancellationToken) {
    let instance = instances::instance_id();
    let bucket = {
        let shared = tasks.current();
        StateBucket::new(
            shared.js.clone(),
            Bucket::Instances.spec(&shared.settings.subjects, &shared.settings.streams),
        )
    };
    let mut written: HashMap<String, (Report, tokio::time::Instant)> = HashMap::new();
    let mut interval = tokio::time::interval(REPORT_EVERY);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        let shared = tasks.current();
        let now = now_s();
        for (pool, config) in &shared.settings.cluster.pools {
            if !counted(config) {
                continue;
            }
            let Some(report) = tasks
                .control
                .counts
                .report(pool, now - kept_seconds(config))
            else {
                written.remove(pool);
                continue;
            };
            if written
                .get(pool)
                .is_some_and(|(last, at)| *last == report && at.elapsed() < REWRITE_AFTER)
            {
                continue;
            }
            let store = match bucket.store().await {
                Ok(store) => store,
                Err(e) => {
                    warn!(error = %e, "cannot open the instances' bucket to report attempts");
                    break;
                }
            };
            let value = match serde_json::to_vec(&report) {
                Ok(value) => value,
                Err(e) => {
                    warn!(pool, error = %e, "cannot encode the attempts' report");
                    continue;
                }
            };
            match store.put(stats_key(pool, &instance), value.into()).await {
                Ok(_) => {
                    written.insert(pool.clone(), (report, tokio::time::Instant::now()));
                }
                Err(e) => {
                    debug!(pool, error = %e, "cannot report attempts; next second");
                    // Opened again next time, and made again if it is gone.
                    bucket.reopen().await;
                }
            }
        }
    }
}

/// Every instance's latest report, as a watch of `stats.>` keeps them.
type Reports = Arc<Mutex<ClusterReports>>;

/// Follows every report in the instances' bucket into `reports` until `stop`; a lost
/// watch is made again.
async fn follow_reports(tasks: PoolTasks, reports: Reports, stop: CancellationToken) {
    let mut failures = 0u32;
    loop {
        if failures > 0
            && !webproxy_jetstream::backoff::PULL_BACKOFF
                .wait(failures, &stop)
                .await
        {
            return;
        }
        let shared = tasks.current();
        let watched = async {
            let store = shared
                .js
                .create_or_update_key_value(instances::bucket_config(&shared.settings))
                .await
                .map_err(|e| e.to_string())?;
            store
                .watch_with_history(format!("{STATS}.>"))
                .await
                .map_err(|e| e.to_string())
        };
        let mut entries = tokio::select! {
            watched = watched => match watched {
                Ok(entries) => entries,
                Err(e) => {
                    warn!(error = %e, "cannot watch the instances' attempt reports; retrying");
                    failures = failures.saturating_add(1);
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        failures = 1;
        loop {
            let entry = tokio::select! {
                entry = entries.next() => entry,
                _ = stop.cancelled() => return,
            };
            let Some(Ok(entry)) = entry else {
                debug!("the watch of the attempt reports ended; watching again");
                break;
            };
            let report = (entry.operation == kv::Operation::Put)
                .then(|| serde_json::from_slice::<Report>(&entry.value).ok())
                .flatten();
            let mut reports = reports.lock().unwrap_or_else(PoisonError::into_inner);
            match report {
                Some(report) => reports.put(entry.key, report, std::time::Instant::now()),
                None => reports.remove(&entry.key),
            }
        }
    }
}

/// The cluster's counts of `pool` in the seconds `from..to`.
fn cluster_counts(reports: &Reports, pool: &str, from: u64, to: u64) -> breaker::Counts {
    reports
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .sum(pool, from, to)
}

/// What the judge remembers of a pool between its looks.
#[derive(Default)]
struct Seen {
    /// The first second the next adaptive step counts, and when it may be taken.
    adapt_from: Option<u64>,
    adapt_at: Option<tokio::time::Instant>,
}

/// While `holding` says this instance holds the lease, looks at every counted pool
/// each [`REPORT_EVERY`]: opens a breaker on the cluster's counts, and steps an
/// adaptive limit every [`ADAPT_EVERY`]. Its writes go
/// to the pools' state, which the owner's loop then writes to the consumers.
pub(crate) async fn oversee(
    tasks: PoolTasks,
    mut holding: watch::Receiver<bool>,
    shutdown: CancellationToken,
) {
    let reports: Reports = Arc::default();
    let mut following: Option<CancellationToken> = None;
    let mut seen: HashMap<String, Seen> = HashMap::new();
    let mut interval = tokio::time::interval(REPORT_EVERY);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            changed = holding.changed() => if changed.is_err() { break },
            _ = shutdown.cancelled() => break,
        }
        if !*holding.borrow_and_update() {
            if let Some(stop) = following.take() {
                stop.cancel();
                reports
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clear();
                seen.clear();
            }
            continue;
        }
        let shared = tasks.current();
        if following.is_none() {
            let stop = shutdown.child_token();
            tokio::spawn(follow_reports(tasks.clone(), reports.clone(), stop.clone()));
            following = Some(stop);
        }
        // The bucket removed the keys of instances that stopped reporting; so does the map.
        reports
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .drop_expired(std::time::Instant::now(), instances::TTL);
        let states = tasks.control.states().borrow().clone();
        let now = clock::now_utc();
        let second = now_s();
        for (pool, config) in &shared.settings.cluster.pools {
            let state = states.get(pool).cloned().unwrap_or_default();
            let seen = seen.entry(pool.clone()).or_default();
            let phase = state.phase(now);
            match (&config.breaker, phase) {
                (Some(breaker), Phase::Closed) => {
                    let from = counted_from(second, breaker, state.breaker_closed);
                    let counts = cluster_counts(&reports, pool, from, second + 1);
                    if should_open(counts, breaker) {
                        let reason = open_reason(counts, breaker);
                        let opened = tasks
                            .control
                            .change_state(pool, |state| {
                                state.open_breaker(clock::now_utc(), breaker.open_for, &reason)
                            })
                            .await;
                        match opened {
                            Ok(Some(_)) => {
                                warn!(pool, reason, open_for = %human(breaker.open_for), "circuit breaker opened");
                                tasks.control.metrics().breaker_transition(pool, "open");
                            }
                            Ok(None) => {}
                            Err(e) => warn!(pool, error = %e, "cannot open the circuit breaker"),
                        }
                    }
                }
                // A breaker taken out of the configuration while open closes, and lets
                // go of the pool at once, not at the end of its pause.
                (None, Phase::Open | Phase::HalfOpen) => {
                    let closed = tasks
                        .control
                        .change_state(pool, PoolState::forget_breaker)
                        .await;
                    match closed {
                        Ok(Some(closed)) => {
                            info!(pool, "circuit breaker closed: it is no longer configured");
                            tasks.control.metrics().breaker_transition(pool, "closed");
                            if state.lifts_pause(&closed, clock::now_utc())
                                && let Err(e) = shared.pauses().lift_pause(pool).await
                            {
                                warn!(pool, error = %e, "cannot lift the pause of a breaker no longer configured");
                            }
                        }
                        Ok(None) => {}
                        Err(e) => {
                            warn!(pool, error = %e, "cannot close a breaker no longer configured")
                        }
                    }
                }
                _ => {}
            }
            if config.adaptive && phase == Phase::Closed {
                adapt(&tasks.control, &reports, pool, config, &state, seen, second).await;
            } else if !config.adaptive && state.adaptive_limit.is_some() {
                // Switched off: the stored limit no longer applies, nor shows.
                let cleared = tasks
                    .control
                    .change_state(pool, |state| {
                        state.baseline_us = None;
                        state.adaptive_limit.take().is_some()
                    })
                    .await;
                if let Err(e) = cleared {
                    warn!(pool, error = %e, "cannot clear the adaptive limit");
                }
            }
        }
    }
    if let Some(stop) = following {
        stop.cancel();
    }
}

/// One step of `pool`'s adaptive limit, when [`ADAPT_EVERY`] has passed since the last,
/// from the cluster's counts since then (the second still being reported left out).
async fn adapt(
    control: &PoolControl,
    reports: &Reports,
    pool: &str,
    config: &PoolConfig,
    state: &PoolState,
    seen: &mut Seen,
    second: u64,
) {
    let due = seen.adapt_at.is_none_or(|at| at.elapsed() >= ADAPT_EVERY);
    if !due {
        return;
    }
    let bounds = Bounds {
        min: config.min_in_flight,
        max: config.max_in_flight,
    };
    let to = second.saturating_sub(1);
    let from = seen
        .adapt_from
        .unwrap_or(to.saturating_sub(ADAPT_EVERY.as_secs()));
    seen.adapt_from = Some(to);
    seen.adapt_at = Some(tokio::time::Instant::now());
    let current = match state.adaptive_limit {
        Some(limit) => Adaptive {
            limit,
            baseline_us: state.baseline_us,
        },
        None => start(bounds),
    };
    let counts = cluster_counts(reports, pool, from, to);
    let next = if state.adaptive_limit.is_none() {
        current
    } else {
        next_limit(current, counts, bounds)
    };
    if state.adaptive_limit == Some(next.limit) && state.baseline_us == next.baseline_us {
        return;
    }
    let written = control
        .change_state(pool, |stored| {
            // Computed from the state as read; another writer's limit since wins.
            if stored.adaptive_limit != state.adaptive_limit {
                return false;
            }
            let changed =
                stored.adaptive_limit != Some(next.limit) || stored.baseline_us != next.baseline_us;
            stored.adaptive_limit = Some(next.limit);
            stored.baseline_us = next.baseline_us;
            changed
        })
        .await;
    match written {
        Ok(_) => info!(
            pool,
            limit = next.limit,
            was = current.limit,
            attempts = counts.attempts,
            failures = counts.failures,
            mean_latency_us = counts.mean_latency_us(),
            baseline_us = next.baseline_us,
            "adaptive limit"
        ),
        Err(e) => warn!(pool, error = %e, "cannot write the adaptive limit"),
    }
}
