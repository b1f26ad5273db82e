//! Why a worker Pod did not start, in the contract's terms and the Pod's own words.

use k8s_openapi::api::core::v1::Pod;
use session_runtime::{WorkerExit, WorkerFailure};

/// Where a starting Pod is.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Progress {
    /// Ready to connect to: the relay's container runs and the Pod has its IP. The relay may
    /// take a moment more to listen; the broker's first connection retries until it does,
    /// instead of waiting for the kubelet's next readiness probe and status update (most of a
    /// second per start).
    Ready,
    /// Still starting (scheduling, pulling, creating).
    Starting,
    /// Not scheduled yet, in the scheduler's words. It may still be (a claim being bound, a node
    /// being added), so it is the failure only once the start timeout passes.
    Unschedulable(String),
    /// It will not become ready: the classified reason.
    Failed(WorkerFailure),
}

/// Classifies a worker Pod's status. A waiting reason that a retry of the kubelet cannot fix
/// (a missing image, a bad container config) fails at once rather than at the start timeout.
pub(crate) fn progress(pod: &Pod) -> Progress {
    let Some(status) = &pod.status else {
        return Progress::Starting;
    };
    if status.reason.as_deref() == Some("Evicted") {
        return Progress::Failed(WorkerFailure::Evicted(status.message.clone().unwrap_or_default()));
    }
    // The init container (`prepare`) first: until it ends, the worker container has no status.
    let init = status.init_container_statuses.as_deref().unwrap_or_default();
    let main = status.container_statuses.as_deref().unwrap_or_default();
    for container in init.iter().chain(main) {
        let Some(state) = &container.state else {
            continue;
        };
        if let Some(terminated) = &state.terminated {
            let is_init = init.iter().any(|i| i.name == container.name);
            if is_init && terminated.exit_code == 0 {
                continue;
            }
            return Progress::Failed(match terminated.reason.as_deref() {
                Some("OOMKilled") => WorkerFailure::OutOfMemory,
                _ if terminated.exit_code > 128 && terminated.signal.is_none() => {
                    WorkerFailure::Exited(WorkerExit::Signal(terminated.exit_code - 128))
                }
                _ => WorkerFailure::Exited(match terminated.signal {
                    Some(signal) => WorkerExit::Signal(signal),
                    None => WorkerExit::Code(terminated.exit_code),
                }),
            });
        }
        if let Some(waiting) = &state.waiting {
            let said = || {
                format!(
                    "{} ({}): {}",
                    waiting.reason.as_deref().unwrap_or("waiting"),
                    container.name,
                    waiting.message.as_deref().unwrap_or("no message")
                )
            };
            match waiting.reason.as_deref() {
                Some("ErrImageNeverPull" | "ErrImagePull" | "ImagePullBackOff" | "InvalidImageName") => {
                    return Progress::Failed(WorkerFailure::ImagePull(said()))
                }
                Some("CreateContainerConfigError" | "CreateContainerError" | "RunContainerError") => {
                    return Progress::Failed(WorkerFailure::Spawn(said()))
                }
                _ => {}
            }
        }
    }
    if status.phase.as_deref() == Some("Failed") {
        return Progress::Failed(WorkerFailure::Exited(WorkerExit::Unknown));
    }
    let conditions = status.conditions.as_deref().unwrap_or_default();
    if let Some(unschedulable) = conditions.iter().find(|c| {
        c.type_ == "PodScheduled" && c.status == "False" && c.reason.as_deref() == Some("Unschedulable")
    }) {
        return Progress::Unschedulable(unschedulable.message.clone().unwrap_or_default());
    }
    let running = main
        .iter()
        .any(|c| c.name == crate::pod::CONTAINER && c.state.as_ref().is_some_and(|s| s.running.is_some()));
    let ready = conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    if ready || (running && status.pod_ip.is_some()) {
        return Progress::Ready;
    }
    Progress::Starting
}

/// Whether the kubelet has yet to make the Pod's sandbox (its network and pause container): the
/// condition `PodReadyToStartContainers` is not `True`. Only then can a sandbox failure the
/// kubelet reported be why the Pod did not start (an earlier failure it recovered from is not).
pub(crate) fn sandbox_missing(pod: &Pod) -> bool {
    let conditions = pod
        .status
        .as_ref()
        .and_then(|status| status.conditions.as_deref());
    !conditions
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "PodReadyToStartContainers" && c.status == "True")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({ "metadata": {}, "status": status })).expect("a Pod")
    }

    #[test]
    fn each_kubelet_reason_maps_to_its_kind() {
        let waiting = |reason: &str| {
            pod(serde_json::json!({ "containerStatuses": [{
                "name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": { "waiting": { "reason": reason, "message": "said" } } }] }))
        };
        assert!(
            matches!(progress(&waiting("ErrImageNeverPull")), Progress::Failed(WorkerFailure::ImagePull(m)) if m.contains("said"))
        );
        assert!(matches!(
            progress(&waiting("CreateContainerConfigError")),
            Progress::Failed(WorkerFailure::Spawn(_))
        ));
        assert_eq!(progress(&waiting("ContainerCreating")), Progress::Starting);
        let init_waiting = pod(serde_json::json!({ "initContainerStatuses": [{
            "name": "prepare", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": { "waiting": { "reason": "ErrImageNeverPull", "message": "absent" } } }] }));
        assert!(
            matches!(progress(&init_waiting), Progress::Failed(WorkerFailure::ImagePull(m)) if m.contains("prepare"))
        );
        let init_done = pod(serde_json::json!({ "initContainerStatuses": [{
            "name": "prepare", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
            "state": { "terminated": { "exitCode": 0, "reason": "Completed" } } }] }));
        assert_eq!(progress(&init_done), Progress::Starting);

        let terminated = |reason: &str, code: i32| {
            pod(serde_json::json!({ "phase": "Failed", "containerStatuses": [{
                "name": "worker", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                "state": { "terminated": { "reason": reason, "exitCode": code } } }] }))
        };
        assert_eq!(
            progress(&terminated("OOMKilled", 137)),
            Progress::Failed(WorkerFailure::OutOfMemory)
        );
        assert_eq!(
            progress(&terminated("Error", 3)),
            Progress::Failed(WorkerFailure::Exited(WorkerExit::Code(3)))
        );
        assert_eq!(
            progress(&terminated("Error", 143)),
            Progress::Failed(WorkerFailure::Exited(WorkerExit::Signal(15)))
        );
        let unschedulable = pod(serde_json::json!({ "phase": "Pending", "conditions": [
            { "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/4 nodes" }] }));
        assert_eq!(
            progress(&unschedulable),
            Progress::Unschedulable("0/4 nodes".to_owned())
        );
        let ready = pod(
            serde_json::json!({ "phase": "Running", "conditions": [{ "type": "Ready", "status": "True" }] }),
        );
        assert_eq!(progress(&ready), Progress::Ready);
        let evicted = pod(serde_json::json!({ "phase": "Failed", "reason": "Evicted", "message": "disk" }));
        assert!(matches!(progress(&evicted), Progress::Failed(WorkerFailure::Evicted(m)) if m == "disk"));
    }

    #[test]
    fn a_sandbox_is_missing_until_the_pod_is_ready_to_start_containers() {
        let with = |status: &str| {
            pod(serde_json::json!({ "conditions": [
                { "type": "PodReadyToStartContainers", "status": status }] }))
        };
        assert!(sandbox_missing(&with("False")));
        assert!(sandbox_missing(&pod(serde_json::json!({}))));
        assert!(!sandbox_missing(&with("True")));
    }
}
