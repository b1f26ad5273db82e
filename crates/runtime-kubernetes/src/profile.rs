//! The cluster-owned worker profile: everything security-sensitive about a session's worker.
//!
//! The image, its command, resources, storage, read-only inputs, secret references, network
//! reach, runtime class and lifetimes of every worker come from an `OabProfile` in the sessions
//! namespace that only an administrator can edit. The broker's configuration merely names it
//! (`[session_runtime.kubernetes] profile = "isolated-worker"`) and the broker can only read it, so
//! neither a chat message nor a compromised broker configuration can widen what a worker may do.
//!
//! Its `spec` holds the keys below; in their TOML form (a document such as [`PROFILE_KEY`] names,
//! which [`WorkerProfile::from_toml`] reads and [`WorkerProfile::resource_from_toml`] turns into
//! the object):
//!
//! ```toml
//! image = "openab.dev/worker:test"            # required
//! image_pull_policy = "IfNotPresent"          # Always | IfNotPresent | Never; default IfNotPresent
//! agent = ["/usr/local/bin/acp-test-agent"]   # required: argv the relay runs inside the worker
//! relay_port = 7780                           # default 7780
//! mount_path = "/workspace"                   # default "/workspace"
//! home_path = "/home/agent"                   # default "/home/agent"
//! # volume_path = "/session"   # a volume of its own mounted whole, with mount_path and home_path
//!                              # in it and no init container: see WorkerProfile::volume_path
//! runtime_class = "gvisor"                    # default: the cluster's default runtime
//! egress = ["10.0.0.0/8", "fd00::/8"]         # default: none
//! egress_gateway = "openab-egress-gateway:3128" # the egress gateway's Service as workers reach it
//! egress_hosts = ["github.com:443"]           # through the gateway; default: none
//! seed_hosts = ["github.com"]                 # where clone seeds may come from; default: none
//! idle_ttl = "30m"                            # default: the broker's idle_ttl
//! max_lifetime = "8h"                         # default: no limit
//! termination_grace = "10s"                   # default "10s"
//! unschedulable_timeout = "2m"                # default: the broker's start_timeout
//! warm_pool = 4                               # started workers kept ready to claim; default 0
//!
//! [resources]                                 # every key optional
//! cpu_request = "250m"
//! cpu_limit = "2"
//! memory_request = "256Mi"
//! memory_limit = "1Gi"
//! ephemeral_storage_limit = "512Mi"
//!
//! [storage]                                   # default: kind = "per-session", size = "1Gi"
//! kind = "per-session"                        # per-session | ephemeral | borrowed
//!                                             # ephemeral: size_limit, or container_layer = true
//! class = "openab-test-local"
//! size = "1Gi"
//! access_mode = "ReadWriteOnce"               # ReadWriteOnce | ReadWriteOncePod
//!
//! skills_read_only = "recursive"            # recursive | if-possible; default "recursive"
//!
//! [[skills]]
//! name = "skills"
//! mount_path = "/skills"
//! config_map = "agent-skills"                 # or claim = "skills-volume"; exactly one
//! version = "v3"
//!
//! [home_template]                            # copied into a new session's HOME at create
//! config_map = "agent-home"                   # or secret = "agent-home"; exactly one
//!
//! [[model_routes]]                           # through the gateway, which adds the key
//! prefix = "/openai/"
//! upstream = "https://api.openai.com"
//! header = "Authorization"
//! secret = { name = "model-keys", key = "openai" }   # mounted in the gateway, never the worker
//! base_url_env = "OPENAI_BASE_URL"            # optional: set to http://GATEWAY/openai
//! key_env = "OPENAI_API_KEY"                  # optional: set to the session's route key
//!
//! [[env]]
//! name = "ANTHROPIC_API_KEY"
//! secret = "agent-credentials"
//! key = "anthropic"
//!
//! [retention]                                 # overrides [session_runtime.retention]
//! ended = "retain"
//! retain_for = "7d"
//! ```
//!
//! An administrator writes it as the `spec` of an `OabProfile` (the same keys, in YAML:
//! [`WorkerProfile::resource`]), which the API server checks against the resource's schema at
//! apply; [`WorkerProfile::from_resource`] (or [`WorkerProfile::from_toml`]) parses and validates
//! all of it. Every refusal is an [`Error::InvalidConfig`] whose key is
//! `profile/<OabProfile name>.<key>`,
//! e.g. `profile/isolated-worker.storage.size`; a problem in the `n`th entry of an array of
//! tables starts its reason with `entry n:`.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use egress_proxy::routes::{check_routes, ModelRoute};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use serde::Deserialize;
use session_runtime::config::{
    self, check_dns_label, check_dns_subdomain, deserialize_json, deserialize_toml, serde_duration,
    AddressKind, EgressTarget,
};
use session_runtime::{Error, Retention, RetentionPolicy};

pub use crate::clone_source::SeedHost;

/// The file name of a profile's TOML form (the gateway's `--profiles` directory holds
/// `NAME.toml` files of the same form).
pub const PROFILE_KEY: &str = "profile.toml";

/// The prefix of the environment variables the runtime sets for the relay; a profile's
/// [`SecretEnv`] may not use it, so it can never shadow them.
pub const RESERVED_ENV_PREFIX: &str = "OAB_RELAY_";

/// A validated worker profile: how every worker Pod of this runtime is built.
///
/// Only [`from_toml`](Self::from_toml) and [`from_resource`](Self::from_resource) make one,
/// so a profile in hand has passed validation.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerProfile {
    name: String,
    version: String,
    /// The OabProfile's UID when read from one: what owns the profile's warm pool members.
    uid: Option<String>,
    /// The worker image. Required; no whitespace. Its entrypoint must be the worker relay.
    pub image: String,
    /// When the kubelet pulls [`image`](Self::image). Default [`PullPolicy::IfNotPresent`].
    pub image_pull_policy: PullPolicy,
    /// The agent's argv, which the relay spawns inside the worker. Required: at least the
    /// program, and no argument may be empty.
    pub agent: Vec<String>,
    /// The TCP port the relay listens on. Default [`WorkerProfile::DEFAULT_RELAY_PORT`]; not 0.
    pub relay_port: u16,
    /// CPU, memory and ephemeral storage of the worker container. Default: none set.
    pub resources: Resources,
    /// Where the session's workspace, HOME and agent state live. Default
    /// [`Storage::default`]: a 1Gi claim per session.
    pub storage: Storage,
    /// Where the workspace is mounted in the worker (the agent's working directory). Default
    /// [`WorkerProfile::DEFAULT_MOUNT_PATH`].
    pub mount_path: String,
    /// Where HOME is mounted in the worker. Default [`WorkerProfile::DEFAULT_HOME_PATH`].
    pub home_path: String,
    /// Where a volume of the session's own (`per-session` or `ephemeral` storage) is mounted
    /// whole, with the workspace and HOME as its `workspace` and `home` directories, which the
    /// relay makes as the worker user before it starts the agent: no init container runs, so a
    /// new session's worker is Ready as soon as a Pod without one (see `docs/kubernetes.md`).
    /// [`mount_path`](Self::mount_path) and [`home_path`](Self::home_path) then default to
    /// `<volume_path>/workspace` and `<volume_path>/home`, and may only be written as those.
    /// Default `None`: the workspace and HOME are mounted as subPaths where `mount_path` and
    /// `home_path` say, and a volume's first worker makes them in an init container (the kubelet
    /// would make them as root). Refused with `borrowed` storage, whose volume holds other
    /// sessions' directories.
    pub volume_path: Option<String>,
    /// Read-only inputs mounted into every worker (skills, tools, reference data). Default none.
    pub skills: Vec<ReadOnlyInput>,
    /// Whether [`skills`](Self::skills) must be read-only all the way down (submounts
    /// included), or only where the node's runtime can do it. Default
    /// [`SkillsReadOnly::Recursive`].
    pub skills_read_only: SkillsReadOnly,
    /// Files copied into every new session's HOME when it is created (each key of the
    /// ConfigMap or Secret becomes a file). Default none.
    pub home_template: Option<HomeTemplate>,
    /// Environment variables taken from Secrets by reference. Default none.
    pub env: Vec<SecretEnv>,
    /// The Pod's `runtimeClassName` (e.g. a gVisor or Kata class). Default `None`: the
    /// cluster's default runtime.
    pub runtime_class: Option<String>,
    /// CIDRs workers may open connections to, besides what the NetworkPolicy always allows.
    /// Default empty: no egress.
    pub egress: Vec<String>,
    /// The egress gateway (`oab-egress-gateway`) as workers reach it, `host:port` (its Service's
    /// name, or its cluster IP where Pods have no DNS). Required with
    /// [`egress_hosts`](Self::egress_hosts); default `None`: workers get no proxy.
    pub egress_gateway: Option<EgressTarget>,
    /// The destinations (`host:port`, with the kind of address a name may resolve to, as
    /// [`EgressTarget::parse`] reads them) workers may reach by name through the egress
    /// gateway, which holds the same list (it reads this key of the same profile). Default
    /// empty: nothing through the gateway.
    pub egress_hosts: Vec<EgressTarget>,
    /// Model providers workers reach through the egress gateway, which replaces the session's
    /// route key with the provider's credential from a Secret only the gateway mounts (see
    /// [`egress_proxy::routes`]). Default empty.
    pub model_routes: Vec<ModelRoute>,
    /// The origins a [`WorkspaceSeed::GitClone`](session_runtime::WorkspaceSeed::GitClone) may
    /// clone from (see [`SeedHost::parse`]). Default empty: clone seeds are refused. A URL is
    /// checked against it at create; local paths, `file://` and transport helpers never pass.
    pub seed_hosts: Vec<SeedHost>,
    /// How long a worker may sit idle before it is suspended. `None` (key absent): the broker's
    /// `[session_runtime] idle_ttl` applies.
    pub idle_ttl: Option<Duration>,
    /// The longest one worker may run, however busy. `None` (key absent): no limit.
    pub max_lifetime: Option<Duration>,
    /// Changes to the broker's `[session_runtime.retention]` policy for this profile's
    /// sessions. `None` (table absent): the broker's policy applies unchanged.
    pub retention: Option<RetentionOverrides>,
    /// How long the worker has to exit after SIGTERM before it is killed. Whole seconds, since
    /// that is what Kubernetes counts. Default [`WorkerProfile::DEFAULT_TERMINATION_GRACE`].
    pub termination_grace: Duration,
    /// How long an attach waits for a worker the scheduler cannot place (no node has room: an
    /// autoscaler may be adding one) before it fails `Unschedulable` and removes the Pod. `None`
    /// (key absent): the broker's `start_timeout`, which also bounds it.
    pub unschedulable_timeout: Option<Duration>,
    /// How many started workers with no session yet the broker keeps ready for this profile
    /// (at most [`MAX_WARM_POOL`](Self::MAX_WARM_POOL)): an attach that would start a worker
    /// claims one instead, binds it to the session and starts the agent in it. 0 (the default):
    /// every worker starts cold. Only for `ephemeral` storage (a volume made for a session at
    /// create cannot be mounted into a Pod that is already running), and only for brokers given
    /// their key ([`broker_key`](crate::KubernetesRuntimeBuilder::broker_key): a member is bound
    /// with a token of that key); see docs/kubernetes.md.
    pub warm_pool: u32,
}

impl WorkerProfile {
    /// The largest [`warm_pool`](Self::warm_pool): 100 workers.
    pub const MAX_WARM_POOL: u32 = 100;
    /// The default [`relay_port`](Self::relay_port): 7780.
    pub const DEFAULT_RELAY_PORT: u16 = 7780;
    /// The default [`mount_path`](Self::mount_path): `/workspace`.
    pub const DEFAULT_MOUNT_PATH: &'static str = "/workspace";
    /// The default [`home_path`](Self::home_path): `/home/agent`.
    pub const DEFAULT_HOME_PATH: &'static str = "/home/agent";
    /// The default [`termination_grace`](Self::termination_grace): 10 seconds.
    pub const DEFAULT_TERMINATION_GRACE: Duration = Duration::from_secs(10);
    /// The longest [`max_lifetime`](Self::max_lifetime): 30 days.
    pub const MAX_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);

    /// Parses and validates a profile document.
    ///
    /// `name` is the OabProfile's name (it prefixes every error key); `version` is its
    /// `metadata.resourceVersion`, kept so the runtime can record which profile version a worker
    /// was started with.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] with key `profile/<name>.<key>`: for a TOML syntax error (key
    /// `profile/<name>` when no key is known), an unknown key, a value of the wrong type or
    /// format, a missing required key, or values that contradict each other.
    pub fn from_toml(name: &str, version: &str, document: &str) -> Result<WorkerProfile, Error> {
        let document: Document = deserialize_toml(document, &format!("profile/{name}"), Some(PROFILE_KEY))?;
        let profile = document.into_profile(name, version);
        profile.validate()?;
        Ok(profile)
    }

    /// The custom resource an administrator writes a profile as: `OabProfile`
    /// (`openab.dev/v1alpha1`, deploy/helm/openab-session-runtime/crds/oabprofiles.yaml), whose
    /// `spec` holds the keys of [`PROFILE_KEY`]'s document under the same names.
    pub fn resource() -> ApiResource {
        use session_runtime::config::profile_resource::{GROUP, KIND, PLURAL, VERSION};
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
    }

    /// Parses and validates an `OabProfile` (see [`resource`](Self::resource)).
    ///
    /// The profile's name is the object's `metadata.name` and its version the
    /// `metadata.resourceVersion`. The API server has checked what the resource's schema can
    /// say; everything else is checked here as for [`from_toml`](Self::from_toml).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] with key `profile/<name>.<key>`, as for
    /// [`from_toml`](Self::from_toml).
    pub fn from_resource(object: &DynamicObject) -> Result<WorkerProfile, Error> {
        let name = object.metadata.name.as_deref().unwrap_or_default();
        let version = object.metadata.resource_version.as_deref().unwrap_or_default();
        let spec = object
            .data
            .get("spec")
            .cloned()
            .unwrap_or_else(|| serde_json::Value::Object(serde_json::Map::new()));
        let document: Document = deserialize_json(spec, &format!("profile/{name}"))?;
        let mut profile = document.into_profile(name, version);
        profile.uid = object.metadata.uid.clone();
        profile.validate()?;
        Ok(profile)
    }

    /// The `OabProfile` named `name` whose `spec` is `document`, a profile in its TOML form (as
    /// [`from_toml`](Self::from_toml) reads it): what an administrator's tooling, or a test,
    /// creates. Only the TOML is checked here; the API server checks the resource's schema.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] with key `profile/<name>` for a TOML syntax error.
    pub fn resource_from_toml(name: &str, document: &str) -> Result<DynamicObject, Error> {
        let spec: serde_json::Value =
            deserialize_toml(document, &format!("profile/{name}"), Some(PROFILE_KEY))?;
        let mut object = DynamicObject::new(name, &Self::resource());
        object.data = serde_json::json!({ "spec": spec });
        Ok(object)
    }

    /// The profile's name: the name of the OabProfile it came from.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The profile's version: the OabProfile's `metadata.resourceVersion` when it was read.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The OabProfile's UID, for a profile read from one.
    pub(crate) fn uid(&self) -> Option<&str> {
        self.uid.as_deref()
    }

    /// Whether the session's directories live in the worker container's own writable layer
    /// (ephemeral storage with `container_layer = true`): no volume at all.
    pub(crate) fn in_container_layer(&self) -> bool {
        matches!(
            self.storage,
            Storage::Ephemeral {
                container_layer: true,
                ..
            }
        )
    }

    /// An [`Error::InvalidConfig`] for `key` of this profile.
    fn invalid(&self, key: &str, reason: impl Into<String>) -> Error {
        invalid(&self.name, key, reason)
    }

    /// Checks everything the types alone cannot; the first problem found is reported.
    fn validate(&self) -> Result<(), Error> {
        self.check_command()?;
        self.resources.check(self)?;
        self.storage.check(self)?;
        self.check_mounts()?;
        self.check_env()?;
        if let Some(template) = &self.home_template {
            if matches!(self.storage, Storage::Ephemeral { .. }) {
                return Err(self.invalid(
                    "home_template",
                    "needs storage that outlives the seed Job: kind = \"per-session\" or \"borrowed\"",
                ));
            }
            let (key, name) = match template {
                HomeTemplate::ConfigMap(name) => ("home_template.config_map", name),
                HomeTemplate::Secret(name) => ("home_template.secret", name),
            };
            check_dns_subdomain(name)
                .map_err(|reason| self.invalid(key, format!("{reason}, e.g. \"agent-home\"")))?;
        }
        if let Some(class) = &self.runtime_class {
            check_dns_subdomain(class)
                .map_err(|reason| self.invalid("runtime_class", format!("{reason}, e.g. \"gvisor\"")))?;
        }
        for (index, cidr) in self.egress.iter().enumerate() {
            check_cidr(cidr)
                .map_err(|reason| self.invalid("egress", format!("entry {}: {reason}", index + 1)))?;
        }
        self.check_gateway()?;
        self.check_warm_pool()?;
        self.check_durations()
    }

    /// A pool holds started Pods, so what each session gets at create must be nothing a Pod
    /// mounts: only ephemeral storage qualifies.
    fn check_warm_pool(&self) -> Result<(), Error> {
        if self.warm_pool > Self::MAX_WARM_POOL {
            return Err(self.invalid(
                "warm_pool",
                format!(
                    "{} is more than the most allowed, {}; e.g. warm_pool = 4",
                    self.warm_pool,
                    Self::MAX_WARM_POOL
                ),
            ));
        }
        if self.warm_pool > 0 && !matches!(self.storage, Storage::Ephemeral { .. }) {
            return Err(self.invalid(
                "warm_pool",
                "needs storage kind = \"ephemeral\": a session's own or borrowed volume is \
                 chosen at create, after a warm worker has started without it; use warm_pool = 0",
            ));
        }
        Ok(())
    }

    /// The image and the agent's argv.
    fn check_command(&self) -> Result<(), Error> {
        if self.image.is_empty() {
            return Err(self.invalid(
                "image",
                "is required: the worker image, e.g. image = \"openab.dev/worker:test\"",
            ));
        }
        if self.image.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(self.invalid(
                "image",
                format!(
                    "{:?} contains whitespace; expected an image reference such as \"openab.dev/worker:test\"",
                    self.image
                ),
            ));
        }
        if self.agent.is_empty() {
            return Err(self.invalid(
                "agent",
                "is required: the agent's program and arguments, e.g. agent = [\"/usr/local/bin/acp-test-agent\"]",
            ));
        }
        if let Some(index) = self
            .agent
            .iter()
            .position(|arg| arg.is_empty() || arg.contains('\0'))
        {
            return Err(self.invalid(
                "agent",
                format!(
                    "entry {}: an argument must be non-empty text without NUL, e.g. \"--acp\"",
                    index + 1
                ),
            ));
        }
        if self.relay_port == 0 {
            return Err(self.invalid("relay_port", "must be 1 to 65535, e.g. 7780"));
        }
        Ok(())
    }

    /// Workspace, HOME and read-only inputs: well-formed paths, none inside another, so no mount
    /// hides or exposes another's contents.
    fn check_mounts(&self) -> Result<(), Error> {
        self.check_volume_path()?;
        check_mount_path(&self.mount_path)
            .map_err(|reason| self.invalid("mount_path", format!("{reason}, e.g. \"/workspace\"")))?;
        check_mount_path(&self.home_path)
            .map_err(|reason| self.invalid("home_path", format!("{reason}, e.g. \"/home/agent\"")))?;
        if overlaps(&self.mount_path, &self.home_path) {
            return Err(self.invalid(
                "home_path",
                format!(
                    "{:?} overlaps mount_path {:?}; HOME and the workspace must not contain each other, e.g. \"/home/agent\" and \"/workspace\"",
                    self.home_path, self.mount_path
                ),
            ));
        }
        // /tmp is the worker's scratch emptyDir (the root filesystem is read-only).
        let mut taken = vec![
            ("mount_path".to_owned(), self.mount_path.as_str()),
            ("home_path".to_owned(), self.home_path.as_str()),
            ("the worker's /tmp".to_owned(), "/tmp"),
        ];
        if let Some(volume) = &self.volume_path {
            taken.push(("volume_path".to_owned(), volume.as_str()));
        }
        for (index, input) in self.skills.iter().enumerate() {
            let entry = index + 1;
            input.check(self, entry)?;
            if let Some(earlier) = self.skills[..index].iter().position(|e| e.name == input.name) {
                return Err(self.invalid(
                    "skills.name",
                    format!(
                        "entry {entry}: {:?} is already the name of entry {}; names must be unique",
                        input.name,
                        earlier + 1
                    ),
                ));
            }
            if let Some((what, path)) = taken.iter().find(|(_, path)| overlaps(path, &input.mount_path)) {
                return Err(self.invalid(
                    "skills.mount_path",
                    format!(
                        "entry {entry}: {:?} overlaps {what} {path:?}; mount each input at a path of its own, e.g. \"/skills\"",
                        input.mount_path
                    ),
                ));
            }
            taken.push((format!("the mount_path of entry {entry}"), &input.mount_path));
        }
        Ok(())
    }

    /// [`volume_path`](Self::volume_path): a volume of the session's own, with the workspace and
    /// HOME where the relay makes them on it.
    fn check_volume_path(&self) -> Result<(), Error> {
        let Some(volume) = &self.volume_path else {
            return Ok(());
        };
        check_mount_path(volume)
            .map_err(|reason| self.invalid("volume_path", format!("{reason}, e.g. \"/session\"")))?;
        if matches!(self.storage, Storage::Borrowed { .. }) {
            return Err(self.invalid(
                "volume_path",
                "needs a volume of the session's own (storage kind \"per-session\" or \"ephemeral\"): a borrowed volume holds other sessions' directories, which the agent must not see",
            ));
        }
        let (workspace, home) = whole_volume_paths(volume);
        for (key, path, expected) in [
            ("mount_path", &self.mount_path, workspace),
            ("home_path", &self.home_path, home),
        ] {
            if *path != expected {
                return Err(self.invalid(
                    key,
                    format!("is {path:?}, but with volume_path {volume:?} it is {expected:?} (leave it out)"),
                ));
            }
        }
        Ok(())
    }

    /// Secret references: valid names, none reserved, none twice.
    fn check_env(&self) -> Result<(), Error> {
        for (index, var) in self.env.iter().enumerate() {
            let entry = index + 1;
            var.check(self, entry)?;
            if let Some(earlier) = self.env[..index].iter().position(|e| e.name == var.name) {
                return Err(self.invalid(
                    "env.name",
                    format!(
                        "entry {entry}: {:?} is already set by entry {}; set each variable once",
                        var.name,
                        earlier + 1
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The gateway's destinations and model routes: each once, their variables free, and a
    /// gateway to reach them through.
    fn check_gateway(&self) -> Result<(), Error> {
        for (index, host) in self.egress_hosts.iter().enumerate() {
            if let Some(earlier) = self.egress_hosts[..index].iter().position(|e| e == host) {
                return Err(self.invalid(
                    "egress_hosts",
                    format!(
                        "entry {}: {host} is already listed by entry {}; list each destination once",
                        index + 1,
                        earlier + 1
                    ),
                ));
            }
            if host.reach() == AddressKind::Loopback {
                return Err(self.invalid(
                    "egress_hosts",
                    format!(
                        "entry {}: {host} is a loopback destination, which at the gateway is the \
                         gateway's own",
                        index + 1
                    ),
                ));
            }
        }
        check_routes(&self.model_routes).map_err(|e| self.invalid("model_routes", e.to_string()))?;
        let mut taken: Vec<&str> = self.env.iter().map(|var| var.name.as_str()).collect();
        for (index, route) in self.model_routes.iter().enumerate() {
            for (field, variable) in [("base_url_env", &route.base_url_env), ("key_env", &route.key_env)] {
                let Some(variable) = variable.as_deref() else {
                    continue;
                };
                let reserved = variable == "HOME"
                    || variable.starts_with(RESERVED_ENV_PREFIX)
                    || variable.to_ascii_uppercase().ends_with("_PROXY");
                if reserved || taken.contains(&variable) {
                    return Err(self.invalid(
                        "model_routes",
                        format!(
                            "entry {}: {field}: {variable} is {}",
                            index + 1,
                            if reserved {
                                "set by the runtime"
                            } else {
                                "already set by [[env]] or another route"
                            }
                        ),
                    ));
                }
                taken.push(variable);
            }
        }
        if self.egress_gateway.is_none() {
            let needing = if !self.egress_hosts.is_empty() {
                Some("egress_hosts")
            } else if !self.model_routes.is_empty() {
                Some("model_routes")
            } else {
                None
            };
            if let Some(needing) = needing {
                return Err(self.invalid(
                    "egress_gateway",
                    format!(
                        "is required with {needing}: the egress gateway's Service as workers reach it, \
                         e.g. egress_gateway = \"openab-egress-gateway:3128\""
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Lifetimes: a zero TTL would stop workers at once, which is never what was meant, and
    /// one without end is a typo that would keep workers or storage forever.
    fn check_durations(&self) -> Result<(), Error> {
        let retain_for = self.retention.as_ref().and_then(|r| r.retain_for);
        for (key, value, example, most) in [
            (
                "idle_ttl",
                self.idle_ttl,
                "\"30m\"",
                config::SessionRuntimeConfig::MAX_IDLE_TTL,
            ),
            (
                "max_lifetime",
                self.max_lifetime,
                "\"8h\"",
                WorkerProfile::MAX_LIFETIME,
            ),
            (
                "retention.retain_for",
                retain_for,
                "\"7d\"",
                RetentionPolicy::MAX_RETAIN_FOR,
            ),
            (
                "termination_grace",
                Some(self.termination_grace),
                "\"10s\"",
                config::LocalConfig::MAX_TERMINATE_GRACE,
            ),
            (
                "unschedulable_timeout",
                self.unschedulable_timeout,
                "\"2m\"",
                config::KubernetesConfig::MAX_START_TIMEOUT,
            ),
        ] {
            if value.is_some_and(|d| d.is_zero()) && key != "termination_grace" {
                return Err(self.invalid(
                    key,
                    format!("must be more than zero, e.g. {example}; leave it out for the default"),
                ));
            }
            if let Some(value) = value.filter(|d| *d > most) {
                return Err(self.invalid(
                    key,
                    format!(
                        "{} is more than the most allowed, {}; e.g. {example}",
                        humantime::format_duration(value),
                        humantime::format_duration(most)
                    ),
                ));
            }
        }
        if self.termination_grace.subsec_nanos() != 0 {
            return Err(self.invalid(
                "termination_grace",
                format!(
                    "Kubernetes counts the grace period in whole seconds, found {}; e.g. \"10s\"",
                    humantime::format_duration(self.termination_grace)
                ),
            ));
        }
        Ok(())
    }
}

/// When the kubelet pulls the worker image: Kubernetes' `imagePullPolicy`, spelled as there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[non_exhaustive]
pub enum PullPolicy {
    /// Pull on every Pod start: `"Always"`.
    Always,
    /// Pull only when the node lacks the image: `"IfNotPresent"`. The default.
    #[default]
    IfNotPresent,
    /// Never pull; the image must already be on the node: `"Never"`.
    Never,
}

impl PullPolicy {
    /// The Kubernetes spelling, which is also the profile's.
    pub fn as_str(&self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

impl fmt::Display for PullPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `[resources]` table: requests and limits of the worker container, as Kubernetes
/// quantities (`"500m"`, `"2"`, `"512Mi"`, `"1G"`). Every key is optional; a request may not
/// exceed its limit.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Resources {
    /// CPU the scheduler reserves, e.g. `"250m"`.
    pub cpu_request: Option<String>,
    /// CPU the container is throttled to, e.g. `"2"`.
    pub cpu_limit: Option<String>,
    /// Memory the scheduler reserves, e.g. `"256Mi"`.
    pub memory_request: Option<String>,
    /// Memory beyond which the container is OOM-killed, e.g. `"1Gi"`.
    pub memory_limit: Option<String>,
    /// Node-local disk (writable layers, logs, `emptyDir`) beyond which the Pod is evicted,
    /// e.g. `"512Mi"`.
    pub ephemeral_storage_limit: Option<String>,
}

impl Resources {
    /// Each quantity on its own, then each request against its limit.
    fn check(&self, profile: &WorkerProfile) -> Result<(), Error> {
        fn parse<'a>(
            profile: &WorkerProfile,
            key: &str,
            value: &'a Option<String>,
            unit: Unit,
        ) -> Result<Option<(u128, &'a str)>, Error> {
            let Some(text) = value else { return Ok(None) };
            match parse_quantity(text, unit) {
                Ok(amount) => Ok(Some((amount, text))),
                Err(reason) => Err(profile.invalid(&format!("resources.{key}"), reason)),
            }
        }
        let cpu_request = parse(profile, "cpu_request", &self.cpu_request, Unit::Cpu)?;
        let cpu_limit = parse(profile, "cpu_limit", &self.cpu_limit, Unit::Cpu)?;
        let memory_request = parse(profile, "memory_request", &self.memory_request, Unit::Bytes)?;
        let memory_limit = parse(profile, "memory_limit", &self.memory_limit, Unit::Bytes)?;
        parse(
            profile,
            "ephemeral_storage_limit",
            &self.ephemeral_storage_limit,
            Unit::Bytes,
        )?;
        for (kind, request, limit, example) in [
            ("cpu", cpu_request, cpu_limit, "\"500m\" with cpu_limit = \"1\""),
            (
                "memory",
                memory_request,
                memory_limit,
                "\"256Mi\" with memory_limit = \"1Gi\"",
            ),
        ] {
            if let (Some((request, request_text)), Some((limit, limit_text))) = (request, limit) {
                if request > limit {
                    return Err(profile.invalid(
                        &format!("resources.{kind}_request"),
                        format!(
                            "{request_text:?} is more than {kind}_limit {limit_text:?}; a request must not \
                             exceed its limit, e.g. {kind}_request = {example}"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The `[storage]` table: where a session's workspace, HOME and agent state live, chosen by
/// `kind`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
#[non_exhaustive]
pub enum Storage {
    /// `kind = "per-session"`: a PersistentVolumeClaim created for each session; it outlives
    /// suspends and is deleted on close as the retention policy says. The default, with 1Gi.
    PerSession {
        /// The StorageClass to provision from. `None`: the cluster's default class.
        #[serde(default)]
        class: Option<String>,
        /// The requested capacity, a byte quantity such as `"1Gi"`. Required.
        #[serde(default)]
        size: String,
        /// How the volume may be attached. Default [`AccessMode::ReadWriteOnce`].
        #[serde(default)]
        access_mode: AccessMode,
    },
    /// `kind = "ephemeral"`: an `emptyDir` that lives and dies with each worker Pod, so nothing
    /// survives a suspend. For stateless agents only.
    Ephemeral {
        /// The most the directory may hold before the Pod is evicted, e.g. `"2Gi"`. `None`: no
        /// limit beyond the node's.
        #[serde(default)]
        size_limit: Option<String>,
        /// `true`: no volume at all. The relay makes the session's directories under
        /// `volume_path` (which this needs: a directory the image lets the worker user make,
        /// such as `"/tmp/session"`) in the worker container's own writable layer, so the root
        /// filesystem is writable wherever the image lets the worker user write (the image's
        /// root-owned files stay as they are), and `/tmp` is the image's. A worker Pod with no
        /// volume starts about 300 ms sooner: the kubelet checks that a Pod's volumes are
        /// mounted every 300 ms, and its first check comes before they are. Bounded by
        /// `[resources] ephemeral_storage_limit`, not `size_limit`. Default `false`: an
        /// `emptyDir`, a 256 MiB `/tmp`, and a read-only root filesystem.
        #[serde(default)]
        container_layer: bool,
    },
    /// `kind = "borrowed"`: an existing claim the administrator lends. Every session of this
    /// profile mounts it, and the runtime never deletes it, whatever the retention policy.
    Borrowed {
        /// The PersistentVolumeClaim's name, in the sessions namespace. Required.
        #[serde(default)]
        claim: String,
    },
}

impl Default for Storage {
    fn default() -> Self {
        Storage::PerSession {
            class: None,
            size: Storage::DEFAULT_SIZE.to_owned(),
            access_mode: AccessMode::default(),
        }
    }
}

impl Storage {
    /// The default size of per-session storage: `"1Gi"`.
    pub const DEFAULT_SIZE: &'static str = "1Gi";

    /// Names and sizes of the chosen kind.
    fn check(&self, profile: &WorkerProfile) -> Result<(), Error> {
        let name = |key: &str, value: &str, example: &str| {
            check_dns_subdomain(value)
                .map_err(|reason| profile.invalid(key, format!("{reason}, e.g. {example:?}")))
        };
        let size = |key: &str, value: &str| {
            parse_quantity(value, Unit::Bytes)
                .map(drop)
                .map_err(|reason| profile.invalid(key, reason))
        };
        match self {
            Storage::PerSession {
                class, size: value, ..
            } => {
                if let Some(class) = class {
                    name("storage.class", class, "openab-test-local")?;
                }
                if value.is_empty() {
                    return Err(profile.invalid(
                        "storage.size",
                        "is required for kind = \"per-session\": the claim's capacity, e.g. \"1Gi\"",
                    ));
                }
                size("storage.size", value)
            }
            Storage::Ephemeral {
                size_limit,
                container_layer,
            } => {
                if *container_layer {
                    if size_limit.is_some() {
                        return Err(profile.invalid(
                            "storage.size_limit",
                            "does not bound the container layer (container_layer = true); use [resources] ephemeral_storage_limit",
                        ));
                    }
                    if profile.volume_path.is_none() {
                        return Err(profile.invalid(
                            "storage.container_layer",
                            "needs volume_path, a directory the image lets the worker user make, e.g. \"/tmp/session\"",
                        ));
                    }
                }
                match size_limit {
                    Some(limit) => size("storage.size_limit", limit),
                    None => Ok(()),
                }
            }
            Storage::Borrowed { claim } => name("storage.claim", claim, "shared-workspace"),
        }
    }
}

/// How a per-session volume may be attached: Kubernetes' access mode, spelled as there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[non_exhaustive]
pub enum AccessMode {
    /// Read-write by the Pods of one node: `"ReadWriteOnce"`. The default.
    #[default]
    ReadWriteOnce,
    /// Read-write by one Pod only, even on the same node: `"ReadWriteOncePod"`.
    ReadWriteOncePod,
}

impl AccessMode {
    /// The Kubernetes spelling, which is also the profile's.
    pub fn as_str(&self) -> &'static str {
        match self {
            AccessMode::ReadWriteOnce => "ReadWriteOnce",
            AccessMode::ReadWriteOncePod => "ReadWriteOncePod",
        }
    }
}

impl fmt::Display for AccessMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How read-only the `[[skills]]` mounts are: the profile's `skills_read_only`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum SkillsReadOnly {
    /// `"recursive"`: read-only all the way down, submounts included (`recursiveReadOnly:
    /// Enabled`); a node whose runtime cannot do that refuses to start the worker, which fails
    /// the attach rather than mounting something writable. The default.
    #[default]
    Recursive,
    /// `"if-possible"`: recursively where the node's runtime supports it (containerd 2 with a
    /// recent runc and kernel), else only the top mount (`recursiveReadOnly: IfPossible`). A
    /// volume with no submounts is read-only either way.
    IfPossible,
}

impl SkillsReadOnly {
    /// The value of a mount's `recursiveReadOnly`.
    pub fn as_kubernetes(&self) -> &'static str {
        match self {
            SkillsReadOnly::Recursive => "Enabled",
            SkillsReadOnly::IfPossible => "IfPossible",
        }
    }
}

/// One `[[skills]]` entry: a volume mounted read-only (recursively) into every worker.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawInput")]
#[non_exhaustive]
pub struct ReadOnlyInput {
    /// The volume's name in the Pod: a DNS label, unique among the inputs. Required.
    pub name: String,
    /// Where it is mounted: absolute, normalized, not overlapping any other mount. Required.
    pub mount_path: String,
    /// Where its contents come from: in TOML `config_map = "..."` or `claim = "..."`.
    pub source: InputSource,
    /// A label for the contents' version, recorded with each worker so operators can see which
    /// version a session ran with. `None`: not tracked.
    pub version: Option<String>,
}

impl ReadOnlyInput {
    /// The entry on its own; overlap with other mounts is checked by the profile.
    fn check(&self, profile: &WorkerProfile, entry: usize) -> Result<(), Error> {
        let refuse = |key: &str, reason: String| {
            profile.invalid(&format!("skills.{key}"), format!("entry {entry}: {reason}"))
        };
        check_dns_label(&self.name).map_err(|reason| refuse("name", format!("{reason}, e.g. \"skills\"")))?;
        check_mount_path(&self.mount_path)
            .map_err(|reason| refuse("mount_path", format!("{reason}, e.g. \"/skills\"")))?;
        match &self.source {
            InputSource::ConfigMap(name) => check_dns_subdomain(name)
                .map_err(|reason| refuse("config_map", format!("{reason}, e.g. \"agent-skills\""))),
            InputSource::Claim(name) => check_dns_subdomain(name)
                .map_err(|reason| refuse("claim", format!("{reason}, e.g. \"skills-volume\""))),
        }?;
        if let Some(version) = &self.version {
            check_label_value(version)
                .map_err(|reason| refuse("version", format!("{reason}, e.g. \"v3\"")))?;
        }
        Ok(())
    }
}

/// Where a read-only input's contents come from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InputSource {
    /// A ConfigMap in the sessions namespace: `config_map = "name"`.
    ConfigMap(String),
    /// A PersistentVolumeClaim in the sessions namespace, mounted read-only and never deleted:
    /// `claim = "name"`.
    Claim(String),
}

/// Where a new session's HOME template comes from: `[home_template]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawHomeTemplate")]
#[non_exhaustive]
pub enum HomeTemplate {
    /// A ConfigMap in the sessions namespace: `config_map = "name"`.
    ConfigMap(String),
    /// A Secret in the sessions namespace: `secret = "name"`. Its values reach only the seed
    /// Job's Pod (the kubelet mounts them), never the broker.
    Secret(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHomeTemplate {
    config_map: Option<String>,
    secret: Option<String>,
}

impl TryFrom<RawHomeTemplate> for HomeTemplate {
    type Error = String;

    fn try_from(raw: RawHomeTemplate) -> Result<Self, String> {
        match (raw.config_map, raw.secret) {
            (Some(name), None) => Ok(HomeTemplate::ConfigMap(name)),
            (None, Some(name)) => Ok(HomeTemplate::Secret(name)),
            (both, _) => {
                let found = if both.is_some() { "both" } else { "neither" };
                Err(format!(
                    "set exactly one of config_map or secret, found {found}; e.g. config_map = \"agent-home\""
                ))
            }
        }
    }
}

/// A `[[skills]]` entry as written, before the source is resolved to exactly one kind.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawInput {
    #[serde(default)]
    name: String,
    #[serde(default)]
    mount_path: String,
    config_map: Option<String>,
    claim: Option<String>,
    version: Option<String>,
}

impl TryFrom<RawInput> for ReadOnlyInput {
    type Error = String;

    fn try_from(raw: RawInput) -> Result<Self, String> {
        let source = match (raw.config_map, raw.claim) {
            (Some(name), None) => InputSource::ConfigMap(name),
            (None, Some(name)) => InputSource::Claim(name),
            (both, _) => {
                let found = if both.is_some() { "both" } else { "neither" };
                return Err(format!(
                    "set exactly one of config_map or claim, found {found}; e.g. config_map = \"agent-skills\""
                ));
            }
        };
        Ok(ReadOnlyInput {
            name: raw.name,
            mount_path: raw.mount_path,
            source,
            version: raw.version,
        })
    }
}

/// One `[[env]]` entry: an environment variable of the agent, set from a key of a Secret.
///
/// Only the names are in the profile: the kubelet resolves the value (`secretKeyRef`), so it never
/// passes through the broker, its configuration or its logs.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct SecretEnv {
    /// The variable's name, `[A-Za-z_][A-Za-z0-9_]*`, not starting with `OAB_RELAY_` (the
    /// runtime's own). Required.
    #[serde(default)]
    pub name: String,
    /// The Secret, in the sessions namespace. Required.
    #[serde(default)]
    pub secret: String,
    /// The key within the Secret. Required.
    #[serde(default)]
    pub key: String,
}

impl SecretEnv {
    /// The entry on its own; duplicates are checked by the profile.
    fn check(&self, profile: &WorkerProfile, entry: usize) -> Result<(), Error> {
        let refuse = |key: &str, reason: String| {
            profile.invalid(&format!("env.{key}"), format!("entry {entry}: {reason}"))
        };
        let mut chars = self.name.chars();
        let name_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !name_ok {
            return Err(refuse(
                "name",
                format!(
                    "expected a variable name of letters, digits and '_', not starting with a digit, e.g. \"ANTHROPIC_API_KEY\", found {:?}",
                    self.name
                ),
            ));
        }
        if self.name.starts_with(RESERVED_ENV_PREFIX) {
            return Err(refuse(
                "name",
                format!(
                    "{:?}: names starting with {RESERVED_ENV_PREFIX} are reserved for the runtime; choose another, e.g. \"AGENT_TOKEN\"",
                    self.name
                ),
            ));
        }
        check_dns_subdomain(&self.secret)
            .map_err(|reason| refuse("secret", format!("{reason}, e.g. \"agent-credentials\"")))?;
        let key_ok = (1..=253).contains(&self.key.len())
            && self
                .key
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !key_ok {
            return Err(refuse(
                "key",
                format!(
                    "expected a Secret key of 1 to 253 letters, digits, '-', '_' or '.', e.g. \"api-key\", found {:?}",
                    self.key
                ),
            ));
        }
        Ok(())
    }
}

/// The `[retention]` table: per-key changes to the broker's `[session_runtime.retention]`
/// policy. Keys left out keep the broker's value.
///
/// Borrowed storage ([`Storage::Borrowed`]) is never deleted, whatever these say.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RetentionOverrides {
    /// For [`CloseReason::Reset`](session_runtime::CloseReason::Reset): `"delete"` or `"retain"`.
    pub reset: Option<Retention>,
    /// For [`CloseReason::Ended`](session_runtime::CloseReason::Ended): `"delete"` or `"retain"`.
    pub ended: Option<Retention>,
    /// For [`CloseReason::Expired`](session_runtime::CloseReason::Expired): `"delete"` or
    /// `"retain"`.
    pub expired: Option<Retention>,
    /// How long retained storage is kept, e.g. `"7d"`; more than zero.
    #[serde(with = "serde_duration::option")]
    pub retain_for: Option<Duration>,
}

impl RetentionOverrides {
    /// `base` with every key this table sets replaced.
    pub fn apply(&self, base: &RetentionPolicy) -> RetentionPolicy {
        let mut policy = base.clone();
        if let Some(reset) = self.reset {
            policy.reset = reset;
        }
        if let Some(ended) = self.ended {
            policy.ended = ended;
        }
        if let Some(expired) = self.expired {
            policy.expired = expired;
        }
        if self.retain_for.is_some() {
            policy.retain_for = self.retain_for;
        }
        policy
    }
}

/// The document as written; [`WorkerProfile`] adds the OabProfile's name and version, which are
/// not the administrator's to write in the spec.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Document {
    image: String,
    image_pull_policy: PullPolicy,
    agent: Vec<String>,
    relay_port: u16,
    resources: Resources,
    storage: Storage,
    mount_path: Option<String>,
    home_path: Option<String>,
    volume_path: Option<String>,
    skills: Vec<ReadOnlyInput>,
    skills_read_only: SkillsReadOnly,
    home_template: Option<HomeTemplate>,
    env: Vec<SecretEnv>,
    runtime_class: Option<String>,
    egress: Vec<String>,
    egress_gateway: Option<EgressTarget>,
    egress_hosts: Vec<EgressTarget>,
    model_routes: Vec<ModelRoute>,
    seed_hosts: Vec<SeedHost>,
    #[serde(with = "serde_duration::option")]
    idle_ttl: Option<Duration>,
    #[serde(with = "serde_duration::option")]
    max_lifetime: Option<Duration>,
    retention: Option<RetentionOverrides>,
    #[serde(with = "serde_duration")]
    termination_grace: Duration,
    #[serde(with = "serde_duration::option")]
    unschedulable_timeout: Option<Duration>,
    warm_pool: u32,
}

impl Default for Document {
    fn default() -> Self {
        Document {
            image: String::new(),
            image_pull_policy: PullPolicy::default(),
            agent: Vec::new(),
            relay_port: WorkerProfile::DEFAULT_RELAY_PORT,
            resources: Resources::default(),
            storage: Storage::default(),
            mount_path: None,
            home_path: None,
            volume_path: None,
            skills: Vec::new(),
            skills_read_only: SkillsReadOnly::default(),
            home_template: None,
            env: Vec::new(),
            runtime_class: None,
            egress: Vec::new(),
            egress_gateway: None,
            egress_hosts: Vec::new(),
            model_routes: Vec::new(),
            seed_hosts: Vec::new(),
            idle_ttl: None,
            max_lifetime: None,
            retention: None,
            termination_grace: WorkerProfile::DEFAULT_TERMINATION_GRACE,
            unschedulable_timeout: None,
            warm_pool: 0,
        }
    }
}

impl Document {
    /// The profile, named and versioned; not yet validated.
    fn into_profile(self, name: &str, version: &str) -> WorkerProfile {
        let (mount_path, home_path) = match &self.volume_path {
            Some(volume) => {
                let (workspace, home) = whole_volume_paths(volume);
                (
                    self.mount_path.unwrap_or(workspace),
                    self.home_path.unwrap_or(home),
                )
            }
            None => (
                self.mount_path
                    .unwrap_or_else(|| WorkerProfile::DEFAULT_MOUNT_PATH.to_owned()),
                self.home_path
                    .unwrap_or_else(|| WorkerProfile::DEFAULT_HOME_PATH.to_owned()),
            ),
        };
        WorkerProfile {
            name: name.to_owned(),
            version: version.to_owned(),
            uid: None,
            image: self.image,
            image_pull_policy: self.image_pull_policy,
            agent: self.agent,
            relay_port: self.relay_port,
            resources: self.resources,
            storage: self.storage,
            mount_path,
            home_path,
            volume_path: self.volume_path,
            skills: self.skills,
            skills_read_only: self.skills_read_only,
            home_template: self.home_template,
            env: self.env,
            runtime_class: self.runtime_class,
            egress: self.egress,
            egress_gateway: self.egress_gateway,
            egress_hosts: self.egress_hosts,
            model_routes: self.model_routes,
            seed_hosts: self.seed_hosts,
            idle_ttl: self.idle_ttl,
            max_lifetime: self.max_lifetime,
            retention: self.retention,
            termination_grace: self.termination_grace,
            unschedulable_timeout: self.unschedulable_timeout,
            warm_pool: self.warm_pool,
        }
    }
}

/// An [`Error::InvalidConfig`] for `key` of the profile `profile`.
fn invalid(profile: &str, key: &str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        key: format!("profile/{profile}.{key}"),
        reason: reason.into(),
    }
}

/// What a quantity measures, which decides its examples and whether `m` makes sense.
#[derive(Clone, Copy)]
enum Unit {
    /// CPU cores.
    Cpu,
    /// Bytes of memory or storage.
    Bytes,
}

/// Parses a Kubernetes quantity: a decimal number and an optional suffix (`m`, `k`, `M`, `G`,
/// `T`, `Ki`, `Mi`, `Gi`, `Ti`), into thousandths of the unit (millicores, millibytes), so any two
/// quantities of one kind compare exactly. Zero is refused: no worker runs in zero of anything.
fn parse_quantity(text: &str, unit: Unit) -> Result<u128, String> {
    let expected = match unit {
        Unit::Cpu => "a CPU quantity such as \"500m\", \"1\" or \"1.5\"",
        Unit::Bytes => "a byte quantity such as \"512Mi\", \"1Gi\" or \"1G\"",
    };
    // Bounded digits keep the arithmetic far inside u128.
    config::parse_quantity(text, expected, 18, |suffix| match suffix {
        // Milli-bytes are legal Kubernetes but always a slip for "Mi".
        "m" if matches!(unit, Unit::Bytes) => Err("m means thousandths; for mebibytes write Mi"),
        "m" => Ok(1),
        "" => Ok(1000),
        "k" => Ok(1000 * 1000),
        "M" => Ok(1000 * 1000_u128.pow(2)),
        "G" => Ok(1000 * 1000_u128.pow(3)),
        "T" => Ok(1000 * 1000_u128.pow(4)),
        "Ki" => Ok(1000 << 10),
        "Mi" => Ok(1000 << 20),
        "Gi" => Ok(1000 << 30),
        "Ti" => Ok(1000 << 40),
        _ => Err("unknown suffix; use m, k, M, G, T, Ki, Mi, Gi or Ti"),
    })
}

/// Checks a mount path in the worker: absolute, normalized (no empty, `.` or `..` components,
/// no trailing `/`), not `/` itself, no control characters.
fn check_mount_path(path: &str) -> Result<(), String> {
    let normalized = path
        .strip_prefix('/')
        .is_some_and(|rest| rest.split('/').all(|part| !matches!(part, "" | "." | "..")));
    if normalized && !path.chars().any(char::is_control) {
        Ok(())
    } else {
        Err(format!(
            "expected an absolute, normalized path other than \"/\", found {path:?}"
        ))
    }
}

/// The workspace and HOME of a worker whose volume is mounted whole at `volume` (see
/// [`WorkerProfile::volume_path`]): the volume's own directories for them.
fn whole_volume_paths(volume: &str) -> (String, String) {
    use crate::pod::{HOME_DIR, WORKSPACE_DIR};
    (
        format!("{volume}/{WORKSPACE_DIR}"),
        format!("{volume}/{HOME_DIR}"),
    )
}

/// Whether one of two normalized paths is the other or lies inside it.
fn overlaps(a: &str, b: &str) -> bool {
    let inside = |inner: &str, outer: &str| {
        inner
            .strip_prefix(outer)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    };
    inside(a, b) || inside(b, a)
}

/// Checks a CIDR such as `10.0.0.0/8` or `fd00::/8`: an address, a prefix length in range for
/// its family, and no host bits set (a NetworkPolicy would silently widen them away).
fn check_cidr(text: &str) -> Result<(), String> {
    let expected = || format!("expected a CIDR such as \"10.0.0.0/8\" or \"fd00::/8\", found {text:?}");
    let (address, prefix) = text.split_once('/').ok_or_else(expected)?;
    let address: IpAddr = address.parse().map_err(|_| expected())?;
    if prefix.is_empty() || prefix.len() > 3 || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return Err(expected());
    }
    let prefix: u32 = prefix.parse().map_err(|_| expected())?;
    let (bits, max) = match address {
        IpAddr::V4(v4) => (u128::from(u32::from(v4)) << 96, 32),
        IpAddr::V6(v6) => (u128::from(v6), 128),
    };
    if prefix > max {
        return Err(format!(
            "{text:?}: the prefix length must be 0 to {max}, e.g. \"10.0.0.0/8\" or \"fd00::/8\""
        ));
    }
    let host_bits = bits.checked_shl(prefix).unwrap_or(0);
    if host_bits != 0 {
        return Err(format!(
            "{text:?} has bits set after its /{prefix} prefix; write the network address, e.g. \"10.0.0.0/8\""
        ));
    }
    Ok(())
}

/// Checks a Kubernetes label value, since versions end up in labels: 1 to 63 characters of
/// letters, digits, `-`, `_` and `.`, starting and ending with a letter or digit.
fn check_label_value(value: &str) -> Result<(), String> {
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let ok = (1..=63).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && edge(value.chars().next())
        && edge(value.chars().last());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "expected 1 to 63 letters, digits, '-', '_' or '.', starting and ending with a letter or digit, found {value:?}"
        ))
    }
}

#[cfg(test)]
mod tests {

    use proptest::prelude::*;

    use super::*;

    const NAME: &str = "isolated-worker";
    const MINIMAL: &str = "image = \"openab.dev/worker:test\"\nagent = [\"/usr/local/bin/acp-test-agent\"]\n";

    /// The key and reason of the refusal of `MINIMAL` followed by `extra`.
    fn refusal(extra: &str) -> (String, String) {
        refusal_of(&format!("{MINIMAL}{extra}"))
    }

    fn refusal_of(document: &str) -> (String, String) {
        match WorkerProfile::from_toml(NAME, "1", document) {
            Err(Error::InvalidConfig { key, reason }) => (key, reason),
            other => panic!("expected InvalidConfig for {document:?}, got {other:?}"),
        }
    }

    fn assert_refused(extra: &str, key: &str, reason_part: &str) {
        let (actual_key, reason) = refusal(extra);
        assert_eq!(actual_key, key, "{extra:?}: {reason}");
        assert!(
            reason.contains(reason_part),
            "{extra:?}: {reason:?} lacks {reason_part:?}"
        );
    }

    #[test]
    fn full_profile_sets_every_field() {
        let document = r#"
            image = "registry.example/worker@sha256:0123"
            image_pull_policy = "Always"
            agent = ["/usr/bin/agent", "--acp", "--model=opus"]
            relay_port = 9000
            mount_path = "/work/space"
            home_path = "/home/someone"
            runtime_class = "gvisor"
            egress = ["10.0.0.0/8", "192.168.1.7/32", "fd00::/8", "0.0.0.0/0"]
            egress_gateway = "openab-egress-gateway:3128"
            egress_hosts = ["github.com:443"]
            seed_hosts = ["github.com", "git://10.0.0.7:9419"]
            skills_read_only = "if-possible"
            idle_ttl = "45m"
            max_lifetime = "8h"
            termination_grace = "30s"
            unschedulable_timeout = "5m"

            [resources]
            cpu_request = "250m"
            cpu_limit = "1.5"
            memory_request = "256Mi"
            memory_limit = "1G"
            ephemeral_storage_limit = "2Gi"

            [storage]
            kind = "per-session"
            class = "fast.ssd"
            size = "10Gi"
            access_mode = "ReadWriteOncePod"

            [[skills]]
            name = "skills"
            mount_path = "/skills"
            config_map = "agent-skills"
            version = "v3.1"

            [[skills]]
            name = "tools"
            mount_path = "/opt/tools"
            claim = "tools-volume"

            [home_template]
            secret = "agent-home"

            [[env]]
            name = "ANTHROPIC_API_KEY"
            secret = "agent-credentials"
            key = "anthropic"

            [[model_routes]]
            prefix = "/openai/"
            upstream = "https://api.openai.com"
            header = "Authorization"
            secret = { name = "model-keys", key = "openai" }
            key_env = "OPENAI_API_KEY"

            [retention]
            reset = "delete"
            ended = "retain"
            expired = "retain"
            retain_for = "7d"
        "#;
        let profile = WorkerProfile::from_toml(NAME, "42", document).expect("valid");
        let expected = WorkerProfile {
            name: NAME.to_owned(),
            version: "42".to_owned(),
            uid: None,
            image: "registry.example/worker@sha256:0123".to_owned(),
            image_pull_policy: PullPolicy::Always,
            agent: vec!["/usr/bin/agent".into(), "--acp".into(), "--model=opus".into()],
            relay_port: 9000,
            resources: Resources {
                cpu_request: Some("250m".into()),
                cpu_limit: Some("1.5".into()),
                memory_request: Some("256Mi".into()),
                memory_limit: Some("1G".into()),
                ephemeral_storage_limit: Some("2Gi".into()),
            },
            storage: Storage::PerSession {
                class: Some("fast.ssd".into()),
                size: "10Gi".into(),
                access_mode: AccessMode::ReadWriteOncePod,
            },
            mount_path: "/work/space".into(),
            home_path: "/home/someone".into(),
            volume_path: None,
            skills: vec![
                ReadOnlyInput {
                    name: "skills".into(),
                    mount_path: "/skills".into(),
                    source: InputSource::ConfigMap("agent-skills".into()),
                    version: Some("v3.1".into()),
                },
                ReadOnlyInput {
                    name: "tools".into(),
                    mount_path: "/opt/tools".into(),
                    source: InputSource::Claim("tools-volume".into()),
                    version: None,
                },
            ],
            skills_read_only: SkillsReadOnly::IfPossible,
            home_template: Some(HomeTemplate::Secret("agent-home".into())),
            env: vec![SecretEnv {
                name: "ANTHROPIC_API_KEY".into(),
                secret: "agent-credentials".into(),
                key: "anthropic".into(),
            }],
            runtime_class: Some("gvisor".into()),
            egress: vec![
                "10.0.0.0/8".into(),
                "192.168.1.7/32".into(),
                "fd00::/8".into(),
                "0.0.0.0/0".into(),
            ],
            egress_gateway: Some(EgressTarget::parse("openab-egress-gateway:3128").expect("valid")),
            egress_hosts: vec![EgressTarget::parse("github.com:443").expect("valid")],
            model_routes: vec![ModelRoute {
                prefix: "/openai/".into(),
                upstream: "https://api.openai.com".into(),
                header: "Authorization".into(),
                secret: egress_proxy::routes::SecretKey {
                    name: "model-keys".into(),
                    key: "openai".into(),
                },
                base_url_env: None,
                key_env: Some("OPENAI_API_KEY".into()),
            }],
            seed_hosts: vec![
                SeedHost::parse("github.com").expect("valid"),
                SeedHost::parse("git://10.0.0.7:9419").expect("valid"),
            ],
            idle_ttl: Some(Duration::from_secs(45 * 60)),
            max_lifetime: Some(Duration::from_secs(8 * 3600)),
            retention: Some(RetentionOverrides {
                reset: Some(Retention::Delete),
                ended: Some(Retention::Retain),
                expired: Some(Retention::Retain),
                retain_for: Some(Duration::from_secs(7 * 86400)),
            }),
            termination_grace: Duration::from_secs(30),
            unschedulable_timeout: Some(Duration::from_secs(300)),
            warm_pool: 0,
        };
        assert_eq!(profile, expected);
        assert_eq!(profile.name(), NAME);
        assert_eq!(profile.version(), "42");
    }

    #[test]
    fn minimal_profile_gets_the_defaults() {
        let profile = WorkerProfile::from_toml(NAME, "7", MINIMAL).expect("valid");
        assert_eq!(profile.image, "openab.dev/worker:test");
        assert_eq!(profile.agent, ["/usr/local/bin/acp-test-agent"]);
        assert_eq!(profile.image_pull_policy, PullPolicy::IfNotPresent);
        assert_eq!(profile.relay_port, 7780);
        assert_eq!(profile.resources, Resources::default());
        assert_eq!(
            profile.storage,
            Storage::PerSession {
                class: None,
                size: "1Gi".into(),
                access_mode: AccessMode::ReadWriteOnce
            }
        );
        assert_eq!(profile.mount_path, "/workspace");
        assert_eq!(profile.home_path, "/home/agent");
        assert!(profile.skills.is_empty() && profile.env.is_empty() && profile.egress.is_empty());
        assert_eq!(profile.runtime_class, None);
        assert_eq!((profile.idle_ttl, profile.max_lifetime), (None, None));
        assert_eq!(profile.retention, None);
        assert_eq!(profile.termination_grace, Duration::from_secs(10));
    }

    #[test]
    fn other_storage_kinds() {
        let profile = WorkerProfile::from_toml(
            NAME,
            "1",
            &format!("{MINIMAL}[storage]\nkind = \"ephemeral\"\nsize_limit = \"2Gi\"\n"),
        )
        .expect("valid");
        assert_eq!(
            profile.storage,
            Storage::Ephemeral {
                size_limit: Some("2Gi".into()),
                container_layer: false,
            }
        );
        let profile = WorkerProfile::from_toml(
            NAME,
            "1",
            &format!("{MINIMAL}[storage]\nkind = \"borrowed\"\nclaim = \"shared\"\n"),
        )
        .expect("valid");
        assert_eq!(
            profile.storage,
            Storage::Borrowed {
                claim: "shared".into()
            }
        );
        assert_refused(
            "[storage]\nkind = \"borrowed\"\n",
            "profile/isolated-worker.storage.claim",
            "required",
        );
        assert_refused(
            "[storage]\nkind = \"host-path\"\n",
            "profile/isolated-worker.storage.kind",
            "host-path",
        );
        assert_refused(
            "[storage]\nkind = \"ephemeral\"\nsize = \"1Gi\"\n",
            "profile/isolated-worker.storage",
            "unknown field `size`",
        );
    }

    #[test]
    fn retention_overrides_replace_only_what_they_set() {
        let base = RetentionPolicy::default();
        let overrides = RetentionOverrides {
            ended: Some(Retention::Retain),
            retain_for: Some(Duration::from_secs(60)),
            ..RetentionOverrides::default()
        };
        let policy = overrides.apply(&base);
        assert_eq!(policy.ended, Retention::Retain);
        assert_eq!(policy.retain_for, Some(Duration::from_secs(60)));
        assert_eq!(
            (policy.reset, policy.expired),
            (Retention::Delete, Retention::Delete)
        );
        assert_eq!(RetentionOverrides::default().apply(&policy), policy);
    }

    #[test]
    fn refuses_unknown_fields() {
        assert_refused(
            "imagePullPolicy = \"Never\"\n",
            "profile/isolated-worker.imagePullPolicy",
            "unknown field",
        );
        assert_refused(
            "[resources]\ncpu = \"1\"\n",
            "profile/isolated-worker.resources.cpu",
            "unknown field",
        );
        assert_refused(
            "[[env]]\nname = \"A\"\nsecret = \"s\"\nkey = \"k\"\nvalue = \"hunter2\"\n",
            "profile/isolated-worker.env.value",
            "entry 1: unknown field",
        );
    }

    #[test]
    fn refuses_a_missing_or_bad_image() {
        let (key, reason) = refusal_of("agent = [\"/bin/agent\"]\n");
        assert_eq!(key, "profile/isolated-worker.image");
        assert!(reason.contains("required"), "{reason}");
        let (key, _) = refusal_of("image = \"a b\"\nagent = [\"/bin/agent\"]\n");
        assert_eq!(key, "profile/isolated-worker.image");
    }

    #[test]
    fn refuses_an_empty_agent() {
        let (key, reason) = refusal_of("image = \"i\"\nagent = []\n");
        assert_eq!(key, "profile/isolated-worker.agent");
        assert!(reason.contains("required"), "{reason}");
        let (key, reason) = refusal_of("image = \"i\"\nagent = [\"/bin/agent\", \"\"]\n");
        assert_eq!(key, "profile/isolated-worker.agent");
        assert!(reason.starts_with("entry 2:"), "{reason}");
    }

    #[test]
    fn the_container_layer_needs_volume_path_and_no_size_limit() {
        let layer = "[storage]\nkind = \"ephemeral\"\ncontainer_layer = true\n";
        assert_refused(
            layer,
            "profile/isolated-worker.storage.container_layer",
            "needs volume_path",
        );
        assert_refused(
            &format!("volume_path = \"/tmp/session\"\n{layer}size_limit = \"1Gi\"\n"),
            "profile/isolated-worker.storage.size_limit",
            "ephemeral_storage_limit",
        );
        assert_refused(
            "[storage]\nkind = \"per-session\"\nsize = \"1Gi\"\ncontainer_layer = true\n",
            "profile/isolated-worker.storage",
            "container_layer",
        );
        let accepted = format!("volume_path = \"/tmp/session\"\nwarm_pool = 2\n{layer}");
        let profile = WorkerProfile::from_toml(NAME, "7", &format!("{MINIMAL}{accepted}")).expect("valid");
        assert!(profile.in_container_layer());
    }

    #[test]
    fn refuses_a_zero_or_out_of_range_port() {
        assert_refused(
            "relay_port = 0\n",
            "profile/isolated-worker.relay_port",
            "1 to 65535",
        );
        assert_refused(
            "relay_port = 70000\n",
            "profile/isolated-worker.relay_port",
            "u16",
        );
    }

    #[test]
    fn refuses_bad_quantities() {
        for (extra, key) in [
            ("[resources]\ncpu_limit = \"lots\"\n", "resources.cpu_limit"),
            (
                "[resources]\nmemory_limit = \"512MB\"\n",
                "resources.memory_limit",
            ),
            (
                "[resources]\nmemory_request = \"512m\"\n",
                "resources.memory_request",
            ),
            (
                "[resources]\nephemeral_storage_limit = \"0\"\n",
                "resources.ephemeral_storage_limit",
            ),
            ("[resources]\ncpu_request = \".5\"\n", "resources.cpu_request"),
            (
                "[storage]\nkind = \"per-session\"\nsize = \"1 Gi\"\n",
                "storage.size",
            ),
            ("[storage]\nkind = \"per-session\"\n", "storage.size"),
            (
                "[storage]\nkind = \"ephemeral\"\nsize_limit = \"-1Gi\"\n",
                "storage.size_limit",
            ),
        ] {
            let (actual, reason) = refusal(extra);
            assert_eq!(actual, format!("profile/{NAME}.{key}"), "{extra:?}: {reason}");
            assert!(reason.contains("e.g.") || reason.contains("such as"), "{reason}");
        }
    }

    #[test]
    fn quantities_compare_by_value() {
        assert_eq!(parse_quantity("500m", Unit::Cpu), Ok(500));
        assert_eq!(parse_quantity("1.5", Unit::Cpu), Ok(1500));
        assert_eq!(parse_quantity("0.0001", Unit::Cpu), Ok(1));
        assert_eq!(parse_quantity("1Gi", Unit::Bytes), Ok(1000 << 30));
        assert_eq!(parse_quantity("1G", Unit::Bytes), Ok(1000 * 1_000_000_000));
        assert!(parse_quantity("1Gi", Unit::Bytes) > parse_quantity("1G", Unit::Bytes));
        assert!(parse_quantity("999999999999999999Ti", Unit::Bytes).is_ok());
        assert!(parse_quantity("9999999999999999999Ti", Unit::Bytes).is_err());
        assert!(parse_quantity("1Pi", Unit::Bytes).is_err());
    }

    #[test]
    fn refuses_a_request_above_its_limit() {
        assert_refused(
            "[resources]\ncpu_request = \"1500m\"\ncpu_limit = \"1\"\n",
            "profile/isolated-worker.resources.cpu_request",
            "must not exceed",
        );
        assert_refused(
            "[resources]\nmemory_request = \"1Gi\"\nmemory_limit = \"1G\"\n",
            "profile/isolated-worker.resources.memory_request",
            "must not exceed",
        );
        // Equal is fine.
        WorkerProfile::from_toml(
            NAME,
            "1",
            &format!("{MINIMAL}[resources]\ncpu_request = \"1000m\"\ncpu_limit = \"1\"\n"),
        )
        .expect("a request equal to its limit is valid");
    }

    #[test]
    fn refuses_bad_or_overlapping_mounts() {
        let skill =
            |path: &str| format!("[[skills]]\nname = \"s\"\nmount_path = \"{path}\"\nconfig_map = \"c\"\n");
        assert_refused(
            &skill("/workspace/skills"),
            "profile/isolated-worker.skills.mount_path",
            "overlaps mount_path",
        );
        assert_refused(
            &skill("/home"),
            "profile/isolated-worker.skills.mount_path",
            "overlaps home_path",
        );
        let two = format!(
            "{}[[skills]]\nname = \"t\"\nmount_path = \"/skills/t\"\nclaim = \"c\"\n",
            skill("/skills")
        );
        assert_refused(&two, "profile/isolated-worker.skills.mount_path", "entry 2:");
        assert_refused(
            "home_path = \"/workspace\"\n",
            "profile/isolated-worker.home_path",
            "overlaps",
        );
        for bad in ["/", "workspace", "/a//b", "/a/", "/a/../b", ""] {
            assert_refused(
                &format!("mount_path = \"{bad}\"\n"),
                "profile/isolated-worker.mount_path",
                "normalized",
            );
        }
        // A shared prefix that is not a parent directory is no overlap.
        let profile = WorkerProfile::from_toml(NAME, "1", &format!("{MINIMAL}{}", skill("/workspaces")))
            .expect("valid");
        assert_eq!(profile.skills[0].mount_path, "/workspaces");
    }

    #[test]
    fn a_volume_path_places_the_workspace_and_home_on_the_whole_volume() {
        for storage in ["", "[storage]\nkind = \"ephemeral\"\n"] {
            let profile = WorkerProfile::from_toml(
                NAME,
                "1",
                &format!("{MINIMAL}volume_path = \"/session\"\n{storage}"),
            )
            .expect("valid");
            assert_eq!(
                (
                    profile.volume_path.as_deref(),
                    profile.mount_path.as_str(),
                    profile.home_path.as_str()
                ),
                (Some("/session"), "/session/workspace", "/session/home"),
                "{storage}"
            );
        }
        // Written out as they are: accepted.
        WorkerProfile::from_toml(
            NAME,
            "1",
            &format!(
                "{MINIMAL}volume_path = \"/v\"\nmount_path = \"/v/workspace\"\nhome_path = \"/v/home\"\n"
            ),
        )
        .expect("valid");
        assert_refused(
            "volume_path = \"/session\"\nmount_path = \"/workspace\"\n",
            "profile/isolated-worker.mount_path",
            "\"/session/workspace\"",
        );
        assert_refused(
            "volume_path = \"/session\"\nhome_path = \"/session/agent\"\n",
            "profile/isolated-worker.home_path",
            "\"/session/home\"",
        );
        assert_refused(
            "volume_path = \"/session\"\n[storage]\nkind = \"borrowed\"\nclaim = \"shared\"\n",
            "profile/isolated-worker.volume_path",
            "other sessions' directories",
        );
        assert_refused(
            "volume_path = \"/\"\n",
            "profile/isolated-worker.volume_path",
            "normalized",
        );
        assert_refused(
            "volume_path = \"/session\"\n[[skills]]\nname = \"s\"\nmount_path = \"/session/skills\"\nconfig_map = \"c\"\n",
            "profile/isolated-worker.skills.mount_path",
            "overlaps volume_path",
        );
    }

    #[test]
    fn refuses_a_skill_with_both_or_neither_source() {
        let entry = "[[skills]]\nname = \"s\"\nmount_path = \"/skills\"\n";
        assert_refused(
            &format!("{entry}config_map = \"c\"\nclaim = \"d\"\n"),
            "profile/isolated-worker.skills",
            "entry 1: set exactly one of config_map or claim, found both",
        );
        assert_refused(entry, "profile/isolated-worker.skills", "found neither");
        assert_refused(
            &format!("{entry}config_map = \"Bad_Name\"\n"),
            "profile/isolated-worker.skills.config_map",
            "entry 1:",
        );
    }

    #[test]
    fn refuses_reserved_or_bad_env_names() {
        let env = |name: &str| format!("[[env]]\nname = \"{name}\"\nsecret = \"creds\"\nkey = \"token\"\n");
        assert_refused(
            &env("OAB_RELAY_TOKEN"),
            "profile/isolated-worker.env.name",
            "reserved",
        );
        assert_refused(
            &env("1PASSWORD"),
            "profile/isolated-worker.env.name",
            "variable name",
        );
        assert_refused(&env("A-B"), "profile/isolated-worker.env.name", "variable name");
        assert_refused(
            &format!("{}{}", env("A"), env("A")),
            "profile/isolated-worker.env.name",
            "entry 2:",
        );
        assert_refused(
            "[[env]]\nname = \"A\"\nsecret = \"creds\"\n",
            "profile/isolated-worker.env.key",
            "Secret key",
        );
    }

    #[test]
    fn refuses_seed_hosts_that_name_more_than_an_origin() {
        for bad in [
            "file:///srv",
            "ext::sh",
            "github.com/org/repo",
            "https://u@github.com",
        ] {
            assert_refused(
                &format!("seed_hosts = [\"{bad}\"]\n"),
                "profile/isolated-worker.seed_hosts",
                bad,
            );
        }
    }

    #[test]
    fn egress_hosts_go_through_a_gateway_each_once() {
        let profile = WorkerProfile::from_toml(
            "isolated-worker",
            "1",
            "image = \"w\"\nagent = [\"/a\"]\negress_gateway = \"10.96.0.50:3128\"\n\
             egress_hosts = [\"github.com:443\", \"gateway.internal:8080 private\"]\n",
        )
        .expect("a profile");
        assert_eq!(
            profile.egress_gateway.map(|g| g.to_string()).as_deref(),
            Some("10.96.0.50:3128")
        );
        let hosts: Vec<String> = profile.egress_hosts.iter().map(ToString::to_string).collect();
        assert_eq!(hosts, ["github.com:443", "gateway.internal:8080 private"]);
        assert_refused(
            "egress_hosts = [\"github.com:443\"]\n",
            "profile/isolated-worker.egress_gateway",
            "required with egress_hosts",
        );
        assert_refused(
            "egress_gateway = \"gw:3128\"\negress_hosts = [\"github.com:443\", \"github.com:443\"]\n",
            "profile/isolated-worker.egress_hosts",
            "entry 2:",
        );
        for bad in [
            "github.com",
            "github.com:0",
            "https://github.com",
            "github.com:443 everywhere",
            "localhost:8080",
            "127.0.0.1:8080",
            "cache.internal:8080 loopback",
        ] {
            assert_refused(
                &format!("egress_gateway = \"gw:3128\"\negress_hosts = [\"{bad}\"]\n"),
                "profile/isolated-worker.egress_hosts",
                "",
            );
        }
        assert_refused(
            "egress_gateway = \"gw\"\n",
            "profile/isolated-worker.egress_gateway",
            "",
        );
    }

    #[test]
    fn model_routes_go_through_a_gateway_with_variables_of_their_own() {
        let route = |extra: &str| {
            format!(
                "[[model_routes]]\nprefix = \"/openai/\"\nupstream = \"https://api.openai.com\"\n\
                 header = \"Authorization\"\nsecret = {{ name = \"keys\", key = \"openai\" }}\n{extra}"
            )
        };
        assert_refused(
            &route(""),
            "profile/isolated-worker.egress_gateway",
            "required with model_routes",
        );
        let gateway = "egress_gateway = \"gw:3128\"\n";
        assert_refused(
            &format!("{gateway}{}", route("upstream_key = 1\n")),
            "profile/isolated-worker.model_routes.upstream_key",
            "unknown field `upstream_key`",
        );
        assert_refused(
            &format!("{gateway}{}", route("key_env = \"HTTPS_PROXY\"\n")),
            "profile/isolated-worker.model_routes",
            "entry 1: key_env: HTTPS_PROXY is set by the runtime",
        );
        assert_refused(
            &format!(
                "{gateway}[[env]]\nname = \"OPENAI_API_KEY\"\nsecret = \"s\"\nkey = \"k\"\n{}",
                route("key_env = \"OPENAI_API_KEY\"\n")
            ),
            "profile/isolated-worker.model_routes",
            "already set by [[env]]",
        );
        assert_refused(
            &format!("{gateway}{}", route("").replace("/openai/", "openai")),
            "profile/isolated-worker.model_routes",
            "entry 1: prefix:",
        );
    }

    #[test]
    fn refuses_bad_cidrs() {
        for bad in [
            "10.0.0.0",
            "10.0.0.0/33",
            "fd00::/129",
            "10.0.0.1/8",
            "10.0.0.0/+8",
            "example.com/8",
            "10.0.0.0/",
        ] {
            assert_refused(
                &format!("egress = [\"{bad}\"]\n"),
                "profile/isolated-worker.egress",
                "entry 1:",
            );
        }
        for good in ["0.0.0.0/0", "10.1.2.3/32", "::/0", "2001:db8::/32"] {
            assert_eq!(check_cidr(good), Ok(()), "{good}");
        }
    }

    #[test]
    fn a_warm_pool_needs_ephemeral_storage_and_a_bound() {
        assert_refused(
            "warm_pool = 2\n",
            "profile/isolated-worker.warm_pool",
            "needs storage kind = \"ephemeral\"",
        );
        assert_refused(
            "warm_pool = 101\n[storage]\nkind = \"ephemeral\"\n",
            "profile/isolated-worker.warm_pool",
            "more than the most allowed, 100",
        );
        assert_refused("warm_pool = -1\n", "profile/isolated-worker.warm_pool", "");
        let pooled = WorkerProfile::from_toml(
            NAME,
            "1",
            &format!("{MINIMAL}warm_pool = 3\n[storage]\nkind = \"ephemeral\"\n"),
        )
        .expect("an ephemeral profile may keep a pool");
        assert_eq!(pooled.warm_pool, 3);
        let cold = WorkerProfile::from_toml(NAME, "1", MINIMAL).expect("minimal profile");
        assert_eq!(cold.warm_pool, 0, "no pool unless asked for");
    }

    #[test]
    fn refuses_zero_or_bad_durations() {
        assert_refused(
            "idle_ttl = \"0s\"\n",
            "profile/isolated-worker.idle_ttl",
            "more than zero",
        );
        assert_refused(
            "max_lifetime = \"0m\"\n",
            "profile/isolated-worker.max_lifetime",
            "more than zero",
        );
        assert_refused(
            "[retention]\nretain_for = \"0d\"\n",
            "profile/isolated-worker.retention.retain_for",
            "more than zero",
        );
        assert_refused(
            "idle_ttl = \"soon\"\n",
            "profile/isolated-worker.idle_ttl",
            "expected a duration",
        );
        assert_refused(
            "idle_ttl = 30\n",
            "profile/isolated-worker.idle_ttl",
            "expected a duration",
        );
        assert_refused(
            "termination_grace = \"1500ms\"\n",
            "profile/isolated-worker.termination_grace",
            "whole seconds",
        );
        assert_refused(
            "[retention]\nended = \"keep\"\n",
            "profile/isolated-worker.retention.ended",
            "keep",
        );
    }

    #[test]
    fn syntax_errors_name_the_profile_and_place() {
        let (key, reason) = refusal_of("image = \"unterminated\n");
        assert_eq!(key, "profile/isolated-worker");
        assert!(reason.contains("line 1"), "{reason}");
    }

    #[test]
    fn a_resource_gives_name_and_version_and_its_spec_is_checked_like_toml() {
        let mut object = WorkerProfile::resource_from_toml(NAME, MINIMAL).expect("TOML");
        object.metadata.resource_version = Some("4711".to_owned());
        let profile = WorkerProfile::from_resource(&object).expect("valid");
        assert_eq!((profile.name(), profile.version()), (NAME, "4711"));
        assert_eq!(
            profile,
            WorkerProfile::from_toml(NAME, "4711", MINIMAL).expect("valid")
        );

        let refused = |spec: serde_json::Value| {
            let mut object = object.clone();
            object.data = serde_json::json!({ "spec": spec });
            match WorkerProfile::from_resource(&object) {
                Err(Error::InvalidConfig { key, reason }) => (key, reason),
                other => panic!("expected InvalidConfig, got {other:?}"),
            }
        };
        let minimal = serde_json::json!({"image": "openab.dev/worker:test", "agent": ["a"]});
        let with = |key: &str, value: serde_json::Value| {
            let mut spec = minimal.clone();
            spec[key] = value;
            spec
        };
        let (key, reason) = refused(with("storage_class", "fast".into()));
        assert_eq!(key, "profile/isolated-worker.storage_class", "{reason}");
        assert!(reason.contains("unknown field"), "{reason}");
        let (key, reason) = refused(with(
            "env",
            serde_json::json!([{"name": "A", "secret": "s", "key": 7}]),
        ));
        assert_eq!(key, "profile/isolated-worker.env.key", "{reason}");
        assert!(reason.starts_with("entry 1: "), "{reason}");
        let (key, _) = refused(with(
            "storage",
            serde_json::json!({"kind": "per-session", "size": "1Gb"}),
        ));
        assert_eq!(key, "profile/isolated-worker.storage.size");
        let (key, _) = refused(serde_json::json!({"agent": ["a"]}));
        assert_eq!(key, "profile/isolated-worker.image");
    }

    /// Lines built from the profile's own vocabulary, so generated documents get past the TOML
    /// parser and into validation.
    fn profile_line() -> impl Strategy<Value = String> {
        let keys = prop::sample::select(vec![
            "image",
            "agent",
            "relay_port",
            "mount_path",
            "home_path",
            "runtime_class",
            "egress",
            "idle_ttl",
            "max_lifetime",
            "termination_grace",
            "kind",
            "size",
            "size_limit",
            "container_layer",
            "claim",
            "class",
            "access_mode",
            "name",
            "config_map",
            "version",
            "secret",
            "key",
            "cpu_limit",
            "cpu_request",
            "memory_request",
            "memory_limit",
            "reset",
            "retain_for",
        ]);
        let values = prop_oneof![
            "\"[ -~]{0,12}\"",
            "[0-9]{1,6}",
            Just("\"per-session\"".to_owned()),
            Just("\"borrowed\"".to_owned()),
            Just("[\"/a\", \"\"]".to_owned()),
            Just("\"/workspace/x\"".to_owned()),
            Just("\"1.5Gi\"".to_owned()),
            Just("\"0s\"".to_owned()),
            Just("\"::/200\"".to_owned()),
        ];
        let tables = prop::sample::select(vec![
            "[resources]",
            "[storage]",
            "[[skills]]",
            "[[env]]",
            "[retention]",
        ]);
        prop_oneof![
            3 => (keys, values).prop_map(|(key, value)| format!("{key} = {value}")),
            1 => tables.prop_map(str::to_owned),
        ]
    }

    proptest! {
        #[test]
        fn arbitrary_documents_never_panic(document in ".{0,400}") {
            let _ = WorkerProfile::from_toml(NAME, "1", &document);
        }

        #[test]
        fn profile_like_documents_never_panic(lines in prop::collection::vec(profile_line(), 0..24)) {
            let document = format!("{MINIMAL}{}\n", lines.join("\n"));
            if let Err(err) = WorkerProfile::from_toml(NAME, "1", &document) {
                let is_profile_key = matches!(&err, Error::InvalidConfig { key, .. } if key.starts_with("profile/isolated-worker"));
                prop_assert!(is_profile_key, "{err:?}");
            }
        }
    }

    #[test]
    fn a_home_template_names_exactly_one_source_and_needs_lasting_storage() {
        let base = "image = \"w\"\nagent = [\"/a\"]\n";
        let map = WorkerProfile::from_toml(
            NAME,
            "1",
            &format!("{base}[home_template]\nconfig_map = \"agent-home\"\n"),
        )
        .expect("valid");
        assert_eq!(
            map.home_template,
            Some(HomeTemplate::ConfigMap("agent-home".into()))
        );
        for (table, key, says) in [
            (
                "config_map = \"a\"\nsecret = \"b\"\n",
                "home_template",
                "found both",
            ),
            ("", "home_template", "found neither"),
            (
                "config_map = \"Not_A_Name\"\n",
                "home_template.config_map",
                "agent-home",
            ),
        ] {
            let document = format!("{base}[home_template]\n{table}");
            match WorkerProfile::from_toml(NAME, "1", &document) {
                Err(Error::InvalidConfig { key: found, reason }) => {
                    assert_eq!(found, format!("profile/{NAME}.{key}"), "{reason}");
                    assert!(reason.contains(says), "{reason}");
                }
                other => panic!("{document}: {other:?}"),
            }
        }
        let ephemeral = format!("{base}[storage]\nkind = \"ephemeral\"\n[home_template]\nsecret = \"h\"\n");
        match WorkerProfile::from_toml(NAME, "1", &ephemeral) {
            Err(Error::InvalidConfig { key, .. }) => assert_eq!(key, format!("profile/{NAME}.home_template")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn lifetimes_without_end_are_refused_naming_the_key() {
        let base = "image = \"w\"\nagent = [\"/a\"]\n";
        for (line, key) in [
            ("idle_ttl = \"400d\"\n", "idle_ttl"),
            ("max_lifetime = \"100000000y\"\n", "max_lifetime"),
            ("termination_grace = \"11m\"\n", "termination_grace"),
            ("[retention]\nretain_for = \"20y\"\n", "retention.retain_for"),
        ] {
            match WorkerProfile::from_toml(NAME, "1", &format!("{base}{line}")) {
                Err(Error::InvalidConfig { key: found, reason }) => {
                    assert_eq!(found, format!("profile/{NAME}.{key}"), "{reason}");
                    assert!(
                        reason.contains("most allowed") || reason.contains("out of range"),
                        "{reason}"
                    );
                }
                other => panic!("{line}: {other:?}"),
            }
        }
    }
}
