//! `webproxy send`: one request through a running service, its reply printed as JSON.

use std::process::ExitCode;

use anyhow::{Context as _, bail};
use webproxy_client::{Client, Outcome, Request};

use crate::cfg;
use crate::cli::{NatsArgs, SendArgs};

/// Connects as the configuration (or `--nats`) says; returns the client and prefix.
pub async fn connect(args: &NatsArgs) -> anyhow::Result<Client> {
    let settings = cfg::load(args.config.as_deref())?;
    let url = args
        .nats
        .clone()
        .unwrap_or_else(|| settings.config.nats.url.clone());
    let urls: Vec<String> = url.split(',').map(|u| u.trim().to_string()).collect();
    let nats = webproxy_dispatcher::nats_auth::connect_options(&settings.config.nats)
        .await
        .context("cannot read the NATS credentials")?
        .connect(urls)
        .await
        .with_context(|| {
            format!(
                "cannot connect to NATS at {}",
                webproxy_dispatcher::nats_auth::redact_url_credentials(&url)
            )
        })?;
    Ok(Client::new(nats, settings.subjects.prefix())?)
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
    let client = connect(&args.nats).await?;
    let reply = client.request(&request).await?;
    let printed = if args.json {
        serde_json::to_string(&reply)?
    } else {
        serde_json::to_string_pretty(&reply)?
    };
    println!("{printed}");
    Ok(match reply.outcome {
        Outcome::Response => ExitCode::SUCCESS,
        Outcome::Error => ExitCode::FAILURE,
    })
}
