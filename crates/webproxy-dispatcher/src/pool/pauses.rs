//! The operator's pauses (`webproxy pools pause`, `resume`, and what `pools` shows),
//! written to the pools' runtime state like every other pause: the owner of the pool
//! consumers' settings applies them, every instance's gate honours them.

use async_nats::jetstream;
use time::OffsetDateTime;
use webproxy_protocol::Subjects;

use super::stored::stored_pool_state;
use super::stored::{StateError, update_pool_state};
use crate::pool::breaker::Phase;
use crate::pool::state::{Extend, MANUAL, PoolState};

/// One pause of a pool in force: its cause (`manual`, `retry_after`, ...), its end
/// and its reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolPause {
    pub cause: String,
    pub until: OffsetDateTime,
    pub reason: String,
}

/// A pool's runtime state as `pools` shows it: its pauses in force, its breaker and
/// its adaptive limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolRuntime {
    pub pauses: Vec<PoolPause>,
    /// `closed`, `open` or `half_open`.
    pub breaker: &'static str,
    /// The breaker's last pause, while it is open or half-open (a failed probe
    /// doubles it, up to `max_open_for`).
    pub breaker_open_for: Option<std::time::Duration>,
    pub adaptive_limit: Option<u64>,
}

fn in_force(state: &PoolState) -> Vec<PoolPause> {
    state
        .in_force(webproxy_jetstream::clock::now_utc())
        .map(|(cause, pause)| PoolPause {
            cause: cause.to_string(),
            until: pause.until,
            reason: pause.reason.clone(),
        })
        .collect()
}

/// The pools' pauses as the operator commands and the owner of the consumers' settings
/// write them: the pool-state bucket and the pool consumers, through `js`.
#[derive(Debug, Clone)]
pub struct PoolPauses {
    js: jetstream::Context,
    subjects: Subjects,
}

impl PoolPauses {
    /// Pauses of the deployment whose names `subjects` gives.
    pub fn new(js: jetstream::Context, subjects: Subjects) -> PoolPauses {
        PoolPauses { js, subjects }
    }

    /// Pauses `pool` by hand until `until`, cluster-wide, for `reason`: requests keep
    /// waiting in its stream. A later `resume_pool` ends it; other pauses keep their
    /// own ends.
    pub async fn pause_pool(
        &self,
        pool: &str,
        until: OffsetDateTime,
        reason: String,
    ) -> Result<(), StateError> {
        update_pool_state(
            &self.js,
            &self.subjects.pool_state_bucket(),
            pool,
            |state| state.pause(MANUAL, until, &reason, Extend::Replace),
        )
        .await?;
        Ok(())
    }

    /// Ends `pool`'s pause by hand. When no other pause is in force it lifts the pool
    /// consumer's pause (the owner of its settings never lifts one) and then marks the
    /// resume, so that every instance pulls again at once. Returns the pauses still
    /// in force.
    pub async fn resume_pool(&self, pool: &str) -> Result<Vec<PoolPause>, StateError> {
        let bucket = self.subjects.pool_state_bucket();
        let state = update_pool_state(&self.js, &bucket, pool, |state| {
            state.pauses.remove(MANUAL).is_some()
        })
        .await?;
        let left = match state {
            Some(state) => in_force(&state),
            None => self.pool_pauses(pool).await?,
        };
        if !left.is_empty() {
            return Ok(left);
        }
        self.lift_pause(pool).await?;
        Ok(Vec::new())
    }

    /// Lifts `pool`'s consumer's pause through the API (the owner of its settings never
    /// lifts one) and then marks the resume, so that every instance pulls again at
    /// once: for a pause that ended early with no other left in force.
    pub(crate) async fn lift_pause(&self, pool: &str) -> Result<(), StateError> {
        let bucket = self.subjects.pool_state_bucket();
        let error = |e: &dyn std::error::Error| StateError::new(pool, &bucket, e.to_string());
        let consumer = self.subjects.pool_consumer(pool);
        let stream = self
            .js
            .get_stream_no_info(self.subjects.pool_stream(pool))
            .await
            .map_err(|e| error(&e))?;
        stream
            .resume_consumer(&consumer)
            .await
            .map_err(|e| error(&e))?;
        update_pool_state(&self.js, &bucket, pool, |state| {
            state.resumed = Some(webproxy_jetstream::clock::now_utc());
            true
        })
        .await?;
        Ok(())
    }

    /// `pool`'s pauses in force now.
    async fn pool_pauses(&self, pool: &str) -> Result<Vec<PoolPause>, StateError> {
        Ok(self.pool_runtime(pool).await?.pauses)
    }

    /// `pool`'s runtime state now: pauses in force, breaker, adaptive limit.
    pub async fn pool_runtime(&self, pool: &str) -> Result<PoolRuntime, StateError> {
        let bucket = self.subjects.pool_state_bucket();
        let state = match self.js.get_key_value(&bucket).await {
            Ok(store) => {
                stored_pool_state(&store, pool)
                    .await
                    .map_err(|e| StateError::new(pool, &bucket, e))?
                    .0
            }
            Err(_) => PoolState::default(),
        };
        let breaker = match state.phase(webproxy_jetstream::clock::now_utc()) {
            Phase::Closed => "closed",
            Phase::Open => "open",
            Phase::HalfOpen => "half_open",
        };
        Ok(PoolRuntime {
            pauses: in_force(&state),
            breaker,
            breaker_open_for: state
                .breaker
                .as_ref()
                .map(|open| std::time::Duration::from_millis(open.open_for_ms)),
            adaptive_limit: state.adaptive_limit,
        })
    }
}
