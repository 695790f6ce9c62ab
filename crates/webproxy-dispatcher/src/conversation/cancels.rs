//! The cancels a delivery asks about: conversations a caller or an operator took back.
//! `crate::cancel` answers `<prefix>.cancel` and `<prefix>.admin.cancel` and records a
//! cancel in the cancels bucket, keyed `<STREAM>.<seq>.<generation>`, before it says
//! `recorded`. Every instance follows the bucket into memory ([`Cancels`]): a delivery
//! looks its conversation up there when it starts (no lookup per delivery, no NATS
//! operation) and is woken if a cancel comes while it runs, so the next delivery of a
//! cancelled conversation, or the one in flight, ends it. Settle removes the record of
//! the generation it ends.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv;
use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};
use webproxy_jetstream::follow::{Follower, follow};
use webproxy_jetstream::state::{PROGRESS_MARKER_TTL, StateBucket};
use webproxy_protocol::{ErrorBody, ErrorCode, Origin};

/// Who took the conversation back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum By {
    /// The caller, showing the message id it published with.
    Caller,
    /// An operator, on `<prefix>.admin.cancel`.
    Operator,
}

/// What the bucket keeps of a cancel.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub(crate) struct Recorded {
    pub(crate) by: Option<By>,
}

/// The error a cancelled conversation is answered and dead-lettered with, cancelled
/// `by` whom when this instance knows. `attempts` were made before (one of them
/// dropped in flight when `in_flight`); a delivery made again (`redelivered`) may
/// follow one whose attempt was never recorded.
pub(crate) fn cancelled_error(
    by: Option<By>,
    attempts: u32,
    in_flight: bool,
    redelivered: bool,
) -> ErrorBody {
    let who = match by {
        Some(By::Caller) => " by the caller",
        Some(By::Operator) => " by an operator",
        None => "",
    };
    let what = match (attempts, in_flight) {
        (_, true) => format!(
            "the attempt in flight was dropped ({attempts} attempt(s) made): the upstream may have acted"
        ),
        (0, false) if redelivered => {
            "before any recorded attempt; an earlier delivery of it may have called the upstream"
                .to_string()
        }
        (0, false) => "before any attempt".to_string(),
        (n, false) => format!(
            "while waiting for its next attempt ({n} attempt(s) made): the upstream may have acted"
        ),
    };
    ErrorBody {
        code: ErrorCode::Cancelled,
        message: format!("cancelled{who} {what}"),
        status: None,
    }
}

/// The cancels this instance knows of, as the bucket's watch brings them, and the
/// deliveries under way that a cancel wakes.
#[derive(Debug, Default)]
pub(crate) struct Cancels {
    /// The service's bucket; none for an operator command's outlet, which follows none.
    bucket: Option<StateBucket>,
    known: Mutex<Known>,
    /// The watch has read the bucket's history and is not known to be lost since:
    /// while it is not, a delivery asks the bucket itself (`Cancels::catch_up`).
    synced: AtomicBool,
    /// Records of settled generations whose removal failed, to try again.
    unremoved: Mutex<Vec<String>>,
}

/// The most records whose removal failed that are kept to try again.
const MAX_UNREMOVED: usize = 10_000;

/// A cancel this instance knows of.
#[derive(Debug, Clone, Copy)]
struct KnownCancel {
    /// Who cancelled, when the record said (an ended one seen only as its removal
    /// does not).
    by: Option<By>,
    /// When it was written, or seen removed: the bucket's age limit removes a record
    /// without telling the watch, and an ended one is kept [`ENDED_KEPT`].
    at: SystemTime,
    /// Its generation settled (the record was removed): any delivery of it still to
    /// come is one that lagged (a pod stalled with it unread) and ends it too.
    ended: bool,
}

/// How long a cancel whose generation settled is kept in memory: a delivery of that
/// generation read by a pod that stalled for less than this still ends cancelled
/// rather than calling the upstream.
const ENDED_KEPT: Duration = Duration::from_secs(600);

#[derive(Debug, Default)]
struct Known {
    /// Recorded cancels by key.
    recorded: HashMap<String, KnownCancel>,
    /// Deliveries under way by key: the token wakes them, the count is how many
    /// hold it.
    watching: HashMap<String, (CancellationToken, usize)>,
}

impl Cancels {
    /// The cancels of the bucket `bucket`.
    pub(crate) fn new(bucket: StateBucket) -> Cancels {
        Cancels {
            bucket: Some(bucket),
            ..Cancels::default()
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Follows the bucket until `shutdown`, and removes again the records whose
    /// removal failed.
    pub(crate) async fn follow(self: &Arc<Self>, shutdown: CancellationToken) {
        let Some(bucket) = &self.bucket else { return };
        let open = || async { bucket.store().await.map_err(|e| e.to_string()) };
        let mut follower = CancelsFollower {
            cancels: self,
            max_age: bucket.spec().max_age,
        };
        let watched = follow(
            &bucket.spec().name,
            open,
            WATCH_CHECK,
            &mut follower,
            &shutdown,
        );
        let removed_again = async {
            let mut rounds = tokio::time::interval(WATCH_CHECK);
            loop {
                tokio::select! {
                    _ = rounds.tick() => {}
                    () = shutdown.cancelled() => return,
                }
                let keys = std::mem::take(&mut *self.unremoved());
                for key in keys {
                    self.remove(&key).await;
                }
            }
        };
        tokio::join!(watched, removed_again);
    }

    fn unremoved(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.unremoved
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Records a cancel of `origin`'s `generation`, stored once this returns `Ok`.
    pub(crate) async fn record(
        &self,
        origin: &Origin,
        generation: u64,
        by: By,
    ) -> Result<(), String> {
        let Some(bucket) = &self.bucket else {
            return Err("no cancels bucket".into());
        };
        let store = bucket.store().await.map_err(|e| e.to_string())?;
        let value = serde_json::to_vec(&Recorded { by: Some(by) }).unwrap_or_default();
        let key = origin.record_key(generation);
        if let Err(e) = store.put(&key, value.into()).await {
            bucket.reopen().await;
            return Err(format!("cannot record the cancel {key}: {e}"));
        }
        Ok(())
    }

    /// A delivery of `origin`'s `generation` starts: what it asks of its cancel until
    /// it is dropped.
    pub(crate) fn watch(self: &Arc<Self>, origin: &Origin, generation: u64) -> CancelWatch {
        let key = origin.record_key(generation);
        let mut known = self.known();
        let recorded = known.recorded.contains_key(&key);
        let (token, holders) = known
            .watching
            .entry(key.clone())
            .or_insert_with(|| (CancellationToken::new(), 0));
        *holders += 1;
        if recorded {
            token.cancel();
        }
        CancelWatch {
            token: token.clone(),
            cancels: self.clone(),
            key,
        }
    }

    /// Removes the record `watch` saw, once its generation settled. A record that
    /// cannot be removed goes with the bucket's age limit; it can cancel nothing, since
    /// its generation is over.
    pub(crate) async fn forget(&self, watch: &CancelWatch) {
        if watch.is_cancelled() {
            self.remove(&watch.key).await;
        }
    }

    /// Purges `key`'s record; one that cannot be purged now is tried again at the next
    /// round of [`Cancels::follow`] (at most [`MAX_UNREMOVED`] are kept for that; past
    /// them, and on a restart, a record goes with the bucket's age limit).
    async fn remove(&self, key: &str) {
        let Some(bucket) = &self.bucket else { return };
        let purged = match bucket.store().await {
            Ok(store) => store
                .purge_with_ttl(key, PROGRESS_MARKER_TTL)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = purged {
            bucket.reopen().await;
            warn!(key, error = %e, "cannot remove the cancel of a settled conversation; trying again");
            let mut unremoved = self.unremoved();
            if unremoved.len() < MAX_UNREMOVED {
                unremoved.push(key.to_string());
            }
        }
    }

    /// A key's record as the bucket now has it: `Some` a cancel recorded, `None` one
    /// removed when its generation settled (only settle removes one). Either way a
    /// delivery of that generation under way is woken: a removed one was answered by
    /// another delivery.
    fn apply(&self, key: &str, recorded: Option<Recorded>, at: SystemTime) {
        let mut known = self.known();
        if let Some((token, _)) = known.watching.get(key) {
            debug!(key, "a delivery under way is cancelled");
            token.cancel();
        }
        let by = match recorded {
            Some(recorded) => recorded.by,
            None => known.recorded.get(key).and_then(|k| k.by),
        };
        let ended = recorded.is_none();
        known
            .recorded
            .insert(key.to_string(), KnownCancel { by, at, ended });
    }

    /// Before a delivery while the watch is not in step with the bucket (starting, or
    /// lost): reads `origin`'s `generation` from the bucket itself, so a cancel the
    /// watch has not brought is not missed. A read that fails goes on without it (the
    /// watch brings the cancel once it is back, and wakes the delivery then).
    pub(crate) async fn catch_up(&self, origin: &Origin, generation: u64) {
        if self.synced.load(Ordering::Acquire) {
            return;
        }
        let Some(bucket) = &self.bucket else { return };
        let key = origin.record_key(generation);
        let read = async {
            let store = bucket.store().await.map_err(|e| e.to_string())?;
            store.entry(&key).await.map_err(|e| e.to_string())
        };
        match tokio::time::timeout(CATCH_UP_WITHIN, read).await {
            Ok(Ok(Some(entry))) => {
                let recorded = (entry.operation == kv::Operation::Put).then(|| read_record(&entry));
                self.apply(&key, recorded, SystemTime::from(entry.created));
            }
            Ok(Ok(None)) => {}
            Ok(Err(e)) => {
                debug!(key, error = %e, "cannot read a cancel while the watch is behind")
            }
            Err(_) => debug!(key, "no answer reading a cancel while the watch is behind"),
        }
    }
}

/// How often the cancels' watch is checked against the bucket's last write (and old
/// records are let go).
const WATCH_CHECK: Duration = Duration::from_secs(5);

/// The longest a delivery waits for [`Cancels::catch_up`].
const CATCH_UP_WITHIN: Duration = Duration::from_secs(1);

/// A record as the service writes it; one it cannot read is still a cancel (the key is
/// what counts), by whom unknown.
fn read_record(entry: &kv::Entry) -> Recorded {
    serde_json::from_slice(&entry.value).unwrap_or(Recorded { by: None })
}

/// The cancels as the watch brings them.
struct CancelsFollower<'a> {
    cancels: &'a Cancels,
    max_age: Duration,
}

impl Follower for CancelsFollower<'_> {
    fn apply(&mut self, entry: &kv::Entry) {
        let recorded = (entry.operation == kv::Operation::Put).then(|| read_record(entry));
        self.cancels
            .apply(&entry.key, recorded, SystemTime::from(entry.created));
    }

    /// A recorded cancel the bucket no longer has is gone (a lost bucket); an ended one
    /// is kept its while, being a fact about a generation that is over.
    fn history_read(&mut self, seen: HashSet<String>) {
        self.cancels
            .known()
            .recorded
            .retain(|key, known| known.ended || seen.contains(key));
        self.cancels.synced.store(true, Ordering::Release);
    }

    fn tick(&mut self) {
        let now = SystemTime::now();
        let max_age = self.max_age;
        self.cancels.known().recorded.retain(|_, known| {
            let age = now.duration_since(known.at).unwrap_or_default();
            if known.ended {
                age < ENDED_KEPT
            } else {
                max_age.is_zero() || age < max_age
            }
        });
    }

    fn lost(&mut self) {
        self.cancels.synced.store(false, Ordering::Release);
    }
}

/// A delivery's view of its conversation's cancel: whether one is recorded, and a wait
/// that ends when one is.
#[derive(Debug)]
pub(crate) struct CancelWatch {
    token: CancellationToken,
    cancels: Arc<Cancels>,
    key: String,
}

impl CancelWatch {
    /// Whether a cancel is recorded (or its generation ended after one), and who
    /// cancelled when this instance knows: `None` while there is none.
    pub(crate) fn by(&self) -> Option<Option<By>> {
        if !self.token.is_cancelled() {
            return None;
        }
        let known = self.cancels.known();
        Some(known.recorded.get(&self.key).and_then(|k| k.by))
    }

    /// Whether a cancel was recorded while this delivery ran (or before).
    pub(crate) fn is_cancelled(&self) -> bool {
        self.token.is_cancelled()
    }

    /// A token cancelled when a cancel is recorded.
    pub(crate) fn token(&self) -> CancellationToken {
        self.token.clone()
    }
}

impl Drop for CancelWatch {
    fn drop(&mut self) {
        let mut known = self.cancels.known();
        if let Some((_, holders)) = known.watching.get_mut(&self.key) {
            *holders -= 1;
            if *holders == 0 {
                known.watching.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> Origin {
        Origin::new("WEBPROXY_POOL_DEFAULT", 1_733_025_600_000_123)
    }

    fn follower(cancels: &Cancels) -> CancelsFollower<'_> {
        CancelsFollower {
            cancels,
            max_age: Duration::from_secs(3600),
        }
    }

    #[test]
    fn a_cancel_wakes_the_delivery_of_its_generation_only() {
        let cancels = Arc::new(Cancels::default());
        let current = cancels.watch(&origin(), 1);
        let earlier = cancels.watch(&origin(), 0);
        assert!(!current.is_cancelled());
        let key = origin().record_key(1);
        let by = Recorded {
            by: Some(By::Caller),
        };
        cancels.apply(&key, Some(by), SystemTime::now());
        assert!(current.is_cancelled(), "the delivery under way is woken");
        assert_eq!(current.by(), Some(Some(By::Caller)));
        assert!(!earlier.is_cancelled(), "another generation is not");
        let next = cancels.watch(&origin(), 1);
        assert!(next.is_cancelled(), "a later delivery finds it at once");
        drop((current, earlier, next));
        assert!(
            cancels.known().watching.is_empty(),
            "nothing is kept without a delivery"
        );
        // Settled by another delivery: one that lagged still ends, and knows by whom.
        cancels.apply(&key, None, SystemTime::now());
        let lagging = cancels.watch(&origin(), 1);
        assert_eq!(lagging.by(), Some(Some(By::Caller)));
        drop(lagging);
        // Kept a while, not for ever.
        if let Some(known) = cancels.known().recorded.get_mut(&key) {
            known.at -= ENDED_KEPT;
        }
        follower(&cancels).tick();
        assert!(
            !cancels.watch(&origin(), 1).is_cancelled(),
            "an old ended cancel is let go"
        );
    }

    #[test]
    fn a_lost_bucket_forgets_its_recorded_cancels_but_not_the_ended_ones() {
        let cancels = Arc::new(Cancels::default());
        let recorded = origin().record_key(0);
        let ended = origin().record_key(1);
        let by = Some(Recorded { by: None });
        cancels.apply(&recorded, by, SystemTime::now());
        cancels.apply(&ended, None, SystemTime::now());
        follower(&cancels).history_read(HashSet::new());
        assert!(!cancels.watch(&origin(), 0).is_cancelled());
        assert_eq!(cancels.watch(&origin(), 1).by(), Some(None));
    }

    #[test]
    fn a_delivery_asks_the_bucket_only_while_the_watch_is_behind() {
        let cancels = Cancels::default();
        let mut follower = follower(&cancels);
        assert!(
            !cancels.synced.load(Ordering::Acquire),
            "not before the history is read"
        );
        follower.history_read(HashSet::new());
        assert!(cancels.synced.load(Ordering::Acquire));
        follower.lost();
        assert!(
            !cancels.synced.load(Ordering::Acquire),
            "nor once the watch is lost"
        );
    }

    #[test]
    fn the_error_says_who_cancelled_and_whether_the_upstream_may_have_acted() {
        let waiting = cancelled_error(Some(By::Caller), 0, false, false);
        assert_eq!(waiting.code, ErrorCode::Cancelled);
        assert_eq!(
            waiting.message,
            "cancelled by the caller before any attempt"
        );
        let parked = cancelled_error(Some(By::Operator), 2, false, false);
        assert!(
            parked
                .message
                .starts_with("cancelled by an operator while waiting")
        );
        assert!(parked.message.contains("2 attempt(s)"));
        let in_flight = cancelled_error(Some(By::Caller), 1, true, false);
        assert!(
            in_flight.message.contains("dropped"),
            "{}",
            in_flight.message
        );
        let redelivered = cancelled_error(Some(By::Caller), 0, false, true);
        assert!(redelivered.message.contains("may have called the upstream"));
        let unknown = cancelled_error(None, 0, false, false);
        assert_eq!(unknown.message, "cancelled before any attempt");
    }
}
