//! One reconcile pass: make what runs match the anchors.
//!
//! Level-triggered: each pass reads every anchor and worker Pod of the installation and fixes
//! what differs, so a pass that was interrupted is simply continued by the next.

use std::collections::BTreeSet;
use std::time::Duration;

use kube::api::ListParams;
use kube::ResourceExt;
use session_runtime::{ReconcileReport, Result, SessionId};

use crate::api::api_error;
use crate::names;
use crate::runtime::KubernetesRuntime;

/// A worker Pod without an anchor is left this long: its anchor may be a create in flight.
const ORPHAN_GRACE: Duration = Duration::from_secs(60);

pub(crate) async fn run(runtime: &KubernetesRuntime) -> Result<ReconcileReport> {
    let mut report = ReconcileReport::default();
    let anchored: BTreeSet<SessionId> = runtime.anchor_ids().await?.into_iter().collect();
    for id in &anchored {
        if let Err(error) = runtime.reconcile_session(id, &mut report).await {
            report.errors.push(format!("session {id}: {error}"));
        }
    }
    // Workers whose session has no anchor: their owner reference lets the garbage collector take
    // them once the anchor is gone, but a Pod made by a broker killed before its anchor existed
    // has none to follow.
    let params = ListParams::default().labels(&format!(
        "{},{}=worker",
        names::installation_selector(runtime.installation()),
        names::ROLE
    ));
    let pods = runtime
        .pods()
        .list(&params)
        .await
        .map_err(|e| api_error("listing worker Pods", e))?;
    let now = k8s_openapi::jiff::Timestamp::now();
    for pod in pods {
        let Some(id) = pod
            .labels()
            .get(names::SESSION)
            .and_then(|v| SessionId::parse(v).ok())
        else {
            continue;
        };
        let terminating = pod.metadata.deletion_timestamp.is_some();
        if terminating || anchored.contains(&id) || !names::belongs_to(&pod.metadata, &id) {
            continue;
        }
        let old_enough =
            pod.metadata.creation_timestamp.as_ref().is_some_and(|created| {
                now.duration_since(created.0).as_secs() >= ORPHAN_GRACE.as_secs() as i64
            });
        if !old_enough {
            continue;
        }
        let name = pod.name_any();
        match runtime
            .pods()
            .delete(
                &name,
                &kube::api::DeleteParams {
                    grace_period_seconds: Some(1),
                    preconditions: Some(kube::api::Preconditions {
                        uid: pod.uid(),
                        resource_version: None,
                    }),
                    ..kube::api::DeleteParams::default()
                },
            )
            .await
        {
            Ok(_) => report.killed_workers.push((id, format!("pod/{name}"))),
            Err(error) => report.errors.push(format!("orphaned worker {name}: {error}")),
        }
    }
    Ok(report)
}
