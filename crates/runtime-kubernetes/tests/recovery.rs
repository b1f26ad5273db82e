//! A worker Pod that is killed under a live attachment: the attachment ends at once with the
//! Pod's loss as its cause (the broker's watch of its worker Pods says so; the relay client's
//! reconnect budget here is ten minutes), and the next attach replaces the worker with a new
//! generation on the same volume.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test recovery -- --ignored`.

mod common;

use std::time::Duration;

use common::{builder, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::testing::{AcpClient, ClientError};
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime, WorkerFailure};
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::api::DeleteParams;
use test_cluster::kube::Api;
use test_cluster::{unique_name, TestCluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_killed_worker_fails_its_attachment_and_the_next_attach_replaces_it_on_the_same_volume() {
    let installation = unique_name("recovery");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let runtime = builder(&cluster, &profile, Reach::PodIp, &installation)
        .relay_reconnect_budget(Duration::from_secs(600))
        .build()
        .expect("runtime");
    let identity = SessionIdentity::new(&installation, "agent", "test", "killed").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
    client.initialize().await.expect("initialize");
    let wrote = client.exec("echo kept > killed-marker").await.expect("exec");
    assert!(wrote.success(), "{wrote:?}");
    let first = runtime.status(&id).await.expect("status").generation;

    // The relay is frozen first, so it cannot report the agent's end when the kubelet stops the
    // container: only the broker's watch of its worker Pods can end the attachment in time.
    let relays = relay_processes(id.as_str());
    assert!(
        !relays.is_empty(),
        "the worker's relay runs on this machine's node"
    );
    for pid in &relays {
        let status = std::process::Command::new("kill")
            .args(["-STOP", &pid.to_string()])
            .status()
            .expect("kill -STOP");
        assert!(status.success(), "froze relay {pid}");
    }
    // The node loses the Pod at once, as a force delete or a vanished node does.
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    pods.delete(
        &format!("oab-w-{id}"),
        &DeleteParams {
            grace_period_seconds: Some(0),
            ..DeleteParams::default()
        },
    )
    .await
    .expect("kill the worker");
    let ended = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Err(error) = client.exec("true").await {
                return error;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the attachment of a killed worker ends long before the reconnect budget");
    eprintln!("the old attachment ended with: {ended}");
    // The ACP client reports a read that failed as the output's end, with the runtime's words.
    let loss = Error::WorkerFailed {
        id,
        cause: WorkerFailure::Evicted(format!(
            "the worker Pod oab-w-{id} was deleted under the live attachment; the next attach starts a new one"
        )),
    };
    match &ended {
        ClientError::Runtime(error) => assert_eq!(error.to_string(), loss.to_string()),
        ClientError::Closed(words) => assert_eq!(words, &loss.to_string()),
        other => panic!("the attachment must end with the Pod's loss, got {other:?}"),
    }
    drop(client);

    let client = AcpClient::new(runtime.attach(&id).await.expect("attach replaces the worker"));
    client.initialize().await.expect("initialize");
    let status = runtime.status(&id).await.expect("status");
    assert!(
        status.generation > first,
        "a new generation: {} after {first}",
        status.generation
    );
    let read = client.exec("cat killed-marker").await.expect("exec");
    assert_eq!(read.stdout, "kept\n", "the same volume: {read:?}");
    drop(client);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
}

/// The pids of the relay processes (on the test cluster's real node, which is this machine) that
/// serve `session`: those whose environment names it.
fn relay_processes(session: &str) -> Vec<u32> {
    let wanted = format!("OAB_RELAY_SESSION={session}");
    std::fs::read_dir("/proc")
        .expect("read /proc")
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            comm.trim() == "oab-relay"
                && environ
                    .split(|byte| *byte == 0)
                    .any(|var| var == wanted.as_bytes())
        })
        .collect()
}
