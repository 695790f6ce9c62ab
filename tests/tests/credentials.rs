//! Credential injection end to end: the upstream sees the secret, the caller's own
//! header is replaced, file secrets reload on SIGHUP and when their contents change (a
//! Kubernetes-style `..data` symlink swap, without a signal), no secret value appears in
//! the reply, the dead letter, the logs (at trace level) or `check-config`'s output, and
//! what a caller wrote itself is never rewritten (a guess is not confirmed).

use std::net::SocketAddr;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::routing::get;
use webproxy_protocol::{ErrorCode, HeaderValue as Hv};
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, envelope, next_message};
use webproxy_tests::{
    SecretVolume, ServiceOptions, Upstream, closed_port, default_routes, wait_for, webproxy_bin,
};

const ENV_SECRET: &str = "env-secret-7f3a9c";
const FILE_SECRET_1: &str = "file-secret-one-41d2";
const FILE_SECRET_2: &str = "file-secret-two-88e0";

/// What the upstream saw on `/auth`: every `authorization` and `x-api-key` value.
type Seen = Arc<Mutex<Vec<(Vec<String>, Vec<String>)>>>;

/// `/auth` records the credential headers and answers without repeating them.
async fn recording_upstream() -> (Upstream, Seen) {
    recording_upstream_on("127.0.0.1:0".parse().expect("addr")).await
}

async fn recording_upstream_on(addr: SocketAddr) -> (Upstream, Seen) {
    let seen: Seen = Arc::default();
    let record = seen.clone();
    let upstream = Upstream::start_on(
        addr,
        default_routes().route(
            "/auth",
            get(move |headers: HeaderMap| {
                let record = record.clone();
                async move {
                    let values = |name: &str| {
                        headers
                            .get_all(name)
                            .iter()
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
                            .collect::<Vec<_>>()
                    };
                    record
                        .lock()
                        .expect("lock")
                        .push((values("authorization"), values("x-api-key")));
                    "recorded"
                }
            }),
        ),
    )
    .await;
    (upstream, seen)
}

fn rule(upstream: &Upstream, secret_file: &std::path::Path) -> String {
    format!(
        "[outbound]\nmax_response_bytes = 1000\n\n\
         [[request_rules]]\nname = \"partner\"\nurl_pattern = '^{}'\n{}\
         [request_rules.inject_headers]\n\
         Authorization = {{ env = \"PARTNER_TOKEN\", prefix = \"Bearer \" }}\n\
         X-Api-Key = {{ file = {} }}\n",
        upstream.url("/").replace('.', "\\."),
        origin_of(upstream),
        toml_string(secret_file.to_str().expect("utf8 path")),
    )
}

/// The keys that bind an injecting rule to the loopback upstream's origin: plain http
/// needs `allow_http`.
fn origin_of(upstream: &Upstream) -> String {
    format!(
        "origin = \"http://{}\"\nallow_http = true\n",
        upstream.addr()
    )
}

fn toml_string(text: &str) -> String {
    serde_json::to_string(text).expect("string")
}

fn assert_no_secret(what: &str, text: &str) {
    for secret in [ENV_SECRET, FILE_SECRET_1, FILE_SECRET_2] {
        assert!(
            !text.contains(secret),
            "{what} contains the secret {secret}:\n{text}"
        );
    }
}

#[tokio::test]
async fn secrets_reach_the_upstream_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_file = dir.path().join("api-key");
    std::fs::write(&secret_file, format!("{FILE_SECRET_1}\n")).expect("write secret");
    let (upstream, seen) = recording_upstream().await;
    // Polling off: the reload below must be the signal's.
    let options = ServiceOptions::default()
        .env("PARTNER_TOKEN", ENV_SECRET)
        .env("WEBPROXY_SERVICE__SECRET_POLL_INTERVAL", "0s")
        .env("RUST_LOG", "trace");
    let h = Harness::start_with_options(upstream, options, |up| rule(up, &secret_file)).await;

    // The caller's own Authorization is replaced, never merged.
    let mut request = envelope("GET", &h.upstream.url("/auth"));
    request.headers.insert(
        "Authorization".into(),
        Hv::One("Bearer caller-guess".into()),
    );
    let reply = h.request(&request).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    assert_eq!(
        seen.lock().expect("lock").last().cloned(),
        Some((
            vec![format!("Bearer {ENV_SECRET}")],
            vec![FILE_SECRET_1.to_string()]
        ))
    );

    // An error under the same rule: its reply and dead letter are webproxy's own words.
    let too_large = h
        .request(&envelope("GET", &h.upstream.url("/bytes/5000")))
        .await;
    assert_eq!(
        too_large.error.as_ref().map(|e| e.code),
        Some(ErrorCode::ResponseTooLarge)
    );
    let letters = h.wait_dead_letters(1).await;
    let letter = serde_json::to_string(&letters[0].1).expect("json");

    // SIGHUP re-reads the file; the environment secret stays as read at start.
    std::fs::write(&secret_file, format!("{FILE_SECRET_2}\n")).expect("rewrite secret");
    let status = Command::new("kill")
        .args(["-HUP", &h.service.pid().to_string()])
        .status()
        .expect("kill -HUP");
    assert!(status.success());
    wait_for(REPLY_TIMEOUT, "the secret files to be reloaded", || async {
        h.service
            .logs()
            .contains("secret files reloaded")
            .then_some(())
    })
    .await;
    let reply = h.request(&envelope("GET", &h.upstream.url("/auth"))).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    assert_eq!(
        seen.lock().expect("lock").last().cloned(),
        Some((
            vec![format!("Bearer {ENV_SECRET}")],
            vec![FILE_SECRET_2.to_string()]
        ))
    );

    for reply in [&too_large, &reply] {
        assert_no_secret("a reply", &serde_json::to_string(reply).expect("json"));
    }
    assert_no_secret("the dead letter", &letter);
    let logs = h.service.logs();
    // The trace level really was on, so the grep covers every level.
    assert!(logs.contains("TRACE"), "no trace lines in the log");
    assert_no_secret("the service log", &logs);
}

#[tokio::test]
async fn a_secret_volume_swapped_under_its_symlink_is_picked_up_without_a_signal() {
    let mut volume = SecretVolume::new("api-key", FILE_SECRET_1);
    let (upstream, seen) = recording_upstream().await;
    let options = ServiceOptions::default()
        .env("PARTNER_TOKEN", ENV_SECRET)
        .env("WEBPROXY_SERVICE__SECRET_POLL_INTERVAL", "200ms");
    let secret_file = volume.path();
    let h = Harness::start_with_options(upstream, options, |up| rule(up, &secret_file)).await;
    let api_keys = || {
        seen.lock()
            .expect("lock")
            .last()
            .map(|(_, api_keys)| api_keys.clone())
    };
    let reply = h.request(&envelope("GET", &h.upstream.url("/auth"))).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    assert_eq!(api_keys(), Some(vec![FILE_SECRET_1.to_string()]));

    volume.publish(FILE_SECRET_2);
    wait_for(
        REPLY_TIMEOUT,
        "the rotated secret to reach the upstream",
        || async {
            let reply = h.request(&envelope("GET", &h.upstream.url("/auth"))).await;
            assert_eq!(reply.status, Some(200), "{reply:?}");
            (api_keys() == Some(vec![FILE_SECRET_2.to_string()])).then_some(())
        },
    )
    .await;
    let logs = h.service.logs();
    assert!(
        logs.contains("secret files changed: reloaded") && !logs.contains("SIGHUP"),
        "{logs}"
    );
    assert_no_secret("the service log", &logs);
}

#[tokio::test]
async fn check_config_names_sources_and_never_prints_values() {
    let dir = tempfile::tempdir().expect("tempdir");
    let secret_file = dir.path().join("api-key");
    std::fs::write(&secret_file, FILE_SECRET_1).expect("write secret");
    let upstream = Upstream::start().await;
    let config = dir.path().join("webproxy.toml");
    std::fs::write(&config, rule(&upstream, &secret_file)).expect("write config");
    let config = config.to_str().expect("utf8");

    for json in [false, true] {
        let mut args = vec!["check-config", "--config", config];
        if json {
            args.push("--json");
        }
        let output = Command::new(webproxy_bin())
            .args(&args)
            .env("PARTNER_TOKEN", ENV_SECRET)
            .output()
            .expect("run check-config");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{output:?}");
        assert!(stdout.contains("PARTNER_TOKEN"), "{stdout}");
        assert!(stdout.contains("api-key"), "{stdout}");
        assert_no_secret("check-config output", &stdout);
        assert_no_secret(
            "check-config stderr",
            &String::from_utf8_lossy(&output.stderr),
        );
    }

    // A missing variable or file stops check-config and serve, naming rule and source.
    for (env, missing) in [(None, "PARTNER_TOKEN"), (Some(ENV_SECRET), "api-key")] {
        if env.is_some() {
            std::fs::remove_file(&secret_file).expect("remove secret");
        }
        for command in ["check-config", "serve"] {
            let mut cmd = Command::new(webproxy_bin());
            cmd.args([command, "--config", config])
                .env_remove("PARTNER_TOKEN")
                .env("WEBPROXY_NATS__URL", "nats://127.0.0.1:1")
                .env("WEBPROXY_HTTP__LISTEN", "127.0.0.1:0");
            if let Some(value) = env {
                cmd.env("PARTNER_TOKEN", value);
            }
            let output = tokio::time::timeout(
                Duration::from_secs(20),
                tokio::process::Command::from(cmd).output(),
            )
            .await
            .expect("exits at once")
            .expect("run");
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(
                !output.status.success(),
                "{command} started without {missing}"
            );
            assert!(stderr.contains(missing), "{command}: {stderr}");
            assert!(
                stderr.contains("request_rules[0] (partner).inject_headers"),
                "{command}: {stderr}"
            );
        }
    }
}

/// A parked retry is webproxy's own copy of a request, like a dead letter: neither
/// holds a secret value, even one the caller put in its own envelope.
/// Issue 30, attack 6: a guess of another rule's secret, placed in the URL, a header,
/// the body and the metadata, gives the same outputs whether it is right or wrong. The
/// reply, the stored reply, the parked copy (payload and hop state) and the dead letter,
/// error messages and attempt failures included, are identical once the guess is
/// swapped back. The upstream is a closed port: it echoes nothing, so only what
/// webproxy writes itself could tell the two apart.
#[tokio::test]
async fn a_right_and_a_wrong_guess_of_a_secret_give_the_same_outputs() {
    let (_closed, port) = closed_port();
    let wrong = "env-secret-7f3a9d";
    assert_eq!(wrong.len(), ENV_SECRET.len());
    let (right, wrong) = tokio::join!(
        outputs_of_a_guess(ENV_SECRET, port),
        outputs_of_a_guess(wrong, port)
    );
    assert_eq!(right, wrong);
    // The guess is in them, as the caller wrote it: the parked copy is the envelope.
    assert!(right.contains("I know GUESS"), "{right}");
}

/// Every output of one conversation that carries `guess`, against a rule that injects
/// [`ENV_SECRET`] and retries once, with the guess and the times masked.
async fn outputs_of_a_guess(guess: &str, port: u16) -> String {
    let options = ServiceOptions::default().env("PARTNER_TOKEN", ENV_SECRET);
    let h = Harness::start_with_options(Upstream::start().await, options, |_| {
        format!(
            "[[request_rules]]\nname = \"partner\"\nurl_pattern = '^http://127\\.0\\.0\\.1:{port}/'\nmax_retries = 1\nretry_delay = \"100ms\"\n\
             origin = \"http://127.0.0.1:{port}\"\nallow_http = true\n\
             [request_rules.inject_headers]\nAuthorization = {{ env = \"PARTNER_TOKEN\", prefix = \"Bearer \" }}\n",
        )
    })
    .await;
    let client = h.js.client();
    let mut parked = client
        .subscribe("webproxy.retry.>")
        .await
        .expect("subscribe");
    client.flush().await.expect("flush");
    let mut request = envelope("PUT", &format!("http://127.0.0.1:{port}/x?q={guess}"));
    request.id = "guess".into();
    request
        .headers
        .insert("X-Note".into(), Hv::One(format!("I know {guess}")));
    request.body = Some(format!("the key is {guess}"));
    request.metadata = Some(serde_json::json!({ "note": guess }));
    let answer = h.request_answer(&request).await;
    assert!(answer.reply.error.is_some(), "{:?}", answer.reply);
    // Denied, its error message quoting the URL: no rule accepts 127.0.0.2.
    let mut denied = request.clone();
    denied.id = "denied".into();
    denied.url = denied.url.replace("127.0.0.1", "127.0.0.2");
    let denied = h.request(&denied).await;
    assert!(
        denied
            .error
            .as_ref()
            .is_some_and(|e| e.message.contains(guess)),
        "{denied:?}"
    );
    let copy = next_message(&mut parked, REPLY_TIMEOUT, "a parked retry").await;
    let hop_state: serde_json::Value = copy
        .headers
        .as_ref()
        .and_then(|headers| headers.get("Webproxy-Hop"))
        .and_then(|value| serde_json::from_str(value.as_str()).ok())
        .expect("the parked copy's hop state");
    let mut letters = h.wait_dead_letters(2).await;
    letters.sort_by(|a, b| a.1.id.cmp(&b.1.id));
    let stored =
        h.js.get_stream(h.subjects.replies_stream_of(&answer.origin))
            .await
            .expect("the replies stream")
            .get_last_raw_message_by_subject(&h.subjects.stored_reply("guess", &answer.origin))
            .await
            .expect("the stored reply");
    let outputs = [
        serde_json::to_value(&answer.reply).expect("reply"),
        serde_json::from_slice(&stored.payload).expect("stored reply"),
        serde_json::from_slice(&copy.payload).expect("parked copy"),
        hop_state,
        serde_json::to_value(&denied).expect("denied reply"),
        serde_json::to_value(&letters[0].1).expect("dead letter"),
        serde_json::to_value(&letters[1].1).expect("dead letter"),
    ];
    let masked: Vec<_> = outputs.into_iter().map(|o| masked(o, guess)).collect();
    serde_json::to_string_pretty(&masked).expect("json")
}

/// `value` with `guess` written `GUESS`, and what differs between two runs anyway
/// (times, durations, the origin: a stream starts its sequence from the clock, and the
/// hash of the publish's random message id, which hop states and dead letters keep)
/// blanked.
fn masked(value: serde_json::Value, guess: &str) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(s) => Value::String(s.replace(guess, "GUESS")),
        Value::Array(items) => items.into_iter().map(|v| masked(v, guess)).collect(),
        Value::Object(map) => map
            .into_iter()
            .map(|(key, v)| {
                let v = match key.as_str() {
                    "duration_ms" | "at" | "first_published_ms" | "due_ms" | "origin"
                    | "msg_id_sha256" => Value::Null,
                    _ => masked(v, guess),
                };
                (key, v)
            })
            .collect(),
        other => other,
    }
}

/// An injecting rule is bound to its origin: whatever its pattern matches, a request
/// to another scheme, host or port is denied, never sent without the header. The
/// rule here is as loose as the bad examples (unanchored, no trailing `/`),
/// so only the origin stands between the secret and the other upstreams, all on
/// loopback: `?u=`, `#`, `@` and a longer host (`127.0.0.23` for `127.0.0.2`, the
/// `.evil` form). The `x` form needs a name resolving to loopback and is covered by
/// the unit tests of the origin check.
#[tokio::test]
async fn an_injecting_rule_sends_to_its_origin_only() {
    let (partner, seen) = recording_upstream_on("127.0.0.2:0".parse().expect("addr")).await;
    let port = partner.addr().port();
    let (evil, evil_seen) =
        recording_upstream_on(SocketAddr::new("127.0.0.3".parse().expect("ip"), port)).await;
    let (longer, longer_seen) =
        recording_upstream_on(SocketAddr::new("127.0.0.23".parse().expect("ip"), port)).await;
    let options = ServiceOptions::default().env("PARTNER_TOKEN", ENV_SECRET);
    let h = Harness::start_with_options(partner, options, |up| {
        format!(
            "[[request_rules]]\nname = \"partner\"\nurl_pattern = '127\\.0\\.0\\.2'\n{}\
             [request_rules.inject_headers]\nAuthorization = {{ env = \"PARTNER_TOKEN\" }}\n",
            origin_of(up)
        )
    })
    .await;
    let reply = h.request(&envelope("GET", &h.upstream.url("/auth"))).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    assert_eq!(seen.lock().expect("lock").len(), 1);

    let partner_url = h.upstream.url("/");
    for (url, code) in [
        (
            format!("{}?u={partner_url}", evil.url("/auth")),
            ErrorCode::Denied,
        ),
        (longer.url("/auth"), ErrorCode::Denied),
        (
            format!("{}#{partner_url}", evil.url("/auth")),
            ErrorCode::Denied,
        ),
        (
            format!("http://127.0.0.2:{port}@127.0.0.3:{port}/auth"),
            ErrorCode::InvalidRequest,
        ),
    ] {
        let reply = h.request(&envelope("GET", &url)).await;
        let error = reply.error.unwrap_or_else(|| panic!("{url} was sent"));
        assert_eq!(error.code, code, "{url}: {error:?}");
        assert_eq!(reply.attempts, 0, "{url}");
        if code == ErrorCode::Denied && url.contains("?u=") {
            assert!(
                error
                    .message
                    .contains(&format!("bound to origin http://127.0.0.2:{port}")),
                "{url}: {}",
                error.message
            );
        }
    }
    assert_eq!(
        evil.hits(),
        0,
        "a request under the partner rule left its origin"
    );
    assert_eq!(
        longer.hits(),
        0,
        "a request under the partner rule left its origin"
    );
    assert!(evil_seen.lock().expect("lock").is_empty());
    assert!(longer_seen.lock().expect("lock").is_empty());
}

/// `check-config` refuses an injecting rule without an origin, or with a plain http
/// origin and no `allow_http`, naming the rule and what to add.
#[tokio::test]
async fn check_config_refuses_an_injecting_rule_without_an_https_origin() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("webproxy.toml");
    let rule =
        "[[request_rules]]\nname = \"partner\"\nurl_pattern = '^https://api\\.partner\\.com/'\n";
    let inject = "[request_rules.inject_headers]\nAuthorization = { env = \"PARTNER_TOKEN\" }\n";
    for (origin, expected) in [
        ("", "add origin = \"https://api.partner.com\""),
        ("origin = \"http://api.partner.com\"\n", "allow_http = true"),
    ] {
        std::fs::write(&config, format!("{rule}{origin}{inject}")).expect("write config");
        let output = Command::new(webproxy_bin())
            .args(["check-config", "--config", config.to_str().expect("utf8")])
            .env("PARTNER_TOKEN", ENV_SECRET)
            .output()
            .expect("run check-config");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{origin:?} was accepted");
        assert!(
            stderr.contains("request_rules[0] (partner).origin"),
            "{stderr}"
        );
        assert!(stderr.contains(expected), "{stderr}");
    }
}
