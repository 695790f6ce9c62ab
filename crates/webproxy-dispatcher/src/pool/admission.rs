//! Whether a pool has room for a request a rule moves into it: `max_waiting` bounds the
//! requests waiting in a pool whether callers published them there or rules moved them
//! there, so a flood published to one pool cannot fill another through a move.
//!
//! `max_waiting` is a bound per caller: each request subject of a pool (the one without
//! a caller name, and each `<prefix>.request.<pool>.<caller>`) is a queue of its own, and
//! a caller's requests moved into the pool count against its own queue. Callers'
//! publishes are bounded by the server (the per-subject limit, discard new). Moves go on
//! subjects of their own (`Subjects::moved`, with the caller's name), apart from parked
//! retries, due hops and replays, which do not count; before a move this instance counts
//! the caller's request subject and its moved subjects in the pool and refuses the move
//! when they hold `max_waiting`. The count and the publish are one step per pool in an
//! instance (a lock held until the move is published), so moves racing from other
//! instances pass the bound by at most one each.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use async_nats::jetstream;
use futures::TryStreamExt as _;
use tokio::sync::OwnedMutexGuard;
use webproxy_protocol::Subjects;

/// The lock a move into a pool holds from its count to its publish.
pub(crate) type Admitted = OwnedMutexGuard<()>;

/// What the count allows.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Room: publish the move while holding this.
    Room(Admitted),
    /// The pool holds `waiting` requests, `max_waiting` or more.
    Full { waiting: u64 },
}

/// Whether `waiting` requests leave room for one more under `max_waiting`.
pub(crate) fn has_room(waiting: u64, max_waiting: u64) -> bool {
    waiting < max_waiting
}

/// The per-pool locks of this instance's moves.
#[derive(Debug, Default)]
pub(crate) struct Admissions {
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

impl Admissions {
    /// Counts `caller`'s requests waiting in `pool` (published and moved) and says
    /// whether one more moved request fits under `max_waiting`.
    pub(crate) async fn admit(
        &self,
        js: &jetstream::Context,
        subjects: &Subjects,
        pool: &str,
        caller: Option<&str>,
        max_waiting: u64,
    ) -> Result<Admission, async_nats::Error> {
        let lock = self
            .locks
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(pool.to_owned())
            .or_default()
            .clone();
        let admitted = lock.lock_owned().await;
        let stream = js.get_stream_no_info(subjects.pool_stream(pool)).await?;
        let mut waiting = 0u64;
        let published = match caller {
            None => subjects.request(pool),
            Some(caller) => subjects.caller_request(pool, caller),
        };
        for filter in [published, subjects.moved_filter(pool, caller)] {
            let mut counts = stream.info_with_subjects(filter).await?;
            while let Some((_, count)) = counts.try_next().await? {
                waiting = waiting.saturating_add(u64::try_from(count).unwrap_or(u64::MAX));
            }
        }
        Ok(if has_room(waiting, max_waiting) {
            Admission::Room(admitted)
        } else {
            Admission::Full { waiting }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_has_room_below_max_waiting_only() {
        assert!(has_room(0, 1));
        assert!(has_room(4, 5));
        assert!(!has_room(5, 5));
        assert!(!has_room(6, 5));
        assert!(!has_room(0, 0));
    }
}
