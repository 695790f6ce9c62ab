//! Fence streams: subjects an older layout's instances would write, captured so that
//! their rewrite of a stream fails instead of taking a pool away.

use super::*;

/// A fence: a tiny stream that captures `subject`, a subject an instance of layout 1
/// lists in one of its streams and layout 2 never uses. Two streams' subjects may not
/// overlap, so that instance's rewrite of its stream fails (err_code 10065) instead of
/// undoing the migration. It keeps at most one message (an old instance's last stray
/// publish, which nothing reads), on file: a memory fence is gone after a restart of
/// the server, and with it the fence, until a pod of this layout starts again.
pub(crate) fn fence_config(name: String, subject: String) -> stream::Config {
    stream::Config {
        name,
        description: Some(
            "webproxy fence: keeps instances of an older layout from rewriting a stream"
                .to_string(),
        ),
        subjects: vec![subject],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        max_messages: 1,
        discard: stream::DiscardPolicy::Old,
        metadata: with_layout(&HashMap::new()),
        ..Default::default()
    }
}

/// The fence of a pool stream: it captures layout 1's `<prefix>.retry.<pool>`.
pub fn pool_fence_config(settings: &Settings, pool: &str) -> stream::Config {
    let subjects = &settings.subjects;
    fence_config(
        subjects.pool_fence_stream(pool),
        subjects.layout1_retry(pool),
    )
}

/// The fence of the replies stream: it captures `<prefix>.reply.*.*`, which layout 1's
/// `<prefix>.reply.>` overlaps.
pub fn replies_fence_config(settings: &Settings) -> stream::Config {
    let subjects = &settings.subjects;
    fence_config(
        subjects.replies_fence_stream(),
        subjects.replies_fence_subject(),
    )
}

/// How a fence is brought to its config, given the storage of the one there (pure).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FenceStep {
    /// None there, or one on the wanted storage: create it, or update it in place.
    CreateOrUpdate,
    /// One on other storage (a memory fence of an earlier release), which an update
    /// cannot change: delete it and create it again.
    Move,
}

pub(crate) fn fence_step(
    found: Option<stream::StorageType>,
    wanted: stream::StorageType,
) -> FenceStep {
    match found {
        Some(storage) if storage != wanted => FenceStep::Move,
        _ => FenceStep::CreateOrUpdate,
    }
}

/// Creates or updates a fence, moving one on other storage by deleting it and
/// creating it again. Deleting loses at most the one stray message of an old instance
/// it holds, which nothing reads. An old instance that rewrites its stream in the gap
/// adds the fence's subject to that stream, so the fence's creation then fails (10065),
/// provisioning fails and its retry migrates the stream again and makes the fence: the
/// gap cannot undo a migration for longer than that retry.
pub async fn make_fence(
    js: &jetstream::Context,
    fence: stream::Config,
) -> Result<(), ProvisionError> {
    let name = fence.name.clone();
    let what = || format!("fence stream {name}");
    let found = existing_stream(js, &name)
        .await?
        .map(|(_, info)| info.config.storage);
    if fence_step(found, fence.storage) == FenceStep::Move {
        warn!(stream = %name, from = found.map_or("none", storage_name), to = storage_name(fence.storage), "moving fence stream {name}: deleting it and creating it again");
        match js.delete_stream(&name).await {
            Ok(_) => {}
            // Another instance moved it first.
            Err(e) if crate::state::is_stream_not_found(&e.kind()) => {}
            Err(e) => return Err(provision_error(what(), e)),
        }
    }
    js.create_or_update_stream(fence)
        .await
        .map_err(|e| provision_error(what(), e))?;
    Ok(())
}
