//! A broker that restarts (or a second replica with the same key) takes the running worker over
//! instead of replacing it: same generation, same Pod, the turn in flight continues, and the
//! output the old broker never read is replayed to the new one.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test restart -- --ignored`.

mod common;

use std::time::Duration;

use common::{builder, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime};
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::{Api, ResourceExt};
use test_cluster::{unique_name, TestCluster};
use tokio::io::AsyncBufReadExt;
use worker_relay::BrokerKey;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_restarted_broker_takes_the_worker_over_and_the_turn_in_flight_continues() {
    let installation = unique_name("restart");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let key = || BrokerKey::new(vec![42; 32]);
    let before = builder(&cluster, &profile, Reach::PodIp, &installation)
        .broker_key(key())
        .epoch(1_000)
        .build()
        .expect("the broker before its restart");
    let identity = SessionIdentity::new(&installation, "agent", "test", "restart").expect("identity");
    let id = identity.id();
    before
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let client = AcpClient::new(before.attach(&id).await.expect("attach"));
    client.initialize().await.expect("initialize");
    let session = client
        .new_session(client.working_dir())
        .await
        .expect("session/new");
    // A turn of 40 chunks, 100 ms apart: it runs on while no broker is connected. Written
    // straight to the agent's stdin, so nothing here waits for its answer.
    let prompt = serde_json::json!({
        "jsonrpc": "2.0",
        "id": 999,
        "method": "session/prompt",
        "params": {
            "sessionId": session,
            "prompt": [{ "type": "text", "text": "/chunks=40 /delay_ms=100 keep going" }],
        },
    });
    client
        .input()
        .write_line(&prompt.to_string())
        .await
        .expect("send the prompt");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let generation = before.status(&id).await.expect("status").generation;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let worker = pods.get(&format!("oab-w-{id}")).await.expect("the worker").uid();
    // The broker goes away mid-turn, without suspending.
    drop(client);
    drop(before);

    let after = builder(&cluster, &profile, Reach::PodIp, &installation)
        .broker_key(key())
        .epoch(2_000)
        .build()
        .expect("the broker after its restart");
    let mut attachment = after.attach(&id).await.expect("attach after the restart");
    assert_eq!(
        after.status(&id).await.expect("status").generation,
        generation,
        "the same generation"
    );
    let now = pods.get(&format!("oab-w-{id}")).await.expect("the worker").uid();
    assert_eq!(now, worker, "the same worker Pod");
    // The rest of the turn arrives here, ending with the prompt's response.
    let mut lines = tokio::io::BufReader::new(attachment.output()).lines();
    let mut chunks = 0;
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await.expect("read the agent's output") {
            if line.contains("agent_message_chunk") {
                chunks += 1;
            }
            if line.contains("stopReason") {
                return line;
            }
        }
        panic!("the output ended before the turn did");
    })
    .await
    .expect("the turn in flight ends on the new broker's stream");
    assert!(ended.contains("end_turn"), "{ended}");
    assert!(chunks > 0, "the new broker got the turn's later chunks");
    drop(lines);
    after.close(&id, CloseReason::Reset).await.expect("close");
}
