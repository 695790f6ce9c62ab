//! The dead-letter tools at scale: `dead list` and `dead replay` filter and stream the
//! dead-letter stream, and `dead replay` changes nothing without consent or with
//! `--dry-run`, and skips `denied` and `invalid_request` unless asked.
//!
//! The letters are published straight into the dead-letter stream (a running service
//! created it), each as a conversation of its own with an origin on the default
//! pool's stream, so a test controls exactly which codes, ids and pools exist.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::process::Stdio;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, context::PublishAckFuture};
use futures::TryStreamExt as _;
use serde_json::{Value, json};
use tokio::io::AsyncBufReadExt as _;
use webproxy_tests::caller::{Harness, accept_rule, next_message};
use webproxy_tests::run_webproxy as webproxy;
use webproxy_tests::{ServiceOptions, Upstream, wait_until};

/// A dead letter of conversation `id` in `pool`, ended with `code`, whose request
/// calls `path` on `upstream`. `origin_seq` makes its origin unique.
fn letter(upstream: &Upstream, pool: &str, id: &str, code: &str, origin_seq: u64) -> Value {
    json!({
        "pool": pool,
        "id": id,
        "generation": 0,
        "origin": format!("WEBPROXY_POOL_DEFAULT:{origin_seq}"),
        "error": {"code": code, "message": format!("{id} failed")},
        "envelope": {"id": id, "method": "GET", "url": upstream.url(&format!("/status/{}", 200 + origin_seq))},
    })
}

/// Publishes `letters` into the dead-letter stream, acks awaited a batch at a time so
/// that thousands take a moment, not a round trip each.
async fn publish_letters(js: &jetstream::Context, letters: impl IntoIterator<Item = Value>) {
    const IN_FLIGHT: usize = 1000;
    let mut acks: Vec<PublishAckFuture> = Vec::with_capacity(IN_FLIGHT);
    for letter in letters {
        let pool = letter["pool"].as_str().expect("pool").to_string();
        let payload = serde_json::to_vec(&letter).expect("json");
        acks.push(
            js.publish(format!("webproxy.dead.{pool}"), payload.into())
                .await
                .expect("publish"),
        );
        if acks.len() == IN_FLIGHT {
            futures::future::try_join_all(acks.drain(..).map(IntoFuture::into_future))
                .await
                .expect("stored");
        }
    }
    futures::future::try_join_all(acks.into_iter().map(IntoFuture::into_future))
        .await
        .expect("stored");
}

async fn harness(options: ServiceOptions) -> Harness {
    // Pool partner's letters need its dead-letter stream, which its provisioning makes.
    Harness::start_with_options(Upstream::start().await, options, |up| {
        format!(
            "{}\n[pools.partner]\nmax_in_flight = 1\n",
            accept_rule("local", up)
        )
    })
    .await
}

/// Runs webproxy and returns its stdout as JSON lines, after checking it succeeded.
async fn json_lines(args: &[&str]) -> Vec<Value> {
    let output = webproxy(args).await;
    assert!(output.status.success(), "{args:?}: {output:?}");
    serde_json::Deserializer::from_slice(&output.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{args:?}: not JSON lines ({e}): {output:?}"))
}

/// Runs webproxy and returns its stdout as one JSON array (`dead list --json`), after
/// checking it succeeded.
async fn json_array(args: &[&str]) -> Vec<Value> {
    let output = webproxy(args).await;
    assert!(output.status.success(), "{args:?}: {output:?}");
    serde_json::from_slice(&output.stdout)
        .unwrap_or_else(|e| panic!("{args:?}: not one JSON array ({e}): {output:?}"))
}

/// Runs webproxy and returns its stdout as text, after checking it succeeded.
async fn text_output(args: &[&str]) -> String {
    let output = webproxy(args).await;
    assert!(output.status.success(), "{args:?}: {output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The `field` of each line, in order.
fn field(lines: &[Value], field: &str) -> Vec<String> {
    lines
        .iter()
        .map(|line| line[field].as_str().unwrap_or("-").to_string())
        .collect()
}

/// What `dead list` with `filters` lists: the ids, oldest first.
async fn listed(nats: &str, filters: &[&str]) -> Vec<String> {
    let mut args = vec!["dead", "list", "--nats", nats, "--json"];
    args.extend_from_slice(filters);
    field(&json_array(&args).await, "id")
}

#[tokio::test]
async fn dead_list_filters_by_code_id_pool_since_and_limit() {
    let h = harness(ServiceOptions::default()).await;
    let up = &h.upstream;
    publish_letters(
        &h.js,
        [
            letter(up, "default", "a1", "upstream_error", 1),
            letter(up, "default", "a2", "denied", 2),
            letter(up, "partner", "a3", "expired", 3),
            letter(up, "default", "a4", "expired", 4),
        ],
    )
    .await;
    // Every letter above was stored (its ack came) before this instant, and every one
    // below after it, by the same machine's clock.
    let between = time::OffsetDateTime::now_utc()
        .format(&time::format_description::well_known::Rfc3339)
        .expect("format");
    publish_letters(
        &h.js,
        [
            letter(up, "default", "b1", "internal", 5),
            letter(up, "partner", "b2", "denied", 6),
        ],
    )
    .await;
    let nats = h.nats.url();

    // Each pool's letters are in its own stream, read pool by pool, oldest first.
    assert_eq!(
        listed(&nats, &[]).await,
        ["a1", "a2", "a4", "b1", "a3", "b2"]
    );
    assert_eq!(listed(&nats, &["--code", "denied"]).await, ["a2", "b2"]);
    assert_eq!(
        listed(&nats, &["--code", "expired,internal"]).await,
        ["a4", "b1", "a3"]
    );
    assert_eq!(
        listed(&nats, &["--code", "expired", "--code", "internal"]).await,
        ["a4", "b1", "a3"]
    );
    assert_eq!(listed(&nats, &["--id", "a3"]).await, ["a3"]);
    assert_eq!(
        listed(&nats, &["--id", "nobody"]).await,
        Vec::<String>::new()
    );
    assert_eq!(listed(&nats, &["--limit", "2"]).await, ["a1", "a2"]);
    // --limit counts matching letters, not letters read.
    assert_eq!(
        listed(&nats, &["--code", "expired,denied", "--limit", "2"]).await,
        ["a2", "a4"]
    );
    assert_eq!(listed(&nats, &["--pool", "partner"]).await, ["a3", "b2"]);
    assert_eq!(
        listed(&nats, &["--pool", "default", "--code", "denied"]).await,
        ["a2"]
    );
    assert_eq!(listed(&nats, &["--since", &between]).await, ["b1", "b2"]);
    assert_eq!(listed(&nats, &["--since", "1h"]).await.len(), 6);
    assert_eq!(
        listed(&nats, &["--since", &between, "--code", "denied"]).await,
        ["b2"]
    );

    // Each letter carries its conversation's origin, what it is picked by.
    let denied = json_array(&[
        "dead", "list", "--nats", &nats, "--code", "denied", "--json",
    ])
    .await;
    assert_eq!(
        field(&denied, "origin"),
        ["WEBPROXY_POOL_DEFAULT:2", "WEBPROXY_POOL_DEFAULT:6"]
    );
    assert_eq!(
        field(&denied, "stream"),
        ["WEBPROXY_POOL_DEFAULT_DEAD", "WEBPROXY_POOL_PARTNER_DEAD"]
    );
    assert!(
        denied
            .iter()
            .all(|l| l["sequence"].is_u64() && l["stored_at"].is_string()),
        "{denied:?}"
    );
    let none = json_array(&["dead", "list", "--nats", &nats, "--id", "nobody", "--json"]).await;
    assert!(none.is_empty(), "{none:?}");

    // The table prints the same selection: a header, then a letter a line, each
    // column (the origin's among them) starting where its header does.
    let text = text_output(&["dead", "list", "--nats", &nats, "--code", "denied"]).await;
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "a header and two letters: {text}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header,
        [
            "SEQ", "STORED", "POOL", "ORIGIN", "ID", "GEN", "CODE", "MESSAGE"
        ],
        "{text}"
    );
    let at = |line: &str, what: &str| {
        line.find(what)
            .unwrap_or_else(|| panic!("{what} not in {line:?}: {text}"))
    };
    for (line, pool, origin, id) in [
        (lines[1], "default", "WEBPROXY_POOL_DEFAULT:2", "a2"),
        (lines[2], "partner", "WEBPROXY_POOL_DEFAULT:6", "b2"),
    ] {
        assert_eq!(at(line, pool), at(lines[0], "POOL"), "{text}");
        assert_eq!(at(line, origin), at(lines[0], "ORIGIN"), "{text}");
        assert_eq!(
            at(line, &format!(" {id} ")) + 1,
            at(lines[0], " ID ") + 1,
            "{text}"
        );
        assert_eq!(at(line, "denied"), at(lines[0], "CODE"), "{text}");
        assert_eq!(
            at(line, &format!("{id} failed")),
            at(lines[0], "MESSAGE"),
            "{text}"
        );
    }
    assert!(!text.contains(" a1 "), "{text}");

    for (flag, bad, named) in [
        ("--since", "yesterday", "RFC 3339"),
        ("--code", "nope", "retries_exhausted"),
        ("--limit", "0", "--limit"),
    ] {
        let refused = webproxy(&["dead", "list", "--nats", &nats, flag, bad]).await;
        assert!(!refused.status.success(), "{flag} {bad}: {refused:?}");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains(named), "{flag} {bad}: {stderr}");
    }
}

/// How many letters the scale test stores, and how large each one's request body is:
/// 10,000 letters of 8 KiB make a stream of about 80 MiB.
const MANY_LETTERS: u64 = 10_000;
const BODY_BYTES: usize = 8 * 1024;

/// `dead list` streams: over a stream of about 80 MiB it lists every letter, in order,
/// while its peak RSS stays below the stream's size. A list that loaded the stream
/// would hold every letter at once and could not; a streaming one holds one fetched
/// batch (at most 4 MiB here) and is expected near 20 MiB (printed, so a regression
/// towards the bound shows before it fails). The bound is that loose on purpose:
/// allocator and runtime overheads vary by build and machine.
///
/// The peak is `VmHWM` from `/proc/<pid>/status`, sampled every 10 ms until the
/// process exits: the last sample is at most 10 ms before its end, and a streaming
/// list does not grow at its end. Publishing and listing take a few seconds; the
/// bounds are generous for a loaded 2-core machine.
#[tokio::test]
async fn dead_list_streams_ten_thousand_letters_in_bounded_memory() {
    // The tests' 64 MiB dead-letter stream would not hold them.
    let options = ServiceOptions::default().env("WEBPROXY_STREAMS__DEAD_MAX_BYTES", "268435456");
    let h = harness(options).await;
    let body = "x".repeat(BODY_BYTES);
    let started = Instant::now();
    publish_letters(
        &h.js,
        (1..=MANY_LETTERS).map(|n| {
            let mut letter = letter(&h.upstream, "default", &format!("many-{n}"), "internal", n);
            letter["envelope"]["body"] = json!(body);
            letter
        }),
    )
    .await;
    let stream_bytes =
        h.js.get_stream("WEBPROXY_POOL_DEFAULT_DEAD")
            .await
            .expect("dead stream")
            .info()
            .await
            .expect("info")
            .state
            .bytes;
    println!(
        "published {MANY_LETTERS} letters ({} MiB) in {:?}",
        stream_bytes >> 20,
        started.elapsed()
    );

    let started = Instant::now();
    let mut child = tokio::process::Command::new(webproxy_tests::webproxy_bin())
        .args(["dead", "list", "--nats", &h.nats.url(), "--json"])
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn webproxy dead list");
    let pid = child.id().expect("pid");
    let stdout = child.stdout.take().expect("stdout");
    let mut stderr = child.stderr.take().expect("stderr");
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut stderr, &mut text)
            .await
            .map(|_| text)
    });
    // Checks each line as it comes, holding none: ids in stream order.
    let reader = tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let mut count = 0_u64;
        // One JSON array, a letter a line between `[` and `]`.
        while let Some(line) = lines.next_line().await.expect("read stdout") {
            if line == "[" || line == "]" {
                continue;
            }
            count += 1;
            let line = line.strip_suffix(',').unwrap_or(&line);
            let letter: Value = serde_json::from_str(line).expect("a letter a line");
            assert_eq!(letter["id"], format!("many-{count}"), "line {count}");
            assert_eq!(letter["sequence"], count, "line {count}");
        }
        count
    });
    let mut peak = 0;
    let status = tokio::time::timeout(Duration::from_secs(120), async {
        loop {
            if let Some(rss) = webproxy_tests::process::peak_rss(pid) {
                peak = peak.max(rss);
            }
            if let Some(status) = child.try_wait().expect("wait") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("dead list finished within 120 s");
    let listed = reader.await.expect("stdout reader");
    println!(
        "dead list of {listed} letters: {:?}, peak RSS {} MiB",
        started.elapsed(),
        peak >> 20
    );
    let errors = errors.await.expect("stderr reader").expect("read stderr");
    assert!(status.success(), "{status:?}: {errors}");
    assert_eq!(listed, MANY_LETTERS, "{errors}");
    assert!(peak > 0, "no RSS sample of pid {pid}");
    assert!(
        peak < stream_bytes,
        "peak RSS {peak} is not below the stream's {stream_bytes} bytes"
    );
}

/// Each stream's stored messages and last sequence: what a replay would change (the
/// hop it publishes, the progress record it creates).
async fn streams(js: &jetstream::Context) -> BTreeMap<String, (u64, u64)> {
    js.streams()
        // The running service's own heartbeat and lease change on their own clock.
        .try_filter(|info| futures::future::ready(info.config.name != "KV_WEBPROXY_INSTANCES"))
        .map_ok(|info| {
            (
                info.config.name,
                (info.state.messages, info.state.last_sequence),
            )
        })
        .try_collect()
        .await
        .expect("stream infos")
}

/// One replayable conversation in each of the three codes whose letters replay skips
/// or not: `upstream_error` (replayed), `denied` and `invalid_request` (skipped).
async fn three_conversations(h: &Harness) {
    let up = &h.upstream;
    publish_letters(
        &h.js,
        [
            letter(up, "default", "failed", "upstream_error", 1),
            letter(up, "default", "refused", "denied", 2),
            letter(up, "default", "malformed", "invalid_request", 3),
        ],
    )
    .await;
}

#[tokio::test]
async fn replay_dry_run_changes_nothing() {
    let h = harness(ServiceOptions::default()).await;
    three_conversations(&h).await;
    let nats = h.nats.url();
    let before = streams(&h.js).await;

    let lines = json_lines(&["dead", "replay", "--nats", &nats, "--dry-run", "--json"]).await;
    assert_eq!(field(&lines, "id"), ["failed", "refused", "malformed"]);
    assert_eq!(
        field(&lines, "action"),
        ["would_replay", "skipped", "skipped"]
    );
    assert_eq!(lines[0]["generation"], 1);
    assert!(
        field(&lines, "reason")[1].contains("--include-denied"),
        "{lines:?}"
    );
    let all = json_lines(&[
        "dead",
        "replay",
        "--nats",
        &nats,
        "--dry-run",
        "--json",
        "--include-denied",
    ])
    .await;
    assert_eq!(
        field(&all, "action"),
        ["would_replay", "would_replay", "would_replay"]
    );
    let text = text_output(&["dead", "replay", "--nats", &nats, "--dry-run"]).await;
    assert!(text.contains("would replay failed"), "{text}");
    assert!(text.ends_with("1 would be replayed, 2 skipped\n"), "{text}");

    // Nothing published: no hop in the pool stream, no progress record, no new letter.
    assert_eq!(streams(&h.js).await, before);
    assert_eq!(h.upstream.hits(), 0);
}

#[tokio::test]
async fn replay_without_yes_and_without_a_terminal_replays_nothing() {
    let h = harness(ServiceOptions::default()).await;
    three_conversations(&h).await;
    let nats = h.nats.url();
    let before = streams(&h.js).await;

    // The test's webproxy has no terminal: its stdin is /dev/null.
    let refused = webproxy(&["dead", "replay", "--nats", &nats]).await;
    assert!(!refused.status.success(), "{refused:?}");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--yes"), "{stderr}");
    assert!(stderr.contains("1 conversation(s)"), "{stderr}");
    assert_eq!(streams(&h.js).await, before);
    assert_eq!(h.upstream.hits(), 0);
}

/// How many messages the default pool's stream has stored: a replay publishes its hop
/// there, and the service publishes nothing there for requests that succeed at once.
async fn pool_publishes(js: &jetstream::Context) -> u64 {
    streams(js).await["WEBPROXY_POOL_DEFAULT"].1
}

/// `replay --yes` replays the `upstream_error` conversation only; `--include-denied`
/// replays the `denied` and `invalid_request` ones too.
#[tokio::test]
async fn replay_skips_denied_and_invalid_requests_unless_included() {
    let h = harness(ServiceOptions::default()).await;
    three_conversations(&h).await;
    let nats = h.nats.url();
    let published = pool_publishes(&h.js).await;

    let lines = json_lines(&["dead", "replay", "--nats", &nats, "--yes", "--json"]).await;
    assert_eq!(field(&lines, "id"), ["failed", "refused", "malformed"]);
    assert_eq!(field(&lines, "action"), ["replayed", "skipped", "skipped"]);
    assert_eq!(pool_publishes(&h.js).await, published + 1);
    wait_until(
        Duration::from_secs(20),
        "the replayed request at the upstream",
        || async { h.upstream.hits_for("/status/201") == 1 },
    )
    .await;
    assert_eq!(h.upstream.hits(), 1);

    let refused = webproxy(&[
        "dead", "replay", "--nats", &nats, "--yes", "--code", "denied",
    ])
    .await;
    assert!(!refused.status.success(), "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("--include-denied"),
        "{refused:?}"
    );
    assert_eq!(pool_publishes(&h.js).await, published + 1);

    let lines = json_lines(&[
        "dead",
        "replay",
        "--nats",
        &nats,
        "--yes",
        "--include-denied",
        "--code",
        "denied,invalid_request",
        "--json",
    ])
    .await;
    assert_eq!(field(&lines, "id"), ["refused", "malformed"]);
    assert_eq!(field(&lines, "action"), ["replayed", "replayed"]);
    assert_eq!(pool_publishes(&h.js).await, published + 3);
    wait_until(
        Duration::from_secs(20),
        "the replayed denied and invalid requests at the upstream",
        || async {
            h.upstream.hits_for("/status/202") == 1 && h.upstream.hits_for("/status/203") == 1
        },
    )
    .await;
}

/// Runs `dead replay` with `args` (`--json`), checks that it replayed one conversation
/// as `generation`, and that the next live reply on `replies` answers that generation.
async fn replays_as(args: &[&str], replies: &mut async_nats::Subscriber, generation: u64) {
    let lines = json_lines(args).await;
    assert_eq!(field(&lines, "action"), ["replayed"], "{lines:?}");
    assert_eq!(lines[0]["generation"], generation, "{lines:?}");
    let what = format!("generation {generation}'s reply");
    let reply = next_message(replies, Duration::from_secs(20), &what).await;
    let answered = reply
        .headers
        .as_ref()
        .and_then(|h| h.get(webproxy_protocol::header::GENERATION))
        .map(|v| v.as_str().to_string());
    assert_eq!(answered, Some(generation.to_string()), "{what}");
}

/// A letter is replayed once (issue 29, point 6). A first `dead replay --yes` runs
/// generation 1. Once its stored reply is gone, as it is `reply_max_age` later, a
/// second `dead replay --yes` says "already replayed as generation 1", exits 0 (the
/// letter is where the operator wants it: replayed) and publishes nothing: no hop, no
/// call upstream, no reply. `--again` then replays it as generation 2 on purpose, and
/// a plain replay after that names generation 2.
///
/// The stored reply vanishes by the server's own expiry: `[streams] reply_max_age` is
/// set to 2 s (the config takes any duration), so the second replay finds exactly what
/// it finds in production 15 minutes later, without the test reaching into the
/// replies stream by hand.
#[tokio::test]
async fn a_letter_is_replayed_once() {
    let options = ServiceOptions::default().env("WEBPROXY_STREAMS__REPLY_MAX_AGE", "2s");
    let h = harness(options).await;
    publish_letters(
        &h.js,
        [letter(
            &h.upstream,
            "default",
            "failed",
            "upstream_error",
            1,
        )],
    )
    .await;
    let origin = webproxy_protocol::Origin::new("WEBPROXY_POOL_DEFAULT", 1);
    let nats = h.nats.url();
    let replay = ["dead", "replay", "--nats", &nats, "--yes", "--json"];
    let mut replies =
        h.js.client()
            .subscribe("webproxy.reply.failed")
            .await
            .expect("subscribe");

    replays_as(&replay, &mut replies, 1).await;
    let stored = || async { h.client.reply("failed", &origin).await.expect("lookup") };
    wait_until(
        Duration::from_secs(10),
        "generation 1's stored reply",
        || async { stored().await.is_some() },
    )
    .await;
    wait_until(
        Duration::from_secs(20),
        "generation 1's stored reply to expire",
        || async { stored().await.is_none() },
    )
    .await;
    assert_eq!(h.upstream.hits_for("/status/201"), 1);

    let published = pool_publishes(&h.js).await;
    // It exits 0: the letter is where the operator wants it, replayed.
    let text = text_output(&["dead", "replay", "--nats", &nats, "--yes"]).await;
    assert!(text.contains("already replayed as generation 1"), "{text}");
    assert!(text.ends_with("0 replayed, 1 skipped\n"), "{text}");
    // Nothing published: no hop, so nothing for the service to call or answer.
    assert_eq!(pool_publishes(&h.js).await, published);

    // The next reply is generation 2's: had the second replay run, a second
    // generation 1 reply would have come first.
    replays_as(&[&replay[..], &["--again"]].concat(), &mut replies, 2).await;
    assert_eq!(pool_publishes(&h.js).await, published + 1);
    assert_eq!(h.upstream.hits_for("/status/201"), 2);

    let third = json_lines(&replay).await;
    assert_eq!(field(&third, "action"), ["skipped"], "{third:?}");
    assert!(
        field(&third, "reason")[0].contains("already replayed as generation 2"),
        "{third:?}"
    );
    assert_eq!(pool_publishes(&h.js).await, published + 1);
}
