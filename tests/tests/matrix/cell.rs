//! One cell of the matrix: the world a fault needs (one nats-server or a cluster of
//! three, two `webproxy serve` instances in `kv` mode, an upstream, a caller, and for
//! the gateway column a `webproxy gateway`), and the caller's side of it.

use std::time::Duration;

use async_nats::jetstream;
use webproxy_client::{Client, Request, Submitted};
use webproxy_protocol::{Origin, RequestEnvelope};
use webproxy_tests::caller::envelope;
use webproxy_tests::pools::kv_config;
use webproxy_tests::{
    Gateway, NatsCluster, NatsServer, Service, ServiceOptions, http_client, run_webproxy,
    wait_until,
};

use crate::fault::Fault;
use crate::feature::{ACK_WAIT, Feature, POOL};
use crate::observe::{ANSWERED, Observed, REPLY_TO};
use crate::upstream::MatrixUpstream;

/// How long a request may wait for its answer in all: far beyond [`ANSWERED`].
const REQUEST_WAIT: Duration = Duration::from_secs(180);

/// How long the gateway holds a request for its reply before it answers 202: longer
/// than any fault and its recovery, so a request held through the fault is answered
/// with its reply.
const GATEWAY_WAIT: Duration = Duration::from_secs(60);

/// The gateway's route to the cell's upstream, in pool [`POOL`].
const GATEWAY_ROUTE: &str = "/m";

/// How long a new 3-node cluster may take to elect its JetStream meta leader on a
/// loaded machine (two cells at once, each with its servers and instances).
const CLUSTER_READY: Duration = Duration::from_secs(60);

/// How long every instance may take to report after a fault: its next heartbeat (every
/// 5 s) once JetStream answers again, with a loaded machine's margin.
const INSTANCES_REPORT: Duration = Duration::from_secs(30);

/// How long a failing `config push` is made again after a fault (see [`Cell::push`]):
/// generous, against a JetStream that elects its stream leaders again.
const PUSH_WORKS_AGAIN: Duration = Duration::from_secs(30);

/// The pause between two tries of a failed `config push`.
const PUSH_RETRY_PAUSE: Duration = Duration::from_millis(500);

/// The gateway's records bucket: each keyed id's route, token identity and origin.
const GATEWAY_RECORDS: &str = "WEBPROXY_GATEWAY";

/// The nats-servers of a cell.
pub enum Nats {
    One(NatsServer),
    Cluster(NatsCluster),
}

impl Nats {
    /// Every client URL, comma-separated, as `[nats] url` and `--nats` take them.
    pub fn urls(&self) -> String {
        match self {
            Nats::One(server) => server.url(),
            Nats::Cluster(cluster) => cluster.urls(),
        }
    }

    /// A client of every node, reconnecting every 100 ms (so that what a cell times is
    /// the service's recovery, not the test client's backoff).
    pub async fn client(&self) -> async_nats::Client {
        let urls: Vec<String> = self.urls().split(',').map(str::to_string).collect();
        async_nats::ConnectOptions::new()
            .reconnect_delay_callback(|_| Duration::from_millis(100))
            .connect(urls)
            .await
            .expect("connect to the cell's nats-servers")
    }
}

/// A cell's world.
pub struct Cell {
    pub fault: Fault,
    pub feature: Feature,
    pub nats: Nats,
    pub upstream: MatrixUpstream,
    pub services: Vec<Service>,
    /// [`Feature::Gateway`]'s gateway, routing [`GATEWAY_ROUTE`] to pool [`POOL`].
    pub gateway: Option<Gateway>,
    pub client: Client,
    pub js: jetstream::Context,
    pub observed: Observed,
}

impl Cell {
    pub async fn start(fault: Fault, feature: Feature) -> Cell {
        let nats = if fault.needs_a_cluster() {
            let cluster = NatsCluster::start(3);
            cluster.wait_jetstream_ready(CLUSTER_READY).await;
            Nats::Cluster(cluster)
        } else {
            Nats::One(NatsServer::start())
        };
        let upstream = MatrixUpstream::start().await;
        let process = if fault.needs_a_cluster() {
            "[streams]\nreplicas = 3\n\n"
        } else {
            ""
        };
        let config = format!(
            "{process}{}",
            kv_config(&feature.document(&upstream, ACK_WAIT, 0))
        );
        let services = Service::start_each(&nats.urls(), &config, fault.instance_options()).await;
        let gateway = match feature {
            // Its buckets as replicated as the service's: `[streams]` after its routes.
            Feature::Gateway => Some(
                Gateway::start_with_url(
                    &nats.urls(),
                    &format!(
                        "wait = \"{}s\"\n\n[[gateway.routes]]\npath = \"{GATEWAY_ROUTE}\"\nupstream = \"{}\"\npool = \"{POOL}\"\n\n{process}",
                        GATEWAY_WAIT.as_secs(),
                        upstream.url("/")
                    ),
                    ServiceOptions::default(),
                )
                .await,
            ),
            _ => None,
        };
        let nats_client = nats.client().await;
        let observed = Observed::subscribe(&nats_client).await;
        Cell {
            fault,
            feature,
            client: Client::new(nats_client.clone(), "webproxy").expect("client"),
            js: jetstream::new(nats_client),
            nats,
            upstream,
            services,
            gateway,
            observed,
        }
    }

    /// A conversation to `path` on the upstream, sent to `pool`, with a `reply_to`.
    /// Right after a fault the pool stream may not answer yet (no responders, which
    /// the client reports as no such pool): the publish is retried, as a caller
    /// would, with the same request.
    pub async fn submit(&self, pool: &str, path: &str) -> Submitted {
        let request = self.request(pool, path);
        let deadline = std::time::Instant::now() + ANSWERED;
        loop {
            match self.client.submit(&request).await {
                Ok(submitted) => return submitted,
                Err(e) if std::time::Instant::now() > deadline => {
                    panic!("submit: {e:?}\n{}", self.logs())
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// The request [`Cell::submit`] sends; [`Feature::Large`]'s opts in to a stored
    /// body, with the random message id that reading it asks for.
    pub fn request(&self, pool: &str, path: &str) -> Request {
        let envelope: RequestEnvelope = envelope("GET", &self.upstream.url(path));
        let reply_to = format!("{REPLY_TO}.{}", envelope.id);
        let request = Request::from_envelope(envelope)
            .pool(pool)
            .reply_to(reply_to)
            .wait(REQUEST_WAIT);
        match self.feature {
            Feature::Large => request.large_body().expect("a random message id"),
            _ => request,
        }
    }

    /// `webproxy ARGS --nats URLS`'s standard output, or its failure.
    pub async fn webproxy(&self, args: &[&str]) -> Result<String, String> {
        let urls = self.nats.urls();
        let mut all = args.to_vec();
        all.extend_from_slice(&["--nats", &urls]);
        let output = run_webproxy(&all).await;
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        if output.status.success() {
            Ok(stdout)
        } else {
            Err(format!(
                "webproxy {args:?}: {}\n{stdout}",
                String::from_utf8_lossy(&output.stderr)
            ))
        }
    }

    /// Like [`Cell::webproxy`], asserting it succeeded.
    pub async fn webproxy_ok(&self, args: &[&str]) -> String {
        self.webproxy(args)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.logs()))
    }

    /// Pushes the cluster document `document` with `config push --wait`: it returns
    /// once every live instance runs it.
    ///
    /// It first waits for every instance's heartbeat in `WEBPROXY_INSTANCES`: an
    /// instance reports every 5 s, so after a fault (or a slow start) a push may come
    /// before any report, and `config push` then refuses, rightly, to write a document
    /// no live instance would follow.
    ///
    /// A push that fails is made again, as an operator would, until
    /// [`PUSH_WORKS_AGAIN`] has passed: right after the JetStream API returns, the
    /// configuration bucket's stream may still answer "no stream found" while its
    /// leader is elected, and a replica still catching up may answer a direct get with
    /// no document, so the push's compare-and-set fails (`matrix::api_down_config`
    /// failed so once in CI). `config push` refuses then and writes nothing; pushing
    /// the same document again is harmless (`unchanged` once it is in).
    pub async fn push(&self, document: &str) {
        wait_until(INSTANCES_REPORT, "every instance's heartbeat", || async {
            self.instances_reporting().await >= self.services.len()
        })
        .await;
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("cluster.toml");
        std::fs::write(&path, document).expect("write the document");
        let path = path.display().to_string();
        let deadline = tokio::time::Instant::now() + PUSH_WORKS_AGAIN;
        let mut failures = Vec::new();
        loop {
            match self.webproxy(&["config", "push", &path, "--wait"]).await {
                Ok(_) => return,
                Err(e) if tokio::time::Instant::now() < deadline => {
                    failures.push(e);
                    tokio::time::sleep(PUSH_RETRY_PAUSE).await;
                }
                Err(e) => panic!(
                    "config push failed for {PUSH_WORKS_AGAIN:?}; earlier tries: {failures:#?}\nthe last: {e}\n{}",
                    self.logs()
                ),
            }
        }
    }

    /// How many instances report in `WEBPROXY_INSTANCES` now (as `config push` reads
    /// them); none while it cannot be read.
    async fn instances_reporting(&self) -> usize {
        let subjects = webproxy_protocol::Subjects::new("webproxy").expect("the default prefix");
        webproxy_jetstream::config_store::ConfigStore::instance_reports(&self.js, &subjects)
            .await
            .map_or(0, |reports| reports.len())
    }

    /// A request through the gateway to `path` on the upstream with
    /// `Idempotency-Key: <key>`, with `Prefer: respond-async` when `async_` (a 202 once
    /// its id is recorded); `None` when the gateway cannot be reached.
    pub async fn keyed(&self, key: &str, path: &str, async_: bool) -> Option<reqwest::Response> {
        self.keyed_request(key, path, async_).send().await.ok()
    }

    /// The request [`Cell::keyed`] sends.
    pub fn keyed_request(&self, key: &str, path: &str, async_: bool) -> reqwest::RequestBuilder {
        let gateway = self.gateway.as_ref().expect("a gateway cell");
        let request = http_client()
            .get(gateway.url(&format!("{GATEWAY_ROUTE}{path}")))
            .header("Idempotency-Key", key)
            // The gateway answers within its wait: more is a hung gateway.
            .timeout(GATEWAY_WAIT + Duration::from_secs(30));
        if async_ {
            request.header("Prefer", "respond-async")
        } else {
            request
        }
    }

    /// `GET /_webproxy/replies/<id>`: the reply of a gateway id as the gateway's API
    /// gives it.
    pub async fn gateway_reply(&self, id: &str) -> Option<reqwest::Response> {
        let gateway = self.gateway.as_ref().expect("a gateway cell");
        http_client()
            .get(gateway.url(&format!("/_webproxy/replies/{id}")))
            .send()
            .await
            .ok()
    }

    /// The conversation the gateway recorded for `id`; `None` while there is no record
    /// or the bucket cannot be read.
    pub async fn gateway_record(&self, id: &str) -> Option<Submitted> {
        let records = self.js.get_key_value(GATEWAY_RECORDS).await.ok()?;
        let value = records.get(id).await.ok()??;
        let record: serde_json::Value = serde_json::from_slice(&value).ok()?;
        let origin: Origin = record["origin"].as_str()?.parse().ok()?;
        Some(Submitted {
            id: id.to_string(),
            origin,
            msg_id: record["msg_id"].as_str().unwrap_or_default().to_string(),
        })
    }

    /// How many deliveries instance `n` handles now in the cell's pool; `None` while its
    /// metrics do not answer.
    pub async fn in_flight(&self, n: usize) -> Option<f64> {
        self.services[n]
            .metric(&format!("webproxy_in_flight{{pool=\"{POOL}\"}}"))
            .await
    }

    /// Waits until no instance handles a delivery in the cell's pool, a woken pod's
    /// stale one included: every settle the fault left behind is done. Panics if
    /// `within` passes first.
    pub async fn wait_idle(&self, within: Duration) {
        wait_until(within, "every instance idle", || async {
            let mut idle = true;
            for n in 0..self.services.len() {
                idle &= self.in_flight(n).await == Some(0.0);
            }
            idle
        })
        .await;
    }

    /// Every instance's log (and the gateway's), for a failure's message.
    pub fn logs(&self) -> String {
        self.services
            .iter()
            .enumerate()
            .map(|(i, s)| format!("--- instance {i} ---\n{}", s.logs()))
            .chain(
                self.gateway
                    .iter()
                    .map(|g| format!("--- gateway ---\n{}", g.logs())),
            )
            .collect::<Vec<_>>()
            .join("\n")
    }
}
