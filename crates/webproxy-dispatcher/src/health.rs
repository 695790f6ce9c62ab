//! The service's readiness and connection history, kept in memory so that probes cost
//! nothing (no NATS round trip, no upstream call, no new connection per probe) and
//! handlers can tell whether the server may have redelivered their message.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Flags the dispatcher sets and the health listener reads.
#[derive(Debug)]
pub struct Health {
    nats_connected: AtomicBool,
    provisioned: AtomicBool,
    draining: AtomicBool,
    /// A disconnect at least this long may have let `ack_wait` expire on the server.
    stale_after: Duration,
    disconnected_at: Mutex<Option<Instant>>,
    long_disconnects: AtomicU64,
}

impl Health {
    /// `stale_after`: how long a disconnect must last before the server may have
    /// redelivered the messages this instance holds (a margin under `ack_wait`, since
    /// the last progress ack went out up to a third of it earlier).
    pub fn new(stale_after: Duration) -> Health {
        Health {
            nats_connected: AtomicBool::new(false),
            provisioned: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            stale_after,
            disconnected_at: Mutex::new(None),
            long_disconnects: AtomicU64::new(0),
        }
    }

    pub fn set_nats_connected(&self, connected: bool) {
        self.set_nats_connected_at(connected, Instant::now());
    }

    fn set_nats_connected_at(&self, connected: bool, now: Instant) {
        self.nats_connected.store(connected, Ordering::Relaxed);
        let mut disconnected_at = self
            .disconnected_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if !connected {
            disconnected_at.get_or_insert(now);
        } else if let Some(since) = disconnected_at.take()
            && now.saturating_duration_since(since) >= self.stale_after
        {
            self.long_disconnects.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn set_provisioned(&self) {
        self.provisioned.store(true, Ordering::Relaxed);
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub fn nats_connected(&self) -> bool {
        self.nats_connected.load(Ordering::Relaxed)
    }

    /// Ready while connected, provisioned and not draining.
    pub fn is_ready(&self) -> bool {
        self.nats_connected()
            && self.provisioned.load(Ordering::Relaxed)
            && !self.draining.load(Ordering::Relaxed)
    }

    /// Changes whenever the connection was (or still is) lost long enough for the
    /// server to have redelivered a message this instance holds. A handler that sees it
    /// change must not ack: its delivery may be stale, and an ack would free the slot
    /// that the redelivered copy holds.
    pub fn redelivery_epoch(&self) -> u64 {
        self.redelivery_epoch_at(Instant::now())
    }

    fn redelivery_epoch_at(&self, now: Instant) -> u64 {
        let ongoing = self
            .disconnected_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|since| now.saturating_duration_since(since) >= self.stale_after);
        self.long_disconnects.load(Ordering::Relaxed) + u64::from(ongoing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_all_hold() {
        let health = Health::new(Duration::from_secs(5));
        assert!(!health.is_ready());
        health.set_nats_connected(true);
        assert!(!health.is_ready());
        health.set_provisioned();
        assert!(health.is_ready());
        health.set_nats_connected(false);
        assert!(!health.is_ready());
        health.set_nats_connected(true);
        health.set_draining();
        assert!(!health.is_ready());
    }

    #[test]
    fn only_long_disconnects_change_the_epoch() {
        let health = Health::new(Duration::from_secs(5));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        health.set_nats_connected_at(true, at(0));
        let start = health.redelivery_epoch_at(at(0));
        health.set_nats_connected_at(false, at(1));
        health.set_nats_connected_at(true, at(2));
        assert_eq!(
            health.redelivery_epoch_at(at(2)),
            start,
            "a blip is not stale"
        );
        health.set_nats_connected_at(false, at(10));
        assert_eq!(health.redelivery_epoch_at(at(12)), start, "not yet long");
        assert_eq!(
            health.redelivery_epoch_at(at(16)),
            start + 1,
            "an ongoing long disconnect counts"
        );
        health.set_nats_connected_at(true, at(17));
        assert_eq!(
            health.redelivery_epoch_at(at(17)),
            start + 1,
            "and still counts once reconnected"
        );
    }
}
