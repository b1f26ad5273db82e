//! The conformance suite against `FakeRuntime`, the reference implementation.

use std::sync::Arc;
use std::time::Duration;

use session_runtime::conformance::{self, run_all, Target, Verdict, BEHAVIOURS};
use session_runtime::testing::FakeRuntime;
use session_runtime::{Retention, RetentionPolicy};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_runtime_passes_every_behaviour() {
    let runtime = Arc::new(FakeRuntime::builder().build().expect("fake runtime"));
    let target =
        Target::new(Arc::<FakeRuntime>::clone(&runtime), runtime.installation()).with_faults(runtime);
    let report = run_all(&target).await;
    assert!(
        report.skipped.is_empty(),
        "nothing may be skipped against the fake: {:?}",
        report.skipped
    );
    assert_eq!(report.passed, BEHAVIOURS, "every behaviour must run, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fake_runtime_retains_storage_when_configured() {
    let mut retention = RetentionPolicy::default();
    retention.ended = Retention::Retain;
    retention.retain_for = Some(Duration::from_secs(3600));
    let runtime = Arc::new(
        FakeRuntime::builder()
            .retention(retention.clone())
            .build()
            .expect("fake runtime"),
    );
    let target =
        Target::new(Arc::<FakeRuntime>::clone(&runtime), runtime.installation()).with_retention(retention);
    assert_eq!(
        conformance::close_applies_retention_by_reason(&target).await,
        Verdict::Passed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behaviours_needing_faults_say_they_were_skipped() {
    let runtime = Arc::new(FakeRuntime::builder().build().expect("fake runtime"));
    let target = Target::new(Arc::<FakeRuntime>::clone(&runtime), runtime.installation());
    match conformance::reconcile_reclaims_stray_worker(&target).await {
        Verdict::Skipped(why) => assert!(why.contains("FaultInjector"), "{why}"),
        other => panic!("a behaviour that cannot run must say it was skipped, got {other:?}"),
    }
}
