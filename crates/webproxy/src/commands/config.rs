//! `webproxy config`: the cluster document in the bucket `<PREFIX>_CONFIG` (`push`,
//! `show`, `history`, `rollback`, `diff`). Every document is validated as
//! `check-config` validates the file (with this configuration's `[streams]`), and
//! every write is a compare-and-set on the revision read, so a push made in between
//! is never overwritten.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use async_nats::jetstream;
use clap::{Args, Subcommand};
use serde::Serialize;
use webproxy_jetstream::config_store::{ConfigStore, PushNote, StoredRevision};
use webproxy_protocol::Subjects;

use crate::commands::operator::{NatsArgs, connect_with_settings};
use crate::commands::serve_follow;
use crate::config::document;
use crate::config::schema::ClusterDocument;
use crate::config::schema::Settings;

#[derive(Debug, Subcommand)]
pub(crate) enum ConfigCommand {
    /// Validate a cluster document and write it as the new revision, with
    /// compare-and-set; print the revision and the diff against the current one.
    Push {
        /// The document: the file's [outbound], [service] ack_wait and max_deliver,
        /// [pools.*], [[request_rules]] and [[response_rules]], nothing else.
        file: PathBuf,
        /// Write only if the current revision is N (0: only if there is no document
        /// yet). Without it, the revision read just before writing.
        #[arg(long, value_name = "N")]
        expect_revision: Option<u64>,
        #[command(flatten)]
        note: NoteArgs,
        #[command(flatten)]
        wait: WaitArgs,
        #[command(flatten)]
        followers: FollowerArgs,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Print the current document, or an older revision's.
    Show {
        /// Show revision N (one `config history` lists); without it, the current one.
        #[arg(long, value_name = "N")]
        revision: Option<u64>,
        /// Print JSON: revision, time, user, message and document.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// List the revisions the bucket keeps: revision, time, user, message.
    History {
        /// Print JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Push revision N's document again, with compare-and-set on the current revision.
    Rollback {
        /// The revision whose document to push again (`config history` lists them).
        revision: u64,
        #[command(flatten)]
        note: NoteArgs,
        #[command(flatten)]
        wait: WaitArgs,
        #[command(flatten)]
        followers: FollowerArgs,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Validate a document and print its diff against the current revision; write
    /// nothing.
    Diff {
        /// The document, as `config push` takes it.
        file: PathBuf,
        #[command(flatten)]
        nats: NatsArgs,
    },
}

/// What `history` shows of a push. Self-reported: the bucket records what the pushing
/// process says.
#[derive(Debug, Args)]
pub(crate) struct NoteArgs {
    /// Why: shown by `config history`.
    #[arg(long, value_name = "TEXT", default_value = "")]
    message: String,
    /// Who, as `config history` shows it; by default the USER (or LOGNAME) variable.
    #[arg(long, value_name = "NAME")]
    author: Option<String>,
}

/// Waiting for the instances to run what was pushed.
#[derive(Debug, Args)]
pub(crate) struct WaitArgs {
    /// Return once every live instance reports the new revision (in the bucket
    /// <PREFIX>_INSTANCES); after --wait-timeout, name those that do not and fail.
    #[arg(long)]
    wait: bool,
    /// How long --wait waits.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    wait_timeout: Duration,
}

impl WaitArgs {
    /// With `--wait`: until every live instance runs `revision` or a later one, or
    /// the timeout, which is an error naming the instances that do not.
    async fn wait_for(
        &self,
        js: &jetstream::Context,
        subjects: &Subjects,
        revision: u64,
    ) -> anyhow::Result<()> {
        if !self.wait {
            return Ok(());
        }
        let started = Instant::now();
        // Polled: a CLI waiting a few seconds at most, on reports that expire silently.
        loop {
            let reports = serve_follow::reports(js, subjects).await?;
            let lagging = serve_follow::lagging(&reports, revision);
            if lagging.is_empty() {
                if reports.is_empty() {
                    eprintln!(
                        "notice: no live instance reports to {}: nothing runs in kv mode to wait for",
                        subjects.instances_bucket()
                    );
                } else {
                    outln!(
                        "every live instance ({}) runs revision {revision}, after {} ms",
                        reports.len(),
                        started.elapsed().as_millis()
                    )?;
                }
                return Ok(());
            }
            if started.elapsed() >= self.wait_timeout {
                let names: Vec<String> = lagging
                    .iter()
                    .map(|r| format!("{} (revision {})", r.instance, r.revision))
                    .collect();
                bail!(
                    "after {}, {} of {} live instances do not run revision {revision}: {}",
                    humantime::format_duration(self.wait_timeout),
                    lagging.len(),
                    reports.len(),
                    names.join(", ")
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Whether anything follows what is written.
#[derive(Debug, Args)]
pub(crate) struct FollowerArgs {
    /// Write even when no live instance runs `[config] source = "kv"` (in the bucket
    /// <PREFIX>_INSTANCES): for instance to write the document before the first
    /// instance in kv mode starts. Instances in file mode refuse to start while the
    /// bucket holds a document.
    #[arg(long)]
    force: bool,
}

impl FollowerArgs {
    /// Refuses, unless `--force`, a write that no live instance would follow: none
    /// reports `kv` mode. The instances in file mode are named, since each of them
    /// would refuse its next start beside a document; with kv followers as well,
    /// they are named in a warning.
    async fn check(&self, js: &jetstream::Context, subjects: &Subjects) -> anyhow::Result<()> {
        let reports = serve_follow::reports(js, subjects).await?;
        let (file, kv): (Vec<_>, Vec<_>) = reports.iter().partition(|r| r.runs_file_mode());
        let file: Vec<&str> = file.iter().map(|r| r.instance.as_str()).collect();
        let restart = "each refuses its next start while the bucket holds a document";
        if kv.is_empty() && !self.force {
            let found = if file.is_empty() {
                format!(
                    "no live instance reports to {}",
                    subjects.instances_bucket()
                )
            } else {
                format!(
                    "the live instances run [config] source = \"file\" ({}), so none would follow it, and {restart}",
                    file.join(", ")
                )
            };
            bail!(
                "refused: no live instance runs [config] source = \"kv\" to follow this document: {found}; set source = \"kv\" and restart the instances first, or pass --force to write it anyway"
            );
        }
        if !file.is_empty() {
            eprintln!(
                "warning: live instances in file mode will not follow this document, and {restart}: {}",
                file.join(", ")
            );
        }
        Ok(())
    }
}

impl NoteArgs {
    fn note(self, default_message: impl FnOnce() -> String) -> PushNote {
        let user = self.author.unwrap_or_else(|| {
            ["USER", "LOGNAME", "USERNAME"]
                .iter()
                .find_map(|name| std::env::var(name).ok().filter(|v| !v.is_empty()))
                .unwrap_or_else(|| "unknown".into())
        });
        let message = if self.message.is_empty() {
            default_message()
        } else {
            self.message
        };
        PushNote { user, message }
    }
}

pub(crate) async fn run(command: ConfigCommand) -> anyhow::Result<()> {
    match command {
        ConfigCommand::Push {
            file,
            expect_revision,
            note,
            wait,
            followers,
            nats,
        } => {
            let (client, settings) = connect_with_settings(&nats).await?;
            let name = file.display().to_string();
            let text = read_document(&file)?;
            let pushed = validated(&text, &settings, &name)?;
            let js = client.jetstream().clone();
            // Before the bucket is made: a refused push leaves nothing behind.
            followers.check(&js, &settings.dispatcher.subjects).await?;
            let store = ConfigStore::open_or_create(&js, &settings.dispatcher).await?;
            let current = store.latest().await?;
            let expected = match expect_revision {
                Some(0) => None,
                Some(revision) => Some(revision),
                None => current.as_ref().map(|r| r.revision),
            };
            let push = Push {
                store: &store,
                current: current.as_ref(),
                expected,
            };
            let revision = push.write(&text, &pushed, note.note(String::new)).await?;
            wait.wait_for(&js, &settings.dispatcher.subjects, revision)
                .await
        }
        ConfigCommand::Rollback {
            revision,
            note,
            wait,
            followers,
            nats,
        } => {
            let (settings, store, js) = open(&nats).await?;
            let old = revision_of(&store, revision).await?;
            let pushed = validated(&old.document, &settings, &format!("revision {revision}"))?;
            followers.check(&js, &settings.dispatcher.subjects).await?;
            let current = store.latest().await?;
            if current.as_ref().is_some_and(|c| c.revision == revision) {
                bail!("revision {revision} is the current one already");
            }
            let push = Push {
                store: &store,
                current: current.as_ref(),
                expected: current.as_ref().map(|r| r.revision),
            };
            let note = note.note(|| format!("rollback to revision {revision}"));
            let revision = push.write(&old.document, &pushed, note).await?;
            wait.wait_for(&js, &settings.dispatcher.subjects, revision)
                .await
        }
        ConfigCommand::Show {
            revision,
            json,
            nats,
        } => {
            let store = open(&nats).await?.1;
            let shown = match revision {
                Some(revision) => revision_of(&store, revision).await?,
                None => store
                    .current()
                    .await?
                    .with_context(|| format!("the bucket {} holds no document", store.bucket()))?,
            };
            if json {
                outln!("{}", serde_json::to_string_pretty(&Listed::from(&shown))?)?;
            } else {
                eprintln!("{}", describe(&shown));
                out!("{}", shown.document)?;
            }
            Ok(())
        }
        ConfigCommand::History { json, nats } => {
            let store = open(&nats).await?.1;
            let history = store.history().await?;
            if json {
                let listed: Vec<Listed> = history.iter().map(Listed::from).collect();
                outln!("{}", serde_json::to_string_pretty(&listed)?)?;
            } else {
                out!("{}", history_table(&history))?;
            }
            Ok(())
        }
        ConfigCommand::Diff { file, nats } => {
            let (client, settings) = connect_with_settings(&nats).await?;
            let name = file.display().to_string();
            let text = read_document(&file)?;
            validated(&text, &settings, &name)?;
            let js = client.jetstream().clone();
            let current = match ConfigStore::open(&js, &settings.dispatcher.subjects).await? {
                Some(store) => store.current().await?,
                None => None,
            };
            let diff = document::unified_diff(
                current.as_ref().map_or("", |c| &c.document),
                &text,
                &current_name(current.as_ref()),
                &name,
            );
            if diff.is_empty() {
                outln!("no difference from {}", current_name(current.as_ref()))?;
            } else {
                out!("{diff}")?;
            }
            Ok(())
        }
    }
}

/// `text` (the document `name`) parsed and validated with this configuration's
/// `[streams]`, as `check-config` validates a file.
fn validated(text: &str, settings: &Settings, name: &str) -> anyhow::Result<ClusterDocument> {
    let (document, _) = document::validate(text, &settings.config.streams)
        .with_context(|| format!("invalid document {name}"))?;
    Ok(document)
}

/// One compare-and-set write over `current`.
struct Push<'a> {
    store: &'a ConfigStore,
    /// The latest revision read (a deletion included), or none.
    current: Option<&'a StoredRevision>,
    /// The revision the document must still be at (`None`: no document).
    expected: Option<u64>,
}

impl Push<'_> {
    /// Writes `text` (validated: `pushed`) if the document is still at the expected
    /// revision, and prints the new revision, the diff and the pools it leaves out;
    /// returns the revision that holds `text`.
    async fn write(
        &self,
        text: &str,
        pushed: &ClusterDocument,
        note: PushNote,
    ) -> anyhow::Result<u64> {
        let current = self.current.filter(|c| !c.deleted);
        let old_text = current.map_or("", |c| c.document.as_str());
        if let Some(current) = current
            && old_text == text
            && self.expected == Some(current.revision)
        {
            outln!(
                "unchanged: revision {} holds this document already",
                current.revision
            )?;
            return Ok(current.revision);
        }
        let revision = self.store.put(&note, text, self.expected).await?;
        outln!("pushed revision {revision} to {}", self.store.bucket())?;
        out!(
            "{}",
            document::unified_diff(
                old_text,
                text,
                &current_name(current),
                &format!("revision {revision}")
            )
        )?;
        // A document that no longer parses (written by hand) names no pools to compare.
        if let Some(Ok(before)) = current.map(|c| document::parse(&c.document)) {
            for pool in document::removed_pools(&before, pushed) {
                eprintln!(
                    "notice: pool {pool} is not in the pushed document; it keeps being served until `webproxy pools remove {pool}`"
                );
            }
        }
        Ok(revision)
    }
}

/// A revision in `show --json` and `history --json`.
#[derive(Debug, Serialize)]
struct Listed<'a> {
    revision: u64,
    /// RFC 3339.
    time: String,
    user: Option<&'a str>,
    message: Option<&'a str>,
    deleted: bool,
    #[serde(skip_serializing_if = "str::is_empty")]
    document: &'a str,
}

impl<'a> From<&'a StoredRevision> for Listed<'a> {
    fn from(revision: &'a StoredRevision) -> Listed<'a> {
        Listed {
            revision: revision.revision,
            time: rfc3339(revision.created),
            user: revision.note.as_ref().map(|n| n.user.as_str()),
            message: revision.note.as_ref().map(|n| n.message.as_str()),
            deleted: revision.deleted,
            document: &revision.document,
        }
    }
}

fn rfc3339(time: time::OffsetDateTime) -> String {
    time.format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_else(|_| time.to_string())
}

/// One line: revision, time, user and message (`-` where the value carries no note).
/// One revision as `config history` and `config show` print it: revision, time, user
/// and message (on one line).
fn columns(revision: &StoredRevision) -> [String; 4] {
    let (user, message) = match (&revision.note, revision.deleted) {
        (_, true) => ("-", "(deleted)"),
        (Some(note), false) => (note.user.as_str(), note.message.as_str()),
        (None, false) => ("-", "(written without a note)"),
    };
    [
        revision.revision.to_string(),
        rfc3339(revision.created),
        user.to_owned(),
        message.replace('\n', " "),
    ]
}

/// `config show`'s line about the revision it prints.
fn describe(revision: &StoredRevision) -> String {
    columns(revision).join("  ")
}

/// `config history`'s table: a header, then one line a revision, oldest first, in
/// aligned columns (the message last).
fn history_table(history: &[StoredRevision]) -> String {
    use crate::table::{Align, render};
    let rows: Vec<[String; 4]> = history.iter().map(columns).collect();
    render(
        [
            ("REVISION", Align::Right),
            ("TIME", Align::Left),
            ("USER", Align::Left),
            ("MESSAGE", Align::Left),
        ],
        &rows,
    )
}

fn current_name(current: Option<&StoredRevision>) -> String {
    current.map_or_else(
        || "no document".to_string(),
        |c| format!("revision {}", c.revision),
    )
}

async fn revision_of(store: &ConfigStore, revision: u64) -> anyhow::Result<StoredRevision> {
    match store.revision(revision).await? {
        Some(found) if !found.deleted => Ok(found),
        Some(_) => bail!("revision {revision} deleted the document; it holds none"),
        None => bail!(
            "revision {revision} is not a revision of the document in {} (the bucket keeps the last 64)",
            store.bucket()
        ),
    }
}

fn read_document(file: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))
}

/// The bucket, which must exist.
async fn open(nats: &NatsArgs) -> anyhow::Result<(Settings, ConfigStore, jetstream::Context)> {
    let (client, settings) = connect_with_settings(nats).await?;
    let js = client.jetstream().clone();
    let store = ConfigStore::open(&js, &settings.dispatcher.subjects)
        .await?
        .with_context(|| {
            format!(
                "there is no bucket {}: nothing was pushed yet",
                settings.dispatcher.subjects.config_bucket()
            )
        })?;
    Ok((settings, store, js))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn revision(revision: u64, note: Option<(&str, &str)>, deleted: bool) -> StoredRevision {
        StoredRevision {
            revision,
            created: time::OffsetDateTime::UNIX_EPOCH,
            note: note.map(|(user, message)| PushNote {
                user: user.into(),
                message: message.into(),
            }),
            document: String::new(),
            deleted,
        }
    }

    #[test]
    fn history_is_a_table_with_a_header_in_aligned_columns() {
        let table = history_table(&[
            revision(1, Some(("alice", "open the partner")), false),
            revision(12, Some(("bob", "deny\nadmin")), false),
            revision(13, None, false),
            revision(14, None, true),
        ]);
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines.len(), 5, "{table}");
        assert!(lines[0].starts_with("REVISION  TIME"), "{table}");
        // Every column starts at the same place on every line.
        let at = |line: &str, what: &str| line.find(what).expect(what);
        assert_eq!(at(lines[1], "alice"), at(lines[2], "bob"), "{table}");
        assert_eq!(at(lines[1], "open"), at(lines[2], "deny admin"), "{table}");
        assert_eq!(at(lines[0], "USER"), at(lines[1], "alice"), "{table}");
        assert!(
            lines[3].ends_with("-      (written without a note)"),
            "{table}"
        );
        assert!(lines[4].ends_with("(deleted)"), "{table}");
    }
}
