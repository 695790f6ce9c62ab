//! `just bench`: webproxy's cost per conversation, measured in one run on one machine as
//! ratios against two references: the same HTTP calls made directly, and a
//! broker-only loop (JetStream publish → pull consumer → reply stored through
//! JetStream → ack, no HTTP, no rules), which is webproxy's ceiling; and beside it, in
//! the same rounds, the minimal pipeline of the same contract (`webproxy-pipeline`,
//! issue 33), against which [`gates`] holds webproxy's throughput, CPU and RSS. With
//! `--reference NAME=PATH` (`just bench-reference`), other webproxy binaries are measured
//! in the same run, interleaved round by round, and compared by the median of the rounds.
//!
//! Everything runs here: a private nats-server per webproxy binary (so each server's CPU
//! and message counts are that binary's alone) and one for the broker-only loop, an
//! in-process upstream, the release
//! `webproxy serve` as a subprocess, and closed-loop load generators that keep a fixed
//! number of conversations outstanding. Last, a probe restarts the nats-server under
//! load (issue 14's scenario, shared with the liveness test) and reports how soon
//! the last conversation is answered. The HTTP gateway (`webproxy gateway`) gets rows of
//! its own beside the NATS-client path, measured in the same run. Then, apart, the
//! adaptive limit's run (`adaptive.rs`, issue 20's scenario), the progress bucket's
//! bound (`progress_bound.rs`, issue 29) and webproxy's memory with 64 large bodies in
//! flight (`large_bodies.rs`, issue 34). `--only` and `--skip` pick among these four
//! [`Section`]s.

mod adaptive;
mod cost;
mod gates;
mod gateway;
mod large_bodies;
mod load;
mod pipeline;
mod progress_bound;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream;
use clap::Parser;
use serde::Serialize;
use webproxy_client::Client;
use webproxy_testkit::recovery::{Killed, Load, OUTAGE, restart_under_load};
use webproxy_testkit::rules::accept_rule;
use webproxy_testkit::{Gate, NatsServer, Service, ServiceOptions, Upstream, default_routes};

use cost::{Cost, Counters, median};
use gateway::{GatewayFigures, gateway_figures};
use load::{Figures, Replies, broker, broker_echo, closed_loop, direct, proxied};
use pipeline::Pipeline;

#[derive(Debug, Parser)]
#[command(
    about = "Benchmark webproxy against direct calls, a broker-only loop, a minimal pipeline and other builds"
)]
struct Args {
    /// How long each measurement runs.
    #[arg(long, default_value = "6s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The concurrency levels (outstanding conversations).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    levels: Vec<usize>,
    /// Rounds: every level of every binary is measured once a round, the binaries
    /// taking turns in an order that alternates from round to round. Three by default:
    /// issue 33's gates are read from the medians of at least three.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Another webproxy binary to measure beside this build, as NAME=PATH; repeatable.
    #[arg(long = "reference", value_parser = reference)]
    references: Vec<(String, PathBuf)>,
    /// Where the figures are written as JSON (each section apart from the main one
    /// writes a file of its own beside it).
    #[arg(long, default_value = "target/bench/latest.json")]
    json: PathBuf,
    /// Run only these sections, comma-separated (all by default).
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Section>,
    /// Leave these sections out, comma-separated.
    #[arg(long, value_enum, value_delimiter = ',')]
    skip: Vec<Section>,
}

/// The parts of the bench, each with servers and instances of its own; their times are
/// on the 2-core development machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Section {
    /// The levels, the references, the probes, the rates and the gateway: about 3
    /// minutes a round with the default levels and duration.
    Main,
    /// Issue 20's adaptive limit, three instances for 2 × 60 s: about 2 minutes.
    Adaptive,
    /// Issue 29's progress bucket after 10k parked-and-settled conversations and again
    /// a minute later: about 80 s, the run (8 s) and a 70 s wait.
    ProgressBound,
    /// Issue 34's memory bound: 64 bodies of 50 MiB stored at once, webproxy's RSS
    /// sampled throughout; fails the bench over 200 MiB. About 10 s (8 to 17 s).
    LargeBodies,
}

/// Whether `section` runs: among `only` when that names any, and not among `skip`.
fn runs(section: Section, only: &[Section], skip: &[Section]) -> bool {
    (only.is_empty() || only.contains(&section)) && !skip.contains(&section)
}

fn reference(arg: &str) -> Result<(String, PathBuf), String> {
    match arg.split_once('=') {
        // Absolute: the service runs in a directory of its own.
        Some((name, path)) if !name.is_empty() && !path.is_empty() => std::path::absolute(path)
            .map(|path| (name.to_string(), path))
            .map_err(|e| format!("{path}: {e}")),
        _ => Err(format!("{arg:?} is not NAME=PATH")),
    }
}

/// This build's name in the tables.
const CURRENT: &str = "webproxy";

/// A bench nats-server's extra configuration: a monitoring port, for `/varz`.
const MONITORED: &str = "http: \"127.0.0.1:-1\"";

/// The minimal pipeline's name in the tables.
const PIPELINE: &str = "pipeline";

/// What serves a candidate's conversations.
enum Server {
    Webproxy(Service),
    Pipeline(Pipeline),
}

/// How to start a candidate's server.
enum Launch {
    /// `webproxy serve`: this build's, or the binary at the path.
    Webproxy(Option<PathBuf>),
    Pipeline,
}

impl Server {
    fn pid(&self) -> u32 {
        match self {
            Server::Webproxy(service) => service.pid(),
            Server::Pipeline(pipeline) => pipeline.pid(),
        }
    }
}

/// One server under test (a webproxy binary or the minimal pipeline), with a
/// nats-server of its own.
struct Candidate {
    name: String,
    nats: NatsServer,
    monitoring: String,
    server: Server,
    client: Client,
    replies: Replies,
}

impl Candidate {
    async fn start(name: &str, launch: Launch, config: &str) -> anyhow::Result<Self> {
        let nats = NatsServer::start_with(MONITORED);
        let monitoring = nats
            .monitoring_url()
            .context("the bench's nats-server reports no monitoring port")?;
        let server = match launch {
            Launch::Webproxy(binary) => {
                let mut options = ServiceOptions::default();
                if let Some(binary) = binary {
                    options = options.binary(binary);
                }
                Server::Webproxy(Service::start_with(&nats.url(), config, options).await)
            }
            Launch::Pipeline => Server::Pipeline(Pipeline::start(&nats.url()).await?),
        };
        let nats_client = nats.client().await;
        let client = Client::new(nats_client.clone(), "webproxy")?;
        // The live copies only: the stored ones, on webproxy.reply.<id>.<STREAM>.<seq>,
        // would arrive a second time.
        let replies = Replies::subscribe(
            &nats_client,
            "webproxy.reply.*".into(),
            "webproxy.reply.".len(),
        )
        .await?;
        Ok(Candidate {
            name: name.to_string(),
            nats,
            monitoring,
            server,
            client,
            replies,
        })
    }

    /// The webproxy service, for the measurements only it takes part in.
    fn service(&self) -> anyhow::Result<&Service> {
        match &self.server {
            Server::Webproxy(service) => Ok(service),
            Server::Pipeline(_) => anyhow::bail!("{} is not a webproxy service", self.name),
        }
    }

    fn nats_pid(&self) -> anyhow::Result<u32> {
        self.nats
            .pid()
            .context("the bench's nats-server is not running")
    }

    /// `concurrency` conversations on `pool` for `url`, kept outstanding for `duration`,
    /// with what they cost.
    async fn measure(
        &self,
        http: &reqwest::Client,
        concurrency: usize,
        duration: Duration,
        pool: &'static str,
        url: &Arc<str>,
    ) -> anyhow::Result<Sample> {
        let pid = self.nats_pid()?;
        // `just profile` starts recording when it reads this, the server too.
        eprintln!(
            "measuring {} at {concurrency} on pool {pool} (nats-server {pid})",
            self.name
        );
        let service = Some(self.server.pid());
        let before = Counters::read(http, service, pid, &self.monitoring).await?;
        let figures = closed_loop(concurrency, duration, {
            let (client, replies, url) = (self.client.clone(), self.replies.clone(), url.clone());
            move || proxied(client.clone(), replies.clone(), pool, url.clone())
        })
        .await;
        let after = Counters::read(http, service, pid, &self.monitoring).await?;
        let cost = before.per_conversation(&after, figures.requests);
        Ok(Sample { figures, cost })
    }
}

/// One measurement and what its conversations cost.
#[derive(Debug, Clone, Serialize)]
struct Sample {
    figures: Figures,
    cost: Cost,
}

/// One round of one binary.
#[derive(Debug, Default, Serialize)]
pub(crate) struct Round {
    /// By concurrency level, in the order of `--levels`.
    levels: Vec<Sample>,
    slot: Option<Sample>,
    /// VmHWM of its `webproxy serve` after the concurrency-256 run, in MiB.
    peak_rss_mib: f64,
}

/// A binary's figures: every round, and the median of each figure across them.
#[derive(Debug, Serialize)]
pub(crate) struct Measured {
    pub(crate) name: String,
    pub(crate) rounds: Vec<Round>,
    pub(crate) medians: Vec<LevelMedian>,
    /// Through a pool of one slot with 8 outstanding, ÷ direct req/s at concurrency 1,
    /// against an upstream that holds each request 10 ms (the median of the rounds).
    pub(crate) slot_utilization: f64,
    pub(crate) peak_rss_mib: f64,
}

#[derive(Debug, Clone, Copy, Serialize)]
pub(crate) struct LevelMedian {
    pub(crate) concurrency: usize,
    pub(crate) rps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) cost: Cost,
}

impl Measured {
    fn summarize(name: String, rounds: Vec<Round>, levels: &[usize], slot_direct: &[f64]) -> Self {
        let medians = levels
            .iter()
            .enumerate()
            .map(|(i, &concurrency)| {
                let of = |f: fn(&Sample) -> f64| {
                    median(
                        rounds
                            .iter()
                            .filter_map(|r| r.levels.get(i))
                            .map(f)
                            .collect(),
                    )
                };
                LevelMedian {
                    concurrency,
                    rps: of(|s| s.figures.rps),
                    p50_ms: of(|s| s.figures.p50_ms),
                    cost: Cost {
                        service_cpu_us: of(|s| s.cost.service_cpu_us),
                        nats_cpu_us: of(|s| s.cost.nats_cpu_us),
                        msgs_in: of(|s| s.cost.msgs_in),
                        msgs_out: of(|s| s.cost.msgs_out),
                    },
                }
            })
            .collect();
        let slot_utilization = median(
            rounds
                .iter()
                .zip(slot_direct)
                .filter_map(|(round, direct)| Some(round.slot.as_ref()?.figures.rps / direct))
                .collect(),
        );
        let peak_rss_mib = rounds.iter().map(|r| r.peak_rss_mib).fold(0.0, f64::max);
        Measured {
            name,
            rounds,
            medians,
            slot_utilization,
            peak_rss_mib,
        }
    }
}

/// The references of a round, measured once a round beside the binaries.
#[derive(Debug, Default, Serialize)]
struct Baselines {
    direct: Vec<Figures>,
    /// With the broker's nats-server cost (no service: its CPU is the bench's own).
    broker: Vec<Sample>,
    slot_direct: Option<Figures>,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: String,
    duration_s: f64,
    levels: Vec<usize>,
    baselines: Vec<Baselines>,
    /// This build first, the minimal pipeline second, then the references.
    binaries: Vec<Measured>,
    /// From the nats-server's return after a 3 s outage until the last of 100
    /// conversations (pool of 16, upstream 50 ms) was answered, in seconds.
    nats_restart_recovery_s: f64,
    /// Conversations of that probe that got no 200 answer.
    nats_restart_failed: usize,
    /// Pools with a cluster-wide rate limit, under demand above it.
    rates: Vec<RateFigures>,
    /// The HTTP gateway beside the NATS-client path (issue 21).
    gateway: Vec<GatewayFigures>,
    /// webproxy against the minimal pipeline (issue 33).
    gates: Vec<gates::Gate>,
    /// The pipeline's req/s at 256 outstanding ÷ the broker-only loop's.
    pipeline_vs_broker: Option<f64>,
}

/// A rate-limited pool under 64 outstanding conversations for the run's duration.
#[derive(Debug, Serialize)]
struct RateFigures {
    rate_per_s: u32,
    /// Attempts per second achieved, ÷ the rate.
    achieved: f64,
    /// NATS requests made to claim slots of the schedule (reads and compare-and-set
    /// writes) per attempt.
    nats_requests_per_attempt: f64,
}

/// The rates the bench measures: per second, the pool, and the upstream status (a
/// path of its own, `/status/<status>`, which the pool's rule sends there).
const RATES: [(u32, &str, u16); 2] = [(20, "rate20", 221), (200, "rate200", 222)];

/// Runs `rate`'s pool under 64 outstanding conversations for `duration` and reads the
/// service's own counters of attempts and schedule requests.
async fn rate_figures(
    service: &Service,
    client: &Client,
    replies: &Replies,
    upstream: &Upstream,
    (rate, pool, status): (u32, &'static str, u16),
    duration: Duration,
) -> RateFigures {
    let url: Arc<str> = Arc::from(upstream.url(&format!("/status/{status}")));
    let figures = closed_loop(64, duration, {
        let (client, replies, url) = (client.clone(), replies.clone(), url.clone());
        move || proxied(client.clone(), replies.clone(), pool, url.clone())
    })
    .await;
    let attempts = service
        .metric(&format!(
            "webproxy_attempts_total{{pool=\"{pool}\",rule=\"{pool}\",result=\"2xx\"}}"
        ))
        .await
        .unwrap_or(0.0);
    let requests = service
        .metric(&format!(
            "webproxy_rate_schedule_requests_total{{pool=\"{pool}\"}}"
        ))
        .await
        .unwrap_or(0.0);
    RateFigures {
        rate_per_s: rate,
        achieved: figures.rps / f64::from(rate),
        nats_requests_per_attempt: if attempts > 0.0 {
            requests / attempts
        } else {
            0.0
        },
    }
}

fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    format!("{cores} cores, {model}")
}

fn header() {
    println!(
        "{:<10} {:>5} {:>9} {:>7} {:>7} {:>7} {:>7} {:>6} {:>8} {:>8} {:>7} {:>7}",
        "mode",
        "conc",
        "req/s",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "max ms",
        "errors",
        "svc µs",
        "nats µs",
        "msg in",
        "msg out"
    );
}

/// One table row; the cost columns are per completed conversation.
pub(crate) fn row(mode: &str, concurrency: usize, f: &Figures, cost: Option<&Cost>) {
    let cost = cost.map_or_else(String::new, |c| {
        format!(
            " {:>8.1} {:>8.1} {:>7.2} {:>7.2}",
            c.service_cpu_us, c.nats_cpu_us, c.msgs_in, c.msgs_out
        )
    });
    println!(
        "{mode:<10} {concurrency:>5} {:>9.0} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>6}{cost}",
        f.rps, f.p50_ms, f.p90_ms, f.p99_ms, f.max_ms, f.errors
    );
}

fn config(upstream: &Upstream) -> String {
    let rated: String = RATES
        .iter()
        .map(|(rate, pool, status)| {
            format!(
                "[pools.{pool}]\nmax_in_flight = 64\nrate = \"{rate}/s\"\n\n\
                 [[request_rules]]\nname = \"{pool}\"\nurl_pattern = '/status/{status}$'\npool = \"{pool}\"\n\n"
            )
        })
        .collect();
    // Logged as deployed (JSON, one line per finished conversation at info): what the
    // log line costs is part of what a conversation costs.
    format!(
        "[log]\nlevel = \"info\"\nformat = \"json\"\n\n[pools.default]\nmax_in_flight = 512\n\n[pools.slot]\nmax_in_flight = 1\n\n\
         [pools.recovery]\nmax_in_flight = 16\n\n\
         [[request_rules]]\nname = \"slot\"\nurl_pattern = '/delay/'\npool = \"slot\"\n\n\
         [[request_rules]]\nname = \"recovery\"\nurl_pattern = '/gated/'\npool = \"recovery\"\n\n{rated}{}",
        accept_rule("local", upstream)
    )
}

/// The ratios of this build's medians to a reference's.
fn compare(current: &Measured, reference: &Measured) {
    println!();
    println!(
        "{} ÷ {} (medians of the rounds; req/s above 1 and costs below 1 are better)",
        current.name, reference.name
    );
    println!(
        "{:>5} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8}",
        "conc", "req/s", "p50", "svc cpu", "nats cpu", "msg in", "msg out"
    );
    for (mine, theirs) in current.medians.iter().zip(&reference.medians) {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { f64::NAN };
        println!(
            "{:>5} {:>8.2} {:>8.2} {:>9.2} {:>9.2} {:>8.2} {:>8.2}",
            mine.concurrency,
            ratio(mine.rps, theirs.rps),
            ratio(mine.p50_ms, theirs.p50_ms),
            ratio(mine.cost.service_cpu_us, theirs.cost.service_cpu_us),
            ratio(mine.cost.nats_cpu_us, theirs.cost.nats_cpu_us),
            ratio(mine.cost.msgs_in, theirs.cost.msgs_in),
            ratio(mine.cost.msgs_out, theirs.cost.msgs_out),
        );
    }
    println!(
        "slot utilization: {:.3} vs {:.3}; peak RSS after 256 outstanding: {:.1} vs {:.1} MiB",
        current.slot_utilization,
        reference.slot_utilization,
        current.peak_rss_mib,
        reference.peak_rss_mib
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(dir) = args.json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    if runs(Section::Main, &args.only, &args.skip) {
        main_section(&args).await?;
    }
    // Each has its own servers and instances: sections apart from everything above.
    if runs(Section::Adaptive, &args.only, &args.skip) {
        adaptive::report(&args.json).await?;
    }
    if runs(Section::ProgressBound, &args.only, &args.skip) {
        progress_bound::report(&args.json).await?;
    }
    // Last: it is the one section that fails the bench on its bound, and it should not
    // keep the others from running.
    if runs(Section::LargeBodies, &args.only, &args.skip) {
        large_bodies::report(&args.json).await?;
    }
    Ok(())
}

/// Writes a section's `figures` to `<name>.json` in the directory of `json` (the main
/// figures' file) and says where.
pub(crate) fn write_beside(
    json: &Path,
    name: &str,
    figures: &impl Serialize,
) -> anyhow::Result<()> {
    let path = json.with_file_name(format!("{name}.json"));
    std::fs::write(&path, serde_json::to_string_pretty(figures)?)
        .with_context(|| format!("cannot write {}", path.display()))?;
    println!("{name} figures written to {}", path.display());
    Ok(())
}

/// The main section: every level of every binary, the probes, the rates and the
/// gateway, written to `args.json`.
async fn main_section(args: &Args) -> anyhow::Result<()> {
    let gate = Gate::new();
    let upstream = Upstream::start_with(default_routes().merge(gate.routes())).await;
    let config = config(&upstream);
    let mut candidates = vec![
        Candidate::start(CURRENT, Launch::Webproxy(None), &config).await?,
        Candidate::start(PIPELINE, Launch::Pipeline, &config)
            .await
            .context("cannot start the minimal pipeline")?,
    ];
    for (name, binary) in &args.references {
        let candidate = Candidate::start(name, Launch::Webproxy(Some(binary.clone())), &config)
            .await
            .with_context(|| format!("cannot start the reference {name}"))?;
        candidates.push(candidate);
    }
    // The broker-only loop has a server of its own: its streams' messages and
    // duplicate-window ids would otherwise weigh on one binary's server alone.
    let broker_nats = NatsServer::start_with(MONITORED);
    let broker_monitoring = broker_nats
        .monitoring_url()
        .context("the broker loop's nats-server reports no monitoring port")?;
    let broker_client = broker_nats.client().await;
    let js = jetstream::new(broker_client.clone());
    let broker_replies =
        Replies::subscribe(&broker_client, "bench.reply.>".into(), "bench.reply.".len()).await?;
    broker_echo(js.clone())
        .await
        .context("cannot set up the broker-only loop")?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let echo: Arc<str> = Arc::from(upstream.url("/bytes/64"));
    let delayed: Arc<str> = Arc::from(upstream.url("/delay/10"));
    let direct_op = |url: Arc<str>| {
        let http = http.clone();
        move || direct(http.clone(), url.clone())
    };
    let broker_op = {
        let (js, replies) = (js.clone(), broker_replies.clone());
        move || broker(js.clone(), replies.clone())
    };

    // At the highest level, so that every mode has its connections open before any
    // measurement: otherwise the first run at a new level pays for opening them.
    eprintln!("warming up");
    let warm = args.levels.iter().copied().max().unwrap_or(16);
    for candidate in &candidates {
        candidate
            .measure(&http, warm, Duration::from_secs(2), "default", &echo)
            .await?;
    }
    closed_loop(warm, Duration::from_secs(1), broker_op.clone()).await;
    closed_loop(warm, Duration::from_secs(1), direct_op(echo.clone())).await;

    println!("machine: {}", machine());
    let nats_pid = broker_nats
        .pid()
        .context("the broker loop's nats-server is not running")?;
    let mut rounds: Vec<Vec<Round>> = candidates.iter().map(|_| Vec::new()).collect();
    let mut baselines = Vec::new();
    for round in 0..args.rounds {
        println!();
        println!("round {}/{}", round + 1, args.rounds);
        header();
        // Each binary first in turn, so no binary always runs after the same one.
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        order.rotate_left(round % candidates.len());
        let mut measured: Vec<Round> = candidates.iter().map(|_| Round::default()).collect();
        let mut baseline = Baselines::default();
        for &concurrency in &args.levels {
            let before = Counters::read(&http, None, nats_pid, &broker_monitoring).await?;
            let figures = closed_loop(concurrency, args.duration, broker_op.clone()).await;
            let after = Counters::read(&http, None, nats_pid, &broker_monitoring).await?;
            let cost = before.per_conversation(&after, figures.requests);
            row("broker", concurrency, &figures, Some(&cost));
            baseline.broker.push(Sample { figures, cost });
            let figures = closed_loop(concurrency, args.duration, direct_op(echo.clone())).await;
            row("direct", concurrency, &figures, None);
            baseline.direct.push(figures);
            for &i in &order {
                let candidate = &candidates[i];
                let sample = candidate
                    .measure(&http, concurrency, args.duration, "default", &echo)
                    .await?;
                row(
                    &candidate.name,
                    concurrency,
                    &sample.figures,
                    Some(&sample.cost),
                );
                if concurrency == 256 {
                    measured[i].peak_rss_mib =
                        webproxy_testkit::process::peak_rss(candidate.server.pid()).unwrap_or(0)
                            as f64
                            / (1024.0 * 1024.0);
                }
                measured[i].levels.push(sample);
            }
        }
        let slot_direct = closed_loop(1, args.duration, direct_op(delayed.clone())).await;
        row("direct", 1, &slot_direct, None);
        for &i in &order {
            let sample = candidates[i]
                .measure(&http, 8, args.duration, "slot", &delayed)
                .await?;
            println!(
                "slot utilization of {} (max_in_flight 1, 10 ms upstream, 8 outstanding): {:.3} ({:.1} req/s, {:.1} direct)",
                candidates[i].name,
                sample.figures.rps / slot_direct.rps,
                sample.figures.rps,
                slot_direct.rps
            );
            measured[i].slot = Some(sample);
        }
        baseline.slot_direct = Some(slot_direct);
        baselines.push(baseline);
        for (i, round) in measured.into_iter().enumerate() {
            rounds[i].push(round);
        }
    }

    let slot_direct: Vec<f64> = baselines
        .iter()
        .map(|b| b.slot_direct.as_ref().map_or(0.0, |f| f.rps))
        .collect();
    let binaries: Vec<Measured> = candidates
        .iter()
        .zip(rounds)
        .map(|(c, rounds)| Measured::summarize(c.name.clone(), rounds, &args.levels, &slot_direct))
        .collect();

    let current = &candidates[0];
    let mut rates = Vec::new();
    for measured in RATES {
        rates.push(
            rate_figures(
                current.service()?,
                &current.client,
                &current.replies,
                &upstream,
                measured,
                args.duration,
            )
            .await,
        );
    }
    let proxied_op = {
        let (client, replies, url) = (
            current.client.clone(),
            current.replies.clone(),
            echo.clone(),
        );
        move || proxied(client.clone(), replies.clone(), "default", url.clone())
    };
    let gateway = gateway_figures(
        &current.nats,
        &upstream,
        "/bytes/64",
        proxied_op,
        args.duration,
    )
    .await
    .context("cannot measure the gateway")?;
    // Last, since it takes the server away from everything above.
    let caller = Client::new(current.nats.quick_client().await, "webproxy")?;
    let load = Load {
        pool: "recovery",
        count: 100,
        limit: 16,
        upstream_ms: 50,
        killed: Killed::AtTheGate,
    };
    let nats = &mut candidates[0].nats;
    let recovery = restart_under_load(nats, &caller, &upstream, &gate, load).await;

    println!();
    println!(
        "medians of {} round(s): {:>5} {:>18} {:>14} {:>14}",
        args.rounds, "conc", "req/s vs broker", "p50 vs broker", "p50 vs direct"
    );
    for (i, level) in binaries[0].medians.iter().enumerate() {
        let broker_rps = median(baselines.iter().map(|b| b.broker[i].figures.rps).collect());
        let broker_p50 = median(
            baselines
                .iter()
                .map(|b| b.broker[i].figures.p50_ms)
                .collect(),
        );
        let direct_p50 = median(baselines.iter().map(|b| b.direct[i].p50_ms).collect());
        println!(
            "{:>27} {:>18.2} {:>14.2} {:>14.2}",
            level.concurrency,
            level.rps / broker_rps,
            level.p50_ms / broker_p50,
            level.p50_ms / direct_p50
        );
    }
    println!(
        "slot utilization (max_in_flight 1, 10 ms upstream, 8 outstanding): {:.3}",
        binaries[0].slot_utilization
    );
    println!(
        "peak RSS of webproxy serve after concurrency 256: {:.1} MiB",
        binaries[0].peak_rss_mib
    );
    for reference in &binaries[1..] {
        compare(&binaries[0], reference);
    }
    // The pipeline is the second candidate.
    let gates = gates::gates(&binaries[0], &binaries[1]);
    let high = args.levels.iter().position(|&level| level == gates::HIGH);
    let pipeline_vs_broker = high.and_then(|i| {
        let broker = median(baselines.iter().map(|b| b.broker[i].figures.rps).collect());
        let pipeline = binaries[1].medians.get(i)?.rps;
        (broker > 0.0).then(|| pipeline / broker)
    });
    gates::print(&gates, pipeline_vs_broker);
    println!();
    println!(
        "recovery after NATS restart: {:.2} s (last of 100 conversations answered after a {OUTAGE:?} outage; pool of 16, upstream 50 ms; {} failed)",
        recovery.last_answer.as_secs_f64(),
        recovery.failed.len()
    );
    for rate in &rates {
        println!(
            "rate {}/s (64 outstanding): {:.0}% of the rate achieved, {:.2} NATS requests per attempt for the schedule",
            rate.rate_per_s,
            rate.achieved * 100.0,
            rate.nats_requests_per_attempt
        );
    }
    for level in &gateway {
        println!(
            "gateway at concurrency {}: {:.2} of the NATS client's req/s, p50 {:.2}x ({:.2} ms vs {:.2} ms)",
            level.concurrency,
            level.throughput_vs_proxied,
            level.p50_vs_proxied,
            level.gateway.p50_ms,
            level.proxied.p50_ms
        );
    }
    let report = Report {
        machine: machine(),
        duration_s: args.duration.as_secs_f64(),
        levels: args.levels.clone(),
        baselines,
        binaries,
        nats_restart_recovery_s: recovery.last_answer.as_secs_f64(),
        nats_restart_failed: recovery.failed.len(),
        rates,
        gateway,
        gates,
        pipeline_vs_broker,
    };
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)?)?;
    println!("figures written to {}", args.json.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{Section, runs};

    #[test]
    fn every_section_runs_unless_left_out() {
        assert!(runs(Section::Main, &[], &[]));
        assert!(runs(Section::ProgressBound, &[], &[]));
        assert!(!runs(Section::Adaptive, &[], &[Section::Adaptive]));
        assert!(runs(Section::Main, &[], &[Section::Adaptive]));
    }

    #[test]
    fn only_runs_the_sections_it_names() {
        let only = [Section::ProgressBound];
        assert!(runs(Section::ProgressBound, &only, &[]));
        assert!(!runs(Section::Main, &only, &[]));
        assert!(!runs(Section::Adaptive, &only, &[]));
        // Named in both: left out.
        assert!(!runs(Section::ProgressBound, &only, &only));
    }
}
