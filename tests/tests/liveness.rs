//! Liveness (issue 14's "Done when"): back within seconds of a NATS fault, never
//! acting on a stale delivery. Real `webproxy serve` processes against a real
//! nats-server, with loopback upstreams; a TCP relay on loopback stalls one
//! instance's connection.
//!
//! Time bounds are generous (a loaded 2-core CI machine runs several of these at
//! once) and documented where they are set; the figures measured are printed.

use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer};
use webproxy_client::Client;
use webproxy_protocol::Subjects;
use webproxy_tests::caller::{Harness, accept_rule, envelope, stored_reply, to};
use webproxy_tests::recovery::{Killed, Load, OUTAGE, restart_under_load};
use webproxy_tests::{
    Gate, NatsServer, Relay, Service, Upstream, default_routes, run_webproxy, wait_for, wait_until,
};

/// How long a conversation may take in these tests, faults included.
const ANSWER: Duration = Duration::from_secs(60);

/// `[service] ack_wait`, one pool `default` of `max_in_flight` and a rule that accepts
/// `upstream`, with an attempt timeout far beyond any gate a test holds.
fn config(upstream: &Upstream, ack_wait: &str, max_in_flight: u32) -> String {
    format!(
        "[service]\nack_wait = \"{ack_wait}\"\n\n[pools.default]\nmax_in_flight = {max_in_flight}\n\n{}timeout = \"60s\"\n",
        accept_rule("local", upstream)
    )
}

async fn gated_upstream(gate: &Gate) -> Upstream {
    Upstream::start_with(default_routes().merge(gate.routes())).await
}

/// The pool consumer's state, or `None` while it (or its stream) is missing.
async fn pool_consumer(js: &jetstream::Context, pool: &str) -> Option<consumer::Info> {
    let subjects = Subjects::new("webproxy").expect("prefix");
    let stream = js.get_stream(subjects.pool_stream(pool)).await.ok()?;
    stream
        .consumer_info(subjects.pool_consumer(pool))
        .await
        .ok()
}

/// Runs issue 14's scenario (`restart_under_load`: 100 conversations waiting on pool
/// `default` of `limit`, each upstream call `upstream_ms` long, nats-server killed as
/// `killed` says and started again after [`OUTAGE`]) and
/// asserts that every conversation is answered, the last within `bound` of the
/// server's return, and that the pool's limit held. Prints the figure measured.
async fn recovers_from_a_restart_within(
    limit: usize,
    upstream_ms: u64,
    killed: Killed,
    bound: Duration,
) {
    let mut nats = NatsServer::start();
    let gate = Gate::new();
    let upstream = gated_upstream(&gate).await;
    let service = Service::start(
        &nats,
        &format!(
            "[pools.default]\nmax_in_flight = {limit}\n\n{}",
            accept_rule("local", &upstream)
        ),
    )
    .await;
    let client = Client::new(nats.quick_client().await, "webproxy").expect("client");
    let load = Load {
        pool: "default",
        count: 100,
        limit,
        upstream_ms,
        killed,
    };
    let recovery = restart_under_load(&mut nats, &client, &upstream, &gate, load).await;
    println!(
        "recovery after NATS restart ({OUTAGE:?} outage, killed {killed:?}, 100 conversations, limit {limit}, upstream {upstream_ms} ms): last answer {:.2} s after the server was back",
        recovery.last_answer.as_secs_f64()
    );
    assert!(
        recovery.failed.is_empty(),
        "{} conversations failed: {:?}\n{}",
        recovery.failed.len(),
        recovery.failed.iter().take(5).collect::<Vec<_>>(),
        service.logs()
    );
    assert!(
        recovery.last_answer <= bound,
        "the last answer came {:?} after the restart, beyond {bound:?}\n{}",
        recovery.last_answer,
        service.logs()
    );
    assert!(
        upstream.max_concurrent() <= limit,
        "the pool's limit broke: {}",
        upstream.max_concurrent()
    );
}

/// The issue's black-box run: 100 conversations waiting on a pool of 16 (upstream
/// 50 ms, the default `ack_wait` of 15 s), nats-server killed while 16 attempts are at
/// the upstream and started again after a 3 s outage. Every conversation is answered,
/// the last one within 10 s of the server's return (generous: it took 13.8 s before
/// issue 14, and about a second is expected now).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiting_conversation_is_answered_within_seconds_of_a_nats_restart() {
    recovers_from_a_restart_within(16, 50, Killed::AtTheGate, Duration::from_secs(10)).await;
}

/// Issue 29, point 12 (table item 10): 100 conversations in flight on a pool of 10, a
/// 100 ms upstream, nats-server killed mid-load and started again after a 3 s outage;
/// every conversation is answered within 3 s of the server's return, the issue's own
/// bound. Killed twice over, each time with its own server and instance: while the 10
/// attempts are held at the upstream (each handler then publishes its reply into the
/// outage, and 90 conversations are left), and with the load flowing after 40 calls
/// (a publish or an ack may be on the wire when the connection drops).
///
/// What the figure is made of: the reconnect backoff (the dispatcher's `consuming/connect.rs`, at most 1 s,
/// so 0 to 1 s depending on where the server's return falls in it), then the work left
/// (90 or 60 conversations, 10 at a time, 100 ms each: 0.9 or 0.6 s). Measured on the
/// shared 2-core machine over 9 runs, alone and 5 in a row with `--test faults`
/// running beside it: 1.63 to 1.76 s at the gate, 1.26 to 1.43 s mid-flow. Issue 29
/// reported 4.2 s, which this scenario did not reproduce on today's code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_waiting_conversation_is_answered_within_3_s_of_a_nats_restart() {
    for killed in [Killed::AtTheGate, Killed::MidFlow { calls: 40 }] {
        recovers_from_a_restart_within(10, 100, killed, Duration::from_secs(3)).await;
    }
}

/// A pool consumer deleted by hand is recreated by the running instance within
/// seconds (15 s is generous: it is noticed at the pull in flight, at once), counted
/// in `webproxy_consumer_recreations_total`, and the instance is ready and serving
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pool_consumer_is_recreated_and_counted() {
    let h = Harness::start(|up| config(up, "15s", 4)).await;
    let recreations = r#"webproxy_consumer_recreations_total{pool="default"}"#;
    let before = pool_consumer(&h.js, "default")
        .await
        .expect("the pool consumer");
    let stream =
        h.js.get_stream(h.subjects.pool_stream("default"))
            .await
            .expect("pool stream");
    stream
        .delete_consumer(&h.subjects.pool_consumer("default"))
        .await
        .expect("delete the pool consumer");
    let deleted = Instant::now();

    let recreated = wait_for(
        Duration::from_secs(15),
        "the pool consumer to be recreated",
        || async {
            pool_consumer(&h.js, "default")
                .await
                .filter(|info| info.created != before.created)
        },
    )
    .await;
    println!(
        "pool consumer recreated {:.2} s after it was deleted",
        deleted.elapsed().as_secs_f64()
    );
    assert_eq!(recreated.config.max_ack_pending, 4, "{recreated:?}");
    assert_eq!(
        recreated.config.ack_wait,
        Duration::from_secs(15),
        "{recreated:?}"
    );
    wait_until(
        Duration::from_secs(15),
        "the recreation to be counted",
        || async {
            h.service
                .metric(recreations)
                .await
                .is_some_and(|n| n >= 1.0)
        },
    )
    .await;
    h.service.wait_ready(Duration::from_secs(15)).await;
    let reply = h.request(&envelope("GET", &h.upstream.url("/echo"))).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
}

/// `pools remove --force` on a pool that a running instance still has in its config
/// (without `--force` it is refused, issue 31): the instance notices its consumer is
/// gone but does not recreate it (the stream is marked `removing`, then deleted), nor
/// the stream; it stays alive, serves its other pools, and stays not ready, since a
/// pool of its config has no consumer: the operator's cue to take the pool out of the
/// config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_removed_with_pools_remove_stays_removed() {
    let h =
        Harness::start(|up| format!("[pools.p1]\nmax_in_flight = 2\n\n{}", config(up, "15s", 4)))
            .await;
    let refused = run_webproxy(&["pools", "remove", "p1", "--nats", &h.nats.url()]).await;
    assert!(!refused.status.success(), "{refused:?}");
    let removed =
        run_webproxy(&["pools", "remove", "p1", "--force", "--nats", &h.nats.url()]).await;
    assert!(removed.status.success(), "{removed:?}");

    wait_until(
        Duration::from_secs(15),
        "the instance to try recreating p1's consumer, and be refused",
        || async {
            h.service
                .logs()
                .lines()
                .any(|l| l.contains("cannot recreate the pool's consumer") && l.contains("p1"))
        },
    )
    .await;
    let stream = h.subjects.pool_stream("p1");
    let p1_recreations = r#"webproxy_consumer_recreations_total{pool="p1"}"#;
    let http = webproxy_tests::http_client();
    let status = |path: &'static str| {
        let url = format!("{}{path}", h.service.health_url());
        let http = http.clone();
        async move { http.get(url).send().await.map(|r| r.status().as_u16()).ok() }
    };
    // Nothing happens for a while: 6 s spans several of the pull loop's retries (its
    // backoff grows by 100 ms per failure). Checked over and over, not slept through.
    let watch_until = Instant::now() + Duration::from_secs(6);
    let mut checks = 0;
    while Instant::now() < watch_until {
        assert!(
            h.js.get_stream(&stream).await.is_err(),
            "stream {stream} is back\n{}",
            h.service.logs()
        );
        assert_eq!(status("/readyz").await, Some(503), "ready without p1");
        assert_eq!(status("/healthz").await, Some(200), "p1's pull loop died");
        assert!(
            h.service
                .metric(p1_recreations)
                .await
                .is_none_or(|n| n == 0.0),
            "p1's consumer was recreated"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(checks >= 5, "only {checks} checks in 6 s");
    // The other pool is served all along.
    let reply = h.request(&envelope("GET", &h.upstream.url("/echo"))).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
}

/// A stalled connection (no RST, no FIN) after the upstream answered instance A,
/// while A's handler publishes. With `ack_wait` 2 s the server redelivers the message
/// to instance B, whose copy is held at the upstream. When the relay resumes, A's
/// delivery is stale: A stores what it produced (deduplicated) but does not ack, so
/// the slot stays with B's copy, and the second request, queued behind the pool's
/// limit of one, starts only once B's copy has finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_delivery_does_not_ack_and_the_limit_holds() {
    let nats = NatsServer::start();
    let gate = Gate::new();
    let upstream = gated_upstream(&gate).await;
    let relay = Relay::start(SocketAddr::from((Ipv4Addr::LOCALHOST, nats.port()))).await;
    let config = config(&upstream, "2s", 1);
    let a = Service::start_with_url(&relay.nats_url(), &config).await;
    let nats_client = nats.client().await;
    let js = jetstream::new(nats_client.clone());
    let client = Client::new(nats_client, "webproxy").expect("client");

    let first = envelope("GET", &upstream.url("/gated/0"));
    let first_answer = tokio::spawn({
        let (client, request) = (client.clone(), to("default", &first).wait(ANSWER));
        async move { client.request(&request).await }
    });
    wait_until(
        Duration::from_secs(20),
        "A's attempt at the upstream",
        || async { upstream.hits_for("/gated/0") == 1 },
    )
    .await;
    relay.pause();
    // A gets its response and publishes the reply into the stalled connection.
    gate.pass(1);
    let second = client
        .submit(&to("default", &envelope("GET", &upstream.url("/echo"))))
        .await
        .expect("submit the second request");
    let b = Service::start(&nats, &config).await;

    // A's progress acks are stalled: after ack_wait the server redelivers (perhaps to
    // A's own stalled pull first, then, another ack_wait later, to B).
    wait_until(
        Duration::from_secs(30),
        "the redelivered copy at the upstream",
        || async { upstream.hits_for("/gated/0") == 2 },
    )
    .await;
    relay.resume();
    let a_logged = |what: &str| {
        a.logs()
            .lines()
            .any(|line| line.contains(what) && line.contains(&first.id))
    };
    // Logged once the reply is stored, just before the ack would be sent.
    wait_until(
        Duration::from_secs(30),
        "A to finish its stale delivery",
        || async { a_logged("conversation finished") },
    )
    .await;
    // B's copy holds the only slot: had A acked, the second request would be delivered
    // at once (both instances have a pull waiting). 3 s, checked over and over.
    let watch_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < watch_until {
        let info = pool_consumer(&js, "default").await.expect("pool consumer");
        assert_eq!(
            (info.num_ack_pending, info.num_pending),
            (1, 1),
            "the slot was freed while B's copy runs: {info:?}\n--- A ---\n{}\n--- B ---\n{}",
            a.logs(),
            b.logs()
        );
        assert_eq!(upstream.hits_for("/echo"), 0, "the second request started");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        a_logged("leaving it unacked"),
        "A did not say it left its stale delivery unacked\n{}",
        a.logs()
    );

    let released = Instant::now();
    gate.pass(1);
    let reply = first_answer
        .await
        .expect("the first request's task")
        .unwrap_or_else(|e| panic!("no answer for the first request: {e}\n{}", b.logs()));
    assert_eq!(reply.status, Some(200), "{reply:?}");
    let reply = stored_reply(&client, &second.id, &second.origin, ANSWER).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    let started = upstream.hit_times("/echo");
    assert_eq!(started.len(), 1, "the second request ran {started:?}");
    assert!(
        started[0] >= released,
        "the second request started before the first's copy finished"
    );
    assert_eq!(upstream.hits_for("/gated/0"), 2, "a third copy ran");
    assert_eq!(upstream.max_concurrent(), 1, "the pool's limit broke");
    wait_until(ANSWER, "nothing pending on the pool", || async {
        pool_consumer(&js, "default")
            .await
            .is_some_and(|i| i.num_ack_pending == 0 && i.num_pending == 0)
    })
    .await;
}

/// With the consumer's `max_ack_pending` raised by hand to 3 above the instance's one
/// local permit, a message delivered while the permit is taken waits for it, kept by
/// progress acks: with `ack_wait` 1 s and attempts of 4 s, each waits over 3x
/// `ack_wait` and none is redelivered. Takes about 12 s (three 4 s attempts in turn).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waiting_for_a_permit_is_kept_not_redelivered() {
    let h = Harness::start(|up| config(up, "1s", 1)).await;
    let stream =
        h.js.get_stream(h.subjects.pool_stream("default"))
            .await
            .expect("pool stream");
    let mut raised = pool_consumer(&h.js, "default")
        .await
        .expect("pool consumer")
        .config;
    raised.max_ack_pending = 3;
    stream
        .update_consumer(raised)
        .await
        .expect("raise max_ack_pending");

    let paths = ["/delay/4000", "/delay/4001", "/delay/4002"];
    let mut submitted = Vec::new();
    for path in paths {
        let request = envelope("GET", &h.upstream.url(path));
        submitted.push(
            h.client
                .submit(&to("default", &request))
                .await
                .expect("submit"),
        );
    }
    // At least one message beyond the one attempted is delivered and waits for the
    // permit (a pull may bring both others at once). ANSWER, not a tighter bound: a
    // loaded machine once took over 10 s to get here (starting the service, three
    // submits, the first delivery), which says nothing about what is tested. The
    // owner's round (every 5 s) brings the consumer back in line with the configured
    // limit, so the raise is made again whenever it finds it undone before then.
    wait_until(
        ANSWER,
        "a message delivered while the permit is taken",
        || async {
            let Some(info) = pool_consumer(&h.js, "default").await else {
                return false;
            };
            if info.num_ack_pending >= 2 {
                return true;
            }
            if info.config.max_ack_pending < 3 {
                let mut raised = info.config.clone();
                raised.max_ack_pending = 3;
                let _ = stream.update_consumer(raised).await;
            }
            false
        },
    )
    .await;
    // The server forgets a message's redeliveries once it is acked, so they are
    // watched all along, and the deliveries are counted at the end.
    let deadline = Instant::now() + ANSWER;
    let info = loop {
        let info = pool_consumer(&h.js, "default")
            .await
            .expect("pool consumer");
        assert_eq!(
            info.num_redelivered,
            0,
            "redelivered: {info:?}\n{}",
            h.service.logs()
        );
        if info.num_pending == 0 && info.num_ack_pending == 0 {
            break info;
        }
        assert!(
            Instant::now() < deadline,
            "not done after {ANSWER:?}: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        info.delivered.consumer_sequence, 3,
        "deliveries of 3 messages: {info:?}"
    );
    for submitted in &submitted {
        let reply = stored_reply(&h.client, &submitted.id, &submitted.origin, ANSWER).await;
        assert_eq!(reply.status, Some(200), "{reply:?}");
    }
    for path in paths {
        assert_eq!(h.upstream.hits_for(path), 1, "{path} was attempted again");
    }
    assert_eq!(h.upstream.max_concurrent(), 1, "the local permit broke");
    // Each message after the first waited for the permit through a whole attempt.
    let starts: Vec<Instant> = paths.iter().map(|p| h.upstream.hit_times(p)[0]).collect();
    for pair in starts.windows(2) {
        let waited = pair[1].duration_since(pair[0]);
        assert!(
            waited >= Duration::from_secs(3),
            "started {waited:?} after the one before"
        );
    }
}
