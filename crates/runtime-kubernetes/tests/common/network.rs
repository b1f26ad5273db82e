//! Packets on the test node: connection attempts made from a shell inside a Pod, Pods that listen
//! or probe, and the wait for the NetworkPolicy engine (kube-router, scripts/cluster) to program a
//! new Pod.

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use super::DeleteOnDrop;
use runtime_kubernetes::KubernetesRuntime;
use session_runtime::{Attachment, CreateOptions, SessionId, SessionIdentity, SessionRuntime};
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::api::{ObjectMeta, PostParams};
use test_cluster::kube::Api;
use test_cluster::{exec, restricted_pod, wait_until, TestCluster};

/// The image of the probing and listening Pods: busybox's `nc`, `timeout` and `sh`.
pub const PROBE_IMAGE: &str = "openab.dev/worker:test";

/// The port the listening Pods serve.
pub const LISTEN_PORT: u16 = 8080;

/// The Pod bridge's address on the test node: the Pods' gateway, the node's InternalIP and the
/// API server's address (scripts/cluster).
pub const NODE_ADDRESS: &str = "10.244.0.1";

/// The API server's port on the node (the `kubernetes` Service's endpoint).
pub const API_SERVER_PORT: u16 = 6443;

/// The `kubernetes` Service's ClusterIP (the first address of the test cluster's service range).
pub const KUBERNETES_SERVICE_IP: &str = "10.96.0.1";

/// What one connection attempt found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The connection was established (and held until the probe gave up on it).
    Connected,
    /// Refused: a RST, or an ICMP port-unreachable such as the policy engine's REJECT.
    Refused,
    /// No answer within the probe's connect timeout (a DROP on the way).
    NoAnswer,
}

/// Opens a TCP connection from a shell inside `pod`'s first container to `address:port`.
///
/// busybox `nc` holds an established connection until the peer closes it, so `timeout` ends
/// it: a connection that lasted until then, or that the peer closed, counts as connected.
pub async fn connect_from(pods: &Api<Pod>, pod: &str, address: &str, port: u16) -> Outcome {
    let script = "timeout 3 nc -w 2 \"$0\" \"$1\" </dev/null 2>&1; echo \"exit=$?\"";
    let output = exec(pods, pod, &["sh", "-c", script, address, &port.to_string()]).await;
    classify(&output.stdout).unwrap_or_else(|| {
        panic!("the probe from {pod} to {address}:{port} said neither connected nor refused: {output:?}")
    })
}

/// What busybox `nc`'s output (with `exit=STATUS` appended) says happened, if it says.
pub fn classify(stdout: &str) -> Option<Outcome> {
    if stdout.contains("Connection refused") {
        Some(Outcome::Refused)
    } else if stdout.contains("timed out") {
        Some(Outcome::NoAnswer)
    } else if stdout.contains("can't connect") {
        None
    } else if stdout.contains("exit=0") || stdout.contains("exit=143") {
        Some(Outcome::Connected)
    } else {
        None
    }
}

/// A running worker: its session, attachment, Pod address and relay port.
pub struct Worker {
    pub id: SessionId,
    pub attachment: Attachment,
    pub pod: String,
    pub ip: String,
    pub relay_port: u16,
}

pub async fn worker(
    cluster: &TestCluster,
    runtime: &KubernetesRuntime,
    installation: &str,
    thread: &str,
) -> Worker {
    let identity = SessionIdentity::new(installation, "agent", "test", thread).expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let attachment = runtime.attach(&id).await.expect("attach");
    let (pod, ip, relay_port) = worker_pod(cluster, &id).await;
    Worker {
        id,
        attachment,
        pod,
        ip,
        relay_port,
    }
}

/// The session's worker Pod: its name, address and relay port, once the engine has programmed it.
pub async fn worker_pod(cluster: &TestCluster, id: &SessionId) -> (String, String, u16) {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = format!("oab-w-{id}");
    let pod = pods.get(&name).await.expect("the worker Pod");
    let ip = pod
        .status
        .and_then(|s| s.pod_ip)
        .expect("an attached worker has an address");
    let relay_port = pod
        .spec
        .expect("spec")
        .containers
        .iter()
        .flat_map(|c| c.ports.iter().flatten())
        .find(|p| p.name.as_deref() == Some("relay"))
        .map(|p| u16::try_from(p.container_port).expect("a port"))
        .expect("the worker names its relay port");
    wait_for_policy_engine(&ip).await;
    (name, ip, relay_port)
}

/// Connects from a shell inside `worker`'s container.
pub async fn from_worker(cluster: &TestCluster, worker: &Worker, address: &str, port: u16) -> Outcome {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    connect_from(&pods, &worker.pod, address, port).await
}

/// Probes up to three times while the probe meets silence, and returns the last outcome.
///
/// For addresses off this machine: the engine refuses a packet the node would forward with an
/// ICMP error, and one such error in several runs arrived as silence. A connection, or a refusal,
/// on any attempt ends the probing.
pub async fn probe_through_silence<F, Fut>(mut probe: F) -> Outcome
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Outcome>,
{
    let mut outcome = Outcome::NoAnswer;
    for _ in 0..3 {
        outcome = probe().await;
        if outcome != Outcome::NoAnswer {
            break;
        }
    }
    outcome
}

/// Opens a TCP connection from this host (the node, where the tests' broker runs).
pub fn connect_from_host(address: &str, port: u16) -> Outcome {
    let socket: std::net::SocketAddr = format!("{address}:{port}").parse().expect("an address");
    match std::net::TcpStream::connect_timeout(&socket, Duration::from_secs(2)) {
        Ok(_) => Outcome::Connected,
        Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => Outcome::Refused,
        Err(_) => Outcome::NoAnswer,
    }
}

/// A Pod of `PROBE_IMAGE` in `namespace`, deleted when dropped.
pub struct TestPod {
    pub name: String,
    pub ip: String,
    pub pods: Api<Pod>,
    _delete: DeleteOnDrop,
}

impl TestPod {
    /// Sleeps, for probes from inside it.
    pub async fn prober(
        cluster: &TestCluster,
        namespace: &str,
        name: &str,
        labels: &[(&str, &str)],
    ) -> TestPod {
        Self::start(cluster, namespace, name, labels, &["sleep", "3600"]).await
    }

    /// Serves `LISTEN_PORT`, echoing what it is sent, for as many connections as come.
    pub async fn listener(cluster: &TestCluster, namespace: &str, name: &str) -> TestPod {
        let port = LISTEN_PORT.to_string();
        Self::start(
            cluster,
            namespace,
            name,
            &[],
            &["nc", "-ll", "-p", &port, "-e", "cat"],
        )
        .await
    }

    async fn start(
        cluster: &TestCluster,
        namespace: &str,
        name: &str,
        labels: &[(&str, &str)],
        command: &[&str],
    ) -> TestPod {
        let pods: Api<Pod> = Api::namespaced(cluster.admin(), namespace);
        let mut pod = restricted_pod(name, PROBE_IMAGE, command);
        pod.metadata = ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect::<BTreeMap<_, _>>(),
            ),
            ..ObjectMeta::default()
        };
        pods.create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|error| panic!("create Pod {namespace}/{name}: {error}"));
        let delete = DeleteOnDrop::new::<Pod>(cluster, namespace, name);
        let ip = wait_until(
            &format!("Pod {namespace}/{name} running"),
            Duration::from_secs(60),
            || async {
                let pod = pods.get(name).await.ok()?;
                let status = pod.status?;
                (status.phase.as_deref() == Some("Running")).then_some(status.pod_ip)?
            },
        )
        .await;
        TestPod {
            name: name.to_owned(),
            ip,
            pods,
            _delete: delete,
        }
    }

    /// Opens a connection from inside this Pod.
    pub async fn connect(&self, address: &str, port: u16) -> Outcome {
        connect_from(&self.pods, &self.name, address, port).await
    }

    /// Connects from inside this Pod once `address:port` answers, within 30 s, and panics if it
    /// never does: a positive control, which a dead network or a policy that never admits this
    /// Pod (the engine adds a new Pod to the sets its policies name after it starts) fails.
    pub async fn eventually_connects(&self, address: &str, port: u16) {
        let what = format!("{} connecting to {address}:{port}", self.name);
        wait_until(&what, Duration::from_secs(30), || async {
            (self.connect(address, port).await == Outcome::Connected).then_some(())
        })
        .await;
    }
}

/// Waits until the policy engine has programmed the Pod at `ip` (which a policy selects).
///
/// kube-router writes a Pod's rules after the Pod has its address, so a packet sent in the
/// first moments of a Pod's life may pass before its policies apply (production engines have
/// such a window too: docs/kubernetes.md). The tests probe after it, reading the node's rules.
pub async fn wait_for_policy_engine(ip: &str) {
    let wanted = format!("-d {ip}/32");
    let sources = format!("-s {ip}/32");
    wait_until(
        &format!("kube-router's rules for Pod {ip}"),
        Duration::from_secs(60),
        || {
            let (wanted, sources) = (wanted.clone(), sources.clone());
            async move {
                let output = Command::new("iptables")
                    .args(["-t", "filter", "-S"])
                    .output()
                    .ok()?;
                let rules = String::from_utf8_lossy(&output.stdout);
                (rules.contains(&wanted) && rules.contains(&sources)).then_some(())
            }
        },
    )
    .await;
}
