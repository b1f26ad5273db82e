//! The conformance suite against the local runtime, in plain mode and in every sandbox: plain
//! and bubblewrap must run here (the test command installs bubblewrap); Landlock runs where the
//! kernel offers it, and elsewhere the builder must refuse it with the documented configuration
//! error (checked, and the skip printed).

mod common;

use std::sync::Arc;

use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::conformance::{self, run_all, Target, Verdict, BEHAVIOURS};
use session_runtime::{Retention, RetentionPolicy};

async fn passes_every_behaviour(sandbox: SandboxMode) {
    let root = tempfile::tempdir().expect("temporary root");
    let builder = common::builder(root.path(), "conformance", sandbox);
    let runtime = if sandbox == SandboxMode::Landlock {
        let Some(runtime) = common::build_if_supported(builder, sandbox) else {
            return;
        };
        runtime
    } else {
        // Plain and bubblewrap must work here: a refusal is a failure, not a skip.
        Arc::new(
            builder
                .build()
                .unwrap_or_else(|e| panic!("building the {sandbox} runtime: {e}")),
        )
    };
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn landlock_mode_passes_conformance() {
    passes_every_behaviour(SandboxMode::Landlock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retained_storage_is_kept_listed_and_left_by_a_new_session() {
    let root = tempfile::tempdir().expect("temporary root");
    let mut retention = RetentionPolicy::default();
    retention.ended = Retention::Retain;
    retention.expired = Retention::Retain;
    let runtime = Arc::new(
        common::builder(root.path(), "conformance", SandboxMode::Bubblewrap)
            .retention(retention.clone())
            .build()
            .expect("local runtime"),
    );
    let target = Target::new(Arc::<LocalRuntime>::clone(&runtime), "conformance").with_retention(retention);
    assert_eq!(
        conformance::close_applies_retention_by_reason(&target).await,
        Verdict::Passed
    );
}
