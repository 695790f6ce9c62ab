//! `webproxy gateway`: a stateless HTTP front door on the pools. Each request to a
//! route is published as a request envelope (so the request rules, the pools'
//! limits and the retries apply as to any caller) and answered with its reply; a
//! reply that takes longer than `wait` is answered 202 and served later from
//! `/_webproxy/replies/<id>`. State lives in NATS only (the ids' records and the
//! shared key), so any number of gateways run behind one Kubernetes Service.

mod body;
mod connections;
mod handler;
mod ids;
mod key_commands;
mod listener;
mod mapping;
mod metrics;
mod route;
mod store;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use webproxy_config::Redactor;
use webproxy_config::element_key;
use webproxy_dispatcher::{Instruments, follow_bucket_use};
use webproxy_jetstream::state::Bucket;

use crate::config::gateway::RESERVED_PATH;
use crate::config::schema::Settings;
use crate::health_listener;
use crate::rotation;

pub(crate) use key_commands::{KeyCommand, run as run_key_command};
pub(crate) use metrics::Telemetry;

/// Where the reply of a conversation that goes on is read: `<REPLIES_PATH><id>`.
pub(crate) const REPLIES_PATH: &str = "/_webproxy/replies/";

const _: () = assert!(REPLIES_PATH.len() > RESERVED_PATH.len());

/// How long a failed start-up step (the key, the bucket) waits before it is tried
/// again.
const START_RETRY: Duration = Duration::from_secs(1);

/// How often the key bucket is read: a lost key turns `/readyz` 503 within this and
/// a lookup (the bound is 10 s), and a rotated or restored key is in force on
/// every gateway within it.
const KEY_POLL: Duration = Duration::from_secs(2);

/// What the gateway needs before it serves, read from files and the environment:
/// each route's token, the configured key, the TLS acceptor. `check-config` reads
/// them too, so a token that cannot be read fails there as at start.
pub(crate) struct Secrets {
    pub(crate) tokens: Vec<Option<String>>,
    pub(crate) key: Option<String>,
    pub(crate) tls: Option<tokio_rustls::TlsAcceptor>,
}

/// Reads the tokens, the key and the TLS files; errors name the key.
pub(crate) fn load_secrets(settings: &Settings) -> anyhow::Result<Secrets> {
    let gateway = &settings.gateway;
    let tokens = read_tokens(settings)?;
    let key = settings
        .config
        .gateway
        .key
        .as_ref()
        .map(|source| {
            source
                .read()
                .map_err(|message| anyhow::anyhow!("gateway.key: {message}"))
        })
        .transpose()?;
    let tls = match &gateway.tls {
        Some((cert, key)) => Some(listener::tls_acceptor(cert, key)?),
        None => None,
    };
    Ok(Secrets { tokens, key, tls })
}

/// Every route's token, read from its variable or file; the first that cannot be read
/// fails them all.
fn read_tokens(settings: &Settings) -> anyhow::Result<Vec<Option<String>>> {
    settings
        .gateway
        .routes
        .iter()
        .enumerate()
        .map(|(index, route)| {
            route
                .token
                .as_ref()
                .map(|source| {
                    source.read().map_err(|message| {
                        let route = element_key("gateway.routes", index, None);
                        anyhow::anyhow!("{route}.token: {message}")
                    })
                })
                .transpose()
        })
        .collect()
}

/// Runs the gateway until SIGTERM or SIGINT.
/// The logger's `redactor` learns the NATS credentials, the tokens and the key.
pub(crate) async fn run(settings: Settings, redactor: Redactor) -> anyhow::Result<()> {
    redactor.add_fixed(crate::config::nats_auth::secret_values(
        &settings.config.nats,
    ));
    for warning in &settings.environment_warnings {
        warn!("configuration: {warning}");
    }
    let secrets = load_secrets(&settings)?;
    redactor.add_fixed(
        secrets
            .tokens
            .iter()
            .flatten()
            .chain(secrets.key.iter())
            .cloned()
            .collect(),
    );
    let config = &settings.config.gateway;
    let telemetry = Telemetry::new();
    let health_listen = config.health_listen;
    let health_socket = tokio::net::TcpListener::bind(health_listen)
        .await
        .with_context(|| format!("cannot listen on gateway.health_listen = {health_listen}"))?;
    health_listener::spawn(health_socket, telemetry.clone());
    let listen = config.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on gateway.listen = {listen}"))?;
    info!(%listen, %health_listen, tls = secrets.tls.is_some(), "gateway listening");

    let shutdown = CancellationToken::new();
    tokio::spawn(crate::commands::serve::stop_on_signal(shutdown.clone()));
    // The dispatcher's connection conventions (reconnect backoff, pings); its
    // instruments are not the gateway's, which follows the connection below.
    let Some((nats, server)) =
        crate::commands::serve::connect_until_up(&settings, &Instruments::new(), &shutdown).await?
    else {
        return Ok(());
    };
    tokio::spawn(follow_connection(nats.clone(), telemetry.clone()));
    let js = jetstream::new(nats.clone());
    let subjects = &settings.dispatcher.subjects;
    let streams = &settings.config.streams;
    tokio::spawn({
        let (js, subjects, streams) = (js.clone(), subjects.clone(), streams.clone());
        let (telemetry, shutdown) = (telemetry.clone(), shutdown.clone());
        async move {
            let buckets = [Bucket::Gateway, Bucket::GatewayKey];
            follow_bucket_use(js, &subjects, &streams, &buckets, &telemetry, shutdown).await;
        }
    });
    let records = store::Records::new(&js, subjects, streams);
    // A configured key is the operator's; otherwise the bucket's, followed while the
    // gateway runs.
    let (key, key_bucket) = match &secrets.key {
        Some(key) => (Ok(ids::Key::new(key.as_bytes().to_vec())), None),
        None => {
            let keys = store::KeyBucket::new(&js, subjects, streams);
            let Some(key) = retried(&shutdown, "the gateway key", || keys.at_start(&records)).await
            else {
                return Ok(());
            };
            (key.map_err(|loss| loss.describe(keys.name())), Some(keys))
        }
    };
    if retried(&shutdown, "the gateway bucket", || records.open())
        .await
        .is_none()
    {
        return Ok(());
    }
    let client = webproxy_client::Client::new(nats.clone(), subjects.prefix())?;
    let state = Arc::new(handler::Gateway::new(
        &settings,
        secrets.tokens,
        key,
        records,
        client,
        server.max_payload,
        telemetry.clone(),
    ));
    if let Some(keys) = key_bucket {
        tokio::spawn(follow_key(keys, state.clone(), shutdown.clone()));
    }
    // Listened for before serving: SIGHUP's default action ends the process.
    tokio::spawn(follow_token_files(
        settings.clone(),
        rotation::hangups("token files"),
        shutdown.clone(),
        state.clone(),
        redactor,
    ));
    telemetry.set_ready(true);
    info!(routes = settings.gateway.routes.len(), "gateway serving");
    // Requests already being answered get their answers (a 202 for those still
    // waiting as shutdown_grace runs out); their conversations go on either way.
    let drain = listener::Drain {
        shutdown: shutdown.clone(),
        grace: settings.config.service.shutdown_grace,
        give_up: state.give_up(),
    };
    listener::serve(
        listener,
        handler::router(state),
        secrets.tls,
        settings.gateway.allow_sources.clone(),
        listener::Limits::of(config),
        telemetry.clone(),
        drain,
    )
    .await;
    if let Err(e) = nats.flush().await {
        warn!(error = %e, "could not flush the NATS connection");
    }
    info!("gateway stopped");
    Ok(())
}

/// Re-reads the routes' tokens (a file's may have been rotated), polled and on SIGHUP,
/// all or nothing: one that cannot be read keeps every old token in force and is
/// logged.
async fn follow_token_files(
    settings: Settings,
    hangups: Option<tokio::signal::unix::Signal>,
    shutdown: CancellationToken,
    state: Arc<handler::Gateway>,
    redactor: Redactor,
) {
    let interval = settings.config.service.secret_poll_interval;
    let mut in_force = state.tokens().as_ref().clone();
    rotation::follow("gateway tokens", interval, hangups, shutdown, move || {
        let tokens = read_tokens(&settings).map_err(|e| format!("{e:#}"))?;
        Ok(rotation::replace_if_changed(
            &mut in_force,
            tokens,
            |tokens| {
                redactor.add_fixed(tokens.iter().flatten().cloned().collect());
                state.replace_tokens(tokens.clone());
            },
        ))
    })
    .await;
}

/// Reads the key bucket every [`KEY_POLL`] and puts what it holds in force: a key
/// rotated or restored by an operator, or its loss (the gateway then refuses what
/// needs the key and is not ready). A reading that fails (the API down) changes
/// nothing: it says nothing about the key.
async fn follow_key(
    keys: store::KeyBucket,
    state: Arc<handler::Gateway>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(KEY_POLL) => {}
            _ = shutdown.cancelled() => return,
        }
        match keys.read().await {
            Ok(entry) => state.set_key(
                store::running(entry)
                    .map(ids::Key::new)
                    .map_err(|loss| loss.describe(keys.name())),
            ),
            Err(e) => debug!(
                error = format!("{e:#}"),
                "cannot read the gateway key; keeping the one in force"
            ),
        }
    }
}

/// `f` until it succeeds, logging each failure; `None` when a signal comes first.
async fn retried<T, F, Fut>(shutdown: &CancellationToken, what: &str, mut f: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    loop {
        match f().await {
            Ok(value) => return Some(value),
            Err(e) => warn!(error = format!("{e:#}"), "cannot open {what}; trying again"),
        }
        tokio::select! {
            _ = tokio::time::sleep(START_RETRY) => {}
            _ = shutdown.cancelled() => return None,
        }
    }
}

/// Keeps the connected gauge (which `/readyz` reads) in step with the connection.
async fn follow_connection(nats: async_nats::Client, telemetry: Telemetry) {
    loop {
        let connected = nats.connection_state() == async_nats::connection::State::Connected;
        telemetry.set_nats_connected(connected);
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}
