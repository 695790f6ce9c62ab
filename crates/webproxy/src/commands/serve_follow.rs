//! `serve` in `kv` mode after start: follows the configuration bucket (every new
//! revision validated as a push is, then handed to the dispatcher to swap in, or
//! refused, keeping the running one); and in either mode, the heartbeat in the
//! `<PREFIX>_INSTANCES` bucket (the revision, the source and the pools it runs) that
//! `config push`, `pools` and `pools remove` read.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use async_nats::jetstream::{self, kv};
use futures::StreamExt as _;
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, warn};
use webproxy_config::{Redactor, Secrets};
use webproxy_dispatcher::{AckWaitPacing, Instruments, StartError};
use webproxy_jetstream::config_store::{ConfigStore, StoredRevision};

use crate::config::document;
use crate::config::schema::{ClusterSource, Settings};

/// What this instance runs: the settings of one revision and its rules' secrets.
#[derive(Clone)]
pub(crate) struct Running {
    pub(crate) revision: u64,
    pub(crate) settings: Arc<Settings>,
    pub(crate) secrets: Arc<Secrets>,
}

/// How often an instance reports; the bucket keeps a report for 20 s, so an instance
/// that stopped vanishes within that, and one late heartbeat does not make a live
/// instance vanish.
const HEARTBEAT: Duration = Duration::from_secs(5);

/// One instance's report in `<PREFIX>_INSTANCES`, under its id.
pub(crate) use webproxy_jetstream::instances::InstanceReport as Report;

/// The instances in `reports` that do not run `revision` or a later one (pure); an
/// instance in file mode never runs a pushed revision, so it is not waited for.
pub(crate) fn lagging(reports: &[Report], revision: u64) -> Vec<&Report> {
    reports
        .iter()
        .filter(|r| !r.runs_file_mode() && r.revision < revision)
        .collect()
}

/// The live instances' reports, by id; none when the bucket does not exist.
pub(crate) async fn reports(
    js: &jetstream::Context,
    subjects: &webproxy_protocol::Subjects,
) -> anyhow::Result<Vec<Report>> {
    Ok(ConfigStore::instance_reports(js, subjects).await?)
}

/// Reports `running`'s revision and pools, where they come from (`source`), and the
/// `ack_wait` this instance paces from, every [`HEARTBEAT`] and at once when any
/// changes, until `shutdown`; then deletes the report, so `--wait` does not wait for
/// this instance. `reported` is told once the first report was tried, written or not.
pub(crate) async fn heartbeat(
    client: async_nats::Client,
    settings: Arc<webproxy_config::Settings>,
    source: ClusterSource,
    mut running: watch::Receiver<Running>,
    mut pacing: AckWaitPacing,
    reported: oneshot::Sender<()>,
    shutdown: CancellationToken,
) {
    let mut reported = Some(reported);
    let js = jetstream::new(client);
    let id = ConfigStore::instance_id();
    let mut store: Option<kv::Store> = None;
    let mut interval = tokio::time::interval(HEARTBEAT);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            changed = running.changed() => if changed.is_err() { return },
            // The owner lowers ack_wait once every live instance reports pacing from it.
            changed = pacing.changed() => if !changed { break },
            _ = shutdown.cancelled() => break,
        }
        if store.is_none() {
            match ConfigStore::instances(&js, &settings).await {
                Ok(opened) => store = Some(opened),
                Err(e) => warn!(error = %e, "cannot report this instance's revision"),
            }
        }
        if let Some(store) = &store {
            write_report(store, &id, source, &mut running, &mut pacing).await;
        }
        // Tried once, written or not: the start waits no longer.
        if let Some(reported) = reported.take() {
            let _ = reported.send(());
        }
    }
    if let Some(store) = store
        && let Err(e) = store.purge(&id).await
    {
        debug!(error = %e, "cannot delete this instance's report; it expires");
    }
}

/// Writes one heartbeat: what `running` runs, from where, and the pacing.
async fn write_report(
    store: &kv::Store,
    id: &str,
    source: ClusterSource,
    running: &mut watch::Receiver<Running>,
    pacing: &mut AckWaitPacing,
) {
    let (revision, pools) = {
        let running = running.borrow_and_update();
        let pools = running.settings.dispatcher.cluster.pools.keys().cloned();
        (running.revision, pools.collect())
    };
    let report = Report {
        instance: id.to_string(),
        revision,
        version: env!("CARGO_PKG_VERSION").into(),
        time: time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default(),
        pacing_ack_wait_ms: Some(u64::try_from(pacing.longest().as_millis()).unwrap_or(u64::MAX)),
        source: Some(
            match source {
                ClusterSource::File => "file",
                ClusterSource::Kv => "kv",
            }
            .into(),
        ),
        pools: Some(pools),
    };
    let value = serde_json::to_vec(&report).unwrap_or_default();
    if let Err(e) = store.put(id, value.into()).await {
        warn!(error = %e, "cannot report this instance's revision");
    }
}

/// Follows the document in the configuration bucket from `running`'s revision until
/// `shutdown`: each new revision is validated (as `config push` validates it), its
/// secrets read and handed to `apply`; a revision that fails any of it is refused,
/// logged with its number and counted, and the running one stays. A watch that is lost
/// (NATS reconnects, the bucket is briefly unavailable) is made again after the last
/// revision seen.
pub(crate) async fn follow(
    client: async_nats::Client,
    running: watch::Sender<Running>,
    redactor: Redactor,
    instruments: Instruments,
    apply: impl Fn(u64, Arc<webproxy_config::Settings>, Arc<Secrets>) -> Result<(), StartError>,
    shutdown: CancellationToken,
) {
    let js = jetstream::new(client);
    let mut seen = running.borrow().revision;
    let mut failures = 0u32;
    // Whether the bucket's loss was logged: once per loss.
    let mut lost = false;
    loop {
        if failures > 0 {
            // 100 ms more per failure, at most 2 s: the pull loops' backoff.
            let wait = Duration::from_millis(100 * u64::from(failures.min(20)));
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => return,
            }
        }
        let settings = running.borrow().settings.clone();
        // Opened, never made: a lost bucket is not made again (nor seeded) behind the
        // operators' back; this instance keeps its revision until a push writes one.
        // A bucket made again after a loss numbers its revisions from 1: read all of it.
        let after = if lost { 0 } else { seen };
        let watched = async {
            match ConfigStore::open(&js, &settings.dispatcher.subjects).await? {
                Some(store) => {
                    let revisions = store.watch_after(after).await?;
                    Ok::<_, webproxy_jetstream::config_store::ConfigStoreError>(Some((
                        store, revisions,
                    )))
                }
                None => Ok(None),
            }
        };
        let (store, mut revisions) = tokio::select! {
            watched = watched => match watched {
                Ok(Some(watching)) => {
                    lost = false;
                    watching
                }
                Ok(None) => {
                    if !lost {
                        error!(
                            bucket = settings.dispatcher.subjects.config_bucket(),
                            running = seen,
                            "the configuration bucket is gone; still running revision {seen} until `webproxy config push` writes a document again"
                        );
                        lost = true;
                    }
                    failures = failures.saturating_add(1);
                    continue;
                }
                Err(e) => {
                    warn!(error = %e, after = seen, "cannot watch the configuration bucket; retrying");
                    failures = failures.saturating_add(1);
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        let mut catch_up = CatchUp::default();
        let mut checks =
            tokio::time::interval_at(tokio::time::Instant::now() + WATCH_CHECK, WATCH_CHECK);
        loop {
            let next = tokio::select! {
                next = revisions.next() => next,
                _ = checks.tick() => {
                    // A watch can go quiet without an error: its consumer lost with the
                    // node that held it while the client reconnected elsewhere. The
                    // bucket's latest revision, read directly, shows it.
                    if let Ok(Some(latest)) = store.latest().await
                        && catch_up.behind(seen, latest.revision)
                    {
                        warn!(
                            after = seen,
                            latest = latest.revision,
                            "the watch of the configuration bucket fell behind its latest revision; watching again"
                        );
                        failures = 1;
                        break;
                    }
                    continue;
                }
                _ = shutdown.cancelled() => return,
            };
            match next {
                Some(Ok(revision)) => {
                    seen = revision.revision;
                    take(revision, &running, &redactor, &instruments, &apply);
                }
                Some(Err(e)) => {
                    warn!(error = %e, after = seen, "lost the watch of the configuration bucket; watching again");
                    // Lost after it was made: the next watch is tried soon.
                    failures = 1;
                    break;
                }
                None => {
                    warn!(
                        after = seen,
                        "the watch of the configuration bucket ended; watching again"
                    );
                    failures = 1;
                    break;
                }
            }
        }
    }
}

/// How often a configuration watch is checked against the bucket's latest revision:
/// README promises every instance runs a push within 5 s, and a quiet watch is made
/// again at the second check that finds it behind.
const WATCH_CHECK: Duration = Duration::from_secs(2);

/// Whether a watch is behind the bucket (pure): behind at two checks in a row, on the
/// same latest revision, so that a revision written just before a check (and on its
/// way in the watch) is not taken for a quiet watch.
#[derive(Debug, Default)]
struct CatchUp {
    behind_on: Option<u64>,
}

impl CatchUp {
    /// At a check that saw `seen` as the last revision taken and `latest` in the
    /// bucket: whether to watch again.
    fn behind(&mut self, seen: u64, latest: u64) -> bool {
        if latest <= seen {
            self.behind_on = None;
            return false;
        }
        let again = self.behind_on == Some(latest);
        self.behind_on = Some(latest);
        again
    }
}

/// Validates one revision and runs it, or refuses it.
fn take(
    stored: StoredRevision,
    running: &watch::Sender<Running>,
    redactor: &Redactor,
    instruments: &Instruments,
    apply: &impl Fn(u64, Arc<webproxy_config::Settings>, Arc<Secrets>) -> Result<(), StartError>,
) {
    let revision = stored.revision;
    let current = running.borrow().clone();
    match candidate(&stored, &current.settings, redactor).and_then(|(settings, secrets)| {
        apply(revision, settings.dispatcher.clone(), secrets.clone())
            .with_context(|| "this instance cannot run it")?;
        Ok((settings, secrets))
    }) {
        Ok((settings, secrets)) => {
            for warning in settings.warnings() {
                warn!(revision, "configuration: {warning}");
            }
            running.send_replace(Running {
                revision,
                settings: Arc::new(settings),
                secrets,
            });
        }
        Err(e) => {
            error!(
                revision,
                running = current.revision,
                error = format!("{e:#}"),
                "refused revision {revision} of the configuration bucket; still running revision {}",
                current.revision
            );
            instruments.count_config_refused();
        }
    }
}

/// The settings and secrets of a stored revision, or why it cannot run.
fn candidate(
    stored: &StoredRevision,
    running: &Settings,
    redactor: &Redactor,
) -> anyhow::Result<(Settings, Arc<Secrets>)> {
    if stored.deleted {
        anyhow::bail!("the document was deleted; a push or a rollback writes one again");
    }
    let (document, dispatcher) = document::validate(&stored.document, &running.config.streams)?;
    let settings = running.clone().with_document(document, dispatcher);
    let secrets = Secrets::load(&settings.dispatcher.cluster.rules, redactor.clone())
        .context("cannot read an injected secret")?;
    Ok((settings, Arc::new(secrets)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(instance: &str, revision: u64) -> Report {
        Report {
            instance: instance.into(),
            revision,
            version: "1".into(),
            time: String::new(),
            pacing_ack_wait_ms: None,
            source: None,
            pools: None,
        }
    }

    #[test]
    fn a_watch_is_behind_only_at_the_second_check_on_the_same_latest_revision() {
        let mut catch_up = CatchUp::default();
        assert!(!catch_up.behind(3, 3), "up to date");
        assert!(!catch_up.behind(3, 4), "a revision may be on its way");
        assert!(catch_up.behind(3, 4), "still not taken at the next check");
        let mut catch_up = CatchUp::default();
        assert!(!catch_up.behind(3, 4));
        assert!(!catch_up.behind(4, 4), "taken in between");
        assert!(!catch_up.behind(4, 5), "a newer one is on its way again");
        assert!(
            !catch_up.behind(4, 6),
            "pushes keep coming: give the newest its time"
        );
        assert!(catch_up.behind(4, 6));
    }

    #[test]
    fn an_instance_lags_until_it_runs_the_revision_or_a_later_one() {
        let reports = [report("a", 3), report("b", 4), report("c", 5)];
        let lagging: Vec<&str> = lagging(&reports, 4)
            .iter()
            .map(|r| r.instance.as_str())
            .collect();
        assert_eq!(lagging, ["a"]);
        assert!(lagging_none(&reports, 3));
    }

    #[test]
    fn an_instance_in_file_mode_is_never_waited_for() {
        let mut file = report("f", 0);
        file.source = Some("file".into());
        let mut kv = report("k", 0);
        kv.source = Some("kv".into());
        let reports = [file, kv];
        let lagging: Vec<&str> = lagging(&reports, 1)
            .iter()
            .map(|r| r.instance.as_str())
            .collect();
        assert_eq!(lagging, ["k"]);
    }

    fn lagging_none(reports: &[Report], revision: u64) -> bool {
        lagging(reports, revision).is_empty()
    }
}
