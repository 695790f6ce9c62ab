//! Whether a delivery is still the one the server holds for this instance, judged by
//! send times, and the one progress task that keeps it so for a handler's whole life.
//!
//! The server redelivers a message once `ack_wait` passes without an ack or a progress
//! ack, and acks count by stream sequence alone: a stale delivery's ack would free the
//! slot that the redelivered copy holds. A progress ack is confirmed (sent as a
//! request), but the server answers one even for a sequence it has meanwhile
//! redelivered, so a confirmation proves only that the connection was alive when it was
//! sent. A delivery is therefore current only while every interval, from the delivery
//! through each confirmed progress ack's *send* time, stayed under `ack_wait` minus a
//! margin; once that breaks it stays stale, and its ending is stored but not acked.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;
use tracing::debug;

use super::delivery::Delivery;

/// The timings one pool consumer's deliveries are judged by.
#[derive(Debug, Clone, Copy)]
pub(super) struct LivenessPolicy {
    /// The longest gap allowed between the delivery and the first confirmed progress
    /// ack sent, and between two of them: `ack_wait` minus a margin for clocks and
    /// the network.
    pub(crate) limit: Duration,
    /// How often a progress ack is sent.
    pub(crate) period: Duration,
    /// How long a progress ack's confirmation is waited for.
    pub(crate) confirm_within: Duration,
}

impl LivenessPolicy {
    /// Progress every third of `ack_wait`, confirmations waited for up to a quarter
    /// of it, and a fifth of it as the margin: a lost confirmation or two is absorbed
    /// before the limit is reached.
    pub(super) fn for_ack_wait(ack_wait: Duration) -> LivenessPolicy {
        LivenessPolicy {
            limit: ack_wait - ack_wait / 5,
            period: ack_wait / 3,
            confirm_within: ack_wait / 4,
        }
    }
}

#[derive(Debug)]
struct State {
    /// The send time of the last confirmed progress ack, or the delivery's arrival.
    last: Instant,
    stale: bool,
}

/// One delivery's liveness.
#[derive(Debug)]
pub(super) struct Liveness {
    policy: LivenessPolicy,
    state: Mutex<State>,
}

impl Liveness {
    /// A delivery that arrived at `delivered`.
    pub(super) fn new(policy: LivenessPolicy, delivered: Instant) -> Liveness {
        Liveness {
            policy,
            state: Mutex::new(State {
                last: delivered,
                stale: false,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the delivery is still current at `now`: no interval has broken the
    /// limit, the open one included. Once it is not, it never is again.
    pub(super) fn is_current_at(&self, now: Instant) -> bool {
        let mut state = self.state();
        if !state.stale && now.saturating_duration_since(state.last) >= self.policy.limit {
            state.stale = true;
        }
        !state.stale
    }

    pub(super) fn is_current(&self) -> bool {
        self.is_current_at(Instant::now())
    }

    /// A progress ack sent at `sent` was confirmed: the next interval starts there,
    /// if the one it closes stayed within the limit.
    pub(super) fn confirmed(&self, sent: Instant) {
        let mut state = self.state();
        if state.stale || sent.saturating_duration_since(state.last) >= self.policy.limit {
            state.stale = true;
        } else if sent > state.last {
            state.last = sent;
        }
    }

    /// Sends confirmed progress acks for `delivery` every period until the delivery
    /// is stale (then it returns) or the caller stops polling it.
    pub(super) async fn keep(&self, delivery: &impl Delivery) {
        let period = self.policy.period;
        let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let sent = Instant::now();
            if !self.is_current_at(sent) {
                debug!("delivery went stale; no more progress acks");
                return;
            }
            match tokio::time::timeout(self.policy.confirm_within, delivery.progress_confirmed())
                .await
            {
                Ok(Ok(())) => self.confirmed(sent),
                Ok(Err(e)) => debug!(error = %e, "progress ack not confirmed"),
                Err(_) => debug!("progress ack not confirmed in time"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> LivenessPolicy {
        LivenessPolicy::for_ack_wait(Duration::from_secs(15))
    }

    #[test]
    fn the_policy_leaves_room_for_a_lost_confirmation() {
        let p = policy();
        assert_eq!(p.limit, Duration::from_secs(12));
        assert_eq!(p.period, Duration::from_secs(5));
        assert!(p.period * 2 < p.limit, "one lost confirmation is absorbed");
        assert!(p.confirm_within < p.period);
    }

    #[test]
    fn confirmed_progress_keeps_a_delivery_current() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let liveness = Liveness::new(policy(), t0);
        assert!(liveness.is_current_at(at(11)));
        liveness.confirmed(at(5));
        liveness.confirmed(at(15));
        assert!(liveness.is_current_at(at(26)));
        assert!(
            !liveness.is_current_at(at(27)),
            "12 s since the last confirmed send"
        );
    }

    #[test]
    fn a_confirmation_after_a_broken_interval_does_not_revive_it() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let liveness = Liveness::new(policy(), t0);
        // sent 13 s after the delivery: the server may have redelivered before it
        liveness.confirmed(at(13));
        assert!(!liveness.is_current_at(at(14)));
        liveness.confirmed(at(15));
        assert!(!liveness.is_current_at(at(16)), "once stale, always stale");
    }

    #[test]
    fn an_open_interval_past_the_limit_is_stale_for_good() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let liveness = Liveness::new(policy(), t0);
        assert!(!liveness.is_current_at(at(12)));
        // a confirmation of a progress ack sent earlier arriving late changes nothing
        liveness.confirmed(at(5));
        assert!(!liveness.is_current_at(at(13)));
    }
}
