//! Session records: the backend's authority (AgentCore keeps no record of a session), behind a
//! small trait so a broker can keep them elsewhere, and [`FileRecordStore`], the default.

use std::fmt;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use session_runtime::{
    CloseReason, Generation, RetainedUntil, SessionId, SessionState, StorageState, SuspendReason,
};

/// A record's revision: bumped by every write, the basis of compare-and-swap.
pub type Revision = u64;

/// What the broker knows of one session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SessionRecord {
    /// The session.
    pub id: SessionId,
    /// How many times a session of this id was created: part of the runtime session id, so a
    /// session created after a close reaches a new microVM and new session storage.
    pub incarnation: u64,
    /// The newest worker generation; only ever grows, across incarnations too.
    pub generation: Generation,
    /// The lifecycle state.
    pub state: SessionState,
    /// Why the session was last suspended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub suspend_reason: Option<SuspendReason>,
    /// Why the session was closed (the first reason wins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_reason: Option<CloseReason>,
    /// When this incarnation was created (Unix milliseconds).
    #[serde(with = "unix_millis")]
    pub created_at: SystemTime,
    /// The last attach, renewal or lifecycle change (Unix milliseconds).
    #[serde(with = "unix_millis")]
    pub last_activity: SystemTime,
    /// When the current worker generation was attached, while one runs.
    #[serde(default, with = "unix_millis_option", skip_serializing_if = "Option::is_none")]
    pub worker_started_at: Option<SystemTime>,
    /// Whether this incarnation was ever attached: before that, nothing ran and its session
    /// storage holds nothing, so closing it calls nothing remote.
    #[serde(default)]
    pub attached: bool,
    /// Whether the microVM of this incarnation is known to be gone (stopped after a suspend or
    /// close); `false` while one may still run the session's agent.
    #[serde(default)]
    pub compute_released: bool,
    /// What the close recorded before acting: whether the storage is retained, until when.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub close_intent: Option<CloseIntent>,
    /// When the close finished (Unix milliseconds).
    #[serde(default, with = "unix_millis_option", skip_serializing_if = "Option::is_none")]
    pub closed_at: Option<SystemTime>,
    /// The state of this incarnation's session storage.
    pub storage: StorageState,
    /// Session storage of earlier incarnations that the retention policy keeps, until when.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub retained: Vec<RetainedStorage>,
}

/// A close's decision, recorded before any side effect so an interrupted close finishes the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloseIntent {
    /// `None`: the storage is deleted; else it is kept until then.
    pub retain_until: Option<RetainedUntil>,
}

/// The session storage of a closed incarnation, kept by the retention policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetainedStorage {
    /// The incarnation whose storage it is.
    pub incarnation: u64,
    /// Until when it is kept.
    pub until: RetainedUntil,
}

impl SessionRecord {
    /// A new session's first incarnation, created at `now`.
    pub fn new(id: SessionId, now: SystemTime) -> Self {
        Self {
            id,
            incarnation: 1,
            generation: 0,
            state: SessionState::Created,
            suspend_reason: None,
            close_reason: None,
            created_at: now,
            last_activity: now,
            worker_started_at: None,
            attached: false,
            compute_released: true,
            close_intent: None,
            closed_at: None,
            storage: StorageState::Present,
            retained: Vec::new(),
        }
    }
}

/// A record as stored, with its revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The record.
    pub record: SessionRecord,
    /// Its revision.
    pub revision: Revision,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The record changed (or appeared, or vanished) since it was read: read it again.
    #[error("the session record changed concurrently")]
    Conflict,
    /// The record exists but cannot be read as one.
    #[error("the session record {path} is unreadable: {reason}")]
    Corrupt {
        /// Where it is.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The store failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// Where session records live. Every write is a compare-and-swap on the revision read, so
/// several broker processes sharing a store never lose each other's changes.
#[async_trait]
pub trait RecordStore: fmt::Debug + Send + Sync + 'static {
    /// The record of `id`, if there is one.
    ///
    /// # Errors
    /// [`StoreError::Corrupt`] or [`StoreError::Io`].
    async fn load(&self, id: &SessionId) -> Result<Option<Stored>, StoreError>;

    /// Writes `record` if the stored revision is still `expected` (`None`: no record may exist)
    /// and returns the new revision.
    ///
    /// # Errors
    /// [`StoreError::Conflict`] if the revision moved; [`StoreError::Io`].
    async fn store(&self, record: &SessionRecord, expected: Option<Revision>)
        -> Result<Revision, StoreError>;

    /// Removes the record of `id` if its revision is still `expected`.
    ///
    /// # Errors
    /// [`StoreError::Conflict`] if the revision moved or the record is gone; [`StoreError::Io`].
    async fn remove(&self, id: &SessionId, expected: Revision) -> Result<(), StoreError>;

    /// Every record. Records that cannot be read are skipped and logged.
    ///
    /// # Errors
    /// [`StoreError::Io`] if the store cannot be listed at all.
    async fn list(&self) -> Result<Vec<Stored>, StoreError>;
}

/// Records as one JSON file per session in a directory (mode 0700), written atomically (a
/// synced temporary file renamed over the old one) under an exclusive lock on the directory's
/// `.lock` file, so processes on one host sharing the directory serialize their swaps.
#[derive(Debug, Clone)]
pub struct FileRecordStore {
    dir: Arc<PathBuf>,
}

/// The file form: the record and its revision.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RecordFile {
    revision: Revision,
    record: SessionRecord,
}

impl FileRecordStore {
    /// A store in `dir`, created (mode 0700) if missing.
    ///
    /// # Errors
    /// [`StoreError::Io`] if the directory cannot be created.
    pub fn open(dir: impl Into<PathBuf>) -> Result<Self, StoreError> {
        let dir = dir.into();
        create_private_dir(&dir).map_err(|source| StoreError::Io {
            what: format!("creating the record directory {}", dir.display()),
            source,
        })?;
        Ok(Self { dir: Arc::new(dir) })
    }

    /// The directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, id: &SessionId) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Path) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let dir = Arc::clone(&self.dir);
        tokio::task::spawn_blocking(move || f(&dir))
            .await
            .map_err(|error| StoreError::Io {
                what: "the record store's worker thread".into(),
                source: io::Error::other(error.to_string()),
            })?
    }
}

fn io_error(what: impl Into<String>) -> impl FnOnce(io::Error) -> StoreError {
    let what = what.into();
    move |source| StoreError::Io { what, source }
}

fn create_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)
}

/// Holds the directory's exclusive lock while alive.
struct DirLock(#[allow(dead_code)] std::fs::File);

fn lock_dir(dir: &Path) -> Result<DirLock, StoreError> {
    let path = dir.join(".lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(io_error(format!("opening {}", path.display())))?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|errno| io_error(format!("locking {}", path.display()))(errno.into()))?;
    Ok(DirLock(file))
}

fn read_file(path: &Path) -> Result<Option<RecordFile>, StoreError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(error) if error.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(io_error(format!("reading {}", path.display()))(error)),
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|error| StoreError::Corrupt {
            path: path.display().to_string(),
            reason: error.to_string(),
        })
}

fn write_file(dir: &Path, path: &Path, file: &RecordFile) -> Result<(), StoreError> {
    let bytes = serde_json::to_vec_pretty(file).map_err(|error| StoreError::Io {
        what: "encoding a session record".into(),
        source: io::Error::other(error),
    })?;
    let temporary = path.with_extension("json.tmp");
    let what = format!("writing {}", temporary.display());
    let mut out = std::fs::File::create(&temporary).map_err(io_error(what.clone()))?;
    out.write_all(&bytes).map_err(io_error(what.clone()))?;
    out.sync_all().map_err(io_error(what))?;
    std::fs::rename(&temporary, path).map_err(io_error(format!("replacing {}", path.display())))?;
    sync_dir(dir)
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(format!("syncing {}", dir.display())))
}

#[async_trait]
impl RecordStore for FileRecordStore {
    async fn load(&self, id: &SessionId) -> Result<Option<Stored>, StoreError> {
        let path = self.path(id);
        self.blocking(move |_| {
            Ok(read_file(&path)?.map(|file| Stored {
                record: file.record,
                revision: file.revision,
            }))
        })
        .await
    }

    async fn store(
        &self,
        record: &SessionRecord,
        expected: Option<Revision>,
    ) -> Result<Revision, StoreError> {
        let path = self.path(&record.id);
        let record = record.clone();
        self.blocking(move |dir| {
            let _lock = lock_dir(dir)?;
            let current = read_file(&path)?.map(|file| file.revision);
            if current != expected {
                return Err(StoreError::Conflict);
            }
            let revision = expected.map_or(1, |r| r + 1);
            write_file(dir, &path, &RecordFile { revision, record })?;
            Ok(revision)
        })
        .await
    }

    async fn remove(&self, id: &SessionId, expected: Revision) -> Result<(), StoreError> {
        let path = self.path(id);
        self.blocking(move |dir| {
            let _lock = lock_dir(dir)?;
            match read_file(&path)? {
                Some(file) if file.revision == expected => {}
                _ => return Err(StoreError::Conflict),
            }
            std::fs::remove_file(&path).map_err(io_error(format!("removing {}", path.display())))?;
            sync_dir(dir)
        })
        .await
    }

    async fn list(&self) -> Result<Vec<Stored>, StoreError> {
        self.blocking(|dir| {
            let entries = std::fs::read_dir(dir).map_err(io_error(format!("listing {}", dir.display())))?;
            let mut records = Vec::new();
            for entry in entries {
                let entry = entry.map_err(io_error(format!("listing {}", dir.display())))?;
                let path = entry.path();
                if path.extension().and_then(|e| e.to_str()) != Some("json") {
                    continue;
                }
                match read_file(&path) {
                    Ok(Some(file)) => records.push(Stored {
                        record: file.record,
                        revision: file.revision,
                    }),
                    Ok(None) => {}
                    Err(error) => tracing::warn!(%error, "skipping a session record"),
                }
            }
            Ok(records)
        })
        .await
    }
}

mod unix_millis {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(time: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        let millis = time.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis());
        s.serialize_u64(u64::try_from(millis).unwrap_or(u64::MAX))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let millis = u64::deserialize(d)?;
        UNIX_EPOCH
            .checked_add(Duration::from_millis(millis))
            .ok_or_else(|| serde::de::Error::custom("a time out of range"))
    }
}

mod unix_millis_option {
    use super::*;
    use serde::{Deserializer, Serializer};

    #[allow(clippy::ref_option)]
    pub(super) fn serialize<S: Serializer>(time: &Option<SystemTime>, s: S) -> Result<S::Ok, S::Error> {
        match time {
            Some(time) => super::unix_millis::serialize(time, s),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SystemTime>, D::Error> {
        let millis = Option::<u64>::deserialize(d)?;
        millis
            .map(|millis| {
                UNIX_EPOCH
                    .checked_add(Duration::from_millis(millis))
                    .ok_or_else(|| serde::de::Error::custom("a time out of range"))
            })
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> SessionId {
        session_runtime::SessionIdentity::new("agentcore-tests", "agent", "test", name)
            .expect("an identity")
            .id()
    }

    #[tokio::test]
    async fn writes_are_compare_and_swap_and_survive_a_reopen() {
        let dir = tempfile::tempdir().expect("a directory");
        let store = FileRecordStore::open(dir.path().join("records")).expect("a store");
        let id = id("cas");
        let now = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_123);
        let mut record = SessionRecord::new(id, now);
        assert!(store.load(&id).await.expect("load").is_none());
        let first = store.store(&record, None).await.expect("create");
        assert!(matches!(
            store.store(&record, None).await,
            Err(StoreError::Conflict)
        ));
        record.generation = 1;
        record.state = SessionState::Running;
        record.worker_started_at = Some(now);
        let second = store.store(&record, Some(first)).await.expect("swap");
        assert!(matches!(
            store.store(&record, Some(first)).await,
            Err(StoreError::Conflict)
        ));

        let reopened = FileRecordStore::open(dir.path().join("records")).expect("reopen");
        let stored = reopened.load(&id).await.expect("load").expect("present");
        assert_eq!(
            stored,
            Stored {
                record: record.clone(),
                revision: second
            }
        );
        assert_eq!(reopened.list().await.expect("list"), vec![stored]);
        assert!(matches!(
            reopened.remove(&id, first).await,
            Err(StoreError::Conflict)
        ));
        reopened.remove(&id, second).await.expect("remove");
        assert!(reopened.load(&id).await.expect("load").is_none());
    }

    #[tokio::test]
    async fn a_corrupt_record_is_an_error_to_load_and_skipped_by_list() {
        let dir = tempfile::tempdir().expect("a directory");
        let store = FileRecordStore::open(dir.path()).expect("a store");
        let good = id("good");
        store
            .store(&SessionRecord::new(good, SystemTime::now()), None)
            .await
            .expect("store");
        let bad = id("bad");
        std::fs::write(dir.path().join(format!("{bad}.json")), b"{ not json").expect("write");
        assert!(matches!(store.load(&bad).await, Err(StoreError::Corrupt { .. })));
        let listed = store.list().await.expect("list");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].record.id, good);
    }

    #[tokio::test]
    async fn concurrent_swaps_from_one_revision_let_exactly_one_win() {
        let dir = tempfile::tempdir().expect("a directory");
        let store = FileRecordStore::open(dir.path()).expect("a store");
        let id = id("race");
        let record = SessionRecord::new(id, SystemTime::now());
        let base = store.store(&record, None).await.expect("create");
        let mut tasks = Vec::new();
        for generation in 1..=8 {
            let (store, mut record) = (store.clone(), record.clone());
            record.generation = generation;
            tasks.push(tokio::spawn(
                async move { store.store(&record, Some(base)).await },
            ));
        }
        let mut won = 0;
        for task in tasks {
            match task.await.expect("join") {
                Ok(_) => won += 1,
                Err(StoreError::Conflict) => {}
                Err(other) => panic!("{other}"),
            }
        }
        assert_eq!(won, 1);
    }
}
