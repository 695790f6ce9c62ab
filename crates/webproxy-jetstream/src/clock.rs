//! The one clock the dispatcher's decisions read ([`now`]), and how far this pod's clock
//! strays from the NATS server's.
//!
//! Decisions compare "now" with times other machines wrote: the server's publish time
//! (`queue_timeout`, `duration_ms`), rate slots, pauses' ends and per-second counts
//! other pods wrote, parked retries' due times (ARCHITECTURE.md, "Clocks", lists them
//! all). NTP keeps clocks within milliseconds; a pod whose clock is off by seconds
//! would expire fresh requests or break a rate. So the pod measures its skew against
//! the server, whose time (`ts`) comes with every consumer info the pool gauges read
//! anyway: no round trip is added, and nothing on the hot path but an atomic load.
//! Beyond [`TOLERANCE`], the skew is logged (at most once per [`WARN_EVERY`]) and every
//! decision reads the server's time as estimated: this pod's clock less the skew.
//! Within it, decisions read this pod's clock, which is what the tolerance allows.
//!
//! The estimator ([`SkewEstimator`]) and the choice of a correction ([`correction`])
//! are pure; the process-wide state is a few atomics.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use time::OffsetDateTime;
use tracing::{info, warn};

/// How far this pod's clock may stray from the server's before decisions stop
/// trusting it: a second, far beyond what NTP leaves and far below any `queue_timeout`,
/// rate window or breaker window the decisions measure.
pub const TOLERANCE: Duration = Duration::from_secs(1);

/// A skew beyond the tolerance is logged when found, then at most this often while it
/// lasts, not once per message.
pub(crate) const WARN_EVERY: Duration = Duration::from_secs(600);

/// How many recent samples the estimate chooses from: with the gauges read every 5 s,
/// about 40 s of one pool's, so a stepped clock is followed within that.
const KEPT_SAMPLES: usize = 8;

/// One reading of the server's clock: this pod's clock when the request was sent and
/// when its answer came, and the server's time in the answer, all Unix microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub sent_us: i64,
    pub received_us: i64,
    pub server_us: i64,
}

impl Sample {
    /// The server wrote its time somewhere between the send and the answer: the
    /// midpoint is the best guess, wrong by at most half the round trip.
    fn skew(&self) -> Skew {
        let round_trip = self.received_us.saturating_sub(self.sent_us).max(0);
        let midpoint = self.sent_us.saturating_add(round_trip / 2);
        Skew {
            ahead_us: midpoint.saturating_sub(self.server_us),
            error_us: round_trip / 2 + round_trip % 2,
        }
    }
}

/// How far this pod's clock runs ahead of the server's (negative: behind), and how
/// wrong that may be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Skew {
    pub ahead_us: i64,
    pub error_us: i64,
}

impl Skew {
    /// Whether the skew is beyond `tolerance` even at its smallest.
    pub(crate) fn beyond(&self, tolerance: Duration) -> bool {
        let tolerance = i64::try_from(tolerance.as_micros()).unwrap_or(i64::MAX);
        self.ahead_us.saturating_abs().saturating_sub(self.error_us) > tolerance
    }
}

/// The skew from the recent samples: the one with the shortest round trip, the least
/// disturbed by a slow server or network (as NTP's clock filter chooses).
#[derive(Debug, Default)]
pub(crate) struct SkewEstimator {
    recent: VecDeque<Sample>,
}

impl SkewEstimator {
    pub(crate) const fn new() -> SkewEstimator {
        SkewEstimator {
            recent: VecDeque::new(),
        }
    }

    /// Adds `sample`, forgetting the oldest beyond [`KEPT_SAMPLES`]; the estimate now.
    pub(crate) fn add(&mut self, sample: Sample) -> Skew {
        if self.recent.len() == KEPT_SAMPLES {
            self.recent.pop_front();
        }
        self.recent.push_back(sample);
        self.estimate().unwrap_or(sample.skew())
    }

    /// The estimate, if any sample was taken.
    pub(crate) fn estimate(&self) -> Option<Skew> {
        self.recent
            .iter()
            .map(Sample::skew)
            .min_by_key(|skew| skew.error_us)
    }
}

/// What decisions subtract from this pod's clock to read the server's: the skew when it
/// is beyond `tolerance`, else nothing (within it, this pod's clock is trusted).
pub(crate) fn correction(skew: Skew, tolerance: Duration) -> i64 {
    if skew.beyond(tolerance) {
        skew.ahead_us
    } else {
        0
    }
}

/// What this process knows of its clock.
struct Clock {
    /// Microseconds [`now`] subtracts from this pod's clock.
    correction_us: AtomicI64,
    /// The latest estimate of the skew, for the gauge.
    ahead_us: AtomicI64,
    measured: AtomicBool,
    estimator: Mutex<SkewEstimator>,
    /// When a skew beyond the tolerance was last logged; `None` while within it.
    warned: Mutex<Option<Instant>>,
}

static CLOCK: Clock = Clock {
    correction_us: AtomicI64::new(0),
    ahead_us: AtomicI64::new(0),
    measured: AtomicBool::new(false),
    estimator: Mutex::new(SkewEstimator::new()),
    warned: Mutex::new(None),
};

/// "Now" for every decision: this pod's clock, or the server's time as estimated when
/// this pod's clock strays beyond [`TOLERANCE`].
pub fn now() -> SystemTime {
    shift(local(), -CLOCK.correction_us.load(Ordering::Relaxed))
}

/// [`now`] as an `OffsetDateTime`, for the pools' state.
pub fn now_utc() -> OffsetDateTime {
    OffsetDateTime::from(now())
}

/// This pod's own clock: the system's, moved by `WEBPROXY_TEST_CLOCK_OFFSET` in test
/// builds (`test-hooks`). Only the skew's samples read it.
pub fn local() -> SystemTime {
    shift(SystemTime::now(), test_clock_offset_us())
}

/// `WEBPROXY_TEST_CLOCK_OFFSET` (`5s`, `-5s`, `250ms`): how far this process's clock
/// runs ahead of the system's, in microseconds, so a fault test can skew one pod's
/// clock (`clock::local`); read once. Always 0 without the feature, or when unset or
/// unreadable.
fn test_clock_offset_us() -> i64 {
    #[cfg(feature = "test-hooks")]
    {
        static OFFSET: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
        *OFFSET.get_or_init(|| {
            let Ok(text) = std::env::var("WEBPROXY_TEST_CLOCK_OFFSET") else {
                return 0;
            };
            let (sign, magnitude) = match text.trim().strip_prefix('-') {
                Some(rest) => (-1, rest),
                None => (1, text.trim()),
            };
            match humantime::parse_duration(magnitude) {
                Ok(offset) => {
                    tracing::warn!(offset = %text, "test clock offset switched on");
                    sign * i64::try_from(offset.as_micros()).unwrap_or(i64::MAX)
                }
                Err(e) => {
                    tracing::warn!(offset = %text, error = %e, "unreadable test clock offset; ignored");
                    0
                }
            }
        })
    }
    #[cfg(not(feature = "test-hooks"))]
    0
}

/// Microseconds since the Unix epoch (negative before it).
pub fn unix_us(time: SystemTime) -> i64 {
    match time.duration_since(UNIX_EPOCH) {
        Ok(after) => i64::try_from(after.as_micros()).unwrap_or(i64::MAX),
        Err(before) => -i64::try_from(before.duration().as_micros()).unwrap_or(i64::MAX),
    }
}

/// `time` moved by `us` microseconds.
fn shift(time: SystemTime, us: i64) -> SystemTime {
    let by = Duration::from_micros(us.unsigned_abs());
    let shifted = if us >= 0 {
        time.checked_add(by)
    } else {
        time.checked_sub(by)
    };
    shifted.unwrap_or(time)
}

/// Takes one reading of the server's clock into the estimate: the gauge follows it,
/// decisions switch to the server's time while the skew is beyond the tolerance, and a
/// change across the tolerance is logged.
pub fn observe(sample: Sample) {
    let skew = CLOCK
        .estimator
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .add(sample);
    CLOCK.ahead_us.store(skew.ahead_us, Ordering::Relaxed);
    CLOCK.measured.store(true, Ordering::Relaxed);
    let correction_us = correction(skew, TOLERANCE);
    CLOCK.correction_us.store(correction_us, Ordering::Relaxed);
    let mut warned = CLOCK.warned.lock().unwrap_or_else(PoisonError::into_inner);
    let seconds = skew.ahead_us as f64 / 1e6;
    if correction_us == 0 {
        if warned.take().is_some() {
            info!(
                skew_seconds = seconds,
                "this pod's clock agrees with the NATS server's again; decisions read it again"
            );
        }
        return;
    }
    if warned.is_none_or(|at| at.elapsed() >= WARN_EVERY) {
        *warned = Some(Instant::now());
        warn!(
            skew_seconds = seconds,
            error_seconds = skew.error_us as f64 / 1e6,
            tolerance_seconds = TOLERANCE.as_secs_f64(),
            "this pod's clock runs {seconds:.3} s ahead of the NATS server's (negative: behind), beyond the tolerance; decisions read the server's time instead"
        );
    }
}

/// The latest skew in seconds (this pod's clock ahead of the server's), once measured.
pub fn skew_seconds() -> Option<f64> {
    CLOCK
        .measured
        .load(Ordering::Relaxed)
        .then(|| CLOCK.ahead_us.load(Ordering::Relaxed) as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000_000;
    const MS: i64 = 1_000;

    fn sample(sent_us: i64, round_trip_us: i64, server_us: i64) -> Sample {
        Sample {
            sent_us,
            received_us: sent_us + round_trip_us,
            server_us,
        }
    }

    #[test]
    fn a_sample_reads_the_skew_at_the_midpoint_of_its_round_trip() {
        // Sent at 100 s, answered 10 ms later; the server said 95.005 s: 5 s ahead.
        let skew = sample(100 * S, 10 * MS, 95 * S + 5 * MS).skew();
        assert_eq!(
            skew,
            Skew {
                ahead_us: 5 * S,
                error_us: 5 * MS
            }
        );
        // Behind: the server is later than this pod.
        let behind = sample(100 * S, 0, 103 * S).skew();
        assert_eq!(behind.ahead_us, -3 * S);
    }

    #[test]
    fn the_estimate_is_the_sample_with_the_shortest_round_trip() {
        let mut estimator = SkewEstimator::new();
        assert!(estimator.estimate().is_none());
        // A slow answer (2 s) suggests 4 s ahead; a quick one says 5 s.
        estimator.add(sample(100 * S, 2 * S, 100 * S - 4 * S + S));
        let skew = estimator.add(sample(110 * S, 2 * MS, 105 * S + MS));
        assert_eq!(
            skew,
            Skew {
                ahead_us: 5 * S,
                error_us: MS
            }
        );
        // A later slow sample does not displace the quick one.
        let skew = estimator.add(sample(120 * S, 3 * S, 120 * S));
        assert_eq!(skew.ahead_us, 5 * S);
    }

    #[test]
    fn old_samples_are_forgotten_so_a_stepped_clock_is_followed() {
        let mut estimator = SkewEstimator::new();
        estimator.add(sample(0, 0, -5 * S));
        for k in 1..KEPT_SAMPLES as i64 {
            assert_eq!(estimator.add(sample(k * S, MS, k * S)).ahead_us, 5 * S);
        }
        // The quick sample of 5 s ahead has now been pushed out.
        let skew = estimator.add(sample(100 * S, MS, 100 * S));
        assert_eq!(skew.ahead_us, MS / 2);
    }

    #[test]
    fn decisions_fall_back_to_the_server_time_only_beyond_the_tolerance() {
        let tolerance = Duration::from_secs(1);
        let within = Skew {
            ahead_us: 900 * MS,
            error_us: MS,
        };
        assert_eq!(correction(within, tolerance), 0);
        let ahead = Skew {
            ahead_us: 5 * S,
            error_us: 10 * MS,
        };
        assert_eq!(correction(ahead, tolerance), 5 * S);
        let behind = Skew {
            ahead_us: -5 * S,
            error_us: 10 * MS,
        };
        assert_eq!(correction(behind, tolerance), -5 * S);
        // 1.2 s measured over a 1 s round trip may be 0.7 s: not surely beyond.
        let unsure = Skew {
            ahead_us: 1_200 * MS,
            error_us: 500 * MS,
        };
        assert_eq!(correction(unsure, tolerance), 0);
    }

    #[test]
    fn the_server_time_is_the_pod_clock_less_the_correction() {
        let at = UNIX_EPOCH + Duration::from_secs(100);
        assert_eq!(unix_us(shift(at, -5 * S)), 95 * S);
        assert_eq!(unix_us(shift(at, 5 * S)), 105 * S);
        assert_eq!(unix_us(UNIX_EPOCH - Duration::from_secs(1)), -S);
    }
}
