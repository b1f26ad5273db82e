//! Events on a session's anchor at each transition, published with the broker's own identity and
//! admitted by `admission.yaml`'s `openab-session-events`: a lifecycle leaves `Created`,
//! `WorkerStarted`, `Suspended` and `Closed` on the anchor, a worker that cannot start leaves a
//! `StartFailed` Warning naming the classified cause, and the broker's identity cannot publish an
//! Event about anything but a session anchor.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test events -- --ignored`.

mod common;

use std::time::Duration;

use common::{runtime, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::{
    CloseReason, CreateOptions, SessionId, SessionIdentity, SessionRuntime, SuspendReason,
};
use test_cluster::k8s_openapi::api::core::v1::ObjectReference;
use test_cluster::k8s_openapi::api::events::v1::Event;
use test_cluster::k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use test_cluster::kube::api::{ListParams, ObjectMeta, PostParams};
use test_cluster::kube::Api;
use test_cluster::{api_status, unique_name, wait_until, TestCluster};

/// The reasons and notes of the Events about session `id`'s anchor, oldest first.
async fn events_of(cluster: &TestCluster, id: &SessionId) -> Vec<(String, String, String)> {
    let events: Api<Event> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let listed = events
        .list(&ListParams::default().fields(&format!("regarding.name=oab-s-{id}")))
        .await
        .expect("list the session's Events");
    let mut found: Vec<_> = listed
        .into_iter()
        .map(|event| {
            (
                event.event_time.clone(),
                event.reason.unwrap_or_default(),
                event.type_.unwrap_or_default(),
                event.note.unwrap_or_default(),
            )
        })
        .collect();
    found.sort_by(|a, b| a.0.as_ref().map(|t| t.0).cmp(&b.0.as_ref().map(|t| t.0)));
    found
        .into_iter()
        .map(|(_, reason, type_, note)| (reason, type_, note))
        .collect()
}

async fn wait_for_reasons(
    cluster: &TestCluster,
    id: &SessionId,
    reasons: &[&str],
) -> Vec<(String, String, String)> {
    wait_until("the session's Events", Duration::from_secs(30), || async {
        let events = events_of(cluster, id).await;
        reasons
            .iter()
            .all(|wanted| events.iter().any(|(reason, _, _)| reason == wanted))
            .then_some(events)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_lifecycle_leaves_an_event_at_each_transition_on_the_anchor() {
    let installation = unique_name("events");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "test", "events").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    drop(runtime.attach(&id).await.expect("attach"));
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    drop(runtime.attach(&id).await.expect("resume"));
    runtime.close(&id, CloseReason::Ended).await.expect("close");

    let events = wait_for_reasons(
        &cluster,
        &id,
        &["Created", "WorkerStarted", "Suspended", "Closed"],
    )
    .await;
    let note_of = |wanted: &str| {
        events
            .iter()
            .filter(|(reason, _, _)| reason == wanted)
            .map(|(_, type_, note)| format!("{type_}: {note}"))
            .collect::<Vec<_>>()
    };
    assert_eq!(note_of("Created"), ["Normal: session created"]);
    let started = note_of("WorkerStarted");
    assert!(
        started.iter().any(|note| note.contains("(new)"))
            && started.iter().any(|note| note.contains("(resume)")),
        "{started:?}"
    );
    assert_eq!(note_of("Suspended"), ["Normal: suspended (idle); storage kept"]);
    assert_eq!(
        note_of("Closed"),
        ["Normal: closed (ended); its volume is deleted"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_start_failure_is_a_warning_naming_its_cause() {
    let installation = unique_name("events-fail");
    let cluster = TestCluster::connect().await;
    // An image the node does not have, never pulled: the kubelet says ErrImageNeverPull.
    let document = WORKER_PROFILE.replace("openab.dev/worker:test", "openab.dev/absent:test");
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "test", "fails").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let error = runtime.attach(&id).await.expect_err("no image, no worker");
    assert_eq!(error.cause_label(), "image_pull", "{error}");
    let events = wait_for_reasons(&cluster, &id, &["StartFailed"]).await;
    let (_, type_, note) = events
        .iter()
        .find(|(reason, _, _)| reason == "StartFailed")
        .expect("a StartFailed event");
    assert_eq!(type_, "Warning");
    assert!(note.starts_with("image_pull: "), "{note}");
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn the_brokers_events_are_about_its_sessions_only() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace().to_owned();
    let events: Api<Event> = Api::namespaced(cluster.broker(), &namespace);
    let event = |name: &str, controller: &str, kind: &str, regarding: &str| Event {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.clone()),
            ..ObjectMeta::default()
        },
        event_time: Some(MicroTime(test_cluster::k8s_openapi::jiff::Timestamp::now())),
        reporting_controller: Some(controller.to_owned()),
        reporting_instance: Some("test".to_owned()),
        action: Some("Test".to_owned()),
        reason: Some("Test".to_owned()),
        type_: Some("Normal".to_owned()),
        regarding: Some(ObjectReference {
            kind: Some(kind.to_owned()),
            name: Some(regarding.to_owned()),
            namespace: Some(namespace.clone()),
            ..ObjectReference::default()
        }),
        ..Event::default()
    };
    let allowed = unique_name("allowed");
    // The positive control: an Event as the runtime publishes them is admitted.
    events
        .create(
            &PostParams::default(),
            &event(&allowed, "openab.dev/session-runtime", "OabSession", "oab-s-x"),
        )
        .await
        .expect("an Event about a session anchor");
    let _ = Api::<Event>::namespaced(cluster.admin(), &namespace)
        .delete(&allowed, &Default::default())
        .await;
    for (what, controller, kind, regarding) in [
        ("another controller's name", "kubelet", "OabSession", "oab-s-x"),
        ("a Pod", "openab.dev/session-runtime", "Pod", "oab-s-x"),
        (
            "a Lease under an anchor's name",
            "openab.dev/session-runtime",
            "Lease",
            "oab-s-x",
        ),
    ] {
        let refused = events
            .create(
                &PostParams::default(),
                &event(&unique_name("refused"), controller, kind, regarding),
            )
            .await;
        assert_eq!(api_status(&refused), Some(403), "{what}: {refused:?}");
    }
}
