//! What a session's lifecycle asks of the API server once a broker is warm: the anchor as the
//! broker last read or wrote it, its profile through its watch, its workers through its watch;
//! and that neither memory hides a change: a profile changed is what the next worker runs, a
//! profile deleted is refused, an anchor another broker changed is read afresh.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --all-features --test api_requests -- --ignored`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::AdminObject;
use runtime_kubernetes::KubernetesRuntime;
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{
    CloseReason, CreateOptions, Error, SessionId, SessionIdentity, SessionRuntime, SuspendReason,
};
use test_cluster::faults::Faults;
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::api::ListParams;
use test_cluster::kube::Api;
use test_cluster::{unique_name, wait_until, TestCluster};

const EPHEMERAL_PROFILE: &str = r#"
image = "openab.dev/worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/acp-test-agent"]
termination_grace = "2s"
volume_path = "/session"

[storage]
kind = "ephemeral"
"#;

fn runtime_with(
    cluster: &TestCluster,
    faults: &Faults,
    profile: &AdminObject,
    installation: &str,
) -> Arc<KubernetesRuntime> {
    Arc::new(
        common::builder_through(cluster, faults, profile, Reach::PodIp, installation)
            .build()
            .expect("runtime"),
    )
}

/// create, attach and a reply, suspend, attach and a reply, close.
async fn lifecycle(runtime: &KubernetesRuntime, identity: &SessionIdentity) {
    let id = identity.id();
    runtime
        .create(identity, &CreateOptions::new())
        .await
        .expect("create");
    for suspend in [true, false] {
        let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
        client.initialize().await.expect("the first ACP reply");
        drop(client);
        if suspend {
            runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
        }
    }
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}

/// The termination grace (seconds) of session `id`'s worker Pod, which follows the profile's
/// `termination_grace`.
async fn worker_grace(cluster: &TestCluster, id: &SessionId) -> i64 {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let listed = pods
        .list(&ListParams::default().labels(&format!("openab.dev/session={id},openab.dev/role=worker")))
        .await
        .expect("list the session's worker");
    let pod = listed.items.first().expect("the session's worker Pod");
    pod.spec
        .as_ref()
        .and_then(|spec| spec.termination_grace_period_seconds)
        .expect("the worker's termination grace")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn a_warm_brokers_lifecycle_reads_no_anchor_profile_or_pod_list() {
    let installation = unique_name("requests");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, EPHEMERAL_PROFILE).await;
    let faults = Faults::new();
    let runtime = runtime_with(&cluster, &faults, &profile, &installation);
    // The first lifecycle starts the broker's watches.
    let first = SessionIdentity::new(&installation, "agent", "requests", "first").expect("identity");
    lifecycle(&runtime, &first).await;

    faults.clear_requests();
    let second = SessionIdentity::new(&installation, "agent", "requests", "second").expect("identity");
    lifecycle(&runtime, &second).await;
    let requests = faults.requests();
    let own: Vec<_> = requests
        .iter()
        .filter(|(_, path)| !path.contains("/events"))
        .collect();
    let listed = own
        .iter()
        .map(|(method, path)| format!("{method} {path}"))
        .collect::<Vec<_>>();
    let anchor = format!("/oabsessions/oab-s-{}", second.id());
    let reads: Vec<_> = listed
        .iter()
        .filter(|request| request.starts_with("GET "))
        .filter(|request| {
            request.ends_with(&anchor) || request.contains("/oabprofiles") || request.ends_with("/pods")
        })
        .collect();
    assert!(
        reads.is_empty(),
        "no read of the anchor, the profile or the Pods: {reads:#?}"
    );
    // The one read left (the session's claims, at create) and 15 writes: the anchor's POST and
    // 7 status updates, the ServiceAccount's POST and DELETE, two Pod POSTs and DELETEs. The 5
    // Events (one per transition) come on top, in the background.
    assert!(
        own.len() <= 16,
        "{} requests of the broker's own: {listed:#?}",
        own.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn a_changed_profile_reaches_the_next_worker_and_a_deleted_one_is_refused() {
    let installation = unique_name("profile-watch");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, EPHEMERAL_PROFILE).await;
    let faults = Faults::new();
    let runtime = runtime_with(&cluster, &faults, &profile, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "profile", "1").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    drop(runtime.attach(&id).await.expect("attach"));
    let before = worker_grace(&cluster, &id).await;
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");

    profile
        .replace_profile(&cluster, &EPHEMERAL_PROFILE.replace("\"2s\"", "\"3s\""))
        .await;
    // The watch delivers the change within moments; each attach in between runs one version or
    // the other, never a mix.
    let mut after = before;
    for _ in 0..20 {
        drop(runtime.attach(&id).await.expect("attach after the change"));
        after = worker_grace(&cluster, &id).await;
        runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
        if after != before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_ne!(
        after, before,
        "a worker started after the change runs the new version"
    );

    let profiles: Api<test_cluster::kube::api::DynamicObject> = Api::namespaced_with(
        cluster.admin(),
        cluster.sessions_namespace(),
        &runtime_kubernetes::profile::WorkerProfile::resource(),
    );
    profiles
        .delete(profile.name(), &Default::default())
        .await
        .expect("delete the profile");
    wait_until("the profile to go", Duration::from_secs(10), || async {
        profiles
            .get_opt(profile.name())
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await;
    // Refused once the watch has delivered the deletion (a missing profile is read to confirm).
    let mut refused = None;
    for _ in 0..20 {
        match runtime.attach(&id).await {
            Err(error @ Error::InvalidConfig { .. }) => {
                refused = Some(error);
                break;
            }
            Ok(attachment) => {
                drop(attachment);
                runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
            }
            Err(other) => panic!("attach without a profile: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    match refused {
        Some(Error::InvalidConfig { key, .. }) => assert_eq!(key, format!("profile/{}", profile.name())),
        other => panic!("attach without a profile: {other:?}"),
    }
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}
