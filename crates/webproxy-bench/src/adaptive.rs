//! The bench's adaptive-concurrency section (issue 20): issue 20's scenario
//! (`webproxy_testkit::adaptive`) against three release instances on a private
//! nats-server of its own, so it shares nothing with the main measurement. It prints
//! where the limit settled with the upstream's knee at 8 and where it went after the
//! knee moved to 32, and writes the figures to `adaptive.json` beside the main ones.

use std::path::Path;
use std::time::Duration;

use serde::Serialize;
use webproxy_client::Client;
use webproxy_testkit::adaptive::{self, KNEE, KneeUpstream, median};
use webproxy_testkit::{NatsServer, Service, ServiceOptions};

use crate::write_beside;

/// How long each half of the run lasts: the test's 60 s.
const HALF: Duration = Duration::from_secs(60);

/// Conversations outstanding: enough to keep 64 slots busy.
const CALLERS: usize = 96;

#[derive(Debug, Serialize)]
struct Figures {
    /// Each half's length, in seconds.
    half_s: f64,
    /// The effective limit over the last 20 s with the knee at 8.
    settled_min: u64,
    settled_median: u64,
    settled_max: u64,
    /// The effective limit's median over the half after the knee moved to 32.
    moved_median: u64,
    /// Calls per second the upstream answered in each half.
    calls_per_s_knee_8: f64,
    calls_per_s_knee_32: f64,
    /// Every sample, once a second: (seconds since the half began, limit).
    samples_knee_8: Vec<(f64, u64)>,
    samples_knee_32: Vec<(f64, u64)>,
}

/// Runs the scenario, prints its figures and writes them to `adaptive.json` in the
/// directory of `json` (the main figures' file).
pub(crate) async fn report(json: &Path) -> anyhow::Result<()> {
    eprintln!("adaptive concurrency: 2 × {HALF:?} with three instances");
    let nats = NatsServer::start();
    let upstream = KneeUpstream::start(KNEE).await;
    let config = format!("[log]\nlevel = \"warn\"\n\n{}", adaptive::config(&upstream));
    let mut services = Vec::new();
    for _ in 0..3 {
        services.push(
            Service::start_with(
                &nats.url(),
                &config,
                ServiceOptions::default().env("RUST_LOG", "warn"),
            )
            .await,
        );
    }
    let client = Client::new(nats.client().await, "webproxy")?;
    let run = adaptive::run(&services, &client, &upstream, CALLERS, HALF).await;
    let settled = run.settled();
    let figures = Figures {
        half_s: HALF.as_secs_f64(),
        settled_min: settled.iter().copied().min().unwrap_or(0),
        settled_median: median(&settled),
        settled_max: settled.iter().copied().max().unwrap_or(0),
        moved_median: median(&run.after_move()),
        calls_per_s_knee_8: run.calls_per_s.0,
        calls_per_s_knee_32: run.calls_per_s.1,
        samples_knee_8: run.first.clone(),
        samples_knee_32: run.moved.clone(),
    };
    println!(
        "adaptive limit (max_in_flight 64, 3 instances, {CALLERS} outstanding): knee 8, last 20 s of {:?}: {}..{} (median {}), {:.0} calls/s; knee 32, next {:?}: median {}, {:.0} calls/s",
        HALF,
        figures.settled_min,
        figures.settled_max,
        figures.settled_median,
        figures.calls_per_s_knee_8,
        HALF,
        figures.moved_median,
        figures.calls_per_s_knee_32
    );
    write_beside(json, "adaptive", &figures)
}
