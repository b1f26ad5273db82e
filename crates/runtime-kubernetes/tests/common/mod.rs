//! What the runtime's cluster tests share: an administrator's worker profile, and a runtime with
//! the broker's identity.

// Each test binary uses part of it.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

pub mod agents;
pub mod network;

use runtime_kubernetes::profile::WorkerProfile;
use runtime_kubernetes::{KubernetesRuntime, KubernetesRuntimeBuilder};
use session_runtime::config::{KubernetesConfig, Reach};
use test_cluster::k8s_openapi::api::core::v1::ConfigMap;
use test_cluster::kube::api::{DeleteParams, DynamicObject, ObjectMeta, Patch, PatchParams, PostParams};
use test_cluster::kube::Api;
use test_cluster::TestCluster;

/// The worker image with the ACP test agent behind the relay, on the test cluster's storage class.
pub const WORKER_PROFILE: &str = r#"
image = "openab.dev/worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/acp-test-agent"]
termination_grace = "2s"

[resources]
memory_limit = "256Mi"

[storage]
kind = "per-session"
class = "openab-test-local"
size = "1Gi"
"#;

/// An object an administrator made in the sessions namespace (a ConfigMap, or a worker profile as
/// an `OabProfile`), removed when dropped.
pub struct AdminObject {
    name: String,
    _delete: DeleteOnDrop,
}

impl AdminObject {
    /// Creates (or replaces) ConfigMap `name` with `data`.
    pub async fn install(cluster: &TestCluster, name: &str, data: &[(&str, &str)]) -> AdminObject {
        let maps: Api<ConfigMap> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
        let map = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            data: Some(
                data.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            ..ConfigMap::default()
        };
        let _ = maps.delete(name, &DeleteParams::default()).await;
        maps.create(&PostParams::default(), &map)
            .await
            .expect("install the ConfigMap");
        AdminObject {
            name: name.to_owned(),
            _delete: DeleteOnDrop::new::<ConfigMap>(cluster, cluster.sessions_namespace(), name),
        }
    }

    /// A worker profile named `name` (an `OabProfile`), from its TOML form.
    pub async fn profile(cluster: &TestCluster, name: &str, document: &str) -> AdminObject {
        let object = WorkerProfile::resource_from_toml(name, document).expect("a profile in TOML");
        Self::profile_object(cluster, name, object).await
    }

    /// A worker profile named `name` (an `OabProfile`) whose `spec` is `spec`.
    pub async fn profile_spec(cluster: &TestCluster, name: &str, spec: serde_json::Value) -> AdminObject {
        let mut object = DynamicObject::new(name, &WorkerProfile::resource());
        object.data = serde_json::json!({ "spec": spec });
        Self::profile_object(cluster, name, object).await
    }

    async fn profile_object(cluster: &TestCluster, name: &str, object: DynamicObject) -> AdminObject {
        let profiles: Api<DynamicObject> = Api::namespaced_with(
            cluster.admin(),
            cluster.sessions_namespace(),
            &WorkerProfile::resource(),
        );
        let _ = profiles.delete(name, &DeleteParams::default()).await;
        profiles
            .create(&PostParams::default(), &object)
            .await
            .unwrap_or_else(|e| panic!("install the OabProfile {name}: {e}"));
        AdminObject {
            name: name.to_owned(),
            _delete: DeleteOnDrop::profile(cluster, cluster.sessions_namespace(), name),
        }
    }

    /// Makes this worker profile's spec the TOML `document` (a new profile version).
    pub async fn replace_profile(&self, cluster: &TestCluster, document: &str) {
        let object = WorkerProfile::resource_from_toml(&self.name, document).expect("a profile in TOML");
        let profiles: Api<DynamicObject> = Api::namespaced_with(
            cluster.admin(),
            cluster.sessions_namespace(),
            &WorkerProfile::resource(),
        );
        profiles
            .patch(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": object.data["spec"] })),
            )
            .await
            .unwrap_or_else(|e| panic!("change the OabProfile {}: {e}", self.name));
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// The body of `GET path` at `ip:port` from this host (which reaches Pod IPs on the bridge),
/// failing the test unless it is answered `200`.
pub async fn http_get(ip: &str, port: u16, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect((ip, port))
        .await
        .unwrap_or_else(|e| panic!("connect to {ip}:{port}: {e}"));
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: {ip}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .expect("send the request");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.expect("read the answer");
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "GET {ip}:{port}{path}: {answer}"
    );
    body.to_owned()
}

/// Runs `kubectl` (on PATH by `scripts/cluster env`, with the administrator's kubeconfig) and
/// fails the test if it fails.
pub fn kubectl(args: &[&str]) {
    let output = std::process::Command::new("kubectl")
        .args(args)
        .output()
        .expect("kubectl (scripts/cluster env puts it on PATH)");
    assert!(
        output.status.success(),
        "kubectl {args:?}: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The object of the manifest at `path` (relative to the repository) as JSON, as the API
/// server's dry run of applying it returns it (whether or not it exists): the file passed the
/// resource's schema.
pub fn manifest_object(path: &str) -> serde_json::Value {
    let file = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(path);
    let output = std::process::Command::new("kubectl")
        .args([
            "apply",
            "--server-side",
            "--dry-run=server",
            "--force-conflicts",
            "--field-manager",
            "openab-test",
            "-o",
            "json",
            "-f",
        ])
        .arg(&file)
        .output()
        .expect("kubectl (scripts/cluster env puts it on PATH)");
    assert!(
        output.status.success(),
        "the API server refused {path}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("kubectl's JSON")
}

/// A runtime builder for `installation` with the broker's identity, the profile and the reach.
pub fn builder(
    cluster: &TestCluster,
    profile: &AdminObject,
    reach: Reach,
    installation: &str,
) -> KubernetesRuntimeBuilder {
    let mut config = KubernetesConfig::new(cluster.sessions_namespace(), profile.name());
    config.reach = reach;
    KubernetesRuntime::builder(cluster.broker(), config).installation(installation)
}

/// [`builder`], whose requests go through `faults` (which counts them, and may fail them).
pub fn builder_through(
    cluster: &TestCluster,
    faults: &test_cluster::faults::Faults,
    profile: &AdminObject,
    reach: Reach,
    installation: &str,
) -> KubernetesRuntimeBuilder {
    let mut config = KubernetesConfig::new(cluster.sessions_namespace(), profile.name());
    config.reach = reach;
    KubernetesRuntime::builder(faults.client(cluster.broker_config()), config).installation(installation)
}

/// A runtime for `installation` with the broker's identity, the profile and the reach.
pub fn runtime(
    cluster: &TestCluster,
    profile: &AdminObject,
    reach: Reach,
    installation: &str,
) -> Arc<KubernetesRuntime> {
    Arc::new(
        builder(cluster, profile, reach, installation)
            .build()
            .expect("a runtime"),
    )
}

/// Leaves a session as a broker killed right after it recorded a close (`Reset`) would, and waits
/// up to `within` for someone else (a controller) to finish that close. Returns the session.
pub async fn finished_interrupted_close(
    cluster: &TestCluster,
    profile: &AdminObject,
    installation: &str,
    thread: &str,
    within: std::time::Duration,
) -> session_runtime::SessionId {
    use session_runtime::conformance::FaultInjector;
    use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime, SessionState};
    let broker = runtime(cluster, profile, Reach::Exec, installation);
    let identity = SessionIdentity::new(installation, "agent", "test", thread).expect("identity");
    let id = identity.id();
    // The controller beside it runs with no orphan grace, so it may finish this create itself
    // while the broker is still at it; the broker is then told to create again (a retryable
    // error), as a broker retries any.
    let mut attempts = 0;
    loop {
        match broker.create(&identity, &CreateOptions::new()).await {
            Ok(_) => break,
            Err(error) if error.retryable() && attempts < 5 => attempts += 1,
            Err(error) => panic!("create: {error:?}"),
        }
    }
    broker
        .record_closing(&id, CloseReason::Reset)
        .await
        .expect("record the close");
    test_cluster::wait_until("the controller to finish the close", within, || async {
        (broker.status(&id).await.expect("status").state == SessionState::Closed).then_some(())
    })
    .await;
    id
}

/// A namespaced object a test made with the administrator's client, deleted when dropped (also
/// when the test panics), from a thread, a runtime and a client of its own.
pub struct DeleteOnDrop {
    config: test_cluster::kube::Config,
    namespace: String,
    name: String,
    delete: DeleteFn,
}

/// How a [`DeleteOnDrop`] deletes its object: client, namespace, name.
type DeleteFn = fn(test_cluster::kube::Client, &str, &str) -> futures_util::future::BoxFuture<'static, ()>;

impl DeleteOnDrop {
    /// Deletes the object of kind `K` named `name` in `namespace` when dropped.
    pub fn new<K>(cluster: &TestCluster, namespace: &str, name: &str) -> DeleteOnDrop
    where
        K: test_cluster::kube::Resource<Scope = test_cluster::k8s_openapi::NamespaceResourceScope>
            + serde::de::DeserializeOwned
            + Clone
            + std::fmt::Debug
            + Send
            + 'static,
        K::DynamicType: Default,
    {
        fn delete<K>(
            client: test_cluster::kube::Client,
            namespace: &str,
            name: &str,
        ) -> futures_util::future::BoxFuture<'static, ()>
        where
            K: test_cluster::kube::Resource<Scope = test_cluster::k8s_openapi::NamespaceResourceScope>
                + serde::de::DeserializeOwned
                + Clone
                + std::fmt::Debug
                + Send
                + 'static,
            K::DynamicType: Default,
        {
            let api: Api<K> = Api::namespaced(client, namespace);
            let name = name.to_owned();
            Box::pin(async move {
                let _ = api.delete(&name, &DeleteParams::default()).await;
            })
        }
        Self::with(cluster, namespace, name, delete::<K>)
    }

    /// Deletes the `OabProfile` named `name` in `namespace` when dropped.
    pub fn profile(cluster: &TestCluster, namespace: &str, name: &str) -> DeleteOnDrop {
        fn delete(
            client: test_cluster::kube::Client,
            namespace: &str,
            name: &str,
        ) -> futures_util::future::BoxFuture<'static, ()> {
            let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &WorkerProfile::resource());
            let name = name.to_owned();
            Box::pin(async move {
                let _ = api.delete(&name, &DeleteParams::default()).await;
            })
        }
        Self::with(cluster, namespace, name, delete)
    }

    fn with(cluster: &TestCluster, namespace: &str, name: &str, delete: DeleteFn) -> DeleteOnDrop {
        DeleteOnDrop {
            config: cluster.admin_config(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            delete,
        }
    }
}

impl Drop for DeleteOnDrop {
    fn drop(&mut self) {
        let (config, namespace, name, delete) = (
            self.config.clone(),
            self.namespace.clone(),
            self.name.clone(),
            self.delete,
        );
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async {
                let client = test_cluster::kube::Client::try_from(config).ok()?;
                delete(client, &namespace, &name).await;
                Some(())
            })
        })
        .join();
    }
}
