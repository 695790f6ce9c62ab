//! The one backoff: how long every retry loop waits after a run of failures
//! (publishing, pulling, reconnecting, provisioning; the gateway's id records too). A
//! loop keeps its own numbers next to it as a `const`; the two schedules loops in
//! several folders share ([`PULL_BACKOFF`], [`START_BACKOFF`]) and the loop that
//! retries a step at start until it is done ([`retry_until_done`]) are here.
//!
//! The delays are pure functions of the number of failures in a row, so a loop keeps
//! a counter, resets it on success, and asks for the wait.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::warn;

/// A retry policy: the wait after `n` failures in a row grows linearly or doubles,
/// up to a cap, optionally within a budget of tries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    first: Duration,
    growth: Growth,
    max: Duration,
    /// The most tries in all (the first included); `None` is no limit.
    tries: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Growth {
    /// `first * n`.
    Linear,
    /// `first * 2^(n-1)`.
    Doubling,
}

impl Backoff {
    /// Waits `step`, `2 * step`, `3 * step`, ... up to `max`.
    pub const fn linear(step: Duration, max: Duration) -> Backoff {
        Backoff {
            first: step,
            growth: Growth::Linear,
            max,
            tries: None,
        }
    }

    /// Waits `first`, `2 * first`, `4 * first`, ... up to `max`.
    pub const fn doubling(first: Duration, max: Duration) -> Backoff {
        Backoff {
            first,
            growth: Growth::Doubling,
            max,
            tries: None,
        }
    }

    /// Gives up once `tries` tries (the first included) have failed.
    pub const fn tries(self, tries: u32) -> Backoff {
        Backoff {
            tries: Some(tries),
            ..self
        }
    }

    /// The wait after `failures` failures in a row: none after none, and `None` once
    /// the budget of tries is spent.
    pub fn after(&self, failures: u32) -> Option<Duration> {
        if self.tries.is_some_and(|tries| failures >= tries) {
            return None;
        }
        let Some(n) = failures.checked_sub(1) else {
            return Some(Duration::ZERO);
        };
        let wait = match self.growth {
            Growth::Linear => self.first.saturating_mul(failures),
            // 2^31 times anything beyond a nanosecond is past any cap.
            Growth::Doubling => self.first.saturating_mul(1u32 << n.min(31)),
        };
        Some(wait.min(self.max))
    }

    /// Waits [`Backoff::after`] `failures`; false when the budget is spent or
    /// `shutdown` comes first, so the loop stops.
    pub async fn wait(&self, failures: u32, shutdown: &CancellationToken) -> bool {
        let Some(wait) = self.after(failures) else {
            return false;
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => true,
            _ = shutdown.cancelled() => false,
        }
    }
}

/// Pulling (the pull loop, the parked retries' consumer) and following a bucket (a lost
/// watch made again): after failures or quick empty pulls in a row, 100 ms more per
/// failure, at most 2 s, forever; until shutdown.
pub const PULL_BACKOFF: Backoff =
    Backoff::linear(Duration::from_millis(100), Duration::from_secs(2));

/// Provisioning and migrating parked retries, at start: 200 ms after the first failure,
/// doubling to at most 5 s, forever; until a signal.
pub(crate) const START_BACKOFF: Backoff =
    Backoff::doubling(Duration::from_millis(200), Duration::from_secs(5));

/// Runs `step` until it succeeds, waiting [`START_BACKOFF`] between tries (provisioning and migrating
/// at start, the configuration bucket's reads at start, `crate::config_store`); `None` when
/// `shutdown` is cancelled first.
///
/// A failure unlike the one before is progress, and the backoff starts again: two
/// instances that start together create the same replicated streams, and of two
/// equal creates in flight one was seen answered late or not at all (10 s did not
/// do), so each step of provisioning can time out once and then find its stream made. A backoff that grew over those
/// steps took a start past 30 s.
pub async fn retry_until_done<T, E, F, Fut>(
    what: &str,
    shutdown: &CancellationToken,
    mut step: F,
) -> Option<T>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut failures = 0u32;
    let mut last_failure = String::new();
    loop {
        match step().await {
            Ok(done) => return Some(done),
            Err(e) => {
                warn!(error = %e, "{what} failed; retrying");
                let failure = e.to_string();
                failures = next_failures(failures, &last_failure, &failure);
                last_failure = failure;
            }
        }
        if !START_BACKOFF.wait(failures, shutdown).await {
            return None;
        }
    }
}

/// The count of failures in a row to back off by (pure): one more after the same
/// failure again, and one (the shortest wait) after a failure unlike the last.
fn next_failures(failures: u32, last: &str, now: &str) -> u32 {
    if last == now {
        failures.saturating_add(1)
    } else {
        1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn waits(backoff: Backoff, failures: std::ops::RangeInclusive<u32>) -> Vec<Option<u64>> {
        failures
            .map(|n| backoff.after(n).map(|d| d.as_millis() as u64))
            .collect()
    }

    #[test]
    fn no_failure_waits_nothing() {
        assert_eq!(Backoff::linear(ms(100), ms(1000)).after(0), Some(ms(0)));
        assert_eq!(Backoff::doubling(ms(50), ms(1000)).after(0), Some(ms(0)));
    }

    #[test]
    fn linear_grows_by_its_step_to_the_cap() {
        let b = Backoff::linear(ms(100), ms(2000));
        assert_eq!(
            waits(b, 1..=4),
            [Some(100), Some(200), Some(300), Some(400)]
        );
        assert_eq!(b.after(20), Some(ms(2000)));
        assert_eq!(b.after(21), Some(ms(2000)));
        assert_eq!(b.after(u32::MAX), Some(ms(2000)));
    }

    #[test]
    fn doubling_doubles_to_the_cap() {
        let b = Backoff::doubling(ms(200), ms(5000));
        assert_eq!(
            waits(b, 1..=6),
            [
                Some(200),
                Some(400),
                Some(800),
                Some(1600),
                Some(3200),
                Some(5000)
            ]
        );
        assert_eq!(b.after(40), Some(ms(5000)));
        assert_eq!(b.after(u32::MAX), Some(ms(5000)));
    }

    #[test]
    fn a_budget_ends_the_waits() {
        // Eight tries: seven waits between them, then none.
        let b = Backoff::doubling(ms(50), ms(1000)).tries(8);
        assert_eq!(
            waits(b, 1..=8),
            [
                Some(50),
                Some(100),
                Some(200),
                Some(400),
                Some(800),
                Some(1000),
                Some(1000),
                None
            ]
        );
        assert_eq!(b.after(9), None);
    }

    #[tokio::test]
    async fn wait_sleeps_the_delay() {
        let b = Backoff::linear(ms(10), ms(1000));
        let start = std::time::Instant::now();
        let waited = tokio::time::timeout(ms(5000), b.wait(3, &CancellationToken::new())).await;
        assert_eq!(waited, Ok(true));
        assert!(start.elapsed() >= ms(30), "{:?}", start.elapsed());
    }

    #[tokio::test]
    async fn wait_stops_at_shutdown_or_an_empty_budget() {
        // An hour's wait: only shutdown or the budget can end these within the timeout.
        let b = Backoff::linear(Duration::from_secs(3600), Duration::from_secs(3600)).tries(2);
        let shutdown = CancellationToken::new();
        shutdown.cancel();
        let stopped = tokio::time::timeout(ms(5000), b.wait(1, &shutdown)).await;
        assert_eq!(stopped, Ok(false));
        let spent = tokio::time::timeout(ms(5000), b.wait(2, &CancellationToken::new())).await;
        assert_eq!(spent, Ok(false));
    }

    #[test]
    fn pulling_waits_100_ms_more_per_failure_up_to_two_seconds() {
        assert_eq!(PULL_BACKOFF.after(1), Some(ms(100)));
        assert_eq!(PULL_BACKOFF.after(7), Some(ms(700)));
        assert_eq!(PULL_BACKOFF.after(20), Some(ms(2000)));
        assert_eq!(PULL_BACKOFF.after(u32::MAX), Some(ms(2000)));
    }

    #[test]
    fn a_failure_unlike_the_last_starts_the_backoff_again() {
        assert_eq!(next_failures(0, "", "stream A timed out"), 1);
        assert_eq!(
            next_failures(1, "stream A timed out", "stream A timed out"),
            2
        );
        assert_eq!(
            next_failures(2, "stream A timed out", "stream B timed out"),
            1
        );
        assert_eq!(next_failures(u32::MAX, "x", "x"), u32::MAX);
    }

    #[test]
    fn starting_waits_200_ms_doubling_to_5_s() {
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(START_BACKOFF.after(1), ms(200));
        assert_eq!(START_BACKOFF.after(2), ms(400));
        assert_eq!(START_BACKOFF.after(5), ms(3200));
        assert_eq!(START_BACKOFF.after(6), ms(5000));
        assert_eq!(START_BACKOFF.after(u32::MAX), ms(5000));
    }
}
