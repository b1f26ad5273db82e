//! The real API server with faults in front of it (`common::faults`): throttling and server
//! errors are retryable errors that leave a record the next call or `reconcile` finishes, and a
//! controller whose watch breaks resumes it and still acts.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --all-features --test api_faults -- --ignored`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{AdminObject, WORKER_PROFILE};
use runtime_kubernetes::{Controller, ControllerEvent, KubernetesRuntime, LeaderElection};
use session_runtime::config::Reach;
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime, SessionState};
use test_cluster::faults::{Faults, Rule};
use test_cluster::k8s_openapi::api::core::v1::PersistentVolumeClaim;
use test_cluster::kube::Api;
use test_cluster::{unique_name, wait_until, TestCluster};

fn runtime_with(
    cluster: &TestCluster,
    faults: &Faults,
    profile: &AdminObject,
    installation: &str,
) -> Arc<KubernetesRuntime> {
    Arc::new(
        common::builder_through(cluster, faults, profile, Reach::Exec, installation)
            .orphan_grace(Duration::ZERO)
            .build()
            .expect("runtime"),
    )
}

fn expect_retryable(result: session_runtime::Result<impl std::fmt::Debug>, status: u16) {
    match result {
        Err(error @ Error::Backend { retryable: true, .. }) => {
            let chain = format!("{error}: {:?}", std::error::Error::source(&error));
            assert!(
                chain.contains(&status.to_string()),
                "{status}: the cause is kept: {chain}"
            );
        }
        other => panic!("{status}: expected a retryable backend error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn throttling_and_server_errors_are_retryable_and_what_they_interrupt_is_finished() {
    let installation = unique_name("api-faults");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    for (thread, status) in [("t429", 429), ("t500", 500), ("t503", 503), ("t504", 504)] {
        let faults = Faults::new();
        let runtime = runtime_with(&cluster, &faults, &profile, &installation);
        let identity = SessionIdentity::new(&installation, "agent", "test", thread).expect("identity");
        let id = identity.id();

        // Create: the claim's POST fails after the anchor named it.
        faults.add(Rule {
            method: http::Method::POST,
            target: "/persistentvolumeclaims".into(),
            skip: 0,
            times: 1,
            status,
        });
        expect_retryable(runtime.create(&identity, &CreateOptions::new()).await, status);
        assert_eq!(faults.answered().len(), 1, "{:?}", faults.answered());
        let claim = format!("oab-d-{id}-1");
        assert!(claims.get_opt(&claim).await.expect("read").is_none());
        // The record names the claim it will make, so the retry makes exactly that one.
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("the retried create");
        assert!(claims.get_opt(&claim).await.expect("read").is_some());
        let report = runtime.reconcile().await.expect("reconcile");
        assert!(
            report.orphaned_storage.is_empty() && report.errors.is_empty(),
            "{report:?}"
        );

        // Close: the close is recorded, then the write that marks it closed fails.
        faults.add(Rule {
            method: http::Method::PUT,
            target: "/oabsessions/oab-s-".into(),
            skip: 1,
            times: 1,
            status,
        });
        expect_retryable(runtime.close(&id, CloseReason::Reset).await, status);
        assert_eq!(
            runtime.status(&id).await.expect("status").state,
            SessionState::Closing,
            "the intent is durable"
        );
        let report = runtime.reconcile().await.expect("reconcile");
        assert_eq!(report.finished_closes, [id], "{report:?}");
        assert_eq!(
            runtime.status(&id).await.expect("status").state,
            SessionState::Closed
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn a_controller_whose_watch_breaks_resumes_it_and_still_acts() {
    let installation = unique_name("broken-watch");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let faults = Faults::new();
    let runtime = runtime_with(&cluster, &faults, &profile, &installation);
    // The first watches of the anchors fail: the watcher backs off and watches again.
    faults.add(Rule {
        method: http::Method::GET,
        target: "watch=true".into(),
        skip: 0,
        times: 3,
        status: 500,
    });
    let election = LeaderElection::new(
        cluster.broker(),
        cluster.sessions_namespace(),
        &installation,
        "watcher",
    )
    .with_duration(Duration::from_secs(3));
    let mut controller = Controller::new(Arc::clone(&runtime), election).resync(Duration::from_secs(600));
    let mut events = controller.subscribe();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(controller.run(async move {
        let _ = stopped.await;
    }));
    tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(event) = events.recv().await {
            if matches!(event, ControllerEvent::Pass(_)) {
                return;
            }
        }
    })
    .await
    .expect("the first full pass");
    wait_until(
        "every injected watch failure to be served",
        Duration::from_secs(60),
        || async { (faults.answered().len() == 3).then_some(()) },
    )
    .await;

    common::finished_interrupted_close(
        &cluster,
        &profile,
        &installation,
        "watched",
        Duration::from_secs(60),
    )
    .await;
    let _ = stop.send(());
    task.await.expect("join").expect("a clean shutdown");
}
