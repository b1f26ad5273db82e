//! Start failures from real ones, classified with the Pod's own words: a missing image, resources
//! no node has, a RuntimeClass that does not exist, a RuntimeClass whose handler the node lacks
//! (in the kubelet's words); an agent killed over its memory limit after
//! the start; and objects under a session's names that are not the session's, which are never
//! adopted.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test start_failures -- --ignored`.

mod common;

use std::time::Duration;

use common::{AdminObject, WORKER_PROFILE};
use runtime_kubernetes::KubernetesRuntime;
use runtime_kubernetes::{OabSession, OabSessionSpec};
use session_runtime::config::{KubernetesConfig, Reach};
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime, WorkerFailure};
use test_cluster::kube::api::{DeleteParams, PostParams};
use test_cluster::kube::Api;
use test_cluster::TestCluster;

/// Attaches a fresh session under `profile` and returns how the start failed.
async fn start_failure(installation: &str, profile: &str, start_timeout: Duration) -> WorkerFailure {
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, installation, profile).await;
    let mut config = KubernetesConfig::new(cluster.sessions_namespace(), profile.name());
    config.reach = Reach::Exec;
    config.start_timeout = start_timeout;
    let runtime = KubernetesRuntime::builder(cluster.broker(), config)
        .installation(installation)
        .build()
        .expect("a runtime");
    let identity = SessionIdentity::new(installation, "agent", "test", "failing thread").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let failure = match runtime.attach(&id).await {
        Err(Error::WorkerFailed { cause, .. }) => cause,
        Ok(_) => panic!("the worker started"),
        Err(other) => panic!("expected a classified start failure, got {other}"),
    };
    runtime.close(&id, CloseReason::Ended).await.expect("close");
    failure
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_missing_image_is_an_image_pull_failure() {
    let profile = WORKER_PROFILE.replace("openab.dev/worker:test", "openab.dev/absent:test");
    let failure = start_failure("fail-image", &profile, Duration::from_secs(60)).await;
    assert!(
        matches!(&failure, WorkerFailure::ImagePull(said) if said.contains("ErrImageNeverPull")),
        "{failure:?}"
    );
    assert!(!failure.retryable());
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn an_agent_over_its_memory_limit_is_killed_and_the_relay_reports_it() {
    // The relay starts the agent at the broker's first hello, so the worker becomes ready and the
    // agent (dd with a 512 MiB buffer) meets the 64 MiB limit only after attach: the kernel's OOM
    // killer ends the agent, not the relay, and the relay reports the SIGKILL as the exit.
    let profile = WORKER_PROFILE
        .replace(
            r#"agent = ["/usr/local/bin/acp-test-agent"]"#,
            r#"agent = ["/bin/dd", "if=/dev/zero", "of=/dev/null", "bs=512M", "count=1"]"#,
        )
        .replace(r#"memory_limit = "256Mi""#, r#"memory_limit = "64Mi""#);
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, "fail-memory", &profile).await;
    let mut config = KubernetesConfig::new(cluster.sessions_namespace(), profile.name());
    config.reach = Reach::Exec;
    let runtime = KubernetesRuntime::builder(cluster.broker(), config)
        .installation("fail-memory")
        .build()
        .expect("a runtime");
    let identity = SessionIdentity::new("fail-memory", "agent", "test", "hungry").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let attached = runtime.attach(&id).await;
    let exit = match attached {
        Ok(attachment) => attachment.control().wait().await.expect("the exit"),
        Err(Error::WorkerFailed { cause, .. }) => panic!("the relay itself failed: {cause:?}"),
        Err(other) => panic!("attach: {other}"),
    };
    assert!(
        matches!(
            exit,
            session_runtime::WorkerExit::Signal(9) | session_runtime::WorkerExit::OutOfMemory
        ),
        "{exit:?}"
    );
    runtime.close(&id, CloseReason::Ended).await.expect("close");
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn resources_no_node_has_are_unschedulable_at_the_timeout() {
    let profile = WORKER_PROFILE.replace("[resources]\n", "[resources]\ncpu_request = \"512\"\n");
    let failure = start_failure("fail-schedule", &profile, Duration::from_secs(5)).await;
    assert!(
        matches!(&failure, WorkerFailure::Unschedulable(said) if said.contains("Insufficient cpu")),
        "{failure:?}"
    );
    assert!(failure.retryable());
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_missing_runtime_class_is_refused_at_admission() {
    let profile = format!("runtime_class = \"no-such-sandbox\"\n{WORKER_PROFILE}");
    let failure = start_failure("fail-runtime-class", &profile, Duration::from_secs(30)).await;
    assert!(
        matches!(&failure, WorkerFailure::Spawn(said) if said.contains("no-such-sandbox")),
        "{failure:?}"
    );
}

/// A cluster-wide RuntimeClass, deleted when dropped.
struct RuntimeClass(&'static str);

impl RuntimeClass {
    fn apply(name: &'static str, handler: &str) -> RuntimeClass {
        let manifest = format!(
            "{{\"apiVersion\":\"node.k8s.io/v1\",\"kind\":\"RuntimeClass\",\"metadata\":{{\"name\":\"{name}\"}},\"handler\":\"{handler}\"}}"
        );
        let mut child = std::process::Command::new("kubectl")
            .args(["apply", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("kubectl (scripts/cluster env puts it on PATH)");
        std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), manifest.as_bytes())
            .expect("write the manifest");
        assert!(
            child.wait().expect("kubectl").success(),
            "kubectl apply {manifest}"
        );
        RuntimeClass(name)
    }
}

impl Drop for RuntimeClass {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kubectl")
            .args(["delete", "runtimeclass", self.0, "--ignore-not-found"])
            .output();
    }
}

/// The class exists but the node has no such handler (a cluster where not every node has
/// gVisor, say): the Pod stays `ContainerCreating` while the kubelet retries, and the start
/// timeout reports the kubelet's refusal rather than a bare timeout.
#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_runtime_class_whose_handler_the_node_lacks_fails_in_the_kubelets_words() {
    let _class = RuntimeClass::apply("oab-test-no-handler", "no-such-handler");
    let profile = format!("runtime_class = \"oab-test-no-handler\"\n{WORKER_PROFILE}");
    let failure = start_failure("fail-runtime-handler", &profile, Duration::from_secs(20)).await;
    assert!(
        matches!(&failure, WorkerFailure::Spawn(said)
            if said.starts_with("FailedCreatePodSandBox") && said.contains("no-such-handler")),
        "{failure:?}"
    );
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]
async fn an_object_under_the_sessions_name_that_is_not_its_own_is_never_adopted() {
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, "foreign", WORKER_PROFILE).await;
    let runtime = KubernetesRuntime::builder(
        cluster.broker(),
        KubernetesConfig::new(cluster.sessions_namespace(), profile.name()),
    )
    .installation("foreign")
    .build()
    .expect("a runtime");
    let identity = SessionIdentity::new("foreign", "agent", "test", "squatted").expect("identity");
    let id = identity.id();
    // Someone else's OabSession under the anchor's name, without the session's annotation.
    let leases: Api<OabSession> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = format!("oab-s-{id}");
    let squatter = OabSession::new(
        &name,
        OabSessionSpec {
            installation: "foreign".to_owned(),
            identity_digest: "ab".repeat(32),
        },
    );
    let _ = leases.delete(&name, &DeleteParams::default()).await;
    leases
        .create(&PostParams::default(), &squatter)
        .await
        .expect("the foreign OabSession");

    match runtime.create(&identity, &CreateOptions::new()).await {
        Err(error @ Error::Backend { retryable: false, .. }) => {
            assert!(error.to_string().contains(&name), "{error}")
        }
        other => panic!("a foreign anchor must be refused, got {other:?}"),
    }
    let after = leases.get(&name).await.expect("still there");
    assert!(
        after.status.is_none() && after.metadata.annotations.is_none(),
        "the foreign OabSession was changed: {after:?}"
    );
    // Closing a session whose anchor is not its own changes nothing either.
    assert!(runtime.close(&id, CloseReason::Reset).await.is_err());
    leases.get(&name).await.expect("still there after close");
    leases
        .delete(&name, &DeleteParams::default())
        .await
        .expect("clean up");
}
