//! The contract's conformance suite against the real cluster: worker Pods of the worker image on
//! the real node, made by the broker's identity, reached over each reach.
//!
//! Run: `scripts/cluster up && eval "$(scripts/cluster env)" && cargo test -p runtime-kubernetes
//! --test conformance -- --ignored`.

use std::sync::Arc;

use runtime_kubernetes::profile::PROFILE_KEY;
use runtime_kubernetes::KubernetesRuntime;
use session_runtime::config::{KubernetesConfig, Reach};
use session_runtime::conformance::{run_all, Target, BEHAVIOURS};
use test_cluster::k8s_openapi::api::core::v1::ConfigMap;
use test_cluster::kube::api::{DeleteParams, ObjectMeta, PostParams};
use test_cluster::kube::Api;
use test_cluster::TestCluster;

/// A profile for the conformance run: the worker image with the ACP test agent behind the relay.
const PROFILE: &str = r#"
image = "openab.dev/worker:test"
image_pull_policy = "Never"
agent = ["/usr/local/bin/acp-test-agent"]
termination_grace = "2s"

[resources]
memory_limit = "256Mi"

[storage]
kind = "per-session"
class = "openab-test-local"
size = "1Gi"
"#;

/// An administrator's profile ConfigMap, removed when dropped.
struct Profile {
    maps: Api<ConfigMap>,
    name: String,
}

impl Profile {
    async fn install(cluster: &TestCluster, name: &str) -> Profile {
        let maps: Api<ConfigMap> = Api::namespaced(cluster.admin(), cluster.sessions_namespace());
        let map = ConfigMap {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                ..ObjectMeta::default()
            },
            data: Some([(PROFILE_KEY.to_owned(), PROFILE.to_owned())].into()),
            ..ConfigMap::default()
        };
        let _ = maps.delete(name, &DeleteParams::default()).await;
        maps.create(&PostParams::default(), &map)
            .await
            .expect("install the profile");
        Profile {
            maps,
            name: name.to_owned(),
        }
    }
}

impl Drop for Profile {
    fn drop(&mut self) {
        let (maps, name) = (self.maps.clone(), self.name.clone());
        // The test's runtime is single-threaded and busy dropping: delete from a thread of its own.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime
                .block_on(maps.delete(&name, &DeleteParams::default()))
                .ok()
        })
        .join();
    }
}

async fn conformance(reach: Reach, installation: &str) {
    let cluster = TestCluster::connect().await;
    let profile = Profile::install(&cluster, installation).await;
    let mut config = KubernetesConfig::new(cluster.sessions_namespace(), profile.name.clone());
    config.reach = reach;
    let runtime = Arc::new(
        KubernetesRuntime::builder(cluster.broker(), config)
            .installation(installation)
            .build()
            .expect("a runtime"),
    );
    let target = Target::new(Arc::<KubernetesRuntime>::clone(&runtime), installation).with_faults(Arc::<
        KubernetesRuntime,
    >::clone(
        &runtime
    ));
    let report = run_all(&target).await;
    assert!(
        report.skipped.is_empty(),
        "nothing may be skipped: {:?}",
        report.skipped
    );
    assert_eq!(report.passed, BEHAVIOURS, "every behaviour must run, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn kubernetes_runtime_over_exec_passes_every_behaviour() {
    conformance(Reach::Exec, "conformance-exec").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a cluster with a real node: scripts/cluster up, then cargo test -- --ignored"]
async fn kubernetes_runtime_over_the_pod_ip_passes_every_behaviour() {
    conformance(Reach::PodIp, "conformance-pod-ip").await;
}
