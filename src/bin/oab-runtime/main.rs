//! `oab-runtime`: the operator's tool for OpenAB session runtimes.
//!
//! It reads an OpenAB configuration file (`[agent]` and `[session_runtime]`; with none, the local
//! runtime with sandbox `auto`) and proves isolation (`verify`), runs a session by hand (`run`),
//! and inspects and manages sessions (`ls`, `status`, `suspend`, `close`, `gc`).

mod commands;
mod controller;
mod cwd;
mod run;
mod settings;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// Operate OpenAB session runtimes: prove isolation, run and manage sessions.
#[derive(Debug, Parser)]
#[command(name = "oab-runtime", version)]
struct Cli {
    /// An OpenAB configuration file (`[agent]`, `[session_runtime]`); default: the local runtime,
    /// sandbox `auto`.
    #[arg(long, short, global = true, value_name = "FILE")]
    config: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Prove that two sessions cannot reach each other's files (the RFC's acceptance test, run from
    /// a shell inside each session). Exit code 0 only if every probe was denied.
    Verify {
        /// Keep session storage under this root instead of a fresh temporary directory (when the
        /// configuration names no root).
        #[arg(long, value_name = "DIR")]
        root: Option<PathBuf>,
        /// A file every session sees read-only (a skill the profile mounts, for `type =
        /// "kubernetes"`): the suite checks both sessions can read it and neither can change it.
        /// The local runtime makes its own.
        #[arg(long, value_name = "PATH")]
        shared_input: Option<String>,
    },
    /// Create (or reuse) the session of a thread, attach, and pipe the agent's ACP stdio to this
    /// terminal. Ends, always suspending the session first, when the agent ends (exit status: the
    /// agent's), when stdin has ended and the agent's output falls quiet for two seconds (0), or on
    /// SIGTERM, SIGHUP or SIGINT (128 + the signal). 127 if the agent cannot be started.
    Run {
        /// The platform part of the identity, e.g. `discord`.
        #[arg(long)]
        platform: String,
        /// The thread id.
        #[arg(long)]
        thread: String,
        /// The agent part of the identity.
        #[arg(long, default_value = "default")]
        agent: String,
        /// An environment variable of the agent: `KEY=VALUE` sets it, `KEY` passes this shell's
        /// value through. Repeatable. The runtime clears the agent's environment: it sees only
        /// `[agent].env`, `[agent].inherit_env` and these (and its own `HOME`, `TMPDIR`, `PATH`, `USER`).
        #[arg(long = "env", value_name = "KEY[=VALUE]")]
        env: Vec<String>,
        /// Send the `cwd` of `session/new` and `session/load` requests unchanged. Without it, `run`
        /// replaces it with the session's working directory as the agent sees it (a host path of
        /// this shell's means nothing inside a session), and says so once on stderr.
        #[arg(long)]
        keep_cwd: bool,
        /// The agent command, overriding `[agent]`'s command and arguments (its `env`,
        /// `inherit_env` and `needs` still apply, also when `[agent]` has no `command`).
        #[arg(last = true, value_name = "AGENT ARGV")]
        argv: Vec<String>,
    },
    /// List sessions.
    Ls,
    /// Show one session.
    Status {
        /// The session id (20 characters).
        id: String,
    },
    /// Release a session's compute and keep its storage.
    Suspend {
        /// The session id.
        id: String,
        /// Why.
        #[arg(long, value_enum, default_value_t = SuspendArg::Idle)]
        reason: SuspendArg,
    },
    /// End a session and apply the retention policy for the reason. A session that does not exist
    /// is reported as such ("nothing to close"), with exit status 0: closing is idempotent.
    Close {
        /// The session id.
        id: String,
        /// Why.
        #[arg(long, value_enum)]
        reason: CloseArg,
    },
    /// Reconcile: kill orphaned workers, finish interrupted closes, suspend idle sessions, expire
    /// retained storage.
    Gc,
    /// Reconcile a Kubernetes installation continuously while holding its leader Lease (one
    /// controller acts at a time; run two for a quick takeover). Needs `type = "kubernetes"` and a
    /// build with the `kubernetes` feature. SIGTERM, SIGINT or SIGHUP gives the Lease up and exits.
    Controller {
        /// This candidate's name in the Lease (default: `$POD_NAME` or the host name, and the pid).
        #[arg(long)]
        holder: Option<String>,
        /// How often a full pass runs while leading (idle, retention and orphan rules act at most
        /// this late).
        #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
        resync: std::time::Duration,
        /// How long a term lasts without a renewal; a vanished leader is replaced after it.
        #[arg(long, default_value = "15s", value_parser = humantime::parse_duration)]
        lease_duration: std::time::Duration,
        /// Where to serve /metrics (Prometheus text format), /healthz and /readyz, e.g.
        /// `0.0.0.0:9090` (default: not served).
        #[arg(long)]
        metrics_listen: Option<std::net::SocketAddr>,
    },
    /// Suspends session ID once its stdin ends without a `done` line: `run` starts it and holds
    /// its stdin, so a `run` killed by SIGKILL (which cannot suspend its session itself) leaves
    /// no agent running. Used by `run`.
    #[command(name = "__run-guard", hide = true)]
    RunGuard {
        /// The session `run` attached.
        id: String,
    },
    /// Runs the bundled ACP test agent on stdio (used by `verify`).
    #[command(name = "__acp-test-agent", hide = true)]
    TestAgent {
        /// Arguments of the test agent.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum SuspendArg {
    Idle,
    Capacity,
    Shutdown,
    Hung,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum CloseArg {
    Reset,
    Ended,
    Expired,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Command::TestAgent { args } = &cli.command {
        return commands::test_agent(args);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("OAB_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("oab-runtime: cannot start: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(commands::dispatch(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("oab-runtime: {}", with_causes(error.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// `error` and every cause in its chain that its message does not already show.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        let shown = inner.to_string();
        if !text.contains(&shown) {
            text = format!("{text}: {shown}");
        }
        cause = inner.source();
    }
    text
}
