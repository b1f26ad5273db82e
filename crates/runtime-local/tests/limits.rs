//! Per-session resource limits are enforced through cgroups and reported in `status`.

use session_runtime::config::{ResourceLimits, SandboxMode};
use session_runtime::testing::acp_test_agent_binary;
use session_runtime::{AgentCommand, CreateOptions, Error, SessionIdentity, SessionRuntime};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_the_limits_and_usage_of_a_running_worker() {
    let root = tempfile::tempdir().expect("root");
    let mut limits = ResourceLimits::default();
    limits.memory = Some(512 * 1024 * 1024);
    limits.pids = Some(64);
    let agent = AgentCommand::new(acp_test_agent_binary().expect("agent").display().to_string());
    let runtime = runtime_local::LocalRuntime::builder(agent)
        .root(root.path())
        .installation("limits")
        .sandbox(SandboxMode::None)
        .limits(limits)
        .build()
        .expect("runtime");
    let identity = SessionIdentity::new("limits", "agent", "discord", "1").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let attachment = match runtime.attach(&id).await {
        Ok(attachment) => attachment,
        Err(Error::InvalidConfig { key, reason }) => {
            panic!("cgroup limits must work on the CI machines ({key}: {reason})")
        }
        Err(error) => panic!("attach: {error}"),
    };
    let status = runtime.status(&id).await.expect("status");
    let resources = status.resources.expect("a worker under limits reports them");
    assert_eq!(resources.memory_limit, Some(512 * 1024 * 1024));
    assert_eq!(resources.pids_limit, Some(64));
    assert!(
        resources.pids.is_some_and(|pids| pids >= 1),
        "the worker itself counts: {resources:?}"
    );
    // Memory already charged elsewhere is not moved along on cgroup v1, so usage may read 0.
    assert!(resources.memory_bytes.is_some(), "{resources:?}");
    drop(attachment);
    runtime
        .close(&id, session_runtime::CloseReason::Reset)
        .await
        .expect("close");
    assert!(matches!(runtime.status(&id).await, Err(Error::NotFound { .. })));
}
