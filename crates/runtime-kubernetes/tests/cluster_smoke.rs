//! Proof that the test cluster is a real Kubernetes: each guarantee the runtime will rely on
//! (admission, RBAC, optimistic concurrency, preconditions, garbage collection, scheduling,
//! watches), checked against the API server the environment names.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test cluster_smoke -- --ignored`.

use std::time::Duration;

use futures_util::{StreamExt, TryStreamExt};
use runtime_kubernetes::{OabSession, OabSessionSpec, OabSessionStatus};
use test_cluster::k8s_openapi::api::core::v1::{
    ConfigMap, Event, PersistentVolume, PersistentVolumeClaim, PersistentVolumeClaimSpec,
    PersistentVolumeClaimVolumeSource, Pod, Secret, ServiceAccount, Toleration, Volume, VolumeMount,
    VolumeResourceRequirements,
};
use test_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use test_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use test_cluster::kube::api::{
    DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions, WatchEvent,
    WatchParams,
};
use test_cluster::kube::{Api, Resource, ResourceExt};
use test_cluster::{api_status, restricted_pod, unique_name, unique_session_id, wait_until, TestCluster};

/// An image name that no node has: these Pods are admitted and scheduled, never run.
const ABSENT_IMAGE: &str = "openab.dev/never-pulled:smoke";
const GENEROUS: Duration = Duration::from_secs(90);

/// The labels the admission policy asks of the broker's objects (deploy/kubernetes/admission.yaml).
fn ours(session: &str, role: &str) -> std::collections::BTreeMap<String, String> {
    [
        ("app.kubernetes.io/managed-by", "openab"),
        ("openab.dev/installation", "smoke"),
        ("openab.dev/session", session),
        ("openab.dev/role", role),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v.to_owned()))
    .collect()
}

/// An anchor as the broker may write it: its name and labels.
fn anchor(name: &str) -> OabSession {
    let mut anchor = OabSession::new(
        name,
        OabSessionSpec {
            installation: "smoke".to_owned(),
            identity_digest: "ab".repeat(32),
        },
    );
    anchor.metadata.labels = Some(ours("aaaaaaaaaaaaaaaaaaaa", "anchor"));
    anchor
}

/// A status in `phase`, as a record write sends it.
fn status(phase: &str) -> OabSessionStatus {
    OabSessionStatus {
        phase: phase.to_owned(),
        generation: 1,
        worker: None,
        storage: "ephemeral".to_owned(),
        last_activity: "2026-12-04T00:00:00Z".to_owned(),
        renew_time: None,
        lent_to: None,
        conditions: Vec::new(),
        record: serde_json::json!({}),
    }
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn the_api_server_reports_the_pinned_version() {
    let cluster = TestCluster::connect().await;
    let version = cluster
        .admin()
        .apiserver_version()
        .await
        .expect("/version answers");
    let expected = cluster
        .kubernetes_version()
        .expect("OPENAB_KUBERNETES_VERSION names the version the cluster was built at");
    assert_eq!(version.git_version, expected);
    assert_eq!(version.major, "1");
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn a_pod_that_violates_restricted_is_refused_naming_the_control() {
    let cluster = TestCluster::connect().await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());

    // The compliant Pod passes the whole admission chain (dry run: nothing is stored)...
    let compliant = restricted_pod(&unique_name("compliant"), ABSENT_IMAGE, &[]);
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    pods.create(&dry_run, &compliant)
        .await
        .expect("a restricted-compliant Pod is admitted");

    // ...and the same Pod with one forbidden control is refused, with that control named.
    let mut capable = restricted_pod(&unique_name("capable"), ABSENT_IMAGE, &[]);
    let container = &mut capable.spec.as_mut().expect("spec").containers[0];
    let security = container.security_context.get_or_insert_with(Default::default);
    security.capabilities.get_or_insert_with(Default::default).add = Some(vec!["NET_ADMIN".to_owned()]);
    let refused = pods.create(&dry_run, &capable).await;
    assert_eq!(api_status(&refused), Some(403), "{refused:?}");
    let message = refused.err().map(|error| error.to_string()).unwrap_or_default();
    assert!(message.contains("PodSecurity \"restricted"), "{message}");
    assert!(message.contains("unrestricted capabilities"), "{message}");
    assert!(message.contains("NET_ADMIN"), "{message}");

    let mut root = restricted_pod(&unique_name("root"), ABSENT_IMAGE, &[]);
    let pod_security = root.spec.as_mut().expect("spec").security_context.as_mut();
    let pod_security = pod_security.expect("pod security context");
    pod_security.run_as_non_root = None;
    pod_security.run_as_user = Some(0);
    let refused = pods.create(&dry_run, &root).await;
    let message = refused.err().map(|error| error.to_string()).unwrap_or_default();
    assert!(message.contains("runAsNonRoot"), "{message}");
    assert!(message.contains("runAsUser=0"), "{message}");
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn the_broker_has_its_role_and_nothing_else() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();

    let secrets: Api<Secret> = Api::namespaced(cluster.broker(), namespace);
    let listed = secrets.list(&ListParams::default()).await;
    assert_eq!(api_status(&listed), Some(403), "secrets: {listed:?}");
    let elsewhere: Api<Pod> = Api::namespaced(cluster.broker(), "default");
    let listed = elsewhere.list(&ListParams::default()).await;
    assert_eq!(api_status(&listed), Some(403), "pods outside: {listed:?}");
    let volumes: Api<PersistentVolume> = Api::all(cluster.broker());
    let listed = volumes.list(&ListParams::default()).await;
    assert_eq!(api_status(&listed), Some(403), "cluster-wide: {listed:?}");

    let anchors: Api<OabSession> = Api::namespaced(cluster.broker(), namespace);
    let name = unique_name("oab-s-broker-anchor");
    let created = anchors
        .create(&PostParams::default(), &anchor(&name))
        .await
        .expect("the broker creates an OabSession in the sessions namespace");
    assert_eq!(created.name_any(), name);
    anchors
        .delete(&name, &DeleteParams::default())
        .await
        .expect("and deletes it");
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn a_stale_resource_version_and_a_wrong_uid_are_conflicts() {
    let cluster = TestCluster::connect().await;
    let anchors: Api<OabSession> = Api::namespaced(cluster.broker(), cluster.sessions_namespace());
    let name = unique_name("oab-s-cas");
    let original = anchors
        .create(&PostParams::default(), &anchor(&name))
        .await
        .expect("create");

    // The record lives in the status: a status write carries the resourceVersion it read.
    let mut first = original.clone();
    first.status = Some(status("Created"));
    anchors
        .replace_status(&name, &PostParams::default(), &first)
        .await
        .expect("an update from the current resourceVersion");
    let mut stale = original.clone();
    stale.status = Some(status("Running"));
    let refused = anchors
        .replace_status(&name, &PostParams::default(), &stale)
        .await;
    assert_eq!(api_status(&refused), Some(409), "{refused:?}");
    let kept = anchors.get(&name).await.expect("get");
    assert_eq!(kept.status.map(|status| status.phase).as_deref(), Some("Created"));

    let wrong_uid = DeleteParams {
        preconditions: Some(Preconditions {
            uid: Some("00000000-0000-0000-0000-000000000000".to_owned()),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    let refused = anchors.delete(&name, &wrong_uid).await;
    assert_eq!(api_status(&refused), Some(409), "{refused:?}");
    anchors
        .get(&name)
        .await
        .expect("still there after the refused delete");

    let right_uid = DeleteParams {
        preconditions: Some(Preconditions {
            uid: original.uid(),
            resource_version: None,
        }),
        ..DeleteParams::default()
    };
    anchors
        .delete(&name, &right_uid)
        .await
        .expect("delete with the right UID");
    assert_eq!(api_status(&anchors.get(&name).await), Some(404));
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn deleting_an_owner_collects_its_pod_and_block_owner_deletion_needs_rights() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();
    let anchors: Api<OabSession> = Api::namespaced(cluster.broker(), namespace);
    let pods: Api<Pod> = Api::namespaced(cluster.broker(), namespace);
    let session = unique_session_id();
    let name = format!("oab-s-{session}");
    let pod_name = format!("oab-w-{session}");
    // A worker as the admission policy admits it: the session's own account, which exists.
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.admin(), namespace);
    let account = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(format!("oab-i-{session}-1")),
            ..ObjectMeta::default()
        },
        automount_service_account_token: Some(false),
        ..ServiceAccount::default()
    };
    accounts
        .create(&PostParams::default(), &account)
        .await
        .expect("the session's account");
    let owner = anchors
        .create(&PostParams::default(), &anchor(&name))
        .await
        .expect("create the owner");
    let mut reference = OwnerReference {
        api_version: OabSession::api_version(&()).into_owned(),
        kind: OabSession::kind(&()).into_owned(),
        name: name.clone(),
        uid: owner.uid().expect("a created object has a UID"),
        controller: Some(true),
        block_owner_deletion: Some(true),
    };

    // OwnerReferencesPermissionEnforcement: blocking the owner's deletion needs update on
    // oabsessions/finalizers, which the broker's Role does not grant.
    let mut pod = restricted_pod(&pod_name, "openab.dev/absent:test", &[]);
    pod.metadata.labels = Some(ours(&session, "worker"));
    if let Some(spec) = pod.spec.as_mut() {
        spec.service_account_name = Some(format!("oab-i-{session}-1"));
    }
    pod.metadata.owner_references = Some(vec![reference.clone()]);
    let refused = pods.create(&PostParams::default(), &pod).await;
    assert_eq!(api_status(&refused), Some(403), "{refused:?}");

    reference.block_owner_deletion = None;
    pod.metadata.owner_references = Some(vec![reference]);
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("an owned Pod without blockOwnerDeletion");
    anchors
        .delete(&name, &DeleteParams::background())
        .await
        .expect("delete the owner");
    wait_until(
        "the garbage collector to delete the owned Pod",
        GENEROUS,
        || async { (api_status(&pods.get(&pod_name).await) == Some(404)).then_some(()) },
    )
    .await;
    let _ = accounts
        .delete(&format!("oab-i-{session}-1"), &DeleteParams::default())
        .await;
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn a_pod_scheduled_onto_a_kwok_node_becomes_ready() {
    let cluster = TestCluster::connect().await;
    assert!(
        cluster.kwok_nodes() > 0,
        "this cluster has no kwok nodes (OPENAB_KWOK_NODES); on kind, skip this test"
    );
    let namespace = cluster.fresh_namespace("smoke-kwok").await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), namespace.name());
    let mut pod = restricted_pod("fake", ABSENT_IMAGE, &[]);
    let spec = pod.spec.as_mut().expect("spec");
    spec.node_selector = Some([("type".to_owned(), "kwok".to_owned())].into());
    spec.tolerations = Some(vec![Toleration {
        key: Some("kwok.x-k8s.io/node".to_owned()),
        operator: Some("Exists".to_owned()),
        effect: Some("NoSchedule".to_owned()),
        ..Toleration::default()
    }]);
    pods.create(&PostParams::default(), &pod).await.expect("create");

    let ready = wait_until("the kwok Pod to be Ready", GENEROUS, || async {
        let pod = pods.get("fake").await.ok()?;
        let status = pod.status.as_ref()?;
        let ready = status
            .conditions
            .as_ref()?
            .iter()
            .any(|condition| condition.type_ == "Ready" && condition.status == "True");
        ready.then_some(pod)
    })
    .await;
    let node = ready.spec.and_then(|spec| spec.node_name).unwrap_or_default();
    assert!(node.starts_with("kwok-"), "scheduled onto {node}");
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn a_watch_resumed_from_a_resource_version_delivers_the_missed_events() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.fresh_namespace("smoke-watch").await;
    let maps: Api<ConfigMap> = Api::namespaced(cluster.admin(), namespace.name());
    // Labelled: the controller-manager publishes kube-root-ca.crt into every new namespace too.
    let first = ConfigMap {
        metadata: ObjectMeta {
            name: Some("first".to_owned()),
            labels: Some([("smoke".to_owned(), "watch".to_owned())].into()),
            ..ObjectMeta::default()
        },
        ..ConfigMap::default()
    };
    let created = maps.create(&PostParams::default(), &first).await.expect("create");
    let resume_from = created.resource_version().expect("a resourceVersion");

    // Changes made while nobody watches.
    for step in 1..=3 {
        let patch = serde_json::json!({ "data": { "step": step.to_string() } });
        maps.patch("first", &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .expect("patch");
    }
    let mut second = first.clone();
    second.metadata.name = Some("second".to_owned());
    maps.create(&PostParams::default(), &second)
        .await
        .expect("create");

    let events = maps
        .watch(
            &WatchParams::default().labels("smoke=watch").timeout(30),
            &resume_from,
        )
        .await
        .expect("watch from the old resourceVersion");
    let seen: Vec<String> = events
        .map_ok(|event| match event {
            WatchEvent::Added(map) => format!("added {}", map.name_any()),
            WatchEvent::Modified(map) => format!(
                "modified {} step {}",
                map.name_any(),
                map.data
                    .and_then(|data| data.get("step").cloned())
                    .unwrap_or_default()
            ),
            WatchEvent::Deleted(map) => format!("deleted {}", map.name_any()),
            WatchEvent::Bookmark(_) => "bookmark".to_owned(),
            WatchEvent::Error(error) => format!("error {error:?}"),
        })
        .take(4)
        .try_collect()
        .await
        .expect("the watch delivers events");
    assert_eq!(
        seen,
        [
            "modified first step 1",
            "modified first step 2",
            "modified first step 3",
            "added second",
        ]
    );
}

/// The test cluster's provisioner (local-path-provisioner, `WaitForFirstConsumer`): a claim waits
/// for its first Pod, then becomes a directory on that Pod's node, and goes with the claim.
#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_claim_of_the_test_storage_class_binds_on_its_first_pods_node_and_its_volume_goes_with_it() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.fresh_namespace("smoke-storage").await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.admin(), namespace.name());
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), namespace.name());
    let volumes: Api<PersistentVolume> = Api::all(cluster.admin());
    let claim = PersistentVolumeClaim {
        metadata: ObjectMeta {
            name: Some("data".to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(PersistentVolumeClaimSpec {
            storage_class_name: Some("openab-test-local".to_owned()),
            access_modes: Some(vec!["ReadWriteOncePod".to_owned()]),
            resources: Some(VolumeResourceRequirements {
                requests: Some([("storage".to_owned(), Quantity("1Gi".to_owned()))].into()),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    };
    claims
        .create(&PostParams::default(), &claim)
        .await
        .expect("create");
    // No volume before a Pod uses the claim: the volume controller says it waits for one.
    let events: Api<Event> = Api::namespaced(cluster.admin(), namespace.name());
    wait_until("the claim to wait for its first consumer", GENEROUS, || async {
        let listed = events.list(&ListParams::default()).await.ok()?;
        listed
            .items
            .iter()
            .any(|e| e.reason.as_deref() == Some("WaitForFirstConsumer"))
            .then_some(())
    })
    .await;
    let pending = claims.get("data").await.expect("the claim");
    assert_eq!(pending.status.and_then(|s| s.phase).as_deref(), Some("Pending"));

    let mut pod = restricted_pod("consumer", "openab.dev/worker:test", &["sleep", "3600"]);
    let spec = pod.spec.as_mut().expect("spec");
    spec.volumes = Some(vec![Volume {
        name: "data".to_owned(),
        persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
            claim_name: "data".to_owned(),
            read_only: None,
        }),
        ..Volume::default()
    }]);
    spec.containers[0].volume_mounts = Some(vec![VolumeMount {
        name: "data".to_owned(),
        mount_path: "/data".to_owned(),
        ..VolumeMount::default()
    }]);
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create the consumer");
    let volume = wait_until("the claim to be bound", GENEROUS, || async {
        let claim = claims.get("data").await.ok()?;
        let bound = claim.status.as_ref()?.phase.as_deref() == Some("Bound");
        bound.then(|| claim.spec?.volume_name).flatten()
    })
    .await;
    let node = wait_until("the consumer to be scheduled", GENEROUS, || async {
        pods.get("consumer").await.ok()?.spec?.node_name
    })
    .await;
    let provisioned = volumes.get(&volume).await.expect("the bound volume");
    let spec = provisioned.spec.expect("spec");
    assert_eq!(spec.access_modes, Some(vec!["ReadWriteOncePod".to_owned()]));
    let directory = spec.host_path.expect("a directory on the node").path;
    let pinned = spec
        .node_affinity
        .and_then(|a| a.required)
        .map(|r| r.node_selector_terms)
        .into_iter()
        .flatten()
        .flat_map(|term| term.match_expressions.into_iter().flatten())
        .flat_map(|e| e.values.into_iter().flatten())
        .collect::<Vec<_>>();
    assert_eq!(pinned, [node], "the volume is pinned to its first Pod's node");
    let metadata = std::fs::metadata(&directory).expect("the volume's directory on this node");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&metadata),
        65532,
        "{directory}"
    );

    pods.delete("consumer", &DeleteParams::default().grace_period(0))
        .await
        .expect("delete the consumer");
    claims
        .delete("data", &DeleteParams::default())
        .await
        .expect("delete");
    wait_until("the released volume to be removed", GENEROUS, || async {
        (api_status(&volumes.get(&volume).await) == Some(404)).then_some(())
    })
    .await;
    assert!(
        !std::path::Path::new(&directory).exists(),
        "{directory} is removed with the volume"
    );
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn a_fresh_namespace_is_gone_after_its_guard_drops() {
    let cluster = TestCluster::connect().await;
    let namespaces: Api<test_cluster::k8s_openapi::api::core::v1::Namespace> = Api::all(cluster.admin());
    let name = {
        let namespace = cluster.fresh_namespace("smoke-guard").await;
        namespaces.get(namespace.name()).await.expect("exists while held");
        namespace.name().to_owned()
    };
    // Namespace deletion is the controller-manager's: the object goes once its contents are gone.
    wait_until("the namespace to be deleted", GENEROUS, || async {
        let namespace = namespaces.get(&name).await;
        match namespace {
            Err(_) => (api_status(&namespace) == Some(404)).then_some(()),
            Ok(namespace) => {
                assert!(
                    namespace.metadata.deletion_timestamp.is_some(),
                    "{name} not deleting"
                );
                None
            }
        }
    })
    .await;
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn every_deploy_file_passes_a_server_side_dry_run() {
    // The cluster applied the kustomization; files outside it (the controller) must pass too.
    let _cluster = TestCluster::connect().await;
    let deploy = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/kubernetes");
    let mut files: Vec<_> = std::fs::read_dir(&deploy)
        .expect("deploy/kubernetes")
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "yaml") && !path.ends_with("kustomization.yaml"))
        .collect();
    files.sort();
    assert!(files.iter().any(|f| f.ends_with("controller.yaml")), "{files:?}");
    for file in &files {
        let output = std::process::Command::new("kubectl")
            .args(["apply", "--dry-run=server", "-f"])
            .arg(file)
            .output()
            .expect("kubectl (scripts/cluster env puts it on PATH)");
        assert!(
            output.status.success(),
            "{}: {}",
            file.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
