//! `webproxy gateway key`: the operator's hands on the gateways' shared HMAC key in
//! `<PREFIX>_GATEWAY_KEY` (`export`, `restore`, `rotate`). A gateway never makes a key
//! once its deployment has had one, so a lost key bucket or key keeps every gateway
//! not ready until one of these puts a key there; the gateways read it within 2 s.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use clap::Subcommand;

use super::store::{self, Installed, KeyBucket};
use crate::commands::operator::{NatsArgs, connect_with_settings};

#[derive(Debug, Subcommand)]
pub(crate) enum KeyCommand {
    /// Print the shared key, or write it to a new file only its owner may read, so
    /// that `restore` can put it back if its bucket is lost.
    Export {
        /// A file to create (refused if it exists), instead of standard output.
        #[arg(long, value_name = "FILE")]
        to: Option<PathBuf>,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Put a key saved by `export` back, making the bucket if it is gone: ids minted
    /// under it are served again. Replacing another key needs --yes.
    Restore {
        /// The saved key (surrounding whitespace is ignored).
        #[arg(long, value_name = "FILE")]
        from: PathBuf,
        /// Replace a different key that is there.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Make a new random key, making the bucket if it is gone. Ids minted under the
    /// old key are no longer served, and keyed retries become new conversations, so
    /// replacing a key that is there needs --yes.
    Rotate {
        /// Replace the key that is there.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        nats: NatsArgs,
    },
}

/// The bucket as the configuration's prefix and `[streams]` name it; a configuration
/// that sets `[gateway] key` is warned about, since its gateways read no bucket.
async fn key_bucket(nats: &NatsArgs) -> anyhow::Result<KeyBucket> {
    let (client, settings) = connect_with_settings(nats).await?;
    if settings.config.gateway.key.is_some() {
        tracing::warn!(
            "this configuration sets [gateway] key: gateways run with it use that key, not the bucket's"
        );
    }
    let js = client.jetstream().clone();
    Ok(KeyBucket::new(
        &js,
        client.subjects(),
        &settings.config.streams,
    ))
}

pub(crate) async fn run(command: KeyCommand) -> anyhow::Result<()> {
    match command {
        KeyCommand::Export { to, nats } => {
            let keys = key_bucket(&nats).await?;
            let key = match store::running(keys.read().await?) {
                Ok(key) => key,
                Err(loss) => anyhow::bail!("no key to export: {}", loss.describe(keys.name())),
            };
            match to {
                Some(path) => write_private(&path, &key)?,
                None => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&key)?;
                    out.write_all(b"\n")?;
                }
            }
        }
        KeyCommand::Restore { from, yes, nats } => {
            let key = read_saved(&from)?;
            let keys = key_bucket(&nats).await?;
            report(
                &keys,
                keys.install(&key, yes).await?,
                "restored the gateway key",
            );
        }
        KeyCommand::Rotate { yes, nats } => {
            let keys = key_bucket(&nats).await?;
            let fresh = store::fresh_key()?;
            report(
                &keys,
                keys.install(&fresh, yes).await?,
                "made a new gateway key",
            );
        }
    }
    Ok(())
}

fn report(keys: &KeyBucket, installed: Installed, done: &str) {
    let name = keys.name();
    match installed {
        Installed::Unchanged => println!("{name} already holds this key; nothing changed"),
        Installed::Made | Installed::Replaced => println!(
            "{done} in {name}; gateways use it within 2 s (`webproxy gateway key export` saves it)"
        ),
    }
}

/// Creates `path` readable and writable by its owner only, holding `key` and a
/// newline; an existing file is never overwritten.
fn write_private(path: &Path, key: &[u8]) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    file.write_all(key)
        .and_then(|()| file.write_all(b"\n"))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// A saved key: the file's contents without surrounding whitespace, not empty.
fn read_saved(path: &Path) -> anyhow::Result<Vec<u8>> {
    let text = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let key = text.trim_ascii();
    anyhow::ensure!(!key.is_empty(), "{} holds no key", path.display());
    Ok(key.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exported_key_reads_back_the_same_and_is_never_overwritten() {
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("key");
        write_private(&path, b"0123abcd").expect("written");
        assert_eq!(read_saved(&path).expect("read"), b"0123abcd");
        let mode = std::fs::metadata(&path).expect("metadata");
        assert_eq!(
            std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
            0o600
        );
        assert!(write_private(&path, b"other").is_err());
        std::fs::write(&path, " \n").expect("emptied");
        assert!(read_saved(&path).is_err());
    }
}
