//! A Kubernetes Secret volume on disk, for tests of secret files rotated while running.

/// A Kubernetes Secret volume as the kubelet writes it: each version in a directory of
/// its own, `..data` a symlink to the current one, and the file read a symlink through
/// `..data`.
pub struct SecretVolume {
    dir: tempfile::TempDir,
    key: String,
    versions: usize,
}

impl SecretVolume {
    /// A volume holding one key, `key`, at its first version `value`.
    pub fn new(key: &str, value: &str) -> SecretVolume {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut volume = SecretVolume {
            dir,
            key: key.to_string(),
            versions: 0,
        };
        volume.publish(value);
        std::os::unix::fs::symlink(format!("..data/{key}"), volume.dir.path().join(key))
            .expect("symlink the key");
        volume
    }

    /// The path a configuration names: a symlink through `..data`.
    pub fn path(&self) -> std::path::PathBuf {
        self.dir.path().join(&self.key)
    }

    /// A new version directory, then `..data` swapped to it in one rename, the old one
    /// removed. The new file gets the old one's modification time, so only its
    /// contents tell the versions apart.
    pub fn publish(&mut self, value: &str) {
        let root = self.dir.path();
        self.versions += 1;
        let version = format!("..version_{}", self.versions);
        std::fs::create_dir(root.join(&version)).expect("version dir");
        let file = root.join(&version).join(&self.key);
        std::fs::write(&file, format!("{value}\n")).expect("write secret");
        let previous = root.join(format!("..version_{}", self.versions - 1));
        if previous.exists() {
            let old_time = std::fs::metadata(previous.join(&self.key))
                .and_then(|m| m.modified())
                .expect("the old version's modification time");
            std::fs::File::options()
                .write(true)
                .open(&file)
                .and_then(|f| f.set_modified(old_time))
                .expect("give the new version the old modification time");
        }
        std::os::unix::fs::symlink(&version, root.join("..data_tmp")).expect("symlink");
        std::fs::rename(root.join("..data_tmp"), root.join("..data")).expect("swap ..data");
        if previous.exists() {
            std::fs::remove_dir_all(previous).expect("remove the old version");
        }
    }
}
