//! A pool's runtime state, kept in `<PREFIX>_POOL_STATE` (one key per pool), which
//! `provision::pool_consumer_config` lays over the configured limits. Pure.
//!
//! The state is what changes while a pool runs, set by operators and by the service
//! itself, never by a configuration push: a push or a restart keeps it, and no write
//! of the consumer's settings can undo it, because every such write is computed from it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

/// One pause of a pool: until when, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Pause {
    #[serde(with = "time::serde::rfc3339")]
    pub(crate) until: OffsetDateTime,
    pub(crate) reason: String,
}

/// A pool's runtime state.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PoolState {
    /// Pauses by their cause (by hand, on an upstream's `Retry-After`, by a circuit
    /// breaker), each with its own end and reason: ending one leaves the others.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub(crate) pauses: BTreeMap<String, Pause>,
    /// A concurrency limit the service chose below the configured `max_in_flight`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) adaptive_limit: Option<u64>,
    /// When the pool was last resumed by hand: a change every instance sees, and pulls
    /// again on (the server does not serve a pull that waited through a pause lifted
    /// through its API).
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub(crate) resumed: Option<OffsetDateTime>,
}

/// How a new pause meets one of the same cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Extend {
    /// A later end stays.
    KeepLater,
    /// The new end replaces it, earlier or later.
    Replace,
}

/// The cause of a pause made by hand (`webproxy pools pause`).
pub(crate) const MANUAL: &str = "manual";

/// The cause of a pause an upstream's `Retry-After` made.
pub(crate) const RETRY_AFTER: &str = "retry_after";

impl PoolState {
    /// The state stored under a pool's key; an unreadable value is an error the owner
    /// logs, keeping the consumer as it is.
    pub(crate) fn from_json(value: &[u8]) -> Result<PoolState, serde_json::Error> {
        serde_json::from_slice(value)
    }

    /// Pauses the pool under `cause` until `until`, for `reason`; whether that changed
    /// the state. `Extend::KeepLater` leaves a later end of the same cause alone (an
    /// upstream's second, shorter `Retry-After`); `Replace` sets it (an operator's).
    pub(crate) fn pause(
        &mut self,
        cause: &str,
        until: OffsetDateTime,
        reason: &str,
        extend: Extend,
    ) -> bool {
        if extend == Extend::KeepLater && self.pauses.get(cause).is_some_and(|p| p.until >= until) {
            return false;
        }
        self.pauses.insert(
            cause.to_string(),
            Pause {
                until,
                reason: reason.to_string(),
            },
        );
        true
    }

    /// The pauses in force at `now`, by cause.
    pub(crate) fn in_force(&self, now: OffsetDateTime) -> impl Iterator<Item = (&str, &Pause)> {
        self.pauses
            .iter()
            .filter(move |(_, pause)| pause.until > now)
            .map(|(cause, pause)| (cause.as_str(), pause))
    }

    /// The end of the pause in force at `now`: the latest end of those not over.
    pub(crate) fn paused_until(&self, now: OffsetDateTime) -> Option<OffsetDateTime> {
        self.in_force(now).map(|(_, pause)| pause.until).max()
    }

    /// The pool's limit on messages in flight across all instances: `max_in_flight`,
    /// lowered by an adaptive limit (never below 1, which would stop the pool: that is
    /// what a pause is for).
    pub(crate) fn max_ack_pending(&self, max_in_flight: u64) -> u64 {
        match self.adaptive_limit {
            Some(limit) => limit.clamp(1, max_in_flight.max(1)),
            None => max_in_flight,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> OffsetDateTime {
        OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(seconds)
    }

    fn pause(until: i64) -> Pause {
        Pause {
            until: at(until),
            reason: "test".into(),
        }
    }

    #[test]
    fn the_latest_end_in_force_applies() {
        let mut state = PoolState::default();
        assert_eq!(state.paused_until(at(100)), None);
        state.pauses.insert("manual".into(), pause(150));
        state.pauses.insert("retry_after".into(), pause(120));
        state.pauses.insert("breaker".into(), pause(90));
        assert_eq!(state.paused_until(at(100)), Some(at(150)));
        assert_eq!(state.paused_until(at(150)), None);
    }

    #[test]
    fn a_pause_keeps_a_later_end_of_its_cause_unless_replaced() {
        let mut state = PoolState::default();
        assert!(state.pause(RETRY_AFTER, at(200), "429", Extend::KeepLater));
        assert!(!state.pause(RETRY_AFTER, at(150), "429 again", Extend::KeepLater));
        assert_eq!(state.pauses[RETRY_AFTER].until, at(200));
        assert!(state.pause(RETRY_AFTER, at(300), "longer", Extend::KeepLater));
        assert!(state.pause(MANUAL, at(900), "incident", Extend::Replace));
        assert!(state.pause(MANUAL, at(400), "shorter", Extend::Replace));
        assert_eq!(state.pauses[MANUAL].until, at(400));
        assert_eq!(state.paused_until(at(100)), Some(at(400)));
    }

    #[test]
    fn an_adaptive_limit_lowers_the_configured_one_never_to_zero() {
        let mut state = PoolState::default();
        assert_eq!(state.max_ack_pending(8), 8);
        state.adaptive_limit = Some(3);
        assert_eq!(state.max_ack_pending(8), 3);
        state.adaptive_limit = Some(20);
        assert_eq!(state.max_ack_pending(8), 8);
        state.adaptive_limit = Some(0);
        assert_eq!(state.max_ack_pending(8), 1);
    }

    #[test]
    fn state_round_trips_and_defaults_when_empty() {
        let mut state = PoolState::default();
        assert_eq!(PoolState::from_json(b"{}").expect("empty"), state);
        state.pauses.insert("manual".into(), pause(150));
        state.adaptive_limit = Some(4);
        let json = serde_json::to_vec(&state).expect("json");
        assert_eq!(PoolState::from_json(&json).expect("read"), state);
        assert!(PoolState::from_json(b"\"paused\"").is_err());
    }
}
