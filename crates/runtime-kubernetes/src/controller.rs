//! The installation's controller (`oab-runtime controller`): reconciles while it leads.
//!
//! It waits for the installation's leader Lease ([`LeaderElection`]), then, while it holds it,
//! reconciles level-triggered: a full pass when it takes over and every `resync` (the time-based
//! rules: idle workers, retention, closed records, orphans), and one session at a time whenever a
//! watch reports a change to that session's anchor or worker Pod (a close interrupted a moment
//! ago, a worker of an older generation). The per-session passes decide from the watches' caches
//! and write only when they act; every action is a compare-and-swap or a UID-preconditioned
//! delete, so a cache that lags, or a second controller that has not noticed it lost the Lease,
//! cannot act on the wrong object.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{watcher, WatchStreamExt};
use session_runtime::{ReconcileReport, Result, SessionId};
use tokio::sync::{mpsc, watch};

use crate::anchor::OabSession;
use crate::leader::{LeaderElection, Term};
use crate::reconcile::{self, Policy};
use crate::{names, KubernetesRuntime};

/// What a controller did, for whoever watches it (logs, tests).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ControllerEvent {
    /// It took the leader Lease: it reconciles from now on.
    Leading(Term),
    /// It lost the Lease (another holder took it, or it could not renew in time): it stopped
    /// reconciling and waits to lead again.
    Following,
    /// A full pass ended.
    Pass(ReconcileReport),
    /// A pass over one session, triggered by a watch, acted or failed.
    Session(SessionId, ReconcileReport),
}

/// Reconciles an installation's sessions while it holds the installation's leader Lease.
pub struct Controller {
    runtime: Arc<KubernetesRuntime>,
    election: LeaderElection,
    resync: Duration,
    events: Option<mpsc::UnboundedSender<ControllerEvent>>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("election", &self.election)
            .field("resync", &self.resync)
            .finish_non_exhaustive()
    }
}

/// Why leading ended.
enum Ended {
    Shutdown,
    Lost,
}

impl Controller {
    /// How often a leader runs a full pass, unless set.
    pub const DEFAULT_RESYNC: Duration = Duration::from_secs(60);

    /// A controller for `runtime`'s installation that leads through `election`.
    pub fn new(runtime: Arc<KubernetesRuntime>, election: LeaderElection) -> Self {
        Controller {
            runtime,
            election,
            resync: Self::DEFAULT_RESYNC,
            events: None,
        }
    }

    /// How often a full pass runs while leading (default [`Self::DEFAULT_RESYNC`]); the
    /// time-based rules (idle TTL, retention, record expiry, orphans) act at most this late.
    pub fn resync(mut self, every: Duration) -> Self {
        self.resync = every.max(Duration::from_secs(1));
        self
    }

    /// A stream of what the controller does.
    pub fn subscribe(&mut self) -> mpsc::UnboundedReceiver<ControllerEvent> {
        let (sender, receiver) = mpsc::unbounded_channel();
        self.events = Some(sender);
        receiver
    }

    /// Runs until `shutdown` resolves, then gives the Lease up if it holds it.
    ///
    /// # Errors
    /// Only from giving the Lease up at shutdown; API failures while running are logged, reported
    /// in passes and retried.
    ///
    /// # Cancellation
    /// Dropping the future stops it at once without giving the Lease up: another controller
    /// takes over when the term runs out.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        let retry = self.election.duration() / 3;
        loop {
            let term = loop {
                match self.election.try_acquire().await {
                    Ok(Some(term)) => break term,
                    Ok(None) => {}
                    Err(error) => tracing::warn!("controller: trying for the leader Lease: {error}"),
                }
                tokio::select! {
                    () = &mut shutdown => return Ok(()),
                    () = tokio::time::sleep(retry) => {}
                }
            };
            tracing::info!(
                lease = self.election.lease_name(),
                epoch = term.epoch,
                "controller: leading"
            );
            self.emit(ControllerEvent::Leading(term));
            match self.lead(term, shutdown.as_mut()).await {
                Ended::Shutdown => return self.election.release().await,
                Ended::Lost => {
                    tracing::warn!(
                        lease = self.election.lease_name(),
                        "controller: lost the leader Lease"
                    );
                    self.emit(ControllerEvent::Following);
                }
            }
        }
    }

    async fn lead(&self, term: Term, mut shutdown: std::pin::Pin<&mut impl Future<Output = ()>>) -> Ended {
        let (lost_sender, mut lost) = watch::channel(false);
        let renewal = self.renew(term, lost_sender);
        tokio::pin!(renewal);

        let namespace = self.runtime.namespace().to_owned();
        let (anchors, mut changes, _watching) = match self.watch().await {
            Ok(watching) => watching,
            Err(error) => {
                tracing::warn!("controller: cannot watch the sessions: {error}");
                return Ended::Lost;
            }
        };
        let mut policy = self.runtime.policy().await;
        let mut resync = tokio::time::interval(self.resync);
        loop {
            tokio::select! {
                () = &mut shutdown => return Ended::Shutdown,
                () = &mut renewal => return Ended::Lost,
                _ = lost.changed() => return Ended::Lost,
                _ = resync.tick() => {
                    policy = self.runtime.policy().await;
                    match self.runtime_pass().await {
                        Ok(report) => self.emit(ControllerEvent::Pass(report)),
                        Err(error) => tracing::warn!("controller: a full pass failed: {error}"),
                    }
                }
                Some(first) = changes.recv() => {
                    // Coalesce a burst of events into one pass per session.
                    let mut pending = BTreeSet::from([first]);
                    while let Ok(id) = changes.try_recv() {
                        pending.insert(id);
                    }
                    for id in pending {
                        let report = self.session(&id, &anchors.0, &anchors.1, &namespace, &policy).await;
                        if !report.is_clean() {
                            self.emit(ControllerEvent::Session(id, report));
                        }
                    }
                }
            }
        }
    }

    async fn runtime_pass(&self) -> Result<ReconcileReport> {
        reconcile::run(&self.runtime).await
    }

    /// Renews the Lease three times per term; resolves when the term is lost: another holder has
    /// it, or renewals kept failing for two thirds of a term (before anyone else may take it).
    async fn renew(&self, term: Term, lost: watch::Sender<bool>) {
        let every = self.election.duration() / 3;
        let mut renewed = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(every).await;
            match self.election.try_acquire().await {
                Ok(Some(now)) if now.epoch == term.epoch => renewed = tokio::time::Instant::now(),
                Ok(_) => break,
                Err(error) => {
                    tracing::warn!("controller: renewing the leader Lease: {error}");
                    if renewed.elapsed() >= self.election.duration() * 2 / 3 {
                        break;
                    }
                }
            }
        }
        let _ = lost.send(true);
    }

    /// Caches of the installation's anchors and worker Pods, the sessions they report changes
    /// of, and the watch task, which stops when its guard is dropped.
    async fn watch(
        &self,
    ) -> Result<(
        (Store<OabSession>, Store<Pod>),
        mpsc::UnboundedReceiver<SessionId>,
        AbortOnDrop,
    )> {
        let selector = names::installation_selector(self.runtime.installation());
        let (anchor_store, anchor_writer) = reflector::store();
        let (pod_store, pod_writer) = reflector::store();
        let anchors = watcher(
            self.runtime.anchor_api().await?.clone(),
            watcher::Config::default().labels(&format!("{selector},{}=anchor", names::ROLE)),
        )
        .default_backoff()
        .reflect(anchor_writer)
        .applied_objects()
        .map(|anchor| anchor.map(|anchor| names::session_of(&anchor.metadata)));
        let pods = watcher(
            self.runtime.pods().await?.clone(),
            watcher::Config::default().labels(&format!("{selector},{}=worker", names::ROLE)),
        )
        .default_backoff()
        .reflect(pod_writer)
        .applied_objects()
        .map(|pod| pod.map(|pod| names::session_of(&pod.metadata)));
        let (sender, receiver) = mpsc::unbounded_channel();
        let mut merged = futures_util::stream::select(anchors, pods).boxed();
        let task = tokio::spawn(async move {
            while let Some(event) = merged.next().await {
                match event {
                    Ok(Some(id)) => {
                        if sender.send(id).is_err() {
                            return;
                        }
                    }
                    Ok(None) => {}
                    Err(error) => tracing::debug!("controller: a watch broke (it resumes): {error}"),
                }
                if sender.is_closed() {
                    return;
                }
            }
        });
        let guard = AbortOnDrop(task.abort_handle());
        anchor_store.wait_until_ready().await.ok();
        pod_store.wait_until_ready().await.ok();
        Ok(((anchor_store, pod_store), receiver, guard))
    }

    /// One session, from the caches.
    async fn session(
        &self,
        id: &SessionId,
        anchors: &Store<OabSession>,
        pods: &Store<Pod>,
        namespace: &str,
        policy: &Policy,
    ) -> ReconcileReport {
        let mut report = ReconcileReport::default();
        let Some(anchor) = anchors.get(&ObjectRef::new(&names::anchor(id)).within(namespace)) else {
            // No anchor: the full pass decides about its worker, after the orphan grace.
            return report;
        };
        if !names::belongs_to(&anchor.metadata, id) {
            return report;
        }
        let record = match anchor.record(id) {
            Ok(Some(record)) => record,
            // A create that recorded nothing yet: the full pass decides about it.
            Ok(None) => return report,
            Err(error) => {
                report.errors.push(error.to_string());
                return report;
            }
        };
        let worker = pods
            .get(&ObjectRef::new(&record.worker_pod()).within(namespace))
            .filter(|pod| names::belongs_to(&pod.metadata, id));
        let result = reconcile::session(
            &self.runtime,
            id,
            &anchor,
            record,
            worker.as_deref(),
            policy,
            &mut report,
        )
        .await;
        if let Err(error) = result {
            report.errors.push(format!("session {id}: {error}"));
        }
        reconcile::count_actions(&report);
        report
    }

    fn emit(&self, event: ControllerEvent) {
        if let Some(events) = &self.events {
            let _ = events.send(event);
        }
    }
}

/// Stops a task when dropped: a leader that stops leading closes its watches at once.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
