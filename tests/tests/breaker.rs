//! Issue 20: the circuit breaker per pool, cluster-wide, with three instances of the
//! real binary on one nats-server against an upstream that counts its calls: it
//! opens on the cluster's counts, lets one call through per pause while open,
//! recovers when the upstream does with exactly one reply per conversation, and is
//! not opened by errors the caller chose.
//!
//! Time bounds are the (two pause periods for recovery), with the pauses
//! short (2 s, at most 4 s) so the tests stay quick; each test prints what it measured.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use futures::StreamExt as _;
use webproxy_client::Client;
use webproxy_tests::caller::{envelope, origin_rule, to};
use webproxy_tests::pools::{kv_config, pool_json, pools, push_config, seed_config};
use webproxy_tests::{NatsServer, Service, Upstream, closed_port, default_routes, wait_until};

const POOL: &str = "partner";

/// How long a condition the service reports may take to show: generous for a loaded
/// CI machine.
const SEEN: Duration = Duration::from_secs(30);

/// An upstream whose `/flaky` answers 503 until `healthy` is set, then 200.
async fn flaky_upstream(healthy: Arc<AtomicBool>) -> Upstream {
    let router = Router::new().route(
        "/flaky",
        get(move || {
            let healthy = healthy.clone();
            async move {
                if healthy.load(Ordering::SeqCst) {
                    (StatusCode::OK, "ok")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "down")
                }
            }
        }),
    );
    Upstream::start_with(default_routes().merge(router)).await
}

/// The partner pool with `breaker` as its `[pools.partner.breaker]`, and one rule
/// sending every call to `upstream` there with `rule`'s further keys.
fn config(upstream: &Upstream, breaker: &str, rule: &str) -> String {
    pool_config(
        upstream,
        &format!("[pools.{POOL}.breaker]\n{breaker}"),
        rule,
    )
}

/// The partner pool (`max_in_flight = 8`) with `sections` after it, and one rule
/// sending every call to `upstream` there with `rule`'s further keys. The rule names
/// the upstream's origin: the breaker counts only such rules' attempts.
fn pool_config(upstream: &Upstream, sections: &str, rule: &str) -> String {
    format!(
        "[pools.{POOL}]\nmax_in_flight = 8\n{sections}\n{}pool = \"{POOL}\"\n{rule}\n",
        origin_rule("partner", upstream, "/")
    )
}

/// A nats-server and three instances serving [`config`]`(upstream, breaker, rule)`,
/// and a client.
async fn cluster(
    upstream: &Upstream,
    breaker: &str,
    rule: &str,
) -> (NatsServer, Vec<Service>, Client) {
    let nats = NatsServer::start();
    let services = Service::start_many(&nats.url(), &config(upstream, breaker, rule), 3).await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    (nats, services, client)
}

/// One request for `url` to the partner pool, in the background; its reply's status,
/// or its error code.
fn spawn_request(client: &Client, url: &str) -> tokio::task::JoinHandle<Result<u16, String>> {
    let client = client.clone();
    let request = to(POOL, &envelope("GET", url)).wait(Duration::from_secs(120));
    tokio::spawn(async move {
        let reply = client.request(&request).await.expect("reply");
        match reply.error {
            Some(error) => Err(format!("{:?}", error.code)),
            None => Ok(reply.status.unwrap_or(0)),
        }
    })
}

/// Waits for every call in `calls`, each of which must end in one of the error `codes`.
async fn end_in_errors(calls: Vec<tokio::task::JoinHandle<Result<u16, String>>>, codes: &[&str]) {
    for call in calls {
        let ended = call.await.expect("task");
        assert!(
            matches!(&ended, Err(code) if codes.contains(&code.as_str())),
            "{ended:?}, not one of {codes:?}"
        );
    }
}

/// The partner pool's work consumer.
async fn consumer(nats: &NatsServer) -> async_nats::jetstream::consumer::Info {
    webproxy_tests::caller::pool_consumer(nats, POOL).await
}

/// The reason `pools` shows for the breaker's pause, once it shows one.
async fn breaker_reason(nats: &NatsServer) -> String {
    webproxy_tests::wait_for(SEEN, "the breaker to open", || async {
        let listed = pools(nats).await;
        listed
            .lines()
            .find(|line| line.starts_with("partner paused until") && line.contains("(breaker: "))
            .map(|line| line.to_string())
    })
    .await
}

/// `webproxy_breaker_transitions_total{to}` summed over `services`.
async fn transitions(services: &[Service], to: &str) -> f64 {
    let series = format!("webproxy_breaker_transitions_total{{pool=\"{POOL}\",to=\"{to}\"}}");
    let mut sum = 0.0;
    for service in services {
        sum += service.metric(&series).await.unwrap_or(0.0);
    }
    sum
}

/// The attempts of pool [`POOL`] the instances have reported in `WEBPROXY_INSTANCES`
/// (`stats.<pool>.<instance>`: `{"s": [[second, attempts, failures, latency_ms], ...]}`).
async fn reported_attempts(js: &async_nats::jetstream::Context) -> u64 {
    let Ok(bucket) = js.get_key_value("WEBPROXY_INSTANCES").await else {
        return 0;
    };
    let Ok(mut keys) = bucket.keys().await else {
        return 0;
    };
    let mut attempts = 0;
    while let Some(Ok(key)) = keys.next().await {
        if !key.starts_with(&format!("stats.{POOL}.")) {
            continue;
        }
        let Ok(Some(value)) = bucket.get(&key).await else {
            continue;
        };
        let report: serde_json::Value = serde_json::from_slice(&value).unwrap_or_default();
        attempts += report["s"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|second| second[1].as_u64())
            .sum::<u64>();
    }
    attempts
}

/// "F of M attempts failed": (F, M).
fn counts_in(reason: &str) -> (u64, u64) {
    let words: Vec<&str> = reason.split_whitespace().collect();
    let at = words
        .iter()
        .position(|w| *w == "of")
        .expect("an 'of' in the reason");
    let number = |w: &str| {
        w.trim_start_matches("(breaker:")
            .parse::<u64>()
            .unwrap_or_else(|_| panic!("{w:?} in {reason:?}"))
    };
    (number(words[at - 1]), number(words[at + 1]))
}

/// With `min_attempts = 40`, 60 failing calls spread over three instances open the
/// breaker although no instance made 40 of them: the counts are the cluster's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_on_the_clusters_counts_not_an_instances() {
    let upstream = Upstream::start().await;
    let (nats, services, client) = cluster(
        &upstream,
        "min_attempts = 40\nfailure_ratio = 0.5\nwindow = \"2m\"\nopen_for = \"1m\"",
        "max_retries = 0",
    )
    .await;
    let url = upstream.url("/status/503");
    let calls: Vec<_> = (0..60).map(|_| spawn_request(&client, &url)).collect();

    let reason = breaker_reason(&nats).await;
    let (failures, attempts) = counts_in(&reason);
    let series =
        format!("webproxy_attempts_total{{pool=\"{POOL}\",rule=\"partner\",result=\"5xx\"}}");
    let mut each = Vec::new();
    for service in &services {
        each.push(service.metric(&series).await.unwrap_or(0.0) as u64);
    }
    println!("opened: {reason}; attempts per instance {each:?}");
    assert!(attempts >= 40 && failures * 2 >= attempts, "{reason}");
    // Each instance stayed below min_attempts; only the cluster reached it.
    assert!(each.iter().all(|n| *n < 40), "{each:?}");
    assert!(each.iter().filter(|n| **n > 0).count() >= 2, "{each:?}");
    wait_until(SEEN, "the consumer paused with the probe limit", || async {
        let info = consumer(&nats).await;
        info.paused && info.config.max_ack_pending == 1
    })
    .await;
    assert_eq!(transitions(&services, "open").await, 1.0);
    let listed = pools(&nats).await;
    assert!(
        listed.contains("partner breaker open: one probe attempt when its pause ends"),
        "{listed}"
    );
    // The calls still waiting are parked, not failed; the test ends here.
    for call in calls {
        call.abort();
    }
}

/// Once open, an upstream failing every call gets one call per pause (2 s, doubling to
/// 4 s); when it comes back, the next probe closes the breaker and the rest goes
/// through within two pause periods, every conversation with exactly one reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_open_one_call_per_pause_then_recovery_with_one_reply_each() {
    let healthy = Arc::new(AtomicBool::new(false));
    let upstream = flaky_upstream(healthy.clone()).await;
    let (nats, services, client) = cluster(
        &upstream,
        "min_attempts = 10\nfailure_ratio = 0.5\nwindow = \"1m\"\nopen_for = \"2s\"\nmax_open_for = \"4s\"",
        "max_retries = 30\nretry_delay = \"200ms\"\nbackoff_factor = 1.0",
    )
    .await;
    // Every live reply: subscribed before the first publish.
    let mut replies = nats
        .client()
        .await
        .subscribe("webproxy.reply.*")
        .await
        .expect("subscribe");
    let url = upstream.url("/flaky");
    let count = 30;
    let calls: Vec<_> = (0..count).map(|_| spawn_request(&client, &url)).collect();

    let reason = breaker_reason(&nats).await;
    let opened = Instant::now();
    println!("opened: {reason}");
    // The calls already in flight when it opened end at once (503); from then on the
    // upstream sees only probes.
    let settled = opened + Duration::from_secs(1);
    wait_until(SEEN, "three probes", || async {
        upstream
            .hit_times("/flaky")
            .iter()
            .filter(|t| **t > settled)
            .count()
            >= 3
    })
    .await;
    let probes: Vec<Instant> = upstream
        .hit_times("/flaky")
        .into_iter()
        .filter(|t| *t > settled)
        .collect();
    let gaps: Vec<Duration> = probes.windows(2).map(|w| w[1] - w[0]).collect();
    println!(
        "calls while open after {:?}: gaps {gaps:?}",
        settled - opened
    );
    // At most one call per pause period: 2 s, then 4 s; never two within the shortest.
    assert!(
        gaps.iter().all(|gap| *gap >= Duration::from_millis(1800)),
        "{gaps:?}"
    );
    assert!(transitions(&services, "open").await >= 2.0);
    assert!(transitions(&services, "half_open").await >= 1.0);

    let back = Instant::now();
    let before = upstream.hits_for("/flaky");
    healthy.store(true, Ordering::SeqCst);
    let mut statuses = Vec::new();
    for call in calls {
        statuses.push(call.await.expect("task"));
    }
    let recovered = back.elapsed();
    println!(
        "recovered {count} conversations in {recovered:?} ({} calls after the upstream came back)",
        upstream.hits_for("/flaky") - before
    );
    assert!(statuses.iter().all(|s| *s == Ok(200)), "{statuses:?}");
    // Two pause periods of at most max_open_for (4 s).
    assert!(recovered <= Duration::from_secs(8), "took {recovered:?}");
    wait_until(SEEN, "the limit restored", || async {
        let info = consumer(&nats).await;
        info.config.max_ack_pending == 8
    })
    .await;
    assert!(transitions(&services, "closed").await >= 1.0);

    // Exactly one live reply per conversation: wait until no more come for a while
    // after all have.
    let mut per_subject: HashMap<String, usize> = HashMap::new();
    let quiet = Duration::from_secs(3);
    while let Ok(Some(reply)) = tokio::time::timeout(quiet, replies.next()).await {
        *per_subject.entry(reply.subject.to_string()).or_default() += 1;
    }
    assert_eq!(per_subject.len(), count, "{per_subject:?}");
    assert!(per_subject.values().all(|n| *n == 1), "{per_subject:?}");
    drop(services);
}

/// A caller whose requests a rule answers 404 → error, or that get 500, does not open
/// the breaker: 60 such attempts count as attempts, none as failures. 503s then open it,
/// and its reason shows the earlier attempts counted as successes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_the_caller_chose_do_not_open_the_breaker() {
    let upstream = Upstream::start().await;
    let (nats, services, client) = cluster(
        &upstream,
        "min_attempts = 10\nfailure_ratio = 0.5\nwindow = \"5m\"\nopen_for = \"1m\"",
        "max_retries = 0\n[[request_rules.response_rules]]\nstatus = \"404\"\naction = \"error\"\n[[request_rules.response_rules]]\nstatus = \"500-599\"\naction = \"retry\"",
    )
    .await;
    let chosen: Vec<_> = (0..30)
        .map(|_| spawn_request(&client, &upstream.url("/status/404")))
        .chain((0..30).map(|_| spawn_request(&client, &upstream.url("/status/500"))))
        .collect();
    end_in_errors(chosen, &["UpstreamError", "RetriesExhausted"]).await;
    assert_eq!(upstream.hits(), 60);
    // The caller's errors are in the counts (reported each second) before the 503s go:
    // else the 503s may open the breaker before the next report, on counts without them.
    let js = async_nats::jetstream::new(nats.client().await);
    wait_until(SEEN, "the 60 attempts reported", || async {
        reported_attempts(&js).await >= 60
    })
    .await;
    let failing_from = Instant::now();
    let url = upstream.url("/status/503");
    let calls: Vec<_> = (0..100).map(|_| spawn_request(&client, &url)).collect();
    let reason = breaker_reason(&nats).await;
    let (failures, attempts) = counts_in(&reason);
    println!(
        "opened {:?} after the 503s began: {reason}",
        failing_from.elapsed()
    );
    // Had the 404s and 500s counted, it would have opened on them alone.
    assert!(attempts - failures >= 60, "{reason}");
    assert_eq!(transitions(&services, "open").await, 1.0);
    for call in calls {
        call.abort();
    }
}

/// How long the breaker is watched after caller-chosen failures: before, an instance
/// reported them within a second and the lease holder opened the breaker within a
/// second more, so this is well over twice what opening took.
const WOULD_HAVE_OPENED: Duration = Duration::from_secs(5);

/// Issue 29, point 7: six calls to a closed port, under a rule that accepts any
/// loopback port and names no origin, opened pool `shared`'s breaker, and another
/// caller's call to a healthy upstream then waited 9.4 s. Here the same six fail
/// (connection refused) in the partner pool, whose breaker would open on 5 attempts
/// half failed, for 1 min: it stays closed for [`WOULD_HAVE_OPENED`], and a call to
/// the partner's healthy upstream is then answered 200 within 3 s (it takes tens of
/// milliseconds; 3 s is generous for a loaded machine, and far below the 1 min an open
/// breaker would have parked it). Every target is on 127.0.0.1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_chosen_destinations_do_not_open_the_breaker() {
    let upstream = Upstream::start().await;
    let any_loopback_port = format!(
        "[[request_rules]]\nname = \"any-loopback-port\"\nurl_pattern = '^http://127\\.0\\.0\\.1:[0-9]+/'\npool = \"{POOL}\"\nmax_retries = 0\n"
    );
    let config = config(
        &upstream,
        "min_attempts = 5\nfailure_ratio = 0.5\nwindow = \"1m\"\nopen_for = \"1m\"\nmax_open_for = \"1m\"",
        &format!("max_retries = 0\n{any_loopback_port}"),
    );
    let nats = NatsServer::start();
    let service = Service::start(&nats, &config).await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    // Bound but never listening, so it refuses connections while the test runs.
    let (_closed, port) = closed_port();
    let refused = format!("http://127.0.0.1:{port}/");
    let calls: Vec<_> = (0..6).map(|_| spawn_request(&client, &refused)).collect();
    end_in_errors(calls, &["TransportError", "RetriesExhausted"]).await;

    let watched = Instant::now();
    while watched.elapsed() < WOULD_HAVE_OPENED {
        let pool = pool_json(&nats, POOL).await;
        assert_eq!(
            pool["breaker"],
            "closed",
            "opened {:?} after the caller's failures: {pool}",
            watched.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let asked = Instant::now();
    let healthy = spawn_request(&client, &upstream.url("/status/200"));
    let status = tokio::time::timeout(Duration::from_secs(3), healthy).await;
    println!("the healthy upstream answered in {:?}", asked.elapsed());
    assert!(
        matches!(status, Ok(Ok(Ok(200)))),
        "{status:?} after {:?}\n{}",
        asked.elapsed(),
        service.logs()
    );
    assert_eq!(pool_json(&nats, POOL).await["breaker"], "closed");
    assert_eq!(
        transitions(std::slice::from_ref(&service), "open").await,
        0.0
    );
}

/// Fails exactly `min_attempts` (10) calls at the upstream, each ended (503, no
/// retries) before the breaker can open on them: no message is left to probe.
async fn fail_ten_calls(client: &Client, upstream: &Upstream) {
    let url = upstream.url("/status/503");
    let calls: Vec<_> = (0..10).map(|_| spawn_request(client, &url)).collect();
    for call in calls {
        call.await.expect("task").expect_err("503 with no retries");
    }
}

/// `pools`' lines about the partner pool's breaker and pauses.
fn breaker_lines(listed: &str) -> Vec<&str> {
    listed
        .lines()
        .filter(|line| {
            line.starts_with("partner breaker") || line.starts_with("partner paused until")
        })
        .collect()
}

/// When its pause (`open_for`, 2 s) ends with nothing waiting, the breaker stays
/// half-open until a probe, and `pools` shows it so: no pause, the half-open line, a
/// limit of 1, `"breaker": "half_open"` in `--json`. One call that succeeds is the
/// probe and closes it: `pools` shows no breaker and the limit of 8 again. Each wait
/// is bounded by [`SEEN`]; the test takes a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_shows_a_half_open_breaker_until_its_probe_closes_it() {
    let upstream = Upstream::start().await;
    let (nats, services, client) = cluster(
        &upstream,
        "min_attempts = 10\nfailure_ratio = 0.5\nwindow = \"1m\"\nopen_for = \"2s\"\nmax_open_for = \"2s\"",
        "max_retries = 0",
    )
    .await;
    // Its open phase (2 s) may be over before a loaded machine runs `pools`: the
    // test waits for what follows it.
    fail_ten_calls(&client, &upstream).await;
    let half_open = webproxy_tests::wait_for(SEEN, "the breaker half-open", || async {
        let pool = pool_json(&nats, POOL).await;
        (pool["breaker"] == "half_open").then_some(pool)
    })
    .await;
    println!("half-open: {half_open}");
    assert_eq!(half_open["max_in_flight"], 1, "{half_open}");
    assert_eq!(half_open["pauses"], serde_json::json!([]), "{half_open}");
    // Nothing calls meanwhile, so it is still half-open.
    let listed = pools(&nats).await;
    assert_eq!(
        breaker_lines(&listed),
        ["partner breaker half-open: one probe attempt at a time (max_in_flight 1)"],
        "{listed}"
    );
    assert_eq!(upstream.hits_for("/status/503"), 10);

    let probe = spawn_request(&client, &upstream.url("/status/200"));
    assert_eq!(probe.await.expect("task"), Ok(200));
    let closed = webproxy_tests::wait_for(SEEN, "the breaker closed at the full limit", || async {
        let pool = pool_json(&nats, POOL).await;
        (pool["breaker"] == "closed" && pool["max_in_flight"] == 8).then_some(pool)
    })
    .await;
    assert_eq!(closed["pauses"], serde_json::json!([]), "{closed}");
    let listed = pools(&nats).await;
    assert!(breaker_lines(&listed).is_empty(), "{listed}");
    assert_eq!(transitions(&services, "open").await, 1.0);
    assert_eq!(transitions(&services, "half_open").await, 1.0);
    assert_eq!(transitions(&services, "closed").await, 1.0);
}

/// A breaker taken out of the configuration (a `config push` in `kv` mode) while it is
/// open lets go of the pool at once, not when its pause (10 min) would have ended:
/// the consumer is no longer paused and is back at `max_in_flight` (8), `pools` shows
/// no breaker, and a call goes through. Each wait is bounded by [`SEEN`], far below
/// the pause; the test takes a few seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breaker_taken_out_of_the_config_while_open_lets_go_of_the_pool() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let document = |sections: &str| {
        format!(
            "[outbound]\nallow_private_networks = true\n\n{}",
            pool_config(&upstream, sections, "max_retries = 0")
        )
    };
    let breaker = format!(
        "[pools.{POOL}.breaker]\nmin_attempts = 10\nfailure_ratio = 0.5\nwindow = \"1m\"\nopen_for = \"10m\"\nmax_open_for = \"10m\""
    );
    seed_config(&nats, &document(&breaker)).await;
    let services = Service::start_many(
        &nats.url(),
        &kv_config(&webproxy_tests::caller::accept_rule("local", &upstream)),
        2,
    )
    .await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    fail_ten_calls(&client, &upstream).await;
    println!("opened: {}", breaker_reason(&nats).await);
    wait_until(SEEN, "the consumer paused with the probe limit", || async {
        let info = consumer(&nats).await;
        info.paused && info.config.max_ack_pending == 1
    })
    .await;

    let pushed = push_config(&nats, &document("")).await;
    println!("{pushed}");
    let removed = Instant::now();
    wait_until(SEEN, "the consumer unpaused at max_in_flight", || async {
        let info = consumer(&nats).await;
        !info.paused && info.config.max_ack_pending == 8
    })
    .await;
    println!("let go of the pool {:?} after the push", removed.elapsed());
    let pool = pool_json(&nats, POOL).await;
    assert_eq!(pool["breaker"], "closed", "{pool}");
    assert_eq!(pool["pauses"], serde_json::json!([]), "{pool}");
    let listed = pools(&nats).await;
    assert!(breaker_lines(&listed).is_empty(), "{listed}");
    let call = spawn_request(&client, &upstream.url("/status/200"));
    let status = tokio::time::timeout(SEEN, call).await;
    assert!(
        matches!(status, Ok(Ok(Ok(200)))),
        "{status:?} after {:?}",
        removed.elapsed()
    );
    assert_eq!(transitions(&services, "closed").await, 1.0);
}
