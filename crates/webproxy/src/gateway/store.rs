//! The gateway's two KV buckets: `<PREFIX>_GATEWAY_KEY`, the shared HMAC key when
//! `[gateway] key` is unset (created once with compare-and-set, no age limit), and
//! `<PREFIX>_GATEWAY`, each minted id's route, token identity and origin, kept for
//! `reply_max_age`. Only gateways write them: callers' accounts cannot reach them.

use anyhow::Context as _;
use async_nats::jetstream::{self, kv};
use serde::{Deserialize, Serialize};
use webproxy_dispatcher::StreamsConfig;
use webproxy_protocol::{Origin, Subjects};

use super::ids::{self, Key};

/// The key's name in `<PREFIX>_GATEWAY_KEY`.
const KEY: &str = "hmac";

/// What the gateway keeps of an id it minted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The route's path.
    pub route: String,
    /// The caller's token identity ([`Key::identity`]).
    pub identity: String,
    /// The conversation: `<STREAM>:<seq>`.
    pub origin: String,
}

impl Record {
    pub fn new(route: &str, identity: &str, origin: &Origin) -> Record {
        Record {
            route: route.into(),
            identity: identity.into(),
            origin: origin.to_string(),
        }
    }

    /// The conversation's origin; only gateways write records, so one that does not
    /// parse is an error, not someone else's.
    pub fn origin(&self) -> anyhow::Result<Origin> {
        self.origin
            .parse()
            .map_err(|e| anyhow::anyhow!("a gateway record's origin {:?}: {e}", self.origin))
    }
}

/// The records bucket.
#[derive(Debug, Clone)]
pub struct Records {
    kv: kv::Store,
}

/// The shared key: read, or created by the first gateway (a create is a
/// compare-and-set on "no value", so gateways starting together agree on one).
pub async fn shared_key(
    js: &jetstream::Context,
    subjects: &Subjects,
    streams: &StreamsConfig,
) -> anyhow::Result<Key> {
    let bucket = subjects.gateway_key_bucket();
    let kv = open_bucket(js, &bucket, streams, std::time::Duration::ZERO).await?;
    for _ in 0..3 {
        if let Some(value) = kv
            .get(KEY)
            .await
            .with_context(|| format!("cannot read the gateway key in {bucket}"))?
        {
            return Ok(Key::new(value.to_vec()));
        }
        let fresh = format!("{}{}", ids::random_hex()?, ids::random_hex()?);
        match kv.create(KEY, fresh.clone().into()).await {
            Ok(_) => return Ok(Key::new(fresh.into_bytes())),
            // Another gateway created it first: read theirs.
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("cannot create the gateway key in {bucket}"));
            }
        }
    }
    anyhow::bail!("the gateway key in {bucket} was created but cannot be read")
}

/// Opens `bucket` (history 1, the streams' replicas, `max_age`, zero for none),
/// created when missing: an identical create is a no-op, so gateways starting
/// together all succeed.
async fn open_bucket(
    js: &jetstream::Context,
    bucket: &str,
    streams: &StreamsConfig,
    max_age: std::time::Duration,
) -> anyhow::Result<kv::Store> {
    js.create_key_value(kv::Config {
        bucket: bucket.to_string(),
        history: 1,
        max_age,
        num_replicas: streams.replicas(),
        ..Default::default()
    })
    .await
    .with_context(|| format!("cannot open the gateway bucket {bucket}"))
}

impl Records {
    /// Opens the bucket, created when missing (an identical create is a no-op).
    pub async fn open(
        js: &jetstream::Context,
        subjects: &Subjects,
        streams: &StreamsConfig,
    ) -> anyhow::Result<Records> {
        let bucket = subjects.gateway_bucket();
        let kv = open_bucket(js, &bucket, streams, streams.reply_max_age()).await?;
        Ok(Records { kv })
    }

    /// The record of `id`, if the gateway minted it (and it has not aged out).
    pub async fn get(&self, id: &str) -> anyhow::Result<Option<Record>> {
        let Some(value) = self
            .kv
            .get(id)
            .await
            .with_context(|| format!("cannot read the record of {id}"))?
        else {
            return Ok(None);
        };
        let record = serde_json::from_slice(&value)
            .with_context(|| format!("the record of {id} is not a gateway record"))?;
        Ok(Some(record))
    }

    /// Stores `record` for `id` unless one is there; returns the record that holds
    /// (a concurrent twin's, when it was first).
    pub async fn create(&self, id: &str, record: &Record) -> anyhow::Result<Record> {
        // `fail-gateway-record`: the bucket refuses every write, as an unwritable
        // one would.
        if webproxy_dispatcher::test_hook("fail-gateway-record") {
            anyhow::bail!("cannot record {id}: test hook fail-gateway-record");
        }
        let record = record.clone();
        let value = serde_json::to_vec(&record)?;
        match self.kv.create(id, value.into()).await {
            Ok(_) => Ok(record),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                Ok(self.get(id).await?.unwrap_or(record))
            }
            Err(e) => Err(e).with_context(|| format!("cannot record {id}")),
        }
    }
}
