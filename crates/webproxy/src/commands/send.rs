//! `webproxy send`: one request through a running service. Made for scripts: the
//! conversation's origin is always printed, each way the command can end has an exit
//! code of its own ([`Reason`]), and `--json` prints exactly one JSON object.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use async_nats::jetstream::context::PublishErrorKind;
use clap::Args;
use serde_json::{Value, json};
use webproxy_client::{Answer, Client, Error as ClientError, Origin, Outcome, Reply, Request};

use crate::commands::operator::{NatsArgs, connect};

#[derive(Debug, Args)]
pub(crate) struct SendArgs {
    #[command(flatten)]
    pub(crate) nats: NatsArgs,
    /// The pool to send to.
    #[arg(long, default_value = "default")]
    pub(crate) pool: String,
    /// How long to wait for the reply; past it `send` exits 4 and prints the origin, by
    /// which the stored reply can be read later.
    #[arg(long, visible_alias = "wait", default_value = "30s", value_parser = humantime::parse_duration)]
    pub(crate) timeout: Duration,
    /// A request header, `Name: value`; repeat for more.
    #[arg(short = 'H', long = "header", value_name = "HEADER")]
    pub(crate) headers: Vec<String>,
    /// The request body.
    #[arg(short = 'd', long = "data", conflicts_with = "data_file")]
    pub(crate) data: Option<String>,
    /// Read the request body from a file.
    #[arg(long, value_name = "PATH")]
    pub(crate) data_file: Option<PathBuf>,
    /// The caller name: the request goes on `<prefix>.request.<pool>.<caller>`, the
    /// subject NATS permissions let an isolated caller publish on.
    #[arg(long, value_name = "NAME")]
    pub(crate) caller: Option<String>,
    /// Have the reply copied to this subject and listen there only (an isolated
    /// caller may read neither `<prefix>.reply.>` nor the stored replies).
    #[arg(long, value_name = "SUBJECT")]
    pub(crate) reply_to: Option<String>,
    /// Print exactly one JSON object: the reply with its `origin`, or a failure
    /// (`failure`, `exit_code`, `message`, and `id` and `origin` after a timeout).
    #[arg(long)]
    pub(crate) json: bool,
    /// The HTTP method, e.g. GET.
    pub(crate) method: String,
    /// The absolute http or https URL to request.
    pub(crate) url: String,
}

/// Why `send` ended without a reply to print, each with its exit code. 0 is a
/// `response` reply and 3 an `error` reply; clap's usage errors are 2, as a malformed
/// `-H` is here. docs/cli.md, "`send`'s exit codes", lists them; keep it in step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reason {
    /// Anything else: an unreadable configuration or `--data-file`, a publish JetStream
    /// refused (a full pool), a stored reply that cannot be read.
    Failed,
    Usage,
    /// The request is stored but no reply came within `--timeout`; it may still come.
    Timeout,
    NoSuchPool,
    /// The NATS server cannot be reached (or refuses the connection).
    NatsUnreachable,
    /// NATS answers but JetStream does not (a server without JetStream, one that lost
    /// its JetStream quorum), or does not ack a publish in time.
    JetStreamUnavailable,
}

/// The exit code of an `error` reply.
const ERROR_OUTCOME: u8 = 3;

impl Reason {
    fn code(self) -> u8 {
        match self {
            Reason::Failed => 1,
            Reason::Usage => 2,
            Reason::Timeout => 4,
            Reason::NoSuchPool => 5,
            Reason::NatsUnreachable | Reason::JetStreamUnavailable => 6,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Reason::Failed => "failed",
            Reason::Usage => "usage",
            Reason::Timeout => "timeout",
            Reason::NoSuchPool => "no_such_pool",
            Reason::NatsUnreachable => "nats_unreachable",
            Reason::JetStreamUnavailable => "jetstream_unavailable",
        }
    }
}

/// How `send` ended when no reply can be printed.
#[derive(Debug)]
struct Failure {
    reason: Reason,
    message: String,
    /// The conversation's id and origin, when the request was stored: with both, its
    /// stored reply can be read later.
    stored: Option<(String, Origin)>,
}

impl Failure {
    fn new(reason: Reason, message: impl Into<String>) -> Failure {
        Failure {
            reason,
            message: message.into(),
            stored: None,
        }
    }
}

pub(crate) async fn run(args: SendArgs) -> anyhow::Result<ExitCode> {
    match send(&args).await {
        Ok(answer) => print_answer(&answer, args.json),
        Err(failure) => print_failure(&failure, args.json),
    }
}

async fn send(args: &SendArgs) -> Result<Answer, Failure> {
    let request = build_request(args)?;
    let client = connect(&args.nats).await.map_err(|e| {
        // Only a failed connection is "unreachable": a bad configuration is not.
        let reason = if e.downcast_ref::<async_nats::ConnectError>().is_some() {
            Reason::NatsUnreachable
        } else {
            Reason::Failed
        };
        Failure::new(reason, format!("{e:#}"))
    })?;
    let client = match &args.caller {
        Some(caller) => client
            .with_caller(caller)
            .map_err(|e| Failure::new(Reason::Usage, e.to_string()))?,
        None => client,
    };
    match client.request_answer(&request).await {
        Ok(answer) => Ok(answer),
        Err(error) => Err(classify(&client, error).await),
    }
}

fn build_request(args: &SendArgs) -> Result<Request, Failure> {
    let mut request = Request::new(args.method.clone(), args.url.clone())
        .pool(args.pool.clone())
        .wait(args.timeout);
    for line in &args.headers {
        let Some((name, value)) = line.split_once(':') else {
            return Err(Failure::new(
                Reason::Usage,
                format!("header {line:?} is not `Name: value`"),
            ));
        };
        request = request.header(name.trim(), value.trim());
    }
    if let Some(text) = &args.data {
        request = request.body(text.clone());
    }
    if let Some(path) = &args.data_file {
        let bytes = std::fs::read(path).map_err(|e| {
            Failure::new(
                Reason::Failed,
                format!("cannot read --data-file {}: {e}", path.display()),
            )
        })?;
        request = request.body_bytes(bytes);
    }
    if let Some(subject) = &args.reply_to {
        request = request.reply_to(subject.clone());
    }
    Ok(request)
}

/// The failure a client error stands for. A publish that nothing stores answers "no
/// responders" both when the pool does not exist and when JetStream is down, so after
/// one `send` asks the JetStream API for the account's info (`$JS.API.INFO`): an answer
/// means JetStream runs and the pool is missing; none means JetStream is unavailable.
async fn classify(client: &Client, error: ClientError) -> Failure {
    let message = error.to_string();
    match error {
        ClientError::Timeout { id, origin, .. } => Failure {
            reason: Reason::Timeout,
            message: format!("{message}; the reply may still come: read it by its id and origin"),
            stored: Some((id, origin)),
        },
        ClientError::NoSuchPool { .. } => {
            let js = async_nats::jetstream::new(client.nats().clone());
            match js.query_account().await {
                Ok(_) => Failure::new(Reason::NoSuchPool, message),
                Err(e) => Failure::new(
                    Reason::JetStreamUnavailable,
                    format!(
                        "JetStream does not answer (account info: {e}); the request was not stored"
                    ),
                ),
            }
        }
        // JetStream did not ack in time: it is down or too busy to answer.
        ClientError::Publish(e) if e.kind() == PublishErrorKind::TimedOut => {
            Failure::new(Reason::JetStreamUnavailable, message)
        }
        ClientError::InvalidPool(_) | ClientError::InvalidMsgId(_) => {
            Failure::new(Reason::Usage, message)
        }
        _ => Failure::new(Reason::Failed, message),
    }
}

/// The reply as JSON, with its origin.
fn reply_json(answer: &Answer) -> anyhow::Result<Value> {
    let mut value = serde_json::to_value(&answer.reply)?;
    if let Value::Object(fields) = &mut value {
        fields.insert("origin".to_string(), json!(answer.origin.to_string()));
    }
    Ok(value)
}

fn print_answer(answer: &Answer, json: bool) -> anyhow::Result<ExitCode> {
    let reply = &answer.reply;
    if json {
        outln!("{}", reply_json(answer)?)?;
    } else {
        eprintln!("{}", summary(reply, &answer.origin));
        // The body as the upstream sent it, so `send ... > file` keeps its bytes.
        let body = reply.body.decode().unwrap_or_default();
        crate::stdout::write_bytes(&body)?;
    }
    Ok(match reply.outcome {
        Outcome::Response => ExitCode::SUCCESS,
        Outcome::Error => ExitCode::from(ERROR_OUTCOME),
    })
}

/// One line: the status or error code, the attempts and the origin.
fn summary(reply: &Reply, origin: &Origin) -> String {
    let attempts = match reply.attempts {
        1 => "1 attempt".to_string(),
        n => format!("{n} attempts"),
    };
    match (&reply.outcome, &reply.error) {
        (Outcome::Error, Some(error)) => format!(
            "error {}: {}, {attempts}, origin {origin}",
            error.code, error.message
        ),
        _ => match reply.status {
            Some(status) => format!(
                "{} {status}, {attempts}, origin {origin}",
                reply.outcome.as_str()
            ),
            None => format!("{}, {attempts}, origin {origin}", reply.outcome.as_str()),
        },
    }
}

fn print_failure(failure: &Failure, json: bool) -> anyhow::Result<ExitCode> {
    let code = failure.reason.code();
    if json {
        let mut value = json!({
            "failure": failure.reason.name(),
            "exit_code": code,
            "message": failure.message,
        });
        if let (Some((id, origin)), Value::Object(fields)) = (&failure.stored, &mut value) {
            fields.insert("id".to_string(), json!(id));
            fields.insert("origin".to_string(), json!(origin.to_string()));
        }
        outln!("{value}")?;
    } else {
        eprintln!("error: {}", failure.message);
        if let Some((id, origin)) = &failure.stored {
            eprintln!("id {id}, origin {origin}");
        }
    }
    Ok(ExitCode::from(code))
}
