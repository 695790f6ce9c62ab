//! The pure arithmetic of a pool's cluster-wide rate schedule (`[pools.NAME] rate =
//! "10/s"`, `burst`; the [`Rate`] is `webproxy-config`'s). Pure: `super::limiter`
//! stores the schedule in KV and waits for the slots it claims.
//!
//! The schedule is a sequence of slots, one every `1 / rate` seconds; the one value
//! stored per pool is the time of the next unclaimed slot. An instance claims a few
//! consecutive slots at once with a compare-and-set, then starts one attempt at each
//! slot's time. A slot not used within [`SLOT_LEASE`] of its time is dropped, so an
//! instance that dies holding slots costs at most that, and no stale slot can crowd a
//! later second: over any 1 s window at most `rate × (1 s + SLOT_LEASE)` slots' times,
//! plus the `burst` slots an idle pool may claim at once, can fall.

use std::time::Duration;

use webproxy_config::rate::Rate;

/// How long after its time a claimed slot may still be used, and how far ahead one
/// claim reaches: half the tenth of a second the margin allows over `rate` in any 1 s
/// window. The other half is for the way from the slot to the upstream (a loaded
/// machine's late wake-ups, the request itself), which the upstream's own count
/// includes: with the whole tenth for the lease, a loaded machine went over.
pub(crate) const SLOT_LEASE: Duration = Duration::from_millis(50);

/// A pool's schedule, in microseconds since the Unix epoch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Schedule {
    interval_us: u64,
    burst: u64,
}

/// Slots claimed at once: `count` of them, the first at `first_us`, one every
/// `interval_us`; `next_us` is what the stored value becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotClaim {
    pub(crate) first_us: u64,
    pub(crate) count: u64,
    pub(crate) interval_us: u64,
    pub(crate) next_us: u64,
}

impl SlotClaim {
    /// The claimed slots' times.
    pub(crate) fn slots(&self) -> impl Iterator<Item = u64> + use<> {
        let SlotClaim {
            first_us,
            interval_us,
            count,
            ..
        } = *self;
        (0..count).map(move |k| first_us + k * interval_us)
    }
}

impl Schedule {
    pub(crate) fn new(rate: Rate, burst: u32) -> Schedule {
        let interval_us = u64::try_from(rate.interval().as_micros())
            .unwrap_or(u64::MAX)
            .max(1);
        Schedule {
            interval_us,
            burst: u64::from(burst.max(1)),
        }
    }

    /// The most slots one claim takes: those within [`SLOT_LEASE`], at least one.
    fn batch(&self) -> u64 {
        (SLOT_LEASE.as_micros() as u64 / self.interval_us).max(1)
    }

    /// Claims up to `wanted` slots at `now_us`, after `stored_next_us` (none: the
    /// schedule is new). Slots an idle pool has saved up, at most `burst`, start in the
    /// past; the rest follow those others claimed, however far ahead that is.
    pub(crate) fn claim(&self, stored_next_us: Option<u64>, now_us: u64, wanted: u64) -> SlotClaim {
        let saved = (self.burst - 1).saturating_mul(self.interval_us);
        let earliest = now_us.saturating_sub(saved);
        let first_us = stored_next_us.map_or(earliest, |next| next.max(earliest));
        // A burst may be claimed whole; otherwise no more than the batch.
        let in_burst = now_us.saturating_sub(first_us) / self.interval_us + 1;
        let count = wanted.clamp(1, self.batch().max(in_burst.min(self.burst)));
        SlotClaim {
            first_us,
            count,
            interval_us: self.interval_us,
            next_us: first_us + count * self.interval_us,
        }
    }

    /// Where a claim starts from: the stored next slot, or the next slot this instance
    /// last wrote (`known_next_us`, 0 when none) when that is later. A schedule lost
    /// with its bucket (a restart of memory storage, a delete by hand) thus goes on
    /// where this instance left it, instead of starting anew at now in a second that
    /// already had its calls.
    pub(crate) fn resumed(stored_next_us: Option<u64>, known_next_us: u64) -> Option<u64> {
        match stored_next_us {
            Some(next) => Some(next.max(known_next_us)),
            None => (known_next_us > 0).then_some(known_next_us),
        }
    }

    /// Until when a slot at `slot_us`, claimed at `claimed_us`, may be used: a slot
    /// saved up by an idle pool counts from its claim.
    pub(crate) fn usable_until(slot_us: u64, claimed_us: u64) -> u64 {
        slot_us.max(claimed_us) + SLOT_LEASE.as_micros() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(text: &str) -> Rate {
        text.parse().expect("rate")
    }

    #[test]
    fn a_lost_schedule_resumes_where_this_instance_left_it() {
        // Never claimed here: the stored schedule, or a new one.
        assert_eq!(Schedule::resumed(None, 0), None);
        assert_eq!(Schedule::resumed(Some(5), 0), Some(5));
        // The bucket lost (nothing stored, or a newer instance's fresh start behind
        // what this one wrote): this instance's last next slot.
        assert_eq!(Schedule::resumed(None, 7_000), Some(7_000));
        assert_eq!(Schedule::resumed(Some(5_000), 7_000), Some(7_000));
        // Others claimed since: theirs.
        assert_eq!(Schedule::resumed(Some(9_000), 7_000), Some(9_000));
    }

    const S: u64 = 1_000_000;

    #[test]
    fn an_idle_pool_gives_one_slot_now_without_a_burst() {
        let schedule = Schedule::new(rate("20/s"), 1);
        let claim = schedule.claim(None, 10 * S, 5);
        // 20/s: 50 ms apart, at most 50 ms ahead.
        assert_eq!(claim.first_us, 10 * S);
        assert_eq!(claim.count, 1);
        assert_eq!(claim.slots().collect::<Vec<_>>(), [10 * S]);
        assert_eq!(claim.next_us, 10 * S + 50_000);
        // Long idle: the stored time is in the past, and nothing was saved up.
        let later = schedule.claim(Some(claim.next_us), 20 * S, 1);
        assert_eq!((later.first_us, later.count), (20 * S, 1));
    }

    #[test]
    fn claims_follow_one_another_however_far_ahead() {
        let schedule = Schedule::new(rate("200/s"), 1);
        let first = schedule.claim(None, 10 * S, 100);
        assert_eq!(first.count, 10);
        let second = schedule.claim(Some(first.next_us), 10 * S + 1_000, 100);
        assert_eq!(second.first_us, first.next_us);
        assert_eq!(second.next_us, 10 * S + 100_000);
    }

    #[test]
    fn an_idle_pool_saves_up_its_burst_and_no_more() {
        let schedule = Schedule::new(rate("10/s"), 5);
        let claim = schedule.claim(Some(S), 100 * S, 50);
        assert_eq!(claim.count, 5);
        assert_eq!(claim.first_us, 100 * S - 400_000);
        assert!(claim.slots().all(|slot| slot <= 100 * S));
        // A claim just after has nothing saved: one slot, after the burst.
        let next = schedule.claim(Some(claim.next_us), 100 * S + 1, 50);
        assert_eq!((next.first_us, next.count), (100 * S + 100_000, 1));
    }

    #[test]
    fn no_one_second_window_holds_more_than_rate_times_1_1_plus_burst() {
        // Slots claimed back to back by three instances, each used anywhere within its
        // lease: count the uses that can fall in a 1 s window.
        for (text, burst) in [("20/s", 1u32), ("200/s", 1), ("20/s", 4), ("7/s", 2)] {
            let rate = rate(text);
            let schedule = Schedule::new(rate, burst);
            let mut next = Some(0);
            let mut slots = Vec::new();
            let now = 50 * S;
            for _ in 0..200 {
                let claim = schedule.claim(next, now, 1000);
                slots.extend(claim.slots().map(|s| (s, now)));
                next = Some(claim.next_us);
            }
            let latest = |(slot, claimed): (u64, u64)| Schedule::usable_until(slot, claimed);
            let limit = rate.per_second() * 1.1 + f64::from(burst);
            for start in (now - S..now + 5 * S).step_by(10_000) {
                // Worst case: every slot whose lease overlaps the window is used in it.
                let used = slots
                    .iter()
                    .filter(|&&(slot, claimed)| {
                        slot.max(claimed) < start + S && latest((slot, claimed)) > start
                    })
                    .count();
                assert!(used as f64 <= limit + 1.0, "{text}: {used} > {limit}");
            }
        }
    }
}
