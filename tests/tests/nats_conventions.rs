//! Issue 16, points 1 and 2, against the real binary and real nats-servers: the nats
//! CLI's conventions (`-s`, `NATS_URL`, `--context` and `NATS_CONTEXT` with a context
//! file), stray and misspelt `WEBPROXY_` variables, and secrets from the environment
//! taken as written.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use webproxy_protocol::Outcome;
use webproxy_tests::caller::{Harness, envelope};
use webproxy_tests::{
    NATS_CLI_VARS, NatsServer, Service, ServiceOptions, Upstream, closed_port, webproxy_bin,
};

/// How long a refused configuration may take to stop the service: it exits before it
/// connects, so this only absorbs a slow machine.
const EXIT_TIMEOUT: Duration = Duration::from_secs(20);

/// Runs a webproxy CLI command with exactly `env` among the nats CLI's and webproxy's
/// variables, and `$XDG_CONFIG_HOME` at `xdg`.
async fn webproxy(args: &[&str], env: &[(&str, &str)], xdg: &Path) -> Output {
    let mut command = tokio::process::Command::new(webproxy_bin());
    for var in NATS_CLI_VARS {
        command.env_remove(var);
    }
    for (var, _) in std::env::vars_os() {
        if var.to_str().is_some_and(|var| var.starts_with("WEBPROXY_")) {
            command.env_remove(var);
        }
    }
    command
        .args(args)
        .env("XDG_CONFIG_HOME", xdg)
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .output()
        .await
        .expect("run webproxy")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// Writes the nats CLI context `name` under `xdg`.
fn write_context(xdg: &Path, name: &str, json: &serde_json::Value) {
    let dir = xdg.join("nats").join("context");
    std::fs::create_dir_all(&dir).expect("context dir");
    std::fs::write(dir.join(format!("{name}.json")), json.to_string()).expect("context file");
}

fn assert_connects(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what}: {}\n{}",
        output.status,
        stderr(output)
    );
}

/// Asserts that the command tried `url` (and failed there, as nothing listens).
fn assert_tried(output: &Output, url: &str, what: &str) {
    let err = stderr(output);
    assert!(!output.status.success(), "{what}: connected");
    assert!(
        err.contains(&format!("cannot connect to NATS at {url}")),
        "{what}: expected {url}: {err}"
    );
}

#[tokio::test]
async fn the_cli_resolves_nats_url_the_server_flag_and_contexts() {
    let nats = NatsServer::start();
    let good = nats.url();
    // Three addresses where nothing listens, held for the test.
    let closed = [closed_port(), closed_port(), closed_port()];
    let [config_url, env_url, context_url] = closed
        .each_ref()
        .map(|(_, port)| format!("nats://127.0.0.1:{port}"));
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("webproxy.toml");
    std::fs::write(&config, format!("[nats]\nurl = \"{config_url}\"\n")).expect("config");
    let config = config.to_str().expect("utf8");
    let xdg = dir.path().join("xdg");
    write_context(
        &xdg,
        "good",
        &serde_json::json!({"url": good, "description": "x"}),
    );
    write_context(&xdg, "closed", &serde_json::json!({"url": context_url}));
    let pools = ["pools", "--json", "--config", config];
    let with = |extra: &[&'static str]| -> Vec<String> {
        pools
            .iter()
            .map(|s| s.to_string())
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    let run = async |args: &[String], env: &[(&str, &str)]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        webproxy(&args, env, &xdg).await
    };

    // The config file alone; then WEBPROXY_NATS__URL over it; then NATS_URL over both.
    assert_tried(&run(&with(&[]), &[]).await, &config_url, "config file");
    let output = run(&with(&[]), &[("WEBPROXY_NATS__URL", &env_url)]).await;
    assert_tried(&output, &env_url, "WEBPROXY_NATS__URL");
    let output = run(
        &with(&[]),
        &[("WEBPROXY_NATS__URL", &env_url), ("NATS_URL", &good)],
    )
    .await;
    assert_connects(&output, "NATS_URL over WEBPROXY_NATS__URL");

    // -s (and its alias --nats) over NATS_URL.
    let mut args = with(&["-s"]);
    args.push(good.clone());
    assert_connects(&run(&args, &[("NATS_URL", &env_url)]).await, "-s");
    let mut args = with(&["--nats"]);
    args.push(good.clone());
    assert_connects(&run(&args, &[("NATS_URL", &env_url)]).await, "--nats");

    // NATS_CONTEXT over NATS_URL; --context over NATS_CONTEXT, even when NATS_URL is set.
    let output = run(
        &with(&[]),
        &[("NATS_URL", &env_url), ("NATS_CONTEXT", "good")],
    )
    .await;
    assert_connects(&output, "NATS_CONTEXT over NATS_URL");
    let output = run(
        &with(&["--context", "good"]),
        &[("NATS_URL", &env_url), ("NATS_CONTEXT", "closed")],
    )
    .await;
    assert_connects(&output, "--context over NATS_CONTEXT and NATS_URL");
    let output = run(&with(&["--context", "closed"]), &[("NATS_CONTEXT", "good")]).await;
    assert_tried(&output, &context_url, "--context over NATS_CONTEXT");

    // -s over the context's URL.
    let mut args = with(&["--context", "closed", "-s"]);
    args.push(good.clone());
    assert_connects(&run(&args, &[]).await, "-s over --context");

    // A context that does not exist is named.
    let output = run(&with(&["--context", "nowhere"]), &[]).await;
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("nowhere.json"),
        "{}",
        stderr(&output)
    );
}

/// `serve` follows the same precedence: NATS_URL over the config file, and
/// NATS_CONTEXT over NATS_URL.
#[tokio::test]
async fn serve_follows_the_same_precedence() {
    let nats = NatsServer::start();
    let closed = [closed_port(), closed_port()];
    let [file_url, env_url] = closed
        .each_ref()
        .map(|(_, port)| format!("nats://127.0.0.1:{port}"));
    let upstream = Upstream::start().await;
    let rule = webproxy_tests::caller::accept_rule("local", &upstream);
    // Ready means connected: the config file's URL has nothing behind it.
    Service::start_with(
        &file_url,
        &rule,
        ServiceOptions::default().env("NATS_URL", &nats.url()),
    )
    .await;
    let xdg = tempfile::tempdir().expect("tempdir");
    write_context(xdg.path(), "good", &serde_json::json!({"url": nats.url()}));
    let options = ServiceOptions::default()
        .env("NATS_URL", &env_url)
        .env("NATS_CONTEXT", "good")
        .env("XDG_CONFIG_HOME", xdg.path().to_str().expect("utf8"));
    Service::start_with(&file_url, &rule, options).await;
}

/// A numeric token reaches NATS as written, from `WEBPROXY_NATS__TOKEN` (serve) and from
/// a context file (the CLI); an injected rule secret from the environment reaches the
/// upstream as written too.
#[tokio::test]
async fn secrets_from_the_environment_are_taken_as_written() {
    const TOKEN: &str = "007";
    let nats = NatsServer::start_with(&format!("authorization {{ token: \"{TOKEN}\" }}"));
    let upstream = Upstream::start().await;
    let rule = format!(
        "[[request_rules]]\nname = \"local\"\nurl_pattern = '^{}'\norigin = \"{}\"\nallow_http = true\n\
         [request_rules.inject_headers]\nX-Partner-Token = {{ env = \"PARTNER_TOKEN\" }}\n",
        upstream.url("/").replace('.', "\\."),
        upstream.url("/").trim_end_matches('/'),
    );
    let options = ServiceOptions::default()
        .env("WEBPROXY_NATS__TOKEN", TOKEN)
        .env("PARTNER_TOKEN", TOKEN);
    // Ready means connected and provisioned: the server accepted the token "007".
    let service = Service::start_with(&nats.url(), &rule, options).await;

    let dir = tempfile::tempdir().expect("tempdir");
    write_context(
        dir.path(),
        "token",
        &serde_json::json!({"url": nats.url(), "token": TOKEN}),
    );
    let url = upstream.url("/echo");
    let output = webproxy(
        &["send", "--json", "--context", "token", "GET", &url],
        &[],
        dir.path(),
    )
    .await;
    assert_connects(&output, "send with a context's token");
    let reply: serde_json::Value = serde_json::from_slice(&output.stdout).expect("reply JSON");
    assert_eq!(reply["outcome"], "response", "{reply}\n{}", service.logs());
    let echo: serde_json::Value =
        serde_json::from_str(reply["body"].as_str().expect("body")).expect("echo");
    assert_eq!(
        echo["headers"]["x-partner-token"],
        serde_json::json!([TOKEN]),
        "{echo}"
    );
    // The same token as a flag: --user alone is a token, as the nats CLI has it.
    let output = webproxy(
        &["pools", "-s", &nats.url(), "--user", TOKEN],
        &[],
        dir.path(),
    )
    .await;
    assert_connects(&output, "--user as a token");
}

#[tokio::test]
async fn a_stray_webproxy_variable_warns_and_a_misspelt_key_is_refused() {
    let h = Harness::start_with_options(
        Upstream::start().await,
        ServiceOptions::default().env("WEBPROXY_X", "1"),
        |up| webproxy_tests::caller::accept_rule("local", up),
    )
    .await;
    let reply = h.request(&envelope("GET", &h.upstream.url("/echo"))).await;
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    let logs = h.service.logs();
    assert!(
        logs.contains("WEBPROXY_X is not a configuration variable") && logs.contains("WARN"),
        "{logs}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let output = webproxy(
        &["pools", "-s", &h.nats.url()],
        &[("WEBPROXY_X", "1")],
        dir.path(),
    )
    .await;
    assert_connects(&output, "a CLI command with WEBPROXY_X");
    assert!(
        stderr(&output).contains("WEBPROXY_X is not a configuration variable"),
        "{}",
        stderr(&output)
    );

    let mut refused = Service::spawn(
        &h.nats.url(),
        "",
        ServiceOptions::default().env("WEBPROXY_NATS__PASSWRD", "pw"),
    );
    let status = refused
        .wait_exit(EXIT_TIMEOUT)
        .await
        .expect("a misspelt key stops the service");
    assert!(!status.success());
    let logs = refused.logs();
    assert!(
        logs.contains("WEBPROXY_NATS__PASSWRD is not a configuration key (nats.passwrd)"),
        "{logs}"
    );
}

/// The example nats-server configuration reads its passwords from variables that are
/// not webproxy's: a shell that starts both must not hand webproxy stray variables.
#[test]
fn the_example_server_passwords_are_not_webproxy_variables() {
    let authorization = include_str!("../../deploy/nats/authorization.conf");
    assert!(
        !authorization.contains("$WEBPROXY_"),
        "deploy/nats/authorization.conf reads a WEBPROXY_ variable"
    );
    let server = include_str!("../../deploy/nats/nats-server.conf");
    assert!(
        !server.contains("WEBPROXY_NATS_PASSWORD"),
        "deploy/nats/nats-server.conf"
    );
}

/// `--js-api-prefix` reaches the JetStream calls of the operator commands: under a
/// prefix nothing answers (no account imports a JetStream there) `pools` fails, where
/// the same command with the default `$JS.API` lists the pools.
#[tokio::test]
async fn the_js_api_prefix_flag_reaches_jetstream() {
    let nats = NatsServer::start();
    let url = nats.url();
    let dir = tempfile::tempdir().expect("tempdir");
    let pools = ["pools", "--json", "-s", &url];
    assert_connects(&webproxy(&pools, &[], dir.path()).await, "$JS.API");
    let prefixed = [&pools[..], &["--js-api-prefix", "nowhere.API"]].concat();
    let output = tokio::time::timeout(EXIT_TIMEOUT, webproxy(&prefixed, &[], dir.path()))
        .await
        .expect("pools under an unanswered prefix gave up in time");
    assert!(
        !output.status.success(),
        "pools succeeded under a prefix nothing answers: {}",
        String::from_utf8_lossy(&output.stdout)
    );
    // Refused by JetStream, not by the flag parser.
    assert!(
        stderr(&output).contains("cannot list streams"),
        "{}",
        stderr(&output)
    );
}
