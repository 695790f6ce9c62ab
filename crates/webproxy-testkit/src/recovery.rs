//! Issue 14's NATS-restart scenario, shared by `tests/liveness.rs` and `just bench`:
//! conversations waiting on a full pool when nats-server is killed, an outage of a
//! known length, and the time from the server's return until the last answer.

use std::time::{Duration, Instant};

use async_nats::jetstream;
use webproxy_client::{Client, Request};

use crate::{Gate, NatsServer, Upstream, wait_until};

/// How long nats-server stays down.
pub const OUTAGE: Duration = Duration::from_secs(3);
/// How long each conversation may take in all: far beyond any recovery worth passing.
const ANSWER_WAIT: Duration = Duration::from_secs(60);
/// How long the load may take to fill the pool; generous for a loaded 2-core machine.
const UNDER_WAY: Duration = Duration::from_secs(30);

/// The load a restart hits.
#[derive(Debug, Clone, Copy)]
pub struct Load<'a> {
    pub pool: &'a str,
    /// Conversations in all.
    pub count: usize,
    /// The pool's `max_in_flight`: this many are at the upstream when the server dies.
    pub limit: usize,
    /// How long the upstream takes per request once the gate is open.
    pub upstream_ms: u64,
    /// When nats-server is killed.
    pub killed: Killed,
}

/// The moment of the load at which nats-server is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Killed {
    /// While `limit` attempts are held at the gate, which opens once the server is
    /// gone: every handler in flight publishes its reply into the outage.
    AtTheGate,
    /// With the gate open and conversations flowing, once the upstream has taken
    /// `calls` requests: handlers are caught at every step, some with a publish or an
    /// ack on the wire when the connection drops.
    MidFlow { calls: usize },
}

/// What became of the conversations.
#[derive(Debug)]
pub struct Recovery {
    /// From nats-server accepting connections again until the last answer.
    pub last_answer: Duration,
    /// Conversations with no answer, or an answer other than a 200, and why.
    pub failed: Vec<String>,
}

/// Sends `load.count` conversations to `load.pool`, each to `gate`'s
/// `/gated/{upstream_ms}` on `upstream`, and waits until every one is stored and
/// `load.limit` of them are held at the gate (the pool is full). Then it kills
/// nats-server as `load.killed` says (and opens the gate), waits [`OUTAGE`], starts
/// the server again, and waits for every answer.
///
/// `client` should reconnect quickly ([`NatsServer::quick_client`]), so that the figure
/// is the service's. Needs a multi-threaded runtime (the server's start blocks).
pub async fn restart_under_load(
    nats: &mut NatsServer,
    client: &Client,
    upstream: &Upstream,
    gate: &Gate,
    load: Load<'_>,
) -> Recovery {
    let path = format!("/gated/{}", load.upstream_ms);
    let url = upstream.url(&path);
    let conversations: Vec<_> = (0..load.count)
        .map(|_| {
            let client = client.clone();
            let request = Request::new("GET", url.as_str())
                .pool(load.pool)
                .wait(ANSWER_WAIT);
            tokio::spawn(async move {
                let reply = client.request(&request).await;
                (request.envelope().id.clone(), reply, Instant::now())
            })
        })
        .collect();

    let js = jetstream::new(client.nats().clone());
    let stream = client.subjects().pool_stream(load.pool);
    let consumer = client.subjects().pool_consumer(load.pool);
    wait_until(
        UNDER_WAY,
        "every conversation stored and the pool full",
        || async {
            let Ok(stream) = js.get_stream(&stream).await else {
                return false;
            };
            let Ok(info) = stream.consumer_info(&consumer).await else {
                return false;
            };
            let stored = info.num_pending + u64::try_from(info.num_ack_pending).unwrap_or(0);
            stored == load.count as u64 && upstream.hits_for(&path) >= load.limit
        },
    )
    .await;

    match load.killed {
        Killed::AtTheGate => {
            nats.kill();
            gate.open();
        }
        Killed::MidFlow { calls } => {
            gate.open();
            wait_until(UNDER_WAY, "the load flowing", || async {
                upstream.hits_for(&path) >= calls
            })
            .await;
            nats.kill();
        }
    }
    // The outage itself: a fixed length is the scenario, not a wait for a condition.
    tokio::time::sleep(OUTAGE).await;
    tokio::task::block_in_place(|| nats.start_again());
    let back = Instant::now();

    let mut last = back;
    let mut failed = Vec::new();
    for conversation in conversations {
        match conversation.await {
            Ok((_, Ok(reply), at)) if reply.status == Some(200) => last = last.max(at),
            Ok((id, Ok(reply), _)) => failed.push(format!("{id}: {reply:?}")),
            Ok((id, Err(e), _)) => failed.push(format!("{id}: {e}")),
            Err(e) => failed.push(format!("a conversation's task failed: {e}")),
        }
    }
    Recovery {
        last_answer: last.saturating_duration_since(back),
        failed,
    }
}
