//! Progress records: one per conversation and generation that parked or moved, in a
//! JetStream KV bucket keyed `<STREAM>.<seq>.<generation>`. A record holds the whole
//! next hop and is written with compare-and-set before that hop is published, so a
//! conversation has one attempt line however its acks are lost: a delivery that is not
//! the current, untaken step does nothing but ack.
//!
//! The same bucket holds the replay markers, `replayed.<STREAM>.<seq>.<generation>`:
//! one per generation that `dead replay` started, created before its hop is published
//! and never deleted at settle, so that a letter is replayed once (see [`replayed_key`]).

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv::{self, Operation};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tracing::{info, warn};
use webproxy_protocol::Origin;

use crate::conversation::hop::{HopKind, HopState};
use crate::observability::health::Health;
use webproxy_jetstream::backoff::Backoff;
use webproxy_jetstream::state::{PROGRESS_MARKER_TTL, StateBucket};

/// The next hop of a conversation, as recorded before it is published.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Record {
    pub(crate) kind: HopKind,
    /// Where the hop is published, and under which message id: a republish after a
    /// crash reuses both exactly.
    pub(crate) subject: String,
    pub(crate) msg_id: String,
    /// The hop's state, its step among it.
    pub(crate) hop: HopState,
    /// The stream sequence of the hop message that started this step, once one has.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) taken_by: Option<u64>,
}

impl Record {
    pub(crate) fn step(&self) -> u32 {
        self.hop.step
    }
}

/// What a delivery at `step`, stored at stream sequence `seq`, may do given the
/// conversation's record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepClaim {
    /// This delivery is the recorded step: it carries on (taking the step first when
    /// no delivery has yet).
    Current { take: bool },
    /// The conversation went on without this delivery, and its recorded hop may not
    /// have been published (a crash between the record and the publish): publish it
    /// again, with its own message id, then ack.
    Republish,
    /// Another delivery holds the current step: ack and do nothing else.
    Stale,
}

/// Decides a delivery's claim on its conversation's record (pure).
pub(crate) fn claim(record: &Record, step: u32, seq: u64) -> StepClaim {
    match record.taken_by {
        _ if record.step() != step => {
            if record.taken_by.is_none() {
                StepClaim::Republish
            } else {
                StepClaim::Stale
            }
        }
        None => StepClaim::Current { take: true },
        Some(taker) if taker == seq => StepClaim::Current { take: false },
        Some(_) => StepClaim::Stale,
    }
}

/// The replay marker's key for `origin`'s `generation`:
/// `replayed.<STREAM>.<seq>.<generation>`. It has four tokens where a record key has
/// three, so the two never meet, and only characters KV keys allow.
pub(crate) fn replayed_key(origin: &Origin, generation: u64) -> String {
    format!("replayed.{}", origin.record_key(generation))
}

/// The attempt claim's key of the message stored at `seq` in `stream`:
/// `attempt.<STREAM>.<seq>` (see `attempt_claim`). Never a record's key, whose second
/// token is a number, nor a replay marker's, which has four tokens.
pub(crate) fn attempt_key(stream: &str, seq: u64) -> String {
    format!("attempt.{stream}.{seq}")
}

/// What an attempt claim holds: the server's delivery count of the delivery holding it.
#[derive(Debug, Serialize, Deserialize)]
struct AttemptHolder {
    delivered: u64,
}

/// Who holds a message's attempt claim after [`Progress::take_attempt`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Taken {
    /// This delivery, at the claim's revision.
    Held { revision: u64 },
    /// Another delivery of the message, delivered that many times (`None`: it took the
    /// claim between this delivery's read and its write).
    Busy { delivered: Option<u64> },
}

/// What a replay marker holds: which hop started the generation, and when. Nothing
/// reads it back but an operator looking into the bucket; the key's existence is the
/// marker.
#[derive(Debug, Serialize)]
struct Marker<'a> {
    msg_id: &'a str,
    replayed_ms: u64,
}

/// A progress-record operation failed.
#[derive(Debug, Error)]
pub enum ProgressError {
    /// Another writer changed the record first.
    #[error("the progress record {key} changed meanwhile")]
    Conflict { key: String },
    /// The record holds something the service did not write.
    #[error("the progress record {key} is unreadable: {reason}")]
    Unreadable { key: String, reason: String },
    #[error("progress record {key}: {source}")]
    Nats {
        key: String,
        #[source]
        source: async_nats::Error,
    },
}

/// The progress bucket, as the service or an operator command reaches it.
#[derive(Debug, Clone)]
pub(crate) struct Progress {
    handle: Handle,
}

#[derive(Debug, Clone)]
enum Handle {
    /// The service's: made again when the server confirms it gone, and every failed read
    /// or write (a settled record's purge excepted)
    /// operation retried while the delivery's progress acks hold the message (the
    /// server's delivery count cannot be undone, so waiting on the service's own store
    /// must not count as a crash). After [`STUCK_AFTER`] of failures the pool's
    /// readiness says so.
    Service {
        bucket: StateBucket,
        health: Arc<Health>,
    },
    /// An operator command's: the bucket it opened, one try per operation, and an
    /// error for the operator to read. Boxed: a store is large, and a handle is
    /// cloned into every outlet.
    Operator(Box<kv::Store>),
}

/// Retries of a progress operation, or of another lookup of the service's own state
/// that a held delivery waits on: 100 ms more per failure, at most 2 s apart.
pub(crate) const RETRY: Backoff =
    Backoff::linear(Duration::from_millis(100), Duration::from_secs(2));

/// How long progress operations may keep failing before `/readyz` turns 503: longer
/// than a leader election, and with [`RETRY`] well within 10 s.
const STUCK_AFTER: Duration = Duration::from_secs(3);

/// The key `/readyz`'s reasons keep a stuck progress bucket under.
const STUCK_KEY: &str = "progress";

fn nats_error(key: &str, source: impl Into<async_nats::Error>) -> ProgressError {
    ProgressError::Nats {
        key: key.to_string(),
        source: source.into(),
    }
}

/// A failed compare-and-set write: `Conflict` when another writer won it (`lost`),
/// otherwise the NATS error, which the service's handle retries.
fn write_error(key: &str, lost: bool, source: impl Into<async_nats::Error>) -> ProgressError {
    if lost {
        ProgressError::Conflict {
            key: key.to_string(),
        }
    } else {
        nats_error(key, source)
    }
}

fn encode(value: &impl Serialize) -> Bytes {
    // Strings, numbers and records only: serializing cannot fail.
    Bytes::from(serde_json::to_vec(value).unwrap_or_default())
}

impl Progress {
    /// The service's progress bucket.
    pub(crate) fn new(bucket: StateBucket, health: Arc<Health>) -> Progress {
        Progress {
            handle: Handle::Service { bucket, health },
        }
    }

    /// An operator command's progress bucket.
    pub(crate) fn operator(store: kv::Store) -> Progress {
        Progress {
            handle: Handle::Operator(Box::new(store)),
        }
    }

    /// Runs `operation` on the bucket: once for an operator; for the service, again
    /// after every failure to reach the bucket, reopening it in between.
    async fn run<T, F>(
        &self,
        key: &str,
        operation: impl Fn(kv::Store) -> F,
    ) -> Result<T, ProgressError>
    where
        F: Future<Output = Result<T, ProgressError>>,
    {
        let (bucket, health) = match &self.handle {
            Handle::Operator(store) => return Box::pin(operation(kv::Store::clone(store))).await,
            Handle::Service { bucket, health } => (bucket, health),
        };
        let mut failures = 0u32;
        let mut failing_since = None;
        loop {
            let result = match bucket.store().await {
                _ if crate::hooks::progress_outage() => {
                    Err(nats_error(key, "test hook: the progress bucket is out"))
                }
                // Boxed: a key-value operation's future is kilobytes, which every
                // handler that may await one (most never do) would otherwise carry and
                // move (issue 33).
                Ok(store) => Box::pin(operation(store)).await,
                Err(e) => Err(nats_error(key, e)),
            };
            let error = match result {
                Err(error @ ProgressError::Nats { .. }) => error,
                done => {
                    if failures > 0 {
                        health.set_stuck(STUCK_KEY, None);
                        info!(key, failures, "the progress bucket answers again");
                    }
                    return done;
                }
            };
            failures = failures.saturating_add(1);
            warn!(key, error = %error, failures, "a progress record operation failed; retrying while the message is held");
            bucket.reopen().await;
            let since = *failing_since.get_or_insert_with(tokio::time::Instant::now);
            if since.elapsed() >= STUCK_AFTER {
                health.set_stuck(
                    STUCK_KEY,
                    Some(format!(
                        "progress records in {} unreachable for {} s: {error}",
                        bucket.spec().name,
                        since.elapsed().as_secs()
                    )),
                );
            }
            tokio::time::sleep(RETRY.after(failures).unwrap_or(Duration::from_secs(2))).await;
        }
    }

    /// The record of `origin`'s `generation` and its revision, if one exists. A
    /// deleted record reads as none; a lookup that fails is an error, never "none".
    pub(crate) async fn load(
        &self,
        origin: &Origin,
        generation: u64,
    ) -> Result<Option<(Record, u64)>, ProgressError> {
        let key = origin.record_key(generation);
        let entry = self
            .run(&key, |store| {
                let key = key.clone();
                async move { store.entry(&key).await.map_err(|e| nats_error(&key, e)) }
            })
            .await?;
        let Some(entry) = entry else {
            return Ok(None);
        };
        if entry.operation != Operation::Put {
            return Ok(None);
        }
        let record =
            serde_json::from_slice(&entry.value).map_err(|e| ProgressError::Unreadable {
                key: key.clone(),
                reason: e.to_string(),
            })?;
        Ok(Some((record, entry.revision)))
    }

    /// Writes `record` for its conversation: created when `revision` is `None` (it must
    /// not exist), else updated only if the record is still at `revision`. Returns the
    /// new revision.
    pub(crate) async fn write(
        &self,
        record: &Record,
        revision: Option<u64>,
    ) -> Result<u64, ProgressError> {
        let key = record.hop.origin.record_key(record.hop.generation);
        let value = encode(record);
        match revision {
            None => self.create(&key, value).await,
            Some(revision) => {
                self.run(&key, |store| {
                    let (key, value) = (key.clone(), value.clone());
                    async move {
                        store.update(&key, value, revision).await.map_err(|e| {
                            let lost = e.kind() == kv::UpdateErrorKind::WrongLastRevision;
                            write_error(&key, lost, e)
                        })
                    }
                })
                .await
            }
        }
    }

    /// Marks `origin`'s `generation` as replayed by the hop `msg_id`, at `replayed_ms`
    /// (Unix ms). A create: `Conflict` means that generation was replayed already (or
    /// is being replayed now). The marker is never deleted; the bucket's age limit, at
    /// least `dead_max_age`, ends it after the letter it was replayed from.
    pub(crate) async fn mark_replayed(
        &self,
        origin: &Origin,
        generation: u64,
        msg_id: &str,
        replayed_ms: u64,
    ) -> Result<(), ProgressError> {
        let key = replayed_key(origin, generation);
        let marker = Marker {
            msg_id,
            replayed_ms,
        };
        self.create(&key, encode(&marker)).await.map(|_| ())
    }

    /// Creates `key`, which must not exist (`Conflict` when it does); returns its
    /// revision.
    async fn create(&self, key: &str, value: Bytes) -> Result<u64, ProgressError> {
        self.run(key, |store| {
            let (key, value) = (key.to_string(), value.clone());
            async move {
                store.create(&key, value).await.map_err(|e| {
                    let lost = e.kind() == kv::CreateErrorKind::AlreadyExists;
                    write_error(&key, lost, e)
                })
            }
        })
        .await
    }

    /// Takes the attempt claim `key` for a delivery delivered `delivered` times, for
    /// `ttl`, unless another delivery holds it. Retried like the other operations.
    pub(crate) async fn take_attempt(
        &self,
        key: &str,
        delivered: u64,
        ttl: Duration,
    ) -> Result<Taken, ProgressError> {
        let bucket = self.service_bucket(key)?;
        let value = encode(&AttemptHolder { delivered });
        self.run(key, |store| {
            let (key, value) = (key.to_string(), value.clone());
            async move {
                let entry = store.entry(&key).await.map_err(|e| nats_error(&key, e))?;
                let expected = match entry {
                    Some(entry) if entry.operation == Operation::Put => {
                        let holder = serde_json::from_slice::<AttemptHolder>(&entry.value);
                        return Ok(Taken::Busy {
                            delivered: holder.ok().map(|holder| holder.delivered),
                        });
                    }
                    // Released: written on top of the purge's marker.
                    Some(entry) => entry.revision,
                    None => 0,
                };
                match bucket
                    .put_expecting(&store, &key, value, expected, ttl)
                    .await
                {
                    Ok(Some(revision)) => Ok(Taken::Held { revision }),
                    Ok(None) => Ok(Taken::Busy { delivered: None }),
                    Err(e) => Err(nats_error(&key, e)),
                }
            }
        })
        .await
    }

    /// Renews the attempt claim `key`, held at `revision`, for another `ttl`: its new
    /// revision, or `None` when it is no longer at `revision` (it lapsed, and maybe
    /// another delivery took it). One try: the claim's keeper decides what a failure
    /// means.
    pub(crate) async fn renew_attempt(
        &self,
        key: &str,
        delivered: u64,
        revision: u64,
        ttl: Duration,
    ) -> Result<Option<u64>, ProgressError> {
        let (bucket, store) = self.service_store(key).await?;
        let value = encode(&AttemptHolder { delivered });
        bucket
            .put_expecting(&store, key, value, revision, ttl)
            .await
            .map_err(|e| nats_error(key, e))
    }

    /// Releases the attempt claim `key` held at `revision`, once its delivery is
    /// settled: a purge whose marker expires like a settled record's. One try; a claim
    /// left behind lapses after its TTL.
    pub(crate) async fn release_attempt(
        &self,
        key: &str,
        revision: u64,
    ) -> Result<(), ProgressError> {
        let (_, store) = self.service_store(key).await?;
        store
            .purge_expect_revision_with_ttl(key, revision, PROGRESS_MARKER_TTL)
            .await
            .map_err(|e| nats_error(key, e))
    }

    /// The service's bucket and its handle now, for the one-try claim operations.
    async fn service_store(&self, key: &str) -> Result<(&StateBucket, kv::Store), ProgressError> {
        let bucket = self.service_bucket(key)?;
        let store = bucket.store().await.map_err(|e| nats_error(key, e))?;
        Ok((bucket, store))
    }

    /// The service's bucket; attempt claims are the service's alone.
    fn service_bucket(&self, key: &str) -> Result<&StateBucket, ProgressError> {
        match &self.handle {
            Handle::Service { bucket, .. } => Ok(bucket),
            Handle::Operator(_) => Err(nats_error(
                key,
                "an operator command holds no attempt claims",
            )),
        }
    }

    /// Whether `origin`'s `generation` carries a replay marker. A lookup that fails is
    /// an error, never "no".
    pub(crate) async fn is_replayed(
        &self,
        origin: &Origin,
        generation: u64,
    ) -> Result<bool, ProgressError> {
        let key = replayed_key(origin, generation);
        let entry = self
            .run(&key, |store| {
                let key = key.clone();
                async move { store.entry(&key).await.map_err(|e| nats_error(&key, e)) }
            })
            .await?;
        Ok(entry.is_some_and(|entry| entry.operation == Operation::Put))
    }

    /// Removes the record of a conversation that settled. A KV delete or purge always
    /// leaves a marker; this one is a purge whose marker expires after
    /// [`PROGRESS_MARKER_TTL`] (the bucket allows per-message TTLs), so settled
    /// conversations leave nothing behind for long. One try, unlike the other
    /// operations: the conversation is answered already, the bucket's age limit removes
    /// a record left behind, and a settled delivery must not hold its slot for it.
    pub(crate) async fn delete(
        &self,
        origin: &Origin,
        generation: u64,
    ) -> Result<(), ProgressError> {
        let key = origin.record_key(generation);
        let store = match &self.handle {
            Handle::Operator(store) => kv::Store::clone(store),
            Handle::Service { bucket, .. } => {
                bucket.store().await.map_err(|e| nats_error(&key, e))?
            }
        };
        let purged = store.purge_with_ttl(&key, PROGRESS_MARKER_TTL).await;
        if purged.is_err()
            && let Handle::Service { bucket, .. } = &self.handle
        {
            // Looked up again by the next operation, and made again if it is gone.
            bucket.reopen().await;
        }
        purged.map_err(|e| nats_error(&key, e))
    }
}

#[cfg(test)]
mod tests;
