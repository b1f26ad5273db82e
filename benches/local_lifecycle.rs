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
//! the plain/direct ratio (target at most 1.3x on ext4, 1.2x on tmpfs), the extra median latency
//! of bubblewrap over plain (target at most 15 ms), and, where valgrind is installed, the
//! broker's instructions per cycle of `direct` and `plain` (callgrind; the difference of a run of
//! [`COUNT_SMALL`] and one of [`COUNT_LARGE`] cycles, so that start-up cancels out). The medians are over every cycle of criterion's measurement
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
/// Set to `<mode>:<count>`, the benchmark only runs `count` cycles of `mode` and exits: what the
/// instruction counts are taken of.
const CYCLES_ENV: &str = "OAB_BENCH_CYCLES";
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
    // As in the runtime cycle, where the attachment's input is gone once the exchange is over.
    drop(sink);
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
///
/// The cycles run in a task of the runtime, as a broker's sessions do, not in the thread that
/// blocks on the runtime.
fn bench_cycles<F, Fut>(
    group: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>,
    tokio: &Runtime,
    name: &str,
    calls: &Calls,
    cycle: F,
) where
    F: Fn(u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Cycle> + Send + 'static,
{
    let counter = AtomicU64::new(0);
    group.bench_function(name, |b| {
        b.to_async(tokio).iter_custom(|iters| {
            let calls = Arc::clone(calls);
            let first = counter.fetch_add(iters, Ordering::Relaxed);
            let cycle = cycle.clone();
            async move {
                let cycles = tokio::spawn(async move {
                    let mut cycles = Vec::new();
                    for n in first..first + iters {
                        cycles.push(cycle(n).await);
                    }
                    cycles
                })
                .await
                .expect("the cycles' task");
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

/// The cycles of the two counted runs; their difference is what one cycle costs.
const COUNT_SMALL: u64 = 2;
const COUNT_LARGE: u64 = 12;

/// Instructions of this (the broker's) process per cycle of `mode`, if valgrind runs here: the
/// difference of two callgrind runs, per extra cycle. The agent (and, on cgroup v2, the shell
/// that joins the cgroups) runs natively and is not counted, alike in both modes.
fn instructions_per_cycle(mode: &str) -> Option<f64> {
    if std::env::var_os("OAB_BENCH_NO_INSTRUCTIONS").is_some() {
        // Repeated timing runs: the counts do not change from run to run.
        return None;
    }
    let count = |cycles: u64| -> Option<u64> {
        let output = std::process::Command::new("valgrind")
            .args(["--tool=callgrind", "--callgrind-out-file=/dev/null"])
            .arg(std::env::current_exe().ok()?)
            .env(CYCLES_ENV, format!("{mode}:{cycles}"))
            .stdout(Stdio::null())
            .output()
            .ok()?;
        if !output.status.success() {
            return None;
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        stderr
            .lines()
            .find_map(|line| line.split("Collected : ").nth(1))
            .and_then(|n| n.trim().parse().ok())
    };
    let (small, large) = (count(COUNT_SMALL)?, count(COUNT_LARGE)?);
    Some(large.saturating_sub(small) as f64 / (COUNT_LARGE - COUNT_SMALL) as f64)
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
    let plain = Arc::new(
        local_runtime(&agent, &scratch.path().join("plain"), SandboxMode::None).expect("plain runtime"),
    );
    let bubblewrap = local_runtime(
        &agent,
        &scratch.path().join("bubblewrap"),
        SandboxMode::Bubblewrap,
    )
    .map(Arc::new);
    let direct = {
        let paths = Arc::new((agent, workspace, state));
        move |_: u64| {
            let paths = Arc::clone(&paths);
            async move { direct_cycle(&paths.0, &paths.1, &paths.2).await }
        }
    };
    let with_runtime = |runtime: &Arc<LocalRuntime>| {
        let runtime = Arc::clone(runtime);
        move |n: u64| {
            let runtime = Arc::clone(&runtime);
            async move { runtime_cycle(&runtime, n).await }
        }
    };
    if let Some(request) = std::env::var_os(CYCLES_ENV) {
        let request = request.to_string_lossy().into_owned();
        let (mode, count) = request.split_once(':').expect("OAB_BENCH_CYCLES=<mode>:<count>");
        let count: u64 = count.parse().expect("a cycle count");
        let mode = mode.to_owned();
        // In a task, as the measured cycles run.
        let cycles = async move {
            for n in 0..count {
                let _cycle = match mode.as_str() {
                    "direct" => direct(n).await,
                    "plain" => with_runtime(&plain)(n).await,
                    "bubblewrap" => {
                        let bubblewrap = bubblewrap.as_ref().expect("bubblewrap works here");
                        with_runtime(bubblewrap)(n).await
                    }
                    other => panic!("unknown mode {other}"),
                };
            }
        };
        tokio.block_on(tokio.spawn(cycles)).expect("the cycles' task");
        return;
    }
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
        bench_cycles(&mut group, &tokio, "direct", &direct_calls, direct);
        bench_cycles(&mut group, &tokio, "plain", &plain_calls, with_runtime(&plain));
        match &bubblewrap {
            Ok(bubblewrap) => bench_cycles(
                &mut group,
                &tokio,
                "bubblewrap",
                &bubblewrap_calls,
                with_runtime(bubblewrap),
            ),
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
            "plain / direct: {:.2}x (target <= 1.3x on ext4, 1.2x on tmpfs)",
            plain.as_secs_f64() / direct.as_secs_f64()
        );
    }
    if let (Some(plain), Some(bubblewrap)) = (plain, bubblewrap) {
        println!(
            "bubblewrap - plain: {:+.2} ms (target <= 15 ms)",
            millis(bubblewrap) - millis(plain)
        );
    }
    match (instructions_per_cycle("direct"), instructions_per_cycle("plain")) {
        (Some(direct), Some(plain)) => println!(
            "broker instructions per cycle (callgrind): direct {direct:.0}, plain {plain:.0}: {:.2}x",
            plain / direct
        ),
        _ => println!("instructions per cycle: not measured (valgrind --tool=callgrind did not run, or OAB_BENCH_NO_INSTRUCTIONS is set)"),
    }
}
