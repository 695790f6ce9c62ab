//! Issue 30's point 8 end to end: host name lookups are bounded. The service asks a DNS
//! server on loopback that reads every query and never answers ([`SilentDns`], named
//! by `[outbound] dns_servers`, so nothing leaves the machine). Lookups used to run
//! getaddrinfo on tokio's blocking threads, which no timeout stops: a slow
//! authoritative server under a wildcard rule could take every one of them.

use std::time::Duration;

use tokio::time::Instant;
use webproxy_protocol::{Outcome, Reply};
use webproxy_tests::caller::{Harness, envelope};
use webproxy_tests::{SilentDns, process, wait_until};

/// The lookups' bound in this test: long enough that the two requests sent meanwhile
/// are answered well within it on a loaded machine.
const DNS_TIMEOUT: Duration = Duration::from_secs(5);
/// Lookups at once; the test asks for more, so some find every slot taken. More than
/// the threads the service may gain meanwhile (`SPARE_THREADS`), so that lookups
/// holding a thread each would show even under the cap.
const DNS_SLOTS: usize = 8;
/// Threads the service may start for other reasons while the lookups stall.
const SPARE_THREADS: u64 = 2;
/// Concurrent requests to names the silent server never answers.
const STALLED: usize = 24;
/// What a loaded 2-core machine may add to a bound: publishing, the pull, the reply.
const MARGIN: Duration = Duration::from_secs(3);

/// With the silent server taking every lookup, `STALLED` requests to names of their
/// own each fail within `dns_timeout` (plus a margin) with a reply naming DNS and the
/// key; the service's thread count does not grow with them (getaddrinfo would hold a
/// blocking thread per lookup); and a request to 127.0.0.1 and one to `localhost`,
/// sent while every lookup slot is taken, are answered at once. The failures are
/// counted by reason: the first `DNS_SLOTS` as timeouts, the rest as busy.
#[tokio::test]
async fn a_resolver_that_never_answers_fails_attempts_within_its_timeout_and_holds_no_thread() {
    let dns = SilentDns::start().await;
    let h = Harness::start(|_| {
        format!(
            "[outbound]\ndns_timeout = \"{}s\"\ndns_max_concurrent = {DNS_SLOTS}\n\
             dns_servers = [\"{}\"]\n\n\
             [[request_rules]]\nname = \"any\"\nurl_pattern = '^http://'\nmax_retries = 0\n",
            DNS_TIMEOUT.as_secs(),
            dns.addr(),
        )
    })
    .await;
    let pid = h.service.pid();
    let threads_before = process::threads(pid).expect("the service's threads");
    let port = h.upstream.addr().port();

    let started = Instant::now();
    let stalled: Vec<_> = (0..STALLED)
        .map(|i| {
            let request = envelope("GET", &format!("http://slow-{i}.test:{port}/echo"));
            let client = h.client.clone();
            tokio::spawn(async move {
                let request =
                    webproxy_client::Request::from_envelope(request).wait(DNS_TIMEOUT + MARGIN * 2);
                let reply = client.request(&request).await;
                (reply, Instant::now())
            })
        })
        .collect();

    // Every slot is taken once the server has seen a query for each.
    wait_until(
        MARGIN,
        "the service's lookups to reach the silent server",
        || {
            let seen = dns.queries();
            async move { seen >= DNS_SLOTS }
        },
    )
    .await;
    let threads_stalled = process::threads(pid).expect("the service's threads");

    for url in [
        h.upstream.url("/echo"),
        format!("http://localhost:{port}/echo"),
    ] {
        let asked = Instant::now();
        let reply = h.request(&envelope("GET", &url)).await;
        assert_eq!(reply.status, Some(200), "{url}: {reply:?}");
        assert!(
            asked.elapsed() < DNS_TIMEOUT * 2 / 5,
            "{url} waited {:?} behind the stalled lookups",
            asked.elapsed()
        );
    }
    assert!(
        stalled.iter().all(|task| !task.is_finished()),
        "the stalled lookups ended before the other requests were answered: the test \
         proves nothing on a machine this slow"
    );

    let mut timeouts = 0;
    let mut busy = 0;
    for task in stalled {
        let (reply, at) = task.await.expect("request task");
        let reply: Reply = reply.expect("a reply");
        let took = at - started;
        assert!(
            took < DNS_TIMEOUT + MARGIN,
            "failed after {took:?}: {reply:?}"
        );
        assert_eq!(reply.outcome, Outcome::Error, "{reply:?}");
        let message = reply.error.map(|e| e.message).unwrap_or_default();
        assert!(message.contains("DNS lookup of slow-"), "{message}");
        if message.contains("dns_max_concurrent") {
            busy += 1;
        } else {
            assert!(message.contains("dns_timeout"), "{message}");
            timeouts += 1;
        }
    }
    assert_eq!(
        timeouts + busy,
        STALLED,
        "every stalled request failed on DNS"
    );
    assert!(timeouts >= DNS_SLOTS, "{timeouts} timeouts, {busy} busy");
    assert!(busy >= 1, "{timeouts} timeouts, {busy} busy");
    // getaddrinfo would have held one blocking thread per lookup under way.
    assert!(
        threads_stalled <= threads_before + SPARE_THREADS,
        "the service went from {threads_before} to {threads_stalled} threads while {DNS_SLOTS}+ lookups stalled"
    );

    let metric = |reason: &str| {
        let service = &h.service;
        let series = format!("webproxy_dns_lookup_failures_total{{reason=\"{reason}\"}}");
        async move { service.metric(&series).await.unwrap_or_default() }
    };
    assert_eq!(metric("timeout").await, timeouts as f64);
    assert_eq!(metric("busy").await, busy as f64);
    assert_eq!(metric("error").await, 0.0);
}
