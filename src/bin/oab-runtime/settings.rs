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
    pub(crate) runtime: SessionRuntimeConfig,
    pub(crate) agent: Option<AgentCommand>,
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
            return Ok(Self { runtime, agent: None });
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
        let agent = document.agent.and_then(|section| {
            let program = section.command?;
            let mut agent = AgentCommand::new(program).args(section.args);
            agent.env = section.env;
            agent.inherit_env = section.inherit_env;
            agent.needs = section.needs;
            Some(agent)
        });
        Ok(Self { runtime, agent })
    }
}
