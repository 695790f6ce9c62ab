//! Exactly one live reply (issue 29, point 2): a pod that stalled past `ack_wait` and
//! woke after another pod answered its conversation sends no second body, on a single
//! server (which refuses the stale reply with "wrong last sequence") and in a cluster
//! (which answers "duplicate", checking the message id first). Real `webproxy serve`
//! processes against real nats-servers; a TCP relay on loopback stalls instance A's
//! connection the way a SIGSTOPped pod looks to the server (no RST, no FIN).
//!
//! Time bounds are generous (a loaded 2-core CI machine runs several of these at once)
//! and documented where they are set.

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::any;
use bytes::Bytes;
use futures::StreamExt as _;
use webproxy_client::Client;
use webproxy_protocol::Reply;
use webproxy_tests::caller::{accept_rule, envelope, stored_reply, to};
use webproxy_tests::{
    Gate, NatsCluster, NatsServer, Relay, Service, Upstream, run_webproxy, wait_until,
};

/// How long a step of these tests may take, faults included: a redelivery takes one
/// or two `ack_wait`s (2 s) and a loaded machine adds seconds to each.
const STEP: Duration = Duration::from_secs(60);

/// `/calls/{fail_first}`: waits at the gate, then answers `{"call":N}` for the Nth
/// call, with 400 for the first when `fail_first` is 1 (an error under the rule's
/// response rule) and 200 otherwise.
#[derive(Clone)]
struct Calls {
    gate: Gate,
    count: Arc<AtomicUsize>,
}

async fn calls(State(calls): State<Calls>, Path(fail_first): Path<u8>) -> (StatusCode, String) {
    let n = calls.count.fetch_add(1, Ordering::SeqCst) + 1;
    calls.gate.wait().await;
    let status = if fail_first == 1 && n == 1 {
        StatusCode::BAD_REQUEST
    } else {
        StatusCode::OK
    };
    (status, format!("{{\"call\":{n}}}"))
}

/// One pool of one slot, `ack_wait` 2 s, 400 answered as an error with no retry.
fn config(upstream: &Upstream, extra: &str) -> String {
    format!(
        "{extra}[service]\nack_wait = \"2s\"\n\n[pools.default]\nmax_in_flight = 1\n\n{}timeout = \"60s\"\nmax_retries = 0\n[[request_rules.response_rules]]\nstatus = \"400\"\naction = \"error\"\n",
        accept_rule("local", upstream)
    )
}

/// What the conversation's caller saw once instance A woke.
struct Woke {
    id: String,
    /// Every body published on `reply.<id>`, in arrival order.
    live: Vec<Reply>,
    stored: Reply,
    a_logs: String,
}

/// Instance A gets the upstream's first answer and stalls before storing it; the
/// server redelivers to instance B, which gets the second answer and stores it. Then
/// A's connection resumes.
async fn a_stalled_pod_wakes_after_another_answered(
    nats_for_a: SocketAddr,
    nats_for_b: &str,
    observer: async_nats::Client,
    extra_config: &str,
    fail_first: bool,
) -> Woke {
    let gate = Gate::new();
    let calls_route = Calls {
        gate: gate.clone(),
        count: Arc::new(AtomicUsize::new(0)),
    };
    let upstream = Upstream::start_with(
        Router::new()
            .route("/calls/{fail_first}", any(calls))
            .with_state(calls_route),
    )
    .await;
    let path = format!("/calls/{}", u8::from(fail_first));
    let relay = Relay::start(nats_for_a).await;
    let config = config(&upstream, extra_config);
    let a = Service::start_with_url(&relay.nats_url(), &config).await;
    let client = Client::new(observer.clone(), "webproxy").expect("client");

    let request = envelope("GET", &upstream.url(&path));
    let live = Arc::new(Mutex::new(Vec::new()));
    let mut subscription = observer
        .subscribe(format!("webproxy.reply.{}", request.id))
        .await
        .expect("subscribe to the live reply");
    observer.flush().await.expect("flush the subscription");
    tokio::spawn({
        let live = live.clone();
        async move {
            while let Some(message) = subscription.next().await {
                let payload: Bytes = message.payload;
                live.lock().expect("live replies").push(payload);
            }
        }
    });
    let submitted = client
        .submit(&to("default", &request))
        .await
        .expect("submit the request");
    wait_until(STEP, "A's attempt at the upstream", || async {
        upstream.hits_for(&path) == 1
    })
    .await;
    relay.pause();
    // A gets the first answer and publishes into the stalled connection.
    gate.pass(1);
    let b = Service::start_with_url(nats_for_b, &config).await;
    wait_until(STEP, "the redelivered copy at the upstream", || async {
        upstream.hits_for(&path) == 2
    })
    .await;
    gate.pass(1);
    let stored = stored_reply(&client, &submitted.id, &submitted.origin, STEP).await;
    wait_until(STEP, "B's live reply", || async {
        !live.lock().expect("live replies").is_empty()
    })
    .await;

    relay.resume();
    let a_ended = |logs: &str| {
        logs.lines().any(|line| {
            line.contains(&request.id)
                && (line.contains("conversation finished") || line.contains("reply first"))
        })
    };
    wait_until(STEP, "A to end its stale delivery", || async {
        a_ended(&a.logs())
    })
    .await;
    // A core publish A sent just before its log line may still be on its way: watch
    // for 3 s (generous for loopback) that nothing else arrives.
    let watch_until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < watch_until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let live = live
        .lock()
        .expect("live replies")
        .iter()
        .map(|payload| serde_json::from_slice(payload).expect("a live reply"))
        .collect();
    assert_eq!(upstream.hits_for(&path), 2, "a third attempt ran");
    drop(b);
    Woke {
        id: request.id.clone(),
        live,
        stored,
        a_logs: a.logs(),
    }
}

fn assert_one_live_body(woke: &Woke) {
    assert!(
        woke.a_logs.contains("reply first"),
        "A did not find B's reply stored first\n{}",
        woke.a_logs
    );
    assert_eq!(
        woke.stored.body.body.as_deref(),
        Some("{\"call\":2}"),
        "B's answer is the stored one: {:?}",
        woke.stored
    );
    for reply in &woke.live {
        assert_eq!(
            (&reply.body.body, reply.status),
            (&woke.stored.body.body, woke.stored.status),
            "reply.{} carried a body other than the stored one: {:?}\n--- A ---\n{}",
            woke.id,
            woke.live,
            woke.a_logs
        );
    }
}

async fn listed_dead_letters(nats: &str, id: &str) -> String {
    let out = run_webproxy(&["dead", "list", "--nats", nats, "--id", id, "--json"]).await;
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The finding 2: `reply.<id>` saw `{"call":2}` from B, then A's `{"call":1}`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_pod_that_wakes_sends_no_second_live_reply() {
    let (_nats, woke) = on_one_server(false).await;
    assert_one_live_body(&woke);
}

/// The scene on one nats-server, which refuses A's stale reply with "wrong last
/// sequence"; the server is returned for what the test reads afterwards.
async fn on_one_server(fail_first: bool) -> (NatsServer, Woke) {
    let nats = NatsServer::start();
    let target = SocketAddr::from((Ipv4Addr::LOCALHOST, nats.port()));
    let woke = a_stalled_pod_wakes_after_another_answered(
        target,
        &nats.url(),
        nats.client().await,
        "",
        fail_first,
    )
    .await;
    (nats, woke)
}

/// In a cluster the stale reply is answered "duplicate" rather than "wrong last
/// sequence"; A still sends nothing of its own. A reaches the cluster through node 0,
/// B and the observer through every node; the streams have 3 replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_a_cluster_a_stalled_pod_that_wakes_sends_no_second_live_reply() {
    let cluster = NatsCluster::start(3);
    let target = SocketAddr::from((Ipv4Addr::LOCALHOST, cluster.nodes[0].port()));
    let urls = cluster.urls();
    let observer = async_nats::connect(urls.split(',').collect::<Vec<_>>())
        .await
        .expect("connect");
    let woke = a_stalled_pod_wakes_after_another_answered(
        target,
        &urls,
        observer,
        "[streams]\nreplicas = 3\n\n",
        false,
    )
    .await;
    assert_one_live_body(&woke);
}

/// A stalled pod whose attempt failed stores its dead letter before its reply; B
/// answered with a response meanwhile, so the letter is marked superseded and `dead
/// list` does not show it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_pods_dead_letter_is_superseded_by_the_answer() {
    let (nats, woke) = on_one_server(true).await;
    assert_one_live_body(&woke);
    assert!(
        woke.a_logs.contains("dead letter superseded"),
        "A did not supersede its dead letter\n{}",
        woke.a_logs
    );
    let listed = listed_dead_letters(&nats.url(), &woke.id).await;
    let letters: Vec<serde_json::Value> = serde_json::from_str(&listed).expect("one JSON array");
    assert!(
        letters.is_empty(),
        "dead list shows a superseded letter: {listed}"
    );
}
