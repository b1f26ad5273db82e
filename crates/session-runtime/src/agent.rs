//! [`AgentCommand`]: what program a session's worker runs, as OpenAB's `[agent]` section says.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// The agent program a worker runs: upstream OpenAB's `[agent]` `command`, `args`, `env` and
/// `inherit_env`, and `needs`: what of the host the program needs to run.
///
/// Backends that build the worker from a cluster-owned profile (Kubernetes, AgentCore) may take the
/// program from the profile instead and use this only for arguments and environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AgentCommand {
    /// The program, as a path or a name looked up on `PATH`.
    pub program: String,
    /// Its arguments.
    pub args: Vec<String>,
    /// Environment variables set explicitly (they win over inherited ones).
    pub env: BTreeMap<String, String>,
    /// Names of broker environment variables passed through when set.
    pub inherit_env: Vec<String>,
    /// Absolute host paths (files or directories) the program needs besides itself: its
    /// installation directory, an interpreter, a virtual environment. A sandboxing backend shows
    /// each read-only (and executable) at the same path, with links resolved; the directory of the
    /// program's file, the interpreter of its `#!` line, the package either is installed in (a
    /// Python virtual environment, a Node package's `node_modules`) and files named by absolute
    /// paths in `args` need not be listed (the local runtime shows them). A backend that runs
    /// the program elsewhere (a Pod, a microVM) ignores them.
    pub needs: Vec<PathBuf>,
    /// upstream's `[agent].working_dir`: where the agent runs with shared storage
    /// ([`StorageMode::Shared`](crate::config::StorageMode)), and the `cwd` it is given. `None`:
    /// the system's temporary directory (`/tmp` on Linux), upstream v0.8.x's default. Backends
    /// with storage of a session's own ignore it: the session's workspace is the working directory.
    pub working_dir: Option<PathBuf>,
}

impl AgentCommand {
    /// A command with no arguments and no extra environment.
    pub fn new(program: impl Into<String>) -> Self {
        Self {
            program: program.into(),
            ..Self::default()
        }
    }

    /// Appends arguments.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Sets one environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.env.insert(key.into(), value.into());
        self
    }

    /// Passes one broker environment variable through when it is set.
    pub fn inherit_env(mut self, key: impl Into<String>) -> Self {
        self.inherit_env.push(key.into());
        self
    }

    /// Sets the working directory of shared storage (see [`working_dir`](Self::working_dir)).
    pub fn working_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.working_dir = Some(dir.into());
        self
    }

    /// Adds one path the program needs (see [`needs`](Self::needs)).
    pub fn needs(mut self, path: impl Into<PathBuf>) -> Self {
        self.needs.push(path.into());
        self
    }
}
