//! The delivery a handler works on, behind a small trait: its subject, headers,
//! payload, JetStream metadata, and its acks. A JetStream message is one; the tests use
//! a fake that records the acks, so the handler's paths run in-process.

use std::future::Future;
use std::time::SystemTime;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;

/// What JetStream says about one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeliveryInfo {
    /// The stream that stores the message, and its sequence there.
    pub(crate) stream: String,
    pub(crate) seq: u64,
    /// How often the server has delivered it, this time included.
    pub(crate) delivered: u64,
    /// When the server stored it.
    pub(crate) published: SystemTime,
}

/// One delivered message and its acks.
pub(crate) trait Delivery: Send + Sync {
    fn subject(&self) -> &str;
    fn headers(&self) -> Option<&HeaderMap>;
    fn payload(&self) -> &Bytes;
    /// The JetStream metadata; an error names what is missing.
    fn info(&self) -> Result<DeliveryInfo, String>;
    /// Sends an ack of `kind` (ack, progress, term): fire-and-forget, like JetStream's.
    fn ack(&self, kind: AckKind) -> impl Future<Output = Result<(), async_nats::Error>> + Send;
    /// Sends a progress ack as a request and waits for the server's answer. The answer
    /// proves only that the connection was alive: see `liveness`.
    fn progress_confirmed(&self) -> impl Future<Output = Result<(), ProgressAckError>> + Send;
}

/// Why a progress ack was not confirmed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ProgressAckError {
    /// "No responders": the consumer has no leader. The next one restores the message's
    /// pending time from what its group committed, which can be older than every
    /// progress ack this instance saw answered (a leader that lost its quorum answers
    /// them for seconds before it steps down), and so may redeliver the message at once.
    #[error("no consumer leader answered the progress ack")]
    NoLeader,
    #[error("{0}")]
    Failed(String),
}

impl Delivery for jetstream::Message {
    fn subject(&self) -> &str {
        self.message.subject.as_str()
    }

    fn headers(&self) -> Option<&HeaderMap> {
        self.message.headers.as_ref()
    }

    fn payload(&self) -> &Bytes {
        &self.message.payload
    }

    fn info(&self) -> Result<DeliveryInfo, String> {
        let info = jetstream::Message::info(self).map_err(|e| e.to_string())?;
        Ok(DeliveryInfo {
            stream: info.stream.to_string(),
            seq: info.stream_sequence,
            delivered: u64::try_from(info.delivered).unwrap_or(0),
            published: SystemTime::from(info.published),
        })
    }

    fn ack(&self, kind: AckKind) -> impl Future<Output = Result<(), async_nats::Error>> + Send {
        self.ack_with(kind)
    }

    /// A request of its own rather than async-nats' `double_ack_with`, which takes any
    /// answer for a confirmation, the "no responders" status included.
    async fn progress_confirmed(&self) -> Result<(), ProgressAckError> {
        let Some(reply) = self.message.reply.clone() else {
            return Err(ProgressAckError::Failed(
                "no reply subject: not a JetStream delivery".into(),
            ));
        };
        match self
            .context
            .client()
            .request(reply, AckKind::Progress.into())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                Err(ProgressAckError::NoLeader)
            }
            Err(e) => Err(ProgressAckError::Failed(e.to_string())),
        }
    }
}

#[cfg(test)]
pub(crate) mod fake {
    //! A delivery that records its acks.

    use std::sync::Mutex;

    use super::*;

    #[derive(Debug)]
    pub(crate) struct FakeDelivery {
        pub(crate) subject: String,
        pub(crate) headers: Option<HeaderMap>,
        pub(crate) payload: Bytes,
        pub(crate) info: DeliveryInfo,
        pub(crate) acks: Mutex<Vec<AckKind>>,
        /// What each progress ack is answered with; confirmed when `None`.
        pub(crate) progress_error: Option<ProgressAckError>,
    }

    impl FakeDelivery {
        pub(crate) fn new(subject: &str, payload: &str, info: DeliveryInfo) -> FakeDelivery {
            FakeDelivery {
                subject: subject.to_string(),
                headers: None,
                payload: Bytes::from(payload.to_string()),
                info,
                acks: Mutex::new(Vec::new()),
                progress_error: None,
            }
        }

        /// The acks sent (`Ack`, `Term`, ...: `AckKind` has no equality), progress
        /// acks left out.
        pub(crate) fn final_acks(&self) -> Vec<String> {
            self.acks
                .lock()
                .map(|acks| {
                    acks.iter()
                        .filter(|k| !matches!(k, AckKind::Progress))
                        .map(|k| format!("{k:?}"))
                        .collect()
                })
                .unwrap_or_default()
        }
    }

    impl Delivery for FakeDelivery {
        fn subject(&self) -> &str {
            &self.subject
        }

        fn headers(&self) -> Option<&HeaderMap> {
            self.headers.as_ref()
        }

        fn payload(&self) -> &Bytes {
            &self.payload
        }

        fn info(&self) -> Result<DeliveryInfo, String> {
            Ok(self.info.clone())
        }

        fn ack(&self, kind: AckKind) -> impl Future<Output = Result<(), async_nats::Error>> + Send {
            if let Ok(mut acks) = self.acks.lock() {
                acks.push(kind);
            }
            std::future::ready(Ok(()))
        }

        fn progress_confirmed(&self) -> impl Future<Output = Result<(), ProgressAckError>> + Send {
            if let Ok(mut acks) = self.acks.lock() {
                acks.push(AckKind::Progress);
            }
            std::future::ready(self.progress_error.clone().map_or(Ok(()), Err))
        }
    }
}
