//! Fault injection for the conformance suite (feature `testing`): puts a session's record into the
//! state a broker killed at the wrong moment would leave.

use async_trait::async_trait;
use session_runtime::conformance::FaultInjector;
use session_runtime::{CloseReason, Error, Result, SessionId, SessionState, SuspendReason};

use crate::record::{self, Phase};
use crate::LocalRuntime;

#[async_trait]
impl FaultInjector for LocalRuntime {
    async fn record_suspended_keep_worker(&self, id: &SessionId) -> Result<()> {
        self.rewrite_record(id, |record| {
            record.phase = Phase::Session(SessionState::Suspended);
            record.suspend_reason = Some(SuspendReason::Shutdown);
        })
    }

    async fn record_closing(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        self.rewrite_record(id, |record| {
            record.phase = Phase::Session(SessionState::Closing);
            record.close_reason = Some(reason);
        })
    }
}

impl LocalRuntime {
    fn rewrite_record(&self, id: &SessionId, change: impl FnOnce(&mut record::SessionRecord)) -> Result<()> {
        let path = crate::layout::SessionDirs::live(&self.settings.root, id).record();
        let mut record = record::load(&path, id)?.ok_or(Error::NotFound { id: *id })?;
        change(&mut record);
        record::store(&path, &record)
    }
}

/// One session's egress proxy on its own, without a sandbox or an agent (feature `testing`): what
/// the tests and the benchmark of the proxy's bounds drive directly, through its Unix socket, as
/// a session's `oab-egress-forward` does.
#[derive(Debug)]
pub struct EgressProxyUnderTest {
    proxy: crate::egress::EgressProxy,
    socket: std::path::PathBuf,
}

impl EgressProxyUnderTest {
    /// Starts the proxy of session `id` allowing `targets`, with its sockets in `socket_dir`
    /// (created if needed). Must be called within a tokio runtime.
    ///
    /// # Errors
    ///
    /// As the runtime's own start of a session's proxy: [`Error::Backend`] if a socket cannot
    /// be made.
    ///
    /// # Cancellation
    ///
    /// Dropping the value stops the proxy, ends its connections and removes its sockets.
    pub fn start(
        id: SessionId,
        targets: &[session_runtime::config::EgressTarget],
        socket_dir: &std::path::Path,
    ) -> Result<Self> {
        let plan = std::sync::Arc::new(crate::egress::EgressPlan::new(targets));
        let proxy = crate::egress::EgressProxy::start(id, &plan, socket_dir, None)?;
        Ok(EgressProxyUnderTest {
            proxy,
            socket: socket_dir.join(crate::egress::PROXY_SOCKET),
        })
    }

    /// The HTTP proxy's socket (what the session's `127.0.0.1:3128` leads to).
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// How many of the session's connections the proxy holds now (at most its per-session
    /// limit).
    pub fn open_connections(&self) -> usize {
        self.proxy.open_connections()
    }

    /// How many connections and requests the proxy has refused so far, logged or not.
    pub fn refused(&self) -> u64 {
        self.proxy.refused()
    }
}
