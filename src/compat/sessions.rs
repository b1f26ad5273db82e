//! [`ThreadSessions`]: the pool's thread keys mapped onto runtime sessions.

use std::sync::Arc;

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

    /// Ends the thread's connection the way `path` says.
    ///
    /// # Errors
    /// As [`PoolPath::apply`]; [`Error::InvalidIdentity`] for a malformed key.
    pub async fn end(&self, pool_key: &str, path: PoolPath) -> Result<()> {
        let id = self.session_id(pool_key)?;
        path.apply(self.runtime.as_ref(), &id).await
    }
}
