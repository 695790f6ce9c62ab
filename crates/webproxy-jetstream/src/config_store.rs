//! The KV bucket `<PREFIX>_CONFIG`, which holds the cluster part of the configuration
//! when `[config] source = "kv"`: one key, [`DOCUMENT_KEY`], whose value is the TOML
//! document (the file's shape) after one comment line saying who pushed it and why
//! ([`PushNote`]). The bucket's history is the document's history; every write is a
//! compare-and-set, so two writers never both win. Parsing and validating a document
//! is the binary's; this module only stores text.

use async_nats::jetstream::{self, kv};
use futures::{StreamExt as _, TryStreamExt as _};
use serde::{Deserialize, Serialize};
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use webproxy_config::settings::Settings;
use webproxy_protocol::Subjects;

use crate::backoff::retry_until_done;
use crate::instances;

/// The key of the cluster document.
pub(crate) const DOCUMENT_KEY: &str = "cluster";

use crate::state::{Bucket, is_bucket_not_found};

/// What the first line of a stored value starts with, before the note's JSON. A TOML
/// comment, so the stored value is itself a valid document.
const NOTE_LINE: &str = "# webproxy-push: ";

/// Who pushed a revision and why, as the pushing process said: self-reported (the
/// pusher's `USER`, or `--author`), not authenticated.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PushNote {
    pub user: String,
    pub message: String,
}

/// One revision of the document as stored.
#[derive(Debug, Clone)]
pub struct StoredRevision {
    /// The bucket's revision (its stream sequence).
    pub revision: u64,
    pub created: time::OffsetDateTime,
    /// `None` for a value written without one (by hand, with `nats kv put`).
    pub note: Option<PushNote>,
    /// The TOML document, without the note line.
    pub document: String,
    /// The key was deleted or purged at this revision: there is no document.
    pub deleted: bool,
}

/// How seeding an empty bucket went.
#[derive(Debug, Clone)]
pub enum Seeded {
    /// This call wrote the document, at this revision.
    Written(u64),
    /// The bucket already held one (another instance seeded it first, or a push).
    Found(StoredRevision),
}

#[derive(Debug, Error)]
pub enum ConfigStoreError {
    #[error("cannot open or create the configuration bucket {bucket}: {message}")]
    Bucket { bucket: String, message: String },
    #[error("cannot read the configuration bucket {bucket}: {message}")]
    Read { bucket: String, message: String },
    #[error("cannot write the configuration bucket {bucket}: {message}")]
    Write { bucket: String, message: String },
    /// A compare-and-set lost: the document is not at the revision the writer read.
    #[error(
        "the document in {bucket} is no longer {}: it changed since it was read; review it and push again",
        match expected { Some(revision) => format!("at revision {revision}"), None => "absent".to_string() }
    )]
    Conflict {
        bucket: String,
        expected: Option<u64>,
    },
    /// The bucket is missing while live instances report running one of its
    /// revisions: it was lost, not never made, and is not seeded again from a file.
    #[error(
        "the configuration bucket {bucket} is gone, yet live instances run its revision {revision}: it is not seeded again from this instance's file behind the operators' back; push the cluster document again (`webproxy config push`) and this instance starts on it"
    )]
    Lost { bucket: String, revision: u64 },
}

/// The stored value: the note line, then the document.
pub(crate) fn stored_text(note: &PushNote, document: &str) -> String {
    // serde_json writes a string's newlines as `\n`, so the note stays on one line.
    let note = serde_json::to_string(note).unwrap_or_default();
    format!("{NOTE_LINE}{note}\n{}", strip_note(document).1)
}

/// A stored value's note (when its first line is one) and its document.
pub(crate) fn strip_note(text: &str) -> (Option<PushNote>, &str) {
    let (first, rest) = text.split_once('\n').unwrap_or((text, ""));
    match first
        .strip_prefix(NOTE_LINE)
        .and_then(|json| serde_json::from_str(json).ok())
    {
        Some(note) => (Some(note), rest),
        None => (None, text),
    }
}

fn stored_revision(entry: kv::Entry) -> StoredRevision {
    let text = String::from_utf8_lossy(&entry.value);
    let (note, document) = strip_note(&text);
    StoredRevision {
        revision: entry.revision,
        created: entry.created,
        note,
        document: document.to_string(),
        deleted: entry.operation != kv::Operation::Put,
    }
}

/// The bucket, as `state.rs` declares it: file storage, `CONFIG_HISTORY` revisions.
pub(crate) fn config_bucket_config(settings: &Settings) -> kv::Config {
    Bucket::Config
        .spec(&settings.subjects, &settings.streams)
        .kv_config()
}

/// The cluster document's bucket.
#[derive(Debug, Clone)]
pub struct ConfigStore {
    kv: kv::Store,
    bucket: String,
}

impl ConfigStore {
    /// The bucket, or `None` when it does not exist.
    pub async fn open(
        js: &jetstream::Context,
        subjects: &Subjects,
    ) -> Result<Option<ConfigStore>, ConfigStoreError> {
        let bucket = subjects.config_bucket();
        match js.get_key_value(&bucket).await {
            Ok(kv) => Ok(Some(ConfigStore { kv, bucket })),
            Err(e) if is_bucket_not_found(&e) => Ok(None),
            Err(e) => Err(ConfigStoreError::Bucket {
                bucket,
                message: error_chain(&e),
            }),
        }
    }

    /// The bucket, created with `settings`' replicas when it does not exist.
    pub async fn open_or_create(
        js: &jetstream::Context,
        settings: &Settings,
    ) -> Result<ConfigStore, ConfigStoreError> {
        if let Some(store) = ConfigStore::open(js, &settings.subjects).await? {
            return Ok(store);
        }
        let config = config_bucket_config(settings);
        let bucket = config.bucket.clone();
        // Two creators at once: the same configuration, so the second create succeeds.
        let kv = js
            .create_key_value(config)
            .await
            .map_err(|e| ConfigStoreError::Bucket {
                bucket: bucket.clone(),
                message: error_chain(&e),
            })?;
        Ok(ConfigStore { kv, bucket })
    }

    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The latest revision of the document's key (a deletion included), or `None`
    /// when it was never written.
    pub async fn latest(&self) -> Result<Option<StoredRevision>, ConfigStoreError> {
        let entry = self
            .kv
            .entry(DOCUMENT_KEY)
            .await
            .map_err(|e| self.read_error(&e))?;
        Ok(entry.map(stored_revision))
    }

    /// The current document, or `None` when there is none (never written, or deleted).
    pub async fn current(&self) -> Result<Option<StoredRevision>, ConfigStoreError> {
        Ok(self.latest().await?.filter(|r| !r.deleted))
    }

    /// The document at `revision`, or `None` when that revision is not one of the
    /// document's, or is no longer in the history.
    pub async fn revision(
        &self,
        revision: u64,
    ) -> Result<Option<StoredRevision>, ConfigStoreError> {
        let entry = self
            .kv
            .entry_for_revision(DOCUMENT_KEY, revision)
            .await
            .map_err(|e| self.read_error(&e))?;
        Ok(entry.map(stored_revision))
    }

    /// Every revision the bucket keeps, oldest first, deletions included.
    pub async fn history(&self) -> Result<Vec<StoredRevision>, ConfigStoreError> {
        if self.latest().await?.is_none() {
            // The history of a key never written would wait for its first value.
            return Ok(Vec::new());
        }
        let entries = self
            .kv
            .history(DOCUMENT_KEY)
            .await
            .map_err(|e| self.read_error(&e))?;
        let entries: Vec<kv::Entry> = entries
            .try_collect()
            .await
            .map_err(|e| self.read_error(&e))?;
        Ok(entries.into_iter().map(stored_revision).collect())
    }

    /// Writes `document` with `note` if the document's key is still at `expected`
    /// (`None`: there is no document); returns the new revision.
    pub async fn put(
        &self,
        note: &PushNote,
        document: &str,
        expected: Option<u64>,
    ) -> Result<u64, ConfigStoreError> {
        let value = stored_text(note, document).into_bytes().into();
        let conflict = || ConfigStoreError::Conflict {
            bucket: self.bucket.clone(),
            expected,
        };
        match expected {
            // `create` also replaces a deletion marker.
            None => self.kv.create(DOCUMENT_KEY, value).await.map_err(|e| {
                if e.kind() == kv::CreateErrorKind::AlreadyExists {
                    conflict()
                } else {
                    self.write_error(&e)
                }
            }),
            Some(revision) => self
                .kv
                .update(DOCUMENT_KEY, value, revision)
                .await
                .map_err(|e| {
                    if e.kind() == kv::UpdateErrorKind::WrongLastRevision {
                        conflict()
                    } else {
                        self.write_error(&e)
                    }
                }),
        }
    }

    /// Writes `document` if there is none; if there is one, returns it. Of several
    /// instances seeding at once, one writes and the others read what it wrote.
    pub async fn seed(&self, note: &PushNote, document: &str) -> Result<Seeded, ConfigStoreError> {
        // One read decides: a document is found, or the write expects exactly this
        // state (nothing, or this deletion). Two reads would let another seed land
        // between them and be taken for a deletion.
        let expected = match self.latest().await? {
            Some(found) if !found.deleted => return Ok(Seeded::Found(found)),
            Some(deleted) => Some(deleted.revision),
            None => None,
        };
        match self.put(note, document, expected).await {
            Ok(revision) => Ok(Seeded::Written(revision)),
            Err(ConfigStoreError::Conflict { .. }) => match self.current().await? {
                Some(found) => Ok(Seeded::Found(found)),
                // Written and deleted again in between: rare enough to report.
                None => Err(ConfigStoreError::Conflict {
                    bucket: self.bucket.clone(),
                    expected,
                }),
            },
            Err(e) => Err(e),
        }
    }

    /// The revisions of the document written after `revision`, as they are written
    /// (deletions included). An error in the stream means the watch is lost: watch
    /// again after the last revision seen.
    pub async fn watch_after(
        &self,
        revision: u64,
    ) -> Result<
        impl futures::Stream<Item = Result<StoredRevision, ConfigStoreError>> + Send + Unpin + use<>,
        ConfigStoreError,
    > {
        let watch = self
            .kv
            .watch_from_revision(DOCUMENT_KEY, revision.saturating_add(1))
            .await
            .map_err(|e| self.read_error(&e))?;
        let bucket = self.bucket.clone();
        Ok(watch.map(move |entry| {
            entry
                .map(stored_revision)
                .map_err(|e| ConfigStoreError::Read {
                    bucket: bucket.clone(),
                    message: error_chain(&e),
                })
        }))
    }

    /// The bucket `<PREFIX>_INSTANCES`, created if need be: every running instance's
    /// heartbeat, one key per instance (its [`ConfigStore::instance_id`]), and the
    /// lease of the pool consumers' settings, each value kept 20 s (so an instance that
    /// stopped vanishes, and its lease ends), with the streams' replicas.
    pub async fn instances(
        js: &jetstream::Context,
        settings: &Settings,
    ) -> Result<kv::Store, ConfigStoreError> {
        let config = instances::bucket_config(settings);
        let bucket = config.bucket.clone();
        js.create_or_update_key_value(config)
            .await
            .map_err(|e| ConfigStoreError::Bucket {
                bucket,
                message: error_chain(&e),
            })
    }

    /// This process's id in `<PREFIX>_INSTANCES`.
    pub fn instance_id() -> String {
        instances::instance_id()
    }

    /// The live instances' heartbeats in `<PREFIX>_INSTANCES`, by id; none when the
    /// bucket does not exist.
    pub async fn instance_reports(
        js: &jetstream::Context,
        subjects: &Subjects,
    ) -> Result<Vec<instances::InstanceReport>, ConfigStoreError> {
        let bucket = subjects.instances_bucket();
        let Ok(store) = js.get_key_value(&bucket).await else {
            return Ok(Vec::new());
        };
        instances::reports(&store)
            .await
            .map_err(|message| ConfigStoreError::Read { bucket, message })
    }

    /// The instance that holds the lease of the pool consumers' settings now, if any.
    pub async fn pool_consumers_owner(
        js: &jetstream::Context,
        subjects: &Subjects,
    ) -> Result<Option<String>, ConfigStoreError> {
        let bucket = subjects.instances_bucket();
        let Ok(store) = js.get_key_value(&bucket).await else {
            return Ok(None);
        };
        let value = store
            .get(instances::POOL_CONSUMERS_LEASE)
            .await
            .map_err(|e| ConfigStoreError::Read {
                bucket,
                message: error_chain(&e),
            })?;
        Ok(value.map(|holder| String::from_utf8_lossy(&holder).into_owned()))
    }

    fn read_error(&self, e: &dyn std::error::Error) -> ConfigStoreError {
        ConfigStoreError::Read {
            bucket: self.bucket.clone(),
            message: error_chain(e),
        }
    }

    fn write_error(&self, e: &dyn std::error::Error) -> ConfigStoreError {
        ConfigStoreError::Write {
            bucket: self.bucket.clone(),
            message: error_chain(e),
        }
    }
}

impl ConfigStore {
    /// At start, in `file` mode: the current document in the bucket, if the bucket exists
    /// and holds one. Retried like provisioning (JetStream may be electing leaders);
    /// `None` when `shutdown` is cancelled first.
    pub async fn document_at_start(
        client: &async_nats::Client,
        settings: &Settings,
        shutdown: &CancellationToken,
    ) -> Option<Option<StoredRevision>> {
        let js = start_context(client, settings);
        retry_until_done("reading the configuration bucket", shutdown, || async {
            match ConfigStore::open(&js, &settings.subjects).await? {
                Some(store) => store.current().await,
                None => Ok(None),
            }
        })
        .await
    }

    /// At start, in `kv` mode: the bucket's document, or `document` (with `note`) written
    /// into an empty bucket, created if need be. A missing bucket is neither made nor
    /// seeded while live instances run one of its revisions (it was lost: an operator
    /// pushes it again). Retried like provisioning; `None` when `shutdown` is cancelled
    /// first.
    pub async fn seed_at_start(
        client: &async_nats::Client,
        settings: &Settings,
        note: &PushNote,
        document: &str,
        shutdown: &CancellationToken,
    ) -> Option<Seeded> {
        let js = start_context(client, settings);
        retry_until_done(
            "reading or seeding the configuration bucket",
            shutdown,
            || async {
                let store = match ConfigStore::open(&js, &settings.subjects).await? {
                    Some(store) => store,
                    None => {
                        if let Some(revision) = revision_in_use(&js, &settings.subjects).await? {
                            return Err(ConfigStoreError::Lost {
                                bucket: settings.subjects.config_bucket(),
                                revision,
                            });
                        }
                        ConfigStore::open_or_create(&js, settings).await?
                    }
                };
                store.seed(note, document).await
            },
        )
        .await
    }
}

/// The newest configuration revision a live instance reports running (its heartbeat
/// in `<PREFIX>_INSTANCES`, kept 20 s), if any. With one, a missing configuration
/// bucket was lost rather than never made. Instances in file mode report 0.
async fn revision_in_use(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<Option<u64>, ConfigStoreError> {
    let bucket = subjects.instances_bucket();
    let store = match js.get_key_value(&bucket).await {
        Ok(store) => store,
        Err(e) if is_bucket_not_found(&e) => return Ok(None),
        Err(e) => {
            return Err(ConfigStoreError::Read {
                bucket,
                message: error_chain(&e),
            });
        }
    };
    let reports = instances::reports(&store)
        .await
        .map_err(|message| ConfigStoreError::Read { bucket, message })?;
    Ok(reports.iter().map(|r| r.revision).filter(|r| *r > 0).max())
}

fn start_context(client: &async_nats::Client, settings: &Settings) -> jetstream::Context {
    let mut js = jetstream::new(client.clone());
    js.set_timeout(webproxy_config::settings::jetstream_request_timeout(
        settings.cluster.ack_wait,
    ));
    js
}

/// An error and its sources, `: `-separated: async-nats' own messages are terse.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests;
