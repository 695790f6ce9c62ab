//! Cluster state that survives faults (issue 29): the buckets the service keeps in
//! NATS are made again when the server confirms them gone, and a pool that cannot
//! reach its state says so on `/readyz`. Real `webproxy serve` processes against real
//! nats-servers.
//!
//! Time bounds are the where it gives one, generous otherwise (a loaded 2-core
//! CI machine runs several of these at once), and documented where they are set.

use std::time::{Duration, Instant};

use async_nats::jetstream::stream;
use webproxy_client::Client;
use webproxy_tests::caller::{envelope, path_rule, to};
use webproxy_tests::{NatsServer, Service, Upstream, http_client, wait_for, wait_until};

const POOL: &str = "partner";

/// The bound on an answer after the fault: 3 of 3 requests got none in 25 s.
const ANSWER: Duration = Duration::from_secs(25);

/// The pool `partner` with `pool` (its section's keys) and a rule sending every call
/// to `upstream` there.
fn config(upstream: &Upstream, pool: &str, extra: &str) -> String {
    format!(
        "{extra}[pools.{POOL}]\n{pool}\n{}pool = \"{POOL}\"\n",
        path_rule("partner", upstream, "/")
    )
}

async fn call(client: &Client, upstream: &Upstream) -> Result<u16, String> {
    let request = to(POOL, &envelope("GET", &upstream.url("/echo"))).wait(ANSWER);
    let reply = client.request(&request).await.map_err(|e| e.to_string())?;
    reply.status.ok_or_else(|| format!("no status: {reply:?}"))
}

/// `/readyz`'s status and body.
async fn readiness(service: &Service) -> (u16, String) {
    let Ok(response) = http_client()
        .get(format!("{}/readyz", service.health_url()))
        .send()
        .await
    else {
        return (0, String::new());
    };
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// Table item 1: the rate bucket is in memory, so a restart loses it. The limiter
/// used to keep its old handle and retry on it forever, and every new request of the
/// pool went unanswered while pools without a rate recovered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limited_pool_recovers_after_a_restart_that_loses_memory_state() {
    let mut nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let service = Service::start(
        &nats,
        &config(&upstream, "max_in_flight = 4\nrate = \"20/s\"\n", ""),
    )
    .await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    assert_eq!(
        call(&client, &upstream).await,
        Ok(200),
        "before the restart"
    );

    nats.restart();
    let restarted = Instant::now();
    for n in 1..=3 {
        let status = call(&client, &upstream).await;
        assert_eq!(
            status,
            Ok(200),
            "request {n} after the restart\n{}",
            service.logs()
        );
    }
    println!(
        "3 requests answered {:?} after the restart",
        restarted.elapsed()
    );
    wait_until(ANSWER, "the service ready again", || async {
        readiness(&service).await.0 == 200
    })
    .await;
}

/// Readiness: a pool whose rate bucket cannot be used (here the bucket's stream is
/// replaced by a sealed one, which refuses every write and every change) cannot claim
/// a slot. `/readyz` turns 503 within 10 s (the bound) and names the pool and
/// the bucket. Once the operator deletes the broken stream, the bucket is made again,
/// the waiting request is answered and the service is ready again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_cannot_use_its_rate_schedule_is_not_ready_and_says_why() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let service = Service::start(
        &nats,
        &config(&upstream, "max_in_flight = 4\nrate = \"20/s\"\n", ""),
    )
    .await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    assert_eq!(call(&client, &upstream).await, Ok(200), "before the fault");

    let js = async_nats::jetstream::new(nats.client().await);
    js.delete_stream("KV_WEBPROXY_RATE")
        .await
        .expect("delete the rate bucket");
    let broken = stream::Config {
        name: "KV_WEBPROXY_RATE".into(),
        subjects: vec!["$KV.WEBPROXY_RATE.>".into()],
        max_messages_per_subject: 1,
        storage: stream::StorageType::Memory,
        ..Default::default()
    };
    js.create_stream(broken.clone())
        .await
        .expect("a stream in its place");
    js.update_stream(stream::Config {
        sealed: true,
        ..broken
    })
    .await
    .expect("seal it");

    let request = to(POOL, &envelope("GET", &upstream.url("/echo"))).wait(Duration::from_secs(120));
    let answer = tokio::spawn({
        let client = client.clone();
        async move { client.request(&request).await }
    });
    let broke = Instant::now();
    let body = wait_for(
        Duration::from_secs(10),
        "/readyz 503 naming the rate schedule",
        || async {
            let (status, text) = readiness(&service).await;
            (status == 503 && text.contains("rate schedule")).then_some(text)
        },
    )
    .await;
    println!("/readyz 503 after {:?}: {body}", broke.elapsed());
    assert!(
        body.contains(POOL) && body.contains("WEBPROXY_RATE"),
        "{body}"
    );
    assert_eq!(upstream.hits(), 1, "the waiting request was attempted");

    js.delete_stream("KV_WEBPROXY_RATE")
        .await
        .expect("delete the broken stream");
    let reply = answer
        .await
        .expect("the request's task")
        .unwrap_or_else(|e| {
            panic!(
                "no answer once the stream was deleted: {e}\n{}",
                service.logs()
            )
        });
    assert_eq!(reply.status, Some(200), "{reply:?}");
    wait_until(ANSWER, "the service ready again", || async {
        readiness(&service).await.0 == 200
    })
    .await;
}
