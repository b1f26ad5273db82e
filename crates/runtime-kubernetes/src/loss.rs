//! Noticing that a live attachment's worker is gone: one watch of the installation's worker Pods
//! per broker, shared by every attachment, tells each the moment its Pod is deleted (a force
//! delete, an eviction, the Pod GC after its node was removed) or failed, so the attachment ends
//! with that cause at once instead of after the relay client's reconnect budget.
//!
//! The same watch keeps what it saw of each worker Pod ([`WorkerWatch::observe`]), so a broker
//! waiting for its worker to start or to go waits on it instead of opening a watch of its own.
//!
//! A graceful end needs none of this: the relay reports the agent's exit before its Pod goes, and
//! an attachment that has ended stops listening. A node that only stops answering keeps its Pods
//! until the node controller evicts them; until then the reconnect budget is what ends the
//! attachment.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::{self, Event};
use kube::{Api, ResourceExt};
use parking_lot::Mutex;
use session_runtime::WorkerFailure;
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use crate::start::{progress, Progress};

/// How many deleted Pods' UIDs the watch remembers (see [`Observed::Absent`]).
const REMEMBERED_DELETIONS: usize = 4096;

/// The shared watch, started by the first attachment or wait that asks.
#[derive(Debug)]
pub(crate) struct WorkerWatch {
    pods: Api<Pod>,
    selector: String,
    state: Arc<Mutex<Watched>>,
    /// Counts the events applied: a waiter looks again whenever it moves.
    changes: tokio::sync::watch::Sender<u64>,
    task: std::sync::OnceLock<AbortHandle>,
}

/// A worker Pod as the shared watch last saw it.
#[derive(Debug, Clone)]
pub(crate) enum Observed {
    /// The Pod of that name (whichever UID it has).
    Pod(Box<Pod>),
    /// No Pod of that name. `deleted`: the Pod with the UID asked about was seen deleted (or
    /// missing from a relist after it had been seen); otherwise the watch may not have seen it
    /// yet (it was created a moment ago), so absence alone proves nothing.
    Absent { deleted: bool },
}

#[derive(Debug, Default)]
struct Watched {
    /// By Pod UID: who to tell, and the list round the subscription came in.
    listeners: HashMap<String, Listener>,
    /// Counts the watch's (re)lists; a listener is checked against a list only if it subscribed
    /// before that list began (its Pod then must be in it).
    round: u64,
    /// The Pods by name, once the first list is done.
    pods: Option<HashMap<String, Pod>>,
    /// The Pods the list in progress has shown, by name.
    listing: HashMap<String, Pod>,
    /// The UIDs of Pods seen deleted, the oldest first.
    deleted: VecDeque<String>,
    /// The watch failed and has delivered nothing since: `pods` may miss a Pod.
    failing: bool,
}

#[derive(Debug)]
struct Listener {
    pod: String,
    round: u64,
    tell: oneshot::Sender<WorkerFailure>,
}

impl Watched {
    /// Registers a listener for `pod` (by UID), as of the current list round.
    fn listen(&mut self, pod: &Pod) -> oneshot::Receiver<WorkerFailure> {
        let (tell, told) = oneshot::channel();
        let listener = Listener {
            pod: pod.name_any(),
            round: self.round,
            tell,
        };
        self.listeners.insert(pod.uid().unwrap_or_default(), listener);
        told
    }

    fn tell(&mut self, uid: &str, cause: impl FnOnce(&str) -> WorkerFailure) {
        if let Some(listener) = self.listeners.remove(uid) {
            let _ = listener.tell.send(cause(&listener.pod));
        }
    }

    fn apply(&mut self, event: Event<Pod>) {
        self.failing = false;
        match event {
            Event::Init => {
                self.round += 1;
                self.listing.clear();
            }
            Event::InitApply(pod) => {
                self.applied(&pod);
                self.listing.insert(pod.name_any(), pod);
            }
            Event::Apply(pod) => {
                self.applied(&pod);
                if let Some(pods) = self.pods.as_mut() {
                    pods.insert(pod.name_any(), pod);
                }
            }
            Event::Delete(pod) => {
                let uid = pod.uid().unwrap_or_default();
                self.tell(&uid, deleted);
                if let Some(pods) = self.pods.as_mut() {
                    if pods
                        .get(&pod.name_any())
                        .is_some_and(|known| known.uid() == pod.uid())
                    {
                        pods.remove(&pod.name_any());
                    }
                }
                self.remember_deleted(uid);
            }
            Event::InitDone => {
                let listing = std::mem::take(&mut self.listing);
                let listed: HashSet<String> = listing.values().filter_map(|pod| pod.uid()).collect();
                let missing: Vec<String> = self
                    .pods
                    .iter()
                    .flat_map(HashMap::values)
                    .filter_map(|pod| pod.uid())
                    .filter(|uid| !listed.contains(uid))
                    .collect();
                for uid in missing {
                    self.remember_deleted(uid);
                }
                self.pods = Some(listing);
                let round = self.round;
                let gone: Vec<String> = self
                    .listeners
                    .iter()
                    .filter(|(uid, listener)| listener.round < round && !listed.contains(*uid))
                    .map(|(uid, _)| uid.clone())
                    .collect();
                for uid in gone {
                    self.tell(&uid, deleted);
                }
            }
        }
        // Attachments that ended stopped listening.
        self.listeners.retain(|_, listener| !listener.tell.is_closed());
    }

    fn remember_deleted(&mut self, uid: String) {
        if self.deleted.len() == REMEMBERED_DELETIONS {
            self.deleted.pop_front();
        }
        self.deleted.push_back(uid);
    }

    /// The Pod `name` as last seen, for a caller that knows it by `uid`; `None` before the
    /// first list is done.
    fn observe(&self, name: &str, uid: &str) -> Option<Observed> {
        let pods = self.pods.as_ref()?;
        Some(match pods.get(name) {
            Some(pod) => Observed::Pod(Box::new(pod.clone())),
            None => Observed::Absent {
                deleted: self.deleted.iter().any(|gone| gone == uid),
            },
        })
    }

    fn applied(&mut self, pod: &Pod) {
        if let Progress::Failed(cause) = progress(pod) {
            self.tell(&pod.uid().unwrap_or_default(), |_| cause);
        }
    }
}

fn deleted(pod: &str) -> WorkerFailure {
    WorkerFailure::Evicted(format!(
        "the worker Pod {pod} was deleted under the live attachment; the next attach starts a new one"
    ))
}

impl WorkerWatch {
    /// A watch of the Pods that `selector` picks, not started yet.
    pub(crate) fn new(pods: Api<Pod>, selector: String) -> Self {
        Self {
            pods,
            selector,
            state: Arc::default(),
            changes: tokio::sync::watch::channel(0).0,
            task: std::sync::OnceLock::new(),
        }
    }

    /// The worker Pod `name` as the watch last saw it, asked about by `uid` (see
    /// [`Observed::Absent`]); `None` until the watch has listed the Pods once. Starts the watch.
    pub(crate) fn observe(&self, name: &str, uid: &str) -> Option<Observed> {
        self.start();
        self.state.lock().observe(name, uid)
    }

    /// The Pods `keep` picks as the watch last saw them; `None` until the watch has listed the
    /// Pods once, and while it fails (from an error until its next event). Starts the watch.
    pub(crate) fn pods_where(&self, keep: impl Fn(&Pod) -> bool) -> Option<Vec<Pod>> {
        self.start();
        let state = self.state.lock();
        if state.failing {
            return None;
        }
        let pods = state.pods.as_ref()?;
        Some(pods.values().filter(|pod| keep(pod)).cloned().collect())
    }

    /// Moves whenever the watch applied an event: look again with [`observe`](Self::observe).
    /// Starts the watch.
    pub(crate) fn changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.start();
        self.changes.subscribe()
    }

    /// Resolves with the cause when `pod` (that Pod: by UID) is deleted or fails; never, if the
    /// watch cannot say. Dropping it stops listening.
    pub(crate) fn lost(&self, pod: &Pod) -> impl Future<Output = WorkerFailure> + Send + 'static {
        self.start();
        let told = self.state.lock().listen(pod);
        async move {
            match told.await {
                Ok(cause) => cause,
                Err(_) => std::future::pending().await,
            }
        }
    }

    fn start(&self) {
        self.task.get_or_init(|| {
            let state = Arc::clone(&self.state);
            let changes = self.changes.clone();
            let config = watcher::Config::default().labels(&self.selector);
            crate::api::spawn_watch(self.pods.clone(), config, move |event| match event {
                Ok(event) => {
                    state.lock().apply(event);
                    changes.send_modify(|count| *count += 1);
                }
                // The backoff retries; a relist afterwards catches what was missed.
                Err(error) => {
                    tracing::debug!("watching worker Pods failed: {error}");
                    state.lock().failing = true;
                }
            })
        });
    }
}

impl Drop for WorkerWatch {
    fn drop(&mut self) {
        if let Some(task) = self.task.get() {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    fn pod(name: &str, uid: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                uid: Some(uid.to_owned()),
                ..ObjectMeta::default()
            },
            ..Pod::default()
        }
    }

    #[test]
    fn a_deleted_pod_is_told_by_uid_and_a_namesake_is_not_it() {
        let mut state = Watched::default();
        let mut told = state.listen(&pod("oab-w-a", "uid-1"));
        state.apply(Event::Delete(pod("oab-w-a", "uid-0")));
        assert!(
            told.try_recv().is_err(),
            "an older Pod of the same name is not this one"
        );
        state.apply(Event::Apply(pod("oab-w-a", "uid-1")));
        assert!(told.try_recv().is_err(), "a running Pod is not lost");
        state.apply(Event::Delete(pod("oab-w-a", "uid-1")));
        match told.try_recv() {
            Ok(WorkerFailure::Evicted(why)) => assert!(why.contains("oab-w-a"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert!(state.listeners.is_empty());
    }

    #[test]
    fn a_relist_that_misses_a_pod_tells_only_listeners_that_came_before_it() {
        let mut state = Watched::default();
        let mut before = state.listen(&pod("oab-w-a", "uid-a"));
        state.apply(Event::Init);
        // Subscribed while the list runs: the list may predate its Pod.
        let mut during = state.listen(&pod("oab-w-b", "uid-b"));
        state.apply(Event::InitApply(pod("oab-w-c", "uid-c")));
        state.apply(Event::InitDone);
        assert!(
            matches!(before.try_recv(), Ok(WorkerFailure::Evicted(_))),
            "gone while unwatched"
        );
        assert!(during.try_recv().is_err(), "not judged by a list older than it");
        let mut kept = state.listen(&pod("oab-w-c", "uid-c"));
        state.apply(Event::Init);
        state.apply(Event::InitApply(pod("oab-w-c", "uid-c")));
        state.apply(Event::InitDone);
        assert!(kept.try_recv().is_err(), "listed again: still there");
    }

    fn observed_uid(state: &Watched, name: &str, uid: &str) -> Option<Result<String, bool>> {
        state.observe(name, uid).map(|observed| match observed {
            Observed::Pod(pod) => Ok(pod.uid().unwrap_or_default()),
            Observed::Absent { deleted } => Err(deleted),
        })
    }

    /// What a waiter sees: nothing before the first list; then each Pod by name; a deleted one
    /// (or one a relist misses) absent and known deleted, one never seen absent and unknown.
    #[test]
    fn the_watch_keeps_what_it_saw_of_each_pod_and_which_were_deleted() {
        let mut state = Watched::default();
        state.apply(Event::Init);
        state.apply(Event::InitApply(pod("oab-w-a", "uid-a")));
        assert_eq!(observed_uid(&state, "oab-w-a", "uid-a"), None, "not listed yet");
        state.apply(Event::InitDone);
        assert_eq!(observed_uid(&state, "oab-w-a", "uid-a"), Some(Ok("uid-a".into())));
        assert_eq!(
            observed_uid(&state, "oab-w-b", "uid-b"),
            Some(Err(false)),
            "not seen: maybe not yet"
        );
        state.apply(Event::Apply(pod("oab-w-b", "uid-b")));
        state.apply(Event::Delete(pod("oab-w-a", "uid-a")));
        assert_eq!(observed_uid(&state, "oab-w-a", "uid-a"), Some(Err(true)));
        // A namesake's deletion does not remove the Pod now under that name.
        state.apply(Event::Delete(pod("oab-w-b", "uid-old")));
        assert_eq!(observed_uid(&state, "oab-w-b", "uid-b"), Some(Ok("uid-b".into())));
        // Missing from a relist: deleted while the watch was away.
        state.apply(Event::Init);
        state.apply(Event::InitDone);
        assert_eq!(observed_uid(&state, "oab-w-b", "uid-b"), Some(Err(true)));
    }

    #[test]
    fn a_failed_pod_is_told_with_its_classified_cause_and_ended_listeners_are_dropped() {
        use k8s_openapi::api::core::v1::{
            ContainerState, ContainerStateTerminated, ContainerStatus, PodStatus,
        };
        let mut state = Watched::default();
        let mut told = state.listen(&pod("oab-w-a", "uid-a"));
        let gone = state.listen(&pod("oab-w-b", "uid-b"));
        drop(gone);
        let mut failed = pod("oab-w-a", "uid-a");
        failed.status = Some(PodStatus {
            container_statuses: Some(vec![ContainerStatus {
                name: "relay".to_owned(),
                state: Some(ContainerState {
                    terminated: Some(ContainerStateTerminated {
                        exit_code: 137,
                        reason: Some("OOMKilled".to_owned()),
                        ..ContainerStateTerminated::default()
                    }),
                    ..ContainerState::default()
                }),
                ..ContainerStatus::default()
            }]),
            ..PodStatus::default()
        });
        state.apply(Event::Apply(failed));
        assert!(matches!(told.try_recv(), Ok(WorkerFailure::OutOfMemory)));
        assert!(state.listeners.is_empty(), "the ended listener was dropped too");
    }
}
