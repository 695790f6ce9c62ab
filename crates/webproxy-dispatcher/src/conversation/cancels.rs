//! The cancels a delivery asks about: conversations a caller or an operator took back.
//! `crate::cancel` answers `<prefix>.cancel` and `<prefix>.admin.cancel` and records a
//! cancel in the cancels bucket, keyed `<STREAM>.<seq>.<generation>`, before it says
//! `recorded`. Every instance follows the bucket into memory ([`Cancels`]): a delivery
//! looks its conversation up there when it starts (no lookup per delivery, no NATS
//! operation) and is woken if a cancel comes while it runs, so the next delivery of a
//! cancelled conversation, or the one in flight, ends it. Settle removes the record of
//! the generation it ends.

use std::collections::{HashMap, HashSet};
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
    pub(crate) by: By,
}

/// The error a cancelled conversation is answered and dead-lettered with. `attempts`
/// were made before (one of them dropped in flight when `in_flight`); a delivery made
/// again (`redelivered`) may follow one whose attempt was never recorded.
pub(crate) fn cancelled_error(
    by: By,
    attempts: u32,
    in_flight: bool,
    redelivered: bool,
) -> ErrorBody {
    let who = match by {
        By::Caller => "the caller",
        By::Operator => "an operator",
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
        message: format!("cancelled by {who} {what}"),
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
}

#[derive(Debug, Default)]
struct Known {
    /// Recorded cancels by key, with when they were written (the bucket's age limit
    /// removes a record without telling the watch).
    recorded: HashMap<String, (Recorded, SystemTime)>,
    /// Deliveries under way by key: the token wakes them, the count is how many
    /// hold it.
    watching: HashMap<String, (CancellationToken, usize)>,
}

impl Cancels {
    /// The cancels of the bucket `bucket`.
    pub(crate) fn new(bucket: StateBucket) -> Cancels {
        Cancels {
            bucket: Some(bucket),
            known: Mutex::default(),
        }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Follows the bucket until `shutdown`.
    pub(crate) async fn follow(self: &Arc<Self>, shutdown: CancellationToken) {
        let Some(bucket) = &self.bucket else { return };
        let open = || async { bucket.store().await.map_err(|e| e.to_string()) };
        let mut follower = CancelsFollower {
            cancels: self,
            max_age: bucket.spec().max_age,
        };
        follow(
            &bucket.spec().name,
            open,
            WATCH_CHECK,
            &mut follower,
            &shutdown,
        )
        .await;
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
        let value = serde_json::to_vec(&Recorded { by }).unwrap_or_default();
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
        if !watch.is_cancelled() {
            return;
        }
        let Some(bucket) = &self.bucket else { return };
        let purged = match bucket.store().await {
            Ok(store) => store
                .purge_with_ttl(&watch.key, PROGRESS_MARKER_TTL)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = purged {
            bucket.reopen().await;
            warn!(key = watch.key, error = %e, "cannot remove the cancel of a settled conversation; it ages out");
        }
    }

    fn apply(&self, key: &str, recorded: Option<(Recorded, SystemTime)>) {
        let mut known = self.known();
        match recorded {
            Some(recorded) => {
                if let Some((token, _)) = known.watching.get(key) {
                    debug!(key, "a delivery under way is cancelled");
                    token.cancel();
                }
                known.recorded.insert(key.to_string(), recorded);
            }
            None => {
                known.recorded.remove(key);
            }
        }
    }
}

/// How often the cancels' watch is checked against the bucket's last write (and old
/// records are let go).
const WATCH_CHECK: Duration = Duration::from_secs(5);

/// The cancels as the watch brings them.
struct CancelsFollower<'a> {
    cancels: &'a Cancels,
    max_age: Duration,
}

impl Follower for CancelsFollower<'_> {
    fn apply(&mut self, entry: &kv::Entry) {
        let recorded = (entry.operation == kv::Operation::Put).then(|| {
            // Only the service writes the bucket; a record it cannot read is still a
            // cancel (the key is what counts), taken as the operator's.
            let recorded =
                serde_json::from_slice(&entry.value).unwrap_or(Recorded { by: By::Operator });
            (recorded, SystemTime::from(entry.created))
        });
        self.cancels.apply(&entry.key, recorded);
    }

    fn history_read(&mut self, seen: HashSet<String>) {
        self.cancels
            .known()
            .recorded
            .retain(|key, _| seen.contains(key));
    }

    fn tick(&mut self) {
        let now = SystemTime::now();
        let max_age = self.max_age;
        self.cancels.known().recorded.retain(|_, (_, written)| {
            max_age.is_zero() || now.duration_since(*written).unwrap_or_default() < max_age
        });
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
    /// Who cancelled, once a cancel is recorded.
    pub(crate) fn by(&self) -> Option<By> {
        if !self.token.is_cancelled() {
            return None;
        }
        let known = self.cancels.known();
        Some(
            known
                .recorded
                .get(&self.key)
                .map_or(By::Operator, |(r, _)| r.by),
        )
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

    #[test]
    fn a_cancel_wakes_the_delivery_of_its_generation_only() {
        let cancels = Arc::new(Cancels::default());
        let current = cancels.watch(&origin(), 1);
        let earlier = cancels.watch(&origin(), 0);
        assert!(!current.is_cancelled());
        let key = origin().record_key(1);
        cancels.apply(&key, Some((Recorded { by: By::Caller }, SystemTime::now())));
        assert!(current.is_cancelled(), "the delivery under way is woken");
        assert_eq!(current.by(), Some(By::Caller));
        assert!(!earlier.is_cancelled(), "another generation is not");
        let next = cancels.watch(&origin(), 1);
        assert!(next.is_cancelled(), "a later delivery finds it at once");
        drop((current, earlier, next));
        assert!(
            cancels.known().watching.is_empty(),
            "nothing is kept without a delivery"
        );
        cancels.apply(&key, None);
        assert!(
            !cancels.watch(&origin(), 1).is_cancelled(),
            "a removed record cancels nothing"
        );
    }

    #[test]
    fn the_error_says_who_cancelled_and_whether_the_upstream_may_have_acted() {
        let waiting = cancelled_error(By::Caller, 0, false, false);
        assert_eq!(waiting.code, ErrorCode::Cancelled);
        assert_eq!(
            waiting.message,
            "cancelled by the caller before any attempt"
        );
        let parked = cancelled_error(By::Operator, 2, false, false);
        assert!(
            parked
                .message
                .starts_with("cancelled by an operator while waiting")
        );
        assert!(parked.message.contains("2 attempt(s)"));
        let in_flight = cancelled_error(By::Caller, 1, true, false);
        assert!(
            in_flight.message.contains("dropped"),
            "{}",
            in_flight.message
        );
        let redelivered = cancelled_error(By::Caller, 0, false, true);
        assert!(redelivered.message.contains("may have called the upstream"));
    }
}
