//! The gateway's HTTP/1.1 listener: connections from outside `allow_sources` are
//! closed before a byte is read, connections past `max_connections` (overall or per
//! source) are answered 503 and closed, with TLS every connection is a TLS session
//! from the PEM files, and on shutdown every connection finishes its request and
//! closes. A connection's head must arrive within `header_read_timeout` (hyper's
//! timer) and a connection with no request on it closes after `keep_alive_timeout`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use hyper::server::conn::http1;
use hyper::service::{Service as _, service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use ipnet::IpNet;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::Telemetry;
use super::connections::{self, AcceptFailures, Activity, Caps, Connections, Idle, Limit};
use super::handler;
use crate::config::gateway::GatewayConfig;

/// A TLS handshake that takes longer than this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections over a cap that are being answered 503 at once; past these, one is
/// closed unanswered, so a flood costs at most this many descriptors beyond
/// `max_connections`.
const REFUSING: usize = 64;

/// How long a connection over a cap has to send its request's head before it is
/// closed unanswered.
const REFUSAL_HEAD_TIMEOUT: Duration = Duration::from_millis(500);

/// The limits each connection is served within (`[gateway]`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) caps: Caps,
    pub(crate) header_read_timeout: Duration,
    /// `keep_alive_timeout`; `None` when it is 0: keep-alive off.
    pub(crate) keep_alive: Option<Duration>,
}

impl Limits {
    pub(crate) fn of(config: &GatewayConfig) -> Limits {
        Limits {
            caps: Caps {
                total: config.max_connections,
                per_source: config.max_connections_per_source,
            },
            header_read_timeout: config.header_read_timeout,
            keep_alive: Some(config.keep_alive_timeout).filter(|timeout| !timeout.is_zero()),
        }
    }
}

/// The acceptor for the certificate chain in `cert` and the private key in `key`.
pub(crate) fn tls_acceptor(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .with_context(|| {
            format!(
                "gateway.tls_cert_file {}: no PEM certificates",
                cert.display()
            )
        })?;
    if chain.is_empty() {
        anyhow::bail!(
            "gateway.tls_cert_file {} holds no certificate",
            cert.display()
        );
    }
    let private = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("gateway.tls_key_file {}: no PEM private key", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("no TLS protocol version")?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .with_context(|| {
            format!(
                "gateway.tls_cert_file {} and tls_key_file {} do not make a certificate and its key",
                cert.display(),
                key.display()
            )
        })?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Whether `peer` may connect: `allow` is empty, or holds it (an IPv4-mapped IPv6
/// address is compared as IPv4).
fn allowed(allow: &[IpNet], peer: std::net::IpAddr) -> bool {
    let peer = peer.to_canonical();
    allow.is_empty() || allow.iter().any(|net| net.contains(&peer))
}

/// When the listener stops and how long it drains.
pub(crate) struct Drain {
    /// Cancelled on SIGTERM or SIGINT: stop accepting and drain.
    pub(crate) shutdown: CancellationToken,
    /// `[service] shutdown_grace`: the longest drain.
    pub(crate) grace: Duration,
    /// Cancelled by the drain when `grace` is about to run out ([`give_up_after`]),
    /// so requests still waiting for replies are answered (202) before they are cut.
    pub(crate) give_up: CancellationToken,
}

/// How long into a drain of `grace` the waits for replies are given up: a quarter of
/// the grace, at most a second, is left for those answers to be written.
fn give_up_after(grace: Duration) -> Duration {
    grace.saturating_sub((grace / 4).min(Duration::from_secs(1)))
}

/// Serves `app` on `listener` within `limits` until `drain.shutdown`, then drains:
/// the listener is closed, every connection is told to finish the request it is
/// answering and close (an idle keep-alive connection closes at once, a busy one
/// answers with `Connection: close`), and this returns when they all have, or when
/// `grace` has passed since `shutdown`.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    allow: Vec<IpNet>,
    limits: Limits,
    telemetry: Telemetry,
    drain: Drain,
) {
    let Drain {
        shutdown,
        grace,
        give_up,
    } = drain;
    let connections = TaskTracker::new();
    let open = Connections::new(limits.caps);
    let refusing = Arc::new(Semaphore::new(REFUSING));
    let mut failures = AcceptFailures::default();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: the connection stays in the backlog
                // and the next accept fails at once, so wait, longer each time.
                telemetry.accept_failed();
                let failure = failures.failed(Instant::now());
                if let Some(unlogged) = failure.log {
                    warn!(error = %e, failures_not_logged = unlogged, "cannot accept a connection; waiting before accepting again");
                }
                tokio::select! {
                    _ = tokio::time::sleep(failure.pause) => continue,
                    _ = shutdown.cancelled() => break,
                }
            }
        };
        if let Some(run) = failures.accepted() {
            info!(failures = run, "accepting connections again");
        }
        if !allowed(&allow, peer.ip()) {
            telemetry.refused_connection();
            debug!(%peer, "connection outside gateway.allow_sources closed");
            continue;
        }
        let ticket = match open.open(peer.ip()) {
            Ok(ticket) => ticket,
            Err(limit) => {
                telemetry.limited(limit);
                debug!(%peer, limit = limit.key(), "connection over a gateway limit refused");
                // With TLS no answer is possible before a handshake, which is not
                // spent on a connection that is refused anyway.
                if tls.is_none()
                    && let Ok(permit) = refusing.clone().try_acquire_owned()
                {
                    connections.spawn(async move {
                        refuse(stream, limit).await;
                        drop(permit);
                    });
                }
                continue;
            }
        };
        let counted = (ticket, telemetry.connection_opened());
        let app = app.clone();
        let tls = tls.clone();
        let shutdown = shutdown.clone();
        let telemetry = telemetry.clone();
        connections.spawn(async move {
            let _counted = counted;
            let served = Served {
                app,
                peer,
                limits,
                telemetry: &telemetry,
                shutdown: &shutdown,
            };
            let Some(acceptor) = tls else {
                return served.connection(stream).await;
            };
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
            let handshake = tokio::select! {
                handshake = handshake => handshake,
                // No request has started on it: nothing to finish.
                _ = shutdown.cancelled() => return,
            };
            match handshake {
                Ok(Ok(stream)) => served.connection(stream).await,
                Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => debug!(%peer, "TLS handshake timed out"),
            }
        });
    }
    // New connections are refused from here on, and /readyz says so.
    drop(listener);
    telemetry.set_ready(false);
    connections.close();
    let open = connections.len();
    if open > 0 {
        info!(connections = open, "draining the gateway's connections");
    }
    let patience = give_up_after(grace);
    if tokio::time::timeout(patience, connections.wait())
        .await
        .is_ok()
    {
        return;
    }
    info!(
        connections = connections.len(),
        "service.shutdown_grace running out: requests still waiting are answered 202"
    );
    give_up.cancel();
    if tokio::time::timeout(grace - patience, connections.wait())
        .await
        .is_err()
    {
        warn!(
            connections = connections.len(),
            "service.shutdown_grace ran out with connections still open; they are cut"
        );
    }
}

/// A connection over `limit`: its request's head is read (for up to
/// [`REFUSAL_HEAD_TIMEOUT`]) and answered 503 naming the limit, and it closes.
async fn refuse(stream: TcpStream, limit: Limit) {
    let service =
        service_fn(move |_request| async move { Ok::<_, Infallible>(handler::over_limit(limit)) });
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(REFUSAL_HEAD_TIMEOUT)
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), service);
    if let Err(e) = connection.await {
        debug!(error = %e, "a refused connection ended with an error");
    }
}

/// What one connection is served with.
struct Served<'a> {
    app: Router,
    peer: SocketAddr,
    limits: Limits,
    telemetry: &'a Telemetry,
    shutdown: &'a CancellationToken,
}

impl Served<'_> {
    /// One HTTP/1.1 connection, until the client closes it, it waits
    /// `keep_alive_timeout` for a request or `header_read_timeout` for a head, or,
    /// after `shutdown`, until the request it is answering is answered (with
    /// `Connection: close`).
    async fn connection<S>(self, stream: S)
    where
        S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let Served {
            app,
            peer,
            limits,
            telemetry,
            shutdown,
        } = self;
        let activity = Activity::new();
        let app = TowerToHyperService::new(app);
        let service = service_fn({
            let activity = activity.clone();
            move |request| {
                let answering = activity.request();
                let answer = app.call(request);
                async move {
                    let answer = answer.await;
                    drop(answering);
                    answer
                }
            }
        });
        let io = TokioIo::new(Watched {
            inner: stream,
            activity: activity.clone(),
        });
        let connection = http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .keep_alive(limits.keep_alive.is_some())
            .serve_connection(io, service);
        tokio::pin!(connection);
        let served = tokio::select! {
            served = connection.as_mut() => served,
            () = idle_for(&activity, limits.keep_alive) => {
                telemetry.limited(Limit::KeepAliveTimeout);
                // Closes it at once, unless a request arrived just now: then it is
                // answered first.
                connection.as_mut().graceful_shutdown();
                connection.await
            }
            _ = shutdown.cancelled() => {
                connection.as_mut().graceful_shutdown();
                connection.await
            }
        };
        match served {
            Ok(()) => {}
            Err(e) if e.is_timeout() => {
                telemetry.limited(Limit::HeaderReadTimeout);
                debug!(%peer, "a request's head took longer than gateway.header_read_timeout; connection closed");
            }
            Err(e) => debug!(%peer, error = %e, "connection ended with an error"),
        }
    }
}

/// Ends once the connection has waited `keep_alive` for a request (never without
/// one: with keep-alive off, hyper closes the connection after its answer).
async fn idle_for(activity: &Activity, keep_alive: Option<Duration>) {
    let Some(timeout) = keep_alive else {
        return std::future::pending().await;
    };
    loop {
        match connections::idle(activity.now(), Instant::now(), timeout) {
            Idle::Close => return,
            Idle::CheckAt(at) => tokio::time::sleep_until(at).await,
        }
    }
}

/// A connection's stream, telling its [`Activity`] when bytes arrive.
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.read();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_allowed_sources_connect() {
        let allow: Vec<IpNet> = vec!["10.0.0.0/8".parse().expect("net")];
        assert!(allowed(&allow, "10.1.2.3".parse().expect("ip")));
        assert!(allowed(&allow, "::ffff:10.1.2.3".parse().expect("ip")));
        assert!(!allowed(&allow, "127.0.0.1".parse().expect("ip")));
        assert!(allowed(&[], "127.0.0.1".parse().expect("ip")));
    }

    #[test]
    fn waits_are_given_up_a_quarter_of_the_grace_or_a_second_before_its_end() {
        let after = |ms| give_up_after(Duration::from_millis(ms)).as_millis();
        assert_eq!(after(30_000), 29_000);
        assert_eq!(after(2_000), 1_500);
        assert_eq!(after(0), 0);
    }
}
