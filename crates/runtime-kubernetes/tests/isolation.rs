//! The RFC's isolation acceptance test between two real worker Pods: sentinel files in A's
//! workspace and HOME and a local-only git ref, probed from a shell inside B's container (and the
//! reverse), and writes to the shared read-only skills refused. Over each reach, in the real
//! agent image, and with volumes mounted whole.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test isolation -- --ignored`.

mod common;

use common::{runtime, AdminObject, WORKER_PROFILE};
use isolation_suite::{SharedInput, SuiteOptions};
use session_runtime::config::Reach;
use session_runtime::{IsolationLevel, SessionRuntime};
use test_cluster::TestCluster;

const SKILL: &str = "# A shared skill\nRead-only for every session.\n";

/// The suite between two workers of `image` whose profile adds the top-level `keys`.
async fn isolation(reach: Reach, installation: &str, image: &str, keys: &str) {
    isolation_with_storage(reach, installation, image, keys, None).await;
}

/// [`isolation`], with the profile's `[storage]` table's keys replaced by `storage`.
async fn isolation_with_storage(
    reach: Reach,
    installation: &str,
    image: &str,
    keys: &str,
    storage: Option<&str>,
) {
    let cluster = TestCluster::connect().await;
    let skills = AdminObject::install(
        &cluster,
        &format!("{installation}-skills"),
        &[("SKILL.md", SKILL)],
    )
    .await;
    let profile_text = format!(
        "{keys}{}\n[[skills]]\nname = \"demo\"\nmount_path = \"/skills\"\nconfig_map = \"{}\"\nversion = \"1\"\n",
        match storage {
            Some(storage) => format!(
                "{}[storage]\n{storage}",
                WORKER_PROFILE.split("[storage]").next().unwrap_or_default()
            ),
            None => WORKER_PROFILE.to_owned(),
        }
        .replace("openab.dev/worker:test", image),
        skills.name()
    );
    let profile = AdminObject::profile(&cluster, installation, &profile_text).await;
    let runtime = runtime(&cluster, &profile, reach, installation);
    assert_eq!(runtime.capabilities().isolation, IsolationLevel::Pod);
    let options = SuiteOptions::new(installation).with_shared_input(SharedInput::new("/skills/SKILL.md"));
    let report = isolation_suite::run(runtime, &options)
        .await
        .expect("the suite runs");
    println!("{report}");
    assert!(report.skipped.is_empty(), "every step runs: {:?}", report.skipped);
    let problems: Vec<_> = report.problems().collect();
    assert!(
        report.passed(),
        "isolation must hold between worker Pods: {problems:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_worker_pods_cannot_touch_each_other_over_exec() {
    isolation(Reach::Exec, "isolation-exec", "openab.dev/worker:test", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_worker_pods_cannot_touch_each_other_over_the_pod_ip() {
    isolation(Reach::PodIp, "isolation-pod-ip", "openab.dev/worker:test", "").await;
}

/// The same between two workers of deploy/worker/Dockerfile's image (Debian, Node, git, Python
/// and codex-acp at their places), with the ACP test agent added as the shell the suite drives
/// (`openab.dev/agent-worker-probe:test`, e2e/images/build): what a real agent's container holds
/// and permits, probed from inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_workers_of_the_real_agent_image_cannot_touch_each_other() {
    isolation(
        Reach::PodIp,
        "isolation-agent-image",
        "openab.dev/agent-worker-probe:test",
        "",
    )
    .await;
}

/// The same between two workers whose volumes of their own are mounted whole
/// (`volume_path`): each sees its whole volume, and nothing of the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_workers_with_their_volumes_mounted_whole_cannot_touch_each_other() {
    isolation(
        Reach::PodIp,
        "isolation-whole-volume",
        "openab.dev/worker:test",
        "volume_path = \"/session\"\n",
    )
    .await;
}

/// The same between two workers whose session directories live in their containers' own layers
/// (`container_layer = true`): no volume at all, a root filesystem each may write where the
/// image lets it, and nothing of the other's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_workers_in_their_container_layers_cannot_touch_each_other() {
    isolation_with_storage(
        Reach::PodIp,
        "isolation-container-layer",
        "openab.dev/worker:test",
        "volume_path = \"/tmp/session\"\n",
        Some("kind = \"ephemeral\"\ncontainer_layer = true\n"),
    )
    .await;
}

/// The same between two workers under gVisor (RuntimeClass `gvisor`). runsc reports no
/// recursive read-only mounts to the kubelet, so the skills are read-only at their top only
/// (`if-possible`; the default, `recursive`, refuses to start such a worker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn two_workers_under_gvisor_cannot_touch_each_other() {
    isolation(
        Reach::PodIp,
        "isolation-gvisor",
        "openab.dev/worker:test",
        "runtime_class = \"gvisor\"\nskills_read_only = \"if-possible\"\n",
    )
    .await;
}
