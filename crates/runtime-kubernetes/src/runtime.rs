//! [`KubernetesRuntime`]: the contract on a Kubernetes namespace.
//!
//! The anchor (an `OabSession`, see `anchor.rs`) holds the session record; every state change is a compare-and-swap on it, and
//! every side effect (a Pod, a claim, a delete) follows a record that says it should happen, so a
//! broker killed between the two leaves a record that the next call or `reconcile` finishes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use egress_proxy::gateway::GatewayKey;
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, Pod, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::api::{DeleteParams, DynamicObject, ListParams, PostParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use parking_lot::Mutex;
use session_runtime::config::{KubernetesConfig, Reach};
use session_runtime::telemetry::{self, StartKind};
use session_runtime::{
    Attachment, Capabilities, CloseReason, CreateOptions, Error, Fence, FenceTrigger, Generation,
    IsolationLevel, ReconcileReport, Result, Retention, RetentionPolicy, SessionHandle, SessionId,
    SessionIdentity, SessionOverlay, SessionRuntime, SessionState, SessionStatus, SuspendReason,
    WorkerControl, WorkspaceSeed,
};
use worker_relay::transport::{Connector, TcpConnector};
use worker_relay::{BrokerKey, ClientConfig, RelayClient};

use crate::abandon::{AttachInFlight, Before, CONNECT_TIMEOUT};
use crate::anchor::OabSession;
use crate::api::{api_error, is_status};
use crate::events::{SessionEvent, SessionEvents};
use crate::loss::Observed;
use crate::pod::{worker_pod, WorkerEgress, WorkerSpec};
use crate::profile::{Storage, WorkerProfile};
use crate::reach::ExecConnector;
use crate::record::{now, CloseRecord, Phase, SeedRecord, SessionRecord, Volume};
use crate::start::{progress, Progress};
use crate::{names, RUNTIME};

/// How often a Pod is looked at when it cannot be watched, and while a broker connects to it.
pub(crate) const POLL: Duration = Duration::from_millis(200);
/// The longest one watch of a starting or stopping Pod lasts before the Pod is read again (so a
/// slow change, like a scheduler's reason, is seen).
const WATCH_SLICE: Duration = Duration::from_secs(5);
/// How many times a lost compare-and-swap is retried before the call gives up (retryable).
pub(crate) const CAS_ATTEMPTS: usize = 8;
/// The shortest Pod deletion grace: zero would remove the Pod object at once, before the kubelet
/// has stopped its containers, so "gone" would no longer mean "stopped" and a new generation's
/// agent could start on the volume beside the old one.
pub(crate) const KILL_GRACE: u32 = 1;
/// How long a stop through the relay may take beyond the agent's grace.
const RELAY_STOP: Duration = Duration::from_secs(5);
/// How long a deleted worker Pod may take to go away before the call gives up (retryable).
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// One worker Pod and one volume per session, in one namespace; see the crate docs.
pub struct KubernetesRuntime {
    /// Made at build time from the given client, or on first use from the environment.
    apis: tokio::sync::OnceCell<Apis>,
    namespace: String,
    profile: String,
    reach: Reach,
    start_timeout: Duration,
    installation: String,
    retention: RetentionPolicy,
    pub(crate) housekeeping: Housekeeping,
    pub(crate) key: BrokerKey,
    /// Whether the key was given (so other brokers may hold it too): only then can this broker
    /// take over a worker another broker started.
    pub(crate) shared_key: bool,
    /// Which key binds the warm pool members this broker may claim (see `pool.rs`).
    pub(crate) pool_key: String,
    pub(crate) pool: Arc<crate::pool::PoolState>,
    epoch: u64,
    /// The egress gateway's key, for workers whose profile names a gateway.
    egress_gateway_key: Option<GatewayKey>,
    /// Serializes the operations of one session within this broker process; across brokers the
    /// anchor's compare-and-swap does.
    locks: Mutex<HashMap<SessionId, Arc<tokio::sync::Mutex<()>>>>,
    /// The live attachment of each session this process attached: stopped and fenced by the
    /// next attach, suspend or close.
    live: Mutex<HashMap<SessionId, Live>>,
    /// The profile versions whose egress policy this process applied (`name@version`).
    egress_applied: Mutex<std::collections::HashSet<String>>,
    /// Tells live attachments that their worker Pod is gone; started by the first attach.
    workers: std::sync::OnceLock<crate::loss::WorkerWatch>,
    /// Each session's anchor as this process last read or wrote it.
    anchors_seen: crate::recall::AnchorMemory,
    /// The profile as this process's watch of it sees it; started by the first read.
    profile_watch: std::sync::OnceLock<crate::profile_watch::ProfileWatch>,
}

impl std::fmt::Debug for KubernetesRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesRuntime")
            .field("profile", &self.profile)
            .field("reach", &self.reach)
            .field("installation", &self.installation)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

/// The `reportingInstance` of a runtime's Events: its installation and epoch.
fn events_instance(installation: &str, epoch: u64) -> String {
    format!("{installation}-{epoch}")
}

/// The namespace's API handles this runtime uses.
struct Apis {
    jobs: Api<k8s_openapi::api::batch::v1::Job>,
    anchors: Api<OabSession>,
    policies: Api<k8s_openapi::api::networking::v1::NetworkPolicy>,
    pods: Api<Pod>,
    claims: Api<PersistentVolumeClaim>,
    profiles: Api<DynamicObject>,
    service_accounts: Api<k8s_openapi::api::core::v1::ServiceAccount>,
    events: SessionEvents,
    /// What the kubelet said of the namespace's objects (read only when a start times out).
    reported: Api<k8s_openapi::api::events::v1::Event>,
}

impl Apis {
    /// The handles of `namespace`; Events reported as `instance`.
    fn new(client: Client, namespace: &str, instance: String) -> Apis {
        Apis {
            events: SessionEvents::new(client.clone(), namespace, instance),
            jobs: Api::namespaced(client.clone(), namespace),
            anchors: Api::namespaced(client.clone(), namespace),
            policies: Api::namespaced(client.clone(), namespace),
            pods: Api::namespaced(client.clone(), namespace),
            claims: Api::namespaced(client.clone(), namespace),
            service_accounts: Api::namespaced(client.clone(), namespace),
            reported: Api::namespaced(client.clone(), namespace),
            profiles: Api::namespaced_with(client, namespace, &WorkerProfile::resource()),
        }
    }
}

/// The kubelet's Event reason when it cannot make a Pod's sandbox.
const SANDBOX_FAILED: &str = "FailedCreatePodSandBox";

/// Builds a [`KubernetesRuntime`].
pub struct KubernetesRuntimeBuilder {
    /// `None`: inferred on first use (`KUBECONFIG`, `~/.kube/config`, or the in-cluster account).
    client: Option<Client>,
    config: KubernetesConfig,
    installation: String,
    retention: RetentionPolicy,
    housekeeping: Housekeeping,
    key: Option<BrokerKey>,
    epoch: Option<u64>,
    egress_gateway_key: Option<GatewayKey>,
}

/// What `reconcile` does with time: when a worker counts as idle, when a closed record goes,
/// whether storage no record names is deleted.
#[derive(Debug, Clone)]
pub(crate) struct Housekeeping {
    /// `None`: never suspended for idleness.
    pub(crate) idle_ttl: Option<Duration>,
    pub(crate) closed_record_ttl: Duration,
    pub(crate) delete_orphaned_storage: bool,
    pub(crate) orphan_grace: Duration,
    /// How long an attachment keeps reconnecting to a relay that went away; `None`: the relay
    /// client's default (30 s).
    pub(crate) reconnect_budget: Option<Duration>,
}

impl Default for Housekeeping {
    fn default() -> Self {
        Housekeeping {
            idle_ttl: Some(Duration::from_secs(30 * 60)),
            closed_record_ttl: Duration::from_secs(7 * 24 * 3600),
            delete_orphaned_storage: false,
            orphan_grace: Duration::from_secs(60),
            reconnect_budget: None,
        }
    }
}

impl std::fmt::Debug for KubernetesRuntimeBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesRuntimeBuilder")
            .field("config", &self.config)
            .field("installation", &self.installation)
            .finish_non_exhaustive()
    }
}

impl KubernetesRuntimeBuilder {
    /// The client to use instead of one inferred on first use.
    pub fn client(mut self, client: Client) -> Self {
        self.client = Some(client);
        self
    }

    /// The installation whose sessions this runtime serves (default `openab`).
    pub fn installation(mut self, installation: impl Into<String>) -> Self {
        self.installation = installation.into();
        self
    }

    /// The retention policy by close reason; a profile may override it.
    pub fn retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }

    /// How long a running worker may go without a broker holding its attachment before
    /// `reconcile` suspends it (`suspend(Idle)`); `None`: never. A profile's `idle_ttl` overrides
    /// it. Default 30 minutes, the `[session_runtime] idle_ttl` default. A broker renews the anchor while it holds
    /// a live attachment, so this catches workers whose broker went away; an attachment a broker
    /// holds but does not use is the broker's own idle eviction.
    pub fn idle_ttl(mut self, ttl: impl Into<Option<Duration>>) -> Self {
        self.housekeeping.idle_ttl = ttl.into();
        self
    }

    /// How long the record of a closed session stays once nothing of the session is left (its
    /// storage deleted, no retained claims): default 7 days. Until then `status` answers for it
    /// and a re-created session continues its generations.
    pub fn closed_record_ttl(mut self, ttl: Duration) -> Self {
        self.housekeeping.closed_record_ttl = ttl;
        self
    }

    /// Whether `reconcile` deletes claims of this installation that no session record names
    /// (default `false`: it reports them in [`ReconcileReport::orphaned_storage`] and leaves them).
    pub fn delete_orphaned_storage(mut self, delete: bool) -> Self {
        self.housekeeping.delete_orphaned_storage = delete;
        self
    }

    /// How old a worker Pod or claim without a record must be before `reconcile` treats it as
    /// orphaned (default 60 seconds): younger ones may belong to a create in flight on another
    /// broker, whose record the pass did not see yet.
    pub fn orphan_grace(mut self, grace: Duration) -> Self {
        self.housekeeping.orphan_grace = grace;
        self
    }

    /// How long an attachment keeps reconnecting to its worker's relay after the connection
    /// broke before it ends with an error (default 30 s). A worker whose Pod was deleted or failed
    /// ends its attachment at once (the broker watches its worker Pods); one whose node merely
    /// stopped answering, this late. Either way the next `attach` replaces it.
    pub fn relay_reconnect_budget(mut self, budget: Duration) -> Self {
        self.housekeeping.reconnect_budget = Some(budget);
        self
    }

    /// The broker's secret for relay tokens. Brokers that must re-attach to each other's workers
    /// (a restart, a handover) share it: with a shared key, an attach of a session whose worker
    /// another, older broker attached takes that worker over (same generation, the agent's
    /// unacknowledged output replayed) instead of replacing it. Default: a random key for this
    /// process, and every attach from this process starts a new worker when none of its own runs.
    pub fn broker_key(mut self, key: BrokerKey) -> Self {
        self.key = Some(key);
        self
    }

    /// The egress gateway's key, from which each session's proxy credential is derived (see
    /// `oab-egress-gateway`); needed when the profile names an `egress_gateway`. Default: none,
    /// and an attach under such a profile fails naming the missing key.
    pub fn egress_gateway_key(mut self, key: GatewayKey) -> Self {
        self.egress_gateway_key = Some(key);
        self
    }

    /// The broker epoch the relay checks (a newer epoch takes a relay over from an older one);
    /// default: milliseconds since the Unix epoch at build time, so a restarted broker is newer.
    /// A relay refuses an epoch more than a minute ahead of its clock
    /// ([`EPOCH_LEEWAY`](worker_relay::server::EPOCH_LEEWAY)): use a clock reading or a counter
    /// (such as a lease's transitions), never an arbitrary large number.
    pub fn epoch(mut self, epoch: u64) -> Self {
        self.epoch = Some(epoch);
        self
    }

    /// The runtime.
    ///
    /// # Errors
    /// [`Error::Backend`] if no random broker key could be made.
    pub fn build(self) -> Result<KubernetesRuntime> {
        let namespace = self.config.namespace.as_str();
        let shared_key = self.key.is_some();
        let key = match self.key {
            Some(key) => key,
            None => random_key()?,
        };
        let epoch = self.epoch.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |elapsed| {
                    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
                })
        });
        let apis = match self.client {
            Some(client) => tokio::sync::OnceCell::new_with(Some(Apis::new(
                client,
                namespace,
                events_instance(&self.installation, epoch),
            ))),
            None => tokio::sync::OnceCell::new(),
        };
        Ok(KubernetesRuntime {
            apis,
            namespace: namespace.to_owned(),
            profile: self.config.profile,
            reach: self.config.reach,
            start_timeout: self.config.start_timeout,
            installation: self.installation,
            retention: self.retention,
            housekeeping: self.housekeeping,
            pool_key: crate::pool::key_label(&key),
            pool: Arc::default(),
            key,
            shared_key,
            epoch,
            egress_gateway_key: self.egress_gateway_key,
            locks: Mutex::new(HashMap::new()),
            live: Mutex::new(HashMap::new()),
            egress_applied: Mutex::new(std::collections::HashSet::new()),
            workers: std::sync::OnceLock::new(),
            anchors_seen: crate::recall::AnchorMemory::default(),
            profile_watch: std::sync::OnceLock::new(),
        })
    }
}

fn random_key() -> Result<BrokerKey> {
    let bytes: [u8; 32] = random_bytes("the broker key", false)?;
    Ok(BrokerKey::new(bytes.to_vec()))
}

/// `N` bytes from the kernel's random source, for `what` (named in the error).
pub(crate) fn random_bytes<const N: usize>(what: &str, retryable: bool) -> Result<[u8; N]> {
    use std::io::Read;
    let mut bytes = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut random| random.read_exact(&mut bytes))
        .map_err(|error| Error::backend(RUNTIME, retryable, format!("no randomness for {what}"), error))?;
    Ok(bytes)
}

/// What this process holds of a session's live attachment.
struct Live {
    fence: FenceTrigger,
    control: Arc<dyn WorkerControl>,
    /// Renews the anchor while the attachment lives, so `reconcile` does not count it idle.
    renewal: tokio::task::AbortHandle,
    /// The stop grace of the profile the worker was started with.
    termination_grace: Duration,
}

impl Drop for Live {
    fn drop(&mut self) {
        self.renewal.abort();
    }
}

/// How often a live attachment renews its anchor: four times per idle TTL, at most every five
/// minutes and at most once a second, so a pass that reads the anchor never sees a live
/// attachment as idle.
fn renew_every(idle_ttl: Option<Duration>) -> Duration {
    idle_ttl.map_or(Duration::from_secs(300), |ttl| {
        (ttl / 4).clamp(Duration::from_secs(1), Duration::from_secs(300))
    })
}

/// How [`KubernetesRuntime::retire_previous`] went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub(crate) enum Retired {
    /// This process had no live attachment of the session.
    NotHere,
    /// The relay reported the agent's exit.
    Stopped,
    /// The relay did not answer in time.
    Unanswered,
}

/// What a watch of the worker Pod saw.
enum Watched {
    /// The condition was met: by the Pod as it then was, or by its absence.
    Met(Option<Box<Pod>>),
    /// Not within the time given, or the watch failed.
    Unknown,
}

/// The worker an attach that picked a warm pool member got.
enum Warm {
    /// The member, claimed and bound.
    Claimed(Pod),
    /// Another broker claimed it first (or it went): the cold worker started instead, and the
    /// anchor and record that name it.
    Cold(Pod, Box<(OabSession, SessionRecord)>),
}

/// Why a compare-and-swap did not land.
pub(crate) enum Swap {
    /// Someone else changed the anchor first; read it again.
    Lost,
    /// The call failed.
    Failed(Error),
}

/// Writes `record` as the anchor's status, only if the anchor is still the one read.
pub(crate) async fn swap_anchor(
    anchors: &Api<OabSession>,
    anchor: &OabSession,
    record: &SessionRecord,
) -> std::result::Result<OabSession, Swap> {
    let next = anchor.with_record(record, &jiff_now().to_string());
    match anchors
        .replace_status(&anchor.name_any(), &PostParams::default(), &next)
        .await
    {
        Ok(written) => Ok(written),
        // 404: the anchor was removed meanwhile (an expired closed record); a fresh read says so.
        Err(error) if is_status(&error, 409) || is_status(&error, 404) => Err(Swap::Lost),
        Err(error) => Err(Swap::Failed(api_error(
            &format!("updating session {}", record.id),
            error,
        ))),
    }
}

impl KubernetesRuntime {
    /// A builder for the runtime a `[session_runtime]` section with `type = "kubernetes"`
    /// describes: its `[session_runtime.kubernetes]` table, `installation`, `idle_ttl` and
    /// `retention`. The client is inferred on first use, as `kubectl` does: `KUBECONFIG`, else
    /// `~/.kube/config`, else the Pod's service account.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `session_runtime.kubernetes` when the table is missing, or
    /// the key that failed the section's validation.
    pub fn builder_from_config(
        config: &session_runtime::config::SessionRuntimeConfig,
    ) -> Result<KubernetesRuntimeBuilder> {
        config.validate()?;
        let kubernetes = config.kubernetes.clone().ok_or_else(|| Error::InvalidConfig {
            key: "session_runtime.kubernetes".into(),
            reason:
                "the Kubernetes runtime needs a [session_runtime.kubernetes] table with namespace and profile"
                    .into(),
        })?;
        let egress_gateway_key = kubernetes
            .egress_gateway_key_file
            .as_deref()
            .map(|path| {
                GatewayKey::read(path).map_err(|reason| Error::InvalidConfig {
                    key: "session_runtime.kubernetes.egress_gateway_key_file".into(),
                    reason,
                })
            })
            .transpose()?;
        let mut builder = KubernetesRuntimeBuilder {
            client: None,
            config: kubernetes,
            installation: config.installation.clone(),
            retention: config.retention.clone(),
            housekeeping: Housekeeping::default(),
            key: None,
            epoch: None,
            egress_gateway_key,
        };
        builder.housekeeping.idle_ttl = config.effective_idle_ttl();
        Ok(builder)
    }

    /// A builder for a runtime that uses `client` (whose identity needs only the deploy files'
    /// broker Role) with `config`'s namespace, profile, reach and start timeout.
    pub fn builder(client: Client, config: KubernetesConfig) -> KubernetesRuntimeBuilder {
        KubernetesRuntimeBuilder {
            client: Some(client),
            config,
            installation: "openab".to_owned(),
            retention: RetentionPolicy::default(),
            housekeeping: Housekeeping::default(),
            key: None,
            epoch: None,
            egress_gateway_key: None,
        }
    }

    /// What session `id`'s worker under `profile` is given to reach the egress gateway, with
    /// the session's own credential, when the profile names one.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming `egress_gateway_key_file` when the profile names a gateway
    /// and this runtime has no key for it.
    pub(crate) fn worker_egress(
        &self,
        id: &SessionId,
        profile: &WorkerProfile,
    ) -> Result<Option<WorkerEgress>> {
        let Some(gateway) = &profile.egress_gateway else {
            return Ok(None);
        };
        let key = self
            .egress_gateway_key
            .as_ref()
            .ok_or_else(|| Error::InvalidConfig {
                key: "session_runtime.kubernetes.egress_gateway_key_file".into(),
                reason: format!(
                    "profile {} names an egress gateway ({}); the broker needs the gateway's key to give \
                 each worker its proxy credential",
                    profile.name(),
                    gateway.authority()
                ),
            })?;
        Ok(Some(WorkerEgress::new(
            profile,
            &key.credential(*id, profile.name()),
            gateway,
        )))
    }

    pub(crate) fn lock(&self, id: &SessionId) -> Arc<tokio::sync::Mutex<()>> {
        Arc::clone(self.locks.lock().entry(*id).or_default())
    }

    /// Stops the agent of this process's live attachment through its relay (so that attachment
    /// learns how it ended) and fences it on behalf of `generation`. The Pod is deleted after
    /// this either way; the relay stop is what lets the old attachment report its exit.
    ///
    /// Returns [`Retired::Unanswered`] when the relay did not report the agent's exit within
    /// `grace` and the relay's own stop time: a frozen worker, which is then not given its grace
    /// a second time.
    pub(crate) async fn retire_previous(
        &self,
        id: &SessionId,
        generation: Generation,
        grace: Duration,
    ) -> Retired {
        let Some(live) = self.live.lock().remove(id) else {
            return Retired::NotHere;
        };
        let stopped = if grace.is_zero() {
            tokio::time::timeout(RELAY_STOP, live.control.kill()).await
        } else {
            tokio::time::timeout(grace + RELAY_STOP, live.control.terminate(grace)).await
        };
        live.fence.fence(generation);
        if matches!(stopped, Ok(Ok(_))) {
            Retired::Stopped
        } else {
            tracing::debug!(session = %id, "the previous worker did not report its exit through the relay");
            Retired::Unanswered
        }
    }

    /// The session's anchor, if it has one, and its record once the create wrote one. An object
    /// under the anchor's name that is not the session's own is refused, never adopted.
    pub(crate) async fn load_anchor(
        &self,
        id: &SessionId,
    ) -> Result<Option<(OabSession, Option<SessionRecord>)>> {
        let name = names::anchor(id);
        let Some(anchor) = self
            .anchor_api()
            .await?
            .get_opt(&name)
            .await
            .map_err(|e| api_error(&format!("reading session {id}"), e))?
        else {
            self.anchors_seen.forget(id);
            return Ok(None);
        };
        if !names::belongs_to(&anchor.metadata, id) {
            return Err(foreign(id, "anchor", &name));
        }
        self.apis().await?.events.learn_anchor(id, anchor.uid());
        let record = anchor.record(id)?;
        self.anchors_seen.remember(id, &anchor);
        Ok(Some((anchor, record)))
    }

    /// The session's anchor and record, if it has one. An anchor an operator deleted is
    /// returned too: its session is being closed, and only a close may still change it.
    pub(crate) async fn load(&self, id: &SessionId) -> Result<Option<(OabSession, SessionRecord)>> {
        match self.load_anchor(id).await? {
            None => Ok(None),
            Some((anchor, Some(record))) => Ok(Some((anchor, record))),
            Some((_, None)) => Err(retry_later(
                id,
                "the session's create has recorded nothing yet; create it again",
            )),
        }
    }

    async fn load_existing(&self, id: &SessionId) -> Result<(OabSession, SessionRecord)> {
        self.load(id).await?.ok_or(Error::NotFound { id: *id })
    }

    /// The session's anchor and record as this process last read or wrote them, if it
    /// remembers them (see `recall.rs`): possibly stale, so only for a compare-and-swap.
    fn recall(&self, id: &SessionId) -> Option<(OabSession, SessionRecord)> {
        let anchor = self.anchors_seen.recall(id)?;
        match anchor.record(id) {
            Ok(Some(record)) => Some((anchor, record)),
            _ => None,
        }
    }

    /// Writes `record` over the anchor, only if the anchor is still the one read.
    pub(crate) async fn swap(
        &self,
        anchor: &OabSession,
        record: &SessionRecord,
    ) -> std::result::Result<OabSession, Swap> {
        let swapped = swap_anchor(self.anchor_api().await.map_err(Swap::Failed)?, anchor, record).await;
        match &swapped {
            Ok(_) if record.state() == SessionState::Closed => self.anchors_seen.forget(&record.id),
            Ok(written) => self.anchors_seen.remember(&record.id, written),
            Err(_) => self.anchors_seen.forget(&record.id),
        }
        swapped
    }

    /// Reads the record (as this process last saw it, if it remembers it), lets `change` decide
    /// the next one, and swaps it in; retries a lost race with a fresh read. `change` returns
    /// `Ok(None)` when there is nothing to write.
    pub(crate) async fn update<F>(&self, id: &SessionId, change: F) -> Result<(OabSession, SessionRecord)>
    where
        F: FnMut(&SessionRecord) -> Result<Option<SessionRecord>> + Send,
    {
        self.update_from(id, self.recall(id), change).await
    }

    /// [`update`](Self::update), starting from `read` (the anchor and record the caller read
    /// last, or remembered) instead of reading it again. Since `read` may be stale, only a swap
    /// may act on it: if it is stale the swap is lost and the next attempt reads afresh, and a
    /// refusal (`change` returns an error) or nothing to write is decided again on a fresh
    /// read. So this saves a request and gives up nothing.
    pub(crate) async fn update_from<F>(
        &self,
        id: &SessionId,
        mut read: Option<(OabSession, SessionRecord)>,
        mut change: F,
    ) -> Result<(OabSession, SessionRecord)>
    where
        F: FnMut(&SessionRecord) -> Result<Option<SessionRecord>> + Send,
    {
        for _ in 0..CAS_ATTEMPTS {
            let (given, (anchor, record)) = match read.take() {
                Some(read) => (true, read),
                None => (false, self.load_existing(id).await?),
            };
            let next = match change(&record) {
                Ok(Some(next)) => next,
                _ if given => continue,
                Ok(None) => return Ok((anchor, record)),
                Err(error) => return Err(error),
            };
            match self.swap(&anchor, &next).await {
                Ok(written) => return Ok((written, next)),
                Err(Swap::Lost) => continue,
                Err(Swap::Failed(error)) => return Err(error),
            }
        }
        Err(Error::Backend {
            runtime: RUNTIME,
            retryable: true,
            message: format!("session {id}: the anchor kept changing under {CAS_ATTEMPTS} attempts"),
            source: None,
        })
    }

    /// The worker profile, as this process's watch of it sees it (see `profile_watch.rs`); read
    /// when the watch cannot vouch for it, or says there is none.
    pub(crate) async fn profile(&self) -> Result<WorkerProfile> {
        let profiles = self.profiles().await?;
        let watch = self
            .profile_watch
            .get_or_init(|| crate::profile_watch::ProfileWatch::new(profiles.clone(), &self.profile));
        match watch.current() {
            Some(Some(object)) => WorkerProfile::from_resource(&object),
            _ => self.read_profile().await,
        }
    }

    /// The worker profile, read from the API server: for what decides to remove something.
    pub(crate) async fn read_profile(&self) -> Result<WorkerProfile> {
        let object = self
            .profiles()
            .await?
            .get_opt(&self.profile)
            .await
            .map_err(|e| api_error(&format!("reading the worker profile {}", self.profile), e))?;
        let object = object.ok_or_else(|| Error::InvalidConfig {
            key: format!("profile/{}", self.profile),
            reason: format!(
                "no OabProfile {} in the sessions namespace; an administrator creates it (see deploy/kubernetes/profile-example.yaml)",
                self.profile
            ),
        })?;
        WorkerProfile::from_resource(&object)
    }

    /// Makes the session's volume, per the profile, and records it; then the session is created.
    pub(crate) async fn provision(
        &self,
        id: &SessionId,
        mut anchor: OabSession,
        mut record: SessionRecord,
    ) -> Result<SessionRecord> {
        let profile = self.profile().await?;
        // The claim's name goes on the record before the claim exists, so that a crash between
        // the two leaves a record that names it: a close then finds and deletes it.
        if let Storage::PerSession { .. } = &profile.storage {
            let claim = names::storage(id, record.incarnation);
            if record.volume.claim() != Some(claim.as_str()) {
                record.volume = Volume::Owned { claim, uid: None };
                anchor = match self.swap(&anchor, &record).await {
                    Ok(written) => written,
                    Err(Swap::Lost) => {
                        return Err(retry_later(
                            id,
                            "the session changed while it was provisioned; create it again",
                        ))
                    }
                    Err(Swap::Failed(error)) => return Err(error),
                };
            }
        }
        record.volume = match &profile.storage {
            Storage::Ephemeral { .. } => Volume::Ephemeral,
            Storage::Borrowed { claim } => Volume::Borrowed { claim: claim.clone() },
            Storage::PerSession {
                class,
                size,
                access_mode,
            } => {
                let name = names::storage(id, record.incarnation);
                let claim = PersistentVolumeClaim {
                    metadata: names::meta(name.clone(), &self.installation, id, "storage"),
                    spec: Some(PersistentVolumeClaimSpec {
                        access_modes: Some(vec![access_mode.as_str().to_owned()]),
                        storage_class_name: class.clone(),
                        resources: Some(VolumeResourceRequirements {
                            requests: Some([("storage".to_owned(), Quantity(size.clone()))].into()),
                            ..VolumeResourceRequirements::default()
                        }),
                        ..PersistentVolumeClaimSpec::default()
                    }),
                    status: None,
                };
                let created = match self.claims().await?.create(&PostParams::default(), &claim).await {
                    Ok(created) => created,
                    // A retried create finds its own claim; anything else under the name is foreign.
                    Err(error) if is_status(&error, 409) => {
                        let found = self
                            .claims()
                            .await?
                            .get(&name)
                            .await
                            .map_err(|e| api_error(&format!("reading claim {name}"), e))?;
                        if !names::belongs_to(&found.metadata, id) {
                            return Err(foreign(id, "claim", &name));
                        }
                        if found.metadata.deletion_timestamp.is_some() {
                            // An expired volume of the same name on its way out: never adopted.
                            return Err(retry_later(
                                id,
                                &format!("the claim {name} is still being deleted"),
                            ));
                        }
                        found
                    }
                    Err(error) => return Err(api_error(&format!("creating claim {name}"), error)),
                };
                Volume::Owned {
                    claim: name,
                    uid: created.uid(),
                }
            }
        };
        // The session's own identity, before anything runs as it (a new record's first made it).
        if !record.service_account {
            record.service_account_uid = self
                .ensure_service_account(id, record.incarnation, &anchor.uid().unwrap_or_default())
                .await?;
            record.service_account = true;
        }
        if record.seed.is_some() || profile.home_template.is_some() {
            self.seed(id, &anchor, &record, &profile).await?;
            record.seed = None;
            // The Job made both directories, as the worker's user.
            record.prepared = record.volume.claim().is_some();
        }
        record.phase = Phase::Session(SessionState::Created);
        match self.swap(&anchor, &record).await {
            Ok(_) => Ok(record),
            Err(Swap::Lost) => Err(Error::Backend {
                runtime: RUNTIME,
                retryable: true,
                message: format!("session {id} changed while it was provisioned; create it again"),
                source: None,
            }),
            Err(Swap::Failed(error)) => Err(error),
        }
    }

    /// The worker Pod `name` (see [`SessionRecord::worker_pod`]), if one is there and it is the
    /// session's. Under the session's own worker name another object is foreign; a warm pool
    /// member the record names is the session's only once the claim relabelled it, and until
    /// then (or if another session won it) it is simply not this session's worker.
    pub(crate) async fn worker(&self, id: &SessionId, name: &str) -> Result<Option<Pod>> {
        let pod = self
            .pods()
            .await?
            .get_opt(name)
            .await
            .map_err(|e| api_error(&format!("reading worker {name}"), e))?;
        match pod {
            Some(pod) if !names::belongs_to(&pod.metadata, id) => {
                if name == names::worker(id) {
                    Err(foreign(id, "worker Pod", name))
                } else {
                    Ok(None)
                }
            }
            other => Ok(other),
        }
    }

    /// Deletes the session's worker Pods up to `generation` (each that exact Pod: UID
    /// precondition) and waits until they are gone. A Pod newer than `generation` is left alone:
    /// it is a later attach's, which this call's record predates. Found by the session's label,
    /// not a name (a record that no longer has a worker does not say whether its last one was
    /// started cold, `oab-w-<id>`, or a claimed pool member), as the broker's watch of its
    /// workers sees them, and `served`, the worker (name and UID) the record named last, even if
    /// the watch has not seen it. A Pod another broker started a moment ago that the watch has
    /// not seen yet is that broker's to stop: it finds the session changed when it records it.
    pub(crate) async fn stop_worker(
        &self,
        id: &SessionId,
        generation: Generation,
        grace: Option<u32>,
        served: Option<(String, String)>,
    ) -> Result<bool> {
        let mut pods = self.workers_of(id).await?;
        if let Some((name, uid)) = served {
            if !pods.iter().any(|pod| pod.uid().as_deref() == Some(uid.as_str())) {
                pods.push(Pod {
                    metadata: kube::api::ObjectMeta {
                        name: Some(name),
                        uid: Some(uid),
                        ..kube::api::ObjectMeta::default()
                    },
                    ..Pod::default()
                });
            }
        }
        let mut stopped = false;
        for pod in pods {
            if names::pod_generation(&pod.metadata).is_some_and(|theirs| theirs > generation) {
                continue;
            }
            self.delete_pod(&pod, grace).await?;
            self.await_gone(id, &pod).await?;
            stopped = true;
        }
        Ok(stopped)
    }

    /// The session's worker Pods, by its label (whatever their names), that are the session's:
    /// as the broker's watch of its workers sees them, else (until it has listed them) listed.
    async fn workers_of(&self, id: &SessionId) -> Result<Vec<Pod>> {
        let ours = |pod: &Pod| {
            let labels = pod.labels();
            labels.get(names::SESSION).map(String::as_str) == Some(id.as_str())
                && labels.get(names::ROLE).map(String::as_str) == Some("worker")
                && names::belongs_to(&pod.metadata, id)
        };
        if let Some(watched) = self.worker_watch().await?.pods_where(ours) {
            return Ok(watched);
        }
        let selector = format!("{}={id},{}=worker", names::SESSION, names::ROLE);
        let listed = self
            .pods()
            .await?
            .list(&kube::api::ListParams::default().labels(&selector))
            .await
            .map_err(|e| api_error(&format!("listing the worker Pods of session {id}"), e))?;
        Ok(listed.items.into_iter().filter(ours).collect())
    }

    pub(crate) async fn delete_pod(&self, pod: &Pod, grace: Option<u32>) -> Result<()> {
        let name = pod.name_any();
        let params = DeleteParams {
            grace_period_seconds: grace,
            preconditions: Some(Preconditions {
                uid: pod.uid(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.pods().await?.delete(&name, &params).await {
            Ok(_) => Ok(()),
            // Gone already, or replaced by another Pod of the same name (which is not this call's).
            Err(error) if is_status(&error, 404) || is_status(&error, 409) => Ok(()),
            Err(error) => Err(api_error(&format!("deleting worker {name}"), error)),
        }
    }

    /// Waits until the Pod `pod` is gone. A Pod of the same name with another UID counts as gone:
    /// it is a newer worker another broker started meanwhile, not the one deleted.
    async fn await_gone(&self, id: &SessionId, pod: &Pod) -> Result<()> {
        let deadline = tokio::time::Instant::now() + STOP_TIMEOUT;
        let uid = pod.uid().unwrap_or_default();
        let name = pod.name_any();
        loop {
            // The watch's list says at once if it is gone already.
            let now = tokio::time::Instant::now();
            let gone = |observed: &Observed| match observed {
                Observed::Pod(current) => current.uid().as_deref() != Some(uid.as_str()),
                Observed::Absent { deleted } => *deleted,
            };
            if let Watched::Met(_) = self.watch_worker(&name, &uid, deadline - now, gone).await {
                return Ok(());
            }
            // Not within the slice, or the watch failed: a read says.
            match self.worker(id, &name).await? {
                Some(current) if current.uid() == pod.uid() => {}
                _ => return Ok(()),
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Backend {
                    runtime: RUNTIME,
                    retryable: true,
                    message: format!("worker {name} did not go away within {STOP_TIMEOUT:?}"),
                    source: None,
                });
            }
        }
    }

    /// Waits until `done` holds for the worker Pod as the broker's shared watch of its workers
    /// sees it (asked about by `uid`: see [`Observed::Absent`]), at most `limit` and one watch
    /// slice, so waiting costs no request. Until that watch has listed its Pods once, it waits
    /// one poll interval at most and says nothing: the caller reads the Pod itself.
    async fn watch_worker(
        &self,
        name: &str,
        uid: &str,
        limit: Duration,
        done: impl Fn(&Observed) -> bool,
    ) -> Watched {
        let limit = limit.min(WATCH_SLICE);
        let began = tokio::time::Instant::now();
        let Ok(watch) = self.worker_watch().await else {
            tokio::time::sleep(POLL.min(limit)).await;
            return Watched::Unknown;
        };
        let mut changes = watch.changes();
        loop {
            changes.borrow_and_update();
            let until = match watch.observe(name, uid) {
                Some(observed) if done(&observed) => {
                    return Watched::Met(match observed {
                        Observed::Pod(pod) => Some(pod),
                        Observed::Absent { .. } => None,
                    })
                }
                Some(_) => began + limit,
                None => began + POLL.min(limit),
            };
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, changes.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => return Watched::Unknown,
            }
        }
    }

    /// Starts the worker of `generation` and waits until its relay is ready.
    async fn start_worker(
        &self,
        id: &SessionId,
        anchor: &OabSession,
        record: &SessionRecord,
        profile: &WorkerProfile,
    ) -> Result<Pod> {
        let generation = record.generation;
        let anchor_uid = anchor.uid().unwrap_or_default();
        let token_hash = self.key.token(id.as_str(), generation).hash();
        if !record.service_account {
            // A session provisioned before sessions had identities of their own.
            self.ensure_service_account(id, record.incarnation, &anchor_uid)
                .await?;
        }
        let egress = self.worker_egress(id, profile)?;
        let pod = worker_pod(
            profile,
            &WorkerSpec {
                id,
                installation: &self.installation,
                generation,
                incarnation: record.incarnation,
                token_hash: &token_hash,
                anchor_uid: &anchor_uid,
                claim: record.volume.claim(),
                prepare: !(record.prepared && record.volume.claim().is_some()),
                egress: egress.as_ref(),
            },
        );
        self.apply_egress(profile).await?;
        // One worker per session, ever: an older generation's Pod goes first; a newer one means
        // this attach lost; our own (a retry) is adopted, but only if it is this anchor's and
        // not on its way out: a record deleted and made again restarts its numbers, and the Pod
        // of the old record's generation is not this one's. Another broker may put an older Pod
        // back between our delete and our create, so this repeats.
        let mut adopted = false;
        // What is known of the Pod without reading it: the created one as the API server
        // returned it, or one a watch saw meet its condition.
        let mut seen: Option<Pod> = None;
        for attempt in 0..CAS_ATTEMPTS {
            // The first attempt creates at once: a suspended session's worker is gone (suspend
            // waits for that), so a Pod in the way is the exception, which the conflict shows.
            let previous = match attempt {
                0 => None,
                _ => self.worker(id, &names::worker(id)).await?,
            };
            if let Some(previous) = previous {
                let ours = previous.metadata.deletion_timestamp.is_none()
                    && previous
                        .owner_references()
                        .iter()
                        .any(|owner| owner.uid == anchor_uid);
                match names::pod_generation(&previous.metadata) {
                    Some(theirs) if theirs > generation && ours => {
                        return Err(fenced(id, generation, theirs))
                    }
                    Some(theirs) if theirs == generation && ours => {
                        adopted = true;
                        break;
                    }
                    _ => {
                        self.delete_pod(&previous, Some(KILL_GRACE)).await?;
                        self.await_gone(id, &previous).await?;
                    }
                }
            }
            match self.pods().await?.create(&PostParams::default(), &pod).await {
                Ok(created) => {
                    seen = Some(created);
                    adopted = true;
                    break;
                }
                Err(error) if is_status(&error, 409) => continue,
                // RBAC refusing the broker is an operator's problem, not the profile's.
                Err(error)
                    if is_status(&error, 403) && error.to_string().contains("cannot create resource") =>
                {
                    return Err(api_error(
                        &format!("creating worker {}", names::worker(id)),
                        error,
                    ))
                }
                Err(error) if is_status(&error, 403) || is_status(&error, 422) => {
                    // Admission refused the Pod (Pod Security, a missing RuntimeClass, a quota):
                    // the profile asks for something this namespace does not allow.
                    return Err(Error::WorkerFailed {
                        id: *id,
                        cause: session_runtime::WorkerFailure::Spawn(format!(
                            "the worker Pod was refused: {error}"
                        )),
                    });
                }
                Err(error) => {
                    return Err(api_error(
                        &format!("creating worker {}", names::worker(id)),
                        error,
                    ))
                }
            }
        }
        if !adopted {
            return Err(retry_later(id, "worker Pods of other generations kept appearing"));
        }
        let began = tokio::time::Instant::now();
        let deadline = began + self.start_timeout;
        // The scheduler may be waiting for a node an autoscaler adds: the profile says how long
        // that may take, within the start timeout.
        let placement_deadline = began + profile.unschedulable_timeout.unwrap_or(self.start_timeout);
        let mut unschedulable: Option<String>;
        loop {
            let pod = match seen.take() {
                Some(pod) => Some(pod),
                None => self.worker(id, &names::worker(id)).await?,
            };
            let Some(pod) = pod else {
                // Deleted while it started: by a broker that attached after this one (fenced), or
                // by someone else (try again).
                let (_, latest) = self.load_existing(id).await?;
                if latest.generation > generation {
                    return Err(fenced(id, generation, latest.generation));
                }
                return Err(retry_later(id, "the worker Pod was deleted while it started"));
            };
            if names::pod_generation(&pod.metadata) != Some(generation) {
                let theirs = names::pod_generation(&pod.metadata).unwrap_or(0);
                return Err(fenced(id, generation, theirs));
            }
            match progress(&pod) {
                Progress::Ready => return Ok(pod),
                Progress::Failed(cause) => return Err(Error::WorkerFailed { id: *id, cause }),
                Progress::Unschedulable(why) => unschedulable = Some(why),
                Progress::Starting => unschedulable = None,
            }
            let now = tokio::time::Instant::now();
            if now >= deadline || (unschedulable.is_some() && now >= placement_deadline) {
                let cause = match unschedulable {
                    Some(why) => session_runtime::WorkerFailure::Unschedulable(why),
                    None => match self.sandbox_failure(&pod).await {
                        Some(cause) => cause,
                        None => session_runtime::WorkerFailure::StartTimeout(self.start_timeout),
                    },
                };
                return Err(Error::WorkerFailed { id: *id, cause });
            }
            let wait_until = if unschedulable.is_some() {
                deadline.min(placement_deadline)
            } else {
                deadline
            };
            // Until the Pod is ready, failed, gone or replaced.
            let uid = pod.uid().unwrap_or_default();
            let started = |observed: &Observed| match observed {
                Observed::Pod(current) => {
                    current.uid().as_deref() != Some(uid.as_str())
                        || names::pod_generation(&current.metadata) != Some(generation)
                        || matches!(progress(current), Progress::Ready | Progress::Failed(_))
                }
                Observed::Absent { deleted } => *deleted,
            };
            if let Watched::Met(Some(pod)) = self
                .watch_worker(
                    &names::worker(id),
                    &uid,
                    wait_until.saturating_duration_since(now),
                    started,
                )
                .await
            {
                if !names::belongs_to(&pod.metadata, id) {
                    return Err(foreign(id, "worker Pod", &names::worker(id)));
                }
                seen = Some(*pod);
            }
        }
    }

    /// Claims the warm `member` the record names and binds it to the record's generation; if
    /// another broker claimed it first (or it went), puts the cold worker's name back on the
    /// record and starts that one.
    async fn start_warm(
        &self,
        id: &SessionId,
        anchor: &OabSession,
        record: &SessionRecord,
        profile: &WorkerProfile,
        member: &Pod,
    ) -> Result<Warm> {
        self.apply_egress(profile).await?;
        if let Some(pod) = self.claim_member(id, anchor, record, member, profile).await? {
            self.bind_member(id, &pod, record, profile).await?;
            tracing::info!(session = %id, generation = record.generation, worker = %pod.name_any(), "claimed a warm worker");
            return Ok(Warm::Claimed(pod));
        }
        let name = member.name_any();
        let generation = record.generation;
        let (anchor, cold) = self
            .update(id, |latest| {
                if latest.generation != generation {
                    return Err(fenced(id, generation, latest.generation));
                }
                let mut next = latest.clone();
                match next.worker.as_mut() {
                    Some(worker) if worker.pod.as_deref() == Some(name.as_str()) => worker.pod = None,
                    _ => return Ok(None),
                }
                Ok(Some(next))
            })
            .await?;
        let pod = self.start_worker(id, &anchor, &cold, profile).await?;
        Ok(Warm::Cold(pod, Box::new((anchor, cold))))
    }

    /// Why the node never made the Pod's sandbox, in the kubelet's words, if that is what held
    /// it: a RuntimeClass whose handler the node lacks, say. The Pod's status says only
    /// `ContainerCreating` (the kubelet retries), so its Events are read, once, at the timeout, if
    /// the Pod still has no sandbox. Unreadable Events leave the timeout as the cause.
    async fn sandbox_failure(&self, pod: &Pod) -> Option<session_runtime::WorkerFailure> {
        if !crate::start::sandbox_missing(pod) {
            return None;
        }
        let uid = pod.uid()?;
        let params = ListParams::default().fields(&format!("regarding.uid={uid},reason={SANDBOX_FAILED}"));
        let listed = match self.apis().await.ok()?.reported.list(&params).await {
            Ok(listed) => listed,
            Err(error) => {
                tracing::debug!(%error, "could not read the worker Pod's Events");
                return None;
            }
        };
        let latest = listed.items.into_iter().max_by_key(|event| {
            event
                .series
                .as_ref()
                .map(|series| series.last_observed_time.0)
                .or(event.event_time.as_ref().map(|time| time.0))
                .or(event.deprecated_last_timestamp.as_ref().map(|time| time.0))
        })?;
        let note = latest.note.unwrap_or_default();
        Some(session_runtime::WorkerFailure::Spawn(format!(
            "{SANDBOX_FAILED}: {note}"
        )))
    }

    pub(crate) async fn connector(&self, id: &SessionId, pod: &Pod, port: u16) -> Result<Arc<dyn Connector>> {
        match self.reach {
            Reach::Exec => Ok(Arc::new(ExecConnector::new(
                self.pods().await?.clone(),
                pod.name_any(),
                port,
            ))),
            _ => {
                let ip = pod
                    .status
                    .as_ref()
                    .and_then(|status| status.pod_ip.clone())
                    .ok_or_else(|| retry_later(id, "the ready worker has no Pod IP yet"))?;
                let address = match ip.parse::<std::net::IpAddr>() {
                    Ok(std::net::IpAddr::V6(v6)) => format!("[{v6}]:{port}"),
                    Ok(v4) => format!("{v4}:{port}"),
                    Err(_) => return Err(retry_later(id, "the worker's Pod IP is not an address")),
                };
                Ok(Arc::new(TcpConnector::new(address)))
            }
        }
    }

    async fn attach_locked(&self, id: &SessionId) -> Result<Attachment> {
        let started = Instant::now();
        // What this process last saw leads only to the attach's compare-and-swap; what would
        // refuse the attach is read afresh.
        let attachable = |(_, record): &(OabSession, SessionRecord)| {
            record.phase != Phase::Provisioning
                && record.state().can_attach()
                && record.storage_lost.is_none()
        };
        let (loaded, current) = match self.recall(id).filter(attachable) {
            Some(recalled) => recalled,
            None => self.load_existing(id).await?,
        };
        if current.phase == Phase::Provisioning {
            return Err(retry_later(
                id,
                "the session is still being provisioned; create it again",
            ));
        }
        if current.state().can_attach() {
            if let Some(lost) = self.find_storage_loss(id, &current).await? {
                return Err(crate::storage_loss::lost_error(id, &lost));
            }
        }
        let profile = self.profile().await?;
        let mut read = Some((loaded, current));
        let reusable = self.shared_key && !self.live.lock().contains_key(id);
        if let Some(loaded) = read.take_if(|_| reusable) {
            match self.take_over(id, &profile, loaded).await? {
                TakeOver::Taken(attachment, generation) => {
                    telemetry::attached(RUNTIME, StartKind::TakeOver, started.elapsed());
                    self.publish(
                        id,
                        SessionEvent::Adopted {
                            generation,
                            epoch: self.epoch,
                        },
                    );
                    return Ok(*attachment);
                }
                TakeOver::NotTaken(unchanged) => read = unchanged.map(|read| *read),
            }
        }
        // A warm worker, where the profile keeps them and the session has no volume a Pod
        // must be started with.
        let ephemeral = read
            .as_ref()
            .is_none_or(|(_, record)| record.volume == crate::record::Volume::Ephemeral);
        let member = match ephemeral {
            true => self.pick_member(&profile).await,
            false => None,
        };
        let mut generation = 0;
        let mut before = None;
        let updated = self
            .update_from(id, read, |record| {
                let state = record.state();
                if record.phase == Phase::Provisioning || !state.can_attach() {
                    return Err(Error::InvalidState {
                        id: *id,
                        state,
                        operation: "attach",
                    });
                }
                if let Some(loan) = record.lent_to.as_ref().filter(|loan| loan.active()) {
                    return Err(Error::StorageInUse {
                        id: *id,
                        holder: format!("a copy of its storage into session {} is being taken", loan.to),
                    });
                }
                before = Some(Before {
                    state,
                    suspend_reason: record.suspend_reason,
                });
                let mut next = record.clone();
                next.generation = record.generation + 1;
                next.phase = Phase::Session(SessionState::Running);
                next.suspend_reason = None;
                next.worker = Some(crate::record::WorkerRecord {
                    generation: next.generation,
                    pod_uid: None,
                    started_at: now(),
                    holder_epoch: Some(self.epoch),
                    pod: member
                        .as_ref()
                        .filter(|_| record.volume == crate::record::Volume::Ephemeral)
                        .map(ResourceExt::name_any),
                });
                next.last_activity = now();
                next.profile_version = Some(profile.version().to_owned());
                generation = next.generation;
                Ok(Some(next))
            })
            .await;
        let named =
            |record: &SessionRecord| record.worker.as_ref().is_some_and(|worker| worker.pod.is_some());
        let member = match (member, &updated) {
            (Some(member), Ok((_, record))) if named(record) => Some(member),
            (Some(member), _) => {
                self.unpick(&member);
                None
            }
            (None, _) => None,
        };
        let (anchor, record) = updated?;
        let start = StartKind::of(
            before
                .as_ref()
                .map_or(SessionState::Suspended, |before| before.state),
        );
        // From here until a worker serves, a failure or a dropped call undoes the attach.
        let in_flight = AttachInFlight::new(
            self.anchor_api().await?.clone(),
            self.pods().await?.clone(),
            *id,
            generation,
            before.unwrap_or(Before {
                state: SessionState::Suspended,
                suspend_reason: None,
            }),
        );
        let _ = self.retire_previous(id, generation, Duration::ZERO).await;
        let picked = member.is_some();
        let outcome = self
            .start_and_open(id, &anchor, &record, &profile, start, member)
            .await;
        // The place the picked member left (claimed, or lost to another broker).
        if picked {
            self.spawn_refill(&profile).await;
        }
        let error = match outcome {
            Ok((attachment, start)) => {
                in_flight.release();
                telemetry::attached(RUNTIME, start, started.elapsed());
                self.publish(
                    id,
                    SessionEvent::WorkerStarted {
                        generation,
                        start: start.label(),
                    },
                );
                return Ok(attachment);
            }
            Err(error @ Error::Fenced { .. }) => error,
            // A broker that attached after this one deletes this generation's Pod, and what
            // this attach then sees (a container killed, a Pod gone, a relay that stopped
            // answering) is that broker's doing: the newer generation says so.
            Err(error) => match self.load_existing(id).await {
                Ok((_, latest)) if latest.generation > generation => {
                    fenced(id, generation, latest.generation)
                }
                _ => error,
            },
        };
        if matches!(error, Error::Fenced { .. }) {
            in_flight.release();
        } else {
            telemetry::start_failed(RUNTIME, &error);
            in_flight.failed(&error).await;
        }
        if let Some(apis) = self.apis.get() {
            apis.events.attach_failed(id, generation, &error);
        }
        Err(error)
    }

    /// Starts the worker of the generation `record` holds, or claims the warm `member` the
    /// record names, and connects to it.
    async fn start_and_open(
        &self,
        id: &SessionId,
        anchor: &OabSession,
        record: &SessionRecord,
        profile: &WorkerProfile,
        start: StartKind,
        member: Option<Pod>,
    ) -> Result<(Attachment, StartKind)> {
        let generation = record.generation;
        let starting = Instant::now();
        let mut read = (anchor.clone(), record.clone());
        let (pod, start) = match member {
            Some(member) => match self.start_warm(id, anchor, record, profile, &member).await? {
                Warm::Claimed(pod) => (pod, StartKind::Warm),
                Warm::Cold(pod, cold) => {
                    read = *cold;
                    (pod, start)
                }
            },
            None => (self.start_worker(id, anchor, record, profile).await?, start),
        };
        telemetry::worker_ready(RUNTIME, start, starting.elapsed());
        self.record_serving(id, generation, &pod, read).await?;
        let attachment = tokio::time::timeout(CONNECT_TIMEOUT, self.open(id, &pod, generation, profile))
            .await
            .map_err(|_| {
                retry_later(
                    id,
                    &format!("the worker was ready but its relay did not answer within {CONNECT_TIMEOUT:?}"),
                )
            })??;
        Ok((attachment, start))
    }

    /// Records that the worker `pod` of `generation` serves, before its relay is connected: its
    /// Pod's UID (which tells `reconcile` this generation's attach finished), that the claim's
    /// directories exist (the Pod is ready, so its `prepare` step ran), and no start failure.
    /// The compare-and-swap, from `read` (the attach's own write), is also the check that no
    /// other broker took a newer generation, or suspended or closed the session, while this one
    /// started: then this worker must not serve ([`Error::Fenced`], or
    /// [`Error::InvalidState`] with the worker deleted).
    async fn record_serving(
        &self,
        id: &SessionId,
        generation: Generation,
        pod: &Pod,
        read: (OabSession, SessionRecord),
    ) -> Result<()> {
        let recorded = self
            .update_from(id, Some(read), |record| {
                if record.generation != generation {
                    return Err(fenced(id, generation, record.generation));
                }
                let state = record.state();
                if state != SessionState::Running {
                    return Err(Error::InvalidState {
                        id: *id,
                        state,
                        operation: "attach",
                    });
                }
                let Some(worker) = record.worker.as_ref() else {
                    return Ok(None);
                };
                let mut next = record.clone();
                next.prepared = record.volume.claim().is_some();
                next.last_start_failure = None;
                next.worker = Some(crate::record::WorkerRecord {
                    pod_uid: pod.uid(),
                    ..worker.clone()
                });
                Ok((next != *record).then_some(next))
            })
            .await;
        match recorded {
            Err(error @ Error::InvalidState { .. }) => {
                self.delete_pod(pod, Some(KILL_GRACE)).await?;
                Err(error)
            }
            other => other.map(drop),
        }
    }

    /// Takes over the running worker of the current generation (as `read`, the anchor and record
    /// this attach read: the compare-and-swap catches a change since) from the broker that attached
    /// it (a restarted broker, or another replica) instead of starting a new one: the relay
    /// accepts this broker's newer epoch, fences the older broker's stream, and replays the
    /// agent's output that broker had not acknowledged, so a turn in flight continues. Only
    /// for brokers that share the key the worker's token came from, and only when this
    /// broker's epoch is newer than the holder's; `NotTaken` sends the caller to a new generation.
    async fn take_over(
        &self,
        id: &SessionId,
        profile: &WorkerProfile,
        read: (OabSession, SessionRecord),
    ) -> Result<TakeOver> {
        let (anchor, record) = &read;
        let Some(held) = record
            .worker
            .as_ref()
            .filter(|_| record.state() == SessionState::Running)
        else {
            return Ok(TakeOver::NotTaken(Some(Box::new(read))));
        };
        if held.generation != record.generation || held.holder_epoch.is_none_or(|epoch| epoch >= self.epoch) {
            return Ok(TakeOver::NotTaken(Some(Box::new(read))));
        }
        let Some(pod) = self.worker(id, &record.worker_pod()).await?.filter(|pod| {
            pod.metadata.deletion_timestamp.is_none()
                && names::pod_generation(&pod.metadata) == Some(record.generation)
                && matches!(progress(pod), Progress::Ready)
        }) else {
            return Ok(TakeOver::NotTaken(Some(Box::new(read))));
        };
        let mut next = record.clone();
        if let Some(worker) = next.worker.as_mut() {
            worker.holder_epoch = Some(self.epoch);
        }
        next.last_activity = now();
        match self.swap(anchor, &next).await {
            Ok(_) => {}
            // Another broker changed the session first: a new generation settles it, from a
            // fresh read.
            Err(Swap::Lost) => return Ok(TakeOver::NotTaken(None)),
            Err(Swap::Failed(error)) => return Err(error),
        }
        tracing::info!(session = %id, generation = record.generation, epoch = self.epoch, "taking over the running worker");
        self.open(id, &pod, record.generation, profile)
            .await
            .map(|attachment| TakeOver::Taken(Box::new(attachment), record.generation))
    }

    /// Connects to the relay of `pod`, the worker of `generation`, and keeps the attachment as
    /// this process's live one.
    async fn open(
        &self,
        id: &SessionId,
        pod: &Pod,
        generation: Generation,
        profile: &WorkerProfile,
    ) -> Result<Attachment> {
        let connector = self.connector(id, pod, profile.relay_port).await?;
        let mut config = ClientConfig::with_key(*id, generation, self.epoch, &self.key);
        if let Some(budget) = self.housekeeping.reconnect_budget {
            config = config.give_up_after(budget);
        }
        let client = RelayClient::new(config, connector);
        let (fence, trigger) = Fence::new(*id, generation);
        let lost = self.worker_watch().await?.lost(pod);
        let attachment = self.connect(id, pod, client.attach_until(fence, lost)).await?;
        let renewal = tokio::spawn(renew_while_live(
            self.anchor_api().await?.clone(),
            *id,
            attachment.control(),
            trigger.clone(),
            renew_every(profile.idle_ttl.or(self.housekeeping.idle_ttl)),
        ))
        .abort_handle();
        let live = Live {
            fence: trigger,
            control: attachment.control(),
            renewal,
            termination_grace: profile.termination_grace,
        };
        self.live.lock().insert(*id, live);
        Ok(attachment)
    }

    /// Makes the profile's egress policy what the profile says, once per profile version and
    /// process (server-side apply: idempotent, and another broker's identical apply is no
    /// conflict).
    async fn apply_egress(&self, profile: &WorkerProfile) -> Result<()> {
        let key = format!("{}@{}", profile.name(), profile.version());
        if self.egress_applied.lock().contains(&key) {
            return Ok(());
        }
        let policy = crate::network::egress_policy(profile, &self.installation);
        let name = policy.metadata.name.clone().unwrap_or_default();
        let params = kube::api::PatchParams::apply(crate::network::FIELD_MANAGER).force();
        self.apis()
            .await?
            .policies
            .patch(&name, &params, &kube::api::Patch::Apply(&policy))
            .await
            .map_err(|e| {
                api_error(
                    &format!("applying the egress policy {name} of profile {}", profile.name()),
                    e,
                )
            })?;
        self.egress_applied.lock().insert(key);
        Ok(())
    }

    /// Waits for the relay connection of a worker that was just started, watching the Pod
    /// meanwhile: a worker that fails before its relay answers is reported as the Pod says,
    /// not as a connection that kept being refused.
    async fn connect(
        &self,
        id: &SessionId,
        pod: &Pod,
        attach: impl std::future::Future<Output = Result<Attachment>>,
    ) -> Result<Attachment> {
        tokio::pin!(attach);
        let uid = pod.uid().unwrap_or_default();
        loop {
            tokio::select! {
                attached = &mut attach => return attached,
                () = tokio::time::sleep(POLL) => {}
            }
            // As the shared watch saw it, else (not listed yet, or not seen yet) as read.
            let name = pod.name_any();
            let current = match self.worker_watch().await?.observe(&name, &uid) {
                Some(Observed::Pod(current)) => Some(*current),
                Some(Observed::Absent { deleted: true }) => None,
                Some(Observed::Absent { deleted: false }) | None => self.worker(id, &name).await?,
            };
            match current {
                Some(current) if current.uid() == pod.uid() => {
                    if let Progress::Failed(cause) = progress(&current) {
                        return Err(Error::WorkerFailed { id: *id, cause });
                    }
                }
                _ => {
                    return Err(retry_later(
                        id,
                        "the worker Pod went away while the broker connected to it",
                    ))
                }
            }
        }
    }

    async fn suspend_locked(&self, id: &SessionId, reason: SuspendReason) -> Result<()> {
        let mut suspended = false;
        let mut served = None;
        let (_, record) = self
            .update(id, |record| {
                suspended = false;
                served = record.served_worker();
                let state = record.state();
                match state {
                    SessionState::Closing | SessionState::Closed => Err(Error::InvalidState {
                        id: *id,
                        state,
                        operation: "suspend",
                    }),
                    SessionState::Running => {
                        let mut next = record.clone();
                        next.phase = Phase::Session(SessionState::Suspended);
                        next.suspend_reason = Some(reason);
                        next.worker = None;
                        next.last_activity = now();
                        suspended = true;
                        Ok(Some(next))
                    }
                    _ => Ok(None),
                }
            })
            .await?;
        // The grace of the profile this process started the worker with, else the profile's now.
        let started_with = self.live.lock().get(id).map(|live| live.termination_grace);
        let grace = match (reason, started_with) {
            (SuspendReason::Hung, _) => Duration::ZERO,
            (_, Some(grace)) => grace,
            _ => self
                .profile()
                .await
                .map_or(Duration::from_secs(10), |p| p.termination_grace),
        };
        let retired = self.retire_previous(id, record.generation, grace).await;
        // A worker that let its grace pass unanswered is not given it again: the bound of a
        // suspend is one grace (plus the relay's stop time), not two.
        let pod_grace =
            (reason == SuspendReason::Hung || retired == Retired::Unanswered).then_some(KILL_GRACE);
        self.stop_worker(id, record.generation, pod_grace, served).await?;
        if suspended {
            self.publish(id, SessionEvent::Suspended { reason });
        }
        Ok(())
    }

    pub(crate) async fn close_locked(&self, id: &SessionId, reason: CloseReason) -> Result<()> {
        // Only the close's compare-and-swap acts on what this process last saw.
        let read = match self.recall(id) {
            Some(recalled) => recalled,
            None => match self.load(id).await? {
                Some(read) => read,
                None => return Ok(()),
            },
        };
        // The retention intent is part of the recorded close, decided once by the first reason.
        // A profile that is missing or invalid has no say; one that could not be read might have
        // said "retain", so the close waits for it (nothing is recorded yet).
        let retention = match self.profile().await {
            Ok(profile) => profile
                .retention
                .as_ref()
                .map_or_else(|| self.retention.clone(), |o| o.apply(&self.retention)),
            Err(Error::InvalidConfig { .. }) => self.retention.clone(),
            Err(error) => return Err(error),
        };
        let mut served = None;
        let (anchor, record) = self
            .update_from(id, Some(read), |record| {
                served = record.served_worker();
                if record.close.is_some() {
                    return Ok(None);
                }
                let decided = retention.for_reason(reason);
                let mut next = record.clone();
                next.phase = Phase::Session(SessionState::Closing);
                next.worker = None;
                next.close = Some(CloseRecord {
                    reason,
                    retention: decided,
                    retain_until: (decided == Retention::Retain)
                        .then(|| retention.retain_for.map(|keep| now() + keep.as_secs()))
                        .flatten(),
                    storage_done: false,
                });
                Ok(Some(next))
            })
            .await?;
        let _ = self
            .retire_previous(id, record.generation + 1, Duration::ZERO)
            .await;
        self.finish_close(id, (anchor, record), served).await
    }

    /// The steps after a recorded close: compute, then storage, then the closed record.
    /// `read` is the anchor and record as last read; `served`, the worker the record named
    /// before the close, if the caller knows it (see [`stop_worker`](Self::stop_worker)).
    pub(crate) async fn finish_close(
        &self,
        id: &SessionId,
        read: (OabSession, SessionRecord),
        served: Option<(String, String)>,
    ) -> Result<()> {
        let record = read.1.clone();
        let Some(close) = record.close else {
            return Ok(());
        };
        if close.storage_done {
            return Ok(());
        }
        let _ = self
            .retire_previous(id, record.generation + 1, Duration::ZERO)
            .await;
        self.stop_worker(id, record.generation, Some(KILL_GRACE), served)
            .await?;
        self.delete_service_account(id, record.incarnation, record.service_account_uid.as_deref())
            .await?;
        // A lost volume is not looked for: a claim under its name now is not the session's.
        if close.retention == Retention::Delete && record.storage_lost.is_none() {
            if let Volume::Owned { claim, uid } = &record.volume {
                self.delete_claim(id, claim, uid.as_deref()).await?;
            }
        }
        let incarnation = record.incarnation;
        let mut closed = false;
        self.update_from(id, Some(read), |current| {
            closed = false;
            // Another broker may have finished this close and started the next session.
            if current.incarnation != incarnation || current.state() != SessionState::Closing {
                return Ok(None);
            }
            closed = true;
            let mut next = current.clone();
            next.phase = Phase::Session(SessionState::Closed);
            next.closed_at = Some(now());
            next.close = next.close.map(|close| CloseRecord {
                storage_done: true,
                ..close
            });
            Ok(Some(next))
        })
        .await?;
        if closed {
            self.publish(
                id,
                SessionEvent::Closed {
                    reason: close.reason,
                    retention: matches!(record.volume, Volume::Owned { .. }).then_some(close.retention),
                },
            );
        }
        Ok(())
    }

    /// Publishes `event` on session `id` (in the background; see `events`), once the runtime
    /// has its API handles (every operation that makes a transition has).
    fn publish(&self, id: &SessionId, event: SessionEvent) {
        if let Some(apis) = self.apis.get() {
            apis.events.publish(id, event);
        }
    }

    /// Deletes a claim this runtime made: only the one with the recorded UID.
    pub(crate) async fn delete_claim(&self, id: &SessionId, claim: &str, uid: Option<&str>) -> Result<()> {
        let Some(found) = self
            .claims()
            .await?
            .get_opt(claim)
            .await
            .map_err(|e| api_error(&format!("reading claim {claim}"), e))?
        else {
            return Ok(());
        };
        if !names::belongs_to(&found.metadata, id) || (uid.is_some() && found.uid().as_deref() != uid) {
            // Not provably ours: left in place.
            return Err(foreign(id, "claim", claim));
        }
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: found.uid(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.claims().await?.delete(claim, &params).await {
            Ok(_) => Ok(()),
            Err(error) if is_status(&error, 404) => Ok(()),
            Err(error) => Err(api_error(&format!("deleting claim {claim}"), error)),
        }
    }

    async fn create_locked(
        &self,
        identity: &SessionIdentity,
        seed: Option<SeedRecord>,
    ) -> Result<SessionHandle> {
        let id = identity.id();
        let digest = data_encoding::HEXLOWER.encode(&identity.digest());
        // A new session's anchor is created without a read first; a conflict says there is one.
        let mut exists = false;
        for _ in 0..CAS_ATTEMPTS {
            let found = match exists {
                true => self.load_anchor(&id).await?,
                false => None,
            };
            let Some((anchor, record)) = found else {
                let anchor = OabSession::for_session(&self.installation, &id, &digest);
                match self
                    .anchor_api()
                    .await?
                    .create(&PostParams::default(), &anchor)
                    .await
                {
                    Ok(created) => {
                        self.apis().await?.events.learn_anchor(&id, created.uid());
                        let record = self.first_record(&id, &created, &digest, seed.clone()).await?;
                        let record = self.provision(&id, created, record).await?;
                        return Ok(SessionHandle::new(id, record.state(), record.generation, true));
                    }
                    Err(error) if is_status(&error, 409) => {
                        exists = true;
                        continue;
                    }
                    Err(error) => return Err(api_error(&format!("creating session {id}"), error)),
                }
            };
            if anchor.spec.identity_digest != digest {
                return Err(Error::Backend {
                    runtime: RUNTIME,
                    retryable: false,
                    message: format!("session {id}: the anchor belongs to another identity"),
                    source: None,
                });
            }
            if anchor.is_deleted() {
                // Deleted by an operator: its session is being closed, and its name is not free
                // until the controller has finished.
                return Err(retry_later(
                    &id,
                    "the session's anchor is being deleted (its session closed); try again once it is gone",
                ));
            }
            let Some(record) = record else {
                // A create that recorded nothing yet (its broker may have gone): finished here.
                let record = self.first_record(&id, &anchor, &digest, seed.clone()).await?;
                let record = self.provision(&id, anchor, record).await?;
                return Ok(SessionHandle::new(id, record.state(), record.generation, true));
            };
            match record.phase {
                Phase::Provisioning => {
                    let record = self.provision(&id, anchor, record).await?;
                    return Ok(SessionHandle::new(id, record.state(), record.generation, true));
                }
                Phase::Session(SessionState::Closing) => {
                    self.finish_close(&id, (anchor, record), None).await?
                }
                Phase::Session(SessionState::Closed) => {
                    // A new session under the same id: generations keep growing, and the new
                    // incarnation gets a volume of its own.
                    let mut next = record.next_incarnation(digest.clone());
                    next.seed = seed.clone();
                    match self.swap(&anchor, &next).await {
                        Ok(written) => {
                            let record = self.provision(&id, written, next).await?;
                            return Ok(SessionHandle::new(id, record.state(), record.generation, true));
                        }
                        Err(Swap::Lost) => continue,
                        Err(Swap::Failed(error)) => return Err(error),
                    }
                }
                Phase::Session(state) => return Ok(SessionHandle::new(id, state, record.generation, false)),
            }
        }
        Err(retry_later(&id, "the session kept changing while it was created"))
    }

    /// The record a new `anchor` of `id` starts with, before provisioning writes it, and its
    /// identity: the ServiceAccount's name takes the incarnation, so making it is also the
    /// check that no earlier record's account has that number.
    async fn first_record(
        &self,
        id: &SessionId,
        anchor: &OabSession,
        digest: &str,
        seed: Option<SeedRecord>,
    ) -> Result<SessionRecord> {
        let (generation, incarnation) = self.surviving_numbers(id).await?;
        let (incarnation, account_uid) = self
            .first_identity(id, incarnation, &anchor.uid().unwrap_or_default())
            .await?;
        let mut record = SessionRecord::new(*id, digest.to_owned(), generation, incarnation);
        record.seed = seed;
        record.service_account = true;
        record.service_account_uid = account_uid;
        Ok(record)
    }

    /// The generation and incarnation a new record of `id` starts from: past every number that
    /// objects of an earlier record (deleted, its objects perhaps still there or orphaned) carry,
    /// so a worker Pod or claim of that record is never taken for this one's (its identity:
    /// see [`first_identity`](Self::first_identity)).
    ///
    /// # Errors
    /// [`Error::Backend`] if the API server could not be read.
    async fn surviving_numbers(&self, id: &SessionId) -> Result<(Generation, u64)> {
        // By label, not name: an earlier record's worker may have been a claimed pool member.
        let generation = self
            .workers_of(id)
            .await?
            .iter()
            .filter_map(|pod| names::pod_generation(&pod.metadata))
            .max()
            .unwrap_or(0);
        let prefix = format!("{}-", names::storage(id, 0).trim_end_matches("-0"));
        let claims = self
            .claims()
            .await?
            .list(&kube::api::ListParams::default().labels(&format!("{}={id}", names::SESSION)))
            .await
            .map_err(|e| api_error(&format!("listing the claims of session {id}"), e))?;
        let incarnation = claims
            .items
            .iter()
            .filter(|claim| names::belongs_to(&claim.metadata, id))
            .filter_map(|claim| claim.name_any().strip_prefix(&prefix)?.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
            + 1;
        Ok((generation, incarnation))
    }

    /// Test-only fault hooks (see `session_runtime::conformance::FaultInjector`).
    #[cfg(feature = "testing")]
    pub(crate) async fn record_only<F>(&self, id: &SessionId, change: F) -> Result<()>
    where
        F: Fn(&mut SessionRecord) + Send + Sync,
    {
        self.update(id, |record| {
            let mut next = record.clone();
            change(&mut next);
            Ok(Some(next))
        })
        .await
        .map(drop)
    }
}

/// Renews the anchor's `status.renewTime` every `every` until the attachment is fenced or its worker
/// ended. A merge patch of that one field: it never conflicts with a record update, and a record
/// update never loses it (each one renews too).
/// What [`KubernetesRuntime::take_over`] did.
enum TakeOver {
    /// The running worker now serves this broker.
    Taken(Box<Attachment>, Generation),
    /// Nothing taken; the read it was given when it changed nothing, `None` when the session
    /// changed meanwhile.
    NotTaken(Option<Box<(OabSession, SessionRecord)>>),
}

async fn renew_while_live(
    anchors: Api<OabSession>,
    id: SessionId,
    control: Arc<dyn WorkerControl>,
    fence: FenceTrigger,
    every: Duration,
) {
    let name = names::anchor(&id);
    loop {
        tokio::time::sleep(every).await;
        if fence.is_fenced() || !control.is_alive() {
            return;
        }
        let patch = serde_json::json!({ "status": { "renewTime": jiff_now().to_string() } });
        if let Err(error) = anchors
            .patch_status(
                &name,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(&patch),
            )
            .await
        {
            tracing::debug!(session = %id, "renewing the anchor failed (the next renewal retries): {error}");
        }
    }
}

impl Drop for KubernetesRuntime {
    fn drop(&mut self) {
        // The renewals stop with the runtime: its attachments no longer count as live.
        self.live.lock().clear();
        self.pool.stop();
    }
}

pub(crate) fn jiff_now() -> k8s_openapi::jiff::Timestamp {
    k8s_openapi::jiff::Timestamp::now()
}

fn foreign(id: &SessionId, what: &str, name: &str) -> Error {
    Error::Backend {
        runtime: RUNTIME,
        retryable: false,
        message: format!(
            "session {id}: the {what} {name} exists but is not this session's (no matching openab.dev/session-id); it is left alone"
        ),
        source: None,
    }
}

fn fenced(id: &SessionId, ours: Generation, theirs: Generation) -> Error {
    Error::Fenced {
        id: *id,
        generation: ours,
        current: theirs,
    }
}

fn retry_later(id: &SessionId, why: &str) -> Error {
    Error::Backend {
        runtime: RUNTIME,
        retryable: true,
        message: format!("session {id}: {why}"),
        source: None,
    }
}

#[async_trait]
impl SessionRuntime for KubernetesRuntime {
    fn name(&self) -> &'static str {
        RUNTIME
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::minimal()
            .with_isolation(IsolationLevel::Pod)
            .with_persistent_storage(true)
            .with_survives_broker_restart(true)
    }

    async fn create(&self, identity: &SessionIdentity, options: &CreateOptions) -> Result<SessionHandle> {
        identity.require_installation(&self.installation)?;
        // The relay's hello carries no working directory or environment, and a value in the Pod
        // spec would be readable by anyone who can read Pods: refused before anything exists.
        SessionOverlay::refuse(options.overlay.as_ref(), RUNTIME)?;
        let seed = match &options.workspace_seed {
            None => None,
            Some(WorkspaceSeed::GitClone { url, reference }) => {
                let profile = self.profile().await?;
                // Before anything exists: a URL naming a path, a helper or a host the profile does
                // not list never reaches a Job.
                crate::clone_source::check_clone_url(url, &profile.seed_hosts).map_err(|reason| {
                    Error::InvalidArgument {
                        reason: format!("the workspace seed {reason}"),
                    }
                })?;
                if reference
                    .as_deref()
                    .is_some_and(|r| r.is_empty() || r.chars().any(char::is_control))
                {
                    return Err(Error::InvalidArgument {
                        reason: format!(
                            "the workspace seed's reference {reference:?} is not a branch or tag name"
                        ),
                    });
                }
                if matches!(profile.storage, Storage::Ephemeral { .. }) {
                    return Err(Error::Unsupported {
                        runtime: RUNTIME,
                        operation: "a workspace seed with the profile's ephemeral storage (the seed would not outlive its Job)",
                    });
                }
                Some(SeedRecord::GitClone {
                    git_url: url.clone(),
                    git_reference: reference.clone(),
                })
            }
            Some(WorkspaceSeed::CopyOf { source }) => {
                if *source == identity.id() {
                    return Err(Error::InvalidArgument {
                        reason: format!("session {source} cannot be seeded with a copy of its own storage"),
                    });
                }
                if matches!(self.profile().await?.storage, Storage::Ephemeral { .. }) {
                    return Err(Error::Unsupported {
                        runtime: RUNTIME,
                        operation: "a copy of another session's storage with the profile's ephemeral storage",
                    });
                }
                // Refused before this session's anchor exists when the source plainly cannot be
                // copied; the loan at seed time decides under compare-and-swap.
                self.check_copy_source(source).await?;
                Some(SeedRecord::CopyOf { copy_of: *source })
            }
            Some(_) => {
                return Err(Error::Unsupported {
                    runtime: RUNTIME,
                    operation: "this kind of workspace seed",
                })
            }
        };
        let lock = self.lock(&identity.id());
        let _held = lock.lock().await;
        let handle = self.create_locked(identity, seed).await?;
        if handle.created {
            self.publish(&handle.id, SessionEvent::Created);
        }
        Ok(handle)
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
        let (_, mut record) = self.load_existing(id).await?;
        if !matches!(record.state(), SessionState::Closing | SessionState::Closed) {
            record.storage_lost = self.find_storage_loss(id, &record).await?;
        }
        Ok(record.status())
    }

    async fn list(&self) -> Result<Vec<SessionStatus>> {
        let mut sessions = Vec::new();
        for (id, anchor) in self.anchors().await? {
            match anchor.record(&id) {
                Ok(Some(record)) => sessions.push(record.status()),
                // A create that recorded nothing yet: not a session so far.
                Ok(None) => {}
                Err(error) => tracing::warn!(session = %id, "skipping an unreadable session: {error}"),
            }
        }
        Ok(sessions)
    }

    async fn reconcile(&self) -> Result<ReconcileReport> {
        crate::reconcile::run(self).await
    }
}

impl KubernetesRuntime {
    /// The API handles, inferring the client from the environment on first use when the
    /// builder was given none.
    async fn apis(&self) -> Result<&Apis> {
        self.apis
            .get_or_try_init(|| async {
                let config = kube::Config::infer().await.map_err(|error| {
                    Error::backend(
                        RUNTIME,
                        false,
                        "no Kubernetes client configuration (KUBECONFIG, ~/.kube/config or an in-cluster service account)",
                        error,
                    )
                })?;
                let client = crate::metered_client(config)
                    .map_err(|error| Error::backend(RUNTIME, false, "building the Kubernetes client", error))?;
                Ok(Apis::new(
                    client,
                    &self.namespace,
                    events_instance(&self.installation, self.epoch),
                ))
            })
            .await
    }

    /// The shared watch of the installation's workers and warm pool members.
    pub(crate) async fn worker_watch(&self) -> Result<&crate::loss::WorkerWatch> {
        let pods = self.pods().await?;
        Ok(self.workers.get_or_init(|| {
            crate::loss::WorkerWatch::new(pods.clone(), names::workers_selector(&self.installation))
        }))
    }

    pub(crate) async fn pods(&self) -> Result<&Api<Pod>> {
        Ok(&self.apis().await?.pods)
    }

    pub(crate) async fn anchor_api(&self) -> Result<&Api<OabSession>> {
        Ok(&self.apis().await?.anchors)
    }

    pub(crate) async fn claims(&self) -> Result<&Api<PersistentVolumeClaim>> {
        Ok(&self.apis().await?.claims)
    }

    pub(crate) async fn service_accounts(&self) -> Result<&Api<k8s_openapi::api::core::v1::ServiceAccount>> {
        Ok(&self.apis().await?.service_accounts)
    }

    pub(crate) async fn jobs(&self) -> Result<&Api<k8s_openapi::api::batch::v1::Job>> {
        Ok(&self.apis().await?.jobs)
    }

    pub(crate) fn start_timeout(&self) -> Duration {
        self.start_timeout
    }

    async fn profiles(&self) -> Result<&Api<DynamicObject>> {
        Ok(&self.apis().await?.profiles)
    }

    pub(crate) fn namespace(&self) -> &str {
        &self.namespace
    }

    pub(crate) fn installation(&self) -> &str {
        &self.installation
    }

    /// Every anchor of the installation that is its session's own, with its session id; its
    /// record may still be unreadable (a newer format, say).
    pub(crate) async fn anchors(&self) -> Result<Vec<(SessionId, OabSession)>> {
        let params = ListParams::default().labels(&names::installation_selector(&self.installation));
        let anchors = self
            .anchor_api()
            .await?
            .list(&params)
            .await
            .map_err(|e| api_error("listing sessions", e))?;
        Ok(anchors
            .into_iter()
            .filter_map(|anchor| {
                let id = SessionId::parse(anchor.labels().get(names::SESSION)?).ok()?;
                names::belongs_to(&anchor.metadata, &id).then_some((id, anchor))
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use session_runtime::config::SessionRuntimeConfig;

    #[test]
    fn a_section_without_its_table_names_the_table() {
        let config = SessionRuntimeConfig::from_toml_document("[session_runtime]\ntype = \"kubernetes\"\n");
        // The section's own validation may already refuse it; either way the table is named.
        let error = match config {
            Ok(config) => KubernetesRuntime::builder_from_config(&config)
                .map(drop)
                .unwrap_err(),
            Err(error) => error,
        };
        assert!(
            matches!(&error, Error::InvalidConfig { key, .. } if key.contains("kubernetes")),
            "{error}"
        );
    }

    #[test]
    fn a_section_sets_installation_idle_ttl_and_retention() {
        let config = SessionRuntimeConfig::from_toml_document(
            "[session_runtime]\ntype = \"kubernetes\"\ninstallation = \"prod\"\nidle_ttl = \"0s\"\n\
             [session_runtime.retention]\nended = \"retain\"\n\
             [session_runtime.kubernetes]\nnamespace = \"sessions\"\nprofile = \"worker\"\nreach = \"exec\"\n",
        )
        .expect("a valid section");
        let runtime = KubernetesRuntime::builder_from_config(&config)
            .expect("a builder")
            .build()
            .expect("a runtime, with no API server contacted yet");
        assert_eq!(runtime.installation(), "prod");
        assert_eq!(runtime.housekeeping.idle_ttl, None, "0s turns idle suspends off");
        assert_eq!(runtime.retention.ended, Retention::Retain);
        assert_eq!(
            (runtime.namespace.as_str(), runtime.profile.as_str()),
            ("sessions", "worker")
        );
        assert_eq!(runtime.reach, Reach::Exec);
    }

    fn with_key_file(key_file: &std::path::Path) -> Result<KubernetesRuntime> {
        let config = SessionRuntimeConfig::from_toml_document(&format!(
            "[session_runtime]\ntype = \"kubernetes\"\n[session_runtime.kubernetes]\n\
             namespace = \"sessions\"\nprofile = \"worker\"\negress_gateway_key_file = {:?}\n",
            key_file.display().to_string()
        ))
        .expect("a valid section");
        KubernetesRuntime::builder_from_config(&config)?.build()
    }

    #[test]
    fn a_worker_gets_its_own_proxy_credential_only_when_the_broker_holds_the_gateways_key() {
        let key_name = "session_runtime.kubernetes.egress_gateway_key_file";
        let dir = tempfile::tempdir().expect("dir");
        let short = dir.path().join("short");
        std::fs::write(&short, [1u8; 16]).expect("write");
        for missing_or_short in [dir.path().join("absent"), short.clone()] {
            let refused = with_key_file(&missing_or_short).map(drop).unwrap_err();
            assert!(
                matches!(&refused, Error::InvalidConfig { key, .. } if key == key_name),
                "{refused}"
            );
        }
        let key_file = dir.path().join("key");
        std::fs::write(&key_file, [2u8; 32]).expect("write");
        let runtime = with_key_file(&key_file).expect("a runtime");
        let profile = WorkerProfile::from_toml(
            "worker",
            "1",
            "image = \"w\"\nagent = [\"/a\"]\negress_gateway = \"10.96.0.50:3128\"\negress_hosts = [\"github.com:443\"]\n",
        )
        .expect("a profile");
        let id = SessionIdentity::new("i", "a", "p", "t").expect("identity").id();
        let egress = runtime
            .worker_egress(&id, &profile)
            .expect("valid")
            .expect("a proxy");
        let url = egress.proxy_url();
        let expected = GatewayKey::new([2u8; 32])
            .credential(id, "worker")
            .proxy_url("10.96.0.50:3128");
        assert_eq!(url, expected);
        assert!(url.starts_with(&format!("http://{id}.worker:")), "{url}");
        let other = SessionIdentity::new("i", "a", "p", "u").expect("identity").id();
        let others = runtime
            .worker_egress(&other, &profile)
            .expect("valid")
            .expect("a proxy");
        assert_ne!(others.proxy_url(), url);

        let plain =
            WorkerProfile::from_toml("worker", "1", "image = \"w\"\nagent = [\"/a\"]\n").expect("a profile");
        assert_eq!(runtime.worker_egress(&id, &plain).expect("no gateway"), None);
        let without_key = KubernetesRuntime::builder_from_config(
            &SessionRuntimeConfig::from_toml_document(
                "[session_runtime]\ntype = \"kubernetes\"\n[session_runtime.kubernetes]\n\
                 namespace = \"sessions\"\nprofile = \"worker\"\n",
            )
            .expect("a valid section"),
        )
        .expect("a builder")
        .build()
        .expect("a runtime");
        let refused = without_key.worker_egress(&id, &profile).unwrap_err();
        assert!(
            matches!(&refused, Error::InvalidConfig { key, .. } if key == key_name),
            "{refused}"
        );
    }
}
