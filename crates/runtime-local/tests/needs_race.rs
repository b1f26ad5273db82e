//! `agent.needs` against a hostile host user (issue 34, finding 2): whoever may write the
//! directory holding a `needs` path swaps it for a symbolic link to `/` while workers start, as
//! fast as it can. Every start must either show the directory that was checked or refuse (the
//! path changed while it was checked); none may show what the link leads to. Run for bubblewrap
//! and Landlock, where this machine has them; many starts each.
//!
//! The probe: a file outside everything the agent is shown (`secret`, in a directory of its
//! own), read from the agent's shell at its path through the `needs` path (what a bubblewrap
//! bind of `/` would show) and at its own path (what a Landlock grant of `/` would open).

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use runtime_local::LocalRuntime;
use session_runtime::config::SandboxMode;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime};

/// Worker starts per mode while the swap runs (the race was won about once in 60 before).
const STARTS: usize = 150;
const SECRET: &str = "the-host-root-was-shown";

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

/// Swaps `path` (a directory) and `other` (a link to `/`) until dropped, then leaves the
/// directory at `path`.
struct Swapper {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Swapper {
    fn start(path: PathBuf, other: PathBuf) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = std::thread::spawn({
            let stop = Arc::clone(&stop);
            move || {
                let mut swaps = 0;
                let exchange = |a: &Path, b: &Path| {
                    rustix::fs::renameat_with(
                        rustix::fs::CWD,
                        a,
                        rustix::fs::CWD,
                        b,
                        rustix::fs::RenameFlags::EXCHANGE,
                    )
                    .expect("renameat2 RENAME_EXCHANGE")
                };
                while !stop.load(Ordering::Relaxed) {
                    exchange(&path, &other);
                    swaps += 1;
                }
                if swaps % 2 == 1 {
                    exchange(&path, &other);
                }
                swaps
            }
        });
        Swapper {
            stop,
            thread: Some(thread),
        }
    }

    fn stop(&mut self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().map_or(0, |t| t.join().expect("swapper"))
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        self.stop();
    }
}

async fn race(mode: SandboxMode) {
    common::use_built_landlock_helper();
    // Outside /tmp (a bubblewrap sandbox's own) and the session root; readable by every user.
    let host = tempfile::Builder::new()
        .prefix("oab-needs-race-")
        .tempdir_in("/var/tmp")
        .expect("dir");
    chmod(host.path(), 0o755);
    let parent = host.path().join("writable-parent");
    fs::create_dir(&parent).expect("parent");
    chmod(&parent, 0o755);
    let needed = parent.join("tools");
    fs::create_dir(&needed).expect("needs dir");
    chmod(&needed, 0o755);
    fs::write(needed.join("tool"), "a tool\n").expect("tool");
    std::os::unix::fs::symlink("/", parent.join("swap")).expect("the link to /");
    let hidden = host.path().join("hidden");
    fs::create_dir(&hidden).expect("hidden");
    chmod(&hidden, 0o755);
    fs::write(hidden.join("secret"), SECRET).expect("secret");
    chmod(&hidden.join("secret"), 0o644);

    let root = tempfile::tempdir().expect("root");
    chmod(root.path(), 0o711);
    let agent = common::test_agent().needs(&needed);
    let builder = LocalRuntime::builder(agent)
        .root(root.path())
        .installation("needs-race")
        .sandbox(mode);
    let Some(runtime) = common::build_if_supported(builder, mode) else {
        return;
    };
    let identity = SessionIdentity::new("needs-race", "agent", "discord", "race").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let secret = hidden.join("secret");
    let through_needs = needed.join(secret.strip_prefix("/").expect("absolute"));
    let probe = format!(
        "echo through-needs: $(cat {} 2>/dev/null); echo at-its-path: $(cat {} 2>/dev/null); \
         echo needs: $(ls {} 2>&1)",
        through_needs.display(),
        secret.display(),
        needed.display()
    );

    let mut swapper = Swapper::start(needed.clone(), parent.join("swap"));
    let (mut shown, mut refused, mut failed) = (0, 0, 0);
    for start in 0..STARTS {
        let attachment = match runtime.attach(&id).await {
            Ok(attachment) => attachment,
            Err(Error::InvalidConfig { key, .. }) if key == "agent.needs" => {
                refused += 1;
                continue;
            }
            // bubblewrap found the path neither a directory nor a link mid-swap.
            Err(Error::WorkerFailed { .. }) => {
                failed += 1;
                continue;
            }
            Err(error) => panic!("{mode}: start {start}: {error}"),
        };
        let client = AcpClient::new(attachment);
        if client.initialize().await.is_err() {
            failed += 1;
            continue;
        }
        let out = client.exec(&probe).await.expect("exec");
        assert!(
            !out.stdout.contains(SECRET),
            "{mode}: start {start} showed what the swapped-in link leads to: {}",
            out.stdout
        );
        shown += 1;
    }
    let swaps = swapper.stop();
    runtime.close(&id, CloseReason::Ended).await.expect("close");
    eprintln!(
        "{mode}: {STARTS} starts during {swaps} swaps: {shown} started, {refused} refused, {failed} failed"
    );
    assert!(swaps > STARTS, "{mode}: the swap did not run ({swaps} swaps)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_needs_path_swapped_for_a_link_to_root_is_never_shown_under_bubblewrap() {
    race(SandboxMode::Bubblewrap).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_needs_path_swapped_for_a_link_to_root_is_never_shown_under_landlock() {
    race(SandboxMode::Landlock).await;
}
