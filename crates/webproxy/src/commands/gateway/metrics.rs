//! The gateway's metrics: requests by route and outcome, the time requests wait for
//! their answer, open connections and the limits that acted on them. Label values
//! come from the configuration (route paths) and closed sets (outcomes, the gateway's
//! own codes, its limits' keys), never from URLs, ids or addresses.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use webproxy_dispatcher::BucketUseSink;
use webproxy_jetstream::state::{Bucket, BucketUse};

use super::connections::Limit;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    limit: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BucketLabels {
    bucket: &'static str,
}

/// Waits from 1 ms to about 65 s: `wait` is 30 s by default.
fn wait_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The gateway's observable state: what its listener reads, with no I/O.
#[derive(Debug, Clone)]
pub(crate) struct Telemetry {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    wait: Family<RouteLabels, Histogram, fn() -> Histogram>,
    waiting: Gauge,
    refused_connections: Counter,
    connections: Gauge,
    connections_opened: Counter,
    limits: Family<LimitLabels, Counter>,
    accept_errors: Counter,
    nats_connected: Gauge,
    state_bucket_bytes: Family<BucketLabels, Gauge>,
    state_bucket_used_ratio: Family<BucketLabels, Gauge<f64, AtomicU64>>,
    /// Started: connected once, with the records bucket open.
    ready: AtomicBool,
    /// What else keeps the gateway not ready (its key lost), by what: one line each
    /// for `/readyz`.
    stuck: Mutex<BTreeMap<&'static str, String>>,
}

/// The route label of requests that match no route (and of the replies endpoint).
pub(crate) const NO_ROUTE: &str = "none";

impl Telemetry {
    pub(crate) fn new() -> Telemetry {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "webproxy_gateway_requests",
            "HTTP requests the gateway answered, by route and outcome (response, an error code, accepted, or the gateway's own refusal)",
            requests.clone(),
        );
        let wait = Family::<RouteLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            wait_histogram,
        );
        registry.register(
            "webproxy_gateway_wait_seconds",
            "How long published requests waited in the gateway for their answer (a reply, or the 202 when wait ran out)",
            wait.clone(),
        );
        let waiting = Gauge::default();
        registry.register(
            "webproxy_gateway_waiting",
            "Requests waiting in this gateway now (at most max_concurrent)",
            waiting.clone(),
        );
        let refused_connections = Counter::default();
        registry.register(
            "webproxy_gateway_refused_connections",
            "Connections closed at once because their address is outside allow_sources",
            refused_connections.clone(),
        );
        let connections = Gauge::default();
        registry.register(
            "webproxy_gateway_connections",
            "Connections open on this gateway now (at most max_connections)",
            connections.clone(),
        );
        let connections_opened = Counter::default();
        registry.register(
            "webproxy_gateway_connections_opened",
            "Connections the gateway took on (within its caps and allow_sources)",
            connections_opened.clone(),
        );
        let limits = Family::<LimitLabels, Counter>::default();
        registry.register(
            "webproxy_gateway_limits",
            "Times a [gateway] limit refused or closed a connection or a request, by the limit's key",
            limits.clone(),
        );
        // Every limit's series from the start, so a rate over it is 0 rather than absent.
        for limit in Limit::ALL {
            let _ = limits.get_or_create(&LimitLabels { limit: limit.key() });
        }
        let accept_errors = Counter::default();
        registry.register(
            "webproxy_gateway_accept_errors",
            "Connections the gateway failed to accept (out of file descriptors, say); it waits up to 1 s before it accepts again",
            accept_errors.clone(),
        );
        let nats_connected = Gauge::default();
        registry.register(
            "webproxy_gateway_nats_connected",
            "1 while the gateway is connected to NATS",
            nats_connected.clone(),
        );
        // The same series `serve` exports for its buckets, for the gateway's two.
        let state_bucket_bytes = Family::<BucketLabels, Gauge>::default();
        registry.register(
            "webproxy_state_bucket_bytes",
            "Bytes held by each of the gateway's state buckets",
            state_bucket_bytes.clone(),
        );
        let state_bucket_used_ratio = Family::<BucketLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "webproxy_state_bucket_used_ratio",
            "Each of the gateway's state buckets' bytes over its max_bytes; from 0.9 the gateway is not ready",
            state_bucket_used_ratio.clone(),
        );
        Telemetry {
            inner: Arc::new(Inner {
                registry,
                requests,
                wait,
                waiting,
                refused_connections,
                connections,
                connections_opened,
                limits,
                accept_errors,
                nats_connected,
                state_bucket_bytes,
                state_bucket_used_ratio,
                ready: AtomicBool::new(false),
                stuck: Mutex::new(BTreeMap::new()),
            }),
        }
    }

    pub(crate) fn count(&self, route: &str, outcome: &'static str) {
        self.inner
            .requests
            .get_or_create(&RequestLabels {
                route: route.to_string(),
                outcome,
            })
            .inc();
    }

    pub(crate) fn waited(&self, route: &str, wait: Duration) {
        self.inner
            .wait
            .get_or_create(&RouteLabels {
                route: route.to_string(),
            })
            .observe(wait.as_secs_f64());
    }

    /// The gauge of requests waiting now.
    pub(crate) fn waiting(&self) -> &Gauge {
        &self.inner.waiting
    }

    pub(crate) fn refused_connection(&self) {
        self.inner.refused_connections.inc();
    }

    /// A connection was taken on: counted, and in the gauge of open connections
    /// until the returned guard is dropped.
    pub(crate) fn connection_opened(&self) -> impl Drop + Send + use<> {
        self.inner.connections_opened.inc();
        self.inner.connections.inc();
        scopeguard::guard(self.clone(), |telemetry| {
            telemetry.inner.connections.dec();
        })
    }

    /// `limit` refused or closed a connection or a request.
    pub(crate) fn limited(&self, limit: Limit) {
        self.inner
            .limits
            .get_or_create(&LimitLabels { limit: limit.key() })
            .inc();
    }

    pub(crate) fn accept_failed(&self) {
        self.inner.accept_errors.inc();
    }

    pub(crate) fn set_nats_connected(&self, connected: bool) {
        self.inner.nats_connected.set(i64::from(connected));
    }

    pub(crate) fn set_ready(&self, ready: bool) {
        self.inner.ready.store(ready, Ordering::SeqCst);
    }

    /// Keeps the gateway not ready, saying `reason` on `/readyz`, while `what` is
    /// stuck; `None` ends it.
    pub(crate) fn set_stuck(&self, what: &'static str, reason: Option<String>) {
        let mut stuck = self
            .inner
            .stuck
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match reason {
            Some(reason) => stuck.insert(what, reason),
            None => stuck.remove(what),
        };
    }
}

impl BucketUseSink for Telemetry {
    fn set_use(&self, bucket: Bucket, used: Option<BucketUse>) {
        let labels = BucketLabels {
            bucket: bucket.label(),
        };
        let (bytes, ratio) = used.map_or((0, 0.0), |used| (used.bytes, used.ratio()));
        self.inner
            .state_bucket_bytes
            .get_or_create(&labels)
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.inner
            .state_bucket_used_ratio
            .get_or_create(&labels)
            .set(ratio);
    }

    fn set_nearly_full(&self, bucket: Bucket, reason: Option<String>) {
        self.set_stuck(bucket.label(), reason);
    }
}

impl crate::health_listener::Probes for Telemetry {
    fn is_alive(&self) -> bool {
        true
    }

    fn is_ready(&self) -> bool {
        self.inner.ready.load(Ordering::SeqCst)
            && self.inner.nats_connected.get() == 1
            && self.stuck().is_empty()
    }

    fn stuck(&self) -> Vec<String> {
        self.inner
            .stuck
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .values()
            .cloned()
            .collect()
    }

    fn render_metrics(&self) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut text, &self.inner.registry);
        text
    }
}
