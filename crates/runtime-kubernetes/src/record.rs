//! The session record, kept in the status of the session's anchor (`anchor.rs`).
//!
//! The anchor is the authority on a session: its state, generation and incarnation, why it was
//! suspended or closed, what happens to its storage, and the UIDs of the objects it made (the
//! evidence that lets a delete carry a UID precondition). Every change is a compare-and-swap on
//! the anchor's `resourceVersion`, so two brokers never both win a generation.
//!
//! A record read from the API server is untrusted: it must parse, have a known version and name
//! the session whose anchor holds it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use session_runtime::{
    CloseReason, Error, Generation, ReconcileAction, RetainedUntil, Retention, SessionId, SessionState,
    SessionStatus, StartFailure, StorageState, SuspendReason, WorkerInfo,
};

use crate::{names, RUNTIME};

/// The record format this code writes and reads.
const VERSION: u32 = 1;

/// Where a session is, including the provisioning step before it is usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Phase {
    /// `create` made the anchor; storage may not exist yet.
    Provisioning,
    /// A contract state.
    #[serde(untagged)]
    Session(SessionState),
}

/// The volume a session uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub(crate) enum Volume {
    /// `emptyDir`: lives and dies with each worker Pod.
    Ephemeral,
    /// A claim this runtime created for the session; deletable only with this UID.
    Owned {
        /// The claim's name.
        claim: String,
        /// Its UID once created.
        uid: Option<String>,
    },
    /// A claim an administrator lends: never deleted.
    Borrowed {
        /// The claim's name.
        claim: String,
    },
}

impl Volume {
    pub(crate) fn claim(&self) -> Option<&str> {
        match self {
            Volume::Ephemeral => None,
            Volume::Owned { claim, .. } | Volume::Borrowed { claim } => Some(claim),
        }
    }
}

/// The worker Pod of the current generation, as recorded when it was started.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct WorkerRecord {
    pub(crate) generation: Generation,
    /// The Pod's UID once created.
    pub(crate) pod_uid: Option<String>,
    pub(crate) started_at: u64,
    /// The epoch of the broker that holds the worker's attachment: a broker with a newer epoch
    /// (and the same key) may take it over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) holder_epoch: Option<u64>,
    /// The Pod's name when it is not `oab-w-<session id>`: a warm pool member this generation
    /// claimed (a Pod's name cannot change). Written before the claim, so whoever reads the
    /// record finds the Pod; the Pod is the session's only once it carries the session's labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) pod: Option<String>,
}

/// What a close decided for the storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CloseRecord {
    pub(crate) reason: CloseReason,
    pub(crate) retention: Retention,
    /// Seconds since the epoch after which retained storage may go; `None` = forever.
    pub(crate) retain_until: Option<u64>,
    /// Whether the storage step of the close is done.
    pub(crate) storage_done: bool,
}

/// A claim that an earlier incarnation of the session kept by retention: the thread's next
/// session got a volume of its own, and this one stays until `until`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RetainedClaim {
    pub(crate) claim: String,
    pub(crate) uid: Option<String>,
    /// Seconds since the epoch after which it may go; `None` = forever.
    pub(crate) until: Option<u64>,
}

/// The workspace seed a create asked for, kept until the volume is seeded, so that whoever
/// finishes an interrupted create seeds it the same way. Untagged: records written before
/// copies existed hold the clone's fields alone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub(crate) enum SeedRecord {
    GitClone {
        git_url: String,
        git_reference: Option<String>,
    },
    CopyOf {
        copy_of: SessionId,
    },
}

/// A copy of this session's storage into another session's, in progress: attach is refused
/// until it ends, or until `until` (seconds since the epoch) when the copying broker vanished.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Loan {
    pub(crate) to: SessionId,
    pub(crate) until: u64,
}

impl Loan {
    pub(crate) fn active(&self) -> bool {
        self.until > now()
    }
}

/// An attach that could not start or reach its worker, as `status` reports it. Cleared by the
/// next worker that serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct FailedStart {
    pub(crate) at: u64,
    pub(crate) generation: Generation,
    pub(crate) error: String,
}

/// The session's volume, found gone without this runtime (deleted, being deleted, or replaced by
/// another claim of the same name). Permanent for the incarnation: a claim that reappears under
/// the name holds none of the session's data.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LostStorage {
    pub(crate) claim: String,
    /// When it was found, seconds since the epoch.
    pub(crate) at: u64,
    /// What was found, e.g. `deleted` or `being deleted`.
    pub(crate) what: String,
}

impl LostStorage {
    pub(crate) fn describe(&self) -> String {
        format!("persistentvolumeclaim/{} {}", self.claim, self.what)
    }
}

/// What the last reconcile pass did to the session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ReconcileNote {
    pub(crate) at: u64,
    pub(crate) action: String,
}

/// The session record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SessionRecord {
    version: u32,
    pub(crate) id: SessionId,
    /// Hex SHA-256 of the identity's canonical encoding: proves the identity without holding
    /// the thread id.
    pub(crate) identity_digest: String,
    pub(crate) phase: Phase,
    pub(crate) generation: Generation,
    /// Counts the sessions the thread has had under this id; names the volume.
    pub(crate) incarnation: u64,
    pub(crate) volume: Volume,
    pub(crate) worker: Option<WorkerRecord>,
    pub(crate) suspend_reason: Option<SuspendReason>,
    pub(crate) close: Option<CloseRecord>,
    pub(crate) created_at: u64,
    pub(crate) last_activity: u64,
    /// The profile version (the OabProfile's resourceVersion) the current worker was started with.
    pub(crate) profile_version: Option<String>,
    /// Retained claims of earlier incarnations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) retained: Vec<RetainedClaim>,
    /// When the session became closed (its record expires from then on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) closed_at: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_reconcile: Option<ReconcileNote>,
    /// The seed to apply while provisioning; `None` once applied, or when none was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) seed: Option<SeedRecord>,
    /// A copy of the storage being taken ([`SeedRecord::CopyOf`] of another session).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) lent_to: Option<Loan>,
    /// Whether the session's directories exist on its claim, with the worker's ownership: made
    /// by the seed Job or by a worker whose relay answered. Later workers then start without the
    /// `prepare` init container. Always `false` for ephemeral storage, which each Pod makes anew.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) prepared: bool,
    /// Whether the incarnation's own ServiceAccount was made (see `workload_identity.rs`);
    /// `false` for a session provisioned before sessions had one, whose next worker makes it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) service_account: bool,
    /// That ServiceAccount's UID, so a close deletes exactly it without reading it first;
    /// `None` for a session provisioned before the record kept it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) service_account_uid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) last_start_failure: Option<FailedStart>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) storage_lost: Option<LostStorage>,
}

pub(crate) fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

fn instant(seconds: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(seconds)
}

impl SessionRecord {
    pub(crate) fn new(
        id: SessionId,
        identity_digest: String,
        generation: Generation,
        incarnation: u64,
    ) -> Self {
        let now = now();
        SessionRecord {
            version: VERSION,
            id,
            identity_digest,
            phase: Phase::Provisioning,
            generation,
            incarnation,
            volume: Volume::Ephemeral,
            worker: None,
            suspend_reason: None,
            close: None,
            created_at: now,
            last_activity: now,
            profile_version: None,
            retained: Vec::new(),
            closed_at: None,
            last_reconcile: None,
            seed: None,
            lent_to: None,
            prepared: false,
            service_account: false,
            service_account_uid: None,
            last_start_failure: None,
            storage_lost: None,
        }
    }

    /// Reads the record from an anchor's status, checking that it is the session's.
    pub(crate) fn from_value(id: &SessionId, value: serde_json::Value) -> Result<Self, Error> {
        let unreadable = |why: String| Error::Backend {
            runtime: RUNTIME,
            retryable: false,
            message: format!("session {id}: the anchor's record is unreadable: {why}"),
            source: None,
        };
        let record: SessionRecord =
            serde_json::from_value(value).map_err(|error| unreadable(error.to_string()))?;
        if record.version != VERSION {
            return Err(unreadable(format!("unknown version {}", record.version)));
        }
        if record.id != *id {
            return Err(unreadable(format!("it names session {}", record.id)));
        }
        Ok(record)
    }

    /// The record of the thread's next session under the same id, after this closed one:
    /// generations keep growing, the new incarnation gets a volume of its own, and claims kept by
    /// retention stay on the record until they expire.
    pub(crate) fn next_incarnation(&self, identity_digest: String) -> SessionRecord {
        let mut next = SessionRecord::new(self.id, identity_digest, self.generation, self.incarnation + 1);
        next.retained = self.retained.clone();
        if let (Some(close), Volume::Owned { claim, uid }) = (&self.close, &self.volume) {
            if close.retention == Retention::Retain && self.storage_lost.is_none() {
                next.retained.push(RetainedClaim {
                    claim: claim.clone(),
                    uid: uid.clone(),
                    until: close.retain_until,
                });
            }
        }
        next
    }

    /// Every claim the record names: the current volume's and the retained ones.
    pub(crate) fn claims(&self) -> impl Iterator<Item = &str> {
        self.volume
            .claim()
            .into_iter()
            .chain(self.retained.iter().map(|kept| kept.claim.as_str()))
    }

    /// Whether the record still holds anything: a volume that retention keeps, or retained
    /// claims of earlier incarnations. A closed record that holds nothing may expire.
    pub(crate) fn holds_storage(&self) -> bool {
        let kept = matches!(
            self.storage(),
            StorageState::Retained { .. } | StorageState::Present
        ) && matches!(self.volume, Volume::Owned { .. });
        kept || !self.retained.is_empty()
    }

    pub(crate) fn to_value(&self) -> serde_json::Value {
        // Serializing plain data with string keys cannot fail.
        serde_json::to_value(self).unwrap_or_default()
    }

    /// The name of the current generation's worker Pod: the warm pool member it claimed, or
    /// `oab-w-<session id>` for a worker started cold.
    pub(crate) fn worker_pod(&self) -> String {
        self.worker
            .as_ref()
            .and_then(|worker| worker.pod.clone())
            .unwrap_or_else(|| names::worker(&self.id))
    }

    /// The name and UID of the current generation's worker Pod, once it served.
    pub(crate) fn served_worker(&self) -> Option<(String, String)> {
        let uid = self.worker.as_ref()?.pod_uid.clone()?;
        Some((self.worker_pod(), uid))
    }

    pub(crate) fn state(&self) -> SessionState {
        match self.phase {
            Phase::Provisioning => SessionState::Created,
            Phase::Session(state) => state,
        }
    }

    pub(crate) fn storage(&self) -> StorageState {
        if self.storage_lost.is_some() {
            return StorageState::Lost;
        }
        match self.close {
            Some(CloseRecord {
                retention: Retention::Retain,
                retain_until,
                ..
            }) if self.volume.claim().is_some() => StorageState::Retained {
                until: retain_until.map_or(RetainedUntil::Forever, |s| RetainedUntil::Until(instant(s))),
            },
            Some(CloseRecord {
                storage_done: true, ..
            }) => StorageState::Deleted,
            _ => StorageState::Present,
        }
    }

    pub(crate) fn status(&self) -> SessionStatus {
        let mut status = SessionStatus::new(self.id, instant(self.created_at));
        status.state = self.state();
        status.generation = self.generation;
        status.last_activity = instant(self.last_activity);
        status.storage = self.storage();
        status.suspend_reason = self.suspend_reason;
        status.close_reason = self.close.map(|close| close.reason);
        status.worker = self
            .worker
            .as_ref()
            .filter(|_| self.state() == SessionState::Running)
            .map(|worker| {
                WorkerInfo::new(
                    format!("pod/{}", self.worker_pod()),
                    worker.generation,
                    instant(worker.started_at),
                )
            });
        status.storage_refs = self
            .volume
            .claim()
            .map(|claim| match &self.storage_lost {
                Some(lost) => format!("{} (lost)", lost.describe()),
                None => format!("persistentvolumeclaim/{claim}"),
            })
            .into_iter()
            .chain(
                self.retained
                    .iter()
                    .map(|kept| format!("persistentvolumeclaim/{} (retained, earlier session)", kept.claim)),
            )
            .collect();
        status.last_reconcile = self
            .last_reconcile
            .as_ref()
            .map(|note| ReconcileAction::new(instant(note.at), note.action.clone()));
        status.last_start_failure = self
            .last_start_failure
            .as_ref()
            .map(|failed| StartFailure::new(instant(failed.at), failed.generation, failed.error.clone()));
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use session_runtime::SessionIdentity;

    fn record() -> SessionRecord {
        let identity = SessionIdentity::new("prod", "claude", "discord", "t").expect("identity");
        SessionRecord::new(identity.id(), "digest".to_owned(), 3, 1)
    }

    /// The record text as the status holds it; text that is not JSON stays a string.
    fn status_value(text: &str) -> serde_json::Value {
        serde_json::from_str(text).unwrap_or_else(|_| serde_json::Value::String(text.to_owned()))
    }

    #[test]
    fn a_clone_seed_written_before_copies_existed_still_reads_and_a_copy_round_trips() {
        let mut record = record();
        record.seed = Some(SeedRecord::GitClone {
            git_url: "https://example.invalid/repo".to_owned(),
            git_reference: None,
        });
        let mut json: serde_json::Value = serde_json::from_str(&record.to_value().to_string()).expect("json");
        assert_eq!(
            json["seed"],
            serde_json::json!({ "git_url": "https://example.invalid/repo", "git_reference": null }),
            "the clone's fields alone, as records written before copies existed hold them"
        );
        json["seed"] =
            serde_json::json!({ "git_url": "https://example.invalid/old", "git_reference": "main" });
        let old = SessionRecord::from_value(&record.id, status_value(&json.to_string())).expect("old");
        assert_eq!(
            old.seed,
            Some(SeedRecord::GitClone {
                git_url: "https://example.invalid/old".to_owned(),
                git_reference: Some("main".to_owned()),
            })
        );

        let source = SessionIdentity::new("prod", "claude", "discord", "source")
            .expect("identity")
            .id();
        record.seed = Some(SeedRecord::CopyOf { copy_of: source });
        record.lent_to = Some(Loan { to: source, until: 7 });
        let read = SessionRecord::from_value(&record.id, status_value(&record.to_value().to_string()))
            .expect("read");
        assert_eq!(read, record);
        assert!(
            !read.lent_to.expect("loan").active(),
            "a loan past its time has lapsed"
        );
    }

    #[test]
    fn a_record_round_trips_through_the_status() {
        let mut record = record();
        record.phase = Phase::Session(SessionState::Suspended);
        record.volume = Volume::Owned {
            claim: "oab-d-x-1".to_owned(),
            uid: Some("uid".to_owned()),
        };
        let read = SessionRecord::from_value(&record.id, status_value(&record.to_value().to_string()));
        assert_eq!(read.expect("readable"), record);
    }

    #[test]
    fn a_foreign_or_malformed_record_is_refused() {
        let record = record();
        let other = SessionIdentity::new("prod", "claude", "discord", "u")
            .expect("identity")
            .id();
        let text = record.to_value().to_string();
        assert!(SessionRecord::from_value(&other, status_value(&text)).is_err());
        assert!(SessionRecord::from_value(&record.id, status_value("{")).is_err());
        assert!(SessionRecord::from_value(&record.id, serde_json::Value::Null).is_err());
        let future = text.replace("\"version\":1", "\"version\":99");
        assert!(SessionRecord::from_value(&record.id, status_value(&future)).is_err());
    }

    #[test]
    fn storage_follows_the_close() {
        let mut record = record();
        record.volume = Volume::Owned {
            claim: "c".to_owned(),
            uid: None,
        };
        assert_eq!(record.storage(), StorageState::Present);
        record.close = Some(CloseRecord {
            reason: CloseReason::Reset,
            retention: Retention::Delete,
            retain_until: None,
            storage_done: true,
        });
        assert_eq!(record.storage(), StorageState::Deleted);
        record.close = Some(CloseRecord {
            reason: CloseReason::Ended,
            retention: Retention::Retain,
            retain_until: None,
            storage_done: true,
        });
        assert!(matches!(
            record.storage(),
            StorageState::Retained {
                until: RetainedUntil::Forever
            }
        ));
    }

    #[test]
    fn a_retained_claim_follows_the_thread_into_its_next_session() {
        let mut closed = record();
        closed.phase = Phase::Session(SessionState::Closed);
        closed.volume = Volume::Owned {
            claim: "oab-d-x-1".to_owned(),
            uid: Some("u1".to_owned()),
        };
        closed.close = Some(CloseRecord {
            reason: CloseReason::Ended,
            retention: Retention::Retain,
            retain_until: Some(99),
            storage_done: true,
        });
        assert!(closed.holds_storage());
        let next = closed.next_incarnation("digest".to_owned());
        assert_eq!((next.incarnation, next.generation), (2, closed.generation));
        assert_eq!(
            next.retained,
            [RetainedClaim {
                claim: "oab-d-x-1".to_owned(),
                uid: Some("u1".to_owned()),
                until: Some(99),
            }]
        );
        assert!(next.claims().any(|c| c == "oab-d-x-1"));
        // A deleted volume is not carried, and a record holding nothing may expire.
        closed.close = closed.close.map(|close| CloseRecord {
            retention: Retention::Delete,
            ..close
        });
        assert!(closed.next_incarnation("digest".to_owned()).retained.is_empty());
        assert!(!closed.holds_storage());
        // A record written before these fields existed still reads.
        let old = closed.to_value().to_string().replace(",\"closed_at\":null", "");
        assert!(SessionRecord::from_value(&closed.id, status_value(&old)).is_ok());
    }
}
