//! Pools: one concurrency limit per pool, held across every running instance by the
//! JetStream server, with excess requests queued in the stream. Several real
//! `webproxy serve` processes share one nats-server here.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use webproxy_client::{Client, Error as ClientError};
use webproxy_protocol::{ErrorCode, Outcome, Reply};
use webproxy_tests::caller::{
    REPLY_TIMEOUT, accept_rule, envelope, next_message, stored_reply, to,
};
use webproxy_tests::pools::{kv_config, push_config};
use webproxy_tests::run_webproxy as webproxy;
use webproxy_tests::{
    Gate, NatsServer, Service, ServiceOptions, Upstream, default_routes, wait_until,
};

/// How long an instance asked to stop may take to exit.
const EXIT: Duration = Duration::from_secs(30);

struct Cluster {
    nats: NatsServer,
    upstream: Upstream,
    services: Vec<Service>,
    client: Client,
}

async fn cluster(instances: usize, config: impl Fn(&Upstream) -> String) -> Cluster {
    cluster_on(Upstream::start().await, instances, config).await
}

async fn cluster_on(
    upstream: Upstream,
    instances: usize,
    config: impl Fn(&Upstream) -> String,
) -> Cluster {
    let nats = NatsServer::start();
    let text = config(&upstream);
    let mut services = Vec::new();
    for _ in 0..instances {
        services.push(Service::start(&nats, &text).await);
    }
    let client = Client::new(nats.client().await, "webproxy").expect("client");
    Cluster {
        nats,
        upstream,
        services,
        client,
    }
}

impl Cluster {
    /// Sends `count` requests for `path` to `pool` at once and waits for every reply.
    async fn burst(&self, pool: &str, path: &str, count: usize) -> Vec<Reply> {
        let url = self.upstream.url(path);
        let replies = futures::future::join_all((0..count).map(|_| {
            let request = envelope("GET", &url);
            async move {
                self.client
                    .request(&to(pool, &request).wait(Duration::from_secs(60)))
                    .await
            }
        }))
        .await;
        replies
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|e| {
                    let logs: Vec<_> = self.services.iter().map(Service::logs).collect();
                    panic!("no reply: {e}\n{}", logs.join("\n----\n"))
                })
            })
            .collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_share_a_limit_of_three() {
    let c = cluster(3, |up| {
        format!(
            "[pools.default]\nmax_in_flight = 3\n\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    let started = Instant::now();
    let replies = c.burst("default", "/delay/100", 60).await;
    let elapsed = started.elapsed();
    assert!(replies.iter().all(|r| r.status == Some(200)), "{replies:?}");
    assert_eq!(c.upstream.hits_for("/delay/100"), 60);
    assert!(
        c.upstream.max_concurrent() <= 3,
        "limit broken: {}",
        c.upstream.max_concurrent()
    );
    assert_eq!(c.upstream.max_concurrent(), 3, "slots unused");
    // Ideal: 60 x 0.1 s / 3 = 2 s. Three times that catches a limit held but starved.
    assert!(elapsed < Duration::from_secs(6), "took {elapsed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_of_one_holds_across_two_instances() {
    let c = cluster(2, |up| {
        format!(
            "[pools.default]\nmax_in_flight = 1\n\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    let replies = c.burst("default", "/delay/50", 20).await;
    assert!(replies.iter().all(|r| r.status == Some(200)), "{replies:?}");
    assert_eq!(c.upstream.hits_for("/delay/50"), 20);
    assert_eq!(c.upstream.max_concurrent(), 1);
}

/// An attempt three times as long as `ack_wait` is kept from redelivery by progress
/// acks: the upstream sees it once, and the limit holds meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_attempt_is_not_redelivered_while_it_runs() {
    let c = cluster(2, |up| {
        format!(
            "[service]\nack_wait = \"1s\"\n\n[pools.default]\nmax_in_flight = 1\n\n{}timeout = \"20s\"\n",
            accept_rule("local", up)
        )
    })
    .await;
    let long = envelope("GET", &c.upstream.url("/delay/3000"));
    let short = envelope("GET", &c.upstream.url("/delay/10"));
    let long = to("default", &long).wait(REPLY_TIMEOUT);
    let (long_reply, short_reply) = tokio::join!(c.client.request(&long), async {
        wait_until(
            Duration::from_secs(10),
            "the long attempt to start",
            || async { c.upstream.hits_for("/delay/3000") == 1 },
        )
        .await;
        c.client
            .request(&to("default", &short).wait(REPLY_TIMEOUT))
            .await
    });
    assert_eq!(long_reply.expect("long reply").status, Some(200));
    assert_eq!(short_reply.expect("short reply").status, Some(200));
    assert_eq!(
        c.upstream.hits_for("/delay/3000"),
        1,
        "redelivered while running"
    );
    assert_eq!(c.upstream.max_concurrent(), 1);
}

/// Publishing to the default pool does not bypass the limit of the rule's pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_moved_to_its_rules_pool() {
    let c = cluster(1, |up| {
        let base = up.url("/").replace('.', "\\.");
        format!(
            "[pools.p1]\nmax_in_flight = 1\n\n[[request_rules]]\nname = \"slow\"\nurl_pattern = '^{base}delay/'\npool = \"p1\"\n\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    let replies = c.burst("default", "/delay/100", 5).await;
    assert!(replies.iter().all(|r| r.status == Some(200)), "{replies:?}");
    assert_eq!(c.upstream.max_concurrent(), 1, "ran outside p1's limit");
    // and the default pool's own requests still run side by side
    let replies = c.burst("default", "/echo", 5).await;
    assert!(replies.iter().all(|r| r.status == Some(200)));
}

/// Issue 30, point 5: `max_waiting` bounds the requests a rule moves into a pool as it
/// bounds callers' publishes there. Two instances move 24 requests into `p1`
/// (`max_waiting` 3, one slot, its upstream held at a gate, so nothing leaves it): the
/// moves past the bound are answered `queue_full`, naming the pool, and dead-lettered.
/// Each instance counts and publishes a move as one step, so a move racing from the
/// other instance passes the bound by at most one: 3 or 4 moves reach `p1`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_past_max_waiting_are_answered_queue_full() {
    const SENT: usize = 24;
    let gate = Gate::new();
    let upstream = Upstream::start_with(default_routes().merge(gate.routes())).await;
    let c = cluster_on(upstream, 2, |up| {
        let base = up.url("/").replace('.', "\\.");
        format!(
            "[pools.p1]\nmax_in_flight = 1\nmax_waiting = 3\n\n[[request_rules]]\nname = \"held\"\nurl_pattern = '^{base}gated/'\npool = \"p1\"\n\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    let replies = Arc::new(Mutex::new(Vec::new()));
    let url = c.upstream.url("/gated/0");
    let mut sent = Vec::new();
    for _ in 0..SENT {
        let request = to("default", &envelope("GET", &url)).wait(Duration::from_secs(120));
        let client = c.client.clone();
        let replies = replies.clone();
        sent.push(tokio::spawn(async move {
            let reply = client.request(&request).await;
            replies.lock().expect("replies").push(reply);
        }));
    }
    let js = async_nats::jetstream::new(c.nats.client().await);
    let in_p1 = || async {
        let mut stream = js
            .get_stream("WEBPROXY_POOL_P1")
            .await
            .expect("p1's stream");
        stream
            .info()
            .await
            .expect("p1's stream info")
            .state
            .messages
    };
    // Generous for two instances on a loaded 2-core machine: each move is a few
    // round trips to the server.
    wait_until(
        Duration::from_secs(60),
        "every move admitted or refused",
        || async {
            let answered = replies.lock().expect("replies").len();
            answered + usize::try_from(in_p1().await).unwrap_or(usize::MAX) == SENT
        },
    )
    .await;
    let admitted = usize::try_from(in_p1().await).unwrap_or(usize::MAX);
    assert!((3..=4).contains(&admitted), "{admitted} moves reached p1");
    {
        let replies = replies.lock().expect("replies");
        for reply in replies.iter() {
            let reply = reply.as_ref().expect("a reply");
            let error = reply.error.as_ref().expect("an error reply");
            assert_eq!(error.code, ErrorCode::QueueFull, "{reply:?}");
            assert!(error.message.contains("pool p1"), "{}", error.message);
        }
    }
    let letters = webproxy_tests::dead_letter_count(&js)
        .await
        .expect("dead letters");
    assert_eq!(letters, u64::try_from(SENT - admitted).expect("count"));
    gate.open();
    for task in sent {
        task.await.expect("request task");
    }
    let replies = replies.lock().expect("replies");
    let answered = replies
        .iter()
        .filter(|r| r.as_ref().is_ok_and(|r| r.status == Some(200)))
        .count();
    assert_eq!(answered, admitted, "{replies:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_expires_a_request_waiting_behind_a_saturated_pool() {
    let c = cluster(1, |up| {
        format!(
            "[pools.default]\nmax_in_flight = 1\n\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    c.client
        .submit(&to(
            "default",
            &envelope("GET", &c.upstream.url("/delay/2000")),
        ))
        .await
        .expect("submit");
    wait_until(Duration::from_secs(10), "the slot to be taken", || async {
        c.upstream.hits_for("/delay/2000") == 1
    })
    .await;
    let mut waiting = envelope("GET", &c.upstream.url("/echo"));
    let deadline = time::OffsetDateTime::now_utc() + Duration::from_millis(500);
    waiting.deadline = Some(
        deadline
            .format(&time::format_description::well_known::Rfc3339)
            .expect("format"),
    );
    let reply = c
        .client
        .request(&to("default", &waiting).wait(REPLY_TIMEOUT))
        .await
        .expect("reply");
    assert_eq!(reply.error.map(|e| e.code), Some(ErrorCode::Expired));
    assert_eq!(reply.attempts, 0);
    assert_eq!(c.upstream.hits_for("/echo"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_are_listed_and_removed() {
    let mut c = cluster(1, |up| {
        format!(
            "[pools.p1]\nmax_in_flight = 2\n\n{}",
            accept_rule("local", up)
        )
    })
    .await;
    // With no instance consuming, requests wait in the pool. Stopped cleanly, so its
    // heartbeat, which lists p1, is gone and `pools remove` does not refuse p1 as
    // still run (a killed instance's stays 20 s).
    c.services[0].terminate();
    assert!(
        c.services[0].wait_exit(EXIT).await.is_some(),
        "{}",
        c.services[0].logs()
    );
    let nats = c.nats.url();
    let mut replies = c
        .nats
        .client()
        .await
        .subscribe("webproxy.reply.*")
        .await
        .expect("subscribe");
    for _ in 0..3 {
        c.client
            .submit(&to("p1", &envelope("GET", &c.upstream.url("/echo"))))
            .await
            .expect("submit");
    }

    let listed = webproxy(&["pools", "--nats", &nats, "--json"]).await;
    assert!(listed.status.success(), "{listed:?}");
    let pools: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("json");
    let p1 = pools
        .as_array()
        .and_then(|a| a.iter().find(|p| p["pool"] == "p1"))
        .unwrap_or_else(|| panic!("p1 not listed: {pools}"));
    assert_eq!(p1["max_in_flight"], 2);
    assert_eq!(p1["waiting"], 3);
    assert_eq!(p1["in_flight"], 0);
    assert!(p1["oldest_waiting_ms"].is_u64(), "{p1}");
    assert!(
        pools
            .as_array()
            .is_some_and(|a| a.iter().any(|p| p["pool"] == "default"))
    );

    // The table: a header, then a pool a line, the names where POOL starts and each
    // number ending where its header ends.
    let table = webproxy(&["pools", "--nats", &nats]).await;
    assert!(table.status.success(), "{table:?}");
    let text = String::from_utf8_lossy(&table.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let header = lines[0];
    assert_eq!(
        header.split_whitespace().collect::<Vec<_>>(),
        [
            "POOL",
            "MAX_IN_FLIGHT",
            "WAITING",
            "IN_FLIGHT",
            "PARKED",
            "OLDEST_WAITING"
        ],
        "{text}"
    );
    let p1 = lines
        .iter()
        .find(|line| line.starts_with("p1 "))
        .unwrap_or_else(|| panic!("no row for p1: {text}"));
    // Where each of the first `n` words of `line` ends.
    let ends = |line: &str, n: usize| -> Vec<usize> {
        let mut ends = Vec::new();
        let mut previous = ' ';
        for (at, c) in line.char_indices() {
            if c == ' ' && previous != ' ' {
                ends.push(at);
            }
            previous = c;
        }
        ends.truncate(n);
        ends
    };
    assert_eq!(
        p1.split_whitespace().take(5).collect::<Vec<_>>(),
        ["p1", "2", "3", "0", "0"],
        "{text}"
    );
    assert_eq!(ends(p1, 5)[1..], ends(header, 5)[1..], "{text}");
    // The oldest wait, in human units, ends the line where its header does.
    assert_eq!(p1.len(), header.len(), "{text}");
    assert!(p1.trim_end().ends_with('s'), "{text}");

    let refused = webproxy(&["pools", "remove", "p1", "--nats", &nats]).await;
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("3 messages"),
        "{refused:?}"
    );

    let removed = webproxy(&["pools", "remove", "p1", "--dead-letter", "--nats", &nats]).await;
    assert!(removed.status.success(), "{removed:?}");
    for _ in 0..3 {
        let message = next_message(
            &mut replies,
            REPLY_TIMEOUT,
            "a reply for each waiting request",
        )
        .await;
        let reply: Reply = serde_json::from_slice(&message.payload).expect("reply");
        assert_eq!(reply.outcome, Outcome::Error);
        assert_eq!(reply.error.map(|e| e.code), Some(ErrorCode::Internal));
    }
    let js = async_nats::jetstream::new(c.nats.client().await);
    // `pools remove` leaves the pool's dead-letter stream, with its letters.
    assert_eq!(webproxy_tests::dead_letter_count(&js).await, Some(3));

    let result = c
        .client
        .submit(&to("p1", &envelope("GET", &c.upstream.url("/echo"))))
        .await;
    assert!(
        matches!(result, Err(ClientError::NoSuchPool { .. })),
        "{result:?}"
    );
    let default_refused = webproxy(&["pools", "remove", "default", "--nats", &nats]).await;
    assert!(!default_refused.status.success());
}

/// A new `max_in_flight` updates the consumer in place: same consumer, nothing lost.
/// The first instance stops cleanly, ending its lease of the consumers' settings, so
/// the second takes it at once and writes its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_the_limit_updates_the_consumer_in_place() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let config = |limit: u32| {
        format!(
            "[pools.default]\nmax_in_flight = {limit}\n\n{}",
            accept_rule("local", &upstream)
        )
    };
    let mut first = Service::start(&nats, &config(2)).await;
    let js = async_nats::jetstream::new(nats.client().await);
    let stream = js
        .get_stream("WEBPROXY_POOL_DEFAULT")
        .await
        .expect("pool stream");
    let before = stream
        .consumer_info("webproxy-default-l3")
        .await
        .expect("consumer");
    assert_eq!(before.config.max_ack_pending, 2);
    first.terminate();
    assert!(first.wait_exit(Duration::from_secs(30)).await.is_some());

    let client = Client::new(nats.client().await, "webproxy").expect("client");
    let waiting: Vec<_> = (0..3)
        .map(|_| envelope("GET", &upstream.url("/echo")))
        .collect();
    let mut submitted = Vec::new();
    for request in &waiting {
        submitted.push(
            client
                .submit(&to("default", request))
                .await
                .expect("submit"),
        );
    }
    let second = Service::start(&nats, &config(5)).await;
    webproxy_tests::wait_until(
        Duration::from_secs(20),
        "the new limit on the consumer",
        || async {
            stream
                .consumer_info("webproxy-default-l3")
                .await
                .is_ok_and(|info| info.config.max_ack_pending == 5)
        },
    )
    .await;
    let after = stream
        .consumer_info("webproxy-default-l3")
        .await
        .expect("consumer");
    assert_eq!(after.created, before.created, "the consumer was recreated");
    assert!(
        second.logs().contains("pool consumer brought in line"),
        "no log of the update:\n{}",
        second.logs()
    );
    for submitted in &submitted {
        let reply = stored_reply(&client, &submitted.id, &submitted.origin, REPLY_TIMEOUT).await;
        assert_eq!(reply.status, Some(200));
    }
}

/// Issue 29, point 8: the lease is confirmed by compare-and-set just before each
/// consumer write. The holder is held (a test hook) after its round checked the lease
/// and before it brings back a limit changed by hand; another holder takes the lease
/// meanwhile. Released, the old holder writes nothing: the consumer keeps the limit
/// set by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_that_lost_its_lease_writes_no_consumer() {
    let nats = NatsServer::start();
    let upstream = Upstream::start().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let switch = dir.path().join("owner-wait");
    let service = Service::start_with(
        &nats.url(),
        &format!(
            "[pools.default]\nmax_in_flight = 2\n\n{}",
            accept_rule("local", &upstream)
        ),
        ServiceOptions::default().env(
            "WEBPROXY_TEST_OWNER_WAIT",
            switch.to_str().expect("a UTF-8 path"),
        ),
    )
    .await;
    let owner = || async { service.metric("webproxy_pool_consumers_owner").await };
    wait_until(Duration::from_secs(20), "the lease taken", || async {
        owner().await == Some(1.0)
    })
    .await;

    let js = async_nats::jetstream::new(nats.client().await);
    let stream = js
        .get_stream("WEBPROXY_POOL_DEFAULT")
        .await
        .expect("pool stream");
    let consumer = || async {
        stream
            .consumer_info("webproxy-default-l3")
            .await
            .expect("consumer")
            .config
            .clone()
    };
    let mut by_hand = consumer().await;
    assert_eq!(by_hand.max_ack_pending, 2);
    std::fs::write(&switch, b"wait").expect("hold the owner before its writes");
    by_hand.max_ack_pending = 7;
    stream
        .update_consumer(by_hand)
        .await
        .expect("the limit changed by hand");
    wait_until(
        Duration::from_secs(20),
        "the owner held before bringing the limit back",
        || async {
            service
                .logs()
                .contains("test hook owner-wait: waiting before a pool consumer write")
        },
    )
    .await;

    // Another holder takes the lease, as one would after this holder's key expired.
    js.get_key_value("WEBPROXY_INSTANCES")
        .await
        .expect("instances bucket")
        .put("lease.pool-consumers", "another-pod".into())
        .await
        .expect("the lease taken by another holder");
    std::fs::remove_file(&switch).expect("release the owner");
    wait_until(Duration::from_secs(20), "the lease given up", || async {
        owner().await == Some(0.0)
    })
    .await;
    assert_eq!(consumer().await.max_ack_pending, 7, "{}", service.logs());
    assert!(
        service
            .logs()
            .contains("not writing the pool consumer: the lease is no longer this instance's"),
        "{}",
        service.logs()
    );
}

/// Issue 31: `pools pause`, `resume` and `remove` refuse a pool whose stream does not
/// exist, naming it and the command that lists the pools, rather than reporting a
/// pause that holds nothing or a raw JetStream error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_resume_and_remove_refuse_a_pool_that_does_not_exist() {
    let c = cluster(1, |up| accept_rule("local", up)).await;
    let nats = c.nats.url();
    for command in ["pause", "resume", "remove"] {
        let refused = webproxy(&["pools", command, "nosuch", "--nats", &nats]).await;
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(!refused.status.success(), "{command}: {refused:?}");
        assert!(
            stderr.contains("no pool nosuch") && stderr.contains("`webproxy pools`"),
            "{command}: {stderr}"
        );
    }
}

/// `pools remove`'s refusal, waiting out the instances' first heartbeats.
async fn refused_remove(nats: &str, pool: &str, naming: &str) -> String {
    webproxy_tests::wait_for(
        Duration::from_secs(10),
        "pools remove refused naming where the pool is still run",
        || async move {
            let refused = webproxy(&["pools", "remove", pool, "--nats", nats]).await;
            let stderr = String::from_utf8_lossy(&refused.stderr).into_owned();
            (!refused.status.success() && stderr.contains(naming)).then_some(stderr)
        },
    )
    .await
}

/// Issue 31: `pools remove` refuses a pool the running configuration still has in kv
/// mode (the bucket's document names it): removed, every later request for it would
/// be answered `internal: no stream stores ...` and nothing would recreate it. Taken
/// out of the document first, it is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_refuses_a_pool_the_kv_document_still_has() {
    let c = cluster(1, |up| {
        kv_config(&format!(
            "[outbound]\nallow_private_networks = true\n\n[pools.p1]\n\n{}",
            accept_rule("local", up)
        ))
    })
    .await;
    let nats = c.nats.url();
    let refused = refused_remove(&nats, "p1", "revision 1 of WEBPROXY_CONFIG has [pools.p1]").await;
    assert!(refused.contains("config push"), "{refused}");
    assert!(refused.contains("live instances running it"), "{refused}");
    // The pool still serves.
    let reply = c
        .client
        .request(&to("p1", &envelope("GET", &c.upstream.url("/echo"))).wait(REPLY_TIMEOUT))
        .await
        .expect("a reply from p1");
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");

    push_config(
        &c.nats,
        &format!(
            "[outbound]\nallow_private_networks = true\n\n{}",
            accept_rule("local", &c.upstream)
        ),
    )
    .await;
    // The heartbeat says the new revision's pools at once on the change.
    webproxy_tests::wait_until(Duration::from_secs(10), "p1 removed", || {
        let nats = &nats;
        async move {
            webproxy(&["pools", "remove", "p1", "--nats", nats])
                .await
                .status
                .success()
        }
    })
    .await;
}

/// Issue 31: `pools remove` refuses a pool that a live instance in file mode runs
/// (its heartbeat lists its pools), naming the instance; once it stopped, the pool
/// is removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_refuses_a_pool_a_file_mode_instance_still_runs() {
    let mut c = cluster(1, |up| {
        format!("[pools.p1]\n\n{}", accept_rule("local", up))
    })
    .await;
    let nats = c.nats.url();
    let named = format!("-{}", c.services[0].pid());
    let refused = refused_remove(&nats, "p1", &named).await;
    assert!(
        refused.contains("pool p1 is still in the running configuration"),
        "{refused}"
    );
    c.services[0].terminate();
    assert!(c.services[0].wait_exit(EXIT).await.is_some());
    let removed = webproxy(&["pools", "remove", "p1", "--nats", &nats]).await;
    assert!(removed.status.success(), "{removed:?}");
}
