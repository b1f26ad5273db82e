//! `oab-landlock-exec`: runs one program restricted by Landlock.
//!
//! The local session runtime starts a session's agent through this helper when it sandboxes with
//! Landlock (`sandbox = "landlock"`, or `"auto"` without a working bubblewrap). The helper applies
//! the ruleset its command line describes to itself, switches to the session's uid and gid if it
//! was given them, and executes the agent, which inherits the restrictions; the runtime itself
//! never needs `unsafe` code between `fork` and `exec` for this.
//!
//! ```text
//! oab-landlock-exec [--uid N] [--gid N] [--read PATH]... [--write PATH]... -- PROGRAM [ARG]...
//! oab-landlock-exec --probe
//! oab-landlock-exec --scopes-only -- PROGRAM [ARG]...
//! ```
//!
//! `--scopes-only` restricts nothing but abstract UNIX sockets and signals to the helper's own
//! Landlock domain: a bubblewrap sandbox sharing the host's network namespace runs the agent
//! through it, so that sessions cannot connect to each other's abstract sockets.
//!
//! It never runs the program unrestricted: if Landlock is not enforced, or a rule cannot be
//! added, it exits with code 126 (127 if the program does not exist) and says why on stderr.
//!
//! Install it next to the broker's executable (or point `OAB_LANDLOCK_EXEC` at it):
//! `cargo install --path crates/runtime-local --bin oab-landlock-exec`.

use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode};

// The runtime library encodes this command line with the same code.
#[allow(dead_code)]
#[path = "../sandbox/landlock_rules.rs"]
mod landlock_rules;

use landlock_rules::{Invocation, EXIT_CANNOT_RUN, EXIT_NOT_FOUND};

fn main() -> ExitCode {
    let invocation = match landlock_rules::parse(std::env::args_os().skip(1)) {
        Ok(invocation) => invocation,
        Err(problem) => return fail(EXIT_CANNOT_RUN, &format!("bad arguments: {problem}")),
    };
    match invocation {
        Invocation::Probe => match landlock_rules::restrict_self(&Default::default()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(problem) => fail(EXIT_CANNOT_RUN, &problem),
        },
        Invocation::ScopesOnly { program, args } => {
            if let Err(problem) = landlock_rules::restrict_scopes() {
                return fail(EXIT_CANNOT_RUN, &problem);
            }
            exec(Command::new(&program).args(&args), &program)
        }
        Invocation::Exec { rules, program, args } => {
            if let Err(problem) = landlock_rules::restrict_self(&rules) {
                return fail(EXIT_CANNOT_RUN, &problem);
            }
            let mut command = Command::new(&program);
            command.args(&args);
            // std switches the group first, drops supplementary groups when started as root,
            // then the user, all before executing the program.
            if let Some(gid) = rules.gid {
                command.gid(gid);
            }
            if let Some(uid) = rules.uid {
                command.uid(uid);
            }
            exec(&mut command, &program)
        }
    }
}

/// Executes `command`; returns only if that failed, with the exit code a shell would give.
fn exec(command: &mut Command, program: &std::ffi::OsStr) -> ExitCode {
    let error = command.exec();
    let code = if error.kind() == std::io::ErrorKind::NotFound {
        EXIT_NOT_FOUND
    } else {
        EXIT_CANNOT_RUN
    };
    fail(
        code,
        &format!("cannot execute {}: {error}", program.to_string_lossy()),
    )
}

/// Reports `problem` on stderr and returns `code`.
fn fail(code: i32, problem: &str) -> ExitCode {
    eprintln!("oab-landlock-exec: {problem}");
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
