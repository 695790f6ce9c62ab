//! Hostile callers, lost acks and oversized payloads against the conversation core
//! (issue 12's "Done when"): the real `webproxy serve` against a real nats-server with
//! deploy/nats/authorization.conf's users and permissions, every caller connected as
//! one of the file's caller users (`caller_a` is the hostile one, `caller_b` its
//! victim). An `admin` user observes what callers cannot: live reply subjects, the
//! replies and dead-letter streams, and the pool consumers.
//!
//! Time bounds are generous for a loaded 2-core CI machine; each says what it covers.
//! `ack_wait` is 2 s wherever a redelivery is part of the story, so it comes quickly.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::consumer;
use async_nats::{HeaderMap, Message};
use axum::Router;
use axum::extract::Path;
use axum::http::StatusCode;
use axum::routing::any;
use futures::{FutureExt as _, StreamExt as _};
use serde_json::{Value, json};
use webproxy_client::new_id;
use webproxy_protocol::header::{GENERATION, HOP, MSG_ID, ORIGIN, OUTCOME, REPLY_TO};
use webproxy_protocol::{ErrorCode, Outcome, Reply};
use webproxy_tests::authorized::{
    Admin, Caller, Origin, SERVICE_USER, first_and_repeats, header, origin_of, service_as,
    stored_msg_id, violation,
};
use webproxy_tests::caller::{REPLY_TIMEOUT, next_message, path_rule};
use webproxy_tests::{NatsServer, Service, ServiceOptions, Upstream, default_routes, wait_until};

/// `ack_wait` wherever a redelivery is part of the test, and the `[service]` table
/// that sets it.
const ACK_WAIT: Duration = Duration::from_secs(2);
const SERVICE: &str = "[service]\nack_wait = \"2s\"\n";

/// How long a test listens for a second final reply after the first: three times
/// `ack_wait`, so a redelivery (one `ack_wait`) and its handling fit with room.
const GRACE: Duration = Duration::from_secs(6);

/// The hop-state header the service used before issue 12, forged here too.
const ATTEMPTS: &str = "Webproxy-Attempts";

/// The upstream: the default routes, and
/// - `ANY /flaky/{tag}/{n}`: 503 for the first `n` calls on that path, then 200 `ok {tag}`;
/// - `ANY /outage/{tag}`: 503 while the returned switch is on, else 200 `ok {tag}`.
async fn upstream() -> (Upstream, Arc<AtomicBool>) {
    let calls: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let outage = Arc::new(AtomicBool::new(false));
    let down = outage.clone();
    let router = Router::new()
        .route(
            "/flaky/{tag}/{n}",
            any(move |Path((tag, n)): Path<(String, usize)>| {
                let calls = calls.clone();
                async move {
                    let seen = {
                        let mut calls = calls.lock().unwrap_or_else(PoisonError::into_inner);
                        let seen = calls.entry(format!("{tag}/{n}")).or_default();
                        *seen += 1;
                        *seen
                    };
                    if seen <= n {
                        (StatusCode::SERVICE_UNAVAILABLE, format!("busy {tag}"))
                    } else {
                        (StatusCode::OK, format!("ok {tag}"))
                    }
                }
            }),
        )
        .route(
            "/outage/{tag}",
            any(move |Path(tag): Path<String>| {
                let down = down.load(Ordering::SeqCst);
                async move {
                    if down {
                        (StatusCode::SERVICE_UNAVAILABLE, format!("down {tag}"))
                    } else {
                        (StatusCode::OK, format!("ok {tag}"))
                    }
                }
            }),
        );
    (
        Upstream::start_with(default_routes().merge(router)).await,
        outage,
    )
}

/// A server with the shipped permissions, the upstream, one service, and the admin.
struct Scene {
    nats: NatsServer,
    upstream: Upstream,
    outage: Arc<AtomicBool>,
    config: String,
    service: Service,
    admin: Admin,
}

impl Scene {
    /// Starts everything; `config` (tables other than `[streams]`, and rules) is
    /// given the upstream. `[streams]` confines `reply_to` to the callers' reply
    /// spaces, as the permissions file expects.
    async fn start(options: ServiceOptions, config: impl FnOnce(&Upstream) -> String) -> Scene {
        let nats = NatsServer::start_authorized();
        let (upstream, outage) = upstream().await;
        let config = format!(
            "[streams]\nreply_to_allow = [\"callers.{{caller}}.replies.>\"]\n\n{}",
            config(&upstream)
        );
        let service = Service::start_with(&nats.url(), &config, options).await;
        let admin = Admin::connect(&nats).await;
        Scene {
            nats,
            upstream,
            outage,
            config,
            service,
            admin,
        }
    }

    /// Another instance on the same server with the same config.
    async fn start_service(&self, options: ServiceOptions) -> Service {
        Service::start_with(&self.nats.url(), &self.config, options).await
    }

    async fn caller(&self, user: &str) -> Caller {
        Caller::connect(&self.nats, user).await
    }

    /// A GET of `path` on the upstream as conversation `id`, answered to `caller`'s
    /// reply space.
    fn request(&self, caller: &Caller, id: &str, path: &str) -> Value {
        json!({
            "id": id,
            "method": "GET",
            "url": self.upstream.url(path),
            "reply_to": caller.reply_to(id),
        })
    }

    /// The pool consumer of `pool`, as the server sees it now.
    async fn pool_consumer(&self, pool: &str) -> consumer::Info {
        let stream = self
            .admin
            .js
            .get_stream_no_info(format!("WEBPROXY_POOL_{}", pool.to_ascii_uppercase()))
            .await
            .expect("pool stream");
        stream
            .consumer_info(format!("webproxy-{pool}-l3"))
            .await
            .expect("pool consumer info")
    }

    /// Waits until the pool consumer has nothing delivered unacked and nothing
    /// waiting: everything published so far has settled.
    async fn wait_settled(&self, pool: &str) {
        wait_until(REPLY_TIMEOUT, &format!("pool {pool} to settle"), || async {
            let info = self.pool_consumer(pool).await;
            info.num_ack_pending == 0 && info.num_pending == 0
        })
        .await;
    }
}

fn reply_of(message: &Message) -> Reply {
    serde_json::from_slice(&message.payload)
        .unwrap_or_else(|e| panic!("not a reply ({e}): {message:?}"))
}

/// Asserts that `message` is a reply of the conversation from `origin`, generation 0.
fn assert_from(message: &Message, origin: &Origin, what: &str) {
    let headers = message.headers.as_ref();
    assert_eq!(
        header(headers, ORIGIN),
        Some(origin.to_string().as_str()),
        "{what}: a reply of another conversation: {message:?}"
    );
    assert_eq!(
        header(headers, GENERATION),
        Some("0"),
        "{what}: {message:?}"
    );
}

/// `message`'s payload as text, for searching.
fn text(message: &Message) -> String {
    String::from_utf8_lossy(&message.payload).into_owned()
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_millis()
}

fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.insert(*name, *value);
    }
    map
}

/// `n` attempt records as the service writes them.
fn attempt_records(n: usize) -> Vec<Value> {
    (0..n)
        .map(|_| json!({"at": "2026-01-01T00:00:00Z", "status": 503, "duration_ms": 1}))
        .collect()
}

/// A `Webproxy-Hop` value in the service's own format (a JSON hop state).
fn hop_state(origin: &str, generation: u64, step: u32, kept: usize, dropped: u32) -> String {
    json!({
        "origin": origin,
        "generation": generation,
        "step": step,
        "first_published_ms": 0,
        "due_ms": unix_ms(),
        "attempts": {"kept": attempt_records(kept), "dropped": dropped},
    })
    .to_string()
}

/// Hop state a caller forges on its request: the service's hop header in its own
/// format, and every `Webproxy-*` header the service used before issue 12, naming the
/// victim's origin wherever one fits.
fn forged_hop_headers(victim: &Origin, reply_to: &str) -> Vec<(&'static str, HeaderMap)> {
    let victim = victim.to_string();
    let one_attempt = Value::from(attempt_records(1)).to_string();
    let now = unix_ms().to_string();
    vec![
        (
            "a later generation with history",
            headers(&[
                (HOP, &hop_state(&victim, 9, 1, 1, 0)),
                (GENERATION, "9"),
                (ORIGIN, &victim),
                (ATTEMPTS, &one_attempt),
                ("Webproxy-First-Published", "0"),
                ("Webproxy-Due", &now),
                (REPLY_TO, reply_to),
                (OUTCOME, "response"),
            ]),
        ),
        (
            "the victim's own generation, one step on",
            headers(&[
                (HOP, &hop_state(&victim, 0, 1, 0, 0)),
                (GENERATION, "0"),
                (ORIGIN, &victim),
                (ATTEMPTS, "[]"),
                ("Webproxy-First-Published", &now),
            ]),
        ),
        (
            "a replay of the victim",
            headers(&[
                (HOP, &hop_state(&victim, 1, 0, 0, 0)),
                (GENERATION, "1"),
                (ORIGIN, &victim),
            ]),
        ),
        (
            "malformed hop state",
            headers(&[
                (HOP, "{"),
                (GENERATION, "x"),
                (ORIGIN, "nonsense"),
                (ATTEMPTS, "{"),
                ("Webproxy-First-Published", "-1"),
            ]),
        ),
    ]
}

/// Point 1: a caller with forged `Webproxy-*` headers, or with a redelivered envelope
/// naming another conversation's id, cannot get that conversation's reply on its own
/// `reply_to`, cannot replace its stored reply, and cannot change its own retry budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_hop_state_and_redelivery_cannot_steal_replace_or_stretch() {
    let options = service_as(SERVICE_USER);
    let mut scene = Scene::start(options.clone(), |up| {
        format!(
            "{SERVICE}\n{}max_retries = 1\nretry_delay = \"200ms\"\ntimeout = \"30s\"\n",
            path_rule("local", up, "/")
        )
    })
    .await;
    let victim = scene.caller("caller_b").await;
    let hostile = scene.caller("caller_a").await;

    // The victim's conversation: answered, and stored under its origin.
    let id = new_id();
    let secret = new_id();
    let (victim_origin, mut victim_inbox) = victim
        .send(
            "default",
            &scene.request(&victim, &id, &format!("/echo?secret={secret}")),
        )
        .await;
    let answer = next_message(&mut victim_inbox, REPLY_TIMEOUT, "the victim's reply").await;
    assert_from(&answer, &victim_origin, "the victim's reply");
    assert_eq!(reply_of(&answer).status, Some(200), "{answer:?}");
    assert!(text(&answer).contains(&secret), "{answer:?}");
    let stored = scene
        .admin
        .wait_stored_replies(&id, &victim_origin, REPLY_TIMEOUT)
        .await;
    assert_eq!(stored.len(), 1, "{stored:?}");
    let stored = stored.into_iter().next().expect("one stored reply");

    // Everything that reaches the hostile caller's reply space from here on.
    let mut loot = hostile
        .nats
        .subscribe(hostile.reply_to(">"))
        .await
        .expect("subscribe");
    let steal = hostile.reply_to("steal");
    let hostile_envelope = |path: &str| {
        json!({"id": id, "method": "GET", "url": scene.upstream.url(path), "reply_to": steal})
            .to_string()
    };

    // Forged hop state on the caller's subject, naming the victim's id and origin.
    let forgeries = forged_hop_headers(&victim_origin, &steal);
    let mut own = BTreeMap::new();
    for (i, (what, forged)) in forgeries.iter().enumerate() {
        let ack = hostile
            .publish(
                "default",
                &new_id(),
                forged,
                hostile_envelope(&format!("/echo?forged={i}")),
            )
            .await;
        own.insert(origin_of(&ack).to_string(), (i, *what));
    }
    // Each is a conversation of its own: answered once, from its own origin, with its
    // own attempt.
    for _ in 0..forgeries.len() {
        let message = next_message(&mut loot, REPLY_TIMEOUT, "a reply to a forged request").await;
        let from = header(message.headers.as_ref(), ORIGIN).unwrap_or_default();
        let Some((i, what)) = own.remove(from) else {
            panic!(
                "the hostile caller got a reply it did not cause (origin {from:?}; victim \
                 {victim_origin}): {message:?}\n{}",
                scene.service.logs()
            );
        };
        assert!(!text(&message).contains(&secret), "{what}: {message:?}");
        assert!(
            text(&message).contains(&format!("forged={i}")),
            "{what}: not its own attempt: {message:?}"
        );
        assert_eq!(
            header(message.headers.as_ref(), GENERATION),
            Some("0"),
            "{what}"
        );
        assert_eq!(message.subject.as_str(), steal, "{what}");
    }
    scene.wait_settled("default").await;
    hostile.nats.flush().await.expect("flush");
    if let Some(Some(extra)) = loot.next().now_or_never() {
        panic!("a second reply for a forged request: {extra:?}");
    }

    // A redelivered envelope naming the victim's id, forged headers and all: the
    // instance attempting it dies mid-attempt, and another gets it again (delivered 2)
    // `ack_wait` later.
    let slow = "/delay/3000";
    let ack = hostile
        .publish(
            "default",
            &new_id(),
            &forgeries[0].1,
            hostile_envelope(slow),
        )
        .await;
    let redelivered = origin_of(&ack);
    wait_until(REPLY_TIMEOUT, "the slow attempt to start", || async {
        scene.upstream.hits_for(slow) == 1
    })
    .await;
    scene.service.kill();
    scene.service = scene.start_service(options.clone()).await;
    // ack_wait, a restart and the 3 s attempt, with room.
    let message = next_message(
        &mut loot,
        Duration::from_secs(40),
        "the reply to the redelivered request",
    )
    .await;
    assert_from(&message, &redelivered, "the redelivered request");
    assert!(!text(&message).contains(&secret), "{message:?}");
    assert_eq!(reply_of(&message).status, Some(200), "{message:?}");
    assert_eq!(
        scene.upstream.hits_for(slow),
        2,
        "the redelivered request was answered without an attempt of its own"
    );

    // The victim's stored reply is the one it had, and nothing more reached the victim.
    let after = scene.admin.stored_replies(&id, &victim_origin).await;
    assert_eq!(after.len(), 1, "the victim's stored replies: {after:?}");
    assert_eq!(after[0].sequence, stored.sequence);
    assert_eq!(after[0].payload, stored.payload);
    assert_eq!(header(Some(&after[0].headers), GENERATION), Some("0"));
    let victim_origin_text = victim_origin.to_string();
    let claimed = scene
        .admin
        .messages_where(&format!("{}_REPLIES", victim_origin.stream), |m| {
            header(Some(&m.headers), ORIGIN) == Some(victim_origin_text.as_str())
        })
        .await;
    assert_eq!(
        claimed.len(),
        1,
        "stored replies claiming the victim's origin: {claimed:?}"
    );
    victim.nats.flush().await.expect("flush");
    if let Some(Some(extra)) = victim_inbox.next().now_or_never() {
        panic!("the victim got a second reply: {extra:?}");
    }

    // The retry budget is the rule's (1 + max_retries = 2 attempts), whatever the
    // request's headers say about earlier attempts.
    // The origins named: the one the first of these publishes will get (the next
    // sequence of the pool's stream), or the victim's.
    let probe = hostile
        .publish(
            "default",
            &new_id(),
            &HeaderMap::new(),
            hostile_envelope("/echo?probe"),
        )
        .await;
    let next = Origin::new(probe.stream.clone(), probe.sequence + 1).to_string();
    let victim_text = victim_origin.to_string();
    let five = Value::from(attempt_records(5)).to_string();
    let budgets = [
        (
            "five attempts already made",
            headers(&[
                (HOP, &hop_state(&next, 0, 0, 5, 0)),
                (ATTEMPTS, &five),
                (GENERATION, "0"),
            ]),
        ),
        (
            "a thousand attempts left out of the history",
            headers(&[(HOP, &hop_state(&next, 0, 3, 0, 1000))]),
        ),
        (
            "the victim's state in a later generation",
            headers(&[
                (HOP, &hop_state(&victim_text, 3, 9, 5, 0)),
                (ATTEMPTS, "[]"),
                (GENERATION, "3"),
            ]),
        ),
        (
            "a malformed history",
            headers(&[(HOP, "not json"), (ATTEMPTS, "not json")]),
        ),
    ];
    for (i, (what, forged)) in budgets.iter().enumerate() {
        let budget_id = new_id();
        let path = format!("/flaky/budget{i}/1000");
        let (origin, mut inbox) = hostile
            .send_with(
                "default",
                &scene.request(&hostile, &budget_id, &path),
                forged,
            )
            .await;
        let replies = first_and_repeats(
            &mut inbox,
            REPLY_TIMEOUT,
            Duration::from_secs(2),
            &format!("the final reply with {what}"),
        )
        .await;
        assert_eq!(replies.len(), 1, "{what}: {replies:?}");
        assert_from(&replies[0], &origin, what);
        let reply = reply_of(&replies[0]);
        assert_eq!(
            reply.error.as_ref().map(|e| e.code),
            Some(ErrorCode::RetriesExhausted),
            "{what}: {reply:?}"
        );
        assert_eq!(reply.attempts, 2, "{what}: {reply:?}");
        assert_eq!(scene.upstream.hits_for(&path), 2, "{what}");
    }
}

/// Random tokens a caller might guess.
const GUESSED_TOKENS: [&str; 3] = [
    "00000000000000000000000000000000",
    "00000000000000000000000000000001",
    "ffffffffffffffffffffffffffffffff",
];

/// Message ids a caller can fill in without knowing the victim's origin: the id
/// forms of the contract with guessed tokens, the forms before issue 12, and the
/// envelope id (which clients used to send as their message id).
fn ids_without_origin(id: &str, pools: &[&str]) -> Vec<String> {
    let mut ids = vec![id.to_owned()];
    for token in GUESSED_TOKENS {
        for kind in ["park", "due", "move", "replay"] {
            ids.push(format!("{kind}:{token}"));
        }
    }
    for generation in 0..=1 {
        for hop in ["park:1", "due:1", "reply", "dead"] {
            ids.push(format!("{id}:{generation}:{hop}"));
        }
        for pool in pools {
            ids.push(format!("{id}:{generation}:to:{pool}"));
        }
    }
    ids
}

/// Message ids naming the victim's origin: the reply and dead-letter forms, the
/// progress record's key, and tokens a careless implementation might derive from it.
fn ids_with_origin(origin: &Origin) -> Vec<String> {
    let mut ids = vec![origin.to_string(), origin.record_key(0)];
    for generation in 0..=1 {
        ids.push(stored_msg_id(origin, generation, "reply"));
        ids.push(stored_msg_id(origin, generation, "dead"));
    }
    for token in [
        format!("{:032x}", origin.seq),
        format!("{:032}", origin.seq),
    ] {
        for kind in ["park", "due", "move", "replay"] {
            ids.push(format!("{kind}:{token}"));
        }
    }
    ids
}

/// Point 2: a caller that pre-publishes into the pool streams (on
/// `webproxy.request.<pool>`, which callers may publish) every message-id form the
/// contract documents, filled in for a victim as far as a caller can know it, cannot
/// stop the victim's retried or moved conversation from ending normally.
///
/// The moved conversation needs a second pool, which the file's `webproxy` user may
/// serve without a change (its account's JetStream API is all its own). The hostile
/// caller has exactly the file's `caller_a` permissions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepublished_message_ids_cannot_stop_a_retried_or_moved_conversation() {
    let scene = Scene::start(service_as(SERVICE_USER), |up| {
        let retry = "max_retries = 2\nretry_delay = \"500ms\"\nbackoff_factor = 1.0\n";
        format!(
            "{SERVICE}\n[pools.p1]\nmax_in_flight = 4\n\n\
             {}pool = \"p1\"\n{retry}\n{}{retry}",
            path_rule("moved", up, "/flaky/moved-"),
            path_rule("local", up, "/"),
        )
    })
    .await;
    let victim = scene.caller("caller_b").await;
    let mut hostile = scene.caller("caller_a").await;

    // The service's own subjects are closed to callers.
    for subject in [
        format!("webproxy.hop.default.{}", GUESSED_TOKENS[0]),
        format!("webproxy.retry.default.{}", GUESSED_TOKENS[0]),
        format!("webproxy.hop.p1.{}", GUESSED_TOKENS[0]),
    ] {
        hostile
            .nats
            .publish(subject.clone(), "{}".into())
            .await
            .expect("publish");
        violation(&mut hostile.errors, &subject, REPLY_TIMEOUT).await;
    }

    let pools = ["default", "p1"];
    for (case, tag) in [("retried", "retried-victim"), ("moved", "moved-victim")] {
        let id = new_id();
        // What a decoy asks for: answered at once, in the pool it was published to
        // (so that nothing the service publishes meanwhile takes a sequence of the
        // default pool's stream).
        let decoy = |pool: &str| {
            let path = if pool == "p1" {
                "/flaky/moved-decoy/0"
            } else {
                "/echo?decoy"
            };
            json!({
                "id": id,
                "method": "GET",
                "url": scene.upstream.url(path),
                "reply_to": hostile.reply_to("decoys"),
            })
            .to_string()
        };
        let none = HeaderMap::new();
        for pool in pools {
            for msg_id in ids_without_origin(&id, &pools) {
                hostile.publish(pool, &msg_id, &none, decoy(pool)).await;
            }
        }
        // The victim's origin is predictable: the next sequence of the default pool's
        // stream after the hostile caller's own publishes.
        let probe = hostile
            .publish("default", &new_id(), &none, decoy("default"))
            .await;
        let naming = ids_with_origin(&Origin::new(probe.stream.clone(), 1)).len() as u64;
        let predicted = Origin::new(probe.stream.clone(), probe.sequence + naming + 1);
        for msg_id in ids_with_origin(&predicted) {
            let ack = hostile
                .publish("default", &msg_id, &none, decoy("default"))
                .await;
            assert!(!ack.duplicate, "{case}: {msg_id} was taken already");
            let p1 = hostile.publish("p1", &msg_id, &none, decoy("p1")).await;
            assert!(!p1.duplicate, "{case}: {msg_id} was taken already in p1");
        }

        let path = format!("/flaky/{tag}/1");
        let (origin, mut inbox) = victim
            .send("default", &scene.request(&victim, &id, &path))
            .await;
        assert_eq!(
            origin, predicted,
            "{case}: the victim's origin was not the predicted one, so the hostile \
             ids did not name it"
        );
        // One failed attempt, a 500 ms wait, a move for the moved one: seconds.
        let replies = first_and_repeats(
            &mut inbox,
            Duration::from_secs(30),
            Duration::from_secs(3),
            &format!("the {case} victim's final reply"),
        )
        .await;
        assert_eq!(replies.len(), 1, "{case}: {replies:?}");
        assert_from(&replies[0], &origin, case);
        let reply = reply_of(&replies[0]);
        assert_eq!(reply.outcome, Outcome::Response, "{case}: {reply:?}");
        assert_eq!(reply.status, Some(200), "{case}: {reply:?}");
        assert_eq!(reply.attempts, 2, "{case}: {reply:?}");
        assert_eq!(scene.upstream.hits_for(&path), 2, "{case}");
        let stored = scene
            .admin
            .wait_stored_replies(&id, &origin, REPLY_TIMEOUT)
            .await;
        assert_eq!(stored.len(), 1, "{case}: {stored:?}");
        assert_eq!(stored[0].payload, replies[0].payload, "{case}");
        for pool in pools {
            scene.wait_settled(pool).await;
        }
    }
}

/// Point 3: a 600 KB envelope whose error text would exceed `max_payload` (a field of
/// 300,000 `"` characters, which JSON escapes once in the envelope and an error text
/// quoting it would escape again) gets exactly one reply and one dead letter within
/// 20 s, and the pool, with `max_in_flight = 1`, answers the next request within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_envelope_whose_error_outgrows_max_payload_is_answered_once_and_frees_its_pool() {
    let scene = Scene::start(service_as(SERVICE_USER), |up| {
        format!(
            "[pools.default]\nmax_in_flight = 1\n\n{}",
            path_rule("local", up, "/")
        )
    })
    .await;
    let hostile = scene.caller("caller_a").await;
    let quotes = "\"".repeat(300_000);
    for field in ["method", "url"] {
        let id = new_id();
        let mut envelope = scene.request(&hostile, &id, "/echo");
        envelope[field] = Value::String(quotes.clone());
        let size = envelope.to_string().len();
        assert!(size > 600_000, "{field}: only {size} bytes");

        let started = Instant::now();
        let (origin, mut inbox) = hostile.send("default", &envelope).await;
        // The next request, queued right behind it in a pool of one.
        let next = new_id();
        let (next_origin, mut next_inbox) = hostile
            .send("default", &scene.request(&hostile, &next, "/echo"))
            .await;
        let answer = next_message(
            &mut next_inbox,
            Duration::from_secs(5),
            &format!("the reply to the request behind the {field} one"),
        )
        .await;
        assert_from(&answer, &next_origin, "the next request");
        assert_eq!(reply_of(&answer).status, Some(200), "{answer:?}");

        let within = Duration::from_secs(20).saturating_sub(started.elapsed());
        let replies = first_and_repeats(
            &mut inbox,
            within,
            Duration::from_secs(3),
            &format!("the reply to the {size}-byte {field}"),
        )
        .await;
        assert_eq!(replies.len(), 1, "{field}: {} replies", replies.len());
        assert_from(&replies[0], &origin, field);
        let reply = reply_of(&replies[0]);
        assert_eq!(reply.outcome, Outcome::Error, "{field}");
        let error = reply.error.expect("an error reply");
        assert_eq!(error.code, ErrorCode::InvalidRequest, "{field}: {error:?}");
        let within = Duration::from_secs(20).saturating_sub(started.elapsed());
        scene.admin.wait_dead_letters(&origin, within).await;
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "{field}: answered and dead-lettered after {:?}",
            started.elapsed()
        );
        let letters = scene.admin.dead_letters(&origin).await;
        assert_eq!(letters.len(), 1, "{field}: {} dead letters", letters.len());
        let stored = scene.admin.stored_replies(&id, &origin).await;
        assert_eq!(stored.len(), 1, "{field}: {} stored replies", stored.len());
    }
}

/// Point 4: with `max_waiting = 2` and an upstream that answers 503 (retried), the
/// pool does not deadlock (every conversation keeps being attempted) and recovers when
/// the upstream does (every conversation gets its final reply), and the service's CPU
/// time over the outage stays under 20 % of one core.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_max_waiting_survives_an_outage_without_deadlock_or_spinning() {
    let scene = Scene::start(service_as(SERVICE_USER), |up| {
        format!(
            "{SERVICE}\n[pools.default]\nmax_in_flight = 2\nmax_waiting = 2\n\n\
             {}max_retries = 1000\nretry_delay = \"500ms\"\nbackoff_factor = 1.0\ntimeout = \"10s\"\n",
            path_rule("local", up, "/")
        )
    })
    .await;
    let mut pool = scene
        .admin
        .js
        .get_stream("WEBPROXY_POOL_DEFAULT")
        .await
        .expect("pool stream");
    let limit = pool
        .info()
        .await
        .expect("pool stream info")
        .config
        .max_messages_per_subject;
    assert_eq!(limit, 2, "max_waiting is not the request subject's limit");
    let caller = scene.caller("caller_b").await;
    scene.outage.store(true, Ordering::SeqCst);
    let outage_started = Instant::now();
    let cpu_before = scene.service.cpu_time();

    // Six conversations for two slots and two places in the queue: publishes the
    // full queue refuses are retried, as a caller would.
    let mut conversations = Vec::new();
    for i in 0..6 {
        let id = new_id();
        let path = format!("/outage/c{i}");
        let (origin, inbox) = caller
            .send("default", &scene.request(&caller, &id, &path))
            .await;
        conversations.push((path, origin, inbox));
    }
    // At least 8 s of outage, in which every conversation keeps being retried: a
    // deadlocked pool stops attempting. 60 s is far more than 8 s and 4 attempts
    // 500 ms apart need.
    wait_until(
        Duration::from_secs(60),
        "8 s of outage with every conversation attempted 4 times",
        || async {
            outage_started.elapsed() >= Duration::from_secs(8)
                && conversations
                    .iter()
                    .all(|(path, _, _)| scene.upstream.hits_for(path) >= 4)
        },
    )
    .await;
    let cpu = scene.service.cpu_time().saturating_sub(cpu_before);
    let outage = outage_started.elapsed();
    scene.outage.store(false, Ordering::SeqCst);

    for (path, origin, inbox) in &mut conversations {
        // The next retry is at most 500 ms away; 30 s covers a loaded machine.
        let replies = first_and_repeats(
            inbox,
            Duration::from_secs(30),
            Duration::from_secs(1),
            &format!("the final reply for {path} after the outage"),
        )
        .await;
        assert_eq!(replies.len(), 1, "{path}: {replies:?}");
        assert_from(&replies[0], origin, path);
        let reply = reply_of(&replies[0]);
        assert_eq!(reply.status, Some(200), "{path}: {reply:?}");
        assert!(reply.attempts >= 4, "{path}: {reply:?}");
    }
    let share = cpu.as_secs_f64() / outage.as_secs_f64();
    println!(
        "outage of {outage:?}: {cpu:?} of service CPU ({:.1} % of one core)",
        share * 100.0
    );
    assert!(
        share < 0.2,
        "the service used {cpu:?} of CPU in a {outage:?} outage ({:.1} % of one core)",
        share * 100.0
    );
}

/// Point 5: a park whose ack is lost (`WEBPROXY_TEST_HOOK=lose-park-ack`: the delivery
/// that parked is not acked and comes back `ack_wait` later) starts no second attempt
/// line: the upstream sees at most `1 + max_retries` attempts, and the caller gets one
/// final reply. Both orders are covered: the retry falls due before the lost ack
/// shows (500 ms < `ack_wait`), and after it (3 s > `ack_wait`).
///
/// About 16 s: the slowest conversation's four attempts are 3 s apart, and every
/// conversation is then watched for 6 s (three times `ack_wait`) for a second reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_park_whose_ack_is_lost_starts_no_second_attempt_line() {
    let scene = Scene::start(
        service_as(SERVICE_USER).env("WEBPROXY_TEST_HOOK", "lose-park-ack"),
        |up| {
            let retries = "max_retries = 3\nbackoff_factor = 1.0\ntimeout = \"10s\"\n";
            format!(
                "{SERVICE}\n{}retry_delay = \"3s\"\n{retries}\n{}retry_delay = \"500ms\"\n{retries}",
                path_rule("slow", up, "/flaky/slow-"),
                path_rule("fast", up, "/"),
            )
        },
    )
    .await;
    assert!(ACK_WAIT < Duration::from_secs(3) && ACK_WAIT > Duration::from_millis(500));
    let caller = scene.caller("caller_a").await;
    let max_retries = 3;
    let cases = [
        ("due first, recovers", "/flaky/fast-up/2", Some(200), 3),
        ("lost ack first, recovers", "/flaky/slow-up/2", Some(200), 3),
        ("due first, exhausted", "/flaky/fast-down/100", None, 4),
        ("lost ack first, exhausted", "/flaky/slow-down/100", None, 4),
    ];
    let mut running = Vec::new();
    for (what, path, status, attempts) in cases {
        let id = new_id();
        let live = scene.admin.subscribe(format!("webproxy.reply.{id}")).await;
        let (origin, inbox) = caller
            .send("default", &scene.request(&caller, &id, path))
            .await;
        running.push((what, path, status, attempts, origin, live, inbox));
    }
    let scene = &scene;
    let outcomes = futures::future::join_all(running.into_iter().map(
        |(what, path, status, attempts, origin, mut live, mut inbox)| async move {
            // Four attempts 3 s apart and a lost ack's redelivery: 40 s is plenty.
            let live_what = format!("{what}: a live reply");
            let copy_what = format!("{what}: a reply_to copy");
            let within = Duration::from_secs(40);
            let (live, copies) = tokio::join!(
                first_and_repeats(&mut live, within, GRACE, &live_what),
                first_and_repeats(&mut inbox, within, GRACE, &copy_what),
            );
            (what, path, status, attempts, origin, live, copies)
        },
    ))
    .await;
    // Every case is checked before anything fails, so a failure tells the whole story.
    let mut attempted = 0;
    let mut problems = Vec::new();
    for (what, path, status, attempts, origin, live, copies) in outcomes {
        let hits = scene.upstream.hits_for(path);
        attempted += hits;
        if hits > 1 + max_retries {
            problems.push(format!(
                "{what}: {hits} attempts, more than 1 + max_retries"
            ));
        }
        if hits != attempts {
            problems.push(format!("{what}: {hits} attempts, not {attempts}"));
        }
        for (name, messages) in [("live replies", &live), ("reply_to copies", &copies)] {
            if messages.len() != 1 {
                let identical = messages.iter().all(|m| m.payload == messages[0].payload);
                problems.push(format!(
                    "{what}: {} {name} within {GRACE:?} of the first (payloads identical: \
                     {identical}); headers: {:?}",
                    messages.len(),
                    messages.iter().map(|m| &m.headers).collect::<Vec<_>>()
                ));
            }
        }
        for message in live.iter().chain(&copies) {
            assert_from(message, &origin, what);
        }
        let reply = reply_of(&live[0]);
        let code = reply.error.map(|e| e.code);
        let expected_code = status.is_none().then_some(ErrorCode::RetriesExhausted);
        if reply.status != status || reply.attempts as usize != attempts || code != expected_code {
            problems.push(format!(
                "{what}: final reply status {:?}, attempts {}, error {code:?}; expected \
                 {status:?}, {attempts}, {expected_code:?}",
                reply.status, reply.attempts
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{}\n--- service log ---\n{}",
        problems.join("\n"),
        scene.service.logs()
    );
    // Each attempt was one delivery of the pool consumer; the hook's lost acks add a
    // redelivery per park. None would mean the hook never ran (a service built
    // without the `test-hooks` feature).
    let deliveries = scene
        .pool_consumer("default")
        .await
        .delivered
        .consumer_sequence;
    assert!(
        deliveries > attempted as u64,
        "{deliveries} deliveries for {attempted} attempts: no ack was lost. Is webproxy \
         built with webproxy-dispatcher's `test-hooks` feature?"
    );
    println!("lose-park-ack: {deliveries} deliveries for {attempted} attempts");
}

/// Point 6: a dead letter survives a crash between it and the reply
/// (`WEBPROXY_TEST_HOOK=exit-after-dead-letter` exits with code 86 right after the
/// dead letter is stored). The next instance answers the conversation exactly once,
/// and the dead letter is still the only one for its origin and generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_survives_a_crash_between_it_and_the_reply() {
    let mut scene = Scene::start(
        service_as(SERVICE_USER).env("WEBPROXY_TEST_HOOK", "exit-after-dead-letter"),
        |up| format!("{SERVICE}\n{}", path_rule("echo", up, "/echo")),
    )
    .await;
    let caller = scene.caller("caller_a").await;
    let id = new_id();
    let live = scene.admin.subscribe(format!("webproxy.reply.{id}")).await;
    // No rule accepts this path: the conversation ends `denied`, with a dead letter.
    let (origin, mut inbox) = caller
        .send("default", &scene.request(&caller, &id, "/denied/here"))
        .await;

    let status = scene
        .service
        .wait_exit(REPLY_TIMEOUT)
        .await
        .unwrap_or_else(|| {
            panic!(
                "the service did not exit after the dead letter. Is webproxy built with \
                 webproxy-dispatcher's `test-hooks` feature?\n{}",
                scene.service.logs()
            )
        });
    assert_eq!(
        status.code(),
        Some(86),
        "{status:?}\n{}",
        scene.service.logs()
    );
    let letters = scene.admin.dead_letters(&origin).await;
    assert_eq!(letters.len(), 1, "dead letters for {origin}: {letters:?}");
    let letter = &letters[0];
    assert_eq!(
        header(Some(&letter.headers), MSG_ID),
        Some(stored_msg_id(&origin, 0, "dead").as_str())
    );
    assert_eq!(header(Some(&letter.headers), GENERATION), Some("0"));
    let body: Value = serde_json::from_slice(&letter.payload).expect("dead letter json");
    assert_eq!(body["origin"], origin.to_string(), "{body}");
    assert_eq!(body["id"], id.as_str(), "{body}");
    // The crash came before the reply.
    caller.nats.flush().await.expect("flush");
    assert!(
        inbox.next().now_or_never().is_none(),
        "a reply before the crash"
    );
    assert!(scene.admin.stored_replies(&id, &origin).await.is_empty());

    scene.service = scene.start_service(service_as(SERVICE_USER)).await;
    let mut live = live;
    // ack_wait brings the request back to the new instance.
    let within = Duration::from_secs(30);
    let (live, copies) = tokio::join!(
        first_and_repeats(&mut live, within, GRACE, "a live reply after the crash"),
        first_and_repeats(&mut inbox, within, GRACE, "a reply_to copy after the crash"),
    );
    assert_eq!(live.len(), 1, "live replies: {live:?}");
    assert_eq!(copies.len(), 1, "reply_to copies: {copies:?}");
    for message in live.iter().chain(&copies) {
        assert_from(message, &origin, "the reply after the crash");
    }
    let reply = reply_of(&live[0]);
    assert_eq!(reply.outcome, Outcome::Error, "{reply:?}");
    let code = reply.error.map(|e| e.code).expect("an error");
    assert_eq!(code, ErrorCode::Denied);
    assert_eq!(body["error"]["code"], code.as_str(), "{body}");
    let stored = scene.admin.stored_replies(&id, &origin).await;
    assert_eq!(stored.len(), 1, "stored replies: {stored:?}");
    let letters = scene.admin.dead_letters(&origin).await;
    assert_eq!(
        letters.len(),
        1,
        "dead letters after the restart: {letters:?}"
    );
    assert_eq!(letters[0].sequence, letter.sequence);
}
