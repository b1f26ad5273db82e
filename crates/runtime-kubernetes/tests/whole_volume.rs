//! `volume_path` on the real node: a worker whose volume of its own is mounted whole starts
//! without an init container, its relay makes the workspace and HOME owned by the worker user
//! (mode 0700), git accepts the workspace, and a resumed worker finds what the last one wrote (a
//! claim) or a fresh volume (ephemeral storage). The same for ephemeral storage in the
//! container's own layer (`container_layer = true`), whose worker has no volume at all. The
//! isolation acceptance suite with this layout is in `isolation.rs`.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test whole_volume -- --ignored`.

mod common;

use common::{runtime, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, SessionIdentity, SessionRuntime, SuspendReason};
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::Api;
use test_cluster::{unique_name, TestCluster};

/// The worker's Pod (`oab-w-<id>`), as the API server has it.
async fn worker_pod(cluster: &TestCluster, id: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    pods.get(&format!("oab-w-{id}")).await.expect("the worker's Pod")
}

/// Whether `line` (`stat -c '%u:%g %a'`) is a directory the worker user owns that no one else
/// may enter (an emptyDir's setgid bit, from the Pod's fsGroup, may be inherited).
fn private_to_the_worker(line: &str) -> bool {
    line.split_once(' ').is_some_and(|(owner, mode)| {
        owner == "65532:65532" && u32::from_str_radix(mode, 8).is_ok_and(|mode| mode & 0o777 == 0o700)
    })
}

fn init_containers(pod: &Pod) -> usize {
    pod.spec
        .as_ref()
        .and_then(|spec| spec.init_containers.as_ref())
        .map_or(0, Vec::len)
}

/// One session through create, attach, suspend and resume under `storage` (a profile's
/// `[storage]` table) with `volume_path`; `kept` says whether the resumed worker finds the first
/// one's files.
async fn whole_volume(name: &str, storage: &str, volume_path: &str, kept: bool) {
    let installation = unique_name(name);
    let cluster = TestCluster::connect().await;
    let base = WORKER_PROFILE
        .split("[storage]")
        .next()
        .expect("the profile's keys");
    let document = format!("volume_path = \"{volume_path}\"\n{base}{storage}");
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "test", "whole").expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &Default::default())
        .await
        .expect("create");

    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
    client.initialize().await.expect("initialize");
    let pod = worker_pod(&cluster, id.as_str()).await;
    assert_eq!(
        init_containers(&pod),
        0,
        "a new session's worker starts without an init container"
    );
    let volumes = pod.spec.and_then(|spec| spec.volumes).unwrap_or_default();
    if storage.contains("container_layer = true") {
        assert!(
            volumes.is_empty(),
            "no volume in the container layer: {volumes:?}"
        );
    } else {
        assert!(
            volumes.iter().any(|volume| volume.name == "session"),
            "{volumes:?}"
        );
    }
    let made = client
        .exec("pwd; echo \"$HOME\"; stat -c '%u:%g %a' . \"$HOME\"")
        .await
        .expect("exec");
    let lines: Vec<&str> = made.stdout.lines().collect();
    assert_eq!(
        lines[..2],
        [format!("{volume_path}/workspace"), format!("{volume_path}/home")],
        "{made:?}"
    );
    assert!(
        lines.len() == 4 && lines[2..].iter().all(|line| private_to_the_worker(line)),
        "{made:?}"
    );
    // git refuses a repository its user does not own ("dubious ownership"): this one it owns.
    let git = client
        .exec(
            "git init -q . && echo kept > notes.txt && git add notes.txt \
             && git -c user.email=w@w -c user.name=w commit -q -m first && git status --porcelain \
             && echo home > \"$HOME/home.txt\" && echo done",
        )
        .await
        .expect("exec");
    assert!(git.success() && git.stdout.ends_with("done\n"), "{git:?}");
    // The control: a directory root owns (the worker's /tmp: an emptyDir the kubelet made, or
    // the image's), which git does refuse.
    let control = client
        .exec(
            "stat -c %u /tmp; git init -q /tmp 2>/dev/null && git -C /tmp status 2>&1 \
             | grep -c 'dubious ownership'; rm -rf /tmp/.git",
        )
        .await
        .expect("exec");
    assert_eq!(control.stdout, "0\n1\n", "{control:?}");
    drop(client);
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");

    let client = AcpClient::new(runtime.attach(&id).await.expect("resume"));
    client.initialize().await.expect("initialize");
    assert_eq!(init_containers(&worker_pod(&cluster, id.as_str()).await), 0);
    let found = client
        .exec("git log -1 --format=%s 2>/dev/null || echo none; cat \"$HOME/home.txt\" 2>/dev/null || echo none; stat -c '%u:%g %a' . \"$HOME\"")
        .await
        .expect("exec");
    let lines: Vec<&str> = found.stdout.lines().collect();
    assert!(
        lines.len() == 4 && lines[2..].iter().all(|line| private_to_the_worker(line)),
        "{found:?}"
    );
    if kept {
        assert_eq!(lines[..2], ["first", "home"], "{found:?}");
    } else {
        assert_eq!(
            lines[..2],
            ["none", "none"],
            "an ephemeral volume starts empty: {found:?}"
        );
    }
    drop(client);
    runtime.close(&id, CloseReason::Ended).await.expect("close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_claim_mounted_whole_needs_no_init_container_and_keeps_its_directories() {
    whole_volume(
        "whole-claim",
        "[storage]\nkind = \"per-session\"\nclass = \"openab-test-local\"\nsize = \"1Gi\"\n",
        "/session",
        true,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn an_ephemeral_volume_mounted_whole_needs_no_init_container() {
    whole_volume(
        "whole-ephemeral",
        "[storage]\nkind = \"ephemeral\"\n",
        "/session",
        false,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn ephemeral_storage_in_the_container_layer_needs_no_volume() {
    whole_volume(
        "layer-ephemeral",
        "[storage]\nkind = \"ephemeral\"\ncontainer_layer = true\n",
        "/tmp/session",
        false,
    )
    .await;
}
