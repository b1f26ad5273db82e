//! A session overlay is refused by name before the Kubernetes runtime calls the API server: the
//! relay's hello carries no working directory or environment, and a value in a Pod's spec would
//! be readable by whoever can read Pods. Runs without a cluster: the client points at a port
//! where nothing listens, so any request would fail as a backend error instead.

use runtime_kubernetes::KubernetesRuntime;
use session_runtime::config::KubernetesConfig;
use session_runtime::overlay::{ENV_FIELD, WORKING_DIR_FIELD};
use session_runtime::{CreateOptions, Error, SessionIdentity, SessionOverlay, SessionRuntime};

#[tokio::test]
async fn an_overlay_is_unsupported_by_name_before_any_request() {
    let unreachable = "http://127.0.0.1:9".parse().expect("a URI");
    let client =
        test_cluster::kube::Client::try_from(test_cluster::kube::Config::new(unreachable)).expect("a client");
    let runtime = KubernetesRuntime::builder(client, KubernetesConfig::new("sessions", "profile"))
        .installation("overlay")
        .build()
        .expect("the runtime builds without the API server");
    assert!(!runtime.capabilities().overlay);
    let identity = SessionIdentity::new("overlay", "agent", "discord", "1").expect("identity");
    for (overlay, field) in [
        (
            SessionOverlay::new().working_dir("project").env("TOKEN", "t"),
            WORKING_DIR_FIELD,
        ),
        (SessionOverlay::new().env("TOKEN", "t"), ENV_FIELD),
    ] {
        let options = CreateOptions::new().with_overlay(overlay);
        match runtime.create(&identity, &options).await {
            Err(Error::Unsupported { operation, runtime }) => {
                assert_eq!((operation, runtime), (field, "kubernetes"))
            }
            other => panic!("expected Unsupported naming {field}, got {other:?}"),
        }
    }
}
