//! `<prefix>.body.put.<pool>[.<caller>]`: large request bodies uploaded in chunks, into
//! the pool's upload store (`<pool stream>_UPLOADS`, whose `max_bytes` is the pool's
//! upload quota), before an envelope names them. Each chunk is published expecting the
//! upload's last message, so chunks sent through several instances land in order and
//! once; a retried chunk is answered with the size stored. Every chunk lives
//! `upload_max_age`, so an upload no envelope binds goes. A fixed number of requests
//! are answered at once; past that the answer is `busy` at once.

use std::sync::Arc;

use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::DirectGetErrorKind;
use async_nats::{HeaderMap, Message};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use webproxy_jetstream::provision::upload_store_config;
use webproxy_protocol::{BodyPutAnswer, BodyPutError, BodyPutRequest, Subjects, is_upload_name};

use crate::conversation::Revision;
use crate::conversation::body_store::is_store_full;
use crate::conversation::request_body::{UPLOAD_BOUND, UPLOAD_CALLER, UPLOAD_END, upload_ttl};
use crate::core_requests;

/// `body.put` requests one instance answers at once.
const MAX_CONCURRENT: usize = 32;

/// Of those, what one caller name may hold (callers of no name share one), so one
/// caller's uploads leave the others at least half.
const MAX_PER_CALLER: usize = MAX_CONCURRENT / 2;

const QUEUE_GROUP: &str = "webproxy-body-put";

/// Answers `body.put` requests under the running revision until `shutdown`.
pub(crate) async fn serve(revisions: watch::Receiver<Arc<Revision>>, shutdown: CancellationToken) {
    let current = revisions.borrow().clone();
    let busy = refused(
        String::new(),
        "busy",
        "as many uploads as this instance takes at once are under way: send the chunk again".into(),
    );
    let subjects = current.settings.subjects.clone();
    let requests = core_requests::Requests {
        subject: subjects.body_put_filter(),
        group: QUEUE_GROUP,
        max_concurrent: MAX_CONCURRENT,
        max_per_key: MAX_PER_CALLER,
        busy: encoded(&busy),
    };
    core_requests::serve(
        current.outlet.client.clone(),
        requests,
        shutdown,
        move |request| {
            let target = subjects.body_put_target(request.subject.as_str());
            target
                .and_then(|(_, caller)| caller)
                .unwrap_or_default()
                .to_string()
        },
        move |request| {
            let shared = revisions.borrow().clone();
            async move { encoded(&put(&shared, &request).await) }
        },
    )
    .await;
}

fn encoded(answer: &BodyPutAnswer) -> core_requests::Answer {
    (
        HeaderMap::new(),
        Bytes::from(serde_json::to_vec(answer).unwrap_or_default()),
    )
}

fn refused(upload: String, code: &str, message: String) -> BodyPutAnswer {
    BodyPutAnswer {
        upload,
        size: None,
        error: Some(BodyPutError {
            code: code.to_string(),
            message,
        }),
    }
}

/// Where upload `name` ends now: its size, the sequence of its last message (0 for
/// none), and whether an envelope bound it.
struct End {
    size: u64,
    last: u64,
    bound: bool,
    caller: Option<String>,
}

async fn end_of(
    stream: &async_nats::jetstream::stream::Stream<()>,
    subject: &str,
) -> Result<End, String> {
    match stream.direct_get_last_for_subject(subject).await {
        Ok(message) => {
            let header = |name: &str| message.headers.get(name).map(|v| v.as_str().to_string());
            Ok(End {
                size: header(UPLOAD_END)
                    .and_then(|size| size.parse().ok())
                    .unwrap_or(0),
                last: message.sequence,
                bound: header(UPLOAD_BOUND).is_some(),
                caller: header(UPLOAD_CALLER),
            })
        }
        Err(e) if e.kind() == DirectGetErrorKind::NotFound => Ok(End {
            size: 0,
            last: 0,
            bound: false,
            caller: None,
        }),
        Err(e) => Err(e.to_string()),
    }
}

/// One upload request's answer.
async fn put(shared: &Revision, request: &Message) -> BodyPutAnswer {
    let settings = &shared.settings;
    let Some((pool, caller)) = settings.subjects.body_put_target(request.subject.as_str()) else {
        return refused(
            String::new(),
            "invalid_request",
            "not an upload subject".into(),
        );
    };
    let put: BodyPutRequest = match serde_json::from_slice(&request.payload) {
        Ok(put) => put,
        Err(e) => {
            return refused(
                String::new(),
                "invalid_request",
                format!("expected {{\"upload\", \"offset\", \"data_base64\"}}: {e}"),
            );
        }
    };
    let name = put.upload.clone();
    let fail = |code: &str, message: String| refused(name.clone(), code, message);
    if !is_upload_name(&put.upload) {
        return fail(
            "invalid_request",
            "`upload` must be 32 random lowercase hex digits".into(),
        );
    }
    if !settings.cluster.pools.contains_key(pool) {
        return fail("unknown_pool", format!("no pool {pool:?}"));
    }
    let data = match BASE64.decode(&put.data_base64) {
        Ok(data) if !data.is_empty() => Bytes::from(data),
        Ok(_) => return fail("invalid_request", "`data_base64` holds no bytes".into()),
        Err(e) => return fail("invalid_request", format!("`data_base64`: {e}")),
    };
    let outlet = &shared.outlet;
    let config = upload_store_config(settings, pool);
    let stream_name = config.name.clone();
    if let Err(e) = outlet.body_stores.ensure(&outlet.js, config).await {
        return fail("internal", e.message);
    }
    let stream = match outlet.js.get_stream_no_info(&stream_name).await {
        Ok(stream) => stream,
        Err(e) => return fail("internal", format!("the upload store: {e}")),
    };
    let bucket = settings.subjects.pool_upload_bucket(pool);
    let subject = Subjects::object_chunks(&bucket, &Subjects::upload_token(&put.upload));
    let end = match end_of(&stream, &subject).await {
        Ok(end) => end,
        Err(e) => return fail("internal", format!("the upload store: {e}")),
    };
    if end.bound {
        return fail("bound", "an envelope has taken this upload already".into());
    }
    if end.last > 0 && end.caller.as_deref() != caller {
        return fail(
            "invalid_request",
            "this upload was started under another caller".into(),
        );
    }
    let answer = |size| BodyPutAnswer {
        upload: name.clone(),
        size: Some(size),
        error: None,
    };
    if put.offset < end.size {
        // Stored before: a retried chunk.
        return answer(end.size);
    }
    if put.offset > end.size {
        let mut refusal = fail(
            "offset",
            format!("the upload holds {} bytes; send from there", end.size),
        );
        refusal.size = Some(end.size);
        return refusal;
    }
    let size = end.size + data.len() as u64;
    let ttl = upload_ttl(settings);
    let mut publish = PublishMessage::build()
        .payload(data)
        .header(UPLOAD_END, size.to_string().as_str())
        .header("Nats-TTL", format!("{}s", ttl.as_secs().max(1)).as_str())
        .expected_last_subject_sequence(end.last);
    if let Some(caller) = caller {
        publish = publish.header(UPLOAD_CALLER, caller);
    }
    let result = match outlet.js.send_publish(subject.clone(), publish).await {
        Ok(ack) => ack.await,
        Err(e) => Err(e),
    };
    match result {
        Ok(_) => answer(size),
        Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
            let now = end_of(&stream, &subject)
                .await
                .map_or(end.size, |end| end.size);
            let mut refusal = fail(
                "offset",
                format!("another chunk landed first; the upload holds {now} bytes"),
            );
            refusal.size = Some(now);
            refusal
        }
        Err(e) if is_store_full(&e.to_string()) => fail(
            "quota",
            format!("pool {pool}'s upload store is full ([streams] upload_max_bytes)"),
        ),
        Err(e) => fail("internal", format!("the upload store: {e}")),
    }
}
