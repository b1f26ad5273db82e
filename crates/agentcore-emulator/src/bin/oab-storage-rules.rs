//! `oab-storage-rules [--storage-alias=PATH]… PROGRAM [ARGS…]`: runs PROGRAM under the seccomp filters that stand for
//! AgentCore's session storage rules (no hard links, FIFOs, UNIX sockets, extended attributes
//! or `fallocate`; see `agentcore_emulator::storage_rules`): a Landlock ruleset for sockets and
//! FIFOs on the storage (its working directory) and seccomp filters for the rest. The emulator's
//! launcher puts it in front of every worker; both hold for the worker and everything it starts.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1).peekable();
    // Other paths the storage is reached by: `--storage-alias=PATH`, before the program.
    let mut aliases = Vec::new();
    while let Some(alias) = args
        .peek()
        .and_then(|arg| arg.to_str())
        .and_then(|arg| arg.strip_prefix("--storage-alias="))
    {
        aliases.push(PathBuf::from(alias));
        args.next();
    }
    let Some(program) = args.next() else {
        eprintln!("usage: oab-storage-rules [--storage-alias=PATH]... PROGRAM [ARGS...]");
        return ExitCode::from(2);
    };
    // The storage is the working directory the worker starts in (mounted there later or not).
    let landlocked = match std::env::current_dir() {
        Ok(storage) => {
            // Relative aliases are relative to the storage.
            let mut paths: Vec<PathBuf> = aliases.iter().map(|alias| normal(&storage.join(alias))).collect();
            paths.push(storage);
            let aliases = paths;
            agentcore_emulator::storage_rules::refuse_special_files_beneath(&aliases).unwrap_or_else(
                |error| {
                    eprintln!("oab-storage-rules: {error}; refusing UNIX sockets and FIFOs everywhere");
                    false
                },
            )
        }
        Err(error) => {
            eprintln!("oab-storage-rules: no working directory ({error}); refusing UNIX sockets and FIFOs everywhere");
            false
        }
    };
    let filters = match agentcore_emulator::storage_rules::filters(!landlocked) {
        Ok(filters) => filters,
        Err(error) => {
            eprintln!("oab-storage-rules: {error}");
            return ExitCode::from(126);
        }
    };
    for filter in &filters {
        // Sets no_new_privs first, so no privilege is needed.
        if let Err(error) = seccompiler::apply_filter(filter) {
            eprintln!("oab-storage-rules: installing the filter: {error}");
            return ExitCode::from(126);
        }
    }
    let error = std::process::Command::new(&program).args(args).exec();
    eprintln!(
        "oab-storage-rules: running {}: {error}",
        program.to_string_lossy()
    );
    ExitCode::from(127)
}

/// `path` with `.` and `..` taken out lexically (the storage's ancestors are real directories).
fn normal(path: &std::path::Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::new();
    for component in path.components() {
        match component {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}
