//! The AgentCore runtime's figures against the offline emulator
//! (`cargo bench -p runtime-agentcore --bench agentcore`), each next to a baseline measured in the
//! same run:
//!
//! 1. Cancel during a streaming turn: from writing `session/cancel` to the agent's answer to the
//!    prompt (`stopReason: cancelled`), through the emulator (signed WebSocket, proxy, relay),
//!    against the same agent under the local runtime in plain mode (stdio pipes). Median of 20
//!    each. No `StopRuntimeSession` is sent for a cancel: the microVM keeps running.
//! 2. 1,000 lines through `cat` with 50 cut WebSockets, against the same without cuts: the time,
//!    and that no line is lost or duplicated.

use std::sync::Arc;
use std::time::{Duration, Instant};

#[path = "../tests/common/mod.rs"]
mod common;

use agentcore_emulator::{Operation, WorkerCommand};
use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::testing::AcpClient;
use session_runtime::{AgentCommand, CloseReason, CreateOptions, SessionIdentity, SessionRuntime};
use tokio::io::{AsyncBufReadExt, BufReader};

const SAMPLES: usize = 20;
const LINES: usize = 1000;
const CUTS: usize = 50;

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime");
    runtime.block_on(run());
}

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn stops(harness: &common::Harness) -> usize {
    harness
        .emulator
        .requests()
        .iter()
        .filter(|r| r.operation == Some(Operation::Stop))
        .count()
}

/// How long a cancel takes to end a streaming turn, `SAMPLES` times, on sessions of `runtime`.
/// `during` is called around each cancel, e.g. to count stop calls.
async fn cancel_latencies(
    runtime: Arc<dyn SessionRuntime>,
    installation: &str,
    during: impl Fn() -> usize,
) -> (Vec<Duration>, usize) {
    let mut samples = Vec::with_capacity(SAMPLES);
    let mut stopped = 0;
    for i in 0..SAMPLES {
        let identity = SessionIdentity::new(
            installation,
            "agent",
            "bench",
            format!("cancel-{i}-{}", std::process::id()),
        )
        .expect("an identity");
        let id = runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create")
            .id;
        let client = Arc::new(AcpClient::new(runtime.attach(&id).await.expect("attach")));
        client.initialize().await.expect("initialize");
        let session = client
            .new_session(client.working_dir())
            .await
            .expect("session/new");
        let turn = {
            let (client, session) = (Arc::clone(&client), session.clone());
            tokio::spawn(async move { client.prompt(&session, "/chunks=100000 /delay_ms=5 stream").await })
        };
        client.next_chunk(&session).await.expect("the turn streams");
        let before = during();
        let started = Instant::now();
        client.cancel(&session).await.expect("cancel");
        let outcome = turn.await.expect("the turn task").expect("the turn ends");
        samples.push(started.elapsed());
        stopped += during() - before;
        assert_eq!(outcome.stop_reason, "cancelled");
        drop(client);
        runtime.close(&id, CloseReason::Ended).await.expect("close");
    }
    (samples, stopped)
}

async fn lines_through_cat(harness: &common::Harness, name: &str, cuts: usize) -> Duration {
    let identity = common::identity(name);
    let id = harness
        .runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create")
        .id;
    let mut attachment = harness.runtime.attach(&id).await.expect("attach");
    let rsid = harness.runtime_session(&id, 1);
    let base = upgrades(harness);
    let input = attachment.input().clone();
    let started = Instant::now();
    let writer = tokio::spawn(async move {
        for i in 0..LINES {
            input.write_line(format!("line {i}")).await.expect("write");
        }
    });
    let every = LINES / cuts.max(1);
    let mut reader = BufReader::new(attachment.output());
    let mut cut = 0;
    for i in 0..LINES {
        let mut line = String::new();
        reader.read_line(&mut line).await.expect("read");
        assert_eq!(
            line.trim_end(),
            format!("line {i}"),
            "a line lost, duplicated or out of order"
        );
        if cuts > 0 && i % every == every / 2 && cut < cuts {
            // Cut only a connection that is up: wait for the reconnect after the previous cut.
            while upgrades(harness) - base < cut {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            if harness.emulator.drop_websockets(&rsid) {
                cut += 1;
            }
        }
    }
    let took = started.elapsed();
    writer.await.expect("the writer");
    assert_eq!(cut, cuts);
    took
}

fn upgrades(harness: &common::Harness) -> usize {
    harness
        .emulator
        .requests()
        .iter()
        .filter(|r| r.operation == Some(Operation::WebSocket) && r.status == 101)
        .count()
}

async fn run() {
    let harness = common::start().await;
    println!("emulator sandbox: {}", harness.emulator.sandbox());
    let (_, agent) = common::relay_and_agent();
    let root = tempfile::tempdir().expect("a root");
    let local = LocalRuntime::builder(AgentCommand::new(agent.display().to_string()))
        .root(root.path())
        .installation("agentcore-bench-local")
        .sandbox(SandboxMode::None)
        .build()
        .expect("a plain local runtime");

    let (through_agentcore, stopped) = cancel_latencies(
        Arc::clone(&harness.runtime) as Arc<_>,
        common::INSTALLATION,
        || stops(&harness),
    )
    .await;
    let (direct, _) = cancel_latencies(Arc::new(local), "agentcore-bench-local", || 0).await;
    let (agentcore, plain) = (median(through_agentcore), median(direct));
    println!(
        "cancel to the agent's answer: {agentcore:?} through the emulator vs {plain:?} local plain (median of {SAMPLES}) = {:.2}x",
        agentcore.as_secs_f64() / plain.as_secs_f64()
    );
    println!("StopRuntimeSession calls while cancelling: {stopped}");
    assert_eq!(stopped, 0, "a cancel must never stop the microVM");

    let cat = common::start_with(|mut setup| {
        let (relay, _) = common::relay_and_agent();
        setup.worker = WorkerCommand::relay(relay, ["/bin/cat"]);
        setup
    })
    .await;
    let clean = lines_through_cat(&cat, "lines-clean", 0).await;
    let cut = lines_through_cat(&cat, "lines-cut", CUTS).await;
    println!(
        "{LINES} lines through cat: {cut:?} with {CUTS} cut WebSockets vs {clean:?} without = {:.2}x; none lost or duplicated",
        cut.as_secs_f64() / clean.as_secs_f64()
    );
}
