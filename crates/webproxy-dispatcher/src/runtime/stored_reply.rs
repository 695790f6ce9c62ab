//! A conversation's stored reply, one body per generation. A redelivery reads it back
//! instead of attempting again, and a reply is stored only on top of what its subject
//! held (`Nats-Expected-Last-Subject-Sequence`), so that a delivery that stalled past
//! `ack_wait` and woke can never store, or send live, a second body for a generation
//! another delivery answered.

use async_nats::jetstream::stream::LastRawMessageErrorKind;
use webproxy_protocol::{Origin, header};

use super::publish::{Checked, Outlet, PublishFailure, Stored, publish_checked};

/// A reply stored on a conversation's own subject, with the generation it answers.
#[derive(Debug)]
pub(super) struct StoredReply {
    pub(super) message: async_nats::Message,
    pub(super) generation: u64,
}

/// The last message on a stored-reply subject.
#[derive(Debug)]
struct Last {
    sequence: u64,
    /// The reply, when its headers say it is `origin`'s (the subject already does).
    reply: Option<StoredReply>,
}

/// The conversation's stored reply, when it answers `generation` or a later one.
pub(super) async fn answering(
    outlet: &Outlet,
    subject: &str,
    origin: &Origin,
    generation: u64,
) -> Result<Option<StoredReply>, async_nats::Error> {
    Ok(last(outlet, subject, origin)
        .await?
        .and_then(|last| last.reply)
        .filter(|reply| reply.generation >= generation))
}

async fn last(
    outlet: &Outlet,
    subject: &str,
    origin: &Origin,
) -> Result<Option<Last>, async_nats::Error> {
    let stream = outlet
        .js
        .get_stream_no_info(outlet.subjects.replies_stream())
        .await?;
    let stored = match stream.get_last_raw_message_by_subject(subject).await {
        Ok(stored) => stored,
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let header = |name: &str| stored.headers.get(name).map(|v| v.as_str().to_string());
    let generation = header(header::GENERATION).and_then(|g| g.parse::<u64>().ok());
    let own = header(header::ORIGIN).is_some_and(|o| o == origin.to_string());
    let reply = generation.filter(|_| own).map(|generation| StoredReply {
        message: async_nats::Message {
            subject: stored.subject.clone(),
            reply: None,
            headers: Some(stored.headers.clone()),
            length: stored.payload.len(),
            payload: stored.payload.clone(),
            status: None,
            description: None,
        },
        generation,
    });
    Ok(Some(Last {
        sequence: stored.sequence,
        reply,
    }))
}

/// Which body the conversation's reply subject holds for this generation.
#[derive(Debug, Default)]
pub(super) enum Kept {
    /// This delivery's: it was stored now (or no stream stores it, which settle
    /// tolerates, and the live copies are this delivery's).
    #[default]
    Ours,
    /// Another delivery's, stored first: the only body of this generation that may be
    /// sent.
    Theirs(StoredReply),
}

/// Refused publishes before the reply is left for redelivery. A refusal is followed
/// by a read that finds the winner, so a second one needs a subject that changed
/// between the read and the publish (an older generation's late writer, or a reply
/// that aged out): no wait helps, and a few rounds are plenty.
const STORE_ROUNDS: u32 = 4;

/// Stores `reply` as `origin`'s reply of `generation`, unless that generation (or a
/// later one) is stored already. Generation 0, the hot path, expects an empty subject
/// and reads nothing first; a replay reads the subject's last message and publishes
/// on top of it. A refused publish reads back what won.
pub(super) async fn store_once(
    outlet: &Outlet,
    reply: Stored<'_>,
    origin: &Origin,
    generation: u64,
) -> Result<Kept, PublishFailure> {
    let mut expected = (generation == 0).then_some(0);
    let mut rounds = 0u32;
    loop {
        let expected_last = match expected {
            Some(sequence) => sequence,
            None => match last(outlet, reply.subject, origin).await {
                Ok(Some(Last {
                    reply: Some(stored),
                    ..
                })) if stored.generation >= generation => {
                    // An earlier try of this very publish (its ack lost, say) stored
                    // the same bytes: that is this delivery's reply.
                    if stored.message.payload == *reply.payload {
                        return Ok(Kept::Ours);
                    }
                    return Ok(Kept::Theirs(stored));
                }
                Ok(Some(last)) => last.sequence,
                Ok(None) => 0,
                Err(e) => {
                    return Err(PublishFailure::GaveUp {
                        subject: reply.subject.to_string(),
                        tries: rounds + 1,
                        last: format!("cannot read the stored reply: {e}"),
                    });
                }
            },
        };
        match publish_checked(outlet, reply, Some(expected_last)).await? {
            Checked::Stored => return Ok(Kept::Ours),
            Checked::Refused => expected = None,
        }
        rounds += 1;
        if rounds == STORE_ROUNDS {
            return Err(PublishFailure::GaveUp {
                subject: reply.subject.to_string(),
                tries: rounds,
                last: "the stored reply kept changing".into(),
            });
        }
    }
}
