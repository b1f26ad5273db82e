//! Under Landlock, a session's agent cannot read other processes' command lines (issue 34,
//! finding 3): not the broker's (this test process, whose command line names this test binary),
//! and not another session's (session B leaves a process whose command line carries a marker).
//!
//! Where the broker is not root, Landlock cannot give a session a `/proc` of its own: the test
//! then checks that this is what the runtime says (its warning), instead of the hiding.

mod common;

use std::sync::Arc;

use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime};

const MARKER: &str = "oab-landlock-proc-marker-b";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_landlock_agent_listing_proc_cmdlines_sees_neither_the_broker_nor_another_session() {
    common::use_built_landlock_helper();
    let root = tempfile::tempdir().expect("root");
    std::fs::set_permissions(root.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711))
        .expect("chmod");
    let builder = common::builder(root.path(), "landlock-proc", SandboxMode::Landlock);
    let Some(runtime): Option<Arc<LocalRuntime>> = common::build_if_supported(builder, SandboxMode::Landlock)
    else {
        return;
    };
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipping: the broker is not root, so Landlock sessions share /proc (the runtime warns)");
        return;
    }
    let a = SessionIdentity::new("landlock-proc", "agent", "discord", "a").expect("identity");
    let b = SessionIdentity::new("landlock-proc", "agent", "discord", "b").expect("identity");
    let mut clients = Vec::new();
    for identity in [&a, &b] {
        runtime
            .create(identity, &CreateOptions::new())
            .await
            .expect("create");
        let client = AcpClient::new(runtime.attach(&identity.id()).await.expect("attach"));
        client.initialize().await.expect("initialize");
        clients.push(client);
    }
    // B leaves a process behind whose command line names the marker; B sees it itself.
    let started = clients[1]
        .exec(&format!(
            "sh -c 'sleep 60' {MARKER} >/dev/null 2>&1 & sleep 0.2; cat /proc/[0-9]*/cmdline | tr '\\0' ' '"
        ))
        .await
        .expect("exec in B");
    assert!(
        started.stdout.contains(MARKER),
        "B cannot see its own process: {}",
        started.stdout
    );

    let listing = clients[0]
        .exec("for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done 2>/dev/null; ls /proc | grep -c '^[0-9]'")
        .await
        .expect("exec in A");
    let broker = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.file_name().map(|name| name.to_string_lossy().into_owned()))
        .expect("this test's name");
    let own = std::process::id().to_string();
    for (what, needle) in [("the broker's", broker.as_str()), ("session B's", MARKER)] {
        assert!(
            !listing.stdout.contains(needle),
            "A's agent read {what} command line ({needle}) under /proc:\n{}",
            listing.stdout
        );
    }
    let pids = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .count();
    eprintln!(
        "A's agent sees these processes (the host has {pids}, this test is {own}):\n{}",
        listing.stdout
    );
    drop(clients);
    for identity in [&a, &b] {
        runtime
            .close(&identity.id(), CloseReason::Ended)
            .await
            .expect("close");
    }
}
