//! The retry schedule (the seed's RetryDelay and BackoffFactor): pure arithmetic over
//! durations, with the randomness passed in so that it is testable.

use std::time::{Duration, SystemTime};

use serde::Serialize;

/// How often and how fast a rule's requests are retried.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RetryPolicy {
    pub max_retries: u32,
    #[serde(with = "humantime_serde")]
    pub retry_delay: Duration,
    pub backoff_factor: f64,
    #[serde(with = "humantime_serde")]
    pub max_retry_delay: Duration,
    /// A fraction: 0.2 spreads each wait by ±20%.
    pub jitter: f64,
}

impl RetryPolicy {
    /// The most attempts a conversation gets.
    pub fn max_attempts(&self) -> u32 {
        self.max_retries.saturating_add(1)
    }

    /// The wait after attempt `attempt` (1-based) before the next one:
    /// `retry_delay * backoff_factor^(attempt-1)`, capped by `max_retry_delay`, then
    /// spread by `jitter` with `unit` drawn uniformly from [-1, 1]. The spread never
    /// lifts a wait above the cap.
    pub fn delay_after(&self, attempt: u32, unit: f64) -> Duration {
        let exponent = i32::try_from(attempt.saturating_sub(1)).unwrap_or(i32::MAX);
        let cap = self.max_retry_delay.as_secs_f64();
        let base = (self.retry_delay.as_secs_f64() * self.backoff_factor.powi(exponent)).min(cap);
        let spread = base * (1.0 + self.jitter * unit.clamp(-1.0, 1.0));
        Duration::from_secs_f64(spread.clamp(0.0, cap))
    }

    /// The wait when the upstream asked for `retry_after`: the longer of the two, but
    /// never more than `max_retry_delay` (the next attempt then meets the upstream's
    /// verdict again).
    pub fn with_retry_after(&self, scheduled: Duration, retry_after: Option<Duration>) -> Duration {
        scheduled
            .max(retry_after.unwrap_or_default())
            .min(self.max_retry_delay)
    }
}

/// Parses a `Retry-After` value: delay seconds or an HTTP date, relative to `now`.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(delay_ms: u64, factor: f64, cap_s: u64, jitter: f64) -> RetryPolicy {
        RetryPolicy {
            max_retries: 5,
            retry_delay: Duration::from_millis(delay_ms),
            backoff_factor: factor,
            max_retry_delay: Duration::from_secs(cap_s),
            jitter,
        }
    }

    #[test]
    fn geometric_schedule() {
        let p = policy(4000, 1.5, 300, 0.0);
        let waits: Vec<_> = (1..=4).map(|k| p.delay_after(k, 0.0)).collect();
        assert_eq!(
            waits,
            [4000, 6000, 9000, 13500]
                .map(Duration::from_millis)
                .to_vec()
        );
        assert_eq!(p.max_attempts(), 6);
    }

    #[test]
    fn cap_applies() {
        let p = policy(1000, 10.0, 5, 0.0);
        assert_eq!(p.delay_after(1, 0.0), Duration::from_secs(1));
        assert_eq!(p.delay_after(2, 0.0), Duration::from_secs(5));
        assert_eq!(p.delay_after(60, 0.0), Duration::from_secs(5));
    }

    #[test]
    fn jitter_stays_within_bounds_and_under_the_cap() {
        let p = policy(1000, 1.0, 60, 0.2);
        assert_eq!(p.delay_after(1, -1.0), Duration::from_millis(800));
        assert_eq!(p.delay_after(1, 1.0), Duration::from_millis(1200));
        for i in -10..=10 {
            let d = p.delay_after(1, f64::from(i) / 10.0);
            assert!(
                d >= Duration::from_millis(800) && d <= Duration::from_millis(1200),
                "{d:?}"
            );
        }
        // out-of-range randomness is clamped
        assert_eq!(p.delay_after(1, 7.0), Duration::from_millis(1200));
        let capped = policy(1000, 10.0, 5, 0.5);
        assert!(capped.delay_after(3, 1.0) <= Duration::from_secs(5));
    }

    #[test]
    fn retry_after_stretches_but_the_cap_wins() {
        let p = policy(100, 2.0, 10, 0.0);
        let scheduled = p.delay_after(1, 0.0);
        assert_eq!(
            p.with_retry_after(scheduled, Some(Duration::from_secs(1))),
            Duration::from_secs(1)
        );
        assert_eq!(p.with_retry_after(scheduled, None), scheduled);
        assert_eq!(
            p.with_retry_after(scheduled, Some(Duration::from_secs(3600))),
            Duration::from_secs(10)
        );
        assert_eq!(
            p.with_retry_after(Duration::from_secs(2), Some(Duration::from_secs(1))),
            Duration::from_secs(2)
        );
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        assert_eq!(parse_retry_after("1", now), Some(Duration::from_secs(1)));
        assert_eq!(
            parse_retry_after(" 120 ", now),
            Some(Duration::from_secs(120))
        );
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            parse_retry_after(&later, now),
            Some(Duration::from_secs(30))
        );
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(parse_retry_after(&earlier, now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("soon", now), None);
        assert_eq!(parse_retry_after("-1", now), None);
    }
}
