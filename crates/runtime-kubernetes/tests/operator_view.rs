//! What an operator sees and does with `kubectl`: sessions listed as `OabSession`s with their
//! columns, `kubectl wait` on their conditions, their Events in `kubectl describe`, and
//! `kubectl delete oabsession`, which closes the session through the controller and leaves no
//! worker and no volume behind.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test operator_view -- --ignored`.

mod common;

use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use common::{builder, runtime, AdminObject, WORKER_PROFILE};
use runtime_kubernetes::{Controller, ControllerEvent, KubernetesRuntime, LeaderElection, OabSession};
use session_runtime::config::Reach;
use session_runtime::{
    CloseReason, CreateOptions, Retention, RetentionPolicy, SessionId, SessionIdentity, SessionRuntime,
    SuspendReason,
};
use test_cluster::k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use test_cluster::kube::Api;
use test_cluster::{unique_name, wait_until, TestCluster};
use tokio::sync::oneshot;

/// Starting a worker on this 2-core machine takes seconds; this bounds a hang.
const GENEROUS: Duration = Duration::from_secs(120);

fn kubectl(args: &[&str]) -> Output {
    Command::new("kubectl")
        .args(args)
        .output()
        .expect("kubectl (scripts/cluster env puts it on PATH)")
}

/// Creates the session of `thread` in `installation`.
async fn create(runtime: &KubernetesRuntime, installation: &str, thread: &str) -> SessionId {
    let identity = SessionIdentity::new(installation, "agent", "test", thread).expect("identity");
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create")
        .id
}

fn said(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn kubectl_lists_a_session_with_its_columns_waits_on_its_conditions_and_describes_its_events() {
    let installation = unique_name("view");
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let id = create(&runtime, &installation, "viewed").await;
    let name = format!("oab-s-{id}");
    let attachment = runtime.attach(&id).await.expect("attach");

    let listed = kubectl(&["get", "oabsessions", "-n", namespace, &name]);
    assert!(listed.status.success(), "{}", said(&listed));
    let text = String::from_utf8_lossy(&listed.stdout);
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap_or_default().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "PHASE", "GENERATION", "WORKER", "STORAGE", "IDLE", "AGE"],
        "{text}"
    );
    let row: Vec<&str> = lines.next().unwrap_or_default().split_whitespace().collect();
    let status = runtime.status(&id).await.expect("status");
    let generation = status.generation.to_string();
    let worker = format!("oab-w-{id}");
    assert_eq!(
        row.get(..5),
        Some(
            [
                name.as_str(),
                "Running",
                generation.as_str(),
                worker.as_str(),
                status.storage_refs[0].trim_start_matches("persistentvolumeclaim/"),
            ]
            .as_slice()
        ),
        "{text}"
    );

    // The negative control: not suspended yet, so a short wait times out.
    let early = kubectl(&[
        "wait",
        "-n",
        namespace,
        "--for=condition=Suspended",
        "--timeout=2s",
        &format!("oabsession/{name}"),
    ]);
    assert!(
        !early.status.success(),
        "suspended before the suspend: {}",
        said(&early)
    );
    let waiting = {
        let namespace = namespace.to_owned();
        let name = name.clone();
        tokio::task::spawn_blocking(move || {
            kubectl(&[
                "wait",
                "-n",
                &namespace,
                "--for=condition=Suspended",
                "--timeout=60s",
                &format!("oabsession/{name}"),
            ])
        })
    };
    drop(attachment);
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    let waited = waiting.await.expect("the wait");
    assert!(
        waited.status.success(),
        "kubectl wait after the suspend: {}",
        said(&waited)
    );

    let described = kubectl(&["describe", "oabsession", "-n", namespace, &name]);
    assert!(described.status.success(), "{}", said(&described));
    let text = String::from_utf8_lossy(&described.stdout);
    // Events are published in the background: wait for the last one to show.
    let mut text = text.into_owned();
    for _ in 0..20 {
        if text.contains("Suspended") && text.contains("WorkerStarted") && text.contains("Created") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        text = String::from_utf8_lossy(&kubectl(&["describe", "oabsession", "-n", namespace, &name]).stdout)
            .into_owned();
    }
    let events = text.split("Events:").nth(1).unwrap_or_default();
    for reason in ["Created", "WorkerStarted", "Suspended"] {
        assert!(events.contains(reason), "no {reason} Event in:\n{text}");
    }
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn deleting_an_oabsession_closes_its_session_and_leaves_no_worker_and_no_volume() {
    let installation = unique_name("deleted");
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let election = LeaderElection::new(cluster.broker(), namespace, &installation, "deleting")
        .with_duration(Duration::from_secs(3));
    // Its full passes only at the start: the delete is handled from the watch.
    let mut controller = Controller::new(Arc::clone(&runtime), election).resync(Duration::from_secs(600));
    let mut events = controller.subscribe();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(controller.run(async move {
        let _ = stopped.await;
    }));

    let id = create(&runtime, &installation, "deleted").await;
    let attachment = runtime.attach(&id).await.expect("attach");
    let claim = runtime.status(&id).await.expect("status").storage_refs[0]
        .trim_start_matches("persistentvolumeclaim/")
        .to_owned();
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), namespace);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.admin(), namespace);
    let worker = format!("oab-w-{id}");
    assert!(
        pods.get_opt(&worker).await.expect("read").is_some(),
        "the positive control: a worker runs"
    );
    assert!(
        claims.get_opt(&claim).await.expect("read").is_some(),
        "and its volume exists"
    );

    let name = format!("oab-s-{id}");
    let deleted = kubectl(&["delete", "oabsession", "-n", namespace, &name, "--wait=false"]);
    assert!(deleted.status.success(), "{}", said(&deleted));
    let anchors: Api<OabSession> = Api::namespaced(cluster.admin(), namespace);
    wait_until("the deleted OabSession to be gone", GENEROUS, || async {
        anchors.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await;
    let closed_by_watch = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(event) = events.recv().await {
            if let ControllerEvent::Session(session, report) = event {
                if session == id && report.finished_closes.contains(&id) {
                    return true;
                }
            }
        }
        false
    })
    .await
    .unwrap_or(false);
    assert!(
        closed_by_watch,
        "the controller closed the session from the watch"
    );
    wait_until("the worker to be gone", GENEROUS, || async {
        pods.get_opt(&worker).await.ok()?.is_none().then_some(())
    })
    .await;
    wait_until("the volume to be gone", GENEROUS, || async {
        claims.get_opt(&claim).await.ok()?.is_none().then_some(())
    })
    .await;
    assert!(
        matches!(
            runtime.attach(&id).await,
            Err(session_runtime::Error::NotFound { .. })
        ),
        "the session is gone with its anchor"
    );
    drop(attachment);
    let _ = stop.send(());
    task.await
        .expect("the controller task")
        .expect("a clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn a_deleted_oabsession_whose_volume_retention_keeps_stays_until_the_retention_ends() {
    let installation = unique_name("kept");
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let mut retention = RetentionPolicy::default();
    retention.ended = Retention::Retain;
    retention.retain_for = Some(Duration::from_secs(4));
    let runtime = builder(&cluster, &profile, Reach::Exec, &installation)
        .retention(retention)
        .build()
        .expect("runtime");
    let id = create(&runtime, &installation, "kept").await;
    let name = format!("oab-s-{id}");
    let claim = format!("oab-d-{id}-1");
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.admin(), namespace);
    let anchors: Api<OabSession> = Api::namespaced(cluster.admin(), namespace);

    let deleted = kubectl(&["delete", "oabsession", "-n", namespace, &name, "--wait=false"]);
    assert!(deleted.status.success(), "{}", said(&deleted));
    let report = runtime.reconcile().await.expect("reconcile");
    assert!(report.finished_closes.contains(&id), "{report:?}");
    let kept = anchors
        .get(&name)
        .await
        .expect("the anchor stays while it holds the volume");
    assert!(kept.metadata.deletion_timestamp.is_some(), "{kept:?}");
    let status = kept.status.expect("a status");
    assert_eq!(status.phase, "Closed");
    assert!(status.storage.ends_with("(retained)"), "{status:?}");
    assert!(
        claims.get_opt(&claim).await.expect("read").is_some(),
        "the retained volume is kept"
    );

    // Once the retention ends, a pass deletes the volume, and with it the anchor goes.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let report = runtime.reconcile().await.expect("reconcile");
    assert!(report.expired_storage.contains(&id), "{report:?}");
    assert!(report.expired_records.contains(&id), "{report:?}");
    assert!(
        anchors.get_opt(&name).await.expect("read").is_none(),
        "the anchor is gone"
    );
    wait_until("the volume to be gone", GENEROUS, || async {
        claims.get_opt(&claim).await.ok()?.is_none().then_some(())
    })
    .await;
}
