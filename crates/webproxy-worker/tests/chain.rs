//! The whole chain in-process, without NATS: redirects followed within the budget with
//! method and body per status, every leg asked of the policy and guarded again, leg
//! URLs canonical, credentials only on their own leg and only at its origin, and the
//! outcome's messages redacted. A test policy stands in for the dispatcher's rules and
//! secrets. Upstreams listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 only.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderMap, Method as HttpMethod, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use tokio::net::TcpListener;
use url::Url;
use webproxy_protocol::Method;
use webproxy_worker::{
    AttemptOutcome, Chain, ChainRequest, Denial, GuardPolicy, Leg, LegPolicy, Worker, WorkerConfig,
};

/// One request an upstream saw: which upstream, method, path, headers (lower case),
/// body.
#[derive(Debug, Clone)]
struct Seen {
    upstream: &'static str,
    method: String,
    path: String,
    headers: Vec<(String, String)>,
    body: String,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

type Log = Arc<Mutex<Vec<Seen>>>;

fn seen(log: &Log) -> Vec<Seen> {
    log.lock().expect("lock").clone()
}

/// `/to/{code}?url=...` answers `code` with `Location: url`; every other path is
/// recorded in `log` and answered 200.
fn upstream_app(name: &'static str, log: Log) -> Router {
    Router::new().fallback(
        move |method: HttpMethod, uri: Uri, headers: HeaderMap, body: Bytes| {
            let log = log.clone();
            async move {
                if let Some(code) = uri.path().strip_prefix("/to/") {
                    let status = code
                        .parse()
                        .ok()
                        .and_then(|c| StatusCode::from_u16(c).ok())
                        .unwrap_or(StatusCode::BAD_REQUEST);
                    let location =
                        url::form_urlencoded::parse(uri.query().unwrap_or("").as_bytes())
                            .find(|(k, _)| k == "url")
                            .map(|(_, v)| v.into_owned());
                    let mut response: Response = (status, "redirecting").into_response();
                    if let Some(Ok(location)) = location.map(|l| l.parse()) {
                        response.headers_mut().insert("location", location);
                    }
                    return response;
                }
                log.lock().expect("lock").push(Seen {
                    upstream: name,
                    method: method.to_string(),
                    path: uri.path().to_string(),
                    headers: headers
                        .iter()
                        .map(|(n, v)| {
                            (
                                n.as_str().to_string(),
                                String::from_utf8_lossy(v.as_bytes()).into_owned(),
                            )
                        })
                        .collect(),
                    body: String::from_utf8_lossy(&body).into_owned(),
                });
                "seen".into_response()
            }
        },
    )
}

/// An upstream named `name` on `ip`:`port` (0 for any).
async fn upstream(name: &'static str, ip: &str, port: u16, log: &Log) -> SocketAddr {
    let listener = TcpListener::bind((ip, port)).await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = upstream_app(name, log.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

fn url_of(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}{path}")
}

/// `base` redirecting with `code` to `target`.
fn to(base: SocketAddr, code: u16, target: &str) -> String {
    let encoded: String = url::form_urlencoded::byte_serialize(target.as_bytes()).collect();
    url_of(base, &format!("/to/{code}?url={encoded}"))
}

/// The rules and secrets of a test: the first leg whose URL prefix matches, or a
/// denial; every URL asked is kept.
#[derive(Default)]
struct Rules {
    legs: Vec<(String, Leg)>,
    secrets: Vec<String>,
    asked: Mutex<Vec<String>>,
}

impl Rules {
    fn with(mut self, prefix: &str, leg: Leg) -> Rules {
        self.legs.push((prefix.to_string(), leg));
        self
    }

    fn first(&self) -> Leg {
        self.legs
            .first()
            .map(|(_, leg)| leg.clone())
            .unwrap_or_default()
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().expect("lock").clone()
    }
}

impl LegPolicy for Rules {
    fn leg(&self, method: Method, url: &Url) -> Result<Leg, Denial> {
        self.asked
            .lock()
            .expect("lock")
            .push(format!("{method} {url}"));
        self.legs
            .iter()
            .find(|(prefix, _)| url.as_str().starts_with(prefix.as_str()))
            .map(|(_, leg)| leg.clone())
            .filter(|_| !url.path().contains(';'))
            .ok_or_else(|| Denial {
                message: format!("no leg for {method} {url}"),
                // As the dispatcher's rules refuse a ';' no rule allows.
                invalid: url.path().contains(';'),
            })
    }

    fn redact<'t>(&self, text: &'t str) -> Cow<'t, str> {
        let mut out = Cow::Borrowed(text);
        for secret in &self.secrets {
            if out.contains(secret.as_str()) {
                out = Cow::Owned(out.replace(secret.as_str(), "[REDACTED]"));
            }
        }
        out
    }
}

fn leg(rule: &str, follow_redirects: u32) -> Leg {
    Leg {
        rule: rule.into(),
        follow_redirects,
        ..Leg::default()
    }
}

/// A worker whose guard opens exactly 127.0.0.2 and 127.0.0.3: the rest of 127/8
/// stays denied as loopback.
fn worker() -> Worker {
    let mut config = WorkerConfig::new(64 * 1024);
    config.guard = GuardPolicy {
        allow_private_networks: false,
        allow: vec![
            "127.0.0.2/32".parse().expect("net"),
            "127.0.0.3/32".parse().expect("net"),
        ],
        deny: Vec::new(),
    };
    Worker::new(&config).expect("client")
}

fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

/// Runs a chain of `method url` with `headers` and `body` under `rules`, starting with
/// its first leg.
async fn perform(
    rules: &Rules,
    method: Method,
    url: &str,
    headers: &[(String, String)],
    body: &'static str,
) -> Chain {
    let url = webproxy_protocol::canonical_url(Url::parse(url).expect("url")).expect("canonical");
    worker()
        .perform(
            rules,
            rules.first(),
            ChainRequest {
                method,
                url: &url,
                headers,
                body: Bytes::from_static(body.as_bytes()),
                own_headers: &pairs(&[("Idempotency-Key", "own")]),
                timeout: Duration::from_secs(5),
            },
        )
        .await
}

fn status(chain: &Chain) -> Option<u16> {
    match &chain.outcome {
        AttemptOutcome::Response(r) => Some(r.status),
        _ => None,
    }
}

fn denied(chain: &Chain) -> &str {
    match &chain.outcome {
        AttemptOutcome::Denied { message } => message,
        other => panic!("expected a denial, got {other:?}"),
    }
}

#[tokio::test]
async fn methods_bodies_and_the_budget() {
    let log = Log::default();
    let up = upstream("up", "127.0.0.2", 0, &log).await;
    let rules = Rules::default().with(&url_of(up, "/"), leg("local", 2));
    let echo = url_of(up, "/echo");
    let content = pairs(&[
        ("Content-Type", "text/plain"),
        ("Idempotency-Key", "caller"),
    ]);
    for (code, method, body) in [
        (301, "GET", ""),
        (302, "GET", ""),
        (303, "GET", ""),
        (307, "POST", "payload"),
        (308, "POST", "payload"),
    ] {
        let chain = perform(
            &rules,
            Method::Post,
            &to(up, code, &echo),
            &content,
            "payload",
        )
        .await;
        assert_eq!(status(&chain), Some(200), "{code}: {chain:?}");
        assert_eq!(chain.redirects, 1);
        let last = seen(&log).pop().expect("seen");
        assert_eq!(
            (last.method.as_str(), last.body.as_str()),
            (method, body),
            "{code}"
        );
        assert_eq!(
            last.header("content-type").is_some(),
            !body.is_empty(),
            "{code}: {last:?}"
        );
        // Webproxy's own header replaces the caller's on every leg.
        assert_eq!(last.header("idempotency-key"), Some("own"));
    }

    // Two redirects are followed; the third 3xx comes back as the response.
    let before = seen(&log).len();
    let three = to(up, 302, &to(up, 302, &to(up, 302, &echo)));
    let chain = perform(&rules, Method::Get, &three, &[], "").await;
    assert_eq!((status(&chain), chain.redirects), (Some(302), 2));
    assert_eq!(seen(&log).len(), before);
    let two = to(up, 302, &to(up, 302, &echo));
    assert_eq!(
        status(&perform(&rules, Method::Get, &two, &[], "").await),
        Some(200)
    );

    // No budget: the redirect itself is the answer, and the policy is never asked.
    let rules = Rules::default().with(&url_of(up, "/"), leg("local", 0));
    let chain = perform(&rules, Method::Get, &to(up, 302, &echo), &[], "").await;
    assert_eq!((status(&chain), chain.redirects), (Some(302), 0));
    assert!(rules.asked().is_empty(), "{:?}", rules.asked());
}

#[tokio::test]
async fn every_leg_is_asked_of_the_policy_and_guarded_again() {
    let log = Log::default();
    let allowed = upstream("allowed", "127.0.0.2", 0, &log).await;
    let port = allowed.port();
    let loopback = upstream("loopback", "127.0.0.1", port, &log).await;
    let unruled = upstream("unruled", "127.0.0.3", port, &log).await;
    let rules = Rules::default()
        .with(&url_of(allowed, "/"), leg("allowed", 5))
        .with(&url_of(loopback, "/"), leg("to-loopback", 0));

    // The policy accepts the loopback leg; the guard does not, and the caller is told
    // the kind of range, never the address.
    let chain = perform(
        &rules,
        Method::Get,
        &to(allowed, 302, &url_of(loopback, "/echo")),
        &[],
        "",
    )
    .await;
    assert_eq!(denied(&chain), "destination not allowed (loopback)");
    assert!(chain.connected, "the first leg was an attempt");
    // The same through the decimal spelling of 127.0.0.1, canonical before it is asked.
    let decimal = format!("http://2130706433:{port}/echo");
    let chain = perform(&rules, Method::Get, &to(allowed, 307, &decimal), &[], "").await;
    assert_eq!(denied(&chain), "destination not allowed (loopback)");
    assert!(
        rules
            .asked()
            .contains(&format!("GET http://127.0.0.1:{port}/echo")),
        "{:?}",
        rules.asked()
    );

    // The guard allows it; no rule does.
    let chain = perform(
        &rules,
        Method::Get,
        &to(allowed, 302, &url_of(unruled, "/echo")),
        &[],
        "",
    )
    .await;
    let message = denied(&chain);
    assert!(
        message.starts_with(&format!("redirect from http://{allowed}/to/302"))
            && message.ends_with(&format!("no leg for GET http://127.0.0.3:{port}/echo")),
        "{message}"
    );

    // Off http(s).
    let chain = perform(
        &rules,
        Method::Get,
        &to(allowed, 302, "file:///etc/passwd"),
        &[],
        "",
    )
    .await;
    assert!(
        denied(&chain).contains("not an http or https URL"),
        "{chain:?}"
    );

    // A first leg the guard refuses is no attempt at all.
    let rules = Rules::default().with(&url_of(loopback, "/"), leg("to-loopback", 0));
    let chain = perform(&rules, Method::Get, &url_of(loopback, "/echo"), &[], "").await;
    assert_eq!(denied(&chain), "destination not allowed (loopback)");
    assert!(!chain.connected);

    let reached: Vec<&str> = seen(&log)
        .iter()
        .map(|s| s.upstream)
        .filter(|u| *u != "allowed")
        .collect();
    assert!(reached.is_empty(), "a leg reached {reached:?}");
}

#[tokio::test]
async fn redirect_legs_are_canonical_and_refused_like_a_callers_url() {
    let log = Log::default();
    let up = upstream("up", "127.0.0.2", 0, &log).await;
    let rules = Rules::default().with(&url_of(up, "/"), leg("local", 2));

    let chain = perform(
        &rules,
        Method::Get,
        &to(up, 302, &url_of(up, "/%61dmin/")),
        &[],
        "",
    )
    .await;
    assert_eq!(status(&chain), Some(200), "{chain:?}");
    assert_eq!(rules.asked(), [format!("GET http://{up}/admin/")]);
    assert_eq!(seen(&log).pop().map(|s| s.path).as_deref(), Some("/admin/"));

    let port = up.port();
    for (target, why) in [
        (
            format!("http://u:secret@127.0.0.2:{port}/echo"),
            "user information",
        ),
        (
            format!("http://u@127.0.0.2:{port}/echo"),
            "user information",
        ),
        (url_of(up, "//echo"), "empty path segment"),
        (url_of(up, "/x%2Fecho"), "%2F"),
        (url_of(up, "/x/..;/echo"), "';' parameter"),
        (url_of(up, "/x/%2e%2e%3b/echo"), "';' parameter"),
        // Refused by the policy, which knows whether the rule allows a ';'.
        (url_of(up, "/echo;jsessionid=x"), "no leg for"),
    ] {
        let chain = perform(&rules, Method::Get, &to(up, 302, &target), &[], "").await;
        match &chain.outcome {
            AttemptOutcome::Invalid { message } => {
                assert!(message.contains(why), "{target}: {message}");
                assert!(!message.contains("secret"), "{message}");
            }
            other => panic!("{target}: {other:?}"),
        }
        assert!(chain.connected, "the first leg was an attempt");
    }
    assert!(
        seen(&log).iter().all(|s| s.path == "/admin/"),
        "{:?}",
        seen(&log)
    );
}

/// Two recording upstreams on the same port of two loopback addresses: one origin
/// each, which only the host tells apart.
async fn two_origins_on_one_port(log: &Log) -> (SocketAddr, SocketAddr) {
    let first = upstream("first", "127.0.0.2", 0, log).await;
    let other = upstream("other", "127.0.0.3", first.port(), log).await;
    (first, other)
}

fn injecting(origin: SocketAddr, follow_redirects: u32) -> Leg {
    Leg {
        rule: "partner".into(),
        drop_headers: vec!["x-dropped".into()],
        inject: pairs(&[("X-Api-Key", "k-123")]),
        origin: Some(Url::parse(&url_of(origin, "/")).expect("url").origin()),
        follow_redirects,
    }
}

fn credentials(seen: &Seen) -> Vec<String> {
    seen.headers
        .iter()
        .filter(|(n, _)| {
            ["authorization", "x-api-key", "cookie", "x-dropped"].contains(&n.as_str())
        })
        .map(|(n, v)| format!("{n}: {v}"))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect()
}

#[tokio::test]
async fn injected_credentials_stay_with_their_leg_and_origin() {
    let log = Log::default();
    let (first, other) = two_origins_on_one_port(&log).await;
    let rules = Rules::default()
        .with(&url_of(first, "/"), injecting(first, 3))
        .with(&url_of(other, "/"), leg("other", 0));
    let caller = pairs(&[
        ("Authorization", "Bearer caller"),
        ("Cookie", "session=caller"),
        ("X-Api-Key", "caller-key"),
        ("X-Dropped", "no"),
    ]);

    // Same origin, same leg: the key replaces the caller's, and the caller's
    // credentials go along.
    let chain = perform(
        &rules,
        Method::Get,
        &to(first, 302, &url_of(first, "/who")),
        &caller,
        "",
    )
    .await;
    assert_eq!(status(&chain), Some(200), "{chain:?}");
    // Another origin, a leg that injects nothing: neither goes along.
    let chain = perform(
        &rules,
        Method::Get,
        &to(first, 307, &url_of(other, "/who")),
        &caller,
        "",
    )
    .await;
    assert_eq!(status(&chain), Some(200), "{chain:?}");

    let seen: Vec<(&str, Vec<String>)> = seen(&log)
        .iter()
        .map(|s| (s.upstream, credentials(s)))
        .collect();
    assert_eq!(
        seen,
        [
            (
                "first",
                vec![
                    "authorization: Bearer caller".to_string(),
                    "cookie: session=caller".to_string(),
                    "x-api-key: k-123".to_string(),
                ]
            ),
            // The other leg drops and injects nothing: the caller's own key goes.
            (
                "other",
                vec![
                    "x-api-key: caller-key".to_string(),
                    "x-dropped: no".to_string()
                ]
            ),
        ]
    );
}

/// A policy that hands out the injecting leg for any URL: the worker still sends it
/// only to its origin, neither with the credential nor without it elsewhere.
#[tokio::test]
async fn an_injecting_leg_goes_only_to_its_origin_whatever_the_policy_says() {
    let log = Log::default();
    let (first, other) = two_origins_on_one_port(&log).await;
    let rules = Rules::default().with("http://127.0.0.", injecting(first, 2));
    let chain = perform(
        &rules,
        Method::Get,
        &to(first, 307, &url_of(other, "/who")),
        &[],
        "",
    )
    .await;
    let message = denied(&chain);
    assert!(
        message.contains(&format!(
            "bound to origin http://{first}, not http://{other}"
        )),
        "{message}"
    );
    assert!(chain.connected);

    // As a first leg too, and an injecting leg without an origin goes nowhere.
    let chain = perform(&rules, Method::Get, &url_of(other, "/who"), &[], "").await;
    assert!(denied(&chain).contains("bound to origin"), "{chain:?}");
    assert!(!chain.connected);
    let unbound = Leg {
        origin: None,
        ..injecting(first, 0)
    };
    let rules = Rules::default().with("http://127.0.0.", unbound);
    let chain = perform(&rules, Method::Get, &url_of(first, "/who"), &[], "").await;
    assert!(denied(&chain).contains("names no origin"), "{chain:?}");
    assert!(seen(&log).is_empty(), "{:?}", seen(&log));
}

#[tokio::test]
async fn the_outcomes_messages_are_redacted() {
    let log = Log::default();
    let up = upstream("up", "127.0.0.2", 0, &log).await;
    let rules = Rules {
        secrets: vec!["tok-55".into()],
        ..Rules::default()
    }
    .with(&url_of(up, "/"), leg("local", 1));
    // The denial quotes the URL, and the URL holds the secret.
    let chain = perform(
        &rules,
        Method::Get,
        &to(up, 302, "http://127.0.0.3/?k=tok-55"),
        &[],
        "",
    )
    .await;
    let message = denied(&chain);
    assert!(
        !message.contains("tok-55") && message.contains("[REDACTED]"),
        "{message}"
    );
}
