//! `webproxy serve`: connect, take the cluster part from the file or from the bucket
//! (`[config] source`), start the dispatcher (which provisions), consume until a
//! signal, drain with a deadline.

use std::sync::Arc;
use std::time::Duration;

use crate::config::nats_auth;
use anyhow::{Context as _, bail};
use tokio::signal::unix::Signal;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use webproxy_config::{Redactor, Secrets};
use webproxy_dispatcher::{Dispatcher, Instruments, check_server, connect};
use webproxy_jetstream::config_store::{ConfigStore, PushNote, Seeded, StoredRevision};
use webproxy_jetstream::state::Bucket;

use crate::commands::serve_follow::{self, Running};
use crate::config::document;
use crate::config::schema::{ClusterDocument, ClusterSource, Settings};
use crate::health_listener;
use crate::rotation;
use tokio::sync::{oneshot, watch};

/// How long the start waits for the first heartbeat to be written before serving
/// anyway (the heartbeat keeps trying).
const FIRST_REPORT: std::time::Duration = std::time::Duration::from_secs(5);

pub(crate) async fn run(settings: Settings, redactor: Redactor) -> anyhow::Result<()> {
    redactor.add_fixed(nats_auth::secret_values(&settings.config.nats));
    let source = settings.config.config.source;
    // In file mode the rules are known now, and an unreadable secret stops the start
    // before anything connects; in kv mode they are known once the bucket is read.
    let file_secrets = match source {
        ClusterSource::File => {
            log_warnings(&settings);
            Some(load_secrets(&settings, &redactor)?)
        }
        ClusterSource::Kv => None,
    };
    let instruments = Instruments::new();
    let listen = settings.config.http.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on http.listen = {listen}"))?;
    health_listener::spawn(listener, instruments.clone());
    info!(%listen, "health listener up");

    let shutdown = CancellationToken::new();
    tokio::spawn(stop_on_signal(shutdown.clone()));
    // Listened for from the start: SIGHUP's default action ends the process.
    let hangups = rotation::hangups("secret files");

    let Some((client, server)) = connect_until_up(&settings, &instruments, &shutdown).await? else {
        return Ok(());
    };
    let (settings, secrets, revision) = match file_secrets {
        Some(secrets) => {
            if !refuse_a_seeded_bucket(&client, &settings, &shutdown).await? {
                return Ok(());
            }
            (settings, secrets, None)
        }
        None => {
            let Some((settings, revision)) =
                cluster_from_bucket(&client, settings, &shutdown).await?
            else {
                return Ok(());
            };
            log_warnings(&settings);
            let secrets = load_secrets(&settings, &redactor)?;
            (settings, secrets, Some(revision))
        }
    };
    let settings = Arc::new(settings);
    let (running, following) = watch::channel(Running {
        revision: revision.unwrap_or(0),
        settings: settings.clone(),
        secrets: secrets.clone(),
    });
    tokio::spawn(follow_secret_files(
        settings.config.service.secret_poll_interval,
        hangups,
        shutdown.clone(),
        following.clone(),
    ));
    let Some(mut dispatcher) = Dispatcher::start(
        settings.dispatcher.clone(),
        client.clone(),
        &server,
        instruments.clone(),
        secrets,
        &shutdown,
    )
    .await?
    else {
        return Ok(());
    };
    // In kv mode the instance follows the bucket. In either mode it reports what it
    // runs: `config push` refuses a push no instance would follow, and `pools remove`
    // a pool a file-mode instance still has.
    let (reported, first_report) = oneshot::channel();
    let reporting = tokio::spawn(serve_follow::heartbeat(
        client.clone(),
        settings.dispatcher.clone(),
        source,
        following,
        dispatcher.ack_wait_pacing(),
        reported,
        shutdown.clone(),
    ));
    // Ready only once reported (or a few seconds tried): an operator who pushes as
    // soon as the instances are ready finds them in the bucket.
    let _ = tokio::time::timeout(FIRST_REPORT, first_report).await;
    // In file mode nothing changes what runs; the sender is kept until the end, as
    // the heartbeat stops when it is dropped.
    let mut _file_running = None;
    if let Some(revision) = revision {
        // `config push` writes to it: a full bucket refuses the next revision.
        dispatcher.gauge_bucket(Bucket::Config);
        instruments.set_config_revision(revision);
        tokio::spawn(serve_follow::follow(
            client.clone(),
            running,
            redactor,
            instruments,
            dispatcher.reconfigure(),
            shutdown.clone(),
        ));
    } else {
        _file_running = Some(running);
    }
    let pools: Vec<&str> = settings
        .dispatcher
        .cluster
        .pools
        .keys()
        .map(String::as_str)
        .collect();
    info!(pools = %pools.join(", "), "serving");
    dispatcher
        .run(shutdown, settings.config.service.shutdown_grace)
        .await;
    // Its report deleted, so that `config push --wait` stops waiting for it.
    let _ = reporting.await;
    drop(_file_running);
    if let Err(e) = client.flush().await {
        warn!(error = %e, "could not flush the NATS connection");
    }
    info!("stopped");
    Ok(())
}

/// Logs the configuration's warnings.
fn log_warnings(settings: &Settings) {
    for warning in settings.warnings() {
        warn!("configuration: {warning}");
    }
}

/// Reads the injected secrets of `settings`' rules: what `serve` checks of a loaded
/// configuration (`cfg::load`) before it serves, and so what `check-config` checks
/// for it, by this one function. In file mode the rules are the file's, read before
/// anything connects; in kv mode the bucket's revision's, once read (the file's, when
/// they seed an empty bucket: `check-config`, which reads no bucket, checks them as
/// that start would). The gateway's tokens and key are `webproxy gateway`'s
/// (`gateway::load_secrets`, which `check-config --gateway` runs), not serve's: a pod
/// of one need not hold the other's secrets.
pub(crate) fn load_secrets(
    settings: &Settings,
    redactor: &Redactor,
) -> anyhow::Result<Arc<Secrets>> {
    let secrets = Secrets::load(&settings.dispatcher.cluster.rules, redactor.clone())
        .context("cannot read an injected secret")?;
    Ok(Arc::new(secrets))
}

/// `source = "file"`: a bucket holding a document is a second source of truth, which
/// instances in `kv` mode would follow while this one follows its file. `false` when a
/// signal arrives before the bucket could be read.
async fn refuse_a_seeded_bucket(
    client: &async_nats::Client,
    settings: &Settings,
    shutdown: &CancellationToken,
) -> anyhow::Result<bool> {
    let Some(found) = ConfigStore::document_at_start(client, &settings.dispatcher, shutdown).await
    else {
        return Ok(false);
    };
    if let Some(found) = found {
        let bucket = settings.dispatcher.subjects.config_bucket();
        bail!(
            "[config] source = \"file\", but the bucket {bucket} holds a cluster document (revision {}): two sources of truth would diverge. Set [config] source = \"kv\" (WEBPROXY_CONFIG__SOURCE=kv) to run on the bucket's document, or delete the bucket (`nats kv del {bucket}`) to run on this file",
            found.revision
        );
    }
    Ok(true)
}

/// A document another writer put in the bucket, validated: the file's cluster
/// settings are ignored, and the log says which.
fn found_in_bucket(settings: &Settings, found: StoredRevision) -> anyhow::Result<Validated> {
    if !settings.cluster_keys_set.is_empty() {
        warn!(
            bucket = settings.dispatcher.subjects.config_bucket(),
            revision = found.revision,
            "[config] source = \"kv\": the bucket's document is the cluster part; these settings of the configuration file and environment are ignored: {}",
            settings.cluster_keys_set.join(", ")
        );
    }
    let validated =
        document::validate(&found.document, &settings.config.streams).with_context(|| {
            format!(
                "the document at revision {} of {} is invalid",
                found.revision,
                settings.dispatcher.subjects.config_bucket()
            )
        })?;
    Ok((found.revision, validated))
}

/// A revision of the bucket and its document, parsed and compiled.
type Validated = (u64, (ClusterDocument, webproxy_config::Settings));

/// `source = "kv"`: the settings with the bucket's document as the cluster part, and
/// its revision. An empty bucket is seeded from the file's cluster part first
/// (compare-and-set: of instances starting together, one writes it and the rest read
/// it). `None` when a signal arrives first.
async fn cluster_from_bucket(
    client: &async_nats::Client,
    settings: Settings,
    shutdown: &CancellationToken,
) -> anyhow::Result<Option<(Settings, u64)>> {
    let bucket = settings.dispatcher.subjects.config_bucket();
    let Some(found) = ConfigStore::document_at_start(client, &settings.dispatcher, shutdown).await
    else {
        return Ok(None);
    };
    let (revision, (document, dispatcher)) = match found {
        Some(found) => found_in_bucket(&settings, found)?,
        None => {
            let text = document::to_text(&settings.config.document())?;
            // What a push must pass, the seed must too (no secret written out).
            let validated = document::validate(&text, &settings.config.streams)
                .with_context(|| format!("cannot seed {bucket} from this configuration"))?;
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "an unnamed host".into());
            let note = PushNote {
                user: format!("webproxy serve on {host}"),
                message: "seeded from the configuration file".into(),
            };
            match ConfigStore::seed_at_start(client, &settings.dispatcher, &note, &text, shutdown)
                .await
            {
                None => return Ok(None),
                Some(Seeded::Written(revision)) => {
                    info!(
                        bucket,
                        revision, "seeded the configuration bucket from this configuration"
                    );
                    (revision, validated)
                }
                Some(Seeded::Found(found)) => found_in_bucket(&settings, found)?,
            }
        }
    };
    info!(
        bucket,
        revision, "running on the bucket's cluster configuration"
    );
    Ok(Some((
        settings.with_document(document, dispatcher),
        revision,
    )))
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
pub(crate) async fn connect_until_up(
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
    let server = tokio::select! {
        server = server_info(&client) => server?,
        _ = shutdown.cancelled() => return Ok(None),
    };
    // Before any bucket is read or created: an old server answers the first KV call
    // with errors that look transient and would be retried forever.
    check_server(&server)?;
    Ok(Some((client, server)))
}

/// Re-reads the secret files of `inject_headers` of the revision running, polled and
/// on SIGHUP; a file that cannot be read keeps every old value in use and is logged.
async fn follow_secret_files(
    interval: Duration,
    hangups: Option<Signal>,
    shutdown: CancellationToken,
    running: watch::Receiver<Running>,
) {
    rotation::follow("secret files", interval, hangups, shutdown, move || {
        let Running {
            settings, secrets, ..
        } = running.borrow().clone();
        match secrets.reload_files(&settings.dispatcher.cluster.rules) {
            Ok(true) => Ok(rotation::Reading::Replaced),
            Ok(false) => Ok(rotation::Reading::Unchanged),
            Err(e) => Err(e.to_string()),
        }
    })
    .await;
}

/// The one signal handler: SIGTERM or SIGINT starts the drain.
pub(crate) async fn stop_on_signal(shutdown: CancellationToken) {
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
