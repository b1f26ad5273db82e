//! Lifecycle states, reasons, status reports and capabilities: the data the contract speaks in.

use std::fmt;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::{RetainedUntil, SessionId};

/// A worker generation. Every worker start increments the session's generation first, and a
/// stream, connection or worker of an older generation is fenced.
pub type Generation = u64;

/// Why compute is being released while storage, identity and record are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum SuspendReason {
    /// The session saw no activity for the idle TTL.
    Idle,
    /// The broker needs room for another session (least recently active goes first).
    Capacity,
    /// The broker is shutting down.
    Shutdown,
    /// The agent stopped responding; the worker is killed without grace and the fault recorded.
    Hung,
}

/// Why a session ends. Retention of its storage is decided per reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum CloseReason {
    /// The user asked for a clean slate in the same thread.
    Reset,
    /// The thread was closed or archived by a user or an administrator.
    Ended,
    /// The session's lifetime or retention ran out.
    Expired,
}

macro_rules! display_as_serde_name {
    ($ty:ty { $($variant:ident => $name:literal),* $(,)? }) => {
        impl $ty {
            /// The lower-case name used in configuration, records and logs.
            pub fn as_str(&self) -> &'static str {
                match self { $(Self::$variant => $name),* }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

display_as_serde_name!(SuspendReason { Idle => "idle", Capacity => "capacity", Shutdown => "shutdown", Hung => "hung" });
display_as_serde_name!(CloseReason { Reset => "reset", Ended => "ended", Expired => "expired" });

/// Where a session is in its lifecycle.
///
/// ```text
///            create            attach             suspend
///  (none) ──────────▶ Created ───────▶ Running ───────────▶ Suspended
///                        │               ▲   │                 │
///                        │               └───┼──── attach ─────┘
///                        │ close             │ close
///                        ▼                   ▼
///                     Closing ──(retention applied)──▶ Closed
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum SessionState {
    /// Storage and record exist; no worker has run yet.
    Created,
    /// A worker of the current generation runs (or is starting).
    Running,
    /// No worker runs; storage is kept.
    Suspended,
    /// Close was recorded and is being carried out; `reconcile` finishes it after a crash.
    Closing,
    /// The session ended; its storage was deleted or is retained per policy.
    Closed,
}

display_as_serde_name!(SessionState {
    Created => "created",
    Running => "running",
    Suspended => "suspended",
    Closing => "closing",
    Closed => "closed",
});

impl SessionState {
    /// Whether `attach` may start or reach a worker in this state.
    pub fn can_attach(&self) -> bool {
        matches!(self, Self::Created | Self::Running | Self::Suspended)
    }

    /// Whether `suspend` is meaningful (it is a no-op in `Created` and `Suspended`).
    pub fn can_suspend(&self) -> bool {
        matches!(self, Self::Created | Self::Running | Self::Suspended)
    }

    /// Whether a worker may legitimately run in this state.
    pub fn may_run_worker(&self) -> bool {
        matches!(self, Self::Running)
    }

    /// Whether the session has ended or is ending.
    pub fn is_closed(&self) -> bool {
        matches!(self, Self::Closing | Self::Closed)
    }
}

/// What happened to a session's storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "state")]
#[non_exhaustive]
pub enum StorageState {
    /// Storage exists and belongs to the live session.
    Present,
    /// The session is closed and its storage is kept for the time its retention policy says.
    Retained {
        /// When `reconcile` may delete it.
        until: RetainedUntil,
    },
    /// The storage was deleted.
    Deleted,
    /// The storage went away without its runtime (an operator deleted the volume, say) while the
    /// session still needed it: its data are gone, nothing is retained, and `attach` fails with
    /// [`StorageLost`](crate::Error::StorageLost).
    Lost,
}

/// The worker currently serving a session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct WorkerInfo {
    /// Backend-specific worker identity (a pid and start time, a Pod name and UID, a runtime session id).
    pub worker_id: String,
    /// The generation the worker was started for.
    pub generation: Generation,
    /// When it was started.
    pub started_at: SystemTime,
}

impl WorkerInfo {
    /// Describes a worker.
    pub fn new(worker_id: impl Into<String>, generation: Generation, started_at: SystemTime) -> Self {
        Self {
            worker_id: worker_id.into(),
            generation,
            started_at,
        }
    }
}

/// A point-in-time view of one session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SessionStatus {
    /// The session.
    pub id: SessionId,
    /// Its lifecycle state.
    pub state: SessionState,
    /// Its current generation (0 until the first worker starts).
    pub generation: Generation,
    /// The worker of the current generation, if one is recorded as running.
    pub worker: Option<WorkerInfo>,
    /// When the session was created.
    pub created_at: SystemTime,
    /// The last lifecycle activity (create, attach, suspend, close).
    pub last_activity: SystemTime,
    /// What happened to its storage.
    pub storage: StorageState,
    /// The reason of the last suspend, if the session is suspended.
    pub suspend_reason: Option<SuspendReason>,
    /// The close reason, once closing.
    pub close_reason: Option<CloseReason>,
    /// Backend-specific references to its storage (directories, volume names), for operators.
    pub storage_refs: Vec<String>,
    /// The running worker's resource limits and current usage, where the backend enforces limits.
    pub resources: Option<ResourceUsage>,
    /// What the last `reconcile` pass did to this session, where the backend records it.
    pub last_reconcile: Option<ReconcileAction>,
    /// Why the last attempt to start a worker failed, where the backend records it; cleared when
    /// a worker starts. A session whose first start failed is still `Created` at generation 0,
    /// and this says so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_start_failure: Option<StartFailure>,
}

/// A failed attempt to start a session's worker, as its status reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct StartFailure {
    /// When.
    pub at: SystemTime,
    /// The session's generation after the attempt (0 if no worker was ever started).
    pub generation: Generation,
    /// The error `attach` returned, as its message.
    pub error: String,
}

impl StartFailure {
    /// A failure at `at`, leaving the session at `generation`, with `error`'s message.
    pub fn new(at: SystemTime, generation: Generation, error: impl Into<String>) -> Self {
        Self {
            at,
            generation,
            error: error.into(),
        }
    }
}

/// One thing a `reconcile` pass did to a session, as its status reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ReconcileAction {
    /// When.
    pub at: SystemTime,
    /// What, in words for an operator (`suspended: idle for 31m`).
    pub action: String,
}

impl ReconcileAction {
    /// An action done at `at`.
    pub fn new(at: SystemTime, action: impl Into<String>) -> Self {
        Self {
            at,
            action: action.into(),
        }
    }
}

/// A worker's resource limits and what it uses now. Every field is optional: a backend reports
/// what it enforces and can read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ResourceUsage {
    /// The memory limit in bytes.
    pub memory_limit: Option<u64>,
    /// Memory in use, in bytes.
    pub memory_bytes: Option<u64>,
    /// The limit on processes and threads.
    pub pids_limit: Option<u32>,
    /// Processes and threads running.
    pub pids: Option<u64>,
    /// The CPU limit, in cores.
    pub cpu_limit: Option<f64>,
    /// How many processes were killed for exceeding the memory limit.
    pub oom_kills: Option<u64>,
}

impl SessionStatus {
    /// A status for a session that was just created.
    pub fn new(id: SessionId, created_at: SystemTime) -> Self {
        Self {
            id,
            state: SessionState::Created,
            generation: 0,
            worker: None,
            created_at,
            last_activity: created_at,
            storage: StorageState::Present,
            suspend_reason: None,
            close_reason: None,
            storage_refs: Vec::new(),
            resources: None,
            last_reconcile: None,
            last_start_failure: None,
        }
    }
}

/// What `create` returns.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SessionHandle {
    /// The session.
    pub id: SessionId,
    /// Its state after the call.
    pub state: SessionState,
    /// Its generation after the call.
    pub generation: Generation,
    /// `true` if this call provisioned the session, `false` if it already existed.
    pub created: bool,
}

impl SessionHandle {
    /// Describes a session returned by `create`.
    pub fn new(id: SessionId, state: SessionState, generation: Generation, created: bool) -> Self {
        Self {
            id,
            state,
            generation,
            created,
        }
    }
}

/// How a workspace is provisioned at create.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkspaceSeed {
    /// Clone a git repository into the workspace.
    GitClone {
        /// The repository URL, as `git clone` accepts it.
        url: String,
        /// A branch or tag to check out; the remote's default when `None`.
        reference: Option<String>,
    },
    /// Copy another session's storage (its workspace and HOME) into the new one, for example
    /// to fork a thread's work. The source is another session of the same runtime installation,
    /// and it must be idle: created or suspended, with no worker. The copy is taken while the
    /// source is held against attach, so no worker writes it meanwhile; it is never waited on.
    ///
    /// A backend refuses a source that has a worker, or that another operation holds, with
    /// [`Error::StorageInUse`](crate::Error::StorageInUse) naming the source; an unknown source
    /// is [`Error::NotFound`](crate::Error::NotFound), a closed one
    /// [`Error::InvalidState`](crate::Error::InvalidState), the session itself
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument).
    CopyOf {
        /// The session whose storage is copied.
        source: SessionId,
    },
}

/// Per-call options of `create`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CreateOptions {
    /// How to provision the workspace; empty when `None`.
    pub workspace_seed: Option<WorkspaceSeed>,
    /// The session's working directory and environment on top of the configured agent
    /// ([`SessionOverlay`](crate::SessionOverlay)), kept with the session and applied by every
    /// attach. `None` keeps what the session has (nothing, for a new one); `Some` replaces it,
    /// also for an existing session (the next worker gets it, a running one keeps its own).
    pub overlay: Option<crate::SessionOverlay>,
}

impl CreateOptions {
    /// Options with an empty workspace.
    pub fn new() -> Self {
        Self::default()
    }

    /// Seeds the workspace.
    pub fn with_workspace_seed(mut self, seed: WorkspaceSeed) -> Self {
        self.workspace_seed = Some(seed);
        self
    }

    /// Sets the session's overlay (see [`overlay`](Self::overlay)).
    pub fn with_overlay(mut self, overlay: crate::SessionOverlay) -> Self {
        self.overlay = Some(overlay);
        self
    }
}

/// What one `reconcile` pass found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ReconcileReport {
    /// Workers that were killed because no record said they should run (stale generation, a
    /// session suspended or closed while its worker survived, or no record at all).
    pub killed_workers: Vec<(SessionId, String)>,
    /// Sessions whose interrupted close was finished.
    pub finished_closes: Vec<SessionId>,
    /// Sessions suspended for being idle past the TTL.
    pub suspended_idle: Vec<SessionId>,
    /// Closed sessions whose retained storage expired and was deleted.
    pub expired_storage: Vec<SessionId>,
    /// Closed sessions whose record itself expired and was removed (nothing of them was left).
    pub expired_records: Vec<SessionId>,
    /// Storage that no record names, reported for an operator and left in place (a backend
    /// deletes it only when configured to, and then lists it under `expired_storage`).
    pub orphaned_storage: Vec<(SessionId, String)>,
    /// Sessions whose storage was found gone without their runtime, with what was lost. Each is
    /// recorded on the session (its status says [`StorageState::Lost`]) and reported once.
    pub lost_storage: Vec<(SessionId, String)>,
    /// Warm workers (started for no session yet, for a backend that keeps a pool of them) this
    /// pass started to fill its pool, by name.
    pub warm_started: Vec<String>,
    /// Warm workers this pass removed: of an older profile version or another key, or beyond
    /// the pool's size. A claimed one is a session's worker and never among them.
    pub warm_trimmed: Vec<String>,
    /// Problems that did not stop the pass; the next pass retries them.
    pub errors: Vec<String>,
}

impl ReconcileReport {
    /// Whether the pass found nothing to do and nothing went wrong. Reported orphaned storage
    /// does not count: the pass leaves it alone, so every later pass reports it again.
    pub fn is_clean(&self) -> bool {
        self.killed_workers.is_empty()
            && self.finished_closes.is_empty()
            && self.suspended_idle.is_empty()
            && self.expired_storage.is_empty()
            && self.expired_records.is_empty()
            && self.lost_storage.is_empty()
            && self.warm_started.is_empty()
            && self.warm_trimmed.is_empty()
            && self.errors.is_empty()
    }
}

/// How strongly sessions are separated from each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum IsolationLevel {
    /// None: every session can read and write every other session's files.
    None,
    /// Kernel access control on a shared view of the filesystem (Landlock, and a user per
    /// session where the broker may switch users): a session cannot open, list or change another's
    /// files, but it shares the host's mounts, processes and network, and can `stat` a path it
    /// already knows unless the user per session hides it.
    #[serde(rename = "access-control")]
    AccessControl,
    /// Kernel namespaces and filesystem restrictions on a shared kernel.
    Namespaces,
    /// A separate Pod (namespaces, cgroup, network identity, own volume).
    Pod,
    /// A separate virtual machine.
    MicroVm,
}

display_as_serde_name!(IsolationLevel { None => "none", AccessControl => "access-control", Namespaces => "namespaces", Pod => "pod", MicroVm => "microvm" });

/// What a runtime can do, declared once as data. Callers and the conformance suite branch on it;
/// an operation outside it returns [`Error::Unsupported`](crate::Error::Unsupported).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// How strongly sessions are separated.
    pub isolation: IsolationLevel,
    /// Whether storage survives suspend and worker replacement.
    pub persistent_storage: bool,
    /// Whether workers keep running when the broker process restarts, so a new broker can re-attach.
    pub survives_broker_restart: bool,
    /// Whether re-attaching to a live worker replays output the previous attachment did not read.
    pub replay_on_reattach: bool,
    /// The longest a worker may live before the platform ends it, if bounded.
    pub max_lifetime: Option<Duration>,
    /// How long the platform lets a worker sit without traffic before it ends it, if it does
    /// (AgentCore's idle timeout). Independent of the runtime's own `idle_ttl`, which suspends
    /// through the lifecycle; the next attach starts a new worker either way.
    pub platform_idle_timeout: Option<Duration>,
    /// Whether the runtime applies a [`SessionOverlay`](crate::SessionOverlay) (a working
    /// directory and environment per session). Without it, `create` refuses a non-empty overlay
    /// with [`Error::Unsupported`](crate::Error::Unsupported) naming the field.
    pub overlay: bool,
}

impl Capabilities {
    /// Capabilities of a runtime that isolates nothing and keeps nothing; backends start here and
    /// set what they provide.
    pub const fn minimal() -> Self {
        Self {
            isolation: IsolationLevel::None,
            persistent_storage: false,
            survives_broker_restart: false,
            replay_on_reattach: false,
            max_lifetime: None,
            platform_idle_timeout: None,
            overlay: false,
        }
    }

    /// Declares that the runtime applies session overlays.
    pub const fn with_overlay(mut self, yes: bool) -> Self {
        self.overlay = yes;
        self
    }

    /// Sets the isolation level.
    pub const fn with_isolation(mut self, isolation: IsolationLevel) -> Self {
        self.isolation = isolation;
        self
    }

    /// Declares persistent storage.
    pub const fn with_persistent_storage(mut self, yes: bool) -> Self {
        self.persistent_storage = yes;
        self
    }

    /// Declares that workers survive a broker restart.
    pub const fn with_survives_broker_restart(mut self, yes: bool) -> Self {
        self.survives_broker_restart = yes;
        self
    }

    /// Declares replay on re-attach.
    pub const fn with_replay_on_reattach(mut self, yes: bool) -> Self {
        self.replay_on_reattach = yes;
        self
    }

    /// Declares the platform's idle timeout.
    pub const fn with_platform_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.platform_idle_timeout = timeout;
        self
    }

    /// Declares a maximum worker lifetime.
    pub const fn with_max_lifetime(mut self, max: Option<Duration>) -> Self {
        self.max_lifetime = max;
        self
    }
}

#[cfg(test)]
mod isolation_names {
    use super::IsolationLevel;

    #[test]
    fn each_isolation_level_displays_as_it_serializes() {
        for level in [
            IsolationLevel::None,
            IsolationLevel::AccessControl,
            IsolationLevel::Namespaces,
            IsolationLevel::Pod,
            IsolationLevel::MicroVm,
        ] {
            let serialized = serde_json::to_string(&level).expect("serialize");
            assert_eq!(serialized, format!("\"{level}\""));
        }
        assert!(IsolationLevel::None < IsolationLevel::AccessControl);
        assert!(IsolationLevel::AccessControl < IsolationLevel::Namespaces);
    }
}
