//! The command line: `serve`, `check-config` and `send`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use webproxy_dispatcher::secrets::{Redactor, Secrets};

use crate::{cfg, send, serve};

#[derive(Debug, Parser)]
#[command(
    name = "webproxy",
    version,
    about = "Reliable outbound HTTP on behalf of other services, over NATS JetStream"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the service.
    Serve {
        /// The configuration file (layered over the built-in defaults).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
    },
    /// Validate a configuration and print the effective pools and rules.
    CheckConfig {
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Send one request through a running service and print its reply.
    Send(SendArgs),
}

/// Options of every subcommand that talks to NATS.
#[derive(Debug, Args)]
pub struct NatsArgs {
    /// The configuration file, for the NATS settings and the subject prefix.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The NATS server URL, overriding the configuration.
    #[arg(long, value_name = "URL")]
    pub nats: Option<String>,
}

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
    /// Print the reply on one line.
    #[arg(long)]
    pub json: bool,
    pub method: String,
    pub url: String,
}

impl Cli {
    /// The service logs its work; the command-line tools only their warnings.
    pub fn default_log_level(&self) -> &'static str {
        match self.command {
            Command::Serve { .. } => "info",
            _ => "warn",
        }
    }

    pub async fn run(self, redactor: Redactor) -> anyhow::Result<ExitCode> {
        match self.command {
            Command::Serve { config } => {
                let settings = cfg::load(config.as_deref())?;
                serve::run(settings, redactor).await?;
                Ok(ExitCode::SUCCESS)
            }
            Command::CheckConfig { config, json } => {
                let settings = cfg::load(config.as_deref())?;
                // Every secret must be readable for the configuration to be valid; the
                // values are never printed.
                Secrets::load(&settings.rules, redactor)
                    .context("invalid configuration: cannot read an injected secret")?;
                cfg::print_effective(&settings, json)?;
                Ok(ExitCode::SUCCESS)
            }
            Command::Send(args) => send::run(args).await,
        }
    }
}
