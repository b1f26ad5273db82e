//! The `acp-test-agent` binary: serves the ACP test agent on stdin/stdout.
//!
//! Protocol output goes to stdout only; a short log line per handled message
//! goes to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use acp_test_agent::{serve_with_stderr_log, AgentOptions};

const USAGE: &str = "\
usage: acp-test-agent [OPTIONS]

A scriptable ACP agent for tests (newline-delimited JSON-RPC 2.0 on stdin/stdout).

options:
  --ignore-stdin-eof    keep running after stdin reaches EOF
  --chunks N            default number of chunks per prompt turn (default 3)
  --delay-ms N          default delay between chunks in milliseconds (default 0)
  --state-dir PATH      where sessions are persisted for session/load
                        (default $HOME/.acp-test-agent when HOME is set)
  --exec-dir PATH       working directory for _openab/exec probes
  --name NAME           agentInfo name (default acp-test-agent)
  -h, --help            print this help

prompt directives (at the start of the prompt text):
  /chunks=N /delay_ms=N /size=N /permission
";

/// What the command line asked for.
enum Command {
    Help,
    Serve(AgentOptions),
}

fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Command, String> {
    let mut options = AgentOptions::default();
    let mut state_dir = None;
    let mut args = args.into_iter();
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => (flag.to_owned(), Some(value.to_owned())),
            _ => (arg.clone(), None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            match inline.clone() {
                Some(value) => Ok(value),
                None => args.next().ok_or_else(|| format!("{name} needs a value")),
            }
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(Command::Help),
            "--ignore-stdin-eof" if inline.is_none() => options.ignore_stdin_eof = true,
            "--chunks" => {
                let text = value("--chunks")?;
                options.chunks = text
                    .parse()
                    .map_err(|_| format!("--chunks: not a number: {text:?}"))?;
            }
            "--delay-ms" => {
                let text = value("--delay-ms")?;
                let millis: u64 = text
                    .parse()
                    .map_err(|_| format!("--delay-ms: not a number: {text:?}"))?;
                options.chunk_delay = Duration::from_millis(millis);
            }
            "--state-dir" => state_dir = Some(PathBuf::from(value("--state-dir")?)),
            "--exec-dir" => options.exec_dir = Some(PathBuf::from(value("--exec-dir")?)),
            "--name" => options.name = value("--name")?,
            _ => return Err(format!("unknown argument: {arg}")),
        }
    }
    options.state_dir = state_dir.or_else(|| {
        std::env::var_os("HOME")
            .filter(|home| !home.is_empty())
            .map(|home| PathBuf::from(home).join(".acp-test-agent"))
    });
    Ok(Command::Serve(options))
}

/// Writes to stderr, ignoring failures (a closed stderr must not turn a clean
/// exit code into a panic).
fn complain(message: &str) {
    let _ = write!(std::io::stderr(), "acp-test-agent: {message}");
}

fn main() -> ExitCode {
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(Command::Help) => {
            let _ = std::io::stdout().write_all(USAGE.as_bytes());
            return ExitCode::SUCCESS;
        }
        Ok(Command::Serve(options)) => options,
        Err(message) => {
            complain(&format!("{message}\n{USAGE}"));
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            complain(&format!("cannot start the runtime: {err}\n"));
            return ExitCode::FAILURE;
        }
    };
    let served = runtime.block_on(serve_with_stderr_log(
        tokio::io::stdin(),
        tokio::io::stdout(),
        options,
    ));
    // A blocking stdin read may still be parked on a runtime thread; do not
    // wait for it.
    runtime.shutdown_background();
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            complain(&format!("{err}\n"));
            ExitCode::FAILURE
        }
    }
}
