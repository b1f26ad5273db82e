//! The `[session_runtime]` section of OpenAB's configuration file.
//!
//! It chooses where a session's agent runs and how:
//!
//! ```toml
//! [session_runtime]
//! type = "local"                # local | kubernetes | agentcore; default local
//! installation = "prod-bot"     # default "openab"
//! idle_ttl = "30m"              # default: never with storage = "shared", else "30m"; "0": never
//! [session_runtime.retention]
//! reset = "delete"              # delete | retain; default delete
//! ended = "delete"              # delete | retain; default delete
//! expired = "delete"            # delete | retain; default delete
//! retain_for = "7d"             # default: retained storage is kept until an operator deletes it
//! [session_runtime.local]
//! storage = "per-session"       # shared | per-session; default shared (upstream's behaviour)
//! root = "/var/lib/openab/sessions"
//! sandbox = "auto"              # auto | bubblewrap | landlock | none; default none
//! network = "host"              # host | none | allowlist; default host
//! egress = ["api.example.com:443", "127.0.0.1:8080"]  # with network = "allowlist"
//! readonly = ["/opt/openab/skills:/skills"]
//! home_template = "/etc/openab/home"
//! terminate_grace = "5s"        # default "1500ms" with storage = "shared", else "5s"
//! agent_stderr = "warn"         # discard | error | warn | info | debug | trace;
//!                               # default "discard" with storage = "shared", else "warn"
//! [session_runtime.local.limits]
//! memory = "2Gi"
//! pids = 512
//! cpu = 1.5
//! [session_runtime.kubernetes]
//! namespace = "openab-sessions"
//! profile = "isolated-worker"   # names a cluster-owned profile; the broker cannot change it
//! reach = "pod-ip"              # pod-ip | exec; default pod-ip
//! start_timeout = "120s"        # default "120s"
//! [session_runtime.agentcore]
//! runtime_arn = "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/example"
//! region = "us-east-1"          # default: the region in runtime_arn
//! qualifier = "DEFAULT"         # default "DEFAULT"
//! ```
//!
//! Durations are strings of numbers with units (`"90s"`, `"30m"`, `"4h"`, `"7d"`, `"1h30m"`).
//! Byte sizes are strings in Kubernetes quantity style (`"512Mi"`, `"2Gi"`, `"1G"`).
//!
//! Parse with [`SessionRuntimeConfig::from_toml_document`] (a whole OpenAB configuration file) or
//! [`SessionRuntimeConfig::from_toml_section`] (the section's body). Every problem is an
//! [`Error::InvalidConfig`] whose `key` is the full dotted path of the offending key, e.g.
//! `session_runtime.local.sandbox`: unknown keys, values of the wrong type or format, and
//! contradictions between keys alike.
//!
//! The types also implement serde's `Deserialize`, so a larger configuration struct can embed
//! [`SessionRuntimeConfig`] as a `#[serde(default)] session_runtime` field; call
//! [`SessionRuntimeConfig::validate`] on the result, which the parsing functions here do for you.
//!
//! # Helpers for runtimes' own configuration
//!
//! A runtime that reads settings of its own (the Kubernetes runtime's worker profile) can check
//! and report them the same way: [`deserialize_toml`] for the keys and places in errors,
//! [`serde_duration`] for durations, [`parse_quantity`] for Kubernetes-style quantities, and
//! [`check_dns_label`] and [`check_dns_subdomain`] for names of Kubernetes objects.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::{Error, Result, RetentionPolicy};

mod egress;
mod values;

pub use egress::{AddressKind, EgressTarget};

/// The custom resource a Kubernetes worker profile is written as: `OabProfile`
/// (`openab.dev/v1alpha1`, `oabprofiles`), its `spec` the profile's keys. Named here because
/// both the runtime and the egress gateway read it.
pub mod profile_resource {
    /// The API group.
    pub const GROUP: &str = "openab.dev";
    /// The served version.
    pub const VERSION: &str = "v1alpha1";
    /// The kind.
    pub const KIND: &str = "OabProfile";
    /// The resource's plural name, as in its URL path.
    pub const PLURAL: &str = "oabprofiles";
}
use values::{check_mount_path, quoted, serde_byte_size_option};
pub use values::{parse_quantity, serde_duration};

/// The name of the configuration section, and the first part of every key in errors.
const SECTION_NAME: &str = "session_runtime";

/// The `[session_runtime]` section: which runtime runs sessions, and its settings.
///
/// Every key is optional; [`SessionRuntimeConfig::default`] (an absent or empty section) is the
/// local runtime with [`StorageMode::Shared`]: exactly what upstream OpenAB does without this
/// library (the agent in `[agent].working_dir` with the broker's HOME, its own process group,
/// the same environment rules, SIGTERM then SIGKILL after 1.5 s). It isolates nothing. Each step
/// beyond it is one explicit key: `local.storage = "per-session"` (a HOME and workspace per
/// session), then `local.sandbox = "auto"` (OS isolation), or `type = "kubernetes"`.
///
/// **Changed in 0.2:** the default used to be per-session storage with `sandbox = "auto"`. A
/// configuration that relied on that default and sets any per-session key (`local.root`,
/// `local.home_template`, `local.sandbox`, `local.limits`, ...) without `local.storage` is now an
/// [`Error::InvalidConfig`] naming that key, never a silent loss of isolation; an empty section
/// now means upstream's behaviour.
///
/// Tables of runtimes other than the selected one may be present; they are validated all the
/// same, so switching `type` never uncovers a latent error.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct SessionRuntimeConfig {
    /// Which runtime runs sessions. TOML key `type`; default [`RuntimeKind::Local`].
    #[serde(rename = "type")]
    pub runtime: RuntimeKind,
    /// The name of this broker deployment; it is part of every session's identity, so two
    /// deployments sharing a cluster or host never collide. 1 to 63 characters of `a-z`, `0-9`
    /// and `-`, not starting or ending with `-`. Default `"openab"`.
    pub installation: String,
    /// The `idle_ttl` key as written: `None` when the operator did not set it, so a broker with
    /// idle timers of its own (openab-core's `[pool] session_ttl_hours`) can tell "unset" from
    /// "set" and fill it in with its own value. A zero duration (`"0"`, `"0s"`) is
    /// [`IdleTtl::Never`]. At most [`SessionRuntimeConfig::MAX_IDLE_TTL`]. What the runtime
    /// applies is [`effective_idle_ttl`](Self::effective_idle_ttl).
    #[serde(with = "idle_ttl", skip_serializing_if = "Option::is_none")]
    pub idle_ttl: Option<IdleTtl>,
    /// What happens to a closed session's storage: the `[session_runtime.retention]` table.
    /// Default: deleted for every close reason.
    pub retention: RetentionPolicy,
    /// Settings of the local runtime: the `[session_runtime.local]` table. Default
    /// [`LocalConfig::default`].
    pub local: LocalConfig,
    /// Settings of the Kubernetes runtime: the `[session_runtime.kubernetes]` table. Required
    /// when `type = "kubernetes"`; default absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<KubernetesConfig>,
    /// Settings of the AgentCore runtime: the `[session_runtime.agentcore]` table. Required when
    /// `type = "agentcore"`; default absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agentcore: Option<AgentCoreConfig>,
}

impl Default for SessionRuntimeConfig {
    fn default() -> Self {
        SessionRuntimeConfig {
            runtime: RuntimeKind::default(),
            installation: Self::DEFAULT_INSTALLATION.to_owned(),
            idle_ttl: None,
            retention: RetentionPolicy::default(),
            local: LocalConfig::default(),
            kubernetes: None,
            agentcore: None,
        }
    }
}

impl SessionRuntimeConfig {
    /// The default [`installation`](Self::installation): `"openab"`.
    pub const DEFAULT_INSTALLATION: &'static str = "openab";

    /// The [`idle_ttl`](Self::idle_ttl) applied when the key is unset, except with
    /// [`StorageMode::Shared`] (never, as upstream): 30 minutes.
    pub const DEFAULT_IDLE_TTL: Duration = Duration::from_secs(30 * 60);

    /// The longest [`idle_ttl`](Self::idle_ttl): 365 days (`"0"` is the way to say never).
    pub const MAX_IDLE_TTL: Duration = Duration::from_secs(365 * 24 * 3600);

    /// How long a worker may sit idle before `reconcile` suspends it, as the runtime applies it:
    /// the [`idle_ttl`](Self::idle_ttl) key if set (`None` for [`IdleTtl::Never`]); unset, `None`
    /// (never) for the local runtime with [`StorageMode::Shared`], whose upstream behaviour has no
    /// runtime idle timer, and [`DEFAULT_IDLE_TTL`](Self::DEFAULT_IDLE_TTL) for every other runtime.
    pub fn effective_idle_ttl(&self) -> Option<Duration> {
        match self.idle_ttl {
            Some(IdleTtl::Never) => None,
            Some(IdleTtl::After(ttl)) => Some(ttl),
            None if self.runtime == RuntimeKind::Local && self.local.storage == StorageMode::Shared => None,
            None => Some(Self::DEFAULT_IDLE_TTL),
        }
    }

    /// Sets an unset [`idle_ttl`](Self::idle_ttl) to the broker pool's own idle TTL (openab-core's
    /// `[pool] session_ttl_hours`), so the runtime's backstop and the pool agree, except for the
    /// local runtime with [`StorageMode::Shared`]: upstream has no runtime idle timer there, and
    /// the pool's eviction stays the only one. A key the operator set is kept.
    ///
    /// ```
    /// use std::time::Duration;
    /// use session_runtime::config::SessionRuntimeConfig;
    ///
    /// let pool_ttl = Duration::from_secs(4 * 3600);
    /// let mut shared = SessionRuntimeConfig::default();
    /// shared.fill_idle_ttl_from_pool(pool_ttl);
    /// assert_eq!(shared.effective_idle_ttl(), None);
    /// let mut per_session = SessionRuntimeConfig::from_toml_section("[local]\nstorage = \"per-session\"")?;
    /// per_session.fill_idle_ttl_from_pool(pool_ttl);
    /// assert_eq!(per_session.effective_idle_ttl(), Some(pool_ttl));
    /// # Ok::<(), session_runtime::Error>(())
    /// ```
    pub fn fill_idle_ttl_from_pool(&mut self, pool_ttl: Duration) {
        let shared = self.runtime == RuntimeKind::Local && self.local.storage == StorageMode::Shared;
        if self.idle_ttl.is_none() && !shared {
            self.idle_ttl = Some(IdleTtl::After(pool_ttl));
        }
    }

    /// Reads the `[session_runtime]` section of a whole OpenAB configuration file and validates it.
    ///
    /// Other top-level tables (`[agent]`, `[discord]`, ...) are ignored. A missing
    /// `[session_runtime]` table gives [`SessionRuntimeConfig::default`]: the local runtime.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the offending key (`session_runtime.local.sandbox`, ...):
    /// for an unknown key, a value of the wrong type or format, or a failed
    /// [`validate`](Self::validate). A TOML syntax error anywhere in the file is reported with the
    /// key `session_runtime` (or the key it occurred in, when known) and its line and column.
    pub fn from_toml_document(text: &str) -> Result<Self> {
        /// A whole configuration file, of which only `[session_runtime]` matters here.
        #[derive(Deserialize)]
        struct Document {
            #[serde(default)]
            session_runtime: SessionRuntimeConfig,
        }
        let document: Document = deserialize_toml_below(text, &[], None)?;
        document.session_runtime.validate()?;
        Ok(document.session_runtime)
    }

    /// Reads the body of a `[session_runtime]` section (its keys, and nested tables written
    /// relative to it as `[local]`, `[retention]`, ...) and validates it.
    ///
    /// Keys in errors are still full paths (`session_runtime.local.sandbox`); line and column
    /// numbers refer to `text`.
    ///
    /// # Errors
    ///
    /// As for [`from_toml_document`](Self::from_toml_document).
    pub fn from_toml_section(text: &str) -> Result<Self> {
        let config: SessionRuntimeConfig = deserialize_toml_below(text, &[SECTION_NAME], None)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what the types alone cannot: names, paths, ranges, required keys, and agreement
    /// between keys.
    ///
    /// Every present table is checked, whichever runtime is selected.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the first offending key, e.g.
    /// `session_runtime.installation` for a name that is not DNS-label-like, or
    /// `session_runtime.kubernetes` when `type = "kubernetes"` has no `[session_runtime.kubernetes]`
    /// table.
    pub fn validate(&self) -> Result<()> {
        if let Err(reason) = check_dns_label(&self.installation) {
            return Err(invalid(
                "installation",
                format!("{reason}; it names this broker deployment, e.g. \"prod-bot\""),
            ));
        }
        let required = match self.runtime {
            RuntimeKind::Local => None,
            RuntimeKind::Kubernetes => self
                .kubernetes
                .is_none()
                .then_some(("kubernetes", "namespace and profile")),
            RuntimeKind::Agentcore => self.agentcore.is_none().then_some(("agentcore", "runtime_arn")),
        };
        if let Some((table, keys)) = required {
            return Err(invalid(
                table,
                format!(
                    "type = \"{}\" needs a [{SECTION_NAME}.{table}] table with at least {keys}",
                    self.runtime
                ),
            ));
        }
        if let Some(IdleTtl::After(ttl)) = self.idle_ttl {
            check_at_most(
                "idle_ttl",
                ttl,
                Self::MAX_IDLE_TTL,
                "; \"0\" never suspends for idleness",
            )?;
        }
        if let Some(keep) = self.retention.retain_for {
            check_at_most(
                "retention.retain_for",
                keep,
                RetentionPolicy::MAX_RETAIN_FOR,
                "; leave it out to keep retained storage until an operator removes it",
            )?;
        }
        if self.runtime == RuntimeKind::Local
            && self.local.storage == StorageMode::Shared
            && self.retention != RetentionPolicy::default()
        {
            return Err(invalid(
                "retention",
                "retention applies to per-session storage, but local.storage = \"shared\" keeps \
                 no storage of a session's own; set local.storage = \"per-session\" or remove \
                 [session_runtime.retention]",
            ));
        }
        self.local.validate()?;
        if let Some(kubernetes) = &self.kubernetes {
            kubernetes.validate()?;
        }
        if let Some(agentcore) = &self.agentcore {
            agentcore.validate()?;
        }
        Ok(())
    }
}

/// Which runtime runs sessions: the `type` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum RuntimeKind {
    /// Child processes of the broker, plain or OS-sandboxed: `"local"`. The default.
    #[default]
    Local,
    /// One worker Pod and volume per session: `"kubernetes"`.
    Kubernetes,
    /// One AWS Bedrock AgentCore Runtime microVM per session: `"agentcore"`.
    Agentcore,
}

impl RuntimeKind {
    /// Every runtime kind, in the order they are documented.
    pub const ALL: [RuntimeKind; 3] = [
        RuntimeKind::Local,
        RuntimeKind::Kubernetes,
        RuntimeKind::Agentcore,
    ];

    /// The configuration spelling: `"local"`, `"kubernetes"` or `"agentcore"`. It is also the
    /// name of the cargo feature that compiles the runtime in.
    pub fn as_str(&self) -> &'static str {
        match self {
            RuntimeKind::Local => "local",
            RuntimeKind::Kubernetes => "kubernetes",
            RuntimeKind::Agentcore => "agentcore",
        }
    }
}

impl fmt::Display for RuntimeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A set `idle_ttl` key: a time, or never.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IdleTtl {
    /// `"0"` (or any zero duration): the runtime never suspends a worker for idleness.
    Never,
    /// Suspend a worker once its stream has been idle this long.
    After(Duration),
}

/// Where a local session's agent works and keeps its files: the `storage` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub enum StorageMode {
    /// Upstream OpenAB's behaviour, unchanged: every session's agent runs in the configured
    /// working directory ([`AgentCommand::working_dir`](crate::AgentCommand)) with the broker's
    /// own HOME; nothing is kept per session and nothing is isolated: `"shared"`. The default.
    #[default]
    #[serde(rename = "shared")]
    Shared,
    /// A workspace, HOME and agent state of its own for each session under `root/<session id>/`:
    /// `"per-session"`. Needed by every sandbox.
    #[serde(rename = "per-session")]
    PerSession,
}

impl StorageMode {
    /// The configuration spelling: `"shared"` or `"per-session"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            StorageMode::Shared => "shared",
            StorageMode::PerSession => "per-session",
        }
    }
}

impl fmt::Display for StorageMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `[session_runtime.local]` table: settings of the local runtime.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct LocalConfig {
    /// Shared (upstream's behaviour) or per-session storage. Default [`StorageMode::Shared`].
    /// Every other key of this table but `terminate_grace` and `agent_stderr` needs
    /// [`StorageMode::PerSession`].
    pub storage: StorageMode,
    /// The directory that holds one subdirectory per session (`<root>/<session id>/`). Must be
    /// absolute. Default `None`: the local runtime chooses its own default location.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub root: Option<PathBuf>,
    /// How sessions are isolated from each other and from the host. Default [`SandboxMode::None`]
    /// (changed in 0.2 from `Auto`: a sandbox is now an explicit step).
    pub sandbox: SandboxMode,
    /// The `network` key as written (`None`: unset): what sandboxed agents can reach. What
    /// applies is [`effective_network`](Self::effective_network): unset, a sandboxed session gets
    /// a network of its own, so that sessions share no loopback port and no abstract socket
    /// (changed in 0.3 from [`NetworkMode::Host`], which stays available as an explicit choice).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkMode>,
    /// With `network = "allowlist"`: the only destinations the session may reach, each
    /// `"HOST:PORT"` ([`EgressTarget`]). Default empty (with `allowlist`: nothing outside the
    /// session). Not allowed with another network mode.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub egress: Vec<EgressTarget>,
    /// Host paths made visible read-only inside every sandbox, each written
    /// `"HOST_PATH:SANDBOX_PATH"` with two absolute paths (e.g. `"/opt/openab/skills:/skills"`).
    /// Default empty. Needs a sandbox: not allowed with `sandbox = "none"`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub readonly: Vec<ReadonlyMount>,
    /// An administrator-owned directory copied into each new session's HOME at create (agent
    /// credentials and configuration). Must be absolute. Default `None`: HOME starts empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub home_template: Option<PathBuf>,
    /// Per-session resource limits (cgroups): the `[session_runtime.local.limits]` table.
    /// Default `None`: no limits.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limits: Option<ResourceLimits>,
    /// The `terminate_grace` key as written (`None`: unset): how long an agent may take to exit
    /// after SIGTERM before it is killed with SIGKILL. `"0s"` kills at once; at most
    /// [`LocalConfig::MAX_TERMINATE_GRACE`]. What applies is
    /// [`effective_terminate_grace`](Self::effective_terminate_grace).
    #[serde(with = "serde_duration::option", skip_serializing_if = "Option::is_none")]
    pub terminate_grace: Option<Duration>,
    /// The `agent_stderr` key as written (`None`: unset): what happens to each line the agent
    /// writes to stderr, in both storage modes. What applies is
    /// [`effective_agent_stderr`](Self::effective_agent_stderr).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agent_stderr: Option<AgentStderr>,
    /// With shared storage: the host directories a session overlay's working directory
    /// ([`SessionOverlay`](crate::SessionOverlay), upstream's `[[ws:...]]`) may be, each with
    /// everything beneath it, links resolved. Each must be absolute. Default empty:
    /// `[agent].working_dir` and what is beneath it. Not allowed with per-session storage, whose
    /// overlay working directories are inside each session's own workspace.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub working_dirs: Vec<PathBuf>,
}

impl LocalConfig {
    /// The [`terminate_grace`](Self::terminate_grace) applied when unset with per-session
    /// storage: 5 seconds.
    pub const DEFAULT_TERMINATE_GRACE: Duration = Duration::from_secs(5);

    /// The [`terminate_grace`](Self::terminate_grace) applied when unset with
    /// [`StorageMode::Shared`]: 1.5 seconds, upstream's wait between SIGTERM and SIGKILL.
    pub const UPSTREAM_TERMINATE_GRACE: Duration = Duration::from_millis(1500);

    /// The grace the runtime applies: the key if set, else
    /// [`UPSTREAM_TERMINATE_GRACE`](Self::UPSTREAM_TERMINATE_GRACE) with shared storage and
    /// [`DEFAULT_TERMINATE_GRACE`](Self::DEFAULT_TERMINATE_GRACE) with per-session storage.
    pub fn effective_terminate_grace(&self) -> Duration {
        self.terminate_grace.unwrap_or(match self.storage {
            StorageMode::Shared => Self::UPSTREAM_TERMINATE_GRACE,
            StorageMode::PerSession => Self::DEFAULT_TERMINATE_GRACE,
        })
    }

    /// What the runtime does with the agent's stderr: the
    /// [`agent_stderr`](Self::agent_stderr) key if set, else [`AgentStderr::Discard`] with
    /// shared storage (upstream's v0.8.x releases give the agent `/dev/null`) and
    /// [`AgentStderr::Warn`] with per-session storage (the local runtime's behaviour before the
    /// key existed).
    pub fn effective_agent_stderr(&self) -> AgentStderr {
        self.agent_stderr.unwrap_or(match self.storage {
            StorageMode::Shared => AgentStderr::Discard,
            StorageMode::PerSession => AgentStderr::Warn,
        })
    }

    /// The network mode the runtime applies: the [`network`](Self::network) key if set; else,
    /// without a sandbox (or with shared storage), [`NetworkMode::Host`], the only one a plain
    /// process can have; else [`NetworkMode::Allowlist`] when [`egress`](Self::egress) lists
    /// destinations, and [`NetworkMode::None`] (a network namespace of the session's own,
    /// loopback only) when it does not. A sandbox that cannot give a session a network of its own
    /// (Landlock) applies `host` for an unset key, and says so.
    pub fn effective_network(&self) -> NetworkMode {
        match self.network {
            Some(network) => network,
            None if self.storage == StorageMode::Shared || self.sandbox == SandboxMode::None => {
                NetworkMode::Host
            }
            None if !self.egress.is_empty() => NetworkMode::Allowlist,
            None => NetworkMode::None,
        }
    }

    /// The longest [`terminate_grace`](Self::terminate_grace): 10 minutes. Stopping a session
    /// (suspend, close, a signal to `oab-runtime run`) waits this long for an agent that ignores
    /// SIGTERM, so it must end.
    pub const MAX_TERMINATE_GRACE: Duration = Duration::from_secs(10 * 60);

    /// Checks paths, mounts, limits, the grace and their agreement with the sandbox mode.
    fn validate(&self) -> Result<()> {
        if let Some(grace) = self.terminate_grace {
            check_at_most("local.terminate_grace", grace, Self::MAX_TERMINATE_GRACE, "")?;
        }
        if self.storage == StorageMode::Shared {
            self.check_shared()?;
        }
        if let Some(root) = &self.root {
            check_absolute("local.root", root)?;
        }
        if self.storage == StorageMode::PerSession && !self.working_dirs.is_empty() {
            return Err(invalid(
                "local.working_dirs",
                "lists host directories a session overlay may work in with storage = \"shared\"; \
                 with storage = \"per-session\" an overlay's working directory is inside the \
                 session's own workspace, so remove the key"
                    .to_owned(),
            ));
        }
        for dir in &self.working_dirs {
            check_absolute("local.working_dirs", dir)?;
        }
        if let Some(template) = &self.home_template {
            check_absolute("local.home_template", template)?;
        }
        for (index, mount) in self.readonly.iter().enumerate() {
            if let Err(reason) = mount.check() {
                return Err(invalid(
                    "local.readonly",
                    format!("entry {}: {reason}", index + 1),
                ));
            }
            if let Some(earlier) = self.readonly[..index]
                .iter()
                .position(|m| m.target == mount.target)
            {
                return Err(invalid(
                    "local.readonly",
                    format!(
                        "entries {} and {} both mount at {}",
                        earlier + 1,
                        index + 1,
                        quoted(&mount.target)
                    ),
                ));
            }
        }
        let network = self.effective_network();
        if !self.egress.is_empty() && network != NetworkMode::Allowlist {
            let (why, fix) = match self.network {
                Some(_) => ("", "set network = \"allowlist\" or remove egress"),
                None => (
                    " (without a sandbox there is no other)",
                    "choose sandbox = \"auto\" or \"bubblewrap\", or remove egress",
                ),
            };
            return Err(invalid(
                "local.egress",
                format!(
                    "egress lists the destinations of network = \"allowlist\", but network = \"{network}\"{why}; {fix}"
                ),
            ));
        }
        for (index, target) in self.egress.iter().enumerate() {
            // One entry per destination, whatever kind of address each says it may reach.
            let same = |t: &EgressTarget| t.host() == target.host() && t.port() == target.port();
            if let Some(earlier) = self.egress[..index].iter().position(same) {
                return Err(invalid(
                    "local.egress",
                    format!(
                        "entries {} and {} are both {}:{}",
                        earlier + 1,
                        index + 1,
                        target.host(),
                        target.port()
                    ),
                ));
            }
        }
        if self.sandbox == SandboxMode::None {
            if network != NetworkMode::Host {
                return Err(invalid(
                    "local.network",
                    format!(
                        "network = \"{network}\" needs a sandbox, but sandbox = \"none\"; \
                         choose sandbox = \"auto\" or \"bubblewrap\", or network = \"host\""
                    ),
                ));
            }
            if !self.readonly.is_empty() {
                return Err(invalid(
                    "local.readonly",
                    "read-only mounts need a sandbox, but sandbox = \"none\"; \
                     choose sandbox = \"auto\" or \"bubblewrap\", or remove them",
                ));
            }
        }
        if let Some(limits) = &self.limits {
            limits.validate()?;
        }
        Ok(())
    }
}

impl LocalConfig {
    /// With shared storage, refuses every key that only per-session storage gives a meaning to,
    /// naming it: before 0.2 an absent `storage` meant per-session storage with a sandbox, so such
    /// a key most likely comes from a configuration that expects isolation.
    fn check_shared(&self) -> Result<()> {
        let set = [
            ("sandbox", self.sandbox != SandboxMode::None),
            ("network", self.network.is_some_and(|n| n != NetworkMode::Host)),
            ("egress", !self.egress.is_empty()),
            ("readonly", !self.readonly.is_empty()),
            ("root", self.root.is_some()),
            ("home_template", self.home_template.is_some()),
            ("limits", self.limits.is_some()),
        ];
        match set.iter().find(|(_, is_set)| *is_set) {
            None => Ok(()),
            Some((key, _)) => Err(invalid(
                &format!("local.{key}"),
                format!(
                    "`{key}` needs storage = \"per-session\", but storage is \"shared\" (the default \
                     since 0.2: every session's agent runs in [agent].working_dir with the broker's \
                     HOME, as upstream OpenAB runs it); add storage = \"per-session\" to \
                     [session_runtime.local], and sandbox = \"auto\" for the isolation an absent \
                     sandbox key gave before 0.2"
                ),
            )),
        }
    }
}

/// What happens to the lines a local agent writes to stderr: the `agent_stderr` key.
///
/// Logged lines are `tracing` events of the runtime's crate (`runtime_shared` or
/// `runtime_local`) with the message `agent stderr: <line>` and the session id as the field
/// `session`; control characters are removed and empty lines skipped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum AgentStderr {
    /// Not read at all: the agent's stderr is `/dev/null`, as upstream v0.8.x has it:
    /// `"discard"`.
    Discard,
    /// Each line logged at ERROR: `"error"`.
    Error,
    /// Each line logged at WARN: `"warn"`.
    Warn,
    /// Each line logged at INFO: `"info"`.
    Info,
    /// Each line logged at DEBUG: `"debug"`.
    Debug,
    /// Each line logged at TRACE: `"trace"`.
    Trace,
}

impl AgentStderr {
    /// Every value, in the order they are documented.
    pub const ALL: [AgentStderr; 6] = [
        AgentStderr::Discard,
        AgentStderr::Error,
        AgentStderr::Warn,
        AgentStderr::Info,
        AgentStderr::Debug,
        AgentStderr::Trace,
    ];

    /// The configuration spelling: `"discard"`, `"error"`, `"warn"`, `"info"`, `"debug"` or
    /// `"trace"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            AgentStderr::Discard => "discard",
            AgentStderr::Error => "error",
            AgentStderr::Warn => "warn",
            AgentStderr::Info => "info",
            AgentStderr::Debug => "debug",
            AgentStderr::Trace => "trace",
        }
    }

    /// The level lines are logged at; `None` for [`AgentStderr::Discard`].
    pub fn level(&self) -> Option<tracing::Level> {
        match self {
            AgentStderr::Discard => None,
            AgentStderr::Error => Some(tracing::Level::ERROR),
            AgentStderr::Warn => Some(tracing::Level::WARN),
            AgentStderr::Info => Some(tracing::Level::INFO),
            AgentStderr::Debug => Some(tracing::Level::DEBUG),
            AgentStderr::Trace => Some(tracing::Level::TRACE),
        }
    }
}

impl fmt::Display for AgentStderr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the local runtime isolates sessions: the `sandbox` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum SandboxMode {
    /// Bubblewrap if it works on this host, else Landlock; if neither does, isolated sessions
    /// refuse to start: `"auto"`.
    Auto,
    /// Bubblewrap namespaces (mount, pid, ipc, uts, optionally network); refuse to start without
    /// it: `"bubblewrap"`.
    Bubblewrap,
    /// Landlock filesystem rules only; refuse to start without it: `"landlock"`.
    Landlock,
    /// No isolation at all: agents are plain child processes of the broker, as upstream OpenAB
    /// runs them (with per-session storage, each session still gets its own HOME and worktree
    /// directory): `"none"`. The default (since 0.2).
    #[default]
    None,
}

impl SandboxMode {
    /// The configuration spelling: `"auto"`, `"bubblewrap"`, `"landlock"` or `"none"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            SandboxMode::Auto => "auto",
            SandboxMode::Bubblewrap => "bubblewrap",
            SandboxMode::Landlock => "landlock",
            SandboxMode::None => "none",
        }
    }
}

impl fmt::Display for SandboxMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether sandboxed agents reach the network: the `network` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum NetworkMode {
    /// The host's network, as the broker sees it: `"host"`. Sessions share it: every loopback
    /// port one session's agent listens on is open to every other session, and so are its
    /// abstract UNIX sockets unless the sandbox scopes them (Landlock does, also inside
    /// bubblewrap where the kernel offers it). What a plain process (no sandbox) always has.
    #[default]
    Host,
    /// A private network namespace with no interfaces but loopback: `"none"`. Needs a sandbox.
    /// The default of sandboxed sessions without `egress` (see
    /// [`LocalConfig::effective_network`]).
    None,
    /// A private network namespace whose only way out is a proxy the runtime runs for the
    /// session, admitting only the destinations of `egress`: `"allowlist"`. Needs a sandbox.
    /// The agent gets `HTTPS_PROXY`/`HTTP_PROXY` (HTTP CONNECT, and plain HTTP requests, to a
    /// listed name or address) and `NO_PROXY` for loopback, where each listed loopback port is
    /// forwarded to the same port of the host.
    Allowlist,
}

impl NetworkMode {
    /// The configuration spelling: `"host"`, `"none"` or `"allowlist"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            NetworkMode::Host => "host",
            NetworkMode::None => "none",
            NetworkMode::Allowlist => "allowlist",
        }
    }
}

impl fmt::Display for NetworkMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A host path made visible read-only at a path inside every sandbox: one entry of `readonly`,
/// written `"HOST_PATH:SANDBOX_PATH"`.
///
/// Both paths are absolute, without `.`, `..` or `:`; the sandbox path is not `/`. Mounts are
/// read-only, always: there is no read-write variant.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ReadonlyMount {
    /// The path on the host.
    host: PathBuf,
    /// The path inside the sandbox.
    target: PathBuf,
}

impl ReadonlyMount {
    /// A mount of `host` at `target` inside the sandbox.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] with key `session_runtime.local.readonly` if either path is not
    /// absolute, contains `.`, `..` or `:`, or `target` is `/`.
    pub fn new(host: impl Into<PathBuf>, target: impl Into<PathBuf>) -> Result<Self> {
        let mount = ReadonlyMount {
            host: host.into(),
            target: target.into(),
        };
        mount
            .check()
            .map_err(|reason| invalid("local.readonly", reason))?;
        Ok(mount)
    }

    /// The path on the host.
    pub fn host(&self) -> &Path {
        &self.host
    }

    /// The path inside the sandbox.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Parses `"HOST_PATH:SANDBOX_PATH"`, returning the reason it is wrong on failure.
    fn parse(text: &str) -> std::result::Result<Self, String> {
        let mut parts = text.split(':');
        let (Some(host), Some(target), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!(
                "expected \"HOST_PATH:SANDBOX_PATH\" with two absolute paths, e.g. \
                 \"/opt/openab/skills:/skills\", found {text:?}"
            ));
        };
        let mount = ReadonlyMount {
            host: host.into(),
            target: target.into(),
        };
        mount.check().map_err(|reason| format!("{text:?}: {reason}"))?;
        Ok(mount)
    }

    /// Checks both paths.
    fn check(&self) -> std::result::Result<(), String> {
        check_mount_path("host path", &self.host)?;
        check_mount_path("sandbox path", &self.target)?;
        if self.target.parent().is_none() {
            return Err("the sandbox path must not be `/`".to_owned());
        }
        Ok(())
    }
}

impl fmt::Display for ReadonlyMount {
    /// Formats as `HOST_PATH:SANDBOX_PATH`, the configuration syntax.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host.display(), self.target.display())
    }
}

impl Serialize for ReadonlyMount {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ReadonlyMount {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        /// Accepts a `"HOST_PATH:SANDBOX_PATH"` string.
        struct MountVisitor;

        impl serde::de::Visitor<'_> for MountVisitor {
            type Value = ReadonlyMount;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string \"HOST_PATH:SANDBOX_PATH\" with two absolute paths")
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> std::result::Result<ReadonlyMount, E> {
                ReadonlyMount::parse(text).map_err(E::custom)
            }
        }

        deserializer.deserialize_str(MountVisitor)
    }
}

/// The `[session_runtime.local.limits]` table: per-session cgroup limits (cgroup v1 or v2).
///
/// Every limit is optional; an absent one is not limited.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct ResourceLimits {
    /// Memory limit in bytes. In TOML a size string in Kubernetes quantity style (`"512Mi"`,
    /// `"2Gi"`, `"1G"`; `Ki`/`Mi`/`Gi`/`Ti`/`Pi` are powers of 1024, `k`/`M`/`G`/`T`/`P` powers
    /// of 1000) or an integer number of bytes. Default `None`: unlimited.
    #[serde(with = "serde_byte_size_option", skip_serializing_if = "Option::is_none")]
    pub memory: Option<u64>,
    /// The most processes and threads a session may have at once; at least 1. Default `None`:
    /// unlimited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pids: Option<u32>,
    /// CPU time in cores (`1.5` is one and a half cores); more than zero. Default `None`:
    /// unlimited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
}

impl ResourceLimits {
    /// The smallest [`memory`](Self::memory) limit: one 4 KiB page.
    pub const MIN_MEMORY: u64 = 4096;
    /// The largest [`memory`](Self::memory) limit the kernel keeps as a limit (`i64::MAX`
    /// bytes; above it cgroups silently mean "unlimited").
    pub const MAX_MEMORY: u64 = i64::MAX as u64;
    /// The largest [`pids`](Self::pids) limit: the kernel's `PID_MAX_LIMIT` (2^22); `pids.max`
    /// refuses more.
    pub const MAX_PIDS: u32 = 1 << 22;
    /// The smallest [`cpu`](Self::cpu) limit: 0.01 cores, the kernel's minimum CFS quota of
    /// 1 ms per 100 ms period.
    pub const MIN_CPU: f64 = 0.01;
    /// The largest [`cpu`](Self::cpu) limit: the kernel's largest CFS quota (2^44 - 1 µs) per
    /// 100 ms period, about 175.9 million cores.
    pub const MAX_CPU: f64 = 175_921_860.0;

    /// Checks that every limit is one the kernel can represent: [`MIN_MEMORY`](Self::MIN_MEMORY)
    /// to [`MAX_MEMORY`](Self::MAX_MEMORY) bytes, 1 to [`MAX_PIDS`](Self::MAX_PIDS) processes,
    /// [`MIN_CPU`](Self::MIN_CPU) to [`MAX_CPU`](Self::MAX_CPU) cores. A value outside is refused
    /// rather than rounded, clamped or wrapped into something else.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the key (`session_runtime.local.limits.cpu`, ...) and the
    /// allowed range.
    pub fn validate(&self) -> Result<()> {
        if let Some(memory) = self.memory {
            if !(Self::MIN_MEMORY..=Self::MAX_MEMORY).contains(&memory) {
                return Err(invalid(
                    "local.limits.memory",
                    format!(
                        "must be {} to {} bytes, e.g. \"512Mi\" or \"2Gi\", found {memory}",
                        Self::MIN_MEMORY,
                        Self::MAX_MEMORY
                    ),
                ));
            }
        }
        if let Some(pids) = self.pids {
            if !(1..=Self::MAX_PIDS).contains(&pids) {
                return Err(invalid(
                    "local.limits.pids",
                    format!("must be 1 to {}, found {pids}", Self::MAX_PIDS),
                ));
            }
        }
        if let Some(cpu) = self.cpu {
            // `contains` is false for NaN too.
            if !(Self::MIN_CPU..=Self::MAX_CPU).contains(&cpu) {
                return Err(invalid(
                    "local.limits.cpu",
                    format!(
                        "must be a number of cores from {} to {}, e.g. 0.5 or 2, found {cpu}",
                        Self::MIN_CPU,
                        Self::MAX_CPU
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The `[session_runtime.kubernetes]` table: settings of the Kubernetes runtime.
///
/// Everything security-sensitive (image, resources, storage, read-only inputs, secrets, network
/// policy, runtime class) lives in the cluster-owned profile named here, not in the broker's
/// configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct KubernetesConfig {
    /// The namespace that holds session Pods, volumes and records. Required: a DNS label
    /// (1 to 63 characters of `a-z`, `0-9` and `-`, starting and ending with a letter or digit).
    #[serde(default)]
    pub namespace: String,
    /// The name of the cluster-owned worker profile; only an administrator can edit it and the
    /// broker cannot change it. Required: a DNS subdomain name (lower-case, up to 253 characters).
    #[serde(default)]
    pub profile: String,
    /// How the broker reaches a worker's relay. Default [`Reach::PodIp`].
    #[serde(default)]
    pub reach: Reach,
    /// How long a worker may take to become ready before the start fails. More than zero, at
    /// most [`KubernetesConfig::MAX_START_TIMEOUT`]. Default 120 seconds
    /// ([`KubernetesConfig::DEFAULT_START_TIMEOUT`]).
    #[serde(default = "KubernetesConfig::default_start_timeout", with = "serde_duration")]
    pub start_timeout: Duration,
    /// The file holding the egress gateway's key (at least 32 bytes; the same file the gateway
    /// reads), from which each session's proxy credential is derived. Needed when the profile
    /// names an `egress_gateway`; default `None`.
    #[serde(default)]
    pub egress_gateway_key_file: Option<PathBuf>,
}

impl KubernetesConfig {
    /// The default [`start_timeout`](Self::start_timeout): 120 seconds.
    pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(120);

    /// The longest [`start_timeout`](Self::start_timeout): 1 hour.
    pub const MAX_START_TIMEOUT: Duration = Duration::from_secs(3600);

    /// Settings for `namespace` and `profile`, with every other key at its default.
    pub fn new(namespace: impl Into<String>, profile: impl Into<String>) -> Self {
        KubernetesConfig {
            namespace: namespace.into(),
            profile: profile.into(),
            reach: Reach::default(),
            start_timeout: Self::DEFAULT_START_TIMEOUT,
            egress_gateway_key_file: None,
        }
    }

    /// For `#[serde(default = ...)]`.
    fn default_start_timeout() -> Duration {
        Self::DEFAULT_START_TIMEOUT
    }

    /// Checks names and the timeout.
    fn validate(&self) -> Result<()> {
        if let Err(reason) = check_dns_label(&self.namespace) {
            return Err(invalid(
                "kubernetes.namespace",
                format!("{reason}; it names the namespace that holds session Pods, e.g. \"openab-sessions\""),
            ));
        }
        if let Err(reason) = check_dns_subdomain(&self.profile) {
            return Err(invalid(
                "kubernetes.profile",
                format!("{reason}; it names the cluster-owned worker profile, e.g. \"isolated-worker\""),
            ));
        }
        if self.start_timeout.is_zero() {
            return Err(invalid(
                "kubernetes.start_timeout",
                "must be more than zero, e.g. \"120s\"",
            ));
        }
        check_at_most(
            "kubernetes.start_timeout",
            self.start_timeout,
            Self::MAX_START_TIMEOUT,
            "",
        )?;
        Ok(())
    }
}

/// How the broker reaches a worker's relay in Kubernetes: the `reach` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Reach {
    /// TCP straight to the Pod's IP, for brokers running inside the cluster: `"pod-ip"`. The
    /// default.
    #[default]
    PodIp,
    /// A stdio bridge through `pods/exec`, for brokers outside the cluster and for CI: `"exec"`.
    /// Needs `pods/exec` permission for the broker.
    Exec,
}

impl Reach {
    /// The configuration spelling: `"pod-ip"` or `"exec"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reach::PodIp => "pod-ip",
            Reach::Exec => "exec",
        }
    }
}

impl fmt::Display for Reach {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `[session_runtime.agentcore]` table: settings of the AWS Bedrock AgentCore runtime.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct AgentCoreConfig {
    /// The agent runtime's ARN,
    /// `arn:aws:bedrock-agentcore:<region>:<12-digit account>:runtime/<runtime id>`. Required.
    #[serde(default)]
    pub runtime_arn: String,
    /// The AWS region to call. Default `None`: the region in [`runtime_arn`](Self::runtime_arn);
    /// if set it must be that region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// The runtime endpoint (qualifier) to invoke: a letter, then up to 47 letters, digits or
    /// `_` (AgentCore's pattern). Default `None`: [`AgentCoreConfig::DEFAULT_QUALIFIER`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub qualifier: Option<String>,
    /// The data-plane endpoint, for a VPC endpoint or a test emulator: `https://<host>[:port]`, or
    /// `http://` to a loopback address only. Default `None`: AWS's endpoint for the region.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_url: Option<String>,
    /// Where the broker keeps session records and its relay key (the backend's authority; AgentCore
    /// keeps none). Default `/var/lib/openab/agentcore`.
    #[serde(default = "AgentCoreConfig::default_state_dir")]
    pub state_dir: PathBuf,
    /// The agent runtime's `idleRuntimeSessionTimeout`, as configured on the runtime: AgentCore
    /// stops a session's microVM after this long without traffic. 60 seconds to 8 hours; default
    /// 900 seconds. It must match the runtime's setting; the broker cannot change it.
    #[serde(default = "AgentCoreConfig::default_idle_timeout", with = "serde_duration")]
    pub idle_timeout: Duration,
    /// The agent runtime's `maxLifetime`: AgentCore stops a microVM this long after it started,
    /// busy or not. 60 seconds to 8 hours, at least `idle_timeout`; default 8 hours.
    #[serde(default = "AgentCoreConfig::default_max_lifetime", with = "serde_duration")]
    pub max_lifetime: Duration,
    /// Whether the agent runtime has a session storage filesystem (`sessionStorage`), whose mount
    /// is the relay's working directory: files there outlive a stopped microVM. Default `false`:
    /// nothing outlives the microVM, and the runtime says so.
    #[serde(default)]
    pub session_storage: bool,
    /// Whether `suspend` stops the runtime session (`StopRuntimeSession`: compute is released at
    /// once, the next attach starts a new microVM) or only detaches (the microVM idles until
    /// `idle_timeout`). Default `true`.
    #[serde(default = "AgentCoreConfig::default_stop_on_suspend")]
    pub stop_on_suspend: bool,
    /// How long an attach may take to reach the relay in the microVM (a cold start included).
    /// More than zero, at most [`AgentCoreConfig::MAX_START_TIMEOUT`]; default 120 seconds.
    #[serde(default = "AgentCoreConfig::default_start_timeout", with = "serde_duration")]
    pub start_timeout: Duration,
}

impl AgentCoreConfig {
    /// The endpoint every agent runtime has, used when no qualifier is configured: `"DEFAULT"`.
    pub const DEFAULT_QUALIFIER: &'static str = "DEFAULT";

    /// The default [`state_dir`](Self::state_dir).
    pub const DEFAULT_STATE_DIR: &'static str = "/var/lib/openab/agentcore";

    /// AgentCore's default [`idle_timeout`](Self::idle_timeout): 900 seconds.
    pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(900);

    /// AgentCore's default [`max_lifetime`](Self::max_lifetime): 8 hours.
    pub const DEFAULT_MAX_LIFETIME: Duration = Duration::from_secs(8 * 3600);

    /// The shortest idle timeout and maximum lifetime AgentCore accepts: 60 seconds.
    pub const MIN_LIFECYCLE: Duration = Duration::from_secs(60);

    /// The longest idle timeout and maximum lifetime of a microVM runtime: 8 hours.
    pub const MAX_LIFECYCLE: Duration = Duration::from_secs(8 * 3600);

    /// The default [`start_timeout`](Self::start_timeout): 120 seconds.
    pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(120);

    /// The longest [`start_timeout`](Self::start_timeout): 1 hour.
    pub const MAX_START_TIMEOUT: Duration = Duration::from_secs(3600);

    /// Settings for the runtime `runtime_arn`, with every other key at its default.
    pub fn new(runtime_arn: impl Into<String>) -> Self {
        AgentCoreConfig {
            runtime_arn: runtime_arn.into(),
            region: None,
            qualifier: None,
            endpoint_url: None,
            state_dir: Self::default_state_dir(),
            idle_timeout: Self::DEFAULT_IDLE_TIMEOUT,
            max_lifetime: Self::DEFAULT_MAX_LIFETIME,
            session_storage: false,
            stop_on_suspend: true,
            start_timeout: Self::DEFAULT_START_TIMEOUT,
        }
    }

    fn default_state_dir() -> PathBuf {
        PathBuf::from(Self::DEFAULT_STATE_DIR)
    }

    fn default_idle_timeout() -> Duration {
        Self::DEFAULT_IDLE_TIMEOUT
    }

    fn default_max_lifetime() -> Duration {
        Self::DEFAULT_MAX_LIFETIME
    }

    fn default_stop_on_suspend() -> bool {
        true
    }

    fn default_start_timeout() -> Duration {
        Self::DEFAULT_START_TIMEOUT
    }

    /// The runtime's ARN split into its parts, once [`SessionRuntimeConfig::validate`] accepted it.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming `agentcore.runtime_arn` if it is not a runtime ARN.
    pub fn parsed_arn(&self) -> Result<AgentCoreArn<'_>> {
        parse_runtime_arn(&self.runtime_arn)
            .map(|arn| AgentCoreArn {
                region: arn.region,
                account: arn.account,
                runtime_id: arn.runtime_id,
            })
            .map_err(|reason| invalid("agentcore.runtime_arn", reason))
    }

    /// The region to call: [`region`](Self::region) if set, else the region part of
    /// [`runtime_arn`](Self::runtime_arn). `None` only if neither is usable (which
    /// [`SessionRuntimeConfig::validate`] rejects).
    pub fn effective_region(&self) -> Option<&str> {
        self.region
            .as_deref()
            .or_else(|| parse_runtime_arn(&self.runtime_arn).ok().map(|arn| arn.region))
    }

    /// The endpoint to invoke: [`qualifier`](Self::qualifier) if set, else
    /// [`AgentCoreConfig::DEFAULT_QUALIFIER`].
    pub fn effective_qualifier(&self) -> &str {
        self.qualifier.as_deref().unwrap_or(Self::DEFAULT_QUALIFIER)
    }

    /// Checks every key (as [`SessionRuntimeConfig::validate`] does for the table).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first bad key.
    pub fn validate(&self) -> Result<()> {
        let arn = parse_runtime_arn(&self.runtime_arn)
            .map_err(|reason| invalid("agentcore.runtime_arn", reason))?;
        if let Some(region) = &self.region {
            if !is_region(region) {
                return Err(invalid(
                    "agentcore.region",
                    format!("expected an AWS region such as \"us-east-1\", found {region:?}"),
                ));
            }
            if region != arn.region {
                return Err(invalid(
                    "agentcore.region",
                    format!(
                        "{region:?} is not the region of runtime_arn ({:?}); remove it or make them agree",
                        arn.region
                    ),
                ));
            }
        }
        if let Some(qualifier) = &self.qualifier {
            // AgentCore's pattern for endpoint names: `[a-zA-Z][a-zA-Z0-9_]{0,47}`.
            let mut bytes = qualifier.bytes();
            let ok = bytes.next().is_some_and(|first| first.is_ascii_alphabetic())
                && qualifier.len() <= 48
                && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !ok {
                return Err(invalid(
                    "agentcore.qualifier",
                    format!(
                        "expected an endpoint name: a letter, then up to 47 letters, digits or `_` (AgentCore's pattern [a-zA-Z][a-zA-Z0-9_]{{0,47}}), e.g. \"DEFAULT\", found {qualifier:?}"
                    ),
                ));
            }
        }
        if let Some(url) = &self.endpoint_url {
            check_endpoint_url(url).map_err(|reason| invalid("agentcore.endpoint_url", reason))?;
        }
        if !self.state_dir.is_absolute() {
            return Err(invalid(
                "agentcore.state_dir",
                format!("must be an absolute path, found {:?}", self.state_dir),
            ));
        }
        for (key, value) in [
            ("agentcore.idle_timeout", self.idle_timeout),
            ("agentcore.max_lifetime", self.max_lifetime),
        ] {
            if value < Self::MIN_LIFECYCLE {
                return Err(invalid(
                    key,
                    format!(
                        "{} is shorter than AgentCore allows (60s); set it to the agent runtime's lifecycle setting",
                        values::format_duration(value)
                    ),
                ));
            }
            check_at_most(
                key,
                value,
                Self::MAX_LIFECYCLE,
                " (AgentCore's limit for microVM runtimes)",
            )?;
        }
        if self.idle_timeout > self.max_lifetime {
            return Err(invalid(
                "agentcore.idle_timeout",
                "must not be longer than max_lifetime (AgentCore refuses such a lifecycle)",
            ));
        }
        if self.start_timeout.is_zero() {
            return Err(invalid(
                "agentcore.start_timeout",
                "must be more than zero, e.g. \"120s\"",
            ));
        }
        check_at_most(
            "agentcore.start_timeout",
            self.start_timeout,
            Self::MAX_START_TIMEOUT,
            "",
        )?;
        Ok(())
    }
}

/// The parts of an AgentCore runtime ARN, from [`AgentCoreConfig::parsed_arn`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct AgentCoreArn<'a> {
    /// The region, e.g. `us-east-1`.
    pub region: &'a str,
    /// The 12-digit account id.
    pub account: &'a str,
    /// The runtime id, e.g. `my_agent-AbCdEf1234`.
    pub runtime_id: &'a str,
}

/// Checks an endpoint override: `https://host[:port]` or `http://` to loopback, no path.
fn check_endpoint_url(url: &str) -> std::result::Result<(), String> {
    let expected =
        || format!("expected https://<host>[:port] (or http:// to a loopback address), found {url:?}");
    let (scheme, rest) = url.split_once("://").ok_or_else(expected)?;
    let authority = rest.strip_suffix('/').unwrap_or(rest);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@', ' ']) {
        return Err(expected());
    }
    let host = match authority.strip_prefix('[') {
        Some(bracketed) => bracketed
            .split_once(']')
            .map(|(host, _)| host)
            .ok_or_else(expected)?,
        None => authority.split(':').next().unwrap_or_default(),
    };
    match scheme {
        "https" => Ok(()),
        "http"
            if host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()) =>
        {
            Ok(())
        }
        "http" => Err(format!(
            "plain http is allowed only to a loopback address (an emulator), found {url:?}; use https"
        )),
        _ => Err(expected()),
    }
}

/// The parts of an AgentCore runtime ARN that are checked.
struct RuntimeArn<'a> {
    /// The region part.
    region: &'a str,
    /// The account part.
    account: &'a str,
    /// The runtime id.
    runtime_id: &'a str,
}

/// Whether `region` looks like an AWS region: `<2 letters>-<words>-<number>`, e.g. `us-east-1`,
/// `us-gov-west-1`, `cn-north-1`.
fn is_region(region: &str) -> bool {
    let parts: Vec<&str> = region.split('-').collect();
    parts.len() >= 3
        && parts[0].len() == 2
        && parts[0].bytes().all(|b| b.is_ascii_lowercase())
        && parts[1..parts.len() - 1]
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_lowercase()))
        && parts
            .last()
            .is_some_and(|n| !n.is_empty() && n.len() <= 2 && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Loosely checks `arn:<partition>:bedrock-agentcore:<region>:<account>:runtime/<id>`.
fn parse_runtime_arn(arn: &str) -> std::result::Result<RuntimeArn<'_>, String> {
    let expected = || {
        format!(
            "expected arn:aws:bedrock-agentcore:<region>:<12-digit account>:runtime/<runtime id>, found {arn:?}"
        )
    };
    let parts: Vec<&str> = arn.splitn(6, ':').collect();
    let [prefix, partition, service, region, account, resource] = parts[..] else {
        return Err(expected());
    };
    let lower_dashed = |s: &str| {
        !s.is_empty()
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    };
    let id = resource.strip_prefix("runtime/").unwrap_or("");
    let ok = prefix == "arn"
        && partition.starts_with("aws")
        && lower_dashed(partition)
        && service == "bedrock-agentcore"
        && is_region(region)
        && account.len() == 12
        && account.bytes().all(|b| b.is_ascii_digit())
        && !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(RuntimeArn {
            region,
            account,
            runtime_id: id,
        })
    } else {
        Err(expected())
    }
}

/// Checks an RFC 1123 DNS label, such as a Kubernetes namespace or volume name: 1 to 63
/// characters of `a-z`, `0-9` and `-`, not starting or ending with `-`.
///
/// # Errors
///
/// The reason, for [`Error::InvalidConfig`]: `is required and must not be empty` for `""`, else
/// `expected 1 to 63 characters of a-z, 0-9 and '-', not starting or ending with '-', found
/// "<name>"`.
pub fn check_dns_label(name: &str) -> std::result::Result<(), String> {
    let ok = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else if name.is_empty() {
        Err("is required and must not be empty".to_owned())
    } else {
        Err(format!(
            "expected 1 to 63 characters of a-z, 0-9 and '-', not starting or ending with '-', found {name:?}"
        ))
    }
}

/// Checks an RFC 1123 DNS subdomain name, such as the name of a Kubernetes ConfigMap, Secret or
/// claim: up to 253 characters, DNS labels joined by `.`.
///
/// # Errors
///
/// The reason, for [`Error::InvalidConfig`]: `is required and must not be empty` for `""`, else
/// `expected a DNS subdomain name (...), found "<name>"`.
pub fn check_dns_subdomain(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() {
        return Err("is required and must not be empty".to_owned());
    }
    if name.len() <= 253 && name.split('.').all(|label| check_dns_label(label).is_ok()) {
        Ok(())
    } else {
        Err(format!(
            "expected a DNS subdomain name (lower-case letters, digits, '-' and '.', up to 253 characters), found {name:?}"
        ))
    }
}

/// Checks that a configured path is absolute.
fn check_absolute(key: &str, path: &Path) -> Result<()> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(invalid(key, format!("{} is not an absolute path", quoted(path))))
    }
}

/// An [`Error::InvalidConfig`] for `key`, given relative to the section (`local.root`).
/// An [`Error::InvalidConfig`] for `key` if `duration` is longer than `max` (`hint` is appended
/// to the reason).
fn check_at_most(key: &str, duration: Duration, max: Duration, hint: &str) -> Result<()> {
    if duration <= max {
        return Ok(());
    }
    Err(invalid(
        key,
        format!(
            "{} is longer than the most allowed, {}{hint}",
            values::format_duration(duration),
            values::format_duration(max)
        ),
    ))
}

fn invalid(key: &str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        key: format!("{SECTION_NAME}.{key}"),
        reason: reason.into(),
    }
}

/// Deserializes the TOML document `text`, reporting any failure as an [`Error::InvalidConfig`]
/// the way this module reports its own.
///
/// `key` names the document in errors, e.g. `profile/isolated-worker`: the error's key is `key`
/// followed by the dotted path of the offending key (`profile/isolated-worker.storage.size`), or
/// `key` alone where no key is known, as for a TOML syntax error (the reason then starts with
/// `not valid TOML: `, which holds when `T` is a struct or a map, as documents are). A problem in
/// the `n`th entry of an array starts its reason with `entry n: `. The reason ends with the line and
/// column when known, followed by ` of <file>` when `file` is given: ` (at line 3, column 8 of
/// profile.toml)`.
///
/// # Errors
///
/// [`Error::InvalidConfig`] for a TOML syntax error, an unknown key (with
/// `#[serde(deny_unknown_fields)]`) or a value of the wrong type or format.
pub fn deserialize_toml<T: DeserializeOwned>(text: &str, key: &str, file: Option<&str>) -> Result<T> {
    deserialize_toml_below(text, &[key], file)
}

/// Deserializes `text` as TOML, reporting the full key path of any error. `prefix` are the keys
/// in front of the document's own keys; with none, an error in no key is reported with the key
/// `session_runtime`. `file` names the document after its line and column.
fn deserialize_toml_below<T: DeserializeOwned>(text: &str, prefix: &[&str], file: Option<&str>) -> Result<T> {
    serde_path_to_error::deserialize(toml::Deserializer::new(text)).map_err(|err| {
        let (key, mut reason) = key_and_entries(prefix, err.path());
        let inner = err.inner();
        // Every value here sits below a table, so an error at the root is in the TOML syntax.
        if err.path().iter().next().is_none() {
            reason.insert_str(0, "not valid TOML: ");
        }
        let message = inner.message().trim();
        if message.is_empty() {
            reason.push_str("unexpected input");
        } else {
            // toml puts hints on lines of their own.
            reason.push_str(&message.replace('\n', "; "));
        }
        if let Some(span) = inner.span() {
            let (line, column) = line_column(text, span.start);
            let of_file = file.map(|file| format!(" of {file}")).unwrap_or_default();
            reason.push_str(&format!(" (at line {line}, column {column}{of_file})"));
        }
        Error::InvalidConfig { key, reason }
    })
}

/// Deserializes a document that arrived as JSON (a custom resource's `spec`), reporting any
/// failure as [`deserialize_toml`] does: the key is `key` followed by the dotted path of the
/// offending key, and a problem in the `n`th entry of an array starts its reason with
/// `entry n: `.
///
/// # Errors
///
/// [`Error::InvalidConfig`] for an unknown key (with `#[serde(deny_unknown_fields)]`) or a value
/// of the wrong type or format.
pub fn deserialize_json<T: DeserializeOwned>(value: serde_json::Value, key: &str) -> Result<T> {
    serde_path_to_error::deserialize(value).map_err(|err| {
        let (key, mut reason) = key_and_entries(&[key], err.path());
        reason.push_str(&err.inner().to_string());
        Error::InvalidConfig { key, reason }
    })
}

/// The dotted key of `path` below `prefix` (or the section's name when both are empty), and the
/// reason's start naming each array entry on the way (`entry 2: `).
fn key_and_entries(prefix: &[&str], path: &serde_path_to_error::Path) -> (String, String) {
    let mut key: Vec<&str> = prefix.to_vec();
    let mut entries = String::new();
    for segment in path {
        match segment {
            serde_path_to_error::Segment::Map { key: part } => key.push(part),
            serde_path_to_error::Segment::Seq { index } => {
                entries.push_str(&format!("entry {}: ", index + 1))
            }
            serde_path_to_error::Segment::Enum { .. } | serde_path_to_error::Segment::Unknown => {}
        }
    }
    let key = if key.is_empty() {
        SECTION_NAME.to_owned()
    } else {
        key.join(".")
    };
    (key, entries)
}

/// The 1-based line and column (in characters) of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[line_start..].chars().count() + 1)
}

/// Serde adapter for [`SessionRuntimeConfig::idle_ttl`]: a duration string where zero means
/// `None`; `None` is written as `"0s"`.
mod idle_ttl {
    use std::time::Duration;

    use serde::{Deserializer, Serializer};

    use super::{serde_duration, IdleTtl};

    /// Writes the TTL, or `"0s"` for never (an unset key is skipped).
    pub(super) fn serialize<S: Serializer>(ttl: &Option<IdleTtl>, serializer: S) -> Result<S::Ok, S::Error> {
        let written = match ttl {
            Some(IdleTtl::After(ttl)) => *ttl,
            Some(IdleTtl::Never) | None => Duration::ZERO,
        };
        serde_duration::serialize(&written, serializer)
    }

    /// Reads a duration string; zero is never. Only called for a present key.
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<IdleTtl>, D::Error> {
        serde_duration::deserialize(deserializer).map(|ttl| {
            Some(if ttl.is_zero() {
                IdleTtl::Never
            } else {
                IdleTtl::After(ttl)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn line_and_column() {
        let text = "a = 1\nbé = 2\n";
        assert_eq!(line_column(text, 0), (1, 1));
        assert_eq!(line_column(text, 6), (2, 1));
        assert_eq!(line_column(text, 9), (2, 3));
        assert_eq!(line_column(text, 100), (3, 1));
    }

    #[test]
    fn documents_of_other_keys() {
        #[derive(Debug, Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Doc {
            #[allow(dead_code)]
            size: u8,
        }
        let err = deserialize_toml::<Doc>("size = 300\n", "profile/p", Some("profile.toml")).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidConfig { key, reason }
                if key == "profile/p.size" && reason.ends_with("(at line 1, column 8 of profile.toml)")),
            "{err:?}"
        );
        let err = deserialize_toml::<Doc>("size = \n", "profile/p", None).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidConfig { key, reason }
                if key == "profile/p" && reason.starts_with("not valid TOML: ") && reason.ends_with("column 8)")),
            "{err:?}"
        );
    }

    #[test]
    fn overlay_working_dirs_are_absolute_and_for_shared_storage_only() {
        let config = SessionRuntimeConfig::from_toml_section("[local]\nworking_dirs = [\"/home/agent\"]")
            .expect("an absolute directory with shared storage");
        assert_eq!(config.local.working_dirs, [PathBuf::from("/home/agent")]);
        for text in [
            "[local]\nworking_dirs = [\"home/agent\"]",
            "[local]\nstorage = \"per-session\"\nworking_dirs = [\"/home/agent\"]",
        ] {
            match SessionRuntimeConfig::from_toml_section(text) {
                Err(Error::InvalidConfig { key, .. }) => {
                    assert_eq!(key, "session_runtime.local.working_dirs", "{text}")
                }
                other => panic!("{text}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    #[test]
    fn agentcore_keys_are_checked_and_named() {
        let arn = "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/example";
        let parse = |extra: &str| {
            let text = format!("type = \"agentcore\"\n[agentcore]\nruntime_arn = \"{arn}\"\n{extra}");
            SessionRuntimeConfig::from_toml_section(&text)
        };
        let config = parse("").expect("defaults are valid");
        let agentcore = config.agentcore.expect("the table");
        assert_eq!(agentcore, AgentCoreConfig::new(arn));
        assert_eq!(agentcore.idle_timeout, Duration::from_secs(900));
        assert_eq!(agentcore.max_lifetime, Duration::from_secs(8 * 3600));
        let parsed = agentcore.parsed_arn().expect("an ARN");
        assert_eq!(
            (parsed.region, parsed.account, parsed.runtime_id),
            ("us-east-1", "123456789012", "example")
        );
        assert!(parse("endpoint_url = \"http://127.0.0.1:4566\"\nidle_timeout = \"60s\"").is_ok());
        assert!(
            parse("endpoint_url = \"https://vpce-1.bedrock-agentcore.us-east-1.vpce.amazonaws.com\"").is_ok()
        );
        for (extra, key) in [
            ("region = \"useast1\"", "agentcore.region"),
            ("region = \"us-west-2\"", "agentcore.region"),
            ("endpoint_url = \"http://10.0.0.1\"", "agentcore.endpoint_url"),
            ("endpoint_url = \"https://host/path\"", "agentcore.endpoint_url"),
            ("endpoint_url = \"ftp://host\"", "agentcore.endpoint_url"),
            ("state_dir = \"relative\"", "agentcore.state_dir"),
            ("idle_timeout = \"59s\"", "agentcore.idle_timeout"),
            ("idle_timeout = \"9h\"", "agentcore.idle_timeout"),
            ("max_lifetime = \"30s\"", "agentcore.max_lifetime"),
            (
                "idle_timeout = \"2h\"\nmax_lifetime = \"1h\"",
                "agentcore.idle_timeout",
            ),
            ("start_timeout = \"0s\"", "agentcore.start_timeout"),
            ("start_timeout = \"2h\"", "agentcore.start_timeout"),
            // The service's pattern for endpoint names is `[a-zA-Z][a-zA-Z0-9_]{0,47}`.
            ("qualifier = \"my-endpoint\"", "agentcore.qualifier"),
            ("qualifier = \"1st\"", "agentcore.qualifier"),
            ("qualifier = \"_x\"", "agentcore.qualifier"),
            (
                "qualifier = \"a234567890123456789012345678901234567890123456789\"",
                "agentcore.qualifier",
            ),
        ] {
            match parse(extra) {
                Err(Error::InvalidConfig { key: got, .. }) => {
                    assert_eq!(got, format!("session_runtime.{key}"), "{extra}");
                }
                other => panic!("{extra}: expected an error naming {key}, got {other:?}"),
            }
        }
    }

    #[test]
    fn runtime_arns() {
        for good in [
            "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/example",
            "arn:aws-cn:bedrock-agentcore:cn-north-1:123456789012:runtime/my_agent-AbCdEf1234",
        ] {
            assert!(parse_runtime_arn(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            "example",
            "arn:aws:bedrock:us-east-1:123456789012:runtime/example",
            "arn:aws:bedrock-agentcore:us-east-1:1234:runtime/example",
            "arn:aws:bedrock-agentcore:us-east-1:123456789012:agent/example",
            "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/",
            "arn:aws:bedrock-agentcore::123456789012:runtime/example",
            "arn:aws:bedrock-agentcore:us-east-1:123456789012:runtime/ex/ample",
            "arn:aws:bedrock-agentcore:useast1:123456789012:runtime/example",
            "arn:aws:bedrock-agentcore:us-east:123456789012:runtime/example",
        ] {
            assert!(parse_runtime_arn(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn dns_names() {
        assert!(check_dns_label("prod-bot").is_ok());
        assert!(check_dns_label("0").is_ok());
        assert!(check_dns_label(&"a".repeat(63)).is_ok());
        for bad in ["", "-a", "a-", "Prod", "a_b", "a.b", &"a".repeat(64)] {
            assert!(check_dns_label(bad).is_err(), "{bad}");
        }
        assert!(check_dns_subdomain("isolated-worker.v2").is_ok());
        for bad in ["", ".a", "a..b", "A", "a."] {
            assert!(check_dns_subdomain(bad).is_err(), "{bad}");
        }
    }
}
