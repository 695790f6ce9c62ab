//! `webproxy dead list` and `webproxy dead replay`: read the dead-letter streams, and
//! replay failed conversations as a new generation from their origin, through the
//! dispatcher's own replay. Dead letters stay where they are, as an audit trail.
//!
//! Each pool has a dead-letter stream of its own (`<POOL STREAM>_DEAD`); the letters
//! stored before the upgrade to layout 3 are in the retired shared stream
//! (`<PREFIX>_DEAD`) until they age out. Both commands read the shared stream first (its
//! letters are older), then every pool's stream on the server (or `--pool`'s only).
//!
//! Both stream each dead-letter stream rather than load it (one may hold up to
//! `dead_max_bytes`): a read holds one fetched batch at a time, and stops at the
//! stream's last letter as it was when the command started, so letters stored
//! meanwhile (a replay that fails again, say) are not read in the same run.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::IsTerminal as _;
use std::num::NonZeroU64;
use std::ops::ControlFlow;
use std::time::Duration;

use anyhow::{Context as _, bail};
use async_nats::jetstream::{self, consumer, stream};
use clap::Args;
use futures::TryStreamExt as _;
use serde::{Deserialize as _, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use webproxy_client::Client;
use webproxy_dispatcher::{Operator, Replay, ReplayError};
use webproxy_protocol::{DeadLetter, ErrorCode, Origin, header};

use crate::commands::operator::{NatsArgs, connect, for_each_message, operator};
use crate::table::{self, Align, Column};

/// Which dead letters `dead list` and `dead replay` read. Letters match when they
/// pass every filter given.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct Selection {
    /// Only this pool's.
    #[arg(long)]
    pub(crate) pool: Option<String>,
    /// Only letters stored at or after TIME: an RFC 3339 time (2026-05-01T12:00:00Z)
    /// or a duration ago (90m, 1h, 2days).
    #[arg(long, value_name = "TIME", value_parser = since_now)]
    pub(crate) since: Option<OffsetDateTime>,
    /// Only letters with this error code (invalid_request, denied, expired,
    /// upstream_error, retries_exhausted, transport_error, response_too_large,
    /// queue_full, cancelled, internal). Repeat it, or separate codes with commas, for
    /// several.
    #[arg(long, value_name = "CODE", value_delimiter = ',', value_parser = parse_code)]
    pub(crate) code: Vec<ErrorCode>,
    /// Only this conversation's: the request's `id`.
    #[arg(long)]
    pub(crate) id: Option<String>,
    /// Stop after N matching letters.
    #[arg(long, value_name = "N")]
    pub(crate) limit: Option<NonZeroU64>,
}

impl Selection {
    /// Whether `letter` passes the filters the server does not apply (`--pool` is the
    /// reader's subject filter, `--since` its start time).
    fn matches(&self, letter: &DeadLetter) -> bool {
        (self.code.is_empty() || self.code.contains(&letter.error.code))
            && self
                .id
                .as_ref()
                .is_none_or(|id| letter.id.as_ref() == Some(id))
    }
}

/// `--since`: an RFC 3339 time, or a duration (humantime's syntax) before `now`.
pub(crate) fn parse_since(value: &str, now: OffsetDateTime) -> Result<OffsetDateTime, String> {
    if let Ok(at) = OffsetDateTime::parse(value, &Rfc3339) {
        return Ok(at);
    }
    let ago = humantime::parse_duration(value).map_err(|e| {
        format!(
            "{value:?} is neither an RFC 3339 time (like 2026-05-01T12:00:00Z) nor a \
             duration ago (like 90m, 1h or 2days): {e}"
        )
    })?;
    time::Duration::try_from(ago)
        .ok()
        .and_then(|ago| now.checked_sub(ago))
        .ok_or_else(|| format!("{value:?} reaches back before any representable time"))
}

fn since_now(value: &str) -> Result<OffsetDateTime, String> {
    parse_since(value, OffsetDateTime::now_utc())
}

/// `--code`: an error code as the protocol spells it; the error lists the valid ones.
fn parse_code(value: &str) -> Result<ErrorCode, String> {
    ErrorCode::deserialize(serde::de::value::StrDeserializer::<serde::de::value::Error>::new(value))
        .map_err(|e| e.to_string())
}

/// One stored dead letter.
#[derive(Debug, Serialize)]
pub(crate) struct StoredLetter {
    /// The stream that holds it: its pool's, or the retired shared one.
    pub(crate) stream: String,
    /// Its sequence in that stream.
    pub(crate) sequence: u64,
    /// RFC 3339, when it was stored.
    pub(crate) stored_at: String,
    #[serde(flatten)]
    pub(crate) letter: DeadLetter,
}

/// One dead-letter stream as it was when the command opened it.
struct DeadStream {
    stream: stream::Stream,
    name: String,
    /// The stream's last sequence at opening: reads stop there.
    end: u64,
}

/// The dead-letter streams a command reads: the retired shared one first, then each
/// pool's, by name.
struct DeadStreams {
    streams: Vec<DeadStream>,
    subjects: webproxy_protocol::Subjects,
    max_payload: usize,
}

/// The names of the dead-letter streams to read (pure): the retired shared stream,
/// then `pool`'s own, or, without one, every pool's among `existing` (pool `x`'s is
/// `<PREFIX>_POOL_X_DEAD`, and no pool's work stream ends in `_DEAD`).
fn dead_stream_names(
    subjects: &webproxy_protocol::Subjects,
    pool: Option<&str>,
    existing: &[String],
) -> Vec<String> {
    let mut names = vec![subjects.dead_stream()];
    match pool {
        Some(pool) => names.push(subjects.pool_dead_stream(pool)),
        None => {
            let prefix = subjects.pool_stream("");
            let mut pools: Vec<String> = existing
                .iter()
                .filter(|name| name.starts_with(&prefix) && name.ends_with("_DEAD"))
                .cloned()
                .collect();
            pools.sort();
            names.extend(pools);
        }
    }
    names
}

impl DeadStreams {
    async fn open(client: &Client, selection: &Selection) -> anyhow::Result<DeadStreams> {
        let subjects = client.subjects().clone();
        let js = jetstream::new(client.nats().clone());
        let existing: Vec<String> = if selection.pool.is_some() {
            Vec::new()
        } else {
            js.stream_names()
                .try_collect()
                .await
                .context("cannot list streams")?
        };
        let mut streams = Vec::new();
        for name in dead_stream_names(&subjects, selection.pool.as_deref(), &existing) {
            let stream = match js.get_stream(&name).await {
                Ok(stream) => stream,
                // The shared stream of an older layout, deleted once it aged out, or a
                // pool with no dead letters stream (yet).
                Err(e)
                    if matches!(e.kind(), jetstream::context::GetStreamErrorKind::JetStream(ref js)
                        if js.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND) =>
                {
                    continue;
                }
                Err(e) => return Err(e).with_context(|| format!("cannot open stream {name}")),
            };
            let end = stream.cached_info().state.last_sequence;
            if end > 0 {
                streams.push(DeadStream { stream, name, end });
            }
        }
        Ok(DeadStreams {
            streams,
            subjects,
            max_payload: client.nats().server_info().max_payload,
        })
    }

    /// Hands each letter that `selection` matches to `each`, stream by stream and
    /// oldest first in each, until `each` breaks, `--limit` letters matched, or the
    /// end; returns how many matched.
    async fn for_each(
        &self,
        selection: &Selection,
        mut each: impl AsyncFnMut(StoredLetter) -> anyhow::Result<ControlFlow<()>>,
    ) -> anyhow::Result<u64> {
        let mut superseded = HashSet::new();
        for dead in &self.streams {
            superseded.extend(self.superseded(dead, selection).await?);
        }
        let limit = selection.limit.map_or(u64::MAX, NonZeroU64::get);
        let mut matched = 0;
        for dead in &self.streams {
            let stopped = self
                .for_each_in(dead, selection, &superseded, limit, &mut matched, &mut each)
                .await?;
            if stopped.is_break() {
                break;
            }
        }
        Ok(matched)
    }

    /// [`DeadStreams::for_each`] in one stream; breaks when the whole read stops.
    async fn for_each_in(
        &self,
        dead: &DeadStream,
        selection: &Selection,
        superseded: &HashSet<Superseded>,
        limit: u64,
        matched: &mut u64,
        each: &mut impl AsyncFnMut(StoredLetter) -> anyhow::Result<ControlFlow<()>>,
    ) -> anyhow::Result<ControlFlow<()>> {
        let filter = selection.pool.as_deref().map_or_else(
            || self.subjects.dead_letters_wildcard(),
            |pool| self.subjects.dead(pool),
        );
        let deliver_policy = selection
            .since
            .map_or(consumer::DeliverPolicy::All, |start_time| {
                consumer::DeliverPolicy::ByStartTime { start_time }
            });
        let reader = reader(dead, filter, deliver_policy).await?;
        let mut stopped = ControlFlow::Continue(());
        for_each_message(&reader, self.max_payload, async |message| {
            let info = message
                .info()
                .map_err(|e| anyhow::anyhow!("dead letter without metadata: {e}"))?;
            let sequence = info.stream_sequence;
            if sequence > dead.end {
                return Ok(ControlFlow::Break(()));
            }
            let stored_at = info.published.format(&Rfc3339).unwrap_or_default();
            match serde_json::from_slice::<DeadLetter>(&message.payload) {
                Ok(letter) if superseded.contains(&Superseded::of(&letter)) => {}
                Ok(letter) if selection.matches(&letter) => {
                    *matched += 1;
                    let stored = StoredLetter {
                        stream: dead.name.clone(),
                        sequence,
                        stored_at,
                        letter,
                    };
                    if each(stored).await?.is_break() || *matched == limit {
                        stopped = ControlFlow::Break(());
                        return Ok(ControlFlow::Break(()));
                    }
                }
                Ok(_) => {}
                Err(e) => eprintln!(
                    "warning: dead letter {sequence} of {} is not readable: {e}",
                    dead.name
                ),
            }
            Ok(if sequence == dead.end {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            })
        })
        .await?;
        Ok(stopped)
    }

    /// The conversations whose letters the service marked superseded (a stalled
    /// delivery's letter, where another delivery answered with a response). Marks are
    /// rare and small, so they are read whole before the letters.
    async fn superseded(
        &self,
        dead: &DeadStream,
        selection: &Selection,
    ) -> anyhow::Result<HashSet<Superseded>> {
        let filter = selection.pool.as_deref().map_or_else(
            || self.subjects.dead_superseded_wildcard(),
            |pool| self.subjects.dead_superseded(pool),
        );
        let reader = reader(dead, filter, consumer::DeliverPolicy::All).await?;
        let mut marks = HashSet::new();
        for_each_message(&reader, self.max_payload, async |message| {
            let header = |name: &str| {
                message
                    .headers
                    .as_ref()
                    .and_then(|h| h.get(name))
                    .map(|v| v.as_str().to_string())
            };
            let generation = header(header::GENERATION).and_then(|g| g.parse().ok());
            if let (Some(origin), Some(generation)) = (header(header::ORIGIN), generation) {
                marks.insert(Superseded { origin, generation });
            }
            Ok(ControlFlow::Continue(()))
        })
        .await?;
        Ok(marks)
    }
}

/// An ephemeral consumer that acks nothing: it reads without changing the stream.
async fn reader(
    dead: &DeadStream,
    filter_subject: String,
    deliver_policy: consumer::DeliverPolicy,
) -> anyhow::Result<consumer::PullConsumer> {
    dead.stream
        .create_consumer(consumer::pull::Config {
            filter_subject,
            deliver_policy,
            ack_policy: consumer::AckPolicy::None,
            inactive_threshold: Duration::from_secs(30),
            ..Default::default()
        })
        .await
        .with_context(|| {
            format!(
                "cannot create a reader on the dead-letter stream {}",
                dead.name
            )
        })
}

/// A conversation's generation whose dead letter is superseded.
#[derive(Debug, PartialEq, Eq, Hash)]
struct Superseded {
    origin: String,
    generation: u64,
}

impl Superseded {
    fn of(letter: &DeadLetter) -> Superseded {
        Superseded {
            origin: letter.origin.clone().unwrap_or_default(),
            generation: letter.generation,
        }
    }
}

/// Prints `text` on stdout. A closed stdout (`dead list | head`) breaks, so the
/// command stops reading and ends quietly.
fn print_text(text: fmt::Arguments<'_>) -> anyhow::Result<ControlFlow<()>> {
    match out!("{text}") {
        Ok(()) => Ok(ControlFlow::Continue(())),
        Err(e) if e.is::<crate::stdout::Closed>() => Ok(ControlFlow::Break(())),
        Err(e) => Err(e),
    }
}

/// Prints one line on stdout, as [`print_text`].
fn print_line(line: fmt::Arguments<'_>) -> anyhow::Result<ControlFlow<()>> {
    print_text(format_args!("{line}\n"))
}

/// `dead list`'s columns: where the letter is stored, its pool, its conversation's
/// origin (what the letter is picked by, `<STREAM>:<seq>`), id and generation, and how
/// it ended.
const LIST_COLUMNS: [Column; 8] = [
    ("SEQ", Align::Right),
    ("STORED", Align::Left),
    ("POOL", Align::Left),
    ("ORIGIN", Align::Left),
    ("ID", Align::Left),
    ("GEN", Align::Right),
    ("CODE", Align::Left),
    ("MESSAGE", Align::Left),
];

/// One letter as a row of `dead list`'s table (`-` for what it lacks).
fn list_row(stored: &StoredLetter) -> [String; 8] {
    let letter = &stored.letter;
    [
        stored.sequence.to_string(),
        stored.stored_at.clone(),
        letter.pool.clone(),
        letter.origin.clone().unwrap_or_else(|| "-".into()),
        letter.id.clone().unwrap_or_else(|| "-".into()),
        letter.generation.to_string(),
        letter.error.code.as_str().to_owned(),
        letter.error.message.clone(),
    ]
}

/// `dead list`: the selected letters, oldest first. With `json`, one JSON array, a
/// letter a line, printed as the letters are read. The table is printed once every
/// letter is read, since its columns are as wide as their widest value: it holds one
/// row of short fields a letter (not the letters' requests).
pub(crate) async fn list(args: &NatsArgs, selection: &Selection, json: bool) -> anyhow::Result<()> {
    let client = connect(args).await?;
    let dead = DeadStreams::open(&client, selection).await?;
    if json {
        if print_text(format_args!("["))?.is_break() {
            return Ok(());
        }
        let mut separator = "";
        dead.for_each(selection, async |stored| {
            let letter = serde_json::to_string(&stored)?;
            print_text(format_args!(
                "{}\n{letter}",
                std::mem::replace(&mut separator, ",")
            ))
        })
        .await?;
        // The last line: whether stdout is still open changes nothing.
        let _ = print_line(format_args!("\n]"))?;
        return Ok(());
    }
    let mut rows = Vec::new();
    dead.for_each(selection, async |stored| {
        rows.push(list_row(&stored));
        Ok(ControlFlow::Continue(()))
    })
    .await?;
    // The last lines: whether stdout is still open changes nothing.
    if rows.is_empty() {
        let _ = print_line(format_args!("no dead letters"))?;
    } else {
        let _ = print_text(format_args!("{}", table::render(LIST_COLUMNS, &rows)))?;
    }
    Ok(())
}

/// `dead replay`'s options beyond the NATS ones.
#[derive(Debug, Args)]
pub(crate) struct ReplayArgs {
    #[command(flatten)]
    pub(crate) selection: Selection,
    /// Replay `denied` and `invalid_request` letters too. They are skipped otherwise:
    /// the same request would most likely fail the same way again.
    #[arg(long)]
    pub(crate) include_denied: bool,
    /// Replay `cancelled` letters too. They are skipped otherwise: someone took the
    /// request back on purpose (`webproxy cancel`, or its caller).
    #[arg(long)]
    pub(crate) include_cancelled: bool,
    /// Print what would be replayed, and replay nothing. Needs no confirmation.
    #[arg(long)]
    pub(crate) dry_run: bool,
    /// Replay without asking. Without --id, replay asks on a terminal, and without a
    /// terminal it replays nothing unless --yes is given.
    #[arg(long)]
    pub(crate) yes: bool,
    /// Print JSON lines, one per conversation replayed or letter skipped.
    #[arg(long)]
    pub(crate) json: bool,
    /// Replay conversations that were replayed already, as a new generation (the next
    /// after the newest replayed one). Without it, a letter is replayed once: a second
    /// replay says "already replayed as generation N" and publishes nothing.
    #[arg(long)]
    pub(crate) again: bool,
}

impl ReplayArgs {
    /// Which generation each replay starts.
    fn mode(&self) -> Replay {
        if self.again {
            Replay::Again
        } else {
            Replay::Once
        }
    }
}

/// `dead replay`'s `--include-*` flags, each of which replays codes it skips by
/// default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Included {
    denied: bool,
    cancelled: bool,
}

impl Included {
    /// The flag that would replay letters of `code`, when these flags leave them
    /// skipped: the caller's mistakes and the rules' refusals (`--include-denied`),
    /// which a replay would most likely only repeat, and conversations someone took
    /// back (`--include-cancelled`), which a replay would undo.
    fn missing(self, code: ErrorCode) -> Option<&'static str> {
        let (flag, given) = match code {
            ErrorCode::Denied | ErrorCode::InvalidRequest => ("--include-denied", self.denied),
            ErrorCode::Cancelled => ("--include-cancelled", self.cancelled),
            _ => return None,
        };
        (!given).then_some(flag)
    }
}

/// Refuses `--code denied` (or `invalid_request`, or `cancelled`) without the flag
/// that includes it, which would select letters only to skip every one of them.
fn check_codes(
    codes: &[ErrorCode],
    include_denied: bool,
    include_cancelled: bool,
) -> anyhow::Result<()> {
    let included = Included {
        denied: include_denied,
        cancelled: include_cancelled,
    };
    if let Some((code, flag)) = codes
        .iter()
        .find_map(|code| included.missing(*code).map(|flag| (code, flag)))
    {
        bail!("--code {code} selects letters that replay skips unless {flag} is given");
    }
    Ok(())
}

/// Why a letter is not replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Skip {
    NoOrigin,
    BadOrigin(String),
    Truncated,
    Excluded(ErrorCode),
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skip::NoOrigin => f.write_str(
                "no origin (the payload was not a request, or an older webproxy stored it)",
            ),
            Skip::BadOrigin(e) => write!(f, "malformed origin: {e}"),
            Skip::Truncated => f.write_str("the letter does not hold the whole request"),
            // With no flag given, the flag that replays a skipped code.
            Skip::Excluded(code) => match Included::default().missing(*code) {
                Some(flag) => write!(f, "{code} ({flag} replays it)"),
                None => write!(f, "{code}"),
            },
        }
    }
}

/// The newest letter of one conversation: the one a replay starts from, since it has
/// the highest generation and the next one starts above it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Newest {
    generation: u64,
    /// Where the letter is: its stream and sequence. Generations order one
    /// conversation's letters across streams; within one stream, so does the sequence.
    stream: String,
    sequence: u64,
    skip: Option<Skip>,
}

/// What to do with one letter, once the first pass has seen them all.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    /// Replay it, as generation `generation`.
    Replay {
        origin: Origin,
        generation: u64,
    },
    Skip(Skip),
    /// A newer letter of its conversation is replayed instead (or skipped).
    Superseded,
}

/// The first pass over the selected letters: each conversation's newest letter.
#[derive(Debug, Default)]
struct Plan {
    included: Included,
    newest: HashMap<Origin, Newest>,
    /// Letters without a usable origin: skipped whatever else holds.
    unoriginated: u64,
}

impl Plan {
    fn new(include_denied: bool, include_cancelled: bool) -> Plan {
        Plan {
            included: Included {
                denied: include_denied,
                cancelled: include_cancelled,
            },
            ..Plan::default()
        }
    }

    fn origin(stored: &StoredLetter) -> Result<Origin, Skip> {
        stored
            .letter
            .origin
            .as_deref()
            .ok_or(Skip::NoOrigin)?
            .parse()
            .map_err(|e: webproxy_protocol::InvalidName| Skip::BadOrigin(e.0))
    }

    /// Why `letter` would be skipped as its conversation's newest, if it would.
    fn skip(&self, letter: &DeadLetter) -> Option<Skip> {
        if self.included.missing(letter.error.code).is_some() {
            Some(Skip::Excluded(letter.error.code))
        } else if letter.whole_request().is_none() {
            Some(Skip::Truncated)
        } else {
            None
        }
    }

    fn add(&mut self, stored: &StoredLetter) {
        let Ok(origin) = Self::origin(stored) else {
            self.unoriginated += 1;
            return;
        };
        let candidate = Newest {
            generation: stored.letter.generation,
            stream: stored.stream.clone(),
            sequence: stored.sequence,
            skip: self.skip(&stored.letter),
        };
        self.newest
            .entry(origin)
            .and_modify(|newest| {
                // Streams are read in order, the retired shared one first: a letter
                // read later with the same generation is the later one.
                let later = candidate.generation > newest.generation
                    || (candidate.generation == newest.generation
                        && (candidate.stream != newest.stream
                            || candidate.sequence > newest.sequence));
                if later {
                    *newest = candidate.clone();
                }
            })
            .or_insert(candidate);
    }

    /// How many conversations would be replayed.
    fn to_replay(&self) -> usize {
        self.newest.values().filter(|n| n.skip.is_none()).count()
    }

    /// How many letters would be reported as skipped.
    fn to_skip(&self) -> u64 {
        let newest_skipped = self.newest.values().filter(|n| n.skip.is_some()).count();
        self.unoriginated + newest_skipped as u64
    }

    /// The second pass: what to do with `stored`.
    fn action(&self, stored: &StoredLetter) -> Action {
        let origin = match Self::origin(stored) {
            Ok(origin) => origin,
            Err(skip) => return Action::Skip(skip),
        };
        match self.newest.get(&origin) {
            Some(newest)
                if newest.sequence == stored.sequence && newest.stream == stored.stream =>
            {
                match &newest.skip {
                    Some(skip) => Action::Skip(skip.clone()),
                    None => Action::Replay {
                        generation: newest.generation + 1,
                        origin,
                    },
                }
            }
            // Letters stored between the passes are not in the plan.
            _ => Action::Superseded,
        }
    }
}

/// Whether a replay may go ahead without asking.
#[derive(Debug, PartialEq, Eq)]
enum Consent {
    Given,
    /// Ask on the terminal.
    Ask,
    /// No terminal to ask on, and no --yes.
    Missing,
}

/// One conversation (`--id`) and a dry run need no confirmation; otherwise --yes or
/// an answer on the terminal.
fn consent(args: &ReplayArgs, stdin_is_terminal: bool) -> Consent {
    if args.yes || args.dry_run || args.selection.id.is_some() {
        Consent::Given
    } else if stdin_is_terminal {
        Consent::Ask
    } else {
        Consent::Missing
    }
}

/// Asks on the terminal whether to replay `count` conversations.
async fn confirm(count: usize, skipped: u64) -> anyhow::Result<bool> {
    eprint!("replay {count} conversation(s) ({skipped} letter(s) skipped)? [y/N] ");
    let answer = tokio::task::spawn_blocking(|| {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).map(|_| line)
    })
    .await
    .context("cannot read the answer")?
    .context("cannot read the answer")?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}

/// One line of `dead replay`'s output.
#[derive(Debug, Serialize)]
struct Reported<'a> {
    action: &'static str,
    sequence: u64,
    id: Option<&'a str>,
    origin: Option<&'a str>,
    pool: &'a str,
    code: ErrorCode,
    #[serde(skip_serializing_if = "Option::is_none")]
    generation: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<String>,
}

impl fmt::Display for Reported<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let id = self.id.unwrap_or("-");
        match (self.generation, &self.reason) {
            (Some(generation), _) => write!(
                f,
                "{} {id} ({}) to pool {} as generation {generation}",
                self.action.replace('_', " "),
                self.origin.unwrap_or("-"),
                self.pool,
            ),
            (None, reason) => write!(
                f,
                "skipped seq {} ({id}): {}",
                self.sequence,
                reason.as_deref().unwrap_or("-")
            ),
        }
    }
}

/// `dead replay`: a first pass finds each selected conversation's newest letter and
/// counts what would be replayed; after consent, a second pass over the same letters
/// replays (or, with --dry-run, prints) each, as it is read.
pub(crate) async fn replay(nats: &NatsArgs, args: &ReplayArgs) -> anyhow::Result<()> {
    let selection = &args.selection;
    check_codes(&selection.code, args.include_denied, args.include_cancelled)?;
    let client = connect(nats).await?;
    let dead = DeadStreams::open(&client, selection).await?;
    let mut plan = Plan::new(args.include_denied, args.include_cancelled);
    let matched = dead
        .for_each(selection, async |stored| {
            plan.add(&stored);
            Ok(ControlFlow::Continue(()))
        })
        .await?;
    if let Some(wanted) = &selection.id
        && matched == 0
    {
        bail!(
            "no dead letter for id {wanted:?}{}",
            selection
                .pool
                .as_ref()
                .map(|p| format!(" in pool {p}"))
                .unwrap_or_default()
        );
    }
    let count = plan.to_replay();
    if count > 0 {
        match consent(args, std::io::stdin().is_terminal()) {
            Consent::Given => {}
            Consent::Ask => {
                if !confirm(count, plan.to_skip()).await? {
                    bail!("nothing replayed");
                }
            }
            Consent::Missing => bail!(
                "{count} conversation(s) would be replayed, and there is no terminal to \
                 confirm on: nothing replayed. Pass --yes to replay them (--dry-run lists \
                 them)"
            ),
        }
    }
    let operator = if args.dry_run || count == 0 {
        None
    } else {
        Some(operator(&client, client.subjects()).await?)
    };
    let (mut replayed, mut skipped) = (0_u64, 0_u64);
    dead.for_each(selection, async |stored| {
        let action = plan.action(&stored);
        let letter = &stored.letter;
        let mut line = Reported {
            action: "skipped",
            sequence: stored.sequence,
            id: letter.id.as_deref(),
            origin: letter.origin.as_deref(),
            pool: &letter.pool,
            code: letter.error.code,
            generation: None,
            reason: None,
        };
        match action {
            Action::Superseded => return Ok(ControlFlow::Continue(())),
            Action::Skip(skip) => line.reason = Some(skip.to_string()),
            Action::Replay { origin, generation } => match &operator {
                None => {
                    line.action = "would_replay";
                    line.generation = Some(generation);
                }
                Some(operator) => match replay_one(operator, letter, &origin, args.mode()).await? {
                    Ok(generation) => {
                        line.action = "replayed";
                        line.generation = Some(generation);
                    }
                    Err(e) => line.reason = Some(e.to_string()),
                },
            },
        }
        if line.generation.is_some() {
            replayed += 1;
        } else {
            skipped += 1;
        }
        if args.json {
            print_line(format_args!("{}", serde_json::to_string(&line)?))
        } else {
            print_line(format_args!("{line}"))
        }
    })
    .await?;
    if !args.json {
        let verb = if args.dry_run {
            "would be replayed"
        } else {
            "replayed"
        };
        let _ = print_line(format_args!("{replayed} {verb}, {skipped} skipped"))?;
    }
    Ok(())
}

/// Replays one letter. The outer error stops the command (NATS failed); the inner one
/// only skips this letter (it was replayed already, say: that letter is where the
/// operator wants it, so the command still succeeds).
async fn replay_one(
    operator: &Operator,
    letter: &DeadLetter,
    origin: &Origin,
    mode: Replay,
) -> anyhow::Result<Result<u64, ReplayError>> {
    match operator.replay(letter, mode).await {
        Err(e @ (ReplayError::Progress(_) | ReplayError::Publish(_))) => {
            Err(e).with_context(|| format!("cannot replay {origin}"))
        }
        result => Ok(result),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(value: &str) -> OffsetDateTime {
        OffsetDateTime::parse(value, &Rfc3339).expect("test time")
    }

    #[test]
    fn since_takes_an_rfc3339_time() {
        let now = at("2026-05-01T12:00:00Z");
        assert_eq!(
            parse_since("2026-04-30T08:15:00+02:00", now),
            Ok(at("2026-04-30T06:15:00Z"))
        );
    }

    #[test]
    fn since_takes_a_duration_ago() {
        let now = at("2026-05-01T12:00:00Z");
        assert_eq!(parse_since("1h", now), Ok(at("2026-05-01T11:00:00Z")));
        assert_eq!(parse_since("90m", now), Ok(at("2026-05-01T10:30:00Z")));
        assert_eq!(parse_since("2days", now), Ok(at("2026-04-29T12:00:00Z")));
        assert_eq!(parse_since("1h 30m", now), Ok(at("2026-05-01T10:30:00Z")));
    }

    #[test]
    fn since_refuses_what_is_neither_and_says_what_it_takes() {
        let now = at("2026-05-01T12:00:00Z");
        for value in ["yesterday", "2026-05-01", "12:00", "-1h", ""] {
            let error = parse_since(value, now).expect_err(value);
            assert!(error.contains("RFC 3339"), "{value}: {error}");
            assert!(error.contains(&format!("{value:?}")), "{value}: {error}");
        }
        let error = parse_since("100000000years", now).expect_err("too far");
        assert!(error.contains("representable"), "{error}");
    }

    #[test]
    fn codes_are_spelt_as_the_protocol_spells_them() {
        assert_eq!(parse_code("denied"), Ok(ErrorCode::Denied));
        assert_eq!(
            parse_code("retries_exhausted"),
            Ok(ErrorCode::RetriesExhausted)
        );
        let error = parse_code("Denied").expect_err("case matters");
        assert!(error.contains("invalid_request"), "{error}");
    }

    #[test]
    fn codes_come_repeated_or_comma_separated() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            selection: Selection,
        }
        let cli = <Cli as clap::Parser>::try_parse_from([
            "x",
            "--code",
            "denied,expired",
            "--code",
            "internal",
        ])
        .expect("parse");
        assert_eq!(
            cli.selection.code,
            [ErrorCode::Denied, ErrorCode::Expired, ErrorCode::Internal]
        );
        assert!(<Cli as clap::Parser>::try_parse_from(["x", "--code", "nope"]).is_err());
        assert!(<Cli as clap::Parser>::try_parse_from(["x", "--limit", "0"]).is_err());
    }

    fn letter(id: &str, code: ErrorCode, origin: Option<&str>, generation: u64) -> DeadLetter {
        serde_json::from_value(serde_json::json!({
            "pool": "default",
            "id": id,
            "generation": generation,
            "origin": origin,
            "error": {"code": code, "message": "failed"},
            "envelope": {"id": id, "method": "GET", "url": "https://example.com/"},
        }))
        .expect("letter")
    }

    fn stored(sequence: u64, letter: DeadLetter) -> StoredLetter {
        stored_in("WEBPROXY_POOL_DEFAULT_DEAD", sequence, letter)
    }

    fn stored_in(stream: &str, sequence: u64, letter: DeadLetter) -> StoredLetter {
        StoredLetter {
            stream: stream.to_string(),
            sequence,
            stored_at: String::new(),
            letter,
        }
    }

    #[test]
    fn selection_matches_every_filter_given() {
        let a = letter("a", ErrorCode::Denied, Some("S:1"), 0);
        let b = letter("b", ErrorCode::Expired, Some("S:2"), 0);
        let all = Selection::default();
        assert!(all.matches(&a) && all.matches(&b));
        let codes = Selection {
            code: vec![ErrorCode::Expired, ErrorCode::Internal],
            ..Selection::default()
        };
        assert!(!codes.matches(&a) && codes.matches(&b));
        let id = Selection {
            id: Some("a".into()),
            ..Selection::default()
        };
        assert!(id.matches(&a) && !id.matches(&b));
        let both = Selection {
            id: Some("a".into()),
            code: vec![ErrorCode::Expired],
            ..Selection::default()
        };
        assert!(!both.matches(&a) && !both.matches(&b));
    }

    #[test]
    fn replay_refuses_an_excluded_code_without_include_denied() {
        let error = check_codes(&[ErrorCode::Expired, ErrorCode::Denied], false, false)
            .expect_err("denied without --include-denied");
        assert!(error.to_string().contains("--include-denied"), "{error}");
        assert!(check_codes(&[ErrorCode::InvalidRequest], false, false).is_err());
        assert!(check_codes(&[ErrorCode::Denied], true, false).is_ok());
        assert!(check_codes(&[ErrorCode::Expired], false, false).is_ok());
    }

    #[test]
    fn the_newest_letter_of_each_conversation_is_replayed_once() {
        let letters = [
            stored(1, letter("a", ErrorCode::UpstreamError, Some("S:1"), 0)),
            stored(2, letter("b", ErrorCode::Expired, Some("S:2"), 0)),
            stored(3, letter("a", ErrorCode::UpstreamError, Some("S:1"), 1)),
        ];
        let mut plan = Plan::new(false, false);
        letters.iter().for_each(|l| plan.add(l));
        assert_eq!(plan.to_replay(), 2);
        let actions: Vec<Action> = letters.iter().map(|l| plan.action(l)).collect();
        assert_eq!(
            actions,
            [
                Action::Superseded,
                Action::Replay {
                    origin: Origin::new("S", 2),
                    generation: 1
                },
                Action::Replay {
                    origin: Origin::new("S", 1),
                    generation: 2
                },
            ]
        );
    }

    #[test]
    fn letters_of_the_retired_shared_stream_and_a_pool_stream_are_told_apart() {
        // The shared stream is read first; sequences repeat across streams.
        let letters = [
            stored_in(
                "WEBPROXY_DEAD",
                1,
                letter("a", ErrorCode::Internal, Some("S:1"), 0),
            ),
            stored_in(
                "WEBPROXY_POOL_DEFAULT_DEAD",
                1,
                letter("b", ErrorCode::Internal, Some("S:2"), 0),
            ),
            stored_in(
                "WEBPROXY_POOL_DEFAULT_DEAD",
                2,
                letter("a", ErrorCode::Internal, Some("S:1"), 1),
            ),
        ];
        let mut plan = Plan::new(false, false);
        letters.iter().for_each(|l| plan.add(l));
        assert_eq!(plan.to_replay(), 2);
        assert_eq!(plan.action(&letters[0]), Action::Superseded);
        assert_eq!(
            plan.action(&letters[1]),
            Action::Replay {
                origin: Origin::new("S", 2),
                generation: 1
            }
        );
        assert_eq!(
            plan.action(&letters[2]),
            Action::Replay {
                origin: Origin::new("S", 1),
                generation: 2
            }
        );
    }

    #[test]
    fn the_shared_stream_is_read_first_then_every_pools() {
        let subjects = webproxy_protocol::Subjects::new("webproxy").expect("prefix");
        let existing = [
            "WEBPROXY_POOL_B_DEAD",
            "WEBPROXY_POOL_B",
            "WEBPROXY_POOL_A_DEAD",
            "WEBPROXY_POOL_A_REPLIES",
            "WEBPROXY_DEAD",
            "OTHER_POOL_A_DEAD",
        ]
        .map(String::from);
        assert_eq!(
            dead_stream_names(&subjects, None, &existing),
            [
                "WEBPROXY_DEAD",
                "WEBPROXY_POOL_A_DEAD",
                "WEBPROXY_POOL_B_DEAD"
            ]
        );
        assert_eq!(
            dead_stream_names(&subjects, Some("b"), &existing),
            ["WEBPROXY_DEAD", "WEBPROXY_POOL_B_DEAD"]
        );
    }

    #[test]
    fn denied_and_invalid_requests_are_skipped_unless_included() {
        let letters = [
            stored(1, letter("a", ErrorCode::Denied, Some("S:1"), 0)),
            stored(2, letter("b", ErrorCode::InvalidRequest, Some("S:2"), 0)),
            stored(3, letter("c", ErrorCode::Internal, Some("S:3"), 0)),
        ];
        let mut plan = Plan::new(false, false);
        letters.iter().for_each(|l| plan.add(l));
        assert_eq!((plan.to_replay(), plan.to_skip()), (1, 2));
        assert_eq!(
            plan.action(&letters[0]),
            Action::Skip(Skip::Excluded(ErrorCode::Denied))
        );
        assert_eq!(
            plan.action(&letters[1]),
            Action::Skip(Skip::Excluded(ErrorCode::InvalidRequest))
        );
        let mut included = Plan::new(true, false);
        letters.iter().for_each(|l| included.add(l));
        assert_eq!(included.to_replay(), 3);
    }

    #[test]
    fn cancelled_letters_are_skipped_unless_included_and_the_reason_names_the_flag() {
        let letters = [
            stored(1, letter("a", ErrorCode::Cancelled, Some("S:1"), 0)),
            stored(2, letter("b", ErrorCode::Denied, Some("S:2"), 0)),
            stored(3, letter("c", ErrorCode::Internal, Some("S:3"), 0)),
        ];
        let plan_of = |include_denied, include_cancelled| {
            let mut plan = Plan::new(include_denied, include_cancelled);
            letters.iter().for_each(|l| plan.add(l));
            plan
        };
        let plan = plan_of(false, false);
        assert_eq!((plan.to_replay(), plan.to_skip()), (1, 2));
        let cancelled = plan.action(&letters[0]);
        assert_eq!(
            cancelled,
            Action::Skip(Skip::Excluded(ErrorCode::Cancelled))
        );
        let Action::Skip(skip) = cancelled else {
            panic!("cancelled is skipped");
        };
        assert_eq!(
            skip.to_string(),
            "cancelled (--include-cancelled replays it)"
        );
        let Action::Skip(skip) = plan.action(&letters[1]) else {
            panic!("denied is skipped");
        };
        assert_eq!(skip.to_string(), "denied (--include-denied replays it)");
        // Each flag includes its own codes only.
        let plan = plan_of(false, true);
        assert!(matches!(plan.action(&letters[0]), Action::Replay { .. }));
        assert!(matches!(plan.action(&letters[1]), Action::Skip(_)));
        let plan = plan_of(true, false);
        assert!(matches!(plan.action(&letters[0]), Action::Skip(_)));
        assert!(matches!(plan.action(&letters[1]), Action::Replay { .. }));
        assert_eq!(plan_of(true, true).to_replay(), 3);
    }

    #[test]
    fn replay_refuses_code_cancelled_without_include_cancelled() {
        let error = check_codes(&[ErrorCode::Cancelled], false, false)
            .expect_err("cancelled without --include-cancelled");
        assert!(error.to_string().contains("--include-cancelled"), "{error}");
        let error = check_codes(&[ErrorCode::Cancelled], true, false)
            .expect_err("--include-denied does not include cancelled");
        assert!(error.to_string().contains("--include-cancelled"), "{error}");
        let error = check_codes(&[ErrorCode::Cancelled, ErrorCode::Denied], false, true)
            .expect_err("--include-cancelled does not include denied");
        assert!(error.to_string().contains("--include-denied"), "{error}");
        assert!(check_codes(&[ErrorCode::Cancelled], false, true).is_ok());
        assert!(check_codes(&[ErrorCode::Cancelled, ErrorCode::Denied], true, true).is_ok());
    }

    #[test]
    fn letters_without_a_whole_request_or_an_origin_are_skipped() {
        let mut truncated = letter("a", ErrorCode::Internal, Some("S:1"), 0);
        truncated.truncated = true;
        let letters = [
            stored(1, truncated),
            stored(2, letter("b", ErrorCode::Internal, None, 0)),
            stored(3, letter("c", ErrorCode::Internal, Some("no-sequence"), 0)),
        ];
        let mut plan = Plan::new(true, false);
        letters.iter().for_each(|l| plan.add(l));
        assert_eq!(plan.to_replay(), 0);
        assert_eq!(plan.to_skip(), 3);
        assert_eq!(plan.action(&letters[0]), Action::Skip(Skip::Truncated));
        assert_eq!(plan.action(&letters[1]), Action::Skip(Skip::NoOrigin));
        assert!(matches!(
            plan.action(&letters[2]),
            Action::Skip(Skip::BadOrigin(_))
        ));
    }

    #[test]
    fn a_letter_stored_after_the_first_pass_is_not_replayed() {
        let mut plan = Plan::new(false, false);
        plan.add(&stored(1, letter("a", ErrorCode::Internal, Some("S:1"), 0)));
        let later = stored(9, letter("a", ErrorCode::Internal, Some("S:1"), 1));
        assert_eq!(plan.action(&later), Action::Superseded);
        let unseen = stored(10, letter("z", ErrorCode::Internal, Some("S:7"), 0));
        assert_eq!(plan.action(&unseen), Action::Superseded);
    }

    #[test]
    fn only_a_replay_of_many_conversations_needs_consent() {
        let args = |id: Option<&str>, dry_run, yes| ReplayArgs {
            selection: Selection {
                id: id.map(str::to_string),
                ..Selection::default()
            },
            include_denied: false,
            include_cancelled: false,
            dry_run,
            yes,
            json: false,
            again: false,
        };
        assert_eq!(consent(&args(None, false, false), false), Consent::Missing);
        assert_eq!(consent(&args(None, false, false), true), Consent::Ask);
        assert_eq!(consent(&args(None, false, true), false), Consent::Given);
        assert_eq!(consent(&args(None, true, false), false), Consent::Given);
        assert_eq!(
            consent(&args(Some("a"), false, false), false),
            Consent::Given
        );
    }
}
