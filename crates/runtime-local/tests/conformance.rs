//! The conformance suite against the local runtime, in plain mode and in every sandbox this
//! machine supports.

use std::sync::Arc;

use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::conformance::{run_all, Target, BEHAVIOURS};
use session_runtime::testing::acp_test_agent_binary;
use session_runtime::AgentCommand;

async fn passes_every_behaviour(sandbox: SandboxMode) {
    let root = tempfile::tempdir().expect("temporary root");
    let agent = AgentCommand::new(
        acp_test_agent_binary()
            .expect("acp-test-agent")
            .display()
            .to_string(),
    );
    let runtime = Arc::new(
        LocalRuntime::builder(agent)
            .root(root.path())
            .installation("conformance")
            .sandbox(sandbox)
            .build()
            .expect("local runtime"),
    );
    let target = Target::new(Arc::<LocalRuntime>::clone(&runtime), "conformance").with_faults(runtime);
    let report = run_all(&target).await;
    assert!(
        report.skipped.is_empty(),
        "nothing may be skipped: {:?}",
        report.skipped
    );
    assert_eq!(report.passed, BEHAVIOURS);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_mode_passes_conformance() {
    passes_every_behaviour(SandboxMode::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bubblewrap_mode_passes_conformance() {
    passes_every_behaviour(SandboxMode::Bubblewrap).await;
}
