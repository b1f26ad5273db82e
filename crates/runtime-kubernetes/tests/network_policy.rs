//! The deploy files' NetworkPolicies, enforced by the test node's policy engine (kube-router),
//! proven with packets from a shell inside the workers, each refusal beside a positive control
//! that a dead network would fail.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test network_policy -- --ignored`.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::network::{
    connect_from, connect_from_host, from_worker, probe_through_silence, worker, worker_pod, Outcome,
    TestPod, API_SERVER_PORT, KUBERNETES_SERVICE_IP, LISTEN_PORT, NODE_ADDRESS,
};
use common::{runtime, AdminObject, WORKER_PROFILE};
use runtime_kubernetes::KubernetesRuntime;
use session_runtime::config::Reach;
use session_runtime::{CloseReason, SessionRuntime};
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::Api;
use test_cluster::{unique_name, TestCluster};

/// The broker's namespace and the label its NetworkPolicy admits (deploy/kubernetes).
const BROKER_NAMESPACE: &str = "openab";
const BROKER_LABEL: (&str, &str) = ("app.kubernetes.io/name", "openab-broker");

/// The cluster's NetworkPolicies are deploy/kubernetes/networkpolicy.yaml's, unchanged.
fn assert_deployed_policies_are_the_files() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/kubernetes/networkpolicy.yaml"
    );
    let diff = Command::new("kubectl")
        .args([
            "diff",
            "--server-side",
            "--field-manager",
            "openab-cluster",
            "-f",
            file,
        ])
        .output()
        .expect("kubectl (scripts/cluster env puts it on PATH)");
    assert!(
        diff.status.success(),
        "the cluster's policies differ from {file}:\n{}{}",
        String::from_utf8_lossy(&diff.stdout),
        String::from_utf8_lossy(&diff.stderr)
    );
}

fn setup(cluster: &TestCluster, profile: &AdminObject, installation: &str) -> Arc<KubernetesRuntime> {
    runtime(cluster, profile, Reach::PodIp, installation)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_worker_reaches_no_other_pod_node_api_server_or_metadata_and_only_the_broker_reaches_relays() {
    assert_deployed_policies_are_the_files();
    let cluster = TestCluster::connect().await;
    let installation = unique_name("netpol");
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = setup(&cluster, &profile, &installation);
    let a = worker(&cluster, &runtime, &installation, "a").await;
    let b = worker(&cluster, &runtime, &installation, "b").await;
    let elsewhere = cluster.fresh_namespace("netpol-target").await;
    let target = TestPod::listener(&cluster, elsewhere.name(), "target").await;
    let broker = TestPod::prober(
        &cluster,
        BROKER_NAMESPACE,
        &unique_name("broker"),
        &[BROKER_LABEL],
    )
    .await;
    let stranger = TestPod::prober(&cluster, BROKER_NAMESPACE, &unique_name("stranger"), &[]).await;

    // Positive controls: the broker (this host, where the tests' broker runs, and a Pod with the
    // broker's label) reaches both relays; a Pod no policy selects reaches the other Pod, the
    // API server on the node and the `kubernetes` Service.
    for w in [&a, &b] {
        assert_eq!(
            connect_from_host(&w.ip, w.relay_port),
            Outcome::Connected,
            "host to {}",
            w.pod
        );
        broker.eventually_connects(&w.ip, w.relay_port).await;
    }
    stranger.eventually_connects(&target.ip, LISTEN_PORT).await;
    stranger.eventually_connects(NODE_ADDRESS, API_SERVER_PORT).await;
    stranger.eventually_connects(KUBERNETES_SERVICE_IP, 443).await;

    // From inside B: A's relay, the other Pod, the node (the API server's address) and the
    // `kubernetes` Service are refused by the engine (its REJECT), and so are the cloud metadata
    // address and a public address (off the machine: see probe_through_silence).
    let refused = [
        (a.ip.as_str(), a.relay_port, "A's relay"),
        (target.ip.as_str(), LISTEN_PORT, "another Pod"),
        (NODE_ADDRESS, API_SERVER_PORT, "the node's API server"),
        (KUBERNETES_SERVICE_IP, 443, "the kubernetes Service"),
    ];
    for (address, port, what) in refused {
        assert_eq!(
            from_worker(&cluster, &b, address, port).await,
            Outcome::Refused,
            "B must not reach {what} ({address}:{port})"
        );
    }
    for (address, what) in [
        ("169.254.169.254", "the metadata address"),
        ("192.0.2.1", "192.0.2.1"),
    ] {
        assert_eq!(
            probe_through_silence(|| from_worker(&cluster, &b, address, 80)).await,
            Outcome::Refused,
            "B must not reach {what} ({address}:80)"
        );
    }
    // And the reverse for the relays: A cannot reach B's.
    assert_eq!(
        from_worker(&cluster, &a, &b.ip, b.relay_port).await,
        Outcome::Refused
    );
    // A Pod outside the broker's selector, in the broker's namespace, cannot reach a relay.
    assert_eq!(stranger.connect(&a.ip, a.relay_port).await, Outcome::Refused);

    drop(target);
    for w in [a, b] {
        drop(w.attachment);
        runtime.close(&w.id, CloseReason::Reset).await.expect("close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_profiles_egress_opens_exactly_what_it_lists_and_closes_for_the_next_worker() {
    let cluster = TestCluster::connect().await;
    let elsewhere = cluster.fresh_namespace("egress-target").await;
    let listed = TestPod::listener(&cluster, elsewhere.name(), "listed").await;
    let unlisted = TestPod::listener(&cluster, elsewhere.name(), "unlisted").await;
    let installation = unique_name("egress-packets");
    let document = format!(
        "egress = [\"{}/32\", \"192.0.2.1/32\"]\n{WORKER_PROFILE}",
        listed.ip
    );
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = setup(&cluster, &profile, &installation);
    let open = worker(&cluster, &runtime, &installation, "open").await;

    // The listed Pod answers; the unlisted one beside it is refused by the engine.
    assert_eq!(
        from_worker(&cluster, &open, &listed.ip, LISTEN_PORT).await,
        Outcome::Connected
    );
    assert_eq!(
        from_worker(&cluster, &open, &unlisted.ip, LISTEN_PORT).await,
        Outcome::Refused
    );
    // A listed public address passes the engine (no REJECT, in three tries) and then meets the
    // test node's own drop of everything leaving it: no answer, where an unlisted one is refused.
    for _ in 0..3 {
        assert_eq!(
            from_worker(&cluster, &open, "192.0.2.1", 80).await,
            Outcome::NoAnswer
        );
    }
    assert_eq!(
        probe_through_silence(|| from_worker(&cluster, &open, "203.0.113.9", 80)).await,
        Outcome::Refused
    );

    // The administrator takes the allowances away: the session's next worker is refused.
    let id = open.id;
    drop(open);
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = setup(&cluster, &profile, &installation);
    let attachment = runtime.attach(&id).await.expect("attach again");
    let (pod, _, _) = worker_pod(&cluster, &id).await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    assert_eq!(
        connect_from(&pods, &pod, &listed.ip, LISTEN_PORT).await,
        Outcome::Refused
    );
    assert_eq!(
        probe_through_silence(|| connect_from(&pods, &pod, "192.0.2.1", 80)).await,
        Outcome::Refused
    );
    drop(attachment);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}

#[test]
fn busybox_nc_outputs_are_classified() {
    use common::network::classify;
    assert_eq!(classify("exit=143\n"), Some(Outcome::Connected));
    assert_eq!(classify("exit=0\n"), Some(Outcome::Connected));
    assert_eq!(
        classify("nc: can't connect to remote host (10.0.0.1): Connection refused\nexit=1\n"),
        Some(Outcome::Refused)
    );
    assert_eq!(classify("nc: timed out\nexit=1\n"), Some(Outcome::NoAnswer));
    assert_eq!(classify("exit=1\n"), None);
}
