//! The gateway's two KV buckets, declared with the service's in the dispatcher's
//! `state.rs` and reached through its `StateBucket`: `<PREFIX>_GATEWAY_KEY`, the shared
//! HMAC key when `[gateway] key` is unset, and `<PREFIX>_GATEWAY`, each minted id's
//! route, token identity, origin and message id (and a keyed id's request
//! fingerprint), kept for `reply_max_age`. The records bucket is
//! made again when the server confirms it gone; the key bucket never is, and the key is
//! made by a gateway only on a deployment's first start (neither bucket there), else
//! only by `webproxy gateway key rotate` or `restore`. Only gateways and operators
//! write them: callers' accounts cannot reach them.

use anyhow::Context as _;
use async_nats::jetstream::{self, kv};
use serde::{Deserialize, Serialize};
use webproxy_config::StreamsConfig;
use webproxy_jetstream::state::{Bucket, BucketError, StateBucket};
use webproxy_protocol::{Origin, Subjects};

use super::ids::{self, Fingerprint, Key};

/// The key's name in `<PREFIX>_GATEWAY_KEY`.
const KEY: &str = "hmac";

/// What the gateway keeps of an id it minted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Record {
    /// The route's path.
    pub(crate) route: String,
    /// The caller's token identity ([`Key::identity`]).
    pub(crate) identity: String,
    /// The conversation: `<STREAM>:<seq>`.
    pub(crate) origin: String,
    /// A keyed id's request, which a retry with the key must repeat. Absent for a
    /// random id, and in records written before gateways kept it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) request: Option<Fingerprint>,
    /// The request's `Nats-Msg-Id`: the capability `body.get` and `cancel` ask for,
    /// so a poll can stream a stored body and a `DELETE` can take the request back.
    /// Kept for every request (only gateways and operators read this bucket); absent
    /// in records written by gateways that kept it only for `large_bodies` routes, or
    /// not at all (older gateways ignore it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) msg_id: Option<String>,
}

impl Record {
    pub(crate) fn new(
        route: &str,
        identity: &str,
        origin: &Origin,
        request: Option<&Fingerprint>,
    ) -> Record {
        Record {
            route: route.into(),
            identity: identity.into(),
            origin: origin.to_string(),
            request: request.cloned(),
            msg_id: None,
        }
    }

    /// The conversation's origin; only gateways write records, so one that does not
    /// parse is an error, not someone else's.
    pub(crate) fn origin(&self) -> anyhow::Result<Origin> {
        self.origin
            .parse()
            .map_err(|e| anyhow::anyhow!("a gateway record's origin {:?}: {e}", self.origin))
    }
}

/// `op` on the bucket; after a failure the handle is dropped and `op` tried once more
/// on the bucket looked up again, so that a bucket deleted by hand is found gone
/// (10059) at once, and made again when it may be. A confirmed loss is returned as the
/// [`BucketError`] itself, for [`KeyBucket::read`] to tell it apart.
async fn on_bucket<T, E, F, Fut>(bucket: &StateBucket, what: &str, op: F) -> anyhow::Result<T>
where
    F: Fn(kv::Store) -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::error::Error + Send + Sync + 'static,
{
    let store = bucket.store().await?;
    match op(store).await {
        Ok(value) => Ok(value),
        Err(first) => {
            tracing::debug!(bucket = bucket.spec().name, error = %first, "{what} failed; looking the bucket up again");
            bucket.reopen().await;
            let store = bucket.store().await?;
            op(store)
                .await
                .with_context(|| format!("{what} in {}", bucket.spec().name))
        }
    }
}

/// What `<PREFIX>_GATEWAY_KEY` holds, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum KeyEntry {
    /// The server confirmed the bucket gone (10059).
    BucketGone,
    /// The bucket holds no key and never did: no value and no delete marker.
    Never,
    /// The key was deleted or purged: its marker is there.
    Removed,
    /// The key, and its revision (for a compare-and-set replacement).
    Value { key: Vec<u8>, revision: u64 },
}

/// Why a gateway has no key: what `/readyz` and refused requests say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyLoss {
    BucketGone,
    Removed,
    /// An empty key bucket beside an existing records bucket: not a first start.
    Empty,
}

impl KeyLoss {
    /// One line naming the bucket and the commands that end the loss.
    pub(crate) fn describe(self, bucket: &str) -> String {
        let what = match self {
            KeyLoss::BucketGone => format!("the gateway key's bucket {bucket} is gone"),
            KeyLoss::Removed => format!("the gateway key in the bucket {bucket} was deleted"),
            KeyLoss::Empty => format!(
                "the bucket {bucket} holds no gateway key, though the gateway's records exist"
            ),
        };
        format!(
            "{what}: requests that need the key (an Idempotency-Key, a route's token) are refused, \
             and the gateway makes no new key by itself; restore the saved one with \
             `webproxy gateway key restore --from FILE` (saved by `webproxy gateway key export`), \
             or make a new one with `webproxy gateway key rotate`"
        )
    }
}

/// What a starting gateway does about the key (pure): use the one there; make one
/// only on a deployment's first start, when neither bucket exists (or the key bucket
/// was made and never written, by a first start cut short); otherwise the key is
/// lost, and only an operator makes or restores it. A key bucket and a records bucket
/// both lost look like a first start, and a new key is made then: the records it would
/// serve are gone with their bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AtStart {
    Use(Vec<u8>),
    Create,
    Lost(KeyLoss),
}

pub(crate) fn at_start(entry: KeyEntry, records_exist: bool) -> AtStart {
    if !records_exist && matches!(entry, KeyEntry::BucketGone | KeyEntry::Never) {
        return AtStart::Create;
    }
    match running(entry) {
        Ok(key) => AtStart::Use(key),
        Err(loss) => AtStart::Lost(loss),
    }
}

/// The key a running gateway uses (pure): the one in the bucket, or why there is none.
/// A gateway that has had a key never makes one.
pub(crate) fn running(entry: KeyEntry) -> Result<Vec<u8>, KeyLoss> {
    match entry {
        KeyEntry::Value { key, .. } => Ok(key),
        KeyEntry::BucketGone => Err(KeyLoss::BucketGone),
        KeyEntry::Removed => Err(KeyLoss::Removed),
        KeyEntry::Never => Err(KeyLoss::Empty),
    }
}

/// `<PREFIX>_GATEWAY_KEY`.
#[derive(Debug, Clone)]
pub(crate) struct KeyBucket {
    bucket: StateBucket,
}

/// What installing a key did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Installed {
    /// There was none: the bucket (made if missing) holds it now.
    Made,
    /// The bucket held this very key.
    Unchanged,
    /// Another key was replaced (compare-and-set on the one read).
    Replaced,
}

impl KeyBucket {
    pub(crate) fn new(
        js: &jetstream::Context,
        subjects: &Subjects,
        streams: &StreamsConfig,
    ) -> KeyBucket {
        KeyBucket {
            bucket: StateBucket::new(js.clone(), Bucket::GatewayKey.spec(subjects, streams)),
        }
    }

    /// The bucket's name.
    pub(crate) fn name(&self) -> &str {
        &self.bucket.spec().name
    }

    /// What the bucket holds; an error when it cannot be read (the API down), which
    /// says nothing about the key.
    pub(crate) async fn read(&self) -> anyhow::Result<KeyEntry> {
        let entry = match on_bucket(&self.bucket, "reading the gateway key", |kv| async move {
            kv.entry(KEY).await
        })
        .await
        {
            Ok(entry) => entry,
            Err(e) if matches!(e.downcast_ref(), Some(BucketError::Lost { .. })) => {
                return Ok(KeyEntry::BucketGone);
            }
            Err(e) => return Err(e),
        };
        Ok(match entry {
            None => KeyEntry::Never,
            Some(entry) if entry.operation == kv::Operation::Put => KeyEntry::Value {
                key: entry.value.to_vec(),
                revision: entry.revision,
            },
            Some(_) => KeyEntry::Removed,
        })
    }

    /// The key a starting gateway uses, or why it has none (see [`at_start`]).
    pub(crate) async fn at_start(&self, records: &Records) -> anyhow::Result<Result<Key, KeyLoss>> {
        // The records first: a gateway making the key on a first start makes them
        // after it, so one starting beside it sees either no records or the key.
        let records_exist = records.exists().await?;
        let entry = self.read().await?;
        match at_start(entry.clone(), records_exist) {
            AtStart::Use(key) => Ok(Ok(Key::new(key))),
            AtStart::Lost(loss) => Ok(Err(loss)),
            AtStart::Create => {
                // Gateways starting together each try to make one: compare-and-set
                // keeps the first, which all read.
                self.make(&entry, &fresh_key()?).await?;
                Ok(running(self.read().await?).map(Key::new))
            }
        }
    }

    /// Writes `key` where `entry` (just read) shows none, making the bucket if it is
    /// gone; false when a key was written meanwhile (compare-and-set on "no value").
    async fn make(&self, entry: &KeyEntry, key: &[u8]) -> anyhow::Result<bool> {
        let kv = if *entry == KeyEntry::BucketGone {
            self.bucket.create().await?
        } else {
            self.bucket.store().await?
        };
        match kv.create(KEY, bytes::Bytes::copy_from_slice(key)).await {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(false),
            Err(e) => {
                Err(e).with_context(|| format!("cannot write the gateway key in {}", self.name()))
            }
        }
    }

    /// Writes `key`: made (with the bucket, if missing) when there is none; another
    /// key is replaced only when `replace`, with compare-and-set on the one read.
    pub(crate) async fn install(&self, key: &[u8], replace: bool) -> anyhow::Result<Installed> {
        let name = self.name();
        // A key written between the read and the write is read again, twice at most.
        for _ in 0..3 {
            match self.read().await? {
                KeyEntry::Value { key: held, .. } if held == key => {
                    return Ok(Installed::Unchanged);
                }
                KeyEntry::Value { revision, .. } => {
                    anyhow::ensure!(
                        replace,
                        "the bucket {name} holds another key: replacing it changes every keyed id and token identity, so ids minted under it are no longer served; pass --yes to replace it"
                    );
                    let kv = self.bucket.store().await?;
                    kv.update(KEY, bytes::Bytes::copy_from_slice(key), revision)
                        .await
                        .with_context(|| {
                            format!("cannot replace the gateway key in {name} (changed meanwhile?)")
                        })?;
                    return Ok(Installed::Replaced);
                }
                entry => {
                    if self.make(&entry, key).await? {
                        return Ok(Installed::Made);
                    }
                }
            }
        }
        anyhow::bail!("the gateway key in {name} keeps changing; try again")
    }
}

/// A new random key: 256 bits from the operating system's CSPRNG, in hex.
pub(crate) fn fresh_key() -> anyhow::Result<Vec<u8>> {
    Ok(format!("{}{}", ids::random_hex()?, ids::random_hex()?).into_bytes())
}

/// The records bucket: made again when the server confirms it gone, and brought to
/// its declared bound (`StateBucket`).
#[derive(Debug, Clone)]
pub(crate) struct Records {
    bucket: StateBucket,
}

impl Records {
    /// The bucket's handle, opened on first use.
    pub(crate) fn new(
        js: &jetstream::Context,
        subjects: &Subjects,
        streams: &StreamsConfig,
    ) -> Records {
        Records {
            bucket: StateBucket::new(js.clone(), Bucket::Gateway.spec(subjects, streams)),
        }
    }

    /// Opens the bucket now: made when missing, brought to its bound.
    pub(crate) async fn open(&self) -> anyhow::Result<()> {
        self.bucket.store().await?;
        Ok(())
    }

    /// Whether the bucket exists (one `STREAM.INFO`; never makes it).
    async fn exists(&self) -> anyhow::Result<bool> {
        Ok(self.bucket.usage().await?.is_some())
    }

    /// The record of `id`, if the gateway minted it (and it has not aged out).
    pub(crate) async fn get(&self, id: &str) -> anyhow::Result<Option<Record>> {
        let Some(value) = on_bucket(&self.bucket, "reading a record", |kv| {
            let id = id.to_string();
            async move { kv.get(id).await }
        })
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
    /// (a concurrent twin's, when it was first). A failed write drops the handle, so
    /// the caller's next try finds a deleted bucket gone and makes it again.
    pub(crate) async fn create(&self, id: &str, record: &Record) -> anyhow::Result<Record> {
        // `fail-gateway-record`: the bucket refuses every write, as an unwritable
        // one would.
        if webproxy_dispatcher::test_hook("fail-gateway-record") {
            anyhow::bail!("cannot record {id}: test hook fail-gateway-record");
        }
        let record = record.clone();
        let value = serde_json::to_vec(&record)?;
        let kv = self.bucket.store().await?;
        match kv.create(id, value.into()).await {
            Ok(_) => Ok(record),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                Ok(self.get(id).await?.unwrap_or(record))
            }
            Err(e) => {
                self.bucket.reopen().await;
                Err(e).with_context(|| format!("cannot record {id}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(key: &str) -> KeyEntry {
        KeyEntry::Value {
            key: key.into(),
            revision: 1,
        }
    }

    #[test]
    fn a_record_from_before_the_binding_reads_as_unbound() {
        let old = r#"{"route":"/a","identity":"t1","origin":"WEBPROXY_POOL_DEFAULT:7"}"#;
        let record: Record = serde_json::from_str(old).expect("an older record");
        assert_eq!(record.request, None);
        let random = Record::new("/a", "t1", &record.origin().expect("origin"), None);
        assert_eq!(
            serde_json::to_string(&random).expect("json"),
            old,
            "a random id's record is written as before"
        );
        let request = Key::new(b"k".to_vec()).fingerprint(
            "GET",
            "https://h/",
            &webproxy_protocol::Headers::new(),
            "idempotency-key",
            ids::BodyPart::Inline(b""),
        );
        let keyed = Record::new(
            "/a",
            "t1",
            &record.origin().expect("origin"),
            Some(&request),
        );
        let read: Record =
            serde_json::from_slice(&serde_json::to_vec(&keyed).expect("json")).expect("read");
        assert_eq!(read, keyed);
    }

    #[test]
    fn a_key_is_made_only_on_a_first_start() {
        assert_eq!(at_start(KeyEntry::BucketGone, false), AtStart::Create);
        assert_eq!(
            at_start(KeyEntry::Never, false),
            AtStart::Create,
            "a first start cut short between the bucket and the key"
        );
        assert_eq!(
            at_start(KeyEntry::BucketGone, true),
            AtStart::Lost(KeyLoss::BucketGone)
        );
        assert_eq!(
            at_start(KeyEntry::Never, true),
            AtStart::Lost(KeyLoss::Empty)
        );
        for records_exist in [false, true] {
            assert_eq!(
                at_start(KeyEntry::Removed, records_exist),
                AtStart::Lost(KeyLoss::Removed)
            );
            assert_eq!(
                at_start(value("k"), records_exist),
                AtStart::Use("k".into())
            );
        }
    }

    #[test]
    fn a_running_gateway_never_makes_a_key() {
        assert_eq!(running(value("k")), Ok("k".into()));
        assert_eq!(running(KeyEntry::BucketGone), Err(KeyLoss::BucketGone));
        assert_eq!(running(KeyEntry::Never), Err(KeyLoss::Empty));
        assert_eq!(running(KeyEntry::Removed), Err(KeyLoss::Removed));
    }

    #[test]
    fn a_loss_names_the_bucket_and_the_commands_that_end_it() {
        for loss in [KeyLoss::BucketGone, KeyLoss::Removed, KeyLoss::Empty] {
            let line = loss.describe("WEBPROXY_GATEWAY_KEY");
            for part in [
                "WEBPROXY_GATEWAY_KEY",
                "webproxy gateway key restore --from FILE",
                "webproxy gateway key export",
                "webproxy gateway key rotate",
            ] {
                assert!(line.contains(part), "{line}");
            }
        }
    }
}
