//! `oab-runtime run`: one session's agent on this terminal, for as long as the agent, the
//! terminal's input, or the operator (a signal) lets it run.
//!
//! `run` ends when the first of these happens, and always suspends the session before it exits:
//!
//! | what happened | exit status |
//! |---|---|
//! | the agent ended (exited, or closed its output) | the agent's: its code, `128 + signal` if killed, 137 if killed for exceeding its memory limit; 0 only for a clean exit |
//! | stdin ended, then the agent's output fell quiet | 0 |
//! | SIGTERM, SIGHUP or SIGINT reached `run` | `128 + signal` |
//! | the agent could not be started | 127 |
//!
//! Nothing the agent started outlives `run`: `run` is the subreaper of everything below it, and
//! kills what is left there once the session is suspended.
//!
//! A `run` killed by SIGKILL cannot suspend its session itself. Its guard does: a second
//! `oab-runtime` process (`__run-guard ID`, in a process group of its own so a terminal's
//! signals do not reach it) that `run` starts before it creates the session and tells when it is
//! done; if its stdin (held only by `run`) ends without that, `run` died, and the guard suspends
//! the session, which stops the agent and everything it started, in every sandbox mode. `run`
//! tells it the generation its attach starts (before the attach, and again after it), and the
//! guard suspends only a session still at that generation: never the worker of a later `run` of
//! the same thread.
//!
//! Every line of stdin reaches the agent byte for byte, not UTF-8 included (JSON-RPC over ACP is
//! UTF-8, but `run` does not judge: the agent reports what it cannot parse); only blank lines,
//! which carry no message, are left out. The one exception: the `cwd` of `session/new` and
//! `session/load` requests is replaced with the session's working directory, as the agent sees
//! it (see [`crate::cwd`]; said once on stderr), unless `--keep-cwd` is given. If the agent stops
//! taking input, `run` says how many lines it did not get.

use std::io::BufRead;
use std::process::ExitCode;
use std::time::Duration;

use openab_runtime::{
    AgentCommand, AgentInput, AgentOutput, CreateOptions, Error, SessionIdentity, SuspendReason, WorkerExit,
    WorkerFailure,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{signal, Signal, SignalKind};
use tokio::sync::mpsc;

use crate::commands::{runtime, Outcome};
use crate::cwd::CwdRewrite;
use crate::settings::Settings;

/// How long `run` keeps relaying the agent's output after its own stdin ended, once the agent
/// falls quiet: real agents keep running at stdin EOF.
const DRAIN_AFTER_STDIN_EOF: Duration = Duration::from_secs(2);

/// How long an agent that closed its output gets to exit on its own before it is stopped.
const EXIT_AFTER_OUTPUT_END: Duration = Duration::from_secs(2);

/// How long output still buffered in the pipe is relayed after the agent exited (a process the
/// agent left behind may hold the pipe open).
const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

/// The exit status for an agent that could not be started, as a shell reports it.
const EXIT_NOT_STARTED: u8 = 127;

/// Lines of stdin buffered ahead of the agent.
const STDIN_LINES_AHEAD: usize = 16;

/// Why the relay between the terminal and the agent stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// The agent's output ended.
    OutputEnded,
    /// The agent's process exited.
    AgentExited,
    /// Stdin ended and the agent then fell quiet.
    StdinEndedAndQuiet,
    /// This signal reached `run`.
    Signal(i32),
    /// Writing the agent's output to stdout failed.
    StdoutFailed,
}

/// The agent `run` starts: `-- ARGV` replaces the configured command and arguments but keeps
/// `[agent]`'s environment rules and `needs` (also when `[agent]` names no command), and each
/// `--env` adds one (`KEY=VALUE` sets, `KEY` inherits). Without `-- ARGV`, `[agent]` must name a
/// command; without `[agent]` the bundled test agent runs.
fn agent_command(settings: &Settings, argv: Vec<String>, env: &[String]) -> Result<AgentCommand, Error> {
    let mut agent = match (argv.split_first(), &settings.agent) {
        (Some((program, args)), Some(configured)) => configured.with_argv(program, args),
        (Some((program, args)), None) => AgentCommand::new(program).args(args.iter().cloned()),
        (None, Some(configured)) => configured.command().ok_or_else(|| Error::InvalidConfig {
            key: "agent.command".into(),
            reason: "[agent] names no command, and `run` was given none after `--`: set \
                     agent.command, or give the agent's command as `run ... -- PROGRAM ARGS...` \
                     (it keeps [agent]'s env, inherit_env and needs)"
                .into(),
        })?,
        (None, None) => crate::commands::bundled_test_agent()?,
    };
    for entry in env {
        let (key, value) = match entry.split_once('=') {
            Some((key, value)) => (key, Some(value)),
            None => (entry.as_str(), None),
        };
        if key.is_empty() || key.contains('\0') || value.is_some_and(|v| v.contains('\0')) {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "--env {entry:?}: expected KEY=VALUE or KEY, with a non-empty KEY and no NUL byte"
                ),
            });
        }
        match value {
            Some(value) => {
                agent.env.insert(key.to_owned(), value.to_owned());
            }
            None => agent.inherit_env.push(key.to_owned()),
        }
    }
    Ok(agent)
}

pub(crate) async fn run(
    settings: Settings,
    platform: &str,
    thread: &str,
    agent_name: &str,
    argv: Vec<String>,
    env: &[String],
    keep_cwd: bool,
) -> Outcome {
    let agent = agent_command(&settings, argv, env)?;
    // Before anything starts: a signal from here on suspends what was started.
    let mut signals = StopSignals::install()?;
    // Whatever the agent leaves behind when its parent exits is reparented to `run` instead of
    // PID 1, so that `run` can still end it (where no cgroup of the session holds it).
    if let Err(error) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
        eprintln!("oab-runtime: cannot adopt the agent's orphans: {error}");
    }
    let runtime = runtime(&settings, Some(agent))?;
    let identity = SessionIdentity::new(
        settings.runtime.installation.as_str(),
        agent_name,
        platform,
        thread,
    )?;
    let mut guard = Guard::start(&settings, &identity.id());
    let handle = runtime.create(&identity, &CreateOptions::new()).await?;
    eprintln!(
        "session {} ({}, generation {}); attaching...",
        handle.id,
        if handle.created { "created" } else { "existing" },
        handle.generation
    );
    if let Some(guard) = guard.as_mut() {
        guard.expect(handle.generation + 1);
    }
    let attachment = match runtime.attach(&handle.id).await {
        Ok(attachment) => attachment,
        Err(
            error @ Error::WorkerFailed {
                cause: WorkerFailure::Spawn(_),
                ..
            },
        ) => {
            eprintln!("oab-runtime: {error}");
            return Ok(ExitCode::from(EXIT_NOT_STARTED));
        }
        Err(error) => return Err(error.into()),
    };
    eprintln!(
        "attached: worker {} generation {}, cwd {}; speak ACP on stdin (one JSON-RPC message per line)",
        attachment.control().worker_id(),
        attachment.generation(),
        attachment.working_dir()
    );
    if let Some(guard) = guard.as_mut() {
        guard.expect(attachment.generation());
    }
    let rewrite = (!keep_cwd).then(|| CwdRewrite::new(attachment.working_dir()));
    let (mut output, input, control) = attachment.into_split();
    let mut to_agent = tokio::spawn(forward_stdin(stdin_lines(), input, rewrite));
    let mut stdout = tokio::io::stdout();
    let mut stdin_ended = false;
    let mut buffer = vec![0u8; 64 * 1024];
    let ending = loop {
        let quiet_limit = stdin_ended.then_some(DRAIN_AFTER_STDIN_EOF);
        tokio::select! {
            number = signals.next() => break Ending::Signal(number),
            _ = &mut to_agent, if !stdin_ended => stdin_ended = true,
            _ = control.wait() => break Ending::AgentExited,
            read = read_within(&mut output, &mut buffer, quiet_limit) => match read {
                Ok(Some(0)) => break Ending::OutputEnded,
                Ok(Some(n)) => {
                    if relay(&mut stdout, &buffer[..n]).await.is_err() {
                        break Ending::StdoutFailed;
                    }
                }
                Ok(None) => break Ending::StdinEndedAndQuiet,
                Err(error) => {
                    eprintln!("oab-runtime: reading the agent's output: {error}");
                    break Ending::OutputEnded;
                }
            },
        }
    };
    match ending {
        Ending::AgentExited => drain(&mut output, &mut stdout, &mut buffer).await,
        Ending::OutputEnded => {
            let _ = tokio::time::timeout(EXIT_AFTER_OUTPUT_END, control.wait()).await;
        }
        _ => {}
    }
    let _ = stdout.flush().await;
    to_agent.abort();
    // How the agent ended before `run` stopped it, if it did.
    let ended_alone = if control.is_alive() {
        None
    } else {
        control.wait().await.ok()
    };
    drop(output);
    eprintln!(
        "session {}: {}; suspending",
        handle.id,
        describe(ending, ended_alone)
    );
    let suspended = runtime.suspend(&handle.id, SuspendReason::Shutdown).await;
    drop(guard);
    kill_adopted_orphans();
    suspended?;
    eprintln!("session {} suspended", handle.id);
    Ok(ExitCode::from(exit_status(ending, ended_alone)))
}

/// What `run` tells its guard when it ends by itself.
const GUARD_DONE: &str = "done";
/// How long the guard waits for a `run` whose pipe closed to finish exiting.
const GUARD_WAIT_FOR_EXIT: Duration = Duration::from_secs(5);
/// How `run` tells its guard the generation to suspend: this, then the number.
const GUARD_GENERATION: &str = "generation ";

/// `run`'s guard (see the module documentation), told `done` when dropped: on every way out of
/// `run` but SIGKILL.
struct Guard {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
}

impl Guard {
    /// Starts the guard of session `id`; `None` (said on stderr) if it cannot start: `run` then
    /// works as before, and a SIGKILL leaves its agent to `gc`.
    fn start(settings: &Settings, id: &openab_runtime::SessionId) -> Option<Guard> {
        use std::os::unix::process::CommandExt;
        let started = std::env::current_exe().and_then(|exe| {
            let mut command = std::process::Command::new(exe);
            if let Some(path) = &settings.path {
                command.arg("--config").arg(path);
            }
            command
                .arg("__run-guard")
                .arg(id.to_string())
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::null())
                .process_group(0)
                .spawn()
        });
        match started {
            Ok(mut child) => Some(Guard {
                stdin: child.stdin.take(),
                child,
            }),
            Err(error) => {
                eprintln!(
                    "oab-runtime: cannot start the guard that suspends the session if run is killed: {error}; \
                     after a SIGKILL, `oab-runtime gc` stops the agent"
                );
                None
            }
        }
    }
}

impl Guard {
    /// Tells the guard the generation of the worker it is to stop.
    fn expect(&mut self, generation: openab_runtime::Generation) {
        use std::io::Write;
        if let Some(stdin) = self.stdin.as_mut() {
            let _ = writeln!(stdin, "{GUARD_GENERATION}{generation}");
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        use std::io::Write;
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "{GUARD_DONE}");
        }
        let _ = self.child.wait();
    }
}

/// `__run-guard ID`: waits for its stdin to end; unless `run` said `done` first, suspends the
/// session if it is still at the generation `run` named last (see the module documentation).
pub(crate) async fn guard(settings: &Settings, id: &str) -> crate::commands::Outcome {
    let id = openab_runtime::SessionId::parse(id.trim())?;
    let run = rustix::process::getppid();
    let mut said = Vec::new();
    let mut stdin = tokio::io::stdin();
    // Ends at EOF: `run` closed it (after `done`) or died.
    let _ = stdin.read_to_end(&mut said).await;
    let said = String::from_utf8_lossy(&said);
    if said.lines().any(|line| line == GUARD_DONE) {
        return Ok(ExitCode::SUCCESS);
    }
    // A dying process closes its descriptors one by one (this pipe may close before the
    // session's lock): wait until it is reparented. That may still come before its last thread
    // closed the lock; the local runtime's suspend waits for a lock a dead broker left.
    let deadline = std::time::Instant::now() + GUARD_WAIT_FOR_EXIT;
    while run.is_some() && rustix::process::getppid() == run && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let Some(generation) = said.lines().rev().find_map(|line| {
        line.strip_prefix(GUARD_GENERATION)?
            .parse::<openab_runtime::Generation>()
            .ok()
    }) else {
        // `run` died before it attached: it started no worker.
        return Ok(ExitCode::SUCCESS);
    };
    let runtime = runtime(settings, None)?;
    let status = runtime.status(&id).await?;
    if status.generation != generation || status.state != openab_runtime::SessionState::Running {
        // Not (or no longer) the worker `run` started.
        return Ok(ExitCode::SUCCESS);
    }
    eprintln!("oab-runtime: run of session {id} ended without suspending it (killed?); suspending it");
    runtime.suspend(&id, SuspendReason::Shutdown).await?;
    eprintln!("session {id} suspended");
    Ok(ExitCode::SUCCESS)
}

/// The signals that end `run`: each suspends the session, then `run` exits.
struct StopSignals {
    terminate: Signal,
    hangup: Signal,
    interrupt: Signal,
}

impl StopSignals {
    fn install() -> std::io::Result<Self> {
        Ok(Self {
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
            interrupt: signal(SignalKind::interrupt())?,
        })
    }

    /// The number of the next signal that arrives.
    async fn next(&mut self) -> i32 {
        tokio::select! {
            _ = self.terminate.recv() => SignalKind::terminate().as_raw_value(),
            _ = self.hangup.recv() => SignalKind::hangup().as_raw_value(),
            _ = self.interrupt.recv() => SignalKind::interrupt().as_raw_value(),
        }
    }
}

/// Stdin, line by line, as raw bytes (a trailing newline kept).
///
/// Read on a thread of its own, not Tokio's: a blocking read of a terminal cannot be cancelled,
/// and Tokio's runtime waits for its blocking tasks when it shuts down, so `run` would wait for
/// one more line (or EOF) before it could exit after its agent ended.
fn stdin_lines() -> mpsc::Receiver<std::io::Result<Vec<u8>>> {
    let (sender, receiver) = mpsc::channel(STDIN_LINES_AHEAD);
    let spawned = std::thread::Builder::new().name("stdin".into()).spawn(move || {
        let mut stdin = std::io::stdin().lock();
        loop {
            let mut line = Vec::new();
            let read = match stdin.read_until(b'\n', &mut line) {
                Ok(0) => return,
                Ok(_) => Ok(line),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => Err(e),
            };
            let failed = read.is_err();
            if sender.blocking_send(read).is_err() || failed {
                return;
            }
        }
    });
    if let Err(error) = spawned {
        eprintln!("oab-runtime: cannot read stdin: {error}");
    }
    receiver
}

/// Writes every line from `lines` to the agent, unchanged but for what `rewrite` replaces, then
/// closes the agent's stdin. Returns when stdin ended or the agent stopped taking input (said on
/// stderr, with how many lines it did not get).
async fn forward_stdin(
    mut lines: mpsc::Receiver<std::io::Result<Vec<u8>>>,
    input: AgentInput,
    mut rewrite: Option<CwdRewrite>,
) {
    while let Some(line) = lines.recv().await {
        let line = match line {
            Ok(line) => line,
            Err(error) => {
                eprintln!("oab-runtime: reading stdin: {error}; closing the agent's stdin");
                break;
            }
        };
        // A blank line is no message: the agent would only have to skip it.
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let line = rewrite
            .as_mut()
            .and_then(|rewrite| rewrite.apply(&line))
            .unwrap_or(line);
        if let Err(error) = input.write_line(&line).await {
            lines.close();
            let mut left = 1;
            while lines.recv().await.is_some() {
                left += 1;
            }
            eprintln!("oab-runtime: writing to the agent: {error}; {left} line(s) of stdin not delivered");
            return;
        }
    }
    let _ = input.close().await;
}

async fn relay(stdout: &mut tokio::io::Stdout, bytes: &[u8]) -> std::io::Result<()> {
    stdout.write_all(bytes).await?;
    stdout.flush().await
}

/// Relays what the agent's output still holds, until it ends or stays quiet for
/// [`DRAIN_AFTER_EXIT`].
async fn drain(output: &mut AgentOutput, stdout: &mut tokio::io::Stdout, buffer: &mut [u8]) {
    while let Ok(Some(n)) = read_within(output, buffer, Some(DRAIN_AFTER_EXIT)).await {
        if n == 0 || relay(stdout, &buffer[..n]).await.is_err() {
            return;
        }
    }
}

/// Reads from `output`; `Ok(None)` if `limit` passes without a byte.
async fn read_within(
    output: &mut AgentOutput,
    buffer: &mut [u8],
    limit: Option<Duration>,
) -> std::io::Result<Option<usize>> {
    let read = output.read(buffer);
    match limit {
        None => read.await.map(Some),
        Some(limit) => match tokio::time::timeout(limit, read).await {
            Ok(read) => read.map(Some),
            Err(_) => Ok(None),
        },
    }
}

/// Kills every process left below `run` once its session is suspended: only processes the agent
/// started are (the subreaper made its orphans `run`'s), so none of them outlives `run`, even
/// if it left the agent's process group and cleared the worker marker from its environment.
fn kill_adopted_orphans() {
    // A killed parent's children are reparented here only as it dies: look again, a few times.
    for _ in 0..10 {
        let left = living_descendants(std::process::id());
        if left.is_empty() {
            return;
        }
        for pid in left {
            if let Some(pid) = i32::try_from(pid).ok().and_then(rustix::process::Pid::from_raw) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Every descendant of `root` that has not exited (zombies stay until `run` exits: Tokio reaps
/// only the children it started).
fn living_descendants(root: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut queue = vec![root];
    while let Some(pid) = queue.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children = std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children
                .split_ascii_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                if !found.contains(&child) && !is_zombie(child) {
                    found.push(child);
                    queue.push(child);
                }
            }
        }
    }
    found
}

fn is_zombie(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit_once(") ")
            .is_none_or(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X'))
    })
}

/// What happened, for the operator.
fn describe(ending: Ending, ended_alone: Option<WorkerExit>) -> String {
    match (ending, ended_alone) {
        (_, Some(exit)) => format!("the agent {exit}"),
        (Ending::OutputEnded, None) => "the agent closed its output".into(),
        (Ending::StdinEndedAndQuiet, None) => {
            format!("stdin ended and the agent was quiet for {DRAIN_AFTER_STDIN_EOF:?}")
        }
        (Ending::Signal(number), None) => format!("signal {number} received"),
        (Ending::StdoutFailed, None) => "stdout is closed".into(),
        (Ending::AgentExited, None) => "the agent exited".into(),
    }
}

/// `run`'s exit status (see the module documentation).
fn exit_status(ending: Ending, ended_alone: Option<WorkerExit>) -> u8 {
    match (ending, ended_alone) {
        (Ending::Signal(number), _) => signal_status(number),
        (_, Some(exit)) => agent_status(exit),
        (Ending::StdinEndedAndQuiet, None) => 0,
        // It closed its output but kept running, and was stopped: not a clean end.
        (Ending::OutputEnded | Ending::AgentExited | Ending::StdoutFailed, None) => 1,
    }
}

/// The exit status that reports how the agent ended, as a shell would.
fn agent_status(exit: WorkerExit) -> u8 {
    match exit {
        // A code the shell cannot show (negative, above 255) must not wrap around to 0.
        WorkerExit::Code(code) => u8::try_from(code).unwrap_or(1),
        WorkerExit::Signal(number) => signal_status(number),
        // The kernel's OOM killer sends SIGKILL.
        WorkerExit::OutOfMemory => signal_status(SIGKILL),
        _ => 1,
    }
}

/// SIGKILL's number.
const SIGKILL: i32 = 9;

fn signal_status(number: i32) -> u8 {
    u8::try_from(128 + number).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_report_how_the_agent_ended() {
        assert_eq!(exit_status(Ending::AgentExited, Some(WorkerExit::Code(0))), 0);
        assert_eq!(exit_status(Ending::OutputEnded, Some(WorkerExit::Code(3))), 3);
        assert_eq!(exit_status(Ending::AgentExited, Some(WorkerExit::Code(256))), 1);
        assert_eq!(
            exit_status(Ending::AgentExited, Some(WorkerExit::Signal(11))),
            139
        );
        assert_eq!(
            exit_status(Ending::AgentExited, Some(WorkerExit::OutOfMemory)),
            137
        );
        assert_eq!(exit_status(Ending::StdinEndedAndQuiet, None), 0);
        assert_eq!(exit_status(Ending::OutputEnded, None), 1);
        assert_eq!(exit_status(Ending::Signal(15), Some(WorkerExit::Code(0))), 143);
    }
}
