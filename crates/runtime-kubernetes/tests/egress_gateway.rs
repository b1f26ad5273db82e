//! The egress gateway as `deploy/kubernetes/egress-gateway.yaml` deploys it (two replicas behind
//! its Service, applied through an overlay that sets only the test's image, profile, Secret and
//! model address), with `networkpolicy.yaml`'s worker policy enforced by the test node's policy
//! engine:
//!
//! - codex-acp in a worker Pod, under `deploy/kubernetes/agents/codex.yaml`'s profile (adapted only
//!   where an operator adapts it), completes a prompt turn through the profile's model route against
//!   a fake OpenAI-compatible model that answers only the Secret's key, which the worker never
//!   holds: a probe from a shell in the worker finds it in no process's environment or command
//!   line, in HOME, the workspace or /tmp (and finds the session's own route key there, the
//!   positive control);
//! - from the same shell, the worker reaches the model only through the gateway (a direct
//!   connection is refused by the engine), and the gateway refuses, each with its status and a
//!   log line: an unlisted name, an IP literal, names that resolve to a private or a loopback
//!   address, another session's name with this session's token, no credential, a malformed
//!   request and an oversized head; it goes on serving the session after each.
//!
//! The gateway binary is the workspace's debug build (`cargo test --workspace --all-features`
//! builds it; this test refuses an older one than its sources).
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo build -p egress-proxy
//! --features kubernetes --bin oab-egress-gateway && cargo test -p runtime-kubernetes
//! --all-features --test egress_gateway -- --ignored`.

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::agents::{one_turn, worker_pod, FakeModel, AGENT_IMAGE};
use common::{builder, http_get, kubectl, manifest_object, AdminObject, DeleteOnDrop};
use egress_proxy::gateway::GatewayKey;
use runtime_kubernetes::profile::WorkerProfile;
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, SessionId, SessionIdentity, SessionRuntime};
use test_cluster::k8s_openapi::api::core::v1::{Pod, Secret, Service};
use test_cluster::k8s_openapi::ByteString;
use test_cluster::kube::api::{
    DynamicObject, ListParams, LogParams, ObjectMeta, Patch, PatchParams, PostParams,
};
use test_cluster::kube::Api;
use test_cluster::{exec, unique_name, wait_until, TestCluster};

/// The gateway's port, as deploy/kubernetes/egress-gateway.yaml's Service has it.
const GATEWAY_PORT: u16 = 3128;
/// The gateway's metrics port (egress-gateway.yaml's `metrics`).
const METRICS_PORT: u16 = 9090;
/// The fake model's port.
const MODEL_PORT: u16 = 8000;
/// The Secret the gateway reads the model's key from (never one a worker may read).
const MODEL_SECRET: &str = "oab-test-gateway-model";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The workspace's debug `oab-egress-gateway`, refused when older than any of its sources.
fn gateway_binary() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| repo().join("target"), PathBuf::from);
    let binary = target.join("debug/oab-egress-gateway");
    let built = std::fs::metadata(&binary)
        .and_then(|m| m.modified())
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e} (cargo build -p egress-proxy --features kubernetes --bin oab-egress-gateway)",
                binary.display()
            )
        });
    let mut sources = vec![repo().join("crates/egress-proxy/src")];
    while let Some(dir) = sources.pop() {
        for entry in std::fs::read_dir(&dir).expect("the gateway's sources") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                sources.push(path);
            } else {
                let changed = std::fs::metadata(&path)
                    .and_then(|m| m.modified())
                    .expect("a source's time");
                assert!(
                    changed <= built,
                    "{} is older than {}: cargo build -p egress-proxy --features kubernetes --bin oab-egress-gateway",
                    binary.display(),
                    path.display()
                );
            }
        }
    }
    binary
}

/// deploy/kubernetes/egress-gateway.yaml applied through an overlay, deleted (and waited for)
/// when dropped.
struct DeployedGateway {
    overlay: tempfile::TempDir,
}

impl DeployedGateway {
    /// Applies the gateway (it follows every OabProfile of `namespace`), its model route's Secret
    /// `MODEL_SECRET`, with `model.internal` and `shadow.internal` resolving to `model_ip` and
    /// `loop.internal` to
    /// 127.0.0.1 in its Pods, and an allowance to reach `model_ip` on the model's port.
    fn apply(namespace: &str, model_ip: &str) -> DeployedGateway {
        let overlay = tempfile::tempdir().expect("an overlay directory");
        std::fs::copy(
            repo().join("deploy/kubernetes/egress-gateway.yaml"),
            overlay.path().join("egress-gateway.yaml"),
        )
        .expect("copy egress-gateway.yaml");
        let model_policy = format!(
            r#"apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: oab-egress-gateway-test-model
  namespace: {namespace}
spec:
  podSelector:
    matchLabels:
      app.kubernetes.io/name: openab-egress-gateway
  policyTypes: [Egress]
  egress:
    - to:
        - ipBlock:
            cidr: {model_ip}/32
      ports:
        - port: {MODEL_PORT}
          protocol: TCP
"#
        );
        std::fs::write(overlay.path().join("model.yaml"), model_policy).expect("write the model policy");
        let kustomization = format!(
            r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: {namespace}
resources: [egress-gateway.yaml, model.yaml]
images:
  - name: oab-egress-gateway
    newName: openab.dev/egress-gateway
    newTag: test
patches:
  - target: {{ kind: Deployment, name: openab-egress-gateway }}
    patch: |-
      - op: add
        path: /spec/template/spec/containers/0/imagePullPolicy
        value: Never
      - op: replace
        path: /spec/template/spec/volumes/1/projected/sources
        value: [{{ secret: {{ name: {MODEL_SECRET}, items: [{{ key: openai, path: {MODEL_SECRET}/openai }}] }} }}]
      - op: add
        path: /spec/template/spec/hostAliases
        value: [{{ ip: "{model_ip}", hostnames: [model.internal, shadow.internal] }}, {{ ip: 127.0.0.1, hostnames: [loop.internal] }}]
"#
        );
        std::fs::write(overlay.path().join("kustomization.yaml"), kustomization).expect("write the overlay");
        let gateway = DeployedGateway { overlay };
        kubectl(&["apply", "-k", gateway.path()]);
        gateway
    }

    fn path(&self) -> &str {
        self.overlay.path().to_str().expect("a UTF-8 path")
    }
}

impl Drop for DeployedGateway {
    fn drop(&mut self) {
        let _ = Command::new("kubectl")
            .args(["delete", "-k", self.path(), "--ignore-not-found", "--wait=true"])
            .output();
    }
}

/// Secret `name` in the sessions namespace with `data`, deleted when dropped.
async fn secret(cluster: &TestCluster, name: &str, data: &[(&str, &[u8])]) -> DeleteOnDrop {
    let secrets: Api<Secret> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let _ = secrets.delete(name, &Default::default()).await;
    let object = Secret {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some(
            data.iter()
                .map(|(key, value)| ((*key).to_owned(), ByteString(value.to_vec())))
                .collect(),
        ),
        ..Secret::default()
    };
    secrets
        .create(&PostParams::default(), &object)
        .await
        .expect("create the Secret");
    DeleteOnDrop::new::<Secret>(cluster, cluster.sessions_namespace(), name)
}

/// The gateway's address in `deploy/kubernetes/agents/codex.yaml`, which an operator replaces.
const DOCUMENTED_GATEWAY: &str = "10.96.0.50:3128";

/// `deploy/kubernetes/agents/codex.yaml`'s profile, as an operator adapts it to this cluster: the
/// gateway's address (`gateway`; the documented placeholder until it is known), the model's
/// address and Secret, and this cluster's image, storage and limits; plus destinations for the
/// refusals (`egress_hosts`). Everything else (codex's arguments, the route's prefix, header and
/// key variable) is the file's.
fn codex_profile(model_ip: &str, gateway: &str) -> serde_json::Value {
    let manifest = manifest_object("deploy/kubernetes/agents/codex.yaml");
    let mut text = serde_json::to_string(&manifest["spec"]).expect("JSON");
    for (documented, here) in [
        (DOCUMENTED_GATEWAY, gateway.to_owned()),
        (
            "https://api.openai.com/v1",
            format!("http://{model_ip}:{MODEL_PORT}/v1"),
        ),
        ("codex-model-keys", MODEL_SECRET.to_owned()),
    ] {
        assert!(
            text.contains(documented),
            "codex.yaml no longer holds {documented}"
        );
        text = text.replace(documented, &here);
    }
    let mut profile: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let cluster = serde_json::json!({
        "image": AGENT_IMAGE,
        "image_pull_policy": "Never",
        "termination_grace": "2s",
        "egress_hosts": [
            format!("model.internal:{MODEL_PORT} private"),
            format!("shadow.internal:{MODEL_PORT}"),
            format!("loop.internal:{MODEL_PORT}"),
        ],
        "resources": { "memory_limit": "512Mi" },
        "storage": { "kind": "per-session", "class": "openab-test-local", "size": "1Gi" },
    });
    for (key, value) in cluster.as_object().expect("an object") {
        profile[key] = value.clone();
    }
    profile
}

/// Where `needle` is, seen from a shell in the session's worker: the environment and command
/// line of each process, and the files under HOME, the workspace and /tmp. The probe is given the
/// needle in base64 and holds it in memory only, so it never finds itself.
async fn places_holding(pods: &Api<Pod>, pod: &str, needle: &str) -> Vec<String> {
    let script = r#"
import base64, glob, os, sys
needle = base64.b64decode(sys.argv[1])
for path in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
    try:
        if needle in open(path, "rb").read():
            print(path)
    except OSError:
        pass
for top in (os.environ["HOME"], "/workspace", "/tmp"):
    for directory, _, files in os.walk(top):
        for name in files:
            path = os.path.join(directory, name)
            try:
                if needle in open(path, "rb").read():
                    print(path)
            except OSError:
                pass
"#;
    let encoded = data_encoding::BASE64.encode(needle.as_bytes());
    let output = exec(pods, pod, &["python3", "-c", script, &encoded]).await;
    assert!(output.success, "the probe: {}", output.stderr);
    output.stdout.lines().map(str::to_owned).collect()
}

/// Sends `request` (raw bytes) to the gateway from a shell in the worker; returns the answer's
/// status line (empty if the connection closed without one).
async fn from_worker(pods: &Api<Pod>, pod: &str, gateway: &str, request: &[u8]) -> String {
    let script = r#"
import base64, socket, sys
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)), timeout=20)
s.sendall(base64.b64decode(sys.argv[2]))
answer = b""
while b"\r\n" not in answer:
    chunk = s.recv(4096)
    if not chunk:
        break
    answer += chunk
print(answer.split(b"\r\n")[0].decode(errors="replace"))
"#;
    let encoded = data_encoding::BASE64.encode(request);
    let output = exec(pods, pod, &["python3", "-c", script, gateway, &encoded]).await;
    assert!(output.success, "the request from the worker: {}", output.stderr);
    output.stdout.trim().to_owned()
}

/// A TCP connection from the worker to `address:port`, bypassing the gateway: `connected`,
/// `refused` or `timed out`.
async fn direct(pods: &Api<Pod>, pod: &str, address: &str, port: u16) -> String {
    let script = r#"
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("connected")
except ConnectionRefusedError:
    print("refused")
except OSError as error:
    print("timed out" if isinstance(error, TimeoutError) else "failed: %s" % error)
"#;
    let output = exec(pods, pod, &["python3", "-c", script, address, &port.to_string()]).await;
    assert!(output.success, "the direct probe: {}", output.stderr);
    output.stdout.trim().to_owned()
}

/// The sum over `texts` (Prometheus text) of the samples whose line starts with `series`.
fn sample_sum(texts: &[String], series: &str) -> f64 {
    texts
        .iter()
        .flat_map(|text| text.lines())
        .filter_map(|line| line.strip_prefix(series)?.trim().parse::<f64>().ok())
        .sum()
}

/// The logs of every gateway Pod.
async fn gateway_logs(cluster: &TestCluster) -> String {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let listed = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=openab-egress-gateway"))
        .await
        .expect("list the gateway's Pods");
    let mut text = String::new();
    for pod in listed {
        let name = pod.metadata.name.unwrap_or_default();
        text.push_str(&pods.logs(&name, &LogParams::default()).await.unwrap_or_default());
    }
    text
}

fn random_bytes(n: usize) -> Vec<u8> {
    let mut bytes = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .expect("random bytes");
    bytes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn codex_reaches_its_model_through_the_gateway_which_alone_holds_the_key_and_refuses_the_rest() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace().to_owned();
    let installation = unique_name("gateway");
    let image = Command::new(repo().join("scripts/cluster"))
        .arg("image")
        .arg("egress-gateway")
        .arg(gateway_binary())
        .output()
        .expect("scripts/cluster image");
    assert!(
        image.status.success(),
        "building the gateway's image: {}",
        String::from_utf8_lossy(&image.stderr)
    );

    let model_key = unique_name("sk-gateway-only");
    let model = FakeModel::start_requiring(&cluster, "gateway-model", Some(&model_key)).await;
    let _model_secret = secret(&cluster, MODEL_SECRET, &[("openai", model_key.as_bytes())]).await;
    let key = random_bytes(32);
    let _key_secret = secret(&cluster, "oab-egress-gateway-key", &[("key", &key)]).await;
    // The gateway reads only the profile's destinations and routes, which do not name it.
    let profile = AdminObject::profile_spec(
        &cluster,
        &installation,
        codex_profile(&model.ip, DOCUMENTED_GATEWAY),
    )
    .await;
    let deployed = DeployedGateway::apply(&namespace, &model.ip);

    let services: Api<Service> = Api::namespaced(cluster.admin(), &namespace);
    let service_ip = services
        .get("openab-egress-gateway")
        .await
        .expect("the gateway's Service")
        .spec
        .and_then(|spec| spec.cluster_ip)
        .expect("a cluster IP");
    // Workers have no DNS: they reach the gateway by its Service's address.
    let gateway = format!("{service_ip}:{GATEWAY_PORT}");
    let profile =
        AdminObject::profile_spec(&cluster, profile.name(), codex_profile(&model.ip, &gateway)).await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), &namespace);
    wait_until(
        "both gateway replicas to be ready",
        Duration::from_secs(120),
        || async {
            let listed = pods
                .list(&ListParams::default().labels("app.kubernetes.io/name=openab-egress-gateway"))
                .await
                .ok()?;
            let ready = listed
                .iter()
                .filter(|pod| {
                    pod.status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
                })
                .count();
            (ready == 2).then_some(())
        },
    )
    .await;

    let runtime = std::sync::Arc::new(
        builder(&cluster, &profile, Reach::Exec, &installation)
            .egress_gateway_key(GatewayKey::new(key.clone()))
            .build()
            .expect("a runtime"),
    );
    let identity = SessionIdentity::new(&installation, "agent", "test", "a").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));

    // A turn through the model route: the model saw the Secret's key (it answers nothing else).
    let (served_before, _) = model.stats().await;
    one_turn(&client, "ping").await;
    assert!(
        model.stats().await.0 > served_before,
        "codex answered without the model"
    );
    assert_eq!(
        model.refused().await,
        0,
        "a model request without the Secret's key"
    );

    // The worker holds its own route key (the positive control of the probe), never the model's.
    let pod = worker_pod(&cluster, &id).await;
    let route_key = GatewayKey::new(key.clone())
        .credential(id, profile.name())
        .route_key();
    let holding_route_key = places_holding(&pods, &pod, &route_key).await;
    assert!(
        holding_route_key.iter().any(|place| place.ends_with("/environ")),
        "the probe does not see the agent's environment: {holding_route_key:?}"
    );
    let holding_model_key = places_holding(&pods, &pod, &model_key).await;
    assert!(
        holding_model_key.is_empty(),
        "the model's key inside the worker: {holding_model_key:?}"
    );

    // The model is reachable through the gateway only.
    assert_eq!(
        direct(&pods, &pod, &model.ip, MODEL_PORT).await,
        "refused",
        "the worker's direct connection to the model"
    );

    let credential = GatewayKey::new(key.clone()).credential(id, profile.name());
    let token = route_key.rsplit(':').next().expect("a token").to_owned();
    let other: SessionId = SessionIdentity::new(&installation, "agent", "test", "b")
        .expect("identity")
        .id();
    let connect = |target: &str, authorization: Option<String>| {
        let credential =
            authorization.map_or_else(String::new, |value| format!("Proxy-Authorization: {value}\r\n"));
        format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{credential}\r\n").into_bytes()
    };
    let own = || Some(credential.header_value());
    let model_name = format!("model.internal:{MODEL_PORT}");
    let allowed = from_worker(&pods, &pod, &gateway, &connect(&model_name, own())).await;
    assert!(allowed.starts_with("HTTP/1.1 200"), "the listed name: {allowed}");
    let borrowed = format!(
        "Basic {}",
        data_encoding::BASE64.encode(format!("{other}.{}:{token}", profile.name()).as_bytes())
    );
    let refusals: Vec<(&str, Vec<u8>, &str)> = vec![
        ("an unlisted name", connect("unlisted.example:443", own()), "403"),
        (
            "an IP literal",
            connect(&format!("{}:{MODEL_PORT}", model.ip), own()),
            "403",
        ),
        (
            "a name resolving to a private address",
            connect(&format!("shadow.internal:{MODEL_PORT}"), own()),
            "403",
        ),
        (
            "a name resolving to a loopback address",
            connect(&format!("loop.internal:{MODEL_PORT}"), own()),
            "403",
        ),
        (
            "another session's name with this session's token",
            connect(&model_name, Some(borrowed)),
            "407",
        ),
        ("no credential", connect(&model_name, None), "407"),
        ("a malformed request", b"NOT HTTP AT ALL\r\n\r\n".to_vec(), "400"),
        (
            "an oversized head",
            format!(
                "CONNECT {model_name} HTTP/1.1\r\nProxy-Authorization: {}\r\nX-Long: {}\r\n\r\n",
                credential.header_value(),
                "a".repeat(20 * 1024)
            )
            .into_bytes(),
            "431",
        ),
    ];
    for (case, request, status) in &refusals {
        let answer = from_worker(&pods, &pod, &gateway, request).await;
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {status}")),
            "{case}: {answer:?}"
        );
        let again = from_worker(&pods, &pod, &gateway, &connect(&model_name, own())).await;
        assert!(again.starts_with("HTTP/1.1 200"), "served after {case}: {again}");
    }

    // A profile's change applies to its sessions' next requests, without restarting the
    // gateway: with model.internal no longer among its hosts, the CONNECT answered above is
    // refused; put back, it is answered again (by both replicas behind the Service).
    let profiles: Api<DynamicObject> =
        Api::namespaced_with(cluster.admin(), &namespace, &WorkerProfile::resource());
    let listed_hosts = codex_profile(&model.ip, &gateway)["egress_hosts"].clone();
    for (hosts, status) in [(serde_json::json!([]), "403"), (listed_hosts, "200")] {
        profiles
            .patch(
                profile.name(),
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({ "spec": { "egress_hosts": hosts } })),
            )
            .await
            .expect("change the profile");
        let request = connect(&model_name, own());
        wait_until(
            &format!("the gateway to answer {status} after the profile's change"),
            Duration::from_secs(30),
            || async {
                for _ in 0..4 {
                    let answer = from_worker(&pods, &pod, &gateway, &request).await;
                    if !answer.starts_with(&format!("HTTP/1.1 {status}")) {
                        return None;
                    }
                }
                Some(())
            },
        )
        .await;
    }

    // The metrics count what was answered, and are served to this host but not to the worker.
    let gateway_pods = pods
        .list(&ListParams::default().labels("app.kubernetes.io/name=openab-egress-gateway"))
        .await
        .expect("list the gateway's Pods");
    let mut scraped = Vec::new();
    for gateway_pod in &gateway_pods {
        let ip = gateway_pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .expect("a Pod IP");
        // As a scraper outside the sessions namespace (and the kubelet's probes) reach it.
        scraped.push(http_get(&ip, METRICS_PORT, "/metrics").await);
        assert_eq!(
            direct(&pods, &pod, &ip, METRICS_PORT).await,
            "refused",
            "the worker reached the gateway's metrics"
        );
    }
    let forbidden = sample_sum(
        &scraped,
        "openab_egress_requests_total{kind=\"connect\",status=\"403\"}",
    );
    assert!(forbidden >= 4.0, "403s counted: {forbidden}\n{scraped:?}");
    let routed = sample_sum(
        &scraped,
        "openab_egress_requests_total{kind=\"route\",status=\"200\"}",
    );
    assert!(routed >= 1.0, "model route requests counted: {routed}");

    // Each refusal is logged with the session and the reason; no log holds either key.
    let logs = gateway_logs(&cluster).await;
    assert!(!logs.contains(&model_key), "the model's key in the gateway's log");
    assert!(!logs.contains(&token), "a session's token in the gateway's log");
    for (destination, reason) in [
        ("unlisted.example:443", "not in the session's allowlist"),
        ("shadow.internal:8000", "resolves to"),
        ("loop.internal:8000", "resolves to"),
    ] {
        assert!(
            logs.lines().any(|line| line.contains("egress refused")
                && line.contains(&format!("session={id}"))
                && line.contains(&format!("destination={destination}"))
                && line.contains(reason)),
            "no refusal of {destination} logged:\n{logs}"
        );
    }
    assert!(
        logs.lines().any(|line| line.contains("model route")
            && line.contains(&format!("session={id}"))
            && line.contains("status=200")),
        "the model route's use is not logged:\n{logs}"
    );
    assert!(
        logs.lines()
            .any(|line| line.contains("session=-") && line.contains("reason=no proxy credential")),
        "the missing credential's refusal is not logged:\n{logs}"
    );

    drop(client);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
    drop(deployed);
}
