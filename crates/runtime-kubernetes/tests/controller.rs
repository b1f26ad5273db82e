//! The controller on the real control plane: one leader at a time, a clean handover on shutdown,
//! a takeover only after a vanished leader's term ran out (each with a newer epoch), and a leader
//! that acts on a watch event without waiting for its next full pass.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test controller -- --ignored`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{runtime, AdminObject, WORKER_PROFILE};
use runtime_kubernetes::{Controller, ControllerEvent, KubernetesRuntime, LeaderElection, Term};
use session_runtime::config::Reach;
use session_runtime::SessionRuntime;
use test_cluster::{unique_name, TestCluster};
use tokio::sync::{mpsc, oneshot};

const TERM: Duration = Duration::from_secs(3);

struct Running {
    events: mpsc::UnboundedReceiver<ControllerEvent>,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<session_runtime::Result<()>>,
}

impl Running {
    /// Waits up to `timeout` for the controller to lead, and returns its term.
    async fn leading_within(&mut self, timeout: Duration) -> Option<Term> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            match tokio::time::timeout_at(deadline, self.events.recv()).await {
                Ok(Some(ControllerEvent::Leading(term))) => return Some(term),
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return None,
            }
        }
    }

    /// Stops it as a SIGTERM would: it gives the Lease up.
    async fn shut_down(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.task
            .await
            .expect("the controller task")
            .expect("a clean shutdown");
    }

    /// Stops it as a crash would: the Lease stays with it until the term runs out.
    fn vanish(self) {
        self.task.abort();
    }
}

fn start(
    cluster: &TestCluster,
    runtime: &Arc<KubernetesRuntime>,
    installation: &str,
    holder: &str,
    resync: Duration,
) -> Running {
    let election = LeaderElection::new(
        cluster.broker(),
        cluster.sessions_namespace(),
        installation,
        holder,
    )
    .with_duration(TERM);
    let mut controller = Controller::new(Arc::clone(runtime), election).resync(resync);
    let events = controller.subscribe();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(controller.run(async move {
        let _ = stopped.await;
    }));
    Running {
        events,
        stop: Some(stop),
        task,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn one_controller_leads_at_a_time_and_each_handover_has_a_newer_epoch() {
    let installation = unique_name("leader");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let resync = Duration::from_secs(60);

    let mut first = start(&cluster, &runtime, &installation, "first", resync);
    let first_term = first
        .leading_within(TERM * 3)
        .await
        .expect("the only candidate leads");
    let mut second = start(&cluster, &runtime, &installation, "second", resync);
    assert_eq!(
        second.leading_within(TERM * 2).await,
        None,
        "a second controller must not lead while the first renews"
    );

    // A shutdown gives the Lease up: the other takes it without waiting for the term.
    first.shut_down().await;
    let second_term = second
        .leading_within(TERM * 2)
        .await
        .expect("the waiting candidate leads");
    assert!(
        second_term.epoch > first_term.epoch,
        "{second_term:?} after {first_term:?}"
    );

    // A leader that vanishes keeps the Lease until its term runs out, then a newcomer takes it.
    second.vanish();
    let vanished_at = tokio::time::Instant::now();
    let mut third = start(&cluster, &runtime, &installation, "third", resync);
    let third_term = third
        .leading_within(TERM * 4)
        .await
        .expect("a newcomer leads once the term ran out");
    assert!(
        vanished_at.elapsed() >= TERM,
        "the Lease was taken before the vanished leader's term could run out"
    );
    assert!(
        third_term.epoch > second_term.epoch,
        "{third_term:?} after {second_term:?}"
    );
    third.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn a_leader_finishes_an_interrupted_close_from_the_watch_before_its_next_pass() {
    let installation = unique_name("watching");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    // The first full pass runs at once; the next only after the test is over.
    let mut leader = start(
        &cluster,
        &runtime,
        &installation,
        "watcher",
        Duration::from_secs(600),
    );
    leader.leading_within(TERM * 3).await.expect("it leads");
    let first_pass = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(event) = leader.events.recv().await {
            if matches!(event, ControllerEvent::Pass(_)) {
                return;
            }
        }
    });
    first_pass.await.expect("the leader's first full pass");

    let id = common::finished_interrupted_close(
        &cluster,
        &profile,
        &installation,
        "interrupted",
        Duration::from_secs(30),
    )
    .await;
    // The record says closed as soon as the pass wrote it; the pass reports just after.
    let finished_by_watch = tokio::time::timeout(Duration::from_secs(10), async {
        while let Some(event) = leader.events.recv().await {
            match event {
                ControllerEvent::Session(session, report)
                    if session == id && report.finished_closes.contains(&id) =>
                {
                    return true;
                }
                // A full pass would be the resync's, not the watch's.
                ControllerEvent::Pass(report) if report.finished_closes.contains(&id) => return false,
                _ => {}
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    assert!(
        finished_by_watch,
        "the close was finished by a watch-triggered pass"
    );
    let status = runtime.status(&id).await.expect("status");
    assert!(status
        .last_reconcile
        .is_some_and(|note| note.action.contains("close")));
    leader.shut_down().await;
}
