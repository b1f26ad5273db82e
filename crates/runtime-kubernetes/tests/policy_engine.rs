//! The policy engine is what refuses: a Pod outside the broker's selector is refused a worker's
//! relay while the deploy files' policies exist, reaches it once they are deleted, and is refused
//! again once they are applied back. Its own test binary, because it takes the sessions
//! namespace's policies away for a moment (cargo runs test binaries one at a time).
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test policy_engine -- --ignored`.

mod common;

use std::time::Duration;

use common::network::{worker, Outcome, TestPod};
use common::{kubectl, runtime, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::{CloseReason, SessionRuntime};
use test_cluster::{unique_name, wait_until, TestCluster};

const POLICIES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../deploy/kubernetes/networkpolicy.yaml"
);

/// Applies the deploy files' policies back when dropped, also when the test panics.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        kubectl(&[
            "apply",
            "--server-side",
            "--field-manager",
            "openab-cluster",
            "-f",
            POLICIES,
        ]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn deleting_the_policies_opens_a_relay_to_a_stranger_and_applying_them_closes_it() {
    let cluster = TestCluster::connect().await;
    let installation = unique_name("engine");
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = runtime(&cluster, &profile, Reach::PodIp, &installation);
    let w = worker(&cluster, &runtime, &installation, "engine").await;
    let stranger = TestPod::prober(&cluster, "openab", &unique_name("stranger"), &[]).await;

    assert_eq!(stranger.connect(&w.ip, w.relay_port).await, Outcome::Refused);

    let restore = Restore;
    kubectl(&[
        "-n",
        cluster.sessions_namespace(),
        "delete",
        "networkpolicy",
        "oab-default-deny",
        "oab-workers",
    ]);
    stranger.eventually_connects(&w.ip, w.relay_port).await;

    drop(restore);
    let what = "the relay refused to the stranger again";
    wait_until(what, Duration::from_secs(30), || async {
        (stranger.connect(&w.ip, w.relay_port).await == Outcome::Refused).then_some(())
    })
    .await;

    drop(w.attachment);
    runtime.close(&w.id, CloseReason::Reset).await.expect("close");
}
