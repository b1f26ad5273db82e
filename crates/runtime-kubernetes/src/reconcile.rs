//! One reconcile pass: make what runs and what is stored match the anchors.
//!
//! Level-triggered: a pass lists the installation's anchors, worker Pods and claims once, decides
//! from that snapshot, and acts only through compare-and-swap on the anchor it read and deletes
//! with UID preconditions. A snapshot that went stale makes an action fail (and the next pass
//! decide again), never act on the wrong object; a pass that was interrupted is simply continued
//! by the next.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ListParams, PostParams};
use kube::ResourceExt;
use session_runtime::{
    telemetry, CloseReason, ReconcileReport, Result, Retention, SessionId, SessionState, SuspendReason,
};

use crate::abandon::abandoned_before;
use crate::anchor::{OabSession, CLOSE_FINALIZER};
use crate::api::{api_error, delete_if_unchanged, is_status};
use crate::record::{now, CloseRecord, Phase, ReconcileNote, SessionRecord, Volume};
use crate::runtime::{KubernetesRuntime, Swap, KILL_GRACE};
use crate::{names, storage_loss, RUNTIME};

/// What one pass decides from, besides each anchor.
pub(crate) struct Policy {
    pub(crate) idle_ttl: Option<Duration>,
}

pub(crate) async fn run(runtime: &KubernetesRuntime) -> Result<ReconcileReport> {
    let started = std::time::Instant::now();
    let mut report = pass(runtime).await?;
    keep_pool(runtime, &mut report).await;
    telemetry::reconciled(RUNTIME, started.elapsed());
    count_actions(&report);
    Ok(report)
}

/// Refills the profile's warm pool and trims it (see `pool.rs`). A broker whose key was not
/// given keeps no pool; a profile it cannot read is left to the next attach to report.
async fn keep_pool(runtime: &KubernetesRuntime, report: &mut ReconcileReport) {
    if !runtime.shared_key {
        return;
    }
    let profile = match runtime.read_profile().await {
        Ok(profile) => profile,
        Err(error) => {
            tracing::debug!("no profile to keep a warm pool of: {error}");
            return;
        }
    };
    match runtime.refill_pool(&profile).await {
        Ok(refill) => {
            report.warm_started.extend(refill.started);
            report.warm_trimmed.extend(refill.trimmed);
            report.errors.extend(refill.errors);
        }
        Err(error) => report.errors.push(format!("keeping the warm pool: {error}")),
    }
}

/// Counts what a pass, or one session's reconcile, did ([`telemetry::RECONCILE_ACTIONS`]).
pub(crate) fn count_actions(report: &ReconcileReport) {
    for (action, count) in [
        ("kill_worker", report.killed_workers.len()),
        ("finish_close", report.finished_closes.len()),
        ("suspend_idle", report.suspended_idle.len()),
        ("expire_storage", report.expired_storage.len()),
        ("expire_record", report.expired_records.len()),
        ("report_orphaned_storage", report.orphaned_storage.len()),
        ("report_lost_storage", report.lost_storage.len()),
        ("start_warm_worker", report.warm_started.len()),
        ("trim_warm_worker", report.warm_trimmed.len()),
        ("error", report.errors.len()),
    ] {
        telemetry::reconcile_actions(RUNTIME, action, count);
    }
}

/// The installation's sessions by phase, for [`telemetry::SESSIONS`]: every phase, so that one
/// that emptied reads 0 rather than its last count.
struct PhaseCounts(BTreeMap<&'static str, usize>);

impl PhaseCounts {
    fn new() -> Self {
        let phases = [
            "provisioning",
            "created",
            "running",
            "suspended",
            "closing",
            "closed",
        ];
        PhaseCounts(phases.into_iter().map(|phase| (phase, 0)).collect())
    }

    fn count(&mut self, record: &SessionRecord) {
        let phase = if record.phase == Phase::Provisioning {
            "provisioning"
        } else {
            record.state().as_str()
        };
        *self.0.entry(phase).or_default() += 1;
    }

    fn publish(self) {
        for (phase, count) in self.0 {
            telemetry::sessions(RUNTIME, phase, count);
        }
    }
}

async fn pass(runtime: &KubernetesRuntime) -> Result<ReconcileReport> {
    let mut report = ReconcileReport::default();
    let anchors = runtime.anchors().await?;
    let mut phases = PhaseCounts::new();
    let workers = list(
        runtime.pods().await?,
        runtime.installation(),
        "worker",
        "worker Pods",
    )
    .await?;
    let claims = list(
        runtime.claims().await?,
        runtime.installation(),
        "storage",
        "claims",
    )
    .await?;
    let policy = runtime.policy().await;
    let by_session: HashMap<SessionId, &Pod> = workers
        .iter()
        .filter_map(|pod| Some((names::session_of(&pod.metadata)?, pod)))
        .collect();
    let claims_by_name: HashMap<String, &PersistentVolumeClaim> =
        claims.iter().map(|claim| (claim.name_any(), claim)).collect();
    let mut named_claims = BTreeSet::new();
    let mut unreadable = BTreeSet::new();
    for (id, anchor) in &anchors {
        let record = match anchor.record(id) {
            Ok(Some(record)) => {
                phases.count(&record);
                record
            }
            Ok(None) => {
                // A create that recorded nothing: it owns nothing a cascade does not take, so an
                // interrupted one (or one an operator deleted) is removed; a create in flight is
                // left to finish.
                if anchor.is_deleted() || is_old(&anchor.metadata, runtime) {
                    match remove_anchor(runtime, anchor).await {
                        Ok(true) => report.expired_records.push(*id),
                        Ok(false) => {}
                        Err(error) => report.errors.push(format!("session {id}: {error}")),
                    }
                }
                continue;
            }
            Err(error) => {
                // A newer broker's record, say: its claims are not orphans, and it is not ours to fix.
                unreadable.insert(*id);
                report.errors.push(error.to_string());
                continue;
            }
        };
        named_claims.extend(record.claims().map(str::to_owned));
        let worker = by_session.get(id).copied();
        let record = match storage(runtime, id, anchor, record, &claims_by_name, &mut report).await {
            Ok(Some(record)) => record,
            // The record changed since the pass read it: the next pass decides.
            Ok(None) => continue,
            Err(error) => {
                report.errors.push(format!("session {id}: {error}"));
                continue;
            }
        };
        if let Err(error) = session(runtime, id, anchor, record, worker, &policy, &mut report).await {
            report.errors.push(format!("session {id}: {error}"));
        }
    }
    phases.publish();
    let anchored: BTreeSet<SessionId> = anchors.iter().map(|(id, _)| *id).collect();
    for (id, pod) in &by_session {
        if anchored.contains(id)
            || !is_old(&pod.metadata, runtime)
            || pod.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        // Its owner reference lets the garbage collector take it once the anchor is gone, but a
        // Pod made by a broker killed before its anchor existed has none to follow.
        match runtime.delete_pod(pod, Some(KILL_GRACE)).await {
            Ok(()) => report
                .killed_workers
                .push((*id, format!("pod/{}", pod.name_any()))),
            Err(error) => report
                .errors
                .push(format!("orphaned worker {}: {error}", pod.name_any())),
        }
    }
    for claim in &claims {
        let Some(id) = names::session_of(&claim.metadata) else {
            continue;
        };
        let name = claim.name_any();
        // A claim being deleted is on its way out, not an orphan: a pass may delete an expired
        // claim and then the record that named it, while the claim waits for its Pod to go
        // (`pvc-protection`).
        if named_claims.contains(&name)
            || unreadable.contains(&id)
            || !is_old(&claim.metadata, runtime)
            || claim.metadata.deletion_timestamp.is_some()
        {
            continue;
        }
        if !runtime.housekeeping.delete_orphaned_storage {
            report
                .orphaned_storage
                .push((id, format!("persistentvolumeclaim/{name}")));
            continue;
        }
        match delete_orphaned_claim(runtime, claim).await {
            Ok(()) => report.expired_storage.push(id),
            Err(error) => report.errors.push(format!("orphaned claim {name}: {error}")),
        }
    }
    Ok(report)
}

/// One session, from its anchor and its worker as listed (either may have changed since).
pub(crate) async fn session(
    runtime: &KubernetesRuntime,
    id: &SessionId,
    anchor: &OabSession,
    record: SessionRecord,
    worker: Option<&Pod>,
    policy: &Policy,
    report: &mut ReconcileReport,
) -> Result<()> {
    let lock = runtime.lock(id);
    let _held = lock.lock().await;
    let worker = worker.filter(|pod| pod.metadata.deletion_timestamp.is_none());
    if anchor.is_deleted() {
        return finish_deletion(runtime, id, anchor, record, report).await;
    }
    if record.phase == Phase::Provisioning && is_old(&anchor.metadata, runtime) {
        // A create whose broker went away before the storage was made (or recorded): finished
        // here, so the claim it may have named is made and recorded, never left half-known.
        runtime.provision(id, anchor.clone(), record).await?;
        note(runtime, id, "finished an interrupted create".to_owned()).await;
        return Ok(());
    }
    match record.state() {
        SessionState::Closing => {
            runtime.finish_close(id, (anchor.clone(), record), None).await?;
            report.finished_closes.push(*id);
            note(runtime, id, "finished an interrupted close".to_owned()).await;
            return Ok(());
        }
        SessionState::Running
            if abandoned_before(
                &record,
                runtime.start_timeout(),
                runtime.housekeeping.orphan_grace,
            ) =>
        {
            // An attach that failed or was dropped and could not undo itself (its broker was
            // killed, or the API server did not answer): undone here, as it would have been.
            let generation = record.generation;
            let why = format!(
                "the attach of generation {generation} did not finish (its broker failed or went away before its worker served)"
            );
            crate::abandon::undo(
                runtime.anchor_api().await?,
                runtime.pods().await?,
                id,
                generation,
                None,
                &why,
            )
            .await?;
            if let Some(pod) = worker {
                report
                    .killed_workers
                    .push((*id, format!("pod/{}", pod.name_any())));
            }
            note(
                runtime,
                id,
                format!("undid the abandoned attach of generation {generation}"),
            )
            .await;
            return Ok(());
        }
        SessionState::Running => {
            if let Some(pod) = worker {
                if names::pod_generation(&pod.metadata) < Some(record.generation) {
                    runtime.delete_pod(pod, Some(KILL_GRACE)).await?;
                    report
                        .killed_workers
                        .push((*id, format!("pod/{}", pod.name_any())));
                    note(
                        runtime,
                        id,
                        format!(
                            "deleted a worker of an older generation than {}",
                            record.generation
                        ),
                    )
                    .await;
                }
            }
            let idle_for = Duration::from_secs(now().saturating_sub(last_active(anchor, &record)));
            let idle = policy.idle_ttl.is_some_and(|ttl| idle_for >= ttl);
            if idle && suspend_idle(runtime, id, anchor, &record, idle_for).await? {
                report.suspended_idle.push(*id);
            }
        }
        _ => {
            if let Some(pod) = worker {
                let _ = runtime
                    .retire_previous(id, record.generation + 1, Duration::ZERO)
                    .await;
                runtime.delete_pod(pod, Some(KILL_GRACE)).await?;
                report
                    .killed_workers
                    .push((*id, format!("pod/{}", pod.name_any())));
                note(
                    runtime,
                    id,
                    format!("deleted a worker of a {} session", record.state()),
                )
                .await;
            }
        }
    }
    expire_storage(runtime, id, &record, report).await?;
    if record.state() == SessionState::Closed {
        expire_record(runtime, id, anchor, &record, report).await?;
    }
    Ok(())
}

/// Checks the session's own claim against the pass's listing and records a loss found there
/// (compare-and-swap on the anchor the pass read: a session changed since is left to the next
/// pass, which returns `None`). Returns the record to decide from.
async fn storage(
    runtime: &KubernetesRuntime,
    id: &SessionId,
    anchor: &OabSession,
    record: SessionRecord,
    claims: &HashMap<String, &PersistentVolumeClaim>,
    report: &mut ReconcileReport,
) -> Result<Option<SessionRecord>> {
    let owned = matches!(record.volume, Volume::Owned { .. });
    if !owned || record.phase == Phase::Provisioning || !storage_loss::expects_storage(&record) {
        return Ok(Some(record));
    }
    let found = record.volume.claim().and_then(|claim| claims.get(claim)).copied();
    let Some(lost) = storage_loss::loss(&record, found) else {
        return Ok(Some(record));
    };
    let mut next = record.clone();
    next.storage_lost = Some(lost.clone());
    match runtime.swap(anchor, &next).await {
        Ok(_) => {}
        Err(Swap::Lost) => return Ok(None),
        Err(Swap::Failed(error)) => return Err(error),
    }
    tracing::warn!(session = %id, claim = %lost.claim, "the session's storage is lost: {}", lost.describe());
    report.lost_storage.push((*id, lost.describe()));
    // Deciding from the record just written would be deciding from a stale anchor.
    Ok(None)
}

/// The last sign of life: the anchor's `status.renewTime` (renewed by whichever broker holds a live
/// attachment, and by every record update) or the record's last activity.
fn last_active(anchor: &OabSession, record: &SessionRecord) -> u64 {
    let renewed = anchor
        .status
        .as_ref()
        .and_then(|status| status.renew_time.as_deref())
        .and_then(crate::anchor::seconds_of)
        .unwrap_or(0);
    renewed.max(record.last_activity)
}

/// Suspends the session if its anchor is still the one that showed it idle: a renewal or an
/// attach since then makes the swap lose, and the session is left running.
async fn suspend_idle(
    runtime: &KubernetesRuntime,
    id: &SessionId,
    anchor: &OabSession,
    record: &SessionRecord,
    idle_for: Duration,
) -> Result<bool> {
    let mut next = record.clone();
    next.phase = Phase::Session(SessionState::Suspended);
    next.suspend_reason = Some(SuspendReason::Idle);
    next.worker = None;
    next.last_activity = now();
    next.last_reconcile = Some(ReconcileNote {
        at: now(),
        action: format!(
            "suspended: no live attachment for {}",
            humantime::format_duration(idle_for)
        ),
    });
    match runtime.swap(anchor, &next).await {
        Ok(_) => {}
        Err(Swap::Lost) => return Ok(false),
        Err(Swap::Failed(error)) => return Err(error),
    }
    let _ = runtime
        .retire_previous(id, record.generation, Duration::ZERO)
        .await;
    // The Pod's own termination grace: the agent gets to stop as it would on any suspend.
    runtime
        .stop_worker(id, record.generation, None, record.served_worker())
        .await?;
    Ok(true)
}

/// Deletes retained claims whose time is up: a closed session's own volume, and those of the
/// thread's earlier sessions (whatever state the current one is in).
async fn expire_storage(
    runtime: &KubernetesRuntime,
    id: &SessionId,
    record: &SessionRecord,
    report: &mut ReconcileReport,
) -> Result<()> {
    let now = now();
    let expired = |until: Option<u64>| until.is_some_and(|until| until <= now);
    let own = match (&record.close, &record.volume) {
        (Some(close), Volume::Owned { claim, uid })
            if close.retention == Retention::Retain
                && expired(close.retain_until)
                && record.storage_lost.is_none() =>
        {
            Some((claim.clone(), uid.clone()))
        }
        _ => None,
    };
    let earlier: Vec<_> = record
        .retained
        .iter()
        .filter(|kept| expired(kept.until))
        .map(|kept| (kept.claim.clone(), kept.uid.clone()))
        .collect();
    if own.is_none() && earlier.is_empty() {
        return Ok(());
    }
    for (claim, uid) in own.iter().chain(&earlier) {
        runtime.delete_claim(id, claim, uid.as_deref()).await?;
    }
    let gone: Vec<String> = own
        .iter()
        .chain(&earlier)
        .map(|(claim, _)| claim.clone())
        .collect();
    runtime
        .update(id, |current| {
            let mut next = current.clone();
            if let (Some(close), Some(claim)) = (next.close.as_mut(), current.volume.claim()) {
                if gone.iter().any(|c| c == claim) {
                    *close = CloseRecord {
                        retention: Retention::Delete,
                        ..*close
                    };
                }
            }
            next.retained.retain(|kept| !gone.contains(&kept.claim));
            next.last_reconcile = Some(ReconcileNote {
                at: now,
                action: format!("deleted retained storage past its time: {}", gone.join(", ")),
            });
            Ok((next != *current).then_some(next))
        })
        .await?;
    report.expired_storage.push(*id);
    Ok(())
}

/// Removes a closed record that holds nothing any more, once it has been closed for the
/// configured time. Preconditioned on the anchor read: a create since then keeps it.
async fn expire_record(
    runtime: &KubernetesRuntime,
    id: &SessionId,
    anchor: &OabSession,
    record: &SessionRecord,
    report: &mut ReconcileReport,
) -> Result<()> {
    let closed_for = record.closed_at.map(|at| now().saturating_sub(at));
    let due = closed_for.is_some_and(|s| s >= runtime.housekeeping.closed_record_ttl.as_secs());
    if !due || record.holds_storage() {
        return Ok(());
    }
    if remove_anchor(runtime, anchor).await? {
        report.expired_records.push(*id);
    }
    Ok(())
}

/// An anchor someone deleted (`kubectl delete oabsession`): its session closes with reason
/// `ended` and the profile's retention, and the close finalizer goes once the record holds
/// nothing. A volume that retention keeps holds it until the retention ends, so the record that
/// will delete the volume then is never lost first. A pass that changes nothing reads nothing.
async fn finish_deletion(
    runtime: &KubernetesRuntime,
    id: &SessionId,
    anchor: &OabSession,
    record: SessionRecord,
    report: &mut ReconcileReport,
) -> Result<()> {
    let closed_now = match record.state() {
        SessionState::Closed => false,
        SessionState::Closing => {
            runtime
                .finish_close(id, (anchor.clone(), record.clone()), None)
                .await?;
            true
        }
        _ => {
            runtime.close_locked(id, CloseReason::Ended).await?;
            note(runtime, id, "closed: its anchor was deleted".to_owned()).await;
            true
        }
    };
    let (mut anchor, mut record) = (anchor.clone(), record);
    if closed_now {
        report.finished_closes.push(*id);
        let Some(read) = runtime.load(id).await? else {
            return Ok(());
        };
        (anchor, record) = read;
    }
    let expired = report.expired_storage.len();
    expire_storage(runtime, id, &record, report).await?;
    if report.expired_storage.len() > expired {
        let Some(read) = runtime.load(id).await? else {
            return Ok(());
        };
        (anchor, record) = read;
    }
    if record.state() == SessionState::Closed
        && !record.holds_storage()
        && remove_anchor(runtime, &anchor).await?
    {
        report.expired_records.push(*id);
    }
    Ok(())
}

/// Removes an anchor if it is still the one read: drops the close finalizer, then deletes it
/// (a deleted anchor goes with its finalizer). `false` when it changed or went meanwhile.
async fn remove_anchor(runtime: &KubernetesRuntime, anchor: &OabSession) -> Result<bool> {
    let api = runtime.anchor_api().await?;
    let name = anchor.name_any();
    let mut current = anchor.clone();
    if current.has_close_finalizer() {
        current.finalizers_mut().retain(|f| f != CLOSE_FINALIZER);
        current = match api.replace(&name, &PostParams::default(), &current).await {
            Ok(written) => written,
            Err(error) if is_status(&error, 404) || is_status(&error, 409) => return Ok(false),
            Err(error) => return Err(api_error(&format!("releasing the anchor {name}"), error)),
        };
        if anchor.is_deleted() {
            return Ok(true);
        }
    }
    delete_if_unchanged(api, &current, &format!("removing the anchor {name}")).await
}

async fn delete_orphaned_claim(runtime: &KubernetesRuntime, claim: &PersistentVolumeClaim) -> Result<()> {
    let what = format!("deleting orphaned claim {}", claim.name_any());
    delete_if_unchanged(runtime.claims().await?, claim, &what)
        .await
        .map(drop)
}

/// Records what the pass did on the session's status. Best effort: the action itself is done,
/// and a lost note is only a less informative status.
async fn note(runtime: &KubernetesRuntime, id: &SessionId, action: String) {
    let written = runtime
        .update(id, |current| {
            let mut next = current.clone();
            next.last_reconcile = Some(ReconcileNote {
                at: now(),
                action: action.clone(),
            });
            Ok(Some(next))
        })
        .await;
    if let Err(error) = written {
        tracing::debug!(session = %id, "recording a reconcile note failed: {error}");
    }
}

async fn list<K>(api: &kube::Api<K>, installation: &str, role: &str, what: &str) -> Result<Vec<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = ListParams::default().labels(&format!(
        "{},{}={role}",
        names::installation_selector(installation),
        names::ROLE
    ));
    Ok(api
        .list(&params)
        .await
        .map_err(|e| api_error(&format!("listing {what}"), e))?
        .items)
}

/// Whether an object without a record is past the orphan grace (see `orphan_grace`).
fn is_old(meta: &ObjectMeta, runtime: &KubernetesRuntime) -> bool {
    let now = k8s_openapi::jiff::Timestamp::now();
    let grace = i64::try_from(runtime.housekeeping.orphan_grace.as_secs()).unwrap_or(i64::MAX);
    meta.creation_timestamp
        .as_ref()
        .is_some_and(|created| now.duration_since(created.0).as_secs() >= grace)
}

impl KubernetesRuntime {
    /// The pass's policy: the profile's idle TTL, else the runtime's. A profile that cannot be
    /// read leaves the runtime's (and says so), rather than stopping the whole pass.
    pub(crate) async fn policy(&self) -> Policy {
        let idle_ttl = match self.read_profile().await {
            Ok(profile) => profile.idle_ttl.or(self.housekeeping.idle_ttl),
            Err(error) => {
                tracing::warn!("reconcile: using the default idle TTL: {error}");
                self.housekeeping.idle_ttl
            }
        };
        Policy { idle_ttl }
    }
}
