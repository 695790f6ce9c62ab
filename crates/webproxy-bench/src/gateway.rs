//! The HTTP gateway's rows: the same request through `webproxy gateway` (HTTP in, the
//! reply as the HTTP answer) and through the Rust NATS client, measured back to back.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use webproxy_testkit::{Gateway, NatsServer, ServiceOptions, Upstream};

use crate::load::{Figures, closed_loop};
use crate::row;

/// The concurrency levels of the gateway's rows.
const GATEWAY_LEVELS: [usize; 2] = [1, 64];

/// The gateway beside the NATS-client path at one level.
#[derive(Debug, Serialize)]
pub(crate) struct GatewayFigures {
    pub(crate) concurrency: usize,
    pub(crate) gateway: Figures,
    pub(crate) proxied: Figures,
    /// gateway req/s ÷ NATS-client req/s.
    pub(crate) throughput_vs_proxied: f64,
    /// gateway p50 ÷ NATS-client p50.
    pub(crate) p50_vs_proxied: f64,
}

/// One call through the gateway: answered 200 with the upstream's response.
async fn through_gateway(http: reqwest::Client, url: Arc<str>) -> bool {
    match http.get(url.as_ref()).send().await {
        Ok(response) => {
            response.status().is_success()
                && response
                    .headers()
                    .get("webproxy-outcome")
                    .is_some_and(|v| v.as_bytes() == b"response")
                && response.bytes().await.is_ok()
        }
        Err(_) => false,
    }
}

/// Starts a gateway with one open route to `upstream` and measures it beside
/// `proxied_op` (the NATS-client path to the same URL) at [`GATEWAY_LEVELS`]; prints
/// a `gateway` and a `proxied` row per level.
pub(crate) async fn gateway_figures<F, Fut>(
    nats: &NatsServer,
    upstream: &Upstream,
    path: &str,
    proxied_op: F,
    duration: Duration,
) -> anyhow::Result<Vec<GatewayFigures>>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = bool> + Send,
{
    let gateway = Gateway::start_with(
        nats,
        &format!(
            "[[gateway.routes]]\npath = \"/up\"\nupstream = \"{}\"\n\n[log]\nlevel = \"warn\"\n",
            upstream.url("/")
        ),
        ServiceOptions::default().env("RUST_LOG", "warn"),
    )
    .await;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let url: Arc<str> = Arc::from(gateway.url(&format!("/up{path}")));
    let gateway_op = move || through_gateway(http.clone(), url.clone());
    let warm = GATEWAY_LEVELS.iter().copied().max().unwrap_or(16);
    closed_loop(warm, Duration::from_secs(1), gateway_op.clone()).await;
    let mut figures = Vec::new();
    for concurrency in GATEWAY_LEVELS {
        let proxied = closed_loop(concurrency, duration, proxied_op.clone()).await;
        let through = closed_loop(concurrency, duration, gateway_op.clone()).await;
        row("gateway", concurrency, &through, None);
        row("proxied", concurrency, &proxied, None);
        figures.push(GatewayFigures {
            concurrency,
            throughput_vs_proxied: through.rps / proxied.rps,
            p50_vs_proxied: through.p50_ms / proxied.p50_ms,
            gateway: through,
            proxied,
        });
    }
    Ok(figures)
}
