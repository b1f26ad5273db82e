//! An operator's bad day on the real node and control plane: attaches that fail (no room on the
//! node, an API server that stops answering) leave no worker behind and no session recorded as
//! running; a claim deleted under a running session is reported lost, never retained; a record
//! deleted and made again at once never adopts the old record's worker or volume; a frozen worker
//! is not given its grace twice.
//!
//! One test binary of its own: the capacity test measures what the node has free, which parallel
//! tests of other binaries do not change (test binaries run one after another).
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --all-features --test reliability -- --ignored`.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{AdminObject, WORKER_PROFILE};
use runtime_kubernetes::KubernetesRuntime;
use runtime_kubernetes::OabSession;
use session_runtime::config::{KubernetesConfig, Reach};
use session_runtime::{
    CloseReason, CreateOptions, Error, SessionId, SessionIdentity, SessionRuntime, SessionState,
    StorageState, SuspendReason, WorkerFailure,
};
use test_cluster::faults::{Faults, Method, Rule};
use test_cluster::k8s_openapi::api::core::v1::{Node, PersistentVolumeClaim, Pod};
use test_cluster::kube::api::{DeleteParams, ListParams, PropagationPolicy};
use test_cluster::kube::{Api, ResourceExt};
use test_cluster::{unique_name, wait_until, TestCluster};

fn runtime_on(
    cluster: &TestCluster,
    client: test_cluster::kube::Client,
    profile: &AdminObject,
    installation: &str,
    start_timeout: Duration,
) -> Arc<KubernetesRuntime> {
    let mut config = KubernetesConfig::new(cluster.sessions_namespace(), profile.name());
    config.reach = Reach::Exec;
    config.start_timeout = start_timeout;
    Arc::new(
        KubernetesRuntime::builder(client, config)
            .installation(installation)
            .orphan_grace(Duration::ZERO)
            .build()
            .expect("a runtime"),
    )
}

/// A cluster, the test worker profile for a fresh installation named after `purpose`, and a
/// broker's runtime for it with a start timeout of a minute.
async fn installation(purpose: &str) -> (TestCluster, String, AdminObject, Arc<KubernetesRuntime>) {
    let installation = unique_name(purpose);
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = runtime_on(
        &cluster,
        cluster.broker(),
        &profile,
        &installation,
        Duration::from_secs(60),
    );
    (cluster, installation, profile, runtime)
}

/// The session's worker Pods that are not on their way out.
async fn live_workers(cluster: &TestCluster, id: &SessionId) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    pods.list(&ListParams::default().labels(&format!("openab.dev/session={id}")))
        .await
        .expect("list workers")
        .items
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .collect()
}

async fn create(runtime: &KubernetesRuntime, installation: &str, thread: &str) -> SessionId {
    let identity = SessionIdentity::new(installation, "agent", "test", thread).expect("identity");
    let mut attempts = 0;
    loop {
        match runtime.create(&identity, &CreateOptions::new()).await {
            Ok(_) => return identity.id(),
            Err(error) if error.retryable() && attempts < 20 => {
                attempts += 1;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(error) => panic!("create {thread}: {error}"),
        }
    }
}

/// CPU the real node has left for requests, in millicores.
async fn free_millicores(cluster: &TestCluster) -> u64 {
    let nodes: Api<Node> = Api::all(cluster.admin());
    let node = nodes
        .list(&ListParams::default())
        .await
        .expect("nodes")
        .items
        .into_iter()
        .find(|node| !node.annotations().contains_key("kwok.x-k8s.io/node"))
        .expect("the real node");
    let allocatable = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get("cpu"))
        .map(|q| millicores(&q.0))
        .expect("allocatable cpu");
    let pods: Api<Pod> = Api::all(cluster.admin());
    let requested: u64 = pods
        .list(&ListParams::default().fields(&format!("spec.nodeName={}", node.name_any())))
        .await
        .expect("pods on the node")
        .items
        .iter()
        .filter(|pod| {
            !matches!(
                pod.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .flat_map(|pod| pod.spec.iter().flat_map(|spec| spec.containers.iter()))
        .filter_map(|c| {
            c.resources
                .as_ref()?
                .requests
                .as_ref()?
                .get("cpu")
                .map(|q| millicores(&q.0))
        })
        .sum();
    allocatable.saturating_sub(requested)
}

fn millicores(quantity: &str) -> u64 {
    match quantity.strip_suffix('m') {
        Some(milli) => milli.parse().expect("millicores"),
        None => quantity.parse::<u64>().expect("cores") * 1000,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn an_attach_the_node_has_no_room_for_leaves_nothing_that_takes_a_resuming_sessions_place() {
    let installation = unique_name("capacity");
    let cluster = TestCluster::connect().await;
    // Each worker asks for most of what the node has free: one fits, two do not.
    let request = free_millicores(&cluster).await * 6 / 10;
    assert!(
        request >= 100,
        "the node has {request}m to give; too little to test with"
    );
    let document = format!(
        "unschedulable_timeout = \"3s\"\n{}",
        WORKER_PROFILE.replace(
            "[resources]\n",
            &format!("[resources]\ncpu_request = \"{request}m\"\n")
        )
    );
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = runtime_on(
        &cluster,
        cluster.broker(),
        &profile,
        &installation,
        Duration::from_secs(60),
    );
    let resuming = create(&runtime, &installation, "resuming").await;
    let crowded = create(&runtime, &installation, "crowded out").await;
    drop(runtime.attach(&resuming).await.expect("the first worker fits"));

    match runtime.attach(&crowded).await {
        Err(Error::WorkerFailed {
            cause: WorkerFailure::Unschedulable(_),
            ..
        }) => {}
        Ok(_) => panic!("a second worker fitted: the request does not fill the node"),
        Err(other) => panic!("expected Unschedulable, got {other}"),
    }
    let status = runtime.status(&crowded).await.expect("status");
    assert_ne!(status.state, SessionState::Running, "{status:?}");
    let failure = status.last_start_failure.expect("the failure is on the record");
    assert!(
        failure.error.contains("unschedulable") || failure.error.contains("Unschedulable"),
        "{failure:?}"
    );
    assert!(
        live_workers(&cluster, &crowded).await.is_empty(),
        "the failed attach's Pod is gone"
    );

    // The room the resuming session frees is still its own when it comes back.
    runtime
        .suspend(&resuming, SuspendReason::Capacity)
        .await
        .expect("suspend");
    drop(runtime.attach(&resuming).await.expect("resume"));

    for id in [resuming, crowded] {
        runtime.close(&id, CloseReason::Reset).await.expect("close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn an_attach_the_api_server_stopped_answering_leaves_no_unattended_worker_after_reconcile() {
    let installation = unique_name("api-outage");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let start_timeout = Duration::from_secs(5);
    let healthy = runtime_on(&cluster, cluster.broker(), &profile, &installation, start_timeout);
    let mut ids = Vec::new();
    for thread in ["outage 1", "outage 2", "outage 3"] {
        ids.push(create(&healthy, &installation, thread).await);
    }
    // Each broker loses the API server right after it created its worker: its reads of the
    // worker and of the record fail from then on, so neither its attach nor its own undo can
    // finish.
    let mut attaches = Vec::new();
    for id in &ids {
        let faults = Faults::new();
        faults.add(Rule {
            method: Method::GET,
            target: format!("pods/oab-w-{id}"),
            skip: 1,
            times: usize::MAX,
            status: 503,
        });
        faults.add(Rule {
            method: Method::GET,
            target: format!("oabsessions/oab-s-{id}"),
            skip: 2,
            times: usize::MAX,
            status: 503,
        });
        let broker = runtime_on(
            &cluster,
            faults.client(cluster.broker_config()),
            &profile,
            &installation,
            start_timeout,
        );
        let id = *id;
        attaches.push(tokio::spawn(async move {
            let result = broker.attach(&id).await.map(drop);
            (result, broker)
        }));
    }
    // The brokers are kept until the end: their runtimes' own attempts to undo (on drop) would
    // meet the same outage.
    let mut brokers = Vec::new();
    for attach in attaches {
        let (result, broker) = attach.await.expect("the attach task");
        match result {
            Err(error) if error.retryable() => {}
            other => panic!("expected a retryable error while the API server is down, got {other:?}"),
        }
        brokers.push(broker);
    }
    for id in &ids {
        assert_eq!(
            healthy.status(id).await.expect("status").state,
            SessionState::Running,
            "the outage left the record as the attach made it (the scenario reproduces)"
        );
        assert_eq!(live_workers(&cluster, id).await.len(), 1, "and its worker");
    }

    // The API server answers again; a reconcile pass undoes what the attaches could not.
    let within = start_timeout + Duration::from_secs(90);
    wait_until("reconcile to undo the abandoned attaches", within, || async {
        healthy.reconcile().await.expect("reconcile");
        let mut done = true;
        for id in &ids {
            let status = healthy.status(id).await.expect("status");
            done &= status.state != SessionState::Running && live_workers(&cluster, id).await.is_empty();
            if done {
                assert!(
                    status.last_start_failure.is_some(),
                    "the abandoned attach is on the record: {status:?}"
                );
            }
        }
        if !done {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        done.then_some(())
    })
    .await;
    drop(brokers);
    for id in &ids {
        healthy.close(id, CloseReason::Reset).await.expect("close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_claim_deleted_under_a_running_session_is_reported_lost_and_never_retained() {
    let (cluster, installation, _profile, runtime) = installation("lost-claim").await;
    let id = create(&runtime, &installation, "lost").await;
    let attachment = runtime.attach(&id).await.expect("attach");
    let status = runtime.status(&id).await.expect("status");
    assert_eq!(status.storage, StorageState::Present);
    let claim = status
        .storage_refs
        .first()
        .and_then(|r| r.strip_prefix("persistentvolumeclaim/"))
        .expect("a claim")
        .to_owned();

    // An operator deletes it: kept Terminating while the worker uses it, gone with it after.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    claims
        .delete(&claim, &DeleteParams::default())
        .await
        .expect("delete the claim");
    let status = runtime.status(&id).await.expect("status");
    assert_eq!(status.storage, StorageState::Lost, "{status:?}");
    drop(attachment);
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    match runtime.attach(&id).await {
        Err(error @ Error::StorageLost { .. }) => {
            assert!(!error.retryable());
            assert!(error.to_string().contains(&claim), "{error}");
        }
        Ok(_) => panic!("a session whose volume is gone attached"),
        Err(other) => panic!("expected StorageLost, got {other}"),
    }
    assert!(
        live_workers(&cluster, &id).await.is_empty(),
        "no Pod waits for the lost claim"
    );
    runtime.close(&id, CloseReason::Ended).await.expect("close");
    let status = runtime.status(&id).await.expect("status");
    assert_eq!(status.storage, StorageState::Lost, "never retained: {status:?}");
}

/// Deletes the session's anchor as an administrator would, with `propagation`, and makes the
/// session again at once: the new record's worker is its own, and the old record's volume is
/// never handed to it.
async fn anchor_deleted_and_made_again(propagation: PropagationPolicy, thread: &str) {
    let (cluster, installation, _profile, runtime) = installation("anchor-again").await;
    let id = create(&runtime, &installation, thread).await;
    drop(runtime.attach(&id).await.expect("attach"));
    let old_claim = runtime.status(&id).await.expect("status").storage_refs[0].clone();
    let old_generation = runtime.status(&id).await.expect("status").generation;

    let leases: Api<OabSession> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let params = DeleteParams {
        propagation_policy: Some(propagation),
        ..DeleteParams::default()
    };
    // The anchor lost, as a forced deletion loses it: its close finalizer removed first (with
    // it, a delete is a close the controller carries out).
    let unfinalized = serde_json::json!({ "metadata": { "finalizers": null } });
    leases
        .patch(
            &format!("oab-s-{id}"),
            &test_cluster::kube::api::PatchParams::default(),
            &test_cluster::kube::api::Patch::Merge(&unfinalized),
        )
        .await
        .expect("remove the finalizer");
    leases
        .delete(&format!("oab-s-{id}"), &params)
        .await
        .expect("delete the anchor");
    let id_again = create(&runtime, &installation, thread).await;
    assert_eq!(id_again, id);
    let mut attempts = 0;
    let attachment = loop {
        match runtime.attach(&id).await {
            Ok(attachment) => break attachment,
            Err(error) if error.retryable() && attempts < 20 => attempts += 1,
            Err(error) => panic!("attach of the session made again: {error}"),
        }
    };
    let status = runtime.status(&id).await.expect("status");
    assert!(
        status.generation > old_generation,
        "generations go on past the old record's: {} after {old_generation}",
        status.generation
    );
    assert_ne!(
        status.storage_refs[0], old_claim,
        "the old volume is not the new session's"
    );
    let workers = live_workers(&cluster, &id).await;
    assert_eq!(workers.len(), 1);
    let anchor_uid = leases
        .get(&format!("oab-s-{id}"))
        .await
        .expect("the new anchor")
        .uid();
    assert!(
        workers[0]
            .owner_references()
            .iter()
            .any(|owner| Some(&owner.uid) == anchor_uid.as_ref()),
        "the worker is the new record's"
    );
    drop(attachment);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
    // The old record's volume is nobody's now: removed by its administrator.
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let old = old_claim.trim_start_matches("persistentvolumeclaim/");
    let _ = claims.delete(old, &DeleteParams::default()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn an_anchor_deleted_in_the_background_and_made_again_adopts_nothing_of_the_old_one() {
    anchor_deleted_and_made_again(PropagationPolicy::Background, "again background").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn an_anchor_deleted_orphaning_its_objects_and_made_again_adopts_nothing_of_the_old_one() {
    anchor_deleted_and_made_again(PropagationPolicy::Orphan, "again orphan").await;
}

/// The host processes of the Pod with `uid` (its cgroup path names it).
fn pod_processes(uid: &str) -> Vec<i32> {
    let marker = format!("pod{uid}");
    let alternative = format!("pod{}", uid.replace('-', "_"));
    std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
                .is_ok_and(|cgroup| cgroup.contains(&marker) || cgroup.contains(&alternative))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_frozen_worker_is_not_given_its_grace_twice() {
    let (cluster, installation, _profile, runtime) = installation("frozen").await;
    let id = create(&runtime, &installation, "frozen").await;
    let attachment = runtime.attach(&id).await.expect("attach");
    let worker = live_workers(&cluster, &id).await.remove(0);
    let uid = worker.uid().expect("uid");
    let processes = pod_processes(&uid);
    assert!(!processes.is_empty(), "the worker's processes are on this host");
    for pid in &processes {
        let stopped = std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("kill");
        assert!(stopped.success(), "froze {pid}");
    }
    // What grace the Pod's deletion carries, as the API server records it.
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = worker.name_any();
    let watched = tokio::spawn(async move {
        wait_until("the worker's deletion", Duration::from_secs(60), || async {
            let pod = pods.get_opt(&name).await.ok()??;
            pod.metadata.deletion_grace_period_seconds
        })
        .await
    });
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    let grace = watched.await.expect("watch");
    assert_eq!(
        grace, 1,
        "a worker that let its 2 s grace pass through the relay is killed, not given it again"
    );
    drop(attachment);
    // Nothing stays stopped: the Pod's processes died with it.
    assert!(pod_processes(&uid).is_empty());
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}
