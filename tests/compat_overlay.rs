//! The compat layer driven as upstream's workspace-line pool drives `get_or_create(thread_id,
//! working_dir_override)` with the `acp-mcp` feature: a thread with a working directory of its
//! own and a token minted per connection, in the shared mode, with per-session storage and under
//! bubblewrap. The agent reports its working directory and environment from inside.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::time::Duration;

use openab_runtime::compat::{thread_overlay, AgentTransport, LineWriter, PoolPath, ThreadSessions};
use openab_runtime::config::SessionRuntimeConfig;
use openab_runtime::testing::acp_test_agent_binary;
use openab_runtime::{AgentCommand, AgentOutput, CreateOptions, SessionRuntime};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const THREAD: &str = "discord:100";
const OTHER_THREAD: &str = "discord:200";
const PATIENCE: Duration = Duration::from_secs(30);

/// One connection, as `AcpConnection::from_transport` holds it.
struct Connection {
    cwd: String,
    writer: LineWriter,
    reader: BufReader<AgentOutput>,
    next_id: u64,
}

impl Connection {
    async fn open(sessions: &ThreadSessions, key: &str, options: &CreateOptions) -> Self {
        let transport: AgentTransport = sessions
            .open(key, options)
            .await
            .expect("open the thread's session");
        let AgentTransport {
            cwd, reader, writer, ..
        } = transport;
        let mut connection = Self {
            cwd,
            writer,
            reader: BufReader::new(reader),
            next_id: 1,
        };
        connection
            .request("initialize", json!({"protocolVersion": 1}))
            .await;
        let cwd = connection.cwd.clone();
        connection
            .request("session/new", json!({"cwd": cwd, "mcpServers": []}))
            .await;
        connection
    }

    async fn request(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        let line = format!(
            "{}\n",
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
        );
        self.writer
            .write_all(line.as_bytes())
            .await
            .expect("write a request");
        self.writer.flush().await.expect("flush");
        let answer = async {
            loop {
                let mut line = String::new();
                let read = self
                    .reader
                    .read_line(&mut line)
                    .await
                    .expect("read the agent's output");
                assert!(read > 0, "the agent ended before answering {method}");
                let message: Value = serde_json::from_str(&line).expect("a JSON-RPC line");
                if message.get("id") == Some(&json!(id)) {
                    assert!(message.get("error").is_none(), "{method} failed: {message}");
                    return message.get("result").cloned().unwrap_or(Value::Null);
                }
            }
        };
        tokio::time::timeout(PATIENCE, answer)
            .await
            .expect("the agent answers in time")
    }

    /// The agent's working directory and `OPENAB_SESSION_TOKEN` (`unset` when it has none), from
    /// inside: what the exec probe's shell, started in the agent's own directory with its own
    /// environment, prints.
    async fn seen_from_inside(&mut self) -> (String, String) {
        let command = "printf '%s\\n%s' \"$(pwd)\" \"${OPENAB_SESSION_TOKEN-unset}\"";
        let result = self.request("_openab/exec", json!({"command": command})).await;
        let stdout = result.get("stdout").and_then(Value::as_str).unwrap_or_default();
        let (cwd, token) = stdout.split_once('\n').unwrap_or((stdout, ""));
        (cwd.to_owned(), token.to_owned())
    }
}

/// A local runtime from a `[session_runtime]` section, as openab-core's `main.rs` builds it.
fn runtime(section: &str, agent_dir: &Path) -> std::sync::Arc<dyn SessionRuntime> {
    let config = SessionRuntimeConfig::from_toml_section(section).expect("the section parses");
    let program = acp_test_agent_binary().expect("the acp-test-agent binary");
    let agent = AgentCommand::new(program.display().to_string())
        .working_dir(agent_dir)
        .env("OAB_CONFIGURED", "from [agent].env");
    openab_runtime::from_config(&config, &agent).expect("the runtime builds")
}

/// What the mode gives a thread: the working directory the pool passes, and the `cwd` the agent
/// must report for it and for a thread without one.
struct Mode {
    section: String,
    working_dir_override: String,
    expected_cwd: Box<dyn Fn(&str) -> bool + Send + Sync>,
    default_cwd: Box<dyn Fn(&str) -> bool + Send + Sync>,
    survives_restart: bool,
    /// With storage of the session's own: the runtime's root, where a file the agent writes in
    /// its working directory must land (`<root>/<session id>/workspace/projects/api`).
    session_root: Option<PathBuf>,
}

async fn a_thread_keeps_its_working_directory_and_gets_each_minted_token(mode: Mode, agent_dir: &Path) {
    let sessions = ThreadSessions::new(runtime(&mode.section, agent_dir), "openab", "default");
    let with = |token: &str| {
        CreateOptions::new().with_overlay(thread_overlay(Some(&mode.working_dir_override), Some(token)))
    };

    let mut first = Connection::open(&sessions, THREAD, &with("token-1")).await;
    assert!(
        (mode.expected_cwd)(&first.cwd),
        "the transport's cwd: {}",
        first.cwd
    );
    assert_eq!(
        first.seen_from_inside().await,
        (first.cwd.clone(), "token-1".to_owned())
    );
    let configured = first
        .request(
            "_openab/exec",
            json!({"command": "printf '%s' \"$OAB_CONFIGURED\""}),
        )
        .await;
    assert_eq!(
        configured["stdout"], "from [agent].env",
        "the configured env still applies"
    );
    if let Some(root) = &mode.session_root {
        first
            .request("_openab/exec", json!({"command": "echo written-inside > here"}))
            .await;
        let id = sessions.session_id(THREAD).expect("the thread's session id");
        let host = root.join(id.as_str()).join("workspace/projects/api/here");
        let written = std::fs::read_to_string(&host).unwrap_or_default();
        assert_eq!(
            written.trim(),
            "written-inside",
            "the directory is the session's own: {}",
            host.display()
        );
    }
    let cwd = first.cwd.clone();
    drop(first);

    // Idle eviction, then the next message: a new connection with a newly minted token.
    sessions
        .end(THREAD, PoolPath::IdleEviction)
        .await
        .expect("idle eviction");
    let mut second = Connection::open(&sessions, THREAD, &with("token-2")).await;
    assert_eq!(
        second.seen_from_inside().await,
        (cwd.clone(), "token-2".to_owned())
    );
    drop(second);

    // Another thread of the same agent: neither the directory nor the token.
    let mut other = Connection::open(&sessions, OTHER_THREAD, &CreateOptions::new()).await;
    let (other_cwd, other_token) = other.seen_from_inside().await;
    assert!(
        (mode.default_cwd)(&other_cwd),
        "a thread without an override: {other_cwd}"
    );
    assert_eq!(other_token, "unset");
    drop(other);

    // A broker restart: a new runtime over the same configuration. With storage of its own the
    // session's record still holds the overlay, so an open without one honours it.
    sessions
        .end(THREAD, PoolPath::BrokerShutdown)
        .await
        .expect("shutdown");
    if mode.survives_restart {
        let restarted = ThreadSessions::new(runtime(&mode.section, agent_dir), "openab", "default");
        let mut resumed = Connection::open(&restarted, THREAD, &CreateOptions::new()).await;
        assert_eq!(resumed.seen_from_inside().await, (cwd, "token-2".to_owned()));
        drop(resumed);
        restarted
            .end(THREAD, PoolPath::ExplicitReset)
            .await
            .expect("reset");
    }
    sessions
        .end(THREAD, PoolPath::ExplicitReset)
        .await
        .expect("reset");
    sessions
        .end(OTHER_THREAD, PoolPath::ExplicitReset)
        .await
        .expect("reset");
}

fn canonical(path: &Path) -> PathBuf {
    path.canonicalize().expect("a canonical path")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_mode() {
    let agent_dir = tempfile::tempdir().expect("[agent].working_dir");
    let projects = tempfile::tempdir().expect("the bot's projects");
    let api = canonical(projects.path()).join("api");
    std::fs::create_dir(&api).expect("a project directory, as [[ws:]] requires");
    let default = canonical(agent_dir.path()).display().to_string();
    let expected = api.display().to_string();
    let mode = Mode {
        section: format!(
            "[local]\nworking_dirs = [{:?}]\n",
            projects.path().display().to_string()
        ),
        working_dir_override: expected.clone(),
        expected_cwd: Box::new(move |cwd| cwd == expected),
        default_cwd: Box::new(move |cwd| cwd == default),
        survives_restart: false,
        session_root: None,
    };
    a_thread_keeps_its_working_directory_and_gets_each_minted_token(mode, agent_dir.path()).await;
}

fn per_session(root: &Path, sandbox: &str, workspace: &'static str) -> Mode {
    Mode {
        section: format!(
            "[local]\nstorage = \"per-session\"\nsandbox = \"{sandbox}\"\nroot = {:?}\n",
            root.display().to_string()
        ),
        working_dir_override: "projects/api".into(),
        expected_cwd: Box::new(move |cwd| {
            cwd.ends_with("/workspace/projects/api")
                && (workspace.is_empty() || cwd == format!("{workspace}/projects/api"))
        }),
        default_cwd: Box::new(move |cwd| {
            cwd.ends_with("/workspace") && (workspace.is_empty() || cwd == workspace)
        }),
        survives_restart: true,
        session_root: Some(root.to_owned()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_session_storage() {
    let agent_dir = tempfile::tempdir().expect("[agent].working_dir");
    let root = tempfile::tempdir().expect("session root");
    let mode = per_session(root.path(), "none", "");
    a_thread_keeps_its_working_directory_and_gets_each_minted_token(mode, agent_dir.path()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bubblewrap() {
    let agent_dir = tempfile::tempdir().expect("[agent].working_dir");
    let root = tempfile::tempdir().expect("session root");
    let mode = per_session(root.path(), "bubblewrap", "/workspace");
    a_thread_keeps_its_working_directory_and_gets_each_minted_token(mode, agent_dir.path()).await;
}
