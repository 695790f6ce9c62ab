//! Pool control: everything that decides how much a pool may send upstream, and when.
//! The pure models (the pool's runtime state, the rate schedule, the breaker, the
//! adaptive limit) beside their effects: the gate every attempt passes
//! ([`control::PoolControl`]), the moves into a pool counted against `max_waiting`
//! ([`admission`]), the operator's pauses, the cluster-wide breaker and its reports
//! ([`oversight`]), and the one writer of the pool consumers' settings ([`owner`]).
//!
//! The conversation path calls in here twice per attempt: before it, the gate
//! ([`control::PoolControl::pass`]: go, probe, or park until a time); after it, what the
//! outcome means for the pool ([`outcome`]). Nothing here calls the conversation path:
//! the cluster tasks are given a [`PoolTasks`], not the service's revisions.

pub(crate) mod adaptive;
pub(crate) mod admission;
pub(crate) mod breaker;
pub(crate) mod consumers;
pub(crate) mod control;
pub(crate) mod counts;
pub(crate) mod limiter;
pub(crate) mod outcome;
pub(crate) mod oversight;
pub(crate) mod owner;
pub(crate) mod pauses;
pub(crate) mod rate;
pub(crate) mod state;
pub(crate) mod stored;

use std::sync::Arc;

use async_nats::jetstream;
use tokio::sync::watch;
use webproxy_config::settings::Settings;

use control::PoolControl;

/// One revision of the cluster part as pool control's tasks read it: its settings, and
/// the JetStream context with that revision's request timeout.
#[derive(Clone)]
pub(crate) struct PoolRevision {
    pub(crate) settings: Arc<Settings>,
    pub(crate) js: jetstream::Context,
}

impl PoolRevision {
    /// The pauses, written through this revision's context.
    pub(crate) fn pauses(&self) -> pauses::PoolPauses {
        pauses::PoolPauses::new(self.js.clone(), self.settings.subjects.clone())
    }
}

/// What the service gives pool control's cluster tasks (the owner, the breaker's
/// oversight, the attempt reports): the gate every handler passes (and its metrics),
/// and each revision as it is swapped in.
#[derive(Clone)]
pub(crate) struct PoolTasks {
    pub(crate) control: Arc<PoolControl>,
    pub(crate) revisions: watch::Receiver<PoolRevision>,
}

impl PoolTasks {
    /// The revision running now.
    pub(crate) fn current(&self) -> PoolRevision {
        self.revisions.borrow().clone()
    }
}
