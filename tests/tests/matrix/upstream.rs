//! The cell's upstream: the fixture's default routes and two of the matrix's own.

use std::collections::HashSet;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::routing::get;
use webproxy_tests::{Upstream, default_routes};

/// How long `/slow/{key}` takes: long enough that a load of a dozen is still at the
/// upstream when the fault comes.
pub const SLOW: Duration = Duration::from_millis(400);

/// The body `/slow/{key}` answers.
pub fn slow_body(key: &str) -> String {
    format!("slow {key}")
}

/// The cell's upstream: the fixture's default routes, plus
/// - `/flaky/{key}`: 503 the first time a key is asked for, 200 after;
/// - `/mend/{key}`: 503 while broken, 200 once mended;
/// - `/slow/{key}`: 200 after [`SLOW`], its body naming the key (so that a reply
///   shows which request it answers).
pub struct MatrixUpstream {
    upstream: Upstream,
    mended: Arc<AtomicBool>,
}

#[derive(Clone)]
struct Routes {
    seen: Arc<Mutex<HashSet<String>>>,
    mended: Arc<AtomicBool>,
}

impl MatrixUpstream {
    pub async fn start() -> MatrixUpstream {
        let routes = Routes {
            seen: Arc::default(),
            mended: Arc::new(AtomicBool::new(true)),
        };
        let mended = routes.mended.clone();
        let router = Router::new()
            .route("/flaky/{key}", get(flaky))
            .route("/mend/{key}", get(mend))
            .route("/slow/{key}", get(slow))
            .with_state(routes);
        MatrixUpstream {
            upstream: Upstream::start_with(default_routes().merge(router)).await,
            mended,
        }
    }

    pub fn mend(&self, mended: bool) {
        self.mended.store(mended, Ordering::SeqCst);
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

async fn slow(Path(key): Path<String>) -> String {
    tokio::time::sleep(SLOW).await;
    slow_body(&key)
}
