//! Errors keep their cause: an OS error behind a failure is in the message (for whoever shows
//! only that) and in the error chain (`source()`), as an `std::io::Error` with its errno.
//!
//! - [`a_root_below_a_file_reports_enotdir`]: `root` below a regular file (`ENOTDIR`).
//! - [`a_record_that_cannot_be_written_reports_why`]: `writing a session record` when its
//!   temporary file's name is taken by a directory (`EISDIR`).

mod common;

use session_runtime::config::SandboxMode;
use session_runtime::{CreateOptions, Error, SessionIdentity, SessionRuntime};

/// The first `std::io::Error` in `error`'s chain, by its errno.
fn os_cause(error: &Error) -> Option<i32> {
    let mut cause = std::error::Error::source(error);
    while let Some(inner) = cause {
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            return io.raw_os_error();
        }
        cause = inner.source();
    }
    None
}

#[test]
fn a_root_below_a_file_reports_enotdir() {
    let dir = tempfile::tempdir().expect("dir");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").expect("write");
    let error = common::builder(&file.join("sessions"), "causes", SandboxMode::None)
        .build()
        .expect_err("a root below a file");
    assert!(error.to_string().contains("Not a directory"), "{error}");
    assert_eq!(
        os_cause(&error),
        Some(rustix::io::Errno::NOTDIR.raw_os_error()),
        "{error:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_that_cannot_be_written_reports_why() {
    let root = tempfile::tempdir().expect("root");
    let runtime = common::builder(root.path(), "causes", SandboxMode::None)
        .build()
        .expect("runtime");
    let identity = SessionIdentity::new("causes", "agent", "discord", "record").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    // Attach first writes a transitional record (the launch intent), through this temporary name.
    let blocker = root.path().join(id.as_str()).join(".record.boot.json.tmp");
    std::fs::create_dir_all(blocker.join("inside")).expect("mkdir");
    let error = runtime
        .attach(&id)
        .await
        .expect_err("the record cannot be written");
    assert!(
        error.to_string().contains("writing a session record")
            && error.to_string().contains("Is a directory"),
        "{error}"
    );
    assert_eq!(
        os_cause(&error),
        Some(rustix::io::Errno::ISDIR.raw_os_error()),
        "{error:?}"
    );
    std::fs::remove_dir_all(&blocker).expect("unblock");
    runtime
        .close(&id, session_runtime::CloseReason::Reset)
        .await
        .expect("close");
}
