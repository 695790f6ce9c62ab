//! A pool's consumers: the work consumer's configuration and the writes that bring it
//! in line, the retry consumer, and recreating a consumer that is gone.

use super::*;

/// The durable pull consumer of one pool's request subject: the configured limits with
/// the pool's runtime `state` on top. Every write of its settings (creation, and the
/// owner's updates) is computed here, so none can undo that state.
pub(crate) fn pool_consumer_config(
    settings: &Settings,
    pool: &str,
    config: &PoolConfig,
    state: &PoolState,
) -> consumer::pull::Config {
    let subjects = &settings.subjects;
    consumer::pull::Config {
        durable_name: Some(subjects.pool_consumer(pool)),
        description: Some(format!("webproxy pool {pool}: the concurrency limit")),
        filter_subjects: vec![
            subjects.request(pool),
            subjects.caller_requests(pool),
            subjects.hop_filter(pool),
        ],
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: settings.cluster.ack_wait,
        max_ack_pending: i64::try_from(state.max_ack_pending(config)).unwrap_or(i64::MAX),
        // Unlimited: poison messages are counted and ended by the dispatcher itself.
        max_deliver: -1,
        metadata: with_layout(&HashMap::new()),
        ..Default::default()
    }
}

/// A write that brings a pool's work consumer in line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ConsumerWrite {
    /// Its settings differ from the wanted ones: an update, which leaves out
    /// `pause_until`, so a pause made through the JetStream API stays.
    Update,
    /// The state holds a pause in force that the consumer lacks, or that ends at
    /// another time: through the pause API.
    Pause(OffsetDateTime),
}

/// How a log line names the write: `update`, or `pause until <RFC 3339>`.
impl std::fmt::Display for ConsumerWrite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConsumerWrite::Update => f.write_str("update"),
            ConsumerWrite::Pause(until) => {
                let until = until
                    .format(&time::format_description::well_known::Rfc3339)
                    .map_err(|_| std::fmt::Error)?;
                write!(f, "pause until {until}")
            }
        }
    }
}

impl ConsumerWrite {
    /// Its label in `webproxy_pool_consumer_writes_total`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            ConsumerWrite::Update => "update",
            ConsumerWrite::Pause(_) => "pause",
        }
    }
}

/// How far apart two ends of a pause may be and count as the same: the server keeps
/// what it is sent, but RFC 3339 round trips may drop sub-second digits.
pub(super) const PAUSE_TOLERANCE: time::Duration = time::Duration::seconds(1);

/// What to write so that the consumer whose server-side settings are `current` has
/// the `wanted` ones and the state's pause in force, `paused_until`; nothing when it
/// has them already, so the server sees an update only for a change.
pub(crate) fn consumer_writes(
    current: &consumer::Config,
    wanted: &consumer::pull::Config,
    paused_until: Option<OffsetDateTime>,
) -> Vec<ConsumerWrite> {
    let mut writes = Vec::new();
    let differs = current.max_ack_pending != wanted.max_ack_pending
        || current.ack_wait != wanted.ack_wait
        || current.max_deliver != wanted.max_deliver
        || current.filter_subjects != wanted.filter_subjects
        || current.description != wanted.description
        || layout(&current.metadata) != layout(&wanted.metadata);
    if differs {
        writes.push(ConsumerWrite::Update);
    }
    if let Some(until) = paused_until {
        let paused_then = current
            .pause_until
            .is_some_and(|current| (current - until).abs() < PAUSE_TOLERANCE);
        if !paused_then {
            writes.push(ConsumerWrite::Pause(until));
        }
    }
    writes
}

/// The most parked retries a pool holds at once; a parked retry waiting out its delay
/// holds one of these, never a slot of the pool's concurrency limit.
pub(crate) const MAX_PARKED: i64 = 100_000;

/// The durable pull consumer of one pool's retry subject.
pub(crate) fn retry_consumer_config(settings: &Settings, pool: &str) -> consumer::pull::Config {
    let subjects = &settings.subjects;
    consumer::pull::Config {
        durable_name: Some(subjects.retry_consumer(pool)),
        description: Some(format!("webproxy pool {pool}: parked retries")),
        filter_subject: subjects.retry_filter(pool),
        ack_policy: consumer::AckPolicy::Explicit,
        // Handling a parked retry is a NAK or a republish: quick, so a short wait is
        // enough and a crashed instance's retries come back soon.
        ack_wait: Duration::from_secs(30),
        max_ack_pending: MAX_PARKED,
        max_deliver: -1,
        metadata: with_layout(&HashMap::new()),
        ..Default::default()
    }
}

/// A pool's two consumers.
pub(crate) struct PoolConsumers {
    pub(crate) pool: String,
    /// The request subject: `max_ack_pending` is the concurrency limit.
    pub(crate) work: consumer::PullConsumer,
    /// The retry subject: parked retries waiting to be due.
    pub(crate) parked: consumer::PullConsumer,
}

/// Deletes a consumer; one that is gone already is fine.
pub(super) async fn delete_consumer(
    stream: &stream::Stream,
    name: &str,
) -> Result<(), ProvisionError> {
    match stream.delete_consumer(name).await {
        Ok(_) => {
            info!(consumer = name, "deleted a consumer of the older layout");
            Ok(())
        }
        Err(e) if consumer_missing(&e) => Ok(()),
        Err(e) => Err(provision_error(format!("consumer {name}"), e)),
    }
}

/// The consumer asked for does not exist.
pub(crate) fn consumer_missing(e: &stream::ConsumerError) -> bool {
    matches!(
        e.kind(),
        stream::ConsumerErrorKind::JetStream(ref js)
            if js.error_code() == jetstream::ErrorCode::CONSUMER_NOT_FOUND
    )
}

/// What [`recreate_pool_consumer`] found.
pub(crate) enum Recreated {
    /// The consumer was there after all (it did not answer a pull, but the API found
    /// it): nothing was written.
    Found(consumer::PullConsumer),
    /// It was confirmed gone (10014) and made anew.
    Made(consumer::PullConsumer),
}

/// Recreates `pool`'s work consumer, exactly as provisioning makes it, and nothing
/// else: the pull loop calls it when a pull finds no consumer to answer it. It does so
/// only while the pool's stream exists, is not marked for removal and has this
/// instance's layout; otherwise the error (a [`LayoutRefusal`]) says why not.
///
/// A pull answered "no responders" says as little as a KV call does: the consumer is
/// gone, or it has no leader, or the JetStream API is down. So it is made only after
/// `CONSUMER.INFO` answers 10014, and made strictly (action create): a write of this
/// instance's settings over a consumer that exists would undo what the pools' owner
/// wrote there (a newer revision's limits, a lowered `ack_wait` no instance paces
/// from yet).
pub(crate) async fn recreate_pool_consumer(
    js: &jetstream::Context,
    settings: &Settings,
    pool: &str,
) -> Result<Recreated, ProvisionError> {
    let stream_name = settings.subjects.pool_stream(pool);
    let name = settings.subjects.pool_consumer(pool);
    let what = format!("consumer {name} on {stream_name}");
    let Some(pool_config) = settings.cluster.pools.get(pool) else {
        return Err(provision_error(
            what,
            format!("pool {pool} is not in this instance's config"),
        ));
    };
    let Some((stream, info)) = existing_stream(js, &stream_name).await? else {
        return Err(refused(what, LayoutRefusal::Missing));
    };
    match examine(&info.config.metadata) {
        Examined::Current => {}
        Examined::Migrate { from } => {
            return Err(refused(
                what,
                LayoutRefusal::OlderLayout {
                    found: from,
                    own: LAYOUT,
                },
            ));
        }
        Examined::Refuse(refusal) => return Err(refused(what, refusal)),
    }
    if let Some(found) = existing_consumer(&stream, &name)
        .await
        .map_err(|e| provision_error(what.clone(), e))?
    {
        return Ok(Recreated::Found(found));
    }
    let state = read_pool_state(js, settings, pool).await;
    match stream
        .create_consumer_strict(pool_consumer_config(settings, pool, pool_config, &state))
        .await
    {
        Ok(made) => Ok(Recreated::Made(made)),
        // Another instance made it first.
        Err(e) if e.kind() == stream::ConsumerCreateStrictErrorKind::AlreadyExists => stream
            .get_consumer(&name)
            .await
            .map(Recreated::Found)
            .map_err(|e| provision_error(what, e)),
        Err(e) => Err(provision_error(what, e)),
    }
}

/// The consumer `name` on `stream`, or `None` when the API answers that it does not
/// exist (10014); any other failure (a timeout, no responders) is an error.
pub(super) async fn existing_consumer(
    stream: &stream::Stream,
    name: &str,
) -> Result<Option<consumer::PullConsumer>, async_nats::Error> {
    match stream.get_consumer(name).await {
        Ok(found) => Ok(Some(found)),
        Err(e)
            if e.downcast_ref::<jetstream::context::ConsumerInfoError>()
                .is_some_and(|e| {
                    e.kind() == jetstream::context::ConsumerInfoErrorKind::NotFound
                }) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}
