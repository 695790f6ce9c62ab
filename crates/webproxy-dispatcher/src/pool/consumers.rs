//! A pool's consumers as pool control makes them: the work consumer's configuration
//! (its configured limits with the pool's runtime state on top) and the writes that
//! bring it in line, provisioning one pool, and recreating its work consumer when it
//! is gone. The streams, fences and layouts under them are `webproxy_jetstream::provision`'s.

use std::collections::HashMap;

use async_nats::jetstream::{self, consumer, stream};
use time::OffsetDateTime;
use webproxy_config::settings::{PoolConfig, Settings};

use super::state::PoolState;
use super::stored::read_pool_state;
use webproxy_jetstream::provision::{
    Examined, LAYOUT, LayoutRefusal, PoolConsumers, ProvisionError, StreamPlan, examine,
    existing_consumer, existing_stream, layout, pool_fence_config, pool_stream_config,
    provision_endings, provision_error, provision_stream, refused, retry_consumer_config,
    with_layout,
};

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

/// Provisions one pool: its replies and dead-letter streams, its stream (migrated
/// from an older layout if need be), its fence and its two consumers. A work consumer
/// that exists is bound as it is: its settings are written only by their owner
/// (`super::owner`), under a lease, from the configured limits and the pool's runtime
/// state; one that does not is created from them.
pub(crate) async fn provision_pool(
    js: &jetstream::Context,
    settings: &Settings,
    pool: &str,
    pool_config: &PoolConfig,
) -> Result<PoolConsumers, ProvisionError> {
    let subjects = &settings.subjects;
    // Where the pool's conversations end go first, so that none ends before its
    // reply or letter can be stored (a pool added live has none yet).
    provision_endings(js, settings, pool).await?;
    let stream_config = pool_stream_config(settings, pool, pool_config);
    let stream_name = stream_config.name.clone();
    provision_stream(
        js,
        StreamPlan {
            config: stream_config,
            fresh_first_sequence: true,
            old_consumers: vec![
                subjects.layout1_pool_consumer(pool),
                subjects.layout1_retry_consumer(pool),
                subjects.layout2_pool_consumer(pool),
                subjects.layout2_retry_consumer(pool),
            ],
            fence: Some(pool_fence_config(settings, pool)),
        },
    )
    .await?;
    let name = subjects.pool_consumer(pool);
    let what = format!("consumer {name} on {stream_name}");
    let stream = js
        .get_stream_no_info(&stream_name)
        .await
        .map_err(|e| provision_error(what.clone(), e))?;
    let state = read_pool_state(js, settings, pool).await;
    let work: consumer::PullConsumer = stream
        .get_or_create_consumer(
            &name,
            pool_consumer_config(settings, pool, pool_config, &state),
        )
        .await
        .map_err(|e| provision_error(what, e))?;
    let retry = retry_consumer_config(settings, pool);
    let what = format!(
        "consumer {} on {stream_name}",
        retry.durable_name.as_deref().unwrap_or_default()
    );
    let parked: consumer::PullConsumer = stream
        .create_consumer(retry)
        .await
        .map_err(|e| provision_error(what, e))?;
    Ok(PoolConsumers {
        pool: pool.to_string(),
        work,
        parked,
    })
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use webproxy_config::testing::settings_from;

    fn at(seconds: i64) -> time::OffsetDateTime {
        time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(seconds)
    }

    /// The consumer as the server reports it after `wanted` was written.
    fn as_written(wanted: &consumer::pull::Config) -> consumer::Config {
        consumer::Config {
            durable_name: wanted.durable_name.clone(),
            description: wanted.description.clone(),
            filter_subjects: wanted.filter_subjects.clone(),
            ack_policy: wanted.ack_policy,
            ack_wait: wanted.ack_wait,
            max_ack_pending: wanted.max_ack_pending,
            max_deliver: wanted.max_deliver,
            // The server adds keys of its own.
            metadata: wanted
                .metadata
                .clone()
                .into_iter()
                .chain([("_nats.level".to_string(), "1".to_string())])
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn only_a_change_is_written() {
        let settings = settings_from("[pools.p]\nmax_in_flight = 4\n").expect("settings");
        let config = &settings.cluster.pools["p"];
        let state = PoolState::default();
        let wanted = pool_consumer_config(&settings, "p", config, &state);
        let current = as_written(&wanted);
        assert_eq!(consumer_writes(&current, &wanted, None), vec![]);

        let raised = settings_from("[pools.p]\nmax_in_flight = 9\n").expect("raised");
        let wanted_raised = pool_consumer_config(&raised, "p", &raised.cluster.pools["p"], &state);
        assert_eq!(
            consumer_writes(&current, &wanted_raised, None),
            vec![ConsumerWrite::Update]
        );

        // An adaptive limit is part of what is wanted: a push cannot undo it.
        let adaptive =
            settings_from("[pools.p]\nmax_in_flight = 9\nadaptive = true\n").expect("adaptive");
        let lowered = PoolState {
            adaptive_limit: Some(2),
            ..Default::default()
        };
        let wanted_lowered =
            pool_consumer_config(&adaptive, "p", &adaptive.cluster.pools["p"], &lowered);
        assert_eq!(wanted_lowered.max_ack_pending, 2);
        assert_eq!(
            consumer_writes(&as_written(&wanted_lowered), &wanted_lowered, None),
            vec![]
        );
        // Without `adaptive`, a stored limit does not apply.
        let ignored = pool_consumer_config(&raised, "p", &raised.cluster.pools["p"], &lowered);
        assert_eq!(ignored.max_ack_pending, 9);
        // An open breaker's probe limit wins over both.
        let mut open = lowered.clone();
        open.open_breaker(OffsetDateTime::now_utc(), Duration::from_secs(30), "test");
        let probing = pool_consumer_config(&adaptive, "p", &adaptive.cluster.pools["p"], &open);
        assert_eq!(probing.max_ack_pending, 1);
    }

    #[test]
    fn a_pause_is_written_when_missing_or_moved_and_never_lifted_here() {
        let settings = settings_from("[pools.p]\nmax_in_flight = 4\n").expect("settings");
        let wanted = pool_consumer_config(
            &settings,
            "p",
            &settings.cluster.pools["p"],
            &PoolState::default(),
        );
        let mut current = as_written(&wanted);
        assert_eq!(
            consumer_writes(&current, &wanted, Some(at(500))),
            vec![ConsumerWrite::Pause(at(500))]
        );
        current.pause_until = Some(at(500) + time::Duration::milliseconds(300));
        assert_eq!(consumer_writes(&current, &wanted, Some(at(500))), vec![]);
        assert_eq!(
            consumer_writes(&current, &wanted, Some(at(900))),
            vec![ConsumerWrite::Pause(at(900))]
        );
        // A pause the state does not hold (made by hand through the JetStream API) is
        // left as it is.
        assert_eq!(consumer_writes(&current, &wanted, None), vec![]);
    }
}
