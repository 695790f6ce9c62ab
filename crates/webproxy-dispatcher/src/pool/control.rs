//! The gate a message passes between its plan and its attempt, per pool and
//! cluster-wide. A pool paused in its runtime state (`<PREFIX>_POOL_STATE`, watched by
//! every instance) makes no attempt until the pause ends; a pool with a `rate` makes
//! each attempt at a slot of its shared schedule (`<PREFIX>_RATE`, one key per pool:
//! the next unclaimed slot's time), claimed a few at a time with compare-and-set.
//!
//! A message waiting at the gate holds its local permit, and so one of the pool's
//! `max_in_flight` slots, and its progress acks go on.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use webproxy_config::rate::Rate;
use webproxy_config::settings::{PoolConfig, Settings};

use super::limiter::Limiter;
use super::stored::{StateError, update_pool_state};
use crate::observability::health::Health;
use crate::observability::metrics::Metrics;
use crate::pool::breaker::Phase;
use crate::pool::rate::Schedule;
use crate::pool::state::{Extend, PoolState};
use webproxy_jetstream::clock;
use webproxy_jetstream::follow::{Follower, follow};
use webproxy_jetstream::provision::pool_state_bucket_config;
use webproxy_jetstream::state::{Bucket, StateBucket};

/// Every pool's runtime state as last seen.
pub(crate) type PoolStates = Arc<BTreeMap<String, PoolState>>;

/// The pools' runtime state and rate schedules, for every handler of this instance.
pub(crate) struct PoolControl {
    js: jetstream::Context,
    metrics: Arc<Metrics>,
    state_bucket: String,
    rate_bucket: StateBucket,
    health: Arc<Health>,
    states: watch::Sender<PoolStates>,
    /// Whether [`PoolControl::states`] holds every pool's state the bucket held when it was
    /// first watched; until then, no pool's state is known.
    loaded: std::sync::atomic::AtomicBool,
    limiters: Mutex<HashMap<String, Arc<Limiter>>>,
    /// This instance's attempts per pool, for the breaker and the adaptive limit.
    pub(crate) counts: super::counts::AttemptCounts,
    /// Pools whose pause in force left their state before its end (a bucket lost and
    /// made again, a resume): the lease holder lifts the pause their consumer still has.
    forgotten_pauses: Mutex<HashSet<String>>,
}

/// How a message leaves the gate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Attempt it.
    Go,
    /// Attempt it as the probe of a half-open breaker: its outcome closes or reopens it.
    Probe,
    /// The pool's breaker is open: park it, without an attempt, due when the pause ends.
    Park(OffsetDateTime),
}

impl PoolControl {
    pub(crate) fn new(
        js: jetstream::Context,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
        settings: &Settings,
    ) -> PoolControl {
        PoolControl {
            rate_bucket: StateBucket::new(
                js.clone(),
                Bucket::Rate.spec(&settings.subjects, &settings.streams),
            ),
            js,
            metrics,
            health,
            state_bucket: settings.subjects.pool_state_bucket(),
            states: watch::Sender::new(Arc::new(BTreeMap::new())),
            loaded: std::sync::atomic::AtomicBool::new(false),
            limiters: Mutex::new(HashMap::new()),
            counts: super::counts::AttemptCounts::default(),
            forgotten_pauses: Mutex::new(HashSet::new()),
        }
    }

    /// The metrics the gate and the breaker's transitions are counted in.
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Whether `pool`'s pause left its state before its end since this was last asked
    /// ([`PoolControl::follow_states`]); asking forgets it.
    pub(crate) fn take_forgotten_pause(&self, pool: &str) -> bool {
        self.forgotten_pauses
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(pool)
    }

    /// Keeps in [`PoolControl::states`] only the pools `kept` says, noting each pool forgotten
    /// with a pause in force.
    fn forget_states(&self, kept: impl Fn(&str) -> bool) {
        let now = webproxy_jetstream::clock::now_utc();
        let mut forgotten = Vec::new();
        self.states.send_modify(|states| {
            Arc::make_mut(states).retain(|pool, state| {
                let keep = kept(pool);
                if !keep && state.paused_until(now).is_some() {
                    forgotten.push(pool.clone());
                }
                keep
            });
        });
        if !forgotten.is_empty() {
            warn!(pools = %forgotten.join(", "), "the pools' runtime state was lost with their pauses; the pauses end");
            self.note_lifted_pauses(forgotten);
        }
    }

    /// Notes pools whose pause in force left their state before its end, for the
    /// lease holder to lift from their consumers: a pause ended by a writer that may
    /// not have lifted it (a bucket lost and made again, a `pools resume` the owner's
    /// round overtook with the state it had before).
    pub(crate) fn note_lifted_pauses(&self, pools: impl IntoIterator<Item = String>) {
        self.forgotten_pauses
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(pools);
    }

    /// The pools' runtime state, as it changes.
    pub(crate) fn states(&self) -> watch::Receiver<PoolStates> {
        self.states.subscribe()
    }

    /// Whether the pools' state has been read: a write computed from the state before
    /// then could undo it.
    pub(crate) fn loaded(&self) -> bool {
        self.loaded.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks the state read, and wakes whoever waits for a change of it.
    fn set_loaded(&self) {
        if !self.loaded.swap(true, std::sync::atomic::Ordering::AcqRel) {
            self.states.send_modify(|_| {});
        }
    }

    /// Keeps [`PoolControl::states`] in step with the bucket until `shutdown`; a watch that is
    /// lost is made again (it starts with every key's latest value).
    pub(crate) async fn follow_states(&self, settings: &Settings, shutdown: CancellationToken) {
        let open = || async {
            self.js
                .create_or_update_key_value(pool_state_bucket_config(settings))
                .await
                .map_err(|e| e.to_string())
        };
        let mut follower = StatesFollower { control: self };
        follow(
            &self.state_bucket,
            open,
            WATCH_CHECK,
            &mut follower,
            &shutdown,
        )
        .await;
    }

    /// Waits until `pool` may make an attempt: not paused, and under a `rate`, at a
    /// slot of the pool's schedule. A pool whose breaker is open does not wait: the
    /// message is to be parked until the pause ends (a message waiting out another
    /// pause that the breaker's joins is parked then too). Past a half-open breaker,
    /// the attempt is its probe.
    pub(crate) async fn pass(&self, pool: &str, config: &PoolConfig) -> Pass {
        let started = std::time::Instant::now();
        let paused = match self.wait_out_pauses(pool).await {
            Ok(paused) => paused,
            Err(until) => return Pass::Park(until),
        };
        if let Some(rate) = config.rate {
            self.limiter(pool, rate, config.burst).acquire().await;
        }
        if paused || config.rate.is_some() {
            self.metrics.gate_wait(pool, started.elapsed());
        }
        // The breaker may have opened while this message waited for its rate slot.
        let now = clock::now_utc();
        let states = self.states.borrow();
        let Some(state) = states.get(pool) else {
            return Pass::Go;
        };
        match (state.phase(now), state.paused_until(now)) {
            (Phase::Open, Some(until)) => Pass::Park(until),
            (Phase::HalfOpen, _) => Pass::Probe,
            _ => Pass::Go,
        }
    }

    /// A message passed `pool`'s half-open breaker and is attempted: its attempt is the
    /// probe (said once the wait at the gate did not make it too late).
    pub(crate) fn probe_started(&self, pool: &str) {
        info!(
            pool,
            "circuit breaker half-open: this attempt is its one probe"
        );
        self.metrics.breaker_transition(pool, "half_open");
    }

    /// Changes `pool`'s state with `change` (which says whether it changed anything),
    /// by compare-and-set: the state written, or `None` when nothing changed.
    pub(crate) async fn change_state(
        &self,
        pool: &str,
        change: impl FnMut(&mut PoolState) -> bool,
    ) -> Result<Option<PoolState>, StateError> {
        update_pool_state(&self.js, &self.state_bucket, pool, change).await
    }

    /// `pool`'s limit as its state sets it now (what the owner writes to its consumer).
    pub(crate) fn effective_limit(&self, pool: &str, config: &PoolConfig) -> u64 {
        self.states
            .borrow()
            .get(pool)
            .map_or(config.max_in_flight, |state| state.max_ack_pending(config))
    }

    /// Whether `pool`'s state holds a pause in force now.
    pub(crate) fn is_paused(&self, pool: &str) -> bool {
        self.states
            .borrow()
            .get(pool)
            .is_some_and(|state| state.paused_until(clock::now_utc()).is_some())
    }

    /// Returns once the state of `pool` holds no pause in force: whether it had to
    /// wait; or, at once, the end of the pause when the pool's breaker is open.
    async fn wait_out_pauses(&self, pool: &str) -> Result<bool, OffsetDateTime> {
        let mut states = self.states();
        let mut waited = false;
        loop {
            let now = clock::now_utc();
            let (until, open) = states
                .borrow_and_update()
                .get(pool)
                .map_or((None, false), |state| {
                    (state.paused_until(now), state.phase(now) == Phase::Open)
                });
            let Some(until) = until else {
                return Ok(waited);
            };
            if open {
                return Err(until);
            }
            waited = true;
            let left = until - clock::now_utc();
            let left = Duration::try_from(left).unwrap_or_default();
            tokio::select! {
                _ = tokio::time::sleep(left) => {}
                changed = states.changed() => if changed.is_err() { return Ok(waited) },
            }
        }
    }

    /// `pool`'s limiter for `rate` and `burst`, made anew when they change.
    fn limiter(&self, pool: &str, rate: Rate, burst: u32) -> Arc<Limiter> {
        let schedule = Schedule::new(rate, burst);
        let mut limiters = self.limiters.lock().unwrap_or_else(PoisonError::into_inner);
        match limiters.get(pool) {
            Some(limiter) if limiter.schedule() == schedule => limiter.clone(),
            _ => {
                let limiter = Arc::new(Limiter::new(
                    pool,
                    schedule,
                    self.rate_bucket.clone(),
                    self.metrics.clone(),
                    self.health.clone(),
                ));
                limiters.insert(pool.to_string(), limiter.clone());
                limiter
            }
        }
    }

    /// Pauses `pool` until `until` for `reason`, under `cause`, keeping a later end of
    /// the same cause: a compare-and-set on the pool's state, which every instance
    /// sees and the owner of the consumers' settings applies.
    pub(crate) async fn pause(
        &self,
        pool: &str,
        cause: &str,
        until: OffsetDateTime,
        reason: String,
    ) -> Result<(), StateError> {
        let paused = update_pool_state(&self.js, &self.state_bucket, pool, |state| {
            state.pause(cause, until, &reason, Extend::KeepLater)
        })
        .await?;
        if paused.is_some() {
            info!(pool, cause, %until, reason, "pool paused");
        }
        Ok(())
    }
}

/// Returns when `pool`'s state changes: its pull then nudges the server, which serves
/// a pull that waited through a pause lifted by hand only at its next heartbeat.
pub(crate) async fn pool_state_changed(states: &mut watch::Receiver<PoolStates>, pool: &str) {
    let before = states.borrow_and_update().get(pool).cloned();
    loop {
        if states.changed().await.is_err() {
            return std::future::pending().await;
        }
        if states.borrow_and_update().get(pool) != before.as_ref() {
            return;
        }
    }
}

/// How often the pool-state watch is checked against the bucket's last write.
const WATCH_CHECK: Duration = Duration::from_secs(5);

/// The pools' runtime state as the watch brings it.
struct StatesFollower<'a> {
    control: &'a PoolControl,
}

impl Follower for StatesFollower<'_> {
    fn apply(&mut self, entry: &kv::Entry) {
        let state = if entry.operation == kv::Operation::Put {
            match PoolState::from_json(&entry.value) {
                Ok(state) => Some(state),
                Err(e) => {
                    warn!(pool = entry.key, error = %e, "the pool's runtime state cannot be read; taken as none");
                    None
                }
            }
        } else {
            None
        };
        let now = webproxy_jetstream::clock::now_utc();
        let mut lifted = false;
        self.control.states.send_modify(|states| {
            let states = Arc::make_mut(states);
            let paused_after = state.as_ref().and_then(|s| s.paused_until(now));
            let before = match state {
                Some(state) => states.insert(entry.key.clone(), state),
                None => states.remove(&entry.key),
            };
            lifted =
                paused_after.is_none() && before.is_some_and(|b| b.paused_until(now).is_some());
        });
        if lifted {
            self.control.note_lifted_pauses([entry.key.clone()]);
        }
    }

    /// A state this instance knew whose key is no longer there (the bucket lost and
    /// made again, a purge) is forgotten once the history is read, so that a breaker
    /// left half-open in a lost bucket does not stay half-open here for ever.
    fn history_read(&mut self, seen: HashSet<String>) {
        self.control.forget_states(|pool| seen.contains(pool));
        self.control.set_loaded();
    }
}
