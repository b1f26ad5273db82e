//! `oab-runtime` against the test cluster with `type = "kubernetes"`, as an operator runs it,
//! with the broker's identity: `controller` takes the installation's leader Lease and gives it up
//! on SIGTERM; `verify` proves isolation between two worker Pods and says what it proved.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test --features kubernetes
//! --test kubernetes_cli -- --ignored`.

use std::process::{Command, Stdio};
use std::time::Duration;

use test_cluster::k8s_openapi::api::coordination::v1::Lease;
use test_cluster::k8s_openapi::api::core::v1::ConfigMap;
use test_cluster::kube::api::{DeleteParams, ObjectMeta, PostParams};
use test_cluster::kube::Api;
use test_cluster::{unique_name, wait_until, TestCluster};

/// An OpenAB configuration file for `type = "kubernetes"` with `installation` and `profile`, and
/// `extra` keys of the kubernetes table; the directory holding it goes when dropped.
fn configuration(
    cluster: &TestCluster,
    installation: &str,
    profile: &str,
    extra: &str,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let directory = tempfile::tempdir().expect("a directory");
    let config = directory.path().join("openab.toml");
    std::fs::write(
        &config,
        format!(
            "[session_runtime]\ntype = \"kubernetes\"\ninstallation = \"{installation}\"\n\
             [session_runtime.kubernetes]\nnamespace = \"{}\"\nprofile = \"{profile}\"\n{extra}",
            cluster.sessions_namespace()
        ),
    )
    .expect("write the configuration");
    (directory, config)
}

/// The broker's kubeconfig, which `oab-runtime` gets as its `KUBECONFIG`.
fn broker_kubeconfig() -> String {
    std::env::var("OPENAB_BROKER_KUBECONFIG").expect("scripts/cluster env sets OPENAB_BROKER_KUBECONFIG")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test --features kubernetes -- --ignored"]
async fn the_controller_command_leads_and_gives_the_lease_up_on_sigterm() {
    let cluster = TestCluster::connect().await;
    let installation = unique_name("cli");
    let (_directory, config) = configuration(&cluster, &installation, "isolated-worker", "");
    let broker_kubeconfig = broker_kubeconfig();
    let controller = Command::new(env!("CARGO_BIN_EXE_oab-runtime"))
        .arg("--config")
        .arg(&config)
        .args([
            "controller",
            "--holder",
            "cli-test",
            "--lease-duration",
            "3s",
            "--resync",
            "1s",
        ])
        .env("KUBECONFIG", broker_kubeconfig)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start oab-runtime controller");

    let leases: Api<Lease> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = format!("oab-leader-{installation}");
    let holder = |lease: Option<Lease>| lease.and_then(|l| l.spec?.holder_identity);
    wait_until(
        "the controller to hold the Lease",
        Duration::from_secs(30),
        || async {
            let lease = leases.get_opt(&name).await.expect("read the Lease");
            (holder(lease).as_deref() == Some("cli-test")).then_some(())
        },
    )
    .await;

    let pid = controller.id().to_string();
    let signalled = Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
    assert!(signalled.success());
    let output = tokio::task::spawn_blocking(move || controller.wait_with_output())
        .await
        .expect("join")
        .expect("the controller's exit");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "exit {:?}: {stderr}", output.status);
    assert!(stderr.contains("leading (epoch"), "{stderr}");
    let lease = leases.get_opt(&name).await.expect("read the Lease");
    assert_eq!(holder(lease), None, "SIGTERM gives the Lease up: {stderr}");
    leases
        .delete(&name, &Default::default())
        .await
        .expect("remove the test's Lease");
}

/// The e2e worker image with the ACP test agent (its exec probe is the shell `verify` uses).
const PROFILE: &str = r#"
image = "openab.dev/worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/acp-test-agent"]
termination_grace = "2s"

[storage]
kind = "per-session"
class = "openab-test-local"
size = "1Gi"

[[skills]]
name = "demo"
mount_path = "/skills"
config_map = "SKILLS"
"#;

async fn config_map(cluster: &TestCluster, name: &str, key: &str, value: &str) -> Api<ConfigMap> {
    let maps: Api<ConfigMap> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let map = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some([(key.to_owned(), value.to_owned())].into()),
        ..ConfigMap::default()
    };
    maps.create(&PostParams::default(), &map)
        .await
        .expect("a ConfigMap");
    maps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test --features kubernetes -- --ignored"]
async fn verify_proves_isolation_between_worker_pods_and_says_what_it_proved() {
    let cluster = TestCluster::connect().await;
    let installation = unique_name("verify");
    let skills = format!("{installation}-skills");
    let maps = config_map(&cluster, &skills, "SKILL.md", "# shared\n").await;
    config_map(
        &cluster,
        &installation,
        "profile.toml",
        &PROFILE.replace("SKILLS", &skills),
    )
    .await;
    let (_directory, config) = configuration(&cluster, &installation, &installation, "reach = \"exec\"\n");
    let broker_kubeconfig = broker_kubeconfig();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_oab-runtime"))
            .arg("--config")
            .arg(&config)
            .args(["verify", "--shared-input", "/skills/SKILL.md"])
            .env("KUBECONFIG", broker_kubeconfig)
            .stdin(Stdio::null())
            .output()
    })
    .await
    .expect("join")
    .expect("run oab-runtime verify");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        output.status
    );
    assert!(stdout.contains("Proved: two sessions' worker Pods"), "{stdout}");
    assert!(stdout.contains("Not proved here"), "{stdout}");
    for name in [&skills, &installation] {
        let _ = maps.delete(name, &DeleteParams::default()).await;
    }
}
