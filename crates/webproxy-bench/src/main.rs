//! `just bench`: webproxy's cost per request, measured in one run on one machine as
//! ratios against two references: the same HTTP calls made directly, and a
//! broker-only loop (JetStream publish → pull consumer → reply stored through
//! JetStream → ack, no HTTP, no rules), which is webproxy's ceiling.
//!
//! Everything runs here: a private nats-server, an in-process upstream, the release
//! `webproxy serve` as a subprocess, and closed-loop load generators that keep a fixed
//! number of conversations outstanding. Last, a probe restarts the nats-server under
//! load (issue 14's scenario, shared with the liveness test) and reports how soon
//! the last conversation is answered. Then, apart, the adaptive limit's run
//! (`adaptive.rs`, issue 20's scenario).

mod adaptive;

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer, stream};
use bytes::Bytes;
use clap::Parser;
use futures::StreamExt as _;
use serde::Serialize;
use tokio::sync::oneshot;
use webproxy_client::{Client, Request, new_id};
use webproxy_testkit::recovery::{Load, OUTAGE, restart_under_load};
use webproxy_testkit::rules::accept_rule;
use webproxy_testkit::{Gate, NatsServer, Service, ServiceOptions, Upstream, default_routes};

#[derive(Debug, Parser)]
#[command(about = "Benchmark webproxy against direct calls and a broker-only loop")]
struct Args {
    /// How long each measurement runs.
    #[arg(long, default_value = "6s", value_parser = humantime::parse_duration)]
    duration: Duration,
    /// The concurrency levels (outstanding conversations).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    levels: Vec<usize>,
    /// Where the figures are written as JSON.
    #[arg(long, default_value = "target/bench/latest.json")]
    json: PathBuf,
}

/// One measurement's figures.
#[derive(Debug, Clone, Serialize)]
struct Figures {
    requests: usize,
    errors: usize,
    rps: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    max_ms: f64,
}

impl Figures {
    fn from(mut latencies: Vec<Duration>, errors: usize, elapsed: Duration) -> Figures {
        latencies.sort_unstable();
        let at = |q: f64| {
            if latencies.is_empty() {
                return 0.0;
            }
            let index = ((latencies.len() as f64 - 1.0) * q).round() as usize;
            latencies[index].as_secs_f64() * 1000.0
        };
        Figures {
            requests: latencies.len(),
            errors,
            rps: latencies.len() as f64 / elapsed.as_secs_f64(),
            p50_ms: at(0.50),
            p90_ms: at(0.90),
            p99_ms: at(0.99),
            max_ms: at(1.0),
        }
    }
}

/// Keeps `concurrency` operations outstanding for `duration`; an operation returns
/// whether it succeeded.
async fn closed_loop<F, Fut>(concurrency: usize, duration: Duration, op: F) -> Figures
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = bool> + Send,
{
    let started = Instant::now();
    let deadline = started + duration;
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let op = op.clone();
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                let mut errors = 0;
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    if op().await {
                        latencies.push(t0.elapsed());
                    } else {
                        errors += 1;
                    }
                }
                (latencies, errors)
            })
        })
        .collect();
    let mut latencies = Vec::new();
    let mut errors = 0;
    for worker in workers {
        if let Ok((l, e)) = worker.await {
            latencies.extend(l);
            errors += e;
        }
    }
    Figures::from(latencies, errors, started.elapsed())
}

/// Routes replies from one wildcard subscription, made before any publish, to the
/// conversation waiting for each.
#[derive(Clone, Default)]
struct Replies(Arc<Mutex<HashMap<String, oneshot::Sender<async_nats::Message>>>>);

impl Replies {
    async fn subscribe(
        nats: &async_nats::Client,
        wildcard: String,
        prefix_len: usize,
    ) -> anyhow::Result<Replies> {
        let replies = Replies::default();
        let mut subscription = nats.subscribe(wildcard).await?;
        let routes = replies.clone();
        tokio::spawn(async move {
            while let Some(message) = subscription.next().await {
                let id = message
                    .subject
                    .get(prefix_len..)
                    .unwrap_or_default()
                    .to_string();
                if let Some(waiter) = routes.lock().remove(&id) {
                    let _ = waiter.send(message);
                }
            }
        });
        Ok(replies)
    }

    fn lock(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<String, oneshot::Sender<async_nats::Message>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn expect(&self, id: &str) -> oneshot::Receiver<async_nats::Message> {
        let (tx, rx) = oneshot::channel();
        self.lock().insert(id.to_string(), tx);
        rx
    }
}

const REPLY_WAIT: Duration = Duration::from_secs(30);

/// One proxied conversation: publish with the client, wait for the reply.
async fn proxied(client: Client, replies: Replies, pool: &'static str, url: Arc<str>) -> bool {
    let id = new_id();
    let reply = replies.expect(&id);
    let request = Request::new("GET", url.as_ref()).id(id).pool(pool);
    if client.submit(&request).await.is_err() {
        return false;
    }
    match tokio::time::timeout(REPLY_WAIT, reply).await {
        Ok(Ok(message)) => message
            .headers
            .as_ref()
            .and_then(|h| h.get("Webproxy-Outcome"))
            .is_some_and(|v| v.as_str() == "response"),
        _ => false,
    }
}

async fn direct(http: reqwest::Client, url: Arc<str>) -> bool {
    match http.get(url.as_ref()).send().await {
        Ok(response) => response.status().is_success() && response.bytes().await.is_ok(),
        Err(_) => false,
    }
}

/// The broker-only loop's server side: what webproxy does with NATS, without HTTP.
async fn broker_echo(js: jetstream::Context) -> anyhow::Result<()> {
    js.create_stream(stream::Config {
        name: "BENCH_WORK".into(),
        subjects: vec!["bench.work".into()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await?;
    js.create_stream(stream::Config {
        name: "BENCH_REPLIES".into(),
        subjects: vec!["bench.reply.>".into()],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await?;
    let work: consumer::PullConsumer = js
        .get_stream("BENCH_WORK")
        .await?
        .create_consumer(consumer::pull::Config {
            durable_name: Some("bench".into()),
            max_ack_pending: 512,
            ..Default::default()
        })
        .await?;
    tokio::spawn(async move {
        loop {
            let Ok(mut batch) = work
                .batch()
                .max_messages(256)
                .expires(Duration::from_secs(5))
                .messages()
                .await
            else {
                continue;
            };
            while let Some(Ok(message)) = batch.next().await {
                let js = js.clone();
                tokio::spawn(async move {
                    let id = String::from_utf8_lossy(&message.payload).into_owned();
                    let publish = jetstream::message::PublishMessage::build()
                        .payload(Bytes::from_static(b"{\"outcome\":\"response\"}"))
                        .message_id(format!("{id}:0:reply"));
                    if let Ok(ack) = js.send_publish(format!("bench.reply.{id}"), publish).await
                        && ack.await.is_ok()
                    {
                        let _ = message.ack().await;
                    }
                });
            }
        }
    });
    Ok(())
}

async fn broker(js: jetstream::Context, replies: Replies) -> bool {
    let id = new_id();
    let reply = replies.expect(&id);
    let publish = jetstream::message::PublishMessage::build()
        .payload(Bytes::from(id.clone()))
        .message_id(&id);
    let Ok(ack) = js.send_publish("bench.work", publish).await else {
        return false;
    };
    if ack.await.is_err() {
        return false;
    }
    matches!(tokio::time::timeout(REPLY_WAIT, reply).await, Ok(Ok(_)))
}

/// Peak resident memory of a process, from `/proc/<pid>/status` (VmHWM), in KiB.
fn peak_rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[derive(Debug, Serialize)]
struct Level {
    concurrency: usize,
    proxied: Figures,
    direct: Figures,
    broker: Figures,
    /// proxied req/s ÷ broker-only req/s: how close webproxy gets to its ceiling.
    throughput_vs_broker: f64,
    /// proxied p50 ÷ broker-only p50.
    p50_vs_broker: f64,
    /// proxied p50 ÷ direct p50.
    p50_vs_direct: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    machine: String,
    duration_s: f64,
    levels: Vec<Level>,
    /// webproxy req/s through a pool of one slot with 8 outstanding, ÷ direct req/s at
    /// concurrency 1, against an upstream that holds each request 10 ms.
    slot_utilization: f64,
    slot_proxied: Figures,
    slot_direct: Figures,
    /// `webproxy serve`'s VmHWM after the concurrency-256 run, in MiB.
    peak_rss_mib: f64,
    /// From the nats-server's return after a 3 s outage until the last of 100
    /// conversations (pool of 16, upstream 50 ms) was answered, in seconds.
    nats_restart_recovery_s: f64,
    /// Conversations of that probe that got no 200 answer.
    nats_restart_failed: usize,
    /// Pools with a cluster-wide rate limit, under demand above it.
    rates: Vec<RateFigures>,
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

fn row(mode: &str, concurrency: usize, f: &Figures) {
    println!(
        "{mode:<8} {concurrency:>5} {:>10.0} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>7}",
        f.rps, f.p50_ms, f.p90_ms, f.p99_ms, f.max_ms, f.errors
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut nats = NatsServer::start();
    let gate = Gate::new();
    let upstream = Upstream::start_with(default_routes().merge(gate.routes())).await;
    let rated: String = RATES
        .iter()
        .map(|(rate, pool, status)| {
            format!(
                "[pools.{pool}]\nmax_in_flight = 64\nrate = \"{rate}/s\"\n\n\
                 [[request_rules]]\nname = \"{pool}\"\nurl_pattern = '/status/{status}$'\npool = \"{pool}\"\n\n"
            )
        })
        .collect();
    let config = format!(
        "[log]\nlevel = \"warn\"\n\n[pools.default]\nmax_in_flight = 512\n\n[pools.slot]\nmax_in_flight = 1\n\n\
         [pools.recovery]\nmax_in_flight = 16\n\n\
         [[request_rules]]\nname = \"slot\"\nurl_pattern = '/delay/'\npool = \"slot\"\n\n\
         [[request_rules]]\nname = \"recovery\"\nurl_pattern = '/gated/'\npool = \"recovery\"\n\n{rated}{}",
        accept_rule("local", &upstream)
    );
    // The outcome of every conversation is logged at info; the bench measures the
    // service, not its log volume.
    let service = Service::start_with(
        &nats.url(),
        &config,
        ServiceOptions::default().env("RUST_LOG", "warn"),
    )
    .await;
    let nats_client = nats.client().await;
    let client = Client::new(nats_client.clone(), "webproxy")?;
    let js = jetstream::new(nats_client.clone());
    // The live copies only: the stored ones, on webproxy.reply.<id>.<STREAM>.<seq>,
    // would arrive a second time.
    let replies = Replies::subscribe(
        &nats_client,
        "webproxy.reply.*".into(),
        "webproxy.reply.".len(),
    )
    .await?;
    let broker_replies =
        Replies::subscribe(&nats_client, "bench.reply.>".into(), "bench.reply.".len()).await?;
    broker_echo(js.clone())
        .await
        .context("cannot set up the broker-only loop")?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let echo: Arc<str> = Arc::from(upstream.url("/bytes/64"));

    let proxied_op = {
        let (client, replies, url) = (client.clone(), replies.clone(), echo.clone());
        move || proxied(client.clone(), replies.clone(), "default", url.clone())
    };
    let direct_op = {
        let (http, url) = (http.clone(), echo.clone());
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
    closed_loop(warm, Duration::from_secs(2), proxied_op.clone()).await;
    closed_loop(warm, Duration::from_secs(1), broker_op.clone()).await;
    closed_loop(warm, Duration::from_secs(1), direct_op.clone()).await;

    println!("machine: {}", machine());
    println!(
        "{:<8} {:>5} {:>10} {:>8} {:>8} {:>8} {:>8} {:>7}",
        "mode", "conc", "req/s", "p50 ms", "p90 ms", "p99 ms", "max ms", "errors"
    );
    let mut levels = Vec::new();
    let mut peak_rss_mib = 0.0;
    for &concurrency in &args.levels {
        let broker = closed_loop(concurrency, args.duration, broker_op.clone()).await;
        let direct = closed_loop(concurrency, args.duration, direct_op.clone()).await;
        let proxied = closed_loop(concurrency, args.duration, proxied_op.clone()).await;
        if concurrency == 256 {
            peak_rss_mib = peak_rss_kib(service.pid()).unwrap_or(0) as f64 / 1024.0;
        }
        row("broker", concurrency, &broker);
        row("direct", concurrency, &direct);
        row("proxied", concurrency, &proxied);
        levels.push(Level {
            concurrency,
            throughput_vs_broker: proxied.rps / broker.rps,
            p50_vs_broker: proxied.p50_ms / broker.p50_ms,
            p50_vs_direct: proxied.p50_ms / direct.p50_ms,
            proxied,
            direct,
            broker,
        });
    }

    let delayed: Arc<str> = Arc::from(upstream.url("/delay/10"));
    let slot_direct = closed_loop(1, args.duration, {
        let (http, url) = (http.clone(), delayed.clone());
        move || direct(http.clone(), url.clone())
    })
    .await;
    let slot_proxied = closed_loop(8, args.duration, {
        let (client, replies, url) = (client.clone(), replies.clone(), delayed.clone());
        move || proxied(client.clone(), replies.clone(), "slot", url.clone())
    })
    .await;

    let mut rates = Vec::new();
    for measured in RATES {
        rates.push(
            rate_figures(
                &service,
                &client,
                &replies,
                &upstream,
                measured,
                args.duration,
            )
            .await,
        );
    }

    // Last, since it takes the server away from everything above.
    let caller = Client::new(nats.quick_client().await, "webproxy")?;
    let load = Load {
        pool: "recovery",
        count: 100,
        limit: 16,
        upstream_ms: 50,
    };
    let recovery = restart_under_load(&mut nats, &caller, &upstream, &gate, load).await;
    let report = Report {
        machine: machine(),
        duration_s: args.duration.as_secs_f64(),
        slot_utilization: slot_proxied.rps / slot_direct.rps,
        slot_proxied,
        slot_direct,
        peak_rss_mib,
        nats_restart_recovery_s: recovery.last_answer.as_secs_f64(),
        nats_restart_failed: recovery.failed.len(),
        levels,
        rates,
    };

    println!();
    println!(
        "{:>5} {:>18} {:>14} {:>14}",
        "conc", "req/s vs broker", "p50 vs broker", "p50 vs direct"
    );
    for level in &report.levels {
        println!(
            "{:>5} {:>18.2} {:>14.2} {:>14.2}",
            level.concurrency, level.throughput_vs_broker, level.p50_vs_broker, level.p50_vs_direct
        );
    }
    println!(
        "slot utilization (max_in_flight 1, 10 ms upstream, 8 outstanding): {:.3} ({:.1} req/s proxied, {:.1} direct)",
        report.slot_utilization, report.slot_proxied.rps, report.slot_direct.rps
    );
    println!(
        "peak RSS of webproxy serve after concurrency 256: {:.1} MiB",
        report.peak_rss_mib
    );
    println!(
        "recovery after NATS restart: {:.2} s (last of 100 conversations answered after a {OUTAGE:?} outage; pool of 16, upstream 50 ms; {} failed)",
        report.nats_restart_recovery_s, report.nats_restart_failed
    );
    for rate in &report.rates {
        println!(
            "rate {}/s (64 outstanding): {:.0}% of the rate achieved, {:.2} NATS requests per attempt for the schedule",
            rate.rate_per_s,
            rate.achieved * 100.0,
            rate.nats_requests_per_attempt
        );
    }
    if let Some(dir) = args.json.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)?)?;
    println!("figures written to {}", args.json.display());
    // Its own servers and instances: a section apart from everything above.
    adaptive::report(&args.json).await?;
    Ok(())
}
