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

use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::debug;
use webproxy_config::human;

use super::delivery::{Delivery, ProgressAckError};
use super::pacing::Known;

/// The timings one pool consumer's deliveries are judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LivenessPolicy {
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
    pub(crate) fn for_ack_wait(ack_wait: Duration) -> LivenessPolicy {
        LivenessPolicy {
            limit: ack_wait - ack_wait / 5,
            period: ack_wait / 3,
            confirm_within: ack_wait / 4,
        }
    }
}

#[derive(Debug)]
struct State {
    /// The send time of the last confirmed progress ack, or the delivery's arrival,
    /// or when a shorter `ack_wait` was first paced from.
    last: Instant,
    stale: bool,
    /// What the delivery is judged and paced by now.
    policy: LivenessPolicy,
}

/// One delivery's liveness.
#[derive(Debug)]
pub(crate) struct Liveness {
    /// The `ack_wait` of the revision the delivery arrived under.
    arrived_under: Duration,
    state: Mutex<State>,
    /// Wakes [`Liveness::stale`] when a shorter `ack_wait` brings the limit forward;
    /// confirmations only ever move it later.
    repaced: Notify,
    /// The pool's leadership epoch (see [`Leadership`]) and its value at delivery.
    leadership: Option<(watch::Receiver<u64>, u64)>,
}

/// A pool's leadership epoch: the pull loop counts up each time its pull learns that
/// the consumer's leader changed ("Leadership Change") or that it has none (no
/// responders). Missed heartbeats do not count: a starved instance misses them too.
/// A new leader restores each message's pending time from what its group committed,
/// which can be older than the progress acks this instance saw answered, so every
/// delivery held from before is stale from then on.
pub(crate) type Leadership = watch::Receiver<u64>;

impl Liveness {
    /// A delivery that arrived at `delivered` under a revision whose `ack_wait` is
    /// `ack_wait`, judged by it alone.
    pub(crate) fn new(ack_wait: Duration, delivered: Instant) -> Liveness {
        Liveness::paced(ack_wait, ack_wait, delivered)
    }

    /// A delivery that arrived at `delivered` under `arrived_under`, paced from
    /// `pacing` (`pacing::pacing_ack_wait`).
    pub(crate) fn paced(arrived_under: Duration, pacing: Duration, delivered: Instant) -> Liveness {
        Liveness {
            arrived_under,
            state: Mutex::new(State {
                last: delivered,
                stale: false,
                policy: LivenessPolicy::for_ack_wait(pacing),
            }),
            repaced: Notify::new(),
            leadership: None,
        }
    }

    /// The same, stale once the pool's `leadership` epoch moves on from its value now.
    pub(crate) fn under(mut self, leadership: Leadership) -> Liveness {
        let epoch = *leadership.borrow();
        self.leadership = Some((leadership, epoch));
        self
    }

    fn leader_changed(&self) -> bool {
        self.leadership
            .as_ref()
            .is_some_and(|(leadership, epoch)| *leadership.borrow() != *epoch)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the delivery is still current at `now`: no interval has broken the
    /// limit, the open one included. Once it is not, it never is again.
    pub(crate) fn is_current_at(&self, now: Instant) -> bool {
        let leader_changed = self.leader_changed();
        let mut state = self.state();
        if !state.stale
            && (leader_changed || now.saturating_duration_since(state.last) >= state.policy.limit)
        {
            state.stale = true;
        }
        !state.stale
    }

    pub(crate) fn is_current(&self) -> bool {
        self.is_current_at(Instant::now())
    }

    /// Resolves once the delivery is stale: what an attempt is raced against, so that
    /// no call runs on for a message the server may already have handed to another
    /// handler (which would put one call more at the upstream than the pool allows).
    pub(crate) async fn stale(&self) {
        loop {
            let repaced = self.repaced.notified();
            tokio::pin!(repaced);
            // Registered before the limit is read: a repace in between still wakes it.
            repaced.as_mut().enable();
            let until = {
                let state = self.state();
                if state.stale {
                    return;
                }
                state.last + state.policy.limit
            };
            tokio::select! {
                () = tokio::time::sleep_until(until) => {}
                () = repaced => {}
            }
            if !self.is_current() {
                return;
            }
        }
    }

    /// A progress ack sent at `sent` was confirmed: the next interval starts there,
    /// if the one it closes stayed within the limit.
    pub(crate) fn confirmed(&self, sent: Instant) {
        let mut state = self.state();
        if state.stale || sent.saturating_duration_since(state.last) >= state.policy.limit {
            state.stale = true;
        } else if sent > state.last {
            state.last = sent;
        }
    }

    /// From `at` on, the delivery is paced from `ack_wait`; the new period, when it
    /// differs from the one paced by until now.
    ///
    /// The open interval is judged by the old limit up to `at`. A shorter `ack_wait`
    /// reaches the server only after this instance reports pacing from it, which is
    /// after `at`, so its limit runs from `at` (the keeper sends a progress ack at
    /// once). A longer one is paced from only once the consumer carries it, so its
    /// limit applies to the open interval as it is.
    pub(crate) fn repace(&self, ack_wait: Duration, at: Instant) -> Option<Duration> {
        let mut state = self.state();
        let policy = LivenessPolicy::for_ack_wait(ack_wait);
        if state.stale || policy.period == state.policy.period {
            return None;
        }
        if at.saturating_duration_since(state.last) >= state.policy.limit {
            state.stale = true;
            return None;
        }
        if policy.limit < state.policy.limit {
            state.last = state.last.max(at);
        }
        state.policy = policy;
        drop(state);
        self.repaced.notify_waiters();
        Some(policy.period)
    }

    /// Stale for good, whatever the confirmations said: the consumer lost its leader
    /// while this delivery was held (what the old leader answered may not have been
    /// committed, so the next leader may hand the message to another handler at once),
    /// another delivery of the message arrived, or its attempt claim was lost.
    pub(crate) fn make_stale(&self) {
        self.state().stale = true;
        self.repaced.notify_waiters();
    }

    pub(crate) fn policy(&self) -> LivenessPolicy {
        self.state().policy
    }

    /// Sends confirmed progress acks for `delivery` every period until the delivery
    /// is stale (then it returns) or the caller stops polling it. With `pacing`, the
    /// period follows what this instance knows of `ack_wait`, and a shorter one is
    /// paced from with a progress ack at once.
    pub(crate) async fn keep(
        &self,
        delivery: &impl Delivery,
        mut pacing: Option<watch::Receiver<Known>>,
    ) {
        let ticking = |period: Duration| {
            let mut ticks = tokio::time::interval_at(Instant::now() + period, period);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks
        };
        let mut ticks = ticking(self.policy().period);
        let mut leadership = self.leadership.as_ref().map(|(l, _)| l.clone());
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = leader_moved_on(&mut leadership) => {
                    self.make_stale();
                    debug!("the pool consumer's leader changed; the delivery is stale");
                    return;
                }
                known = next_known(&mut pacing) => {
                    let before = self.policy().period;
                    let Some(period) = self.repace(known.pacing(self.arrived_under), Instant::now())
                    else {
                        continue;
                    };
                    debug!(period = %human(period), "progress acks paced anew");
                    ticks = ticking(period);
                    if period > before {
                        continue;
                    }
                }
            }
            let sent = Instant::now();
            if !self.is_current_at(sent) {
                debug!("delivery went stale; no more progress acks");
                return;
            }
            let confirm_within = self.policy().confirm_within;
            match tokio::time::timeout(confirm_within, delivery.progress_confirmed()).await {
                Ok(Ok(())) => self.confirmed(sent),
                Ok(Err(ProgressAckError::NoLeader)) => {
                    self.make_stale();
                    debug!("no consumer leader answered a progress ack; the delivery is stale");
                    return;
                }
                Ok(Err(e)) => debug!(error = %e, "progress ack not confirmed"),
                Err(_) => debug!("progress ack not confirmed in time"),
            }
        }
    }
}

/// Resolves once the pool's leadership epoch moves on; never, without one to follow
/// or once its pull loop is gone.
async fn leader_moved_on(leadership: &mut Option<watch::Receiver<u64>>) {
    let moved = match leadership {
        Some(epoch) => epoch.changed().await.is_ok(),
        None => false,
    };
    if !moved {
        *leadership = None;
        std::future::pending::<()>().await;
    }
}

/// The deliveries one pool's pull loop holds, by stream sequence. The server delivers a
/// message again only once it counts the delivery before as timed out, so a second
/// delivery of a sequence this instance still holds makes the first stale at once,
/// even when every progress ack of the first looked confirmed (a consumer whose
/// leadership changed twice after an outage redelivered one message twice in 234 ms).
#[derive(Debug, Default)]
pub(crate) struct HeldDeliveries {
    held: Mutex<HeldBySequence>,
}

#[derive(Debug, Default)]
struct HeldBySequence {
    by_sequence: std::collections::HashMap<u64, std::sync::Weak<Liveness>>,
    /// The size at which ended deliveries are next swept out: twice what was left at
    /// the last sweep, so that a delivery costs amortized constant time however many a
    /// pool holds.
    sweep_at: usize,
}

impl HeldDeliveries {
    /// Records `liveness` as the delivery of `sequence` now held; an earlier delivery of
    /// it still held is made stale. Whether there was one.
    pub(crate) fn hold(&self, sequence: u64, liveness: &std::sync::Arc<Liveness>) -> bool {
        let mut held = self
            .held
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if held.by_sequence.len() >= held.sweep_at {
            held.by_sequence
                .retain(|_, earlier| earlier.strong_count() > 0);
            held.sweep_at = (held.by_sequence.len() * 2).max(64);
        }
        let earlier = held
            .by_sequence
            .insert(sequence, std::sync::Arc::downgrade(liveness))
            .and_then(|earlier| earlier.upgrade());
        drop(held);
        match earlier {
            Some(earlier) => {
                earlier.make_stale();
                true
            }
            None => false,
        }
    }
}

/// The next change of what this instance knows of `ack_wait`; never, without one to
/// follow or once it is gone.
async fn next_known(pacing: &mut Option<watch::Receiver<Known>>) -> Known {
    let changed = match pacing {
        Some(known) => known.changed().await.is_ok(),
        None => false,
    };
    match pacing {
        Some(known) if changed => *known.borrow_and_update(),
        _ => {
            *pacing = None;
            std::future::pending().await
        }
    }
}

/// Runs `work` to its end while `keeper` runs beside it (until the keeper ends).
pub(crate) async fn while_keeping<T>(
    work: impl Future<Output = T>,
    keeper: impl Future<Output = ()>,
) -> T {
    tokio::pin!(work);
    tokio::pin!(keeper);
    let mut keeping = true;
    loop {
        tokio::select! {
            out = &mut work => return out,
            _ = &mut keeper, if keeping => keeping = false,
        }
    }
}

#[cfg(test)]
mod tests;
