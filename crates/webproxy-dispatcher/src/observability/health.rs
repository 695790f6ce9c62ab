//! The service's liveness and readiness, kept in memory so that probes cost nothing (no
//! NATS round trip, no upstream call, no new connection per probe), and the reconnect
//! signal that sends every pull loop to pull again at once.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::watch;

/// The prefix of a denied subscription's entry among what keeps the instance stuck.
const DENIED_SUBSCRIPTION: &str = "denied subscription ";

/// Flags the dispatcher sets and the health listener reads.
#[derive(Debug)]
pub(crate) struct Health {
    nats_connected: AtomicBool,
    provisioned: AtomicBool,
    draining: AtomicBool,
    /// Pools whose consumer is missing until it is recreated: not ready meanwhile.
    pools_down: Mutex<BTreeSet<String>>,
    /// Pools whose pull loop ended while the service was not stopping: not alive.
    dead_loops: Mutex<BTreeSet<String>>,
    /// What keeps a pool from making progress, by what it waits on (a bucket it cannot
    /// reach, say), or soon will (a nearly full bucket): not ready meanwhile, and
    /// `/readyz` says why.
    stuck: Mutex<BTreeMap<String, String>>,
    /// Counts the connections made; a pull loop waiting on it pulls again the moment
    /// the connection is back, instead of when a pull lost in the outage expires.
    connections: watch::Sender<u64>,
}

impl Default for Health {
    fn default() -> Health {
        Health::new()
    }
}

impl Health {
    pub(crate) fn new() -> Health {
        Health {
            nats_connected: AtomicBool::new(false),
            provisioned: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            pools_down: Mutex::new(BTreeSet::new()),
            dead_loops: Mutex::new(BTreeSet::new()),
            stuck: Mutex::new(BTreeMap::new()),
            connections: watch::Sender::new(0),
        }
    }

    pub(crate) fn set_nats_connected(&self, connected: bool) {
        let was = self.nats_connected.swap(connected, Ordering::Relaxed);
        if connected && !was {
            // The new connection sends every subscription again, and the server
            // refuses again whatever it still denies.
            self.forget_denied_subscriptions();
            self.connections.send_modify(|n| *n += 1);
        }
    }

    /// The server refused this connection's subscription to `subject`: what is sent
    /// there (cancels, body requests) reaches no one here, yet nothing else would
    /// show it but its callers' "no responders". Not ready, and `/readyz` says why,
    /// until a new connection subscribes again.
    pub(crate) fn set_subscription_denied(&self, subject: &str) {
        self.set_stuck(
            &format!("{DENIED_SUBSCRIPTION}{subject}"),
            Some(format!(
                "NATS permissions deny this service's user subscribing to {subject}, so nothing here answers what is sent there: allow it (deploy/nats/authorization.conf) and restart the instance"
            )),
        );
    }

    fn forget_denied_subscriptions(&self) {
        self.stuck
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .retain(|what, _| !what.starts_with(DENIED_SUBSCRIPTION));
    }

    /// Changes each time the connection is made again.
    pub(crate) fn connections(&self) -> watch::Receiver<u64> {
        self.connections.subscribe()
    }

    pub(crate) fn set_provisioned(&self) {
        self.provisioned.store(true, Ordering::Relaxed);
    }

    pub(crate) fn set_draining(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    pub(crate) fn nats_connected(&self) -> bool {
        self.nats_connected.load(Ordering::Relaxed)
    }

    fn set(flags: &Mutex<BTreeSet<String>>, pool: &str, on: bool) {
        let mut flags = flags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if on {
            flags.insert(pool.to_string());
        } else {
            flags.remove(pool);
        }
    }

    fn any(flags: &Mutex<BTreeSet<String>>) -> bool {
        !flags
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_empty()
    }

    /// `pool`'s consumer is missing (`true`) or back (`false`).
    pub(crate) fn set_pool_down(&self, pool: &str, down: bool) {
        Self::set(&self.pools_down, pool, down);
    }

    /// `pool`'s pull loop ended while the service was not stopping.
    pub(crate) fn set_pull_loop_dead(&self, pool: &str) {
        Self::set(&self.dead_loops, pool, true);
    }

    /// `what` keeps a pool from making progress, for `reason`; `None` once it no longer
    /// does.
    pub(crate) fn set_stuck(&self, what: &str, reason: Option<String>) {
        let mut stuck = self
            .stuck
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match reason {
            Some(reason) => stuck.insert(what.to_string(), reason),
            None => stuck.remove(what),
        };
    }

    /// Why a pool cannot make progress, one line each; empty when nothing keeps one.
    pub(crate) fn stuck(&self) -> Vec<String> {
        self.stuck
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    /// Alive unless a pool's pull loop has died: restarting the process is the cure.
    pub(crate) fn is_alive(&self) -> bool {
        !Self::any(&self.dead_loops)
    }

    /// Ready while connected, provisioned, every pool consuming, and not draining.
    pub(crate) fn is_ready(&self) -> bool {
        self.nats_connected()
            && self.provisioned.load(Ordering::Relaxed)
            && !self.draining.load(Ordering::Relaxed)
            && !Self::any(&self.pools_down)
            && self
                .stuck
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .is_empty()
            && self.is_alive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stuck_pool_is_not_ready_and_says_why_until_it_moves() {
        let health = Health::new();
        health.set_nats_connected(true);
        health.set_provisioned();
        health.set_stuck(
            "rate.p",
            Some("pool p: its rate schedule is unreachable".into()),
        );
        assert!(!health.is_ready());
        assert_eq!(health.stuck(), ["pool p: its rate schedule is unreachable"]);
        health.set_stuck("rate.p", None);
        assert!(health.is_ready());
        assert!(health.stuck().is_empty());
    }

    #[test]
    fn ready_only_when_all_hold() {
        let health = Health::new();
        assert!(!health.is_ready());
        health.set_nats_connected(true);
        assert!(!health.is_ready());
        health.set_provisioned();
        assert!(health.is_ready());
        health.set_pool_down("p", true);
        assert!(!health.is_ready());
        health.set_pool_down("p", false);
        assert!(health.is_ready());
        health.set_nats_connected(false);
        assert!(!health.is_ready());
        health.set_nats_connected(true);
        health.set_draining();
        assert!(!health.is_ready());
    }

    #[test]
    fn a_denied_subscription_is_not_ready_until_a_new_connection() {
        let health = Health::new();
        health.set_nats_connected(true);
        health.set_provisioned();
        health.set_subscription_denied("webproxy.cancel");
        assert!(!health.is_ready());
        let [reason] = &health.stuck()[..] else {
            panic!("one reason: {:?}", health.stuck())
        };
        assert!(
            reason.contains("subscribing to webproxy.cancel"),
            "{reason}"
        );
        health.set_stuck("rate.p", Some("pool p: unreachable".into()));
        health.set_nats_connected(false);
        health.set_nats_connected(true);
        assert_eq!(health.stuck(), ["pool p: unreachable"]);
    }

    #[test]
    fn a_dead_pull_loop_is_not_alive() {
        let health = Health::new();
        assert!(health.is_alive());
        health.set_pull_loop_dead("p");
        assert!(!health.is_alive());
    }

    #[test]
    fn each_new_connection_is_signalled_once() {
        let health = Health::new();
        let connections = health.connections();
        health.set_nats_connected(true);
        health.set_nats_connected(true);
        assert_eq!(*connections.borrow(), 1);
        health.set_nats_connected(false);
        health.set_nats_connected(true);
        assert_eq!(*connections.borrow(), 2);
    }
}
