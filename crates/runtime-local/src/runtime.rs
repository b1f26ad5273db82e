//! [`LocalRuntime`]: the `SessionRuntime` implementation.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use parking_lot::Mutex;
use rustix::process::Signal;
use session_runtime::telemetry::{self, StartKind};
use session_runtime::{
    Attachment, AttachmentParts, Capabilities, CloseReason, CreateOptions, Error, Fence, FenceTrigger,
    ReconcileReport, ResourceUsage, Result, SessionHandle, SessionId, SessionIdentity, SessionRuntime,
    SessionState, SessionStatus, StartFailure, StorageState, SuspendReason, WorkerFailure, WorkspaceSeed,
};

use crate::egress::EgressProxy;
use crate::layout::{self, SessionDirs};
use crate::process::{self, ProcessRef};
use crate::record::{self, DirEvidence, Phase, SessionRecord, WorkerRecord};
use crate::sandbox::{needs, storage, CgroupEntry, LaunchSpec, LimitsHandle, Sandbox, SandboxKind};
use crate::seed;
use crate::workdir;
use crate::worker::{self, Activity, LocalWorker, Watched};
use crate::{LocalSettings, RUNTIME};
use session_runtime::config::ResourceLimits;
use session_runtime::{overlay, SessionOverlay};

/// The environment variable every worker carries: `<scope>:<session id>:<generation>`, where the
/// scope names the installation and the storage root (see `LocalSettings::scope`).
/// `reconcile` recognises workers by it when no pid was recorded (a broker killed mid-spawn).
pub(crate) const WORKER_MARKER: &str = "OPENAB_SESSION_WORKER";
/// How long `reconcile` and `attach` wait for a killed orphan to disappear.
const ORPHAN_EXIT_WAIT: Duration = Duration::from_secs(5);

/// Runs each session's agent as a child process of the broker, plain or sandboxed, with its own
/// storage under `root/<session id>/`. Build it with [`LocalRuntime::builder`](crate::LocalRuntime::builder).
#[derive(Debug)]
pub struct LocalRuntime {
    pub(crate) settings: LocalSettings,
    pub(crate) sandbox: Sandbox,
    pub(crate) broker: ProcessRef,
    /// See [`LocalRuntime::root_tag`].
    root_tag: OnceLock<String>,
    /// The root as `create` last found it usable.
    checked_root: crate::root::CheckedRoot,
    slots: Mutex<HashMap<SessionId, Arc<Slot>>>,
}

/// What this broker process holds of one session, behind the session's lifecycle lock.
#[derive(Debug, Default)]
struct Slot {
    held: tokio::sync::Mutex<Held>,
}

#[derive(Debug, Default)]
struct Held {
    /// The session's flock, held while this process owns the session's worker.
    lock: Option<OwnerLock>,
    worker: Option<Live>,
}

#[derive(Debug)]
struct Live {
    control: Arc<LocalWorker>,
    fence: FenceTrigger,
    activity: Activity,
    limits: Option<LimitsHandle>,
    /// The worker's egress proxy (`network = "allowlist"`): held for its drop, which stops it
    /// when the worker is gone.
    #[allow(dead_code)]
    egress: Option<EgressProxy>,
    /// What the worker's sandbox was set up from, by descriptor: held for as long as the worker
    /// runs, since the sandbox mounts them after its process has started.
    #[allow(dead_code)]
    pinned_needs: needs::PinnedNeeds,
}

/// An exclusive `flock` on a session's lock file.
///
/// Released explicitly on drop: a child forked by another thread at that moment holds a copy of
/// the descriptor until it execs, and closing ours alone would leave the lock held through it.
#[derive(Debug)]
struct OwnerLock(File);

impl Drop for OwnerLock {
    fn drop(&mut self) {
        let _ = self.0.unlock();
    }
}

fn storage_error(what: &str, error: io::Error) -> Error {
    crate::backend_error(true, what, error)
}

impl LocalRuntime {
    pub(crate) fn new(settings: LocalSettings, sandbox: Sandbox) -> Self {
        Self {
            settings,
            sandbox,
            broker: ProcessRef::current(),
            root_tag: OnceLock::new(),
            checked_root: crate::root::CheckedRoot::default(),
            slots: Mutex::default(),
        }
    }

    /// `<installation>@<root device>.<root inode>`: which workers are this runtime's. Two
    /// runtimes of one installation with different roots never touch each other's workers.
    /// Fixed once the root exists; before, it matches no worker (none can have started).
    pub(crate) fn scope(&self) -> String {
        format!("{}@{}", self.settings.installation, self.root_tag())
    }

    /// `<root device>.<root inode>`: which root this runtime serves (in its scope and its cgroup
    /// names). Fixed once the root exists; before, it matches nothing (no worker can have
    /// started).
    pub(crate) fn root_tag(&self) -> String {
        if let Some(tag) = self.root_tag.get() {
            return tag.clone();
        }
        match crate::root::tag_of(&self.settings.root) {
            Some(tag) => self.root_tag.get_or_init(|| tag).clone(),
            None => "no-root".to_owned(),
        }
    }

    /// Whether the root exists: without one there are no sessions to read or repair.
    fn has_root(&self) -> bool {
        fs::symlink_metadata(&self.settings.root).is_ok()
    }

    fn slot(&self, id: &SessionId) -> Arc<Slot> {
        Arc::clone(self.slots.lock().entry(*id).or_default())
    }

    fn dirs(&self, id: &SessionId) -> SessionDirs {
        SessionDirs::live(&self.settings.root, id)
    }

    fn load(&self, id: &SessionId) -> Result<Option<SessionRecord>> {
        record::load(&self.dirs(id).record(), id)
    }

    fn store(&self, record: &SessionRecord) -> Result<()> {
        record::store(&self.dirs(&record.id).record(), record)
    }

    /// Takes the session's flock for this process, unless it already holds it.
    fn own(
        &self,
        held: &mut Held,
        id: SessionId,
        dirs: &SessionDirs,
        record: Option<&SessionRecord>,
    ) -> Result<()> {
        if held.lock.is_some() {
            return Ok(());
        }
        held.lock = Some(Self::lock_session(id, dirs, record)?);
        Ok(())
    }

    /// Takes the session's flock, or says who holds it.
    fn lock_session(id: SessionId, dirs: &SessionDirs, record: Option<&SessionRecord>) -> Result<OwnerLock> {
        // Never through a symbolic link: one planted as the lock would make this create a file
        // wherever it points.
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .custom_flags(record::no_follow())
            .open(dirs.lock())
            .map_err(|e| storage_error("opening a session lock", e))?;
        match file.try_lock() {
            Ok(()) => Ok(OwnerLock(file)),
            Err(fs::TryLockError::WouldBlock) => Err(Error::StorageInUse {
                id,
                holder: match record.and_then(|r| r.worker) {
                    Some(worker) => format!("another broker process (pid {})", worker.broker.pid),
                    None => "another broker process".into(),
                },
            }),
            Err(fs::TryLockError::Error(e)) => Err(storage_error("locking a session", e)),
        }
    }

    /// Holds a [`WorkspaceSeed::CopyOf`] source against attach for the copy: the caller holds
    /// the source's lifecycle lock (`held`), and this takes its flock unless this process already
    /// has it, so no broker can start a worker there until the returned lock drops.
    ///
    /// # Errors
    /// [`Error::StorageInUse`] if the source has a worker or another process holds it,
    /// [`Error::NotFound`] if it does not exist, [`Error::InvalidState`] if it is closed.
    fn lend(&self, source: SessionId, held: &Held) -> Result<(SessionDirs, Option<OwnerLock>)> {
        let in_use = |holder: String| Error::StorageInUse { id: source, holder };
        if held.worker.is_some() {
            return Err(in_use(
                "its worker runs in this broker; suspend the session first".into(),
            ));
        }
        let record = self.load(&source)?.ok_or(Error::NotFound { id: source })?;
        let dirs = self.dirs(&source);
        let lock = match held.lock {
            Some(_) => None,
            None => Some(Self::lock_session(source, &dirs, Some(&record))?),
        };
        // Read again under the lock: the broker that held it may have changed it.
        let record = self.load(&source)?.ok_or(Error::NotFound { id: source })?;
        match record.phase {
            Phase::Provisioning => Err(in_use("it is still being provisioned".into())),
            Phase::Session(SessionState::Closing | SessionState::Closed) => Err(Error::InvalidState {
                id: source,
                state: record.state(),
                operation: "copy its storage",
            }),
            Phase::Session(_) if record.worker.is_some() => Err(in_use(
                "a worker is recorded for it (a broker that stopped without suspending it); attach and suspend it first".into(),
            )),
            Phase::Session(_) => Ok((dirs, lock)),
        }
    }

    fn storage_refs(&self, dirs: &SessionDirs) -> Vec<String> {
        vec![dirs.base.display().to_string()]
    }

    /// Stops whatever worker the session has: this process's (fenced first), or one recorded by
    /// a broker that is gone.
    /// `fenced_by` is the generation taking over (the next one when a new worker replaces it).
    ///
    /// When it returns, no process of any of the session's workers is left (within
    /// `ORPHAN_EXIT_WAIT`): the caller may start the next generation or release the storage.
    async fn stop_worker(&self, held: &mut Held, record: &SessionRecord, fenced_by: u64, grace: Duration) {
        let had_worker = held.worker.is_some() || record.worker.is_some();
        // Recorded, but not started by this process: its broker was killed.
        let foreign = held.worker.is_none() && record.worker.is_some();
        let mut limits = None;
        let own_leader = held.worker.as_ref().map(|live| live.control.process);
        if let Some(live) = held.worker.take() {
            live.fence.fence(fenced_by);
            let _ = session_runtime::WorkerControl::terminate(live.control.as_ref(), grace).await;
            limits = live.limits;
        }
        // The recorded worker is only signalled again if it is not the one just stopped.
        if let Some(worker) = record
            .worker
            .filter(|w| own_leader.is_none() || w.process != own_leader)
        {
            kill_recorded(&self.scope(), &record.id, &worker).await;
        }
        // The leader's exit does not mean its tree is gone: a sandbox's inner processes run in
        // a session of their own and die (by `--die-with-parent`) only after bubblewrap exits,
        // and a child the agent started may outlive it. Wait for every process carrying the
        // session's marker to go before a new generation starts, so two generations never run
        // (and touch storage) at once.
        //
        // One exception: a plain worker this process started, whose process group is empty, left
        // nothing but what detached itself on purpose (a new session). Plain mode isolates
        // nothing (any session can reach this storage anyway), and `reconcile` still finds such
        // processes by their marker; the scan of every process is skipped on this hot path.
        let plain_and_gone = self.sandbox.kind() == SandboxKind::None
            && own_leader.is_some_and(|leader| group_is_empty(leader.pid));
        if had_worker && !plain_and_gone {
            kill_leftovers(&self.scope(), &record.id).await;
        }
        // Removing the cgroups kills whatever is still in them: nothing the worker started
        // outlives it, however it detached itself.
        if let Some(limits) = limits {
            remove_cgroups(&record.id, Some(&limits));
        } else if foreign {
            // A worker this process did not start (its broker was killed) may have left its
            // cgroup behind, found by name. Its processes are gone (above), so it is empty
            // unless another runtime uses that name: then it is left alone.
            let name = crate::sandbox::cgroup::group_name(&record.id, &self.root_tag());
            if let Some(limits) = self.sandbox.existing_limits(&name) {
                // The name is this root's own, so whatever is still inside escaped the worker's
                // process group and marker (a detached child with a clean environment): it goes.
                remove_cgroups(&record.id, Some(&limits));
            }
        }
    }

    async fn attach_locked(&self, id: SessionId, held: &mut Held) -> Result<Attachment> {
        let attaching = std::time::Instant::now();
        let dirs = self.dirs(&id);
        let mut record = self.load(&id)?.ok_or(Error::NotFound { id })?;
        if record.phase == Phase::Provisioning {
            return Err(Error::Backend {
                runtime: RUNTIME,
                retryable: true,
                message: format!("session {id} is still being provisioned; create it again"),
                source: None,
            });
        }
        let state = record.state();
        if !state.can_attach() {
            return Err(Error::InvalidState {
                id,
                state,
                operation: "attach",
            });
        }
        // The agent's directories are bound into its sandbox or become its working directory:
        // each must be the session's own directory, not a link planted to lead elsewhere.
        for dir in dirs.agent_dirs() {
            let plain = layout::plain_dir(dir).map_err(|e| {
                crate::backend_error(false, format!("session {id} storage was tampered with"), e)
            })?;
            if !plain {
                return Err(Error::Backend {
                    runtime: RUNTIME,
                    retryable: false,
                    message: format!("session {id} storage is incomplete: {} is missing", dir.display()),
                    source: None,
                });
            }
        }
        // Modes widened since create (by hand, a restore) would open the storage to other
        // sessions' users: narrowed again before any worker sees it.
        self.sandbox.repair_storage_modes(&id, &dirs, record.uid)?;
        // A missing agent fails here, alike in every mode, before anything changes.
        let agent = &self.settings.agent;
        if let Some(error) = self
            .sandbox
            .missing_program(&agent.program, &self.agent_path_var(), &dirs)
        {
            return Err(Error::WorkerFailed {
                id,
                cause: WorkerFailure::Spawn(format!("{}: {error}", agent.program)),
            });
        }
        // What the agent needs is looked at again for every worker: it may have been
        // reinstalled, or made unreachable, since the session was created.
        let needs = self.agent_needs()?;
        // Opened once before the checks and found unchanged after them: what the sandbox shows
        // is what was checked (it takes each by descriptor).
        let pinned = if self.sandbox.kind() == SandboxKind::None {
            needs::PinnedNeeds::default()
        } else {
            needs::PinnedNeeds::pin(&needs)?
        };
        self.sandbox
            .check_needs(&needs, &self.settings.root, record.uid)?;
        pinned.verify()?;
        self.own(held, id, &dirs, Some(&record))?;
        self.stop_worker(
            held,
            &record,
            record.generation + 1,
            self.settings.terminate_grace,
        )
        .await;
        if record.uid.is_none() {
            // Created before this broker could give sessions their own user (or by one that
            // could not): hand the storage over now, if this one can. Both calls are idempotent;
            // without a user the storage stays as `create` prepared it.
            record.uid = self.sandbox.allocate_uid(&self.settings.root, &id)?;
            if record.uid.is_some() {
                self.sandbox.prepare_storage(&dirs, record.uid)?;
            }
        }
        // The record is read from disk: its overlay is checked again, and its working directory
        // made (or found) inside the workspace while no worker of the session runs.
        let overlay = record.overlay.clone().unwrap_or_default();
        overlay.validate()?;
        let working_dir = overlay.relative_working_dir()?;
        let host_working_dir = match &working_dir {
            Some(relative) => workdir::ensure_within(&dirs.workspace, relative, record.uid)?,
            None => dirs.workspace.clone(),
        };

        // The generation is bumped durably, with the launch intent, before any process starts.
        record.generation += 1;
        let generation = record.generation;
        record.phase = Phase::Session(SessionState::Running);
        record.suspend_reason = None;
        record.last_start_failure = None;
        record.last_activity = SystemTime::now();
        record.worker = Some(WorkerRecord {
            generation,
            process: None,
            broker: self.broker,
            started_at: record.last_activity,
        });
        self.store(&record)?;

        let paths = self.sandbox.worker_paths(&dirs);
        // The cgroups exist before the worker, which joins them before its program starts: a
        // limit holds from the first instruction, and whatever the agent leaves behind is
        // killed with the session.
        let limits = match self.session_cgroups(&id) {
            Ok(limits) => limits,
            Err(error) => {
                self.record_not_started(&mut record)?;
                return Err(error);
            }
        };
        let entry = limits
            .as_ref()
            .map(|limits| self.sandbox.cgroup_entry(limits, record.uid));
        let procs = limits
            .as_ref()
            .filter(|_| entry == Some(CgroupEntry::AtExec))
            .map(LimitsHandle::procs_files);
        // The proxy listens before the worker starts, so the agent's first connection finds it.
        let egress = match &self.settings.egress {
            Some(egress) => match EgressProxy::start(id, &egress.plan, &dirs.egress(), record.uid) {
                Ok(proxy) => Some((proxy, egress.plan.launch(&egress.forwarder, &dirs.egress()))),
                Err(error) => {
                    remove_cgroups(&id, limits.as_ref());
                    self.record_not_started(&mut record)?;
                    return Err(error);
                }
            },
            None => None,
        };
        let spec = LaunchSpec {
            egress: egress.as_ref().map(|(_, launch)| launch),
            id: &id,
            program: &self.settings.agent.program,
            args: &self.settings.agent.args,
            dirs: &dirs,
            uid: record.uid,
            join_cgroups: procs.as_deref(),
            needs: &needs,
            pinned: &pinned,
            working_dir: working_dir.as_deref(),
        };
        let started = match self.sandbox.command(&spec) {
            Ok(mut command) => {
                command.env_clear().envs(self.environment(
                    &id,
                    generation,
                    &paths.home,
                    &paths.tmp,
                    record.uid,
                    &overlay,
                ));
                command.current_dir(&host_working_dir);
                worker::spawn(
                    command,
                    id,
                    generation,
                    self.settings.agent_stderr,
                    limits.clone(),
                    entry == Some(CgroupEntry::Birth),
                    (self.sandbox.kind() != SandboxKind::None).then(|| self.sandbox.kind().as_str()),
                )
            }
            Err(error) => Err(error),
        };
        let mut spawned = match started {
            Ok(spawned) => spawned,
            Err(error) => {
                remove_cgroups(&id, limits.as_ref());
                self.record_not_started(&mut record)?;
                return Err(error);
            }
        };
        if let Some(worker) = record.worker.as_mut() {
            worker.process = Some(spawned.worker.process);
        }
        let joined = match (&limits, entry) {
            (Some(_), Some(CgroupEntry::AtExec)) => {
                wait_joined(&mut spawned.stdout, spawned.worker.as_ref()).await
            }
            (Some(handle), Some(CgroupEntry::Adopt)) => handle.adopt(spawned.worker.process.pid),
            _ => Ok(()),
        };
        if let Err(error) = joined {
            let _ = session_runtime::WorkerControl::kill(spawned.worker.as_ref()).await;
            remove_cgroups(&id, limits.as_ref());
            self.record_not_started(&mut record)?;
            return Err(error);
        }
        if let Err(error) = self.store(&record) {
            let _ = session_runtime::WorkerControl::kill(spawned.worker.as_ref()).await;
            remove_cgroups(&id, limits.as_ref());
            return Err(error);
        }
        let (fence, trigger) = Fence::new(id, generation);
        let activity = Activity::default();
        activity.touch();
        held.worker = Some(Live {
            control: Arc::clone(&spawned.worker),
            fence: trigger,
            activity: activity.clone(),
            limits,
            egress: egress.map(|(proxy, _)| proxy),
            pinned_needs: pinned,
        });
        tracing::debug!(session = %id, generation, worker = %spawned.worker.process.pid, "worker started");
        telemetry::attached(RUNTIME, StartKind::of(state), attaching.elapsed());
        Ok(Attachment::new(AttachmentParts::new(
            fence,
            overlay::within(&paths.workspace, working_dir.as_deref()),
            Watched {
                inner: spawned.stdout,
                activity: activity.clone(),
            },
            Watched {
                inner: spawned.stdin,
                activity,
            },
            spawned.worker,
        )))
    }

    /// `create` of an existing session: a different overlay replaces the recorded one, for the
    /// next worker (a running one keeps its own). Takes the session's flock to write the record,
    /// and lets it go again unless this process runs the session's worker.
    fn replace_overlay(
        &self,
        held: &mut Held,
        record: &SessionRecord,
        overlay: Option<&SessionOverlay>,
    ) -> Result<()> {
        let Some(overlay) = overlay else { return Ok(()) };
        let overlay = Some(overlay.clone()).filter(|overlay| !overlay.is_empty());
        if record.overlay == overlay {
            return Ok(());
        }
        let dirs = self.dirs(&record.id);
        let had_lock = held.lock.is_some();
        self.own(held, record.id, &dirs, Some(record))?;
        let mut updated = record.clone();
        updated.overlay = overlay;
        let stored = self.store(&updated);
        if !had_lock {
            held.lock = None;
        }
        stored
    }

    /// Records that the worker of `record`'s new generation did not start.
    /// Records in the session's record that `attach` could not start a worker, with `error`, so
    /// `status` and `ls` show it (a session whose first start failed would otherwise look like a
    /// fresh `created` one). Errors that are not about starting a worker (no such session, a
    /// state that cannot attach, a fenced or busy one) are not recorded. Called with the
    /// session's lock held; a failure to record is logged, never returned over `error`.
    fn note_start_failure(&self, id: &SessionId, error: &Error) {
        if !matches!(
            error,
            Error::WorkerFailed { .. } | Error::InvalidConfig { .. } | Error::Backend { .. }
        ) {
            return;
        }
        telemetry::start_failed(RUNTIME, error);
        let mut record = match self.load(id) {
            Ok(Some(record)) if record.state().can_attach() => record,
            _ => return,
        };
        record.last_start_failure = Some(StartFailure::new(
            SystemTime::now(),
            record.generation,
            error.to_string(),
        ));
        if let Err(store) = self.store(&record) {
            tracing::warn!(session = %id, "recording a failed start: {store}");
        }
    }

    fn record_not_started(&self, record: &mut SessionRecord) -> Result<()> {
        record.phase = Phase::Session(SessionState::Suspended);
        record.worker = None;
        self.store(record)
    }

    /// The cgroups of `id`'s next worker: with the configured limits (an error if they cannot be
    /// had), or, without limits, none where this broker cannot create cgroups (it is not root
    /// and has no delegated subtree): then the worker's process group and marker are all that
    /// tie its processes to the session.
    fn session_cgroups(&self, id: &SessionId) -> Result<Option<LimitsHandle>> {
        let name = crate::sandbox::cgroup::group_name(id, &self.root_tag());
        match &self.settings.limits {
            Some(limits) => self.sandbox.prepare_limits(&name, limits).map(Some),
            None => match self.sandbox.prepare_limits(&name, &ResourceLimits::default()) {
                Ok(handle) => Ok(Some(handle)),
                Err(error) => {
                    tracing::debug!(session = %id, "no cgroup for the worker: {error}");
                    Ok(None)
                }
            },
        }
    }

    /// Upstream OpenAB's environment: cleared, then a baseline, then configured variables, then
    /// inherited ones that were not set explicitly, then the session overlay's; the egress
    /// proxy's and the worker marker win over all of them.
    fn environment(
        &self,
        id: &SessionId,
        generation: u64,
        home: &str,
        tmp: &str,
        uid: Option<u32>,
        overlay: &SessionOverlay,
    ) -> Vec<(String, String)> {
        let agent = &self.settings.agent;
        let mut env: Vec<(String, String)> = vec![
            ("HOME".into(), home.into()),
            ("TMPDIR".into(), tmp.into()),
            ("PATH".into(), broker_path_var()),
            // A session with a user of its own runs as `agent` (the sandbox's passwd says so).
            (
                "USER".into(),
                if uid.is_some() {
                    None
                } else {
                    std::env::var("USER").ok()
                }
                .unwrap_or_else(|| "agent".into()),
            ),
        ];
        for (key, value) in &agent.env {
            env.retain(|(k, _)| k != key);
            env.push((key.clone(), value.clone()));
        }
        for key in &agent.inherit_env {
            if agent.env.contains_key(key) {
                continue;
            }
            if let Ok(value) = std::env::var(key) {
                env.retain(|(k, _)| k != key);
                env.push((key.clone(), value));
            }
        }
        for (key, value) in &overlay.env {
            env.retain(|(k, _)| k != key);
            env.push((key.clone(), value.clone()));
        }
        if let Some(egress) = &self.settings.egress {
            // The only way out of the session's network namespace; set last, so it is the one.
            for (key, value) in egress.plan.environment() {
                env.retain(|(k, _)| *k != key);
                env.push((key, value));
            }
        }
        env.push((WORKER_MARKER.into(), marker_value(&self.scope(), id, generation)));
        env
    }

    /// What the agent needs of the host (see [`needs::resolve`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming `agent.needs` for an entry that no longer resolves.
    fn agent_needs(&self) -> Result<Vec<needs::Needed>> {
        let agent = &self.settings.agent;
        if self.sandbox.kind() == SandboxKind::None {
            // Nothing is shown to a plain worker, which sees the whole host: the listed entries
            // are still checked, and the program's own files need no looking up.
            return needs::listed(&agent.needs);
        }
        needs::resolve(&agent.program, &agent.args, &agent.needs, &self.agent_path_var())
    }

    /// The `PATH` the agent gets (see [`environment`](Self::environment)).
    fn agent_path_var(&self) -> String {
        self.settings
            .agent
            .env
            .get("PATH")
            .cloned()
            .unwrap_or_else(broker_path_var)
    }

    async fn suspend_locked(&self, id: SessionId, held: &mut Held, reason: SuspendReason) -> Result<()> {
        let dirs = self.dirs(&id);
        let (mut record, state) = loop {
            let Some(record) = self.load(&id)? else {
                return Err(Error::NotFound { id });
            };
            let state = record.state();
            if !state.can_suspend() {
                return Err(Error::InvalidState {
                    id,
                    state,
                    operation: "suspend",
                });
            }
            if state != SessionState::Running && record.worker.is_none() && held.worker.is_none() {
                return Ok(());
            }
            if !self.own_left_behind(held, id, &dirs, &record).await? {
                break (record, state);
            }
            // Taken only after a wait: whoever held it may have changed the record, so the
            // lock goes back and the suspend decides again from a fresh read.
            held.lock = None;
        };
        let stopping = record.clone();
        if state == SessionState::Running {
            record.phase = Phase::Session(SessionState::Suspended);
            record.suspend_reason = Some(reason);
            record.last_activity = SystemTime::now();
        }
        // Suspend is recorded before the worker is stopped; `reconcile` stops a survivor.
        self.store(&record)?;
        let grace = if reason == SuspendReason::Hung {
            Duration::ZERO
        } else {
            self.settings.terminate_grace
        };
        self.stop_worker(held, &stopping, stopping.generation, grace)
            .await;
        record.worker = None;
        self.store(&record)?;
        held.lock = None;
        Ok(())
    }

    async fn close_locked(&self, id: SessionId, held: &mut Held, reason: CloseReason) -> Result<bool> {
        let dirs = self.dirs(&id);
        let Some(mut record) = self.load(&id)? else {
            return Ok(false);
        };
        self.own(held, id, &dirs, Some(&record))?;
        if !record.state().is_closed() {
            record.phase = Phase::Session(SessionState::Closing);
            record.close_reason = Some(reason);
            record.last_activity = SystemTime::now();
            self.store(&record)?;
        }
        // What the record will say once the worker is gone.
        let mut closed = record.clone();
        closed.worker = None;
        if closed.state() != SessionState::Closed {
            let reason = closed.close_reason.unwrap_or(reason);
            closed.storage = match self.settings.retention.retained_until(reason, SystemTime::now()) {
                Some(until) => StorageState::Retained { until },
                None => StorageState::Deleted,
            };
            closed.phase = Phase::Session(SessionState::Closed);
        }
        let destination = match closed.storage {
            StorageState::Retained { .. } => layout::retained_dir(&self.settings.root),
            _ => layout::trash_dir(&self.settings.root),
        };
        // The bookkeeping that does not depend on the worker is done while it exits.
        let bookkeeping = async {
            if closed.storage == StorageState::Deleted {
                // The record goes with the storage; its counters stay, so the next session under
                // this id starts above every generation a stray worker of this one could carry.
                self.remember_counters(&closed)?;
            }
            layout::ensure_plain_dir(&destination).map_err(|e| storage_error("preparing closed storage", e))
        };
        let ((), prepared) = tokio::join!(
            self.stop_worker(held, &record, record.generation, self.settings.terminate_grace),
            bookkeeping
        );
        prepared?;
        let record = closed;
        // Retained storage keeps its record, durable before the storage moves. Storage to delete
        // takes its record along: moving the directory out of the root is the commit point (made
        // durable below), and a crash before it leaves `closing`, which reconcile finishes.
        if record.storage != StorageState::Deleted {
            self.store(&record)?;
        }
        if DirEvidence::of(&dirs.base).ok() != Some(record.evidence) {
            return Err(Error::Backend {
                runtime: RUNTIME,
                retryable: false,
                message: format!(
                    "session {id} storage is not the directory recorded at create; left in place"
                ),
                source: None,
            });
        }
        let moved = destination.join(format!("{id}.{}", record.incarnation));
        fs::rename(&dirs.base, &moved).map_err(|e| storage_error("moving closed storage", e))?;
        held.lock = None;
        // Retained storage stays owned by the session's user, so the user is kept until the
        // storage is deleted.
        if record.storage == StorageState::Deleted {
            fs::File::open(&self.settings.root)
                .and_then(|root| root.sync_all())
                .map_err(|e| storage_error("recording the close durably", e))?;
            storage::remove_tree(&moved).map_err(|e| storage_error("deleting session storage", e))?;
            self.release_uid_unless_stored(&id)?;
        }
        Ok(true)
    }

    /// The limits and usage of this process's worker of `id`, if limits are configured. Skipped
    /// (`None`) while a lifecycle operation holds the session: status never waits for one.
    fn resources(&self, id: &SessionId) -> Option<ResourceUsage> {
        let limits = self.settings.limits.as_ref()?;
        let slot = self.slots.lock().get(id).cloned()?;
        let held = slot.held.try_lock().ok()?;
        let usage = held.worker.as_ref()?.limits.as_ref()?.usage();
        let mut resources = ResourceUsage::default();
        resources.memory_limit = limits.memory;
        resources.pids_limit = limits.pids;
        resources.cpu_limit = limits.cpu;
        resources.memory_bytes = usage.memory_bytes;
        resources.pids = usage.pids;
        resources.oom_kills = usage.oom_kills;
        Some(resources)
    }

    /// Keeps the generation and incarnation of a session whose storage is being deleted.
    fn remember_counters(&self, record: &SessionRecord) -> Result<()> {
        let dir = layout::counters_dir(&self.settings.root);
        let fail = |e| storage_error("keeping the counters of a closed session", e);
        layout::ensure_plain_dir(&dir).map_err(fail)?;
        let temporary = dir.join(format!(".{}.tmp", record.id));
        let counters = format!("{} {}\n", record.generation, record.incarnation);
        record::create_fresh(&temporary)
            .and_then(|mut file| file.write_all(counters.as_bytes()))
            .map_err(fail)?;
        fs::rename(&temporary, dir.join(record.id.as_str())).map_err(fail)
    }

    /// The generation and incarnation of `id`'s last deleted session, if any.
    fn counters(&self, id: &SessionId) -> Option<(u64, u64)> {
        let dir = layout::counters_dir(&self.settings.root);
        layout::plain_dir(&dir).ok()?;
        let path = dir.join(id.as_str());
        if !fs::symlink_metadata(&path).ok()?.is_file() {
            return None;
        }
        let text = fs::read_to_string(path).ok()?;
        let (generation, incarnation) = text.trim().split_once(' ')?;
        Some((generation.parse().ok()?, incarnation.parse().ok()?))
    }

    /// The newest retained record of `id`, with its directory.
    fn retained(&self, id: &SessionId) -> Option<(SessionRecord, PathBuf)> {
        let dir = layout::retained_dir(&self.settings.root);
        if !layout::plain_dir(&dir).ok()? {
            return None;
        }
        let entries = fs::read_dir(dir).ok()?;
        entries
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                let (found, incarnation) = name.split_once('.')?;
                (found == id.as_str()).then_some(())?;
                incarnation.parse::<u64>().ok()?;
                let dirs = SessionDirs::at(entry.path());
                let record = record::load(&dirs.record(), id).ok()??;
                Some((record, entry.path()))
            })
            .max_by_key(|(record, _)| record.incarnation)
    }

    async fn provision(
        &self,
        identity: &SessionIdentity,
        options: &CreateOptions,
        held: &mut Held,
        generation: u64,
        incarnation: u64,
        copy_from: Option<&SessionDirs>,
    ) -> Result<SessionRecord> {
        let id = identity.id();
        let dirs = self.dirs(&id);
        self.checked_root.ensure(&self.settings.root)?;
        let adopted = match fs::create_dir(&dirs.base) {
            Ok(()) => false,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                adoptable(&dirs)?;
                true
            }
            Err(e) => return Err(storage_error("creating session storage", e)),
        };
        self.own(held, id, &dirs, None)?;
        let evidence =
            DirEvidence::of(&dirs.base).map_err(|e| storage_error("inspecting session storage", e))?;
        let mut record = SessionRecord::new(identity, incarnation, generation, evidence);
        record.overlay = options.overlay.clone().filter(|overlay| !overlay.is_empty());
        self.store(&record)?;
        for dir in dirs.agent_dirs() {
            // An interrupted or failed provisioning (a seed that failed halfway) leaves partial
            // seeds, and no agent ever ran there: start the directories over.
            if adopted {
                match fs::remove_dir_all(dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(storage_error("clearing an interrupted provisioning", e)),
                }
            }
            fs::create_dir_all(dir).map_err(|e| storage_error("creating session storage", e))?;
        }
        record.uid = self.sandbox.allocate_uid(&self.settings.root, &id)?;
        seed::provision(&self.settings, &dirs, options, copy_from, record.uid).await?;
        self.sandbox.prepare_storage(&dirs, record.uid)?;
        record.phase = Phase::Session(SessionState::Created);
        self.store(&record)?;
        held.lock = None;
        Ok(record)
    }
}

/// Whether an existing directory without a usable record may be (re)provisioned: only if it holds
/// nothing but what an interrupted provisioning leaves.
fn adoptable(dirs: &SessionDirs) -> Result<()> {
    let entries = fs::read_dir(&dirs.base).map_err(|e| storage_error("inspecting session storage", e))?;
    let ours = [
        "lock",
        "record.json",
        ".record.json.tmp",
        record::TRANSIENT_NAME,
        record::TRANSIENT_TEMPORARY_NAME,
        "workspace",
        "home",
        "state",
        "tmp",
    ];
    for entry in entries.flatten() {
        if !ours.iter().any(|name| entry.file_name() == *name) {
            return Err(Error::Backend {
                runtime: RUNTIME,
                retryable: false,
                message: format!(
                    "{} holds files this runtime did not create; move it away to provision the session",
                    dirs.base.display()
                ),
                source: None,
            });
        }
    }
    Ok(())
}

/// How long a worker may take to join its cgroups (a few shell built-ins) before it is killed.
const CGROUP_JOIN_WAIT: Duration = Duration::from_secs(5);

/// Waits until `worker` has joined its cgroups (its program starts only then), so that when
/// `attach` returns, the cgroups account for it, or until it has exited (it could not join; its
/// exit says why).
///
/// The joining shell announces the join with one byte on the worker's stdout
/// ([`JOINED`](crate::sandbox::cgroup::JOINED)), read off here before the attachment gets the
/// stream: waking on it costs nothing and is exact, where polling `cgroup.procs` cost a timer
/// tick (a millisecond or more) per attach.
///
/// # Errors
///
/// [`Error::Backend`] if neither happened within [`CGROUP_JOIN_WAIT`], or the worker's first
/// byte was not the announcement.
async fn wait_joined(stdout: &mut tokio::process::ChildStdout, worker: &LocalWorker) -> Result<()> {
    use tokio::io::AsyncReadExt;
    let mut first = [0u8; 1];
    let read = tokio::time::timeout(CGROUP_JOIN_WAIT, stdout.read(&mut first)).await;
    let failure = |what: String| Error::Backend {
        runtime: RUNTIME,
        retryable: true,
        message: format!("worker {} {what}", worker.process.pid),
        source: None,
    };
    match read {
        // Joined.
        Ok(Ok(1)) if first[0] == crate::sandbox::cgroup::JOINED => Ok(()),
        // Its stdout ended before the announcement: it exited without joining.
        Ok(Ok(0)) => Ok(()),
        Ok(Ok(_)) => Err(failure("wrote to its stdout before joining its cgroups".into())),
        Ok(Err(error)) => Err(failure(format!(
            "could not be watched joining its cgroups: {error}"
        ))),
        Err(_) => Err(failure(format!(
            "did not join its cgroups within {CGROUP_JOIN_WAIT:?}"
        ))),
    }
}

/// Removes a session's cgroups, killing what is left in them; a failure is logged (`reconcile`
/// finds the cgroups again by name).
fn remove_cgroups(id: &SessionId, limits: Option<&LimitsHandle>) {
    if let Some(Err(error)) = limits.map(LimitsHandle::remove) {
        tracing::warn!(session = %id, "{error}");
    }
}

/// The broker's `PATH`, the agent's unless configured otherwise.
fn broker_path_var() -> String {
    std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into())
}

/// Whether no process is left in the process group `pgid`.
fn group_is_empty(pgid: u32) -> bool {
    rustix::process::Pid::from_raw(pgid as i32)
        .is_some_and(|pid| rustix::process::test_kill_process_group(pid) == Err(rustix::io::Errno::SRCH))
}

pub(crate) fn marker_value(scope: &str, id: &SessionId, generation: u64) -> String {
    format!("{scope}:{id}:{generation}")
}

/// Kills a worker recorded by any broker process: by pid and start time when it was recorded, else
/// by the marker in its environment. Waits a bounded time for it to go.
///
/// A record is untrusted input, so the process it names is signalled only if it is a worker of
/// this session: the pid with its start time, carrying the session's marker. A record naming any
/// other process (an edited record, a pid reused since) gets a warning and no signal.
async fn kill_recorded(scope: &str, id: &SessionId, worker: &WorkerRecord) {
    let session_marker = format!("{WORKER_MARKER}={scope}:{id}:");
    match worker.process {
        Some(process) if process.is_alive() => {
            if process::environment_entry(process.pid, &session_marker).is_none() {
                tracing::warn!(
                    session = %id,
                    pid = process.pid,
                    "the recorded worker process is not a worker of this session; not signalled"
                );
                return;
            }
            let _ = process::signal_tree(process, Signal::KILL);
            let deadline = tokio::time::Instant::now() + ORPHAN_EXIT_WAIT;
            while process.is_alive() && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // Gone already (its remains are found by their marker, see `kill_leftovers`).
        Some(_) => {}
        None => {
            let marker = format!("{WORKER_MARKER}={}", marker_value(scope, id, worker.generation));
            for pid in process::with_environment_entry(&marker) {
                if let Some(found) = ProcessRef::of(pid) {
                    let _ = process::signal_tree(found, Signal::KILL);
                }
            }
        }
    }
}

/// Kills every process that still carries a worker marker of session `id` (any generation), and
/// waits a bounded time until none is left. A process that has begun exiting no longer shows its
/// environment, so it counts as gone: it can no longer make a system call.
async fn kill_leftovers(scope: &str, id: &SessionId) {
    let prefix = format!("{WORKER_MARKER}={scope}:{id}:");
    let deadline = tokio::time::Instant::now() + ORPHAN_EXIT_WAIT;
    loop {
        let left = process::with_environment_prefix(&prefix);
        if left.is_empty() {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(session = %id, processes = left.len(), "worker processes survived SIGKILL");
            return;
        }
        for (pid, _) in left {
            if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(pid, Signal::KILL);
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[async_trait]
impl SessionRuntime for LocalRuntime {
    fn name(&self) -> &'static str {
        RUNTIME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal()
            .with_isolation(self.sandbox.isolation())
            .with_persistent_storage(true)
            .with_overlay(true)
    }

    async fn create(&self, identity: &SessionIdentity, options: &CreateOptions) -> Result<SessionHandle> {
        identity.require_installation(&self.settings.installation)?;
        if let Some(overlay) = &options.overlay {
            // Checked before anything exists: the working directory is one inside the session's
            // own workspace, never a host path.
            overlay.validate()?;
            overlay.relative_working_dir()?;
        }
        let id = identity.id();
        let slot = self.slot(&id);
        let mut held = slot.held.lock().await;
        let existing = self.load(&id)?;
        if let Some(record) = &existing {
            if !record.belongs_to(identity) {
                return Err(Error::Backend {
                    runtime: RUNTIME,
                    retryable: false,
                    message: format!("session {id} record belongs to another identity"),
                    source: None,
                });
            }
            match record.phase {
                Phase::Provisioning => {}
                Phase::Session(SessionState::Closing | SessionState::Closed) => {
                    self.close_locked(id, &mut held, CloseReason::Ended).await?;
                }
                Phase::Session(state) => {
                    self.replace_overlay(&mut held, record, options.overlay.as_ref())?;
                    return Ok(SessionHandle::new(id, state, record.generation, false));
                }
            }
        }
        // Generations and incarnations only grow, across closes too.
        let (generation, incarnation) = match &existing {
            Some(record) if record.phase == Phase::Provisioning => (record.generation, record.incarnation),
            Some(record) => (record.generation, record.incarnation + 1),
            None => {
                let retained = self
                    .retained(&id)
                    .map(|(record, _)| (record.generation, record.incarnation));
                let (generation, incarnation) = retained.max(self.counters(&id)).unwrap_or((0, 0));
                (generation, incarnation + 1)
            }
        };
        // A session whose agent could not run fails here, before any of its storage exists.
        self.sandbox
            .check_needs(&self.agent_needs()?, &self.settings.root, None)?;
        let copy_source = match &options.workspace_seed {
            Some(WorkspaceSeed::CopyOf { source }) if *source == id => {
                return Err(Error::InvalidArgument {
                    reason: format!("session {id} cannot be seeded with a copy of its own storage"),
                })
            }
            Some(WorkspaceSeed::CopyOf { source }) => Some((*source, self.slot(source))),
            _ => None,
        };
        // The source's lifecycle lock, then its flock, for as long as the copy takes; never
        // waited on (two creates copying each other would deadlock), and released on drop if this
        // call is cancelled.
        let source_held = match &copy_source {
            Some((source, slot)) => Some(slot.held.try_lock().map_err(|_| Error::StorageInUse {
                id: *source,
                holder: "another operation on it in this broker".into(),
            })?),
            None => None,
        };
        let lent = match (&copy_source, &source_held) {
            (Some((source, _)), Some(source_held)) => Some(self.lend(*source, source_held)?),
            _ => None,
        };
        let record = self
            .provision(
                identity,
                options,
                &mut held,
                generation,
                incarnation,
                lent.as_ref().map(|(dirs, _)| dirs),
            )
            .await?;
        Ok(SessionHandle::new(id, record.state(), record.generation, true))
    }

    async fn attach(&self, id: &SessionId) -> Result<Attachment> {
        let slot = self.slot(id);
        let mut held = slot.held.lock().await;
        let attached = self.attach_locked(*id, &mut held).await;
        if let Err(error) = &attached {
            self.note_start_failure(id, error);
        }
        attached
    }

    async fn suspend(&self, id: &SessionId, reason: SuspendReason) -> Result<()> {
        let slot = self.slot(id);
        let mut held = slot.held.lock().await;
        self.suspend_locked(*id, &mut held, reason).await
    }

    async fn close(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let slot = self.slot(id);
        let mut held = slot.held.lock().await;
        self.close_locked(*id, &mut held, reason).await.map(drop)
    }

    async fn status(&self, id: &SessionId) -> Result<SessionStatus> {
        if let Some(record) = self.load(id)? {
            let mut status = record.status(self.storage_refs(&self.dirs(id)));
            status.resources = self.resources(id);
            return Ok(status);
        }
        match self.retained(id) {
            Some((record, path)) => Ok(record.status(vec![path.display().to_string()])),
            None => Err(Error::NotFound { id: *id }),
        }
    }

    async fn list(&self) -> Result<Vec<SessionStatus>> {
        if !self.has_root() {
            return Ok(Vec::new());
        }
        let entries = fs::read_dir(&self.settings.root).map_err(|e| storage_error("listing sessions", e))?;
        let mut ids: Vec<SessionId> = entries
            .flatten()
            .filter_map(|entry| entry.file_name().to_str().and_then(|n| SessionId::parse(n).ok()))
            .collect();
        // Closed sessions whose storage is retained have their record in `.retained/<id>.<n>`.
        let retained = layout::retained_dir(&self.settings.root);
        if layout::plain_dir(&retained).unwrap_or(false) {
            let entries =
                fs::read_dir(&retained).map_err(|e| storage_error("listing retained sessions", e))?;
            ids.extend(entries.flatten().filter_map(|entry| {
                let name = entry.file_name().into_string().ok()?;
                SessionId::parse(name.split_once('.')?.0).ok()
            }));
        }
        ids.sort_unstable();
        ids.dedup();
        let mut sessions = Vec::new();
        for id in ids {
            match self.status(&id).await {
                Ok(status) => sessions.push(status),
                Err(error) => tracing::warn!(session = %id, "skipping an unreadable session: {error}"),
            }
        }
        Ok(sessions)
    }

    async fn reconcile(&self) -> Result<ReconcileReport> {
        crate::reconcile::run(self).await
    }
}

impl LocalRuntime {
    /// Sessions with live storage under the root.
    pub(crate) fn live_ids(&self) -> Result<Vec<SessionId>> {
        if !self.has_root() {
            return Ok(Vec::new());
        }
        let entries = fs::read_dir(&self.settings.root).map_err(|e| storage_error("listing sessions", e))?;
        Ok(entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| SessionId::parse(n).ok()))
            .collect())
    }

    /// Releases the uid of every session that has no storage left, live or retained: a broker
    /// killed between deleting a session's storage and releasing its uid leaves the claim behind
    /// (`close` deletes first, so a uid never goes back into use while files still carry it).
    /// Each session is checked under its lifecycle lock, so a `create` of this process cannot
    /// pick the claim up in between.
    pub(crate) async fn release_unused_uids(&self, report: &mut ReconcileReport) {
        let holders = match self.sandbox.uid_holders(&self.settings.root) {
            Ok(holders) => holders,
            Err(error) => {
                report.errors.push(format!("reading uid claims: {error}"));
                return;
            }
        };
        for holder in holders {
            let Ok(id) = SessionId::parse(&holder) else {
                continue;
            };
            let slot = self.slot(&id);
            let _held = slot.held.lock().await;
            if let Err(error) = self.release_uid_unless_stored(&id) {
                report
                    .errors
                    .push(format!("session {id}: releasing its user: {error}"));
            }
        }
    }

    /// Frees the uid of `id` unless some storage of it is left: a live directory (of this broker
    /// or of another one creating the session right now) or retained storage. Files keep their
    /// owner, so a uid never goes back into use while files still carry it.
    pub(crate) fn release_uid_unless_stored(&self, id: &SessionId) -> Result<()> {
        let retained = layout::retained_dir(&self.settings.root);
        let prefix = format!("{id}.");
        self.sandbox.release_uid(&self.settings.root, id, || {
            let has_retained = fs::read_dir(&retained).is_ok_and(|mut entries| {
                entries.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().starts_with(&prefix)))
            });
            // `symlink_metadata`: anything at the session's path, even a dangling link, counts.
            has_retained || fs::symlink_metadata(self.dirs(id).base).is_ok()
        })
    }

    /// Takes the session's lock like [`own`](Self::own), but waits (polling, within
    /// `ORPHAN_EXIT_WAIT`) while the lock outlives the broker `record` names (see
    /// [`own_abandoned`](Self::own_abandoned)): a `run` killed a moment ago is suspended by its
    /// guard, which must not fail on the lock its dying broker's last child still holds.
    /// `Ok(true)` if it waited (the record may have changed meanwhile, so the caller reads it
    /// again).
    ///
    /// # Errors
    /// [`Error::StorageInUse`] if a live broker holds the lock, or the lock outlived the wait.
    async fn own_left_behind(
        &self,
        held: &mut Held,
        id: SessionId,
        dirs: &SessionDirs,
        record: &SessionRecord,
    ) -> Result<bool> {
        let deadline = tokio::time::Instant::now() + ORPHAN_EXIT_WAIT;
        let mut waited = false;
        loop {
            match self.own(held, id, dirs, Some(record)) {
                Err(Error::StorageInUse { .. })
                    if !self.owned_by_live_broker(record) && tokio::time::Instant::now() < deadline =>
                {
                    waited = true;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                owned => return owned.map(|()| waited),
            }
        }
    }

    /// Whether `record` names a worker of another broker that still runs.
    fn owned_by_live_broker(&self, record: &SessionRecord) -> bool {
        record
            .worker
            .is_some_and(|w| w.broker != self.broker && w.broker.is_alive())
    }

    /// Takes the session's lock for `reconcile`, to repair what a broker that is gone left
    /// behind. `Ok(false)`: a live broker owns the session.
    ///
    /// The lock of a broker killed a moment ago can outlive it: a worker it was starting holds a
    /// copy of every descriptor (the lock's too) until it executes the agent. So while the
    /// record names no live broker but this one, a held lock is waited for (polling, within
    /// `ORPHAN_EXIT_WAIT`); otherwise the pass would skip the session and leave its orphan running.
    async fn own_abandoned(&self, held: &mut Held, id: SessionId) -> Result<bool> {
        let dirs = self.dirs(&id);
        let deadline = tokio::time::Instant::now() + ORPHAN_EXIT_WAIT;
        loop {
            // Gone meanwhile (closed by the broker that held it): nothing to repair.
            let Some(record) = self.load(&id)? else {
                return Ok(false);
            };
            match self.own(held, id, &dirs, Some(&record)) {
                Ok(()) => return Ok(true),
                Err(Error::StorageInUse { .. }) => {}
                Err(error) => return Err(error),
            }
            if self.owned_by_live_broker(&record) || tokio::time::Instant::now() >= deadline {
                return Ok(false);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// [`own_abandoned`](Self::own_abandoned), and then only if the record is still `decided_on`
    /// (what the caller decided from); if it changed while the lock was waited for, the lock is
    /// let go again and the next pass decides afresh.
    async fn own_unchanged(
        &self,
        held: &mut Held,
        id: SessionId,
        decided_on: &SessionRecord,
    ) -> Result<bool> {
        let had_lock = held.lock.is_some();
        if !self.own_abandoned(held, id).await? {
            return Ok(false);
        }
        if self.load(&id)?.as_ref() == Some(decided_on) {
            return Ok(true);
        }
        if !had_lock {
            held.lock = None;
        }
        Ok(false)
    }

    /// Stops what is left of a worker that should not run and records that none does (a running
    /// session becomes suspended, as by a broker shutdown). `false` if another live broker owns
    /// the session.
    async fn stop_stray(&self, held: &mut Held, id: SessionId, record: &SessionRecord) -> Result<bool> {
        if !self.own_unchanged(held, id, record).await? {
            return Ok(false);
        }
        self.stop_worker(held, record, record.generation, Duration::ZERO)
            .await;
        let mut record = record.clone();
        record.worker = None;
        if record.state() == SessionState::Running {
            record.phase = Phase::Session(SessionState::Suspended);
            record.suspend_reason = Some(SuspendReason::Shutdown);
        }
        self.store(&record)?;
        held.lock = None;
        Ok(true)
    }

    /// One reconcile step for one live session.
    pub(crate) async fn reconcile_session(&self, id: SessionId, report: &mut ReconcileReport) -> Result<()> {
        let slot = self.slot(&id);
        let mut held = slot.held.lock().await;
        let Some(record) = self.load(&id)? else {
            return Ok(());
        };
        let state = record.state();
        // This process's worker, if it is of the recorded generation: (alive, last activity).
        let ours = held
            .worker
            .as_ref()
            .filter(|live| {
                session_runtime::WorkerControl::generation(live.control.as_ref()) == record.generation
            })
            .map(|live| {
                (
                    session_runtime::WorkerControl::is_alive(live.control.as_ref()),
                    live.activity.last(),
                )
            });
        // A worker that should not run: the record says so, it is of an older generation, or it
        // was started by a broker that is gone.
        let recorded = record.worker.filter(|w| w.process.is_none_or(|p| p.is_alive()));
        let stray_recorded = recorded.is_some_and(|w| {
            !state.may_run_worker()
                || w.generation != record.generation
                || (w.broker != self.broker && !w.broker.is_alive())
        });
        let stray_held = held.worker.is_some() && (!state.may_run_worker() || ours.is_none());
        if stray_recorded || stray_held {
            if !self.stop_stray(&mut held, id, &record).await? {
                return Ok(()); // another live broker owns it and will act
            }
            report
                .killed_workers
                .push((id, format!("a worker ran while the session was {state}")));
        } else if (state == SessionState::Running || record.worker.is_some())
            && recorded.is_none()
            && held.worker.is_none()
            && !self.owned_by_live_broker(&record)
        {
            // The record names a worker (or says one runs), but it is gone and no live broker
            // owns the session: it died with a broker killed by SIGKILL (bubblewrap's
            // `--die-with-parent`), exited on its own afterwards (e.g. on a broken stdout), or
            // the broker was killed while stopping it, before it could finish (remove the
            // worker's cgroup, record that it stopped). Without this the record would claim a
            // worker that does not exist, and what it left would stay, forever. `stop_worker`
            // signals what may remain of its process group and removes a cgroup left behind.
            if !self.stop_stray(&mut held, id, &record).await? {
                return Ok(()); // another live broker owns it and will act
            }
            tracing::info!(session = %id, "the recorded worker is gone; its record is repaired");
        }
        if state == SessionState::Closing
            || (state == SessionState::Closed && record.storage != StorageState::Present)
        {
            // As the steps above may have left it.
            let Some(current) = self.load(&id)? else {
                return Ok(());
            };
            if !self.own_unchanged(&mut held, id, &current).await? {
                return Ok(()); // another live broker is closing it
            }
            let reason = record.close_reason.unwrap_or(CloseReason::Ended);
            if self.close_locked(id, &mut held, reason).await? {
                report.finished_closes.push(id);
            }
            return Ok(());
        }
        if let (SessionState::Running, Some((true, activity)), Some(ttl)) =
            (state, ours, self.settings.idle_ttl)
        {
            let last = activity.max(record.last_activity);
            if SystemTime::now().duration_since(last).unwrap_or_default() >= ttl {
                self.suspend_locked(id, &mut held, SuspendReason::Idle).await?;
                report.suspended_idle.push(id);
            }
        }
        Ok(())
    }
}
