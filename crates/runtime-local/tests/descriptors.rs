//! A descriptor the broker holds without close-on-exec (what systemd's socket activation or a
//! supervisor's pipes look like) never reaches a worker, in any mode this machine can run.
//!
//! The probe runs inside the session, through the test agent's exec method: the shell lists its
//! own descriptors (`/proc/$$/fd`), which it inherited from the agent, which inherited them from
//! whatever started it. A control run of the same probe, spawned directly by this test, shows the
//! descriptor, so the probe does see an inherited one.
//!
//! One test in its own binary: the runtime marks the process's descriptors close-on-exec when it
//! starts a worker, so another test's worker starting in between would make this one pass for
//! the wrong reason. The flag is cleared again (and checked) before each mode's attach.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

use rustix::fs::{Mode, OFlags};
use rustix::io::FdFlags;
use session_runtime::config::SandboxMode;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime};

const INSTALLATION: &str = "descriptors";

/// Lists the descriptors of the shell that runs it: `<number> -> <target>` per line.
const PROBE: &str = "for fd in /proc/$$/fd/*; do echo \"${fd##*/} -> $(readlink \"$fd\")\"; done";

/// The descriptor numbers in a probe's output.
fn listed(output: &str) -> Vec<i32> {
    output
        .lines()
        .filter_map(|line| line.split_once(" -> ")?.0.trim().parse().ok())
        .collect()
}

/// Opens `path` without close-on-exec, as an inherited descriptor would be.
fn inheritable(path: &Path) -> OwnedFd {
    let fd = rustix::fs::open(path, OFlags::RDONLY, Mode::empty()).expect("opening the sentinel");
    clear_cloexec(&fd);
    fd
}

fn clear_cloexec(fd: &OwnedFd) {
    rustix::io::fcntl_setfd(fd, FdFlags::empty()).expect("clearing close-on-exec");
    assert!(
        !rustix::io::fcntl_getfd(fd)
            .expect("reading descriptor flags")
            .contains(FdFlags::CLOEXEC),
        "the sentinel descriptor must be inheritable before the worker starts"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_descriptor_the_broker_inherited_never_reaches_a_worker() {
    let scratch = tempfile::tempdir().expect("scratch");
    let sentinel_path = scratch.path().join("broker-secret");
    std::fs::write(&sentinel_path, "not for agents").expect("sentinel");
    let sentinel = inheritable(&sentinel_path);
    let number = sentinel.as_raw_fd();

    // The control: a process spawned without the runtime inherits it, and the probe shows it.
    let control = std::process::Command::new("/bin/sh")
        .args(["-c", PROBE])
        .output()
        .expect("running the control probe");
    let control = String::from_utf8_lossy(&control.stdout);
    assert!(
        listed(&control).contains(&number),
        "the control probe must see descriptor {number}:\n{control}"
    );

    let mut ran = Vec::new();
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        let root = scratch.path().join(format!("root-{mode}"));
        let Some(runtime) = common::build_if_supported(common::builder(&root, INSTALLATION, mode), mode)
        else {
            continue;
        };
        let identity =
            SessionIdentity::new(INSTALLATION, "agent", "discord", format!("fd-{mode}")).expect("identity");
        let id = identity.id();
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        clear_cloexec(&sentinel);
        let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
        client.initialize().await.expect("initialize");
        let output = client.exec(PROBE).await.expect("exec");
        let seen = listed(&output.stdout);
        // Non-vacuous: the shell's own standard streams are listed.
        assert!(
            [0, 1, 2].iter().all(|fd| seen.contains(fd)),
            "{mode}: the probe listed no standard streams:\n{}\n{}",
            output.stdout,
            output.stderr
        );
        assert!(
            !seen.contains(&number),
            "{mode}: the worker inherited the broker's descriptor {number}:\n{}",
            output.stdout
        );
        drop(client);
        runtime.close(&id, CloseReason::Reset).await.expect("close");
        ran.push(mode);
    }
    assert!(ran.contains(&SandboxMode::None), "plain mode always runs");
    println!("checked: {ran:?}");
}
