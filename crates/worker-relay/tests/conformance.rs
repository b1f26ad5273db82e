//! The contract's conformance suite with the relay in the path: every worker is an
//! `oab-relay serve -- acp-test-agent` process reached over loopback TCP through `RelayClient`.

mod common;

use std::sync::Arc;

use common::runtime::relay_runtime;
use session_runtime::conformance::{run_all, Target, BEHAVIOURS};
use session_runtime::testing::FakeRuntime;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_runtime_passes_every_behaviour() {
    common::init_tracing();
    let runtime = Arc::new(relay_runtime("relay-conformance"));
    let target =
        Target::new(Arc::<FakeRuntime>::clone(&runtime), runtime.installation()).with_faults(runtime);
    let report = run_all(&target).await;
    assert!(
        report.skipped.is_empty(),
        "nothing may be skipped: {:?}",
        report.skipped
    );
    assert_eq!(report.passed, BEHAVIOURS, "every behaviour must run, in order");
}
