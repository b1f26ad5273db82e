//! Real agents in worker Pods: the agent worker image, a fake OpenAI-compatible model in a Pod
//! on the bridge, codex-acp's configuration, and probes from a shell in a session's worker.

use std::time::Duration;

use serde_json::Value;
use session_runtime::testing::AcpClient;
use session_runtime::SessionId;
use test_cluster::k8s_openapi::api::core::v1::{Pod, Probe, TCPSocketAction};
use test_cluster::k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use test_cluster::kube::api::{ListParams, PostParams};
use test_cluster::kube::Api;
use test_cluster::{exec, restricted_pod, unique_name, wait_until, TestCluster, TestNamespace};

/// `deploy/worker/Dockerfile`'s image, as `e2e/images/build agent-worker` makes it.
pub const AGENT_IMAGE: &str = "openab.dev/agent-worker:test";
/// What the fake model answers.
pub const ANSWER: &str = "pong from the fake model";

/// The fake model in a Pod on the bridge, in a namespace of its own (as a model service outside
/// the sessions namespace, whose default-deny policy would refuse its clients), deleted when
/// dropped.
pub struct FakeModel {
    pub ip: String,
    _namespace: TestNamespace,
}

impl FakeModel {
    pub async fn start(cluster: &TestCluster, purpose: &str) -> FakeModel {
        Self::start_requiring(cluster, purpose, None).await
    }

    /// The fake model answering only requests that carry `key` (`Authorization: Bearer KEY`),
    /// when given one.
    pub async fn start_requiring(cluster: &TestCluster, purpose: &str, key: Option<&str>) -> FakeModel {
        let name = unique_name(purpose);
        let script = include_str!("../fixtures/fake_model.py");
        let mut argv = vec!["python3", "-c", script];
        argv.extend(key);
        let mut pod = restricted_pod(&name, AGENT_IMAGE, &argv);
        let container = &mut pod.spec.as_mut().expect("spec").containers[0];
        container.readiness_probe = Some(Probe {
            tcp_socket: Some(TCPSocketAction {
                port: IntOrString::Int(8000),
                host: None,
            }),
            period_seconds: Some(1),
            ..Probe::default()
        });
        let namespace = cluster.fresh_namespace("fake-model").await;
        let pods: Api<Pod> = Api::namespaced(cluster.admin(), namespace.name());
        pods.create(&PostParams::default(), &pod)
            .await
            .expect("create the fake model's Pod");
        let ip = wait_until(
            "the fake model's Pod to be ready",
            Duration::from_secs(90),
            || async {
                let pod = pods.get(&name).await.ok()?;
                let status = pod.status?;
                let ready = status
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                ready.then_some(status.pod_ip?)
            },
        )
        .await;
        FakeModel {
            ip,
            _namespace: namespace,
        }
    }

    /// The model's base URL as an agent is given it.
    pub fn base_url(&self) -> String {
        format!("http://{}:8000/v1", self.ip)
    }

    /// `GET /stats` from this host (which may open connections into Pods): requests served and
    /// streams open.
    pub async fn stats(&self) -> (u64, u64) {
        let stats = self.all_stats().await;
        (
            stats["served"].as_u64().unwrap_or_default(),
            stats["streaming"].as_u64().unwrap_or_default(),
        )
    }

    /// Model requests refused for want of the required key.
    pub async fn refused(&self) -> u64 {
        self.all_stats().await["refused"].as_u64().unwrap_or_default()
    }

    async fn all_stats(&self) -> Value {
        let body = super::http_get(&self.ip, 8000, "/stats").await;
        serde_json::from_str(&body).expect("stats are JSON")
    }
}

/// codex-acp pointed at the Responses API at `base_url`, with its key from `OPENAI_API_KEY`, as
/// "Run your agent" configures it.
pub fn codex(base_url: &str) -> Vec<String> {
    let provider = format!(
        "model_providers.fake={{name=\"fake\",base_url=\"{base_url}\",wire_api=\"responses\",env_key=\"OPENAI_API_KEY\"}}"
    );
    [
        "/usr/local/bin/codex-acp",
        "-c",
        "model_provider=\"fake\"",
        "-c",
        &provider,
        "-c",
        "model=\"gpt-fake\"",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The session's running worker Pod.
pub async fn worker_pod(cluster: &TestCluster, id: &SessionId) -> String {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let listed = pods
        .list(&ListParams::default().labels(&format!("openab.dev/session={id}")))
        .await
        .expect("list the session's Pods");
    listed
        .into_iter()
        .find(|pod| pod.metadata.deletion_timestamp.is_none())
        .and_then(|pod| pod.metadata.name)
        .expect("the session has a worker Pod")
}

/// Runs `script` with `/bin/sh -c` in the session's worker (the agent's container) and returns
/// its standard output.
pub async fn shell(cluster: &TestCluster, id: &SessionId, script: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = worker_pod(cluster, id).await;
    let output = exec(&pods, &name, &["/bin/sh", "-c", script]).await;
    assert!(output.success, "{script}: {}", output.stderr);
    output.stdout
}

/// `initialize`, `session/new` in the attachment's working directory, and one prompt turn, whose
/// text it returns after checking that it ended normally with the model's answer.
pub async fn one_turn(client: &AcpClient, prompt: &str) -> String {
    client.initialize().await.expect("initialize");
    let session = client
        .new_session(client.working_dir())
        .await
        .expect("session/new");
    let outcome = client.prompt(&session, prompt).await.expect("session/prompt");
    let text = outcome.chunks.concat();
    assert_eq!(outcome.stop_reason, "end_turn", "{text}");
    assert!(text.contains(ANSWER), "the turn's answer: {text:?}");
    text
}
