//! NATS authentication and TLS: the service against a nats-server that requires a
//! user and password, and one that requires TLS with client certificates from a CA
//! made at test time.

use std::process::Command;

use webproxy_client::Client;
use webproxy_protocol::Outcome;
use webproxy_tests::caller::{REPLY_TIMEOUT, accept_rule, envelope, to};
use webproxy_tests::{NatsServer, Service, ServiceOptions, TestCa, Upstream, webproxy_bin};

const PASSWORD: &str = "nats-pw-5b81e2";

async fn round_trip(nats: async_nats::Client, upstream: &Upstream, service: &Service) {
    let client = Client::new(nats, "webproxy").expect("client");
    let reply = client
        .request(&to("default", &envelope("GET", &upstream.url("/echo"))).wait(REPLY_TIMEOUT))
        .await
        .unwrap_or_else(|e| panic!("no reply: {e}\n{}", service.logs()));
    assert_eq!(reply.outcome, Outcome::Response, "{reply:?}");
    assert_eq!(reply.status, Some(200));
}

#[tokio::test]
async fn user_and_password() {
    let nats = NatsServer::start_with(&format!(
        "authorization {{ user: webproxy, password: \"{PASSWORD}\" }}"
    ));
    let upstream = Upstream::start().await;
    let options = ServiceOptions::default()
        .env("WEBPROXY_NATS__USER", "webproxy")
        .env("WEBPROXY_NATS__PASSWORD", PASSWORD)
        .env("RUST_LOG", "debug");
    let service = Service::start_with(&nats.url(), &accept_rule("local", &upstream), options).await;
    let client = nats
        .client_with(|| {
            async_nats::ConnectOptions::with_user_and_password("webproxy".into(), PASSWORD.into())
        })
        .await;
    round_trip(client, &upstream, &service).await;
    assert!(
        !service.logs().contains(PASSWORD),
        "the password is in the log"
    );

    // Without the password the server refuses webproxy's client commands.
    let output = Command::new(webproxy_bin())
        .args(["send", "--nats", &nats.url(), "GET", &upstream.url("/echo")])
        .env("WEBPROXY_NATS__USER", "webproxy")
        .env("WEBPROXY_NATS__PASSWORD", "wrong")
        .output()
        .expect("run send");
    assert!(!output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stderr).contains("cannot connect to NATS"),
        "{output:?}"
    );
}

#[tokio::test]
async fn tls_with_a_test_ca_and_client_certificates() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = TestCa::generate(dir.path());
    let quote =
        |p: &std::path::Path| serde_json::to_string(p.to_str().expect("utf8")).expect("json");
    let nats = NatsServer::start_with(&format!(
        "tls {{\n  cert_file: {}\n  key_file: {}\n  ca_file: {}\n  verify: true\n  timeout: 5\n}}",
        quote(&ca.server_cert),
        quote(&ca.server_key),
        quote(&ca.ca),
    ));
    let upstream = Upstream::start().await;
    let options = ServiceOptions::default()
        .env("WEBPROXY_NATS__TLS_CA_FILE", ca.ca.to_str().expect("utf8"))
        .env(
            "WEBPROXY_NATS__TLS_CERT_FILE",
            ca.client_cert.to_str().expect("utf8"),
        )
        .env(
            "WEBPROXY_NATS__TLS_KEY_FILE",
            ca.client_key.to_str().expect("utf8"),
        );
    let service = Service::start_with(&nats.url(), &accept_rule("local", &upstream), options).await;
    let client = nats
        .client_with(|| {
            async_nats::ConnectOptions::new()
                .add_root_certificates(ca.ca.clone())
                .add_client_certificate(ca.client_cert.clone(), ca.client_key.clone())
                .require_tls(true)
        })
        .await;
    round_trip(client, &upstream, &service).await;

    // Without the CA the server's certificate is not trusted.
    let output = Command::new(webproxy_bin())
        .args(["send", "--nats", &nats.url(), "GET", &upstream.url("/echo")])
        .output()
        .expect("run send");
    assert!(!output.status.success(), "{output:?}");

    // A missing file is named at start.
    let output = Command::new(webproxy_bin())
        .args(["check-config"])
        .env("WEBPROXY_NATS__TLS_CA_FILE", "/nonexistent/ca.pem")
        .output()
        .expect("run check-config");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("nats.tls_ca_file") && stderr.contains("/nonexistent/ca.pem"),
        "{stderr}"
    );
}
