//! Issue 20's adaptive-concurrency scenario, shared by `tests/adaptive.rs` and `just
//! bench`: an upstream whose latency grows as (in flight / knee)² × 10 ms above its
//! knee, closed-loop callers keeping a pool of `max_in_flight = 64` with `adaptive =
//! true` busy, and the pool's effective limit sampled once a second, first with the
//! knee at 8, then for as long again after it moves to 32.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::get;
use webproxy_client::{Client, Request};

use crate::{Service, Upstream, default_routes, rules::origin_rule};

/// The scenario's pool.
pub const POOL: &str = "adaptive";

/// The knee the run starts with, and the one it moves to.
pub const KNEE: u64 = 8;
pub const MOVED_KNEE: u64 = 32;

/// The upstream: `/knee` takes 10 ms up to `knee` calls in flight, (in flight /
/// knee)² × 10 ms above.
pub struct KneeUpstream {
    pub upstream: Upstream,
    knee: Arc<AtomicU64>,
}

impl KneeUpstream {
    pub async fn start(knee: u64) -> KneeUpstream {
        let knee = Arc::new(AtomicU64::new(knee));
        let in_flight = Arc::new(AtomicU64::new(0));
        let router = Router::new().route(
            "/knee",
            get({
                let knee = knee.clone();
                move || {
                    let (knee, in_flight) = (knee.clone(), in_flight.clone());
                    async move {
                        let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                        let ratio = (now as f64 / knee.load(Ordering::SeqCst) as f64).max(1.0);
                        tokio::time::sleep(Duration::from_secs_f64(ratio * ratio * 0.010)).await;
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        "ok"
                    }
                }
            }),
        );
        KneeUpstream {
            upstream: Upstream::start_with(default_routes().merge(router)).await,
            knee,
        }
    }

    pub fn set_knee(&self, knee: u64) {
        self.knee.store(knee, Ordering::SeqCst);
    }
}

/// The cluster part for the scenario: the pool and a rule sending `/knee` there, bound
/// to the upstream's origin, as the adaptive limit counts only such rules' attempts.
pub fn config(upstream: &KneeUpstream) -> String {
    format!(
        "[pools.{POOL}]\nmax_in_flight = 64\nadaptive = true\nmin_in_flight = 1\n{}pool = \"{POOL}\"\nmax_retries = 0\n",
        origin_rule("knee", &upstream.upstream, "/knee")
    )
}

/// What a run measured.
#[derive(Debug, Clone)]
pub struct Run {
    /// (seconds since the start, effective limit) once a second with the knee at 8.
    pub first: Vec<(f64, u64)>,
    /// The same, after the knee moved to 32.
    pub moved: Vec<(f64, u64)>,
    /// Calls the upstream answered per second in each half.
    pub calls_per_s: (f64, f64),
    /// The most calls the upstream had in flight at once, over the run.
    pub upstream_max_in_flight: usize,
    /// How long each half ran.
    pub half: Duration,
}

impl Run {
    /// The limits of the last 20 s with the knee at 8: the settled ones.
    pub fn settled(&self) -> Vec<u64> {
        let from = self.half.as_secs_f64() - 20.0;
        self.first
            .iter()
            .filter(|(at, _)| *at >= from)
            .map(|(_, limit)| *limit)
            .collect()
    }

    /// Every limit after the knee moved.
    pub fn after_move(&self) -> Vec<u64> {
        self.moved.iter().map(|(_, limit)| *limit).collect()
    }
}

/// The median of `values` (the upper one of an even count); 0 for none.
pub fn median(values: &[u64]) -> u64 {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    sorted.get(sorted.len() / 2).copied().unwrap_or(0)
}

/// `webproxy_pool_effective_limit` as the highest of `services` reports it (each
/// reports the cluster's one limit; one may lag a refresh behind).
async fn effective_limit(services: &[Service]) -> Option<u64> {
    let series = format!("webproxy_pool_effective_limit{{pool=\"{POOL}\"}}");
    let mut limit = None;
    for service in services {
        if let Some(value) = service.metric(&series).await {
            limit = Some(limit.unwrap_or(0).max(value as u64));
        }
    }
    limit
}

/// Samples the effective limit once a second for `half`.
async fn sample(services: &[Service], half: Duration) -> Vec<(f64, u64)> {
    let started = Instant::now();
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    while started.elapsed() < half {
        tick.tick().await;
        if let Some(limit) = effective_limit(services).await {
            samples.push((started.elapsed().as_secs_f64(), limit));
        }
    }
    samples
}

/// Runs the scenario against `services` (serving [`config`]) with `callers`
/// conversations outstanding: `half` with the knee at 8, then `half` at 32.
pub async fn run(
    services: &[Service],
    client: &Client,
    upstream: &KneeUpstream,
    callers: usize,
    half: Duration,
) -> Run {
    upstream.set_knee(KNEE);
    let stop = Arc::new(AtomicBool::new(false));
    let url = upstream.upstream.url("/knee");
    let workers: Vec<_> = (0..callers)
        .map(|_| {
            let (client, url, stop) = (client.clone(), url.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let request = Request::new("GET", url.as_str())
                        .pool(POOL)
                        .wait(Duration::from_secs(60));
                    let _ = client.request(&request).await;
                }
            })
        })
        .collect();
    let first = sample(services, half).await;
    let calls_first = upstream.upstream.hits_for("/knee");
    upstream.set_knee(MOVED_KNEE);
    let moved = sample(services, half).await;
    stop.store(true, Ordering::Relaxed);
    let calls_moved = upstream.upstream.hits_for("/knee") - calls_first;
    for worker in workers {
        worker.abort();
    }
    let per_s = |calls: usize| calls as f64 / half.as_secs_f64();
    Run {
        first,
        moved,
        calls_per_s: (per_s(calls_first), per_s(calls_moved)),
        upstream_max_in_flight: upstream.upstream.max_concurrent(),
        half,
    }
}
