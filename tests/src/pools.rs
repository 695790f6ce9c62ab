//! Live reconfiguration and `webproxy pools` for tests: instances in `kv` mode, a
//! cluster document pushed with `config push --wait`, and what `pools` then shows.

use serde_json::Value;

use crate::{NatsServer, run_webproxy};

/// A service config in `kv` mode, its cluster part from `cluster` (ignored once the
/// bucket holds a revision).
pub fn kv_config(cluster: &str) -> String {
    format!("[config]\nsource = \"kv\"\n\n{cluster}")
}

/// `webproxy ARGS --nats URL`'s standard output, asserting it succeeded.
async fn run(nats: &NatsServer, args: &[&str]) -> String {
    let url = nats.url();
    let mut all = args.to_vec();
    all.extend_from_slice(&["--nats", &url]);
    let output = run_webproxy(&all).await;
    assert!(
        output.status.success(),
        "webproxy {args:?} failed: {}\nstdout: {}",
        String::from_utf8_lossy(&output.stderr),
        String::from_utf8_lossy(&output.stdout)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Pushes the cluster document `document` with `config push --wait` (it returns once
/// every live instance runs it); its output.
pub async fn push_config(nats: &NatsServer, document: &str) -> String {
    push_document(nats, document, "--wait").await
}

/// Writes the cluster document `document` with `config push --force` before any
/// instance runs (a plain push is refused while no instance in kv mode would follow
/// it); the instances started next read it instead of seeding their own.
pub async fn seed_config(nats: &NatsServer, document: &str) -> String {
    push_document(nats, document, "--force").await
}

/// `config push` of `document` (from a file) with `flag`; its output.
async fn push_document(nats: &NatsServer, document: &str, flag: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, document).expect("write the document");
    let path = path.display().to_string();
    run(nats, &["config", "push", &path, flag]).await
}

/// `webproxy pools`'s standard output.
pub async fn pools(nats: &NatsServer) -> String {
    run(nats, &["pools"]).await
}

/// `pool`'s entry in `webproxy pools --json`.
pub async fn pool_json(nats: &NatsServer, pool: &str) -> Value {
    let listed: Value =
        serde_json::from_str(&run(nats, &["pools", "--json"]).await).expect("pools --json is JSON");
    listed
        .as_array()
        .and_then(|pools| pools.iter().find(|p| p["pool"] == pool))
        .cloned()
        .unwrap_or_else(|| panic!("no pool {pool} in {listed}"))
}
