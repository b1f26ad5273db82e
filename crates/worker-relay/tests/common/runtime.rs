//! `RelayRuntime`: a small [`SessionRuntime`] whose workers are real `oab-relay serve --
//! acp-test-agent` processes, reached over loopback TCP through [`RelayClient`]. Records live in
//! memory; each session gets temporary storage. It exists to run the conformance suite with the
//! relay in the path.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use parking_lot::Mutex;
use session_runtime::conformance::FaultInjector;
use session_runtime::{
    Attachment, Capabilities, CloseReason, CreateOptions, Error, Fence, FenceTrigger, Generation,
    IsolationLevel, ReconcileReport, Result, RetentionPolicy, SessionHandle, SessionId, SessionIdentity,
    SessionRuntime, SessionState, SessionStatus, StorageState, SuspendReason, WorkerControl, WorkerExit,
    WorkerInfo, WorkspaceSeed,
};
use worker_relay::{ClientConfig, RelayClient};

use super::{key, RelayOptions, RelayProcess};

const NAME: &str = "relay-test";

/// The runtime.
pub struct RelayRuntime {
    installation: String,
    retention: RetentionPolicy,
    epoch: u64,
    agent: PathBuf,
    root: tempfile::TempDir,
    sessions: Mutex<HashMap<SessionId, Arc<Slot>>>,
}

impl fmt::Debug for RelayRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RelayRuntime")
            .field("installation", &self.installation)
            .field("root", &self.root.path())
            .finish_non_exhaustive()
    }
}

struct Slot {
    lifecycle: tokio::sync::Mutex<()>,
    record: Mutex<Record>,
}

struct Record {
    status: SessionStatus,
    incarnation: u64,
    storage: PathBuf,
    worker: Option<Worker>,
}

struct Worker {
    control: Arc<dyn WorkerControl>,
    fence: FenceTrigger,
    relay: RelayProcess,
}

impl RelayRuntime {
    /// A runtime for `installation` with the default retention policy.
    pub fn new(installation: &str) -> Self {
        Self {
            installation: installation.to_owned(),
            retention: RetentionPolicy::default(),
            epoch: 1,
            agent: super::acp_test_agent(),
            root: tempfile::Builder::new()
                .prefix("relay-runtime-")
                .tempdir()
                .expect("storage root"),
            sessions: Mutex::default(),
        }
    }

    pub fn installation(&self) -> &str {
        &self.installation
    }

    fn slot(&self, id: &SessionId) -> Result<Arc<Slot>> {
        self.sessions
            .lock()
            .get(id)
            .cloned()
            .ok_or(Error::NotFound { id: *id })
    }

    fn workspace(storage: &Path) -> PathBuf {
        storage.join("workspace")
    }

    /// Fences and stops the worker (through its relay), then waits for the relay to end.
    async fn stop_worker(slot: &Slot, generation: Generation, grace: Option<Duration>) -> Option<WorkerExit> {
        let worker = slot.record.lock().worker.take()?;
        worker.fence.fence(generation);
        let exit = match grace {
            Some(grace) => worker.control.terminate(grace).await,
            None => worker.control.kill().await,
        };
        let mut relay = worker.relay;
        if tokio::time::timeout(Duration::from_secs(10), relay.child.wait())
            .await
            .is_err()
        {
            let _ = relay.child.kill().await;
        }
        exit.ok()
    }

    async fn start_worker(&self, id: SessionId, slot: &Slot) -> Result<Attachment> {
        let (generation, storage) = {
            let mut record = slot.record.lock();
            if !record.status.state.can_attach() {
                return Err(Error::InvalidState {
                    id,
                    state: record.status.state,
                    operation: "attach",
                });
            }
            record.status.generation += 1;
            (record.status.generation, record.storage.clone())
        };
        // The old worker is fenced and gone before the new one may touch storage.
        Self::stop_worker(slot, generation, None).await;

        let workspace = Self::workspace(&storage);
        let state_dir = storage.join("agent-state");
        std::fs::create_dir_all(&state_dir).map_err(|e| Error::backend(NAME, true, "agent state dir", e))?;
        let relay = RelayProcess::start(
            id,
            &[
                self.agent.clone().into(),
                "--exec-dir".into(),
                workspace.clone().into(),
                "--state-dir".into(),
                state_dir.into(),
            ],
            RelayOptions {
                generation,
                workdir: Some(workspace),
                ..RelayOptions::default()
            },
        )
        .await;
        let (fence, trigger) = Fence::new(id, generation);
        let config = ClientConfig::with_key(id, generation, self.epoch, &key())
            .heartbeat(Duration::from_secs(5))
            .backoff(Duration::from_millis(10), Duration::from_millis(200))
            .give_up_after(Duration::from_secs(10));
        let attachment = RelayClient::new(config, relay.connector()).attach(fence).await?;
        let control = attachment.control();
        let now = SystemTime::now();
        let mut record = slot.record.lock();
        record.status.state = SessionState::Running;
        record.status.suspend_reason = None;
        record.status.worker = Some(WorkerInfo::new(control.worker_id(), generation, now));
        record.status.last_activity = now;
        record.worker = Some(Worker {
            control,
            fence: trigger,
            relay,
        });
        Ok(attachment)
    }

    async fn suspend_locked(&self, id: SessionId, slot: &Slot, reason: SuspendReason) -> Result<()> {
        let generation = {
            let mut record = slot.record.lock();
            let state = record.status.state;
            if !state.can_suspend() {
                return Err(Error::InvalidState {
                    id,
                    state,
                    operation: "suspend",
                });
            }
            if state == SessionState::Running {
                record.status.state = SessionState::Suspended;
                record.status.suspend_reason = Some(reason);
                record.status.worker = None;
                record.status.last_activity = SystemTime::now();
            }
            record.status.generation
        };
        let grace = (reason != SuspendReason::Hung).then_some(Duration::from_secs(5));
        Self::stop_worker(slot, generation, grace).await;
        Ok(())
    }

    async fn close_locked(&self, slot: &Slot, reason: CloseReason) -> Result<()> {
        let generation = {
            let mut record = slot.record.lock();
            match record.status.state {
                SessionState::Closed => return Ok(()),
                SessionState::Closing => {}
                _ => {
                    record.status.state = SessionState::Closing;
                    record.status.close_reason = Some(reason);
                    record.status.worker = None;
                }
            }
            record.status.generation
        };
        Self::stop_worker(slot, generation, Some(Duration::from_secs(5))).await;
        let mut record = slot.record.lock();
        let reason = record.status.close_reason.unwrap_or(reason);
        let now = SystemTime::now();
        record.status.storage = match self.retention.retained_until(reason, now) {
            Some(until) => StorageState::Retained { until },
            None => {
                if record.storage.exists() {
                    std::fs::remove_dir_all(&record.storage)
                        .map_err(|e| Error::backend(NAME, true, "deleting session storage", e))?;
                }
                StorageState::Deleted
            }
        };
        record.status.state = SessionState::Closed;
        record.status.last_activity = now;
        Ok(())
    }
}

#[async_trait]
impl SessionRuntime for RelayRuntime {
    fn name(&self) -> &'static str {
        NAME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal()
            .with_isolation(IsolationLevel::None)
            .with_persistent_storage(true)
    }

    async fn create(&self, identity: &SessionIdentity, options: &CreateOptions) -> Result<SessionHandle> {
        if identity.installation() != self.installation {
            return Err(Error::InvalidIdentity {
                part: "installation",
                problem: format!("belongs to another installation than {}", self.installation),
            });
        }
        if let Some(WorkspaceSeed::GitClone { .. }) = options.workspace_seed {
            return Err(Error::Unsupported {
                operation: "git workspace seeds",
                runtime: NAME,
            });
        }
        let id = identity.id();
        let slot = Arc::clone(self.sessions.lock().entry(id).or_insert_with(|| {
            Arc::new(Slot {
                lifecycle: tokio::sync::Mutex::new(()),
                record: Mutex::new(Record {
                    status: SessionStatus::new(id, SystemTime::now()),
                    incarnation: 0,
                    storage: PathBuf::new(),
                    worker: None,
                }),
            })
        }));
        let _lifecycle = slot.lifecycle.lock().await;
        let mut record = slot.record.lock();
        let fresh = record.incarnation == 0 || record.status.state == SessionState::Closed;
        if fresh {
            record.incarnation += 1;
            record.storage = self
                .root
                .path()
                .join(id.as_str())
                .join(record.incarnation.to_string());
            std::fs::create_dir_all(Self::workspace(&record.storage))
                .map_err(|e| Error::backend(NAME, true, "creating session storage", e))?;
            // Generations never go back, across incarnations too.
            let generation = record.status.generation;
            record.status = SessionStatus::new(id, SystemTime::now());
            record.status.generation = generation;
            record.status.storage_refs = vec![record.storage.display().to_string()];
        }
        Ok(SessionHandle::new(
            id,
            record.status.state,
            record.status.generation,
            fresh,
        ))
    }

    async fn attach(&self, id: &SessionId) -> Result<Attachment> {
        let slot = self.slot(id)?;
        let _lifecycle = slot.lifecycle.lock().await;
        self.start_worker(*id, &slot).await
    }

    async fn suspend(&self, id: &SessionId, reason: SuspendReason) -> Result<()> {
        let slot = self.slot(id)?;
        let _lifecycle = slot.lifecycle.lock().await;
        self.suspend_locked(*id, &slot, reason).await
    }

    async fn close(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let Ok(slot) = self.slot(id) else {
            return Ok(());
        };
        let _lifecycle = slot.lifecycle.lock().await;
        self.close_locked(&slot, reason).await
    }

    async fn status(&self, id: &SessionId) -> Result<SessionStatus> {
        Ok(self.slot(id)?.record.lock().status.clone())
    }

    async fn list(&self) -> Result<Vec<SessionStatus>> {
        let slots: Vec<_> = self.sessions.lock().values().cloned().collect();
        Ok(slots.iter().map(|s| s.record.lock().status.clone()).collect())
    }

    async fn reconcile(&self) -> Result<ReconcileReport> {
        let mut report = ReconcileReport::default();
        let slots: Vec<_> = self
            .sessions
            .lock()
            .iter()
            .map(|(id, slot)| (*id, Arc::clone(slot)))
            .collect();
        let now = SystemTime::now();
        for (id, slot) in slots {
            let _lifecycle = slot.lifecycle.lock().await;
            let (state, generation, stray) = {
                let record = slot.record.lock();
                let alive = record.worker.as_ref().is_some_and(|w| w.control.is_alive());
                (
                    record.status.state,
                    record.status.generation,
                    alive && !record.status.state.may_run_worker(),
                )
            };
            if stray {
                Self::stop_worker(&slot, generation, None).await;
                report
                    .killed_workers
                    .push((id, format!("a worker ran while the session was {state}")));
            }
            match state {
                SessionState::Closing => match self.close_locked(&slot, CloseReason::Ended).await {
                    Ok(()) => report.finished_closes.push(id),
                    Err(error) => report.errors.push(format!("session {id}: {error}")),
                },
                SessionState::Closed => {
                    let mut record = slot.record.lock();
                    if let StorageState::Retained { until } = record.status.storage {
                        if until.has_passed(now) {
                            match std::fs::remove_dir_all(&record.storage) {
                                Ok(()) => {
                                    record.status.storage = StorageState::Deleted;
                                    report.expired_storage.push(id);
                                }
                                Err(error) => report.errors.push(format!("session {id}: {error}")),
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(report)
    }
}

#[async_trait]
impl FaultInjector for RelayRuntime {
    async fn record_suspended_keep_worker(&self, id: &SessionId) -> Result<()> {
        let slot = self.slot(id)?;
        let _lifecycle = slot.lifecycle.lock().await;
        let mut record = slot.record.lock();
        record.status.state = SessionState::Suspended;
        record.status.suspend_reason = Some(SuspendReason::Shutdown);
        record.status.worker = None;
        Ok(())
    }

    async fn record_closing(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let slot = self.slot(id)?;
        let _lifecycle = slot.lifecycle.lock().await;
        let mut record = slot.record.lock();
        record.status.state = SessionState::Closing;
        record.status.close_reason = Some(reason);
        Ok(())
    }
}
