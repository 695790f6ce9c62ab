//! `<prefix>.cancel` and `<prefix>.admin.cancel`: a cancel looked up and recorded.
//! Every cancel makes the same four lookups, each by a literal subject when the caller
//! names the id: the conversation's stored reply (for its generation), the request
//! message in its pool stream, the progress record of the generation after the reply,
//! and the stored reply again. They are made in the order a conversation leaves its
//! states (the message is acked only after a park's record or the reply is stored, a
//! record is purged only after the reply is stored), so a conversation that moves on
//! while it is looked up is still found in one of them. The pure [`decide`] reads
//! them: a conversation under way is recorded at its current generation, one with its
//! final reply is `finished`, and anything else, a message id that is not the
//! publisher's included, is `unknown`, byte for byte.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use bytes::Bytes;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use webproxy_protocol::{
    AdminCancelRequest, CancelAnswer, CancelErrorCode, CancelRequest, CancelState, Origin,
    capability_sha256, header, validate_id,
};

use crate::conversation::cancels::{By, Cancels};
use crate::conversation::publish::Outlet;
use crate::conversation::stored_reply;
use crate::core_requests;

/// Cancels one instance answers at once, and of them what one pool's conversations
/// may hold (the caller is not named on the subject, so the share is the pool's).
const MAX_CONCURRENT: usize = 32;
const MAX_PER_POOL: usize = MAX_CONCURRENT / 2;

/// The longest a cancel's lookups and record may take before it is answered
/// `internal`: a store that does not answer must not hold a slot for good.
const ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// What answers cancels: the outlet (the streams, the progress bucket) and the cancels.
#[derive(Clone)]
pub(crate) struct Answerer {
    pub(crate) outlet: Outlet,
    pub(crate) cancels: std::sync::Arc<Cancels>,
}

/// Answers callers' and operators' cancels until `shutdown`.
pub(crate) async fn serve(answerer: Answerer, shutdown: CancellationToken) {
    let client = answerer.outlet.client.clone();
    let subjects = &answerer.outlet.subjects;
    let busy = |what: &str| {
        answer_of(&CancelAnswer::error(
            CancelErrorCode::Busy,
            format!("as many {what} as this instance answers at once are under way: ask again"),
        ))
    };
    let callers = core_requests::Requests {
        subject: subjects.cancel(),
        group: "webproxy-cancel",
        max_concurrent: MAX_CONCURRENT,
        max_per_key: MAX_PER_POOL,
        busy: busy("cancels"),
    };
    let operators = core_requests::Requests {
        subject: subjects.admin_cancel(),
        group: "webproxy-admin-cancel",
        max_concurrent: 4,
        max_per_key: 4,
        busy: busy("operator cancels"),
    };
    let caller_answers = answerer.clone();
    let operator_answers = answerer;
    tokio::join!(
        core_requests::serve(
            client.clone(),
            callers,
            shutdown.clone(),
            core_requests::origin_stream,
            move |request| {
                let answerer = caller_answers.clone();
                async move { answer_of(&answerer.caller(&request.payload).await) }
            },
        ),
        core_requests::serve(
            client,
            operators,
            shutdown,
            |_| String::new(),
            move |request| {
                let answerer = operator_answers.clone();
                async move { answer_of(&answerer.operator(&request.payload).await) }
            },
        ),
    );
}

fn answer_of(answer: &CancelAnswer) -> core_requests::Answer {
    (HeaderMap::new(), Bytes::from(answer.encode()))
}

fn invalid(message: impl Into<String>) -> CancelAnswer {
    CancelAnswer::error(CancelErrorCode::InvalidRequest, message)
}

/// What the lookups found of a conversation.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Found {
    /// The stored reply's generation and the message-id hash it carries, read first.
    pub(crate) reply: Option<(u64, Option<String>)>,
    /// The stored reply read last: one the conversation stored while it was looked up.
    pub(crate) reply_after: Option<(u64, Option<String>)>,
    /// The progress record of the generation after the stored reply's (or of 0), with
    /// its hash: a parked, moved or replayed conversation.
    pub(crate) record: Option<Option<String>>,
    /// The request message still in its pool stream, with its message id's hash:
    /// waiting or in flight, generation 0.
    pub(crate) message: Option<Option<String>>,
}

impl Found {
    /// The generation a cancel would end: the one after the stored reply's.
    pub(crate) fn next_generation(&self) -> u64 {
        self.reply
            .as_ref()
            .map_or(0, |(generation, _)| generation + 1)
    }
}

/// Who asks: a caller showing a message id's hash, or an operator.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Asker<'a> {
    Caller { msg_id_sha256: &'a str },
    Operator,
}

/// What a cancel does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    Record { generation: u64 },
    Finished,
    Unknown,
}

/// Decides a cancel from what the lookups `found` (pure). Every hash is compared in
/// constant time, and a mismatch anywhere is `Unknown`.
pub(crate) fn decide(found: &Found, asker: Asker<'_>) -> Decision {
    let shown = |kept: &Option<String>| match asker {
        Asker::Operator => true,
        Asker::Caller { msg_id_sha256 } => kept.as_deref().is_some_and(|kept| {
            use subtle::ConstantTimeEq as _;
            bool::from(kept.as_bytes().ct_eq(msg_id_sha256.as_bytes()))
        }),
    };
    let next = found.next_generation();
    // The lookup that says where the conversation stands, and the hash kept there.
    let standing = match found {
        // Finished while it was looked up: what the record or the message said is past.
        Found {
            reply_after: Some((generation, kept)),
            ..
        } if *generation >= next => Some((kept, Decision::Finished)),
        Found {
            record: Some(kept), ..
        } => Some((kept, Decision::Record { generation: next })),
        Found {
            message: Some(kept),
            ..
        } if next == 0 => Some((kept, Decision::Record { generation: 0 })),
        Found {
            reply: Some((_, kept)),
            ..
        } => Some((kept, Decision::Finished)),
        _ => None,
    };
    match standing {
        Some((kept, decision)) if shown(kept) => decision,
        _ => Decision::Unknown,
    }
}

impl Answerer {
    async fn caller(&self, payload: &[u8]) -> CancelAnswer {
        let request: CancelRequest = match serde_json::from_slice(payload) {
            Ok(request) => request,
            Err(e) => return invalid(format!("expected {{\"id\", \"origin\", \"msg_id\"}}: {e}")),
        };
        if let Err(e) = validate_id(&request.id) {
            return invalid(format!("invalid field `id`: {e}"));
        }
        let origin = match parse_origin(&request.origin) {
            Ok(origin) => origin,
            Err(answer) => return answer,
        };
        // A message id that is no capability opens nothing; it is still looked up, so
        // that the answer takes as long as any other.
        let hash = capability_sha256(&request.msg_id).unwrap_or_default();
        let asker = Asker::Caller {
            msg_id_sha256: &hash,
        };
        self.cancel(&origin, Some(&request.id), asker).await
    }

    async fn operator(&self, payload: &[u8]) -> CancelAnswer {
        let request: AdminCancelRequest = match serde_json::from_slice(payload) {
            Ok(request) => request,
            Err(e) => return invalid(format!("expected {{\"origin\"}}: {e}")),
        };
        let origin = match parse_origin(&request.origin) {
            Ok(origin) => origin,
            Err(answer) => return answer,
        };
        let answer = self.cancel(&origin, None, Asker::Operator).await;
        info!(%origin, answer = answer.cancel.map_or("error", |state| state.as_str()), "an operator's cancel");
        answer
    }

    /// Looks `origin` up and records the cancel when it is under way.
    async fn cancel(&self, origin: &Origin, id: Option<&str>, asker: Asker<'_>) -> CancelAnswer {
        let by = match asker {
            Asker::Caller { .. } => By::Caller,
            Asker::Operator => By::Operator,
        };
        let done = async {
            let found = self.look_up(origin, id).await?;
            match decide(&found, asker) {
                Decision::Record { generation } => {
                    self.cancels.record(origin, generation, by).await?;
                    Ok(CancelState::Recorded)
                }
                Decision::Finished => Ok(CancelState::Finished),
                Decision::Unknown => Ok::<_, String>(CancelState::Unknown),
            }
        };
        match tokio::time::timeout(ANSWER_WITHIN, done).await {
            Ok(Ok(state)) => CancelAnswer::state(state),
            Ok(Err(e)) => {
                warn!(%origin, error = %e, "cannot take a cancel");
                CancelAnswer::error(
                    CancelErrorCode::Internal,
                    "the cancel could not be looked up or recorded: nothing was recorded, ask again",
                )
            }
            Err(_) => CancelAnswer::error(
                CancelErrorCode::Internal,
                "the cancel's lookups did not finish in time: nothing was recorded, ask again",
            ),
        }
    }

    /// The four lookups, made whatever each finds, in the order a conversation leaves
    /// its states.
    async fn look_up(&self, origin: &Origin, id: Option<&str>) -> Result<Found, String> {
        let reply = self.stored_reply(origin, id).await?;
        let message = self.request_message(origin).await?;
        let found = Found {
            reply,
            message,
            ..Found::default()
        };
        let record = self
            .outlet
            .progress
            .load(origin, found.next_generation())
            .await
            .map_err(|e| e.to_string())?
            .map(|(record, _)| record.hop.msg_id_sha256);
        let reply_after = self.stored_reply(origin, id).await?;
        Ok(Found {
            record,
            reply_after,
            ..found
        })
    }

    /// The conversation's stored reply, its generation and the hash it keeps: on its
    /// literal subject when the id is known; else (an operator names none) on the one
    /// subject of the origin, found by a wildcard.
    async fn stored_reply(
        &self,
        origin: &Origin,
        id: Option<&str>,
    ) -> Result<Option<(u64, Option<String>)>, String> {
        let outlet = &self.outlet;
        let subject = match id {
            Some(id) => outlet.subjects.stored_reply(id, origin),
            None => match self.reply_subject(origin).await? {
                Some(subject) => subject,
                None => return Ok(None),
            },
        };
        Ok(stored_reply::answering(outlet, &subject, origin, 0)
            .await
            .map_err(|e| format!("stored reply: {e}"))?
            .map(|reply| (reply.generation, kept_hash(reply.message.headers.as_ref()))))
    }

    /// The subject `origin`'s reply is stored on, whatever its id, if one is stored.
    async fn reply_subject(&self, origin: &Origin) -> Result<Option<String>, String> {
        let outlet = &self.outlet;
        let stream = outlet
            .js
            .get_stream_no_info(outlet.subjects.replies_stream_of(origin))
            .await
            .map_err(|e| format!("replies stream: {e}"))?;
        let wildcard = outlet.subjects.stored_reply("*", origin);
        match stream.get_first_raw_message_by_subject(&wildcard, 0).await {
            Ok(message) => Ok(Some(message.subject.to_string())),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) if stored_reply::stream_missing(&e) => Ok(None),
            Err(e) => Err(format!("stored reply: {e}")),
        }
    }

    /// The request message at `origin`, while it is in its pool stream (a work queue:
    /// it is gone once acked), with its message id's hash.
    async fn request_message(&self, origin: &Origin) -> Result<Option<Option<String>>, String> {
        let stream = match self.outlet.js.get_stream_no_info(&origin.stream).await {
            Ok(stream) => stream,
            Err(e) => return Err(format!("pool stream: {e}")),
        };
        match stream.get_raw_message(origin.seq).await {
            Ok(message) => Ok(Some(
                message
                    .headers
                    .get(header::MSG_ID)
                    .and_then(|id| capability_sha256(id.as_str())),
            )),
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
            // An origin of no pool stream names no conversation.
            Err(e) if stored_reply::stream_missing(&e) => Ok(None),
            Err(e) => Err(format!("pool stream: {e}")),
        }
    }
}

/// The message-id hash a stored reply carries.
fn kept_hash(headers: Option<&HeaderMap>) -> Option<String> {
    headers
        .and_then(|h| h.get(header::MSG_ID_SHA256))
        .map(|v| v.as_str().to_string())
}

/// An origin of a pool stream, or the answer that says it is not one.
fn parse_origin(text: &str) -> Result<Origin, CancelAnswer> {
    let origin: Origin = text.parse().map_err(|e: webproxy_protocol::InvalidName| {
        invalid(format!("invalid field `origin`: {}", e.0))
    })?;
    if validate_id(&origin.stream).is_err() {
        return Err(invalid("invalid field `origin`: not a stream name"));
    }
    Ok(origin)
}

#[cfg(test)]
mod tests {
    use super::*;

    const OURS: &str = "a1";
    const CALLER: Asker<'static> = Asker::Caller {
        msg_id_sha256: OURS,
    };
    const STRANGER: Asker<'static> = Asker::Caller {
        msg_id_sha256: "b2",
    };

    fn kept() -> Option<String> {
        Some(OURS.to_string())
    }

    #[test]
    fn a_waiting_or_in_flight_conversation_is_recorded_at_generation_0() {
        let found = Found {
            message: Some(kept()),
            ..Found::default()
        };
        assert_eq!(decide(&found, CALLER), Decision::Record { generation: 0 });
        assert_eq!(
            decide(&found, Asker::Operator),
            Decision::Record { generation: 0 }
        );
        assert_eq!(decide(&found, STRANGER), Decision::Unknown);
    }

    #[test]
    fn a_parked_or_replayed_conversation_is_recorded_at_its_record_s_generation() {
        let parked = Found {
            record: Some(kept()),
            ..Found::default()
        };
        assert_eq!(decide(&parked, CALLER), Decision::Record { generation: 0 });
        let replayed = Found {
            reply: Some((2, kept())),
            record: Some(kept()),
            ..Found::default()
        };
        assert_eq!(
            decide(&replayed, CALLER),
            Decision::Record { generation: 3 }
        );
        assert_eq!(decide(&replayed, STRANGER), Decision::Unknown);
    }

    #[test]
    fn a_stored_reply_is_finished_even_before_its_message_is_acked() {
        let settling = Found {
            reply: Some((0, kept())),
            message: Some(kept()),
            ..Found::default()
        };
        assert_eq!(decide(&settling, CALLER), Decision::Finished);
        assert_eq!(decide(&settling, STRANGER), Decision::Unknown);
        assert_eq!(decide(&settling, Asker::Operator), Decision::Finished);
    }

    #[test]
    fn a_conversation_that_finished_while_looked_up_is_finished() {
        // Acked before the message lookup, its record purged before the record lookup:
        // only the second read of the stored reply finds it.
        let gone = Found {
            reply_after: Some((0, kept())),
            ..Found::default()
        };
        assert_eq!(decide(&gone, CALLER), Decision::Finished);
        assert_eq!(decide(&gone, STRANGER), Decision::Unknown);
        // Parked when looked up, finished by the last read.
        let settled = Found {
            record: Some(kept()),
            reply_after: Some((0, kept())),
            ..Found::default()
        };
        assert_eq!(decide(&settled, CALLER), Decision::Finished);
        // A replay under way is not finished by the reply of the generation before.
        let replaying = Found {
            reply: Some((0, kept())),
            record: Some(kept()),
            reply_after: Some((0, kept())),
            ..Found::default()
        };
        assert_eq!(
            decide(&replaying, CALLER),
            Decision::Record { generation: 1 }
        );
    }

    #[test]
    fn nothing_kept_opens_nothing() {
        assert_eq!(decide(&Found::default(), CALLER), Decision::Unknown);
        assert_eq!(
            decide(&Found::default(), Asker::Operator),
            Decision::Unknown
        );
        let without_capability = Found {
            message: Some(None),
            ..Found::default()
        };
        assert_eq!(decide(&without_capability, CALLER), Decision::Unknown);
        let empty_shown = Asker::Caller { msg_id_sha256: "" };
        assert_eq!(decide(&without_capability, empty_shown), Decision::Unknown);
    }
}
