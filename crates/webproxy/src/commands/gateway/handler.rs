//! One HTTP request through the gateway: route, token, limits, envelope, publish,
//! record, wait, answer; `GET /_webproxy/replies/<id>`, and its `DELETE`, which
//! cancels the conversation.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::CONTENT_LENGTH;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode};
use axum::response::Response;
use tokio::sync::Semaphore;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};
use webproxy_client::{Client, Error as ClientError, Origin, Request as Publish, RequestEnvelope};
use webproxy_jetstream::backoff::Backoff;

use super::body::{self, Limits, Received, StoredBody, Unread};
use super::connections::Limit;
use super::ids::{self, Binding, BodyPart, Fingerprint, Key};
use super::mapping::{self, Answer};
use super::metrics::{NO_ROUTE, Telemetry};
use super::store::{Record, Records};
use super::{REPLIES_PATH, route};
use crate::config::gateway::Route;
use crate::config::schema::Settings;

/// What a 503, and a poll for a reply not ready yet, ask the client to wait before it
/// tries again, in seconds: a reply usually comes within one.
const RETRY_AFTER: &str = "1";

/// An id's record is written up to 7 times, 100 ms doubling to 1.6 s apart (4.7 s in
/// all), before the id is given up as unrecorded: after a JetStream outage the
/// bucket's stream answers "no stream found" for a few seconds while the server loads
/// it (`matrix::api_down_gateway` gave up after 0.3 s, under load).
const RECORD_BACKOFF: Backoff =
    Backoff::doubling(Duration::from_millis(100), Duration::from_millis(1600)).tries(7);

/// What keeps the gateway not ready while its key is lost (`Telemetry::set_stuck`).
const KEY_LOST: &str = "key";

/// The code of a request refused while the key is lost.
const KEY_LOST_CODE: &str = "key_lost";

/// Room left in `max_payload` for the NATS message's headers (`Nats-Msg-Id` and the
/// trace context).
const HEADER_ROOM: usize = 1024;

/// Everything a request needs, shared by all of them.
pub(crate) struct Gateway {
    routes: Vec<Route>,
    /// Each route's token, read at start and (files) again on SIGHUP.
    tokens: std::sync::RwLock<Arc<Vec<Option<String>>>>,
    /// The HMAC key in force, or why there is none (a lost key bucket): then the
    /// requests that need it are refused and `/readyz` says why.
    key: std::sync::RwLock<Result<Key, String>>,
    records: Records,
    client: Client,
    wait: Duration,
    idempotency_header: String,
    max_request_bytes: usize,
    /// `[outbound] max_large_body`: the most a `large_bodies` route uploads.
    max_large_body: u64,
    max_payload: usize,
    /// `body_idle_timeout`: the longest pause in a body being read.
    body_idle_timeout: Duration,
    permits: Arc<Semaphore>,
    telemetry: Telemetry,
    /// Cancelled when `shutdown_grace` is about to run out: requests still waiting
    /// for their replies are answered 202 rather than cut with their connections.
    give_up: CancellationToken,
}

impl Gateway {
    pub(crate) fn new(
        settings: &Settings,
        tokens: Vec<Option<String>>,
        key: Result<Key, String>,
        records: Records,
        client: Client,
        max_payload: usize,
        telemetry: Telemetry,
    ) -> Gateway {
        let config = &settings.config.gateway;
        if let Err(reason) = &key {
            error!("{reason}");
        }
        telemetry.set_stuck(KEY_LOST, key.as_ref().err().cloned());
        Gateway {
            routes: settings.gateway.routes.clone(),
            tokens: std::sync::RwLock::new(Arc::new(tokens)),
            key: std::sync::RwLock::new(key),
            records,
            client,
            wait: config.wait,
            idempotency_header: settings.gateway.idempotency_header.clone(),
            max_request_bytes: usize::try_from(settings.config.outbound.max_request_bytes())
                .unwrap_or(usize::MAX),
            max_large_body: settings.config.outbound.max_large_body,
            max_payload,
            body_idle_timeout: config.body_idle_timeout,
            permits: Arc::new(Semaphore::new(config.max_concurrent)),
            telemetry,
            give_up: CancellationToken::new(),
        }
    }

    /// Cancelling it ends every wait for a reply now, as if `wait` had run out.
    pub(crate) fn give_up(&self) -> CancellationToken {
        self.give_up.clone()
    }
}

pub(crate) fn router(gateway: Arc<Gateway>) -> Router {
    Router::new().fallback(handle).with_state(gateway)
}

/// An answer and the id it names (the conversation's, or a fresh one that names
/// nothing when the request was refused before it was bound to its id), and where
/// its body is stored when the reply names a stored one.
struct Answered {
    id: String,
    answer: Answer,
    stored: Option<StoredBody>,
}

impl Answered {
    fn new(id: &str, answer: Answer) -> Answered {
        Answered {
            id: id.to_string(),
            answer,
            stored: None,
        }
    }
}

async fn handle(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let path = request.uri().path().to_string();
    let (route, answered) = match path.strip_prefix(REPLIES_PATH) {
        Some(id) => {
            let id = id.to_string();
            gateway
                .replies(&id, request.method(), request.headers())
                .await
        }
        None => match route::find(&gateway.routes, &path) {
            None => (
                NO_ROUTE.to_string(),
                refused(mapping::gateway_error(
                    404,
                    "no_route",
                    &format!("no gateway route matches {path}"),
                )),
            ),
            Some((route, rest)) => {
                let rest = rest.to_string();
                let index = gateway
                    .routes
                    .iter()
                    .position(|r| r.path == route.path)
                    .unwrap_or_default();
                (
                    route.path.clone(),
                    gateway.proxy(index, &rest, request).await,
                )
            }
        },
    };
    // The stored body is opened first, so the count is of the answer sent.
    let (answered, streamed) = gateway.open_stored_body(answered);
    gateway.telemetry.count(&route, answered.answer.label);
    let mut response = respond(answered);
    if let Some((body, size)) = streamed {
        *response.body_mut() = body;
        response
            .headers_mut()
            .insert(CONTENT_LENGTH, HeaderValue::from(size));
    }
    response
}

/// A refusal before the request was published under its id (or found recorded
/// under it): `Webproxy-Id` is a fresh one that names nothing published.
fn refused(answer: Answer) -> Answered {
    let id = ids::random_id().unwrap_or_else(|_| format!("{}none", ids::PREFIX));
    Answered::new(&id, answer)
}

impl Gateway {
    /// The tokens in force.
    pub(super) fn tokens(&self) -> Arc<Vec<Option<String>>> {
        self.tokens
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Puts re-read tokens in force, all at once (their files changed, or SIGHUP).
    pub(crate) fn replace_tokens(&self, tokens: Vec<Option<String>>) {
        *self
            .tokens
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(tokens);
    }

    /// The key in force, or the refusal of a request that needs it while it is lost
    /// (503 `key_lost`, naming the bucket and the commands that restore it).
    fn key(&self) -> Result<Key, Answer> {
        self.key
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
            .map_err(|reason| mapping::gateway_error(503, KEY_LOST_CODE, &reason))
    }

    /// Puts the key read from its bucket in force, or its loss, and says so when
    /// either changes.
    pub(crate) fn set_key(&self, next: Result<Key, String>) {
        let mut key = self
            .key
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match (&*key, &next) {
            (Ok(old), Ok(new)) if old != new => warn!(
                "the gateway key changed (rotated or restored by an operator): ids minted under the other one are no longer served"
            ),
            (Err(_), Ok(_)) => info!("the gateway key is back: serving every request again"),
            (old, Err(reason)) if old.as_ref().err() != Some(reason) => error!("{reason}"),
            _ => {}
        }
        self.telemetry
            .set_stuck(KEY_LOST, next.as_ref().err().cloned());
        *key = next;
    }

    /// The token a request presents for `route`, checked: the caller's token
    /// identity, or the answer to a missing or wrong token (407 for
    /// `Proxy-Authorization`, 401 for a route's own header), or to a right one while
    /// the key that makes its identity is lost.
    fn authenticate(&self, index: usize, headers: &HeaderMap) -> Result<String, Answer> {
        let route = &self.routes[index];
        let tokens = self.tokens();
        let Some(expected) = tokens.get(index).and_then(Option::as_deref) else {
            return Ok(ids::ANONYMOUS.into());
        };
        let given = headers
            .get(route.token_header.as_str())
            .and_then(|value| value.to_str().ok())
            .and_then(|value| ids::presented(value, route.proxy_credential()));
        match given {
            Some(given) if ids::token_matches(given, expected) => {
                Ok(self.key()?.identity(Some(expected)))
            }
            _ => Err(unauthorized(
                route.proxy_credential(),
                &format!(
                    "route {} needs its token in {}",
                    route.path, route.token_header
                ),
            )),
        }
    }

    /// The credentials of a poll or a cancel (`/_webproxy/replies/<id>`), judged
    /// before its id is looked up so that the answer says nothing of whether the id
    /// exists: one that presents the token of some route (or any, while some route
    /// takes none) goes on to the lookup; any other is refused as a request without
    /// its token is, 407 (401 when every route takes its token in a header of its
    /// own).
    fn poll_credentials(&self, headers: &HeaderMap) -> Result<(), Answer> {
        let tokens = self.tokens();
        let mut proxy_credential = false;
        for (index, route) in self.routes.iter().enumerate() {
            let Some(expected) = tokens.get(index).and_then(Option::as_deref) else {
                return Ok(());
            };
            proxy_credential |= route.proxy_credential();
            let given = headers
                .get(route.token_header.as_str())
                .and_then(|value| value.to_str().ok())
                .and_then(|value| ids::presented(value, route.proxy_credential()));
            if given.is_some_and(|given| ids::token_matches(given, expected)) {
                return Ok(());
            }
        }
        if self.routes.is_empty() {
            return Ok(());
        }
        Err(unauthorized(
            proxy_credential,
            "a poll or a cancel needs the token of the route whose request minted the id",
        ))
    }

    /// A request to a route: checked, published, waited for.
    async fn proxy(&self, index: usize, rest: &str, request: Request) -> Answered {
        let route = &self.routes[index];
        let identity = match self.authenticate(index, request.headers()) {
            Ok(identity) => identity,
            Err(answer) => return refused(answer),
        };
        let url = match route::target(route, rest, request.uri().query()) {
            Ok(url) => url,
            Err(message) => return refused(mapping::gateway_error(400, "bad_path", &message)),
        };
        let split = match mapping::split(request.headers(), &route.token_header) {
            Ok(split) => split,
            Err(message) => return refused(mapping::gateway_error(400, "bad_request", &message)),
        };
        let client_key = match request.headers().get(self.idempotency_header.as_str()) {
            None => None,
            Some(value) => match value.to_str() {
                Ok(key) if !key.trim().is_empty() => Some(key.trim().to_string()),
                _ => {
                    return refused(mapping::gateway_error(
                        400,
                        "bad_request",
                        &format!("{} must be visible ASCII text", self.idempotency_header),
                    ));
                }
            },
        };
        let (id, key) = match &client_key {
            Some(client_key) => {
                let key = match self.key() {
                    Ok(key) => key,
                    Err(answer) => return refused(answer),
                };
                (key.id_for(&route.path, &identity, client_key), Some(key))
            }
            None => match ids::random_id() {
                Ok(id) => (id, None),
                Err(_) => return refused(no_randomness()),
            },
        };
        // Past max_concurrent waiting requests, refuse before reading the body.
        if self.permits.available_permits() == 0 {
            return refused(self.busy());
        }
        let mut envelope = RequestEnvelope {
            id: id.clone(),
            method: request.method().as_str().to_string(),
            url: url.to_string(),
            headers: split.headers,
            large_body: route.large_bodies,
            deadline: split.deadline,
            ..Default::default()
        };
        let limits = Limits {
            inline: self.max_request_bytes,
            large: route.large_bodies.then_some(self.max_large_body),
            idle: self.body_idle_timeout,
        };
        let received =
            match body::receive(request.into_body(), limits, &self.client, &route.pool).await {
                Ok(received) => received,
                Err(unread) => return refused(self.unread(unread)),
            };
        // Whether the envelope fits, once known: an inline body's is judged here, an
        // uploaded one's once the envelope names the upload.
        let (received, fitted) = match received {
            Received::Whole(body) => {
                envelope.body_base64 = mapping::body_base64(&body);
                match self.fits(&envelope) {
                    // Whole, but its envelope would not fit a NATS message.
                    Err(_) if route.large_bodies && !body.is_empty() => {
                        envelope.body_base64 = None;
                        match body::upload_whole(&self.client, &route.pool, &body).await {
                            Ok(upload) => (Received::Uploaded(upload), None),
                            Err(unread) => return refused(self.unread(unread)),
                        }
                    }
                    fitted => (Received::Whole(body), Some(fitted)),
                }
            }
            uploaded => (uploaded, None),
        };
        // A request takes its place only with its whole body in hand, so a client that
        // stalls its body holds its connection but never one of max_concurrent.
        let Ok(_permit) = self.permits.clone().try_acquire_owned() else {
            return refused(self.busy());
        };
        self.telemetry.waiting().inc();
        let _waiting = scopeguard_dec(&self.telemetry);
        let body = match &received {
            Received::Whole(body) => BodyPart::Inline(body),
            Received::Uploaded(upload) => BodyPart::Uploaded {
                digest: &upload.digest,
            },
        };
        let request = key.as_ref().map(|key| {
            key.fingerprint(
                &envelope.method,
                &envelope.url,
                &envelope.headers,
                &self.idempotency_header,
                body,
            )
        });
        if let Received::Uploaded(upload) = received {
            envelope.body_object = Some(upload);
        }
        if let Err(answer) = fitted.unwrap_or_else(|| self.fits(&envelope)) {
            return refused(answer);
        }
        let msg_id = match (&key, &request) {
            (Some(key), Some(request)) => key.msg_id_for(&id, request),
            _ => match ids::random_hex() {
                Ok(msg_id) => msg_id,
                Err(_) => return refused(no_randomness()),
            },
        };
        let mut publish = Publish::from_envelope(envelope)
            .pool(route.pool.clone())
            .msg_id(msg_id.clone());
        for (name, value) in split.trace {
            publish = publish.message_header(name, value);
        }
        let started = Instant::now();
        let conversed = self
            .converse(
                route,
                &identity,
                &id,
                request.as_ref(),
                &publish,
                split.respond_async,
            )
            .await;
        self.telemetry.waited(&route.path, started.elapsed());
        match conversed {
            Ok((answer, origin)) => Answered {
                stored: origin
                    .filter(|_| route.large_bodies)
                    .map(|origin| StoredBody { origin, msg_id }),
                ..Answered::new(&id, answer)
            },
            Err(refusal) => refused(refusal),
        }
    }

    /// Whether `envelope` fits a NATS message with room for its headers: if not, 413
    /// naming its size.
    fn fits(&self, envelope: &RequestEnvelope) -> Result<(), Answer> {
        let size = serde_json::to_vec(envelope).map_or(usize::MAX, |payload| payload.len());
        if size + HEADER_ROOM <= self.max_payload {
            return Ok(());
        }
        Err(mapping::gateway_error(
            413,
            "too_large",
            &format!(
                "the request's envelope would be {size} bytes, over the NATS server's max_payload of {}",
                self.max_payload
            ),
        ))
    }

    /// 503 `busy`: `max_concurrent` requests are waiting.
    fn busy(&self) -> Answer {
        self.telemetry.limited(Limit::MaxConcurrent);
        retry_later(mapping::gateway_error(
            503,
            "busy",
            "the gateway has max_concurrent requests waiting",
        ))
    }

    /// The answer to a body that was not read whole.
    fn unread(&self, unread: Unread) -> Answer {
        match unread {
            Unread::TooLarge { key, limit } => mapping::gateway_error(
                413,
                "too_large",
                &format!("the body is over {key} = {limit}"),
            ),
            Unread::Stalled => {
                self.telemetry.limited(Limit::BodyIdleTimeout);
                let mut answer = mapping::gateway_error(
                    408,
                    "body_timeout",
                    &format!(
                        "no bytes of the body arrived for gateway.body_idle_timeout = {}",
                        humantime::format_duration(self.body_idle_timeout)
                    ),
                );
                answer.headers.push(("connection".into(), "close".into()));
                answer
            }
            Unread::Failed(e) => mapping::gateway_error(
                400,
                "bad_request",
                &format!("the body could not be read: {e}"),
            ),
            Unread::Upload(e) => upload_failed(&e),
        }
    }

    /// Whether a keyed id's record may answer `request`: the refusal (422) of one
    /// that is not the request the key was first used with, or that cannot be told
    /// from it.
    fn bound(&self, record: &Record, request: &Fingerprint) -> Result<(), Answer> {
        let key = &self.idempotency_header;
        match ids::binding(record.request.as_ref(), request) {
            Binding::Same => Ok(()),
            Binding::Differs(part) => Err(mapping::gateway_error(
                422,
                "idempotency_mismatch",
                &format!(
                    "the {key} was used with a different request: the {part} differs. A new request needs a new key"
                ),
            )),
            Binding::Unbound => Err(mapping::gateway_error(
                422,
                "idempotency_unverifiable",
                &format!(
                    "the {key} was first used on an older gateway, which kept nothing to compare this request with, so the first request's answer is not given for it; whoever holds that answer's Webproxy-Id reads it at {REPLIES_PATH}<id>, and the key is free again after [streams] reply_max_age"
                ),
            )),
        }
    }

    /// Publishes `publish` (unless a keyed id's record shows it published already),
    /// records the id, and waits up to `wait` for the reply. `request` is a keyed
    /// id's fingerprint: a record of another request is refused. `Err` is an answer
    /// that must not name the id: one given before the id is bound to this request
    /// (recorded for it, or found recorded for it). A keyed id follows from the
    /// route, the token and the key alone, so naming it to a caller who merely
    /// reused someone else's key would let that caller read the other conversation at
    /// `/_webproxy/replies/<id>`, then or later.
    async fn converse(
        &self,
        route: &Route,
        identity: &str,
        id: &str,
        request: Option<&Fingerprint>,
        publish: &Publish,
        respond_async: bool,
    ) -> Result<(Answer, Option<Origin>), Answer> {
        let known = match request {
            Some(request) => match self.records.get(id).await {
                Ok(Some(record)) => {
                    self.bound(&record, request)?;
                    Some(record)
                }
                Ok(None) => None,
                Err(e) => return Err(unavailable(&e)),
            },
            None => None,
        };
        let deadline = Instant::now() + self.wait;
        let watch = match self.client.watch(id).await {
            Ok(watch) => watch,
            Err(e) => return Err(unavailable(&e)),
        };
        let (origin, stored_first, recorded) = match known {
            // A retry with the same key: the same conversation, never a second publish.
            Some(record) => match record.origin() {
                Ok(origin) => (origin, true, true),
                Err(e) => return Ok((unavailable(&e), None)),
            },
            None => {
                let (origin, duplicate) = match self.client.publish_request(publish).await {
                    Ok(published) => published,
                    Err(e) => return Err(publish_failed(&e)),
                };
                let mut record = Record::new(&route.path, identity, &origin, request);
                // For every route: a poll reads a stored body with it, a DELETE
                // cancels with it.
                record.msg_id = publish.msg_id_set().map(str::to_string);
                match self.record(id, &record).await {
                    // A concurrent retry with the same key recorded first.
                    Ok(record) => match record.origin() {
                        Ok(recorded) => {
                            if let Some(request) = request
                                && let Err(refusal) = self.bound(&record, request)
                            {
                                // Another request under the key, sent at the same
                                // time, recorded first. This one's message (another
                                // Nats-Msg-Id) was published and goes on unanswered.
                                warn!(
                                    id,
                                    %origin,
                                    "a request published under an idempotency key that another request recorded first"
                                );
                                return Err(refusal);
                            }
                            let twin = recorded != origin;
                            (recorded, duplicate || twin, true)
                        }
                        Err(e) => return Ok((unavailable(&e), None)),
                    },
                    Err(e) => {
                        // The conversation goes on (its reply and any dead letter
                        // are kept); only /_webproxy/replies and retries with the
                        // key cannot find it, so no 202 names it.
                        error!(id, %origin, error = format!("{e:#}"), "cannot record a gateway id");
                        (origin, duplicate, false)
                    }
                }
            }
        };
        if respond_async {
            return Ok((mapping::settled(id, recorded, None), Some(origin)));
        }
        let waited = tokio::select! {
            waited = watch.answer(id, &origin, stored_first, deadline) => waited,
            _ = self.give_up.cancelled() => Ok(None),
        };
        let answer = match waited {
            Ok(reply) => mapping::settled(id, recorded, reply.as_ref()),
            Err(e) => unavailable(&e),
        };
        Ok((answer, Some(origin)))
    }

    /// [`Records::create`], tried as [`RECORD_BACKOFF`] says: a bucket that cannot
    /// be written for a moment (a leader election) does not cost the id.
    async fn record(&self, id: &str, record: &Record) -> anyhow::Result<Record> {
        let mut failures = 0;
        loop {
            let error = match self.records.create(id, record).await {
                Ok(held) => return Ok(held),
                Err(e) => e,
            };
            failures += 1;
            let Some(pause) = RECORD_BACKOFF.after(failures) else {
                return Err(error);
            };
            warn!(
                id,
                attempt = failures,
                error = format!("{error:#}"),
                "cannot record a gateway id; trying again"
            );
            tokio::time::sleep(pause).await;
        }
    }

    /// `/_webproxy/replies/<id>`: `GET` (or `HEAD`) polls for the reply, `DELETE`
    /// cancels the conversation; any other method is 405.
    async fn replies(&self, id: &str, method: &Method, headers: &HeaderMap) -> Counted {
        match *method {
            Method::GET | Method::HEAD => self.stored(id, headers).await,
            Method::DELETE => self.cancel(id, headers).await,
            _ => {
                let mut answer = mapping::gateway_error(
                    405,
                    "method_not_allowed",
                    "use GET to poll or DELETE to cancel",
                );
                answer
                    .headers
                    .push(("allow".into(), "GET, HEAD, DELETE".into()));
                (NO_ROUTE.to_string(), Answered::new(id, answer))
            }
        }
    }

    /// The record of `id` and its origin, when the id was minted by a route of this
    /// gateway for the token identity `headers` present: what a poll and a cancel
    /// alike may act on. Otherwise the answer: 407 without the token of any route
    /// ([`Gateway::poll_credentials`]), `key_lost` while the key is lost, 503 when
    /// the bucket cannot be read, and for any other id [`unknown_id`], so nothing
    /// says that the id exists.
    async fn own_record(&self, id: &str, headers: &HeaderMap) -> Result<(Record, Origin), Counted> {
        if let Err(answer) = self.poll_credentials(headers) {
            return Err((NO_ROUTE.to_string(), Answered::new(id, answer)));
        }
        if !id.starts_with(ids::PREFIX) || webproxy_protocol::validate_id(id).is_err() {
            return Err(unknown_id(id));
        }
        let record = match self.records.get(id).await {
            Ok(Some(record)) => record,
            Ok(None) => return Err(unknown_id(id)),
            Err(e) => {
                return Err((NO_ROUTE.to_string(), Answered::new(id, unavailable(&e))));
            }
        };
        let Some(index) = self.routes.iter().position(|r| r.path == record.route) else {
            return Err(unknown_id(id));
        };
        // Another route's token reads as an unknown id: nothing says the id exists. A
        // right one while the key is lost gets the key's refusal: the record's identity
        // cannot be checked without the key.
        match self.authenticate(index, headers) {
            Ok(identity) if identity == record.identity => {}
            Err(answer) if answer.label == KEY_LOST_CODE => {
                return Err((record.route, Answered::new(id, answer)));
            }
            _ => return Err(unknown_id(id)),
        }
        match record.origin() {
            Ok(origin) => Ok((record, origin)),
            Err(e) => Err((record.route, Answered::new(id, unavailable(&e)))),
        }
    }

    /// `GET /_webproxy/replies/<id>`: the reply of an id this gateway's route minted
    /// for the same token identity ([`Gateway::own_record`]), as the original request
    /// would have been answered; 202 with `Retry-After` while there is no reply yet.
    async fn stored(&self, id: &str, headers: &HeaderMap) -> Counted {
        let (record, origin) = match self.own_record(id, headers).await {
            Ok(owned) => owned,
            Err(counted) => return counted,
        };
        let answer = match self.client.reply(id, &origin).await {
            Ok(Some(reply)) => mapping::from_reply(&reply),
            // 202, as a wait that runs out is answered, with a hint when to poll
            // again: a 404 reads as final to HTTP clients.
            Ok(None) => {
                let mut answer = mapping::pending(id);
                answer.label = mapping::PENDING;
                retry_later(answer)
            }
            Err(e) => unavailable(&e),
        };
        let stored = record.msg_id.map(|msg_id| StoredBody { origin, msg_id });
        (
            record.route,
            Answered {
                stored,
                ..Answered::new(id, answer)
            },
        )
    }

    /// `DELETE /_webproxy/replies/<id>`: cancels the conversation of an id this
    /// gateway's route minted for the same token identity ([`Gateway::own_record`]),
    /// with the message id it was published with. `recorded` is 202 and `finished`
    /// 200 ([`mapping::cancel_taken`]); `unknown`, and a record from a gateway that
    /// kept no message id for it, are answered as an unknown id; a service `busy` past
    /// the client's retries is 503 with `Retry-After`; any other failure 502.
    async fn cancel(&self, id: &str, headers: &HeaderMap) -> Counted {
        let (record, origin) = match self.own_record(id, headers).await {
            Ok(owned) => owned,
            Err(counted) => return counted,
        };
        // Older gateways kept the message id only for `large_bodies` routes: without
        // it the service could not tell this caller from anyone who knows the origin.
        let Some(msg_id) = record.msg_id.as_deref() else {
            return unknown_id(id);
        };
        let answer = match self.client.cancel(id, &origin, msg_id).await {
            Ok(state) => match mapping::cancel_taken(id, state) {
                Some(answer) => {
                    info!(id, %origin, cancel = state.as_str(), "cancel taken");
                    answer
                }
                None => return unknown_id(id),
            },
            Err(ClientError::Cancel { code, message }) if code == "busy" => {
                retry_later(mapping::gateway_error(503, "busy", &message))
            }
            Err(e) => {
                warn!(id, %origin, error = %e, "a cancel failed");
                mapping::gateway_error(502, "cancel_failed", &e.to_string())
            }
        };
        (record.route, Answered::new(id, answer))
    }
}

/// An answer and the route it is counted under.
type Counted = (String, Answered);

/// The answer to an id this route and token do not have, whether or not it exists:
/// 404 `not_found`, counted under no route.
fn unknown_id(id: &str) -> Counted {
    (
        NO_ROUTE.to_string(),
        Answered::new(
            id,
            mapping::gateway_error(
                404,
                "not_found",
                "no conversation of this route and token has this id",
            ),
        ),
    )
}

/// The refusal of a missing or wrong token: 407 with `Proxy-Authenticate` for a token
/// in `Proxy-Authorization`, 401 with `WWW-Authenticate` for a route's own header.
fn unauthorized(proxy_credential: bool, message: &str) -> Answer {
    let (status, challenge) = if proxy_credential {
        (407, "proxy-authenticate")
    } else {
        (401, "www-authenticate")
    };
    let mut answer = mapping::gateway_error(status, "unauthorized", message);
    answer
        .headers
        .push((challenge.into(), "Bearer realm=\"webproxy\"".into()));
    answer
}

/// The answer on a connection over a connection cap (`listener.rs`): 503 naming the
/// cap, and the connection closes.
pub(crate) fn over_limit(limit: Limit) -> Response {
    let whose = match limit {
        Limit::MaxConnectionsPerSource => "this client's address has",
        _ => "the gateway has",
    };
    let mut answer = retry_later(mapping::gateway_error(
        503,
        limit.key(),
        &format!(
            "{whose} gateway.{} connections open; try again later",
            limit.key()
        ),
    ));
    answer.headers.push(("connection".into(), "close".into()));
    respond(refused(answer))
}

/// Decrements the waiting gauge when dropped, however the request ends.
fn scopeguard_dec(telemetry: &Telemetry) -> impl Drop + '_ {
    scopeguard::guard((), move |()| {
        telemetry.waiting().dec();
    })
}

/// The operating system's random source failed: 500.
fn no_randomness() -> Answer {
    mapping::gateway_error(
        500,
        "internal",
        "the operating system's random source failed",
    )
}

/// `answer` with `Retry-After`: when to try again (a 503, a poll's 202).
fn retry_later(mut answer: Answer) -> Answer {
    answer
        .headers
        .push(("retry-after".into(), RETRY_AFTER.into()));
    answer
}

/// NATS could not be reached or refused: 503, try again.
fn unavailable(error: &dyn std::fmt::Display) -> Answer {
    warn!(error = %error, "gateway request failed on NATS");
    retry_later(mapping::gateway_error(
        503,
        "unavailable",
        &error.to_string(),
    ))
}

/// A publish JetStream refused: a full queue (`max_waiting`) is 503 with
/// `Retry-After`, a pool that does not exist 502.
fn publish_failed(error: &ClientError) -> Answer {
    if error.is_queue_full() {
        return retry_later(mapping::gateway_error(
            503,
            "queue_full",
            "the pool's queue is full (max_waiting)",
        ));
    }
    if let ClientError::NoSuchPool { .. } = error {
        return mapping::gateway_error(502, "no_such_pool", &error.to_string());
    }
    unavailable(error)
}

impl Gateway {
    /// The stream of the stored body a reply names, and its size (the answer's
    /// `Content-Length`); or, when it cannot be opened, `502 body_unavailable` in the
    /// answer's place.
    fn open_stored_body(&self, answered: Answered) -> (Answered, Option<(Body, u64)>) {
        let Some(size) = answered.answer.stored else {
            return (answered, None);
        };
        let streamed = match &answered.stored {
            Some(stored) => body::streamed(&self.client, &answered.id, stored)
                .map_err(|e| e.to_string()),
            None => Err("the reply names a stored body, but this request's message id was not kept to read it".into()),
        };
        match streamed {
            Ok(body) => (answered, Some((body, size))),
            Err(message) => {
                let mut answer = mapping::gateway_error(502, "body_unavailable", &message);
                answer.attempts = answered.answer.attempts;
                (Answered::new(&answered.id, answer), None)
            }
        }
    }
}

/// An upload the pool's store refused: `busy` (every `body.put` slot taken) 503 with
/// `Retry-After`, a full upload quota 507, a pool that does not exist 502.
fn upload_failed(error: &ClientError) -> Answer {
    let ClientError::Body { code, message } = error else {
        return unavailable(error);
    };
    match code.as_str() {
        "busy" => retry_later(mapping::gateway_error(503, "busy", message)),
        "quota" => mapping::gateway_error(507, "upload_quota", message),
        "unknown_pool" => mapping::gateway_error(502, "no_such_pool", message),
        _ => unavailable(error),
    }
}

/// The HTTP response, with `Webproxy-Id`, `Webproxy-Attempts` and
/// `Webproxy-Outcome` on every answer.
fn respond(Answered { id, answer, .. }: Answered) -> Response {
    let status = StatusCode::from_u16(answer.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let mut response = Response::new(Body::from(answer.body));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    for (name, value) in &answer.headers {
        // The service checked the upstream's headers; one HTTP cannot carry is left
        // out rather than failing the answer.
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(name, value);
        }
    }
    let own = [
        (mapping::ID, id),
        (mapping::ATTEMPTS, answer.attempts.to_string()),
        (mapping::OUTCOME, answer.outcome.to_string()),
    ];
    for (name, value) in own {
        if let Ok(value) = HeaderValue::from_str(&value) {
            headers.insert(HeaderName::from_static(name), value);
        }
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_tried_seven_times_100_ms_doubling_to_1600_ms_apart() {
        let waits: Vec<_> = (1..=7)
            .map(|failures| RECORD_BACKOFF.after(failures))
            .collect();
        let ms = |n| Some(Duration::from_millis(n));
        assert_eq!(
            waits,
            [ms(100), ms(200), ms(400), ms(800), ms(1600), ms(1600), None]
        );
    }
}
