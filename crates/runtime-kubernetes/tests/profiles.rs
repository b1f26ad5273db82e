//! Worker profiles as the API server holds them (`OabProfile`, the chart's
//! `crds/oabprofiles.yaml`): every example in the deploy files is accepted by the API server and
//! is a valid profile for the runtime; a bad profile is refused at `kubectl apply`, naming the
//! field; and the broker can only read profiles.

mod common;

use std::process::Command;

use common::manifest_object;
use runtime_kubernetes::profile::WorkerProfile;
use test_cluster::kube::api::{DeleteParams, DynamicObject, PostParams};
use test_cluster::kube::Api;
use test_cluster::{unique_name, TestCluster};

/// The example's object as the API server accepted it, read by the runtime.
fn example(path: &str) -> WorkerProfile {
    let object: DynamicObject = serde_json::from_value(manifest_object(path)).expect("an object");
    WorkerProfile::from_resource(&object).unwrap_or_else(|error| panic!("{path}: {error}"))
}

#[test]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
fn every_example_profile_is_accepted_by_the_api_server_and_valid() {
    let isolated = example("deploy/kubernetes/profile-example.yaml");
    assert_eq!(isolated.name(), "isolated-worker");
    assert_eq!(isolated.image, "openab.dev/worker:test");
    assert_eq!(isolated.agent, ["/usr/local/bin/acp-test-agent"]);
    assert_eq!(isolated.idle_ttl, Some(std::time::Duration::from_secs(30 * 60)));
    assert!(isolated.resources.memory_limit.is_some() && isolated.resources.cpu_limit.is_some());

    for (path, agent, key) in [
        (
            "deploy/kubernetes/agents/claude-code.yaml",
            "claude-code-acp",
            "ANTHROPIC_API_KEY",
        ),
        (
            "deploy/kubernetes/agents/python-sdk.yaml",
            "agent.py",
            "OPENAI_API_KEY",
        ),
    ] {
        let profile = example(path);
        assert!(profile.agent.iter().any(|arg| arg.ends_with(agent)), "{agent}");
        assert!(profile.image.contains("@sha256:"), "{agent}: pinned by digest");
        assert_eq!(profile.home_path, "/home/agent", "{agent}: HOME on the volume");
        assert!(profile.env.iter().any(|env| env.name == key), "{agent}: {key}");
        assert!(!profile.egress.is_empty(), "{agent}: an egress entry");
    }
    // codex's goes through the gateway, whose model route holds the key: the worker gets
    // neither the Secret nor a way past the gateway.
    let codex = example("deploy/kubernetes/agents/codex.yaml");
    assert!(codex.image.contains("@sha256:"), "codex-acp: pinned by digest");
    assert!(codex.env.is_empty() && codex.egress.is_empty(), "{codex:?}");
    let gateway = codex.egress_gateway.as_ref().expect("a gateway").authority();
    let [route] = codex.model_routes.as_slice() else {
        panic!("one model route: {:?}", codex.model_routes)
    };
    assert_eq!(route.key_env.as_deref(), Some("OPENAI_API_KEY"));
    assert!(
        codex
            .agent
            .iter()
            .any(|arg| arg.contains(&format!("base_url=\"{}\"", route.base_url(&gateway)))),
        "codex-acp's base URL is the route's: {:?}",
        codex.agent
    );
}

/// `kubectl apply --dry-run=server` of an OabProfile whose spec is `spec` (YAML flow); its
/// error output when refused.
fn refusal(spec: &str) -> Option<String> {
    let manifest = format!(
        "apiVersion: openab.dev/v1alpha1\nkind: OabProfile\nmetadata: {{name: {}, namespace: openab-sessions}}\nspec: {spec}\n",
        unique_name("refused")
    );
    let mut child = Command::new("kubectl")
        .args(["apply", "--dry-run=server", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kubectl (scripts/cluster env puts it on PATH)");
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(manifest.as_bytes())
        .expect("write the manifest");
    let output = child.wait_with_output().expect("kubectl");
    (!output.status.success()).then(|| String::from_utf8_lossy(&output.stderr).into_owned())
}

#[test]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
fn a_bad_profile_is_refused_at_apply_naming_the_field() {
    const BASE: &str = "image: openab.dev/worker:test, agent: [a]";
    // The positive control: the same document without the mistake is accepted.
    assert_eq!(
        refusal(&format!(
            "{{{BASE}, storage: {{kind: per-session, size: 1Gi}}, resources: {{memory_request: 1Gi, memory_limit: 2Gi}}}}"
        )),
        None
    );
    for (spec, field) in [
        ("storage: {kind: per-session, size: 1Gb}", "spec.storage.size"),
        ("storage_class: fast", "spec.storage_class"),
        ("image_pull_policy: Sometimes", "spec.image_pull_policy"),
        (
            "resources: {memory_request: 2Gi, memory_limit: 1Gi}",
            "spec.resources.memory_request",
        ),
        ("storage: {kind: borrowed, size: 1Gi}", "spec.storage"),
        ("egress: [10.0.0.0/33]", "spec.egress[0]"),
        (
            "env: [{name: OAB_RELAY_X, secret: s, key: k}]",
            "spec.env[0].name",
        ),
        ("relay_port: 0", "spec.relay_port"),
        (
            "skills: [{name: s, mount_path: /s, config_map: a, claim: b}]",
            "spec.skills[0]",
        ),
    ] {
        let refused =
            refusal(&format!("{{{BASE}, {spec}}}")).unwrap_or_else(|| panic!("{spec} was accepted"));
        assert!(refused.contains(field), "{spec}: {refused}");
    }
    let refused = refusal("{image: x}").expect("a profile without agent was accepted");
    assert!(refused.contains("spec.agent"), "{refused}");
}

#[tokio::test]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn the_broker_reads_profiles_and_cannot_write_them() {
    let cluster = TestCluster::connect().await;
    let name = unique_name("profile");
    let object =
        WorkerProfile::resource_from_toml(&name, "image = \"openab.dev/worker:test\"\nagent = [\"a\"]\n")
            .expect("TOML");
    let resource = WorkerProfile::resource();
    let as_admin: Api<DynamicObject> =
        Api::namespaced_with(cluster.admin(), cluster.sessions_namespace(), &resource);
    let as_broker: Api<DynamicObject> =
        Api::namespaced_with(cluster.broker(), cluster.sessions_namespace(), &resource);
    let forbidden = |result: Result<DynamicObject, test_cluster::kube::Error>, what: &str| match result {
        Err(test_cluster::kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("the broker's {what}: {other:?}"),
    };
    forbidden(as_broker.create(&PostParams::default(), &object).await, "create");
    as_admin
        .create(&PostParams::default(), &object)
        .await
        .expect("the administrator creates it");
    let read = as_broker.get(&name).await.expect("the broker reads it");
    assert!(WorkerProfile::from_resource(&read).is_ok());
    forbidden(
        as_broker.replace(&name, &PostParams::default(), &read).await,
        "replace",
    );
    match as_broker.delete(&name, &DeleteParams::default()).await {
        Err(test_cluster::kube::Error::Api(status)) if status.code == 403 => {}
        other => panic!("the broker's delete: {other:?}"),
    }
    as_admin
        .delete(&name, &DeleteParams::default())
        .await
        .expect("the administrator deletes it");
}
