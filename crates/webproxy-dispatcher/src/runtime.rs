//! The effects: pulls each pool's messages, runs the decisions of `decision`, performs
//! attempts with the worker, publishes replies and dead letters, and acks.
//!
//! A message is always answered, dead-lettered, or left unacked for redelivery; it is
//! never acked before what it produced is stored.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, AckKind};
use async_nats::{HeaderMap, connection};
use bytes::Bytes;
use futures::StreamExt as _;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};
use webproxy_protocol::{
    AttemptRecord, ErrorBody, ErrorCode, ParseError, Request, header, parse_request,
};
use webproxy_worker::{AttemptOutcome, Worker};

use crate::config::Settings;
use crate::decision::{Admission, Verdict, admit, judge};
use crate::egress::Egress;
use crate::health::Health;
use crate::outbox::{
    EncodedReply, ReplyContext, dead_letter, error_reply, invalid_request, response_reply,
};
use crate::secrets::Secrets;

/// The most messages one pull asks for.
const MAX_PULL: usize = 256;
/// How long one pull request waits for messages on the server.
const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// How often and how long a publish of a reply or dead letter is retried before the
/// message is left for redelivery.
const PUBLISH_TRIES: u32 = 8;

/// Connects to NATS, keeping `health` in step with the connection state.
pub async fn connect(
    settings: &Settings,
    health: Arc<Health>,
) -> Result<async_nats::Client, async_nats::ConnectError> {
    let events = health.clone();
    let client = crate::nats_auth::connect_options(&settings.config.nats)
        .await?
        .name("webproxy")
        .retry_on_initial_connect()
        .event_callback(move |event| {
            let events = events.clone();
            async move {
                match event {
                    async_nats::Event::Connected => events.set_nats_connected(true),
                    async_nats::Event::Disconnected => events.set_nats_connected(false),
                    other => debug!(event = %other, "nats event"),
                }
            }
        })
        .connect(settings.config.nats.urls())
        .await?;
    health.set_nats_connected(client.connection_state() == connection::State::Connected);
    Ok(client)
}

/// Everything a message handler needs, shared by all of them.
struct Shared {
    settings: Arc<Settings>,
    client: async_nats::Client,
    js: jetstream::Context,
    worker: Worker,
    max_payload: usize,
    secrets: Arc<Secrets>,
}

/// Consumes every pool of this instance until told to stop.
pub struct Dispatcher {
    shared: Arc<Shared>,
}

impl Dispatcher {
    pub fn new(
        settings: Arc<Settings>,
        client: async_nats::Client,
        worker: Worker,
        max_payload: usize,
        secrets: Arc<Secrets>,
    ) -> Dispatcher {
        let js = jetstream::new(client.clone());
        Dispatcher {
            shared: Arc::new(Shared {
                settings,
                client,
                js,
                worker,
                max_payload,
                secrets,
            }),
        }
    }

    /// Runs the pool loops until `shutdown` is cancelled, then waits up to `grace` for
    /// the attempts in flight. Attempts still running at the deadline are left unacked,
    /// so the server redelivers them elsewhere.
    pub async fn run(
        &self,
        consumers: Vec<(String, PullConsumer)>,
        health: Arc<Health>,
        shutdown: CancellationToken,
        grace: Duration,
    ) {
        let attempts = TaskTracker::new();
        let mut pulls = Vec::new();
        for (pool, consumer) in consumers {
            let shared = self.shared.clone();
            let limit = self
                .shared
                .settings
                .pools
                .get(&pool)
                .map_or(1, |p| p.max_in_flight);
            let permits = Arc::new(Semaphore::new(
                usize::try_from(limit)
                    .unwrap_or(usize::MAX)
                    .min(Semaphore::MAX_PERMITS),
            ));
            pulls.push(tokio::spawn(pull_loop(
                shared,
                Arc::from(pool.as_str()),
                consumer,
                permits,
                attempts.clone(),
                shutdown.clone(),
            )));
        }
        health.set_provisioned();
        shutdown.cancelled().await;
        health.set_draining();
        for pull in pulls {
            let _ = pull.await;
        }
        attempts.close();
        let in_flight = attempts.len();
        info!(in_flight, grace = ?grace, "draining");
        if tokio::time::timeout(grace, attempts.wait()).await.is_err() {
            warn!(
                left = attempts.len(),
                "shutdown grace ran out; leaving the remaining attempts unacked for redelivery"
            );
        }
    }
}

/// Pulls as many messages as there are free local slots and starts each at once: a
/// message buffered here would hold a cluster-wide slot that an idle instance could use.
async fn pull_loop(
    shared: Arc<Shared>,
    pool: Arc<str>,
    consumer: PullConsumer,
    permits: Arc<Semaphore>,
    attempts: TaskTracker,
    shutdown: CancellationToken,
) {
    let mut failures = 0u32;
    loop {
        let mut held = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => return,
            },
            _ = shutdown.cancelled() => return,
        };
        while held.num_permits() < MAX_PULL {
            match permits.clone().try_acquire_owned() {
                Ok(p) => held.merge(p),
                Err(_) => break,
            }
        }
        let request = consumer
            .batch()
            .max_messages(held.num_permits())
            .expires(PULL_EXPIRES)
            .messages();
        let mut batch = tokio::select! {
            batch = request => match batch {
                Ok(b) => { failures = 0; b }
                Err(e) => {
                    failures += 1;
                    warn!(pool = %pool, error = %e, "pull request failed; retrying");
                    drop(held);
                    let backoff = Duration::from_millis(100 * u64::from(failures.min(20)));
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => continue,
                        _ = shutdown.cancelled() => return,
                    }
                }
            },
            _ = shutdown.cancelled() => return,
        };
        loop {
            let next = tokio::select! {
                next = batch.next() => next,
                _ = shutdown.cancelled() => return,
            };
            match next {
                Some(Ok(message)) => {
                    let permit = held.split(1);
                    let shared = shared.clone();
                    let pool = pool.clone();
                    attempts.spawn(async move {
                        handle(&shared, &pool, message).await;
                        drop(permit);
                    });
                }
                Some(Err(e)) => {
                    debug!(pool = %pool, error = %e, "pull ended");
                    break;
                }
                None => break,
            }
        }
    }
}

fn header_str<'a>(headers: Option<&'a HeaderMap>, name: &str) -> Option<&'a str> {
    headers.and_then(|h| h.get(name)).map(|v| v.as_str())
}

fn now_rfc3339() -> String {
    OffsetDateTime::now_utc()
        .format(&Rfc3339)
        .unwrap_or_default()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// One conversation's state while its message is handled.
struct Conversation<'a> {
    pool: &'a str,
    /// A valid id: its reply is stored under `<prefix>.reply.<id>`.
    id: Option<String>,
    /// The id as given, for the reply body even when it is invalid.
    raw_id: String,
    reply_to: Option<String>,
    generation: u64,
    payload: &'a Bytes,
    started: Instant,
    attempts: Vec<AttemptRecord>,
    rule: &'a str,
}

impl Conversation<'_> {
    fn context<'m>(
        &'m self,
        metadata: Option<&'m serde_json::value::RawValue>,
    ) -> ReplyContext<'m> {
        ReplyContext {
            id: &self.raw_id,
            attempts: u32::try_from(self.attempts.len()).unwrap_or(u32::MAX),
            duration_ms: millis(self.started.elapsed()),
            metadata,
        }
    }
}

async fn handle(shared: &Shared, pool: &str, message: jetstream::Message) {
    let started = Instant::now();
    let headers = message.headers.as_ref();
    let generation = header_str(headers, header::GENERATION)
        .and_then(|g| g.parse().ok())
        .unwrap_or(0);
    let payload = message.payload.clone();
    let mut conversation = Conversation {
        pool,
        id: None,
        raw_id: String::new(),
        reply_to: None,
        generation,
        payload: &payload,
        started,
        attempts: Vec::new(),
        rule: "none",
    };
    let request = match parse_request(&payload, &shared.settings.subjects) {
        Ok(request) => request,
        Err(ParseError::Undecodable { reason }) => {
            let error = ErrorBody {
                code: ErrorCode::InvalidRequest,
                message: format!("payload is not a request envelope: {reason}"),
                status: None,
            };
            if publish_dead_letter(shared, &conversation, &error).await {
                info!(
                    pool,
                    code = "invalid_request",
                    "undecodable payload dead-lettered"
                );
                ack(&message, AckKind::Term).await;
            }
            return;
        }
        Err(ParseError::Invalid(invalid)) => {
            conversation.id = invalid.id;
            conversation.raw_id = invalid.raw_id.unwrap_or_default();
            conversation.reply_to = invalid.reply_to;
            let reply = error_reply(
                &conversation.context(invalid.metadata.as_deref()),
                invalid_request(invalid.field, &invalid.message),
            );
            finish(shared, &message, &conversation, reply).await;
            return;
        }
    };
    conversation.id = Some(request.id.clone());
    conversation.raw_id = request.id.clone();
    conversation.reply_to = request.reply_to.clone();
    let metadata = request.metadata.as_deref();
    let rule = match admit(&request, &shared.settings.rules) {
        Admission::Reject { error, rule } => {
            if let Some(rule) = rule {
                conversation.rule = &rule.name;
            }
            let reply = error_reply(&conversation.context(metadata), error);
            finish(shared, &message, &conversation, reply).await;
            return;
        }
        Admission::Attempt(rule) => rule,
    };
    conversation.rule = &rule.name;
    if let Err(error) = crate::security::check_request(&request, &shared.settings.outbound) {
        let reply = error_reply(&conversation.context(metadata), error);
        finish(shared, &message, &conversation, reply).await;
        return;
    }
    let timeout = request
        .timeout
        .map_or(rule.timeout, |t| t.min(rule.timeout));
    let outcome = attempt_with_progress(shared, &message, rule, &request, timeout).await;
    conversation.attempts.extend(outcome.1);
    let reply = match judge(outcome.0) {
        Verdict::Respond(response) => response_reply(
            &conversation.context(metadata),
            &response,
            shared.max_payload,
        ),
        Verdict::Fail(error) => error_reply(&conversation.context(metadata), error),
    };
    finish(shared, &message, &conversation, reply).await;
}

/// Runs one attempt, telling the server every third of `ack_wait` that the message is
/// still in progress, so it is never redelivered while its attempt runs.
async fn attempt_with_progress(
    shared: &Shared,
    message: &jetstream::Message,
    rule: &crate::rules::RequestRule,
    request: &Request,
    timeout: Duration,
) -> (AttemptOutcome, Option<AttemptRecord>) {
    let at = now_rfc3339();
    let started = Instant::now();
    let egress = Egress {
        worker: &shared.worker,
        rules: &shared.settings.rules,
        outbound: &shared.settings.outbound,
        secrets: &shared.secrets,
    };
    let attempt = egress.perform(rule, request, timeout);
    tokio::pin!(attempt);
    let period = shared.settings.config.service.ack_wait / 3;
    let mut progress = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
    let chain = loop {
        tokio::select! {
            chain = &mut attempt => break chain,
            _ = progress.tick() => {
                if let Err(e) = message.ack_with(AckKind::Progress).await {
                    debug!(error = %e, "progress ack failed");
                }
            }
        }
    };
    let outcome = chain.outcome;
    if !chain.connected {
        // Refused before any connection: no attempt was started.
        return (outcome, None);
    }
    let (status, failure) = match &outcome {
        AttemptOutcome::Response(r) => (Some(r.status), None),
        AttemptOutcome::TooLarge { status, .. } => (Some(*status), None),
        AttemptOutcome::HeadersTooLarge { status, .. } => (*status, None),
        AttemptOutcome::Failed(f) => (None, Some(format!("{}: {}", f.kind, f.message))),
        AttemptOutcome::Denied { message } => (None, Some(format!("denied: {message}"))),
    };
    let record = AttemptRecord {
        at,
        status,
        failure,
        duration_ms: millis(started.elapsed()),
    };
    (outcome, Some(record))
}

/// Publishes the final reply (stored, then the custom copy), the dead letter of an
/// error, and acks. If anything that must be stored cannot be, the message is left
/// unacked and the server redelivers it.
async fn finish(
    shared: &Shared,
    message: &jetstream::Message,
    conversation: &Conversation<'_>,
    reply: EncodedReply,
) {
    let outcome = if reply.error.is_some() {
        "error"
    } else {
        "response"
    };
    let generation = conversation.generation.to_string();
    let mut headers = HeaderMap::new();
    headers.insert(header::OUTCOME, outcome);
    headers.insert(header::GENERATION, generation.as_str());
    if let Some(id) = &conversation.id {
        let subject = shared.settings.subjects.reply(id);
        let msg_id = format!("{id}:{}:reply", conversation.generation);
        if !publish_stored(shared, &subject, Some(&msg_id), &headers, &reply.payload).await {
            return;
        }
    }
    if let Some(reply_to) = &conversation.reply_to
        && let Err(e) = shared
            .client
            .publish_with_headers(reply_to.clone(), headers.clone(), reply.payload.clone())
            .await
    {
        warn!(reply_to = %reply_to, error = %e, "could not publish the reply copy");
    }
    if let Some(error) = &reply.error
        && !publish_dead_letter(shared, conversation, error).await
    {
        return;
    }
    info!(
        id = %conversation.raw_id,
        pool = conversation.pool,
        rule = conversation.rule,
        outcome,
        code = reply.error.as_ref().map_or("none", |e| e.code.as_str()),
        attempts = conversation.attempts.len(),
        duration_ms = millis(conversation.started.elapsed()),
        "conversation finished"
    );
    ack(message, AckKind::Ack).await;
}

async fn publish_dead_letter(
    shared: &Shared,
    conversation: &Conversation<'_>,
    error: &ErrorBody,
) -> bool {
    // The caller's envelope never holds an injected secret unless the caller already
    // knew it, but the dead letter is webproxy's own copy: nothing secret goes in.
    let redactor = shared.secrets.redactor();
    let code = error.code;
    let mut error = error.clone();
    error.message = redactor.redact(&error.message).into_owned();
    let mut attempts = conversation.attempts.clone();
    for attempt in &mut attempts {
        if let Some(failure) = &mut attempt.failure {
            *failure = redactor.redact(failure).into_owned();
        }
    }
    let payload = dead_letter(
        conversation.pool,
        conversation.id.as_deref(),
        conversation.generation,
        error,
        &redactor.redact_payload(conversation.payload),
        attempts,
        shared.max_payload,
    );
    let mut headers = HeaderMap::new();
    headers.insert(header::ERROR_CODE, code.as_str());
    headers.insert(
        header::GENERATION,
        conversation.generation.to_string().as_str(),
    );
    if let Some(id) = &conversation.id {
        headers.insert(header::ID, id.as_str());
    }
    let subject = shared.settings.subjects.dead(conversation.pool);
    // Dead letters are an audit trail: no message id, so a redelivered conversation
    // that fails again is recorded again rather than taken for a duplicate.
    publish_stored(shared, &subject, None, &headers, &payload).await
}

/// Publishes into a stream and waits for the server to confirm it stored the message,
/// retrying with backoff; false when it never confirmed.
async fn publish_stored(
    shared: &Shared,
    subject: &str,
    msg_id: Option<&str>,
    headers: &HeaderMap,
    payload: &Bytes,
) -> bool {
    let mut delay = Duration::from_millis(50);
    for attempt in 1..=PUBLISH_TRIES {
        let mut publish = PublishMessage::build()
            .payload(payload.clone())
            .headers(headers.clone());
        if let Some(msg_id) = msg_id {
            publish = publish.message_id(msg_id);
        }
        let result: Result<(), async_nats::Error> = async {
            shared
                .js
                .send_publish(subject.to_string(), publish)
                .await?
                .await?;
            Ok(())
        }
        .await;
        match result {
            Ok(()) => return true,
            Err(e) if attempt == PUBLISH_TRIES => {
                warn!(subject, error = %e, "could not store the message; leaving the request for redelivery");
            }
            Err(e) => debug!(subject, error = %e, "publish failed; retrying"),
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(2));
    }
    false
}

async fn ack(message: &jetstream::Message, kind: AckKind) {
    if let Err(e) = message.ack_with(kind).await {
        warn!(error = %e, "ack failed; the server will redeliver the message");
    }
}
