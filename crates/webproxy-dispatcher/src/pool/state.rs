//! A pool's runtime state, kept in `<PREFIX>_POOL_STATE` (one key per pool), which
//! `consumers::pool_consumer_config` lays over the configured limits. Pure.
//!
//! The state is what changes while a pool runs, set by operators and by the service
//! itself, never by a configuration push: a push or a restart keeps it, and no write
//! of the consumer's settings can undo it, because every such write is computed from it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use webproxy_config::cluster::PoolConfig;

use crate::pool::breaker::{BREAKER, Open, Phase};

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
    /// The latency the adaptive limit measures against, in microseconds
    /// (`adaptive::Adaptive::baseline_us`), kept here so a new owner goes on from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) baseline_us: Option<u64>,
    /// The circuit breaker, while open or half-open; its pause is `pauses["breaker"]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) breaker: Option<Open>,
    /// When the breaker last closed: it counts only attempts after that.
    #[serde(
        default,
        with = "time::serde::rfc3339::option",
        skip_serializing_if = "Option::is_none"
    )]
    pub(crate) breaker_closed: Option<OffsetDateTime>,
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

    /// The pool's limit on messages in flight across all instances: 1 while its
    /// breaker is open or half-open (the one probe), else `max_in_flight`, lowered by
    /// an adaptive limit when `adaptive` is on (never below `min_in_flight`, nor 1,
    /// which would stop the pool: that is what a pause is for).
    pub(crate) fn max_ack_pending(&self, config: &PoolConfig) -> u64 {
        if self.breaker.is_some() {
            return 1;
        }
        match self.adaptive_limit {
            Some(limit) if config.adaptive => limit.clamp(
                config.min_in_flight.clamp(1, config.max_in_flight.max(1)),
                config.max_in_flight.max(1),
            ),
            _ => config.max_in_flight,
        }
    }

    /// Where the pool's breaker stands at `now`.
    pub(crate) fn phase(&self, now: OffsetDateTime) -> Phase {
        match &self.breaker {
            None => Phase::Closed,
            Some(_) if self.pauses.get(BREAKER).is_some_and(|p| p.until > now) => Phase::Open,
            Some(_) => Phase::HalfOpen,
        }
    }

    /// Opens the breaker for `open_for` from `now`, for `reason`; false when it is
    /// open already (another writer won).
    pub(crate) fn open_breaker(
        &mut self,
        now: OffsetDateTime,
        open_for: std::time::Duration,
        reason: &str,
    ) -> bool {
        if self.breaker.is_some() {
            return false;
        }
        self.set_open(now, open_for, reason);
        true
    }

    /// The probe's outcome: a failure reopens the breaker for `reopen_for` from `now`,
    /// a success closes it. False when the breaker is not half-open (another probe's
    /// outcome came first).
    pub(crate) fn end_probe(
        &mut self,
        now: OffsetDateTime,
        failed: bool,
        reopen_for: std::time::Duration,
    ) -> bool {
        if self.phase(now) != Phase::HalfOpen {
            return false;
        }
        if failed {
            self.set_open(now, reopen_for, "the probe failed; open again");
        } else {
            self.breaker = None;
            self.pauses.remove(BREAKER);
            self.breaker_closed = Some(now);
        }
        true
    }

    /// Forgets a breaker no longer configured, open or half-open: its pause and its
    /// probe limit go. Whether there was one.
    pub(crate) fn forget_breaker(&mut self) -> bool {
        self.pauses.remove(BREAKER);
        self.breaker.take().is_some()
    }

    /// Whether the pool consumer's pause must be lifted through the API now that this
    /// state became `after`: a pause in force at `now` ended early and none is left.
    /// The owner's writes never lift a pause (they would undo one made by hand
    /// through the API), and the server's would otherwise last to its old end.
    pub(crate) fn lifts_pause(&self, after: &PoolState, now: OffsetDateTime) -> bool {
        self.paused_until(now).is_some() && after.paused_until(now).is_none()
    }

    fn set_open(&mut self, now: OffsetDateTime, open_for: std::time::Duration, reason: &str) {
        self.breaker = Some(Open {
            open_for_ms: u64::try_from(open_for.as_millis()).unwrap_or(u64::MAX),
        });
        self.pauses.insert(
            BREAKER.to_string(),
            Pause {
                until: now + open_for,
                reason: reason.to_string(),
            },
        );
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
        let mut config = PoolConfig {
            max_in_flight: 8,
            adaptive: true,
            ..PoolConfig::default()
        };
        assert_eq!(state.max_ack_pending(&config), 8);
        state.adaptive_limit = Some(3);
        assert_eq!(state.max_ack_pending(&config), 3);
        state.adaptive_limit = Some(20);
        assert_eq!(state.max_ack_pending(&config), 8);
        state.adaptive_limit = Some(0);
        assert_eq!(state.max_ack_pending(&config), 1);
        config.min_in_flight = 2;
        assert_eq!(state.max_ack_pending(&config), 2);
        // Switched off, a stored limit no longer applies.
        config.adaptive = false;
        assert_eq!(state.max_ack_pending(&config), 8);
    }

    #[test]
    fn an_open_breaker_probes_once_then_closes_or_reopens() {
        let config = PoolConfig {
            max_in_flight: 8,
            ..PoolConfig::default()
        };
        let mut state = PoolState::default();
        assert_eq!(state.phase(at(0)), Phase::Closed);
        assert!(state.open_breaker(
            at(0),
            std::time::Duration::from_secs(30),
            "breaker: 20 of 20"
        ));
        assert!(!state.open_breaker(at(1), std::time::Duration::from_secs(30), "again"));
        assert_eq!(state.phase(at(10)), Phase::Open);
        assert_eq!(state.paused_until(at(10)), Some(at(30)));
        assert_eq!(state.max_ack_pending(&config), 1);
        // No probe's outcome counts while it is open.
        assert!(!state.end_probe(at(10), false, std::time::Duration::from_secs(60)));
        assert_eq!(state.phase(at(30)), Phase::HalfOpen);
        assert!(state.end_probe(at(31), true, std::time::Duration::from_secs(60)));
        assert_eq!(state.phase(at(40)), Phase::Open);
        assert_eq!(state.paused_until(at(40)), Some(at(91)));
        assert_eq!(state.breaker.as_ref().map(|b| b.open_for_ms), Some(60_000));
        assert!(state.end_probe(at(92), false, std::time::Duration::from_secs(60)));
        assert_eq!(state.phase(at(92)), Phase::Closed);
        assert_eq!(state.breaker_closed, Some(at(92)));
        assert_eq!(state.max_ack_pending(&config), 8);
        assert!(state.pauses.is_empty());
    }

    #[test]
    fn a_breaker_no_longer_configured_is_forgotten_and_its_pause_lifted_if_alone() {
        let config = PoolConfig {
            max_in_flight: 8,
            ..PoolConfig::default()
        };
        let mut state = PoolState::default();
        assert!(!state.forget_breaker());
        state.open_breaker(at(0), std::time::Duration::from_secs(600), "breaker");
        let open = state.clone();
        assert!(state.forget_breaker());
        assert_eq!(state.phase(at(10)), Phase::Closed);
        assert_eq!(state.max_ack_pending(&config), 8);
        assert_eq!(state.paused_until(at(10)), None);
        assert!(open.lifts_pause(&state, at(10)));
        // Half-open, its pause is over already: nothing to lift.
        assert!(!open.lifts_pause(&state, at(600)));
        // Another pause in force stays, and so does the consumer's.
        let mut manual = open.clone();
        manual.pause(MANUAL, at(900), "incident", Extend::Replace);
        let before = manual.clone();
        assert!(manual.forget_breaker());
        assert_eq!(manual.paused_until(at(10)), Some(at(900)));
        assert!(!before.lifts_pause(&manual, at(10)));
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
