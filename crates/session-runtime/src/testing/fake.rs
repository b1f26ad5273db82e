//! [`FakeRuntime`]: the reference implementation of the contract, in memory.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use parking_lot::Mutex;
use tokio::task::AbortHandle;

use crate::conformance::FaultInjector;
use crate::{
    Attachment, AttachmentParts, Capabilities, CloseReason, CreateOptions, Error, ExitCell, Fence,
    FenceTrigger, Generation, IsolationLevel, ReconcileReport, Result, RetentionPolicy, SessionHandle,
    SessionId, SessionIdentity, SessionOverlay, SessionRuntime, SessionState, SessionStatus, StorageState,
    SuspendReason, WorkerControl, WorkerExit, WorkerInfo,
};

const RUNTIME: &str = "fake";
/// Bytes buffered in each direction between the broker and the in-process agent.
const PIPE_BUFFER: usize = 64 * 1024;

/// Builds a [`FakeRuntime`].
#[derive(Debug, Clone)]
pub struct FakeRuntimeBuilder {
    installation: String,
    retention: RetentionPolicy,
    idle_ttl: Option<Duration>,
    launcher: Arc<dyn WorkerLauncher>,
}

impl FakeRuntimeBuilder {
    /// Sets the installation whose sessions the runtime serves (default `test`).
    pub fn installation(mut self, installation: impl Into<String>) -> Self {
        self.installation = installation.into();
        self
    }

    /// Sets the retention policy (default: delete on every reason).
    pub fn retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }

    /// Sets the idle TTL `reconcile` suspends after (default: none).
    pub fn idle_ttl(mut self, idle_ttl: Option<Duration>) -> Self {
        self.idle_ttl = idle_ttl;
        self
    }

    /// Sets the options of the in-process agent (its exec and state directories are per session).
    pub fn agent_options(mut self, agent: acp_test_agent::AgentOptions) -> Self {
        self.launcher = Arc::new(InProcessAgent { options: agent });
        self
    }

    /// Starts workers with `launcher` instead of the in-process test agent, keeping the fake's
    /// records and lifecycle: how a transport's tests (e.g. the worker relay's) run the
    /// conformance suite with the transport in the path.
    pub fn launcher(mut self, launcher: impl WorkerLauncher) -> Self {
        self.launcher = Arc::new(launcher);
        self
    }

    /// Builds the runtime with storage in a fresh temporary directory.
    ///
    /// # Errors
    /// [`Error::Backend`] if the temporary directory cannot be created.
    pub fn build(self) -> Result<FakeRuntime> {
        let root = tempfile::Builder::new()
            .prefix("openab-fake-runtime-")
            .tempdir()
            .map_err(|e| Error::backend(RUNTIME, true, "creating the storage root", e))?;
        Ok(FakeRuntime {
            installation: self.installation,
            retention: self.retention,
            idle_ttl: self.idle_ttl,
            launcher: self.launcher,
            root,
            sessions: Mutex::default(),
        })
    }
}

/// An in-memory runtime that runs the ACP test agent in-process, one task per worker.
///
/// Storage is a real directory per session (so exec probes can show that it survives suspend),
/// records live in memory, workers are Tokio tasks connected by in-memory pipes. It isolates
/// nothing and survives nothing. It is the reference the conformance suite is checked against,
/// and a stand-in for broker tests. It refuses a [`SessionOverlay`] with
/// [`Error::Unsupported`] naming the field: its in-process agents share the test's working
/// directory and environment.
#[derive(Debug)]
pub struct FakeRuntime {
    installation: String,
    retention: RetentionPolicy,
    idle_ttl: Option<Duration>,
    launcher: Arc<dyn WorkerLauncher>,
    root: tempfile::TempDir,
    sessions: Mutex<HashMap<SessionId, Arc<SessionSlot>>>,
}

/// One session: its record, and a lock that serializes its lifecycle operations.
#[derive(Debug)]
struct SessionSlot {
    lifecycle: tokio::sync::Mutex<()>,
    record: Mutex<Record>,
}

#[derive(Debug)]
struct Record {
    status: SessionStatus,
    incarnation: u64,
    storage: PathBuf,
    worker: Option<LiveWorker>,
}

#[derive(Debug)]
struct LiveWorker {
    control: Arc<dyn WorkerControl>,
    fence: FenceTrigger,
}

impl FakeRuntime {
    /// A builder with defaults: installation `test`, delete on every close, no idle TTL.
    pub fn builder() -> FakeRuntimeBuilder {
        FakeRuntimeBuilder {
            installation: "test".into(),
            retention: RetentionPolicy::default(),
            idle_ttl: None,
            launcher: Arc::new(InProcessAgent {
                options: acp_test_agent::AgentOptions::default(),
            }),
        }
    }

    /// The installation this runtime serves.
    pub fn installation(&self) -> &str {
        &self.installation
    }

    /// The retention policy this runtime applies.
    pub fn retention(&self) -> &RetentionPolicy {
        &self.retention
    }

    fn slot(&self, id: &SessionId) -> Result<Arc<SessionSlot>> {
        self.sessions
            .lock()
            .get(id)
            .cloned()
            .ok_or(Error::NotFound { id: *id })
    }

    fn workspace(storage: &Path) -> PathBuf {
        storage.join("workspace")
    }

    /// Stops the session's worker, if any, fencing its attachment on behalf of `generation`.
    async fn stop_worker(
        record: &Mutex<Record>,
        generation: Generation,
        grace: Option<Duration>,
    ) -> Option<WorkerExit> {
        let worker = record.lock().worker.take()?;
        worker.fence.fence(generation);
        let exit = match grace {
            Some(grace) => worker.control.terminate(grace).await,
            None => worker.control.kill().await,
        };
        exit.ok()
    }

    fn apply_retention(&self, record: &mut Record, reason: CloseReason, now: SystemTime) -> Result<()> {
        record.status.storage = match self.retention.retained_until(reason, now) {
            Some(until) => StorageState::Retained { until },
            None => {
                if record.storage.exists() {
                    std::fs::remove_dir_all(&record.storage)
                        .map_err(|e| Error::backend(RUNTIME, true, "deleting session storage", e))?;
                }
                StorageState::Deleted
            }
        };
        Ok(())
    }

    async fn start_worker(&self, id: SessionId, slot: &SessionSlot) -> Result<Attachment> {
        let (generation, storage) = {
            let mut record = slot.record.lock();
            if !record.status.state.can_attach() {
                return Err(Error::InvalidState {
                    id,
                    state: record.status.state,
                    operation: "attach",
                });
            }
            record.status.generation += 1;
            (record.status.generation, record.storage.clone())
        };
        // Fence and stop the previous worker before the new one may touch storage.
        Self::stop_worker(&slot.record, generation, None).await;

        let (fence, trigger) = Fence::new(id, generation);
        let request = LaunchRequest {
            id,
            generation,
            workspace: Self::workspace(&storage),
            state_dir: storage.join("agent-state"),
        };
        let attachment = self.launcher.launch(request, fence).await?;
        let control = attachment.control();
        let now = SystemTime::now();
        let mut record = slot.record.lock();
        record.status.state = SessionState::Running;
        record.status.suspend_reason = None;
        record.status.worker = Some(WorkerInfo::new(control.worker_id(), generation, now));
        record.status.last_activity = now;
        record.worker = Some(LiveWorker {
            control,
            fence: trigger,
        });
        Ok(attachment)
    }

    async fn suspend_locked(&self, id: SessionId, slot: &SessionSlot, reason: SuspendReason) -> Result<()> {
        let generation = {
            let mut record = slot.record.lock();
            let state = record.status.state;
            if !state.can_suspend() {
                return Err(Error::InvalidState {
                    id,
                    state,
                    operation: "suspend",
                });
            }
            if state == SessionState::Running {
                record.status.state = SessionState::Suspended;
                record.status.suspend_reason = Some(reason);
                record.status.worker = None;
                record.status.last_activity = SystemTime::now();
            }
            record.status.generation
        };
        let grace = (reason != SuspendReason::Hung).then_some(Duration::ZERO);
        Self::stop_worker(&slot.record, generation, grace).await;
        Ok(())
    }

    async fn close_locked(&self, slot: &SessionSlot, reason: CloseReason) -> Result<()> {
        let generation = {
            let mut record = slot.record.lock();
            match record.status.state {
                SessionState::Closed => return Ok(()),
                SessionState::Closing => {}
                _ => {
                    record.status.state = SessionState::Closing;
                    record.status.close_reason = Some(reason);
                    record.status.worker = None;
                }
            }
            record.status.generation
        };
        Self::stop_worker(&slot.record, generation, Some(Duration::ZERO)).await;
        let mut record = slot.record.lock();
        let reason = record.status.close_reason.unwrap_or(reason);
        let now = SystemTime::now();
        self.apply_retention(&mut record, reason, now)?;
        record.status.state = SessionState::Closed;
        record.status.last_activity = now;
        Ok(())
    }
}

#[async_trait]
impl SessionRuntime for FakeRuntime {
    fn name(&self) -> &'static str {
        RUNTIME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal()
            .with_isolation(IsolationLevel::None)
            .with_persistent_storage(true)
    }

    async fn create(&self, identity: &SessionIdentity, options: &CreateOptions) -> Result<SessionHandle> {
        identity.require_installation(&self.installation)?;
        // The in-process agent shares the test's working directory and environment.
        SessionOverlay::refuse(options.overlay.as_ref(), RUNTIME)?;
        if options.workspace_seed.is_some() {
            return Err(Error::Unsupported {
                operation: "workspace seeds",
                runtime: RUNTIME,
            });
        }
        let id = identity.id();
        let slot = {
            let mut sessions = self.sessions.lock();
            let slot = sessions.entry(id).or_insert_with(|| {
                Arc::new(SessionSlot {
                    lifecycle: tokio::sync::Mutex::new(()),
                    record: Mutex::new(Record {
                        status: SessionStatus::new(id, SystemTime::now()),
                        incarnation: 0,
                        storage: PathBuf::new(),
                        worker: None,
                    }),
                })
            });
            Arc::clone(slot)
        };
        let _lifecycle = slot.lifecycle.lock().await;
        let mut record = slot.record.lock();
        let fresh = record.incarnation == 0 || record.status.state == SessionState::Closed;
        if fresh {
            record.incarnation += 1;
            // A new incarnation never sees storage retained by an earlier close.
            record.storage = self
                .root
                .path()
                .join(id.as_str())
                .join(record.incarnation.to_string());
            std::fs::create_dir_all(Self::workspace(&record.storage))
                .map_err(|e| Error::backend(RUNTIME, true, "creating session storage", e))?;
            let generation = record.status.generation;
            record.status = SessionStatus::new(id, SystemTime::now());
            // Generations only grow, across incarnations too, so nothing old is ever current again.
            record.status.generation = generation;
            record.status.storage_refs = vec![record.storage.display().to_string()];
        }
        Ok(SessionHandle::new(
            id,
            record.status.state,
            record.status.generation,
            fresh,
        ))
    }

    async fn attach(&self, id: &SessionId) -> Result<Attachment> {
        let slot = self.slot(id)?;
        let _lifecycle = slot.lifecycle.lock().await;
        self.start_worker(*id, &slot).await
    }

    async fn suspend(&self, id: &SessionId, reason: SuspendReason) -> Result<()> {
        let slot = self.slot(id)?;
        let _lifecycle = slot.lifecycle.lock().await;
        self.suspend_locked(*id, &slot, reason).await
    }

    async fn close(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let Ok(slot) = self.slot(id) else {
            return Ok(());
        };
        let _lifecycle = slot.lifecycle.lock().await;
        self.close_locked(&slot, reason).await
    }

    async fn status(&self, id: &SessionId) -> Result<SessionStatus> {
        Ok(self.slot(id)?.record.lock().status.clone())
    }

    async fn list(&self) -> Result<Vec<SessionStatus>> {
        let slots: Vec<_> = self.sessions.lock().values().cloned().collect();
        Ok(slots
            .iter()
            .map(|slot| slot.record.lock().status.clone())
            .collect())
    }

    async fn reconcile(&self) -> Result<ReconcileReport> {
        let mut report = ReconcileReport::default();
        let slots: Vec<_> = self
            .sessions
            .lock()
            .iter()
            .map(|(id, slot)| (*id, Arc::clone(slot)))
            .collect();
        let now = SystemTime::now();
        for (id, slot) in slots {
            let _lifecycle = slot.lifecycle.lock().await;
            let (state, stray, idle) = {
                let record = slot.record.lock();
                let alive = record.worker.as_ref().is_some_and(|w| w.control.is_alive());
                let idle = self.idle_ttl.is_some_and(|ttl| {
                    now.duration_since(record.status.last_activity)
                        .unwrap_or_default()
                        >= ttl
                });
                (
                    record.status.state,
                    alive && !record.status.state.may_run_worker(),
                    idle,
                )
            };
            if stray {
                let generation = slot.record.lock().status.generation;
                Self::stop_worker(&slot.record, generation, None).await;
                report
                    .killed_workers
                    .push((id, format!("a worker ran while the session was {state}")));
            }
            if state == SessionState::Closing {
                match self.close_locked(&slot, CloseReason::Ended).await {
                    Ok(()) => report.finished_closes.push(id),
                    Err(error) => report.errors.push(format!("session {id}: {error}")),
                }
            } else if state == SessionState::Running && idle {
                match self.suspend_locked(id, &slot, SuspendReason::Idle).await {
                    Ok(()) => report.suspended_idle.push(id),
                    Err(error) => report.errors.push(format!("session {id}: {error}")),
                }
            } else if state == SessionState::Closed {
                let mut record = slot.record.lock();
                if let StorageState::Retained { until } = record.status.storage {
                    if until.has_passed(now) {
                        match std::fs::remove_dir_all(&record.storage) {
                            Ok(()) => {
                                record.status.storage = StorageState::Deleted;
                                report.expired_storage.push(id);
                            }
                            Err(error) => report
                                .errors
                                .push(format!("session {id}: deleting storage: {error}")),
                        }
                    }
                }
            }
        }
        Ok(report)
    }
}

#[async_trait]
impl FaultInjector for FakeRuntime {
    async fn record_suspended_keep_worker(&self, id: &SessionId) -> Result<()> {
        let slot = self.slot(id)?;
        let _lifecycle = slot.lifecycle.lock().await;
        let mut record = slot.record.lock();
        record.status.state = SessionState::Suspended;
        record.status.suspend_reason = Some(SuspendReason::Shutdown);
        record.status.worker = None;
        Ok(())
    }

    async fn record_closing(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let slot = self.slot(id)?;
        let _lifecycle = slot.lifecycle.lock().await;
        let mut record = slot.record.lock();
        record.status.state = SessionState::Closing;
        record.status.close_reason = Some(reason);
        Ok(())
    }
}

/// What a [`WorkerLauncher`] is asked to start.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct LaunchRequest {
    /// The session.
    pub id: SessionId,
    /// The generation the worker is started for.
    pub generation: Generation,
    /// The session's workspace: the agent's working directory and the exec probe's.
    pub workspace: PathBuf,
    /// A directory for the agent's state, kept across generations (for `session/load`).
    pub state_dir: PathBuf,
}

/// Starts the workers of a [`FakeRuntime`]. The default runs the ACP test agent in-process.
#[async_trait]
pub trait WorkerLauncher: fmt::Debug + Send + Sync + 'static {
    /// Starts a worker and returns the attachment to it, built on `fence` (so the runtime can
    /// fence it when a newer worker takes over).
    ///
    /// # Errors
    /// Whatever starting the worker failed with, as contract errors.
    async fn launch(&self, request: LaunchRequest, fence: Fence) -> Result<Attachment>;
}

/// The default launcher: the ACP test agent as a Tokio task, over in-memory pipes.
#[derive(Debug)]
struct InProcessAgent {
    options: acp_test_agent::AgentOptions,
}

#[async_trait]
impl WorkerLauncher for InProcessAgent {
    async fn launch(&self, request: LaunchRequest, fence: Fence) -> Result<Attachment> {
        let mut options = self.options.clone();
        options.exec_dir = Some(request.workspace.clone());
        options.state_dir = Some(request.state_dir);
        let (broker_output, agent_output) = tokio::io::duplex(PIPE_BUFFER);
        let (agent_input, broker_input) = tokio::io::duplex(PIPE_BUFFER);
        let exit = ExitCell::new();
        let task = {
            let exit = exit.clone();
            tokio::spawn(async move {
                let result = acp_test_agent::serve(agent_input, agent_output, options).await;
                exit.set(WorkerExit::Code(if result.is_ok() { 0 } else { 1 }));
            })
        };
        let control: Arc<dyn WorkerControl> = Arc::new(FakeWorker {
            worker_id: format!("fake-{}-{}", request.id, request.generation),
            generation: request.generation,
            task: task.abort_handle(),
            exit,
        });
        let parts = AttachmentParts::new(
            fence,
            request.workspace.to_string_lossy(),
            broker_output,
            broker_input,
            control,
        );
        Ok(Attachment::new(parts))
    }
}

/// A worker: one Tokio task running the test agent.
#[derive(Debug)]
struct FakeWorker {
    worker_id: String,
    generation: Generation,
    task: AbortHandle,
    exit: ExitCell,
}

impl FakeWorker {
    async fn abort(&self, signal: i32) -> WorkerExit {
        if self.exit.get().is_none() {
            self.task.abort();
            self.exit.set(WorkerExit::Signal(signal));
        }
        self.exit.wait().await
    }
}

#[async_trait]
impl WorkerControl for FakeWorker {
    fn worker_id(&self) -> &str {
        &self.worker_id
    }

    fn generation(&self) -> Generation {
        self.generation
    }

    fn is_alive(&self) -> bool {
        self.exit.get().is_none()
    }

    async fn terminate(&self, grace: Duration) -> Result<WorkerExit> {
        // An in-process agent has no signal handler: give it the grace to finish on its own.
        if tokio::time::timeout(grace, self.exit.wait()).await.is_ok() {
            return Ok(self.exit.wait().await);
        }
        Ok(self.abort(15).await)
    }

    async fn kill(&self) -> Result<WorkerExit> {
        Ok(self.abort(9).await)
    }

    async fn wait(&self) -> Result<WorkerExit> {
        Ok(self.exit.wait().await)
    }
}
