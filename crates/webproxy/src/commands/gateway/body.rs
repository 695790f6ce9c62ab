//! A gateway request's bodies, both ways: the client's body read whole up to the
//! inline limit, or (on a `large_bodies` route) streamed on into the pool's upload
//! store as it arrives; and a reply's stored body streamed back from the body store.
//! Either way the gateway holds at most the inline limit of one body at a time.

use std::time::Duration;

use axum::body::{Body, BodyDataStream};
use bytes::Bytes;
use futures::StreamExt as _;
use tracing::warn;
use webproxy_client::{Client, Error as ClientError, Origin, Upload, UploadRef};

/// A request body as the gateway received it.
#[derive(Debug)]
pub(super) enum Received {
    /// Whole, within the inline limit.
    Whole(Vec<u8>),
    /// Uploaded to the pool's upload store.
    Uploaded(UploadRef),
}

/// Why a body was not received whole.
#[derive(Debug)]
pub(super) enum Unread {
    /// Over the limit the `key` names: read up to it, not refused by its
    /// `Content-Length`, since an answer sent while a client still writes megabytes
    /// is often lost to the reset of closing under them.
    TooLarge { key: &'static str, limit: u64 },
    /// No bytes for `body_idle_timeout`.
    Stalled,
    /// The connection failed or the framing was wrong.
    Failed(axum::Error),
    /// The upload store refused a chunk, or could not be reached.
    Upload(ClientError),
}

/// How much of a body the gateway takes, and how long it waits for the next bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// `[outbound] max_request_bytes`: the most held in memory and sent inline.
    pub(super) inline: usize,
    /// `[outbound] max_large_body` on a `large_bodies` route: the most uploaded.
    pub(super) large: Option<u64>,
    /// `[gateway] body_idle_timeout`.
    pub(super) idle: Duration,
}

/// Reads `body`: whole when it fits `limits.inline`; past that, on a route that takes
/// large bodies, into a new upload for `pool`, with no pause between its bytes longer
/// than `limits.idle` either way (a slow body that keeps coming is read to its end).
/// An upload abandoned part way (a stall, a failure) expires with the upload store's
/// `upload_max_age`.
pub(super) async fn receive(
    body: Body,
    limits: Limits,
    client: &Client,
    pool: &str,
) -> Result<Received, Unread> {
    let mut chunks = body.into_data_stream();
    let mut read = Vec::new();
    while let Some(chunk) = next(&mut chunks, limits.idle).await? {
        if read.len() + chunk.len() <= limits.inline {
            read.extend_from_slice(&chunk);
            continue;
        }
        let Some(max) = limits.large else {
            return Err(Unread::TooLarge {
                key: "outbound.max_request_bytes",
                limit: limits.inline as u64,
            });
        };
        let mut upload = client.upload_writer(pool).map_err(Unread::Upload)?;
        write(&mut upload, &read, max).await?;
        drop(read);
        write(&mut upload, &chunk, max).await?;
        while let Some(chunk) = next(&mut chunks, limits.idle).await? {
            write(&mut upload, &chunk, max).await?;
        }
        return upload
            .finish()
            .await
            .map(Received::Uploaded)
            .map_err(Unread::Upload);
    }
    Ok(Received::Whole(read))
}

/// Uploads a body received whole whose envelope would not fit a NATS message.
pub(super) async fn upload_whole(
    client: &Client,
    pool: &str,
    body: &[u8],
) -> Result<UploadRef, Unread> {
    client.upload(pool, body).await.map_err(Unread::Upload)
}

async fn next(chunks: &mut BodyDataStream, idle: Duration) -> Result<Option<Bytes>, Unread> {
    match tokio::time::timeout(idle, chunks.next()).await {
        Err(_) => Err(Unread::Stalled),
        Ok(None) => Ok(None),
        Ok(Some(Err(e))) => Err(Unread::Failed(e)),
        Ok(Some(Ok(chunk))) => Ok(Some(chunk)),
    }
}

async fn write(upload: &mut Upload, bytes: &[u8], max: u64) -> Result<(), Unread> {
    if upload.size() + bytes.len() as u64 > max {
        return Err(Unread::TooLarge {
            key: "outbound.max_large_body",
            limit: max,
        });
    }
    upload.write(bytes).await.map_err(Unread::Upload)
}

/// Where a reply's stored body is read: its conversation, and the `Nats-Msg-Id` it
/// was published with, which `body.get` takes as the capability.
#[derive(Debug, Clone)]
pub(super) struct StoredBody {
    pub(super) origin: Origin,
    pub(super) msg_id: String,
}

/// The stored body of conversation `id`, streamed chunk by chunk as `body.get` answers.
/// A read that fails part way ends the stream with an error, which cuts the response
/// short of its `Content-Length`: the client sees a broken body, never a short one
/// that looks whole.
pub(super) fn streamed(
    client: &Client,
    id: &str,
    stored: &StoredBody,
) -> Result<Body, ClientError> {
    let reader = client.body_reader(id, &stored.origin, &stored.msg_id)?;
    let id = id.to_string();
    let chunks = reader.into_stream().inspect(move |chunk| {
        if let Err(e) = chunk {
            warn!(id, error = %e, "a stored body could not be read to its end; the answer is cut short");
        }
    });
    Ok(Body::from_stream(chunks))
}
