//! [`LocalRuntimeBuilder`]: configuration of the local runtime, validated once in `build`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use session_runtime::config::{
    AgentStderr, EgressTarget, LocalConfig, NetworkMode, ReadonlyMount, ResourceLimits, SandboxMode,
    SessionRuntimeConfig, StorageMode,
};
use session_runtime::{AgentCommand, Error, IsolationLevel, Result, RetentionPolicy, SessionIdentity};

use crate::egress::{EgressPlan, FORWARDER_ENV, FORWARDER_NAME};
use crate::runtime::LocalRuntime;
use crate::sandbox::Sandbox;

/// Everything a built runtime needs, validated.
#[derive(Debug, Clone)]
pub(crate) struct LocalSettings {
    pub(crate) root: PathBuf,
    pub(crate) installation: String,
    pub(crate) agent: AgentCommand,
    pub(crate) retention: RetentionPolicy,
    pub(crate) idle_ttl: Option<Duration>,
    pub(crate) terminate_grace: Duration,
    /// What happens to each worker's stderr.
    pub(crate) agent_stderr: AgentStderr,
    pub(crate) limits: Option<ResourceLimits>,
    pub(crate) home_template: Option<PathBuf>,
    /// With `network = "allowlist"`: what sessions may reach, and the forwarder that runs first
    /// in their sandboxes.
    pub(crate) egress: Option<Egress>,
}

/// The allowlist of `network = "allowlist"` and its in-sandbox helper.
#[derive(Debug, Clone)]
pub(crate) struct Egress {
    pub(crate) plan: std::sync::Arc<EgressPlan>,
    /// The `oab-egress-forward` program on the host.
    pub(crate) forwarder: PathBuf,
}

/// Builds a [`LocalRuntime`].
///
/// ```no_run
/// use runtime_local::LocalRuntime;
/// use session_runtime::config::SandboxMode;
/// use session_runtime::AgentCommand;
///
/// let runtime = LocalRuntime::builder(AgentCommand::new("claude-agent-acp"))
///     .root("/var/lib/openab/sessions")
///     .installation("prod-bot")
///     .sandbox(SandboxMode::Bubblewrap)
///     .build()?;
/// # Ok::<(), session_runtime::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct LocalRuntimeBuilder {
    agent: AgentCommand,
    installation: String,
    retention: RetentionPolicy,
    idle_ttl: Option<Duration>,
    local: LocalConfig,
}

impl LocalRuntime {
    /// A builder running `agent` in every session: per-session storage with sandbox `auto`
    /// (this runtime's own defaults, unchanged by 0.2; an empty `[session_runtime]` section
    /// means shared storage now, which is not this runtime's).
    pub fn builder(agent: AgentCommand) -> LocalRuntimeBuilder {
        let mut config = SessionRuntimeConfig::default();
        config.local.storage = StorageMode::PerSession;
        config.local.sandbox = SandboxMode::Auto;
        LocalRuntimeBuilder::from_config(&config, agent)
    }
}

impl LocalRuntimeBuilder {
    /// A builder from a parsed `[session_runtime]` section (its `local` table and common keys).
    /// The section must select per-session storage (`build` refuses shared storage, which is
    /// `runtime-shared`'s); an unset `idle_ttl` or `terminate_grace` takes its per-session default.
    pub fn from_config(config: &SessionRuntimeConfig, agent: AgentCommand) -> Self {
        Self {
            agent,
            installation: config.installation.clone(),
            retention: config.retention.clone(),
            idle_ttl: config.effective_idle_ttl(),
            local: config.local.clone(),
        }
    }

    /// Where session storage lives (default: `/var/lib/openab/sessions` for root, else
    /// `$XDG_STATE_HOME/openab/sessions` or `~/.local/state/openab/sessions`).
    pub fn root(mut self, root: impl Into<PathBuf>) -> Self {
        self.local.root = Some(root.into());
        self
    }

    /// The installation whose sessions this runtime serves.
    pub fn installation(mut self, installation: impl Into<String>) -> Self {
        self.installation = installation.into();
        self
    }

    /// The sandbox mode.
    pub fn sandbox(mut self, sandbox: SandboxMode) -> Self {
        self.local.sandbox = sandbox;
        self
    }

    /// With [`NetworkMode::Allowlist`]: the only destinations sessions may reach.
    pub fn egress(mut self, targets: Vec<EgressTarget>) -> Self {
        self.local.egress = targets;
        self
    }

    /// What sandboxed sessions' network is. Unset, a sandboxed session gets a network namespace
    /// of its own ([`LocalConfig::effective_network`]); [`NetworkMode::Host`] shares the host's
    /// with every session, which the runtime logs at startup.
    pub fn network(mut self, network: NetworkMode) -> Self {
        self.local.network = Some(network);
        self
    }

    /// Read-only inputs shared by every session (sandboxed modes only).
    pub fn readonly(mut self, mounts: Vec<ReadonlyMount>) -> Self {
        self.local.readonly = mounts;
        self
    }

    /// A directory copied into every new session's HOME (agent credentials and configuration).
    pub fn home_template(mut self, template: impl Into<PathBuf>) -> Self {
        self.local.home_template = Some(template.into());
        self
    }

    /// Per-session resource limits (checked in [`build`](Self::build), as
    /// [`ResourceLimits::validate`] does).
    pub fn limits(mut self, limits: ResourceLimits) -> Self {
        self.local.limits = Some(limits);
        self
    }

    /// How long an agent gets between SIGTERM and SIGKILL; at most
    /// [`LocalConfig::MAX_TERMINATE_GRACE`] (checked in [`build`](Self::build)).
    pub fn terminate_grace(mut self, grace: Duration) -> Self {
        self.local.terminate_grace = Some(grace);
        self
    }

    /// What happens to the agent's stderr (default [`AgentStderr::Warn`]; the configuration key
    /// `session_runtime.local.agent_stderr`).
    pub fn agent_stderr(mut self, stderr: AgentStderr) -> Self {
        self.local.agent_stderr = Some(stderr);
        self
    }

    /// The retention policy applied at close.
    pub fn retention(mut self, retention: RetentionPolicy) -> Self {
        self.retention = retention;
        self
    }

    /// How long a worker may be idle before `reconcile` suspends it (`None`: never).
    pub fn idle_ttl(mut self, idle_ttl: Option<Duration>) -> Self {
        self.idle_ttl = idle_ttl;
        self
    }

    /// Validates the configuration and picks the sandbox. Writes nothing: the root is created
    /// by the first [`create`](session_runtime::SessionRuntime::create) (mode 0711); a root
    /// that exists is used as it is, never changed.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the key for a bad installation, a grace, idle TTL or
    /// retention time above its documented maximum, an empty agent command, an `agent.needs`
    /// entry that is relative, missing, or contains or lies inside the root, a
    /// sandbox that cannot work here (with how to fix it), or a root that is relative, `/`, a
    /// system directory, writable by every user or owned by another user (saying which);
    /// [`Error::Backend`] if the root cannot be inspected.
    pub fn build(self) -> Result<LocalRuntime> {
        let invalid = |key: &str, reason: String| Error::InvalidConfig {
            key: key.into(),
            reason,
        };
        if self.local.storage != StorageMode::PerSession {
            return Err(invalid(
                "session_runtime.local.storage",
                format!(
                    "this runtime keeps storage per session, but storage = \"{}\"; shared storage \
                     (upstream's behaviour) is runtime-shared's, which `openab_runtime::from_config` \
                     picks for it",
                    self.local.storage
                ),
            ));
        }
        SessionIdentity::new(self.installation.as_str(), "probe", "probe", "probe")
            .map_err(|e| invalid("session_runtime.installation", e.to_string()))?;
        // The builder's setters bypass the configuration file's checks: the same bounds apply.
        let too_long = |key: &str, value: Duration, max: Duration| {
            invalid(
                key,
                format!(
                    "{value:?} is longer than the most allowed, {max:?}; stopping and expiring sessions must end"
                ),
            )
        };
        let terminate_grace = self.local.effective_terminate_grace();
        if terminate_grace > LocalConfig::MAX_TERMINATE_GRACE {
            return Err(too_long(
                "session_runtime.local.terminate_grace",
                terminate_grace,
                LocalConfig::MAX_TERMINATE_GRACE,
            ));
        }
        if let Some(ttl) = self
            .idle_ttl
            .filter(|ttl| *ttl > SessionRuntimeConfig::MAX_IDLE_TTL)
        {
            return Err(too_long(
                "session_runtime.idle_ttl",
                ttl,
                SessionRuntimeConfig::MAX_IDLE_TTL,
            ));
        }
        if let Some(keep) = self
            .retention
            .retain_for
            .filter(|keep| *keep > RetentionPolicy::MAX_RETAIN_FOR)
        {
            return Err(too_long(
                "session_runtime.retention.retain_for",
                keep,
                RetentionPolicy::MAX_RETAIN_FOR,
            ));
        }
        if let Some(limits) = &self.local.limits {
            limits.validate()?;
        }
        if self.agent.program.trim().is_empty() {
            return Err(invalid("agent.command", "the agent command is empty".into()));
        }
        let root = match &self.local.root {
            Some(root) if root.is_absolute() => root.clone(),
            Some(root) => {
                return Err(invalid(
                    "session_runtime.local.root",
                    format!("{} is not absolute", root.display()),
                ))
            }
            None => default_root().ok_or_else(|| {
                invalid(
                    "session_runtime.local.root",
                    "no default: neither HOME nor XDG_STATE_HOME is set".into(),
                )
            })?,
        };
        // Checked in every mode, so that a configuration means the same whatever the sandbox:
        // each entry exists and shows no session's storage.
        crate::sandbox::needs::check_apart_from(&crate::sandbox::needs::listed(&self.agent.needs)?, &root)?;
        check_readonly_apart_from(&self.local.readonly, &root)?;
        if let Some(template) = &self.local.home_template {
            if !template.is_dir() {
                return Err(invalid(
                    "session_runtime.local.home_template",
                    format!("{} is not a directory", template.display()),
                ));
            }
        }
        let egress = self.egress_settings()?;
        let detect = crate::sandbox::DetectOptions {
            network_is_default: self.local.network.is_none(),
            ..Default::default()
        };
        let sandbox = Sandbox::detect_with(
            self.local.sandbox,
            self.local.effective_network(),
            &self.local.readonly,
            &detect,
        )?;
        // Checked, not created: reading sessions must not write; `create` makes the root.
        crate::root::check(&root)?;
        if sandbox.isolation() == IsolationLevel::None {
            tracing::warn!(
                root = %root.display(),
                "the local session runtime runs without a sandbox: sessions are NOT isolated from each other"
            );
        } else {
            tracing::info!(
                root = %root.display(),
                sandbox = %sandbox.kind(),
                network = %sandbox.network(),
                "local session runtime ready"
            );
        }
        if let Some(shared) = sandbox.shared_processes() {
            tracing::warn!(root = %root.display(), "{shared}");
        }
        if let Some(shared) = sandbox.shared_network() {
            tracing::warn!(root = %root.display(), "{shared}");
        } else if self.local.network.is_none() && sandbox.network() == NetworkMode::None {
            // The default changed in 0.3 (it was `host`): an agent that reached its model before
            // and cannot now finds the reason and the fix here.
            tracing::info!(
                root = %root.display(),
                "network unset: each session has a network namespace of its own, loopback only (the \
                 default since 0.3, which was \"host\"); list what agents must reach in egress, e.g. \
                 egress = [\"api.openai.com:443\"], or set network = \"host\" to share the host's with \
                 every session"
            );
        }
        let settings = LocalSettings {
            root,
            installation: self.installation,
            agent: self.agent,
            retention: self.retention,
            idle_ttl: self.idle_ttl,
            terminate_grace,
            agent_stderr: self.local.effective_agent_stderr(),
            limits: self.local.limits,
            home_template: self.local.home_template,
            egress,
        };
        Ok(LocalRuntime::new(settings, sandbox))
    }
}

impl LocalRuntimeBuilder {
    /// The allowlist settings of `network = "allowlist"`, checked as the configuration file's
    /// are (the builder's setters bypass those checks), with the forwarder found.
    fn egress_settings(&self) -> Result<Option<Egress>> {
        let invalid = |key: &str, reason: String| Error::InvalidConfig {
            key: key.into(),
            reason,
        };
        let network = self.local.effective_network();
        if !self.local.egress.is_empty() && network != NetworkMode::Allowlist {
            return Err(invalid(
                "session_runtime.local.egress",
                format!(
                    "egress lists the destinations of network = \"allowlist\", but network = \"{network}\""
                ),
            ));
        }
        if network != NetworkMode::Allowlist {
            return Ok(None);
        }
        if self.local.sandbox == SandboxMode::None {
            return Err(invalid(
                "session_runtime.local.network",
                "network = \"allowlist\" needs a sandbox, but sandbox = \"none\"; choose sandbox = \
                 \"auto\" or \"bubblewrap\", or network = \"host\""
                    .into(),
            ));
        }
        let forwarder =
            crate::sandbox::host::locate_helper(FORWARDER_NAME, FORWARDER_ENV).map_err(|why| {
                invalid(
                    "session_runtime.local.network",
                    format!("network = \"allowlist\": {why}"),
                )
            })?;
        if !crate::sandbox::host::is_executable(&forwarder) {
            return Err(invalid(
                "session_runtime.local.network",
                format!(
                    "network = \"allowlist\": the `{FORWARDER_NAME}` helper {} is not an executable file",
                    forwarder.display()
                ),
            ));
        }
        Ok(Some(Egress {
            plan: std::sync::Arc::new(EgressPlan::new(&self.local.egress)),
            forwarder,
        }))
    }
}

/// Refuses a read-only input whose host path contains the session root or lies inside it, as
/// `agent.needs` refuses such a path: it would show sessions' storage (or one session's) to
/// every session, held back only by the modes of the directories in between.
fn check_readonly_apart_from(readonly: &[ReadonlyMount], root: &Path) -> Result<()> {
    let resolved = crate::sandbox::needs::resolved_as_far_as_it_exists;
    let root = resolved(root);
    for (index, mount) in readonly.iter().enumerate() {
        let host = resolved(mount.host());
        let problem = if root.starts_with(&host) {
            "contains the session root"
        } else if host.starts_with(&root) {
            "lies inside the session root"
        } else {
            continue;
        };
        return Err(Error::InvalidConfig {
            key: "session_runtime.local.readonly".to_owned(),
            reason: format!(
                "entry {} ({mount}): host path {} (resolved: {}) {problem} {}: it would show sessions' \
                 storage to every session; choose a directory apart from the root",
                index + 1,
                mount.host().display(),
                host.display(),
                root.display()
            ),
        });
    }
    Ok(())
}

fn default_root() -> Option<PathBuf> {
    if rustix::process::geteuid().is_root() {
        return Some(PathBuf::from("/var/lib/openab/sessions"));
    }
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".local/state")))?;
    Some(state.join("openab/sessions"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn graces_and_ttls_set_on_the_builder_are_bounded_too() {
        let root = tempfile::tempdir().expect("root");
        let builder = || {
            LocalRuntime::builder(AgentCommand::new("agent"))
                .root(root.path())
                .sandbox(SandboxMode::None)
        };
        let forever = Duration::from_secs(100_000_000 * 365 * 24 * 3600);
        let mut keep_forever = RetentionPolicy::default();
        keep_forever.retain_for = Some(forever);
        for (built, key) in [
            (
                builder().terminate_grace(forever).build(),
                "session_runtime.local.terminate_grace",
            ),
            (
                builder().idle_ttl(Some(forever)).build(),
                "session_runtime.idle_ttl",
            ),
            (
                builder().retention(keep_forever).build(),
                "session_runtime.retention.retain_for",
            ),
        ] {
            match built {
                Err(Error::InvalidConfig { key: got, reason }) => {
                    assert_eq!(got, key, "{reason}");
                    assert!(reason.contains("longer than the most allowed"), "{reason}");
                }
                other => panic!("{key}: {other:?}"),
            }
        }
        builder()
            .terminate_grace(LocalConfig::MAX_TERMINATE_GRACE)
            .build()
            .expect("the maximum itself is allowed");
    }

    #[test]
    fn a_read_only_input_apart_from_the_session_root_only() {
        let around = tempfile::tempdir().expect("dir");
        let root = around.path().join("sessions");
        let inside = root.join("some-session");
        std::fs::create_dir_all(&inside).expect("mkdir");
        let apart = tempfile::tempdir().expect("dir");
        let build = |host: &Path| {
            let mount = ReadonlyMount::new(host, "/skills").expect("mount");
            LocalRuntime::builder(AgentCommand::new("agent"))
                .root(&root)
                .sandbox(SandboxMode::Landlock)
                .readonly(vec![mount])
                .build()
        };
        for (host, problem) in [
            (root.as_path(), "contains the session root"),
            (around.path(), "contains the session root"),
            (inside.as_path(), "lies inside the session root"),
        ] {
            match build(host) {
                Err(Error::InvalidConfig { key, reason }) => {
                    assert_eq!(key, "session_runtime.local.readonly", "{reason}");
                    assert!(reason.contains(problem), "{reason}");
                }
                other => panic!("{}: {other:?}", host.display()),
            }
        }
        // The control: an input elsewhere gets past this check (to the sandbox's own, which may
        // refuse it for other reasons on this machine, but not naming the root).
        if let Err(Error::InvalidConfig { reason, .. }) = build(apart.path()) {
            assert!(!reason.contains("session root"), "{reason}");
        }
    }

    #[test]
    fn limits_set_on_the_builder_are_checked_too() {
        let root = tempfile::tempdir().expect("root");
        let mut huge = ResourceLimits::default();
        huge.cpu = Some(1e308);
        let built = LocalRuntime::builder(AgentCommand::new("agent"))
            .root(root.path())
            .sandbox(SandboxMode::None)
            .limits(huge)
            .build();
        match built {
            Err(Error::InvalidConfig { key, .. }) => assert_eq!(key, "session_runtime.local.limits.cpu"),
            other => panic!("{other:?}"),
        }
    }
}
