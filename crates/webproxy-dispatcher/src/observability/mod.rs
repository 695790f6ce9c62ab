//! What the service shows of itself without any I/O of its own: the Prometheus
//! metrics and per-pool gauges, the health the probes read, the trace context carried
//! in and out, and the state buckets' use read every few seconds.

pub(crate) mod bucket_use;
pub(crate) mod gauges;
pub(crate) mod health;
pub(crate) mod metrics;
pub(crate) mod trace;
