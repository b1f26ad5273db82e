//! The durable session record: `root/<session id>/record.json`, and the current boot's
//! transitional state beside it, `record.boot.json`.
//!
//! Together they are the authority on a session's state and generation. Each is replaced
//! atomically (write a temporary file, rename it over the file), so a crash leaves either the
//! old or the new one, never a torn one.
//!
//! Records of states at rest (`created`, `suspended`, `closed`) go to `record.json`, made durable
//! against a host crash: the file and its directory are fsynced before the call returns, and the
//! transitional file is then removed. Transitional records (`provisioning`, the launch intent and
//! pid of a `running` worker, `closing`) go to `record.boot.json` only, tagged with the kernel's
//! boot id and not fsynced, which survives a killed broker (the page cache is the kernel's) but
//! not a host crash. A transitional record overrides the one at rest while it exists and was
//! written in the current boot; one from an earlier boot, or an empty one (what a file system that
//! does not flush a renamed file leaves after a host crash), is ignored, so a host crash leaves
//! the last record at rest in force, never an empty `record.json`. That is enough because a host
//! crash ends every worker, and no durable side effect follows a transitional record before the
//! next record at rest: retained storage is moved only after `closed` is durable, storage to
//! delete leaves the root with its record (that move, fsynced, is the close: a session without a
//! directory is closed), and a lost `provisioning` record leaves a directory that `create` adopts
//! again. It keeps create → attach → close with deletion at one file fsync (the record at create)
//! and two of directories.
//!
//! A record read from disk is untrusted: it must parse, have a known version, and name the
//! session whose directory it sits in; it never supplies a path.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use session_runtime::{
    CloseReason, Error, Generation, SessionId, SessionIdentity, SessionOverlay, SessionState, SessionStatus,
    StartFailure, StorageState, SuspendReason, WorkerInfo,
};

use crate::process::ProcessRef;
use crate::RUNTIME;

/// The record format version this code writes and reads.
const VERSION: u32 = 1;
/// Records larger than this are not read (a record is a few hundred bytes, plus its session
/// overlay: at most `MAX_OVERLAY_BYTES`, which JSON's escapes can make six times larger).
const MAX_RECORD_BYTES: u64 = 256 * 1024;
const _: () =
    assert!(MAX_RECORD_BYTES as usize >= 6 * session_runtime::overlay::MAX_OVERLAY_BYTES + 64 * 1024);

/// Where a session is, including the provisioning step before it is usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Phase {
    /// `create` started provisioning; storage may be incomplete.
    Provisioning,
    /// A contract state.
    #[serde(untagged)]
    Session(SessionState),
}

/// The process running a session's worker, as recorded when it was started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerRecord {
    /// The worker's generation.
    pub(crate) generation: Generation,
    /// The worker's top process (its process group leader); `None` between the launch intent
    /// and the spawn.
    pub(crate) process: Option<ProcessRef>,
    /// The broker process that started it.
    pub(crate) broker: ProcessRef,
    /// When it was started.
    pub(crate) started_at: SystemTime,
}

/// Evidence that a directory is the one this runtime created for the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DirEvidence {
    pub(crate) dev: u64,
    pub(crate) ino: u64,
}

impl DirEvidence {
    pub(crate) fn of(path: &Path) -> io::Result<Self> {
        use std::os::unix::fs::MetadataExt;
        let meta = fs::symlink_metadata(path)?;
        Ok(Self {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// The durable record of one session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SessionRecord {
    pub(crate) version: u32,
    pub(crate) id: SessionId,
    /// SHA-256 of the identity's canonical encoding: evidence of which identity the storage
    /// belongs to, without keeping the raw thread id on disk.
    pub(crate) identity_digest: String,
    pub(crate) installation: String,
    pub(crate) phase: Phase,
    pub(crate) generation: Generation,
    /// Counts creates of this id; storage of different incarnations is never shared.
    pub(crate) incarnation: u64,
    pub(crate) created_at: SystemTime,
    pub(crate) last_activity: SystemTime,
    pub(crate) suspend_reason: Option<SuspendReason>,
    pub(crate) close_reason: Option<CloseReason>,
    pub(crate) storage: StorageState,
    pub(crate) evidence: DirEvidence,
    pub(crate) uid: Option<u32>,
    pub(crate) worker: Option<WorkerRecord>,
    /// Why the last attempt to start a worker failed; cleared when one starts. Absent from
    /// records written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_start_failure: Option<StartFailure>,
    /// The broker's working directory and environment for the session's workers (its `Debug`
    /// shows no values); absent from records written before it existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) overlay: Option<SessionOverlay>,
}

impl SessionRecord {
    pub(crate) fn new(
        identity: &SessionIdentity,
        incarnation: u64,
        generation: Generation,
        evidence: DirEvidence,
    ) -> Self {
        let now = SystemTime::now();
        Self {
            version: VERSION,
            id: identity.id(),
            identity_digest: hex(&identity.digest()),
            installation: identity.installation().to_owned(),
            phase: Phase::Provisioning,
            generation,
            incarnation,
            created_at: now,
            last_activity: now,
            suspend_reason: None,
            close_reason: None,
            storage: StorageState::Present,
            evidence,
            uid: None,
            worker: None,
            last_start_failure: None,
            overlay: None,
        }
    }

    /// The contract state; a session still provisioning reads as `Created` with no worker.
    pub(crate) fn state(&self) -> SessionState {
        match self.phase {
            Phase::Provisioning => SessionState::Created,
            Phase::Session(state) => state,
        }
    }

    pub(crate) fn status(&self, storage_refs: Vec<String>) -> SessionStatus {
        let mut status = SessionStatus::new(self.id, self.created_at);
        status.state = self.state();
        status.generation = self.generation;
        status.worker = self
            .worker
            .filter(|w| w.process.is_some() && self.state() == SessionState::Running)
            .map(|w| WorkerInfo::new(worker_id(&w), w.generation, w.started_at));
        status.last_activity = self.last_activity;
        status.storage = self.storage;
        status.suspend_reason = self.suspend_reason;
        status.close_reason = self.close_reason;
        status.storage_refs = storage_refs;
        status.last_start_failure.clone_from(&self.last_start_failure);
        status
    }

    /// Whether the record describes a state at rest, which must survive a host crash.
    fn at_rest(&self) -> bool {
        matches!(
            self.phase,
            Phase::Session(SessionState::Created | SessionState::Suspended | SessionState::Closed)
        )
    }

    pub(crate) fn belongs_to(&self, identity: &SessionIdentity) -> bool {
        self.id == identity.id() && self.identity_digest == hex(&identity.digest())
    }
}

/// A worker's id as operators see it: `pid:<pid>@<start time>/g<generation>`.
pub(crate) fn worker_id(worker: &WorkerRecord) -> String {
    match worker.process {
        Some(process) => format!(
            "pid:{}@{}/g{}",
            process.pid, process.start_time, worker.generation
        ),
        None => format!("launching/g{}", worker.generation),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn corrupt(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::Backend {
        runtime: RUNTIME,
        retryable: false,
        message: format!("session record {} is unusable: {why}", path.display()),
        source: None,
    }
}

/// `O_NOFOLLOW`, for `OpenOptionsExt::custom_flags`: opening a symbolic link fails (`ELOOP`).
pub(crate) fn no_follow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

/// Whether `dir` is a directory itself, not a symbolic link to one (or anything else).
/// Session storage is never reached through a link: one planted in the root could point
/// anywhere on the host.
fn is_real_dir(dir: &Path) -> io::Result<bool> {
    fs::symlink_metadata(dir).map(|meta| meta.is_dir())
}

/// The file name of the current boot's transitional record, beside `record.json`.
pub(crate) const TRANSIENT_NAME: &str = "record.boot.json";
/// The temporary file name of a transitional record being written.
pub(crate) const TRANSIENT_TEMPORARY_NAME: &str = ".record.boot.json.tmp";

/// A transitional record: the boot it was written in, and the record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Transient {
    /// The kernel's boot id (`/proc/sys/kernel/random/boot_id`) when it was written.
    boot: String,
    record: SessionRecord,
}

/// This boot's id, read once; empty where the kernel does not say (then a transitional record is
/// honoured whatever boot wrote it, as a single file was).
fn boot_id() -> &'static str {
    static BOOT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BOOT.get_or_init(|| {
        fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map(|id| id.trim().to_owned())
            .unwrap_or_default()
    })
}

/// The transitional record beside the durable one at `path`.
fn transient_path(path: &Path) -> std::path::PathBuf {
    path.with_file_name(TRANSIENT_NAME)
}

/// Reads the session record of `id` whose durable file is `path`: the current boot's
/// transitional record if there is one, else the durable record. `Ok(None)` if there is neither.
///
/// Neither file nor the session directory holding them may be a symbolic link: each is an
/// error, never followed. A transitional record from another boot, or an empty one, is ignored.
pub(crate) fn load(path: &Path, id: &SessionId) -> Result<Option<SessionRecord>, Error> {
    let durable = load_file(path, id, |bytes| {
        serde_json::from_slice::<SessionRecord>(bytes).map(Some)
    })?;
    let transient = transient_path(path);
    let current = load_file(&transient, id, |bytes| {
        if bytes.is_empty() {
            return Ok(None);
        }
        let transient: Transient = serde_json::from_slice(bytes)?;
        Ok((transient.boot == boot_id()).then_some(transient.record))
    })?;
    Ok(current.or(durable))
}

/// Reads the record file at `path` with `parse` (which may find nothing in it), checking what it
/// finds belongs to session `id`. `Ok(None)` if the file does not exist.
fn load_file(
    path: &Path,
    id: &SessionId,
    parse: impl FnOnce(&[u8]) -> serde_json::Result<Option<SessionRecord>>,
) -> Result<Option<SessionRecord>, Error> {
    if let Some(dir) = path.parent() {
        match is_real_dir(dir) {
            Ok(true) => {}
            Ok(false) => return Err(corrupt(path, "its session directory is not a plain directory")),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(crate::backend_error(true, "reading a session record", e)),
        }
    }
    let opened = OpenOptions::new().read(true).custom_flags(no_follow()).open(path);
    let file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        // ELOOP: the record is a symbolic link.
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::LOOP.raw_os_error()) => {
            return Err(corrupt(path, "it is a symbolic link"))
        }
        Err(e) => return Err(crate::backend_error(true, "reading a session record", e)),
    };
    let meta = file
        .metadata()
        .map_err(|e| crate::backend_error(true, "reading a session record", e))?;
    if !meta.is_file() || meta.len() > MAX_RECORD_BYTES {
        return Err(corrupt(path, "not a regular file of a plausible size"));
    }
    // Read whole (it is bounded above) and parsed from memory: serde_json parses a slice several
    // times faster than a reader, which it takes byte by byte.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    io::Read::read_to_end(&mut io::Read::take(file, MAX_RECORD_BYTES + 1), &mut bytes)
        .map_err(|e| crate::backend_error(true, "reading a session record", e))?;
    if bytes.len() as u64 > MAX_RECORD_BYTES {
        return Err(corrupt(path, "not a regular file of a plausible size"));
    }
    let Some(record) = parse(&bytes).map_err(|e| corrupt(path, e))? else {
        return Ok(None);
    };
    if record.version != VERSION {
        return Err(corrupt(path, format!("unknown version {}", record.version)));
    }
    if record.id != *id {
        return Err(corrupt(path, format!("it names session {}", record.id)));
    }
    Ok(Some(record))
}

/// Creates a new file at `path` (a temporary name, to be renamed into place), never opening what
/// is there: a symbolic link planted at that name would otherwise have its target (anywhere on
/// the host) overwritten. Usually nothing is there, as each use renames its file away; what an
/// interrupted one left is removed first.
pub(crate) fn create_fresh(path: &Path) -> io::Result<File> {
    // Owner-only: a record can hold the session overlay's environment values.
    let create = || {
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
    };
    match create() {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            match fs::remove_file(path) {
                Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            create()
        }
        created => created,
    }
}

/// Atomically replaces the record of the session whose durable file is `path`: a record at rest
/// replaces `path`, durably, and then the transitional file is removed; a transitional record
/// replaces the transitional file, tagged with this boot (see the module documentation).
pub(crate) fn store(path: &Path, record: &SessionRecord) -> Result<(), Error> {
    let fail = |e: io::Error| crate::backend_error(true, "writing a session record", e);
    let dir = path
        .parent()
        .ok_or_else(|| fail(io::Error::other("a record path has a parent")))?;
    if !is_real_dir(dir).map_err(fail)? {
        return Err(corrupt(path, "its session directory is not a plain directory"));
    }
    let at_rest = record.at_rest();
    let (target, temporary, bytes) = if at_rest {
        let bytes = serde_json::to_vec_pretty(record).map_err(|e| fail(io::Error::other(e)))?;
        (path.to_path_buf(), dir.join(".record.json.tmp"), bytes)
    } else {
        let transient = Transient {
            boot: boot_id().to_owned(),
            record: record.clone(),
        };
        let bytes = serde_json::to_vec_pretty(&transient).map_err(|e| fail(io::Error::other(e)))?;
        (transient_path(path), dir.join(TRANSIENT_TEMPORARY_NAME), bytes)
    };
    {
        let mut file = create_fresh(&temporary).map_err(fail)?;
        file.write_all(&bytes).map_err(fail)?;
        if at_rest {
            file.sync_all().map_err(fail)?;
        }
    }
    fs::rename(&temporary, &target).map_err(fail)?;
    if at_rest {
        File::open(dir).and_then(|d| d.sync_all()).map_err(fail)?;
        // The record at rest is durable: the transitional one it follows is over. (Not fsynced:
        // after a host crash, one left behind is from another boot, and ignored.)
        match fs::remove_file(transient_path(path)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(fail(e)),
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(phase: Phase) -> SessionRecord {
        let identity = SessionIdentity::new("records", "agent", "discord", "t1").expect("identity");
        let dir = tempfile::tempdir().expect("dir");
        let evidence = DirEvidence::of(dir.path()).expect("evidence");
        let mut record = SessionRecord::new(&identity, 1, 0, evidence);
        record.phase = phase;
        record
    }

    #[test]
    fn a_transitional_record_of_this_boot_overrides_the_record_at_rest_until_the_next_one() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("record.json");
        let created = record(Phase::Session(SessionState::Created));
        let id = created.id;
        store(&path, &created).expect("store created");
        let mut running = created.clone();
        running.phase = Phase::Session(SessionState::Running);
        running.generation = 1;
        store(&path, &running).expect("store running");
        assert_eq!(load(&path, &id).expect("load"), Some(running.clone()));
        let durable: SessionRecord =
            serde_json::from_slice(&fs::read(&path).expect("durable")).expect("json");
        assert_eq!(
            durable, created,
            "a transitional record leaves record.json as it was"
        );

        // What a host crash leaves: an empty transitional file, or one from another boot.
        fs::write(transient_path(&path), "").expect("empty");
        assert_eq!(load(&path, &id).expect("load"), Some(created.clone()));
        let earlier = Transient {
            boot: "an-earlier-boot".into(),
            record: running.clone(),
        };
        fs::write(transient_path(&path), serde_json::to_vec(&earlier).expect("json")).expect("write");
        assert_eq!(load(&path, &id).expect("load"), Some(created.clone()));

        store(&path, &running).expect("store running");
        let mut suspended = running.clone();
        suspended.phase = Phase::Session(SessionState::Suspended);
        store(&path, &suspended).expect("store suspended");
        assert!(
            !transient_path(&path).exists(),
            "a record at rest ends the transitional one"
        );
        assert_eq!(load(&path, &id).expect("load"), Some(suspended));
    }

    #[test]
    fn a_transitional_record_that_does_not_parse_or_names_another_session_is_an_error() {
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("record.json");
        let created = record(Phase::Session(SessionState::Created));
        store(&path, &created).expect("store");
        fs::write(transient_path(&path), "{ not json").expect("garbage");
        assert!(load(&path, &created.id).is_err());
        let other = SessionIdentity::new("records", "agent", "discord", "t2").expect("identity");
        let mut foreign = created.clone();
        foreign.id = other.id();
        let foreign = Transient {
            boot: boot_id().to_owned(),
            record: foreign,
        };
        fs::write(transient_path(&path), serde_json::to_vec(&foreign).expect("json")).expect("write");
        assert!(load(&path, &created.id).is_err());
    }
}
