//! `webproxy send`: one request through a running service, its reply printed as JSON.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, bail};
use clap::Args;
use webproxy_client::{Outcome, Request};

use crate::operator::{NatsArgs, connect};

#[derive(Debug, Args)]
pub struct SendArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    /// The pool to send to.
    #[arg(long, default_value = "default")]
    pub pool: String,
    /// How long to wait for the reply.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
    /// A request header, `Name: value`; repeat for more.
    #[arg(short = 'H', long = "header", value_name = "HEADER")]
    pub headers: Vec<String>,
    /// The request body.
    #[arg(short = 'd', long = "data", conflicts_with = "data_file")]
    pub data: Option<String>,
    /// Read the request body from a file.
    #[arg(long, value_name = "PATH")]
    pub data_file: Option<PathBuf>,
    /// The caller name: the request goes on `<prefix>.request.<pool>.<caller>`, the
    /// subject NATS permissions let an isolated caller publish on.
    #[arg(long, value_name = "NAME")]
    pub caller: Option<String>,
    /// Have the reply copied to this subject and listen there only (an isolated
    /// caller may read neither `<prefix>.reply.>` nor the stored replies).
    #[arg(long, value_name = "SUBJECT")]
    pub reply_to: Option<String>,
    /// Print the reply on one line.
    #[arg(long)]
    pub json: bool,
    pub method: String,
    pub url: String,
}

pub async fn run(args: SendArgs) -> anyhow::Result<ExitCode> {
    let mut request = Request::new(args.method.clone(), args.url.clone())
        .pool(args.pool.clone())
        .wait(args.timeout);
    for line in &args.headers {
        let Some((name, value)) = line.split_once(':') else {
            bail!("header {line:?} is not `Name: value`");
        };
        request = request.header(name.trim(), value.trim());
    }
    if let Some(text) = &args.data {
        request = request.body(text.clone());
    }
    if let Some(path) = &args.data_file {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read --data-file {}", path.display()))?;
        request = request.body_bytes(bytes);
    }
    if let Some(subject) = &args.reply_to {
        request = request.reply_to(subject.clone());
    }
    let mut client = connect(&args.nats).await?;
    if let Some(caller) = &args.caller {
        client = client.with_caller(caller)?;
    }
    let reply = client.request(&request).await?;
    let printed = if args.json {
        serde_json::to_string(&reply)?
    } else {
        serde_json::to_string_pretty(&reply)?
    };
    outln!("{printed}")?;
    Ok(match reply.outcome {
        Outcome::Response => ExitCode::SUCCESS,
        Outcome::Error => ExitCode::FAILURE,
    })
}
