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

/// A currently free TCP port on 127.0.0.1. Another process can take it before
/// the caller binds it; prefer letting servers bind port 0 themselves.
pub fn free_port() -> u16 {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind 127.0.0.1:0 to find a free port");
    listener
        .local_addr()
        .expect("local address of a bound listener")
        .port()
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
