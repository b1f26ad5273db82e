//! Two chat threads, each with its own isolated session, driven through a reproduction of
//! openab-core's `SessionPool` (the pool harness in `tests/pool_harness`) on the local runtime.
//!
//! A Discord-like thread and a Slack-like thread each get a session and a prompt turn. Then the
//! Discord thread is reset (its next session starts with a clean workspace) and the Slack thread
//! is suspended as idle and resumed with `session/load` (same workspace, higher generation).
//!
//! ```text
//! cargo run --example two_threads
//! ```
//!
//! The agent is this repository's ACP test agent (built on first use). Sessions are sandboxed
//! with `sandbox = "auto"` (bubblewrap where it works, else Landlock) under a temporary root that
//! is removed at the end.

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use openab_runtime::compat::ThreadSessions;
use openab_runtime::config::SandboxMode;
use openab_runtime::testing::acp_test_agent_binary;
use openab_runtime::{AgentCommand, LocalRuntime};

// The demo uses part of the harness the tests use in full.
#[allow(dead_code)]
#[path = "../tests/pool_harness/mod.rs"]
mod pool_harness;

use pool_harness::{Op, PoolConfig, RecordingRuntime, SessionPool};

const DISCORD: &str = "discord:1234567890";
const SLACK: &str = "slack:C0123ABC:1712345678.000100";

type Result<T> = std::result::Result<T, Box<dyn Error>>;

#[tokio::main]
async fn main() -> Result<()> {
    let agent = acp_test_agent_binary()?;
    let root = tempfile::Builder::new()
        .prefix("openab-demo-sessions-")
        .tempdir()?;
    let broker_state = tempfile::Builder::new().prefix("openab-demo-broker-").tempdir()?;

    let runtime = LocalRuntime::builder(AgentCommand::new(agent.display().to_string()))
        .root(root.path())
        .installation("demo-bot")
        .sandbox(SandboxMode::Auto)
        .build()
        .map_err(|error| format!("the local runtime cannot start here: {error}"))?;
    let recorder = Arc::new(RecordingRuntime::new(Arc::new(runtime)));
    let sessions = ThreadSessions::new(
        Arc::<RecordingRuntime>::clone(&recorder),
        "demo-bot",
        "test-agent",
    );
    let pool = SessionPool::new(sessions, PoolConfig::new(broker_state.path()))?;

    println!("== OpenAB session pool over the local runtime ==");
    println!(
        "isolation between sessions: {}",
        pool.sessions().capabilities().isolation
    );
    println!("session storage root:       {}", root.path().display());
    println!("agent:                      {}", agent.display());

    step("Each thread's first message opens its own session");
    for key in [DISCORD, SLACK] {
        let fresh = pool.get_or_create(key).await?;
        println!("[{key}] get_or_create -> fresh = {fresh}");
        describe(&pool, key).await?;
    }

    step("One prompt turn in each thread (chunks stream in as the agent sends them)");
    for (key, text) in [
        (DISCORD, "why does the build fail on main?"),
        (SLACK, "draft the release notes"),
    ] {
        println!("[{key}] > {text}");
        let turn = pool
            .prompt_with(key, text, |chunk| println!("[{key}]   {chunk}"))
            .await?;
        println!("[{key}]   (stop reason: {})", turn.stop_reason);
    }

    step("Each agent writes notes.md in its own workspace (the test agent's shell probe)");
    for key in [DISCORD, SLACK] {
        pool.exec(key, &format!("echo 'notes of {key}' > notes.md"))
            .await?;
        let listing = pool.exec(key, "ls -A").await?;
        println!("[{key}] workspace: {}", one_line(&listing.stdout));
    }

    step("The Discord thread is reset: session/cancel, then close(reset)");
    let discord_before = pool.info(DISCORD).ok_or("no Discord session")?;
    let discord_control = pool.control(DISCORD).ok_or("no Discord session")?;
    let discord_storage = storage(&pool, DISCORD).await?;
    pool.reset(DISCORD).await?;
    println!(
        "[{DISCORD}] runtime call: {}",
        last_call(&recorder, &pool, DISCORD)?
    );
    println!("[{DISCORD}] old worker alive: {}", discord_control.is_alive());
    println!(
        "[{DISCORD}] old storage {} exists: {}",
        discord_storage,
        std::path::Path::new(&discord_storage).exists()
    );

    step("The Slack thread goes idle: cleanup_idle suspends it (storage kept)");
    let slack_before = pool.info(SLACK).ok_or("no Slack session")?;
    let slack_control = pool.control(SLACK).ok_or("no Slack session")?;
    let cleanup = pool.cleanup_idle(Duration::ZERO).await?;
    println!("idle-evicted: {:?}", cleanup.idle);
    println!("[{SLACK}] runtime call: {}", last_call(&recorder, &pool, SLACK)?);
    println!("[{SLACK}] old worker alive: {}", slack_control.is_alive());
    let status = pool.sessions().runtime().status(&slack_before.session_id).await?;
    println!(
        "[{SLACK}] status: {} ({}), worker: {:?}, storage: {:?} at {}",
        status.state,
        status
            .suspend_reason
            .map(|reason| reason.to_string())
            .unwrap_or_default(),
        status.worker.map(|worker| worker.worker_id),
        status.storage,
        status.storage_refs.join(", "),
    );
    println!(
        "[{SLACK}] persisted ACP session id: {}",
        pool.persisted(SLACK).unwrap_or_default()
    );

    step("A new message in each thread");
    let fresh = pool.get_or_create(DISCORD).await?;
    println!("[{DISCORD}] get_or_create -> fresh = {fresh} (the reset dropped everything)");
    describe(&pool, DISCORD).await?;
    let discord_after = pool.info(DISCORD).ok_or("no Discord session")?;
    println!(
        "[{DISCORD}] ACP session {} -> {} (session/new)",
        discord_before.acp_session_id, discord_after.acp_session_id
    );
    let listing = pool.exec(DISCORD, "ls -A").await?;
    println!("[{DISCORD}] workspace: {}", one_line(&listing.stdout));

    let fresh = pool.get_or_create(SLACK).await?;
    println!("[{SLACK}] get_or_create -> fresh = {fresh} (resumed)");
    describe(&pool, SLACK).await?;
    let slack_after = pool.info(SLACK).ok_or("no Slack session")?;
    println!(
        "[{SLACK}] {:?} ACP session {}; generation {} -> {}",
        slack_after.opened, slack_after.acp_session_id, slack_before.generation, slack_after.generation
    );
    let notes = pool.exec(SLACK, "cat notes.md").await?;
    println!("[{SLACK}] notes.md is still there: {}", one_line(&notes.stdout));

    step("Broker shutdown: every session suspended, thread map saved");
    let suspended = pool.shutdown().await?;
    println!("suspended: {suspended:?}");
    println!("thread map {}:", pool.thread_map_path().display());
    println!("{}", std::fs::read_to_string(pool.thread_map_path())?);

    step("Runtime calls the pool made (recorded)");
    for key in [DISCORD, SLACK] {
        let id = pool.sessions().session_id(key)?;
        let ops: Vec<String> = recorder.ops(&id).into_iter().map(op_name).collect();
        println!("[{key}] session {id}: {}", ops.join(" -> "));
    }
    println!("\n(the temporary storage root is removed now)");
    Ok(())
}

fn step(title: &str) {
    println!("\n--- {title} ---");
}

/// Prints a thread's session: ids, generation, worker, where the agent works, where storage is.
async fn describe(pool: &SessionPool, key: &str) -> Result<()> {
    let info = pool.info(key).ok_or("no live session")?;
    println!(
        "[{key}]   session id     {} (generation {})",
        info.session_id, info.generation
    );
    println!(
        "[{key}]   ACP session    {} ({:?})",
        info.acp_session_id, info.opened
    );
    println!("[{key}]   worker         {}", info.worker_id);
    println!("[{key}]   agent cwd      {} (inside the worker)", info.cwd);
    println!(
        "[{key}]   storage        {} (on the host)",
        storage(pool, key).await?
    );
    Ok(())
}

async fn storage(pool: &SessionPool, key: &str) -> Result<String> {
    let id = pool.sessions().session_id(key)?;
    let status = pool.sessions().runtime().status(&id).await?;
    Ok(status.storage_refs.join(", "))
}

/// The last lifecycle call the pool made for `key`'s session, as the runtime received it.
fn last_call(recorder: &RecordingRuntime, pool: &SessionPool, key: &str) -> Result<String> {
    let id = pool.sessions().session_id(key)?;
    let op = recorder.ops(&id).pop().ok_or("no runtime call")?;
    Ok(op_name(op))
}

fn one_line(text: &str) -> String {
    let words: Vec<&str> = text.split_whitespace().collect();
    if words.is_empty() {
        "(empty)".to_owned()
    } else {
        words.join(" ")
    }
}

fn op_name(op: Op) -> String {
    match op {
        Op::Create => "create".to_owned(),
        Op::Attach => "attach".to_owned(),
        Op::Suspend(reason) => format!("suspend({reason})"),
        Op::Close(reason) => format!("close({reason})"),
    }
}
