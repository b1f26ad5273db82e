//! The Kubernetes runtime's figures, against the test cluster (`scripts/cluster up`, then
//! `eval "$(scripts/cluster env)"` and `cargo bench -p runtime-kubernetes --bench kubernetes`):
//!
//! 1. API requests of a lifecycle (create, attach, suspend, attach, close), counted by kind: the
//!    process's first, then its second (what every later one costs); `OAB_BENCH_TRACE=1` lists
//!    each request in order. Events are published in the background, so one is counted in the
//!    phase during which it lands.
//! 2. On the real node: attach of a new session to the agent's first ACP reply, against a bare
//!    Pod of the same image from create to Ready, in the same run (median of 20 each); and where
//!    the attach goes: a bare Pod of the worker's shape (an init container, then the main one),
//!    a bare Pod with the volumes of an ephemeral worker mounted whole (two `emptyDir`s),
//!    `attach` returning (the relay's welcome), and the ACP `initialize` reply after it; and a
//!    resume (attach after suspend) of the same session, whose worker needs no init container;
//!    then the same with the volume mounted whole (`volume_path`), which needs none at all; and
//!    both with ephemeral storage (no provisioner; subPaths need the init container on every
//!    start); and ephemeral storage in the container's own layer (`container_layer`: no volume
//!    at all). Medians and p95 of 20.
//! 3. One reconcile pass over 10,000 session anchors: wall time, this process's CPU time, and
//!    API requests (`OAB_BENCH_ANCHORS` changes the number).
//! 4. On the real node: 30 sessions at once (`OAB_BENCH_CONCURRENT` changes the number), each a
//!    volume of its own: create, attach, the first ACP reply and a prompt turn of all at once; suspend half and
//!    resume them at once; close all. First-reply p50 and p95, and the p50 as a ratio to a single
//!    session's median first reply (the same shape, one at a time, in the same run); API requests
//!    per session, and what is left afterwards. Then the same with no volume (`emptyDir`), the
//!    node's own floor for that many Pods at once, so that what the volume provisioner adds shows.
//! 5. On the real node, with `deploy/worker/Dockerfile`'s image and codex-acp as the agent
//!    (`openab.dev/agent-worker:test`, e2e/images/build): a new session's first ACP reply and a
//!    resume's, against a bare Pod of that image from create to Ready (median of 10 each); the
//!    image's size as the node reports it; the relay's and the agent's resident memory per Pod.
//! 6. On the real node, the gVisor tier (`runtime_class = "gvisor"`) against the default runtime
//!    (runc), each with ephemeral storage mounted whole, interleaved: a new session's first ACP
//!    reply and a resume's (median and p95 of 20 each), a bare Pod of the image under each, and
//!    the memory each worker Pod costs the node (proportional set size of its processes and its
//!    containerd shim, read from the node's `/proc`).
//! 7. On the real node, the warm pool (`warm_pool = 2`, ephemeral storage, a broker with its key):
//!    a new session's attach and first ACP reply when it claims a warm worker, against a bare Pod
//!    of the same image to Ready and a cold first reply of the same profile with the pool empty,
//!    interleaved (median and p95 of 20 each; the pool is refilled between samples); the API
//!    requests of a warm lifecycle (create, warm attach, close), the refill the claim starts
//!    counted apart; and a burst of 20 attaches at once with a pool of 10 (first-reply p50 and
//!    p99, and how many started warm).
//!
//! `OAB_BENCH_PARTS=2,5` runs only those parts; `OAB_BENCH_LAYOUTS=1,3` only those layouts of
//! part 2 (numbered from 0 as listed); `RUST_LOG` (e.g. `runtime_kubernetes=debug`) logs the
//! runtime to standard error. Part 2 lists each sample over twice its median, by session name,
//! to find it in that log. Without a cluster it says so and exits 0: a
//! benchmark is run by hand, never a gate.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use runtime_kubernetes::profile::WorkerProfile;
use runtime_kubernetes::{KubernetesRuntime, OabSession};
use session_runtime::config::{KubernetesConfig, Reach};
use session_runtime::testing::AcpClient;
use session_runtime::{CloseReason, CreateOptions, SessionIdentity, SessionRuntime, SuspendReason};
use test_cluster::faults::Faults;
use test_cluster::k8s_openapi::api::core::v1::Pod;
use test_cluster::kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use test_cluster::kube::Api;
use test_cluster::{restricted_pod, unique_name, wait_until, TestCluster};

const WORKER: &str = r#"
image = "openab.dev/worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/acp-test-agent"]
termination_grace = "1s"

[storage]
kind = "ephemeral"
"#;
/// `deploy/worker/Dockerfile`'s image as the test cluster builds it, with codex-acp.
const REAL_AGENT_IMAGE: &str = "openab.dev/agent-worker:test";
const REAL_AGENT: &str = r#"
image = "openab.dev/agent-worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/codex-acp"]
termination_grace = "1s"

[resources]
memory_limit = "512Mi"

[storage]
kind = "ephemeral"
"#;
const REAL_AGENT_SAMPLES: usize = 10;
const EPHEMERAL: &str = "kind = \"ephemeral\"";
const PER_SESSION: &str = "kind = \"per-session\"\nclass = \"openab-test-local\"\nsize = \"1Gi\"";

const SAMPLES: usize = 20;

fn main() {
    if std::env::var_os("OPENAB_BROKER_KUBECONFIG").is_none() {
        eprintln!("kubernetes bench: no cluster in the environment; start one with scripts/cluster up and eval \"$(scripts/cluster env)\"");
        return;
    }
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a Tokio runtime");
    runtime.block_on(run());
}

async fn run() {
    let cluster = TestCluster::connect().await;
    let installation = unique_name("bench");
    let maps: Api<DynamicObject> = Api::namespaced_with(
        cluster.admin(),
        cluster.sessions_namespace(),
        &WorkerProfile::resource(),
    );
    let profile =
        |name: &str, document: &str| WorkerProfile::resource_from_toml(name, document).expect("a profile");
    maps.create(&PostParams::default(), &profile(&installation, WORKER))
        .await
        .expect("the profile");
    // The attach figures on a volume of each session's own, as sessions that resume have.
    let with_volume = format!("{installation}-volume");
    let volume_profile = profile(&with_volume, &WORKER.replace(EPHEMERAL, PER_SESSION));
    maps.create(&PostParams::default(), &volume_profile)
        .await
        .expect("the profile with a volume");
    // The same with the volume mounted whole (`volume_path`): no init container; and both
    // with ephemeral storage, where no provisioner takes part.
    let whole_volume = format!("{installation}-whole");
    let whole_ephemeral = format!("{installation}-whole-ephemeral");
    for (name, document) in [
        (&whole_volume, WORKER.replace(EPHEMERAL, PER_SESSION)),
        (&whole_ephemeral, WORKER.to_owned()),
    ] {
        maps.create(
            &PostParams::default(),
            &profile(name, &format!("volume_path = \"/session\"\n{document}")),
        )
        .await
        .expect("a profile with the volume mounted whole");
    }
    // Ephemeral storage in the container's own layer: no volume at all.
    let container_layer = format!("{installation}-layer");
    let document = WORKER.replace(EPHEMERAL, &format!("{EPHEMERAL}\ncontainer_layer = true"));
    maps.create(
        &PostParams::default(),
        &profile(
            &container_layer,
            &format!("volume_path = \"/tmp/session\"\n{document}"),
        ),
    )
    .await
    .expect("a profile in the container layer");
    let faults = Faults::new();
    let build = |profile: &str| {
        let mut config = KubernetesConfig::new(cluster.sessions_namespace(), profile);
        config.reach = Reach::PodIp;
        KubernetesRuntime::builder(faults.client(cluster.broker_config()), config)
            .installation(&installation)
            .build()
            .expect("runtime")
    };
    let runtime = build(&installation);

    // The real agent's image, a volume per session.
    let real_agent = format!("{installation}-codex");
    let real_agent_profile = profile(&real_agent, &REAL_AGENT.replace(EPHEMERAL, PER_SESSION));
    maps.create(&PostParams::default(), &real_agent_profile)
        .await
        .expect("the real agent's profile");
    let parts = std::env::var("OAB_BENCH_PARTS").ok();
    let part = |n: &str| {
        parts
            .as_deref()
            .is_none_or(|parts| parts.split(',').any(|p| p.trim() == n))
    };

    if part("1") {
        requests_per_lifecycle(&runtime, &faults, &installation).await;
    }
    if part("2") {
        let chosen = std::env::var("OAB_BENCH_LAYOUTS").ok();
        let layouts: Vec<_> = [
            ("a claim each, subPaths + init container", &with_volume),
            ("a claim each, mounted whole", &whole_volume),
            ("ephemeral, subPaths + init container", &installation),
            ("ephemeral, mounted whole", &whole_ephemeral),
            ("ephemeral, in the container layer", &container_layer),
        ]
        .into_iter()
        .enumerate()
        .filter(|(n, _)| {
            chosen
                .as_deref()
                .is_none_or(|chosen| chosen.split(',').any(|c| c.trim() == n.to_string()))
        })
        .map(|(_, (label, profile))| (label, build(profile)))
        .collect();
        attach_against_a_bare_pod(&cluster, &layouts, &installation).await;
    }
    if part("3") {
        reconcile_over_many_anchors(&cluster, &runtime, &faults, &installation).await;
    }
    if part("4") {
        for (storage, profile) in [("a volume each", &with_volume), ("no volume", &installation)] {
            sessions_at_once(
                &cluster,
                std::sync::Arc::new(build(profile)),
                &faults,
                &installation,
                storage,
            )
            .await;
        }
    }
    if part("5") {
        real_agent_against_a_bare_pod(&cluster, &build(&real_agent), &installation).await;
    }
    let gvisor = format!("{installation}-gvisor");
    if part("6") {
        let document = format!("runtime_class = \"gvisor\"\nvolume_path = \"/session\"\n{WORKER}");
        maps.create(&PostParams::default(), &profile(&gvisor, &document))
            .await
            .expect("the gVisor profile");
        gvisor_against_runc(&cluster, &build(&whole_ephemeral), &build(&gvisor), &installation).await;
    }
    let warm = format!("{installation}-warm");
    if part("7") {
        maps.create(
            &PostParams::default(),
            &profile(&warm, &format!("warm_pool = 2\n{WORKER}")),
        )
        .await
        .expect("the pooled profile");
        let mut config = KubernetesConfig::new(cluster.sessions_namespace(), &warm);
        config.reach = Reach::PodIp;
        let pooled = std::sync::Arc::new(
            KubernetesRuntime::builder(faults.client(cluster.broker_config()), config)
                .installation(&installation)
                .broker_key(worker_relay::BrokerKey::new(vec![9; 32]))
                .build()
                .expect("a broker with its key"),
        );
        warm_against_a_bare_pod(&cluster, &pooled, &build(&warm), &installation).await;
        warm_requests(&cluster, &pooled, &faults, &installation).await;
        let spec = serde_json::json!({ "spec": { "warm_pool": BURST_POOL } });
        maps.patch(&warm, &PatchParams::default(), &Patch::Merge(&spec))
            .await
            .expect("a larger pool");
        burst_with_a_pool(&cluster, &pooled, &installation).await;
        // The pool goes with its profile (the members are the OabProfile's).
    }
    for name in [
        &warm,
        &installation,
        &with_volume,
        &whole_volume,
        &whole_ephemeral,
        &container_layer,
        &real_agent,
        &gvisor,
    ] {
        let _ = maps.delete(name, &DeleteParams::default()).await;
    }
}

fn kinds(requests: &[(test_cluster::faults::Method, String)]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for (method, path) in requests {
        let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
        // .../namespaces/<ns>/<resource>[/<name>[/<subresource>]]
        let at = segments
            .iter()
            .position(|s| *s == "namespaces")
            .map_or(0, |i| i + 2);
        let resource = segments.get(at).copied().unwrap_or("?");
        let verb = match (method.as_str(), segments.len() > at + 1) {
            ("GET", false) => "list",
            ("GET", true) => "get",
            ("POST", _) if segments.last() == Some(&"exec") => "exec",
            ("POST", _) => "create",
            ("PUT", _) => "update",
            ("PATCH", _) => "patch",
            ("DELETE", _) => "delete",
            (other, _) => other,
        };
        *counts.entry(format!("{verb} {resource}")).or_insert(0) += 1;
    }
    counts
}

fn writes(counts: &BTreeMap<String, usize>) -> usize {
    counts
        .iter()
        .filter(|(kind, _)| {
            ["create", "update", "patch", "delete"]
                .iter()
                .any(|w| kind.starts_with(w))
        })
        .map(|(_, n)| n)
        .sum()
}

async fn requests_per_lifecycle(runtime: &KubernetesRuntime, faults: &Faults, installation: &str) {
    // The first lifecycle of a process also pays what a process does once (the profile's egress
    // policy, the start of its shared watch); the second is what every later one costs.
    for lifecycle in ["first", "second"] {
        let identity = SessionIdentity::new(installation, "agent", "bench", format!("lifecycle {lifecycle}"))
            .expect("identity");
        let id = identity.id();
        println!("API requests of the process's {lifecycle} lifecycle (ephemeral storage, Pod IP reach):");
        println!("  {:<10} {:>5} {:>7}  by kind", "phase", "all", "writes");
        let mut total = 0;
        let mut total_writes = 0;
        for phase in ["create", "attach", "suspend", "attach", "close"] {
            faults.clear_requests();
            match phase {
                "create" => drop(
                    runtime
                        .create(&identity, &CreateOptions::new())
                        .await
                        .expect("create"),
                ),
                "attach" => {
                    let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
                    client.initialize().await.expect("initialize");
                }
                "suspend" => runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend"),
                _ => runtime.close(&id, CloseReason::Reset).await.expect("close"),
            }
            if std::env::var_os("OAB_BENCH_TRACE").is_some() {
                for (method, path) in faults.requests() {
                    println!("    {method:?} {path}");
                }
            }
            let counts = kinds(&faults.requests());
            let all: usize = counts.values().sum();
            total += all;
            total_writes += writes(&counts);
            println!("  {phase:<10} {all:>5} {:>7}  {counts:?}", writes(&counts));
        }
        println!("  {:<10} {total:>5} {total_writes:>7}", "total");
    }
    println!(
        "  (the broker's watches of its workers, `list pods`, and of its profile, `list oabprofiles`, list and watch once per process)"
    );
}

fn median(mut samples: Vec<Duration>) -> (Duration, Duration, Duration) {
    samples.sort();
    (samples[0], samples[samples.len() / 2], samples[samples.len() - 1])
}

/// Creates `pod`, waits for it to be Ready, deletes it; how long to Ready.
async fn bare_pod_to_ready(pods: &Api<Pod>, pod: Pod) -> Duration {
    let name = pod.metadata.name.clone().expect("a name");
    let started = Instant::now();
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("a bare Pod");
    wait_until("the bare Pod to be Ready", Duration::from_secs(120), || async {
        let pod = pods.get(&name).await.ok()?;
        let ready = pod
            .status?
            .conditions?
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        ready.then_some(())
    })
    .await;
    let elapsed = started.elapsed();
    let _ = pods
        .delete(
            &name,
            &DeleteParams {
                grace_period_seconds: Some(0),
                ..DeleteParams::default()
            },
        )
        .await;
    elapsed
}

/// One new session of `runtime`: attach to the relay's welcome, to the first ACP reply, and a
/// resume (attach after suspend) to its first ACP reply.
async fn new_session_and_resume(
    runtime: &KubernetesRuntime,
    installation: &str,
    name: &str,
) -> [Duration; 3] {
    let identity = SessionIdentity::new(installation, "agent", "bench", name).expect("identity");
    let id = identity.id();
    runtime
        .create(&identity, &CreateOptions::new())
        .await
        .expect("create");
    let started = Instant::now();
    let attachment = runtime.attach(&id).await.expect("attach");
    let attached = started.elapsed();
    let client = AcpClient::new(attachment);
    client.initialize().await.expect("the first ACP reply");
    let first = started.elapsed();
    drop(client);
    runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
    let started = Instant::now();
    let client = AcpClient::new(runtime.attach(&id).await.expect("resume"));
    client
        .initialize()
        .await
        .expect("the first ACP reply after resume");
    let resume = started.elapsed();
    drop(client);
    runtime.close(&id, CloseReason::Reset).await.expect("close");
    [attached, first, resume]
}

/// Part 2, for each of `layouts` (a label and a runtime whose profile has that storage and
/// layout: subPaths, where an init container makes the directories on a volume that may lack
/// them, or the volume mounted whole with `volume_path`, where the relay makes them).
async fn attach_against_a_bare_pod(
    cluster: &TestCluster,
    layouts: &[(&'static str, KubernetesRuntime)],
    installation: &str,
) {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let mut bare = Vec::new();
    let mut shaped = Vec::new();
    let mut volumed = Vec::new();
    let mut figures: Vec<[Vec<Duration>; 3]> = layouts.iter().map(|_| Default::default()).collect();
    // Interleaved, so a machine that slows down mid-run slows all alike.
    for sample in 0..SAMPLES {
        let pod = restricted_pod(
            &format!("{installation}-bare-{sample}"),
            "openab.dev/worker:test",
            &["/bin/sleep", "3600"],
        );
        bare.push(bare_pod_to_ready(&pods, pod).await);
        // The subPath worker's shape: the same container first as an init container that exits at once.
        let mut pod = restricted_pod(
            &format!("{installation}-shaped-{sample}"),
            "openab.dev/worker:test",
            &["/bin/sleep", "3600"],
        );
        if let Some(spec) = pod.spec.as_mut() {
            let mut init = spec.containers[0].clone();
            init.name = "prepare".to_owned();
            init.command = Some(vec!["/bin/true".to_owned()]);
            spec.init_containers = Some(vec![init]);
        }
        shaped.push(bare_pod_to_ready(&pods, pod).await);
        volumed.push(
            bare_pod_to_ready(
                &pods,
                with_worker_volumes(&format!("{installation}-volumed-{sample}")),
            )
            .await,
        );
        for (layout, (_, runtime)) in layouts.iter().enumerate() {
            let name = format!("attach-{layout}-{sample}");
            let sampled = new_session_and_resume(runtime, installation, &name).await;
            for (samples, figure) in figures[layout].iter_mut().zip(sampled) {
                samples.push(figure);
            }
        }
    }
    // The outliers, to find in the runtime's log (RUST_LOG).
    for (layout, ((label, _), samples)) in layouts.iter().zip(&figures).enumerate() {
        for (figure, samples) in ["attach", "first reply", "resume"].iter().zip(samples) {
            let (_, median, _) = median(samples.clone());
            for (sample, taken) in samples.iter().enumerate() {
                if *taken > median * 2 {
                    let id = SessionIdentity::new(
                        installation,
                        "agent",
                        "bench",
                        format!("attach-{layout}-{sample}"),
                    )
                    .expect("identity")
                    .id();
                    println!("  outlier: {label}, {figure} of sample {sample} (session {id}): {taken:.1?}, median {median:.1?}");
                }
            }
        }
    }
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!("a new session to its first ACP reply, and its resume, against a bare Pod of the same image to Ready ({SAMPLES} each):");
    let bare_median = row("bare Pod", &bare);
    let shaped_median = row("bare Pod, init + main", &shaped);
    let volumed_median = row("bare Pod, 2 emptyDirs", &volumed);
    for ((label, _), [attached, first, resume]) in layouts.iter().zip(&figures) {
        println!(" {label}:");
        row("attach returned", attached);
        let first = row("first ACP reply", first);
        let resume = row("resume to ACP reply", resume);
        println!(
            "  ratio of medians: first reply {:.2}x the bare Pod ({:.2}x the bare Pod with an init container, {:.2}x with the worker's volumes), resume {:.2}x the bare Pod ({:.2}x with the worker's volumes)",
            ratio(first, bare_median),
            ratio(first, shaped_median),
            ratio(first, volumed_median),
            ratio(resume, bare_median),
            ratio(resume, volumed_median)
        );
    }
}

/// A bare Pod of the worker image with the volumes an ephemeral worker mounted whole has (an
/// `emptyDir` for the session, one for `/tmp`): a Pod with any volume waits for the kubelet to
/// mount them, which it checks every 300 ms (`podAttachAndMountRetryInterval`), after a first
/// check that comes too early.
fn with_worker_volumes(name: &str) -> Pod {
    use test_cluster::k8s_openapi::api::core::v1::{EmptyDirVolumeSource, Volume, VolumeMount};
    let mut pod = restricted_pod(name, "openab.dev/worker:test", &["/bin/sleep", "3600"]);
    if let Some(spec) = pod.spec.as_mut() {
        let volumes = [("session", "/session"), ("tmp", "/tmp")];
        spec.volumes = Some(
            volumes
                .iter()
                .map(|(volume, _)| Volume {
                    name: (*volume).to_owned(),
                    empty_dir: Some(EmptyDirVolumeSource::default()),
                    ..Volume::default()
                })
                .collect(),
        );
        spec.containers[0].volume_mounts = Some(
            volumes
                .iter()
                .map(|(volume, path)| VolumeMount {
                    name: (*volume).to_owned(),
                    mount_path: (*path).to_owned(),
                    ..VolumeMount::default()
                })
                .collect(),
        );
    }
    pod
}

/// Prints one figure's `samples` (min, median, p95, max) under `label`; its median.
fn row(label: &str, samples: &[Duration]) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    let (min, median, max) = (sorted[0], sorted[sorted.len() / 2], sorted[sorted.len() - 1]);
    let p95 = percentile(&mut sorted, 0.95);
    println!("  {label:<28} min {min:>9.1?}  median {median:>9.1?}  p95 {p95:>9.1?}  max {max:>9.1?}");
    median
}

/// This process's CPU time (user and system), from /proc.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the parenthesised command: state is field 3, utime 14, stime 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<u64>().ok())
        .sum();
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

async fn reconcile_over_many_anchors(
    cluster: &TestCluster,
    runtime: &KubernetesRuntime,
    faults: &Faults,
    installation: &str,
) {
    let anchors: usize = std::env::var("OAB_BENCH_ANCHORS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000);
    let started = Instant::now();
    let mut created = 0;
    let mut pending = Vec::new();
    for n in 0..anchors {
        let identity =
            SessionIdentity::new(installation, "agent", "bench", format!("many-{n}")).expect("identity");
        pending.push(async move { runtime.create(&identity, &CreateOptions::new()).await });
        if pending.len() == 32 || n + 1 == anchors {
            for result in futures_util::future::join_all(pending.drain(..)).await {
                result.expect("create");
                created += 1;
            }
        }
    }
    println!(
        "made {created} sessions (anchors, ephemeral storage) in {:.1?}",
        started.elapsed()
    );
    faults.clear_requests();
    let cpu = cpu_time();
    let wall = Instant::now();
    let report = runtime.reconcile().await.expect("reconcile");
    let wall = wall.elapsed();
    let cpu = cpu_time().saturating_sub(cpu);
    let counts = kinds(&faults.requests());
    println!("one reconcile pass over {created} anchors:");
    println!(
        "  wall {wall:.2?}, CPU of this process {cpu:.2?}, API requests {} {counts:?}, clean: {}",
        counts.values().sum::<usize>(),
        report.is_clean()
    );
    // Deleted OabSessions are closes: one more pass carries them out and removes them.
    let anchors: Api<OabSession> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let _ = anchors
        .delete_collection(
            &DeleteParams::default(),
            &ListParams::default().labels(&format!("openab.dev/installation={installation}")),
        )
        .await;
    let _ = runtime.reconcile().await;
}

fn percentile(samples: &mut [Duration], fraction: f64) -> Duration {
    samples.sort();
    let index = ((samples.len() as f64 * fraction).ceil() as usize).clamp(1, samples.len()) - 1;
    samples[index]
}

/// Attaches every session of `ids` at once and waits for each one's first ACP reply and, with
/// `turn`, a prompt turn after it; how long each took.
async fn attach_all(
    runtime: &std::sync::Arc<KubernetesRuntime>,
    ids: &[session_runtime::SessionId],
    turn: bool,
) -> Vec<Duration> {
    let mut tasks = Vec::new();
    for id in ids {
        let (runtime, id) = (std::sync::Arc::clone(runtime), *id);
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
            client.initialize().await.expect("the first ACP reply");
            let first_reply = started.elapsed();
            if turn {
                let session = client
                    .new_session(client.working_dir())
                    .await
                    .expect("session/new");
                client.prompt(&session, "hello").await.expect("a prompt turn");
            }
            first_reply
        }));
    }
    let mut times = Vec::new();
    for task in tasks {
        times.push(task.await.expect("an attach task"));
    }
    times
}

/// How many sessions part 4 attaches one at a time first, for its baseline.
const ALONE_SAMPLES: usize = 5;

async fn sessions_at_once(
    cluster: &TestCluster,
    runtime: std::sync::Arc<KubernetesRuntime>,
    faults: &Faults,
    installation: &str,
    storage: &str,
) {
    let count: usize = std::env::var("OAB_BENCH_CONCURRENT")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(30);
    // The baseline, in this run: the same sessions' shape one at a time.
    let mut alone = Vec::new();
    for n in 0..ALONE_SAMPLES {
        let identity = SessionIdentity::new(installation, "agent", "bench", format!("{storage}: alone {n}"))
            .expect("identity");
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        alone.extend(attach_all(&runtime, &[identity.id()], true).await);
        runtime
            .close(&identity.id(), CloseReason::Reset)
            .await
            .expect("close");
    }
    faults.clear_requests();
    let mut ids = Vec::new();
    for n in 0..count {
        let identity =
            SessionIdentity::new(installation, "agent", "bench", format!("{storage}: at once {n}"))
                .expect("identity");
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        ids.push(identity.id());
    }
    let mut first = attach_all(&runtime, &ids, true).await;
    let half = &ids[..count / 2];
    for id in half {
        runtime.suspend(id, SuspendReason::Idle).await.expect("suspend");
    }
    let mut resumed = attach_all(&runtime, half, false).await;
    for id in &ids {
        runtime.close(id, CloseReason::Reset).await.expect("close");
    }
    let requests = faults.requests().len();
    let selector = format!("app.kubernetes.io/managed-by=openab,openab.dev/installation={installation}");
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let claims: Api<test_cluster::k8s_openapi::api::core::v1::PersistentVolumeClaim> =
        Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let pods_left = pods
        .list(&ListParams::default().labels(&format!("{selector},openab.dev/role=worker")))
        .await
        .map_or(0, |l| {
            l.items
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .count()
        });
    let claims_left = claims
        .list(&ListParams::default().labels(&format!("{selector},openab.dev/role=storage")))
        .await
        .map_or(0, |l| {
            l.items
                .iter()
                .filter(|c| c.metadata.deletion_timestamp.is_none())
                .count()
        });
    println!("{count} sessions at once ({storage}): create, attach + first ACP reply + a prompt turn of all at once, suspend {}, resume them at once, close all:", half.len());
    let alone_median = percentile(&mut alone, 0.5);
    let median = percentile(&mut first, 0.5);
    println!(
        "  first reply   p50 {median:>9.1?}  p95 {:>9.1?}; alone (median of {ALONE_SAMPLES}, this run) {alone_median:.1?}: {:.1}x",
        percentile(&mut first, 0.95),
        median.as_secs_f64() / alone_median.as_secs_f64()
    );
    println!(
        "  resume reply  p50 {:>9.1?}  p95 {:>9.1?}",
        percentile(&mut resumed, 0.5),
        percentile(&mut resumed, 0.95)
    );
    println!(
        "  API requests per session: {:.1}; left afterwards: {pods_left} worker Pods, {claims_left} claims",
        requests as f64 / count as f64
    );
}

/// Part 5: the real agent's image.
async fn real_agent_against_a_bare_pod(
    cluster: &TestCluster,
    runtime: &KubernetesRuntime,
    installation: &str,
) {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let (mut bare, mut first, mut resume) = (Vec::new(), Vec::new(), Vec::new());
    let mut memory = Vec::new();
    for sample in 0..REAL_AGENT_SAMPLES {
        let pod = restricted_pod(
            &format!("{installation}-agent-bare-{sample}"),
            REAL_AGENT_IMAGE,
            &["/bin/sleep", "3600"],
        );
        bare.push(bare_pod_to_ready(&pods, pod).await);
        let identity = SessionIdentity::new(installation, "agent", "bench", format!("codex-{sample}"))
            .expect("identity");
        let id = identity.id();
        runtime
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        let started = Instant::now();
        let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
        client.initialize().await.expect("codex's first ACP reply");
        first.push(started.elapsed());
        memory.push(resident_memory(&pods, id.as_ref()).await);
        drop(client);
        runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
        let started = Instant::now();
        let client = AcpClient::new(runtime.attach(&id).await.expect("resume"));
        client
            .initialize()
            .await
            .expect("codex's first ACP reply after resume");
        resume.push(started.elapsed());
        drop(client);
        runtime.close(&id, CloseReason::Reset).await.expect("close");
    }
    let (bare_min, bare_median, bare_max) = median(bare);
    let (first_min, first_median, first_max) = median(first);
    let (resume_min, resume_median, resume_max) = median(resume);
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!(
        "codex-acp in deploy/worker/Dockerfile's image (a volume per session, {REAL_AGENT_SAMPLES} each):"
    );
    println!(
        "  bare Pod of the image min {bare_min:>9.1?}  median {bare_median:>9.1?}  max {bare_max:>9.1?}"
    );
    println!(
        "  first ACP reply       min {first_min:>9.1?}  median {first_median:>9.1?}  max {first_max:>9.1?}"
    );
    println!("  resume to ACP reply   min {resume_min:>9.1?}  median {resume_median:>9.1?}  max {resume_max:>9.1?}");
    println!(
        "  ratio of medians: first reply {:.2}x the bare Pod, resume {:.2}x",
        ratio(first_median, bare_median),
        ratio(resume_median, bare_median)
    );
    let size = image_size(cluster).await;
    println!(
        "  image size on the node: {}",
        size.map_or("unknown".to_owned(), |bytes| format!(
            "{:.0} MiB",
            bytes as f64 / 1048576.0
        ))
    );
    memory.sort_unstable();
    let (relay, agent) = memory[memory.len() / 2];
    println!(
        "  resident memory per Pod after initialize (median): relay {:.1} MiB, agent {:.1} MiB",
        relay as f64 / 1024.0,
        agent as f64 / 1024.0
    );
}

/// The relay's (PID 1) and every other process's (the agent: codex's Node launcher and native
/// agent) resident memory in the session's worker, in KiB, read from `/proc` inside it.
async fn resident_memory(pods: &Api<Pod>, session: &str) -> (u64, u64) {
    let listed = pods
        .list(&ListParams::default().labels(&format!("openab.dev/session={session}")))
        .await
        .expect("the session's Pods");
    let pod = listed
        .into_iter()
        .find(|pod| pod.metadata.deletion_timestamp.is_none())
        .and_then(|pod| pod.metadata.name)
        .expect("a worker Pod");
    let script = "for p in /proc/[0-9]*; do echo \"${p#/proc/} $(awk '/^VmRSS/ {print $2}' $p/status 2>/dev/null)\"; done";
    let output = test_cluster::exec(pods, &pod, &["/bin/sh", "-c", script]).await;
    let (mut relay, mut agent) = (0, 0);
    for line in output.stdout.lines() {
        let mut fields = line.split_whitespace();
        let (Some(pid), Some(kib)) = (fields.next(), fields.next().and_then(|k| k.parse::<u64>().ok()))
        else {
            continue;
        };
        if pid == "1" {
            relay = kib;
        } else {
            agent += kib;
        }
    }
    // The shell and awk that read it are counted with the agent: about 2 MiB at most.
    (relay, agent)
}

/// The real agent image's size as the node reports it (`status.images`).
async fn image_size(cluster: &TestCluster) -> Option<i64> {
    use test_cluster::k8s_openapi::api::core::v1::Node;
    let nodes: Api<Node> = Api::all(cluster.admin());
    let listed = nodes.list(&ListParams::default()).await.ok()?;
    listed.into_iter().find_map(|node| {
        node.status?.images?.into_iter().find_map(|image| {
            image
                .names
                .as_ref()?
                .iter()
                .any(|name| name.ends_with(REAL_AGENT_IMAGE))
                .then_some(image.size_bytes?)
        })
    })
}

/// Part 6: the same worker under runc and under gVisor, interleaved.
async fn gvisor_against_runc(
    cluster: &TestCluster,
    runc: &KubernetesRuntime,
    gvisor: &KubernetesRuntime,
    installation: &str,
) {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let tiers = [("runc", None, runc), ("gVisor", Some("gvisor"), gvisor)];
    let mut figures: Vec<TierFigures> = tiers.iter().map(|_| TierFigures::default()).collect();
    for sample in 0..SAMPLES {
        for ((tier, class, runtime), figures) in tiers.iter().zip(figures.iter_mut()) {
            let mut pod = restricted_pod(
                &format!("{installation}-{}-bare-{sample}", tier.to_lowercase()),
                "openab.dev/worker:test",
                &["/bin/sleep", "3600"],
            );
            if let Some(spec) = pod.spec.as_mut() {
                spec.runtime_class_name = class.map(str::to_owned);
            }
            figures.bare.push(bare_pod_to_ready(&pods, pod).await);
            let identity = SessionIdentity::new(installation, "agent", "bench", format!("{tier}-{sample}"))
                .expect("identity");
            let id = identity.id();
            runtime
                .create(&identity, &CreateOptions::new())
                .await
                .expect("create");
            let started = Instant::now();
            let client = AcpClient::new(runtime.attach(&id).await.expect("attach"));
            client.initialize().await.expect("the first ACP reply");
            figures.first.push(started.elapsed());
            figures.memory.push(node_memory(&pods, id.as_ref()).await);
            drop(client);
            runtime.suspend(&id, SuspendReason::Idle).await.expect("suspend");
            let started = Instant::now();
            let client = AcpClient::new(runtime.attach(&id).await.expect("resume"));
            client
                .initialize()
                .await
                .expect("the first ACP reply after resume");
            figures.resume.push(started.elapsed());
            drop(client);
            runtime.close(&id, CloseReason::Reset).await.expect("close");
        }
    }
    let stats = |samples: &[Duration]| {
        let mut sorted = samples.to_vec();
        sorted.sort();
        let median = sorted[sorted.len() / 2];
        (median, percentile(&mut sorted, 0.95))
    };
    let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
    println!("the gVisor tier against runc (ephemeral storage mounted whole, {SAMPLES} each, interleaved):");
    let mut medians = Vec::new();
    for (
        (tier, _, _),
        TierFigures {
            bare,
            first,
            resume,
            memory,
        },
    ) in tiers.iter().zip(&figures)
    {
        let (bare, bare_p95) = stats(bare);
        let (first, first_p95) = stats(first);
        let (resume, resume_p95) = stats(resume);
        let mut memory = memory.clone();
        memory.sort_unstable();
        let memory = memory[memory.len() / 2];
        println!(
            "  {tier:<7} bare Pod median {bare:>9.1?} (p95 {bare_p95:>9.1?})  first ACP reply {first:>9.1?} (p95 {first_p95:>9.1?})  resume {resume:>9.1?} (p95 {resume_p95:>9.1?})  node memory per worker Pod {:.1} MiB",
            memory as f64 / 1024.0
        );
        medians.push((bare, first, resume, memory));
    }
    let (
        (runc_bare, runc_first, runc_resume, runc_memory),
        (gvisor_bare, gvisor_first, gvisor_resume, gvisor_memory),
    ) = (medians[0], medians[1]);
    println!(
        "  gVisor / runc (medians): bare Pod {:.2}x, first reply {:.2}x, resume {:.2}x; memory {:+.1} MiB per worker Pod",
        ratio(gvisor_bare, runc_bare),
        ratio(gvisor_first, runc_first),
        ratio(gvisor_resume, runc_resume),
        (gvisor_memory as f64 - runc_memory as f64) / 1024.0
    );
}

/// Part 6's samples of one tier.
#[derive(Default)]
struct TierFigures {
    /// A bare Pod of the image, create to Ready.
    bare: Vec<Duration>,
    /// A new session's attach to its first ACP reply.
    first: Vec<Duration>,
    /// A resume's attach to its first ACP reply.
    resume: Vec<Duration>,
    /// What the worker Pod costs the node, KiB.
    memory: Vec<u64>,
}

/// What the session's worker Pod costs the node's memory, in KiB: the proportional set size of
/// every process in the Pod's cgroup (the containers, or gVisor's sandbox and gofer) and of the
/// containerd shim that is their parent, read from the node's `/proc` (this benchmark runs on
/// the node).
async fn node_memory(pods: &Api<Pod>, session: &str) -> u64 {
    let listed = pods
        .list(&ListParams::default().labels(&format!("openab.dev/session={session}")))
        .await
        .expect("the session's Pods");
    let uid = listed
        .into_iter()
        .find(|pod| pod.metadata.deletion_timestamp.is_none())
        .and_then(|pod| pod.metadata.uid)
        .expect("a worker Pod");
    // cgroupfs names a Pod's cgroup `pod<uid>`.
    let marker = format!("pod{uid}");
    let pss = |pid: &str| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
            .unwrap_or_default()
            .lines()
            .find_map(|line| line.strip_prefix("Pss:"))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    let parent = |pid: &str| -> Option<String> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // Fields after the parenthesised command: state, then the parent's pid.
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)
            .map(str::to_owned)
    };
    let mut members = std::collections::BTreeSet::new();
    let mut shims = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let cgroups = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        if !cgroups.contains(&marker) {
            continue;
        }
        if let Some(parent) = parent(&pid) {
            let name = std::fs::read_to_string(format!("/proc/{parent}/comm")).unwrap_or_default();
            if name.starts_with("containerd-shim") {
                shims.insert(parent);
            }
        }
        members.insert(pid);
    }
    members.iter().chain(&shims).map(|pid| pss(pid)).sum()
}

/// Part 7's pool for its burst, and the burst.
const BURST_POOL: usize = 10;
const BURST: usize = 20;

/// Runs reconcile passes until the installation's pool holds `size` ready members.
async fn pool_full(cluster: &TestCluster, pooled: &KubernetesRuntime, installation: &str, size: usize) {
    members_ready(cluster, Some(pooled), installation, size).await;
}

/// Waits until the installation's pool holds `size` ready members, running reconcile passes of
/// `pooled` meanwhile if given (else the broker's own refills fill it).
async fn members_ready(
    cluster: &TestCluster,
    pooled: Option<&KubernetesRuntime>,
    installation: &str,
    size: usize,
) {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let members = ListParams::default().labels(&format!(
        "openab.dev/installation={installation},openab.dev/role=pool"
    ));
    wait_until("the pool to be full", Duration::from_secs(180), || async {
        if let Some(pooled) = pooled {
            pooled.reconcile().await.ok()?;
        }
        let listed = pods.list(&members).await.ok()?;
        let ready = listed
            .items
            .iter()
            .filter(|pod| pod.metadata.deletion_timestamp.is_none())
            .filter(|pod| {
                pod.status
                    .as_ref()
                    .and_then(|status| status.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .count();
        (ready == size).then_some(())
    })
    .await;
    // The broker's watch sees them ready too.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// The API requests of a warm lifecycle: create, a warm attach to its first reply, close; the
/// refill the claim starts (members' accounts and Pods, and the lists it decides from) apart.
async fn warm_requests(
    cluster: &TestCluster,
    pooled: &KubernetesRuntime,
    faults: &Faults,
    installation: &str,
) {
    pool_full(cluster, pooled, installation, 2).await;
    let identity = SessionIdentity::new(installation, "agent", "bench", "warm lifecycle").expect("identity");
    let id = identity.id();
    let refill = [
        "list pods",
        "create pods",
        "create serviceaccounts",
        "list serviceaccounts",
    ];
    println!("API requests of a warm lifecycle (the pool full, its refill counted apart):");
    let mut total = 0;
    for phase in ["create", "warm attach", "close"] {
        faults.clear_requests();
        match phase {
            "create" => drop(
                pooled
                    .create(&identity, &CreateOptions::new())
                    .await
                    .expect("create"),
            ),
            "warm attach" => {
                let client = AcpClient::new(pooled.attach(&id).await.expect("a warm attach"));
                client.initialize().await.expect("initialize");
                // The refill the claim started, to its end (read with the admin's client, which
                // is not counted).
                members_ready(cluster, None, installation, 2).await;
                drop(client);
            }
            _ => pooled.close(&id, CloseReason::Reset).await.expect("close"),
        }
        let counts = kinds(&faults.requests());
        let (refilling, own): (BTreeMap<_, _>, BTreeMap<_, _>) = counts
            .into_iter()
            .partition(|(kind, _)| phase == "warm attach" && refill.contains(&kind.as_str()));
        let all: usize = own.values().sum();
        total += all;
        println!("  {phase:<12} {all:>3} ({} writes) {own:?}", writes(&own));
        if !refilling.is_empty() {
            println!("  {:<12}     the refill and its waits: {refilling:?}", "");
        }
    }
    println!("  total {total}");
}

/// A burst of [`BURST`] attaches at once against a pool of [`BURST_POOL`].
async fn burst_with_a_pool(
    cluster: &TestCluster,
    pooled: &std::sync::Arc<KubernetesRuntime>,
    installation: &str,
) {
    pool_full(cluster, pooled, installation, BURST_POOL).await;
    let mut ids = Vec::new();
    for n in 0..BURST {
        let identity =
            SessionIdentity::new(installation, "agent", "bench", format!("burst-{n}")).expect("identity");
        pooled
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        ids.push(identity.id());
    }
    let mut times = attach_all(pooled, &ids, false).await;
    let mut warm = 0;
    for id in &ids {
        let worker = pooled
            .status(id)
            .await
            .expect("status")
            .worker
            .map(|w| w.worker_id);
        if worker.is_some_and(|w| w.starts_with("pod/oab-m-")) {
            warm += 1;
        }
    }
    for id in &ids {
        pooled.close(id, CloseReason::Reset).await.expect("close");
    }
    times.sort();
    println!(
        "a burst of {BURST} attaches at once, a pool of {BURST_POOL}: {warm} started warm; first reply p50 {:.1?}, p99 {:.1?}, max {:.1?}",
        percentile(&mut times, 0.5),
        percentile(&mut times, 0.99),
        times[times.len() - 1]
    );
}

/// Part 7: a warm claim's first reply, a cold one of the same profile (a broker without a key
/// keeps no pool) and a bare Pod, interleaved.
async fn warm_against_a_bare_pod(
    cluster: &TestCluster,
    pooled: &KubernetesRuntime,
    cold: &KubernetesRuntime,
    installation: &str,
) {
    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let (mut bare, mut warm_attach, mut warm_first, mut cold_first) = (vec![], vec![], vec![], vec![]);
    // The broker's watch lists the members once before the first sample.
    for sample in 0..=SAMPLES {
        pool_full(cluster, pooled, installation, 2).await;
        let identity =
            SessionIdentity::new(installation, "agent", "bench", format!("warm-{sample}")).expect("identity");
        let id = identity.id();
        pooled
            .create(&identity, &CreateOptions::new())
            .await
            .expect("create");
        let started = Instant::now();
        let attachment = pooled.attach(&id).await.expect("a warm attach");
        let attached = started.elapsed();
        let client = AcpClient::new(attachment);
        client.initialize().await.expect("the first ACP reply");
        let first = started.elapsed();
        let worker = pooled
            .status(&id)
            .await
            .expect("status")
            .worker
            .map(|w| w.worker_id);
        drop(client);
        pooled.close(&id, CloseReason::Reset).await.expect("close");
        if sample == 0 {
            continue;
        }
        assert!(
            worker.as_deref().is_some_and(|w| w.starts_with("pod/oab-m-")),
            "sample {sample} started warm: {worker:?}"
        );
        warm_attach.push(attached);
        warm_first.push(first);
        let pod = restricted_pod(
            &format!("{installation}-warm-bare-{sample}"),
            "openab.dev/worker:test",
            &["/bin/sleep", "3600"],
        );
        bare.push(bare_pod_to_ready(&pods, pod).await);
        let [_, first, _] = new_session_and_resume(cold, installation, &format!("cold-{sample}")).await;
        cold_first.push(first);
    }
    println!("the warm pool: a new session's first ACP reply from a warm worker, against a bare Pod to Ready and a cold first reply ({SAMPLES} each):");
    let bare = row("bare Pod", &bare);
    row("warm attach returned", &warm_attach);
    let warm = row("warm first ACP reply", &warm_first);
    let cold = row("cold first ACP reply", &cold_first);
    println!(
        "  ratio of medians: warm first reply {:.2}x the bare Pod, {:.2}x the cold first reply",
        warm.as_secs_f64() / bare.as_secs_f64(),
        warm.as_secs_f64() / cold.as_secs_f64()
    );
}
