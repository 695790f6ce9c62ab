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

use crate::breaker::Counts;

/// How often the limit moves: consumer updates go through the server's metadata
/// layer, so no more than one per 5 s.
pub(crate) const ADAPT_EVERY: Duration = Duration::from_secs(5);

/// How far the mean latency may rise over its baseline and still count as near it.
const TOLERANCE: f64 = 1.5;

/// Latencies are reported in whole milliseconds: this much more always counts as near
/// the baseline, so an upstream answering in under a millisecond does not look slow.
const SLACK_US: u64 = 1000;

/// The most a step lowers the limit to (half), and the least (a tenth less).
const MAX_DECREASE: f64 = 0.5;
const MIN_DECREASE: f64 = 0.9;

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

/// The next step from `current`, given the cluster's `counts` since the last one:
/// lower when failures appear or the mean latency rose past the baseline, by as much
/// as it rose (at most half, at least a tenth); higher otherwise, by a step that
/// shrinks as the latency nears the threshold. No attempts, no evidence: no change.
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
    let limit = if counts.failures > 0 {
        (limit as f64 * MAX_DECREASE) as u64
    } else if mean as f64 > threshold {
        let factor = (threshold / mean as f64).clamp(MAX_DECREASE, MIN_DECREASE);
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

    #[test]
    fn failures_halve_it_and_it_stays_within_its_bounds() {
        let bounds = Bounds { min: 4, max: 64 };
        let current = Adaptive {
            limit: 40,
            baseline_us: Some(10_000),
        };
        assert_eq!(next_limit(current, counts(10, 1, 10), bounds).limit, 20);
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
