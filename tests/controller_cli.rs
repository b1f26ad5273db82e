//! `oab-runtime controller` against the test cluster, as an operator runs it: it takes the
//! installation's leader Lease with the broker's identity, and gives it up on SIGTERM.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test --features kubernetes
//! --test controller_cli -- --ignored`.

use std::process::{Command, Stdio};
use std::time::Duration;

use test_cluster::k8s_openapi::api::coordination::v1::Lease;
use test_cluster::kube::Api;
use test_cluster::{unique_name, wait_until, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test --features kubernetes -- --ignored"]
async fn the_controller_command_leads_and_gives_the_lease_up_on_sigterm() {
    let cluster = TestCluster::connect().await;
    let installation = unique_name("cli");
    let directory = tempfile::tempdir().expect("a directory");
    let config = directory.path().join("openab.toml");
    std::fs::write(
        &config,
        format!(
            "[session_runtime]\ntype = \"kubernetes\"\ninstallation = \"{installation}\"\n\
             [session_runtime.kubernetes]\nnamespace = \"{}\"\nprofile = \"isolated-worker\"\n",
            cluster.sessions_namespace()
        ),
    )
    .expect("write the configuration");
    let broker_kubeconfig =
        std::env::var("OPENAB_BROKER_KUBECONFIG").expect("scripts/cluster env sets OPENAB_BROKER_KUBECONFIG");
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
