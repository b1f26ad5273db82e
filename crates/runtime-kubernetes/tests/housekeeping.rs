//! What `reconcile` does with time, on the real control plane: a worker whose broker went away is
//! suspended once idle and resumes on its own volume; retained storage of an earlier session
//! expires; a closed record that holds nothing goes; storage no record names is reported, and
//! deleted only when the operator says so.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test housekeeping -- --ignored`.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{builder, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::{
    CloseReason, CreateOptions, Error, Retention, RetentionPolicy, SessionIdentity, SessionRuntime,
    SessionState, SuspendReason,
};
use test_cluster::k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, Pod, VolumeResourceRequirements,
};
use test_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use test_cluster::kube::api::{ObjectMeta, PostParams};
use test_cluster::kube::{Api, ResourceExt};
use test_cluster::{unique_name, wait_until, TestCluster};

const IDLE_TTL: Duration = Duration::from_secs(6);

fn claims(cluster: &TestCluster) -> Api<PersistentVolumeClaim> {
    Api::namespaced(cluster.admin(), cluster.sessions_namespace())
}

/// Whether the claim is gone or on its way out.
async fn claim_going(cluster: &TestCluster, name: &str) -> bool {
    match claims(cluster).get_opt(name).await.expect("read the claim") {
        None => true,
        Some(claim) => claim.metadata.deletion_timestamp.is_some(),
    }
}

/// The claim a worker Pod mounts.
fn mounted_claim(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .volumes
        .iter()
        .flatten()
        .find_map(|volume| Some(volume.persistent_volume_claim.as_ref()?.claim_name.clone()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_worker_whose_broker_went_away_is_suspended_once_idle_and_resumes_on_its_volume() {
    let installation = unique_name("idle");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let broker = builder(&cluster, &profile, Reach::Exec, &installation)
        .idle_ttl(IDLE_TTL)
        .build()
        .expect("broker");
    let controller = builder(&cluster, &profile, Reach::Exec, &installation)
        .idle_ttl(IDLE_TTL)
        .build()
        .expect("controller");
    let identity = SessionIdentity::new(&installation, "agent", "test", "idle").expect("identity");
    let id = identity.id();
    broker
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let attachment = broker.attach(&id).await.expect("attach");
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let first = pods.get(&format!("oab-w-{id}")).await.expect("the worker");
    let claim = mounted_claim(&first).expect("the worker mounts its claim");
    let claim_uid = claims(&cluster).get(&claim).await.expect("the claim").uid();

    // While the broker holds the attachment, its renewals keep the worker from counting as idle.
    let watched = tokio::time::Instant::now();
    while watched.elapsed() < IDLE_TTL * 2 {
        let report = controller.reconcile().await.expect("reconcile");
        assert!(
            !report.suspended_idle.contains(&id),
            "a worker with a live attachment was suspended as idle: {report:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    assert_eq!(
        controller.status(&id).await.expect("status").state,
        SessionState::Running
    );

    // The broker goes away without suspending: nothing renews the anchor any more.
    drop(attachment);
    drop(broker);
    wait_until(
        "the idle worker to be suspended",
        Duration::from_secs(60),
        || async {
            let report = controller.reconcile().await.expect("reconcile");
            report.suspended_idle.contains(&id).then_some(())
        },
    )
    .await;
    let status = controller.status(&id).await.expect("status");
    assert_eq!(status.state, SessionState::Suspended);
    assert_eq!(status.suspend_reason, Some(SuspendReason::Idle));
    let note = status.last_reconcile.expect("the status says what reconcile did");
    assert!(note.action.starts_with("suspended"), "{}", note.action);
    assert!(
        pods.get_opt(&format!("oab-w-{id}"))
            .await
            .expect("read")
            .is_none(),
        "an idle suspend removes the worker Pod"
    );

    // Resuming starts a new worker on the same volume.
    let resumed = controller.attach(&id).await.expect("resume");
    let second = pods.get(&format!("oab-w-{id}")).await.expect("the new worker");
    assert_ne!(second.uid(), first.uid(), "a new worker Pod");
    assert_eq!(mounted_claim(&second).as_deref(), Some(claim.as_str()));
    assert_eq!(
        claims(&cluster).get(&claim).await.expect("the claim").uid(),
        claim_uid
    );
    drop(resumed);
    controller.close(&id, CloseReason::Reset).await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn retained_storage_of_an_earlier_session_expires_and_a_closed_record_holding_nothing_goes() {
    let installation = unique_name("expiry");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let mut retention = RetentionPolicy::default();
    retention.ended = Retention::Retain;
    retention.retain_for = Some(Duration::from_secs(3));
    let runtime = builder(&cluster, &profile, Reach::Exec, &installation)
        .retention(retention)
        .closed_record_ttl(Duration::ZERO)
        .build()
        .expect("runtime");
    let identity = SessionIdentity::new(&installation, "agent", "test", "expiry").expect("identity");
    let id = identity.id();
    let first_claim = format!("oab-d-{id}-1");
    let second_claim = format!("oab-d-{id}-2");

    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    runtime
        .close(&id, CloseReason::Ended)
        .await
        .expect("close, retained");
    let report = runtime.reconcile().await.expect("reconcile");
    assert!(
        !report.expired_records.contains(&id),
        "a record holding storage stays: {report:?}"
    );

    // The thread's next session gets its own volume; the retained one stays on the record.
    let next = runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create again");
    assert!(next.created);
    let status = runtime.status(&id).await.expect("status");
    assert!(
        status
            .storage_refs
            .iter()
            .any(|r| r.contains(&first_claim) && r.contains("retained")),
        "{:?}",
        status.storage_refs
    );
    assert!(
        !claim_going(&cluster, &first_claim).await,
        "retained until its time"
    );
    assert!(
        !claim_going(&cluster, &second_claim).await,
        "the new session's volume"
    );

    wait_until(
        "the retained volume to expire",
        Duration::from_secs(30),
        || async {
            let report = runtime.reconcile().await.expect("reconcile");
            assert!(
                report.orphaned_storage.is_empty(),
                "recorded claims are no orphans: {report:?}"
            );
            report.expired_storage.contains(&id).then_some(())
        },
    )
    .await;
    assert!(claim_going(&cluster, &first_claim).await);
    assert!(
        !claim_going(&cluster, &second_claim).await,
        "only the expired volume goes"
    );
    let status = runtime.status(&id).await.expect("status");
    assert!(!status.storage_refs.iter().any(|r| r.contains(&first_claim)));

    // A reset deletes the volume; the closed record then holds nothing and expires.
    runtime.close(&id, CloseReason::Reset).await.expect("reset");
    let report = runtime.reconcile().await.expect("reconcile");
    assert!(report.expired_records.contains(&id), "{report:?}");
    assert!(matches!(runtime.status(&id).await, Err(Error::NotFound { .. })));
    assert!(claim_going(&cluster, &second_claim).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn storage_no_record_names_is_reported_and_deleted_only_when_configured() {
    let installation = unique_name("orphans");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let named = SessionIdentity::new(&installation, "agent", "test", "named").expect("identity");
    let stray = SessionIdentity::new(&installation, "agent", "test", "stray")
        .expect("identity")
        .id();
    // A claim as a broker killed between making a claim and its record would leave it.
    let stray_claim = format!("oab-d-{stray}-1");
    let claim = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some(stray_claim.clone()),
            labels: Some(BTreeMap::from([
                ("app.kubernetes.io/managed-by".to_owned(), "openab".to_owned()),
                ("openab.dev/installation".to_owned(), installation.clone()),
                ("openab.dev/session".to_owned(), stray.to_string()),
                ("openab.dev/role".to_owned(), "storage".to_owned()),
            ])),
            annotations: Some(BTreeMap::from([(
                "openab.dev/session-id".to_owned(),
                stray.to_string(),
            )])),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
            resources: Some(VolumeResourceRequirements {
                requests: Some([("storage".to_owned(), Quantity("1Gi".to_owned()))].into()),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        status: None,
    };
    claims(&cluster)
        .create(&PostParams::default(), &claim)
        .await
        .expect("the stray claim");

    let reporting = builder(&cluster, &profile, Reach::Exec, &installation)
        .orphan_grace(Duration::ZERO)
        .build()
        .expect("runtime");
    reporting
        .create(&named, &CreateOptions::new())
        .await
        .expect("create");
    let report = reporting.reconcile().await.expect("reconcile");
    assert_eq!(
        report.orphaned_storage,
        [(stray, format!("persistentvolumeclaim/{stray_claim}"))],
        "only the claim no record names"
    );
    assert!(
        !claim_going(&cluster, &stray_claim).await,
        "reported, not deleted"
    );

    let deleting = builder(&cluster, &profile, Reach::Exec, &installation)
        .orphan_grace(Duration::ZERO)
        .delete_orphaned_storage(true)
        .build()
        .expect("runtime");
    let report = deleting.reconcile().await.expect("reconcile");
    assert_eq!(report.expired_storage, [stray], "{report:?}");
    assert!(claim_going(&cluster, &stray_claim).await);
    assert!(!claim_going(&cluster, &format!("oab-d-{}-1", named.id())).await);
    deleting
        .close(&named.id(), CloseReason::Reset)
        .await
        .expect("close");
}
