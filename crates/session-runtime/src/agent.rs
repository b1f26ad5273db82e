//! [`AgentCommand`]: what program a session's worker runs, as OpenAB's `[agent]` section says.

use std::collections::BTreeMap;

/// The agent program a worker runs: upstream OpenAB's `[agent]` `command`, `args`, `env` and
/// `inherit_env`.
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
}
