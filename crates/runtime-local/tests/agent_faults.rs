//! Agents that fail or misbehave.
//!
//! - [`a_missing_agent_fails_attach_with_enoent_in_every_mode`]: an agent program that does not
//!   exist (by path, or by name on `PATH`) fails `attach` with `WorkerFailed` / `Spawn` saying
//!   `ENOENT`, the same in plain, bubblewrap and Landlock modes (where the failed exec would
//!   otherwise happen inside the sandbox, after the worker started, and Landlock would turn the
//!   search of `PATH` into `EACCES`), and the session is left as it was.
//! - [`the_agent_is_in_its_cgroups_from_its_first_instruction`]: an agent under a limit whose
//!   first act is to read its own cgroups is already in the session's, in every mode.
//! - [`nothing_an_agent_detaches_outlives_its_session`]: a plain agent's grandchild that left its
//!   process group and session, cleared its environment (no worker marker) and was orphaned (its
//!   parent is gone) is killed when the session is suspended.
//! - [`an_agent_killed_by_its_memory_limit_ended_out_of_memory`]: plain and bubblewrap.
//! - [`a_failed_start_is_shown_in_status_until_a_worker_starts`]: a session whose first start
//!   failed stays `created` at generation 0, and its status says why, in every mode; the next
//!   worker that starts clears it.
//!
//! The cgroup tests need a broker that may create cgroups (root here); elsewhere they say so and
//! pass without checking.

mod common;

use session_runtime::config::SandboxMode;
use session_runtime::{
    AgentCommand, CreateOptions, Error, SessionIdentity, SessionRuntime, SessionState, WorkerFailure,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_agent_fails_attach_with_enoent_in_every_mode() {
    common::use_built_landlock_helper();
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        for program in ["no-such-agent-anywhere", "/no/such/dir/agent"] {
            let root = tempfile::tempdir().expect("root");
            let builder = runtime_local::LocalRuntime::builder(AgentCommand::new(program))
                .root(root.path())
                .installation("missing")
                .sandbox(mode);
            let Some(runtime) = common::build_if_supported(builder, mode) else {
                continue;
            };
            let identity = SessionIdentity::new("missing", "agent", "discord", program).expect("identity");
            let id = identity.id();
            runtime
                .create(&identity, &CreateOptions::new())
                .await
                .expect("create");
            match runtime.attach(&id).await {
                Err(Error::WorkerFailed {
                    cause: WorkerFailure::Spawn(why),
                    ..
                }) => assert!(
                    why.contains("No such file or directory"),
                    "{mode}, {program}: {why}"
                ),
                Err(other) => panic!("{mode}, {program}: not a spawn failure: {other}"),
                Ok(_) => panic!("{mode}, {program}: a missing agent attached"),
            }
            let status = runtime.status(&id).await.expect("status");
            assert_eq!(status.state, SessionState::Created, "{mode}, {program}");
            assert!(status.worker.is_none(), "{mode}, {program}: {status:?}");
        }
    }
}

/// An agent built under a directory the sandbox replaces (a checkout under the host's /tmp, as CI
/// makes one) is still found and started: bubblewrap binds the program itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_under_the_hosts_tmp_starts_in_every_mode() {
    common::use_built_landlock_helper();
    let built = session_runtime::testing::acp_test_agent_binary().expect("acp-test-agent");
    let elsewhere = tempfile::Builder::new()
        .prefix("agent-in-tmp-")
        .tempdir_in("/tmp")
        .expect("a directory under /tmp");
    let program = elsewhere.path().join("acp-test-agent");
    std::fs::copy(&built, &program).expect("copy the agent");
    std::fs::set_permissions(
        elsewhere.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        let root = tempfile::tempdir().expect("root");
        let builder = runtime_local::LocalRuntime::builder(AgentCommand::new(program.display().to_string()))
            .root(root.path())
            .installation("tmp-agent")
            .sandbox(mode);
        let Some(runtime) = common::build_if_supported(builder, mode) else {
            continue;
        };
        let identity = SessionIdentity::new("tmp-agent", "agent", "discord", "t").expect("identity");
        let id = identity.id();
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        let attachment = runtime
            .attach(&id)
            .await
            .unwrap_or_else(|error| panic!("{mode}: an agent under /tmp must start: {error}"));
        let client = session_runtime::testing::AcpClient::new(attachment);
        client
            .initialize()
            .await
            .unwrap_or_else(|error| panic!("{mode}: initialize: {error}"));
        drop(client);
        runtime
            .close(&id, session_runtime::CloseReason::Reset)
            .await
            .expect("close");
    }
}

/// Whether this process may create cgroups (the tests below need it); says so when not.
fn cgroups_usable() -> bool {
    let root = rustix::process::geteuid().is_root();
    if !root {
        eprintln!("skipping: per-session cgroups need a root broker here");
    }
    root
}

/// The plain or sandboxed runtime of `mode` under `root`, running `program args`.
fn runtime_running(
    root: &std::path::Path,
    mode: SandboxMode,
    program: &str,
    args: &[&str],
    limits: Option<session_runtime::config::ResourceLimits>,
) -> Option<std::sync::Arc<runtime_local::LocalRuntime>> {
    let agent = AgentCommand::new(program).args(args.iter().map(|a| a.to_string()));
    let mut builder = runtime_local::LocalRuntime::builder(agent)
        .root(root)
        .installation("misbehaving")
        .sandbox(mode);
    if let Some(limits) = limits {
        builder = builder.limits(limits);
    }
    common::build_if_supported(builder, mode)
}

async fn created(runtime: &runtime_local::LocalRuntime, thread: &str) -> session_runtime::SessionId {
    let identity = SessionIdentity::new("misbehaving", "agent", "discord", thread).expect("identity");
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    identity.id()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_is_in_its_cgroups_from_its_first_instruction() {
    use tokio::io::AsyncReadExt;
    common::use_built_landlock_helper();
    if !cgroups_usable() {
        return;
    }
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        let root = tempfile::tempdir().expect("root");
        // `cat` reads its own cgroups before anything else it does: under a limit, it must
        // already be where the limit is.
        let mut limits = session_runtime::config::ResourceLimits::default();
        limits.pids = Some(64);
        let Some(runtime) = runtime_running(
            root.path(),
            mode,
            "/bin/cat",
            &["/proc/self/cgroup"],
            Some(limits),
        ) else {
            continue;
        };
        let id = created(&runtime, "first-instruction").await;
        let mut attachment = runtime.attach(&id).await.expect("attach");
        let mut seen = String::new();
        attachment
            .output()
            .read_to_string(&mut seen)
            .await
            .expect("output");
        let ours = format!("/openab-{id}-");
        assert!(
            seen.lines().any(|line| line.contains(&ours)),
            "{mode}: the agent ran outside its cgroups:\n{seen}"
        );
        drop(attachment);
        runtime
            .close(&id, session_runtime::CloseReason::Reset)
            .await
            .expect("close");
    }
}

/// The thread that spawns a worker inside its cgroups is a member for the spawn only, and the
/// room it takes in `pids.max` meanwhile is given back: under `pids = 1` the worker's shell is
/// the one task of its cgroup and cannot fork; under `pids = 2` it can fork once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pids_limit_holds_exactly_for_the_worker_alone() {
    use tokio::io::AsyncBufReadExt;
    if !cgroups_usable() {
        return;
    }
    // dash gives up on a failed fork, so "refused" may never be printed: no "forked" is the sign.
    let script = "read go; /bin/true && echo forked || echo refused; read end";
    for (pids, forks) in [(1, false), (2, true)] {
        let root = tempfile::tempdir().expect("root");
        let mut limits = session_runtime::config::ResourceLimits::default();
        limits.pids = Some(pids);
        let runtime = runtime_running(
            root.path(),
            SandboxMode::None,
            "/bin/sh",
            &["-c", script],
            Some(limits),
        )
        .expect("plain mode always builds");
        let id = created(&runtime, "pids-exact").await;
        let attachment = runtime.attach(&id).await.expect("attach");
        let resources = runtime
            .status(&id)
            .await
            .expect("status")
            .resources
            .expect("a worker under limits reports them");
        assert_eq!(
            resources.pids,
            Some(1),
            "pids = {pids}: the worker's shell is the one task of its cgroup: {resources:?}"
        );
        let (output, input, _control) = attachment.into_split();
        input.write_line("go").await.expect("write");
        let mut line = String::new();
        tokio::io::BufReader::new(output)
            .read_line(&mut line)
            .await
            .expect("the agent's verdict");
        assert_eq!(
            line.trim() == "forked",
            forks,
            "pids = {pids}: the agent said {line:?}"
        );
        drop(input);
        runtime
            .close(&id, session_runtime::CloseReason::Reset)
            .await
            .expect("close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_an_agent_detaches_outlives_its_session() {
    use tokio::io::AsyncBufReadExt;
    if !cgroups_usable() {
        return;
    }
    let root = tempfile::tempdir().expect("root");
    // A grandchild in a session of its own, with no environment (so no worker marker), whose
    // parent exits at once (so it is not the agent's descendant either), then the agent waits.
    let script = "(setsid env -i /bin/sleep 300 & echo $!) ; exec /bin/sleep 300";
    let runtime = runtime_running(root.path(), SandboxMode::None, "/bin/sh", &["-c", script], None)
        .expect("plain mode always builds");
    let id = created(&runtime, "detached").await;
    let mut attachment = runtime.attach(&id).await.expect("attach");
    let mut line = String::new();
    tokio::io::BufReader::new(attachment.output())
        .read_line(&mut line)
        .await
        .expect("the grandchild's pid");
    let pid: u32 = line.trim().parse().expect("a pid");
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("the grandchild runs");
    let start_time = stat
        .rsplit_once(") ")
        .expect("stat")
        .1
        .split(' ')
        .nth(19)
        .expect("start")
        .to_owned();
    drop(attachment);
    runtime
        .suspend(&id, session_runtime::SuspendReason::Idle)
        .await
        .expect("suspend");
    let survivor = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .filter(|stat| {
            let fields: Vec<&str> = stat
                .rsplit_once(") ")
                .map(|(_, rest)| rest.split(' ').collect())
                .unwrap_or_default();
            fields.first() != Some(&"Z") && fields.get(19) == Some(&start_time.as_str())
        });
    if survivor.is_some() {
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    }
    assert!(
        survivor.is_none(),
        "the detached grandchild {pid} outlived the suspend"
    );
    runtime
        .close(&id, session_runtime::CloseReason::Reset)
        .await
        .expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_by_its_memory_limit_ended_out_of_memory() {
    if !cgroups_usable() {
        return;
    }
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap] {
        let root = tempfile::tempdir().expect("root");
        let mut limits = session_runtime::config::ResourceLimits::default();
        limits.memory = Some(32 << 20);
        // `tail` keeps all of an endless line in memory.
        let Some(runtime) = runtime_running(root.path(), mode, "/usr/bin/tail", &["/dev/zero"], Some(limits))
        else {
            continue;
        };
        let id = created(&runtime, "oom").await;
        let attachment = runtime.attach(&id).await.expect("attach");
        let exit = attachment.control().wait().await.expect("exit");
        assert_eq!(exit, session_runtime::WorkerExit::OutOfMemory, "{mode}: {exit}");
        drop(attachment);
        runtime
            .close(&id, session_runtime::CloseReason::Reset)
            .await
            .expect("close");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_start_is_shown_in_status_until_a_worker_starts() {
    common::use_built_landlock_helper();
    for mode in [SandboxMode::None, SandboxMode::Bubblewrap, SandboxMode::Landlock] {
        let root = tempfile::tempdir().expect("root");
        let build = |agent: AgentCommand| {
            let builder = runtime_local::LocalRuntime::builder(agent)
                .root(root.path())
                .installation("failed-start")
                .sandbox(mode);
            common::build_if_supported(builder, mode)
        };
        let Some(broken) = build(AgentCommand::new("/no/such/dir/agent")) else {
            continue;
        };
        let identity = SessionIdentity::new("failed-start", "agent", "discord", "t").expect("identity");
        let id = identity.id();
        broken
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        // The control: a fresh session shows no failure.
        assert_eq!(broken.status(&id).await.expect("status").last_start_failure, None);
        let error = broken
            .attach(&id)
            .await
            .expect_err("a missing agent cannot start");
        let status = broken.status(&id).await.expect("status");
        assert_eq!(
            (status.state, status.generation),
            (SessionState::Created, 0),
            "{mode}"
        );
        let failure = status
            .last_start_failure
            .unwrap_or_else(|| panic!("{mode}: the failed start is not shown"));
        assert_eq!(failure.generation, 0, "{mode}");
        assert_eq!(failure.error, error.to_string(), "{mode}");
        let listed = broken.list().await.expect("list");
        assert!(
            listed
                .iter()
                .any(|s| s.id == id && s.last_start_failure.is_some()),
            "{mode}: list shows it too"
        );

        // Fixed (the agent installed): the next start clears it.
        let fixed = build(common::test_agent()).expect("the same mode builds");
        let attachment = fixed.attach(&id).await.expect("attach");
        let status = fixed.status(&id).await.expect("status");
        drop(attachment);
        fixed
            .close(&id, session_runtime::CloseReason::Ended)
            .await
            .expect("close");
        assert_eq!(
            status.last_start_failure, None,
            "{mode}: a started worker clears it"
        );
        assert_eq!(status.generation, 1, "{mode}");
    }
}
