//! An in-process HTTP upstream on 127.0.0.1 that records every request it
//! sees, so tests can assert on what webproxy actually sent.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{any, get};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

/// A running upstream; the server task stops when this is dropped.
pub struct Upstream {
    addr: SocketAddr,
    stats: Arc<Stats>,
    server: JoinHandle<()>,
}

#[derive(Default)]
struct Stats {
    total: AtomicUsize,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    arrivals: Mutex<HashMap<String, Vec<Instant>>>,
    /// The requests being handled now, by arrival number.
    open: Mutex<BTreeMap<u64, OpenCall>>,
    next_call: AtomicU64,
    /// The requests that were being handled when the most were: what a failed limit
    /// check prints, so that it shows which calls overlapped and from where.
    busiest: Mutex<Vec<OpenCall>>,
}

/// A request being handled: for [`Upstream::busiest_calls`].
#[derive(Clone)]
struct OpenCall {
    path: String,
    peer: Option<SocketAddr>,
    arrived: SystemTime,
}

impl std::fmt::Display for OpenCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = humantime::format_rfc3339_micros(self.arrived);
        match self.peer {
            Some(peer) => write!(f, "{} from {peer}, arrived {at}", self.path),
            None => write!(f, "{}, arrived {at}", self.path),
        }
    }
}

impl Stats {
    fn arrivals(&self) -> MutexGuard<'_, HashMap<String, Vec<Instant>>> {
        self.arrivals.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn open(&self) -> MutexGuard<'_, BTreeMap<u64, OpenCall>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn busiest(&self) -> MutexGuard<'_, Vec<OpenCall>> {
        self.busiest.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Upstream {
    /// Starts the upstream with the default routes:
    ///
    /// - `ANY /echo`: 200, JSON `{method, path, query, headers: {name: [values]}, body, body_len}`
    /// - `ANY /status/{code}`: that status, body `status {code}`
    /// - `ANY /delay/{ms}`: 200 `ok` after `ms` milliseconds
    /// - `GET /binary`: 200, bytes `[0, 1, 2, 255, 254]`, `application/octet-stream`
    /// - `GET /multi`: 200 `multi`, `x-multi: a`, `x-multi: b`, `x-single: one`
    /// - `GET /bytes/{n}`: 200, `n` bytes of `x` (for size limits)
    /// - `ANY /hang`: never answers
    pub async fn start() -> Upstream {
        Self::start_with(default_routes()).await
    }

    /// Starts the upstream with custom routes; requests are counted all the same.
    pub async fn start_with(router: Router) -> Upstream {
        Self::start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), router).await
    }

    /// Starts the upstream on `addr`, which must be a loopback address (127.0.0.0/8
    /// or ::1): tests never listen on or send to anything else. Port 0 picks one.
    pub async fn start_on(addr: SocketAddr, router: Router) -> Upstream {
        assert!(
            addr.ip().is_loopback(),
            "upstreams listen on loopback only, not {addr}"
        );
        let stats = Arc::new(Stats::default());
        let app = router.layer(middleware::from_fn_with_state(stats.clone(), count));
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("bind upstream on {addr}: {e}"));
        let addr = listener.local_addr().expect("upstream local address");
        let server = tokio::spawn(async move {
            let app = app.into_make_service_with_connect_info::<SocketAddr>();
            if let Err(error) = axum::serve(listener, app).await {
                eprintln!("upstream on {addr} stopped: {error}");
            }
        });
        Upstream {
            addr,
            stats,
            server,
        }
    }

    /// `http://127.0.0.1:PORT{path}` (`[::1]` for an IPv6 upstream); `path` starts
    /// with `/`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Requests seen so far, on any path.
    pub fn hits(&self) -> usize {
        self.stats.total.load(Ordering::SeqCst)
    }

    /// Requests seen so far on exactly `path` (no query string).
    pub fn hits_for(&self, path: &str) -> usize {
        self.stats.arrivals().get(path).map_or(0, Vec::len)
    }

    /// The most requests that were ever being handled at the same time.
    pub fn max_concurrent(&self) -> usize {
        self.stats.max_in_flight.load(Ordering::SeqCst)
    }

    /// The requests that were being handled at once when the most were (see
    /// [`Upstream::max_concurrent`]), each with its path, the address it came from and
    /// when it arrived: for a failed limit check's message.
    pub fn busiest_calls(&self) -> Vec<String> {
        self.stats
            .busiest()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// When each request on `path` arrived, oldest first.
    pub fn hit_times(&self, path: &str) -> Vec<Instant> {
        self.stats.arrivals().get(path).cloned().unwrap_or_default()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn count(State(stats): State<Arc<Stats>>, request: Request, next: Next) -> Response {
    stats
        .arrivals()
        .entry(request.uri().path().to_owned())
        .or_default()
        .push(Instant::now());
    stats.total.fetch_add(1, Ordering::SeqCst);
    let call = OpenCall {
        path: request.uri().path().to_owned(),
        peer: request
            .extensions()
            .get::<ConnectInfo<SocketAddr>>()
            .map(|ConnectInfo(peer)| *peer),
        arrived: SystemTime::now(),
    };
    // A guard rather than a decrement after `.await`: a request the client
    // abandons (e.g. on /hang) is dropped mid-handler and must stop counting.
    let _in_flight = InFlight::enter(stats, call);
    next.run(request).await
}

struct InFlight(Arc<Stats>, u64);

impl InFlight {
    fn enter(stats: Arc<Stats>, call: OpenCall) -> InFlight {
        let number = stats.next_call.fetch_add(1, Ordering::SeqCst);
        let mut open = stats.open();
        open.insert(number, call);
        let now = stats.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        if stats.max_in_flight.fetch_max(now, Ordering::SeqCst) < now {
            *stats.busiest() = open.values().cloned().collect();
        }
        drop(open);
        InFlight(stats, number)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.open().remove(&self.1);
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Holds requests until the test lets them through, so a test can act while an attempt
/// is known to be at the upstream: `ANY /gated/{ms}` waits for a pass, then `ms`
/// milliseconds, then answers 200 `ok`. The upstream counts a request when it arrives,
/// so `hits_for("/gated/{ms}")` tells how many have reached the gate.
#[derive(Clone)]
pub struct Gate(Arc<Semaphore>);

impl Default for Gate {
    fn default() -> Gate {
        Gate::new()
    }
}

impl Gate {
    /// A closed gate: nothing passes until [`Gate::pass`] or [`Gate::open`].
    pub fn new() -> Gate {
        Gate(Arc::new(Semaphore::new(0)))
    }

    /// The `/gated/{ms}` route, to merge into the upstream's routes.
    pub fn routes(&self) -> Router {
        Router::new()
            .route("/gated/{ms}", any(gated))
            .with_state(self.clone())
    }

    /// Lets `count` more requests through, waiting ones first.
    pub fn pass(&self, count: usize) {
        self.0.add_permits(count);
    }

    /// Waits for a pass, as `/gated/{ms}` does: for a test's own gated routes.
    pub async fn wait(&self) {
        if let Ok(pass) = self.0.acquire().await {
            pass.forget();
        }
    }

    /// Lets every request through, now and from now on.
    pub fn open(&self) {
        // A closed semaphore fails every acquire, waiting or not: each is let through.
        self.0.close();
    }
}

async fn gated(State(gate): State<Gate>, Path(ms): Path<u64>) -> &'static str {
    gate.wait().await;
    tokio::time::sleep(Duration::from_millis(ms)).await;
    "ok"
}

/// `ANY /fails-once/{key}`: 503 `not yet` the first time each `key` is asked for, 200
/// `ok` from then on. With a rule that retries, every conversation on a key of its own
/// parks exactly once and then succeeds, however many run at once (the bench's
/// progress-bound section). Each call makes routes with nothing seen yet.
pub fn fails_once_routes() -> Router {
    Router::new()
        .route("/fails-once/{key}", any(fails_once))
        .with_state(Arc::new(Mutex::new(HashSet::new())))
}

async fn fails_once(
    State(seen): State<Arc<Mutex<HashSet<String>>>>,
    Path(key): Path<String>,
) -> Response {
    let first = seen
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key);
    if first {
        (StatusCode::SERVICE_UNAVAILABLE, "not yet").into_response()
    } else {
        (StatusCode::OK, "ok").into_response()
    }
}

/// Byte `i` of every body [`large_routes`] sends (and of a test's own routes that
/// stream it differently): not UTF-8 and not repeating, so a lost, doubled or
/// reordered chunk changes the digest.
pub fn large_body_byte(i: usize) -> u8 {
    (i.wrapping_mul(2_654_435_761) >> 13) as u8
}

/// The `len` bytes `GET /large/{len}` sends, to compare what was stored with.
pub fn large_body(len: usize) -> Vec<u8> {
    (0..len).map(large_body_byte).collect()
}

/// `GET /large/{n}`: `n` bytes ([`large_body`]), chunked (no `Content-Length`), in
/// 64 KiB pieces made as they are sent, so the size is learned only while it streams
/// and the upstream never holds a whole body (the bench sends 64 of 50 MiB at once).
pub fn large_routes() -> Router {
    const PIECE: usize = 64 * 1024;
    Router::new().route(
        "/large/{n}",
        get(|Path(n): Path<usize>| async move {
            let pieces = (0..n.div_ceil(PIECE)).map(move |k| {
                let piece: Vec<u8> = (k * PIECE..((k + 1) * PIECE).min(n))
                    .map(large_body_byte)
                    .collect();
                Ok::<_, std::io::Error>(piece)
            });
            Body::from_stream(futures::stream::iter(pieces))
        }),
    )
}

/// The default routes (see [`Upstream::start`]), to extend or to serve elsewhere.
pub fn default_routes() -> Router {
    Router::new()
        .route("/echo", any(echo))
        .route("/status/{code}", any(status))
        .route("/delay/{ms}", any(delay))
        .route("/binary", get(binary))
        .route("/multi", get(multi))
        .route("/bytes/{n}", get(bytes))
        .route("/hang", any(hang))
        // Tests send large bodies on purpose (size limits are webproxy's job).
        .layer(DefaultBodyLimit::disable())
}

async fn echo(method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let mut header_values: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for (name, value) in &headers {
        header_values
            .entry(name.as_str())
            .or_default()
            .push(String::from_utf8_lossy(value.as_bytes()).into_owned());
    }
    Json(serde_json::json!({
        "method": method.as_str(),
        "path": uri.path(),
        "query": uri.query().unwrap_or(""),
        "headers": header_values,
        "body": String::from_utf8_lossy(&body),
        "body_len": body.len(),
    }))
    .into_response()
}

async fn status(Path(code): Path<u16>) -> Response {
    match StatusCode::from_u16(code) {
        Ok(status) => (status, format!("status {code}")).into_response(),
        Err(_) => (StatusCode::BAD_REQUEST, format!("bad status {code}")).into_response(),
    }
}

async fn delay(Path(ms): Path<u64>) -> &'static str {
    tokio::time::sleep(Duration::from_millis(ms)).await;
    "ok"
}

async fn binary() -> impl IntoResponse {
    (
        [(CONTENT_TYPE, "application/octet-stream")],
        vec![0u8, 1, 2, 255, 254],
    )
}

async fn multi() -> impl IntoResponse {
    let mut headers = HeaderMap::new();
    headers.append("x-multi", HeaderValue::from_static("a"));
    headers.append("x-multi", HeaderValue::from_static("b"));
    headers.insert("x-single", HeaderValue::from_static("one"));
    (headers, "multi")
}

async fn bytes(Path(n): Path<usize>) -> Vec<u8> {
    vec![b'x'; n]
}

async fn hang() -> Response {
    std::future::pending().await
}
