//! Fault hooks for the conformance suite: records a crash would leave, without the side effects.

use async_trait::async_trait;
use session_runtime::conformance::FaultInjector;
use session_runtime::{CloseReason, Result, Retention, SessionId, SessionState};

use crate::record::{CloseRecord, Phase};
use crate::KubernetesRuntime;

#[async_trait]
impl FaultInjector for KubernetesRuntime {
    async fn record_suspended_keep_worker(&self, id: &SessionId) -> Result<()> {
        self.record_only(id, |record| {
            record.phase = Phase::Session(SessionState::Suspended);
            record.worker = None;
        })
        .await
    }

    async fn record_closing(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        self.record_only(id, |record| {
            record.phase = Phase::Session(SessionState::Closing);
            record.close = Some(CloseRecord {
                reason,
                retention: Retention::Delete,
                retain_until: None,
                storage_done: false,
            });
        })
        .await
    }
}
