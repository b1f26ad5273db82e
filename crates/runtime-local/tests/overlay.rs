//! Session overlays in the local runtime beyond what the conformance suite can see from outside:
//! a link planted in the workspace never becomes the agent's working directory, and the record
//! that keeps the overlay's values is readable by the broker's user only.

mod common;

use std::os::unix::fs::PermissionsExt;

use session_runtime::config::SandboxMode;
use session_runtime::overlay::WORKING_DIR_FIELD;
use session_runtime::{
    CloseReason, CreateOptions, Error, SessionIdentity, SessionOverlay, SessionRuntime, SessionState,
    SuspendReason,
};

fn identity(thread: &str) -> SessionIdentity {
    SessionIdentity::new("overlay", "agent", "discord", thread).expect("identity")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_link_planted_where_the_working_directory_was_is_refused_and_no_worker_starts() {
    let root = tempfile::tempdir().expect("temporary root");
    let outside = tempfile::tempdir().expect("a directory outside the session");
    let runtime = common::builder(root.path(), "overlay", SandboxMode::None)
        .build()
        .expect("local runtime");
    let identity = identity("link");
    let id = identity.id();
    let options = CreateOptions::new().with_overlay(SessionOverlay::new().working_dir("project"));
    runtime.create(&identity, &options).await.expect("create");
    let attachment = runtime.attach(&id).await.expect("first attach");
    let made = root.path().join(id.as_str()).join("workspace/project");
    assert_eq!(attachment.working_dir(), made.display().to_string());
    drop(attachment);
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");

    // What an agent (or a seeded repository) could leave behind: the directory replaced by a link.
    std::fs::remove_dir(&made).expect("remove the working directory");
    std::os::unix::fs::symlink(outside.path(), &made).expect("plant a link");
    match runtime.attach(&id).await {
        Err(Error::InvalidOverlay { field, .. }) => assert_eq!(field, WORKING_DIR_FIELD),
        Err(other) => panic!("a link in place of the working directory must be refused, got {other}"),
        Ok(attachment) => panic!(
            "a link in place of the working directory must be refused, the agent got {}",
            attachment.working_dir()
        ),
    }
    let status = runtime.status(&id).await.expect("status");
    assert_ne!(status.state, SessionState::Running);
    assert!(status.worker.is_none(), "no worker may start: {status:?}");
    runtime.close(&id, CloseReason::Ended).await.expect("close");
    assert!(
        outside.path().exists(),
        "closing deletes the link, never what it points to"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_keeping_the_overlay_is_the_brokers_alone() {
    let root = tempfile::tempdir().expect("temporary root");
    let runtime = common::builder(root.path(), "overlay", SandboxMode::None)
        .build()
        .expect("local runtime");
    let identity = identity("record");
    let options =
        CreateOptions::new().with_overlay(SessionOverlay::new().env("OPENAB_SESSION_TOKEN", "t0ken"));
    runtime.create(&identity, &options).await.expect("create");
    let record = root.path().join(identity.id().as_str()).join("record.json");
    let mode = std::fs::metadata(&record)
        .expect("the record")
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "record.json is mode {:o}", mode & 0o777);
    runtime
        .close(&identity.id(), CloseReason::Ended)
        .await
        .expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_largest_overlay_still_fits_its_record() {
    let root = tempfile::tempdir().expect("temporary root");
    let runtime = common::builder(root.path(), "overlay", SandboxMode::None)
        .build()
        .expect("local runtime");
    let identity = identity("largest");
    // Control characters: JSON writes each as six bytes.
    let half = session_runtime::overlay::MAX_OVERLAY_BYTES / 2 - 2;
    let overlay = SessionOverlay::new()
        .env("V0", "\u{1}".repeat(half))
        .env("V1", "\u{1}".repeat(half));
    overlay.validate().expect("an overlay at the bound is valid");
    let options = CreateOptions::new().with_overlay(overlay);
    runtime.create(&identity, &options).await.expect("create");
    let attachment = runtime
        .attach(&identity.id())
        .await
        .expect("the record is read back");
    drop(attachment);
    runtime
        .close(&identity.id(), CloseReason::Ended)
        .await
        .expect("close");
}
