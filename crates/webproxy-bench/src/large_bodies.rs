//! The bench's large-bodies section (issue 34, point 5): 64 attempts in flight at once,
//! each moving a 50 MiB chunked body from the upstream into the pool's body store, while
//! webproxy's resident memory is sampled every 50 ms. Its peak must stay under 200 MiB:
//! a [`Gate`] which, unlike issue 33's, fails the bench when not met, since it is a bound
//! the service promises rather than a ratio still being worked towards. Its own
//! nats-server (whose temp dir takes the 3.2 GiB of stored bodies with it) and release
//! `webproxy serve`; the figures go to `large_bodies.json` beside the main ones. The
//! 3.2 GiB move in 8 to 17 s on the 2-core development machine, depending on what
//! else runs.

use std::future::Future;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;
use tokio::time::MissedTickBehavior;
use webproxy_client::{Client, Request};
use webproxy_protocol::Reply;
use webproxy_testkit::rules::path_rule;
use webproxy_testkit::{NatsServer, Service, ServiceOptions, Upstream, large_routes, process};

use crate::gates::{Bound, Gate, print_gate};
use crate::write_beside;

const MIB: u64 = 1024 * 1024;

/// Attempts in flight at once: the 64.
const ATTEMPTS: usize = 64;

/// Each body: the 50 MiB, above the inline limit, so all of it is stored.
const BODY_BYTES: u64 = 50 * MIB;

/// `[outbound] max_large_body`: the default (64 MiB), stated so that a smaller default
/// would not turn the bench's bodies away.
const MAX_LARGE_BODY: u64 = 64 * MIB;

/// `[streams] body_max_bytes`: the 64 bodies (3.2 GiB) and the chunks' and metadata's
/// overhead, with room to spare; the default 1 GiB would refuse the 21st body.
const STORE_BYTES: u64 = 4096 * MIB;

/// The bound on webproxy's resident memory.
const BOUND_MIB: f64 = 200.0;

/// How often the resident memory is read while the bodies move.
const SAMPLE_EVERY: Duration = Duration::from_millis(50);

/// Every how many samples the pool's `webproxy_in_flight` is scraped too: less often,
/// since a scrape is work of the service's own.
const SCRAPE_EVERY: usize = 10;

/// The rule's attempt timeout and each caller's wait: far above the run's length, so a
/// slow machine is measured rather than timed out.
const WAIT: Duration = Duration::from_secs(600);

const POOL: &str = "large";

#[derive(Debug, Serialize)]
struct Figures {
    attempts: usize,
    body_bytes: u64,
    /// Replies naming a stored body (`body_object`) of `body_bytes`.
    stored: usize,
    /// What the other attempts got instead.
    failures: Vec<String>,
    /// From the first publish to the last reply, in seconds.
    wall_s: f64,
    /// webproxy's resident memory before the first publish, in MiB.
    idle_rss_mib: f64,
    /// Its peak resident memory over its whole life (`VmHWM`) after the last reply, in
    /// MiB, which no sample can miss.
    hwm_rss_mib: f64,
    /// The largest of the samples, in MiB.
    max_sampled_rss_mib: f64,
    /// The larger of the two, what the gate reads: the kernel updates `VmHWM` from
    /// per-thread counters it folds in now and then, so a sample of `VmRSS` can exceed
    /// it by a little (by 0.2 MiB in a run).
    peak_rss_mib: f64,
    /// The most attempts the pool had in flight at once (`webproxy_in_flight`, scraped
    /// every [`SCRAPE_EVERY`] samples): [`ATTEMPTS`] when all were in flight together.
    max_in_flight: f64,
    /// Every sample: (seconds since the first publish, MiB).
    samples: Vec<(f64, f64)>,
    gate: Gate,
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// What was read of the service while the bodies moved.
struct Sampled {
    /// (seconds since the start, resident bytes).
    rss: Vec<(f64, u64)>,
    max_in_flight: f64,
}

/// Runs `work` while reading `service`'s resident memory every [`SAMPLE_EVERY`] (and
/// its pool's attempts in flight every [`SCRAPE_EVERY`] samples); returns its output
/// with what was read.
async fn sampling<F: Future>(service: &Service, work: F) -> (F::Output, Sampled) {
    let started = Instant::now();
    let in_flight = format!("webproxy_in_flight{{pool=\"{POOL}\"}}");
    let mut sampled = Sampled {
        rss: Vec::new(),
        max_in_flight: 0.0,
    };
    let mut tick = tokio::time::interval(SAMPLE_EVERY);
    // A late tick (a busy machine) is not made up with a burst of readings.
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut work = std::pin::pin!(work);
    loop {
        tokio::select! {
            output = &mut work => return (output, sampled),
            _ = tick.tick() => {
                if let Some(rss) = process::rss(service.pid()) {
                    sampled.rss.push((started.elapsed().as_secs_f64(), rss));
                }
                if sampled.rss.len() % SCRAPE_EVERY == 1
                    && let Some(now) = service.metric(&in_flight).await
                {
                    sampled.max_in_flight = sampled.max_in_flight.max(now);
                }
            }
        }
    }
}

/// One large-body conversation for `url`: the size of the body its reply names, or
/// what it got instead.
async fn stored_size(client: Client, url: String) -> Result<u64, String> {
    let request = Request::new("GET", url)
        .pool(POOL)
        .large_body()
        .map_err(|e| format!("no message id: {e}"))?
        .wait(WAIT);
    let answer = client
        .request_answer(&request)
        .await
        .map_err(|e| format!("no reply: {e}"))?;
    match answer.reply {
        Reply {
            body_object: Some(object),
            ..
        } => Ok(object.size),
        Reply {
            error: Some(error), ..
        } => Err(format!("{}: {}", error.code, error.message)),
        Reply { status, .. } => Err(format!(
            "status {} without a stored body",
            status.unwrap_or(0)
        )),
    }
}

/// Runs the section, prints its figures and its gate and writes them to
/// `large_bodies.json` in the directory of `json` (the main figures' file). Fails when
/// a body was not stored whole or the gate is not met.
pub(crate) async fn report(json: &Path) -> anyhow::Result<()> {
    eprintln!(
        "large bodies: {ATTEMPTS} attempts of {} MiB each at once",
        BODY_BYTES / MIB
    );
    let nats = NatsServer::start();
    let upstream = Upstream::start_with(large_routes()).await;
    let config = format!(
        "[log]\nlevel = \"warn\"\n\n[streams]\nbody_max_bytes = {STORE_BYTES}\n\n\
         [outbound]\nmax_large_body = {MAX_LARGE_BODY}\n\n\
         [pools.{POOL}]\nmax_in_flight = {ATTEMPTS}\n\n{}pool = \"{POOL}\"\ntimeout = \"{}s\"\n",
        path_rule("large", &upstream, "/large/"),
        WAIT.as_secs()
    );
    let service = Service::start_with(
        &nats.url(),
        &config,
        ServiceOptions::default().env("RUST_LOG", "warn"),
    )
    .await;
    let client = Client::new(nats.client().await, "webproxy")?;
    let pid = service.pid();
    let idle = process::rss(pid).context("webproxy serve is not running")?;

    let url = upstream.url(&format!("/large/{BODY_BYTES}"));
    let started = Instant::now();
    // A task each, so that the bench's side of 64 conversations is not one task's.
    let conversations = futures::future::join_all(
        (0..ATTEMPTS).map(|_| tokio::spawn(stored_size(client.clone(), url.clone()))),
    );
    let (outcomes, sampled) = sampling(&service, conversations).await;
    let samples = sampled.rss;
    let wall = started.elapsed();
    let hwm = process::peak_rss(pid).context("webproxy serve exited during the run")?;

    let mut stored = 0;
    let mut failures = Vec::new();
    for outcome in outcomes {
        match outcome {
            Ok(Ok(size)) if size == BODY_BYTES => stored += 1,
            Ok(Ok(size)) => failures.push(format!("a stored body of {size} bytes")),
            Ok(Err(failure)) => failures.push(failure),
            Err(e) => failures.push(format!("the conversation's task failed: {e}")),
        }
    }
    let max_sampled = samples.iter().map(|&(_, rss)| rss).max().unwrap_or(0);
    let peak = hwm.max(max_sampled);
    let figures = Figures {
        attempts: ATTEMPTS,
        body_bytes: BODY_BYTES,
        stored,
        failures,
        wall_s: wall.as_secs_f64(),
        idle_rss_mib: mib(idle),
        hwm_rss_mib: mib(hwm),
        max_sampled_rss_mib: mib(max_sampled),
        peak_rss_mib: mib(peak),
        max_in_flight: sampled.max_in_flight,
        samples: samples.iter().map(|&(at, rss)| (at, mib(rss))).collect(),
        gate: Gate {
            name: format!(
                "peak RSS (MiB), {ATTEMPTS} × {} MiB bodies",
                BODY_BYTES / MIB
            ),
            value: Some(mib(peak)),
            bound: Bound::AtMost(BOUND_MIB),
        },
    };
    println!();
    println!(
        "large bodies ({} of {ATTEMPTS} × {BODY_BYTES} bytes stored whole, at most {} in flight at once, in {:.1} s): webproxy's RSS {:.1} MiB idle, at most {:.1} MiB in {} samples every {SAMPLE_EVERY:?}, VmHWM {:.1} MiB",
        figures.stored,
        figures.max_in_flight,
        figures.wall_s,
        figures.idle_rss_mib,
        figures.max_sampled_rss_mib,
        figures.samples.len(),
        figures.hwm_rss_mib
    );
    for failure in figures.failures.iter().take(5) {
        println!("  not stored: {failure}");
    }
    print_gate(&figures.gate);
    write_beside(json, "large_bodies", &figures)?;
    anyhow::ensure!(
        figures.stored == ATTEMPTS,
        "large bodies: only {} of {ATTEMPTS} bodies were stored whole",
        figures.stored
    );
    anyhow::ensure!(
        figures.gate.met(),
        "large bodies: webproxy's peak RSS {:.1} MiB is over {BOUND_MIB} MiB",
        figures.peak_rss_mib
    );
    Ok(())
}
