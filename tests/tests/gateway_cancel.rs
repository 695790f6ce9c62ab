//! `DELETE /_webproxy/replies/<id>` through the gateway (issue 35): a request held at
//! the upstream is taken back (202 `recorded`) and its poll answers 499 `cancelled`;
//! only the route and token that made the request may cancel it, anyone else getting
//! the answer of an unknown id; a finished conversation is 200 `finished` and keeps
//! its reply; a record from a gateway that kept no message id cannot be cancelled;
//! and the deploy file's gateway user may send the cancel. Real `serve` and `gateway`
//! binaries, a real nats-server and a real HTTP upstream.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use reqwest::{RequestBuilder, Response};
use serde_json::Value;
use webproxy_tests::caller::accept_rule;
use webproxy_tests::gateway_answers::{header, token_options, token_routes};
use webproxy_tests::{
    Gate, Gateway, NatsServer, Service, ServiceOptions, Upstream, default_routes, http_client,
    wait_for, wait_until,
};

/// Generous: a loaded 2-core machine runs several services per test.
const ANSWER: Duration = Duration::from_secs(30);

/// The upstream path the gate holds until the test lets it through.
const HELD: &str = "/gated/0";

/// An id the gateway could have minted but never did.
const NEVER_MINTED: &str = "gw-0123456789abcdef0123456789abcdef";

const TOKEN_A: (&str, &str) = ("Proxy-Authorization", "Bearer alpha-secret");
const TOKEN_B: (&str, &str) = ("X-Gateway-Token", "beta-secret");

/// A nats-server, an upstream with a [`Gate`] at [`HELD`], the service accepting the
/// upstream, and a gateway with the routes `routes` makes of the upstream's root.
struct Scene {
    nats: NatsServer,
    upstream: Upstream,
    gate: Gate,
    _service: Service,
    gateway: Gateway,
}

impl Scene {
    async fn start(routes: impl FnOnce(&str) -> String, options: ServiceOptions) -> Scene {
        let nats = NatsServer::start();
        let gate = Gate::new();
        let upstream = Upstream::start_with(default_routes().merge(gate.routes())).await;
        let service = Service::start(&nats, &accept_rule("local", &upstream)).await;
        let gateway = Gateway::start_with(&nats, &routes(&upstream.url("/")), options).await;
        Scene {
            nats,
            upstream,
            gate,
            _service: service,
            gateway,
        }
    }

    /// `GET <path>` with `headers` and `Prefer: respond-async`, answered 202: its id.
    async fn accepted(&self, path: &str, headers: &[(&str, &str)]) -> String {
        let response = with(http_client().get(self.gateway.url(path)), headers)
            .header("Prefer", "respond-async")
            .send()
            .await
            .expect("the gateway answers");
        assert_eq!(response.status(), 202);
        header(&response, "webproxy-id").to_string()
    }

    /// `DELETE /_webproxy/replies/<id>` with `headers`.
    async fn cancel(&self, id: &str, headers: &[(&str, &str)]) -> Response {
        with(http_client().delete(self.replies(id)), headers)
            .send()
            .await
            .expect("the gateway answers")
    }

    /// The poll's answer for `id` once it is no longer the 202 of a reply not ready.
    async fn reply(&self, id: &str, headers: &[(&str, &str)]) -> Response {
        let url = self.replies(id);
        wait_for(ANSWER, &format!("the reply at {url}"), || async {
            let response = with(http_client().get(&url), headers).send().await.ok()?;
            (response.status() != 202).then_some(response)
        })
        .await
    }

    /// Waits until the upstream holds `count` calls at the gate: an attempt in flight.
    async fn held(&self, count: usize) {
        wait_until(ANSWER, "the attempt to reach the upstream", || async {
            self.upstream.hits_for(HELD) >= count
        })
        .await;
    }

    fn replies(&self, id: &str) -> String {
        self.gateway.url(&format!("/_webproxy/replies/{id}"))
    }

    /// The gateway's records bucket.
    async fn records(&self) -> jetstream::kv::Store {
        jetstream::new(self.nats.client().await)
            .get_key_value("WEBPROXY_GATEWAY")
            .await
            .expect("the gateway's records bucket")
    }
}

fn with(mut request: RequestBuilder, headers: &[(&str, &str)]) -> RequestBuilder {
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request
}

/// One open route `/svc`.
fn open_route(upstream: &str) -> String {
    format!("[[gateway.routes]]\npath = \"/svc\"\nupstream = \"{upstream}\"\n")
}

/// Status, headers (less `Date` and `Content-Length`, and `Webproxy-Id`, which names
/// the id asked for) and body: what tells two answers apart.
async fn comparable(response: Response) -> (u16, BTreeMap<String, String>, String) {
    let status = response.status().as_u16();
    let headers = response
        .headers()
        .iter()
        .filter(|(name, _)| !["date", "content-length", "webproxy-id"].contains(&name.as_str()))
        .map(|(name, value)| {
            let value = value.to_str().expect("text").to_string();
            (name.as_str().to_string(), value)
        })
        .collect();
    (status, headers, response.text().await.expect("body"))
}

/// `response`'s status and JSON body.
async fn json_of(response: Response) -> (u16, Value) {
    let status = response.status().as_u16();
    let body = response.bytes().await.expect("body");
    let json = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
    (status, json)
}

/// A request held at the upstream, in flight, is taken back: the DELETE is 202
/// `{"cancel":"recorded"}` (with `Location` and `Webproxy-Outcome: cancel`), and the
/// poll answers 499 with the error `cancelled` and the aborted attempt, once and for
/// good; the upstream is not called again. Both answers are counted under the route.
#[tokio::test]
async fn a_request_held_at_the_upstream_is_cancelled_and_its_poll_is_499() {
    let scene = Scene::start(open_route, ServiceOptions::default()).await;
    let id = scene.accepted(&format!("/svc{HELD}"), &[]).await;
    scene.held(1).await;

    let cancelled = scene.cancel(&id, &[]).await;
    assert_eq!(cancelled.status(), 202);
    assert_eq!(header(&cancelled, "webproxy-id"), id);
    assert_eq!(header(&cancelled, "webproxy-outcome"), "cancel");
    assert_eq!(
        header(&cancelled, "location"),
        format!("/_webproxy/replies/{id}")
    );
    assert_eq!(
        cancelled.text().await.expect("body"),
        r#"{"cancel":"recorded"}"#
    );

    let reply = scene.reply(&id, &[]).await;
    assert_eq!(header(&reply, "webproxy-outcome"), "error");
    assert_eq!(header(&reply, "webproxy-attempts"), "1");
    let (status, body) = json_of(reply).await;
    assert_eq!(status, 499, "{body}");
    assert_eq!(body["error"]["code"], "cancelled", "{body}");

    // One reply: the gate let through now finds no second attempt, and the poll
    // answers the same.
    scene.gate.open();
    let again = scene.reply(&id, &[]).await;
    assert_eq!(again.status(), 499);
    assert_eq!(scene.upstream.hits_for(HELD), 1);

    let gateway = &scene.gateway;
    for (outcome, count) in [("cancel_recorded", 1.0), ("cancelled", 2.0)] {
        let series =
            format!(r#"webproxy_gateway_requests_total{{route="/svc",outcome="{outcome}"}}"#);
        assert_eq!(gateway.metric(&series).await, Some(count), "{series}");
    }
}

/// A cancel answers only the route and token that made the request, as the poll
/// does: another route's token gets exactly the answer of an id never minted (404
/// `not_found`), no route's token 407 whatever the id, and the conversation goes on
/// to its response. Any method but GET, HEAD and DELETE is 405 naming them.
#[tokio::test]
async fn only_the_route_and_token_that_made_the_request_may_cancel_it() {
    let scene = Scene::start(token_routes, token_options()).await;
    let id = scene.accepted(&format!("/a{HELD}"), &[TOKEN_A]).await;
    scene.held(1).await;

    let unknown = comparable(scene.cancel(NEVER_MINTED, &[TOKEN_B]).await).await;
    assert_eq!(unknown.0, 404, "{unknown:?}");
    let body: Value = serde_json::from_str(&unknown.2).expect("json");
    assert_eq!(body["error"]["code"], "not_found", "{body}");
    let other = scene.cancel(&id, &[TOKEN_B]).await;
    assert_eq!(header(&other, "webproxy-id"), id);
    assert_eq!(
        comparable(other).await,
        unknown,
        "another route's token is told what an unknown id is"
    );
    for credentials in [
        &[][..],
        &[("Proxy-Authorization", "Bearer beta-secret")][..],
        &[("X-Gateway-Token", "alpha-secret")][..],
    ] {
        for asked in [id.as_str(), NEVER_MINTED] {
            let refused = scene.cancel(asked, credentials).await;
            assert_eq!(refused.status(), 407, "{credentials:?} {asked}");
            assert!(header(&refused, "proxy-authenticate").starts_with("Bearer"));
        }
    }
    let put = with(http_client().put(scene.replies(&id)), &[TOKEN_A])
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(put.status(), 405);
    assert_eq!(header(&put, "allow"), "GET, HEAD, DELETE");

    // Nothing was cancelled: let the attempt through, and the poll answers it.
    scene.gate.open();
    let reply = scene.reply(&id, &[TOKEN_A]).await;
    assert_eq!(reply.status(), 200);
    assert_eq!(reply.text().await.expect("body"), "ok");
    let series = r#"webproxy_gateway_requests_total{route="none",outcome="not_found"}"#;
    assert_eq!(scene.gateway.metric(series).await, Some(2.0), "{series}");
}

/// A finished conversation is 200 `{"cancel":"finished"}`, and its poll still
/// answers the original response. A record from a gateway that kept no message id
/// (older ones kept it only for `large_bodies` routes) is answered as an unknown id.
#[tokio::test]
async fn a_finished_conversation_is_200_finished_and_keeps_its_reply() {
    let scene = Scene::start(open_route, ServiceOptions::default()).await;
    let direct = http_client()
        .get(scene.gateway.url("/svc/echo?n=1"))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(direct.status(), 200);
    let id = header(&direct, "webproxy-id").to_string();
    let original = direct.text().await.expect("body");

    let finished = scene.cancel(&id, &[]).await;
    assert_eq!(finished.status(), 200);
    assert_eq!(header(&finished, "webproxy-outcome"), "cancel");
    assert_eq!(
        finished.text().await.expect("body"),
        r#"{"cancel":"finished"}"#
    );
    let reply = scene.reply(&id, &[]).await;
    assert_eq!(reply.status(), 200);
    assert_eq!(header(&reply, "webproxy-outcome"), "response");
    assert_eq!(reply.text().await.expect("body"), original);

    // The record as a gateway from before cancels wrote it for this route.
    let records = scene.records().await;
    let mut record: Value =
        serde_json::from_slice(&records.get(&id).await.expect("read").expect("a record"))
            .expect("json");
    assert!(
        record["msg_id"].is_string(),
        "kept for every route: {record}"
    );
    record.as_object_mut().expect("object").remove("msg_id");
    records
        .put(&id, record.to_string().into())
        .await
        .expect("write the older record");
    let older = comparable(scene.cancel(&id, &[]).await).await;
    let unknown = comparable(scene.cancel(NEVER_MINTED, &[]).await).await;
    assert_eq!(older, unknown);
    assert_eq!(older.0, 404);
    let reply = scene.reply(&id, &[]).await;
    assert_eq!(reply.status(), 200);
    assert_eq!(reply.text().await.expect("body"), original);
    assert_eq!(scene.upstream.hits_for("/echo"), 1);
    let series = r#"webproxy_gateway_requests_total{route="/svc",outcome="cancel_finished"}"#;
    assert_eq!(scene.gateway.metric(series).await, Some(1.0), "{series}");
}

/// The gateway as deploy/nats/authorization.conf's `gateway` user, beside the service
/// as its `webproxy` user: its permissions let it send the cancel, and the server
/// reports no permission violation.
#[tokio::test]
async fn the_deploy_files_gateway_user_may_cancel() {
    use webproxy_tests::authorized::{GATEWAY_USER, SERVICE_USER, service_as};
    let nats = NatsServer::start_authorized();
    let gate = Gate::new();
    let upstream = Upstream::start_with(default_routes().merge(gate.routes())).await;
    // The file's gateway user may publish only to the pool its deploy routes name.
    let service_config = format!(
        "[pools.partner]\n\n{}pool = \"partner\"\n",
        accept_rule("local", &upstream)
    );
    let _service =
        Service::start_with(&nats.url(), &service_config, service_as(SERVICE_USER)).await;
    let route = format!("{}pool = \"partner\"\n", open_route(&upstream.url("/")));
    let gateway = Gateway::start_with(&nats, &route, service_as(GATEWAY_USER)).await;
    let http = http_client();
    let accepted = http
        .get(gateway.url(&format!("/svc{HELD}")))
        .header("Prefer", "respond-async")
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(accepted.status(), 202);
    let id = header(&accepted, "webproxy-id").to_string();
    wait_until(ANSWER, "the attempt to reach the upstream", || async {
        upstream.hits_for(HELD) >= 1
    })
    .await;
    let url = gateway.url(&format!("/_webproxy/replies/{id}"));
    let cancelled = http.delete(&url).send().await.expect("the gateway answers");
    assert_eq!(cancelled.status(), 202, "{}", nats.logs());
    let reply = wait_for(ANSWER, "the cancelled reply", || async {
        let response = http.get(&url).send().await.ok()?;
        (response.status() != 202).then_some(response)
    })
    .await;
    assert_eq!(reply.status(), 499);
    assert!(
        !nats.logs().contains("Permissions Violation"),
        "{}",
        nats.logs()
    );
}
