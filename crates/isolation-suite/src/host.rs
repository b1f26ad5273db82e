//! The suite's own view of the host: finding a session's sentinels among the storage the runtime
//! reports, and hashing them there.

use std::fs;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// How deep below a storage reference the search goes.
const MAX_DEPTH: usize = 8;
/// How many directory entries one search looks at, at most.
const MAX_ENTRIES: usize = 200_000;

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        })
}

/// The lower-case hex SHA-256 of `data`.
pub(crate) fn sha256_hex(data: &[u8]) -> String {
    hex(&Sha256::digest(data))
}

/// The SHA-256 of a host file, `None` if it cannot be read.
pub(crate) fn file_sha256(path: &Path) -> Option<String> {
    fs::read(path).ok().map(|data| sha256_hex(&data))
}

/// What a host candidate must be.
#[derive(Debug, Clone)]
pub(crate) enum Expect {
    /// A regular file with this SHA-256.
    File(String),
    /// A directory.
    Dir,
}

impl Expect {
    fn matches(&self, path: &Path) -> bool {
        let Ok(meta) = fs::symlink_metadata(path) else {
            return false;
        };
        match self {
            Self::File(sha256) => meta.is_file() && file_sha256(path).as_deref() == Some(sha256),
            Self::Dir => meta.is_dir(),
        }
    }
}

/// Finds a session's file or directory on the host: at its in-worker path itself (a runtime that
/// isolates nothing runs its workers on the host's filesystem), else by name below each storage
/// reference that is an absolute host directory. Symbolic links are not followed. Blocking.
pub(crate) fn locate(
    storage_refs: &[String],
    in_worker: &str,
    name: &str,
    expect: &Expect,
) -> Option<PathBuf> {
    let direct = Path::new(in_worker);
    if direct.is_absolute() && expect.matches(direct) {
        return Some(direct.to_path_buf());
    }
    let mut budget = MAX_ENTRIES;
    storage_refs
        .iter()
        .map(Path::new)
        .filter(|root| root.is_absolute())
        .find_map(|root| search(root, name, expect, &mut budget))
}

fn search(root: &Path, name: &str, expect: &Expect, budget: &mut usize) -> Option<PathBuf> {
    let mut pending = vec![(root.to_path_buf(), 0usize)];
    while let Some((dir, depth)) = pending.pop() {
        let Ok(entries) = fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if *budget == 0 {
                return None;
            }
            *budget -= 1;
            let path = entry.path();
            if entry.file_name() == name && expect.matches(&path) {
                return Some(path);
            }
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            if is_dir && depth < MAX_DEPTH {
                pending.push((path, depth + 1));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_empty_input() {
        assert_eq!(
            sha256_hex(b""),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    #[test]
    fn locate_finds_by_name_below_a_storage_ref() {
        let root = std::env::temp_dir().join(format!("isolation-suite-host-{}", std::process::id()));
        let nested = root.join("s1").join("home");
        fs::create_dir_all(&nested).unwrap();
        fs::write(nested.join("oab-sentinel-x"), b"content\n").unwrap();
        let refs = vec![root.display().to_string(), "volume-name".to_owned()];
        let expect = Expect::File(sha256_hex(b"content\n"));
        let found = locate(&refs, "/home/agent/oab-sentinel-x", "oab-sentinel-x", &expect);
        assert_eq!(found, Some(nested.join("oab-sentinel-x")));
        // Same name, other content: not the sentinel.
        let other = Expect::File(sha256_hex(b"other\n"));
        assert_eq!(
            locate(&refs, "/home/agent/oab-sentinel-x", "oab-sentinel-x", &other),
            None
        );
        fs::remove_dir_all(&root).unwrap();
    }
}
