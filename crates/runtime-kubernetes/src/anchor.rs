//! The session's anchor: an `OabSession` (openab.dev/v1alpha1) named `oab-s-<session id>` in the
//! sessions namespace, one per session of an installation.
//!
//! Its `spec` is what never changes for the session id: the installation and the digest of the
//! identity (the full-hash check that refuses to adopt a colliding id). Its `status` holds the
//! session record (`record.rs`) and, derived from it on every write, what an operator reads:
//! the phase, generation, worker, storage and last activity (the printer columns), and the
//! conditions `Ready`, `Suspended` and `Closing`, always all three, so `kubectl wait` works.
//!
//! Every change of the record is a compare-and-swap of the status on the object's
//! `resourceVersion`. A create writes the object alone (the status subresource ignores a status
//! sent with it); its first status write is the create's first record change. An anchor without
//! a status is therefore a create that recorded nothing yet: it names no volume, and what it may
//! own (the session's ServiceAccount, a seed Job) goes with it when it is deleted.
//!
//! The finalizer [`CLOSE_FINALIZER`] turns `kubectl delete oabsession` into a close with reason
//! `ended`: the controller closes the session, applies retention, and removes the finalizer once
//! the record holds nothing (a volume kept by retention holds it until the retention ends).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{CustomResource, Resource, ResourceExt};
use schemars::{json_schema, Schema, SchemaGenerator};
use serde::{Deserialize, Serialize};
use session_runtime::{Error, SessionId, SessionState, StorageState};

use crate::{
    names,
    record::{Phase, SessionRecord, Volume},
    RUNTIME,
};

/// The finalizer by which the controller closes a session whose anchor an operator deleted.
pub const CLOSE_FINALIZER: &str = "openab.dev/close";

/// What never changes for a session id.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[allow(
    clippy::duplicated_attributes,
    reason = "each printcolumn names its type; clippy reads them as one attribute repeated"
)]
#[kube(
    group = "openab.dev",
    version = "v1alpha1",
    kind = "OabSession",
    plural = "oabsessions",
    shortname = "oabs",
    category = "openab",
    namespaced,
    status = "OabSessionStatus",
    doc = "An OpenAB session of a chat thread: its record, worker and storage (written by the runtime; delete it to close the session)",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Generation", type_ = "integer", json_path = ".status.generation"),
    printcolumn(name = "Worker", type_ = "string", json_path = ".status.worker"),
    printcolumn(name = "Storage", type_ = "string", json_path = ".status.storage"),
    printcolumn(name = "Idle", type_ = "date", json_path = ".status.lastActivity"),
    printcolumn(name = "Age", type_ = "date", json_path = ".metadata.creationTimestamp")
)]
#[schemars(extend("x-kubernetes-validations" = [
    { "rule": "self == oldSelf", "message": "a session's spec is fixed when it is created" }
]))]
#[serde(rename_all = "camelCase")]
pub struct OabSessionSpec {
    /// The installation (the broker's `[session_runtime] installation`) the session belongs to.
    #[schemars(length(max = 253))]
    pub installation: String,
    /// Hex SHA-256 of the session identity's canonical encoding: proves the identity without
    /// holding the thread id.
    #[schemars(regex(pattern = "^[0-9a-f]{64}$"))]
    pub identity_digest: String,
}

/// The session as the runtime last recorded it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OabSessionStatus {
    /// `Provisioning`, `Created`, `Running`, `Suspended`, `Closing` or `Closed`.
    pub phase: String,
    /// The current worker generation: a worker of an older one is fenced.
    pub generation: u64,
    /// The worker Pod of the current generation, while the session is running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    /// The session's volume (`ephemeral`, or the claim's name) and, when it is not simply
    /// present, what became of it.
    pub storage: String,
    /// The last activity the record knows of (RFC 3339).
    pub last_activity: String,
    /// The last renewal by a broker holding a live attachment (RFC 3339): a live session is
    /// not idle even when its record does not change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<String>,
    /// The session a copy of this one's storage is being taken for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lent_to: Option<String>,
    /// `Ready`, `Suspended` and `Closing`, always all three.
    pub conditions: Vec<SessionCondition>,
    /// The runtime's record, versioned and checked by the runtime when it reads it.
    #[schemars(schema_with = "preserved_object")]
    pub record: serde_json::Value,
}

/// A condition in the form `kubectl wait --for=condition=...` reads.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionCondition {
    /// `Ready`, `Suspended` or `Closing`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `True` or `False`.
    pub status: String,
    /// Why, in one CamelCase word: the phase, the suspend or close reason, `WorkerServing`.
    pub reason: String,
    /// The detail: a start failure, what a close did with the storage.
    #[serde(default)]
    pub message: String,
    /// When `status` last changed (RFC 3339).
    pub last_transition_time: String,
}

/// The definition the chart installs (`crds/oabsessions.yaml`, written by
/// `cargo run -p runtime-kubernetes --example oabsession-crd`): the derived one, labelled as part
/// of OpenAB like the chart's other objects.
pub fn definition(
) -> k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
    use kube::CustomResourceExt;
    let mut crd = OabSession::crd();
    crd.metadata
        .labels
        .get_or_insert_with(Default::default)
        .insert("app.kubernetes.io/part-of".to_owned(), "openab".to_owned());
    crd
}

fn preserved_object(_: &mut SchemaGenerator) -> Schema {
    json_schema!({ "type": "object", "x-kubernetes-preserve-unknown-fields": true })
}

impl OabSession {
    /// A new anchor for session `id`, with the close finalizer.
    pub(crate) fn for_session(installation: &str, id: &SessionId, identity_digest: &str) -> Self {
        let mut metadata = names::meta(names::anchor(id), installation, id, "anchor");
        metadata.finalizers = Some(vec![CLOSE_FINALIZER.to_owned()]);
        OabSession {
            metadata,
            spec: OabSessionSpec {
                installation: installation.to_owned(),
                identity_digest: identity_digest.to_owned(),
            },
            status: None,
        }
    }

    /// The record in the status, checked to be the session's; `None` before the first write.
    ///
    /// # Errors
    /// [`Error::Backend`] (not retryable) when the record does not parse, has an unknown
    /// version, names another session, or holds another identity than the spec.
    pub(crate) fn record(&self, id: &SessionId) -> Result<Option<SessionRecord>, Error> {
        let Some(status) = &self.status else {
            return Ok(None);
        };
        let record = SessionRecord::from_value(id, status.record.clone())?;
        if record.identity_digest != self.spec.identity_digest {
            return Err(Error::Backend {
                runtime: RUNTIME,
                retryable: false,
                message: format!("session {id}: the anchor's record holds another identity than its spec"),
                source: None,
            });
        }
        Ok(Some(record))
    }

    /// Whether an operator (or anyone) asked for the anchor's deletion.
    pub(crate) fn is_deleted(&self) -> bool {
        self.metadata.deletion_timestamp.is_some()
    }

    /// Whether the close finalizer is still on the anchor.
    pub(crate) fn has_close_finalizer(&self) -> bool {
        self.finalizers().iter().any(|f| f == CLOSE_FINALIZER)
    }

    /// The anchor with `record` as its status, the summary derived from it, and `renewed`
    /// (RFC 3339) as the renewal time. Conditions keep their transition time when unchanged.
    pub(crate) fn with_record(&self, record: &SessionRecord, renewed: &str) -> OabSession {
        let mut next = self.clone();
        let previous = self
            .status
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or_default();
        next.status = Some(OabSessionStatus {
            phase: phase_name(record.phase),
            generation: record.generation,
            worker: record
                .worker
                .as_ref()
                .filter(|_| record.state() == SessionState::Running)
                .map(|_| record.worker_pod()),
            storage: storage_summary(record),
            last_activity: rfc3339(record.last_activity),
            renew_time: Some(renewed.to_owned()),
            lent_to: record.lent_to.as_ref().map(|loan| loan.to.to_string()),
            conditions: conditions(record, previous, renewed),
            record: record.to_value(),
        });
        next
    }

    /// The owner reference of the objects the session makes (Pods, Jobs, ServiceAccounts), so a
    /// deleted anchor takes them along. Not blockOwnerDeletion: that needs update on the
    /// anchor's finalizers for whoever creates the object, a right the broker does not need.
    pub(crate) fn owner_reference(id: &SessionId, anchor_uid: &str) -> OwnerReference {
        OwnerReference {
            api_version: OabSession::api_version(&()).into_owned(),
            kind: OabSession::kind(&()).into_owned(),
            name: names::anchor(id),
            uid: anchor_uid.to_owned(),
            controller: Some(true),
            block_owner_deletion: None,
        }
    }
}

/// `Provisioning`, or the contract state capitalized (`Running`).
fn phase_name(phase: Phase) -> String {
    match phase {
        Phase::Provisioning => "Provisioning".to_owned(),
        Phase::Session(state) => camel(state.as_str()),
    }
}

fn storage_summary(record: &SessionRecord) -> String {
    let name = match &record.volume {
        Volume::Ephemeral => return "ephemeral".to_owned(),
        Volume::Owned { claim, .. } => claim.clone(),
        Volume::Borrowed { claim } => format!("{claim} (borrowed)"),
    };
    match record.storage() {
        StorageState::Retained { .. } => format!("{name} (retained)"),
        StorageState::Deleted => format!("{name} (deleted)"),
        StorageState::Lost => format!("{name} (lost)"),
        _ => name,
    }
}

fn conditions(record: &SessionRecord, previous: &[SessionCondition], now: &str) -> Vec<SessionCondition> {
    let state = record.state();
    let ready = state == SessionState::Running && record.worker.as_ref().is_some_and(|w| w.pod_uid.is_some());
    let suspended = state == SessionState::Suspended;
    let closing = matches!(state, SessionState::Closing | SessionState::Closed);
    let phase = phase_name(record.phase);
    let ready_reason = if ready {
        "WorkerServing".to_owned()
    } else {
        phase.clone()
    };
    let suspended_reason = match (&record.suspend_reason, suspended) {
        (Some(reason), true) => camel(reason.as_str()),
        _ => phase.clone(),
    };
    let (closing_reason, closing_message) = match (&record.close, closing) {
        (Some(close), true) => (
            camel(close.reason.as_str()),
            format!("closed ({}); storage: {}", close.reason, storage_summary(record)),
        ),
        _ => (phase, String::new()),
    };
    let ready_message = match (&record.last_start_failure, ready) {
        (Some(failed), false) => format!("generation {}: {}", failed.generation, failed.error),
        _ => String::new(),
    };
    [
        ("Ready", ready, ready_reason, ready_message),
        ("Suspended", suspended, suspended_reason, String::new()),
        ("Closing", closing, closing_reason, closing_message),
    ]
    .into_iter()
    .map(|(type_, on, reason, message)| {
        let status = if on { "True" } else { "False" }.to_owned();
        let last_transition_time = previous
            .iter()
            .find(|c| c.type_ == type_ && c.status == status)
            .map_or_else(|| now.to_owned(), |c| c.last_transition_time.clone());
        SessionCondition {
            type_: type_.to_owned(),
            status,
            reason,
            message,
            last_transition_time,
        }
    })
    .collect()
}

/// `ended` → `Ended`.
fn camel(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// Seconds since the epoch as RFC 3339.
fn rfc3339(seconds: u64) -> String {
    i64::try_from(seconds)
        .ok()
        .and_then(|s| k8s_openapi::jiff::Timestamp::from_second(s).ok())
        .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH)
        .to_string()
}

/// The seconds since the epoch of an RFC 3339 time written by [`rfc3339`] or a renewal.
pub(crate) fn seconds_of(time: &str) -> Option<u64> {
    let at: k8s_openapi::jiff::Timestamp = time.parse().ok()?;
    u64::try_from(at.as_second()).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::CustomResourceExt;
    use session_runtime::{CloseReason, Retention, SuspendReason};

    use crate::record::CloseRecord;

    fn id() -> SessionId {
        session_runtime::SessionIdentity::new("discord", "agent", "guild", "thread")
            .expect("an identity")
            .id()
    }

    fn record() -> SessionRecord {
        SessionRecord::new(id(), "ab".repeat(32), 3, 1)
    }

    fn condition<'a>(anchor: &'a OabSession, type_: &str) -> &'a SessionCondition {
        let status = anchor.status.as_ref().expect("a status");
        status
            .conditions
            .iter()
            .find(|c| c.type_ == type_)
            .expect("the condition")
    }

    #[test]
    fn every_status_has_all_three_conditions_and_only_one_phase_is_true() {
        let anchor = OabSession::for_session("test", &id(), &"ab".repeat(32));
        let mut record = record();
        for (phase, true_one) in [
            (Phase::Provisioning, None),
            (Phase::Session(SessionState::Suspended), Some("Suspended")),
            (Phase::Session(SessionState::Closed), Some("Closing")),
        ] {
            record.phase = phase;
            let written = anchor.with_record(&record, "2026-12-04T00:00:00Z");
            let status = written.status.as_ref().expect("a status");
            let types: Vec<_> = status.conditions.iter().map(|c| c.type_.as_str()).collect();
            assert_eq!(types, ["Ready", "Suspended", "Closing"]);
            let on: Vec<_> = status
                .conditions
                .iter()
                .filter(|c| c.status == "True")
                .map(|c| c.type_.as_str())
                .collect();
            assert_eq!(on, true_one.into_iter().collect::<Vec<_>>(), "{phase:?}");
        }
    }

    #[test]
    fn a_condition_keeps_its_transition_time_until_its_status_changes() {
        let anchor = OabSession::for_session("test", &id(), &"ab".repeat(32));
        let mut record = record();
        record.phase = Phase::Session(SessionState::Suspended);
        record.suspend_reason = Some(SuspendReason::Idle);
        let first = anchor.with_record(&record, "2026-12-04T00:00:00Z");
        let again = first.with_record(&record, "2026-12-04T00:05:00Z");
        assert_eq!(
            condition(&again, "Suspended").last_transition_time,
            "2026-12-04T00:00:00Z"
        );
        assert_eq!(condition(&again, "Suspended").reason, "Idle");
        record.phase = Phase::Session(SessionState::Closed);
        record.close = Some(CloseRecord {
            reason: CloseReason::Ended,
            retention: Retention::Delete,
            retain_until: None,
            storage_done: true,
        });
        let closed = again.with_record(&record, "2026-12-04T00:09:00Z");
        assert_eq!(
            condition(&closed, "Suspended").last_transition_time,
            "2026-12-04T00:09:00Z"
        );
        assert_eq!(condition(&closed, "Closing").status, "True");
        assert_eq!(condition(&closed, "Closing").reason, "Ended");
    }

    #[test]
    fn the_record_reads_back_and_a_foreign_identity_is_refused() {
        let mut anchor = OabSession::for_session("test", &id(), &"ab".repeat(32));
        assert_eq!(
            anchor.record(&id()).expect("readable"),
            None,
            "no status: nothing recorded"
        );
        anchor = anchor.with_record(&record(), "2026-12-04T00:00:00Z");
        assert_eq!(anchor.record(&id()).expect("readable"), Some(record()));
        anchor.spec.identity_digest = "cd".repeat(32);
        let refused = anchor.record(&id()).expect_err("another identity");
        assert!(refused.to_string().contains("another identity"), "{refused}");
    }

    #[test]
    fn the_definition_has_the_columns_a_status_subresource_and_a_fixed_spec() {
        let crd = serde_json::to_value(OabSession::crd()).expect("serializable");
        let version = &crd["spec"]["versions"][0];
        let columns: Vec<_> = version["additionalPrinterColumns"]
            .as_array()
            .expect("columns")
            .iter()
            .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
            .collect();
        assert_eq!(
            columns,
            ["Phase", "Generation", "Worker", "Storage", "Idle", "Age"]
        );
        assert!(version["subresources"]["status"].is_object(), "{version}");
        let spec = &version["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(
            spec["x-kubernetes-validations"][0]["rule"], "self == oldSelf",
            "{spec}"
        );
    }

    #[test]
    fn the_charts_definition_is_the_derived_one() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/helm/openab-session-runtime/crds/oabsessions.yaml"
        );
        let text = std::fs::read_to_string(path).expect("the chart's definition");
        // YAML's comments, then JSON (which YAML includes).
        let json: String = text
            .lines()
            .filter(|line| !line.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n");
        let committed: serde_json::Value = serde_json::from_str(&json).expect("JSON after the comments");
        let derived = serde_json::to_value(definition()).expect("serializable");
        assert!(
            committed == derived,
            "{path} is not the derived definition: run scripts/chart render"
        );
    }

    #[test]
    fn times_round_trip_through_rfc3339() {
        assert_eq!(rfc3339(1_796_342_400), "2026-12-04T00:00:00Z");
        assert_eq!(seconds_of("2026-12-04T00:00:00Z"), Some(1_796_342_400));
        assert_eq!(seconds_of("2026-12-04T00:00:00.123456Z"), Some(1_796_342_400));
        assert_eq!(seconds_of("yesterday"), None);
    }
}
