//! `oab-storage-rules PROGRAM [ARGS…]`: runs PROGRAM under the seccomp filters that stand for
//! AgentCore's session storage rules (no hard links, FIFOs, UNIX sockets, extended attributes
//! or `fallocate`; see `agentcore_emulator::storage_rules`). The emulator's launcher puts it in
//! front of every worker; the filters hold for the worker and everything it starts.

use std::os::unix::process::CommandExt;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(program) = args.next() else {
        eprintln!("usage: oab-storage-rules PROGRAM [ARGS...]");
        return ExitCode::from(2);
    };
    let filters = match agentcore_emulator::storage_rules::filters() {
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
