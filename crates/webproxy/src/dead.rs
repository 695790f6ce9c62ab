//! `webproxy dead list` and `webproxy dead replay`: read the dead-letter stream, and
//! replay failed conversations as a new generation from their origin, through the
//! dispatcher's own replay. Dead letters stay where they are, as an audit trail.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, consumer};
use serde::Serialize;
use webproxy_client::Client;
use webproxy_dispatcher::ReplayError;
use webproxy_protocol::DeadLetter;

use crate::operator::{NatsArgs, connect, for_each_message, operator_outlet};

/// One stored dead letter.
#[derive(Debug, Serialize)]
pub struct StoredLetter {
    pub sequence: u64,
    /// RFC 3339, when it was stored.
    pub stored_at: String,
    #[serde(flatten)]
    pub letter: DeadLetter,
}

/// Every dead letter, of one pool or all, oldest first.
pub async fn read_letters(
    client: &Client,
    pool: Option<&str>,
) -> anyhow::Result<Vec<StoredLetter>> {
    let subjects = client.subjects();
    let js = jetstream::new(client.nats().clone());
    let stream = js
        .get_stream(subjects.dead_stream())
        .await
        .with_context(|| format!("cannot open stream {}", subjects.dead_stream()))?;
    let filter = pool.map_or_else(|| subjects.dead_wildcard(), |p| subjects.dead(p));
    // An ephemeral consumer that acks nothing reads without changing the stream.
    let reader: consumer::PullConsumer = stream
        .create_consumer(consumer::pull::Config {
            filter_subject: filter,
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .context("cannot create a reader on the dead-letter stream")?;
    let mut letters = Vec::new();
    for_each_message(&reader, async |message| {
        let info = message
            .info()
            .map_err(|e| anyhow::anyhow!("dead letter without metadata: {e}"))?;
        let (sequence, stored_at) = (
            info.stream_sequence,
            info.published
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default(),
        );
        match serde_json::from_slice::<DeadLetter>(&message.payload) {
            Ok(letter) => letters.push(StoredLetter {
                sequence,
                stored_at,
                letter,
            }),
            Err(e) => eprintln!("warning: dead letter {sequence} is not readable: {e}"),
        }
        Ok(())
    })
    .await?;
    Ok(letters)
}

pub async fn list(args: &NatsArgs, pool: Option<&str>, json: bool) -> anyhow::Result<()> {
    let client = connect(args).await?;
    let letters = read_letters(&client, pool).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&letters)?);
        return Ok(());
    }
    if letters.is_empty() {
        println!("no dead letters");
        return Ok(());
    }
    println!(
        "{:>6}  {:<25}  {:<12}  {:<24}  {:<4}  {:<18}  message",
        "seq", "stored", "pool", "id", "gen", "code"
    );
    for stored in &letters {
        let letter = &stored.letter;
        println!(
            "{:>6}  {:<25}  {:<12}  {:<24}  {:<4}  {:<18}  {}",
            stored.sequence,
            stored.stored_at,
            letter.pool,
            letter.id.as_deref().unwrap_or("-"),
            letter.generation,
            letter.error.code.as_str(),
            letter.error.message
        );
    }
    Ok(())
}

/// What a replay did with one conversation.
#[derive(Debug, Serialize)]
struct Replayed {
    id: Option<String>,
    origin: String,
    pool: String,
    generation: u64,
}

pub async fn replay(
    args: &NatsArgs,
    pool: Option<&str>,
    id: Option<&str>,
    json: bool,
) -> anyhow::Result<()> {
    let client = connect(args).await?;
    let letters = read_letters(&client, pool).await?;
    // The newest letter of each conversation (its origin) is the one to replay: it has
    // the highest generation, and the next one starts above it.
    let mut latest: BTreeMap<&str, &StoredLetter> = BTreeMap::new();
    let mut skipped = Vec::new();
    for stored in &letters {
        let letter = &stored.letter;
        if id.is_some_and(|wanted| letter.id.as_deref() != Some(wanted)) {
            continue;
        }
        let Some(origin) = letter.origin.as_deref() else {
            skipped.push(format!(
                "seq {}: no origin (the payload was not a request, or an older webproxy stored it)",
                stored.sequence
            ));
            continue;
        };
        let entry = latest.entry(origin).or_insert(stored);
        if (letter.generation, stored.sequence) > (entry.letter.generation, entry.sequence) {
            *entry = stored;
        }
    }
    if let Some(wanted) = id
        && latest.is_empty()
    {
        bail!(
            "no dead letter for id {wanted:?}{}",
            pool.map(|p| format!(" in pool {p}")).unwrap_or_default()
        );
    }
    let outlet = operator_outlet(&client).await?;
    let mut replayed = Vec::new();
    for (origin, stored) in latest {
        let letter = &stored.letter;
        match outlet.replay(letter).await {
            Ok(generation) => replayed.push(Replayed {
                id: letter.id.clone(),
                origin: origin.to_string(),
                pool: letter.pool.clone(),
                generation,
            }),
            Err(e @ (ReplayError::Progress(_) | ReplayError::Publish(_))) => {
                return Err(e).with_context(|| format!("cannot replay {origin}"));
            }
            Err(e) => skipped.push(format!("{origin}: {e}")),
        }
    }
    if json {
        println!(
            "{}",
            serde_json::json!({"replayed": replayed, "skipped": skipped})
        );
    } else {
        for r in &replayed {
            println!(
                "replayed {} ({}) to pool {} as generation {}",
                r.id.as_deref().unwrap_or("-"),
                r.origin,
                r.pool,
                r.generation
            );
        }
        for s in &skipped {
            println!("skipped {s}");
        }
        println!("{} replayed, {} skipped", replayed.len(), skipped.len());
    }
    Ok(())
}
