//! Which `ack_wait` this instance paces its progress acks from while a change of it
//! is in flight.
//!
//! The server redelivers a message once its consumer's `ack_wait` passes without a
//! progress ack, whatever the revision the message arrived under. A change of
//! `ack_wait` reaches the pods (a new revision) and the consumer (the owner's write)
//! at different times, so a delivery is paced from the shortest of: the `ack_wait`
//! of the revision it arrived under, that of the newest revision this instance knows,
//! and the one its pool consumers were last seen with. A decrease is then paced from
//! as soon as this instance knows it (the owner writes it to the consumer only after
//! every live instance reports pacing from it), and an increase only once the consumer
//! carries it.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;

/// The `ack_wait` a delivery's progress acks are paced from (pure): the shortest of
/// the one it `arrived_under`, the `newest_known` revision's, and the one the server's
/// consumers were last seen with (`server_applied`; unknown before the first reading).
pub(crate) fn pacing_ack_wait(
    arrived_under: Duration,
    newest_known: Duration,
    server_applied: Option<Duration>,
) -> Duration {
    let known = server_applied.map_or(newest_known, |applied| applied.min(newest_known));
    arrived_under.min(known)
}

/// What this instance knows of `ack_wait` now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Known {
    /// The newest revision's.
    newest: Duration,
    /// The shortest one this instance's pool consumers were last seen with.
    server_applied: Option<Duration>,
}

impl Known {
    /// What a delivery that arrived under `arrived_under` is paced from now.
    pub(crate) fn pacing(&self, arrived_under: Duration) -> Duration {
        pacing_ack_wait(arrived_under, self.newest, self.server_applied)
    }

    /// The longest any delivery is paced from now: a delivery arriving now, under the
    /// newest revision, is paced from this, and one that arrived earlier from no more.
    pub(crate) fn longest(&self) -> Duration {
        self.pacing(self.newest)
    }
}

/// This instance's knowledge of `ack_wait`, the same across revisions; every
/// delivery's progress task follows it.
#[derive(Debug)]
pub(crate) struct Pacing {
    known: watch::Sender<Known>,
    /// Per pool, the `ack_wait` its work consumer was last seen with.
    applied: Mutex<BTreeMap<String, Duration>>,
}

impl Pacing {
    /// Knowing only the revision started with.
    pub(crate) fn new(ack_wait: Duration) -> Pacing {
        Pacing {
            known: watch::Sender::new(Known {
                newest: ack_wait,
                server_applied: None,
            }),
            applied: Mutex::new(BTreeMap::new()),
        }
    }

    /// A revision whose `ack_wait` is `ack_wait` is swapped in.
    pub(crate) fn learned(&self, ack_wait: Duration) {
        self.known
            .send_if_modified(|known| std::mem::replace(&mut known.newest, ack_wait) != ack_wait);
    }

    /// `pool`'s work consumer was read with `ack_wait`.
    pub(crate) fn server_has(&self, pool: &str, ack_wait: Duration) {
        let shortest = {
            let mut applied = self
                .applied
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            applied.insert(pool.to_string(), ack_wait);
            applied.values().min().copied()
        };
        self.known.send_if_modified(|known| {
            std::mem::replace(&mut known.server_applied, shortest) != shortest
        });
    }

    pub(crate) fn known(&self) -> watch::Receiver<Known> {
        self.known.subscribe()
    }
}

/// What this instance paces from, for its heartbeat: the longest `ack_wait` any of its
/// deliveries' progress acks are paced from now, and when that changes.
pub struct AckWaitPacing {
    known: watch::Receiver<Known>,
    /// The value last read, so that only a change of it wakes the heartbeat.
    last: Duration,
}

impl AckWaitPacing {
    pub(crate) fn new(known: watch::Receiver<Known>) -> AckWaitPacing {
        let last = known.borrow().longest();
        AckWaitPacing { known, last }
    }

    /// Waits until the longest `ack_wait` paced from differs from the one last read;
    /// `false` once the dispatcher is gone.
    pub async fn changed(&mut self) -> bool {
        loop {
            if self.known.changed().await.is_err() {
                return false;
            }
            if self.known.borrow_and_update().longest() != self.last {
                return true;
            }
        }
    }

    /// The longest `ack_wait` any delivery is paced from now.
    pub fn longest(&mut self) -> Duration {
        self.last = self.known.borrow_and_update().longest();
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[test]
    fn a_decrease_is_paced_from_as_soon_as_it_is_known() {
        // arrived under 30 s; 2 s pushed; the consumer still has 30 s
        assert_eq!(pacing_ack_wait(s(30), s(2), Some(s(30))), s(2));
        assert_eq!(pacing_ack_wait(s(30), s(2), None), s(2));
    }

    #[test]
    fn an_increase_is_paced_from_only_once_the_consumer_carries_it() {
        // 30 s pushed; the consumer was last seen with 2 s
        assert_eq!(pacing_ack_wait(s(30), s(30), Some(s(2))), s(2));
        assert_eq!(pacing_ack_wait(s(30), s(30), Some(s(30))), s(30));
    }

    #[test]
    fn a_delivery_is_never_paced_from_more_than_it_arrived_under() {
        assert_eq!(pacing_ack_wait(s(2), s(30), Some(s(30))), s(2));
        assert_eq!(pacing_ack_wait(s(2), s(30), None), s(2));
    }

    #[test]
    fn the_longest_is_what_a_delivery_arriving_now_is_paced_from() {
        let pacing = Pacing::new(s(30));
        let known = pacing.known();
        assert_eq!(known.borrow().longest(), s(30));
        pacing.server_has("a", s(30));
        pacing.learned(s(2));
        assert_eq!(known.borrow().longest(), s(2));
        assert_eq!(known.borrow().pacing(s(30)), s(2));
        // back up to 30 s while one pool's consumer still has 2 s
        pacing.server_has("b", s(2));
        pacing.learned(s(30));
        assert_eq!(known.borrow().longest(), s(2));
        pacing.server_has("b", s(30));
        assert_eq!(known.borrow().longest(), s(30));
    }

    #[test]
    fn nothing_new_is_no_change() {
        let pacing = Pacing::new(s(30));
        let mut known = pacing.known();
        known.mark_unchanged();
        pacing.learned(s(30));
        assert!(!known.has_changed().unwrap_or(true));
        pacing.server_has("a", s(30));
        assert!(known.has_changed().unwrap_or(false));
        known.mark_unchanged();
        pacing.server_has("a", s(30));
        assert!(!known.has_changed().unwrap_or(true));
    }

    #[test]
    fn the_heartbeat_wakes_only_when_the_longest_changes() {
        use futures::FutureExt as _;
        let pacing = Pacing::new(s(30));
        let mut reported = AckWaitPacing::new(pacing.known());
        pacing.server_has("a", s(30));
        assert_eq!(reported.changed().now_or_never(), None);
        pacing.learned(s(2));
        assert_eq!(reported.changed().now_or_never(), Some(true));
        assert_eq!(reported.longest(), s(2));
        pacing.server_has("a", s(2));
        assert_eq!(reported.changed().now_or_never(), None);
    }
}
