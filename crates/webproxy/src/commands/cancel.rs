//! `webproxy cancel`: an operator takes a conversation back by its origin alone, with a
//! core NATS request on `<prefix>.admin.cancel`, which the service answers with what
//! became of the cancel. Made for scripts, as `send` is: the state on stdout, and
//! `unknown` an exit code of its own ([`UNKNOWN_EXIT`]).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use async_nats::RequestErrorKind;
use clap::Args;
use webproxy_protocol::{AdminCancelRequest, CancelAnswer, CancelState, Origin};

use crate::commands::operator::{NatsArgs, connect};

/// How long `cancel` waits for an instance's answer. An instance answers once it has
/// looked the conversation up and stored the cancel, a few KV operations: past this the
/// service is down or too busy, and the operator had better know than wait.
const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// The exit code of an `unknown` answer: no such conversation. The same as `send`'s
/// for a pool that does not exist, the other "what you named is not there"; 1 stays
/// "the command failed", 2 bad usage (an origin that is not `<STREAM>:<seq>`).
/// docs/cli.md, "`cancel`", lists them; keep it in step.
const UNKNOWN_EXIT: u8 = 5;

#[derive(Debug, Args)]
pub(crate) struct CancelArgs {
    #[command(flatten)]
    pub(crate) nats: NatsArgs,
    /// The conversation's origin, `<STREAM>:<seq>`, as `send`, `dead list` and the
    /// service's logs print it.
    #[arg(long, value_name = "STREAM:SEQ", value_parser = parse_origin)]
    pub(crate) origin: Origin,
    /// Print the service's answer as it came, one JSON object: `{"cancel": STATE}`, or
    /// `{"error": {"code": ..., "message": ...}}` (then the command fails too).
    #[arg(long)]
    pub(crate) json: bool,
}

/// `--origin`: `<STREAM>:<seq>`, checked as the service checks it, so a typo is
/// refused here rather than answered `unknown`.
fn parse_origin(value: &str) -> Result<Origin, String> {
    value
        .parse()
        .map_err(|e: webproxy_protocol::InvalidName| e.0)
}

pub(crate) async fn run(args: CancelArgs) -> anyhow::Result<ExitCode> {
    let client = connect(&args.nats).await?;
    let subject = client.subjects().admin_cancel();
    let request = AdminCancelRequest {
        origin: args.origin.to_string(),
    };
    let payload = serde_json::to_vec(&request).context("cannot encode the cancel")?;
    let answer = tokio::time::timeout(
        ANSWER_WAIT,
        client.nats().request(subject.clone(), payload.into()),
    )
    .await
    .map_err(|_| timed_out(&subject))?
    .map_err(|e| match e.kind() {
        RequestErrorKind::NoResponders => {
            anyhow::anyhow!("no webproxy instance answers {subject}: is the service running?")
        }
        RequestErrorKind::TimedOut => timed_out(&subject),
        _ => anyhow::Error::new(e).context("cannot send the cancel"),
    })?;
    let state = state(&answer.payload, &args.origin)?;
    if args.json {
        outln!("{}", String::from_utf8_lossy(&answer.payload))?;
    }
    let state = state?;
    if !args.json {
        outln!("{}", state.as_str())?;
    }
    Ok(exit_code(state))
}

fn timed_out(subject: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "no answer on {subject} within {}s: the cancel may or may not be recorded; ask again",
        ANSWER_WAIT.as_secs()
    )
}

/// What the answer says (pure). The outer error is an answer that is not one, which
/// is not printed; the inner one an answer refusing the cancel, which `--json` prints
/// before failing.
fn state(payload: &[u8], origin: &Origin) -> anyhow::Result<anyhow::Result<CancelState>> {
    let answer: CancelAnswer = serde_json::from_slice(payload).with_context(|| {
        format!(
            "the answer is not a cancel answer: {}",
            String::from_utf8_lossy(payload)
        )
    })?;
    Ok(match (answer.cancel, answer.error) {
        (Some(state), _) => Ok(state),
        (None, Some(error)) => Err(anyhow::anyhow!(
            "the cancel of {origin} was not taken: {}: {}",
            error.code.as_str(),
            error.message
        )),
        (None, None) => bail!("the answer has neither a state nor an error"),
    })
}

fn exit_code(state: CancelState) -> ExitCode {
    match state {
        CancelState::Recorded | CancelState::Finished => ExitCode::SUCCESS,
        CancelState::Unknown => ExitCode::from(UNKNOWN_EXIT),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn origin() -> Origin {
        Origin::new("WEBPROXY_POOL_DEFAULT", 7)
    }

    #[test]
    fn each_state_is_read_from_its_answer() {
        for (payload, want) in [
            (r#"{"cancel":"recorded"}"#, CancelState::Recorded),
            (r#"{"cancel":"finished"}"#, CancelState::Finished),
            (r#"{"cancel":"unknown"}"#, CancelState::Unknown),
        ] {
            let got = state(payload.as_bytes(), &origin()).expect("an answer");
            assert_eq!(got.expect("a state"), want, "{payload}");
        }
    }

    #[test]
    fn a_refusal_names_its_code_and_message() {
        let payload = br#"{"error":{"code":"busy","message":"ask again"}}"#;
        let error = state(payload, &origin())
            .expect("an answer")
            .expect_err("a refusal");
        assert_eq!(
            error.to_string(),
            "the cancel of WEBPROXY_POOL_DEFAULT:7 was not taken: busy: ask again"
        );
    }

    #[test]
    fn what_is_not_an_answer_is_an_error() {
        for payload in [&b"not json"[..], b"{}", br#"{"cancel":"maybe"}"#] {
            assert!(state(payload, &origin()).is_err(), "{payload:?}");
        }
    }

    #[test]
    fn only_unknown_fails_with_its_own_code() {
        assert_eq!(exit_code(CancelState::Recorded), ExitCode::SUCCESS);
        assert_eq!(exit_code(CancelState::Finished), ExitCode::SUCCESS);
        assert_eq!(
            exit_code(CancelState::Unknown),
            ExitCode::from(UNKNOWN_EXIT)
        );
    }

    #[test]
    fn the_origin_is_checked_as_the_service_checks_it() {
        assert_eq!(parse_origin("WEBPROXY_POOL_DEFAULT:7"), Ok(origin()));
        for bad in ["WEBPROXY_POOL_DEFAULT", "S:0", "A.B:1", "S:x"] {
            let error = parse_origin(bad).expect_err(bad);
            assert!(error.contains("origin"), "{bad}: {error}");
        }
    }
}
