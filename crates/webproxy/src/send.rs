//! `webproxy send`: one request through a running service, its reply printed as JSON.

use std::process::ExitCode;

use anyhow::{Context as _, bail};
use webproxy_client::{Client, new_id};
use webproxy_protocol::{HeaderValue, Headers, Outcome, RequestEnvelope};

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
        .with_context(|| format!("cannot connect to NATS at {url}"))?;
    Ok(Client::new(nats, settings.subjects.prefix())?)
}

fn parse_headers(raw: &[String]) -> anyhow::Result<Headers> {
    let mut headers = Headers::new();
    for line in raw {
        let Some((name, value)) = line.split_once(':') else {
            bail!("header {line:?} is not `Name: value`");
        };
        let (name, value) = (name.trim().to_string(), value.trim().to_string());
        match headers.remove(&name) {
            None => headers.insert(name, HeaderValue::One(value)),
            Some(HeaderValue::One(first)) => {
                headers.insert(name, HeaderValue::Many(vec![first, value]))
            }
            Some(HeaderValue::Many(mut all)) => {
                all.push(value);
                headers.insert(name, HeaderValue::Many(all))
            }
        };
    }
    Ok(headers)
}

pub async fn run(args: SendArgs) -> anyhow::Result<ExitCode> {
    let mut envelope = RequestEnvelope {
        id: new_id(),
        method: args.method.clone(),
        url: args.url.clone(),
        headers: parse_headers(&args.headers)?,
        body: args.data.clone(),
        ..Default::default()
    };
    if let Some(path) = &args.data_file {
        let bytes = std::fs::read(path)
            .with_context(|| format!("cannot read --data-file {}", path.display()))?;
        match String::from_utf8(bytes) {
            Ok(text) => envelope.body = Some(text),
            Err(e) => {
                use base64::Engine as _;
                envelope.body_base64 =
                    Some(base64::engine::general_purpose::STANDARD.encode(e.as_bytes()));
            }
        }
    }
    let client = connect(&args.nats).await?;
    let reply = client.request(&args.pool, &envelope, args.timeout).await?;
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
