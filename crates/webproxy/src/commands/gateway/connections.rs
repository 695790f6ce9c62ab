//! What one client can hold of the gateway's connections, decided without I/O: the
//! caps on open connections (overall and per source), when a connection with no
//! request on it has been idle long enough to close, and how the accept loop waits
//! after a failure. `listener.rs` acts on these.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use webproxy_jetstream::backoff::Backoff;

/// A `[gateway]` limit that acted, by its key: the `limit` label of
/// `webproxy_gateway_limits_total` and the code of the answer, when there is one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Limit {
    MaxConnections,
    MaxConnectionsPerSource,
    HeaderReadTimeout,
    BodyIdleTimeout,
    KeepAliveTimeout,
    MaxConcurrent,
}

impl Limit {
    pub(crate) const ALL: [Limit; 6] = [
        Limit::MaxConnections,
        Limit::MaxConnectionsPerSource,
        Limit::HeaderReadTimeout,
        Limit::BodyIdleTimeout,
        Limit::KeepAliveTimeout,
        Limit::MaxConcurrent,
    ];

    pub(crate) fn key(self) -> &'static str {
        match self {
            Limit::MaxConnections => "max_connections",
            Limit::MaxConnectionsPerSource => "max_connections_per_source",
            Limit::HeaderReadTimeout => "header_read_timeout",
            Limit::BodyIdleTimeout => "body_idle_timeout",
            Limit::KeepAliveTimeout => "keep_alive_timeout",
            Limit::MaxConcurrent => "max_concurrent",
        }
    }
}

/// The caps on open connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// `max_connections`.
    pub(crate) total: usize,
    /// `max_connections_per_source`; 0 is no cap.
    pub(crate) per_source: usize,
}

impl Caps {
    /// Whether one more connection may open while `total` are open, `from_source` of
    /// them from its source; the cap it would pass, if any.
    pub(crate) fn admit(self, total: usize, from_source: usize) -> Result<(), Limit> {
        if total >= self.total {
            return Err(Limit::MaxConnections);
        }
        if self.per_source > 0 && from_source >= self.per_source {
            return Err(Limit::MaxConnectionsPerSource);
        }
        Ok(())
    }
}

/// A connection's source as the per-source cap counts it: an IPv4 address (an
/// IPv4-mapped IPv6 one too), or the /64 of an IPv6 address, since a client that has
/// one IPv6 address usually has its whole /64.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Source(IpAddr);

impl Source {
    pub(crate) fn of(ip: IpAddr) -> Source {
        match ip.to_canonical() {
            IpAddr::V4(v4) => Source(IpAddr::V4(v4)),
            IpAddr::V6(v6) => {
                let network = u128::from(v6) & !((1u128 << 64) - 1);
                Source(IpAddr::V6(Ipv6Addr::from(network)))
            }
        }
    }
}

/// The connections open now, overall and by source, within [`Caps`].
#[derive(Debug)]
pub(crate) struct Connections {
    caps: Caps,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_source: HashMap<Source, usize>,
}

impl Connections {
    pub(crate) fn new(caps: Caps) -> Arc<Connections> {
        Arc::new(Connections {
            caps,
            open: Mutex::new(Open::default()),
        })
    }

    /// A place for a connection from `peer`, held until the [`Ticket`] is dropped,
    /// or the cap it would pass.
    pub(crate) fn open(self: &Arc<Self>, peer: IpAddr) -> Result<Ticket, Limit> {
        let source = Source::of(peer);
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        let from_source = open.by_source.get(&source).copied().unwrap_or_default();
        self.caps.admit(open.total, from_source)?;
        open.total += 1;
        *open.by_source.entry(source).or_default() += 1;
        Ok(Ticket {
            connections: self.clone(),
            source,
        })
    }

    /// Connections open now.
    #[cfg(test)]
    fn total(&self) -> usize {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }
}

/// One open connection's place; dropping it frees the place.
#[derive(Debug)]
pub(crate) struct Ticket {
    connections: Arc<Connections>,
    source: Source,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut open = self
            .connections
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        open.total = open.total.saturating_sub(1);
        if let Some(count) = open.by_source.get_mut(&self.source) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.by_source.remove(&self.source);
            }
        }
    }
}

/// What one connection has done, for its idle watch: requests being answered, the
/// reads that brought bytes, and when and after which read it last went idle.
/// Written by the connection's reads and requests, read by its watch.
#[derive(Debug)]
pub(crate) struct Activity {
    start: Instant,
    busy: AtomicUsize,
    reads: AtomicU64,
    /// Milliseconds from `start` to when the last request's answer was ready.
    idle_since_ms: AtomicU64,
    /// `reads` then.
    reads_at_idle: AtomicU64,
}

impl Activity {
    pub(crate) fn new() -> Arc<Activity> {
        Arc::new(Activity {
            start: Instant::now(),
            busy: AtomicUsize::new(0),
            reads: AtomicU64::new(0),
            idle_since_ms: AtomicU64::new(0),
            reads_at_idle: AtomicU64::new(0),
        })
    }

    /// Bytes arrived.
    pub(crate) fn read(&self) {
        self.reads.fetch_add(1, Ordering::Relaxed);
    }

    /// A request is being answered until the returned guard is dropped (its answer
    /// is ready): the connection is idle from then on, until bytes arrive.
    pub(crate) fn request(self: &Arc<Self>) -> impl Drop + Send + use<> {
        self.busy.fetch_add(1, Ordering::SeqCst);
        scopeguard::guard(self.clone(), |activity| {
            let since = activity.start.elapsed().as_millis();
            activity
                .idle_since_ms
                .store(u64::try_from(since).unwrap_or(u64::MAX), Ordering::SeqCst);
            activity
                .reads_at_idle
                .store(activity.reads.load(Ordering::SeqCst), Ordering::SeqCst);
            activity.busy.fetch_sub(1, Ordering::SeqCst);
        })
    }

    /// What the connection looks like now, for [`idle`].
    pub(crate) fn now(&self) -> Seen {
        let busy = self.busy.load(Ordering::SeqCst) > 0;
        let since = Duration::from_millis(self.idle_since_ms.load(Ordering::SeqCst));
        let reading =
            self.reads.load(Ordering::SeqCst) != self.reads_at_idle.load(Ordering::SeqCst);
        Seen {
            waiting: !busy && !reading,
            idle_since: self.start + since,
        }
    }
}

/// A connection as its idle watch sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    /// No request is being answered and no byte of a next one has arrived.
    pub(crate) waiting: bool,
    /// When it started waiting: its start, or the last answer's.
    pub(crate) idle_since: Instant,
}

/// What a connection's idle watch does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Idle {
    /// It has waited `keep_alive_timeout` for a request: close it.
    Close,
    /// Look again then.
    CheckAt(Instant),
}

/// Whether a connection seen as `seen` at `now` has waited out `timeout` for a
/// request. A connection answering a request, or receiving one's head (which
/// `header_read_timeout` bounds), is looked at again a `timeout` later: an idle time
/// that starts meanwhile ends no earlier than that.
pub(crate) fn idle(seen: Seen, now: Instant, timeout: Duration) -> Idle {
    if !seen.waiting {
        return Idle::CheckAt(now + timeout);
    }
    let end = seen.idle_since + timeout;
    if now >= end {
        Idle::Close
    } else {
        Idle::CheckAt(end)
    }
}

/// The accept loop's wait after failures in a row (out of file descriptors, say):
/// 10 ms doubling to 1 s, so a loop that cannot accept neither spins nor stays
/// deaf long after descriptors free up.
pub(crate) const ACCEPT_BACKOFF: Backoff =
    Backoff::doubling(Duration::from_millis(10), Duration::from_secs(1));

/// The longest a run of accept failures goes without a log line.
pub(crate) const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);

/// A run of accept failures: how many, and when one was last logged.
#[derive(Debug, Default)]
pub(crate) struct AcceptFailures {
    run: u32,
    unlogged: u64,
    logged_at: Option<Instant>,
}

/// What the accept loop does about one failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AcceptFailure {
    /// How long to wait before accepting again.
    pub(crate) pause: Duration,
    /// `Some(n)`: log it, with the `n` failures not logged since the last line.
    pub(crate) log: Option<u64>,
}

impl AcceptFailures {
    /// One more failure at `now`.
    pub(crate) fn failed(&mut self, now: Instant) -> AcceptFailure {
        self.run = self.run.saturating_add(1);
        let due = self
            .logged_at
            .is_none_or(|at| now.duration_since(at) >= ACCEPT_LOG_EVERY);
        let log = if due {
            self.logged_at = Some(now);
            Some(std::mem::take(&mut self.unlogged))
        } else {
            self.unlogged += 1;
            None
        };
        AcceptFailure {
            pause: ACCEPT_BACKOFF.after(self.run).unwrap_or(Duration::ZERO),
            log,
        }
    }

    /// A connection was accepted: the failures in the run that ended, if any.
    pub(crate) fn accepted(&mut self) -> Option<u32> {
        let run = std::mem::take(&mut self.run);
        self.unlogged = 0;
        self.logged_at = None;
        (run > 0).then_some(run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().expect("ip")
    }

    #[test]
    fn caps_hold_overall_and_per_source() {
        let caps = Caps {
            total: 3,
            per_source: 2,
        };
        assert_eq!(caps.admit(0, 0), Ok(()));
        assert_eq!(caps.admit(2, 1), Ok(()));
        assert_eq!(caps.admit(2, 2), Err(Limit::MaxConnectionsPerSource));
        assert_eq!(caps.admit(3, 0), Err(Limit::MaxConnections));
        let off = Caps {
            total: 3,
            per_source: 0,
        };
        assert_eq!(off.admit(2, 2), Ok(()));
    }

    #[test]
    fn tickets_count_connections_until_dropped() {
        let connections = Connections::new(Caps {
            total: 3,
            per_source: 2,
        });
        let a1 = connections.open(ip("10.0.0.1")).expect("first");
        let a2 = connections
            .open(ip("::ffff:10.0.0.1"))
            .expect("second, mapped");
        assert_eq!(
            connections.open(ip("10.0.0.1")).map(|_| ()),
            Err(Limit::MaxConnectionsPerSource)
        );
        let b = connections.open(ip("10.0.0.2")).expect("another source");
        assert_eq!(
            connections.open(ip("10.0.0.3")).map(|_| ()),
            Err(Limit::MaxConnections)
        );
        drop(a1);
        assert_eq!(connections.total(), 2);
        let a3 = connections.open(ip("10.0.0.1")).expect("a place freed");
        drop((a2, a3, b));
        assert_eq!(connections.total(), 0);
        assert!(connections.open.lock().expect("lock").by_source.is_empty());
    }

    #[test]
    fn an_ipv6_source_is_its_64() {
        assert_eq!(
            Source::of(ip("2001:db8:1:2:aaaa::1")),
            Source::of(ip("2001:db8:1:2:bbbb::2"))
        );
        assert_ne!(
            Source::of(ip("2001:db8:1:2::1")),
            Source::of(ip("2001:db8:1:3::1"))
        );
        assert_eq!(
            Source::of(ip("::ffff:10.0.0.1")),
            Source::of(ip("10.0.0.1"))
        );
        assert_ne!(Source::of(ip("10.0.0.1")), Source::of(ip("10.0.0.2")));
    }

    #[test]
    fn a_connection_waiting_for_a_request_closes_after_the_timeout() {
        let start = Instant::now();
        let timeout = Duration::from_secs(5);
        let waiting = Seen {
            waiting: true,
            idle_since: start,
        };
        assert_eq!(
            idle(waiting, start + Duration::from_secs(1), timeout),
            Idle::CheckAt(start + timeout)
        );
        assert_eq!(idle(waiting, start + timeout, timeout), Idle::Close);
        let busy = Seen {
            waiting: false,
            idle_since: start,
        };
        let later = start + Duration::from_secs(60);
        assert_eq!(idle(busy, later, timeout), Idle::CheckAt(later + timeout));
    }

    #[test]
    fn activity_is_idle_only_between_an_answer_and_the_next_bytes() {
        let activity = Activity::new();
        assert!(activity.now().waiting, "a new connection waits");
        activity.read();
        assert!(!activity.now().waiting, "a head is arriving");
        let request = activity.request();
        assert!(!activity.now().waiting, "a request is answered");
        drop(request);
        let seen = activity.now();
        assert!(seen.waiting, "answered, nothing since");
        assert!(seen.idle_since >= activity.start);
        activity.read();
        assert!(!activity.now().waiting);
    }

    #[test]
    fn accept_failures_back_off_and_log_once_per_interval() {
        let mut failures = AcceptFailures::default();
        let start = Instant::now();
        let first = failures.failed(start);
        assert_eq!(first.log, Some(0));
        assert_eq!(first.pause, Duration::from_millis(10));
        let pauses: Vec<_> = (1..=9)
            .map(|n| failures.failed(start + Duration::from_millis(n)))
            .collect();
        assert!(pauses.iter().all(|f| f.log.is_none()));
        assert_eq!(pauses[0].pause, Duration::from_millis(20));
        assert_eq!(pauses[1].pause, Duration::from_millis(40));
        assert_eq!(pauses[8].pause, Duration::from_secs(1));
        let later = failures.failed(start + ACCEPT_LOG_EVERY);
        assert_eq!(later.log, Some(9));
        assert_eq!(failures.accepted(), Some(11));
        assert_eq!(failures.accepted(), None);
        assert_eq!(failures.failed(start + ACCEPT_LOG_EVERY).log, Some(0));
    }
}
