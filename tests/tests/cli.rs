//! The command line as users run it: `webproxy send` and `webproxy cancel` against a
//! live service, and `webproxy check-config` on good and bad files.

use std::process::Output;

use serde_json::Value;
use webproxy_protocol::{ErrorCode, Outcome};
use webproxy_tests::caller::{Harness, REPLY_TIMEOUT, accept_rule, envelope, stored_reply, to};
use webproxy_tests::run_webproxy as webproxy;

fn stdout_json(output: &Output) -> Value {
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// Standard output as exactly one JSON object, as `send --json` promises.
fn one_json_object(output: &Output) -> Value {
    let mut values = serde_json::Deserializer::from_slice(&output.stdout).into_iter::<Value>();
    let first = values.next().and_then(Result::ok);
    let rest = values.count();
    match first {
        Some(value @ Value::Object(_)) if rest == 0 => value,
        _ => panic!(
            "stdout is not exactly one JSON object: {}\nstderr: {}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ),
    }
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// `send`'s exit codes, as docs/cli.md ("`send`'s exit codes") documents them.
mod exit {
    pub const RESPONSE: i32 = 0;
    pub const ERROR_OUTCOME: i32 = 3;
    pub const TIMEOUT: i32 = 4;
    pub const NO_SUCH_POOL: i32 = 5;
    pub const UNREACHABLE: i32 = 6;
}

/// `cancel`'s exit code for an `unknown` answer, as docs/cli.md ("`cancel`") documents
/// it (`recorded` and `finished` exit 0).
const CANCEL_UNKNOWN: i32 = 5;

/// An origin of the default pool's stream, `WEBPROXY_POOL_DEFAULT:<seq>`, in `text`.
fn origin_in(text: &str) -> Option<&str> {
    let start = text.find("WEBPROXY_POOL_DEFAULT:")?;
    let tail = &text[start..];
    let seq_start = "WEBPROXY_POOL_DEFAULT:".len();
    let digits = tail[seq_start..]
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(tail.len() - seq_start);
    (digits > 0).then(|| &tail[..seq_start + digits])
}

#[tokio::test]
async fn send_prints_the_reply_and_exits_by_outcome() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let nats = h.nats.url();
    let url = h.upstream.url("/echo");
    let output = webproxy(&[
        "send",
        "--nats",
        &nats,
        "--json",
        "-H",
        "X-Trace: abc",
        "-d",
        "hello",
        "POST",
        &url,
    ])
    .await;
    assert_eq!(output.status.code(), Some(exit::RESPONSE), "{output:?}");
    let reply = one_json_object(&output);
    assert_eq!(reply["outcome"], "response");
    assert_eq!(reply["status"], 200);
    let origin = reply["origin"].as_str().expect("origin");
    assert_eq!(origin_in(origin), Some(origin), "{reply}");
    let echo: Value = serde_json::from_str(reply["body"].as_str().expect("body")).expect("echo");
    assert_eq!(echo["method"], "POST");
    assert_eq!(echo["body"], "hello");
    assert_eq!(echo["headers"]["x-trace"], serde_json::json!(["abc"]));

    let data = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(data.path(), [0u8, 1, 255]).expect("write");
    let path = data.path().to_str().expect("utf8 path");
    let output = webproxy(&[
        "send",
        "--nats",
        &nats,
        "--json",
        "--data-file",
        path,
        "PUT",
        &url,
    ])
    .await;
    assert!(output.status.success(), "{output:?}");
    let echo: Value =
        serde_json::from_str(one_json_object(&output)["body"].as_str().expect("body"))
            .expect("echo");
    assert_eq!(echo["body_len"], 3);
}

/// The default output: a summary line with the origin on stderr, the body as it came
/// on stdout.
#[tokio::test]
async fn send_prints_a_summary_with_the_origin_and_the_body() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let output = webproxy(&[
        "send",
        "--nats",
        &h.nats.url(),
        "GET",
        &h.upstream.url("/echo?from=send"),
    ])
    .await;
    assert_eq!(output.status.code(), Some(exit::RESPONSE), "{output:?}");
    let stderr = stderr(&output);
    let summary = stderr.lines().next().unwrap_or_default();
    assert!(
        summary.starts_with("response 200, 1 attempt, origin WEBPROXY_POOL_DEFAULT:"),
        "{stderr}"
    );
    assert!(origin_in(summary).is_some(), "{stderr}");
    let echo: Value = serde_json::from_slice(&output.stdout).expect("the body alone on stdout");
    assert_eq!(echo["query"], "from=send", "{echo}");
}

/// An error outcome, a missing pool and a timeout each have an exit code of their own;
/// a timeout prints the origin, by which the stored reply can be read later.
#[tokio::test]
async fn send_exits_distinctly_on_an_error_a_missing_pool_and_a_timeout() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let nats = h.nats.url();
    let url = h.upstream.url("/echo");

    // No rule accepts this loopback URL.
    let denied_url = "http://127.0.0.1:9/elsewhere";
    let denied = webproxy(&["send", "--nats", &nats, "GET", denied_url]).await;
    assert_eq!(
        denied.status.code(),
        Some(exit::ERROR_OUTCOME),
        "{denied:?}"
    );
    let summary = stderr(&denied);
    assert!(summary.starts_with("error denied: "), "{summary}");
    assert!(origin_in(&summary).is_some(), "{summary}");
    let denied = webproxy(&["send", "--nats", &nats, "--json", "GET", denied_url]).await;
    assert_eq!(
        denied.status.code(),
        Some(exit::ERROR_OUTCOME),
        "{denied:?}"
    );
    let reply = one_json_object(&denied);
    assert_eq!(reply["error"]["code"], "denied", "{reply}");
    assert!(reply["origin"].is_string(), "{reply}");

    let no_pool = webproxy(&["send", "--nats", &nats, "--pool", "nope", "GET", &url]).await;
    assert_eq!(
        no_pool.status.code(),
        Some(exit::NO_SUCH_POOL),
        "{no_pool:?}"
    );
    assert!(stderr(&no_pool).contains("no pool \"nope\""), "{no_pool:?}");
    let no_pool = webproxy(&[
        "send", "--nats", &nats, "--json", "--pool", "nope", "GET", &url,
    ])
    .await;
    assert_eq!(
        no_pool.status.code(),
        Some(exit::NO_SUCH_POOL),
        "{no_pool:?}"
    );
    let failure = one_json_object(&no_pool);
    assert_eq!(failure["failure"], "no_such_pool", "{failure}");
    assert_eq!(failure["exit_code"], exit::NO_SUCH_POOL, "{failure}");

    // A paused pool stores the request and delivers nothing: no reply within the wait.
    let paused = webproxy(&["pools", "pause", "default", "--nats", &nats]).await;
    assert!(paused.status.success(), "{paused:?}");
    webproxy_tests::wait_until(
        std::time::Duration::from_secs(10),
        "the pool paused",
        || async { h.pool_consumer("default").await.paused },
    )
    .await;
    let timeout = webproxy(&["send", "--nats", &nats, "--wait", "1s", "GET", &url]).await;
    assert_eq!(timeout.status.code(), Some(exit::TIMEOUT), "{timeout:?}");
    assert!(origin_in(&stderr(&timeout)).is_some(), "{timeout:?}");
    let timeout = webproxy(&[
        "send", "--nats", &nats, "--json", "--wait", "1s", "GET", &url,
    ])
    .await;
    assert_eq!(timeout.status.code(), Some(exit::TIMEOUT), "{timeout:?}");
    let failure = one_json_object(&timeout);
    assert_eq!(failure["failure"], "timeout", "{failure}");
    assert!(failure["id"].is_string(), "{failure}");
    let origin = failure["origin"].as_str().expect("origin");
    assert_eq!(origin_in(origin), Some(origin), "{failure}");
    assert_eq!(
        h.upstream.hits_for("/echo"),
        0,
        "a paused pool called the upstream"
    );
}

/// NATS that cannot be reached, and a NATS without JetStream (which answers a publish
/// as a missing pool does), exit as unreachable, not as a missing pool.
#[tokio::test]
async fn send_tells_unreachable_nats_and_jetstream_from_a_missing_pool() {
    let url = "http://127.0.0.1:9/";
    let (_socket, port) = webproxy_tests::closed_port();
    let closed = format!("nats://127.0.0.1:{port}");
    let output = webproxy(&["send", "--nats", &closed, "GET", url]).await;
    assert_eq!(output.status.code(), Some(exit::UNREACHABLE), "{output:?}");
    assert!(
        stderr(&output).contains("cannot connect to NATS"),
        "{output:?}"
    );
    let output = webproxy(&["send", "--nats", &closed, "--json", "GET", url]).await;
    assert_eq!(output.status.code(), Some(exit::UNREACHABLE), "{output:?}");
    assert_eq!(one_json_object(&output)["failure"], "nats_unreachable");

    let nats = webproxy_tests::NatsServer::start_without_jetstream();
    let output = webproxy(&["send", "--nats", &nats.url(), "--json", "GET", url]).await;
    assert_eq!(output.status.code(), Some(exit::UNREACHABLE), "{output:?}");
    let failure = one_json_object(&output);
    assert_eq!(failure["failure"], "jetstream_unavailable", "{failure}");
    assert_eq!(failure["exit_code"], exit::UNREACHABLE, "{failure}");
}

/// Issue 35: `webproxy cancel` against a live service. A conversation whose attempt is
/// in flight is `recorded`, its attempt is dropped and its reply says `cancelled`; once
/// answered it is `finished`. An origin of the pool's stream that no conversation has
/// (pool streams start at Unix microseconds, so sequence 1 is never one) is `unknown`,
/// with its own exit code.
#[tokio::test]
async fn cancel_ends_an_in_flight_conversation_and_tells_an_unknown_origin() {
    // A 60 s attempt timeout: the attempt at /hang ends by the cancel, or not in time.
    let h = Harness::start(|up| format!("{}timeout = \"60s\"\n", accept_rule("local", up))).await;
    let nats = h.nats.url();
    let submitted = h
        .client
        .submit(&to("default", &envelope("GET", &h.upstream.url("/hang"))))
        .await
        .expect("submit");
    webproxy_tests::wait_until(REPLY_TIMEOUT, "the attempt at the upstream", || async {
        h.upstream.hits_for("/hang") == 1
    })
    .await;
    let origin = submitted.origin.to_string();

    let output = webproxy(&["cancel", "--nats", &nats, "--origin", &origin]).await;
    assert!(output.status.success(), "{output:?}\n{}", h.service.logs());
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "recorded\n",
        "{output:?}"
    );
    let reply = stored_reply(&h.client, &submitted.id, &submitted.origin, REPLY_TIMEOUT).await;
    assert_eq!(reply.outcome, Outcome::Error, "{reply:?}");
    assert_eq!(
        reply.error.as_ref().map(|e| e.code),
        Some(ErrorCode::Cancelled),
        "{reply:?}"
    );

    let output = webproxy(&["cancel", "--nats", &nats, "--origin", &origin, "--json"]).await;
    assert!(output.status.success(), "{output:?}");
    assert_eq!(
        one_json_object(&output),
        serde_json::json!({"cancel": "finished"})
    );

    let made_up = format!("{}:1", submitted.origin.stream);
    let output = webproxy(&["cancel", "--nats", &nats, "--origin", &made_up]).await;
    assert_eq!(output.status.code(), Some(CANCEL_UNKNOWN), "{output:?}");
    assert_eq!(
        String::from_utf8_lossy(&output.stdout),
        "unknown\n",
        "{output:?}"
    );
    let output = webproxy(&["cancel", "--nats", &nats, "--origin", &made_up, "--json"]).await;
    assert_eq!(output.status.code(), Some(CANCEL_UNKNOWN), "{output:?}");
    assert_eq!(
        one_json_object(&output),
        serde_json::json!({"cancel": "unknown"})
    );
}

/// With no service running, `cancel` says so rather than waiting or answering
/// `unknown`: nothing answers its subject.
#[tokio::test]
async fn cancel_without_a_service_says_none_answers() {
    let nats = webproxy_tests::NatsServer::start();
    let output = webproxy(&[
        "cancel",
        "--nats",
        &nats.url(),
        "--origin",
        "WEBPROXY_POOL_DEFAULT:1",
    ])
    .await;
    assert_eq!(output.status.code(), Some(1), "{output:?}");
    assert!(output.stdout.is_empty(), "{output:?}");
    assert!(
        stderr(&output).contains(
            "no webproxy instance answers webproxy.admin.cancel: is the service running?"
        ),
        "{output:?}"
    );
}

async fn check_config(text: &str) -> Output {
    check_config_with(&[], text).await
}

/// `check-config` with `flags` (`--json`) on a file holding `text`.
async fn check_config_with(flags: &[&str], text: &str) -> Output {
    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), text).expect("write");
    let mut args = vec![
        "check-config",
        "--config",
        file.path().to_str().expect("utf8"),
    ];
    args.extend_from_slice(flags);
    webproxy(&args).await
}

#[tokio::test]
async fn check_config_names_the_bad_key() {
    let cases = [
        (
            "[[request_rules]]\nname = \"orders\"\nurl_pattern = \"(unclosed\"\n",
            "request_rules[0] (orders).url_pattern",
        ),
        (
            "[[request_rules]]\nname = \"orders\"\nurl_pattern = \".\"\npool = \"ghost\"\n",
            "request_rules[0] (orders).pool",
        ),
        ("[service]\nack_wait = \"a while\"\n", "service.ack_wait"),
        ("[nats]\nuri = \"nats://x\"\n", "uri"),
    ];
    for (text, key) in cases {
        let output = check_config(text).await;
        assert!(!output.status.success(), "{text} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(key), "{text}: {stderr}");
    }
}

#[tokio::test]
async fn check_config_prints_effective_pools_and_rules() {
    let output = check_config(
        "[pools.partner]\nmax_in_flight = 1\n\n[[request_rules]]\nname = \"partner\"\nmethod = \"post\"\nurl_pattern = '^https://partner\\.example/'\npool = \"partner\"\n",
    )
    .await;
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("default: max_in_flight=256"), "{stdout}");
    assert!(stdout.contains("partner: max_in_flight=1"), "{stdout}");
    assert!(
        stdout.contains("partner: POST ^https://partner\\.example/"),
        "{stdout}"
    );
}

/// A `[[request_rules.response_rules]]` block belongs to the request rule above it: the
/// output shows, per request rule, which list classifies its responses (its own, the
/// global one or the defaults), so a block under the wrong rule can be seen.
#[tokio::test]
async fn check_config_prints_the_response_rules_of_each_request_rule() {
    let text = "[[response_rules]]\nstatus = \"500-599\"\naction = \"retry\"\n\n\
                [[request_rules]]\nname = \"ledger\"\nurl_pattern = '^https://ledger\\.example/'\n\n\
                [[request_rules.response_rules]]\nstatus = \"200\"\naction = \"error\"\nbody_pattern = '\"ok\":false'\n\n\
                [[request_rules]]\nname = \"catalog\"\nurl_pattern = '^https://catalog\\.example/'\n\n\
                [[request_rules]]\nname = \"search\"\nurl_pattern = '^https://search\\.example/'\nresponse_rules = []\n\n\
                [[request_rules]]\nname = \"closed\"\nurl_pattern = '^https://closed\\.example/'\naction = \"deny\"\n";
    let output = check_config(text).await;
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let after = |rule: &str| {
        stdout
            .lines()
            .skip_while(|line| !line.starts_with(&format!("  {rule}: ")))
            .nth(1)
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(
        after("ledger"),
        "    response rules (its own): 200 error if the body matches /\"ok\":false/; any other responds",
        "{stdout}"
    );
    assert_eq!(
        after("catalog"),
        "    response rules (global): 500-599 retry; any other responds",
        "{stdout}"
    );
    assert_eq!(
        after("search"),
        "    response rules (default): 408, 429 and 500-599 retry; any other responds",
        "{stdout}"
    );
    // A denying rule never sends, so nothing classifies its responses.
    assert!(!after("closed").contains("response rules"), "{stdout}");

    let json = check_config_with(&["--json"], text).await;
    let rules = &stdout_json(&json)["request_rules"];
    assert_eq!(rules[0]["response_rules"]["source"], "own");
    assert_eq!(
        rules[0]["response_rules"]["rules"][0]["body_pattern"],
        "\"ok\":false"
    );
    assert_eq!(rules[1]["response_rules"]["source"], "global");
    assert_eq!(rules[2]["response_rules"]["source"], "default");
}

/// `check-config` shows the gateway's routes: where each goes, through which pool, and
/// who may call it (a token by its source, never its value).
#[tokio::test]
async fn check_config_prints_the_gateway_routes() {
    let token = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(token.path(), "route-token-4c1e\n").expect("write token");
    let text = format!(
        "[pools.partner]\n\n\
         [[gateway.routes]]\npath = \"/svc\"\nupstream = \"https://partner.example/api/\"\npool = \"partner\"\ntoken = {{ file = \"{}\" }}\n\n\
         [[gateway.routes]]\npath = \"/open\"\nupstream = \"https://open.example/\"\n",
        token.path().display()
    );
    for flags in [&[][..], &["--json"][..]] {
        let output = check_config_with(flags, &text).await;
        assert!(output.status.success(), "{output:?}");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            !stdout.contains("route-token-4c1e"),
            "a token value: {stdout}"
        );
        if flags.is_empty() {
            assert!(
                stdout.contains(&format!(
                    "  /svc -> https://partner.example/api/ pool=partner (token from the file {} in proxy-authorization)",
                    token.path().display()
                )),
                "{stdout}"
            );
            assert!(
                stdout.contains(
                    "  /open -> https://open.example/ pool=default (open to anyone who can connect)"
                ),
                "{stdout}"
            );
        } else {
            let routes = &stdout_json(&output)["gateway"]["routes"];
            assert_eq!(routes[0]["pool"], "partner", "{routes}");
            assert_eq!(routes[1]["upstream"], "https://open.example/", "{routes}");
        }
    }
}

/// A reader that stops reading (`webproxy send ... | head -c0`) ends the command with
/// success and no panic. The pipe is closed before the reply can be printed: the
/// upstream answers only after 500 ms.
#[tokio::test]
async fn a_closed_stdout_ends_send_quietly() {
    let h = Harness::start(|up| accept_rule("local", up)).await;
    let mut child = std::process::Command::new(webproxy_tests::webproxy_bin())
        .args([
            "send",
            "--nats",
            &h.nats.url(),
            "GET",
            &h.upstream.url("/delay/500"),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn webproxy send");
    drop(child.stdout.take());
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .expect("join")
        .expect("wait for webproxy send");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{:?}\n{stderr}", output.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        h.upstream.hits_for("/delay/500"),
        1,
        "the request was not sent"
    );
}

/// Issue 31: `check-config` and the process it checks for decide by one function. A
/// gateway route whose token variable is unset: `serve` starts (the token is the
/// gateway's, not serve's), so `check-config` accepts it; `webproxy gateway` refuses
/// to start, and so does `check-config --gateway`, both naming the variable. (An
/// unreadable injected secret is refused by `check-config` and `serve` alike:
/// `credentials.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_refuses_what_serve_or_gateway_refuses_and_nothing_else() {
    const UNSET: &str = "WEBPROXY_TEST_UNSET_ROUTE_TOKEN";
    let text = format!(
        "[[gateway.routes]]\npath = \"/svc\"\nupstream = \"https://partner.example/api/\"\ntoken = {{ env = \"{UNSET}\" }}\n"
    );
    let checked = check_config(&text).await;
    assert!(checked.status.success(), "{checked:?}");

    let nats = webproxy_tests::NatsServer::start();
    let service = webproxy_tests::Service::start(&nats, &text).await;
    assert!(service.is_ready().await, "{}", service.logs());

    let refused = check_config_with(&["--gateway"], &text).await;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{refused:?}");
    assert!(stderr.contains(UNSET), "{stderr}");
    assert!(
        stderr.contains("`webproxy gateway` would not start"),
        "{stderr}"
    );

    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), &text).expect("write");
    let config = file.path().to_str().expect("utf8");
    let url = nats.url();
    let gateway = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        webproxy(&["gateway", "--config", config, "--nats", &url]),
    )
    .await
    .expect("the gateway exits at once");
    let stderr = String::from_utf8_lossy(&gateway.stderr);
    assert!(!gateway.status.success(), "{gateway:?}");
    assert!(stderr.contains(UNSET), "{stderr}");
}

/// Issue 31: a `[nats] credentials_file` that can be read but holds no credentials
/// passed `check-config`, while `serve` refused to start on it: both now refuse it,
/// by the function `serve` reads it with before connecting.
#[tokio::test]
async fn check_config_and_serve_both_refuse_unusable_nats_credentials() {
    let creds = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(creds.path(), "not a credentials file\n").expect("write");
    let text = format!(
        "[nats]\ncredentials_file = \"{}\"\n",
        creds.path().display()
    );
    let checked = check_config(&text).await;
    assert!(!checked.status.success(), "{checked:?}");
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert!(stderr.contains("cannot parse user JWT"), "{stderr}");

    let file = tempfile::NamedTempFile::new().expect("temp file");
    std::fs::write(file.path(), &text).expect("write");
    let mut serve = std::process::Command::new(webproxy_tests::webproxy_bin());
    serve
        .args(["serve", "--config", file.path().to_str().expect("utf8")])
        .env("WEBPROXY_NATS__URL", "nats://127.0.0.1:1")
        .env("WEBPROXY_HTTP__LISTEN", "127.0.0.1:0");
    let served = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        tokio::process::Command::from(serve).output(),
    )
    .await
    .expect("serve exits at once")
    .expect("run serve");
    assert!(!served.status.success(), "{served:?}");
    let stderr = String::from_utf8_lossy(&served.stderr);
    assert!(stderr.contains("cannot parse user JWT"), "{stderr}");
}
