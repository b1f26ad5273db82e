//! A broker killed with SIGKILL in the middle of create, attach and close, many times over: the
//! next broker's `reconcile` leaves nothing orphaned and loses nothing. The stand-in broker is
//! `oab-k8s-fault-harness` (this crate's `testing` feature), with the broker's kubeconfig.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --all-features --test faults -- --ignored`.

mod common;

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{builder, AdminObject, WORKER_PROFILE};
use session_runtime::config::Reach;
use session_runtime::{
    CloseReason, CreateOptions, Error, Retention, RetentionPolicy, SessionIdentity, SessionRuntime,
    SessionState,
};
use test_cluster::k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use test_cluster::kube::api::ListParams;
use test_cluster::kube::{Api, ResourceExt};
use test_cluster::{unique_name, wait_until, TestCluster};

const THREADS: u64 = 3;

/// Phases, how many kills each, and the longest delay from the operation's start to the kill.
const PLAN: [(&str, usize, u64); 3] = [("create", 8, 60), ("close", 8, 400), ("attach", 3, 3000)];

struct Harness {
    child: Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

impl Harness {
    fn start(cluster: &TestCluster, profile: &str, installation: &str, phase: &str, seed: u64) -> Harness {
        let kubeconfig = std::env::var("OPENAB_BROKER_KUBECONFIG")
            .expect("scripts/cluster env sets OPENAB_BROKER_KUBECONFIG");
        let mut child = Command::new(env!("CARGO_BIN_EXE_oab-k8s-fault-harness"))
            .args([
                cluster.sessions_namespace(),
                profile,
                installation,
                phase,
                &seed.to_string(),
            ])
            .env("KUBECONFIG", kubeconfig)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the harness");
        let lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        Harness { child, lines }
    }

    /// Reads until the harness announces `phase`; panics on a failed step.
    fn until_start_of(&mut self, phase: &str) {
        let wanted = format!("{phase} start ");
        loop {
            let line = self
                .lines
                .next()
                .expect("the harness ended early")
                .expect("read the harness");
            assert!(!line.starts_with("failed"), "the harness failed: {line}");
            if line.starts_with(&wanted) {
                return;
            }
        }
    }

    /// Lets the announced operation run for `delay`, then kills the process. Returns whether
    /// the operation was still running when the kill landed.
    fn kill_after(mut self, phase: &str, delay: Duration) -> bool {
        let stdin = self.child.stdin.as_mut().expect("stdin");
        stdin.write_all(b"g").expect("go ahead");
        stdin.flush().expect("flush");
        std::thread::sleep(delay);
        let pid = self.child.id().to_string();
        let killed = Command::new("kill").args(["-KILL", &pid]).status().expect("kill");
        assert!(killed.success());
        let _ = self.child.wait();
        // What it printed before it died: was the operation done?
        let done = format!("{phase} done ");
        !self
            .lines
            .map_while(Result::ok)
            .any(|line| line.starts_with(&done))
    }
}

/// xorshift64, seeded from the clock; the seed is printed for a rerun.
fn next(state: &mut u64) -> u64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    *state
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test --all-features -- --ignored"]
async fn a_broker_killed_mid_create_attach_or_close_leaves_nothing_orphaned_and_nothing_lost() {
    let installation = unique_name("faults");
    let cluster = TestCluster::connect().await;
    let profile = AdminObject::profile(&cluster, &installation, WORKER_PROFILE).await;
    let mut state = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |elapsed| elapsed.as_nanos() as u64 | 1);
    eprintln!("fault seed {state}");

    let mut mid_operation = Vec::new();
    for (phase, kills, longest) in PLAN {
        let mut landed = 0;
        for _ in 0..kills {
            let seed = next(&mut state);
            let delay = Duration::from_millis(next(&mut state) % longest);
            let phase_owned = phase.to_owned();
            let (name, installation_owned) = (profile.name().to_owned(), installation.clone());
            let namespace_cluster = TestCluster::connect().await;
            let was_mid = tokio::task::spawn_blocking(move || {
                let mut harness =
                    Harness::start(&namespace_cluster, &name, &installation_owned, &phase_owned, seed);
                harness.until_start_of(&phase_owned);
                harness.kill_after(&phase_owned, delay)
            })
            .await
            .expect("the harness thread");
            landed += usize::from(was_mid);
        }
        mid_operation.push((phase, landed, kills));
    }
    eprintln!("kills that landed mid-operation (phase, landed, kills): {mid_operation:?}");
    let (_, create_landed, _) = mid_operation[0];
    let (_, close_landed, _) = mid_operation[1];
    assert!(
        create_landed + close_landed > 0,
        "no kill landed inside an operation: the test proved nothing"
    );

    // The next broker.
    let mut retention = RetentionPolicy::default();
    retention.ended = Retention::Retain;
    retention.retain_for = Some(Duration::from_secs(2));
    let broker = builder(&cluster, &profile, Reach::Exec, &installation)
        .retention(retention)
        .orphan_grace(Duration::ZERO)
        .build()
        .expect("runtime");
    let report = broker.reconcile().await.expect("reconcile");
    assert!(report.errors.is_empty(), "{report:?}");
    assert!(
        report.orphaned_storage.is_empty(),
        "every claim is named by a record: {report:?}"
    );
    let again = broker.reconcile().await.expect("reconcile");
    assert!(
        again.killed_workers.is_empty() && again.finished_closes.is_empty() && again.errors.is_empty(),
        "one pass fixes everything: {again:?}"
    );

    let pods: Api<Pod> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
    let selector = ListParams::default().labels(&format!("openab.dev/installation={installation}"));
    let threads: Vec<SessionIdentity> = (0..THREADS)
        .map(|t| SessionIdentity::new(&installation, "agent", "faults", format!("t{t}")).expect("identity"))
        .collect();
    for identity in &threads {
        let id = identity.id();
        match broker.status(&id).await {
            Ok(status) => {
                assert_ne!(
                    status.state,
                    SessionState::Closing,
                    "{id}: a close left unfinished"
                );
                let worker = pods.get_opt(&format!("oab-w-{id}")).await.expect("read");
                let live_worker = worker.filter(|pod| pod.metadata.deletion_timestamp.is_none());
                if status.state != SessionState::Running {
                    assert!(
                        live_worker.is_none(),
                        "{id}: a worker outlived its {} session",
                        status.state
                    );
                }
            }
            Err(Error::NotFound { .. }) => {}
            Err(other) => panic!("{id}: unreadable after the kills: {other}"),
        }
        // Nothing lost: every thread's session can be created (or found) and used again.
        let handle = broker
            .create(identity, &CreateOptions::new())
            .await
            .expect("create after the kills");
        assert_eq!(handle.id, id);
        broker
            .close(&id, CloseReason::Reset)
            .await
            .expect("close after the kills");
    }

    // Once the retained volumes' time is up, nothing of the installation is left but the
    // closed records, and every claim is gone.
    wait_until(
        "every claim of the installation to go",
        Duration::from_secs(60),
        || async {
            let report = broker.reconcile().await.expect("reconcile");
            assert!(report.orphaned_storage.is_empty(), "{report:?}");
            let left: BTreeSet<String> = claims
                .list(&selector)
                .await
                .expect("list claims")
                .into_iter()
                .filter(|claim| claim.metadata.deletion_timestamp.is_none())
                .map(|claim| claim.name_any())
                .collect();
            left.is_empty().then_some(())
        },
    )
    .await;
}
