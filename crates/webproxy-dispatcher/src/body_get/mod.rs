//! `<prefix>.body.get`: stored bodies read through the service, chunk by chunk, for
//! callers that may not read the body stores (the isolated callers of
//! `deploy/nats/authorization.conf`, who cannot make the consumer an Object Store read
//! needs and must not see other callers' objects). Every lookup is by a literal
//! subject. The first request shows the message id, checked against the receipt of the
//! conversation; each answer carries a cursor signed with the object's key, which the
//! next request sends. A fixed number of requests are answered at once; past that the
//! answer is `busy` at once, and nothing waits.

mod cursor;

use async_nats::jetstream;
use async_nats::jetstream::object_store::ObjectInfo;
use async_nats::{HeaderMap, Message};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE;
use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use webproxy_protocol::{
    BodyGetCode, BodyGetError, BodyGetRequest, Origin, Subjects, body_header, hex_sha256,
    validate_id,
};

use crate::conversation::body_store::{CURSOR_KEY, Receipt, found_nothing};
use crate::core_requests;
use cursor::Cursor;

/// `body.get` requests one instance answers at once.
pub(crate) const MAX_CONCURRENT: usize = 32;

/// Of those, what the bodies of one pool may hold, so one pool's readers leave the
/// others at least half.
const MAX_PER_POOL: usize = MAX_CONCURRENT / 2;

/// The queue group instances share, so each request is answered once.
const QUEUE_GROUP: &str = "webproxy-body-get";

/// Answers `body.get` requests until `shutdown`.
pub(crate) async fn serve(
    client: async_nats::Client,
    subjects: Subjects,
    shutdown: CancellationToken,
) {
    let js = jetstream::new(client.clone());
    let busy = refusal(
        BodyGetCode::Busy,
        "as many body.get requests as this instance answers at once are under way: ask again",
    );
    let requests = core_requests::Requests {
        subject: subjects.body_get(),
        group: QUEUE_GROUP,
        max_concurrent: MAX_CONCURRENT,
        max_per_key: MAX_PER_POOL,
        busy,
    };
    // A request names no caller (the subject is one for all, and an imported request's
    // reply subject is the server's), so the share is the pool's, as the stores are.
    let key = core_requests::origin_stream;
    core_requests::serve(client, requests, shutdown, key, move |request| {
        let js = js.clone();
        async move { answer(&js, &request).await }
    })
    .await;
}

/// An answer without a chunk.
fn refusal(code: BodyGetCode, message: &str) -> (HeaderMap, Bytes) {
    let mut headers = HeaderMap::new();
    headers.insert(body_header::ERROR, code.as_str());
    let error = BodyGetError {
        code,
        message: message.to_string(),
    };
    (
        headers,
        Bytes::from(serde_json::to_vec(&error).unwrap_or_default()),
    )
}

/// One request's answer.
async fn answer(js: &jetstream::Context, request: &Message) -> (HeaderMap, Bytes) {
    match chunk(js, &request.payload).await {
        Ok(answer) => answer,
        Err((code, message)) => refusal(code, &message),
    }
}

type Refused = (BodyGetCode, String);

const NOT_FOUND: &str =
    "no stored body for this id, origin and message id (unknown, not finished, or not stored)";

fn invalid(message: impl Into<String>) -> Refused {
    (BodyGetCode::InvalidRequest, message.into())
}

/// What a direct get found: the message, nothing, or an error to report.
async fn last_on(
    js: &jetstream::Context,
    bucket: &str,
    subject: String,
) -> Result<Option<jetstream::message::StreamMessage>, Refused> {
    let stream = js
        .get_stream_no_info(Subjects::object_stream(bucket))
        .await
        .map_err(|e| (BodyGetCode::Internal, format!("body store {bucket}: {e}")))?;
    match stream.direct_get_last_for_subject(subject).await {
        Ok(message) => Ok(Some(message)),
        Err(e) if found_nothing(&e) => Ok(None),
        Err(e) => Err((BodyGetCode::Internal, format!("body store {bucket}: {e}"))),
    }
}

/// The object `name` of `bucket` as its metadata says, if it is stored.
async fn object_info(
    js: &jetstream::Context,
    bucket: &str,
    name: &str,
) -> Result<Option<ObjectInfo>, Refused> {
    let subject = Subjects::object_meta(bucket, &URL_SAFE.encode(name));
    let Some(message) = last_on(js, bucket, subject).await? else {
        return Ok(None);
    };
    let info: ObjectInfo = serde_json::from_slice(&message.payload)
        .map_err(|e| (BodyGetCode::Internal, format!("object {name}: {e}")))?;
    Ok((!info.deleted).then_some(info))
}

/// The object's cursor key, from its metadata's headers.
fn key_of(info: &ObjectInfo) -> Option<String> {
    info.headers
        .as_ref()
        .and_then(|h| h.get(CURSOR_KEY))
        .map(|v| v.to_string())
}

const EXPIRED: &str =
    "the body was stored and has expired ([streams] reply_max_age after the reply)";

/// The chunk a request asks for, with its headers.
async fn chunk(js: &jetstream::Context, payload: &[u8]) -> Result<(HeaderMap, Bytes), Refused> {
    let request: BodyGetRequest = serde_json::from_slice(payload).map_err(|e| {
        invalid(format!(
            "expected {{\"id\", \"origin\", \"msg_id\", \"cursor\"?}}: {e}"
        ))
    })?;
    validate_id(&request.id).map_err(|e| invalid(format!("invalid field `id`: {e}")))?;
    let origin: Origin = request
        .origin
        .parse()
        .map_err(|e: webproxy_protocol::InvalidName| {
            invalid(format!("invalid field `origin`: {}", e.0))
        })?;
    let (info, at) = match &request.cursor {
        Some(text) => {
            let (cursor, body, mac) =
                Cursor::read(text).ok_or_else(|| invalid("invalid field `cursor`"))?;
            // A cursor names an object of this conversation only.
            if !cursor.name.starts_with(&format!("{origin}:"))
                || !cursor.bucket.ends_with("_BODIES")
                || validate_id(&cursor.bucket).is_err()
            {
                return Err(invalid("invalid field `cursor`"));
            }
            let info = object_info(js, &cursor.bucket, &cursor.name)
                .await?
                .ok_or((BodyGetCode::Expired, EXPIRED.to_string()))?;
            let key = key_of(&info).unwrap_or_default();
            if key.is_empty() || !Cursor::verify(&key, body, mac) {
                return Err(invalid("invalid field `cursor`"));
            }
            (info, cursor)
        }
        None => first(js, &request, &origin).await?,
    };
    read_chunk(js, info, at).await
}

/// The first chunk's object and place: the receipt of the conversation checked
/// against the id and the message id. A receipt that does not match answers exactly as
/// no receipt does.
async fn first(
    js: &jetstream::Context,
    request: &BodyGetRequest,
    origin: &Origin,
) -> Result<(ObjectInfo, Cursor), Refused> {
    let not_found = || (BodyGetCode::NotFound, NOT_FOUND.to_string());
    let receipts = Subjects::body_bucket_of(&origin.stream);
    if validate_id(&receipts).is_err() {
        return Err(not_found());
    }
    let message = last_on(js, &receipts, Subjects::body_receipt(&receipts, origin))
        .await?
        .ok_or_else(not_found)?;
    let receipt: Receipt = serde_json::from_slice(&message.payload).map_err(|_| not_found())?;
    let shown = hex_sha256(request.msg_id.as_bytes());
    let matches = {
        use subtle::ConstantTimeEq as _;
        bool::from(shown.as_bytes().ct_eq(receipt.msg_id_sha256.as_bytes()))
    };
    if !matches || receipt.id != request.id {
        return Err(not_found());
    }
    let object = receipt.object;
    let info = object_info(js, &object.bucket, &object.name)
        .await?
        .ok_or((BodyGetCode::Expired, EXPIRED.to_string()))?;
    let at = Cursor {
        bucket: object.bucket,
        name: object.name,
        next_seq: 0,
        offset: 0,
    };
    Ok((info, at))
}

/// The chunk at `at`, and the cursor of the one after it.
async fn read_chunk(
    js: &jetstream::Context,
    info: ObjectInfo,
    at: Cursor,
) -> Result<(HeaderMap, Bytes), Refused> {
    let size = info.size as u64;
    let mut headers = HeaderMap::new();
    headers.insert(body_header::SIZE, size.to_string().as_str());
    headers.insert(body_header::OFFSET, at.offset.to_string().as_str());
    if let Some(digest) = &info.digest {
        headers.insert(body_header::DIGEST, digest.as_str());
    }
    if at.offset >= size {
        return Ok((headers, Bytes::new()));
    }
    let stream = js
        .get_stream_no_info(Subjects::object_stream(&at.bucket))
        .await
        .map_err(|e| (BodyGetCode::Internal, format!("body store: {e}")))?;
    let chunks = Subjects::object_chunks(&at.bucket, &info.nuid);
    let message = match stream
        .direct_get_next_for_subject(chunks, Some(at.next_seq))
        .await
    {
        Ok(message) => message,
        Err(e) if found_nothing(&e) => return Err((BodyGetCode::Expired, EXPIRED.to_string())),
        Err(e) => return Err((BodyGetCode::Internal, format!("body store: {e}"))),
    };
    let offset = at.offset + message.payload.len() as u64;
    if offset < size {
        let next = Cursor {
            next_seq: message.sequence + 1,
            offset,
            ..at
        };
        let key = key_of(&info).unwrap_or_default();
        headers.insert(body_header::CURSOR, next.sign(&key).as_str());
    }
    Ok((headers, message.payload))
}
