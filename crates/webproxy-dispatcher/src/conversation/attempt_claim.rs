//! One delivery of a message at work at a time, across instances. After a consumer's
//! leadership changes, a new leader may hand out again a message whose holder it never
//! heard from (the old leader answered the holder's progress acks but did not commit
//! them), and nothing local to either instance sees the other: two calls at once would
//! break the pool's limit. So a delivery the server made again (delivered > 1) takes
//! the message's attempt claim in the progress bucket (`attempt.<STREAM>.<seq>`, its
//! TTL under the liveness limit) before it looks anything up, renews it while it works,
//! and releases it once settled. A delivery that finds the claim held waits, holding
//! its message with progress acks, until the claim is released or lapses: the holder's
//! call, even one it gave up, may still be open at the upstream, and the TTL is what
//! bounds that. A first delivery takes no claim, so the hot path costs nothing.

use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::delivery::DeliveryInfo;
use super::liveness::{Liveness, LivenessPolicy};
use super::progress::{Progress, Taken, attempt_key};
use webproxy_jetstream::backoff::Backoff;

/// A message's attempt claim, held by this delivery.
#[derive(Debug)]
pub(crate) struct AttemptClaim<'a> {
    progress: &'a Progress,
    key: String,
    delivered: u64,
    revision: u64,
    ttl: Duration,
}

/// How long a claim lives unrenewed: the liveness limit, in the whole seconds a
/// message TTL has (at least one). Under the limit, a claim whose holder died lapses
/// before the server's next redelivery of its message is due.
fn ttl_for(policy: LivenessPolicy) -> Duration {
    Duration::from_secs(policy.limit.as_secs().max(1))
}

/// How soon a delivery that found the claim held tries again: 100 ms more each time,
/// at most a second apart.
const WAIT: Backoff = Backoff::linear(Duration::from_millis(100), Duration::from_secs(1));

/// Takes the attempt claim of the message `info` describes, waiting while another
/// delivery holds it. `None`: this delivery went stale first, and is to be left.
pub(crate) async fn take<'a>(
    progress: &'a Progress,
    info: &DeliveryInfo,
    liveness: &Liveness,
) -> Option<AttemptClaim<'a>> {
    let key = attempt_key(&info.stream, info.seq);
    let mut waits = 0u32;
    loop {
        if !liveness.is_current() {
            return None;
        }
        let ttl = ttl_for(liveness.policy());
        match progress.take_attempt(&key, info.delivered, ttl).await {
            Ok(Taken::Held { revision }) => {
                if waits > 0 {
                    info!(
                        key,
                        delivered = info.delivered,
                        waits,
                        "took the attempt claim"
                    );
                }
                return Some(AttemptClaim {
                    progress,
                    key,
                    delivered: info.delivered,
                    revision,
                    ttl,
                });
            }
            Ok(Taken::Busy { delivered }) => {
                if waits == 0 {
                    info!(key, delivered = info.delivered, holder = %delivered.map_or_else(|| "unknown".to_string(), |n| n.to_string()), "another delivery of this message holds its attempt claim; waiting for it");
                }
            }
            Err(e) => {
                warn!(key, error = %e, "cannot take the attempt claim");
                return None;
            }
        }
        waits = waits.saturating_add(1);
        let pause = WAIT.after(waits).unwrap_or(Duration::from_secs(1));
        tokio::select! {
            () = tokio::time::sleep(pause) => {}
            () = liveness.stale() => return None,
        }
    }
}

impl AttemptClaim<'_> {
    /// Renews the claim every progress period while the delivery is current. A claim
    /// that moved on, or could not be renewed within its TTL, makes the delivery stale:
    /// another delivery may hold it now.
    pub(crate) async fn keep(&mut self, liveness: &Liveness) {
        let mut renewed = Instant::now();
        loop {
            tokio::select! {
                () = tokio::time::sleep(liveness.policy().period) => {}
                () = liveness.stale() => return,
            }
            let ttl = ttl_for(liveness.policy());
            let renewal = self
                .progress
                .renew_attempt(&self.key, self.delivered, self.revision, ttl)
                .await;
            match renewal {
                Ok(Some(revision)) => {
                    self.revision = revision;
                    self.ttl = ttl;
                    renewed = Instant::now();
                }
                Ok(None) => {
                    warn!(
                        key = self.key,
                        "the attempt claim lapsed; the delivery is stale"
                    );
                    liveness.make_stale();
                    return;
                }
                Err(e) if renewed.elapsed() >= self.ttl => {
                    warn!(key = self.key, error = %e, "the attempt claim could not be renewed within its TTL; the delivery is stale");
                    liveness.make_stale();
                    return;
                }
                Err(e) => debug!(key = self.key, error = %e, "the attempt claim was not renewed"),
            }
        }
    }

    /// Releases the claim of a settled delivery, so that a delivery waiting for it
    /// finds the conversation ended at once rather than after the TTL.
    pub(crate) async fn release(self) {
        if let Err(e) = self
            .progress
            .release_attempt(&self.key, self.revision)
            .await
        {
            debug!(key = self.key, error = %e, "the attempt claim was not released; it lapses");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_lapses_before_the_next_redelivery_and_after_a_renewal() {
        for ack_wait in [1, 2, 3, 5, 30, 300] {
            let policy = LivenessPolicy::for_ack_wait(Duration::from_secs(ack_wait));
            let ttl = ttl_for(policy);
            assert!(ttl >= Duration::from_secs(1), "{ack_wait}");
            // renewed at least once within its life
            assert!(
                policy.period < ttl,
                "ack_wait {ack_wait}: {policy:?} {ttl:?}"
            );
            if ack_wait > 1 {
                assert!(ttl <= policy.limit, "ack_wait {ack_wait}: {ttl:?}");
            }
        }
    }
}
