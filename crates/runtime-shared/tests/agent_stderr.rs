//! `session_runtime.local.agent_stderr`: the agent's stderr is discarded by default, as upstream
//! v0.8.x does, or each line is logged at the configured level. The agent is a `/bin/sh` script,
//! so these tests run on unix only.
#![cfg(unix)]

use std::time::{Duration, Instant};

use runtime_shared::{AgentStderr, SharedRuntimeBuilder};
use session_runtime::config::SessionRuntimeConfig;
use session_runtime::testing::CapturedLogs;
use session_runtime::{AgentCommand, CloseReason, CreateOptions, SessionIdentity, SessionRuntime};
use tokio::io::{AsyncBufReadExt, BufReader};

/// Runs an agent that writes `marker` to stderr, then says on stdout whether its stderr is
/// `/dev/null`, under a runtime built from `section` (a `[session_runtime]` body); returns that
/// answer.
async fn run(section: &str, marker: &str) -> bool {
    CapturedLogs::global();
    let dir = tempfile::tempdir().expect("dir");
    let config = SessionRuntimeConfig::from_toml_section(section).expect("config");
    let agent = AgentCommand::new("/bin/sh")
        .args([
            "-c",
            &format!(
                "echo '{marker}' >&2; if [ /dev/fd/2 -ef /dev/null ]; then echo NULL=yes; else echo NULL=no; fi; sleep 30"
            ),
        ])
        .working_dir(dir.path());
    let runtime = SharedRuntimeBuilder::from_config(&config, agent)
        .build()
        .expect("runtime");
    let identity =
        SessionIdentity::new(config.installation.as_str(), "agent", "discord", marker).expect("identity");
    let id = runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create")
        .id;
    let mut attachment = runtime.attach(&id).await.expect("attach");
    let mut line = String::new();
    tokio::time::timeout(
        Duration::from_secs(10),
        BufReader::new(attachment.output()).read_line(&mut line),
    )
    .await
    .expect("the agent answered")
    .expect("read");
    let is_null = match line.trim() {
        "NULL=yes" => true,
        "NULL=no" => false,
        other => panic!("unexpected output {other:?}"),
    };
    if !is_null {
        // The line was written before the answer; the logging task may still be reading it.
        let deadline = Instant::now() + Duration::from_secs(5);
        while CapturedLogs::global().lines_with(marker).is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    runtime.close(&id, CloseReason::Reset).await.expect("close");
    is_null
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_the_agents_stderr_is_dev_null_as_upstream() {
    let marker = "stderr-marker-default";
    assert!(run("", marker).await, "unset: /dev/null");
    assert_eq!(CapturedLogs::global().lines_with(marker), Vec::<String>::new());
    let marker = "stderr-marker-discard";
    assert!(run("[local]\nagent_stderr = \"discard\"", marker).await);
    assert_eq!(CapturedLogs::global().lines_with(marker), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_stderr_line_is_logged_at_the_configured_level() {
    for value in AgentStderr::ALL
        .into_iter()
        .filter(|v| *v != AgentStderr::Discard)
    {
        let level = value.level().expect("a level");
        let marker = format!("stderr-marker-{value}");
        assert!(
            !run(&format!("[local]\nagent_stderr = \"{value}\""), &marker).await,
            "{value}: piped, not /dev/null"
        );
        let lines = CapturedLogs::global().lines_with(&marker);
        assert_eq!(lines.len(), 1, "{value}: {lines:?}");
        let line = &lines[0];
        assert!(
            line.trim_start().starts_with(&level.to_string()),
            "{value}: logged at {level}: {line}"
        );
        assert!(line.contains(&format!("agent stderr: {marker}")), "{line}");
        assert!(line.contains("session="), "with the session id: {line}");
    }
}
