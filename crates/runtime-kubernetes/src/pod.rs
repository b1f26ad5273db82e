//! The worker Pod of one generation, from the cluster-owned profile.
//!
//! Everything here holds whatever the profile says: Pod Security "restricted" (non-root, no
//! privilege escalation, every capability dropped, the runtime's seccomp profile), a read-only
//! root filesystem, no service-account token, no service links, skills read-only and recursively
//! so, and the session volume as the only writable storage besides a bounded `/tmp`.

use std::collections::BTreeMap;

use egress_proxy::gateway::ProxyCredential;
use k8s_openapi::api::core::v1::{
    Capabilities, ConfigMapVolumeSource, Container, ContainerPort, EmptyDirVolumeSource, EnvVar,
    EnvVarSource, PersistentVolumeClaimVolumeSource, Pod, PodSecurityContext, PodSpec, Probe,
    ResourceRequirements, SeccompProfile, SecretKeySelector, SecurityContext, TCPSocketAction, Volume,
    VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use session_runtime::config::EgressTarget;
use session_runtime::{Generation, SessionId};
use worker_relay::token::{TokenHash, BIND_TOKEN_HASH_ENV};

use crate::anchor::OabSession;
use crate::names;
use crate::profile::{InputSource, Storage, WorkerProfile};
use crate::reach::RELAY_BINARY;

/// The uid and gid every worker runs as (the worker image's user).
pub(crate) const WORKER_UID: i64 = 65532;
/// Where the init container mounts the whole session volume to make its two directories.
pub(crate) const PREPARE_MOUNT: &str = "/session";
/// The session volume's directories: the workspace and HOME, mounted at the profile's paths.
pub(crate) const WORKSPACE_DIR: &str = "workspace";
pub(crate) const HOME_DIR: &str = "home";
/// The worker's only container.
pub(crate) const CONTAINER: &str = "worker";

/// What `NO_PROXY` says in a worker with a proxy, besides the gateway itself: loopback is
/// reached directly.
const NO_PROXY: &str = "localhost,127.0.0.1,::1";

/// What a worker is given to reach the egress gateway: its proxy URL and model routes, each
/// with the session's own credential only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WorkerEgress {
    /// `http://SESSION.PROFILE:TOKEN@GATEWAY`.
    proxy_url: String,
    /// The gateway's host, reached directly (its model routes are its own paths).
    gateway_host: String,
    /// The model routes' variables: base URLs at the gateway, and the route key.
    route_env: Vec<(String, String)>,
}

impl WorkerEgress {
    /// What a worker of `profile` with `credential` is given for the gateway at `gateway`.
    pub(crate) fn new(profile: &WorkerProfile, credential: &ProxyCredential, gateway: &EgressTarget) -> Self {
        let authority = gateway.authority();
        let mut route_env = Vec::new();
        for route in &profile.model_routes {
            if let Some(name) = &route.base_url_env {
                route_env.push((name.clone(), route.base_url(&authority)));
            }
            if let Some(name) = &route.key_env {
                route_env.push((name.clone(), credential.route_key()));
            }
        }
        WorkerEgress {
            proxy_url: credential.proxy_url(&authority),
            gateway_host: gateway.host(),
            route_env,
        }
    }

    /// The agent's variables for the gateway: the proxy in upper and lower case (clients read
    /// one or the other), `NO_PROXY` for loopback and the gateway's own paths (its model
    /// routes), and the model routes' variables.
    pub(crate) fn env(&self) -> Vec<(String, String)> {
        let mut env = Vec::new();
        for name in ["HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"] {
            env.push((name.to_owned(), self.proxy_url.clone()));
        }
        for name in ["NO_PROXY", "no_proxy"] {
            env.push((name.to_owned(), format!("{NO_PROXY},{}", self.gateway_host)));
        }
        env.extend(self.route_env.iter().cloned());
        env
    }

    /// The proxy URL (for tests).
    #[cfg(test)]
    pub(crate) fn proxy_url(&self) -> &str {
        &self.proxy_url
    }
}

/// What one worker Pod is made of besides the profile.
#[derive(Debug)]
pub(crate) struct WorkerSpec<'a> {
    pub(crate) id: &'a SessionId,
    pub(crate) installation: &'a str,
    pub(crate) generation: Generation,
    /// The session's incarnation, whose ServiceAccount the worker runs as.
    pub(crate) incarnation: u64,
    pub(crate) token_hash: &'a TokenHash,
    /// The anchor that owns the Pod (its UID: ownership is by UID, not by name).
    pub(crate) anchor_uid: &'a str,
    /// The claim to mount, or `None` for a volume that lives with the Pod.
    pub(crate) claim: Option<&'a str>,
    /// Whether the session's directories must be made first (the `prepare` init container).
    /// An init container cost the test node's Pods about 600 ms more to Ready (most likely the
    /// kubelet noticing its exit only at its next relist), so a claim whose directories an earlier
    /// worker or the seed Job made goes without one.
    pub(crate) prepare: bool,
    /// The worker's way to the egress gateway, when its profile names one.
    pub(crate) egress: Option<&'a WorkerEgress>,
}

pub(crate) fn worker_pod(profile: &WorkerProfile, spec: &WorkerSpec<'_>) -> Pod {
    let mut metadata = names::meta(names::worker(spec.id), spec.installation, spec.id, "worker");
    if let Some(labels) = metadata.labels.as_mut() {
        labels.insert(names::GENERATION.to_owned(), spec.generation.to_string());
        // What the profile's egress policy selects (see network.rs).
        labels.insert(names::PROFILE.to_owned(), names::profile_label(profile.name()));
    }
    metadata.owner_references = Some(vec![owned_by_anchor(spec.id, spec.anchor_uid)]);
    let mut relay_env = vec![
        plain_env("OAB_RELAY_SESSION", spec.id.to_string()),
        plain_env("OAB_RELAY_GENERATION", spec.generation.to_string()),
        plain_env("OAB_RELAY_TOKEN_SHA256", spec.token_hash.to_hex()),
    ];
    if let Some(egress) = spec.egress {
        relay_env.extend(
            egress
                .env()
                .into_iter()
                .map(|(name, value)| plain_env(&name, value)),
        );
    }
    let mut pod = pod_body(
        profile,
        &Body {
            dirs: session_dirs(profile, spec.id),
            claim: spec.claim,
            prepare: spec.prepare,
            relay_env,
            unbound: false,
            service_account: names::service_account(spec.id, spec.incarnation),
        },
    );
    pod.metadata = metadata;
    if let Some(pod_spec) = pod.spec.as_mut() {
        // The profile's maximum lifetime is the kubelet's to enforce: the Pod fails with
        // `DeadlineExceeded` even if no broker or controller is left to stop it.
        pod_spec.active_deadline_seconds = profile.max_lifetime.map(deadline_seconds);
    }
    pod
}

/// A Pod deadline of `limit`, in the whole seconds Kubernetes counts.
pub(crate) fn deadline_seconds(limit: std::time::Duration) -> i64 {
    i64::try_from(limit.as_secs()).unwrap_or(i64::MAX)
}

/// A warm pool member: a worker of the profile started with no session (see `pool.rs`).
#[derive(Debug)]
pub(crate) struct MemberSpec<'a> {
    /// The Pod's name, which its own ServiceAccount shares.
    pub(crate) name: &'a str,
    pub(crate) installation: &'a str,
    /// The OabProfile that owns it, by UID.
    pub(crate) profile_uid: &'a str,
    /// The hash of the bind token a broker claims it with.
    pub(crate) bind_hash: &'a TokenHash,
    /// Which broker key binds it (see `pool::key_label`).
    pub(crate) key_label: &'a str,
}

/// The Pod of a warm pool member of `profile`: everything of a worker of the profile but the
/// session. Its relay starts unbound; a claim gives it the session's labels, owner, deadline
/// and (by the relay's bind) its identity, token and agent environment.
pub(crate) fn member_pod(profile: &WorkerProfile, spec: &MemberSpec<'_>) -> Pod {
    let mut pod = pod_body(
        profile,
        &Body {
            // A volume of its own (pools are for ephemeral storage): the directories at its top.
            dirs: (WORKSPACE_DIR.to_owned(), HOME_DIR.to_owned()),
            claim: None,
            prepare: true,
            relay_env: vec![plain_env(BIND_TOKEN_HASH_ENV, spec.bind_hash.to_hex())],
            unbound: true,
            service_account: spec.name.to_owned(),
        },
    );
    pod.metadata = member_meta(profile, spec);
    pod
}

/// The labels and owner of a pool member and of its ServiceAccount.
pub(crate) fn member_meta(profile: &WorkerProfile, spec: &MemberSpec<'_>) -> ObjectMeta {
    let labels = BTreeMap::from([
        (names::MANAGED_BY.to_owned(), names::MANAGER.to_owned()),
        (
            names::INSTALLATION.to_owned(),
            names::installation_label(spec.installation),
        ),
        (names::ROLE.to_owned(), names::POOL_ROLE.to_owned()),
        (names::PROFILE.to_owned(), names::profile_label(profile.name())),
        (names::POOL_KEY.to_owned(), spec.key_label.to_owned()),
    ]);
    let annotations = BTreeMap::from([(names::PROFILE_VERSION.to_owned(), profile.version().to_owned())]);
    let resource = WorkerProfile::resource();
    ObjectMeta {
        name: Some(spec.name.to_owned()),
        labels: Some(labels),
        annotations: Some(annotations),
        owner_references: Some(vec![OwnerReference {
            api_version: resource.api_version,
            kind: resource.kind,
            name: profile.name().to_owned(),
            uid: spec.profile_uid.to_owned(),
            controller: Some(true),
            block_owner_deletion: None,
        }]),
        ..ObjectMeta::default()
    }
}

/// What differs between a session's worker and a pool member besides their metadata.
struct Body<'a> {
    /// The workspace and HOME directories on the volume.
    dirs: (String, String),
    claim: Option<&'a str>,
    prepare: bool,
    /// The relay's own variables (the session or the bind hash, the gateway's).
    relay_env: Vec<EnvVar>,
    unbound: bool,
    service_account: String,
}

/// Everything of a worker Pod the profile decides.
fn pod_body(profile: &WorkerProfile, body: &Body<'_>) -> Pod {
    let mut volumes = vec![
        Volume {
            name: "session".to_owned(),
            persistent_volume_claim: body.claim.map(|claim| PersistentVolumeClaimVolumeSource {
                claim_name: claim.to_owned(),
                read_only: None,
            }),
            empty_dir: body.claim.is_none().then(|| EmptyDirVolumeSource {
                size_limit: match &profile.storage {
                    Storage::Ephemeral { size_limit, .. } => size_limit.clone().map(Quantity),
                    _ => None,
                },
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        },
        Volume {
            name: "tmp".to_owned(),
            empty_dir: Some(EmptyDirVolumeSource {
                size_limit: Some(Quantity("256Mi".to_owned())),
                ..EmptyDirVolumeSource::default()
            }),
            ..Volume::default()
        },
    ];
    // A volume of the session's own may be mounted whole (the relay makes the two directories
    // on it); otherwise the agent mounts only its session's directories, and the init container
    // alone sees the whole volume.
    let (workspace_dir, home_dir) = body.dirs.clone();
    let mut mounts = match &profile.volume_path {
        Some(volume) => vec![VolumeMount {
            name: "session".to_owned(),
            mount_path: volume.clone(),
            ..VolumeMount::default()
        }],
        None => vec![
            VolumeMount {
                name: "session".to_owned(),
                mount_path: profile.mount_path.clone(),
                sub_path: Some(workspace_dir.clone()),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "session".to_owned(),
                mount_path: profile.home_path.clone(),
                sub_path: Some(home_dir.clone()),
                ..VolumeMount::default()
            },
        ],
    };
    mounts.push(VolumeMount {
        name: "tmp".to_owned(),
        mount_path: "/tmp".to_owned(),
        ..VolumeMount::default()
    });
    // In the container's own layer, nothing is mounted for the session or `/tmp` (see
    // `Storage::Ephemeral::container_layer`): the kubelet then has no volume to wait for.
    let in_container_layer = profile.in_container_layer();
    if in_container_layer {
        volumes.clear();
        mounts.clear();
    }
    for (index, skill) in profile.skills.iter().enumerate() {
        // By position: a skill's name may be longer than a volume name may be.
        let name = format!("skill-{index}");
        let mut volume = Volume {
            name: name.clone(),
            ..Volume::default()
        };
        match &skill.source {
            InputSource::ConfigMap(map) => {
                volume.config_map = Some(ConfigMapVolumeSource {
                    name: map.clone(),
                    default_mode: Some(0o444),
                    ..ConfigMapVolumeSource::default()
                })
            }
            InputSource::Claim(claim) => {
                volume.persistent_volume_claim = Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.clone(),
                    read_only: Some(true),
                })
            }
        }
        volumes.push(volume);
        mounts.push(VolumeMount {
            name,
            mount_path: skill.mount_path.clone(),
            read_only: Some(true),
            recursive_read_only: Some(profile.skills_read_only.as_kubernetes().to_owned()),
            ..VolumeMount::default()
        });
    }

    let mut env = body.relay_env.clone();
    env.push(plain_env("HOME", profile.home_path.clone()));
    env.extend(profile.env.iter().map(|secret| EnvVar {
        name: secret.name.clone(),
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret.secret.clone(),
                key: secret.key.clone(),
                optional: Some(false),
            }),
            ..EnvVarSource::default()
        }),
        ..EnvVar::default()
    }));

    let port = i32::from(profile.relay_port);
    let mut command = vec![
        RELAY_BINARY.to_owned(),
        "serve".to_owned(),
        "--listen".to_owned(),
        // Dual-stack: the broker dials whichever address the Pod reports, IPv4 or IPv6.
        format!("[::]:{port}"),
        "--workdir".to_owned(),
        profile.mount_path.clone(),
        "--term-grace".to_owned(),
        format!("{}ms", profile.termination_grace.as_millis()),
    ];
    if body.unbound {
        command.push("--unbound".to_owned());
    }
    // The kubelet would make a missing subPath as root, which the agent could not write: the
    // relay, as the worker user, makes both directories first, in the worker itself where it
    // sees the whole volume, else in an init container (only where they may be missing).
    let prepare = match profile.volume_path {
        Some(_) => {
            for dir in [&profile.mount_path, &profile.home_path] {
                command.extend(["--make-dir".to_owned(), dir.clone()]);
            }
            None
        }
        None => body.prepare.then(|| {
            prepare_container(
                profile,
                vec![
                    format!("{PREPARE_MOUNT}/{workspace_dir}"),
                    format!("{PREPARE_MOUNT}/{home_dir}"),
                ],
            )
        }),
    };
    command.push("--".to_owned());
    command.extend(profile.agent.iter().cloned());

    let mut security = restricted_container();
    if in_container_layer {
        security.read_only_root_filesystem = Some(false);
    }

    let container = Container {
        name: CONTAINER.to_owned(),
        image: Some(profile.image.clone()),
        image_pull_policy: Some(profile.image_pull_policy.as_str().to_owned()),
        command: Some(command),
        working_dir: Some("/".to_owned()),
        env: Some(env),
        ports: Some(vec![ContainerPort {
            name: Some("relay".to_owned()),
            container_port: port,
            protocol: Some("TCP".to_owned()),
            ..ContainerPort::default()
        }]),
        readiness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction {
                port: IntOrString::Int(port),
                host: None,
            }),
            period_seconds: Some(1),
            failure_threshold: Some(1),
            ..Probe::default()
        }),
        resources: Some(resources(profile)),
        volume_mounts: Some(mounts),
        security_context: Some(security),
        ..Container::default()
    };

    // The relay's own grace for the agent, plus a margin for the relay to report the exit.
    let grace = i64::try_from(profile.termination_grace.as_secs())
        .unwrap_or(i64::MAX)
        .saturating_add(5);
    Pod {
        metadata: ObjectMeta::default(),
        spec: Some(PodSpec {
            init_containers: prepare.map(|prepare| vec![prepare]),
            containers: vec![container],
            volumes: Some(volumes),
            restart_policy: Some("Never".to_owned()),
            service_account_name: Some(body.service_account.clone()),
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            share_process_namespace: Some(false),
            termination_grace_period_seconds: Some(grace),
            runtime_class_name: profile.runtime_class.clone(),
            security_context: Some(restricted_pod()),
            ..PodSpec::default()
        }),
        status: None,
    }
}

/// The init container that makes a session's directories on its volume as the worker user,
/// seeing the whole volume: the relay's `prepare`, with paths the runtime computed.
pub(crate) fn prepare_container(profile: &WorkerProfile, dirs: Vec<String>) -> Container {
    let mut command = vec![RELAY_BINARY.to_owned(), "prepare".to_owned()];
    command.extend(dirs);
    Container {
        name: "prepare".to_owned(),
        image: Some(profile.image.clone()),
        image_pull_policy: Some(profile.image_pull_policy.as_str().to_owned()),
        command: Some(command),
        volume_mounts: Some(vec![VolumeMount {
            name: "session".to_owned(),
            mount_path: PREPARE_MOUNT.to_owned(),
            ..VolumeMount::default()
        }]),
        security_context: Some(restricted_container()),
        resources: Some(resources(profile)),
        ..Container::default()
    }
}

/// Owned by the anchor, so a deleted anchor takes it along (see [`OabSession::owner_reference`]).
pub(crate) fn owned_by_anchor(id: &SessionId, anchor_uid: &str) -> OwnerReference {
    OabSession::owner_reference(id, anchor_uid)
}

/// Pod Security "restricted" for a container: no privilege escalation, no capabilities, a
/// read-only root filesystem.
pub(crate) fn restricted_container() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        ..SecurityContext::default()
    }
}

/// Pod Security "restricted" for a Pod: the worker user, its group owning the volumes, and the
/// runtime's default seccomp profile.
pub(crate) fn restricted_pod() -> PodSecurityContext {
    PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(WORKER_UID),
        run_as_group: Some(WORKER_UID),
        fs_group: Some(WORKER_UID),
        fs_group_change_policy: Some("OnRootMismatch".to_owned()),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            localhost_profile: None,
        }),
        ..PodSecurityContext::default()
    }
}

/// Where a session's workspace and HOME live on its volume: a borrowed claim is one volume for
/// every session of the profile, so each session gets a directory of its own on it.
pub(crate) fn session_dirs(profile: &WorkerProfile, id: &SessionId) -> (String, String) {
    dirs_on_volume(matches!(profile.storage, Storage::Borrowed { .. }), id)
}

/// The session's workspace and HOME directories, relative to its volume: a volume of its own
/// holds them at the top, a borrowed one (shared by sessions) under the session's id.
pub(crate) fn dirs_on_volume(borrowed: bool, id: &SessionId) -> (String, String) {
    let base = if borrowed { format!("{id}/") } else { String::new() };
    (format!("{base}{WORKSPACE_DIR}"), format!("{base}{HOME_DIR}"))
}

pub(crate) fn plain_env(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value),
        ..EnvVar::default()
    }
}

pub(crate) fn resources(profile: &WorkerProfile) -> ResourceRequirements {
    let r = &profile.resources;
    let pick = |pairs: [(&str, &Option<String>); 3]| {
        let map: BTreeMap<String, Quantity> = pairs
            .into_iter()
            .filter_map(|(name, value)| Some((name.to_owned(), Quantity(value.clone()?))))
            .collect();
        (!map.is_empty()).then_some(map)
    };
    ResourceRequirements {
        requests: pick([
            ("cpu", &r.cpu_request),
            ("memory", &r.memory_request),
            ("ephemeral-storage", &None),
        ]),
        limits: pick([
            ("cpu", &r.cpu_limit),
            ("memory", &r.memory_limit),
            ("ephemeral-storage", &r.ephemeral_storage_limit),
        ]),
        ..ResourceRequirements::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use egress_proxy::gateway::GatewayKey;
    use session_runtime::SessionIdentity;
    use worker_relay::BrokerKey;

    fn pod_for(storage: &str) -> (SessionId, Pod) {
        pod_with(storage, None)
    }

    fn session() -> SessionId {
        SessionIdentity::new("i", "a", "p", "t").expect("identity").id()
    }

    /// A first worker of generation 3 on a claim, under a profile with `settings` (other keys),
    /// and `egress`.
    fn pod_with(settings: &str, egress: Option<&WorkerEgress>) -> (SessionId, Pod) {
        let document = format!("image = \"w:1\"\nagent = [\"/agent\"]\n{settings}");
        let profile = WorkerProfile::from_toml("p", "1", &document).expect("a profile");
        let id = session();
        let hash = BrokerKey::new(vec![7; 32]).token(id.as_str(), 3).hash();
        let spec = WorkerSpec {
            id: &id,
            installation: "i",
            generation: 3,
            incarnation: 1,
            token_hash: &hash,
            anchor_uid: "uid",
            claim: Some("claim"),
            prepare: true,
            egress,
        };
        (id, worker_pod(&profile, &spec))
    }

    fn env(pod: &Pod) -> Vec<(String, String)> {
        pod.spec.as_ref().expect("spec").containers[0]
            .env
            .iter()
            .flatten()
            .filter_map(|var| Some((var.name.clone(), var.value.clone()?)))
            .collect()
    }

    #[test]
    fn a_worker_with_a_gateway_gets_its_proxy_and_one_without_gets_none() {
        let (_, without) = pod_for("");
        let names: Vec<String> = env(&without).into_iter().map(|(name, _)| name).collect();
        assert!(
            !names
                .iter()
                .any(|name| name.to_ascii_uppercase().contains("PROXY")),
            "{names:?}"
        );
        let routes = "egress_gateway = \"oab-gw.sessions:3128\"\n\
            [[model_routes]]\nprefix = \"/openai/\"\nupstream = \"https://api.openai.com\"\n\
            header = \"Authorization\"\nsecret = { name = \"keys\", key = \"openai\" }\n\
            base_url_env = \"OPENAI_BASE_URL\"\nkey_env = \"OPENAI_API_KEY\"\n";
        let profile =
            WorkerProfile::from_toml("p", "1", &format!("image = \"w\"\nagent = [\"/a\"]\n{routes}"))
                .expect("a profile");
        let credential = GatewayKey::new([4u8; 32]).credential(session(), "p");
        let gateway = profile.egress_gateway.clone().expect("a gateway");
        let egress = WorkerEgress::new(&profile, &credential, &gateway);
        let (_, with) = pod_with(routes, Some(&egress));
        let env = env(&with);
        let url = credential.proxy_url("oab-gw.sessions:3128");
        for name in ["HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"] {
            assert!(env.contains(&(name.to_owned(), url.clone())), "{name}: {env:?}");
        }
        // The gateway's own paths (its model routes) are not proxied.
        let direct = format!("{NO_PROXY},oab-gw.sessions");
        for name in ["NO_PROXY", "no_proxy"] {
            assert!(
                env.contains(&(name.to_owned(), direct.clone())),
                "{name}: {env:?}"
            );
        }
        assert!(
            env.contains(&(
                "OPENAI_BASE_URL".to_owned(),
                "http://oab-gw.sessions:3128/openai".to_owned()
            )),
            "{env:?}"
        );
        assert!(
            env.contains(&("OPENAI_API_KEY".to_owned(), credential.route_key())),
            "{env:?}"
        );
    }

    fn sub_paths(pod: &Pod) -> Vec<String> {
        let spec = pod.spec.as_ref().expect("spec");
        spec.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .filter_map(|mount| mount.sub_path.clone())
            .collect()
    }

    #[test]
    fn a_borrowed_claim_gives_each_session_its_own_directories() {
        let (id, borrowed) = pod_for("[storage]\nkind = \"borrowed\"\nclaim = \"shared\"\n");
        assert_eq!(
            sub_paths(&borrowed),
            [format!("{id}/workspace"), format!("{id}/home")]
        );
        let prepare = &borrowed
            .spec
            .as_ref()
            .expect("spec")
            .init_containers
            .as_ref()
            .expect("init")[0];
        let command = prepare.command.as_ref().expect("command");
        assert!(
            command.contains(&format!("/session/{id}/workspace")),
            "{command:?}"
        );
        let (_, own) = pod_for("");
        assert_eq!(sub_paths(&own), ["workspace", "home"]);
    }

    #[test]
    fn a_prepared_claim_starts_without_the_init_container_and_mounts_alike() {
        let (id, first) = pod_for("");
        let profile =
            WorkerProfile::from_toml("p", "1", "image = \"w:1\"\nagent = [\"/agent\"]\n").expect("a profile");
        let hash = BrokerKey::new(vec![7; 32]).token(id.as_str(), 4).hash();
        let later = worker_pod(
            &profile,
            &WorkerSpec {
                id: &id,
                installation: "i",
                generation: 4,
                incarnation: 1,
                token_hash: &hash,
                anchor_uid: "uid",
                claim: Some("claim"),
                prepare: false,
                egress: None,
            },
        );
        let init = |pod: &Pod| pod.spec.as_ref().and_then(|spec| spec.init_containers.clone());
        assert!(init(&first).is_some_and(|containers| containers.len() == 1));
        assert!(
            init(&later).is_none(),
            "no init container once the directories exist"
        );
        assert_eq!(sub_paths(&later), sub_paths(&first), "the same directories");
    }

    /// In the container's own layer, a worker has no volume at all (so the kubelet has none to
    /// wait for) and a root filesystem it may write where the image lets it; the relay makes the
    /// two directories under `volume_path`. A skill still brings its own read-only volume.
    #[test]
    fn a_container_layer_worker_has_no_volume_and_makes_its_directories() {
        let storage =
            "volume_path = \"/tmp/session\"\n[storage]\nkind = \"ephemeral\"\ncontainer_layer = true\n";
        let (_, pod) = pod_for(storage);
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.volumes.as_deref(), Some(&[][..]), "no volume");
        let container = &spec.containers[0];
        assert_eq!(
            container.volume_mounts.as_deref(),
            Some(&[][..]),
            "nothing mounted"
        );
        let security = container.security_context.as_ref().expect("security context");
        assert_eq!(security.read_only_root_filesystem, Some(false));
        assert_eq!(
            security.allow_privilege_escalation,
            Some(false),
            "still restricted"
        );
        assert!(spec.init_containers.is_none());
        let command = container.command.clone().unwrap_or_default();
        let made: Vec<&str> = command
            .windows(2)
            .filter(|pair| pair[0] == "--make-dir")
            .map(|pair| pair[1].as_str())
            .collect();
        assert_eq!(
            made,
            ["/tmp/session/workspace", "/tmp/session/home"],
            "{command:?}"
        );

        let (_, default) = pod_for("volume_path = \"/session\"\n[storage]\nkind = \"ephemeral\"\n");
        let default = default.spec.expect("spec");
        let security = default.containers[0]
            .security_context
            .clone()
            .expect("security context");
        assert_eq!(
            security.read_only_root_filesystem,
            Some(true),
            "the default keeps the root read-only"
        );
        assert_eq!(
            default.volumes.map(|volumes| volumes.len()),
            Some(2),
            "the session's and /tmp"
        );

        let skilled = format!("{storage}[[skills]]\nname = \"s\"\nmount_path = \"/skills/s\"\nconfig_map = \"s\"\nversion = \"1\"\n");
        let (_, with_skill) = pod_for(&skilled);
        let volumes: Vec<String> = with_skill
            .spec
            .and_then(|spec| spec.volumes)
            .into_iter()
            .flatten()
            .map(|volume| volume.name)
            .collect();
        assert_eq!(volumes, ["skill-0"]);
    }

    /// With `volume_path`, a volume of the session's own is mounted whole and the relay makes
    /// the two directories: no init container, on the first worker as on any later one.
    #[test]
    fn a_whole_volume_worker_makes_its_directories_without_an_init_container() {
        for storage in ["", "[storage]\nkind = \"ephemeral\"\n"] {
            let (_, pod) = pod_for(&format!("volume_path = \"/session\"\n{storage}"));
            let spec = pod.spec.as_ref().expect("spec");
            assert!(spec.init_containers.is_none(), "{storage}");
            let container = &spec.containers[0];
            let session: Vec<(String, Option<String>)> = container
                .volume_mounts
                .iter()
                .flatten()
                .filter(|mount| mount.name == "session")
                .map(|mount| (mount.mount_path.clone(), mount.sub_path.clone()))
                .collect();
            assert_eq!(session, [("/session".to_owned(), None)], "{storage}");
            let command = container.command.clone().unwrap_or_default();
            let agent_at = command
                .iter()
                .position(|arg| arg == "--")
                .expect("the agent's argv");
            let made: Vec<&str> = command[..agent_at]
                .windows(2)
                .filter(|pair| pair[0] == "--make-dir")
                .map(|pair| pair[1].as_str())
                .collect();
            assert_eq!(made, ["/session/workspace", "/session/home"], "{command:?}");
            assert!(
                command
                    .windows(2)
                    .any(|pair| pair == ["--workdir", "/session/workspace"]),
                "{command:?}"
            );
            let env = env(&pod);
            assert!(
                env.contains(&("HOME".to_owned(), "/session/home".to_owned())),
                "{env:?}"
            );
        }
    }

    #[test]
    fn every_worker_pod_is_restricted_and_holds_no_token() {
        let (id, pod) = pod_for("");
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.automount_service_account_token, Some(false));
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some(format!("oab-i-{id}-1").as_str()),
            "the session incarnation's own identity, shared with no other session"
        );
        assert_eq!(spec.enable_service_links, Some(false));
        let command = spec.containers[0].command.clone().unwrap_or_default();
        assert!(
            command.windows(2).any(|pair| pair == ["--listen", "[::]:7780"]),
            "the relay listens dual-stack: {command:?}"
        );
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        for container in spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
        {
            let security = container.security_context.as_ref().expect("security context");
            assert_eq!(
                security.allow_privilege_escalation,
                Some(false),
                "{}",
                container.name
            );
            assert_eq!(
                security.read_only_root_filesystem,
                Some(true),
                "{}",
                container.name
            );
            let dropped = security.capabilities.as_ref().and_then(|c| c.drop.clone());
            assert_eq!(dropped, Some(vec!["ALL".to_owned()]), "{}", container.name);
        }
        let env = spec.containers[0].env.as_ref().expect("env");
        let value = |name: &str| env.iter().find(|e| e.name == name).and_then(|e| e.value.clone());
        assert_eq!(value("OAB_RELAY_SESSION"), Some(id.to_string()));
        assert_eq!(value("OAB_RELAY_GENERATION"), Some("3".to_owned()));
        // The Pod holds the token's hash, never the token.
        let token = BrokerKey::new(vec![7; 32]).token(id.as_str(), 3);
        assert_eq!(value("OAB_RELAY_TOKEN_SHA256"), Some(token.hash().to_hex()));
        let labels = pod.metadata.labels.as_ref().expect("labels");
        assert_eq!(labels.get(names::GENERATION).map(String::as_str), Some("3"));
        assert_eq!(spec.active_deadline_seconds, None, "no max_lifetime, no deadline");
    }

    #[test]
    fn skills_are_read_only_all_the_way_down_unless_the_profile_settles_for_less() {
        let skills = "[[skills]]\nname = \"skills\"\nmount_path = \"/skills\"\nconfig_map = \"s\"\n";
        let mode = |pod: &Pod| {
            pod.spec.as_ref().expect("spec").containers[0]
                .volume_mounts
                .iter()
                .flatten()
                .find(|mount| mount.mount_path == "/skills")
                .map(|mount| (mount.read_only, mount.recursive_read_only.clone()))
        };
        let (_, strict) = pod_for(skills);
        assert_eq!(mode(&strict), Some((Some(true), Some("Enabled".to_owned()))));
        let (_, lenient) = pod_for(&format!("skills_read_only = \"if-possible\"\n{skills}"));
        assert_eq!(mode(&lenient), Some((Some(true), Some("IfPossible".to_owned()))));
    }

    #[test]
    fn the_maximum_lifetime_is_the_pods_deadline() {
        let (_, pod) = pod_for("max_lifetime = \"8h\"\n");
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.active_deadline_seconds, Some(8 * 3600));
    }
}
