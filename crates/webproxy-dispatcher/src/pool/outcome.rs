//! Pool control's second call: after an attempt, what its outcome means for the pool.
//! An outcome that is the upstream's is counted (breaker, adaptive limit), and ends the
//! probe of a half-open breaker; a `Retry-After` the rule honours pauses the pool.

use std::time::Duration;

use time::format_description::well_known::Rfc3339;
use tracing::{debug, info, warn};
use webproxy_config::rules::RequestRule;
use webproxy_config::settings::PoolConfig;
use webproxy_worker::AttemptOutcome;

use super::breaker::{evidence, reopen_for};
use super::control::PoolControl;
use super::state::RETRY_AFTER;
use webproxy_jetstream::clock;

/// One attempt of a pool's message, as it ended.
pub(crate) struct AttemptEnded<'a> {
    pub(crate) rule: &'a RequestRule,
    /// The attempt's own timeout (the rule's, or the caller's shorter one).
    pub(crate) timeout: Duration,
    pub(crate) outcome: &'a AttemptOutcome,
    /// How long it took; none when it never reached the upstream.
    pub(crate) duration_ms: Option<u64>,
    /// It was the probe of a half-open breaker ([`super::control::Pass::Probe`]).
    pub(crate) probe: bool,
    /// How long the outcome pauses the pool (the verdict's `pool_pause`).
    pub(crate) pause: Option<Duration>,
}

impl PoolControl {
    /// Takes what `ended` means for its rule's pool, `config` (none when the pool is
    /// not in the running revision): counted only when it reached the upstream and its
    /// outcome is the upstream's (`super::breaker::evidence`). A probe that was not
    /// leaves the breaker half-open for the next attempt: one under a rule with an
    /// origin then decides.
    pub(crate) async fn attempt_ended(&self, config: Option<&PoolConfig>, ended: AttemptEnded<'_>) {
        let rule = ended.rule;
        if let (Some(duration_ms), Some(config)) = (ended.duration_ms, config) {
            let evidence = evidence(
                rule.security.origin.is_some(),
                ended.timeout,
                rule.timeout,
                ended.outcome,
            );
            if evidence.counts() {
                let failed = self
                    .counts
                    .attempted(&rule.pool, config, ended.outcome, duration_ms);
                if ended.probe {
                    probe_ended(self, &rule.pool, config, failed).await;
                }
            } else if ended.probe {
                debug!(pool = rule.pool, rule = %rule.name, evidence = evidence.as_str(), "the probe's outcome is not the upstream's: the breaker stays half-open");
            }
        }
        if let Some(pause) = ended.pause {
            let reason = format!(
                "rule {}: the upstream asked to retry after {}",
                rule.name,
                humantime::format_duration(pause)
            );
            let until = clock::now_utc() + pause;
            if let Err(e) = self.pause(&rule.pool, RETRY_AFTER, until, reason).await {
                warn!(pool = rule.pool, error = %e, "cannot pause the pool on the upstream's Retry-After");
            }
        }
    }
}

/// A probe's outcome: closes `pool`'s breaker, or reopens it with its pause doubled
/// (at most `max_open_for`). Another instance's outcome written first wins.
async fn probe_ended(control: &PoolControl, pool: &str, config: &PoolConfig, failed: bool) {
    let Some(breaker) = &config.breaker else {
        return;
    };
    let written = control
        .change_state(pool, |state| {
            let again = state
                .breaker
                .as_ref()
                .map_or(breaker.open_for, |open| reopen_for(open, breaker));
            state.end_probe(clock::now_utc(), failed, again)
        })
        .await;
    match written {
        Ok(Some(state)) if failed => {
            let until = state
                .paused_until(clock::now_utc())
                .and_then(|until| until.format(&Rfc3339).ok())
                .unwrap_or_else(|| "-".into());
            warn!(pool, %until, "the probe failed: circuit breaker open again");
            control.metrics().breaker_transition(pool, "open");
        }
        Ok(Some(_)) => {
            info!(pool, "the probe succeeded: circuit breaker closed");
            control.metrics().breaker_transition(pool, "closed");
        }
        Ok(None) => {}
        Err(e) => warn!(pool, error = %e, "cannot write the probe's outcome"),
    }
}
