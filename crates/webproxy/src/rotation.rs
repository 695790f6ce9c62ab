//! Secret files followed while running: re-read every `[service] secret_poll_interval`
//! and on SIGHUP, and put in force when their contents change.
//!
//! Kubernetes never sends a signal when it rotates a mounted Secret, and the distroless
//! image has no shell to send one. It swaps the `..data` symlink of the volume to a
//! new directory, which leaves the modification time of the path read unchanged, so
//! the files' contents are compared, never their times.

use std::time::Duration;

use tokio::signal::unix::{Signal, SignalKind};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// What one reading of the files found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reading {
    /// The same contents as those in force: nothing was replaced.
    Unchanged,
    /// New contents, now in force.
    Replaced,
}

/// Why the files were read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Cause {
    Poll,
    Hangup,
}

/// SIGHUP, listened for as soon as the process starts (its default action ends the
/// process); `None`, logged, when it cannot be.
pub(crate) fn hangups(what: &str) -> Option<Signal> {
    match tokio::signal::unix::signal(SignalKind::hangup()) {
        Ok(signal) => Some(signal),
        Err(e) => {
            warn!(error = %e, "cannot listen for SIGHUP; {what} are reloaded by polling only");
            None
        }
    }
}

/// Calls `read` every `interval` (never when it is zero) and on each SIGHUP until
/// `shutdown`. `read` reads the files, compares them with the values in force and
/// replaces those, all or nothing; an error keeps the old values. A change is logged
/// once, and so is an error until it changes or the files can be read again: a poll
/// every few seconds must not repeat the same line.
pub(crate) async fn follow<F>(
    what: &'static str,
    interval: Duration,
    mut hangups: Option<Signal>,
    shutdown: CancellationToken,
    mut read: F,
) where
    F: FnMut() -> Result<Reading, String>,
{
    let mut last_error: Option<String> = None;
    let mut ticks = (!interval.is_zero()).then(|| {
        let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        ticks
    });
    loop {
        let cause = tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = next_tick(&mut ticks) => Cause::Poll,
            Some(()) = next_hangup(&mut hangups) => Cause::Hangup,
        };
        match read() {
            Ok(reading) => {
                last_error = None;
                let changed = reading == Reading::Replaced;
                match cause {
                    Cause::Poll if changed => info!("{what} changed: reloaded"),
                    Cause::Poll => {}
                    Cause::Hangup => info!(changed, "SIGHUP: {what} reloaded"),
                }
            }
            Err(e) => {
                if cause == Cause::Hangup || last_error.as_deref() != Some(e.as_str()) {
                    error!(error = %e, "{what} not reloaded; the old values stay in use");
                }
                last_error = Some(e);
            }
        }
    }
}

async fn next_tick(ticks: &mut Option<tokio::time::Interval>) {
    match ticks {
        Some(ticks) => {
            ticks.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// The next SIGHUP; pending for ever once the signal cannot be received.
async fn next_hangup(hangups: &mut Option<Signal>) -> Option<()> {
    match hangups {
        Some(signal) => signal.recv().await,
        None => std::future::pending().await,
    }
}

/// `candidate` put in force through `apply` when it differs from `current`, which then
/// holds it: how the gateway's token follower compares (injected secrets compare
/// inside `Secrets::reload_files`).
pub(crate) fn replace_if_changed<T: PartialEq>(
    current: &mut T,
    candidate: T,
    apply: impl FnOnce(&T),
) -> Reading {
    if *current == candidate {
        return Reading::Unchanged;
    }
    apply(&candidate);
    *current = candidate;
    Reading::Replaced
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_contents_replace_nothing() {
        let mut current = vec![Some("a".to_string())];
        let mut applied = 0;
        let reading =
            replace_if_changed(&mut current, vec![Some("a".to_string())], |_| applied += 1);
        assert_eq!(reading, Reading::Unchanged);
        assert_eq!(applied, 0);
    }

    #[test]
    fn new_contents_are_applied_and_kept() {
        let mut current = vec![Some("a".to_string())];
        let mut applied = Vec::new();
        let reading = replace_if_changed(&mut current, vec![Some("b".to_string())], |new| {
            applied.push(new.clone())
        });
        assert_eq!(reading, Reading::Replaced);
        assert_eq!(applied, vec![vec![Some("b".to_string())]]);
        assert_eq!(current, vec![Some("b".to_string())]);
    }

    /// Follows with `interval` for `run`, then stops it; how many times it read.
    async fn reads_in(interval: Duration, run: Duration) -> usize {
        let shutdown = CancellationToken::new();
        let reads = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = reads.clone();
        let following = tokio::spawn(follow(
            "test files",
            interval,
            None,
            shutdown.clone(),
            move || {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                Ok(Reading::Unchanged)
            },
        ));
        tokio::time::sleep(run).await;
        shutdown.cancel();
        following.await.expect("the follower ends on shutdown");
        reads.load(std::sync::atomic::Ordering::SeqCst)
    }

    #[tokio::test(start_paused = true)]
    async fn a_poll_reads_every_interval_until_shutdown() {
        assert_eq!(
            reads_in(Duration::from_secs(1), Duration::from_millis(3500)).await,
            3
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_interval_never_polls() {
        assert_eq!(reads_in(Duration::ZERO, Duration::from_secs(60)).await, 0);
    }
}
