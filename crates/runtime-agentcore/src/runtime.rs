//! [`AgentCoreRuntime`]: the lifecycle on top of the record store, the SDK and the relay.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use aws_credential_types::provider::SharedCredentialsProvider;
use parking_lot::Mutex;
use session_runtime::config::{AgentCoreConfig, SessionRuntimeConfig};
use session_runtime::{
    Attachment, Capabilities, CloseReason, CreateOptions, Error, Fence, FenceTrigger, Generation,
    IsolationLevel, ReconcileReport, Result, RetainedUntil, RetentionPolicy, SessionHandle, SessionId,
    SessionIdentity, SessionOverlay, SessionRuntime, SessionState, SessionStatus, StorageState,
    SuspendReason, WorkerControl, WorkerInfo,
};
use tokio::sync::OnceCell;
use worker_relay::agentcore::{self, RuntimeSessionId};
use worker_relay::{BrokerKey, ClientConfig, RelayClient};

use crate::connect::SignedConnector;
use crate::control::{Aws, Stopped};
use crate::errors::Failure;
use crate::record::{
    CloseIntent, FileRecordStore, RecordStore, RetainedStorage, Revision, SessionRecord, StoreError, Stored,
};
use crate::RUNTIME;

/// How long a worker's relay gets to report its exit when it is stopped through the stream.
const RELAY_STOP: Duration = Duration::from_secs(5);

/// How long an agent gets to stop on `suspend` (other than `Hung`) before it is killed.
const TERMINATE_GRACE: Duration = Duration::from_secs(10);

/// How long a closed session's record (holding nothing) is kept before `reconcile` removes it.
pub const DEFAULT_CLOSED_RECORD_TTL: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long AgentCore keeps session storage nobody used: it deletes it after 14 idle days.
pub const SESSION_STORAGE_EXPIRY: Duration = Duration::from_secs(14 * 24 * 3600);

/// One AWS Bedrock AgentCore Runtime microVM per session, reached through the worker relay over
/// a SigV4-signed WebSocket.
///
/// # How sessions map onto AgentCore
///
/// - **Records.** AgentCore has no session objects to list or to keep state in; the backend's
///   authority is a [`RecordStore`] ([`FileRecordStore`] under `state_dir` by default).
///   `create` writes the record and provisions nothing remote.
/// - **Runtime session ids.** A session's incarnation (bumped when a closed session is created
///   again) is one AgentCore runtime session, `oab1-<session id>-<incarnation>-<token hash>`
///   ([`RuntimeSessionId`]): the same microVM and session storage across suspends and worker
///   generations; a new one after a close. It is always sent explicitly.
/// - **Attach** bumps the generation by compare-and-swap on the record and opens the signed
///   WebSocket to the runtime's `/ws`. AgentCore starts a microVM for the id if none runs; in it,
///   `oab-relay serve --agentcore` retires the previous generation's agent before it starts the
///   new one. The attachment's working directory is the relay's (the session storage mount).
/// - **Suspend** records the suspend, stops the agent through the stream, and (by default,
///   `stop_on_suspend`) calls `StopRuntimeSession`, so compute is released at once.
/// - **Close** records the reason and retention first, then deletes the session storage's
///   contents through the relay when the policy says delete (AgentCore has no call that deletes
///   session storage), calls `StopRuntimeSession` (not running counts as stopped), and records the
///   close. The next `create` starts a new incarnation.
/// - **Cancel** is the broker's business: `session/cancel` travels in-band over the stream and
///   never stops the microVM.
#[derive(Clone)]
pub struct AgentCoreRuntime {
    inner: Arc<Inner>,
}

struct Inner {
    config: AgentCoreConfig,
    installation: String,
    retention: RetentionPolicy,
    idle_ttl: Option<Duration>,
    closed_record_ttl: Duration,
    store: Arc<dyn RecordStore>,
    key: BrokerKey,
    epoch: u64,
    credentials: Option<SharedCredentialsProvider>,
    aws: OnceCell<Arc<Aws>>,
    locks: Mutex<HashMap<SessionId, Arc<tokio::sync::Mutex<()>>>>,
    live: Mutex<HashMap<SessionId, Live>>,
}

impl fmt::Debug for AgentCoreRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AgentCoreRuntime")
            .field("runtime_arn", &self.inner.config.runtime_arn)
            .field("qualifier", &self.inner.config.effective_qualifier())
            .field("installation", &self.inner.installation)
            .field("store", &self.inner.store)
            .finish_non_exhaustive()
    }
}

/// The attachment this process holds for a session.
struct Live {
    generation: Generation,
    fence: FenceTrigger,
    control: Arc<dyn WorkerControl>,
    /// Renews the record's activity while the attachment lives, so `reconcile` does not count
    /// it idle.
    renewal: tokio::task::AbortHandle,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.renewal.abort();
    }
}

/// Builds an [`AgentCoreRuntime`].
#[derive(Debug)]
pub struct AgentCoreRuntimeBuilder {
    config: AgentCoreConfig,
    installation: String,
    retention: RetentionPolicy,
    idle_ttl: Option<Duration>,
    closed_record_ttl: Duration,
    store: Option<Arc<dyn RecordStore>>,
    key: Option<BrokerKey>,
    credentials: Option<SharedCredentialsProvider>,
}

impl AgentCoreRuntimeBuilder {
    /// The installation every identity must name. Default `"openab"`.
    pub fn installation(mut self, installation: impl Into<String>) -> Self {
        self.installation = installation.into();
        self
    }

    /// What a close does with session storage. Default: delete for every reason.
    pub fn retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }

    /// How long a session may go without an attachment before `reconcile` suspends it. Default
    /// 30 minutes; `None` leaves idle sessions to AgentCore's own idle timeout.
    pub fn idle_ttl(mut self, idle_ttl: Option<Duration>) -> Self {
        self.idle_ttl = idle_ttl;
        self
    }

    /// How long `reconcile` keeps the record of a closed session that holds nothing. Default
    /// [`DEFAULT_CLOSED_RECORD_TTL`].
    pub fn closed_record_ttl(mut self, ttl: Duration) -> Self {
        self.closed_record_ttl = ttl;
        self
    }

    /// Keeps records in `store` instead of a [`FileRecordStore`] under `state_dir/sessions`.
    pub fn record_store(mut self, store: Arc<dyn RecordStore>) -> Self {
        self.store = Some(store);
        self
    }

    /// Derives relay tokens (and so runtime session ids) from `key` instead of the key file
    /// `state_dir/relay.key`. Every broker process serving the same sessions needs the same key.
    pub fn broker_key(mut self, key: BrokerKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Uses `credentials` instead of the standard AWS provider chain.
    pub fn credentials(mut self, credentials: SharedCredentialsProvider) -> Self {
        self.credentials = Some(credentials);
        self
    }

    /// Builds the runtime. No AWS call is made until the first attach, suspend or close.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the key for invalid settings; [`Error::Backend`] if the
    /// state directory, the record store or the key cannot be opened.
    pub fn build(self) -> Result<AgentCoreRuntime> {
        self.config.validate()?;
        let state_dir = &self.config.state_dir;
        let store: Arc<dyn RecordStore> = match self.store {
            Some(store) => store,
            None => Arc::new(FileRecordStore::open(state_dir.join("sessions")).map_err(store_error)?),
        };
        let key = match self.key {
            Some(key) => key,
            None => {
                let path = state_dir.join("relay.key");
                crate::key::load_or_create(&path).map_err(|error| {
                    Error::backend(
                        RUNTIME,
                        false,
                        format!("reading the relay key {}", path.display()),
                        error,
                    )
                })?
            }
        };
        // Every process's hellos carry a newer epoch than the ones before it: its start time in
        // milliseconds, the unit the relay bounds epochs by (one further ahead of its clock than
        // `worker_relay::server::EPOCH_LEEWAY` is refused; microseconds would be).
        let epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Ok(AgentCoreRuntime {
            inner: Arc::new(Inner {
                config: self.config,
                installation: self.installation,
                retention: self.retention,
                idle_ttl: self.idle_ttl,
                closed_record_ttl: self.closed_record_ttl,
                store,
                key,
                epoch,
                credentials: self.credentials,
                aws: OnceCell::new(),
                locks: Mutex::new(HashMap::new()),
                live: Mutex::new(HashMap::new()),
            }),
        })
    }
}

fn store_error(error: StoreError) -> Error {
    let retryable = matches!(error, StoreError::Conflict | StoreError::Io { .. });
    let message = error.to_string();
    Error::backend(RUNTIME, retryable, message, error)
}

fn now() -> SystemTime {
    SystemTime::now()
}

impl AgentCoreRuntime {
    /// A builder for the agent runtime `config` describes.
    pub fn builder(config: AgentCoreConfig) -> AgentCoreRuntimeBuilder {
        AgentCoreRuntimeBuilder {
            config,
            installation: SessionRuntimeConfig::DEFAULT_INSTALLATION.to_owned(),
            retention: RetentionPolicy::default(),
            idle_ttl: Some(SessionRuntimeConfig::DEFAULT_IDLE_TTL),
            closed_record_ttl: DEFAULT_CLOSED_RECORD_TTL,
            store: None,
            key: None,
            credentials: None,
        }
    }

    /// A builder from a `[session_runtime]` section with an `[agentcore]` table.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] if the section is invalid or has no `[agentcore]` table.
    pub fn builder_from_config(config: &SessionRuntimeConfig) -> Result<AgentCoreRuntimeBuilder> {
        config.validate()?;
        let agentcore = config.agentcore.clone().ok_or_else(|| Error::InvalidConfig {
            key: "session_runtime.agentcore".into(),
            reason: "the AgentCore runtime needs a [session_runtime.agentcore] table with runtime_arn".into(),
        })?;
        Ok(Self::builder(agentcore)
            .installation(config.installation.clone())
            .retention(config.retention.clone())
            .idle_ttl(config.effective_idle_ttl()))
    }

    /// The installation this runtime serves.
    pub fn installation(&self) -> &str {
        &self.inner.installation
    }

    /// The runtime session id of `id`'s `incarnation`.
    pub fn runtime_session_id(&self, id: &SessionId, incarnation: u64) -> String {
        self.rsid(id, incarnation).to_string()
    }

    fn rsid(&self, id: &SessionId, incarnation: u64) -> RuntimeSessionId {
        let token = self.inner.key.token(id.as_str(), incarnation);
        // Session ids are lowercase base32 by construction, which the scheme carries.
        RuntimeSessionId::new(id.as_str(), incarnation, &token)
            .unwrap_or_else(|_| unreachable!("a session id is lowercase base32"))
    }

    async fn aws(&self) -> Arc<Aws> {
        Arc::clone(
            self.inner
                .aws
                .get_or_init(|| async {
                    Arc::new(Aws::load(&self.inner.config, self.inner.credentials.clone()).await)
                })
                .await,
        )
    }

    fn lock(&self, id: &SessionId) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(self.inner.locks.lock().entry(*id).or_default())
    }

    async fn load(&self, id: &SessionId) -> Result<Option<Stored>> {
        self.inner.store.load(id).await.map_err(store_error)
    }

    async fn load_existing(&self, id: &SessionId) -> Result<Stored> {
        self.load(id).await?.ok_or(Error::NotFound { id: *id })
    }

    /// Applies `change` to the current record by compare-and-swap, re-reading after a lost
    /// race. `change` returns `Ok(None)` for "nothing to write".
    async fn update(
        &self,
        id: &SessionId,
        mut change: impl FnMut(&SessionRecord) -> Result<Option<SessionRecord>>,
    ) -> Result<(Revision, SessionRecord)> {
        loop {
            let stored = self.load_existing(id).await?;
            let Some(next) = change(&stored.record)? else {
                return Ok((stored.revision, stored.record));
            };
            match self.inner.store.store(&next, Some(stored.revision)).await {
                Ok(revision) => return Ok((revision, next)),
                Err(StoreError::Conflict) => continue,
                Err(error) => return Err(store_error(error)),
            }
        }
    }

    /// Stops this process's attachment of `id`: the agent is asked to stop through the stream
    /// (killed with `grace` zero), then the attachment is fenced on behalf of `generation`.
    async fn retire_live(&self, id: &SessionId, generation: Generation, grace: Duration) {
        let Some(live) = self.inner.live.lock().remove(id) else {
            return;
        };
        let stopped = if grace.is_zero() {
            tokio::time::timeout(RELAY_STOP, live.control.kill()).await
        } else {
            tokio::time::timeout(grace + RELAY_STOP, live.control.terminate(grace)).await
        };
        if !matches!(stopped, Ok(Ok(_))) {
            tracing::debug!(session = %id, "the previous worker did not report its exit through the relay");
        }
        live.fence.fence(generation.max(live.generation));
    }

    async fn stop_compute(&self, id: &SessionId, incarnation: u64) -> Result<()> {
        let aws = self.aws().await;
        let rsid = self.rsid(id, incarnation).to_string();
        match aws.stop(&rsid).await.map_err(Failure::into_error)? {
            Stopped::Stopped => tracing::info!(session = %id, incarnation, "runtime session stopped"),
            Stopped::NotRunning => {
                tracing::debug!(session = %id, incarnation, "runtime session was not running")
            }
        }
        Ok(())
    }

    /// Deletes the contents of an incarnation's session storage through its relay, then stops its
    /// microVM. Without session storage nothing outlives the microVM, so stopping it is enough.
    async fn delete_storage(&self, id: &SessionId, incarnation: u64) -> Result<()> {
        if self.inner.config.session_storage {
            let aws = self.aws().await;
            let rsid = self.rsid(id, incarnation);
            let token = self.inner.key.token(id.as_str(), incarnation);
            let answer = aws
                .invoke(&rsid.to_string(), agentcore::wipe_request(&token))
                .await
                .map_err(Failure::into_error)?;
            agentcore::check_wipe_answer(&answer).map_err(|reason| {
                Error::backend(
                    RUNTIME,
                    true,
                    format!("deleting the session storage of {id} (incarnation {incarnation})"),
                    std::io::Error::other(reason),
                )
            })?;
        }
        self.stop_compute(id, incarnation).await
    }

    async fn create_locked(&self, id: SessionId) -> Result<SessionHandle> {
        loop {
            let (next, expected) = match self.load(&id).await? {
                None => (SessionRecord::new(id, now()), None),
                Some(stored) if !stored.record.state.is_closed() => {
                    let record = stored.record;
                    return Ok(SessionHandle::new(id, record.state, record.generation, false));
                }
                Some(stored) => (reincarnate(stored.record, now()), Some(stored.revision)),
            };
            match self.inner.store.store(&next, expected).await {
                Ok(_) => {
                    tracing::info!(session = %id, incarnation = next.incarnation, "session created");
                    return Ok(SessionHandle::new(id, next.state, next.generation, true));
                }
                Err(StoreError::Conflict) => continue,
                Err(error) => return Err(store_error(error)),
            }
        }
    }

    async fn attach_locked(&self, id: &SessionId) -> Result<Attachment> {
        let (_, record) = self
            .update(id, |record| match record.state {
                state @ (SessionState::Closing | SessionState::Closed) => Err(Error::InvalidState {
                    id: *id,
                    state,
                    operation: "attach",
                }),
                _ => {
                    let mut next = record.clone();
                    next.generation += 1;
                    next.state = SessionState::Running;
                    next.suspend_reason = None;
                    next.worker_started_at = Some(now());
                    next.last_activity = now();
                    next.attached = true;
                    next.compute_released = false;
                    Ok(Some(next))
                }
            })
            .await?;
        let generation = record.generation;
        // The relay retires the previous agent itself; this process's attachment is fenced now.
        if let Some(previous) = self.inner.live.lock().remove(id) {
            previous.fence.fence(generation);
        }
        let aws = self.aws().await;
        let rsid = self.rsid(id, record.incarnation);
        let token = self.inner.key.token(id.as_str(), record.incarnation);
        let budget = self.inner.config.start_timeout;
        let config = ClientConfig::new(*id, generation, self.inner.epoch, token).give_up_after(budget);
        let connector = Arc::new(SignedConnector::new(aws, rsid.to_string()));
        let (fence, trigger) = Fence::new(*id, generation);
        let attachment = RelayClient::new(config, connector).attach(fence).await?;
        let renewal = tokio::spawn(renew_while_live(
            Arc::clone(&self.inner.store),
            *id,
            generation,
            attachment.control(),
            trigger.clone(),
            renew_every(self.inner.idle_ttl),
        ))
        .abort_handle();
        let live = Live {
            generation,
            fence: trigger,
            control: attachment.control(),
            renewal,
        };
        self.inner.live.lock().insert(*id, live);
        tracing::info!(session = %id, generation, incarnation = record.incarnation, "attached");
        Ok(attachment)
    }

    async fn suspend_locked(&self, id: &SessionId, reason: SuspendReason) -> Result<()> {
        let (_, record) = self
            .update(id, |record| match record.state {
                state @ (SessionState::Closing | SessionState::Closed) => Err(Error::InvalidState {
                    id: *id,
                    state,
                    operation: "suspend",
                }),
                SessionState::Running => {
                    let mut next = record.clone();
                    next.state = SessionState::Suspended;
                    next.suspend_reason = Some(reason);
                    next.worker_started_at = None;
                    next.last_activity = now();
                    Ok(Some(next))
                }
                _ => Ok(None),
            })
            .await?;
        let grace = if reason == SuspendReason::Hung {
            Duration::ZERO
        } else {
            TERMINATE_GRACE
        };
        self.retire_live(id, record.generation, grace).await;
        if record.state == SessionState::Suspended && !record.compute_released {
            self.release_compute(id, &record, reason == SuspendReason::Hung)
                .await?;
        }
        Ok(())
    }

    /// Releases the microVM of a suspended session: stops the runtime session (always for a hung
    /// one), or leaves it to idle out when `stop_on_suspend` is off.
    async fn release_compute(&self, id: &SessionId, record: &SessionRecord, hung: bool) -> Result<()> {
        if !(hung || self.inner.config.stop_on_suspend) {
            return Ok(());
        }
        self.stop_compute(id, record.incarnation).await?;
        self.mark_released(id, record.generation).await
    }

    /// Records that no microVM runs `generation` of the session any more.
    async fn mark_released(&self, id: &SessionId, generation: Generation) -> Result<()> {
        self.update(id, |current| {
            if current.generation != generation || current.compute_released {
                return Ok(None);
            }
            let mut next = current.clone();
            next.compute_released = true;
            Ok(Some(next))
        })
        .await?;
        Ok(())
    }

    async fn close_locked(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let Some(stored) = self.load(id).await? else {
            tracing::debug!(session = %id, "close: no such session");
            return Ok(());
        };
        if stored.record.state == SessionState::Closed {
            return Ok(());
        }
        let retention = self.inner.retention.clone();
        let (_, record) = self
            .update(id, |record| {
                if matches!(record.state, SessionState::Closing | SessionState::Closed) {
                    return Ok(None);
                }
                let mut next = record.clone();
                next.state = SessionState::Closing;
                next.close_reason = Some(reason);
                next.worker_started_at = None;
                next.last_activity = now();
                // The retention is decided once, by the first close.
                next.close_intent = Some(CloseIntent {
                    retain_until: retention.retained_until(reason, now()),
                });
                Ok(Some(next))
            })
            .await?;
        self.retire_live(id, record.generation + 1, Duration::ZERO).await;
        if record.state == SessionState::Closing {
            self.finish_close(id, &record).await?;
        }
        Ok(())
    }

    /// Applies the recorded retention to a closing session's storage and records the close.
    async fn finish_close(&self, id: &SessionId, record: &SessionRecord) -> Result<()> {
        let retained = match record.close_intent {
            Some(intent) => intent.retain_until,
            // A record written without its intent: decide now, as the close would have.
            None => self
                .inner
                .retention
                .retained_until(record.close_reason.unwrap_or(CloseReason::Ended), now()),
        };
        match retained {
            // Never attached: no microVM ran and the session storage was never written.
            _ if !record.attached => {}
            None => self.delete_storage(id, record.incarnation).await?,
            Some(_) => self.stop_compute(id, record.incarnation).await?,
        }
        let incarnation = record.incarnation;
        self.update(id, |current| {
            if current.state != SessionState::Closing || current.incarnation != incarnation {
                return Ok(None);
            }
            let mut next = current.clone();
            next.state = SessionState::Closed;
            next.storage = match retained {
                Some(until) if current.attached => StorageState::Retained { until },
                // Deleted, or never written: nothing is kept.
                _ => StorageState::Deleted,
            };
            next.closed_at = Some(now());
            next.compute_released = true;
            Ok(Some(next))
        })
        .await?;
        tracing::info!(session = %id, incarnation, reason = ?record.close_reason, "session closed");
        Ok(())
    }

    fn status_of(&self, record: &SessionRecord) -> SessionStatus {
        let mut status = SessionStatus::new(record.id, record.created_at);
        status.state = record.state;
        status.generation = record.generation;
        status.last_activity = record.last_activity;
        status.storage = record.storage;
        status.suspend_reason = record.suspend_reason;
        status.close_reason = record.close_reason;
        let rsid = self.rsid(&record.id, record.incarnation).to_string();
        if record.state == SessionState::Running {
            status.worker = Some(WorkerInfo::new(
                format!("agentcore:{rsid}:{}", record.generation),
                record.generation,
                record.worker_started_at.unwrap_or(record.last_activity),
            ));
        }
        if record.storage != StorageState::Deleted && self.inner.config.session_storage {
            status
                .storage_refs
                .push(format!("agentcore-session-storage:{rsid}"));
        }
        for retained in &record.retained {
            let old = self.rsid(&record.id, retained.incarnation);
            status
                .storage_refs
                .push(format!("agentcore-session-storage:{old}"));
        }
        status
    }
}

/// The record of a closed session turned into its next incarnation: fresh storage, the same
/// (ever growing) generation, and the closed incarnation's storage kept if it was retained.
fn reincarnate(closed: SessionRecord, at: SystemTime) -> SessionRecord {
    let mut next = SessionRecord::new(closed.id, at);
    next.incarnation = closed.incarnation + 1;
    next.generation = closed.generation;
    next.retained = closed.retained;
    if let StorageState::Retained { until } = closed.storage {
        next.retained.push(RetainedStorage {
            incarnation: closed.incarnation,
            until,
        });
    }
    next
}

/// How long the session has gone without an attach, a renewal or a lifecycle change.
fn idle_for(record: &SessionRecord, at: SystemTime) -> Duration {
    at.duration_since(record.last_activity).unwrap_or_default()
}

fn renew_every(idle_ttl: Option<Duration>) -> Duration {
    idle_ttl
        .map_or(Duration::from_secs(300), |ttl| ttl / 4)
        .clamp(Duration::from_secs(1), Duration::from_secs(300))
}

/// Keeps the record's `last_activity` fresh while this process's attachment of `generation`
/// lives.
async fn renew_while_live(
    store: Arc<dyn RecordStore>,
    id: SessionId,
    generation: Generation,
    control: Arc<dyn WorkerControl>,
    fence: FenceTrigger,
    every: Duration,
) {
    loop {
        tokio::time::sleep(every).await;
        if fence.is_fenced() || !control.is_alive() {
            return;
        }
        let Ok(Some(stored)) = store.load(&id).await else {
            continue;
        };
        if stored.record.generation != generation || stored.record.state != SessionState::Running {
            return;
        }
        let mut next = stored.record;
        next.last_activity = now();
        if let Err(error) = store.store(&next, Some(stored.revision)).await {
            tracing::debug!(session = %id, %error, "renewing the record failed (the next renewal retries)");
        }
    }
}

#[async_trait]
impl SessionRuntime for AgentCoreRuntime {
    fn name(&self) -> &'static str {
        RUNTIME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal()
            .with_isolation(IsolationLevel::MicroVm)
            .with_persistent_storage(self.inner.config.session_storage)
            .with_survives_broker_restart(true)
            .with_max_lifetime(Some(self.inner.config.max_lifetime))
            .with_platform_idle_timeout(Some(self.inner.config.idle_timeout))
    }

    async fn create(&self, identity: &SessionIdentity, options: &CreateOptions) -> Result<SessionHandle> {
        if identity.installation() != self.inner.installation {
            return Err(Error::InvalidIdentity {
                part: "installation",
                problem: format!(
                    "names installation {:?}, but this runtime serves {:?}",
                    identity.installation(),
                    self.inner.installation
                ),
            });
        }
        // The relay's hello carries no working directory or environment (yet).
        SessionOverlay::refuse(options.overlay.as_ref(), RUNTIME)?;
        if options.workspace_seed.is_some() {
            return Err(Error::Unsupported {
                operation: "create with a workspace seed",
                runtime: RUNTIME,
            });
        }
        let id = identity.id();
        let lock = self.lock(&id);
        let _held = lock.lock().await;
        self.create_locked(id).await
    }

    async fn attach(&self, id: &SessionId) -> Result<Attachment> {
        let lock = self.lock(id);
        let _held = lock.lock().await;
        self.attach_locked(id).await
    }

    async fn suspend(&self, id: &SessionId, reason: SuspendReason) -> Result<()> {
        let lock = self.lock(id);
        let _held = lock.lock().await;
        self.suspend_locked(id, reason).await
    }

    async fn close(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let lock = self.lock(id);
        let _held = lock.lock().await;
        self.close_locked(id, reason).await
    }

    async fn status(&self, id: &SessionId) -> Result<SessionStatus> {
        Ok(self.status_of(&self.load_existing(id).await?.record))
    }

    async fn list(&self) -> Result<Vec<SessionStatus>> {
        let stored = self.inner.store.list().await.map_err(store_error)?;
        Ok(stored.iter().map(|s| self.status_of(&s.record)).collect())
    }

    async fn reconcile(&self) -> Result<ReconcileReport> {
        let stored = self.inner.store.list().await.map_err(store_error)?;
        let mut report = ReconcileReport::default();
        for entry in stored {
            let id = entry.record.id;
            let lock = self.lock(&id);
            let _held = lock.lock().await;
            if let Err(error) = self.reconcile_session(&id, &mut report).await {
                report.errors.push(format!("session {id}: {error}"));
            }
        }
        Ok(report)
    }
}

impl AgentCoreRuntime {
    async fn reconcile_session(&self, id: &SessionId, report: &mut ReconcileReport) -> Result<()> {
        let Some(stored) = self.load(id).await? else {
            return Ok(());
        };
        let record = stored.record;
        let at = now();
        match record.state {
            SessionState::Closing => {
                self.finish_close(id, &record).await?;
                report.finished_closes.push(*id);
            }
            SessionState::Suspended if !record.compute_released => {
                self.retire_live(id, record.generation, Duration::ZERO).await;
                if self.inner.config.stop_on_suspend {
                    self.release_compute(id, &record, true).await?;
                    report
                        .killed_workers
                        .push((*id, self.rsid(id, record.incarnation).to_string()));
                } else if idle_for(&record, at) >= self.inner.config.idle_timeout {
                    // Left to idle out, and AgentCore has reaped it by now: nothing to call.
                    self.mark_released(id, record.generation).await?;
                }
            }
            SessionState::Running => {
                let live = self
                    .inner
                    .live
                    .lock()
                    .get(id)
                    .is_some_and(|l| l.control.is_alive());
                if !live
                    && self
                        .inner
                        .idle_ttl
                        .is_some_and(|ttl| idle_for(&record, at) >= ttl)
                {
                    self.suspend_locked(id, SuspendReason::Idle).await?;
                    report.suspended_idle.push(*id);
                }
            }
            SessionState::Closed => {
                if let StorageState::Retained {
                    until: until @ RetainedUntil::Until(_),
                } = record.storage
                {
                    if until.has_passed(at) {
                        self.delete_storage(id, record.incarnation).await?;
                        let incarnation = record.incarnation;
                        self.update(id, |current| {
                            if current.incarnation != incarnation || current.state != SessionState::Closed {
                                return Ok(None);
                            }
                            let mut next = current.clone();
                            next.storage = StorageState::Deleted;
                            Ok(Some(next))
                        })
                        .await?;
                        report.expired_storage.push(*id);
                    }
                }
            }
            _ => {}
        }
        self.expire_retained(id, report).await?;
        self.expire_record(id, report).await
    }

    /// Deletes the retained storage of earlier incarnations whose retention ran out.
    async fn expire_retained(&self, id: &SessionId, report: &mut ReconcileReport) -> Result<()> {
        let Some(stored) = self.load(id).await? else {
            return Ok(());
        };
        let at = now();
        let due: Vec<u64> = stored
            .record
            .retained
            .iter()
            .filter(|r| r.until.has_passed(at))
            .map(|r| r.incarnation)
            .collect();
        for incarnation in due {
            self.delete_storage(id, incarnation).await?;
            self.update(id, |current| {
                let mut next = current.clone();
                next.retained.retain(|r| r.incarnation != incarnation);
                Ok((next.retained.len() != current.retained.len()).then_some(next))
            })
            .await?;
            report.expired_storage.push(*id);
        }
        Ok(())
    }

    /// Removes the record of a session closed long ago that holds no storage.
    async fn expire_record(&self, id: &SessionId, report: &mut ReconcileReport) -> Result<()> {
        let Some(stored) = self.load(id).await? else {
            return Ok(());
        };
        let record = &stored.record;
        let holds_nothing = record.storage == StorageState::Deleted && record.retained.is_empty();
        let closed_long_ago = record
            .closed_at
            .and_then(|at| now().duration_since(at).ok())
            .is_some_and(|age| age >= self.inner.closed_record_ttl);
        if record.state == SessionState::Closed && holds_nothing && closed_long_ago {
            match self.inner.store.remove(id, stored.revision).await {
                Ok(()) => report.expired_records.push(*id),
                Err(StoreError::Conflict) => {}
                Err(error) => return Err(store_error(error)),
            }
        }
        Ok(())
    }
}

#[cfg(feature = "testing")]
#[async_trait]
impl session_runtime::conformance::FaultInjector for AgentCoreRuntime {
    async fn record_suspended_keep_worker(&self, id: &SessionId) -> Result<()> {
        self.update(id, |record| {
            let mut next = record.clone();
            next.state = SessionState::Suspended;
            next.suspend_reason = Some(SuspendReason::Idle);
            next.worker_started_at = None;
            Ok(Some(next))
        })
        .await?;
        Ok(())
    }

    async fn record_closing(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        let retention = self.inner.retention.retained_until(reason, now());
        self.update(id, |record| {
            let mut next = record.clone();
            next.state = SessionState::Closing;
            next.close_reason = Some(reason);
            next.close_intent = Some(CloseIntent {
                retain_until: retention,
            });
            Ok(Some(next))
        })
        .await?;
        Ok(())
    }
}
