//! The shared runtime starts and stops the agent exactly as upstream's `AcpConnection::spawn` and
//! its `Drop` do: working directory, HOME, environment rules, process group, SIGTERM then SIGKILL.
//! The agent is a `/bin/sh` script, so these tests run on unix only.
#![cfg(unix)]

use std::time::{Duration, Instant};

use runtime_shared::SharedRuntime;
use session_runtime::{
    AgentCommand, Attachment, CreateOptions, Error, IsolationLevel, SessionIdentity, SessionRuntime,
    SuspendReason, WorkerExit, WorkspaceSeed,
};
use tokio::io::{AsyncBufReadExt, BufReader};

fn script(body: &str) -> AgentCommand {
    AgentCommand::new("/bin/sh").args(["-c", body])
}

fn identity(thread: &str) -> SessionIdentity {
    SessionIdentity::new("test", "agent", "discord", thread).expect("identity")
}

/// Lines of the agent's stdout up to the line `END`.
async fn lines_until_end(attachment: &mut Attachment) -> Vec<String> {
    let mut reader = BufReader::new(attachment.output());
    let mut lines = Vec::new();
    let read = async {
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).await.expect("read") == 0 {
                break;
            }
            let line = line.trim_end().to_owned();
            if line == "END" {
                break;
            }
            lines.push(line);
        }
    };
    tokio::time::timeout(Duration::from_secs(10), read)
        .await
        .expect("the agent answered");
    lines
}

fn value<'a>(lines: &'a [String], key: &str) -> Option<&'a str> {
    lines
        .iter()
        .find_map(|line| line.strip_prefix(&format!("{key}=")))
}

fn process_is_gone(pid: i32) -> bool {
    let pid = rustix::process::Pid::from_raw(pid).expect("pid");
    rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
}

#[tokio::test]
async fn the_agent_runs_in_the_working_directory_with_the_brokers_home_and_upstreams_environment() {
    let dir = tempfile::tempdir().expect("dir");
    let working_dir = dir.path().canonicalize().expect("canonical");
    // The broker's environment: one variable passed through by name, one that must not leak.
    std::env::set_var("OAB_SHARED_TEST_INHERITED", "from-the-broker");
    std::env::set_var("OAB_SHARED_TEST_SECRET", "bot-token");
    let agent = script("echo PWD=$(pwd -P); env; echo END")
        .working_dir(&working_dir)
        .env("EXPLICIT", "set-in-config")
        .env("OAB_SHARED_TEST_OVERRIDDEN", "explicit-wins")
        .inherit_env("OAB_SHARED_TEST_INHERITED")
        .inherit_env("OAB_SHARED_TEST_OVERRIDDEN")
        .inherit_env("OAB_SHARED_TEST_ABSENT");
    std::env::set_var("OAB_SHARED_TEST_OVERRIDDEN", "inherited-loses");
    let runtime = SharedRuntime::builder(agent).build().expect("runtime");
    let id = runtime
        .create(&identity("env"), &CreateOptions::new())
        .await
        .expect("create")
        .id;
    let mut attachment = runtime.attach(&id).await.expect("attach");
    assert_eq!(
        attachment.working_dir(),
        working_dir.to_string_lossy(),
        "the cwd to send in session/new"
    );
    let lines = lines_until_end(&mut attachment).await;

    assert_eq!(value(&lines, "PWD"), Some(working_dir.to_str().expect("utf-8")));
    let broker_home = std::env::var("HOME").expect("the test runs with a HOME");
    assert_eq!(
        value(&lines, "HOME"),
        Some(broker_home.as_str()),
        "the broker's own HOME, not one per session"
    );
    assert_eq!(value(&lines, "PATH"), std::env::var("PATH").ok().as_deref());
    assert_eq!(value(&lines, "EXPLICIT"), Some("set-in-config"));
    assert_eq!(
        value(&lines, "OAB_SHARED_TEST_INHERITED"),
        Some("from-the-broker")
    );
    assert_eq!(value(&lines, "OAB_SHARED_TEST_OVERRIDDEN"), Some("explicit-wins"));
    assert_eq!(value(&lines, "OAB_SHARED_TEST_ABSENT"), None);
    assert_eq!(
        value(&lines, "OAB_SHARED_TEST_SECRET"),
        None,
        "the broker's environment is cleared: {lines:?}"
    );
    assert_eq!(
        value(&lines, "CARGO_MANIFEST_DIR"),
        None,
        "nothing else of the broker's: {lines:?}"
    );
    runtime
        .close(&id, session_runtime::CloseReason::Reset)
        .await
        .expect("close");
}

#[tokio::test]
async fn the_agent_leads_its_own_process_group_and_stopping_it_stops_the_group() {
    let dir = tempfile::tempdir().expect("dir");
    // The agent starts a child of its own that outlives a plain kill of the agent alone.
    let agent = script("sleep 1000 & echo CHILD=$!; echo AGENT=$$; echo END; wait").working_dir(dir.path());
    let runtime = SharedRuntime::builder(agent).build().expect("runtime");
    let id = runtime
        .create(&identity("group"), &CreateOptions::new())
        .await
        .expect("create")
        .id;
    let mut attachment = runtime.attach(&id).await.expect("attach");
    let lines = lines_until_end(&mut attachment).await;
    let agent_pid: i32 = value(&lines, "AGENT")
        .and_then(|p| p.parse().ok())
        .expect("agent pid");
    let child_pid: i32 = value(&lines, "CHILD")
        .and_then(|p| p.parse().ok())
        .expect("child pid");

    let group = rustix::process::getpgid(rustix::process::Pid::from_raw(agent_pid)).expect("pgid");
    assert_eq!(
        group.as_raw_nonzero().get(),
        agent_pid,
        "setpgid(0, 0): the agent leads a group of its own"
    );
    let broker_group = rustix::process::getpgid(None).expect("our pgid");
    assert_ne!(group, broker_group, "not the broker's group");

    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !(process_is_gone(child_pid) && process_is_gone(agent_pid)) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(process_is_gone(agent_pid), "the agent was stopped");
    assert!(
        process_is_gone(child_pid),
        "the agent's own child was stopped with its group"
    );
}

#[tokio::test]
async fn an_agent_that_ignores_sigterm_is_killed_once_the_grace_has_passed() {
    let dir = tempfile::tempdir().expect("dir");
    let agent = script("trap '' TERM; echo END; while :; do sleep 0.05; done").working_dir(dir.path());
    let grace = Duration::from_millis(400);
    let runtime = SharedRuntime::builder(agent)
        .terminate_grace(grace)
        .build()
        .expect("runtime");
    let id = runtime
        .create(&identity("grace"), &CreateOptions::new())
        .await
        .expect("create")
        .id;
    let mut attachment = runtime.attach(&id).await.expect("attach");
    lines_until_end(&mut attachment).await;
    let control = attachment.control();

    let started = Instant::now();
    runtime
        .suspend(&id, SuspendReason::Capacity)
        .await
        .expect("suspend");
    let took = started.elapsed();
    assert!(
        took >= grace,
        "SIGTERM first, SIGKILL only after the grace: {took:?}"
    );
    assert!(took < grace + Duration::from_secs(3), "{took:?}");
    assert_eq!(
        control.wait().await.expect("exit"),
        WorkerExit::Signal(9),
        "killed by SIGKILL"
    );
}

#[tokio::test]
async fn a_hung_suspend_kills_without_grace() {
    let dir = tempfile::tempdir().expect("dir");
    let agent = script("trap '' TERM; echo END; while :; do sleep 0.05; done").working_dir(dir.path());
    let runtime = SharedRuntime::builder(agent)
        .terminate_grace(Duration::from_secs(30))
        .build()
        .expect("runtime");
    let id = runtime
        .create(&identity("hung"), &CreateOptions::new())
        .await
        .expect("create")
        .id;
    let mut attachment = runtime.attach(&id).await.expect("attach");
    lines_until_end(&mut attachment).await;
    let started = Instant::now();
    runtime.suspend(&id, SuspendReason::Hung).await.expect("suspend");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn it_says_it_isolates_nothing_and_refuses_what_needs_storage_of_a_sessions_own() {
    let dir = tempfile::tempdir().expect("dir");
    let runtime = SharedRuntime::builder(script("cat").working_dir(dir.path()))
        .build()
        .expect("runtime");
    let capabilities = runtime.capabilities();
    assert_eq!(capabilities.isolation, IsolationLevel::None);
    assert!(!capabilities.persistent_storage);
    let seeded = CreateOptions::new().with_workspace_seed(WorkspaceSeed::GitClone {
        url: "https://example.invalid/repo.git".into(),
        reference: None,
    });
    match runtime.create(&identity("seed"), &seeded).await {
        Err(Error::Unsupported { runtime, .. }) => assert_eq!(runtime, "shared"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_missing_working_directory_is_an_error_naming_the_key() {
    match SharedRuntime::builder(script("cat").working_dir("/nonexistent/openab-work")).build() {
        Err(Error::InvalidConfig { key, .. }) => assert_eq!(key, "agent.working_dir"),
        other => panic!("{other:?}"),
    }
}
