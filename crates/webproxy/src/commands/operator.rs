//! What the commands that talk to a running deployment share (`send`, `pools`,
//! `dead`, `cancel`, `config`): their NATS options, connecting, reading a stream to its end, and an outlet
//! into the dispatcher's own settle and replay code.

use std::ops::ControlFlow;
use std::path::PathBuf;

use anyhow::Context as _;
use async_nats::jetstream::{self, consumer};
use clap::Args;
use futures::StreamExt as _;
use webproxy_client::Client;
use webproxy_dispatcher::Operator;
use webproxy_protocol::Subjects;

use crate::config::connection::{self, ConnectionArgs};
use crate::config::load;
use crate::config::schema::Settings;

/// Options of every subcommand that talks to NATS.
#[derive(Debug, Args)]
pub(crate) struct NatsArgs {
    /// The configuration file, for the NATS settings and the subject prefix.
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) connection: ConnectionArgs,
}

/// Connects as the flags, the nats CLI's variables and the configuration say (see
/// `connection` for the precedence); returns the client, which knows the prefix.
pub(crate) async fn connect(args: &NatsArgs) -> anyhow::Result<Client> {
    Ok(connect_with_settings(args).await?.0)
}

/// [`connect`], and the configuration it read (`config push` validates documents
/// with its `[streams]`).
pub(crate) async fn connect_with_settings(args: &NatsArgs) -> anyhow::Result<(Client, Settings)> {
    let settings = load::load(
        args.config.as_deref(),
        &connection::overrides(&args.connection)?,
    )?;
    for warning in &settings.environment_warnings {
        tracing::warn!("{warning}");
    }
    let nats_config = &settings.config.nats;
    let nats = crate::config::nats_auth::connect_options(nats_config)
        .await
        .context("cannot read the NATS credentials")?
        .connect(nats_config.urls())
        .await
        .with_context(|| {
            format!(
                "cannot connect to NATS at {}",
                crate::config::nats_auth::redact_url_credentials(&nats_config.url)
            )
        })?;
    let mut client = Client::new(nats, settings.dispatcher.subjects.prefix())?;
    if let Some(prefix) = &nats_config.js_api_prefix {
        client = client.with_js_api_prefix(prefix);
    }
    Ok((client, settings))
}

/// Hands every message `reader` has now to `each`, in batches, until `each` breaks or
/// the reader has no more; returns how many `each` was given. `fetch` returns what is
/// there without waiting, so an empty batch is the end. A batch holds at most 500
/// messages and twice `max_payload` bytes (at least 4 MiB), which bounds the memory a
/// reader of a large stream needs: a message is at most `max_payload`, so one always
/// fits.
pub(crate) async fn for_each_message(
    reader: &consumer::PullConsumer,
    max_payload: usize,
    mut each: impl AsyncFnMut(jetstream::Message) -> anyhow::Result<ControlFlow<()>>,
) -> anyhow::Result<u64> {
    let mut count = 0;
    loop {
        let mut batch = reader
            .fetch()
            .max_messages(500)
            .max_bytes(batch_bytes(max_payload))
            .messages()
            .await
            .context("cannot read from the stream")?;
        let mut got = 0;
        while let Some(message) = batch.next().await {
            let message = match message {
                Ok(message) => message,
                // The server ends a batch whose next message would not fit that way.
                Err(e) if got > 0 && is_batch_full(&e.to_string()) => break,
                Err(e) => anyhow::bail!("cannot read a message: {e}"),
            };
            got += 1;
            count += 1;
            if each(message).await?.is_break() {
                return Ok(count);
            }
        }
        if got == 0 {
            return Ok(count);
        }
    }
}

/// Whether a fetch's error is the server saying that the batch's byte limit is reached:
/// a `409 Message Size Exceeds MaxBytes` status, which async-nats reports as an error.
fn is_batch_full(error: &str) -> bool {
    error.contains("Message Size Exceeds MaxBytes")
}

/// The most bytes one fetch asks for. The server refuses a fetch whose byte limit is
/// below the next message's size (subject and headers included), so the limit leaves
/// room above `max_payload`.
fn batch_bytes(max_payload: usize) -> usize {
    const AT_LEAST: usize = 4 << 20;
    max_payload.saturating_mul(2).max(AT_LEAST)
}

/// The operator API for the commands, which end or replay conversations through the
/// service's own code. The CLI loads no secrets: what it publishes is what the callers
/// sent. `subjects` are the configuration's (`--config`): its `reply_to_allow` decides
/// which `reply_to` of a request the CLI ends gets a copy, as the service's would;
/// without a configuration only `_INBOX.` subjects do.
pub(crate) async fn operator(client: &Client, subjects: &Subjects) -> anyhow::Result<Operator> {
    let js = client.jetstream().clone();
    let bucket = client.subjects().progress_bucket();
    let progress = js.get_key_value(&bucket).await.with_context(|| {
        format!("cannot open the progress bucket {bucket} (has `webproxy serve` run?)")
    })?;
    Ok(Operator::new(
        client.nats().clone(),
        subjects.clone(),
        progress,
    ))
}

#[cfg(test)]
mod tests {
    use super::{batch_bytes, is_batch_full};

    #[test]
    fn a_batch_always_has_room_for_the_largest_message() {
        assert_eq!(batch_bytes(1 << 20), 4 << 20);
        assert_eq!(batch_bytes(8 << 20), 16 << 20);
        assert_eq!(batch_bytes(usize::MAX), usize::MAX);
    }

    #[test]
    fn only_the_byte_limit_status_ends_a_batch_early() {
        assert!(is_batch_full(
            "error while processing messages from the stream: 409, Some(\"Message Size Exceeds MaxBytes\")"
        ));
        assert!(!is_batch_full(
            "error while processing messages from the stream: 409, Some(\"Consumer Deleted\")"
        ));
    }
}
