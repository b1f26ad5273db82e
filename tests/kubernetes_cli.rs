//! `oab-runtime` against the test cluster with `type = "kubernetes"`, as an operator runs it,
//! with the broker's identity: `controller` takes the installation's leader Lease and gives it up
//! on SIGTERM; `verify` proves isolation between two worker Pods and says what it proved.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test --features kubernetes
//! --test kubernetes_cli -- --ignored`.

use std::process::{Command, Stdio};
use std::time::Duration;

use runtime_kubernetes::profile::WorkerProfile;
use runtime_kubernetes::OabSession;
use test_cluster::k8s_openapi::api::coordination::v1::Lease;
use test_cluster::k8s_openapi::api::core::v1::ConfigMap;
use test_cluster::kube::api::{DeleteParams, DynamicObject, ObjectMeta, PostParams};
use test_cluster::kube::Api;
use test_cluster::{unique_name, wait_until, TestCluster};

/// An OpenAB configuration file for `type = "kubernetes"` with `installation` and `profile`, and
/// `extra` keys of the kubernetes table; the directory holding it goes when dropped.
fn configuration(
    cluster: &TestCluster,
    installation: &str,
    profile: &str,
    extra: &str,
) -> (tempfile::TempDir, std::path::PathBuf) {
    let directory = tempfile::tempdir().expect("a directory");
    let config = directory.path().join("openab.toml");
    std::fs::write(
        &config,
        format!(
            "[session_runtime]\ntype = \"kubernetes\"\ninstallation = \"{installation}\"\n\
             [session_runtime.kubernetes]\nnamespace = \"{}\"\nprofile = \"{profile}\"\n{extra}",
            cluster.sessions_namespace()
        ),
    )
    .expect("write the configuration");
    (directory, config)
}

/// The broker's kubeconfig, which `oab-runtime` gets as its `KUBECONFIG`.
fn broker_kubeconfig() -> String {
    std::env::var("OPENAB_BROKER_KUBECONFIG").expect("scripts/cluster env sets OPENAB_BROKER_KUBECONFIG")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test --features kubernetes -- --ignored"]
async fn the_controller_command_leads_and_gives_the_lease_up_on_sigterm() {
    let cluster = TestCluster::connect().await;
    let installation = unique_name("cli");
    let (_directory, config) = configuration(&cluster, &installation, "isolated-worker", "");
    let broker_kubeconfig = broker_kubeconfig();
    let controller = Command::new(env!("CARGO_BIN_EXE_oab-runtime"))
        .arg("--config")
        .arg(&config)
        .args([
            "controller",
            "--holder",
            "cli-test",
            "--lease-duration",
            "3s",
            "--resync",
            "1s",
        ])
        .env("KUBECONFIG", broker_kubeconfig)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start oab-runtime controller");

    let leases: Api<Lease> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = format!("oab-leader-{installation}");
    let holder = |lease: Option<Lease>| lease.and_then(|l| l.spec?.holder_identity);
    wait_until(
        "the controller to hold the Lease",
        Duration::from_secs(30),
        || async {
            let lease = leases.get_opt(&name).await.expect("read the Lease");
            (holder(lease).as_deref() == Some("cli-test")).then_some(())
        },
    )
    .await;

    let pid = controller.id().to_string();
    let signalled = Command::new("kill").args(["-TERM", &pid]).status().expect("kill");
    assert!(signalled.success());
    let output = tokio::task::spawn_blocking(move || controller.wait_with_output())
        .await
        .expect("join")
        .expect("the controller's exit");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "exit {:?}: {stderr}", output.status);
    assert!(stderr.contains("leading (epoch"), "{stderr}");
    let lease = leases.get_opt(&name).await.expect("read the Lease");
    assert_eq!(holder(lease), None, "SIGTERM gives the Lease up: {stderr}");
    leases
        .delete(&name, &Default::default())
        .await
        .expect("remove the test's Lease");
}

/// The e2e worker image with the ACP test agent (its exec probe is the shell `verify` uses), its
/// skills recursively read-only (the default).
const PROFILE: &str = r#"
image = "openab.dev/worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/acp-test-agent"]
termination_grace = "2s"

[storage]
kind = "per-session"
class = "openab-test-local"
size = "1Gi"

[[skills]]
name = "demo"
mount_path = "/skills"
config_map = "SKILLS"
"#;

/// The worker profile `name` (an OabProfile) from its TOML form, as an administrator makes it.
async fn profile(cluster: &TestCluster, name: &str, document: &str) -> Api<DynamicObject> {
    let profiles: Api<DynamicObject> = Api::namespaced_with(
        cluster.admin(),
        cluster.sessions_namespace(),
        &WorkerProfile::resource(),
    );
    let object = WorkerProfile::resource_from_toml(name, document).expect("a profile in TOML");
    profiles
        .create(&PostParams::default(), &object)
        .await
        .expect("an OabProfile");
    profiles
}

async fn config_map(cluster: &TestCluster, name: &str, key: &str, value: &str) -> Api<ConfigMap> {
    let maps: Api<ConfigMap> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let map = ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        data: Some([(key.to_owned(), value.to_owned())].into()),
        ..ConfigMap::default()
    };
    maps.create(&PostParams::default(), &map)
        .await
        .expect("a ConfigMap");
    maps
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test --features kubernetes -- --ignored"]
async fn verify_proves_isolation_between_worker_pods_and_says_what_it_proved() {
    let cluster = TestCluster::connect().await;
    let installation = unique_name("verify");
    let skills = format!("{installation}-skills");
    let maps = config_map(&cluster, &skills, "SKILL.md", "# shared\n").await;
    let profiles = profile(&cluster, &installation, &PROFILE.replace("SKILLS", &skills)).await;
    let (_directory, config) = configuration(&cluster, &installation, &installation, "reach = \"exec\"\n");
    let broker_kubeconfig = broker_kubeconfig();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_oab-runtime"))
            .arg("--config")
            .arg(&config)
            .args(["verify", "--shared-input", "/skills/SKILL.md"])
            .env("KUBECONFIG", broker_kubeconfig)
            .stdin(Stdio::null())
            .output()
    })
    .await
    .expect("join")
    .expect("run oab-runtime verify");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "exit {:?}\n{stdout}\n{stderr}",
        output.status
    );
    assert!(stdout.contains("Proved: two sessions' worker Pods"), "{stdout}");
    assert!(stdout.contains("Not proved here"), "{stdout}");
    let _ = maps.delete(&skills, &DeleteParams::default()).await;
    let _ = profiles.delete(&installation, &DeleteParams::default()).await;
}

/// A profile whose sessions need no volume: `create` makes the anchor alone.
const EPHEMERAL_PROFILE: &str = r#"
image = "openab.dev/worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/acp-test-agent"]

[storage]
kind = "ephemeral"
"#;

/// The API server's port, from the admin kubeconfig `scripts/cluster env` names.
fn kubectl(args: &[&str]) -> String {
    let output = Command::new("kubectl")
        .args(args)
        .output()
        .expect("kubectl (scripts/cluster env puts it on PATH)");
    assert!(
        output.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Rewrites the session's record in its anchor's status, through the admin's client.
async fn edit_record(anchors: &Api<OabSession>, name: &str, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut anchor = anchors.get(name).await.expect("the anchor");
    edit(&mut anchor.status.as_mut().expect("a recorded session").record);
    anchors
        .replace_status(name, &PostParams::default(), &anchor)
        .await
        .expect("write the record");
}

async fn record_of(anchors: &Api<OabSession>, name: &str) -> serde_json::Value {
    let anchor = anchors.get(name).await.expect("the anchor");
    anchor.status.expect("a recorded session").record
}

/// The body of `GET path` at `ip:port`, if answered `200`.
async fn http_get(ip: &str, port: u16, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect((ip, port)).await.ok()?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: controller\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

/// `deploy/kubernetes/controller.yaml` itself, applied with `kubectl apply -k` through an overlay
/// that sets only what the test cluster needs: the image built from this `oab-runtime` and this
/// test's installation. The controller reaches the API server as in production, through the
/// `kubernetes` Service (kube-proxy), with the in-cluster configuration it finds by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test --features cli,kubernetes -- --ignored"]
async fn the_controller_deployment_leads_in_cluster_finishes_an_interrupted_close_and_hands_over() {
    let cluster = TestCluster::connect().await;
    let installation = unique_name("deployed");
    let namespace = cluster.sessions_namespace().to_owned();
    let profiles = profile(&cluster, &installation, EPHEMERAL_PROFILE).await;

    // On kind (scripts/kind-e2e.sh) the image is loaded already.
    let on_kind = std::env::var_os("OPENAB_CLUSTER_KIND").is_some();
    if !on_kind {
        let image = Command::new("scripts/cluster")
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["image", "controller", env!("CARGO_BIN_EXE_oab-runtime")])
            .output()
            .expect("scripts/cluster image");
        assert!(
            image.status.success(),
            "building the controller image: {}",
            String::from_utf8_lossy(&image.stderr)
        );
    }

    let overlay = tempfile::tempdir().expect("an overlay directory");
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/kubernetes/controller.yaml"),
        overlay.path().join("controller.yaml"),
    )
    .expect("copy controller.yaml");
    let config = format!(
        "[session_runtime]\ntype = \"kubernetes\"\ninstallation = \"{installation}\"\n\
         [session_runtime.kubernetes]\nnamespace = \"{namespace}\"\nprofile = \"{installation}\"\n"
    );
    let kustomization = format!(
        r#"apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [controller.yaml]
images:
  - name: oab-runtime
    newName: openab.dev/controller
    newTag: test
patches:
  - target: {{ kind: ConfigMap, name: oab-controller }}
    patch: |-
      - op: replace
        path: /data/openab.toml
        value: {config:?}
  - target: {{ kind: Deployment, name: oab-controller }}
    patch: |-
      - op: add
        path: /spec/template/spec/containers/0/imagePullPolicy
        value: Never
"#
    );
    std::fs::write(overlay.path().join("kustomization.yaml"), kustomization).expect("write the overlay");
    let overlay_path = overlay.path().to_str().expect("a UTF-8 path").to_owned();
    kubectl(&["apply", "-k", &overlay_path]);

    // One of the two replicas leads: the Lease names one of the Deployment's Pods.
    let pods: Api<test_cluster::k8s_openapi::api::core::v1::Pod> = Api::namespaced(cluster.admin(), "openab");
    let anchors: Api<OabSession> = Api::namespaced(cluster.admin(), &namespace);
    let leases: Api<Lease> = Api::namespaced(cluster.admin(), &namespace);
    let leader_lease = format!("oab-leader-{installation}");
    let leader = || async {
        let lease = leases.get_opt(&leader_lease).await.ok()??;
        let spec = lease.spec?;
        Some((spec.holder_identity?, spec.lease_transitions.unwrap_or(0)))
    };
    let controller_pods = || async {
        pods.list(
            &test_cluster::kube::api::ListParams::default().labels("app.kubernetes.io/name=oab-controller"),
        )
        .await
        .map(|list| {
            list.items
                .into_iter()
                .filter(|pod| pod.metadata.deletion_timestamp.is_none())
                .filter_map(|pod| pod.metadata.name)
                .collect::<Vec<_>>()
        })
        .unwrap_or_default()
    };
    let (first, first_transitions) =
        wait_until("a controller Pod to lead", Duration::from_secs(120), || async {
            let (holder, transitions) = leader().await?;
            let names = controller_pods().await;
            let pod = names.into_iter().find(|name| holder.starts_with(name.as_str()))?;
            Some((pod, transitions))
        })
        .await;

    // The leader finishes a close that a broker left half done.
    let runtime = openab_runtime::from_config(
        &openab_runtime::config::SessionRuntimeConfig::from_toml_document(&config).expect("config"),
        &openab_runtime::AgentCommand::new("/usr/local/bin/acp-test-agent"),
    )
    .expect("the broker's runtime");
    let (done, interrupted) = (
        openab_runtime::SessionIdentity::new(&installation, "agent", "test", "done").expect("identity"),
        openab_runtime::SessionIdentity::new(&installation, "agent", "test", "interrupted")
            .expect("identity"),
    );
    for identity in [&done, &interrupted] {
        runtime
            .create(identity, &openab_runtime::CreateOptions::new())
            .await
            .expect("create");
    }
    runtime
        .close(&done.id(), openab_runtime::CloseReason::Reset)
        .await
        .expect("close");
    let closed = record_of(&anchors, &format!("oab-s-{}", done.id())).await;
    let anchor = format!("oab-s-{}", interrupted.id());
    edit_record(&anchors, &anchor, |record| {
        record["phase"] = serde_json::json!("closing");
        let mut close = closed["close"].clone();
        close["storage_done"] = serde_json::json!(false);
        record["close"] = close;
    })
    .await;
    wait_until(
        "the in-cluster controller to finish the close",
        Duration::from_secs(60),
        || async { (record_of(&anchors, &anchor).await["phase"] == "closed").then_some(()) },
    )
    .await;

    // `oab-runtime ls` with the broker's identity lists both from their records.
    let config_file = overlay.path().join("openab.toml");
    std::fs::write(&config_file, &config).expect("write the broker's configuration");
    let listing = Command::new(env!("CARGO_BIN_EXE_oab-runtime"))
        .env("KUBECONFIG", broker_kubeconfig())
        .arg("--config")
        .arg(&config_file)
        .arg("ls")
        .output()
        .expect("oab-runtime ls");
    let listed = String::from_utf8_lossy(&listing.stdout);
    assert!(listing.status.success(), "ls: {listing:?}");
    assert!(
        listed
            .lines()
            .next()
            .is_some_and(|header| header.contains("IDLE")),
        "{listed}"
    );
    for identity in [&done, &interrupted] {
        let line = listed
            .lines()
            .find(|line| line.starts_with(identity.id().as_str()))
            .unwrap_or_else(|| panic!("{} not listed:\n{listed}", identity.id()));
        let columns: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(columns.get(1), Some(&"closed"), "{line}");
        assert!(
            columns
                .get(4)
                .is_some_and(|idle| idle.ends_with('s') || idle.ends_with('m')),
            "an idle time: {line}"
        );
    }

    // Its metrics say so, served on its own port as to a scraper (this host reaches Pod IPs).
    let leader_ip = pods
        .get(&first)
        .await
        .expect("the leader's Pod")
        .status
        .and_then(|status| status.pod_ip)
        .expect("a Pod IP");
    let metrics = wait_until(
        "the leader's metrics to count the finished close",
        Duration::from_secs(60),
        || async {
            let text = http_get(&leader_ip, 9090, "/metrics").await?;
            text.contains("openab_reconcile_actions_total{backend=\"kubernetes\",action=\"finish_close\"}")
                .then_some(text)
        },
    )
    .await;
    for series in [
        "openab_reconcile_pass_seconds_count{backend=\"kubernetes\"}",
        "openab_api_requests_total{backend=\"kubernetes\",verb=\"list\"}",
        "openab_api_requests_total{backend=\"kubernetes\",verb=\"update\"}",
    ] {
        let value = metrics
            .lines()
            .find_map(|line| line.strip_prefix(series)?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {series} in the leader's metrics:\n{metrics}"));
        assert!(value >= 1.0, "{series} is {value}");
    }
    // Sessions by phase, as of its last full pass (which may precede the close): every phase.
    for phase in ["created", "running", "suspended", "closing", "closed"] {
        let series = format!("openab_sessions{{backend=\"kubernetes\",phase=\"{phase}\"}}");
        assert!(metrics.contains(&series), "no {series}:\n{metrics}");
    }
    let ready = http_get(&leader_ip, 9090, "/readyz").await;
    assert_eq!(ready.as_deref(), Some("ready\n"), "the leader's /readyz");

    // Its Pod goes (gracefully: the Lease is given up), and the other replica takes over.
    kubectl(&["-n", "openab", "delete", "pod", &first, "--wait=false"]);
    let (second, second_transitions) =
        wait_until("the other replica to lead", Duration::from_secs(90), || async {
            let (holder, transitions) = leader().await?;
            let names = controller_pods().await;
            let pod = names
                .into_iter()
                .find(|name| name != &first && holder.starts_with(name.as_str()))?;
            Some((pod, transitions))
        })
        .await;
    eprintln!("led by {first} (transitions {first_transitions}), then by {second} ({second_transitions})");
    assert!(
        second_transitions > first_transitions,
        "a handover is a new term: {first_transitions} then {second_transitions} ({first} then {second})"
    );

    kubectl(&["delete", "-k", &overlay_path, "--wait=true"]);
    let _ = leases.delete(&leader_lease, &DeleteParams::default()).await;
    for identity in [&done, &interrupted] {
        let _ = runtime
            .close(&identity.id(), openab_runtime::CloseReason::Reset)
            .await;
    }
    let _ = profiles.delete(&installation, &DeleteParams::default()).await;
}
