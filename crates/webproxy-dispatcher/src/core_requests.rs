//! Core NATS requests the service answers beside its streams (`body.get`, `body.put`):
//! one queue group across instances, so each request is answered once, and a fixed
//! number answered at once per instance; past that the answer is the caller's `busy`
//! at once, so nothing waits on handlers.

use std::future::Future;
use std::sync::Arc;

use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use futures::StreamExt as _;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// An answer: its headers and payload.
pub(crate) type Answer = (HeaderMap, Bytes);

/// Answers requests on `subject` (queue group `group`) with `handle`, at most
/// `max_concurrent` at once and `busy` beyond, until `shutdown`.
pub(crate) async fn serve<H, F>(
    client: async_nats::Client,
    subject: String,
    group: &str,
    max_concurrent: usize,
    busy: Answer,
    shutdown: CancellationToken,
    handle: H,
) where
    H: Fn(Message) -> F,
    F: Future<Output = Answer> + Send + 'static,
{
    let mut requests = match client
        .queue_subscribe(subject.clone(), group.to_string())
        .await
    {
        Ok(requests) => requests,
        Err(e) => {
            warn!(subject, error = %e, "cannot answer requests: the subscription failed");
            return;
        }
    };
    let permits = Arc::new(Semaphore::new(max_concurrent));
    loop {
        let request = tokio::select! {
            request = requests.next() => request,
            () = shutdown.cancelled() => break,
        };
        let Some(request) = request else { break };
        let Some(reply_to) = request.reply.clone() else {
            continue;
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            let (headers, payload) = busy.clone();
            let _ = client
                .publish_with_headers(reply_to, headers, payload)
                .await;
            continue;
        };
        let client = client.clone();
        let answer = handle(request);
        tokio::spawn(async move {
            let (headers, payload) = answer.await;
            if let Err(e) = client
                .publish_with_headers(reply_to, headers, payload)
                .await
            {
                debug!(error = %e, "cannot send an answer");
            }
            drop(permit);
        });
    }
}
