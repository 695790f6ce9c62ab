//! `webproxy serve`: connect, start the dispatcher (which provisions), consume until a
//! signal, drain with a deadline.

use std::sync::Arc;
use std::time::Duration;

use crate::nats_auth;
use anyhow::{Context as _, bail};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};
use webproxy_dispatcher::{Dispatcher, Instruments, Redactor, Secrets, connect};

use crate::config::Settings;
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
    let instruments = Instruments::new();
    let listen = settings.config.http.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on http.listen = {listen}"))?;
    health::spawn(listener, instruments.clone());
    info!(%listen, "health listener up");

    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    tokio::spawn(reload_on_hangup(settings.clone(), secrets.clone()));

    let Some((client, server)) = connect_until_up(&settings, &instruments, &shutdown).await? else {
        return Ok(());
    };
    let Some(dispatcher) = Dispatcher::start(
        settings.dispatcher.clone(),
        client.clone(),
        &server,
        instruments,
        secrets,
        &shutdown,
    )
    .await?
    else {
        return Ok(());
    };
    info!(pools = ?settings.dispatcher.cluster.pools.keys().collect::<Vec<_>>(), "serving");
    dispatcher
        .run(shutdown, settings.config.service.shutdown_grace)
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

/// Connects and waits for the server's INFO; `None` when a signal arrives first.
///
/// Connecting is retried once, by the client: `connect` sets `retry_on_initial_connect`,
/// so an unreachable server is tried again with the reconnect backoff, in the
/// background, and the wait for it ends at a signal. What `connect` itself returns is
/// not worth retrying: an address that does not parse, or an unreadable credentials
/// file.
async fn connect_until_up(
    settings: &Settings,
    instruments: &Instruments,
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
        instruments,
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
