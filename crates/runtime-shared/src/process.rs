//! [`AgentProcess`]: one agent child process and its process group, as a
//! [`WorkerControl`].
//!
//! Signals go to the whole group, as upstream's `kill(-pgid, ...)` does, so that what the agent
//! started (a shell, a language server) stops with it. This is the only platform-specific code of
//! the crate: unix (Linux, macOS) signals the group; Windows, which has no SIGTERM, terminates
//! the agent process at once.

use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use session_runtime::{ExitCell, Generation, Result, WorkerControl, WorkerExit};
use tokio::process::Child;
use tokio::sync::mpsc;

/// A running (or ended) agent process.
#[derive(Debug)]
pub(crate) struct AgentProcess {
    worker_id: String,
    generation: Generation,
    /// The child's pid, which is also its process group id (it was started as a group leader).
    #[cfg_attr(not(unix), allow(dead_code))]
    group: Option<u32>,
    exit: ExitCell,
    /// Asks the task that owns the `Child` to kill it (the direct child only).
    kill_child: mpsc::UnboundedSender<()>,
    /// Whether the group got its final SIGKILL: sent once, so that a group id the system has
    /// reused long after is never signalled by a repeated stop.
    group_killed: AtomicBool,
}

impl AgentProcess {
    /// Takes over `child`: a task waits for it, and kills it when asked.
    pub(crate) fn watch(mut child: Child, generation: Generation) -> Self {
        let group = child.id();
        let worker_id = group.map_or_else(|| "pid unknown".to_owned(), |pid| format!("pid {pid}"));
        let exit = ExitCell::new();
        let (kill_child, mut kill_requests) = mpsc::unbounded_channel::<()>();
        let recorded = exit.clone();
        tokio::spawn(async move {
            let status = loop {
                tokio::select! {
                    status = child.wait() => break status,
                    Some(()) = kill_requests.recv() => {
                        let _ = child.start_kill();
                    }
                }
            };
            recorded.set(status.map_or(WorkerExit::Unknown, exit_of));
        });
        Self {
            worker_id,
            generation,
            group,
            exit,
            kill_child,
            group_killed: AtomicBool::new(false),
        }
    }

    /// Sends SIGTERM to the group (unix); elsewhere terminates the agent at once.
    fn ask_to_stop(&self) {
        #[cfg(unix)]
        signal_group(self.group, rustix::process::Signal::TERM);
        #[cfg(not(unix))]
        let _ = self.kill_child.send(());
    }

    /// Kills the whole group (unix) or the agent (elsewhere), once.
    fn kill_now(&self) {
        let _ = self.kill_child.send(());
        if self.group_killed.swap(true, Ordering::AcqRel) {
            return;
        }
        #[cfg(unix)]
        signal_group(self.group, rustix::process::Signal::KILL);
    }

    /// What the runtime's `Drop` does, without a Tokio runtime: SIGTERM now, SIGKILL to the group
    /// after `grace` from a plain thread (which survives the Tokio runtime shutting down), as
    /// upstream's `Drop` of a connection does.
    pub(crate) fn stop_detached(&self, grace: Duration) {
        if !self.is_alive() {
            return;
        }
        self.ask_to_stop();
        #[cfg(unix)]
        if !self.group_killed.swap(true, Ordering::AcqRel) {
            let group = self.group;
            std::thread::spawn(move || {
                std::thread::sleep(grace);
                signal_group(group, rustix::process::Signal::KILL);
            });
        }
        #[cfg(not(unix))]
        let _ = grace;
    }
}

/// Signals process group `group`; a group that is gone already is not an error.
#[cfg(unix)]
fn signal_group(group: Option<u32>, signal: rustix::process::Signal) {
    let Some(pid) = group
        .and_then(|pid| i32::try_from(pid).ok())
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    let _ = rustix::process::kill_process_group(pid, signal);
}

/// How a child ended, as the contract reports it.
fn exit_of(status: ExitStatus) -> WorkerExit {
    if let Some(code) = status.code() {
        return WorkerExit::Code(code);
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return WorkerExit::Signal(signal);
        }
    }
    WorkerExit::Unknown
}

#[async_trait]
impl WorkerControl for AgentProcess {
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
        if self.is_alive() {
            self.ask_to_stop();
            let _ = tokio::time::timeout(grace, self.exit.wait()).await;
        }
        // Always, like upstream's SIGKILL after the grace: the agent may have exited on SIGTERM
        // and left children in its group.
        self.kill_now();
        Ok(self.exit.wait().await)
    }

    async fn kill(&self) -> Result<WorkerExit> {
        self.kill_now();
        Ok(self.exit.wait().await)
    }

    async fn wait(&self) -> Result<WorkerExit> {
        Ok(self.exit.wait().await)
    }
}
