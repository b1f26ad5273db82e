//! What the local runtime records through the `metrics` facade (`session_runtime::telemetry`),
//! read back from a Prometheus recorder installed for this test binary alone: each attach by how
//! it started, and an agent that cannot start by its cause.

mod common;

use session_runtime::config::SandboxMode;
use session_runtime::{
    AgentCommand, CloseReason, CreateOptions, SessionIdentity, SessionRuntime, SuspendReason,
};

/// The value of `series` (a metric name with its labels) in `text`, if present.
fn value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attaches_are_recorded_by_how_they_started_and_failures_by_cause() {
    let metrics = ops_http::install().expect("the only recorder of this test binary");
    let dir = tempfile::tempdir().expect("temp dir");
    let runtime = common::builder(dir.path(), "metrics", SandboxMode::None)
        .build()
        .expect("a plain runtime");
    let identity = SessionIdentity::new("metrics", "agent", "test", "one").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    drop(runtime.attach(&id).await.expect("attach"));
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    drop(runtime.attach(&id).await.expect("resume"));
    runtime.close(&id, CloseReason::Reset).await.expect("close");

    let missing = dir.path().join("no-such-agent");
    let broken = runtime_local::LocalRuntime::builder(AgentCommand::new(missing.display().to_string()))
        .root(dir.path())
        .installation("metrics")
        .sandbox(SandboxMode::None)
        .build()
        .expect("a runtime whose agent is missing");
    let failing = SessionIdentity::new("metrics", "agent", "test", "two").expect("identity");
    broken
        .create(&failing, &CreateOptions::new())
        .await
        .expect("create");
    let error = broken.attach(&failing.id()).await.expect_err("no agent to start");
    broken
        .close(&failing.id(), CloseReason::Reset)
        .await
        .expect("close");

    let text = metrics.render();
    for (start, count) in [("new", 1.0), ("resume", 1.0)] {
        let series = format!("openab_attach_first_byte_seconds_count{{backend=\"local\",start=\"{start}\"}}");
        assert_eq!(value(&text, &series), Some(count), "{series} in\n{text}");
    }
    let series = format!(
        "openab_start_failures_total{{backend=\"local\",cause=\"{}\"}}",
        error.cause_label()
    );
    assert_eq!(value(&text, &series), Some(1.0), "{series} in\n{text}");
}
