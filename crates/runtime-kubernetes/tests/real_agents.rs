//! Real ACP agents in worker Pods of `deploy/worker/Dockerfile`'s image, which the test cluster
//! builds without Docker (`e2e/images/build agent-worker`): `@zed-industries/codex-acp` from npm
//! and an agent on the Python ACP SDK from PyPI (`tests/fixtures/real-agents/python-agent.py`), each
//! configured only through its profile as `docs/kubernetes.md` "Run your agent" says, completing
//! turns against a fake OpenAI-compatible model (`fixtures/fake_model.py`) in a Pod on the bridge,
//! reached through the profile's `egress` entry, with its API key from a Secret. Their own state in
//! HOME and a file in the workspace survive suspend and resume and are gone after a reset; a cancel
//! ends a streamed turn; an agent that cannot start says why in its own words; and the image's
//! layout is the Dockerfile's.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test real_agents -- --ignored`.

mod common;

use std::time::Duration;

use common::agents::{codex, one_turn, shell, FakeModel, AGENT_IMAGE};
use common::{runtime, AdminObject, DeleteOnDrop};
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{
    CloseReason, CreateOptions, SessionIdentity, SessionRuntime, SuspendReason, WorkerExit,
};
use test_cluster::k8s_openapi::api::core::v1::Secret;
use test_cluster::kube::api::{ObjectMeta, PostParams};
use test_cluster::kube::Api;
use test_cluster::{wait_until, TestCluster};

/// The Secret keys the admission policy of the test cluster lets workers read
/// (`e2e/manifests/test-values.yaml`), one per test so that tests running at once never share one.
const MODEL_KEY_SECRETS: [&str; 3] = [
    "oab-test-model-codex",
    "oab-test-model-python",
    "oab-test-model-crash",
];

/// Secret `name` with the model's API key under `api_key`, deleted when dropped.
async fn model_key(cluster: &TestCluster, name: &str) -> DeleteOnDrop {
    let secrets: Api<Secret> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let _ = secrets.delete(name, &Default::default()).await;
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        string_data: Some([("api_key".to_owned(), "sk-test".to_owned())].into()),
        ..Secret::default()
    };
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("create the model key's Secret");
    DeleteOnDrop::new::<Secret>(cluster, cluster.sessions_namespace(), name)
}

/// A worker profile for `AGENT_IMAGE` running `agent`, reaching `model` only, with the model key
/// from Secret `key`.
fn agent_profile(agent: &[String], model: &FakeModel, key: &str) -> String {
    format!(
        r#"
image = "{AGENT_IMAGE}"
image_pull_policy = "Never"
agent = {agent:?}
termination_grace = "2s"
egress = ["{ip}/32"]

[resources]
memory_limit = "512Mi"

[storage]
kind = "per-session"
class = "openab-test-local"
size = "1Gi"

[[env]]
name = "OPENAI_API_KEY"
secret = "{key}"
key = "api_key"
"#,
        ip = model.ip,
    )
}

/// A session of `installation` under a profile running `agent`, made fresh: what a failed earlier
/// run left of it is closed first. Returns the runtime, the identity and the profile's guard.
async fn fresh_session(
    cluster: &TestCluster,
    installation: &str,
    agent: &[String],
    model: &FakeModel,
    key: &str,
    reach: Reach,
) -> (
    std::sync::Arc<runtime_kubernetes::KubernetesRuntime>,
    SessionIdentity,
    AdminObject,
) {
    let profile = AdminObject::profile(cluster, installation, &agent_profile(agent, model, key)).await;
    let runtime = runtime(cluster, &profile, reach, installation);
    let identity = SessionIdentity::new(installation, "agent", "test", installation).expect("identity");
    let _ = runtime.close(&identity.id(), CloseReason::Reset).await;
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    (runtime, identity, profile)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn codex_acp_completes_turns_in_a_pod_keeps_its_state_across_resume_and_cancels() {
    let installation = "real-codex";
    let cluster = TestCluster::connect().await;
    let model = FakeModel::start(&cluster, "model-codex").await;
    let _key = model_key(&cluster, MODEL_KEY_SECRETS[0]).await;
    let (runtime, identity, _profile) = fresh_session(
        &cluster,
        installation,
        &codex(&model.base_url()),
        &model,
        MODEL_KEY_SECRETS[0],
        Reach::Exec,
    )
    .await;
    let id = identity.id();

    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
    let (served_before, _) = model.stats().await;
    one_turn(&client, "ping").await;
    assert!(
        model.stats().await.0 > served_before,
        "codex answered without the model"
    );
    // codex keeps each conversation as a rollout file under its home, ~/.codex.
    let rollouts = "find \"$HOME/.codex\" -name 'rollout-*.jsonl' | sort";
    let kept = shell(&cluster, &id, rollouts).await;
    assert!(kept.contains("rollout-"), "codex's own state in HOME: {kept:?}");

    // A cancel in the middle of a streamed answer ends the turn as cancelled.
    let session = client
        .new_session(client.working_dir())
        .await
        .expect("session/new");
    let turn = client.prompt(&session, "slow: keep streaming");
    let cancel = async {
        wait_until("the model to stream", Duration::from_secs(60), || async {
            (model.stats().await.1 > 0).then_some(())
        })
        .await;
        client.cancel(&session).await.expect("session/cancel");
    };
    let (outcome, ()) = tokio::join!(turn, cancel);
    assert_eq!(outcome.expect("the turn ends").stop_reason, "cancelled");
    drop(client);

    // Resume on the same volume: codex's state is still there, and it answers again.
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    let client = AcpClient::new(runtime.attach(&id).await.expect("attach after suspend"));
    let after = shell(&cluster, &id, rollouts).await;
    for rollout in kept.lines() {
        assert!(after.contains(rollout), "{rollout} lost across resume: {after:?}");
    }
    one_turn(&client, "ping again").await;
    drop(client);

    // After a reset the identity starts from nothing.
    runtime.close(&id, CloseReason::Reset).await.expect("close");
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create again");
    let _client = AcpClient::new(runtime.attach(&id).await.expect("attach the new session"));
    let fresh = shell(&cluster, &id, rollouts).await;
    assert_eq!(fresh, "", "a reset session starts without codex's conversations");
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}

/// The `[turn N cwd=C home=H]` the Python agent appends to each answer.
fn reported(text: &str) -> (u64, String, String) {
    let tail = text
        .rsplit_once("[turn ")
        .map(|(_, tail)| tail.trim_end_matches(']'))
        .unwrap_or_else(|| panic!("no report in {text:?}"));
    let mut words = tail.split(' ');
    let turn = words.next().and_then(|n| n.parse().ok()).expect("a turn count");
    let mut field = |prefix: &str| {
        words
            .next()
            .and_then(|word| word.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix} in {text:?}"))
            .to_owned()
    };
    (turn, field("cwd="), field("home="))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_python_sdk_agent_runs_in_the_workspace_with_its_home_and_both_outlive_a_suspend() {
    let installation = "real-python";
    let cluster = TestCluster::connect().await;
    let model = FakeModel::start(&cluster, "model-python").await;
    let _key = model_key(&cluster, MODEL_KEY_SECRETS[1]).await;
    let agent = ["python3", "/usr/local/lib/agent/agent.py", &model.base_url()].map(str::to_owned);
    let (runtime, identity, _profile) = fresh_session(
        &cluster,
        installation,
        &agent,
        &model,
        MODEL_KEY_SECRETS[1],
        Reach::PodIp,
    )
    .await;
    let id = identity.id();

    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
    let (turn, cwd, home) = reported(&one_turn(&client, "first").await);
    assert_eq!(turn, 1);
    assert_eq!(
        cwd,
        client.working_dir(),
        "the agent runs in the session's workspace"
    );
    assert_eq!(home, "/home/agent", "the agent's HOME is the profile's home_path");
    drop(client);

    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    let client = AcpClient::new(runtime.attach(&id).await.expect("attach after suspend"));
    let (turn, ..) = reported(&one_turn(&client, "second").await);
    assert_eq!(turn, 2, "the agent's history in HOME survives a suspend");
    let notes = shell(&cluster, &id, &format!("cat {cwd}/notes.txt")).await;
    assert_eq!(
        notes, "first\nsecond\n",
        "the file the agent wrote in its workspace"
    );
    drop(client);

    runtime.close(&id, CloseReason::Reset).await.expect("close");
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create again");
    let client = AcpClient::new(runtime.attach(&id).await.expect("attach the new session"));
    let (turn, ..) = reported(&one_turn(&client, "after reset").await);
    assert_eq!(turn, 1, "a reset session has no history");
    drop(client);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn an_agent_that_cannot_start_says_why_in_its_own_words() {
    let installation = "real-crash";
    let cluster = TestCluster::connect().await;
    let model = FakeModel::start(&cluster, "model-crash").await;
    let _key = model_key(&cluster, MODEL_KEY_SECRETS[2]).await;
    let mut agent = codex(&model.base_url());
    agent.push("--no-such-flag".to_owned());
    let (runtime, identity, _profile) = fresh_session(
        &cluster,
        installation,
        &agent,
        &model,
        MODEL_KEY_SECRETS[2],
        Reach::Exec,
    )
    .await;
    let id = identity.id();
    // The relay starts the agent at the broker's first hello, so the attach succeeds and the
    // agent's exit ends the attachment at its first request, not after a timeout.
    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
    let refused = client.initialize().await;
    assert!(refused.is_err(), "{refused:?}");
    let control = client.control();
    let exit = tokio::time::timeout(Duration::from_secs(30), control.wait())
        .await
        .expect("the exit arrives without a timeout")
        .expect("the exit");
    assert_eq!(exit, WorkerExit::Code(2), "clap's usage error");
    let said = control
        .stderr_tail()
        .expect("the agent's last words came with its exit");
    assert!(said.contains("--no-such-flag"), "{said}");
    drop(client);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}
