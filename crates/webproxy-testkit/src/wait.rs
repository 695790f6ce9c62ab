//! Bounded polling helpers, so tests wait for conditions instead of sleeping.

use std::future::Future;
use std::net::{Ipv4Addr, TcpListener};
use std::time::Duration;

use tokio::time::Instant;

/// Short enough to keep tests fast, long enough not to spin a core.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Polls `f` every 20 ms until it returns `true`; panics once `timeout` has
/// passed (including when a single call to `f` is still running then).
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    wait_for(timeout, what, || {
        let done = f();
        async move { done.await.then_some(()) }
    })
    .await;
}

/// Polls `f` every 20 ms until it returns `Some`, and returns that value;
/// panics once `timeout` has passed.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        // A check that itself hangs (e.g. a request to a stuck server) must
        // not stretch the bound.
        match tokio::time::timeout_at(deadline, f()).await {
            Ok(Some(value)) => return value,
            Ok(None) if Instant::now() < deadline => tokio::time::sleep(POLL_INTERVAL).await,
            _ => panic!("timed out after {timeout:?} waiting for {what}"),
        }
    }
}

/// A currently free TCP port on 127.0.0.1, for a server the test starts later.
///
/// Chosen at random below the kernel's ephemeral range, never from it: a port the kernel
/// hands out for `bind(0)` is also what it gives the next outgoing connection of any
/// test running in parallel, which then takes the port before the server binds it
/// (seen as `Address already in use`). Below that range only another test's server can
/// collide, and among some 20 000 ports that is rare.
pub fn free_port() -> u16 {
    let (low, high) = (10_000, ephemeral_range_start().max(10_001));
    for _ in 0..1_000 {
        let port = low + u16::try_from(random_u64() % u64::from(high - low)).unwrap_or(0);
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            return port;
        }
    }
    panic!("no free 127.0.0.1 port in {low}..{high} after 1000 tries")
}

/// The first port of the kernel's ephemeral range (Linux's default when it cannot be read).
fn ephemeral_range_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// A random number from the standard library's per-process random hash keys: enough to
/// spread ports, with no dependency for it.
fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    hasher.finish()
}

/// A 127.0.0.1 port that refuses connections for as long as the returned socket lives:
/// bound (so no other test can take it) but never listening.
pub fn closed_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("create a socket");
    socket
        .bind((Ipv4Addr::LOCALHOST, 0).into())
        .expect("bind 127.0.0.1:0");
    let port = socket.local_addr().expect("local address").port();
    (socket, port)
}
