//! `oab-fault-harness`: a stand-in broker process for the fault tests of the local runtime
//! (`tests/faults.rs`), which kill it with SIGKILL at random points. Built only with the
//! `testing` feature; not meant to be installed.
//!
//! ```text
//! oab-fault-harness ROOT SANDBOX PHASE SEED AGENT [AGENT-ARG]...
//! ```
//!
//! It builds a [`LocalRuntime`] on `ROOT` (installation `faults`, or `$OAB_FAULT_INSTALLATION`;
//! retention: `Ended` retains, `Reset` deletes; `SANDBOX` = `none` or `bubblewrap`; a pids limit
//! of `$OAB_FAULT_PIDS_LIMIT` per session if set) and loops forever over a small pool of
//! sessions (threads `t0` to `t3`, chosen by an xorshift generator seeded with `SEED`):
//! create; attach, ACP `initialize` and an exec that leaves a background grandchild; sometimes
//! suspend and resume, or attach again (replacing the worker); then usually close with `Reset` or
//! `Ended`.
//!
//! It reports each step on stdout, one line each, so the test knows where it was killed:
//!
//! ```text
//! ready
//! <op> start <thread> [<reason>]      op: create | attach | exec | suspend | close
//! <op> done <thread> <microseconds> [fresh]
//! keep <thread> <token>               writing a file `workspace/fault-keep` with <token>...
//! kept <thread>                       ...written (atomically, by a rename)
//! failed <op> <thread> <error>        then it exits with code 2
//! ```
//!
//! Before each operation named `PHASE` it waits for one byte on stdin after its `start` line,
//! so the test can time the kill from the moment the operation begins. It exits when stdin ends.

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use runtime_local::LocalRuntime;
use session_runtime::config::{ResourceLimits, SandboxMode};
use session_runtime::testing::AcpClient;
use session_runtime::{
    AgentCommand, CloseReason, CreateOptions, Retention, RetentionPolicy, SessionIdentity, SessionRuntime,
    SuspendReason,
};

/// The installation of every session the harness makes, unless `OAB_FAULT_INSTALLATION` says.
const INSTALLATION: &str = "faults";
/// How many distinct sessions (threads) the harness cycles through.
const THREADS: u64 = 4;

/// The operations the harness reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Create,
    Attach,
    Exec,
    Suspend,
    Close,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Create => "create",
            Op::Attach => "attach",
            Op::Exec => "exec",
            Op::Suspend => "suspend",
            Op::Close => "close",
        }
    }

    fn parse(name: &str) -> Option<Self> {
        [Op::Create, Op::Attach, Op::Exec, Op::Suspend, Op::Close]
            .into_iter()
            .find(|op| op.name() == name)
    }
}

/// Writes one line to stdout and flushes it (the test reads it at once).
fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Waits for the test's go-ahead: one byte on stdin. `false` at end of input.
async fn go_ahead() -> bool {
    tokio::task::spawn_blocking(|| {
        let mut byte = [0u8; 1];
        matches!(std::io::stdin().lock().read(&mut byte), Ok(1))
    })
    .await
    .unwrap_or(false)
}

struct Harness {
    runtime: Arc<LocalRuntime>,
    installation: String,
    phase: Op,
    rng: StdRng,
    /// Live ACP clients, so their workers keep their stdin open.
    clients: HashMap<u64, AcpClient>,
}

impl Harness {
    fn identity(&self, thread: u64) -> SessionIdentity {
        SessionIdentity::new(
            self.installation.as_str(),
            "agent",
            "faults",
            format!("t{thread}"),
        )
        .expect("a valid identity")
    }

    /// Announces `op`, waits for the go-ahead if it is the phase under test, runs it, and
    /// reports how long it took (and `detail`, e.g. `fresh`). `Err` ends the harness.
    async fn step<T>(
        &mut self,
        op: Op,
        thread: u64,
        note: &str,
        run: impl std::future::Future<Output = session_runtime::Result<T>>,
        detail: impl FnOnce(&T) -> &'static str,
    ) -> Result<T, ()> {
        say(&format!("{} start t{thread}{note}", op.name()));
        if op == self.phase && !go_ahead().await {
            // The test is done with this harness.
            std::process::exit(0);
        }
        let started = Instant::now();
        match run.await {
            Ok(value) => {
                say(&format!(
                    "{} done t{thread} {} {}",
                    op.name(),
                    started.elapsed().as_micros(),
                    detail(&value)
                ));
                Ok(value)
            }
            Err(error) => {
                say(&format!("failed {} t{thread} {error}", op.name()));
                Err(())
            }
        }
    }

    async fn cycle(&mut self) -> Result<(), ()> {
        let thread = self.rng.random_range(0..THREADS);
        let identity = self.identity(thread);
        let id = identity.id();
        let runtime = Arc::clone(&self.runtime);
        let handle = self
            .step(
                Op::Create,
                thread,
                "",
                runtime.create(&identity, &CreateOptions::new()),
                |h| if h.created { "fresh" } else { "existing" },
            )
            .await?;
        if handle.created {
            // A file the test can look for wherever the retention policy says the storage is.
            let token = format!("{:016x}", self.rng.random::<u64>());
            say(&format!("keep t{thread} {token}"));
            let written = match runtime.status(&id).await {
                Ok(status) => match status.storage_refs.first() {
                    Some(base) => {
                        // Atomically, so a kill never leaves a torn token behind.
                        let workspace = PathBuf::from(base).join("workspace");
                        let temporary = workspace.join("fault-keep.tmp");
                        std::fs::write(&temporary, &token)
                            .and_then(|()| std::fs::rename(&temporary, workspace.join("fault-keep")))
                            .map_err(|e| e.to_string())
                    }
                    None => Err("status names no storage".to_owned()),
                },
                Err(error) => Err(error.to_string()),
            };
            if let Err(error) = written {
                say(&format!("failed keep t{thread} {error}"));
                return Err(());
            }
            say(&format!("kept t{thread}"));
        }
        self.attach(thread).await?;
        match self.rng.random_range(0..4) {
            0 => {
                self.clients.remove(&thread);
                self.step(
                    Op::Suspend,
                    thread,
                    "",
                    runtime.suspend(&id, SuspendReason::Idle),
                    |_| "",
                )
                .await?;
                if self.rng.random_range(0..2) == 0 {
                    self.attach(thread).await?;
                }
            }
            1 => self.attach(thread).await?,
            _ => {}
        }
        if self.rng.random_range(0..4) != 0 {
            let reason = if self.rng.random_range(0..2) == 0 {
                CloseReason::Reset
            } else {
                CloseReason::Ended
            };
            self.clients.remove(&thread);
            self.step(
                Op::Close,
                thread,
                &format!(" {reason}"),
                runtime.close(&id, reason),
                |_| "",
            )
            .await?;
        }
        Ok(())
    }

    /// Attach, then `initialize` and an exec whose background `sleep` outlives the shell (a
    /// grandchild the runtime must reclaim with the worker).
    async fn attach(&mut self, thread: u64) -> Result<(), ()> {
        let id = self.identity(thread).id();
        let runtime = Arc::clone(&self.runtime);
        let attachment = self
            .step(Op::Attach, thread, "", runtime.attach(&id), |_| "")
            .await?;
        let client = AcpClient::new(attachment);
        let exec = async {
            client
                .initialize()
                .await
                .map_err(|e| session_runtime::Error::InvalidArgument {
                    reason: e.to_string(),
                })?;
            client
                .exec("sleep 300 >/dev/null 2>&1 & echo started")
                .await
                .map_err(|e| session_runtime::Error::InvalidArgument {
                    reason: e.to_string(),
                })
        };
        self.step(Op::Exec, thread, "", exec, |_| "").await?;
        self.clients.insert(thread, client);
        Ok(())
    }
}

fn usage() -> ExitCode {
    eprintln!("usage: oab-fault-harness ROOT none|bubblewrap create|attach|close SEED AGENT [AGENT-ARG]...");
    ExitCode::from(64)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [root, sandbox, phase, seed, agent, agent_args @ ..] = args.as_slice() else {
        return usage();
    };
    let sandbox = match sandbox.as_str() {
        "none" => SandboxMode::None,
        "bubblewrap" => SandboxMode::Bubblewrap,
        _ => return usage(),
    };
    let (Some(phase), Ok(seed)) = (Op::parse(phase), seed.parse::<u64>()) else {
        return usage();
    };
    let mut retention = RetentionPolicy::default();
    retention.reset = Retention::Delete;
    retention.ended = Retention::Retain;
    let installation = std::env::var("OAB_FAULT_INSTALLATION").unwrap_or_else(|_| INSTALLATION.to_owned());
    let mut builder =
        LocalRuntime::builder(AgentCommand::new(agent.as_str()).args(agent_args.iter().cloned()))
            .root(root)
            .installation(installation.as_str())
            .sandbox(sandbox)
            .retention(retention)
            .idle_ttl(None)
            .terminate_grace(Duration::from_millis(500));
    if let Some(pids) = std::env::var("OAB_FAULT_PIDS_LIMIT")
        .ok()
        .and_then(|p| p.parse().ok())
    {
        let mut limits = ResourceLimits::default();
        limits.pids = Some(pids);
        builder = builder.limits(limits);
    }
    let runtime = builder.build();
    let runtime = match runtime {
        Ok(runtime) => Arc::new(runtime),
        Err(error) => {
            say(&format!("failed build - {error}"));
            return ExitCode::from(2);
        }
    };
    let tokio = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(tokio) => tokio,
        Err(error) => {
            eprintln!("oab-fault-harness: {error}");
            return ExitCode::FAILURE;
        }
    };
    let mut harness = Harness {
        runtime,
        installation,
        phase,
        rng: StdRng::seed_from_u64(seed),
        clients: HashMap::new(),
    };
    say("ready");
    let failed = tokio.block_on(async {
        loop {
            if harness.cycle().await.is_err() {
                break true;
            }
        }
    });
    tokio.shutdown_background();
    if failed {
        ExitCode::from(2)
    } else {
        ExitCode::SUCCESS
    }
}
