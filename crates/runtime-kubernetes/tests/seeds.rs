//! Seeding at create, on the real node: the profile's HOME template and a git clone (of a branch
//! served by a Pod on the bridge) reach the session's volume through a seed Job, which is gone
//! afterwards; a clone that fails says why in git's words; an ephemeral volume cannot be seeded.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test seeds -- --ignored`.

mod common;

use std::time::Duration;

use common::{runtime, AdminConfigMap, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime, WorkspaceSeed};
use test_cluster::k8s_openapi::api::batch::v1::Job;
use test_cluster::k8s_openapi::api::core::v1::{
    EmptyDirVolumeSource, EnvVar, Pod, Probe, TCPSocketAction, Volume, VolumeMount,
};
use test_cluster::k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use test_cluster::kube::api::{DeleteParams, PostParams};
use test_cluster::kube::Api;
use test_cluster::{restricted_pod, unique_name, wait_until, TestCluster};

/// A git daemon on the bridge serving `/tmp/repo` with a `topic` branch whose last commit says
/// `token`.
async fn git_server(cluster: &TestCluster, name: &str, token: &str) -> (Api<Pod>, String) {
    let script = format!(
        "set -e; cd /tmp; git init -q repo; cd repo; \
         git -c user.email=t@t -c user.name=t commit -q --allow-empty -m base; \
         git checkout -q -b topic; \
         git -c user.email=t@t -c user.name=t commit -q --allow-empty -m {token}; \
         git checkout -q -; \
         exec git daemon --export-all --base-path=/tmp --listen=0.0.0.0 --port=9418 --reuseaddr /tmp"
    );
    let mut pod = restricted_pod(name, "openab.dev/worker:test", &["/bin/sh", "-c", &script]);
    let spec = pod.spec.as_mut().expect("spec");
    spec.volumes = Some(vec![Volume {
        name: "tmp".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }]);
    let container = &mut spec.containers[0];
    container.volume_mounts = Some(vec![VolumeMount {
        name: "tmp".into(),
        mount_path: "/tmp".into(),
        ..VolumeMount::default()
    }]);
    container.env = Some(vec![EnvVar {
        name: "HOME".into(),
        value: Some("/tmp".into()),
        ..EnvVar::default()
    }]);
    container.readiness_probe = Some(Probe {
        tcp_socket: Some(TCPSocketAction {
            port: IntOrString::Int(9418),
            host: None,
        }),
        period_seconds: Some(1),
        ..Probe::default()
    });
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("the git server");
    let ip = wait_until("the git server to be ready", Duration::from_secs(90), || async {
        let pod = pods.get(name).await.ok()?;
        let status = pod.status?;
        let ready = status
            .conditions?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        ready.then_some(status.pod_ip?)
    })
    .await;
    (pods, ip)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_home_template_and_a_clone_of_a_branch_seed_the_session_and_the_job_goes() {
    let installation = unique_name("seeds");
    let cluster = TestCluster::connect().await;
    let home = AdminConfigMap::install(
        &cluster,
        &format!("{installation}-home"),
        &[
            (".gitconfig", "[user]\n\tname = seeded-user\n"),
            ("notes.txt", "from the template\n"),
        ],
    )
    .await;
    let document = format!(
        "{WORKER_PROFILE}\n[home_template]\nconfig_map = \"{}\"\n",
        home.name()
    );
    let profile = AdminConfigMap::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let token = unique_name("commit");
    let server = format!("{installation}-git");
    let (pods, ip) = git_server(&cluster, &server, &token).await;

    let identity = SessionIdentity::new(&installation, "agent", "test", "seeded").expect("identity");
    let id = identity.id();
    let seed = WorkspaceSeed::GitClone {
        url: format!("git://{ip}/repo"),
        reference: Some("topic".into()),
    };
    runtime
        .create(&identity, &CreateOptions::new().with_workspace_seed(seed))
        .await
        .expect("a seeded create");
    let jobs: Api<Job> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let job = jobs
        .get_opt(&format!("oab-p-{id}-1"))
        .await
        .expect("read the Job");
    assert!(
        job.is_none_or(|job| job.metadata.deletion_timestamp.is_some()),
        "the seed Job is removed once it ended"
    );

    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
    client.initialize().await.expect("initialize");
    let workdir = client.working_dir().to_owned();
    let log = client
        .exec(&format!("git -C {workdir} log -1 --format=%s"))
        .await
        .expect("exec");
    assert!(log.success(), "{log:?}");
    assert_eq!(
        log.stdout.trim(),
        token,
        "the workspace holds the requested branch"
    );
    let notes = client.exec("cat \"$HOME/notes.txt\"").await.expect("exec");
    assert_eq!(notes.stdout, "from the template\n", "{notes:?}");
    let name = client.exec("git config --global user.name").await.expect("exec");
    assert_eq!(
        name.stdout.trim(),
        "seeded-user",
        "HOME's dotfiles come from the template: {name:?}"
    );
    drop(client);
    runtime.close(&id, CloseReason::Reset).await.expect("close");

    // A clone that fails says so in git's words, and nothing of the Job is left.
    let broken = SessionIdentity::new(&installation, "agent", "test", "broken").expect("identity");
    let seed = WorkspaceSeed::GitClone {
        url: format!("git://{ip}/no-such-repository"),
        reference: None,
    };
    match runtime
        .create(&broken, &CreateOptions::new().with_workspace_seed(seed))
        .await
    {
        Err(Error::Backend {
            retryable: false,
            message,
            ..
        }) => assert!(
            message.contains("seeding the volume failed") && message.contains("no-such-repository"),
            "{message}"
        ),
        other => panic!("a failed clone must fail the create: {other:?}"),
    }
    let job = jobs
        .get_opt(&format!("oab-p-{}-1", broken.id()))
        .await
        .expect("read the Job");
    assert!(job.is_none_or(|job| job.metadata.deletion_timestamp.is_some()));
    runtime
        .close(&broken.id(), CloseReason::Reset)
        .await
        .expect("close");
    let _ = pods
        .delete(
            &server,
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            },
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster: scripts/cluster up (OPENAB_CLUSTER_NODE=0 is enough), then cargo test -- --ignored"]
async fn an_ephemeral_volume_cannot_be_seeded() {
    let installation = unique_name("ephemeral-seed");
    let cluster = TestCluster::connect().await;
    let document = WORKER_PROFILE.replace(
        "[storage]\nkind = \"per-session\"\nclass = \"openab-test-local\"\nsize = \"1Gi\"\n",
        "[storage]\nkind = \"ephemeral\"\n",
    );
    assert_ne!(
        document, WORKER_PROFILE,
        "the profile's storage table changed shape"
    );
    let profile = AdminConfigMap::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let identity = SessionIdentity::new(&installation, "agent", "test", "ephemeral").expect("identity");
    let seed = WorkspaceSeed::GitClone {
        url: "git://10.244.0.1/repo".into(),
        reference: None,
    };
    match runtime
        .create(&identity, &CreateOptions::new().with_workspace_seed(seed))
        .await
    {
        Err(Error::Unsupported { operation, .. }) => assert!(operation.contains("ephemeral"), "{operation}"),
        other => panic!("{other:?}"),
    }
    assert!(
        matches!(runtime.status(&identity.id()).await, Err(Error::NotFound { .. })),
        "nothing was made"
    );
}
