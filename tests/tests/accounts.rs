//! deploy/nats/authorization.conf's accounts (issue 18, point 8), applied as shipped:
//! webproxy's account WEBPROXY holds the service and operator users, and the callers'
//! account CALLERS imports only the request subjects and the callers' reply spaces.
//! A caller is served across the boundary, by a pool that an operator's push added
//! without any permission change, and nothing service-only reaches the callers'
//! account, whatever a user there may do.

use async_nats::RequestErrorKind;
use futures::FutureExt as _;
use futures::StreamExt as _;
use serde_json::{Value, json};
use webproxy_client::new_id;
use webproxy_protocol::Reply;
use webproxy_tests::authorized::{
    ADMIN, CALLERS_ADMIN, Caller, SERVICE_USER, as_operator, connect_as, service_as, violation,
};
use webproxy_tests::caller::{REPLY_TIMEOUT, next_message, path_rule};
use webproxy_tests::{NatsServer, Service, Upstream};

/// A service in kv mode, as the file's `webproxy` user, on a bucket whose document the
/// file's `operator` pushed: it adds the pool `partner`, which the file's permissions
/// name nowhere, and sends every request there (a request to `default` is moved).
struct Scene {
    nats: NatsServer,
    upstream: Upstream,
    service: Service,
}

impl Scene {
    async fn start() -> Scene {
        let nats = NatsServer::start_authorized();
        let upstream = Upstream::start().await;
        let document = format!(
            "[outbound]\nallow_private_networks = true\n\n[pools.partner]\nmax_in_flight = 4\n\n{}pool = \"partner\"\n",
            path_rule("partner", &upstream, "/")
        );
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("cluster.toml");
        std::fs::write(&file, document).expect("write the document");
        let pushed = as_operator(
            &nats,
            &[
                "config",
                "push",
                // Before the service starts: nothing follows it yet.
                "--force",
                &file.display().to_string(),
                "--message",
                "partner",
            ],
        )
        .await;
        assert!(pushed.contains("revision 1"), "{pushed}");
        // The callers' reply spaces are the one subject space CALLERS imports.
        let config = "[config]\nsource = \"kv\"\n\n\
                      [streams]\nreply_to_allow = [\"callers.{caller}.replies.>\"]\n";
        let service = Service::start_with(&nats.url(), config, service_as(SERVICE_USER)).await;
        Scene {
            nats,
            upstream,
            service,
        }
    }

    /// `caller` sends a GET of /echo to `pool`, answered to its own reply space; the
    /// reply.
    async fn served(&self, caller: &Caller, pool: &str) -> Reply {
        let id = new_id();
        let envelope = json!({
            "id": id,
            "method": "GET",
            "url": self.upstream.url("/echo"),
            "reply_to": caller.reply_to(&id),
        });
        let (_, mut inbox) = caller.send(pool, &envelope).await;
        let what = format!("reply from pool {pool}\n{}", self.service.logs());
        let message = next_message(&mut inbox, REPLY_TIMEOUT, &what).await;
        serde_json::from_slice(&message.payload).expect("reply JSON")
    }
}

/// What a request on `subject` from `client` is answered: `None` when nothing that
/// `client`'s account can reach listens there.
async fn answer(client: &async_nats::Client, subject: &str) -> Option<String> {
    match client.request(subject.to_owned(), "".into()).await {
        Ok(message) => Some(String::from_utf8_lossy(&message.payload).into_owned()),
        Err(e) if e.kind() == RequestErrorKind::NoResponders => None,
        Err(e) => panic!("a request on {subject}: {e}"),
    }
}

/// Points (a), (b) and (d): the operator pushed a new pool and lists it; the service
/// serves it under its own user; a caller in its own account gets its replies, from a
/// request sent to the new pool and from one moved there from `default`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_account_is_served_by_a_pool_an_operator_pushed_without_permission_changes() {
    let scene = Scene::start().await;
    let caller = Caller::connect(&scene.nats, "caller_a").await;
    for pool in ["partner", "default"] {
        let reply = scene.served(&caller, pool).await;
        assert_eq!(reply.status, Some(200), "sent to {pool}: {reply:?}");
    }
    assert_eq!(scene.upstream.hits_for("/echo"), 2);

    let listed: Value =
        serde_json::from_str(&as_operator(&scene.nats, &["pools", "--json"]).await).expect("JSON");
    let partner = listed
        .as_array()
        .and_then(|pools| pools.iter().find(|p| p["pool"] == "partner"))
        .unwrap_or_else(|| panic!("the pushed pool is not listed: {listed}"));
    assert_eq!(partner["max_in_flight"], 4, "{partner}");
    let history = as_operator(&scene.nats, &["config", "history"]).await;
    assert!(history.contains("partner"), "{history}");
}

/// Point (c): the file's callers are refused the service-only subjects, and even a
/// user with every permission in the callers' account reaches none of them: no hop or
/// retry subject, no JetStream API of webproxy's account, no bucket. While a
/// conversation is moved (a hop, a progress record, a live reply), that user sees
/// nothing of it in its account but the request and the copies to the caller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_account_reaches_no_service_only_subject() {
    let scene = Scene::start().await;

    // The file's caller: refused by its own permissions.
    let mut caller = Caller::connect(&scene.nats, "caller_a").await;
    let token = new_id();
    for subject in [
        format!("webproxy.hop.partner.{token}"),
        format!("webproxy.retry.partner.{token}"),
        "$JS.API.STREAM.INFO.KV_WEBPROXY_CONFIG".to_owned(),
        "$KV.WEBPROXY_CONFIG.cluster".to_owned(),
    ] {
        caller
            .nats
            .publish(subject.clone(), "{}".into())
            .await
            .expect("publish");
        violation(&mut caller.errors, &subject, REPLY_TIMEOUT).await;
    }

    // A user with every permission in CALLERS: nothing there answers for the service.
    // The same requests from webproxy's account are answered, so the subjects are
    // right and only the boundary stops them.
    let (everything, _) = connect_as(&scene.nats, CALLERS_ADMIN, None).await;
    let (admin, _) = connect_as(&scene.nats, ADMIN, None).await;
    for readable in [
        "$JS.API.STREAM.INFO.WEBPROXY_POOL_PARTNER",
        "$JS.API.STREAM.INFO.KV_WEBPROXY_PROGRESS",
        "$JS.API.DIRECT.GET.KV_WEBPROXY_CONFIG.$KV.WEBPROXY_CONFIG.cluster",
    ] {
        let from_service_account = answer(&admin, readable).await;
        assert!(
            from_service_account.is_some_and(|a| !a.contains("\"error\"")),
            "{readable} is not answered in webproxy's account"
        );
        let from_callers = answer(&everything, readable).await;
        assert!(
            from_callers
                .as_deref()
                .is_none_or(|a| a.contains("\"error\"")),
            "{readable} answered the callers' account: {from_callers:?}"
        );
    }
    // Writes, tried only from the callers' account: a stream in webproxy's account
    // would ack each of them.
    for writable in [
        format!("webproxy.hop.partner.{token}"),
        format!("webproxy.retry.partner.{token}"),
        "$KV.WEBPROXY_CONFIG.cluster".to_owned(),
        format!("$KV.WEBPROXY_PROGRESS.{token}"),
    ] {
        assert_eq!(
            answer(&everything, &writable).await,
            None,
            "{writable} was answered in the callers' account"
        );
    }

    // A moved conversation, watched from the callers' account and, to show that it
    // did hop and reply, from webproxy's.
    let mut watched = everything.subscribe(">").await.expect("subscribe");
    everything.flush().await.expect("flush");
    let mut hops = admin.subscribe("webproxy.hop.>").await.expect("subscribe");
    let mut live = admin
        .subscribe("webproxy.reply.*")
        .await
        .expect("subscribe");
    admin.flush().await.expect("flush");
    let reply = scene.served(&caller, "default").await;
    assert_eq!(reply.status, Some(200), "{reply:?}");
    // Everything routed to the watcher before the reply copy has arrived by now.
    everything.flush().await.expect("flush");
    let mut seen = Vec::new();
    while let Some(Some(message)) = watched.next().now_or_never() {
        seen.push(message.subject.to_string());
    }
    let reply_copy = format!("callers.a.replies.{}", reply.id);
    assert!(seen.contains(&reply_copy), "{seen:?}");
    let foreign: Vec<&String> = seen
        .iter()
        .filter(|s| *s != "webproxy.request.default.a" && !s.starts_with("callers.a."))
        .collect();
    assert!(
        foreign.is_empty(),
        "the callers' account saw the service's subjects {foreign:?}"
    );
    let hop = next_message(&mut hops, REPLY_TIMEOUT, "the move's hop").await;
    assert!(hop.subject.starts_with("webproxy.hop.partner."), "{hop:?}");
    let live = next_message(&mut live, REPLY_TIMEOUT, "the live reply").await;
    assert_eq!(
        live.subject.as_str(),
        format!("webproxy.reply.{}", reply.id)
    );
}
