//! Seeding at create, on the real node: the profile's HOME template and a git clone (of a branch
//! served by a Pod on the bridge) reach the session's volume through a seed Job, which is gone
//! afterwards; a clone that fails says why in git's words; an ephemeral volume cannot be seeded;
//! on a volume every session borrows, no clone URL reaches another session's repository.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test seeds -- --ignored`.

mod common;

use std::time::Duration;

use common::{runtime, AdminObject, DeleteOnDrop, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, Error, SessionIdentity, SessionRuntime, WorkspaceSeed};
use test_cluster::k8s_openapi::api::batch::v1::Job;
use test_cluster::k8s_openapi::api::core::v1::{
    EmptyDirVolumeSource, EnvVar, PersistentVolumeClaim, PersistentVolumeClaimSpec, Pod, Probe,
    TCPSocketAction, Volume, VolumeMount, VolumeResourceRequirements,
};
use test_cluster::k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use test_cluster::k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use test_cluster::kube::api::{ObjectMeta, PostParams};
use test_cluster::kube::Api;
use test_cluster::{restricted_pod, unique_name, wait_until, TestCluster, TestNamespace};

/// A git daemon on the bridge serving `/tmp/repo` with a `topic` branch whose last commit says
/// `token`, in a namespace of its own (a server outside the sessions namespace, whose
/// default-deny policy would refuse its clients); the namespace goes when this is dropped.
struct GitServer {
    ip: String,
    _namespace: TestNamespace,
}

async fn git_server(cluster: &TestCluster, name: &str, token: &str) -> GitServer {
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
    let namespace = cluster.fresh_namespace("git-server").await;
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), namespace.name());
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
    GitServer {
        ip,
        _namespace: namespace,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_home_template_and_a_clone_of_a_branch_seed_the_session_and_the_job_goes() {
    let installation = unique_name("seeds");
    let cluster = TestCluster::connect().await;
    let home = AdminObject::install(
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
    let token = unique_name("commit");
    let server = format!("{installation}-git");
    let git = git_server(&cluster, &server, &token).await;
    let ip = &git.ip;
    // A server at a private address: the profile lists it for its seeds' egress, as an
    // operator with an in-cluster git server does.
    let document = format!("seed_hosts = [\"git://{ip}\"]\negress = [\"{ip}/32\"]\n{document}");
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);

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
    let identity = SessionIdentity::new(&installation, "agent", "test", "ephemeral").expect("identity");
    let seed = WorkspaceSeed::GitClone {
        url: "git://10.244.0.1/repo".into(),
        reference: None,
    };
    let document = format!("seed_hosts = [\"git://10.244.0.1\"]\n{document}");
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
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

/// Sets (or, with `None`, clears) the loan on a session's record as a copying broker would,
/// through the admin's client: the refusals while a copy runs, made deterministic.
async fn set_loan(
    cluster: &TestCluster,
    source: &session_runtime::SessionId,
    loan: Option<serde_json::Value>,
) {
    let anchors: Api<runtime_kubernetes::OabSession> =
        Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let name = format!("oab-s-{source}");
    let mut anchor = anchors.get(&name).await.expect("the source's anchor");
    let record = &mut anchor.status.as_mut().expect("a recorded session").record;
    match loan {
        Some(loan) => record["lent_to"] = loan,
        None => {
            record.as_object_mut().expect("an object").remove("lent_to");
        }
    }
    anchors
        .replace_status(&name, &PostParams::default(), &anchor)
        .await
        .expect("write the loan");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn a_copy_of_an_idle_session_seeds_the_new_one_and_a_source_in_use_is_refused() {
    let installation = unique_name("copy-seed");
    let cluster = TestCluster::connect().await;
    let home = AdminObject::install(
        &cluster,
        &format!("{installation}-home"),
        &[(".agentrc", "from the template\n")],
    )
    .await;
    let document = format!(
        "{WORKER_PROFILE}\n[home_template]\nconfig_map = \"{}\"\n",
        home.name()
    );
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let thread = |name: &str| SessionIdentity::new(&installation, "agent", "test", name).expect("identity");
    let (source, fork, other) = (thread("source"), thread("fork"), thread("other"));
    let copy_of = |identity: &SessionIdentity| {
        CreateOptions::new().with_workspace_seed(WorkspaceSeed::CopyOf {
            source: identity.id(),
        })
    };

    runtime
        .create(&source, &CreateOptions::new())
        .await
        .expect("create the source");
    let client = AcpClient::new(runtime.attach(&source.id()).await.expect("attach the source"));
    client.initialize().await.expect("initialize");
    // A link where the template's file goes: the copy must replace it, never write through it.
    let wrote = client
        .exec(
            "mkdir -p src && echo 'fn main() {}' > src/main.rs && echo 'from the source' > notes.txt \
             && ln -s notes.txt latest && echo 'source state' > \"$HOME/.agent-state\" \
             && rm -f \"$HOME/.agentrc\" && ln -s \"$PWD/notes.txt\" \"$HOME/.agentrc\" && echo wrote",
        )
        .await
        .expect("exec in the source");
    assert!(wrote.stdout.contains("wrote"), "{wrote:?}");

    // Attached: refused at once, before anything of the fork exists.
    match runtime.create(&fork, &copy_of(&source)).await {
        Err(Error::StorageInUse { id, .. }) => assert_eq!(id, source.id()),
        other => panic!("a copy of an attached session must be refused: {other:?}"),
    }
    assert!(
        matches!(runtime.status(&fork.id()).await, Err(Error::NotFound { .. })),
        "a refused copy makes nothing"
    );
    drop(client);
    runtime
        .suspend(&source.id(), session_runtime::SuspendReason::Idle)
        .await
        .expect("suspend the source");

    // Lent to another copy: its attach and a second copy are refused until the loan ends.
    let until = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
        + 600;
    set_loan(
        &cluster,
        &source.id(),
        Some(serde_json::json!({ "to": other.id().as_str(), "until": until })),
    )
    .await;
    match runtime.attach(&source.id()).await {
        Err(Error::StorageInUse { holder, .. }) => assert!(holder.contains(other.id().as_str()), "{holder}"),
        other => panic!("attach of a lent session must be refused: {other:?}"),
    }
    match runtime.create(&fork, &copy_of(&source)).await {
        Err(Error::StorageInUse { .. }) => {}
        other => panic!("a copy of a session lent to another copy must be refused: {other:?}"),
    }
    set_loan(&cluster, &source.id(), None).await;

    // Idle: the fork gets the workspace and HOME; the template has the last word on its file.
    runtime
        .create(&fork, &copy_of(&source))
        .await
        .expect("create the fork");
    let jobs: Api<Job> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let job = jobs
        .get_opt(&format!("oab-p-{}-1", fork.id()))
        .await
        .expect("read the Job");
    assert!(
        job.is_none_or(|job| job.metadata.deletion_timestamp.is_some()),
        "the copy's Job is removed once it ended"
    );
    let client = AcpClient::new(runtime.attach(&fork.id()).await.expect("attach the fork"));
    client.initialize().await.expect("initialize");
    let probe = client
        .exec(
            "cat notes.txt src/main.rs \"$HOME/.agent-state\"; echo \"link $(readlink latest)\"; \
             test -L \"$HOME/.agentrc\" || cat \"$HOME/.agentrc\"; echo 'changed in the fork' > notes.txt",
        )
        .await
        .expect("exec in the fork");
    for expected in [
        "from the source",
        "fn main() {}",
        "source state",
        "link notes.txt",
        "from the template",
    ] {
        assert!(
            probe.stdout.contains(expected),
            "{expected:?} in the fork: {probe:?}"
        );
    }
    drop(client);

    // The source is as it was, and attachable again now that the copy is done.
    let client = AcpClient::new(
        runtime
            .attach(&source.id())
            .await
            .expect("attach the source again"),
    );
    client.initialize().await.expect("initialize");
    let probe = client.exec("cat notes.txt").await.expect("exec in the source");
    assert_eq!(probe.stdout.trim(), "from the source", "{probe:?}");
    drop(client);

    match runtime.create(&other, &copy_of(&thread("never-created"))).await {
        Err(Error::NotFound { .. }) => {}
        unexpected => panic!("a copy of an unknown session must be NotFound: {unexpected:?}"),
    }
    for identity in [&source, &fork] {
        runtime
            .close(&identity.id(), CloseReason::Reset)
            .await
            .expect("close");
    }
}

/// A claim every session of a profile borrows, bound by the cluster's provisioner; removed when
/// dropped.
struct SharedClaim {
    name: String,
    _delete: DeleteOnDrop,
}

impl SharedClaim {
    async fn create(cluster: &TestCluster, name: &str) -> SharedClaim {
        let claims: Api<PersistentVolumeClaim> =
            Api::namespaced(cluster.admin(), cluster.sessions_namespace());
        let claim = PersistentVolumeClaim {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            spec: Some(PersistentVolumeClaimSpec {
                access_modes: Some(vec!["ReadWriteOnce".into()]),
                storage_class_name: Some("openab-test-local".into()),
                resources: Some(VolumeResourceRequirements {
                    requests: Some([("storage".to_owned(), Quantity("1Gi".into()))].into()),
                    ..VolumeResourceRequirements::default()
                }),
                ..PersistentVolumeClaimSpec::default()
            }),
            status: None,
        };
        claims
            .create(&PostParams::default(), &claim)
            .await
            .expect("the shared claim");
        SharedClaim {
            name: name.to_owned(),
            _delete: DeleteOnDrop::new::<PersistentVolumeClaim>(cluster, cluster.sessions_namespace(), name),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn on_a_borrowed_volume_no_clone_url_reaches_another_sessions_repository() {
    let installation = unique_name("cross-clone");
    let cluster = TestCluster::connect().await;
    let token = unique_name("commit");
    let server = format!("{installation}-git");
    let git = git_server(&cluster, &server, &token).await;
    let ip = &git.ip;
    // The one claim the test cluster's admission limits list (e2e/manifests/test-values.yaml).
    let shared = SharedClaim::create(&cluster, "oab-test-borrowed").await;
    let document = WORKER_PROFILE.replace(
        "[storage]\nkind = \"per-session\"\nclass = \"openab-test-local\"\nsize = \"1Gi\"\n",
        &format!("[storage]\nkind = \"borrowed\"\nclaim = \"{}\"\n", shared.name),
    );
    assert_ne!(
        document, WORKER_PROFILE,
        "the profile's storage table changed shape"
    );
    // A server at a private address: the profile lists it for its seeds' egress, as an
    // operator with an in-cluster git server does.
    let document = format!("seed_hosts = [\"git://{ip}\"]\negress = [\"{ip}/32\"]\n{document}");
    let profile = AdminObject::profile(&cluster, &installation, &document).await;
    let runtime = runtime(&cluster, &profile, Reach::Exec, &installation);
    let thread = |name: &str| SessionIdentity::new(&installation, "agent", "test", name).expect("identity");
    let (victim, intruder) = (thread("victim"), thread("intruder"));

    // The victim keeps a secret on a branch that exists only in its own repository.
    runtime
        .create(&victim, &CreateOptions::new())
        .await
        .expect("create the victim");
    let client = AcpClient::new(runtime.attach(&victim.id()).await.expect("attach the victim"));
    client.initialize().await.expect("initialize");
    let secret = unique_name("secret");
    let made = client
        .exec(&format!(
            "git init -q . && git checkout -q -b private && echo {secret} > secret.txt && git add secret.txt \
             && git -c user.email=v@v -c user.name=v commit -q -m {secret} && echo made"
        ))
        .await
        .expect("exec in the victim");
    assert!(made.stdout.contains("made"), "{made:?}");
    drop(client);
    runtime
        .suspend(&victim.id(), session_runtime::SuspendReason::Idle)
        .await
        .expect("suspend the victim");

    let victim_id = victim.id();
    for url in [
        format!("/session/{victim_id}/workspace"),
        format!("file:///session/{victim_id}/workspace"),
        format!("../{victim_id}/workspace"),
        "ext::sh -c cp% -r% /session% /tmp/x".to_owned(),
        format!("git://{ip}:9419/repo"),
        "https://169.254.169.254/latest/meta-data".to_owned(),
        "https://kubernetes.default.svc/api".to_owned(),
    ] {
        let seed = WorkspaceSeed::GitClone {
            url: url.clone(),
            reference: None,
        };
        match runtime
            .create(&intruder, &CreateOptions::new().with_workspace_seed(seed))
            .await
        {
            Err(Error::InvalidArgument { reason }) => assert!(reason.contains("seed"), "{url}: {reason}"),
            other => panic!("the clone seed {url:?} must be refused at create: {other:?}"),
        }
        assert!(
            matches!(runtime.status(&intruder.id()).await, Err(Error::NotFound { .. })),
            "{url}: a refused seed makes nothing"
        );
    }

    // The positive control: a clone from the listed host reaches the intruder's workspace, and
    // its seed saw nothing of the victim's.
    let seed = WorkspaceSeed::GitClone {
        url: format!("git://{ip}/repo"),
        reference: Some("topic".into()),
    };
    runtime
        .create(&intruder, &CreateOptions::new().with_workspace_seed(seed))
        .await
        .expect("a clone from a listed host");
    let client = AcpClient::new(runtime.attach(&intruder.id()).await.expect("attach the intruder"));
    client.initialize().await.expect("initialize");
    let workdir = client.working_dir().to_owned();
    let log = client
        .exec(&format!(
            "git -C {workdir} log -1 --format=%s; git -C {workdir} branch -a"
        ))
        .await
        .expect("exec in the intruder");
    assert!(
        log.stdout.contains(&token),
        "the listed repository was cloned: {log:?}"
    );
    assert!(
        !log.stdout.contains("private") && !log.stdout.contains(&secret),
        "nothing of the victim's repository: {log:?}"
    );
    drop(client);
    for identity in [&intruder, &victim] {
        runtime
            .close(&identity.id(), CloseReason::Reset)
            .await
            .expect("close");
    }
    drop(runtime);
    drop(shared);
}
