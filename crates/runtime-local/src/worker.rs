//! A running agent process: spawning it with upstream OpenAB's process handling, and its
//! [`WorkerControl`].

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use rustix::process::Signal;
use session_runtime::config::AgentStderr;
use session_runtime::{
    Error, ExitCell, Generation, Result, SessionId, WorkerControl, WorkerExit, WorkerFailure,
};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, BufReader};
use tokio::process::{ChildStdin, ChildStdout, Command};

use crate::process::{self, ProcessRef};
use crate::sandbox::LimitsHandle;

/// Seconds since the epoch of the last byte through an attachment, shared with the runtime for
/// idle detection.
#[derive(Debug, Clone, Default)]
pub(crate) struct Activity(Arc<AtomicU64>);

impl Activity {
    pub(crate) fn touch(&self) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        self.0.store(now, Ordering::Relaxed);
    }

    pub(crate) fn last(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(self.0.load(Ordering::Relaxed))
    }
}

/// A started worker process and its pipes.
#[derive(Debug)]
pub(crate) struct Spawned {
    pub(crate) worker: Arc<LocalWorker>,
    pub(crate) stdout: ChildStdout,
    pub(crate) stdin: ChildStdin,
}

/// Spawns `command` (already carrying its program, arguments, environment and working directory)
/// as the leader of a new process group, with stderr logged at `stderr`'s level (or not read at
/// all: `/dev/null`) and the child reaped by a task.
///
/// `cgroups` are the worker's: a worker killed by SIGKILL while they record an OOM kill ended
/// [`WorkerExit::OutOfMemory`], not by a plain signal. With `born_in_cgroups` it is spawned
/// inside them ([`LimitsHandle::spawn_inside`]).
///
/// `sandbox` names the sandbox it runs in (`None` for plain mode): an agent that fails there soon
/// after it started ([`EARLY_EXIT`]) is logged at WARN with a hint that `agent.needs` may be
/// missing what it tried to load (which paths it tried is not known to the runtime).
///
/// # Errors
///
/// [`Error::WorkerFailed`] if it could not be spawned; the error of
/// [`LimitsHandle::spawn_inside`] if the cgroups could not be entered.
pub(crate) fn spawn(
    mut command: Command,
    id: SessionId,
    generation: Generation,
    stderr: AgentStderr,
    cgroups: Option<LimitsHandle>,
    born_in_cgroups: bool,
    sandbox: Option<&'static str>,
) -> Result<Spawned> {
    let failed = |why: String| Error::WorkerFailed {
        id,
        cause: WorkerFailure::Spawn(why),
    };
    let level = stderr.level();
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(if level.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .process_group(0);
    // The runtime, not the drop of a handle, decides when a worker ends.
    command.kill_on_drop(false);
    keep_inherited_descriptors_from_workers();
    let spawned = match cgroups.as_ref().filter(|_| born_in_cgroups) {
        Some(cgroups) => cgroups.spawn_inside(&mut command)?,
        None => command.spawn(),
    };
    let mut child = spawned.map_err(|e| failed(e.to_string()))?;
    let pid = child
        .id()
        .ok_or_else(|| failed("the agent exited at once".into()))?;
    let process = ProcessRef::of(pid).unwrap_or(ProcessRef { pid, start_time: 0 });
    let (Some(stdout), Some(stdin)) = (child.stdout.take(), child.stdin.take()) else {
        return Err(failed("the agent's pipes were not created".into()));
    };
    match (level, child.stderr.take()) {
        (Some(level), Some(stderr)) => {
            tokio::spawn(log_stderr(stderr, id, generation, level));
        }
        (Some(_), None) => return Err(failed("the agent's stderr pipe was not created".into())),
        (None, _) => {}
    }
    let exit = ExitCell::new();
    let members = cgroups.clone();
    let started = std::time::Instant::now();
    {
        let exit = exit.clone();
        tokio::spawn(async move {
            let status = child.wait().await;
            let after = started.elapsed();
            let ended = match status {
                Ok(status) => match (status.code(), status.signal()) {
                    (Some(code), _) => WorkerExit::Code(code),
                    (None, Some(signal)) => WorkerExit::Signal(signal),
                    (None, None) => WorkerExit::Unknown,
                },
                Err(_) => WorkerExit::Unknown,
            };
            if let Some(sandbox) = sandbox {
                warn_if_failed_at_start(&id, generation, sandbox, ended, after);
            }
            exit.set(classify_oom(ended, cgroups.as_ref()));
        });
    }
    let worker = Arc::new(LocalWorker {
        worker_id: format!("pid:{}@{}/g{generation}", process.pid, process.start_time),
        generation,
        process,
        exit,
        cgroups: members,
    });
    Ok(Spawned {
        worker,
        stdout,
        stdin,
    })
}

/// How soon after it started a sandboxed agent's failure counts as a failure to start.
const EARLY_EXIT: Duration = Duration::from_secs(10);

/// Warns, with a hint about `agent.needs`, when a sandboxed agent exited with a failure code
/// (1 to 127: not a signal, which a sandbox reports as `128 + n`) within [`EARLY_EXIT`] of its
/// start: the usual cause is a file it loads from a host directory the sandbox does not show.
fn warn_if_failed_at_start(
    id: &SessionId,
    generation: Generation,
    sandbox: &str,
    ended: WorkerExit,
    after: Duration,
) {
    let WorkerExit::Code(code @ 1..=127) = ended else {
        return;
    };
    if after > EARLY_EXIT {
        return;
    }
    tracing::warn!(
        session = %id,
        generation,
        "the agent exited with code {code} {:.1}s after it started in its {sandbox} sandbox; if its \
         stderr says it could not find or open a file (ENOENT, EACCES, ERR_MODULE_NOT_FOUND, \
         ModuleNotFoundError), `agent.needs` may be missing the host directory that holds it: a \
         sandboxed agent is shown only the system directories, its session's storage, \
         `agent.needs`, and its program's own files (its file and directory, its `#!` \
         interpreter, the virtual environment or node_modules it is installed in, files named in \
         `agent.args`); which paths it tried to open is not recorded",
        after.as_secs_f64()
    );
}

/// `exit`, or [`WorkerExit::OutOfMemory`] if it is a SIGKILL (directly, or as `128 + 9` from
/// bubblewrap or the Landlock helper, which report their child's signal as an exit code) and the
/// kernel's OOM killer struck in the worker's cgroups.
fn classify_oom(exit: WorkerExit, cgroups: Option<&LimitsHandle>) -> WorkerExit {
    const SIGKILL: i32 = 9;
    let killed = matches!(exit, WorkerExit::Signal(SIGKILL) | WorkerExit::Code(137));
    if killed && cgroups.is_some_and(LimitsHandle::saw_oom_kill) {
        WorkerExit::OutOfMemory
    } else {
        exit
    }
}

/// Marks every descriptor of this process above stderr close-on-exec, so no worker inherits one.
///
/// Everything Rust's standard library and tokio open is close-on-exec already; what is not is
/// what the broker inherited (systemd's socket-activation sockets, a supervisor's pipes) or what
/// C code opened. Neither bubblewrap nor an exec closes those, so without this a sandboxed agent
/// would hold them. Setting the flag in the broker (one `close_range` call on Linux 5.11 and
/// later) rather than between `fork` and `exec` keeps `unsafe` code out of this crate; the broker
/// itself goes on using those descriptors unchanged.
fn keep_inherited_descriptors_from_workers() {
    close_fds::set_fds_cloexec_threadsafe(3, &[]);
}

/// Logs each non-empty stderr line of a worker at `level`, control characters removed.
async fn log_stderr(
    stderr: impl AsyncRead + Unpin,
    id: SessionId,
    generation: Generation,
    level: tracing::Level,
) {
    let mut lines = BufReader::new(stderr).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let line: String = line.chars().filter(|c| !c.is_control()).collect();
        if line.trim().is_empty() {
            continue;
        }
        match level {
            tracing::Level::ERROR => tracing::error!(session = %id, generation, "agent stderr: {line}"),
            tracing::Level::WARN => tracing::warn!(session = %id, generation, "agent stderr: {line}"),
            tracing::Level::INFO => tracing::info!(session = %id, generation, "agent stderr: {line}"),
            tracing::Level::DEBUG => tracing::debug!(session = %id, generation, "agent stderr: {line}"),
            tracing::Level::TRACE => tracing::trace!(session = %id, generation, "agent stderr: {line}"),
        }
    }
}

/// The control handle of a local worker.
#[derive(Debug)]
pub(crate) struct LocalWorker {
    worker_id: String,
    generation: Generation,
    pub(crate) process: ProcessRef,
    exit: ExitCell,
    /// The cgroups it runs in, which hold every process of its tree.
    cgroups: Option<LimitsHandle>,
}

impl LocalWorker {
    async fn stop(&self, grace: Duration) -> WorkerExit {
        if let Some(exit) = self.exit.get() {
            // The leader is gone; members of its tree may not be.
            self.signal(Signal::KILL);
            return exit;
        }
        if !grace.is_zero() {
            self.signal(Signal::TERM);
            if let Ok(exit) = tokio::time::timeout(grace, self.exit.wait()).await {
                self.signal(Signal::KILL);
                return exit;
            }
        }
        self.signal(Signal::KILL);
        self.exit.wait().await
    }

    /// Sends `signal` to the worker's process group and to every other process of its tree:
    /// found as the members of its cgroups where it has them (one file to read), else by walking
    /// its descendants in `/proc`.
    fn signal(&self, signal: Signal) {
        match &self.cgroups {
            Some(cgroups) => {
                process::signal_group(self.process, signal);
                cgroups.signal_members(signal);
            }
            None => {
                let _ = process::signal_tree(self.process, signal);
            }
        }
    }
}

#[async_trait]
impl WorkerControl for LocalWorker {
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
        Ok(self.stop(grace).await)
    }

    async fn kill(&self) -> Result<WorkerExit> {
        Ok(self.stop(Duration::ZERO).await)
    }

    async fn wait(&self) -> Result<WorkerExit> {
        Ok(self.exit.wait().await)
    }
}

/// An agent stdout that records activity.
#[derive(Debug)]
pub(crate) struct Watched<T> {
    pub(crate) inner: T,
    pub(crate) activity: Activity,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let result = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if result.is_ready() {
            self.activity.touch();
        }
        result
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let result = std::pin::Pin::new(&mut self.inner).poll_write(cx, buf);
        if result.is_ready() {
            self.activity.touch();
        }
        result
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
