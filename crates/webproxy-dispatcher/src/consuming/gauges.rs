//! Each pool's gauges, refreshed from its consumers' info on a fixed interval, and the
//! server's time in that info as a reading of this pod's clock skew.

use std::sync::Arc;

use async_nats::jetstream::{self, consumer::PullConsumer, context::GetStreamErrorKind};
use tokio_util::sync::CancellationToken;
use tracing::debug;
use webproxy_protocol::Subjects;

use crate::conversation::Revision;
use crate::observability::gauges::GAUGE_REFRESH;
use webproxy_jetstream::clock;

/// Reads a pool's waiting and parked counts and its limit from its consumers on a fixed
/// interval.
pub(crate) async fn refresh_gauges(
    shared: Arc<Revision>,
    pool: String,
    work: PullConsumer,
    parked: PullConsumer,
    shutdown: CancellationToken,
) {
    let Some(gauge) = shared.gauges.pool(&pool) else {
        return;
    };
    let mut interval = tokio::time::interval(GAUGE_REFRESH);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        match (
            timed_info(&shared.outlet.js, &work).await,
            parked.get_info().await.map_err(|e| e.to_string()),
        ) {
            (Ok(work), Ok(parked)) => {
                shared.pacing.server_has(&pool, work.config.ack_wait);
                gauge.set_queued(
                    work.num_pending,
                    parked.num_pending + parked.num_ack_pending as u64,
                );
                shared
                    .outlet
                    .metrics
                    .set_pool_paused(&pool, shared.pool_control.is_paused(&pool));
                if let Some(config) = shared.settings.cluster.pools.get(&pool) {
                    shared.outlet.metrics.set_pool_effective_limit(
                        &pool,
                        shared.pool_control.effective_limit(&pool, config),
                    );
                }
                // Negative means unlimited, which webproxy never provisions.
                if let Ok(limit) = u64::try_from(work.config.max_ack_pending) {
                    gauge.set_max_in_flight(limit);
                }
            }
            (Err(e), _) | (_, Err(e)) => debug!(pool, error = %e, "cannot refresh pool gauges"),
        }
        refresh_body_store(&shared, &pool).await;
    }
}

/// The pool's body store's use, into its gauge: one `STREAM.INFO`; a store the server
/// does not have holds nothing, and a reading that fails otherwise keeps the last.
async fn refresh_body_store(shared: &Revision, pool: &str) {
    let settings = &shared.settings;
    let name = Subjects::object_stream(&settings.subjects.pool_body_bucket(pool));
    let bound = settings.streams.body_max_bytes;
    let used = match shared.outlet.js.get_stream(&name).await {
        Ok(stream) => stream.cached_info().state.bytes,
        Err(e)
            if matches!(e.kind(), GetStreamErrorKind::JetStream(ref js)
                if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
        {
            0
        }
        Err(e) => {
            debug!(pool, error = %e, "cannot read the body store's use");
            return;
        }
    };
    let ratio = if bound > 0 {
        used as f64 / bound as f64
    } else {
        0.0
    };
    shared.outlet.metrics.set_body_store_used(pool, ratio);
}

/// A consumer's info, as `get_info` reads it, and the server's time in it (`ts`) as a
/// reading of this pod's clock skew (`clock::observe`): the gauges' own round trip,
/// with none added.
pub(crate) async fn timed_info(
    js: &async_nats::jetstream::Context,
    consumer: &PullConsumer,
) -> Result<async_nats::jetstream::consumer::Info, String> {
    use async_nats::jetstream::response::Response;
    let cached = consumer.cached_info();
    let subject = format!("CONSUMER.INFO.{}.{}", cached.stream_name, cached.name);
    let sent = clock::local();
    let response: Response<serde_json::Value> = js
        .request(subject, &serde_json::json!({}))
        .await
        .map_err(|e| e.to_string())?;
    let received = clock::local();
    let info = match response {
        Response::Err { error } => return Err(error.to_string()),
        Response::Ok(info) => info,
    };
    let server = info
        .get("ts")
        .and_then(serde_json::Value::as_str)
        .and_then(|ts| {
            time::OffsetDateTime::parse(ts, &time::format_description::well_known::Rfc3339).ok()
        });
    if let Some(server) = server {
        clock::observe(clock::Sample {
            sent_us: clock::unix_us(sent),
            received_us: clock::unix_us(received),
            server_us: clock::unix_us(server.into()),
        });
    }
    serde_json::from_value(info).map_err(|e| e.to_string())
}
