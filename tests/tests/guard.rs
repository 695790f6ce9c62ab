//! The address guard end to end: the real service with its default guard, and
//! upstreams listening on the loopback addresses it must refuse, so a request that
//! slipped past the guard would show up as an upstream hit. Only loopback addresses
//! are ever used, as every test here must.

use std::net::{IpAddr, SocketAddr};

use webproxy_protocol::{ErrorCode, Outcome, Reply};
use webproxy_tests::caller::{Harness, envelope};
use webproxy_tests::{ServiceOptions, Upstream, default_routes};

/// Accepts every http URL: here only the guard stands between a request and an upstream.
const ACCEPT_ALL: &str = "[[request_rules]]\nname = \"any\"\nurl_pattern = '^http://'\n";

/// An upstream on `ip`, on the same port as `like` so one URL port reaches either.
async fn upstream_beside(ip: &str, like: &Upstream) -> Upstream {
    let ip: IpAddr = ip.parse().expect("ip");
    Upstream::start_on(SocketAddr::new(ip, like.addr().port()), default_routes()).await
}

/// A guard denial: `denied`, no attempt, and a message that names the kind of range
/// but never the address the destination resolved to, which goes to the log instead.
#[track_caller]
fn assert_denied(reply: &Reply, url: &str, address: &str, kind: &str) {
    assert_eq!(reply.outcome, Outcome::Error, "{url}: {reply:?}");
    let error = reply.error.as_ref().expect("error");
    assert_eq!(error.code, ErrorCode::Denied, "{url}: {error:?}");
    assert!(
        error.message.starts_with("destination not allowed") && error.message.contains(kind),
        "{url}: the message should say the destination is not allowed and name {kind}: {}",
        error.message
    );
    assert!(
        !error.message.contains(address),
        "{url}: the message names the address {address}: {}",
        error.message
    );
    assert_eq!(
        reply.attempts, 0,
        "{url}: a refused destination is no attempt"
    );
}

#[tokio::test]
async fn loopback_in_every_spelling_is_denied_by_default() {
    let h = Harness::start_with_options(Upstream::start().await, ServiceOptions::guarded(), |_| {
        ACCEPT_ALL.to_string()
    })
    .await;
    let v6 = upstream_beside("::1", &h.upstream).await;
    let port = h.upstream.addr().port();
    let cases = [
        ("127.0.0.1", "127.0.0.1", "loopback"),
        ("[::1]", "::1", "loopback"),
        // Decimal, octal, hex, short: the URL parser turns each into 127.0.0.1.
        ("2130706433", "127.0.0.1", "loopback"),
        ("0177.0.0.1", "127.0.0.1", "loopback"),
        ("0x7f.0.0.1", "127.0.0.1", "loopback"),
        ("0x7f000001", "127.0.0.1", "loopback"),
        ("127.1", "127.0.0.1", "loopback"),
        (
            "[::ffff:127.0.0.1]",
            "127.0.0.1",
            "loopback, as the IPv4 address embedded",
        ),
        ("0.0.0.0", "0.0.0.0", "unspecified"),
        // A name that resolves to loopback (`localhost` is 127.0.0.1 and ::1 without a
        // lookup): the reply does not tell what it resolved to.
        ("localhost", "127.0.0.1", "loopback"),
        ("localhost", "::1", "loopback"),
    ];
    for (host, address, kind) in cases {
        let url = format!("http://{host}:{port}/echo");
        let reply = h.request(&envelope("GET", &url)).await;
        assert_denied(&reply, &url, address, kind);
    }
    // The log has what the caller is not told.
    let logs = h.service.logs();
    assert!(
        logs.lines().any(
            |line| line.contains("the address guard refused a destination")
                && line.contains("localhost")
                && line.contains("loopback")
        ),
        "the denial of localhost is not logged with its address:\n{logs}"
    );
    assert_eq!(h.upstream.hits(), 0, "a denied request reached 127.0.0.1");
    assert_eq!(v6.hits(), 0, "a denied request reached ::1");
    let letters = h.wait_dead_letters(cases.len()).await;
    assert!(
        letters
            .iter()
            .all(|(_, l)| l.error.code == ErrorCode::Denied && l.attempts.is_empty()),
        "{letters:?}"
    );
}

#[tokio::test]
async fn allow_cidrs_open_exactly_the_listed_range() {
    let base = Upstream::start().await;
    let opened = upstream_beside("127.0.0.2", &base).await;
    let neighbour = upstream_beside("127.0.0.3", &base).await;
    let h = Harness::start_with_options(base, ServiceOptions::guarded(), |_| {
        format!("[outbound]\nallow_cidrs = [\"127.0.0.2/32\"]\n\n{ACCEPT_ALL}")
    })
    .await;
    let port = opened.addr().port();

    let reply = h
        .request(&envelope("GET", &format!("http://127.0.0.2:{port}/echo")))
        .await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    assert_eq!(reply.attempts, 1);
    assert_eq!(opened.hits(), 1);

    for host in ["127.0.0.3", "127.0.0.1"] {
        let url = format!("http://{host}:{port}/echo");
        let reply = h.request(&envelope("GET", &url)).await;
        assert_denied(&reply, &url, host, "loopback");
    }
    assert_eq!(neighbour.hits(), 0);
    assert_eq!(h.upstream.hits(), 0);
}

/// An allow on the IPv4-mapped prefix `::ffff:0:0/96` is applied after the embedded
/// IPv4 address is unwrapped, so it does not open `[::ffff:127.0.0.1]`, which would
/// reach the upstream on 127.0.0.1. Loopback only, as every test here.
#[tokio::test]
async fn an_allow_on_an_embedding_prefix_opens_no_embedded_loopback() {
    let h = Harness::start_with_options(Upstream::start().await, ServiceOptions::guarded(), |_| {
        format!("[outbound]\nallow_cidrs = [\"::ffff:0:0/96\"]\n\n{ACCEPT_ALL}")
    })
    .await;
    let port = h.upstream.addr().port();
    for host in ["[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "127.0.0.1"] {
        let url = format!("http://{host}:{port}/echo");
        let reply = h.request(&envelope("GET", &url)).await;
        assert_denied(&reply, &url, "127.0.0.1", "loopback");
    }
    assert_eq!(
        h.upstream.hits(),
        0,
        "an embedded loopback address was called"
    );
}

#[tokio::test]
async fn deny_cidrs_win_over_allowed_private_networks() {
    let h = Harness::start_with_options(Upstream::start().await, ServiceOptions::guarded(), |_| {
        format!(
            "[outbound]\nallow_private_networks = true\ndeny_cidrs = [\"127.0.0.1\"]\n\n{ACCEPT_ALL}"
        )
    })
    .await;
    let url = h.upstream.url("/echo");
    let reply = h.request(&envelope("GET", &url)).await;
    assert_eq!(
        reply.error.as_ref().map(|e| e.message.as_str()),
        Some("destination not allowed ([outbound] deny_cidrs)"),
        "{reply:?}"
    );
    assert_eq!(reply.attempts, 0);
    assert_eq!(h.upstream.hits(), 0);
}

/// Proxy settings in the environment are ignored: with one pointing at a loopback
/// "proxy", the request still goes straight to the upstream.
#[tokio::test]
async fn environment_proxies_are_ignored() {
    let proxy = Upstream::start().await;
    let proxy_url = proxy.url("");
    let mut options = ServiceOptions::default();
    for var in ["HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "ALL_PROXY"] {
        options = options.env(var, &proxy_url);
    }
    let h =
        Harness::start_with_options(Upstream::start().await, options, |_| ACCEPT_ALL.to_string())
            .await;
    let reply = h.request(&envelope("GET", &h.upstream.url("/echo"))).await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    assert_eq!(h.upstream.hits(), 1);
    assert_eq!(
        proxy.hits(),
        0,
        "the request went through the environment's proxy"
    );
}
