//! A conversation's dead letter: stored before its error reply, and marked
//! superseded when another delivery of the conversation answered with a response
//! first, so that `dead list` and `dead replay` skip it.

use async_nats::HeaderMap;
use tracing::{debug, error, info};
use webproxy_protocol::{ErrorBody, header};

use super::publish::{Outlet, PublishFailure, Stored, publish_stored};
use super::{Conversation, Underway};
use crate::conversation::hop::{dead_msg_id, superseded_msg_id};
use crate::conversation::outbox::{LetterParts, dead_letter};

/// Stores the dead letter of `error`: the caller's envelope as sent, what webproxy
/// composed redacted, the attempts so far.
pub(crate) async fn store_dead_letter(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
    underway: &Underway<'_>,
    error: &ErrorBody,
) -> Result<(), PublishFailure> {
    // What webproxy composed is redacted; the caller's envelope is kept as sent, for
    // replay. Redacting a secret the caller itself wrote would tell it that its guess
    // was right, so those are left as they are everywhere (`Redactor::for_envelope`).
    let redaction = outlet.redactor.for_envelope(&conversation.payload);
    let mut redacted = error.clone();
    redacted.message = redaction.redact(&error.message).into_owned();
    let mut attempts = underway.attempts.clone();
    for attempt in &mut attempts.kept {
        if let Some(failure) = &mut attempt.failure {
            *failure = redaction.redact(failure).into_owned();
        }
    }
    let payload = dead_letter(
        LetterParts {
            pool: conversation.pool,
            id: conversation.id.as_deref(),
            origin: Some(conversation.origin()),
            caller: conversation.caller(),
            msg_id_sha256: conversation.state.msg_id_sha256.as_deref(),
            generation: conversation.generation(),
            error: redacted,
            payload: &conversation.payload,
            attempts: &attempts,
        },
        outlet.max_payload,
    );
    let mut headers = HeaderMap::new();
    headers.insert(header::ERROR_CODE, error.code.as_str());
    headers.insert(
        header::GENERATION,
        conversation.generation().to_string().as_str(),
    );
    headers.insert(header::ORIGIN, conversation.origin().to_string().as_str());
    if let Some(id) = conversation.id.as_deref() {
        headers.insert(header::ID, id);
    }
    let subject = outlet.subjects.dead(conversation.pool);
    let msg_id = dead_msg_id(conversation.origin(), conversation.generation());
    let stored = Stored {
        subject: &subject,
        msg_id: &msg_id,
        headers: &headers,
        payload: &payload,
    };
    tolerate_missing_stream(publish_stored(outlet, stored).await)?;
    outlet
        .metrics
        .dead_letter(conversation.pool, error.code.as_str());
    debug!(pool = conversation.pool, origin = %conversation.origin(), code = error.code.as_str(), "dead-lettered");
    Ok(())
}

/// Marks this generation's dead letter superseded: this delivery stored it, but
/// another delivery of the conversation answered with a response first. `dead list`
/// and `dead replay` skip a letter so marked.
pub(crate) async fn supersede_dead_letter(
    outlet: &Outlet,
    conversation: &Conversation<'_>,
) -> Result<(), PublishFailure> {
    let mut headers = HeaderMap::new();
    headers.insert(
        header::GENERATION,
        conversation.generation().to_string().as_str(),
    );
    headers.insert(header::ORIGIN, conversation.origin().to_string().as_str());
    let subject = outlet.subjects.dead_superseded(conversation.pool);
    let msg_id = superseded_msg_id(conversation.origin(), conversation.generation());
    let stored = Stored {
        subject: &subject,
        msg_id: &msg_id,
        headers: &headers,
        payload: &bytes::Bytes::new(),
    };
    tolerate_missing_stream(publish_stored(outlet, stored).await)?;
    info!(pool = conversation.pool, origin = %conversation.origin(), generation = conversation.generation(), "another delivery answered with a response first; marked this delivery's dead letter superseded");
    Ok(())
}

/// A deleted replies or dead-letter stream is an operator's doing that no retry
/// repairs: the conversation still ends, and the loss is logged loudly.
pub(crate) fn tolerate_missing_stream<T: Default>(
    result: Result<T, PublishFailure>,
) -> Result<T, PublishFailure> {
    match result {
        Err(PublishFailure::NoStream { subject }) => {
            error!(
                subject,
                "no stream stores this subject; the conversation ends without storing it"
            );
            Ok(T::default())
        }
        other => other,
    }
}
