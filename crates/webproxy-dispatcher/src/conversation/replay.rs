//! Replaying a dead letter: its conversation starts a new generation from the letter's
//! origin, once. Before the hop is published, the generation's replay marker is created
//! (it outlives the settle, so a later replay of the same letter is refused), then its
//! progress record, both with compare-and-set, so two concurrent replays of one letter
//! publish once.

use async_nats::HeaderMap;
use bytes::Bytes;
use thiserror::Error;
use webproxy_protocol::{DeadLetter, Origin, header};

use super::progress::{ProgressError, Record};
use super::publish::{Outlet, PublishFailure, Stored, publish_stored};
use crate::conversation::hop::{AttemptHistory, HopKind, HopState, hop_msg_id, new_token, unix_ms};

/// Which generation a replay starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Replay {
    /// The one after the letter's, once: a generation replayed already is refused.
    Once,
    /// The next one after the newest replayed, on purpose (`dead replay --again`).
    Again,
}

/// Why a letter was not replayed.
#[derive(Debug, Error)]
pub enum ReplayError {
    #[error("the dead letter has no origin (it was stored by an older webproxy)")]
    NoOrigin,
    #[error("the dead letter's origin is malformed: {0}")]
    BadOrigin(String),
    #[error("the dead letter does not hold the whole request")]
    Truncated,
    #[error("already replayed as generation {generation} (--again replays it anew)")]
    AlreadyReplayed { generation: u64 },
    #[error(transparent)]
    Progress(#[from] ProgressError),
    #[error(transparent)]
    Publish(#[from] PublishFailure),
}

/// What a replay does when the generation it wanted was taken: its marker or its
/// progress record exists already.
// A value decided and matched once per replay, never stored or moved around: boxing
// the record would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, PartialEq, Eq)]
enum Taken {
    /// Publish this recorded hop, under its own message id: a replay recorded it but
    /// did not get to publish it (or is publishing it now, and the stream keeps one).
    Finish(Record),
    /// Refuse: that generation was replayed.
    Refuse,
    /// Try the generation after it (`Replay::Again`).
    Next,
}

/// Decides what a replay in `mode` does with a taken generation, given the
/// generation's progress record (pure). A record that is not an untaken replay hop, or
/// none (the generation settled and its record was deleted, or a replay stopped
/// between its marker and its record), is a replay that ran: never run it again
/// unless asked.
fn when_taken(mode: Replay, recorded: Option<Record>) -> Taken {
    match (mode, recorded) {
        (Replay::Again, _) => Taken::Next,
        (Replay::Once, Some(record))
            if record.kind == HopKind::Replay && record.taken_by.is_none() =>
        {
            Taken::Finish(record)
        }
        (Replay::Once, _) => Taken::Refuse,
    }
}

impl Outlet {
    /// Publishes the letter's request as the first hop of a new generation of its
    /// conversation, into the letter's pool; returns that generation.
    pub(crate) async fn replay(
        &self,
        letter: &DeadLetter,
        mode: Replay,
    ) -> Result<u64, ReplayError> {
        let origin: Origin = letter
            .origin
            .as_deref()
            .ok_or(ReplayError::NoOrigin)?
            .parse()
            .map_err(|e: webproxy_protocol::InvalidName| ReplayError::BadOrigin(e.0))?;
        let envelope = letter.whole_request().ok_or(ReplayError::Truncated)?;
        let mut generation = letter.generation + 1;
        let record = loop {
            let token = new_token();
            let record = Record {
                kind: HopKind::Replay,
                subject: self.subjects.hop(&letter.pool, &token),
                msg_id: hop_msg_id(HopKind::Replay, &token),
                hop: HopState {
                    origin: origin.clone(),
                    generation,
                    step: 1,
                    first_published_ms: unix_ms(webproxy_jetstream::clock::now()),
                    due_ms: None,
                    attempts: AttemptHistory::default(),
                    caller: letter.caller.clone(),
                    msg_id_sha256: letter.msg_id_sha256.clone(),
                },
                taken_by: None,
            };
            let claimed = match self
                .progress
                .mark_replayed(
                    &origin,
                    generation,
                    &record.msg_id,
                    record.hop.first_published_ms,
                )
                .await
            {
                Ok(()) => self.progress.write(&record, None).await,
                Err(e) => Err(e),
            };
            match claimed {
                Ok(_) => break record,
                Err(ProgressError::Conflict { .. }) => {
                    let recorded = self.progress.load(&origin, generation).await?;
                    match when_taken(mode, recorded.map(|(record, _)| record)) {
                        Taken::Finish(recorded) => break recorded,
                        Taken::Refuse => {
                            let generation = self.newest_replayed(&origin, generation).await?;
                            return Err(ReplayError::AlreadyReplayed { generation });
                        }
                        Taken::Next => generation += 1,
                    }
                }
                Err(e) => return Err(e.into()),
            }
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

    /// The newest generation of `origin` replayed, `taken` or later, to name in a
    /// refusal. Replays mark their generations one after another, so the first one
    /// without a marker ends the search.
    async fn newest_replayed(&self, origin: &Origin, taken: u64) -> Result<u64, ProgressError> {
        let mut newest = taken;
        while self.progress.is_replayed(origin, newest + 1).await? {
            newest += 1;
        }
        Ok(newest)
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;

    fn record(kind: HopKind, taken_by: Option<u64>) -> Record {
        let hop = HopState::first(Origin::new("S", 1), SystemTime::UNIX_EPOCH, None)
            .next(AttemptHistory::default(), None);
        Record {
            kind,
            subject: "webproxy.hop.default.t".into(),
            msg_id: "replay:t".into(),
            hop,
            taken_by,
        }
    }

    #[test]
    fn a_replayed_generation_is_refused_once_it_ran() {
        // settled (its record deleted), or stopped between its marker and its record
        assert_eq!(when_taken(Replay::Once, None), Taken::Refuse);
        // running: its hop was taken, or it parked or moved since
        assert_eq!(
            when_taken(Replay::Once, Some(record(HopKind::Replay, Some(7)))),
            Taken::Refuse
        );
        assert_eq!(
            when_taken(Replay::Once, Some(record(HopKind::Park, None))),
            Taken::Refuse
        );
    }

    #[test]
    fn a_replay_recorded_but_not_yet_taken_is_finished_not_repeated() {
        let recorded = record(HopKind::Replay, None);
        assert_eq!(
            when_taken(Replay::Once, Some(recorded.clone())),
            Taken::Finish(recorded)
        );
    }

    #[test]
    fn again_goes_past_every_replayed_generation() {
        assert_eq!(when_taken(Replay::Again, None), Taken::Next);
        assert_eq!(
            when_taken(Replay::Again, Some(record(HopKind::Replay, None))),
            Taken::Next
        );
    }
}
