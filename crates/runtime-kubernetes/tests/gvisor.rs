//! The gVisor tier on the real node: a worker whose profile says `runtime_class = "gvisor"` runs
//! on gVisor's kernel (runsc, systrap platform), not the node's, and keeps its workspace on its
//! claim across a suspend and resume. The conformance and isolation suites under gVisor are in
//! `conformance.rs` and `isolation.rs`; a RuntimeClass the node has no handler for, in
//! `start_failures.rs`.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test gvisor -- --ignored`.

mod common;

use common::{runtime, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, SessionIdentity, SessionRuntime, SuspendReason};
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::Api;
use test_cluster::{unique_name, TestCluster};

/// The kernel the agent runs on (`/proc/version`) and the worker Pod's RuntimeClass.
async fn kernel(cluster: &TestCluster, client: &AcpClient, id: &str) -> (String, Option<String>) {
    let version = client.exec("cat /proc/version").await.expect("exec");
    assert!(version.success(), "{version:?}");
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let pod = pods.get(&format!("oab-w-{id}")).await.expect("the worker's Pod");
    let class = pod.spec.and_then(|spec| spec.runtime_class_name);
    (version.stdout.trim().to_owned(), class)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_gvisor_worker_runs_on_gvisors_kernel_and_keeps_its_workspace_across_a_suspend() {
    let node = std::fs::read_to_string("/proc/version").expect("the node's /proc/version");
    let node = node.trim();
    let installation = unique_name("gvisor-kernel");
    let cluster = TestCluster::connect().await;
    let gvisor = AdminObject::profile(
        &cluster,
        &format!("{installation}-gvisor"),
        &format!("runtime_class = \"gvisor\"\n{WORKER_PROFILE}"),
    )
    .await;
    let runc = AdminObject::profile(&cluster, &format!("{installation}-runc"), WORKER_PROFILE).await;

    // The control: a worker of the same profile without the class runs on the node's kernel.
    let plain = runtime(&cluster, &runc, Reach::PodIp, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "test", "runc").expect("identity");
    let id = identity.id();
    plain
        .create(&identity, &Default::default())
        .await
        .expect("create");
    let client = AcpClient::new(plain.attach(&id).await.expect("attach"));
    client.initialize().await.expect("initialize");
    assert_eq!(
        kernel(&cluster, &client, id.as_str()).await,
        (node.to_owned(), None)
    );
    drop(client);
    plain.close(&id, CloseReason::Ended).await.expect("close");

    let sandboxed = runtime(&cluster, &gvisor, Reach::PodIp, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "test", "gvisor").expect("identity");
    let id = identity.id();
    sandboxed
        .create(&identity, &Default::default())
        .await
        .expect("create");
    let client = AcpClient::new(sandboxed.attach(&id).await.expect("attach"));
    client.initialize().await.expect("initialize");
    let (version, class) = kernel(&cluster, &client, id.as_str()).await;
    assert_eq!(class.as_deref(), Some("gvisor"));
    assert_ne!(version, node, "the worker sees the node's kernel");
    assert!(version.contains("gvisor"), "{version}");
    // gVisor's own kernel log, which no process of the node's kernel would print.
    let log = client.exec("dmesg | head -1").await.expect("exec");
    assert!(log.stdout.contains("Starting gVisor"), "{log:?}");
    let wrote = client
        .exec("echo kept > kept.txt && git init -q . && echo done")
        .await
        .expect("exec");
    assert_eq!(wrote.stdout, "done\n", "{wrote:?}");
    drop(client);
    sandboxed
        .suspend(&id, SuspendReason::Idle)
        .await
        .expect("suspend");

    let client = AcpClient::new(sandboxed.attach(&id).await.expect("resume"));
    client.initialize().await.expect("initialize");
    let (resumed, class) = kernel(&cluster, &client, id.as_str()).await;
    assert_eq!(
        (resumed.as_str(), class.as_deref()),
        (version.as_str(), Some("gvisor"))
    );
    let found = client
        .exec("cat kept.txt && git status --porcelain --untracked-files=no && echo clean")
        .await
        .expect("exec");
    assert_eq!(found.stdout, "kept\nclean\n", "{found:?}");
    drop(client);
    sandboxed.close(&id, CloseReason::Ended).await.expect("close");
}
