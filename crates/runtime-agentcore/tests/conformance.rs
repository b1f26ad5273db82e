//! The contract's conformance suite against the AgentCore emulator: the real SDK's requests and
//! signed WebSockets on loopback, one `oab-relay --agentcore` worker per runtime session.

mod common;

use std::sync::Arc;

use session_runtime::conformance::{run_all, Target, BEHAVIOURS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agentcore_runtime_passes_every_behaviour() {
    let harness = common::start().await;
    let runtime = Arc::clone(&harness.runtime);
    let target = Target::new(Arc::clone(&runtime) as Arc<_>, common::INSTALLATION).with_faults(runtime);
    let report = run_all(&target).await;
    assert!(
        report.skipped.is_empty(),
        "nothing may be skipped: {:?}",
        report.skipped
    );
    assert_eq!(report.passed, BEHAVIOURS, "every behaviour must run, in order");
    harness.emulator.shutdown().await.expect("the emulator stops");
}
