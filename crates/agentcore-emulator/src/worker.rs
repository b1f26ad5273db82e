//! How session workers start: the [`WorkerLauncher`] trait (one worker per runtime session,
//! on the session's own storage), the [`RunningWorker`] it returns, and [`read_announcement`]
//! for workers that print `oab-relay: listening on http 127.0.0.1:PORT`.

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use session_runtime::IsolationLevel;
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

use crate::arn::RuntimeArn;
use crate::error::WorkerError;

/// The line prefix a worker prints once it listens (the relay's announcement).
pub const ANNOUNCEMENT_PREFIX: &str = "oab-relay: listening on http ";

/// Which emulated session a worker serves: a runtime and a runtime session id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SessionKey {
    runtime: RuntimeArn,
    session_id: String,
}

impl SessionKey {
    /// The key of session `session_id` of `runtime`.
    pub fn new(runtime: RuntimeArn, session_id: impl Into<String>) -> Self {
        Self {
            runtime,
            session_id: session_id.into(),
        }
    }

    /// The runtime.
    pub fn runtime(&self) -> &RuntimeArn {
        &self.runtime
    }

    /// The runtime session id, as the client sent it.
    pub fn session_id(&self) -> &str {
        &self.session_id
    }
}

/// Which sandbox a launcher runs workers in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxReport {
    /// How strongly sessions are separated from each other.
    pub isolation: IsolationLevel,
    /// The mechanism, e.g. `bubblewrap`, `landlock`, `none`, or a custom launcher's own words.
    pub mechanism: String,
}

impl fmt::Display for SandboxReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (isolation: {})", self.mechanism, self.isolation)
    }
}

/// Starts, stops and resets the workers of emulated sessions.
///
/// The emulator calls [`start`](Self::start) at the first request for a session with no running
/// worker (the first invoke or `/ws` of a new session, or the first after a stop, idle timeout or
/// lifetime end), [`RunningWorker::stop`] when the session stops, and
/// [`reset_storage`](Self::reset_storage) when its storage expires or the runtime version
/// changes. Each is called for one session at a time (never concurrently for the same key).
#[async_trait]
pub trait WorkerLauncher: fmt::Debug + Send + Sync + 'static {
    /// The sandbox workers run in.
    fn sandbox(&self) -> SandboxReport;

    /// Starts `key`'s worker on `key`'s storage (created on first use, kept across stops) and
    /// returns once it serves `GET /ping`, `GET /ws` and `POST /invocations` on its address.
    ///
    /// # Errors
    /// [`WorkerError`] if it cannot start or does not announce its address.
    async fn start(&self, key: &SessionKey) -> Result<Box<dyn RunningWorker>, WorkerError>;

    /// The host directory holding `key`'s storage, if it has any yet.
    async fn storage_path(&self, key: &SessionKey) -> Option<PathBuf>;

    /// Deletes `key`'s storage (no worker runs for it when this is called); a later start gets
    /// empty storage.
    ///
    /// # Errors
    /// [`WorkerError::Stop`] if the storage could not be removed.
    async fn reset_storage(&self, key: &SessionKey) -> Result<(), WorkerError>;

    /// Lets go of what the launcher holds on the host for session storage (mounts), now: the
    /// emulator was dropped. The launcher itself may be dropped later (the emulator's tasks hold
    /// it until they end), after the caller already removed the directory the storage was in.
    /// Default: nothing.
    fn release(&self) {}
}

/// One running worker.
#[async_trait]
pub trait RunningWorker: fmt::Debug + Send + Sync {
    /// Where it serves AgentCore's container contract (a loopback address).
    fn address(&self) -> SocketAddr;

    /// Stops it now (its storage stays).
    ///
    /// # Errors
    /// [`WorkerError::Stop`] if it could not be stopped.
    async fn stop(self: Box<Self>) -> Result<(), WorkerError>;
}

/// Reads lines from a worker's stdout until its announcement
/// (`oab-relay: listening on http 127.0.0.1:PORT`) and returns the address, which must be a
/// loopback one (the emulator contacts nothing else).
///
/// # Errors
/// [`WorkerError::Announce`] at end of output, after `patience`, or for an address that is not
/// loopback.
pub async fn read_announcement<R>(output: &mut R, patience: Duration) -> Result<SocketAddr, WorkerError>
where
    R: AsyncBufRead + Unpin + ?Sized,
{
    let read = async {
        let mut line = String::new();
        loop {
            line.clear();
            if output.read_line(&mut line).await? == 0 {
                return Err(WorkerError::Announce(
                    "the worker ended its output before announcing".into(),
                ));
            }
            let Some(addr) = line.trim_end().strip_prefix(ANNOUNCEMENT_PREFIX) else {
                tracing::debug!(line = line.trim_end(), "worker output before its announcement");
                continue;
            };
            let addr: SocketAddr = addr
                .trim()
                .parse()
                .map_err(|_| WorkerError::Announce(format!("not an address: {addr:?}")))?;
            if !addr.ip().is_loopback() {
                return Err(WorkerError::Announce(format!(
                    "{addr} is not a loopback address; the emulator only contacts loopback"
                )));
            }
            return Ok(addr);
        }
    };
    tokio::time::timeout(patience, read)
        .await
        .map_err(|_| WorkerError::Announce(format!("no announcement within {patience:?}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_announcement_is_found_after_other_output() {
        let mut out: &[u8] = b"starting\noab-relay: listening on http 127.0.0.1:4567\n";
        let addr = read_announcement(&mut out, Duration::from_secs(1))
            .await
            .expect("announced");
        assert_eq!(addr, "127.0.0.1:4567".parse().expect("addr"));
    }

    #[tokio::test]
    async fn a_non_loopback_announcement_is_refused() {
        let mut out: &[u8] = b"oab-relay: listening on http 10.0.0.1:80\n";
        assert!(read_announcement(&mut out, Duration::from_secs(1)).await.is_err());
        let mut silent: &[u8] = b"";
        assert!(read_announcement(&mut silent, Duration::from_secs(1))
            .await
            .is_err());
    }
}
