//! What each feature does in a running cell: its load, what lets its conversations go
//! after the fault, what must still hold of them (the gateway's records, the large
//! bodies: `large.rs`, the cancels: `cancel.rs`), how it is shown to work again, and
//! the check of its limits.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::task::JoinHandle;
use webproxy_client::Submitted;
use webproxy_protocol::Outcome;
use webproxy_tests::rate::busiest_window;
use webproxy_tests::{run_webproxy, wait_for, wait_until};

use crate::cell::Cell;
use crate::fault::Fault;
use crate::feature::{ACK_WAIT, BURST, Feature, POOL, RATE};
use crate::observe::{ANSWERED, Stored, wait_answered};
use crate::upstream::slow_body;
use crate::{cancel, large};

/// How long a feature may take to show it works again once its conversations are
/// answered: a fresh conversation, a breaker's open-and-close, a push. Generous for a
/// loaded machine; each feature's own stated time is asserted where it has one.
const WORKS_AGAIN: Duration = Duration::from_secs(60);

/// How long a paused pool is watched for a call that must not come: the pause reaches
/// the consumer in well under a second, and a delivery to a pod takes milliseconds.
const WATCH_PAUSED: Duration = Duration::from_secs(3);

/// How long `config push --wait` may take: docs/configuration.md's 5 s for every instance to run a
/// revision, plus the command's own start on a loaded machine.
const PUSH_APPLIED: Duration = Duration::from_secs(15);

/// What runs while the fault is injected.
pub enum During {
    Nothing,
    /// [`Feature::Replay`]'s `dead replay`.
    Replay(JoinHandle<std::process::Output>),
    /// [`Feature::Gateway`]'s load repeated, each with its key, held by the gateway
    /// through the fault for its reply.
    Held(Vec<JoinHandle<Held>>),
}

/// A request of the gateway's load held through the fault: its number, the id its
/// record names, and the gateway's answer.
pub struct Held {
    n: usize,
    id: String,
    answer: Option<Keyed>,
}

/// A gateway's answer to a keyed request: status, `Webproxy-Id` and body.
#[derive(Debug, PartialEq, Eq)]
pub struct Keyed {
    status: u16,
    id: String,
    body: String,
}

impl Feature {
    /// Sends the load and returns once it is where the fault should hit it.
    pub async fn load(self, cell: &Cell) -> Vec<Submitted> {
        match self {
            Feature::Paused => {
                cell.webproxy_ok(&["pools", "pause", POOL]).await;
                wait_until(ANSWERED, "the pool consumer paused", || async {
                    pool_consumer_paused(cell).await
                })
                .await;
            }
            Feature::Breaker | Feature::Replay => cell.upstream.mend(false),
            _ => {}
        }
        if self == Feature::Large {
            return large::load(cell).await;
        }
        let mut conversations = Vec::new();
        for n in 0..self.count() {
            conversations.push(match self {
                Feature::Gateway => recorded(cell, n).await,
                _ => cell.submit(self.sent_to(), &self.path(n)).await,
            });
        }
        match self {
            Feature::Paused => {}
            Feature::Breaker => breaker_open(cell).await,
            Feature::Parked => {
                wait_until(ANSWERED, "every conversation parked once", || async {
                    cell.upstream.hits() >= self.count()
                })
                .await;
            }
            Feature::Replay => {
                wait_answered(
                    &cell.client,
                    &conversations,
                    |r| r.outcome == Outcome::Error,
                    || cell.logs(),
                )
                .await;
                cell.upstream.mend(true);
            }
            Feature::Cancel => {
                wait_until(ANSWERED, "the load held, instance 0 holding some", || {
                    cancel::under_way(cell)
                })
                .await;
            }
            _ => {
                wait_until(ANSWERED, "the load under way", || async {
                    cell.upstream.hits() >= 3
                })
                .await;
            }
        }
        conversations
    }

    /// What runs while the fault is injected: `dead replay` for [`Feature::Replay`];
    /// for [`Feature::Gateway`], each request of the load sent again with its key and
    /// held by the gateway, which joins it to the recorded conversation; it returns
    /// once each is held or answered already, so that the fault comes while the
    /// gateway holds those still going. For [`Feature::Cancel`], the cancels: the
    /// fault follows the last one's answer.
    pub async fn during(self, cell: &Cell, conversations: &[Submitted]) -> During {
        match self {
            Feature::Cancel => {
                cancel::cancel(cell, conversations).await;
                During::Nothing
            }
            Feature::Replay => {
                let urls = cell.nats.urls();
                During::Replay(tokio::spawn(async move {
                    run_webproxy(&["dead", "replay", "--yes", "--pool", POOL, "--nats", &urls])
                        .await
                }))
            }
            Feature::Gateway => {
                let done = Arc::new(AtomicUsize::new(0));
                let held = conversations
                    .iter()
                    .enumerate()
                    .map(|(n, conversation)| {
                        let request = cell.keyed_request(&key(n), &self.path(n), false);
                        let id = conversation.id.clone();
                        let done = done.clone();
                        tokio::spawn(async move {
                            let answer = match request.send().await {
                                Ok(response) => keyed_of(response).await,
                                Err(_) => None,
                            };
                            done.fetch_add(1, Ordering::SeqCst);
                            Held { n, id, answer }
                        })
                    })
                    .collect();
                let gateway = cell.gateway.as_ref().expect("a gateway cell");
                // A request leaves the gauge before its answer reaches the caller, so
                // the sum counts none twice.
                wait_until(ANSWERED, "the gateway holding the load", || async {
                    gateway
                        .metric("webproxy_gateway_waiting")
                        .await
                        .is_some_and(|waiting| {
                            waiting + done.load(Ordering::SeqCst) as f64
                                >= conversations.len() as f64
                        })
                })
                .await;
                During::Held(held)
            }
            _ => During::Nothing,
        }
    }

    /// Lets the load's conversations go once the fault is over.
    pub async fn let_go(self, cell: &Cell, during: During) {
        match self {
            Feature::Paused => {
                // A lost POOL_STATE forgets the pause (ARCHITECTURE's cluster state).
                if cell.fault != Fault::Deleted {
                    stays_unvisited(cell, WATCH_PAUSED).await;
                }
                retry_command(cell, &["pools", "resume", POOL]).await;
            }
            Feature::Breaker => cell.upstream.mend(true),
            Feature::Cancel => cancel::let_go(cell).await,
            Feature::Gateway => {
                if let During::Held(held) = during {
                    held_answers(cell, held).await;
                }
            }
            Feature::Replay => {
                if let During::Replay(during) = during {
                    let _ = during.await;
                }
                // A replay the fault cut short is run again, as an operator would: the
                // letters it replayed are skipped, the rest replayed.
                retry_command(cell, &["dead", "replay", "--yes", "--pool", POOL]).await;
            }
            _ => {}
        }
    }

    /// What must still hold of the load's answered conversations after the fault: for
    /// [`Feature::Gateway`], the record of each; for [`Feature::Large`], each body
    /// whole and the body store holding nothing else ([`large::kept`]); for
    /// [`Feature::Cancel`], each ending and the cancels bucket ([`cancel::kept`]).
    pub async fn kept(self, cell: &Cell, conversations: &[Submitted], stored: &[Stored]) {
        match self {
            Feature::Gateway => records_kept(cell, conversations, stored).await,
            Feature::Large => large::kept(cell, conversations, stored).await,
            Feature::Cancel => cancel::kept(cell, conversations, stored).await,
            _ => {}
        }
    }

    /// Shows, after the fault, that the feature does its job again.
    pub async fn works_again(self, cell: &Cell) {
        match self {
            Feature::Paused => {
                cell.webproxy_ok(&["pools", "pause", POOL]).await;
                wait_until(WORKS_AGAIN, "the pool consumer paused again", || async {
                    pool_consumer_paused(cell).await
                })
                .await;
                let fresh = fresh(cell, "/delay/100").await;
                stays_unvisited(cell, WATCH_PAUSED).await;
                cell.webproxy_ok(&["pools", "resume", POOL]).await;
                answered_200(cell, &[fresh]).await;
            }
            Feature::Breaker => {
                cell.upstream.mend(false);
                let mut again = Vec::new();
                for n in 0..self.count() {
                    again.push(cell.submit(POOL, &format!("/mend/again-{n}")).await);
                }
                breaker_open(cell).await;
                cell.upstream.mend(true);
                answered_200(cell, &again).await;
            }
            Feature::Parked => {
                let fresh = fresh(cell, "/flaky/again").await;
                let stored = answered_200(cell, &[fresh]).await;
                assert_eq!(stored[0].json["attempts"], 2, "{:?}", stored[0].json);
            }
            Feature::Replay => replays_once(cell).await,
            Feature::Config => {
                let lower = self.document(&cell.upstream, ACK_WAIT, 1);
                let started = Instant::now();
                cell.push(&lower).await;
                let took = started.elapsed();
                assert!(took <= PUSH_APPLIED, "config push --wait took {took:?}");
                let fresh = fresh(cell, "/delay/100").await;
                answered_200(cell, &[fresh]).await;
            }
            Feature::Adaptive => {
                let fresh = fresh(cell, "/delay/100").await;
                answered_200(cell, &[fresh]).await;
                let series = format!("webproxy_pool_effective_limit{{pool=\"{POOL}\"}}");
                wait_until(WORKS_AGAIN, "an adaptive limit reported", || async {
                    for service in &cell.services {
                        if service
                            .metric(&series)
                            .await
                            .is_some_and(|limit| limit >= 1.0)
                        {
                            return true;
                        }
                    }
                    false
                })
                .await;
            }
            Feature::Gateway => {
                let path = "/slow/again";
                let first = wait_for(WORKS_AGAIN, "a new keyed request answered", || async {
                    keyed(cell, "matrix-again", path, false)
                        .await
                        .filter(|a| a.status == 200)
                })
                .await;
                assert_eq!(first.body, slow_body("again"));
                // Read until the test's own client reads the bucket again after the
                // fault; a record the gateway never wrote is never found.
                let recorded = tokio::time::timeout(WORKS_AGAIN, async {
                    loop {
                        if cell.gateway_record(&first.id).await.is_some() {
                            return;
                        }
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                })
                .await;
                assert!(
                    recorded.is_ok(),
                    "the new keyed request {} was not recorded\n{}",
                    first.id,
                    cell.logs()
                );
                let again = keyed(cell, "matrix-again", path, false).await;
                assert_eq!(again.as_ref(), Some(&first), "its repeat");
                assert_eq!(
                    cell.upstream.hits_for(path),
                    1,
                    "the repeat called the upstream"
                );
            }
            Feature::Plain | Feature::Rate | Feature::Moved => {
                let fresh = fresh(cell, &self.path(0)).await;
                answered_200(cell, &[fresh]).await;
            }
            Feature::Large => {
                // A body of its own length, one past the load's.
                let n = self.count();
                let fresh = fresh(cell, &self.path(n)).await;
                let stored = answered_200(cell, std::slice::from_ref(&fresh)).await;
                large::assert_whole(cell, n, &fresh, &stored[0]).await;
            }
            Feature::Cancel => {
                // Released: a conversation not cancelled is answered at once.
                let fresh = fresh(cell, "/hold/again").await;
                answered_200(cell, &[fresh]).await;
                cancel::works_again(cell, WORKS_AGAIN).await;
            }
        }
    }

    /// The pool's limits over the whole cell: never more than `max_in_flight` calls at
    /// once, and for [`Feature::Rate`] never more than its rate (with the 10% and the
    /// burst the dispatcher's `pool/limiter.rs` allows, and what a lost schedule allows) in any 1 s window.
    pub fn assert_limits(self, cell: &Cell) {
        let at_once = cell.upstream.max_concurrent();
        assert!(
            at_once <= self.max_in_flight() as usize,
            "{at_once} calls at once in a pool of {}:\n{}\n{}",
            self.max_in_flight(),
            cell.upstream.busiest_calls().join("\n"),
            cell.logs()
        );
        if self == Feature::Rate {
            let times = cell.upstream.hit_times(&self.path(0));
            let busiest = busiest_window(&times, Duration::from_secs(1));
            // A fault that loses the schedule (ARCHITECTURE's cluster state, RATE) lets
            // each instance that had not claimed a slot yet start it anew: one burst
            // more per instance, in the second of the loss.
            let anew = match cell.fault {
                Fault::Restart | Fault::Deleted => cell.services.len(),
                _ => 0,
            };
            let limit = f64::from(RATE) * 1.1 + f64::from(BURST) * (1 + anew) as f64;
            let first = times.first().copied();
            let offsets: Vec<u128> = times
                .iter()
                .filter_map(|t| first.map(|f| t.duration_since(f).as_millis()))
                .collect();
            assert!(
                busiest as f64 <= limit,
                "{busiest} calls in one second, limit {limit}; calls at {offsets:?} ms"
            );
        }
    }
}

/// The idempotency key of the gateway load's `n`th request.
fn key(n: usize) -> String {
    format!("matrix-{n}")
}

/// A keyed request of `path` through the gateway: its answer, or `None` when the
/// gateway cannot be reached or answers without an id.
async fn keyed(cell: &Cell, key: &str, path: &str, async_: bool) -> Option<Keyed> {
    keyed_of(cell.keyed(key, path, async_).await?).await
}

/// The gateway load's `n`th request (its key and path).
async fn keyed_answer(cell: &Cell, n: usize, async_: bool) -> Option<Keyed> {
    keyed(cell, &key(n), &Feature::Gateway.path(n), async_).await
}

async fn keyed_of(response: reqwest::Response) -> Option<Keyed> {
    let status = response.status().as_u16();
    let id = response
        .headers()
        .get("webproxy-id")?
        .to_str()
        .ok()?
        .to_string();
    let body = response.text().await.ok()?;
    Some(Keyed { status, id, body })
}

/// What must still hold of the gateway's records after the fault: for each, the
/// gateway's API gives the stored reply, and the request repeated with its key is
/// answered with the same id and reply and calls the upstream no more.
async fn records_kept(cell: &Cell, conversations: &[Submitted], stored: &[Stored]) {
    for (n, (conversation, stored)) in conversations.iter().zip(stored).enumerate() {
        let expected = Keyed {
            status: 200,
            id: conversation.id.clone(),
            body: slow_body(&n.to_string()),
        };
        assert_eq!(
            stored.json["body"].as_str(),
            Some(expected.body.as_str()),
            "the stored reply of request {n}"
        );
        let calls = cell.upstream.hits_for(&Feature::Gateway.path(n));
        let api = cell.gateway_reply(&conversation.id).await;
        let api = match api {
            Some(response) => keyed_of(response).await,
            None => None,
        };
        assert_eq!(
            api.as_ref().map(|a| (a.status, a.body.as_str())),
            Some((200, expected.body.as_str())),
            "/_webproxy/replies/{} after the fault\n{}",
            conversation.id,
            cell.logs()
        );
        let repeated = keyed_answer(cell, n, false).await;
        assert_eq!(
            repeated.as_ref(),
            Some(&expected),
            "request {n} repeated with its key after the fault\n{}",
            cell.logs()
        );
        assert_eq!(
            cell.upstream.hits_for(&Feature::Gateway.path(n)),
            calls,
            "request {n} repeated with its key called the upstream again"
        );
    }
}

/// The gateway load's `n`th request, sent with `Prefer: respond-async` until it is
/// answered 202 (its id recorded), and the conversation its record names.
async fn recorded(cell: &Cell, n: usize) -> Submitted {
    let accepted = wait_for(ANSWERED, &format!("request {n} recorded"), || async {
        keyed_answer(cell, n, true)
            .await
            .filter(|a| a.status == 202)
    })
    .await;
    wait_for(ANSWERED, &format!("request {n}'s record"), || {
        cell.gateway_record(&accepted.id)
    })
    .await
}

/// The load's requests the gateway held through the fault: each answered with its
/// own id and its reply, or 202 if its wait ran out first (the conversation goes on).
/// Never another conversation's id or another body, and never a 503: a lookup that
/// fails while NATS recovers does not end a wait that has time left.
async fn held_answers(cell: &Cell, held: Vec<JoinHandle<Held>>) {
    let mut statuses = BTreeMap::<u16, usize>::new();
    for task in held {
        let Held { n, id, answer } = task.await.expect("a held request");
        let answer = answer.unwrap_or_else(|| {
            panic!(
                "held request {n}: the gateway gave no answer with an id\n{}",
                cell.logs()
            )
        });
        assert_eq!(answer.id, id, "held request {n}'s id");
        match answer.status {
            200 => assert_eq!(answer.body, slow_body(&n.to_string()), "held request {n}"),
            202 => {}
            other => panic!(
                "held request {n} answered {other}: {}\n{}",
                answer.body,
                cell.logs()
            ),
        }
        *statuses.entry(answer.status).or_default() += 1;
    }
    println!("the requests held through the fault were answered {statuses:?} (status: count)");
}

/// A conversation sent after the fault, to the feature's pool.
async fn fresh(cell: &Cell, path: &str) -> Submitted {
    cell.submit(cell.feature.sent_to(), path).await
}

/// Waits for `conversations` to be answered 200 (generation 0) within
/// [`WORKS_AGAIN`]; their stored replies.
async fn answered_200(cell: &Cell, conversations: &[Submitted]) -> Vec<Stored> {
    tokio::time::timeout(
        WORKS_AGAIN,
        wait_answered(
            &cell.client,
            conversations,
            |r| r.generation == "0" && r.status == Some(200),
            || cell.logs(),
        ),
    )
    .await
    .unwrap_or_else(|_| panic!("not answered within {WORKS_AGAIN:?}\n{}", cell.logs()))
}

/// Watches for `watch` that the upstream gets no call.
async fn stays_unvisited(cell: &Cell, watch: Duration) {
    let before = cell.upstream.hits();
    let until = Instant::now() + watch;
    while Instant::now() < until {
        assert_eq!(
            cell.upstream.hits(),
            before,
            "a paused pool called the upstream"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Runs a command until it succeeds: right after a fault the JetStream API may still
/// be electing leaders.
async fn retry_command(cell: &Cell, args: &[&str]) -> String {
    let deadline = Instant::now() + ANSWERED;
    loop {
        match cell.webproxy(args).await {
            Ok(out) => return out,
            Err(e) if Instant::now() > deadline => {
                panic!("still failing after {ANSWERED:?}: {e}\n{}", cell.logs())
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

async fn pool_consumer_paused(cell: &Cell) -> bool {
    let subjects = cell.client.subjects();
    let Ok(stream) = cell.js.get_stream(subjects.pool_stream(POOL)).await else {
        return false;
    };
    stream
        .consumer_info(subjects.pool_consumer(POOL))
        .await
        .is_ok_and(|info| info.paused)
}

/// Waits until `pools` shows the breaker's pause.
async fn breaker_open(cell: &Cell) {
    let shown = |listed: &str| {
        listed
            .lines()
            .any(|line| line.starts_with("partner paused until") && line.contains("(breaker: "))
    };
    let deadline = Instant::now() + WORKS_AGAIN;
    loop {
        let listed = cell.webproxy(&["pools"]).await.unwrap_or_else(|e| e);
        if shown(&listed) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the breaker did not open within {WORKS_AGAIN:?}; pools:\n{listed}\n{}",
            cell.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A letter made after the fault is replayed once: `dead replay --id` answers it as
/// generation 1, and a second `dead replay` says it was replayed already and calls
/// nothing.
async fn replays_once(cell: &Cell) {
    cell.upstream.mend(false);
    let letter = fresh(cell, "/mend/after").await;
    wait_answered(
        &cell.client,
        std::slice::from_ref(&letter),
        |r| r.outcome == Outcome::Error,
        || cell.logs(),
    )
    .await;
    cell.upstream.mend(true);
    let replay = ["dead", "replay", "--yes", "--id", letter.id.as_str()];
    wait_for(WORKS_AGAIN, "the letter to be listed", || async {
        cell.webproxy(&["dead", "list", "--id", &letter.id])
            .await
            .ok()
            .filter(|l| !l.trim().is_empty())
    })
    .await;
    // An operator command reads the dead-letter stream through a consumer of its own,
    // and a read during the fault's leader election can answer 503: it is run again, as
    // an operator would (the service's own reads are what the cell checks).
    retry_command(cell, &replay).await;
    wait_answered(
        &cell.client,
        std::slice::from_ref(&letter),
        |r| Feature::Replay.answered(r),
        || cell.logs(),
    )
    .await;
    let calls = cell.upstream.hits_for("/mend/after");
    let again = retry_command(cell, &replay).await;
    assert!(
        again.contains("already replayed as generation 1"),
        "{again}"
    );
    assert_eq!(
        cell.upstream.hits_for("/mend/after"),
        calls,
        "a second replay called the upstream"
    );
    if cell.fault != Fault::Deleted {
        // Every letter of the load was replayed once: a replay of the pool replays none.
        let all = retry_command(cell, &["dead", "replay", "--yes", "--pool", POOL]).await;
        assert!(all.contains("0 replayed"), "{all}");
    }
}
