//! The adaptive concurrency limit of a pool (`[pools.NAME] adaptive = true`): one
//! limit for the cluster, moved by additive increase and multiplicative decrease from
//! the latencies and failures every instance reports, as Vector's adaptive request
//! concurrency and Netflix's concurrency-limits do. Pure, unit-tested.
//!
//! The owner of the pool consumers' settings calls [`next_limit`] once per
//! [`ADAPT_EVERY`] with the cluster's counts since its last step, and writes the
//! result into the pool's state, from which it sets the consumer's `max_ack_pending`:
//! so at most one consumer update per interval, as the server's metadata layer wants.

use std::time::Duration;

use crate::pool::breaker::Counts;

/// How often the limit moves: consumer updates go through the server's metadata
/// layer, so no more than one per 5 s.
pub(crate) const ADAPT_EVERY: Duration = Duration::from_secs(5);

/// How far the mean latency may rise over its baseline and still count as near it.
const TOLERANCE: f64 = 1.5;

/// Latencies are reported in whole milliseconds: this much more always counts as near
/// the baseline, so an upstream answering in under a millisecond does not look slow.
const SLACK_US: u64 = 1000;

/// The most a step lowers the limit to (half), and the least a latency above its
/// threshold lowers it by (a tenth).
const MAX_DECREASE: f64 = 0.5;
const MIN_DECREASE: f64 = 0.9;

/// The share of a step's attempts that may fail with no decrease: every upstream
/// fails now and then, and a limit halved on each stray failure stays near its
/// minimum (issue 29: a mean of 9 of 64 at a 0.1 % failure rate).
const FAILURE_THRESHOLD: f64 = 0.01;

/// The most each failure of a step lowers the limit by: one failure among few
/// attempts is a high ratio on little evidence, so it takes at most a tenth off.
const DECREASE_PER_FAILURE: f64 = 0.1;

/// A pool's adaptive limit and the latency it measures against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Adaptive {
    pub(crate) limit: u64,
    /// The latency near which the limit rises, in microseconds: the lowest mean seen,
    /// allowed to creep up 5 % per step, so an upstream that became slower for good
    /// gets a new baseline instead of a limit stuck at its minimum.
    pub(crate) baseline_us: Option<u64>,
}

/// The limit's bounds: `min_in_flight` and `max_in_flight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) min: u64,
    pub(crate) max: u64,
}

impl Bounds {
    /// How much one step raises the limit at most (latency at its baseline): a tenth
    /// of `max_in_flight`, so the limit can climb its whole range in under a minute.
    fn increase(&self) -> f64 {
        (self.max as f64 / 10.0).max(1.0)
    }
}

/// The limit a pool starts with when it has none yet: its minimum, from which a
/// healthy upstream raises it within a few steps (and its baseline is measured at a
/// concurrency the upstream copes with).
pub(crate) fn start(bounds: Bounds) -> Adaptive {
    Adaptive {
        limit: bounds.min,
        baseline_us: None,
    }
}

/// What a step's failures leave of the limit, when their share of its attempts is
/// past [`FAILURE_THRESHOLD`]: one less that share (so 20 % failures take a fifth
/// off), at most [`DECREASE_PER_FAILURE`] per failure, and never below half.
fn failure_factor(counts: Counts) -> Option<f64> {
    let ratio = counts.failures as f64 / counts.attempts.max(1) as f64;
    (ratio > FAILURE_THRESHOLD).then(|| {
        let decrease = ratio.min(counts.failures as f64 * DECREASE_PER_FAILURE);
        (1.0 - decrease).max(MAX_DECREASE)
    })
}

/// The next step from `current`, given the cluster's `counts` since the last one:
/// lower when the failures' share passes [`FAILURE_THRESHOLD`] (by that share, see
/// [`failure_factor`]) or the mean latency rose past the baseline (by as much as it
/// rose, at most half, at least a tenth), by the larger of the two decreases; higher
/// otherwise, by a step that shrinks as the latency nears the threshold. No attempts,
/// no evidence: no change.
pub(crate) fn next_limit(current: Adaptive, counts: Counts, bounds: Bounds) -> Adaptive {
    let Some(mean) = counts.mean_latency_us() else {
        return current;
    };
    let baseline = match current.baseline_us {
        Some(baseline) => mean.min(baseline + baseline / 20),
        None => mean,
    };
    let threshold = baseline as f64 * TOLERANCE + SLACK_US as f64;
    let limit = current.limit.clamp(bounds.min, bounds.max);
    let slower = (mean as f64 > threshold)
        .then(|| (threshold / mean as f64).clamp(MAX_DECREASE, MIN_DECREASE));
    let factor = match (failure_factor(counts), slower) {
        (Some(failures), Some(slower)) => Some(failures.min(slower)),
        (failures, slower) => failures.or(slower),
    };
    let limit = if let Some(factor) = factor {
        ((limit as f64 * factor) as u64).min(limit.saturating_sub(1))
    } else {
        // The full step at the baseline, less as the latency nears the threshold, so
        // the limit slows down before the knee instead of overshooting it.
        let headroom = ((threshold - mean as f64) / (threshold - baseline as f64)).clamp(0.0, 1.0);
        limit + ((bounds.increase() * headroom).round() as u64).max(1)
    };
    Adaptive {
        limit: limit.clamp(bounds.min, bounds.max),
        baseline_us: Some(baseline),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: Bounds = Bounds { min: 1, max: 64 };

    fn counts(attempts: u64, failures: u64, mean_ms: u64) -> Counts {
        Counts {
            attempts,
            failures,
            latency_ms: attempts * mean_ms,
        }
    }

    /// The upstream: 10 ms up to `knee` in flight, growing as (n / knee)² × 10 ms
    /// above it, with every slot of the limit in use.
    fn latency_ms(limit: u64, knee: u64) -> u64 {
        let ratio = (limit as f64 / knee as f64).max(1.0);
        (ratio * ratio * 10.0) as u64
    }

    fn run(mut adaptive: Adaptive, knee: u64, steps: usize) -> Vec<u64> {
        (0..steps)
            .map(|_| {
                let latency = latency_ms(adaptive.limit, knee);
                adaptive = next_limit(adaptive, counts(100, 0, latency), BOUNDS);
                adaptive.limit
            })
            .collect()
    }

    #[test]
    fn it_settles_near_the_knee_and_follows_it_when_it_moves() {
        let limits = run(start(BOUNDS), 8, 12);
        let settled = &limits[limits.len() - 4..];
        assert!(settled.iter().all(|l| (4..=24).contains(l)), "{limits:?}");
        let after = Adaptive {
            limit: *limits.last().expect("limits"),
            baseline_us: Some(10_000),
        };
        let mut moved = run(after, 32, 12);
        moved.sort_unstable();
        assert!(moved[moved.len() / 2] > 24, "{moved:?}");
    }

    /// Issue 29, point 8 of its table: failures lower the limit by their share of the
    /// step's attempts once it passes 1 %, at most a tenth per failure and at most half;
    /// a single failure never halves it. (Before, any failure halved it: 40 became 20.)
    #[test]
    fn failures_lower_it_by_their_ratio_and_it_stays_within_its_bounds() {
        let bounds = Bounds { min: 4, max: 64 };
        let current = Adaptive {
            limit: 40,
            baseline_us: Some(10_000),
        };
        let after = |counts| next_limit(current, counts, bounds).limit;
        // 1 of 10: a tenth off; 1 of 1: still a tenth, on so little evidence.
        assert_eq!(after(counts(10, 1, 10)), 36);
        assert_eq!(after(counts(1, 1, 10)), 36);
        // 20 of 100: a fifth off; 60 of 100: half at most.
        assert_eq!(after(counts(100, 20, 10)), 32);
        assert_eq!(after(counts(100, 60, 10)), 20);
        // Up to 1 %: no decrease, the limit rises as with none.
        assert_eq!(after(counts(1000, 10, 10)), after(counts(1000, 0, 10)));
        assert!(after(counts(1000, 10, 10)) > 40);
        // Failures and a slower upstream: the larger decrease of the two.
        assert_eq!(after(counts(100, 5, 100)), 20);
        let low = Adaptive {
            limit: 5,
            baseline_us: Some(10_000),
        };
        assert_eq!(next_limit(low, counts(10, 5, 10), bounds).limit, 4);
        let high = Adaptive {
            limit: 63,
            baseline_us: Some(10_000),
        };
        assert_eq!(next_limit(high, counts(10, 0, 10), bounds).limit, 64);
        assert_eq!(next_limit(high, Counts::default(), bounds), high);
    }

    /// The mean limit over `steps` steps from the start against an upstream answering
    /// in 50 ms at any concurrency, each call failing with probability `failure_rate`
    /// (a seeded generator, so the run is the same every time). Every slot of the
    /// limit is busy: a step of 5 s makes limit × 5 s / 50 ms attempts.
    fn mean_limit(failure_rate: f64, steps: usize) -> f64 {
        let mut rng = fastrand::Rng::with_seed(29);
        let mut adaptive = start(BOUNDS);
        let mut sum = 0;
        for _ in 0..steps {
            let attempts = adaptive.limit * (ADAPT_EVERY.as_millis() as u64 / 50);
            let failures = (0..attempts).filter(|_| rng.f64() < failure_rate).count() as u64;
            adaptive = next_limit(adaptive, counts(attempts, failures, 50), BOUNDS);
            sum += adaptive.limit;
        }
        sum as f64 / steps as f64
    }

    /// Issue 29's done-when: at a 0.1 % failure rate, 50 ms latency and
    /// `max_in_flight` 64, the mean limit is at least 0.8 × the mean with no failures
    /// (halving on any failure gave a mean of about 9).
    #[test]
    fn a_failure_rate_of_a_tenth_of_a_percent_keeps_the_limit_high() {
        let (healthy, failing) = (mean_limit(0.0, 120), mean_limit(0.001, 120));
        println!("mean limit: {healthy:.1} with no failures, {failing:.1} at 0.1 %");
        assert!(
            failing >= 0.8 * healthy,
            "{failing:.1} against {healthy:.1}"
        );
    }

    #[test]
    fn the_baseline_is_the_lowest_mean_and_creeps_up_slowly() {
        let current = Adaptive {
            limit: 10,
            baseline_us: Some(10_000),
        };
        let slower = next_limit(current, counts(10, 0, 100), BOUNDS);
        assert_eq!(slower.baseline_us, Some(10_500));
        assert!(slower.limit < 10);
        let faster = next_limit(current, counts(10, 0, 5), BOUNDS);
        assert_eq!(faster.baseline_us, Some(5_000));
        assert_eq!(faster.limit, 16);
    }
}
