//! A pool's runtime state, kept in `<PREFIX>_POOL_STATE` (one key per pool), and the
//! one decision of what the pool's work consumer is written to be: the configured
//! limits with that state on top. Pure: the owner of the consumers' settings
//! (`runtime::owner`) reads the state and the consumer, and writes what
//! [`consumer_writes`] says.
//!
//! The state is what changes while a pool runs, set by operators and by the service
//! itself, never by a configuration push: a push or a restart keeps it, and no write
//! of the consumer's settings can undo it, because every such write is computed here.

use std::collections::BTreeMap;

use async_nats::jetstream::consumer;
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;

use crate::provision::layout;

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
}

impl PoolState {
    /// The state stored under a pool's key; an unreadable value is an error the owner
    /// logs, keeping the consumer as it is.
    pub(crate) fn from_json(value: &[u8]) -> Result<PoolState, serde_json::Error> {
        serde_json::from_slice(value)
    }

    /// The end of the pause in force at `now`: the latest end of those not over.
    pub(crate) fn paused_until(&self, now: OffsetDateTime) -> Option<OffsetDateTime> {
        self.pauses
            .values()
            .map(|pause| pause.until)
            .filter(|until| *until > now)
            .max()
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

/// A write that brings a pool's work consumer in line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ConsumerWrite {
    /// Its settings differ from the wanted ones: an update, which leaves out
    /// `pause_until`, so a pause made through the JetStream API stays.
    Update,
    /// The state holds a pause in force that the consumer lacks, or that ends at
    /// another time: through the pause API.
    Pause(OffsetDateTime),
}

impl ConsumerWrite {
    /// Its label in `webproxy_pool_consumer_writes_total`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            ConsumerWrite::Update => "update",
            ConsumerWrite::Pause(_) => "pause",
        }
    }
}

/// How far apart two ends of a pause may be and count as the same: the server keeps
/// what it is sent, but RFC 3339 round trips may drop sub-second digits.
const PAUSE_TOLERANCE: time::Duration = time::Duration::seconds(1);

/// What to write so that the consumer whose server-side settings are `current` has
/// the `wanted` ones and the state's pause in force, `paused_until`; nothing when it
/// has them already, so the server sees an update only for a change.
pub(crate) fn consumer_writes(
    current: &consumer::Config,
    wanted: &consumer::pull::Config,
    paused_until: Option<OffsetDateTime>,
) -> Vec<ConsumerWrite> {
    let mut writes = Vec::new();
    let differs = current.max_ack_pending != wanted.max_ack_pending
        || current.ack_wait != wanted.ack_wait
        || current.max_deliver != wanted.max_deliver
        || current.filter_subjects != wanted.filter_subjects
        || current.description != wanted.description
        || layout(&current.metadata) != layout(&wanted.metadata);
    if differs {
        writes.push(ConsumerWrite::Update);
    }
    if let Some(until) = paused_until {
        let paused_then = current
            .pause_until
            .is_some_and(|current| (current - until).abs() < PAUSE_TOLERANCE);
        if !paused_then {
            writes.push(ConsumerWrite::Pause(until));
        }
    }
    writes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::settings_from;
    use crate::provision::pool_consumer_config;

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

    /// The consumer as the server reports it after `wanted` was written.
    fn as_written(wanted: &consumer::pull::Config) -> consumer::Config {
        consumer::Config {
            durable_name: wanted.durable_name.clone(),
            description: wanted.description.clone(),
            filter_subjects: wanted.filter_subjects.clone(),
            ack_policy: wanted.ack_policy,
            ack_wait: wanted.ack_wait,
            max_ack_pending: wanted.max_ack_pending,
            max_deliver: wanted.max_deliver,
            // The server adds keys of its own.
            metadata: wanted
                .metadata
                .clone()
                .into_iter()
                .chain([("_nats.level".to_string(), "1".to_string())])
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_change_is_written() {
        let settings = settings_from("[pools.p]\nmax_in_flight = 4\n").expect("settings");
        let config = &settings.cluster.pools["p"];
        let state = PoolState::default();
        let wanted = pool_consumer_config(&settings, "p", config, &state);
        let current = as_written(&wanted);
        assert_eq!(consumer_writes(&current, &wanted, None), vec![]);

        let raised = settings_from("[pools.p]\nmax_in_flight = 9\n").expect("raised");
        let wanted_raised = pool_consumer_config(&raised, "p", &raised.cluster.pools["p"], &state);
        assert_eq!(
            consumer_writes(&current, &wanted_raised, None),
            vec![ConsumerWrite::Update]
        );

        // An adaptive limit is part of what is wanted: a push cannot undo it.
        let lowered = PoolState {
            adaptive_limit: Some(2),
            ..Default::default()
        };
        let wanted_lowered =
            pool_consumer_config(&raised, "p", &raised.cluster.pools["p"], &lowered);
        assert_eq!(wanted_lowered.max_ack_pending, 2);
        assert_eq!(
            consumer_writes(&as_written(&wanted_lowered), &wanted_lowered, None),
            vec![]
        );
    }

    #[test]
    fn a_pause_is_written_when_missing_or_moved_and_never_lifted_here() {
        let settings = settings_from("[pools.p]\nmax_in_flight = 4\n").expect("settings");
        let wanted = pool_consumer_config(
            &settings,
            "p",
            &settings.cluster.pools["p"],
            &PoolState::default(),
        );
        let mut current = as_written(&wanted);
        assert_eq!(
            consumer_writes(&current, &wanted, Some(at(500))),
            vec![ConsumerWrite::Pause(at(500))]
        );
        current.pause_until = Some(at(500) + time::Duration::milliseconds(300));
        assert_eq!(consumer_writes(&current, &wanted, Some(at(500))), vec![]);
        assert_eq!(
            consumer_writes(&current, &wanted, Some(at(900))),
            vec![ConsumerWrite::Pause(at(900))]
        );
        // A pause the state does not hold (made by hand through the JetStream API) is
        // left as it is.
        assert_eq!(consumer_writes(&current, &wanted, None), vec![]);
    }
}
