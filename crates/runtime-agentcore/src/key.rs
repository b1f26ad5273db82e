//! The broker's relay key, kept in the state directory.
//!
//! It must outlive broker restarts: the runtime session ids (and so the microVMs and their
//! session storage) of every session are derived from it. It never leaves the broker: microVMs
//! see only hashes of the tokens derived from it.

use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use worker_relay::BrokerKey;

/// The key's length in bytes.
const KEY_LEN: usize = 32;

/// Reads the key at `path`, or makes one (mode 0600, from the system's random source) if there
/// is none. Two processes making it at once agree: only the first file is kept.
///
/// # Errors
/// The I/O error, or `InvalidData` for a file that is not a key.
pub(crate) fn load_or_create(path: &Path) -> io::Result<BrokerKey> {
    match std::fs::read(path) {
        Ok(bytes) => return parse(&bytes, path),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let mut key = [0u8; KEY_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
    let temporary = path.with_extension(format!("tmp-{}", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&temporary)?;
    file.write_all(&key)?;
    file.sync_all()?;
    // A hard link fails if another process made the key first; then its key is the one.
    let linked = std::fs::hard_link(&temporary, path);
    let _ = std::fs::remove_file(&temporary);
    match linked {
        Ok(()) => Ok(BrokerKey::new(key.to_vec())),
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => parse(&std::fs::read(path)?, path),
        Err(error) => Err(error),
    }
}

fn parse(bytes: &[u8], path: &Path) -> io::Result<BrokerKey> {
    if bytes.len() != KEY_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} holds {} bytes, not a {KEY_LEN}-byte relay key",
                path.display(),
                bytes.len()
            ),
        ));
    }
    Ok(BrokerKey::new(bytes.to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_made_once_and_read_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("a directory");
        let path = dir.path().join("relay.key");
        let first = load_or_create(&path).expect("made");
        let mode = std::fs::metadata(&path).expect("the file").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = load_or_create(&path).expect("read");
        assert_eq!(first.token("s", 1), again.token("s", 1));
        std::fs::write(&path, b"short").expect("overwrite");
        assert_eq!(
            load_or_create(&path).expect_err("bad").kind(),
            io::ErrorKind::InvalidData
        );
    }
}
