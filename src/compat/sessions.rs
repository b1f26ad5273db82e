//! [`ThreadSessions`]: the pool's thread keys mapped onto runtime sessions.

use std::sync::Arc;
use std::time::Duration;

use session_runtime::{
    AgentOutput, Capabilities, CreateOptions, Error, Generation, Result, SessionId, SessionIdentity,
    SessionRuntime,
};

use super::{LineWriter, PoolPath, SessionControl};

/// Everything `AcpConnection` took from a child process, from one attachment.
#[derive(Debug)]
#[non_exhaustive]
pub struct AgentTransport {
    /// The runtime session.
    pub session_id: SessionId,
    /// The worker's generation.
    pub generation: Generation,
    /// The agent's working directory inside the worker: send it as `cwd` in `session/new` and
    /// `session/load` (never the broker's `working_dir`).
    pub cwd: String,
    /// The agent's stdout, for the reader loop.
    pub reader: AgentOutput,
    /// The agent's stdin, for requests, permission replies and the lock-free cancel path.
    pub writer: LineWriter,
    /// Cancel, kill and liveness without the connection mutex.
    pub control: SessionControl,
}

/// How [`ThreadSessions::end_after_turn`] found the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum TurnWait {
    /// No turn held it (any turn in flight had finished) when the session was ended.
    Finished,
    /// A turn still held it when the wait ran out; the session was ended anyway, cutting it off.
    WaitedOut,
}

/// The pool's `"<platform>:<thread>"` keys as runtime sessions of one installation and agent.
#[derive(Debug, Clone)]
pub struct ThreadSessions {
    runtime: Arc<dyn SessionRuntime>,
    installation: String,
    agent: String,
}

impl ThreadSessions {
    /// Sessions of `agent` (the configured agent's name) in `installation`.
    pub fn new(
        runtime: Arc<dyn SessionRuntime>,
        installation: impl Into<String>,
        agent: impl Into<String>,
    ) -> Self {
        Self {
            runtime,
            installation: installation.into(),
            agent: agent.into(),
        }
    }

    /// The runtime.
    pub fn runtime(&self) -> &Arc<dyn SessionRuntime> {
        &self.runtime
    }

    /// What the runtime provides (e.g. whether workers survive a broker restart).
    pub fn capabilities(&self) -> Capabilities {
        self.runtime.capabilities()
    }

    /// The identity of a pool key `"<platform>:<thread>"` (split at the first `:`; the thread part
    /// may contain more, as `native-dispatch:<agent>:<id>` keys do).
    ///
    /// # Errors
    /// [`Error::InvalidIdentity`] for a key without `:` or with an invalid part.
    pub fn identity(&self, pool_key: &str) -> Result<SessionIdentity> {
        let (platform, thread) = pool_key.split_once(':').ok_or_else(|| Error::InvalidIdentity {
            part: "platform",
            problem: "a pool key must look like <platform>:<thread>".into(),
        })?;
        SessionIdentity::new(self.installation.as_str(), self.agent.as_str(), platform, thread)
    }

    /// The session id of a pool key.
    ///
    /// # Errors
    /// As [`identity`](Self::identity).
    pub fn session_id(&self, pool_key: &str) -> Result<SessionId> {
        Ok(self.identity(pool_key)?.id())
    }

    /// Replaces `AcpConnection::spawn`: creates the thread's session if needed (its storage
    /// exists before any agent process) and attaches, starting a worker of a new generation.
    /// An overlay in `options` ([`thread_overlay`](super::thread_overlay): the thread's working
    /// directory and session token) replaces the session's for the worker this call starts, also
    /// when the session exists already.
    ///
    /// # Errors
    /// As [`SessionRuntime::create`] and [`SessionRuntime::attach`].
    pub async fn open(&self, pool_key: &str, options: &CreateOptions) -> Result<AgentTransport> {
        let identity = self.identity(pool_key)?;
        let handle = self.runtime.create(&identity, options).await?;
        let attachment = self.runtime.attach(&handle.id).await?;
        let session_id = attachment.session_id();
        let generation = attachment.generation();
        let cwd = attachment.working_dir().to_owned();
        let (reader, input, worker) = attachment.into_split();
        Ok(AgentTransport {
            session_id,
            generation,
            cwd,
            reader,
            writer: LineWriter::new(input.clone()),
            control: SessionControl::new(session_id, input, worker),
        })
    }

    /// Ends the thread's connection the way `path` says, at once: a turn in flight is cut off.
    ///
    /// # Errors
    /// As [`PoolPath::apply`]; [`Error::InvalidIdentity`] for a malformed key.
    pub async fn end(&self, pool_key: &str, path: PoolPath) -> Result<()> {
        let id = self.session_id(pool_key)?;
        path.apply(self.runtime.as_ref(), &id).await
    }

    /// Ends the thread's connection the way `path` says once no turn holds `connection` (the
    /// pool's `Mutex` around `AcpConnection`, which a turn holds from start to end), waiting at
    /// most `wait`; the lock is held across the runtime call, so no new turn starts meanwhile.
    ///
    /// Upstream's idle and capacity evictions removed the connection from the pool's map and
    /// let the last `Arc` go: a turn that had just started kept its clone and finished before
    /// the process died. [`end`](Self::end) stops the worker at once; this is the graceful
    /// equivalent for [`PoolPath::IdleEviction`] and [`PoolPath::CapacityEviction`]. (Hung
    /// eviction is meant to cut a stuck turn off: use `end`.)
    ///
    /// Returns [`TurnWait::WaitedOut`] if the turn still held the connection after `wait` and
    /// the session was ended anyway.
    ///
    /// # Errors
    /// As [`end`](Self::end).
    ///
    /// # Cancellation
    /// Dropping the future while it waits ends nothing; dropping it during the runtime call is
    /// as dropping [`PoolPath::apply`].
    pub async fn end_after_turn<T: Send>(
        &self,
        pool_key: &str,
        path: PoolPath,
        connection: &tokio::sync::Mutex<T>,
        wait: Duration,
    ) -> Result<TurnWait> {
        let id = self.session_id(pool_key)?;
        match tokio::time::timeout(wait, connection.lock()).await {
            Ok(_turns_held_off) => {
                path.apply(self.runtime.as_ref(), &id).await?;
                Ok(TurnWait::Finished)
            }
            Err(_) => {
                path.apply(self.runtime.as_ref(), &id).await?;
                Ok(TurnWait::WaitedOut)
            }
        }
    }
}
