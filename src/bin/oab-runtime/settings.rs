//! The configuration file: OpenAB's `[agent]` and `[session_runtime]` sections.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use openab_runtime::config::{SandboxMode, SessionRuntimeConfig, StorageMode};
use openab_runtime::{AgentCommand, Error};
use serde::Deserialize;

/// OpenAB's `[agent]` section, as far as a session runtime needs it.
#[derive(Debug, Default, Deserialize)]
struct AgentSection {
    command: Option<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    #[serde(default)]
    inherit_env: Vec<String>,
    #[serde(default)]
    needs: Vec<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
struct Document {
    #[serde(default)]
    agent: Option<AgentSection>,
}

/// A loaded configuration file.
#[derive(Debug)]
pub(crate) struct Settings {
    /// The configuration file read, if any.
    pub(crate) path: Option<PathBuf>,
    pub(crate) runtime: SessionRuntimeConfig,
    /// `[agent]`, when the file has one (with or without a `command`).
    pub(crate) agent: Option<ConfiguredAgent>,
}

/// `[agent]` as configured: its command, if it names one, and the rules that apply to whatever
/// command runs (`env`, `inherit_env`, `needs`), which `run -- ARGV` keeps even when the section
/// names no command.
#[derive(Debug, Clone)]
pub(crate) struct ConfiguredAgent {
    /// `agent.command`, if set.
    command: Option<String>,
    /// `[agent]` with `-- ARGV`'s program (or none) as its command: its `args`, `env`,
    /// `inherit_env` and `needs`.
    rules: AgentCommand,
}

impl ConfiguredAgent {
    /// The configured command with its arguments and rules; `None` when `agent.command` is unset.
    pub(crate) fn command(&self) -> Option<AgentCommand> {
        let program = self.command.as_ref()?;
        let mut agent = self.rules.clone();
        agent.program.clone_from(program);
        Some(agent)
    }

    /// `argv` (a program and its arguments) with the section's `env`, `inherit_env` and `needs`.
    pub(crate) fn with_argv(&self, program: &str, args: &[String]) -> AgentCommand {
        let mut agent = AgentCommand::new(program).args(args.iter().cloned());
        agent.env = self.rules.env.clone();
        agent.inherit_env = self.rules.inherit_env.clone();
        agent.needs = self.rules.needs.clone();
        agent
    }
}

impl Settings {
    /// Reads `path`, as the broker reads it. Without a file: the local runtime with per-session
    /// storage and sandbox `auto`, what this tool is for (an empty `[session_runtime]` section
    /// means upstream's shared storage, which has no sessions to list and nothing to verify).
    pub(crate) fn load(path: Option<&Path>) -> Result<Self, Error> {
        let Some(path) = path else {
            let mut runtime = SessionRuntimeConfig::default();
            runtime.local.storage = StorageMode::PerSession;
            runtime.local.sandbox = SandboxMode::Auto;
            return Ok(Self {
                path: None,
                runtime,
                agent: None,
            });
        };
        let text = std::fs::read_to_string(path).map_err(|e| Error::InvalidConfig {
            key: path.display().to_string(),
            reason: format!("cannot read the configuration file: {e}"),
        })?;
        let runtime = SessionRuntimeConfig::from_toml_document(&text)?;
        // Only `[agent]` is read here; every other table belongs to the broker.
        let document: Document = toml::from_str::<toml::Table>(&text)
            .ok()
            .and_then(|table| table.get("agent").cloned())
            .map(|agent| {
                agent
                    .try_into::<AgentSection>()
                    .map(|agent| Document { agent: Some(agent) })
                    .map_err(|e| Error::InvalidConfig {
                        key: "agent".into(),
                        reason: e.to_string(),
                    })
            })
            .transpose()?
            .unwrap_or_default();
        // A section without `command` is kept: its rules still apply to `run -- ARGV`.
        let agent = document.agent.map(|section| {
            let mut rules = AgentCommand::new("").args(section.args);
            rules.env = section.env;
            rules.inherit_env = section.inherit_env;
            rules.needs = section.needs;
            ConfiguredAgent {
                command: section.command,
                rules,
            }
        });
        Ok(Self {
            path: Some(path.to_path_buf()),
            runtime,
            agent,
        })
    }
}
