//! Large request bodies: an upload (`<prefix>.body.put.<pool>`) that an envelope names
//! in `body_object` is bound to that conversation, checked, copied into the body store
//! of the pool it started in, and sent upstream from there as it is read.
//!
//! Binding: the first delivery to find the upload reads it whole once (its caller, size
//! and digest against the envelope: a mismatch is `invalid_request`, before any byte
//! goes upstream), then claims it with a marker published expecting the upload's last
//! chunk (so of two envelopes naming one upload, one binds it), copies it into
//! `<STREAM>:<seq>:request` with a lifetime of `dead_max_age` (so a replay of a failed
//! conversation sends it again), and removes the upload. The copy, not the upload's
//! TTL, is what then keeps the body: an upload lives `upload_max_age` only until bound.
//! A delivery that finds the copy made uses it; one that finds its own claim but no
//! copy (a pod killed while copying) copies again. A conversation that ends in a
//! response removes the copy.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, context::PublishErrorKind, message::PublishMessage};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE;
use bytes::Bytes;
use sha2::{Digest as _, Sha256};
use webproxy_jetstream::provision::body_store_config;
use webproxy_protocol::{ErrorBody, ErrorCode, Subjects, UploadRef};
use webproxy_worker::{BodySink as _, StreamedBody};

use super::Conversation;
use super::body_store::{BodyStores, BodyWriter, found_nothing, remove_object};

/// On an upload's chunk: the upload's size once this chunk is in.
pub(crate) const UPLOAD_END: &str = "Webproxy-Upload-End";
/// On an upload's chunk: the caller name of the subject it was uploaded on, if any.
pub(crate) const UPLOAD_CALLER: &str = "Webproxy-Caller";
/// On an upload's last message once bound: the origin of the conversation that took it.
pub(crate) const UPLOAD_BOUND: &str = "Webproxy-Upload-Bound";

/// A request body stored for its conversation.
#[derive(Debug, Clone)]
pub(crate) struct StoredRequest {
    bucket: String,
    token: String,
    name: String,
    pub(crate) size: u64,
}

fn invalid(message: String) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::InvalidRequest,
        message: format!("invalid field `body_object`: {message}"),
        status: None,
    }
}

fn internal(message: String) -> ErrorBody {
    ErrorBody {
        code: ErrorCode::Internal,
        message,
        status: None,
    }
}

/// What an upload holds, read in order.
struct UploadState {
    /// Data chunks' sequences.
    chunks: Vec<u64>,
    size: u64,
    digest: String,
    /// The last message's sequence (a chunk, or the claim).
    last: u64,
    /// The origin whose claim ends it, if one does.
    bound_to: Option<String>,
}

/// The header `name` of `headers` as text.
fn text<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers.get(name).map(|v| v.as_str())
}

/// Reads upload `token` of `bucket` whole, checking every chunk's caller; hashing as
/// it goes, holding one chunk at a time.
async fn read_upload(
    stream: &jetstream::stream::Stream<()>,
    bucket: &str,
    token: &str,
    caller: Option<&str>,
) -> Result<UploadState, ErrorBody> {
    let subject = Subjects::object_chunks(bucket, token);
    let mut state = UploadState {
        chunks: Vec::new(),
        size: 0,
        digest: String::new(),
        last: 0,
        bound_to: None,
    };
    let mut hasher = Sha256::new();
    let mut next = 0;
    loop {
        let message = match stream
            .direct_get_next_for_subject(subject.as_str(), Some(next))
            .await
        {
            Ok(message) => message,
            Err(e) if found_nothing(&e) => break,
            Err(e) => return Err(internal(format!("cannot read the upload: {e}"))),
        };
        next = message.sequence + 1;
        state.last = message.sequence;
        if let Some(origin) = text(&message.headers, UPLOAD_BOUND) {
            state.bound_to = Some(origin.to_string());
            continue;
        }
        if text(&message.headers, UPLOAD_CALLER) != caller {
            return Err(invalid(
                "the upload was not made under this request's caller".into(),
            ));
        }
        hasher.update(&message.payload);
        state.size += message.payload.len() as u64;
        state.chunks.push(message.sequence);
    }
    state.digest = format!("SHA-256={}", URL_SAFE.encode(hasher.finalize()));
    Ok(state)
}

/// The stored request body of `conversation`, bound from `upload` if it is not yet.
pub(crate) async fn bind(
    js: &jetstream::Context,
    stores: &std::sync::Arc<BodyStores>,
    settings: &webproxy_config::settings::Settings,
    conversation: &Conversation<'_>,
    upload: &UploadRef,
) -> Result<StoredRequest, ErrorBody> {
    let origin = conversation.origin();
    let stored = StoredRequest {
        bucket: Subjects::body_bucket_of(&origin.stream),
        token: format!("{}_{}_request", origin.stream, origin.seq),
        name: format!("{origin}:request"),
        size: upload.size,
    };
    if let Some(size) = copied_size(js, &stored).await {
        return if size == upload.size {
            Ok(stored)
        } else {
            Err(invalid(format!(
                "the request body bound to this conversation holds {size} bytes, the envelope says {}",
                upload.size
            )))
        };
    }
    let uploads = Subjects::upload_bucket_of(&origin.stream);
    let token = Subjects::upload_token(&upload.upload);
    let stream = js
        .get_stream_no_info(Subjects::object_stream(&uploads))
        .await
        .map_err(|e| internal(format!("cannot read the upload store: {e}")))?;
    let state = read_upload(&stream, &uploads, &token, conversation.caller()).await?;
    let mine = origin.to_string();
    match state.bound_to.as_deref() {
        Some(other) if other != mine => {
            return Err(invalid(format!(
                "upload {} is bound to another request",
                upload.upload
            )));
        }
        _ => {}
    }
    if state.chunks.is_empty() {
        return Err(invalid(format!(
            "no upload {} (never uploaded, or gone after [streams] upload_max_age)",
            upload.upload
        )));
    }
    if state.size != upload.size || state.digest != upload.digest {
        return Err(invalid(format!(
            "upload {} holds {} bytes with digest {}, the envelope says {} bytes with {}; nothing was sent",
            upload.upload, state.size, state.digest, upload.size, upload.digest
        )));
    }
    if state.bound_to.is_none() {
        claim(js, &uploads, &token, state.last, &mine, settings).await?;
    }
    copy(js, stores, settings, conversation, &stream, &state, &stored).await?;
    for sequence in state.chunks {
        let _ = stream.delete_message(sequence).await;
    }
    Ok(stored)
}

/// The size of `stored`'s copy if it is made (its metadata written).
async fn copied_size(js: &jetstream::Context, stored: &StoredRequest) -> Option<u64> {
    let stream = js
        .get_stream_no_info(Subjects::object_stream(&stored.bucket))
        .await
        .ok()?;
    let meta = Subjects::object_meta(&stored.bucket, &URL_SAFE.encode(&stored.name));
    let message = stream.direct_get_last_for_subject(meta).await.ok()?;
    let info: async_nats::jetstream::object_store::ObjectInfo =
        serde_json::from_slice(&message.payload).ok()?;
    (!info.deleted).then_some(info.size as u64)
}

/// Marks the upload taken by `origin`, expecting its last message to be `last`: of two
/// conversations binding it at once, one succeeds.
async fn claim(
    js: &jetstream::Context,
    uploads: &str,
    token: &str,
    last: u64,
    origin: &str,
    settings: &webproxy_config::settings::Settings,
) -> Result<(), ErrorBody> {
    let publish = PublishMessage::build()
        .payload(Bytes::new())
        .header(UPLOAD_BOUND, origin)
        .header(
            "Nats-TTL",
            format!("{}s", settings.streams.upload_max_age.as_secs().max(1)).as_str(),
        )
        .expected_last_subject_sequence(last);
    let result = match js
        .send_publish(Subjects::object_chunks(uploads, token), publish)
        .await
    {
        Ok(ack) => ack.await,
        Err(e) => Err(e),
    };
    match result {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => Err(invalid(
            "the upload changed, or another request bound it, while this one was binding it".into(),
        )),
        Err(e) => Err(internal(format!("cannot bind the upload: {e}"))),
    }
}

/// Copies the upload's chunks into `stored`, first removing what an earlier delivery's
/// copy left.
async fn copy(
    js: &jetstream::Context,
    stores: &std::sync::Arc<BodyStores>,
    settings: &webproxy_config::settings::Settings,
    conversation: &Conversation<'_>,
    stream: &jetstream::stream::Stream<()>,
    state: &UploadState,
    stored: &StoredRequest,
) -> Result<(), ErrorBody> {
    remove_object(js, &stored.bucket, &stored.token, &stored.name).await;
    let mut writer = BodyWriter::new(
        js,
        stores.clone(),
        body_store_config(settings, &stored.bucket),
        (stored.token.clone(), stored.name.clone()),
        (conversation.origin().clone(), conversation.generation()),
        settings.streams.dead_max_age,
    );
    let copied = async {
        for sequence in &state.chunks {
            let message = stream
                .get_raw_message(*sequence)
                .await
                .map_err(|e| internal(format!("cannot read the upload: {e}")))?;
            writer
                .write(message.payload)
                .await
                .map_err(|e| internal(e.message))?;
        }
        writer.finish().await.map_err(|e| internal(e.message))
    }
    .await;
    if copied.is_err() {
        // What was copied is removed; the upload is still there for a redelivery.
        writer.keep_if(false).await;
    }
    copied
}

/// `stored` read from the store as it is sent: chunks in order through a channel of
/// two, so an attempt holds at most two chunks of it.
pub(crate) fn send(js: &jetstream::Context, stored: &StoredRequest) -> StreamedBody {
    let (sender, chunks) = tokio::sync::mpsc::channel(2);
    let js = js.clone();
    let stored = stored.clone();
    tokio::spawn(async move {
        let fail = |e: String| Err(std::io::Error::other(format!("stored request body: {e}")));
        let stream = match js
            .get_stream_no_info(Subjects::object_stream(&stored.bucket))
            .await
        {
            Ok(stream) => stream,
            Err(e) => {
                let _ = sender.send(fail(e.to_string())).await;
                return;
            }
        };
        let subject = Subjects::object_chunks(&stored.bucket, &stored.token);
        let mut next = 0;
        let mut sent = 0u64;
        while sent < stored.size {
            match stream
                .direct_get_next_for_subject(subject.as_str(), Some(next))
                .await
            {
                Ok(message) => {
                    next = message.sequence + 1;
                    sent += message.payload.len() as u64;
                    if sender.send(Ok(message.payload)).await.is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = sender.send(fail(e.to_string())).await;
                    return;
                }
            }
        }
    });
    StreamedBody {
        len: stored.size,
        chunks,
    }
}

/// Removes `stored`: its conversation ended in a response.
pub(crate) async fn remove(js: &jetstream::Context, stored: &StoredRequest) {
    remove_object(js, &stored.bucket, &stored.token, &stored.name).await;
}

/// How long an upload lives unbound, for the `body.put` chunks' TTL.
pub(crate) fn upload_ttl(settings: &webproxy_config::settings::Settings) -> Duration {
    settings.streams.upload_max_age
}
