//! A conversation's stored reply, one body per generation. A redelivery reads it back
//! instead of attempting again, and a reply is stored only on top of what its subject
//! held (`Nats-Expected-Last-Subject-Sequence`), so that a delivery that stalled past
//! `ack_wait` and woke can never store, or send live, a second body for a generation
//! another delivery answered.
//!
//! A reply is stored in the replies stream of the conversation's origin pool stream
//! (`<STREAM>_REPLIES`). A reply stored before the upgrade to layout 3 is in the
//! retired shared stream (`<PREFIX>_REPLIES`) until it ages out, so a read that finds
//! nothing in the pool's own stream looks there too.

use async_nats::jetstream::stream::{LastRawMessageError, LastRawMessageErrorKind};
use async_nats::jetstream::{self, message::StreamMessage};
use webproxy_protocol::{Origin, header};

use super::publish::{Checked, Outlet, PublishFailure, Stored, publish_checked};

/// A reply stored on a conversation's own subject, with the generation it answers.
#[derive(Debug)]
pub(crate) struct StoredReply {
    pub(crate) message: async_nats::Message,
    pub(crate) generation: u64,
}

/// The last message on a stored-reply subject.
#[derive(Debug)]
struct Last {
    sequence: u64,
    /// The reply, when its headers say it is `origin`'s (the subject already does).
    reply: Option<StoredReply>,
}

/// The last message on `subject` in the stream `stream`: none when the subject holds
/// none, or the stream is gone (only the retired shared stream is ever read so: its
/// deletion by an operator, once it has aged out, is expected).
async fn last_in(
    outlet: &Outlet,
    stream: &str,
    subject: &str,
) -> Result<Option<StreamMessage>, async_nats::Error> {
    let stream = outlet.js.get_stream_no_info(stream).await?;
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(stored) => Ok(Some(stored)),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(e) if stream_missing(&e) => Ok(None),
        Err(e) => Err(e.into()),
    }
}

/// The stream read does not exist (err_code 10059).
pub(crate) fn stream_missing(e: &LastRawMessageError) -> bool {
    matches!(e.kind(), LastRawMessageErrorKind::JetStream(ref js)
        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND)
}

/// The conversation's stored reply, when it answers `generation` or a later one.
pub(crate) async fn answering(
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
    let own_stream = outlet.subjects.replies_stream_of(origin);
    let (stored, sequence) = match last_in(outlet, &own_stream, subject).await? {
        Some(stored) => {
            let sequence = stored.sequence;
            (stored, sequence)
        }
        // Stored before the upgrade to layout 3, in the retired shared stream. Its
        // sequence is that stream's: in the pool's own stream the subject holds
        // nothing, so a publish there expects 0.
        None => match last_in(outlet, &outlet.subjects.replies_stream(), subject).await? {
            Some(stored) => (stored, 0),
            None => return Ok(None),
        },
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
    Ok(Some(Last { sequence, reply }))
}

/// Which body the conversation's reply subject holds for this generation.
#[derive(Debug, Default)]
pub(crate) enum Kept {
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
pub(crate) async fn store_once(
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

#[cfg(test)]
mod tests {
    //! Against a real nats-server: a reply that layout 2 stored in its shared stream,
    //! read back after the upgrade to layout 3.

    use async_nats::HeaderMap;
    use async_nats::jetstream::stream;
    use bytes::Bytes;

    use super::*;
    use crate::consuming::start::provision;
    use crate::conversation::tests::{Fixture, STREAM};

    #[tokio::test]
    async fn a_reply_stored_before_the_upgrade_is_found_and_a_replay_is_stored_in_the_pools_stream()
    {
        let f = Fixture::start().await;
        let js = &f.js;
        let outlet = &f.shared.outlet;
        let origin = Origin::new(STREAM, 42);
        let subject = outlet.subjects.stored_reply("old", &origin);
        // Layout 2's shared replies stream, with one reply of generation 0 stored
        // before the upgrade: the pool's own stream cannot exist beside it.
        js.delete_stream(format!("{STREAM}_REPLIES"))
            .await
            .expect("delete the pool's replies stream");
        js.create_stream(stream::Config {
            name: "WEBPROXY_REPLIES".into(),
            subjects: vec!["webproxy.reply.*.*.*".into()],
            ..Default::default()
        })
        .await
        .expect("layout 2's replies stream");
        let mut headers = HeaderMap::new();
        headers.insert(header::ORIGIN, origin.to_string().as_str());
        headers.insert(header::GENERATION, "0");
        js.publish_with_headers(subject.clone(), headers.clone(), "before".into())
            .await
            .expect("publish")
            .await
            .expect("stored");

        provision(js, &f.shared.settings).await.expect("upgraded");
        let found = answering(outlet, &subject, &origin, 0)
            .await
            .expect("read")
            .expect("the reply stored before the upgrade");
        assert_eq!(found.message.payload, "before");
        assert!(
            answering(outlet, &subject, &origin, 1)
                .await
                .expect("read")
                .is_none(),
            "generation 0 does not answer generation 1"
        );

        headers.insert(header::GENERATION, "1");
        let payload = Bytes::from_static(b"replayed");
        let stored = |msg_id| Stored {
            subject: &subject,
            msg_id,
            headers: &headers,
            payload: &payload,
        };
        // A replay (generation 1) reads the subject first: the pool's own stream holds
        // nothing on it, so it stores on top of nothing there.
        let kept = store_once(outlet, stored("m1"), &origin, 1)
            .await
            .expect("stored");
        assert!(matches!(kept, Kept::Ours), "{kept:?}");
        let found = answering(outlet, &subject, &origin, 1)
            .await
            .expect("read")
            .expect("generation 1's reply");
        assert_eq!(found.message.payload, "replayed");
        // The shared stream still holds the old one, untouched.
        let old = js
            .get_stream_no_info("WEBPROXY_REPLIES")
            .await
            .expect("shared")
            .get_last_raw_message_by_subject(&subject)
            .await
            .expect("kept");
        assert_eq!(old.payload, "before");
    }
}
