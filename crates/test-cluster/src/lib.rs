//! Test support for the Kubernetes runtime: kube clients for a real cluster, read from the
//! environment that `scripts/cluster env` (or `scripts/kind-e2e.sh`) prints.
//!
//! The suite is cluster-agnostic: it only reads these variables, so the same tests run against the
//! cluster this repository builds on the machine and against kind.
//!
//! | variable | what |
//! |---|---|
//! | `KUBECONFIG` | an administrator's kubeconfig (one file), for setup and assertions |
//! | `OPENAB_BROKER_KUBECONFIG` | the broker's kubeconfig: exactly the permissions of `deploy/kubernetes/broker-rbac*.yaml` |
//! | `OPENAB_SESSIONS_NAMESPACE` | the sessions namespace of `deploy/kubernetes/namespace.yaml` (default `openab-sessions`) |
//! | `OPENAB_KUBERNETES_VERSION` | the version the cluster must report (optional) |
//! | `OPENAB_KWOK_NODES` | how many kwok fake nodes it has (optional; default 0) |
//! | `OPENAB_CLUSTER_KIND` | set by `scripts/kind-e2e.sh`: a kind cluster, whose images that script loads and whose Pods reach the API server through the `kubernetes` Service (optional) |
//!
//! Nothing here falls back to `~/.kube/config` or in-cluster credentials: a test reaches only the
//! cluster it was pointed at. Cluster tests are marked
//! `#[ignore = "needs a cluster: scripts/cluster up, then cargo test -- --ignored"]`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Capabilities, SeccompProfile, SecurityContext};
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodSecurityContext, PodSpec};
use kube::api::{DeleteParams, ObjectMeta, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

pub mod faults;

pub use k8s_openapi;
pub use kube;

/// What a test says when the cluster is absent.
const HOW_TO_START: &str =
    "start one with `scripts/cluster up` and `eval \"$(scripts/cluster env)\"`, then run \
     `cargo test -- --ignored`";

/// The uid of the worker image's user (restricted Pod Security requires a non-root one).
pub const WORKER_UID: i64 = 65532;

/// The label every namespace made by [`TestCluster::fresh_namespace`] carries.
pub const TEST_NAMESPACE_LABEL: &str = "openab.dev/test-namespace";

/// A running cluster, as the environment describes it.
#[derive(Clone)]
pub struct TestCluster {
    admin_config: Config,
    broker_config: Config,
    admin: Client,
    broker: Client,
    sessions_namespace: String,
    kubernetes_version: Option<String>,
    kwok_nodes: usize,
}

impl std::fmt::Debug for TestCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCluster")
            .field("server", &self.admin_config.cluster_url.to_string())
            .field("sessions_namespace", &self.sessions_namespace)
            .field("kubernetes_version", &self.kubernetes_version)
            .field("kwok_nodes", &self.kwok_nodes)
            .finish_non_exhaustive()
    }
}

impl TestCluster {
    /// Connects to the cluster the environment names, and checks that the API server answers.
    ///
    /// # Panics
    /// When a variable is missing or malformed, a kubeconfig cannot be read, or the API server
    /// does not answer: each message says how to start the cluster.
    pub async fn connect() -> TestCluster {
        let admin_path = required_path("KUBECONFIG");
        let broker_path = required_path("OPENAB_BROKER_KUBECONFIG");
        let admin_config = config_from(&admin_path).await;
        let admin = client_from(admin_config.clone(), &admin_path);
        let broker_config = config_from(&broker_path).await;
        let broker = client_from(broker_config.clone(), &broker_path);
        if let Err(error) = admin.apiserver_version().await {
            panic!(
                "the API server of {} does not answer ({error}); {HOW_TO_START}",
                admin_path.display()
            );
        }
        let kwok_nodes = match std::env::var("OPENAB_KWOK_NODES") {
            Ok(value) => value
                .parse()
                .unwrap_or_else(|_| panic!("OPENAB_KWOK_NODES must be a number of nodes, not {value:?}")),
            Err(_) => 0,
        };
        TestCluster {
            admin_config,
            broker_config,
            admin,
            broker,
            sessions_namespace: std::env::var("OPENAB_SESSIONS_NAMESPACE")
                .unwrap_or_else(|_| "openab-sessions".to_owned()),
            kubernetes_version: std::env::var("OPENAB_KUBERNETES_VERSION").ok(),
            kwok_nodes,
        }
    }

    /// A client with cluster-admin rights: for setup and assertions, never for the code under test.
    pub fn admin(&self) -> Client {
        self.admin.clone()
    }

    /// The admin client's configuration, for making a client of its own on another runtime (a
    /// cleanup in `Drop` must not use a client whose connection task lives on the test's runtime,
    /// which the drop may be blocking).
    pub fn admin_config(&self) -> Config {
        self.admin_config.clone()
    }

    /// A client with exactly the broker's permissions: what the runtime under test must use.
    pub fn broker(&self) -> Client {
        self.broker.clone()
    }

    /// A client with exactly the controller's permissions (`deploy/kubernetes/controller-rbac.yaml`):
    /// a fresh, hour-long token of its ServiceAccount `openab/openab-controller`.
    ///
    /// # Panics
    /// When the token cannot be requested (the deploy files are not applied).
    pub async fn controller(&self) -> Client {
        use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
        use k8s_openapi::api::core::v1::ServiceAccount;
        let accounts: Api<ServiceAccount> = Api::namespaced(self.admin(), "openab");
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                expiration_seconds: Some(3600),
                ..TokenRequestSpec::default()
            }),
            ..TokenRequest::default()
        };
        let token = accounts
            .create_token_request("openab-controller", &PostParams::default(), &request)
            .await
            .unwrap_or_else(|error| panic!("a token of openab/openab-controller: {error}"))
            .status
            .and_then(|status| status.token)
            .unwrap_or_else(|| panic!("the TokenRequest for openab/openab-controller returned no token"));
        let mut config = self.broker_config.clone();
        config.auth_info.token = Some(token.into());
        Client::try_from(config)
            .unwrap_or_else(|error| panic!("a client with the controller's token: {error}"))
    }

    /// The broker client's configuration, for a client with layers of a test's own
    /// ([`faults::Faults::client`]).
    pub fn broker_config(&self) -> Config {
        self.broker_config.clone()
    }

    /// The namespace of the deploy files, where sessions live (Pod Security "restricted").
    pub fn sessions_namespace(&self) -> &str {
        &self.sessions_namespace
    }

    /// The version the cluster is expected to report, when the environment pins one.
    pub fn kubernetes_version(&self) -> Option<&str> {
        self.kubernetes_version.as_deref()
    }

    /// How many kwok fake nodes the cluster has.
    pub fn kwok_nodes(&self) -> usize {
        self.kwok_nodes
    }

    /// A new namespace for one test, named `<purpose>-<random>`, made with the admin client and
    /// deleted when the returned guard drops (also when the test panics).
    ///
    /// # Panics
    /// When `purpose` is not a short DNS label, or the namespace cannot be created.
    pub async fn fresh_namespace(&self, purpose: &str) -> TestNamespace {
        assert!(
            !purpose.is_empty()
                && purpose.len() <= 40
                && purpose
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
            "a namespace purpose is a short DNS label, not {purpose:?}"
        );
        let name = format!("{purpose}-{}", unique_suffix());
        let namespace = Namespace {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some([(TEST_NAMESPACE_LABEL.to_owned(), "true".to_owned())].into()),
                ..ObjectMeta::default()
            },
            ..Namespace::default()
        };
        let api: Api<Namespace> = Api::all(self.admin());
        if let Err(error) = api.create(&PostParams::default(), &namespace).await {
            panic!("could not create test namespace {name}: {error}");
        }
        TestNamespace {
            name,
            admin_config: self.admin_config.clone(),
        }
    }
}

/// A namespace that exists for one test; deleted (in the background) when dropped.
#[derive(Debug)]
pub struct TestNamespace {
    name: String,
    admin_config: Config,
}

impl TestNamespace {
    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime, which may have one thread that this very call
        // blocks: the delete gets its own thread, runtime and client.
        let name = std::mem::take(&mut self.name);
        let config = self.admin_config.clone();
        let deleted = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|error| error.to_string())?;
            runtime.block_on(async {
                let client = Client::try_from(config).map_err(|error| error.to_string())?;
                let api: Api<Namespace> = Api::all(client);
                match api.delete(&name, &DeleteParams::background()).await {
                    Ok(_) => Ok(()),
                    Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
                    Err(error) => Err(format!("could not delete test namespace {name}: {error}")),
                }
            })
        })
        .join();
        match deleted {
            Ok(Ok(())) => {}
            Ok(Err(error)) => eprintln!("test-cluster: {error}"),
            Err(_) => eprintln!("test-cluster: the namespace cleanup thread panicked"),
        }
    }
}

/// Polls `probe` every 100 ms until it returns `Some`, and returns that.
///
/// # Panics
/// When `timeout` passes first; the message names `what`. A bound on a wait, not a timing
/// assertion: generous timeouts only.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The Pod Security "restricted" profile's requirements, as a Pod of one container: non-root
/// (the worker uid), no privilege escalation, every capability dropped, the runtime's default
/// seccomp profile, a read-only root filesystem, and no service-account token.
pub fn restricted_pod(name: &str, image: &str, command: &[&str]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(PodSpec {
            automount_service_account_token: Some(false),
            enable_service_links: Some(false),
            restart_policy: Some("Never".to_owned()),
            termination_grace_period_seconds: Some(1),
            security_context: Some(PodSecurityContext {
                run_as_non_root: Some(true),
                run_as_user: Some(WORKER_UID),
                run_as_group: Some(WORKER_UID),
                seccomp_profile: Some(SeccompProfile {
                    type_: "RuntimeDefault".to_owned(),
                    ..SeccompProfile::default()
                }),
                ..PodSecurityContext::default()
            }),
            containers: vec![Container {
                name: "worker".to_owned(),
                image: Some(image.to_owned()),
                image_pull_policy: Some("Never".to_owned()),
                command: (!command.is_empty()).then(|| command.iter().map(|arg| (*arg).to_owned()).collect()),
                security_context: Some(SecurityContext {
                    allow_privilege_escalation: Some(false),
                    read_only_root_filesystem: Some(true),
                    capabilities: Some(Capabilities {
                        drop: Some(vec!["ALL".to_owned()]),
                        ..Capabilities::default()
                    }),
                    ..SecurityContext::default()
                }),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
        ..Pod::default()
    }
}

/// What a command run through `pods/exec` printed, and whether it exited 0.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Exit status 0.
    pub success: bool,
    /// Its standard output, lossily decoded.
    pub stdout: String,
    /// Its standard error, lossily decoded.
    pub stderr: String,
}

/// Runs `argv` in the first container of Pod `name` through `pods/exec` and collects its output.
///
/// # Panics
/// When the exec cannot be opened (RBAC, a Pod that is not running): the message names both.
pub async fn exec(pods: &Api<Pod>, name: &str, argv: &[&str]) -> ExecOutput {
    use tokio::io::AsyncReadExt;
    let params = kube::api::AttachParams::default()
        .stdin(false)
        .stdout(true)
        .stderr(true);
    let mut process = pods
        .exec(name, argv.iter().copied(), &params)
        .await
        .unwrap_or_else(|error| panic!("exec {argv:?} in Pod {name}: {error}"));
    let mut stdout = process.stdout().expect("stdout was requested");
    let mut stderr = process.stderr().expect("stderr was requested");
    let status = process.take_status().expect("the status is taken once");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let (read_out, read_err) = tokio::join!(stdout.read_to_end(&mut out), stderr.read_to_end(&mut err));
    read_out.unwrap_or_else(|error| panic!("reading the stdout of {argv:?}: {error}"));
    read_err.unwrap_or_else(|error| panic!("reading the stderr of {argv:?}: {error}"));
    let status = status.await;
    let _ = process.join().await;
    ExecOutput {
        success: status.is_some_and(|status| status.status.as_deref() == Some("Success")),
        stdout: String::from_utf8_lossy(&out).into_owned(),
        stderr: String::from_utf8_lossy(&err).into_owned(),
    }
}

/// The HTTP status of a refused API call, or `None` for any other outcome.
pub fn api_status<T>(result: &Result<T, kube::Error>) -> Option<u16> {
    match result {
        Err(kube::Error::Api(status)) => Some(status.code),
        _ => None,
    }
}

/// A session id (20 characters of its base32 alphabet) no other test uses, for objects a test
/// makes in a session's name without a runtime.
pub fn unique_session_id() -> String {
    let seed = unique_name("session");
    let mut state = seed.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    (0..20)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            char::from(b"abcdefghijklmnopqrstuvwxyz234567"[usize::try_from(state >> 59).unwrap_or(0)])
        })
        .collect()
}

/// `<prefix>-<suffix>`, a name no other test of this run (or, very likely, of another run) uses.
pub fn unique_name(prefix: &str) -> String {
    format!("{prefix}-{}", unique_suffix())
}

/// Unique across the processes of one run (pid) and the namespaces of one process (counter), and
/// unlikely to repeat across runs (clock), which matters on a cluster that outlives a run (kind).
fn unique_suffix() -> String {
    static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let count = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.subsec_nanos() ^ elapsed.as_secs() as u32);
    format!("{:x}{count:x}-{:x}", std::process::id(), clock & 0xfffff)
}

fn required_path(variable: &str) -> PathBuf {
    match std::env::var_os(variable) {
        Some(value) if !value.is_empty() => PathBuf::from(value),
        _ => panic!("{variable} is not set: no test cluster to run against; {HOW_TO_START}"),
    }
}

async fn config_from(path: &Path) -> Config {
    let kubeconfig = Kubeconfig::read_from(path).unwrap_or_else(|error| {
        panic!(
            "cannot read the kubeconfig {} ({error}); {HOW_TO_START}",
            path.display()
        )
    });
    Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap_or_else(|error| {
            panic!(
                "the kubeconfig {} is not usable ({error}); {HOW_TO_START}",
                path.display()
            )
        })
}

fn client_from(config: Config, path: &Path) -> Client {
    Client::try_from(config).unwrap_or_else(|error| panic!("no client for {}: {error}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restricted_pod_asks_for_nothing_restricted_forbids() {
        let pod = restricted_pod("p", "image:tag", &["sleep", "1"]);
        let spec = pod.spec.expect("a spec");
        let pod_security = spec.security_context.expect("a pod security context");
        assert_eq!(pod_security.run_as_non_root, Some(true));
        assert_ne!(pod_security.run_as_user, Some(0));
        let container = &spec.containers[0];
        let security = container
            .security_context
            .as_ref()
            .expect("a container security context");
        assert_eq!(security.allow_privilege_escalation, Some(false));
        let dropped = security.capabilities.as_ref().and_then(|c| c.drop.clone());
        assert_eq!(dropped, Some(vec!["ALL".to_owned()]));
        assert_eq!(container.command.as_deref().map(<[String]>::len), Some(2));
        assert_eq!(spec.automount_service_account_token, Some(false));
    }

    #[test]
    fn api_status_is_the_code_of_a_refusal_only() {
        let ok: Result<(), kube::Error> = Ok(());
        assert_eq!(api_status(&ok), None);
        let refused: Result<(), kube::Error> = Err(kube::Error::Api(Box::new(
            kube::core::Status::failure("conflict", "Conflict").with_code(409),
        )));
        assert_eq!(api_status(&refused), Some(409));
    }
}
