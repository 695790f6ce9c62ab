//! A pool's consumers: the work consumer's configuration and the writes that bring it
//! in line, the retry consumer, and recreating a consumer that is gone.

use super::*;

/// The most parked retries a pool holds at once; a parked retry waiting out its delay
/// holds one of these, never a slot of the pool's concurrency limit.
pub(crate) const MAX_PARKED: i64 = 100_000;

/// The durable pull consumer of one pool's retry subject.
pub fn retry_consumer_config(settings: &Settings, pool: &str) -> consumer::pull::Config {
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
pub struct PoolConsumers {
    pub pool: String,
    /// The request subject: `max_ack_pending` is the concurrency limit.
    pub work: consumer::PullConsumer,
    /// The retry subject: parked retries waiting to be due.
    pub parked: consumer::PullConsumer,
}

/// Deletes a consumer; one that is gone already is fine.
pub async fn delete_consumer(stream: &stream::Stream, name: &str) -> Result<(), ProvisionError> {
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

/// The consumer `name` on `stream`, or `None` when the API answers that it does not
/// exist (10014); any other failure (a timeout, no responders) is an error.
pub async fn existing_consumer(
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
