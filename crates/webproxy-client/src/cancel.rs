//! Taking a request back: `<prefix>.cancel`, with the message id the request was
//! published with as the capability.

use webproxy_protocol::{CancelAnswer, CancelErrorCode, CancelRequest, CancelState, Origin};

use crate::body::ask_while_busy;
use crate::{Client, Error, check_id};

impl Client {
    /// Cancels the conversation `origin` with envelope id `id`, published with
    /// `msg_id` (all three are in [`crate::Submitted`]). `Recorded`: its next delivery
    /// ends it and an attempt in flight is dropped; its reply says `cancelled`, or is
    /// the response of an attempt that finished first. `Finished`: it has its final
    /// reply, unchanged. `Unknown`: no such conversation, or not this `msg_id`. An
    /// answer `busy` is asked again, as for bodies.
    pub async fn cancel(
        &self,
        id: &str,
        origin: &Origin,
        msg_id: &str,
    ) -> Result<CancelState, Error> {
        check_id(id)?;
        let request = CancelRequest {
            id: id.to_string(),
            origin: origin.to_string(),
            msg_id: msg_id.to_string(),
        };
        let payload = serde_json::to_vec(&request).map_err(Error::Encode)?;
        let answer = ask_while_busy(&self.nats, &self.subjects.cancel(), payload.into(), |a| {
            serde_json::from_slice::<CancelAnswer>(&a.payload)
                .is_ok_and(|a| a.error.is_some_and(|e| e.code == CancelErrorCode::Busy))
        })
        .await
        .map_err(Error::CancelRequest)?;
        let answer: CancelAnswer =
            serde_json::from_slice(&answer.payload).map_err(Error::Decode)?;
        match (answer.cancel, answer.error) {
            (Some(state), _) => Ok(state),
            (None, Some(error)) => Err(Error::Cancel {
                code: error.code.as_str().to_string(),
                message: error.message,
            }),
            (None, None) => Err(Error::Cancel {
                code: "internal".into(),
                message: "the cancel was answered with neither a state nor an error".into(),
            }),
        }
    }
}
