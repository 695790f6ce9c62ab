//! The use of the service's state buckets: read from the server on the gauges'
//! interval (one `STREAM.INFO` a bucket, nothing on the hot path), exported as gauges,
//! and a nearly full bucket keeps the instance not ready, named on `/readyz`, before
//! the full bucket refuses the writes the cluster needs (every bucket is discard-new).

use std::sync::Arc;

use async_nats::jetstream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use webproxy_config::settings::StreamsConfig;
use webproxy_protocol::Subjects;

use super::gauges::GAUGE_REFRESH;
use crate::observability::health::Health;
use crate::observability::metrics::Metrics;
use webproxy_jetstream::state::{Bucket, BucketUse, StateBucket};

/// The buckets `serve` uses whatever its configuration source. The configuration
/// bucket is added in kv mode (`Dispatcher::gauge_bucket`); the gateway's buckets are
/// its own process's.
pub(crate) const SERVED: [Bucket; 5] = [
    Bucket::Progress,
    Bucket::Instances,
    Bucket::PoolState,
    Bucket::Rate,
    Bucket::Cancels,
];

/// Makes a bucket the server confirmed gone again, with the spec's settings (the
/// handle's own check: only after "stream not found").
async fn make_again(handle: &StateBucket) {
    let name = &handle.spec().name;
    handle.reopen().await;
    match handle.store().await {
        Ok(_) => info!(bucket = name, "the bucket was gone; made it again"),
        Err(e) => debug!(bucket = name, error = %e, "cannot make the bucket again yet"),
    }
}

/// What the service's readiness is kept by while `bucket` is nearly full.
fn stuck_key(bucket: Bucket) -> String {
    format!("full.{}", bucket.label())
}

/// Where a process puts what it reads of its buckets' use: its gauges, and its
/// readiness while a bucket is nearly full (`reason` names it; `None` ends that).
pub trait BucketUseSink: Send + Sync {
    fn set_use(&self, bucket: Bucket, used: Option<BucketUse>);
    fn set_nearly_full(&self, bucket: Bucket, reason: Option<String>);
}

/// `serve`'s sink: the dispatcher's gauges and `/readyz`.
pub(crate) struct Served {
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) health: Arc<Health>,
}

impl BucketUseSink for Served {
    fn set_use(&self, bucket: Bucket, used: Option<BucketUse>) {
        self.metrics.set_state_bucket_use(bucket.label(), used);
    }

    fn set_nearly_full(&self, bucket: Bucket, reason: Option<String>) {
        self.health.set_stuck(&stuck_key(bucket), reason);
    }
}

/// Reads the use of each of `buckets` (declared under `subjects` and `streams`) every
/// 5 s (the gauges' refresh) until `shutdown`, into `sink`. A bucket the server confirms gone
/// holds nothing: its gauges read 0 and it is not full, and one that was there before
/// and may be made again is made again then, so that a bucket lost while nothing uses
/// it (a progress bucket between parks, which `dead replay` and `pools` need) is back
/// within one interval.
/// A reading that fails otherwise (the API down or slow) changes nothing: the gauges
/// and the readiness keep the last reading, since a full bucket is no less full for
/// being unreadable. `serve` reads its buckets, `gateway` its own two.
pub async fn follow_bucket_use(
    js: jetstream::Context,
    subjects: &Subjects,
    streams: &StreamsConfig,
    buckets: &[Bucket],
    sink: &impl BucketUseSink,
    shutdown: CancellationToken,
) {
    // Each bucket, whether it was nearly full at the last reading, and whether a
    // reading ever found it: only a bucket that was there is made again, so that one
    // no feature has made yet (a rate bucket with no rate configured) stays unmade.
    let mut watched: Vec<(Bucket, StateBucket, bool, bool)> = buckets
        .iter()
        .map(|&bucket| {
            let spec = bucket.spec(subjects, streams);
            (bucket, StateBucket::new(js.clone(), spec), false, false)
        })
        .collect();
    let mut interval = tokio::time::interval(GAUGE_REFRESH);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            _ = shutdown.cancelled() => return,
        }
        for (bucket, handle, was_full, was_there) in &mut watched {
            let name = &handle.spec().name;
            let used = match handle.usage().await {
                Ok(used) => used,
                Err(e) => {
                    debug!(bucket = name, error = %e, "cannot read the bucket's use");
                    continue;
                }
            };
            sink.set_use(*bucket, used);
            if used.is_some() {
                *was_there = true;
            } else if *was_there && handle.spec().recreate {
                make_again(handle).await;
            }
            let full = used.is_some_and(|used| used.nearly_full(*was_full));
            match (used, full) {
                (Some(used), true) => {
                    let reason = used.describe(name);
                    if !*was_full {
                        warn!("{reason}");
                    }
                    sink.set_nearly_full(*bucket, Some(reason));
                }
                (_, false) if *was_full => {
                    info!(bucket = name, "the bucket is no longer nearly full");
                    sink.set_nearly_full(*bucket, None);
                }
                _ => {}
            }
            *was_full = full;
        }
    }
}
