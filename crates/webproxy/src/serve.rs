//! `webproxy serve`: connect, provision, consume until a signal, drain with a deadline.

use std::sync::Arc;
use std::time::Duration;

use crate::nats_auth;
use anyhow::{Context as _, bail};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};
use webproxy_dispatcher::backoff::Backoff;
use webproxy_dispatcher::config::ByteLimit;
use webproxy_dispatcher::config::jetstream_request_timeout;
use webproxy_dispatcher::outbox::max_response_bytes_for;
use webproxy_dispatcher::provision::{
    MIN_SERVER_VERSION, Provisioned, provision, server_version_supported,
};
use webproxy_dispatcher::runtime::Progress;
use webproxy_dispatcher::secrets::{Redactor, Secrets};
use webproxy_dispatcher::{Dispatcher, Health, Instruments, connect};

use crate::config::Settings;
use webproxy_worker::{Worker, WorkerConfig};

use crate::health;

pub async fn run(settings: Settings, redactor: Redactor) -> anyhow::Result<()> {
    redactor.add_fixed(nats_auth::secret_values(&settings.config.nats));
    for warning in settings.warnings() {
        warn!("configuration: {warning}");
    }
    let secrets = Arc::new(
        Secrets::load(&settings.dispatcher.cluster.rules, redactor)
            .context("cannot read an injected secret")?,
    );
    let settings = Arc::new(settings);
    let instruments = Instruments::new(&settings.dispatcher);
    let health_state = instruments.health.clone();
    let listen = settings.config.http.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on http.listen = {listen}"))?;
    health::spawn(listener, instruments.clone());
    info!(%listen, "health listener up");

    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    tokio::spawn(reload_on_hangup(settings.clone(), secrets.clone()));

    let Some((client, server)) = connect_until_up(&settings, &health_state, &shutdown).await?
    else {
        return Ok(());
    };
    if !server_version_supported(&server.version) {
        bail!(
            "nats-server {} is too old: webproxy needs {}.{} or newer",
            server.version,
            MIN_SERVER_VERSION.0,
            MIN_SERVER_VERSION.1
        );
    }
    if !server.jetstream {
        bail!("nats-server {} has JetStream disabled", server.version);
    }
    let max_payload = server.max_payload;
    let max_response_bytes =
        effective_max_response_bytes(settings.config.outbound.max_response_bytes, max_payload)?;
    info!(server = %server.version, max_payload, max_response_bytes, "connected to NATS");

    let mut js = async_nats::jetstream::new(client.clone());
    js.set_timeout(jetstream_request_timeout(
        settings.dispatcher.cluster.ack_wait,
    ));
    let Some(provisioned) = provision_until_done(&js, &settings, &shutdown).await else {
        return Ok(());
    };
    let worker = Worker::new(&WorkerConfig {
        max_response_bytes,
        guard: settings.dispatcher.cluster.outbound.guard.clone(),
        max_response_headers: settings.dispatcher.cluster.outbound.max_headers,
        max_response_header_bytes: settings.dispatcher.cluster.outbound.max_header_bytes,
    })?;
    let dispatcher = Dispatcher::new(
        settings.dispatcher.clone(),
        client.clone(),
        worker,
        max_payload,
        instruments,
        secrets,
        Progress::new(provisioned.progress),
    );
    // Before serving, and so before /readyz turns green: retries a webproxy of the
    // previous stream layout parked are moved into this one.
    if retry_until_done("migrating parked retries", &shutdown, || {
        dispatcher.migrate_layout1_parked()
    })
    .await
    .is_none()
    {
        return Ok(());
    }
    info!(pools = ?settings.dispatcher.cluster.pools.keys().collect::<Vec<_>>(), "serving");
    dispatcher
        .run(
            provisioned.pools,
            shutdown,
            settings.config.service.shutdown_grace,
        )
        .await;
    if let Err(e) = client.flush().await {
        warn!(error = %e, "could not flush the NATS connection");
    }
    info!("stopped");
    Ok(())
}

/// The server's INFO, which arrives just after the connection is made.
async fn server_info(client: &async_nats::Client) -> anyhow::Result<async_nats::ServerInfo> {
    client
        .flush()
        .await
        .context("cannot reach the NATS server")?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(info) = client.try_server_info() {
            return Ok(info);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the NATS server sent no INFO within 10s");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `[outbound] max_response_bytes`, resolved against the server's `max_payload`.
fn effective_max_response_bytes(
    configured: ByteLimit,
    max_payload: usize,
) -> anyhow::Result<usize> {
    let largest = max_response_bytes_for(max_payload);
    match configured {
        ByteLimit::Auto => Ok(largest),
        ByteLimit::Bytes(n) if n <= largest as u64 => Ok(usize::try_from(n).unwrap_or(largest)),
        ByteLimit::Bytes(n) => bail!(
            "outbound.max_response_bytes = {n} is too large: with the server's max_payload of {max_payload} bytes a reply can carry at most {largest} bytes of body"
        ),
    }
}

/// Provisions, retrying with backoff: JetStream can be briefly unavailable, for example
/// while a cluster elects its leaders. A stream of a newer layout, or one being
/// removed, is refused on every try, and the instance stays not ready meanwhile. `None`
/// when a signal arrives first.
async fn provision_until_done(
    js: &async_nats::jetstream::Context,
    settings: &Settings,
    shutdown: &CancellationToken,
) -> Option<Provisioned> {
    retry_until_done("provisioning", shutdown, || {
        provision(js, &settings.dispatcher)
    })
    .await
}

/// Provisioning and migrating parked retries, at start: 200 ms after the first failure,
/// doubling to at most 5 s, forever; until a signal.
const START_BACKOFF: Backoff =
    Backoff::doubling(Duration::from_millis(200), Duration::from_secs(5));

/// Runs `step` until it succeeds, waiting [`START_BACKOFF`] between tries; `None` when
/// a signal arrives first.
async fn retry_until_done<T, E, F, Fut>(
    what: &str,
    shutdown: &CancellationToken,
    mut step: F,
) -> Option<T>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut failures = 0u32;
    loop {
        match step().await {
            Ok(done) => return Some(done),
            Err(e) => warn!(error = %e, "{what} failed; retrying"),
        }
        failures = failures.saturating_add(1);
        if !START_BACKOFF.wait(failures, shutdown).await {
            return None;
        }
    }
}

/// Connects and waits for the server's INFO; `None` when a signal arrives first.
///
/// Connecting is retried once, by the client: `connect` sets `retry_on_initial_connect`,
/// so an unreachable server is tried again with the reconnect backoff, in the
/// background, and the wait for it ends at a signal. What `connect` itself returns is
/// not worth retrying: an address that does not parse, or an unreadable credentials
/// file.
async fn connect_until_up(
    settings: &Settings,
    health: &Arc<Health>,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<(async_nats::Client, async_nats::ServerInfo)>> {
    let nats = &settings.config.nats;
    let context = || {
        let url = nats_auth::redact_url_credentials(&nats.url);
        format!("cannot connect to NATS at {url}")
    };
    let options = nats_auth::connect_options(nats)
        .await
        .with_context(context)?;
    let client = connect(
        options,
        nats.urls(),
        settings.dispatcher.cluster.ack_wait,
        health.clone(),
    )
    .await
    .with_context(context)?;
    tokio::select! {
        server = server_info(&client) => Ok(Some((client, server?))),
        _ = shutdown.cancelled() => Ok(None),
    }
}

/// SIGHUP re-reads the secret files of `inject_headers`; a file that cannot be read
/// keeps every old value in use and is logged.
async fn reload_on_hangup(settings: Arc<Settings>, secrets: Arc<Secrets>) {
    let mut hangups = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => s,
        Err(e) => {
            warn!(error = %e, "cannot listen for SIGHUP; secret files will not be reloaded");
            return;
        }
    };
    while hangups.recv().await.is_some() {
        match secrets.reload_files(&settings.dispatcher.cluster.rules) {
            Ok(files) => info!(files, "SIGHUP: secret files reloaded"),
            Err(e) => {
                error!(error = %e, "SIGHUP: secret files not reloaded; the old values stay in use")
            }
        }
    }
}

/// The one signal handler: SIGTERM or SIGINT starts the drain.
async fn stop_on_signal(shutdown: CancellationToken) {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = terminate => info!("SIGTERM: draining"),
        _ = tokio::signal::ctrl_c() => info!("SIGINT: draining"),
    }
    shutdown.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_limit_is_derived_and_capped() {
        let mib = 1024 * 1024;
        assert_eq!(
            effective_max_response_bytes(ByteLimit::Auto, mib).expect("auto"),
            max_response_bytes_for(mib)
        );
        assert_eq!(
            effective_max_response_bytes(ByteLimit::Bytes(1000), mib).expect("small"),
            1000
        );
        let e =
            effective_max_response_bytes(ByteLimit::Bytes(mib as u64), mib).expect_err("too big");
        assert!(e.to_string().contains("outbound.max_response_bytes"), "{e}");
    }
    #[test]
    fn starting_waits_200_ms_doubling_to_5_s() {
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(START_BACKOFF.after(1), ms(200));
        assert_eq!(START_BACKOFF.after(2), ms(400));
        assert_eq!(START_BACKOFF.after(5), ms(3200));
        assert_eq!(START_BACKOFF.after(6), ms(5000));
        assert_eq!(START_BACKOFF.after(u32::MAX), ms(5000));
    }
}
