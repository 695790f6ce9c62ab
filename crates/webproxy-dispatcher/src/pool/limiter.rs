//! One pool's rate limit on this instance: slots of the pool's shared schedule
//! (`<PREFIX>_RATE`, one key per pool: the next unclaimed slot's time), claimed a few
//! at a time with compare-and-set, and used in time order by the handlers waiting at
//! the gate.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::kv;
use tracing::{debug, info, warn};

use super::rate::{Schedule, SlotClaim};
use super::stored::CAS_TRIES;
use crate::observability::health::Health;
use crate::observability::metrics::Metrics;
use webproxy_jetstream::clock;
use webproxy_jetstream::state::StateBucket;

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

/// What the claiming handler knows of the stored schedule: its last write, which the
/// next claim tries first (one round trip when no other instance claimed since), and
/// the next slot it last wrote, which outlives a lost bucket (`Schedule::resumed`).
#[derive(Default)]
struct Claiming {
    last: Option<(u64, u64)>,
    known_next_us: u64,
}

/// How long claims may keep failing before the pool counts as stuck (`/readyz` 503):
/// longer than a leader election, and with the claims' backoff (at most 2 s) well
/// within the 10 s in which a stuck pool must show.
const STUCK_AFTER: Duration = Duration::from_secs(3);

/// One pool's rate limit on this instance: slots claimed and not yet used, and one
/// claim at a time.
pub(crate) struct Limiter {
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
    pub(crate) fn new(
        pool: &str,
        schedule: Schedule,
        bucket: StateBucket,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Limiter {
        Limiter {
            pool: pool.to_string(),
            metrics,
            schedule,
            bucket,
            health,
            slots: Mutex::new(VecDeque::new()),
            claiming: tokio::sync::Mutex::new(Claiming::default()),
            waiting: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The schedule it claims slots of.
    pub(crate) fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// Waits for a slot of the schedule and until its time.
    pub(crate) async fn acquire(&self) {
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
                    let wait = webproxy_jetstream::backoff::PULL_BACKOFF
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
