//! Prometheus metrics. Label values come from the configuration (pool and rule names)
//! and from closed sets (outcomes, codes, result classes), never from URLs or ids, so
//! cardinality stays bounded.

use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use webproxy_worker::DnsFailure;

use crate::observability::gauges::Gauges;
use crate::observability::health::Health;
use webproxy_jetstream::state::BucketUse;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    pool: String,
    rule: String,
    outcome: &'static str,
    code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    pool: String,
    rule: String,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuleLabels {
    pool: String,
    rule: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabels {
    pool: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DeadLabels {
    pool: String,
    code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConsumerWriteLabels {
    pool: String,
    write: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TransitionLabels {
    pool: String,
    to: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BucketLabels {
    bucket: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DnsLabels {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CancelledLabels {
    pool: String,
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
}

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// HTTP attempts, from 1 ms to about 65 s.
fn attempt_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Queue waits, from 5 ms to about 22 min: queue timeouts of several minutes are usual
/// (the examples use 2 to 5), and a wait of up to 15 min must still fall in a bucket
/// below `+Inf`.
fn queue_wait_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.005, 2.0, 19)
}

fn queue_wait_histogram() -> Histogram {
    Histogram::new(queue_wait_buckets())
}

/// Every metric webproxy exports.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    attempts: Family<AttemptLabels, Counter>,
    attempt_duration: HistogramFamily<RuleLabels>,
    queue_wait: HistogramFamily<PoolLabels>,
    in_flight: Family<PoolLabels, Gauge>,
    pool_waiting: Family<PoolLabels, Gauge>,
    pool_parked: Family<PoolLabels, Gauge>,
    pool_max_in_flight: Family<PoolLabels, Gauge>,
    dead_letters: Family<DeadLabels, Counter>,
    consumer_recreations: Family<PoolLabels, Counter>,
    nats_connected: Gauge,
    config_revision: Gauge,
    config_refused: Counter,
    pool_consumer_writes: Family<ConsumerWriteLabels, Counter>,
    pool_consumers_owner: Gauge,
    clock_skew: Gauge<f64, AtomicU64>,
    pool_paused: Family<PoolLabels, Gauge>,
    body_store_used_ratio: Family<PoolLabels, Gauge<f64, AtomicU64>>,
    gate_wait: HistogramFamily<PoolLabels>,
    rate_schedule_requests: Family<PoolLabels, Counter>,
    breaker_transitions: Family<TransitionLabels, Counter>,
    pool_effective_limit: Family<PoolLabels, Gauge>,
    state_bucket_bytes: Family<BucketLabels, Gauge>,
    state_bucket_used_ratio: Family<BucketLabels, Gauge<f64, AtomicU64>>,
    dns_lookup_failures: Family<DnsLabels, Counter>,
    conversations_cancelled: Family<CancelledLabels, Counter>,
}

impl Metrics {
    pub(crate) fn new(version: &str) -> Metrics {
        let mut registry = Registry::with_prefix("webproxy");
        let requests = Family::default();
        registry.register(
            "requests",
            "Conversations ended, by pool, rule (\"none\" when no rule matched), outcome and error code (\"none\" for responses)",
            requests.clone(),
        );
        let attempts = Family::default();
        registry.register(
            "attempts",
            "HTTP attempts, by pool, rule and result: a status class (2xx..5xx) or a transport failure kind",
            attempts.clone(),
        );
        let attempt_duration: HistogramFamily<RuleLabels> =
            Family::new_with_constructor(attempt_histogram);
        registry.register(
            "attempt_duration_seconds",
            "Duration of HTTP attempts",
            attempt_duration.clone(),
        );
        let queue_wait: HistogramFamily<PoolLabels> =
            Family::new_with_constructor(queue_wait_histogram);
        registry.register(
            "queue_wait_seconds",
            "Time from the caller's publish to the first attempt",
            queue_wait.clone(),
        );
        let in_flight = Family::default();
        registry.register(
            "in_flight",
            "Messages being handled by this instance now; sum across pods",
            in_flight.clone(),
        );
        let pool_waiting = Family::default();
        registry.register(
            "pool_waiting",
            "Requests waiting in the pool's queue, cluster-wide: every pod reports the same value, so aggregate with max, not sum",
            pool_waiting.clone(),
        );
        let pool_parked = Family::default();
        registry.register(
            "pool_parked",
            "Retries parked waiting for their due time, cluster-wide: every pod reports the same value, so aggregate with max, not sum",
            pool_parked.clone(),
        );
        let pool_max_in_flight = Family::default();
        registry.register(
            "pool_max_in_flight",
            "The pool's limit on messages in flight across all instances (its consumer's max_ack_pending), cluster-wide: every pod reports the same value, so aggregate with max, not sum",
            pool_max_in_flight.clone(),
        );
        let dead_letters = Family::default();
        registry.register(
            "dead_letters",
            "Dead letters written, by pool and error code",
            dead_letters.clone(),
        );
        let consumer_recreations = Family::default();
        registry.register(
            "consumer_recreations",
            "Pool consumers found missing and recreated by this instance",
            consumer_recreations.clone(),
        );
        let nats_connected = Gauge::default();
        registry.register(
            "nats_connected",
            "1 while this instance is connected to NATS",
            nats_connected.clone(),
        );
        let config_revision = Gauge::default();
        registry.register(
            "config_revision",
            "The revision of the configuration bucket's document this instance runs (0 when the cluster part comes from the file)",
            config_revision.clone(),
        );
        let config_refused = Counter::default();
        registry.register(
            "config_refused",
            "Revisions of the configuration bucket's document this instance refused, keeping the one it ran",
            config_refused.clone(),
        );
        let pool_consumer_writes = Family::default();
        registry.register(
            "pool_consumer_writes",
            "Writes of a pool consumer's settings by this instance, while it held the lease of them: \"update\" (limits) or \"pause\"",
            pool_consumer_writes.clone(),
        );
        let pool_consumers_owner = Gauge::default();
        registry.register(
            "pool_consumers_owner",
            "1 while this instance holds the lease that makes it the one writer of the pool consumers' settings",
            pool_consumers_owner.clone(),
        );
        let clock_skew = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "clock_skew_seconds",
            "How far this instance's clock runs ahead of the NATS server's (negative: behind), as last measured; beyond 1 s, its decisions read the server's time",
            clock_skew.clone(),
        );
        let pool_paused = Family::default();
        registry.register(
            "pool_paused",
            "1 while the pool's runtime state holds a pause in force (by hand, Retry-After), cluster-wide: every pod reports the same value, so aggregate with max, not sum",
            pool_paused.clone(),
        );
        let body_store_used_ratio = Family::<PoolLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "body_store_used_ratio",
            "The share of body_max_bytes the pool's body store (large bodies) holds, as last read (every 5 s; 0 while the pool has none); a full store ends that attempt internal and blocks nothing; cluster-wide: aggregate with max, not sum",
            body_store_used_ratio.clone(),
        );
        let gate_wait: HistogramFamily<PoolLabels> =
            Family::new_with_constructor(queue_wait_histogram);
        registry.register(
            "gate_wait_seconds",
            "Time a message waited, holding its slot, for its pool's pause to end and for a slot of its rate schedule",
            gate_wait.clone(),
        );
        let rate_schedule_requests = Family::default();
        registry.register(
            "rate_schedule_requests",
            "NATS requests this instance made to claim slots of the pool's rate schedule (reads and compare-and-set writes); divide by attempts for the cost per attempt",
            rate_schedule_requests.clone(),
        );
        let breaker_transitions = Family::default();
        registry.register(
            "breaker_transitions",
            "Changes of the pool's circuit breaker this instance made or saw, by the state it went to: \"open\" (opened, or reopened by a failed probe), \"half_open\" (its pause ended and a message went through as its one probe) or \"closed\" (a probe succeeded); sum across pods",
            breaker_transitions.clone(),
        );
        let pool_effective_limit = Family::default();
        registry.register(
            "pool_effective_limit",
            "The pool's limit on attempts in flight across all instances as its runtime state sets it: max_in_flight, the adaptive limit when adaptive is on, 1 while the breaker is open or half-open; cluster-wide: every pod reports the same value, so aggregate with max, not sum",
            pool_effective_limit.clone(),
        );
        let state_bucket_bytes = Family::default();
        registry.register(
            "state_bucket_bytes",
            "Bytes a bucket of the service's cluster state holds, as last read (every 5 s; 0 while it is missing); cluster-wide: every pod reports the same value, so aggregate with max, not sum",
            state_bucket_bytes.clone(),
        );
        let state_bucket_used_ratio = Family::<BucketLabels, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "state_bucket_used_ratio",
            "The share of its size bound a bucket of the service's cluster state holds, as last read (every 5 s; 0 while it is missing); a full bucket refuses writes, and from 0.9 the instance is not ready until it falls below 0.85; cluster-wide: aggregate with max, not sum",
            state_bucket_used_ratio.clone(),
        );
        let dns_lookup_failures = Family::<DnsLabels, Counter>::default();
        // Every reason from the start, so a rate never begins at a missing series.
        for failure in [DnsFailure::Timeout, DnsFailure::Busy, DnsFailure::Error] {
            let _ = dns_lookup_failures.get_or_create(&DnsLabels {
                reason: failure.as_str(),
            });
        }
        registry.register(
            "dns_lookup_failures",
            "Host name lookups that failed on this instance, by reason: timeout (no answer within [outbound] dns_timeout), busy (every slot of dns_max_concurrent was taken and none freed in time) or error (the servers answered with an error, such as no such name, or could not be reached)",
            dns_lookup_failures.clone(),
        );
        let conversations_cancelled = Family::default();
        registry.register(
            "conversations_cancelled",
            "Conversations a cancel ended, by pool and what they were doing: waiting (no attempt yet), parked (waiting for a retry) or in_flight (the attempt was dropped)",
            conversations_cancelled.clone(),
        );
        let build_info: Family<BuildLabels, Gauge> = Family::default();
        build_info
            .get_or_create(&BuildLabels {
                version: version.to_string(),
            })
            .set(1);
        registry.register("build_info", "The running version", build_info);
        Metrics {
            registry,
            requests,
            attempts,
            attempt_duration,
            queue_wait,
            in_flight,
            pool_waiting,
            pool_parked,
            pool_max_in_flight,
            dead_letters,
            consumer_recreations,
            nats_connected,
            config_revision,
            config_refused,
            pool_consumer_writes,
            pool_consumers_owner,
            clock_skew,
            pool_paused,
            body_store_used_ratio,
            gate_wait,
            rate_schedule_requests,
            breaker_transitions,
            pool_effective_limit,
            state_bucket_bytes,
            state_bucket_used_ratio,
            dns_lookup_failures,
            conversations_cancelled,
        }
    }

    /// A host name lookup failed (`webproxy_worker::DnsConfig::on_failure`).
    pub(crate) fn dns_lookup_failed(&self, failure: DnsFailure) {
        self.dns_lookup_failures
            .get_or_create(&DnsLabels {
                reason: failure.as_str(),
            })
            .inc();
    }

    /// What `bucket` (its `Bucket::label`) holds now: `None` while it is missing,
    /// which holds nothing.
    pub(crate) fn set_state_bucket_use(&self, bucket: &'static str, used: Option<BucketUse>) {
        let labels = BucketLabels { bucket };
        let (bytes, ratio) = used.map_or((0, 0.0), |used| (used.bytes, used.ratio()));
        self.state_bucket_bytes
            .get_or_create(&labels)
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.state_bucket_used_ratio
            .get_or_create(&labels)
            .set(ratio);
    }

    /// `pool`'s breaker went `to` "open", "half_open" or "closed".
    pub(crate) fn breaker_transition(&self, pool: &str, to: &'static str) {
        self.breaker_transitions
            .get_or_create(&TransitionLabels {
                pool: pool.to_string(),
                to,
            })
            .inc();
    }

    /// `pool`'s limit as its runtime state sets it now.
    pub(crate) fn set_pool_effective_limit(&self, pool: &str, limit: u64) {
        self.pool_effective_limit
            .get_or_create(&PoolLabels {
                pool: pool.to_string(),
            })
            .set(i64::try_from(limit).unwrap_or(i64::MAX));
    }

    /// Whether `pool` is paused now, as its runtime state says.
    pub(crate) fn set_pool_paused(&self, pool: &str, paused: bool) {
        self.pool_paused
            .get_or_create(&PoolLabels {
                pool: pool.to_string(),
            })
            .set(i64::from(paused));
    }

    /// The share of its `body_max_bytes` `pool`'s body store holds.
    pub(crate) fn set_body_store_used(&self, pool: &str, ratio: f64) {
        self.body_store_used_ratio
            .get_or_create(&PoolLabels {
                pool: pool.to_string(),
            })
            .set(ratio);
    }

    /// A message of `pool` waited `wait` at its pool's gate.
    pub(crate) fn gate_wait(&self, pool: &str, wait: Duration) {
        self.gate_wait
            .get_or_create(&PoolLabels {
                pool: pool.to_string(),
            })
            .observe(wait.as_secs_f64());
    }

    /// `requests` NATS requests were made to claim slots of `pool`'s rate schedule.
    pub(crate) fn rate_schedule_requests(&self, pool: &str, requests: u64) {
        self.rate_schedule_requests
            .get_or_create(&PoolLabels {
                pool: pool.to_string(),
            })
            .inc_by(requests);
    }

    /// This instance wrote a `write` (`ConsumerWrite::kind`) to `pool`'s work consumer.
    pub(crate) fn pool_consumer_written(&self, pool: &str, write: &'static str) {
        self.pool_consumer_writes
            .get_or_create(&ConsumerWriteLabels {
                pool: pool.to_string(),
                write,
            })
            .inc();
    }

    /// Whether this instance holds the lease of the pool consumers' settings.
    pub(crate) fn set_pool_consumers_owner(&self, holding: bool) {
        self.pool_consumers_owner.set(i64::from(holding));
    }

    /// The instance now runs the document of `revision`.
    pub(crate) fn set_config_revision(&self, revision: u64) {
        self.config_revision
            .set(i64::try_from(revision).unwrap_or(i64::MAX));
    }

    /// The revision this instance runs (0: the file's cluster part).
    pub(crate) fn config_revision(&self) -> u64 {
        u64::try_from(self.config_revision.get()).unwrap_or(0)
    }

    /// A revision of the document was refused.
    pub(crate) fn config_refused(&self) {
        self.config_refused.inc();
    }

    /// A conversation ended with `code` (`None` for a response).
    pub(crate) fn request_finished(&self, pool: &str, rule: &str, code: Option<&'static str>) {
        self.requests
            .get_or_create(&RequestLabels {
                pool: pool.to_string(),
                rule: rule.to_string(),
                outcome: if code.is_some() { "error" } else { "response" },
                code: code.unwrap_or("none"),
            })
            .inc();
    }

    /// An HTTP attempt ended with `result` after `duration`.
    pub(crate) fn attempt(&self, pool: &str, rule: &str, result: &'static str, duration: Duration) {
        self.attempts
            .get_or_create(&AttemptLabels {
                pool: pool.to_string(),
                rule: rule.to_string(),
                result,
            })
            .inc();
        self.attempt_duration
            .get_or_create(&RuleLabels {
                pool: pool.to_string(),
                rule: rule.to_string(),
            })
            .observe(duration.as_secs_f64());
    }

    /// A request waited `wait` from its publish to its first attempt.
    pub(crate) fn queue_wait(&self, pool: &str, wait: Duration) {
        self.queue_wait
            .get_or_create(&PoolLabels {
                pool: pool.to_string(),
            })
            .observe(wait.as_secs_f64());
    }

    /// A cancel ended a conversation of `pool` that was `state`.
    pub(crate) fn conversation_cancelled(&self, pool: &str, state: &'static str) {
        self.conversations_cancelled
            .get_or_create(&CancelledLabels {
                pool: pool.to_string(),
                state,
            })
            .inc();
    }

    pub(crate) fn dead_letter(&self, pool: &str, code: &'static str) {
        self.dead_letters
            .get_or_create(&DeadLabels {
                pool: pool.to_string(),
                code,
            })
            .inc();
    }

    pub(crate) fn consumer_recreated(&self, pool: &str) {
        self.consumer_recreations
            .get_or_create(&PoolLabels {
                pool: pool.to_string(),
            })
            .inc();
    }

    /// The Prometheus text exposition, with the gauges read now.
    pub(crate) fn render(&self, gauges: &Gauges, health: &Health) -> String {
        for (pool, gauge) in gauges.all() {
            let labels = PoolLabels { pool };
            let set = |family: &Family<PoolLabels, Gauge>, value: u64| {
                family
                    .get_or_create(&labels)
                    .set(i64::try_from(value).unwrap_or(i64::MAX));
            };
            set(&self.in_flight, gauge.in_flight());
            set(&self.pool_waiting, gauge.waiting());
            set(&self.pool_parked, gauge.parked());
            set(&self.pool_max_in_flight, gauge.max_in_flight());
        }
        self.nats_connected.set(i64::from(health.nats_connected()));
        self.clock_skew
            .set(webproxy_jetstream::clock::skew_seconds().unwrap_or(0.0));
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut text, &self.registry);
        text
    }
}

#[cfg(test)]
mod tests;
