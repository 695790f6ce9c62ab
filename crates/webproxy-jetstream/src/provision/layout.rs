//! The layout streams and consumers were made for, in their metadata: reading it,
//! refusing a newer one, marking a pool being removed, the server version needed, and
//! retiring layout 2's shared streams.

use super::*;

/// The layout of streams and consumers this instance makes: `3` has per-conversation
/// hop and retry subjects, stored replies per conversation, a replies stream and a
/// dead-letter stream per pool (`<POOL STREAM>_REPLIES`, `<POOL STREAM>_DEAD`, each with
/// its own byte budget) and the consumers `<prefix>-<pool>-l3` and
/// `<prefix>-<pool>-retry-l3`. Layout 2 had the same subjects but one replies stream
/// and one dead-letter stream shared by every pool (and consumers named `-l2`); layout
/// 1 (webproxy before the conversation core) had one retry subject per pool and stored
/// every reply.
pub const LAYOUT: u32 = 3;

/// The metadata key holding a stream's or consumer's layout; absent means layout 1.
pub const LAYOUT_KEY: &str = "webproxy.layout";

/// The metadata key `webproxy pools remove` sets to `"true"` before it deletes a pool,
/// so that no instance recreates what it is taking away.
pub const REMOVING_KEY: &str = "removing";

/// The layout recorded in `metadata`: absent is layout 1, the one before layouts were
/// recorded; `None` when the value is no layout number.
pub fn layout(metadata: &HashMap<String, String>) -> Option<u32> {
    match metadata.get(LAYOUT_KEY) {
        None => Some(1),
        Some(value) => value.trim().parse().ok(),
    }
}

/// Whether `webproxy pools remove` has marked the stream for removal.
pub(crate) fn marked_removing(metadata: &HashMap<String, String>) -> bool {
    metadata.get(REMOVING_KEY).is_some_and(|v| v == "true")
}

/// A stream that `pools remove` could not mark for removal.
#[derive(Debug, Error)]
pub enum RemovalError {
    #[error("cannot read the pool's stream")]
    Read(#[source] async_nats::Error),
    #[error("cannot mark stream {stream} for removal")]
    Update {
        stream: String,
        #[source]
        source: async_nats::Error,
    },
    #[error("stream {0} did not keep its removal mark")]
    NotKept(String),
}

/// Marks `stream` for removal ([`REMOVING_KEY`]), keeping the rest of its config, so
/// that no instance provisions it or recreates its consumers while `pools remove`
/// takes it away.
pub async fn mark_removing(
    js: &jetstream::Context,
    stream: &mut stream::Stream,
) -> Result<(), RemovalError> {
    let mut config = stream
        .info()
        .await
        .map_err(|e| RemovalError::Read(e.into()))?
        .config
        .clone();
    let name = config.name.clone();
    config
        .metadata
        .insert(REMOVING_KEY.to_string(), "true".to_string());
    let updated = js
        .update_stream(config)
        .await
        .map_err(|e| RemovalError::Update {
            stream: name.clone(),
            source: e.into(),
        })?;
    if !marked_removing(&updated.config.metadata) {
        return Err(RemovalError::NotKept(name));
    }
    Ok(())
}

/// `existing` metadata with this instance's layout recorded; every other key (the
/// server's own `_nats.*`, an operator's) is kept.
pub fn with_layout(existing: &HashMap<String, String>) -> HashMap<String, String> {
    let mut metadata = existing.clone();
    metadata.insert(LAYOUT_KEY.to_string(), LAYOUT.to_string());
    metadata
}

/// Why an instance leaves a stream alone.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutRefusal {
    /// A newer webproxy made it (or its layout cannot be read): migrating it back
    /// would break that version's instances.
    #[error(
        "its layout {found:?} is newer than this instance's layout {own}; leaving it alone and staying not ready (roll forward, or see docs/operations.md to roll back)"
    )]
    NewerLayout { found: String, own: u32 },
    /// An older layout, which only provisioning migrates.
    #[error("its layout {found} is older than this instance's layout {own}; a restart migrates it")]
    OlderLayout { found: u32, own: u32 },
    /// `webproxy pools remove` is taking the pool away.
    #[error(
        "it is marked for removal by `webproxy pools remove`; run that command again to finish"
    )]
    Removing,
    /// The stream does not exist.
    #[error("it does not exist")]
    Missing,
}

impl LayoutRefusal {
    /// The stream is gone or going: `pools remove` took the pool away.
    pub fn is_removal(&self) -> bool {
        matches!(self, LayoutRefusal::Removing | LayoutRefusal::Missing)
    }
}

/// What provisioning does with an existing stream, given its metadata (pure).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Examined {
    /// This instance's layout: update it in place.
    Current,
    /// An older layout: fence its instances out, then update it.
    Migrate { from: u32 },
    /// Leave it alone.
    Refuse(LayoutRefusal),
}

/// Decides what to do with an existing stream from its metadata (pure).
pub fn examine(metadata: &HashMap<String, String>) -> Examined {
    if marked_removing(metadata) {
        return Examined::Refuse(LayoutRefusal::Removing);
    }
    match layout(metadata) {
        Some(found) if found == LAYOUT => Examined::Current,
        Some(found) if found < LAYOUT => Examined::Migrate { from: found },
        _ => Examined::Refuse(LayoutRefusal::NewerLayout {
            found: metadata.get(LAYOUT_KEY).cloned().unwrap_or_default(),
            own: LAYOUT,
        }),
    }
}

/// The oldest server webproxy runs against: it needs multi-filter consumers, create
/// actions and TERM with a reason (2.10), and consumer pause (2.11), which the pool
/// consumers' owner keeps across updates.
pub const MIN_SERVER_VERSION: (u64, u64) = (2, 11);

/// Whether a server version string (`"2.11.4"`, `"v2.15.1"`) is new enough.
pub fn server_version_supported(version: &str) -> bool {
    let mut parts = version
        .trim_start_matches('v')
        .split(['.', '-'])
        .map(|p| p.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) >= MIN_SERVER_VERSION,
        _ => false,
    }
}

/// What becomes of layout 2's shared replies or dead-letter stream (pure), given its
/// subjects and metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Retirement {
    /// Retired already (it captures only `retired`): nothing to do.
    Done,
    /// Take its subjects away: they become `retired`, and its layout this one's.
    Retire,
    /// A newer layout made it what it is, or it is being removed: leave it alone.
    Refuse(LayoutRefusal),
}

pub(crate) fn retirement(
    subjects: &[String],
    metadata: &HashMap<String, String>,
    retired: &str,
) -> Retirement {
    match examine(metadata) {
        Examined::Refuse(refusal) => Retirement::Refuse(refusal),
        _ if subjects.len() == 1 && subjects[0] == retired => Retirement::Done,
        _ => Retirement::Retire,
    }
}

/// Retires layout 2's shared stream `name` (the replies or the dead letters of every
/// pool): its subjects become `retired`, which nothing publishes on, so that each
/// pool's own stream may capture what it captured. What it stored stays, readable by
/// subject until its `max_age` ends it (readers look there when a pool's own stream
/// has nothing for a subject); its limits are kept. Its metadata records this layout,
/// so an instance of layout 2 that starts again refuses it as newer, and its rewrite
/// of the dead-letter stream (which it makes without looking at the layout) lists
/// subjects that now overlap the pools' streams and fails with err_code 10065: either
/// way it stays not ready. A missing stream is fine: a deployment that began at
/// layout 3 never had one.
pub async fn retire_shared_stream(
    js: &jetstream::Context,
    name: &str,
    retired: String,
) -> Result<(), ProvisionError> {
    let what = || format!("stream {name}");
    let Some((_, info)) = existing_stream(js, name).await? else {
        return Ok(());
    };
    let mut config = info.config;
    match retirement(&config.subjects, &config.metadata, &retired) {
        Retirement::Done => return Ok(()),
        Retirement::Refuse(refusal) => {
            error!(stream = %name, own_layout = LAYOUT, "not retiring stream {name}: {refusal}");
            return Err(refused(what(), refusal));
        }
        Retirement::Retire => {}
    }
    warn!(stream = %name, from = %config.subjects.join(", "), to = %retired, "retiring the shared stream {name}: each pool's own stream stores what it stored from now on; what it holds stays readable until it ages out, and instances of layout 2 are fenced out");
    config.subjects = vec![retired];
    config.metadata = with_layout(&config.metadata);
    js.update_stream(config)
        .await
        .map_err(|e| provision_error(what(), e))?;
    Ok(())
}
