//! Starting to consume, once connected: the server checked, the response limit
//! resolved against its `max_payload`, the worker built, then provisioning and the
//! layout-1 migration retried until they succeed or a signal arrives.

use std::sync::Arc;

use async_nats::jetstream;
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tracing::info;
use webproxy_config::cluster::jetstream_request_timeout;
use webproxy_config::secrets::Secrets;
use webproxy_config::security::{ByteLimit, Outbound};
use webproxy_config::settings::Settings;
use webproxy_worker::{BuildError, DnsConfig, Worker, WorkerConfig};

use super::Dispatcher;
use crate::Instruments;
use crate::conversation::outbox::max_response_bytes_for;
use crate::observability::metrics::Metrics;
use crate::pool::consumers::provision_pool;
use webproxy_jetstream::provision::{
    MIN_SERVER_VERSION, PoolConsumers, ProvisionError, make_fence, pool_state_bucket_config,
    provision_endings, provision_error, replies_fence_config, retire_shared_stream,
    server_version_supported,
};
use webproxy_jetstream::state::{Bucket, StateBucket};

/// Why this instance cannot consume from the server it connected to; retrying does
/// not mend any of these.
#[derive(Debug, Error)]
pub enum StartError {
    #[error(
        "nats-server {version} is too old: webproxy needs {}.{} or newer",
        MIN_SERVER_VERSION.0,
        MIN_SERVER_VERSION.1
    )]
    ServerTooOld { version: String },
    #[error("nats-server {version} has JetStream disabled")]
    NoJetStream { version: String },
    #[error(
        "outbound.max_response_bytes = {configured} is too large: with the server's max_payload of {max_payload} bytes a reply can carry at most {largest} bytes of body"
    )]
    ResponseLimit {
        configured: u64,
        max_payload: usize,
        largest: usize,
    },
    #[error(transparent)]
    Worker(#[from] BuildError),
}

impl Dispatcher {
    /// Prepares to consume from the server `client` is connected to (`server`, its
    /// INFO): checks the server, builds the worker, provisions this instance's pools
    /// and moves the retries a webproxy of the previous stream layout parked, before
    /// [`Dispatcher::run`] turns `/readyz` green. Provisioning and the migration are
    /// retried: JetStream can be briefly unavailable, for example while a cluster
    /// elects its leaders, and a stream of a newer layout, or one being removed, is
    /// refused on every try while the instance stays not ready. `None` when
    /// `shutdown` is cancelled first.
    pub async fn start(
        settings: Arc<Settings>,
        client: async_nats::Client,
        server: &async_nats::ServerInfo,
        instruments: Instruments,
        secrets: Arc<Secrets>,
        shutdown: &CancellationToken,
    ) -> Result<Option<Dispatcher>, StartError> {
        check_server(server)?;
        let max_payload = server.max_payload;
        info!(server = %server.version, max_payload, "connected to NATS");
        let worker = worker_for(
            &settings.cluster.outbound,
            max_payload,
            &instruments.metrics,
        )?;
        let mut js = async_nats::jetstream::new(client.clone());
        js.set_timeout(jetstream_request_timeout(settings.cluster.ack_wait));
        let Some(provisioned) =
            webproxy_jetstream::backoff::retry_until_done("provisioning", shutdown, || {
                provision(&js, &settings)
            })
            .await
        else {
            return Ok(None);
        };
        let dispatcher = Dispatcher::new(
            settings,
            client,
            worker,
            max_payload,
            instruments,
            secrets,
            provisioned,
        );
        let migrated = webproxy_jetstream::backoff::retry_until_done(
            "migrating parked retries",
            shutdown,
            || dispatcher.migrate_layout1_parked(),
        )
        .await;
        Ok(migrated.map(|_| dispatcher))
    }
}

/// Whether webproxy can run against the server that sent `server`: checked first, as
/// soon as the server's INFO arrives, before any bucket is read.
pub fn check_server(server: &async_nats::ServerInfo) -> Result<(), StartError> {
    if !server_version_supported(&server.version) {
        return Err(StartError::ServerTooOld {
            version: server.version.clone(),
        });
    }
    if !server.jetstream {
        return Err(StartError::NoJetStream {
            version: server.version.clone(),
        });
    }
    Ok(())
}

/// The HTTP client for `[outbound]`, its response limit resolved against the server's
/// `max_payload`: at start, and for every revision of the document. Each revision's
/// client has its own DNS resolver and `dns_max_concurrent` slots (a lookup keeps the
/// revision it started under); every one counts its failed lookups in `metrics`.
pub(crate) fn worker_for(
    outbound: &Outbound,
    max_payload: usize,
    metrics: &Arc<Metrics>,
) -> Result<Worker, StartError> {
    let max_response_bytes =
        effective_max_response_bytes(outbound.max_response_bytes, max_payload)?;
    let metrics = metrics.clone();
    Ok(Worker::new(&WorkerConfig {
        max_response_bytes,
        guard: crate::conversation::egress::guard_policy(&outbound.guard),
        max_response_headers: outbound.max_headers,
        max_response_header_bytes: outbound.max_header_bytes,
        dns: DnsConfig {
            timeout: outbound.dns.timeout,
            max_concurrent: outbound.dns.max_concurrent,
            servers: outbound.dns.servers.clone(),
            on_failure: Some(Arc::new(move |failure| metrics.dns_lookup_failed(failure))),
        },
    })?)
}

/// `[outbound] max_response_bytes`, resolved against the server's `max_payload`.
fn effective_max_response_bytes(
    configured: ByteLimit,
    max_payload: usize,
) -> Result<usize, StartError> {
    let largest = max_response_bytes_for(max_payload);
    match configured {
        ByteLimit::Auto => Ok(largest),
        ByteLimit::Bytes(n) if n <= largest as u64 => Ok(usize::try_from(n).unwrap_or(largest)),
        ByteLimit::Bytes(configured) => Err(StartError::ResponseLimit {
            configured,
            max_payload,
            largest,
        }),
    }
}

/// What provisioning made: the pools' consumers, and the progress and cancels buckets.
pub(crate) struct Provisioned {
    pub(crate) pools: Vec<PoolConsumers>,
    pub(crate) progress: StateBucket,
    pub(crate) cancels: StateBucket,
}

/// The state bucket `bucket`, made (or brought to its declared bound) now: an instance
/// is ready only once the buckets its deliveries use exist.
async fn open_state(
    js: &jetstream::Context,
    settings: &Settings,
    bucket: Bucket,
) -> Result<StateBucket, ProvisionError> {
    let state = StateBucket::new(
        js.clone(),
        bucket.spec(&settings.subjects, &settings.streams),
    );
    state
        .store()
        .await
        .map_err(|e| provision_error(format!("bucket {}", state.spec().name), e))?;
    Ok(state)
}

/// Creates or updates every stream, bucket and consumer of this instance's config.
pub(crate) async fn provision(
    js: &jetstream::Context,
    settings: &Settings,
) -> Result<Provisioned, ProvisionError> {
    // Layout 2's shared streams first: their subjects overlap every pool's own
    // replies and dead-letter streams, which the server would refuse to create.
    let subjects = &settings.subjects;
    retire_shared_stream(
        js,
        &subjects.replies_stream(),
        subjects.retired_replies_subject(),
    )
    .await?;
    retire_shared_stream(js, &subjects.dead_stream(), subjects.retired_dead_subject()).await?;
    // At once: until a pool's own streams exist, what an instance of layout 2 still
    // running stores for that pool has no stream (it logs that and answers live only).
    for pool in settings.cluster.pools.keys() {
        provision_endings(js, settings, pool).await?;
    }
    make_fence(js, replies_fence_config(settings)).await?;
    let progress = open_state(js, settings, Bucket::Progress).await?;
    let cancels = open_state(js, settings, Bucket::Cancels).await?;
    let bucket = pool_state_bucket_config(settings);
    let bucket_name = bucket.bucket.clone();
    js.create_or_update_key_value(bucket)
        .await
        .map_err(|e| provision_error(format!("bucket {bucket_name}"), e))?;
    let mut consumers = Vec::new();
    for (pool, pool_config) in &settings.cluster.pools {
        consumers.push(provision_pool(js, settings, pool, pool_config).await?);
    }
    Ok(Provisioned {
        pools: consumers,
        progress,
        cancels,
    })
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
    fn an_old_server_or_one_without_jetstream_is_refused() {
        let server = |version: &str, jetstream| async_nats::ServerInfo {
            version: version.into(),
            jetstream,
            ..Default::default()
        };
        assert!(check_server(&server("2.11.0", true)).is_ok());
        for version in ["2.10.29", "2.9.25"] {
            let old = check_server(&server(version, true)).expect_err(version);
            assert!(matches!(old, StartError::ServerTooOld { .. }), "{old}");
            assert!(old.to_string().contains("needs 2.11 or newer"), "{old}");
        }
        let no_js = check_server(&server("2.11.1", false)).expect_err("no JetStream");
        assert!(matches!(no_js, StartError::NoJetStream { .. }), "{no_js}");
    }
}
