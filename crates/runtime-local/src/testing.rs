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
