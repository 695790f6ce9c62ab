//! The cell's upstream: the fixture's default routes and the matrix's own.

use std::collections::{HashMap, HashSet};
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use futures::StreamExt as _;
use webproxy_tests::{Gate, Upstream, default_routes, large_body};

/// How long `/slow/{key}` takes: long enough that a load of a dozen is still at the
/// upstream when the fault comes.
pub const SLOW: Duration = Duration::from_millis(400);

/// The body `/slow/{key}` answers.
pub fn slow_body(key: &str) -> String {
    format!("slow {key}")
}

/// The body `/hold/{key}` answers once released.
pub fn held_body(key: &str) -> String {
    format!("held {key}")
}

/// The pieces `/large/{n}` sends its body in.
const LARGE_PIECE: usize = 64 * 1024;

/// The pause before each piece of `/large/{n}` but the first: 48 pieces of a 3 MiB
/// body take about 2 s, so that a fault comes while bodies stream and a pod stopped
/// then is most likely mid-stream, not in the milliseconds before or after it.
pub const LARGE_STREAMS: Duration = Duration::from_millis(40);

/// The cell's upstream: the fixture's default routes, plus
/// - `/flaky/{key}`: 503 the first time a key is asked for, 200 after;
/// - `/mend/{key}`: 503 while broken, 200 once mended;
/// - `/slow/{key}`: 200 after [`SLOW`], its body naming the key (so that a reply
///   shows which request it answers);
/// - `/large/{n}`: 200, the `n` bytes of [`large_body`], chunked (no
///   `Content-Length`) in 64 KiB pieces [`LARGE_STREAMS`] apart;
/// - `/hold/{key}`: held until [`MatrixUpstream::release`], then 200 [`held_body`];
///   [`MatrixUpstream::holding`] tells how many calls of a key it holds now (a call
///   whose client went away, such as an attempt a cancel dropped, is no longer held).
pub struct MatrixUpstream {
    upstream: Upstream,
    mended: Arc<AtomicBool>,
    hold: Gate,
    holding: Holding,
}

/// The calls `/hold/{key}` holds now, by key.
type Holding = Arc<Mutex<HashMap<String, usize>>>;

#[derive(Clone)]
struct Routes {
    seen: Arc<Mutex<HashSet<String>>>,
    mended: Arc<AtomicBool>,
    hold: Gate,
    holding: Holding,
}

impl MatrixUpstream {
    pub async fn start() -> MatrixUpstream {
        let routes = Routes {
            seen: Arc::default(),
            mended: Arc::new(AtomicBool::new(true)),
            hold: Gate::new(),
            holding: Holding::default(),
        };
        let mended = routes.mended.clone();
        let (hold, holding) = (routes.hold.clone(), routes.holding.clone());
        let router = Router::new()
            .route("/flaky/{key}", get(flaky))
            .route("/mend/{key}", get(mend))
            .route("/slow/{key}", get(slow))
            .route("/large/{n}", get(large))
            .route("/hold/{key}", get(hold_call))
            .with_state(routes);
        MatrixUpstream {
            upstream: Upstream::start_with(default_routes().merge(router)).await,
            mended,
            hold,
            holding,
        }
    }

    pub fn mend(&self, mended: bool) {
        self.mended.store(mended, Ordering::SeqCst);
    }

    /// Lets every call of `/hold/{key}` through, now and from now on.
    pub fn release(&self) {
        self.hold.open();
    }

    /// How many calls of `/hold/{key}` are held now.
    pub fn holding(&self, key: &str) -> usize {
        lock(&self.holding).get(key).copied().unwrap_or(0)
    }

    /// How many calls of `/hold/{key}` are held now, of any key.
    pub fn holding_any(&self) -> usize {
        lock(&self.holding).values().sum()
    }
}

fn lock(holding: &Holding) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
    holding.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A call `/hold/{key}` holds, counted until it is answered or its client goes away
/// (the handler is then dropped mid-wait).
struct Held {
    holding: Holding,
    key: String,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut holding = lock(&self.holding);
        if let Some(count) = holding.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                holding.remove(&self.key);
            }
        }
    }
}

impl Deref for MatrixUpstream {
    type Target = Upstream;
    fn deref(&self) -> &Upstream {
        &self.upstream
    }
}

async fn flaky(
    State(routes): State<Routes>,
    Path(key): Path<String>,
) -> (StatusCode, &'static str) {
    let first = routes
        .seen
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(key);
    if first {
        (StatusCode::SERVICE_UNAVAILABLE, "not yet")
    } else {
        (StatusCode::OK, "ok")
    }
}

async fn mend(State(routes): State<Routes>) -> (StatusCode, &'static str) {
    if routes.mended.load(Ordering::SeqCst) {
        (StatusCode::OK, "ok")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "down")
    }
}

async fn hold_call(State(routes): State<Routes>, Path(key): Path<String>) -> String {
    *lock(&routes.holding).entry(key.clone()).or_default() += 1;
    let held = Held {
        holding: routes.holding.clone(),
        key,
    };
    routes.hold.wait().await;
    held_body(&held.key)
}

async fn slow(Path(key): Path<String>) -> String {
    tokio::time::sleep(SLOW).await;
    slow_body(&key)
}

async fn large(Path(n): Path<usize>) -> Body {
    let body = Bytes::from(large_body(n));
    let pieces = futures::stream::iter(0..n.div_ceil(LARGE_PIECE)).then(move |k| {
        let piece = body.slice(k * LARGE_PIECE..((k + 1) * LARGE_PIECE).min(n));
        async move {
            if k > 0 {
                tokio::time::sleep(LARGE_STREAMS).await;
            }
            Ok::<_, std::io::Error>(piece)
        }
    });
    Body::from_stream(pieces)
}
