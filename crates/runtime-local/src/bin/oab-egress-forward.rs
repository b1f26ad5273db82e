//! `oab-egress-forward`: the in-sandbox end of a session's egress allowlist.
//!
//! With `network = "allowlist"` the local runtime starts a session's agent in a network namespace
//! of its own, which has nothing but loopback. The session's only way out is a set of Unix
//! sockets, bound into the sandbox, behind which the runtime runs the session's proxy. This
//! helper listens on loopback TCP addresses inside the namespace, forwards every connection to
//! one of those sockets, and executes the agent:
//!
//! ```text
//! oab-egress-forward --listen ADDR=SOCKET [--listen ADDR=SOCKET]... -- PROGRAM [ARG]...
//! ```
//!
//! e.g. `--listen 127.0.0.1:3128=/run/openab/egress/proxy.sock` (the HTTP proxy the agent's
//! `HTTPS_PROXY` names) and `--listen 127.0.0.1:8080=/run/openab/egress/fwd-0.sock` (a listed
//! loopback port). The listeners are bound by a child process before the agent starts, so the
//! agent's first connection finds them; the child is killed when the agent's process ends
//! (`PR_SET_PDEATHSIG`), and with the sandbox's pid namespace in any case. The program is
//! executed in place of this process (same pid, environment and descriptors), so its exit status
//! is the worker's. It exits 127 if the program does not exist and 126 if it cannot run or the
//! listeners cannot be set up, saying why on stderr.

use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

/// Exit code when the program does not exist.
const EXIT_NOT_FOUND: u8 = 127;
/// Exit code when the program or the listeners cannot be set up.
const EXIT_CANNOT_RUN: u8 = 126;
/// The line the listening child writes once every listener is bound.
const READY: &str = "ready";
/// The argument that makes this program the listening child.
const SERVE: &str = "--serve";

/// One `--listen ADDR=SOCKET`.
#[derive(Debug, Clone)]
struct Listen {
    address: SocketAddr,
    socket: PathBuf,
}

/// The parsed command line.
#[derive(Debug)]
struct Invocation {
    serve: bool,
    listens: Vec<Listen>,
    program: Vec<String>,
}

fn main() -> ExitCode {
    let invocation = match parse(std::env::args().skip(1)) {
        Ok(invocation) => invocation,
        Err(problem) => return fail(EXIT_CANNOT_RUN, &format!("bad arguments: {problem}")),
    };
    if invocation.serve {
        return serve(&invocation.listens);
    }
    if let Err(problem) = start_listeners(&invocation.listens) {
        return fail(EXIT_CANNOT_RUN, &problem);
    }
    let Some((program, args)) = invocation.program.split_first() else {
        return fail(EXIT_CANNOT_RUN, "bad arguments: no program after `--`");
    };
    let error = Command::new(program).args(args).exec();
    let code = if error.kind() == std::io::ErrorKind::NotFound {
        EXIT_NOT_FOUND
    } else {
        EXIT_CANNOT_RUN
    };
    fail(code, &format!("cannot execute {program}: {error}"))
}

/// Parses `[--serve] (--listen ADDR=SOCKET)... [-- PROGRAM ARG...]`.
fn parse(mut args: impl Iterator<Item = String>) -> Result<Invocation, String> {
    let mut invocation = Invocation {
        serve: false,
        listens: Vec::new(),
        program: Vec::new(),
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            SERVE => invocation.serve = true,
            "--listen" => {
                let value = args.next().ok_or("--listen needs ADDR=SOCKET")?;
                let (address, socket) = value
                    .split_once('=')
                    .ok_or_else(|| format!("--listen {value}: expected ADDR=SOCKET"))?;
                let address = address
                    .parse()
                    .map_err(|_| format!("--listen {value}: {address} is not an IP address and port"))?;
                invocation.listens.push(Listen {
                    address,
                    socket: socket.into(),
                });
            }
            "--" => {
                invocation.program = args.collect();
                break;
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if !invocation.serve && invocation.program.is_empty() {
        return Err("no program after `--`".to_owned());
    }
    Ok(invocation)
}

/// Starts the listening child and waits until it has bound every listener.
fn start_listeners(listens: &[Listen]) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("finding this program: {e}"))?;
    let mut command = Command::new(exe);
    command.arg(SERVE);
    for listen in listens {
        command
            .arg("--listen")
            .arg(format!("{}={}", listen.address, listen.socket.display()));
    }
    // The child holds neither of the agent's protocol pipes: the agent's stdout must end when
    // the agent does. Its stderr is the worker's log, like the agent's.
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("starting the egress listeners: {e}"))?;
    let stdout = child
        .stdout
        .take()
        .ok_or("starting the egress listeners: no pipe")?;
    let mut line = String::new();
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| format!("waiting for the egress listeners: {e}"))?;
    if line.trim_end() == READY {
        Ok(())
    } else {
        let status = child.wait().map_err(|e| e.to_string())?;
        Err(format!("the egress listeners did not start ({status})"))
    }
}

/// The listening child: binds every listener, says it is ready, and forwards connections until
/// its parent (the agent, once it is executed) ends.
fn serve(listens: &[Listen]) -> ExitCode {
    let parent = rustix::process::getppid();
    // Killed with the agent: the parent's pid stays the agent's across its `exec`.
    if let Err(error) = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL))
    {
        return fail(
            EXIT_CANNOT_RUN,
            &format!("setting the parent-death signal: {error}"),
        );
    }
    if rustix::process::getppid() != parent {
        // The parent ended before the signal was armed.
        return ExitCode::from(EXIT_CANNOT_RUN);
    }
    let mut bound = Vec::new();
    for listen in listens {
        match TcpListener::bind(listen.address) {
            Ok(listener) => bound.push((listener, listen.socket.clone())),
            Err(error) => {
                return fail(
                    EXIT_CANNOT_RUN,
                    &format!("listening on {}: {error}", listen.address),
                )
            }
        }
    }
    let mut stdout = std::io::stdout();
    if writeln!(stdout, "{READY}").and_then(|()| stdout.flush()).is_err() {
        return ExitCode::from(EXIT_CANNOT_RUN);
    }
    // Closing stdout tells nobody anything; the parent read its line and executed the agent.
    let threads: Vec<_> = bound
        .into_iter()
        .map(|(listener, socket)| std::thread::spawn(move || accept_loop(&listener, &socket)))
        .collect();
    for thread in threads {
        let _ = thread.join();
    }
    ExitCode::SUCCESS
}

/// Accepts connections on `listener` and joins each to a new connection to `socket`.
fn accept_loop(listener: &TcpListener, socket: &std::path::Path) {
    for stream in listener.incoming() {
        let Ok(tcp) = stream else { continue };
        let socket = socket.to_path_buf();
        std::thread::spawn(move || match UnixStream::connect(&socket) {
            Ok(unix) => join(tcp, unix),
            Err(error) => {
                eprintln!(
                    "oab-egress-forward: the session's proxy at {} is unreachable: {error}",
                    socket.display()
                );
            }
        });
    }
}

/// Copies bytes both ways until each side has ended, passing each end-of-stream on.
fn join(tcp: TcpStream, unix: UnixStream) {
    let (Ok(tcp_reader), Ok(unix_reader)) = (tcp.try_clone(), unix.try_clone()) else {
        return;
    };
    let upstream = std::thread::spawn(move || {
        let (mut from, mut to) = (tcp_reader, unix);
        let _ = std::io::copy(&mut from, &mut to);
        let _ = to.shutdown(Shutdown::Write);
    });
    let (mut from, mut to) = (unix_reader, tcp);
    let _ = std::io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
    let _ = upstream.join();
}

/// Reports `problem` on stderr and returns `code`.
fn fail(code: u8, problem: &str) -> ExitCode {
    eprintln!("oab-egress-forward: {problem}");
    ExitCode::from(code)
}
