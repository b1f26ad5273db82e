//! Real third-party ACP agents through `oab-runtime run`, in plain, bubblewrap, Landlock and
//! bubblewrap with `network = "allowlist"` modes, configured only with the README's `[agent]`
//! keys (`command`, `args`, `env`; no `needs`: what each needs is shown by default), each
//! completing a prompt turn against a fake model endpoint this test serves on 127.0.0.1 (with
//! `allowlist`, reached through the loopback `egress` entry for its port):
//!
//! - **Node**: `@zed-industries/codex-acp` from npm, installed as a user installs it
//!   (`npm install --global --prefix`), started by its `bin/codex-acp` link into the package
//!   (whose Node launcher runs the native agent of its platform package, nested in the package's
//!   `node_modules`), pointed at the endpoint's Responses API with `-c` overrides;
//! - **Node**: `@zed-industries/claude-code-acp` from npm, installed the same way, which runs the
//!   Claude Code CLI of its `@anthropic-ai/claude-agent-sdk` dependency, pointed at the endpoint's
//!   Anthropic Messages API with `ANTHROPIC_BASE_URL`;
//! - **Python**: `tests/fixtures/real-agents/python-agent.py` on the Python ACP SDK from PyPI,
//!   run as `<venv>/bin/python agent.py` in a virtual environment made with an interpreter outside
//!   `/usr` (as pyenv, uv or conda install one), which calls the endpoint's chat completions.
//!
//! `tests/fixtures/real-agents/install.sh` installs both into `<target>/real-acp-agents` (pinned;
//! a no-op once done); `scripts/test` runs it and then this test. For each agent and mode it
//! prints the time of one prompt turn through `run` and of the same agent started directly
//! (`OAB_REAL_AGENTS=node-codex-acp,node-claude-code,python-venv-agent` chooses agents).
//! Every process it starts leads a process group of its own, killed when it is done with it.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// What the fake model says (in OpenAI's chat completions and Responses APIs and Anthropic's
/// Messages API).
const ANSWER: &str = "pong from the fake model";
/// How long one request may take to be answered.
const TIMEOUT: Duration = Duration::from_secs(60);

/// The target directory this test binary was built into (`<target>/<profile>/deps/<binary>`).
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.ancestors()
        .nth(3)
        .expect("the test binary lives in <target>/<profile>/deps")
        .to_path_buf()
}

/// Where the agents are installed: `<target>/real-acp-agents`, or `/var/tmp/oab-real-acp-agents`
/// when the target directory is under `/tmp`, which a bubblewrap sandbox replaces with its own
/// (`scripts/test` makes the same choice).
fn agents_dir() -> PathBuf {
    let target = target_dir();
    if target.starts_with("/tmp") {
        PathBuf::from("/var/tmp/oab-real-acp-agents")
    } else {
        target.join("real-acp-agents")
    }
}

/// Installs the agents (a no-op when up to date) and returns their directory.
fn installed_agents() -> PathBuf {
    let dest = agents_dir();
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/real-agents/install.sh"
    );
    let output = Command::new("bash")
        .arg(script)
        .arg(&dest)
        .output()
        .expect("run install.sh");
    assert!(
        output.status.success(),
        "{script} failed: it needs npm, /usr/bin/python3 with pip, and once the npm registry and PyPI:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    dest
}

/// A fake OpenAI-compatible model on loopback: chat completions (JSON) and the Responses API
/// (server-sent events), each answering [`ANSWER`]. Returns its port and a request counter.
fn fake_model() -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("address").port();
    let served = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&served);
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let counter = Arc::clone(&counter);
            std::thread::spawn(move || answer(stream, &counter));
        }
    });
    (port, served)
}

/// Serves one HTTP/1.1 request.
fn answer(stream: TcpStream, served: &AtomicUsize) {
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() {
        return;
    }
    let mut length = 0usize;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let target = request_line.split(' ').nth(1).unwrap_or_default();
    let path = target.split('?').next().unwrap_or_default().to_owned();
    let (content_type, payload) = if path.ends_with("/messages/count_tokens") {
        ("application/json", json!({"input_tokens": 1}).to_string())
    } else if path.ends_with("/v1/messages") {
        anthropic_messages(&body)
    } else if path.ends_with("/chat/completions") {
        let completion = json!({"id": "c1", "object": "chat.completion", "choices": [{"index": 0,
            "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"}]});
        ("application/json", completion.to_string())
    } else if path.ends_with("/responses") {
        let events = [
            json!({"type": "response.created", "response": {"id": "r1"}}),
            json!({"type": "response.output_item.done", "item": {"type": "message", "role": "assistant",
                "id": "m1", "content": [{"type": "output_text", "text": ANSWER}]}}),
            json!({"type": "response.completed", "response": {"id": "r1", "usage": {"input_tokens": 1,
                "input_tokens_details": null, "output_tokens": 1, "output_tokens_details": null,
                "total_tokens": 2}}}),
        ];
        let stream = events
            .iter()
            .map(|event| {
                format!(
                    "event: {}\ndata: {event}\n\n",
                    event["type"].as_str().unwrap_or("")
                )
            })
            .collect();
        ("text/event-stream", stream)
    } else {
        let mut stream = reader.into_inner();
        let _ = stream.write_all(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        return;
    };
    served.fetch_add(1, Ordering::SeqCst);
    let mut stream = reader.into_inner();
    let _ = write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{payload}",
        payload.len()
    );
}

/// An answer of Anthropic's Messages API to the request `body`: server-sent events when it asks
/// for a stream, else one JSON message.
fn anthropic_messages(body: &[u8]) -> (&'static str, String) {
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let model = request["model"].as_str().unwrap_or("claude-fake").to_owned();
    let usage = json!({"input_tokens": 1, "output_tokens": 1});
    if request["stream"] != json!(true) {
        let message = json!({"id": "msg_1", "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": ANSWER}], "stop_reason": "end_turn",
            "stop_sequence": null, "usage": usage});
        return ("application/json", message.to_string());
    }
    let start = json!({"id": "msg_1", "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": null, "stop_sequence": null, "usage": usage});
    let events = [
        json!({"type": "message_start", "message": start}),
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": ANSWER}}),
        json!({"type": "content_block_stop", "index": 0}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": null},
            "usage": {"output_tokens": 1}}),
        json!({"type": "message_stop"}),
    ];
    let stream = events
        .iter()
        .map(|event| {
            format!(
                "event: {}\ndata: {event}\n\n",
                event["type"].as_str().unwrap_or("")
            )
        })
        .collect();
    ("text/event-stream", stream)
}

/// A JSON-RPC peer over a child's stdio, answering the agent's own requests (permissions) with
/// `cancelled`. The child leads a process group of its own, which is killed when the peer is
/// dropped (a real agent, e.g. codex-acp, does not exit at stdin EOF, and its Node launcher's
/// native child would outlive a kill of the launcher alone).
struct Peer {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<Value>,
}

impl Peer {
    fn start(mut command: Command) -> Peer {
        use std::os::unix::process::CommandExt;
        let mut child = command
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("  | {line}");
            }
        });
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                match serde_json::from_str::<Value>(&line) {
                    Ok(value) => {
                        if sender.send(value).is_err() {
                            return;
                        }
                    }
                    Err(_) => eprintln!("  | (stdout, not JSON) {line}"),
                }
            }
        });
        Peer {
            stdin: child.stdin.take(),
            child,
            lines,
        }
    }

    fn send(&mut self, message: &Value) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{message}")
            .and_then(|()| stdin.flush())
            .expect("write to the agent");
    }

    /// Sends request `id` and waits for its response, collecting the text of message chunks.
    fn request(&mut self, id: u64, method: &str, params: Value, chunks: &mut String) -> Value {
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let message = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("{method}: no response ({e})"));
            if message.get("method").is_some() {
                if let Some(request_id) = message.get("id") {
                    let cancelled = json!({"outcome": {"outcome": "cancelled"}});
                    self.send(&json!({"jsonrpc": "2.0", "id": request_id, "result": cancelled}));
                } else if message["params"]["update"]["sessionUpdate"] == "agent_message_chunk" {
                    chunks.push_str(
                        message["params"]["update"]["content"]["text"]
                            .as_str()
                            .unwrap_or(""),
                    );
                }
                continue;
            }
            if message.get("id") == Some(&json!(id)) {
                assert!(message.get("error").is_none(), "{method}: {message}");
                return message["result"].clone();
            }
        }
    }

    /// `initialize`, `session/new` and one prompt turn; returns the turn's time and text.
    fn prompt_turn(&mut self, cwd: &str) -> (Duration, String) {
        let mut chunks = String::new();
        self.request(
            1,
            "initialize",
            json!({"protocolVersion": 1, "clientCapabilities": {}}),
            &mut chunks,
        );
        let session = self.request(
            2,
            "session/new",
            json!({"cwd": cwd, "mcpServers": []}),
            &mut chunks,
        );
        let session_id = session["sessionId"].as_str().expect("a session id").to_owned();
        chunks.clear();
        let started = Instant::now();
        let result = self.request(
            3,
            "session/prompt",
            json!({"sessionId": session_id, "prompt": [{"type": "text", "text": "ping"}]}),
            &mut chunks,
        );
        let took = started.elapsed();
        assert_eq!(result["stopReason"], "end_turn", "{result}");
        (took, chunks)
    }

    /// Closes stdin and waits for the child to end (its process group is killed after `grace`,
    /// and in any case when the peer is dropped).
    fn finish(mut self, grace: Duration) -> Option<i32> {
        drop(self.stdin.take());
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Peer {
    /// Kills the child's process group (what the child left in it too), then reaps the child.
    fn drop(&mut self) {
        let group = i32::try_from(self.child.id())
            .ok()
            .and_then(rustix::process::Pid::from_raw);
        if let Some(group) = group {
            let _ = rustix::process::kill_process_group(group, rustix::process::Signal::KILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One agent as the README configures it.
struct Agent {
    name: &'static str,
    command: PathBuf,
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    needs: Vec<PathBuf>,
}

fn agents(dir: &Path, model_port: u16) -> Vec<Agent> {
    let base_url = format!("http://127.0.0.1:{model_port}/v1");
    let provider = format!(
        "model_providers.fake={{name=\"fake\",base_url=\"{base_url}\",wire_api=\"responses\",env_key=\"OPENAI_API_KEY\"}}"
    );
    vec![
        Agent {
            name: "node-codex-acp",
            command: dir.join("codex/bin/codex-acp"),
            args: [
                "-c",
                "model_provider=\"fake\"",
                "-c",
                &provider,
                "-c",
                "model=\"gpt-fake\"",
            ]
            .map(str::to_owned)
            .to_vec(),
            env: vec![
                ("PATH", "/usr/bin:/bin".to_owned()),
                ("OPENAI_API_KEY", "sk-test".to_owned()),
            ],
            needs: Vec::new(),
        },
        Agent {
            name: "node-claude-code",
            command: dir.join("claude/bin/claude-code-acp"),
            args: Vec::new(),
            env: vec![
                ("PATH", "/usr/bin:/bin".to_owned()),
                ("ANTHROPIC_BASE_URL", format!("http://127.0.0.1:{model_port}")),
                ("ANTHROPIC_API_KEY", "sk-ant-test".to_owned()),
                ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".to_owned()),
            ],
            needs: Vec::new(),
        },
        Agent {
            name: "python-venv-agent",
            command: dir.join("python-venv/bin/python"),
            args: vec![dir.join("python-agent/agent.py").display().to_string()],
            env: vec![
                ("PATH", "/usr/bin:/bin".to_owned()),
                ("PYTHONDONTWRITEBYTECODE", "1".to_owned()),
                ("OPENAI_BASE_URL", base_url),
                ("OPENAI_API_KEY", "sk-test".to_owned()),
            ],
            needs: Vec::new(),
        },
    ]
}

/// The `[agent]` table of `agent`, as the README documents it.
fn agent_table(agent: &Agent) -> String {
    let env: Vec<String> = agent
        .env
        .iter()
        .map(|(key, value)| format!("{key} = {value:?}"))
        .collect();
    format!(
        "[agent]\ncommand = {:?}\nargs = {:?}\nenv = {{ {} }}\nneeds = {:?}\n",
        agent.command.display().to_string(),
        agent.args,
        env.join(", "),
        agent
            .needs
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>(),
    )
}

#[test]
#[ignore = "needs node and npm, /usr/bin/python3 with pip, and once the npm registry and PyPI \
            (tests/fixtures/real-agents/install.sh); scripts/test runs it: \
            cargo test --test real_agents -- --ignored"]
fn node_and_python_agents_complete_a_prompt_turn_through_run_in_every_mode() {
    let runtime = Path::new(env!("CARGO_BIN_EXE_oab-runtime"));
    let helper = runtime.with_file_name("oab-landlock-exec");
    assert!(
        helper.exists(),
        "{} is missing: cargo build -p runtime-local --bin oab-landlock-exec (cargo test --workspace builds it)",
        helper.display()
    );
    let dir = installed_agents();
    let (port, served) = fake_model();
    let mut report = Vec::new();
    // `OAB_REAL_AGENTS=name,name` runs only those agents.
    let only = std::env::var("OAB_REAL_AGENTS").ok();
    let chosen = |name: &str| {
        only.as_deref()
            .is_none_or(|only| only.split(',').any(|n| n == name))
    };
    for agent in agents(&dir, port).into_iter().filter(|agent| chosen(agent.name)) {
        // The same agent started directly: the baseline.
        let home = tempfile::tempdir().expect("home");
        let mut direct = Command::new(&agent.command);
        direct
            .args(&agent.args)
            .env_clear()
            .envs(agent.env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("HOME", home.path())
            .current_dir(home.path());
        let before = served.load(Ordering::SeqCst);
        let mut peer = Peer::start(direct);
        let (baseline, text) = peer.prompt_turn(&home.path().display().to_string());
        peer.finish(Duration::from_secs(1));
        assert!(text.contains(ANSWER), "{} directly: {text:?}", agent.name);
        assert!(
            served.load(Ordering::SeqCst) > before,
            "{} directly: no model call",
            agent.name
        );

        for mode in ["none", "bubblewrap", "landlock", "allowlist"] {
            let (sandbox, network) = match mode {
                "allowlist" => (
                    "bubblewrap",
                    format!("network = \"allowlist\"\negress = [\"127.0.0.1:{port}\"]\n"),
                ),
                // The sandboxed default has a network of its own: the fake model on the host's
                // loopback is reached with the host's network (or an `egress` entry, above).
                sandbox => (sandbox, "network = \"host\"\n".to_owned()),
            };
            let work = tempfile::tempdir().expect("temp dir");
            std::fs::set_permissions(work.path(), std::os::unix::fs::PermissionsExt::from_mode(0o711))
                .expect("chmod");
            let config = work.path().join("openab.toml");
            // The fake model listens on the host's loopback, which a sandboxed session reaches
            // only with the host's network (or a loopback `egress` entry and its forwarder).
            std::fs::write(
                &config,
                format!(
                    "{}[session_runtime]\ninstallation = \"real-agents\"\n\
                     [session_runtime.local]\nstorage = \"per-session\"\nsandbox = \"{sandbox}\"\nroot = {:?}\n{network}",
                    agent_table(&agent),
                    work.path().join("sessions").display().to_string(),
                ),
            )
            .expect("config");
            let mut run = Command::new(runtime);
            run.arg("--config")
                .arg(&config)
                .args(["run", "--platform", "test", "--thread", agent.name]);
            let before = served.load(Ordering::SeqCst);
            let mut peer = Peer::start(run);
            // `run` replaces this cwd with the session's working directory.
            let (through_run, text) = peer.prompt_turn("/nonexistent");
            let code = peer.finish(Duration::from_secs(30));
            assert!(text.contains(ANSWER), "{} in {mode}: {text:?}", agent.name);
            assert!(
                served.load(Ordering::SeqCst) > before,
                "{} in {mode}: no model call",
                agent.name
            );
            assert!(
                code.is_some(),
                "{} in {mode}: run did not end after stdin EOF",
                agent.name
            );
            report.push(format!(
                "{:<17} {mode:<10} run {:>7.1} ms   direct {:>7.1} ms",
                agent.name,
                through_run.as_secs_f64() * 1000.0,
                baseline.as_secs_f64() * 1000.0
            ));
        }
    }
    println!("one prompt turn, through `oab-runtime run` and started directly:");
    for line in &report {
        println!("  {line}");
    }
}
