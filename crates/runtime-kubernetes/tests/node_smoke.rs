//! Proof that the test cluster's real node runs real worker Pods: the worker image starts under
//! Pod Security "restricted", as uid 65532 with no capabilities and no service-account token, on a
//! volume that outlives the Pod, reachable from the host on its Pod IP and reaching nothing off the
//! machine; a missing image and an exhausted memory limit say so in the Pod's status.
//!
//! Every Pod here is made in the sessions namespace by the administrator's identity: these are the
//! node's properties, whoever asks. The broker's identity may make only the runtime's own worker
//! Pods, as the admission policy admits them (tests/admission.rs); the runtime's tests make those.
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test node_smoke -- --ignored`.

use std::time::Duration;

use test_cluster::k8s_openapi::api::core::v1::{
    ContainerStateTerminated, ContainerStateWaiting, EnvVar, PersistentVolumeClaim,
    PersistentVolumeClaimSpec, PersistentVolumeClaimVolumeSource, Pod, ResourceRequirements, Volume,
    VolumeMount, VolumeResourceRequirements,
};
use test_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use test_cluster::kube::api::{DeleteParams, ObjectMeta, PostParams};
use test_cluster::kube::Api;
use test_cluster::{api_status, exec, restricted_pod, unique_name, wait_until, TestCluster, WORKER_UID};

const WORKER_IMAGE: &str = "openab.dev/worker:test";
/// Starting a Pod on this 2-core machine takes seconds; this only bounds a hung start.
const START: Duration = Duration::from_secs(120);

fn sleeper(name: &str) -> Pod {
    restricted_pod(name, WORKER_IMAGE, &["/bin/sleep", "3600"])
}

/// Creates the Pod and waits until it is Ready; panics with its status if it fails first.
async fn start(pods: &Api<Pod>, pod: &Pod) -> Pod {
    let name = pod.metadata.name.clone().expect("a named Pod");
    pods.create(&PostParams::default(), pod)
        .await
        .expect("create the Pod");
    wait_until(&format!("Pod {name} to be Ready"), START, || async {
        let pod = pods.get(&name).await.ok()?;
        let status = pod.status.as_ref()?;
        if status.phase.as_deref() == Some("Failed") {
            panic!("Pod {name} failed: {status:?}");
        }
        let ready = status
            .conditions
            .as_ref()?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        ready.then_some(pod)
    })
    .await
}

async fn remove(pods: &Api<Pod>, name: &str) {
    let _ = pods.delete(name, &DeleteParams::default().grace_period(0)).await;
    wait_until(&format!("Pod {name} to be gone"), START, || async {
        (api_status(&pods.get(name).await) == Some(404)).then_some(())
    })
    .await;
}

/// The first container's state once it is waiting for `reason`-like causes or has terminated.
async fn container_state(
    pods: &Api<Pod>,
    name: &str,
) -> (Option<ContainerStateWaiting>, Option<ContainerStateTerminated>) {
    wait_until(
        &format!("Pod {name}'s container to wait or end"),
        START,
        || async {
            let pod = pods.get(name).await.ok()?;
            let statuses = pod.status?.container_statuses?;
            let state = statuses.first()?.state.clone()?;
            let waiting = state
                .waiting
                .filter(|w| w.reason.as_deref() != Some("ContainerCreating"));
            (waiting.is_some() || state.terminated.is_some()).then_some((waiting, state.terminated))
        },
    )
    .await
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_restricted_worker_pod_runs_as_the_worker_uid_with_nothing_extra() {
    let cluster = TestCluster::connect().await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = unique_name("worker");
    let running = start(&pods, &sleeper(&name)).await;
    let node = running
        .spec
        .as_ref()
        .and_then(|spec| spec.node_name.clone())
        .unwrap_or_default();
    assert!(!node.starts_with("kwok-"), "a real node runs it, not {node}");

    let id = exec(&pods, &name, &["id"]).await;
    assert!(id.success, "{id:?}");
    assert!(
        id.stdout
            .starts_with(&format!("uid={WORKER_UID}(agent) gid={WORKER_UID}")),
        "{id:?}"
    );

    let status = exec(&pods, &name, &["cat", "/proc/self/status"]).await;
    for set in ["CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        let line = status.stdout.lines().find(|line| line.starts_with(set));
        assert_eq!(
            line.map(|l| l.split_whitespace().last()),
            Some(Some("0000000000000000")),
            "{set}"
        );
    }
    assert!(status
        .stdout
        .lines()
        .any(|l| l.split_whitespace().eq(["NoNewPrivs:", "1"])));

    let token = exec(
        &pods,
        &name,
        &["ls", "/var/run/secrets/kubernetes.io/serviceaccount"],
    )
    .await;
    assert!(!token.success, "a service-account token is mounted: {token:?}");
    assert!(token.stderr.contains("No such file or directory"), "{token:?}");

    let write = exec(&pods, &name, &["touch", "/usr/local/bin/planted"]).await;
    assert!(
        !write.success && write.stderr.contains("Read-only file system"),
        "{write:?}"
    );
    remove(&pods, &name).await;
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_volume_is_writable_by_the_worker_and_outlives_its_pod() {
    let cluster = TestCluster::connect().await;
    let namespace = cluster.sessions_namespace();
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), namespace);
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.admin(), namespace);
    let claim = unique_name("data");
    claims
        .create(
            &PostParams::default(),
            &PersistentVolumeClaim {
                metadata: ObjectMeta {
                    name: Some(claim.clone()),
                    ..ObjectMeta::default()
                },
                spec: Some(PersistentVolumeClaimSpec {
                    access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
                    resources: Some(VolumeResourceRequirements {
                        requests: Some([("storage".to_owned(), Quantity("1Gi".to_owned()))].into()),
                        ..VolumeResourceRequirements::default()
                    }),
                    ..PersistentVolumeClaimSpec::default()
                }),
                ..PersistentVolumeClaim::default()
            },
        )
        .await
        .expect("the broker creates the claim");
    let with_volume = |name: &str| {
        let mut pod = sleeper(name);
        let spec = pod.spec.as_mut().expect("spec");
        spec.volumes = Some(vec![Volume {
            name: "data".to_owned(),
            persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                claim_name: claim.clone(),
                read_only: None,
            }),
            ..Volume::default()
        }]);
        spec.containers[0].volume_mounts = Some(vec![VolumeMount {
            name: "data".to_owned(),
            mount_path: "/workspace".to_owned(),
            ..VolumeMount::default()
        }]);
        pod
    };

    let first = unique_name("volume-a");
    start(&pods, &with_volume(&first)).await;
    let wrote = exec(
        &pods,
        &first,
        &[
            "sh",
            "-c",
            "echo kept > /workspace/sentinel && stat -c %u /workspace/sentinel",
        ],
    )
    .await;
    assert!(wrote.success, "{wrote:?}");
    assert_eq!(wrote.stdout.trim(), WORKER_UID.to_string());
    remove(&pods, &first).await;

    let second = unique_name("volume-b");
    start(&pods, &with_volume(&second)).await;
    let read = exec(&pods, &second, &["cat", "/workspace/sentinel"]).await;
    assert_eq!(read.stdout, "kept\n", "{read:?}");
    remove(&pods, &second).await;
    claims
        .delete(&claim, &DeleteParams::default())
        .await
        .expect("delete the claim");
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn the_host_reaches_the_relay_on_the_pod_ip_and_the_pod_reaches_nothing_off_the_bridge() {
    let cluster = TestCluster::connect().await;
    // A namespace without NetworkPolicies: what is proven here is the node's own bound, which
    // holds whatever a policy allows (tests/network_policy.rs proves the policies).
    let namespace = cluster.fresh_namespace("smoke-bridge").await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), namespace.name());
    let name = unique_name("relay");
    // The image's own entrypoint: oab-relay serving on 0.0.0.0:7780, the test agent behind it.
    let mut relay = restricted_pod(&name, WORKER_IMAGE, &[]);
    let identity =
        session_runtime::SessionIdentity::new("smoke", "test-agent", "test", &name).expect("an identity");
    let env = [
        ("OAB_RELAY_SESSION", identity.id().to_string()),
        ("OAB_RELAY_GENERATION", "1".to_owned()),
        // Nobody says hello here: any well-formed hash will do.
        ("OAB_RELAY_TOKEN_SHA256", "ab".repeat(32)),
    ];
    relay.spec.as_mut().expect("spec").containers[0].env = Some(
        env.into_iter()
            .map(|(name, value)| EnvVar {
                name: name.to_owned(),
                value: Some(value),
                ..EnvVar::default()
            })
            .collect(),
    );
    let running = start(&pods, &relay).await;
    let pod_ip = running.status.and_then(|status| status.pod_ip).expect("a Pod IP");
    let address: std::net::IpAddr = pod_ip.parse().expect("an IP address");
    assert!(!address.is_loopback(), "{address}");

    let connected = wait_until("the relay's port to accept", START, || async {
        tokio::net::TcpStream::connect((address, 7780)).await.ok()
    })
    .await;
    drop(connected);

    // A probe that can succeed: the Pod reaches its own relay through its own interface.
    let own = format!("nc -w 3 {address} 7780 </dev/null");
    let probe = exec(&pods, &name, &["sh", "-c", &own]).await;
    assert!(
        probe.success,
        "the probe cannot even reach the Pod itself: {probe:?}"
    );

    // This machine's gateway (off the machine), and a port this test opens on every host address,
    // dialled through the host's side of the bridge (first address of the Pod's subnet): both
    // unreachable or silent within the bound, never answered.
    let listener = std::net::TcpListener::bind(("0.0.0.0", 0)).expect("a host port");
    let host_port = listener.local_addr().expect("its address").port();
    let std::net::IpAddr::V4(v4) = address else {
        panic!("an IPv4 Pod address, not {address}")
    };
    let [a, b, c, _] = v4.octets();
    let host_side = format!("{a}.{b}.{c}.1");
    for (target, port) in [("192.0.2.1".to_owned(), 80), (host_side, host_port)] {
        let dial = format!("nc -w 3 {target} {port} </dev/null");
        let probe = exec(&pods, &name, &["sh", "-c", &dial]).await;
        assert!(!probe.success, "the Pod reached {target}:{port}: {probe:?}");
        assert!(
            probe.stderr.contains("timed out") || probe.stderr.contains("unreachable"),
            "{target}:{port}: {probe:?}"
        );
    }
    drop(listener);
    let resolver = exec(&pods, &name, &["nslookup", "kubernetes.default"]).await;
    assert!(!resolver.success, "the Pod resolved a name: {resolver:?}");
    remove(&pods, &name).await;
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_missing_image_is_reported_as_never_pulled() {
    let cluster = TestCluster::connect().await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = unique_name("absent");
    let pod = restricted_pod(&name, "openab.dev/absent:test", &[]);
    pods.create(&PostParams::default(), &pod).await.expect("create");
    let (waiting, terminated) = container_state(&pods, &name).await;
    assert!(terminated.is_none(), "{terminated:?}");
    let waiting = waiting.expect("waiting");
    assert_eq!(
        waiting.reason.as_deref(),
        Some("ErrImageNeverPull"),
        "{waiting:?}"
    );
    remove(&pods, &name).await;
}

#[tokio::test]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_pod_over_its_memory_limit_is_oom_killed_and_says_so() {
    let cluster = TestCluster::connect().await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = unique_name("hungry");
    // dd allocates its block size at once: 256 MiB against a 32 MiB limit, in the container's
    // first instants, where containerd 1.6 reported the kill as a plain "Error"
    // (containerd/containerd#8180); the node's containerd 2 watches the cgroup from the start.
    let mut pod = restricted_pod(
        &name,
        "openab.dev/worker:test",
        &["dd", "if=/dev/zero", "of=/dev/null", "bs=256M", "count=4"],
    );
    pod.spec.as_mut().expect("spec").containers[0].resources = Some(ResourceRequirements {
        limits: Some([("memory".to_owned(), Quantity("32Mi".to_owned()))].into()),
        ..ResourceRequirements::default()
    });
    pods.create(&PostParams::default(), &pod).await.expect("create");
    let (_, terminated) = container_state(&pods, &name).await;
    let terminated = terminated.expect("the container ended");
    assert_eq!(terminated.reason.as_deref(), Some("OOMKilled"), "{terminated:?}");
    assert_eq!(terminated.exit_code, 137, "{terminated:?}");
    remove(&pods, &name).await;
}
