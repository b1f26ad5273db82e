//! Lifecycle latency of the local session runtime, against a baseline measured in the same run.
//!
//! One cycle starts the `acp-test-agent`, runs `initialize`, `session/new` and a one-chunk
//! `session/prompt` until the first `session/update` arrives, then stops the agent:
//!
//! - `direct` (the baseline): the agent spawned with `tokio::process`, the exchange on its pipes,
//!   then killed and reaped;
//! - `plain`: `LocalRuntime` (`sandbox = "none"`) `create` + `attach`, the same exchange over the
//!   attachment, then `close(Reset)` (which stops the worker and deletes the session's storage);
//! - `bubblewrap`: the same with `sandbox = "bubblewrap"` (skipped, with a note, where bubblewrap
//!   does not work).
//!
//! Run: `cargo bench --bench local_lifecycle`. At the end it prints the median cycle of each mode,
//! the plain/direct ratio (target at most 1.2x) and the extra median latency of bubblewrap over
//! plain (target at most 15 ms). The medians are over every cycle of criterion's measurement
//! samples (the warm-up is left out), whole and by phase (`create`, `start`: spawn or `attach`,
//! `exchange`, `stop`: kill or `close`).
//!
//! The runtimes' roots are in a temporary directory under `TMPDIR` (default `/tmp`): session
//! records are written with fsync, so the file system there weighs on the result (e.g.
//! `TMPDIR=/dev/shm` shows the cost without durable writes).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use criterion::{BenchmarkGroup, Criterion, SamplingMode};
use runtime_local::LocalRuntime;
use serde_json::{json, Value};
use session_runtime::config::SandboxMode;
use session_runtime::testing::acp_test_agent_binary;
use session_runtime::{AgentCommand, CloseReason, CreateOptions, SessionIdentity, SessionRuntime};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader, Lines};
use tokio::process::{ChildStdin, Command};
use tokio::runtime::Runtime;

/// Criterion samples per mode; the medians are taken over the cycles of these samples.
const SAMPLES: usize = 20;
/// The prompt: one chunk, so the turn's first update is also its only one.
const PROMPT: &str = "/chunks=1 lifecycle";
/// The installation the benchmark's sessions belong to.
const INSTALLATION: &str = "bench";

/// The phases of a cycle, in order. The baseline has no `create`; its `start` is the spawn, its
/// `stop` the kill and reap. A runtime cycle's `start` is `attach`, its `stop` is `close`.
const PHASES: [&str; 4] = ["create", "start", "exchange", "stop"];

/// How long each phase of one cycle took.
type Cycle = [Duration; PHASES.len()];

/// Every cycle, one vector per call of the measured routine.
type Calls = Arc<Mutex<Vec<Vec<Cycle>>>>;

/// Times consecutive phases.
struct Laps {
    last: Instant,
    cycle: Cycle,
}

impl Laps {
    fn start() -> Self {
        Self {
            last: Instant::now(),
            cycle: Cycle::default(),
        }
    }

    /// Ends phase `index`, which began where the previous one ended.
    fn lap(&mut self, index: usize) {
        let now = Instant::now();
        self.cycle[index] = now - self.last;
        self.last = now;
    }
}

/// Where one side of the exchange writes its lines.
enum Sink {
    /// The agent's stdin pipe.
    Pipe(ChildStdin),
    /// An attachment's line writer.
    Attached(session_runtime::AgentInput),
}

impl Sink {
    async fn send(&mut self, message: Value) {
        let mut line = message.to_string();
        match self {
            Sink::Pipe(stdin) => {
                line.push('\n');
                stdin
                    .write_all(line.as_bytes())
                    .await
                    .expect("writing to the agent");
            }
            Sink::Attached(input) => input.write_line(line).await.expect("writing to the agent"),
        }
    }
}

/// Reads lines until the response to request `id` and returns its result.
async fn response<R: AsyncRead + Unpin>(lines: &mut Lines<BufReader<R>>, id: u64) -> Value {
    loop {
        let line = lines
            .next_line()
            .await
            .expect("reading the agent's output")
            .expect("the agent's output ended");
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if message.get("id").and_then(Value::as_u64) == Some(id) && message.get("method").is_none() {
            assert!(message.get("error").is_none(), "request {id} failed: {line}");
            return message.get("result").cloned().unwrap_or(Value::Null);
        }
    }
}

/// `initialize`, `session/new` in `cwd`, and a prompt until its first `session/update`.
async fn exchange<R: AsyncRead + Unpin>(output: R, sink: &mut Sink, cwd: &str) {
    let mut lines = BufReader::new(output).lines();
    sink.send(json!({"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": 1, "clientCapabilities": {}}}))
        .await;
    response(&mut lines, 1).await;
    sink.send(json!({"jsonrpc": "2.0", "id": 2, "method": "session/new",
        "params": {"cwd": cwd, "mcpServers": []}}))
        .await;
    let session = response(&mut lines, 2).await["sessionId"]
        .as_str()
        .expect("a session id")
        .to_owned();
    sink.send(json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt",
        "params": {"sessionId": session, "prompt": [{"type": "text", "text": PROMPT}]}}))
        .await;
    loop {
        let line = lines
            .next_line()
            .await
            .expect("reading the agent's output")
            .expect("the agent's output ended before the first chunk");
        let Ok(message) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        if message.get("method").and_then(Value::as_str) == Some("session/update") {
            return;
        }
    }
}

/// The baseline cycle: spawn, exchange, kill, reap.
async fn direct_cycle(agent: &Path, workspace: &Path, state: &Path) -> Cycle {
    let mut laps = Laps::start();
    laps.lap(0);
    let mut child = Command::new(agent)
        .arg("--state-dir")
        .arg(state)
        .current_dir(workspace)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawning the agent");
    let output = child.stdout.take().expect("stdout");
    let mut sink = Sink::Pipe(child.stdin.take().expect("stdin"));
    laps.lap(1);
    exchange(output, &mut sink, &workspace.display().to_string()).await;
    laps.lap(2);
    child.start_kill().expect("killing the agent");
    child.wait().await.expect("reaping the agent");
    laps.lap(3);
    laps.cycle
}

/// The runtime cycle: create, attach, exchange, close with `Reset`.
async fn runtime_cycle(runtime: &LocalRuntime, thread: u64) -> Cycle {
    let identity =
        SessionIdentity::new(INSTALLATION, "agent", "bench", format!("t{thread}")).expect("identity");
    let id = identity.id();
    let mut laps = Laps::start();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    laps.lap(0);
    let attachment = runtime.attach(&id).await.expect("attach");
    laps.lap(1);
    let cwd = attachment.working_dir().to_owned();
    let (output, input, _control) = attachment.into_split();
    exchange(output, &mut Sink::Attached(input), &cwd).await;
    laps.lap(2);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
    laps.lap(3);
    laps.cycle
}

/// Builds a runtime in `sandbox` mode whose storage lives under `root`.
fn local_runtime(agent: &Path, root: &Path, sandbox: SandboxMode) -> session_runtime::Result<LocalRuntime> {
    LocalRuntime::builder(AgentCommand::new(agent.display().to_string()))
        .root(root)
        .installation(INSTALLATION)
        .sandbox(sandbox)
        .build()
}

/// Benchmarks `cycle` as `name` in `group`, recording the duration of every cycle in `calls`.
fn bench_cycles<F, Fut>(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    tokio: &Runtime,
    name: &str,
    calls: &Calls,
    cycle: F,
) where
    F: Fn(u64) -> Fut + Copy,
    Fut: std::future::Future<Output = Cycle>,
{
    let counter = AtomicU64::new(0);
    group.bench_function(name, |b| {
        b.to_async(tokio).iter_custom(|iters| {
            let calls = Arc::clone(calls);
            let first = counter.fetch_add(iters, Ordering::Relaxed);
            async move {
                let mut cycles = Vec::new();
                for n in first..first + iters {
                    cycles.push(cycle(n).await);
                }
                let total = cycles.iter().flatten().sum();
                calls.lock().expect("samples").push(cycles);
                total
            }
        });
    });
}

/// The medians of the measured cycles, whole and by phase. The measured cycles are those of the
/// last [`SAMPLES`] calls (criterion calls the routine for its warm-up first). `None` when there
/// were fewer calls (test mode, or the benchmark was filtered out).
fn medians(calls: &Calls) -> Option<(Duration, Cycle)> {
    let calls = calls.lock().expect("samples");
    let measured: Vec<Cycle> = calls
        .get(calls.len().checked_sub(SAMPLES)?..)?
        .iter()
        .flatten()
        .copied()
        .collect();
    let whole = median(measured.iter().map(|cycle| cycle.iter().sum()).collect())?;
    let mut phases = Cycle::default();
    for (index, phase) in phases.iter_mut().enumerate() {
        *phase = median(measured.iter().map(|cycle| cycle[index]).collect())?;
    }
    Some((whole, phases))
}

fn median(mut values: Vec<Duration>) -> Option<Duration> {
    values.sort_unstable();
    let mid = values.len() / 2;
    match values.len() {
        0 => None,
        n if n % 2 == 1 => Some(values[mid]),
        _ => Some((values[mid - 1] + values[mid]) / 2),
    }
}

fn millis(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

fn main() {
    let agent: PathBuf = acp_test_agent_binary().expect("the acp-test-agent binary");
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let scratch = tempfile::tempdir().expect("scratch directory");
    let workspace = scratch.path().join("workspace");
    let state = scratch.path().join("state");
    for dir in [&workspace, &state] {
        std::fs::create_dir_all(dir).expect("scratch directories");
    }
    let plain =
        local_runtime(&agent, &scratch.path().join("plain"), SandboxMode::None).expect("plain runtime");
    let bubblewrap = local_runtime(
        &agent,
        &scratch.path().join("bubblewrap"),
        SandboxMode::Bubblewrap,
    );
    let (direct_calls, plain_calls, bubblewrap_calls) =
        (Calls::default(), Calls::default(), Calls::default());

    let mut criterion = Criterion::default().configure_from_args();
    {
        let mut group = criterion.benchmark_group("local_lifecycle");
        group
            .sampling_mode(SamplingMode::Flat)
            .sample_size(SAMPLES)
            .warm_up_time(Duration::from_secs(2))
            .measurement_time(Duration::from_secs(10));
        bench_cycles(&mut group, &tokio, "direct", &direct_calls, |_| {
            direct_cycle(&agent, &workspace, &state)
        });
        bench_cycles(&mut group, &tokio, "plain", &plain_calls, |n| {
            runtime_cycle(&plain, n)
        });
        match &bubblewrap {
            Ok(bubblewrap) => bench_cycles(&mut group, &tokio, "bubblewrap", &bubblewrap_calls, |n| {
                runtime_cycle(bubblewrap, n)
            }),
            Err(error) => println!("bubblewrap: not measured, it does not work here: {error}"),
        }
        group.finish();
    }
    criterion.final_summary();

    let (direct, plain, bubblewrap) = (
        medians(&direct_calls),
        medians(&plain_calls),
        medians(&bubblewrap_calls),
    );
    for (name, medians) in [("direct", direct), ("plain", plain), ("bubblewrap", bubblewrap)] {
        if let Some((whole, phases)) = medians {
            let phases: Vec<String> = PHASES
                .iter()
                .zip(phases)
                .map(|(phase, median)| format!("{phase} {:.2}", millis(median)))
                .collect();
            println!(
                "{name}: median cycle {:.2} ms (phase medians, ms: {})",
                millis(whole),
                phases.join(", ")
            );
        }
    }
    let (direct, plain, bubblewrap) = (
        direct.map(|(whole, _)| whole),
        plain.map(|(whole, _)| whole),
        bubblewrap.map(|(whole, _)| whole),
    );
    if let (Some(direct), Some(plain)) = (direct, plain) {
        println!(
            "plain / direct: {:.2}x (target <= 1.2x)",
            plain.as_secs_f64() / direct.as_secs_f64()
        );
    }
    if let (Some(plain), Some(bubblewrap)) = (plain, bubblewrap) {
        println!(
            "bubblewrap - plain: {:+.2} ms (target <= 15 ms)",
            millis(bubblewrap) - millis(plain)
        );
    }
}
