//! The gate a message passes between its plan and its attempt, per pool and
//! cluster-wide. A pool paused in its runtime state (`<PREFIX>_POOL_STATE`, watched by
//! every instance) makes no attempt until the pause ends; a pool with a `rate` makes
//! each attempt at a slot of its shared schedule (`<PREFIX>_RATE`, one key per pool:
//! the next unclaimed slot's time), claimed a few at a time with compare-and-set.
//!
//! A message waiting at the gate holds its local permit, and so one of the pool's
//! `max_in_flight` slots, and its progress acks go on.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;
use time::OffsetDateTime;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use webproxy_config::rate::Rate;
use webproxy_config::settings::{PoolConfig, Settings};

use super::stored::stored_pool_state;
use crate::clock;
use crate::observability::health::Health;
use crate::observability::metrics::Metrics;
use crate::pool::breaker::Phase;
use crate::pool::rate::{Schedule, SlotClaim};
use crate::pool::state::{Extend, PoolState};
use crate::provision::pool_state_bucket_config;
use crate::state::{Bucket, StateBucket};

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

/// Microseconds since the Unix epoch: the schedule's clock, shared by every instance,
/// so each reads [`clock::now`], within its tolerance of the server's time.
fn now_us() -> u64 {
    u64::try_from(clock::unix_us(clock::now())).unwrap_or(0)
}

/// Sleeps until `at_us` on the schedule's clock.
async fn sleep_until_us(at_us: u64) {
    let now = now_us();
    if at_us > now {
        tokio::time::sleep(Duration::from_micros(at_us - now)).await;
    }
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
        let now = crate::clock::now_utc();
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
        let mut failures = 0u32;
        loop {
            if failures > 0 && !crate::backoff::PULL_BACKOFF.wait(failures, &shutdown).await {
                return;
            }
            let watched = async {
                let store = self
                    .js
                    .create_or_update_key_value(pool_state_bucket_config(settings))
                    .await
                    .map_err(|e| e.to_string())?;
                // Read before the watch starts: every later write reaches the watch.
                let written_before = store
                    .stream
                    .get_info()
                    .await
                    .map_or(0, |info| info.state.last_sequence);
                let watch = store
                    .watch_with_history(">")
                    .await
                    .map_err(|e| e.to_string())?;
                // An empty bucket sends no history to say it is read.
                let empty = store
                    .status()
                    .await
                    .is_ok_and(|status| status.values() == 0);
                Ok::<_, String>((watch, empty, store, written_before))
            };
            let (mut entries, empty, store, written_before) = tokio::select! {
                watched = watched => match watched {
                    Ok(watched) => watched,
                    Err(e) => {
                        warn!(bucket = self.state_bucket, error = %e, "cannot watch the pools' runtime state; retrying");
                        failures = failures.saturating_add(1);
                        continue;
                    }
                },
                _ = shutdown.cancelled() => return,
            };
            // A watch starts with every key's latest value: a state this instance
            // knew whose key is no longer there (the bucket lost and made again, a
            // purge) is forgotten once the history is read, so that a breaker left
            // half-open in a lost bucket does not stay half-open here for ever.
            let mut history: Option<HashSet<String>> = Some(HashSet::new());
            if empty {
                self.forget_states(|_| false);
                history = None;
                self.set_loaded();
            }
            // The watch is checked against the bucket now and then: after a stream
            // leader moved, a watch was seen to go on without an error yet without the
            // writes that followed (a resume among them, which left a pool paused here
            // for good). One that stays behind the bucket's last write for two checks
            // is made again.
            let mut last_seen = written_before;
            let mut behind_checks = 0u32;
            let mut check =
                tokio::time::interval_at(tokio::time::Instant::now() + WATCH_CHECK, WATCH_CHECK);
            loop {
                let entry = tokio::select! {
                    entry = entries.next() => entry,
                    _ = check.tick() => {
                        let last = store.stream.get_info().await.map(|info| info.state.last_sequence);
                        behind_checks = match last {
                            Ok(last) if last > last_seen => behind_checks + 1,
                            _ => 0,
                        };
                        if behind_checks >= 2 {
                            warn!(bucket = self.state_bucket, last_seen, "the watch of the pools' runtime state fell behind the bucket; watching again");
                            break;
                        }
                        continue;
                    }
                    _ = shutdown.cancelled() => return,
                };
                let entry = match entry {
                    Some(Ok(entry)) => entry,
                    Some(Err(e)) => {
                        warn!(error = %e, "the watch of the pools' runtime state was lost; watching again");
                        failures = 1;
                        break;
                    }
                    None => {
                        failures = 1;
                        break;
                    }
                };
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
                let now = crate::clock::now_utc();
                let mut lifted = false;
                self.states.send_modify(|states| {
                    let states = Arc::make_mut(states);
                    let paused_after = state.as_ref().and_then(|s| s.paused_until(now));
                    let before = match state {
                        Some(state) => states.insert(entry.key.clone(), state),
                        None => states.remove(&entry.key),
                    };
                    lifted = paused_after.is_none()
                        && before.is_some_and(|b| b.paused_until(now).is_some());
                });
                if lifted {
                    self.note_lifted_pauses([entry.key.clone()]);
                }
                last_seen = last_seen.max(entry.revision);
                if let Some(seen) = history.as_mut() {
                    seen.insert(entry.key.clone());
                }
                if entry.seen_current {
                    if let Some(seen) = history.take() {
                        self.forget_states(|pool| seen.contains(pool));
                    }
                    self.set_loaded();
                }
            }
        }
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
            Some(limiter) if limiter.schedule == schedule => limiter.clone(),
            _ => {
                let limiter = Arc::new(Limiter {
                    pool: pool.to_string(),
                    metrics: self.metrics.clone(),
                    schedule,
                    bucket: self.rate_bucket.clone(),
                    health: self.health.clone(),
                    slots: Mutex::new(VecDeque::new()),
                    claiming: tokio::sync::Mutex::new(Claiming::default()),
                    waiting: std::sync::atomic::AtomicU64::new(0),
                });
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

/// The pools' runtime state could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("cannot update the runtime state of pool {pool} in {bucket}: {message}")]
pub struct StateError {
    pool: String,
    bucket: String,
    message: String,
}

impl StateError {
    pub(crate) fn new(pool: &str, bucket: &str, message: String) -> StateError {
        StateError {
            pool: pool.to_string(),
            bucket: bucket.to_string(),
            message,
        }
    }
}

/// Changes `pool`'s state in `bucket` with `change` (which says whether it changed
/// anything), by compare-and-set, again while other writers win. The state written,
/// or `None` when `change` left it as it was.
pub(crate) async fn update_pool_state(
    js: &jetstream::Context,
    bucket: &str,
    pool: &str,
    mut change: impl FnMut(&mut PoolState) -> bool,
) -> Result<Option<PoolState>, StateError> {
    let error = |message: String| StateError::new(pool, bucket, message);
    let store = js
        .get_key_value(bucket)
        .await
        .map_err(|e| error(e.to_string()))?;
    for _ in 0..CAS_TRIES {
        let (mut state, revision) = stored_pool_state(&store, pool).await.map_err(error)?;
        if !change(&mut state) {
            return Ok(None);
        }
        let value = serde_json::to_vec(&state).map_err(|e| error(e.to_string()))?;
        let written = match revision {
            Some(revision) => store.update(pool, value.into(), revision).await.is_ok(),
            None => store.create(pool, value.into()).await.is_ok(),
        };
        if written {
            return Ok(Some(state));
        }
    }
    Err(error(format!(
        "it kept changing; gave up after {CAS_TRIES} tries"
    )))
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

/// Compare-and-set tries before a write of shared state gives up: each lost try means
/// another instance wrote meanwhile.
const CAS_TRIES: usize = 20;

/// What the claiming handler knows of the stored schedule: its last write, which the
/// next claim tries first (one round trip when no other instance claimed since), and
/// the next slot it last wrote, which outlives a lost bucket (`Schedule::resumed`).
#[derive(Default)]
struct Claiming {
    last: Option<(u64, u64)>,
    known_next_us: u64,
}

/// How often the pool-state watch is checked against the bucket's last write.
const WATCH_CHECK: Duration = Duration::from_secs(5);

/// How long claims may keep failing before the pool counts as stuck (`/readyz` 503):
/// longer than a leader election, and with the claims' backoff (at most 2 s) well
/// within the 10 s in which a stuck pool must show.
const STUCK_AFTER: Duration = Duration::from_secs(3);

/// One pool's rate limit on this instance: slots claimed and not yet used, and one
/// claim at a time.
struct Limiter {
    pool: String,
    metrics: Arc<Metrics>,
    schedule: Schedule,
    /// `<PREFIX>_RATE`, shared by every pool's limiter.
    bucket: StateBucket,
    health: Arc<Health>,
    /// Claimed slots, earliest first: (time, usable until).
    slots: Mutex<VecDeque<(u64, u64)>>,
    claiming: tokio::sync::Mutex<Claiming>,
    /// Handlers waiting for a slot: how many the next claim asks for.
    waiting: std::sync::atomic::AtomicU64,
}

impl Limiter {
    /// Waits for a slot of the schedule and until its time.
    async fn acquire(&self) {
        use std::sync::atomic::Ordering;
        self.waiting.fetch_add(1, Ordering::Relaxed);
        // A handler that leaves the wait (its deadline, a shutdown) no longer counts.
        scopeguard::defer! {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        let mut failures = 0u32;
        let mut failing_since = None;
        let stuck_key = format!("rate.{}", self.pool);
        loop {
            if let Some(slot) = self.take() {
                if self.used_in_time(slot).await {
                    return;
                }
                continue;
            }
            let mut claiming = self.claiming.lock().await;
            // Another handler may have claimed while this one waited for the lock.
            if let Some(slot) = self.take() {
                drop(claiming);
                if self.used_in_time(slot).await {
                    return;
                }
                continue;
            }
            let wanted = self.waiting.load(Ordering::Relaxed).max(1);
            match self.claim(&mut claiming, wanted).await {
                Ok(claim) => {
                    if failures > 0 {
                        self.health.set_stuck(&stuck_key, None);
                        info!(pool = self.pool, "claiming the pool's rate slots again");
                    }
                    failures = 0;
                    failing_since = None;
                    let claimed = now_us();
                    let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
                    slots.extend(
                        claim
                            .slots()
                            .map(|slot| (slot, Schedule::usable_until(slot, claimed))),
                    );
                }
                Err(e) => {
                    drop(claiming);
                    failures = failures.saturating_add(1);
                    warn!(pool = self.pool, error = %e, "cannot claim a slot of the pool's rate schedule; retrying");
                    // The bucket may be gone (a memory store lost in a restart, a
                    // delete by hand): the next claim looks it up again, and makes it
                    // once the server confirms it missing.
                    self.bucket.reopen().await;
                    let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
                    if since.elapsed() >= STUCK_AFTER {
                        self.health.set_stuck(
                            &stuck_key,
                            Some(format!(
                                "pool {}: cannot claim slots of its rate schedule in {} for {} s: {e}",
                                self.pool,
                                self.bucket.spec().name,
                                since.elapsed().as_secs()
                            )),
                        );
                    }
                    let wait = crate::backoff::PULL_BACKOFF
                        .after(failures)
                        .unwrap_or(Duration::from_secs(1));
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }

    /// The earliest claimed slot still usable, dropping those whose time passed: its
    /// time and until when it may be used.
    fn take(&self) -> Option<(u64, u64)> {
        let now = now_us();
        let mut slots = self.slots.lock().unwrap_or_else(PoisonError::into_inner);
        while let Some((slot, until)) = slots.pop_front() {
            if until > now {
                return Some((slot, until));
            }
            debug!(pool = self.pool, slot, "a claimed slot went unused");
        }
        None
    }

    /// Sleeps until `slot`'s time; whether this handler woke while the slot was still
    /// usable. On a loaded machine a handler may wake long after its slot, and
    /// handlers woken late together would call the upstream together: a late one
    /// drops its slot and takes another instead.
    async fn used_in_time(&self, (slot, until): (u64, u64)) -> bool {
        sleep_until_us(slot).await;
        if now_us() < until {
            return true;
        }
        debug!(
            pool = self.pool,
            slot, "woke after the slot's lease; taking another"
        );
        false
    }

    /// The stored schedule's next slot and its revision; none when never written.
    async fn read_schedule(&self, store: &kv::Store) -> Result<(Option<u64>, Option<u64>), String> {
        self.metrics.rate_schedule_requests(&self.pool, 1);
        Ok(
            match store.entry(&self.pool).await.map_err(|e| e.to_string())? {
                Some(entry) if entry.operation == kv::Operation::Put => (
                    std::str::from_utf8(&entry.value)
                        .ok()
                        .and_then(|v| v.parse().ok()),
                    Some(entry.revision),
                ),
                Some(entry) => (None, Some(entry.revision)),
                None => (None, None),
            },
        )
    }

    /// Claims up to `wanted` slots with a compare-and-set on the stored schedule.
    async fn claim(&self, claiming: &mut Claiming, wanted: u64) -> Result<SlotClaim, String> {
        let store = self.bucket.store().await.map_err(|e| e.to_string())?;
        for _ in 0..CAS_TRIES {
            let (stored, revision) = match claiming.last.take() {
                Some((next, revision)) => (Some(next), Some(revision)),
                None => self.read_schedule(&store).await?,
            };
            let stored = Schedule::resumed(stored, claiming.known_next_us);
            let claim = self.schedule.claim(stored, now_us(), wanted);
            let value = claim.next_us.to_string().into_bytes();
            self.metrics.rate_schedule_requests(&self.pool, 1);
            // Another instance's claim in between is a conflict, tried again; any
            // other failure ends the claim.
            let written = match revision {
                Some(revision) => match store.update(&self.pool, value.into(), revision).await {
                    Ok(revision) => Some(revision),
                    Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => None,
                    Err(e) => return Err(format!("bucket {}: {e}", self.bucket.spec().name)),
                },
                None => match store.create(&self.pool, value.into()).await {
                    Ok(revision) => Some(revision),
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => None,
                    Err(e) => return Err(format!("bucket {}: {e}", self.bucket.spec().name)),
                },
            };
            if let Some(revision) = written {
                claiming.last = Some((claim.next_us, revision));
                claiming.known_next_us = claim.next_us;
                return Ok(claim);
            }
        }
        Err(format!(
            "the schedule kept changing; gave up after {CAS_TRIES} tries"
        ))
    }
}
