//! [`SharedRuntime`]: sessions whose agents run the way upstream OpenAB runs them.

use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use parking_lot::Mutex;
use session_runtime::config::{AgentStderr, LocalConfig, SessionRuntimeConfig, StorageMode};
use session_runtime::{
    AgentCommand, Attachment, AttachmentParts, Capabilities, CloseReason, CreateOptions, Error, Fence,
    FenceTrigger, ReconcileReport, Result, SessionHandle, SessionId, SessionIdentity, SessionOverlay,
    SessionRuntime, SessionState, SessionStatus, SuspendReason, WorkerControl, WorkerFailure, WorkerInfo,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, BufReader, ReadBuf};

use crate::overlay_dir;
use crate::process::AgentProcess;
use crate::spawn;
use crate::RUNTIME;

/// Builds a [`SharedRuntime`].
///
/// ```
/// use runtime_shared::SharedRuntime;
/// use session_runtime::{AgentCommand, IsolationLevel, SessionRuntime};
///
/// let runtime = SharedRuntime::builder(AgentCommand::new("claude-agent-acp").working_dir("/tmp"))
///     .installation("prod-bot")
///     .build()?;
/// assert_eq!(runtime.capabilities().isolation, IsolationLevel::None);
/// # Ok::<(), session_runtime::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct SharedRuntimeBuilder {
    agent: AgentCommand,
    installation: String,
    storage: StorageMode,
    idle_ttl: Option<Duration>,
    terminate_grace: Duration,
    stderr: AgentStderr,
    working_dirs: Vec<PathBuf>,
}

impl SharedRuntimeBuilder {
    /// A builder from a parsed `[session_runtime]` section: `installation`, `idle_ttl`,
    /// `local.terminate_grace` and `local.agent_stderr` (unset: never, 1.5 s and discarded, as
    /// upstream v0.8.x). The section must select `local.storage = "shared"`, which `build` checks.
    pub fn from_config(config: &SessionRuntimeConfig, agent: AgentCommand) -> Self {
        Self {
            agent,
            installation: config.installation.clone(),
            storage: config.local.storage,
            idle_ttl: config.effective_idle_ttl(),
            terminate_grace: config.local.effective_terminate_grace(),
            stderr: config.local.effective_agent_stderr(),
            working_dirs: config.local.working_dirs.clone(),
        }
    }

    /// Allows session overlays to work in `dir` and beneath it (the configuration key
    /// `session_runtime.local.working_dirs`). With none allowed, `[agent].working_dir` is.
    pub fn allow_working_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.working_dirs.push(dir.into());
        self
    }

    /// The installation whose sessions this runtime serves.
    pub fn installation(mut self, installation: impl Into<String>) -> Self {
        self.installation = installation.into();
        self
    }

    /// How long a worker's stream may be idle before `reconcile` suspends it (`None`: never,
    /// the default; upstream leaves idleness to the broker's pool).
    pub fn idle_ttl(mut self, idle_ttl: Option<Duration>) -> Self {
        self.idle_ttl = idle_ttl;
        self
    }

    /// How long an agent gets between SIGTERM and SIGKILL (default 1.5 s, upstream's); at most
    /// [`LocalConfig::MAX_TERMINATE_GRACE`].
    pub fn terminate_grace(mut self, grace: Duration) -> Self {
        self.terminate_grace = grace;
        self
    }

    /// What happens to the agent's stderr (default [`AgentStderr::Discard`], as upstream v0.8.x;
    /// the configuration key `session_runtime.local.agent_stderr`).
    pub fn agent_stderr(mut self, stderr: AgentStderr) -> Self {
        self.stderr = stderr;
        self
    }

    /// Checks the settings. Starts nothing and writes nothing.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the key: `session_runtime.local.storage` if the section
    /// selects per-session storage (that is `runtime-local`'s), `session_runtime.installation`,
    /// `agent.command` if empty, `agent.working_dir` if it is not a directory, a grace or TTL
    /// above its maximum, `session_runtime.local.working_dirs` for an entry that is not an
    /// existing directory.
    pub fn build(self) -> Result<SharedRuntime> {
        let invalid = |key: &str, reason: String| Error::InvalidConfig {
            key: key.into(),
            reason,
        };
        if self.storage != StorageMode::Shared {
            return Err(invalid(
                "session_runtime.local.storage",
                format!(
                    "this runtime keeps no storage of a session's own, but storage = \"{}\"",
                    self.storage
                ),
            ));
        }
        SessionIdentity::new(self.installation.as_str(), "probe", "probe", "probe")
            .map_err(|e| invalid("session_runtime.installation", e.to_string()))?;
        if self.agent.program.trim().is_empty() {
            return Err(invalid("agent.command", "the agent command is empty".into()));
        }
        if self.terminate_grace > LocalConfig::MAX_TERMINATE_GRACE {
            return Err(invalid(
                "session_runtime.local.terminate_grace",
                format!(
                    "{:?} is longer than the most allowed, {:?}",
                    self.terminate_grace,
                    LocalConfig::MAX_TERMINATE_GRACE
                ),
            ));
        }
        if let Some(ttl) = self
            .idle_ttl
            .filter(|ttl| *ttl > SessionRuntimeConfig::MAX_IDLE_TTL)
        {
            return Err(invalid(
                "session_runtime.idle_ttl",
                format!(
                    "{ttl:?} is longer than the most allowed, {:?}",
                    SessionRuntimeConfig::MAX_IDLE_TTL
                ),
            ));
        }
        let working_dir = self.agent.working_dir.clone().unwrap_or_else(std::env::temp_dir);
        if !working_dir.is_dir() {
            return Err(invalid(
                "agent.working_dir",
                format!("{} is not a directory", working_dir.display()),
            ));
        }
        let (allowed, key) = if self.working_dirs.is_empty() {
            (vec![working_dir.clone()], "agent.working_dir")
        } else {
            (self.working_dirs, "session_runtime.local.working_dirs")
        };
        let overlay_roots = allowed
            .iter()
            .map(|dir| overlay_dir::root(dir).map_err(|reason| invalid(key, reason)))
            .collect::<Result<Vec<_>>>()?;
        tracing::warn!(
            working_dir = %working_dir.display(),
            "the shared session runtime isolates nothing: every session's agent runs in this \
             directory with the broker's HOME, as upstream OpenAB runs it"
        );
        Ok(SharedRuntime {
            inner: Arc::new(Inner {
                agent: self.agent,
                working_dir,
                overlay_roots,
                idle_ttl: self.idle_ttl,
                terminate_grace: self.terminate_grace,
                stderr: self.stderr,
                sessions: Mutex::new(HashMap::new()),
                gates: Mutex::new(HashMap::new()),
            }),
        })
    }
}

/// The runtime of upstream OpenAB's behaviour (see the crate docs): it isolates nothing.
#[derive(Debug, Clone)]
pub struct SharedRuntime {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    agent: AgentCommand,
    working_dir: PathBuf,
    /// Where session overlays may work (canonical), with everything beneath.
    overlay_roots: Vec<PathBuf>,
    idle_ttl: Option<Duration>,
    terminate_grace: Duration,
    stderr: AgentStderr,
    sessions: Mutex<HashMap<SessionId, Session>>,
    /// One lock per session, held across a whole `attach`, `suspend` or `close`, so that the
    /// three never interleave for a session. Never removed: it is concurrency control.
    gates: Mutex<HashMap<SessionId, Arc<tokio::sync::Mutex<()>>>>,
}

/// A session's in-memory record.
#[derive(Debug)]
struct Session {
    status: SessionStatus,
    overlay: SessionOverlay,
    worker: Option<Running>,
}

/// The worker of a session's current generation.
#[derive(Debug)]
struct Running {
    process: Arc<AgentProcess>,
    fence: FenceTrigger,
    /// Milliseconds since the Unix epoch of the last byte in either direction.
    last_io: Arc<AtomicU64>,
}

impl SharedRuntime {
    /// A builder running `agent` in its working directory, with upstream's defaults.
    pub fn builder(agent: AgentCommand) -> SharedRuntimeBuilder {
        SharedRuntimeBuilder::from_config(&SessionRuntimeConfig::default(), agent)
    }

    /// The directory every session's agent runs in.
    pub fn working_dir(&self) -> &std::path::Path {
        &self.inner.working_dir
    }

    fn gate(&self, id: &SessionId) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(self.inner.gates.lock().entry(*id).or_default())
    }

    /// Fences and stops the session's worker, if any; `Hung` kills without grace.
    async fn stop(&self, id: &SessionId, hung: bool) {
        let running = self
            .inner
            .sessions
            .lock()
            .get_mut(id)
            .and_then(|s| s.worker.take());
        let Some(running) = running else { return };
        let generation = running.process.generation();
        running.fence.fence(generation + 1);
        let exit = if hung {
            running.process.kill().await
        } else {
            running.process.terminate(self.inner.terminate_grace).await
        };
        tracing::debug!(session = %id, generation, ?exit, "worker stopped");
    }

    /// An overlay as `create` keeps it: valid, with its working directory resolved to an allowed
    /// existing directory.
    fn checked_overlay(&self, overlay: &SessionOverlay) -> Result<SessionOverlay> {
        overlay.validate()?;
        let mut checked = overlay.clone();
        if let Some(dir) = &overlay.working_dir {
            checked.working_dir = Some(overlay_dir::allowed(dir, &self.inner.overlay_roots)?);
        }
        Ok(checked)
    }

    fn not_found(id: &SessionId) -> Error {
        Error::NotFound { id: *id }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // As upstream's Drop of a connection: nothing outlives the runtime that started it.
        for session in self.sessions.get_mut().values() {
            if let Some(running) = &session.worker {
                running.process.stop_detached(self.terminate_grace);
            }
        }
    }
}

fn now_millis() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

fn time_of(millis: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(millis)
}

#[async_trait]
impl SessionRuntime for SharedRuntime {
    fn name(&self) -> &'static str {
        RUNTIME
    }

    /// Isolation none, no storage of a session's own, nothing survives the broker; overlays are
    /// applied (a working directory among `local.working_dirs`).
    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal().with_overlay(true)
    }

    async fn create(&self, identity: &SessionIdentity, options: &CreateOptions) -> Result<SessionHandle> {
        let id = identity.id();
        let overlay = match &options.overlay {
            Some(overlay) => Some(self.checked_overlay(overlay)?),
            None => None,
        };
        let mut sessions = self.inner.sessions.lock();
        if let Some(existing) = sessions.get_mut(&id).filter(|s| !s.status.state.is_closed()) {
            if let Some(overlay) = overlay {
                // For the next worker; a running one keeps the overlay it was started with.
                existing.overlay = overlay;
            }
            return Ok(SessionHandle::new(
                id,
                existing.status.state,
                existing.status.generation,
                false,
            ));
        }
        if options.workspace_seed.is_some() {
            return Err(Error::Unsupported {
                operation: "a workspace seed (it needs local.storage = \"per-session\")",
                runtime: RUNTIME,
            });
        }
        // A closed session starts again; its generation keeps counting so old streams stay fenced.
        let generation = sessions.get(&id).map_or(0, |s| s.status.generation);
        let mut status = SessionStatus::new(id, SystemTime::now());
        status.generation = generation;
        status.storage_refs = vec![format!("shared:{}", self.inner.working_dir.display())];
        sessions.insert(
            id,
            Session {
                status,
                overlay: overlay.unwrap_or_default(),
                worker: None,
            },
        );
        Ok(SessionHandle::new(id, SessionState::Created, generation, true))
    }

    async fn attach(&self, id: &SessionId) -> Result<Attachment> {
        let gate = self.gate(id);
        let _held = gate.lock().await;
        {
            let sessions = self.inner.sessions.lock();
            let session = sessions.get(id).ok_or_else(|| Self::not_found(id))?;
            if !session.status.state.can_attach() {
                return Err(Error::InvalidState {
                    id: *id,
                    state: session.status.state,
                    operation: "attach",
                });
            }
        }
        // One worker per session: the previous one stops before the next starts.
        self.stop(id, false).await;
        let overlay = {
            let sessions = self.inner.sessions.lock();
            let session = sessions.get(id).ok_or_else(|| Self::not_found(id))?;
            session.overlay.clone()
        };
        // Checked again: the directory, or a link on its way, may have changed since create.
        let working_dir = match &overlay.working_dir {
            Some(dir) => overlay_dir::allowed(dir, &self.inner.overlay_roots)?,
            None => self.inner.working_dir.clone(),
        };
        let generation = {
            let mut sessions = self.inner.sessions.lock();
            let session = sessions.get_mut(id).ok_or_else(|| Self::not_found(id))?;
            session.status.generation += 1;
            session.status.generation
        };
        let agent = &self.inner.agent;
        let mut env = spawn::environment(agent, &working_dir, spawn::broker_env);
        env.extend(
            overlay
                .env
                .iter()
                .map(|(name, value)| (name.clone(), value.clone())),
        );
        let log_stderr = self.inner.stderr.level().is_some();
        let mut child = spawn::command(agent, &working_dir, &env, log_stderr)
            .spawn()
            .map_err(|e| Error::WorkerFailed {
                id: *id,
                cause: WorkerFailure::Spawn(format!("failed to spawn {}: {e}", agent.program)),
            })?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.start_kill();
            return Err(Error::Backend {
                runtime: RUNTIME,
                retryable: false,
                message: "the agent's stdin or stdout was not piped".into(),
                source: None,
            });
        };
        if let (Some(level), Some(stderr)) = (self.inner.stderr.level(), child.stderr.take()) {
            tokio::spawn(log_lines(*id, level, stderr));
        }
        let process = Arc::new(AgentProcess::watch(child, generation));
        let last_io = Arc::new(AtomicU64::new(now_millis()));
        let (fence, trigger) = Fence::new(*id, generation);
        let control: Arc<dyn WorkerControl> = Arc::clone(&process) as Arc<dyn WorkerControl>;
        {
            let mut sessions = self.inner.sessions.lock();
            let session = sessions.get_mut(id).ok_or_else(|| Self::not_found(id))?;
            session.status.state = SessionState::Running;
            session.status.suspend_reason = None;
            session.status.worker = Some(WorkerInfo::new(
                process.worker_id(),
                generation,
                SystemTime::now(),
            ));
            session.worker = Some(Running {
                process,
                fence: trigger,
                last_io: Arc::clone(&last_io),
            });
        }
        let working_dir = working_dir.to_string_lossy().into_owned();
        Ok(Attachment::new(AttachmentParts::new(
            fence,
            working_dir,
            Touching::new(stdout, Arc::clone(&last_io)),
            Touching::new(stdin, last_io),
            control,
        )))
    }

    async fn suspend(&self, id: &SessionId, reason: SuspendReason) -> Result<()> {
        let gate = self.gate(id);
        let _held = gate.lock().await;
        {
            let sessions = self.inner.sessions.lock();
            let session = sessions.get(id).ok_or_else(|| Self::not_found(id))?;
            if !session.status.state.can_suspend() && session.status.state != SessionState::Suspended {
                return Err(Error::InvalidState {
                    id: *id,
                    state: session.status.state,
                    operation: "suspend",
                });
            }
        }
        self.stop(id, reason == SuspendReason::Hung).await;
        let mut sessions = self.inner.sessions.lock();
        if let Some(session) = sessions.get_mut(id) {
            if session.status.state != SessionState::Suspended {
                session.status.state = SessionState::Suspended;
                session.status.suspend_reason = Some(reason);
            }
            session.status.worker = None;
        }
        Ok(())
    }

    async fn close(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let gate = self.gate(id);
        let _held = gate.lock().await;
        match self.inner.sessions.lock().get(id) {
            None => return Ok(()),
            Some(session) if session.status.state.is_closed() => return Ok(()),
            Some(_) => {}
        }
        self.stop(id, false).await;
        let mut sessions = self.inner.sessions.lock();
        if let Some(session) = sessions.get_mut(id) {
            session.status.state = SessionState::Closed;
            session.status.close_reason = Some(reason);
            session.status.worker = None;
        }
        Ok(())
    }

    async fn status(&self, id: &SessionId) -> Result<SessionStatus> {
        let sessions = self.inner.sessions.lock();
        let session = sessions.get(id).ok_or_else(|| Self::not_found(id))?;
        Ok(status_of(session))
    }

    async fn list(&self) -> Result<Vec<SessionStatus>> {
        Ok(self.inner.sessions.lock().values().map(status_of).collect())
    }

    async fn reconcile(&self) -> Result<ReconcileReport> {
        let mut report = ReconcileReport::default();
        let now = now_millis();
        let mut idle = Vec::new();
        {
            let mut sessions = self.inner.sessions.lock();
            for (id, session) in sessions.iter_mut() {
                let Some(running) = &session.worker else { continue };
                if !running.process.is_alive() {
                    // The agent ended on its own: the record says so, as upstream's pool would find
                    // a dead connection.
                    session.worker = None;
                    session.status.worker = None;
                    session.status.state = SessionState::Suspended;
                    continue;
                }
                let idle_for =
                    Duration::from_millis(now.saturating_sub(running.last_io.load(Ordering::Relaxed)));
                if self.inner.idle_ttl.is_some_and(|ttl| idle_for >= ttl) {
                    idle.push(*id);
                }
            }
        }
        for id in idle {
            match self.suspend(&id, SuspendReason::Idle).await {
                Ok(()) => report.suspended_idle.push(id),
                Err(error) => report.errors.push(format!("session {id}: {error}")),
            }
        }
        Ok(report)
    }
}

fn status_of(session: &Session) -> SessionStatus {
    let mut status = session.status.clone();
    if let Some(running) = &session.worker {
        status.last_activity = time_of(running.last_io.load(Ordering::Relaxed)).max(status.last_activity);
    }
    status
}

/// Logs each non-empty stderr line of a session's agent.
async fn log_lines(id: SessionId, level: tracing::Level, stderr: tokio::process::ChildStderr) {
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let line: String = line.chars().filter(|c| !c.is_control()).collect();
        if line.trim().is_empty() {
            continue;
        }
        match level {
            tracing::Level::ERROR => tracing::error!(session = %id, "agent stderr: {line}"),
            tracing::Level::WARN => tracing::warn!(session = %id, "agent stderr: {line}"),
            tracing::Level::INFO => tracing::info!(session = %id, "agent stderr: {line}"),
            tracing::Level::DEBUG => tracing::debug!(session = %id, "agent stderr: {line}"),
            tracing::Level::TRACE => tracing::trace!(session = %id, "agent stderr: {line}"),
        }
    }
}

/// A stream that records the time of its last byte, for `idle_ttl`.
#[derive(Debug)]
struct Touching<T> {
    inner: T,
    last_io: Arc<AtomicU64>,
}

impl<T> Touching<T> {
    fn new(inner: T, last_io: Arc<AtomicU64>) -> Self {
        Self { inner, last_io }
    }

    fn touch(&self) {
        self.last_io.store(now_millis(), Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Touching<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Touching<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(written)) if written > 0) {
            self.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
