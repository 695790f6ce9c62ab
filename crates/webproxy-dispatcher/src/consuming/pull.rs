//! Pull requests with idle heartbeats, one after another on one inbox, watched: a pull
//! lost in an outage or a stream-leader change is noticed within a few heartbeats
//! instead of at its expiry.
//! async-nats' own batch hides the heartbeats and only gives up five seconds after
//! `expires`, so the pull loop sends the request and reads the replies itself.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer};
use async_nats::{StatusCode, Subscriber};
use futures::StreamExt as _;
use tokio::time::Instant;

/// How long one pull request waits at the server.
pub(crate) const PULL_EXPIRES: Duration = Duration::from_secs(5);
/// How often the server sends an idle heartbeat on a waiting pull.
pub(crate) const HEARTBEAT: Duration = Duration::from_secs(1);
/// Heartbeats missed before a pull counts as lost.
const MISSED_HEARTBEATS: u32 = 2;

/// Why a pull ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PullEnd {
    /// It expired, or delivered everything it asked for: pull again.
    Done,
    /// No heartbeat or message for a few heartbeats, or the connection changed: the
    /// request was lost.
    Lost,
    /// The consumer's leader answered "Leadership Change": another node leads it now.
    LeaderLost(String),
    /// The consumer is gone (deleted, or never answering): recreate it.
    ConsumerGone(String),
    /// Anything else the server said, or the connection failed.
    Failed(String),
}

/// What a status reply on a pull means; `None` for an idle heartbeat (pure).
pub(crate) fn status_end(status: StatusCode, description: Option<&str>) -> Option<PullEnd> {
    let description = description.unwrap_or_default();
    match status {
        StatusCode::IDLE_HEARTBEAT => None,
        StatusCode::TIMEOUT | StatusCode::NOT_FOUND => Some(PullEnd::Done),
        StatusCode::NO_RESPONDERS => Some(PullEnd::ConsumerGone(
            "no responders: the consumer is gone, has no leader, or JetStream is down".into(),
        )),
        StatusCode::REQUEST_TERMINATED
            if description
                .to_ascii_lowercase()
                .contains("consumer deleted") =>
        {
            Some(PullEnd::ConsumerGone(description.to_string()))
        }
        StatusCode::REQUEST_TERMINATED
            if description
                .to_ascii_lowercase()
                .contains("leadership change") =>
        {
            Some(PullEnd::LeaderLost(description.to_string()))
        }
        // Limits end the request; pulling again is right.
        StatusCode::REQUEST_TERMINATED => Some(PullEnd::Done),
        status => Some(PullEnd::Failed(format!("status {status}: {description}"))),
    }
}

/// One pull request in flight.
pub(crate) struct Pull {
    subscriber: Subscriber,
    /// Where the server sends this pull's messages, and a nudge's.
    inbox: String,
    context: jetstream::Context,
    remaining: usize,
    /// The pull ends for good at this instant, heartbeats or not.
    deadline: Instant,
}

impl Pull {
    /// Asks `consumer` for up to `batch` messages.
    pub(crate) async fn start(
        consumer: &PullConsumer,
        js: &jetstream::Context,
        batch: usize,
    ) -> Result<Pull, PullEnd> {
        let client = js.client();
        let inbox = client.new_inbox();
        let subscriber = client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| PullEnd::Failed(e.to_string()))?;
        let mut pull = Pull {
            subscriber,
            inbox,
            context: js.clone(),
            remaining: 0,
            deadline: Instant::now(),
        };
        pull.request(consumer, batch).await?;
        Ok(pull)
    }

    /// Asks for `batch` more messages on the same inbox, until a fresh expiry.
    pub(crate) async fn request(
        &mut self,
        consumer: &PullConsumer,
        batch: usize,
    ) -> Result<(), PullEnd> {
        let request = jetstream::consumer::pull::BatchConfig {
            batch,
            expires: Some(PULL_EXPIRES),
            idle_heartbeat: HEARTBEAT,
            ..Default::default()
        };
        consumer
            .request_batch(request, self.inbox.clone().into())
            .await
            .map_err(|e| PullEnd::Failed(e.to_string()))?;
        self.remaining += batch;
        self.deadline = Instant::now() + PULL_EXPIRES + HEARTBEAT * MISSED_HEARTBEATS;
        Ok(())
    }

    /// Wakes the server for this pull: after a consumer's pause is lifted by hand, it
    /// serves the requests that waited through it only at its next heartbeat, but a
    /// new request at once, and then the waiting ones too. One message more at most.
    pub(crate) async fn nudge(&mut self, consumer: &PullConsumer) -> Result<(), PullEnd> {
        self.request(consumer, 1).await
    }

    /// The next message, or why the pull ended.
    pub(crate) async fn next(&mut self) -> Result<jetstream::Message, PullEnd> {
        loop {
            if self.remaining == 0 {
                return Err(PullEnd::Done);
            }
            let watchdog = (Instant::now() + HEARTBEAT * MISSED_HEARTBEATS).min(self.deadline);
            let message = match tokio::time::timeout_at(watchdog, self.subscriber.next()).await {
                // Past the deadline the server has expired the request itself.
                Err(_) if Instant::now() >= self.deadline => {
                    self.remaining = 0;
                    return Err(PullEnd::Done);
                }
                // Not `LeaderLost`: a starved or reconnecting instance misses
                // heartbeats too, and its held deliveries would all be given up.
                Err(_) => return Err(PullEnd::Lost),
                Ok(None) => return Err(PullEnd::Failed("the subscription ended".into())),
                Ok(Some(message)) => message,
            };
            match message.status {
                None | Some(StatusCode::OK) => {
                    self.remaining -= 1;
                    return Ok(jetstream::Message {
                        message,
                        context: self.context.clone(),
                    });
                }
                Some(status) => {
                    if let Some(end) = status_end(status, message.description.as_deref()) {
                        // The request is over, whatever it had left to deliver; the
                        // next one on this inbox counts afresh.
                        self.remaining = 0;
                        return Err(end);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses() {
        assert_eq!(status_end(StatusCode::IDLE_HEARTBEAT, None), None);
        assert_eq!(
            status_end(StatusCode::TIMEOUT, Some("Request Timeout")),
            Some(PullEnd::Done)
        );
        assert_eq!(
            status_end(StatusCode::NOT_FOUND, Some("No Messages")),
            Some(PullEnd::Done)
        );
        assert!(matches!(
            status_end(StatusCode::REQUEST_TERMINATED, Some("Consumer Deleted")),
            Some(PullEnd::ConsumerGone(_))
        ));
        assert!(matches!(
            status_end(StatusCode::NO_RESPONDERS, None),
            Some(PullEnd::ConsumerGone(_))
        ));
        assert!(matches!(
            status_end(StatusCode::REQUEST_TERMINATED, Some("Leadership Change")),
            Some(PullEnd::LeaderLost(_))
        ));
        assert_eq!(
            status_end(StatusCode::REQUEST_TERMINATED, Some("Exceeded MaxWaiting")),
            Some(PullEnd::Done)
        );
        assert!(matches!(
            status_end(
                StatusCode::from_u16(400).expect("status"),
                Some("Bad Request")
            ),
            Some(PullEnd::Failed(_))
        ));
    }
}
