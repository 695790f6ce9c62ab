//! Counting calls against a rate: the busiest window of their times.

use std::ops::Add;
use std::time::Duration;

/// The most of `times` in any window of `width` starting at one of them: instants, or
/// offsets from one.
pub fn busiest_window<T>(times: &[T], width: Duration) -> usize
where
    T: Copy + PartialOrd + Add<Duration, Output = T>,
{
    times
        .iter()
        .map(|start| {
            times
                .iter()
                .filter(|t| **t >= *start && **t < *start + width)
                .count()
        })
        .max()
        .unwrap_or(0)
}
