//! What the commands that talk to a running deployment share (`send`, `pools`,
//! `dead`, `config`): their NATS options, connecting, reading a stream to its end, and an outlet
//! into the dispatcher's own settle and replay code.

use std::path::PathBuf;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer};
use clap::Args;
use futures::StreamExt as _;
use webproxy_client::Client;
use webproxy_dispatcher::Outlet;

use crate::cfg;
use crate::config::Settings;
use crate::connection::{self, ConnectionArgs};

/// Options of every subcommand that talks to NATS.
#[derive(Debug, Args)]
pub struct NatsArgs {
    /// The configuration file, for the NATS settings and the subject prefix.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub connection: ConnectionArgs,
}

/// Connects as the flags, the nats CLI's variables and the configuration say (see
/// `connection` for the precedence); returns the client, which knows the prefix.
pub async fn connect(args: &NatsArgs) -> anyhow::Result<Client> {
    Ok(connect_with_settings(args).await?.0)
}

/// [`connect`], and the configuration it read (`config push` validates documents
/// with its `[streams]`).
pub async fn connect_with_settings(args: &NatsArgs) -> anyhow::Result<(Client, Settings)> {
    let settings = cfg::load(
        args.config.as_deref(),
        &connection::overrides(&args.connection)?,
    )?;
    for warning in &settings.environment_warnings {
        tracing::warn!("{warning}");
    }
    let nats_config = &settings.config.nats;
    let nats = crate::nats_auth::connect_options(nats_config)
        .await
        .context("cannot read the NATS credentials")?
        .connect(nats_config.urls())
        .await
        .with_context(|| {
            format!(
                "cannot connect to NATS at {}",
                crate::nats_auth::redact_url_credentials(&nats_config.url)
            )
        })?;
    let client = Client::new(nats, settings.dispatcher.subjects.prefix())?;
    Ok((client, settings))
}

/// Hands every message `reader` has now to `each`, in batches, and returns how many
/// there were. `fetch` returns what is there without waiting, so an empty batch is
/// the end.
pub async fn for_each_message(
    reader: &consumer::PullConsumer,
    mut each: impl AsyncFnMut(jetstream::Message) -> anyhow::Result<()>,
) -> anyhow::Result<u64> {
    let mut count = 0;
    loop {
        let mut batch = reader
            .fetch()
            .max_messages(500)
            .messages()
            .await
            .context("cannot read from the stream")?;
        let mut got = 0;
        while let Some(message) = batch.next().await {
            let message = message.map_err(|e| anyhow::anyhow!("cannot read a message: {e}"))?;
            got += 1;
            each(message).await?;
        }
        if got == 0 {
            return Ok(count);
        }
        count += got;
    }
}

/// An outlet for the operator commands, which end or replay conversations through
/// the service's own code. The CLI loads no secrets: what it publishes is what the
/// callers sent.
pub async fn operator_outlet(client: &Client) -> anyhow::Result<Outlet> {
    let js = jetstream::new(client.nats().clone());
    let bucket = client.subjects().progress_bucket();
    let progress = js.get_key_value(&bucket).await.with_context(|| {
        format!("cannot open the progress bucket {bucket} (has `webproxy serve` run?)")
    })?;
    Ok(Outlet::operator(
        client.nats().clone(),
        client.subjects().clone(),
        progress,
    ))
}
