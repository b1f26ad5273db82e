//! Two brokers, one session: the anchor's compare-and-swap decides, so at most one worker Pod
//! runs and a broker that lost the race is told it was fenced.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test brokers -- --ignored`.

mod common;

use common::{runtime, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime};
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::api::ListParams;
use test_cluster::kube::Api;
use test_cluster::TestCluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_brokers_racing_attach_leave_one_worker_and_fence_the_loser() {
    const INSTALLATION: &str = "two-brokers";
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, INSTALLATION, WORKER_PROFILE).await;
    let first = runtime(&cluster, &profile, Reach::Exec, INSTALLATION);
    let second = runtime(&cluster, &profile, Reach::Exec, INSTALLATION);
    let identity = SessionIdentity::new(INSTALLATION, "agent", "test", "raced").expect("identity");
    let id = identity.id();
    first
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let created_again = second
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    assert!(!created_again.created, "the second broker finds the session");

    for round in 0..3 {
        let (a, b) = tokio::join!(first.attach(&id), second.attach(&id));
        let mut winners = Vec::new();
        for result in [a, b] {
            match result {
                Ok(attachment) => winners.push(attachment),
                Err(Error::Fenced {
                    generation, current, ..
                }) => {
                    assert!(
                        generation < current,
                        "round {round}: fenced by an older generation"
                    )
                }
                Err(other) => panic!("round {round}: an attach may only win or be fenced, got {other}"),
            }
        }
        assert!(!winners.is_empty(), "round {round}: someone must win");
        let status = first.status(&id).await.expect("status");
        let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
        let workers = pods
            .list(&ListParams::default().labels(&format!("openab.dev/session={id}")))
            .await
            .expect("list workers");
        let live: Vec<_> = workers
            .items
            .iter()
            .filter(|pod| pod.metadata.deletion_timestamp.is_none())
            .collect();
        assert_eq!(live.len(), 1, "round {round}: exactly one worker Pod");
        let label = live[0]
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("openab.dev/generation"));
        assert_eq!(
            label,
            Some(&status.generation.to_string()),
            "round {round}: the Pod is the anchor's generation"
        );
        let current: Vec<_> = winners
            .iter()
            .filter(|a| a.generation() == status.generation)
            .collect();
        assert_eq!(
            current.len(),
            1,
            "round {round}: one attachment holds the current generation"
        );
    }
    first.close(&id, CloseReason::Ended).await.expect("close");
    second
        .close(&id, CloseReason::Ended)
        .await
        .expect("a second close changes nothing");
}
