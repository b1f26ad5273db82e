//! The session record, kept on the session's anchor Lease (annotation [`names::RECORD`]).
//!
//! The anchor is the authority on a session: its state, generation and incarnation, why it was
//! suspended or closed, what happens to its storage, and the UIDs of the objects it made (the
//! evidence that lets a delete carry a UID precondition). Every change is a compare-and-swap on
//! the Lease's `resourceVersion`, so two brokers never both win a generation.
//!
//! A record read from the API server is untrusted: it must parse, have a known version and name
//! the session whose anchor holds it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use session_runtime::{
    CloseReason, Error, Generation, RetainedUntil, Retention, SessionId, SessionState, SessionStatus,
    StorageState, SuspendReason, WorkerInfo,
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
    /// The profile version (ConfigMap resourceVersion) the current worker was started with.
    pub(crate) profile_version: Option<String>,
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
        }
    }

    /// Reads the record from an anchor's annotations, checking that it is the session's.
    pub(crate) fn from_anchor(
        id: &SessionId,
        annotations: Option<&std::collections::BTreeMap<String, String>>,
    ) -> Result<Self, Error> {
        let unreadable = |why: String| Error::Backend {
            runtime: RUNTIME,
            retryable: false,
            message: format!("session {id}: the anchor's record is unreadable: {why}"),
            source: None,
        };
        let text = annotations
            .and_then(|a| a.get(names::RECORD))
            .ok_or_else(|| unreadable("no record annotation".to_owned()))?;
        let record: SessionRecord =
            serde_json::from_str(text).map_err(|error| unreadable(error.to_string()))?;
        if record.version != VERSION {
            return Err(unreadable(format!("unknown version {}", record.version)));
        }
        if record.id != *id {
            return Err(unreadable(format!("it names session {}", record.id)));
        }
        Ok(record)
    }

    pub(crate) fn to_annotation(&self) -> String {
        // Serializing plain data with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    pub(crate) fn state(&self) -> SessionState {
        match self.phase {
            Phase::Provisioning => SessionState::Created,
            Phase::Session(state) => state,
        }
    }

    pub(crate) fn storage(&self) -> StorageState {
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
                    format!("pod/{}", names::worker(&self.id)),
                    worker.generation,
                    instant(worker.started_at),
                )
            });
        status.storage_refs = self
            .volume
            .claim()
            .map(|claim| vec![format!("persistentvolumeclaim/{claim}")])
            .unwrap_or_default();
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use session_runtime::SessionIdentity;
    use std::collections::BTreeMap;

    fn record() -> SessionRecord {
        let identity = SessionIdentity::new("prod", "claude", "discord", "t").expect("identity");
        SessionRecord::new(identity.id(), "digest".to_owned(), 3, 1)
    }

    fn annotated(text: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(names::RECORD.to_owned(), text.to_owned())])
    }

    #[test]
    fn a_record_round_trips_through_its_annotation() {
        let mut record = record();
        record.phase = Phase::Session(SessionState::Suspended);
        record.volume = Volume::Owned {
            claim: "oab-d-x-1".to_owned(),
            uid: Some("uid".to_owned()),
        };
        let read = SessionRecord::from_anchor(&record.id, Some(&annotated(&record.to_annotation())));
        assert_eq!(read.expect("readable"), record);
    }

    #[test]
    fn a_foreign_or_malformed_record_is_refused() {
        let record = record();
        let other = SessionIdentity::new("prod", "claude", "discord", "u")
            .expect("identity")
            .id();
        let text = record.to_annotation();
        assert!(SessionRecord::from_anchor(&other, Some(&annotated(&text))).is_err());
        assert!(SessionRecord::from_anchor(&record.id, Some(&annotated("{"))).is_err());
        assert!(SessionRecord::from_anchor(&record.id, None).is_err());
        let future = text.replace("\"version\":1", "\"version\":99");
        assert!(SessionRecord::from_anchor(&record.id, Some(&annotated(&future))).is_err());
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
}
