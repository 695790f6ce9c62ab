//! Replaying a dead letter: its conversation starts a new generation from the letter's
//! origin. The generation's progress record is created with compare-and-set before the
//! hop is published, so two concurrent replays of one letter publish once.

use async_nats::HeaderMap;
use bytes::Bytes;
use thiserror::Error;
use webproxy_protocol::{DeadLetter, Origin, header};

use super::progress::{ProgressError, Record};
use super::publish::{Outlet, PublishFailure, Stored, publish_stored};
use crate::hop::{AttemptHistory, HopKind, HopState, hop_msg_id, new_token, unix_ms};

/// Why a letter was not replayed.
#[derive(Debug, Error)]
pub enum ReplayError {
    #[error("the dead letter has no origin (it was stored by an older webproxy)")]
    NoOrigin,
    #[error("the dead letter's origin is malformed: {0}")]
    BadOrigin(String),
    #[error("the dead letter does not hold the whole request")]
    Truncated,
    #[error("generation {generation} of this conversation was replayed already")]
    AlreadyReplayed { generation: u64 },
    #[error(transparent)]
    Progress(#[from] ProgressError),
    #[error(transparent)]
    Publish(#[from] PublishFailure),
}

/// Publishes the letter's request as the first hop of the next generation of its
/// conversation, into the letter's pool; returns that generation.
impl Outlet {
    pub async fn replay(&self, letter: &DeadLetter) -> Result<u64, ReplayError> {
        let origin: Origin = letter
            .origin
            .as_deref()
            .ok_or(ReplayError::NoOrigin)?
            .parse()
            .map_err(|e: webproxy_protocol::InvalidName| ReplayError::BadOrigin(e.0))?;
        let envelope = letter.whole_request().ok_or(ReplayError::Truncated)?;
        let generation = letter.generation + 1;
        let token = new_token();
        let record = Record {
            kind: HopKind::Replay,
            subject: self.subjects.hop(&letter.pool, &token),
            msg_id: hop_msg_id(HopKind::Replay, &token),
            hop: HopState {
                origin,
                generation,
                step: 1,
                first_published_ms: unix_ms(crate::clock::now()),
                due_ms: None,
                attempts: AttemptHistory::default(),
            },
            taken_by: None,
        };
        let record = match self.progress.write(&record, None).await {
            Ok(_) => record,
            Err(ProgressError::Conflict { .. }) => {
                // A replay that recorded its hop but did not get to publish it (or is
                // publishing it now) is finished here, under the same message id.
                match self.progress.load(&record.hop.origin, generation).await? {
                    Some((recorded, _))
                        if recorded.kind == HopKind::Replay && recorded.taken_by.is_none() =>
                    {
                        recorded
                    }
                    _ => return Err(ReplayError::AlreadyReplayed { generation }),
                }
            }
            Err(e) => return Err(e.into()),
        };
        let mut headers = HeaderMap::new();
        headers.insert(header::HOP, record.hop.format().as_str());
        let payload = Bytes::from(envelope.get().to_string());
        let stored = Stored {
            subject: &record.subject,
            msg_id: &record.msg_id,
            headers: &headers,
            payload: &payload,
        };
        publish_stored(self, stored).await?;
        Ok(generation)
    }
}
