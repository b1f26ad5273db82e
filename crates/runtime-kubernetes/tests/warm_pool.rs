//! The warm pool on the real node and control plane: an attach claims a started worker with no
//! session, binds it and starts the agent in it; each member goes to exactly one session, even
//! when two brokers race; a member killed before its claim is passed over, one killed after it
//! ends the attachment as any worker would; a profile change replaces the members and leaves the
//! claimed workers alone; an empty pool falls back to the cold path; and two sessions that both
//! started warm pass the isolation acceptance suite.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test warm_pool -- --ignored`.

mod common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use common::{builder, AdminObject};
use runtime_kubernetes::KubernetesRuntime;
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{
    CloseReason, CreateOptions, SessionId, SessionIdentity, SessionRuntime, SessionState, SuspendReason,
};
use test_cluster::k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use test_cluster::kube::api::{DeleteParams, ListParams};
use test_cluster::kube::{Api, ResourceExt};
use test_cluster::{unique_name, TestCluster};
use worker_relay::BrokerKey;

/// The test agent's worker with ephemeral storage and a pool of `pool` (with `extra` keys).
fn pooled_profile(pool: u32, extra: &str) -> String {
    format!(
        r#"
image = "openab.dev/worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/acp-test-agent"]
termination_grace = "2s"
max_lifetime = "1h"
warm_pool = {pool}
{extra}
[resources]
memory_limit = "256Mi"

[storage]
kind = "ephemeral"
"#
    )
}

fn key() -> BrokerKey {
    BrokerKey::new(vec![7; 32])
}

fn broker(cluster: &TestCluster, profile: &AdminObject, installation: &str) -> Arc<KubernetesRuntime> {
    broker_over(cluster, profile, installation, Reach::PodIp)
}

fn broker_over(
    cluster: &TestCluster,
    profile: &AdminObject,
    installation: &str,
    reach: Reach,
) -> Arc<KubernetesRuntime> {
    Arc::new(
        builder(cluster, profile, reach, installation)
            .broker_key(key())
            .build()
            .expect("a broker"),
    )
}

fn pods(cluster: &TestCluster) -> Api<Pod> {
    Api::namespaced(cluster.admin(), cluster.sessions_namespace())
}

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.labels().get(key).map(String::as_str)
}

/// The installation's unclaimed pool members (ready or not) that are not being deleted.
async fn members(cluster: &TestCluster, installation: &str) -> Vec<Pod> {
    pods(cluster)
        .list(&ListParams::default().labels(&format!(
            "openab.dev/installation={installation},openab.dev/role=pool"
        )))
        .await
        .expect("list the pool")
        .items
        .into_iter()
        .filter(|pod| pod.metadata.deletion_timestamp.is_none())
        .collect()
}

fn ready(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|status| status.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|condition| condition.type_ == "Ready" && condition.status == "True")
        })
}

/// Runs reconcile passes until the pool holds `size` ready members (and no more), within a
/// minute; returns the members' names.
async fn filled(
    cluster: &TestCluster,
    runtime: &KubernetesRuntime,
    installation: &str,
    size: usize,
) -> BTreeSet<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let report = runtime.reconcile().await.expect("reconcile");
        assert!(report.errors.is_empty(), "{:?}", report.errors);
        let now = members(cluster, installation).await;
        if now.len() == size && now.iter().all(ready) {
            return now.iter().map(ResourceExt::name_any).collect();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the pool did not fill to {size}: {:?}",
            now.iter()
                .map(|pod| (pod.name_any(), ready(pod)))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The worker Pod's name as the session's status gives it.
async fn worker_of(runtime: &KubernetesRuntime, id: &SessionId) -> String {
    let status = runtime.status(id).await.expect("status");
    let worker = status.worker.expect("a running worker").worker_id;
    worker.trim_start_matches("pod/").to_owned()
}

/// A prompt turn through `attachment`'s agent: the agent runs and answers.
async fn one_turn(client: &AcpClient) {
    client.initialize().await.expect("initialize");
    let session = client
        .new_session(client.working_dir())
        .await
        .expect("session/new");
    let outcome = client.prompt(&session, "hello").await.expect("a prompt turn");
    assert_eq!(outcome.stop_reason, "end_turn", "the turn ends well: {outcome:?}");
}

/// One session attached and closed, so that the broker's watch has listed the pool (its first
/// attach finds no member: the watch starts with it).
async fn warm_up(runtime: &KubernetesRuntime, installation: &str) {
    let warmup = new_session(runtime, installation, &unique_name("warmup")).await;
    drop(runtime.attach(&warmup).await.expect("attach"));
    runtime.close(&warmup, CloseReason::Ended).await.expect("close");
}

async fn new_session(runtime: &KubernetesRuntime, installation: &str, thread: &str) -> SessionId {
    let identity = SessionIdentity::new(installation, "agent", "test", thread).expect("identity");
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    identity.id()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_warm_worker_serves_a_new_session_and_is_never_returned_to_the_pool() {
    let installation = unique_name("warm");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, &pooled_profile(2, "")).await;
    let runtime = broker(&cluster, &profile, &installation);

    // An empty pool (nobody filled it yet): the cold path.
    let cold = new_session(&runtime, &installation, "cold").await;
    let client = AcpClient::new(runtime.attach(&cold).await.expect("a cold attach"));
    assert_eq!(worker_of(&runtime, &cold).await, format!("oab-w-{cold}"));
    one_turn(&client).await;
    drop(client);

    let pool = filled(&cluster, &runtime, &installation, 2).await;
    let id = new_session(&runtime, &installation, "warm").await;
    let client = AcpClient::new(runtime.attach(&id).await.expect("a warm attach"));
    let worker = worker_of(&runtime, &id).await;
    assert!(pool.contains(&worker), "{worker} is one of the pool's {pool:?}");
    one_turn(&client).await;
    // The agent runs as the session, in the claimed Pod, which is now the session's worker.
    let pod = pods(&cluster).get(&worker).await.expect("the claimed Pod");
    assert_eq!(label(&pod, "openab.dev/role"), Some("worker"));
    assert_eq!(label(&pod, "openab.dev/session"), Some(id.to_string().as_str()));
    assert_eq!(label(&pod, "openab.dev/pool-key"), None);
    let owner = &pod.owner_references()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str()),
        ("OabSession", format!("oab-s-{id}").as_str())
    );
    assert!(
        pod.spec
            .as_ref()
            .and_then(|spec| spec.active_deadline_seconds)
            .is_some_and(|limit| limit > 3600),
        "the profile's lifetime counts from the claim, the Pod's deadline from its start"
    );
    let environment = client.exec("echo \"$HOME\"").await.expect("exec");
    assert!(environment.stdout.contains("/home/agent"), "{environment:?}");

    // Refilled in the background to the pool's size, without the claimed one.
    let refilled = filled(&cluster, &runtime, &installation, 2).await;
    assert!(
        !refilled.contains(&worker),
        "a claimed worker is never a member again"
    );

    // A suspend stops the claimed worker for good; the next attach claims another member.
    drop(client);
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    assert!(
        pods(&cluster).get_opt(&worker).await.expect("read").is_none(),
        "the claimed worker is gone with the suspend"
    );
    assert!(members(&cluster, &installation)
        .await
        .iter()
        .all(|pod| pod.name_any() != worker));
    let resumed = AcpClient::new(runtime.attach(&id).await.expect("resume"));
    let second = worker_of(&runtime, &id).await;
    assert_ne!(second, worker);
    assert!(
        refilled.contains(&second),
        "{second} came from the pool {refilled:?}"
    );
    one_turn(&resumed).await;
    drop(resumed);

    for session in [cold, id] {
        runtime.close(&session, CloseReason::Ended).await.expect("close");
    }
    // A profile without a pool: the members go.
    empty_pool(&cluster, &runtime, &profile, &installation).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_brokers_racing_for_the_pool_give_each_member_to_one_session() {
    let installation = unique_name("warm-race");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, &pooled_profile(3, "")).await;
    let first = broker(&cluster, &profile, &installation);
    let second = broker(&cluster, &profile, &installation);
    let pool = filled(&cluster, &first, &installation, 3).await;
    // Each broker's watch has listed the pool before the race, so both pick from it.
    for runtime in [&first, &second] {
        warm_up(runtime, &installation).await;
    }
    let pool: BTreeSet<String> = members(&cluster, &installation)
        .await
        .iter()
        .map(ResourceExt::name_any)
        .chain(pool)
        .collect();

    let mut sessions = Vec::new();
    for index in 0..6 {
        let runtime = if index % 2 == 0 { &first } else { &second };
        sessions.push((
            Arc::clone(runtime),
            new_session(runtime, &installation, &format!("race-{index}")).await,
        ));
    }
    let attaches = sessions.iter().map(|(runtime, id)| {
        let runtime = Arc::clone(runtime);
        let id = *id;
        async move { (id, runtime.attach(&id).await) }
    });
    let attached = futures_util::future::join_all(attaches).await;
    let mut workers = BTreeSet::new();
    let mut clients = Vec::new();
    for (id, result) in attached {
        let attachment =
            result.unwrap_or_else(|error| panic!("session {id}: every attach is served: {error}"));
        let worker = worker_of(&first, &id).await;
        assert!(workers.insert(worker.clone()), "{worker} serves two sessions");
        let pod = pods(&cluster).get(&worker).await.expect("the worker");
        assert_eq!(
            label(&pod, "openab.dev/session"),
            Some(id.to_string().as_str()),
            "{worker} is labelled for the session whose record names it"
        );
        clients.push(AcpClient::new(attachment));
    }
    let warm = workers.iter().filter(|worker| pool.contains(*worker)).count();
    assert!(
        warm >= 1,
        "some attaches claimed members: {workers:?} from {pool:?}"
    );
    println!("{warm} of 6 attaches started warm");
    for client in &clients {
        one_turn(client).await;
    }
    drop(clients);
    for (runtime, id) in &sessions {
        runtime.close(id, CloseReason::Ended).await.expect("close");
    }
    empty_pool(&cluster, &first, &profile, &installation).await;
}

/// Turns the pool off and waits until its members are gone.
async fn empty_pool(
    cluster: &TestCluster,
    runtime: &KubernetesRuntime,
    profile: &AdminObject,
    installation: &str,
) {
    profile.replace_profile(cluster, &pooled_profile(0, "")).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let report = runtime.reconcile().await.expect("reconcile");
        if members(cluster, installation).await.is_empty() && report.warm_trimmed.is_empty() {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "the pool did not empty");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_member_killed_before_its_claim_is_passed_over_and_one_killed_after_ends_the_attachment() {
    let installation = unique_name("warm-kill");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, &pooled_profile(1, "")).await;
    let runtime = broker(&cluster, &profile, &installation);
    let pool = filled(&cluster, &runtime, &installation, 1).await;
    // The broker's watch lists the member, then the member is killed under it.
    warm_up(&runtime, &installation).await;
    let pool = filled(&cluster, &runtime, &installation, 1)
        .await
        .into_iter()
        .chain(pool)
        .collect::<BTreeSet<_>>();
    let victim = members(&cluster, &installation).await.remove(0).name_any();
    pods(&cluster)
        .delete(&victim, &DeleteParams::default().grace_period(0))
        .await
        .expect("kill the member");
    let id = new_session(&runtime, &installation, "after-kill").await;
    let client = AcpClient::new(
        runtime
            .attach(&id)
            .await
            .expect("an attach despite the dead member"),
    );
    let worker = worker_of(&runtime, &id).await;
    assert_ne!(worker, victim, "a killed member serves nobody");
    one_turn(&client).await;
    drop(client);
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");

    // Killed after its claim: the attachment ends as for any worker, and the next attach serves.
    let claimed = filled(&cluster, &runtime, &installation, 1).await;
    let mut attachment = runtime.attach(&id).await.expect("a warm attach");
    let worker = worker_of(&runtime, &id).await;
    assert!(
        claimed.contains(&worker) && !pool.contains(&worker),
        "{worker} from {claimed:?}"
    );
    pods(&cluster)
        .delete(&worker, &DeleteParams::default().grace_period(0))
        .await
        .expect("kill the claimed worker");
    let ended = tokio::time::timeout(
        Duration::from_secs(30),
        tokio::io::copy(attachment.output(), &mut tokio::io::sink()),
    )
    .await
    .expect("the attachment's output ends when its worker is killed");
    println!("the attachment's output ended: {ended:?}");
    assert!(!attachment.control().is_alive(), "the worker is not alive");
    let again = AcpClient::new(runtime.attach(&id).await.expect("the next attach"));
    one_turn(&again).await;
    drop(again);
    runtime.close(&id, CloseReason::Ended).await.expect("close");
    assert_eq!(
        runtime.status(&id).await.expect("status").state,
        SessionState::Closed
    );
    empty_pool(&cluster, &runtime, &profile, &installation).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_profile_change_replaces_the_members_and_leaves_claimed_workers_alone() {
    let installation = unique_name("warm-change");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, &pooled_profile(2, "")).await;
    let runtime = broker(&cluster, &profile, &installation);
    filled(&cluster, &runtime, &installation, 2).await;
    warm_up(&runtime, &installation).await;
    let before = filled(&cluster, &runtime, &installation, 2).await;
    let id = new_session(&runtime, &installation, "claimed").await;
    let client = AcpClient::new(runtime.attach(&id).await.expect("a warm attach"));
    let worker = worker_of(&runtime, &id).await;
    assert!(before.contains(&worker));
    let old = filled(&cluster, &runtime, &installation, 2).await;

    profile
        .replace_profile(&cluster, &pooled_profile(2, "idle_ttl = \"45m\""))
        .await;
    let report = runtime.reconcile().await.expect("reconcile");
    let trimmed: BTreeSet<String> = report.warm_trimmed.iter().cloned().collect();
    assert_eq!(trimmed, old, "every member of the old version goes, nothing else");
    assert_eq!(report.warm_started.len(), 2, "{report:?}");
    let new = filled(&cluster, &runtime, &installation, 2).await;
    assert!(new.is_disjoint(&old));
    assert!(
        pods(&cluster).get_opt(&worker).await.expect("read").is_some(),
        "the claimed worker stays"
    );
    one_turn(&client).await;
    drop(client);
    runtime.close(&id, CloseReason::Ended).await.expect("close");
    empty_pool(&cluster, &runtime, &profile, &installation).await;
    // A trimmed member's account goes with it; a claimed one's once its Pod is gone (after a
    // grace, so not yet).
    let accounts: Api<ServiceAccount> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let left: BTreeSet<String> = accounts
        .list(&ListParams::default().labels(&format!(
            "openab.dev/installation={installation},openab.dev/role=pool"
        )))
        .await
        .expect("list accounts")
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert!(
        left.is_disjoint(&old),
        "trimmed members' accounts are gone: {left:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_sessions_that_started_warm_cannot_touch_each_other_over_exec() {
    let installation = unique_name("warm-isolation");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, &pooled_profile(2, "")).await;
    // Over pods/exec: the claimed members are reached through the exec policy's bridge too.
    let runtime = broker_over(&cluster, &profile, &installation, Reach::Exec);
    filled(&cluster, &runtime, &installation, 2).await;
    warm_up(&runtime, &installation).await;
    let pool = filled(&cluster, &runtime, &installation, 2).await;
    let options = isolation_suite::SuiteOptions::new(&installation);
    let report = isolation_suite::run(Arc::clone(&runtime) as Arc<dyn SessionRuntime>, &options)
        .await
        .expect("the suite runs");
    println!("{report}");
    let problems: Vec<_> = report.problems().collect();
    assert!(
        report.passed(),
        "isolation must hold between warm workers: {problems:#?}"
    );
    // The suite's two sessions took the pool's two members: neither is a member any more.
    let now: BTreeSet<String> = members(&cluster, &installation)
        .await
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    assert!(
        now.is_disjoint(&pool),
        "both sessions started warm: {pool:?} still in {now:?}"
    );
    empty_pool(&cluster, &runtime, &profile, &installation).await;
}
