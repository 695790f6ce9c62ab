//! Fault tests: real `webproxy serve` processes and real nats-servers, killed,
//! restarted and fed garbage, while requests are in flight. Each test checks the
//! promise callers rely on: every conversation gets exactly one stored final reply.
//!
//! Time bounds are generous (tens of seconds) because a loaded 2-core CI machine runs
//! several of these at once; `ack_wait` is short so a dead instance's messages come
//! back quickly.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream;
use bytes::Bytes;
use futures::StreamExt as _;
use webproxy_client::{Client, Submitted};
use webproxy_protocol::{ErrorCode, Outcome, Reply};
use webproxy_tests::caller::{accept_rule, envelope, next_message, to};
use webproxy_tests::{
    NatsCluster, NatsServer, Service, Upstream, http_client, wait_for, wait_until,
};

/// How long every conversation may take to end after a fault.
const RECOVERY: Duration = Duration::from_secs(60);

fn config(upstream: &Upstream, pool: u32, extra: &str) -> String {
    format!(
        "[service]\nack_wait = \"2s\"\nshutdown_grace = \"10s\"\n{extra}\n[pools.default]\nmax_in_flight = {pool}\n\n{}timeout = \"30s\"\n",
        accept_rule("local", upstream)
    )
}

/// Every live reply published on `webproxy.reply.<id>`, by conversation id, as a
/// subscriber saw them (the stored copies, on `webproxy.reply.<id>.<STREAM>.<seq>`,
/// are counted in the stream instead).
#[derive(Clone, Default)]
struct Observed(Arc<Mutex<BTreeMap<String, Vec<Bytes>>>>);

impl Observed {
    async fn subscribe(nats: async_nats::Client) -> Observed {
        let observed = Observed::default();
        let mut replies = nats.subscribe("webproxy.reply.*").await.expect("subscribe");
        let sink = observed.clone();
        tokio::spawn(async move {
            while let Some(message) = replies.next().await {
                let id = message
                    .subject
                    .trim_start_matches("webproxy.reply.")
                    .to_string();
                sink.lock().entry(id).or_default().push(message.payload);
            }
        });
        observed
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Vec<Bytes>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Copies seen beyond one per conversation, and conversations seen with two
    /// different final replies.
    fn repeats(&self) -> (usize, Vec<String>) {
        let seen = self.lock();
        let copies = seen.values().map(|v| v.len().saturating_sub(1)).sum();
        let conflicting = seen
            .iter()
            .filter(|(_, v)| v.iter().collect::<BTreeSet<_>>().len() > 1)
            .map(|(id, _)| id.clone())
            .collect();
        (copies, conflicting)
    }
}

/// How many messages the replies stream stores per conversation id, over all of that
/// id's origins (`webproxy.reply.<id>.<STREAM>.<seq>`); `None` while JetStream cannot
/// answer (a cluster electing leaders after a node loss).
async fn stored_replies(js: &jetstream::Context) -> Option<BTreeMap<String, u64>> {
    // Subjects come in pages, and a subject stored while they are read can appear on
    // two of them: each counts once. Each pool's replies are in a stream of its own.
    let mut subjects = BTreeMap::new();
    for name in webproxy_tests::replies_streams(js).await? {
        let stream = js.get_stream(&name).await.ok()?;
        let mut info = stream.info_with_subjects("webproxy.reply.>").await.ok()?;
        while let Some(entry) = info.next().await {
            let (subject, count) = entry.ok()?;
            subjects.insert(subject, count as u64);
        }
    }
    let mut counts = BTreeMap::new();
    for (subject, count) in subjects {
        let id = subject
            .trim_start_matches("webproxy.reply.")
            .split('.')
            .next()
            .unwrap_or_default()
            .to_string();
        *counts.entry(id).or_default() += count;
    }
    Some(counts)
}

/// Each conversation's own stored reply is a 200.
async fn assert_stored_ok(client: &Client, submitted: &[Submitted]) {
    for submitted in submitted {
        let reply = client
            .reply(&submitted.id, &submitted.origin)
            .await
            .expect("lookup")
            .expect("stored");
        assert_eq!(reply.status, Some(200), "{reply:?}");
    }
}

/// Waits until every id has a stored reply, then checks each has exactly one.
async fn assert_one_stored_reply_each(
    js: &jetstream::Context,
    submitted: &[Submitted],
    services: &[&Service],
) {
    let wanted: BTreeSet<&str> = submitted.iter().map(|s| s.id.as_str()).collect();
    let deadline = tokio::time::Instant::now() + RECOVERY;
    loop {
        let stored = stored_replies(js).await.unwrap_or_default();
        let missing: Vec<_> = wanted
            .iter()
            .filter(|id| !stored.contains_key(**id))
            .collect();
        if missing.is_empty() {
            let doubled: Vec<_> = stored.iter().filter(|(_, n)| **n != 1).collect();
            assert!(
                doubled.is_empty(),
                "conversations with more than one stored reply: {doubled:?}"
            );
            return;
        }
        if tokio::time::Instant::now() > deadline {
            let logs: Vec<_> = services.iter().map(|s| s.logs()).collect();
            panic!(
                "{} of {} conversations have no stored reply after {RECOVERY:?}: {:?}\n{}",
                missing.len(),
                wanted.len(),
                missing.iter().take(5).collect::<Vec<_>>(),
                logs.join("\n----\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Submits `count` requests that each hold the upstream 200 ms, and returns once
/// `under_way` of them have reached it: a fault injected then hits a busy system.
async fn load(
    client: &Client,
    upstream: &Upstream,
    count: usize,
    under_way: usize,
) -> Vec<Submitted> {
    let ids = submit_all(client, upstream, "/delay/200", count).await;
    wait_until(RECOVERY, "the load to be under way", || async {
        upstream.hits() >= under_way
    })
    .await;
    ids
}

async fn submit_all(
    client: &Client,
    upstream: &Upstream,
    path: &str,
    count: usize,
) -> Vec<Submitted> {
    let mut ids = Vec::with_capacity(count);
    for _ in 0..count {
        let request = envelope("GET", &upstream.url(path));
        ids.push(
            client
                .submit(&to("default", &request))
                .await
                .expect("submit"),
        );
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_an_instance_mid_load_loses_no_conversation() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let config = config(&upstream, 20, "");
    let mut doomed = Service::start(&nats, &config).await;
    let survivor = Service::start(&nats, &config).await;
    let observed = Observed::subscribe(nats.client().await).await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");

    let ids = load(&client, &upstream, 200, 40).await;
    doomed.kill();
    let replacement = Service::start(&nats, &config).await;

    let js = jetstream::new(nats.client().await);
    assert_one_stored_reply_each(&js, &ids, &[&survivor, &replacement]).await;
    assert_stored_ok(&client, &ids).await;
    let (copies, conflicting) = observed.repeats();
    assert!(
        conflicting.is_empty(),
        "two different final replies for {conflicting:?}"
    );
    println!(
        "kill -9 mid-load: {} upstream calls repeated, {copies} identical reply copies seen live",
        upstream.hits_for("/delay/200").saturating_sub(200)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_nats_mid_load_loses_no_conversation() {
    let mut nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let service = Service::start(&nats, &config(&upstream, 20, "")).await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    let ids = load(&client, &upstream, 100, 20).await;
    nats.restart();

    let js = jetstream::new(nats.client().await);
    assert_one_stored_reply_each(&js, &ids, &[&service]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_cluster_node_in_use_loses_no_conversation() {
    let mut cluster = NatsCluster::start(3);
    let upstream = Upstream::start().await;
    let service = Service::start_with_url(
        &cluster.urls(),
        &config(&upstream, 20, "[streams]\nreplicas = 3\n"),
    )
    .await;
    let survivor = cluster.nodes[0].url();
    let client = Client::new(
        async_nats::connect(cluster.urls().split(',').collect::<Vec<_>>())
            .await
            .expect("connect"),
        "webproxy",
    )
    .expect("client");
    let ids = load(&client, &upstream, 100, 20).await;
    let in_use = cluster
        .node_with_client("webproxy")
        .await
        .expect("the node the service is connected to");
    cluster.nodes[in_use].kill();
    let alive = if in_use == 0 {
        cluster.nodes[1].url()
    } else {
        survivor
    };
    let js = jetstream::new(async_nats::connect(alive).await.expect("connect"));
    assert_one_stored_reply_each(&js, &ids, &[&service]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_attempts_and_exits_cleanly() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let mut service = Service::start(&nats, &config(&upstream, 64, "")).await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    let ids = submit_all(&client, &upstream, "/delay/1000", 50).await;
    wait_until(RECOVERY, "all 50 attempts in flight", || async {
        upstream.hits_for("/delay/1000") == 50
    })
    .await;
    service.terminate();
    let http = http_client();
    let readyz = format!("{}/readyz", service.health_url());
    wait_until(
        Duration::from_secs(5),
        "readyz 503 while draining",
        || async {
            http.get(&readyz)
                .send()
                .await
                .is_ok_and(|r| r.status().as_u16() == 503)
        },
    )
    .await;
    // The grace is 10 s; the attempts need 1 s.
    let status = service
        .wait_exit(Duration::from_secs(15))
        .await
        .expect("exited within the grace time");
    assert!(status.success(), "{status:?}\n{}", service.logs());
    for submitted in &ids {
        let reply = client
            .reply(&submitted.id, &submitted.origin)
            .await
            .expect("lookup");
        assert_eq!(
            reply.and_then(|r| r.status),
            Some(200),
            "{} was not answered",
            submitted.id
        );
    }
}

/// A small deterministic generator: the test needs varied bytes, not secure ones.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| (self.next() & 0xff) as u8).collect()
    }
}

const BROKEN: &[&str] = &[
    r#"{"id":"ID"}"#,
    r#"{"id":"ID","method":"TELEPORT","url":"URL"}"#,
    r#"{"id":"ID","method":"GET","url":12}"#,
    r#"{"id":"ID","method":"GET","url":"URL","headers":"nope"}"#,
    r#"{"id":"ID","method":"GET","url":"URL","body":"a","body_base64":"YQ=="}"#,
    r#"{"id":"ID","method":"GET","url":"URL","reply_to":"a.>"}"#,
    r#"{"id":"bad id!","method":"GET","url":"URL"}"#,
    r#"{"id":["ID"],"method":"GET","url":"URL"}"#,
    r#"{"id":"ID","method":"GET","url":"URL","v":7}"#,
    r#"{"id":"ID","method":"GET","url":"URL","timeout_ms":"soon"}"#,
];

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse().ok())
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_input_is_dead_lettered_and_valid_requests_are_answered() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let service = Service::start(&nats, &config(&upstream, 64, "")).await;
    let nats_client = nats.client().await;
    let js = jetstream::new(nats_client.clone());
    let client = Client::new(nats_client, "webproxy").expect("client");
    let mut random = XorShift(0x5eed_1234_abcd_9876);
    let url = upstream.url("/echo");

    let mut published = 0usize;
    let mut round = async |random: &mut XorShift, garbage: usize, broken: usize, valid: usize| {
        let mut ids = Vec::new();
        for i in 0..garbage.max(broken).max(valid) {
            if i < garbage {
                let len = (random.next() % 512) as usize;
                publish(&js, &format!("garbage-{published}"), random.bytes(len)).await;
                published += 1;
            }
            if i < broken {
                let template = BROKEN[i % BROKEN.len()];
                let id = format!("broken-{published}");
                publish(
                    &js,
                    &id,
                    template
                        .replace("ID", &id)
                        .replace("URL", &url)
                        .into_bytes(),
                )
                .await;
                published += 1;
            }
            if i < valid {
                ids.push(
                    client
                        .submit(&to("default", &envelope("GET", &url)))
                        .await
                        .expect("submit"),
                );
            }
        }
        ids
    };
    // A warm-up round, so the memory baseline includes steady-state buffers.
    let warm = round(&mut random, 100, 100, 10).await;
    assert_one_stored_reply_each(&js, &warm, &[&service]).await;
    wait_for_dead_letters(&js, 200).await;
    let baseline = rss_kib(service.pid());

    let ids = round(&mut random, 1000, 1000, 100).await;
    assert_one_stored_reply_each(&js, &ids, &[&service]).await;
    wait_for_dead_letters(&js, 2200).await;
    assert_stored_ok(&client, &ids).await;
    let info = wait_for(RECOVERY, "nothing pending or waiting", || async {
        let info = js
            .get_stream("WEBPROXY_POOL_DEFAULT")
            .await
            .expect("pool")
            .consumer_info("webproxy-default-l3")
            .await
            .expect("consumer");
        (info.num_pending == 0 && info.num_ack_pending == 0).then_some(info)
    })
    .await;
    // The server forgets a redelivery once the message is acked, so the redelivered
    // count proves nothing now; the consumer's delivery sequence counts every delivery
    // it ever made: exactly one per message means none was delivered twice.
    let messages = (100 + 100 + 10) + (1000 + 1000 + 100);
    assert_eq!(info.delivered.consumer_sequence, messages, "{info:?}");
    let after = rss_kib(service.pid());
    // 2100 more messages must not leave more than a few MiB behind; 32 MiB is generous.
    assert!(
        after < baseline + 32 * 1024,
        "RSS grew from {baseline} KiB to {after} KiB"
    );
    println!("poison input: RSS {baseline} KiB after warm-up, {after} KiB after 2100 messages");
}

async fn publish(js: &jetstream::Context, msg_id: &str, payload: Vec<u8>) {
    let publish = jetstream::message::PublishMessage::build()
        .payload(payload.into())
        .message_id(msg_id);
    js.send_publish("webproxy.request.default", publish)
        .await
        .expect("publish")
        .await
        .expect("stored");
}

async fn wait_for_dead_letters(js: &jetstream::Context, count: u64) {
    wait_until(RECOVERY, &format!("{count} dead letters"), || async {
        webproxy_tests::dead_letter_count(js)
            .await
            .is_some_and(|letters| letters >= count)
    })
    .await;
}

/// An attempt that never finishes, on an instance killed each time, comes back until
/// `max_deliver` is passed; then it is answered `internal`, dead-lettered and removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_killing_instances_is_ended_as_poison() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let config =
        config(&upstream, 4, "max_deliver = 2\n").replace("ack_wait = \"2s\"", "ack_wait = \"1s\"");
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    let request = envelope("GET", &upstream.url("/hang"));
    let mut replies = nats
        .client()
        .await
        .subscribe(format!("webproxy.reply.{}", request.id))
        .await
        .expect("subscribe");
    let mut service = Service::start(&nats, &config).await;
    client
        .submit(&to("default", &request))
        .await
        .expect("submit");
    for delivery in 1..=2 {
        if delivery > 1 {
            service = Service::start(&nats, &config).await;
        }
        wait_until(
            RECOVERY,
            &format!("delivery {delivery} to hang"),
            || async { upstream.hits_for("/hang") == delivery },
        )
        .await;
        service.kill();
    }
    let _last = Service::start(&nats, &config).await;
    let message = next_message(&mut replies, RECOVERY, "a final reply").await;
    let reply: Reply = serde_json::from_slice(&message.payload).expect("reply");
    assert_eq!(reply.outcome, Outcome::Error);
    let error = reply.error.expect("error");
    assert_eq!(error.code, ErrorCode::Internal);
    assert!(
        error.message.contains("delivered 3 times"),
        "{}",
        error.message
    );
    assert_eq!(
        upstream.hits_for("/hang"),
        2,
        "attempted again after max_deliver"
    );

    let js = jetstream::new(nats.client().await);
    wait_for_dead_letters(&js, 1).await;
    wait_until(
        RECOVERY,
        "the poison message to leave the work stream",
        || async {
            let mut pool = js.get_stream("WEBPROXY_POOL_DEFAULT").await.expect("pool");
            pool.info().await.is_ok_and(|i| i.state.messages == 0)
        },
    )
    .await;
}

/// A retry waiting for its due time is a message in JetStream, not a timer in memory:
/// it survives the instance that parked it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_retry_survives_a_restart() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let config = format!(
        "{}max_retries = 2\nretry_delay = \"1s\"\nbackoff_factor = 1.0\n",
        config(&upstream, 4, "")
    );
    let mut first = Service::start(&nats, &config).await;
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    let request = envelope("GET", &upstream.url("/status/503"));
    let submitted = client
        .submit(&to("default", &request))
        .await
        .expect("submit");
    // Killed only once the retry is parked and the request acked; a kill before that
    // is the crash test's case, where the attempt is legitimately repeated.
    let js = jetstream::new(nats.client().await);
    wait_until(
        RECOVERY,
        "the first attempt's retry to be parked",
        || async {
            let Ok(pool) = js.get_stream("WEBPROXY_POOL_DEFAULT").await else {
                return false;
            };
            let work = pool.consumer_info("webproxy-default-l3").await;
            let parked = pool.consumer_info("webproxy-default-retry-l3").await;
            matches!((work, parked), (Ok(w), Ok(p))
            if upstream.hits_for("/status/503") == 1
                && w.num_ack_pending == 0
                && p.num_pending + p.num_ack_pending as u64 == 1)
        },
    )
    .await;
    first.kill();
    let second = Service::start(&nats, &config).await;
    assert_one_stored_reply_each(&js, std::slice::from_ref(&submitted), &[&second]).await;
    let reply = client
        .reply(&submitted.id, &submitted.origin)
        .await
        .expect("lookup")
        .expect("stored");
    let error = reply.error.expect("error");
    assert_eq!(error.code, ErrorCode::RetriesExhausted);
    assert_eq!(reply.attempts, 3);
    assert_eq!(upstream.hits_for("/status/503"), 3);
}
