//! A profile's egress allowances become a NetworkPolicy that selects exactly that profile's
//! workers, and an allowance removed from the profile is gone from the cluster at the next start.
//! (This proves the object; tests/network_policy.rs proves the packets through the test node's
//! policy engine.)
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test egress -- --ignored`.

mod common;

use common::{runtime, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime};
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::k8s_openapi::api::networking::v1::NetworkPolicy;
use test_cluster::kube::api::ListParams;
use test_cluster::kube::Api;
use test_cluster::{unique_name, TestCluster};

/// The CIDRs the installation's egress policies allow workers with `labels` to reach.
async fn allowed(
    cluster: &TestCluster,
    installation: &str,
    labels: &std::collections::BTreeMap<String, String>,
) -> Vec<String> {
    let policies: Api<NetworkPolicy> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let listed = policies
        .list(&ListParams::default().labels(&format!("openab.dev/installation={installation}")))
        .await
        .expect("list policies");
    let mut cidrs = Vec::new();
    for policy in listed {
        let spec = policy.spec.expect("spec");
        let selects = spec
            .pod_selector
            .and_then(|s| s.match_labels)
            .is_some_and(|wanted| wanted.iter().all(|(k, v)| labels.get(k) == Some(v)));
        if selects {
            cidrs.extend(
                spec.egress
                    .into_iter()
                    .flatten()
                    .flat_map(|rule| rule.to.into_iter().flatten())
                    .filter_map(|peer| Some(peer.ip_block?.cidr)),
            );
        }
    }
    cidrs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_profiles_egress_becomes_a_policy_that_selects_its_workers_and_follows_the_profile() {
    let installation = unique_name("egress");
    let cluster = TestCluster::connect().await;
    let document = format!("egress = [\"203.0.113.0/24\"]\n{WORKER_PROFILE}");
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "test", "egress").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let attachment = runtime.attach(&id).await.expect("attach");
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let worker = pods.get(&format!("oab-w-{id}")).await.expect("the worker");
    let labels = worker.metadata.labels.clone().expect("labels");
    assert_eq!(
        allowed(&cluster, &installation, &labels).await,
        ["203.0.113.0/24"]
    );
    drop(attachment);

    // The administrator takes the allowance away: the next worker start takes it from the cluster.
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = common::runtime(&cluster, &profile, Reach::Exec, &installation);
    let attachment = runtime.attach(&id).await.expect("attach again");
    let worker = pods.get(&format!("oab-w-{id}")).await.expect("the worker");
    let labels = worker.metadata.labels.clone().expect("labels");
    assert!(allowed(&cluster, &installation, &labels).await.is_empty());
    drop(attachment);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}
