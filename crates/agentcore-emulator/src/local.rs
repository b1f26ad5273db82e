//! [`LocalLauncher`]: the default launcher. Each runtime session gets one session of the local
//! backend (`runtime-local`), sandboxed with bubblewrap or Landlock when the host has one, whose
//! workspace is the session storage and the worker's working directory.
//!
//! | emulated | local backend |
//! |---|---|
//! | first request for a session id | `create` (idempotent) + `attach`: a new worker generation |
//! | stop, idle timeout, lifetime end | `suspend` (storage kept) |
//! | storage expiry, runtime version change | `close(Reset)` (storage deleted) |
//!
//! The worker command runs with `network = host`, so the relay's loopback port is reachable
//! from the emulator, and with its own environment cleared as the local backend clears it (only
//! what [`WorkerCommand::env`] sets and `OAB_RELAY_LOG`, if set, pass).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use runtime_local::LocalRuntime;
use session_runtime::config::{NetworkMode, ReadonlyMount, SandboxMode};
use session_runtime::{
    AgentCommand, AgentInput, CloseReason, CreateOptions, Error as RuntimeError, IsolationLevel, SessionId,
    SessionIdentity, SessionRuntime, SuspendReason, WorkerControl,
};
use sha2::{Digest, Sha256};
use tokio::io::BufReader;

use crate::error::{EmulatorError, WorkerError};
use crate::storage::{SessionPaths, StorageEnforcement, StorageLimits, StorageMounts};
use crate::worker::{read_announcement, RunningWorker, SandboxReport, SessionKey, WorkerLauncher};

/// The installation name of the local sessions the launcher creates.
const INSTALLATION: &str = "agentcore-emulator";
/// The platform part of their identities.
const PLATFORM: &str = "agentcore";
/// Host directories the sandbox shows anyway (the local backend's system paths): programs
/// there need no read-only input of their own.
const SYSTEM_PATHS: [&str; 8] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
];

/// The command a worker runs: a program (looked up as a path), its arguments and environment,
/// and host files it needs to read inside the sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerCommand {
    program: PathBuf,
    args: Vec<String>,
    env: BTreeMap<String, String>,
    inputs: Vec<PathBuf>,
}

impl WorkerCommand {
    /// A command running `program` with no arguments.
    pub fn new(program: impl Into<PathBuf>) -> Self {
        Self {
            program: program.into(),
            args: Vec::new(),
            env: BTreeMap::new(),
            inputs: Vec::new(),
        }
    }

    /// The default worker: `<relay> serve --http 127.0.0.1:0 --agentcore -- <agent argv>`.
    ///
    /// The agent's program (`agent_argv[0]`), when it is an absolute path outside the system
    /// directories, is added as a read-only input so a sandboxed relay can start it.
    pub fn relay<I, S>(relay: impl Into<PathBuf>, agent_argv: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let agent: Vec<String> = agent_argv.into_iter().map(Into::into).collect();
        let mut command = Self::new(relay).args(["serve", "--http", "127.0.0.1:0", "--agentcore", "--"]);
        if let Some(program) = agent.first() {
            command = command.input(program);
        }
        command.args(agent)
    }

    /// Appends arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets an environment variable of the worker.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// A host file or directory the worker reads (bound read-only at the same path in a
    /// sandbox). Relative paths and paths in the system directories are ignored: the sandbox
    /// cannot bind the former and shows the latter anyway.
    pub fn input(mut self, path: impl AsRef<Path>) -> Self {
        let path = path.as_ref();
        let shown_anyway = SYSTEM_PATHS.iter().any(|system| path.starts_with(system));
        if path.is_absolute() && !shown_anyway && !self.inputs.iter().any(|known| known == path) {
            self.inputs.push(path.to_path_buf());
        }
        self
    }

    /// The program.
    pub fn program(&self) -> &Path {
        &self.program
    }

    /// The arguments.
    pub fn arguments(&self) -> &[String] {
        &self.args
    }
}

/// Builds a [`LocalLauncher`].
#[derive(Debug, Clone)]
pub struct LocalLauncherBuilder {
    command: WorkerCommand,
    root: Option<PathBuf>,
    sandbox: SandboxMode,
    fall_back_to_none: bool,
    start_timeout: Duration,
    terminate_grace: Duration,
    storage: StorageLimits,
    rules_helper: Option<PathBuf>,
}

/// The name of the program that puts the storage rules' seccomp filters in front of a worker.
pub const STORAGE_RULES_HELPER: &str = "oab-storage-rules";

impl LocalLauncherBuilder {
    /// Session storage limits (default [`StorageLimits::default`]: AgentCore's reported 1 GB
    /// cap, refusals and start-up absence). See [`crate::storage_rules`] and the crate docs for
    /// how each is enforced.
    pub fn storage_limits(mut self, limits: StorageLimits) -> Self {
        self.storage = limits;
        self
    }

    /// The `oab-storage-rules` binary that enforces the refusals (default: the one next to this
    /// process's executable or in its parent directory, as cargo lays out binaries and tests).
    pub fn storage_rules_helper(mut self, helper: impl Into<PathBuf>) -> Self {
        self.rules_helper = Some(helper.into());
        self
    }

    /// Where session storage lives (the local backend's root; must be private to this user).
    /// Default: a fresh directory under the system's temporary directory, removed when the
    /// launcher is dropped.
    pub fn root(mut self, root: impl Into<PathBuf>) -> Self {
        self.root = Some(root.into());
        self
    }

    /// The sandbox mode (default `auto`: bubblewrap, else Landlock, else none, see
    /// [`require_sandbox`](Self::require_sandbox)).
    pub fn sandbox(mut self, mode: SandboxMode) -> Self {
        self.sandbox = mode;
        self
    }

    /// Refuse to build when the chosen mode finds no working sandbox (default: fall back to
    /// plain processes, which [`WorkerLauncher::sandbox`] then reports as isolation `none`).
    pub fn require_sandbox(mut self, required: bool) -> Self {
        self.fall_back_to_none = !required;
        self
    }

    /// How long a worker may take to announce its port (default 30 s).
    pub fn start_timeout(mut self, patience: Duration) -> Self {
        self.start_timeout = patience;
        self
    }

    /// How long a stopped worker gets between SIGTERM and SIGKILL (default 1 s: stopping a
    /// microVM does not wait for the agent either).
    pub fn terminate_grace(mut self, grace: Duration) -> Self {
        self.terminate_grace = grace;
        self
    }

    /// Builds the local runtime under it.
    ///
    /// # Errors
    /// [`EmulatorError::InvalidConfig`] for a root or sandbox the local backend refuses (its
    /// reason included), or an input path it cannot bind.
    pub fn build(self) -> Result<LocalLauncher, EmulatorError> {
        let (root, owned_root) = match &self.root {
            Some(root) => (root.clone(), false),
            None => (fresh_root().map_err(EmulatorError::Bind)?, true),
        };
        let helper = if self.storage.refuse_special_files {
            let helper = self.rules_helper.clone().or_else(default_rules_helper);
            if helper.is_none() {
                tracing::warn!(
                    "no {STORAGE_RULES_HELPER} found: session storage refusals (hard links, FIFOs, UNIX \
                     sockets, xattrs, fallocate) are not enforced"
                );
            }
            helper
        } else {
            None
        };
        let mut command = self.command.clone();
        let mut agent = match &helper {
            Some(helper) => {
                // The local backend shows the program it starts (the helper); the worker's own
                // program is now an argument, so it is shown as an input.
                command = command.input(&self.command.program);
                // Outside a mount namespace the worker also reaches the storage at its host
                // mount point, beside its working directory.
                AgentCommand::new(helper.display().to_string())
                    .args([format!("--storage-alias=../{}", crate::storage::VOLUME_DIR)])
                    .args([self.command.program.display().to_string()])
            }
            None => AgentCommand::new(self.command.program.display().to_string()),
        };
        agent = agent
            .args(self.command.args.iter().cloned())
            .inherit_env("OAB_RELAY_LOG");
        for (key, value) in &self.command.env {
            agent = agent.env(key, value);
        }
        let inputs = command
            .inputs
            .iter()
            .map(|path| ReadonlyMount::new(path, path))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid("worker_command.input", e))?;
        let build = |mode: SandboxMode| {
            LocalRuntime::builder(agent.clone())
                .root(&root)
                .installation(INSTALLATION)
                .sandbox(mode)
                .network(NetworkMode::Host)
                .readonly(inputs.clone())
                .terminate_grace(self.terminate_grace)
                .build()
        };
        let runtime = match build(self.sandbox) {
            Ok(runtime) => runtime,
            Err(error) if self.fall_back_to_none && self.sandbox != SandboxMode::None => {
                tracing::warn!(%error, "no working sandbox: emulated sessions run as plain processes");
                build(SandboxMode::None).map_err(|e| invalid("sandbox", e))?
            }
            Err(error) => return Err(invalid("sandbox", error)),
        };
        let isolation = runtime.capabilities().isolation;
        let mechanism = match isolation {
            IsolationLevel::Namespaces => "bubblewrap",
            IsolationLevel::AccessControl => "landlock",
            _ => "none",
        };
        Ok(LocalLauncher {
            runtime: Arc::new(runtime),
            root,
            owned_root,
            report: SandboxReport {
                isolation,
                mechanism: mechanism.into(),
            },
            start_timeout: self.start_timeout,
            storage: Arc::new(StorageMounts::new(
                self.storage,
                helper.is_some(),
                isolation != IsolationLevel::AccessControl,
            )),
        })
    }
}

/// `oab-storage-rules` next to this process's executable, or one directory up (a test binary in
/// `target/<profile>/deps` finds the one in `target/<profile>`).
fn default_rules_helper() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    let found = [Some(dir), dir.parent()]
        .into_iter()
        .flatten()
        .map(|dir| dir.join(STORAGE_RULES_HELPER))
        .find(|candidate| candidate.is_file());
    found
}

fn invalid(key: &'static str, error: RuntimeError) -> EmulatorError {
    EmulatorError::InvalidConfig {
        key,
        reason: error.to_string(),
    }
}

/// A private directory under the system's temporary directory.
fn fresh_root() -> std::io::Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!(
        "agentcore-emulator-{}-{}-{nanos}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    );
    let root = std::env::temp_dir().join(name);
    std::fs::DirBuilder::new().mode(0o700).create(&root)?;
    Ok(root)
}

/// Runs each emulated session's worker as a session of the local backend.
#[derive(Debug)]
pub struct LocalLauncher {
    runtime: Arc<LocalRuntime>,
    root: PathBuf,
    owned_root: bool,
    report: SandboxReport,
    start_timeout: Duration,
    storage: Arc<StorageMounts>,
}

impl LocalLauncher {
    /// A builder for workers running `command`.
    pub fn builder(command: WorkerCommand) -> LocalLauncherBuilder {
        LocalLauncherBuilder {
            command,
            root: None,
            sandbox: SandboxMode::Auto,
            fall_back_to_none: true,
            start_timeout: Duration::from_secs(30),
            terminate_grace: Duration::from_secs(1),
            storage: StorageLimits::default(),
            rules_helper: None,
        }
    }

    /// Which storage limits hold on this host.
    pub fn storage_enforcement(&self) -> StorageEnforcement {
        self.storage.enforced()
    }

    /// The host paths of `id`'s storage, once the local session exists.
    async fn paths(&self, id: &SessionId) -> Option<SessionPaths> {
        let status = self.runtime.status(id).await.ok()?;
        // The local backend's layout: `root/<id>/workspace` is the agent's working directory.
        let base = PathBuf::from(status.storage_refs.first()?);
        Some(SessionPaths {
            workspace: base.join("workspace"),
            base,
        })
    }

    /// The local backend's root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The local session that stands for `key` (a hash of the runtime ARN names the agent part,
    /// the runtime session id is the thread).
    fn identity(key: &SessionKey) -> Result<SessionIdentity, WorkerError> {
        let digest = Sha256::digest(key.runtime().to_string().as_bytes());
        let label: String = digest.iter().take(8).map(|b| format!("{b:02x}")).collect();
        SessionIdentity::new(INSTALLATION, format!("rt-{label}"), PLATFORM, key.session_id()).map_err(|e| {
            WorkerError::Start(format!("the runtime session id cannot name a local session: {e}"))
        })
    }
}

impl Drop for LocalLauncher {
    fn drop(&mut self) {
        self.storage.release_all();
        if self.owned_root {
            // Best effort: the directory was made by this launcher and holds only its sessions.
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }
}

#[async_trait]
impl WorkerLauncher for LocalLauncher {
    fn sandbox(&self) -> SandboxReport {
        self.report.clone()
    }

    async fn start(&self, key: &SessionKey) -> Result<Box<dyn RunningWorker>, WorkerError> {
        let identity = Self::identity(key)?;
        let id = identity.id();
        self.runtime
            .create(&identity, &CreateOptions::new())
            .await
            .map_err(|e| WorkerError::Start(e.to_string()))?;
        let paths = self
            .paths(&id)
            .await
            .ok_or_else(|| WorkerError::Start("the local session has no storage".into()))?;
        if let Err(error) = self.storage.before_start(&paths).await {
            let _ = self.storage.after_stop(&paths).await;
            return Err(error);
        }
        let attachment = match self.runtime.attach(&id).await {
            Ok(attachment) => attachment,
            Err(error) => {
                let _ = self.storage.after_stop(&paths).await;
                return Err(WorkerError::Start(error.to_string()));
            }
        };
        let (output, input, control) = attachment.into_split();
        let mut output = BufReader::new(output);
        let announced = match read_announcement(&mut output, self.start_timeout).await {
            Ok(addr) => self.storage.after_announce(&paths).await.map(|()| addr),
            Err(error) => Err(error),
        };
        let addr = match announced {
            Ok(addr) => addr,
            Err(error) => {
                // Do not leave a worker that never announced (or never got its storage) running.
                let _ = self.runtime.suspend(&id, SuspendReason::Hung).await;
                let _ = self.storage.after_stop(&paths).await;
                return Err(error);
            }
        };
        // The worker's stdout must keep draining, or a chatty worker would block on a full pipe.
        let drain = tokio::spawn(async move {
            let _ = tokio::io::copy(&mut output, &mut tokio::io::sink()).await;
        });
        tracing::debug!(session = %id, %addr, sandbox = %self.report, "emulated session worker started");
        Ok(Box::new(LocalWorker {
            runtime: Arc::clone(&self.runtime),
            storage: Arc::clone(&self.storage),
            paths,
            id,
            addr,
            _input: input,
            _control: control,
            drain,
        }))
    }

    async fn storage_path(&self, key: &SessionKey) -> Option<PathBuf> {
        let paths = self.paths(&Self::identity(key).ok()?.id()).await?;
        let storage = if self.storage.separate() {
            paths.volume()
        } else {
            paths.workspace
        };
        storage.is_dir().then_some(storage)
    }

    async fn reset_storage(&self, key: &SessionKey) -> Result<(), WorkerError> {
        let id = Self::identity(key)?.id();
        if let Some(paths) = self.paths(&id).await {
            self.storage.release(&paths).await?;
        }
        match self.runtime.close(&id, CloseReason::Reset).await {
            Ok(()) | Err(RuntimeError::NotFound { .. }) => Ok(()),
            Err(error) => Err(WorkerError::Stop(error.to_string())),
        }
    }

    fn release(&self) {
        self.storage.release_all();
    }
}

/// A worker that is a local session's current generation.
#[derive(Debug)]
struct LocalWorker {
    runtime: Arc<LocalRuntime>,
    storage: Arc<StorageMounts>,
    paths: SessionPaths,
    id: SessionId,
    addr: SocketAddr,
    /// Held so the worker's stdin stays open for as long as it runs.
    _input: AgentInput,
    _control: Arc<dyn WorkerControl>,
    drain: tokio::task::JoinHandle<()>,
}

#[async_trait]
impl RunningWorker for LocalWorker {
    fn address(&self) -> SocketAddr {
        self.addr
    }

    async fn stop(self: Box<Self>) -> Result<(), WorkerError> {
        let stopped = self.runtime.suspend(&self.id, SuspendReason::Idle).await;
        self.drain.abort();
        // The storage goes with the microVM, once its processes are gone.
        let unmounted = self.storage.after_stop(&self.paths).await;
        stopped.map_err(|e| WorkerError::Stop(e.to_string()))?;
        unmounted
    }
}
