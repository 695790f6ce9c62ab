//! Following a KV bucket into memory: a watch that starts with every key's latest
//! value, is made again when it is lost or falls behind the bucket, and says when its
//! history is read, so that a key the bucket no longer has (a bucket lost and made
//! again, a purge while no watch ran) is forgotten. Pool control follows the pools'
//! runtime state this way, and the dispatcher the recorded cancels.

use std::collections::HashSet;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt as _;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::backoff::PULL_BACKOFF;

/// What is kept in memory of a followed bucket.
pub trait Follower {
    /// A key's latest value or its deletion, in the bucket's order.
    fn apply(&mut self, entry: &kv::Entry);
    /// The watch's history is read: `seen` holds every key it had, so any other key
    /// kept here is gone from the bucket. Called once per watch, an empty bucket's too.
    fn history_read(&mut self, seen: HashSet<String>);
    /// Called at every check of the watch against the bucket.
    fn tick(&mut self) {}
    /// The watch could not be made, or was lost or fell behind: until the next
    /// `history_read`, what is kept may miss writes.
    fn lost(&mut self) {}
}

/// Follows the bucket `open` opens (named `label` in logs) into `follower` until
/// `shutdown`, checking the watch against the bucket every `check`.
pub async fn follow<O, F>(
    label: &str,
    open: O,
    check: Duration,
    follower: &mut impl Follower,
    shutdown: &CancellationToken,
) where
    O: Fn() -> F,
    F: Future<Output = Result<kv::Store, String>>,
{
    let mut failures = 0u32;
    loop {
        if failures > 0 && !PULL_BACKOFF.wait(failures, shutdown).await {
            return;
        }
        let watched = async {
            let store = open().await?;
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
                    warn!(bucket = label, error = %e, "cannot watch the bucket; retrying");
                    follower.lost();
                    failures = failures.saturating_add(1);
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        let mut history: Option<HashSet<String>> = Some(HashSet::new());
        if empty {
            follower.history_read(HashSet::new());
            history = None;
        }
        // After a stream leader moved, a watch was seen to go on without an error yet
        // without the writes that followed. One that stays behind the bucket's last
        // write for two checks is made again.
        let mut last_seen = written_before;
        let mut behind_checks = 0u32;
        let mut checks = tokio::time::interval_at(tokio::time::Instant::now() + check, check);
        loop {
            let entry = tokio::select! {
                entry = entries.next() => entry,
                _ = checks.tick() => {
                    follower.tick();
                    let last = store.stream.get_info().await.map(|info| info.state.last_sequence);
                    behind_checks = match last {
                        Ok(last) if last > last_seen => behind_checks + 1,
                        _ => 0,
                    };
                    if behind_checks >= 2 {
                        warn!(bucket = label, last_seen, "the watch fell behind the bucket; watching again");
                        follower.lost();
                        break;
                    }
                    continue;
                }
                _ = shutdown.cancelled() => return,
            };
            let entry = match entry {
                Some(Ok(entry)) => entry,
                Some(Err(e)) => {
                    warn!(bucket = label, error = %e, "the watch was lost; watching again");
                    follower.lost();
                    failures = 1;
                    break;
                }
                None => {
                    follower.lost();
                    failures = 1;
                    break;
                }
            };
            follower.apply(&entry);
            last_seen = last_seen.max(entry.revision);
            if let Some(seen) = history.as_mut() {
                seen.insert(entry.key.clone());
            }
            if entry.seen_current
                && let Some(seen) = history.take()
            {
                follower.history_read(seen);
            }
        }
    }
}
