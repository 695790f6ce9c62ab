//! The command line: `serve`, `gateway`, `check-config`, `send` and the operator commands
//! (`pools`, `dead`, `cancel`, `config`, `gateway key`).

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use webproxy_config::Redactor;

use crate::commands::cancel::{self, CancelArgs};
use crate::commands::config::ConfigCommand;
use crate::commands::dead;
use crate::commands::gateway;
use crate::commands::operator::NatsArgs;
use crate::commands::pools;
use crate::commands::send;
use crate::commands::send::SendArgs;
use crate::commands::serve;
use crate::config::connection::{self, ConnectionArgs};
use crate::config::load;
use crate::config::nats_auth;
use crate::config::schema::Settings;
use crate::telemetry;

#[derive(Debug, Parser)]
#[command(
    name = "webproxy",
    version,
    about = "Reliable outbound HTTP on behalf of other services, over NATS JetStream"
)]
pub(crate) struct Cli {
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
        #[command(flatten)]
        connection: ConnectionArgs,
    },
    /// Run the HTTP gateway: callers with no NATS client send HTTP requests to its
    /// routes, which go through the pools like any request envelope.
    #[command(args_conflicts_with_subcommands = true)]
    Gateway {
        #[command(subcommand)]
        command: Option<GatewayCommand>,
        /// The configuration file; `[gateway]` holds the gateway's own settings.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        #[command(flatten)]
        connection: ConnectionArgs,
    },
    /// Validate a configuration as `serve` would before it starts (or `gateway`, with
    /// --gateway) and print the effective pools and rules.
    CheckConfig {
        /// The configuration file (layered over the built-in defaults), as `serve` and
        /// `gateway` take it.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Validate this cluster document (what `config push` takes) in place of the
        /// configuration's cluster sections.
        #[arg(long, value_name = "FILE")]
        document: Option<PathBuf>,
        /// Check what `webproxy gateway` checks before it starts (its routes' tokens,
        /// its key and TLS files) rather than what `serve` does.
        #[arg(long)]
        gateway: bool,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Send one request through a running service and print its reply.
    Send(SendArgs),
    /// Each pool's limit, waiting, in-flight and parked messages, and oldest wait.
    #[command(args_conflicts_with_subcommands = true)]
    Pools {
        #[command(subcommand)]
        command: Option<PoolsCommand>,
        #[command(flatten)]
        nats: NatsArgs,
        /// Print one JSON array, an object a pool: `pool`, `max_in_flight`, `waiting`,
        /// `in_flight`, `parked`, `oldest_waiting_ms` (null when none waits),
        /// `breaker` (closed, open or half_open), `adaptive_limit` (null without one)
        /// and `pauses` (each with `cause`, `until` and `reason`).
        #[arg(long)]
        json: bool,
    },
    /// List or replay dead letters: conversations that ended in an error.
    Dead {
        #[command(subcommand)]
        command: DeadCommand,
    },
    /// Cancel a conversation by its origin alone, as an operator: an attempt in flight
    /// is dropped, and its reply (and dead letter) says `cancelled`. Waits up to 5 s for
    /// a webproxy instance's answer and prints it: `recorded`, `finished` (it has its
    /// final reply already, which stays; exit 0 both) or `unknown` (exit 5).
    Cancel(CancelArgs),
    /// The cluster part of the configuration in the KV bucket <PREFIX>_CONFIG, which
    /// instances with [config] source = "kv" run on.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

#[derive(Debug, Subcommand)]
enum GatewayCommand {
    /// The gateways' shared HMAC key in the bucket <PREFIX>_GATEWAY_KEY: save it, put
    /// a saved one back, or make a new one. A gateway makes none by itself once its
    /// deployment has had one.
    Key {
        #[command(subcommand)]
        command: gateway::KeyCommand,
    },
}

#[derive(Debug, Subcommand)]
enum PoolsCommand {
    /// Delete a pool's stream and consumers. Refused for a pool that does not exist, or
    /// that the running configuration still has (the bucket's document, or a live
    /// instance's heartbeat), unless --force; and while messages wait in it, unless
    /// --dead-letter, which answers and dead-letters them first.
    Remove {
        /// The pool, as the configuration names it (`[pools.NAME]`).
        name: String,
        #[command(flatten)]
        nats: NatsArgs,
        /// End the pool's waiting messages with an `internal` error and dead-letter them.
        #[arg(long)]
        dead_letter: bool,
        /// Remove it even though the running configuration still has it: its
        /// instances then answer its requests `internal` until it is taken out of
        /// their configuration, and do not recreate it.
        #[arg(long)]
        force: bool,
    },
    /// Stop a pool's deliveries on every instance, through consumer pause: requests keep
    /// waiting in its stream. Other pauses (an upstream's Retry-After) keep their own ends.
    Pause {
        /// The pool, as the configuration names it (`[pools.NAME]`).
        name: String,
        #[command(flatten)]
        nats: NatsArgs,
        /// How long, e.g. 10m; without it, until `pools resume`.
        #[arg(long = "for", value_parser = humantime::parse_duration)]
        duration: Option<std::time::Duration>,
        /// Why, shown by `webproxy pools`.
        #[arg(long)]
        reason: Option<String>,
    },
    /// End a pool's pause by hand; a pause of another cause stays until its end.
    Resume {
        /// The pool, as the configuration names it (`[pools.NAME]`).
        name: String,
        #[command(flatten)]
        nats: NatsArgs,
    },
}

#[derive(Debug, Subcommand)]
enum DeadCommand {
    /// List dead letters, oldest first: a table, printed once every letter is read, or
    /// with --json one array, printed as the letters are read.
    List {
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        selection: dead::Selection,
        /// Print one JSON array, a letter a line, as the letters are read. Each letter
        /// is the stored dead letter's fields (`pool`, `id`, `generation`, `origin`,
        /// `error`, `attempts`, `envelope`, ...) with `stream`, `sequence` and
        /// `stored_at` (RFC 3339).
        #[arg(long)]
        json: bool,
    },
    /// Republish dead-lettered conversations as fresh requests: the same id, a new
    /// generation, a new attempt budget. The dead letters stay. Each letter is replayed
    /// once; --again replays one that was, as a further generation.
    Replay {
        #[command(flatten)]
        nats: NatsArgs,
        #[command(flatten)]
        args: dead::ReplayArgs,
    },
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Runtime::new().context("cannot start the async runtime")
}

/// Runs a long-lived command (`serve`, `gateway`) with the service's logging and
/// telemetry, set up inside the async runtime (the gRPC exporter needs it) and
/// flushed before the runtime ends.
fn run_service<F>(
    config: Option<PathBuf>,
    flags: &ConnectionArgs,
    command: impl FnOnce(Settings, Redactor) -> F,
) -> anyhow::Result<ExitCode>
where
    F: Future<Output = anyhow::Result<()>>,
{
    let settings = load::load(config.as_deref(), &connection::overrides(flags)?)?;
    // Shared with the logger, which redacts the secrets the command loads.
    let redactor = Redactor::default();
    let runtime = runtime()?;
    // Declared after the runtime, so dropped (flushing spans) before it.
    let _telemetry = {
        let _entered = runtime.enter();
        telemetry::init_service(
            &settings.config.log,
            &settings.config.telemetry,
            redactor.clone(),
        )?
    };
    runtime.block_on(command(settings, redactor))?;
    Ok(ExitCode::SUCCESS)
}

impl Cli {
    /// Runs the command. The service's telemetry is set up inside the async runtime
    /// (the gRPC exporter needs it) and flushed before the runtime ends.
    pub(crate) fn run(self) -> anyhow::Result<ExitCode> {
        match self.command {
            Command::Serve {
                config,
                connection: flags,
            } => run_service(config, &flags, serve::run),
            Command::Gateway {
                command: None,
                config,
                connection: flags,
            } => run_service(config, &flags, gateway::run),
            Command::CheckConfig {
                config,
                document,
                gateway,
                json,
            } => {
                // What serve would run on in this environment: NATS_URL and the
                // other nats CLI variables apply, as they do to serve.
                let overrides = connection::overrides(&ConnectionArgs::default())?;
                let mut settings = load::load(config.as_deref(), &overrides)?;
                if let Some(path) = document {
                    let text = std::fs::read_to_string(&path)
                        .with_context(|| format!("cannot read {}", path.display()))?;
                    let (document, dispatcher) =
                        crate::config::document::validate(&text, &settings.config.streams)
                            .with_context(|| format!("invalid document {}", path.display()))?;
                    settings = settings.with_document(document, dispatcher);
                }
                // What the process checks before it starts, by the very function it
                // uses: `check-config` refuses exactly what it would. The values are
                // never printed.
                // The [nats] files as both read them before connecting (a
                // credentials file that is readable but no credentials passes
                // `load::load`).
                runtime()?
                    .block_on(nats_auth::connect_options(&settings.config.nats))
                    .context("invalid configuration: the [nats] settings cannot connect")?;
                if gateway {
                    gateway::load_secrets(&settings)
                        .context("invalid configuration: `webproxy gateway` would not start")?;
                } else {
                    serve::load_secrets(&settings, &Redactor::default())
                        .context("invalid configuration: `webproxy serve` would not start")?;
                }
                load::print_effective(&settings, &settings.warnings(), json)?;
                Ok(ExitCode::SUCCESS)
            }
            command => {
                let _telemetry = telemetry::init_cli();
                runtime()?.block_on(run_tool(command))
            }
        }
    }
}

async fn run_tool(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Send(args) => send::run(args).await,
        Command::Pools {
            command,
            nats,
            json,
        } => {
            match command {
                None => pools::list(&nats, json).await?,
                Some(PoolsCommand::Remove {
                    name,
                    nats,
                    dead_letter,
                    force,
                }) => pools::remove(&nats, &name, dead_letter, force).await?,
                Some(PoolsCommand::Pause {
                    name,
                    nats,
                    duration,
                    reason,
                }) => pools::pause(&nats, &name, duration, reason).await?,
                Some(PoolsCommand::Resume { name, nats }) => pools::resume(&nats, &name).await?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Dead { command } => {
            match command {
                DeadCommand::List {
                    nats,
                    selection,
                    json,
                } => dead::list(&nats, &selection, json).await?,
                DeadCommand::Replay { nats, args } => dead::replay(&nats, &args).await?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Cancel(args) => cancel::run(args).await,
        Command::Config { command } => {
            crate::commands::config::run(command).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Gateway {
            command: Some(GatewayCommand::Key { command }),
            ..
        } => {
            gateway::run_key_command(command).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve { .. }
        | Command::Gateway { command: None, .. }
        | Command::CheckConfig { .. } => {
            unreachable!("handled before the runtime starts")
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    use super::Cli;

    /// Every argument of every command says what it is in `--help` (issue 31 found
    /// `<NAME>` and `--config` with nothing beside them); the snapshots in
    /// `tests/cmd/` show the texts.
    #[test]
    fn every_argument_has_help() {
        fn walk(command: &clap::Command, path: &str, missing: &mut Vec<String>) {
            for arg in command.get_arguments() {
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{path} {}", arg.get_id()));
                }
            }
            for sub in command.get_subcommands() {
                walk(sub, &format!("{path} {}", sub.get_name()), missing);
            }
        }
        let mut command = Cli::command();
        // Builds the generated --help and --version arguments, which carry their texts.
        command.build();
        let mut missing = Vec::new();
        walk(&command, "webproxy", &mut missing);
        assert!(missing.is_empty(), "arguments without help: {missing:?}");
    }
}
