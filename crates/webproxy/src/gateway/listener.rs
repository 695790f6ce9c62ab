//! The gateway's HTTP/1.1 listener: connections from outside `allow_sources` are
//! closed before a byte is read, with TLS every connection is a TLS session from the
//! PEM files, and on shutdown every connection finishes its request and closes.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use ipnet::IpNet;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::Telemetry;

/// A TLS handshake that takes longer than this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The acceptor for the certificate chain in `cert` and the private key in `key`.
pub fn tls_acceptor(cert: &Path, key: &Path) -> anyhow::Result<TlsAcceptor> {
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
pub struct Drain {
    /// Cancelled on SIGTERM or SIGINT: stop accepting and drain.
    pub shutdown: CancellationToken,
    /// `[service] shutdown_grace`: the longest drain.
    pub grace: Duration,
    /// Cancelled by the drain when `grace` is about to run out ([`give_up_after`]),
    /// so requests still waiting for replies are answered (202) before they are cut.
    pub give_up: CancellationToken,
}

/// How long into a drain of `grace` the waits for replies are given up: a quarter of
/// the grace, at most a second, is left for those answers to be written.
fn give_up_after(grace: Duration) -> Duration {
    grace.saturating_sub((grace / 4).min(Duration::from_secs(1)))
}

/// Serves `app` on `listener` until `drain.shutdown`, then drains: the listener is
/// closed, every connection is told to finish the request it is answering and close
/// (an idle keep-alive connection closes at once, a busy one answers with
/// `Connection: close`), and this returns when they all have, or when `grace` has
/// passed since `shutdown`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<TlsAcceptor>,
    allow: Vec<IpNet>,
    telemetry: Telemetry,
    drain: Drain,
) {
    let Drain {
        shutdown,
        grace,
        give_up,
    } = drain;
    let connections = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.cancelled() => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, say: wait rather than spin.
                warn!(error = %e, "cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if !allowed(&allow, peer.ip()) {
            telemetry.refused_connection();
            debug!(%peer, "connection outside gateway.allow_sources closed");
            continue;
        }
        let service = TowerToHyperService::new(app.clone());
        let tls = tls.clone();
        let shutdown = shutdown.clone();
        connections.spawn(async move {
            let Some(acceptor) = tls else {
                return serve_connection(stream, service, peer, &shutdown).await;
            };
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream));
            let handshake = tokio::select! {
                handshake = handshake => handshake,
                // No request has started on it: nothing to finish.
                _ = shutdown.cancelled() => return,
            };
            match handshake {
                Ok(Ok(stream)) => serve_connection(stream, service, peer, &shutdown).await,
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

/// One HTTP/1.1 connection, until the client closes it or, after `shutdown`, until
/// the request it is answering is answered (with `Connection: close`).
async fn serve_connection<S>(
    stream: S,
    service: TowerToHyperService<Router>,
    peer: SocketAddr,
    shutdown: &CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let connection =
        hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    let served = tokio::select! {
        served = connection.as_mut() => served,
        _ = shutdown.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = served {
        debug!(%peer, error = %e, "connection ended with an error");
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
