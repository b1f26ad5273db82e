//! The contract's conformance suite against the real cluster: worker Pods of the worker image on
//! the real node, made by the broker's identity, reached over each reach.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test conformance -- --ignored`.

mod common;

use std::sync::Arc;

use common::{runtime, AdminObject, WORKER_PROFILE};
use runtime_kubernetes::KubernetesRuntime;
use session_runtime::config::Reach;
use session_runtime::conformance::{run_all, Target, BEHAVIOURS};
use test_cluster::TestCluster;

/// The suite with the worker profile, `keys` (more profile keys) first.
async fn conformance(reach: Reach, installation: &str, keys: &str) {
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, installation, &format!("{keys}{WORKER_PROFILE}")).await;
    let runtime = runtime(&cluster, &profile, reach, installation);
    let target = Target::new(Arc::<KubernetesRuntime>::clone(&runtime), installation).with_faults(Arc::<
        KubernetesRuntime,
    >::clone(
        &runtime
    ));
    let report = run_all(&target).await;
    assert!(
        report.skipped.is_empty(),
        "nothing may be skipped: {:?}",
        report.skipped
    );
    assert_eq!(report.passed, BEHAVIOURS, "every behaviour must run, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn kubernetes_runtime_over_exec_passes_every_behaviour() {
    conformance(Reach::Exec, "conformance-exec", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn kubernetes_runtime_over_the_pod_ip_passes_every_behaviour() {
    conformance(Reach::PodIp, "conformance-pod-ip", "").await;
}

/// Workers under gVisor (the test node's RuntimeClass `gvisor`, runsc on systrap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn kubernetes_runtime_under_gvisor_passes_every_behaviour() {
    conformance(Reach::PodIp, "conformance-gvisor", "runtime_class = \"gvisor\"\n").await;
}
