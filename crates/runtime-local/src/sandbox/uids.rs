//! A uid of its own for each session, claimed by atomically creating a file.
//!
//! ```text
//! root/.uids/            0700
//!   <uid>                content: the session id holding it (written before the name appears)
//!   .claim-<id>-...      a claim being made (renamed into place by a hard link)
//!   .lock                flock: claims are made and released one at a time, across brokers
//! ```
//!
//! A claim is made by writing the session id to a private temporary file and hard-linking it to
//! `root/.uids/<uid>`: `link(2)` fails if the name exists, so exactly one claimant wins, even
//! across broker processes, and a claim is never seen half-written.
//!
//! A claim is released only while its session has no storage, checked under the lock. Creating a
//! session makes its directory before it claims (under the same lock), so a release can never
//! take the uid of a session that is being created by another broker process: either the
//! release sees the new directory and keeps the claim, or the creation finds no claim and makes
//! a new one.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use session_runtime::{Error, SessionId};

/// The uids (and gids: each session's gid is its uid) handed to sessions:
/// 200000 to 265535, above the usual ranges of regular users (1000 to 60000) and of systemd's
/// dynamic users (61184 to 65519). Numbers the host uses (an account or group in `/etc/passwd`
/// or `/etc/group`, or a range in `/etc/subuid` or `/etc/subgid`, where rootless containers map
/// their users) are skipped.
pub(crate) const UID_RANGE: Range<u32> = 200_000..265_536;

/// The directory of claims under the runtime's root.
const UIDS_DIR: &str = ".uids";

/// Distinguishes concurrent claims of one process.
static CLAIMS: AtomicU64 = AtomicU64::new(0);

/// Ids the host already uses, which are never handed out.
#[derive(Debug, Clone, Default)]
pub(crate) struct HostIds {
    /// Single uids and gids.
    pub(crate) ids: HashSet<u32>,
    /// Ranges of subordinate ids.
    pub(crate) ranges: Vec<Range<u32>>,
}

impl HostIds {
    /// Reads `/etc/passwd`, `/etc/group`, `/etc/subuid` and `/etc/subgid` (missing files are empty).
    pub(crate) fn read() -> Self {
        let mut host = HostIds::default();
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        for line in read("/etc/passwd").lines() {
            let fields: Vec<&str> = line.split(':').collect();
            host.ids.extend(
                fields
                    .iter()
                    .skip(2)
                    .take(2)
                    .filter_map(|f| f.parse::<u32>().ok()),
            );
        }
        for line in read("/etc/group").lines() {
            host.ids
                .extend(line.split(':').nth(2).and_then(|f| f.parse::<u32>().ok()));
        }
        for line in read("/etc/subuid").lines().chain(read("/etc/subgid").lines()) {
            let mut fields = line.split(':').skip(1);
            if let (Some(Ok(start)), Some(Ok(count))) = (
                fields.next().map(str::parse::<u32>),
                fields.next().map(str::parse::<u32>),
            ) {
                host.ranges.push(start..start.saturating_add(count));
            }
        }
        host
    }

    /// Whether `id` is in use on the host.
    fn uses(&self, id: u32) -> bool {
        self.ids.contains(&id) || self.ranges.iter().any(|range| range.contains(&id))
    }
}

fn storage_error(what: &str, error: io::Error) -> Error {
    crate::backend_error(true, what, error)
}

/// The claims directory, created 0700 if missing.
fn claims_dir(root: &Path) -> Result<PathBuf, Error> {
    let dir = root.join(UIDS_DIR);
    match std::fs::create_dir(&dir) {
        Ok(()) => std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| storage_error("protecting the uid claims directory", e))?,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(storage_error("creating the uid claims directory", e)),
    }
    crate::layout::plain_dir(&dir).map_err(|e| storage_error("checking the uid claims directory", e))?;
    Ok(dir)
}

/// The claims directory's lock, held while claims are made or released. Released explicitly on
/// drop, for the reason the session lock is (a child forked meanwhile holds a copy until it execs).
struct ClaimsLock(File);

impl Drop for ClaimsLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

impl ClaimsLock {
    /// Waits for the lock of the claims directory `dir` (held for a few file operations at most).
    fn acquire(dir: &Path) -> Result<Self, Error> {
        // Never through a link: one planted as the lock would make this create a file anywhere.
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
            .open(dir.join(".lock"))
            .map_err(|e| storage_error("opening the uid claims lock", e))?;
        file.lock()
            .map_err(|e| storage_error("locking the uid claims", e))?;
        Ok(Self(file))
    }
}

/// Every claim in `dir`: (uid, holder).
fn claims(dir: &Path) -> Result<Vec<(u32, String)>, Error> {
    // Never through a link: releasing a claim deletes files in this directory.
    crate::layout::plain_dir(dir).map_err(|e| storage_error("checking the uid claims directory", e))?;
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(storage_error("reading uid claims", e)),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| storage_error("reading uid claims", e))?;
        let Some(uid) = entry
            .file_name()
            .to_str()
            .and_then(|name| name.parse::<u32>().ok())
        else {
            continue;
        };
        match std::fs::read_to_string(entry.path()) {
            Ok(holder) => found.push((uid, holder.trim().to_owned())),
            // Released meanwhile.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(storage_error("reading a uid claim", e)),
        }
    }
    Ok(found)
}

/// Where in `range` the search for `id`'s uid starts: spread by the id, so sessions rarely probe
/// the same numbers and a session tends to get its old uid back after a release.
fn start_offset(id: &SessionId, len: u32) -> u32 {
    let hash = id.as_str().bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    u32::try_from(hash % u64::from(len.max(1))).unwrap_or(0)
}

/// Claims a uid from `range` for `id` under `root`, skipping ids `host` uses; returns `id`'s
/// existing claim if it has one.
///
/// # Errors
///
/// [`Error::Backend`] if the claims cannot be read or written, or `range` is exhausted.
pub(crate) fn allocate_in(
    root: &Path,
    id: &SessionId,
    range: Range<u32>,
    host: &HostIds,
) -> Result<u32, Error> {
    let dir = claims_dir(root)?;
    let _lock = ClaimsLock::acquire(&dir)?;
    let existing = claims(&dir)?;
    if let Some((uid, _)) = existing.iter().find(|(_, holder)| holder == id.as_str()) {
        return Ok(*uid);
    }
    let taken: HashSet<u32> = existing.iter().map(|(uid, _)| *uid).collect();
    let len = range.end.saturating_sub(range.start);
    let temp = dir.join(format!(
        ".claim-{id}-{}-{}",
        std::process::id(),
        CLAIMS.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&temp, id.as_str()).map_err(|e| storage_error("writing a uid claim", e))?;
    let result = (|| {
        let start = start_offset(id, len);
        for step in 0..len {
            let uid = range.start + (start + step) % len;
            if taken.contains(&uid) || host.uses(uid) {
                continue;
            }
            match std::fs::hard_link(&temp, dir.join(uid.to_string())) {
                Ok(()) => return Ok(uid),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(storage_error("claiming a uid", e)),
            }
        }
        Err(Error::Backend {
            runtime: crate::RUNTIME,
            retryable: true,
            message: format!(
                "session {id} needs a uid of its own, but all {len} uids from {} to {} are taken",
                range.start,
                range.end.saturating_sub(1)
            ),
            source: None,
        })
    })();
    let _ = std::fs::remove_file(&temp);
    result
}

/// Every claim under `root`: (uid, holder).
///
/// # Errors
///
/// [`Error::Backend`] if the claims cannot be read.
pub(crate) fn claims_in(root: &Path) -> Result<Vec<(u32, String)>, Error> {
    claims(&root.join(UIDS_DIR))
}

/// Removes `id`'s claims under `root`, unless `has_storage` (asked under the claims lock) says
/// the session still has storage. Idempotent.
///
/// # Errors
///
/// [`Error::Backend`] if the claims cannot be read or removed.
pub(crate) fn release_in(
    root: &Path,
    id: &SessionId,
    has_storage: impl FnOnce() -> bool,
) -> Result<(), Error> {
    let dir = root.join(UIDS_DIR);
    // Never through a link (releasing deletes files there); missing: no claim was ever made.
    if !crate::layout::plain_dir(&dir).map_err(|e| storage_error("checking the uid claims directory", e))? {
        return Ok(());
    }
    let _lock = ClaimsLock::acquire(&dir)?;
    if has_storage() {
        return Ok(());
    }
    for (uid, holder) in claims(&dir)? {
        if holder == id.as_str() {
            match std::fs::remove_file(dir.join(uid.to_string())) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(storage_error("releasing a uid", e)),
            }
        }
    }
    Ok(())
}
