//! The pool's body store: where the response body of a request that set `large_body`
//! goes once it outgrows the inline limit. A [`BodyWriter`] is the worker's sink for
//! one attempt. It writes the chunks and the metadata itself, in the Object Store
//! layout, since `ObjectStore::put` leaves partial chunks behind on failure and the
//! service may not purge. It keeps the sequence of everything it stored, so a body
//! that does not end in the reply (over `max_large_body`, a retry, an error verdict,
//! a failure) is removed message by message (`STREAM.MSG.DELETE` needs no free space,
//! where a purge or rollup in a full store would be refused). Every message carries a
//! TTL (`reply_max_age` plus the attempt's timeout) as the backstop.
//!
//! Names are per attempt: the chunk token and the object name hold the origin, the
//! generation, the attempt and the delivery, so a redelivery never writes over what
//! an earlier delivery left, and first removes it ([`BodyWriter::open`]).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::object_store::{ObjectInfo, ObjectOptions};
use async_nats::jetstream::{self, stream};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE;
use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use tracing::{debug, warn};
use webproxy_jetstream::backoff::Backoff;
use webproxy_protocol::{BodyObject, Subjects, header};
use webproxy_worker::{BodySink, SinkError, SinkFuture};

use super::Conversation;
use super::hop::new_token;

/// The Object Store's default chunk size, which its readers expect.
pub(crate) const CHUNK_BYTES: usize = 128 * 1024;

/// Chunks published and not yet confirmed at once: enough to keep the stream busy,
/// few enough that an attempt holds at most this many chunks in the client's buffers.
const WINDOW: usize = 8;

/// The pools whose body store this instance has made or found: a store is made on a
/// pool's first large body, so a pool that never has one reserves no disk. A store
/// that fails a write is forgotten, so the next large body makes it again if it went.
#[derive(Debug, Default)]
pub(crate) struct BodyStores {
    ready: Mutex<HashSet<String>>,
}

impl BodyStores {
    fn is_ready(&self, bucket: &str) -> bool {
        self.ready.lock().is_ok_and(|ready| ready.contains(bucket))
    }

    /// Makes the store `config` describes unless this instance has seen it already.
    pub(crate) async fn ensure(
        &self,
        js: &jetstream::Context,
        config: stream::Config,
    ) -> Result<(), SinkError> {
        let bucket = bucket_of(&config);
        if !self.is_ready(&bucket) {
            let mut stream = js
                .get_or_create_stream(config)
                .await
                .map_err(|e| sink_error("cannot make the store", e))?;
            // A replicated stream just made has no leader for a moment, and a publish
            // to it then finds no responders: wait for one, within LEADER_WAIT.
            let mut failures = 0;
            loop {
                let led = stream.info().await.is_ok_and(|info| {
                    info.cluster
                        .as_ref()
                        .is_none_or(|cluster| cluster.leader.is_some())
                });
                failures += 1;
                match (led, LEADER_WAIT.after(failures)) {
                    (false, Some(pause)) => tokio::time::sleep(pause).await,
                    _ => break,
                }
            }
            self.mark(&bucket, true);
        }
        Ok(())
    }

    fn mark(&self, bucket: &str, ready: bool) {
        if let Ok(mut set) = self.ready.lock() {
            if ready {
                set.insert(bucket.to_string());
            } else {
                set.remove(bucket);
            }
        }
    }
}

/// How long a store's first use on an instance waits for its stream to have a leader:
/// 50 ms doubling to 800 ms, 2.35 s in all (a 3-node cluster elects one within a
/// second or two).
const LEADER_WAIT: Backoff =
    Backoff::doubling(Duration::from_millis(50), Duration::from_millis(800)).tries(7);

/// How a discarded body's deletes that failed are tried again: 8 more tries, 1 s
/// doubling to 8 s apart, 47 s in all, well past a cluster's leader election.
const DISCARD_RETRY: Backoff =
    Backoff::doubling(Duration::from_secs(1), Duration::from_secs(8)).tries(9);

/// Deletes `sequences` from `bucket`'s stream; returns those whose delete could not
/// reach the stream (no answer, or no stream handle), to be tried again. A JetStream
/// error (the message gone already) is an answer: nothing to try again.
async fn remove_messages(js: &jetstream::Context, bucket: &str, sequences: Vec<u64>) -> Vec<u64> {
    if sequences.is_empty() {
        return sequences;
    }
    let stream = match js.get_stream_no_info(Subjects::object_stream(bucket)).await {
        Ok(stream) => stream,
        Err(e) => {
            debug!(bucket, error = %e, "cannot reach a discarded body's stream");
            return sequences;
        }
    };
    let mut left = Vec::new();
    for sequence in sequences {
        if let Err(e) = stream.delete_message(sequence).await {
            debug!(bucket, sequence, error = %e, "cannot remove a discarded body's message");
            if !matches!(e.kind(), stream::DeleteMessageErrorKind::JetStream(_)) {
                left.push(sequence);
            }
        }
    }
    left
}

/// The bucket whose stream `config` is, `OBJ_<bucket>`.
fn bucket_of(config: &stream::Config) -> String {
    config
        .name
        .strip_prefix("OBJ_")
        .unwrap_or(&config.name)
        .to_string()
}

/// What a body store keeps of a conversation whose latest generation stored a body,
/// on [`Subjects::body_receipt`] in the store of the pool it started in (found from
/// its origin alone), for `dead_max_age`: that body, the envelope id, and the
/// capability's hash. `body.get` reads it to check a caller's message id, and to tell
/// a body that expired from one that never was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Receipt {
    pub(crate) id: String,
    pub(crate) generation: u64,
    pub(crate) msg_id_sha256: String,
    pub(crate) object: BodyObject,
}

/// Where and for how long the receipt of a body goes.
pub(crate) struct ReceiptPlan {
    pub(crate) config: stream::Config,
    pub(crate) id: String,
    pub(crate) ttl: Duration,
}

/// The header of a stored body's metadata that holds the key its `body.get` cursors
/// are signed with: random per object, readable only by those who may read the store.
pub(crate) const CURSOR_KEY: &str = "Webproxy-Cursor-Key";

/// Where one attempt's body goes, and what of it is stored so far.
pub(crate) struct BodyWriter {
    js: jetstream::Context,
    stores: Arc<BodyStores>,
    /// The store's stream, until the first write has made sure it exists.
    config: Option<stream::Config>,
    /// A write failed: the store may be gone.
    failed: bool,
    bucket: String,
    name: String,
    token: String,
    /// `Nats-TTL` on every message.
    ttl: Duration,
    /// Kept in the object's headers; a request body copied from an upload has none.
    msg_id_sha256: Option<String>,
    pending: BytesMut,
    hasher: Sha256,
    size: u64,
    chunks: usize,
    acks: VecDeque<PublishAckFuture>,
    /// The sequence of every message stored, chunks and metadata: what
    /// [`BodyWriter::discard`] deletes.
    stored: Vec<u64>,
    object: Option<BodyObject>,
    receipt: Option<ReceiptPlan>,
    origin: webproxy_protocol::Origin,
    generation: u64,
    /// The receipt's sequence in its store, once stored.
    receipt_stored: Option<u64>,
}

/// What names one attempt's body: its origin, generation, attempt and delivery.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AttemptName<'a> {
    pub(crate) conversation: &'a Conversation<'a>,
    pub(crate) attempt: u32,
    pub(crate) delivered: u64,
}

impl AttemptName<'_> {
    /// The chunk subject's token for `delivered`: `<STREAM>_<seq>_<gen>_<attempt>_<d>`.
    fn token(&self, delivered: u64) -> String {
        let origin = self.conversation.origin();
        format!(
            "{}_{}_{}_{}_{delivered}",
            origin.stream,
            origin.seq,
            self.conversation.generation(),
            self.attempt
        )
    }

    /// The object's name for `delivered`: `<STREAM>:<seq>:<gen>:<attempt>:<d>`.
    fn object_name(&self, delivered: u64) -> String {
        let origin = self.conversation.origin();
        format!(
            "{origin}:{}:{}:{delivered}",
            self.conversation.generation(),
            self.attempt
        )
    }
}

/// Why a body store could not be opened or written.
fn sink_error(what: &str, error: impl std::fmt::Display) -> SinkError {
    let text = error.to_string();
    let full = is_store_full(&text);
    let message = if full {
        format!("body store full: {what}: {text}")
    } else {
        format!("body store: {what}: {text}")
    };
    SinkError { message, full }
}

impl BodyWriter {
    /// A writer for `name`'s body in the store `config` describes, after removing
    /// what earlier deliveries of the same attempt left. The store itself is made on
    /// the first write, so a body that fits inline makes none.
    pub(crate) async fn open(
        js: &jetstream::Context,
        stores: Arc<BodyStores>,
        config: stream::Config,
        name: AttemptName<'_>,
        ttl: Duration,
        msg_id_sha256: String,
        receipt: ReceiptPlan,
    ) -> BodyWriter {
        let writer = BodyWriter::new(
            js,
            stores,
            config,
            (name.token(name.delivered), name.object_name(name.delivered)),
            (
                name.conversation.origin().clone(),
                name.conversation.generation(),
            ),
            ttl,
        )
        .with_receipt(msg_id_sha256, receipt);
        for earlier in 1..name.delivered {
            writer
                .remove_left(&name.token(earlier), &name.object_name(earlier))
                .await;
        }
        writer
    }

    /// A writer of the object `token`/`name` of the conversation `origin` (its
    /// `generation`) in the store `config` describes, each message living `ttl`.
    pub(crate) fn new(
        js: &jetstream::Context,
        stores: Arc<BodyStores>,
        config: stream::Config,
        (token, name): (String, String),
        (origin, generation): (webproxy_protocol::Origin, u64),
        ttl: Duration,
    ) -> BodyWriter {
        BodyWriter {
            receipt: None,
            origin,
            generation,
            receipt_stored: None,
            js: js.clone(),
            stores,
            bucket: bucket_of(&config),
            config: Some(config),
            failed: false,
            token,
            name,
            ttl,
            msg_id_sha256: None,
            pending: BytesMut::new(),
            hasher: Sha256::new(),
            size: 0,
            chunks: 0,
            acks: VecDeque::new(),
            stored: Vec::new(),
            object: None,
        }
    }

    /// Keeps `msg_id_sha256` in the object's headers and `receipt`'s receipt of it.
    fn with_receipt(mut self, msg_id_sha256: String, receipt: ReceiptPlan) -> BodyWriter {
        self.msg_id_sha256 = Some(msg_id_sha256);
        self.receipt = Some(receipt);
        self
    }

    /// Makes the store if this instance has not seen it yet.
    async fn ensure_store(&mut self) -> Result<(), SinkError> {
        match self.config.take() {
            Some(config) => self.stores.ensure(&self.js, config).await,
            None => Ok(()),
        }
    }

    /// The object this writer finished, once it has.
    pub(crate) fn object(&self) -> Option<&BodyObject> {
        self.object.as_ref()
    }

    fn ttl_headers(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            "Nats-TTL",
            format!("{}s", self.ttl.as_secs().max(1)).as_str(),
        );
        headers
    }

    async fn publish(
        &mut self,
        subject: String,
        headers: HeaderMap,
        payload: Bytes,
    ) -> Result<(), SinkError> {
        let ack = self
            .js
            .publish_with_headers(subject, headers, payload)
            .await
            .map_err(|e| sink_error("cannot publish", e))?;
        self.acks.push_back(ack);
        while self.acks.len() >= WINDOW {
            self.confirm_oldest().await?;
        }
        Ok(())
    }

    async fn confirm_oldest(&mut self) -> Result<(), SinkError> {
        if let Some(ack) = self.acks.pop_front() {
            let ack = ack.await.map_err(|e| sink_error("not stored", e))?;
            self.stored.push(ack.sequence);
        }
        Ok(())
    }

    async fn publish_chunk(&mut self, chunk: Bytes) -> Result<(), SinkError> {
        let subject = Subjects::object_chunks(&self.bucket, &self.token);
        self.chunks += 1;
        let headers = self.ttl_headers();
        self.publish(subject, headers, chunk).await
    }

    /// Removes what a delivery killed mid-stream left under `token` and `name`.
    async fn remove_left(&self, token: &str, name: &str) {
        remove_object(&self.js, &self.bucket, token, name).await;
    }

    /// Removes everything this writer stored: its body does not end in a reply.
    pub(crate) async fn discard(mut self) {
        while let Some(ack) = self.acks.pop_front() {
            if let Ok(ack) = ack.await {
                self.stored.push(ack.sequence);
            }
        }
        if let (Some(sequence), Some(plan)) = (self.receipt_stored, &self.receipt) {
            let receipts = bucket_of(&plan.config);
            if let Ok(stream) = self
                .js
                .get_stream_no_info(Subjects::object_stream(&receipts))
                .await
                && let Err(e) = stream.delete_message(sequence).await
            {
                warn!(bucket = %receipts, sequence, error = %e, "cannot remove a discarded body's receipt; its TTL will");
            }
        }
        let left = remove_messages(&self.js, &self.bucket, std::mem::take(&mut self.stored)).await;
        if left.is_empty() {
            return;
        }
        // A delete that timed out (the stream electing its leader again, say) is tried
        // again in the background, so that a leader change leaves no orphan until the
        // TTL; bounded by DISCARD_RETRY's tries, one task per discard.
        let js = self.js.clone();
        let bucket = self.bucket.clone();
        tokio::spawn(async move {
            let mut left = left;
            let mut failures = 1;
            while let Some(pause) = DISCARD_RETRY.after(failures) {
                tokio::time::sleep(pause).await;
                left = remove_messages(&js, &bucket, left).await;
                if left.is_empty() {
                    debug!(bucket = %bucket, failures, "removed a discarded body's messages on a later try");
                    return;
                }
                failures += 1;
            }
            warn!(bucket = %bucket, left = left.len(), "cannot remove a discarded body's messages; their TTL will");
        });
    }

    async fn finish_body(&mut self) -> Result<(), SinkError> {
        if !self.pending.is_empty() {
            let rest = std::mem::take(&mut self.pending).freeze();
            self.publish_chunk(rest).await?;
        }
        while !self.acks.is_empty() {
            self.confirm_oldest().await?;
        }
        let digest = format!(
            "SHA-256={}",
            URL_SAFE.encode(std::mem::take(&mut self.hasher).finalize())
        );
        let mut object_headers = HeaderMap::new();
        if let Some(hash) = &self.msg_id_sha256 {
            object_headers.insert(header::MSG_ID_SHA256, hash.as_str());
        }
        // 128 random bits, as a hop token: a key no caller can guess.
        object_headers.insert(CURSOR_KEY, new_token().as_str());
        let info = ObjectInfo {
            name: self.name.clone(),
            description: None,
            metadata: Default::default(),
            headers: Some(object_headers),
            options: Some(ObjectOptions {
                link: None,
                max_chunk_size: Some(CHUNK_BYTES),
            }),
            bucket: self.bucket.clone(),
            nuid: self.token.clone(),
            size: usize::try_from(self.size).unwrap_or(usize::MAX),
            chunks: self.chunks,
            modified: Some(time::OffsetDateTime::from(webproxy_jetstream::clock::now())),
            digest: Some(digest.clone()),
            deleted: false,
        };
        let payload = serde_json::to_vec(&info).map_err(|e| sink_error("metadata", e))?;
        let mut headers = self.ttl_headers();
        headers.insert("Nats-Rollup", "sub");
        let subject = Subjects::object_meta(&self.bucket, &URL_SAFE.encode(&self.name));
        self.publish(subject, headers, Bytes::from(payload)).await?;
        self.confirm_oldest().await?;
        let object = BodyObject {
            bucket: self.bucket.clone(),
            name: self.name.clone(),
            size: self.size,
            digest,
        };
        if self.receipt.is_some() {
            self.store_receipt(&object).await?;
        }
        self.object = Some(object);
        Ok(())
    }

    /// Stores the receipt of `object` in the store of the pool the conversation
    /// started in, confirmed.
    async fn store_receipt(&mut self, object: &BodyObject) -> Result<(), SinkError> {
        let Some(plan) = &self.receipt else {
            return Ok(());
        };
        let receipts = bucket_of(&plan.config);
        let ttl = plan.ttl;
        self.stores.ensure(&self.js, plan.config.clone()).await?;
        let receipt = Receipt {
            id: plan.id.clone(),
            generation: self.generation,
            msg_id_sha256: self.msg_id_sha256.clone().unwrap_or_default(),
            object: object.clone(),
        };
        let payload = serde_json::to_vec(&receipt).map_err(|e| sink_error("receipt", e))?;
        let mut headers = HeaderMap::new();
        headers.insert("Nats-TTL", format!("{}s", ttl.as_secs().max(1)).as_str());
        let ack = self
            .js
            .publish_with_headers(
                Subjects::body_receipt(&receipts, &self.origin),
                headers,
                Bytes::from(payload),
            )
            .await
            .map_err(|e| sink_error("cannot publish the receipt", e))?
            .await
            .map_err(|e| sink_error("receipt not stored", e))?;
        self.receipt_stored = Some(ack.sequence);
        Ok(())
    }
}

impl BodyWriter {
    async fn write_body(&mut self, mut bytes: Bytes) -> Result<(), SinkError> {
        self.ensure_store().await?;
        self.hasher.update(&bytes);
        self.size += bytes.len() as u64;
        // `pending` lives as long as the attempt, so it never grows past a chunk: whole
        // chunks of a large write (the inline head) go out as slices of it.
        while !bytes.is_empty() {
            if self.pending.is_empty() && bytes.len() >= CHUNK_BYTES {
                let chunk = bytes.split_to(CHUNK_BYTES);
                self.publish_chunk(chunk).await?;
                continue;
            }
            if self.pending.is_empty() {
                // One allocation a chunk, rather than doubling up to one.
                self.pending.reserve(CHUNK_BYTES);
            }
            let take = (CHUNK_BYTES - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes.split_to(take));
            if self.pending.len() == CHUNK_BYTES {
                let chunk = self.pending.split().freeze();
                self.publish_chunk(chunk).await?;
            }
        }
        Ok(())
    }

    fn noting_failure<T>(&mut self, result: Result<T, SinkError>) -> Result<T, SinkError> {
        self.failed |= result.is_err();
        result
    }
}

impl BodySink for BodyWriter {
    fn write(&mut self, bytes: Bytes) -> SinkFuture<'_, ()> {
        Box::pin(async move {
            let result = self.write_body(bytes).await;
            self.noting_failure(result)
        })
    }

    fn finish(&mut self) -> SinkFuture<'_, ()> {
        Box::pin(async move {
            let result = self.finish_body().await;
            self.noting_failure(result)
        })
    }
}

impl BodyWriter {
    /// Keeps the body when `named`, the ending being the reply that names it; else
    /// removes what was stored of it.
    pub(crate) async fn keep_if(self, named: bool) {
        if named && self.object.is_some() {
            return;
        }
        if self.failed {
            // The store may be gone: the next body makes sure of it again.
            self.stores.mark(&self.bucket, false);
        }
        self.discard().await;
    }
}

/// Removes every message still stored under `bucket`'s chunks of `token` and the
/// metadata of `name`: read by subject, deleted by sequence (no free space needed). A
/// failure leaves the rest to their TTL.
pub(crate) async fn remove_object(js: &jetstream::Context, bucket: &str, token: &str, name: &str) {
    let Ok(stream) = js.get_stream_no_info(Subjects::object_stream(bucket)).await else {
        return;
    };
    let chunks = Subjects::object_chunks(bucket, token);
    let mut next = 0;
    let mut removed = 0u32;
    while let Ok(message) = stream
        .direct_get_next_for_subject(chunks.as_str(), Some(next))
        .await
    {
        next = message.sequence + 1;
        if stream.delete_message(message.sequence).await.is_err() {
            return;
        }
        removed += 1;
    }
    let meta = Subjects::object_meta(bucket, &URL_SAFE.encode(name));
    if let Ok(message) = stream.direct_get_last_for_subject(meta).await
        && stream.delete_message(message.sequence).await.is_ok()
    {
        removed += 1;
    }
    if removed > 0 {
        debug!(bucket, token, removed, "removed a stored object's messages");
    }
}

/// Whether a publish error says the store is full (`max_bytes` with discard new).
pub(crate) fn is_store_full(error: &str) -> bool {
    error.to_ascii_lowercase().contains("maximum bytes")
}

/// Whether a direct get found nothing: no such message, or no such store (a store is
/// made on first use, so one never used answers "no responders").
pub(crate) fn found_nothing(error: &jetstream::stream::DirectGetError) -> bool {
    matches!(
        error.kind(),
        jetstream::stream::DirectGetErrorKind::NotFound
    ) || error.to_string().contains("no responders")
}
