//! The one writer of the pool consumers' settings. One instance at a time holds a
//! lease in `<PREFIX>_INSTANCES` and brings every pool's work consumer in line with
//! the running revision's limits and the pool's runtime state in
//! `<PREFIX>_POOL_STATE` (as `control` follows it), writing only what differs
//! (`consumers::consumer_writes`).
//!
//! A lower `ack_wait` is written only once every live instance (by its heartbeat)
//! paces its progress acks from it (`may_apply`): the server redelivers a message
//! whose progress acks come slower than its consumer's `ack_wait`, while its attempt
//! still runs. A higher one is written at once; instances pace from it only once the
//! consumer carries it (`pacing.rs`).
//!
//! Provisioning creates a missing consumer from the same computation and never
//! rewrites one that exists. So instances running different revisions (a rolling
//! deploy in file mode, a push on its way) do not fight over the settings, and no
//! write undoes a pause or an adaptive limit.
//!
//! The lease is confirmed by compare-and-set (a renewal of its key at the revision
//! this instance last wrote) immediately before each consumer write, and the write is
//! skipped when that fails. A consumer write itself takes no precondition, so an
//! owner paused between its confirmation and its write can still write once; the next
//! owner's round, within [`ROUND`], brings the consumer back in line.

use std::time::Duration;

use async_nats::jetstream::kv;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use webproxy_config::human;
use webproxy_config::settings::PoolConfig;

use super::consumers::{ConsumerWrite, consumer_writes, pool_consumer_config};
use super::{PoolRevision, PoolTasks};
use crate::observability::metrics::Metrics;
use crate::pool::state::PoolState;
use webproxy_jetstream::instances::{self, POOL_CONSUMERS_LEASE};
use webproxy_jetstream::state::{Bucket, StateBucket};

/// How often the holder renews its lease and checks every pool's consumer, and how
/// often the others try to take the lease: a quarter of how long the bucket keeps
/// the lease, so one late renewal does not lose it.
const ROUND: Duration = Duration::from_secs(5);

/// The lease, held while this instance's last write of its key is the key's latest
/// (compare-and-set on the revision). It ends with the bucket's TTL when its holder
/// stops renewing, and at once when the holder stops cleanly.
struct Lease {
    /// `<PREFIX>_INSTANCES`, reopened after a failed write, and made again when the
    /// server confirms it gone: otherwise a lost bucket would leave no holder at all.
    bucket: StateBucket,
    holder: String,
    revision: Option<u64>,
}

/// Why the lease key is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    /// A round's start: take the lease, or renew it.
    Round,
    /// Just before a consumer write: confirm the lease is still this instance's.
    BeforeWrite,
}

impl Purpose {
    /// How a log line names it.
    fn as_str(self) -> &'static str {
        match self {
            Purpose::Round => "round",
            Purpose::BeforeWrite => "before_write",
        }
    }
}

/// A write of the lease key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseWrite {
    /// Take the lease: the key must not exist.
    Create,
    /// Renew it: the key must still be at this revision, this instance's last write.
    Update(u64),
}

/// What to write for `purpose` while holding the lease at `revision` (pure). Nothing
/// before a consumer write when the lease is not held: it is taken only at a round's
/// start, so a write is never made on a lease taken after the round decided it.
fn lease_write(revision: Option<u64>, purpose: Purpose) -> Option<LeaseWrite> {
    match (revision, purpose) {
        (Some(revision), _) => Some(LeaseWrite::Update(revision)),
        (None, Purpose::Round) => Some(LeaseWrite::Create),
        (None, Purpose::BeforeWrite) => None,
    }
}

/// A failed renewal: whether the key had moved on (another write than the one
/// renewed), and what failed.
fn update_failure(e: kv::UpdateError) -> (bool, String) {
    (
        e.kind() == kv::UpdateErrorKind::WrongLastRevision,
        e.to_string(),
    )
}

/// What a write of the lease key meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renewal {
    Took,
    Kept,
    Lost,
    HeldElsewhere,
}

impl Renewal {
    /// The outcome of a lease write, given whether the lease was held before it (pure).
    fn of(held_before: bool, written: bool) -> Renewal {
        match (held_before, written) {
            (false, true) => Renewal::Took,
            (true, true) => Renewal::Kept,
            (true, false) => Renewal::Lost,
            (false, false) => Renewal::HeldElsewhere,
        }
    }

    /// Whether this instance holds the lease now, and so may write a consumer.
    fn holding(self) -> bool {
        matches!(self, Renewal::Took | Renewal::Kept)
    }
}

impl Lease {
    /// Takes, renews or confirms the lease for `purpose` by compare-and-set; whether
    /// this instance holds it now.
    async fn hold(&mut self, purpose: Purpose) -> bool {
        let Some(write) = lease_write(self.revision, purpose) else {
            return false;
        };
        let value = bytes::Bytes::from(self.holder.clone());
        let written = match self.bucket.store().await {
            Err(e) => Err((false, e.to_string())),
            Ok(store) => {
                let written = match write {
                    LeaseWrite::Update(revision) => store
                        .update(POOL_CONSUMERS_LEASE, value.clone(), revision)
                        .await
                        .map_err(update_failure),
                    LeaseWrite::Create => store
                        .create(POOL_CONSUMERS_LEASE, value.clone())
                        .await
                        .map_err(|e| {
                            (
                                e.kind() == kv::CreateErrorKind::AlreadyExists,
                                e.to_string(),
                            )
                        }),
                };
                match written {
                    // The key moved on, or was there: if its latest write is this
                    // instance's own (a renewal applied whose answer was lost in an
                    // outage), the lease is still this instance's, renewed at that
                    // revision; otherwise another holder's.
                    Err((true, e)) => match self.own_revision(&store).await {
                        Some(own) => store
                            .update(POOL_CONSUMERS_LEASE, value, own)
                            .await
                            .map_err(update_failure),
                        None => Err((true, e)),
                    },
                    Err((false, e)) => {
                        // Not another holder's write: the bucket may be gone.
                        self.bucket.reopen().await;
                        Err((false, e))
                    }
                    written => written,
                }
            }
        };
        let renewal = Renewal::of(self.revision.is_some(), written.is_ok());
        match (renewal, written) {
            // The server did not answer (an outage, a leader election): the key may still
            // be at this instance's revision, so the next round renews at it. Dropping
            // it would leave the key, still this instance's, to block every instance's
            // take until its TTL ends, and the pools ownerless that long.
            (Renewal::Lost, Err((false, e))) => {
                warn!(error = %e, purpose = purpose.as_str(), "could not renew the lease of the pool consumers' settings; renewing at its revision next round");
                return false;
            }
            (_, Ok(revision)) => {
                if renewal == Renewal::Took {
                    info!(
                        holder = self.holder,
                        "took the lease: this instance writes the pool consumers' settings"
                    );
                }
                self.revision = Some(revision);
            }
            (Renewal::Lost, Err((_, e))) => {
                warn!(error = %e, purpose = purpose.as_str(), "lost the lease of the pool consumers' settings");
                self.revision = None;
            }
            (_, Err((_, e))) => {
                debug!(error = %e, "the lease of the pool consumers' settings is held elsewhere");
                self.revision = None;
            }
        }
        renewal.holding()
    }

    /// The lease key's revision when its latest write is this instance's own.
    async fn own_revision(&self, store: &kv::Store) -> Option<u64> {
        let entry = store.entry(POOL_CONSUMERS_LEASE).await.ok().flatten()?;
        (entry.operation == kv::Operation::Put && entry.value == self.holder.as_bytes())
            .then_some(entry.revision)
    }

    /// Ends the lease at once, so another instance takes it on its next round.
    async fn release(self) {
        if let Some(revision) = self.revision
            && let Ok(store) = self.bucket.store().await
            && let Err(e) = store
                .delete_expect_revision(POOL_CONSUMERS_LEASE, Some(revision))
                .await
        {
            debug!(error = %e, "cannot end the lease; it expires");
        }
    }
}

/// Holds or tries to take the lease every [`ROUND`] until `shutdown`; while held, brings
/// every pool's consumer in line each round, at once when a revision is swapped in or
/// a pool's state changes. Ends the lease on the way out.
pub(crate) async fn own_pool_consumers(tasks: PoolTasks, shutdown: CancellationToken) {
    let (holding, held) = tokio::sync::watch::channel(false);
    tokio::join!(
        hold_and_write(tasks.clone(), holding, shutdown.clone()),
        super::oversight::oversee(tasks.clone(), held, shutdown.clone()),
        super::oversight::report(tasks, shutdown),
    );
}

/// The owner's loop: the lease, and the consumers' settings while it is held;
/// `holding` tells the breaker's judge whether it is.
async fn hold_and_write(
    tasks: PoolTasks,
    holding_now: tokio::sync::watch::Sender<bool>,
    shutdown: CancellationToken,
) {
    let mut revisions = tasks.revisions.clone();
    let mut states = tasks.control.states();
    let mut interval = tokio::time::interval(ROUND);
    let mut lease: Option<Lease> = None;
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            changed = revisions.changed() => if changed.is_err() { break },
            changed = states.changed() => if changed.is_err() { break },
            _ = shutdown.cancelled() => break,
        }
        let shared = tasks.current();
        let (js, settings, metrics) = (&shared.js, &shared.settings, tasks.control.metrics());
        let lease = lease.get_or_insert_with(|| Lease {
            bucket: StateBucket::new(
                js.clone(),
                Bucket::Instances.spec(&settings.subjects, &settings.streams),
            ),
            holder: instances::instance_id(),
            revision: None,
        });
        let holding = lease.hold(Purpose::Round).await;
        report_holding(metrics, &holding_now, holding);
        // Writes computed before the pools' state is read could undo it.
        if !holding || !tasks.control.loaded() {
            continue;
        }
        let current = states.borrow_and_update().clone();
        let Ok(store) = lease.bucket.store().await else {
            continue;
        };
        let mut pacing = LivePacing { store, read: None };
        for (pool, config) in &settings.cluster.pools {
            let state = current.get(pool).cloned().unwrap_or_default();
            if !bring_in_line(&tasks, &shared, lease, pool, config, &state, &mut pacing).await {
                report_holding(metrics, &holding_now, false);
                break;
            }
        }
    }
    tasks.control.metrics().set_pool_consumers_owner(false);
    holding_now.send_replace(false);
    if let Some(lease) = lease {
        lease.release().await;
    }
}

/// Shows whether this instance holds the lease: the gauge, and the breaker's judge.
fn report_holding(
    metrics: &Metrics,
    holding_now: &tokio::sync::watch::Sender<bool>,
    holding: bool,
) {
    metrics.set_pool_consumers_owner(holding);
    holding_now.send_if_modified(|held| std::mem::replace(held, holding) != holding);
}

/// Whether a pool consumer's `ack_wait` may go from `current` to `new` (pure): an
/// increase at once; a decrease once every live instance paces its progress acks from
/// `new` or less. `live_instances_pacing` is what each live instance reports; one
/// that does not say (older than the report) is waited for.
pub(crate) fn may_apply(
    new: Duration,
    current: Duration,
    live_instances_pacing: &[Option<Duration>],
) -> bool {
    new >= current
        || live_instances_pacing
            .iter()
            .all(|pacing| pacing.is_some_and(|pacing| pacing <= new))
}

/// What the live instances pace from, read from their heartbeats at most once a round,
/// and only when a pool's `ack_wait` is to be lowered.
struct LivePacing {
    store: kv::Store,
    /// `Some(None)`: the read failed this round.
    read: Option<Option<Vec<Option<Duration>>>>,
}

impl LivePacing {
    async fn get(&mut self) -> Option<&[Option<Duration>]> {
        if self.read.is_none() {
            let read = match instances::reports(&self.store).await {
                // Instances in file mode report too (for `config push` and `pools
                // remove`), but are not waited for, as when they reported nothing: a
                // lowered ack_wait reaches them by a deploy, not by a push (docs/configuration.md).
                Ok(reports) => Some(
                    reports
                        .iter()
                        .filter(|r| !r.runs_file_mode())
                        .map(|r| r.pacing_ack_wait())
                        .collect(),
                ),
                Err(e) => {
                    warn!(error = %e, "cannot read the instances' heartbeats; a lower ack_wait waits");
                    None
                }
            };
            self.read = Some(read);
        }
        self.read.as_ref().and_then(|read| read.as_deref())
    }
}

/// Writes to `pool`'s work consumer what [`consumer_writes`] says it lacks, holding
/// a lower `ack_wait` back until [`may_apply`] allows it, and each write only after
/// `lease` was confirmed by compare-and-set; whether the lease is still held. A
/// consumer that is not there is left to provisioning and the pull loop, which create
/// it (and know when not to: a pool being removed).
async fn bring_in_line(
    tasks: &PoolTasks,
    shared: &PoolRevision,
    lease: &mut Lease,
    pool: &str,
    config: &PoolConfig,
    state: &PoolState,
    pacing: &mut LivePacing,
) -> bool {
    let (js, settings, metrics) = (&shared.js, &shared.settings, tasks.control.metrics());
    let name = settings.subjects.pool_consumer(pool);
    let stream = match js
        .get_stream_no_info(settings.subjects.pool_stream(pool))
        .await
    {
        Ok(stream) => stream,
        Err(e) => {
            debug!(pool, error = %e, "no pool stream; nothing to bring in line");
            return true;
        }
    };
    let current = match stream.consumer_info(&name).await {
        Ok(info) => info.config,
        Err(e) => {
            debug!(pool, error = %e, "no pool consumer; nothing to bring in line");
            return true;
        }
    };
    let mut wanted = pool_consumer_config(settings, pool, config, state);
    if wanted.ack_wait < current.ack_wait {
        let lowered = pacing
            .get()
            .await
            .is_some_and(|live| may_apply(wanted.ack_wait, current.ack_wait, live));
        if !lowered {
            info!(
                pool,
                ack_wait = %human(wanted.ack_wait),
                current = %human(current.ack_wait),
                "a lower ack_wait waits until every live instance paces from it"
            );
            wanted.ack_wait = current.ack_wait;
        }
    }
    let paused_until = state.paused_until(webproxy_jetstream::clock::now_utc());
    // The owner lifts no pause that was never in the pool's state (one made through
    // the API by hand stays); one that left the state before its end it lifts, since
    // the writer that ended it may not have (a lost bucket) or its own round may have
    // written it again from the state it had before.
    // Like every consumer write, made only while the lease is still this instance's;
    // a lift that cannot be made is noted again for the next round.
    if paused_until.is_none()
        && current.pause_until.is_some()
        && tasks.control.take_forgotten_pause(pool)
    {
        if !lease.hold(Purpose::BeforeWrite).await {
            tasks.control.note_lifted_pauses([pool.to_string()]);
            return false;
        }
        match shared.pauses().lift_pause(pool).await {
            Ok(()) => info!(
                pool,
                "lifted the consumer pause that the pool state no longer holds"
            ),
            Err(e) => {
                tasks.control.note_lifted_pauses([pool.to_string()]);
                warn!(pool, error = %e, "cannot lift the consumer pause that the pool state no longer holds")
            }
        }
    }
    for write in consumer_writes(&current, &wanted, paused_until) {
        crate::hooks::owner_waits_before_write().await;
        // The round's check may be seconds old (a slow server, a paused process): a
        // write is made only while this instance's last lease write is still the
        // key's latest.
        if !lease.hold(Purpose::BeforeWrite).await {
            warn!(
                pool,
                %write,
                "not writing the pool consumer: the lease is no longer this instance's"
            );
            return false;
        }
        let written = match write {
            ConsumerWrite::Update => stream
                .update_consumer(wanted.clone())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            ConsumerWrite::Pause(until) => stream
                .pause_consumer(&name, until)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
        };
        match written {
            Ok(()) => {
                info!(
                    pool,
                    %write,
                    max_ack_pending = wanted.max_ack_pending,
                    "pool consumer brought in line"
                );
                metrics.pool_consumer_written(pool, write.kind());
            }
            Err(e) => {
                warn!(pool, %write, error = %e, "cannot bring the pool consumer in line; trying again next round")
            }
        }
    }
    true
}

#[cfg(test)]
mod tests;
