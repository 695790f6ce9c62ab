//! The service's readiness, kept in memory so that probes cost nothing: no NATS round
//! trip, no upstream call, no new connection per probe.

use std::sync::atomic::{AtomicBool, Ordering};

/// Flags the dispatcher sets and the health listener reads.
#[derive(Debug, Default)]
pub struct Health {
    nats_connected: AtomicBool,
    provisioned: AtomicBool,
    draining: AtomicBool,
}

impl Health {
    pub fn set_nats_connected(&self, connected: bool) {
        self.nats_connected.store(connected, Ordering::Relaxed);
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_all_hold() {
        let health = Health::default();
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
}
