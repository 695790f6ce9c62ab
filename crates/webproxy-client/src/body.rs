//! Stored bodies, chunk by chunk: a reply's `body_object` read through
//! `<prefix>.body.get` ([`BodyReader`]) and a request body written through
//! `<prefix>.body.put.<pool>` ([`Upload`]), so neither is ever held whole.

use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use sha2::Digest as _;
use webproxy_protocol::{
    BodyGetCode, BodyGetError, BodyGetRequest, BodyPutAnswer, BodyPutRequest, Origin, UploadRef,
    body_header,
};

use crate::{Client, Error, check_id, new_msg_id, validate_pool_name};

/// How much of a body one `body.put` request carries: 256 KiB, about 350 KB in base64,
/// well within the default 1 MiB `max_payload`.
const UPLOAD_CHUNK: usize = 256 * 1024;

/// How many times in all a request answered `busy` (the service's instances answer a
/// fixed number at once, a caller's share of them fewer) is sent, the pause before
/// the second, doubling after: 50 ms to 800 ms, 1.55 s in all.
const BUSY_TRIES: u32 = 6;
const BUSY_PAUSE: Duration = Duration::from_millis(50);

/// Sends `payload` to `subject` and waits for the answer, again while `busy(answer)`
/// says the service was busy, up to [`BUSY_TRIES`] times.
pub(crate) async fn ask_while_busy(
    nats: &async_nats::Client,
    subject: &str,
    payload: Bytes,
    busy: impl Fn(&async_nats::Message) -> bool,
) -> Result<async_nats::Message, async_nats::RequestError> {
    let mut pause = BUSY_PAUSE;
    let mut tries = 1;
    loop {
        let answer = nats.request(subject.to_string(), payload.clone()).await?;
        if tries == BUSY_TRIES || !busy(&answer) {
            return Ok(answer);
        }
        tries += 1;
        tokio::time::sleep(pause).await;
        pause *= 2;
    }
}

/// A stored body being read through `body.get`, one answer at a time. The size and
/// digest the service names are checked before the last chunk is handed out, so a
/// caller that streams the body on sees an error, never a short or altered body that
/// looks whole.
#[derive(Debug)]
pub struct BodyReader {
    nats: async_nats::Client,
    subject: String,
    request: BodyGetRequest,
    hasher: sha2::Sha256,
    read: u64,
    /// The total size, known from the first answer.
    size: Option<u64>,
    done: bool,
}

impl BodyReader {
    /// The body's size, once the first chunk has been read.
    pub fn size(&self) -> Option<u64> {
        self.size
    }

    /// The next chunk, or `None` after the last.
    pub async fn next_chunk(&mut self) -> Result<Option<Bytes>, Error> {
        if self.done {
            return Ok(None);
        }
        let payload = serde_json::to_vec(&self.request).map_err(Error::Encode)?;
        let answer = ask_while_busy(&self.nats, &self.subject, payload.into(), |answer| {
            answer
                .headers
                .as_ref()
                .and_then(|h| h.get(body_header::ERROR))
                .is_some_and(|code| code.as_str() == BodyGetCode::Busy.as_str())
        })
        .await
        .map_err(Error::BodyRequest)?;
        let headers = answer.headers.unwrap_or_default();
        let text = |name: &str| headers.get(name).map(|v| v.as_str().to_string());
        if let Some(code) = text(body_header::ERROR) {
            let message = serde_json::from_slice::<BodyGetError>(&answer.payload)
                .map(|e| e.message)
                .unwrap_or_default();
            self.done = true;
            return Err(Error::Body { code, message });
        }
        let size = text(body_header::SIZE).unwrap_or_default();
        self.size = size.parse().ok();
        self.hasher.update(&answer.payload);
        self.read += answer.payload.len() as u64;
        match text(body_header::CURSOR) {
            Some(cursor) => self.request.cursor = Some(cursor),
            None => {
                self.done = true;
                let digest = text(body_header::DIGEST).unwrap_or_default();
                let actual = digest_of(std::mem::take(&mut self.hasher));
                if size != self.read.to_string() || digest != actual {
                    return Err(Error::Body {
                        code: "digest".into(),
                        message: format!(
                            "read {} bytes with digest {actual}, the store says {size} bytes with {digest}",
                            self.read
                        ),
                    });
                }
            }
        }
        Ok(Some(answer.payload))
    }

    /// The chunks as a stream, for a body handed on as it is read (an HTTP response).
    pub fn into_stream(self) -> impl futures::Stream<Item = Result<Bytes, Error>> + Send {
        futures::stream::try_unfold(self, |mut reader| async move {
            Ok(reader.next_chunk().await?.map(|chunk| (chunk, reader)))
        })
    }
}

/// A request body being uploaded through `body.put`, as it arrives: whole 256 KiB
/// chunks are sent as soon as they fill, so at most one is held.
#[derive(Debug)]
pub struct Upload {
    nats: async_nats::Client,
    subject: String,
    name: String,
    /// What the service has stored.
    sent: u64,
    pending: Vec<u8>,
    hasher: sha2::Sha256,
}

impl Upload {
    /// Adds `bytes` to the body, sending every chunk that fills.
    pub async fn write(&mut self, mut bytes: &[u8]) -> Result<(), Error> {
        while !bytes.is_empty() {
            let take = (UPLOAD_CHUNK - self.pending.len()).min(bytes.len());
            self.pending.extend_from_slice(&bytes[..take]);
            self.hasher.update(&bytes[..take]);
            bytes = &bytes[take..];
            if self.pending.len() == UPLOAD_CHUNK {
                self.send_pending().await?;
            }
        }
        Ok(())
    }

    /// How many bytes have been written so far.
    pub fn size(&self) -> u64 {
        self.sent + self.pending.len() as u64
    }

    /// Sends what is left and names the upload, for [`crate::Request::body_upload`].
    pub async fn finish(mut self) -> Result<UploadRef, Error> {
        if !self.pending.is_empty() {
            self.send_pending().await?;
        }
        Ok(UploadRef {
            upload: self.name,
            size: self.sent,
            digest: digest_of(self.hasher),
        })
    }

    async fn send_pending(&mut self) -> Result<(), Error> {
        let end = self.sent + self.pending.len() as u64;
        let put = BodyPutRequest {
            upload: self.name.clone(),
            offset: self.sent,
            data_base64: base64::engine::general_purpose::STANDARD.encode(&self.pending),
        };
        let payload = serde_json::to_vec(&put).map_err(Error::Encode)?;
        let answer = ask_while_busy(&self.nats, &self.subject, payload.into(), |answer| {
            serde_json::from_slice::<BodyPutAnswer>(&answer.payload)
                .is_ok_and(|answer| answer.error.is_some_and(|e| e.code == "busy"))
        })
        .await
        .map_err(Error::BodyRequest)?;
        let answer: BodyPutAnswer =
            serde_json::from_slice(&answer.payload).map_err(Error::Decode)?;
        match (answer.size, answer.error) {
            (Some(size), None) if size == end => {}
            // A chunk an earlier try stored: the upload ends where this one would.
            (Some(size), Some(error)) if error.code == "offset" && size == end => {}
            (Some(size), None) => {
                return Err(Error::Body {
                    code: "offset".into(),
                    message: format!("the upload ends at {size}, not {end}"),
                });
            }
            (_, Some(error)) => {
                return Err(Error::Body {
                    code: error.code,
                    message: error.message,
                });
            }
            (None, None) => {
                return Err(Error::Body {
                    code: "internal".into(),
                    message: "body.put answered neither a size nor an error".into(),
                });
            }
        }
        self.sent = end;
        self.pending.clear();
        Ok(())
    }
}

impl Client {
    /// The stored body of the conversation `origin` with envelope id `id`, published
    /// with `msg_id`, to be read chunk by chunk through `<prefix>.body.get` (which
    /// isolated callers may use too). For a reply whose `body_object` is set.
    pub fn body_reader(
        &self,
        id: &str,
        origin: &Origin,
        msg_id: &str,
    ) -> Result<BodyReader, Error> {
        check_id(id)?;
        Ok(BodyReader {
            nats: self.nats.clone(),
            subject: self.subjects.body_get(),
            request: BodyGetRequest {
                id: id.to_string(),
                origin: origin.to_string(),
                msg_id: msg_id.to_string(),
                cursor: None,
            },
            hasher: sha2::Sha256::new(),
            read: 0,
            size: None,
            done: false,
        })
    }

    /// The stored body of [`Client::body_reader`], read whole, in order, with its size
    /// and SHA-256 digest checked.
    pub async fn read_body(
        &self,
        id: &str,
        origin: &Origin,
        msg_id: &str,
    ) -> Result<Vec<u8>, Error> {
        let mut reader = self.body_reader(id, origin, msg_id)?;
        let mut body = Vec::new();
        while let Some(chunk) = reader.next_chunk().await? {
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    }

    /// A new upload for a request to `pool`, through `<prefix>.body.put.<pool>` (under
    /// this client's caller name, if it has one). An upload no envelope names is gone
    /// after the service's `upload_max_age`.
    pub fn upload_writer(&self, pool: &str) -> Result<Upload, Error> {
        validate_pool_name(pool).map_err(Error::InvalidPool)?;
        let subject = match &self.caller {
            None => self.subjects.body_put(pool),
            Some(caller) => self.subjects.caller_body_put(pool, caller),
        };
        Ok(Upload {
            nats: self.nats.clone(),
            subject,
            name: new_msg_id()?,
            sent: 0,
            pending: Vec::with_capacity(UPLOAD_CHUNK),
            hasher: sha2::Sha256::new(),
        })
    }

    /// Uploads `body` whole ([`Client::upload_writer`]); the result goes in the
    /// envelope with [`crate::Request::body_upload`].
    pub async fn upload(&self, pool: &str, body: &[u8]) -> Result<UploadRef, Error> {
        let mut upload = self.upload_writer(pool)?;
        upload.write(body).await?;
        upload.finish().await
    }
}

/// `SHA-256=<base64url, padded>`, the form the service names digests in.
fn digest_of(hasher: sha2::Sha256) -> String {
    format!(
        "SHA-256={}",
        base64::engine::general_purpose::URL_SAFE.encode(hasher.finalize())
    )
}
