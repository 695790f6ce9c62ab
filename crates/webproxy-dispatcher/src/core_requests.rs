//! Core NATS requests the service answers beside its streams (`body.get`, `body.put`):
//! one queue group across instances, so each request is answered once, and a fixed
//! number answered at once per instance, of which one caller (a key the request names)
//! takes a fixed share; past either the answer is the caller's `busy` at once, so
//! nothing waits on handlers.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use async_nats::{HeaderMap, Message};
use bytes::Bytes;
use futures::StreamExt as _;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// An answer: its headers and payload.
pub(crate) type Answer = (HeaderMap, Bytes);

/// What requests a [`serve`] loop answers, and how many at once.
pub(crate) struct Requests {
    pub(crate) subject: String,
    pub(crate) group: &'static str,
    pub(crate) max_concurrent: usize,
    /// How many of them one key may hold.
    pub(crate) max_per_key: usize,
    /// The answer past either bound.
    pub(crate) busy: Answer,
}

/// Answers `requests` with `handle`, at most `max_concurrent` at once and
/// `max_per_key` of them for one `key` of a request, and `busy` beyond, until
/// `shutdown`.
pub(crate) async fn serve<K, H, F>(
    client: async_nats::Client,
    requests: Requests,
    shutdown: CancellationToken,
    key: K,
    handle: H,
) where
    K: Fn(&Message) -> String,
    H: Fn(Message) -> F,
    F: Future<Output = Answer> + Send + 'static,
{
    let Requests {
        subject,
        group,
        max_concurrent,
        max_per_key,
        busy,
    } = requests;
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
    let shares = Arc::new(Shares::new(max_per_key));
    loop {
        let request = tokio::select! {
            request = requests.next() => request,
            () = shutdown.cancelled() => break,
        };
        let Some(request) = request else { break };
        let Some(reply_to) = request.reply.clone() else {
            continue;
        };
        let taken = permits
            .clone()
            .try_acquire_owned()
            .ok()
            .and_then(|permit| Some((permit, shares.take(key(&request))?)));
        let Some((permit, share)) = taken else {
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
            drop((permit, share));
        });
    }
}

/// The pool stream of the `origin` a request's JSON names (`body.get`, `cancel`): the
/// share it is counted in, since such a request names no caller. Empty for a request
/// that names none, which shares one key with the rest of them.
pub(crate) fn origin_stream(request: &Message) -> String {
    #[derive(serde::Deserialize)]
    struct Names {
        origin: String,
    }
    serde_json::from_slice::<Names>(&request.payload)
        .ok()
        .and_then(|names| Some(names.origin.split_once(':')?.0.to_string()))
        .unwrap_or_default()
}

/// How many requests each key holds, each at most `max`. A key is kept only while it
/// holds one, so there are never more keys than requests under way.
#[derive(Debug)]
struct Shares {
    max: usize,
    held: Mutex<HashMap<String, usize>>,
}

/// One request's place in its key's share, given back when dropped.
#[derive(Debug)]
struct Share {
    shares: Arc<Shares>,
    key: String,
}

impl Shares {
    fn new(max: usize) -> Shares {
        Shares {
            max,
            held: Mutex::new(HashMap::new()),
        }
    }

    /// A place for `key`, unless it holds `max` already.
    fn take(self: &Arc<Self>, key: String) -> Option<Share> {
        let mut held = self.held.lock().unwrap_or_else(PoisonError::into_inner);
        let count = held.entry(key.clone()).or_default();
        if *count >= self.max {
            return None;
        }
        *count += 1;
        Some(Share {
            shares: self.clone(),
            key,
        })
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = self
            .shares
            .held
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = held.get_mut(&self.key) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_counted_in_the_pool_stream_of_the_origin_it_names() {
        let request = |payload: &str| Message {
            subject: "webproxy.cancel".into(),
            reply: None,
            payload: Bytes::from(payload.to_string()),
            headers: None,
            status: None,
            description: None,
            length: payload.len(),
        };
        let named = r#"{"id":"a","origin":"WEBPROXY_POOL_A:17","msg_id":"m"}"#;
        assert_eq!(origin_stream(&request(named)), "WEBPROXY_POOL_A");
        for unnamed in ["", "{}", r#"{"origin":"no-sequence"}"#, "[1]"] {
            assert_eq!(origin_stream(&request(unnamed)), "", "{unnamed}");
        }
    }

    #[test]
    fn one_key_holds_at_most_its_share_and_gives_it_back() {
        let shares = Arc::new(Shares::new(2));
        let a1 = shares.take("a".into()).expect("a's first");
        let _a2 = shares.take("a".into()).expect("a's second");
        assert!(shares.take("a".into()).is_none(), "a's share is full");
        let _b = shares.take("b".into()).expect("b is not held back by a");
        drop(a1);
        let _a3 = shares.take("a".into()).expect("a's place came back");
        drop((_a2, _a3, _b));
        assert!(
            shares.held.lock().expect("lock").is_empty(),
            "no key is kept without a request"
        );
    }
}
